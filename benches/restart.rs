//! Benchmark of a restart under traffic, as a DaemonSet rollout or a config change makes one on
//! every node: the daemon, synced with a large cluster, killed and started again while clients
//! keep opening connections to several Services and one connection stays open. Needs root;
//! everything happens in network namespaces the benchmark creates (guards delete them on drop,
//! also on a panic).
//!
//! Run with `cargo bench --bench restart` (as root; `BENCHES=restart benches/run` writes
//! `docs/bench/restart.json` and README's restart table). For each case in `CASES`
//! (`MODE:SERVICESxENDPOINTS`) and each source in `SOURCES`:
//! - a test bed (`kube_proxy::lab::testbed`) with two endpoint pods running `lab serve`;
//! - the synthetic cluster of SERVICES × ENDPOINTS (as in `benches/latency.rs`) and three
//!   probed Services whose endpoints are both pods, named to come first (`aaa/first`), in the
//!   middle (`ns25/probe-middle`, among the synthetic `ns25/svc…`) and last (`zzz/last`) of the
//!   sync order;
//! - the release daemon in the node namespace, `--proxy-mode=MODE -v 2`, upstream's defaults.
//!
//! Once it has synced, a prober per probed Service connects every `PROBE_INTERVAL_US` from the
//! client pod (each connect a new source port, closed with an RST), and one TCP connection to
//! `first` sends a line every 20 ms and reads its echo. Then `RESTARTS` times: the daemon is
//! stopped (SIGKILL, SIGTERM, SIGKILL, …: a crash, then what a rollout sends), a new one is
//! started with the same arguments, and the benchmark waits for its first sync of every
//! Service and 1 s more. Per restart it reports the time to that sync and, per probed
//! Service, the connects made from the stop to the end of that second, the failed ones and
//! the longest gap between two answered connects. Any failed connect, or a line of the open
//! connection not echoed, fails the benchmark: a restart must not make any Service
//! unreachable, not even for a moment.
//!
//! Environment (all optional): `CASES` (default `nftables:10000x10,iptables:10000x10`),
//! `SOURCES` (default `api`; `api,manifests` for both), `RESTARTS` (default 3),
//! `PROBE_INTERVAL_US` (default 2000), `BENCH_JSON` (write the figures there).

#[path = "../tests/support/apiserver/mod.rs"]
mod apiserver;
#[path = "common/cluster.rs"]
mod cluster;
mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cluster::{
    Case, Feed, Probe, Prober, SERVICE_PORT, Source, daemon_args, endpoint_object, lock, node_object, service_object,
    slice_object, synthetic_ports, tail, wait_first_sync,
};
use common::{env_usize, loadavg, loadavg_1m, progress, thousands};
use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::testbed::{SERVER_PORT, Testbed, TestbedSpec};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
/// The probed Services (namespace, name, ClusterIP), in the order a sync meets them.
const PROBED: [(&str, &str, &str); 3] = [
    ("aaa", "first", "10.111.255.201"),
    ("ns25", "probe-middle", "10.111.255.202"),
    ("zzz", "last", "10.111.255.203"),
];
/// After its first sync the restarted daemon is watched this much longer: whatever it does
/// right after (deleting what it no longer wants, a second sync) is inside the window.
const AFTER_SYNC: Duration = Duration::from_secs(1);
/// A line of the open connection every this long; its echo must come within the timeout.
const STREAM_INTERVAL: Duration = Duration::from_millis(20);
const STREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a stopped daemon may take to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// The probed Services and their slices, both pods their endpoints.
fn probed_objects(bed: &Testbed) -> Vec<Value> {
    let eps: Vec<Value> = bed
        .endpoints()
        .iter()
        .map(|e| endpoint_object(e.ip, "node-a"))
        .collect();
    PROBED
        .iter()
        .flat_map(|(ns, name, ip)| {
            [
                service_object(ns, name, ip, 0, SERVER_PORT),
                slice_object(ns, name, SERVER_PORT, eps.clone()),
            ]
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The open connection.

#[derive(Clone, Debug, Default)]
struct StreamReport {
    sent: u64,
    echoed: u64,
    /// The first error, which ends the stream.
    error: Option<String>,
}

/// One TCP connection from the client namespace that sends a numbered line every
/// [`STREAM_INTERVAL`] and reads its echo, until stopped (on drop too).
struct Stream {
    report: Arc<Mutex<StreamReport>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Stream {
    fn start(client_ns: &str, to: SocketAddr) -> Stream {
        let report = Arc::new(Mutex::new(StreamReport::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s, ns) = (report.clone(), stop.clone(), client_ns.to_string());
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("the client's netns file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns (needs root)");
            if let Err(e) = stream_lines(to, &r, &s) {
                lock(&r).error = Some(e);
            }
        });
        Stream {
            report,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the stream and returns what it did.
    fn finish(mut self) -> StreamReport {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        lock(&self.report).clone()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn stream_lines(to: SocketAddr, report: &Mutex<StreamReport>, stop: &AtomicBool) -> Result<(), String> {
    let stream = TcpStream::connect_timeout(&to, STREAM_TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(STREAM_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).map_err(|e| format!("greeting: {e}"))?;
    let mut n: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let start = Instant::now();
        n += 1;
        writer
            .write_all(format!("line {n}\n").as_bytes())
            .map_err(|e| format!("write of line {n}: {e}"))?;
        lock(report).sent = n;
        line.clear();
        reader
            .read_line(&mut line)
            .map_err(|e| format!("echo of line {n}: {e}"))?;
        if line.trim_end() != format!("line {n}") {
            return Err(format!("line {n} echoed as {line:?}"));
        }
        lock(report).echoed = n;
        // Pacing, not synchronisation.
        if let Some(rest) = (start + STREAM_INTERVAL).checked_duration_since(Instant::now()) {
            std::thread::sleep(rest);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// One case.

/// What one probed Service saw during one restart.
#[derive(Clone, Debug)]
struct Window {
    service: String,
    connects: usize,
    failed: usize,
    /// The longest time between the starts of two answered connects, in ms.
    max_gap_ms: f64,
}

struct Restart {
    signal: Signal,
    to_first_sync: Duration,
    windows: Vec<Window>,
}

struct Outcome {
    case: Case,
    source: Source,
    first_sync: Duration,
    restarts: Vec<Restart>,
    stream: StreamReport,
    first_error: Option<String>,
    load: f64,
}

/// The connects of `records` that started in `[from, to)`.
fn window(service: &str, records: &[Probe], from: Instant, to: Instant) -> Window {
    let inside: Vec<&Probe> = records.iter().filter(|p| p.start >= from && p.start < to).collect();
    let answered: Vec<Instant> = inside.iter().filter(|p| p.pod.is_some()).map(|p| p.start).collect();
    let max_gap_ms = answered
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3)
        .fold(0.0, f64::max);
    Window {
        service: service.to_string(),
        connects: inside.len(),
        failed: inside.iter().filter(|p| p.pod.is_none()).count(),
        max_gap_ms,
    }
}

fn stop(mut daemon: ChildGuard, signal: Signal) -> Instant {
    let at = Instant::now();
    daemon.signal(signal).unwrap_or_else(|e| panic!("{signal}: {e}"));
    let exited = daemon.wait_timeout(EXIT_TIMEOUT).expect("waiting for the daemon");
    assert!(
        exited.is_some(),
        "the daemon did not exit within {EXIT_TIMEOUT:?} of {signal}"
    );
    at
}

fn run_case(case: &Case, source: Source, restarts: usize, interval: Duration) -> Outcome {
    println!("[{} from {}]", case.label(), source.as_str());
    let mut spec = TestbedSpec::new("kprst", BIN);
    spec.endpoints = 2;
    let bed = Testbed::build(&spec).expect("the test bed builds (root and iproute2 needed)");
    let pods: Vec<String> = bed.endpoints().iter().map(|e| e.name.clone()).collect();
    let ports = synthetic_ports(case);
    let node = node_object(bed.has_ipv6());
    progress(format!(
        "storing {} Services x {} endpoints and {} probed ones ({})",
        thousands(case.services),
        case.endpoints,
        PROBED.len(),
        source.as_str()
    ));
    let extra = [("probed", probed_objects(&bed))];
    let feed = match source {
        Source::Api => Feed::api(bed.node.name(), &ports, node, &extra),
        Source::Manifests => Feed::manifests(&ports, node, &extra),
    };
    drop(ports);
    let services = case.services + PROBED.len();
    let args = daemon_args(&case.mode, &feed);
    progress(format!("starting {BIN} {}", args.join(" ")));
    let t = Instant::now();
    let mut daemon = bed.spawn_in_node(Path::new(BIN), &args).expect("the daemon starts");
    wait_first_sync(&mut daemon, services);
    let first_sync = t.elapsed();
    progress(format!("first sync after {:.1} s", first_sync.as_secs_f64()));

    let targets: Vec<SocketAddr> = PROBED
        .iter()
        .map(|(_, _, ip)| SocketAddr::new(ip.parse().expect("an IP"), SERVICE_PORT))
        .collect();
    let probers: Vec<Prober> = targets
        .iter()
        .map(|to| Prober::start(bed.client.name(), *to, pods.clone(), interval))
        .collect();
    for (p, to) in probers.iter().zip(&targets) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let answered = (0..pods.len()).any(|pod| p.first_answer(0, Instant::now(), pod, deadline).is_some());
        assert!(answered, "{to} never answered:\n{}", tail(&daemon.log(), 40));
    }
    let stream = Stream::start(bed.client.name(), targets[0]);
    let load_start = loadavg_1m();
    progress(format!(
        "the probed Services answer; {restarts} restarts under traffic (load {})",
        loadavg()
    ));
    let mut done = Vec::new();
    for i in 0..restarts {
        let signal = if i % 2 == 0 { Signal::SIGKILL } else { Signal::SIGTERM };
        let stopped = stop(daemon, signal);
        daemon = bed
            .spawn_in_node(Path::new(BIN), &args)
            .expect("the daemon starts again");
        wait_first_sync(&mut daemon, services);
        let to_first_sync = stopped.elapsed();
        let end = Instant::now() + AFTER_SYNC;
        // The window's last connects are still being made: waiting for it is the measurement.
        std::thread::sleep(AFTER_SYNC + interval * 2);
        let windows: Vec<Window> = probers
            .iter()
            .zip(&PROBED)
            .map(|(p, (ns, name, _))| window(&format!("{ns}/{name}"), &p.records(), stopped, end))
            .collect();
        progress(format!(
            "restart {} ({signal}): first sync after {:.1} s; {}",
            i + 1,
            to_first_sync.as_secs_f64(),
            windows
                .iter()
                .map(|w| format!(
                    "{}: {} failed of {}, longest gap {:.1} ms",
                    w.service, w.failed, w.connects, w.max_gap_ms
                ))
                .collect::<Vec<_>>()
                .join("; ")
        ));
        done.push(Restart {
            signal,
            to_first_sync,
            windows,
        });
    }
    let stream = stream.finish();
    let first_error = probers.iter().find_map(|p| lock(&p.first_error).clone());
    drop(probers);
    let load = (load_start + loadavg_1m()) / 2.0;
    progress(format!(
        "the open connection: {} lines sent, {} echoed{}",
        stream.sent,
        stream.echoed,
        stream.error.as_ref().map(|e| format!(", {e}")).unwrap_or_default()
    ));
    drop(daemon);
    drop(feed);
    Outcome {
        case: case.clone(),
        source,
        first_sync,
        restarts: done,
        stream,
        first_error,
        load,
    }
}

impl Outcome {
    fn failed(&self) -> usize {
        self.restarts.iter().flat_map(|r| &r.windows).map(|w| w.failed).sum()
    }

    fn stream_ok(&self) -> bool {
        self.stream.error.is_none() && self.stream.echoed == self.stream.sent && self.stream.sent > 0
    }

    fn json(&self) -> Value {
        let r = |v: f64| (v * 10.0).round() / 10.0;
        json!({
            "mode": self.case.mode,
            "source": self.source.as_str(),
            "services": self.case.services,
            "endpoints": self.case.endpoints,
            "first_sync_s": r(self.first_sync.as_secs_f64()),
            "restarts": self.restarts.iter().map(|x| json!({
                "signal": x.signal.as_str(),
                "to_first_sync_s": r(x.to_first_sync.as_secs_f64()),
                "services": x.windows.iter().map(|w| json!({
                    "service": w.service,
                    "connects": w.connects,
                    "failed": w.failed,
                    "max_gap_ms": r(w.max_gap_ms),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "stream": {
                "sent": self.stream.sent,
                "echoed": self.stream.echoed,
                "error": self.stream.error,
            },
            "load_average": (self.load * 100.0).round() / 100.0,
        })
    }
}

fn print_table(outcomes: &[Outcome]) {
    println!();
    println!(
        "Restarts under traffic (per restart: time to the first sync; per probed Service: failed of connects, longest gap)"
    );
    for o in outcomes {
        println!(
            "{} from {} (first sync {:.1} s, load {:.2}); open connection: {} of {} lines echoed{}",
            o.case.label(),
            o.source.as_str(),
            o.first_sync.as_secs_f64(),
            o.load,
            o.stream.echoed,
            o.stream.sent,
            o.stream.error.as_ref().map(|e| format!(" ({e})")).unwrap_or_default()
        );
        for (i, x) in o.restarts.iter().enumerate() {
            let services: Vec<String> = x
                .windows
                .iter()
                .map(|w| format!("{} {}/{} {:.1} ms", w.service, w.failed, w.connects, w.max_gap_ms))
                .collect();
            println!(
                "  {} {:<8} {:>6.1} s  {}",
                i + 1,
                x.signal.as_str(),
                x.to_first_sync.as_secs_f64(),
                services.join("  ")
            );
        }
        if let Some(e) = &o.first_error {
            println!("  first failed connect: {e}");
        }
    }
}

fn main() {
    let cases = cluster::cases_from_env("nftables:10000x10,iptables:10000x10");
    let sources = cluster::sources_from_env("api");
    let restarts = env_usize("RESTARTS", 3).max(1);
    let interval = Duration::from_micros(env_usize("PROBE_INTERVAL_US", 2000) as u64);
    common::start_clock();
    assert!(
        nix::unistd::geteuid().is_root(),
        "the restart benchmark needs root (network namespaces)"
    );
    let load_start = loadavg_1m();
    println!(
        "restart benchmark: CASES={:?} SOURCES={:?} RESTARTS={restarts} PROBE_INTERVAL_US={}; load average {}",
        cases.iter().map(Case::label).collect::<Vec<_>>(),
        sources.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        interval.as_micros(),
        loadavg()
    );
    let mut outcomes = Vec::new();
    for case in &cases {
        for &source in &sources {
            outcomes.push(run_case(case, source, restarts, interval));
        }
    }
    print_table(&outcomes);
    println!("load average at the end: {}", loadavg());
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let figures = json!({
            "bench": "restart",
            "restarts": restarts,
            "probe_interval_us": interval.as_micros() as u64,
            "after_sync_ms": AFTER_SYNC.as_millis() as u64,
            "load_average_start": load_start,
            "load_average_end": loadavg_1m(),
            "cases": outcomes.iter().map(Outcome::json).collect::<Vec<_>>(),
        });
        let text = serde_json::to_string_pretty(&figures).expect("JSON");
        std::fs::write(&path, text + "\n").unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("figures written to {path}");
    }
    let failed: usize = outcomes.iter().map(Outcome::failed).sum();
    assert_eq!(failed, 0, "{failed} connects failed during restarts (see above)");
    for o in &outcomes {
        assert!(
            o.stream_ok(),
            "{} from {}: the open connection lost lines: {:?}",
            o.case.label(),
            o.source.as_str(),
            o.stream
        );
    }
}
