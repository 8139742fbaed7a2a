//! The conformance suite on a real ZooKeeper (one server per test, on a free port).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::ZooKeeperHarness::new());
