//! Property tests over generated proxy states: rendering never panics, chain names are unique
//! and fit iptables' 28-character limit, and the probability chains split traffic exactly 1/n.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::{IptablesRenderOptions, render};
use kube_proxy::model::{
    Endpoint, Hints, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
};
use kube_proxy::proxy::RenderOptions;
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
                Hints::default()
            } else {
                Hints::from_iter([format!("zone-{zone}")])
            },
            node_hints: Hints::default(),
            place: Default::default(),
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
            service_ports: kube_proxy::model::shared(service_ports),
            service_cidrs: vec![],
            warnings: vec![],
        })
    })
}

fn options() -> impl Strategy<Value = IptablesRenderOptions> {
    (any::<bool>(), 0u8..32, any::<bool>(), 0u8..4, any::<bool>()).prop_map(
        |(masquerade_all, bit, localhost, det, nfacct)| IptablesRenderOptions {
            common: RenderOptions {
                masquerade_all,
                masquerade_bit: bit,
                local_detector: match det {
                    0 => LocalDetector::None,
                    1 => LocalDetector::Cidr("10.244.0.0/16".into()),
                    2 => LocalDetector::Bridge("cni0".into()),
                    _ => LocalDetector::InterfacePrefix("veth".into()),
                },
                node_port_addresses: vec![],
                prefer_same_node: true,
            },
            localhost_node_ports: localhost,
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
            service_ports: kube_proxy::model::shared(vec![ServicePortState {
                port: ServicePort::cluster_ip(name, "10.96.0.1".parse().unwrap(), 80),
                endpoints: eps,
            }]),
            service_cidrs: vec![], warnings: vec![],
        };
        let opts = IptablesRenderOptions::default();
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
        use kube_proxy::proxy::local_addresses;
        use kube_proxy::iptables::trace::trace;
        use kube_proxy::trace::{Packet, TraceContext};
        use kube_proxy::model::categorize_endpoints;

        let rs = render(&state, &opts);
        let ctx = TraceContext { local_addresses: local_addresses(&state) };
        for sps in &state.service_ports {
            let svc = &sps.port;
            let sets = categorize_endpoints(&sps.endpoints, svc, &state.node.name, state.node.zone(), opts.common.prefer_same_node);
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

// ---------------------------------------------------------------------------------------------
// The nftables tracer against the iptables tracer

/// [`state`] plus what only the nftables mode reads or what tells node addresses apart:
/// ServiceCIDRs (some holding every cluster IP, some not all) and sometimes a second node
/// address that `nodePortAddresses: [primary]` does not select.
fn nft_state() -> impl Strategy<Value = ProxyState> {
    (state(), 0u8..3, any::<bool>()).prop_map(|(mut st, cidrs, second_ip)| {
        st.service_cidrs = match cidrs {
            0 => vec![],
            1 => vec!["10.96.0.0/16".parse().unwrap()],
            _ => vec!["10.96.0.0/28".parse().unwrap(), "10.100.0.0/24".parse().unwrap()],
        };
        if second_ip {
            st.node.addresses.push("192.0.2.11".parse().unwrap());
        }
        st
    })
}

/// [`options`] with every shape of `nodePortAddresses`: all addresses, the primary IP, CIDRs
/// with and without loopback.
fn nft_options() -> impl Strategy<Value = IptablesRenderOptions> {
    let npa = prop_oneof![
        Just(vec![]),
        Just(vec!["primary".to_string()]),
        Just(vec!["192.0.2.0/24".to_string()]),
        Just(vec!["192.0.2.11/32".to_string(), "127.0.0.0/8".to_string()]),
        Just(vec!["0.0.0.0/0".to_string()]),
    ];
    (options(), npa).prop_map(|(mut o, npa)| {
        o.common.node_port_addresses = npa;
        o
    })
}

/// A packet as indices into what the state offers (resolved by [`packet_of`]), so that
/// generated packets hit the state's services, node ports and firewall ranges often.
#[derive(Clone, Debug)]
struct PacketChoice {
    src: (u8, u16),
    dst: (u8, u16),
    port: (u8, u16),
    protocol: u8,
    iface: u8,
}

fn packet_choice() -> impl Strategy<Value = PacketChoice> {
    (
        (0u8..6, any::<u16>()),
        (0u8..7, any::<u16>()),
        // Mostly the service's own port, sometimes any port, sometimes the health-check one.
        (0u8..5, any::<u16>()),
        0u8..3,
        0u8..4,
    )
        .prop_map(|(src, dst, port, protocol, iface)| PacketChoice {
            src,
            dst,
            port,
            protocol,
            iface,
        })
}

fn pick<T: Copy>(v: &[T], sel: u16) -> Option<T> {
    (!v.is_empty()).then(|| v[usize::from(sel) % v.len()])
}

/// Resolves a [`PacketChoice`] against a state: sources are a pod, an outside host, a host in
/// some loadBalancerSourceRanges, the node, an endpoint (hairpin) or loopback; destinations a
/// cluster IP, an external IP, an LB IP, a node address or loopback (with a node port), an
/// address in the service range, or one outside everything.
fn packet_of(st: &ProxyState, c: &PacketChoice) -> kube_proxy::trace::Packet {
    let ports: Vec<&ServicePort> = st.service_ports.iter().map(|s| &s.port).collect();
    let svc = ports[usize::from(c.dst.1) % ports.len()];
    let ip4 = |a: u8, b: u8, c: u8, d: u8| IpAddr::V4(Ipv4Addr::new(a, b, c, d));
    let [hi, lo] = c.src.1.to_be_bytes();
    let ranges: Vec<IpNet> = ports
        .iter()
        .flat_map(|p| p.load_balancer_source_ranges.iter().copied())
        .collect();
    let endpoints: Vec<IpAddr> = st
        .service_ports
        .iter()
        .flat_map(|s| s.endpoints.iter().map(|e| e.ip))
        .collect();
    let node = pick(&st.node.addresses, c.src.1).unwrap_or(ip4(192, 0, 2, 10));
    let src = match c.src.0 {
        0 => ip4(10, 244, hi, lo.max(1)),
        1 => ip4(198, 18, hi, lo.max(1)),
        2 => match pick(&ranges, c.src.1) {
            Some(IpNet::V4(n)) => IpAddr::V4(n.hosts().next().unwrap_or(n.addr())),
            _ => ip4(198, 18, 0, 9),
        },
        3 => node,
        4 => pick(&endpoints, c.src.1).unwrap_or(ip4(10, 244, 9, 9)),
        _ => ip4(127, 0, 0, 1),
    };
    let [dhi, dlo] = c.dst.1.to_be_bytes();
    let node_dst = pick(&st.node.addresses, c.dst.1).unwrap_or(ip4(192, 0, 2, 10));
    let (dst, node_port) = match c.dst.0 {
        0 => (svc.cluster_ip, false),
        1 => (pick(&svc.external_ips, c.dst.1).unwrap_or(svc.cluster_ip), false),
        2 => (pick(&svc.load_balancer_vips, c.dst.1).unwrap_or(svc.cluster_ip), false),
        3 => (node_dst, true),
        4 => (ip4(127, 0, 0, 1), true),
        5 => (ip4(10, 96, dhi % 2, dlo), false),
        _ => (ip4(192, 0, 2, 99), false),
    };
    let (protocol, dport) = match c.port.0 {
        0..=2 if node_port && svc.node_port != 0 => (svc.protocol, svc.node_port),
        0..=2 => (svc.protocol, svc.port),
        3 => (
            [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][usize::from(c.protocol) % 3],
            c.port.1.max(1),
        ),
        _ => (svc.protocol, 31000), // the health-check node port of every ETP Local service
    };
    kube_proxy::trace::Packet {
        src,
        dst,
        dport,
        protocol,
        in_interface: match c.iface {
            0 => Some("eth0".into()),
            1 => Some("cni0".into()),
            2 => Some("veth3".into()),
            _ => None,
        },
    }
}

/// Destinations claimed by more than one service port: upstream's iptables rules let the
/// first Service win, its nftables maps the last one written (conflicting configuration, not
/// a difference in behaviour worth asserting).
fn ambiguous(st: &ProxyState, p: &kube_proxy::trace::Packet, node_dst: bool) -> bool {
    let claims = st
        .service_ports
        .iter()
        .map(|s| &s.port)
        .filter(|s| s.protocol == p.protocol)
        .filter(|s| {
            let ip_port =
                s.port == p.dport && (s.external_ips.contains(&p.dst) || s.load_balancer_vips.contains(&p.dst));
            let node_port = node_dst && s.node_port == p.dport;
            ip_port || node_port
        })
        .count();
    claims > 1
}

/// DNAT, REJECT, DROP or PASS: an explicit accept (iptables' health-check node ports) and no
/// rule at all both let the packet go on unchanged.
fn common_verdict(v: kube_proxy::trace::Verdict) -> &'static str {
    use kube_proxy::trace::Verdict;
    match v {
        Verdict::Accept | Verdict::Pass => "PASS",
        other => other.as_str(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// The nftables and iptables renderers, each traced by its own tracer, agree on what a new
    /// connection does: the verdict (DNAT / REJECT / DROP / PASS), the endpoints it can reach
    /// and whether it is masqueraded — except where upstream's nftables mode differs on
    /// purpose, each exception asserted as nftables' own behaviour:
    /// - loopback destinations: no localhost NodePorts in nftables mode (and iptables'
    ///   KUBE-FIREWALL drops martian localnet traffic), so nftables passes them;
    /// - an undefined port or protocol of a ClusterIP: nftables rejects (cluster-ips-check);
    /// - an unallocated address of a ServiceCIDR: nftables drops;
    /// - a disallowed source to an LB IP with loadBalancerSourceRanges whose Service has no
    ///   endpoints at all: nftables' firewall does not depend on endpoints and drops, where
    ///   iptables has no firewall chain then and rejects;
    /// - a node address outside nodePortAddresses: iptables' REJECT/DROP rules of NodePorts
    ///   without (local) endpoints match every local address (`addrtype LOCAL`), nftables'
    ///   only `@nodeport-ips`, so nftables passes what iptables rejects or drops there;
    /// - a connection from the node to an external or LB IP without (external) endpoints:
    ///   iptables' REJECT/DROP rules for those are in KUBE-EXTERNAL-SERVICES, which OUTPUT
    ///   does not jump to, so it passes; nftables' service-endpoints-check runs in
    ///   filter-output too;
    /// - destinations claimed by two Services (see [`ambiguous`]) are not compared.
    #[test]
    fn nftables_and_iptables_traces_agree(
        state in nft_state(),
        opts in nft_options(),
        choices in prop::collection::vec(packet_choice(), 1..16),
    ) {
        use kube_proxy::proxy::{NodePortAddresses, local_addresses};
        use kube_proxy::iptables::trace::trace;
        use kube_proxy::trace::TraceContext;
        use kube_proxy::nftables::{render::render_tx, ruleset::Ruleset, trace::trace as nft_trace};

        let ipt_rules = render(&state, &opts);
        let nft_rules = Ruleset::from_transaction(&render_tx(&state, &opts.common, true))
            .map_err(|e| TestCaseError::fail(format!("transaction does not apply: {e}")))?;
        let ctx = TraceContext { local_addresses: local_addresses(&state) };
        let cluster_ips: Vec<IpAddr> = state.service_ports.iter().map(|s| s.port.cluster_ip).collect();
        let nodeport_ips = NodePortAddresses::new(state.family, &opts.common.node_port_addresses, state.node.primary_ip(state.family))
            .node_ips(&ctx.local_addresses);
        for c in &choices {
            let p = packet_of(&state, c);
            let node_dst = ctx.local_addresses.contains(&p.dst);
            if ambiguous(&state, &p, node_dst) {
                continue;
            }
            let ipt = trace(&ipt_rules, &ctx, &p).map_err(|e| TestCaseError::fail(format!("iptables: {e}")))?;
            let nft = nft_trace(&nft_rules, &ctx, &p).map_err(|e| TestCaseError::fail(format!("nftables: {e}")))?;
            let (iv, nv) = (common_verdict(ipt.verdict), common_verdict(nft.verdict));
            let why = format!("{p:?}\niptables: {ipt:#?}\nnftables: {nft:#?}");

            if p.dst.is_loopback() {
                prop_assert_eq!(nv, "PASS", "no localhost NodePorts: {}", why);
                continue;
            }
            let is_cluster_ip = cluster_ips.contains(&p.dst);
            let defined_port = state.service_ports.iter().any(|s| {
                s.port.cluster_ip == p.dst && s.port.port == p.dport && s.port.protocol == p.protocol
            });
            if is_cluster_ip && !defined_port {
                prop_assert_eq!((iv, nv), ("PASS", "REJECT"), "undefined ClusterIP port: {}", why);
                continue;
            }
            if !is_cluster_ip && state.service_cidrs.iter().any(|n| n.contains(&p.dst)) {
                prop_assert_eq!((iv, nv), ("PASS", "DROP"), "unallocated ClusterIP: {}", why);
                continue;
            }
            let firewalled_without_endpoints = state.service_ports.iter().any(|s| {
                let svc = &s.port;
                svc.load_balancer_vips.contains(&p.dst)
                    && svc.port == p.dport
                    && svc.protocol == p.protocol
                    && !svc.load_balancer_source_ranges.is_empty()
                    && !s.endpoints.iter().any(|e| e.ready || (e.serving && e.terminating))
            });
            if firewalled_without_endpoints && (iv, nv) == ("REJECT", "DROP") {
                continue;
            }
            let external_dst = state.service_ports.iter().any(|s| {
                let svc = &s.port;
                (svc.external_ips.contains(&p.dst) || svc.load_balancer_vips.contains(&p.dst))
                    && svc.port == p.dport
                    && svc.protocol == p.protocol
            });
            if ipt.from_node && external_dst && iv == "PASS" && matches!(nv, "REJECT" | "DROP") {
                continue;
            }
            if node_dst && !nodeport_ips.contains(&p.dst) {
                // Not a NodePort address: only iptables' no-endpoint rules (addrtype LOCAL)
                // apply here.
                prop_assert!(nft.endpoints.is_empty() && ipt.endpoints.is_empty(), "not a NodePort address: {}", why);
                if iv != nv {
                    prop_assert!(matches!((iv, nv), ("REJECT" | "DROP", "PASS")), "not a NodePort address: {}", why);
                    continue;
                }
            }
            prop_assert_eq!(iv, nv, "verdict: {}", why);
            prop_assert_eq!(&ipt.endpoints, &nft.endpoints, "endpoints: {}", why);
            prop_assert_eq!(ipt.masquerade, nft.masquerade, "masquerade: {}", why);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The IPVS tracer against the iptables tracer

/// The IPVS options matching iptables mode's `opts` (what both modes read).
fn ipvs_options(opts: &IptablesRenderOptions) -> kube_proxy::ipvs::render::IpvsRenderOptions {
    kube_proxy::ipvs::render::IpvsRenderOptions {
        common: opts.common.clone(),
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// The IPVS renderer traced by the IPVS tracer and the iptables renderer traced by the
    /// iptables tracer agree on what a new connection does (verdict, endpoints, masquerade),
    /// except where upstream's IPVS mode differs on purpose, each exception asserted as IPVS
    /// mode's own behaviour:
    /// - loopback destinations: no localhost NodePorts (no virtual server on loopback);
    /// - an address on kube-ipvs0 (ClusterIP, externalIP, LB IP) on a protocol and port that
    ///   is no virtual server: KUBE-IPVS-FILTER rejects what iptables mode lets pass;
    /// - the external addresses of an externalTrafficPolicy Local Service: the virtual server
    ///   has the local endpoints, or the cluster ones when the node has none (no DROP), for
    ///   every client (no short-circuit of pod and node traffic to every endpoint), and the
    ///   node's own connections are not masqueraded;
    /// - a ClusterIP of an internalTrafficPolicy Local Service without local endpoints: the
    ///   virtual server falls back to the cluster endpoints when the Service also has external
    ///   addresses (which need them), and has none otherwise (REJECT), where iptables drops;
    /// - a disallowed source to an LB IP with loadBalancerSourceRanges whose Service has no
    ///   endpoints at all: filter INPUT drops it before IPVS could refuse it (iptables has no
    ///   firewall chain then and rejects);
    /// - a node address outside nodePortAddresses: no virtual server there, so IPVS passes
    ///   what iptables' no-endpoint rules (`addrtype LOCAL`) reject or drop;
    /// - a connection from the node to an external or LB IP without endpoints: IPVS refuses it
    ///   at LOCAL_OUT, iptables' REJECT rules for those are not on the output path (PASS);
    /// - the node to a firewalled LB IP: IPVS mode only stops it when it leaves with the VIP
    ///   as its source (KUBE-IPVS-OUT-FILTER), so with a node address it gets through;
    /// - hairpin: KUBE-LOOP-BACK holds only this node's endpoints, so a remote endpoint
    ///   reaching itself through this node is not masqueraded;
    /// - any local address (kube-ipvs0's, or a node address outside nodePortAddresses) on a
    ///   port that is also a TCP or UDP NodePort: KUBE-SERVICES sends every local destination
    ///   to KUBE-NODE-PORT, whose port-only set marks it for masquerade;
    /// - a loopback source: KUBE-SERVICES returns at once, so nothing is marked;
    /// - destinations claimed by two Services (see [`ambiguous`]) are not compared.
    #[test]
    fn ipvs_and_iptables_traces_agree(
        state in nft_state(),
        opts in nft_options(),
        choices in prop::collection::vec(packet_choice(), 1..16),
    ) {
        use kube_proxy::proxy::{NodePortAddresses, local_addresses};
        use kube_proxy::iptables::trace::trace;
        use kube_proxy::trace::TraceContext;
        use kube_proxy::ipvs::names::SetId;
        use kube_proxy::ipvs::{render::render as ipvs_render, trace::trace as ipvs_trace};
        use kube_proxy::model::categorize_endpoints;

        let ipt_rules = render(&state, &opts);
        let ipvs_rules = ipvs_render(&state, &ipvs_options(&opts));
        let ctx = TraceContext { local_addresses: local_addresses(&state) };
        let node_addresses: Vec<IpAddr> = state.node.addresses.clone();
        let npa = NodePortAddresses::new(state.family, &opts.common.node_port_addresses, state.node.primary_ip(state.family));
        let nodeport_ips = if npa.match_all() { node_addresses.clone() } else { npa.node_ips(&node_addresses) };
        for c in &choices {
            let p = packet_of(&state, c);
            let node_dst = ctx.local_addresses.contains(&p.dst);
            if ambiguous(&state, &p, node_dst) {
                continue;
            }
            let ipt = trace(&ipt_rules, &ctx, &p).map_err(|e| TestCaseError::fail(format!("iptables: {e}")))?;
            let ipvs = ipvs_trace(&ipvs_rules, &ctx, &p).map_err(|e| TestCaseError::fail(format!("ipvs: {e}")))?;
            let (iv, pv) = (common_verdict(ipt.verdict), common_verdict(ipvs.verdict));
            let why = format!("{p:?}\niptables: {ipt:#?}\nipvs: {ipvs:#?}");

            if p.dst.is_loopback() {
                prop_assert_eq!(pv, "PASS", "no localhost NodePorts: {}", why);
                continue;
            }
            let bound = ipvs_rules.bound_addresses.contains(&p.dst);
            let server = ipvs_rules.virtual_server(p.protocol, p.dst, p.dport);
            // Health-check node ports are accepted on every local address (the set holds
            // bare ports).
            let health_check = ipvs_rules
                .ipset(SetId::HealthCheckNodePort)
                .is_some_and(|s| s.entries.contains(&p.dport.to_string()));
            if bound && server.is_none() && !health_check {
                prop_assert_eq!((iv, pv), ("PASS", "REJECT"), "no virtual server on a kube-ipvs0 address: {}", why);
                continue;
            }
            // The Service whose virtual server the packet meets, if any.
            let svc = server.and_then(|vs| state.service_ports.iter().find(|s| s.port.name == vs.service));
            let external = svc.is_some_and(|s| s.port.cluster_ip != p.dst);
            if let (Some(s), Some(vs)) = (svc, server) {
                let node = &state.node;
                let sets = categorize_endpoints(&s.endpoints, &s.port, &node.name, node.zone(), opts.common.prefer_same_node);
                let policy_local = if external { s.port.external_policy_local } else { s.port.internal_policy_local };
                if policy_local && (external || sets.local.is_empty()) {
                    // What IPVS mode schedules to: the local endpoints, else the cluster ones.
                    let chosen = if sets.local.is_empty() { &sets.cluster } else { &sets.local };
                    let mut want: Vec<String> = chosen.iter().map(|e| e.to_string()).collect();
                    want.sort();
                    want.dedup();
                    let mut got: Vec<String> = vs
                        .destinations
                        .iter()
                        .map(|d| std::net::SocketAddr::new(d.address, d.port).to_string())
                        .collect();
                    got.sort();
                    prop_assert_eq!(&got, &want, "real servers of a Local policy: {}", why);
                    if pv == "DNAT" {
                        prop_assert_eq!(&ipvs.endpoints, &want, "Local policy endpoints: {}", why);
                    } else {
                        prop_assert!(matches!(pv, "DROP" | "REJECT"), "Local policy: {}", why);
                    }
                    continue;
                }
                let firewalled =
                    !s.port.load_balancer_source_ranges.is_empty() && s.port.load_balancer_vips.contains(&p.dst);
                if firewalled && !sets.has_any && (iv, pv) == ("REJECT", "DROP") {
                    continue;
                }
                if firewalled && ipt.from_node && (iv, pv) == ("DROP", "DNAT") {
                    continue;
                }
                if external && ipt.from_node && vs.destinations.is_empty() {
                    prop_assert_eq!(pv, "REJECT", "the node to an external address without endpoints: {}", why);
                    continue;
                }
            }
            if node_dst && !nodeport_ips.contains(&p.dst) {
                prop_assert!(ipvs.endpoints.is_empty() && ipt.endpoints.is_empty(), "not a NodePort address: {}", why);
                if iv != pv {
                    prop_assert!(matches!((iv, pv), ("REJECT" | "DROP", "PASS")), "not a NodePort address: {}", why);
                    continue;
                }
            }
            prop_assert_eq!(iv, pv, "verdict: {}", why);
            prop_assert_eq!(&ipt.endpoints, &ipvs.endpoints, "endpoints: {}", why);
            if ipt.masquerade != ipvs.masquerade {
                let remote_endpoint = state
                    .service_ports
                    .iter()
                    .flat_map(|s| &s.endpoints)
                    .any(|e| e.ip == p.src && !e.is_local)
                    && ipt.endpoints.iter().any(|e| e.starts_with(&format!("{}:", p.src)));
                // The TCP and UDP NodePort sets hold bare ports (SCTP's hold node addresses).
                let node_port = |local: bool| {
                    state.service_ports.iter().any(|s| {
                        let svc = &s.port;
                        svc.protocol == p.protocol && svc.node_port == p.dport && svc.external_policy_local == local
                    })
                };
                let node_port_number = (bound || node_dst)
                    && matches!(p.protocol, Protocol::Tcp | Protocol::Udp)
                    && node_port(false)
                    && !node_port(true);
                let hairpin = ipt.masquerade && remote_endpoint;
                let nodeport_mark = ipvs.masquerade && node_port_number;
                let loopback_src = p.src.is_loopback() && !ipvs.masquerade;
                prop_assert!(hairpin || nodeport_mark || loopback_src, "masquerade: {}", why);
            }
        }
    }
}
