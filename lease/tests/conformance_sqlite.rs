//! The conformance suite on SQLite (a throwaway file per test).
leasehold_lease::conformance_suite!(leasehold_lease::testkit::SqliteHarness::new());
