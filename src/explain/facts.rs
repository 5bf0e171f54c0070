//! What `kube-proxy explain` gathers before it diagnoses anything: plain data, serialisable
//! (the JSON report carries it), built by the gathering edge (`gather`) on a node and by hand
//! in the diagnosis' unit tests. The few reductions of raw kernel data that would otherwise
//! be too big to carry (conntrack entries counted per endpoint, stale UDP flows) are done by
//! the pure functions here.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::routes::RouteCheck;
use super::view::{PortView, ServicesView};
use crate::conntrack::{Statistics, TCP_ESTABLISHED, TableUsage, Tracked};
use crate::proxy::Programmed;

/// Everything gathered.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Facts {
    /// The proxy mode whose rules were read back (the daemon's, else the configuration's).
    pub mode: String,
    /// `--from`: the client address asked about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<IpAddr>,
    /// Where the desired state came from: `daemon`, `manifests DIR` or `kubeconfig`.
    pub desired_from: String,
    pub desired: ServicesView,
    pub daemon: DaemonFacts,
    /// The service ports asked about, each with what was found for it.
    pub ports: Vec<PortFacts>,
    /// Rules of another proxy mode found on the node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leftovers: Vec<Leftover>,
    pub conntrack: ConntrackFacts,
    /// IPVS mode: why the kernel cannot run it (module or scheduler missing), if it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipvs_kernel_error: Option<String>,
    /// The effective `nodePortAddresses` per family (`primary` or CIDRs; empty: every address).
    #[serde(default)]
    pub node_port_addresses: BTreeMap<String, Vec<String>>,
    /// The cluster's pod CIDRs (`clusterCIDR`), for the route check.
    #[serde(default)]
    pub cluster_cidrs: Vec<String>,
}

/// The daemon as `explain` reached it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonFacts {
    /// Where its metrics server (and `/debug/services`) was asked.
    pub metrics_address: String,
    /// It answered `/debug/services`.
    pub reachable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub healthz_address: String,
    /// `/healthz`: its status code and body, or why it could not be asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthz_status: Option<u16>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub healthz_body: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthz_error: Option<String>,
}

/// One service port of one family, with what the node holds for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortFacts {
    /// `IPv4` or `IPv6`.
    pub family: String,
    pub port: PortView,
    /// What the mode programs for it, rendered from the desired state.
    pub desired_rules: Programmed,
    /// What the kernel holds, read back (absent when reading failed: see `readBackError`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_rules: Option<Programmed>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_back_error: Option<String>,
    pub connections: Connections,
    /// One route check per endpoint IP.
    pub routes: Vec<RouteCheck>,
    /// The health-check node port's answer on this node, when the port has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// The node's addresses of this family that NodePorts could be reached on (the Node
    /// object's addresses, and the interfaces' in IPVS mode).
    #[serde(default)]
    pub node_addresses: Vec<IpAddr>,
}

impl PortFacts {
    /// `ns/name:port (IPv4)`: how the report and the problems name it.
    pub fn label(&self) -> String {
        format!("{} ({})", self.port.name, self.family)
    }
}

/// What `GET /` on the health-check node port answered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Rules of another proxy mode.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Leftover {
    pub mode: String,
    /// What was found, e.g. `iptables chain nat KUBE-SERVICES with 12 service chains`.
    pub what: String,
}

/// The conntrack table as a whole.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackFacts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<TableUsage>,
    /// The statistics at the start and at the end of the gathering, `windowMs` apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<Statistics>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Statistics>,
    pub window_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The conntrack entries of one service port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Connections {
    /// Entries per endpoint (`ip:port`, as its reply source says), including endpoints the
    /// Service no longer has.
    pub per_endpoint: BTreeMap<String, EndpointConnections>,
    /// Entries to the Service not answered by an endpoint (not DNATed: rules missing when
    /// the connection started, or a refused one).
    pub not_translated: usize,
    /// UDP entries that still point at an endpoint the Service no longer serves from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stale_udp: Vec<String>,
}

/// The entries of one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointConnections {
    pub total: usize,
    /// TCP entries in ESTABLISHED.
    pub established: usize,
}

/// Counts the entries sent to `port` (any of its addresses at its port, or its NodePort),
/// by the endpoint that answers them; UDP entries toward endpoints that no longer serve are
/// stale (upstream's rule: `conntrack::stale_flows`).
pub fn count_connections(entries: &[Tracked], port: &PortView) -> Connections {
    let proto = match port.protocol.as_str() {
        "TCP" => 6,
        "UDP" => 17,
        _ => 132,
    };
    let addresses: Vec<IpAddr> = std::iter::once(port.cluster_ip)
        .chain(port.external_ips.iter().copied())
        .chain(port.load_balancer_ips.iter().copied())
        .collect();
    let serving: Vec<SocketAddr> = port
        .endpoints
        .iter()
        .filter(|e| e.serving)
        .map(|e| SocketAddr::new(e.ip, e.port))
        .collect();
    let mut c = Connections::default();
    for t in entries.iter().filter(|t| t.protocol == proto) {
        let f = &t.flow;
        let to_service = (addresses.contains(&f.orig_dst) && f.orig_dport == port.port)
            || (port.node_port != 0 && f.orig_dport == port.node_port);
        if !to_service {
            continue;
        }
        let reply = f.reply_source();
        if reply.ip() == f.orig_dst && reply.port() == f.orig_dport {
            c.not_translated += 1;
            continue;
        }
        let e = c.per_endpoint.entry(reply.to_string()).or_default();
        e.total += 1;
        e.established += usize::from(t.tcp_state == Some(TCP_ESTABLISHED));
        if proto == 17 && !serving.is_empty() && !serving.contains(&reply) {
            c.stale_udp.push(f.to_string());
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conntrack::Flow;
    use crate::explain::view::{Topology, port_view};
    use crate::model::{NodeInfo, Protocol, testing};

    fn tracked(protocol: u8, dst: &str, dport: u16, reply: &str, state: Option<u8>) -> Tracked {
        let dst: SocketAddr = format!("{dst}:{dport}").parse().unwrap();
        let reply: SocketAddr = reply.parse().unwrap();
        Tracked {
            protocol,
            flow: Flow {
                orig_src: "10.244.9.2".parse().unwrap(),
                orig_dst: dst.ip(),
                orig_sport: 40000,
                orig_dport: dst.port(),
                reply_src: reply.ip(),
                reply_dst: "10.244.9.2".parse().unwrap(),
                reply_sport: reply.port(),
                reply_dport: 40000,
            },
            tcp_state: state,
        }
    }

    #[test]
    fn entries_are_counted_per_endpoint_and_stale_udp_found() {
        let node = NodeInfo::default();
        let topo = Topology {
            node: &node,
            prefer_same_node: false,
            mode: crate::config::ProxyMode::Iptables,
        };
        let mut udp = port_view(&testing::port("ns", "dns", 1, Protocol::Udp, &[1, 2]), &topo);
        udp.node_port = 30053;
        let entries = vec![
            tracked(17, "10.96.0.1", 80, "10.244.1.1:8080", None),
            tracked(17, "10.96.0.1", 80, "10.244.1.1:8080", None),
            tracked(17, "192.168.49.2", 30053, "10.244.1.2:8080", None),
            tracked(17, "10.96.0.1", 80, "10.244.1.7:8080", None),
            tracked(17, "10.96.0.1", 80, "10.96.0.1:80", None),
            tracked(6, "10.96.0.1", 80, "10.244.1.1:8080", Some(TCP_ESTABLISHED)),
            tracked(17, "10.96.0.2", 80, "10.244.1.1:8080", None),
        ];
        let c = count_connections(&entries, &udp);
        assert_eq!(c.per_endpoint["10.244.1.1:8080"].total, 2);
        assert_eq!(c.per_endpoint["10.244.1.2:8080"].total, 1, "by NodePort");
        assert_eq!(c.not_translated, 1);
        assert_eq!(c.stale_udp.len(), 1);
        assert!(c.stale_udp[0].contains("reply 10.244.1.7:8080"), "{:?}", c.stale_udp);
        let tcp = port_view(&testing::port("ns", "web", 1, Protocol::Tcp, &[1]), &topo);
        let c = count_connections(&entries, &tcp);
        assert_eq!(
            c.per_endpoint["10.244.1.1:8080"],
            EndpointConnections {
                total: 1,
                established: 1
            }
        );
    }
}
