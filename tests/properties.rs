//! Property tests over generated proxy states: rendering never panics, chain names are unique
//! and fit iptables' 28-character limit, and the probability chains split traffic exactly 1/n.

use std::collections::{BTreeSet, HashSet};
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::{RenderOptions, render};
use kube_proxy::model::{
    Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
};
use proptest::prelude::*;

fn endpoint() -> impl Strategy<Value = Endpoint> {
    (
        1u8..=250,
        1u8..=250,
        1u16..=65535,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0u8..3,
    )
        .prop_map(|(a, b, port, local, ready, serving, terminating, zone)| Endpoint {
            ip: IpAddr::V4(Ipv4Addr::new(10, 244, a, b)),
            port,
            is_local: local,
            ready,
            serving,
            terminating,
            zone_hints: if zone == 0 {
                BTreeSet::new()
            } else {
                BTreeSet::from([format!("zone-{zone}")])
            },
            node_hints: BTreeSet::new(),
        })
}

fn service_port(idx: usize) -> impl Strategy<Value = ServicePortState> {
    (
        "[a-z][a-z0-9-]{0,20}",
        "[a-z][a-z0-9-]{0,40}",
        prop_oneof![Just(String::new()), "[a-z][a-z0-9-]{0,14}"],
        prop_oneof![Just(Protocol::Tcp), Just(Protocol::Udp), Just(Protocol::Sctp)],
        1u16..=65535,
        prop_oneof![Just(0u16), 30000u16..32767],
        prop::collection::vec(any::<u8>(), 0..3),
        prop::collection::vec(any::<u8>(), 0..3),
        prop::collection::vec((any::<u8>(), 8u8..=32), 0..3),
        (any::<bool>(), any::<bool>(), prop::option::of(1u32..86400)),
        prop::collection::vec(endpoint(), 0..24),
    )
        .prop_map(
            move |(ns, name, port_name, protocol, port, node_port, ext, lbs, ranges, (etp, itp, affinity), eps)| {
                let mut eps = eps;
                eps.sort_by_key(|e| e.to_string());
                eps.dedup_by_key(|e| e.to_string());
                let external_ips: Vec<IpAddr> = ext
                    .iter()
                    .map(|o| IpAddr::V4(Ipv4Addr::new(198, 51, 100, *o)))
                    .collect();
                let load_balancer_vips: Vec<IpAddr> =
                    lbs.iter().map(|o| IpAddr::V4(Ipv4Addr::new(203, 0, 113, *o))).collect();
                let accessible = node_port != 0 || !external_ips.is_empty() || !load_balancer_vips.is_empty();
                ServicePortState {
                    port: ServicePort {
                        name: ServicePortName {
                            namespace: ns,
                            name: format!("{name}{idx}"),
                            port: port_name,
                            protocol,
                        },
                        cluster_ip: IpAddr::V4(Ipv4Addr::new(10, 96, (idx / 250) as u8, (idx % 250) as u8 + 1)),
                        port,
                        protocol,
                        node_port,
                        external_ips,
                        load_balancer_vips,
                        load_balancer_source_ranges: ranges
                            .iter()
                            .map(|(o, l)| {
                                IpNet::new(IpAddr::V4(Ipv4Addr::new(192, 0, *o, 0)), *l)
                                    .unwrap()
                                    .trunc()
                            })
                            .collect(),
                        health_check_node_port: if etp && accessible { 31000 } else { 0 },
                        session_affinity_timeout: affinity,
                        external_policy_local: etp && accessible,
                        internal_policy_local: itp,
                    },
                    endpoints: eps,
                }
            },
        )
}

fn state() -> impl Strategy<Value = ProxyState> {
    (1usize..12).prop_flat_map(|n| {
        let ports: Vec<_> = (0..n).map(service_port).collect();
        ports.prop_map(|service_ports| ProxyState {
            family: IpFamily::V4,
            node: NodeInfo {
                name: "node-a".into(),
                labels: [("topology.kubernetes.io/zone".to_string(), "zone-1".to_string())].into(),
                addresses: vec!["192.0.2.10".parse().unwrap()],
                pod_cidrs: vec![],
            },
            service_ports,
            service_cidrs: vec![],
            warnings: vec![],
        })
    })
}

fn options() -> impl Strategy<Value = RenderOptions> {
    (any::<bool>(), 0u8..32, any::<bool>(), 0u8..4, any::<bool>()).prop_map(
        |(masquerade_all, bit, localhost, det, nfacct)| RenderOptions {
            masquerade_all,
            masquerade_bit: bit,
            localhost_node_ports: localhost,
            local_detector: match det {
                0 => LocalDetector::None,
                1 => LocalDetector::Cidr("10.244.0.0/16".into()),
                2 => LocalDetector::Bridge("cni0".into()),
                _ => LocalDetector::InterfacePrefix("veth".into()),
            },
            node_port_addresses: vec![],
            prefer_same_node: true,
            nfacct,
            tcp_be_liberal: false,
            random_fully: true,
        },
    )
}

/// The probability that a new connection entering `chain` takes the rule jumping to each
/// target, computed from the printed `--probability` values.
fn split_of(restore: &str, chain: &str) -> Vec<(String, f64)> {
    let mut remaining = 1.0f64;
    let mut out = Vec::new();
    for line in restore.lines().filter(|l| l.starts_with(&format!("-A {chain} "))) {
        if line.contains("-m recent") || !line.contains("-j KUBE-SEP-") {
            continue;
        }
        let target = line.rsplit(' ').next().unwrap().to_string();
        let p = match line.split(" --probability ").nth(1) {
            Some(rest) => rest.split(' ').next().unwrap().parse::<f64>().unwrap(),
            None => 1.0,
        };
        out.push((target, remaining * p));
        remaining *= 1.0 - p;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn renders_valid_unique_chains(state in state(), opts in options()) {
        let rs = render(&state, &opts);
        let mut seen = HashSet::new();
        for table in rs.restore.split("COMMIT\n").filter(|t| !t.is_empty()) {
            seen.clear();
            for line in table.lines().filter(|l| l.starts_with(':')) {
                let chain = line[1..].split(' ').next().unwrap();
                prop_assert!(chain.len() <= 28, "chain {} too long", chain);
                prop_assert!(seen.insert(chain.to_string()), "chain {} declared twice", chain);
            }
            // Every jump target is declared (or is a built-in target).
            for line in table.lines().filter(|l| l.starts_with("-A ")) {
                if let Some(t) = line.split(" -j ").nth(1).map(|r| r.split(' ').next().unwrap()) {
                    let builtin = ["ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "MARK", "MASQUERADE"].contains(&t);
                    prop_assert!(builtin || seen.contains(t), "jump to undeclared chain {}", t);
                }
            }
        }
    }

    #[test]
    fn probability_chains_split_exactly(n in 1usize..200) {
        let mut eps: Vec<Endpoint> = (0..n)
            .map(|i| Endpoint::ready(IpAddr::V4(Ipv4Addr::new(10, 1, (i / 250) as u8, (i % 250) as u8 + 1)), 80))
            .collect();
        eps.sort_by_key(|e| e.to_string());
        let name = ServicePortName { namespace: "ns".into(), name: "svc".into(), port: "p".into(), protocol: Protocol::Tcp };
        let state = ProxyState {
            family: IpFamily::V4,
            node: NodeInfo { name: "node-a".into(), ..NodeInfo::default() },
            service_ports: vec![ServicePortState {
                port: ServicePort::cluster_ip(name, "10.96.0.1".parse().unwrap(), 80),
                endpoints: eps,
            }],
            service_cidrs: vec![], warnings: vec![],
        };
        let opts = RenderOptions { local_detector: LocalDetector::None, ..RenderOptions::default() };
        let rs = render(&state, &opts);
        let chain = kube_proxy::iptables::names::service_port_chains("ns/svc:p", "tcp").cluster;
        let split = split_of(&rs.restore, &chain);
        prop_assert_eq!(split.len(), n);
        let targets: HashSet<&String> = split.iter().map(|(t, _)| t).collect();
        prop_assert_eq!(targets.len(), n, "each endpoint has its own rule");
        let total: f64 = split.iter().map(|(_, p)| p).sum();
        prop_assert!((total - 1.0).abs() < 1e-12, "the last rule is unconditional: total {}", total);
        for (t, p) in &split {
            // 10 printed digits per probability bound the error well below 1e-8.
            prop_assert!((p - 1.0 / n as f64).abs() < 1e-8, "{} gets {} instead of 1/{}", t, p, n);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, .. ProptestConfig::default() })]

    /// The renderer and the tracer agree with the model: a new connection to each cluster IP
    /// reaches exactly the endpoint set that `categorize_endpoints` chose, or is rejected /
    /// dropped when the model says it has no (local) endpoints.
    #[test]
    fn traced_cluster_ip_reaches_the_categorized_endpoints(state in state(), opts in options()) {
        use kube_proxy::iptables::render::local_addresses;
        use kube_proxy::iptables::trace::{Packet, TraceContext, trace};
        use kube_proxy::model::categorize_endpoints;

        let rs = render(&state, &opts);
        let ctx = TraceContext { local_addresses: local_addresses(&state) };
        for sps in &state.service_ports {
            let svc = &sps.port;
            let sets = categorize_endpoints(&sps.endpoints, svc, &state.node.name, state.node.zone(), opts.prefer_same_node);
            let packet = Packet {
                src: "10.244.251.7".parse().unwrap(),
                dst: svc.cluster_ip,
                dport: svc.port,
                protocol: svc.protocol,
                in_interface: Some("eth0".into()),
            };
            let t = trace(&rs, &ctx, &packet).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let chosen = if svc.internal_policy_local { &sets.local } else { &sets.cluster };
            let (verdict, mut want): (&str, Vec<String>) = if !sets.has_any {
                ("REJECT", vec![])
            } else if chosen.is_empty() {
                ("DROP", vec![])
            } else {
                ("DNAT", chosen.iter().map(|e| e.to_string()).collect())
            };
            want.sort();
            prop_assert_eq!(t.verdict.as_str(), verdict, "{}", svc.name);
            prop_assert_eq!(&t.endpoints, &want, "{}", svc.name);
        }
    }
}
