//! The in-memory API server's RBAC, against what Kubernetes documents for its RBAC authorizer:
//! a user may do what a bound rule lists (verb, API group, resource or `resource/subresource`,
//! `resourceNames`), a RoleBinding's rules hold inside its namespace only, and anything else is
//! a 403 `Forbidden` naming the user, verb, resource and scope. Its lists, pages, watches and
//! compaction, and its server-side apply (field managers, conflicts, list maps), against what
//! the API server does.

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use leasehold_testkit::InMemoryApiServer;
use leasehold_testkit::in_memory_api_server::{Attributes, DISTRIBUTED_LOCKS, Grant, LEASES};
use serde_json::json;

const USER: &str = "system:serviceaccount:apps:worker";

fn lease(namespace: &str, name: &str) -> serde_json::Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": name, "namespace": namespace}, "spec": {}})
}

fn forbidden(result: Result<impl std::fmt::Debug, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 && status.reason == "Forbidden" => {
            status.message
        }
        other => panic!("not a 403 Forbidden: {other:?}"),
    }
}

#[tokio::test]
async fn a_role_binding_grants_its_verbs_inside_its_namespace_only() {
    let api = InMemoryApiServer::new();
    api.put(LEASES, lease("apps", "a"));
    api.put(LEASES, lease("other", "a"));
    api.grant(
        USER,
        vec![Grant {
            namespace: Some("apps".into()),
            rule: json!({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                         "verbs": ["get", "list"]}),
        }],
    );
    let client = api.client_as(USER);
    let apps = Api::<Lease>::namespaced(client.clone(), "apps");
    apps.get("a").await.expect("get in the bound namespace");
    apps.list(&ListParams::default()).await.expect("list there");
    let message = forbidden(
        Api::<Lease>::namespaced(client.clone(), "other")
            .get("a")
            .await,
    );
    assert_eq!(
        message,
        "leases.coordination.k8s.io \"a\" is forbidden: User \"system:serviceaccount:apps:worker\" \
         cannot get resource \"leases\" in API group \"coordination.k8s.io\" in the namespace \"other\""
    );
    forbidden(apps.delete("a", &DeleteParams::default()).await);
    let created = serde_json::from_value(lease("apps", "b")).unwrap();
    forbidden(apps.create(&PostParams::default(), &created).await);
    assert!(api.lease("apps", "b").is_none(), "a refused create wrote");
    assert!(api.lease("apps", "a").is_some(), "a refused delete deleted");
    let denied: Vec<(String, String)> = api
        .denied()
        .into_iter()
        .map(
            |Attributes {
                 verb, namespace, ..
             }| (verb, namespace),
        )
        .collect();
    assert_eq!(
        denied,
        [
            ("get".to_owned(), "other".to_owned()),
            ("delete".to_owned(), "apps".to_owned()),
            ("create".to_owned(), "apps".to_owned()),
        ]
    );
    // Without a user, the client is the cluster's administrator.
    Api::<Lease>::namespaced(api.client(), "other")
        .delete("a", &DeleteParams::default())
        .await
        .expect("the administrator deletes");
}

#[tokio::test]
async fn resource_names_subresources_and_cluster_scope_are_authorized_as_kubernetes_does() {
    use k8s_openapi::api::core::v1::Namespace;
    let api = InMemoryApiServer::new();
    api.put(LEASES, lease("apps", "mine"));
    api.put(LEASES, lease("apps", "theirs"));
    api.put(
        leasehold_testkit::in_memory_api_server::NAMESPACES,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "apps"}}),
    );
    api.grant(
        USER,
        vec![
            Grant {
                namespace: None,
                rule: json!({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                             "resourceNames": ["mine"], "verbs": ["get", "list", "watch"]}),
            },
            Grant {
                namespace: Some("apps".into()),
                rule: json!({"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]}),
            },
        ],
    );
    let client = api.client_as(USER);
    let leases = Api::<Lease>::namespaced(client.clone(), "apps");
    leases.get("mine").await.expect("a listed name");
    forbidden(leases.get("theirs").await);
    // A list restricted to a listed name by a field selector is allowed; a plain list is not.
    leases
        .list(&ListParams::default().fields("metadata.name=mine"))
        .await
        .expect("a list of one listed name");
    forbidden(leases.list(&ListParams::default()).await);
    // The status subresource is a resource of its own.
    let patch = kube::api::Patch::Merge(json!({"status": {}}));
    forbidden(
        leases
            .patch_status("mine", &kube::api::PatchParams::default(), &patch)
            .await,
    );
    // A RoleBinding never grants a cluster-scoped resource, though the rule names it.
    let message = forbidden(Api::<Namespace>::all(client).get("apps").await);
    assert!(message.ends_with("at the cluster scope"), "{message}");
}

/// A SubjectAccessReview answers whether its subject (the user, or any of its groups) may do
/// what it names, from the same grants that authorize requests; asking needs `create` on
/// `subjectaccessreviews` at the cluster scope, and nothing is stored.
#[tokio::test]
async fn a_subject_access_review_answers_from_the_grants() {
    use k8s_openapi::api::authorization::v1::SubjectAccessReview;
    let api = InMemoryApiServer::new();
    let sidecar = "system:serviceaccount:apps:jobs-runner";
    api.grant(
        USER,
        vec![Grant {
            namespace: None,
            rule: json!({"apiGroups": ["authorization.k8s.io"],
                         "resources": ["subjectaccessreviews"], "verbs": ["create"]}),
        }],
    );
    api.grant(
        sidecar,
        vec![Grant {
            namespace: Some("apps".into()),
            rule: json!({"apiGroups": ["leasehold.dev"], "resources": ["distributedlocks"],
                         "resourceNames": ["jobs"], "verbs": ["get"]}),
        }],
    );
    api.grant(
        "system:serviceaccounts:shared",
        vec![Grant {
            namespace: Some("shared".into()),
            rule: json!({"apiGroups": ["leasehold.dev"], "resources": ["distributedlocks"],
                         "verbs": ["get"]}),
        }],
    );
    let ask = async |client: kube::Client, user: &str, groups: &[&str], ns: &str, name: &str| {
        let review: SubjectAccessReview = serde_json::from_value(json!({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": groups,
                     "resourceAttributes": {"namespace": ns, "verb": "get",
                                            "group": "leasehold.dev",
                                            "resource": "distributedlocks", "name": name}}
        }))
        .unwrap();
        Api::<SubjectAccessReview>::all(client)
            .create(&PostParams::default(), &review)
            .await
            .map(|answer| answer.status.expect("a status").allowed)
    };
    let client = api.client_as(USER);
    assert!(
        ask(client.clone(), sidecar, &[], "apps", "jobs")
            .await
            .unwrap()
    );
    assert!(
        !ask(client.clone(), sidecar, &[], "apps", "other")
            .await
            .unwrap()
    );
    assert!(
        !ask(client.clone(), sidecar, &[], "shared", "jobs")
            .await
            .unwrap()
    );
    // Granted to its group, a ServiceAccount of that namespace may.
    let groups = ["system:serviceaccounts", "system:serviceaccounts:shared"];
    let shared = "system:serviceaccount:shared:app";
    assert!(
        ask(client.clone(), shared, &groups, "shared", "any")
            .await
            .unwrap()
    );
    assert!(!ask(client, shared, &[], "shared", "any").await.unwrap());
    // Asking is itself authorized.
    forbidden(ask(api.client_as(sidecar), sidecar, &[], "apps", "jobs").await);
    assert!(
        api.objects(leasehold_testkit::in_memory_api_server::SUBJECT_ACCESS_REVIEWS)
            .is_empty()
    );

    // A LocalSubjectAccessReview asks about the namespace it is made in, with `create` there.
    use k8s_openapi::api::authorization::v1::LocalSubjectAccessReview;
    let local = async |client: kube::Client, made_in: &str, about: &str| {
        let review: LocalSubjectAccessReview = serde_json::from_value(json!({
            "apiVersion": "authorization.k8s.io/v1", "kind": "LocalSubjectAccessReview",
            "metadata": {"namespace": made_in},
            "spec": {"user": sidecar,
                     "resourceAttributes": {"namespace": about, "verb": "get",
                                            "group": "leasehold.dev",
                                            "resource": "distributedlocks", "name": "jobs"}}
        }))
        .unwrap();
        Api::<LocalSubjectAccessReview>::namespaced(client, made_in)
            .create(&PostParams::default(), &review)
            .await
            .map(|answer| answer.status.expect("a status").allowed)
    };
    let asker = "system:serviceaccount:ops:asker";
    api.grant(
        asker,
        vec![Grant {
            namespace: Some("apps".into()),
            rule: json!({"apiGroups": ["authorization.k8s.io"],
                         "resources": ["localsubjectaccessreviews"], "verbs": ["create"]}),
        }],
    );
    assert!(local(api.client_as(asker), "apps", "apps").await.unwrap());
    forbidden(local(api.client_as(asker), "shared", "shared").await);
    match local(api.client_as(asker), "apps", "shared").await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 422, "{status:?}"),
        other => panic!("a review about another namespace was answered: {other:?}"),
    }
}

/// Lists and watches honour equality-based and existence label selectors; empty metadata
/// lists are stored as absent (`omitempty`), so a JSON patch testing for `null` finds it.
#[tokio::test]
async fn label_selectors_filter_and_empty_metadata_lists_are_absent() {
    use futures_util::{StreamExt, TryStreamExt};
    use kube::api::{Patch, PatchParams, WatchEvent, WatchParams};
    let api = InMemoryApiServer::new();
    let labelled = |name: &str, labels: serde_json::Value| {
        let mut object = lease("apps", name);
        object["metadata"]["labels"] = labels;
        object
    };
    api.put(
        LEASES,
        labelled("ours", json!({"app": "leasehold", "tier": "a"})),
    );
    api.put(LEASES, labelled("theirs", json!({"app": "other"})));
    api.put(LEASES, lease("bare", "bare"));
    api.put(LEASES, lease("apps", "bare"));
    let leases = Api::<Lease>::namespaced(api.client(), "apps");
    let names = |list: kube::core::ObjectList<Lease>| {
        let mut names: Vec<String> = list
            .items
            .into_iter()
            .filter_map(|l| l.metadata.name)
            .collect();
        names.sort();
        names
    };
    for (selector, expected) in [
        ("app=leasehold", vec!["ours"]),
        ("app==leasehold,tier=a", vec!["ours"]),
        ("app!=leasehold", vec!["bare", "theirs"]),
        ("app", vec!["ours", "theirs"]),
        ("!app", vec!["bare"]),
        ("app=leasehold,tier=b", vec![]),
    ] {
        let listed = leases
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        assert_eq!(names(listed), expected, "{selector}");
    }
    let mut watch = leases
        .watch(&WatchParams::default().labels("app=leasehold"), "0")
        .await
        .unwrap()
        .boxed();
    api.put(LEASES, labelled("late", json!({"app": "other"})));
    api.put(LEASES, labelled("later", json!({"app": "leasehold"})));
    let mut seen = Vec::new();
    while seen.len() < 2 {
        if let Some(WatchEvent::Added(lease)) = watch.try_next().await.unwrap() {
            seen.push(lease.metadata.name.unwrap());
        }
    }
    assert_eq!(seen, ["ours", "later"]);

    let patch = Patch::Merge(json!({"metadata": {"finalizers": ["x"]}}));
    leases
        .patch("bare", &PatchParams::default(), &patch)
        .await
        .unwrap();
    let patch = Patch::Merge(json!({"metadata": {"finalizers": []}}));
    leases
        .patch("bare", &PatchParams::default(), &patch)
        .await
        .unwrap();
    let stored = api.lease("apps", "bare").unwrap();
    assert!(stored["metadata"].get("finalizers").is_none(), "{stored}");
}

/// A watcher that falls behind by more than the server buffers sees every change all the
/// same: its watch is ended, and it watches again from the last revision it saw (a server that
/// thinned the stream instead would leave objects its clients never hear of).
#[tokio::test]
async fn a_watcher_that_falls_behind_still_sees_every_change() {
    use futures_util::StreamExt;
    use kube::runtime::watcher;
    const BURST: usize = 10_000;
    let api = InMemoryApiServer::new();
    let leases = Api::<Lease>::namespaced(api.client(), "apps");
    let mut events = watcher(leases, watcher::Config::default()).boxed();
    // The initial list (empty) first, then a watch.
    while !matches!(events.next().await, Some(Ok(watcher::Event::InitDone))) {}
    let mut seen = std::collections::BTreeSet::new();
    let mut read_until = async |seen: &mut std::collections::BTreeSet<String>, count: usize| {
        while seen.len() < count {
            match events
                .next()
                .await
                .expect("a watcher ends only when dropped")
            {
                Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                    seen.insert(lease.metadata.name.unwrap());
                }
                Ok(_) => {}
                Err(e) => panic!("watcher: {e}"),
            }
        }
    };
    // The watch is open once a change made after the initial list arrives through it.
    api.put(LEASES, lease("apps", "first"));
    read_until(&mut seen, 1).await;
    // The whole burst lands while the watcher reads nothing.
    for i in 0..BURST {
        api.put(LEASES, lease("apps", &format!("burst-{i}")));
    }
    let all = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        read_until(&mut seen, BURST + 1),
    )
    .await;
    assert!(
        all.is_ok(),
        "the watcher saw {} of the {} Leases",
        seen.len(),
        BURST + 1
    );
}

/// Lists come in pages (`limit`, `continue`, `remainingItemCount`) as the API server serves
/// them; after a compaction, a continue token or a watch from an earlier revision is 410 Gone;
/// a kube-runtime watcher that meets it lists again and misses no object.
#[tokio::test]
async fn lists_come_in_pages_and_compacted_revisions_are_gone() {
    use futures_util::{StreamExt, TryStreamExt};
    use kube::api::{WatchEvent, WatchParams};
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let api = InMemoryApiServer::new();
    for i in 0..7 {
        api.put(LEASES, lease("apps", &format!("l{i}")));
    }
    let leases = Api::<Lease>::namespaced(api.client(), "apps");
    let mut names = Vec::new();
    let mut params = ListParams::default().limit(3);
    let mut pages = 0;
    loop {
        let page = leases.list(&params).await.unwrap();
        pages += 1;
        names.extend(page.items.iter().map(|l| l.metadata.name.clone().unwrap()));
        match page.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => {
                assert_eq!(
                    page.metadata.remaining_item_count,
                    Some(7 - names.len() as i64)
                );
                params = params.continue_token(&token);
            }
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(names, (0..7).map(|i| format!("l{i}")).collect::<Vec<_>>());

    let first = leases.list(&ListParams::default().limit(3)).await.unwrap();
    let before = first.metadata.resource_version.clone().unwrap();
    let token = first.metadata.continue_.clone().unwrap();
    api.put(LEASES, lease("apps", "l7"));
    api.compact();
    match leases
        .list(&ListParams::default().limit(3).continue_token(&token))
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 410, "{status:?}"),
        other => panic!("a continue token from before the compaction was served: {other:?}"),
    }
    let mut events = leases
        .watch(&WatchParams::default(), &before)
        .await
        .unwrap()
        .boxed();
    match events.try_next().await {
        Ok(Some(WatchEvent::Error(status))) => assert_eq!(status.code, 410, "{status:?}"),
        other => panic!("a watch from before the compaction was served: {other:?}"),
    }

    // A watcher in pages of two, resuming from a compacted revision, still sees all eight.
    let (reader, writer) = reflector::store();
    let watch = reflector::reflector(
        writer,
        watcher(leases.clone(), watcher::Config::default().page_size(2)).default_backoff(),
    );
    let driven = tokio::spawn(watch.for_each(|_| async {}));
    reader.wait_until_ready().await.unwrap();
    assert_eq!(reader.state().len(), 8);
    // Its watch ends (the server goes down a moment) and, meanwhile, history is compacted: it
    // watches again from a revision that is gone, gets 410, and lists again.
    api.put(LEASES, lease("apps", "l0"));
    api.set_down(true);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    api.compact();
    api.set_down(false);
    api.put(LEASES, lease("apps", "l8"));
    for _ in 0..500 {
        if reader.state().len() == 9 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(reader.state().len(), 9, "the watcher missed a lease");
    driven.abort();
}

fn distributed_locks(api: &InMemoryApiServer, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "leasehold.dev".into(),
        version: "v1alpha1".into(),
        api_version: "leasehold.dev/v1alpha1".into(),
        kind: "DistributedLock".into(),
        plural: "distributedlocks".into(),
    };
    Api::namespaced_with(api.client(), namespace, &resource)
}

fn status_apply(status: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock", "status": status})
}

/// Each manager's entry in `managedFields`: (manager, operation, subresource).
fn managers(object: &DynamicObject) -> Vec<(String, String, Option<String>)> {
    object
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|e| {
            (
                e.manager.clone().unwrap_or_default(),
                e.operation.clone().unwrap_or_default(),
                e.subresource.clone(),
            )
        })
        .collect()
}

fn condition_types(object: &DynamicObject) -> Vec<String> {
    object.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Server-side apply as Kubernetes documents it: a manager owns what it applied, a field it no
/// longer applies is removed, and a list map (`status.conditions`, by `type`) merges item by
/// item, so another manager's condition survives the operator's apply of the whole status.
#[tokio::test]
async fn an_apply_removes_what_its_manager_dropped_and_merges_conditions_by_type() {
    let api = InMemoryApiServer::new();
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "orders", "namespace": "apps"},
               "spec": {"backend": {"redis": {"endpoints": ["redis:6379"]}}}}),
    );
    let locks = distributed_locks(&api, "apps");
    let operator = PatchParams::apply("leasehold-operator").force();
    let ready = |status: &str| json!({"type": "Ready", "status": status, "reason": "Reconciled"});
    let first =
        status_apply(json!({"holder": "pod-a", "fencingToken": 7, "conditions": [ready("True")]}));
    locks
        .patch_status("orders", &operator, &Patch::Apply(&first))
        .await
        .expect("the operator's apply");
    let audit = status_apply(json!({"conditions": [{"type": "Audited", "status": "True"}]}));
    let other = locks
        .patch_status(
            "orders",
            &PatchParams::apply("auditor"),
            &Patch::Apply(&audit),
        )
        .await
        .expect("another manager's apply of another condition does not conflict");
    assert_eq!(condition_types(&other), ["Ready", "Audited"]);
    assert_eq!(
        managers(&other),
        [
            (
                "leasehold-operator".into(),
                "Apply".into(),
                Some("status".into())
            ),
            ("auditor".into(), "Apply".into(), Some("status".into())),
        ]
    );

    // The holder is gone: the operator's next apply leaves it out, and the field goes.
    let second = status_apply(json!({"fencingToken": 7, "conditions": [ready("False")]}));
    let after = locks
        .patch_status("orders", &operator, &Patch::Apply(&second))
        .await
        .expect("the operator's second apply");
    assert!(
        after.data["status"].get("holder").is_none(),
        "{:?}",
        after.data
    );
    assert_eq!(after.data["status"]["fencingToken"], 7);
    assert_eq!(condition_types(&after), ["Ready", "Audited"]);
    assert_eq!(after.data["status"]["conditions"][0]["status"], "False");

    // A condition the operator no longer applies goes; the auditor's stays.
    let third = status_apply(json!({"fencingToken": 8}));
    let after = locks
        .patch_status("orders", &operator, &Patch::Apply(&third))
        .await
        .expect("the operator's third apply");
    assert_eq!(condition_types(&after), ["Audited"]);
    // The spec was never the status applies' to change.
    assert_eq!(
        after.data["spec"]["backend"]["redis"]["endpoints"][0],
        "redis:6379"
    );
}

/// An apply that would change a field another manager set (by an update or an apply) is a 409
/// `Conflict` naming the manager and the field, and changes nothing; the same value is owned by
/// both; `force` takes the field over.
#[tokio::test]
async fn an_apply_conflicts_with_another_managers_field_unless_forced() {
    let api = InMemoryApiServer::new();
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "orders", "namespace": "apps"}, "spec": {}}),
    );
    let locks = distributed_locks(&api, "apps");
    let editor = PatchParams {
        field_manager: Some("kubectl-edit".into()),
        ..PatchParams::default()
    };
    locks
        .patch_status(
            "orders",
            &editor,
            &Patch::Merge(json!({"status": {"holder": "by-hand"}})),
        )
        .await
        .expect("a merge patch by hand");
    let apply = |holder: &str| status_apply(json!({"holder": holder}));
    let operator = PatchParams::apply("leasehold-operator");
    let refused = locks
        .patch_status("orders", &operator, &Patch::Apply(&apply("pod-a")))
        .await;
    match refused {
        Err(kube::Error::Api(status)) if status.code == 409 && status.reason == "Conflict" => {
            assert_eq!(
                status.message,
                "Apply failed with 1 conflict: conflict with \"kubectl-edit\" using leasehold.dev/v1alpha1: .status.holder"
            );
        }
        other => panic!("not a 409 Conflict: {other:?}"),
    }
    let unchanged = locks.get("orders").await.expect("get");
    assert_eq!(unchanged.data["status"]["holder"], "by-hand");

    let shared = locks
        .patch_status("orders", &operator, &Patch::Apply(&apply("by-hand")))
        .await
        .expect("the same value conflicts with nobody");
    assert_eq!(managers(&shared).len(), 2, "both own the field");

    let forced = locks
        .patch_status(
            "orders",
            &operator.clone().force(),
            &Patch::Apply(&apply("pod-a")),
        )
        .await
        .expect("a forced apply");
    assert_eq!(forced.data["status"]["holder"], "pod-a");
    assert_eq!(
        managers(&forced),
        [(
            "leasehold-operator".into(),
            "Apply".into(),
            Some("status".into())
        )],
        "the editor's only field moved to the operator"
    );
}

/// An apply names its field manager (422 otherwise), and one of an object that does not exist
/// creates it, its fields the applier's.
#[tokio::test]
async fn an_apply_needs_a_field_manager_and_creates_what_is_missing() {
    let api = InMemoryApiServer::new();
    let client = api.client();
    let body = serde_json::to_vec(&lease("apps", "made-by-apply")).unwrap();
    let request = |query: &str| {
        http::Request::patch(format!(
            "/apis/coordination.k8s.io/v1/namespaces/apps/leases/made-by-apply{query}"
        ))
        .header("content-type", "application/apply-patch+yaml")
        .body(body.clone())
        .unwrap()
    };
    match client.request::<serde_json::Value>(request("")).await {
        Err(kube::Error::Api(status)) if status.code == 422 => {
            assert!(
                status.message.contains("fieldManager: Required value"),
                "{}",
                status.message
            );
        }
        other => panic!("not a 422: {other:?}"),
    }
    assert!(api.lease("apps", "made-by-apply").is_none());
    let created: Lease = client
        .request(request("?fieldManager=installer"))
        .await
        .expect("an apply creates");
    assert_eq!(created.metadata.namespace.as_deref(), Some("apps"));
    let entries = created.metadata.managed_fields.unwrap_or_default();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].manager.as_deref(), Some("installer"));
    assert_eq!(entries[0].operation.as_deref(), Some("Apply"));
}

/// What the API server also does around an apply: an apply that changes nothing stores
/// nothing (no new resourceVersion); an item of a list map that another manager still owns a
/// field of keeps its key; an apply's resourceVersion is a precondition and its name must be
/// the URL's; and a resource with a status subresource takes its status through it alone.
#[tokio::test]
async fn no_op_applies_kept_items_preconditions_and_the_status_subresource() {
    let api = InMemoryApiServer::new();
    let locks = distributed_locks(&api, "apps");
    let created: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
        "metadata": {"name": "orders"}, "spec": {"leaseDuration": "15s"},
        "status": {"holder": "made-up"}}))
    .unwrap();
    let created = locks
        .create(&PostParams::default(), &created)
        .await
        .expect("create");
    assert!(
        created.data.get("status").is_none(),
        "a create wrote the status: {:?}",
        created.data
    );

    let operator = PatchParams::apply("leasehold-operator").force();
    let ready = json!({"type": "Ready", "status": "True", "reason": "Reconciled", "message": "ok"});
    let config = status_apply(json!({"conditions": [ready]}));
    let first = locks
        .patch_status("orders", &operator, &Patch::Apply(&config))
        .await
        .expect("apply");
    let again = locks
        .patch_status("orders", &operator, &Patch::Apply(&config))
        .await
        .expect("the same apply");
    assert_eq!(
        first.metadata.resource_version, again.metadata.resource_version,
        "an apply that changed nothing was stored"
    );

    // Another manager takes the Ready condition's message; the operator then stops applying
    // Ready: the item stays for the other manager's field, and keeps its key.
    let editor = PatchParams::apply("editor").force();
    let message = status_apply(json!({"conditions": [{"type": "Ready", "message": "by hand"}]}));
    locks
        .patch_status("orders", &editor, &Patch::Apply(&message))
        .await
        .expect("the editor's apply");
    let after = locks
        .patch_status(
            "orders",
            &operator,
            &Patch::Apply(&status_apply(json!({"holder": "pod-a"}))),
        )
        .await
        .expect("the operator's apply without Ready");
    let conditions = after.data["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(conditions.len(), 1, "{conditions:?}");
    assert_eq!(
        conditions[0]["type"], "Ready",
        "the item lost its key: {conditions:?}"
    );
    assert_eq!(conditions[0]["message"], "by hand");
    assert!(conditions[0].get("reason").is_none(), "{conditions:?}");

    let stale = json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                       "metadata": {"name": "orders", "resourceVersion": "1"},
                       "status": {"holder": "pod-b"}});
    match locks
        .patch_status("orders", &operator, &Patch::Apply(&stale))
        .await
    {
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        other => panic!("a stale resourceVersion was applied: {other:?}"),
    }
    let renamed = json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                         "metadata": {"name": "other"}, "status": {"holder": "pod-b"}});
    match locks
        .patch_status("orders", &operator, &Patch::Apply(&renamed))
        .await
    {
        Err(kube::Error::Api(status)) if status.code == 400 => {}
        other => panic!("an apply named another object: {other:?}"),
    }

    // A replace of the object leaves the status as it was.
    let mut replaced = locks.get("orders").await.expect("get");
    replaced.data["spec"]["leaseDuration"] = json!("30s");
    replaced.data["status"]["holder"] = json!("made-up");
    let replaced = locks
        .replace("orders", &PostParams::default(), &replaced)
        .await
        .expect("replace");
    assert_eq!(replaced.data["spec"]["leaseDuration"], "30s");
    assert_eq!(replaced.data["status"]["holder"], "pod-a");
}
