//! The conformance suite on a real PostgreSQL that takes clients over TLS only (`hostssl`,
//! plain text rejected) and asks each for a certificate (`clientcert=verify-ca`); the drivers
//! connect with `sslmode=verify-full&sslrootcert=&sslcert=&sslkey=`.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::PostgresHarness::tls());
