//! A person's force-release (`leasehold.dev/force-release=TOKEN` on the lock), end to end: the
//! real operator binary and sidecars that follow the lock (`--resource`) on the in-memory API,
//! a real Redis. The holder with that token steps down (409 at once), another pod takes the
//! lock with a higher token, not before the holder's last answer has run out, and the operator
//! removes the annotation with an Event; a token that is not current changes nothing. The same
//! for a family's key (`KEY:TOKEN`), a semaphore's permit (`KEY#PERMIT:TOKEN`) and a lock of
//! several permits (`#PERMIT:TOKEN`).

use std::time::Duration;

use leasehold_e2e::cluster::Cluster;
use leasehold_e2e::{RedisServer, Sidecar, eventually, hands_over, unique_lock};
use serde_json::json;

const ANNOTATION: &str = "leasehold.dev/force-release";

/// A Redis server, and a cluster serving `name` on it (a 3 s lease renewed every second,
/// cleaned up on deletion, so that the operator puts its finalizer on) with `extra` in its spec.
fn on_redis(name: &str, extra: serde_json::Value) -> (RedisServer, Cluster) {
    let redis = RedisServer::start();
    let mut spec = json!({
        "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
        "leaseDuration": "3s", "renewInterval": "1s", "cleanupPolicy": "Delete",
    });
    for (field, value) in extra.as_object().expect("fields of a spec") {
        spec[field] = value.clone();
    }
    let cluster = Cluster::start(name, spec);
    (redis, cluster)
}

/// The sidecar of pod `identity`, following the cluster's resource.
fn pod(cluster: &Cluster, identity: &str) -> Sidecar {
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Sidecar::start_from_resource(identity, &cluster.resource(), &env)
}

/// Wait until the operator has removed the annotation and said `reason` in an Event (published
/// after the annotation is removed, so waited for with it).
fn reported(cluster: &Cluster, reason: &str) {
    eventually(Duration::from_secs(30), reason, || {
        cluster.annotation(ANNOTATION).is_none()
            && cluster.event_reasons().contains(&reason.to_owned())
    });
}

#[test]
fn a_force_released_holder_steps_down_and_another_pod_takes_the_lock() {
    let (_redis, cluster) = on_redis(&unique_lock("forced"), json!({}));
    let a = pod(&cluster, "pod-a");
    eventually(Duration::from_secs(15), "pod a holds", || a.is_holder());
    let b = pod(&cluster, "pod-b");
    let token = a.get("/lock").token();

    // A token that is not the holding's: nothing changes, the annotation goes, and an Event
    // says so.
    cluster.annotate(ANNOTATION, &(token + 100).to_string());
    reported(&cluster, "ForceReleaseIgnored");
    assert_eq!(a.get("/lock").token(), token, "pod a still holds");

    cluster.annotate(ANNOTATION, &token.to_string());
    // Pod a answers 409 at once; pod b takes the lock once pod a's last answer has run out.
    hands_over(&a, &b, Duration::from_secs(15), |reply| reply.status == 409);
    assert!(b.get("/lock").token() > token);
    reported(&cluster, "ForceReleased");
}

/// On a family, `KEY:TOKEN` ends one key's holding: its owner holds it no more at once, another
/// pod's owner takes the key with a higher token once the holding's last answer has run out,
/// the operator removes the annotation with an Event, and the owner's other key is untouched.
#[test]
fn a_force_released_key_is_given_up_and_another_owner_takes_it() {
    let family = unique_lock("forced-keys");
    let (_redis, cluster) = on_redis(&family, json!({"keys": {}}));
    let a = pod(&cluster, "pod-a");
    let b = pod(&cluster, "pod-b");
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
    reported(&cluster, "ForceReleaseIgnored");
    let still = a.get(&status("k1")).token();
    assert_eq!(still, token, "pod a's owner still holds k1");

    cluster.annotate(ANNOTATION, &format!("k1:{token}"));
    eventually(
        Duration::from_secs(30),
        "pod a's owner no longer holds k1",
        || a.get(&status("k1")).status == 409,
    );
    eventually(Duration::from_secs(30), "pod b's owner takes k1", || {
        b.post(&route("k1", "acquire", "owner=w2&wait=1s")).status == 200
    });
    let taken = b.get(&format!("/locks/{family}/keys/k1?owner=w2")).token();
    assert!(taken > token, "token {taken} after {token}");
    reported(&cluster, "ForceReleased");
    assert_eq!(a.get(&status("k2")).token(), other, "k2 was touched");
}

/// On a semaphore the request names the permit (`KEY#PERMIT:TOKEN`): two permits of a key may
/// hold one token on some backends, so a request without it is refused and releases nothing.
#[test]
fn a_semaphores_force_release_names_the_permit() {
    let family = unique_lock("forced-permits");
    let (_redis, cluster) = on_redis(&family, json!({"keys": {}, "permits": 2}));
    let a = pod(&cluster, "pod-a");
    let acquire = format!("/locks/{family}/keys/k1/acquire?owner=w1&hold=1h");
    eventually(
        Duration::from_secs(30),
        "pod a's owner takes a permit",
        || a.post(&acquire).status == 200,
    );
    let still = format!("/locks/{family}/keys/k1?owner=w1");
    let held = a.get(&still).json();
    let (token, permit) = (
        held["fencingToken"].as_u64().unwrap(),
        held["permit"].as_u64().unwrap(),
    );

    cluster.annotate(ANNOTATION, &format!("k1:{token}"));
    reported(&cluster, "ForceReleaseInvalid");
    assert_eq!(
        a.get(&still).token(),
        token,
        "released without a permit named"
    );

    cluster.annotate(ANNOTATION, &format!("k1#{permit}:{token}"));
    eventually(Duration::from_secs(30), "the permit's holding ends", || {
        a.get(&still).status == 409
    });
    reported(&cluster, "ForceReleased");
}

/// A lock of two permits declared by a `DistributedLock`: two of three pods hold it, each on a
/// permit of its own. A force-release names the permit (`#PERMIT:TOKEN`; a token alone is
/// refused and releases nothing); that holder steps down at once, and the waiting pod takes its
/// permit with a higher token. A third permit added to the spec is taken, and nobody's holding
/// is revoked.
#[test]
fn a_lock_of_two_permits_is_held_by_two_pods_and_its_force_release_names_the_permit() {
    let (_redis, cluster) = on_redis(&unique_lock("forced-lock-permits"), json!({"permits": 2}));
    let pods = [
        pod(&cluster, "pod-a"),
        pod(&cluster, "pod-b"),
        pod(&cluster, "pod-c"),
    ];
    let holding = || -> Vec<(usize, u64, u64)> {
        pods.iter()
            .enumerate()
            .filter_map(|(i, pod)| {
                let answer = pod.get("/lock");
                (answer.status == 200)
                    .then(|| (i, answer.json()["permit"].as_u64().unwrap(), answer.token()))
            })
            .collect()
    };
    eventually(Duration::from_secs(30), "two pods hold", || {
        holding().len() == 2
    });
    let held = holding();
    assert_ne!(held[0].1, held[1].1, "two holders of one permit: {held:?}");
    let (forced, permit, token) = held[0];
    let waiting = (0..3).find(|i| held.iter().all(|(h, ..)| h != i)).unwrap();

    cluster.annotate(ANNOTATION, &token.to_string());
    reported(&cluster, "ForceReleaseInvalid");
    assert_eq!(
        pods[forced].get("/lock").token(),
        token,
        "released without a permit named"
    );

    cluster.annotate(ANNOTATION, &format!("#{permit}:{token}"));
    eventually(Duration::from_secs(30), "the holding ends", || {
        pods[forced].get("/lock").status == 409
    });
    eventually(
        Duration::from_secs(30),
        "the waiting pod takes the permit",
        || pods[waiting].is_holder(),
    );
    let taken = pods[waiting].get("/lock");
    assert_eq!(taken.json()["permit"], permit, "{}", taken.body);
    assert!(
        taken.token() > token,
        "token {} after {token}",
        taken.token()
    );
    reported(&cluster, "ForceReleased");

    // A third permit: the pod that stepped down takes it, and the two holders keep theirs (a
    // change of permits restarts no lock and revokes no holding).
    let kept = holding();
    cluster.edit(|spec| spec["permits"] = json!(3));
    eventually(Duration::from_secs(30), "three pods hold", || {
        holding().len() == 3
    });
    let now = holding();
    for held in &kept {
        assert!(
            now.contains(held),
            "{held:?} was not kept: {kept:?} then {now:?}"
        );
    }
}
