//! The multi-process safety check: several real sidecars contend for one lock on a real backend
//! while faults are injected at random, and a checker polls every sidecar's `/lock` many times a
//! second, recording on one clock who claimed to hold, when, and with which token.
//!
//! Faults: SIGKILL of the holder (then a new process in its place), SIGSTOP of the holder for
//! longer than the lease (then SIGCONT), a crash and restart of the backend, a partition of
//! the holder from the backend (a [`FaultProxy`] per sidecar and endpoint), and on a
//! three-server ZooKeeper ensemble a follower cut off from its quorum while it goes on serving;
//! on Tair's failover target, a standby promoted behind the primary's address while the
//! primary still serves; on Redis Sentinel spread over test hosts, the master split off with a
//! replica and one sentinel while the other sentinels fail over.
//!
//! Two workloads: every sidecar campaigns ([`Workload::Campaign`]), or the sidecars run
//! on-demand and workers beside each take and release the lock ([`Workload::Waiters`]), some
//! blocking, some with try-locks (`wait=0`), some hanging up while they wait. The second also
//! fails when a sidecar holds the lock for nobody (a token that no worker of it was given), and
//! when a blocking waiter is refused although, with no fault near, the lock stayed free for
//! longer than a hand-over takes.
//!
//! It fails when two sidecars' claims certainly overlap, when a token does not increase from one
//! holder to the next (or two sidecars claim one token), or when no holder appears within
//! leaseDuration + renewInterval (plus a slack for a loaded machine) after a fault ends.
//!
//! "Certainly" is exact, not statistical: a 200 answer means the sidecar claimed at some instant
//! between sending the request and receiving the answer, and one process claims one token over
//! one contiguous span. So a token's claim surely covers [first answer received, last request
//! sent]; two of those spans that intersect are two holders at once. The polling resolution
//! (how long a request takes, how often each sidecar is asked) is reported alongside.
//!
//! It also fails when an answer's promise is broken: a 200's `validForMs`, measured by the
//! sidecar after the request was sent, tells the pod's apps they may act on the lock until the
//! request's sending plus `validForMs`, unless one of them gives the holding up first (a
//! release, a client hanging up once granted). Another holding (another sidecar's, or a later
//! token of the same sidecar) that surely held within that promise (over its certain span, or
//! at some instant of a request's window that lies wholly inside it) is two processes acting
//! on the lock at once, whatever the first sidecar claimed by then.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_testkit::{
    EtcdServer, MariaDbServer, PostgresServer, RedisCluster, RedisSentinelHosts, RedisSentinelSet,
    RedisServer, TairPair, ZooKeeperEnsemble, ZooKeeperServer,
};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cluster::Cluster;
use crate::fault_proxy::FaultProxy;
use crate::{Placement, Sidecar, http, post_or_hang_up, unique_lock};

pub const LEASE: Duration = Duration::from_secs(1);
pub const RENEW: Duration = Duration::from_millis(250);
pub(crate) const TIMING: &[&str] = &["--lease-duration", "1s", "--renew-interval", "250ms"];
/// On top of lease + renew interval, for a 2-core machine running servers, sidecars and checker.
pub const RECOVERY_SLACK: Duration = Duration::from_millis(1500);
/// How long a fault lasts: longer than the lease, so that it always forces a hand-over.
pub(crate) const FAULT_LENGTH: Duration = Duration::from_millis(1500);
/// How long a ZooKeeper follower stays cut off from its quorum: long enough for its clients'
/// sessions to expire on the leader, well within the ensemble's sync limit (5 s), so it serves
/// stale reads throughout.
const FOLLOWER_CUT: Duration = Duration::from_millis(3000);
/// How long an isolated follower may take to follow again once healed.
const FOLLOWER_REJOIN: Duration = Duration::from_secs(20);
/// How long a split of a Sentinel set lasts, in turn: well past the sentinels' failover (down
/// after 2.5 s, then an election and a promotion), so that both sides have a master for
/// seconds; and short of it, so that the master's side alone has one.
const SPLIT_LENGTHS: [Duration; 2] = [Duration::from_secs(10), Duration::from_secs(1)];
/// Test hosts for sidecars on a network of test hosts: `sidecar-0` and on.
const SIDECAR_HOSTS: usize = 6;
pub(crate) const CALM_MIN_MS: u64 = 300;
pub(crate) const CALM_MAX_MS: u64 = 1200;
const POLL_PAUSE: Duration = Duration::from_millis(3);
const POLL_TIMEOUT: Duration = Duration::from_millis(300);
/// The longest a restart may take before the check calls it hung. A restarted MariaDB replays
/// its redo log first; a Sentinel set's restart is a failover whose rejoined replica the
/// sentinels see healthy only at their next look (every 10 s), and a loaded machine took 37 s.
const BACKEND_READY: Duration = Duration::from_secs(90);

/// The backends (and SQL modes) the check runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Sqlite,
    Redis,
    Redlock,
    Postgres,
    PostgresRowLock,
    MariaDb,
    MariaDbRowLock,
    Etcd,
    ZooKeeper,
    Tair,
    /// Tair as a primary and a standby behind one address, failing over and back.
    TairFailover,
    RedisSentinel,
    /// Redis Sentinel with four servers and three sentinels, each on a test host of its own
    /// (as are the sidecars), split by partitions.
    RedisSentinelSplit,
    /// Three ZooKeeper servers, each sidecar connected to one of them.
    ZooKeeperEnsemble,
    /// A Redis Cluster of three masters and their replicas: lock slots move between the masters,
    /// and shards fail over.
    RedisCluster,
}

impl Target {
    pub const ALL: [Target; 15] = [
        Target::Sqlite,
        Target::Redis,
        Target::Redlock,
        Target::Postgres,
        Target::PostgresRowLock,
        Target::MariaDb,
        Target::MariaDbRowLock,
        Target::Etcd,
        Target::ZooKeeper,
        Target::Tair,
        Target::TairFailover,
        Target::RedisSentinel,
        Target::RedisSentinelSplit,
        Target::ZooKeeperEnsemble,
        Target::RedisCluster,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Sqlite => "sqlite",
            Target::Redis => "redis",
            Target::Redlock => "redlock",
            Target::Postgres => "postgres",
            Target::PostgresRowLock => "postgres-row-lock",
            Target::MariaDb => "mariadb",
            Target::MariaDbRowLock => "mariadb-row-lock",
            Target::Etcd => "etcd",
            Target::ZooKeeper => "zookeeper",
            Target::Tair => "tair",
            Target::TairFailover => "tair-failover",
            Target::RedisSentinel => "redis-sentinel",
            Target::RedisSentinelSplit => "redis-sentinel-split",
            Target::ZooKeeperEnsemble => "zookeeper-ensemble",
            Target::RedisCluster => "redis-cluster",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// What the sidecars of a run are asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// Every sidecar campaigns: someone always holds the lock.
    Campaign,
    /// On-demand sidecars, each with [`WAITERS_PER_SIDECAR`] workers that take the lock and
    /// give it back: blocking waits, try-locks and clients that hang up while they wait, mixed.
    Waiters,
    /// Campaigning sidecars that follow a `DistributedLock` (`--resource`) on the in-memory
    /// API, with the operator binary reconciling it; the lock is deleted (its records cleaned
    /// up by the operator) and created again, and edited, among the faults.
    Resource,
    /// On-demand sidecars of one keyed family, workers taking random keys as per-request
    /// owners, re-entering with shorter holds and hanging up while they wait: the check of
    /// [`crate::keyed_safety`].
    Keyed,
    /// The keyed check on a family whose keys have two permits each
    /// ([`crate::keyed_safety::run_semaphore`]).
    Semaphore,
    /// The keyed check with readers and writers (`mode=read|write`) on keys of two permits
    /// ([`crate::keyed_safety::run_read_write`]).
    ReadWrite,
    /// The keyed check with owners taking two or three keys at once, all or nothing
    /// ([`crate::keyed_safety::run_several`]).
    Several,
    /// `leasehold-sidecar exec` run over and over by each contender, its commands checked
    /// rather than the lock ([`crate::exec_safety`]).
    Exec,
    /// The same on a lock of two permits (`exec --permits 2`), each permit checked as a lock
    /// ([`crate::exec_safety::run_permits`]).
    ExecPermits,
    /// The same with each `exec` holding through its contender's sidecar (`--via`), which is
    /// killed, paused and cut off too ([`crate::exec_safety::run_via`]).
    ExecVia,
    /// The same on a key of a family (`exec --via --keyed`,
    /// [`crate::exec_safety::run_via_keyed`]).
    ExecViaKeyed,
    /// The same on a key of a read-write family, each exec a reader or the writer
    /// ([`crate::exec_safety::run_via_read_write`]).
    ExecViaReadWrite,
}

impl Workload {
    pub const ALL: [Workload; 12] = [
        Workload::Campaign,
        Workload::Waiters,
        Workload::Resource,
        Workload::Keyed,
        Workload::Semaphore,
        Workload::ReadWrite,
        Workload::Several,
        Workload::Exec,
        Workload::ExecPermits,
        Workload::ExecVia,
        Workload::ExecViaKeyed,
        Workload::ExecViaReadWrite,
    ];

    /// The suffix of a scenario's name: `etcd`, `etcd+waiters`.
    fn suffix(self) -> &'static str {
        match self {
            Workload::Campaign => "",
            Workload::Waiters => "+waiters",
            Workload::Resource => "+resource",
            Workload::Keyed => "+keyed",
            Workload::Semaphore => "+semaphore",
            Workload::ReadWrite => "+read-write",
            Workload::Several => "+several",
            Workload::Exec => "+exec",
            Workload::ExecPermits => "+exec-permits",
            Workload::ExecVia => "+exec-via",
            Workload::ExecViaKeyed => "+exec-via-keyed",
            Workload::ExecViaReadWrite => "+exec-via-read-write",
        }
    }
}

/// A backend and a workload: what one run of the check exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenario {
    pub target: Target,
    pub workload: Workload,
}

impl Scenario {
    pub const fn campaign(target: Target) -> Self {
        Self {
            target,
            workload: Workload::Campaign,
        }
    }

    pub const fn waiters(target: Target) -> Self {
        Self {
            target,
            workload: Workload::Waiters,
        }
    }

    /// What `scripts/soak DURATION` runs when it is given no names: every driver campaigning,
    /// waiters and keyed owners where their faults live (the fair queues of etcd and ZooKeeper,
    /// which try-locks and hung-up clients could leave places in; Redis's pub/sub wake-ups).
    pub fn soak_default() -> Vec<Self> {
        let mut all: Vec<Self> = Target::ALL.into_iter().map(Self::campaign).collect();
        let queues = [Target::Etcd, Target::ZooKeeper, Target::Redis];
        all.extend(queues.map(Self::waiters));
        all.extend(queues.map(|target| Self {
            target,
            workload: Workload::Keyed,
        }));
        all.push(Self::resource(Target::Redis));
        all
    }

    pub const fn resource(target: Target) -> Self {
        Self {
            target,
            workload: Workload::Resource,
        }
    }

    /// Every scenario the check can run: a resource needs a backend a `DistributedLock` here
    /// can name, and exec runs on this machine, not on test hosts.
    pub fn all() -> impl Iterator<Item = Self> {
        Target::ALL.into_iter().flat_map(|target| {
            Workload::ALL
                .into_iter()
                .map(move |workload| Self { target, workload })
                .filter(|s| s.workload != Workload::Resource || s.target == Target::Redis)
                .filter(|s| {
                    !matches!(
                        s.workload,
                        Workload::Exec
                            | Workload::ExecPermits
                            | Workload::ExecVia
                            | Workload::ExecViaKeyed
                            | Workload::ExecViaReadWrite
                    ) || s.target != Target::RedisSentinelSplit
                })
        })
    }

    pub fn name(self) -> String {
        format!("{}{}", self.target.name(), self.workload.suffix())
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::all().find(|s| s.name() == name)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    KillHolder,
    PauseHolder,
    RestartBackend,
    PartitionHolder,
    /// A ZooKeeper follower (the holder's, when it is one) cut off from the leader and the
    /// other follower, while its clients still reach it.
    IsolateFollower,
    /// The `DistributedLock` (`cleanupPolicy: Delete`) deleted during a hold: the operator
    /// cleans up its records once the sidecars have let go, then it is created again.
    DeleteLock,
    /// Its renew interval edited: every sidecar swaps in a lock with the new settings.
    EditSettings,
    /// Its backend edited (another address of the same server), which the CRD's rule refuses
    /// and the fake API lets through: every sidecar steps down before campaigning anew.
    EditBackend,
    /// The hash slot of a lock's keys moved, keys and all, to another master of a Redis
    /// Cluster (`redis-cli --cluster reshard`'s commands), held or not.
    MigrateSlot,
    /// The shard that serves a lock's slot failed over to its replica (`CLUSTER FAILOVER`).
    FailOverShard,
    /// A Tair standby promoted behind the primary's address while the primary serves one
    /// renew interval longer (what it takes then is lost), the old primary following it; the
    /// next one is the failback.
    PromoteStandby,
    /// A Sentinel set split: the master, a replica and one sentinel (with the holder, every
    /// other time) cut off from the rest, whose sentinels fail over if it lasts long enough.
    SplitSentinels,
}

/// The faults of a resource scenario: no partition, since every sidecar reads one address.
const RESOURCE_FAULTS: &[Fault] = &[
    Fault::KillHolder,
    Fault::PauseHolder,
    Fault::RestartBackend,
    Fault::DeleteLock,
    Fault::EditSettings,
    Fault::EditBackend,
];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::KillHolder => "kill",
            Fault::PauseHolder => "pause",
            Fault::RestartBackend => "restart",
            Fault::PartitionHolder => "partition",
            Fault::IsolateFollower => "isolate-follower",
            Fault::DeleteLock => "delete-recreate",
            Fault::EditSettings => "edit-settings",
            Fault::EditBackend => "edit-backend",
            Fault::MigrateSlot => "migrate-slot",
            Fault::FailOverShard => "failover",
            Fault::PromoteStandby => "promote-standby",
            Fault::SplitSentinels => "split",
        }
    }
}

/// The backend under test, and how to reach it through a sidecar's own proxies.
pub(crate) enum Backend {
    Sqlite(tempfile::TempDir),
    Redis(RedisServer),
    /// Redis with the TairString module, reached as `tair://`.
    Tair(RedisServer),
    /// The same as a primary and its standby behind one address; a restart is the primary's.
    TairFailover(TairPair),
    Redlock(Vec<RedisServer>),
    Postgres(PostgresServer, &'static str),
    MariaDb(MariaDbServer, &'static str),
    Etcd(EtcdServer),
    ZooKeeper(ZooKeeperServer),
    /// A master, a replica and a sentinel; a restart is a failover.
    RedisSentinel(RedisSentinelSet),
    /// Four servers and three sentinels on test hosts, and how many splits it has been through.
    RedisSentinelSplit(RedisSentinelHosts, usize),
    /// Three servers; sidecar `i` is connected to server `i % 3` only, so that cutting a
    /// follower off cuts off the sidecars it serves, and nothing else.
    ZooKeeperEnsemble(ZooKeeperEnsemble),
    /// Three masters and a replica of each; a restart is every node killed and started again
    /// on its data.
    RedisCluster(RedisCluster),
}

impl Backend {
    pub(crate) fn start(target: Target) -> Self {
        match target {
            Target::Sqlite => Backend::Sqlite(tempfile::tempdir().expect("temp dir")),
            Target::Redis => Backend::Redis(RedisServer::start()),
            Target::Redlock => Backend::Redlock((0..5).map(|_| RedisServer::start()).collect()),
            Target::Postgres => Backend::Postgres(PostgresServer::start(), ""),
            Target::PostgresRowLock => Backend::Postgres(PostgresServer::start(), "?mode=row-lock"),
            Target::MariaDb => Backend::MariaDb(MariaDbServer::start(), ""),
            Target::MariaDbRowLock => Backend::MariaDb(MariaDbServer::start(), "?mode=row-lock"),
            Target::Etcd => Backend::Etcd(EtcdServer::start()),
            Target::ZooKeeper => Backend::ZooKeeper(ZooKeeperServer::start()),
            Target::Tair => Backend::Tair(RedisServer::start_tair()),
            Target::TairFailover => Backend::TairFailover(TairPair::start()),
            Target::RedisSentinel => Backend::RedisSentinel(RedisSentinelSet::start()),
            Target::RedisSentinelSplit => {
                let sidecars: Vec<String> =
                    (0..SIDECAR_HOSTS).map(|i| format!("sidecar-{i}")).collect();
                Backend::RedisSentinelSplit(RedisSentinelHosts::start(&sidecars), 0)
            }
            Target::ZooKeeperEnsemble => Backend::ZooKeeperEnsemble(ZooKeeperEnsemble::start()),
            Target::RedisCluster => Backend::RedisCluster(RedisCluster::start_with_replicas()),
        }
    }

    pub(crate) fn ports(&self) -> Vec<u16> {
        match self {
            // The sentinels name the master's own address, past any proxy of ours; so do the
            // nodes of a cluster, for every slot.
            // A split's sidecars are on test hosts, cut off by the network itself.
            Backend::Sqlite(_)
            | Backend::RedisSentinel(_)
            | Backend::RedisSentinelSplit(..)
            | Backend::RedisCluster(_) => Vec::new(),
            Backend::Redis(s) | Backend::Tair(s) => vec![s.port()],
            Backend::TairFailover(pair) => vec![pair.port()],
            Backend::Redlock(masters) => masters.iter().map(RedisServer::port).collect(),
            Backend::Postgres(s, _) => vec![s.port()],
            Backend::MariaDb(s, _) => vec![s.port()],
            Backend::Etcd(s) => vec![s.port()],
            Backend::ZooKeeper(s) => vec![s.port()],
            Backend::ZooKeeperEnsemble(e) => (0..3).map(|m| e.client_port(m)).collect(),
        }
    }

    /// Sidecar `index`'s `--backend` URL, each endpoint replaced by the matching proxy port.
    pub(crate) fn url_via(&self, index: usize, proxies: &[u16]) -> String {
        let swap = |url: String, port: u16, proxy: u16| {
            url.replace(&format!("127.0.0.1:{port}"), &format!("127.0.0.1:{proxy}"))
        };
        match self {
            Backend::Sqlite(dir) => format!("sqlite://{}", dir.path().join("locks.db").display()),
            Backend::Redis(s) | Backend::Tair(s) => swap(s.url(), s.port(), proxies[0]),
            Backend::TairFailover(pair) => swap(pair.url(), pair.port(), proxies[0]),
            Backend::Redlock(_) => {
                let hosts: Vec<String> = proxies.iter().map(|p| format!("127.0.0.1:{p}")).collect();
                format!("redlock://{}", hosts.join(","))
            }
            Backend::Postgres(s, mode) => swap(s.url(), s.port(), proxies[0]) + mode,
            Backend::MariaDb(s, mode) => swap(s.url(), s.port(), proxies[0]) + mode,
            Backend::Etcd(s) => swap(s.url(), s.port(), proxies[0]),
            Backend::ZooKeeper(s) => swap(s.url(), s.port(), proxies[0]),
            Backend::RedisSentinel(set) => set.url(),
            Backend::RedisSentinelSplit(set, _) => set.url(),
            Backend::RedisCluster(cluster) => cluster.url(),
            Backend::ZooKeeperEnsemble(e) => {
                let member = index % 3;
                swap(e.url(&[member]), e.client_port(member), proxies[member])
            }
        }
    }

    pub(crate) fn faults(&self) -> &'static [Fault] {
        match self {
            // One file, no network, no server: what can fail is the process.
            Backend::Sqlite(_) => &[Fault::KillHolder, Fault::PauseHolder],
            // A restart is a failover; a partition from the master cannot be placed (see ports).
            Backend::RedisSentinel(_) => {
                &[Fault::KillHolder, Fault::PauseHolder, Fault::RestartBackend]
            }
            // No partition, for the same reason; the lock's slot moves, or its shard fails
            // over, instead.
            Backend::RedisCluster(_) => &[
                Fault::KillHolder,
                Fault::PauseHolder,
                Fault::RestartBackend,
                Fault::MigrateSlot,
                Fault::FailOverShard,
            ],
            // A restart is the plain Sentinel target's; here the network fails instead.
            Backend::RedisSentinelSplit(..) => &[
                Fault::KillHolder,
                Fault::PauseHolder,
                Fault::PartitionHolder,
                Fault::SplitSentinels,
            ],
            Backend::TairFailover(_) => &[
                Fault::KillHolder,
                Fault::PauseHolder,
                Fault::RestartBackend,
                Fault::PartitionHolder,
                Fault::PromoteStandby,
            ],
            // A restart of a server is the single-server target's; here a server stays up
            // and loses its quorum.
            Backend::ZooKeeperEnsemble(_) => &[
                Fault::KillHolder,
                Fault::PauseHolder,
                Fault::PartitionHolder,
                Fault::IsolateFollower,
            ],
            _ => &[
                Fault::KillHolder,
                Fault::PauseHolder,
                Fault::RestartBackend,
                Fault::PartitionHolder,
            ],
        }
    }

    /// Crash the backend and start it again on the same data.
    pub(crate) fn restart(&mut self) {
        match self {
            Backend::Sqlite(_) => {}
            Backend::Redis(s) | Backend::Tair(s) => s.restart(),
            Backend::TairFailover(pair) => pair.restart_primary(),
            Backend::Redlock(masters) => masters.iter_mut().for_each(RedisServer::restart),
            Backend::Postgres(s, _) => s.restart(),
            Backend::MariaDb(s, _) => s.restart(),
            Backend::Etcd(s) => s.restart(),
            Backend::ZooKeeper(s) => s.restart(),
            Backend::RedisSentinel(set) => {
                set.fail_over_and_rejoin();
            }
            Backend::RedisCluster(cluster) => cluster.restart(),
            Backend::ZooKeeperEnsemble(_) | Backend::RedisSentinelSplit(..) => {
                unreachable!("this target's faults name no restart")
            }
        }
    }

    /// Where sidecar `index` runs: on its test host when the backend is on a network.
    pub(crate) fn placement(&self, index: usize) -> Placement {
        match self {
            Backend::RedisSentinelSplit(set, _) => {
                assert!(index < SIDECAR_HOSTS, "no test host for sidecar {index}");
                Placement::On(set.network().clone(), format!("sidecar-{index}"))
            }
            _ => Placement::Here,
        }
    }

    /// Cut sidecar `index` off from the backend for [`FAULT_LENGTH`]: through its proxies, or
    /// on the network.
    fn partition(&self, index: usize, proxies: &[FaultProxy]) {
        match self {
            Backend::RedisSentinelSplit(set, _) => {
                set.isolate(&format!("sidecar-{index}"), FAULT_LENGTH);
            }
            _ => {
                proxies.iter().for_each(FaultProxy::cut);
                std::thread::sleep(FAULT_LENGTH);
                proxies.iter().for_each(FaultProxy::restore);
            }
        }
    }

    /// Inject `fault`, one that acts on the backend or on contender `index`'s links to it
    /// (`proxies`), and end it.
    pub(crate) fn inject(&mut self, fault: Fault, index: usize, proxies: &[FaultProxy]) {
        match fault {
            Fault::RestartBackend => {
                let restarting = Instant::now();
                self.restart();
                assert!(
                    restarting.elapsed() < BACKEND_READY,
                    "the backend took {:?} to restart",
                    restarting.elapsed()
                );
            }
            Fault::PartitionHolder => self.partition(index, proxies),
            Fault::SplitSentinels => self.split_sentinels(index),
            Fault::IsolateFollower => self.isolate_follower(index),
            Fault::MigrateSlot => self.migrate_a_lock_slot(),
            Fault::FailOverShard => self.fail_over_a_lock_shard(),
            Fault::PromoteStandby => self.promote_standby(),
            Fault::KillHolder | Fault::PauseHolder => {
                unreachable!("{} acts on a contender's process", fault.name())
            }
            Fault::DeleteLock | Fault::EditSettings | Fault::EditBackend => {
                unreachable!("{} acts on the resource (edit_resource)", fault.name())
            }
        }
    }

    /// Split the Sentinel set, with sidecar `near` (the holder) on the master's side, then
    /// another sidecar there and the holder on the far side, for each of [`SPLIT_LENGTHS`];
    /// settled again before it returns. Either way a sidecar sits beside the old master while
    /// the far side's sentinels may promote another.
    fn split_sentinels(&mut self, near: usize) {
        let Backend::RedisSentinelSplit(set, splits) = self else {
            unreachable!("only a Sentinel set on test hosts can be split")
        };
        let beside = if *splits % 2 == 0 {
            near
        } else {
            (near + 1) % 3
        };
        let beside = format!("sidecar-{beside}");
        let with_master: &[&str] = &[&beside];
        let length = SPLIT_LENGTHS[(*splits / 2) % SPLIT_LENGTHS.len()];
        *splits += 1;
        set.split(with_master, length);
    }

    /// Fail a Tair pair over (or back), the old primary serving one renew interval longer.
    fn promote_standby(&mut self) {
        let Backend::TairFailover(pair) = self else {
            unreachable!("only the Tair failover target has a standby to promote")
        };
        pair.fail_over(RENEW);
    }

    /// Move the slot of a lock (or a key of a family) stored in the cluster to the next master.
    fn migrate_a_lock_slot(&self) {
        let Backend::RedisCluster(cluster) = self else {
            unreachable!("only a Redis Cluster has slots to move")
        };
        if let Some(&slot) = cluster.lock_slots().first() {
            let mut masters = cluster.masters();
            masters.sort_unstable();
            let owner = cluster.owner_of(slot);
            let next = masters
                .iter()
                .copied()
                .find(|&m| m > owner)
                .or(masters.first().copied())
                .filter(|&m| m != owner);
            if let Some(next) = next {
                cluster.migrate_slot(slot, next);
            }
        }
    }

    /// Fail over the shard that serves a lock's slot to its replica.
    fn fail_over_a_lock_shard(&self) {
        let Backend::RedisCluster(cluster) = self else {
            unreachable!("only a Redis Cluster has shards to fail over")
        };
        if let Some(&slot) = cluster.lock_slots().first() {
            cluster.fail_over_shard(slot);
        }
    }

    /// The `DistributedLock` spec of a lock on this backend, reached at `port`.
    fn resource_spec(&self, port: u16) -> serde_json::Value {
        let Backend::Redis(_) = self else {
            unreachable!("resource scenarios run on Redis")
        };
        serde_json::json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{port}")]}},
            "leaseDuration": "1s", "renewInterval": "250ms", "cleanupPolicy": "Delete",
        })
    }

    /// Cut a follower off from its quorum for [`FOLLOWER_CUT`] (sidecar `near`'s server when
    /// it follows, else another follower), then heal it and wait until it follows again.
    fn isolate_follower(&self, near: usize) {
        let Backend::ZooKeeperEnsemble(ensemble) = self else {
            unreachable!("only an ensemble has followers to isolate")
        };
        let followers = ensemble.followers();
        let Some(&member) = followers
            .iter()
            .find(|&&f| f == near % 3)
            .or(followers.first())
        else {
            return;
        };
        ensemble.isolate(member);
        std::thread::sleep(FOLLOWER_CUT);
        assert!(
            ensemble.rejoin(member, FOLLOWER_REJOIN),
            "server {member} did not follow again within {FOLLOWER_REJOIN:?} of healing (modes {:?}); logs:\n{}",
            ensemble.modes(),
            ensemble.logs()
        );
    }
}

/// One contender: a sidecar process, replaced after a kill, and its links to the backend.
pub(crate) struct Slot {
    pub(crate) index: usize,
    pub(crate) identity: String,
    pub(crate) generation: u32,
    pub(crate) sidecar: Sidecar,
    pub(crate) proxies: Vec<FaultProxy>,
    pub(crate) placement: Placement,
    /// Where the checker asks; swapped when the process is replaced.
    pub(crate) addr: Arc<Mutex<(SocketAddr, u32)>>,
}

impl Slot {
    pub(crate) fn url(&self, backend: &Backend) -> String {
        let ports: Vec<u16> = self.proxies.iter().map(|p| p.port).collect();
        backend.url_via(self.index, &ports)
    }

    /// Sidecar `index` of a run, with its own proxy to each of the backend's endpoints.
    pub(crate) fn start(
        index: usize,
        identity: String,
        backend: &Backend,
        start_sidecar: &StartSidecar,
    ) -> Self {
        let proxies: Vec<FaultProxy> = backend.ports().into_iter().map(FaultProxy::start).collect();
        let ports: Vec<u16> = proxies.iter().map(|p| p.port).collect();
        let placement = backend.placement(index);
        let sidecar = start_sidecar(&placement, &identity, &backend.url_via(index, &ports));
        let addr = Arc::new(Mutex::new((sidecar.addr, 0)));
        Slot {
            index,
            identity,
            generation: 0,
            sidecar,
            proxies,
            placement,
            addr,
        }
    }
}

/// Starts a sidecar process: (where, identity, `--backend` URL).
pub(crate) type StartSidecar<'a> = dyn Fn(&Placement, &str, &str) -> Sidecar + 'a;

/// `kill 3, pause 2`: how many faults of each kind a run injected, for its summary.
pub(crate) fn fault_counts(faults: &BTreeMap<&'static str, usize>) -> String {
    let counts: Vec<String> = faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
    counts.join(", ")
}

/// One answer from one sidecar.
#[derive(Debug, Clone, Copy)]
struct Sample {
    slot: usize,
    generation: u32,
    sent: Instant,
    received: Instant,
    /// The fencing token of a 200 answer.
    token: Option<u64>,
    /// The `validForMs` of a 200 answer.
    valid_for: Duration,
}

/// The figures of one run.
#[derive(Debug, Default)]
pub struct Report {
    pub target: String,
    pub duration: Duration,
    pub seed: u64,
    pub samples: usize,
    pub handovers: usize,
    /// With waiters: acquisitions answered 200, try-locks answered 409, clients that hung up.
    pub acquisitions: usize,
    pub try_locks_refused: usize,
    pub hang_ups: usize,
    pub faults: BTreeMap<&'static str, usize>,
    pub violations: Vec<String>,
    pub longest_without_holder: Duration,
    pub slowest_recovery: Duration,
    /// The median time between two answers of one sidecar, and the longest request.
    pub poll_interval: Duration,
    pub longest_request: Duration,
}

impl Report {
    pub fn overlaps(&self) -> usize {
        self.violations
            .iter()
            .filter(|v| v.starts_with("overlap"))
            .count()
    }

    pub fn summary(&self) -> String {
        format!(
            "{:<18} {:>5.0}s  hand-overs {:>4}  faults {:>3} ({})  overlaps {}  violations {}  \
             longest without holder {:>5} ms  slowest recovery {:>5} ms  poll every {:.1?} (request ≤ {:.0?})  seed {}",
            self.target,
            self.duration.as_secs_f64(),
            self.handovers,
            self.faults.values().sum::<usize>(),
            fault_counts(&self.faults),
            self.overlaps(),
            self.violations.len(),
            self.longest_without_holder.as_millis(),
            self.slowest_recovery.as_millis(),
            self.poll_interval,
            self.longest_request,
            self.seed,
        ) + &if self.acquisitions > 0 {
            format!(
                "  waiters: acquisitions {}, try-locks refused {}, hung up {}",
                self.acquisitions, self.try_locks_refused, self.hang_ups
            )
        } else {
            String::new()
        }
    }
}

/// What a 200 answer claims: its fencing token and `validForMs`.
#[derive(Debug, Clone, Copy)]
struct Claim {
    token: u64,
    valid_for: Duration,
}

impl Claim {
    /// The claim of a 200 answer's body. One that names no token or validity cannot be
    /// checked, and panics the thread that read it (which fails the run).
    fn of(answer: &serde_json::Value) -> Self {
        let (Some(token), Some(valid_for)) = (
            answer["fencingToken"].as_u64(),
            answer["validForMs"].as_u64(),
        ) else {
            panic!("a 200 answer without its fencing token and validity: {answer}");
        };
        Self {
            token,
            valid_for: Duration::from_millis(valid_for),
        }
    }
}

/// One GET /lock with short timeouts: (200 with its claim) or not.
fn probe(addr: SocketAddr) -> Option<Option<Claim>> {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect_timeout(&addr, POLL_TIMEOUT).ok()?;
    stream.set_read_timeout(Some(POLL_TIMEOUT)).ok()?;
    stream
        .write_all(b"GET /lock HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    if !text.starts_with("HTTP/1.1 200") {
        return Some(None);
    }
    let body = text.split_once("\r\n\r\n")?.1;
    let json: serde_json::Value = serde_json::from_str(body).ok()?;
    Some(Some(Claim::of(&json)))
}

/// Poll one slot until told to stop.
fn checker(
    slot: usize,
    addr: Arc<Mutex<(SocketAddr, u32)>>,
    log: Arc<Mutex<Vec<Sample>>>,
    last_holder: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::SeqCst) {
        let (target, generation) = *addr.lock().unwrap();
        let sent = Instant::now();
        let answer = probe(target);
        let received = Instant::now();
        if let Some(claim) = answer {
            if claim.is_some() {
                let mut last = last_holder.lock().unwrap();
                *last = Some(last.map_or(received, |l| l.max(received)));
            }
            log.lock().unwrap().push(Sample {
                slot,
                generation,
                sent,
                received,
                token: claim.map(|c| c.token),
                valid_for: claim.map(|c| c.valid_for).unwrap_or_default(),
            });
        }
        std::thread::sleep(POLL_PAUSE);
    }
}

/// The waiters' workload: how long a blocking waiter waits, how long a holder may keep the
/// lock without acquiring again, and the mix of requests.
/// Two per sidecar, each pausing between holdings: an on-demand lock is re-entrant for the pod,
/// so more workers (or none pausing) would keep one pod's count from ever reaching zero, and
/// the lock would pass between pods only through faults.
pub const WAITERS_PER_SIDECAR: usize = 2;
const WAIT: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(3);
/// Out of 100 requests: this many try-locks, and this many clients that hang up.
const TRY_LOCKS: u32 = 25;
const HANG_UPS: u32 = 15;
/// How long a client that hangs up waits first.
const PATIENCE_MS: std::ops::Range<u64> = 30..1000;
/// How long a worker keeps the lock once it has it, and pauses after giving it back.
const WORK_MS: std::ops::Range<u64> = 2..20;
const BETWEEN_MS: std::ops::Range<u64> = 0..40;
/// A client that hangs up at the very instant its acquisition succeeds leaves a holding that
/// nobody was told of: no sidecar can tell that race from a client that read its answer. A
/// holding first seen this close to a hang-up of its sidecar's client is that race.
const HANG_UP_RACE: Duration = Duration::from_millis(100);

/// What the waiters saw, besides the checker's samples.
#[derive(Default)]
struct WaiterLog {
    /// Every acquisition a worker was answered 200, by (slot, token).
    given: BTreeMap<(usize, u64), Vec<Take>>,
    acquisitions: usize,
    try_locks_refused: usize,
    /// When a client of each slot hung up.
    hang_ups: Vec<(usize, Instant)>,
    /// Blocking waits refused after the whole wait: (sent, received).
    refusals: Vec<(Instant, Instant)>,
    /// When each fault began and ended.
    faults: Vec<(Instant, Instant)>,
}

/// One acquisition answered 200: when it was asked and answered, for how long the answer said
/// it was valid, when its release was asked, and when that was answered 200 (`None` when the
/// release failed or was never answered).
#[derive(Debug, Clone, Copy)]
struct Take {
    sent: Instant,
    received: Instant,
    valid_for: Duration,
    release_sent: Instant,
    released: Option<Instant>,
}

impl Take {
    /// Until when its worker acted on the lock: its release, or its answer's validity ending.
    fn acted_until(&self) -> Instant {
        self.release_sent.min(self.sent + self.valid_for)
    }
}

/// One worker beside sidecar `slot`: take the lock (a blocking wait, a try-lock, or a wait it
/// gives up on), keep it a moment, give it back; again until `stop`.
fn waiter(
    slot: usize,
    addr: Arc<Mutex<(SocketAddr, u32)>>,
    log: Arc<Mutex<WaiterLog>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    while !stop.load(Ordering::SeqCst) {
        let (target, _) = *addr.lock().unwrap();
        let roll = rng.random_range(0..100);
        let try_lock = roll < TRY_LOCKS;
        let wait = if try_lock { Duration::ZERO } else { WAIT };
        let path = format!(
            "/lock/acquire?wait={}ms&hold={}ms",
            wait.as_millis(),
            HOLD.as_millis()
        );
        let sent = Instant::now();
        let answer = if roll >= 100 - HANG_UPS {
            let patience = Duration::from_millis(rng.random_range(PATIENCE_MS));
            match post_or_hang_up(target, &path, patience) {
                Ok(None) => {
                    log.lock().unwrap().hang_ups.push((slot, Instant::now()));
                    continue;
                }
                other => other.map(|reply| reply.expect("answered")),
            }
        } else {
            http(target, "POST", &path)
        };
        let received = Instant::now();
        match answer {
            Ok(reply) if reply.status == 200 => {
                let Claim { token, valid_for } = Claim::of(&reply.json());
                std::thread::sleep(Duration::from_millis(rng.random_range(WORK_MS)));
                // With its token, as an app should: a plain release that reaches the sidecar
                // late (paused meanwhile) would end whatever the pod holds by then, another
                // worker's later holding included.
                let release_sent = Instant::now();
                let released = http(target, "POST", &format!("/lock/release?token={token}"))
                    .is_ok_and(|r| r.status == 200)
                    .then(Instant::now);
                let mut log = log.lock().unwrap();
                log.acquisitions += 1;
                log.given.entry((slot, token)).or_default().push(Take {
                    sent,
                    received,
                    valid_for,
                    release_sent,
                    released,
                });
                drop(log);
                std::thread::sleep(Duration::from_millis(rng.random_range(BETWEEN_MS)));
            }
            Ok(reply) if reply.status == 409 => {
                let mut log = log.lock().unwrap();
                if try_lock {
                    log.try_locks_refused += 1;
                } else if received - sent >= WAIT {
                    log.refusals.push((sent, received));
                }
                drop(log);
                std::thread::sleep(Duration::from_millis(rng.random_range(5..30)));
            }
            // 503 (cannot tell), or the sidecar killed under us: try again shortly.
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Run the check of `scenario` for `duration`, with `contenders` sidecars.
pub fn run(scenario: Scenario, duration: Duration, contenders: usize, seed: u64) -> Report {
    assert!(
        !matches!(
            scenario.workload,
            Workload::Keyed
                | Workload::Semaphore
                | Workload::ReadWrite
                | Workload::Several
                | Workload::Exec
                | Workload::ExecPermits
                | Workload::ExecVia
                | Workload::ExecViaKeyed
                | Workload::ExecViaReadWrite
        ),
        "keyed scenarios run in keyed_safety::run, exec ones in exec_safety::run"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut backend = Backend::start(scenario.target);
    let lock = unique_lock("safety");
    let args: Vec<&str> = match scenario.workload {
        Workload::Campaign
        | Workload::Resource
        | Workload::Keyed
        | Workload::Semaphore
        | Workload::ReadWrite
        | Workload::Several
        | Workload::Exec
        | Workload::ExecPermits
        | Workload::ExecVia
        | Workload::ExecViaKeyed
        | Workload::ExecViaReadWrite => TIMING.to_vec(),
        Workload::Waiters => [TIMING, &["--mode", "on-demand"]].concat(),
    };
    // A resource scenario's sidecars read their lock from the cluster; its backend can also be
    // reached through `alias`, the address an edit of the backend moves it to and back.
    let mut cluster = None;
    let mut alias = None;
    if scenario.workload == Workload::Resource {
        let direct = backend.ports()[0];
        alias = Some((direct, FaultProxy::start(direct)));
        cluster = Some(Cluster::start(&lock, backend.resource_spec(direct)));
    }
    let (resource, env) = cluster
        .as_ref()
        .map(|c| (c.resource(), c.env()))
        .unwrap_or_default();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let faults: Vec<Fault> = if cluster.is_some() {
        RESOURCE_FAULTS
    } else {
        backend.faults()
    }
    .to_vec();
    let from_resource = cluster.is_some();
    let start_sidecar = |placement: &Placement, identity: &str, url: &str| {
        if from_resource {
            Sidecar::start_from_resource(identity, &resource, &env)
        } else {
            Sidecar::start_on(placement, identity, url, &lock, &args)
        }
    };
    let mut slots: Vec<Slot> = (0..contenders)
        .map(|i| Slot::start(i, format!("contender-{i}"), &backend, &start_sidecar))
        .collect();

    let log = Arc::new(Mutex::new(Vec::new()));
    let waiter_log = Arc::new(Mutex::new(WaiterLog::default()));
    let last_holder = Arc::new(Mutex::new(None));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads: Vec<_> = slots
        .iter()
        .enumerate()
        .map(|(i, slot)| {
            let (addr, log, last, stop) = (
                slot.addr.clone(),
                log.clone(),
                last_holder.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || checker(i, addr, log, last, stop))
        })
        .collect();
    if scenario.workload == Workload::Waiters {
        for (i, slot) in slots.iter().enumerate() {
            for _ in 0..WAITERS_PER_SIDECAR {
                let (addr, log, stop, seed) = (
                    slot.addr.clone(),
                    waiter_log.clone(),
                    stop.clone(),
                    rng.random(),
                );
                threads.push(std::thread::spawn(move || waiter(i, addr, log, stop, seed)));
            }
        }
    }

    let mut report = Report {
        target: scenario.name(),
        seed,
        ..Report::default()
    };
    let began = Instant::now();
    let recovered = |since: Instant| *last_holder.lock().unwrap() > Some(since);
    // The first holder, before any fault.
    let first = Instant::now();
    while !recovered(first) {
        if first.elapsed() > LEASE + RENEW + RECOVERY_SLACK {
            report
                .violations
                .push("no holder appeared at the start".to_owned());
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }

    while began.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(
            rng.random_range(CALM_MIN_MS..CALM_MAX_MS),
        ));
        let fault = faults[rng.random_range(0..faults.len())];
        // The holder now, as the checker last saw it; anyone when nobody holds.
        let holder = current_holder(&log.lock().unwrap())
            .unwrap_or_else(|| rng.random_range(0..slots.len()));
        let started = Instant::now();
        match (&mut cluster, &alias) {
            (Some(cluster), Some((direct, alias))) if RESOURCE_ONLY.contains(&fault) => {
                if let Err(failed) = edit_resource(fault, cluster, *direct, alias.port) {
                    report.violations.push(failed);
                }
            }
            _ => inject(fault, &mut slots[holder], &mut backend, &start_sidecar),
        }
        *report.faults.entry(fault.name()).or_default() += 1;
        let healed = Instant::now();
        waiter_log.lock().unwrap().faults.push((started, healed));
        let bound = LEASE + RENEW + RECOVERY_SLACK;
        while !recovered(healed) && healed.elapsed() < bound {
            std::thread::sleep(Duration::from_millis(2));
        }
        let took = healed.elapsed();
        report.slowest_recovery = report.slowest_recovery.max(took);
        if !recovered(healed) {
            report.violations.push(format!(
                "no holder within {bound:?} after {} ended (at {:.1?})",
                fault.name(),
                healed - began
            ));
        }
    }
    report.duration = began.elapsed();
    stop.store(true, Ordering::SeqCst);
    // A checker or worker that panicked saw something it could not record: a failed run.
    for thread in threads {
        if thread.join().is_err() {
            report
                .violations
                .push("a checker or worker thread panicked (its message is above)".to_owned());
        }
    }
    let samples = std::mem::take(&mut *log.lock().unwrap());
    let waiters = (scenario.workload == Workload::Waiters)
        .then(|| std::mem::take(&mut *waiter_log.lock().unwrap()));
    let holdings = analyse(&samples, waiters.as_ref(), began, &mut report);
    if let Some(waiters) = &waiters {
        analyse_waiters(&holdings, waiters, began, &mut report);
    }
    drop(slots);
    report
}

/// Inject `fault` on `slot` (or on the backend) and end it: a killed process is replaced by
/// `start_sidecar`, a pause or a partition lasts [`FAULT_LENGTH`].
pub(crate) fn inject(
    fault: Fault,
    slot: &mut Slot,
    backend: &mut Backend,
    start_sidecar: &StartSidecar,
) {
    match fault {
        Fault::KillHolder => {
            slot.sidecar.kill9();
            std::thread::sleep(LEASE / 2);
            slot.generation += 1;
            slot.sidecar = start_sidecar(&slot.placement, &slot.identity, &slot.url(backend));
            *slot.addr.lock().unwrap() = (slot.sidecar.addr, slot.generation);
        }
        Fault::PauseHolder => {
            slot.sidecar.signal(Signal::SIGSTOP);
            std::thread::sleep(FAULT_LENGTH);
            slot.sidecar.signal(Signal::SIGCONT);
        }
        other => backend.inject(other, slot.index, &slot.proxies),
    }
}

/// The faults that act on the `DistributedLock`, not on a process or the backend.
const RESOURCE_ONLY: &[Fault] = &[Fault::DeleteLock, Fault::EditSettings, Fault::EditBackend];

/// Delete and recreate, or edit, the lock in `cluster`. An edit moves to the other of two
/// values: renew intervals, or the backend's two addresses (`direct` and `alias`).
fn edit_resource(
    fault: Fault,
    cluster: &mut Cluster,
    direct: u16,
    alias: u16,
) -> Result<(), String> {
    match fault {
        Fault::DeleteLock => cluster.delete_and_recreate().map(drop),
        Fault::EditSettings => {
            cluster.edit(|spec| {
                let next = if spec["renewInterval"] == "250ms" {
                    "200ms"
                } else {
                    "250ms"
                };
                spec["renewInterval"] = next.into();
            });
            Ok(())
        }
        Fault::EditBackend => {
            cluster.edit(|spec| {
                let endpoint = &mut spec["backend"]["redis"]["endpoints"][0];
                let port = if *endpoint == format!("127.0.0.1:{direct}") {
                    alias
                } else {
                    direct
                };
                *endpoint = format!("127.0.0.1:{port}").into();
            });
            Ok(())
        }
        _ => unreachable!("{} does not act on the resource", fault.name()),
    }
}

/// The slot that answered 200 most recently, if its last answer was 200.
fn current_holder(samples: &[Sample]) -> Option<usize> {
    let mut last: BTreeMap<usize, &Sample> = BTreeMap::new();
    for sample in samples.iter().rev() {
        last.entry(sample.slot).or_insert(sample);
    }
    last.values()
        .filter(|s| s.token.is_some())
        .max_by_key(|s| s.received)
        .map(|s| s.slot)
}

/// One token's claim by one process: surely held over [certain_from, certain_to] when that is
/// not empty, and at some instant within [first_sent, first_received]; possibly held from
/// `first_sent` to `last_received`. Its answers told the pod's apps they may act on it until
/// `promised_to`.
#[derive(Debug, Clone, Copy)]
struct Holding {
    slot: usize,
    generation: u32,
    token: u64,
    first_sent: Instant,
    first_received: Instant,
    certain_from: Instant,
    certain_to: Instant,
    last_received: Instant,
    promised_to: Instant,
}

/// The holdings the samples show, in the order they began; overlaps, broken promises, falling
/// or shared tokens and the polling figures go into `report`. With the waiters' log, a
/// holding's promise ends where one of its pod's workers gave it up.
fn analyse(
    samples: &[Sample],
    waiters: Option<&WaiterLog>,
    began: Instant,
    report: &mut Report,
) -> Vec<Holding> {
    report.samples = samples.len();
    let mut holdings: BTreeMap<(usize, u32, u64), Holding> = BTreeMap::new();
    for s in samples {
        let Some(token) = s.token else { continue };
        holdings
            .entry((s.slot, s.generation, token))
            .and_modify(|h| {
                h.certain_from = h.certain_from.min(s.received);
                h.certain_to = h.certain_to.max(s.sent);
                if s.sent < h.first_sent {
                    h.first_sent = s.sent;
                    h.first_received = s.received;
                }
                h.last_received = h.last_received.max(s.received);
                h.promised_to = h.promised_to.max(s.sent + s.valid_for);
            })
            .or_insert(Holding {
                slot: s.slot,
                generation: s.generation,
                token,
                first_sent: s.sent,
                first_received: s.received,
                certain_from: s.received,
                certain_to: s.sent,
                last_received: s.received,
                promised_to: s.sent + s.valid_for,
            });
    }
    let mut holdings: Vec<Holding> = holdings.into_values().collect();
    if let Some(log) = waiters {
        for h in &mut holdings {
            if let Some(given_up) = given_up(h, log) {
                h.promised_to = h.promised_to.min(given_up.max(h.certain_to));
            }
        }
    }
    holdings.sort_by_key(|h| h.first_sent);
    report.handovers = holdings.len().saturating_sub(1);
    let at = |t: Instant| t.saturating_duration_since(began);

    for (i, a) in holdings.iter().enumerate() {
        for b in &holdings[i + 1..] {
            let from = a.certain_from.max(b.certain_from);
            let to = a.certain_to.min(b.certain_to);
            if from < to {
                report.violations.push(format!(
                    "overlap: contender-{} (token {}) and contender-{} (token {}) both held for {:?} at {:.3?}",
                    a.slot, a.token, b.slot, b.token, to - from, at(from)
                ));
            } else {
                for (promiser, other) in [(a, b), (b, a)] {
                    if let Some(held) = held_within_promise(promiser, other) {
                        report.violations.push(format!(
                            "broken promise: contender-{} (token {}) was promised validity until {:.3?}, but contender-{} (token {}) held at {:.3?}",
                            promiser.slot,
                            promiser.token,
                            at(promiser.promised_to),
                            other.slot,
                            other.token,
                            at(held)
                        ));
                    }
                }
            }
            if a.token == b.token && (a.slot, a.generation) != (b.slot, b.generation) {
                report.violations.push(format!(
                    "token {} claimed by contender-{} and contender-{}",
                    a.token, a.slot, b.slot
                ));
            }
            // Tokens rise in the order the claims began, where that order is certain: one
            // claim was seen before the first request that saw the other was sent. (Sorted by
            // that request alone, a slow answer misorders two short holdings.)
            let Some((first, second)) = surely_ordered(a, b, |h| (h.first_sent, h.first_received))
            else {
                continue;
            };
            if second.token < first.token {
                report.violations.push(format!(
                    "token went from {} (contender-{}) to {} (contender-{}) at {:.3?}",
                    first.token,
                    first.slot,
                    second.token,
                    second.slot,
                    at(second.first_sent)
                ));
            }
        }
    }

    // Gaps between consecutive 200 answers, from the first holder on.
    let mut held: Vec<Instant> = samples
        .iter()
        .filter(|s| s.token.is_some())
        .map(|s| s.received)
        .collect();
    held.sort();
    report.longest_without_holder = held
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();

    let mut per_slot: BTreeMap<(usize, u32), Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        per_slot.entry((s.slot, s.generation)).or_default().push(s);
    }
    let mut intervals: Vec<Duration> = per_slot
        .values()
        .flat_map(|v| v.windows(2).map(|w| w[1].sent - w[0].sent))
        .collect();
    intervals.sort();
    report.poll_interval = intervals
        .get(intervals.len() / 2)
        .copied()
        .unwrap_or_default();
    report.longest_request = samples
        .iter()
        .map(|s| s.received - s.sent)
        .max()
        .unwrap_or_default();
    holdings
}

/// When a worker of `h`'s pod first gave `h` up, voiding the answers about it in the pod: the
/// release of a take of its token asked, or a client hanging up (once granted, which no log
/// can tell apart from hanging up while it waited) as it began or after.
fn given_up(h: &Holding, log: &WaiterLog) -> Option<Instant> {
    let released = log
        .given
        .get(&(h.slot, h.token))
        .into_iter()
        .flatten()
        .map(|take| take.release_sent);
    let hung_up = log
        .hang_ups
        .iter()
        .filter(|&&(slot, at)| slot == h.slot && at + HANG_UP_RACE >= h.first_sent)
        .map(|&(_, at)| at);
    released.chain(hung_up).min()
}

/// Whether `other` surely held while `promiser`'s answers promised it the lock, from the first
/// answer received to `promised_to`: the instant it surely held then ([`held_within`]).
fn held_within_promise(promiser: &Holding, other: &Holding) -> Option<Instant> {
    held_within(
        (
            promiser.certain_from,
            promiser.promised_to.max(promiser.certain_to),
        ),
        (other.certain_from, other.certain_to),
        (other.first_sent, other.first_received),
    )
}

/// An instant within `(from, to)` (a promise) at which a holding surely held: one of its
/// `certain` span (received of its first answer, sent of its last), or, when that span misses
/// the promise (it is empty for a holding seen once), the end of a request's `window` (sent,
/// received) lying wholly inside the promise, since it held at some instant of that window.
pub(crate) fn held_within(
    (from, to): (Instant, Instant),
    certain: (Instant, Instant),
    window: (Instant, Instant),
) -> Option<Instant> {
    let overlap_from = from.max(certain.0);
    if overlap_from < to.min(certain.1) {
        return Some(overlap_from);
    }
    (from <= window.0 && window.1 < to).then_some(window.1)
}

/// The waiters' own checks: no holding for nobody, and no blocking waiter refused while the
/// lock stayed free.
fn analyse_waiters(holdings: &[Holding], log: &WaiterLog, began: Instant, report: &mut Report) {
    let at = |t: Instant| t.saturating_duration_since(began);
    report.acquisitions = log.acquisitions;
    report.try_locks_refused = log.try_locks_refused;
    report.hang_ups = log.hang_ups.len();
    let hung_up_within = |slot: usize, from: Instant, to: Instant| {
        log.hang_ups
            .iter()
            .any(|&(s, at)| s == slot && at + HANG_UP_RACE >= from && at <= to)
    };
    // Each worker acts on the lock from its answer until its release (or its answer's
    // validity ending): two workers of different holdings at once, or one beside another
    // pod's certain claim, are two processes acting on the lock.
    let acting: Vec<(usize, u64, &Take)> = log
        .given
        .iter()
        .flat_map(|(&(slot, token), takes)| takes.iter().map(move |t| (slot, token, t)))
        .collect();
    for (i, &(slot, token, take)) in acting.iter().enumerate() {
        for &(other_slot, other_token, other) in &acting[i + 1..] {
            let from = take.received.max(other.received);
            if other_token != token && from < take.acted_until().min(other.acted_until()) {
                report.violations.push(format!(
                    "overlap: a worker of contender-{slot} (token {token}) and one of contender-{other_slot} (token {other_token}) both acted on the lock at {:.3?}",
                    at(from)
                ));
            }
        }
        for h in holdings
            .iter()
            .filter(|h| (h.slot, h.token) != (slot, token))
        {
            let from = take.received.max(h.certain_from);
            if from < take.acted_until().min(h.certain_to) {
                report.violations.push(format!(
                    "overlap: a worker of contender-{slot} (token {token}) acted on the lock while contender-{} (token {}) held it, at {:.3?}",
                    h.slot,
                    h.token,
                    at(from)
                ));
            }
        }
    }
    for h in holdings {
        let Some(takes) = log.given.get(&(h.slot, h.token)) else {
            if !hung_up_within(h.slot, h.first_sent, h.first_received + HANG_UP_RACE) {
                report.violations.push(format!(
                    "contender-{} held token {} for nobody: no worker of it was given it, and none of its clients hung up as it began (at {:.3?})",
                    h.slot,
                    h.token,
                    at(h.first_sent)
                ));
            }
            continue;
        };
        // The pod's count of this token's holds: a later take found it zero when every other
        // take that may have been counted before it (asked before it was answered) had been
        // released before it was asked; the lock was then given back, and the later take must
        // have got a new token. A count kept above zero by a client that had gone (or a
        // release that failed) is what this finds.
        if takes.iter().any(|t| t.released.is_none()) {
            continue;
        }
        for (i, later) in takes.iter().enumerate() {
            let others = || takes.iter().enumerate().filter(move |&(j, _)| j != i);
            let token_existed = others().any(|(_, t)| t.received < later.sent);
            let all_released = others()
                .filter(|(_, t)| t.sent < later.received)
                .all(|(_, t)| t.released.is_some_and(|r| r < later.sent));
            if token_existed && all_released && !hung_up_within(h.slot, h.first_sent, later.sent) {
                report.violations.push(format!(
                    "contender-{} gave token {} again at {:.3?}, after every worker that had it released it: a hold was counted for nobody",
                    h.slot,
                    h.token,
                    at(later.sent)
                ));
                break;
            }
        }
    }

    // A blocking waiter refused after its whole wait is a liveness failure when, with no fault
    // near, nobody held the lock for longer than a hand-over takes during that wait.
    let quiet_before = LEASE + HOLD + RENEW + RECOVERY_SLACK;
    let free_gap = RENEW + RECOVERY_SLACK;
    let mut busy: Vec<(Instant, Instant)> = holdings
        .iter()
        .map(|h| (h.first_sent, h.last_received))
        .collect();
    busy.sort();
    for &(sent, received) in &log.refusals {
        let faulted = log
            .faults
            .iter()
            .any(|&(from, to)| from < received && to + quiet_before > sent);
        if faulted {
            continue;
        }
        let longest = longest_gap(&busy, sent, received);
        if longest > free_gap {
            report.violations.push(format!(
                "a waiter waited {:?} and was refused, though nobody held the lock for {:?} of it (from {:.3?})",
                received - sent,
                longest,
                at(sent)
            ));
        }
    }
}

/// Two claims in the order they surely began, each known to have begun by the answer to a
/// request (`seen`: sent, received): the one answered before the request about the other was
/// sent came first. `None` when the requests overlap and the order cannot be told.
pub(crate) fn surely_ordered<T: Copy>(
    a: T,
    b: T,
    seen: impl Fn(T) -> (Instant, Instant),
) -> Option<(T, T)> {
    let ((a_sent, a_received), (b_sent, b_received)) = (seen(a), seen(b));
    if a_received < b_sent {
        Some((a, b))
    } else if b_received < a_sent {
        Some((b, a))
    } else {
        None
    }
}

/// The longest stretch of [from, to] that none of the sorted `busy` spans covers.
pub(crate) fn longest_gap(busy: &[(Instant, Instant)], from: Instant, to: Instant) -> Duration {
    let mut free_from = from;
    let mut longest = Duration::ZERO;
    for &(start, end) in busy {
        if start > free_from {
            longest = longest.max(start.min(to) - free_from);
        }
        free_from = free_from.max(end);
        if free_from >= to {
            return longest;
        }
    }
    longest.max(to - free_from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples of one claim: (slot, token, sent ms, received ms) from a common origin, each 200
    /// valid for as long as its request took.
    fn samples(origin: Instant, raw: &[(usize, Option<u64>, u64, u64)]) -> Vec<Sample> {
        let promising: Vec<_> = raw
            .iter()
            .map(|&(slot, token, sent, received)| (slot, token, sent, received, received - sent))
            .collect();
        promising_samples(origin, &promising)
    }

    /// Samples as for [`samples`], each with its `validForMs`.
    fn promising_samples(
        origin: Instant,
        raw: &[(usize, Option<u64>, u64, u64, u64)],
    ) -> Vec<Sample> {
        raw.iter()
            .map(|&(slot, token, sent, received, valid_for)| Sample {
                slot,
                generation: 0,
                sent: origin + Duration::from_millis(sent),
                received: origin + Duration::from_millis(received),
                token,
                valid_for: Duration::from_millis(valid_for),
            })
            .collect()
    }

    fn report(raw: &[(usize, Option<u64>, u64, u64)]) -> Report {
        let origin = Instant::now();
        let mut report = Report::default();
        analyse(&samples(origin, raw), None, origin, &mut report);
        report
    }

    fn promise_violations(raw: &[(usize, Option<u64>, u64, u64, u64)]) -> Vec<String> {
        let origin = Instant::now();
        let mut report = Report::default();
        analyse(&promising_samples(origin, raw), None, origin, &mut report);
        report.violations
    }

    #[test]
    fn an_answer_whose_validity_reaches_into_the_next_holders_claim_is_a_broken_promise() {
        // Contender 0's answer at 0-1 says valid for 500 ms; contender 1 surely holds from 301.
        let next = [(1, Some(2), 300, 301, 900), (1, Some(2), 310, 311, 900)];
        let found = promise_violations(&[&[(0, Some(1), 0, 1, 500)][..], &next].concat());
        assert!(
            found
                .iter()
                .any(|v| v.starts_with("broken promise: contender-0")),
            "{found:?}"
        );
        // Seen once only: it held at some instant of 300-301, inside the promise.
        let found = promise_violations(&[(0, Some(1), 0, 1, 500), (1, Some(2), 300, 301, 900)]);
        assert!(
            found.iter().any(|v| v.starts_with("broken promise")),
            "{found:?}"
        );
        // A promise that ends before the next holder is seen holding breaks nothing.
        assert_eq!(
            promise_violations(&[&[(0, Some(1), 0, 1, 250)][..], &next].concat()),
            Vec::<String>::new()
        );
        // Nor one that may have ended before: the next holder's only answer took from 200 to 301.
        assert_eq!(
            promise_violations(&[(0, Some(1), 0, 1, 250), (1, Some(2), 200, 301, 900)]),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_clean_hand_over_passes() {
        let r = report(&[
            (0, Some(1), 0, 1),
            (0, Some(1), 10, 11),
            (1, None, 12, 13),
            (1, Some(2), 20, 21),
            (1, Some(2), 30, 31),
        ]);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert_eq!(r.handovers, 1);
        assert_eq!(r.longest_without_holder, Duration::from_millis(10));
    }

    #[test]
    fn two_certain_claims_at_once_are_an_overlap() {
        let r = report(&[
            (0, Some(1), 0, 1),
            (1, Some(2), 5, 6),
            (0, Some(1), 10, 11),
            (1, Some(2), 12, 13),
        ]);
        assert_eq!(r.overlaps(), 1, "{:?}", r.violations);
    }

    /// Claims that may have been sequential within the polling windows are not reported.
    #[test]
    fn claims_within_one_polling_window_are_not_an_overlap() {
        let r = report(&[(0, Some(1), 0, 10), (1, Some(2), 5, 15)]);
        assert_eq!(r.overlaps(), 0, "{:?}", r.violations);
    }

    /// A slow answer about one short holding does not misorder it with the next.
    #[test]
    fn holdings_whose_order_is_not_certain_are_not_compared() {
        // Token 5 first seen by a request sent at 0 and answered at 50; token 4 seen by a
        // request sent at 10 and answered at 11: 4 may well have come first.
        let r = report(&[(0, Some(5), 0, 50), (1, Some(4), 10, 11)]);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
    }

    #[test]
    fn tokens_must_increase_and_never_repeat() {
        let r = report(&[(0, Some(5), 0, 1), (1, Some(4), 10, 11)]);
        assert!(
            r.violations
                .iter()
                .any(|v| v.starts_with("token went from 5")),
            "{:?}",
            r.violations
        );
        let r = report(&[(0, Some(5), 0, 1), (1, Some(5), 10, 11)]);
        assert!(
            r.violations.iter().any(|v| v.contains("claimed by")),
            "{:?}",
            r.violations
        );
    }

    /// The waiters' checks on a log: `raw` as for [`report`], and the workers' takes and
    /// hang-ups in ms from the same origin.
    fn waiter_violations(
        raw: &[(usize, Option<u64>, u64, u64)],
        takes: &[(usize, u64, u64, u64, Option<u64>)],
        hang_ups: &[(usize, u64)],
    ) -> Vec<String> {
        let origin = Instant::now();
        let ms = |t: u64| origin + Duration::from_millis(t);
        let mut report = Report::default();
        let mut log = WaiterLog::default();
        for &(slot, token, sent, received, released) in takes {
            log.given.entry((slot, token)).or_default().push(Take {
                sent: ms(sent),
                received: ms(received),
                valid_for: Duration::from_secs(3),
                release_sent: released.map_or(ms(received + 1), |r| ms(r - 1)),
                released: released.map(ms),
            });
        }
        log.hang_ups = hang_ups.iter().map(|&(slot, at)| (slot, ms(at))).collect();
        let holdings = analyse(&samples(origin, raw), Some(&log), origin, &mut report);
        analyse_waiters(&holdings, &log, origin, &mut report);
        report.violations
    }

    #[test]
    fn a_promise_ends_where_a_worker_of_its_pod_gives_the_holding_up() {
        let origin = Instant::now();
        let ms = |t: u64| origin + Duration::from_millis(t);
        // Contender 0 promised until 500, contender 1 holds from 301.
        let raw = [
            (0, Some(1), 0, 1, 500),
            (1, Some(2), 300, 301, 900),
            (1, Some(2), 310, 311, 900),
        ];
        let violations = |log: &WaiterLog| {
            let mut report = Report::default();
            analyse(
                &promising_samples(origin, &raw),
                Some(log),
                origin,
                &mut report,
            );
            report.violations
        };
        let take = |release_sent: u64| Take {
            sent: ms(0),
            received: ms(1),
            valid_for: Duration::from_secs(3),
            release_sent: ms(release_sent),
            released: Some(ms(release_sent + 1)),
        };
        let mut log = WaiterLog::default();
        log.given.insert((0, 1), vec![take(250)]);
        assert_eq!(violations(&log), Vec::<String>::new());
        // Released only once the other held.
        log.given.insert((0, 1), vec![take(400)]);
        let found = violations(&log);
        assert!(
            found.iter().any(|v| v.starts_with("broken promise")),
            "{found:?}"
        );
        // A client of the pod that hung up meanwhile voids it too; one of another pod does not.
        log.hang_ups = vec![(1, ms(100))];
        assert!(!violations(&log).is_empty());
        log.hang_ups = vec![(0, ms(100))];
        assert_eq!(violations(&log), Vec::<String>::new());
    }

    #[test]
    fn a_holding_nobody_was_given_is_caught_unless_a_client_hung_up_as_it_began() {
        let held = [(0, Some(7), 500, 501), (0, Some(7), 900, 901)];
        let found = waiter_violations(&held, &[], &[]);
        assert!(found.iter().any(|v| v.contains("for nobody")), "{found:?}");
        // A client of that sidecar hung up just as it began: the race no server can tell.
        assert_eq!(
            waiter_violations(&held, &[], &[(0, 450)]),
            Vec::<String>::new()
        );
        // A hang-up of another sidecar's client explains nothing.
        let found = waiter_violations(&held, &[], &[(1, 450)]);
        assert!(found.iter().any(|v| v.contains("for nobody")), "{found:?}");
    }

    #[test]
    fn a_token_given_again_after_every_worker_released_it_is_caught() {
        let held = [(0, Some(7), 0, 1), (0, Some(7), 200, 201)];
        // Two workers overlapping: the second came while the first still held. Fine.
        let overlapping = [(0, 7, 0, 2, Some(100)), (0, 7, 50, 52, Some(150))];
        assert_eq!(
            waiter_violations(&held, &overlapping, &[]),
            Vec::<String>::new()
        );
        // The second came after the first had released: the count was zero, yet the same
        // token was given again, so something else still held a count.
        let after = [(0, 7, 0, 2, Some(40)), (0, 7, 100, 102, Some(150))];
        let found = waiter_violations(&held, &after, &[]);
        assert!(
            found.iter().any(|v| v.contains("gave token 7 again")),
            "{found:?}"
        );
        // A take answered after the later one was asked may have been counted before it.
        let answered_late = [
            (0, 7, 0, 2, Some(40)),
            (0, 7, 10, 120, Some(160)),
            (0, 7, 100, 102, Some(150)),
        ];
        assert_eq!(
            waiter_violations(&held, &answered_late, &[]),
            Vec::<String>::new()
        );
        // Unless one of its clients hung up during the holding, or a release failed.
        assert_eq!(
            waiter_violations(&held, &after, &[(0, 20)]),
            Vec::<String>::new()
        );
        let failed = [(0, 7, 0, 2, None), (0, 7, 100, 102, Some(150))];
        assert_eq!(waiter_violations(&held, &failed, &[]), Vec::<String>::new());
    }

    #[test]
    fn workers_acting_on_the_lock_beside_another_holding_are_an_overlap() {
        // Contender 0 held token 1 from 0 to 100; contender 1 from 200.
        let held = [
            (0, Some(1), 0, 1),
            (0, Some(1), 100, 101),
            (1, Some(2), 200, 201),
            (1, Some(2), 300, 301),
        ];
        // Token 1's worker released at 150, token 2's acquired at 190: fine.
        let apart = [(0, 1, 0, 1, Some(151)), (1, 2, 180, 190, Some(400))];
        assert_eq!(waiter_violations(&held, &apart, &[]), Vec::<String>::new());
        // Token 1's worker released only at 250: it acted beside contender 1's claim, and
        // beside contender 1's worker.
        let late = [(0, 1, 0, 1, Some(251)), (1, 2, 180, 190, Some(400))];
        let found = waiter_violations(&held, &late, &[]);
        assert!(
            found
                .iter()
                .any(|v| v.contains("acted on the lock while contender-1")),
            "{found:?}"
        );
        assert!(
            found.iter().any(|v| v.contains("both acted on the lock")),
            "{found:?}"
        );
    }

    #[test]
    fn longest_gap_counts_what_no_span_covers() {
        let origin = Instant::now();
        let ms = |t: u64| origin + Duration::from_millis(t);
        let busy = [(ms(0), ms(100)), (ms(50), ms(300)), (ms(900), ms(1000))];
        assert_eq!(
            longest_gap(&busy, ms(0), ms(1200)),
            Duration::from_millis(600)
        );
        assert_eq!(
            longest_gap(&busy, ms(0), ms(950)),
            Duration::from_millis(600)
        );
        assert_eq!(longest_gap(&[], ms(0), ms(10)), Duration::from_millis(10));
    }
}
