//! A single Redis master that restarts: with its data (an append-only file synced on every
//! write) it lost nothing, and locks go on at once; without it (no persistence, or the last
//! second of `appendfsync everysec`), a lease its holder still claims is gone, and the server
//! must not hand the lock to anyone else before that claim has ended. The same on Tair (Redis
//! with the TairString module behind `tair://`), whose driver guards it without Lua. Beside
//! those, a server that falls silent on the connections a driver has without closing them.

use std::time::Duration;

use leasehold_lease::{Acquire, Answer, Lock};
use leasehold_testkit::conformance::holder_renews_after_its_connections_fall_silent;
use leasehold_testkit::{
    FaultProxy, FaultyDriver, RedisServer, campaign, claims, driver_for, unique_lock,
};
use tokio::time::{Instant, sleep};

async fn held_token(lock: &Lock, within: Duration) -> u64 {
    let start = Instant::now();
    loop {
        if let Answer::Holder { token, .. } = lock.answer() {
            return token;
        }
        assert!(start.elapsed() < within, "never held: {:?}", lock.answer());
        sleep(Duration::from_millis(10)).await;
    }
}

/// `call`'s result once it stops failing, trying for up to 5 s: a driver's first calls after a
/// restart may meet the old connection, or a server not up yet.
async fn once_reconnected<T, E>(mut call: impl AsyncFnMut() -> Result<T, E>) -> Result<T, E> {
    let reconnecting = Instant::now();
    loop {
        let result = call().await;
        if result.is_ok() || reconnecting.elapsed() >= Duration::from_secs(5) {
            return result;
        }
        sleep(Duration::from_millis(50)).await;
    }
}

/// The holder is cut off from Redis (a partition, a long pause) and Redis restarts without its
/// data: the lease and the token counter are gone. A contender must hold only once the old
/// claim has ended, with a greater token. Without the epoch record it took the lock at once,
/// with the same token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_lost_the_lease_grants_the_lock_only_after_the_old_claim() {
    restart_that_lost_the_lease(RedisServer::start_with(false), Restart::Empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_restart_that_lost_the_lease_grants_the_lock_only_after_the_old_claim() {
    restart_that_lost_the_lease(RedisServer::start_tair_with(false), Restart::Empty).await;
}

/// The same with a server that comes back from a snapshot taken before the lease (Redis's
/// default `save` points, no append-only file) and answers `LOADING` while it loads it: the
/// contender meets that first, and must not take it for a server without a restart guard.
/// Tair's driver did (any error reply to `INFO` was a refusal for good) and, once the snapshot
/// was loaded, granted the lock at once, beside the old claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_an_old_snapshot_grants_the_lock_only_after_the_old_claim() {
    let server = RedisServer::start_with(false);
    restart_that_lost_the_lease(server, Restart::FromAnOldSnapshot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_restart_from_an_old_snapshot_grants_the_lock_only_after_the_old_claim() {
    let server = RedisServer::start_tair_with(false);
    restart_that_lost_the_lease(server, Restart::FromAnOldSnapshot).await;
}

/// A server made durable by `CONFIG SET` alone comes back from a restart as it was started,
/// without persistence: its durability, read before the restart, says nothing of it. With the
/// reading trusted for a minute, the contender's driver took the empty server for a durable one
/// restarted on its own data, and granted the lock at once with a token counted from nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_drops_durability_set_at_run_time_grants_the_lock_only_after_the_old_claim()
{
    let mut server = RedisServer::start_with(false);
    server.make_durable_until_restart();
    restart_that_lost_the_lease(server, Restart::Empty).await;
}

/// How the server of [`restart_that_lost_the_lease`] comes back.
#[derive(Clone, Copy, PartialEq)]
enum Restart {
    /// With nothing: no persistence at all (whatever `CONFIG SET` made of it while it ran).
    Empty,
    /// With a snapshot taken before the lease, loaded for about 1.5 s.
    FromAnOldSnapshot,
}

/// Keys in the snapshot of [`Restart::FromAnOldSnapshot`], and how long each takes to load.
const SNAPSHOT_KEYS: usize = 3000;
const LOAD_PER_KEY: Duration = Duration::from_micros(500);

async fn restart_that_lost_the_lease(mut server: RedisServer, restart: Restart) {
    let lock = unique_lock("restart");
    let lease = Duration::from_secs(3);
    if restart == Restart::FromAnOldSnapshot {
        let mut admin = server.admin().await;
        let mut fill = redis::pipe();
        for i in 0..SNAPSHOT_KEYS {
            fill.set(format!("fill:{i}"), "x").ignore();
        }
        let () = fill.query_async(&mut admin).await.expect("fill");
        let () = redis::cmd("SAVE")
            .query_async(&mut admin)
            .await
            .expect("SAVE");
    }
    let a_driver = FaultyDriver::wrap(driver_for(&server.url()).await);
    let a = campaign(a_driver.clone(), &lock, "a", lease);
    // A fresh server without persistence cannot tell its start from a restart that lost
    // everything: its first grant waits until it has been up for a lease.
    let a_token = held_token(&a, lease * 3).await;
    let b_driver = driver_for(&server.url()).await;
    // The contender's driver meets the server before the restart, as a waiting sidecar's does.
    let busy = b_driver
        .try_acquire(&lock, "b", lease)
        .await
        .expect("b's attempt");
    assert!(matches!(busy, Acquire::Busy(_)), "{busy:?}");

    a_driver.cut_off(true);
    let restarted = Instant::now();
    let restarting = tokio::task::spawn_blocking(move || {
        match restart {
            Restart::Empty => server.restart(),
            Restart::FromAnOldSnapshot => server.restart_loading_slowly(LOAD_PER_KEY),
        }
        server
    });
    let b = campaign(b_driver, &lock, "b", lease);
    let TakenOver {
        b_token,
        b_met_loading,
    } = taken_over_after_the_old_claim(&a, &b, restarted, lease).await;
    let _server = restarting.await.expect("restarted");
    if restart == Restart::FromAnOldSnapshot {
        assert!(
            b_met_loading,
            "b never met the server loading (the case under test)"
        );
    }
    assert!(
        b_token > a_token,
        "token {b_token} after the restart, {a_token} before"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// What [`taken_over_after_the_old_claim`] saw.
struct TakenOver {
    b_token: u64,
    /// Whether b met the server loading its data.
    b_met_loading: bool,
}

/// Watches `a` (cut off from a server restarted at `restarted`, still claiming) and `b` (a
/// contender) until b holds: never both at once, and a still claimed a while after the restart
/// (the case under test).
async fn taken_over_after_the_old_claim(
    a: &Lock,
    b: &Lock,
    restarted: Instant,
    lease: Duration,
) -> TakenOver {
    let (mut a_last_claimed, mut b_met_loading) = (None, false);
    let b_token = loop {
        // b first: a holding of b's that began before a's claim was read would be two
        // holders (read the other way round, a stall between the reads could pass for one).
        let b_answer = b.answer();
        let a_claims = claims(a);
        assert!(
            !(a_claims && b_answer.is_holder()),
            "two holders after the restart: a claims {:?}, b answers {b_answer:?}",
            a.snapshot().held
        );
        if a_claims {
            a_last_claimed = Some(restarted.elapsed());
        }
        b_met_loading |= b
            .snapshot()
            .backend_error
            .is_some_and(|e| e.to_lowercase().contains("loading"));
        if let Answer::Holder { token, .. } = b_answer {
            break token;
        }
        assert!(
            restarted.elapsed() < lease * 4,
            "b never took over after the restart: {b_answer:?}"
        );
        sleep(Duration::from_millis(5)).await;
    };
    assert!(
        a_last_claimed.is_some_and(|t| t > Duration::from_millis(100)),
        "the old holder still claimed after the restart (the case under test): {a_last_claimed:?}"
    );
    TakenOver {
        b_token,
        b_met_loading,
    }
}

/// A server whose append-only file is synced once a second (not durable: a crash may lose the
/// last second's writes) crashes, losing the lease its holder still claims, and is started
/// again with `appendfsync always`, as an operator makes it durable. The restarted server is
/// durable; the one that crashed was not, and its epoch record says so: a contender that first
/// meets the restarted server must not hold before the old claim has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_made_durable_by_its_restart_grants_the_lock_only_after_the_old_claim() {
    made_durable_by_its_restart(RedisServer::start_with(false)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_server_made_durable_by_its_restart_grants_the_lock_only_after_the_old_claim() {
    made_durable_by_its_restart(RedisServer::start_tair_with(false)).await;
}

async fn made_durable_by_its_restart(mut server: RedisServer) {
    let lock = unique_lock("made-durable");
    // Long enough that the restart and b's first connection, before the watch begins, stay
    // well within a's last claim on a loaded machine.
    let lease = Duration::from_secs(6);
    tokio::task::block_in_place(|| server.append_every_second_until_restart());
    let a_driver = FaultyDriver::wrap(driver_for(&server.url()).await);
    let a = campaign(a_driver.clone(), &lock, "a", lease);
    let a_token = held_token(&a, lease * 3).await;
    a_driver.cut_off(true);
    // The crash loses the last second's writes, the lease among them; the epoch record, written
    // by the first acquisition, is kept. (A kill alone loses nothing the server wrote: the
    // system keeps it.)
    let mut admin = server.admin().await;
    let deleted: i64 = redis::cmd("DEL")
        .arg(format!("leasehold:{{{lock}}}:lease"))
        .query_async(&mut admin)
        .await
        .expect("DEL");
    assert_eq!(deleted, 1, "the lease is where the driver keeps it");
    let restarted = Instant::now();
    tokio::task::block_in_place(|| server.restart_durable());
    // A contender whose driver first meets the restarted server: its durability is read there.
    let b = campaign(driver_for(&server.url()).await, &lock, "b", lease);
    let TakenOver { b_token, .. } = taken_over_after_the_old_claim(&a, &b, restarted, lease).await;
    assert!(
        b_token > a_token,
        "token {b_token} after the restart, {a_token} before"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// A durable server made lossy while it runs (`CONFIG SET appendfsync everysec`): an
/// acquisition whose reading finds it so marks its epoch record not durable, and the next
/// restart, whatever settings it comes back with, grants no free lock before a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_made_lossy_while_it_runs_is_not_trusted_at_its_restart() {
    made_lossy_while_it_runs(RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_server_made_lossy_while_it_runs_is_not_trusted_at_its_restart() {
    made_lossy_while_it_runs(RedisServer::start_tair()).await;
}

async fn made_lossy_while_it_runs(mut server: RedisServer) {
    let lease = Duration::from_secs(30);
    let durable = driver_for(&server.url()).await;
    let first = durable
        .try_acquire(&unique_lock("durable"), "a", lease)
        .await;
    assert!(
        matches!(first, Ok(Acquire::Acquired(_))),
        "a fresh durable server grants at once: {first:?}"
    );
    tokio::task::block_in_place(|| server.append_every_second_until_restart());
    // A driver that reads the settings now, and acquires a free lock: the record says lossy.
    let lossy = driver_for(&server.url()).await;
    let second = lossy.try_acquire(&unique_lock("lossy"), "b", lease).await;
    assert!(
        matches!(second, Ok(Acquire::Acquired(_))),
        "the same incarnation grants at once: {second:?}"
    );
    tokio::task::block_in_place(|| server.restart_durable());
    let after = driver_for(&server.url()).await;
    let lock = unique_lock("after");
    let third = once_reconnected(async || after.try_acquire(&lock, "c", lease).await).await;
    assert!(
        matches!(third, Ok(Acquire::Withheld(_))),
        "a restart after a lossy incarnation granted a free lock at once: {third:?}"
    );
}

/// A record whose `durable` field speaks of another incarnation than the one it names (a
/// sidecar of an earlier version wrote the new epoch, without the field) says nothing of how
/// that one kept its data: a durable server meeting it waits out the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_field_of_another_incarnation_is_not_trusted() {
    let server = RedisServer::start();
    let mut admin = server.admin().await;
    let () = redis::cmd("HSET")
        .arg("leasehold:epoch")
        .arg("replid")
        .arg("written-by-an-earlier-version")
        .arg("since")
        .arg("0")
        .arg("floor")
        .arg("0")
        .arg("keeper")
        .arg("written-by-an-earlier-version ")
        .arg("durable")
        .arg("the-incarnation-before 1")
        .query_async(&mut admin)
        .await
        .expect("HSET");
    let driver = driver_for(&server.url()).await;
    let lease = Duration::from_secs(30);
    let acquired = driver.try_acquire(&unique_lock("after"), "a", lease).await;
    assert!(
        matches!(acquired, Ok(Acquire::Withheld(_))),
        "a record that says nothing of its incarnation was trusted: {acquired:?}"
    );
}

/// A durable master (`appendonly yes`, `appendfsync always`) that restarts lost nothing: the
/// holder's lease is still there, a free lock is granted at once, and tokens are not rebased
/// (the free lock's first token is 1, or 2 after a draw lost to the reconnection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_restart_keeps_the_lease_and_grants_free_locks_at_once() {
    durable_restart(RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_tair_restart_keeps_the_lease_and_grants_free_locks_at_once() {
    durable_restart(RedisServer::start_tair()).await;
}

async fn durable_restart(mut server: RedisServer) {
    let (held, free) = (unique_lock("kept"), unique_lock("free"));
    let client = driver_for(&server.url()).await;
    let lease = Duration::from_secs(30);
    let Acquire::Acquired(first) = client.try_acquire(&held, "a", lease).await.unwrap() else {
        panic!("a fresh durable server grants at once");
    };
    assert_eq!(first.token, 1);
    tokio::task::block_in_place(|| server.restart());
    // The same driver, as in a sidecar that outlives the restart (Tair's renewals go by the
    // version that only the holder's driver knows); its first call may meet the old connection.
    let observed = once_reconnected(async || client.observe(&held).await).await;
    let holding = observed.unwrap().expect("the lease survived");
    assert_eq!((holding.identity.as_str(), holding.token), ("a", 1));
    assert!(client.renew(&first, lease).await.unwrap());
    match client.try_acquire(&free, "b", lease).await.unwrap() {
        // Not raised to a floor (the server's clock in microseconds); on Tair a draw whose
        // claim met the reconnection is undone and lost, so 1 or 2.
        Acquire::Acquired(lease) => assert!(lease.token <= 2, "token {}", lease.token),
        busy => panic!("a durable restart held up a free lock: {busy:?}"),
    }
}

/// A server that skips its sync while a rewrite or a snapshot runs (`no-appendfsync-on-rewrite
/// yes`) may lose acknowledged writes in a crash, as `appendfsync everysec` may: it is not
/// durable, so a fresh one grants no free lock before it has been up for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_skips_its_sync_during_rewrites_is_not_durable() {
    for server in [RedisServer::start(), RedisServer::start_tair()] {
        let mut admin = server.admin().await;
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("no-appendfsync-on-rewrite")
            .arg("yes")
            .query_async(&mut admin)
            .await
            .expect("CONFIG SET");
        let client = driver_for(&server.url()).await;
        let lock = unique_lock("skips-sync");
        let answer = client
            .try_acquire(&lock, "a", Duration::from_secs(300))
            .await
            .expect("an answer");
        assert!(
            matches!(answer, Acquire::Withheld(_)),
            "{}: a fresh server that may lose writes during rewrites granted a free lock at once: \
             {answer:?}",
            server.url()
        );
    }
}

/// A durable master that the driver first meets while it is down (a sidecar that starts with
/// its Redis, or during a restart) is still known to be durable once it answers: a free lock is
/// granted at once. When the failed `CONFIG GET` counted as "not durable", the first
/// acquisition recorded a new epoch and the free lock was refused for a whole lease (the smoke
/// test of the static binary waited 10 s for it in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_master_first_met_while_down_grants_free_locks_at_once() {
    first_met_while_down(RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_tair_master_first_met_while_down_grants_free_locks_at_once() {
    first_met_while_down(RedisServer::start_tair()).await;
}

async fn first_met_while_down(mut server: RedisServer) {
    let lock = unique_lock("first-met-while-down");
    let lease = Duration::from_secs(30);
    tokio::task::block_in_place(|| server.kill());
    let client = driver_for(&server.url()).await;
    let down = client.try_acquire(&lock, "a", lease).await;
    assert!(down.is_err(), "a stopped server answered: {down:?}");
    tokio::task::block_in_place(|| server.restart());
    let acquired = once_reconnected(async || client.try_acquire(&lock, "a", lease).await).await;
    match acquired.unwrap() {
        Acquire::Acquired(lease) => assert!(lease.token <= 2, "token {}", lease.token),
        busy => panic!("a durable server met first while down held up a free lock: {busy:?}"),
    }
}

/// A durable master busy with someone's long script when the driver first asks it its
/// settings (every command but `SCRIPT KILL` is answered `BUSY`) is still known to be durable
/// once it answers: a free lock is granted at once. Taken for a refusal of `CONFIG`, the
/// `BUSY` counted the master as not durable, and the free lock was refused for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_master_busy_with_a_script_grants_free_locks_once_it_is_done() {
    let server = RedisServer::start();
    let lock = unique_lock("busy-master");
    let lease = Duration::from_secs(30);
    let mut admin = server.admin().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(20)
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut spinning = server.admin().await;
    let script = tokio::spawn(async move {
        redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .query_async::<()>(&mut spinning)
            .await
    });
    // Busy once another client is answered BUSY (not before the script runs, however slowly
    // the machine starts it).
    let mut probe = server.admin().await;
    let started = Instant::now();
    loop {
        let ping = redis::cmd("PING").query_async::<String>(&mut probe).await;
        if ping.as_ref().is_err_and(|e| e.code() == Some("BUSY")) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never busy: {ping:?}"
        );
        sleep(Duration::from_millis(20)).await;
    }
    let client = driver_for(&server.url()).await;
    let busy = client.try_acquire(&lock, "a", lease).await;
    assert!(
        busy.is_err(),
        "a master busy with a script answered: {busy:?}"
    );
    let _: () = redis::cmd("SCRIPT")
        .arg("KILL")
        .query_async(&mut server.admin().await)
        .await
        .unwrap();
    assert!(script.await.unwrap().is_err(), "the script was not killed");
    match client.try_acquire(&lock, "a", lease).await.unwrap() {
        Acquire::Acquired(lease) => assert!(lease.token <= 2, "token {}", lease.token),
        busy => panic!("a durable master met busy held up a free lock: {busy:?}"),
    }
}

/// A Redis user that may not run `INFO` still takes locks, without the guard against a restart
/// that lost a lease, and the lock's warnings say so and what to allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_info_gets_locks_and_a_warning() {
    user_without_info(RedisServer::start(), "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_user_without_info_gets_locks_and_a_warning() {
    user_without_info(RedisServer::start_tair(), "tair").await;
}

async fn user_without_info(server: RedisServer, scheme: &str) {
    let mut admin = server.admin().await;
    let _: () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER", "locker", "on", ">secret", "~*", "&*", "+@all", "-info",
            ][..],
        )
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let locker = driver_for(&format!(
        "{scheme}://locker:secret@127.0.0.1:{}",
        server.port()
    ))
    .await;
    let lock = unique_lock("no-info");
    match locker
        .try_acquire(&lock, "a", Duration::from_secs(30))
        .await
        .unwrap()
    {
        Acquire::Acquired(lease) => assert!(locker.release(&lease).await.unwrap()),
        busy => panic!("{busy:?}"),
    }
    let warnings = locker.warnings().await.unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("INFO is refused")
                && w.contains("let the lock's Redis user run INFO")),
        "{warnings:?}"
    );
    let full = driver_for(&server.url()).await;
    assert_eq!(full.warnings().await.unwrap(), Vec::<String>::new());
}

/// A holder whose connections fall silent renews on new ones
/// ([`holder_renews_after_its_connections_fall_silent`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_connection_falls_silent_renews_on_a_new_one() {
    connection_falls_silent(RedisServer::start(), "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_holder_whose_connection_falls_silent_renews_on_a_new_one() {
    connection_falls_silent(RedisServer::start_tair(), "tair").await;
}

async fn connection_falls_silent(server: RedisServer, scheme: &str) {
    let proxy = FaultProxy::start(server.port());
    let driver = driver_for(&format!("{scheme}://127.0.0.1:{}", proxy.port)).await;
    holder_renews_after_its_connections_fall_silent(driver, &[&proxy]).await;
}
