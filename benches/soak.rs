//! The soak benchmark (issue 15): the real daemon (the release build of this tree) in a test
//! bed's node namespace on `SERVICES` × `ENDPOINTS` synthetic Services from `--manifests`,
//! changed at `RATE` changes/s for `DURATION` seconds (Services created and deleted, endpoints
//! scaled, readiness flipped, ports changed; a fifth of the changes go to Services whose
//! endpoints are the bed's pods), with real connections from the client pod throughout, a
//! drift check after every `K` syncs (the kernel read back over netlink / with
//! `iptables-save` against a fresh full render), and the daemon's RSS and CPU sampled every
//! `SAMPLE` seconds. See `kube_proxy::lab::soak` for what each check means. Needs root;
//! everything happens in namespaces it creates.
//!
//! Run: `benches/run soak` (both modes, then the plots), or
//! `MODE=nftables cargo bench --bench soak`. Environment (defaults): `MODE` (nftables),
//! `SERVICES` (10000), `ENDPOINTS` (10), `DURATION` (1800), `RATE` (40), `K` (40),
//! `SAMPLE` (2), `WARMUP` (120, seconds of churn before RSS growth is measured), `SEED` (1),
//! `SOAK_JSON` (docs/bench/soak-MODE.json).
//!
//! Fails (after writing the JSON) on a failed stable connect, a drift, a landing on an
//! endpoint that was not ready, or RSS growth above 5 % (when the run was long enough to tell).

use std::path::PathBuf;

use kube_proxy::lab::soak::{Config, Report, run};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn print(r: &Report) {
    let f = &r.figures;
    let c = &r.config;
    println!(
        "\nsoak, {} mode: {} Services x {} endpoints, {:.0} s at {} changes/s target, drift check every {} syncs",
        c.mode, c.services, c.endpoints, c.duration_s, c.rate, c.k
    );
    println!("load average: {} at the start, {} at the end", r.load_start, r.load_end);
    println!("first sync after {:.1} s", f.first_sync_s);
    println!(
        "changes: {} in {:.0} s of churn ({:.1}/s churning, {:.1}/s over the whole run): {:?}",
        f.changes, f.churn_s, f.rate_churning, f.rate_overall, r.changes_by_kind
    );
    println!(
        "syncs: {} ({} full), elapsed p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        f.syncs, f.full_syncs, f.sync_p50_ms, f.sync_p99_ms, f.sync_max_ms
    );
    println!(
        "drift checks: {}, differences {}; tick (change -> seen in the kernel) p50 {:.0} ms, max {:.0} ms",
        f.drift_checks, f.drift_differences, f.tick_latency_p50_ms, f.tick_latency_max_ms
    );
    for d in r.drift_checks.iter().filter(|d| d.drift.differences > 0).take(3) {
        println!("  at {:.0} s: {:?}", d.t, d.drift.examples);
    }
    println!(
        "stable Services: {} connects, {} failed {:?}",
        r.stable.connects, r.stable.failed, r.stable.examples
    );
    println!(
        "live Services: {} connects, {} landed, {} refused, {} other errors, {} on an endpoint not ready {:?}",
        r.live.connects, r.live.landed, r.live.refused, r.live.other_errors, r.live.violations, r.live.examples
    );
    println!(
        "live Services' endpoint changes: {} seen in the kernel's rules ({} superseded before a read-back), \
         change -> kernel p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {} read-backs failed, {} unmatched",
        r.live.changes_seen,
        r.live.changes_unseen,
        f.live_apply_p50_ms,
        f.live_apply_p99_ms,
        f.live_apply_max_ms,
        r.live.read_back_errors,
        r.live.read_backs_unmatched
    );
    println!(
        "daemon RSS: {:.1} MiB after warm-up, {:.1} MiB at the end (growth {}), peak {:.1} MiB; CPU mean {:.0} % (children {:.0} %)",
        f.rss_start_mib,
        f.rss_end_mib,
        f.rss_growth_pct
            .map_or("unknown: run too short".to_string(), |g| format!("{g:+.2} %")),
        f.rss_peak_mib,
        f.cpu_mean_pct,
        f.children_cpu_mean_pct
    );
}

fn main() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the soak needs root (network namespaces)"
    );
    let mode = std::env::var("MODE").unwrap_or_else(|_| "nftables".to_string());
    assert!(
        ["iptables", "nftables"].contains(&mode.as_str()),
        "MODE: iptables or nftables"
    );
    let cfg = Config {
        services: env_or("SERVICES", 10_000),
        endpoints: env_or("ENDPOINTS", 10),
        duration_s: env_or("DURATION", 1800.0),
        rate: env_or("RATE", 40.0),
        k: env_or("K", 40),
        min_drift_checks: 0,
        sample_every_s: env_or("SAMPLE", 2.0),
        warmup_s: env_or("WARMUP", 120.0),
        pods: 6,
        stable: 3,
        live: 3,
        seed: env_or("SEED", 1),
        binary: PathBuf::from(env!("CARGO_BIN_EXE_kube-proxy")),
        prefix: "kpsoak".to_string(),
        mode,
    };
    println!("soak: {cfg:?}");
    let report = run(&cfg).unwrap_or_else(|e| panic!("the soak failed: {e:#}"));
    let json = std::env::var("SOAK_JSON").unwrap_or_else(|_| format!("docs/bench/soak-{}.json", cfg.mode));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(json);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("the JSON's directory");
    }
    std::fs::write(&path, serde_json::to_string_pretty(&report).expect("JSON")).expect("write the JSON");
    print(&report);
    println!("samples written to {}", path.display());
    let f = &report.figures;
    assert_eq!(f.stable_failed, 0, "failed connects to stable Services");
    assert_eq!(f.drift_differences, 0, "drift between the kernel and a fresh render");
    assert_eq!(
        f.live_violations, 0,
        "connections landed on endpoints that were not ready"
    );
    if cfg.duration_s >= 600.0 {
        let g = f.rss_growth_pct.expect("RSS samples after warm-up");
        assert!(g <= 5.0, "RSS grew by {g:.2} % after warm-up (at most 5 %)");
    }
}
