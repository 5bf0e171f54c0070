//! The proxy model: what upstream kube-proxy computes from Services, EndpointSlices and the
//! Node before any dataplane is involved (its service and endpoint change trackers, the
//! EndpointSlice cache and `CategorizeEndpoints`). Pure functions over data: no I/O, no root.
//!
//! Bad input never panics and never poisons other objects: an invalid Service, port, IP or
//! endpoint is skipped with a warning that names the object and the field. Addresses are
//! parsed as upstream parses them, leading zeros included ([`addr`]).

pub mod addr;
mod endpoints;
pub mod places;
mod services;
pub mod store;
pub mod synthetic;
pub mod testing;
mod topology;
mod types;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

pub use addr::{parse_cidr_sloppy, parse_ip_sloppy};
pub use endpoints::{Endpoint, Hints, SliceEntry, SlicePort, endpoints_by_service_port};
pub use places::Place;
pub use services::{ServiceEntry, ServicePort, ServicePortName, service_ports};
pub use store::{StateBuilder, Store};
pub use topology::{Categorization, EndpointSets, NodeTopology, TopologyMode, categorize, categorize_endpoints};
pub use types::{IpFamily, Protocol};

use crate::manifest::Objects;

/// Label on Services and EndpointSlices that hands them to another proxy; upstream's informers
/// exclude objects carrying it.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label on EndpointSlices (and Services) of headless Services; excluded by the same selector.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label linking an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The node label that topology hints are matched against.
pub const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";

/// What kube-proxy knows about the node it runs on.
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The node's addresses: InternalIPs first, then ExternalIPs (upstream's order of preference),
    /// or the `--node-ip` values when given.
    pub addresses: Vec<IpAddr>,
    /// `spec.podCIDRs` (used by `--detect-local-mode=NodeCIDR`).
    pub pod_cidrs: Vec<String>,
}

impl NodeInfo {
    /// Finds the node called `name` in `objects`; a node that is not there has no labels and
    /// no addresses. `node_ips` (from `--node-ip`) replace the Node's addresses when non-empty.
    pub fn from_objects(objects: &Objects, name: &str, node_ips: &[IpAddr]) -> NodeInfo {
        NodeInfo::from_nodes(&objects.nodes, name, node_ips)
    }

    /// As [`NodeInfo::from_objects`], from a list of Nodes.
    pub fn from_nodes(nodes: &[Node], name: &str, node_ips: &[IpAddr]) -> NodeInfo {
        let mut info = NodeInfo {
            name: name.to_string(),
            ..NodeInfo::default()
        };
        if let Some(node) = nodes.iter().find(|n| n.metadata.name.as_deref() == Some(name)) {
            info.labels = node.metadata.labels.clone().unwrap_or_default();
            if let Some(spec) = &node.spec {
                info.pod_cidrs = spec.pod_cidrs.clone().unwrap_or_default();
                if info.pod_cidrs.is_empty()
                    && let Some(c) = &spec.pod_cidr
                {
                    info.pod_cidrs.push(c.clone());
                }
                // Leading zeros normalised (what is not a CIDR stays as it is, for the
                // detector to refuse).
                for c in &mut info.pod_cidrs {
                    if let Some(net) = parse_cidr_sloppy(c) {
                        *c = net.to_string();
                    }
                }
            }
            let addresses = node
                .status
                .as_ref()
                .and_then(|s| s.addresses.clone())
                .unwrap_or_default();
            for wanted in ["InternalIP", "ExternalIP"] {
                for a in addresses.iter().filter(|a| a.type_ == wanted) {
                    if let Some(ip) = parse_ip_sloppy(&a.address)
                        && !info.addresses.contains(&ip)
                    {
                        info.addresses.push(ip);
                    }
                }
            }
        }
        if !node_ips.is_empty() {
            info.addresses = node_ips.to_vec();
        }
        info
    }

    /// The node's primary IP of `family` (upstream's `nodeIP` per proxier), if known.
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.addresses.iter().copied().find(|ip| family.contains(ip))
    }

    pub fn zone(&self) -> Option<&str> {
        self.labels.get(LABEL_TOPOLOGY_ZONE).map(String::as_str)
    }
}

/// One service port of one family with its endpoints, sorted like upstream sorts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortState {
    pub port: ServicePort,
    /// All endpoints of the port (ready or not), sorted by their `ip:port` string.
    pub endpoints: Vec<Endpoint>,
}

impl ServicePortState {
    /// Whether going from `self` to `new` can leave stale UDP conntrack entries: a UDP port
    /// lost a serving endpoint, or the port itself changed.
    pub fn loses_udp_endpoints_to(&self, new: &ServicePortState) -> bool {
        if self.port.protocol != Protocol::Udp {
            return false;
        }
        let serving = |s: &ServicePortState| -> std::collections::HashSet<IpAddr> {
            s.endpoints.iter().filter(|e| e.serving).map(|e| e.ip).collect()
        };
        !serving(self).is_subset(&serving(new)) || self.port != new.port
    }
}

/// Service ports as a state holds them (tests and benchmarks build them as values).
pub fn shared(ports: Vec<ServicePortState>) -> Vec<Arc<ServicePortState>> {
    ports.into_iter().map(Arc::new).collect()
}

/// Everything a dataplane needs to program one IP family.
#[derive(Clone, Debug)]
pub struct ProxyState {
    pub family: IpFamily,
    pub node: NodeInfo,
    /// Service ports sorted by `ns/name:port` and protocol, so that rendering is deterministic.
    /// Shared: the state builder, the state and a proxier's record of what it programmed hold
    /// the same unchanged ports (one copy of 10^5 endpoints, not three).
    pub service_ports: Vec<Arc<ServicePortState>>,
    /// ServiceCIDRs of this family (nftables mode uses them; iptables mode ignores them, as upstream).
    pub service_cidrs: Vec<IpNet>,
    pub warnings: Vec<String>,
}

/// Builds the state of `family` from the objects, as seen by the node `node`.
pub fn build_state(objects: &Objects, node: &NodeInfo, family: IpFamily) -> ProxyState {
    Store::from_objects(objects, &node.name).state(node, family)
}

/// True if `s` is safe to embed in rule text and chain-name hashes: Kubernetes names are
/// DNS labels/subdomains and port names are IANA service names, so anything else (quotes,
/// spaces, newlines) is malformed input that could break the restore format.
pub(crate) fn is_valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Namespaces, Service names and label values: [`is_valid_name`], at most 63 characters (DNS
/// labels, as the API server validates them). Longer ones would not fit in the rules' comments
/// (iptables takes 255 characters), and one rejected comment fails the whole sync.
pub(crate) fn is_valid_label(s: &str) -> bool {
    s.len() <= 63 && is_valid_name(s)
}

/// Port names: empty (unnamed) or a lower-case IANA service name.
pub(crate) fn is_valid_port_name(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels_of_at_most_63_characters_slices_subdomains() {
        assert!(is_valid_label(&"a".repeat(63)));
        assert!(!is_valid_label(&"a".repeat(64)), "longer than the API allows");
        assert!(
            is_valid_name(&"a".repeat(253)),
            "an EndpointSlice name may be a subdomain"
        );
        assert!(!is_valid_name(&"a".repeat(254)));
        assert!(!is_valid_label("Web") && !is_valid_label("a b") && !is_valid_label(""));
    }
}
