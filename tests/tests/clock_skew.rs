//! A client whose wall clock is wrong by minutes still cannot steal a live lease: expiry is
//! decided by the backend's clock (Redis PX, SQL `now()`), and the sidecar measures its own lease
//! on the monotonic clock. The skewed sidecar runs under libfaketime, ten minutes ahead.

use std::time::{Duration, Instant, SystemTime};

use leasehold_e2e::{RedisServer, Sidecar, eventually, eventually_or, libfaketime, unique_lock};

const LEASE: Duration = Duration::from_secs(2);
const RENEW: Duration = Duration::from_millis(500);
/// Slack on top of the protocol's bounds, only to catch hangs. What the file checks (no steal,
/// the token unchanged, the next token higher) is exact; how soon things happen is not, on a
/// 2-core machine running the whole suite: a commit's fsync behind another server's start-up
/// has taken over a second, and in row-lock mode a first acquisition that must open its
/// connection ran past its 500 ms budget twice in a row in CI, putting the takeover 5.5 s after
/// the kill.
const SLACK: Duration = Duration::from_secs(15);
const TIMING: &[&str] = &["--lease-duration", "2s", "--renew-interval", "500ms"];
const SKEW: Duration = Duration::from_secs(600);

/// The token of `sidecar`'s holding, waiting out a moment of 503 ("cannot tell").
fn holder_token(sidecar: &Sidecar) -> u64 {
    eventually(LEASE + SLACK, "the holder answers 200", || {
        sidecar.is_holder()
    });
    sidecar.get("/lock").token()
}

fn skewed_client_cannot_steal(backend: &str) {
    let lock = unique_lock("skew");
    let mut honest = Sidecar::start("honest", backend, &lock, TIMING);
    eventually(LEASE + SLACK, "the honest sidecar holds", || {
        honest.is_holder()
    });
    let token = holder_token(&honest);

    let preload = libfaketime();
    let skewed = Sidecar::start_with_env(
        "skewed",
        backend,
        &lock,
        TIMING,
        &[
            ("LD_PRELOAD", preload.to_str().expect("UTF-8 path")),
            ("FAKETIME", "+10m"),
            // Only the wall clock is wrong; a monotonic clock cannot be set.
            ("DONT_FAKE_MONOTONIC", "1"),
        ],
    );
    // Prove the skew took: the skewed sidecar's timestamps are ten minutes ahead.
    eventually(LEASE + SLACK, "the skewed sidecar answers", || {
        skewed.get("/lock").status == 409
    });
    let since = skewed.get("/lock").json()["since"]
        .as_str()
        .unwrap()
        .to_owned();
    let since = humantime::parse_rfc3339(&since).unwrap();
    let ahead = since.duration_since(SystemTime::now()).unwrap_or_default();
    assert!(
        ahead > SKEW - Duration::from_secs(60),
        "no skew: since={since:?}"
    );

    let until = Instant::now() + LEASE * 3;
    while Instant::now() < until {
        assert!(
            !skewed.is_holder(),
            "a client ten minutes ahead stole a live lease"
        );
        // A renewal slower than its budget on a busy machine makes the holder answer 503
        // ("cannot tell") for a moment, which is safe; losing the lease to anyone is not (the
        // token is checked again below).
        let answer = honest.get("/lock");
        assert_ne!(
            answer.status, 409,
            "the honest holder lost its lease: {}",
            answer.body
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        holder_token(&honest),
        token,
        "the honest holder's lease changed"
    );

    // And the skewed client is otherwise a normal contender.
    honest.kill9();
    eventually_or(
        LEASE + RENEW + SLACK,
        "the skewed sidecar takes over",
        || skewed.is_holder(),
        || {
            format!(
                "; its answer: {}\nits log:\n{}",
                skewed.get("/lock").body,
                skewed.log()
            )
        },
    );
    assert!(skewed.get("/lock").token() > token);
}

leasehold_e2e::on_each_server! {
    skewed_client_cannot_steal:
    redis_ignores_client_clocks: RedisServer,
    postgres_ignores_client_clocks: PostgresServer,
    mariadb_ignores_client_clocks: MariaDbServer,
    postgres_row_lock_ignores_client_clocks: PostgresServer "?mode=row-lock",
    mariadb_row_lock_ignores_client_clocks: MariaDbServer "?mode=row-lock",
    /// etcd expires leases by its own clock.
    etcd_ignores_client_clocks: EtcdServer,
}

/// Redlock masters expire keys by their own clocks; the client's clock is never sent. The
/// masters skip fsync: each must answer within a tenth of the 2 s lease, and an fsync behind the
/// parallel tests' database start-ups took longer than that in CI (no master restarts here, so
/// durability is not what this test is about).
#[test]
fn redlock_ignores_client_clocks() {
    let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start_with(false)).collect();
    let hosts: Vec<String> = masters
        .iter()
        .map(|m| format!("127.0.0.1:{}", m.port()))
        .collect();
    skewed_client_cannot_steal(&format!("redlock://{}", hosts.join(",")));
}
