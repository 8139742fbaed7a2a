//! A person's force-release (`leasehold.dev/force-release=TOKEN` on the lock), end to end: the
//! real operator binary and sidecars that follow the lock (`--resource`) on the in-memory API,
//! a real Redis. The holder with that token steps down (409 at once), another pod takes the
//! lock with a higher token, not before the holder's last answer has run out, and the operator
//! removes the annotation with an Event; a token that is not current changes nothing.

use std::time::Duration;

use leasehold_e2e::cluster::Cluster;
use leasehold_e2e::{RedisServer, Sidecar, eventually, hands_over, unique_lock};
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

    // A token that is not the holding's: nothing changes, the annotation goes, and an Event
    // says so (published after the annotation is removed, so waited for with it).
    cluster.annotate(ANNOTATION, &(token + 100).to_string());
    eventually(
        Duration::from_secs(15),
        "the stale request is removed and reported",
        || {
            cluster.annotation(ANNOTATION).is_none()
                && cluster
                    .event_reasons()
                    .contains(&"ForceReleaseIgnored".to_owned())
        },
    );
    assert_eq!(a.get("/lock").token(), token, "pod a still holds");

    cluster.annotate(ANNOTATION, &token.to_string());
    // Pod a answers 409 at once; pod b takes the lock once pod a's last answer has run out.
    hands_over(&a, &b, Duration::from_secs(15), |reply| reply.status == 409);
    assert!(b.get("/lock").token() > token);
    eventually(Duration::from_secs(15), "the operator reports it", || {
        cluster.annotation(ANNOTATION).is_none()
            && cluster
                .event_reasons()
                .contains(&"ForceReleased".to_owned())
    });
}
