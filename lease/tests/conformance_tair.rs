//! The conformance suite on `tair://`: Debian's `redis-server` with the TairString module
//! (built from `../shared/vendor/TairString`), append-only with `appendfsync always`, so the
//! outage scenario's restart keeps the token counter.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedisHarness::tair());
