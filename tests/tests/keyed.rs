//! Keyed locks over HTTP, against real sidecar processes on a real Redis: two pods, several
//! owners per pod, one family (`--keyed orders`) beside a plain lock.

use std::time::{Duration, Instant};

use leasehold_e2e::{RedisServer, Reply, Sidecar, eventually, unique_lock};

fn token(reply: &Reply) -> u64 {
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json()["fencingToken"].as_u64().expect("fencingToken")
}

#[test]
fn owners_of_one_pod_and_of_two_contend_for_keys_over_http() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let keyed = ["--keyed", &family, "--mode", "on-demand"];
    let a = Sidecar::start("pod-a", &redis.url(), &unique_lock("plain"), &keyed);
    let b = Sidecar::start("pod-b", &redis.url(), &unique_lock("plain"), &keyed);
    let key = |k: &str| format!("/locks/{family}/keys/{k}");

    let taken = a.post(&format!("{}/acquire?owner=w1&hold=30s", key("order-1234")));
    let first = token(&taken);
    let body = taken.json();
    assert_eq!(body["family"], family.as_str());
    assert_eq!(body["key"], "order-1234");
    assert_eq!(body["owner"], "w1");
    assert_eq!(body["holds"], 1);
    assert!(body["validForMs"].as_u64().unwrap() > 0);

    // Another owner of the same pod, and an owner of another pod: refused, told who holds it.
    let same_pod = a.post(&format!("{}/acquire?owner=w2", key("order-1234")));
    assert_eq!(same_pod.status, 409, "{}", same_pod.body);
    assert_eq!(same_pod.json()["currentHolder"], "pod-a/w1");
    let other_pod = b.post(&format!(
        "{}/acquire?owner=w3&wait=200ms",
        key("order-1234")
    ));
    assert_eq!(other_pod.status, 409, "{}", other_pod.body);

    // Asking: the owner holds it; another owner does not; pod b's owners do not.
    assert_eq!(
        a.get(&format!("{}?owner=w1", key("order-1234"))).status,
        200
    );
    assert_eq!(
        a.get(&format!("{}?owner=w2", key("order-1234"))).status,
        409
    );
    assert_eq!(a.get(&key("order-1234")).status, 200, "any owner of pod a");
    assert_eq!(b.get(&key("order-1234")).status, 409);

    // Only the owner releases.
    assert_eq!(
        a.post(&format!("{}/release?owner=w2", key("order-1234")))
            .status,
        409
    );
    assert_eq!(
        b.post(&format!("{}/release?owner=w1", key("order-1234")))
            .status,
        404,
        "pod b holds nothing"
    );

    // Pod b's owner waits; the owner in pod a releases; pod b's owner gets a higher token.
    let waiting = {
        let path = format!("{}/acquire?owner=w3&wait=10s&hold=30s", key("order-1234"));
        let addr = b.addr;
        std::thread::spawn(move || leasehold_e2e::http(addr, "POST", &path).expect("acquire"))
    };
    std::thread::sleep(Duration::from_millis(300));
    let released = a.post(&format!("{}/release?owner=w1", key("order-1234")));
    assert_eq!(released.status, 200, "{}", released.body);
    let second = token(&waiting.join().unwrap());
    assert!(second > first, "token {second} after {first}");

    // Extend: the holder's owner only.
    assert_eq!(
        b.post(&format!("{}/extend?owner=w3&hold=1m", key("order-1234")))
            .status,
        200
    );
    assert_eq!(
        a.post(&format!("{}/extend?owner=w3&hold=1m", key("order-1234")))
            .status,
        404
    );

    // Keys are independent, and odd keys are fine (their backend name is a hash).
    token(&a.post(&format!("{}/acquire?owner=w1", key("SKU:998@warehouse"))));

    // Bad input: a 4xx with a JSON error, and nothing changes.
    for (path, status) in [
        (format!("{}/acquire?owner=w1", key("has%20space")), 400),
        (format!("{}/acquire?owner=w1", key(&"k".repeat(200))), 400),
        (format!("{}/acquire", key("order-1")), 400),
        (format!("{}/acquire?owner=w1&hold=0s", key("order-1")), 400),
        (format!("{}/acquire?owner=w1&bogus=1", key("order-1")), 400),
        ("/locks/nope/keys/order-1/acquire?owner=w1".to_owned(), 404),
    ] {
        let reply = a.post(&path);
        assert_eq!(reply.status, status, "{path}: {}", reply.body);
        assert!(
            reply.json()["error"]
                .as_str()
                .is_some_and(|e| !e.is_empty()),
            "{path}: {}",
            reply.body
        );
    }
    assert_eq!(
        b.get(&format!("{}?owner=w3", key("order-1234"))).status,
        200
    );
    assert_eq!(a.get(&key("order-1")).status, 409);

    // A worker that forgets to release loses the key when its hold lapses.
    token(&a.post(&format!("{}/acquire?owner=w9&hold=500ms", key("order-7"))));
    eventually(Duration::from_secs(5), "the hold lapses", || {
        a.get(&format!("{}?owner=w9", key("order-7"))).status == 409
    });
    token(&b.post(&format!("{}/acquire?owner=w4&wait=5s", key("order-7"))));
}

#[test]
fn a_sidecar_holds_no_more_keys_than_its_limit() {
    let redis = RedisServer::start();
    let family = unique_lock("jobs");
    let s = Sidecar::start(
        "pod-a",
        &redis.url(),
        &unique_lock("plain"),
        &["--keyed", &family, "--max-keys", "2"],
    );
    for k in ["a", "b"] {
        token(&s.post(&format!("/locks/{family}/keys/{k}/acquire?owner=w")));
    }
    let third = s.post(&format!("/locks/{family}/keys/c/acquire?owner=w"));
    assert_eq!(third.status, 429, "{}", third.body);
    assert_eq!(
        s.post(&format!("/locks/{family}/keys/a/release?owner=w"))
            .status,
        200
    );
    token(&s.post(&format!("/locks/{family}/keys/c/acquire?owner=w")));
}

/// A key is chosen at run time and without bound, so it must never become a metric label: each
/// key ever taken would stay a series, in the sidecar's memory and in Prometheus, for the life
/// of the pod. The family's series count keys, owners waiting and contention instead.
#[test]
fn metrics_count_keys_by_family_and_never_label_a_key() {
    let redis = RedisServer::start();
    let family = unique_lock("stock");
    let s = Sidecar::start(
        "pod-a",
        &redis.url(),
        &unique_lock("plain"),
        &["--keyed", &family],
    );
    let key = |k: &str| format!("/locks/{family}/keys/{k}");
    const TAKEN: usize = 40;
    for i in 0..TAKEN {
        token(&s.post(&format!("{}/acquire?owner=w{i}", key(&format!("sku-{i}")))));
        let released = s.post(&format!("{}/release?owner=w{i}", key(&format!("sku-{i}"))));
        assert_eq!(released.status, 200, "{}", released.body);
    }
    // Three keys held, one owner refused, one waiting.
    for k in ["Held:1", "held-2", "held-3"] {
        token(&s.post(&format!("{}/acquire?owner=keeper", key(k))));
    }
    assert_eq!(
        s.post(&format!("{}/acquire?owner=other", key("held-2")))
            .status,
        409
    );
    let waiter = {
        let path = format!("{}/acquire?owner=patient&wait=20s", key("held-3"));
        let addr = s.addr;
        std::thread::spawn(move || leasehold_e2e::http(addr, "POST", &path).expect("acquire"))
    };
    let line = |body: &str, series: &str| {
        let prefix = format!("{series}{{family=\"{family}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {prefix}in:\n{body}"))
    };
    eventually(Duration::from_secs(10), "the waiter is counted", || {
        line(&s.get("/metrics").body, "leasehold_keyed_waiting_owners") == "1"
    });
    let body = s.get("/metrics").body;
    assert_eq!(line(&body, "leasehold_keyed_held_keys"), "3");
    assert_eq!(
        line(&body, "leasehold_keyed_acquisitions_total"),
        (TAKEN + 3).to_string()
    );
    assert_eq!(
        line(&body, "leasehold_keyed_releases_total"),
        TAKEN.to_string()
    );
    assert_eq!(line(&body, "leasehold_keyed_contended_total"), "1");
    assert_eq!(line(&body, "leasehold_keyed_max_keys"), "1024");
    assert!(
        body.contains(&format!(
            "leasehold_keyed_family_info{{family=\"{family}\",backend=\"redis\"}} 1"
        )),
        "{body}"
    );
    for leaked in [".keys.", ".keyh.", "sku-", "held-"] {
        assert!(
            !body.contains(leaked),
            "a key became a metric label ({leaked}):\n{body}"
        );
    }

    let released = s.post(&format!("{}/release?owner=keeper", key("held-3")));
    assert_eq!(released.status, 200, "{}", released.body);
    token(&waiter.join().unwrap());
    let body = s.get("/metrics").body;
    assert_eq!(line(&body, "leasehold_keyed_waiting_owners"), "0");
}

/// A family with `--permits 2` over HTTP: two owners (of two pods) hold a key at once, each told
/// its permit; a third is refused, then takes the permit given up with a token above its last;
/// `GET` counts the permits held in every pod.
#[test]
fn a_semaphore_family_admits_as_many_owners_as_it_has_permits() {
    let redis = RedisServer::start();
    let family = unique_lock("exports");
    let keyed = ["--keyed", &family, "--mode", "on-demand", "--permits", "2"];
    let a = Sidecar::start("pod-a", &redis.url(), &unique_lock("plain"), &keyed);
    let b = Sidecar::start("pod-b", &redis.url(), &unique_lock("plain"), &keyed);
    let key = format!("/locks/{family}/keys/tenant-7");

    let first = a.post(&format!("{key}/acquire?owner=job-1&hold=30s"));
    let second = b.post(&format!("{key}/acquire?owner=job-2&hold=30s"));
    let first_token = token(&first);
    token(&second);
    let (first, second) = (first.json(), second.json());
    assert_eq!(first["permits"], 2);
    let mut permits = [
        first["permit"].as_u64().unwrap(),
        second["permit"].as_u64().unwrap(),
    ];
    permits.sort_unstable();
    assert_eq!(permits, [0, 1], "{first} {second}");

    let third = a.post(&format!("{key}/acquire?owner=job-3&wait=200ms"));
    assert_eq!(third.status, 409, "{}", third.body);
    let counted = b.get(&format!("{key}?owner=job-2"));
    assert_eq!(counted.status, 200, "{}", counted.body);
    assert_eq!(counted.json()["permitsHeld"], 2, "{}", counted.body);

    let released = a.post(&format!("{key}/release?owner=job-1"));
    assert_eq!(released.status, 200, "{}", released.body);
    let third = a.post(&format!("{key}/acquire?owner=job-3&wait=5s&hold=30s"));
    let third_token = token(&third);
    assert_eq!(third.json()["permit"], first["permit"], "{}", third.body);
    assert!(
        third_token > first_token,
        "token {third_token} after {first_token}"
    );
}

/// Read-write locks over HTTP (`mode=read|write` on a `--read-write` family of 2 permits): two
/// readers of two pods share a key; a writer is refused beside them, then holds the key alone
/// (`"mode": "write"`, a token above the readers'); a reader cannot upgrade; a bad mode or a
/// mode on a family that is not read-write is a 400 that takes nothing.
#[test]
fn readers_share_a_key_and_a_writer_holds_it_alone_over_http() {
    let redis = RedisServer::start();
    let family = unique_lock("docs");
    let keyed = [
        "--keyed",
        &family,
        "--mode",
        "on-demand",
        "--permits",
        "2",
        "--read-write",
    ];
    let a = Sidecar::start("pod-a", &redis.url(), &unique_lock("plain"), &keyed);
    let b = Sidecar::start("pod-b", &redis.url(), &unique_lock("plain"), &keyed);
    let key = format!("/locks/{family}/keys/report-9");

    let r1 = a.post(&format!("{key}/acquire?owner=r1&mode=read&hold=30s"));
    let r2 = b.post(&format!("{key}/acquire?owner=r2&mode=read&hold=30s"));
    let readers = [token(&r1), token(&r2)];
    assert!(r1.json().get("mode").is_none(), "{}", r1.body);

    for bad in ["mode=upgrade", "mode=", "mode=READ", "mode=read&mode=write"] {
        let answer = b.post(&format!("{key}/acquire?owner=w9&{bad}"));
        assert_eq!(answer.status, 400, "{bad}: {}", answer.body);
    }
    let upgrade = a.post(&format!("{key}/acquire?owner=r1&mode=write"));
    assert_eq!(upgrade.status, 400, "{}", upgrade.body);
    assert!(
        upgrade.body.contains("cannot also write"),
        "{}",
        upgrade.body
    );
    let held = a.get(&format!("{key}?owner=r1"));
    assert_eq!(held.status, 200, "the reader kept its read: {}", held.body);
    // Through a connection, a write lock is refused as an acquisition is.
    let through_a_connection = b.post(&format!("{key}/hold?owner=w1&mode=write"));
    assert_eq!(
        through_a_connection.status, 409,
        "{}",
        through_a_connection.body
    );

    let refused = b.post(&format!("{key}/acquire?owner=w1&mode=write&wait=200ms"));
    assert_eq!(refused.status, 409, "{}", refused.body);
    for (sidecar, owner) in [(&a, "r1"), (&b, "r2")] {
        let released = sidecar.post(&format!("{key}/release?owner={owner}"));
        assert_eq!(released.status, 200, "{}", released.body);
    }
    let writer = b.post(&format!(
        "{key}/acquire?owner=w1&mode=write&wait=5s&hold=30s"
    ));
    let written = token(&writer);
    assert_eq!(writer.json()["mode"], "write", "{}", writer.body);
    assert!(
        readers.iter().all(|r| written > *r),
        "{written} after {readers:?}"
    );
    let status = b.get(&format!("{key}?owner=w1"));
    assert_eq!(status.json()["mode"], "write", "{}", status.body);
    let reader = a.post(&format!("{key}/acquire?owner=r3&mode=read&wait=200ms"));
    assert_eq!(reader.status, 409, "{}", reader.body);
    assert_eq!(
        reader.json()["currentHolder"],
        "pod-b/w1",
        "{}",
        reader.body
    );

    let released = b.post(&format!("{key}/release?owner=w1"));
    assert_eq!(released.status, 200, "{}", released.body);
    let reader = a.post(&format!(
        "{key}/acquire?owner=r3&mode=read&wait=5s&hold=30s"
    ));
    token(&reader);

    // Several keys written at once: refused on the key r3 reads, with nothing kept; then,
    // once r3 is gone, every key's write lock.
    let several = format!("/locks/{family}/acquire?keys=report-10,report-9");
    let refused = b.post(&format!("{several}&owner=w2&mode=write&wait=200ms"));
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert_eq!(
        refused.json()["blockedBy"]["key"],
        "report-9",
        "{}",
        refused.body
    );
    let free = a.post(&format!("/locks/{family}/keys/report-10/acquire?owner=r4"));
    token(&free);
    for owner in ["r3", "r4"] {
        let released = a.post(&format!("{several}&owner={owner}").replace("acquire", "release"));
        assert!(
            released.body.contains("\"released\":true"),
            "{}",
            released.body
        );
    }
    let written = b.post(&format!("{several}&owner=w2&mode=write&wait=5s&hold=30s"));
    assert_eq!(written.status, 200, "{}", written.body);
    for key in written.json()["keys"].as_array().expect("keys") {
        assert_eq!(key["mode"], "write", "{}", written.body);
    }
    let reader = a.post(&format!(
        "/locks/{family}/keys/report-10/acquire?owner=r5&wait=200ms"
    ));
    assert_eq!(reader.status, 409, "{}", reader.body);
    // Written again among several: each write lock counts one acquisition more, and one
    // release of the keys leaves the first.
    let again = b.post(&format!("{several}&owner=w2&mode=write&hold=30s"));
    assert_eq!(again.status, 200, "{}", again.body);
    for key in again.json()["keys"].as_array().expect("keys") {
        assert_eq!(key["holds"], 2, "{}", again.body);
    }
    let released = b.post(&format!("{several}&owner=w2").replace("acquire", "release"));
    assert_eq!(released.status, 200, "{}", released.body);
    for key in released.json()["keys"].as_array().expect("keys") {
        assert_eq!(key["holds"], 1, "{}", released.body);
    }
    let reader = a.post(&format!(
        "/locks/{family}/keys/report-10/acquire?owner=r5&wait=200ms"
    ));
    assert_eq!(reader.status, 409, "{}", reader.body);
    let released = b.post(&format!("{several}&owner=w2").replace("acquire", "release"));
    assert_eq!(released.status, 200, "{}", released.body);
    let read = a.post(&format!("{several}&owner=r5&mode=read&wait=5s"));
    assert_eq!(read.status, 200, "{}", read.body);

    let other = unique_lock("plain-family");
    let c = Sidecar::start(
        "pod-c",
        &redis.url(),
        &unique_lock("plain"),
        &["--keyed", &other, "--mode", "on-demand"],
    );
    for mode in ["read", "write"] {
        let answer = c.post(&format!(
            "/locks/{other}/keys/report-9/acquire?owner=x&mode={mode}"
        ));
        assert_eq!(answer.status, 400, "{}", answer.body);
        assert!(
            answer.body.contains("not declared read-write"),
            "{}",
            answer.body
        );
    }
    let several = c.post(&format!(
        "/locks/{other}/acquire?keys=report-9,report-10&owner=x&mode=write"
    ));
    assert_eq!(several.status, 400, "{}", several.body);
    assert!(
        several.body.contains("not declared read-write"),
        "{}",
        several.body
    );
    let free = c.post(&format!("/locks/{other}/keys/report-9/acquire?owner=y"));
    token(&free);
}

/// Several keys at once over HTTP: `POST /locks/FAMILY/acquire?keys=...` answers every key's
/// token or, refused, the key that blocked it with nothing taken; `extend` and `release` take
/// the same list; bad lists are 400s that change nothing.
#[test]
fn several_keys_are_taken_and_given_back_together_over_http() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let keyed = ["--keyed", &family, "--mode", "on-demand"];
    let a = Sidecar::start("pod-a", &redis.url(), &unique_lock("plain"), &keyed);
    let b = Sidecar::start("pod-b", &redis.url(), &unique_lock("plain"), &keyed);
    let route = |verb: &str, query: &str| format!("/locks/{family}/{verb}?{query}");

    let taken = a.post(&route("acquire", "keys=sku-2,sku-1&owner=w1&hold=30s"));
    assert_eq!(taken.status, 200, "{}", taken.body);
    let body = taken.json();
    assert_eq!(body["holder"], true);
    assert_eq!(body["owner"], "w1");
    let keys = body["keys"].as_array().unwrap();
    let named: Vec<&str> = keys.iter().map(|k| k["key"].as_str().unwrap()).collect();
    assert_eq!(named, ["sku-2", "sku-1"]);
    assert!(keys.iter().all(|k| k["fencingToken"].as_u64().is_some()));
    let least = keys.iter().map(|k| k["validForMs"].as_u64().unwrap()).min();
    assert_eq!(body["validForMs"].as_u64(), least);

    // Pod b: refused on sku-1, told by whom; sku-3 is not left held.
    let refused = b.post(&route("acquire", "keys=sku-3,sku-1&owner=w2&wait=200ms"));
    assert_eq!(refused.status, 409, "{}", refused.body);
    let body = refused.json();
    assert_eq!(body["holder"], false);
    assert_eq!(body["blockedBy"]["key"], "sku-1");
    assert_eq!(body["blockedBy"]["currentHolder"], "pod-a/w1");
    let free = b.post(&format!("/locks/{family}/keys/sku-3/acquire?owner=w3"));
    assert_eq!(free.status, 200, "sku-3 was kept: {}", free.body);

    let extended = a.post(&route("extend", "keys=sku-1,sku-2&owner=w1&hold=1m"));
    assert_eq!(extended.status, 200, "{}", extended.body);
    assert!(extended.json()["validForMs"].as_u64().unwrap() > 0);
    // sku-3 is pod b's: pod a's owner holds it not (404, as for one key), the answer says so.
    let not_all = a.post(&route("extend", "keys=sku-1,sku-3&owner=w1&hold=1m"));
    assert_eq!(not_all.status, 404, "{}", not_all.body);
    assert_eq!(not_all.json()["holder"], false);
    assert_eq!(not_all.json()["keys"][0]["holder"], true);

    for bad in [
        "keys=sku-1,sku-1&owner=w1",
        "keys=&owner=w1",
        "keys=sku%201&owner=w1",
        "owner=w1",
        "keys=sku-1",
        "keys=sku-9&owner=w1&color=red",
        "keys=sku-9&keys=sku-8&owner=w1",
        "keys=sku-9&%6Beys=sku-8&owner=w1",
    ] {
        let answer = a.post(&route("acquire", bad));
        assert_eq!(answer.status, 400, "{bad}: {}", answer.body);
    }
    // One key's routes refuse a parameter named twice too: which owner to act for would be a
    // guess.
    let twice = a.post(&format!(
        "/locks/{family}/keys/sku-5/acquire?owner=w1&owner=w2"
    ));
    assert_eq!(twice.status, 400, "{}", twice.body);
    assert!(
        twice.body.contains("owner is given twice"),
        "{}",
        twice.body
    );
    let taken = b.post(&format!("/locks/{family}/keys/sku-5/acquire?owner=w3"));
    assert_eq!(
        taken.status, 200,
        "a refused request took sku-5: {}",
        taken.body
    );

    let released = a.post(&route("release", "keys=sku-1,sku-2&owner=w1"));
    assert_eq!(released.status, 200, "{}", released.body);
    assert!(
        released.json()["keys"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["released"] == true && k["holder"] == false)
    );
    let again = a.post(&route("release", "keys=sku-1&owner=w1"));
    assert_eq!(again.status, 409, "{}", again.body);
    let now_free = b.post(&route("acquire", "keys=sku-1,sku-2&owner=w2"));
    assert_eq!(now_free.status, 200, "{}", now_free.body);
}

/// A person ends a holding through the holder's own sidecar (`force-release?token=T`), as the
/// force-release annotation does for a sidecar that follows its lock: a token that is not the
/// current holding changes nothing; the right one makes the holder answer 409 at once, and the
/// next holder, in another pod, has a higher token. The same for a key, whoever its owner.
#[test]
fn a_person_force_releases_a_holding_through_the_holders_sidecar() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let lock = unique_lock("nightly");
    // The holder releases once its last answer, at most a lease, has run out.
    let args = [
        "--keyed",
        &family,
        "--mode",
        "on-demand",
        "--lease-duration",
        "3s",
        "--renew-interval",
        "1s",
    ];
    let a = Sidecar::start("pod-a", &redis.url(), &lock, &args);
    let b = Sidecar::start("pod-b", &redis.url(), &lock, &args);
    let route = format!("/locks/{lock}");

    let sent = Instant::now();
    let taken = a.post(&format!("{route}/acquire?hold=30s"));
    let held = token(&taken);
    // What pod a told its app: nobody else may hold the lock before this has run out.
    let told_until = sent + Duration::from_millis(taken.json()["validForMs"].as_u64().unwrap());
    for (sidecar, asked) in [(&a, held + 1), (&b, held)] {
        let refused = sidecar.post(&format!("{route}/force-release?token={asked}"));
        assert_eq!(refused.status, 409, "{}", refused.body);
        assert_eq!(refused.json()["released"], false, "{}", refused.body);
    }
    assert_eq!(a.get(&route).status, 200, "a wrong token changed nothing");
    let released = a.post(&format!("{route}/force-release?token={held}"));
    assert_eq!(released.status, 200, "{}", released.body);
    assert_eq!(released.json()["released"], true, "{}", released.body);
    assert_eq!(a.get(&route).status, 409, "the holder stops at once");
    let next = token(&b.post(&format!("{route}/acquire?wait=10s&hold=30s")));
    assert!(
        Instant::now() >= told_until,
        "pod b held the lock before pod a's answer ran out"
    );
    assert!(next > held, "{next} after {held}");

    let key = format!("/locks/{family}/keys/order-7");
    let held = token(&a.post(&format!("{key}/acquire?owner=w1&hold=30s")));
    let refused = a.post(&format!("{key}/force-release?token={}", held + 1));
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert!(refused.json()["reason"].is_string(), "{}", refused.body);
    assert_eq!(a.get(&format!("{key}?owner=w1")).status, 200);
    let released = a.post(&format!("{key}/force-release?token={held}"));
    assert_eq!(released.status, 200, "{}", released.body);
    assert_eq!(a.get(&format!("{key}?owner=w1")).status, 409);
    let next = token(&b.post(&format!("{key}/acquire?owner=w2&wait=10s&hold=30s")));
    assert!(next > held, "{next} after {held}");

    for (path, status, says) in [
        (format!("{route}/force-release"), 400, "token is required"),
        (
            format!("{route}/force-release?token=abc"),
            400,
            "not a fencing token",
        ),
        (
            format!("{route}/force-release?token=1&owner=w1"),
            400,
            "unknown parameter",
        ),
        (
            format!("/locks/{family}/force-release?token=1"),
            400,
            "is a family",
        ),
        (
            "/locks/no-such-lock/force-release?token=1".to_owned(),
            404,
            "no-such-lock",
        ),
        (
            format!("{key}/force-release?token=1&permit=x"),
            400,
            "not a permit",
        ),
        (
            format!("{key}/force-release?token=1&permit=0"),
            400,
            "has no permits",
        ),
        (format!("{key}/force-release"), 400, "token is required"),
    ] {
        let answer = a.post(&path);
        assert_eq!(answer.status, status, "{path}: {}", answer.body);
        assert!(answer.body.contains(says), "{path}: {}", answer.body);
    }
    assert_eq!(
        b.get(&format!("{key}?owner=w2")).status,
        200,
        "bad input changed nothing"
    );
}

/// A sidecar told to stop (SIGTERM, without `--apps-stop-first`: the app may still run) while an
/// owner holds a key keeps the key from every other owner until the hold it answered has run
/// out, then releases it, long before the lease would have: a Dapr client, which cannot learn
/// of a loss, holds until its expiry whatever happens to the sidecar.
#[test]
fn a_stopping_sidecar_keeps_a_key_until_the_answered_hold_ran_out() {
    let redis = RedisServer::start();
    let family = unique_lock("orders");
    let keyed = ["--keyed", &family, "--mode", "on-demand"];
    let mut a = Sidecar::start("pod-a", &redis.url(), &unique_lock("plain"), &keyed);
    let b = Sidecar::start("pod-b", &redis.url(), &unique_lock("plain"), &keyed);
    let key = format!("/locks/{family}/keys/order-1");

    let asked = Instant::now();
    let taken = a.post(&format!("{key}/acquire?owner=w1&hold=2s"));
    let first = token(&taken);
    let valid_for = Duration::from_millis(taken.json()["validForMs"].as_u64().unwrap());
    assert!(valid_for <= Duration::from_secs(2), "{}", taken.body);
    a.signal(nix::sys::signal::Signal::SIGTERM);
    let taken_by_b = loop {
        let tried = b.post(&format!("{key}/acquire?owner=w2"));
        if tried.status == 200 {
            break tried;
        }
        assert_eq!(tried.status, 409, "{}", tried.body);
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "pod-b never took the key"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = asked.elapsed();
    assert!(
        took >= valid_for,
        "pod-b took the key {took:?} after pod-a answered it held for {valid_for:?}"
    );
    // Released, not expired: the family's lease is 15 s.
    assert!(
        took < Duration::from_secs(8),
        "pod-b took the key after {took:?}"
    );
    assert!(token(&taken_by_b) > first);
    let status = a
        .wait_exit(Duration::from_secs(5))
        .expect("pod-a did not exit once its key was released");
    assert!(status.success(), "exit status {status}");
}
