//! The keyed safety check on every driver (and SQL mode): three sidecars, eight workers each,
//! random keys out of fifty, while sidecars are killed, paused and cut off and the backend
//! restarts, while some owners re-enter with shorter holds and some waiters hang up; no key is
//! ever held by two owners at once or by another owner within an answer's `validForMs`, every
//! key's tokens rise, and no worker is refused a key that stayed free while it waited. The same
//! with semaphores (two permits a key), with readers and writers, and with owners taking several
//! keys at once.

use std::time::Duration;

use leasehold_e2e::keyed_safety;
use leasehold_e2e::safety::Target;

/// Half a minute per driver; `LEASEHOLD_KEYED_SAFETY_SECS` changes it.
fn duration() -> Duration {
    leasehold_e2e::check_duration("LEASEHOLD_KEYED_SAFETY_SECS", 30)
}

fn check(target: Target) {
    check_report(keyed_safety::run(target, duration(), rand::random()));
}

/// The same on keys of two permits each: never more than two owners of a key, each permit
/// exclusive with rising tokens.
fn check_semaphore(target: Target) {
    check_report(keyed_safety::run_semaphore(
        target,
        duration(),
        rand::random(),
    ));
}

/// Readers and writers on keys of two permits: never a writer beside another owner, writers'
/// tokens above every earlier holder's, readers as on a semaphore.
fn check_read_write(target: Target) {
    let report = keyed_safety::run_read_write(target, duration(), rand::random());
    assert!(
        report.writes >= 20,
        "only {} writers' holdings: {}",
        report.writes,
        report.summary()
    );
    assert!(
        report.several >= 5,
        "only {} writes of two keys: {}",
        report.several,
        report.summary()
    );
    assert!(
        report.written_again >= 3,
        "only {} write locks acquired again among two keys: {}",
        report.written_again,
        report.summary()
    );
    check_common(report);
}

/// Owners taking two or three keys at once: no key of a refused acquisition left held, and
/// every key checked as above.
fn check_several(target: Target) {
    let report = keyed_safety::run_several(target, duration(), rand::random());
    assert!(
        report.several >= 50,
        "only {} acquisitions of several keys: {}",
        report.several,
        report.summary()
    );
    check_common(report);
}

fn check_report(report: keyed_safety::Report) {
    assert!(
        report.reentries >= 10 && report.hang_ups >= 5,
        "too few re-entrant acquisitions ({}) or clients hung up ({}) to mean anything: {}",
        report.reentries,
        report.hang_ups,
        report.summary()
    );
    check_common(report);
}

fn check_common(report: keyed_safety::Report) {
    leasehold_e2e::assert_safe_under_faults(&report.summary(), &report.violations, &report.faults);
    assert!(
        report.acquisitions >= 100,
        "only {} acquisitions",
        report.acquisitions
    );
}

#[test]
fn sqlite_keys_survive_random_faults() {
    check(Target::Sqlite);
}

#[test]
fn redis_keys_survive_random_faults() {
    check(Target::Redis);
}

#[test]
fn tair_keys_survive_random_faults() {
    check(Target::Tair);
}

#[test]
fn redlock_keys_survive_random_faults() {
    check(Target::Redlock);
}

#[test]
fn postgres_keys_survive_random_faults() {
    check(Target::Postgres);
}

#[test]
fn postgres_row_lock_keys_survive_random_faults() {
    check(Target::PostgresRowLock);
}

#[test]
fn mariadb_keys_survive_random_faults() {
    check(Target::MariaDb);
}

#[test]
fn mariadb_row_lock_keys_survive_random_faults() {
    check(Target::MariaDbRowLock);
}

#[test]
fn etcd_keys_survive_random_faults() {
    check(Target::Etcd);
}

#[test]
fn zookeeper_keys_survive_random_faults() {
    check(Target::ZooKeeper);
}

#[test]
fn redis_semaphore_keys_survive_random_faults() {
    check_semaphore(Target::Redis);
}

#[test]
fn postgres_semaphore_keys_survive_random_faults() {
    check_semaphore(Target::Postgres);
}

#[test]
fn etcd_semaphore_keys_survive_random_faults() {
    check_semaphore(Target::Etcd);
}

#[test]
fn zookeeper_semaphore_keys_survive_random_faults() {
    check_semaphore(Target::ZooKeeper);
}

#[test]
fn redis_keys_taken_several_at_once_survive_random_faults() {
    check_several(Target::Redis);
}

#[test]
fn postgres_keys_taken_several_at_once_survive_random_faults() {
    check_several(Target::Postgres);
}

#[test]
fn etcd_keys_taken_several_at_once_survive_random_faults() {
    check_several(Target::Etcd);
}

#[test]
fn zookeeper_keys_taken_several_at_once_survive_random_faults() {
    check_several(Target::ZooKeeper);
}

#[test]
fn redis_read_write_keys_survive_random_faults() {
    check_read_write(Target::Redis);
}

#[test]
fn postgres_read_write_keys_survive_random_faults() {
    check_read_write(Target::Postgres);
}

#[test]
fn etcd_read_write_keys_survive_random_faults() {
    check_read_write(Target::Etcd);
}

#[test]
fn zookeeper_read_write_keys_survive_random_faults() {
    check_read_write(Target::ZooKeeper);
}
