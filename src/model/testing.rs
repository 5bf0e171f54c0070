//! Small hand-made states for the proxiers' unit tests: ClusterIP service ports on
//! 10.96.0.IP:80 with ready endpoints 10.244.1.E:8080, on node `node-a`.

use std::net::{IpAddr, Ipv4Addr};

use super::{Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState};

/// Service port `namespace/name:p` on 10.96.0.`ip`:80 with endpoints 10.244.1.`e`:8080.
pub fn port(namespace: &str, name: &str, ip: u8, protocol: Protocol, endpoints: &[u8]) -> ServicePortState {
    let spn = ServicePortName {
        namespace: namespace.into(),
        name: name.into(),
        port: "p".into(),
        protocol,
    };
    let mut eps: Vec<Endpoint> = endpoints
        .iter()
        .map(|e| Endpoint::ready(IpAddr::V4(Ipv4Addr::new(10, 244, 1, *e)), 8080))
        .collect();
    eps.sort_by_key(|e| e.to_string());
    ServicePortState {
        port: ServicePort::cluster_ip(spn, IpAddr::V4(Ipv4Addr::new(10, 96, 0, ip)), 80),
        endpoints: eps,
    }
}

/// The IPv4 state of node `node-a` with these ports (sorted as the model sorts them).
pub fn state(mut ports: Vec<ServicePortState>, service_cidrs: &[&str]) -> ProxyState {
    ports.sort_by(|a, b| a.port.name.cmp(&b.port.name));
    ProxyState {
        family: IpFamily::V4,
        node: NodeInfo {
            name: "node-a".into(),
            ..NodeInfo::default()
        },
        service_ports: crate::model::shared(ports),
        service_cidrs: service_cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
        warnings: vec![],
    }
}
