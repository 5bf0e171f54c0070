//! The iptables renderer: one family's [`ProxyState`] → the exact `iptables-restore` input that
//! upstream kube-proxy writes on a full sync (same chains, rule order, matches, comments and
//! probabilities), plus the jump rules it ensures in the built-in chains. Pure: no I/O.
//!
//! Upstream walks its service map in Go map order; we walk service ports sorted by name and
//! protocol (and endpoint chains sorted by `ip:port`), so the output is deterministic. Rule
//! order *within* a chain, which is what the kernel sees, is upstream's.

use std::fmt::Write as _;
use std::net::IpAddr;

use super::names::{self, *};
use super::{JumpRule, Ruleset};
use crate::config::ProxyConfig;
use crate::model::{
    Endpoint, EndpointSets, IpFamily, NodeInfo, NodeTopology, ProxyState, ServicePort, ServicePortState,
};
use crate::proxy::{NodePortAddresses, RenderOptions, local_addresses};

/// Above this many endpoints upstream drops per-endpoint comments to keep the ruleset small.
pub const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;
/// nfacct counter behind `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`.
pub const NFACCT_LOCALHOST_NODEPORTS: &str = "localhost_nps_accepted_pkts";
/// nfacct counter behind `kubeproxy_iptables_ct_state_invalid_dropped_packets_total`.
pub const NFACCT_CT_STATE_INVALID: &str = "ct_state_invalid_dropped_pkts";

/// What changes the iptables rules of one family besides the model: the options every mode
/// shares, and iptables mode's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesRenderOptions {
    pub common: RenderOptions,
    /// `iptables.localhostNodePorts` as configured (it only takes effect for IPv4 when
    /// nodePortAddresses include loopback).
    pub localhost_node_ports: bool,
    /// Whether the nfacct counters exist (they add `-m nfacct` to two rules).
    pub nfacct: bool,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` is set: no INVALID drop rule.
    pub tcp_be_liberal: bool,
    /// iptables supports `MASQUERADE --random-fully` (every iptables since 1.6.2).
    pub random_fully: bool,
}

impl Default for IptablesRenderOptions {
    /// Upstream's defaults on a stock node (mark bit 14, localhost NodePorts on, no
    /// local-traffic detector, `--random-fully` supported, no nfacct counters).
    fn default() -> Self {
        IptablesRenderOptions {
            common: RenderOptions::default(),
            localhost_node_ports: true,
            nfacct: false,
            tcp_be_liberal: false,
            random_fully: true,
        }
    }
}

impl IptablesRenderOptions {
    /// The options of one family's proxier for a configuration, as the daemon would run it on
    /// a stock node (nfacct counters absent, `tcp_be_liberal` unset, `--random-fully` supported).
    pub fn from_config(cfg: &ProxyConfig, family: IpFamily, node: &NodeInfo) -> IptablesRenderOptions {
        IptablesRenderOptions {
            common: RenderOptions::from_config(cfg, family, node),
            localhost_node_ports: cfg.localhost_node_ports,
            ..IptablesRenderOptions::default()
        }
    }
}

/// Appends one line to a table part (chain declarations or rules) of the restore input.
macro_rules! line {
    ($buf:expr, $($fmt:tt)*) => {{
        // Writing to a String cannot fail.
        let _ = writeln!($buf, $($fmt)*);
    }};
}

/// Go's `%0.10f` of 1/n.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

/// Go's `%#08x` of the mark.
pub fn masquerade_mark(bit: u8) -> String {
    format!("{:#08x}", 1u64 << bit)
}

/// Everything that is the same for every service port during one sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderContext {
    pub opts: IptablesRenderOptions,
    pub family: IpFamily,
    /// What decides which endpoints each service port uses on this node.
    pub topology: NodeTopology,
    /// The node's primary IP of this family (for the "allow from the node" firewall rule).
    pub node_ip: Option<IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    /// Localhost NodePorts in effect (IPv4, enabled, and loopback among nodePortAddresses).
    pub localhost_node_ports: bool,
    /// More than [`LARGE_CLUSTER_ENDPOINTS_THRESHOLD`] endpoints: per-endpoint comments dropped.
    pub large_cluster: bool,
    /// The addresses the NodePort tail rule is restricted to (when not match-all).
    pub local_addresses: Vec<IpAddr>,
    mark: String,
    if_local: String,
    /// [`cluster_ip_masquerade`] of the options.
    cluster_ip_masquerade: Option<String>,
}

impl RenderContext {
    pub fn new(state: &ProxyState, opts: &IptablesRenderOptions) -> RenderContext {
        let family = state.family;
        let node_ip = state.node.primary_ip(family);
        let npa = NodePortAddresses::new(family, &opts.common.node_port_addresses, node_ip);
        let localhost_node_ports = opts.localhost_node_ports && family == IpFamily::V4 && npa.contains_ipv4_loopback();
        let total_endpoints: usize = state.service_ports.iter().map(|s| s.endpoints.len()).sum();
        RenderContext {
            family,
            topology: NodeTopology::new(&state.node, opts.common.prefer_same_node),
            node_ip,
            node_port_addresses: npa,
            localhost_node_ports,
            large_cluster: total_endpoints > LARGE_CLUSTER_ENDPOINTS_THRESHOLD,
            local_addresses: local_addresses(state),
            mark: masquerade_mark(opts.common.masquerade_bit),
            if_local: opts.common.local_detector.if_local().join(" "),
            cluster_ip_masquerade: cluster_ip_masquerade(&opts.common),
            opts: opts.clone(),
        }
    }
}

/// The rules of one service port, split by where they go, so that a partial sync can rewrite
/// the chains of changed services only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceFragment {
    /// Lines for the filter table's fixed chains (REJECT/DROP, firewall, health check).
    pub filter_rules: String,
    /// Lines appended to nat KUBE-SERVICES.
    pub services_rules: String,
    /// Lines appended to nat KUBE-NODEPORTS.
    pub nodeports_rules: String,
    /// The service's own nat chains (KUBE-SVC/SVL/EXT/FW/SEP), in declaration order.
    pub chains: Vec<String>,
    /// Lines of those chains.
    pub chain_rules: String,
    /// Whether the service has usable endpoints anywhere (REJECT when false).
    pub has_endpoints: bool,
}

/// Renders the rules of one service port. The order of lines is upstream's.
pub fn render_service(sps: &ServicePortState, ctx: &RenderContext) -> ServiceFragment {
    let r = ServiceRules::new(sps, ctx);
    let mut f = ServiceFragment {
        has_endpoints: r.sets.has_any,
        ..ServiceFragment::default()
    };
    // The dispatch to the service's chains (or its REJECT/DROP), per kind of address.
    r.cluster_ip(&mut f);
    r.external_ips(&mut f);
    r.load_balancer_ips(&mut f);
    r.node_port(&mut f);
    r.health_check_node_port(&mut f);
    // The service's own chains.
    r.internal_masquerade(&mut f);
    r.external_chain(&mut f);
    r.firewall_chain(&mut f);
    r.service_chains(&mut f);
    r.endpoint_chains(&mut f);
    f
}

/// One service port being rendered: its names, its endpoints, and which of its chains its
/// traffic goes through.
struct ServiceRules<'a> {
    ctx: &'a RenderContext,
    svc: &'a ServicePort,
    /// `ns/svc:port`, as the comments spell it.
    name: String,
    proto: &'static str,
    chains: ServicePortChains,
    sets: EndpointSets,
    /// Internal (ClusterIP) traffic has endpoints under its traffic policy.
    has_internal: bool,
    /// External traffic has endpoints under its traffic policy.
    has_external: bool,
    /// The KUBE-FW chain filters load-balancer traffic by loadBalancerSourceRanges.
    uses_fw_chain: bool,
    /// What filter does with internal traffic that has no endpoints: (target, comment).
    internal_filter: Option<(&'static str, String)>,
    /// The same for external traffic.
    external_filter: Option<(&'static str, String)>,
}

impl<'a> ServiceRules<'a> {
    fn new(sps: &'a ServicePortState, ctx: &'a RenderContext) -> ServiceRules<'a> {
        let svc = &sps.port;
        let proto = svc.protocol.lower();
        let name = svc.name.to_string();
        let chains = names::service_port_chains(&name, proto);
        let sets = ctx.topology.endpoint_sets(sps);
        let has_endpoints = sets.has_any;
        let has_internal = sets.has_for_policy(svc.internal_policy_local);
        let has_external = sets.has_for_policy(svc.external_policy_local);
        let uses_fw_chain =
            has_endpoints && !svc.load_balancer_vips.is_empty() && !svc.load_balancer_source_ranges.is_empty();
        let no_endpoints = format!("\"{name} has no endpoints\"");
        let no_local = format!("\"{name} has no local endpoints\"");
        let (internal_filter, external_filter) = if !has_endpoints {
            (Some(("REJECT", no_endpoints.clone())), Some(("REJECT", no_endpoints)))
        } else {
            (
                (!has_internal).then(|| ("DROP", no_local.clone())),
                (!has_external).then_some(("DROP", no_local)),
            )
        };
        ServiceRules {
            ctx,
            svc,
            name,
            proto,
            chains,
            sets,
            has_internal,
            has_external,
            uses_fw_chain,
            internal_filter,
            external_filter,
        }
    }

    fn has_endpoints(&self) -> bool {
        self.sets.has_any
    }

    /// KUBE-SVL for a Local policy, KUBE-SVC for Cluster.
    fn policy_chain(&self, policy_local: bool) -> &str {
        if policy_local {
            &self.chains.local
        } else {
            &self.chains.cluster
        }
    }

    fn internal_chain(&self) -> &str {
        self.policy_chain(self.svc.internal_policy_local)
    }

    /// Where load-balancer traffic goes first: the firewall chain when source ranges apply.
    fn load_balancer_chain(&self) -> &str {
        if self.uses_fw_chain {
            &self.chains.firewall
        } else {
            &self.chains.external
        }
    }

    fn cluster_ip(&self, f: &mut ServiceFragment) {
        let (name, proto, port, cluster_ip) = (&self.name, self.proto, self.svc.port, self.svc.cluster_ip);
        match &self.internal_filter {
            None => line!(
                f.services_rules,
                "-A {KUBE_SERVICES} -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {cluster_ip} --dport {port} -j {}",
                self.internal_chain()
            ),
            Some((target, comment)) => line!(
                f.filter_rules,
                "-A {KUBE_SERVICES} -m comment --comment {comment} -m {proto} -p {proto} -d {cluster_ip} --dport {port} -j {target}"
            ),
        }
    }

    fn external_ips(&self, f: &mut ServiceFragment) {
        let (name, proto, port, external_chain) = (&self.name, self.proto, self.svc.port, &self.chains.external);
        for ext in &self.svc.external_ips {
            if self.has_endpoints() {
                line!(
                    f.services_rules,
                    "-A {KUBE_SERVICES} -m comment --comment \"{name} external IP\" -m {proto} -p {proto} -d {ext} --dport {port} -j {external_chain}"
                );
            }
            if let Some((target, comment)) = &self.external_filter {
                line!(
                    f.filter_rules,
                    "-A {KUBE_EXTERNAL_SERVICES} -m comment --comment {comment} -m {proto} -p {proto} -d {ext} --dport {port} -j {target}"
                );
            }
        }
    }

    fn load_balancer_ips(&self, f: &mut ServiceFragment) {
        let (name, proto, port, lb_chain) = (&self.name, self.proto, self.svc.port, self.load_balancer_chain());
        for lb in &self.svc.load_balancer_vips {
            if self.has_endpoints() {
                line!(
                    f.services_rules,
                    "-A {KUBE_SERVICES} -m comment --comment \"{name} loadbalancer IP\" -m {proto} -p {proto} -d {lb} --dport {port} -j {lb_chain}"
                );
            }
            if self.uses_fw_chain {
                line!(
                    f.filter_rules,
                    "-A {KUBE_PROXY_FIREWALL} -m comment --comment \"{name} traffic not accepted by {fw}\" -m {proto} -p {proto} -d {lb} --dport {port} -j DROP",
                    fw = self.chains.firewall
                );
            }
        }
        if let Some((target, comment)) = &self.external_filter {
            for lb in &self.svc.load_balancer_vips {
                line!(
                    f.filter_rules,
                    "-A {KUBE_EXTERNAL_SERVICES} -m comment --comment {comment} -m {proto} -p {proto} -d {lb} --dport {port} -j {target}"
                );
            }
        }
    }

    /// NodePorts are not subject to loadBalancerSourceRanges (upstream behaviour).
    fn node_port(&self, f: &mut ServiceFragment) {
        let (name, proto, node_port, external_chain) =
            (&self.name, self.proto, self.svc.node_port, &self.chains.external);
        if node_port == 0 {
            return;
        }
        if self.has_endpoints() {
            if self.ctx.localhost_node_ports && self.ctx.opts.nfacct {
                line!(
                    f.nodeports_rules,
                    "-A {KUBE_NODEPORTS} -m comment --comment {name} -m {proto} -p {proto} -d 127.0.0.0/8 --dport {node_port} -m nfacct --nfacct-name {NFACCT_LOCALHOST_NODEPORTS} -j {external_chain}"
                );
            }
            line!(
                f.nodeports_rules,
                "-A {KUBE_NODEPORTS} -m comment --comment {name} -m {proto} -p {proto} --dport {node_port} -j {external_chain}"
            );
        }
        if let Some((target, comment)) = &self.external_filter {
            line!(
                f.filter_rules,
                "-A {KUBE_EXTERNAL_SERVICES} -m comment --comment {comment} -m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {node_port} -j {target}"
            );
        }
    }

    /// Health-check node ports are accepted whether or not the node has local endpoints.
    fn health_check_node_port(&self, f: &mut ServiceFragment) {
        let (name, hc) = (&self.name, self.svc.health_check_node_port);
        if hc != 0 {
            line!(
                f.filter_rules,
                "-A {KUBE_NODEPORTS} -m comment --comment \"{name} health check node port\" -m tcp -p tcp --dport {hc} -j ACCEPT"
            );
        }
    }

    /// The masquerade rule at the top of the chain ClusterIP traffic goes to.
    fn internal_masquerade(&self, f: &mut ServiceFragment) {
        if !self.has_internal {
            return;
        }
        let (name, proto, port, cluster_ip) = (&self.name, self.proto, self.svc.port, self.svc.cluster_ip);
        if let Some(matches) = &self.ctx.cluster_ip_masquerade {
            line!(
                f.chain_rules,
                "-A {} -m comment --comment \"{name} cluster IP\" -m {proto} -p {proto} -d {cluster_ip} --dport {port}{matches} -j {KUBE_MARK_MASQ}",
                self.internal_chain()
            );
        }
    }

    /// KUBE-EXT: what NodePort, externalIP and load-balancer traffic goes through.
    fn external_chain(&self, f: &mut ServiceFragment) {
        if !(self.has_endpoints() && self.svc.externally_accessible()) {
            return;
        }
        let (name, external_chain, cluster_chain) = (&self.name, &self.chains.external, &self.chains.cluster);
        f.chains.push(external_chain.clone());
        let rules = &mut f.chain_rules;
        if !self.svc.external_policy_local {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            line!(
                rules,
                "-A {external_chain} -m comment --comment \"masquerade traffic for {name} external destinations\" -j {KUBE_MARK_MASQ}"
            );
        } else {
            // Pod traffic to an external address behaves as if it went out to the load
            // balancer and came back: subject to no traffic policy.
            if self.ctx.opts.common.local_detector.is_implemented() {
                line!(
                    rules,
                    "-A {external_chain} -m comment --comment \"pod traffic for {name} external destinations\" {} -j {cluster_chain}",
                    self.ctx.if_local
                );
            }
            line!(
                rules,
                "-A {external_chain} -m comment --comment \"masquerade LOCAL traffic for {name} external destinations\" -m addrtype --src-type LOCAL -j {KUBE_MARK_MASQ}"
            );
            line!(
                rules,
                "-A {external_chain} -m comment --comment \"route LOCAL traffic for {name} external destinations\" -m addrtype --src-type LOCAL -j {cluster_chain}"
            );
        }
        if self.has_external {
            line!(
                rules,
                "-A {external_chain} -j {}",
                self.policy_chain(self.svc.external_policy_local)
            );
        }
    }

    /// KUBE-FW: loadBalancerSourceRanges.
    fn firewall_chain(&self, f: &mut ServiceFragment) {
        if !self.uses_fw_chain {
            return;
        }
        let (name, fw, external_chain) = (&self.name, &self.chains.firewall, &self.chains.external);
        f.chains.push(fw.clone());
        let rules = &mut f.chain_rules;
        let mut allow_from_node = false;
        for cidr in &self.svc.load_balancer_source_ranges {
            line!(
                rules,
                "-A {fw} -m comment --comment \"{name} loadbalancer IP\" -s {cidr} -j {external_chain}"
            );
            allow_from_node |= self.ctx.node_ip.is_some_and(|ip| cidr.contains(&ip));
        }
        // A VIP bound locally makes node→VIP traffic loop back with the VIP as source.
        if allow_from_node {
            for lb in &self.svc.load_balancer_vips {
                line!(
                    rules,
                    "-A {fw} -m comment --comment \"{name} loadbalancer IP\" -s {lb} -j {external_chain}"
                );
            }
        }
        line!(
            rules,
            "-A {fw} -m comment --comment \"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL\""
        );
    }

    /// KUBE-SVC and KUBE-SVL: the choice of an endpoint, for Cluster and Local traffic.
    fn service_chains(&self, f: &mut ServiceFragment) {
        let (svc, sets, large) = (self.svc, &self.sets, self.ctx.large_cluster);
        if !sets.cluster.is_empty() && svc.uses_cluster_endpoints() {
            f.chains.push(self.chains.cluster.clone());
            write_service_to_endpoint_rules(
                &mut f.chain_rules, &self.name, svc, &self.chains.cluster, &sets.cluster, large,
            );
        }
        if !sets.local.is_empty() && svc.uses_local_endpoints() {
            f.chains.push(self.chains.local.clone());
            write_service_to_endpoint_rules(
                &mut f.chain_rules, &self.name, svc, &self.chains.local, &sets.local, large,
            );
        }
    }

    /// KUBE-SEP: one chain per endpoint, DNAT to it.
    fn endpoint_chains(&self, f: &mut ServiceFragment) {
        let (name, proto) = (&self.name, self.proto);
        let rules = &mut f.chain_rules;
        for ep in &self.sets.all_reachable {
            let chain = names::endpoint_chain(name, proto, &ep.to_string());
            let comment = if self.ctx.large_cluster {
                String::new()
            } else {
                format!(" -m comment --comment {name}")
            };
            // Hairpin: a pod reaching itself through the Service must be masqueraded.
            line!(rules, "-A {chain}{comment} -s {ip} -j {KUBE_MARK_MASQ}", ip = ep.ip);
            let affinity = if self.svc.session_affinity_timeout.is_some() {
                format!(" -m recent --name {chain} --set")
            } else {
                String::new()
            };
            line!(
                rules,
                "-A {chain}{comment}{affinity} -m {proto} -p {proto} -j DNAT --to-destination {ep}"
            );
            f.chains.push(chain);
        }
    }
}

/// The fixed chains of each table, in upstream's declaration order.
pub const FILTER_CHAINS: [&str; 5] = [
    KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL,
];
pub const NAT_CHAINS: [&str; 4] = [KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ];

/// The whole `*filter` section, which depends on every service (it is small: only services
/// without (local) endpoints, firewalls and health checks add to it).
pub fn filter_section<'a>(ctx: &RenderContext, fragments: impl Iterator<Item = &'a ServiceFragment>) -> String {
    let mark = &ctx.mark;
    let mut s = String::from("*filter\n");
    for c in FILTER_CHAINS {
        line!(s, ":{c} - [0:0]");
    }
    if ctx.localhost_node_ports {
        line!(s, ":{KUBE_FIREWALL} - [0:0]");
        // Mitigates the route_localnet exposure (upstream issue 90259); kubelet has a twin.
        line!(
            s,
            "-A {KUBE_FIREWALL} -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
        );
    }
    for f in fragments {
        s.push_str(&f.filter_rules);
    }
    // Drop INVALID packets, which would otherwise cause resets (upstream issue 74839).
    if !ctx.opts.tcp_be_liberal {
        let nfacct = if ctx.opts.nfacct {
            format!(" -m nfacct --nfacct-name {NFACCT_CT_STATE_INVALID}")
        } else {
            String::new()
        };
        line!(s, "-A {KUBE_FORWARD} -m conntrack --ctstate INVALID{nfacct} -j DROP");
    }
    s.push_str(&forward_rules(mark));
    s.push_str("COMMIT\n");
    s
}

/// What ClusterIP traffic is masqueraded, as the matches that follow the ClusterIP's own:
/// all of it with masqueradeAll (no more matches), traffic from outside the cluster with a
/// local-traffic detector (the detector's "not local" matches, after a space, since it may
/// bounce off-node), and none of it without one (`None`). IPVS mode decides the same.
pub fn cluster_ip_masquerade(common: &RenderOptions) -> Option<String> {
    if common.masquerade_all {
        Some(String::new())
    } else if common.local_detector.is_implemented() {
        Some(format!(" {}", common.local_detector.if_not_local().join(" ")))
    } else {
        None
    }
}

/// The rules of filter KUBE-FORWARD after the INVALID drop (IPVS mode writes the same): what
/// we marked is forwarded even when the FORWARD policy is DROP, and so is the rest of its flow.
pub fn forward_rules(mark: &str) -> String {
    let mut s = String::new();
    line!(
        s,
        "-A {KUBE_FORWARD} -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
    );
    line!(
        s,
        "-A {KUBE_FORWARD} -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    );
    s
}

/// Rules of nat KUBE-POSTROUTING and KUBE-MARK-MASQ.
pub fn masquerade_rules(ctx: &RenderContext) -> String {
    postrouting_rules(&ctx.mark, ctx.opts.random_fully)
}

/// Rules of nat KUBE-POSTROUTING and KUBE-MARK-MASQ for the mark `mark` (IPVS mode writes the
/// same): marked packets are masqueraded (`--random-fully` when iptables supports it).
pub fn postrouting_rules(mark: &str, random_fully: bool) -> String {
    let mut s = String::new();
    line!(s, "-A {KUBE_POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN");
    // Clear the mark so that a packet re-traversing the stack is not masqueraded twice.
    line!(s, "-A {KUBE_POSTROUTING} -j MARK --xor-mark {mark}");
    let random_fully = if random_fully { " --random-fully" } else { "" };
    line!(
        s,
        "-A {KUBE_POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE{random_fully}"
    );
    line!(s, "-A {KUBE_MARK_MASQ} -j MARK --or-mark {mark}");
    s
}

/// The NodePort tail call, which must stay the last rule of nat KUBE-SERVICES.
pub fn nodeports_tail(ctx: &RenderContext) -> String {
    let comment = "\"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    let is_ipv6 = ctx.family == IpFamily::V6;
    let mut s = String::new();
    if ctx.node_port_addresses.match_all() {
        // Localhost NodePorts never work for IPv6, and for IPv4 only with route_localnet.
        let not_loopback = if is_ipv6 {
            " ! -d ::1/128"
        } else if !ctx.localhost_node_ports {
            " ! -d 127.0.0.0/8"
        } else {
            ""
        };
        line!(
            s,
            "-A {KUBE_SERVICES} -m comment --comment {comment} -m addrtype --dst-type LOCAL{not_loopback} -j {KUBE_NODEPORTS}"
        );
    } else {
        for ip in ctx.node_port_addresses.node_ips(&ctx.local_addresses) {
            if ip.is_loopback() && (is_ipv6 || !ctx.localhost_node_ports) {
                continue;
            }
            line!(
                s,
                "-A {KUBE_SERVICES} -m comment --comment {comment} -d {ip} -j {KUBE_NODEPORTS}"
            );
        }
    }
    s
}

/// The whole `*nat` section of a full sync: the fixed chains and every service port's, the
/// `masquerade` rules ([`masquerade_rules`]), then each service port's rules, in order.
pub fn nat_section<'a>(
    ctx: &RenderContext,
    masquerade: &str,
    fragments: impl Iterator<Item = &'a ServiceFragment> + Clone,
) -> String {
    let mut s = String::from("*nat\n");
    for c in NAT_CHAINS {
        line!(s, ":{c} - [0:0]");
    }
    for f in fragments.clone() {
        for c in &f.chains {
            line!(s, ":{c} - [0:0]");
        }
    }
    s.push_str(masquerade);
    for f in fragments {
        s.push_str(&f.services_rules);
        s.push_str(&f.nodeports_rules);
        s.push_str(&f.chain_rules);
    }
    s.push_str(&nodeports_tail(ctx));
    s.push_str("COMMIT\n");
    s
}

/// Renders the full-sync ruleset of one family.
pub fn render(state: &ProxyState, opts: &IptablesRenderOptions) -> Ruleset {
    let ctx = RenderContext::new(state, opts);
    let fragments: Vec<ServiceFragment> = state
        .service_ports
        .iter()
        .map(|sps| render_service(sps, &ctx))
        .collect();
    let mut restore = filter_section(&ctx, fragments.iter());
    restore.push_str(&nat_section(&ctx, &masquerade_rules(&ctx), fragments.iter()));
    Ruleset {
        family: ctx.family,
        jumps: jump_rules(),
        restore,
    }
}

fn write_service_to_endpoint_rules(
    rules: &mut String,
    name: &str,
    svc: &ServicePort,
    chain: &str,
    endpoints: &[Endpoint],
    large_cluster: bool,
) {
    let proto = svc.protocol.lower();
    let comment = |ep: &Endpoint| {
        if large_cluster {
            String::new()
        } else {
            format!(" -m comment --comment \"{name} -> {ep}\"")
        }
    };
    // Affinity first: a client seen recently goes back to the endpoint it used.
    if let Some(timeout) = svc.session_affinity_timeout {
        for ep in endpoints {
            let sep = names::endpoint_chain(name, proto, &ep.to_string());
            line!(
                rules,
                "-A {chain}{c} -m recent --name {sep} --rcheck --seconds {timeout} --reap -j {sep}",
                c = comment(ep)
            );
        }
    }
    // Rule i matches with probability 1/(n-i), so each endpoint gets exactly 1/n.
    let n = endpoints.len();
    for (i, ep) in endpoints.iter().enumerate() {
        let sep = names::endpoint_chain(name, proto, &ep.to_string());
        let statistic = if i + 1 < n {
            format!(" -m statistic --mode random --probability {}", probability(n - i))
        } else {
            String::new()
        };
        line!(rules, "-A {chain}{c}{statistic} -j {sep}", c = comment(ep));
    }
}

/// Upstream's `iptablesJumpChains` (+ kubelet's KUBE-FIREWALL jumps), each ensured with
/// "insert at the top if missing"; returned in the order they end up in each built-in chain.
pub fn jump_rules() -> Vec<JumpRule> {
    let new = ["-m", "conntrack", "--ctstate", "NEW"];
    let spec: [(&'static str, &'static str, &'static str, &'static str, bool); 14] = [
        (
            "filter",
            "INPUT",
            KUBE_EXTERNAL_SERVICES,
            "kubernetes externally-visible service portals",
            true,
        ),
        (
            "filter",
            "FORWARD",
            KUBE_EXTERNAL_SERVICES,
            "kubernetes externally-visible service portals",
            true,
        ),
        (
            "filter", "INPUT", KUBE_NODEPORTS, "kubernetes health check service ports", false,
        ),
        ("filter", "FORWARD", KUBE_SERVICES, "kubernetes service portals", true),
        ("filter", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", true),
        ("filter", "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules", false),
        (
            "filter", "INPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", true,
        ),
        (
            "filter", "OUTPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", true,
        ),
        (
            "filter", "FORWARD", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", true,
        ),
        ("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", false),
        ("nat", "PREROUTING", KUBE_SERVICES, "kubernetes service portals", false),
        (
            "nat", "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules", false,
        ),
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
        out.push(JumpRule { table, chain, args });
    }
    inserted_at_the_top(out)
}

/// `rules`, each ensured in turn by inserting it at the top of its chain, in the order they
/// end up in each built-in chain: each later rule before the earlier ones of the same chain.
/// (IPVS mode ensures its jump rules the same way.)
pub fn inserted_at_the_top(rules: Vec<JumpRule>) -> Vec<JumpRule> {
    let mut out: Vec<JumpRule> = Vec::with_capacity(rules.len());
    for rule in rules {
        let pos = out
            .iter()
            .position(|j| j.table == rule.table && j.chain == rule.chain)
            .unwrap_or(out.len());
        out.insert(pos, rule);
    }
    out
}

impl JumpRule {
    /// `-t TABLE -I CHAIN ARGS` with comments quoted, as an operator would type it.
    pub fn to_command(&self) -> String {
        let args: Vec<String> = self
            .args
            .iter()
            .map(|a| if a.contains(' ') { format!("\"{a}\"") } else { a.clone() })
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
        assert_eq!(
            input,
            vec![
                KUBE_FIREWALL, KUBE_PROXY_FIREWALL, KUBE_NODEPORTS, KUBE_EXTERNAL_SERVICES
            ]
        );
    }

    fn state_with_endpoints(n: usize) -> ProxyState {
        use crate::model::{NodeInfo, Protocol, ServicePortName, ServicePortState};
        use std::net::Ipv4Addr;
        let mut endpoints: Vec<Endpoint> = (0..n)
            .map(|i| Endpoint::ready(IpAddr::V4(Ipv4Addr::from(0x0a01_0000u32 + i as u32)), 80))
            .collect();
        endpoints.sort_by_key(|e| e.to_string());
        let name = ServicePortName {
            namespace: "ns".into(),
            name: "big".into(),
            port: String::new(),
            protocol: Protocol::Tcp,
        };
        ProxyState {
            family: IpFamily::V4,
            node: NodeInfo {
                name: "n".into(),
                ..NodeInfo::default()
            },
            service_ports: crate::model::shared(vec![ServicePortState {
                port: ServicePort::cluster_ip(name, "10.96.0.1".parse().unwrap(), 80),
                endpoints,
            }]),
            service_cidrs: vec![],
            warnings: vec![],
        }
    }

    fn opts() -> IptablesRenderOptions {
        IptablesRenderOptions::default()
    }

    #[test]
    fn large_cluster_mode_drops_per_endpoint_comments() {
        let small = render(&state_with_endpoints(LARGE_CLUSTER_ENDPOINTS_THRESHOLD), &opts());
        assert!(
            small
                .restore
                .lines()
                .any(|l| l.starts_with("-A KUBE-SEP-") && l.contains("--comment ns/big"))
        );
        let large = render(&state_with_endpoints(LARGE_CLUSTER_ENDPOINTS_THRESHOLD + 1), &opts());
        let sep_or_svc =
            |l: &&str| l.starts_with("-A KUBE-SEP-") || (l.starts_with("-A KUBE-SVC-") && l.contains("KUBE-SEP-"));
        assert!(
            large
                .restore
                .lines()
                .filter(sep_or_svc)
                .all(|l| !l.contains("--comment"))
        );
        // The service-level rules keep theirs.
        assert!(large.restore.contains("--comment \"ns/big cluster IP\""));
    }

    #[test]
    fn nfacct_and_tcp_be_liberal_change_the_filter_rules() {
        let mut o = opts();
        o.nfacct = true;
        let rs = render(&state_with_endpoints(1), &o);
        assert!(rs.restore.contains("-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP"));
        o.tcp_be_liberal = true;
        let rs = render(&state_with_endpoints(1), &o);
        assert!(!rs.restore.contains("INVALID"));
    }
}
