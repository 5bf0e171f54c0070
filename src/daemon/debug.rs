//! The daemon's read-only `/debug` endpoints, served on the metrics server next to upstream's
//! `/metrics`, `/proxyMode` and `/configz`:
//! - `/debug/services` (optionally `?service=[NAMESPACE/]NAME[:PORT]`): the model's view of
//!   every service port of each family as the last sync wanted it (endpoints
//!   with their conditions, node, zone, hints and locality; the category each fell into and
//!   why; where each kind of traffic goes), the last sync of each family (time, full or not,
//!   result or error) and whether the source reaches its objects; for one Service also the
//!   rule lines the mode programs for it. JSON ([`crate::explain::view::ServicesView`]).
//! - `/debug/rules`: what the daemon last programmed, per family, in the mode's own syntax (as
//!   `kube-proxy render` prints it).
//!
//! Only loopback peers get an answer (403 otherwise) unless the daemon runs with
//! `--debug-allow-remote`: the view names every Service and endpoint of the cluster.
//!
//! The sync loop publishes into a [`DebugView`] after each sync (a state is a vector of shared
//! pointers: cheap); the JSON and the rules are computed when asked, off the HTTP runtime's
//! thread.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use axum::Router;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{Extension, RawQuery, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;

use crate::app;
use crate::config::ProxyConfig;
use crate::explain::rules::DesiredRules;
use crate::explain::view::{FamilyView, NodeView, ServiceRef, ServicesView, SyncInfo, Topology, family_view};
use crate::healthz::JSON_HEADERS;
use crate::model::{IpFamily, ProxyState};
use crate::source::status::rfc3339;
use crate::source::{SourceHealth, SourceStatus};

/// What the sync loop last did, per family, and the source's status; shared with the
/// `/debug` handlers.
#[derive(Clone, Debug, Default)]
pub struct DebugView(Arc<RwLock<Published>>);

#[derive(Clone, Debug, Default)]
struct Published {
    families: BTreeMap<IpFamily, Record>,
    /// Set once the source has started.
    source: Option<SourceStatus>,
    /// iptables mode counts localhost NodePort packets into the nfacct counters.
    nfacct: bool,
}

#[derive(Clone, Debug, Default)]
struct Record {
    /// The state of the last successful sync (what the kernel holds).
    state: Option<ProxyState>,
    /// The state of the last sync, successful or not (what the daemon wants).
    wanted: Option<ProxyState>,
    last: Option<SyncInfo>,
    last_success: Option<String>,
}

impl DebugView {
    fn update(&self, family: IpFamily, f: impl FnOnce(&mut Record)) {
        let mut published = self.0.write().unwrap_or_else(|e| e.into_inner());
        f(published.families.entry(family).or_default());
    }

    fn records(&self) -> BTreeMap<IpFamily, Record> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).families.clone()
    }

    /// The source whose status `/debug/services` reports.
    pub fn set_source(&self, status: SourceStatus) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).source = Some(status);
    }

    /// Whether iptables mode's rules count into the nfacct counters (they exist).
    pub fn set_nfacct(&self, counted: bool) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).nfacct = counted;
    }

    fn source(&self) -> SourceHealth {
        let published = self.0.read().unwrap_or_else(|e| e.into_inner());
        published.source.as_ref().map(SourceStatus::health).unwrap_or_default()
    }

    /// `state` was programmed by a sync (`full` or not).
    pub fn synced(&self, state: &ProxyState, full: bool) {
        let now = rfc3339(SystemTime::now());
        self.update(state.family, |r| {
            r.state = Some(state.clone());
            r.wanted = Some(state.clone());
            r.last_success = Some(now.clone());
            r.last = Some(SyncInfo {
                time: now.clone(),
                full,
                result: "ok".into(),
                error: None,
                last_success: Some(now),
            });
        });
    }

    /// A sync of `state` failed; the kernel keeps the last successful sync's rules.
    pub fn failed(&self, state: &ProxyState, full: bool, error: &str) {
        let now = rfc3339(SystemTime::now());
        self.update(state.family, |r| {
            r.wanted = Some(state.clone());
            r.last = Some(SyncInfo {
                time: now,
                full,
                result: "error".into(),
                error: Some(error.to_string()),
                last_success: r.last_success.clone(),
            });
        });
    }

    /// The view `/debug/services` answers, of one Service's ports or of all.
    pub fn services(&self, cfg: &ProxyConfig, only: Option<&ServiceRef>) -> ServicesView {
        let records = self.records();
        let node = records
            .values()
            .find_map(|r| r.wanted.as_ref().map(|s| s.node.clone()))
            .unwrap_or_else(|| crate::model::NodeInfo {
                name: cfg.node_name(),
                ..crate::model::NodeInfo::default()
            });
        let topology = Topology {
            node: &node,
            prefer_same_node: cfg.feature_enabled("PreferSameTrafficDistribution"),
            mode: cfg.mode,
        };
        let nfacct = self.0.read().unwrap_or_else(|e| e.into_inner()).nfacct;
        let families = records
            .into_iter()
            .map(|(family, r)| match &r.wanted {
                Some(wanted) => {
                    let mut state = wanted.clone();
                    if let Some(only) = only {
                        state.service_ports.retain(|p| {
                            p.port.name.namespace == only.namespace
                                && p.port.name.name == only.name
                                && only
                                    .port
                                    .as_deref()
                                    .is_none_or(|x| x == p.port.name.port || x == p.port.port.to_string())
                        });
                    }
                    let mut view = family_view(&state, &topology, r.last.clone());
                    if only.is_some() {
                        // Rendered on the whole state: some rules depend on its size
                        // (iptables mode drops comments beyond 1,000 endpoints).
                        let desired = DesiredRules::counted(cfg, cfg.mode, wanted, nfacct);
                        for (v, sps) in view.service_ports.iter_mut().zip(&state.service_ports) {
                            v.rules = desired.of(sps).sections;
                        }
                    }
                    view
                }
                None => FamilyView {
                    family: family.as_str().into(),
                    last_sync: r.last.clone(),
                    ..FamilyView::default()
                },
            })
            .collect();
        ServicesView {
            mode: cfg.mode.as_str().into(),
            node: NodeView::of(&node),
            source: self.source(),
            families,
        }
    }

    /// What `/debug/rules` answers: each family's last programmed rules, as `render` prints
    /// them.
    pub fn rules(&self, cfg: &ProxyConfig) -> String {
        let mut out = String::new();
        for (family, r) in self.records() {
            let when = r.last_success.as_deref().unwrap_or("never");
            out.push_str(&format!(
                "# {family}: programmed by the last successful sync ({when})\n"
            ));
            if let Some(state) = &r.state {
                out.push_str(&app::render(cfg, state).text);
            }
            out.push('\n');
        }
        out
    }
}

/// What the `/debug` handlers need.
#[derive(Clone)]
pub struct DebugServer {
    pub view: DebugView,
    pub config: Arc<ProxyConfig>,
    /// `--debug-allow-remote`: answer peers beyond loopback too.
    pub allow_remote: bool,
}

/// The peer's address, as `serve` hands it over (absent when not served over TCP).
type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// `/debug/services` and `/debug/rules` (no fallback: merged into the metrics router).
pub fn router(server: DebugServer) -> Router {
    Router::new()
        .route(
            "/debug/services",
            any(
                |State(s): State<DebugServer>, peer: Peer, RawQuery(q): RawQuery| async move {
                    let q = q.unwrap_or_default();
                    answer(&s, peer, move |s| services_rsp(s, &q)).await
                },
            ),
        )
        .route(
            "/debug/rules",
            any(|State(s): State<DebugServer>, peer: Peer| async move { answer(&s, peer, rules_rsp).await }),
        )
        .with_state(server)
}

/// Checks the peer, then builds the answer on a blocking thread (rendering 10^5 endpoints
/// takes a moment; the healthz server shares this runtime).
async fn answer(
    s: &DebugServer,
    peer: Peer,
    build: impl FnOnce(&DebugServer) -> Response + Send + 'static,
) -> Response {
    if let Some(denied) = refused(peer, s.allow_remote) {
        return denied;
    }
    let s = s.clone();
    tokio::task::spawn_blocking(move || build(&s))
        .await
        .unwrap_or_else(|e| text(StatusCode::INTERNAL_SERVER_ERROR, format!("building the answer: {e}\n")))
}

/// The answer to a peer that may not ask, if this one may not.
pub fn refused(peer: Peer, allow_remote: bool) -> Option<Response> {
    let loopback = peer.is_some_and(|Extension(ConnectInfo(a))| a.ip().is_loopback());
    (!loopback && !allow_remote).then(|| {
        text(
            StatusCode::FORBIDDEN,
            "the /debug endpoints answer loopback clients only (start kube-proxy with --debug-allow-remote to change that)\n"
                .to_string(),
        )
    })
}

/// The `/debug/services` answer for the raw query string `query`.
pub fn services_rsp(s: &DebugServer, query: &str) -> Response {
    let only = crate::http::query_pairs(query)
        .into_iter()
        .find(|(k, _)| k == "service")
        .map(|(_, v)| ServiceRef::parse(&v));
    let only = match only.transpose() {
        Ok(o) => o,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("invalid service: {e}\n")),
    };
    let view = s.view.services(&s.config, only.as_ref());
    match serde_json::to_string(&view) {
        Ok(body) => (StatusCode::OK, JSON_HEADERS, body).into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the view: {e}\n")),
    }
}

/// The `/debug/rules` answer.
pub fn rules_rsp(s: &DebugServer) -> Response {
    text(StatusCode::OK, s.view.rules(&s.config))
}

fn text(status: StatusCode, body: String) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        )],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt as _;

    use super::*;
    use crate::config::{Flags, ProxyMode};
    use crate::model::{Protocol, testing};

    fn server(allow_remote: bool) -> DebugServer {
        let flags = Flags {
            hostname_override: Some("node-a".into()),
            proxy_mode: Some(ProxyMode::Iptables.as_str().into()),
            cluster_cidr: Some("10.244.0.0/16".into()),
            ..Flags::default()
        };
        let view = DebugView::default();
        let state = testing::state(
            vec![
                testing::port("ns", "web", 1, Protocol::Tcp, &[1, 2]),
                testing::port("ns", "db", 2, Protocol::Tcp, &[]),
            ],
            &[],
        );
        view.synced(&state, true);
        view.failed(&state, false, "iptables-restore: line 3 failed");
        let source = SourceStatus::new("api");
        source.failed("Service", "connection refused");
        view.set_source(source);
        DebugServer {
            view,
            config: Arc::new(ProxyConfig::resolve(&flags).expect("valid")),
            allow_remote,
        }
    }

    async fn get(s: DebugServer, uri: &str, peer: &str) -> (StatusCode, String) {
        let peer: SocketAddr = peer.parse().expect("an address");
        let req = Request::get(uri)
            .extension(ConnectInfo(peer))
            .body(Body::empty())
            .expect("a request");
        let rsp = router(s).oneshot(req).await.expect("answers");
        let status = rsp.status();
        let body = axum::body::to_bytes(rsp.into_body(), usize::MAX).await.expect("a body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn services_shows_ports_endpoints_and_the_last_sync() {
        let (status, body) = get(server(false), "/debug/services", "127.0.0.1:5000").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let view: ServicesView = serde_json::from_str(&body).expect("the view");
        assert_eq!(view.mode, "iptables");
        assert_eq!(view.node.name, "node-a");
        assert_eq!(view.source.kind, "api");
        assert!(view.source.unreachable_since.is_some());
        assert_eq!(view.source.errors["Service"], "connection refused");
        let v4 = &view.families[0];
        let sync = v4.last_sync.as_ref().expect("synced");
        assert_eq!((sync.result.as_str(), sync.full), ("error", false));
        assert_eq!(sync.error.as_deref(), Some("iptables-restore: line 3 failed"));
        assert!(sync.last_success.is_some());
        let names: Vec<&str> = v4.service_ports.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, vec!["ns/db:p", "ns/web:p"]);
        assert_eq!(v4.service_ports[0].programmed.internal.verdict, "REJECT");
        assert_eq!(v4.service_ports[1].endpoints[0].categories, vec!["cluster"]);
        assert!(v4.service_ports[1].rules.is_empty(), "rules only for one Service");
    }

    #[tokio::test]
    async fn one_service_comes_with_its_rules() {
        let (status, body) = get(server(false), "/debug/services?service=ns/web", "[::1]:5000").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let view: ServicesView = serde_json::from_str(&body).expect("the view");
        let ports = &view.families[0].service_ports;
        assert_eq!(ports.len(), 1);
        let lines: Vec<&String> = ports[0].rules.iter().flat_map(|s| &s.lines).collect();
        assert!(
            lines.iter().any(|l| l.contains("--to-destination 10.244.1.2:8080")),
            "{lines:#?}"
        );
        let (status, _) = get(server(false), "/debug/services?service=Bad/Name", "127.0.0.1:5000").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn rules_are_the_render_of_the_last_programmed_state() {
        let (status, body) = get(server(false), "/debug/rules", "127.0.0.1:5000").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.starts_with("# IPv4: programmed by the last successful sync ("),
            "{body}"
        );
        assert!(body.contains("*nat\n") && body.contains("-j KUBE-SVC-"), "{body}");
    }

    #[tokio::test]
    async fn only_loopback_peers_unless_allowed() {
        for uri in ["/debug/services", "/debug/rules"] {
            let (status, body) = get(server(false), uri, "192.168.49.77:5000").await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{uri}");
            assert!(body.contains("--debug-allow-remote"), "{body}");
            let (status, _) = get(server(true), uri, "192.168.49.77:5000").await;
            assert_eq!(status, StatusCode::OK, "{uri}");
        }
        // No peer address at all (not served over TCP): refused too.
        let req = Request::get("/debug/rules").body(Body::empty()).expect("a request");
        let rsp = router(server(false)).oneshot(req).await.expect("answers");
        assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
    }
}
