//! The conformance suite on a real MariaDB that takes TCP clients over TLS only
//! (`require_secure_transport`); the drivers connect with
//! `ssl-mode=VERIFY_IDENTITY&ssl-ca=&ssl-cert=&ssl-key=`.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::MariaDbHarness::tls());
