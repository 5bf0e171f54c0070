//! The daemon's HTTP servers under many idle connections and slow clients: the real daemon
//! (`--manifests`, iptables mode) in the node namespace of a test bed, with a Service whose
//! health-check node port is open; from the outside host, thousands of idle connections to
//! the healthz server and the health-check node port, and slowloris clients (a request whose
//! headers never end, one more header line every 200 ms); from the node, idle connections to
//! the metrics server. Meanwhile `/healthz`, `/metrics` and the health check must keep
//! answering within a bound, and the daemon's open file descriptors and memory must stay
//! bounded (`kube_proxy::http::serve::Limits`: 1,000 connections, 10 s for headers).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::netns::in_netns;
use common::{ManifestDir, wait_until};
use kube_proxy::http::serve::Limits;
use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const HC_PORT: u16 = 31000;
/// How long the attack lasts: longer than the header timeout, so that timeouts cycle.
const ATTACK: Duration = Duration::from_secs(14);
/// Idle connections the attacker keeps open (re-opening those the daemon closes) per target.
const IDLE_PER_TARGET: usize = 1500;
const SLOWLORIS: usize = 300;
/// The bound on one `/healthz` (connect, request, answer) under attack.
const HEALTHZ_BOUND: Duration = Duration::from_secs(1);

/// The daemon's open file descriptors and resident memory (KiB).
fn fds_and_rss(pid: u32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    (fds, rss)
}

/// One `GET path` on a new connection: (status, time taken), or what failed.
fn timed_get(addr: SocketAddr, path: &str) -> Result<(u16, Duration), String> {
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").map_err(|e| format!("write: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| format!("read: {e}"))?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {text:?}"))?;
    Ok((status, started.elapsed()))
}

/// Whether the server has closed `s` (EOF or an error; nothing to read is open).
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    }
}

fn connect_nonblocking(to: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(1)).ok()?;
    s.set_nonblocking(true).ok()?;
    Some(s)
}

/// What the attackers did.
#[derive(Default)]
struct Attack {
    opened: AtomicUsize,
    closed_by_daemon: AtomicUsize,
}

/// Connections an attacker re-opens per target and round (of 250 ms for idle clients, 200 ms
/// for slowloris ones): clients that come back, not a reconnect storm at the machine's full
/// speed, which would make the test a contest for CPU between it and the daemon (each
/// connection the daemon closes for a new one is re-opened at once, so the accept queue never
/// drains) rather than a check of the limits.
const REOPEN_PER_ROUND: usize = 100;

/// Keeps `n` idle connections to each target open until `stop`, re-opening those the daemon
/// closes, every 250 ms. Runs in the calling thread's namespace.
fn idle_clients(targets: &[SocketAddr], n: usize, stop: &AtomicBool, attack: &Attack) {
    let mut conns: Vec<Vec<TcpStream>> = targets.iter().map(|_| Vec::new()).collect();
    let mut first = true;
    while !stop.load(Ordering::SeqCst) {
        for (to, open) in targets.iter().zip(&mut conns) {
            let before = open.len();
            open.retain_mut(|s| !closed(s));
            attack.closed_by_daemon.fetch_add(before - open.len(), Ordering::SeqCst);
            let want = if first { n } else { n.min(open.len() + REOPEN_PER_ROUND) };
            while open.len() < want && !stop.load(Ordering::SeqCst) {
                match connect_nonblocking(*to) {
                    Some(s) => {
                        open.push(s);
                        attack.opened.fetch_add(1, Ordering::SeqCst);
                    }
                    None => break,
                }
            }
        }
        first = false;
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Keeps `n` slowloris clients on `to` until `stop`: a request line and one more header
/// line every 200 ms, never the blank line that ends the headers.
fn slowloris(to: SocketAddr, n: usize, stop: &AtomicBool, attack: &Attack) {
    let mut conns: Vec<TcpStream> = Vec::new();
    let mut first = true;
    while !stop.load(Ordering::SeqCst) {
        let before = conns.len();
        conns.retain_mut(|s| !closed(s) && s.write_all(b"X-Slow: 1\r\n").is_ok());
        attack
            .closed_by_daemon
            .fetch_add(before - conns.len(), Ordering::SeqCst);
        let want = if first {
            n
        } else {
            n.min(conns.len() + REOPEN_PER_ROUND)
        };
        first = false;
        while conns.len() < want {
            let Some(mut s) = connect_nonblocking(to) else { break };
            if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").is_ok() {
                conns.push(s);
                attack.opened.fetch_add(1, Ordering::SeqCst);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Raises this process' soft file-descriptor limit to its hard one (the attack needs some
/// thousands); the daemon started later inherits it.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn healthz_stays_fast_and_the_daemon_bounded_under_idle_and_slow_clients() {
    raise_fd_limit();
    let limits = Limits::for_this_process();
    let mut spec = TestbedSpec::new("kph", BIN);
    spec.endpoints = 1;
    let bed = Testbed::build(&spec).expect("test bed");
    let dir = ManifestDir::new("kp-http-limits");
    let eps = [Ep::local(bed.endpoint(0).ip)];
    let mut lb = ServiceSpec::new("lb", "10.96.165.10", &eps);
    lb.node_port = Some(32517);
    lb.load_balancer_ip = Some("203.0.113.10");
    let extra = format!("  externalTrafficPolicy: Local\n  healthCheckNodePort: {HC_PORT}\n");
    lb.spec_extra = &extra;
    dir.write(&manifests(&[lb]));
    let args: Vec<String> = [
        "--hostname-override=node-a",
        "--iptables-min-sync-period=0s",
        "--manifests",
        &dir.0.display().to_string(),
    ]
    .map(String::from)
    .into();
    let daemon = bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
    daemon
        .wait_for_log("Synced rules", Duration::from_secs(20))
        .expect("first sync");
    let pid = daemon.pid();
    let healthz = SocketAddr::new(bed.node_ip(), 10256);
    let hc = SocketAddr::new(bed.node_ip(), HC_PORT);
    let metrics: SocketAddr = "127.0.0.1:10249".parse().unwrap();
    let (out_ns, node_ns) = (bed.outside.name().to_string(), bed.node.name().to_string());
    wait_until(Duration::from_secs(10), "the health check node port", || {
        in_netns(&out_ns, || timed_get(hc, "/")).is_ok_and(|(s, _)| s == 200)
    });
    let (fds_before, rss_before) = fds_and_rss(pid);
    println!(
        "before: {fds_before} fds, {} MiB RSS; limit {} connections",
        rss_before / 1024,
        limits.max_connections
    );

    let stop = AtomicBool::new(false);
    let attack = Attack::default();
    let (mut healthz_times, mut failures, mut peak) = (Vec::new(), Vec::new(), (0usize, 0u64));
    std::thread::scope(|s| {
        let (stop, attack) = (&stop, &attack);
        let (out_ns, node_ns) = (&out_ns, &node_ns);
        s.spawn(move || in_netns(out_ns, || idle_clients(&[healthz, hc], IDLE_PER_TARGET, stop, attack)));
        s.spawn(move || in_netns(node_ns, || idle_clients(&[metrics], IDLE_PER_TARGET / 3, stop, attack)));
        s.spawn(move || in_netns(out_ns, || slowloris(healthz, SLOWLORIS, stop, attack)));
        s.spawn(move || in_netns(out_ns, || slowloris(hc, SLOWLORIS, stop, attack)));
        let started = Instant::now();
        let mut round = 0u32;
        while started.elapsed() < ATTACK {
            round += 1;
            let (to, path, ns) = match round % 4 {
                1 => (hc, "/", out_ns),
                2 => (metrics, "/metrics", node_ns),
                _ => (healthz, "/healthz", out_ns),
            };
            match in_netns(ns, || timed_get(to, path)) {
                Ok((200, took)) if path == "/healthz" => healthz_times.push(took),
                Ok((200, took)) if took <= HEALTHZ_BOUND => {}
                other => failures.push(format!("{path} at {:?}: {other:?}", started.elapsed())),
            }
            let (fds, rss) = fds_and_rss(pid);
            peak = (peak.0.max(fds), peak.1.max(rss));
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, Ordering::SeqCst);
    });
    healthz_times.sort();
    let pct = |p: f64| healthz_times[((healthz_times.len() - 1) as f64 * p) as usize];
    println!(
        "attack: {} connections opened, {} closed by the daemon; /healthz ×{}: p50 {:?}, p99 {:?}, max {:?}; peak {} fds, {} MiB RSS",
        attack.opened.load(Ordering::SeqCst),
        attack.closed_by_daemon.load(Ordering::SeqCst),
        healthz_times.len(),
        pct(0.5),
        pct(0.99),
        pct(1.0),
        peak.0,
        peak.1 / 1024
    );
    assert!(failures.is_empty(), "answers under attack: {failures:#?}");
    assert!(healthz_times.len() >= 40, "{} /healthz answered", healthz_times.len());
    assert!(
        pct(1.0) <= HEALTHZ_BOUND,
        "/healthz within {HEALTHZ_BOUND:?}: max {:?}",
        pct(1.0)
    );
    let opened = attack.opened.load(Ordering::SeqCst);
    assert!(
        opened > limits.max_connections * 2,
        "the attack went past the limit: {opened} opened"
    );
    // Each connection is one descriptor; beyond the limit, only the few of a connection being
    // replaced and the probes' own.
    let fd_bound = fds_before + limits.max_connections + 64;
    assert!(peak.0 <= fd_bound, "peak {} fds > {fd_bound}", peak.0);
    assert!(
        peak.1 <= rss_before + 128 * 1024,
        "RSS {} MiB, from {} MiB",
        peak.1 / 1024,
        rss_before / 1024
    );
    // Once the clients are gone, so are their connections.
    wait_until(Duration::from_secs(15), "the daemon's descriptors back down", || {
        fds_and_rss(pid).0 <= fds_before + 16
    });
    drop(daemon);
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-restore")] =>
        healthz_stays_fast_and_the_daemon_bounded_under_idle_and_slow_clients;
}
