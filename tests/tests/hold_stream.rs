//! Holds bound to a connection (`POST .../hold`), against real sidecar processes on a real
//! Redis: the lock or key is held while the app's connection is open, free the moment it closes,
//! each renewal told with its validity, and a loss told the moment the sidecar runs again.

use std::time::{Duration, Instant};

use leasehold_e2e::fault_proxy::FaultProxy;
use leasehold_e2e::{
    EventStream, RedisServer, Reply, Sidecar, StreamEvent, eventually, unique_lock,
};
use nix::sys::signal::Signal;

/// A renewal a second under a lease long enough that a release which never happened (waited
/// out from the last renewal: 5 s or more after a connection closed) is far from one at once
/// ([`RELEASED_WITHIN`]), however loaded the machine.
const TIMING: [&str; 4] = ["--lease-duration", "6s", "--renew-interval", "1s"];
/// Where a test compares a claim's end with another pod's grant: the claim ends a safety margin
/// (lease / 50 + 10 ms) before the backend lets the lease go, 130 ms under this lease.
const LONG_TIMING: [&str; 4] = ["--lease-duration", "6s", "--renew-interval", "2s"];
/// How soon a lock is free after its connection closed, at most, on a loaded machine: well
/// short of what is left of [`TIMING`]'s lease, and of the connection's own hold (two leases),
/// which a release that never happened would wait out.
const RELEASED_WITHIN: Duration = Duration::from_secs(3);
/// A read-write family of two permits: up to two readers, or one writer.
const READ_WRITE: [&str; 3] = ["--permits", "2", "--read-write"];
/// How much later than the sidecar sent an event this test may read it on a loaded machine:
/// the end of the validity an event told, counted from its reading, is that much too late.
/// A holding released in the backend at once is taken seconds before that end.
const READ_LAG: Duration = Duration::from_millis(500);

fn on_demand(identity: &str, redis: &RedisServer, lock: &str, family: &str) -> Sidecar {
    on_demand_with(identity, &redis.url(), lock, family, &TIMING)
}

fn on_demand_with(
    identity: &str,
    backend: &str,
    lock: &str,
    family: &str,
    timing: &[&str],
) -> Sidecar {
    let args = [timing, &["--mode", "on-demand", "--keyed", family]].concat();
    Sidecar::start(identity, backend, lock, &args)
}

fn open(sidecar: &Sidecar, path: &str) -> EventStream {
    EventStream::post(sidecar.addr, path)
        .unwrap_or_else(|reply| panic!("POST {path}: {} {}", reply.status, reply.body))
}

/// Follow `stream` for `during`: every event a renewal of `token` with a validity; how many.
fn renewals_told(stream: &EventStream, token: u64, during: Duration) -> usize {
    let mut renewals = 0;
    let until = Instant::now() + during;
    while Instant::now() < until {
        if let Some(StreamEvent { kind, body, .. }) = stream.try_next() {
            assert_eq!(kind, "renewed", "{body}");
            assert_eq!(body["fencingToken"], token);
            assert!(body["validForMs"].as_u64().unwrap() > 0, "{body}");
            renewals += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    renewals
}

/// `POST path` on `addr` (an acquisition that waits) begun, then `stream` closed: the answer,
/// and how long after the close it came.
fn taken_once_closed(
    stream: EventStream,
    addr: std::net::SocketAddr,
    path: String,
) -> (Reply, Duration) {
    let waiting = std::thread::spawn(move || {
        let reply = leasehold_e2e::http(addr, "POST", &path).expect("acquire");
        (reply, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(300));
    let closed = Instant::now();
    stream.close();
    let (reply, taken) = waiting.join().unwrap();
    (reply, taken - closed)
}

#[test]
fn a_key_held_by_a_connection_is_held_while_it_is_open_and_free_the_moment_it_closes() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let a = on_demand("pod-a", &redis, &unique_lock("plain"), &family);
    let b = on_demand("pod-b", &redis, &unique_lock("plain"), &family);
    let key = format!("/locks/{family}/keys/order-1");

    let stream = open(&a, &format!("{key}/hold?owner=w1&wait=2s"));
    let acquired = stream.next(Duration::from_secs(5));
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    let acquired = acquired.body;
    assert_eq!(acquired["family"], family.as_str());
    assert_eq!(acquired["key"], "order-1");
    assert_eq!(acquired["owner"], "w1");
    let token = acquired["fencingToken"].as_u64().expect("fencingToken");
    assert!(acquired["validForMs"].as_u64().unwrap() > 0, "{acquired}");

    // Held for longer than the lease and the connection's own hold (two leases), renewed and
    // told so.
    let renewals = renewals_told(&stream, token, Duration::from_secs(13));
    assert!(
        renewals >= 8,
        "{renewals} renewals told in 13 s of a 1 s renew interval"
    );
    assert_eq!(a.get(&format!("{key}?owner=w1")).status, 200);
    assert_eq!(a.post(&format!("{key}/acquire?owner=w2")).status, 409);
    assert_eq!(b.post(&format!("{key}/acquire?owner=w3")).status, 409);

    // The app goes away: the key is released at once, not when a hold or the lease runs out.
    let path = format!("{key}/acquire?owner=w3&wait=10s");
    let (reply, after) = taken_once_closed(stream, b.addr, path);
    assert!(reply.token() > token, "{}", reply.body);
    assert!(
        after < RELEASED_WITHIN,
        "the key was taken {after:?} after the connection closed"
    );
}

#[test]
fn a_lock_held_by_a_connection_is_free_the_moment_it_closes() {
    let redis = RedisServer::start();
    let lock = unique_lock("bound");
    let family = unique_lock("unused");
    let a = on_demand("pod-a", &redis, &lock, &family);
    let b = on_demand("pod-b", &redis, &lock, &family);

    let stream = open(&a, "/lock/hold?wait=2s");
    let acquired = stream.next(Duration::from_secs(5));
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    let acquired = acquired.body;
    assert_eq!(acquired["lock"], lock.as_str());
    let token = acquired["fencingToken"].as_u64().unwrap();
    assert_eq!(a.get("/lock").status, 200);
    assert_eq!(b.post("/lock/acquire").status, 409);
    // Another connection of the same pod shares the holding, counted: the lock stays held
    // until both have closed.
    let second = open(&a, "/lock/hold");
    let StreamEvent { kind, body, .. } = second.next(Duration::from_secs(5));
    assert_eq!(
        (kind.as_str(), &body["fencingToken"]),
        ("acquired", &token.into())
    );
    assert_eq!(body["holds"], 2, "{body}");
    stream.close();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        a.get("/lock").status,
        200,
        "the second connection still holds"
    );

    let closed = Instant::now();
    second.close();
    let reply = b.post("/lock/acquire?wait=10s");
    assert!(reply.token() > token, "{}", reply.body);
    assert!(
        closed.elapsed() < RELEASED_WITHIN,
        "the lock was taken {:?} after the connection closed",
        closed.elapsed()
    );
}

/// A sidecar paused past its claim tells nothing while paused; its last word's `validForMs`
/// had run out before another pod held the key, and once it runs again the stream says `lost`
/// at once and ends.
/// On a lock of two permits the stream names the permit beside the token, and a force-release
/// of the holding must name it too (tokens count per permit): without it a 400, with the other
/// permit a 409 that ends nothing, with its own the holding ends and the stream says so.
#[test]
fn a_hold_on_a_lock_of_permits_names_its_permit_and_so_must_its_force_release() {
    let redis = RedisServer::start();
    let lock = unique_lock("permits");
    let args = [&TIMING[..], &["--mode", "on-demand", "--permits", "2"]].concat();
    let sidecar = Sidecar::start("a", &redis.url(), &lock, &args);
    let stream = open(&sidecar, "/lock/hold?wait=5s");
    let StreamEvent { kind, body, .. } = stream.next(Duration::from_secs(5));
    assert_eq!(kind, "acquired", "{body}");
    let token = body["fencingToken"].as_u64().expect("a token");
    let permit = body["permit"].as_u64().expect("the permit");
    assert!(permit < 2, "{body}");
    let answer = sidecar.get("/lock");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["permit"], permit, "{}", answer.body);
    assert_eq!(answer.json()["permits"], 2, "{}", answer.body);

    let path = |query: &str| format!("/locks/{lock}/force-release?token={token}{query}");
    let unnamed = sidecar.post(&path(""));
    assert_eq!(unnamed.status, 400, "{}", unnamed.body);
    assert!(unnamed.body.contains("permit"), "{}", unnamed.body);
    let other = sidecar.post(&path(&format!("&permit={}", 1 - permit)));
    assert_eq!(other.status, 409, "{}", other.body);
    assert_eq!(
        sidecar.get("/lock").status,
        200,
        "the other permit's request ended nothing"
    );
    let named = sidecar.post(&path(&format!("&permit={permit}")));
    assert_eq!(named.status, 200, "{}", named.body);
    let ended = loop {
        let StreamEvent { kind, body, .. } = stream.next(Duration::from_secs(5));
        if kind != "renewed" {
            break (kind, body);
        }
    };
    assert!(
        ["lost", "released"].contains(&ended.0.as_str()),
        "{ended:?}"
    );
    assert_eq!(sidecar.get("/lock").status, 409);
}

/// Follow `stream` of `a` for `settle` (every event a renewal of the holding told of by `last`,
/// the last word read and when), then pause `a` (SIGSTOP) past its claim while `take` makes
/// another pod the holder: that happens only once the last validity told has run out, and the
/// paused sidecar says nothing meanwhile. How many renewals were told before the pause; `a`
/// is left paused.
fn paused_past_its_claim(
    a: &Sidecar,
    stream: &EventStream,
    mut last: (Instant, serde_json::Value),
    settle: Duration,
    take: impl FnOnce(),
) -> usize {
    let token = last.1["fencingToken"].clone();
    let mut renewals = 0;
    let settled = Instant::now() + settle;
    while Instant::now() < settled {
        if let Some(StreamEvent { kind, body, at }) = stream.try_next() {
            assert_eq!(kind, "renewed", "{body}");
            assert_eq!(body["fencingToken"], token);
            renewals += 1;
            last = (at, body);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    a.signal(Signal::SIGSTOP);
    // What was on its way when the sidecar stopped.
    std::thread::sleep(Duration::from_millis(200));
    while let Some(StreamEvent { kind, body, at }) = stream.try_next() {
        assert_eq!(kind, "renewed", "{body}");
        last = (at, body);
    }
    take();
    let taken_at = Instant::now();
    // A stopped process writes nothing: an event read only now was sent before the pause, and
    // read late on a loaded machine.
    while let Some(StreamEvent { kind, body, at }) = stream.try_next() {
        assert_eq!(kind, "renewed", "{body}");
        assert_eq!(body["fencingToken"], token);
        last = (at, body);
    }
    // Counted from its reading, a validity ends up to the reading's lag late.
    let last_valid_until =
        last.0 + Duration::from_millis(last.1["validForMs"].as_u64().expect("validForMs"));
    assert!(
        last_valid_until <= taken_at + READ_LAG,
        "another pod held {:?} before the paused pod's last told validity ran out",
        last_valid_until - taken_at
    );
    renewals
}

#[test]
fn a_paused_sidecar_says_lost_the_moment_it_runs_again() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let plain = unique_lock("plain");
    let a = on_demand_with("pod-a", &redis.url(), &plain, &family, &LONG_TIMING);
    let b = on_demand_with("pod-b", &redis.url(), &plain, &family, &LONG_TIMING);
    let key = format!("/locks/{family}/keys/order-9");

    let stream = open(&a, &format!("{key}/hold?owner=w1"));
    let acquired = stream.next(Duration::from_secs(5));
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    let acquired = acquired.body;
    let token = acquired["fencingToken"].as_u64().unwrap();
    paused_past_its_claim(
        &a,
        &stream,
        (Instant::now(), acquired),
        Duration::from_millis(2500),
        || {
            let taken = b.post(&format!("{key}/acquire?owner=w2&wait=15s"));
            assert!(taken.token() > token, "{}", taken.body);
        },
    );

    a.signal(Signal::SIGCONT);
    let resumed = Instant::now();
    let StreamEvent { kind, body, .. } = stream.next(Duration::from_secs(5));
    assert_eq!(kind, "lost", "{body}");
    assert_eq!(body["fencingToken"], token);
    assert!(
        resumed.elapsed() < RELEASED_WITHIN,
        "lost was told {:?} after the sidecar ran again",
        resumed.elapsed()
    );
    assert_eq!(a.get(&format!("{key}?owner=w1")).status, 409);
}

/// A campaign's follower (`GET /lock/events`) is told how long each word holds: `state` and
/// `acquired` carry the holding's `validForMs`, and each renewal comes as `renewed` with its
/// own. A leader's sidecar paused past its claim says nothing more, and the other pod leads
/// only once the last validity told has run out; the stream says `lost` when it runs again.
#[test]
fn a_campaigns_events_tell_each_validity_and_a_paused_leader_is_replaced_after_the_last() {
    let redis = RedisServer::start();
    let lock = unique_lock("leader");
    let a = Sidecar::start("pod-a", &redis.url(), &lock, &LONG_TIMING);
    eventually(Duration::from_secs(10), "pod a leads", || {
        a.get("/lock").status == 200
    });
    let b = Sidecar::start("pod-b", &redis.url(), &lock, &LONG_TIMING);
    let stream = EventStream::get(a.addr, "/lock/events")
        .unwrap_or_else(|reply| panic!("GET /lock/events: {} {}", reply.status, reply.body));
    let state = stream.next(Duration::from_secs(5));
    assert_eq!(state.kind, "state", "{state:?}");
    assert_eq!(state.body["holder"], true, "{}", state.body);
    let token = state.body["fencingToken"].as_u64().unwrap();
    assert!(
        state.body["validForMs"].as_u64().is_some_and(|v| v > 0),
        "the leader's state says how long it holds: {}",
        state.body
    );
    let renewals = paused_past_its_claim(
        &a,
        &stream,
        (state.at, state.body),
        Duration::from_millis(4500),
        || {
            eventually(Duration::from_secs(15), "pod b leads", || {
                b.get("/lock").status == 200
            });
            assert!(b.get("/lock").token() > token);
        },
    );
    assert!(renewals >= 1, "no renewal told in two renew intervals");
    a.signal(Signal::SIGCONT);
    let StreamEvent { kind, body, .. } = stream.next(Duration::from_secs(5));
    assert_eq!(kind, "lost", "{body}");
    assert_eq!(body["fencingToken"], token);
}

/// A sidecar cut off from its backend stops telling renewals; the last one's `validForMs` runs
/// out before the backend lets another pod hold the key, and the stream then says `lost`.
#[test]
fn a_sidecar_cut_off_from_its_backend_says_lost_and_its_last_validity_ends_first() {
    cut_off_from_the_backend(&[], "owner=w1", "owner=w2");
}

/// As a key's hold, a write lock's (the write gate and every permit, followed together): the
/// stream says `lost` once its claim is gone, and a reader of another pod is let in only after
/// the writer's last validity ran out.
#[test]
fn a_write_lock_cut_off_from_its_backend_says_lost_and_its_last_validity_ends_first() {
    cut_off_from_the_backend(&READ_WRITE, "owner=w1&mode=write", "owner=r1&mode=read");
}

fn cut_off_from_the_backend(family_args: &[&str], hold: &str, take: &str) {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(redis.port());
    let family = unique_lock("orders");
    let plain = unique_lock("plain");
    let through_proxy = format!("redis://127.0.0.1:{}", proxy.port);
    let timing = [&LONG_TIMING[..], family_args].concat();
    let a = on_demand_with("pod-a", &through_proxy, &plain, &family, &timing);
    let b = on_demand_with("pod-b", &redis.url(), &plain, &family, &timing);
    let key = format!("/locks/{family}/keys/order-3");

    let stream = open(&a, &format!("{key}/hold?{hold}"));
    let acquired = stream.next(Duration::from_secs(5));
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    let token = acquired.body["fencingToken"].as_u64().unwrap();
    proxy.cut();
    let taking = {
        let (addr, path) = (b.addr, format!("{key}/acquire?{take}&wait=15s"));
        std::thread::spawn(move || {
            let reply = leasehold_e2e::http(addr, "POST", &path).expect("acquire");
            (reply, Instant::now())
        })
    };
    let mut last = acquired;
    let lost = loop {
        let event = stream.next(Duration::from_secs(15));
        if event.kind != "renewed" {
            break event;
        }
        last = event;
    };
    assert_eq!(lost.kind, "lost", "{lost:?}");
    assert_eq!(lost.body["fencingToken"], token);
    let last_valid_until =
        last.at + Duration::from_millis(last.body["validForMs"].as_u64().unwrap());
    let (taken, taken_at) = taking.join().unwrap();
    assert!(taken.token() > token, "{}", taken.body);
    // Counted from its reading, a validity ends up to the reading's lag late.
    assert!(
        last_valid_until <= taken_at + READ_LAG,
        "pod b held the key {:?} before pod a's last validity ran out",
        last_valid_until - taken_at
    );
}

/// A write lock held through a connection (`mode=write` on a read-write family): the stream
/// opens once the readers are gone, with a token above theirs; while it is open the write lock
/// is held past the lease and the connection's own hold, renewals told, and readers and
/// writers of every pod are refused; the moment it closes a waiting reader gets in.
#[test]
fn a_write_lock_held_by_a_connection_excludes_everyone_else_until_it_closes() {
    let redis = RedisServer::start();
    let family = unique_lock("docs");
    let plain = unique_lock("plain");
    let timing = [&TIMING[..], &READ_WRITE].concat();
    let a = on_demand_with("pod-a", &redis.url(), &plain, &family, &timing);
    let b = on_demand_with("pod-b", &redis.url(), &plain, &family, &timing);
    let key = format!("/locks/{family}/keys/report-1");

    let reader = b.post(&format!("{key}/acquire?owner=r1&mode=read&hold=30s"));
    assert_eq!(reader.status, 200, "{}", reader.body);
    let read_token = reader.token();
    let waiting = {
        let (addr, path) = (a.addr, format!("{key}/hold?owner=w1&mode=write&wait=10s"));
        std::thread::spawn(move || {
            let stream = EventStream::post(addr, &path).expect("a stream");
            (stream.next(Duration::from_secs(10)), stream)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !waiting.is_finished(),
        "the writer did not wait for the reader"
    );
    assert_eq!(b.post(&format!("{key}/release?owner=r1")).status, 200);
    let (acquired, stream) = waiting.join().unwrap();
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    assert_eq!(acquired.body["mode"], "write", "{acquired:?}");
    let token = acquired.body["fencingToken"]
        .as_u64()
        .expect("fencingToken");
    assert!(token > read_token, "{token} after {read_token}");

    let renewals = renewals_told(&stream, token, Duration::from_secs(13));
    assert!(
        renewals >= 8,
        "{renewals} renewals told in 13 s of a 1 s renew interval"
    );
    let status = a.get(&format!("{key}?owner=w1"));
    assert_eq!(status.status, 200, "{}", status.body);
    assert_eq!(status.json()["mode"], "write", "{}", status.body);
    // The writer's hold that is not to write would follow a read: refused, nothing taken.
    let not_to_write = a.post(&format!("{key}/hold?owner=w1"));
    assert_eq!(not_to_write.status, 400, "{}", not_to_write.body);
    assert!(
        not_to_write.body.contains("mode=write"),
        "{}",
        not_to_write.body
    );
    for (sidecar, query) in [
        (&b, "owner=r2&mode=read"),
        (&a, "owner=r3&mode=read"),
        (&b, "owner=w2&mode=write"),
    ] {
        let refused = sidecar.post(&format!("{key}/acquire?{query}"));
        assert_eq!(refused.status, 409, "{query}: {}", refused.body);
    }

    let path = format!("{key}/acquire?owner=r2&mode=read&wait=10s");
    let (reply, after) = taken_once_closed(stream, b.addr, path);
    // On Redis a family's keys draw their tokens from one counter: a later reader's is higher.
    assert!(reply.token() > token, "{}", reply.body);
    assert!(
        after < RELEASED_WITHIN,
        "the key was read {after:?} after the writer's connection closed"
    );
    assert_eq!(a.get(&format!("{key}?owner=w1")).status, 409);
}

#[test]
fn a_hold_request_that_cannot_be_served_gets_a_clear_answer_and_changes_nothing() {
    let redis = RedisServer::start();
    let lock = unique_lock("plain");
    let family = unique_lock("orders");
    let a = on_demand("pod-a", &redis, &lock, &family);
    let refused = |path: &str, status: u16, says: &str| {
        let reply = match EventStream::post(a.addr, path) {
            Ok(_) => panic!("POST {path} was served a stream"),
            Err(reply) => reply,
        };
        assert_eq!(reply.status, status, "POST {path}: {}", reply.body);
        assert!(reply.body.contains(says), "POST {path}: {}", reply.body);
    };
    refused(
        "/locks/no-such-family/keys/k/hold?owner=w1",
        404,
        "no-such-family",
    );
    refused(&format!("/locks/{family}/keys/k/hold"), 400, "owner");
    refused(
        &format!("/locks/{family}/keys/k/hold?owner=w1&hold=10s"),
        400,
        "unknown parameter",
    );
    refused(
        &format!("/locks/{family}/keys/k%00/hold?owner=w1"),
        400,
        "key",
    );
    refused("/lock/hold?wait=forever", 400, "not a duration");
    refused(
        &format!("/locks/{family}/hold?keys=a,a&owner=w1"),
        400,
        "keys",
    );
    refused(
        &format!("/locks/{family}/hold?keys=a,b&owner=w1&exclusive=yes"),
        400,
        "true or false",
    );
    refused("/lock/hold?exclusive=yes", 400, "true or false");
    refused(
        &format!("/locks/{family}/keys/k/hold?owner=w1&exclusive=1"),
        400,
        "true or false",
    );

    // A key held by another owner: the stream is refused as `acquire` refuses.
    let holding = open(&a, &format!("/locks/{family}/keys/k/hold?owner=w1"));
    assert_eq!(holding.next(Duration::from_secs(5)).kind, "acquired");
    refused(
        &format!("/locks/{family}/keys/k/hold?owner=w2&wait=100ms"),
        409,
        "pod-a/w1",
    );
    assert_eq!(
        a.get(&format!("/locks/{family}/keys/k?owner=w1")).status,
        200
    );

    let campaign = Sidecar::start("pod-c", &redis.url(), &unique_lock("campaign"), &TIMING);
    let reply = EventStream::post(campaign.addr, "/lock/hold")
        .err()
        .expect("refused");
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("campaign mode"), "{}", reply.body);
}

/// Exclusive holds of one owner take turns on a key, where plain holds of that owner share its
/// holding (re-entered): the second waits for the first connection to close, and then holds
/// under a newer token.
#[test]
fn exclusive_holds_of_one_owner_take_turns_on_a_key() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let a = on_demand("pod-a", &redis, &unique_lock("plain"), &family);
    let key = format!("/locks/{family}/keys/k");

    let first = open(&a, &format!("{key}/hold?owner=job&exclusive=true"));
    let first_token = first.next(Duration::from_secs(5)).body["fencingToken"]
        .as_u64()
        .expect("fencingToken");
    // Not its turn: refused as a key held by another, naming the holder.
    let reply = EventStream::post(
        a.addr,
        &format!("{key}/hold?owner=job&exclusive=true&wait=200ms"),
    )
    .err()
    .expect("refused while the first holds");
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert!(reply.body.contains("pod-a/job"), "{}", reply.body);
    // A plain hold of the owner re-enters the holding, as acquire does.
    let shared = open(&a, &format!("{key}/hold?owner=job"));
    let shared_event = shared.next(Duration::from_secs(5));
    assert_eq!(shared_event.kind, "acquired", "{shared_event:?}");
    assert_eq!(shared_event.body["fencingToken"], first_token);
    assert_eq!(shared_event.body["holds"], 2, "{shared_event:?}");
    shared.close();
    // Given back once its connection's release has run: the first hold's alone again.
    let holds = || a.get(&format!("{key}?owner=job")).json()["holds"].as_u64();
    let start = Instant::now();
    while holds() != Some(1) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the shared hold was not given back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let waiting = {
        let (addr, path) = (
            a.addr,
            format!("{key}/hold?owner=job&exclusive=true&wait=10s"),
        );
        std::thread::spawn(move || {
            let stream = EventStream::post(addr, &path).expect("a stream");
            (stream.next(Duration::from_secs(10)), Instant::now(), stream)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !waiting.is_finished(),
        "the second exclusive hold did not wait"
    );
    let closed = Instant::now();
    first.close();
    let (second, taken, _stream) = waiting.join().unwrap();
    assert_eq!(second.kind, "acquired", "{second:?}");
    assert!(
        second.body["fencingToken"].as_u64().unwrap() > first_token,
        "{second:?}"
    );
    assert!(
        taken - closed < RELEASED_WITHIN,
        "the second hold began {:?} after the first closed",
        taken - closed
    );
}

/// Several keys held by one connection (`POST /locks/FAMILY/hold?keys=...`): every key or
/// none; each key's token named in the events; while it is open another pod takes none of
/// them, and the moment it closes another pod's wait for all of them ends. A key of the set
/// released by another call ends the stream (`released`), and the others are given back once
/// the validity last told has run out.
#[test]
fn several_keys_held_by_a_connection_are_held_together_and_given_back_together() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let a = on_demand("pod-a", &redis, &unique_lock("plain"), &family);
    let b = on_demand("pod-b", &redis, &unique_lock("plain"), &family);
    let route = |query: &str| format!("/locks/{family}/{query}");

    let stream = open(&a, &route("hold?keys=sku-2,sku-1&owner=w1&wait=2s"));
    let acquired = stream.next(Duration::from_secs(5));
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    let body = &acquired.body;
    assert_eq!(body["owner"], "w1");
    assert!(body.get("fencingToken").is_none(), "{body}");
    let keys = body["keys"].as_array().expect("keys");
    let named: Vec<&str> = keys.iter().map(|k| k["key"].as_str().unwrap()).collect();
    assert_eq!(named, ["sku-2", "sku-1"], "{body}");
    let tokens: Vec<u64> = keys
        .iter()
        .map(|k| k["fencingToken"].as_u64().expect("fencingToken"))
        .collect();
    assert!(body["validForMs"].as_u64().unwrap() > 0, "{body}");
    for key in ["sku-1", "sku-2"] {
        let refused = b.post(&route(&format!("keys/{key}/acquire?owner=w2")));
        assert_eq!(refused.status, 409, "{key}: {}", refused.body);
    }
    let refused = b.post(&route("acquire?keys=sku-1,sku-3&owner=w2"));
    assert_eq!(refused.status, 409, "{}", refused.body);

    let reply = taken_together_once_closed(stream, &b, &family, "sku-1,sku-2", "owner=w2");
    let after: Vec<u64> = reply.json()["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .map(|k| k["fencingToken"].as_u64().unwrap())
        .collect();
    assert!(
        after.iter().all(|t| tokens.iter().all(|before| t > before)),
        "{after:?} after {tokens:?}"
    );

    // One key of the set released by another call: the stream ends, and the other key is
    // given back once the validity the app was last told has run out (the app may not have
    // read the end yet), not before.
    released_one_gives_back_the_other(
        (&a, &b),
        &family,
        "keys=sku-5,sku-6&owner=w3",
        ("sku-5", "sku-6"),
        "owner=w4",
    );
}

/// `stream`, a hold of `keys` (comma-separated), closed while `b` waits for them all (`take`: the
/// rest of its query, owner first): taken at once, then released; the answer that took them.
fn taken_together_once_closed(
    stream: EventStream,
    b: &Sidecar,
    family: &str,
    keys: &str,
    take: &str,
) -> Reply {
    let path = format!("/locks/{family}/acquire?keys={keys}&{take}&wait=10s&hold=30s");
    let (reply, taken_after) = taken_once_closed(stream, b.addr, path);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        taken_after < RELEASED_WITHIN,
        "{keys} were taken {taken_after:?} after the connection closed"
    );
    let owner = take.split('&').next().expect("an owner");
    let released = b.post(&format!("/locks/{family}/release?keys={keys}&{owner}"));
    assert_eq!(released.status, 200, "{}", released.body);
    reply
}

/// A hold of two keys (`hold`: its query, naming `first` and `second` and the owner) through
/// `a`, then `first` released by another call of the owner: the stream says `released`, and
/// neither `first` nor `second` is taken through `b` (`take`: an acquisition's query) before
/// the validity the app was last told has run out.
fn released_one_gives_back_the_other(
    (a, b): (&Sidecar, &Sidecar),
    family: &str,
    hold: &str,
    (first, second): (&str, &str),
    take: &str,
) {
    let stream = open(a, &format!("/locks/{family}/hold?{hold}&wait=2s"));
    let owner = hold
        .split('&')
        .find_map(|p| p.strip_prefix("owner="))
        .expect("an owner");
    let told_until = released_by_another_call(&stream, || {
        a.post(&format!(
            "/locks/{family}/keys/{first}/release?owner={owner}"
        ))
    });
    for key in [first, second] {
        let path = format!("/locks/{family}/keys/{key}/acquire?{take}&wait=10s");
        taken_no_earlier_than(told_until, || b.post(&path), key);
    }
}

/// `stream`'s holding ended by `release`, a call that is not the stream's: the stream says
/// `released` after any renewals; the end of the validity it told last.
fn released_by_another_call(stream: &EventStream, release: impl FnOnce() -> Reply) -> Instant {
    let mut last = stream.next(Duration::from_secs(5));
    assert_eq!(last.kind, "acquired", "{last:?}");
    let released = release();
    assert_eq!(released.status, 200, "{}", released.body);
    let ended = loop {
        let event = stream.next(Duration::from_secs(5));
        if event.kind != "renewed" {
            break event;
        }
        last = event;
    };
    assert_eq!(ended.kind, "released", "{ended:?}");
    last.at + Duration::from_millis(last.body["validForMs"].as_u64().unwrap())
}

/// `take` (an acquisition that waits) succeeds, not before `told_until`, the end of the
/// validity a stream's client was told of `what`.
fn taken_no_earlier_than(told_until: Instant, take: impl FnOnce() -> Reply, what: &str) {
    let taken = take();
    let taken_at = Instant::now();
    assert_eq!(taken.status, 200, "{}", taken.body);
    assert!(
        told_until <= taken_at + READ_LAG,
        "{what} was taken {:?} before the validity the app was told ran out",
        told_until - taken_at
    );
}

/// A lock held through a connection and released by another call of the pod (`POST
/// /lock/release`, a retried release say): the stream says `released`, and no other pod holds
/// the lock before the validity the connection's client was last told has run out.
#[test]
fn a_lock_released_by_another_call_is_not_taken_before_the_connections_last_validity() {
    let redis = RedisServer::start();
    let lock = unique_lock("bound");
    let family = unique_lock("unused");
    let a = on_demand("pod-a", &redis, &lock, &family);
    let b = on_demand("pod-b", &redis, &lock, &family);
    let stream = open(&a, "/lock/hold?wait=2s");
    let told_until = released_by_another_call(&stream, || a.post("/lock/release"));
    assert_eq!(a.get("/lock").status, 409, "released: not held any more");
    taken_no_earlier_than(told_until, || b.post("/lock/acquire?wait=10s"), &lock);
}

/// Several keys written through one connection (`hold?keys=...&mode=write` on a read-write
/// family): the stream opens once every key's readers are gone, each key's token above its
/// readers'; while it is open no pod reads or writes any of them; the moment it closes a
/// reader waiting for them all gets in. One key's write lock released by another call ends
/// the stream, and the other key is given back once the validity last told has run out.
#[test]
fn several_keys_written_through_a_connection_are_held_alone_and_given_back_together() {
    let redis = RedisServer::start();
    let family = unique_lock("docs");
    let plain = unique_lock("plain");
    let timing = [&TIMING[..], &READ_WRITE].concat();
    let a = on_demand_with("pod-a", &redis.url(), &plain, &family, &timing);
    let b = on_demand_with("pod-b", &redis.url(), &plain, &family, &timing);
    let route = |query: &str| format!("/locks/{family}/{query}");

    let reader = b.post(&route("keys/doc-2/acquire?owner=r1&mode=read&hold=30s"));
    assert_eq!(reader.status, 200, "{}", reader.body);
    let read_token = reader.token();
    let waiting = {
        let (addr, path) = (
            a.addr,
            route("hold?keys=doc-1,doc-2&owner=w1&mode=write&wait=10s"),
        );
        std::thread::spawn(move || {
            let stream = EventStream::post(addr, &path).expect("a stream");
            (stream.next(Duration::from_secs(10)), stream)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !waiting.is_finished(),
        "the writer did not wait for the reader"
    );
    assert_eq!(b.post(&route("keys/doc-2/release?owner=r1")).status, 200);
    let (acquired, stream) = waiting.join().unwrap();
    assert_eq!(acquired.kind, "acquired", "{acquired:?}");
    let body = &acquired.body;
    assert_eq!(body["mode"], "write", "{body}");
    assert!(body.get("fencingToken").is_none(), "{body}");
    let keys = body["keys"].as_array().expect("keys");
    let named: Vec<&str> = keys.iter().map(|k| k["key"].as_str().unwrap()).collect();
    assert_eq!(named, ["doc-1", "doc-2"], "{body}");
    let tokens: Vec<u64> = keys
        .iter()
        .map(|k| k["fencingToken"].as_u64().expect("fencingToken"))
        .collect();
    assert!(tokens[1] > read_token, "{tokens:?} after {read_token}");
    for key in ["doc-1", "doc-2"] {
        assert_eq!(a.get(&route(&format!("keys/{key}?owner=w1"))).status, 200);
        for (sidecar, query) in [(&b, "owner=r2&mode=read"), (&b, "owner=w2&mode=write")] {
            let refused = sidecar.post(&route(&format!("keys/{key}/acquire?{query}")));
            assert_eq!(refused.status, 409, "{key} {query}: {}", refused.body);
        }
    }
    taken_together_once_closed(stream, &b, &family, "doc-1,doc-2", "owner=r2&mode=read");

    released_one_gives_back_the_other(
        (&a, &b),
        &family,
        "keys=doc-5,doc-6&owner=w3&mode=write",
        ("doc-5", "doc-6"),
        "owner=r4&mode=read",
    );
}

/// An observer follows one key's holders in every pod: free, then each holder with its token.
#[test]
fn an_observer_follows_a_keys_holders_in_every_pod() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let a = on_demand("pod-a", &redis, &unique_lock("plain"), &family);
    let b = on_demand("pod-b", &redis, &unique_lock("plain"), &family);
    let key = format!("/locks/{family}/keys/order-5");
    let observer = EventStream::get(b.addr, &format!("{key}/events"))
        .unwrap_or_else(|reply| panic!("{} {}", reply.status, reply.body));
    let holder = |within: Duration| {
        let StreamEvent { kind, body, .. } = observer.next(within);
        assert_eq!(kind, "holder", "{body}");
        assert_eq!(body["key"], "order-5");
        (body["currentHolder"].clone(), body["fencingToken"].clone())
    };
    assert_eq!(holder(Duration::from_secs(5)).0, serde_json::Value::Null);

    // Within a renew interval (1 s) of each change, and a release as soon as it is signalled.
    let first = a.post(&format!("{key}/acquire?owner=w1&hold=30s")).token();
    assert_eq!(
        holder(Duration::from_secs(3)),
        ("pod-a/w1".into(), first.into())
    );
    assert_eq!(a.post(&format!("{key}/release?owner=w1")).status, 200);
    assert_eq!(holder(Duration::from_secs(3)).0, serde_json::Value::Null);
    let stream = open(&b, &format!("{key}/hold?owner=w2"));
    let second = stream.next(Duration::from_secs(5)).body["fencingToken"]
        .as_u64()
        .unwrap();
    assert!(second > first);
    assert_eq!(
        holder(Duration::from_secs(3)),
        ("pod-b/w2".into(), second.into())
    );
    stream.close();
    assert_eq!(holder(Duration::from_secs(3)).0, serde_json::Value::Null);

    for (path, status, says) in [
        (format!("{key}/events?owner=w1"), 400, "unknown parameter"),
        (
            format!("/locks/{family}/keys/a%20b/events"),
            400,
            "invalid key",
        ),
        (
            "/locks/no-such-family/keys/k/events".to_owned(),
            404,
            "no-such-family",
        ),
    ] {
        let reply = EventStream::get(b.addr, &path).err().expect("refused");
        assert_eq!(reply.status, status, "GET {path}: {}", reply.body);
        assert!(reply.body.contains(says), "GET {path}: {}", reply.body);
    }
}
