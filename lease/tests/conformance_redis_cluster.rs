//! The conformance suite on a Redis Cluster of three masters (`redis+cluster://`); an outage is
//! every node killed and restarted on its data.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::ServerHarness::<
    leasehold_lease::testkit::RedisCluster,
>::new());
