//! The soak: the real daemon in a test bed's node namespace, on a manifest directory of
//! thousands of Services that changes at a steady rate ([`cluster`]), with real connections
//! from the client pod throughout: to stable Services (none may fail) and to churning Services
//! whose endpoints are the bed's pods (each must land on an endpoint that was ready, within the
//! sync latency: [`watch::History`]). After every K syncs the churn pauses for a drift check
//! ([`drift`]): a tick change marks the point, and once the kernel shows it, its rules are read
//! back and compared with a fresh full render of the same files. The daemon's RSS and
//! CPU are sampled throughout. `benches/soak.rs` runs it at scale; `tests/soak.rs` briefly.

pub mod cluster;
pub mod drift;
pub mod watch;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use cluster::{Change, SoakCluster};
use drift::Drift;
use watch::{History, ProcSample, Sync};

use crate::lab::netns::{ChildGuard, Netns};
use crate::lab::probe::{ERR_REFUSED, ProbeArgs};
use crate::lab::testbed::{POD_CIDR, Testbed, TestbedSpec};

/// How long the daemon must have made no sync before a drift check's tick: beyond nftables
/// mode's delay for deleting stale chains (1 s) and the minimum sync period (1 s), so that the
/// tick's sync also deletes what earlier syncs left for later.
const SETTLE: Duration = Duration::from_millis(2500);
/// How long a tick may take to reach the kernel before the check counts as failed.
const TICK_TIMEOUT: Duration = Duration::from_secs(180);
const FIRST_SYNC_TIMEOUT: Duration = Duration::from_secs(900);
/// Connects per probe batch (one `lab probe` process), 10 ms apart.
const BATCH: u32 = 20;
/// Pause between read-backs of the live Services' rules (each takes milliseconds in nftables
/// mode, tens of milliseconds a chain in iptables mode at 10,000 Services).
const READ_BACK_PAUSE: Duration = Duration::from_millis(100);

/// What to run.
#[derive(Clone, Debug, Serialize)]
pub struct Config {
    /// `iptables` or `nftables`.
    pub mode: String,
    pub services: usize,
    pub endpoints: usize,
    pub duration_s: f64,
    /// Changes per second while churning.
    pub rate: f64,
    /// IPv4 syncs between drift checks.
    pub k: usize,
    /// Drift checks the run must make (the one before the churn counts): where the daemon
    /// syncs slowly (a debug build on a loaded machine), the churn goes on past `duration_s`
    /// until it has made them, for at most three times as long again.
    pub min_drift_checks: usize,
    pub sample_every_s: f64,
    /// RSS growth is measured from this many seconds into the churn.
    pub warmup_s: f64,
    /// Pods (endpoint namespaces) and the stable and live Services on them.
    pub pods: usize,
    pub stable: usize,
    pub live: usize,
    pub seed: u64,
    #[serde(skip)]
    pub binary: PathBuf,
    /// Start of the namespace and directory names.
    #[serde(skip)]
    pub prefix: String,
}

/// One drift check.
#[derive(Clone, Debug, Serialize)]
pub struct DriftCheck {
    pub t: f64,
    /// Rename of the tick's file until the kernel listing showed it (an upper bound of the
    /// path of one change: inotify, re-read, sync; the listing's own time included).
    pub tick_latency_ms: f64,
    /// The whole check, churn paused (settle included).
    pub check_s: f64,
    #[serde(flatten)]
    pub drift: Drift,
}

/// Connections to the stable Services.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StableProbes {
    pub connects: usize,
    pub failed: usize,
    pub examples: Vec<String>,
}

/// Connections to the churning Services.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LiveProbes {
    pub connects: usize,
    pub landed: usize,
    /// Refused: no endpoint was ready, or the daemon had not yet applied one.
    pub refused: usize,
    pub other_errors: usize,
    /// Landed on an endpoint that was not ready then (allowing for the sync latency: until
    /// the kernel was seen holding the change).
    pub violations: usize,
    /// Changes to their endpoints seen in the kernel's rules, and not seen (superseded
    /// before a read-back came by); read-backs that failed.
    pub changes_seen: usize,
    pub changes_unseen: usize,
    pub read_back_errors: usize,
    /// Read-backs whose endpoints matched no version the kernel could be at (a read of
    /// several chains can straddle a sync in iptables mode).
    pub read_backs_unmatched: usize,
    pub examples: Vec<String>,
}

/// The figures of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Figures {
    pub first_sync_s: f64,
    pub churn_s: f64,
    pub changes: usize,
    /// Changes per second of churn time, and of the whole run (drift checks included).
    pub rate_churning: f64,
    pub rate_overall: f64,
    pub syncs: usize,
    pub full_syncs: usize,
    pub sync_p50_ms: f64,
    pub sync_p99_ms: f64,
    pub sync_max_ms: f64,
    pub tick_latency_p50_ms: f64,
    pub tick_latency_max_ms: f64,
    pub drift_checks: usize,
    pub drift_differences: usize,
    pub rss_start_mib: f64,
    pub rss_end_mib: f64,
    pub rss_peak_mib: f64,
    pub rss_growth_pct: Option<f64>,
    pub cpu_mean_pct: f64,
    pub children_cpu_mean_pct: f64,
    pub stable_failed: usize,
    pub live_violations: usize,
    /// Change to a live Service's endpoints (file renamed) → seen in its rules read back.
    pub live_apply_p50_ms: f64,
    pub live_apply_p99_ms: f64,
    pub live_apply_max_ms: f64,
}

/// Everything a run measured (the bench writes it as JSON).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub config: Config,
    pub load_start: String,
    pub load_end: String,
    pub figures: Figures,
    pub changes_by_kind: BTreeMap<String, usize>,
    pub stable: StableProbes,
    pub live: LiveProbes,
    pub drift_checks: Vec<DriftCheck>,
    pub syncs: Vec<Sync>,
    pub samples: Vec<ProcSample>,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a file atomically (a temporary beside it, renamed over: one change for the daemon).
fn write_file(dir: &Path, name: &str, text: &str) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(name)).with_context(|| format!("renaming into {name}"))
}

/// State shared with the watching threads.
struct Shared {
    start: Instant,
    stop: AtomicBool,
    syncs: Mutex<Vec<Sync>>,
    sync_count: AtomicUsize,
    samples: Mutex<Vec<ProcSample>>,
    histories: Mutex<Vec<History>>,
    /// (live Service, pod address, t0, t1) of each landing.
    landings: Mutex<Vec<(usize, IpAddr, f64, f64)>>,
    stable: Mutex<StableProbes>,
    live: Mutex<LiveProbes>,
}

impl Shared {
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// Follows the daemon's log and samples its process until told to stop.
fn monitor(sh: &Shared, daemon: &ChildGuard, sample_every: Duration) {
    let pid = daemon.pid();
    let mut offset = 0;
    let mut next_sample = Instant::now();
    while !sh.stop.load(Ordering::SeqCst) {
        let log = daemon.log();
        let t = sh.now();
        if let Some(new) = log.get(offset..) {
            let complete = new.rfind('\n').map_or(0, |i| i + 1);
            for line in new[..complete].lines() {
                if let Some(s) = watch::parse_sync(line, t) {
                    sh.syncs.lock().expect("syncs").push(s);
                    sh.sync_count.fetch_add(1, Ordering::SeqCst);
                }
            }
            offset += complete;
        }
        if Instant::now() >= next_sample {
            if let Some(s) = ProcSample::read(pid, t) {
                sh.samples.lock().expect("samples").push(s);
            }
            next_sample += sample_every;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Probes the stable Services in turn until told to stop.
fn probe_stable(sh: &Shared, bed: &Testbed, stable: &[(SocketAddr, BTreeSet<String>)]) {
    while !sh.stop.load(Ordering::SeqCst) {
        for (to, names) in stable {
            let args = ProbeArgs::tcp(*to)
                .with_count(BATCH)
                .with_interval_ms(10)
                .with_timeout_ms(1000);
            let at = sh.now();
            let report = bed.probe(&bed.client, &args);
            let mut st = sh.stable.lock().expect("stable");
            let Ok(report) = report else {
                st.failed += 1;
                st.examples
                    .push(format!("{at:.1} s {to}: the probe did not run: {report:?}"));
                continue;
            };
            for a in &report.attempts {
                st.connects += 1;
                let good = a.ok && a.name.as_ref().is_some_and(|n| names.contains(n));
                if !good {
                    st.failed += 1;
                    if st.examples.len() < 10 {
                        let t = at + a.t_ms as f64 / 1e3;
                        st.examples
                            .push(format!("{t:.1} s {to}: {:?} from {:?}", a.error, a.name));
                    }
                }
            }
        }
    }
}

/// Probes the live Services in turn until told to stop, recording where each connect landed.
fn probe_live(sh: &Shared, bed: &Testbed, live: &[SocketAddr], pod_of: &BTreeMap<String, IpAddr>) {
    while !sh.stop.load(Ordering::SeqCst) {
        for (k, to) in live.iter().enumerate() {
            let args = ProbeArgs::tcp(*to)
                .with_count(BATCH)
                .with_interval_ms(10)
                .with_timeout_ms(1000);
            let at = sh.now();
            let Ok(report) = bed.probe(&bed.client, &args) else {
                sh.live.lock().expect("live").other_errors += 1;
                continue;
            };
            let mut lv = sh.live.lock().expect("live");
            let mut landings = sh.landings.lock().expect("landings");
            for a in &report.attempts {
                lv.connects += 1;
                let t0 = at + a.t_ms as f64 / 1e3;
                let t1 = t0 + a.elapsed_us as f64 / 1e6;
                match (a.ok, a.name.as_ref().and_then(|n| pod_of.get(n))) {
                    (true, Some(ip)) => {
                        lv.landed += 1;
                        landings.push((k, *ip, t0, t1));
                    }
                    _ if a.error.as_deref() == Some(ERR_REFUSED) => lv.refused += 1,
                    _ => {
                        lv.other_errors += 1;
                        if lv.examples.len() < 10 {
                            lv.examples
                                .push(format!("{t0:.1} s {to}: {:?} from {:?}", a.error, a.name));
                        }
                    }
                }
            }
        }
    }
}

/// Reads the live Services' rules back from the node's kernel until told to stop (on a thread
/// that enters the node's namespace), and tells each one's history which endpoints they send
/// to, at the end of each read.
fn watch_kernel(sh: &Shared, node: &Node<'_>, pods: &[IpAddr], names: &[String]) -> Result<()> {
    drift::enter(&node.bed.node)?;
    let (cfg, state, _) = drift::desired(&node.flags(), node.dir)?;
    let ports = names
        .iter()
        .map(|n| {
            let sps = state.service_ports.iter().find(|s| s.port.name.name == *n);
            sps.map(|s| s.port.clone()).with_context(|| format!("no Service {n}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let backend = crate::iptables::backend::detect_and_log();
    let mut proxier = crate::daemon::modes::proxiers(&cfg, backend, false)?
        .into_iter()
        .find(|p| p.family() == crate::model::IpFamily::V4)
        .context("no IPv4 proxier")?;
    while !sh.stop.load(Ordering::SeqCst) {
        for (k, port) in ports.iter().enumerate() {
            match proxier.read_back(port) {
                Ok(programmed) => {
                    let lines: Vec<&String> = programmed.sections.iter().flat_map(|s| &s.lines).collect();
                    let to = |ip: &IpAddr| {
                        let (a, b) = (format!("{ip}:"), format!("{ip} . "));
                        lines.iter().any(|l| l.contains(&a) || l.contains(&b))
                    };
                    let sends_to: BTreeSet<IpAddr> = pods.iter().filter(|ip| to(ip)).copied().collect();
                    let t = sh.now();
                    sh.histories.lock().expect("histories")[k].observe(t, &sends_to);
                }
                Err(e) => {
                    let mut lv = sh.live.lock().expect("live");
                    lv.read_back_errors += 1;
                    if lv.examples.len() < 10 {
                        lv.examples.push(format!("read-back of {}: {e}", port.name));
                    }
                }
            }
        }
        std::thread::sleep(READ_BACK_PAUSE);
    }
    Ok(())
}

/// Waits until the daemon has made no sync for [`SETTLE`] and its last sync programmed
/// `ports` service ports, as many as the files hold: the churn's last changes are programmed,
/// and the tick's sync comes late enough to delete the chains they left for later. A loaded
/// daemon can still be syncing the churn seconds after it stopped, and its manifest source can
/// lag further: at load average 7 a Service created before the pause reached a sync 25 s
/// later, after the tick (docs/soak.md); the count catches most of that lag.
fn settle(sh: &Shared, ports: usize) -> Result<()> {
    let deadline = Instant::now() + TICK_TIMEOUT;
    let (mut seen, mut since) = (sh.sync_count.load(Ordering::SeqCst), Instant::now());
    let caught_up = || {
        sh.syncs
            .lock()
            .expect("syncs")
            .last()
            .is_some_and(|s| s.services == ports)
    };
    while since.elapsed() < SETTLE || !caught_up() {
        if Instant::now() > deadline {
            bail!(
                "{TICK_TIMEOUT:?} after the churn paused, the daemon was still syncing or had not \
                 programmed the {ports} service ports of the files"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
        let now = sh.sync_count.load(Ordering::SeqCst);
        if now != seen {
            (seen, since) = (now, Instant::now());
        }
    }
    Ok(())
}

/// The daemon and what the drift checks need.
struct Node<'a> {
    cfg: &'a Config,
    bed: &'a Testbed,
    dir: &'a Path,
    scratch: &'a Netns,
}

impl Node<'_> {
    /// Pauses, writes a tick, waits for the kernel to show it, and compares.
    fn drift_check(&self, sh: &Shared, cluster: &mut SoakCluster) -> Result<DriftCheck> {
        let started = Instant::now();
        settle(sh, cluster.service_count())?;
        let ((name, text), ip) = cluster.next_tick();
        let written = Instant::now();
        write_file(self.dir, &name, &text)?;
        let (drift, tick_latency_ms) = if self.cfg.mode == "nftables" {
            let ((kernel, undecoded), ms) = self.tick_wait(ip, written, || {
                let read = drift::kernel_nftables(&self.bed.node)?;
                Ok(drift::nft_serves(&read.0, ip).then_some(read))
            })?;
            let render = drift::render_nftables(&self.flags(), self.dir)?;
            let forms = (drift::nft_form(&kernel), drift::nft_form(&render));
            (drift::compare_nft_forms(&forms.0, &undecoded, &forms.1), ms)
        } else {
            let marker = format!("{ip}:8080");
            let (kernel, ms) = self.tick_wait(ip, written, || {
                let text = drift::kernel_iptables(&self.bed.node)?;
                Ok(text.contains(&marker).then_some(text))
            })?;
            let render = drift::render_iptables(&self.flags(), self.dir, &self.bed.node, self.scratch)?;
            (drift::compare_iptables(&kernel, &render, self.scratch)?, ms)
        };
        Ok(DriftCheck {
            t: sh.now(),
            tick_latency_ms,
            check_s: started.elapsed().as_secs_f64(),
            drift,
        })
    }

    /// Polls `read` until it shows the tick `ip` (written at `written`), and returns what it read.
    /// The tick's latency is until that read.
    fn tick_wait<T>(&self, ip: IpAddr, written: Instant, read: impl Fn() -> Result<Option<T>>) -> Result<(T, f64)> {
        loop {
            if let Some(found) = read()? {
                return Ok((found, written.elapsed().as_secs_f64() * 1e3));
            }
            if written.elapsed() > TICK_TIMEOUT {
                bail!("the tick {ip} did not reach the kernel within {TICK_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn flags(&self) -> Vec<String> {
        vec![
            "--hostname-override=node-a".to_string(),
            format!("--cluster-cidr={POD_CIDR}"),
            format!("--proxy-mode={}", self.cfg.mode),
        ]
    }
}

/// Runs the soak: builds the bed, starts the daemon, churns for the configured time.
pub fn run(cfg: &Config) -> Result<Report> {
    let load_start = loadavg();
    let mut spec = TestbedSpec::new(&cfg.prefix, &cfg.binary);
    spec.endpoints = cfg.pods;
    spec.ipv6 = false;
    let bed = Testbed::build(&spec)?;
    // The bed's id is unique in this process (two soaks may run at once).
    let scratch = Netns::create(&format!("{}-ref", bed.id()))?;
    let dir = TempDir(std::env::temp_dir().join(format!("{}-manifests", bed.id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0)?;
    let pods: Vec<IpAddr> = bed.endpoints().iter().map(|e| e.ip).collect();
    let pod_of: BTreeMap<String, IpAddr> = bed.endpoints().iter().map(|e| (e.name.clone(), e.ip)).collect();
    let name_of = |ip: &IpAddr| pod_of.iter().find(|(_, p)| *p == ip).map(|(n, _)| n.clone());
    let mut cluster = SoakCluster::new(cfg.services, cfg.endpoints, &pods, cfg.stable, cfg.live, cfg.seed);
    for (name, text) in cluster.files() {
        write_file(&dir.0, &name, &text)?;
    }
    let node = Node {
        cfg,
        bed: &bed,
        dir: &dir.0,
        scratch: &scratch,
    };
    let mut args = node.flags();
    args.extend(["--manifests".to_string(), dir.0.display().to_string()]);
    let start = Instant::now();
    let daemon = bed.spawn_in_node(&cfg.binary, &args)?;
    daemon.wait_for_log(
        &format!("\"Synced rules\" mode=\"{}\" ipFamily=\"IPv4\"", cfg.mode),
        FIRST_SYNC_TIMEOUT,
    )?;
    let first_sync_s = start.elapsed().as_secs_f64();
    let sh = Shared {
        start,
        stop: AtomicBool::new(false),
        syncs: Mutex::new(Vec::new()),
        sync_count: AtomicUsize::new(0),
        samples: Mutex::new(Vec::new()),
        histories: Mutex::new(cluster.live.iter().map(|s| History::new(0.0, s.ready())).collect()),
        landings: Mutex::new(Vec::new()),
        stable: Mutex::new(StableProbes::default()),
        live: Mutex::new(LiveProbes::default()),
    };
    let stable: Vec<(SocketAddr, BTreeSet<String>)> = cluster
        .stable
        .iter()
        .map(|(ip, eps)| {
            (
                SocketAddr::new((*ip).into(), 80),
                eps.iter().filter_map(name_of).collect(),
            )
        })
        .collect();
    let live: Vec<SocketAddr> = cluster
        .live
        .iter()
        .map(|s| SocketAddr::new(s.cluster_ip.into(), 80))
        .collect();
    let live_names: Vec<String> = (0..live.len()).map(|k| format!("live-{k}")).collect();
    let mut checks = Vec::new();
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    let mut churn = Duration::ZERO;
    let outcome: Result<()> = std::thread::scope(|s| {
        let _stop = StopOnDrop(&sh.stop);
        s.spawn(|| monitor(&sh, &daemon, Duration::from_secs_f64(cfg.sample_every_s)));
        s.spawn(|| probe_stable(&sh, &bed, &stable));
        s.spawn(|| probe_live(&sh, &bed, &live, &pod_of));
        let kernel = s.spawn(|| watch_kernel(&sh, &node, &pods, &live_names));
        checks.push(node.drift_check(&sh, &mut cluster)?);
        let end = Instant::now() + Duration::from_secs_f64(cfg.duration_s);
        let cap = end + Duration::from_secs_f64(cfg.duration_s * 3.0);
        let churning = |checks: usize| {
            let now = Instant::now();
            now < end || (checks < cfg.min_drift_checks && now < cap)
        };
        let interval = Duration::from_secs_f64(1.0 / cfg.rate);
        let mut last_check = sh.sync_count.load(Ordering::SeqCst);
        while churning(checks.len()) {
            let (burst, mut n) = (Instant::now(), 0u32);
            while churning(checks.len()) && sh.sync_count.load(Ordering::SeqCst) < last_check + cfg.k {
                let (kind, name, text) = cluster.change();
                write_file(&dir.0, &name, &text)?;
                if kind == Change::LiveEndpoints {
                    let t = sh.now();
                    let mut h = sh.histories.lock().expect("histories");
                    for (hist, svc) in h.iter_mut().zip(&cluster.live) {
                        hist.push_if_changed(t, svc.ready());
                    }
                }
                *by_kind.entry(kind.as_str().to_string()).or_default() += 1;
                n += 1;
                // Paced from the start of the burst: a slow write does not lower the rate.
                if let Some(wait) = (burst + interval * n).checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            churn += burst.elapsed();
            if let Some(dead) = daemon_exited(&daemon) {
                bail!("the daemon exited: {dead}");
            }
            checks.push(node.drift_check(&sh, &mut cluster)?);
            last_check = sh.sync_count.load(Ordering::SeqCst);
            if kernel.is_finished() {
                break;
            }
        }
        sh.stop.store(true, Ordering::SeqCst);
        kernel
            .join()
            .map_err(|_| anyhow::anyhow!("the read-back thread panicked"))?
            .context("reading the live Services' rules back")
    });
    let run_s = sh.now();
    outcome.with_context(|| {
        format!(
            "the soak stopped early; the daemon's log ends:\n{}",
            tail(&daemon.log())
        )
    })?;
    drop(daemon);
    Ok(report(cfg, sh, checks, by_kind, churn, run_s, first_sync_s, load_start))
}

fn daemon_exited(daemon: &ChildGuard) -> Option<String> {
    let pid = daemon.pid();
    (!Path::new(&format!("/proc/{pid}")).exists()).then(|| format!("pid {pid} is gone"))
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Sets the flag when dropped: the watching threads stop also when the churn fails.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    cfg: &Config,
    sh: Shared,
    checks: Vec<DriftCheck>,
    by_kind: BTreeMap<String, usize>,
    churn: Duration,
    run_s: f64,
    first_sync_s: f64,
    load_start: String,
) -> Report {
    let syncs = sh.syncs.into_inner().expect("syncs");
    let samples = sh.samples.into_inner().expect("samples");
    let histories = sh.histories.into_inner().expect("histories");
    let stable = sh.stable.into_inner().expect("stable");
    let mut live = sh.live.into_inner().expect("live");
    for (k, ip, t0, t1) in sh.landings.into_inner().expect("landings") {
        if !histories[k].allows(ip, t0, t1) {
            live.violations += 1;
            if live.examples.len() < 20 {
                live.examples
                    .push(format!("{t0:.2}..{t1:.2} s live-{k}: landed on {ip}, not ready"));
            }
        }
    }
    let mut applied = Vec::new();
    for h in &histories {
        let (seen, unseen) = h.apply_latencies();
        live.changes_seen += seen.len();
        live.changes_unseen += unseen;
        live.read_backs_unmatched += h.unmatched;
        applied.extend(seen.iter().map(|s| s * 1e3));
    }
    let elapsed: Vec<f64> = syncs.iter().map(|s| s.elapsed_ms).collect();
    let ticks: Vec<f64> = checks.iter().map(|c| c.tick_latency_ms).collect();
    let cpu = watch::cpu_percent(&samples);
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let mib = |k: f64| k / 1024.0;
    let growth = watch::rss_growth(&samples, first_sync_s + cfg.warmup_s);
    let changes: usize = by_kind.values().sum();
    let figures = Figures {
        first_sync_s,
        churn_s: churn.as_secs_f64(),
        changes,
        rate_churning: changes as f64 / churn.as_secs_f64().max(1e-9),
        rate_overall: changes as f64 / (run_s - first_sync_s).max(1e-9),
        syncs: syncs.len(),
        full_syncs: syncs.iter().filter(|s| s.full).count(),
        sync_p50_ms: watch::percentile(&elapsed, 0.5),
        sync_p99_ms: watch::percentile(&elapsed, 0.99),
        sync_max_ms: watch::percentile(&elapsed, 1.0),
        tick_latency_p50_ms: watch::percentile(&ticks, 0.5),
        tick_latency_max_ms: watch::percentile(&ticks, 1.0),
        drift_checks: checks.len(),
        drift_differences: checks.iter().map(|c| c.drift.differences).sum(),
        rss_start_mib: growth.map_or(0.0, |g| mib(g.1)),
        rss_end_mib: growth.map_or(0.0, |g| mib(g.2)),
        rss_peak_mib: mib(samples.iter().map(|s| s.rss_kib).max().unwrap_or(0) as f64),
        rss_growth_pct: growth.map(|g| g.0),
        cpu_mean_pct: mean(&cpu.iter().map(|c| c.1).collect::<Vec<_>>()),
        children_cpu_mean_pct: mean(&cpu.iter().map(|c| c.2).collect::<Vec<_>>()),
        stable_failed: stable.failed,
        live_violations: live.violations,
        live_apply_p50_ms: watch::percentile(&applied, 0.5),
        live_apply_p99_ms: watch::percentile(&applied, 0.99),
        live_apply_max_ms: watch::percentile(&applied, 1.0),
    };
    Report {
        config: cfg.clone(),
        load_start,
        load_end: loadavg(),
        figures,
        changes_by_kind: by_kind,
        stable,
        live,
        drift_checks: checks,
        syncs,
        samples,
    }
}
