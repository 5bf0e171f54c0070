//! Chaos through the test API server at scale: the real daemon watches
//! tests/support/apiserver (inside the node namespace of a test bed) holding a synthetic cluster
//! (tests/support/api_cluster.rs) plus two Services with real endpoints, and goes through:
//!
//! 1. **dropped watches** every 3 s while changes flow: converges to the exact objects, and
//!    resumes every watch from its last version (no LIST after the first);
//! 2. **410 Gone**: a relist with nothing changed makes no sync (the next sync after it is the one
//!    of a change made after it), and its peak RSS stays within 1.5× the steady RSS; then a
//!    relist with changes converges;
//! 3. **an outage** (connections reset) with changes and deletions meanwhile, and the watches
//!    expired (the recovery relists): while the API is away the kernel's table reads back
//!    identical, a Service deleted meanwhile still answers, and a stream through a stable Service
//!    never breaks; after it, the kernel converges with the deleted objects gone, within 1.5× the
//!    steady RSS;
//! 4. **slow responses** (every response held back) with dropped watches: converges; then
//!    **truncated responses** (bodies cut mid-object) during a relist with changes meanwhile: the
//!    kernel is untouched (half a list is never taken for the whole), and once whole responses
//!    come back it converges; the daemon never exits.
//!
//! "Converges" is read from the kernel: every ClusterIP the table dispatches and the endpoints
//! its rules reach (over netlink in nftables mode, `iptables-save` in iptables mode), equal to
//! what the API server's objects say, plus real traffic to the stable Service.
//!
//! Size and lengths (CI defaults in brackets; the 10k figures in the README come from
//! `CHAOS_SERVICES=10000 CHAOS_OUTAGE=600`): `CHAOS_SERVICES` [1000] Services × `CHAOS_ENDPOINTS`
//! [10], `CHAOS_OUTAGE` [12] seconds, `CHAOS_PHASE` [8] seconds of churn per phase,
//! `CHAOS_RATE` [20] changes per second, `CHAOS_MODES` [nftables,iptables] (iptables at a fifth of
//! the size, its syncs being slower).

mod common;

#[path = "support/apiserver/mod.rs"]
mod apiserver;

#[path = "support/api_cluster.rs"]
mod api_cluster;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use api_cluster::{Churn, View, differences, expected, mib, slice_of};
use apiserver::ApiServer;
use common::netns::in_netns;
use common::wait_until_every;
use kube_proxy::lab::netns::{ChildGuard, memory_kib, reset_peak};
use kube_proxy::lab::probe::{ProbeArgs, ProbeReport};
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};
use kube_proxy::model::IpFamily;
use kube_proxy::nftables::ast::{ElemKey, ElemValue, Statement};
use kube_proxy::nftables::names::{ENDPOINT_PREFIX, SERVICE_IPS};
use kube_proxy::nftables::netlink::{NftSocket, ReadScope};
use kube_proxy::nftables::ruleset::Ruleset;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
/// One chaos run at a time: each loads the 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());
const POLL: Duration = Duration::from_millis(200);
/// The stable Service (endpoints 0 and 1 of the bed) and the one deleted during the outage.
const STABLE: &str = "10.96.165.10:80";
const DOOMED: &str = "10.96.165.20:80";
/// Longer than the nftables proxier waits before deleting what a sync left unused.
const SETTLED: Duration = Duration::from_secs(3);
/// A relist may not raise the peak RSS above this many times the steady RSS.
const RELIST_RSS_LIMIT: f64 = 1.5;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The daemon, its API server and its test bed.
struct Chaos {
    // Dropped first: the daemon stops before its namespaces go.
    daemon: ChildGuard,
    api: ApiServer,
    bed: Testbed,
    _kubeconfig: TempFile,
    nft: bool,
    services: usize,
    /// Changes per second in the churn phases.
    rate: u64,
}

/// The kernel's state in the node: the table read back (nftables) or the rules listed
/// (iptables), to compare whole.
#[derive(PartialEq)]
enum Snapshot {
    Nft(Box<Ruleset>),
    Iptables(String),
}

impl Chaos {
    fn start(mode: &str, services: usize, endpoints: usize) -> Chaos {
        let mut spec = TestbedSpec::new(format!("kpc-{}", &mode[..3]), BIN);
        spec.endpoints = 3;
        let bed = Testbed::build(&spec).expect("test bed");
        let api = in_netns(bed.node.name(), ApiServer::start);
        let kubeconfig =
            TempFile(std::env::temp_dir().join(format!("kp-chaos-{mode}-{}.kubeconfig", std::process::id())));
        api.write_kubeconfig(&kubeconfig.0);
        api.apply(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                         "status": {"addresses": [{"type": "InternalIP", "address": "192.168.49.2"}]}}),
        );
        let t = Instant::now();
        api_cluster::load(&api, services, endpoints);
        let ep = |i: usize| bed.endpoint(i).ip;
        for (name, addr, eps) in [("stable", STABLE, vec![ep(0), ep(1)]), ("doomed", DOOMED, vec![ep(2)])] {
            let ip = addr.split(':').next().unwrap_or_default();
            api.apply(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
                             "spec": {"clusterIP": ip, "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}}));
            api.apply(slice_of("default", name, &eps, "node-a"));
        }
        println!(
            "{services} Services × {endpoints} endpoints loaded into the API server in {:?}",
            t.elapsed()
        );
        let args: Vec<String> = [
            "--hostname-override=node-a".to_string(),
            "--cluster-cidr=10.244.0.0/16".to_string(),
            format!("--proxy-mode={mode}"),
            // Every sync comes from a change: the periodic one is out of the way.
            "--iptables-sync-period=1h".to_string(),
            "--iptables-min-sync-period=1s".to_string(),
            format!("--kubeconfig={}", kubeconfig.0.display()),
        ]
        .to_vec();
        let daemon = bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
        Chaos {
            daemon,
            api,
            bed,
            _kubeconfig: kubeconfig,
            nft: mode == "nftables",
            services,
            rate: env_or("CHAOS_RATE", 20).max(1),
        }
    }

    fn snapshot(&self) -> Snapshot {
        if self.nft {
            Snapshot::Nft(Box::new(nft_table(self.bed.node.name())))
        } else {
            let mut text = String::new();
            for table in ["nat", "filter"] {
                let out = self
                    .bed
                    .node
                    .exec_ok("iptables-save", ["-t", table])
                    .expect("iptables-save");
                // Without the comment lines (they carry the time of the listing).
                text.extend(out.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")));
            }
            Snapshot::Iptables(text)
        }
    }

    /// What the kernel dispatches: ClusterIP:port → the endpoints its rules reach.
    fn kernel(&self) -> View {
        match self.snapshot() {
            Snapshot::Nft(rs) => nft_view(&rs),
            Snapshot::Iptables(text) => iptables_view(&text),
        }
    }

    /// Polls the kernel until it holds exactly what the API server's objects say (within
    /// `timeout`); the time it took.
    fn converge(&self, what: &str, timeout: Duration) -> Duration {
        let want = expected(&self.api);
        let start = Instant::now();
        let mut last = String::new();
        loop {
            let got = self.kernel();
            if got == want {
                break;
            }
            last = differences(&want, &got);
            assert!(
                start.elapsed() < timeout,
                "{what}: no convergence within {timeout:?}: {last}; the daemon's log ends:\n{}",
                tail(&self.daemon.log())
            );
            std::thread::sleep(POLL);
        }
        let took = start.elapsed();
        println!(
            "{what}: converged in {took:?} ({} Services){}",
            want.len(),
            if last.is_empty() {
                String::new()
            } else {
                format!("; first seen: {last}")
            }
        );
        assert!(self.ok(STABLE, 3), "{what}: traffic to the stable Service");
        took
    }

    fn ok(&self, to: &str, n: u32) -> bool {
        self.probe(
            ProbeArgs::tcp(to.parse().expect("an address"))
                .with_count(n)
                .with_timeout_ms(1000),
        )
        .all_ok()
    }

    fn probe(&self, args: ProbeArgs) -> ProbeReport {
        self.bed.probe(&self.bed.client, &args).expect("probe")
    }

    /// LIST requests (no watch) for Services or EndpointSlices so far.
    fn lists(&self, plural: &str) -> usize {
        self.api
            .requests()
            .iter()
            .filter(|r| {
                r.starts_with(&format!(
                    "GET /{}",
                    if plural == "services" {
                        "api/v1/services"
                    } else {
                        "apis/discovery.k8s.io/v1/endpointslices"
                    }
                )) && !r.contains("watch=")
            })
            .count()
    }

    /// The IPv4 `Synced rules` lines of the daemon so far.
    fn syncs(&self) -> Vec<String> {
        self.daemon
            .log()
            .lines()
            .filter(|l| l.contains("\"Synced rules\"") && l.contains("ipFamily=\"IPv4\""))
            .map(str::to_string)
            .collect()
    }

    /// Changes at `self.rate` per second for `length`, calling `every_3s` every 3 s.
    fn churn_for(&self, churn: &mut Churn, length: Duration, mut every_3s: impl FnMut()) {
        let start = Instant::now();
        let mut next = start + Duration::from_secs(3);
        let mut n = 0u64;
        while start.elapsed() < length {
            churn.step(&self.api);
            n += 1;
            // Pacing the changes (not synchronisation).
            let due = start + Duration::from_millis(n * 1000 / self.rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            if Instant::now() >= next {
                every_3s();
                next += Duration::from_secs(3);
            }
        }
    }

    /// The kernel's state once it holds still: the nftables proxier deletes the chains and
    /// maps a sync left unused a moment later, so the last sync before a fault may still be
    /// followed by that clean-up. Polled until two reads [`SETTLED`] apart agree.
    fn settled(&self) -> Snapshot {
        let start = Instant::now();
        let mut last = self.snapshot();
        loop {
            std::thread::sleep(SETTLED);
            let now = self.snapshot();
            if now == last {
                return now;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the kernel's table keeps changing"
            );
            last = now;
        }
    }

    /// The kernel's state is still `table`, and the daemon has not synced since it had made
    /// `syncs` syncs.
    fn assert_untouched(&self, table: &Snapshot, syncs: usize, when: &str) {
        let new = self.syncs().split_off(syncs);
        assert!(new.is_empty(), "{when}: no sync, but: {new:#?}");
        assert!(*table == self.snapshot(), "{when}: the kernel's table is untouched");
    }

    /// The daemon's RSS now, and its peak since the last [`reset_peak`], in KiB.
    fn memory(&self) -> (u64, u64) {
        memory_kib(self.daemon.pid())
    }

    /// The daemon's peak RSS since [`reset_peak`] is within [`RELIST_RSS_LIMIT`] × `steady`.
    fn assert_relist_peak(&self, steady: u64, what: &str) {
        let (_, peak) = self.memory();
        println!(
            "{what}: VmRSS {} MiB before, VmHWM {} MiB during",
            mib(steady),
            mib(peak)
        );
        assert!(
            peak as f64 <= RELIST_RSS_LIMIT * steady as f64,
            "{what}: the peak RSS rose to {} MiB, over {RELIST_RSS_LIMIT} × the steady {} MiB",
            mib(peak),
            mib(steady)
        );
    }

    fn assert_alive(&mut self, when: &str) {
        if let Ok(Some(status)) = self.daemon.try_wait() {
            panic!("{when}: the daemon exited ({status}):\n{}", tail(&self.daemon.log()));
        }
        assert!(
            !self.daemon.log().contains("panicked"),
            "{when}: a panic in the daemon's log"
        );
    }
}

/// The `kube-proxy` IPv4 table as the kernel holds it, read over netlink in namespace `ns`.
fn nft_table(ns: &str) -> Ruleset {
    in_netns(ns, || {
        let mut socket = NftSocket::new().expect("netlink socket");
        let read = socket.read(IpFamily::V4, &ReadScope::Whole).expect("reading the table");
        read.map(|(rs, _)| rs).unwrap_or_else(|| Ruleset::new(IpFamily::V4))
    })
}

/// The ClusterIPs an nftables table dispatches (`service-ips`) and the endpoints each one's
/// chain reaches: the intervals of the `service-endpoints-…` map within the numbers its
/// `numgen` draws, a plain `dnat`, or through endpoint chains.
fn nft_view(rs: &Ruleset) -> View {
    fn reach(rs: &Ruleset, chain: &str, depth: usize, out: &mut BTreeSet<SocketAddr>) {
        let Some(c) = rs.chains.get(chain) else { return };
        for rule in &c.rules {
            match &rule.statement {
                Statement::DnatNumgenMap { modulus, offset, map } => {
                    let (lo_end, hi_end) = (u64::from(*offset), u64::from(*offset) + u64::from(*modulus));
                    let elements = rs.sets.get(map).map(|s| s.elements.iter());
                    for (key, el) in elements.into_iter().flatten() {
                        if let (ElemKey::Range(lo, hi), Some(ElemValue::AddrPort(sa))) = (key, &el.value)
                            && u64::from(*lo) >= lo_end
                            && u64::from(*hi) < hi_end
                        {
                            out.insert(*sa);
                        }
                    }
                }
                Statement::Dnat(sa) => {
                    out.insert(*sa);
                }
                Statement::Verdict(v) => {
                    if let Some(next) = v.chain().filter(|c| c.starts_with(ENDPOINT_PREFIX) && depth < 2) {
                        reach(rs, next, depth + 1, out);
                    }
                }
                Statement::NumgenVmap(chains) if depth < 2 => {
                    for next in chains {
                        reach(rs, next, depth + 1, out);
                    }
                }
                _ => {}
            }
        }
    }
    let mut view = View::new();
    for (key, el) in rs
        .sets
        .get(SERVICE_IPS)
        .map(|s| s.elements.iter())
        .into_iter()
        .flatten()
    {
        let (ElemKey::AddrProtoPort(ip, _, port), Some(chain)) = (key, el.value.as_ref().and_then(|v| v.chain()))
        else {
            continue;
        };
        let mut eps = BTreeSet::new();
        reach(rs, chain, 0, &mut eps);
        view.insert(SocketAddr::new(*ip, *port), eps);
    }
    view
}

/// The ClusterIPs `KUBE-SERVICES` sends to a service chain (`iptables-save` of nat), and the
/// `DNAT` targets of the endpoint chains each one jumps to.
fn iptables_view(text: &str) -> View {
    let arg = |line: &str, flag: &str| {
        let mut words = line.split_whitespace();
        words.by_ref().find(|w| *w == flag)?;
        words.next().map(str::to_string)
    };
    let mut services: Vec<(SocketAddr, String)> = Vec::new();
    let mut jumps: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
    let mut dnat: std::collections::HashMap<String, SocketAddr> = std::collections::HashMap::new();
    for line in text.lines() {
        let Some(chain) = arg(line, "-A") else { continue };
        let Some(target) = arg(line, "-j") else { continue };
        if chain == "KUBE-SERVICES" && target.starts_with("KUBE-SVC-") {
            let ip = arg(line, "-d").and_then(|d| d.trim_end_matches("/32").parse::<IpAddr>().ok());
            let port = arg(line, "--dport").and_then(|p| p.parse::<u16>().ok());
            if let (Some(ip), Some(port)) = (ip, port) {
                services.push((SocketAddr::new(ip, port), target));
            }
        } else if chain.starts_with("KUBE-SVC-") && target.starts_with("KUBE-SEP-") {
            jumps.entry(chain).or_default().push(target);
        } else if chain.starts_with("KUBE-SEP-")
            && target == "DNAT"
            && let Some(to) = arg(line, "--to-destination").and_then(|d| d.parse().ok())
        {
            dnat.insert(chain, to);
        }
    }
    services
        .into_iter()
        .map(|(addr, chain)| {
            let eps = jumps
                .get(&chain)
                .into_iter()
                .flatten()
                .filter_map(|sep| dnat.get(sep).copied())
                .collect();
            (addr, eps)
        })
        .collect()
}

/// The value of `key=` in a log line ("" if none).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or("")
        .trim_matches('"')
}

/// The last lines of a long log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Phase 1: watches dropped every 3 s while changes flow.
fn dropped_watches(c: &Chaos, churn: &mut Churn, length: Duration) {
    let lists = (c.lists("services"), c.lists("endpointslices"));
    let mut drops = 0;
    c.churn_for(churn, length, || {
        c.api.drop_connections();
        drops += 1;
    });
    println!("dropped watches: {drops} drops over {length:?}; {}", churn.summary());
    c.converge("after dropped watches", Duration::from_secs(60));
    assert_eq!(
        (c.lists("services"), c.lists("endpointslices")),
        lists,
        "every watch resumed from its last version, without a relist"
    );
}

/// Waits until both kinds have relisted since `before` (their LIST counts) and watch again.
fn wait_relisted(c: &Chaos, before: (usize, usize), what: &str) {
    // (Churn creates about as many Services as it deletes.)
    let pages = (c.services / 2).div_ceil(500).max(1);
    wait_until_every(POLL, Duration::from_secs(120), what, || {
        c.lists("services") >= before.0 + pages
            && c.lists("endpointslices") >= before.1 + pages
            && c.api.open_watches() >= 4
    });
}

/// Phase 2: 410 Gone, first with nothing changed, then with changes.
fn relists(c: &Chaos, churn: &mut Churn) {
    let table = c.snapshot();
    let syncs = c.syncs().len();
    let (steady, _) = c.memory();
    reset_peak(c.daemon.pid()).expect("resetting VmHWM (needs root)");
    let before = (c.lists("services"), c.lists("endpointslices"));
    c.api.expire_watches();
    wait_relisted(c, before, "a relist after 410 Gone");
    c.assert_relist_peak(steady, "a relist with nothing changed");
    // A change after the relist: its sync is the first one since, so the relist made none.
    churn.move_one(&c.api);
    c.converge("one change after a relist of nothing new", Duration::from_secs(30));
    // (A sync that only deletes what an earlier one left may come too: it rewrites nothing.)
    let new: Vec<String> = c.syncs().split_off(syncs);
    let rewritten = new
        .iter()
        .map(|l| field(l, "rewritten").parse::<u64>().unwrap_or(u64::MAX))
        .fold(0u64, u64::saturating_add);
    assert!(
        !new.is_empty() && new.iter().all(|l| l.contains("full=false")) && rewritten <= 1,
        "the relist made no sync: only the change's, rewriting one Service: {new:#?}"
    );
    assert!(table != c.snapshot(), "the change reached the kernel");
    // A relist with changes: made right after the expiry, some land in the list, some after.
    c.api.expire_watches();
    churn.steps(&c.api, 200);
    c.converge("a relist with 200 changes", Duration::from_secs(60));
}

/// Phase 3: the API server away for `length`, with changes and deletions meanwhile.
fn outage(c: &Chaos, churn: &mut Churn, length: Duration) {
    let table = c.settled();
    let syncs = c.syncs().len();
    let (steady, _) = c.memory();
    let stream = std::thread::scope(|s| {
        let bed = &c.bed;
        let args = ProbeArgs::tcp(STABLE.parse().expect("an address"))
            .with_stream_seconds(length.as_secs_f64())
            .with_interval_ms(100);
        let streaming = s.spawn(move || bed.probe(&bed.client, &args));
        c.api.set_unavailable(true);
        // Meanwhile: the doomed Service goes, the cluster changes, and the server's history is
        // compacted (as after a restart): the recovery must relist, and find the deletions.
        c.api.delete("Service", "default", "doomed");
        c.api.delete("EndpointSlice", "default", "doomed-x");
        c.api.expire_watches();
        let mut checks = 0;
        let before = churn.total();
        c.churn_for(churn, length, || {
            c.assert_untouched(&table, syncs, "while the API server is away");
            assert!(
                c.ok(DOOMED, 1),
                "a Service deleted meanwhile still answers while the API server is away"
            );
            assert!(
                c.ok(STABLE, 1),
                "new connections to the stable Service while the API server is away"
            );
            checks += 1;
        });
        c.assert_untouched(&table, syncs, "at the end of the outage");
        println!(
            "outage of {length:?}: {checks} checks of the kernel and the traffic; {} changes meanwhile (in all: {})",
            churn.total() - before,
            churn.summary()
        );
        reset_peak(c.daemon.pid()).expect("resetting VmHWM (needs root)");
        c.api.set_unavailable(false);
        streaming.join().expect("probe thread").expect("probe")
    });
    let took = c.converge("after the outage", Duration::from_secs(120));
    println!("after an outage of {length:?}: converged {took:?} after the API server came back");
    let st = stream.stream.expect("a stream report");
    assert!(
        st.sent > 0 && st.echoed == st.sent && st.errors.is_empty(),
        "a stream through the outage never broke: {st:?}"
    );
    c.assert_relist_peak(steady, "the relist after the outage");
    assert!(
        !c.kernel().contains_key(&DOOMED.parse().expect("an address")),
        "the doomed Service is gone"
    );
}

/// Phase 4: slow responses, then truncated ones.
fn slow_and_truncated(c: &Chaos, churn: &mut Churn, length: Duration) {
    c.api.set_delay(Duration::from_millis(1500));
    c.churn_for(churn, length, || c.api.drop_connections());
    c.converge(
        "with every response 1.5 s late and watches dropped",
        Duration::from_secs(90),
    );
    c.api.set_delay(Duration::ZERO);

    let table = c.settled();
    let syncs = c.syncs().len();
    c.api.set_truncated(true);
    let before = (c.lists("services"), c.lists("endpointslices"));
    c.api.expire_watches();
    churn.steps(&c.api, 100);
    // Two attempts of each list, both cut in half.
    wait_until_every(
        POLL,
        Duration::from_secs(60),
        "relists tried while responses are truncated",
        || c.lists("services") >= before.0 + 2 && c.lists("endpointslices") >= before.1 + 2,
    );
    c.assert_untouched(&table, syncs, "while every list is truncated");
    c.api.set_truncated(false);
    c.converge("after truncated responses", Duration::from_secs(90));
}

fn chaos(mode: &str, divisor: u64) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let services = (env_or("CHAOS_SERVICES", 1000) / divisor).max(10) as usize;
    let endpoints = env_or("CHAOS_ENDPOINTS", 10) as usize;
    let phase = Duration::from_secs(env_or("CHAOS_PHASE", 8));
    let outage_for = Duration::from_secs(env_or("CHAOS_OUTAGE", 12));
    let started = Instant::now();
    let mut c = Chaos::start(mode, services, endpoints);
    let mut churn = Churn::new(0x5eed, services, endpoints);
    let first = c.converge("the first sync", Duration::from_secs(300));
    let (rss, hwm) = c.memory();
    println!(
        "{mode}, {services} × {endpoints} from the API: in the kernel {first:?} after the start; VmRSS {} MiB, VmHWM {} MiB",
        mib(rss),
        mib(hwm)
    );
    dropped_watches(&c, &mut churn, phase);
    c.assert_alive("after dropped watches");
    relists(&c, &mut churn);
    c.assert_alive("after relists");
    outage(&c, &mut churn, outage_for);
    c.assert_alive("after the outage");
    slow_and_truncated(&c, &mut churn, phase);
    c.assert_alive("after slow and truncated responses");
    let (rss, hwm) = c.memory();
    println!(
        "{mode} chaos done in {:?}: {}; VmRSS {} MiB, VmHWM {} MiB",
        started.elapsed(),
        churn.summary(),
        mib(rss),
        mib(hwm)
    );
}

fn chaos_at_scale_in_nftables_mode() {
    if !modes().contains(&"nftables".to_string()) {
        return println!("skipped by CHAOS_MODES");
    }
    chaos("nftables", 1);
}

fn chaos_at_scale_in_iptables_mode() {
    if !modes().contains(&"iptables".to_string()) {
        return println!("skipped by CHAOS_MODES");
    }
    chaos("iptables", 5);
}

fn modes() -> Vec<String> {
    std::env::var("CHAOS_MODES")
        .unwrap_or_else(|_| "nftables,iptables".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .collect()
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl"), Tool("nft")] =>
        chaos_at_scale_in_nftables_mode;
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-save"), Tool("iptables-restore")] =>
        chaos_at_scale_in_iptables_mode;
}
