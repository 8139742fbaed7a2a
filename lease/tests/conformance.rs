//! The conformance suite (`leasehold_testkit::conformance`) on every backend, one module
//! each, in one test binary: `cargo test -p leasehold-lease --test conformance redis_tls` runs
//! one backend's. Every server is real and started per test on free loopback ports, except the
//! Kubernetes API (the in-memory one of `testkit::in_memory_api_server`).

/// The conformance suite on SQLite (a throwaway file per test).
mod sqlite {
    leasehold_testkit::conformance_suite!(leasehold_testkit::SqliteHarness::new());
}

/// The conformance suite on a real `redis-server` (one per test, on a free port).
mod redis {
    leasehold_testkit::conformance_suite!(leasehold_testkit::RedisHarness::new());
}

/// The conformance suite on a real `redis-server` that serves TLS and asks every client for a
/// certificate (`--tls-auth-clients yes`); the drivers connect with
/// `rediss://...?ca=&cert=&key=`.
mod redis_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::RedisHarness::tls());
}

/// The conformance suite on Redis behind Sentinel (`redis+sentinel://`): a master, a replica
/// that confirms every acquisition and renewal (`WAIT 1`), and a sentinel, with a dead sentinel
/// listed first in the URL.
mod redis_sentinel {
    leasehold_testkit::conformance_suite!(leasehold_testkit::RedisSentinelHarness::new());
}

/// The conformance suite behind Redis Sentinel over TLS everywhere (`rediss+sentinel://`): the
/// sentinel, the master and its replica each ask for a client certificate, replicate and
/// monitor over TLS, and the sentinel asks for its own password (`sentinel-password`).
mod redis_sentinel_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::ServerHarness::<
        leasehold_testkit::TlsRedisSentinelSet,
    >::new());
}

/// The conformance suite on a Redis Cluster of three masters (`redis+cluster://`); an outage is
/// every node killed and restarted on its data.
mod redis_cluster {
    leasehold_testkit::conformance_suite!(leasehold_testkit::ServerHarness::<
        leasehold_testkit::RedisCluster,
    >::new());
}

/// The conformance suite on a Redis Cluster of three masters that serve TLS only, ask every
/// client for a certificate and speak TLS on their cluster bus (`rediss+cluster://...?ca=&cert=&key=`):
/// the client follows the slots to the nodes' TLS ports and verifies each node against the CA.
mod redis_cluster_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::ServerHarness::<
        leasehold_testkit::TlsRedisCluster,
    >::new());
}

/// The conformance suite on Redlock over five real `redis-server` masters (an outage crashes a
/// majority of them).
mod redlock {
    leasehold_testkit::conformance_suite!(leasehold_testkit::RedlockHarness::new());
}

/// The conformance suite on `tair://`: Debian's `redis-server` with the TairString test double
/// (`tairstring-fake`, or `LEASEHOLD_TAIRSTRING_MODULE`), append-only with
/// `appendfsync always`, so the outage scenario's restart keeps the token counter.
mod tair {
    leasehold_testkit::conformance_suite!(leasehold_testkit::RedisHarness::tair());
}

/// The conformance suite on `tairs://`: the TairString module in a `redis-server` that serves
/// TLS and asks every client for a certificate, as managed Tair instances accept only TLS.
mod tair_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::RedisHarness::tair_tls());
}

/// The conformance suite on a real PostgreSQL (one server per test, on a free port), in both of
/// the SQL driver's modes.
mod postgres {
    mod lease_mode {
        leasehold_testkit::conformance_suite!(leasehold_testkit::PostgresHarness::new());
    }

    mod row_lock_mode {
        leasehold_testkit::conformance_suite!(leasehold_testkit::PostgresHarness::row_lock());
    }
}

/// The conformance suite on a real PostgreSQL that takes clients over TLS only (`hostssl`,
/// plain text rejected) and asks each for a certificate (`clientcert=verify-ca`); the drivers
/// connect with `sslmode=verify-full&sslrootcert=&sslcert=&sslkey=`.
mod postgres_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::PostgresHarness::tls());
}

/// The conformance suite on a real MariaDB (one server per test, on a free port), in both of the
/// SQL driver's modes.
mod mariadb {
    mod lease_mode {
        leasehold_testkit::conformance_suite!(leasehold_testkit::MariaDbHarness::new());
    }

    mod row_lock_mode {
        leasehold_testkit::conformance_suite!(leasehold_testkit::MariaDbHarness::row_lock());
    }
}

/// The conformance suite on a real MariaDB that takes TCP clients over TLS only
/// (`require_secure_transport`); the drivers connect with
/// `ssl-mode=VERIFY_IDENTITY&ssl-ca=&ssl-cert=&ssl-key=`.
mod mariadb_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::MariaDbHarness::tls());
}

/// The conformance suite on a real etcd (one server per test, on free ports).
mod etcd {
    leasehold_testkit::conformance_suite!(leasehold_testkit::EtcdHarness::new());
}

/// The conformance suite on a real etcd that serves clients over TLS only and asks each for a
/// certificate (`--client-cert-auth`); the drivers connect with `etcds://...?ca=&cert=&key=`.
mod etcd_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::EtcdHarness::tls());
}

/// The conformance suite on a real ZooKeeper (one server per test, on a free port).
mod zookeeper {
    leasehold_testkit::conformance_suite!(leasehold_testkit::ZooKeeperHarness::new());
}

/// The conformance suite on a real ZooKeeper reached over TLS (its `secureClientPort`, served by
/// Netty), which asks each client for a certificate (`ssl.clientAuth=need`); the drivers connect
/// with `zks://...?ca=&cert=&key=`.
mod zookeeper_tls {
    leasehold_testkit::conformance_suite!(leasehold_testkit::ZooKeeperHarness::tls());
}

/// The conformance suite on Kubernetes Leases, against the in-memory Lease API (no API server
/// can run on these machines; see `testkit::in_memory_api_server`).
mod kubernetes {
    leasehold_testkit::conformance_suite!(leasehold_testkit::KubernetesHarness::new());
}
