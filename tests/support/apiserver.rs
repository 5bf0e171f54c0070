//! A small in-process Kubernetes API server for integration tests.
//!
//! It speaks the HTTP/JSON protocol kube-rs 5 uses for the kinds kube-proxy watches —
//! `Service`, `EndpointSlice`, `Node` and `ServiceCIDR` — and accepts `Event` writes:
//!
//! - `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes`,
//!   `/apis/networking.k8s.io/v1/servicecidrs`, the namespaced forms
//!   (`/api/v1/namespaces/{ns}/services`, …) and single objects (`…/{name}`), plus `/version`.
//! - LIST honours `labelSelector` (`k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
//!   `k notin (a,b)`), `fieldSelector` (`path=v`, `path!=v` on any dotted path such as
//!   `metadata.name`), `limit` + `continue` (pages come from a snapshot taken by the first page,
//!   so they are consistent), and `resourceVersionMatch=Exact` (only the current version).
//! - WATCH (`watch=true|1`) streams newline-delimited events from an in-memory event log after
//!   the given `resourceVersion` (`""`/`"0"` start with synthetic `ADDED`s, and with
//!   `sendInitialEvents=true` a bookmark annotated `k8s.io/initial-events-end`). A version older
//!   than the log's start gets one `ERROR` event (410 Expired) and the end of the stream. Objects
//!   moving in or out of the selectors arrive as `ADDED`/`DELETED`, as from a real server.
//!   `BOOKMARK`s are sent every [`ApiServer::set_bookmark_interval`] when `allowWatchBookmarks`
//!   is set, and the stream ends after `timeoutSeconds`.
//! - `POST`/`PUT`/`PATCH`/`DELETE` on `/api/v1/namespaces/{ns}/events[/{name}]` and
//!   `/apis/events.k8s.io/v1/…/events[/{name}]` are recorded (see [`ApiServer::events`]); other
//!   writes get 405.
//!
//! Every stored object gets `metadata.resourceVersion` (one global counter), and a `uid` and
//! `creationTimestamp` if it has none. Objects are plain `serde_json::Value`s.
//!
//! The server runs on its own tokio runtime in a background thread, so every control method is
//! a plain synchronous call usable from sync and async tests alike; dropping the handle stops it.
//!
//! Failure injection:
//! - [`ApiServer::expire_watches`]: every open watch gets the 410 `ERROR` event and ends, and every
//!   resource version handed out so far becomes too old, so kube-rs' watcher must relist.
//! - [`ApiServer::drop_connections`]: open watch streams are cut mid-body (no terminating chunk,
//!   no event); kube-rs sees an unexpected EOF and resumes watching from its last version.
//! - [`ApiServer::set_unavailable`]: while on, connections are reset (TCP accept then RST;
//!   already open connections, idle or streaming, are reset too) rather than answered with 503.
//!   kube-rs 5's default client stack retries 429/503/504 responses internally (up to 15 times
//!   with exponential backoff from 5 ms, minutes in all), which would hide the outage from the
//!   watcher; connection errors are not retried there, so they surface at once and the
//!   watcher's own backoff paces the retries.
//! - [`ApiServer::set_delay`]: every response is held back by the given time.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::future::{Future, IntoFuture};
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State as AxState;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

/// How many watch events are kept before the oldest are compacted away.
const LOG_CAPACITY: usize = 10_000;
/// How many paged-list snapshots are kept for `continue` tokens.
const SNAPSHOT_CAPACITY: usize = 64;

/// A resource type the server knows, by URL prefix and plural.
#[derive(Debug, PartialEq, Eq)]
struct Resource {
    kind: &'static str,
    api_version: &'static str,
    prefix: &'static str,
    plural: &'static str,
    namespaced: bool,
    /// Events are write-only: recorded, never listed or watched.
    event: bool,
}

const RESOURCES: &[Resource] = &[
    Resource {
        kind: "Service",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "services",
        namespaced: true,
        event: false,
    },
    Resource {
        kind: "EndpointSlice",
        api_version: "discovery.k8s.io/v1",
        prefix: "/apis/discovery.k8s.io/v1",
        plural: "endpointslices",
        namespaced: true,
        event: false,
    },
    Resource {
        kind: "Node",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "nodes",
        namespaced: false,
        event: false,
    },
    Resource {
        kind: "ServiceCIDR",
        api_version: "networking.k8s.io/v1",
        prefix: "/apis/networking.k8s.io/v1",
        plural: "servicecidrs",
        namespaced: false,
        event: false,
    },
    Resource {
        kind: "Event",
        api_version: "v1",
        prefix: "/api/v1",
        plural: "events",
        namespaced: true,
        event: true,
    },
    Resource {
        kind: "Event",
        api_version: "events.k8s.io/v1",
        prefix: "/apis/events.k8s.io/v1",
        plural: "events",
        namespaced: true,
        event: true,
    },
];

/// The listable resource for `kind`; panics on kinds the server does not serve.
fn resource_of(kind: &str) -> &'static Resource {
    RESOURCES
        .iter()
        .find(|r| r.kind == kind && !r.event)
        .unwrap_or_else(|| {
            panic!("test API server: unsupported kind {kind:?} (Service, EndpointSlice, Node, ServiceCIDR)")
        })
}

/// A handle on a running test API server; dropping it stops the server.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Binds `127.0.0.1:0` and starts serving on a background thread.
    pub fn start() -> ApiServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("test API server: binding 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("test API server: set_nonblocking");
        let addr = listener.local_addr().expect("test API server: local_addr");
        let shared = Arc::new(Shared::new());
        let (shutdown, stop) = oneshot::channel::<()>();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("test-apiserver".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("test API server: building its runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("test API server: registering the listener");
                    let app = Router::new().fallback(handle).with_state(sh.clone());
                    let serve = axum::serve(
                        GatedListener {
                            inner: listener,
                            shared: sh,
                        },
                        app,
                    )
                    .into_future();
                    tokio::select! {
                        res = serve => if let Err(e) = res { eprintln!("test API server stopped: {e}") },
                        _ = stop => {}
                    }
                });
                // Drops every connection task without waiting for it.
                rt.shutdown_background();
            })
            .expect("test API server: spawning its thread");
        ApiServer {
            shared,
            addr,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Writes a kubeconfig whose current context points at this server over plain HTTP, with a
    /// user without credentials. Panics if the file cannot be written.
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) {
        let path = path.as_ref();
        let text = format!(
            "apiVersion: v1
kind: Config
clusters:
- name: test-apiserver
  cluster:
    server: {url}
users:
- name: test-user
  user: {{}}
contexts:
- name: test
  context:
    cluster: test-apiserver
    user: test-user
    namespace: default
current-context: test
preferences: {{}}
",
            url = self.url()
        );
        std::fs::write(path, text).unwrap_or_else(|e| panic!("test API server: writing {}: {e}", path.display()));
    }

    /// Creates or replaces an object by kind, namespace and name (a watch sees `ADDED` or
    /// `MODIFIED`) and returns it as stored. `apiVersion` is filled in, a namespaced object
    /// without a namespace goes to `default`, and a cluster-scoped one loses its namespace.
    /// Panics on an unknown kind or a missing name.
    pub fn apply(&self, obj: Value) -> Value {
        let mut obj = obj;
        let kind = obj
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("test API server: object without kind: {obj}"));
        let res = resource_of(kind);
        obj["apiVersion"] = json!(res.api_version);
        let name = str_at(&obj, &["metadata", "name"])
            .unwrap_or_else(|| panic!("test API server: object without metadata.name: {obj}"))
            .to_string();
        let meta = meta_mut(&mut obj);
        let ns = if res.namespaced {
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .unwrap_or("default")
                .to_string();
            meta.insert("namespace".into(), json!(ns));
            ns
        } else {
            meta.remove("namespace");
            String::new()
        };
        let mut st = self.shared.lock();
        let key = (res.kind, ns, name);
        let previous = st.objects.get(&key).cloned();
        st.stamp(&mut obj, previous.as_ref());
        st.objects.insert(key, obj.clone());
        let event = if previous.is_some() { "MODIFIED" } else { "ADDED" };
        let rv = st.rv;
        st.append(LogEntry {
            rv,
            kind: res.kind,
            event,
            object: obj.clone(),
            previous,
        });
        drop(st);
        self.shared.notify();
        obj
    }

    /// Deletes an object (a watch sees `DELETED`, carrying a new resource version) and returns
    /// it, or `None` if there was none. `namespace` is ignored for cluster-scoped kinds.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let res = resource_of(kind);
        let ns = if res.namespaced { namespace } else { "" };
        let mut st = self.shared.lock();
        let mut obj = st.objects.remove(&(res.kind, ns.to_string(), name.to_string()))?;
        st.rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(st.rv.to_string()));
        let rv = st.rv;
        st.append(LogEntry {
            rv,
            kind: res.kind,
            event: "DELETED",
            object: obj.clone(),
            previous: None,
        });
        drop(st);
        self.shared.notify();
        Some(obj)
    }

    /// The stored objects of `kind`, ordered by namespace and name.
    pub fn objects(&self, kind: &str) -> Vec<Value> {
        let res = resource_of(kind);
        self.shared
            .lock()
            .objects
            .iter()
            .filter(|((k, _, _), _)| *k == res.kind)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// The Events written by clients (core or events.k8s.io), in order of creation, as they
    /// stand after any later PUT/PATCH.
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// The current (latest handed out) resource version.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Ends every open watch with a 410 Expired `ERROR` event and compacts the event log past
    /// every resource version handed out so far: resuming from any of them gets the same 410,
    /// and `continue` tokens of paged lists expire, so clients must relist.
    pub fn expire_watches(&self) {
        let mut st = self.shared.lock();
        st.expire_gen += 1;
        st.rv += 1;
        st.compacted = st.rv;
        st.log.clear();
        st.snapshots.clear();
        drop(st);
        self.shared.notify();
    }

    /// Cuts every open watch stream mid-body: no event, no terminating chunk, connection closed.
    pub fn drop_connections(&self) {
        self.shared.lock().drop_gen += 1;
        self.shared.notify();
    }

    /// While `true`, every connection is reset: new ones right after accept, open ones
    /// (idle keep-alive, in-flight or streaming) at once. No HTTP response is sent.
    pub fn set_unavailable(&self, unavailable: bool) {
        // Flag first, then the generation: see `GatedListener::accept`.
        self.shared.unavailable.store(unavailable, Ordering::SeqCst);
        if unavailable {
            self.shared.kill.send_modify(|g| *g += 1);
        }
    }

    /// Holds back every response (including a watch's headers) by `delay`; zero turns it off.
    pub fn set_delay(&self, delay: Duration) {
        self.shared.lock().delay = delay;
    }

    /// How often watches that allow bookmarks get one (default 1 s); applies to new watches.
    pub fn set_bookmark_interval(&self, every: Duration) {
        self.shared.lock().bookmark_interval = every;
    }

    /// Every request received so far, as `METHOD /path?query` with the query percent-decoded,
    /// in the client's order, e.g.
    /// `GET /api/v1/services?labelSelector=!service.kubernetes.io/headless&limit=500`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// Forgets the requests logged so far.
    pub fn clear_requests(&self) {
        self.shared.lock().requests.clear();
    }

    /// How many watch streams are currently being served.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// State shared by the handle, the listener and the request handlers.
struct Shared {
    state: Mutex<State>,
    /// Bumped whenever watches have something to look at.
    changed: watch::Sender<u64>,
    /// Bumped to reset every open connection.
    kill: watch::Sender<u64>,
    unavailable: AtomicBool,
    open_watches: AtomicUsize,
}

impl Shared {
    fn new() -> Shared {
        Shared {
            state: Mutex::new(State {
                rv: 1,
                uid_seq: 0,
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                compacted: 0,
                expire_gen: 0,
                drop_gen: 0,
                events: Vec::new(),
                requests: Vec::new(),
                delay: Duration::ZERO,
                bookmark_interval: Duration::from_secs(1),
                snapshots: BTreeMap::new(),
                snapshot_seq: 0,
            }),
            changed: watch::Sender::new(0),
            kill: watch::Sender::new(0),
            unavailable: AtomicBool::new(false),
            open_watches: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not take the server down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|g| *g += 1);
    }
}

struct State {
    /// The last resource version handed out.
    rv: u64,
    uid_seq: u64,
    /// Keyed by (kind, namespace or "", name).
    objects: BTreeMap<(&'static str, String, String), Value>,
    /// Changes, in resource-version order, for watches to replay.
    log: VecDeque<LogEntry>,
    /// Watching from a version below this gets 410: its successors are gone from the log.
    compacted: u64,
    expire_gen: u64,
    drop_gen: u64,
    events: Vec<Value>,
    requests: Vec<String>,
    delay: Duration,
    bookmark_interval: Duration,
    /// Paged-list snapshots by id: (resource version, all matching items).
    snapshots: BTreeMap<u64, (u64, Arc<Vec<Value>>)>,
    snapshot_seq: u64,
}

struct LogEntry {
    rv: u64,
    kind: &'static str,
    event: &'static str,
    object: Value,
    /// The state before a MODIFIED, to turn selector transitions into ADDED/DELETED.
    previous: Option<Value>,
}

impl State {
    /// Gives `obj` the next resource version, and a uid and creation time if it has none
    /// (kept from `previous` on updates).
    fn stamp(&mut self, obj: &mut Value, previous: Option<&Value>) {
        self.rv += 1;
        let rv = self.rv;
        let keep = |field: &str| {
            previous
                .and_then(|p| p.get("metadata")?.get(field))
                .filter(|v| !v.is_null())
                .cloned()
        };
        let (uid, created) = (keep("uid"), keep("creationTimestamp"));
        let meta = meta_mut(obj);
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        if meta.get("uid").is_none_or(Value::is_null) {
            let uid = uid.unwrap_or_else(|| {
                self.uid_seq += 1;
                json!(format!("00000000-0000-4000-8000-{:012x}", self.uid_seq))
            });
            meta.insert("uid".into(), uid);
        }
        if meta.get("creationTimestamp").is_none_or(Value::is_null) {
            let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
            meta.insert("creationTimestamp".into(), created.unwrap_or_else(|| json!(now)));
        }
    }

    fn append(&mut self, entry: LogEntry) {
        self.log.push_back(entry);
        while self.log.len() > LOG_CAPACITY {
            if let Some(old) = self.log.pop_front() {
                self.compacted = old.rv;
            }
        }
    }

    fn event_index(&self, ns: &str, name: &str) -> Option<usize> {
        self.events.iter().position(|e| {
            str_at(e, &["metadata", "namespace"]) == Some(ns) && str_at(e, &["metadata", "name"]) == Some(name)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP handling

async fn handle(
    AxState(sh): AxState<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let query = parse_query(uri.query());
    let delay = {
        let mut st = sh.lock();
        st.requests.push(request_line(&method, uri.path(), &query));
        st.delay
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    route(&sh, &method, uri.path(), &Query(query), &headers, &body)
}

fn route(sh: &Arc<Shared>, method: &Method, path: &str, q: &Query, headers: &HeaderMap, body: &[u8]) -> Response {
    if path == "/version" && method == Method::GET {
        return Json(json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0", "gitCommit": "test", "gitTreeState": "clean",
            "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"
        }))
        .into_response();
    }
    let Some((res, ns, name)) = parse_path(path) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        );
    };
    if res.event {
        return write_event(
            sh,
            res,
            ns.as_deref().unwrap_or("default"),
            name.as_deref(),
            method,
            headers,
            body,
        );
    }
    match (method, name) {
        (&Method::GET, Some(name)) => get(sh, res, ns.as_deref().unwrap_or(""), &name),
        (&Method::GET, None) if matches!(q.get("watch"), Some("true" | "1")) => start_watch(sh, res, ns, q),
        (&Method::GET, None) => list(sh, res, ns, q),
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the test API server does not support {method} on {}", res.plural),
        ),
    }
}

/// Splits `/api/v1[/namespaces/{ns}]/{plural}[/{name}]` (or `/apis/{group}/{version}/…`).
fn parse_path(path: &str) -> Option<(&'static Resource, Option<String>, Option<String>)> {
    let (prefix, rest) = if let Some(rest) = path.strip_prefix("/api/v1/") {
        ("/api/v1".to_string(), rest)
    } else {
        let rest = path.strip_prefix("/apis/")?;
        let mut it = rest.splitn(3, '/');
        let (group, version, rest) = (it.next()?, it.next()?, it.next()?);
        (format!("/apis/{group}/{version}"), rest)
    };
    let segs: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    let (ns, plural, name) = match segs.as_slice() {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        _ => return None,
    };
    let res = RESOURCES.iter().find(|r| r.prefix == prefix && r.plural == plural)?;
    if ns.is_some() && !res.namespaced || [ns, Some(plural), name].iter().flatten().any(|s| s.is_empty()) {
        return None;
    }
    Some((res, ns.map(str::to_string), name.map(str::to_string)))
}

fn get(sh: &Shared, res: &'static Resource, ns: &str, name: &str) -> Response {
    let st = sh.lock();
    match st.objects.get(&(res.kind, ns.to_string(), name.to_string())) {
        Some(obj) => Json(obj.clone()).into_response(),
        None => not_found(res, name),
    }
}

fn list(sh: &Shared, res: &'static Resource, ns: Option<String>, q: &Query) -> Response {
    let filter = match Filter::new(ns, q) {
        Ok(f) => f,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e),
    };
    let limit = match q.get("limit").map(str::parse::<usize>).transpose() {
        Ok(limit) => limit.filter(|&l| l > 0),
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid limit"),
    };
    let mut st = sh.lock();
    let (snapshot, rv, items, offset) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let Some((id, offset)) = decode_continue(token) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid continue token");
            };
            let Some((rv, items)) = st.snapshots.get(&id).cloned() else {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                );
            };
            let offset = offset.min(items.len());
            (Some(id), rv, items, offset)
        }
        None => {
            if q.get("resourceVersionMatch") == Some("Exact")
                && q.get("resourceVersion") != Some(st.rv.to_string().as_str())
            {
                return status(StatusCode::GONE, "Expired", "too old resource version");
            }
            let items: Vec<Value> = st
                .objects
                .iter()
                .filter(|((k, _, _), o)| *k == res.kind && filter.matches(o))
                .map(|(_, o)| o.clone())
                .collect();
            (None, st.rv, Arc::new(items), 0)
        }
    };
    let end = limit.map_or(items.len(), |l| (offset + l).min(items.len()));
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if end < items.len() {
        let id = snapshot.unwrap_or_else(|| {
            st.snapshot_seq += 1;
            let id = st.snapshot_seq;
            st.snapshots.insert(id, (rv, items.clone()));
            while st.snapshots.len() > SNAPSHOT_CAPACITY {
                st.snapshots.pop_first();
            }
            id
        });
        metadata["continue"] = json!(encode_continue(id, end));
        metadata["remainingItemCount"] = json!(items.len() - end);
    }
    Json(json!({
        "apiVersion": res.api_version,
        "kind": format!("{}List", res.kind),
        "metadata": metadata,
        "items": items[offset..end],
    }))
    .into_response()
}

/// Continue tokens are opaque to clients: hex of `snapshot-id:offset`.
fn encode_continue(id: u64, offset: usize) -> String {
    format!("{id}:{offset}").bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Option<(u64, usize)> {
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| token.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect::<Option<Vec<u8>>>()?;
    let (id, offset) = std::str::from_utf8(&bytes).ok()?.split_once(':')?;
    Some((id.parse().ok()?, offset.parse().ok()?))
}

fn write_event(
    sh: &Shared,
    res: &'static Resource,
    ns: &str,
    name: Option<&str>,
    method: &Method,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let bad = |msg: String| status(StatusCode::BAD_REQUEST, "BadRequest", msg);
    let parse_body = || -> Result<Value, String> {
        match serde_json::from_slice::<Value>(body) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err("the body must be a JSON object".into()),
            Err(e) => Err(format!("invalid JSON body: {e}")),
        }
    };
    let mut st = sh.lock();
    match (method, name) {
        (&Method::POST, None) => {
            let mut obj = match parse_body() {
                Ok(o) => o,
                Err(msg) => return bad(msg),
            };
            let name = match str_at(&obj, &["metadata", "name"]).filter(|n| !n.is_empty()) {
                Some(n) => n.to_string(),
                None => match str_at(&obj, &["metadata", "generateName"]) {
                    Some(prefix) => format!("{prefix}{:05x}", st.rv + 1),
                    None => {
                        return status(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "Invalid",
                            "metadata.name or generateName is required",
                        );
                    }
                },
            };
            if st.event_index(ns, &name).is_some() {
                return status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    format!("events {name:?} already exists"),
                );
            }
            prepare_event(&mut obj, res, ns, &name);
            st.stamp(&mut obj, None);
            st.events.push(obj.clone());
            (StatusCode::CREATED, Json(obj)).into_response()
        }
        (&Method::PUT, Some(name)) => {
            let mut obj = match parse_body() {
                Ok(o) => o,
                Err(msg) => return bad(msg),
            };
            prepare_event(&mut obj, res, ns, name);
            match st.event_index(ns, name) {
                Some(i) => {
                    let previous = st.events[i].clone();
                    st.stamp(&mut obj, Some(&previous));
                    st.events[i] = obj.clone();
                    Json(obj).into_response()
                }
                None => {
                    st.stamp(&mut obj, None);
                    st.events.push(obj.clone());
                    (StatusCode::CREATED, Json(obj)).into_response()
                }
            }
        }
        (&Method::PATCH, Some(name)) => {
            let content_type = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if content_type.starts_with("application/json-patch+json") {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "JSON patches are not supported by the test API server",
                );
            }
            // Merge, strategic-merge and (JSON-encoded) apply patches are all applied as merge patches.
            let patch = match parse_body() {
                Ok(o) => o,
                Err(msg) => return bad(msg),
            };
            let existing = st.event_index(ns, name);
            let apply = content_type.starts_with("application/apply-patch");
            let mut obj = match existing {
                Some(i) => st.events[i].clone(),
                None if apply => json!({}),
                None => return status(StatusCode::NOT_FOUND, "NotFound", format!("events {name:?} not found")),
            };
            merge_patch(&mut obj, &patch);
            prepare_event(&mut obj, res, ns, name);
            match existing {
                Some(i) => {
                    let previous = st.events[i].clone();
                    st.stamp(&mut obj, Some(&previous));
                    st.events[i] = obj.clone();
                    Json(obj).into_response()
                }
                None => {
                    st.stamp(&mut obj, None);
                    st.events.push(obj.clone());
                    (StatusCode::CREATED, Json(obj)).into_response()
                }
            }
        }
        (&Method::DELETE, Some(name)) => match st.event_index(ns, name) {
            Some(i) => Json(st.events.remove(i)).into_response(),
            None => status(StatusCode::NOT_FOUND, "NotFound", format!("events {name:?} not found")),
        },
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the test API server only records writes to events, not {method}"),
        ),
    }
}

fn prepare_event(obj: &mut Value, res: &Resource, ns: &str, name: &str) {
    if obj.get("apiVersion").is_none_or(Value::is_null) {
        obj["apiVersion"] = json!(res.api_version);
    }
    obj["kind"] = json!("Event");
    let meta = meta_mut(obj);
    meta.insert("namespace".into(), json!(ns));
    meta.insert("name".into(), json!(name));
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response {
    (code, Json(status_object(code.as_u16(), reason, &message.into()))).into_response()
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

fn not_found(res: &Resource, name: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{} \"{name}\" not found", res.plural), "reason": "NotFound",
            "details": { "name": name, "kind": res.plural }, "code": 404,
        })),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Watches

fn start_watch(sh: &Arc<Shared>, res: &'static Resource, ns: Option<String>, q: &Query) -> Response {
    let filter = match Filter::new(ns, q) {
        Ok(f) => f,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e),
    };
    let timeout = match q.get("timeoutSeconds").map(str::parse::<u64>).transpose() {
        Ok(t) => t.filter(|&t| t > 0).unwrap_or(1800),
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid timeoutSeconds"),
    };
    let from = match q
        .get("resourceVersion")
        .filter(|rv| !rv.is_empty() && *rv != "0")
        .map(str::parse::<u64>)
        .transpose()
    {
        Ok(rv) => rv,
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid resourceVersion"),
    };
    let bookmarks = q.get("allowWatchBookmarks") == Some("true");
    let initial_events = q.get("sendInitialEvents");

    let mut changed = sh.changed.subscribe();
    changed.mark_unchanged();
    let st = sh.lock();
    let now = Instant::now();
    let mut w = WatchStream {
        _guard: WatchGuard::new(sh.clone()),
        shared: sh.clone(),
        kind: res.kind,
        api_version: res.api_version,
        filter,
        bookmark_every: bookmarks.then_some(st.bookmark_interval.max(Duration::from_millis(10))),
        last_rv: st.rv,
        pending: VecDeque::new(),
        deadline: now + Duration::from_secs(timeout),
        next_bookmark: now + st.bookmark_interval,
        expire_gen: st.expire_gen,
        drop_gen: st.drop_gen,
        changed,
        done: false,
    };
    match from {
        Some(rv) if rv < st.compacted => {
            w.pending.push_back(event_line(
                "ERROR",
                &status_object(410, "Expired", "too old resource version"),
            ));
            w.done = true;
        }
        Some(rv) => w.last_rv = rv,
        // No version (or "0"): the current state as synthetic ADDEDs, then changes from now on.
        None if initial_events != Some("false") => {
            for (_, obj) in st
                .objects
                .iter()
                .filter(|((k, _, _), o)| *k == res.kind && w.filter.matches(o))
            {
                w.pending.push_back(event_line("ADDED", obj));
            }
            if initial_events == Some("true") {
                let mut bookmark = w.bookmark(st.rv);
                bookmark["metadata"]["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
                w.pending.push_back(event_line("BOOKMARK", &bookmark));
            }
        }
        None => {}
    }
    drop(st);
    let stream = futures::stream::unfold(w, WatchStream::next_chunk);
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .expect("a valid watch response")
}

/// One watch response body, produced lazily by `next_chunk`.
struct WatchStream {
    _guard: WatchGuard,
    shared: Arc<Shared>,
    kind: &'static str,
    api_version: &'static str,
    filter: Filter,
    bookmark_every: Option<Duration>,
    /// Every change up to this version has been looked at.
    last_rv: u64,
    pending: VecDeque<Bytes>,
    deadline: Instant,
    next_bookmark: Instant,
    expire_gen: u64,
    drop_gen: u64,
    changed: watch::Receiver<u64>,
    done: bool,
}

impl WatchStream {
    async fn next_chunk(mut self) -> Option<(Result<Bytes, io::Error>, WatchStream)> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                return Some((Ok(line), self));
            }
            if self.done {
                return None;
            }
            self.changed.borrow_and_update();
            {
                let shared = self.shared.clone();
                let st = shared.lock();
                if st.drop_gen != self.drop_gen {
                    // An error from the body makes hyper abort the connection mid-chunk.
                    drop(st);
                    self.done = true;
                    return Some((
                        Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "watch dropped by the test API server",
                        )),
                        self,
                    ));
                }
                if st.expire_gen != self.expire_gen {
                    self.pending.push_back(event_line(
                        "ERROR",
                        &status_object(410, "Expired", "too old resource version"),
                    ));
                    self.done = true;
                    continue;
                }
                let start = st.log.partition_point(|e| e.rv <= self.last_rv);
                for entry in st.log.range(start..) {
                    if let Some(line) = self.translate(entry) {
                        self.pending.push_back(line);
                    }
                }
                self.last_rv = self.last_rv.max(st.rv);
                let now = Instant::now();
                if let Some(every) = self.bookmark_every
                    && self.pending.is_empty()
                    && now >= self.next_bookmark
                {
                    let bookmark = self.bookmark(self.last_rv);
                    self.pending.push_back(event_line("BOOKMARK", &bookmark));
                    self.next_bookmark = now + every;
                }
            }
            if !self.pending.is_empty() {
                continue;
            }
            if Instant::now() >= self.deadline {
                return None;
            }
            let wake = if self.bookmark_every.is_some() {
                self.deadline.min(self.next_bookmark)
            } else {
                self.deadline
            };
            tokio::select! {
                _ = self.changed.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// The event this watcher sees for a change, if any: objects entering or leaving the
    /// selection are ADDED or DELETED.
    fn translate(&self, e: &LogEntry) -> Option<Bytes> {
        if e.kind != self.kind {
            return None;
        }
        let now = self.filter.matches(&e.object);
        let before = e.previous.as_ref().is_some_and(|p| self.filter.matches(p));
        let ty = match (e.event, before, now) {
            ("ADDED", _, true) | ("MODIFIED", false, true) => "ADDED",
            ("MODIFIED", true, true) => "MODIFIED",
            ("MODIFIED", true, false) | ("DELETED", _, true) => "DELETED",
            _ => return None,
        };
        Some(event_line(ty, &e.object))
    }

    fn bookmark(&self, rv: u64) -> Value {
        json!({ "kind": self.kind, "apiVersion": self.api_version, "metadata": { "resourceVersion": rv.to_string() } })
    }
}

/// Counts open watch streams.
struct WatchGuard(Arc<Shared>);

impl WatchGuard {
    fn new(shared: Arc<Shared>) -> WatchGuard {
        shared.open_watches.fetch_add(1, Ordering::SeqCst);
        WatchGuard(shared)
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

fn event_line(ty: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": ty, "object": object })).expect("JSON");
    line.push(b'\n');
    Bytes::from(line)
}

// ---------------------------------------------------------------------------------------------
// Selectors

/// Namespace, label and field selection of a list or watch.
struct Filter {
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<(String, bool, String)>,
}

enum LabelReq {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Filter {
    fn new(namespace: Option<String>, q: &Query) -> Result<Filter, String> {
        Ok(Filter {
            namespace,
            labels: parse_label_selector(q.get("labelSelector").unwrap_or(""))?,
            fields: parse_field_selector(q.get("fieldSelector").unwrap_or(""))?,
        })
    }

    fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && str_at(obj, &["metadata", "namespace"]).unwrap_or("") != ns
        {
            return false;
        }
        let label = |k: &str| {
            obj.get("metadata")
                .and_then(|m| m.get("labels"))
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
        };
        let labels_ok = self.labels.iter().all(|req| match req {
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
            LabelReq::In(k, vs) => label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|v| vs.iter().all(|x| x != v)),
        });
        labels_ok
            && self
                .fields
                .iter()
                .all(|(path, eq, want)| (field_value(obj, path) == *want) == *eq)
    }
}

/// Splits at commas outside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let (mut terms, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(s[start..].trim());
    terms.into_iter().filter(|t| !t.is_empty()).collect()
}

fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, String> {
    let invalid = || format!("unable to parse label selector {s:?}");
    let key = |k: &str| {
        let k = k.trim();
        if k.is_empty() || k.contains(char::is_whitespace) {
            Err(invalid())
        } else {
            Ok(k.to_string())
        }
    };
    split_terms(s)
        .into_iter()
        .map(|term| {
            if let Some(k) = term.strip_prefix('!') {
                return Ok(LabelReq::NotExists(key(k)?));
            }
            if let Some(open) = term.find('(') {
                let values = term[open + 1..].strip_suffix(')').ok_or_else(invalid)?;
                let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
                let mut head = term[..open].split_whitespace();
                let (k, op) = (head.next().ok_or_else(invalid)?, head.next().ok_or_else(invalid)?);
                return match (op, head.next()) {
                    ("in", None) => Ok(LabelReq::In(key(k)?, values)),
                    ("notin", None) => Ok(LabelReq::NotIn(key(k)?, values)),
                    _ => Err(invalid()),
                };
            }
            if let Some((k, v)) = term.split_once("!=") {
                return Ok(LabelReq::NotIn(key(k)?, vec![v.trim().to_string()]));
            }
            if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                return Ok(LabelReq::In(key(k)?, vec![v.trim().to_string()]));
            }
            Ok(LabelReq::Exists(key(term)?))
        })
        .collect()
}

/// `path=value`, `path==value`, `path!=value`; `(path, equal, value)`.
fn parse_field_selector(s: &str) -> Result<Vec<(String, bool, String)>, String> {
    split_terms(s)
        .into_iter()
        .map(|term| {
            let (path, eq, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (p, true, v)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            Ok((path.trim().to_string(), eq, value.trim().to_string()))
        })
        .collect()
}

/// A dotted path's value as a string ("" when absent), as field selectors compare it.
fn field_value(obj: &Value, path: &str) -> String {
    match path.split('.').try_fold(obj, |v, k| v.get(k)) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Query strings

/// Decoded query parameters, in order.
struct Query(Vec<(String, String)>);

impl Query {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

fn parse_query(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (form_decode(k), form_decode(v))
        })
        .collect()
}

fn form_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn request_line(method: &Method, path: &str, query: &[(String, String)]) -> String {
    if query.is_empty() {
        return format!("{method} {path}");
    }
    let query: Vec<String> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{method} {path}?{}", query.join("&"))
}

// ---------------------------------------------------------------------------------------------
// JSON helpers

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_str()
}

/// `obj.metadata` as a map, created if missing. Panics if `obj` is not an object.
fn meta_mut(obj: &mut Value) -> &mut serde_json::Map<String, Value> {
    let obj = obj
        .as_object_mut()
        .expect("test API server: objects must be JSON objects");
    let meta = obj.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut().expect("metadata is an object")
}

// ---------------------------------------------------------------------------------------------
// Connections: a listener whose connections can all be reset at once

struct GatedListener {
    inner: TcpListener,
    shared: Arc<Shared>,
}

impl axum::serve::Listener for GatedListener {
    type Io = KillableIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (KillableIo, SocketAddr) {
        loop {
            let Ok((stream, addr)) = self.inner.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            // Read the kill generation before the flag: `set_unavailable` sets the flag before
            // bumping the generation, so a connection either sees the flag or gets killed.
            let kill = self.shared.kill.subscribe();
            let generation = *kill.borrow();
            if self.shared.unavailable.load(Ordering::SeqCst) {
                let _ = stream.set_zero_linger();
                drop(stream);
                continue;
            }
            return (KillableIo::new(stream, kill, generation), addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A TCP stream that fails (and is reset) once the kill generation moves on.
struct KillableIo {
    stream: TcpStream,
    killed: Pin<Box<dyn Future<Output = ()> + Send>>,
    dead: bool,
}

impl KillableIo {
    fn new(stream: TcpStream, mut kill: watch::Receiver<u64>, generation: u64) -> KillableIo {
        let killed = Box::pin(async move {
            let _ = kill.wait_for(|g| *g != generation).await;
        });
        KillableIo {
            stream,
            killed,
            dead: false,
        }
    }

    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.dead && self.killed.as_mut().poll(cx).is_ready() {
            self.dead = true;
            // RST rather than FIN when the connection is dropped.
            let _ = self.stream.set_zero_linger();
        }
        if self.dead {
            Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "reset by the test API server",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for KillableIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
