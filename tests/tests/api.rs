//! The sidecar's HTTP contract and command line, against a real process.

use std::process::Command;
use std::time::{Duration, Instant};

use leasehold_e2e::{Sidecar, eventually, http, raw_http, sidecar_binary, unique_lock};

fn sqlite_backend(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}/locks.db", dir.path().display())
}

#[test]
fn bad_flags_exit_2_with_one_line_naming_the_value() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--lock", "jobs", "--lease-duration", "forever"],
            "forever",
        ),
        (
            &["--lock", "jobs", "--backend", "mongodb://db"],
            "mongodb://db",
        ),
        (
            &["--lock", "jobs", "--backend", "redis://:hunter2@h:x"],
            "redis://:***@h:x",
        ),
        (
            &["--lock", "jobs", "--listen", "0.0.0.0:4040"],
            "0.0.0.0:4040",
        ),
        (&["--lock", "jobs", "--renew-interval", "30s"], "30s"),
        (&["--lock", "no/slashes"], "no/slashes"),
        (&["--lock", "jobs", "--mode", "sometimes"], "sometimes"),
        (&["--lock", "jobs", "--bogus"], "--bogus"),
        (
            &[
                "--lock",
                "jobs",
                "--backend",
                "postgres://app:hunter2@db/app?mode=rowlock",
            ],
            "lease or row-lock",
        ),
        (
            &["--lock", "jobs", "--backend", "mysql://db/app?table=x;drop"],
            "table",
        ),
        (&["--keyed", "no/slashes"], "no/slashes"),
        (&["--keyed", "orders,orders"], "orders"),
        (
            &["--lock", "orders.keys.x", "--keyed", "orders"],
            "orders.keys.x",
        ),
        (&["--keyed", "orders", "--max-keys", "0"], "max-keys"),
        (
            &["--lock", "jobs", "--dapr-http-listen", "127.0.0.1:3500"],
            "--keyed",
        ),
        (
            &["--keyed", "orders", "--dapr-grpc-listen", "0.0.0.0:50001"],
            "0.0.0.0:50001",
        ),
    ];
    for (args, needle) in cases {
        let out = Command::new(sidecar_binary()).args(*args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("hunter2"),
            "{args:?} leaked a password: {stderr}"
        );
    }
    let env = Command::new(sidecar_binary())
        .env("LEASEHOLD_LOCK", "jobs")
        .env("LEASEHOLD_LEASE_DURATION", "nope")
        .output()
        .unwrap();
    assert_eq!(env.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&env.stderr).contains("nope"));
}

#[test]
fn malformed_http_gets_4xx_and_the_sidecar_keeps_answering() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start("a", &sqlite_backend(&dir), &unique_lock("http"), &[]);
    eventually(Duration::from_secs(5), "holder", || s.is_holder());
    let garbage: &[&[u8]] = &[
        b"GARBAGE\r\n\r\n",
        b"GET /lock HTTP/9.9\r\n\r\n",
        b"GET /lock HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /lock HTTP/1.1\r\nBad Header\r\n\r\n",
        b"\x00\xff\xfe binary\r\n\r\n",
    ];
    for request in garbage {
        let reply = raw_http(s.addr, request).expect("an answer, not a dropped connection");
        assert!(
            (400..500).contains(&reply.status),
            "{request:?} -> {reply:?}"
        );
    }
    let cases = [
        ("GET", "/lock?wait=soon", 400),
        ("GET", "/lock?wait=10m", 400),
        ("GET", "/lock?wiat=1s", 400),
        ("GET", "/lock?wait=%zz", 400),
        ("GET", "/locks/nosuch", 404),
        ("GET", "/nowhere", 404),
        ("DELETE", "/lock", 405),
        ("PUT", "/locks/x/keys/y/acquire", 405),
        ("POST", "/lock/acquire", 400), // campaign mode
        ("GET", "/locks/%ff", 400),
        ("GET", "/locks/x/keys/%c3%28", 400),
        ("GET", "/lock/events?since=1", 400),
        // Last: were the parameter ignored, the sidecar would step down for good.
        ("POST", "/resign?after=1s", 400),
    ];
    for (method, path, status) in cases {
        let reply = http(s.addr, method, path).unwrap();
        assert_eq!(reply.status, status, "{method} {path}: {}", reply.body);
        // Every refusal is JSON with a message, whichever layer refused.
        let body: serde_json::Value = serde_json::from_str(&reply.body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {:?}", reply.body));
        assert!(body["error"].is_string(), "{method} {path}: {body}");
    }
    let long = format!("/lock?{}", "x".repeat(100_000));
    let reply = http(s.addr, "GET", &long).unwrap();
    assert!((400..500).contains(&reply.status), "{}", reply.status);
    assert_eq!(s.get("/lock").status, 200, "the sidecar stopped answering");
}

#[test]
fn lock_answer_body() {
    let dir = tempfile::tempdir().unwrap();
    let lock = unique_lock("body");
    let a = Sidecar::start("pod-a", &sqlite_backend(&dir), &lock, &[]);
    eventually(Duration::from_secs(5), "holder", || a.is_holder());
    let b = Sidecar::start("pod-b", &sqlite_backend(&dir), &lock, &[]);
    let held = a.get("/lock").json();
    assert_eq!(held["lock"], lock.as_str());
    assert_eq!(held["holder"], true);
    assert_eq!(held["identity"], "pod-a");
    assert_eq!(held["currentHolder"], "pod-a");
    assert_eq!(held["backend"], "sqlite");
    assert!(held["fencingToken"].as_u64().unwrap() >= 1);
    let valid = held["validForMs"].as_u64().unwrap();
    assert!(valid > 0 && valid <= 15_000, "{valid}");
    assert!(held["since"].as_str().unwrap().ends_with('Z'));

    eventually(Duration::from_secs(5), "b sees a", || {
        b.get("/lock").json()["currentHolder"] == "pod-a"
    });
    let other = b.get("/lock");
    assert_eq!(other.status, 409);
    let other = other.json();
    assert_eq!(other["holder"], false);
    assert!(other.get("fencingToken").is_none());
    assert_eq!(other["validForMs"], 0);

    assert_eq!(a.get("/healthz").status, 200);
    assert_eq!(a.get("/readyz").status, 200);
    let metrics = a.get("/metrics");
    assert_eq!(metrics.status, 200);
    for family in [
        "leasehold_holder{",
        "leasehold_acquisitions_total{",
        "leasehold_renew_duration_seconds_bucket{",
        "leasehold_fencing_token{",
    ] {
        assert!(
            metrics.body.contains(family),
            "{family} missing:\n{}",
            metrics.body
        );
    }
    assert!(
        metrics
            .body
            .contains(&format!("leasehold_holder{{lock=\"{lock}\"}} 1"))
    );
    assert!(
        metrics
            .body
            .contains(&format!("leasehold_lock_permits{{lock=\"{lock}\"}} 1")),
        "a lock without permits admits one holder:\n{}",
        metrics.body
    );
}

#[test]
fn long_poll_answers_when_the_pod_becomes_holder() {
    let dir = tempfile::tempdir().unwrap();
    let lock = unique_lock("wait");
    let a = Sidecar::start(
        "a",
        &sqlite_backend(&dir),
        &lock,
        &["--lease-duration", "2s"],
    );
    eventually(Duration::from_secs(5), "a holds", || a.is_holder());
    let b = Sidecar::start(
        "b",
        &sqlite_backend(&dir),
        &lock,
        &["--lease-duration", "2s"],
    );
    // Not holder: the long poll runs to its timeout and answers 409.
    let start = Instant::now();
    let r = b.get("/lock?wait=300ms");
    assert_eq!(r.status, 409);
    assert!(start.elapsed() >= Duration::from_millis(290));

    let addr = b.addr;
    let poll = std::thread::spawn(move || {
        let start = Instant::now();
        (
            http(addr, "GET", "/lock?wait=20s").unwrap(),
            start.elapsed(),
        )
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(a.post("/lock/release").status, 200);
    let (reply, took) = poll.join().unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn on_demand_acquire_is_reentrant_and_bounded_by_hold() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = (unique_lock("x"), unique_lock("y"));
    let s = Sidecar::start(
        "a",
        &sqlite_backend(&dir),
        &format!("{x},{y}"),
        &["--mode", "on-demand", "--lease-duration", "2s"],
    );
    let other = Sidecar::start("b", &sqlite_backend(&dir), &x, &["--mode", "on-demand"]);
    eventually(Duration::from_secs(5), "ready", || {
        s.get("/readyz").status == 200
    });
    // Nobody asked: not holder.
    assert_eq!(s.get(&format!("/locks/{x}")).status, 409);

    let first = s.post(&format!("/locks/{x}/acquire?wait=2s&hold=30s"));
    assert_eq!(first.status, 200, "{}", first.body);
    let token = first.token();
    assert_eq!(
        s.post(&format!("/locks/{x}/acquire?hold=30s")).token(),
        token,
        "re-entrant"
    );
    assert_eq!(
        s.get(&format!("/locks/{y}")).status,
        409,
        "locks are independent"
    );
    assert_eq!(
        other.post("/lock/acquire?wait=200ms").status,
        409,
        "b got a held lock"
    );

    // Two acquisitions, two releases.
    assert_eq!(s.post(&format!("/locks/{x}/release")).status, 200);
    assert_eq!(
        s.get(&format!("/locks/{x}")).status,
        200,
        "released after one of two"
    );
    assert_eq!(s.post(&format!("/locks/{x}/release")).status, 200);
    assert_eq!(s.get(&format!("/locks/{x}")).status, 409);
    assert_eq!(
        s.post(&format!("/locks/{x}/release")).status,
        409,
        "nothing to release"
    );

    // b gets it now, with a greater token; and an app that forgets to release loses it.
    let b = other.post("/lock/acquire?wait=5s&hold=700ms");
    assert!(b.token() > token);
    eventually(Duration::from_secs(5), "the hold lapses", || {
        other.get("/lock").status == 409
    });
    assert!(s.post(&format!("/locks/{x}/acquire?wait=5s")).token() > b.token());
    assert_eq!(s.post(&format!("/locks/{x}/acquire?hold=0s")).status, 400);
}

#[test]
fn events_stream_reports_changes() {
    let dir = tempfile::tempdir().unwrap();
    let lock = unique_lock("events");
    let s = Sidecar::start("a", &sqlite_backend(&dir), &lock, &["--mode", "on-demand"]);
    let addr = s.addr;
    // The stream is subscribed before its first event (`state`) goes out: changes made after
    // that event reaches the reader are on the stream.
    let (subscribed, on_stream) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::{BufRead, BufReader, Write};
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
            .write_all(b"GET /lock/events HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut kinds = Vec::new();
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if let Some(kind) = line.strip_prefix("event: ") {
                kinds.push(kind.to_owned());
                let _ = subscribed.send(());
                if kinds.len() == 3 {
                    break;
                }
            }
        }
        kinds
    });
    on_stream
        .recv_timeout(Duration::from_secs(10))
        .expect("the event stream's first event");
    assert_eq!(s.post("/lock/acquire?wait=5s").status, 200);
    assert_eq!(s.post("/lock/release").status, 200);
    assert_eq!(reader.join().unwrap(), ["state", "acquired", "released"]);
}

#[test]
fn an_unreachable_backend_is_reported_not_fatal() {
    let port = leasehold_testkit::free_port();
    let s = Sidecar::start(
        "a",
        &format!("redis://127.0.0.1:{port}"),
        &unique_lock("down"),
        &[],
    );
    std::thread::sleep(Duration::from_millis(500));
    let reply = s.get("/lock");
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.json()["holder"], false);
    // Readiness is the pod's (a native sidecar's counts toward it): an outage must not take
    // the app out of its Services, so by default the sidecar stays ready and says why not.
    let ready = s.get("/readyz");
    assert_eq!(ready.status, 200, "{}", ready.body);
    assert!(ready.body.contains("backend unreachable"), "{}", ready.body);
    assert_eq!(s.get("/healthz").status, 200);
    // Backend-gated readiness is an explicit opt-in.
    let gated = Sidecar::start(
        "b",
        &format!("redis://127.0.0.1:{port}"),
        &unique_lock("down-gated"),
        &["--readiness-requires-backend"],
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(gated.get("/readyz").status, 503);
}

/// A sidecar serving families alone (Dapr's setup) has no lease of its own to tell of its
/// backend: with backend-gated readiness it pings each family's backend, and `/readyz` fails
/// while that goes unanswered, and passes again once it answers.
#[test]
fn backend_gated_readiness_follows_a_familys_backend() {
    let mut redis = leasehold_e2e::RedisServer::start();
    let s = Sidecar::start_keyed_with(
        "a",
        &redis.url(),
        &unique_lock("gated-family"),
        &["--readiness-requires-backend"],
    );
    let within = Duration::from_secs(20);
    eventually(within, "ready with the backend up", || {
        s.get("/readyz").status == 200
    });
    redis.kill();
    eventually(within, "not ready with the backend down", || {
        s.get("/readyz").status == 503
    });
    let down = s.get("/readyz");
    assert!(down.body.contains("gated-family"), "{}", down.body);
    redis.restart();
    eventually(within, "ready again with the backend back", || {
        s.get("/readyz").status == 200
    });
}

/// Established loopback TCP connections to `port`, from `/proc/net/tcp`.
fn connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(2) == Some(&remote.as_str()) && fields.get(3) == Some(&"01")
        })
        .count()
}

/// A sidecar opens its backend connection as it starts, so that the first acquisition, often
/// asked with no wait, does not pay for connecting (a TLS handshake, a new session).
#[test]
fn the_backend_connection_is_opened_before_the_first_request() {
    let redis = leasehold_e2e::RedisServer::start();
    let postgres = leasehold_testkit::PostgresServer::start();
    let etcd = leasehold_testkit::EtcdServer::start();
    let zookeeper = leasehold_testkit::ZooKeeperServer::start();
    for (backend, port) in [
        (redis.url(), redis.port()),
        (postgres.url(), postgres.port()),
        (etcd.url(), etcd.port()),
        (zookeeper.url(), zookeeper.port()),
    ] {
        // etcd holds a connection to itself (its gRPC gateway).
        let before = connections_to(port);
        let _sidecar = Sidecar::start_keyed("pod-a", &backend, &unique_lock("orders"));
        eventually(
            Duration::from_secs(5),
            &format!("the sidecar to connect to {backend}"),
            || connections_to(port) > before,
        );
    }
}

#[test]
fn json_logs_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let s = Sidecar::start(
        "a",
        &sqlite_backend(&dir),
        &unique_lock("logs"),
        &["--log-format", "json"],
    );
    eventually(Duration::from_secs(5), "holder", || s.is_holder());
    let log = s.log();
    let lines: Vec<&str> = log.lines().collect();
    assert!(lines.len() >= 2, "{log}");
    for line in lines {
        let entry: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            entry["level"].is_string() && entry["fields"].is_object(),
            "{line}"
        );
    }
}

/// A password in the backend URL never reaches the logs, the API or the metrics.
#[test]
fn secrets_stay_out_of_logs_and_answers() {
    let redis = leasehold_e2e::RedisServer::start();
    let secret = "pw-8c1f0d2e";
    // This Redis has no password, so AUTH fails: the error path is logged, the secret is not.
    let url = format!("redis://:{secret}@127.0.0.1:{}", redis.port());
    let s = Sidecar::start_with_env(
        "a",
        &url,
        &unique_lock("secret"),
        &[],
        &[("RUST_LOG", "debug")],
    );
    std::thread::sleep(Duration::from_millis(800));
    let answer = s.get("/lock");
    assert_eq!(answer.status, 503, "{}", answer.body);
    let outputs = [
        s.log(),
        answer.body,
        s.get("/metrics").body,
        s.get("/readyz").body,
    ];
    for output in outputs {
        assert!(!output.contains(secret), "the password leaked:\n{output}");
    }
    assert!(
        s.log().contains(":***@127.0.0.1"),
        "the redacted URL is logged"
    );
}

/// The preStop hook the webhook injects: `leasehold-sidecar --resign` steps the running sidecar
/// down from its lock for good: it answers "not holder" at once, and a waiter takes over once the
/// last answer given has run out.
#[test]
fn resign_steps_down_for_good_and_hands_over() {
    let dir = tempfile::tempdir().unwrap();
    let lock = unique_lock("resign");
    let lease = ["--lease-duration", "2s"];
    let a = Sidecar::start("pod-a", &sqlite_backend(&dir), &lock, &lease);
    eventually(Duration::from_secs(5), "a holds", || a.is_holder());
    let b = Sidecar::start("pod-b", &sqlite_backend(&dir), &lock, &lease);
    let out = Command::new(sidecar_binary())
        .args(["--resign", "--listen", &a.addr.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!a.is_holder(), "a still claims after resigning");
    eventually(Duration::from_secs(5), "b takes over", || b.is_holder());
    // Resigned for good: a does not campaign again, even after its cool-down would have ended.
    std::thread::sleep(Duration::from_secs(3));
    assert!(!a.is_holder());
    assert_eq!(
        a.get("/healthz").status,
        200,
        "the process keeps running until stopped"
    );

    let nobody = Command::new(sidecar_binary())
        .args(["--resign", "--listen", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!nobody.status.success());
    assert!(String::from_utf8_lossy(&nobody.stderr).contains("cannot reach the sidecar"));
}

/// Prometheus scrapes the pod IP: `/metrics` answers on the probe listener, beside the probes,
/// while the lock routes stay on loopback only.
#[test]
fn metrics_answer_on_the_probe_listener() {
    let dir = tempfile::tempdir().unwrap();
    let probe_port = leasehold_testkit::free_port();
    let lock = unique_lock("scraped");
    let s = Sidecar::start(
        "a",
        &sqlite_backend(&dir),
        &lock,
        &["--probe-listen", &format!("0.0.0.0:{probe_port}")],
    );
    eventually(Duration::from_secs(5), "holder", || s.is_holder());
    let probe = std::net::SocketAddr::from(([127, 0, 0, 1], probe_port));
    let metrics = http(probe, "GET", "/metrics").expect("scrape");
    assert_eq!(metrics.status, 200, "{}", metrics.body);
    assert!(
        metrics
            .body
            .lines()
            .any(|l| l.starts_with("leasehold_holder{") && l.contains(&lock) && l.ends_with(" 1")),
        "{}",
        metrics.body
    );
    assert_eq!(http(probe, "GET", "/readyz").unwrap().status, 200);
    for (method, path) in [
        ("GET", "/lock"),
        ("POST", "/lock/release"),
        ("POST", "/resign"),
    ] {
        assert_eq!(
            http(probe, method, path).unwrap().status,
            404,
            "{method} {path} on the probe listener"
        );
    }
    assert!(s.is_holder(), "nothing on the probe listener stepped down");
}

/// `acquire?wait=30s&hold=1h` from a client that hangs up after half a second: when the holder
/// releases, that sidecar must not take the lock for nobody, so another pod's waiter gets it.
#[test]
fn a_waiter_whose_client_hung_up_never_takes_the_lock() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let lock = unique_lock("hung-up");
    let on_demand = ["--mode", "on-demand", "--lease-duration", "3s"];
    let a = Sidecar::start("a", &sqlite_backend(&dir), &lock, &on_demand);
    let b = Sidecar::start("b", &sqlite_backend(&dir), &lock, &on_demand);
    let c = Sidecar::start("c", &sqlite_backend(&dir), &lock, &on_demand);
    assert_eq!(a.post("/lock/acquire").status, 200, "a takes the free lock");
    {
        let mut gone = std::net::TcpStream::connect(b.addr).unwrap();
        gone.write_all(
            b"POST /lock/acquire?wait=30s&hold=1h HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(500));
    } // hung up
    std::thread::sleep(Duration::from_millis(200));
    let waiting = std::thread::spawn({
        let addr = c.addr;
        move || http(addr, "POST", "/lock/acquire?wait=10s").unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(a.post("/lock/release").status, 200);
    let answer = waiting.join().unwrap();
    assert_eq!(
        answer.status,
        200,
        "c waited for a released lock: {}\nb's log:\n{}",
        answer.body,
        b.log()
    );
    assert_eq!(b.get("/lock").status, 409, "b holds the lock for nobody");
}

/// A guard that withholds a free lock says so: a sidecar started against a Redis server without
/// durable data (which may have lost leases) answers 409 with the reason and when grants
/// resume, on `/lock`, on the keyed routes and in `/readyz`, then holds once a lease has passed.
#[test]
fn a_withheld_lock_says_why_and_when_grants_resume() {
    use leasehold_e2e::RedisServer;
    let redis = RedisServer::start_with(false);
    let lock = unique_lock("withheld");
    let family = unique_lock("withheld-keys");
    let a = Sidecar::start(
        "pod-a",
        &redis.url(),
        &lock,
        &["--lease-duration", "4s", "--keyed", &family],
    );
    eventually(Duration::from_secs(5), "a reason", || {
        a.get("/lock").json().get("reason").is_some()
    });
    let answer = a.get("/lock");
    assert_eq!(answer.status, 409, "{}", answer.body);
    let body = answer.json();
    assert!(body["currentHolder"].is_null(), "{body}");
    assert!(
        body["reason"]
            .as_str()
            .unwrap()
            .contains("granted once one lease has passed"),
        "{body}"
    );
    let retry = body["retryAfterMs"].as_u64().expect("retryAfterMs");
    assert!(retry <= 4_000, "{body}");
    let ready = a.get("/readyz");
    assert!(ready.body.contains("not granted yet"), "{}", ready.body);

    let key = a.post(&format!("/locks/{family}/keys/k1/acquire?owner=w1"));
    if key.status == 409 {
        let key = key.json();
        assert!(key["reason"].as_str().is_some(), "{key}");
        assert!(key["retryAfterMs"].as_u64().is_some(), "{key}");
    } else {
        // The guard's lease (this family's) had already passed.
        assert_eq!(key.status, 200, "{}", key.body);
    }

    eventually(
        Duration::from_secs(10),
        "a holds once a lease has passed",
        || a.is_holder(),
    );
    let held = a.get("/lock").json();
    assert!(held.get("reason").is_none(), "{held}");
}
