//! The bounded safety check: for every driver (and SQL mode), three sidecars contend while kills, pauses,
//! backend restarts and partitions are injected at random, and a checker polling every sidecar
//! finds no two holders at once, tokens that only go up, and a holder back after every fault.
//! Beyond process faults: a ZooKeeper ensemble whose followers are cut off from their quorum, a
//! Redis Sentinel set split by a network partition, on-demand waiters that try and hang up, and
//! a `DistributedLock` deleted and edited under its sidecars. `scripts/soak DURATION` runs the same check for longer.

use std::time::Duration;

use leasehold_e2e::safety::{self, Scenario, Target, Workload};

/// About a minute per driver; `LEASEHOLD_SAFETY_SECS` changes it, and `LEASEHOLD_SOAK_SEED`
/// replays a run's fault schedule.
fn duration() -> Duration {
    leasehold_e2e::check_duration("LEASEHOLD_SAFETY_SECS", 50)
}

fn check(target: Target) {
    check_scenario(Scenario::campaign(target));
}

fn check_scenario(scenario: Scenario) {
    check_scenario_for(scenario, duration());
}

fn check_scenario_for(scenario: Scenario, duration: Duration) {
    // As in `scripts/soak`: a failed run's seed (in its summary) replays its fault schedule.
    let seed = std::env::var("LEASEHOLD_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let report = safety::run(scenario, duration, 3, seed);
    leasehold_e2e::assert_safe_under_faults(&report.summary(), &report.violations, &report.faults);
    assert!(
        report.handovers >= 5,
        "only {} hand-overs",
        report.handovers
    );
    if scenario.workload == Workload::Waiters {
        assert!(
            report.try_locks_refused >= 5 && report.hang_ups >= 5,
            "too few try-locks refused ({}) or clients hung up ({}) to mean anything",
            report.try_locks_refused,
            report.hang_ups
        );
    }
}

#[test]
fn sqlite_survives_random_faults() {
    check(Target::Sqlite);
}

#[test]
fn redis_survives_random_faults() {
    check(Target::Redis);
}

#[test]
fn tair_survives_random_faults() {
    check(Target::Tair);
}

#[test]
fn redlock_survives_random_faults() {
    check(Target::Redlock);
}

#[test]
fn postgres_survives_random_faults() {
    check(Target::Postgres);
}

#[test]
fn postgres_row_lock_survives_random_faults() {
    check(Target::PostgresRowLock);
}

#[test]
fn mariadb_survives_random_faults() {
    check(Target::MariaDb);
}

#[test]
fn mariadb_row_lock_survives_random_faults() {
    check(Target::MariaDbRowLock);
}

#[test]
fn etcd_survives_random_faults() {
    check(Target::Etcd);
}

#[test]
fn zookeeper_survives_random_faults() {
    check(Target::ZooKeeper);
}

/// A restart here is a failover: the master killed, the replica promoted, the old master back
/// as a replica.
#[test]
fn redis_sentinel_survives_random_faults_and_failovers() {
    check(Target::RedisSentinel);
}

/// Four servers and three sentinels, each on a test host, as are the sidecars: the master, a
/// replica and one sentinel are split off with a sidecar (the holder every other time) for long
/// enough that the other sentinels fail over, or not. A sidecar that trusted the master its
/// side still reaches would hold beside the far side's new holder. Half as long again as the
/// others, since a split and the failover after it take about a quarter of a minute.
#[test]
fn redis_sentinel_split_by_partitions_never_has_two_holders() {
    check_scenario_for(
        Scenario::campaign(Target::RedisSentinelSplit),
        duration() * 3 / 2,
    );
}

/// Each sidecar serves one of three servers; the holder's, when it follows, is cut off from
/// the leader and the other follower while it goes on answering its clients from stale state.
#[test]
fn zookeeper_ensemble_survives_random_faults_and_isolated_followers() {
    check(Target::ZooKeeperEnsemble);
}

/// On-demand sidecars with workers that wait, try (`wait=0`) and hang up while they wait, on
/// the fair queues where an abandoned place could block the lock, and on Redis's wake-ups.
#[test]
fn etcd_waiters_try_locks_and_hang_ups_survive_random_faults() {
    check_scenario(Scenario::waiters(Target::Etcd));
}

/// With server restarts, as everywhere else: with waiters, a ZooKeeper restart used to leave
/// the lock with no holder now and then, at times for the rest of a 50 s run. The causes found
/// are fixed (the test server called ready before it served; a sidecar's own node, unknown to
/// its driver, first in line for its session's life; one identity's attempts granted the same
/// place twice), and `scripts/soak 10m zookeeper+waiters` ran 74 restarts without a violation.
#[test]
fn zookeeper_waiters_try_locks_and_hang_ups_survive_random_faults() {
    check_scenario(Scenario::waiters(Target::ZooKeeper));
}

/// A Redis Cluster of three masters and their replicas: besides kills, pauses and every node
/// restarted, the lock's slot moves to another master, and its shard fails over to the replica,
/// during holds.
#[test]
fn redis_cluster_survives_random_faults_slot_migrations_and_failovers() {
    check(Target::RedisCluster);
}

#[test]
fn redis_waiters_try_locks_and_hang_ups_survive_random_faults() {
    check_scenario(Scenario::waiters(Target::Redis));
}

/// Sidecars that follow a `DistributedLock` on the in-memory API, with the operator binary
/// reconciling it: the lock is deleted during holds (the operator cleans up its records once
/// the sidecars let go) and created again, its settings and its backend's address are edited,
/// besides kills, pauses and Redis restarts. Tokens must keep rising across every deletion.
#[test]
fn redis_resource_survives_deletion_edits_and_random_faults() {
    check_scenario(Scenario::resource(Target::Redis));
}
