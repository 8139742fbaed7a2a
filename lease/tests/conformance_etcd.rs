//! The conformance suite on a real etcd (one server per test, on free ports).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::EtcdHarness::new());
