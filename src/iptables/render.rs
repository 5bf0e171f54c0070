//! The iptables renderer: one family's [`ProxyState`] → the exact `iptables-restore` input that
//! upstream kube-proxy writes on a full sync (same chains, rule order, matches, comments and
//! probabilities), plus the jump rules it ensures in the built-in chains. Pure: no I/O.
//!
//! Upstream walks its service map in Go map order; we walk service ports sorted by name and
//! protocol (and endpoint chains sorted by `ip:port`), so the output is deterministic. Rule
//! order *within* a chain, which is what the kernel sees, is upstream's.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use super::names::{self, *};
use super::{JumpRule, Ruleset};
use crate::config::{LocalDetector, ProxyConfig};
use crate::model::{Endpoint, IpFamily, ProxyState, ServicePort, categorize_endpoints};

/// Above this many endpoints upstream drops per-endpoint comments to keep the ruleset small.
pub const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;
/// nfacct counter behind `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`.
pub const NFACCT_LOCALHOST_NODEPORTS: &str = "localhost_nps_accepted_pkts";
/// nfacct counter behind `kubeproxy_iptables_ct_state_invalid_dropped_packets_total`.
pub const NFACCT_CT_STATE_INVALID: &str = "ct_state_invalid_dropped_pkts";

/// Everything besides the model that changes the rules of one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    pub masquerade_all: bool,
    /// The mark is `1 << masquerade_bit`.
    pub masquerade_bit: u8,
    /// `iptables.localhostNodePorts` as configured (it only takes effect for IPv4 when
    /// nodePortAddresses include loopback).
    pub localhost_node_ports: bool,
    pub local_detector: LocalDetector,
    /// `nodePortAddresses`: CIDRs and/or `primary`; empty means every local address.
    pub node_port_addresses: Vec<String>,
    /// The `PreferSameTrafficDistribution` feature gate (node hints).
    pub prefer_same_node: bool,
    /// Whether the nfacct counters exist (they add `-m nfacct` to two rules).
    pub nfacct: bool,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` is set: no INVALID drop rule.
    pub tcp_be_liberal: bool,
    /// iptables supports `MASQUERADE --random-fully` (every iptables since 1.6.2).
    pub random_fully: bool,
}

impl RenderOptions {
    /// The options of one family's proxier for a configuration, as the daemon would run it on
    /// a stock node (nfacct counters absent, `tcp_be_liberal` unset, `--random-fully` supported).
    pub fn from_config(cfg: &ProxyConfig, family: IpFamily, state: &ProxyState) -> RenderOptions {
        RenderOptions {
            masquerade_all: cfg.masquerade_all,
            masquerade_bit: cfg.masquerade_bit,
            localhost_node_ports: cfg.localhost_node_ports,
            local_detector: cfg.local_detector(family, &state.node),
            node_port_addresses: cfg.node_port_addresses.clone(),
            prefer_same_node: cfg.feature_enabled("PreferSameTrafficDistribution"),
            nfacct: false,
            tcp_be_liberal: false,
            random_fully: true,
        }
    }
}

/// upstream's `NodePortAddresses` for one family.
#[derive(Clone, Debug)]
pub struct NodePortAddresses {
    cidrs: Vec<IpNet>,
    match_all: bool,
    contains_ipv4_loopback: bool,
}

impl NodePortAddresses {
    pub fn new(family: IpFamily, entries: &[String], primary: Option<IpAddr>) -> NodePortAddresses {
        let mut cidrs: Vec<IpNet> = Vec::new();
        for e in entries {
            if e == "primary" {
                if let Some(ip) = primary.filter(|ip| family.contains(ip)) {
                    cidrs.push(IpNet::from(ip));
                }
                continue;
            }
            if let Ok(net) = e.parse::<IpNet>()
                && family.contains(&net.addr())
            {
                cidrs.push(net.trunc());
            }
        }
        if cidrs.is_empty() {
            cidrs.push(match family {
                IpFamily::V4 => IpNet::from(IpAddr::V4(Ipv4Addr::UNSPECIFIED)).supernet_all(),
                IpFamily::V6 => IpNet::from(IpAddr::V6(Ipv6Addr::UNSPECIFIED)).supernet_all(),
            });
        }
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let contains_ipv4_loopback = cidrs
            .iter()
            .any(|c| c.addr().is_ipv4() && (c.addr().is_loopback() || c.contains(&loopback)));
        let match_all = cidrs.iter().any(|c| c.prefix_len() == 0);
        NodePortAddresses {
            cidrs,
            match_all,
            contains_ipv4_loopback,
        }
    }

    pub fn match_all(&self) -> bool {
        self.match_all
    }

    pub fn contains_ipv4_loopback(&self) -> bool {
        self.contains_ipv4_loopback
    }

    /// The node's addresses (plus loopback) that fall in the configured CIDRs.
    pub fn node_ips(&self, local_addresses: &[IpAddr]) -> Vec<IpAddr> {
        let mut out = Vec::new();
        for ip in local_addresses {
            if self.cidrs.iter().any(|c| c.contains(ip)) && !out.contains(ip) {
                out.push(*ip);
            }
        }
        out
    }
}

trait SupernetAll {
    fn supernet_all(self) -> IpNet;
}

impl SupernetAll for IpNet {
    fn supernet_all(self) -> IpNet {
        IpNet::new(self.addr(), 0).unwrap_or(self)
    }
}

/// The node's own addresses of `family` plus loopback: what `addrtype LOCAL` matches and what
/// nodePortAddresses select from.
pub fn local_addresses(state: &ProxyState) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = state
        .node
        .addresses
        .iter()
        .copied()
        .filter(|ip| state.family.contains(ip))
        .collect();
    v.push(match state.family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
    });
    v
}

/// Collects the lines of one table part (chain declarations or rules).
#[derive(Default)]
struct Lines {
    text: String,
    count: usize,
}

impl Lines {
    fn chain(&mut self, name: &str) {
        let _ = writeln!(self.text, ":{name} - [0:0]");
        self.count += 1;
    }

    fn rule<S: AsRef<str>>(&mut self, words: &[S]) {
        let mut first = true;
        for w in words {
            if !first {
                self.text.push(' ');
            }
            first = false;
            self.text.push_str(w.as_ref());
        }
        self.text.push('\n');
        self.count += 1;
    }
}

fn quoted(s: &str) -> String {
    format!("\"{s}\"")
}

/// Go's `%0.10f` of 1/n.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

/// Go's `%#08x` of the mark.
pub fn masquerade_mark(bit: u8) -> String {
    format!("{:#08x}", 1u64 << bit)
}

/// Renders the full-sync ruleset of one family.
pub fn render(state: &ProxyState, opts: &RenderOptions) -> Ruleset {
    let family = state.family;
    let is_ipv6 = family == IpFamily::V6;
    let mark = masquerade_mark(opts.masquerade_bit);
    let node_ip = state.node.primary_ip(family);
    let npa = NodePortAddresses::new(family, &opts.node_port_addresses, node_ip);
    let localhost_node_ports = opts.localhost_node_ports && !is_ipv6 && npa.contains_ipv4_loopback();
    let detector = &opts.local_detector;

    let mut filter_chains = Lines::default();
    let mut filter_rules = Lines::default();
    let mut nat_chains = Lines::default();
    let mut nat_rules = Lines::default();

    for c in [KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL] {
        filter_chains.chain(c);
    }
    for c in [KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ] {
        nat_chains.chain(c);
    }

    nat_rules.rule(&[
        "-A",
        KUBE_POSTROUTING,
        "-m",
        "mark",
        "!",
        "--mark",
        &format!("{mark}/{mark}"),
        "-j",
        "RETURN",
    ]);
    nat_rules.rule(&["-A", KUBE_POSTROUTING, "-j", "MARK", "--xor-mark", &mark]);
    let mut masq = vec![
        "-A".to_string(),
        KUBE_POSTROUTING.into(),
        "-m".into(),
        "comment".into(),
        "--comment".into(),
        quoted("kubernetes service traffic requiring SNAT"),
        "-j".into(),
        "MASQUERADE".into(),
    ];
    if opts.random_fully {
        masq.push("--random-fully".into());
    }
    nat_rules.rule(&masq);
    nat_rules.rule(&["-A", KUBE_MARK_MASQ, "-j", "MARK", "--or-mark", &mark]);

    if localhost_node_ports {
        // Mitigates the route_localnet exposure (upstream issue 90259); kubelet has a twin.
        filter_chains.chain(KUBE_FIREWALL);
        filter_rules.rule(&[
            "-A",
            KUBE_FIREWALL,
            "-m",
            "comment",
            "--comment",
            &quoted("block incoming localnet connections"),
            "-d",
            "127.0.0.0/8",
            "!",
            "-s",
            "127.0.0.0/8",
            "-m",
            "conntrack",
            "!",
            "--ctstate",
            "RELATED,ESTABLISHED,DNAT",
            "-j",
            "DROP",
        ]);
    }

    let total_endpoints: usize = state.service_ports.iter().map(|s| s.endpoints.len()).sum();
    let large_cluster = total_endpoints > LARGE_CLUSTER_ENDPOINTS_THRESHOLD;

    for sps in &state.service_ports {
        let svc = &sps.port;
        let proto = svc.protocol.lower();
        let name = svc.name.to_string();
        let chains = names::service_port_chains(&name, proto);
        let port = svc.port.to_string();
        let sets = categorize_endpoints(
            &sps.endpoints,
            svc,
            &state.node.name,
            state.node.zone(),
            opts.prefer_same_node,
        );
        let has_endpoints = sets.has_any;
        let uses_cluster_chain = !sets.cluster.is_empty() && svc.uses_cluster_endpoints();
        let uses_local_chain = !sets.local.is_empty() && svc.uses_local_endpoints();

        let mut internal_chain = chains.cluster.clone();
        let mut has_internal = has_endpoints;
        if svc.internal_policy_local {
            internal_chain = chains.local.clone();
            has_internal = !sets.local.is_empty();
        }
        let mut external_policy_chain = chains.cluster.clone();
        let mut has_external = has_endpoints;
        if svc.external_policy_local {
            external_policy_chain = chains.local.clone();
            has_external = !sets.local.is_empty();
        }
        let external_chain = chains.external.clone();
        let uses_external_chain = has_endpoints && svc.externally_accessible();
        let uses_fw_chain =
            has_endpoints && !svc.load_balancer_vips.is_empty() && !svc.load_balancer_source_ranges.is_empty();
        let lb_chain = if uses_fw_chain { chains.firewall.clone() } else { external_chain.clone() };

        let (mut internal_target, mut internal_comment) = ("", String::new());
        let (mut external_target, mut external_comment) = ("", String::new());
        if !has_endpoints {
            internal_target = "REJECT";
            internal_comment = quoted(&format!("{name} has no endpoints"));
            external_target = "REJECT";
            external_comment = internal_comment.clone();
        } else {
            if !has_internal {
                internal_target = "DROP";
                internal_comment = quoted(&format!("{name} has no local endpoints"));
            }
            if !has_external {
                external_target = "DROP";
                external_comment = quoted(&format!("{name} has no local endpoints"));
            }
        }

        let cluster_ip = svc.cluster_ip.to_string();
        // Capture the cluster IP.
        if has_internal {
            nat_rules.rule(&[
                "-A", KUBE_SERVICES, "-m", "comment", "--comment", &quoted(&format!("{name} cluster IP")),
                "-m", proto, "-p", proto, "-d", &cluster_ip, "--dport", &port, "-j", &internal_chain,
            ]);
        } else {
            filter_rules.rule(&[
                "-A", KUBE_SERVICES, "-m", "comment", "--comment", &internal_comment,
                "-m", proto, "-p", proto, "-d", &cluster_ip, "--dport", &port, "-j", internal_target,
            ]);
        }

        // Capture externalIPs.
        for ext in &svc.external_ips {
            let ext = ext.to_string();
            if has_endpoints {
                nat_rules.rule(&[
                    "-A", KUBE_SERVICES, "-m", "comment", "--comment", &quoted(&format!("{name} external IP")),
                    "-m", proto, "-p", proto, "-d", &ext, "--dport", &port, "-j", &external_chain,
                ]);
            }
            if !has_external {
                filter_rules.rule(&[
                    "-A", KUBE_EXTERNAL_SERVICES, "-m", "comment", "--comment", &external_comment,
                    "-m", proto, "-p", proto, "-d", &ext, "--dport", &port, "-j", external_target,
                ]);
            }
        }

        // Capture load-balancer ingress.
        for lb in &svc.load_balancer_vips {
            let lb = lb.to_string();
            if has_endpoints {
                nat_rules.rule(&[
                    "-A", KUBE_SERVICES, "-m", "comment", "--comment", &quoted(&format!("{name} loadbalancer IP")),
                    "-m", proto, "-p", proto, "-d", &lb, "--dport", &port, "-j", &lb_chain,
                ]);
            }
            if uses_fw_chain {
                filter_rules.rule(&[
                    "-A", KUBE_PROXY_FIREWALL, "-m", "comment", "--comment",
                    &quoted(&format!("{name} traffic not accepted by {}", chains.firewall)),
                    "-m", proto, "-p", proto, "-d", &lb, "--dport", &port, "-j", "DROP",
                ]);
            }
        }
        if !has_external {
            for lb in &svc.load_balancer_vips {
                filter_rules.rule(&[
                    "-A", KUBE_EXTERNAL_SERVICES, "-m", "comment", "--comment", &external_comment,
                    "-m", proto, "-p", proto, "-d", &lb.to_string(), "--dport", &port, "-j", external_target,
                ]);
            }
        }

        // Capture nodeports. NodePorts are not subject to loadBalancerSourceRanges (upstream).
        if svc.node_port != 0 {
            let node_port = svc.node_port.to_string();
            if has_endpoints {
                if localhost_node_ports && opts.nfacct {
                    nat_rules.rule(&[
                        "-A", KUBE_NODEPORTS, "-m", "comment", "--comment", &name, "-m", proto, "-p", proto,
                        "-d", "127.0.0.0/8", "--dport", &node_port, "-m", "nfacct", "--nfacct-name",
                        NFACCT_LOCALHOST_NODEPORTS, "-j", &external_chain,
                    ]);
                }
                nat_rules.rule(&[
                    "-A", KUBE_NODEPORTS, "-m", "comment", "--comment", &name, "-m", proto, "-p", proto,
                    "--dport", &node_port, "-j", &external_chain,
                ]);
            }
            if !has_external {
                filter_rules.rule(&[
                    "-A", KUBE_EXTERNAL_SERVICES, "-m", "comment", "--comment", &external_comment,
                    "-m", "addrtype", "--dst-type", "LOCAL", "-m", proto, "-p", proto,
                    "--dport", &node_port, "-j", external_target,
                ]);
            }
        }

        // Capture healthCheckNodePorts, whether or not the node has local endpoints.
        if svc.health_check_node_port != 0 {
            filter_rules.rule(&[
                "-A", KUBE_NODEPORTS, "-m", "comment", "--comment",
                &quoted(&format!("{name} health check node port")), "-m", "tcp", "-p", "tcp",
                "--dport", &svc.health_check_node_port.to_string(), "-j", "ACCEPT",
            ]);
        }

        // Internal traffic handling.
        if has_internal {
            let mut args: Vec<String> = vec![
                "-A".into(), internal_chain.clone(), "-m".into(), "comment".into(), "--comment".into(),
                quoted(&format!("{name} cluster IP")), "-m".into(), proto.into(), "-p".into(), proto.into(),
                "-d".into(), cluster_ip.clone(), "--dport".into(), port.clone(),
            ];
            if opts.masquerade_all {
                args.extend(["-j".into(), KUBE_MARK_MASQ.into()]);
                nat_rules.rule(&args);
            } else if detector.is_implemented() {
                // Off-cluster traffic to a ClusterIP may bounce off-node: masquerade it.
                args.extend(detector.if_not_local());
                args.extend(["-j".into(), KUBE_MARK_MASQ.into()]);
                nat_rules.rule(&args);
            }
        }

        // External traffic handling.
        if uses_external_chain {
            nat_chains.chain(&external_chain);
            if !svc.external_policy_local {
                nat_rules.rule(&[
                    "-A", &external_chain, "-m", "comment", "--comment",
                    &quoted(&format!("masquerade traffic for {name} external destinations")), "-j", KUBE_MARK_MASQ,
                ]);
            } else {
                if detector.is_implemented() {
                    let mut args: Vec<String> = vec![
                        "-A".into(), external_chain.clone(), "-m".into(), "comment".into(), "--comment".into(),
                        quoted(&format!("pod traffic for {name} external destinations")),
                    ];
                    args.extend(detector.if_local());
                    args.extend(["-j".into(), chains.cluster.clone()]);
                    nat_rules.rule(&args);
                }
                nat_rules.rule(&[
                    "-A", &external_chain, "-m", "comment", "--comment",
                    &quoted(&format!("masquerade LOCAL traffic for {name} external destinations")),
                    "-m", "addrtype", "--src-type", "LOCAL", "-j", KUBE_MARK_MASQ,
                ]);
                nat_rules.rule(&[
                    "-A", &external_chain, "-m", "comment", "--comment",
                    &quoted(&format!("route LOCAL traffic for {name} external destinations")),
                    "-m", "addrtype", "--src-type", "LOCAL", "-j", &chains.cluster,
                ]);
            }
            if has_external {
                nat_rules.rule(&["-A", &external_chain, "-j", &external_policy_chain]);
            }
        }

        // Firewall chain for loadBalancerSourceRanges.
        if uses_fw_chain {
            nat_chains.chain(&chains.firewall);
            let comment = quoted(&format!("{name} loadbalancer IP"));
            let mut allow_from_node = false;
            for cidr in &svc.load_balancer_source_ranges {
                nat_rules.rule(&[
                    "-A", &chains.firewall, "-m", "comment", "--comment", &comment, "-s", &cidr.to_string(),
                    "-j", &external_chain,
                ]);
                if node_ip.is_some_and(|ip| cidr.contains(&ip)) {
                    allow_from_node = true;
                }
            }
            // A VIP bound locally makes node→VIP traffic loop back with the VIP as source.
            if allow_from_node {
                for lb in &svc.load_balancer_vips {
                    nat_rules.rule(&[
                        "-A", &chains.firewall, "-m", "comment", "--comment", &comment, "-s", &lb.to_string(),
                        "-j", &external_chain,
                    ]);
                }
            }
            nat_rules.rule(&[
                "-A", &chains.firewall, "-m", "comment", "--comment",
                &quoted(&format!("other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL")),
            ]);
        }

        if uses_cluster_chain {
            nat_chains.chain(&chains.cluster);
            write_service_to_endpoint_rules(&mut nat_rules, &name, svc, &chains.cluster, &sets.cluster, large_cluster);
        }
        if uses_local_chain {
            nat_chains.chain(&chains.local);
            write_service_to_endpoint_rules(&mut nat_rules, &name, svc, &chains.local, &sets.local, large_cluster);
        }

        for ep in &sets.all_reachable {
            let ep_str = ep.to_string();
            let chain = names::endpoint_chain(&name, proto, &ep_str);
            nat_chains.chain(&chain);
            let mut args: Vec<String> = vec!["-A".into(), chain.clone()];
            if !large_cluster {
                args.extend(["-m".into(), "comment".into(), "--comment".into(), name.clone()]);
            }
            // Hairpin: a pod reaching itself through the Service must be masqueraded.
            let mut hairpin = args.clone();
            hairpin.extend(["-s".into(), ep.ip.to_string(), "-j".into(), KUBE_MARK_MASQ.into()]);
            nat_rules.rule(&hairpin);
            if svc.session_affinity_timeout.is_some() {
                args.extend(["-m".into(), "recent".into(), "--name".into(), chain.clone(), "--set".into()]);
            }
            args.extend([
                "-m".into(), proto.into(), "-p".into(), proto.into(), "-j".into(), "DNAT".into(),
                "--to-destination".into(), ep_str,
            ]);
            nat_rules.rule(&args);
        }
    }

    // The NodePort tail call must stay the last rule of nat KUBE-SERVICES.
    let nodeports_comment = quoted("kubernetes service nodeports; NOTE: this must be the last rule in this chain");
    if npa.match_all() {
        let mut args: Vec<String> = vec![
            "-A".into(), KUBE_SERVICES.into(), "-m".into(), "comment".into(), "--comment".into(),
            nodeports_comment, "-m".into(), "addrtype".into(), "--dst-type".into(), "LOCAL".into(),
        ];
        // Localhost NodePorts never work for IPv6, and for IPv4 only with route_localnet.
        if is_ipv6 {
            args.extend(["!".into(), "-d".into(), "::1/128".into()]);
        } else if !localhost_node_ports {
            args.extend(["!".into(), "-d".into(), "127.0.0.0/8".into()]);
        }
        args.extend(["-j".into(), KUBE_NODEPORTS.into()]);
        nat_rules.rule(&args);
    } else {
        for ip in npa.node_ips(&local_addresses(state)) {
            if ip.is_loopback() && (is_ipv6 || !localhost_node_ports) {
                continue;
            }
            nat_rules.rule(&[
                "-A", KUBE_SERVICES, "-m", "comment", "--comment", &nodeports_comment, "-d", &ip.to_string(),
                "-j", KUBE_NODEPORTS,
            ]);
        }
    }

    // Drop INVALID packets, which would otherwise cause resets (upstream issue 74839).
    if !opts.tcp_be_liberal {
        let mut rule = vec!["-A", KUBE_FORWARD, "-m", "conntrack", "--ctstate", "INVALID"];
        if opts.nfacct {
            rule.extend(["-m", "nfacct", "--nfacct-name", NFACCT_CT_STATE_INVALID]);
        }
        rule.extend(["-j", "DROP"]);
        filter_rules.rule(&rule);
    }
    filter_rules.rule(&[
        "-A", KUBE_FORWARD, "-m", "comment", "--comment", &quoted("kubernetes forwarding rules"), "-m", "mark",
        "--mark", &format!("{mark}/{mark}"), "-j", "ACCEPT",
    ]);
    filter_rules.rule(&[
        "-A", KUBE_FORWARD, "-m", "comment", "--comment", &quoted("kubernetes forwarding conntrack rule"), "-m",
        "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT",
    ]);

    let mut restore = String::with_capacity(
        filter_chains.text.len() + filter_rules.text.len() + nat_chains.text.len() + nat_rules.text.len() + 32,
    );
    restore.push_str("*filter\n");
    restore.push_str(&filter_chains.text);
    restore.push_str(&filter_rules.text);
    restore.push_str("COMMIT\n*nat\n");
    restore.push_str(&nat_chains.text);
    restore.push_str(&nat_rules.text);
    restore.push_str("COMMIT\n");

    Ruleset {
        family,
        jumps: jump_rules(),
        restore,
    }
}

fn write_service_to_endpoint_rules(
    rules: &mut Lines,
    name: &str,
    svc: &ServicePort,
    chain: &str,
    endpoints: &[Endpoint],
    large_cluster: bool,
) {
    let proto = svc.protocol.lower();
    let comment_args = |ep: &Endpoint| -> Vec<String> {
        if large_cluster {
            vec![]
        } else {
            vec!["-m".into(), "comment".into(), "--comment".into(), quoted(&format!("{name} -> {ep}"))]
        }
    };
    if let Some(timeout) = svc.session_affinity_timeout {
        for ep in endpoints {
            let sep = names::endpoint_chain(name, proto, &ep.to_string());
            let mut args: Vec<String> = vec!["-A".into(), chain.into()];
            args.extend(comment_args(ep));
            args.extend([
                "-m".into(), "recent".into(), "--name".into(), sep.clone(), "--rcheck".into(), "--seconds".into(),
                timeout.to_string(), "--reap".into(), "-j".into(), sep,
            ]);
            rules.rule(&args);
        }
    }
    let n = endpoints.len();
    for (i, ep) in endpoints.iter().enumerate() {
        let sep = names::endpoint_chain(name, proto, &ep.to_string());
        let mut args: Vec<String> = vec!["-A".into(), chain.into()];
        args.extend(comment_args(ep));
        if i < n - 1 {
            args.extend([
                "-m".into(), "statistic".into(), "--mode".into(), "random".into(), "--probability".into(),
                probability(n - i),
            ]);
        }
        args.extend(["-j".into(), sep]);
        rules.rule(&args);
    }
}

/// Upstream's `iptablesJumpChains` (+ kubelet's KUBE-FIREWALL jumps), each ensured with
/// "insert at the top if missing"; returned in the order they end up in each built-in chain.
pub fn jump_rules() -> Vec<JumpRule> {
    let new = ["-m", "conntrack", "--ctstate", "NEW"];
    let spec: [(&'static str, &'static str, &'static str, &'static str, bool); 14] = [
        ("filter", "INPUT", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", true),
        ("filter", "FORWARD", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", true),
        ("filter", "INPUT", KUBE_NODEPORTS, "kubernetes health check service ports", false),
        ("filter", "FORWARD", KUBE_SERVICES, "kubernetes service portals", true),
        ("filter", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", true),
        ("filter", "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules", false),
        ("filter", "INPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", true),
        ("filter", "OUTPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", true),
        ("filter", "FORWARD", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", true),
        ("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", false),
        ("nat", "PREROUTING", KUBE_SERVICES, "kubernetes service portals", false),
        ("nat", "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules", false),
        ("filter", "INPUT", KUBE_FIREWALL, "", false),
        ("filter", "OUTPUT", KUBE_FIREWALL, "", false),
    ];
    let mut out: Vec<JumpRule> = Vec::new();
    for (table, chain, target, comment, ctstate_new) in spec {
        let mut args: Vec<String> = Vec::new();
        if ctstate_new {
            args.extend(new.iter().map(|s| s.to_string()));
        }
        if !comment.is_empty() {
            args.extend(["-m".into(), "comment".into(), "--comment".into(), comment.into()]);
        }
        args.extend(["-j".into(), target.into()]);
        // Prepending puts each later rule before the earlier ones of the same chain.
        let pos = out
            .iter()
            .position(|j| j.table == table && j.chain == chain)
            .unwrap_or(out.len());
        out.insert(pos, JumpRule { table, chain, args });
    }
    out
}

impl JumpRule {
    /// `-t TABLE -I CHAIN ARGS` with comments quoted, as an operator would type it.
    pub fn to_command(&self) -> String {
        let args: Vec<String> = self
            .args
            .iter()
            .map(|a| if a.contains(' ') { quoted(a) } else { a.clone() })
            .collect();
        format!("-t {} -I {} {}", self.table, self.chain, args.join(" "))
    }
}

impl Ruleset {
    /// The restore input preceded by `#` comment lines naming the family and the jump rules
    /// that a full sync ensures separately; still valid `iptables-restore` input.
    pub fn annotated(&self) -> String {
        let tool = match self.family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        let mut s = format!("# {tool}-restore --noflush --counters input ({})\n", self.family);
        s.push_str(&format!("# jump rules ensured with `{tool} -I` when missing:\n"));
        for j in &self.jumps {
            s.push_str(&format!("#   {}\n", j.to_command()));
        }
        s.push_str(&self.restore);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_match_go_formatting() {
        assert_eq!(probability(2), "0.5000000000");
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(7), "0.1428571429");
    }

    #[test]
    fn mark_matches_go_formatting() {
        assert_eq!(masquerade_mark(14), "0x004000");
        assert_eq!(masquerade_mark(0), "0x000001");
        assert_eq!(masquerade_mark(31), "0x80000000");
    }

    #[test]
    fn jump_rules_in_kernel_order() {
        let jumps = jump_rules();
        let input: Vec<&str> = jumps
            .iter()
            .filter(|j| j.table == "filter" && j.chain == "INPUT")
            .map(|j| j.args.last().map(String::as_str).unwrap_or(""))
            .collect();
        assert_eq!(input, vec![KUBE_FIREWALL, KUBE_PROXY_FIREWALL, KUBE_NODEPORTS, KUBE_EXTERNAL_SERVICES]);
    }

    #[test]
    fn node_port_addresses() {
        let v4 = NodePortAddresses::new(IpFamily::V4, &[], None);
        assert!(v4.match_all() && v4.contains_ipv4_loopback());
        let p = NodePortAddresses::new(IpFamily::V4, &["primary".into()], Some("192.168.0.2".parse().unwrap()));
        assert!(!p.match_all() && !p.contains_ipv4_loopback());
        assert_eq!(
            p.node_ips(&["192.168.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap()]),
            vec!["192.168.0.2".parse::<IpAddr>().unwrap()]
        );
        let only_v6 = NodePortAddresses::new(IpFamily::V4, &["fd00::/64".into()], None);
        assert!(only_v6.match_all(), "no CIDR of the family means all addresses");
    }
}
