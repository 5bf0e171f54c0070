//! Benchmark of the data plane a node ends up with, and of the daemon's memory. Needs root;
//! everything happens in network namespaces the benchmark creates (guards delete them on drop,
//! also on a panic); the root namespace's rules, routes and sysctls are never touched.
//!
//! Run with `cargo bench --bench dataplane` (as root). Three parts:
//!
//! **1. First-packet latency** (after FLOOR.md, "First-packet latency"). For each mode in
//! `MODES` and each N in `SERVICES`, a fresh test bed (`kube_proxy::lab::testbed`: a client pod
//! namespace and an endpoint namespace, routed through a node namespace) gets the rules of
//! `synthetic::state(N, ENDPOINTS)`, programmed by the proxier itself as the daemon does it
//! (`Proxier` with `iptables-restore`, or `NftProxier::netlink`) from a thread that entered the
//! node namespace; the `load` column is the time of that one cold sync. The
//! *last* service port of the state (the last `KUBE-SERVICES` rule: the worst case of iptables'
//! linear match; checked in the kernel) gets the real endpoint(s) instead of synthetic ones:
//! the endpoint namespace's address(es) 10.244.1.2, .3, … on port 8090, where a listener of
//! this process accepts and closes. A thread in the client namespace then times `connect()`
//! (`TcpStream::connect_timeout`, 1 s) to that Service's ClusterIP:80, `CONNECTS` times after
//! `WARMUP` untimed ones, `REPS` runs; each connection is closed with `SO_LINGER` 0 (an RST: no
//! TIME_WAIT piles up; each connect takes the kernel's next ephemeral port and makes a new
//! conntrack entry in the node). p50/p99 in µs and the number of failed connects (must be 0)
//! are reported, for two servers:
//! - `accept`: a listener that accept()s and closes (the realistic case: the handshake also
//!   wakes the server thread, which is noisy on a VM);
//! - `no wake-up`: a `TCP_DEFER_ACCEPT` listener that never accepts, which takes the server
//!   wake-up off the measured path (FLOOR's second pass) and is the steadier figure.
//!
//! The baseline is the same client connecting straight to the endpoint's address in a bed
//! without any rules (no tables, no conntrack in the node), measured first and again last.
//! Synthetic NodePorts are renumbered to be unique (30000 upwards; Services beyond 32767 lose
//! theirs), as an API server would have them. The target of the issue: nftables at 30,000
//! Services within 1.2× of nftables at 1,000 (printed as the ratio of the largest N to the
//! smallest).
//!
//! **2. Daemon RSS.** For each mode, the real daemon (`CARGO_BIN_EXE_kube-proxy`, i.e. the
//! release build of this tree) starts in a fresh network namespace with
//! `--hostname-override=node-a --cluster-cidr=10.244.0.0/16 --proxy-mode=MODE --manifests DIR`,
//! DIR holding the same synthetic cluster, `RSS_SERVICES` × `RSS_ENDPOINTS`, written as
//! Service + EndpointSlice YAML (500 Services per file) plus the Node (checked first: reading
//! them back gives exactly the synthetic model). Once the daemon logged `Synced rules` for every
//! IP family it programs (polled, 900 s deadline), VmRSS and VmHWM are read from
//! `/proc/PID/status` (the daemon only, not its `iptables-restore`/`nft` children), with the
//! time from start to that point. The target of the issue: ≤ 64 MiB at 10,000 × 10 in
//! nftables mode. Then `LIVE_CHANGES` times (2.5 s apart, beyond the minimum sync period and
//! the deletion of stale chains) one endpoint address in one manifest file is replaced (write
//! to a temporary file, rename over): the time from the rename until the daemon logs its next
//! IPv4 `Synced rules` line is the whole path of a change (inotify, re-reading the directory,
//! parsing the changed file, converting, building the state, the sync), printed as p50/max,
//! with VmRSS after the changes.
//!
//! **3. `kube-proxy explain` at scale** (`PARTS=explain`). The daemon starts as in part 2 on
//! the same synthetic cluster (`RSS_SERVICES` × `RSS_ENDPOINTS`) and syncs; then, in its
//! namespace, the binary's `explain` is timed from spawn to exit, `EXPLAIN_REPS` runs each:
//! for the last Service (`explain NS/NAME`, the desired state from the daemon's
//! `/debug/services`), `explain --all`, and both again with `--manifests DIR` (explain reads the
//! 10^5 endpoints itself, as with the daemon down). Each run gathers everything (the kernel's
//! rules read back, conntrack with its ≥ 200 ms statistics window, routes, the daemon's health).
//! The synthetic endpoints have no routes in the namespace, so explain finds problems (exit 1)
//! and says so; exit 2 fails the benchmark. The targets of the issue: one Service ≤ 1 s,
//! `--all` ≤ 5 s (checked on the slowest run).
//!
//! Environment (all optional):
//! - `SERVICES` (default `1000,10000,30000`), `ENDPOINTS` (default 1, at most 250),
//!   `MODES` (default `iptables,nftables`), `CONNECTS` (default 2000), `WARMUP` (default 100),
//!   `REPS` (default 5: runs per server and case; the table shows the median of the runs'
//!   p50s and p99s, as FLOOR.md does, and the sum of their errors);
//! - `RSS_SERVICES` (default 10000), `RSS_ENDPOINTS` (default 10), `LIVE_CHANGES` (default 10);
//! - `EXPLAIN_REPS` (default 5), `EXPLAIN_SHOW` (set: print each report and what explain
//!   wrote to stderr);
//! - `PARTS` (default `latency,rss`; `explain` too): which parts to run.
//!
//! Deterministic inputs (the synthetic cluster); the timings are what they are on the machine.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod common;

use common::{TempDir, env_list, env_usize, field, in_netns, loadavg, progress, thousands, unique_node_ports};
use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::IptablesRenderOptions;
use kube_proxy::iptables::backend::Backend;
use kube_proxy::iptables::exec::Exec;
use kube_proxy::iptables::proxier::IptablesProxier;
use kube_proxy::lab::netns::{ChildGuard, Netns, memory_kib};
use kube_proxy::lab::scenario::NODE;
use kube_proxy::lab::testbed::{POD_CIDR, Testbed, TestbedSpec};
use kube_proxy::model::{Endpoint, IpFamily, NodeInfo, ProxyState, build_state, synthetic};
use kube_proxy::nftables::proxier::NftProxier;
use kube_proxy::proxy::RenderOptions;
use nix::libc;
use nix::sys::socket::{Backlog, setsockopt, sockopt};
use nix::{setsockopt_impl, sockopt_impl};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
/// The port of the Services (ClusterIP:80).
const SERVICE_PORT: u16 = 80;
/// Our listener in the endpoint namespace (the bed's own `lab serve` keeps 8080).
const ENDPOINT_PORT: u16 = 8090;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// A pass stops early after this many failed connects (each may cost CONNECT_TIMEOUT).
const MAX_ERRORS: usize = 50;
const FIRST_SYNC_TIMEOUT: Duration = Duration::from_secs(900);
const SERVICES_PER_FILE: usize = 500;
/// The listen backlog of our endpoint listener (and `net.core.somaxconn` in its namespace).
const ACCEPT_BACKLOG: i32 = 4096;

sockopt_impl!(
    /// `TCP_DEFER_ACCEPT` (seconds): the listener ignores the bare final ACK of a handshake.
    TcpDeferAccept,
    SetOnly,
    libc::IPPROTO_TCP,
    libc::TCP_DEFER_ACCEPT,
    libc::c_int
);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Iptables,
    Nftables,
}

impl Mode {
    fn parse(s: &str) -> Mode {
        match s {
            "iptables" => Mode::Iptables,
            "nftables" => Mode::Nftables,
            _ => panic!("MODES: unknown mode {s:?} (iptables, nftables)"),
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn opts() -> RenderOptions {
    RenderOptions {
        local_detector: LocalDetector::Cidr(POD_CIDR.into()),
        ..RenderOptions::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Part 1: first-packet latency.

/// A listener of this process inside the endpoint namespace; closed (and its acceptor thread
/// joined) on drop.
struct Server {
    listener: Arc<TcpListener>,
    stopping: Arc<AtomicBool>,
    accepted: Arc<AtomicU64>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// `defer`: a `TCP_DEFER_ACCEPT` listener that never accepts; otherwise accept and close.
    fn start(ns: &str, defer: bool) -> Server {
        let listener = in_netns(ns, || TcpListener::bind((Ipv4Addr::UNSPECIFIED, ENDPOINT_PORT)))
            .expect("bind the endpoint listener");
        // A deep accept queue: an acceptor thread descheduled for a few ms (two busy CPUs)
        // must not make the listener drop SYNs (a 1 s retransmit, counted as an error).
        nix::sys::socket::listen(&listener, Backlog::new(ACCEPT_BACKLOG).expect("backlog")).expect("listen");
        let listener = Arc::new(listener);
        let stopping = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let acceptor = if defer {
            setsockopt(&*listener, TcpDeferAccept, &30).expect("TCP_DEFER_ACCEPT");
            None
        } else {
            let (l, stop, n) = (listener.clone(), stopping.clone(), accepted.clone());
            Some(std::thread::spawn(move || {
                loop {
                    match l.accept() {
                        Ok((s, _)) => {
                            n.fetch_add(1, Ordering::Relaxed);
                            drop(s);
                        }
                        Err(_) if stop.load(Ordering::Acquire) => break,
                        Err(_) => {}
                    }
                }
            }))
        };
        Server {
            listener,
            stopping,
            accepted,
            acceptor,
        }
    }

    fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // shutdown() of a listening socket wakes a blocked accept() (EINVAL) on Linux.
        let _ = nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Stats {
    p50_us: f64,
    p99_us: f64,
    samples: usize,
    errors: usize,
    first_error: Option<String>,
}

impl Stats {
    /// The median of the runs' percentiles (as FLOOR.md reports them); errors summed.
    fn median_of(runs: &[Stats]) -> Stats {
        let median = |f: fn(&Stats) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or_default()
        };
        Stats {
            p50_us: median(|s| s.p50_us),
            p99_us: median(|s| s.p99_us),
            samples: runs.iter().map(|s| s.samples).sum(),
            errors: runs.iter().map(|s| s.errors).sum(),
            first_error: runs.iter().find_map(|s| s.first_error.clone()),
        }
    }
}

/// How many connects: `reps` runs of `warmup` untimed and `connects` timed ones, per server.
#[derive(Clone, Copy, Debug)]
struct Connects {
    warmup: usize,
    connects: usize,
    reps: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

/// One connect, closed with an RST. `Ok(connect time)` or the error.
fn connect_once(to: SocketAddr) -> Result<Duration, String> {
    let t = Instant::now();
    let s = TcpStream::connect_timeout(&to, CONNECT_TIMEOUT).map_err(|e| e.to_string())?;
    let elapsed = t.elapsed();
    let rst = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(&s, sockopt::Linger, &rst).map_err(|e| format!("SO_LINGER: {e}"))?;
    drop(s);
    Ok(elapsed)
}

/// `warmup` untimed connects, then `connects` timed ones, from a thread in `client_ns`.
fn measure(client_ns: &str, to: SocketAddr, warmup: usize, connects: usize) -> Stats {
    in_netns(client_ns, || {
        let mut stats = Stats::default();
        let mut times = Vec::with_capacity(connects);
        for i in 0..warmup + connects {
            match connect_once(to) {
                Ok(d) if i >= warmup => times.push(d),
                Ok(_) => {}
                Err(e) => {
                    stats.errors += 1;
                    stats.first_error.get_or_insert(e);
                    if stats.errors >= MAX_ERRORS {
                        break;
                    }
                }
            }
        }
        times.sort();
        stats.samples = times.len();
        stats.p50_us = percentile(&times, 0.5).as_secs_f64() * 1e6;
        stats.p99_us = percentile(&times, 0.99).as_secs_f64() * 1e6;
        stats
    })
}

struct Row {
    case: String,
    services: usize,
    load: Option<Duration>,
    accept: Stats,
    no_wake: Stats,
}

/// A bed with `endpoint_ips` addresses on the endpoint's eth0 (10.244.1.2 upwards).
fn build_bed(endpoint_ips: usize) -> (Testbed, Vec<IpAddr>) {
    let mut spec = TestbedSpec::new("kpdp", BIN);
    spec.endpoints = 1;
    let bed = Testbed::build(&spec).expect("the test bed builds (root and iproute2 needed)");
    let ep = bed.endpoint(0);
    ep.ns
        .sysctl("net.core.somaxconn", &ACCEPT_BACKLOG.to_string())
        .expect("somaxconn in the endpoint namespace");
    let IpAddr::V4(first) = ep.ip else {
        panic!("the endpoint has an IPv4 address")
    };
    let mut ips = vec![ep.ip];
    for j in 1..endpoint_ips {
        let ip = IpAddr::V4(Ipv4Addr::from(u32::from(first) + j as u32));
        ep.ns
            .add_addr("eth0", ipnet::IpNet::new(ip, 24).expect("prefix"))
            .expect("an extra endpoint address");
        ips.push(ip);
    }
    (bed, ips)
}

/// Both passes (accept server, then the no-wake-up listener) against `to`.
fn both_passes(bed: &Testbed, to: SocketAddr, c: &Connects) -> (Stats, Stats) {
    let ep_ns = bed.endpoint(0).ns.name().to_string();
    let client = bed.client.name().to_string();
    {
        // The path works at all (a ClusterIP is no address anywhere: only DNAT reaches us).
        let _server = Server::start(&ep_ns, false);
        if let Err(e) = in_netns(&client, || connect_once(to)) {
            panic!("a first connect to {to} from the client fails: {e}");
        }
    }
    let (mut accept, mut no_wake) = (Vec::new(), Vec::new());
    for _ in 0..c.reps {
        let server = Server::start(&ep_ns, false);
        let run = measure(&client, to, c.warmup, c.connects);
        // Every connect that succeeded landed on our server (the acceptor may lag; bounded).
        let want = (c.warmup + c.connects - run.errors) as u64;
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.accepted() < want && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(
            server.accepted() >= want,
            "{} of {want} connections reached the endpoint's server",
            server.accepted()
        );
        drop(server);
        accept.push(run);
        let server = Server::start(&ep_ns, true);
        no_wake.push(measure(&client, to, c.warmup, c.connects));
        drop(server);
    }
    (Stats::median_of(&accept), Stats::median_of(&no_wake))
}

fn measuring(c: &Connects, to: impl std::fmt::Display) -> String {
    format!(
        "measuring {} x ({} connects + {} warm-up) to {to}, accept and no-wake-up servers",
        c.reps, c.connects, c.warmup
    )
}

fn baseline(label: &str, c: &Connects) -> Row {
    println!("[{label}] no rules, straight to the endpoint");
    let (bed, ips) = build_bed(1);
    let to = SocketAddr::new(ips[0], ENDPOINT_PORT);
    progress(measuring(c, to));
    let (accept, no_wake) = both_passes(&bed, to, c);
    Row {
        case: label.to_string(),
        services: 0,
        load: None,
        accept,
        no_wake,
    }
}

/// The synthetic state whose last service port points at the real endpoint(s).
fn latency_state(services: usize, endpoints: usize, real: &[IpAddr], node_ip: IpAddr) -> ProxyState {
    let mut state = synthetic::state(services, endpoints);
    unique_node_ports(&mut state);
    state.node.addresses = vec![node_ip];
    let last = std::sync::Arc::make_mut(state.service_ports.last_mut().expect("at least one Service"));
    let mut eps: Vec<Endpoint> = real
        .iter()
        .map(|ip| Endpoint {
            is_local: true,
            ..Endpoint::ready(*ip, ENDPOINT_PORT)
        })
        .collect();
    eps.sort_by_key(|e| e.to_string());
    last.endpoints = eps;
    state
}

/// iptables: the measured ClusterIP's rule is the last ClusterIP rule of KUBE-SERVICES.
fn check_last_rule(bed: &Testbed, cluster_ip: IpAddr) -> usize {
    let nat = bed
        .node
        .exec_ok("iptables-save", ["-t", "nat"])
        .expect("iptables-save in the node");
    let rules: Vec<&str> = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES ") && l.contains(" -d "))
        .collect();
    let last = rules.last().copied().unwrap_or_default();
    assert!(
        last.contains(&format!(" -d {cluster_ip}/32 ")),
        "the measured ClusterIP {cluster_ip} is not the last KUBE-SERVICES rule: {last}"
    );
    rules.len()
}

fn latency_case(mode: Mode, services: usize, endpoints: usize, c: &Connects) -> Row {
    let label = format!("{} N={}", mode.as_str(), thousands(services));
    println!("[{label}] building the test bed");
    let (bed, real) = build_bed(endpoints);
    let state = latency_state(services, endpoints, &real, bed.node_ip());
    let cluster_ip = state.service_ports.last().expect("a Service").port.cluster_ip;
    progress(format!(
        "programming {} Services x {endpoints} endpoint(s) in the node namespace ({} mode)",
        thousands(services),
        mode.as_str()
    ));
    let node = bed.node.name().to_string();
    let t = Instant::now();
    let result = in_netns(&node, || match mode {
        // The plain tools, which the check of the programmed rules reads (`iptables-save`).
        Mode::Iptables => IptablesProxier::new(
            Exec::new(Backend::Plain, IpFamily::V4),
            IptablesRenderOptions {
                common: opts(),
                ..IptablesRenderOptions::default()
            },
        )
        .sync(&state)
        .map(|r| r.full)
        .map_err(|e| e.to_string()),
        Mode::Nftables => NftProxier::netlink(IpFamily::V4, opts())
            .map_err(|e| e.to_string())?
            .sync(&state)
            .map(|r| r.full)
            .map_err(|e| e.to_string()),
    });
    let load = t.elapsed();
    if let Err(e) = result {
        panic!("[{label}] the sync failed: {e}");
    }
    progress(format!("rules loaded in {}", secs(load)));
    if mode == Mode::Iptables {
        let n = check_last_rule(&bed, cluster_ip);
        progress(format!(
            "{cluster_ip} is rule {n} of {n} ClusterIP rules in KUBE-SERVICES"
        ));
    }
    progress(measuring(c, format!("{cluster_ip}:{SERVICE_PORT}")));
    let to = SocketAddr::new(cluster_ip, SERVICE_PORT);
    let (accept, no_wake) = both_passes(&bed, to, c);
    progress(format!(
        "p50 {:.1} / {:.1} µs (accept / no wake-up)",
        accept.p50_us, no_wake.p50_us
    ));
    Row {
        case: mode.as_str().to_string(),
        services,
        load: Some(load),
        accept,
        no_wake,
    }
}

fn stats_cells(s: &Stats) -> String {
    format!("{:>8.1} {:>8.1} {:>6}", s.p50_us, s.p99_us, s.errors)
}

fn print_latency(rows: &[Row], endpoints: usize, c: &Connects) {
    println!();
    println!(
        "First-packet latency: TCP connect() from the client pod to the last Service's ClusterIP:{SERVICE_PORT}\n\
         (baseline: straight to the endpoint, no rules), {endpoints} endpoint(s) per Service; µs, median of {} runs of \
         {} connects (after {} warm-up) per server",
        c.reps, c.connects, c.warmup
    );
    println!(
        "{:<16} {:>8} {:>9} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6}",
        "case", "N", "load", "p50", "p99", "errors", "p50", "p99", "errors"
    );
    println!(
        "{:<16} {:>8} {:>9} | {:^24} | {:^24}",
        "", "", "", "accept() server", "no wake-up (DEFER_ACCEPT)"
    );
    for r in rows {
        println!(
            "{:<16} {:>8} {:>9} | {} | {}",
            r.case,
            thousands(r.services),
            r.load.map(secs).unwrap_or_else(|| "-".into()),
            stats_cells(&r.accept),
            stats_cells(&r.no_wake)
        );
    }
    let mut problems = String::new();
    for r in rows {
        for (pass, s) in [("accept", &r.accept), ("no wake-up", &r.no_wake)] {
            if s.errors > 0 {
                let _ = writeln!(
                    problems,
                    "  {} N={} {pass}: {} failed connects (first: {})",
                    r.case,
                    r.services,
                    s.errors,
                    s.first_error.as_deref().unwrap_or("?")
                );
            }
        }
    }
    if !problems.is_empty() {
        println!("ERRORS:\n{problems}");
    }
    // The target: nftables flat in N.
    let nft: Vec<&Row> = rows.iter().filter(|r| r.case == "nftables").collect();
    if let (Some(lo), Some(hi)) = (
        nft.iter().min_by_key(|r| r.services),
        nft.iter().max_by_key(|r| r.services),
    ) && hi.services > lo.services
    {
        let verdict = |x: f64| if x <= 1.2 { "ok" } else { "ABOVE 1.2x" };
        let a = hi.accept.p50_us / lo.accept.p50_us;
        let b = hi.no_wake.p50_us / lo.no_wake.p50_us;
        println!(
            "nftables p50 at N={} / at N={}: {a:.2}x accept ({}), {b:.2}x no wake-up ({}); target <= 1.2x",
            thousands(hi.services),
            thousands(lo.services),
            verdict(a),
            verdict(b)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Part 2: daemon RSS.

/// One Service and its EndpointSlice, as YAML documents.
fn service_yaml(out: &mut String, sps: &kube_proxy::model::ServicePortState) {
    let p = &sps.port;
    let (ns, name, port_name) = (&p.name.namespace, &p.name.name, &p.name.port);
    let (kind, node_port) = if p.node_port != 0 {
        ("NodePort", format!(", nodePort: {}", p.node_port))
    } else {
        ("ClusterIP", String::new())
    };
    let target = sps.endpoints.first().map_or(8080, |e| e.port);
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  type: {kind}\n  \
         clusterIP: {}\n  ports: [{{name: {port_name}, protocol: TCP, port: {}, targetPort: {target}{node_port}}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-x1\n  namespace: {ns}\n  \
         labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\n\
         ports: [{{name: {port_name}, protocol: TCP, port: {target}}}]\nendpoints:",
        p.cluster_ip, p.port
    );
    if sps.endpoints.is_empty() {
        out.push_str(" []");
    }
    for e in &sps.endpoints {
        let node = if e.is_local { "node-a" } else { "node-b" };
        let _ = write!(
            out,
            "\n- addresses: [\"{}\"]\n  nodeName: {node}\n  conditions: {{ready: true}}",
            e.ip
        );
    }
    out.push('\n');
}

/// Writes `state` as manifests (the Node in its own file, then 500 Services per file) and checks
/// that reading them back gives the same service ports.
fn write_manifests(dir: &Path, state: &ProxyState) -> usize {
    std::fs::write(dir.join("00-node.yaml"), NODE).expect("write the Node");
    let mut files = 1;
    for (k, chunk) in state.service_ports.chunks(SERVICES_PER_FILE).enumerate() {
        let mut text = String::new();
        for sps in chunk {
            service_yaml(&mut text, sps);
        }
        std::fs::write(dir.join(format!("svc-{k:04}.yaml")), text).expect("write manifests");
        files += 1;
    }
    let objects = kube_proxy::manifest::load_paths(&[dir]).expect("the manifests load");
    assert!(
        objects.warnings.is_empty(),
        "manifest warnings: {:?}",
        &objects.warnings[..1]
    );
    let node = NodeInfo::from_objects(&objects, "node-a", &[]);
    let loaded = build_state(&objects, &node, IpFamily::V4);
    assert_eq!(loaded.service_ports.len(), state.service_ports.len());
    if let Some((a, b)) = loaded
        .service_ports
        .iter()
        .zip(&state.service_ports)
        .find(|(a, b)| a != b)
    {
        panic!("the manifests do not give the synthetic model back:\nread    {a:?}\nwritten {b:?}");
    }
    files
}

struct RssRow {
    mode: Mode,
    rss_kib: u64,
    hwm_kib: u64,
    to_synced: Duration,
    sync_ms: String,
    /// Manifest change → next IPv4 sync logged, sorted.
    live: Vec<Duration>,
    rss_after_kib: u64,
}

/// The IPv4 `Synced rules` lines of a log.
fn ipv4_syncs(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("\"Synced rules\"") && field(l, "ipFamily") == Some("IPv4"))
        .count()
}

/// Replaces the first endpoint address of `file` by `new_ip` (atomically: temporary + rename).
fn change_one_endpoint(file: &Path, new_ip: &str) {
    let text = std::fs::read_to_string(file).expect("read a manifest");
    let start = text.find("- addresses: [\"").expect("an endpoint") + "- addresses: [\"".len();
    let end = start + text[start..].find('"').expect("a quoted address");
    let changed = format!("{}{new_ip}{}", &text[..start], &text[end..]);
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, changed).expect("write the changed manifest");
    std::fs::rename(&tmp, file).expect("rename it into place");
}

/// `n` live endpoint changes, each timed from the rename to the daemon's next IPv4 sync.
fn live_changes(daemon: &ChildGuard, dir: &Path, files: usize, n: usize) -> Vec<Duration> {
    // New addresses across runs too: writing what a file already holds is no change at all.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut times = Vec::new();
    for _ in 0..n {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(2500)); // spacing, not synchronisation
        let before = ipv4_syncs(&daemon.log());
        let file = dir.join(format!("svc-{:04}.yaml", k % (files - 1)));
        let t = Instant::now();
        change_one_endpoint(&file, &format!("10.255.{}.{}", k / 250, k % 250 + 1));
        let deadline = t + Duration::from_secs(60);
        while ipv4_syncs(&daemon.log()) == before {
            assert!(Instant::now() < deadline, "no sync after a change:\n{}", daemon.log());
            std::thread::sleep(Duration::from_millis(2));
        }
        times.push(t.elapsed());
    }
    times.sort();
    times
}

/// Polls the daemon's log until it synced every family; the IPv4 `Synced rules` line.
fn wait_first_sync(daemon: &mut ChildGuard, families: &BTreeSet<&str>, services: usize) -> String {
    let deadline = Instant::now() + FIRST_SYNC_TIMEOUT;
    loop {
        let log = daemon.log();
        let synced: Vec<&str> = log.lines().filter(|l| l.contains("\"Synced rules\"")).collect();
        let seen: BTreeSet<&str> = synced.iter().filter_map(|l| field(l, "ipFamily")).collect();
        if families.iter().all(|f| seen.contains(f)) {
            let v4 = synced
                .iter()
                .find(|l| field(l, "ipFamily") == Some("IPv4"))
                .expect("an IPv4 sync");
            assert_eq!(
                field(v4, "services"),
                Some(services.to_string().as_str()),
                "the first IPv4 sync did not see every Service: {v4}"
            );
            return v4.to_string();
        }
        if let Ok(Some(st)) = daemon.try_wait() {
            panic!("the daemon exited ({st}) before its first sync:\n{log}");
        }
        assert!(
            Instant::now() < deadline,
            "no first sync of {families:?} within {FIRST_SYNC_TIMEOUT:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The daemon's flags but for `--manifests` (explain takes the same).
fn mode_flags(mode: Mode) -> Vec<String> {
    vec![
        "--hostname-override=node-a".to_string(),
        format!("--cluster-cidr={POD_CIDR}"),
        format!("--proxy-mode={}", mode.as_str()),
    ]
}

/// A synced daemon: its namespace, itself, its IPv4 `Synced rules` line and the time from its
/// start to the first sync of every family it programs.
struct Synced {
    // Dropped first: the daemon stops before its namespace goes.
    daemon: ChildGuard,
    ns: Netns,
    line: String,
    to_synced: Duration,
}

/// Starts the real daemon on the manifests in `dir` in a fresh namespace (`tag` in its name)
/// and waits for its first sync.
fn synced_daemon(mode: Mode, dir: &Path, services: usize, tag: &str) -> Synced {
    let ns = Netns::create(&format!("kpdp-{}-{tag}-{}", std::process::id(), mode.as_str())).expect("a namespace");
    let mut args = mode_flags(mode);
    args.extend(["--manifests".to_string(), dir.display().to_string()]);
    let proxy_mode = kube_proxy::config::ProxyMode::parse(mode.as_str()).expect("a proxy mode");
    // nft: what the daemon chooses in a node namespace without rules.
    let families: BTreeSet<&str> = kube_proxy::daemon::modes::families(proxy_mode, Backend::Nft)
        .iter()
        .map(|f| match f {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        })
        .collect();
    progress(format!("starting {BIN} {}", args.join(" ")));
    let t = Instant::now();
    let mut daemon = ns.spawn_guarded(BIN, &args).expect("the daemon starts");
    let line = wait_first_sync(&mut daemon, &families, services);
    Synced {
        daemon,
        ns,
        line,
        to_synced: t.elapsed(),
    }
}

fn rss_case(mode: Mode, dir: &Path, services: usize, files: usize, changes: usize) -> RssRow {
    println!("[daemon RSS, {} mode]", mode.as_str());
    let Synced {
        daemon,
        ns,
        line,
        to_synced,
    } = synced_daemon(mode, dir, services, "rss");
    let pid = daemon.pid();
    let families = "every family";
    let sync_ms = field(&line, "elapsedMs")
        .and_then(|v| v.parse::<f64>().ok())
        .map_or_else(|| "?".to_string(), |v| format!("{v:.0}"));
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert_eq!(comm.trim(), "kube-proxy", "pid {pid} is the daemon itself");
    let (rss_kib, hwm_kib) = memory_kib(pid);
    progress(format!(
        "first sync of {families} after {}; VmRSS {} MiB, VmHWM {} MiB",
        secs(to_synced),
        mib(rss_kib),
        mib(hwm_kib)
    ));
    progress(format!("its log: {}", line.trim()));
    let live = live_changes(&daemon, dir, files, changes);
    let (rss_after_kib, _) = memory_kib(pid);
    if let (Some(first), Some(last)) = (live.first(), live.last()) {
        progress(format!(
            "{changes} live endpoint changes: manifest rename -> IPv4 sync logged in {} .. {}; VmRSS {} MiB",
            ms(*first),
            ms(*last),
            mib(rss_after_kib)
        ));
    }
    drop(daemon);
    drop(ns);
    RssRow {
        mode,
        rss_kib,
        hwm_kib,
        to_synced,
        sync_ms,
        live,
        rss_after_kib,
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

fn print_rss(rows: &[RssRow], services: usize, endpoints: usize, files: usize) {
    println!();
    println!(
        "Daemon memory after its first sync, {} Services x {endpoints} endpoints from --manifests ({files} files)",
        thousands(services)
    );
    println!(
        "{:<10} {:>12} {:>12} {:>16} {:>14} {:>22} {:>16}",
        "mode", "VmRSS MiB", "VmHWM MiB", "start->synced", "sync elapsed", "change live p50 / max", "VmRSS after MiB"
    );
    for r in rows {
        let target = if r.mode == Mode::Nftables {
            if r.rss_kib <= 64 * 1024 && r.hwm_kib <= 64 * 1024 {
                "  (target <= 64 MiB: ok)"
            } else if r.rss_kib <= 64 * 1024 {
                "  (target <= 64 MiB: RSS ok, peak above)"
            } else {
                "  (target <= 64 MiB: ABOVE)"
            }
        } else {
            ""
        };
        let live = match (r.live.get(r.live.len() / 2), r.live.last()) {
            (Some(p50), Some(max)) => format!("{} / {}", ms(*p50), ms(*max)),
            _ => "-".to_string(),
        };
        println!(
            "{:<10} {:>12} {:>12} {:>16} {:>11} ms {:>22} {:>16}{target}",
            r.mode.as_str(),
            mib(r.rss_kib),
            mib(r.hwm_kib),
            secs(r.to_synced),
            r.sync_ms,
            live,
            mib(r.rss_after_kib)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Part 3: `kube-proxy explain` at scale.

/// One way of asking explain, timed.
struct ExplainRow {
    mode: Mode,
    what: &'static str,
    /// Sorted.
    times: Vec<Duration>,
    /// The exit status (0 or 1: a problem found; 2 would be a usage error) and the report's
    /// lines, of the last run.
    code: i32,
    lines: usize,
}

/// `kube-proxy explain ARGS` in `ns`, `reps` times, each timed from spawn to exit.
fn time_explain(ns: &Netns, mode: Mode, what: &'static str, args: &[String], reps: usize) -> ExplainRow {
    let mut all = vec!["explain".to_string()];
    all.extend(args.iter().cloned());
    all.extend(mode_flags(mode));
    let mut times = Vec::new();
    let (mut code, mut lines) = (-1, 0);
    for _ in 0..reps {
        let t = Instant::now();
        let out = ns.exec(BIN, &all).expect("explain runs");
        times.push(t.elapsed());
        code = out.status.code().unwrap_or(-1);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            code == 0 || code == 1,
            "explain {all:?}: exit {code}\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        lines = stdout.lines().count();
        if std::env::var_os("EXPLAIN_SHOW").is_some() {
            println!("{stdout}");
            print!("{}", String::from_utf8_lossy(&out.stderr));
        }
    }
    times.sort();
    progress(format!(
        "explain {what}: median {} (exit {code}, {lines} lines)",
        ms(times[times.len() / 2])
    ));
    ExplainRow {
        mode,
        what,
        times,
        code,
        lines,
    }
}

/// The daemon synced on `dir`, then explain for the last Service (the one `KUBE-SERVICES`
/// matches last) and `--all`, from the daemon's `/debug/services` and from `--manifests`.
fn explain_case(mode: Mode, dir: &Path, state: &ProxyState, reps: usize) -> Vec<ExplainRow> {
    println!("[explain, {} mode]", mode.as_str());
    let services = state.service_ports.len();
    let synced = synced_daemon(mode, dir, services, "explain");
    progress(format!("first sync after {}", secs(synced.to_synced)));
    let last = &state.service_ports.last().expect("a Service").port.name;
    let one = format!("{}/{}", last.namespace, last.name);
    let manifests = ["--manifests".to_string(), dir.display().to_string()];
    let all = ["--all".to_string()];
    let with = |a: &[String], b: &[String]| -> Vec<String> { a.iter().chain(b).cloned().collect() };
    let rows = vec![
        time_explain(&synced.ns, mode, "one Service", std::slice::from_ref(&one), reps),
        time_explain(&synced.ns, mode, "--all", &all, reps),
        time_explain(
            &synced.ns,
            mode,
            "one Service --manifests",
            &with(std::slice::from_ref(&one), &manifests),
            reps,
        ),
        time_explain(&synced.ns, mode, "--all --manifests", &with(&all, &manifests), reps),
    ];
    assert!(
        rows[1].lines >= services,
        "--all gives a line per service port: {} lines",
        rows[1].lines
    );
    drop(synced);
    rows
}

fn print_explain(rows: &[ExplainRow], services: usize, endpoints: usize, reps: usize) {
    println!();
    println!(
        "kube-proxy explain on a node holding {} Services x {endpoints} endpoints (the daemon running), {reps} runs each",
        thousands(services)
    );
    println!(
        "{:<10} {:<26} {:>10} {:>10} {:>6} {:>8}  target",
        "mode", "asked", "median", "max", "exit", "lines"
    );
    for r in rows {
        let (median, max) = (r.times[r.times.len() / 2], r.times[r.times.len() - 1]);
        let target = match r.what {
            "one Service" => Some(Duration::from_secs(1)),
            "--all" => Some(Duration::from_secs(5)),
            _ => None,
        };
        let verdict = target.map_or(String::new(), |t| {
            let ok = if max <= t { "ok" } else { "ABOVE" };
            format!("<= {} s (max): {ok}", t.as_secs())
        });
        println!(
            "{:<10} {:<26} {:>10} {:>10} {:>6} {:>8}  {verdict}",
            r.mode.as_str(),
            r.what,
            ms(median),
            ms(max),
            r.code,
            r.lines
        );
    }
}

/// The synthetic cluster of `services` × `endpoints` (unique NodePorts) written as manifests
/// into a fresh directory (`tag` in its name): the state, the directory and its file count.
fn synthetic_manifests(tag: &str, services: usize, endpoints: usize) -> (ProxyState, TempDir, usize) {
    println!(
        "[{tag}] writing {} Services x {endpoints} endpoints as manifests",
        thousands(services)
    );
    let mut state = synthetic::state(services, endpoints);
    unique_node_ports(&mut state);
    let dir = TempDir::new(&format!("dataplane-{tag}"));
    let files = write_manifests(dir.path(), &state);
    (state, dir, files)
}

fn main() {
    let services: Vec<usize> = env_list("SERVICES", "1000,10000,30000")
        .iter()
        .map(|s| s.replace('_', "").parse().expect("SERVICES: comma-separated numbers"))
        .collect();
    let endpoints = env_usize("ENDPOINTS", 1);
    assert!((1..=250).contains(&endpoints), "ENDPOINTS must be 1..=250");
    let modes: Vec<Mode> = env_list("MODES", "iptables,nftables")
        .iter()
        .map(|m| Mode::parse(m))
        .collect();
    let connects = env_usize("CONNECTS", 2000).max(1);
    let warmup = env_usize("WARMUP", 100);
    let reps = env_usize("REPS", 5).max(1);
    let c = Connects { warmup, connects, reps };
    let rss_services = env_usize("RSS_SERVICES", 10_000);
    let rss_endpoints = env_usize("RSS_ENDPOINTS", 10);
    let live_changes_n = env_usize("LIVE_CHANGES", 10);
    let parts = env_list("PARTS", "latency,rss");
    common::start_clock();
    assert!(
        nix::unistd::geteuid().is_root(),
        "the dataplane benchmark needs root (network namespaces)"
    );
    println!(
        "dataplane benchmark: SERVICES={services:?} ENDPOINTS={endpoints} MODES={:?} CONNECTS={connects} WARMUP={warmup} REPS={reps} \
         RSS_SERVICES={rss_services} RSS_ENDPOINTS={rss_endpoints} PARTS={parts:?}",
        modes.iter().map(|m| m.as_str()).collect::<Vec<_>>()
    );

    println!("load average at the start: {}", loadavg());
    let mut rows = Vec::new();
    if parts.iter().any(|p| p == "latency") {
        rows.push(baseline("baseline", &c));
        for &mode in &modes {
            for &n in &services {
                assert!(n >= 1, "SERVICES: at least 1");
                rows.push(latency_case(mode, n, endpoints, &c));
            }
        }
        rows.push(baseline("baseline-again", &c));
        print_latency(&rows, endpoints, &c);
    }

    let explain_reps = env_usize("EXPLAIN_REPS", 5).max(1);
    if parts.iter().any(|p| p == "explain") {
        println!();
        let (state, dir, _) = synthetic_manifests("explain", rss_services, rss_endpoints);
        let rows: Vec<ExplainRow> = modes
            .iter()
            .flat_map(|&m| explain_case(m, dir.path(), &state, explain_reps))
            .collect();
        print_explain(&rows, rss_services, rss_endpoints, explain_reps);
    }

    if parts.iter().any(|p| p == "rss") {
        println!();
        let (_, dir, files) = synthetic_manifests("rss", rss_services, rss_endpoints);
        progress(format!(
            "{files} files in {} (read back: same model)",
            dir.path().display()
        ));
        let rss: Vec<RssRow> = modes
            .iter()
            .map(|&m| rss_case(m, dir.path(), rss_services, files, live_changes_n))
            .collect();
        if !rows.is_empty() {
            print_latency(&rows, endpoints, &c);
        }
        print_rss(&rss, rss_services, rss_endpoints, files);
    }

    println!("load average at the end: {}", loadavg());
    let failed: usize = rows.iter().map(|r| r.accept.errors + r.no_wake.errors).sum();
    assert_eq!(failed, 0, "{failed} connects failed (see above)");
}
