//! Benchmark of an endpoint change as a user sees it: from the change reaching the source (an
//! EndpointSlice written to the API server, or a manifest file renamed into place) to the first
//! connection that lands on the new endpoint. Needs root; everything happens in network
//! namespaces the benchmark creates (guards delete them on drop, also on a panic).
//!
//! Run with `cargo bench --bench latency` (as root; `benches/run` runs it with the others).
//! For each case in `CASES` (`MODE:SERVICESxENDPOINTS`) and each source in `SOURCES`:
//! - a test bed (`kube_proxy::lab::testbed`: client pod, two endpoint pods running
//!   `lab serve`, which answers every connection with its name, routed through a node
//!   namespace);
//! - the synthetic cluster (`synthetic::state`, NodePorts made unique) of SERVICES Services ×
//!   ENDPOINTS endpoints plus the Service `default/flip` (ClusterIP 10.111.255.200:80), whose
//!   single endpoint is one of the two pods. With `api` they are stored in the test API server
//!   (tests/support/apiserver, running in the node namespace) and the daemon gets a
//!   kubeconfig; with `manifests` they are files (500 Services per file; `flip` alone in
//!   `flip.yaml`) and the daemon gets `--manifests DIR`;
//! - the real release daemon (`CARGO_BIN_EXE_kube-proxy`) in the node namespace, with
//!   `--proxy-mode=MODE -v 2` and otherwise upstream's defaults (`minSyncPeriod` 1 s);
//! - a prober thread in the client namespace that connects to the ClusterIP every
//!   `PROBE_INTERVAL_US` (each connect from the kernel's next ephemeral port, closed with an
//!   RST: no connection reuses a source port, see PITFALLS.md) and records who answered.
//!
//! Once the daemon has synced and `flip` answers from pod 1, the endpoint is flipped `FLIPS`
//! times between the pods, `SPACING_MS` apart (beyond `minSyncPeriod`, so that each change is
//! one sync started at once, as after a quiet period). A flip's latency is the time from the
//! change (`ApiServer::apply` called, or `rename` called) to the start of the first connect
//! answered by the new pod; the resolution is the prober's interval. Every connect after that
//! one must land on the new pod (counted as `stale` otherwise) and none may fail (`errors`).
//!
//! The daemon's log (klog lines with µs timestamps, `-v 2`) splits each flip into: the source
//! (to its `Watch event` line, or to the end of `Read the manifests`), the loop (to the start
//! of `Built the state`), building the state, the proxier (to the end of `Synced rules`), and
//! the rest (the kernel and the prober's resolution). p50 and p99 of the latency, medians of
//! the parts, are printed, and with `BENCH_JSON=PATH` written as JSON (`benches/report.py`
//! turns it into README's table).
//!
//! Environment (all optional): `CASES` (default
//! `nftables:10000x10,nftables:44000x1,nftables:5000x50,iptables:10000x10`), `SOURCES` (default
//! `api,manifests`), `FLIPS` (default 100), `SPACING_MS` (default 1200), `PROBE_INTERVAL_US`
//! (default 1000), `SHOW_LOG` (set: print the daemon's log lines of the last flip).

#[path = "../tests/support/apiserver/mod.rs"]
mod apiserver;
#[path = "common/cluster.rs"]
mod cluster;
mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cluster::{
    Case, Feed, Probe, Prober, SERVICE_PORT, Source, daemon_args, endpoint_object, lock, node_object, rss_kib,
    service_object, slice_object, synthetic_ports, tail, wait_first_sync, write_docs,
};
use common::{env_usize, field, loadavg, loadavg_1m, percentile_of, progress, thousands};
use kube_proxy::lab::testbed::{SERVER_PORT, Testbed, TestbedSpec};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const FLIP_NS: &str = "default";
const FLIP_NAME: &str = "flip";
const FLIP_IP: &str = "10.111.255.200";
/// A flip not seen in traffic by then fails the benchmark.
const FLIP_TIMEOUT: Duration = Duration::from_secs(10);

/// The flipped Service and its EndpointSlice, with `ip` its one endpoint (on this node).
fn flip_objects(ip: IpAddr) -> Vec<Value> {
    vec![
        service_object(FLIP_NS, FLIP_NAME, FLIP_IP, 0, SERVER_PORT),
        slice_object(FLIP_NS, FLIP_NAME, SERVER_PORT, vec![endpoint_object(ip, "node-a")]),
    ]
}

/// Makes `ip` the flipped Service's endpoint; the time just before the change was handed
/// over (monotonic, and the wall clock the daemon's log uses). Through the API only the slice
/// is written; a manifest is the file renamed into place.
fn flip(feed: &Feed, ip: IpAddr) -> (Instant, SystemTime) {
    let [_, slice] = <[Value; 2]>::try_from(flip_objects(ip)).expect("two objects");
    match feed {
        Feed::Api { api, .. } => {
            let t = (Instant::now(), SystemTime::now());
            api.apply(slice);
            t
        }
        Feed::Manifests { dir } => {
            let (tmp, file) = (dir.path().join("flip.tmp"), dir.path().join("flip.yaml"));
            write_docs(&tmp, &flip_objects(ip));
            let t = (Instant::now(), SystemTime::now());
            std::fs::rename(&tmp, &file).expect("rename the flipped manifest into place");
            t
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The daemon's log.

/// Seconds since midnight (UTC) of a klog line (`I1202 05:19:33.123456 ...`).
fn line_time(line: &str) -> Option<f64> {
    let t = line.get(6..21)?;
    let (h, m, s) = (t.get(0..2)?, t.get(3..5)?, t.get(6..)?);
    Some(h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
}

/// Seconds since midnight (UTC) of a wall-clock time.
fn day_time(t: SystemTime) -> f64 {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_nanos()) * 1e-9
}

/// Seconds from `a` to `b`, both seconds of a day, across midnight too.
fn day_diff(a: f64, b: f64) -> f64 {
    let d = b - a;
    if d < -43_200.0 { d + 86_400.0 } else { d }
}

/// A daemon log line of interest: its time (seconds of the day) and `elapsedMs`.
#[derive(Clone, Copy, Debug)]
struct Mark {
    at: f64,
    elapsed_ms: f64,
}

/// The first line after `after` (seconds of the day) and before `before` whose message is
/// `msg` and whose fields match `fields`.
fn mark(log: &[(f64, &str)], msg: &str, fields: &[(&str, &str)], after: f64, before: f64) -> Option<Mark> {
    let quoted = format!("] \"{msg}\"");
    log.iter()
        .filter(|(t, _)| day_diff(after, *t) >= 0.0 && day_diff(*t, before) > 0.0)
        .find(|(_, l)| l.contains(&quoted) && fields.iter().all(|(k, v)| field(l, k) == Some(*v)))
        .map(|(t, l)| Mark {
            at: *t,
            elapsed_ms: field(l, "elapsedMs").and_then(|v| v.parse().ok()).unwrap_or(0.0),
        })
}

/// Where one flip's time went, in ms from the change.
#[derive(Clone, Copy, Debug, Default)]
struct Parts {
    /// The source: its watch event logged, or the changed file re-read.
    source: f64,
    /// The loop: from there to the start of building the state.
    queue: f64,
    /// Building the state.
    build: f64,
    /// The proxier: from the state built to its `Synced rules`.
    proxier: f64,
    /// From the sync's end to the first connect on the new pod (kernel, prober resolution).
    traffic: f64,
}

/// The parts of a flip at `t0` (seconds of the day) that took `latency_ms`, from the lines
/// logged before the next flip at `next`.
fn parts(log: &[(f64, &str)], source: Source, t0: f64, next: f64, latency_ms: f64) -> Option<Parts> {
    let v4 = [("ipFamily", "IPv4")];
    let sourced = match source {
        Source::Api => mark(log, "Watch event", &[("kind", "EndpointSlice")], t0, next)?.at,
        Source::Manifests => mark(log, "Read the manifests", &[], t0, next)?.at,
    };
    let built = mark(log, "Built the state", &v4, sourced, next)?;
    let synced = mark(log, "Synced rules", &v4, built.at, next)?;
    let ms = |a: f64, b: f64| day_diff(a, b) * 1e3;
    let build_start = built.at - built.elapsed_ms / 1e3;
    Some(Parts {
        source: ms(t0, sourced),
        queue: ms(sourced, build_start),
        build: built.elapsed_ms,
        proxier: ms(built.at, synced.at),
        traffic: latency_ms - ms(t0, synced.at),
    })
}

// ---------------------------------------------------------------------------------------------
// One case.

struct Outcome {
    case: Case,
    source: Source,
    /// Start → every family synced.
    to_synced: Duration,
    /// Each flip's latency, in order.
    latencies: Vec<Duration>,
    parts: Vec<Parts>,
    /// Connects answered by the old pod after the first one answered by the new pod.
    stale: usize,
    errors: usize,
    first_error: Option<String>,
    probes: usize,
    load: f64,
    rss_kib: u64,
}

struct Knobs {
    flips: usize,
    spacing: Duration,
    interval: Duration,
}

fn run_case(case: &Case, source: Source, k: &Knobs) -> Outcome {
    println!("[{} from {}]", case.label(), source.as_str());
    let mut spec = TestbedSpec::new("kplat", BIN);
    spec.endpoints = 2;
    let bed = Testbed::build(&spec).expect("the test bed builds (root and iproute2 needed)");
    let pods: Vec<String> = bed.endpoints().iter().map(|e| e.name.clone()).collect();
    let ports = synthetic_ports(case);
    let node = node_object(bed.has_ipv6());
    let first = bed.endpoint(0).ip;
    progress(format!(
        "storing {} Services x {} endpoints and {FLIP_NS}/{FLIP_NAME} ({})",
        thousands(case.services),
        case.endpoints,
        source.as_str()
    ));
    let extra = [("flip", flip_objects(first))];
    let feed = match source {
        Source::Api => Feed::api(bed.node.name(), &ports, node, &extra),
        Source::Manifests => Feed::manifests(&ports, node, &extra),
    };
    drop(ports);
    let args = daemon_args(&case.mode, &feed);
    progress(format!("starting {BIN} {}", args.join(" ")));
    let t = Instant::now();
    let mut daemon = bed.spawn_in_node(Path::new(BIN), &args).expect("the daemon starts");
    wait_first_sync(&mut daemon, case.services + 1);
    let to_synced = t.elapsed();
    progress(format!("first sync after {:.1} s", to_synced.as_secs_f64()));

    let to = SocketAddr::new(FLIP_IP.parse().expect("an IP"), SERVICE_PORT);
    let prober = Prober::start(bed.client.name(), to, pods.clone(), k.interval);
    let ready = prober.first_answer(0, Instant::now(), 0, Instant::now() + Duration::from_secs(30));
    assert!(
        ready.is_some(),
        "{to} never answered from {}:\n{}",
        pods[0],
        tail(&daemon.log(), 40)
    );
    progress(format!(
        "{to} answers from {}; flipping its endpoint {} times, {} ms apart (load {})",
        pods[0],
        k.flips,
        k.spacing.as_millis(),
        loadavg()
    ));
    let load_start = loadavg_1m();
    let mut current = 0;
    let mut flips: Vec<(Instant, SystemTime, Instant)> = Vec::new();
    let mut last = Instant::now();
    for i in 0..k.flips {
        let target = 1 - current;
        if let Some(rest) = (last + k.spacing).checked_duration_since(Instant::now()) {
            std::thread::sleep(rest); // spacing, not synchronisation
        }
        let from = prober.len();
        let (t0, wall) = flip(&feed, bed.endpoint(target).ip);
        last = t0;
        let Some(seen) = prober.first_answer(from, t0, target, t0 + FLIP_TIMEOUT) else {
            panic!(
                "flip {i}: {to} not answered by {} within {FLIP_TIMEOUT:?}; the daemon's log ends:\n{}",
                pods[target],
                tail(&daemon.log(), 40)
            );
        };
        flips.push((t0, wall, seen));
        current = target;
        if (i + 1) % 25 == 0 {
            progress(format!("{} flips", i + 1));
        }
    }
    // Let the last window fill before counting.
    std::thread::sleep(k.spacing.min(Duration::from_millis(500)));
    let records = prober.records();
    let first_error = lock(&prober.first_error).clone();
    drop(prober);
    let rss = rss_kib(daemon.pid());
    let load = (load_start + loadavg_1m()) / 2.0;

    let (stale, errors) = count_misses(&records, &flips);
    let log = daemon.log();
    if std::env::var_os("SHOW_LOG").is_some()
        && let Some((_, wall, _)) = flips.last()
    {
        let t0 = day_time(*wall);
        for l in log
            .lines()
            .filter(|l| line_time(l).is_some_and(|t| day_diff(t0, t) >= 0.0))
        {
            println!("    {l}");
        }
    }
    let timed: Vec<(f64, &str)> = log.lines().filter_map(|l| Some((line_time(l)?, l))).collect();
    let mut all_parts = Vec::new();
    for (i, (t0, wall, seen)) in flips.iter().enumerate() {
        let next = flips.get(i + 1).map_or(day_time(SystemTime::now()), |f| day_time(f.1));
        let latency_ms = seen.duration_since(*t0).as_secs_f64() * 1e3;
        if let Some(p) = parts(&timed, source, day_time(*wall), next, latency_ms) {
            all_parts.push(p);
        }
    }
    let latencies: Vec<Duration> = flips.iter().map(|(t0, _, seen)| seen.duration_since(*t0)).collect();
    drop(daemon);
    drop(feed);
    let outcome = Outcome {
        case: case.clone(),
        source,
        to_synced,
        latencies,
        parts: all_parts,
        stale,
        errors,
        first_error,
        probes: records.len(),
        load,
        rss_kib: rss,
    };
    let (p50, p99) = (outcome.percentile(0.5), outcome.percentile(0.99));
    progress(format!(
        "change live p50 {p50:.1} ms, p99 {p99:.1} ms; {} stale, {} failed of {} connects",
        stale, errors, outcome.probes
    ));
    outcome
}

/// Connects answered by the old pod after a flip's first answer from the new one, before the
/// next flip; and connects that failed, from the first flip on.
fn count_misses(records: &[Probe], flips: &[(Instant, SystemTime, Instant)]) -> (usize, usize) {
    let Some(start) = flips.first().map(|f| f.0) else {
        return (0, 0);
    };
    let mut stale = 0;
    for (i, (_, _, seen)) in flips.iter().enumerate() {
        let end = flips.get(i + 1).map(|f| f.0);
        // The pod that answered first after the flip is the new one.
        let new = records.iter().find(|p| p.start == *seen).and_then(|p| p.pod);
        stale += records
            .iter()
            .filter(|p| p.start > *seen && end.is_none_or(|e| p.start < e))
            .filter(|p| p.pod.is_some() && p.pod != new)
            .count();
    }
    let errors = records.iter().filter(|p| p.start >= start && p.pod.is_none()).count();
    (stale, errors)
}

impl Outcome {
    /// A percentile of the latencies, in ms.
    fn percentile(&self, p: f64) -> f64 {
        let mut v: Vec<f64> = self.latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        percentile_of(&mut v, p)
    }

    /// The median of one part, in ms.
    fn part(&self, f: fn(&Parts) -> f64) -> f64 {
        let mut v: Vec<f64> = self.parts.iter().map(f).collect();
        percentile_of(&mut v, 0.5)
    }

    /// The p99 target of the issue for this case, in ms.
    fn target_ms(&self) -> f64 {
        match (self.case.mode.as_str(), self.case.services, self.case.endpoints) {
            ("nftables", 10_000, 10) => 30.0,
            ("nftables", _, _) => 40.0,
            _ => 150.0,
        }
    }

    fn json(&self) -> Value {
        let r = |v: f64| (v * 10.0).round() / 10.0;
        json!({
            "mode": self.case.mode,
            "source": self.source.as_str(),
            "services": self.case.services,
            "endpoints": self.case.endpoints,
            "flips": self.latencies.len(),
            "p50_ms": r(self.percentile(0.5)),
            "p99_ms": r(self.percentile(0.99)),
            "max_ms": r(self.percentile(1.0)),
            "target_p99_ms": self.target_ms(),
            "parts_p50_ms": {
                "source": r(self.part(|p| p.source)),
                "loop": r(self.part(|p| p.queue)),
                "build": r(self.part(|p| p.build)),
                "proxier": r(self.part(|p| p.proxier)),
                "traffic": r(self.part(|p| p.traffic)),
            },
            "parts_found": self.parts.len(),
            "stale": self.stale,
            "errors": self.errors,
            "probes": self.probes,
            "first_sync_s": r(self.to_synced.as_secs_f64()),
            "rss_mib": r(self.rss_kib as f64 / 1024.0),
            "load_average": (self.load * 100.0).round() / 100.0,
        })
    }
}

fn print_table(outcomes: &[Outcome], k: &Knobs) {
    println!();
    println!(
        "Endpoint change live, end to end: {} flips {} ms apart, a connect every {} µs (ms; parts are medians)",
        k.flips,
        k.spacing.as_millis(),
        k.interval.as_micros()
    );
    println!(
        "{:<22} {:<10} {:>7} {:>7} {:>7} {:>8} | {:>7} {:>7} {:>7} {:>8} {:>8} | {:>5} {:>6} {:>8} {:>6}",
        "case",
        "source",
        "p50",
        "p99",
        "max",
        "target",
        "source",
        "loop",
        "build",
        "proxier",
        "traffic",
        "stale",
        "errors",
        "synced",
        "load"
    );
    for o in outcomes {
        let p99 = o.percentile(0.99);
        let verdict = if p99 <= o.target_ms() { "ok" } else { "ABOVE" };
        println!(
            "{:<22} {:<10} {:>7.1} {:>7.1} {:>7.1} {:>3.0} {:<4} | {:>7.1} {:>7.1} {:>7.1} {:>8.1} {:>8.1} | {:>5} {:>6} {:>6.1} s {:>6.2}",
            o.case.label(),
            o.source.as_str(),
            o.percentile(0.5),
            p99,
            o.percentile(1.0),
            o.target_ms(),
            verdict,
            o.part(|p| p.source),
            o.part(|p| p.queue),
            o.part(|p| p.build),
            o.part(|p| p.proxier),
            o.part(|p| p.traffic),
            o.stale,
            o.errors,
            o.to_synced.as_secs_f64(),
            o.load
        );
        if let Some(e) = &o.first_error {
            println!("    first failed connect: {e}");
        }
    }
}

fn main() {
    let cases = cluster::cases_from_env("nftables:10000x10,nftables:44000x1,nftables:5000x50,iptables:10000x10");
    let sources = cluster::sources_from_env("api,manifests");
    let k = Knobs {
        flips: env_usize("FLIPS", 100).max(1),
        spacing: Duration::from_millis(env_usize("SPACING_MS", 1200) as u64),
        interval: Duration::from_micros(env_usize("PROBE_INTERVAL_US", 1000) as u64),
    };
    common::start_clock();
    assert!(
        nix::unistd::geteuid().is_root(),
        "the latency benchmark needs root (network namespaces)"
    );
    let load_start = loadavg_1m();
    println!(
        "latency benchmark: CASES={:?} SOURCES={:?} FLIPS={} SPACING_MS={} PROBE_INTERVAL_US={}; load average {}",
        cases.iter().map(Case::label).collect::<Vec<_>>(),
        sources.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        k.flips,
        k.spacing.as_millis(),
        k.interval.as_micros(),
        loadavg()
    );
    let mut outcomes = Vec::new();
    for case in &cases {
        for &source in &sources {
            outcomes.push(run_case(case, source, &k));
        }
    }
    print_table(&outcomes, &k);
    println!("load average at the end: {}", loadavg());
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let figures = json!({
            "bench": "latency",
            "flips": k.flips,
            "spacing_ms": k.spacing.as_millis() as u64,
            "probe_interval_us": k.interval.as_micros() as u64,
            "load_average_start": load_start,
            "load_average_end": loadavg_1m(),
            "cases": outcomes.iter().map(Outcome::json).collect::<Vec<_>>(),
        });
        let text = serde_json::to_string_pretty(&figures).expect("JSON");
        std::fs::write(&path, text + "\n").unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("figures written to {path}");
    }
    let bad: usize = outcomes.iter().map(|o| o.stale + o.errors).sum();
    assert_eq!(bad, 0, "{bad} connects failed or reached the old endpoint (see above)");
}
