//! The conformance suite on Kubernetes Leases, against the in-memory Lease API (no API server
//! can run on these machines; see `testkit::in_memory_api_server`).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::KubernetesHarness::new());
