//! The conformance suite on a real `redis-server` (one per test, on a free port).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedisHarness::new());
