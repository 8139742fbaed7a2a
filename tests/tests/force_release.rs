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

/// On a family, `KEY:TOKEN` ends one key's holding: its owner holds it no more at once, another
/// pod's owner takes the key with a higher token once the holding's last answer has run out,
/// the operator removes the annotation with an Event, and the owner's other key is untouched.
#[test]
fn a_force_released_key_is_given_up_and_another_owner_takes_it() {
    let redis = RedisServer::start();
    let family = unique_lock("forced-keys");
    let cluster = Cluster::start(
        &family,
        json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
            "leaseDuration": "3s", "renewInterval": "1s", "cleanupPolicy": "Delete", "keys": {},
        }),
    );
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let a = Sidecar::start_from_resource("pod-a", &cluster.resource(), &env);
    let b = Sidecar::start_from_resource("pod-b", &cluster.resource(), &env);
    let route = |key: &str, action: &str, query: &str| {
        format!("/locks/{family}/keys/{key}/{action}?{query}")
    };
    let status = |key: &str| format!("/locks/{family}/keys/{key}?owner=w1");
    eventually(Duration::from_secs(30), "pod a's owner takes k1", || {
        a.post(&route("k1", "acquire", "owner=w1&hold=1h")).status == 200
    });
    let token = a.get(&status("k1")).token();
    let other = a.post(&route("k2", "acquire", "owner=w1&hold=1h")).token();

    // A token that is not the key's holding: nothing changes.
    cluster.annotate(ANNOTATION, &format!("k1:{}", token + 100));
    eventually(
        Duration::from_secs(30),
        "the stale request is removed and reported",
        || {
            cluster.annotation(ANNOTATION).is_none()
                && cluster
                    .event_reasons()
                    .contains(&"ForceReleaseIgnored".to_owned())
        },
    );
    assert_eq!(
        a.get(&status("k1")).token(),
        token,
        "pod a's owner still holds k1"
    );

    cluster.annotate(ANNOTATION, &format!("k1:{token}"));
    eventually(
        Duration::from_secs(30),
        "pod a's owner no longer holds k1",
        || a.get(&status("k1")).status != 200,
    );
    eventually(Duration::from_secs(30), "pod b's owner takes k1", || {
        b.post(&route("k1", "acquire", "owner=w2&wait=1s")).status == 200
    });
    let taken = b.get(&format!("/locks/{family}/keys/k1?owner=w2")).token();
    assert!(taken > token, "token {taken} after {token}");
    eventually(Duration::from_secs(30), "the operator reports it", || {
        cluster.annotation(ANNOTATION).is_none()
            && cluster
                .event_reasons()
                .contains(&"ForceReleased".to_owned())
    });
    assert_eq!(a.get(&status("k2")).token(), other, "k2 was touched");
}

/// On a semaphore the request names the permit (`KEY#PERMIT:TOKEN`): two permits of a key may
/// hold one token on some backends, so a request without it is refused and releases nothing.
#[test]
fn a_semaphores_force_release_names_the_permit() {
    let redis = RedisServer::start();
    let family = unique_lock("forced-permits");
    let cluster = Cluster::start(
        &family,
        json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
            "leaseDuration": "3s", "renewInterval": "1s", "cleanupPolicy": "Delete",
            "keys": {}, "permits": 2,
        }),
    );
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let a = Sidecar::start_from_resource("pod-a", &cluster.resource(), &env);
    let acquire = format!("/locks/{family}/keys/k1/acquire?owner=w1&hold=1h");
    eventually(
        Duration::from_secs(30),
        "pod a's owner takes a permit",
        || a.post(&acquire).status == 200,
    );
    let held = a.get(&format!("/locks/{family}/keys/k1?owner=w1")).json();
    let (token, permit) = (
        held["fencingToken"].as_u64().unwrap(),
        held["permit"].as_u64().unwrap(),
    );

    cluster.annotate(ANNOTATION, &format!("k1:{token}"));
    eventually(
        Duration::from_secs(30),
        "the request without a permit is refused",
        || {
            cluster.annotation(ANNOTATION).is_none()
                && cluster
                    .event_reasons()
                    .contains(&"ForceReleaseInvalid".to_owned())
        },
    );
    let still = format!("/locks/{family}/keys/k1?owner=w1");
    assert_eq!(
        a.get(&still).token(),
        token,
        "released without a permit named"
    );

    cluster.annotate(ANNOTATION, &format!("k1#{permit}:{token}"));
    eventually(Duration::from_secs(30), "the permit's holding ends", || {
        a.get(&still).status == 409
    });
    eventually(Duration::from_secs(30), "the operator reports it", || {
        cluster.annotation(ANNOTATION).is_none()
            && cluster
                .event_reasons()
                .contains(&"ForceReleased".to_owned())
    });
}
