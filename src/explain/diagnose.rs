//! The diagnosis of `kube-proxy explain`: a pure function from the gathered [`Facts`] to one
//! [`Problem`] per thing found wrong, each naming the cause and the fix in the operator's
//! words, plus the rule differences of each port (shown in the report's rules section).

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::facts::{Facts, PortFacts};
use super::rules::{RuleDiff, compare};
use crate::config::ProxyMode;
use crate::model::IpFamily;
use crate::proxy::NodePortAddresses;

/// One problem found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Problem {
    /// A stable name for the kind of problem (`no-endpoints`, `rules-differ`, ...).
    pub code: String,
    /// The service port (`ns/name:port (IPv4)`) it is about; absent for the node as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<String>,
    /// Cause, effect and fix, in one sentence or three.
    pub text: String,
}

/// What the diagnosis found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Diagnosis {
    pub problems: Vec<Problem>,
    /// Per port of the facts (same order): its rules missing from the kernel or extra there.
    pub diffs: Vec<Vec<RuleDiff>>,
}

/// The probability bound under which a spread over endpoints counts as concentrated.
const CONCENTRATION_P: f64 = 0.001;
/// Fewer connections than this say nothing about a spread.
const CONCENTRATION_MIN: usize = 10;
/// The conntrack table counts as full from this share of its maximum.
const CONNTRACK_FULL: f64 = 0.9;

/// Diagnoses `f`.
pub fn diagnose(f: &Facts, target: Option<&str>) -> Diagnosis {
    let mode = ProxyMode::parse(&f.mode).unwrap_or(ProxyMode::Iptables);
    let mut d = Diagnosis::default();
    let push = |d: &mut Diagnosis, code: &str, port: Option<String>, text: String| {
        d.problems.push(Problem {
            code: code.into(),
            port,
            text,
        })
    };
    node_problems(f, mode, &mut |code, text| push(&mut d, code, None, text));
    if let Some(t) = target
        && f.ports.is_empty()
        && (f.daemon.reachable || f.desired_from != "daemon")
    {
        push(
            &mut d,
            "not-found",
            None,
            format!(
                "no service port of {t} in the desired state (from {}): check the namespace, name and port; a \
                 headless or ExternalName Service has no rules",
                f.desired_from
            ),
        );
    }
    for (p, diffs) in f.ports.iter().zip(all_diffs(mode, &f.ports)) {
        let label = p.label();
        port_problems(f, mode, p, &diffs, &mut |code, text| {
            push(&mut d, code, Some(label.clone()), text)
        });
        d.diffs.push(diffs);
    }
    if f.ports.iter().all(|p| p.actual_rules.is_some()) && !d.diffs.iter().any(|x| !x.is_empty()) {
        for fam in &f.desired.families {
            if let Some(s) = fam.last_sync.as_ref().filter(|s| s.failed()) {
                push(
                    &mut d,
                    "sync-failed",
                    None,
                    format!(
                        "kube-proxy's last {} sync failed at {}: {}; the kernel keeps the rules of the last \
                         successful sync ({}) and the daemon retries with a full sync; its log has the details",
                        fam.family,
                        s.time,
                        s.error.as_deref().unwrap_or("no error given"),
                        s.last_success.as_deref().unwrap_or("none")
                    ),
                );
            }
        }
    }
    d
}

/// Each port's differences between desired and actual rules. Pure and independent per port,
/// and most of `--all`'s own time at 10,000 Services: compared on every core.
fn all_diffs(mode: ProxyMode, ports: &[PortFacts]) -> Vec<Vec<RuleDiff>> {
    let diffs_of = |p: &PortFacts| {
        p.port
            .state()
            .ok()
            .zip(p.actual_rules.as_ref())
            .map(|(sps, actual)| compare(mode, &sps.port, &p.desired_rules, actual))
            .unwrap_or_default()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads < 2 || ports.len() < 64 {
        return ports.iter().map(diffs_of).collect();
    }
    let chunk = ports.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = ports
            .chunks(chunk)
            .map(|c| s.spawn(move || c.iter().map(diffs_of).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

fn node_problems(f: &Facts, mode: ProxyMode, push: &mut dyn FnMut(&str, String)) {
    let dm = &f.daemon;
    if !dm.reachable {
        let err = dm.error.as_deref().unwrap_or("no answer");
        push(
            "daemon-down",
            if f.desired_from == "daemon" {
                format!(
                    "kube-proxy does not answer at {} ({err}): nothing keeps this node's rules in sync, and \
                     the desired state is unknown; start kube-proxy on this node (its DaemonSet pod), or run \
                     explain with --manifests DIR or --kubeconfig to read the objects itself",
                    dm.metrics_address
                )
            } else {
                format!(
                    "kube-proxy does not answer at {} ({err}): the rules below are what it left and nothing \
                     keeps them in sync; start kube-proxy on this node (its DaemonSet pod)",
                    dm.metrics_address
                )
            },
        );
    } else if let Some(503) = dm.healthz_status {
        // Upstream's healthz JSON says which half failed.
        let body: serde_json::Value = serde_json::from_str(&dm.healthz_body).unwrap_or_default();
        let why = if body["nodeEligible"] == false {
            "this Node is being deleted, or drained by the cluster autoscaler: load balancers stop sending \
             traffic here"
                .to_string()
        } else {
            format!(
                "a change has waited more than twice the sync period (last update {}): its syncs do not \
                 complete; its log says why",
                body["lastUpdated"].as_str().unwrap_or("unknown")
            )
        };
        push(
            "healthz-failing",
            format!("kube-proxy's /healthz at {} answers 503: {why}", dm.healthz_address),
        );
    }
    if dm.reachable
        && let Some(since) = &f.desired.source.unreachable_since
    {
        let errors: Vec<String> = f
            .desired
            .source
            .errors
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        push(
            "api-unreachable",
            format!(
                "kube-proxy cannot reach the API server since {since} ({}): it keeps the rules it has, but \
                 changes to Services and endpoints no longer reach this node; check the API server, the \
                 network to it and the node's credentials",
                errors.join("; ")
            ),
        );
    }
    // One problem per other mode, naming all it left.
    let mut modes: Vec<&str> = f.leftovers.iter().map(|l| l.mode.as_str()).collect();
    modes.dedup();
    for other in modes {
        let what: Vec<&str> = f
            .leftovers
            .iter()
            .filter(|l| l.mode == other)
            .map(|l| l.what.as_str())
            .collect();
        push(
            "leftover-mode",
            format!(
                "rules of {other} mode are on the node ({}) while it runs {} mode: both sets of rules see \
                 the packets; restarting kube-proxy removes the other mode's rules once its own are in place (or run \
                 kube-proxy --cleanup while kube-proxy is stopped)",
                what.join(", "),
                mode.as_str()
            ),
        );
    }
    if let Some(e) = &f.ipvs_kernel_error {
        push(
            "ipvs-kernel",
            format!("the kernel cannot run IPVS mode: {e}; kube-proxy refuses to start in IPVS mode until it can"),
        );
    }
    conntrack_problems(f, push);
}

fn conntrack_problems(f: &Facts, push: &mut dyn FnMut(&str, String)) {
    let ct = &f.conntrack;
    if let Some(u) = ct
        .usage
        .filter(|u| u.max > 0 && u.count as f64 >= CONNTRACK_FULL * u.max as f64)
    {
        push(
            "conntrack-full",
            format!(
                "the conntrack table holds {} of at most {} entries ({:.0} %): when it is full, new \
                 connections are dropped; raise --conntrack-max-per-core (or conntrack.maxPerCore), or find \
                 what opens so many connections (conntrack -L)",
                u.count,
                u.max,
                100.0 * u.count as f64 / u.max as f64
            ),
        );
    }
    if let (Some(b), Some(a)) = (ct.before, ct.after) {
        let failed = a.insert_failed.saturating_sub(b.insert_failed);
        let dropped = a.drop.saturating_sub(b.drop);
        if failed > 0 || dropped > 0 {
            push(
                "conntrack-drops",
                format!(
                    "conntrack dropped packets while explain watched ({failed} insert_failed, {dropped} drop in \
                     {} ms; {} and {} since boot): new connections are lost, usually because the table is \
                     full or entries clash; see conntrack -S, raise the table's maximum",
                    ct.window_ms, a.insert_failed, a.drop
                ),
            );
        }
    }
}

fn port_problems(f: &Facts, mode: ProxyMode, p: &PortFacts, diffs: &[RuleDiff], push: &mut dyn FnMut(&str, String)) {
    let v = &p.port;
    let selector = format!(
        "kubectl get endpointslices -n {} -l kubernetes.io/service-name={}",
        v.namespace, v.service
    );
    if v.endpoints.is_empty() {
        push(
            "no-endpoints",
            format!(
                "no endpoints: clients get REJECT (connection refused); check that the Service's selector \
                 matches running Pods ({selector})"
            ),
        );
    } else if !v.endpoints.iter().any(|e| e.ready) {
        let terminating = v.endpoints.iter().filter(|e| e.serving && e.terminating).count();
        let effect = if terminating > 0 {
            format!("traffic goes to the {terminating} terminating endpoints that still serve, until they stop")
        } else {
            "clients get REJECT (connection refused)".to_string()
        };
        push(
            "none-ready",
            format!(
                "{} endpoints, none ready: {effect}; check the Pods' readiness (kubectl describe pod), \
                 ({selector})",
                v.endpoints.len()
            ),
        );
    }
    local_policy_problems(mode, p, push);
    if let Some(from) = f.from
        && !v.load_balancer_source_ranges.is_empty()
        && !v
            .load_balancer_source_ranges
            .iter()
            .filter_map(|r| r.parse::<IpNet>().ok())
            .any(|r| r.contains(&from))
    {
        push(
            "source-range-excluded",
            format!(
                "loadBalancerSourceRanges ({}) exclude {from}: its connections to the load-balancer IPs are \
                 dropped; add its range to spec.loadBalancerSourceRanges",
                v.load_balancer_source_ranges.join(", ")
            ),
        );
    }
    rules_problems(f, mode, p, diffs, push);
    traffic_problems(p, push);
    route_problems(f, p, push);
    node_port_problems(f, p, push);
}

fn local_policy_problems(mode: ProxyMode, p: &PortFacts, push: &mut dyn FnMut(&str, String)) {
    let v = &p.port;
    let has_any = v.endpoints.iter().any(|e| e.ready || (e.serving && e.terminating));
    let local = v.endpoints.iter().any(|e| e.categories.iter().any(|c| c == "local"));
    if v.endpoints.is_empty() || local || !has_any {
        return;
    }
    let externally = v.node_port != 0 || !v.load_balancer_ips.is_empty() || !v.external_ips.is_empty();
    if v.external_traffic_policy == "Local" && externally {
        let health = match &p.health_check {
            Some(h) => match h.status {
                Some(s) => format!(" and its health-check node port {} answers {s}", h.port),
                None => format!(
                    " and its health-check node port {} does not answer ({})",
                    h.port,
                    h.error.as_deref().unwrap_or("no answer")
                ),
            },
            None if v.health_check_node_port != 0 => {
                format!(
                    " and its health-check node port {} answers 503",
                    v.health_check_node_port
                )
            }
            None => String::new(),
        };
        let effect = if mode == ProxyMode::Ipvs {
            "IPVS mode sends external traffic to endpoints on other nodes instead (the client address is lost)"
        } else {
            "external traffic arriving at this node is dropped"
        };
        push(
            "external-local-no-endpoint",
            format!(
                "externalTrafficPolicy Local and no ready endpoint on this node: {effect}{health}; the load \
                 balancer should send no traffic here, otherwise run a Pod of it on this node or set \
                 externalTrafficPolicy Cluster"
            ),
        );
    }
    if v.internal_traffic_policy == "Local" {
        let effect = if mode == ProxyMode::Ipvs { "refused" } else { "dropped" };
        push(
            "internal-local-no-endpoint",
            format!(
                "internalTrafficPolicy Local and no endpoint on this node: connections from Pods on this node \
                 (and from the node) to {}:{} are {effect}; run a Pod of it on this node or set \
                 internalTrafficPolicy Cluster",
                v.cluster_ip, v.port
            ),
        );
    }
}

fn rules_problems(f: &Facts, mode: ProxyMode, p: &PortFacts, diffs: &[RuleDiff], push: &mut dyn FnMut(&str, String)) {
    if let Some(e) = &p.read_back_error {
        push(
            "read-back-failed",
            format!("the kernel's rules could not be read ({e}); run explain as root in the node's network namespace"),
        );
    }
    if !diffs.is_empty() {
        let missing = diffs.iter().filter(|d| d.kind == "missing").count();
        let extra = diffs.len() - missing;
        let sync = f
            .desired
            .families
            .iter()
            .find(|x| x.family == p.family)
            .and_then(|x| x.last_sync.as_ref());
        let why = match sync {
            Some(s) if s.failed() => format!(
                "the daemon's last sync failed at {}: {}",
                s.time,
                s.error.as_deref().unwrap_or("no error given")
            ),
            _ if !f.daemon.reachable => "kube-proxy is not running to repair them".to_string(),
            Some(s) => format!(
                "its last sync ({}) succeeded, so someone changed them since, or a change is still queued; \
                 kube-proxy repairs flushed rules at its next periodic check",
                s.time
            ),
            None => "kube-proxy has not synced yet".to_string(),
        };
        push(
            "rules-differ",
            format!("{missing} rule lines missing from the kernel and {extra} extra (stale) ones: {why}"),
        );
    }
    let Some(actual) = p.actual_rules.as_ref().filter(|_| mode == ProxyMode::Ipvs) else {
        return;
    };
    for s in actual.sections.iter() {
        let live = s.lines.iter().filter(|l| !l.contains(" weight 0")).count();
        if live == 0 {
            push(
                "ipvs-no-real-servers",
                format!(
                    "virtual server {} has no real server to send to: new connections are refused (ICMP port \
                     unreachable){}",
                    s.place.trim(),
                    if p.port.endpoints.iter().any(|e| e.ready) {
                        " although the Service has ready endpoints"
                    } else {
                        ""
                    }
                ),
            );
        }
        let draining: Vec<&str> = s
            .lines
            .iter()
            .filter(|l| l.contains(" weight 0"))
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect();
        if !draining.is_empty() {
            push(
                "ipvs-draining",
                format!(
                    "real servers of {} drain at weight 0 ({}): removed endpoints with open connections get no \
                     new ones and are deleted once their connections end",
                    s.place.trim(),
                    draining.join(", ")
                ),
            );
        }
    }
}

fn traffic_problems(p: &PortFacts, push: &mut dyn FnMut(&str, String)) {
    let v = &p.port;
    let c = &p.connections;
    let current: Vec<String> = v
        .endpoints
        .iter()
        .filter(|e| !e.categories.is_empty())
        .map(|e| e.address())
        .collect();
    let counts: Vec<(String, usize)> = current
        .iter()
        .map(|a| (a.clone(), c.per_endpoint.get(a).map_or(0, |e| e.total)))
        .collect();
    let total: usize = counts.iter().map(|(_, n)| n).sum();
    if let Some((top, most)) = counts.iter().max_by_key(|(_, n)| *n)
        && counts.len() >= 2
        && total >= CONCENTRATION_MIN
        && concentrated(total, counts.len(), *most)
    {
        let cause = match v.session_affinity_timeout_seconds {
            Some(t) => format!(
                "sessionAffinity ClientIP pins each client to one endpoint for {t} s, so few clients load few \
                 endpoints; set sessionAffinity None if the Service does not need it"
            ),
            None => "kube-proxy balances new connections only, and long-lived connections stay on the \
                     endpoint they were opened to (e.g. opened before the others were ready); clients should \
                     reconnect now and then (or use a balancing client)"
                .to_string(),
        };
        push(
            if v.session_affinity_timeout_seconds.is_some() {
                "session-affinity"
            } else {
                "concentrated"
            },
            format!(
                "traffic concentrated on {top}: {most} of {total} connections in conntrack (an even spread over \
                 {} endpoints would make that unlikely); {cause}",
                counts.len()
            ),
        );
    }
    if !c.stale_udp.is_empty() {
        push(
            "stale-udp",
            format!(
                "{} UDP conntrack entries still send to endpoints the Service no longer has (e.g. {}): those \
                 clients keep talking to a gone Pod until the entry expires; kube-proxy deletes such entries \
                 after its syncs, or delete them with conntrack -D -p udp --orig-dst {} --orig-port-dst {}",
                c.stale_udp.len(),
                c.stale_udp[0],
                v.cluster_ip,
                v.port
            ),
        );
    }
}

/// Whether `most` of `total` connections on one of `n` endpoints is unlikely under an even
/// spread: n · P(Binomial(total, 1/n) ≥ most) ≤ [`CONCENTRATION_P`] (a union bound over the
/// endpoints).
pub fn concentrated(total: usize, n: usize, most: usize) -> bool {
    if n < 2 || most == 0 {
        return false;
    }
    let p = 1.0 / n as f64;
    let ln = |x: f64| x.ln();
    // ln C(total, k) by summing logs, then the tail term by term.
    let mut ln_choose = 0.0;
    let mut tail = 0.0;
    for k in 0..=total {
        if k > 0 {
            ln_choose += ln((total - k + 1) as f64) - ln(k as f64);
        }
        if k >= most {
            tail += (ln_choose + k as f64 * ln(p) + (total - k) as f64 * ln(1.0 - p)).exp();
        }
    }
    n as f64 * tail <= CONCENTRATION_P
}

fn route_problems(f: &Facts, p: &PortFacts, push: &mut dyn FnMut(&str, String)) {
    let pods: Vec<IpNet> = f.cluster_cidrs.iter().filter_map(|c| c.parse().ok()).collect();
    let ghosts: Vec<String> = p
        .routes
        .iter()
        .filter(|r| r.verdict == "none" || (r.verdict == "default" && pods.iter().any(|c| c.contains(&r.ip))))
        .map(|r| match &r.route {
            Some(route) if r.verdict == "default" => format!("{} (only {route})", r.ip),
            _ => format!("{} (no route)", r.ip),
        })
        .collect();
    if !ghosts.is_empty() {
        push(
            "no-route",
            format!(
                "endpoint addresses the node cannot route to the Pod network: {}; connections sent there are \
                 lost (a \"ghost\" address: the Pod is gone, or the CNI did not set up its route); check the \
                 Pod (kubectl get pods -o wide) and the node's routes (ip route)",
                ghosts.join(", ")
            ),
        );
    }
}

fn node_port_problems(f: &Facts, p: &PortFacts, push: &mut dyn FnMut(&str, String)) {
    if p.port.node_port == 0 {
        return;
    }
    let family = if p.family == "IPv6" { IpFamily::V6 } else { IpFamily::V4 };
    let entries = f.node_port_addresses.get(&p.family).cloned().unwrap_or_default();
    let primary = f.desired.node.addresses.iter().copied().find(|ip| family.contains(ip));
    let npa = NodePortAddresses::new(family, &entries, primary);
    if npa.match_all() {
        return;
    }
    let addresses: Vec<IpAddr> = p
        .node_addresses
        .iter()
        .copied()
        .filter(|ip| family.contains(ip) && !ip.is_loopback())
        .collect();
    let served = npa.node_ips(&addresses);
    let excluded: Vec<String> = addresses
        .iter()
        .filter(|ip| !served.contains(ip))
        .map(ToString::to_string)
        .collect();
    if !excluded.is_empty() {
        push(
            "node-port-excluded",
            format!(
                "NodePort {} is not served on {} because nodePortAddresses ({}) excludes it: connections to \
                 that address and port are not forwarded; add the address's CIDR to nodePortAddresses if \
                 clients use it",
                p.port.node_port,
                excluded.join(", "),
                entries.join(", ")
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    //! Each diagnosis from facts made by hand: a healthy Service first, then one condition at
    //! a time.

    use super::*;
    use crate::config::{Flags, ProxyConfig};
    use crate::conntrack::{Statistics, TableUsage};
    use crate::explain::facts::{EndpointConnections, HealthCheck, Leftover};
    use crate::explain::routes::RouteCheck;
    use crate::explain::rules::DesiredRules;
    use crate::explain::view::{NodeView, SyncInfo, Topology, family_view, port_view};
    use crate::model::{NodeInfo, Protocol, ServicePortState, testing};

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            addresses: vec!["192.168.49.2".parse().unwrap()],
            ..NodeInfo::default()
        }
    }

    fn web() -> ServicePortState {
        let mut sps = testing::port("default", "web", 1, Protocol::Tcp, &[1, 2, 3]);
        sps.port.node_port = 30001;
        sps
    }

    /// The facts of `sps` in `mode`, healthy: rules as wanted, routes, a live daemon.
    fn facts(mode: ProxyMode, sps: ServicePortState) -> Facts {
        let node = node();
        let flags = Flags {
            hostname_override: Some("node-a".into()),
            proxy_mode: Some(mode.as_str().into()),
            cluster_cidr: Some("10.244.0.0/16".into()),
            ..Flags::default()
        };
        let cfg = ProxyConfig::resolve(&flags).expect("valid");
        let topo = Topology {
            node: &node,
            prefer_same_node: false,
            mode,
        };
        let state = testing::state(vec![sps.clone()], &[]);
        let state = crate::model::ProxyState {
            node: node.clone(),
            ..state
        };
        let sync = SyncInfo {
            time: "2024-01-01T10:00:00Z".into(),
            full: true,
            result: "ok".into(),
            error: None,
            last_success: Some("2024-01-01T10:00:00Z".into()),
        };
        let desired_rules = DesiredRules::new(&cfg, mode, &state).of(&sps);
        let view = port_view(&sps, &topo);
        let routes = sps
            .endpoints
            .iter()
            .map(|e| RouteCheck {
                ip: e.ip,
                verdict: "route".into(),
                route: Some("10.244.1.0/24 dev veth1".into()),
            })
            .collect();
        Facts {
            mode: mode.as_str().into(),
            from: None,
            desired_from: "daemon".into(),
            desired: ServicesView {
                mode: mode.as_str().into(),
                node: NodeView::of(&node),
                families: vec![family_view(&state, &topo, Some(sync))],
                ..ServicesView::default()
            },
            daemon: DaemonFacts {
                metrics_address: "127.0.0.1:10249".into(),
                reachable: true,
                healthz_address: "127.0.0.1:10256".into(),
                healthz_status: Some(200),
                ..DaemonFacts::default()
            },
            ports: vec![PortFacts {
                family: "IPv4".into(),
                port: view,
                actual_rules: Some(desired_rules.clone()),
                desired_rules,
                read_back_error: None,
                connections: Default::default(),
                routes,
                health_check: None,
                node_addresses: node.addresses.clone(),
            }],
            conntrack: ConntrackFacts {
                usage: Some(TableUsage {
                    count: 10,
                    max: 262_144,
                }),
                before: Some(Statistics::default()),
                after: Some(Statistics::default()),
                window_ms: 200,
                error: None,
            },
            node_port_addresses: [("IPv4".to_string(), vec![])].into_iter().collect(),
            cluster_cidrs: vec!["10.244.0.0/16".into()],
            ..Facts::default()
        }
    }

    use crate::explain::facts::{ConntrackFacts, DaemonFacts};
    use crate::explain::view::ServicesView;

    fn codes(f: &Facts) -> Vec<String> {
        diagnose(f, Some("default/web"))
            .problems
            .into_iter()
            .map(|p| p.code)
            .collect()
    }

    #[test]
    fn a_healthy_service_has_no_problem_in_any_mode() {
        for mode in [ProxyMode::Iptables, ProxyMode::Nftables, ProxyMode::Ipvs] {
            let d = diagnose(&facts(mode, web()), Some("default/web"));
            assert_eq!(d.problems, vec![], "{mode:?}");
            assert_eq!(d.diffs, vec![Vec::<RuleDiff>::new()]);
        }
    }

    #[test]
    fn no_endpoints_and_none_ready() {
        let mut sps = web();
        sps.endpoints.clear();
        let f = facts(ProxyMode::Iptables, sps);
        let d = diagnose(&f, None);
        assert_eq!(d.problems[0].code, "no-endpoints");
        assert!(
            d.problems[0].text.contains("REJECT (connection refused)"),
            "{}",
            d.problems[0].text
        );
        assert_eq!(d.problems[0].port.as_deref(), Some("default/web:p (IPv4)"));

        let mut sps = web();
        for e in &mut sps.endpoints {
            e.ready = false;
        }
        sps.endpoints[0].terminating = true;
        let d = diagnose(&facts(ProxyMode::Iptables, sps), None);
        assert_eq!(d.problems[0].code, "none-ready");
        assert!(
            d.problems[0]
                .text
                .contains("the 1 terminating endpoints that still serve"),
            "{}",
            d.problems[0].text
        );
    }

    #[test]
    fn local_policies_without_a_local_endpoint() {
        let mut sps = web();
        sps.port.external_policy_local = true;
        sps.port.health_check_node_port = 31000;
        let mut f = facts(ProxyMode::Iptables, sps.clone());
        f.ports[0].health_check = Some(HealthCheck {
            port: 31000,
            status: Some(503),
            error: None,
        });
        let d = diagnose(&f, None);
        assert_eq!(d.problems.len(), 1, "{:?}", d.problems);
        assert_eq!(d.problems[0].code, "external-local-no-endpoint");
        assert!(
            d.problems[0]
                .text
                .contains("dropped and its health-check node port 31000 answers 503")
        );
        let ipvs = diagnose(&facts(ProxyMode::Ipvs, sps), None);
        assert!(
            ipvs.problems[0].text.contains("endpoints on other nodes"),
            "{:?}",
            ipvs.problems
        );

        let mut sps = web();
        sps.port.node_port = 0;
        sps.port.internal_policy_local = true;
        assert_eq!(
            codes(&facts(ProxyMode::Nftables, sps.clone())),
            vec!["internal-local-no-endpoint"]
        );
        sps.endpoints[1].is_local = true;
        assert_eq!(codes(&facts(ProxyMode::Nftables, sps)), Vec::<String>::new());
    }

    #[test]
    fn source_ranges_excluding_the_client() {
        let mut sps = web();
        sps.port.load_balancer_vips = vec!["203.0.113.10".parse().unwrap()];
        sps.port.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
        let mut f = facts(ProxyMode::Iptables, sps);
        assert_eq!(codes(&f), Vec::<String>::new(), "no --from, nothing to say");
        f.from = Some("192.168.49.77".parse().unwrap());
        assert_eq!(codes(&f), vec!["source-range-excluded"]);
        f.from = Some("198.51.100.7".parse().unwrap());
        assert_eq!(codes(&f), Vec::<String>::new());
    }

    #[test]
    fn rules_that_differ_name_the_last_sync_error() {
        let mut f = facts(ProxyMode::Iptables, web());
        let actual = f.ports[0].actual_rules.as_mut().expect("read back");
        actual.sections.retain(|s| !s.place.starts_with("nat KUBE-SEP-"));
        let sync = f.desired.families[0].last_sync.as_mut().expect("synced");
        sync.result = "error".into();
        sync.error = Some("iptables-restore: line 7 failed".into());
        let d = diagnose(&f, None);
        assert_eq!(d.problems.len(), 1, "{:?}", d.problems);
        assert_eq!(d.problems[0].code, "rules-differ");
        assert!(d.problems[0].text.contains("line 7 failed"), "{}", d.problems[0].text);
        assert!(
            d.diffs[0]
                .iter()
                .all(|x| x.kind == "missing" && x.place.starts_with("nat KUBE-SEP-"))
        );
        // The same failure with rules that still match: the failed sync itself.
        let mut f2 = facts(ProxyMode::Iptables, web());
        f2.desired.families[0].last_sync = f.desired.families[0].last_sync.clone();
        assert_eq!(codes(&f2), vec!["sync-failed"]);
    }

    #[test]
    fn a_daemon_that_is_down_unhealthy_or_cut_off() {
        let mut f = facts(ProxyMode::Iptables, web());
        f.daemon.reachable = false;
        f.daemon.error = Some("connection refused".into());
        f.desired_from = "manifests /etc/manifests".into();
        assert_eq!(codes(&f), vec!["daemon-down"]);
        let mut f = facts(ProxyMode::Iptables, web());
        f.daemon.healthz_status = Some(503);
        f.desired.source.unreachable_since = Some("2024-01-01T09:00:00Z".into());
        f.desired
            .source
            .errors
            .insert("Service".into(), "connection refused".into());
        assert_eq!(codes(&f), vec!["healthz-failing", "api-unreachable"]);
        assert!(
            diagnose(&f, None).problems[1]
                .text
                .contains("since 2024-01-01T09:00:00Z")
        );
    }

    #[test]
    fn leftovers_conntrack_pressure_and_stale_udp() {
        let mut f = facts(ProxyMode::Nftables, web());
        f.leftovers.push(Leftover {
            mode: "iptables".into(),
            what: "nat KUBE-SERVICES with 3 rules".into(),
        });
        f.conntrack.usage = Some(TableUsage { count: 950, max: 1000 });
        f.conntrack.after = Some(Statistics {
            insert_failed: 3,
            drop: 5,
            ..Statistics::default()
        });
        f.ports[0].connections.stale_udp = vec!["udp ...".into()];
        assert_eq!(
            codes(&f),
            vec!["leftover-mode", "conntrack-full", "conntrack-drops", "stale-udp"]
        );
    }

    #[test]
    fn concentration_needs_a_real_imbalance() {
        assert!(!concentrated(30, 3, 14), "14 of 30 over 3 happens by chance");
        assert!(concentrated(30, 3, 24));
        assert!(concentrated(50, 2, 50));
        assert!(!concentrated(8, 2, 8) || CONCENTRATION_MIN > 8);
        let mut f = facts(ProxyMode::Iptables, web());
        let per = &mut f.ports[0].connections.per_endpoint;
        per.insert(
            "10.244.1.1:8080".into(),
            EndpointConnections {
                total: 40,
                established: 40,
            },
        );
        per.insert(
            "10.244.1.2:8080".into(),
            EndpointConnections {
                total: 1,
                established: 1,
            },
        );
        assert_eq!(codes(&f), vec!["concentrated"]);
        let mut sps = web();
        sps.port.session_affinity_timeout = Some(10800);
        let mut g = facts(ProxyMode::Iptables, sps);
        g.ports[0].connections = f.ports[0].connections.clone();
        assert_eq!(codes(&g), vec!["session-affinity"]);
    }

    #[test]
    fn ghost_addresses_and_excluded_node_port_addresses() {
        let mut f = facts(ProxyMode::Iptables, web());
        f.ports[0].routes[1] = RouteCheck {
            ip: "10.244.1.2".parse().unwrap(),
            verdict: "default".into(),
            route: Some("default via 192.168.49.77 dev eth0".into()),
        };
        assert_eq!(codes(&f), vec!["no-route"]);
        let mut f = facts(ProxyMode::Iptables, web());
        f.ports[0].node_addresses.push("192.168.49.3".parse().unwrap());
        f.node_port_addresses
            .insert("IPv4".into(), vec!["192.168.49.2/32".into()]);
        let d = diagnose(&f, None);
        assert_eq!(d.problems.len(), 1);
        assert!(
            d.problems[0].text.contains("not served on 192.168.49.3"),
            "{}",
            d.problems[0].text
        );
    }

    #[test]
    fn ipvs_real_servers_missing_or_draining_and_the_kernel() {
        let mut f = facts(ProxyMode::Ipvs, web());
        f.ipvs_kernel_error = Some("IPVS mode needs the kernel module ip_vs_sh".into());
        let actual = f.ports[0].actual_rules.as_mut().expect("read back");
        actual.sections[0]
            .lines
            .push("-> 10.244.1.9:8080 Masq weight 0 active 1 inactive 0".into());
        actual.sections[1].lines.clear();
        let c = codes(&f);
        assert!(c.contains(&"ipvs-kernel".to_string()), "{c:?}");
        assert!(c.contains(&"ipvs-draining".to_string()), "{c:?}");
        assert!(c.contains(&"ipvs-no-real-servers".to_string()), "{c:?}");
        assert!(
            c.contains(&"rules-differ".to_string()),
            "the emptied virtual server: {c:?}"
        );
    }

    #[test]
    fn an_unknown_service_is_said_to_be_unknown() {
        let mut f = facts(ProxyMode::Iptables, web());
        f.ports.clear();
        assert_eq!(codes(&f), vec!["not-found"]);
    }
}
