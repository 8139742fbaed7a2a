//! The conformance suite on a real PostgreSQL (one server per test, on a free port), in both of
//! the SQL driver's modes.
use leasehold_lease::testkit::PostgresHarness;

mod lease_mode {
    leasehold_lease::conformance_suite!(super::PostgresHarness::new());
}

mod row_lock_mode {
    leasehold_lease::conformance_suite!(super::PostgresHarness::row_lock());
}
