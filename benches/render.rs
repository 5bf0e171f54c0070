//! Benchmark: build the model and render the full iptables ruleset for large clusters.
//! Run with `cargo bench --bench render`; prints one line per size (median of several runs).

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::{RenderOptions, render};
use kube_proxy::model::{
    Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
};

fn state(services: usize, endpoints: usize) -> ProxyState {
    let service_ports = (0..services)
        .map(|i| {
            let mut eps: Vec<Endpoint> = (0..endpoints)
                .map(|j| {
                    let ip = IpAddr::V4(Ipv4Addr::from(0x0af4_0000u32 + (i * endpoints + j) as u32));
                    Endpoint {
                        is_local: j == 0,
                        ..Endpoint::ready(ip, 8080)
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
                    node_port: if i % 10 == 0 { 30000 + (i % 2700) as u16 } else { 0 },
                    ..ServicePort::cluster_ip(name, cluster_ip, 80)
                },
                endpoints: eps,
            }
        })
        .collect();
    ProxyState {
        family: IpFamily::V4,
        node: NodeInfo {
            name: "node-a".into(),
            addresses: vec!["192.168.0.2".parse().unwrap()],
            ..NodeInfo::default()
        },
        service_ports,
        service_cidrs: vec![],
        warnings: vec![],
    }
}

fn main() {
    let opts = RenderOptions {
        masquerade_all: false,
        masquerade_bit: 14,
        localhost_node_ports: true,
        local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
        node_port_addresses: vec![],
        prefer_same_node: true,
        nfacct: false,
        tcp_be_liberal: false,
        random_fully: true,
    };
    println!(
        "{:<22} {:>12} {:>12} {:>12}",
        "services x endpoints", "render p50", "lines", "bytes"
    );
    for (s, e) in [(1_000, 10), (10_000, 10), (44_000, 1), (5_000, 50)] {
        let st = state(s, e);
        let mut times: Vec<Duration> = Vec::new();
        let mut lines = 0;
        let mut bytes = 0;
        for _ in 0..5 {
            let t = Instant::now();
            let rs = render(&st, &opts);
            times.push(t.elapsed());
            lines = rs.restore.lines().count();
            bytes = rs.restore.len();
        }
        times.sort();
        println!(
            "{:<22} {:>10.1}ms {:>12} {:>12}",
            format!("{s} x {e}"),
            times[2].as_secs_f64() * 1e3,
            lines,
            bytes
        );
    }
}
