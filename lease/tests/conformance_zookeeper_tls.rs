//! The conformance suite on a real ZooKeeper reached over TLS (its `secureClientPort`, served by
//! Netty), which asks each client for a certificate (`ssl.clientAuth=need`); the drivers connect
//! with `zks://...?ca=&cert=&key=`.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::ZooKeeperHarness::tls());
