//! The nftables renderer: one family's [`ProxyState`] → the exact transaction upstream's
//! nftables proxier sends on a full sync, in knftables' text form (one command per line, as
//! `nft -f -` reads it and as upstream's golden tests show it). Pure: no I/O.
//!
//! Layout (upstream `pkg/proxy/nftables/proxier.go`, the version with the `*-pre-dnat` base
//! chains, `cluster-ips-check` and ServiceCIDRs):
//! - table `ip kube-proxy` / `ip6 kube-proxy`;
//! - base chains `filter-prerouting-pre-dnat` / `filter-output-pre-dnat` (priority dstnat-10),
//!   `filter-input` / `filter-forward` / `filter-output` (filter), `nat-prerouting` /
//!   `nat-output` (dstnat) and `nat-postrouting` (srcnat), each jumping to its regular chains;
//! - service dispatch through the verdict maps `service-ips` and `service-nodeports`, REJECT /
//!   DROP through `no-endpoint-services` / `no-endpoint-nodeports`, loadBalancerSourceRanges
//!   through `firewall-ips`, unknown ports / unallocated ClusterIPs through `cluster-ips`;
//! - per service port the `service-` / `local-` / `external-` / `firewall-` chains, per
//!   endpoint an `endpoint-` chain and (ClientIP affinity) an `affinity-` set.
//!
//! Upstream walks its service map in Go map order; we walk service ports in [`ProxyState`]
//! order and endpoints sorted by `ip:port`, so the output is deterministic. What a live
//! proxier adds on top (flushing chains that exist in the kernel but are no longer wanted,
//! deleting stale affinity sets) depends on the kernel's state and is not rendered here.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;

use super::names::*;
use crate::config::LocalDetector;
use crate::iptables::render::{NodePortAddresses, RenderOptions, local_addresses, masquerade_mark};
use crate::model::{Endpoint, IpFamily, ProxyState, ServicePortState, categorize_endpoints};

/// One base chain: name, type, hook, numeric priority (knftables' `dstnat-10` etc.).
struct BaseChain {
    name: &'static str,
    kind: &'static str,
    hook: &'static str,
    priority: i32,
}

/// Numeric values of nftables' named priorities for the `ip`/`ip6` families.
const DSTNAT: i32 = -100;
const FILTER: i32 = 0;
const SRCNAT: i32 = 100;

const BASE_CHAINS: [BaseChain; 8] = [
    // Filtering must see pre-DNAT destination IPs, so these run before DNAT.
    BaseChain {
        name: FILTER_PREROUTING_PRE_DNAT,
        kind: "filter",
        hook: "prerouting",
        priority: DSTNAT - 10,
    },
    BaseChain {
        name: FILTER_OUTPUT_PRE_DNAT,
        kind: "filter",
        hook: "output",
        priority: DSTNAT - 10,
    },
    BaseChain {
        name: FILTER_INPUT,
        kind: "filter",
        hook: "input",
        priority: FILTER,
    },
    BaseChain {
        name: FILTER_FORWARD,
        kind: "filter",
        hook: "forward",
        priority: FILTER,
    },
    BaseChain {
        name: FILTER_OUTPUT,
        kind: "filter",
        hook: "output",
        priority: FILTER,
    },
    BaseChain {
        name: NAT_PREROUTING,
        kind: "nat",
        hook: "prerouting",
        priority: DSTNAT,
    },
    BaseChain {
        name: NAT_OUTPUT,
        kind: "nat",
        hook: "output",
        priority: DSTNAT,
    },
    BaseChain {
        name: NAT_POSTROUTING,
        kind: "nat",
        hook: "postrouting",
        priority: SRCNAT,
    },
];

/// Upstream's `nftablesJumpChains`: (destination, source base chain, extra match).
const JUMP_CHAINS: [(&str, &str, &str); 11] = [
    // `reject` is only valid in input/forward/output hooks on kernels before 5.9, so the
    // endpoint checks are not jumped to from prerouting.
    (NODEPORT_ENDPOINTS_CHECK, FILTER_INPUT, "ct state new"),
    (SERVICE_ENDPOINTS_CHECK, FILTER_INPUT, "ct state new"),
    (SERVICE_ENDPOINTS_CHECK, FILTER_FORWARD, "ct state new"),
    (SERVICE_ENDPOINTS_CHECK, FILTER_OUTPUT, "ct state new"),
    (FIREWALL_CHECK, FILTER_PREROUTING_PRE_DNAT, "ct state new"),
    (FIREWALL_CHECK, FILTER_OUTPUT_PRE_DNAT, "ct state new"),
    (SERVICES, NAT_OUTPUT, ""),
    (SERVICES, NAT_PREROUTING, ""),
    (MASQUERADING, NAT_POSTROUTING, ""),
    (CLUSTER_IPS_CHECK, FILTER_FORWARD, "ct state new"),
    (CLUSTER_IPS_CHECK, FILTER_OUTPUT, "ct state new"),
];

/// A transaction being built: knftables' text form, one command per line, with upstream's
/// de-duplication of chains (`ensureChain`) and of set/map elements (`nftElementStorage`).
struct Tx {
    family: &'static str,
    out: String,
    created_chains: HashSet<String>,
    /// (container, key) → value of every element added so far.
    elements: HashMap<(&'static str, String), String>,
}

impl Tx {
    fn new(family: IpFamily) -> Tx {
        Tx {
            family: match family {
                IpFamily::V4 => "ip",
                IpFamily::V6 => "ip6",
            },
            out: String::new(),
            created_chains: HashSet::new(),
            elements: HashMap::new(),
        }
    }

    fn cmd(&mut self, verb: &str, object: &str, rest: &str) {
        // Writing to a String cannot fail.
        let _ = writeln!(self.out, "{verb} {object} {} {TABLE}{rest}", self.family);
    }

    fn add_table(&mut self) {
        let _ = writeln!(
            self.out,
            "add table {} {TABLE} {{ comment \"rules for kube-proxy\" ; }}",
            self.family
        );
    }

    fn add_chain(&mut self, name: &str) {
        self.cmd("add", "chain", &format!(" {name}"));
    }

    fn add_chain_with_comment(&mut self, name: &str, comment: &str) {
        self.cmd("add", "chain", &format!(" {name} {{ comment \"{comment}\" ; }}"));
    }

    fn flush_chain(&mut self, name: &str) {
        self.cmd("flush", "chain", &format!(" {name}"));
    }

    fn delete_chain(&mut self, name: &str) {
        self.cmd("delete", "chain", &format!(" {name}"));
    }

    /// Upstream's `ensureChain`: add and flush a chain once per transaction.
    fn ensure_chain(&mut self, name: &str) {
        if self.created_chains.insert(name.to_string()) {
            self.add_chain(name);
            self.flush_chain(name);
        }
    }

    fn add_rule(&mut self, chain: &str, rule: &str) {
        self.cmd("add", "rule", &format!(" {chain} {rule}"));
    }

    fn add_rule_with_comment(&mut self, chain: &str, rule: &str, comment: &str) {
        self.cmd("add", "rule", &format!(" {chain} {rule} comment \"{comment}\""));
    }

    fn add_set(&mut self, name: &str, spec: &str) {
        self.cmd("add", "set", &format!(" {name} {{ {spec} ; }}"));
    }

    fn add_map(&mut self, name: &str, spec: &str) {
        self.cmd("add", "map", &format!(" {name} {{ {spec} ; }}"));
    }

    fn flush_container(&mut self, kind: &str, name: &str) {
        self.cmd("flush", kind, &format!(" {name}"));
    }

    /// Upstream's `nftElementStorage.ensureElem`: an element already present with the same
    /// value is not added again; one with another value is deleted and re-added.
    fn ensure_element(&mut self, container: &'static str, key: &str, value: Option<&str>, comment: Option<&str>) {
        let value_s = value.unwrap_or("").to_string();
        let comment = comment.map(|c| format!(" comment \"{c}\"")).unwrap_or_default();
        let body = match value {
            Some(v) => format!(" {container} {{ {key}{comment} : {v} }}"),
            None => format!(" {container} {{ {key}{comment} }}"),
        };
        match self.elements.get(&(container, key.to_string())) {
            Some(existing) if *existing == value_s => {}
            Some(_) => {
                self.cmd("delete", "element", &format!(" {container} {{ {key} }}"));
                self.cmd("add", "element", &body);
                self.elements.insert((container, key.to_string()), value_s);
            }
            None => {
                self.cmd("add", "element", &body);
                self.elements.insert((container, key.to_string()), value_s);
            }
        }
    }
}

/// The local-traffic detector's nftables matches (upstream's `IfLocalNFT` / `IfNotLocalNFT`).
/// A CIDR of the other family (or an unparseable one) means no detector for this family.
fn detector_matches(detector: &LocalDetector, family: IpFamily, ip_x: &str) -> Option<(String, String)> {
    match detector {
        LocalDetector::None => None,
        LocalDetector::Cidr(c) => {
            let net = c.trim().parse::<IpNet>().ok()?;
            if !family.contains(&net.addr()) {
                return None;
            }
            let c = c.trim();
            Some((format!("{ip_x} saddr {c}"), format!("{ip_x} saddr != {c}")))
        }
        LocalDetector::Bridge(b) => Some((format!("iifname {b}"), format!("iifname != {b}"))),
        LocalDetector::InterfacePrefix(p) => Some((format!("iifname {p}*"), format!("iifname != {p}*"))),
    }
}

/// Everything that is the same for every service port during one sync.
struct Ctx {
    family: IpFamily,
    ip_x: &'static str,
    addr_type: &'static str,
    no_localhost: &'static str,
    mark: String,
    masquerade_all: bool,
    prefer_same_node: bool,
    node_name: String,
    zone: Option<String>,
    node_ip: Option<IpAddr>,
    node_port_addresses: NodePortAddresses,
    local_addresses: Vec<IpAddr>,
    service_cidrs: Vec<IpNet>,
    /// (if local, if not local)
    detector: Option<(String, String)>,
}

impl Ctx {
    fn new(state: &ProxyState, opts: &RenderOptions) -> Ctx {
        let family = state.family;
        let (ip_x, addr_type, no_localhost) = match family {
            IpFamily::V4 => ("ip", "ipv4_addr", "ip daddr != 127.0.0.0/8"),
            IpFamily::V6 => ("ip6", "ipv6_addr", "ip6 daddr != ::1"),
        };
        let node_ip = state.node.primary_ip(family);
        Ctx {
            family,
            ip_x,
            addr_type,
            no_localhost,
            mark: masquerade_mark(opts.masquerade_bit),
            masquerade_all: opts.masquerade_all,
            prefer_same_node: opts.prefer_same_node,
            node_name: state.node.name.clone(),
            zone: state.node.zone().map(str::to_string),
            node_ip,
            node_port_addresses: NodePortAddresses::new(family, &opts.node_port_addresses, node_ip),
            local_addresses: local_addresses(state),
            service_cidrs: state
                .service_cidrs
                .iter()
                .copied()
                .filter(|n| family.contains(&n.addr()))
                .collect(),
            detector: detector_matches(&opts.local_detector, family, ip_x),
        }
    }
}

/// Renders the full-sync transaction of one family, as the first sync of a kube-proxy
/// process sends it (including the add+delete that re-creates pre-existing base chains).
pub fn render(state: &ProxyState, opts: &RenderOptions) -> String {
    render_transaction(state, opts, true)
}

/// Renders a full-sync transaction. `first_sync` adds upstream's one-time "add + delete" of
/// every base chain, so that base chains left by an earlier process (possibly with other
/// priorities) are re-created rather than failing the transaction.
pub fn render_transaction(state: &ProxyState, opts: &RenderOptions, first_sync: bool) -> String {
    let ctx = Ctx::new(state, opts);
    let mut tx = Tx::new(ctx.family);
    setup(&mut tx, &ctx, first_sync);
    for sps in &state.service_ports {
        render_service(&mut tx, &ctx, sps);
    }
    tx.out
}

/// Upstream's `setupNFTables`: the table, base chains, fixed chains, sets and maps.
fn setup(tx: &mut Tx, ctx: &Ctx, first_sync: bool) {
    let ip_x = ctx.ip_x;
    let addr = ctx.addr_type;
    let mark = &ctx.mark;
    tx.add_table();

    if first_sync {
        for bc in &BASE_CHAINS {
            tx.add_chain(bc.name);
            tx.delete_chain(bc.name);
        }
    }
    for bc in &BASE_CHAINS {
        tx.cmd(
            "add",
            "chain",
            &format!(
                " {} {{ type {} hook {} priority {} ; }}",
                bc.name, bc.kind, bc.hook, bc.priority
            ),
        );
        tx.flush_chain(bc.name);
    }

    for (dst, src, extra) in JUMP_CHAINS {
        tx.ensure_chain(dst);
        let rule = if extra.is_empty() {
            format!("jump {dst}")
        } else {
            format!("{extra} jump {dst}")
        };
        tx.add_rule(src, &rule);
    }
    for chain in [SERVICES, CLUSTER_IPS_CHECK, MASQUERADING, MARK_FOR_MASQUERADE] {
        tx.ensure_chain(chain);
    }

    tx.add_rule(MARK_FOR_MASQUERADE, &format!("mark set mark or {mark}"));
    tx.add_rule(MASQUERADING, &format!("mark and {mark} == 0 return"));
    tx.add_rule(MASQUERADING, &format!("mark set mark xor {mark}"));
    tx.add_rule(MASQUERADING, "masquerade fully-random");

    tx.add_set(CLUSTER_IPS, &format!("type {addr} ; comment \"Active ClusterIPs\""));
    tx.add_rule_with_comment(
        CLUSTER_IPS_CHECK,
        &format!("{ip_x} daddr @{CLUSTER_IPS} reject"),
        "Reject traffic to invalid ports of ClusterIPs",
    );
    if !ctx.service_cidrs.is_empty() {
        let cidrs: Vec<String> = ctx.service_cidrs.iter().map(IpNet::to_string).collect();
        tx.add_rule_with_comment(
            CLUSTER_IPS_CHECK,
            &format!("{ip_x} daddr {{ {} }} drop", cidrs.join(",")),
            "Drop traffic to unallocated ClusterIPs",
        );
    }

    // nodeport-ips exists only when nodePortAddresses is not match-all ("add + delete"
    // removes it without failing when it does not exist).
    tx.add_set(
        NODEPORT_IPS,
        &format!("type {addr} ; comment \"IPs that accept NodePort traffic\""),
    );
    let match_all = ctx.node_port_addresses.match_all();
    if match_all {
        tx.cmd("delete", "set", &format!(" {NODEPORT_IPS}"));
    } else {
        tx.flush_container("set", NODEPORT_IPS);
        for ip in ctx.node_port_addresses.node_ips(&ctx.local_addresses) {
            // Localhost NodePorts are not supported in nftables mode.
            if ip.is_loopback() {
                continue;
            }
            tx.cmd("add", "element", &format!(" {NODEPORT_IPS} {{ {ip} }}"));
        }
    }

    tx.add_map(
        NO_ENDPOINT_SERVICES,
        &format!(
            "type {addr} . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\""
        ),
    );
    tx.add_map(
        NO_ENDPOINT_NODEPORTS,
        "type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\"",
    );

    tx.add_chain_with_comment(
        REJECT_CHAIN,
        "helper for @no-endpoint-services / @no-endpoint-nodeports",
    );
    tx.flush_chain(REJECT_CHAIN);
    tx.add_rule(REJECT_CHAIN, "reject");

    tx.add_rule(
        SERVICE_ENDPOINTS_CHECK,
        &format!("{ip_x} daddr . meta l4proto . th dport vmap @{NO_ENDPOINT_SERVICES}"),
    );
    let nodeport_daddr = if match_all {
        ctx.no_localhost.to_string()
    } else {
        format!("{ip_x} daddr @{NODEPORT_IPS}")
    };
    tx.add_rule(
        NODEPORT_ENDPOINTS_CHECK,
        &format!("{nodeport_daddr} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS}"),
    );

    tx.add_map(
        FIREWALL_IPS,
        &format!(
            "type {addr} . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\""
        ),
    );
    tx.ensure_chain(FIREWALL_CHECK);
    tx.add_rule(
        FIREWALL_CHECK,
        &format!("{ip_x} daddr . meta l4proto . th dport vmap @{FIREWALL_IPS}"),
    );

    tx.add_map(
        SERVICE_IPS,
        &format!(
            "type {addr} . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\""
        ),
    );
    tx.add_map(
        SERVICE_NODEPORTS,
        "type inet_proto . inet_service : verdict ; comment \"NodePort traffic\"",
    );
    tx.add_rule(
        SERVICES,
        &format!("{ip_x} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}"),
    );
    if match_all {
        tx.add_rule(
            SERVICES,
            &format!(
                "fib daddr type local {} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}",
                ctx.no_localhost
            ),
        );
    } else {
        tx.add_rule(
            SERVICES,
            &format!("{ip_x} daddr @{NODEPORT_IPS} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}"),
        );
    }

    // Flush the containers (a full sync re-adds every element).
    tx.flush_container("set", CLUSTER_IPS);
    tx.flush_container("map", SERVICE_IPS);
    tx.flush_container("map", FIREWALL_IPS);
    tx.flush_container("map", NO_ENDPOINT_SERVICES);
    tx.flush_container("map", NO_ENDPOINT_NODEPORTS);
    tx.flush_container("map", SERVICE_NODEPORTS);
}

/// The endpoint chain and affinity set names of `ep` for the service port of `sps`.
fn endpoint_names(sps: &ServicePortState, ep: &Endpoint) -> EndpointNames {
    let n = &sps.port.name;
    EndpointNames::new(
        &n.namespace,
        &n.name,
        sps.port.protocol.lower(),
        &n.port,
        &ep.ip,
        ep.port,
    )
}

/// The per-service part of upstream's `syncProxyRules`, in its order.
fn render_service(tx: &mut Tx, ctx: &Ctx, sps: &ServicePortState) {
    let svc = &sps.port;
    let ip_x = ctx.ip_x;
    let proto = svc.protocol.lower();
    let name_string = svc.name.to_string();
    let chains = ServicePortChains::new(&svc.name.namespace, &svc.name.name, proto, &svc.name.port);
    let sets = categorize_endpoints(
        &sps.endpoints,
        svc,
        &ctx.node_name,
        ctx.zone.as_deref(),
        ctx.prefer_same_node,
    );
    let has_endpoints = sets.has_any;
    let affinity = svc.session_affinity_timeout;

    for ep in &sets.all_reachable {
        tx.ensure_chain(&endpoint_names(sps, ep).chain);
    }

    let cluster_chain = &chains.cluster;
    let uses_cluster_chain = !sets.cluster.is_empty() && svc.uses_cluster_endpoints();
    if uses_cluster_chain {
        tx.ensure_chain(cluster_chain);
    }
    let local_chain = &chains.local;
    let uses_local_chain = !sets.local.is_empty() && svc.uses_local_endpoints();
    if uses_local_chain {
        tx.ensure_chain(local_chain);
    }

    let (internal_chain, has_internal) = if svc.internal_policy_local {
        (local_chain, has_endpoints && !sets.local.is_empty())
    } else {
        (cluster_chain, has_endpoints)
    };
    let (external_policy_chain, has_external) = if svc.external_policy_local {
        (local_chain, has_endpoints && !sets.local.is_empty())
    } else {
        (cluster_chain, has_endpoints)
    };
    let external_chain = &chains.external;
    // Based on has_endpoints, not has_external: the short-circuit rules for local traffic
    // are needed even when there are no externally usable endpoints.
    let uses_external_chain = has_endpoints && svc.externally_accessible();
    if uses_external_chain {
        tx.ensure_chain(external_chain);
    }

    let reject = format!("goto {REJECT_CHAIN}");
    let (internal_verdict, external_verdict) = if !has_endpoints {
        (reject.as_str(), reject.as_str())
    } else {
        ("drop", "drop")
    };

    let port = svc.port;
    let key = |ip: &IpAddr, port: u16| format!("{ip} . {proto} . {port}");
    let cluster_ip = svc.cluster_ip;

    tx.ensure_element(CLUSTER_IPS, &cluster_ip.to_string(), None, None);
    if has_internal {
        tx.ensure_element(
            SERVICE_IPS,
            &key(&cluster_ip, port),
            Some(&format!("goto {internal_chain}")),
            None,
        );
    } else {
        tx.ensure_element(
            NO_ENDPOINT_SERVICES,
            &key(&cluster_ip, port),
            Some(internal_verdict),
            Some(&name_string),
        );
    }

    for ext in &svc.external_ips {
        if has_endpoints {
            tx.ensure_element(
                SERVICE_IPS,
                &key(ext, port),
                Some(&format!("goto {external_chain}")),
                None,
            );
        }
        if !has_external {
            // No endpoints at all (reject), or none for external traffic (drop what the
            // external chain did not short-circuit).
            tx.ensure_element(
                NO_ENDPOINT_SERVICES,
                &key(ext, port),
                Some(external_verdict),
                Some(&name_string),
            );
        }
    }

    // Unlike the iptables mode, the firewall chain does not depend on having endpoints.
    let uses_fw_chain = !svc.load_balancer_vips.is_empty() && !svc.load_balancer_source_ranges.is_empty();
    let fw_chain = &chains.firewall;
    if uses_fw_chain {
        tx.ensure_chain(fw_chain);
    }
    for lb in &svc.load_balancer_vips {
        if has_endpoints {
            tx.ensure_element(
                SERVICE_IPS,
                &key(lb, port),
                Some(&format!("goto {external_chain}")),
                None,
            );
        }
        if uses_fw_chain {
            tx.ensure_element(FIREWALL_IPS, &key(lb, port), Some(&format!("goto {fw_chain}")), None);
        }
    }
    if !has_external {
        for lb in &svc.load_balancer_vips {
            tx.ensure_element(
                NO_ENDPOINT_SERVICES,
                &key(lb, port),
                Some(external_verdict),
                Some(&name_string),
            );
        }
    }

    let node_port = svc.node_port;
    if node_port != 0 {
        let np_key = format!("{proto} . {node_port}");
        if has_endpoints {
            // NodePorts are not subject to loadBalancerSourceRanges (upstream behaviour).
            tx.ensure_element(
                SERVICE_NODEPORTS,
                &np_key,
                Some(&format!("goto {external_chain}")),
                None,
            );
        }
        if !has_external {
            tx.ensure_element(
                NO_ENDPOINT_NODEPORTS,
                &np_key,
                Some(external_verdict),
                Some(&name_string),
            );
        }
    }

    // Internal traffic: masquerade off-cluster sources (they may bounce off-node).
    if has_internal {
        // The newest upstream matches only the ClusterIP here (the chain is reached through
        // service-ips, which already matched protocol and port).
        let dst = format!("{ip_x} daddr {cluster_ip}");
        if ctx.masquerade_all {
            tx.add_rule(internal_chain, &format!("{dst} jump {MARK_FOR_MASQUERADE}"));
        } else if let Some((_, if_not_local)) = &ctx.detector {
            tx.add_rule(
                internal_chain,
                &format!("{dst} {if_not_local} jump {MARK_FOR_MASQUERADE}"),
            );
        }
    }

    if uses_external_chain {
        if !svc.external_policy_local {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            tx.add_rule(external_chain, &format!("jump {MARK_FOR_MASQUERADE}"));
        } else {
            // Pod traffic to an external address behaves as if it went out to the load
            // balancer and came back: subject to no traffic policy.
            if let Some((if_local, _)) = &ctx.detector {
                tx.add_rule_with_comment(
                    external_chain,
                    &format!("{if_local} goto {cluster_chain}"),
                    "short-circuit pod traffic",
                );
            }
            // Host-originated traffic has a local source (maybe the LB IP itself).
            tx.add_rule_with_comment(
                external_chain,
                &format!("fib saddr type local jump {MARK_FOR_MASQUERADE}"),
                "masquerade local traffic",
            );
            tx.add_rule_with_comment(
                external_chain,
                &format!("fib saddr type local goto {cluster_chain}"),
                "short-circuit local traffic",
            );
        }
        if has_external {
            tx.add_rule(external_chain, &format!("goto {external_policy_chain}"));
        }
    }

    if uses_fw_chain {
        let mut sources: Vec<String> = Vec::new();
        let mut allow_from_node = false;
        for cidr in &svc.load_balancer_source_ranges {
            sources.push(cidr.to_string());
            allow_from_node |= ctx.node_ip.is_some_and(|ip| cidr.contains(&ip));
        }
        // A VIP bound locally makes node→VIP traffic loop back with the VIP as source.
        if allow_from_node {
            sources.extend(svc.load_balancer_vips.iter().map(IpAddr::to_string));
        }
        tx.add_rule(fw_chain, &format!("{ip_x} saddr != {{ {} }} drop", sources.join(" , ")));
    }

    if let Some(timeout) = affinity {
        for ep in &sets.all_reachable {
            let set = endpoint_names(sps, ep).affinity_set;
            tx.add_set(
                &set,
                &format!("type {} ; flags dynamic,timeout ; timeout {timeout}s", ctx.addr_type),
            );
        }
    }

    if uses_cluster_chain {
        write_service_to_endpoint_rules(tx, ctx, sps, cluster_chain, &sets.cluster);
    }
    if uses_local_chain {
        write_service_to_endpoint_rules(tx, ctx, sps, local_chain, &sets.local);
    }

    for ep in &sets.all_reachable {
        let names = endpoint_names(sps, ep);
        // Hairpin: a pod reaching itself through the Service must be masqueraded.
        tx.add_rule(
            &names.chain,
            &format!("{ip_x} saddr {} jump {MARK_FOR_MASQUERADE}", ep.ip),
        );
        if affinity.is_some() {
            tx.add_rule(
                &names.chain,
                &format!("update @{} {{ {ip_x} saddr }}", names.affinity_set),
            );
        }
        tx.add_rule(&names.chain, &format!("meta l4proto {proto} dnat to {ep}"));
    }
}

/// Affinity checks, then one `numgen` lookup choosing each endpoint with probability 1/n.
fn write_service_to_endpoint_rules(
    tx: &mut Tx,
    ctx: &Ctx,
    sps: &ServicePortState,
    chain: &str,
    endpoints: &[Endpoint],
) {
    if sps.port.session_affinity_timeout.is_some() {
        for ep in endpoints {
            let names = endpoint_names(sps, ep);
            tx.add_rule(
                chain,
                &format!("{} saddr @{} goto {}", ctx.ip_x, names.affinity_set, names.chain),
            );
        }
    }
    let elements: Vec<String> = endpoints
        .iter()
        .enumerate()
        .map(|(i, ep)| format!("{i} : goto {}", endpoint_names(sps, ep).chain))
        .collect();
    tx.add_rule(
        chain,
        &format!(
            "numgen random mod {} vmap {{ {} }}",
            endpoints.len(),
            elements.join(" , ")
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NodeInfo, Protocol, ServicePort, ServicePortName};

    fn name(ns: &str, svc: &str, port: &str) -> ServicePortName {
        ServicePortName {
            namespace: ns.into(),
            name: svc.into(),
            port: port.into(),
            protocol: Protocol::Tcp,
        }
    }

    fn state(service_ports: Vec<ServicePortState>) -> ProxyState {
        ProxyState {
            family: IpFamily::V4,
            node: NodeInfo {
                name: "node1".into(),
                addresses: vec!["192.168.0.2".parse().unwrap()],
                ..NodeInfo::default()
            },
            service_ports,
            service_cidrs: vec!["172.30.0.0/16".parse().unwrap()],
            warnings: vec![],
        }
    }

    fn opts() -> RenderOptions {
        RenderOptions {
            local_detector: LocalDetector::Cidr("10.0.0.0/8".into()),
            node_port_addresses: vec!["primary".into()],
            ..RenderOptions::default()
        }
    }

    fn lines(s: &str) -> Vec<&str> {
        s.lines().collect()
    }

    /// Upstream's `TestOverallNFTablesRules` svc1: the rules match its golden dump.
    #[test]
    fn cluster_ip_service_matches_upstream_golden() {
        let st = state(vec![ServicePortState {
            port: ServicePort::cluster_ip(name("ns1", "svc1", "p80"), "172.30.0.41".parse().unwrap(), 80),
            endpoints: vec![Endpoint::ready("10.180.0.1".parse().unwrap(), 80)],
        }]);
        let out = render(&st, &opts());
        let l = lines(&out);
        for want in [
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }",
            "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 ip saddr 10.180.0.1 jump mark-for-masquerade",
            "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 meta l4proto tcp dnat to 10.180.0.1:80",
            "add element ip kube-proxy cluster-ips { 172.30.0.41 }",
            "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }",
            "add table ip kube-proxy { comment \"rules for kube-proxy\" ; }",
            "add chain ip kube-proxy filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }",
            "add chain ip kube-proxy filter-input { type filter hook input priority 0 ; }",
            "add chain ip kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }",
            "add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"",
            "add rule ip kube-proxy cluster-ips-check ip daddr { 172.30.0.0/16 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
            "add rule ip kube-proxy services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
            "add rule ip kube-proxy nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
            "add element ip kube-proxy nodeport-ips { 192.168.0.2 }",
            "add rule ip kube-proxy masquerading mark and 0x004000 == 0 return",
            "add chain ip kube-proxy reject-chain { comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }",
        ] {
            assert!(l.contains(&want), "missing {want:?} in\n{out}");
        }
    }

    /// svc5 of the golden test: LoadBalancer, Cluster policy, source ranges, ClientIP.
    #[test]
    fn firewall_and_affinity_match_upstream_golden() {
        let mut port = ServicePort::cluster_ip(name("ns5", "svc5", "p80"), "172.30.0.45".parse().unwrap(), 80);
        port.node_port = 3002;
        port.load_balancer_vips = vec!["5.6.7.8".parse().unwrap()];
        port.load_balancer_source_ranges = vec!["203.0.113.0/25".parse().unwrap()];
        port.session_affinity_timeout = Some(10800);
        let st = state(vec![ServicePortState {
            port,
            endpoints: vec![Endpoint::ready("10.180.0.3".parse().unwrap(), 80)],
        }]);
        let out = render(&st, &opts());
        let l = lines(&out);
        for want in [
            "add set ip kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }",
            "add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80",
            "add rule ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80 jump mark-for-masquerade",
            "add rule ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80 goto service-HVFWP5L3-ns5/svc5/tcp/p80",
            "add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 update @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { ip saddr }",
            "add rule ip kube-proxy firewall-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr != { 203.0.113.0/25 } drop",
            "add element ip kube-proxy service-ips { 5.6.7.8 . tcp . 80 : goto external-HVFWP5L3-ns5/svc5/tcp/p80 }",
            "add element ip kube-proxy service-nodeports { tcp . 3002 : goto external-HVFWP5L3-ns5/svc5/tcp/p80 }",
            "add element ip kube-proxy firewall-ips { 5.6.7.8 . tcp . 80 : goto firewall-HVFWP5L3-ns5/svc5/tcp/p80 }",
        ] {
            assert!(l.contains(&want), "missing {want:?} in\n{out}");
        }
    }

    /// svc2 (ETP Local without local endpoints) and svc6 (no endpoints) of the golden test.
    #[test]
    fn no_endpoints_verdicts_match_upstream_golden() {
        let mut svc2 = ServicePort::cluster_ip(name("ns2", "svc2", "p80"), "172.30.0.42".parse().unwrap(), 80);
        svc2.node_port = 3001;
        svc2.load_balancer_vips = vec!["1.2.3.4".parse().unwrap()];
        svc2.external_ips = vec!["192.168.99.22".parse().unwrap()];
        svc2.external_policy_local = true;
        svc2.health_check_node_port = 30000;
        let svc6 = ServicePort::cluster_ip(name("ns6", "svc6", "p80"), "172.30.0.46".parse().unwrap(), 80);
        let st = state(vec![
            ServicePortState {
                port: svc2,
                endpoints: vec![Endpoint::ready("10.180.0.2".parse().unwrap(), 80)],
            },
            ServicePortState {
                port: svc6,
                endpoints: vec![],
            },
        ]);
        let out = render(&st, &opts());
        let l = lines(&out);
        for want in [
            "add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 ip saddr 10.0.0.0/8 goto service-42NFTM6N-ns2/svc2/tcp/p80 comment \"short-circuit pod traffic\"",
            "add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\"",
            "add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local goto service-42NFTM6N-ns2/svc2/tcp/p80 comment \"short-circuit local traffic\"",
            "add element ip kube-proxy service-ips { 192.168.99.22 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }",
            "add element ip kube-proxy service-nodeports { tcp . 3001 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }",
            "add element ip kube-proxy no-endpoint-nodeports { tcp . 3001 comment \"ns2/svc2:p80\" : drop }",
            "add element ip kube-proxy no-endpoint-services { 1.2.3.4 . tcp . 80 comment \"ns2/svc2:p80\" : drop }",
            "add element ip kube-proxy no-endpoint-services { 192.168.99.22 . tcp . 80 comment \"ns2/svc2:p80\" : drop }",
            "add element ip kube-proxy cluster-ips { 172.30.0.46 }",
            "add element ip kube-proxy no-endpoint-services { 172.30.0.46 . tcp . 80 comment \"ns6/svc6:p80\" : goto reject-chain }",
        ] {
            assert!(l.contains(&want), "missing {want:?} in\n{out}");
        }
        // No chain of svc6 and no fallthrough to the (missing) local chain of svc2.
        assert!(!out.contains("ns6/svc6/tcp"));
        assert!(!out.contains("goto local-42NFTM6N"));
    }

    #[test]
    fn shared_cluster_ip_is_added_once_and_match_all_nodeports() {
        let a = ServicePort::cluster_ip(name("ns", "s", "a"), "10.96.0.10".parse().unwrap(), 53);
        let b = ServicePort::cluster_ip(name("ns", "s", "b"), "10.96.0.10".parse().unwrap(), 54);
        let st = state(vec![
            ServicePortState {
                port: a,
                endpoints: vec![],
            },
            ServicePortState {
                port: b,
                endpoints: vec![],
            },
        ]);
        let mut o = opts();
        o.node_port_addresses = vec![];
        let out = render(&st, &o);
        assert_eq!(
            out.matches("add element ip kube-proxy cluster-ips { 10.96.0.10 }")
                .count(),
            1
        );
        assert!(out.contains("delete set ip kube-proxy nodeport-ips\n"));
        assert!(out.contains(
            "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports\n"
        ));
        assert!(!out.contains("@nodeport-ips"));
    }

    #[test]
    fn first_sync_recreates_base_chains_and_detectors_render() {
        let st = state(vec![]);
        let first = render_transaction(&st, &opts(), true);
        let later = render_transaction(&st, &opts(), false);
        assert!(first.contains("add chain ip kube-proxy nat-output\ndelete chain ip kube-proxy nat-output\n"));
        assert!(!later.contains("delete chain"));
        assert_eq!(
            detector_matches(&LocalDetector::InterfacePrefix("veth".into()), IpFamily::V4, "ip"),
            Some(("iifname veth*".into(), "iifname != veth*".into()))
        );
        assert_eq!(
            detector_matches(&LocalDetector::Bridge("cni0".into()), IpFamily::V6, "ip6"),
            Some(("iifname cni0".into(), "iifname != cni0".into()))
        );
        // A CIDR of the other family is no detector for this one.
        assert_eq!(
            detector_matches(&LocalDetector::Cidr("10.0.0.0/8".into()), IpFamily::V6, "ip6"),
            None
        );
    }
}
