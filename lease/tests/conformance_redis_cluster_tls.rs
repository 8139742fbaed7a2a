//! The conformance suite on a Redis Cluster of three masters that serve TLS only, ask every
//! client for a certificate and speak TLS on their cluster bus (`rediss+cluster://...?ca=&cert=&key=`):
//! the client follows the slots to the nodes' TLS ports and verifies each node against the CA.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::ServerHarness::<
    leasehold_lease::testkit::TlsRedisCluster,
>::new());
