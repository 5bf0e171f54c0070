//! A small in-process Kubernetes API server for integration tests.
//!
//! It speaks the HTTP/JSON protocol kube-rs 5 uses for the kinds kube-proxy watches —
//! `Service`, `EndpointSlice`, `Node` and `ServiceCIDR` — and accepts `Event` writes:
//!
//! - `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes`,
//!   `/apis/networking.k8s.io/v1/servicecidrs` and `/apis/networking.k8s.io/v1beta1/servicecidrs`,
//!   the namespaced forms (`/api/v1/namespaces/{ns}/services`, …) and single objects
//!   (`…/{name}`), plus `/version`. As in a real server, the versions of a kind share one
//!   storage and each serves the objects with its own `apiVersion`; a version can be switched
//!   off ([`ApiServer::set_served`]), and its requests then get 404 NotFound, as from a server
//!   that does not serve it (ServiceCIDRs before 1.33 are `v1beta1` only).
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
//! - [`ApiServer::set_truncated`]: while on, every GET and LIST answer promises its whole body
//!   (`Content-Length`) and sends half of it before the connection is aborted, and every watch
//!   stream sends the first half of its next event with an object and is aborted, as when a
//!   proxy or a load balancer in front of the API server dies mid-response.
//! - [`ApiServer::require_token`]: requests without the bearer token get 401.
//!
//! Here: the handle and the stored state. Beside it: `http` (routing, GET, LIST, event writes),
//! `watches` (WATCH streams), `select` (selectors, query strings, JSON helpers) and `conn` (the
//! listener whose connections can be reset).

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

mod conn;
mod http;
mod select;
mod watches;

use conn::*;
use http::*;
use select::*;
use watches::*;

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
        kind: "ServiceCIDR",
        api_version: "networking.k8s.io/v1beta1",
        prefix: "/apis/networking.k8s.io/v1beta1",
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

/// The listable resource for `kind` (its first version, in which objects are applied); panics
/// on kinds the server does not serve.
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

    /// Stops (`false`) or resumes (`true`) serving `api_version` (e.g. `networking.k8s.io/v1`):
    /// while it is off, every request to it gets 404 NotFound, as from a server that does not
    /// serve that version, and its open watches end. Its objects stay stored and are still
    /// served by the kind's other versions. Panics on a version no resource has.
    pub fn set_served(&self, api_version: &str, served: bool) {
        let res = RESOURCES
            .iter()
            .find(|r| r.api_version == api_version && !r.event)
            .unwrap_or_else(|| panic!("test API server: no resource has apiVersion {api_version:?}"));
        let mut st = self.shared.lock();
        st.unserved.retain(|v| *v != res.api_version);
        if !served {
            st.unserved.push(res.api_version);
        }
        drop(st);
        self.shared.notify();
    }

    /// Holds back every response (including a watch's headers) by `delay`; zero turns it off.
    pub fn set_delay(&self, delay: Duration) {
        self.shared.lock().delay = delay;
    }

    /// While `true`, responses are cut in the middle of an object: a GET or LIST answer sends
    /// half of the body its `Content-Length` promises, then the connection is aborted; a watch
    /// stream sends half of its next ADDED, MODIFIED or DELETED event, then is aborted (ERROR
    /// and BOOKMARK events, short, go whole: a 410 still reaches the client, which relists).
    /// Watches already open are cut at their next event.
    pub fn set_truncated(&self, truncated: bool) {
        self.shared.lock().truncated = truncated;
        self.shared.notify();
    }

    /// How often watches that allow bookmarks get one (default 1 s); applies to new watches.
    pub fn set_bookmark_interval(&self, every: Duration) {
        self.shared.lock().bookmark_interval = every;
    }

    /// From now on, answers a request without `Authorization: Bearer TOKEN` with 401
    /// Unauthorized (as a real server does); `None` accepts every request again.
    pub fn require_token(&self, token: Option<&str>) {
        self.shared.lock().token = token.map(str::to_string);
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
                truncated: false,
                bookmark_interval: Duration::from_secs(1),
                token: None,
                snapshots: BTreeMap::new(),
                snapshot_seq: 0,
                unserved: Vec::new(),
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
    /// See [`ApiServer::set_truncated`].
    truncated: bool,
    bookmark_interval: Duration,
    /// When set, a request without `Authorization: Bearer <this>` gets 401.
    token: Option<String>,
    /// Paged-list snapshots by id: (resource version, all matching items).
    snapshots: BTreeMap<u64, (u64, Arc<Vec<Value>>)>,
    snapshot_seq: u64,
    /// API versions answered with 404 (see [`ApiServer::set_served`]).
    unserved: Vec<&'static str>,
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
