//! Benchmark: programming a node. Needs root: it enters a new network namespace of its own
//! (`unshare(CLONE_NEWNET)`), so nothing touches the machine's rules. For 10,000 Services × 10
//! endpoints (or `SERVICES`/`ENDPOINTS` from the environment) it reports:
//! - full render (model → restore input);
//! - a cold full sync by the proxier (empty namespace → every rule live);
//! - a periodic full re-sync on the loaded table;
//! - one endpoint change made live by a partial sync, p50/p99 over `CHANGES` (default 100);
//! - a Service losing its last endpoint and getting it back (each a partial sync that edits
//!   one KUBE-SERVICES rule in place), p50/p99 over `ZEROS` (default 20) round trips, and
//!   its ratio to one endpoint change;
//! - the peak RSS of the largest `iptables-restore`/`iptables-save` child of all those syncs,
//!   and of this process;
//! - last, `iptables-restore` alone on the whole rendered input in one flush-mode run, in a
//!   fresh namespace (the stock tool's floor), with its own peak RSS.
//!
//! Run with `cargo bench --bench sync` (as root); `REPS` (default 3) sets the repetitions of
//! the floor and the cold sync.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::backend::Backend;
use kube_proxy::iptables::exec::Exec;
use kube_proxy::iptables::proxier::IptablesProxier;
use kube_proxy::iptables::{IptablesRenderOptions, render};
use kube_proxy::model::{IpFamily, synthetic};
use kube_proxy::proxy::RenderOptions;
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{UsageWho, getrusage};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn fresh_namespace() {
    unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) needs root");
}

fn opts() -> IptablesRenderOptions {
    IptablesRenderOptions {
        common: RenderOptions {
            local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
            ..RenderOptions::default()
        },
        ..IptablesRenderOptions::default()
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn main() {
    let services = env("SERVICES", 10_000);
    let endpoints = env("ENDPOINTS", 10);
    let changes = env("CHANGES", 100);
    println!("{services} Services x {endpoints} endpoints, iptables {}", version());
    let state = synthetic::state(services, endpoints);

    let mut json = serde_json::Map::new();
    let mut record = |key: &str, value: serde_json::Value| {
        json.insert(key.to_string(), value);
    };
    record("bench", "sync".into());
    record("services", services.into());
    record("endpoints", endpoints.into());
    record("iptables", version().into());
    record("load_average_start", load_average().into());
    let t = Instant::now();
    let full = render(&state, &opts());
    record("render_ms", millis(t.elapsed()));
    println!(
        "{:<48} {:>12}   ({} lines)",
        "full render",
        ms(t.elapsed()),
        full.restore.lines().count()
    );

    // The floor: the whole rendered ruleset in one flush-mode `iptables-restore`, the fastest
    // way the stock tool loads it (the proxier sends the same rules in `--noflush` runs).
    let input = full.restore;

    // Cold syncs first, each in a fresh namespace (the last one stays loaded for the partial
    // syncs below), and the floor after everything of ours: the peak RSS of the children
    // (`iptables-restore`, `iptables-save`) is read in between, before the floor's one large
    // restore raises it. Medians of `REPS` runs.
    let reps = env("REPS", 3).max(1);
    let (mut floors, mut colds) = (Vec::new(), Vec::new());
    // The plain tools, the ones the floor runs (`iptables-restore`).
    let mut proxier = IptablesProxier::new(Exec::new(Backend::Plain, IpFamily::V4), opts());
    for _ in 0..reps {
        fresh_namespace();
        proxier = IptablesProxier::new(Exec::new(Backend::Plain, IpFamily::V4), opts());
        let t = Instant::now();
        let report = proxier.sync(&state).expect("cold full sync");
        colds.push(t.elapsed());
        assert!(report.full);
    }
    colds.sort();
    let cold = percentile(&colds, 0.5);
    record("cold_sync_ms", millis(cold));
    println!(
        "{:<48} {:>12}   (median of {reps})",
        "cold full sync (render + apply)",
        ms(cold),
    );

    // A periodic full sync on the loaded table (forced).
    proxier.force_full_sync();
    let t = Instant::now();
    proxier.sync(&state).expect("full re-sync");
    record("full_resync_ms", millis(t.elapsed()));
    println!("{:<48} {:>12}", "full re-sync on the loaded table", ms(t.elapsed()));

    // One endpoint change at a time: Service k gets a new set of endpoint addresses.
    let mut current = state.clone();
    let mut times = Vec::with_capacity(changes);
    for round in 0..changes {
        let idx = (round * 7919) % services;
        let generation = 1 + round as u32;
        let name = current.service_ports[idx].port.name.name.clone();
        let i: usize = name.trim_start_matches("svc").parse().expect("synthetic name");
        let mut changed = synthetic::service(i, endpoints, generation);
        // Keep all but one endpoint and replace that one, as a rolling update does.
        changed.endpoints.truncate(1);
        let mut eps = current.service_ports[idx].endpoints.clone();
        eps.pop();
        eps.extend(changed.endpoints);
        eps.sort_by_key(|e| e.to_string());
        std::sync::Arc::make_mut(&mut current.service_ports[idx]).endpoints = eps;
        let t = Instant::now();
        let r = proxier.sync(&current).expect("partial sync");
        times.push(t.elapsed());
        assert!(!r.full && r.rewritten_services == 1, "{r:?}");
    }
    times.sort();
    let change_p50 = percentile(&times, 0.5);
    record("change_p50_ms", millis(change_p50));
    record("change_p99_ms", millis(percentile(&times, 0.99)));
    record("changes", changes.into());
    println!(
        "{:<48} {:>12}   p99 {}  (n = {changes})",
        "one endpoint change, partial sync p50",
        ms(change_p50),
        ms(percentile(&times, 0.99))
    );

    // A Service to zero endpoints and back: each direction timed on its own.
    let zeros = env("ZEROS", 20);
    let mut zero_times = Vec::with_capacity(2 * zeros);
    for round in 0..zeros {
        let idx = (round * 104_729 + 13) % services;
        let kept = current.service_ports[idx].endpoints.clone();
        std::sync::Arc::make_mut(&mut current.service_ports[idx])
            .endpoints
            .clear();
        let t = Instant::now();
        let r = proxier.sync(&current).expect("to zero endpoints");
        zero_times.push(t.elapsed());
        assert!(!r.full, "{r:?}");
        std::sync::Arc::make_mut(&mut current.service_ports[idx]).endpoints = kept;
        let t = Instant::now();
        let r = proxier.sync(&current).expect("back from zero");
        zero_times.push(t.elapsed());
        assert!(!r.full, "{r:?}");
    }
    zero_times.sort();
    let zero_p50 = percentile(&zero_times, 0.5);
    record("zero_p50_ms", millis(zero_p50));
    record("zero_p99_ms", millis(percentile(&zero_times, 0.99)));
    record("zero_changes", zero_times.len().into());
    println!(
        "{:<48} {:>12}   p99 {}  (n = {}; {:.2}x one endpoint change)",
        "to zero endpoints or back, partial sync p50",
        ms(zero_p50),
        ms(percentile(&zero_times, 0.99)),
        zero_times.len(),
        zero_p50.as_secs_f64() / change_p50.as_secs_f64()
    );
    let nat = Command::new("iptables-save")
        .args(["-t", "nat"])
        .output()
        .expect("iptables-save");
    let chains = String::from_utf8_lossy(&nat.stdout)
        .lines()
        .filter(|l| l.starts_with(":KUBE-SEP-"))
        .count();
    assert_eq!(chains, services * endpoints, "every endpoint chain is in the kernel");
    record("child_peak_mib", children_peak_mib().into());
    record("own_peak_mib", own_peak_mib().into());
    println!(
        "{:<48} {:>8} MiB   (largest iptables-restore/-save of all the syncs above)",
        "peak RSS of one child",
        children_peak_mib()
    );
    println!(
        "{:<48} {:>8} MiB",
        "peak RSS of this process (model, proxier, bench)",
        own_peak_mib()
    );

    for _ in 0..reps {
        fresh_namespace();
        let t = Instant::now();
        restore_flush(&input);
        floors.push(t.elapsed());
    }
    floors.sort();
    let floor = percentile(&floors, 0.5);
    record("floor_ms", millis(floor));
    record("floor_peak_mib", children_peak_mib().into());
    record("reps", reps.into());
    record("load_average_end", load_average().into());
    println!(
        "{:<48} {:>12}   (median of {reps}; cold sync {:.2}x; peak RSS {} MiB)",
        "iptables-restore alone, whole input (floor)",
        ms(floor),
        cold.as_secs_f64() / floor.as_secs_f64(),
        children_peak_mib()
    );
    // `BENCH_JSON=PATH`: the figures as one JSON object (what `benches/report.py` reads).
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let text = serde_json::to_string_pretty(&serde_json::Value::Object(json)).expect("JSON");
        std::fs::write(&path, text + "\n").unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("figures written to {path}");
    }
}

/// A duration in milliseconds, to 0.1 ms.
fn millis(d: Duration) -> serde_json::Value {
    ((d.as_secs_f64() * 10_000.0).round() / 10.0).into()
}

/// The 1-minute load average (`/proc/loadavg`): how busy the machine was.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// The largest peak RSS of a child waited for so far (`RUSAGE_CHILDREN`), in MiB.
fn children_peak_mib() -> i64 {
    getrusage(UsageWho::RUSAGE_CHILDREN).map_or(0, |u| u.max_rss() / 1024)
}

/// This process's peak RSS, in MiB.
fn own_peak_mib() -> i64 {
    getrusage(UsageWho::RUSAGE_SELF).map_or(0, |u| u.max_rss() / 1024)
}

fn version() -> String {
    Command::new("iptables")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn restore_flush(input: &str) {
    let mut child = Command::new("iptables-restore")
        .arg("--counters")
        .stdin(Stdio::piped())
        .spawn()
        .expect("iptables-restore runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write");
    assert!(child.wait().expect("wait").success(), "iptables-restore failed");
}
