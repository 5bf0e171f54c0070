//! Which endpoints a service port uses for Cluster and Local traffic on this node: upstream's
//! `CategorizeEndpoints` (ready endpoints, terminating-but-serving fallback, topology hints,
//! traffic policies).

use super::{Endpoint, NodeInfo, ServicePort, ServicePortState};

/// The endpoint sets of one service port on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSets {
    /// Endpoints for Cluster traffic policy (after topology); empty if the port never uses them.
    pub cluster: Vec<Endpoint>,
    /// Endpoints for Local traffic policy; empty if the port never uses them.
    pub local: Vec<Endpoint>,
    /// Union of both, sorted by `ip:port`: every endpoint that needs a KUBE-SEP chain.
    pub all_reachable: Vec<Endpoint>,
    /// Whether the service has usable endpoints anywhere in the cluster (REJECT when false).
    pub has_any: bool,
}

impl EndpointSets {
    /// Whether traffic under a traffic policy (`policy_local`: Local, else Cluster) has
    /// endpoints to go to: local ones for Local, any for Cluster.
    pub fn has_for_policy(&self, policy_local: bool) -> bool {
        if policy_local {
            !self.local.is_empty()
        } else {
            self.has_any
        }
    }
}

/// What decides, on this node, which endpoints a service port uses: the node's name and zone,
/// and whether hints for the node itself count (`PreferSameTrafficDistribution`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeTopology {
    pub node_name: String,
    pub zone: Option<String>,
    pub prefer_same_node: bool,
}

impl NodeTopology {
    pub fn new(node: &NodeInfo, prefer_same_node: bool) -> NodeTopology {
        NodeTopology {
            node_name: node.name.clone(),
            zone: node.zone().map(str::to_string),
            prefer_same_node,
        }
    }

    /// [`categorize_endpoints`] of one service port as seen from this node.
    pub fn endpoint_sets(&self, sps: &ServicePortState) -> EndpointSets {
        categorize_endpoints(
            &sps.endpoints,
            &sps.port,
            &self.node_name,
            self.zone.as_deref(),
            self.prefer_same_node,
        )
    }
}

/// Which topology hints decided a port's cluster endpoints on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologyMode {
    /// Hints were absent, incomplete or matched nothing here: every ready endpoint counts.
    None,
    /// Every ready endpoint has node hints and one names this node.
    PreferSameNode,
    /// Every ready endpoint has zone hints and one names this node's zone.
    PreferSameZone,
}

impl TopologyMode {
    /// `none`, `PreferSameNode` or `PreferSameZone` (the trafficDistribution values).
    pub fn as_str(self) -> &'static str {
        match self {
            TopologyMode::None => "none",
            TopologyMode::PreferSameNode => "PreferSameNode",
            TopologyMode::PreferSameZone => "PreferSameZone",
        }
    }
}

/// [`categorize_endpoints`] with how it decided: the topology mode and whether each set fell
/// back to serving-and-terminating endpoints (`kube-proxy explain` says why).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Categorization {
    pub sets: EndpointSets,
    pub topology: TopologyMode,
    /// No endpoint was ready: the cluster set is the serving, terminating ones.
    pub cluster_terminating: bool,
    /// No local endpoint was ready: the local set is the local serving, terminating ones.
    pub local_terminating: bool,
}

/// Categorises `endpoints` (sorted by `ip:port`) for `svc` as seen from node `node_name` in
/// `zone`. `prefer_same_node` is the `PreferSameTrafficDistribution` feature gate.
pub fn categorize_endpoints(
    endpoints: &[Endpoint],
    svc: &ServicePort,
    node_name: &str,
    zone: Option<&str>,
    prefer_same_node: bool,
) -> EndpointSets {
    categorize(endpoints, svc, node_name, zone, prefer_same_node).sets
}

/// [`categorize_endpoints`], saying how it decided.
pub fn categorize(
    endpoints: &[Endpoint],
    svc: &ServicePort,
    node_name: &str,
    zone: Option<&str>,
    prefer_same_node: bool,
) -> Categorization {
    let mut sets = EndpointSets::default();
    let mut mode = TopologyMode::None;
    let mut cluster_terminating = false;

    if svc.uses_cluster_endpoints() {
        mode = topology_mode(endpoints, node_name, zone, prefer_same_node);
        sets.cluster = endpoints
            .iter()
            .filter(|ep| ep.ready && available_for_topology(ep, mode, node_name, zone))
            .cloned()
            .collect();
        // No ready endpoints anywhere (topology already fell back): use serving+terminating ones.
        if sets.cluster.is_empty() {
            sets.cluster = endpoints
                .iter()
                .filter(|ep| ep.serving && ep.terminating)
                .cloned()
                .collect();
            cluster_terminating = !sets.cluster.is_empty();
        }
        sets.has_any = !sets.cluster.is_empty();
    }
    let done = |sets: EndpointSets, local_terminating: bool| Categorization {
        sets,
        topology: mode,
        cluster_terminating,
        local_terminating,
    };

    if !svc.uses_local_endpoints() {
        sets.all_reachable = sets.cluster.clone();
        return done(sets, false);
    }

    let mut local_ready = false;
    let mut local_serving_terminating = false;
    for ep in endpoints {
        if ep.ready {
            sets.has_any = true;
            local_ready |= ep.is_local;
        } else if ep.serving && ep.terminating {
            sets.has_any = true;
            local_serving_terminating |= ep.is_local;
        }
    }
    let mut uses_terminating = false;
    if local_ready {
        sets.local = endpoints.iter().filter(|ep| ep.is_local && ep.ready).cloned().collect();
    } else if local_serving_terminating {
        uses_terminating = true;
        sets.local = endpoints
            .iter()
            .filter(|ep| ep.is_local && ep.serving && ep.terminating)
            .cloned()
            .collect();
    }

    if !svc.uses_cluster_endpoints() {
        sets.all_reachable = sets.local.clone();
        return done(sets, uses_terminating);
    }
    if mode == TopologyMode::None && !uses_terminating {
        // Cluster endpoints are then a superset of the local ones.
        sets.all_reachable = sets.cluster.clone();
        return done(sets, uses_terminating);
    }
    let mut all: Vec<Endpoint> = sets.cluster.clone();
    for ep in &sets.local {
        if !all.iter().any(|e| e.ip == ep.ip && e.port == ep.port) {
            all.push(ep.clone());
        }
    }
    all.sort_by_key(|e| e.to_string());
    sets.all_reachable = all;
    done(sets, uses_terminating)
}

/// All-or-nothing hints: every ready endpoint must carry a hint of the kind, and one must
/// match this node (or its zone); otherwise hints are ignored.
fn topology_mode(endpoints: &[Endpoint], node_name: &str, zone: Option<&str>, prefer_same_node: bool) -> TopologyMode {
    let mut all_node_hints = true;
    let mut has_for_node = false;
    let mut all_zone_hints = true;
    let mut has_for_zone = false;
    for ep in endpoints.iter().filter(|e| e.ready) {
        if ep.node_hints.is_empty() {
            all_node_hints = false;
        } else if ep.node_hints.contains(node_name) {
            has_for_node = true;
        }
        if ep.zone_hints.is_empty() {
            all_zone_hints = false;
        } else if zone.is_some_and(|z| ep.zone_hints.contains(z)) {
            has_for_zone = true;
        }
    }
    if prefer_same_node && all_node_hints && has_for_node {
        return TopologyMode::PreferSameNode;
    }
    if all_zone_hints && has_for_zone {
        return TopologyMode::PreferSameZone;
    }
    TopologyMode::None
}

fn available_for_topology(ep: &Endpoint, mode: TopologyMode, node_name: &str, zone: Option<&str>) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::PreferSameNode => ep.node_hints.contains(node_name),
        TopologyMode::PreferSameZone => zone.is_some_and(|z| ep.zone_hints.contains(z)),
    }
}
