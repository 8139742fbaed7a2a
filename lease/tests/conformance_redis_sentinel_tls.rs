//! The conformance suite behind Redis Sentinel over TLS everywhere (`rediss+sentinel://`): the
//! sentinel, the master and its replica each ask for a client certificate, replicate and
//! monitor over TLS, and the sentinel asks for its own password (`sentinel-password`).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::ServerHarness::<
    leasehold_lease::testkit::TlsRedisSentinelSet,
>::new());
