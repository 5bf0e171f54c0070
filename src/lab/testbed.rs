//! The end-to-end test bed: a node, pods and an outside host, each in its own network
//! namespace, linked with veth pairs (never to the root namespace).
//!
//! ```text
//!                outside host ns ("out"): 192.168.49.77/24 and 192.168.49.78/24 on eth0
//!                          |  veth
//!    node ns ("node"): 192.168.49.2/24 on eth0 (the node's InternalIP)
//!                      one veth per pod: node side "veth<k>" 10.244.<k>.1/24
//!      |                 |                    |
//!  client pod ns      endpoint ns "ep1"   endpoint ns "ep2" ...
//!  10.244.9.2/24      10.244.1.2/24       10.244.2.2/24      (eth0; default via 10.244.<k>.1)
//! ```
//!
//! - outside: routes 10.96.0.0/12, 10.244.0.0/16, 198.51.100.0/24 and 203.0.113.0/24 via
//!   192.168.49.2; no forwarding.
//! - node: connected routes to every pod /24 and 192.168.49.0/24, default via 192.168.49.77
//!   (so that locally generated traffic to ClusterIPs / LB IPs finds a route before the nat
//!   table sees it, as on a real node; the outside host does not forward, so nothing loops);
//!   `net.ipv4.ip_forward=1`.
//! - every namespace: `net.ipv4.icmp_ratelimit=0` and `net.ipv4.icmp_ratemask=0` (no ICMP
//!   error is rate limited: tests count REJECTs), `rp_filter=0` (all and default), `lo` up.
//! - endpoint k (k = 1..=8, 10..=254; 9 is the client) is named `ep<k>`, has 10.244.<k>.2 and
//!   runs `BIN lab serve --name ep<k> --port 8080`.
//!
//! Namespace names are `<prefix>-<pid>-<counter>-<role>` with role `node`, `out`, `client`,
//! `ep<k>`; see [`Testbed::id`]. Dropping the bed kills every server (and, as a safety net,
//! anything else still running in its namespaces) and deletes the namespaces.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;

use super::netns::{ChildGuard, Netns, VethEnd, connect_veth};
use super::probe::{ProbeArgs, ProbeReport};

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
}

impl TestbedSpec {
    /// A spec with 3 endpoints.
    pub fn new(prefix: impl Into<String>, binary: impl Into<PathBuf>) -> TestbedSpec {
        TestbedSpec {
            prefix: prefix.into(),
            binary: binary.into(),
            endpoints: 3,
        }
    }
}

/// A pod namespace running the name server.
#[derive(Debug)]
pub struct EndpointNs {
    // Declared first: dropped (killed) before the namespace is deleted.
    server: ChildGuard,
    /// `ep<k>`, also the name the server answers with.
    pub name: String,
    /// 10.244.<k>.2
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
        pod_gateway(self.index)
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
}

fn pod_ip(k: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 244, k, 2))
}

fn pod_gateway(k: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 244, k, 1))
}

fn net(ip: IpAddr, prefix: u8) -> Result<IpNet> {
    IpNet::new(ip, prefix).with_context(|| format!("bad prefix /{prefix} for {ip}"))
}

fn quiet_icmp_and_rp(ns: &Netns) -> Result<()> {
    ns.sysctls(&[
        ("net.ipv4.icmp_ratelimit", "0"),
        ("net.ipv4.icmp_ratemask", "0"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
    ])
}

/// Creates the pod namespace for subnet k: veth `veth<k>` (node, 10.244.k.1/24) <-> `eth0`
/// (pod, 10.244.k.2/24), default route via the node.
fn pod_ns(node: &Netns, name: &str, k: u8) -> Result<Netns> {
    let ns = Netns::create(name)?;
    quiet_icmp_and_rp(&ns)?;
    connect_veth(
        VethEnd {
            ns: node,
            ifname: &format!("{POD_IFACE_PREFIX}{k}"),
            addrs: &[net(pod_gateway(k), 24)?],
        },
        VethEnd {
            ns: &ns,
            ifname: "eth0",
            addrs: &[net(pod_ip(k), 24)?],
        },
    )?;
    ns.add_default_route(pod_gateway(k))?;
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
        let node = Netns::create(&format!("{id}-node"))?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        quiet_icmp_and_rp(&node)?;
        let outside = Netns::create(&format!("{id}-out"))?;
        quiet_icmp_and_rp(&outside)?;
        connect_veth(
            VethEnd {
                ns: &node,
                ifname: "eth0",
                addrs: &[net(NODE_IP.into(), NODE_LINK_PREFIX)?],
            },
            VethEnd {
                ns: &outside,
                ifname: "eth0",
                addrs: &[
                    net(OUTSIDE_IPS[0].into(), NODE_LINK_PREFIX)?,
                    net(OUTSIDE_IPS[1].into(), NODE_LINK_PREFIX)?,
                ],
            },
        )?;
        for dest in [SERVICE_CIDR, POD_CIDR, EXTERNAL_CIDRS[0], EXTERNAL_CIDRS[1]] {
            outside.add_route(dest, NODE_IP.into())?;
        }
        node.add_default_route(OUTSIDE_IPS[0].into())?;
        let client = pod_ns(&node, &format!("{id}-client"), CLIENT_INDEX)?;
        let mut bed = Testbed {
            endpoints: Vec::new(),
            client,
            outside,
            node,
            id,
            binary: spec.binary.clone(),
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
        let ns = pod_ns(&self.node, &format!("{}-{name}", self.id), k)?;
        let server = ns
            .spawn_guarded(
                &self.binary,
                ["lab", "serve", "--name", &name, "--port", &SERVER_PORT.to_string()],
            )
            .with_context(|| format!("cannot start the server of {name}"))?;
        self.endpoints.push(EndpointNs {
            server,
            name,
            ip: pod_ip(k),
            index: k,
            ns,
        });
        Ok(self.endpoints.len() - 1)
    }

    /// Waits for the server's `ready` line, then until it answers a TCP and a UDP probe from
    /// the node (polling, bounded).
    fn wait_endpoint(&self, i: usize) -> Result<()> {
        let ep = &self.endpoints[i];
        ep.server.wait_for_log("ready ", READY_TIMEOUT)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        for args in [ProbeArgs::tcp(ep.server_addr()), ProbeArgs::udp(ep.server_addr())] {
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
        NODE_IP.into()
    }

    /// 10.244.9.2
    pub fn client_ip(&self) -> IpAddr {
        pod_ip(CLIENT_INDEX)
    }

    /// The client pod's gateway on the node (10.244.9.1, interface `veth9`).
    pub fn client_gateway(&self) -> IpAddr {
        pod_gateway(CLIENT_INDEX)
    }

    /// 192.168.49.77 and 192.168.49.78
    pub fn outside_ips(&self) -> [IpAddr; 2] {
        [OUTSIDE_IPS[0].into(), OUTSIDE_IPS[1].into()]
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

impl Drop for Testbed {
    fn drop(&mut self) {
        // Servers and endpoint namespaces first; then client, outside and node (field order).
        // Each Netns kills whatever else still runs inside it before deleting itself.
        while let Some(ep) = self.endpoints.pop() {
            drop(ep);
        }
    }
}
