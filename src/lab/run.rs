//! `kube-proxy lab`: builds a throw-away node, client pod, outside host and three endpoints in
//! network namespaces, runs the real daemon on its own manifests, and reproduces the seed
//! experiment as a readable report, in iptables, nftables or IPVS mode. It never touches the
//! root namespace, and removes everything it created on exit and on Ctrl-C.
//!
//! IPVS mode needs a kernel with IPVS; on one without, the whole lab runs in a VM instead
//! (`relay.rs`). Its report shows what an IPVS operator looks at (`ipvsadm`, `kube-ipvs0`)
//! and says where IPVS behaves differently from iptables mode.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::ipvs;
use super::netns::ChildGuard;
use super::probe::{ProbeArgs, ProbeReport};
use super::scenario::{Ep, ServiceSpec, manifests};
use super::testbed::{Testbed, TestbedSpec};
use crate::config::ProxyMode;
use crate::iptables::names::{self, ServicePortChains};

const PREFIX: &str = "kplab";
const CLUSTER_IP: &str = "10.96.165.10";
const NODE_PORT: u16 = 32517;
const SERVICE: &str = "default/web:p";
/// How long the report waits for the daemon to program a change. Generous: in the VM (TCG)
/// a sync takes seconds; the report prints how long it really took.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the lab, printing the report to stdout. Ctrl-C or SIGTERM stops it and cleans up.
///
/// `args` are the lab's own arguments (after the program name): in IPVS mode on a kernel
/// without IPVS, `binary` runs again with them in the VM, and its exit code is returned.
pub fn main(binary: PathBuf, mode: ProxyMode, connections: u32, args: &[String]) -> Result<ExitCode> {
    if mode == ProxyMode::Ipvs && !kernel_has_ipvs() {
        return super::relay::relay(&binary, args);
    }
    preflight(mode)?;
    let dir = std::env::temp_dir().join(format!("kube-proxy-lab-{}", std::process::id()));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let worker_dir = dir.clone();
    let worker = std::thread::spawn(move || {
        let result = run(&binary, mode, &worker_dir, connections, &mut std::io::stdout());
        let _ = done_tx.send(result);
    });
    match wait_or_signal(done_rx)? {
        Some(result) => {
            let _ = worker.join();
            let _ = std::fs::remove_dir_all(&dir);
            result.unwrap_or_else(|_| bail!("the lab stopped unexpectedly"))?;
            Ok(ExitCode::SUCCESS)
        }
        None => {
            eprintln!("\ninterrupted: removing the lab's namespaces and processes");
            emergency_cleanup();
            let _ = std::fs::remove_dir_all(&dir);
            bail!("interrupted")
        }
    }
}

/// Waits for `done`, or for Ctrl-C or SIGTERM: `None` when a signal came first (the work goes
/// on; the caller stops it).
pub(super) fn wait_or_signal<T>(
    done: tokio::sync::oneshot::Receiver<T>,
) -> Result<Option<Result<T, tokio::sync::oneshot::error::RecvError>>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting signal handling")?;
    Ok(runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            r = done => Some(r),
            _ = tokio::signal::ctrl_c() => None,
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => None,
        }
    }))
}

/// Whether this kernel has IPVS: loaded, or loadable with `modprobe ip_vs` (which loads it;
/// /proc/net/ip_vs appears in every namespace then).
fn kernel_has_ipvs() -> bool {
    let present = || Path::new("/proc/net/ip_vs").exists();
    if present() {
        return true;
    }
    let loaded = Command::new("modprobe")
        .arg("ip_vs")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    loaded && present()
}

/// The tools the lab in `mode` runs that are not installed, as `tool (package P)`. Looked up
/// on PATH rather than run, so that the check also holds on the machine that boots the VM.
pub(super) fn missing_tools(mode: ProxyMode) -> Vec<String> {
    let mut tools = vec![
        ("ip", "iproute2"),
        ("iptables", "iptables"),
        ("iptables-save", "iptables"),
        ("iptables-restore", "iptables"),
    ];
    match mode {
        ProxyMode::Nftables => tools.push(("nft", "nftables")),
        // The daemon needs ipset (it refuses to start without); the report lists with ipvsadm.
        ProxyMode::Ipvs => tools.extend([("ipset", "ipset"), ("ipvsadm", "ipvsadm")]),
        ProxyMode::Iptables => {}
    }
    tools
        .into_iter()
        .filter(|(tool, _)| crate::vm::find_program(tool).is_none())
        .map(|(tool, package)| format!("{tool} (package {package})"))
        .collect()
}

/// Everything the lab needs, with a message that says how to get it.
fn preflight(mode: ProxyMode) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the lab creates network namespaces and must run as root (e.g. sudo kube-proxy lab)");
    }
    let missing = missing_tools(mode);
    if !missing.is_empty() {
        bail!(
            "missing tools: {}; on Debian/Ubuntu: apt-get install -y iproute2 iptables nftables ipset ipvsadm conntrack",
            missing.join(", ")
        );
    }
    Ok(())
}

/// After Ctrl-C the worker's destructors do not run: find our namespaces by name and remove
/// them (killing what runs inside first).
fn emergency_cleanup() {
    let mine = format!("{PREFIX}-{}-", std::process::id());
    let listed = Command::new("ip").args(["netns", "list"]).output();
    let Ok(listed) = listed else { return };
    for line in String::from_utf8_lossy(&listed.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if !name.starts_with(&mine) {
            continue;
        }
        if let Ok(pids) = Command::new("ip").args(["netns", "pids", name]).output() {
            for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "delete", name]).status();
    }
}

fn web(eps: &[Ep]) -> String {
    let mut svc = ServiceSpec::new("web", CLUSTER_IP, eps);
    svc.node_port = Some(NODE_PORT);
    manifests(&[svc])
}

fn write_manifests(dir: &Path, yaml: &str) -> Result<()> {
    let tmp = dir.join(".web.yaml.tmp");
    std::fs::write(&tmp, yaml).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join("web.yaml")).context("replacing the manifests")?;
    Ok(())
}

fn poll(timeout: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if check() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn run<W: Write>(binary: &Path, mode: ProxyMode, dir: &Path, connections: u32, out: &mut W) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    writeln!(
        out,
        "kube-proxy lab: {} mode on kernel {}, everything in network namespaces named {PREFIX}-{}-*\n",
        mode.as_str(),
        kernel.trim(),
        std::process::id()
    )?;
    let bed = build_testbed(binary, out)?;
    write_manifests(dir, &web(&endpoints_of(&bed)))?;
    let daemon = start_daemon(&bed, binary, mode, dir, out)?;

    let mut lab = Lab {
        bed,
        binary,
        mode,
        dir,
        out,
        cip: format!("{CLUSTER_IP}:80").parse()?,
        chains: names::service_port_chains(SERVICE, "tcp"),
        nft: mode == ProxyMode::Nftables,
    };
    lab.show_the_service()?;
    lab.connect(connections)?;
    lab.scale_up()?;
    lab.scale_to_zero()?;
    lab.node_port()?;
    lab.connection_table()?;

    let Lab { bed, out, .. } = lab;
    let id = bed.id().to_string();
    drop(daemon);
    drop(bed);
    // Checked, not assumed: the report's last line is a promise.
    let left = leftover_namespaces(&id)?;
    if !left.is_empty() {
        bail!("namespaces of the lab left behind: {}", left.join(", "));
    }
    writeln!(
        out,
        "\nDone: the namespaces and processes of the lab are removed (`ip netns list` shows none named {id}-*)."
    )?;
    Ok(())
}

/// The test bed: a node, a client pod, an outside host and three endpoints.
fn build_testbed(binary: &Path, out: &mut impl Write) -> Result<Testbed> {
    let t = Instant::now();
    let mut spec = TestbedSpec::new(PREFIX, binary);
    spec.endpoints = 3;
    let bed = Testbed::build(&spec)?;
    writeln!(
        out,
        "Test bed ready in {}: node {} (pods on 10.244.<k>.0/24), client pod {}, outside host {}, endpoints {}",
        ms(t.elapsed()),
        bed.node_ip(),
        bed.client_ip(),
        bed.outside_ips()[0],
        bed.endpoints()
            .iter()
            .map(|e| format!("{} {}", e.name, e.ip))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    Ok(bed)
}

/// The test bed's endpoints as the manifests list them.
fn endpoints_of(bed: &Testbed) -> Vec<Ep> {
    bed.endpoints().iter().map(|e| Ep::local(e.ip)).collect()
}

/// Starts the daemon in the node namespace on the manifests in `dir`, and waits for its
/// first sync.
fn start_daemon(bed: &Testbed, binary: &Path, mode: ProxyMode, dir: &Path, out: &mut impl Write) -> Result<ChildGuard> {
    // IPVS mode has its own sync periods; nftables mode uses iptables mode's, as upstream.
    let periods = if mode == ProxyMode::Ipvs { "ipvs" } else { "iptables" };
    let args: Vec<String> = vec![
        "--hostname-override=node-a".to_string(),
        "--cluster-cidr=10.244.0.0/16".to_string(),
        format!("--{periods}-min-sync-period=0s"),
        format!("--{periods}-sync-period=5s"),
        format!("--proxy-mode={}", mode.as_str()),
        "--manifests".to_string(),
        dir.display().to_string(),
    ];
    let t = Instant::now();
    let daemon: ChildGuard = bed.spawn_in_node(binary, &args)?;
    daemon
        .wait_for_log("Synced rules", Duration::from_secs(60))
        .context("the daemon's first sync")?;
    writeln!(
        out,
        "kube-proxy started in the node namespace with --manifests {}: first sync after {}\n",
        dir.display(),
        ms(t.elapsed())
    )?;
    Ok(daemon)
}

/// The lab while the daemon runs: the test bed, where the manifests are, and the report.
struct Lab<'a, W: Write> {
    bed: Testbed,
    /// This binary: the daemon, and `explain`.
    binary: &'a Path,
    mode: ProxyMode,
    /// The daemon's `--manifests` directory.
    dir: &'a Path,
    out: &'a mut W,
    /// The Service's ClusterIP and port.
    cip: SocketAddr,
    /// The Service's iptables chains.
    chains: ServicePortChains,
    nft: bool,
}

impl<W: Write> Lab<'_, W> {
    fn ipvs(&self) -> bool {
        self.mode == ProxyMode::Ipvs
    }

    /// The Service's rules (or virtual server) as the mode's own tool lists them.
    fn show_rules(&mut self) -> Result<()> {
        if self.ipvs() {
            for l in ipvs::virtual_server(&self.bed, self.cip)? {
                writeln!(self.out, "   {l}")?;
            }
            Ok(())
        } else {
            show_service(self.out, &self.bed, self.nft, &self.chains.cluster)
        }
    }

    /// What `kube-proxy explain` says of the Service now, run in the node namespace with the
    /// daemon's flags (its desired state from the daemon's `/debug/services`), indented.
    fn explain(&mut self) -> Result<()> {
        let args = [
            "explain".to_string(),
            "default/web".into(),
            "--hostname-override=node-a".into(),
            "--cluster-cidr=10.244.0.0/16".into(),
            format!("--proxy-mode={}", self.mode.as_str()),
        ];
        let out = self.bed.node.exec(self.binary, &args)?;
        let code = out.status.code().map_or("a signal".to_string(), |c| c.to_string());
        writeln!(self.out, "   $ kube-proxy explain default/web   (exit status {code})")?;
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            writeln!(self.out, "   | {l}")?;
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !stderr.trim().is_empty() {
            writeln!(self.out, "   (stderr: {})", stderr.trim())?;
        }
        Ok(())
    }

    /// Step 1: the Service as the daemon programmed it.
    fn show_the_service(&mut self) -> Result<()> {
        let source = match self.mode {
            ProxyMode::Nftables => "nft list table ip kube-proxy".to_string(),
            ProxyMode::Iptables => format!("{} -t nat", save_tool()),
            ProxyMode::Ipvs => "ipvsadm -Ln".to_string(),
        };
        let what = if self.ipvs() { "virtual server" } else { "chains" };
        writeln!(
            self.out,
            "1. The {what} of Service {SERVICE} (ClusterIP {CLUSTER_IP}:80, NodePort {NODE_PORT}), from {source}"
        )?;
        if self.ipvs() {
            show_ipvs_service(self.out, &self.bed, self.cip)
        } else {
            show_service(self.out, &self.bed, self.nft, &self.chains.cluster)
        }
    }

    /// Step 2: how new connections spread over the endpoints.
    fn connect(&mut self, connections: u32) -> Result<()> {
        let cip = self.cip;
        writeln!(
            self.out,
            "\n2. {connections} new TCP connections from the client pod to {cip}"
        )?;
        let report = self
            .bed
            .probe(&self.bed.client, &ProbeArgs::tcp(cip).with_count(connections))?;
        print_distribution(self.out, &report, connections)?;
        if self.ipvs() {
            print_turns(self.out, &report, self.bed.endpoints().len())?;
        }
        Ok(())
    }

    /// Step 3: a fourth endpoint, how soon it is live, and its share of new connections.
    fn scale_up(&mut self) -> Result<()> {
        let (mode, cip) = (self.mode, self.cip);
        writeln!(self.out, "\n3. Scale to 4 endpoints")?;
        let new = self.bed.add_endpoint()?;
        let (new_name, new_addr) = (new.name.clone(), new.server_addr());
        let sep = names::endpoint_chain(SERVICE, "tcp", &new_addr.to_string());
        let changed = Instant::now();
        write_manifests(self.dir, &web(&endpoints_of(&self.bed)))?;
        let live = poll(CHANGE_TIMEOUT, || serving(&self.bed, mode, cip, new_addr));
        let what = match mode {
            ProxyMode::Nftables => format!("its share of the numbers ({} . {})", new_addr.ip(), new_addr.port()),
            ProxyMode::Iptables => format!("{sep} (DNAT to {new_addr})"),
            ProxyMode::Ipvs => format!("real server {new_addr} (Masq, weight 1)"),
        };
        match live {
            Some(_) => writeln!(
                self.out,
                "   manifest changed -> {what} live after {}",
                ms(changed.elapsed())
            )?,
            None => writeln!(
                self.out,
                "   the new endpoint's {} did not appear within {CHANGE_TIMEOUT:?}",
                if self.ipvs() { "real server" } else { "chain" }
            )?,
        }
        self.show_rules()?;
        let report = self.bed.probe(&self.bed.client, &ProbeArgs::tcp(cip).with_count(100))?;
        writeln!(self.out, "   100 new connections: {}", summary(&report))?;
        if !report.names().contains_key(&new_name) {
            writeln!(self.out, "   (the new endpoint {new_name} got none of them)")?;
        }
        if self.ipvs() {
            writeln!(
                self.out,
                "   rr splits them exactly; the real servers already there are not touched (iptables mode rewrites the Service's chain with new probabilities)"
            )?;
        }
        self.explain()
    }

    /// Step 4: no endpoints, and what a client then gets.
    fn scale_to_zero(&mut self) -> Result<()> {
        let cip = self.cip;
        writeln!(self.out, "\n4. Scale to 0 endpoints")?;
        write_manifests(self.dir, &web(&[]))?;
        let bed = &self.bed;
        match self.mode {
            ProxyMode::Nftables => {
                // The ClusterIP's element in `reject-services`, which `service-endpoints-check`
                // rejects by.
                let key = format!("{CLUSTER_IP} . tcp . 80");
                let has_reject =
                    || set_elements(&rules(bed, true).unwrap_or_default(), "reject-services").contains(&key);
                if poll(CHANGE_TIMEOUT, has_reject).is_some() {
                    let listing = rules(bed, true)?;
                    for l in listing.lines().filter(|l| l.contains("@reject-services")) {
                        writeln!(self.out, "   nft: {}", l.trim())?;
                    }
                    writeln!(
                        self.out,
                        "   nft: set reject-services {{ {} }}",
                        set_elements(&listing, "reject-services")
                    )?;
                }
            }
            ProxyMode::Iptables => {
                let reject = format!("{SERVICE} has no endpoints");
                let filter = || bed.node.exec_ok(save_tool(), ["-t", "filter"]).unwrap_or_default();
                if poll(CHANGE_TIMEOUT, || filter().contains(&reject)).is_some() {
                    for l in filter().lines().filter(|l| l.contains(&reject)) {
                        writeln!(self.out, "   filter: {l}")?;
                    }
                }
            }
            ProxyMode::Ipvs => show_ipvs_no_endpoints(self.out, bed, cip)?,
        }
        let report = bed.probe(&bed.client, &ProbeArgs::tcp(cip).with_count(3).with_timeout_ms(2000))?;
        for a in &report.attempts {
            writeln!(
                self.out,
                "   connect {cip}: {} after {:.1} ms",
                a.error.as_deref().unwrap_or("answered"),
                a.elapsed_us as f64 / 1000.0
            )?;
        }
        if self.ipvs() {
            writeln!(
                self.out,
                "   no REJECT rule here: with no real server to schedule, IPVS itself answers ICMP port unreachable (iptables mode rejects in the filter table)"
            )?;
        }
        self.explain()
    }

    /// Step 5: the endpoints back, and the NodePort from the outside host.
    fn node_port(&mut self) -> Result<()> {
        let (mode, cip, nft) = (self.mode, self.cip, self.nft);
        writeln!(self.out, "\n5. The NodePort from the outside host")?;
        write_manifests(self.dir, &web(&endpoints_of(&self.bed)))?;
        let first = self.bed.endpoint(0).server_addr();
        poll(CHANGE_TIMEOUT, || serving(&self.bed, mode, cip, first));
        if self.ipvs() {
            show_ipvs_node_port(self.out, &self.bed)?;
        } else {
            let n = rules(&self.bed, nft)?;
            let external = if nft {
                "external-".to_string()
            } else {
                format!("-A {} ", self.chains.external)
            };
            for l in n.lines().filter(|l| {
                l.starts_with("-A KUBE-NODEPORTS")
                    || l.contains(&external)
                    || (nft && l.contains(&NODE_PORT.to_string()))
            }) {
                writeln!(self.out, "   {}", l.trim())?;
            }
        }
        let bed = &self.bed;
        let outside = bed.outside_ips()[0];
        let np = SocketAddr::new(bed.node_ip(), NODE_PORT);
        let report = bed.probe(&bed.outside, &ProbeArgs::tcp(np).with_bind(outside).with_count(10))?;
        let seen: Vec<String> = report.seen_sources().iter().map(ToString::to_string).collect();
        writeln!(
            self.out,
            "   10 connections from {outside} to {np}: {}",
            summary(&report)
        )?;
        writeln!(
            self.out,
            "   the endpoints saw the client as {} (the node's address: masqueraded, externalTrafficPolicy Cluster)",
            seen.join(", ")
        )?;
        Ok(())
    }

    /// Step 6: IPVS's connection table, or conntrack's DNAT mappings.
    fn connection_table(&mut self) -> Result<()> {
        if self.ipvs() {
            writeln!(
                self.out,
                "\n6. A few entries of IPVS's own connection table in the node namespace (ipvsadm -Lnc)"
            )?;
            for l in ipvs::connections(&self.bed, self.cip, 4)? {
                writeln!(self.out, "   {l}")?;
            }
            writeln!(
                self.out,
                "   IPVS keeps its own table (which connection went to which real server, and TIME_WAIT for 2 min); with net.ipv4.vs.conntrack=1 conntrack tracks them too, for the masquerade"
            )?;
            return Ok(());
        }
        writeln!(
            self.out,
            "\n6. A few conntrack entries in the node namespace (the DNAT mapping)"
        )?;
        match self
            .bed
            .node
            .exec("conntrack", ["-L", "-p", "tcp", "--orig-dst", CLUSTER_IP])
        {
            Ok(o) if o.status.success() => {
                for l in String::from_utf8_lossy(&o.stdout).lines().take(4) {
                    writeln!(self.out, "   {l}")?;
                }
            }
            _ => writeln!(
                self.out,
                "   (conntrack is not installed: apt-get install -y conntrack)"
            )?,
        }
        Ok(())
    }
}

/// The lab's namespaces that still exist (`ip netns list`, names starting with `id-`).
fn leftover_namespaces(id: &str) -> Result<Vec<String>> {
    let listed = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .context("running `ip netns list`")?;
    let prefix = format!("{id}-");
    Ok(String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&prefix))
        .map(str::to_string)
        .collect())
}

/// Whether the mode's dataplane sends new connections to `ep` now: its DNAT is in the rules
/// (iptables, nftables), or it is a real server with a weight (IPVS; weight 0 takes none).
fn serving(bed: &Testbed, mode: ProxyMode, vip: SocketAddr, ep: SocketAddr) -> bool {
    match mode {
        ProxyMode::Ipvs => ipvs::real_servers(bed, vip).is_ok_and(|rs| rs.iter().any(|r| r.addr == ep && r.weight > 0)),
        // An element `NUMBERS : IP . PORT` of a `service-endpoints-…` map.
        ProxyMode::Nftables => rules(bed, true).is_ok_and(|n| n.contains(&format!(": {} . {}", ep.ip(), ep.port()))),
        ProxyMode::Iptables => rules(bed, false).is_ok_and(|n| n.contains(&ep.to_string())),
    }
}

/// Section 1 in IPVS mode: the virtual server, the address on `kube-ipvs0`, the sysctls.
fn show_ipvs_service(out: &mut impl Write, bed: &Testbed, vip: SocketAddr) -> Result<()> {
    for l in ipvs::virtual_server(bed, vip)? {
        writeln!(out, "   {l}")?;
    }
    match ipvs::dummy_address(bed, CLUSTER_IP)? {
        Some(l) => writeln!(out, "   ip addr: {l}")?,
        None => writeln!(out, "   ip addr: {CLUSTER_IP} is NOT on kube-ipvs0")?,
    }
    writeln!(
        out,
        "   sysctls in the node's namespace: {}",
        ipvs::sysctls(bed)?.join(" ")
    )?;
    writeln!(
        out,
        "   No per-endpoint rule: the endpoints are the real servers of a virtual server in the kernel's IPVS table (Masq: DNAT), and the scheduler (rr) picks one per new connection. The ClusterIP sits on the dummy link kube-ipvs0 (left down) so that the node takes its packets in; iptables only marks what needs masquerading."
    )?;
    Ok(())
}

/// Section 2 in IPVS mode: whether rr took the endpoints in turn.
fn print_turns(out: &mut impl Write, report: &ProbeReport, endpoints: usize) -> Result<()> {
    let names: Vec<&str> = report.attempts.iter().filter_map(|a| a.name.as_deref()).collect();
    let head: Vec<&str> = names.iter().take(2 * endpoints).copied().collect();
    writeln!(out, "   the first answers in order: {} ...", head.join(" "))?;
    if ipvs::in_turn(&names, endpoints) {
        writeln!(
            out,
            "   rr: every connection went to the next endpoint in turn, so the split is exact (iptables mode picks each endpoint at random)"
        )?;
    } else {
        writeln!(
            out,
            "   NOT in strict turn: rr should take the {endpoints} endpoints one after another"
        )?;
    }
    Ok(())
}

/// Section 4 in IPVS mode: waits until no real server takes new connections, then shows the
/// virtual server left and what graceful termination keeps.
fn show_ipvs_no_endpoints(out: &mut impl Write, bed: &Testbed, vip: SocketAddr) -> Result<()> {
    let idle = || ipvs::real_servers(bed, vip).is_ok_and(|rs| rs.iter().all(|r| r.weight == 0));
    if poll(CHANGE_TIMEOUT, idle).is_none() {
        writeln!(out, "   real servers still take connections after {CHANGE_TIMEOUT:?}")?;
    }
    for l in ipvs::virtual_server(bed, vip)? {
        writeln!(out, "   {l}")?;
    }
    let draining = ipvs::real_servers(bed, vip)?.len();
    if draining > 0 {
        writeln!(
            out,
            "   the virtual server stays; {draining} real servers stay at weight 0 (no new connections) until the kernel counts none of their connections, closed ones in TIME_WAIT included (2 min): graceful termination, as upstream's IPVS mode"
        )?;
    } else {
        writeln!(out, "   the virtual server stays, without real servers")?;
    }
    Ok(())
}

/// Section 5 in IPVS mode: the NodePort's virtual servers and the iptables rule that marks
/// NodePort traffic for masquerading.
fn show_ipvs_node_port(out: &mut impl Write, bed: &Testbed) -> Result<()> {
    let vs = ipvs::virtual_servers_on_port(bed, NODE_PORT)?;
    for l in &vs {
        writeln!(out, "   {l}")?;
    }
    writeln!(
        out,
        "   IPVS matches exact addresses: one virtual server per NodePort address ({} here; iptables mode matches any local address with one rule)",
        vs.len()
    )?;
    for l in bed_nat(bed)?.lines().filter(|l| l.starts_with("-A KUBE-NODE-PORT ")) {
        writeln!(out, "   nat: {l}")?;
    }
    Ok(())
}

/// The rules of the mode in use: `nft list table ip kube-proxy` or `iptables-save -t nat`.
fn rules(bed: &Testbed, nft: bool) -> Result<String> {
    if nft {
        bed.node.exec_ok("nft", ["list", "table", "ip", "kube-proxy"])
    } else {
        bed_nat(bed)
    }
}

/// The Service's entry, its endpoint choice and the DNAT of each endpoint.
fn show_service(out: &mut impl Write, bed: &Testbed, nft: bool, svc_chain: &str) -> Result<()> {
    if !nft {
        return print_chains(out, &bed_nat(bed)?, svc_chain);
    }
    let listing = rules(bed, true)?;
    for l in listing.lines().map(str::trim) {
        if l.contains(CLUSTER_IP) && l.contains("goto")
            || l.contains("numgen") && !l.starts_with("typeof")
            || l.contains("dnat to")
            || (l.starts_with("chain service-") || l.starts_with("chain endpoint-")) && l.contains('/')
        {
            writeln!(out, "   {l}")?;
        }
    }
    // The endpoints: each one's share of the numbers the service chain draws.
    let lines: Vec<String> = listing.lines().map(|l| l.trim().to_string()).collect();
    for map in crate::nftables::readback::endpoint_maps(&lines) {
        writeln!(out, "   map {map} {{ {} }}", set_elements(&listing, &map))?;
    }
    Ok(())
}

/// The elements of set or map `name` in a `nft list table` output, on one line.
fn set_elements(listing: &str, name: &str) -> String {
    let Some(start) = listing
        .find(&format!("set {name} {{"))
        .or_else(|| listing.find(&format!("map {name} {{")))
    else {
        return String::new();
    };
    let object = &listing[start..];
    let object = &object[..object.find("\n\t}").unwrap_or(object.len())];
    let Some(elements) = object.find("elements = {") else {
        return String::new();
    };
    let body = &object[elements + "elements = {".len()..];
    let body = body.split('}').next().unwrap_or("");
    body.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn bed_nat(bed: &Testbed) -> Result<String> {
    bed.node.exec_ok(save_tool(), ["-t", "nat"])
}

/// `iptables-save` of the backend the daemon programs in the lab's node namespace, which has no
/// rules before it starts.
fn save_tool() -> String {
    crate::iptables::backend::on_empty_node().tool(crate::model::IpFamily::V4, "-save")
}

/// The entry rule in KUBE-SERVICES, the service chain and the endpoint chains it jumps to.
fn print_chains(out: &mut impl Write, nat: &str, svc_chain: &str) -> Result<()> {
    let lines: Vec<&str> = nat.lines().collect();
    for l in lines
        .iter()
        .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.ends_with(svc_chain))
    {
        writeln!(out, "   entry: {l}")?;
    }
    let svc_rules: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with(&format!("-A {svc_chain} ")))
        .collect();
    for l in &svc_rules {
        writeln!(out, "   svc:   {l}")?;
    }
    for l in &svc_rules {
        let Some(sep) = l.rsplit(" -j ").next().filter(|t| t.starts_with("KUBE-SEP-")) else {
            continue;
        };
        for r in lines
            .iter()
            .filter(|r| r.starts_with(&format!("-A {sep} ")) && r.contains("DNAT"))
        {
            writeln!(out, "   sep:   {r}")?;
        }
    }
    Ok(())
}

fn summary(report: &ProbeReport) -> String {
    let mut parts: Vec<String> = report.names().iter().map(|(n, c)| format!("{n} {c}")).collect();
    for (e, c) in report.errors() {
        parts.push(format!("{e} {c}"));
    }
    parts.join(", ")
}

/// Counts per endpoint, a bar chart and a chi-square test of uniformity.
fn print_distribution(out: &mut impl Write, report: &ProbeReport, total: u32) -> Result<()> {
    let names: BTreeMap<String, usize> = report.names();
    let k = names.len().max(1);
    let expected = f64::from(total) / k as f64;
    for (name, count) in &names {
        writeln!(
            out,
            "   {name}: {count:>4} {}",
            "#".repeat((*count as f64 / expected * 20.0) as usize)
        )?;
    }
    if !report.errors().is_empty() {
        writeln!(out, "   errors: {:?}", report.errors())?;
    }
    let chi2: f64 = names.values().map(|&n| (n as f64 - expected).powi(2) / expected).sum();
    // Critical values of chi-square at p = 0.001 for 1..=5 degrees of freedom.
    let critical = [10.828, 13.816, 16.266, 18.467, 20.515]
        .get(k.saturating_sub(2))
        .copied()
        .unwrap_or(20.515);
    writeln!(
        out,
        "   chi-square = {chi2:.2} with {} degrees of freedom; a uniform split stays below {critical} at p = 0.001: {}",
        k - 1,
        if chi2 < critical { "uniform" } else { "NOT uniform" }
    )?;
    Ok(())
}
