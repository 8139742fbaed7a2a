//! A person's force-release (`leasehold.dev/force-release=TOKEN` on the lock), end to end: the
//! real operator binary and sidecars that follow the lock (`--resource`) on the in-memory API,
//! a real Redis. The holder with that token steps down (409 at once), another pod takes the
//! lock with a higher token, not before the holder's last answer has run out, and the operator
//! removes the annotation with an Event; a token that is not current changes nothing.

use std::time::{Duration, Instant};

use leasehold_e2e::cluster::Cluster;
use leasehold_e2e::{RedisServer, Sidecar, eventually, unique_lock};
use serde_json::json;

const ANNOTATION: &str = "leasehold.dev/force-release";

#[test]
fn a_force_released_holder_steps_down_and_another_pod_takes_the_lock() {
    let redis = RedisServer::start();
    let lock = unique_lock("forced");
    let cluster = Cluster::start(
        &lock,
        json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
            "leaseDuration": "3s", "renewInterval": "1s", "cleanupPolicy": "Delete",
        }),
    );
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let a = Sidecar::start_from_resource("pod-a", &cluster.resource(), &env);
    eventually(Duration::from_secs(15), "pod a holds", || a.is_holder());
    let b = Sidecar::start_from_resource("pod-b", &cluster.resource(), &env);
    let token = a.get("/lock").token();

    // A token that is not the holding's: nothing changes, the annotation goes.
    cluster.annotate(ANNOTATION, &(token + 100).to_string());
    eventually(
        Duration::from_secs(15),
        "the stale request is removed",
        || cluster.annotation(ANNOTATION).is_none(),
    );
    assert!(
        cluster
            .event_reasons()
            .contains(&"ForceReleaseIgnored".to_owned())
    );
    assert_eq!(a.get("/lock").token(), token, "pod a still holds");

    let mut last_valid_until = Instant::now();
    cluster.annotate(ANNOTATION, &token.to_string());
    eventually(Duration::from_secs(10), "pod a steps down", || {
        let asked = Instant::now();
        let reply = a.get("/lock");
        if reply.status == 200 {
            let valid_for = reply.json()["validForMs"].as_u64().unwrap();
            last_valid_until = asked + Duration::from_millis(valid_for);
        }
        reply.status == 409
    });
    eventually(Duration::from_secs(15), "pod b takes the lock", || {
        b.is_holder()
    });
    let taken = Instant::now();
    assert!(
        taken >= last_valid_until,
        "pod b held {:?} before pod a's last answer ran out",
        last_valid_until - taken
    );
    assert!(b.get("/lock").token() > token);
    eventually(Duration::from_secs(15), "the operator reports it", || {
        cluster.annotation(ANNOTATION).is_none()
            && cluster
                .event_reasons()
                .contains(&"ForceReleased".to_owned())
    });
}
