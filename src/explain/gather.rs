//! The gathering edge of `kube-proxy explain`, run on the node in its network namespace: the
//! desired state (from the daemon's `/debug/services`, or read from manifests or the API as
//! the daemon would), the daemon's health, the rules read back through the mode's proxiers,
//! conntrack over ctnetlink, the routes over rtnetlink, the health-check node ports, other
//! modes' leftovers. Nothing is changed on the node. What it finds becomes [`Facts`].

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::facts::{
    Connections, ConntrackFacts, DaemonFacts, Facts, HealthCheck, Leftover, PortFacts, count_connections,
};
use super::routes;
use super::rules::DesiredRules;
use super::view::{FamilyView, NodeView, PortView, ServiceRef, ServicesView, Topology, family_view};
use crate::config::{ProxyConfig, ProxyMode};
use crate::conntrack::{Netlink, Tracked};
use crate::iptables::backend::Backend;
use crate::model::{IpFamily, NodeInfo, StateBuilder, Store};
use crate::proxy::{Programmed, RenderOptions};
use crate::source::{Source, SourceHealth};
use crate::{app, daemon, manifest};

/// What was asked.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub target: Option<ServiceRef>,
    pub all: bool,
    pub from: Option<IpAddr>,
    /// `--manifests DIR`: read the objects from there.
    pub manifests: Option<PathBuf>,
    /// `--kubeconfig` was given: read the objects from the API.
    pub api: bool,
}

/// Gathering could not start (what was asked cannot be answered at all).
#[derive(Debug, thiserror::Error)]
pub enum GatherError {
    #[error("reading the manifests: {0}")]
    Manifests(#[from] manifest::ManifestError),
    #[error("reading the objects from the API server: {0}")]
    Api(String),
}

/// Set (to anything) to have explain write on stderr when each part of the gathering ended.
pub const TIMINGS_ENV: &str = "KUBE_PROXY_EXPLAIN_TIMINGS";

/// When each part of the gathering ended, for [`TIMINGS_ENV`]: the read-back runs beside
/// the node's other facts, so the parts overlap.
struct Timings {
    started: Instant,
    on: bool,
}

impl Timings {
    fn mark(&self, part: &str) {
        if self.on {
            eprintln!(
                "explain timing: {part} done at {} ms",
                self.started.elapsed().as_millis()
            );
        }
    }
}

/// How long the conntrack statistics are watched at least (drops rising, or not).
const STATS_WINDOW: Duration = Duration::from_millis(200);
const HTTP_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the initial lists of the API may take.
const API_TIMEOUT: Duration = Duration::from_secs(30);

/// Gathers every fact for `req` under the configuration `cfg`.
pub fn gather(cfg: &ProxyConfig, req: &Request) -> Result<Facts, GatherError> {
    let started = Instant::now();
    let timings = Timings {
        started,
        on: std::env::var_os(TIMINGS_ENV).is_some(),
    };
    let mut ct = Netlink::new().ok();
    let before = ct.as_mut().and_then(|c| c.statistics().ok());
    let (daemon_facts, daemon_view) = ask_daemon(cfg, req);
    timings.mark("asking the daemon");
    // The iptables backend in use on this node (the daemon's).
    let backend = crate::iptables::backend::in_use(&mut crate::iptables::backend::Host);
    let (desired_from, desired) = desired(cfg, req, daemon_view.as_ref(), backend)?;
    let mode = ProxyMode::parse(&desired.mode).unwrap_or(cfg.mode);
    let mut mcfg = cfg.clone();
    mcfg.mode = mode;
    let node = desired.node.info();
    timings.mark("the desired state");
    let mut ports = select_ports(&mcfg, req, &desired, &node);
    timings.mark("the desired rules");
    let families = families_of(&ports);
    let mut conntrack = ConntrackFacts::default();
    let mut entries: Vec<Tracked> = Vec::new();
    // The read-back waits on the kernel (a whole-table save in --all: seconds at 10,000
    // Services) while the rest of the node's facts need no ports: gather both at once.
    let (routes, leftovers) = std::thread::scope(|s| {
        s.spawn(|| {
            read_back(&mcfg, backend, req, &mut ports);
            timings.mark("reading the rules back");
        });
        let routes = routes::dump_routes().unwrap_or_default();
        timings.mark("the routes");
        match ct.as_mut() {
            Some(c) => {
                conntrack.usage = c.usage().ok();
                for family in families {
                    match c.dump(family) {
                        Ok(d) => entries.extend(d.tracked),
                        Err(e) => conntrack.error = Some(e.to_string()),
                    }
                }
            }
            None => conntrack.error = Some("no ctnetlink socket (not root, or no conntrack module)".into()),
        }
        timings.mark("conntrack");
        let leftovers: Vec<Leftover> = daemon::leftovers::OtherModes::scan(mode, backend)
            .describe()
            .into_iter()
            .map(|(m, what)| Leftover {
                mode: m.as_str().into(),
                what,
            })
            .collect();
        timings.mark("other modes' leftovers");
        (routes, leftovers)
    });
    let by_dst = index_entries(&entries);
    let routes = routes::RouteTable::new(&routes);
    for p in &mut ports {
        p.connections = connections_of(&by_dst, &p.port);
        p.routes = endpoint_routes(&routes, &p.port);
        p.health_check = health_check(&p.port);
    }
    timings.mark("per-port connections, routes and health checks");
    let ipvs_kernel_error = (mode == ProxyMode::Ipvs)
        .then(|| {
            let scheduler = crate::ipvs::render::IpvsRenderOptions::from_config(&mcfg, IpFamily::V4, &node).scheduler;
            crate::ipvs::kernel::check_kernel_read_only(&scheduler)
                .err()
                .map(|e| e.to_string())
        })
        .flatten();
    if let Some(rest) = STATS_WINDOW.checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    timings.mark("the conntrack statistics window");
    conntrack.before = before;
    conntrack.after = ct.as_mut().and_then(|c| c.statistics().ok());
    conntrack.window_ms = started.elapsed().as_millis() as u64;
    let node_port_addresses = [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .map(|f| {
            let entries = RenderOptions::from_config(&mcfg, f, &node).node_port_addresses;
            (f.as_str().to_string(), entries)
        })
        .collect();
    Ok(Facts {
        mode: mode.as_str().into(),
        from: req.from,
        desired_from,
        desired,
        daemon: daemon_facts,
        ports,
        leftovers,
        conntrack,
        ipvs_kernel_error,
        node_port_addresses,
        cluster_cidrs: cfg.cluster_cidrs.clone(),
    })
}

/// An address to reach a server bound to `addr` from this namespace (a wildcard bind is
/// reached on loopback).
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port()),
        _ => addr,
    }
}

/// `/debug/services` (of the target, or all) and `/healthz` of the daemon.
fn ask_daemon(cfg: &ProxyConfig, req: &Request) -> (DaemonFacts, Option<ServicesView>) {
    let metrics = cfg.metrics_bind_address.map(reachable);
    let healthz = cfg.healthz_bind_address.map(reachable);
    let mut facts = DaemonFacts {
        metrics_address: metrics.map_or_else(|| "nowhere (metricsBindAddress disabled)".into(), |a| a.to_string()),
        healthz_address: healthz.map_or_else(|| "nowhere".into(), |a| a.to_string()),
        ..DaemonFacts::default()
    };
    let path = match (&req.target, req.all) {
        (Some(t), false) => format!("/debug/services?service={}/{}", t.namespace, t.name),
        _ => "/debug/services".to_string(),
    };
    let mut view = None;
    match metrics.map(|a| http_get(a, &path)) {
        Some(Ok((200, body))) => match serde_json::from_str::<ServicesView>(&body) {
            Ok(v) => {
                facts.reachable = true;
                view = Some(v);
            }
            Err(e) => facts.error = Some(format!("its /debug/services does not parse: {e}")),
        },
        Some(Ok((status, body))) => facts.error = Some(format!("/debug/services answers {status}: {}", body.trim())),
        Some(Err(e)) => facts.error = Some(e),
        None => facts.error = Some("metricsBindAddress is disabled".into()),
    }
    match healthz.map(|a| http_get(a, "/healthz")) {
        Some(Ok((status, body))) => {
            facts.healthz_status = Some(status);
            facts.healthz_body = body;
        }
        Some(Err(e)) => facts.healthz_error = Some(e),
        None => {}
    }
    (facts, view)
}

/// The desired state and where it came from.
fn desired(
    cfg: &ProxyConfig,
    req: &Request,
    daemon: Option<&ServicesView>,
    backend: Backend,
) -> Result<(String, ServicesView), GatherError> {
    let (from, store, kind) = if let Some(dir) = &req.manifests {
        let objects = manifest::load_paths(&[dir])?;
        for w in &objects.warnings {
            eprintln!("warning: {w}");
        }
        let store = Store::from_objects(&objects, &cfg.node_name());
        (format!("manifests {}", dir.display()), store, "manifests")
    } else if req.api {
        (format!("the API server ({})", api_name(cfg)), api_store(cfg)?, "api")
    } else {
        let view = daemon.cloned().unwrap_or_else(|| ServicesView {
            mode: cfg.mode.as_str().into(),
            node: NodeView {
                name: cfg.node_name(),
                ..NodeView::default()
            },
            ..ServicesView::default()
        });
        return Ok(("daemon".into(), view));
    };
    let node = app::node_info_from(&store.nodes, cfg);
    let mode = daemon.and_then(|v| ProxyMode::parse(&v.mode)).unwrap_or(cfg.mode);
    let topology = Topology {
        node: &node,
        prefer_same_node: cfg.feature_enabled("PreferSameTrafficDistribution"),
        mode,
    };
    let mut builder = StateBuilder::with_store(store);
    let families = daemon::modes::families(mode, backend);
    let views = families
        .into_iter()
        .map(|f| {
            let state = builder.build(&node, f);
            // The daemon's last sync of the family, when it answers.
            let last = daemon.and_then(|d| d.families.iter().find(|x| x.family == f.as_str())?.last_sync.clone());
            family_view(&state, &topology, last)
        })
        .collect();
    let source = daemon.map_or_else(
        || SourceHealth {
            kind: kind.into(),
            ..SourceHealth::default()
        },
        |d| d.source.clone(),
    );
    Ok((
        from,
        ServicesView {
            mode: mode.as_str().into(),
            node: NodeView::of(&node),
            source,
            families: views,
        },
    ))
}

fn api_name(cfg: &ProxyConfig) -> String {
    cfg.client_connection
        .kubeconfig
        .as_ref()
        .map_or_else(|| "in-cluster".into(), |p| format!("kubeconfig {}", p.display()))
}

/// The objects as the API source lists them, once both initial lists are in.
fn api_store(cfg: &ProxyConfig) -> Result<Store, GatherError> {
    let source = Box::new(crate::source::api::KubeApi(cfg.client_connection.clone()));
    let mut running = source
        .start(&cfg.node_name())
        .map_err(|e| GatherError::Api(format!("{e:#}")))?;
    let mut builder = StateBuilder::new();
    // The source delivers from its own runtime; the channel is awaited here.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| GatherError::Api(e.to_string()))?;
    loop {
        match rt.block_on(tokio::time::timeout(API_TIMEOUT, running.updates.recv())) {
            Ok(Some(update)) => {
                let synced = update.synced;
                builder.apply(update.changes);
                if synced {
                    return Ok(builder.store().clone());
                }
            }
            Ok(None) => return Err(GatherError::Api("the API source stopped".into())),
            Err(_) => {
                return Err(GatherError::Api(format!(
                    "Services and EndpointSlices were not listed within {} s",
                    API_TIMEOUT.as_secs()
                )));
            }
        }
    }
}

/// The ports asked about, each with its desired rules (the daemon's own when it gave them).
fn select_ports(cfg: &ProxyConfig, req: &Request, desired: &ServicesView, node: &NodeInfo) -> Vec<PortFacts> {
    let mut out = Vec::new();
    for fam in &desired.families {
        let chosen: Vec<&PortView> = fam
            .service_ports
            .iter()
            .filter(|p| req.all || req.target.as_ref().is_some_and(|t| t.matches(p)))
            .collect();
        if chosen.is_empty() {
            continue;
        }
        let rules = desired_rules(cfg, fam, node, &chosen);
        for (p, desired_rules) in chosen.into_iter().zip(rules) {
            out.push(PortFacts {
                family: fam.family.clone(),
                port: p.clone(),
                desired_rules,
                actual_rules: None,
                read_back_error: None,
                connections: Connections::default(),
                routes: Vec::new(),
                health_check: None,
                node_addresses: node.addresses.clone(),
            });
        }
    }
    out
}

/// The rules the mode programs for `chosen`: from the daemon's answer when it rendered them
/// (on its whole state), else rendered here from the family's state.
fn desired_rules(cfg: &ProxyConfig, fam: &FamilyView, node: &NodeInfo, chosen: &[&PortView]) -> Vec<Programmed> {
    if chosen.iter().all(|p| !p.rules.is_empty()) {
        return chosen
            .iter()
            .map(|p| Programmed {
                sections: p.rules.clone(),
            })
            .collect();
    }
    let Ok(state) = fam.state(node) else {
        return vec![Programmed::default(); chosen.len()];
    };
    let nfacct = cfg.mode == ProxyMode::Iptables && daemon::modes::nfacct_counters_present();
    let rules = DesiredRules::counted(cfg, cfg.mode, &state, nfacct);
    let by_name: HashMap<&str, usize> = fam
        .service_ports
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    chosen
        .iter()
        .map(|p| {
            by_name
                .get(p.name.as_str())
                .and_then(|i| state.service_ports.get(*i))
                .map(|sps| rules.of(sps))
                .unwrap_or_default()
        })
        .collect()
}

/// Reads each port's rules back through the proxier of its family.
fn read_back(cfg: &ProxyConfig, backend: Backend, req: &Request, ports: &mut [PortFacts]) {
    // The nfacct option changes what is written, not what is read back.
    let proxiers = match daemon::modes::proxiers(cfg, backend, false) {
        Ok(p) => p,
        Err(e) => {
            for p in ports.iter_mut() {
                p.read_back_error = Some(format!("{e:#}"));
            }
            return;
        }
    };
    for mut proxier in proxiers {
        let family = proxier.family();
        let idx: Vec<usize> = (0..ports.len())
            .filter(|i| ports[*i].family == family.as_str())
            .collect();
        let states: Vec<_> = idx.iter().map(|i| ports[*i].port.state()).collect();
        let service_ports: Vec<_> = states.iter().filter_map(|s| s.as_ref().ok()).map(|s| &s.port).collect();
        if service_ports.len() != idx.len() {
            continue;
        }
        let result = if req.all {
            proxier.read_back_all(&service_ports)
        } else {
            service_ports.iter().map(|p| proxier.read_back(p)).collect()
        };
        match result {
            Ok(all) => {
                for (i, programmed) in idx.iter().zip(all) {
                    ports[*i].actual_rules = Some(programmed);
                }
            }
            Err(e) => {
                for i in &idx {
                    ports[*i].read_back_error = Some(e.to_string());
                }
            }
        }
    }
}

fn families_of(ports: &[PortFacts]) -> Vec<IpFamily> {
    let mut out = Vec::new();
    for p in ports {
        let f = if p.family == "IPv6" { IpFamily::V6 } else { IpFamily::V4 };
        if !out.contains(&f) {
            out.push(f);
        }
    }
    out
}

/// Conntrack entries by original destination port (a port's entries are found among those
/// to its port and its NodePort without looking at the others).
fn index_entries(entries: &[Tracked]) -> HashMap<u16, Vec<&Tracked>> {
    let mut by_port: HashMap<u16, Vec<&Tracked>> = HashMap::new();
    for t in entries {
        by_port.entry(t.flow.orig_dport).or_default().push(t);
    }
    by_port
}

fn connections_of(by_port: &HashMap<u16, Vec<&Tracked>>, port: &PortView) -> Connections {
    let mut candidates: Vec<Tracked> = Vec::new();
    for p in [port.port, port.node_port] {
        if p != 0 {
            candidates.extend(by_port.get(&p).into_iter().flatten().map(|t| (*t).clone()));
        }
    }
    if port.node_port == port.port {
        candidates.dedup();
    }
    count_connections(&candidates, port)
}

fn endpoint_routes(table: &routes::RouteTable<'_>, port: &PortView) -> Vec<routes::RouteCheck> {
    let mut ips: Vec<IpAddr> = port.endpoints.iter().map(|e| e.ip).collect();
    ips.dedup();
    ips.into_iter().map(|ip| table.check(ip)).collect()
}

/// `GET /` on the port's health-check node port, on loopback (its server listens on every
/// address).
fn health_check(port: &PortView) -> Option<HealthCheck> {
    if port.health_check_node_port == 0 {
        return None;
    }
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port.health_check_node_port);
    let (status, error) = match http_get(addr, "/") {
        Ok((s, _)) => (Some(s), None),
        Err(e) => (None, Some(e)),
    };
    Some(HealthCheck {
        port: port.health_check_node_port,
        status,
        error,
    })
}

/// One HTTP/1.1 GET (`Connection: close`): the status and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, HTTP_TIMEOUT).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(HTTP_TIMEOUT * 10)).map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("{addr}: {e}"))?;
    parse_response(&raw).ok_or_else(|| format!("{addr}: not an HTTP answer"))
}

/// The status and body of a whole HTTP/1.1 answer (a chunked body is put together).
fn parse_response(raw: &[u8]) -> Option<(u16, String)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = &raw[end + 4..];
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.to_ascii_lowercase().contains("chunked")
    });
    if !chunked {
        return Some((status, String::from_utf8_lossy(body).into_owned()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..line_end]).trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some((status, String::from_utf8_lossy(&out).into_owned()));
        }
        out.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        assert_eq!(parse_response(plain), Some((200, "ok".into())));
        let chunked =
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Some((503, "abcde".into())));
        assert_eq!(parse_response(b"garbage"), None);
    }

    #[test]
    fn wildcard_binds_are_asked_on_loopback() {
        assert_eq!(
            reachable("0.0.0.0:10256".parse().unwrap()),
            "127.0.0.1:10256".parse().unwrap()
        );
        assert_eq!(reachable("[::]:10256".parse().unwrap()), "[::1]:10256".parse().unwrap());
        assert_eq!(
            reachable("127.0.0.1:10249".parse().unwrap()),
            "127.0.0.1:10249".parse().unwrap()
        );
    }
}
