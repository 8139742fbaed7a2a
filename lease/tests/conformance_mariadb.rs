//! The conformance suite on a real MariaDB (one server per test, on a free port), in both of the
//! SQL driver's modes.
use leasehold_lease::testkit::MariaDbHarness;

mod lease_mode {
    leasehold_lease::conformance_suite!(super::MariaDbHarness::new());
}

mod row_lock_mode {
    leasehold_lease::conformance_suite!(super::MariaDbHarness::row_lock());
}
