//! `spec.holderLabel` end to end: three sidecars follow one lock (`--resource`) on the in-memory
//! API with the real operator binary, each on a pod object of its own, over a real Redis. The
//! holder's pod carries `leasehold.dev/holder: "true"` (and the lock's own label) and no other
//! pod of the lock does; the
//! label follows each new holder after its holder is killed (`kill -9`, which cannot take its
//! own label off: the next holder does) or stopped (SIGTERM), and never names two pods at once;
//! the holder reads the pods at its renewals, not in a loop. A pod of another lock keeps its
//! label. A pod that takes two locks carries a label per lock (`holder.leasehold.dev/LOCK`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_e2e::cluster::{Cluster, NAMESPACE};
use leasehold_e2e::{RedisServer, Sidecar, eventually, unique_lock};
use leasehold_testkit::InMemoryApiServer;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const PODS: &str = "/api/v1/pods";
const HOLDER_LABEL: &str = "leasehold.dev/holder";
/// The labelled locks' renew interval, of a 3 s lease: a lease a loaded machine's stall does not
/// lose, which would move the label while a test waits for it on the holder it sampled.
const RENEW: Duration = Duration::from_millis(500);
/// A failed label write is tried again within this.
const LABEL_RETRY: Duration = Duration::from_secs(1);
/// For a loaded 2-core machine, on top of a renew interval.
const SLACK: Duration = Duration::from_millis(1500);

fn pod(name: &str, lock: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NAMESPACE,
                        "annotations": {"leasehold.dev/lock": lock}}})
}

/// The pods whose one-lock holder label says "true", by name.
fn labelled(api: &InMemoryApiServer) -> Vec<String> {
    labelled_by(api, HOLDER_LABEL)
}

/// Reads of pods (lists and gets) the API server has served.
fn pod_reads(api: &InMemoryApiServer) -> u64 {
    api.requests_by_kind().get("GET pods").copied().unwrap_or(0)
}

/// A labelled lock of two permits on a Redis of its own, with `timing` (lease, renew interval),
/// and `pods` pod objects annotated for it (`pod-0`, ...): the server, the cluster and the
/// pods' names.
fn labelled_lock_of_permits(
    name: &str,
    timing: (&str, &str),
    pods: usize,
) -> (RedisServer, Cluster, Vec<String>) {
    let redis = RedisServer::start();
    let lock = unique_lock(name);
    let cluster = Cluster::start(
        &lock,
        json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
            "leaseDuration": timing.0, "renewInterval": timing.1, "holderLabel": true,
            "permits": 2, "cleanupPolicy": "Delete",
        }),
    );
    let names: Vec<String> = (0..pods).map(|i| format!("pod-{i}")).collect();
    for pod_name in &names {
        cluster.api.put(PODS, pod(pod_name, &lock));
    }
    (redis, cluster, names)
}

/// The sidecar of pod `name`, following the cluster's lock.
fn start_pod(cluster: &Cluster, name: &str) -> Sidecar {
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Sidecar::start_from_resource(name, &cluster.resource(), &env)
}

/// Which sidecar holds, when exactly one says so.
fn holder(sidecars: &[Sidecar]) -> Option<usize> {
    let holding: Vec<usize> = (0..sidecars.len())
        .filter(|&i| sidecars[i].is_holder())
        .collect();
    match holding.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

#[test]
fn the_holder_label_follows_the_holder_and_never_names_two_pods() {
    let redis = RedisServer::start();
    let lock = unique_lock("labelled");
    let cluster = Cluster::start(
        &lock,
        json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
            "leaseDuration": "3s", "renewInterval": "500ms", "holderLabel": true,
            "cleanupPolicy": "Delete",
        }),
    );
    let names: Vec<String> = (0..3).map(|i| format!("pod-{i}")).collect();
    for name in &names {
        cluster.api.put(PODS, pod(name, &lock));
    }
    // The holder of another lock in the namespace: not this lock's to take the label off.
    let mut other = pod("other-holder", "another-lock");
    other["metadata"]["labels"] = json!({HOLDER_LABEL: "true"});
    cluster.api.put(PODS, other);

    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let start = |name: &str| Sidecar::start_from_resource(name, &cluster.resource(), &env);
    let mut sidecars: Vec<Sidecar> = names.iter().map(|n| start(n)).collect();

    // Sampled all along, many times a renew interval: the most pods of this lock labelled at
    // once, and when.
    let stop = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(Mutex::new((0usize, Vec::<String>::new())));
    let checker = {
        let (api, stop, worst) = (cluster.api.clone(), stop.clone(), worst.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let ours: Vec<String> = labelled(&api)
                    .into_iter()
                    .filter(|n| n != "other-holder")
                    .collect();
                let mut worst = worst.lock().unwrap();
                if ours.len() > worst.0 {
                    *worst = (ours.len(), ours);
                }
                drop(worst);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    let began = std::time::Instant::now();
    let lists_before = pod_reads(&cluster.api);
    for round in 0..6 {
        let mut held = None;
        eventually(Duration::from_secs(15), "one holder", || {
            held = holder(&sidecars);
            held.is_some()
        });
        let held = held.expect("a holder");
        let expected = vec!["other-holder".to_owned(), names[held].clone()];
        let took = eventually(
            Duration::from_secs(15),
            "the label names the holder",
            || labelled(&cluster.api) == expected,
        );
        assert!(
            took <= RENEW + LABEL_RETRY + SLACK,
            "the label named the holder {took:?} after it held (labels: {:?}); the holder's log:\n{}",
            labelled(&cluster.api),
            sidecars[held].log()
        );
        // Kill or stop the holder. A killed one cannot take its own label off: the next
        // holder must, before it labels its own pod. Its sidecar starts again only once the
        // label has moved.
        if round % 2 == 0 {
            sidecars[held].kill9();
        } else {
            sidecars[held].signal(Signal::SIGTERM);
            assert!(
                sidecars[held].wait_exit(Duration::from_secs(10)).is_some(),
                "the holder did not exit on SIGTERM"
            );
        }
        eventually(
            Duration::from_secs(15),
            "the label moves to another pod",
            || {
                let now = labelled(&cluster.api);
                now.len() == 2 && !now.contains(&names[held])
            },
        );
        sidecars[held] = start(&names[held]);
    }
    let elapsed = began.elapsed();
    stop.store(true, Ordering::SeqCst);
    checker.join().unwrap();
    // The holder lists the labelled pods at each renewal, not in a loop: two lists (the
    // one-lock label's and the lock's own) at each of two renewals a second, with room.
    let lists = pod_reads(&cluster.api) - lists_before;
    let most_lists = 8 * elapsed.as_secs() + 50;
    assert!(
        lists <= most_lists,
        "{lists} reads of pods in {elapsed:?}, more than {most_lists}"
    );
    let (most, when) = worst.lock().unwrap().clone();
    assert!(
        most <= 1,
        "two pods labelled as the holder at once: {when:?}"
    );
    assert!(
        labelled(&cluster.api).contains(&"other-holder".to_owned()),
        "another lock's holder lost its label"
    );
}

/// The pods whose label `key` says "true", by name.
fn labelled_by(api: &InMemoryApiServer, key: &str) -> Vec<String> {
    let mut names: Vec<String> = api
        .objects(PODS)
        .into_iter()
        .filter(|p| p["metadata"]["labels"][key] == "true")
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// Pods that take two locks: each lock's holder carries `holder.leasehold.dev/LOCK`, the label
/// moves with that lock's holder alone, and no pod of two locks carries the one-lock label. A pod
/// of the first lock alone shares it: it carries both labels while it holds, and when it is
/// killed holding, a pod of two locks that takes over takes both off it.
#[test]
fn a_pod_of_two_locks_carries_a_holder_label_per_lock() {
    let redis = RedisServer::start();
    let first = unique_lock("first");
    let second = unique_lock("second");
    let spec = json!({
        "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
        "leaseDuration": "3s", "renewInterval": "500ms", "holderLabel": true,
        "cleanupPolicy": "Delete",
    });
    let cluster = Cluster::start(&first, spec.clone());
    cluster.add_lock(&second, spec);
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let first_key = format!("holder.leasehold.dev/{first}");

    // The pod of the first lock alone starts first and holds it.
    cluster.api.put(PODS, pod("solo", &first));
    let mut solo = Sidecar::start_from_resource("solo", &format!("{NAMESPACE}/{first}"), &env);
    eventually(Duration::from_secs(15), "the lone pod labelled", || {
        labelled(&cluster.api) == ["solo"] && labelled_by(&cluster.api, &first_key) == ["solo"]
    });

    let names: Vec<String> = (0..3).map(|i| format!("pod-{i}")).collect();
    for name in &names {
        cluster
            .api
            .put(PODS, pod(name, &format!("{first},{second}")));
    }
    let resources = format!("{NAMESPACE}/{first},{NAMESPACE}/{second}");
    let start = |name: &str| Sidecar::start_from_resource(name, &resources, &env);
    let mut sidecars: Vec<Sidecar> = names.iter().map(|n| start(n)).collect();
    let holder_of = |sidecars: &[Sidecar], lock: &str| -> Option<usize> {
        let holding: Vec<usize> = (0..sidecars.len())
            .filter(|&i| sidecars[i].get(&format!("/locks/{lock}")).status == 200)
            .collect();
        match holding.as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    };

    // Killed holding, the lone pod cannot take its labels off: the next holder does.
    solo.kill9();
    eventually(
        Duration::from_secs(15),
        "the lone pod's labels taken off by a pod of two locks",
        || {
            let now = labelled_by(&cluster.api, &first_key);
            labelled(&cluster.api).is_empty() && now.len() == 1 && now[0] != "solo"
        },
    );

    for round in 0..2 {
        for lock in [&first, &second] {
            let key = format!("holder.leasehold.dev/{lock}");
            let mut held = None;
            eventually(Duration::from_secs(15), "one holder of the lock", || {
                held = holder_of(&sidecars, lock);
                held.is_some()
            });
            let held = held.expect("a holder");
            let took = eventually(
                Duration::from_secs(15),
                "the lock's label names its holder",
                || labelled_by(&cluster.api, &key) == [names[held].clone()],
            );
            assert!(
                took <= RENEW + LABEL_RETRY + SLACK,
                "{key} named the holder {took:?} after it held; its log:\n{}",
                sidecars[held].log()
            );
        }
        assert!(
            labelled(&cluster.api).is_empty(),
            "a pod of two locks carries {HOLDER_LABEL}"
        );
        // The first lock's holder killed: its label moves to the lock's next holder.
        let held = holder_of(&sidecars, &first).expect("a holder of the first lock");
        sidecars[held].kill9();
        eventually(
            Duration::from_secs(15),
            "the first lock's label moves to another pod",
            || {
                let now = labelled_by(&cluster.api, &first_key);
                now.len() == 1 && now[0] != names[held]
            },
        );
        sidecars[held] = start(&names[held]);
        eprintln!(
            "round {round}: the first lock's label moved from {}",
            names[held]
        );
    }
}

/// On a lock of two permits both holders carry the label, together and for good (neither takes
/// the other's off), and no third pod does; a killed holder's label goes, and the pod that
/// takes its permit carries one.
#[test]
fn on_a_lock_of_two_permits_both_holders_carry_the_label() {
    let (_redis, cluster, names) = labelled_lock_of_permits("labelled-permits", ("3s", "500ms"), 3);
    let mut sidecars: Vec<Sidecar> = names.iter().map(|n| start_pod(&cluster, n)).collect();
    // The holders among the sidecars still running (`dead` is not asked).
    let holders_but = |sidecars: &[Sidecar], dead: Option<usize>| -> Vec<String> {
        let mut held: Vec<String> = sidecars
            .iter()
            .enumerate()
            .filter(|(i, s)| Some(*i) != dead && s.is_holder())
            .map(|(_, s)| s.identity.clone())
            .collect();
        held.sort();
        held
    };
    let holders = |sidecars: &[Sidecar]| holders_but(sidecars, None);
    eventually(
        Duration::from_secs(15),
        "two pods hold, both labelled",
        || {
            let held = holders(&sidecars);
            held.len() == 2 && labelled(&cluster.api) == held
        },
    );
    // Several renewals: each holder lists the labelled pods at each, and takes off none that
    // the backend names as a holder.
    let held = holders(&sidecars);
    let until = std::time::Instant::now() + 8 * RENEW;
    while std::time::Instant::now() < until {
        assert_eq!(
            labelled(&cluster.api),
            held,
            "the labels moved without a fault"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let dead = names.iter().position(|n| *n == held[0]).unwrap();
    sidecars[dead].kill9();
    eventually(
        Duration::from_secs(15),
        "the dead holder's label goes and the new holder's comes",
        || {
            let now = holders_but(&sidecars, Some(dead));
            now.len() == 2 && labelled(&cluster.api) == now
        },
    );
}

/// A holder renewing every few seconds reads the pods at its renewals too: two lists (the
/// one-lock label's and the lock's own) at each, not every second. A namespace of many labelled
/// locks would otherwise list its pods several times a second for each.
#[test]
fn a_holder_with_a_long_renew_interval_reads_the_pods_at_its_renewals() {
    let redis = RedisServer::start();
    let lock = unique_lock("labelled-slow");
    let renew = Duration::from_secs(4);
    let cluster = Cluster::start(
        &lock,
        json!({
            "backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
            "leaseDuration": "12s", "renewInterval": "4s", "holderLabel": true,
            "cleanupPolicy": "Delete",
        }),
    );
    cluster.api.put(PODS, pod("pod-0", &lock));
    let env = cluster.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let sidecar = Sidecar::start_from_resource("pod-0", &cluster.resource(), &env);
    eventually(Duration::from_secs(15), "the holder is labelled", || {
        sidecar.is_holder() && labelled(&cluster.api) == ["pod-0"]
    });
    let reads_before = pod_reads(&cluster.api);
    let watched = 3 * renew;
    std::thread::sleep(watched);
    let reads = pod_reads(&cluster.api) - reads_before;
    // Three renew intervals: a pass at each of up to four renewals, and one more for a renewal
    // that came early, of two lists each (a pass a second would make about 24).
    assert!(
        reads <= 10,
        "{reads} reads of pods in {watched:?} at a renew interval of {renew:?}; the holder's log:\n{}",
        sidecar.log()
    );
    assert_eq!(labelled(&cluster.api), ["pod-0"]);
}

/// A lock of two permits lowered to one keeps both holdings, and a sidecar started since (with
/// one permit, so it reads permit 0 alone) takes the label off neither: the pod on permit 1
/// names its permit in its annotation, and the newcomer reads that permit before it would take
/// its label off.
#[test]
fn a_holder_above_a_lowered_count_keeps_its_label_beside_a_restarted_holder() {
    // A lease a holder keeps through a stall of a second or two on a loaded machine: the
    // holder of permit 1 cannot take it again once the count is one.
    let (_redis, cluster, names) = labelled_lock_of_permits("labelled-lowered", ("3s", "500ms"), 2);
    let start = |name: &str| start_pod(&cluster, name);
    let mut sidecars: Vec<Sidecar> = names.iter().map(|n| start(n)).collect();
    eventually(Duration::from_secs(15), "both hold, both labelled", || {
        sidecars.iter().all(Sidecar::is_holder) && labelled(&cluster.api) == names
    });
    let permit_of = |s: &Sidecar| s.get("/lock").json()["permit"].as_u64();
    let on_zero = (0..2)
        .find(|&i| permit_of(&sidecars[i]) == Some(0))
        .expect("a holder of permit 0");
    let above = 1 - on_zero;
    cluster.edit(|spec| spec["permits"] = json!(1));
    eventually(Duration::from_secs(15), "both see one permit", || {
        sidecars
            .iter()
            .all(|s| s.get("/lock").json()["permits"] == json!(1))
    });
    // The holder of permit 0 starts again, with one permit: it takes permit 0 once its lease
    // has run out.
    sidecars[on_zero].kill9();
    sidecars[on_zero] = start(&names[on_zero]);
    eventually(Duration::from_secs(15), "the restarted pod holds", || {
        sidecars[on_zero].is_holder() && labelled(&cluster.api) == names
    });
    // Six renewals of each holder.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        assert!(
            labelled(&cluster.api).contains(&names[above]),
            "the holder of permit 1 lost its label while it holds (holding: {}); the restarted holder's log:\n{}",
            sidecars[above].is_holder(),
            sidecars[on_zero].log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(sidecars[above].is_holder());
}
