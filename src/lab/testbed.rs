//! The end-to-end test bed: a node, pods and an outside host, each in its own network
//! namespace, linked with veth pairs (never to the root namespace). Dual-stack where the kernel
//! has IPv6 ([`TestbedSpec::ipv6`]): every link carries an address of each family.
//!
//! ```text
//!                outside host ns ("out"): 192.168.49.77/24, 192.168.49.78/24,
//!                                         fd00:49::77/64, fd00:49::78/64 on eth0
//!                          |  veth
//!    node ns ("node"): 192.168.49.2/24, fd00:49::2/64 on eth0 (the node's InternalIPs)
//!                      one veth per pod: node side "veth<k>" 10.244.<k>.1/24, fd00:10:244:<k>::1/64
//!      |                 |                    |
//!  client pod ns      endpoint ns "ep1"   endpoint ns "ep2" ...
//!  10.244.9.2/24      10.244.1.2/24       10.244.2.2/24      (eth0; default via 10.244.<k>.1)
//!  fd00:10:244:9::2   fd00:10:244:1::2    fd00:10:244:2::2   (/64; default via fd00:10:244:<k>::1)
//! ```
//!
//! (`<k>` in an IPv6 address is written in hex: pod 10 is fd00:10:244:a::2.)
//!
//! - outside: routes 10.96.0.0/12, 10.244.0.0/16, 198.51.100.0/24 and 203.0.113.0/24 via
//!   192.168.49.2, and fd00:10:96::/112, fd00:10:244::/48, 2001:db8:100::/64 and
//!   2001:db8:113::/64 via fd00:49::2; no forwarding.
//! - node: connected routes to every pod subnet and the outside link, default routes via
//!   192.168.49.77 and fd00:49::77 (so that locally generated traffic to ClusterIPs / LB IPs
//!   finds a route before the nat table sees it, as on a real node; the outside host does not
//!   forward, so nothing loops); `net.ipv4.ip_forward=1`, `net.ipv6.conf.all.forwarding=1`.
//! - every namespace: `net.ipv4.icmp_ratelimit=0`, `net.ipv4.icmp_ratemask=0`,
//!   `net.ipv6.icmp.ratelimit=0` and `net.ipv6.icmp.ratemask=0` (only type 0, which nobody
//!   sends: no ICMP error is rate limited, tests count REJECTs), `rp_filter=0` (all and
//!   default), no IPv6 duplicate address detection (`accept_dad=0`, so addresses work at once),
//!   `lo` up.
//! - endpoint k (k = 1..=8, 10..=254; 9 is the client) is named `ep<k>`, has 10.244.<k>.2 and
//!   fd00:10:244:<k>::2, and runs `BIN lab serve --name ep<k> --port 8080` (on `[::]`, both
//!   families).
//!
//! Namespace names are `<prefix>-<pid>-<counter>-<role>` with role `node`, `out`, `client`,
//! `ep<k>`; see [`Testbed::id`]. Dropping the bed kills every server (and, as a safety net,
//! anything else still running in its namespaces) and deletes the namespaces.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;

use super::netns::{ChildGuard, Netns, VethEnd, connect_veth};
use super::probe::{ProbeArgs, ProbeReport};
use crate::model::IpFamily;

/// The port every endpoint server listens on (TCP and UDP).
pub const SERVER_PORT: u16 = 8080;
/// The node's InternalIP.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 49, 2);
/// The outside host's two addresses.
pub const OUTSIDE_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(192, 168, 49, 77), Ipv4Addr::new(192, 168, 49, 78)];
/// The prefix length of the node <-> outside link.
pub const NODE_LINK_PREFIX: u8 = 24;
/// Pod subnet index of the client pod (10.244.9.0/24).
pub const CLIENT_INDEX: u8 = 9;
/// The cluster's pod CIDR.
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The Service ClusterIP range the outside host routes to the node.
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// External / LoadBalancer IP ranges the outside host routes to the node.
pub const EXTERNAL_CIDRS: [&str; 2] = ["198.51.100.0/24", "203.0.113.0/24"];
/// Node-side interface names are `veth<k>` (for `--pod-interface-name-prefix=veth`).
pub const POD_IFACE_PREFIX: &str = "veth";
/// The node's IPv6 InternalIP.
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x49, 0, 0, 0, 0, 0, 2);
/// The outside host's two IPv6 addresses.
pub const OUTSIDE_IPS6: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 0x49, 0, 0, 0, 0, 0, 0x77),
    Ipv6Addr::new(0xfd00, 0x49, 0, 0, 0, 0, 0, 0x78),
];
/// The prefix length of the node <-> outside link in IPv6.
pub const NODE_LINK_PREFIX6: u8 = 64;
/// The cluster's IPv6 pod CIDR (pod k has the /64 fd00:10:244:k::/64).
pub const POD_CIDR6: &str = "fd00:10:244::/48";
/// The IPv6 Service ClusterIP range the outside host routes to the node.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
/// IPv6 external / LoadBalancer IP ranges the outside host routes to the node.
pub const EXTERNAL_CIDRS6: [&str; 2] = ["2001:db8:100::/64", "2001:db8:113::/64"];
/// Both pod CIDRs, as `--cluster-cidr` takes them.
pub const CLUSTER_CIDRS: &str = "10.244.0.0/16,fd00:10:244::/48";

const READY_TIMEOUT: Duration = Duration::from_secs(10);

static BED_COUNTER: AtomicU64 = AtomicU64::new(0);

/// What to build.
#[derive(Debug, Clone)]
pub struct TestbedSpec {
    /// Start of every namespace name (e.g. `kpt`); the bed appends `-<pid>-<counter>`.
    pub prefix: String,
    /// The `kube-proxy` binary used for `lab serve` and `lab probe`.
    pub binary: PathBuf,
    /// Endpoint namespaces to create up front.
    pub endpoints: usize,
    /// Give every link an IPv6 address too (a dual-stack bed).
    pub ipv6: bool,
}

impl TestbedSpec {
    /// A spec with 3 endpoints, dual-stack where the kernel has IPv6.
    pub fn new(prefix: impl Into<String>, binary: impl Into<PathBuf>) -> TestbedSpec {
        TestbedSpec {
            prefix: prefix.into(),
            binary: binary.into(),
            endpoints: 3,
            ipv6: kernel_has_ipv6(),
        }
    }
}

/// Whether this kernel has IPv6 (not disabled at boot).
pub fn kernel_has_ipv6() -> bool {
    Path::new("/proc/net/if_inet6").exists()
}

/// A pod namespace running the name server.
#[derive(Debug)]
pub struct EndpointNs {
    // Declared first: dropped (killed) before the namespace is deleted.
    server: ChildGuard,
    /// `ep<k>`, also the name the server answers with.
    pub name: String,
    /// 10.244.<k>.2 (its IPv6 address is [`EndpointNs::ip_in`]).
    pub ip: IpAddr,
    /// The subnet index k.
    pub index: u8,
    pub ns: Netns,
}

impl EndpointNs {
    /// `ip:port`.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip, port)
    }

    /// The server's address (`ip:8080`).
    pub fn server_addr(&self) -> SocketAddr {
        self.addr(SERVER_PORT)
    }

    /// The node-side gateway (10.244.<k>.1).
    pub fn gateway(&self) -> IpAddr {
        pod_gateway(IpFamily::V4, self.index)
    }

    /// Its address in `family`: 10.244.<k>.2 or fd00:10:244:<k>::2.
    pub fn ip_in(&self, family: IpFamily) -> IpAddr {
        pod_ip(family, self.index)
    }

    /// The server's address (`ip:8080`) in `family`.
    pub fn server_addr_in(&self, family: IpFamily) -> SocketAddr {
        SocketAddr::new(self.ip_in(family), SERVER_PORT)
    }

    /// The node-side gateway in `family` (10.244.<k>.1 or fd00:10:244:<k>::1).
    pub fn gateway_in(&self, family: IpFamily) -> IpAddr {
        pod_gateway(family, self.index)
    }

    /// The node-side interface name (`veth<k>`).
    pub fn node_iface(&self) -> String {
        format!("{POD_IFACE_PREFIX}{}", self.index)
    }

    /// The server process (its log, pid).
    pub fn server(&self) -> &ChildGuard {
        &self.server
    }
}

/// A built bed. Drop tears everything down.
#[derive(Debug)]
pub struct Testbed {
    // Drop order matters: endpoints (servers, then their namespaces) first.
    endpoints: Vec<EndpointNs>,
    pub client: Netns,
    pub outside: Netns,
    pub node: Netns,
    id: String,
    binary: PathBuf,
    ipv6: bool,
}

/// Pod k's address in `family` (the last part is 2; 1 is the node's side).
fn pod_addr(family: IpFamily, k: u8, last: u8) -> IpAddr {
    match family {
        IpFamily::V4 => Ipv4Addr::new(10, 244, k, last).into(),
        IpFamily::V6 => Ipv6Addr::new(0xfd00, 0x10, 0x244, k.into(), 0, 0, 0, last.into()).into(),
    }
}

fn pod_ip(family: IpFamily, k: u8) -> IpAddr {
    pod_addr(family, k, 2)
}

fn pod_gateway(family: IpFamily, k: u8) -> IpAddr {
    pod_addr(family, k, 1)
}

/// The prefix length of a pod's link.
fn pod_prefix(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => 24,
        IpFamily::V6 => 64,
    }
}

fn net(ip: IpAddr, prefix: u8) -> Result<IpNet> {
    IpNet::new(ip, prefix).with_context(|| format!("bad prefix /{prefix} for {ip}"))
}

/// The sysctls every namespace of the bed gets, before any of its links exists (the IPv6
/// `default` values apply to links created later).
fn quiet_icmp_and_rp(ns: &Netns, ipv6: bool) -> Result<()> {
    let mut pairs = vec![
        ("net.ipv4.icmp_ratelimit", "0"),
        ("net.ipv4.icmp_ratemask", "0"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
    ];
    if ipv6 {
        pairs.extend([
            ("net.ipv6.conf.all.disable_ipv6", "0"),
            ("net.ipv6.conf.default.disable_ipv6", "0"),
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
            ("net.ipv6.icmp.ratelimit", "0"),
            // A bitmap of ICMPv6 types subject to the global limit: type 0 only (reserved).
            ("net.ipv6.icmp.ratemask", "0"),
        ]);
    }
    ns.sysctls(&pairs)
}

/// The families the bed gives addresses in.
fn families(ipv6: bool) -> &'static [IpFamily] {
    if ipv6 {
        &[IpFamily::V4, IpFamily::V6]
    } else {
        &[IpFamily::V4]
    }
}

/// Creates the pod namespace for subnet k: veth `veth<k>` (node, 10.244.k.1/24 and
/// fd00:10:244:k::1/64) <-> `eth0` (pod, 10.244.k.2/24 and fd00:10:244:k::2/64), default
/// routes via the node.
fn pod_ns(node: &Netns, name: &str, k: u8, ipv6: bool) -> Result<Netns> {
    let ns = Netns::create(name)?;
    quiet_icmp_and_rp(&ns, ipv6)?;
    let on = |addr: fn(IpFamily, u8) -> IpAddr| -> Result<Vec<IpNet>> {
        families(ipv6).iter().map(|&f| net(addr(f, k), pod_prefix(f))).collect()
    };
    connect_veth(
        VethEnd {
            ns: node,
            ifname: &format!("{POD_IFACE_PREFIX}{k}"),
            addrs: &on(pod_gateway)?,
        },
        VethEnd {
            ns: &ns,
            ifname: "eth0",
            addrs: &on(pod_ip)?,
        },
    )?;
    for &f in families(ipv6) {
        ns.add_default_route(pod_gateway(f, k))?;
    }
    Ok(ns)
}

impl Testbed {
    /// Builds the topology, starts a server in each endpoint namespace and waits until every
    /// server answers (a TCP and a UDP probe from the node).
    pub fn build(spec: &TestbedSpec) -> Result<Testbed> {
        if spec.prefix.is_empty() || spec.prefix.contains(['/', ' ']) {
            bail!("invalid namespace prefix {:?}", spec.prefix);
        }
        if !spec.binary.is_file() {
            bail!("the kube-proxy binary {} does not exist", spec.binary.display());
        }
        let id = format!(
            "{}-{}-{}",
            spec.prefix,
            std::process::id(),
            BED_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let ipv6 = spec.ipv6;
        let node = Netns::create(&format!("{id}-node"))?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        if ipv6 {
            node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        }
        quiet_icmp_and_rp(&node, ipv6)?;
        let outside = Netns::create(&format!("{id}-out"))?;
        quiet_icmp_and_rp(&outside, ipv6)?;
        let (mut node_addrs, mut outside_addrs) = (Vec::new(), Vec::new());
        for &f in families(ipv6) {
            let link = link_plan(f);
            node_addrs.push(net(link.node, link.prefix)?);
            for ip in link.outside {
                outside_addrs.push(net(ip, link.prefix)?);
            }
        }
        connect_veth(
            VethEnd {
                ns: &node,
                ifname: "eth0",
                addrs: &node_addrs,
            },
            VethEnd {
                ns: &outside,
                ifname: "eth0",
                addrs: &outside_addrs,
            },
        )?;
        for &f in families(ipv6) {
            let link = link_plan(f);
            for dest in link.routed {
                outside.add_route(dest, link.node)?;
            }
            node.add_default_route(link.outside[0])?;
        }
        let client = pod_ns(&node, &format!("{id}-client"), CLIENT_INDEX, ipv6)?;
        let mut bed = Testbed {
            endpoints: Vec::new(),
            client,
            outside,
            node,
            id,
            binary: spec.binary.clone(),
            ipv6,
        };
        // Start every server first, then wait for them all.
        for _ in 0..spec.endpoints {
            bed.start_endpoint()?;
        }
        for i in 0..bed.endpoints.len() {
            bed.wait_endpoint(i)?;
        }
        Ok(bed)
    }

    fn next_index(&self) -> Result<u8> {
        let mut k: u8 = self.endpoints.iter().map(|e| e.index).max().unwrap_or(0);
        loop {
            k = k
                .checked_add(1)
                .filter(|k| *k < 255)
                .context("no pod subnet left (10.244.1-254.0/24)")?;
            if k != CLIENT_INDEX {
                return Ok(k);
            }
        }
    }

    fn start_endpoint(&mut self) -> Result<usize> {
        let k = self.next_index()?;
        let name = format!("ep{k}");
        let ns = pod_ns(&self.node, &format!("{}-{name}", self.id), k, self.ipv6)?;
        let server = ns
            .spawn_guarded(
                &self.binary,
                ["lab", "serve", "--name", &name, "--port", &SERVER_PORT.to_string()],
            )
            .with_context(|| format!("cannot start the server of {name}"))?;
        self.endpoints.push(EndpointNs {
            server,
            name,
            ip: pod_ip(IpFamily::V4, k),
            index: k,
            ns,
        });
        Ok(self.endpoints.len() - 1)
    }

    /// Waits for the server's `ready` line, then until it answers a TCP and a UDP probe from
    /// the node in each family (polling, bounded).
    fn wait_endpoint(&self, i: usize) -> Result<()> {
        let ep = &self.endpoints[i];
        ep.server.wait_for_log("ready ", READY_TIMEOUT)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let probes = families(self.ipv6).iter().flat_map(|&f| {
            let to = ep.server_addr_in(f);
            [ProbeArgs::tcp(to), ProbeArgs::udp(to)]
        });
        for args in probes {
            loop {
                let report = self.probe(&self.node, &args.clone().with_timeout_ms(500))?;
                if report.all_ok() && report.names().contains_key(&ep.name) {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!(
                        "the server of {} does not answer {:?} from the node: {report:?}; its output:\n{}",
                        ep.name,
                        args.protocol,
                        ep.server.log()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Adds an endpoint namespace (next free subnet index k, IP 10.244.k.2, name `ep<k>`) with
    /// its server started and answering.
    pub fn add_endpoint(&mut self) -> Result<&EndpointNs> {
        let i = self.start_endpoint()?;
        if let Err(e) = self.wait_endpoint(i) {
            self.endpoints.pop();
            return Err(e);
        }
        Ok(&self.endpoints[i])
    }

    /// Removes an endpoint namespace by name (kills its server, deletes the namespace).
    pub fn remove_endpoint(&mut self, name: &str) -> Result<()> {
        let i = self
            .endpoints
            .iter()
            .position(|e| e.name == name)
            .with_context(|| format!("no endpoint named {name}"))?;
        drop(self.endpoints.remove(i));
        Ok(())
    }

    /// The i-th endpoint (0-based, in creation order). Panics when out of range.
    pub fn endpoint(&self, i: usize) -> &EndpointNs {
        &self.endpoints[i]
    }

    pub fn endpoints(&self) -> &[EndpointNs] {
        &self.endpoints
    }

    /// 192.168.49.2
    pub fn node_ip(&self) -> IpAddr {
        self.node_ip_in(IpFamily::V4)
    }

    /// 10.244.9.2
    pub fn client_ip(&self) -> IpAddr {
        self.client_ip_in(IpFamily::V4)
    }

    /// The client pod's gateway on the node (10.244.9.1, interface `veth9`).
    pub fn client_gateway(&self) -> IpAddr {
        pod_gateway(IpFamily::V4, CLIENT_INDEX)
    }

    /// 192.168.49.77 and 192.168.49.78
    pub fn outside_ips(&self) -> [IpAddr; 2] {
        self.outside_ips_in(IpFamily::V4)
    }

    /// Whether the bed has IPv6 addresses too.
    pub fn has_ipv6(&self) -> bool {
        self.ipv6
    }

    /// The node's InternalIP in `family` (192.168.49.2 or fd00:49::2).
    pub fn node_ip_in(&self, family: IpFamily) -> IpAddr {
        link_plan(family).node
    }

    /// The client pod's address in `family` (10.244.9.2 or fd00:10:244:9::2).
    pub fn client_ip_in(&self, family: IpFamily) -> IpAddr {
        pod_ip(family, CLIENT_INDEX)
    }

    /// The outside host's addresses in `family`.
    pub fn outside_ips_in(&self, family: IpFamily) -> [IpAddr; 2] {
        link_plan(family).outside
    }

    /// The unique start of every namespace name of this bed (`<prefix>-<pid>-<counter>`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The names of all its namespaces now.
    pub fn namespace_names(&self) -> Vec<String> {
        let mut v: Vec<String> = [&self.node, &self.outside, &self.client]
            .iter()
            .map(|n| n.name().to_string())
            .collect();
        v.extend(self.endpoints.iter().map(|e| e.ns.name().to_string()));
        v
    }

    /// The binary used for `lab serve` / `lab probe`.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// Runs `BIN lab probe ARGS` inside `ns` and parses its JSON report.
    pub fn probe(&self, ns: &Netns, args: &ProbeArgs) -> Result<ProbeReport> {
        let mut argv = vec!["lab".to_string(), "probe".to_string()];
        argv.extend(args.to_args());
        let out = ns.exec(&self.binary, &argv)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "`{} {}` in {} failed ({}): {}",
                self.binary.display(),
                argv.join(" "),
                ns.name(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        serde_json::from_str(stdout.trim())
            .with_context(|| format!("cannot parse the probe report from {}: {stdout:?}", ns.name()))
    }

    /// Starts a process (the daemon) inside the node namespace; the guard kills it on Drop.
    pub fn spawn_in_node(&self, program: &Path, args: &[String]) -> Result<ChildGuard> {
        self.spawn_in(&self.node, program, args)
    }

    /// Starts a process inside any namespace of the bed; the guard kills it on Drop.
    pub fn spawn_in(&self, ns: &Netns, program: &Path, args: &[String]) -> Result<ChildGuard> {
        ns.spawn_guarded(program, args)
    }
}

/// The node <-> outside link of one family, and what the outside host routes to the node.
struct LinkPlan {
    node: IpAddr,
    outside: [IpAddr; 2],
    prefix: u8,
    routed: [&'static str; 4],
}

fn link_plan(family: IpFamily) -> LinkPlan {
    match family {
        IpFamily::V4 => LinkPlan {
            node: NODE_IP.into(),
            outside: OUTSIDE_IPS.map(IpAddr::V4),
            prefix: NODE_LINK_PREFIX,
            routed: [SERVICE_CIDR, POD_CIDR, EXTERNAL_CIDRS[0], EXTERNAL_CIDRS[1]],
        },
        IpFamily::V6 => LinkPlan {
            node: NODE_IP6.into(),
            outside: OUTSIDE_IPS6.map(IpAddr::V6),
            prefix: NODE_LINK_PREFIX6,
            routed: [SERVICE_CIDR6, POD_CIDR6, EXTERNAL_CIDRS6[0], EXTERNAL_CIDRS6[1]],
        },
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Servers and endpoint namespaces first; then client, outside and node (field order).
        // Each Netns kills whatever else still runs inside it before deleting itself.
        while let Some(ep) = self.endpoints.pop() {
            drop(ep);
        }
    }
}
