//! kube-proxy's HTTP servers: small axum routers over pure response builders, served on
//! listeners the caller binds, stopped by a shutdown future.
//!
//! Healthz server (`healthzBindAddress`, default `0.0.0.0:10256`), [`healthz_router`]:
//! - `/healthz` (any method): proxy healthy ∧ Node eligible → 200, else 503; upstream's
//!   `ProxyHealth` JSON with `nodeEligible`. Counted in `kubeproxy_proxy_healthz_total{code}`.
//! - `/livez` (any method): proxy healthy → 200, else 503; the same JSON without `nodeEligible`.
//!   Counted in `kubeproxy_proxy_livez_total{code}`.
//!
//! Metrics server (`metricsBindAddress`, default `127.0.0.1:10249`), [`metrics_router`], as
//! upstream's `serveMetrics` builds it:
//! - `/metrics`: the Prometheus text exposition of [`Metrics`].
//! - `/proxyMode`: the proxy mode name as plain text (e.g. `iptables`), no newline.
//! - `/configz`: `{"kubeproxy.config.k8s.io":<configuration>}` (component-base `configz`).
//! - `/healthz`: the apiserver-style check list with the single `ping` check: `ok`, or with
//!   `?verbose` the `[+]ping ok` listing; `?exclude=<check>` is honoured.
//! - `/healthz/ping`: `ok`.
//!
//! Service health-check node ports ([`ServiceHealthServers`], upstream's `service_health.go`):
//! one listener per Service with `spec.healthCheckNodePort`, on each node-port address (or the
//! wildcard). Any method, any path: 200 when the Service has local ready endpoints and the proxy
//! is healthy, else 503, with upstream's tab-indented JSON body.
//!
//! Every other path answers Go's `404 page not found`. Not served: `/metrics/slis` and, with
//! `--profiling`, `/debug/pprof` and `/debug/flags/v`.
//!
//! Every server is served by [`serve`] (module `serve`): HTTP/1.1 with bounded connections,
//! header and write timeouts, so that idle or slow clients cannot exhaust the daemon or delay
//! `/healthz`.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::oneshot;

use crate::healthz::{HealthReply, JSON_HEADERS, ProxyHealth};
use crate::metrics::{self, Metrics};

/// component-base's configz group for kube-proxy (`kubeproxyconfig.GroupName`).
pub const CONFIGZ_GROUP: &str = "kubeproxy.config.k8s.io";

pub mod serve;

const TEXT_PLAIN: &str = "text/plain; charset=utf-8";
const NOSNIFF: (HeaderName, HeaderValue) = (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));

/// Runs `router` on `listener` until `shutdown` completes, then stops accepting and lets
/// in-flight requests finish; within the process' connection limits ([`serve::Limits`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    serve::serve(listener, router, shutdown).await
}

// === healthz server ===

#[derive(Clone)]
struct HealthzState {
    health: ProxyHealth,
    metrics: Arc<Metrics>,
}

/// `/healthz` and `/livez` (upstream's `ProxyHealthServer.Run`).
pub fn healthz_router(health: ProxyHealth, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/healthz",
            any(|State(s): State<HealthzState>| async move { healthz_rsp(&s.health, &s.metrics) }),
        )
        .route(
            "/livez",
            any(|State(s): State<HealthzState>| async move { livez_rsp(&s.health, &s.metrics) }),
        )
        .fallback(|| async { not_found_rsp() })
        .with_state(HealthzState { health, metrics })
}

/// The `/healthz` answer.
pub fn healthz_rsp(health: &ProxyHealth, metrics: &Metrics) -> Response {
    json_rsp(health.healthz_reply(metrics))
}

/// The `/livez` answer.
pub fn livez_rsp(health: &ProxyHealth, metrics: &Metrics) -> Response {
    json_rsp(health.livez_reply(metrics))
}

fn json_rsp(reply: HealthReply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, JSON_HEADERS, reply.body).into_response()
}

/// Go's `http.NotFound`.
pub fn not_found_rsp() -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, HeaderValue::from_static(TEXT_PLAIN)), NOSNIFF],
        "404 page not found\n",
    )
        .into_response()
}

// === metrics server ===

#[derive(Clone)]
struct MetricsState {
    metrics: Arc<Metrics>,
    proxy_mode: Arc<str>,
    configz: Arc<str>,
}

/// `/metrics`, `/proxyMode`, `/configz`, `/healthz` and `/healthz/ping` (upstream's
/// `serveMetrics`). `configz` is the configuration document to publish under
/// [`CONFIGZ_GROUP`].
///
/// `_health` is not consulted: upstream's metrics-port `/healthz` runs only the `ping` check,
/// so it answers `ok` whenever the process serves HTTP at all.
pub fn metrics_router(
    metrics: Arc<Metrics>,
    _health: ProxyHealth,
    proxy_mode: &str,
    configz: serde_json::Value,
) -> Router {
    // The configuration is set once at start-up, so the document is rendered once.
    let configz = serde_json::json!({ CONFIGZ_GROUP: configz }).to_string();
    let state = MetricsState {
        metrics,
        proxy_mode: proxy_mode.into(),
        configz: configz.into(),
    };
    Router::new()
        .route(
            "/metrics",
            any(|State(s): State<MetricsState>| async move { metrics_rsp(&s.metrics) }),
        )
        .route(
            "/proxyMode",
            any(|State(s): State<MetricsState>| async move { proxy_mode_rsp(&s.proxy_mode) }),
        )
        .route(
            "/configz",
            any(|State(s): State<MetricsState>| async move { configz_rsp(&s.configz) }),
        )
        .route(
            "/healthz",
            any(|RawQuery(q): RawQuery| async move { ping_healthz_rsp(q.as_deref().unwrap_or("")) }),
        )
        .route("/healthz/ping", any(|| async { text_rsp(StatusCode::OK, "ok".into()) }))
        .fallback(|| async { not_found_rsp() })
        .with_state(state)
}

/// The `/metrics` answer.
pub fn metrics_rsp(metrics: &Metrics) -> Response {
    let body = metrics.encode();
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(metrics::TEXT_CONTENT_TYPE),
        )],
        body,
    )
        .into_response()
}

/// The `/proxyMode` answer.
pub fn proxy_mode_rsp(mode: &str) -> Response {
    text_rsp(StatusCode::OK, mode.to_owned())
}

/// The `/configz` answer for an already rendered document.
pub fn configz_rsp(document: &str) -> Response {
    (StatusCode::OK, JSON_HEADERS, document.to_owned()).into_response()
}

fn text_rsp(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, HeaderValue::from_static(TEXT_PLAIN)), NOSNIFF],
        body,
    )
        .into_response()
}

/// The apiserver healthz root handler (`k8s.io/apiserver/pkg/server/healthz`) with its default
/// check list, `ping`, which never fails. `query` is the raw query string.
pub fn ping_healthz_rsp(query: &str) -> Response {
    const CHECKS: [&str; 1] = ["ping"];
    let pairs = query_pairs(query);
    let verbose = pairs.iter().any(|(k, _)| k == "verbose");
    let mut excluded: std::collections::BTreeSet<&str> = pairs
        .iter()
        .filter(|(k, _)| k == "exclude")
        .map(|(_, v)| v.as_str())
        .collect();
    if !verbose {
        return text_rsp(StatusCode::OK, "ok".into());
    }
    let mut out = String::new();
    for check in CHECKS {
        if excluded.remove(check) {
            out.push_str(&format!("[+]{check} excluded: ok\n"));
        } else {
            out.push_str(&format!("[+]{check} ok\n"));
        }
    }
    if !excluded.is_empty() {
        let names: Vec<String> = excluded.iter().map(|n| go_quote(n)).collect();
        out.push_str(&format!(
            "warn: some health checks cannot be excluded: no matches for {}\n",
            names.join(",")
        ));
    }
    out.push_str("healthz check passed\n");
    text_rsp(StatusCode::OK, out)
}

/// Go's `url.ParseQuery`, leniently: `k=v` pairs split on `&`, `+` and `%XX` decoded.
pub(crate) fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (unescape(k), unescape(v))
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Go's `%q` for the strings we quote (Kubernetes names and check names): a JSON string
/// literal agrees with it on everything but exotic control characters.
fn go_quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

// === service health-check node ports ===

/// `(namespace, name)` of a Service.
pub type ServiceKey = (String, String);

/// The per-Service health-check servers (upstream's `ServiceHealthServer`). Cloning shares the
/// servers; dropping the last clone stops them all.
#[derive(Clone)]
pub struct ServiceHealthServers(Arc<HcShared>);

struct HcShared {
    node_name: String,
    /// Node-port addresses to listen on; empty means the wildcard address.
    addresses: Vec<IpAddr>,
    health: ProxyHealth,
    /// Serialises `sync_services` (upstream holds its lock for the whole sync).
    sync: tokio::sync::Mutex<()>,
    services: Mutex<BTreeMap<ServiceKey, HcInstance>>,
}

struct HcInstance {
    port: u16,
    /// Local ready endpoints, from the last `sync_endpoints`.
    endpoints: usize,
    servers: Vec<HcServer>,
}

/// One serving listener. Dropping it (which drops `stop`) stops the server.
struct HcServer {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    /// Completes (with an error) once the listening socket has been closed.
    closed: oneshot::Receiver<()>,
}

/// A listener that reports, by dropping `_closed`, when its socket is gone; a port can then be
/// re-bound at once, as after Go's synchronous `Server.Close`.
struct TrackedListener {
    inner: TcpListener,
    _closed: oneshot::Sender<()>,
}

impl axum::serve::Listener for TrackedListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        axum::serve::Listener::accept(&mut self.inner).await
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

#[derive(Clone)]
struct HcHandlerState {
    // Weak, so running servers do not keep their owner alive.
    shared: Weak<HcShared>,
    key: ServiceKey,
}

// === impl ServiceHealthServers ===

impl ServiceHealthServers {
    /// `addresses` are the node-port addresses to listen on (one listener per address and
    /// Service); empty listens on the wildcard address, like upstream's match-all case.
    pub fn new(node_name: impl Into<String>, addresses: Vec<IpAddr>, health: ProxyHealth) -> ServiceHealthServers {
        ServiceHealthServers(Arc::new(HcShared {
            node_name: node_name.into(),
            addresses,
            health,
            sync: tokio::sync::Mutex::new(()),
            services: Mutex::new(BTreeMap::new()),
        }))
    }

    /// Makes `ports` (Service → health-check node port) the set being served: closes servers of
    /// Services that are gone or whose port changed, opens the missing ones, leaves the rest.
    /// Returns one message per Service whose port could not be opened (upstream logs these and
    /// emits a `FailedToStartServiceHealthcheck` Warning event); those are retried next time.
    pub async fn sync_services(&self, ports: BTreeMap<ServiceKey, u16>) -> Vec<String> {
        let _sync = self.0.sync.lock().await;

        let stale: Vec<(ServiceKey, HcInstance)> = {
            let mut services = self.0.lock();
            let keys: Vec<ServiceKey> = services
                .iter()
                .filter(|(key, inst)| ports.get(*key) != Some(&inst.port))
                .map(|(key, _)| key.clone())
                .collect();
            keys.into_iter().filter_map(|k| services.remove_entry(&k)).collect()
        };
        for ((ns, name), inst) in stale {
            tracing::debug!(service = %format!("{ns}/{name}"), port = inst.port, "Closing healthcheck");
            inst.close().await;
        }

        let mut errors = Vec::new();
        for (key, &port) in &ports {
            if self.0.lock().contains_key(key) {
                continue;
            }
            let (ns, name) = key;
            tracing::debug!(service = %format!("{ns}/{name}"), port, "Opening healthcheck");
            match self.open(key, port) {
                Ok(inst) => {
                    self.0.lock().insert(key.clone(), inst);
                }
                Err((addr, err)) => {
                    tracing::error!(%err, node = %self.0.node_name, service = %format!("{ns}/{name}"), port, "Failed to start healthcheck");
                    errors.push(format!(
                        "node {} failed to start healthcheck {} on port {port}: listen tcp {addr}: {err}",
                        self.0.node_name,
                        go_quote(&format!("{ns}/{name}")),
                    ));
                }
            }
        }
        errors
    }

    /// Records the number of local ready endpoints per Service. Services without a
    /// health-check server are ignored; served Services missing from the map get 0.
    pub fn sync_endpoints(&self, local_ready: BTreeMap<ServiceKey, usize>) {
        let mut services = self.0.lock();
        for (key, inst) in services.iter_mut() {
            inst.endpoints = local_ready.get(key).copied().unwrap_or(0);
        }
    }

    /// The addresses a Service's health check is listening on (empty if it is not served).
    pub fn local_addrs(&self, namespace: &str, name: &str) -> Vec<SocketAddr> {
        let key = (namespace.to_owned(), name.to_owned());
        self.0
            .lock()
            .get(&key)
            .map(|i| i.servers.iter().map(|s| s.local_addr).collect())
            .unwrap_or_default()
    }

    /// Binds every address for `key`, then starts serving. On failure nothing stays open, so
    /// the next sync retries cleanly.
    fn open(&self, key: &ServiceKey, port: u16) -> Result<HcInstance, (SocketAddr, io::Error)> {
        let mut listeners = Vec::new();
        if self.0.addresses.is_empty() {
            listeners.push(bind_wildcard(port)?);
        } else {
            for ip in &self.0.addresses {
                let addr = SocketAddr::new(*ip, port);
                listeners.push(bind(addr).map_err(|e| (addr, e))?);
            }
        }
        let servers = listeners.into_iter().map(|l| self.spawn_server(key, l)).collect();
        Ok(HcInstance {
            port,
            endpoints: 0,
            servers,
        })
    }

    fn spawn_server(&self, key: &ServiceKey, listener: TcpListener) -> HcServer {
        let local_addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)));
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (closed_tx, closed_rx) = oneshot::channel::<()>();
        let listener = TrackedListener {
            inner: listener,
            _closed: closed_tx,
        };
        let state = HcHandlerState {
            shared: Arc::downgrade(&self.0),
            key: key.clone(),
        };
        let router = Router::new()
            .fallback(|State(s): State<HcHandlerState>| async move { service_health_rsp(&s) })
            .with_state(state);
        let service = format!("{}/{}", key.0, key.1);
        tokio::spawn(async move {
            // Either an explicit stop or the sender being dropped ends the server.
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            match serve::serve(listener, router, shutdown).await {
                Ok(()) => tracing::trace!(%service, address = %local_addr, "Healthcheck closed"),
                Err(err) => tracing::error!(%err, %service, "Healthcheck closed"),
            }
        });
        HcServer {
            local_addr,
            stop: Some(stop_tx),
            closed: closed_rx,
        }
    }
}

impl HcShared {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<ServiceKey, HcInstance>> {
        // Every update is a single insert/remove/assignment, so a poisoned map is still whole.
        self.services.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for ServiceHealthServers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ports: BTreeMap<ServiceKey, u16> = self.0.lock().iter().map(|(k, i)| (k.clone(), i.port)).collect();
        f.debug_struct("ServiceHealthServers")
            .field("node_name", &self.0.node_name)
            .field("ports", &ports)
            .finish()
    }
}

impl HcInstance {
    /// Stops every server and waits until its socket is closed, so the port is free again.
    async fn close(self) {
        for mut server in self.servers {
            if let Some(stop) = server.stop.take() {
                let _ = stop.send(());
            }
            // The server task drops the listener right after the stop signal; bound the wait so a
            // wedged task cannot stall the sync loop.
            if tokio::time::timeout(Duration::from_secs(5), &mut server.closed)
                .await
                .is_err()
            {
                tracing::warn!(address = %server.local_addr, "Healthcheck listener did not close in time");
            }
        }
    }
}

/// Binds like Go's `net.Listen`: `SO_REUSEADDR` set, so a port whose old connections linger in
/// TIME_WAIT can be re-opened at once, and a backlog of [`listen_backlog`]. Needs a tokio
/// runtime.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(listen_backlog())
}

/// Go's listen backlog: `net.core.somaxconn` of this network namespace (at most 65,535; 4,096,
/// the kernel's default, where it cannot be read). A burst of connections beyond a smaller
/// backlog overflows the accept queue, and a client whose SYN is dropped there retries only
/// after a second.
pub fn listen_backlog() -> u32 {
    let read = std::fs::read_to_string("/proc/sys/net/core/somaxconn");
    backlog_of(read.ok().as_deref())
}

fn backlog_of(somaxconn: Option<&str>) -> u32 {
    match somaxconn.and_then(|s| s.trim().parse::<u32>().ok()) {
        Some(n) => n.clamp(1, 65535),
        None => 4096,
    }
}

/// Go listens on `0.0.0.0` as a dual-stack `[::]` socket; do the same, falling back to IPv4 on
/// hosts without IPv6.
fn bind_wildcard(port: u16) -> Result<TcpListener, (SocketAddr, io::Error)> {
    let v6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
    match bind(v6) {
        Ok(l) => Ok(l),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::EAFNOSUPPORT | nix::libc::EADDRNOTAVAIL)
            ) =>
        {
            let v4 = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
            bind(v4).map_err(|e| (v4, e))
        }
        Err(e) => Err((SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port), e)),
    }
}

/// upstream's `hcHandler`.
fn service_health_rsp(st: &HcHandlerState) -> Response {
    let count = st.shared.upgrade().and_then(|shared| {
        let count = shared.lock().get(&st.key).map(|i| i.endpoints)?;
        Some((count, shared.health.is_healthy()))
    });
    let Some((count, proxy_healthy)) = count else {
        // Upstream logs and writes nothing, which Go turns into an empty 200.
        tracing::error!(service = %format!("{}/{}", st.key.0, st.key.1), "Received request for closed healthcheck");
        return StatusCode::OK.into_response();
    };
    let status = if count != 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let weight = HeaderValue::from(count);
    let body = service_health_body(&st.key.0, &st.key.1, count, proxy_healthy);
    (
        status,
        JSON_HEADERS,
        [(HeaderName::from_static("x-load-balancing-endpoint-weight"), weight)],
        body,
    )
        .into_response()
}

/// The health-check node port body: upstream's dedented, tab-indented template with the
/// surrounding newlines trimmed (so no trailing newline).
pub fn service_health_body(namespace: &str, name: &str, local_endpoints: usize, proxy_healthy: bool) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        go_quote(namespace),
        go_quote(name),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::healthz::test_clock::ManualClock;
    use crate::model::IpFamily;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TIMEOUT: Duration = Duration::from_secs(10);
    const HEALTH_TIMEOUT: Duration = Duration::from_secs(60);

    #[test]
    fn the_backlog_is_somaxconn_as_go_listens() {
        assert_eq!(backlog_of(Some("4096\n")), 4096);
        assert_eq!(backlog_of(Some("100000")), 65535);
        assert_eq!(backlog_of(Some("0")), 1);
        assert_eq!(backlog_of(None), 4096);
        assert_eq!(backlog_of(Some("x")), 4096);
    }

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    /// A minimal HTTP/1.1 client: one request, `Connection: close`, read to EOF.
    async fn get(addr: SocketAddr, path: &str) -> io::Result<Reply> {
        let exchange = async {
            let mut s = TcpStream::connect(addr).await?;
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes())
                .await?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).await?;
            Ok::<_, io::Error>(String::from_utf8_lossy(&raw).into_owned())
        };
        let raw = tokio::time::timeout(TIMEOUT, exchange)
            .await
            .map_err(|_| io::Error::other("timed out"))??;
        let (head, body) = raw
            .split_once("\r\n\r\n")
            .ok_or_else(|| io::Error::other(format!("no header end: {raw:?}")))?;
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        Ok(Reply {
            status,
            headers,
            body: body.to_owned(),
        })
    }

    struct Running {
        addr: SocketAddr,
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<io::Result<()>>,
    }

    async fn start(router: Router) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, async move {
            let _ = rx.await;
        }));
        Running {
            addr,
            stop: Some(tx),
            task,
        }
    }

    fn health() -> (ProxyHealth, ManualClock) {
        let clock = ManualClock::new();
        (ProxyHealth::with_clock(HEALTH_TIMEOUT, clock.clock()), clock)
    }

    fn key(ns: &str, name: &str) -> ServiceKey {
        (ns.to_owned(), name.to_owned())
    }

    /// Two distinct ports that were free a moment ago.
    fn free_ports() -> (u16, u16) {
        let probe = || std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
        let (a, b) = (probe(), probe());
        let port = |l: &std::net::TcpListener| l.local_addr().expect("probe addr").port();
        (port(&a), port(&b))
    }

    #[tokio::test]
    async fn healthz_follows_queued_and_applied_updates() {
        let (health, clock) = health();
        let metrics = Arc::new(Metrics::new("iptables"));
        let srv = start(healthz_router(health.clone(), metrics.clone())).await;

        health.updated(IpFamily::V4);
        let r = get(srv.addr, "/healthz").await.expect("GET /healthz");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert!(
            r.body.starts_with(r#"{"lastUpdated":"2024-01-01T10:00:00Z","#),
            "{}",
            r.body
        );

        health.queued_update(IpFamily::V4);
        clock.advance(HEALTH_TIMEOUT);
        let r = get(srv.addr, "/healthz").await.expect("GET /healthz");
        assert_eq!(r.status, 503);
        assert!(r.body.contains(r#""healthy":false"#), "{}", r.body);

        health.updated(IpFamily::V4);
        assert_eq!(get(srv.addr, "/healthz").await.expect("GET /healthz").status, 200);

        let text = metrics.encode();
        assert!(
            text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1\n"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn livez_ignores_node_eligibility() {
        let (health, _) = health();
        let metrics = Arc::new(Metrics::new("iptables"));
        let srv = start(healthz_router(health.clone(), metrics)).await;
        health.set_node_eligible(false);

        let hz = get(srv.addr, "/healthz").await.expect("GET /healthz");
        assert_eq!(hz.status, 503);
        assert!(hz.body.contains(r#""nodeEligible":false"#));
        let lz = get(srv.addr, "/livez").await.expect("GET /livez");
        assert_eq!(lz.status, 200);
        assert!(!lz.body.contains("nodeEligible"), "{}", lz.body);
    }

    #[tokio::test]
    async fn unknown_paths_get_gos_404() {
        let (health, _) = health();
        let srv = start(healthz_router(health, Arc::new(Metrics::new("iptables")))).await;
        let r = get(srv.addr, "/healthz/extra").await.expect("GET");
        assert_eq!(r.status, 404);
        assert_eq!(r.body, "404 page not found\n");
        assert_eq!(r.header("content-type"), Some(TEXT_PLAIN));
    }

    #[tokio::test]
    async fn metrics_server_serves_metrics_mode_configz_and_ping() {
        let (health, _) = health();
        let metrics = Arc::new(Metrics::new("iptables"));
        metrics.service_changes_total.inc();
        let config = serde_json::json!({ "mode": "iptables" });
        let srv = start(metrics_router(metrics, health, "iptables", config)).await;

        let r = get(srv.addr, "/metrics").await.expect("GET /metrics");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some(metrics::TEXT_CONTENT_TYPE));
        assert!(
            r.body
                .contains("# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter\n")
        );
        assert!(r.body.contains("kubeproxy_sync_proxy_rules_service_changes_total 1\n"));

        let r = get(srv.addr, "/proxyMode").await.expect("GET /proxyMode");
        assert_eq!((r.status, r.body.as_str()), (200, "iptables"));
        assert_eq!(r.header("content-type"), Some(TEXT_PLAIN));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));

        let r = get(srv.addr, "/configz").await.expect("GET /configz");
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, r#"{"kubeproxy.config.k8s.io":{"mode":"iptables"}}"#)
        );
        assert_eq!(r.header("content-type"), Some("application/json"));

        for path in ["/healthz", "/healthz/ping"] {
            let r = get(srv.addr, path).await.expect("GET healthz");
            assert_eq!((r.status, r.body.as_str()), (200, "ok"), "{path}");
        }
        assert_eq!(get(srv.addr, "/livez").await.expect("GET /livez").status, 404);
    }

    #[tokio::test]
    async fn metrics_server_healthz_is_apiserver_style() {
        let (health, _) = health();
        let srv = start(metrics_router(
            Arc::new(Metrics::new("iptables")),
            health,
            "iptables",
            serde_json::Value::Null,
        ))
        .await;
        let addr = srv.addr;
        let body = move |path: &'static str| async move { get(addr, path).await.expect("GET").body };
        assert_eq!(body("/healthz?verbose").await, "[+]ping ok\nhealthz check passed\n");
        assert_eq!(
            body("/healthz?verbose=1&exclude=ping").await,
            "[+]ping excluded: ok\nhealthz check passed\n"
        );
        assert_eq!(
            body("/healthz?verbose&exclude=etcd").await,
            "[+]ping ok\nwarn: some health checks cannot be excluded: no matches for \"etcd\"\nhealthz check passed\n"
        );
        assert_eq!(body("/healthz?exclude=ping").await, "ok");
    }

    #[tokio::test]
    async fn serve_returns_after_shutdown() {
        let (health, _) = health();
        let mut srv = start(healthz_router(health, Arc::new(Metrics::new("iptables")))).await;
        if let Some(stop) = srv.stop.take() {
            let _ = stop.send(());
        }
        let res = tokio::time::timeout(TIMEOUT, &mut srv.task)
            .await
            .expect("serve stops")
            .expect("task joins");
        assert!(res.is_ok());
        assert!(TcpStream::connect(srv.addr).await.is_err(), "listener still open");
    }

    #[test]
    fn service_health_body_is_upstreams_template() {
        assert_eq!(
            service_health_body("ns", "svc", 2, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"svc\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }

    #[tokio::test]
    async fn service_health_port_reports_local_endpoints() {
        let (health, clock) = health();
        let hcs = ServiceHealthServers::new("node-1", vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], health.clone());
        let errors = hcs.sync_services(BTreeMap::from([(key("ns", "svc"), 0)])).await;
        assert!(errors.is_empty(), "{errors:?}");
        let addrs = hcs.local_addrs("ns", "svc");
        assert_eq!(addrs.len(), 1);
        let addr = addrs[0];

        let r = get(addr, "/").await.expect("GET /");
        assert_eq!(r.status, 503);
        assert_eq!(r.body, service_health_body("ns", "svc", 0, true));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("0"));

        // Unknown Services are ignored.
        hcs.sync_endpoints(BTreeMap::from([(key("ns", "svc"), 2), (key("ns", "other"), 5)]));
        let r = get(addr, "/any/path?x=1").await.expect("GET any path");
        assert_eq!(r.status, 200);
        assert_eq!(
            r.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"svc\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("2"));

        // An unhealthy proxy fails the check even with endpoints.
        health.updated(IpFamily::V4);
        health.queued_update(IpFamily::V4);
        clock.advance(HEALTH_TIMEOUT);
        let r = get(addr, "/").await.expect("GET /");
        assert_eq!(r.status, 503);
        assert_eq!(r.body, service_health_body("ns", "svc", 2, false));

        // A Service missing from the endpoint map drops to 0.
        health.updated(IpFamily::V4);
        hcs.sync_endpoints(BTreeMap::new());
        assert_eq!(get(addr, "/").await.expect("GET /").status, 503);
    }

    #[tokio::test]
    async fn sync_services_closes_removed_and_reopens_moved_ports() {
        let (health, _) = health();
        let hcs = ServiceHealthServers::new("node-1", vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], health);
        let (p1, p2) = free_ports();
        let ports = BTreeMap::from([(key("ns", "a"), p1), (key("ns", "b"), 0)]);
        assert!(hcs.sync_services(ports).await.is_empty());
        let a1 = SocketAddr::from((Ipv4Addr::LOCALHOST, p1));
        let b = hcs.local_addrs("ns", "b")[0];
        hcs.sync_endpoints(BTreeMap::from([(key("ns", "a"), 1), (key("ns", "b"), 1)]));
        assert_eq!(get(a1, "/").await.expect("GET a").status, 200);

        // "a" moves to p2: the old port closes, the new one starts with no endpoints known.
        let ports = BTreeMap::from([(key("ns", "a"), p2), (key("ns", "b"), 0)]);
        assert!(hcs.sync_services(ports).await.is_empty());
        assert!(TcpStream::connect(a1).await.is_err(), "old port still open");
        let a2 = SocketAddr::from((Ipv4Addr::LOCALHOST, p2));
        assert_eq!(hcs.local_addrs("ns", "a"), vec![a2]);
        assert_eq!(get(a2, "/").await.expect("GET a2").status, 503);
        // "b" was left alone, endpoint count included.
        assert_eq!(hcs.local_addrs("ns", "b"), vec![b]);
        assert_eq!(get(b, "/").await.expect("GET b").status, 200);

        // Removing everything closes everything, and the port can be taken again at once.
        assert!(hcs.sync_services(BTreeMap::new()).await.is_empty());
        assert!(TcpStream::connect(a2).await.is_err(), "removed port still open");
        assert!(TcpStream::connect(b).await.is_err(), "removed port still open");
        assert!(hcs.local_addrs("ns", "a").is_empty());
        assert!(
            hcs.sync_services(BTreeMap::from([(key("ns", "c"), p2)]))
                .await
                .is_empty()
        );
    }

    #[tokio::test]
    async fn listen_failures_are_reported_and_retried() {
        let (health, _) = health();
        let hcs = ServiceHealthServers::new("node-1", vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], health);
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").expect("bind squatter");
        let port = squatter.local_addr().expect("addr").port();

        let errors = hcs.sync_services(BTreeMap::from([(key("ns", "svc"), port)])).await;
        assert_eq!(errors.len(), 1, "{errors:?}");
        let prefix =
            format!("node node-1 failed to start healthcheck \"ns/svc\" on port {port}: listen tcp 127.0.0.1:{port}: ");
        assert!(errors[0].starts_with(&prefix), "{}", errors[0]);
        assert!(hcs.local_addrs("ns", "svc").is_empty());

        drop(squatter);
        assert!(
            hcs.sync_services(BTreeMap::from([(key("ns", "svc"), port)]))
                .await
                .is_empty()
        );
        assert_eq!(
            hcs.local_addrs("ns", "svc"),
            vec![SocketAddr::from((Ipv4Addr::LOCALHOST, port))]
        );
    }

    #[tokio::test]
    async fn no_addresses_listens_on_the_wildcard() {
        let (health, _) = health();
        let hcs = ServiceHealthServers::new("node-1", Vec::new(), health);
        assert!(
            hcs.sync_services(BTreeMap::from([(key("ns", "svc"), 0)]))
                .await
                .is_empty()
        );
        let addrs = hcs.local_addrs("ns", "svc");
        assert_eq!(addrs.len(), 1);
        assert!(addrs[0].ip().is_unspecified(), "{addrs:?}");
        // Dual-stack (or plain IPv4) wildcard: reachable over IPv4 loopback.
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, addrs[0].port()));
        assert_eq!(get(v4, "/").await.expect("GET over IPv4").status, 503);
    }

    #[tokio::test]
    async fn dropping_the_handle_stops_the_servers() {
        let (health, _) = health();
        let hcs = ServiceHealthServers::new("node-1", vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], health);
        assert!(
            hcs.sync_services(BTreeMap::from([(key("ns", "svc"), 0)]))
                .await
                .is_empty()
        );
        let addr = hcs.local_addrs("ns", "svc")[0];
        drop(hcs);
        // The stop is asynchronous here; poll briefly for the port to close.
        let closed = async {
            while TcpStream::connect(addr).await.is_ok() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(TIMEOUT, closed)
            .await
            .expect("port closes after drop");
    }

    #[test]
    fn query_strings_are_decoded_like_go() {
        assert_eq!(
            query_pairs("verbose&exclude=a%2Fb&exclude=c+d&&x="),
            vec![
                ("verbose".into(), "".into()),
                ("exclude".into(), "a/b".into()),
                ("exclude".into(), "c d".into()),
                ("x".into(), "".into())
            ]
        );
        assert_eq!(unescape("%zz%4"), "%zz%4");
    }
}
