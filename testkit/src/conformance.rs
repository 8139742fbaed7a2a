//! The conformance suite: the same scenarios, written once, run against every driver through a
//! [`Harness`]. A driver is done when `conformance_suite!` passes on a real server.
//!
//! Timing assertions here are loose on purpose: they catch a lock that never hands over or a
//! holder that never fences, not a slow machine. Safety assertions are exact.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::{Instant, sleep};

use super::{FaultyDriver, RedisServer, unique_lock};
use leasehold_lease::{Acquire, Backend, Driver, Lease};
use leasehold_lease::{Answer, EventKind, Lock, LockConfig, Mode};

/// Short leases keep the suite quick; every bound below is derived from these.
pub const LEASE: Duration = Duration::from_millis(1000);
pub const RENEW: Duration = Duration::from_millis(250);
/// Slack for a busy 2-core machine on top of the protocol's own bounds.
pub const SLACK: Duration = Duration::from_millis(1500);

/// What a backend offers the suite.
#[async_trait]
pub trait Harness: Send {
    /// A new client with its own connection, as a separate process would have.
    async fn driver(&self) -> Arc<dyn Backend>;
    /// Make the backend unavailable to every client (kill the server, lock the file).
    async fn outage_begin(&mut self);
    /// Bring the backend back, with the data it had.
    async fn outage_end(&mut self);
}

/// SQLite: a throwaway file; an outage is another process holding the file's write lock.
pub struct SqliteHarness {
    dir: tempfile::TempDir,
    blocker: Option<sqlx::SqliteConnection>,
}

impl SqliteHarness {
    pub fn new() -> Self {
        Self {
            dir: tempfile::Builder::new()
                .prefix("leasehold-sqlite-")
                .tempdir()
                .expect("temp dir"),
            blocker: None,
        }
    }
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("locks.db")
    }
    pub fn dir_path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Default for SqliteHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Harness for SqliteHarness {
    async fn driver(&self) -> Arc<dyn Backend> {
        Arc::new(
            leasehold_lease::sqlite::SqliteDriver::open(
                &self.path(),
                leasehold_lease::DEFAULT_TABLE,
            )
            .await
            .expect("open sqlite"),
        )
    }
    async fn outage_begin(&mut self) {
        use sqlx::Connection;
        let _ = self.driver().await; // the file and table exist before we lock them
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(self.path());
        let mut conn = sqlx::SqliteConnection::connect_with(&options)
            .await
            .expect("blocker connection");
        sqlx::query("BEGIN EXCLUSIVE")
            .execute(&mut conn)
            .await
            .expect("take the write lock");
        self.blocker = Some(conn);
    }
    async fn outage_end(&mut self) {
        if let Some(mut conn) = self.blocker.take() {
            sqlx::query("COMMIT")
                .execute(&mut conn)
                .await
                .expect("drop the write lock");
        }
    }
}

/// A real server the suite can take down and bring back.
pub trait BackendServer: Send + Sync {
    fn start() -> Self;
    /// The `--backend` URL of this server.
    fn url(&self) -> String;
    /// Stop it like a crash.
    fn kill(&mut self);
    /// Start it again on the same port with the same data.
    fn restart(&mut self);
}

macro_rules! backend_server {
    ($($server:ty),+) => {$(
        impl BackendServer for $server {
            fn start() -> Self { <$server>::start() }
            fn url(&self) -> String { <$server>::url(self) }
            fn kill(&mut self) { <$server>::kill(self) }
            fn restart(&mut self) { <$server>::restart(self) }
        }
    )+};
}
backend_server!(
    RedisServer,
    super::redis_cluster::RedisCluster,
    super::PostgresServer,
    super::MariaDbServer,
    super::EtcdServer,
    super::ZooKeeperServer
);

/// A network backend: drivers connect through the same URL parsing and `connect` as the
/// sidecar; an outage is a crash of the server, recovery a restart on the same data.
pub struct ServerHarness<S> {
    pub server: S,
    /// Options appended to the server's URL, e.g. `mode=row-lock`.
    options: &'static str,
}

impl<S: BackendServer> ServerHarness<S> {
    pub fn new() -> Self {
        Self::with_options("")
    }

    /// The backend URL's options, as a user would write them after `?`.
    pub fn with_options(options: &'static str) -> Self {
        Self {
            server: S::start(),
            options,
        }
    }

    /// The URL the drivers connect to.
    pub fn url(&self) -> String {
        let url = self.server.url();
        match (self.options, url.contains('?')) {
            ("", _) => url,
            (options, true) => format!("{url}&{options}"),
            (options, false) => format!("{url}?{options}"),
        }
    }
}

impl ServerHarness<super::PostgresServer> {
    /// PostgreSQL in row-lock mode.
    pub fn row_lock() -> Self {
        Self::with_options("mode=row-lock")
    }
}

impl ServerHarness<super::MariaDbServer> {
    /// MariaDB in row-lock mode.
    pub fn row_lock() -> Self {
        Self::with_options("mode=row-lock")
    }
}

impl ServerHarness<super::EtcdServer> {
    /// etcd over TLS, asking every client for a certificate.
    pub fn tls() -> Self {
        Self {
            server: super::EtcdServer::start_tls(),
            options: "",
        }
    }
}

impl ServerHarness<super::ZooKeeperServer> {
    /// ZooKeeper over TLS (its secure port), asking every client for a certificate.
    pub fn tls() -> Self {
        Self {
            server: super::ZooKeeperServer::start_tls(),
            options: "",
        }
    }
}

impl ServerHarness<super::PostgresServer> {
    /// PostgreSQL over TLS only, asking every client for a certificate.
    pub fn tls() -> Self {
        Self {
            server: super::PostgresServer::start_tls(),
            options: "",
        }
    }
}

impl ServerHarness<super::MariaDbServer> {
    /// MariaDB taking TCP clients over TLS only.
    pub fn tls() -> Self {
        Self {
            server: super::MariaDbServer::start_tls(),
            options: "",
        }
    }
}

impl ServerHarness<RedisServer> {
    /// Redis with the TairString module over TLS, reached as `tairs://`.
    pub fn tair_tls() -> Self {
        Self {
            server: RedisServer::start_tair_tls(),
            options: "",
        }
    }

    /// Redis with the TairString module, reached as `tair://`.
    pub fn tair() -> Self {
        Self {
            server: RedisServer::start_tair(),
            options: "",
        }
    }

    /// Redis over TLS, asking every client for a certificate.
    pub fn tls() -> Self {
        Self {
            server: RedisServer::start_tls(),
            options: "",
        }
    }
}

impl<S: BackendServer> Default for ServerHarness<S> {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl<S: BackendServer> Harness for ServerHarness<S> {
    async fn driver(&self) -> Arc<dyn Backend> {
        let url = leasehold_lease::BackendUrl::parse(&self.url()).expect("backend url");
        connected(leasehold_lease::connect(&url).await.expect("driver")).await
    }
    async fn outage_begin(&mut self) {
        self.server.kill();
    }
    async fn outage_end(&mut self) {
        self.server.restart();
    }
}

/// `driver` once it has answered a ping (tried for up to [`SLACK`] while it does not): a
/// driver connects on first use, and on a loaded machine a first TLS handshake can outlast a
/// scenario's first attempt at a lock, which then answers "unknown" instead of what the
/// scenario checks. A backend that is down stays down; the scenario finds that out itself.
async fn connected(driver: Arc<dyn Backend>) -> Arc<dyn Backend> {
    let deadline = Instant::now() + SLACK;
    while driver.ping().await.is_err() && Instant::now() < deadline {
        sleep(Duration::from_millis(50)).await;
    }
    driver
}

/// Redis: `kill -9`, then a restart on the same append-only file.
pub type RedisHarness = ServerHarness<RedisServer>;
/// Redis behind Sentinel (a master, a replica, a sentinel): an outage is a crash of both data
/// servers, recovery a restart of both on their append-only files.
pub type RedisSentinelHarness = ServerHarness<super::RedisSentinelSet>;
/// PostgreSQL: an immediate shutdown, then a restart with crash recovery.
pub type PostgresHarness = ServerHarness<super::PostgresServer>;
/// ZooKeeper: `kill -9`, then a restart on the same data directory.
pub type ZooKeeperHarness = ServerHarness<super::ZooKeeperServer>;
/// etcd: `kill -9`, then a restart on the same data directory.
pub type EtcdHarness = ServerHarness<super::EtcdServer>;
/// MariaDB: `kill -9`, then a restart with InnoDB recovery.
pub type MariaDbHarness = ServerHarness<super::MariaDbServer>;

/// Redlock: five `redis-server` masters (append-only, `appendfsync always`); an outage is a
/// crash of a majority of them. The masters are shared so that a test can crash a minority while
/// clients run.
pub struct RedlockHarness {
    pub masters: Arc<std::sync::Mutex<Vec<RedisServer>>>,
}

/// How many masters the Redlock harness runs.
pub const REDLOCK_MASTERS: usize = 5;

impl RedlockHarness {
    /// Durable masters (`appendfsync always`).
    pub fn new() -> Self {
        Self::with_masters(RedisServer::start)
    }

    /// Masters without an append-only file: a restart after `kill -9` comes back empty.
    pub fn not_durable() -> Self {
        Self::with_masters(|| RedisServer::start_with(false))
    }

    fn with_masters(start: impl Fn() -> RedisServer) -> Self {
        Self {
            masters: Arc::new(std::sync::Mutex::new(
                (0..REDLOCK_MASTERS).map(|_| start()).collect(),
            )),
        }
    }

    /// `redlock://127.0.0.1:P1,127.0.0.1:P2,...`
    pub fn url(&self) -> String {
        let masters = self.masters.lock().unwrap();
        let hosts: Vec<String> = masters
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.port()))
            .collect();
        format!("redlock://{}", hosts.join(","))
    }

    fn majority(&self) -> std::ops::Range<usize> {
        0..REDLOCK_MASTERS / 2 + 1
    }
}

impl Default for RedlockHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Harness for RedlockHarness {
    async fn driver(&self) -> Arc<dyn Backend> {
        let url = leasehold_lease::BackendUrl::parse(&self.url()).expect("backend url");
        connected(leasehold_lease::connect(&url).await.expect("driver")).await
    }
    async fn outage_begin(&mut self) {
        let mut masters = self.masters.lock().unwrap();
        for i in self.majority() {
            masters[i].kill();
        }
    }
    async fn outage_end(&mut self) {
        let mut masters = self.masters.lock().unwrap();
        for i in self.majority() {
            masters[i].restart();
        }
    }
}

/// Leases on the in-memory Kubernetes API ([`super::InMemoryApiServer`]); an outage refuses every
/// request and ends every watch, and the stored Leases survive it.
pub struct KubernetesHarness {
    pub api: super::InMemoryApiServer,
}

impl KubernetesHarness {
    pub const NAMESPACE: &'static str = "leasehold-test";

    pub fn new() -> Self {
        Self {
            api: super::InMemoryApiServer::new(),
        }
    }

    pub fn client_driver(&self) -> leasehold_lease::kubernetes::KubernetesLeaseDriver {
        leasehold_lease::kubernetes::KubernetesLeaseDriver::new(self.api.client(), Self::NAMESPACE)
    }
}

impl Default for KubernetesHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Harness for KubernetesHarness {
    async fn driver(&self) -> Arc<dyn Backend> {
        Arc::new(self.client_driver())
    }
    async fn outage_begin(&mut self) {
        self.api.set_down(true);
    }
    async fn outage_end(&mut self) {
        self.api.set_down(false);
    }
}

fn config(lock: &str, identity: &str, mode: Mode) -> LockConfig {
    config_on(lock, identity, mode, LEASE)
}

/// [`config`] on `lease`.
fn config_on(lock: &str, identity: &str, mode: Mode, lease: Duration) -> LockConfig {
    LockConfig {
        renew_interval: RENEW,
        mode,
        ..LockConfig::new(lock, identity, lease)
    }
}

fn start(driver: Arc<dyn Backend>, lock: &str, identity: &str, mode: Mode) -> Lock {
    Lock::start(driver, config(lock, identity, mode), Arc::new(())).expect("start lock")
}

/// A lease for scenarios where no holder crashes or pauses: a loaded machine that stalls the
/// test for a second must not end a holding while the scenario reads who holds (a holding
/// that lapsed so would be right, and the scenario's reading wrong).
const STEADY_LEASE: Duration = Duration::from_secs(10);

/// [`config`] with [`STEADY_LEASE`].
fn steady_config(lock: &str, identity: &str, mode: Mode) -> LockConfig {
    config_on(lock, identity, mode, STEADY_LEASE)
}

/// `identity` takes the free `lock`. A call the backend's connection failed under is tried
/// again for up to [`SLACK`], as the engine would: ZooKeeper's client drops a connection of the
/// suite's 1 s sessions that is silent for 400 ms, which a loaded machine sometimes makes it.
async fn acquired(driver: &dyn Backend, lock: &str, identity: &str, ttl: Duration) -> Lease {
    let start = Instant::now();
    loop {
        match driver.try_acquire(lock, identity, ttl).await {
            Ok(Acquire::Acquired(lease)) => return lease,
            Ok(Acquire::Busy(h)) => {
                panic!("{identity} expected to acquire {lock}, but it is held: {h:?}")
            }
            Ok(Acquire::Withheld(w)) => {
                panic!("{identity} expected to acquire {lock}, but it is withheld: {w:?}")
            }
            Err(
                e @ (leasehold_lease::Error::Unreachable(_) | leasehold_lease::Error::Timeout(_)),
            ) if start.elapsed() < SLACK => {
                eprintln!("{identity}: acquiring {lock} failed ({e}); trying again");
                sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("acquire: {e:?}"),
        }
    }
}

/// `identity` takes `lock` for `ttl` once it is free, within a lease (and slack); unlike
/// [`acquired_within`], a call the backend's connection failed under is tried again, as
/// [`acquired`] does.
async fn acquired_once_free(
    driver: &dyn Backend,
    lock: &str,
    identity: &str,
    ttl: Duration,
) -> Lease {
    let start = Instant::now();
    loop {
        match driver.try_acquire(lock, identity, ttl).await {
            Ok(Acquire::Acquired(lease)) => return lease,
            Ok(Acquire::Busy(_) | Acquire::Withheld(_))
            | Err(leasehold_lease::Error::Unreachable(_) | leasehold_lease::Error::Timeout(_))
                if start.elapsed() < LEASE + SLACK =>
            {
                sleep(Duration::from_millis(20)).await
            }
            other => panic!(
                "{identity} never acquired {lock} within {:?}: {other:?}",
                LEASE + SLACK
            ),
        }
    }
}

/// `identity` takes `lock` for `ttl` once it is free, within a lease (and slack); `never` says
/// what failed. A failed call fails the test.
async fn acquired_within(
    driver: &dyn Backend,
    lock: &str,
    identity: &str,
    ttl: Duration,
    never: &str,
) -> Lease {
    let start = Instant::now();
    loop {
        match driver
            .try_acquire(lock, identity, ttl)
            .await
            .expect("acquire")
        {
            Acquire::Acquired(lease) => return lease,
            Acquire::Busy(_) | Acquire::Withheld(_) => {
                assert!(start.elapsed() < LEASE + SLACK, "{never}");
                sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn busy(
    driver: &dyn Backend,
    lock: &str,
    identity: &str,
) -> Option<leasehold_lease::Holding> {
    match driver
        .try_acquire(lock, identity, LEASE)
        .await
        .expect("acquire")
    {
        Acquire::Busy(h) => h,
        Acquire::Withheld(_) => None,
        Acquire::Acquired(lease) => {
            panic!("{identity} acquired {lock} while it is held: {lease:?}")
        }
    }
}

/// Poll `check` until it holds or `within` passes; returns how long it took.
async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < within, "not within {within:?}: {what}");
        sleep(Duration::from_millis(5)).await;
    }
    start.elapsed()
}

/// One holder at a time, and everyone sees who it is.
pub async fn exclusivity(h: &mut dyn Harness) {
    let (a, b) = (h.driver().await, h.driver().await);
    let lock = unique_lock("exclusive");
    let lease = acquired(&*a, &lock, "a", LEASE).await;
    let seen = busy(&*b, &lock, "b").await.expect("b sees the holder");
    assert_eq!((seen.identity.as_str(), seen.token), ("a", lease.token));
    // ZooKeeper cannot tell (a session's remaining time is the server's secret): None is allowed.
    assert!(seen.expires_in.is_none_or(|d| d <= LEASE));
    // Not re-entrant at the driver level, not even for the same identity.
    busy(&*a, &lock, "a").await;
    let observed = b.observe(&lock).await.unwrap().expect("observed");
    assert_eq!(
        (observed.identity.as_str(), observed.token),
        ("a", lease.token)
    );
    // Other locks are independent.
    acquired(&*b, &unique_lock("other"), "b", LEASE).await;
}

/// A release frees the lock at once, and the next holder gets a greater token.
pub async fn release_and_takeover(h: &mut dyn Harness) {
    let (a, b) = (h.driver().await, h.driver().await);
    let lock = unique_lock("release");
    let la = acquired(&*a, &lock, "a", LEASE).await;
    assert!(a.release(&la).await.unwrap());
    assert_eq!(b.observe(&lock).await.unwrap(), None);
    let lb = acquired(&*b, &lock, "b", LEASE).await;
    assert!(lb.token > la.token, "{} then {}", la.token, lb.token);
    assert!(!a.release(&la).await.unwrap(), "a released b's lease");
    assert_eq!(b.observe(&lock).await.unwrap().unwrap().identity, "b");
}

/// Renew and release compare identity and token; nobody else can extend or free a lease.
pub async fn only_holder_renews_or_releases(h: &mut dyn Harness) {
    let (a, b) = (h.driver().await, h.driver().await);
    let short = Duration::from_millis(300);
    // The lease is short, so that its expiry can be waited for: on a loaded machine the calls
    // before it may outlast it, which leaves nothing to check, and the case is tried again.
    let mut attempts = 0;
    let (lock, la) = loop {
        attempts += 1;
        assert!(
            attempts <= 5,
            "a short lease outlived by its own calls {attempts} times"
        );
        let lock = unique_lock("only-holder");
        let sent = Instant::now();
        let la = acquired(&*a, &lock, "a", short).await;
        let impostors = [
            Lease {
                identity: "b".into(),
                ..la.clone()
            },
            Lease {
                token: la.token + 1,
                ..la.clone()
            },
            Lease {
                token: la.token.saturating_sub(1),
                ..la.clone()
            },
        ];
        for fake in &impostors {
            assert!(!b.renew(fake, LEASE).await.unwrap(), "renewed by {fake:?}");
            assert!(!b.release(fake).await.unwrap(), "released by {fake:?}");
        }
        let renewal_sent = Instant::now();
        if !a.renew(&la, short).await.unwrap() {
            assert!(
                sent.elapsed() >= short,
                "the holder's renewal failed {:?} into its {short:?} lease",
                sent.elapsed()
            );
            continue;
        }
        // b looks while a holds: a backend whose contenders time a record from when they first
        // saw it (Kubernetes) lets b take it once the lease has run out since then.
        match b.observe(&lock).await.unwrap() {
            Some(holder) => {
                assert_eq!(holder.identity, "a");
                break (lock, la);
            }
            None => assert!(
                renewal_sent.elapsed() >= short,
                "the lease renewed for {short:?} was gone {:?} after the renewal was sent",
                renewal_sent.elapsed()
            ),
        }
    };
    sleep(short + Duration::from_millis(100)).await;
    // Expired: the old holder can neither renew nor release it, and b takes it.
    assert!(
        !a.renew(&la, LEASE).await.unwrap(),
        "renewed an expired lease"
    );
    let lb = acquired(&*b, &lock, "b", LEASE).await;
    assert!(lb.token > la.token);
    assert!(!a.renew(&la, LEASE).await.unwrap());
    assert!(!a.release(&la).await.unwrap());
    let holder = a.observe(&lock).await.unwrap().unwrap();
    assert_eq!((holder.identity.as_str(), holder.token), ("b", lb.token));
}

/// A lock's records deleted from under a running holder (`cleanupPolicy: Delete`) end its claim
/// at its next renew, whatever still lives on in the backend (an etcd lease, a session), and the
/// lock can be taken again, with a token above every earlier one.
pub async fn deprovision_ends_the_holders_claim(h: &mut dyn Harness) {
    let (a, b, operator) = (h.driver().await, h.driver().await, h.driver().await);
    let lock = unique_lock("deprovision");
    let la = acquired(&*a, &lock, "a", LEASE).await;
    operator
        .deprovision(std::slice::from_ref(&lock))
        .await
        .expect("deprovision");
    assert!(
        !a.renew(&la, LEASE).await.unwrap(),
        "the holder renewed a lock whose records were deleted"
    );
    let lb = acquired_within(&*b, &lock, "b", LEASE, "never free again").await;
    assert!(
        !a.renew(&la, LEASE).await.unwrap(),
        "two holders: a renewed"
    );
    // A lock created again under the same name must not hand out tokens that an old holder's
    // writes may already have carried.
    assert!(
        lb.token > la.token,
        "the token went back from {} to {} after the lock's records were deleted",
        la.token,
        lb.token
    );
    assert!(b.release(&lb).await.unwrap());
}

/// A lock's records are deleted (`cleanupPolicy: Delete`) only while the deleter holds the lock:
/// under a live holder nothing is deleted and the holder goes on renewing, nobody else gets in,
/// and no place is left in a queue; once it is free they are deleted, and the next holder's
/// token is above every earlier one. (Reading "free" and then deleting let a holder that came
/// in between lose its records, and a newcomer take the lock beside it.)
pub async fn records_are_deleted_only_while_held(h: &mut dyn Harness) {
    let (a, b, operator) = (h.driver().await, h.driver().await, h.driver().await);
    let lock = unique_lock("records");
    let la = acquired(&*a, &lock, "a", LEASE).await;
    let waiting = leasehold_lease::delete_records(&*operator, &lock, LEASE)
        .await
        .expect("delete records");
    assert_eq!(
        waiting.flatten().map(|h| (h.identity, h.token)),
        Some(("a".to_owned(), la.token)),
        "the deleter names the holder"
    );
    assert!(
        a.renew(&la, LEASE).await.unwrap(),
        "the holder's records were deleted under it"
    );
    busy(&*b, &lock, "b").await;
    b.abandon(&lock, "b").await;
    assert!(a.release(&la).await.unwrap());
    // Free now (a queue-based backend has no place of the deleter's left ahead of anyone).
    let start = Instant::now();
    while leasehold_lease::delete_records(&*operator, &lock, LEASE)
        .await
        .expect("delete records")
        .is_some()
    {
        assert!(
            start.elapsed() < LEASE + SLACK,
            "the free lock was never deleted"
        );
        sleep(Duration::from_millis(20)).await;
    }
    let lb = acquired_within(&*b, &lock, "b", LEASE, "never free after the deletion").await;
    assert!(
        lb.token > la.token,
        "the token went back from {} to {} after the records were deleted",
        la.token,
        lb.token
    );
    assert!(b.release(&lb).await.unwrap());
}

/// A deletion of a lock's records (`cleanupPolicy: Delete`) that reaches the backend after the
/// claim its deleter took the lock with (a stalled clean-up, a request held up on the wire)
/// deletes nothing: by then another may hold the lock, and deleting would free its holding
/// while it still claims, for the next contender to take beside it.
pub async fn records_deleted_late_leave_the_next_holder(h: &mut dyn Harness) {
    let b = h.driver().await;
    let operator = FaultyDriver::wrap(h.driver().await);
    let lock = unique_lock("late-delete");
    let mut made = operator.deprovisions_made();
    operator.delay_deprovisions(LEASE + SLACK);
    let deleting = tokio::spawn({
        let (operator, lock) = (operator.clone(), lock.clone());
        async move { leasehold_lease::delete_records(&*operator, &lock, LEASE).await }
    });
    let operator_holds = Instant::now();
    while operator.observe(&lock).await.expect("observe").is_none() {
        assert!(
            operator_holds.elapsed() < SLACK,
            "the deleter never took the lock"
        );
        sleep(Duration::from_millis(10)).await;
    }
    // A long lease for b: a stall of the loaded machine between two renewals must not end it,
    // which the test would take for the late deletion's doing.
    let b_lease = LEASE * 5;
    let lb = acquired_within(
        &*b,
        &lock,
        "b",
        b_lease,
        "the deleter's lease never ran out",
    )
    .await;
    // b renews as a holder does, for as long as the deletion takes to land and a while after.
    let renewing = tokio::spawn({
        let (b, lb) = (b.clone(), lb.clone());
        async move {
            loop {
                sleep(RENEW).await;
                // A renewal the backend refuses is the claim lost; one that failed is retried.
                if let Ok(false) = b.renew(&lb, b_lease).await {
                    return;
                }
            }
        }
    });
    let deleted = deleting.await.expect("the deletion runs");
    assert!(
        deleted.is_err(),
        "a deletion made after its claim ran out was reported done: {deleted:?}"
    );
    // The deletion on the wire reaches the backend all the same.
    tokio::time::timeout(LEASE + SLACK * 2, made.wait_for(|made| *made > 0))
        .await
        .expect("the late deletion never reached the backend")
        .expect("the driver is kept");
    sleep(RENEW * 2).await;
    assert!(
        !renewing.is_finished(),
        "the late deletion ended b's claim: its renewal failed"
    );
    renewing.abort();
    let holder = b.observe(&lock).await.expect("observe");
    assert_eq!(
        holder.map(|h| (h.identity, h.token)),
        Some(("b".to_owned(), lb.token)),
        "the late deletion freed b's holding"
    );
    assert!(b.release(&lb).await.unwrap());
}

/// Every acquisition's token is greater than all before it: releases, expiries, many clients.
pub async fn tokens_strictly_increase(h: &mut dyn Harness) {
    let drivers = [h.driver().await, h.driver().await, h.driver().await];
    let lock = unique_lock("tokens");
    let short = Duration::from_millis(150);
    let mut last = 0;
    for round in 0..15 {
        let driver = &drivers[round % drivers.len()];
        // A lease to let expire is short; one to release outlasts the release on a busy
        // machine (a Sentinel acquisition waits for its replicas), so that it is still held.
        let expires = round % 3 == 2;
        let ttl = if expires { short } else { SLACK };
        let sent = Instant::now();
        let identity = format!("c{round}");
        // After an expiry the lock is free once the backend has seen the lease run out; after
        // a release, at once.
        let lease = if round % 3 == 0 && round > 0 {
            acquired_once_free(&**driver, &lock, &identity, ttl).await
        } else {
            acquired(&**driver, &lock, &identity, ttl).await
        };
        assert!(
            lease.token > last,
            "round {round}: {} after {last}",
            lease.token
        );
        last = lease.token;
        if expires {
            // Let it expire instead, the next contender watching (see
            // `only_holder_renews_or_releases`).
            let next = &drivers[(round + 1) % drivers.len()];
            let seen = next.observe(&lock).await.unwrap();
            assert!(
                seen.is_some() || sent.elapsed() >= short,
                "round {round}: the lease was gone {:?} after it was asked for, for {short:?}",
                sent.elapsed()
            );
            sleep(short + Duration::from_millis(50)).await;
        } else {
            assert!(driver.release(&lease).await.unwrap());
        }
    }
}

/// A holder that dies without releasing is replaced within lease + renew interval.
pub async fn crash_takeover_within_lease(h: &mut dyn Harness) {
    let lock = unique_lock("crash");
    let a = start(h.driver().await, &lock, "a", Mode::Campaign);
    eventually(SLACK, "a becomes holder", || a.answer().is_holder()).await;
    let Answer::Holder { token: ta, .. } = a.answer() else {
        unreachable!()
    };
    let b = start(h.driver().await, &lock, "b", Mode::Campaign);
    let slept = Instant::now();
    sleep(RENEW).await;
    // b read first: a holding of b's that began before a's answer would be two holders.
    let b_holds = b.answer().is_holder();
    let a_holds = a.answer().is_holder();
    assert!(!(b_holds && a_holds), "b holds while a does");
    // Unless the machine stalled past much of the lease (which lets b in rightly, a having
    // stopped claiming), b waits while a renews.
    if slept.elapsed() < LEASE / 2 {
        assert!(!b_holds, "b holds while a is alive");
    }
    drop(a); // the task is aborted: no release, like kill -9
    let took = eventually(
        LEASE + RENEW + SLACK,
        "b takes over after a crashed",
        || b.answer().is_holder(),
    )
    .await;
    let Answer::Holder { token: tb, .. } = b.answer() else {
        unreachable!()
    };
    assert!(tb > ta);
    assert!(took <= LEASE + RENEW + SLACK, "takeover took {took:?}");
}

/// A holder whose renewals stall (paused, partitioned) stops claiming before the backend lets
/// anyone else in, even when its last renewal's answer arrived late.
pub async fn paused_holder_fences_itself_first(h: &mut dyn Harness) {
    let lock = unique_lock("paused");
    let faulty = FaultyDriver::wrap(h.driver().await);
    let a = start(faulty.clone(), &lock, "a", Mode::Campaign);
    eventually(SLACK, "a becomes holder", || a.answer().is_holder()).await;
    // Answers now arrive 150 ms after the backend acted (within the renew budget): a holder
    // that dated its lease from the answer instead of the request would claim 150 ms too long,
    // far beyond its safety margin.
    faulty.delay_responses(Duration::from_millis(150));
    // Wait for a renewal that was sent after the delay began (the second new deadline).
    let mut a_state = a.watch();
    for _ in 0..2 {
        let before = a_state
            .borrow_and_update()
            .held
            .as_ref()
            .map(|h| h.valid_until);
        a_state
            .wait_for(|s| s.held.as_ref().map(|h| h.valid_until) != before)
            .await
            .expect("a renewed with a late answer");
    }
    assert!(a.answer().is_holder());
    faulty.stall_renewals(true);

    let b = start(h.driver().await, &lock, "b", Mode::Campaign);
    let mut b_events = b.events();
    let deadline = Instant::now() + LEASE + RENEW + SLACK;
    loop {
        let event = tokio::time::timeout_at(deadline, b_events.recv())
            .await
            .expect("b never acquired after a stalled")
            .expect("events");
        if event.kind == EventKind::Acquired {
            // b holds in the backend now; a must already have stopped claiming. Check the
            // self-fence deadline itself, not only the answer: a stalled renewal also makes the
            // answer "unknown", which would hide a deadline that is too late.
            let now = leasehold_lease::BootInstant::now();
            let snapshot = a.snapshot();
            assert!(
                !snapshot.answer_at(now).is_holder(),
                "a still claims: {snapshot:?}"
            );
            if let Some(held) = &snapshot.held {
                assert!(
                    held.valid_until <= now,
                    "a's lease was still valid for {:?} after b acquired",
                    held.valid_until.saturating_duration_since(now)
                );
            }
            break;
        }
    }
    let held = a.snapshot().held;
    assert!(
        held.is_none(),
        "a's holder task did not notice its lease ran out"
    );
}

/// Many contenders, many hand-overs: claimed intervals never overlap, tokens only go up.
pub async fn many_contenders(h: &mut dyn Harness) {
    contenders(h, 6, 4).await;
}

/// `n` on-demand contenders, `rounds` acquisitions each, all on one lock, on
/// [`STEADY_LEASE`].
pub async fn contenders(h: &mut dyn Harness, n: usize, rounds: usize) {
    contenders_on(h, n, rounds, STEADY_LEASE).await;
}

/// [`contenders`] while the backend's servers crash and come back: on the suite's short
/// lease, as a restarted server withholds its grants for a lease, and restarts following one
/// another on a long one would outlast the contenders' wait.
pub async fn contenders_under_faults(h: &mut dyn Harness, n: usize, rounds: usize) {
    contenders_on(h, n, rounds, LEASE).await;
}

async fn contenders_on(h: &mut dyn Harness, n: usize, rounds: usize, lease: Duration) {
    let lock = unique_lock("contenders");
    let mut locks = Vec::new();
    for i in 0..n {
        let config = config_on(&lock, &format!("c{i}"), Mode::OnDemand, lease);
        locks.push(Lock::start(h.driver().await, config, Arc::new(())).expect("start lock"));
    }
    let mut log = take_turns(locks, rounds).await;
    assert_eq!(log.len(), n * rounds);
    log.sort_by_key(|(start, ..)| *start);
    for pair in log.windows(2) {
        let ((_, end, _, t1), (start, _, _, t2)) = (pair[0], pair[1]);
        assert!(end <= start, "two holders at once (tokens {t1} and {t2})");
        assert!(t2 > t1, "token went from {t1} to {t2}");
    }
}

/// Each of `locks` (on-demand contenders) acquires `rounds` times, holds 10 ms and releases:
/// when each holding began and ended as its holder saw it, with its permit and token.
async fn take_turns(locks: Vec<Lock>, rounds: usize) -> Vec<(Instant, Instant, u32, u64)> {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, lock) in locks.into_iter().enumerate() {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let answer = lock
                    .acquire(Duration::from_secs(30), Duration::from_secs(30))
                    .await
                    .expect("acquire");
                let Some((permit, token)) = answer.holding() else {
                    panic!("contender {i} did not acquire: {answer:?}")
                };
                let start = Instant::now();
                sleep(Duration::from_millis(10)).await;
                assert!(
                    lock.answer().is_holder(),
                    "contender {i} lost the lock mid-work"
                );
                let end = Instant::now();
                assert!(lock.release().await.expect("release"));
                log.lock().unwrap().push((start, end, permit, token));
            }
            lock.shutdown().await;
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("contenders finished")
            .expect("contender panicked");
    }
    std::mem::take(&mut *log.lock().unwrap())
}

/// A release wakes a waiter promptly (notification, or fast polling), not at lease expiry.
pub async fn release_wakes_a_waiter(h: &mut dyn Harness) {
    // A long lease and renew interval: a waiter that polled would take most of a renew
    // interval (its first attempt was a moment before the release), and expiry the lease,
    // both far from a wake-up however loaded the machine. SQLite's waiters poll at most once a
    // second whatever the interval: its wake-ups are checked by the hand-over tests between
    // processes (tests/tests/handover.rs), by the median of several.
    const WAKE_LEASE: Duration = Duration::from_secs(60);
    const WAKE_RENEW: Duration = Duration::from_secs(20);
    const WOKEN_WITHIN: Duration = Duration::from_secs(5);
    let lock = unique_lock("handover");
    let start = |driver, identity| {
        let config = LockConfig {
            renew_interval: WAKE_RENEW,
            mode: Mode::Campaign,
            ..LockConfig::new(&lock, identity, WAKE_LEASE)
        };
        Lock::start(driver, config, Arc::new(())).expect("start lock")
    };
    let a = start(h.driver().await, "a");
    eventually(SLACK, "a becomes holder", || a.answer().is_holder()).await;
    let b = start(h.driver().await, "b");
    eventually(SLACK, "b sees a as holder", || {
        b.snapshot()
            .current_holder
            .is_some_and(|h| h.identity == "a")
    })
    .await;
    sleep(RENEW).await;
    assert!(a.release().await.unwrap());
    assert!(!a.answer().is_holder(), "a claims after releasing");
    let took = eventually(WAKE_LEASE, "b takes the released lock", || {
        b.answer().is_holder()
    })
    .await;
    assert!(took < WOKEN_WITHIN, "hand-over took {took:?}");
    sleep(RENEW).await;
    assert!(
        !a.answer().is_holder(),
        "a campaigned again during its cool-down"
    );
}

/// The backend goes away and comes back: nobody claims while it is gone, a holder reappears
/// after, and tokens continue from where they were.
pub async fn backend_outage_and_recovery(h: &mut dyn Harness) {
    let lock = unique_lock("outage");
    let a = start(h.driver().await, &lock, "a", Mode::Campaign);
    eventually(SLACK, "a becomes holder", || a.answer().is_holder()).await;
    let Answer::Holder { token: before, .. } = a.answer() else {
        unreachable!()
    };
    let b = start(h.driver().await, &lock, "b", Mode::Campaign);

    h.outage_begin().await;
    eventually(
        LEASE + SLACK,
        "a stops claiming while the backend is down",
        || !a.answer().is_holder(),
    )
    .await;
    eventually(LEASE + SLACK, "both report the backend unreachable", || {
        a.answer() == Answer::Unknown && b.answer() == Answer::Unknown
    })
    .await;
    assert!(!a.snapshot().ready() && !b.snapshot().ready());
    sleep(LEASE).await;
    assert!(!a.answer().is_holder() && !b.answer().is_holder());

    h.outage_end().await;
    let ended = Instant::now();
    eventually(LEASE + RENEW + SLACK * 2, "a holder after recovery", || {
        a.answer().is_holder() || b.answer().is_holder()
    })
    .await;
    let (aa, ba) = (a.answer(), b.answer());
    assert!(
        !(aa.is_holder() && ba.is_holder()),
        "two holders: {aa:?} {ba:?}"
    );
    let after = match (aa, ba) {
        (Answer::Holder { token, .. }, _) | (_, Answer::Holder { token, .. }) => token,
        _ => unreachable!(),
    };
    assert!(
        after > before,
        "token {after} after the outage, {before} before"
    );
    // Each lock's driver reconnects on its own schedule, so the one that did not take the lock
    // may answer later than the one that did: both are given the bound a holder has.
    let left = (LEASE + RENEW + SLACK * 2).saturating_sub(ended.elapsed());
    let within = left.max(RENEW + SLACK);
    let waiting = Instant::now();
    while !(a.snapshot().ready() && b.snapshot().ready()) {
        // What each lock last heard, so that a driver slow to reconnect says why.
        let said = |lock: &Lock| {
            let s = lock.snapshot();
            (s.contacted, s.backend_error, s.since.elapsed().ok())
        };
        assert!(
            waiting.elapsed() < within,
            "not ready again {:?} after the outage (contacted, error, for how long): a {:?}, b {:?}",
            ended.elapsed(),
            said(&a),
            said(&b)
        );
        sleep(Duration::from_millis(5)).await;
    }
}

/// A fair-queue driver (etcd, ZooKeeper) that counts how often a watch woke one of its waiters.
pub trait CountsWakeups: Driver {
    fn wakeups(&self) -> u64;
}

impl CountsWakeups for leasehold_lease::etcd::EtcdDriver {
    fn wakeups(&self) -> u64 {
        leasehold_lease::etcd::EtcdDriver::wakeups(self)
    }
}

impl CountsWakeups for leasehold_lease::zookeeper::ZooKeeperDriver {
    fn wakeups(&self) -> u64 {
        leasehold_lease::zookeeper::ZooKeeperDriver::wakeups(self)
    }
}

/// A fair queue's acquisition dropped while its place is being put (the engine's time budget, a
/// client that hung up), its wait then abandoned: the place leaves the line as soon as it is
/// put, and `other` takes the lock within `lease`, where a place left unasked would stand for
/// three. `dropped`'s attempt on `lock` must need a round trip (its session already open).
pub async fn a_place_put_for_a_dropped_acquisition_leaves_the_line(
    dropped: &dyn Driver,
    other: &dyn Driver,
    lock: &str,
    lease: Duration,
) {
    use futures_util::FutureExt;
    assert!(
        dropped
            .try_acquire(lock, "a", lease)
            .now_or_never()
            .is_none(),
        "an acquisition answers without a round trip"
    );
    dropped.abandon(lock, "a").await;
    let deadline = Instant::now() + lease;
    loop {
        match other.try_acquire(lock, "b", lease).await.unwrap() {
            Acquire::Acquired(_) => break,
            refused => assert!(
                Instant::now() < deadline,
                "the abandoned place still stands in line: {refused:?}"
            ),
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// A driver of a transport that keeps a line (etcd, ZooKeeper) that can put a place unknown to
/// itself, as a create or put whose answer never came back leaves one.
#[async_trait]
pub trait PutsUnknownPlaces: Driver {
    /// A place in `lock`'s line on this driver's own session that it does not know of: its name.
    async fn place_unknown_to_the_driver(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> String;
}

#[async_trait]
impl PutsUnknownPlaces for leasehold_lease::etcd::EtcdDriver {
    async fn place_unknown_to_the_driver(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> String {
        leasehold_lease::etcd::EtcdDriver::place_unknown_to_the_driver(self, lock, identity, ttl)
            .await
            .expect("an unknown place")
    }
}

#[async_trait]
impl PutsUnknownPlaces for leasehold_lease::zookeeper::ZooKeeperDriver {
    async fn place_unknown_to_the_driver(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> String {
        leasehold_lease::zookeeper::ZooKeeperDriver::place_unknown_to_the_driver(
            self, lock, identity, ttl,
        )
        .await
        .expect("an unknown place")
    }
}

/// A place in a lock's line on `a`'s own session that `a`'s driver does not know of (a create
/// or put whose answer never came back, landing after the process gave it up) is deleted once
/// it stands first in line, by `a`'s next attempt (`owner_waits`) or, when `a`'s engine is idle
/// and `c` waits, `a`'s next look at the holder. `a` meanwhile holds and renews another lock,
/// so that its session lives on: the place would hold the lock for nobody for as long as the
/// process runs. `client` makes a driver, one per process.
pub async fn an_unknown_place_of_its_own_is_cleared<D: PutsUnknownPlaces + 'static>(
    client: impl Fn() -> D,
    owner_waits: bool,
) {
    let lease = Duration::from_secs(3);
    let owner = Arc::new(client());
    let [a, b, c]: [Arc<dyn Driver>; 3] = [owner.clone(), Arc::new(client()), Arc::new(client())];
    let lock = unique_lock("unknown-place");
    let Acquire::Acquired(held) = b.try_acquire(&lock, "b", lease).await.expect("b") else {
        panic!("b could not take the free lock");
    };
    let Acquire::Acquired(kept) = a
        .try_acquire(&unique_lock("other"), "a", lease)
        .await
        .expect("a")
    else {
        panic!("a could not take a free lock");
    };
    let renewing = {
        let a = a.clone();
        tokio::spawn(async move {
            loop {
                sleep(lease / 6).await;
                assert!(
                    a.renew(&kept, lease).await.expect("renewal"),
                    "a lost its other lock"
                );
            }
        })
    };
    let unknown = owner.place_unknown_to_the_driver(&lock, "a", lease).await;
    let (waiter, name) = if owner_waits { (&a, "a") } else { (&c, "c") };
    assert!(matches!(
        waiter
            .try_acquire(&lock, name, lease)
            .await
            .expect("queues"),
        Acquire::Busy(_)
    ));
    assert!(b.release(&held).await.expect("release"));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if !owner_waits {
            // The owner's engine is idle: it only looks at the holder now and then.
            a.observe(&lock).await.expect("observe");
        }
        match waiter
            .try_acquire(&lock, name, lease)
            .await
            .expect("attempt")
        {
            Acquire::Acquired(_) => break,
            Acquire::Busy(holder) => assert!(
                Instant::now() < deadline,
                "{unknown}, unknown to a's driver, still blocks the lock (holder {holder:?})"
            ),
            Acquire::Withheld(w) => panic!("withheld: {w:?}"),
        }
        sleep(Duration::from_millis(50)).await;
    }
    assert!(!renewing.is_finished(), "a's renewals stopped");
    renewing.abort();
}

/// Fifty waiters queue behind a holder (each its own client, as separate processes would be);
/// its release wakes the first of them and nobody else, and that one holds with the next token.
pub async fn one_release_wakes_exactly_one_waiter<D: CountsWakeups>(client: impl Fn() -> D) {
    const WAITERS: usize = 50;
    // Nothing renews the holder or the waiters' places: long enough to outlast fifty sessions
    // opened one after another on a slow machine, within ZooKeeper's default
    // `maxSessionTimeout` (40 s).
    const TTL: Duration = Duration::from_secs(30);
    let lock = unique_lock("herd");
    let holder = client();
    let Acquire::Acquired(lease) = holder.try_acquire(&lock, "holder", TTL).await.unwrap() else {
        panic!("the first contender must hold")
    };
    let mut waiters = Vec::new();
    for i in 0..WAITERS {
        let waiter = client();
        let identity = format!("w{i}");
        // Fifty sessions opened at once on a busy machine: a first call may find its session
        // not yet up (an error, nothing queued); it is tried again, within a loose bound.
        let started = Instant::now();
        let busy = loop {
            match waiter.try_acquire(&lock, &identity, TTL).await {
                Err(leasehold_lease::Error::Unreachable(e))
                    if started.elapsed() < Duration::from_secs(30) =>
                {
                    tracing::debug!(%identity, error = %e, "waiter's session not up yet");
                    sleep(Duration::from_millis(200)).await;
                }
                other => break other.unwrap(),
            }
        };
        assert!(
            matches!(busy, Acquire::Busy(Some(_))),
            "{identity}: {busy:?}"
        );
        waiters.push((waiter, identity));
    }
    sleep(Duration::from_millis(300)).await;
    let woken = || waiters.iter().map(|(w, _)| w.wakeups()).sum::<u64>();
    assert_eq!(woken(), 0, "waiters woke before any release");

    assert!(holder.release(&lease).await.unwrap());
    eventually(Duration::from_secs(5), "the first waiter is woken", || {
        waiters[0].0.wakeups() > 0
    })
    .await;
    sleep(Duration::from_millis(500)).await;
    assert_eq!(woken(), 1, "one release woke {} waiters", woken());

    let (first, identity) = &waiters[0];
    let Acquire::Acquired(next) = first.try_acquire(&lock, identity, TTL).await.unwrap() else {
        panic!("the woken waiter is not the holder")
    };
    assert!(next.token > lease.token);
    // The others are still behind it, in order.
    let (second, identity) = &waiters[1];
    assert!(matches!(
        second.try_acquire(&lock, identity, TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
}

/// A waiter further back than next in line answers its engine's polls without a request while
/// its predecessor's watch stands; the next in line reads the queue at every poll (which also
/// shows that `requests`, the server's own count of what it received, sees polls at all).
pub async fn waiters_further_back_poll_quietly<D: CountsWakeups>(
    client: impl Fn() -> D,
    requests: impl Fn() -> u64,
) {
    const POLLS: u64 = 30;
    // Long, so that no keep-alive or ping of the session falls inside the counted polls.
    const TTL: Duration = Duration::from_secs(20);
    let lock = unique_lock("quiet");
    let (holder, next, back) = (client(), client(), client());
    let Acquire::Acquired(lease) = holder.try_acquire(&lock, "holder", TTL).await.unwrap() else {
        panic!("the first contender must hold")
    };
    for (waiter, identity) in [(&next, "next"), (&back, "back")] {
        let busy = waiter.try_acquire(&lock, identity, TTL).await.unwrap();
        assert!(
            matches!(&busy, Acquire::Busy(Some(h)) if h.identity == "holder"),
            "{identity}: {busy:?}"
        );
    }
    // The watches register in tasks of their own: counted from the first poll that goes without
    // a request (a loaded machine may take a while to start them). Reading the count may cost
    // a request of its own (ZooKeeper's `mntr` is a packet).
    let reading = {
        let first = requests();
        requests() - first
    };
    let registering = Instant::now();
    loop {
        let before = requests();
        let busy = back.try_acquire(&lock, "back", TTL).await.unwrap();
        assert!(
            matches!(&busy, Acquire::Busy(Some(h)) if h.identity == "holder"),
            "back: {busy:?}"
        );
        if requests() - before <= reading {
            break;
        }
        assert!(
            registering.elapsed() < TTL / 2,
            "no poll further back went without a request"
        );
        sleep(Duration::from_millis(20)).await;
    }

    let before = requests();
    for _ in 0..POLLS {
        let busy = back.try_acquire(&lock, "back", TTL).await.unwrap();
        assert!(
            matches!(&busy, Acquire::Busy(Some(h)) if h.identity == "holder"),
            "back: {busy:?}"
        );
    }
    let quiet = requests() - before;
    assert!(
        quiet < POLLS / 10,
        "{POLLS} polls further back cost the backend {quiet} requests"
    );

    let before = requests();
    for _ in 0..POLLS {
        let busy = next.try_acquire(&lock, "next", TTL).await.unwrap();
        assert!(matches!(busy, Acquire::Busy(Some(_))), "next: {busy:?}");
    }
    let read = requests() - before;
    assert!(
        read >= POLLS,
        "{POLLS} polls by the next in line cost only {read} requests"
    );

    // The quiet waiter still moves up: the release wakes the next in line, whose release
    // wakes the one further back, each through its watch.
    assert!(holder.release(&lease).await.unwrap());
    eventually(Duration::from_secs(5), "the next in line is woken", || {
        next.wakeups() > 0
    })
    .await;
    let Acquire::Acquired(second) = next.try_acquire(&lock, "next", TTL).await.unwrap() else {
        panic!("the next in line did not take over")
    };
    assert!(next.release(&second).await.unwrap());
    eventually(
        Duration::from_secs(5),
        "the waiter further back is woken",
        || back.wakeups() > 0,
    )
    .await;
    let Acquire::Acquired(third) = back.try_acquire(&lock, "back", TTL).await.unwrap() else {
        panic!("the waiter further back did not take over")
    };
    assert!(third.token > second.token && second.token > lease.token);
    assert!(back.release(&third).await.unwrap());
}

/// Pod `identity`'s family `family` on `driver`, with the suite's lease and `permits` per key.
fn keyed_pod(
    driver: Arc<dyn Backend>,
    family: &str,
    identity: &str,
    permits: u32,
) -> leasehold_lease::keyed::KeyedFamily {
    keyed_pod_on(driver, family, identity, permits, LEASE)
}

/// [`keyed_pod`] with a lease of `lease`.
fn keyed_pod_on(
    driver: Arc<dyn Backend>,
    family: &str,
    identity: &str,
    permits: u32,
    lease: Duration,
) -> leasehold_lease::keyed::KeyedFamily {
    leasehold_lease::keyed::KeyedFamily::new(
        driver,
        leasehold_lease::keyed::FamilyConfig {
            renew_interval: RENEW,
            permits,
            ..leasehold_lease::keyed::FamilyConfig::new(family, identity, lease)
        },
        Arc::new(()),
    )
    .expect("family")
}

/// `family`'s answer about `owner`'s holding of `key`, once it can tell: an engine whose renewal
/// missed its budget on a loaded machine answers "unknown" until the next one lands, which is
/// not the answer under test. After a lease of "unknown", that is the answer.
async fn status_told(
    family: &leasehold_lease::keyed::KeyedFamily,
    key: &str,
    owner: &str,
) -> Result<leasehold_lease::keyed::KeyAnswer, leasehold_lease::keyed::KeyError> {
    let until = Instant::now() + LEASE;
    loop {
        let answer = family.status(key, Some(owner));
        if !matches!(answer, Ok(leasehold_lease::keyed::KeyAnswer::Unknown))
            || Instant::now() >= until
        {
            return answer;
        }
        sleep(Duration::from_millis(20)).await;
    }
}

/// Who holds `key`'s permits, as the backend reports them, sorted.
async fn permit_holders(family: &leasehold_lease::keyed::KeyedFamily, key: &str) -> Vec<String> {
    let mut holders: Vec<String> = family
        .observe_permits(key)
        .await
        .unwrap()
        .into_iter()
        .map(|h| h.identity)
        .collect();
    holders.sort();
    holders
}

/// Keyed locks on this backend: owners exclude each other whether they share a pod or not, a
/// key is re-entrant for its owner only, only its owner releases it, a key passes to the next
/// owner (of the same pod, then of another) with a higher token, a hold that lapses frees the
/// key (for every pod, its own included), keys are independent, and a bad key changes nothing.
pub async fn keyed_owners_exclude_each_other(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{KeyAnswer, KeyError, KeyRelease};
    const HOLD: Duration = Duration::from_secs(60);
    let family = unique_lock("keyed");
    let (a, b) = (
        keyed_pod_on(h.driver().await, &family, "pod-a", 1, STEADY_LEASE),
        keyed_pod_on(h.driver().await, &family, "pod-b", 1, STEADY_LEASE),
    );
    let token = |answer: KeyAnswer| match answer {
        KeyAnswer::Held { token, .. } => token,
        other => panic!("not held: {other:?}"),
    };
    let key = "order-1234";
    let first = token(a.acquire(key, "w1", Duration::ZERO, HOLD).await.unwrap());
    assert!(
        matches!(
            a.acquire(key, "w2", Duration::ZERO, HOLD).await.unwrap(),
            KeyAnswer::HeldByAnother { holder: Some(ref h) } if h == "pod-a/w1"
        ),
        "a second owner of the same pod took a held key"
    );
    assert!(
        matches!(
            b.acquire(key, "w3", Duration::ZERO, HOLD).await.unwrap(),
            KeyAnswer::HeldByAnother { .. }
        ),
        "an owner of another pod took a held key"
    );
    assert!(matches!(
        a.acquire(key, "w1", Duration::ZERO, HOLD).await.unwrap(),
        KeyAnswer::Held { holds: 2, .. }
    ));
    assert_eq!(
        a.release(key, "w2").await.unwrap(),
        KeyRelease::HeldByAnother {
            holder: "pod-a/w1".into()
        }
    );
    assert_eq!(b.release(key, "w1").await.unwrap(), KeyRelease::NotHeld);
    assert!(matches!(
        status_told(&a, key, "w1").await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    // Another key is another lock. Eight owners, each on a key of its own, take and give back
    // their key in a tight loop, never finding their own last holding in the way.
    let cyclers: Vec<_> = (0..8)
        .map(|i| {
            let b = b.clone();
            tokio::spawn(async move {
                let (key, owner) = (format!("sku-{i}"), format!("c{i}"));
                let mut last = 0;
                for round in 0..20 {
                    // "Cannot tell" is an honest answer when the backend is slow to answer (eight
                    // writers on one SQLite file): ask again, as a client would. The attempt
                    // that could not tell may have taken the key all the same, for this owner,
                    // until its lease runs out: that is the only other holder a retry may meet.
                    // Exclusivity and the tokens are what this checks.
                    let mut unknown_since = None::<tokio::time::Instant>;
                    let next = loop {
                        let answer = b.acquire(&key, &owner, Duration::ZERO, HOLD).await;
                        let retry = match &answer {
                            Ok(KeyAnswer::Held { token, .. }) => break *token,
                            Ok(KeyAnswer::Unknown) => true,
                            Ok(KeyAnswer::HeldByAnother { holder }) => {
                                let own = format!("pod-b/{owner}");
                                unknown_since.is_some()
                                    && holder.as_deref().is_none_or(|h| h == own)
                            }
                            _ => false,
                        };
                        let since = *unknown_since.get_or_insert_with(tokio::time::Instant::now);
                        if !retry || since.elapsed() > STEADY_LEASE + SLACK {
                            panic!("{key} round {round}: {answer:?}");
                        }
                        sleep(Duration::from_millis(20)).await;
                    };
                    assert!(
                        next > last,
                        "{key} round {round}: token {next} after {last}"
                    );
                    last = next;
                    assert_eq!(
                        b.release(&key, &owner).await.unwrap(),
                        KeyRelease::Released { holds: 0 }
                    );
                }
            })
        })
        .collect();
    for cycler in cyclers {
        cycler.await.expect("cycling owner");
    }

    // w2 (same pod) waits; w1 lets go twice; w2 gets the key with a higher token.
    let waiting = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire(key, "w2", STEADY_LEASE + SLACK, HOLD).await })
    };
    sleep(Duration::from_millis(100)).await;
    assert_eq!(
        a.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 1 }
    );
    assert_eq!(
        a.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let second = token(waiting.await.unwrap().unwrap());
    assert!(second > first, "token {second} after {first}");

    // An owner of pod b waits; w2 lets go; it gets the key with a higher token still.
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire(key, "w4", STEADY_LEASE + SLACK, HOLD).await })
    };
    sleep(Duration::from_millis(100)).await;
    assert_eq!(
        a.release(key, "w2").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let third = token(waiting.await.unwrap().unwrap());
    assert!(third > second, "token {third} after {second}");
    assert!(matches!(a.status(key, None).unwrap(), KeyAnswer::NotHeld));

    // An extension never shortens a hold: w4 keeps the key past a shorter one.
    assert!(matches!(
        b.extend(key, "w4", Duration::from_millis(300))
            .await
            .unwrap(),
        KeyAnswer::Held { .. }
    ));
    sleep(Duration::from_millis(400)).await;
    assert!(
        matches!(
            status_told(&b, key, "w4").await.unwrap(),
            KeyAnswer::Held { .. }
        ),
        "a shorter extension cut w4's hold short"
    );
    // A hold that lapses without a release or an extension frees the key.
    assert_eq!(
        b.release(key, "w4").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let short = token(
        b.acquire(key, "w4", STEADY_LEASE + SLACK, Duration::from_millis(300))
            .await
            .unwrap(),
    );
    assert!(short > third, "token {short} after {third}");
    let third = short;
    let fourth = token(
        a.acquire(
            key,
            "w5",
            Duration::from_millis(300) + STEADY_LEASE + SLACK,
            HOLD,
        )
        .await
        .unwrap(),
    );
    assert!(fourth > third, "token {fourth} after {third}");
    assert_eq!(b.release(key, "w4").await.unwrap(), KeyRelease::NotHeld);

    // Bad input changes nothing.
    for bad in ["", "has space", &"k".repeat(500)] {
        assert!(matches!(
            a.acquire(bad, "w1", Duration::ZERO, HOLD).await,
            Err(KeyError::BadKey { .. })
        ));
    }
    assert!(matches!(
        a.acquire(key, "", Duration::ZERO, HOLD).await,
        Err(KeyError::BadOwner(_))
    ));
    assert!(matches!(
        status_told(&a, key, "w5").await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    // The lapsed holding is gone from its own pod too: the pod's next owner gets the key as
    // soon as it is free.
    assert_eq!(
        a.release(key, "w5").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let fifth = token(
        b.acquire(key, "w6", STEADY_LEASE + SLACK, HOLD)
            .await
            .unwrap(),
    );
    assert!(fifth > fourth, "token {fifth} after {fourth}");
    assert_eq!(
        b.release(key, "w6").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Lock names are told apart by case (`orders` and `Orders` are two families): a sweep of one
/// family's idle keys forgets none of the other's, whose tokens would then start again below
/// those its holders carried.
pub async fn families_apart_by_case_are_swept_apart(h: &mut dyn Harness) {
    let driver = h.driver().await;
    let family = unique_lock("case");
    let other = family.to_uppercase();
    assert_ne!(family, other);
    // Each family's floor is made by a first sweep, as an idle sweep does.
    for name in [&family, &other] {
        driver
            .forget_idle_keys(name, Duration::ZERO)
            .await
            .expect("sweep");
    }
    let lock = format!("{family}.keys.k");
    let mut last = 0;
    for _ in 0..3 {
        let lease = acquired(&*driver, &lock, "a", LEASE).await;
        last = lease.token;
        assert!(driver.release(&lease).await.expect("release"));
    }
    driver
        .forget_idle_keys(&other, Duration::ZERO)
        .await
        .expect("sweep");
    let again = acquired(&*driver, &lock, "a", LEASE).await;
    assert!(
        again.token > last,
        "{lock} drew token {} after {last}, once the family {other} was swept",
        again.token
    );
    assert!(driver.release(&again).await.expect("release"));
}

/// A family's keys taken and released over and over while idle keys are forgotten as fast as
/// the backend allows ([`Driver::forget_idle_keys`] with no idle time at all, from another
/// client): every key's tokens still rise, and each key is free again after its release. On
/// the backends that delete idle keys' records this races every acquisition against the floor
/// that keeps their tokens rising; on the others it checks that nothing else changes.
pub async fn idle_keys_are_forgotten_and_their_tokens_still_rise(h: &mut dyn Harness) {
    const KEYS: usize = 4;
    const ROUNDS: usize = 12;
    let family = unique_lock("sweep");
    let sweeper_driver = h.driver().await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweeper = {
        let (family, done) = (family.clone(), done.clone());
        tokio::spawn(async move {
            let mut forgotten = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                // A failed sweep (a busy SQLite file) changes nothing; the next one goes on.
                forgotten += sweeper_driver
                    .forget_idle_keys(&family, Duration::ZERO)
                    .await
                    .unwrap_or(0);
                sleep(Duration::from_millis(5)).await;
            }
            forgotten
        })
    };
    let mut cyclers = Vec::new();
    for i in 0..KEYS {
        let driver = h.driver().await;
        let lock = format!("{family}.keys.k-{i}");
        cyclers.push(tokio::spawn(async move {
            let mut last = 0;
            for round in 0..ROUNDS {
                let started = Instant::now();
                let lease = loop {
                    match driver.try_acquire(&lock, "cycler", LEASE).await {
                        Ok(Acquire::Acquired(lease)) => break lease,
                        // A slow or busy backend: ask again, as the engine would.
                        Ok(Acquire::Busy(None) | Acquire::Withheld(_)) | Err(_) => {}
                        Ok(Acquire::Busy(Some(holder))) => {
                            panic!("{lock} round {round}: held by {holder:?} after its release")
                        }
                    }
                    assert!(
                        started.elapsed() < LEASE + SLACK,
                        "{lock} round {round}: not free again"
                    );
                    sleep(Duration::from_millis(10)).await;
                };
                assert!(
                    lease.token > last,
                    "{lock} round {round}: token {} after {last}",
                    lease.token
                );
                last = lease.token;
                assert!(driver.release(&lease).await.expect("release"));
                // Every other round, idle long enough for a sweep to forget the key; else taken
                // again at once, racing the sweeps.
                if round % 2 == 0 {
                    sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    for cycler in cyclers {
        cycler.await.expect("cycler");
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    sweeper.await.expect("sweeper");
}

/// A family's held keys are counted across processes, a hashed key's too, and nothing else:
/// not a released key, not a contender queued behind a holder, not a key of a family whose name
/// starts the same, not a plain lock. On a Redis Cluster the keys are spread over every
/// master's slots, and each master is counted.
pub async fn held_keys_are_counted(h: &mut dyn Harness) {
    // Held for far longer than the test runs: a key that expired while a loaded machine
    // stalled the test would be counted out, and a contender would take it.
    const HELD: Duration = Duration::from_secs(60);
    let family = unique_lock("count");
    let (a, b) = (h.driver().await, h.driver().await);
    let count = async || a.count_held_keys(&family).await.expect("count");
    assert_eq!(count().await, Some(0), "a family never used");
    let take = async |driver: &Arc<dyn Backend>, lock: &str| match driver
        .try_acquire(lock, "owner", HELD)
        .await
    {
        Ok(Acquire::Acquired(lease)) => lease,
        other => panic!("{lock}: {other:?}"),
    };
    let keys = [
        format!("{family}.keys.k-0"),
        format!("{family}.keys.k-1"),
        format!("{family}.keyh.0123456789abcdef"),
    ];
    let mut held = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        held.push(take(if i == 0 { &a } else { &b }, key).await);
    }
    let decoys = [format!("{family}x.keys.k-0"), family.clone()];
    for decoy in &decoys {
        take(&a, decoy).await;
    }
    assert_eq!(count().await, Some(3), "three keys held in two processes");
    // A contender queued behind a holder (etcd, ZooKeeper) adds no key.
    match b.try_acquire(&keys[0], "other", HELD).await {
        Ok(Acquire::Busy(_)) => {}
        other => panic!("{}: {other:?}", keys[0]),
    }
    b.abandon(&keys[0], "other").await;
    assert_eq!(count().await, Some(3), "a contender counted as a key");
    assert!(b.release(&held[1]).await.expect("release"));
    assert_eq!(count().await, Some(2), "a released key still counted");
}

/// A family with `permits: 3`: three owners (of two pods) hold a key at once, each on a permit
/// of its own; a fourth is refused; an owner holds one permit (re-entrant on it, refused on a
/// try-once); a permit given up goes to a waiting owner with a token above the permit's last;
/// a crashed pod's permit is free within the lease; lowering the permits revokes no holding.
pub async fn keyed_permits_admit_that_many_owners(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease};
    const HOLD: Duration = Duration::from_secs(60);
    const NOW: Duration = Duration::ZERO;
    let family = unique_lock("permits");
    // The steady lease: a scenario this long on one-second leases meets a loaded machine's
    // stalls, whose backend errors make an answer unknown for a moment. The crash at the end
    // runs on a family of its own, on the suite's lease.
    let (a, b) = (
        keyed_pod_on(h.driver().await, &family, "pod-a", 3, STEADY_LEASE),
        keyed_pod_on(h.driver().await, &family, "pod-b", 3, STEADY_LEASE),
    );
    let held = |answer: KeyAnswer| match answer {
        KeyAnswer::Held { permit, token, .. } => (permit, token),
        other => panic!("not held: {other:?}"),
    };
    let key = "pool";
    let (p1, t1) = held(a.acquire(key, "w1", NOW, HOLD).await.unwrap());
    let (p2, t2) = held(a.acquire(key, "w2", NOW, HOLD).await.unwrap());
    let (p3, _) = held(b.acquire(key, "w3", NOW, HOLD).await.unwrap());
    let mut permits = [p1, p2, p3];
    permits.sort_unstable();
    assert_eq!(permits, [0, 1, 2], "three owners on three permits");
    for pod in [&a, &b] {
        let answer = pod.acquire(key, "w4", NOW, HOLD).await.unwrap();
        assert!(
            matches!(answer, KeyAnswer::HeldByAnother { .. }),
            "a fourth owner of {}: {answer:?}",
            pod.identity()
        );
    }
    // Another key, every permit held in pod a: pod b is refused each of them.
    for owner in ["x1", "x2", "x3"] {
        held(a.acquire("elsewhere", owner, NOW, HOLD).await.unwrap());
    }
    let refused = b.acquire("elsewhere", "y", NOW, HOLD).await.unwrap();
    assert!(
        matches!(refused, KeyAnswer::HeldByAnother { .. }),
        "{refused:?}"
    );
    assert_eq!(
        permit_holders(&b, key).await,
        ["pod-a/w1", "pod-a/w2", "pod-b/w3"]
    );
    let again = a.acquire(key, "w1", NOW, HOLD).await.unwrap();
    assert!(
        matches!(again, KeyAnswer::Held { holds: 2, permit, token, .. } if permit == p1 && token == t1),
        "an owner acquiring again keeps its permit: {again:?}"
    );
    assert!(matches!(
        a.try_acquire_once(key, "w1", HOLD).await.unwrap(),
        KeyAnswer::HeldByAnother { .. }
    ));

    // w4 of pod b waits; w2 of pod a gives its permit up; w4 gets it, with a higher token.
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire(key, "w4", LEASE + SLACK, HOLD).await })
    };
    sleep(Duration::from_millis(100)).await;
    assert_eq!(
        a.release(key, "w2").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let (p4, t4) = held(waiting.await.expect("waiter").unwrap());
    assert_eq!(p4, p2, "the waiter takes the permit given up");
    assert!(t4 > t2, "permit {p4}: token {t4} after {t2}");

    // w1 gives its permit up: w5 of pod b takes it.
    for holds in [1, 0] {
        assert_eq!(
            a.release(key, "w1").await.unwrap(),
            KeyRelease::Released { holds }
        );
    }
    let (p5, _) = held(b.acquire(key, "w5", NOW, HOLD).await.unwrap());
    assert_eq!(p5, p1, "w5 takes the permit given up");

    // One permit from now on: the three holders keep theirs, a new owner waits for all to go.
    b.reconfigure(FamilyConfig {
        permits: 1,
        ..b.config()
    })
    .unwrap();
    for owner in ["w3", "w4", "w5"] {
        assert!(matches!(
            status_told(&b, key, owner).await.unwrap(),
            KeyAnswer::Held { .. }
        ));
    }
    assert!(matches!(
        b.acquire(key, "w6", NOW, HOLD).await.unwrap(),
        KeyAnswer::HeldByAnother { .. }
    ));
    for owner in ["w3", "w4", "w5"] {
        assert_eq!(
            b.release(key, owner).await.unwrap(),
            KeyRelease::Released { holds: 0 }
        );
    }
    // Nothing is kept for permits given back, nor for attempts refused.
    eventually(SLACK, "pod b keeps no state for its free permits", || {
        b.tracked_keys() == 0
    })
    .await;
    let (p6, _) = held(b.acquire(key, "w6", NOW, HOLD).await.unwrap());
    assert_eq!(p6, 0, "one permit: permit 0");
    assert_eq!(b.tracked_keys(), 1);

    // A pod dies without a word: its owner's permit is free within the lease, for an owner of
    // another pod whose other permits are held.
    let family = unique_lock("permits-lease");
    let (a, b) = (
        keyed_pod(h.driver().await, &family, "pod-a", 3),
        keyed_pod(h.driver().await, &family, "pod-b", 3),
    );
    for owner in ["w3", "w4"] {
        held(b.acquire(key, owner, NOW, HOLD).await.unwrap());
    }
    let (p1, t1) = held(a.acquire(key, "w1", NOW, HOLD).await.unwrap());
    drop(a);
    let crashed = Instant::now();
    let (p5, t5) = loop {
        match b
            .acquire(key, "w5", LEASE + RENEW + SLACK, HOLD)
            .await
            .unwrap()
        {
            KeyAnswer::Held { permit, token, .. } => break (permit, token),
            KeyAnswer::Unknown if crashed.elapsed() < LEASE + RENEW + SLACK => {}
            other => panic!("w5 after pod a crashed: {other:?}"),
        }
    };
    assert_eq!(p5, p1, "the crashed holder's permit");
    assert!(t5 > t1, "permit {p5}: token {t5} after {t1}");
    assert!(
        crashed.elapsed() <= LEASE + RENEW + SLACK,
        "took {:?}",
        crashed.elapsed()
    );
}

/// A semaphore's waiters each get a permit as permits are given up. Where the backend keeps a
/// queue (etcd, ZooKeeper) they are served first come first served: the first in line takes the
/// next permit given up, before a newcomer that asks right after the release and before the
/// waiters behind it, of its own pod or another.
pub async fn keyed_semaphore_waiters_are_served_in_order(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{KeyAnswer, KeyRelease, KeyedFamily};
    const HOLD: Duration = Duration::from_secs(60);
    const WAIT: Duration = Duration::from_secs(60);
    let family = unique_lock("line");
    let key = "pool";
    // The steady lease: a session of the backend's lost to a loaded machine's stall would take a
    // waiter's places in line with it.
    let pod =
        |driver: Arc<dyn Backend>, name: &str| keyed_pod_on(driver, &family, name, 2, STEADY_LEASE);
    let (fb, fc) = (
        FaultyDriver::wrap(h.driver().await),
        FaultyDriver::wrap(h.driver().await),
    );
    let (a, b, c, d) = (
        pod(h.driver().await, "pod-a"),
        pod(fb.clone(), "pod-b"),
        pod(fc.clone(), "pod-c"),
        pod(h.driver().await, "pod-d"),
    );
    let in_order = fb.keeps_queue();
    let held = |answer: KeyAnswer| match answer {
        KeyAnswer::Held { permit, token, .. } => (permit, token),
        other => panic!("not held: {other:?}"),
    };
    let (p1, _) = held(a.acquire(key, "h1", Duration::ZERO, HOLD).await.unwrap());
    let (p2, _) = held(a.acquire(key, "h2", Duration::ZERO, HOLD).await.unwrap());
    let waiter = |pod: &KeyedFamily, owner: &'static str| {
        let pod = pod.clone();
        tokio::spawn(async move { pod.acquire(key, owner, WAIT, HOLD).await })
    };
    // The attempts at each of `permits` by `owner` that the backend has answered, at least
    // `rounds` each: a waiter's place stands in a permit's line once its attempt there is
    // answered. (A permit held in the owner's own pod is refused without asking the backend.)
    let tried = |faulty: &FaultyDriver, pod: &KeyedFamily, owner: &str, permits: &[u32], rounds| {
        let identity = format!("{}/{owner}", pod.identity());
        permits.iter().all(|&permit| {
            let lock = pod.permit_backend_name(key, permit).unwrap();
            faulty.answered(&lock, &identity) >= rounds
        })
    };
    // The first in line, on a queue backend, has tried each permit twice: once on its own, once
    // first in line, keeping its places.
    let first_rounds = if in_order { 2 } else { 1 };

    let w1 = waiter(&b, "w1");
    eventually(WAIT, "w1 waits, having tried every permit", || {
        tried(&fb, &b, "w1", &[0, 1], first_rounds)
    })
    .await;
    // Pod b cut off from the backend while h1 gives its permit up and a newcomer asks: only
    // the place w1 keeps in the backend can refuse the newcomer.
    fb.cut_off(true);
    assert_eq!(
        a.release(key, "h1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let newcomer = d.acquire(key, "n", Duration::ZERO, HOLD).await.unwrap();
    fb.cut_off(false);
    if in_order {
        assert!(
            matches!(newcomer, KeyAnswer::HeldByAnother { .. }),
            "a newcomer took the permit w1 waits for: {newcomer:?}"
        );
    } else if matches!(newcomer, KeyAnswer::Held { .. }) {
        d.release(key, "n").await.unwrap();
    }
    let (w1_permit, _) = held(w1.await.expect("w1").unwrap());
    if in_order {
        assert_eq!(w1_permit, p1, "w1 takes the permit given up");
    }
    // Served in line, w1 gives its permit up and takes it again at once: nothing of its turn in
    // line stands in its way.
    assert_eq!(
        b.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let again = b.acquire(key, "w1", WAIT, HOLD).await.unwrap();
    assert!(
        matches!(again, KeyAnswer::Held { permit, .. } if permit == w1_permit),
        "w1 again, its permit free: {again:?}"
    );

    // w2 (pod c) waits first in line; then w3 (pod b, which holds w1's permit) lines up.
    let w2 = waiter(&c, "w2");
    eventually(WAIT, "w2 waits, having tried every permit", || {
        tried(&fc, &c, "w2", &[0, 1], first_rounds)
    })
    .await;
    // w1's line given up in pod b: w3 tries the permits before it lines up.
    eventually(SLACK, "pod b keeps only w1's permit", || {
        b.tracked_keys() == 1
    })
    .await;
    let w3 = waiter(&b, "w3");
    eventually(
        WAIT,
        "w3 waits, having tried the permit w1 does not hold",
        || tried(&fb, &b, "w3", &[1 - w1_permit], 1),
    )
    .await;
    // On a queue backend, w3 then stands in the line, behind w2: its place in the backend's
    // line is answered once it holds pod b's place (the line's local slot).
    if in_order {
        let line = b.line_backend_name(key).unwrap();
        eventually(WAIT, "w3 stands in line", || {
            fb.answered(&line, "pod-b/w3") >= 1
        })
        .await;
    }
    // On a queue backend, w4 lines up in pod b behind w3, of the same pod.
    let w4 = in_order.then(|| waiter(&b, "w4"));
    if in_order {
        eventually(WAIT, "w4 waits", || b.waiting_owners() == 2).await;
        // From its count as waiting to its place in the pod's line is a few steps without a
        // wait: far within this.
        sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        a.release(key, "h2").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let mut w2 = Some(w2);
    let mut w2_permit = None;
    if in_order {
        let taken = w2.take().expect("w2");
        let (permit, _) = held(taken.await.expect("w2").unwrap());
        assert_eq!(permit, p2, "w2 takes the permit given up");
        assert!(
            !w3.is_finished(),
            "w3 was served before w2, who waited longer"
        );
        w2_permit = Some(permit);
    }
    // w1 gives its permit up: the last waiter takes it.
    assert_eq!(
        b.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    if let Some(w2) = w2 {
        w2_permit = Some(held(w2.await.expect("w2").unwrap()).0);
    }
    let (w3_permit, _) = held(w3.await.expect("w3").unwrap());
    assert_ne!(Some(w3_permit), w2_permit, "w2 and w3 on one permit");
    if in_order {
        assert_eq!(w3_permit, w1_permit, "w3 takes w1's permit");
    }
    assert_eq!(permit_holders(&a, key).await, ["pod-b/w3", "pod-c/w2"]);
    if let Some(w4) = w4 {
        assert!(
            !w4.is_finished(),
            "w4 was served before w3, who asked first"
        );
        c.release(key, "w2").await.unwrap();
        let (w4_permit, _) = held(w4.await.expect("w4").unwrap());
        assert_eq!(Some(w4_permit), w2_permit, "w4 takes w2's permit");
        b.release(key, "w4").await.unwrap();
    } else {
        c.release(key, "w2").await.unwrap();
    }
    b.release(key, "w3").await.unwrap();
    // Nothing is kept of the line once nobody waits: in the pods, nor in the backend, where a
    // place left standing would refuse a fresh pod's owners (until its lease ran out, had its
    // removal failed).
    for pod in [&a, &b, &c, &d] {
        eventually(SLACK, "no state kept for the key", || {
            pod.tracked_keys() == 0
        })
        .await;
    }
    let fresh = pod(h.driver().await, "pod-e");
    let freed = Instant::now();
    for owner in ["e1", "e2"] {
        loop {
            match fresh
                .acquire(key, owner, Duration::ZERO, HOLD)
                .await
                .unwrap()
            {
                KeyAnswer::Held { .. } => break,
                other => assert!(
                    freed.elapsed() < STEADY_LEASE + SLACK,
                    "{owner} of a fresh pod, every permit free: {other:?}"
                ),
            }
            sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A semaphore's first waiter whose attempts are answered later than a renew interval keeps
/// its places: on a queue backend (etcd, ZooKeeper) a newcomer that asks right after a permit
/// is given up is refused, and the waiter takes the permit. Everywhere, the waiter is served.
pub async fn keyed_semaphore_waiter_keeps_its_places_through_slow_answers(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease, KeyedFamily};
    const HOLD: Duration = Duration::from_secs(60);
    const WAIT: Duration = Duration::from_secs(60);
    // A lease long enough that an acquisition answered two renew intervals late still holds
    // for most of it (the key's line is taken that way).
    const SLOW_LEASE: Duration = Duration::from_secs(3);
    let family = unique_lock("slow-line");
    let key = "pool";
    let pod = |driver: Arc<dyn Backend>, name: &str| {
        KeyedFamily::new(
            driver,
            FamilyConfig {
                renew_interval: RENEW,
                permits: 2,
                ..FamilyConfig::new(&family, name, SLOW_LEASE)
            },
            Arc::new(()),
        )
        .expect("family")
    };
    let fb = FaultyDriver::wrap(h.driver().await);
    let (a, b, d) = (
        pod(h.driver().await, "pod-a"),
        pod(fb.clone(), "pod-b"),
        pod(h.driver().await, "pod-d"),
    );
    let in_order = fb.keeps_queue();
    let held = |answer: KeyAnswer| match answer {
        KeyAnswer::Held { permit, .. } => permit,
        other => panic!("not held: {other:?}"),
    };
    let p1 = held(a.acquire(key, "h1", Duration::ZERO, HOLD).await.unwrap());
    held(a.acquire(key, "h2", Duration::ZERO, HOLD).await.unwrap());
    // Every answer to w1's attempts reaches it two renew intervals after the backend gave it:
    // past the interval a renewal may take, within the lease.
    fb.delay_answers_to("/w1", 2 * RENEW);
    let w1 = {
        let b: KeyedFamily = b.clone();
        tokio::spawn(async move { b.acquire(key, "w1", WAIT, HOLD).await })
    };
    let identity = format!("{}/w1", b.identity());
    let tried = |rounds| {
        [0, 1].iter().all(|&permit| {
            let lock = b.permit_backend_name(key, permit).unwrap();
            fb.answered(&lock, &identity) >= rounds
        })
    };
    // Each permit tried (on a queue backend twice: once more as the first in line, keeping its
    // places).
    let rounds = if in_order { 2 } else { 1 };
    eventually(WAIT, "w1 tried every permit", || tried(rounds)).await;
    // Pod b cut off: w1's attempts answered by then are read, late, and followed up; its next
    // ones hang. Then h1 gives its permit up and a newcomer asks: only a place w1 kept in the
    // backend can refuse the newcomer.
    fb.cut_off(true);
    sleep(4 * RENEW).await;
    assert_eq!(
        a.release(key, "h1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let newcomer = d.acquire(key, "n", Duration::ZERO, HOLD).await.unwrap();
    // Answered at once again: elsewhere than on a queue backend, an attempt answered late is
    // given up on, and w1 could not take a permit while its answers come late.
    fb.delay_answers_to("/w1", Duration::ZERO);
    fb.cut_off(false);
    if in_order {
        assert!(
            matches!(newcomer, KeyAnswer::HeldByAnother { .. }),
            "a newcomer took the permit w1 waits for: {newcomer:?}"
        );
    } else if matches!(newcomer, KeyAnswer::Held { .. }) {
        d.release(key, "n").await.unwrap();
    }
    let w1_permit = held(w1.await.expect("w1").unwrap());
    if in_order {
        assert_eq!(w1_permit, p1, "w1 takes the permit given up");
    }
    b.release(key, "w1").await.unwrap();
    a.release(key, "h2").await.unwrap();
}

/// (index, permit, token) of each of `locks` that claims to hold, read once no answer is
/// unknown: a renewal past its call's budget on a loaded machine leaves its lock's answer
/// unknown until the next renewal lands, which would hide a holder from a reading. For up to
/// [`STEADY_LEASE`], the lease of the locks this reads.
async fn holders_known(locks: &[Option<Lock>]) -> Vec<(usize, u32, u64)> {
    let deadline = Instant::now() + STEADY_LEASE;
    loop {
        let answers: Vec<(usize, Answer)> = locks
            .iter()
            .enumerate()
            .filter_map(|(i, lock)| Some((i, lock.as_ref()?.answer())))
            .collect();
        if answers.iter().all(|(_, a)| !matches!(a, Answer::Unknown)) {
            return answers
                .into_iter()
                .filter_map(|(i, answer)| match answer {
                    Answer::Holder { token, permit, .. } => Some((i, permit, token)),
                    _ => None,
                })
                .collect();
        }
        assert!(
            Instant::now() < deadline,
            "an answer stayed unknown for {STEADY_LEASE:?}"
        );
        sleep(Duration::from_millis(5)).await;
    }
}

/// A lock of several permits (a semaphore lock): as many campaigners hold it as it has permits,
/// each on a permit of its own and nobody beside them; a holder that crashes is replaced on its
/// permit within the lease, with a higher token; on demand, a pod acquiring again keeps its
/// permit, and contenders that come and go never outnumber the permits, each permit's holders
/// following one another with rising tokens.
pub async fn lock_permits_admit_that_many_holders(h: &mut dyn Harness) {
    const PERMITS: u32 = 2;
    let start_with_permits = |driver, lock: &str, identity: &str, mode| {
        let config = LockConfig {
            permits: PERMITS,
            ..config(lock, identity, mode)
        };
        Lock::start(driver, config, Arc::new(())).expect("start lock")
    };
    // (index, permit, token) of each campaigner that claims to hold now.
    let holding = |locks: &[Option<Lock>]| -> Vec<(usize, u32, u64)> {
        locks
            .iter()
            .enumerate()
            .filter_map(|(i, lock)| {
                let snapshot = lock.as_ref()?.snapshot();
                let token = snapshot.answer().token()?;
                Some((i, snapshot.held?.permit, token))
            })
            .collect()
    };
    let lock = unique_lock("semaphore");
    let mut campaigners = Vec::new();
    for identity in ["a", "b", "c"] {
        let driver = h.driver().await;
        campaigners.push(Some(start_with_permits(
            driver,
            &lock,
            identity,
            Mode::Campaign,
        )));
    }
    eventually(SLACK, "two of three campaigners hold", || {
        holding(&campaigners).len() == PERMITS as usize
    })
    .await;
    let watched_until = Instant::now() + 2 * RENEW;
    while Instant::now() < watched_until {
        let now = holding(&campaigners);
        assert!(
            now.len() <= PERMITS as usize,
            "more holders than permits: {now:?}"
        );
        sleep(Duration::from_millis(5)).await;
    }
    // Read until two hold: a machine stalled past the short lease lets a waiter take a lapsed
    // holder's permit, and the reading between is one holder.
    let on_permits = |held: &[(usize, u32, u64)]| {
        let mut permits: Vec<u32> = held.iter().map(|(_, permit, _)| *permit).collect();
        permits.sort_unstable();
        permits
    };
    let mut held = Vec::new();
    eventually(SLACK, "each of two holders on a permit of its own", || {
        held = holding(&campaigners);
        on_permits(&held) == [0, 1]
    })
    .await;
    let (crashed, permit, token) = held[0];
    let waiting = (0..3)
        .find(|i| held.iter().all(|(holder, _, _)| holder != i))
        .expect("a campaigner waits");
    drop(campaigners[crashed].take()); // aborted: no release, like kill -9
    let took = eventually(
        LEASE + RENEW + SLACK,
        "the waiting campaigner takes the crashed holder's permit",
        || holding(&campaigners).iter().any(|(i, _, _)| *i == waiting),
    )
    .await;
    let now = holding(&campaigners);
    let (_, taken, newer) = now.iter().find(|(i, _, _)| *i == waiting).copied().unwrap();
    assert_eq!(taken, permit, "the crashed holder's permit: {now:?}");
    assert!(
        newer > token,
        "permit {permit}: token {newer} after {token}"
    );
    assert!(took <= LEASE + RENEW + SLACK, "takeover took {took:?}");
    for lock in campaigners.into_iter().flatten() {
        lock.shutdown().await;
    }

    // The count changed while the lock runs: raised, the waiting campaigners take the new
    // permits while the holder keeps its own; lowered, nobody's holding is revoked.
    let lock = unique_lock("semaphore-changed");
    let mut changing = Vec::new();
    for identity in ["a", "b", "c", "d"] {
        let driver = h.driver().await;
        let config = steady_config(&lock, identity, Mode::Campaign);
        changing.push(Some(
            Lock::start(driver, config, Arc::new(())).expect("start lock"),
        ));
    }
    eventually(SLACK, "one of four campaigners holds", || {
        holding(&changing).len() == 1
    })
    .await;
    let before = holders_known(&changing).await;
    sleep(RENEW).await;
    assert_eq!(
        holders_known(&changing).await,
        before,
        "one permit, one holder"
    );
    for lock in changing.iter().flatten() {
        lock.set_permits(4).unwrap();
    }
    eventually(SLACK, "all four hold once there are four permits", || {
        holding(&changing).len() == 4
    })
    .await;
    assert!(
        holding(&changing).contains(&before[0]),
        "the holder kept its holding: {:?} then {:?}",
        before,
        holding(&changing)
    );
    // The campaigners that waited on permit 0 left its queue (etcd, ZooKeeper) when they took
    // others: once permit 0's holder goes, a newcomer takes it at once.
    let (first, ..) = before[0];
    let replaced = changing[first].take().unwrap();
    let driver = h.driver().await;
    let config = LockConfig {
        permits: 4,
        ..steady_config(&lock, "e", Mode::Campaign)
    };
    changing[first] = Some(Lock::start(driver, config, Arc::new(())).expect("start lock"));
    replaced.shutdown().await;
    eventually(SLACK, "a newcomer takes the permit given back", || {
        holding(&changing).len() == 4
    })
    .await;
    let all = holders_known(&changing).await;
    for lock in changing.iter().flatten() {
        lock.set_permits(1).unwrap();
        assert!(lock.has_had_permits());
    }
    sleep(2 * RENEW).await;
    assert_eq!(
        holders_known(&changing).await,
        all,
        "lowering the count revoked a holding"
    );
    for lock in changing.into_iter().flatten() {
        lock.shutdown().await;
    }

    // On demand: two pods hold at once, a third is refused; acquiring again keeps the permit.
    let lock = unique_lock("semaphore-on-demand");
    let mut pods = Vec::new();
    for i in 0..5 {
        let driver = h.driver().await;
        let config = LockConfig {
            permits: PERMITS,
            ..steady_config(&lock, &format!("p{i}"), Mode::OnDemand)
        };
        pods.push(Lock::start(driver, config, Arc::new(())).expect("start lock"));
    }
    let hold = Duration::from_secs(30);
    let first = pods[0].acquire(SLACK, hold).await.expect("acquire");
    let second = pods[1].acquire(SLACK, hold).await.expect("acquire");
    assert!(
        first.is_holder() && second.is_holder(),
        "{first:?} {second:?}"
    );
    let third = pods[2]
        .acquire(Duration::ZERO, hold)
        .await
        .expect("acquire");
    assert!(
        !third.is_holder(),
        "a third holder of two permits: {third:?}"
    );
    let permit_of = |pod: &Lock| pod.snapshot().held.map(|held| held.permit);
    let before = permit_of(&pods[0]);
    let again = pods[0].acquire(SLACK, hold).await.expect("acquire");
    assert_eq!(
        again.token(),
        first.token(),
        "acquiring again keeps the holding"
    );
    assert_eq!(permit_of(&pods[0]), before);
    assert_eq!(again.holding().map(|(permit, _)| permit), before);
    assert_eq!(pods[0].snapshot().holds, 2);
    // A holding is named by its permit and its token together: tokens count per permit, so
    // the same token on the other permit is another holding, which none of these touch.
    let (permit, token) = again.holding().unwrap();
    let other = (permit + 1) % PERMITS;
    assert!(!pods[0].release_if((other, token)).await.unwrap());
    assert!(!pods[0].force_release(Some(other), token).await.unwrap());
    let hold_until = pods[0].snapshot().held.unwrap().hold_until;
    pods[0].extend_if((other, token), 10 * hold).await.unwrap();
    assert_eq!(pods[0].snapshot().held.unwrap().hold_until, hold_until);
    assert_eq!(pods[0].snapshot().holds, 2);
    assert!(pods[0].release_if((permit, token)).await.unwrap());
    assert_eq!(pods[0].snapshot().holds, 1);
    assert!(pods[0].acquire(SLACK, hold).await.unwrap().is_holder());
    for _ in 0..2 {
        assert!(pods[0].release().await.unwrap());
    }
    assert!(pods[1].release().await.unwrap());

    let mut log = take_turns(pods, 3).await;
    assert_eq!(log.len(), 15);
    log.sort_by_key(|(start, ..)| *start);
    for (i, (start, ..)) in log.iter().enumerate() {
        let beside = log[..i].iter().filter(|(_, end, ..)| end > start).count();
        assert!(
            beside < PERMITS as usize,
            "more holders than permits: {log:?}"
        );
    }
    for permit in 0..PERMITS {
        let on_permit: Vec<_> = log.iter().filter(|(.., p, _)| *p == permit).collect();
        for pair in on_permit.windows(2) {
            let ((_, end, _, t1), (start, _, _, t2)) = (pair[0], pair[1]);
            assert!(
                end <= start,
                "two holders of permit {permit} (tokens {t1} and {t2})"
            );
            assert!(t2 > t1, "permit {permit}: token went from {t1} to {t2}");
        }
    }
}

/// Several keys at once, all or nothing: an owner takes every key it names (each with its own
/// token, in the order asked) or none; a refused acquisition leaves no key held (a key the owner
/// already held stays held once, as it was); two owners asking for overlapping keys in opposite
/// orders both get them in turn (no deadlock); an acquisition dropped midway (its client hung
/// up) gives back what it took; a crashed pod's keys are free within the lease; bad key lists
/// are refused and change nothing.
pub async fn keyed_several_keys_all_or_nothing(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{KeyAnswer, KeyError, KeyRelease, KeysAnswer};
    const HOLD: Duration = Duration::from_secs(60);
    const NOW: Duration = Duration::ZERO;
    let family = unique_lock("several");
    // The steady lease: a scenario this long on one-second leases meets a loaded machine's
    // stalls, whose backend errors make a holding's answer unknown for a moment. The crash at
    // the end runs on a family of its own, on the suite's lease.
    let (a, b) = (
        keyed_pod_on(h.driver().await, &family, "pod-a", 1, STEADY_LEASE),
        keyed_pod_on(h.driver().await, &family, "pod-b", 1, STEADY_LEASE),
    );
    let keys = |names: &[&str]| -> Vec<String> { names.iter().map(|k| k.to_string()).collect() };
    let tokens = |answer: KeysAnswer| -> Vec<(String, u64, u32)> {
        match answer {
            KeysAnswer::Held(held) => held
                .into_iter()
                .map(|(key, answer)| match answer {
                    KeyAnswer::Held { token, holds, .. } => (key, token, holds),
                    other => panic!("{key} reported held as {other:?}"),
                })
                .collect(),
            other => panic!("not taken: {other:?}"),
        }
    };
    let held_by = |pod: &leasehold_lease::keyed::KeyedFamily, key: &str, owner: &str| {
        matches!(
            pod.status(key, Some(owner)).unwrap(),
            KeyAnswer::Held { .. }
        )
    };

    let first = tokens(
        a.acquire_all(&keys(&["c", "a", "b"]), "w1", NOW, HOLD)
            .await
            .unwrap(),
    );
    let names: Vec<&str> = first.iter().map(|(k, _, _)| k.as_str()).collect();
    assert_eq!(names, ["c", "a", "b"], "answered in the order asked");

    // Pod b asks for b (held) and d (free): refused on b, and d is left free.
    let refused = b
        .acquire_all(&keys(&["d", "b"]), "w2", NOW, HOLD)
        .await
        .unwrap();
    assert!(
        matches!(&refused, KeysAnswer::NotTaken { key, answer: KeyAnswer::HeldByAnother { .. } } if key == "b"),
        "{refused:?}"
    );
    assert!(!held_by(&b, "d", "w2"), "a refused acquisition kept a key");
    // Free for another pod: at once when pod b's release of d went through, within a lease when
    // it timed out on a loaded machine (its lease then runs out); kept, d would be pod b's for
    // the whole hold.
    tokens(
        a.acquire_all(&keys(&["d"]), "w9", STEADY_LEASE + RENEW + SLACK, HOLD)
            .await
            .unwrap(),
    );
    assert_eq!(
        a.release("d", "w9").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );

    // The holder asks again with a key another owner holds: refused, its own keys held once.
    assert!(matches!(
        b.acquire("z", "w3", NOW, HOLD).await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    let refused = a
        .acquire_all(&keys(&["a", "z"]), "w1", NOW, HOLD)
        .await
        .unwrap();
    assert!(
        matches!(&refused, KeysAnswer::NotTaken { key, .. } if key == "z"),
        "{refused:?}"
    );
    assert!(
        matches!(
            status_told(&a, "a", "w1").await.unwrap(),
            KeyAnswer::Held { holds: 1, .. }
        ),
        "the re-entrant acquisition refused was not undone once"
    );
    let again = tokens(
        a.acquire_all(&keys(&["a", "e"]), "w1", NOW, HOLD)
            .await
            .unwrap(),
    );
    assert_eq!(
        (again[0].1, again[0].2),
        (first[1].1, 2),
        "a key held already is re-entered"
    );
    let released = a.release_all(&keys(&["a", "e"]), "w1").await.unwrap();
    assert_eq!(
        released,
        vec![
            ("a".to_owned(), KeyRelease::Released { holds: 1 }),
            ("e".to_owned(), KeyRelease::Released { holds: 0 }),
        ]
    );

    // Overlapping keys asked for in opposite orders, at once, by two pods: both get them.
    let (p, q) = (keys(&["p", "q", "r"]), keys(&["r", "q", "p"]));
    let contend =
        |pod: leasehold_lease::keyed::KeyedFamily, asked: Vec<String>, owner: &'static str| {
            tokio::spawn(async move {
                let answer = pod
                    .acquire_all(&asked, owner, LEASE * 4, HOLD)
                    .await
                    .unwrap();
                let taken = matches!(answer, KeysAnswer::Held(_));
                if taken {
                    sleep(Duration::from_millis(50)).await;
                    pod.release_all(&asked, owner).await.unwrap();
                }
                (answer, taken)
            })
        };
    let (one, two) = (contend(a.clone(), p, "x1"), contend(b.clone(), q, "x2"));
    let (one, two) = (one.await.unwrap(), two.await.unwrap());
    assert!(
        one.1 && two.1,
        "overlapping acquisitions: {:?} and {:?}",
        one.0,
        two.0
    );

    // An acquisition dropped while it waits for its second key gives back its first.
    assert!(matches!(
        b.acquire("m2", "w4", NOW, HOLD).await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    let dropped = tokio::time::timeout(
        Duration::from_millis(300),
        a.acquire_all(&keys(&["m1", "m2"]), "w5", LEASE * 10, HOLD),
    )
    .await;
    assert!(
        dropped.is_err(),
        "the acquisition was not waiting: {dropped:?}"
    );
    // At once when the give-back went through, within the lease when it failed; kept, m1
    // would be pod a's for the whole hold.
    let freed = b
        .acquire("m1", "w6", STEADY_LEASE + SLACK, HOLD)
        .await
        .unwrap();
    assert!(
        matches!(freed, KeyAnswer::Held { .. }),
        "m1 was kept by a dropped acquisition: {freed:?}"
    );

    // A hold shorter than the wait for a later key: the first key is kept alive meanwhile.
    const SHORT: Duration = Duration::from_millis(300);
    assert!(matches!(
        b.acquire("s2", "w10", NOW, HOLD).await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    let releaser = {
        let b = b.clone();
        tokio::spawn(async move {
            sleep(SHORT * 3).await;
            b.release("s2", "w10").await.unwrap()
        })
    };
    let kept = a
        .acquire_all(&keys(&["s1", "s2"]), "w11", SHORT * 10, SHORT)
        .await
        .unwrap();
    assert!(
        matches!(kept, KeysAnswer::Held(_)),
        "the first key lapsed while the second was awaited: {kept:?}"
    );
    assert_eq!(releaser.await.unwrap(), KeyRelease::Released { holds: 0 });
    a.release_all(&keys(&["s1", "s2"]), "w11").await.unwrap();

    // Bad key lists: refused, nothing taken.
    for bad in [keys(&[]), keys(&["f", "g", "f"]), keys(&["f", "no spaces"])] {
        let refused = a.acquire_all(&bad, "w7", NOW, HOLD).await;
        assert!(
            matches!(refused, Err(KeyError::BadKeys(_) | KeyError::BadKey { .. })),
            "{bad:?}: {refused:?}"
        );
    }
    assert!(!held_by(&a, "f", "w7") && !held_by(&a, "g", "w7"));

    assert_eq!(
        a.release_all(&keys(&["c", "a", "b"]), "w1").await.unwrap(),
        [
            ("c".to_owned(), KeyRelease::Released { holds: 0 }),
            ("a".to_owned(), KeyRelease::Released { holds: 0 }),
            ("b".to_owned(), KeyRelease::Released { holds: 0 }),
        ]
    );

    // A pod dies without a word: its keys are free for another pod within the lease, tokens
    // higher.
    let family = unique_lock("several-crash");
    let (a, b) = (
        keyed_pod(h.driver().await, &family, "pod-a", 1),
        keyed_pod(h.driver().await, &family, "pod-b", 1),
    );
    let first = tokens(
        a.acquire_all(&keys(&["c", "a", "b"]), "w1", NOW, HOLD)
            .await
            .unwrap(),
    );
    drop(a);
    let crashed = Instant::now();
    let taken = loop {
        match b
            .acquire_all(&keys(&["a", "b", "c"]), "w8", LEASE + RENEW + SLACK, HOLD)
            .await
            .unwrap()
        {
            KeysAnswer::Held(held) => break held,
            KeysAnswer::NotTaken {
                answer: KeyAnswer::Unknown,
                ..
            } if crashed.elapsed() < LEASE + RENEW + SLACK => {}
            other => panic!("after pod a crashed: {other:?}"),
        }
    };
    assert!(
        crashed.elapsed() <= LEASE + RENEW + SLACK,
        "took {:?}",
        crashed.elapsed()
    );
    for (key, answer) in taken {
        let KeyAnswer::Held { token, .. } = answer else {
            panic!("{key}: {answer:?}")
        };
        let before = first.iter().find(|(k, _, _)| *k == key).unwrap().1;
        assert!(token > before, "{key}: token {token} after {before}");
    }
}

/// Pod `identity`'s read-write family `family` on `driver`, with `permits` per key.
fn read_write_pod(
    driver: Arc<dyn Backend>,
    family: &str,
    identity: &str,
    permits: u32,
) -> leasehold_lease::keyed::KeyedFamily {
    read_write_pod_on(driver, family, identity, permits, LEASE)
}

/// [`read_write_pod`] with a lease of `lease`.
fn read_write_pod_on(
    driver: Arc<dyn Backend>,
    family: &str,
    identity: &str,
    permits: u32,
    lease: Duration,
) -> leasehold_lease::keyed::KeyedFamily {
    let pod = keyed_pod_on(driver, family, identity, permits, lease);
    pod.reconfigure(leasehold_lease::keyed::FamilyConfig {
        read_write: true,
        ..pod.config()
    })
    .expect("read-write");
    pod
}

/// A semaphore of more than 16 permits made read-write as read-write.md says (its count
/// lowered to 16, then `read_write`): writers of a pod that still counts the higher permits and
/// writers of a pod that never had them take and probe the same permits, so each writer's token
/// is above the earlier writer's, also where a permit above 16 has counted its tokens higher.
pub async fn keyed_read_write_after_a_larger_semaphore(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease};
    const HOLD: Duration = Duration::from_secs(60);
    const NOW: Duration = Duration::ZERO;
    const PERMITS: u32 = leasehold_lease::keyed::MAX_READ_WRITE_PERMITS + 1;
    let family = unique_lock("rw-grown");
    let key = "doc";
    let a = keyed_pod_on(h.driver().await, &family, "pod-a", PERMITS, STEADY_LEASE);
    let held = |answer: KeyAnswer| match answer {
        KeyAnswer::Held { permit, token, .. } => (permit, token),
        other => panic!("not held: {other:?}"),
    };
    // Every permit held, then the highest taken again and again: on a backend whose permits
    // count their tokens apart, its tokens rise above the others'.
    let mut owners = Vec::new();
    for n in 0..PERMITS {
        let owner = format!("s{n}");
        let (permit, _) = held(a.acquire(key, &owner, NOW, HOLD).await.unwrap());
        owners.push((permit, owner));
    }
    let top = PERMITS - 1;
    let (_, mut on_top) = owners
        .iter()
        .find(|(permit, _)| *permit == top)
        .cloned()
        .expect("every permit held");
    for round in 0..3 {
        a.release(key, &on_top).await.unwrap();
        on_top = format!("again-{round}");
        let (permit, _) = held(a.acquire(key, &on_top, NOW, HOLD).await.unwrap());
        assert_eq!(permit, top, "the one permit free");
    }
    for (permit, owner) in &owners {
        if *permit != top {
            assert_eq!(
                a.release(key, owner).await.unwrap(),
                KeyRelease::Released { holds: 0 }
            );
        }
    }
    a.release(key, &on_top).await.unwrap();
    // Lowered to 16, then read-write: pod a still counts the permit above 16 among those it
    // has had; pod b, started since, never had it.
    a.reconfigure(FamilyConfig {
        permits: PERMITS - 1,
        ..a.config()
    })
    .expect("lowered");
    a.reconfigure(FamilyConfig {
        read_write: true,
        ..a.config()
    })
    .expect("read-write");
    let b = read_write_pod_on(
        h.driver().await,
        &family,
        "pod-b",
        PERMITS - 1,
        STEADY_LEASE,
    );
    let written = |answer: KeyAnswer| match answer {
        KeyAnswer::Held {
            token,
            writer: true,
            ..
        } => token,
        other => panic!("not written: {other:?}"),
    };
    let first = written(a.acquire_write(key, "w1", NOW, HOLD).await.unwrap());
    assert_eq!(
        a.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let second = written(b.acquire_write(key, "w2", NOW, HOLD).await.unwrap());
    assert!(
        second > first,
        "pod b's writer's token {second} after pod a's writer's {first}"
    );
    assert_eq!(
        b.release(key, "w2").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
}

/// Read-write locks on a family of 3 permits: readers of two pods share a key; a writer waits
/// for them, and while it waits new readers wait too; a writer refused within its wait leaves
/// nothing held; the writer holds the key alone, with a token above every earlier reader's and
/// writer's, re-entrant for itself and for nobody else; a reader cannot upgrade; a crashed
/// pod's write lock is free within the lease; a writer of a pod with fewer permits waits for
/// readers on the permits it does not take; nothing is kept once everything is released.
pub async fn keyed_read_write_locks(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{KeyAnswer, KeyError, KeyRelease};
    const HOLD: Duration = Duration::from_secs(60);
    const NOW: Duration = Duration::ZERO;
    let family = unique_lock("rw");
    // The steady lease: a scenario this long on one-second leases meets a loaded machine's
    // stalls, whose backend errors make a part's answer unknown for a moment. What hangs on
    // the lease runs on a family of its own, on the suite's lease.
    let (a, b) = (
        read_write_pod_on(h.driver().await, &family, "pod-a", 3, STEADY_LEASE),
        read_write_pod_on(h.driver().await, &family, "pod-b", 3, STEADY_LEASE),
    );
    // A family not declared read-write has no writers.
    let plain = keyed_pod(h.driver().await, &unique_lock("plain"), "pod-a", 3);
    assert!(matches!(
        plain.acquire_write("doc", "w", NOW, HOLD).await,
        Err(KeyError::BadMode(_))
    ));
    let read = |answer: KeyAnswer| match answer {
        KeyAnswer::Held {
            token,
            writer: false,
            ..
        } => token,
        other => panic!("not read: {other:?}"),
    };
    let written = |answer: KeyAnswer| match answer {
        KeyAnswer::Held {
            token,
            writer: true,
            holds,
            ..
        } => (token, holds),
        other => panic!("not written: {other:?}"),
    };
    let refused = |answer: &KeyAnswer| matches!(answer, KeyAnswer::HeldByAnother { .. });
    let key = "doc";
    let r1 = read(a.acquire_read(key, "r1", NOW, HOLD).await.unwrap());
    let r2 = read(b.acquire_read(key, "r2", NOW, HOLD).await.unwrap());

    // A writer refused within its wait gives back what it took: readers still get in at once.
    let answer = b.acquire_write(key, "w0", NOW, HOLD).await.unwrap();
    assert!(refused(&answer), "a writer beside two readers: {answer:?}");
    let r3 = read(a.acquire_read(key, "r3", NOW, HOLD).await.unwrap());

    // w1 waits for the three readers; meanwhile a new reader of either pod waits for it.
    let writing = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire_write(key, "w1", LEASE + SLACK, HOLD).await })
    };
    sleep(Duration::from_millis(200)).await;
    for pod in [&a, &b] {
        let answer = pod.acquire_read(key, "r4", NOW, HOLD).await.unwrap();
        assert!(
            refused(&answer),
            "a reader of {} passed a waiting writer: {answer:?}",
            pod.identity()
        );
    }
    assert!(
        !writing.is_finished(),
        "the writer did not wait for the readers"
    );
    for (pod, owner) in [(&a, "r1"), (&b, "r2"), (&a, "r3")] {
        assert_eq!(
            pod.release(key, owner).await.unwrap(),
            KeyRelease::Released { holds: 0 }
        );
    }
    let (w1, _) = written(writing.await.expect("writer").unwrap());
    for earlier in [r1, r2, r3] {
        assert!(
            w1 > earlier,
            "writer's token {w1} after a reader's {earlier}"
        );
    }
    let (_, holds) = written(status_told(&b, key, "w1").await.unwrap());
    assert_eq!(holds, 1);

    // Alone: no reader, no other writer, of either pod; the writer itself acquires again.
    for pod in [&a, &b] {
        for answer in [
            pod.acquire_read(key, "r5", NOW, HOLD).await.unwrap(),
            pod.acquire(key, "r5", NOW, HOLD).await.unwrap(),
            pod.acquire_write(key, "w2", NOW, HOLD).await.unwrap(),
        ] {
            assert!(refused(&answer), "beside a writer: {answer:?}");
        }
    }
    assert!(refused(&b.try_acquire_once(key, "w1", HOLD).await.unwrap()));
    assert!(matches!(
        status_told(&a, key, "w1").await.unwrap(),
        KeyAnswer::NotHeld
    ));
    let (again, holds) = written(b.acquire_write(key, "w1", NOW, HOLD).await.unwrap());
    assert_eq!((again, holds), (w1, 2), "the writer acquiring again");
    let (_, holds) = written(b.extend(key, "w1", HOLD).await.unwrap());
    assert_eq!(holds, 2);
    assert_eq!(
        b.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 1 }
    );
    written(status_told(&b, key, "w1").await.unwrap());
    assert_eq!(
        b.release(key, "w1").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );

    // No upgrade: a reader asking to write is refused and keeps its read.
    read(a.acquire_read(key, "r6", NOW, HOLD).await.unwrap());
    assert!(matches!(
        a.acquire_write(key, "r6", NOW, HOLD).await,
        Err(KeyError::BadMode(_))
    ));
    read(status_told(&a, key, "r6").await.unwrap());
    assert_eq!(
        a.release(key, "r6").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );

    // One owner asking to read and to write at once is given one of them at most, never both:
    // each permit taken checks how the owner holds it, not only each call as it starts.
    for round in 0..5 {
        let owner = format!("rw{round}");
        let (read_answer, write_answer) = tokio::join!(
            a.acquire_read(key, &owner, NOW, HOLD),
            a.acquire_write(key, &owner, NOW, HOLD)
        );
        let held =
            |answer: &Result<KeyAnswer, KeyError>| matches!(answer, Ok(KeyAnswer::Held { .. }));
        assert!(
            !(held(&read_answer) && held(&write_answer)),
            "round {round}: {owner} was told it reads and writes {key} at once: {read_answer:?} and {write_answer:?}"
        );
        if held(&read_answer) || held(&write_answer) {
            assert_eq!(
                a.release(key, &owner).await.unwrap(),
                KeyRelease::Released { holds: 0 }
            );
        }
    }

    // A writer after a writer: a higher token.
    let (w2, _) = written(a.acquire_write(key, "w2", NOW, HOLD).await.unwrap());
    assert!(w2 > w1, "writer's token {w2} after {w1}");

    assert_eq!(
        a.release(key, "w2").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );

    // What hangs on the lease runs on a family of the suite's lease.
    {
        let family = unique_lock("rw-lease");
        let (a, b) = (
            read_write_pod(h.driver().await, &family, "pod-a", 3),
            read_write_pod(h.driver().await, &family, "pod-b", 3),
        );
        // A write lock lost in part is not held, and what remains of it is given back.
        let KeyAnswer::Held { token, permit, .. } =
            a.acquire_write("other", "w9", NOW, HOLD).await.unwrap()
        else {
            panic!("w9 could not write");
        };
        written(a.acquire_write("other", "w9", NOW, HOLD).await.unwrap());
        // The answer names the permit whose token it gives: a force-release of that holding.
        assert!(a.force_release("other", Some(permit), token).await.unwrap());
        eventually(SLACK, "the write lock is lost", || {
            matches!(a.status("other", Some("w9")), Ok(KeyAnswer::NotHeld))
        })
        .await;
        read(
            b.acquire_read("other", "r8", LEASE + SLACK, HOLD)
                .await
                .unwrap(),
        );
        assert_eq!(
            b.release("other", "r8").await.unwrap(),
            KeyRelease::Released { holds: 0 }
        );

        // Pod a dies without a word: its write lock is free within the lease, for a reader and
        // then a writer of pod b.
        let (w2, _) = written(a.acquire_write(key, "w2", NOW, HOLD).await.unwrap());
        drop(a);
        let crashed = Instant::now();
        let within = LEASE + RENEW + SLACK;
        loop {
            match b.acquire_read(key, "r7", within, HOLD).await.unwrap() {
                KeyAnswer::Held { .. } => break,
                KeyAnswer::Unknown if crashed.elapsed() < within => {}
                other => panic!("r7 after pod a crashed: {other:?}"),
            }
        }
        assert!(crashed.elapsed() <= within, "took {:?}", crashed.elapsed());
        assert_eq!(
            b.release(key, "r7").await.unwrap(),
            KeyRelease::Released { holds: 0 }
        );
        // Each of the crashed writer's permits is free within the lease, not all at one moment.
        let left = within.saturating_sub(crashed.elapsed());
        let (w3, _) = written(b.acquire_write(key, "w3", left, HOLD).await.unwrap());
        assert!(crashed.elapsed() <= within, "took {:?}", crashed.elapsed());
        assert!(
            w3 > w2,
            "writer's token {w3} after the crashed writer's {w2}"
        );
        assert_eq!(
            b.release(key, "w3").await.unwrap(),
            KeyRelease::Released { holds: 0 }
        );
    }

    // Pods that disagree on the permits (a change rolling out): a writer of pod c, which has
    // 2, waits for pod b's readers on permits 2 and 3 too.
    b.reconfigure(leasehold_lease::keyed::FamilyConfig {
        permits: 4,
        ..b.config()
    })
    .unwrap();
    let c = read_write_pod_on(h.driver().await, &family, "pod-c", 2, STEADY_LEASE);
    let mut readers = Vec::new();
    for owner in ["r10", "r11", "r12", "r13"] {
        let KeyAnswer::Held { permit, .. } = b.acquire(key, owner, NOW, HOLD).await.unwrap() else {
            panic!("{owner} of pod b");
        };
        readers.push((permit, owner));
    }
    readers.sort_unstable();
    let writing = {
        let c = c.clone();
        tokio::spawn(async move { c.acquire_write(key, "w4", LEASE + SLACK, HOLD).await })
    };
    // The readers of permits 0 and 1 leave; those of 2 and 3 still keep the writer out.
    for (_, owner) in &readers[..2] {
        b.release(key, owner).await.unwrap();
    }
    sleep(Duration::from_millis(300)).await;
    assert!(
        !writing.is_finished(),
        "a writer beside readers of higher permits"
    );
    for (_, owner) in &readers[2..] {
        b.release(key, owner).await.unwrap();
    }
    written(writing.await.expect("writer").unwrap());
    assert!(refused(&b.acquire(key, "r14", NOW, HOLD).await.unwrap()));
    assert_eq!(
        c.release(key, "w4").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    eventually(SLACK, "pod b keeps no state once all is released", || {
        b.tracked_keys() == 0 && b.held_keys() == 0
    })
    .await;
    // A write lock released while its owner's answers are read meanwhile: its parts, given
    // back one at a time, are the release's to settle, not a loss that ends the write lock, and
    // the release says it released.
    written(c.acquire_write("doc-9", "w9", NOW, HOLD).await.unwrap());
    let reading = {
        let c = c.clone();
        tokio::spawn(async move {
            loop {
                let _ = c.status("doc-9", Some("w9"));
                tokio::task::yield_now().await;
            }
        })
    };
    let released = c.release("doc-9", "w9").await.unwrap();
    reading.abort();
    assert_eq!(
        released,
        KeyRelease::Released { holds: 0 },
        "a write lock released while its answers are read"
    );

    // A write lock acquired twice that has lost a part ends whole at once: a release then finds
    // nothing of it held.
    let KeyAnswer::Held {
        token: lost,
        permit,
        ..
    } = c.acquire_write("doc-10", "w10", NOW, HOLD).await.unwrap()
    else {
        panic!("w10 could not write doc-10");
    };
    assert_eq!(
        written(c.acquire_write("doc-10", "w10", NOW, HOLD).await.unwrap()).1,
        2
    );
    assert!(c.force_release("doc-10", Some(permit), lost).await.unwrap());
    assert_eq!(
        c.release("doc-10", "w10").await.unwrap(),
        KeyRelease::NotHeld,
        "a write lock that lost a part, released once of two acquisitions"
    );
    assert!(matches!(
        status_told(&c, "doc-10", "w10").await,
        Ok(KeyAnswer::NotHeld)
    ));

    // A writer's token is above every earlier writer's, that of a pod with more permits among
    // them: pod b's (4 permits) writer follows readers' turnover on its permit 3 alone, which
    // on a backend counting each permit on its own puts permit 3's tokens above the others';
    // pod c's (2 permits) writer, next, has a token above it, named with a permit it holds.
    let key = "doc-11";
    for owner in ["r20", "r21", "r22"] {
        let answer = b.acquire(key, owner, NOW, HOLD).await.unwrap();
        assert!(
            matches!(answer, KeyAnswer::Held { .. }),
            "{owner}: {answer:?}"
        );
    }
    for _ in 0..5 {
        let answer = b.acquire(key, "r23", NOW, HOLD).await.unwrap();
        assert!(matches!(answer, KeyAnswer::Held { .. }), "r23: {answer:?}");
        b.release(key, "r23").await.unwrap();
    }
    for owner in ["r20", "r21", "r22"] {
        b.release(key, owner).await.unwrap();
    }
    let (w11, _) = written(b.acquire_write(key, "w11", NOW, HOLD).await.unwrap());
    b.release(key, "w11").await.unwrap();
    let KeyAnswer::Held {
        token: w12,
        permit,
        writer: true,
        ..
    } = c.acquire_write(key, "w12", NOW, HOLD).await.unwrap()
    else {
        panic!("w12 could not write {key}");
    };
    assert!(
        w12 > w11,
        "the writer of fewer permits has token {w12}, below the earlier writer's {w11}"
    );
    assert!(
        c.force_release(key, Some(permit), w12).await.unwrap(),
        "the write lock's answer names permit {permit}, which it does not hold"
    );
    assert!(matches!(
        status_told(&c, key, "w12").await,
        Ok(KeyAnswer::NotHeld)
    ));
    c.release(key, "w12").await.unwrap();
}

/// Several keys written at once, on a read-write family of 2 permits: every key's write lock
/// or none; while held, no reader and no other writer of any of the keys, of either pod; a
/// call refused on one key leaves none of the others held; a call waiting for a reader of one
/// key holds the keys before it (readers of those wait) and gets every key once the reader
/// leaves, with a token above the reader's; an owner already reading one of the keys is
/// refused, one writing it acquires its write lock again (given back alone when another key is
/// refused); a crashed pod's write locks are free within the lease.
pub async fn keyed_several_keys_written(h: &mut dyn Harness) {
    use leasehold_lease::keyed::{KeyAnswer, KeyError, KeyRelease, KeysAnswer};
    const HOLD: Duration = Duration::from_secs(60);
    const NOW: Duration = Duration::ZERO;
    let family = unique_lock("several-rw");
    // The steady lease: a scenario this long on one-second leases meets a loaded machine's
    // stalls, whose backend errors make a part's answer unknown for a moment. The crash at the
    // end runs on a family of its own, on the suite's lease.
    let (a, b) = (
        read_write_pod_on(h.driver().await, &family, "pod-a", 2, STEADY_LEASE),
        read_write_pod_on(h.driver().await, &family, "pod-b", 2, STEADY_LEASE),
    );
    let keys = |names: &[&str]| -> Vec<String> { names.iter().map(|k| k.to_string()).collect() };
    let written = |answer: KeysAnswer| -> Vec<(String, u64)> {
        match answer {
            KeysAnswer::Held(held) => held
                .into_iter()
                .map(|(key, answer)| match answer {
                    KeyAnswer::Held {
                        token,
                        writer: true,
                        ..
                    } => (key, token),
                    other => panic!("{key} reported written as {other:?}"),
                })
                .collect(),
            other => panic!("not taken: {other:?}"),
        }
    };
    let refused = |answer: &KeyAnswer| matches!(answer, KeyAnswer::HeldByAnother { .. });
    let token = |of: &[(String, u64)], key: &str| of.iter().find(|(k, _)| k == key).unwrap().1;

    // Named in any order, answered in that order.
    let w1 = written(
        a.acquire_all_write(&keys(&["y", "x"]), "w1", NOW, HOLD)
            .await
            .unwrap(),
    );
    assert_eq!(
        w1.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["y", "x"]
    );
    for key in ["x", "y"] {
        for pod in [&a, &b] {
            for answer in [
                pod.acquire_read(key, "r1", NOW, HOLD).await.unwrap(),
                pod.acquire_write(key, "w2", NOW, HOLD).await.unwrap(),
            ] {
                assert!(refused(&answer), "{key} beside a writer: {answer:?}");
            }
        }
    }
    // Refused on y: z, taken first, is given back before the answer.
    let answer = b
        .acquire_all_write(&keys(&["z", "y"]), "w3", NOW, HOLD)
        .await
        .unwrap();
    let KeysAnswer::NotTaken { key, answer } = answer else {
        panic!("w3 wrote a key that w1 writes: {answer:?}");
    };
    assert_eq!(key, "y");
    assert!(refused(&answer), "{answer:?}");
    let KeyAnswer::Held { token: r2, .. } = a.acquire_read("z", "r2", NOW, HOLD).await.unwrap()
    else {
        panic!("z was kept by a refused call");
    };

    // w4 takes q, then waits for r2's read of z; meanwhile q is w4's alone (in the backend:
    // w4 itself is told it holds only once it has every key).
    let waiting = {
        let b = b.clone();
        let keys = keys(&["z", "q"]);
        tokio::spawn(async move { b.acquire_all_write(&keys, "w4", LEASE + SLACK, HOLD).await })
    };
    let asked = Instant::now();
    while !b
        .observe("q")
        .await
        .unwrap()
        .is_some_and(|holder| holder.identity.ends_with("/w4"))
    {
        assert!(
            asked.elapsed() < SLACK,
            "w4 never took q while it waits for z"
        );
        sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !matches!(b.status("q", Some("w4")), Ok(KeyAnswer::Held { .. })),
        "w4 is told it holds q before it has z"
    );
    let answer = a.acquire_read("q", "r3", NOW, HOLD).await.unwrap();
    assert!(refused(&answer), "a reader of q beside w4: {answer:?}");
    assert!(!waiting.is_finished(), "w4 did not wait for z's reader");
    assert_eq!(
        a.release("z", "r2").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    let w4 = written(waiting.await.expect("w4").unwrap());
    let z = token(&w4, "z");
    assert!(z > r2, "w4's token {z} on z after the reader's {r2}");
    for (key, released) in b.release_all(&keys(&["q", "z"]), "w4").await.unwrap() {
        assert_eq!(released, KeyRelease::Released { holds: 0 }, "{key}");
    }

    // An owner reading one of the keys is refused, and keeps what it had.
    a.acquire_read("q", "r5", NOW, HOLD).await.unwrap();
    assert!(
        matches!(
            a.acquire_all_write(&keys(&["q", "m"]), "r5", NOW, HOLD)
                .await,
            Err(KeyError::BadMode(_))
        ),
        "r5 asked to write q, which it reads, among several"
    );
    assert!(matches!(
        status_told(&a, "q", "r5").await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    assert!(matches!(a.status("m", None).unwrap(), KeyAnswer::NotHeld));
    a.release("q", "r5").await.unwrap();

    // An owner writing one of the keys acquires its write lock again among several: refused
    // on another key, the call gives back only what it added; taken, one release of each key
    // gives back this call's acquisitions and leaves the earlier one.
    let holds = async |pod: &leasehold_lease::keyed::KeyedFamily, key: &str, owner: &str| {
        match status_told(pod, key, owner).await {
            Ok(KeyAnswer::Held {
                holds,
                token,
                writer: true,
                ..
            }) => (holds, token),
            other => panic!("{owner} does not write {key}: {other:?}"),
        }
    };
    let KeyAnswer::Held { token: z5, .. } = a.acquire_write("z", "w5", NOW, HOLD).await.unwrap()
    else {
        panic!("w5 could not write z");
    };
    b.acquire_read("m", "r8", NOW, HOLD).await.unwrap();
    let answer = a
        .acquire_all_write(&keys(&["z", "m"]), "w5", NOW, HOLD)
        .await
        .unwrap();
    let KeysAnswer::NotTaken { key, answer } = answer else {
        panic!("w5 wrote m beside its reader: {answer:?}");
    };
    assert_eq!(key, "m");
    assert!(refused(&answer), "{answer:?}");
    assert_eq!(
        holds(&a, "z", "w5").await,
        (1, z5),
        "z after the refused call"
    );
    b.release("m", "r8").await.unwrap();
    let w5 = written(
        a.acquire_all_write(&keys(&["m", "z"]), "w5", NOW, HOLD)
            .await
            .unwrap(),
    );
    assert_eq!(token(&w5, "z"), z5, "z's write lock, acquired again");
    assert_eq!(holds(&a, "z", "w5").await, (2, z5));
    for pod in [&a, &b] {
        let answer = pod.acquire_read("m", "r9", NOW, HOLD).await.unwrap();
        assert!(refused(&answer), "a reader of m beside w5: {answer:?}");
    }
    let released = a.release_all(&keys(&["z", "m"]), "w5").await.unwrap();
    assert_eq!(
        released,
        [
            ("z".to_string(), KeyRelease::Released { holds: 1 }),
            ("m".to_string(), KeyRelease::Released { holds: 0 }),
        ]
    );
    assert_eq!(holds(&a, "z", "w5").await, (1, z5), "z after one release");
    assert!(matches!(
        b.acquire_read("m", "r9", NOW, HOLD).await.unwrap(),
        KeyAnswer::Held { .. }
    ));
    b.release("m", "r9").await.unwrap();
    assert_eq!(
        a.release("z", "w5").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );

    // While the call waits for another key, the write lock it acquired again is kept past
    // both holds; a call dropped midway (its client hung up) gives back what it added.
    let short = Duration::from_secs(2);
    let KeyAnswer::Held { token: z10, .. } = a.acquire_write("z", "w10", NOW, short).await.unwrap()
    else {
        panic!("w10 could not write z");
    };
    b.acquire_read("m", "r10", NOW, HOLD).await.unwrap();
    let waiting = {
        let (a, keys) = (a.clone(), keys(&["z", "m"]));
        tokio::spawn(async move { a.acquire_all_write(&keys, "w10", 5 * short, short).await })
    };
    sleep(short + Duration::from_secs(1)).await;
    if waiting.is_finished() {
        panic!("w10 did not wait for m's reader: {:?}", waiting.await);
    }
    assert_eq!(
        holds(&a, "z", "w10").await,
        (2, z10),
        "z while w10 waits for m"
    );
    b.release("m", "r10").await.unwrap();
    let w10 = written(waiting.await.expect("w10").unwrap());
    assert_eq!(token(&w10, "z"), z10);
    a.release_all(&keys(&["z", "m"]), "w10").await.unwrap();
    a.release("z", "w10").await.unwrap();

    let KeyAnswer::Held { token: z11, .. } = a.acquire_write("z", "w11", NOW, HOLD).await.unwrap()
    else {
        panic!("w11 could not write z");
    };
    b.acquire_read("m", "r11", NOW, HOLD).await.unwrap();
    let waiting = {
        let (a, keys) = (a.clone(), keys(&["z", "m"]));
        tokio::spawn(async move { a.acquire_all_write(&keys, "w11", LEASE + SLACK, HOLD).await })
    };
    let family = &a;
    let counted = move |holds: u32| move || matches!(family.status("z", Some("w11")), Ok(KeyAnswer::Held { holds: h, .. }) if h == holds);
    eventually(SLACK, "w11 acquires z again", counted(2)).await;
    waiting.abort();
    eventually(SLACK, "the dropped call gives z back", counted(1)).await;
    assert_eq!(holds(&a, "z", "w11").await, (1, z11));
    b.release("m", "r11").await.unwrap();
    assert_eq!(
        a.release("z", "w11").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );

    for (key, released) in a.release_all(&keys(&["x", "y"]), "w1").await.unwrap() {
        assert_eq!(released, KeyRelease::Released { holds: 0 }, "{key}");
    }

    // What hangs on the lease runs on a family of the suite's lease.
    let family = unique_lock("several-rw-lease");
    let (a, b) = (
        read_write_pod(h.driver().await, &family, "pod-a", 2),
        read_write_pod(h.driver().await, &family, "pod-b", 2),
    );

    // A write lock lost in part (a force-release of one part) is given back whole once its
    // last answer has run out, within the lease; its owner then writes the key among several
    // afresh.
    let KeyAnswer::Held {
        token: lost,
        permit,
        ..
    } = a.acquire_write("s", "w7", NOW, HOLD).await.unwrap()
    else {
        panic!("w7 could not write s");
    };
    assert!(a.force_release("s", Some(permit), lost).await.unwrap());
    eventually(SLACK, "w7's write lock is lost", || {
        matches!(a.status("s", Some("w7")), Ok(KeyAnswer::NotHeld))
    })
    .await;
    let w7 = written(
        a.acquire_all_write(&keys(&["s", "t"]), "w7", LEASE + SLACK, HOLD)
            .await
            .unwrap(),
    );
    assert!(token(&w7, "s") > lost, "w7 wrote s afresh");
    assert_eq!(
        a.release("s", "w7").await.unwrap(),
        KeyRelease::Released { holds: 0 }
    );
    a.release("t", "w7").await.unwrap();

    // A pod dies writing x and y: both are free within the lease, for another pod's readers
    // (taken together, so that on a backend whose expiry is observed both are looked at from
    // the start), then for a writer, whose tokens are above the crashed writer's.
    let w1 = written(
        a.acquire_all_write(&keys(&["x", "y"]), "w1", NOW, HOLD)
            .await
            .unwrap(),
    );
    drop(a);
    let crashed = Instant::now();
    let within = LEASE + RENEW + SLACK;
    loop {
        let left = within.saturating_sub(crashed.elapsed());
        match b
            .acquire_all_read(&keys(&["x", "y"]), "r6", left, HOLD)
            .await
            .unwrap()
        {
            KeysAnswer::Held(_) => break,
            KeysAnswer::NotTaken {
                answer: KeyAnswer::Unknown,
                ..
            } if crashed.elapsed() < within => {}
            other => panic!("r6 after pod a crashed: {other:?}"),
        }
    }
    assert!(crashed.elapsed() <= within, "took {:?}", crashed.elapsed());
    assert!(matches!(
        b.acquire_all_write(&keys(&["x"]), "w6", NOW, HOLD)
            .await
            .unwrap(),
        KeysAnswer::NotTaken { .. }
    ));
    b.release_all(&keys(&["x", "y"]), "r6").await.unwrap();
    // The crashed writer's parts were renewed one by one, so each runs out at its own moment:
    // a reader needs one permit, a writer every part, each free within the lease.
    let w6 = written(
        b.acquire_all_write(&keys(&["x", "y"]), "w6", within, HOLD)
            .await
            .unwrap(),
    );
    for key in ["x", "y"] {
        let (before, after) = (token(&w1, key), token(&w6, key));
        assert!(
            after > before,
            "{key}: writer's token {after} after {before}"
        );
    }
}

/// The processes waiting for a lock of several permits each get a permit as permits are given
/// up. Where the backend keeps a queue (etcd, ZooKeeper) they are served first come first
/// served: the first in line takes the next permit given up, before a newcomer that asks right
/// after the release and before the processes waiting behind it; once nobody waits, nothing of
/// the line stands in the backend.
pub async fn lock_permits_waiters_are_served_in_order(h: &mut dyn Harness) {
    const PERMITS: u32 = 2;
    const HOLD: Duration = Duration::from_secs(60);
    const WAIT: Duration = Duration::from_secs(60);
    let lock = unique_lock("semaphore-line");
    let pod = |driver: Arc<dyn Backend>, identity: &str| {
        let config = LockConfig {
            permits: PERMITS,
            ..config(&lock, identity, Mode::OnDemand)
        };
        Lock::start(driver, config, Arc::new(())).expect("start lock")
    };
    let permit_name = |permit| leasehold_lease::keyed::lock_permit_name(&lock, permit);
    let line = leasehold_lease::keyed::lock_line_name(&lock);
    let held = |who: &str, answer: Answer| {
        answer
            .holding()
            .unwrap_or_else(|| panic!("{who} does not hold: {answer:?}"))
    };
    let waiter = |pod: &Lock| {
        let pod = pod.clone();
        tokio::spawn(async move { pod.acquire(WAIT, HOLD).await })
    };
    // The attempts at every permit by `identity` that the backend has answered, at least
    // `rounds` each: a waiter's place stands in a permit's queue once its attempt there is.
    let tried = |faulty: &FaultyDriver, identity: &str, rounds| {
        (0..PERMITS).all(|permit| faulty.answered(&permit_name(permit), identity) >= rounds)
    };
    let (f1, f2, f3) = (
        FaultyDriver::wrap(h.driver().await),
        FaultyDriver::wrap(h.driver().await),
        FaultyDriver::wrap(h.driver().await),
    );
    let in_order = f1.keeps_queue();
    // On a queue backend, the first in line has tried each permit twice: once on its own, once
    // first in line, keeping its places.
    let first_rounds = if in_order { 2 } else { 1 };
    let (a, b) = (
        pod(h.driver().await, "pod-a"),
        pod(h.driver().await, "pod-b"),
    );
    // Free permits taken with a wait: an attempt that a loaded machine lets time out (a
    // row-lock mode's first connection) is tried again, as it would be for an app.
    let (pa, _) = held("pod-a", a.acquire(SLACK, HOLD).await.unwrap());
    let (pb, _) = held("pod-b", b.acquire(SLACK, HOLD).await.unwrap());
    assert_ne!(pa, pb, "two holders on one permit");

    // A pod waiting first in line, through `faulty`: it has tried every permit on its own and,
    // on a queue backend, again first in line, keeping its places.
    let first_waiter = async |faulty: &Arc<FaultyDriver>, identity: &str| {
        let waiting_pod = pod(faulty.clone(), identity);
        let waiting = waiter(&waiting_pod);
        let what = format!("{identity} waits, having tried every permit");
        eventually(WAIT, &what, || tried(faulty, identity, first_rounds)).await;
        if in_order {
            let in_line = faulty.answered(&line, identity);
            assert!(in_line >= 1, "{identity} stands in line");
        }
        (waiting_pod, waiting)
    };
    let (w1_pod, w1) = first_waiter(&f1, "pod-w1").await;
    // w1's calls held back while pod-a gives its permit up and a newcomer, connected already,
    // asks: only the place w1 keeps in the backend can refuse the newcomer (or w1 holds by
    // then). Held back for less than a renew interval, so that w1's turn in line lasts.
    let newcomer_pod = pod(h.driver().await, "pod-n");
    f1.delay_requests(RENEW * 4 / 5);
    assert!(a.release().await.unwrap());
    let newcomer = newcomer_pod.acquire(Duration::ZERO, HOLD).await.unwrap();
    f1.delay_requests(Duration::ZERO);
    if in_order {
        assert!(
            !newcomer.is_holder(),
            "a newcomer took the permit w1 waits for: {newcomer:?}"
        );
    } else if newcomer.is_holder() {
        assert!(newcomer_pod.release().await.unwrap());
    }
    let (w1_permit, _) = held("w1", w1.await.expect("w1").unwrap());
    if in_order {
        assert_eq!(w1_permit, pa, "w1 takes the permit given up");
    }

    // w2 waits first in line, then w3 lines up behind it.
    let (w2_pod, w2) = first_waiter(&f2, "pod-w2").await;
    let w3_pod = pod(f3.clone(), "pod-w3");
    let w3 = waiter(&w3_pod);
    if in_order {
        // Refused, w3 lines up (a round cut short by a slow attempt has tried one permit only).
        eventually(WAIT, "w3 stands in line", || {
            f3.answered(&line, "pod-w3") >= 1
        })
        .await;
        // Behind w2, w3 tries no permit.
        let tries = |p| f3.answered(&permit_name(p), "pod-w3");
        let before = (tries(0), tries(1));
        sleep(2 * RENEW).await;
        assert_eq!((tries(0), tries(1)), before, "w3 tried a permit behind w2");
    } else {
        eventually(WAIT, "w3 waits, having tried every permit", || {
            tried(&f3, "pod-w3", 1)
        })
        .await;
    }
    assert!(b.release().await.unwrap());
    let (w2_permit, w3_permit) = if in_order {
        let (w2_permit, _) = held("w2", w2.await.expect("w2").unwrap());
        assert_eq!(w2_permit, pb, "w2 takes the permit given up");
        assert!(!w3.is_finished(), "w3 was served beside w2");
        assert!(w1_pod.release().await.unwrap());
        let (w3_permit, _) = held("w3", w3.await.expect("w3").unwrap());
        assert_eq!(w3_permit, w1_permit, "w3 takes w1's permit");
        (w2_permit, w3_permit)
    } else {
        assert!(w1_pod.release().await.unwrap());
        let (w2_permit, _) = held("w2", w2.await.expect("w2").unwrap());
        let (w3_permit, _) = held("w3", w3.await.expect("w3").unwrap());
        (w2_permit, w3_permit)
    };
    assert_ne!(w2_permit, w3_permit, "w2 and w3 on one permit");
    assert!(w2_pod.release().await.unwrap());
    assert!(w3_pod.release().await.unwrap());
    // Nobody waits now: no place of the line's stands in a permit's queue, where it would
    // keep fresh pods waiting (a place nobody comes back to goes only after several leases).
    for identity in ["pod-e1", "pod-e2"] {
        let fresh = pod(h.driver().await, identity);
        let answer = fresh.acquire(SLACK, HOLD).await.unwrap();
        assert!(
            answer.is_holder(),
            "{identity}, every permit free: {answer:?}"
        );
    }
}

/// A process that stops waiting for a lock of several permits leaves the lock's line with its
/// wait: once the waiter ahead of it is served, the one behind it takes the next permit given
/// up at once, rather than wait, trying no permit, behind a place first in line for nobody
/// until the backend drops it.
pub async fn lock_permits_a_waiter_that_gave_up_leaves_the_line(h: &mut dyn Harness) {
    const PERMITS: u32 = 2;
    const HOLD: Duration = Duration::from_secs(60);
    const WAIT: Duration = Duration::from_secs(30);
    let lock = unique_lock("semaphore-gave-up");
    let line = leasehold_lease::keyed::lock_line_name(&lock);
    let pod = |driver: Arc<dyn Backend>, identity: &str| {
        let config = LockConfig {
            permits: PERMITS,
            ..config(&lock, identity, Mode::OnDemand)
        };
        Lock::start(driver, config, Arc::new(())).expect("start lock")
    };
    let waiting = |pod: &Lock, wait: Duration| {
        let pod = pod.clone();
        tokio::spawn(async move { pod.acquire(wait, HOLD).await })
    };
    let (a, b) = (
        pod(h.driver().await, "pod-a"),
        pod(h.driver().await, "pod-b"),
    );
    assert!(a.acquire(SLACK, HOLD).await.unwrap().is_holder());
    assert!(b.acquire(SLACK, HOLD).await.unwrap().is_holder());
    // w1 waits first in line, w2 behind it for a while, w3 behind w2.
    let (f1, f2, f3) = (
        FaultyDriver::wrap(h.driver().await),
        FaultyDriver::wrap(h.driver().await),
        FaultyDriver::wrap(h.driver().await),
    );
    let in_line = |faulty: &FaultyDriver, identity: &str| {
        !faulty.keeps_queue() || faulty.answered(&line, identity) >= 1
    };
    let w1 = pod(f1.clone(), "pod-w1");
    let w1_waits = waiting(&w1, WAIT);
    eventually(SLACK, "w1 stands in line", || in_line(&f1, "pod-w1")).await;
    let w2 = pod(f2.clone(), "pod-w2");
    let w2_waits = waiting(&w2, 8 * RENEW);
    eventually(SLACK, "w2 stands in line", || in_line(&f2, "pod-w2")).await;
    let w3 = pod(f3.clone(), "pod-w3");
    let w3_waits = waiting(&w3, WAIT);
    eventually(SLACK, "w3 stands in line", || in_line(&f3, "pod-w3")).await;
    let gave_up = w2_waits.await.expect("w2").unwrap();
    assert!(!gave_up.is_holder(), "w2 took a held permit: {gave_up:?}");
    // Each permit given up goes to one of w1 and w3 within the slack: on a queue backend to w1
    // first, which then leaves the line, and the next to w3.
    let mut waiters = vec![("w1", w1, w1_waits), ("w3", w3, w3_waits)];
    let mut served_holders = Vec::new();
    for (releaser, who) in [(&a, "a"), (&b, "b")] {
        assert!(releaser.release().await.unwrap(), "{who}'s release");
        let released = Instant::now();
        let served = loop {
            if let Some(i) = waiters.iter().position(|(_, _, w)| w.is_finished()) {
                break waiters.remove(i);
            }
            assert!(
                released.elapsed() < SLACK,
                "no waiter was given {who}'s permit within {SLACK:?} of its release"
            );
            sleep(Duration::from_millis(10)).await;
        };
        let (name, holder, waited) = served;
        if f1.keeps_queue() && who == "a" {
            assert_eq!(name, "w1", "w3 was served before w1, first in line");
        }
        let answer = waited.await.expect(name).unwrap();
        assert!(answer.is_holder(), "{name}: {answer:?}");
        // It keeps its permit until the other waiter is served.
        served_holders.push(holder);
    }
    for holder in served_holders {
        assert!(holder.release().await.unwrap());
    }
}

#[macro_export]
macro_rules! conformance_suite {
    ($harness:expr) => {
        $crate::conformance_suite!(@tests $harness;
            exclusivity,
            release_and_takeover,
            only_holder_renews_or_releases,
            deprovision_ends_the_holders_claim,
            records_are_deleted_only_while_held,
            records_deleted_late_leave_the_next_holder,
            tokens_strictly_increase,
            crash_takeover_within_lease,
            paused_holder_fences_itself_first,
            many_contenders,
            release_wakes_a_waiter,
            backend_outage_and_recovery,
            keyed_owners_exclude_each_other,
            idle_keys_are_forgotten_and_their_tokens_still_rise,
            families_apart_by_case_are_swept_apart,
            held_keys_are_counted,
            keyed_permits_admit_that_many_owners,
            keyed_semaphore_waiters_are_served_in_order,
            keyed_semaphore_waiter_keeps_its_places_through_slow_answers,
            keyed_several_keys_all_or_nothing,
            keyed_read_write_locks,
            keyed_read_write_after_a_larger_semaphore,
            keyed_several_keys_written,
            lock_permits_admit_that_many_holders,
            lock_permits_waiters_are_served_in_order,
            lock_permits_a_waiter_that_gave_up_leaves_the_line
        );
    };
    (@tests $harness:expr; $($scenario:ident),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $scenario() {
                let mut harness = $harness;
                $crate::conformance::$scenario(&mut harness).await;
            }
        )+
    };
}

/// A backend that enforces a longer lease than `lease` (ZooKeeper's `minSessionTimeout`, etcd's
/// whole seconds) is reported once held: the lock's warning names both, rather than promising a
/// takeover within the lease.
pub async fn an_enforced_lease_longer_than_configured_is_reported(
    driver: Arc<dyn Backend>,
    lease: Duration,
    enforced: &str,
) {
    let lock = Lock::start(
        driver,
        LockConfig::new(&unique_lock("enforced"), "a", lease),
        Arc::new(()),
    )
    .expect("start lock");
    assert!(
        lock.wait_for_holder(Duration::from_secs(10))
            .await
            .is_holder()
    );
    let warning = lock.snapshot().warning.expect("a warning about the lease");
    assert!(
        warning.contains(enforced) && warning.contains(&format!("{lease:?}")),
        "the enforced and the configured lease are named: {warning}"
    );
    lock.shutdown().await;
}

/// The network drops the connections `driver`'s holder has through `proxies` without telling
/// either end (a NAT or conntrack entry gone; the server's node gone while a Service sends new
/// connections to a replacement): nothing comes back on them, and nothing closes them. The
/// holder must renew on a new connection within its lease and keep the lock with its token;
/// kept on the silent connections, every renewal timed out until the kernel gave them up, a
/// quarter of an hour later. The lease is longer than a request's 5 s response timeout and a
/// renew interval after it.
pub async fn holder_renews_after_its_connections_fall_silent(
    driver: Arc<dyn Backend>,
    proxies: &[&super::FaultProxy],
) {
    let lease = Duration::from_secs(10);
    let holder = super::campaign(driver, &unique_lock("silent"), "a", lease);
    eventually(Duration::from_secs(5), "a holds", || {
        holder.answer().is_holder()
    })
    .await;
    let Answer::Holder { token, .. } = holder.answer() else {
        unreachable!()
    };
    for proxy in proxies {
        proxy.strand();
    }
    let stranded = leasehold_lease::BootInstant::now();
    let start = Instant::now();
    loop {
        let held = holder.snapshot().held;
        if held.is_some_and(|held| held.valid_until > stranded + lease) {
            break;
        }
        assert!(
            start.elapsed() < lease,
            "no renewal went through within the lease after the connections fell silent: {:?}",
            holder.snapshot()
        );
        sleep(Duration::from_millis(20)).await;
    }
    match holder.answer() {
        Answer::Holder { token: now, .. } => assert_eq!(now, token, "the holding was kept"),
        other => panic!("the holder lost the lock: {other:?}"),
    }
    assert!(super::claims(&holder));
}
