//! The conformance suite on `tair://`: Debian's `redis-server` with the TairString test double
//! (`tairstring-fake`, or `LEASEHOLD_TAIRSTRING_MODULE`), append-only with
//! `appendfsync always`, so the outage scenario's restart keeps the token counter.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedisHarness::tair());
