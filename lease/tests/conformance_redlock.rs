//! The conformance suite on Redlock over five real `redis-server` masters (an outage crashes a
//! majority of them).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedlockHarness::new());
