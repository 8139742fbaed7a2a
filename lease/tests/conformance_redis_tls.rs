//! The conformance suite on a real `redis-server` that serves TLS and asks every client for a
//! certificate (`--tls-auth-clients yes`); the drivers connect with
//! `rediss://...?ca=&cert=&key=`.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedisHarness::tls());
