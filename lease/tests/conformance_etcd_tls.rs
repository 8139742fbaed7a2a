//! The conformance suite on a real etcd that serves clients over TLS only and asks each for a
//! certificate (`--client-cert-auth`); the drivers connect with `etcds://...?ca=&cert=&key=`.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::EtcdHarness::tls());
