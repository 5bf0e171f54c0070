//! The desired state of service ports as `/debug/services` serves it and `kube-proxy explain`
//! reads it: per family, each service port with its endpoints (conditions, node, zone, hints,
//! locality), the category each endpoint fell into and why, what the mode programs for each
//! kind of traffic, and the last sync. Built from a [`ProxyState`] by pure functions; a view
//! converts back into the state it came from ([`FamilyView::state`]), so `explain` works on one
//! kind of input whether the daemon served it or `explain` read the objects itself.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::ProxyMode;
use crate::model::{
    Categorization, Endpoint, Hints, IpFamily, NodeInfo, Place, Protocol, ProxyState, ServicePort, ServicePortName,
    ServicePortState, TopologyMode, categorize,
};
use crate::proxy::ProgrammedSection;
use crate::source::SourceHealth;

/// What `/debug/services` answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicesView {
    /// The proxy mode the daemon runs (`iptables`, `nftables`, `ipvs`).
    pub mode: String,
    pub node: NodeView,
    /// Where the objects come from, and whether it reaches them.
    pub source: SourceHealth,
    pub families: Vec<FamilyView>,
}

/// This node as the model sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    #[serde(default)]
    pub pod_cidrs: Vec<String>,
}

impl NodeView {
    pub fn of(node: &NodeInfo) -> NodeView {
        NodeView {
            name: node.name.clone(),
            labels: node.labels.clone(),
            addresses: node.addresses.clone(),
            pod_cidrs: node.pod_cidrs.clone(),
        }
    }

    pub fn info(&self) -> NodeInfo {
        NodeInfo {
            name: self.name.clone(),
            labels: self.labels.clone(),
            addresses: self.addresses.clone(),
            pod_cidrs: self.pod_cidrs.clone(),
        }
    }
}

/// One IP family: its last sync and its service ports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FamilyView {
    /// `IPv4` or `IPv6`.
    pub family: String,
    /// The last sync of this family (absent before the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync: Option<SyncInfo>,
    /// ServiceCIDRs of this family.
    #[serde(default)]
    pub service_cidrs: Vec<String>,
    pub service_ports: Vec<PortView>,
    /// What was wrong with the objects, each naming the object and the field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// One sync of one family.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncInfo {
    /// When it ended (RFC 3339).
    pub time: String,
    pub full: bool,
    /// `ok` or `error`.
    pub result: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the last successful sync ended (the rules in the kernel are that sync's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_success: Option<String>,
}

impl SyncInfo {
    pub fn failed(&self) -> bool {
        self.result != "ok"
    }
}

/// One service port of one family, with its endpoints and what the mode programs for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortView {
    /// `namespace/name[:port]`, as the rules' comments name it.
    pub name: String,
    pub namespace: String,
    pub service: String,
    #[serde(default)]
    pub port_name: String,
    pub protocol: String,
    pub cluster_ip: IpAddr,
    pub port: u16,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub node_port: u16,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub external_ips: Vec<IpAddr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_balancer_ips: Vec<IpAddr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_balancer_source_ranges: Vec<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub health_check_node_port: u16,
    /// sessionAffinity ClientIP's timeout; absent for sessionAffinity None.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity_timeout_seconds: Option<u32>,
    /// `Cluster` or `Local`.
    pub external_traffic_policy: String,
    pub internal_traffic_policy: String,
    /// Which topology hints decided the cluster endpoints: `none`, `PreferSameZone`,
    /// `PreferSameNode`.
    pub topology: String,
    pub endpoints: Vec<EndpointView>,
    pub programmed: ProgrammedView,
    /// The rule lines the mode programs for this port, as `render` prints them (in answers
    /// for one Service).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<ProgrammedSection>,
}

fn is_zero(v: &u16) -> bool {
    *v == 0
}

/// One endpoint of a service port.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointView {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub zone_hints: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_hints: Vec<String>,
    /// On this node.
    pub local: bool,
    /// The sets the endpoint is in: `cluster` (Cluster traffic policy, after topology),
    /// `local` (Local traffic policy); empty: not used.
    pub categories: Vec<String>,
    /// Why, in a few words.
    pub why: String,
}

impl EndpointView {
    /// `ip:port` (`[ip]:port` for IPv6).
    pub fn address(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
}

/// Where each kind of traffic goes by the rules of the mode.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgrammedView {
    /// From pods and the node to the ClusterIP.
    pub internal: Traffic,
    /// From outside to the NodePort, externalIPs and load-balancer IPs (absent when the port
    /// has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<Traffic>,
}

/// What a new connection of one kind of traffic meets.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Traffic {
    /// `DNAT` (to `endpoints`), `REJECT` (connection refused) or `DROP` (no answer).
    pub verdict: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Which set: `cluster`, `local`, or `local, else cluster` (IPVS' fallback).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub using: String,
}

impl Traffic {
    fn dnat(endpoints: &[Endpoint], using: &str) -> Traffic {
        Traffic {
            verdict: "DNAT".into(),
            endpoints: endpoints.iter().map(Endpoint::to_string).collect(),
            using: using.into(),
        }
    }

    fn verdict(v: &str) -> Traffic {
        Traffic {
            verdict: v.into(),
            ..Traffic::default()
        }
    }
}

/// What decides categories on this node.
#[derive(Clone, Debug)]
pub struct Topology<'a> {
    pub node: &'a NodeInfo,
    pub prefer_same_node: bool,
    pub mode: ProxyMode,
}

/// The view of one family's state (the sync info is the caller's).
pub fn family_view(state: &ProxyState, topology: &Topology<'_>, last_sync: Option<SyncInfo>) -> FamilyView {
    FamilyView {
        family: state.family.as_str().into(),
        last_sync,
        service_cidrs: state.service_cidrs.iter().map(ToString::to_string).collect(),
        service_ports: state.service_ports.iter().map(|p| port_view(p, topology)).collect(),
        warnings: state.warnings.clone(),
    }
}

/// The view of one service port on this node.
pub fn port_view(sps: &ServicePortState, topology: &Topology<'_>) -> PortView {
    let p = &sps.port;
    let node = topology.node;
    let cat = categorize(&sps.endpoints, p, &node.name, node.zone(), topology.prefer_same_node);
    let policy = |local: bool| if local { "Local" } else { "Cluster" }.to_string();
    PortView {
        name: p.name.to_string(),
        namespace: p.name.namespace.clone(),
        service: p.name.name.clone(),
        port_name: p.name.port.clone(),
        protocol: p.protocol.api().into(),
        cluster_ip: p.cluster_ip,
        port: p.port,
        node_port: p.node_port,
        external_ips: p.external_ips.clone(),
        load_balancer_ips: p.load_balancer_vips.clone(),
        load_balancer_source_ranges: p.load_balancer_source_ranges.iter().map(ToString::to_string).collect(),
        health_check_node_port: p.health_check_node_port,
        session_affinity_timeout_seconds: p.session_affinity_timeout,
        external_traffic_policy: policy(p.external_policy_local),
        internal_traffic_policy: policy(p.internal_policy_local),
        topology: cat.topology.as_str().into(),
        endpoints: sps.endpoints.iter().map(|e| endpoint_view(e, p, &cat, node)).collect(),
        programmed: programmed(p, &cat, topology.mode),
        rules: Vec::new(),
    }
}

/// Where internal and external traffic go, as each mode programs it.
fn programmed(p: &ServicePort, cat: &Categorization, mode: ProxyMode) -> ProgrammedView {
    let sets = &cat.sets;
    let ipvs = mode == ProxyMode::Ipvs;
    let internal = if !sets.has_any {
        Traffic::verdict("REJECT")
    } else if p.internal_policy_local {
        if sets.local.is_empty() {
            // iptables and nftables drop; in IPVS mode the virtual server has no real server.
            Traffic::verdict(if ipvs { "REJECT" } else { "DROP" })
        } else {
            Traffic::dnat(&sets.local, "local")
        }
    } else {
        Traffic::dnat(&sets.cluster, "cluster")
    };
    let external = p.externally_accessible().then(|| {
        if !sets.has_any {
            Traffic::verdict("REJECT")
        } else if p.external_policy_local {
            match (sets.local.is_empty(), ipvs) {
                (false, _) => Traffic::dnat(&sets.local, "local"),
                // Upstream's IPVS proxier falls back to the cluster endpoints.
                (true, true) => Traffic::dnat(&sets.cluster, "local, else cluster"),
                (true, false) => Traffic::verdict("DROP"),
            }
        } else {
            Traffic::dnat(&sets.cluster, "cluster")
        }
    });
    ProgrammedView { internal, external }
}

fn endpoint_view(e: &Endpoint, p: &ServicePort, cat: &Categorization, node: &NodeInfo) -> EndpointView {
    let same = |x: &Endpoint| x.ip == e.ip && x.port == e.port;
    let in_cluster = cat.sets.cluster.iter().any(same);
    let in_local = cat.sets.local.iter().any(same);
    let mut categories = Vec::new();
    if in_cluster {
        categories.push("cluster".to_string());
    }
    if in_local {
        categories.push("local".to_string());
    }
    EndpointView {
        ip: e.ip,
        port: e.port,
        ready: e.ready,
        serving: e.serving,
        terminating: e.terminating,
        node: e.place.node().map(|n| n.to_string()),
        zone: e.place.zone().map(|z| z.to_string()),
        zone_hints: e.zone_hints.iter().map(str::to_string).collect(),
        node_hints: e.node_hints.iter().map(str::to_string).collect(),
        local: e.is_local,
        categories,
        why: why(e, p, cat, node, in_cluster, in_local),
    }
}

/// Why an endpoint is in the sets it is in (or in none).
fn why(e: &Endpoint, p: &ServicePort, cat: &Categorization, node: &NodeInfo, cluster: bool, local: bool) -> String {
    let condition = if e.ready {
        "ready"
    } else if e.serving && e.terminating {
        "terminating (still serving)"
    } else if e.terminating {
        "terminating, not serving"
    } else {
        "not ready"
    };
    let mut reasons = vec![condition.to_string()];
    if p.uses_cluster_endpoints() {
        reasons.push(if cluster {
            if cat.cluster_terminating {
                "used because no endpoint is ready".to_string()
            } else {
                match cat.topology {
                    TopologyMode::None => "used for cluster traffic".to_string(),
                    TopologyMode::PreferSameZone => {
                        format!("hinted for zone {}", node.zone().unwrap_or("?"))
                    }
                    TopologyMode::PreferSameNode => "hinted for this node".to_string(),
                }
            }
        } else if e.ready {
            match cat.topology {
                TopologyMode::PreferSameZone => format!("hints name other zones than {}", node.zone().unwrap_or("?")),
                _ => "hints name other nodes".to_string(),
            }
        } else if e.serving && e.terminating {
            "not used while other endpoints are ready".to_string()
        } else {
            "not used".to_string()
        });
    }
    if p.uses_local_endpoints() && e.is_local {
        reasons.push(if local {
            if cat.local_terminating {
                "local: used because no local endpoint is ready".to_string()
            } else {
                "local: used for Local traffic policy".to_string()
            }
        } else {
            "local: not used".to_string()
        });
    }
    reasons.join("; ")
}

/// A Service (and optionally one of its ports) as `explain` and `?service=` name it:
/// `[NAMESPACE/]NAME[:PORT]`, the port by name or number; the namespace defaults to `default`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRef {
    pub namespace: String,
    pub name: String,
    pub port: Option<String>,
}

impl ServiceRef {
    pub fn parse(s: &str) -> Result<ServiceRef, String> {
        let (ns, rest) = match s.split_once('/') {
            Some((ns, rest)) => (ns, rest),
            None => ("default", s),
        };
        let (name, port) = match rest.split_once(':') {
            Some((n, p)) => (n, Some(p.to_string())),
            None => (rest, None),
        };
        let valid = |x: &str| crate::model::is_valid_name(x);
        if !valid(ns) || !valid(name) || port.as_deref().is_some_and(str::is_empty) {
            return Err(format!(
                "{s:?} is not [NAMESPACE/]NAME[:PORT] (lower-case Kubernetes names, a port name or number)"
            ));
        }
        Ok(ServiceRef {
            namespace: ns.to_string(),
            name: name.to_string(),
            port,
        })
    }

    pub fn matches(&self, p: &PortView) -> bool {
        p.is_of(&self.namespace, &self.name, self.port.as_deref())
    }
}

impl std::fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if let Some(p) = &self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

/// A view that does not convert back (a field the model would not have produced).
#[derive(Debug, thiserror::Error)]
#[error("service port {port}: {field}: {message}")]
pub struct ViewError {
    pub port: String,
    pub field: String,
    pub message: String,
}

impl FamilyView {
    pub fn ip_family(&self) -> Option<IpFamily> {
        match self.family.as_str() {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            _ => None,
        }
    }

    /// The state this view was made of, on `node`.
    pub fn state(&self, node: &NodeInfo) -> Result<ProxyState, ViewError> {
        let err = |field: &str, message: String| ViewError {
            port: String::new(),
            field: field.into(),
            message,
        };
        let family = self
            .ip_family()
            .ok_or_else(|| err("family", format!("unknown family {:?}", self.family)))?;
        let ports: Result<Vec<Arc<ServicePortState>>, ViewError> =
            self.service_ports.iter().map(|p| p.state().map(Arc::new)).collect();
        Ok(ProxyState {
            family,
            node: node.clone(),
            service_ports: ports?,
            service_cidrs: self.service_cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
            warnings: self.warnings.clone(),
        })
    }
}

impl PortView {
    /// The model's service port and endpoints this view was made of.
    pub fn state(&self) -> Result<ServicePortState, ViewError> {
        let err = |field: &str, message: String| ViewError {
            port: self.name.clone(),
            field: field.into(),
            message,
        };
        let protocol =
            Protocol::from_api(&self.protocol).ok_or_else(|| err("protocol", format!("{:?}", self.protocol)))?;
        let mut ranges = Vec::new();
        for r in &self.load_balancer_source_ranges {
            ranges.push(
                r.parse()
                    .map_err(|e| err("loadBalancerSourceRanges", format!("{r:?}: {e}")))?,
            );
        }
        let name = ServicePortName {
            namespace: self.namespace.clone(),
            name: self.service.clone(),
            port: self.port_name.clone(),
            protocol,
        };
        let port = ServicePort {
            node_port: self.node_port,
            external_ips: self.external_ips.clone(),
            load_balancer_vips: self.load_balancer_ips.clone(),
            load_balancer_source_ranges: ranges,
            health_check_node_port: self.health_check_node_port,
            session_affinity_timeout: self.session_affinity_timeout_seconds,
            external_policy_local: self.external_traffic_policy == "Local",
            internal_policy_local: self.internal_traffic_policy == "Local",
            ..ServicePort::cluster_ip(name, self.cluster_ip, self.port)
        };
        let endpoints = self
            .endpoints
            .iter()
            .map(|e| Endpoint {
                ip: e.ip,
                port: e.port,
                is_local: e.local,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                zone_hints: e.zone_hints.iter().cloned().collect::<Hints>(),
                node_hints: e.node_hints.iter().cloned().collect::<Hints>(),
                place: Place::new(e.node.as_deref(), e.zone.as_deref()),
            })
            .collect();
        Ok(ServicePortState { port, endpoints })
    }

    /// Whether this port belongs to the Service `namespace/name` (and to port `port`, a name or
    /// number, when given).
    pub fn is_of(&self, namespace: &str, name: &str, port: Option<&str>) -> bool {
        self.namespace == namespace
            && self.service == name
            && port.is_none_or(|p| p == self.port_name || p == self.port.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testing;

    fn node() -> NodeInfo {
        let mut n = NodeInfo {
            name: "node-a".into(),
            ..NodeInfo::default()
        };
        n.labels
            .insert(crate::model::LABEL_TOPOLOGY_ZONE.into(), "zone-a".into());
        n
    }

    fn topo(node: &NodeInfo, mode: ProxyMode) -> Topology<'_> {
        Topology {
            node,
            prefer_same_node: false,
            mode,
        }
    }

    #[test]
    fn a_view_converts_back_into_its_state() {
        let mut sps = testing::port("ns", "web", 1, Protocol::Udp, &[1, 2, 3]);
        sps.port.node_port = 30001;
        sps.port.external_policy_local = true;
        sps.port.session_affinity_timeout = Some(60);
        sps.port.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
        sps.endpoints[0].is_local = true;
        sps.endpoints[0].place = Place::new(Some("node-a"), Some("zone-a"));
        sps.endpoints[1].ready = false;
        sps.endpoints[1].terminating = true;
        sps.endpoints[2].zone_hints = ["zone-b".to_string()].into_iter().collect();
        let n = node();
        let view = port_view(&sps, &topo(&n, ProxyMode::Iptables));
        let json = serde_json::to_string(&view).expect("serialises");
        let back: PortView = serde_json::from_str(&json).expect("parses");
        assert_eq!(back.state().expect("converts"), sps);
    }

    #[test]
    fn categories_say_why() {
        let mut sps = testing::port("ns", "web", 1, Protocol::Tcp, &[1, 2]);
        sps.endpoints[0].ready = false;
        sps.endpoints[0].terminating = true;
        let n = node();
        let v = port_view(&sps, &topo(&n, ProxyMode::Iptables));
        assert_eq!(v.endpoints[0].categories, Vec::<String>::new());
        assert_eq!(
            v.endpoints[0].why,
            "terminating (still serving); not used while other endpoints are ready"
        );
        assert_eq!(v.endpoints[1].categories, vec!["cluster"]);
        assert_eq!(v.programmed.internal.endpoints, vec!["10.244.1.2:8080"]);

        // None ready: the terminating one is used.
        sps.endpoints[1].ready = false;
        sps.endpoints[1].serving = false;
        let v = port_view(&sps, &topo(&n, ProxyMode::Iptables));
        assert_eq!(v.endpoints[0].categories, vec!["cluster"]);
        assert!(
            v.endpoints[0].why.ends_with("used because no endpoint is ready"),
            "{}",
            v.endpoints[0].why
        );
        assert_eq!(v.endpoints[1].why, "not ready; not used");
    }

    #[test]
    fn programmed_verdicts_follow_the_mode() {
        let mut sps = testing::port("ns", "web", 1, Protocol::Tcp, &[1]);
        sps.port.node_port = 30001;
        sps.port.external_policy_local = true;
        let n = node();
        let ipt = port_view(&sps, &topo(&n, ProxyMode::Iptables)).programmed;
        assert_eq!(ipt.external.expect("a NodePort").verdict, "DROP");
        let ipvs = port_view(&sps, &topo(&n, ProxyMode::Ipvs)).programmed;
        let ext = ipvs.external.expect("a NodePort");
        assert_eq!(
            (ext.verdict.as_str(), ext.using.as_str()),
            ("DNAT", "local, else cluster")
        );
        sps.endpoints.clear();
        let none = port_view(&sps, &topo(&n, ProxyMode::Nftables)).programmed;
        assert_eq!(none.internal.verdict, "REJECT");
    }
}
