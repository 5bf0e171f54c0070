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
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::ast::{
    AddrSpec, BaseHook, ChainDecl, Dir, ElemKey, ElemValue, Element, KeyType, MapValue, Match, Op, Rule, SetDecl,
    Statement, Transaction, Verdict, VmapKey,
};
use super::blocks::{self, BLOCK, Blocks, Pool, PortBlocks};
use super::names::*;
use crate::config::LocalDetector;
use crate::model::{Endpoint, EndpointSets, IpFamily, NodeTopology, ProxyState, ServicePort, ServicePortState};
use crate::proxy::{NodePortAddresses, RenderOptions, local_addresses};

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

/// Upstream's `nftablesJumpChains`: (destination, source base chain, `ct state new` first).
const JUMP_CHAINS: [(&str, &str, bool); 11] = [
    // `reject` is only valid in input/forward/output hooks on kernels before 5.9, so the
    // endpoint checks are not jumped to from prerouting.
    (NODEPORT_ENDPOINTS_CHECK, FILTER_INPUT, true),
    (SERVICE_ENDPOINTS_CHECK, FILTER_INPUT, true),
    (SERVICE_ENDPOINTS_CHECK, FILTER_FORWARD, true),
    (SERVICE_ENDPOINTS_CHECK, FILTER_OUTPUT, true),
    (FIREWALL_CHECK, FILTER_PREROUTING_PRE_DNAT, true),
    (FIREWALL_CHECK, FILTER_OUTPUT_PRE_DNAT, true),
    (SERVICES, NAT_OUTPUT, false),
    (SERVICES, NAT_PREROUTING, false),
    (MASQUERADING, NAT_POSTROUTING, false),
    (CLUSTER_IPS_CHECK, FILTER_FORWARD, true),
    (CLUSTER_IPS_CHECK, FILTER_OUTPUT, true),
];

/// A transaction being built, with upstream's de-duplication of chains (`ensureChain`) and
/// of set/map elements (`nftElementStorage`).
struct Tx {
    tx: Transaction,
    created_chains: HashSet<String>,
    /// (container, key) → value of every element added so far.
    elements: HashMap<(&'static str, ElemKey), Option<ElemValue>>,
}

impl Tx {
    fn new(family: IpFamily) -> Tx {
        Tx {
            tx: Transaction::new(family),
            created_chains: HashSet::new(),
            elements: HashMap::new(),
        }
    }

    fn add_chain(&mut self, name: &str) {
        self.tx.push(Op::AddChain(ChainDecl::regular(name)));
    }

    fn flush_chain(&mut self, name: &str) {
        self.tx.push(Op::FlushChain(name.to_string()));
    }

    /// Upstream's `ensureChain`: add and flush a chain once per transaction.
    fn ensure_chain(&mut self, name: &str) {
        if self.created_chains.insert(name.to_string()) {
            self.add_chain(name);
            self.flush_chain(name);
        }
    }

    fn add_rule(&mut self, chain: &str, rule: Rule) {
        self.tx.push(Op::AddRule {
            chain: chain.to_string(),
            rule,
        });
    }

    fn add_set(&mut self, name: &str, key: KeyType, map: Option<MapValue>, comment: Option<&str>) {
        self.tx.push(Op::AddSet(SetDecl {
            name: name.to_string(),
            key,
            map,
            timeout_seconds: None,
            comment: comment.map(str::to_string),
        }));
    }

    /// Upstream's `nftElementStorage.ensureElem`: an element already present with the same
    /// value is not added again; one with another value is deleted and re-added.
    fn ensure_element(
        &mut self,
        container: &'static str,
        key: ElemKey,
        value: Option<ElemValue>,
        comment: Option<&str>,
    ) {
        let element = Element {
            key: key.clone(),
            value: value.clone(),
            comment: comment.map(str::to_string),
        };
        let add = Op::AddElement {
            set: container.to_string(),
            element,
        };
        match self.elements.get(&(container, key.clone())) {
            Some(existing) if *existing == value => {}
            Some(_) => {
                self.tx.push(Op::DeleteElement {
                    set: container.to_string(),
                    key: key.clone(),
                });
                self.tx.push(add);
                self.elements.insert((container, key), value);
            }
            None => {
                self.tx.push(add);
                self.elements.insert((container, key), value);
            }
        }
    }
}

/// The local-traffic detector's nftables matches (upstream's `IfLocalNFT` / `IfNotLocalNFT`).
/// A CIDR of the other family (or an unparseable one) means no detector for this family.
fn detector_matches(detector: &LocalDetector, family: IpFamily) -> Option<(Match, Match)> {
    let iifname = |pattern: String| {
        (
            Match::Iifname {
                negate: false,
                pattern: pattern.clone(),
            },
            Match::Iifname { negate: true, pattern },
        )
    };
    match detector {
        LocalDetector::None => None,
        LocalDetector::Cidr(c) => {
            let net = c.trim().parse::<IpNet>().ok()?;
            if !family.contains(&net.addr()) {
                return None;
            }
            let m = |negate| Match::Addr {
                dir: Dir::Saddr,
                negate,
                spec: AddrSpec::Net(net),
            };
            Some((m(false), m(true)))
        }
        LocalDetector::Bridge(b) => Some(iifname(b.clone())),
        LocalDetector::InterfacePrefix(p) => Some(iifname(format!("{p}*"))),
    }
}

fn daddr(net: IpNet) -> Match {
    Match::Addr {
        dir: Dir::Daddr,
        negate: false,
        spec: AddrSpec::Net(net),
    }
}

fn addr_in_set(dir: Dir, set: &str) -> Match {
    Match::Addr {
        dir,
        negate: false,
        spec: AddrSpec::Set(set.to_string()),
    }
}

fn jump(chain: &str) -> Verdict {
    Verdict::Jump(chain.to_string())
}

fn goto(chain: &str) -> Verdict {
    Verdict::Goto(chain.to_string())
}

/// Everything that is the same for every service port during one sync.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Ctx {
    family: IpFamily,
    /// `ip daddr != 127.0.0.0/8` / `ip6 daddr != ::1`
    no_localhost: Match,
    mark: u32,
    masquerade_all: bool,
    /// What decides which endpoints each service port uses on this node.
    topology: NodeTopology,
    node_ip: Option<IpAddr>,
    node_port_addresses: NodePortAddresses,
    local_addresses: Vec<IpAddr>,
    service_cidrs: Vec<IpNet>,
    /// (if local, if not local)
    detector: Option<(Match, Match)>,
}

impl Ctx {
    fn new(state: &ProxyState, opts: &RenderOptions) -> Ctx {
        let family = state.family;
        let loopback: IpNet = match family {
            IpFamily::V4 => IpNet::new(IpAddr::from([127, 0, 0, 0]), 8),
            IpFamily::V6 => IpNet::new(IpAddr::from(std::net::Ipv6Addr::LOCALHOST), 128),
        }
        .unwrap_or_default();
        let node_ip = state.node.primary_ip(family);
        Ctx {
            family,
            no_localhost: Match::Addr {
                dir: Dir::Daddr,
                negate: true,
                spec: AddrSpec::Net(loopback),
            },
            mark: 1u32.checked_shl(u32::from(opts.masquerade_bit)).unwrap_or(0),
            masquerade_all: opts.masquerade_all,
            topology: NodeTopology::new(&state.node, opts.prefer_same_node),
            node_ip,
            node_port_addresses: NodePortAddresses::new(family, &opts.node_port_addresses, node_ip),
            local_addresses: local_addresses(state),
            service_cidrs: state
                .service_cidrs
                .iter()
                .copied()
                .filter(|n| family.contains(&n.addr()))
                .collect(),
            detector: detector_matches(&opts.local_detector, family),
        }
    }
}

/// Renders the full-sync transaction of one family, as the first sync of a kube-proxy
/// process sends it (including the add+delete that re-creates pre-existing base chains).
pub fn render(state: &ProxyState, opts: &RenderOptions) -> String {
    render_transaction(state, opts, true)
}

/// [`render_tx`] in knftables' text form.
pub fn render_transaction(state: &ProxyState, opts: &RenderOptions, first_sync: bool) -> String {
    render_tx(state, opts, first_sync).text()
}

/// Renders a full-sync transaction. `first_sync` adds upstream's one-time "add + delete" of
/// every base chain, so that base chains left by an earlier process (possibly with other
/// priorities) are re-created rather than failing the transaction.
pub fn render_tx(state: &ProxyState, opts: &RenderOptions, first_sync: bool) -> Transaction {
    let mut parts = render_parts(state, opts, first_sync);
    let mut tx = parts.setup;
    for s in parts.services.drain(..) {
        tx.ops.extend(s.ops);
    }
    tx
}

/// A full-sync transaction cut in two: the fixed setup (table, base and fixed chains, sets,
/// maps) and the commands of each service port, in [`ProxyState`] order. Element
/// de-duplication runs across all of them, as in one transaction.
pub struct RenderedParts {
    pub setup: Transaction,
    pub services: Vec<Transaction>,
}

pub fn render_parts(state: &ProxyState, opts: &RenderOptions, first_sync: bool) -> RenderedParts {
    let ctx = Ctx::new(state, opts);
    let mut tx = Tx::new(ctx.family);
    setup(&mut tx, &ctx, first_sync);
    let setup_tx = std::mem::replace(&mut tx.tx, Transaction::new(ctx.family));
    let mut services = Vec::with_capacity(state.service_ports.len());
    // Blocks in state order, as a proxier that synced this state from nothing holds them.
    let mut taken = Blocks::default();
    for sps in &state.service_ports {
        let port_blocks = allocate_blocks(&mut taken, sps);
        render_service(&mut tx, &ctx, sps, port_blocks);
        services.push(std::mem::replace(&mut tx.tx, Transaction::new(ctx.family)));
    }
    RenderedParts {
        setup: setup_tx,
        services,
    }
}

/// Renders the parts of a transaction one at a time, for a proxier that sends only what
/// changed. Two renderers compare equal when every part they render would be the same for
/// equal service ports (same node, options and ServiceCIDRs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRenderer {
    ctx: Ctx,
}

impl ServiceRenderer {
    pub fn new(state: &ProxyState, opts: &RenderOptions) -> ServiceRenderer {
        ServiceRenderer {
            ctx: Ctx::new(state, opts),
        }
    }

    /// The table, base and fixed chains, sets and maps (and their flushes) of a full sync.
    pub fn family(&self) -> IpFamily {
        self.ctx.family
    }

    pub fn setup(&self, first_sync: bool) -> Transaction {
        let mut tx = Tx::new(self.ctx.family);
        setup(&mut tx, &self.ctx, first_sync);
        tx.tx
    }

    /// The commands that create one service port's chains, sets and elements on their own
    /// (element de-duplication only within this service port). `blocks`: the numgen blocks of
    /// its selections ([`map_pools`]), or `None` for a chain per endpoint.
    pub fn service(&self, sps: &ServicePortState, blocks: Option<PortBlocks>) -> Transaction {
        let mut tx = Tx::new(self.ctx.family);
        render_service(&mut tx, &self.ctx, sps, blocks);
        tx.tx
    }
}

/// The selections a service port makes through `service-endpoints`, or `None` when it keeps
/// upstream's chain per endpoint: ClientIP affinity remembers the chosen endpoint per client
/// in a set per endpoint, updated from that endpoint's chain.
pub fn map_pools(sps: &ServicePortState) -> Option<Vec<Pool>> {
    let svc = &sps.port;
    if svc.session_affinity_timeout.is_some() {
        return None;
    }
    let mut pools = Vec::with_capacity(2);
    if svc.uses_cluster_endpoints() {
        pools.push(Pool::Cluster);
    }
    if svc.uses_local_endpoints() {
        pools.push(Pool::Local);
    }
    Some(pools)
}

/// Allocates the blocks a service port needs; `None` (and nothing taken) when it keeps a
/// chain per endpoint, by its kind or because the blocks ran out.
pub fn allocate_blocks(taken: &mut Blocks, sps: &ServicePortState) -> Option<PortBlocks> {
    update_blocks(taken, sps, None)
}

/// The blocks of a service port that held `current`: those it keeps, new ones for the
/// selections it gained, those it lost released; `None` (all released) when it now keeps a
/// chain per endpoint.
pub fn update_blocks(taken: &mut Blocks, sps: &ServicePortState, current: Option<PortBlocks>) -> Option<PortBlocks> {
    let mut port_blocks = current.unwrap_or_default();
    let pools = map_pools(sps).unwrap_or_default();
    taken.update(&sps.port.name, &mut port_blocks, &pools);
    if !pools.is_empty() && pools.iter().all(|p| port_blocks.get(*p).is_some()) {
        Some(port_blocks)
    } else {
        taken.update(&sps.port.name, &mut port_blocks, &[]);
        None
    }
}

/// Upstream's `setupNFTables`: the table, base chains, fixed chains, sets and maps.
fn setup(tx: &mut Tx, ctx: &Ctx, first_sync: bool) {
    tx.tx.push(Op::AddTable);
    base_chains(tx, first_sync);
    masquerading(tx, ctx.mark);
    cluster_ips_check(tx, ctx);
    nodeport_ips(tx, ctx);
    no_endpoint_checks(tx, ctx);
    firewall_check(tx);
    service_maps(tx, ctx);
    // Flush the containers (a full sync re-adds every element).
    for (name, map) in [
        (CLUSTER_IPS, false),
        (SERVICE_IPS, true),
        (FIREWALL_IPS, true),
        (NO_ENDPOINT_SERVICES, true),
        (NO_ENDPOINT_NODEPORTS, true),
        (REJECT_SERVICES, false),
        (REJECT_NODEPORTS, false),
        (SERVICE_NODEPORTS, true),
        (HAIRPIN_ENDPOINTS, false),
    ]
    .into_iter()
    .chain(service_endpoints_maps().map(|(m, _)| (m, true)))
    {
        tx.tx.push(Op::FlushSet {
            name: name.to_string(),
            map,
        });
    }
}

/// The base chains (re-created on the first sync), the regular chains they jump to, and the
/// other fixed chains.
fn base_chains(tx: &mut Tx, first_sync: bool) {
    if first_sync {
        for bc in &BASE_CHAINS {
            tx.add_chain(bc.name);
            tx.tx.push(Op::DeleteChain(bc.name.to_string()));
        }
    }
    for bc in &BASE_CHAINS {
        tx.tx.push(Op::AddChain(ChainDecl {
            name: bc.name.to_string(),
            base: Some(BaseHook {
                kind: bc.kind,
                hook: bc.hook,
                priority: bc.priority,
            }),
            comment: None,
        }));
        tx.flush_chain(bc.name);
    }
    for (dst, src, ct_new) in JUMP_CHAINS {
        tx.ensure_chain(dst);
        let matches = if ct_new { vec![Match::CtStateNew] } else { vec![] };
        tx.add_rule(src, Rule::verdict(matches, jump(dst)));
    }
    for chain in [SERVICES, CLUSTER_IPS_CHECK, MASQUERADING, MARK_FOR_MASQUERADE] {
        tx.ensure_chain(chain);
    }
}

/// `mark-for-masquerade` sets the mark; `masquerading` masquerades marked packets (and
/// clears the mark so that a packet re-traversing the stack is not masqueraded twice).
fn masquerading(tx: &mut Tx, mark: u32) {
    tx.add_rule(MARK_FOR_MASQUERADE, Rule::new(vec![], Statement::MarkSetOr(mark)));
    // Hairpin: a pod DNATed to itself must be masqueraded, or it would answer itself directly
    // (upstream: a rule in each endpoint chain; here one lookup of the endpoints chosen
    // through `service-endpoints`).
    tx.add_set(
        HAIRPIN_ENDPOINTS,
        KeyType::AddrPair,
        None,
        Some("endpoints reached from themselves through a service: masqueraded"),
    );
    tx.add_rule(
        MASQUERADING,
        Rule::verdict(
            vec![
                Match::CtStatusDnat,
                Match::InSet {
                    key: VmapKey::SaddrDaddr,
                    set: HAIRPIN_ENDPOINTS.to_string(),
                },
            ],
            jump(MARK_FOR_MASQUERADE),
        ),
    );
    tx.add_rule(
        MASQUERADING,
        Rule::verdict(vec![Match::MarkAndZero(mark)], Verdict::Return),
    );
    tx.add_rule(MASQUERADING, Rule::new(vec![], Statement::MarkSetXor(mark)));
    tx.add_rule(MASQUERADING, Rule::new(vec![], Statement::Masquerade));
}

/// `cluster-ips` and `cluster-ips-check`: unknown ports of ClusterIPs are rejected, and
/// addresses of the ServiceCIDRs that are no ClusterIP dropped.
fn cluster_ips_check(tx: &mut Tx, ctx: &Ctx) {
    tx.add_set(CLUSTER_IPS, KeyType::Addr, None, Some("Active ClusterIPs"));
    tx.add_rule(
        CLUSTER_IPS_CHECK,
        Rule::verdict(vec![addr_in_set(Dir::Daddr, CLUSTER_IPS)], Verdict::Reject)
            .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    );
    if !ctx.service_cidrs.is_empty() {
        tx.add_rule(
            CLUSTER_IPS_CHECK,
            Rule::verdict(
                vec![Match::Addr {
                    dir: Dir::Daddr,
                    negate: false,
                    spec: AddrSpec::AnonSet {
                        items: ctx.service_cidrs.clone(),
                        compact: true,
                    },
                }],
                Verdict::Drop,
            )
            .with_comment("Drop traffic to unallocated ClusterIPs"),
        );
    }
}

/// `nodeport-ips` exists only when nodePortAddresses is not match-all ("add + delete"
/// removes it without failing when it does not exist).
fn nodeport_ips(tx: &mut Tx, ctx: &Ctx) {
    tx.add_set(
        NODEPORT_IPS,
        KeyType::Addr,
        None,
        Some("IPs that accept NodePort traffic"),
    );
    if ctx.node_port_addresses.match_all() {
        tx.tx.push(Op::DeleteSet {
            name: NODEPORT_IPS.to_string(),
            map: false,
        });
        return;
    }
    tx.tx.push(Op::FlushSet {
        name: NODEPORT_IPS.to_string(),
        map: false,
    });
    for ip in ctx.node_port_addresses.node_ips(&ctx.local_addresses) {
        // Localhost NodePorts are not supported in nftables mode.
        if ip.is_loopback() {
            continue;
        }
        tx.tx.push(Op::AddElement {
            set: NODEPORT_IPS.to_string(),
            element: Element {
                key: ElemKey::Addr(ip),
                value: None,
                comment: None,
            },
        });
    }
}

/// The destination match of NodePort traffic: any local address but loopback (match-all),
/// or those of `nodeport-ips`.
fn nodeport_daddr(ctx: &Ctx) -> Match {
    if ctx.node_port_addresses.match_all() {
        ctx.no_localhost.clone()
    } else {
        addr_in_set(Dir::Daddr, NODEPORT_IPS)
    }
}

/// A rule looking a packet's destination up in the verdict map `map`.
fn vmap_rule(matches: Vec<Match>, key: VmapKey, map: &str) -> Rule {
    Rule::new(
        matches,
        Statement::Vmap {
            key,
            map: map.to_string(),
        },
    )
}

/// `no-endpoint-services` / `no-endpoint-nodeports` (drop), `reject-services` /
/// `reject-nodeports` (reject), and the endpoint checks that look them up. Upstream rejects
/// through `goto reject-chain` verdicts in the maps; a plain set element is the same change
/// without the validation of the whole table that adding a jump verdict makes the kernel do.
fn no_endpoint_checks(tx: &mut Tx, ctx: &Ctx) {
    tx.add_set(
        NO_ENDPOINT_SERVICES,
        KeyType::AddrProtoPort,
        Some(MapValue::Verdict),
        Some("vmap to drop packets to services with no endpoints for their traffic policy"),
    );
    tx.add_set(
        NO_ENDPOINT_NODEPORTS,
        KeyType::ProtoPort,
        Some(MapValue::Verdict),
        Some("vmap to drop packets to service nodeports with no endpoints for their traffic policy"),
    );
    tx.add_set(
        REJECT_SERVICES,
        KeyType::AddrProtoPort,
        None,
        Some("services with no endpoints: new connections are rejected"),
    );
    tx.add_set(
        REJECT_NODEPORTS,
        KeyType::ProtoPort,
        None,
        Some("service nodeports with no endpoints: new connections are rejected"),
    );
    let in_set = |key, set: &str| Match::InSet {
        key,
        set: set.to_string(),
    };
    tx.add_rule(
        SERVICE_ENDPOINTS_CHECK,
        Rule::verdict(vec![in_set(VmapKey::DaddrProtoPort, REJECT_SERVICES)], Verdict::Reject),
    );
    tx.add_rule(
        SERVICE_ENDPOINTS_CHECK,
        vmap_rule(vec![], VmapKey::DaddrProtoPort, NO_ENDPOINT_SERVICES),
    );
    tx.add_rule(
        NODEPORT_ENDPOINTS_CHECK,
        Rule::verdict(
            vec![nodeport_daddr(ctx), in_set(VmapKey::ProtoPort, REJECT_NODEPORTS)],
            Verdict::Reject,
        ),
    );
    tx.add_rule(
        NODEPORT_ENDPOINTS_CHECK,
        vmap_rule(vec![nodeport_daddr(ctx)], VmapKey::ProtoPort, NO_ENDPOINT_NODEPORTS),
    );
}

/// `firewall-ips` and `firewall-check`: loadBalancerSourceRanges.
fn firewall_check(tx: &mut Tx) {
    tx.add_set(
        FIREWALL_IPS,
        KeyType::AddrProtoPort,
        Some(MapValue::Verdict),
        Some("destinations that are subject to LoadBalancerSourceRanges"),
    );
    tx.ensure_chain(FIREWALL_CHECK);
    tx.add_rule(FIREWALL_CHECK, vmap_rule(vec![], VmapKey::DaddrProtoPort, FIREWALL_IPS));
}

/// `service-ips` and `service-nodeports`, and the `services` rules that dispatch to them.
fn service_maps(tx: &mut Tx, ctx: &Ctx) {
    tx.add_set(
        SERVICE_IPS,
        KeyType::AddrProtoPort,
        Some(MapValue::Verdict),
        Some("ClusterIP, ExternalIP and LoadBalancer IP traffic"),
    );
    tx.add_set(
        SERVICE_NODEPORTS,
        KeyType::ProtoPort,
        Some(MapValue::Verdict),
        Some("NodePort traffic"),
    );
    for (map, protocol) in service_endpoints_maps() {
        tx.add_set(
            map,
            KeyType::Numgen(BLOCK),
            Some(MapValue::AddrPort(protocol)),
            Some("each service port's random numbers, split among its endpoints"),
        );
    }
    tx.add_rule(SERVICES, vmap_rule(vec![], VmapKey::DaddrProtoPort, SERVICE_IPS));
    let nodeport_matches = if ctx.node_port_addresses.match_all() {
        vec![Match::FibLocal(Dir::Daddr), nodeport_daddr(ctx)]
    } else {
        vec![nodeport_daddr(ctx)]
    };
    tx.add_rule(
        SERVICES,
        vmap_rule(nodeport_matches, VmapKey::ProtoPort, SERVICE_NODEPORTS),
    );
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
fn render_service(tx: &mut Tx, ctx: &Ctx, sps: &ServicePortState, blocks: Option<PortBlocks>) {
    let r = ServiceRules::new(ctx, sps, blocks);
    r.declare_chains(tx);
    // The dispatch to the service's chains (or its drop/reject), per kind of address.
    r.cluster_ip(tx);
    r.external_ips(tx);
    r.load_balancer_ips(tx);
    r.node_port(tx);
    // The service's own chains and sets.
    r.internal_masquerade(tx);
    r.external_chain(tx);
    r.firewall_chain(tx);
    r.affinity_sets(tx);
    r.service_chains(tx);
    r.endpoint_chains(tx);
    r.endpoint_elements(tx);
}

/// One service port being rendered: its names, its endpoints, and which of its chains its
/// traffic goes through.
struct ServiceRules<'a> {
    ctx: &'a Ctx,
    sps: &'a ServicePortState,
    svc: &'a ServicePort,
    /// `ns/svc:port`, the comment of its no-endpoint elements.
    name: String,
    chains: ServicePortChains,
    sets: EndpointSets,
    /// Internal (ClusterIP) traffic has endpoints under its traffic policy.
    has_internal: bool,
    /// External traffic has endpoints under its traffic policy.
    has_external: bool,
    /// Without any endpoint, traffic without endpoints is rejected, else dropped.
    reject: bool,
    /// Endpoints chosen through `service-endpoints` from these blocks; `None`: upstream's
    /// chain per endpoint.
    blocks: Option<PortBlocks>,
}

impl<'a> ServiceRules<'a> {
    fn new(ctx: &'a Ctx, sps: &'a ServicePortState, blocks: Option<PortBlocks>) -> ServiceRules<'a> {
        let svc = &sps.port;
        let chains = ServicePortChains::new(
            &svc.name.namespace,
            &svc.name.name,
            svc.protocol.lower(),
            &svc.name.port,
        );
        let sets = ctx.topology.endpoint_sets(sps);
        ServiceRules {
            ctx,
            sps,
            svc,
            name: comment(&svc.name.to_string()),
            chains,
            has_internal: sets.has_for_policy(svc.internal_policy_local),
            has_external: sets.has_for_policy(svc.external_policy_local),
            reject: !sets.has_any,
            sets,
            blocks,
        }
    }

    fn has_endpoints(&self) -> bool {
        self.sets.has_any
    }

    /// Whether endpoints are chosen through `service-endpoints`. Then the service's chains and
    /// dispatch elements exist whether it has endpoints or not (a selection without any finds
    /// no number in the map, and the traffic is dropped or rejected by the endpoint checks),
    /// so that endpoints coming and going change map elements only.
    fn by_map(&self) -> bool {
        self.blocks.is_some()
    }

    /// Traffic is sent to the service's chains (rather than only dropped or rejected).
    fn dispatched(&self) -> bool {
        self.by_map() || self.has_endpoints()
    }

    fn uses_cluster_chain(&self) -> bool {
        (self.by_map() || !self.sets.cluster.is_empty()) && self.svc.uses_cluster_endpoints()
    }

    fn uses_local_chain(&self) -> bool {
        (self.by_map() || !self.sets.local.is_empty()) && self.svc.uses_local_endpoints()
    }

    /// Based on has_endpoints, not has_external: the short-circuit rules for local traffic
    /// are needed even when there are no externally usable endpoints.
    fn uses_external_chain(&self) -> bool {
        self.dispatched() && self.svc.externally_accessible()
    }

    /// Unlike the iptables mode, the firewall chain does not depend on having endpoints.
    fn uses_fw_chain(&self) -> bool {
        !self.svc.load_balancer_vips.is_empty() && !self.svc.load_balancer_source_ranges.is_empty()
    }

    /// `local-…` for a Local policy, `service-…` for Cluster.
    fn policy_chain(&self, policy_local: bool) -> &str {
        if policy_local {
            &self.chains.local
        } else {
            &self.chains.cluster
        }
    }

    /// The `service-ips` / `firewall-ips` / `no-endpoint-services` key of `ip`.
    fn key(&self, ip: IpAddr) -> ElemKey {
        ElemKey::AddrProtoPort(ip, self.svc.protocol, self.svc.port)
    }

    /// Drop or reject traffic to `key` (a NodePort's when `node_port`).
    fn no_endpoint(&self, tx: &mut Tx, node_port: bool, key: ElemKey) {
        let comment = Some(self.name.as_str());
        match (self.reject, node_port) {
            (true, false) => tx.ensure_element(REJECT_SERVICES, key, None, comment),
            (true, true) => tx.ensure_element(REJECT_NODEPORTS, key, None, comment),
            (false, false) => tx.ensure_element(NO_ENDPOINT_SERVICES, key, Some(Verdict::Drop.into()), comment),
            (false, true) => tx.ensure_element(NO_ENDPOINT_NODEPORTS, key, Some(Verdict::Drop.into()), comment),
        }
    }

    /// The endpoint chains, then the service's chains that have rules (the firewall chain
    /// comes later, among the load-balancer elements).
    fn declare_chains(&self, tx: &mut Tx) {
        if !self.by_map() {
            for ep in &self.sets.all_reachable {
                tx.ensure_chain(&endpoint_names(self.sps, ep).chain);
            }
        }
        if self.uses_cluster_chain() {
            tx.ensure_chain(&self.chains.cluster);
        }
        if self.uses_local_chain() {
            tx.ensure_chain(&self.chains.local);
        }
        if self.uses_external_chain() {
            tx.ensure_chain(&self.chains.external);
        }
    }

    fn cluster_ip(&self, tx: &mut Tx) {
        let cluster_ip = self.svc.cluster_ip;
        tx.ensure_element(CLUSTER_IPS, ElemKey::Addr(cluster_ip), None, None);
        if self.has_internal || self.by_map() {
            let internal_chain = self.policy_chain(self.svc.internal_policy_local);
            tx.ensure_element(
                SERVICE_IPS,
                self.key(cluster_ip),
                Some(goto(internal_chain).into()),
                None,
            );
        }
        if !self.has_internal {
            self.no_endpoint(tx, false, self.key(cluster_ip));
        }
    }

    fn external_ips(&self, tx: &mut Tx) {
        for &ext in &self.svc.external_ips {
            if self.dispatched() {
                tx.ensure_element(
                    SERVICE_IPS,
                    self.key(ext),
                    Some(goto(&self.chains.external).into()),
                    None,
                );
            }
            if !self.has_external {
                // No endpoints at all (reject), or none for external traffic (drop what the
                // external chain did not short-circuit).
                self.no_endpoint(tx, false, self.key(ext));
            }
        }
    }

    fn load_balancer_ips(&self, tx: &mut Tx) {
        let uses_fw_chain = self.uses_fw_chain();
        if uses_fw_chain {
            tx.ensure_chain(&self.chains.firewall);
        }
        for &lb in &self.svc.load_balancer_vips {
            if self.dispatched() {
                tx.ensure_element(
                    SERVICE_IPS,
                    self.key(lb),
                    Some(goto(&self.chains.external).into()),
                    None,
                );
            }
            if uses_fw_chain {
                tx.ensure_element(
                    FIREWALL_IPS,
                    self.key(lb),
                    Some(goto(&self.chains.firewall).into()),
                    None,
                );
            }
        }
        if !self.has_external {
            for &lb in &self.svc.load_balancer_vips {
                self.no_endpoint(tx, false, self.key(lb));
            }
        }
    }

    fn node_port(&self, tx: &mut Tx) {
        let node_port = self.svc.node_port;
        if node_port == 0 {
            return;
        }
        let np_key = ElemKey::ProtoPort(self.svc.protocol, node_port);
        if self.dispatched() {
            // NodePorts are not subject to loadBalancerSourceRanges (upstream behaviour).
            tx.ensure_element(
                SERVICE_NODEPORTS,
                np_key.clone(),
                Some(goto(&self.chains.external).into()),
                None,
            );
        }
        if !self.has_external {
            self.no_endpoint(tx, true, np_key);
        }
    }

    /// Internal traffic: masquerade off-cluster sources (they may bounce off-node).
    fn internal_masquerade(&self, tx: &mut Tx) {
        if !self.has_internal && !self.by_map() {
            return;
        }
        let internal_chain = self.policy_chain(self.svc.internal_policy_local);
        // The newest upstream matches only the ClusterIP here (the chain is reached through
        // service-ips, which already matched protocol and port).
        let dst = daddr(IpNet::from(self.svc.cluster_ip));
        if self.ctx.masquerade_all {
            tx.add_rule(internal_chain, Rule::verdict(vec![dst], jump(MARK_FOR_MASQUERADE)));
        } else if let Some((_, if_not_local)) = &self.ctx.detector {
            tx.add_rule(
                internal_chain,
                Rule::verdict(vec![dst, if_not_local.clone()], jump(MARK_FOR_MASQUERADE)),
            );
        }
    }

    /// `external-…`: what NodePort, externalIP and load-balancer traffic goes through.
    fn external_chain(&self, tx: &mut Tx) {
        if !self.uses_external_chain() {
            return;
        }
        let (external_chain, cluster_chain) = (&self.chains.external, &self.chains.cluster);
        if !self.svc.external_policy_local {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            tx.add_rule(external_chain, Rule::verdict(vec![], jump(MARK_FOR_MASQUERADE)));
        } else {
            // Pod traffic to an external address behaves as if it went out to the load
            // balancer and came back: subject to no traffic policy.
            if let Some((if_local, _)) = &self.ctx.detector {
                tx.add_rule(
                    external_chain,
                    Rule::verdict(vec![if_local.clone()], goto(cluster_chain))
                        .with_comment("short-circuit pod traffic"),
                );
            }
            // Host-originated traffic has a local source (maybe the LB IP itself).
            tx.add_rule(
                external_chain,
                Rule::verdict(vec![Match::FibLocal(Dir::Saddr)], jump(MARK_FOR_MASQUERADE))
                    .with_comment("masquerade local traffic"),
            );
            tx.add_rule(
                external_chain,
                Rule::verdict(vec![Match::FibLocal(Dir::Saddr)], goto(cluster_chain))
                    .with_comment("short-circuit local traffic"),
            );
        }
        if self.has_external || self.by_map() {
            let external_policy_chain = self.policy_chain(self.svc.external_policy_local);
            tx.add_rule(external_chain, Rule::verdict(vec![], goto(external_policy_chain)));
        }
    }

    /// `firewall-…`: drops what loadBalancerSourceRanges do not allow.
    fn firewall_chain(&self, tx: &mut Tx) {
        if !self.uses_fw_chain() {
            return;
        }
        let svc = self.svc;
        let mut sources: Vec<IpNet> = svc.load_balancer_source_ranges.clone();
        let allow_from_node = self
            .ctx
            .node_ip
            .is_some_and(|ip| sources.iter().any(|cidr| cidr.contains(&ip)));
        // A VIP bound locally makes node→VIP traffic loop back with the VIP as source.
        if allow_from_node {
            sources.extend(svc.load_balancer_vips.iter().map(|ip| IpNet::from(*ip)));
        }
        tx.add_rule(
            &self.chains.firewall,
            Rule::verdict(
                vec![Match::Addr {
                    dir: Dir::Saddr,
                    negate: true,
                    spec: AddrSpec::AnonSet {
                        items: sources,
                        compact: false,
                    },
                }],
                Verdict::Drop,
            ),
        );
    }

    /// ClientIP affinity: one `affinity-…` set per endpoint.
    fn affinity_sets(&self, tx: &mut Tx) {
        let Some(timeout) = self.svc.session_affinity_timeout else {
            return;
        };
        for ep in &self.sets.all_reachable {
            tx.tx.push(Op::AddSet(SetDecl {
                name: endpoint_names(self.sps, ep).affinity_set,
                key: KeyType::Addr,
                map: None,
                timeout_seconds: Some(timeout),
                comment: None,
            }));
        }
    }

    /// `service-…` and `local-…`: the choice of an endpoint, for Cluster and Local traffic.
    fn service_chains(&self, tx: &mut Tx) {
        if let Some(blocks) = self.blocks {
            for (pool, chain, used) in [
                (Pool::Cluster, &self.chains.cluster, self.uses_cluster_chain()),
                (Pool::Local, &self.chains.local, self.uses_local_chain()),
            ] {
                if let (true, Some(id)) = (used, blocks.get(pool)) {
                    tx.add_rule(
                        chain,
                        Rule::new(
                            vec![Match::L4proto(self.svc.protocol)],
                            Statement::DnatNumgenMap {
                                modulus: BLOCK,
                                offset: blocks::start(id),
                                map: service_endpoints(self.svc.protocol, id).to_string(),
                            },
                        ),
                    );
                }
            }
            return;
        }
        if self.uses_cluster_chain() {
            write_service_to_endpoint_rules(tx, self.sps, &self.chains.cluster, &self.sets.cluster);
        }
        if self.uses_local_chain() {
            write_service_to_endpoint_rules(tx, self.sps, &self.chains.local, &self.sets.local);
        }
    }

    /// `endpoint-…`: one chain per endpoint, DNAT to it.
    fn endpoint_chains(&self, tx: &mut Tx) {
        if self.by_map() {
            return;
        }
        for ep in &self.sets.all_reachable {
            let names = endpoint_names(self.sps, ep);
            // Hairpin: a pod reaching itself through the Service must be masqueraded.
            tx.add_rule(
                &names.chain,
                Rule::verdict(
                    vec![Match::Addr {
                        dir: Dir::Saddr,
                        negate: false,
                        spec: AddrSpec::Net(IpNet::from(ep.ip)),
                    }],
                    jump(MARK_FOR_MASQUERADE),
                ),
            );
            if self.svc.session_affinity_timeout.is_some() {
                tx.add_rule(
                    &names.chain,
                    Rule::new(vec![], Statement::UpdateSaddr(names.affinity_set.clone())),
                );
            }
            tx.add_rule(
                &names.chain,
                Rule::new(
                    vec![Match::L4proto(self.svc.protocol)],
                    Statement::Dnat(SocketAddr::new(ep.ip, ep.port)),
                ),
            );
        }
    }
}

impl ServiceRules<'_> {
    /// The endpoints of a selection by map: each one's share of the selection's block in
    /// `service-endpoints`, and its hairpin element.
    fn endpoint_elements(&self, tx: &mut Tx) {
        let Some(blocks) = self.blocks else {
            return;
        };
        for (pool, endpoints, used) in [
            (Pool::Cluster, &self.sets.cluster, self.uses_cluster_chain()),
            (Pool::Local, &self.sets.local, self.uses_local_chain()),
        ] {
            let (true, Some(id)) = (used, blocks.get(pool)) else {
                continue;
            };
            let targets: Vec<SocketAddr> = endpoints.iter().map(|ep| SocketAddr::new(ep.ip, ep.port)).collect();
            for (lo, hi, to) in blocks::shares(id, &targets) {
                tx.ensure_element(
                    service_endpoints(self.svc.protocol, id),
                    ElemKey::Range(lo, hi),
                    Some(ElemValue::AddrPort(to)),
                    None,
                );
            }
        }
        for ep in &self.sets.all_reachable {
            tx.ensure_element(HAIRPIN_ENDPOINTS, ElemKey::AddrPair(ep.ip, ep.ip), None, None);
        }
    }
}

/// Affinity checks, then one `numgen` lookup choosing each endpoint with probability 1/n.
fn write_service_to_endpoint_rules(tx: &mut Tx, sps: &ServicePortState, chain: &str, endpoints: &[Endpoint]) {
    if sps.port.session_affinity_timeout.is_some() {
        for ep in endpoints {
            let names = endpoint_names(sps, ep);
            tx.add_rule(
                chain,
                Rule::verdict(vec![addr_in_set(Dir::Saddr, &names.affinity_set)], goto(&names.chain)),
            );
        }
    }
    let mut targets: Vec<String> = endpoints.iter().map(|ep| endpoint_names(sps, ep).chain).collect();
    // One endpoint: a plain goto where upstream writes `numgen random mod 1 vmap { 0 : goto … }`.
    // Same verdict, but no anonymous set: the kernel creates each set in time linear in the
    // number of sets of the table, which made a cold start of 44,000 one-endpoint Services
    // take about 3 minutes (see docs/nftables.md).
    if targets.len() == 1
        && let Some(only) = targets.pop()
    {
        tx.add_rule(chain, Rule::verdict(vec![], goto(&only)));
    } else {
        tx.add_rule(chain, Rule::new(vec![], Statement::NumgenVmap(targets)));
    }
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
            service_ports: crate::model::shared(service_ports),
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
            // Upstream: `numgen random mod 1 vmap { 0 : goto endpoint-… }` and an endpoint chain
            // (hairpin masquerade, dnat). Here: the service port's block of numbers in
            // `service-endpoints`, all of it the endpoint's, and its hairpin element.
            "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 meta l4proto tcp dnat to numgen random mod 55440 offset 2959220880 map @service-endpoints-tcp-01",
            "add element ip kube-proxy service-endpoints-tcp-01 { 2959220880-2959276319 : 10.180.0.1 . 80 }",
            "add element ip kube-proxy hairpin-endpoints { 10.180.0.1 . 10.180.0.1 }",
            "add rule ip kube-proxy masquerading ct status dnat ip saddr . ip daddr @hairpin-endpoints jump mark-for-masquerade",
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
            // Upstream: `goto reject-chain` verdicts in the no-endpoint maps; here a set.
            "add rule ip kube-proxy service-endpoints-check ip daddr . meta l4proto . th dport @reject-services reject",
        ] {
            assert!(l.contains(&want), "missing {want:?} in\n{out}");
        }
        assert!(
            !out.contains("endpoint-5OJB2KTY") && !out.contains("reject-chain"),
            "{out}"
        );
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
            // Upstream: `: goto reject-chain` in no-endpoint-services, and no chain of svc6. Here
            // svc6 keeps its dispatch and service chain (so that endpoints coming back are map
            // elements only); `reject-services` rejects it before anything else.
            "add element ip kube-proxy reject-services { 172.30.0.46 . tcp . 80 comment \"ns6/svc6:p80\" }",
            "add element ip kube-proxy service-ips { 172.30.0.46 . tcp . 80 : goto service-Y3O5BOQO-ns6/svc6/tcp/p80 }",
            // svc2 has no local endpoint: its local chain finds no number in the map (no
            // element of its block), the packet goes on unNATed and no-endpoint-services drops it.
            "add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 goto local-42NFTM6N-ns2/svc2/tcp/p80",
        ] {
            assert!(l.contains(&want), "missing {want:?} in\n{out}");
        }
        assert!(!out.contains("reject-chain"), "{out}");
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
        let text = |m: Option<(Match, Match)>| {
            m.map(|(a, b)| {
                let t = |m: Match| Rule::verdict(vec![m], Verdict::Accept).text(IpFamily::V4);
                (t(a), t(b))
            })
        };
        assert_eq!(
            text(detector_matches(
                &LocalDetector::InterfacePrefix("veth".into()),
                IpFamily::V4
            )),
            Some(("iifname veth* accept".into(), "iifname != veth* accept".into()))
        );
        assert_eq!(
            text(detector_matches(&LocalDetector::Bridge("cni0".into()), IpFamily::V6)),
            Some(("iifname cni0 accept".into(), "iifname != cni0 accept".into()))
        );
        // A CIDR of the other family is no detector for this one.
        assert_eq!(
            detector_matches(&LocalDetector::Cidr("10.0.0.0/8".into()), IpFamily::V6),
            None
        );
    }
}
