//! The exec safety check on a lock of each kind of backend: three contenders run
//! `leasehold-sidecar exec` over and over while the exec holding the lock is killed or cut off
//! from the backend and the backend restarts; no two of their commands ever run at once, each
//! command's fencing token is above the last one's, and a command runs again within a lease
//! after each fault ([`leasehold_e2e::exec_safety`]). The same through each contender's sidecar
//! (`exec --via`), which is killed, paused and cut off too, on a lock, on a key, and on a key
//! of a read-write family (readers side by side, a writer alone).

use std::time::Duration;

use leasehold_e2e::exec_safety;
use leasehold_e2e::safety::Target;

/// Twenty seconds per backend; `LEASEHOLD_EXEC_SAFETY_SECS` changes it.
fn duration() -> Duration {
    leasehold_e2e::check_duration("LEASEHOLD_EXEC_SAFETY_SECS", 20)
}

fn check(target: Target) {
    check_report(exec_safety::run(target, duration(), rand::random()));
}

/// Each `exec` on a lock of two permits (`--permits 2`): each permit's commands one at a time.
fn check_permits(target: Target) {
    check_report(exec_safety::run_permits(target, duration(), rand::random()));
}

/// Each `exec` through its contender's sidecar (`--via`), whose sidecar is killed, paused and
/// cut off too.
fn check_via(target: Target) {
    check_report(exec_safety::run_via(target, duration(), rand::random()));
}

/// Each `exec` on a key of a family through its contender's sidecar (`--via --keyed`).
fn check_via_keyed(target: Target) {
    check_report(exec_safety::run_via_keyed(
        target,
        duration(),
        rand::random(),
    ));
}

/// Each `exec` reading or writing a key of a read-write family through its contender's
/// sidecar (`--via --keyed --mode read|write`): readers side by side, writers alone.
fn check_via_read_write(target: Target) {
    check_report(exec_safety::run_via_read_write(
        target,
        duration(),
        rand::random(),
    ));
}

fn check_report(report: exec_safety::Report) {
    let summary = format!("{} (seed {})", report.summary(), report.seed);
    leasehold_e2e::assert_safe_under_faults(&summary, &report.violations, &report.faults);
    assert!(
        report.runs >= 5,
        "too few commands ran to mean anything: {}",
        report.summary()
    );
}

#[test]
fn sqlite_exec_commands_never_run_two_at_once() {
    check(Target::Sqlite);
}

#[test]
fn redis_exec_commands_never_run_two_at_once() {
    check(Target::Redis);
}

#[test]
fn postgres_exec_commands_never_run_two_at_once() {
    check(Target::Postgres);
}

#[test]
fn mariadb_row_lock_exec_commands_never_run_two_at_once() {
    check(Target::MariaDbRowLock);
}

#[test]
fn etcd_exec_commands_never_run_two_at_once() {
    check(Target::Etcd);
}

#[test]
fn zookeeper_exec_commands_never_run_two_at_once() {
    check(Target::ZooKeeper);
}

#[test]
fn redis_exec_on_a_lock_of_two_permits_never_runs_two_commands_on_one_permit() {
    check_permits(Target::Redis);
}

#[test]
fn etcd_exec_on_a_lock_of_two_permits_never_runs_two_commands_on_one_permit() {
    check_permits(Target::Etcd);
}

#[test]
fn postgres_exec_on_a_lock_of_two_permits_never_runs_two_commands_on_one_permit() {
    check_permits(Target::Postgres);
}

#[test]
fn redis_exec_via_a_sidecar_commands_never_run_two_at_once() {
    check_via(Target::Redis);
}

#[test]
fn postgres_exec_via_a_sidecar_commands_never_run_two_at_once() {
    check_via(Target::Postgres);
}

#[test]
fn etcd_exec_via_a_sidecar_commands_never_run_two_at_once() {
    check_via(Target::Etcd);
}

#[test]
fn zookeeper_exec_on_a_key_via_a_sidecar_commands_never_run_two_at_once() {
    check_via_keyed(Target::ZooKeeper);
}

#[test]
fn mariadb_exec_on_a_key_via_a_sidecar_commands_never_run_two_at_once() {
    check_via_keyed(Target::MariaDb);
}

#[test]
fn redis_exec_readers_and_writers_via_a_sidecar_never_run_a_writer_beside_another() {
    check_via_read_write(Target::Redis);
}

#[test]
fn postgres_exec_readers_and_writers_via_a_sidecar_never_run_a_writer_beside_another() {
    check_via_read_write(Target::Postgres);
}
