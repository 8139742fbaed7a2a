//! The conformance suite on a real MariaDB (one server per test, on a free port).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::MariaDbHarness::new());
