//! Synthetic clusters for benchmarks: `services` Services × `endpoints` ready endpoints, shaped
//! like FLOOR's generator (one TCP port each, ClusterIPs from 10.96.0.0/12 upwards, endpoints
//! from 10.244.0.0/14, every tenth Service with a NodePort).

use std::net::{IpAddr, Ipv4Addr};

use super::{
    Endpoint, IpFamily, NodeInfo, Place, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
};

/// The state of one IPv4 node in such a cluster.
pub fn state(services: usize, endpoints: usize) -> ProxyState {
    let mut service_ports: Vec<ServicePortState> = (0..services).map(|i| service(i, endpoints, 0)).collect();
    service_ports.sort_by(|a, b| a.port.name.cmp(&b.port.name));
    ProxyState {
        family: IpFamily::V4,
        node: NodeInfo {
            name: "node-a".into(),
            addresses: vec!["192.168.0.2".parse().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))],
            ..NodeInfo::default()
        },
        service_ports: service_ports.into_iter().map(std::sync::Arc::new).collect(),
        service_cidrs: vec![],
        warnings: vec![],
    }
}

/// Service `i` with `endpoints` endpoints; `generation` shifts the endpoint addresses so a
/// benchmark can make a changed version of the same Service.
pub fn service(i: usize, endpoints: usize, generation: u32) -> ServicePortState {
    let mut eps: Vec<Endpoint> = (0..endpoints)
        .map(|j| {
            let n = (i * endpoints + j) as u32 + generation * 0x0004_0000;
            Endpoint {
                is_local: j == 0,
                // As the benchmarks write them into manifests.
                place: Place::new(Some(if j == 0 { "node-a" } else { "node-b" }), None),
                ..Endpoint::ready(IpAddr::V4(Ipv4Addr::from(0x0af4_0000u32 + n)), 8080)
            }
        })
        .collect();
    eps.sort_by_key(|e| e.to_string());
    let name = ServicePortName {
        namespace: format!("ns{}", i % 50),
        name: format!("svc{i}"),
        port: "http".into(),
        protocol: Protocol::Tcp,
    };
    let cluster_ip = IpAddr::V4(Ipv4Addr::from(0x0a60_0000u32 + i as u32));
    ServicePortState {
        port: ServicePort {
            node_port: if i.is_multiple_of(10) {
                30000 + (i % 2700) as u16
            } else {
                0
            },
            ..ServicePort::cluster_ip(name, cluster_ip, 80)
        },
        endpoints: eps,
    }
}
