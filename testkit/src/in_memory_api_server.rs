//! An in-memory Kubernetes API server for namespaced objects (Leases, DistributedLocks,
//! Secrets) and cluster-scoped ones (webhook configurations): the one fake in the test suite, since no API server can run on these machines. It
//! keeps the semantics the Lease driver and the resource followers rely on, so the driver can run
//! the same conformance suite as every other backend:
//!
//! - one `resourceVersion` counter; a PUT whose `resourceVersion` is stale gets 409 Conflict,
//!   a POST of an existing name 409 AlreadyExists, a read of a missing one 404;
//! - list and watch with a `metadata.name` field selector and equality-based label selectors,
//!   replaying every event after the requested `resourceVersion`, so kube-runtime's watcher
//!   works against it unchanged;
//! - a namespace being deleted ([`InMemoryApiServer::terminate_namespace`]) refuses new objects
//!   with the real server's 403, as events and Leases meet it there;
//! - empty `metadata` lists and maps (finalizers, owner references, labels, annotations) are
//!   stored as absent, as the real server's `omitempty` serialization does;
//! - a `DistributedLock`'s `metadata.generation` moves with its spec (and its deletion), not
//!   with its status;
//! - PATCH (JSON patch, merge patch, server-side apply) on objects and on their `status`
//!   subresource, each writing only its part; every write's field manager owns the fields it
//!   set, in `metadata.managedFields`, and an apply conflicts, removes and merges list maps
//!   as the real server's does ([`crate::server_side_apply`]); an apply may create; a delete of an object with finalizers
//!   only marks it, and it goes when the last finalizer is removed; the garbage collector then
//!   deletes what it owned (by `ownerReferences` uid); a foreground deletion
//!   (`propagationPolicy: Foreground`, `kubectl delete --cascade=foreground`, Argo CD's prune)
//!   deletes what the object owns first, while the object itself still waits on its finalizers;
//! - a watch whose client falls more than a buffer behind is ended, never thinned, as the API
//!   server closes a watcher that cannot keep up;
//! - an outage: every request fails as a refused connection and open watches end, while the
//!   stored Leases survive (as they would in the API server's etcd);
//! - RBAC: a client made with [`InMemoryApiServer::client_as`] (or a process whose kubeconfig
//!   token names the user) may do only what [`InMemoryApiServer::grant`] gave that user, as
//!   Kubernetes' RBAC authorizer decides: verb, API group, resource and subresource, resource
//!   names, and the namespace of a RoleBinding. Anything else gets the real server's 403, and
//!   is kept for the test to show ([`InMemoryApiServer::denied`]). A client without a user is
//!   the cluster's administrator.
//!
//! Scripted exchanges (a conflict at one exact moment, a 403) use `tower-test` instead, in the
//! Lease driver's scenario tests.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use crate::server_side_apply as ssa;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// What a PATCH writes through, and as whom.
#[derive(Clone, Copy)]
struct Write<'a> {
    subresource: Option<&'a str>,
    /// The field manager (named by the request, or taken from its user agent).
    manager: &'a str,
    /// Whether the request named its manager, as an apply must.
    manager_given: bool,
    force: bool,
}

/// A collection's address without its namespace: `/apis/coordination.k8s.io/v1/leases`,
/// `/api/v1/secrets`.
type Collection = String;

#[derive(Clone)]
struct Change {
    revision: u64,
    collection: Collection,
    namespace: String,
    name: String,
    kind: &'static str,
    object: Value,
}

/// Rules granted to one user, each either cluster-wide (a ClusterRoleBinding) or inside one
/// namespace (a RoleBinding).
#[derive(Clone, Debug)]
pub struct Grant {
    /// `None`: every namespace, and cluster-scoped resources.
    pub namespace: Option<String>,
    /// One RBAC `PolicyRule`, as JSON: `apiGroups`, `resources`, `verbs`, `resourceNames`.
    pub rule: Value,
}

/// A request as the RBAC authorizer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attributes {
    pub user: String,
    pub verb: String,
    pub group: String,
    /// `leases`, or `distributedlocks/status` for a subresource.
    pub resource: String,
    /// Empty for a cluster-scoped resource.
    pub namespace: String,
    pub name: Option<String>,
}

impl std::fmt::Display for Attributes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} {}",
            self.user, self.verb, self.resource, self.group
        )?;
        if !self.namespace.is_empty() {
            write!(f, " in namespace {}", self.namespace)?;
        }
        if let Some(name) = &self.name {
            write!(f, " named {name}")?;
        }
        Ok(())
    }
}

impl Grant {
    fn allows(&self, request: &Attributes) -> bool {
        let listed = |field: &str, value: &str| {
            self.rule[field].as_array().is_some_and(|values| {
                values
                    .iter()
                    .any(|v| v.as_str() == Some(value) || v.as_str() == Some("*"))
            })
        };
        if let Some(namespace) = &self.namespace
            && *namespace != request.namespace
        {
            return false;
        }
        if !listed("apiGroups", &request.group)
            || !listed("verbs", &request.verb)
            || !listed("resources", &request.resource)
        {
            return false;
        }
        match self.rule["resourceNames"].as_array() {
            Some(names) if !names.is_empty() => request
                .name
                .as_deref()
                .is_some_and(|name| names.iter().any(|n| n.as_str() == Some(name))),
            _ => true,
        }
    }
}

#[derive(Default)]
struct Rbac {
    grants: BTreeMap<String, Vec<Grant>>,
    denied: Vec<Attributes>,
}

#[derive(Default)]
struct Store {
    revision: u64,
    objects: BTreeMap<(Collection, String, String), Value>,
    /// The changes after `compacted`, oldest first.
    history: Vec<Change>,
    /// The revision up to which history is gone, as etcd compacts it: a watch from before it,
    /// or a list continued from a page of before it, is answered 410 Gone.
    compacted: u64,
    /// Namespaces that do not exist ([`InMemoryApiServer::without_namespace`]): creates in them
    /// are refused. Any other namespace is taken to exist.
    missing_namespaces: std::collections::BTreeSet<String>,
}

/// How many changes the history keeps before its older half is compacted away.
const HISTORY_LIMIT: usize = 200_000;

/// Cheap to clone; all clones share one store.
#[derive(Clone)]
pub struct InMemoryApiServer {
    store: Arc<Mutex<Store>>,
    changes: broadcast::Sender<Change>,
    down: watch::Sender<bool>,
    requests: Arc<AtomicU64>,
    /// Requests served by method and resource (`GET leases`, `PATCH distributedlocks/status`).
    requests_by_kind: Arc<Mutex<BTreeMap<String, u64>>>,
    rbac: Arc<Mutex<Rbac>>,
}

impl Default for InMemoryApiServer {
    fn default() -> Self {
        Self::new()
    }
}

impl InMemoryApiServer {
    pub fn new() -> Self {
        Self {
            store: Arc::default(),
            changes: broadcast::channel(4096).0,
            down: watch::channel(false).0,
            requests: Arc::default(),
            requests_by_kind: Arc::default(),
            rbac: Arc::default(),
        }
    }

    /// A client of this server that authenticates as `user` (for a ServiceAccount,
    /// `system:serviceaccount:NAMESPACE:NAME`), so that every request it makes is authorized
    /// against what [`Self::grant`] gave the user, and nothing else.
    pub fn client_as(&self, user: &str) -> kube::Client {
        let server = self.clone();
        let bearer = http::HeaderValue::from_str(&format!("Bearer {user}")).expect("a user name");
        let service = tower::service_fn(move |mut request: Request<kube::client::Body>| {
            let server = server.clone();
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, bearer.clone());
            async move { server.handle(request).await }
        });
        kube::Client::new(service, "default")
    }

    /// Give `user` exactly `grants` (replacing what it had).
    pub fn grant(&self, user: &str, grants: Vec<Grant>) {
        let mut rbac = self.rbac.lock().unwrap();
        rbac.grants.insert(user.to_owned(), grants);
    }

    /// Every request refused by RBAC so far, in order.
    pub fn denied(&self) -> Vec<Attributes> {
        self.rbac.lock().unwrap().denied.clone()
    }

    /// RBAC's decision on a request by `user`: `None` when allowed, else the 403.
    fn authorize(&self, user: &str, request: Attributes) -> Option<Response<Body>> {
        let mut rbac = self.rbac.lock().unwrap();
        let allowed = rbac
            .grants
            .get(user)
            .is_some_and(|grants| grants.iter().any(|grant| grant.allows(&request)));
        if allowed {
            return None;
        }
        let (plural, group) = (request.resource.as_str(), request.group.as_str());
        let what = match &request.name {
            Some(name) if group.is_empty() => format!("{plural} \"{name}\""),
            Some(name) => format!("{plural}.{group} \"{name}\""),
            None if group.is_empty() => plural.to_owned(),
            None => format!("{plural}.{group}"),
        };
        let scope = if request.namespace.is_empty() {
            "at the cluster scope".to_owned()
        } else {
            format!("in the namespace \"{}\"", request.namespace)
        };
        let message = format!(
            "{what} is forbidden: User \"{user}\" cannot {} resource \"{plural}\" in API group \"{group}\" {scope}",
            request.verb
        );
        rbac.denied.push(request);
        Some(status(StatusCode::FORBIDDEN, "Forbidden", &message))
    }

    /// A SubjectAccessReview, or with `local` a LocalSubjectAccessReview made in that namespace
    /// (about that namespace only): whether `spec.user` (or one of `spec.groups`) may do what
    /// `spec.resourceAttributes` names, by the grants given. Nothing is stored, as on a real API
    /// server. Until any grant is given the server authorizes everything (as it does requests
    /// that carry no user), so every review is allowed then. (Requests themselves are
    /// authorized by their user alone: a client here carries no groups.)
    fn review_access(&self, body: &[u8], local: Option<&str>) -> Response<Body> {
        let Ok(mut review) = serde_json::from_slice::<Value>(body) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the body is not JSON",
            );
        };
        let spec = &review["spec"];
        let attributes = &spec["resourceAttributes"];
        let user = spec["user"].as_str().unwrap_or_default();
        let groups = spec["groups"].as_array().cloned().unwrap_or_default();
        let (Some(verb), Some(resource)) =
            (attributes["verb"].as_str(), attributes["resource"].as_str())
        else {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "spec.resourceAttributes.verb and .resource are required",
            );
        };
        if user.is_empty() && groups.is_empty() {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "at least one of user or group must be specified",
            );
        }
        let asked_in = attributes["namespace"].as_str().unwrap_or_default();
        if let Some(local) = local
            && !asked_in.is_empty()
            && asked_in != local
        {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "spec.resourceAttributes.namespace must match metadata.namespace",
            );
        }
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let resource = match attributes["subresource"].as_str() {
            Some(sub) if !sub.is_empty() => format!("{resource}/{sub}"),
            _ => resource.to_owned(),
        };
        let request = Attributes {
            user: user.to_owned(),
            verb: verb.to_owned(),
            group: text(&attributes["group"]),
            resource,
            namespace: local.map_or_else(|| asked_in.to_owned(), str::to_owned),
            name: attributes["name"]
                .as_str()
                .filter(|n| !n.is_empty())
                .map(str::to_owned),
        };
        let subjects: Vec<String> = std::iter::once(user.to_owned())
            .filter(|user| !user.is_empty())
            .chain(groups.iter().filter_map(|g| g.as_str().map(str::to_owned)))
            .collect();
        let rbac = self.rbac.lock().unwrap();
        let allowed = rbac.grants.is_empty()
            || subjects.iter().any(|subject| {
                rbac.grants
                    .get(subject)
                    .is_some_and(|grants| grants.iter().any(|grant| grant.allows(&request)))
            });
        review["status"] = if allowed {
            json!({"allowed": true, "reason": "allowed by the grants given"})
        } else {
            json!({"allowed": false, "reason": ""})
        };
        json_response(StatusCode::CREATED, &review)
    }

    /// A client of this server, as a separate process would have (its own connection pool).
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.clone().service(), "default")
    }

    /// Serve this API as [`Self::listen`] does, and write a kubeconfig naming it (as an
    /// anonymous user, `namespace` the default) to `path`, for a process given
    /// `KUBECONFIG=path`. The address served.
    pub async fn listen_with_kubeconfig(
        &self,
        path: &std::path::Path,
        namespace: &str,
    ) -> std::net::SocketAddr {
        let addr = self.listen().await;
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: test\n\
                 clusters: [{{name: test, cluster: {{server: \"http://{addr}\"}}}}]\n\
                 users: [{{name: test, user: {{}}}}]\n\
                 contexts: [{{name: test, context: {{cluster: test, user: test, namespace: {namespace}}}}}]\n"
            ),
        )
        .expect("a kubeconfig");
        addr
    }

    /// Serve this API over plain HTTP on a free loopback port, for another process (the operator
    /// binary, with a kubeconfig naming `http://ADDR`). Serves until the runtime ends.
    pub async fn listen(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().unwrap();
        let server = self.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let server = server.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |request: Request<hyper::body::Incoming>| {
                            let server = server.clone();
                            async move { server.handle(request).await }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        addr
    }

    /// Refuse every request and end open watches (`true`), or serve again (`false`).
    pub fn set_down(&self, down: bool) {
        self.down.send_replace(down);
    }

    /// How many requests have been served (for cost checks).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// [`requests`](Self::requests) once none has come for half a second: the calls a change
    /// set off (a status write, its Event, the reconcile they bring) are over by then, on a
    /// machine however loaded.
    pub async fn settled_requests(&self) -> u64 {
        let since = std::time::Instant::now();
        let mut before = self.requests();
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            let now = self.requests();
            if now == before {
                return now;
            }
            assert!(
                since.elapsed() < std::time::Duration::from_secs(30),
                "the API server's clients never went quiet"
            );
            before = now;
        }
    }

    /// How many requests were served, by method and resource (`GET leases`, `WATCH leases`,
    /// `PATCH distributedlocks/status`).
    pub fn requests_by_kind(&self) -> BTreeMap<String, u64> {
        self.requests_by_kind.lock().unwrap().clone()
    }

    /// The service behind [`InMemoryApiServer::client`], for a client with layers of its own
    /// (`api.clone().service()`).
    pub fn service(
        self,
    ) -> impl tower::Service<
        Request<kube::client::Body>,
        Response = Response<Body>,
        Error = std::io::Error,
        Future = impl Future<Output = Result<Response<Body>, std::io::Error>> + Send,
    > + Clone
    + Send {
        let server = self;
        tower::service_fn(move |request: Request<kube::client::Body>| {
            let server = server.clone();
            async move { server.handle(request).await }
        })
    }

    /// The stored Lease, as JSON.
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        self.object(LEASES, namespace, name)
    }

    /// A stored object of `collection` (e.g. [`LEASES`]), as JSON.
    pub fn object(&self, collection: &str, namespace: &str, name: &str) -> Option<Value> {
        let store = self.store.lock().unwrap();
        store
            .objects
            .get(&(collection.to_owned(), namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Every stored object of `collection` (e.g. [`EVENTS`]), in every namespace, as JSON.
    pub fn objects(&self, collection: &str) -> Vec<Value> {
        let store = self.store.lock().unwrap();
        store
            .objects
            .iter()
            .filter(|((c, _, _), _)| c == collection)
            .map(|(_, object)| object.clone())
            .collect()
    }

    /// Start deleting namespace `ns`, as `kubectl delete namespace` does while its objects still
    /// have finalizers: from now on every new object in it is refused (403, cause
    /// `NamespaceTerminating`), while existing ones can still be read, updated and deleted.
    pub fn terminate_namespace(&self, ns: &str) {
        self.put(
            NAMESPACES,
            json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "deletionTimestamp": "2026-01-01T00:00:00Z"},
                "status": {"phase": "Terminating"},
            }),
        );
    }

    /// Namespace `ns` does not exist (deleted, or never made): from now on every create in it
    /// is refused with 404, as a real API server refuses it.
    pub fn without_namespace(&self, ns: &str) {
        self.store
            .lock()
            .unwrap()
            .missing_namespaces
            .insert(ns.to_owned());
    }

    /// Create or overwrite `object` (namespace and name from its metadata) in `collection`, as
    /// `kubectl apply` would, telling the watchers.
    pub fn put(&self, collection: &str, object: Value) {
        // Cluster-scoped objects have no namespace and are stored under "".
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        let mut store = self.store.lock().unwrap();
        let key = (collection.to_owned(), ns.clone(), name.clone());
        let kind = if store.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let mut object = object;
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = json!(format!("uid-{ns}-{name}"));
        }
        self.commit(&mut store, collection, &ns, &name, kind, object);
    }

    /// Delete an object as `kubectl delete` would: with finalizers it is only marked, and goes
    /// when the last one is removed. `false` if there was no such object.
    pub fn remove(&self, collection: &str, namespace: &str, name: &str) -> bool {
        self.delete(collection, namespace, name, b"").status() == StatusCode::OK
    }

    async fn handle<B>(&self, request: Request<B>) -> Result<Response<Body>, std::io::Error>
    where
        B: http_body::Body,
        B::Error: std::fmt::Display,
    {
        if *self.down.borrow() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "the fake API server is down",
            ));
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        let (parts, body) = request.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))?
            .to_bytes();
        let path = parts.uri.path().to_owned();
        let query: BTreeMap<String, String> = parts
            .uri
            .query()
            .map(|q| {
                url::form_urlencoded::parse(q.as_bytes())
                    .into_owned()
                    .collect()
            })
            .unwrap_or_default();
        if path == "/version" {
            return Ok(json_response(StatusCode::OK, &version()));
        }
        let Some(route) = Route::parse(&path) else {
            return Ok(status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("no route {path}"),
            ));
        };
        let (c, ns) = (route.collection.as_str(), route.namespace.as_str());
        // The field manager: named by the request, or the client's user agent as the API
        // server takes it (up to the first `/`).
        let manager = query.get("fieldManager").cloned().unwrap_or_else(|| {
            parts
                .headers
                .get(http::header::USER_AGENT)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split('/').next())
                .filter(|v| !v.is_empty())
                .unwrap_or("unknown")
                .to_owned()
        });
        let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
        {
            let plural = c.rsplit('/').next().unwrap_or_default();
            // A GET of one object at `resourceVersion=0` is served from the API server's
            // cache, not read from etcd with a quorum: told apart, since they cost apart.
            let cached = parts.method == http::Method::GET
                && route.name.is_some()
                && query.get("resourceVersion").is_some_and(|v| v == "0");
            let kind = match (&route.subresource, watch) {
                (Some(sub), _) => format!("{} {plural}/{sub}", parts.method),
                (None, true) => format!("WATCH {plural}"),
                (None, false) if cached => format!("GET {plural} from the cache"),
                (None, false) => format!("{} {plural}", parts.method),
            };
            *self
                .requests_by_kind
                .lock()
                .unwrap()
                .entry(kind)
                .or_default() += 1;
        }
        let user = parts
            .headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(user) = user {
            let verb = match (&parts.method, route.name.is_some()) {
                (&Method::GET, true) => "get",
                (&Method::GET, false) if watch => "watch",
                (&Method::GET, false) => "list",
                (&Method::POST, _) => "create",
                (&Method::PUT, _) => "update",
                (&Method::PATCH, _) => "patch",
                (&Method::DELETE, true) => "delete",
                (&Method::DELETE, false) => "deletecollection",
                _ => "unknown",
            };
            let segments: Vec<&str> = c.trim_start_matches('/').split('/').collect();
            let group = match segments.as_slice() {
                ["apis", group, ..] => *group,
                _ => "",
            };
            let plural = segments.last().copied().unwrap_or_default();
            let resource = match &route.subresource {
                Some(sub) => format!("{plural}/{sub}"),
                None => plural.to_owned(),
            };
            // A list or watch of one name (a field selector) is authorized for that name, as
            // the real authorizer does.
            let name = route.name.clone().or_else(|| name_selector(&query));
            let attributes = Attributes {
                user: user.to_owned(),
                verb: verb.to_owned(),
                group: group.to_owned(),
                resource,
                namespace: ns.to_owned(),
                name,
            };
            if let Some(forbidden) = self.authorize(user, attributes) {
                return Ok(forbidden);
            }
        }
        let response = match (&parts.method, route.name.as_deref()) {
            (&Method::POST, None) if c == SUBJECT_ACCESS_REVIEWS => self.review_access(&body, None),
            (&Method::POST, None) if c == LOCAL_SUBJECT_ACCESS_REVIEWS => {
                self.review_access(&body, Some(ns))
            }
            (&Method::GET, None) if watch => self.watch(c, ns, name_selector(&query), &query),
            (&Method::GET, None) => self.list(
                c,
                ns,
                name_selector(&query).as_deref(),
                &LabelSelector::of(&query),
                &query,
            ),
            (&Method::POST, None) => self.create(c, ns, &body, &manager),
            (&Method::GET, Some(name)) => match self.object(c, ns, name) {
                Some(object) => json_response(StatusCode::OK, &object),
                None => not_found(name),
            },
            (&Method::PUT, Some(name)) => {
                self.replace(c, ns, name, route.subresource.as_deref(), &body, &manager)
            }
            (&Method::PATCH, Some(name)) => {
                let content_type = parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                let write = Write {
                    subresource: route.subresource.as_deref(),
                    manager: &manager,
                    force: query.get("force").is_some_and(|f| f == "true"),
                    manager_given: query.contains_key("fieldManager"),
                };
                self.patch(c, ns, name, write, content_type, &body)
            }
            (&Method::DELETE, Some(name)) => self.delete(c, ns, name, &body),
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                &format!("{} {path}", parts.method),
            ),
        };
        Ok(response)
    }

    /// Store `object` under a new revision and tell the watchers, under one lock so a watch that
    /// replays history and then subscribes misses nothing.
    fn commit(
        &self,
        store: &mut Store,
        collection: &str,
        ns: &str,
        name: &str,
        kind: &'static str,
        mut object: Value,
    ) -> Value {
        store.revision += 1;
        object["metadata"]["resourceVersion"] = json!(store.revision.to_string());
        // ObjectMeta's lists and maps are `omitempty`: an empty one is stored as absent, so a
        // JSON patch that tests for `null` (kube-runtime's finalizer helper) sees what it would.
        if let Some(metadata) = object["metadata"].as_object_mut() {
            metadata.retain(|field, value| {
                !(matches!(
                    field.as_str(),
                    "finalizers" | "ownerReferences" | "labels" | "annotations"
                ) && (value.is_null()
                    || value.as_array().is_some_and(Vec::is_empty)
                    || value.as_object().is_some_and(serde_json::Map::is_empty)))
            });
        }
        let key = (collection.to_owned(), ns.to_owned(), name.to_owned());
        // A custom resource's generation starts at 1 and moves when its spec changes or its
        // deletion starts, never for its status: what the sidecar and the operator go by.
        if collection == DISTRIBUTED_LOCKS && kind != "DELETED" {
            let previous = store.objects.get(&key);
            let generation = match previous {
                None => 1,
                Some(p) => {
                    let before = p["metadata"]["generation"].as_i64().unwrap_or(1);
                    let deleting = p["metadata"]["deletionTimestamp"].is_null()
                        && !object["metadata"]["deletionTimestamp"].is_null();
                    if p["spec"] != object["spec"] || deleting {
                        before + 1
                    } else {
                        before
                    }
                }
            };
            object["metadata"]["generation"] = json!(generation);
        }
        if kind == "DELETED" {
            store.objects.remove(&key);
        } else {
            store.objects.insert(key, object.clone());
        }
        let change = Change {
            revision: store.revision,
            collection: collection.to_owned(),
            namespace: ns.to_owned(),
            name: name.to_owned(),
            kind,
            object: object.clone(),
        };
        store.history.push(change.clone());
        if store.history.len() > HISTORY_LIMIT {
            let gone: Vec<Change> = store.history.drain(..HISTORY_LIMIT / 2).collect();
            store.compacted = gone.last().map_or(store.compacted, |c| c.revision);
        }
        let _ = self.changes.send(change);
        object
    }

    /// Compact the history up to now, as etcd does every few minutes: a watch from an earlier
    /// revision, or a list continued from an earlier page, is answered 410 Gone (the client
    /// lists again).
    pub fn compact(&self) {
        let mut store = self.store.lock().unwrap();
        store.compacted = store.revision;
        store.history.clear();
    }

    fn create(&self, collection: &str, ns: &str, body: &[u8], manager: &str) -> Response<Body> {
        let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the body is not JSON",
            );
        };
        let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name is required",
            );
        };
        if let Some(refused) = invalid_name(&name) {
            return refused;
        }
        let mut store = self.store.lock().unwrap();
        if store
            .objects
            .get(&(NAMESPACES.to_owned(), String::new(), ns.to_owned()))
            .is_some_and(|n| !n["metadata"]["deletionTimestamp"].is_null())
        {
            return namespace_terminating(collection, ns);
        }
        if store.missing_namespaces.contains(ns) {
            return namespace_not_found(ns);
        }
        if store
            .objects
            .contains_key(&(collection.to_owned(), ns.to_owned(), name.clone()))
        {
            return status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("\"{name}\" already exists"),
            );
        }
        if !ns.is_empty() {
            object["metadata"]["namespace"] = json!(ns);
        }
        object["metadata"]["uid"] = json!(format!("uid-{ns}-{name}-{}", store.revision + 1));
        object["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        if let Some(metadata) = object["metadata"].as_object_mut() {
            metadata.remove("managedFields");
        }
        // A resource with a status subresource is created without one: the status is written
        // through the subresource alone.
        if collection == DISTRIBUTED_LOCKS
            && let Some(fields) = object.as_object_mut()
        {
            fields.remove("status");
        }
        ssa::record_update(&Value::Null, &mut object, manager, ssa::Scope::Object);
        let object = self.commit(&mut store, collection, ns, &name, "ADDED", object);
        json_response(StatusCode::CREATED, &object)
    }

    fn replace(
        &self,
        collection: &str,
        ns: &str,
        name: &str,
        subresource: Option<&str>,
        body: &[u8],
        manager: &str,
    ) -> Response<Body> {
        let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the body is not JSON",
            );
        };
        let mut store = self.store.lock().unwrap();
        let Some(current) =
            store
                .objects
                .get(&(collection.to_owned(), ns.to_owned(), name.to_owned()))
        else {
            return not_found(name);
        };
        let sent = object["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_owned);
        if sent.is_some() && sent.as_deref() != current["metadata"]["resourceVersion"].as_str() {
            return modified_since(name);
        }
        for field in ["uid", "creationTimestamp", "namespace", "managedFields"] {
            object["metadata"][field] = current["metadata"][field].clone();
        }
        // With a status subresource, a replace of the object keeps the status, and one of the
        // status keeps everything else.
        if collection == DISTRIBUTED_LOCKS {
            if subresource == Some("status") {
                let status = object["status"].take();
                object = current.clone();
                object["status"] = status;
            } else {
                object["status"] = current["status"].clone();
            }
            if object["status"].is_null()
                && let Some(fields) = object.as_object_mut()
            {
                fields.remove("status");
            }
        }
        let current = current.clone();
        ssa::record_update(&current, &mut object, manager, ssa::Scope::of(subresource));
        let object = self.commit(&mut store, collection, ns, name, "MODIFIED", object);
        json_response(StatusCode::OK, &object)
    }

    /// A JSON patch, a merge patch, or a server-side apply ([`crate::server_side_apply`]). On
    /// the `status` subresource only the status changes, and on the object itself everything
    /// but the status, as with a real API server; the resourceVersion moves either way.
    fn patch(
        &self,
        collection: &str,
        ns: &str,
        name: &str,
        write: Write<'_>,
        content_type: &str,
        body: &[u8],
    ) -> Response<Body> {
        let subresource = write.subresource;
        let content_type = content_type.split(';').next().unwrap_or_default();
        if content_type == "application/apply-patch+yaml" {
            return self.apply(collection, ns, name, write, body);
        }
        let mut store = self.store.lock().unwrap();
        let Some(current) = store
            .objects
            .get(&(collection.to_owned(), ns.to_owned(), name.to_owned()))
            .cloned()
        else {
            return not_found(name);
        };
        let mut patched = current.clone();
        let applied = match content_type {
            "application/json-patch+json" => serde_json::from_slice::<Vec<Value>>(body)
                .map(|ops| {
                    // The API server's JSON patch takes a missing field for a `null` one, as
                    // `test` ops of kube's finalizer helper expect.
                    ops.into_iter()
                        .filter(|op| {
                            !(op["op"] == "test"
                                && op["value"].is_null()
                                && op["path"]
                                    .as_str()
                                    .is_some_and(|path| patched.pointer(path).is_none()))
                        })
                        .collect::<Vec<Value>>()
                })
                .and_then(|ops| serde_json::from_value::<json_patch::Patch>(Value::Array(ops)))
                .map_err(|e| e.to_string())
                .and_then(|p| json_patch::patch(&mut patched, &p).map_err(|e| e.to_string())),
            "application/merge-patch+json" => serde_json::from_slice::<Value>(body)
                .map(|p| json_patch::merge(&mut patched, &p))
                .map_err(|e| e.to_string()),
            other => Err(format!("unsupported patch type {other:?}")),
        };
        if let Err(e) = applied {
            return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &e);
        }
        let mut object = current.clone();
        match subresource {
            Some("status") => object["status"] = patched["status"].take(),
            Some(other) => {
                return status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    &format!("no subresource {other}"),
                );
            }
            None => {
                let kept = current["status"].clone();
                object = patched;
                object["status"] = kept;
            }
        }
        for field in [
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "managedFields",
        ] {
            object["metadata"][field] = current["metadata"][field].clone();
        }
        ssa::record_update(
            &current,
            &mut object,
            write.manager,
            ssa::Scope::of(subresource),
        );
        self.commit_patched(&mut store, collection, ns, name, object)
    }

    /// A server-side apply: conflicts refused (409) unless forced, an object created when
    /// there is none (not through a subresource).
    fn apply(
        &self,
        collection: &str,
        ns: &str,
        name: &str,
        write: Write<'_>,
        body: &[u8],
    ) -> Response<Body> {
        if !write.manager_given {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
            );
        }
        let Ok(config) = serde_json::from_slice::<Value>(body) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the apply configuration is not JSON",
            );
        };
        let scope = ssa::Scope::of(write.subresource);
        if !matches!(write.subresource, None | Some("status")) {
            return status(StatusCode::NOT_FOUND, "NotFound", "no such subresource");
        }
        if !config["apiVersion"].is_string() || !config["kind"].is_string() {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "an apply configuration names its apiVersion and kind",
            );
        }
        if config["metadata"]["name"]
            .as_str()
            .is_some_and(|sent| sent != name)
        {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the name in the apply configuration does not match the name in the URL",
            );
        }
        let mut store = self.store.lock().unwrap();
        let key = (collection.to_owned(), ns.to_owned(), name.to_owned());
        let Some(current) = store.objects.get(&key).cloned() else {
            if scope == ssa::Scope::Status {
                return not_found(name);
            }
            let mut object = json!({"metadata": {"name": name}});
            for field in ["apiVersion", "kind"] {
                object[field] = config[field].clone();
            }
            return match ssa::apply(&object, &config, write.manager, scope, true) {
                Ok(created) => self.create_applied(&mut store, collection, ns, name, created),
                Err(_) => unreachable!("a forced apply has no conflicts"),
            };
        };
        let sent = &config["metadata"]["resourceVersion"];
        if sent.is_string() && *sent != current["metadata"]["resourceVersion"] {
            return modified_since(name);
        }
        match ssa::apply(&current, &config, write.manager, scope, write.force) {
            Ok(mut object) => {
                for field in ["uid", "creationTimestamp", "namespace", "name"] {
                    object["metadata"][field] = current["metadata"][field].clone();
                }
                self.commit_patched(&mut store, collection, ns, name, object)
            }
            Err(conflicts) => {
                let causes: Vec<Value> = conflicts
                    .iter()
                    .map(|c| {
                        json!({
                            "reason": "FieldManagerConflict",
                            "message": format!("conflict with {:?} using {}", c.manager, c.api_version),
                            "field": ssa::show(&c.path),
                        })
                    })
                    .collect();
                let listed: Vec<String> = conflicts
                    .iter()
                    .map(|c| {
                        format!(
                            "conflict with {:?} using {}: {}",
                            c.manager,
                            c.api_version,
                            ssa::show(&c.path)
                        )
                    })
                    .collect();
                let message = format!(
                    "Apply failed with {} conflict{}: {}",
                    conflicts.len(),
                    if conflicts.len() == 1 { "" } else { "s" },
                    listed.join("\n")
                );
                let body = json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "message": message, "reason": "Conflict",
                    "details": {"causes": causes}, "code": 409,
                });
                json_response(StatusCode::CONFLICT, &body)
            }
        }
    }

    /// The first apply of an object that does not exist: created, its fields the applier's.
    fn create_applied(
        &self,
        store: &mut Store,
        collection: &str,
        ns: &str,
        name: &str,
        mut object: Value,
    ) -> Response<Body> {
        if let Some(refused) = invalid_name(name) {
            return refused;
        }
        if store
            .objects
            .get(&(NAMESPACES.to_owned(), String::new(), ns.to_owned()))
            .is_some_and(|n| !n["metadata"]["deletionTimestamp"].is_null())
        {
            return namespace_terminating(collection, ns);
        }
        if store.missing_namespaces.contains(ns) {
            return namespace_not_found(ns);
        }
        if !ns.is_empty() {
            object["metadata"]["namespace"] = json!(ns);
        }
        object["metadata"]["uid"] = json!(format!("uid-{ns}-{name}-{}", store.revision + 1));
        object["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        let object = self.commit(store, collection, ns, name, "ADDED", object);
        json_response(StatusCode::CREATED, &object)
    }

    /// Store a patched object; one being deleted goes once its last finalizer has.
    fn commit_patched(
        &self,
        store: &mut Store,
        collection: &str,
        ns: &str,
        name: &str,
        object: Value,
    ) -> Response<Body> {
        // A write that changes nothing is not stored: no new resourceVersion, no event.
        if let Some(current) =
            store
                .objects
                .get(&(collection.to_owned(), ns.to_owned(), name.to_owned()))
        {
            let mut unchanged = object.clone();
            unchanged["metadata"]["resourceVersion"] =
                current["metadata"]["resourceVersion"].clone();
            if unchanged == *current {
                return json_response(StatusCode::OK, current);
            }
        }
        // The API server deletes an object being deleted once its last finalizer goes.
        let finalized = !object["metadata"]["deletionTimestamp"].is_null()
            && object["metadata"]["finalizers"]
                .as_array()
                .is_none_or(|f| f.is_empty());
        let kind = if finalized { "DELETED" } else { "MODIFIED" };
        let object = self.commit(store, collection, ns, name, kind, object);
        if finalized {
            self.collect_garbage(store);
        }
        json_response(StatusCode::OK, &object)
    }

    fn delete(&self, collection: &str, ns: &str, name: &str, body: &[u8]) -> Response<Body> {
        let mut store = self.store.lock().unwrap();
        let Some(current) = store
            .objects
            .get(&(collection.to_owned(), ns.to_owned(), name.to_owned()))
            .cloned()
        else {
            return not_found(name);
        };
        // DeleteOptions' preconditions: the object is deleted only as it was read.
        let options: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        for field in ["resourceVersion", "uid"] {
            let wanted = &options["preconditions"][field];
            if !wanted.is_null() && wanted != &current["metadata"][field] {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!("precondition failed: {field} {wanted} does not match"),
                );
            }
        }
        if options["propagationPolicy"] == "Foreground"
            && let Some(uid) = current["metadata"]["uid"].as_str()
        {
            self.delete_dependents(&mut store, uid);
        }
        // With finalizers, a delete only marks the object; it goes when the last one is removed.
        if current["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty())
        {
            if !current["metadata"]["deletionTimestamp"].is_null() {
                return json_response(StatusCode::OK, &current);
            }
            let mut marked = current;
            marked["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            let object = self.commit(&mut store, collection, ns, name, "MODIFIED", marked);
            return json_response(StatusCode::OK, &object);
        }
        let object = self.commit(&mut store, collection, ns, name, "DELETED", current);
        self.collect_garbage(&mut store);
        json_response(StatusCode::OK, &object)
    }

    /// A foreground deletion's first step: what names `owner` (by uid) among its owners is
    /// deleted, and so on down the chain, before the owner goes.
    fn delete_dependents(&self, store: &mut Store, owner: &str) {
        let dependents: Vec<_> = store
            .objects
            .iter()
            .filter(|(_, object)| {
                object["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|owners| owners.iter().any(|o| o["uid"] == owner))
            })
            .map(|(key, object)| (key.clone(), object.clone()))
            .collect();
        for ((collection, ns, name), object) in dependents {
            if let Some(uid) = object["metadata"]["uid"].as_str() {
                self.delete_dependents(store, uid);
            }
            self.commit(store, &collection, &ns, &name, "DELETED", object);
        }
    }

    /// The garbage collector: objects whose every owner (by uid) is gone are deleted, and so on
    /// down the chain.
    fn collect_garbage(&self, store: &mut Store) {
        loop {
            let uids: std::collections::BTreeSet<String> = store
                .objects
                .values()
                .filter_map(|o| o["metadata"]["uid"].as_str().map(str::to_owned))
                .collect();
            let orphan = store.objects.iter().find_map(|(key, object)| {
                let owners = object["metadata"]["ownerReferences"].as_array()?;
                let orphaned = !owners.is_empty()
                    && owners
                        .iter()
                        .all(|o| o["uid"].as_str().is_none_or(|uid| !uids.contains(uid)));
                orphaned.then(|| (key.clone(), object.clone()))
            });
            let Some(((collection, ns, name), object)) = orphan else {
                return;
            };
            self.commit(store, &collection, &ns, &name, "DELETED", object);
        }
    }

    /// A list, in pages when `limit` is given: each page ends with a `continue` token (and
    /// `remainingItemCount`) while more remain. A continued page comes from the objects as they
    /// are now, after the last one sent (a real server serves every page from the first page's
    /// revision); a token from before a compaction is answered 410 Gone, as a real server does.
    fn list(
        &self,
        collection: &str,
        ns: &str,
        name: Option<&str>,
        labels: &LabelSelector,
        query: &BTreeMap<String, String>,
    ) -> Response<Body> {
        let store = self.store.lock().unwrap();
        let limit = query
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0);
        let (revision, after) = match query.get("continue").filter(|c| !c.is_empty()) {
            None => (store.revision, None),
            Some(token) => match Continue::decode(token) {
                None => {
                    return status(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        "continue key is not valid",
                    );
                }
                Some(token) if token.revision < store.compacted => {
                    return status(
                        StatusCode::GONE,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent \
                         list result. You can start a new list without the continue parameter.",
                    );
                }
                Some(token) => (token.revision, Some((token.namespace, token.name))),
            },
        };
        let mut matching = store
            .objects
            .iter()
            // No namespace in the path: every namespace (and the cluster-scoped objects).
            .filter(|((c, n, object_name), object)| {
                c == collection
                    && (ns.is_empty() || n == ns)
                    && name.is_none_or(|name| name == object_name)
                    && labels.matches(object)
            })
            .filter(|((_, n, object_name), _)| {
                after
                    .as_ref()
                    .is_none_or(|(a_ns, a_name)| (n, object_name) > (a_ns, a_name))
            });
        let items: Vec<Value> = matching
            .by_ref()
            .take(limit.unwrap_or(usize::MAX))
            .map(|(_, object)| object.clone())
            .collect();
        let remaining = matching.count();
        let mut metadata = json!({"resourceVersion": revision.to_string()});
        if remaining > 0
            && let Some(last) = items.last()
        {
            let token = Continue {
                revision,
                namespace: last["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                name: last["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            };
            metadata["continue"] = json!(token.encode());
            metadata["remainingItemCount"] = json!(remaining);
        }
        json_response(
            StatusCode::OK,
            &json!({
                "apiVersion": "v1",
                "kind": "List",
                "metadata": metadata,
                "items": items,
            }),
        )
    }

    fn watch(
        &self,
        collection: &str,
        ns: &str,
        name: Option<String>,
        query: &BTreeMap<String, String>,
    ) -> Response<Body> {
        let since: u64 = query
            .get("resourceVersion")
            .and_then(|rv| rv.parse().ok())
            .unwrap_or(0);
        let (replay, live) = {
            let store = self.store.lock().unwrap();
            if since != 0 && since < store.compacted {
                // As the API server says it: an ERROR event in the stream, then its end.
                let gone = json!({"type": "ERROR", "object": {
                    "apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "Expired", "code": 410,
                    "message": format!("too old resource version: {since} ({})", store.compacted),
                }});
                let mut line = serde_json::to_vec(&gone).unwrap();
                line.push(b'\n');
                let frames = futures_util::stream::iter([Ok::<_, Infallible>(
                    http_body::Frame::data(Bytes::from(line)),
                )]);
                return Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", "application/json")
                    .body(StreamBody::new(frames).boxed_unsync())
                    .unwrap();
            }
            let replay: Vec<Change> = if since == 0 {
                // No revision: every object as it is now, as ADDED, then the changes.
                let mut now: Vec<Change> = store
                    .objects
                    .iter()
                    .map(|((collection, namespace, name), object)| Change {
                        revision: object["metadata"]["resourceVersion"]
                            .as_str()
                            .and_then(|rv| rv.parse().ok())
                            .unwrap_or(0),
                        collection: collection.clone(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                        kind: "ADDED",
                        object: object.clone(),
                    })
                    .collect();
                now.sort_by_key(|c| c.revision);
                now
            } else {
                store
                    .history
                    .iter()
                    .filter(|c| c.revision > since)
                    .cloned()
                    .collect()
            };
            (replay, self.changes.subscribe())
        };
        let (collection, ns) = (collection.to_owned(), ns.to_owned());
        // An object outside the selector is not sent (a real server would also send DELETED
        // for an object whose labels stop matching; nothing here relabels objects).
        let labels = LabelSelector::of(query);
        let matches = move |c: &Change| {
            c.collection == collection
                && (ns.is_empty() || c.namespace == ns)
                && name.as_deref().is_none_or(|n| n == c.name)
                && labels.matches(&c.object)
        };
        // A watcher that falls more than the buffer behind has its watch ended, as the API
        // server closes a watch whose client cannot keep up: the client watches again from
        // the last revision it saw and misses nothing. Dropping the changes it fell behind
        // on instead would lose them for good.
        let live = tokio_stream::wrappers::BroadcastStream::new(live)
            .take_while(|c| std::future::ready(c.is_ok()))
            .filter_map(|c| async move { c.ok() });
        let mut down = self.down.subscribe();
        let until_down = async move {
            let _ = down.wait_for(|d| *d).await;
        };
        let lines = futures_util::stream::iter(replay)
            .chain(live)
            .filter(move |c| std::future::ready(matches(c)))
            .map(|c| {
                let mut line =
                    serde_json::to_vec(&json!({"type": c.kind, "object": c.object})).unwrap();
                line.push(b'\n');
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(line)))
            })
            .take_until(Box::pin(until_down));
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(StreamBody::new(lines).boxed_unsync())
            .unwrap()
    }
}

/// A list's `continue` token: the first page's revision and the last object sent, as text.
struct Continue {
    revision: u64,
    namespace: String,
    name: String,
}

impl Continue {
    /// Hex of `REVISION/NAMESPACE/NAME` (names hold no `/`): opaque to clients, as the API's is.
    fn encode(&self) -> String {
        format!("{}/{}/{}", self.revision, self.namespace, self.name)
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn decode(token: &str) -> Option<Self> {
        let bytes: Option<Vec<u8>> = (0..token.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
            .collect();
        let text = String::from_utf8(bytes?).ok()?;
        let mut parts = text.splitn(3, '/');
        Some(Self {
            revision: parts.next()?.parse().ok()?,
            namespace: parts.next()?.to_owned(),
            name: parts.next()?.to_owned(),
        })
    }
}

/// The collection of Leases.
pub const LEASES: &str = "/apis/coordination.k8s.io/v1/leases";
/// The collection of DistributedLocks.
pub const DISTRIBUTED_LOCKS: &str = "/apis/leasehold.dev/v1alpha1/distributedlocks";
/// The collection of Secrets.
pub const SECRETS: &str = "/api/v1/secrets";
/// The collection of Events (`events.k8s.io`, as kube-runtime's recorder writes them).
pub const EVENTS: &str = "/apis/events.k8s.io/v1/events";
/// SubjectAccessReviews (cluster-scoped, create only): answered from the grants, never stored.
pub const SUBJECT_ACCESS_REVIEWS: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";
/// LocalSubjectAccessReviews (namespaced, create only), as [`SUBJECT_ACCESS_REVIEWS`] about one
/// namespace.
pub const LOCAL_SUBJECT_ACCESS_REVIEWS: &str =
    "/apis/authorization.k8s.io/v1/localsubjectaccessreviews";
/// The collection of Namespaces (cluster-scoped).
pub const NAMESPACES: &str = "/api/v1/namespaces";
/// The collection of MutatingWebhookConfigurations (cluster-scoped: namespace "").
pub const MUTATING_WEBHOOK_CONFIGURATIONS: &str =
    "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations";

/// `/api/v1/namespaces/NS/PLURAL[/NAME]` or `/apis/GROUP/VERSION/namespaces/NS/PLURAL[/NAME]`.
struct Route {
    collection: Collection,
    namespace: String,
    name: Option<String>,
    /// `status` in `.../NAME/status`.
    subresource: Option<String>,
}

impl Route {
    fn parse(path: &str) -> Option<Self> {
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let Some(at) = segments.iter().position(|s| *s == "namespaces") else {
            // Cluster-scoped: `/apis/GROUP/VERSION/PLURAL[/NAME]`, stored under namespace "".
            let root = if segments.first() == Some(&"api") {
                2
            } else {
                3
            };
            return match segments.get(root..)? {
                [plural] => Some(Self {
                    collection: format!("/{}/{plural}", segments[..root].join("/")),
                    namespace: String::new(),
                    name: None,
                    subresource: None,
                }),
                [plural, name] => Some(Self {
                    collection: format!("/{}/{plural}", segments[..root].join("/")),
                    namespace: String::new(),
                    name: Some((*name).to_owned()),
                    subresource: None,
                }),
                _ => None,
            };
        };
        let root = segments[..at].join("/");
        match &segments[at + 1..] {
            // The Namespace objects themselves (cluster-scoped).
            [] | [_] if root == "api/v1" => Some(Self {
                collection: NAMESPACES.to_owned(),
                namespace: String::new(),
                name: segments.get(at + 1).map(|n| (*n).to_owned()),
                subresource: None,
            }),
            [ns, plural] => Some(Self {
                collection: format!("/{root}/{plural}"),
                namespace: (*ns).to_owned(),
                name: None,
                subresource: None,
            }),
            [ns, plural, name] => Some(Self {
                collection: format!("/{root}/{plural}"),
                namespace: (*ns).to_owned(),
                name: Some((*name).to_owned()),
                subresource: None,
            }),
            [ns, plural, name, subresource] => Some(Self {
                collection: format!("/{root}/{plural}"),
                namespace: (*ns).to_owned(),
                name: Some((*name).to_owned()),
                subresource: Some((*subresource).to_owned()),
            }),
            _ => None,
        }
    }
}

/// A `labelSelector` of equality-based requirements (`k=v`, `k==v`, `k!=v`) and existence
/// ones (`k`, `!k`), all of which an object's labels must meet.
struct LabelSelector(Vec<Requirement>);

enum Requirement {
    Equals(String, String),
    Differs(String, String),
    Exists(String),
    Absent(String),
}

impl LabelSelector {
    fn of(query: &BTreeMap<String, String>) -> Self {
        let Some(selector) = query.get("labelSelector") else {
            return Self(Vec::new());
        };
        let requirements = selector
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(|r| {
                if let Some((k, v)) = r.split_once("!=") {
                    Requirement::Differs(k.trim().into(), v.trim().into())
                } else if let Some((k, v)) = r.split_once("==").or_else(|| r.split_once('=')) {
                    Requirement::Equals(k.trim().into(), v.trim().into())
                } else if let Some(k) = r.strip_prefix('!') {
                    Requirement::Absent(k.trim().into())
                } else {
                    assert!(
                        !r.contains(' '),
                        "set-based label selectors are not served here: {r}"
                    );
                    Requirement::Exists(r.into())
                }
            })
            .collect();
        Self(requirements)
    }

    fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let label = |k: &str| labels[k].as_str();
        self.0.iter().all(|requirement| match requirement {
            Requirement::Equals(k, v) => label(k) == Some(v.as_str()),
            Requirement::Differs(k, v) => label(k) != Some(v.as_str()),
            Requirement::Exists(k) => label(k).is_some(),
            Requirement::Absent(k) => label(k).is_none(),
        })
    }
}

fn name_selector(query: &BTreeMap<String, String>) -> Option<String> {
    query
        .get("fieldSelector")
        .and_then(|s| s.strip_prefix("metadata.name="))
        .map(str::to_owned)
}

fn version() -> Value {
    json!({
        "major": "1", "minor": "33", "gitVersion": "v1.33.0-leasehold-fake",
        "gitCommit": "0", "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"
    })
}

fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(value).unwrap())).boxed_unsync())
        .unwrap()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
        }),
    )
}

/// What a real API server answers to a create in a namespace that does not exist.
fn namespace_not_found(ns: &str) -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("namespaces \"{ns}\" not found"),
            "reason": "NotFound", "code": 404,
            "details": {"name": ns, "kind": "namespaces"},
        }),
    )
}

/// What a real API server answers to a create in a namespace being deleted.
fn namespace_terminating(collection: &str, ns: &str) -> Response<Body> {
    let plural = collection.rsplit('/').next().unwrap_or_default();
    json_response(
        StatusCode::FORBIDDEN,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{plural} is forbidden: unable to create new content in namespace {ns} because it is being terminated"),
            "reason": "Forbidden", "code": 403,
            "details": {"kind": plural, "causes": [{
                "reason": "NamespaceTerminating",
                "message": format!("namespace {ns} is being terminated"),
                "field": "metadata.namespace",
            }]},
        }),
    )
}

/// A write whose resourceVersion is not the object's any more.
fn modified_since(name: &str) -> Response<Body> {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on \"{name}\": \
             the object has been modified; please apply your changes to the latest version and try again"
        ),
    )
}

fn not_found(name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("\"{name}\" not found"),
    )
}

/// The real server's 422 for a name that is no lowercase RFC 1123 subdomain (what it asks of
/// Leases, Secrets, events and custom resources alike): `[a-z0-9-]` parts separated by '.',
/// each starting and ending alphanumeric, 253 characters at most. `None` for a valid name.
fn invalid_name(name: &str) -> Option<Response<Body>> {
    let part_ok = |part: &str| {
        let bytes = part.as_bytes();
        !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
    };
    if name.len() <= 253 && name.split('.').all(part_ok) {
        return None;
    }
    Some(status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!(
            "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ),
    ))
}
