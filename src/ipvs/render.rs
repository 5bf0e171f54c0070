//! The IPVS-mode renderer: one family's [`ProxyState`] → everything upstream's IPVS proxier
//! programs on a full sync, as plain data. Pure: no I/O, no root.
//!
//! - the virtual servers (ClusterIP, each externalIP, each load-balancer IP, and each NodePort
//!   on every selected node address) with their scheduler, persistence and Masq real servers;
//!   the node addresses are the ones the caller lists in [`IpvsRenderOptions::node_addresses`]
//!   (the daemon: the node's interface addresses outside `kube-ipvs0`, as upstream), or the
//!   Node object's when it has none to give (`kube-proxy render`);
//! - the addresses bound to the `kube-ipvs0` dummy device;
//! - the ipsets, with upstream's names, types and entries (and the `ipset restore` input that
//!   creates them as upstream's ipset utility does);
//! - the iptables rules that remain in IPVS mode, as the `iptables-restore` input upstream
//!   writes (nat first, then filter), plus the jump rules it ensures in the built-in chains
//!   (both written by [`super::iptables`] from the sets built here);
//! - the sysctls and IPVS timeouts set at start.
//!
//! [`IpvsRuleset::to_text`] prints it all for `kube-proxy render --proxy-mode=ipvs`: the
//! virtual servers as `ipvsadm -Ln` lists them, then the ipsets, then the iptables rules.
//!
//! Upstream builds sets and virtual servers while walking its service map in Go map order; we
//! walk service ports sorted by name and protocol, keep set entries sorted (the order in which
//! upstream adds them) and list virtual servers in `ipvsadm`'s order, so the output is
//! deterministic. Behaviour that differs from iptables mode, as upstream: a service without
//! endpoints keeps its virtual servers with no real servers (no REJECT rule: IPVS itself
//! answers), and externalTrafficPolicy/internalTrafficPolicy Local fall back to the cluster
//! endpoints when the node has no local ones (no DROP).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::iptables::{jump_rules, restore_input};
use super::names::*;
use crate::config::ProxyConfig;
// The iptables jump rules IPVS mode ensures are iptables mode's kind of rule.
use crate::iptables::JumpRule;
use crate::model::{
    Endpoint, IpFamily, NodeInfo, NodeTopology, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
};
use crate::proxy::{NodePortAddresses, RenderOptions};

/// IPVS service flag: persistence (session affinity).
pub const FLAG_PERSISTENT: u32 = 0x1;
/// IPVS service flag: first scheduler flag (`sh-fallback` / `mh-fallback`).
pub const FLAG_SCHED1: u32 = 0x8;
/// IPVS service flag: second scheduler flag (`sh-port` / `mh-port`).
pub const FLAG_SCHED2: u32 = 0x10;
/// IPVS service flag: third scheduler flag (no name in `ipvsadm`).
pub const FLAG_SCHED3: u32 = 0x20;

/// The kernel's IPVS version and connection-table size as `ipvsadm -Ln` reports them with the
/// usual `CONFIG_IP_VS_TAB_BITS=12` (Debian's kernel, checked in the test VM).
const IPVS_VERSION_LINE: &str = "IP Virtual Server version 1.2.1 (size=4096)";

/// Everything besides the model that changes what IPVS mode programs for one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsRenderOptions {
    /// `--ipvs-scheduler`, with upstream's default `rr` filled in.
    pub scheduler: String,
    /// `--ipvs-exclude-cidrs` of this family: virtual servers there are never deleted.
    pub exclude_cidrs: Vec<IpNet>,
    /// `--ipvs-strict-arp`: the ARP sysctls that keep kube-ipvs0 addresses from being announced.
    pub strict_arp: bool,
    /// `--ipvs-tcp-timeout`, `--ipvs-tcpfin-timeout`, `--ipvs-udp-timeout` (0: left as is).
    pub tcp_timeout: Duration,
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
    /// The options every mode shares. `nodePortAddresses` empty (upstream's default in IPVS
    /// mode, unlike nftables mode's `primary`) means every address of the node.
    pub common: RenderOptions,
    /// The node's interface addresses outside `kube-ipvs0` (any family: each render keeps its
    /// own), as the proxier lists them before every sync, as upstream re-reads them on every
    /// sync. They carry the NodePort virtual servers and decide which externalIPs and
    /// load-balancer IPs are already the node's. `None` (`kube-proxy render`, which has no
    /// host to ask): the Node object's addresses (or `--node-ip`) stand in for them.
    pub node_addresses: Option<Vec<IpAddr>>,
    /// iptables supports `MASQUERADE --random-fully` (every iptables since 1.6.2).
    pub random_fully: bool,
}

impl Default for IpvsRenderOptions {
    /// Upstream's defaults: rr, mark bit 14, no local-traffic detector, every node address.
    fn default() -> Self {
        IpvsRenderOptions {
            scheduler: DEFAULT_SCHEDULER.to_string(),
            exclude_cidrs: Vec::new(),
            strict_arp: false,
            tcp_timeout: Duration::ZERO,
            tcp_fin_timeout: Duration::ZERO,
            udp_timeout: Duration::ZERO,
            common: RenderOptions::default(),
            node_addresses: None,
            random_fully: true,
        }
    }
}

impl IpvsRenderOptions {
    /// The options of one family's IPVS proxier for a configuration.
    pub fn from_config(cfg: &ProxyConfig, family: IpFamily, node: &NodeInfo) -> IpvsRenderOptions {
        let scheduler = cfg.ipvs.scheduler.trim();
        IpvsRenderOptions {
            scheduler: if scheduler.is_empty() {
                DEFAULT_SCHEDULER.to_string()
            } else {
                scheduler.to_string()
            },
            // Each family's proxier gets the CIDRs of its family only (upstream's filterCIDRs).
            exclude_cidrs: cfg
                .ipvs
                .exclude_cidrs
                .iter()
                .filter(|c| family.contains(&c.addr()))
                .map(IpNet::trunc)
                .collect(),
            strict_arp: cfg.ipvs.strict_arp,
            tcp_timeout: cfg.ipvs.tcp_timeout,
            tcp_fin_timeout: cfg.ipvs.tcp_fin_timeout,
            udp_timeout: cfg.ipvs.udp_timeout,
            common: RenderOptions::from_config(cfg, family, node),
            // Listed by the proxier on every sync (the configuration has no host to ask).
            node_addresses: None,
            random_fully: true,
        }
    }
}

/// Which address of a service port a virtual server is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum VirtualServerKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

/// One real server: always NAT ("Masq") forwarding.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IpvsDestination {
    pub address: IpAddr,
    pub port: u16,
    /// 1 for every endpoint (upstream); the proxier lowers it to 0 while draining a removed one.
    pub weight: u32,
}

/// One virtual server and its real servers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsService {
    pub address: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
    pub scheduler: String,
    /// `Some(timeout in seconds)` for sessionAffinity ClientIP.
    pub persistent: Option<u32>,
    /// Persistence granularity: upstream always sets a host mask (0xffffffff for IPv4, 128 for
    /// IPv6), so affinity is per client address.
    pub netmask: u32,
    /// Scheduler flags ([`FLAG_SCHED1`]…[`FLAG_SCHED3`]); upstream sets [`FLAG_SCHED2`]
    /// (`mh-port`) for the mh scheduler and nothing else.
    pub sched_flags: u32,
    /// Sorted by address and port.
    pub destinations: Vec<IpvsDestination>,
    /// The service port it was built for (the first one, should several claim the same key).
    pub service: ServicePortName,
    pub kind: VirtualServerKind,
}

impl IpvsService {
    /// The service flags to program (without the kernel's own `hashed` flag).
    pub fn flags(&self) -> u32 {
        let persistent = if self.persistent.is_some() { FLAG_PERSISTENT } else { 0 };
        persistent | self.sched_flags
    }

    /// What identifies a virtual server in the kernel.
    pub fn key(&self) -> (Protocol, IpAddr, u16) {
        (self.protocol, self.address, self.port)
    }

    /// The virtual server's line in `ipvsadm -Ln`.
    pub fn ipvsadm_line(&self) -> String {
        let mut s = format!("{:<4} {}", self.protocol.api(), addr_port(self.address, self.port));
        s.push(' ');
        s.push_str(&self.scheduler);
        let flags = sched_flag_names(&self.scheduler, self.sched_flags);
        if !flags.is_empty() {
            s.push_str(&format!(" ({})", flags.join(",")));
        }
        if let Some(timeout) = self.persistent {
            s.push_str(&format!(" persistent {timeout}"));
            let host_mask = full_netmask(self.address);
            if self.netmask != host_mask {
                match self.address {
                    IpAddr::V4(_) => s.push_str(&format!(" mask {}", std::net::Ipv4Addr::from(self.netmask))),
                    IpAddr::V6(_) => s.push_str(&format!(" mask {}", self.netmask)),
                }
            }
        }
        s
    }
}

/// `ipvsadm`'s names of the scheduler flags that are set.
fn sched_flag_names(scheduler: &str, flags: u32) -> Vec<&'static str> {
    let (one, two) = match scheduler {
        "sh" => ("sh-fallback", "sh-port"),
        "mh" => ("mh-fallback", "mh-port"),
        _ => ("flag-1", "flag-2"),
    };
    let mut out = Vec::new();
    for (bit, name) in [(FLAG_SCHED1, one), (FLAG_SCHED2, two), (FLAG_SCHED3, "flag-3")] {
        if flags & bit != 0 {
            out.push(name);
        }
    }
    out
}

fn full_netmask(ip: IpAddr) -> u32 {
    match ip {
        IpAddr::V4(_) => u32::MAX,
        IpAddr::V6(_) => 128,
    }
}

/// `ip:port`, or `[ip]:port` for IPv6.
fn addr_port(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{ip}:{port}"),
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
    }
}

/// One ipset with its entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipset {
    pub id: SetId,
    /// The name in this family (`KUBE-6-…` for IPv6).
    pub name: String,
    pub set_type: IpsetType,
    pub family: IpFamily,
    pub comment: &'static str,
    /// Entries in ipset's syntax (`10.96.0.1,tcp:443`, `8080`…), sorted as strings, which is
    /// the order upstream adds them in.
    pub entries: Vec<String>,
}

impl Ipset {
    /// The `create` line upstream's ipset utility runs (without its `-exist`): hash sets get
    /// the family and upstream's hashsize/maxelem, bitmap:port sets the whole port range. The
    /// sets carry no `comment` extension: upstream's comments live in the iptables rules.
    pub fn create_line(&self) -> String {
        if self.set_type.is_hash() {
            let family = match self.family {
                IpFamily::V4 => "inet",
                IpFamily::V6 => "inet6",
            };
            format!(
                "create {} {} family {family} hashsize 1024 maxelem 65536",
                self.name,
                self.set_type.as_str()
            )
        } else {
            format!("create {} {} range 0-65535", self.name, self.set_type.as_str())
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Where a render took the node's addresses from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeAddressSource {
    /// The node's interfaces, outside `kube-ipvs0` ([`IpvsRenderOptions::node_addresses`]).
    Interfaces,
    /// The Node object's addresses, or `--node-ip`: a stand-in without a host to ask.
    NodeObject,
}

/// The IPVS timeouts of `ipvsadm --set` (0: leave the kernel's value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IpvsTimeouts {
    pub tcp: Duration,
    pub tcp_fin: Duration,
    pub udp: Duration,
}

/// Everything a full sync programs for one IP family in IPVS mode.
#[derive(Clone, Debug)]
pub struct IpvsRuleset {
    pub family: IpFamily,
    /// Sorted by protocol (TCP, UDP, SCTP), address and port, as `ipvsadm -Ln` sorts them.
    /// (ipvsadm compares IPv4 addresses by a 32-bit subtraction that overflows, so on a node it
    /// may list, say, 192.168.0.1 before 10.0.0.1; the lines themselves are identical.)
    pub virtual_servers: Vec<IpvsService>,
    /// Addresses bound to kube-ipvs0 (each as a /32 or /128), sorted: every ClusterIP, and the
    /// externalIPs and load-balancer IPs that are not already addresses of the node.
    pub bound_addresses: Vec<IpAddr>,
    /// The addresses NodePort virtual servers go on (whether or not a Service has a NodePort),
    /// sorted.
    pub node_port_addresses: Vec<IpAddr>,
    /// Where the node's addresses came from: its interfaces (the daemon), or the Node object
    /// (`kube-proxy render`).
    pub node_addresses_from: NodeAddressSource,
    /// Every set, in upstream's order (all of them exist even when empty).
    pub ipsets: Vec<Ipset>,
    /// Jump rules in the order they end up in each built-in chain (first = evaluated first).
    pub jumps: Vec<JumpRule>,
    /// The exact `iptables-restore --noflush --counters` input: `*nat … COMMIT`, `*filter … COMMIT`.
    pub restore: String,
    /// Sysctls (path under /proc/sys, value) set at start.
    pub sysctls: Vec<(&'static str, u32)>,
    /// `Some` when any IPVS timeout is configured.
    pub timeouts: Option<IpvsTimeouts>,
    /// Virtual servers there are left alone by cleanup.
    pub exclude_cidrs: Vec<IpNet>,
    /// Conflicts found while rendering (several service ports claiming one virtual server).
    pub warnings: Vec<String>,
}

impl IpvsRuleset {
    pub fn ipset(&self, id: SetId) -> Option<&Ipset> {
        self.ipsets.iter().find(|s| s.id == id)
    }

    /// The virtual server `(protocol, address, port)`, if any.
    pub fn virtual_server(&self, protocol: Protocol, address: IpAddr, port: u16) -> Option<&IpvsService> {
        self.virtual_servers
            .iter()
            .find(|v| v.key() == (protocol, address, port))
    }

    /// The table as `ipvsadm -Ln` prints it (connection counters at 0), real servers included.
    /// `ipvsadm` pads the real-server columns, so those lines end in spaces, as its own do.
    pub fn ipvsadm_list(&self) -> String {
        let mut s = String::new();
        s.push_str(IPVS_VERSION_LINE);
        s.push('\n');
        s.push_str("Prot LocalAddress:Port Scheduler Flags\n");
        s.push_str("  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n");
        for vs in &self.virtual_servers {
            s.push_str(&vs.ipvsadm_line());
            s.push('\n');
            for d in &vs.destinations {
                let _ = writeln!(
                    s,
                    "  -> {:<28} {:<7} {:<6} {:<10} {:<10}",
                    addr_port(d.address, d.port),
                    "Masq",
                    d.weight,
                    0,
                    0
                );
            }
        }
        s
    }

    /// `ipset restore` input creating every set and adding its entries, in the layout of
    /// `ipset save`. Apply it with `ipset restore -exist` so that existing sets are kept.
    pub fn ipset_restore(&self) -> String {
        let mut s = String::new();
        for set in &self.ipsets {
            s.push_str(&set.create_line());
            s.push('\n');
            for e in &set.entries {
                let _ = writeln!(s, "add {} {e}", set.name);
            }
        }
        s
    }

    /// The iptables-restore input preceded by `#` lines naming the jump rules ensured
    /// separately; still valid `iptables-restore` input.
    pub fn annotated_restore(&self) -> String {
        let tool = match self.family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        let mut s = format!("# {tool}-restore --noflush --counters input ({})\n", self.family);
        let _ = writeln!(s, "# jump rules ensured with `{tool} -I` when missing:");
        for j in &self.jumps {
            let _ = writeln!(s, "#   {}", j.to_command());
        }
        s.push_str(&self.restore);
        s
    }

    /// Everything, for `kube-proxy render --proxy-mode=ipvs`.
    pub fn to_text(&self) -> String {
        let mut s = format!("# IPVS proxy mode ({})\n", self.family);
        let sysctls: Vec<String> = self.sysctls.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(s, "# sysctls set at start: {}", sysctls.join(" "));
        // Upstream sets it only on kernels whose IPVS mishandles connection reuse (#93297).
        let _ = writeln!(s, "#   and net/ipv4/vs/conn_reuse_mode=0 on kernels 4.1 to 5.8");
        if let Some(t) = self.timeouts {
            let _ = writeln!(
                s,
                "# IPVS timeouts: ipvsadm --set {} {} {}",
                t.tcp.as_secs(),
                t.tcp_fin.as_secs(),
                t.udp.as_secs()
            );
        }
        if !self.exclude_cidrs.is_empty() {
            let cidrs: Vec<String> = self.exclude_cidrs.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                s,
                "# virtual servers never deleted (--ipvs-exclude-cidrs): {}",
                cidrs.join(" ")
            );
        }
        let _ = writeln!(s, "# addresses bound to {DUMMY_DEVICE}:");
        for a in &self.bound_addresses {
            let _ = writeln!(s, "#   {a}");
        }
        match self.node_addresses_from {
            NodeAddressSource::Interfaces => {
                let _ = writeln!(s, "# NodePort addresses (the node's interfaces):");
            }
            NodeAddressSource::NodeObject => {
                let _ = writeln!(
                    s,
                    "# NodePort addresses, from the Node object here (the daemon uses the node's interface"
                );
                let _ = writeln!(s, "#   addresses outside {DUMMY_DEVICE}, as upstream):");
            }
        }
        for a in &self.node_port_addresses {
            let _ = writeln!(s, "#   {a}");
        }
        s.push_str("# ipvsadm -Ln\n");
        s.push_str(&self.ipvsadm_list());
        s.push_str("# ipset restore -exist input\n");
        s.push_str(&self.ipset_restore());
        s.push_str(&self.annotated_restore());
        s
    }
}

/// The IANA protocol number: the kernel (and `ipvsadm`) order virtual servers by it.
fn protocol_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// The node's addresses of `family`, once each, in the order given: the listed interface
/// addresses, or the Node object's when there is no list.
fn listed_addresses(state: &ProxyState, opts: &IpvsRenderOptions, family: IpFamily) -> Vec<IpAddr> {
    let listed: &[IpAddr] = opts.node_addresses.as_deref().unwrap_or(&state.node.addresses);
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in listed.iter().copied().filter(|ip| family.contains(ip)) {
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    out
}

/// Whether upstream counts a local address as the node's (its netlink handle's filter for
/// address sets): loopback and IPv6 link-local addresses do not count.
fn counts_as_node_address(ip: &IpAddr) -> bool {
    let link_local = matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local());
    !ip.is_loopback() && !link_local
}

/// hash:ip,port,net sets cannot hold a zero-length prefix, so `0.0.0.0/0` (or `::/0`) is
/// stored as its two halves, which match exactly the same sources.
fn storable_nets(net: IpNet) -> Vec<IpNet> {
    if net.prefix_len() != 0 {
        return vec![net];
    }
    match net {
        IpNet::V4(_) => ["0.0.0.0/1", "128.0.0.0/1"]
            .iter()
            .filter_map(|s| s.parse::<Ipv4Net>().ok())
            .map(IpNet::V4)
            .collect(),
        IpNet::V6(_) => ["::/1", "8000::/1"]
            .iter()
            .filter_map(|s| s.parse::<Ipv6Net>().ok())
            .map(IpNet::V6)
            .collect(),
    }
}

fn destinations(endpoints: &[Endpoint]) -> Vec<IpvsDestination> {
    let mut v: Vec<IpvsDestination> = endpoints
        .iter()
        .map(|ep| IpvsDestination {
            address: ep.ip,
            port: ep.port,
            weight: 1,
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The node's addresses of the rendered family, as IPVS mode uses them.
struct NodeAddresses {
    /// The node's primary IP: source ranges that include it let its VIPs be the source.
    primary: Option<IpAddr>,
    /// Upstream's set of node addresses: they keep externalIPs and load-balancer IPs off
    /// kube-ipvs0, and by default they all carry NodePorts.
    node: Vec<IpAddr>,
    /// The addresses NodePort virtual servers go on, sorted.
    node_ports: Vec<IpAddr>,
}

impl NodeAddresses {
    fn new(state: &ProxyState, opts: &IpvsRenderOptions) -> NodeAddresses {
        let family = state.family;
        let primary = state.node.primary_ip(family);
        let npa = NodePortAddresses::new(family, &opts.common.node_port_addresses, primary);
        let listed = listed_addresses(state, opts, family);
        let node: Vec<IpAddr> = listed.iter().copied().filter(counts_as_node_address).collect();
        // With nodePortAddresses, upstream selects from every interface address but loopback (an
        // IPv6 link-local one too, if a CIDR covers it). Unlike upstream, never from kube-ipvs0's:
        // upstream's list holds whatever kube-ipvs0 held when it listed, so a CIDR covering the
        // Service range would put NodePorts on the ClusterIPs bound before that sync.
        let mut node_ports: Vec<IpAddr> = if npa.match_all() {
            node.clone()
        } else {
            npa.node_ips(&listed)
                .into_iter()
                .filter(|ip| !ip.is_loopback())
                .collect()
        };
        node_ports.sort();
        NodeAddresses {
            primary,
            node,
            node_ports,
        }
    }
}

/// One service port being rendered, with the real servers of its internal (ClusterIP) and
/// external virtual servers.
struct PortContext<'a> {
    svc: &'a ServicePort,
    internal: Vec<IpvsDestination>,
    external: Vec<IpvsDestination>,
}

impl PortContext<'_> {
    /// The `address,proto:port` ipset entry of `address` for this service port.
    fn entry(&self, address: IpAddr) -> String {
        format!("{address},{}:{}", self.svc.protocol.lower(), self.svc.port)
    }
}

/// The collection state of one render.
struct Builder<'a> {
    node: &'a NodeAddresses,
    topology: NodeTopology,
    scheduler: String,
    sched_flags: u32,
    sets: BTreeMap<SetId, BTreeSet<String>>,
    servers: BTreeMap<(u8, IpAddr, u16), IpvsService>,
    bound: BTreeSet<IpAddr>,
    /// Load-balancer IP, protocol and port the node itself must not reach (source ranges
    /// that do not include the node).
    no_node_access: Vec<(IpAddr, Protocol, u16)>,
    warnings: Vec<String>,
}

impl<'a> Builder<'a> {
    fn new(state: &ProxyState, opts: &IpvsRenderOptions, node: &'a NodeAddresses) -> Builder<'a> {
        let scheduler = if opts.scheduler.is_empty() {
            DEFAULT_SCHEDULER.to_string()
        } else {
            opts.scheduler.clone()
        };
        // mh hashes on the source address only unless told to include the port; upstream always
        // asks for the port, so that connections from one client spread over the backends.
        let sched_flags = if scheduler == "mh" { FLAG_SCHED2 } else { 0 };
        Builder {
            node,
            topology: NodeTopology::new(&state.node, opts.common.prefer_same_node),
            scheduler,
            sched_flags,
            sets: BTreeMap::new(),
            servers: BTreeMap::new(),
            bound: BTreeSet::new(),
            no_node_access: Vec::new(),
            warnings: Vec::new(),
        }
    }

    fn add(&mut self, id: SetId, entry: String) {
        self.sets.entry(id).or_default().insert(entry);
    }

    /// Adds the virtual server `address:port` of the service port `of`, unless another service
    /// port has it already.
    fn add_server(
        &mut self,
        of: &PortContext<'_>,
        kind: VirtualServerKind,
        address: IpAddr,
        port: u16,
        destinations: &[IpvsDestination],
    ) {
        let (name, protocol, persistent) = (&of.svc.name, of.svc.protocol, of.svc.session_affinity_timeout);
        let key = (protocol_number(protocol), address, port);
        if let Some(existing) = self.servers.get(&key) {
            // Upstream would program both in turn on every sync, each replacing the other's
            // real servers; render one, deterministically, and say so.
            if existing.service != *name || existing.kind != kind {
                self.warnings.push(format!(
                    "IPVS virtual server {} {} is claimed by {} and {}; only {}'s is rendered",
                    protocol.api(),
                    addr_port(address, port),
                    existing.service,
                    name,
                    existing.service
                ));
            }
            return;
        }
        self.servers.insert(
            key,
            IpvsService {
                address,
                protocol,
                port,
                scheduler: self.scheduler.clone(),
                persistent,
                netmask: full_netmask(address),
                sched_flags: self.sched_flags,
                destinations: destinations.to_vec(),
                service: name.clone(),
                kind,
            },
        );
    }

    /// Binds `address` to kube-ipvs0, unless it is already the node's (it must not move to
    /// the dummy device).
    fn bind_unless_node_address(&mut self, address: IpAddr) {
        if !self.node.node.contains(&address) {
            self.bound.insert(address);
        }
    }

    /// Everything one service port adds: sets, virtual servers, bound addresses.
    fn add_service_port(&mut self, sps: &ServicePortState) {
        let svc = &sps.port;
        let sets = self.topology.endpoint_sets(sps);
        let cluster = destinations(&sets.cluster);
        let local = destinations(&sets.local);
        // A Local policy uses the local endpoints, but falls back to the cluster ones when the
        // node has none (upstream PR 97081): pods on this node can still reach the service.
        let pick = |policy_local: bool| {
            if policy_local && !local.is_empty() {
                local.clone()
            } else {
                cluster.clone()
            }
        };
        let of = PortContext {
            svc,
            internal: pick(svc.internal_policy_local),
            external: pick(svc.external_policy_local),
        };
        self.hairpin(sps);
        self.cluster_ip(&of);
        self.external_ips(&of);
        self.load_balancer_ips(&of);
        if svc.node_port != 0 {
            // Upstream skips the rest of this service port when it found no node address,
            // its health-check node port included.
            if self.node.node_ports.is_empty() {
                return;
            }
            self.node_port(&of);
        }
        if svc.health_check_node_port != 0 {
            self.add(SetId::HealthCheckNodePort, svc.health_check_node_port.to_string());
        }
    }

    /// Hairpin: a local pod reaching itself through the service is masqueraded. Every local
    /// endpoint counts, ready or not.
    fn hairpin(&mut self, sps: &ServicePortState) {
        let proto = sps.port.protocol.lower();
        for ep in sps.endpoints.iter().filter(|ep| ep.is_local) {
            self.add(SetId::LoopBack, format!("{},{proto}:{},{}", ep.ip, ep.port, ep.ip));
        }
    }

    fn cluster_ip(&mut self, of: &PortContext<'_>) {
        let cip = of.svc.cluster_ip;
        self.add(SetId::ClusterIp, of.entry(cip));
        self.add_server(of, VirtualServerKind::ClusterIp, cip, of.svc.port, &of.internal);
        self.bound.insert(cip);
    }

    fn external_ips(&mut self, of: &PortContext<'_>) {
        let set = if of.svc.external_policy_local {
            SetId::ExternalIpLocal
        } else {
            SetId::ExternalIp
        };
        for &ext in &of.svc.external_ips {
            self.add(set, of.entry(ext));
            self.add_server(of, VirtualServerKind::ExternalIp, ext, of.svc.port, &of.external);
            self.bind_unless_node_address(ext);
        }
    }

    fn load_balancer_ips(&mut self, of: &PortContext<'_>) {
        let svc = of.svc;
        for &lb in &svc.load_balancer_vips {
            let entry = of.entry(lb);
            self.add(SetId::LoadBalancer, entry.clone());
            if svc.external_policy_local {
                self.add(SetId::LoadBalancerLocal, entry.clone());
            }
            if !svc.load_balancer_source_ranges.is_empty() {
                self.source_ranges(of, lb, entry);
            }
            self.add_server(of, VirtualServerKind::LoadBalancer, lb, svc.port, &of.external);
            self.bind_unless_node_address(lb);
        }
    }

    /// loadBalancerSourceRanges of the load-balancer IP `lb` (ipset entry `entry`).
    fn source_ranges(&mut self, of: &PortContext<'_>, lb: IpAddr, entry: String) {
        let svc = of.svc;
        self.add(SetId::LoadBalancerFw, entry.clone());
        let mut allow_from_node = false;
        for &cidr in &svc.load_balancer_source_ranges {
            for net in storable_nets(cidr) {
                self.add(SetId::LoadBalancerSourceCidr, format!("{entry},{net}"));
            }
            allow_from_node |= self.node.primary.is_some_and(|ip| cidr.contains(&ip));
        }
        if allow_from_node {
            // Traffic from the node to its own VIP leaves with the VIP as source.
            self.add(SetId::LoadBalancerSourceIp, format!("{entry},{lb}"));
        } else {
            self.no_node_access.push((lb, svc.protocol, svc.port));
        }
    }

    fn node_port(&mut self, of: &PortContext<'_>) {
        let node = self.node;
        let np = of.svc.node_port;
        let (set, local_set, entries): (SetId, SetId, Vec<String>) = match of.svc.protocol {
            Protocol::Tcp => (SetId::NodePortTcp, SetId::NodePortLocalTcp, vec![np.to_string()]),
            Protocol::Udp => (SetId::NodePortUdp, SetId::NodePortLocalUdp, vec![np.to_string()]),
            // No bitmap for SCTP ports in ipset: a hash of node address and port instead.
            Protocol::Sctp => (
                SetId::NodePortSctp,
                SetId::NodePortLocalSctp,
                node.node_ports.iter().map(|ip| format!("{ip},sctp:{np}")).collect(),
            ),
        };
        for e in &entries {
            self.add(set, e.clone());
            if of.svc.external_policy_local {
                self.add(local_set, e.clone());
            }
        }
        for &ip in &node.node_ports {
            self.add_server(of, VirtualServerKind::NodePort, ip, np, &of.external);
        }
    }

    /// Every set, in upstream's order, with its entries (kube-ipvs0's addresses included).
    fn ipsets(&mut self, family: IpFamily) -> Vec<Ipset> {
        for ip in self.bound.clone() {
            self.add(SetId::IpvsIps, ip.to_string());
        }
        IPSETS
            .iter()
            .map(|info| Ipset {
                id: info.id,
                name: set_name(info.name, family),
                set_type: info.set_type,
                family,
                comment: info.comment,
                entries: self
                    .sets
                    .get(&info.id)
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default(),
            })
            .collect()
    }
}

/// Renders the full-sync state of one family.
pub fn render(state: &ProxyState, opts: &IpvsRenderOptions) -> IpvsRuleset {
    let family = state.family;
    let node = NodeAddresses::new(state, opts);
    let mut b = Builder::new(state, opts, &node);
    for sps in &state.service_ports {
        b.add_service_port(sps);
    }
    let ipsets = b.ipsets(family);
    let restore = restore_input(family, opts, &ipsets, &b.no_node_access);
    IpvsRuleset {
        family,
        virtual_servers: b.servers.into_values().collect(),
        bound_addresses: b.bound.into_iter().collect(),
        node_addresses_from: if opts.node_addresses.is_some() {
            NodeAddressSource::Interfaces
        } else {
            NodeAddressSource::NodeObject
        },
        ipsets,
        jumps: jump_rules(),
        restore,
        sysctls: sysctls(opts),
        timeouts: timeouts(opts),
        exclude_cidrs: opts.exclude_cidrs.clone(),
        warnings: b.warnings,
        // Last: the builder borrows `node` until then.
        node_port_addresses: node.node_ports,
    }
}

/// The sysctls IPVS mode sets at start.
fn sysctls(opts: &IpvsRenderOptions) -> Vec<(&'static str, u32)> {
    let mut sysctls: Vec<(&'static str, u32)> = vec![
        ("net/ipv4/vs/conntrack", 1),
        ("net/ipv4/vs/expire_nodest_conn", 1),
        ("net/ipv4/vs/expire_quiescent_template", 1),
        ("net/ipv4/ip_forward", 1),
    ];
    if opts.strict_arp {
        sysctls.push(("net/ipv4/conf/all/arp_ignore", 1));
        sysctls.push(("net/ipv4/conf/all/arp_announce", 2));
    }
    sysctls
}

/// The IPVS timeouts to set, when any is configured.
fn timeouts(opts: &IpvsRenderOptions) -> Option<IpvsTimeouts> {
    let timeouts = IpvsTimeouts {
        tcp: opts.tcp_timeout,
        tcp_fin: opts.tcp_fin_timeout,
        udp: opts.udp_timeout,
    };
    let any_timeout = [timeouts.tcp, timeouts.tcp_fin, timeouts.udp]
        .iter()
        .any(|d| !d.is_zero());
    any_timeout.then_some(timeouts)
}

#[cfg(test)]
mod tests {
    //! Expectations hand-checked against upstream's IPVS proxier (and the cases of its
    //! `proxier_test.go`: TestNodePortIPv4, TestLoadBalancerSourceRanges, TestOnlyLocalNodePorts,
    //! TestOnlyLocalLoadBalancing, TestHealthCheckNodePort, TestAcceptIPVSTraffic, ...).

    use super::*;
    use crate::config::LocalDetector;
    use crate::model::{ServicePort, ServicePortState};

    const NODE: &str = "test-node";

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    fn port(ns: &str, name: &str, port_name: &str, proto: Protocol, cip: &str, p: u16) -> ServicePort {
        ServicePort::cluster_ip(
            ServicePortName {
                namespace: ns.into(),
                name: name.into(),
                port: port_name.into(),
                protocol: proto,
            },
            ip(cip),
            p,
        )
    }

    /// The service port `ns1/svc1:p80` on 10.20.30.41:80 of upstream's tests.
    fn svc1(proto: Protocol) -> ServicePort {
        port("ns1", "svc1", "p80", proto, "10.20.30.41", 80)
    }

    fn ep(addr: &str, p: u16, local: bool) -> Endpoint {
        Endpoint {
            is_local: local,
            ..Endpoint::ready(ip(addr), p)
        }
    }

    fn state(node_ips: &[&str], ports: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
        let family = IpFamily::of(&ports.first().map_or(ip("10.0.0.1"), |p| p.0.cluster_ip));
        let mut service_ports: Vec<ServicePortState> = ports
            .into_iter()
            .map(|(port, mut endpoints)| {
                endpoints.sort_by_key(|e| e.to_string());
                ServicePortState { port, endpoints }
            })
            .collect();
        service_ports.sort_by(|a, b| a.port.name.cmp(&b.port.name));
        ProxyState {
            family,
            node: NodeInfo {
                name: NODE.into(),
                addresses: node_ips.iter().map(|s| ip(s)).collect(),
                ..NodeInfo::default()
            },
            service_ports: crate::model::shared(service_ports),
            service_cidrs: vec![],
            warnings: vec![],
        }
    }

    fn entries(rs: &IpvsRuleset, id: SetId) -> Vec<&str> {
        rs.ipset(id)
            .map(|s| s.entries.iter().map(String::as_str).collect())
            .unwrap_or_default()
    }

    fn dests(rs: &IpvsRuleset, proto: Protocol, addr: &str, p: u16) -> Vec<String> {
        let vs = rs
            .virtual_server(proto, ip(addr), p)
            .unwrap_or_else(|| panic!("no virtual server {proto} {addr}:{p}"));
        vs.destinations
            .iter()
            .map(|d| format!("{}/{}", addr_port(d.address, d.port), d.weight))
            .collect()
    }

    fn keys(rs: &IpvsRuleset) -> Vec<String> {
        rs.virtual_servers
            .iter()
            .map(|v| format!("{} {}", v.protocol, addr_port(v.address, v.port)))
            .collect()
    }

    /// The rules of one chain of one table, without the `-A CHAIN ` prefix.
    fn chain(rs: &IpvsRuleset, table: &str, chain: &str) -> Vec<String> {
        let mut current = "";
        let mut out = Vec::new();
        let prefix = format!("-A {chain} ");
        for line in rs.restore.lines() {
            if let Some(t) = line.strip_prefix('*') {
                current = t;
            } else if current == table
                && let Some(rest) = line.strip_prefix(&prefix)
            {
                out.push(rest.to_string());
            }
        }
        out
    }

    fn node_port(mut p: ServicePort, np: u16) -> ServicePort {
        p.node_port = np;
        p
    }

    #[test]
    fn node_port_with_endpoints() {
        // TestNodePortIPv4 "1 service with node port, has 2 endpoints".
        let st = state(
            &["100.101.102.103", "2001:db8::1:1"],
            vec![(node_port(svc1(Protocol::Tcp), 3001), vec![ep("10.180.0.1", 80, false)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(keys(&rs), ["TCP 10.20.30.41:80", "TCP 100.101.102.103:3001"]);
        assert_eq!(dests(&rs, Protocol::Tcp, "10.20.30.41", 80), ["10.180.0.1:80/1"]);
        assert_eq!(dests(&rs, Protocol::Tcp, "100.101.102.103", 3001), ["10.180.0.1:80/1"]);
        assert!(rs.virtual_servers.iter().all(|v| v.scheduler == "rr" && v.flags() == 0));
        assert_eq!(entries(&rs, SetId::ClusterIp), ["10.20.30.41,tcp:80"]);
        assert_eq!(entries(&rs, SetId::NodePortTcp), ["3001"]);
        assert_eq!(entries(&rs, SetId::IpvsIps), ["10.20.30.41"]);
        assert_eq!(rs.bound_addresses, [ip("10.20.30.41")]);
        assert!(entries(&rs, SetId::LoopBack).is_empty());
    }

    #[test]
    fn udp_node_port_rules() {
        // TestNodePortIPv4 "1 UDP service with node port, has endpoints" (no local detector).
        let st = state(
            &["100.101.102.103"],
            vec![(node_port(svc1(Protocol::Udp), 3001), vec![ep("10.180.0.1", 80, false)])],
        );
        let opts = IpvsRenderOptions {
            common: RenderOptions {
                node_port_addresses: vec!["0.0.0.0/0".into()],
                ..RenderOptions::default()
            },
            ..IpvsRenderOptions::default()
        };
        let rs = render(&st, &opts);
        assert_eq!(keys(&rs), ["UDP 10.20.30.41:80", "UDP 100.101.102.103:3001"]);
        assert_eq!(entries(&rs, SetId::NodePortUdp), ["3001"]);
        assert_eq!(
            chain(&rs, "nat", KUBE_NODE_PORT),
            [
                "-p udp -m comment --comment \"Kubernetes nodeport UDP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-UDP dst -j KUBE-MARK-MASQ"
            ]
        );
        assert_eq!(
            chain(&rs, "filter", KUBE_NODE_PORT),
            [
                "-m comment --comment \"Kubernetes health check node port\" -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT"
            ]
        );
        assert_eq!(
            chain(&rs, "nat", KUBE_SERVICES),
            [
                "-s 127.0.0.0/8 -j RETURN",
                "-m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ",
                "-m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
                "-m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT",
            ]
        );
    }

    #[test]
    fn no_endpoints_keeps_virtual_servers_without_real_servers() {
        // TestNodePortIPv4 "service has node port but no endpoints": no REJECT rule either.
        let st = state(
            &["100.101.102.103"],
            vec![(node_port(svc1(Protocol::Tcp), 3001), vec![])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(keys(&rs), ["TCP 10.20.30.41:80", "TCP 100.101.102.103:3001"]);
        assert!(rs.virtual_servers.iter().all(|v| v.destinations.is_empty()));
        assert_eq!(rs.restore.matches("REJECT").count(), 1, "only KUBE-IPVS-FILTER's");
        assert_eq!(entries(&rs, SetId::ClusterIp), ["10.20.30.41,tcp:80"]);
    }

    #[test]
    fn sctp_node_port_on_every_node_address() {
        // TestNodePortIPv4 "node port service with protocol sctp on a node with multiple nodeIPs".
        let st = state(
            &[
                "100.101.102.103", "100.101.102.104", "100.101.102.105", "2001:db8::1:1", "2001:db8::1:2",
            ],
            vec![(node_port(svc1(Protocol::Sctp), 3001), vec![ep("10.180.0.1", 80, false)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(
            keys(&rs),
            [
                "SCTP 10.20.30.41:80", "SCTP 100.101.102.103:3001", "SCTP 100.101.102.104:3001",
                "SCTP 100.101.102.105:3001",
            ]
        );
        assert_eq!(
            entries(&rs, SetId::NodePortSctp),
            [
                "100.101.102.103,sctp:3001", "100.101.102.104,sctp:3001", "100.101.102.105,sctp:3001"
            ]
        );
        assert!(entries(&rs, SetId::NodePortTcp).is_empty());
    }

    #[test]
    fn sctp_node_port_with_local_policy() {
        // TestNodePortIPv4 "node port service with protocol sctp and externalTrafficPolicy local".
        let mut p = node_port(svc1(Protocol::Sctp), 3001);
        p.external_policy_local = true;
        let st = state(
            &["100.101.102.103"],
            vec![(p, vec![ep("10.180.0.1", 80, true), ep("10.180.1.1", 80, false)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(
            dests(&rs, Protocol::Sctp, "10.20.30.41", 80),
            ["10.180.0.1:80/1", "10.180.1.1:80/1"]
        );
        assert_eq!(dests(&rs, Protocol::Sctp, "100.101.102.103", 3001), ["10.180.0.1:80/1"]);
        assert_eq!(entries(&rs, SetId::NodePortSctp), ["100.101.102.103,sctp:3001"]);
        assert_eq!(entries(&rs, SetId::NodePortLocalSctp), ["100.101.102.103,sctp:3001"]);
        assert_eq!(entries(&rs, SetId::LoopBack), ["10.180.0.1,sctp:80,10.180.0.1"]);
        assert_eq!(
            chain(&rs, "nat", KUBE_NODE_PORT),
            [
                "-p sctp -m comment --comment \"Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'\" -m set --match-set KUBE-NODE-PORT-LOCAL-SCTP-HASH dst,dst -j RETURN",
                "-p sctp -m comment --comment \"Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'\" -m set --match-set KUBE-NODE-PORT-SCTP-HASH dst,dst -j KUBE-MARK-MASQ",
            ]
        );
    }

    #[test]
    fn only_local_node_ports_on_selected_addresses() {
        // TestOnlyLocalNodePorts: nodePortAddresses 100.101.102.0/24.
        let mut p = node_port(svc1(Protocol::Tcp), 3001);
        p.external_policy_local = true;
        let st = state(
            &["100.101.102.103", "192.168.0.9"],
            vec![(p, vec![ep("10.180.0.1", 80, true), ep("10.180.1.1", 80, false)])],
        );
        let opts = IpvsRenderOptions {
            common: RenderOptions {
                node_port_addresses: vec!["100.101.102.0/24".into()],
                ..RenderOptions::default()
            },
            ..IpvsRenderOptions::default()
        };
        let rs = render(&st, &opts);
        assert_eq!(keys(&rs), ["TCP 10.20.30.41:80", "TCP 100.101.102.103:3001"]);
        assert_eq!(dests(&rs, Protocol::Tcp, "100.101.102.103", 3001), ["10.180.0.1:80/1"]);
        assert_eq!(entries(&rs, SetId::NodePortTcp), ["3001"]);
        assert_eq!(entries(&rs, SetId::NodePortLocalTcp), ["3001"]);
        let np = chain(&rs, "nat", KUBE_NODE_PORT);
        assert_eq!(np.len(), 2);
        assert!(
            np[0].ends_with("--match-set KUBE-NODE-PORT-LOCAL-TCP dst -j RETURN"),
            "{np:?}"
        );
        assert!(
            np[1].ends_with("--match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ"),
            "{np:?}"
        );
    }

    #[test]
    fn load_balancer_source_ranges() {
        // TestLoadBalancerSourceRanges, checked rule for rule against writeIptablesRules.
        let mut p = svc1(Protocol::Tcp);
        p.load_balancer_vips = vec![ip("1.2.3.4")];
        p.load_balancer_source_ranges = vec!["10.0.0.0/8".parse().expect("cidr")];
        let st = state(&["100.101.102.103"], vec![(p, vec![ep("10.180.0.1", 80, false)])]);
        let opts = IpvsRenderOptions {
            common: RenderOptions {
                local_detector: LocalDetector::Cidr("10.0.0.0/24".into()),
                ..RenderOptions::default()
            },
            ..IpvsRenderOptions::default()
        };
        let rs = render(&st, &opts);
        assert_eq!(keys(&rs), ["TCP 1.2.3.4:80", "TCP 10.20.30.41:80"]);
        assert_eq!(dests(&rs, Protocol::Tcp, "1.2.3.4", 80), ["10.180.0.1:80/1"]);
        assert_eq!(entries(&rs, SetId::LoadBalancer), ["1.2.3.4,tcp:80"]);
        assert_eq!(entries(&rs, SetId::LoadBalancerFw), ["1.2.3.4,tcp:80"]);
        assert_eq!(
            entries(&rs, SetId::LoadBalancerSourceCidr),
            ["1.2.3.4,tcp:80,10.0.0.0/8"]
        );
        assert!(entries(&rs, SetId::LoadBalancerSourceIp).is_empty());
        assert_eq!(entries(&rs, SetId::IpvsIps), ["1.2.3.4", "10.20.30.41"]);
        let expected = "\
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN
-A KUBE-SERVICES -m comment --comment \"Kubernetes service lb portal\" -m set --match-set KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER
-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s 10.0.0.0/24 -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-SERVICES -m set --match-set KUBE-LOAD-BALANCER dst,dst -j ACCEPT
-A KUBE-POSTROUTING -m mark ! --mark 0x004000/0x004000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x004000
-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000
COMMIT
*filter
:KUBE-FORWARD - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-IPVS-OUT-FILTER - [0:0]
-A KUBE-PROXY-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL
-A KUBE-SOURCE-RANGES-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port + source cidr for packet filter purpose\" -m set --match-set KUBE-LOAD-BALANCER-SOURCE-CIDR dst,dst,src -j RETURN
-A KUBE-SOURCE-RANGES-FIREWALL -j DROP
-A KUBE-IPVS-OUT-FILTER -s 1.2.3.4 -m ipvs --vaddr 1.2.3.4 --vproto tcp --vport 80 -j DROP
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x004000/0x004000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-NODE-PORT -m comment --comment \"Kubernetes health check node port\" -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT
-A KUBE-IPVS-FILTER -m set --match-set KUBE-LOAD-BALANCER dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-CLUSTER-IP dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-EXTERNAL-IP dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-EXTERNAL-IP-LOCAL dst,dst -j RETURN
-A KUBE-IPVS-FILTER -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j RETURN
-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT
COMMIT
";
        assert_eq!(rs.restore, expected);
    }

    #[test]
    fn source_range_with_the_node_allows_the_vip_as_source() {
        let mut p = svc1(Protocol::Tcp);
        p.load_balancer_vips = vec![ip("1.2.3.4")];
        p.load_balancer_source_ranges = vec!["100.101.0.0/16".parse().expect("cidr")];
        let st = state(&["100.101.102.103"], vec![(p, vec![ep("10.180.0.1", 80, false)])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(entries(&rs, SetId::LoadBalancerSourceIp), ["1.2.3.4,tcp:80,1.2.3.4"]);
        assert!(chain(&rs, "filter", KUBE_IPVS_OUT_FILTER).is_empty());
        assert_eq!(chain(&rs, "filter", KUBE_SOURCE_RANGES_FIREWALL).len(), 3);
    }

    #[test]
    fn match_all_source_range_is_stored_as_two_halves() {
        let mut p = svc1(Protocol::Tcp);
        p.load_balancer_vips = vec![ip("1.2.3.4")];
        p.load_balancer_source_ranges = vec!["0.0.0.0/0".parse().expect("cidr")];
        let st = state(&["100.101.102.103"], vec![(p, vec![])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(
            entries(&rs, SetId::LoadBalancerSourceCidr),
            ["1.2.3.4,tcp:80,0.0.0.0/1", "1.2.3.4,tcp:80,128.0.0.0/1"]
        );
        assert_eq!(entries(&rs, SetId::LoadBalancerSourceIp), ["1.2.3.4,tcp:80,1.2.3.4"]);
    }

    #[test]
    fn only_local_load_balancing() {
        // TestOnlyLocalLoadBalancing.
        let mut p = node_port(svc1(Protocol::Tcp), 3001);
        p.load_balancer_vips = vec![ip("1.2.3.4")];
        p.external_policy_local = true;
        p.health_check_node_port = 30000;
        let st = state(
            &[],
            vec![(p, vec![ep("10.180.0.1", 80, true), ep("10.180.1.1", 80, false)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        // No node address: no NodePort virtual servers (and upstream skips the NodePort sets).
        assert_eq!(keys(&rs), ["TCP 1.2.3.4:80", "TCP 10.20.30.41:80"]);
        assert_eq!(dests(&rs, Protocol::Tcp, "1.2.3.4", 80), ["10.180.0.1:80/1"]);
        assert_eq!(entries(&rs, SetId::LoadBalancer), ["1.2.3.4,tcp:80"]);
        assert_eq!(entries(&rs, SetId::LoadBalancerLocal), ["1.2.3.4,tcp:80"]);
        assert!(entries(&rs, SetId::NodePortTcp).is_empty());
        // Upstream's `continue` for a NodePort without node addresses skips the health check too.
        assert!(entries(&rs, SetId::HealthCheckNodePort).is_empty());
        assert_eq!(
            chain(&rs, "nat", KUBE_LOAD_BALANCER),
            [
                "-m comment --comment \"Kubernetes service load balancer ip + port with externalTrafficPolicy=local\" -m set --match-set KUBE-LOAD-BALANCER-LOCAL dst,dst -j RETURN",
                "-j KUBE-MARK-MASQ",
            ]
        );
    }

    #[test]
    fn local_policies_fall_back_to_cluster_endpoints() {
        // Upstream PR 97081: no local endpoint means the cluster ones, not a drop.
        let mut p = node_port(svc1(Protocol::Tcp), 3001);
        p.external_policy_local = true;
        p.internal_policy_local = true;
        let st = state(&["100.101.102.103"], vec![(p, vec![ep("10.180.1.1", 80, false)])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(dests(&rs, Protocol::Tcp, "10.20.30.41", 80), ["10.180.1.1:80/1"]);
        assert_eq!(dests(&rs, Protocol::Tcp, "100.101.102.103", 3001), ["10.180.1.1:80/1"]);
    }

    #[test]
    fn internal_local_policy_uses_local_endpoints_for_the_cluster_ip() {
        let mut p = svc1(Protocol::Tcp);
        p.internal_policy_local = true;
        let st = state(
            &[],
            vec![(p, vec![ep("10.180.0.1", 80, true), ep("10.180.1.1", 80, false)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(dests(&rs, Protocol::Tcp, "10.20.30.41", 80), ["10.180.0.1:80/1"]);
    }

    #[test]
    fn terminating_endpoints_only_as_fallback() {
        let mut term = ep("10.180.0.2", 80, false);
        term.ready = false;
        term.terminating = true;
        let st = state(
            &[],
            vec![(svc1(Protocol::Tcp), vec![ep("10.180.0.1", 80, false), term.clone()])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(dests(&rs, Protocol::Tcp, "10.20.30.41", 80), ["10.180.0.1:80/1"]);
        let st = state(&[], vec![(svc1(Protocol::Tcp), vec![term.clone()])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(dests(&rs, Protocol::Tcp, "10.20.30.41", 80), ["10.180.0.2:80/1"]);
        term.serving = false;
        let st = state(&[], vec![(svc1(Protocol::Tcp), vec![term])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert!(dests(&rs, Protocol::Tcp, "10.20.30.41", 80).is_empty());
    }

    #[test]
    fn health_check_node_ports() {
        // TestHealthCheckNodePort: the set holds the health-check ports (TCP bitmap).
        let mut a = node_port(port("ns1", "valid-svc1", "p80", Protocol::Tcp, "10.20.30.41", 80), 3000);
        a.external_policy_local = true;
        a.health_check_node_port = 30000;
        let mut b = node_port(port("ns1", "valid-svc2", "p80", Protocol::Tcp, "10.20.30.42", 80), 3001);
        b.external_policy_local = true;
        b.health_check_node_port = 30001;
        let st = state(&["100.101.102.103"], vec![(a, vec![]), (b, vec![])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(entries(&rs, SetId::HealthCheckNodePort), ["30000", "30001"]);
        assert_eq!(entries(&rs, SetId::NodePortLocalTcp), ["3000", "3001"]);
    }

    #[test]
    fn accept_rules_close_kube_services() {
        // TestAcceptIPVSTraffic: ClusterIP with an externalIP, a LoadBalancer, a NodePort.
        let mut a = port("ns1", "svc1", "p80", Protocol::Tcp, "10.20.30.40", 80);
        a.external_ips = vec![ip("5.6.7.8")];
        let mut b = node_port(port("ns1", "svc2", "p80", Protocol::Tcp, "10.20.30.41", 80), 80);
        b.load_balancer_vips = vec![ip("1.2.3.4")];
        let c = node_port(port("ns1", "svc3", "p80", Protocol::Tcp, "10.20.30.42", 80), 80);
        let st = state(&["100.101.102.103"], vec![(a, vec![]), (b, vec![]), (c, vec![])]);
        let opts = IpvsRenderOptions {
            common: RenderOptions {
                masquerade_all: true,
                ..RenderOptions::default()
            },
            ..IpvsRenderOptions::default()
        };
        let rs = render(&st, &opts);
        let ext = "-m comment --comment \"Kubernetes service external ip + port for masquerade and filter purpose\" -m set --match-set KUBE-EXTERNAL-IP dst,dst";
        assert_eq!(
            chain(&rs, "nat", KUBE_SERVICES),
            [
                "-s 127.0.0.0/8 -j RETURN".to_string(),
                "-m comment --comment \"Kubernetes service lb portal\" -m set --match-set KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER".to_string(),
                "-m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ".to_string(),
                format!("{ext} -j KUBE-MARK-MASQ"),
                format!("{ext} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"),
                format!("{ext} -m addrtype --dst-type LOCAL -j ACCEPT"),
                "-m addrtype --dst-type LOCAL -j KUBE-NODE-PORT".to_string(),
                "-m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT".to_string(),
                "-m set --match-set KUBE-LOAD-BALANCER dst,dst -j ACCEPT".to_string(),
            ]
        );
        // One NodePort shared by two services: one virtual server, and a warning.
        assert_eq!(rs.warnings.len(), 1, "{:?}", rs.warnings);
        assert!(rs.warnings[0].contains("TCP 100.101.102.103:80"), "{:?}", rs.warnings);
        assert_eq!(
            rs.virtual_server(Protocol::Tcp, ip("100.101.102.103"), 80)
                .map(|v| v.service.name.as_str()),
            Some("svc2")
        );
    }

    #[test]
    fn external_ips_local_and_bound_addresses() {
        // TestOnlyLocalExternalIPs; an externalIP that is the node's own stays off kube-ipvs0.
        let mut p = svc1(Protocol::Tcp);
        p.external_ips = vec![ip("50.60.70.81"), ip("127.0.0.1"), ip("100.101.102.103")];
        p.external_policy_local = true;
        let st = state(
            &["100.101.102.103"],
            vec![(p, vec![ep("10.180.0.1", 80, true), ep("10.180.1.1", 80, false)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(rs.virtual_servers.len(), 4);
        for ext in ["50.60.70.81", "127.0.0.1", "100.101.102.103"] {
            assert_eq!(dests(&rs, Protocol::Tcp, ext, 80), ["10.180.0.1:80/1"], "{ext}");
        }
        assert!(entries(&rs, SetId::ExternalIp).is_empty());
        assert_eq!(
            entries(&rs, SetId::ExternalIpLocal),
            ["100.101.102.103,tcp:80", "127.0.0.1,tcp:80", "50.60.70.81,tcp:80"]
        );
        assert_eq!(
            rs.bound_addresses,
            [ip("10.20.30.41"), ip("50.60.70.81"), ip("127.0.0.1")]
        );
        // Local externalIPs are accepted but never marked for masquerade.
        let svcs = chain(&rs, "nat", KUBE_SERVICES);
        assert!(
            svcs.iter()
                .any(|r| r.contains("KUBE-EXTERNAL-IP-LOCAL dst,dst -m addrtype --dst-type LOCAL -j ACCEPT"))
        );
        assert!(
            !svcs
                .iter()
                .any(|r| r.contains("KUBE-EXTERNAL-IP-LOCAL") && r.ends_with("KUBE-MARK-MASQ"))
        );
    }

    #[test]
    fn session_affinity_is_persistence() {
        let mut p = svc1(Protocol::Tcp);
        p.session_affinity_timeout = Some(10800);
        let st = state(&[], vec![(p, vec![ep("10.180.0.1", 80, false)])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        let vs = &rs.virtual_servers[0];
        assert_eq!(vs.persistent, Some(10800));
        assert_eq!(vs.flags(), FLAG_PERSISTENT);
        assert_eq!(vs.netmask, 0xffff_ffff);
        assert_eq!(vs.ipvsadm_line(), "TCP  10.20.30.41:80 rr persistent 10800");
    }

    #[test]
    fn mh_scheduler_hashes_on_the_port_too() {
        let mut p = svc1(Protocol::Udp);
        p.session_affinity_timeout = Some(60);
        let st = state(&[], vec![(p, vec![])]);
        let opts = IpvsRenderOptions {
            scheduler: "mh".into(),
            ..IpvsRenderOptions::default()
        };
        let rs = render(&st, &opts);
        let vs = &rs.virtual_servers[0];
        assert_eq!(vs.flags(), FLAG_PERSISTENT | FLAG_SCHED2);
        // As the kernel lists it (checked with ipvsadm 1.31 in the test VM).
        assert_eq!(vs.ipvsadm_line(), "UDP  10.20.30.41:80 mh (mh-port) persistent 60");
        for sched in ["sh", "dh", "wrr", "lc"] {
            let rs = render(
                &st,
                &IpvsRenderOptions {
                    scheduler: sched.into(),
                    ..IpvsRenderOptions::default()
                },
            );
            assert_eq!(rs.virtual_servers[0].sched_flags, 0, "{sched}");
        }
    }

    #[test]
    fn node_ports_on_the_listed_interface_addresses() {
        // The Node object says 192.168.49.2 and 172.16.0.9; the interfaces hold 192.168.49.2,
        // a second address, loopback and IPv6 ones.
        let mut p = node_port(svc1(Protocol::Tcp), 3001);
        p.external_ips = vec![ip("10.0.2.15"), ip("172.16.0.9")];
        let st = state(
            &["192.168.49.2", "172.16.0.9"],
            vec![(p, vec![ep("10.180.0.1", 80, false)])],
        );
        let listed = vec![
            ip("127.0.0.1"),
            ip("192.168.49.2"),
            ip("10.0.2.15"),
            ip("::1"),
            ip("fe80::1"),
            ip("169.254.3.3"),
            ip("192.168.49.2"),
        ];
        let opts = IpvsRenderOptions {
            node_addresses: Some(listed.clone()),
            ..IpvsRenderOptions::default()
        };
        let rs = render(&st, &opts);
        // Loopback never; IPv4 link-local counts (upstream filters IPv6 link-local only).
        assert_eq!(
            rs.node_port_addresses,
            [ip("10.0.2.15"), ip("169.254.3.3"), ip("192.168.49.2")]
        );
        for a in ["10.0.2.15", "169.254.3.3", "192.168.49.2"] {
            assert_eq!(dests(&rs, Protocol::Tcp, a, 3001), ["10.180.0.1:80/1"], "{a}");
        }
        assert!(rs.virtual_server(Protocol::Tcp, ip("172.16.0.9"), 3001).is_none());
        // An externalIP on an interface stays off kube-ipvs0; the Node object's other address
        // is no interface's, so it is bound.
        assert_eq!(rs.bound_addresses, [ip("10.20.30.41"), ip("172.16.0.9")]);
        assert_eq!(rs.node_addresses_from, NodeAddressSource::Interfaces);
        assert!(
            rs.to_text()
                .contains("# NodePort addresses (the node's interfaces):\n#   10.0.2.15\n")
        );

        // `primary` is the Node's primary IP, as a CIDR over the interface addresses.
        let primary = IpvsRenderOptions {
            common: RenderOptions {
                node_port_addresses: vec!["primary".into()],
                ..opts.common.clone()
            },
            ..opts.clone()
        };
        assert_eq!(render(&st, &primary).node_port_addresses, [ip("192.168.49.2")]);
        let elsewhere = state(&["172.16.0.9"], vec![(node_port(svc1(Protocol::Tcp), 3001), vec![])]);
        assert!(
            render(&elsewhere, &primary).node_port_addresses.is_empty(),
            "the primary IP is on no interface"
        );
        // A CIDR selects from every listed address but loopback.
        let cidrs = IpvsRenderOptions {
            common: RenderOptions {
                node_port_addresses: vec!["127.0.0.0/8".into(), "169.254.0.0/16".into()],
                ..opts.common.clone()
            },
            ..opts.clone()
        };
        assert_eq!(render(&st, &cidrs).node_port_addresses, [ip("169.254.3.3")]);
    }

    #[test]
    fn render_without_a_host_says_it_used_the_node_object() {
        let st = state(&["192.168.49.2"], vec![(node_port(svc1(Protocol::Tcp), 3001), vec![])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(rs.node_addresses_from, NodeAddressSource::NodeObject);
        assert_eq!(rs.node_port_addresses, [ip("192.168.49.2")]);
        let text = rs.to_text();
        assert!(text.contains("from the Node object here"), "{text}");
    }

    #[test]
    fn ipvsadm_listing() {
        let mut a = svc1(Protocol::Tcp);
        a.node_port = 3001;
        let b = port("ns1", "dns", "dns", Protocol::Udp, "10.20.30.10", 53);
        let c = port("ns1", "sctp", "", Protocol::Sctp, "10.20.30.11", 9000);
        let st = state(
            &["192.168.100.200"],
            vec![
                (a, vec![ep("10.180.0.1", 80, false), ep("10.180.0.10", 8080, false)]),
                (b, vec![ep("10.180.0.3", 53, false)]),
                (c, vec![]),
            ],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        let expected = "\
IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn
TCP  10.20.30.41:80 rr
  -> 10.180.0.1:80                Masq    1      0          0         
  -> 10.180.0.10:8080             Masq    1      0          0         
TCP  192.168.100.200:3001 rr
  -> 10.180.0.1:80                Masq    1      0          0         
  -> 10.180.0.10:8080             Masq    1      0          0         
UDP  10.20.30.10:53 rr
  -> 10.180.0.3:53                Masq    1      0          0         
SCTP 10.20.30.11:9000 rr
";
        assert_eq!(rs.ipvsadm_list(), expected);
    }

    #[test]
    fn ipv6_names_family_and_loopback() {
        let mut p = node_port(port("ns1", "svc1", "p80", Protocol::Tcp, "2020::1", 80), 3001);
        p.load_balancer_vips = vec![ip("2001:db8:1::5")];
        p.load_balancer_source_ranges = vec!["2001:db8:2::/64".parse().expect("cidr")];
        p.session_affinity_timeout = Some(300);
        let st = state(
            &["100.101.102.103", "2001:db8::1:1", "fe80::1"],
            vec![(p, vec![ep("1002:ab8::2:10", 80, true)])],
        );
        let rs = render(&st, &IpvsRenderOptions::default());
        assert_eq!(
            keys(&rs),
            ["TCP [2001:db8::1:1]:3001", "TCP [2001:db8:1::5]:80", "TCP [2020::1]:80"]
        );
        assert_eq!(rs.virtual_servers[0].netmask, 128);
        assert_eq!(
            rs.virtual_servers[2].ipvsadm_line(),
            "TCP  [2020::1]:80 rr persistent 300"
        );
        let names: Vec<&str> = rs.ipsets.iter().map(|s| s.name.as_str()).collect();
        assert!(names.iter().all(|n| n.starts_with("KUBE-6-")), "{names:?}");
        assert!(names.contains(&"KUBE-6-LOAD-BALANCER-SOURCE-CID"));
        let restore = rs.ipset_restore();
        assert!(restore.contains("create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536\nadd KUBE-6-CLUSTER-IP 2020::1,tcp:80\n"));
        assert!(
            restore.contains("create KUBE-6-NODE-PORT-TCP bitmap:port range 0-65535\nadd KUBE-6-NODE-PORT-TCP 3001\n")
        );
        assert!(restore.contains("add KUBE-6-LOOP-BACK 1002:ab8::2:10,tcp:80,1002:ab8::2:10\n"));
        assert!(restore.contains("add KUBE-6-LOAD-BALANCER-SOURCE-CID 2001:db8:1::5,tcp:80,2001:db8:2::/64\n"));
        assert!(rs.restore.contains("-A KUBE-SERVICES -s ::1/128 -j RETURN\n"));
        assert!(
            rs.restore
                .contains("--match-set KUBE-6-CLUSTER-IP src,dst -j KUBE-MARK-MASQ\n")
        );
        assert!(rs.restore.contains(
            "-A KUBE-IPVS-OUT-FILTER -s 2001:db8:1::5 -m ipvs --vaddr 2001:db8:1::5 --vproto tcp --vport 80 -j DROP\n"
        ));
        assert_eq!(rs.bound_addresses, [ip("2001:db8:1::5"), ip("2020::1")]);
    }

    #[test]
    fn ipset_restore_layout() {
        let st = state(&[], vec![(svc1(Protocol::Tcp), vec![ep("10.180.0.1", 80, true)])]);
        let rs = render(&st, &IpvsRenderOptions::default());
        let restore = rs.ipset_restore();
        let creates: Vec<&str> = restore.lines().filter(|l| l.starts_with("create ")).collect();
        assert_eq!(creates.len(), 17);
        assert_eq!(
            restore.lines().take(4).collect::<Vec<_>>(),
            [
                "create KUBE-LOOP-BACK hash:ip,port,ip family inet hashsize 1024 maxelem 65536",
                "add KUBE-LOOP-BACK 10.180.0.1,tcp:80,10.180.0.1",
                "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536",
                "add KUBE-CLUSTER-IP 10.20.30.41,tcp:80",
            ]
        );
        assert!(restore.ends_with(
            "create KUBE-IPVS-IPS hash:ip family inet hashsize 1024 maxelem 65536\nadd KUBE-IPVS-IPS 10.20.30.41\n"
        ));
        // Hairpin masquerade for the local endpoint.
        assert_eq!(
            chain(&rs, "nat", KUBE_POSTROUTING)[0],
            "-m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE"
        );
    }

    #[test]
    fn options_from_config() {
        use crate::config::Flags;
        let cfg = ProxyConfig::resolve(&Flags {
            proxy_mode: Some("ipvs".into()),
            ipvs_exclude_cidrs: Some(vec!["10.0.0.0/8".into(), "fd00::/8".into()]),
            ipvs_strict_arp: Some(true),
            ipvs_tcp_timeout: Some("15m".into()),
            cluster_cidr: Some("10.244.0.0/16".into()),
            masquerade_all: Some(true),
            ..Flags::default()
        })
        .expect("valid flags");
        let node = NodeInfo::default();
        let o = IpvsRenderOptions::from_config(&cfg, IpFamily::V4, &node);
        assert_eq!(o.scheduler, "rr");
        assert_eq!(o.exclude_cidrs, vec!["10.0.0.0/8".parse::<IpNet>().expect("cidr")]);
        assert!(o.strict_arp && o.common.masquerade_all);
        assert_eq!(o.common.masquerade_bit, 14);
        assert_eq!(o.tcp_timeout, Duration::from_secs(900));
        assert_eq!(o.common.local_detector, LocalDetector::Cidr("10.244.0.0/16".into()));
        let o6 = IpvsRenderOptions::from_config(&cfg, IpFamily::V6, &node);
        assert_eq!(o6.exclude_cidrs, vec!["fd00::/8".parse::<IpNet>().expect("cidr")]);
        assert_eq!(o6.common.local_detector, LocalDetector::None);

        let st = state(&[], vec![(svc1(Protocol::Tcp), vec![])]);
        let rs = render(&st, &o);
        assert!(rs.sysctls.contains(&("net/ipv4/conf/all/arp_announce", 2)));
        assert_eq!(rs.timeouts.map(|t| t.tcp), Some(Duration::from_secs(900)));
        let text = rs.to_text();
        assert!(text.contains("# IPVS timeouts: ipvsadm --set 900 0 0\n"), "{text}");
        assert!(text.contains("(--ipvs-exclude-cidrs): 10.0.0.0/8\n"), "{text}");
        assert!(
            rs.restore
                .contains("--match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ\n")
        );
    }
}
