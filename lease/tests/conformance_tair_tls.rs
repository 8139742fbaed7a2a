//! The conformance suite on `tairs://`: the TairString module in a `redis-server` that serves
//! TLS and asks every client for a certificate, as managed Tair instances accept only TLS.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedisHarness::tair_tls());
