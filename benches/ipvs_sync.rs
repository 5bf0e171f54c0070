//! Benchmark of IPVS mode's programming at scale, on a real IPVS: the test VM (`vm/run`), since
//! this machine's own kernel has none. Needs root and the VM's packages (see .ci/run).
//!
//! Run with `cargo bench --bench ipvs_sync` (as root; `BENCHES=ipvs_sync benches/run` writes
//! `docs/bench/ipvs_sync.json` and README's IPVS table). On the host it re-runs itself in the
//! VM (`KUBE_PROXY_IN_VM=1`), where, for SERVICES × ENDPOINTS synthetic Services (as the other
//! benchmarks make them; every tenth with a NodePort):
//! - **cold sync**, `REPS` times, each in a fresh network namespace whose node link (a dummy
//!   link, 192.168.0.2/24) carries the NodePorts: the proxier (`IpvsProxier` over netlink, the
//!   real `ip`, `ipset` and `iptables-restore`) programs everything from nothing, timed as one
//!   `sync`; its IPVS netlink calls are timed on their own;
//! - **the floor**: the same virtual and real servers as `ipvsadm -Sn` saves them after that
//!   sync, given to `ipvsadm --restore` in another fresh namespace, timed (`REPS` times);
//! - **endpoint changes**, `CHANGES` of them on the last namespace: one Service replaces one of
//!   its endpoints (a rolling update), one `sync` each, timed, with every IPVS netlink call
//!   recorded. Each change must send exactly one real server added and one deleted, list
//!   only that virtual server's real servers, and nothing else: the benchmark fails otherwise;
//! - **explain**: `kube-proxy explain` for the last Service and `--all` on the last namespace,
//!   the cluster read from manifests (`--manifests`: the VM runs no daemon), `REPS` runs each,
//!   beside `ipvsadm -Ln` of the same namespace.
//!
//! The VM runs under TCG (no nested KVM), so every figure is several times what the same
//! kernel would take on the host; the ratio to `ipvsadm --restore` compares like with like.
//!
//! Environment (all optional): `SERVICES` (default 10000), `ENDPOINTS` (default 10), `REPS`
//! (default 3), `CHANGES` (default 50), `VM_MEM_MB` (default 2048), `BENCH_JSON` (write the
//! figures there, on the host).

#[path = "../tests/support/apiserver/mod.rs"]
mod apiserver;
#[path = "common/cluster.rs"]
mod cluster;
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{env_usize, in_netns, loadavg, loadavg_1m, percentile_of, progress, thousands, unique_node_ports};
use kube_proxy::iptables::backend::Backend;
use kube_proxy::iptables::exec::Exec;
use kube_proxy::ipvs::host::{HostError, HostExec, IpvsHost};
use kube_proxy::ipvs::netlink::{Info, Ipvs, IpvsError, IpvsHandle, RealServer, Timeouts, VirtualServer};
use kube_proxy::ipvs::proxier::IpvsProxier;
use kube_proxy::ipvs::render::{IpvsRenderOptions, render};
use kube_proxy::lab::netns::Netns;
use kube_proxy::model::{IpFamily, ProxyState, synthetic};
use kube_proxy::vm::{IN_VM, Vm, in_vm};
use serde_json::{Value, json};

/// The guest prints its figures on one line after this marker; the host picks them up.
const FIGURES: &str = "ipvs-sync-figures: ";
const NODE_LINK: &str = "eth0";
const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const NODE_ADDR: &str = "192.168.0.2/24";

// ---------------------------------------------------------------------------------------------
// IPVS netlink calls, counted and timed.

/// An [`Ipvs`] that counts and times every call it passes on.
struct Recorded<V> {
    inner: V,
    calls: BTreeMap<&'static str, usize>,
    time: Duration,
}

impl<V: Ipvs> Recorded<V> {
    fn new(inner: V) -> Self {
        Recorded {
            inner,
            calls: BTreeMap::new(),
            time: Duration::ZERO,
        }
    }

    fn take(&mut self) -> (BTreeMap<&'static str, usize>, Duration) {
        (std::mem::take(&mut self.calls), std::mem::take(&mut self.time))
    }

    fn record<T>(&mut self, name: &'static str, f: impl FnOnce(&mut V) -> T) -> T {
        let t = Instant::now();
        let out = f(&mut self.inner);
        self.time += t.elapsed();
        *self.calls.entry(name).or_default() += 1;
        out
    }
}

impl<V: Ipvs> Ipvs for Recorded<V> {
    fn info(&mut self) -> Result<Info, IpvsError> {
        self.record("info", |v| v.info())
    }
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        self.record("services", |v| v.services())
    }
    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.record("add_service", |v| v.add_service(vs))
    }
    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.record("update_service", |v| v.update_service(vs))
    }
    fn delete_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.record("delete_service", |v| v.delete_service(vs))
    }
    fn dests(&mut self, vs: &VirtualServer) -> Result<Vec<RealServer>, IpvsError> {
        self.record("dests", |v| v.dests(vs))
    }
    fn add_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        self.record("add_dest", |v| v.add_dest(vs, rs))
    }
    fn update_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        self.record("update_dest", |v| v.update_dest(vs, rs))
    }
    fn delete_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        self.record("delete_dest", |v| v.delete_dest(vs, rs))
    }
    fn flush(&mut self) -> Result<(), IpvsError> {
        self.record("flush", |v| v.flush())
    }
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        self.record("set_timeouts", |v| v.set_timeouts(t))
    }
    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        self.record("timeouts", |v| v.timeouts())
    }
}

/// An [`IpvsHost`] whose calls (the `ip` and `ipset` tools, sysctls) are timed.
struct TimedHost {
    inner: HostExec,
    /// Per method: calls and time.
    calls: BTreeMap<&'static str, (usize, Duration)>,
}

impl TimedHost {
    fn time<T>(&mut self, name: &'static str, f: impl FnOnce(&mut HostExec) -> T) -> T {
        let t = Instant::now();
        let out = f(&mut self.inner);
        let e = self.calls.entry(name).or_default();
        e.0 += 1;
        e.1 += t.elapsed();
        out
    }

    /// The time of every call since the last `take`, and what each method took.
    fn take(&mut self) -> (Duration, String) {
        let calls = std::mem::take(&mut self.calls);
        let total = calls.values().map(|(_, t)| *t).sum();
        let each: Vec<String> = calls
            .iter()
            .map(|(name, (n, t))| format!("{name} {n}x {:.0} ms", t.as_secs_f64() * 1e3))
            .collect();
        (total, each.join(", "))
    }
}

impl IpvsHost for TimedHost {
    fn link_exists(&mut self, name: &str) -> Result<bool, HostError> {
        self.time("link_exists", |h| h.link_exists(name))
    }
    fn ensure_dummy(&mut self, name: &str) -> Result<bool, HostError> {
        self.time("ensure_dummy", |h| h.ensure_dummy(name))
    }
    fn delete_link(&mut self, name: &str) -> Result<(), HostError> {
        self.time("delete_link", |h| h.delete_link(name))
    }
    fn addresses(&mut self, name: &str) -> Result<Vec<IpAddr>, HostError> {
        self.time("addresses", |h| h.addresses(name))
    }
    fn other_addresses(&mut self, except: &str) -> Result<Vec<IpAddr>, HostError> {
        self.time("other_addresses", |h| h.other_addresses(except))
    }
    fn change_addresses(&mut self, name: &str, add: &[IpAddr], del: &[IpAddr]) -> Result<(), HostError> {
        self.time("change_addresses", |h| h.change_addresses(name, add, del))
    }
    fn ipsets(&mut self) -> Result<BTreeMap<String, BTreeSet<String>>, HostError> {
        self.time("ipsets", |h| h.ipsets())
    }
    fn ipset_restore(&mut self, input: &str) -> Result<(), HostError> {
        self.time("ipset_restore", |h| h.ipset_restore(input))
    }
    fn ipset_destroy(&mut self, name: &str) -> Result<(), HostError> {
        self.time("ipset_destroy", |h| h.ipset_destroy(name))
    }
    fn read_sysctl(&mut self, path: &str) -> Result<String, HostError> {
        self.time("read_sysctl", |h| h.read_sysctl(path))
    }
    fn write_sysctl(&mut self, path: &str, value: &str) -> Result<(), HostError> {
        self.time("write_sysctl", |h| h.write_sysctl(path, value))
    }
}

type Proxier = IpvsProxier<Recorded<IpvsHandle>, Exec, TimedHost>;

// ---------------------------------------------------------------------------------------------
// In the VM.

struct Knobs {
    services: usize,
    endpoints: usize,
    reps: usize,
    changes: usize,
}

/// A fresh namespace with the node's link up and addressed.
fn node_namespace(name: &str) -> Netns {
    let ns = Netns::create(name).expect("a network namespace");
    ns.ip(["link", "add", NODE_LINK, "type", "dummy"])
        .expect("the node link");
    ns.ip(["addr", "add", NODE_ADDR, "dev", NODE_LINK])
        .expect("the node address");
    ns.link_up(NODE_LINK).expect("the node link up");
    ns.link_up("lo").expect("lo up");
    ns
}

fn proxier() -> Proxier {
    let ipvs = IpvsHandle::new().expect("IPVS over netlink (the VM's kernel has it)");
    IpvsProxier::new(
        IpFamily::V4,
        IpvsRenderOptions::default(),
        Recorded::new(ipvs),
        Exec::new(Backend::Nft, IpFamily::V4),
        TimedHost {
            inner: HostExec,
            calls: BTreeMap::new(),
        },
    )
}

/// What one cold sync took.
struct Cold {
    /// The whole `sync`.
    took: Duration,
    /// Its IPVS netlink calls, and how many.
    netlink: Duration,
    calls: usize,
    /// Its `ip` and `ipset` runs and sysctls.
    tools: Duration,
    /// `ipvsadm -Sn` of the result.
    saved: String,
}

/// One cold sync in a fresh namespace, and the proxier and namespace for the changes.
fn cold_sync(name: &str, state: &ProxyState) -> (Cold, Proxier, Netns) {
    let ns = node_namespace(name);
    let (cold, p) = in_netns(ns.name(), || {
        let mut p = proxier();
        let t = Instant::now();
        let report = p.sync(state).expect("the cold sync");
        let took = t.elapsed();
        assert!(report.full, "a first sync is a full one");
        let (calls, netlink) = p.ipvs().take();
        let (tools, each) = p.host().take();
        progress(format!("tools: {each}"));
        let out = std::process::Command::new("ipvsadm")
            .arg("-Sn")
            .output()
            .expect("ipvsadm runs");
        assert!(
            out.status.success(),
            "ipvsadm -Sn: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cold = Cold {
            took,
            netlink,
            calls: calls.values().sum(),
            tools,
            saved: String::from_utf8_lossy(&out.stdout).into_owned(),
        };
        (cold, p)
    });
    (cold, p, ns)
}

/// `ipvsadm --restore` of `saved` in a fresh namespace.
fn floor(name: &str, saved: &str) -> Duration {
    let ns = node_namespace(name);
    in_netns(ns.name(), || {
        use std::io::Write;
        let mut child = std::process::Command::new("ipvsadm")
            .arg("--restore")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("ipvsadm runs");
        let t = Instant::now();
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(saved.as_bytes())
            .expect("writing to ipvsadm --restore");
        let st = child.wait().expect("ipvsadm --restore");
        let took = t.elapsed();
        assert!(st.success(), "ipvsadm --restore failed");
        took
    })
}

/// Service `i` with its last endpoint replaced by a new address (`n` makes it unique).
fn with_replaced_endpoint(state: &mut ProxyState, i: usize, n: u32) {
    let sps = Arc::make_mut(&mut state.service_ports[i]);
    let last = sps.endpoints.len() - 1;
    // Off the node (remote), like most endpoints: no ipset holds it.
    sps.endpoints[last].ip = IpAddr::V4(Ipv4Addr::from(0x0af5_0000u32 + n));
    sps.endpoints.sort_by_key(|e| e.to_string());
}

/// The median in ms.
fn median(v: &[Duration]) -> f64 {
    let mut ms: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    percentile_of(&mut ms, 0.5)
}

fn in_the_vm(k: &Knobs) -> Value {
    let mut state = synthetic::state(k.services, k.endpoints);
    unique_node_ports(&mut state);
    let endpoints: usize = state.service_ports.iter().map(|s| s.endpoints.len()).sum();
    progress(format!(
        "{} Services x {} endpoints ({} real servers behind ClusterIPs)",
        thousands(k.services),
        k.endpoints,
        thousands(endpoints)
    ));
    // The render alone (the proxier renders once per sync), for the breakdown.
    let t = Instant::now();
    let rendered = render(
        &state,
        &IpvsRenderOptions {
            node_addresses: Some(vec![
                NODE_ADDR
                    .split('/')
                    .next()
                    .unwrap_or_default()
                    .parse()
                    .expect("an address"),
            ]),
            ..IpvsRenderOptions::default()
        },
    );
    let render_ms = t.elapsed().as_secs_f64() * 1e3;
    progress(format!(
        "render: {render_ms:.0} ms ({} virtual servers, {} addresses on kube-ipvs0, {} ipset entries, {} \
         iptables-restore lines)",
        thousands(rendered.virtual_servers.len()),
        thousands(rendered.bound_addresses.len()),
        thousands(rendered.ipsets.iter().map(|s| s.entries.len()).sum::<usize>()),
        thousands(rendered.restore.lines().count())
    ));
    let (virtual_servers, ipset_entries) = (
        rendered.virtual_servers.len(),
        rendered.ipsets.iter().map(|s| s.entries.len()).sum::<usize>(),
    );
    drop(rendered);
    let (mut colds, mut floors) = (Vec::new(), Vec::new());
    let mut last = None;
    let mut saved_lines = 0;
    for rep in 0..k.reps {
        // The namespace of the previous repetition goes first: each starts alone.
        drop(last.take());
        let (cold, p, ns) = cold_sync(&format!("kpipvs-cold{rep}"), &state);
        saved_lines = cold.saved.lines().count();
        progress(format!(
            "cold sync {}: {:.0} ms, of which {:.0} ms in {} IPVS netlink calls and {:.0} ms in \
             ip/ipset/sysctls ({} lines saved)",
            rep + 1,
            cold.took.as_secs_f64() * 1e3,
            cold.netlink.as_secs_f64() * 1e3,
            thousands(cold.calls),
            cold.tools.as_secs_f64() * 1e3,
            thousands(saved_lines)
        ));
        let f = floor(&format!("kpipvs-floor{rep}"), &cold.saved);
        progress(format!(
            "ipvsadm --restore of the same: {:.0} ms",
            f.as_secs_f64() * 1e3
        ));
        colds.push(cold);
        floors.push(f);
        last = Some((p, ns));
    }
    let (mut p, ns) = last.expect("at least one repetition");
    let mut change_ms = Vec::new();
    let mut calls_per_change = BTreeMap::new();
    in_netns(ns.name(), || {
        for c in 0..k.changes {
            let i = (c * 7919) % state.service_ports.len();
            with_replaced_endpoint(&mut state, i, c as u32);
            let t = Instant::now();
            let report = p.sync(&state).expect("a change's sync");
            let took = t.elapsed();
            let (calls, _) = p.ipvs().take();
            let (_, each) = p.host().take();
            if c == 0 {
                progress(format!("a change's tools: {each}"));
            }
            assert!(!report.full, "change {c}: a sync of differences");
            // Its virtual servers: the ClusterIP's, and a NodePort's on the node's one address.
            let servers = if state.service_ports[i].port.node_port != 0 {
                2
            } else {
                1
            };
            let want: BTreeMap<&str, usize> =
                [("add_dest", servers), ("delete_dest", servers), ("dests", servers)].into();
            assert_eq!(
                calls, want,
                "change {c}: per virtual server of the Service one real server added and one \
                 deleted, only its real servers listed"
            );
            for (name, n) in calls {
                *calls_per_change.entry(name).or_insert(0) += n;
            }
            change_ms.push(took.as_secs_f64() * 1e3);
        }
    });
    let explain = explain_times(&ns, &state, k.reps);
    drop(p);
    drop(ns);
    let (p50, p99) = (percentile_of(&mut change_ms, 0.5), percentile_of(&mut change_ms, 0.99));
    progress(format!(
        "{} endpoint changes: p50 {p50:.1} ms, p99 {p99:.1} ms; IPVS calls in all: {calls_per_change:?}",
        k.changes
    ));
    let r = |v: f64| (v * 10.0).round() / 10.0;
    let of = |f: fn(&Cold) -> Duration| median(&colds.iter().map(f).collect::<Vec<_>>());
    let (cold, netlink, tools, floor) = (of(|c| c.took), of(|c| c.netlink), of(|c| c.tools), median(&floors));
    json!({
        "bench": "ipvs_sync",
        "services": k.services,
        "endpoints": k.endpoints,
        "reps": k.reps,
        "saved_lines": saved_lines,
        "virtual_servers": virtual_servers,
        "ipset_entries": ipset_entries,
        "cold_sync_ms": r(cold),
        "cold_sync_netlink_ms": r(netlink),
        "cold_sync_tools_ms": r(tools),
        "render_ms": r(render_ms),
        "floor_ms": r(floor),
        "ratio": (cold / floor * 100.0).round() / 100.0,
        "netlink_ratio": (netlink / floor * 100.0).round() / 100.0,
        "changes": k.changes,
        "change_p50_ms": r(p50),
        "change_p99_ms": r(p99),
        "change_calls": calls_per_change,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "explain_one_ms": r(explain.one),
        "explain_all_ms": r(explain.all),
        "explain_all_lines": explain.all_lines,
        "ipvsadm_list_ms": r(explain.ipvsadm_list),
    })
}

/// `kube-proxy explain` on the programmed namespace, with the cluster read from manifests (the
/// VM runs no daemon): medians of `reps` runs, and `ipvsadm -Ln` there for comparison.
struct ExplainTimes {
    one: f64,
    all: f64,
    all_lines: usize,
    ipvsadm_list: f64,
}

fn explain_times(ns: &Netns, state: &ProxyState, reps: usize) -> ExplainTimes {
    let feed = cluster::Feed::manifests(&state.service_ports, cluster::node_object(false), &[]);
    let last = &state.service_ports.last().expect("a Service").port.name;
    let base = [
        format!("{}=1", kube_proxy::explain::gather::TIMINGS_ENV),
        BIN.to_string(),
        "explain".to_string(),
        "--proxy-mode=ipvs".into(),
        "--hostname-override=node-a".into(),
        feed.daemon_arg(),
    ];
    let time = |program: &str, args: &[String], what: &str| -> (f64, usize) {
        let (mut v, mut lines) = (Vec::new(), 0);
        for _ in 0..reps {
            let t = Instant::now();
            let out = ns.exec(program, args).expect("the command runs");
            v.push(t.elapsed());
            let code = out.status.code().unwrap_or(-1);
            assert!(
                code == 0 || code == 1,
                "{program} {args:?}: exit {code}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            lines = String::from_utf8_lossy(&out.stdout).lines().count();
            if v.len() == reps {
                // Where the last run's time went.
                for line in String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .filter(|l| l.contains("timing"))
                {
                    progress(format!("  {line}"));
                }
            }
        }
        let m = median(&v);
        progress(format!("{what}: median {m:.0} ms ({lines} lines)"));
        (m, lines)
    };
    let mut one_args = base.to_vec();
    one_args.push(format!("{}/{}", last.namespace, last.name));
    let (one, _) = time("env", &one_args, "explain one Service");
    let mut all_args = base.to_vec();
    all_args.push("--all".into());
    let (all, all_lines) = time("env", &all_args, "explain --all");
    assert!(
        all_lines >= state.service_ports.len(),
        "--all gives a line per service port"
    );
    let (list, _) = time("ipvsadm", &["-Ln".to_string()], "ipvsadm -Ln");
    ExplainTimes {
        one,
        all,
        all_lines,
        ipvsadm_list: list,
    }
}

// ---------------------------------------------------------------------------------------------
// On the host.

/// The VM tests' cache of the kernel and initramfs `vm/prepare` derives.
fn cache_dir() -> std::path::PathBuf {
    let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("vm")
}

fn on_the_host(k: &Knobs) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the IPVS benchmark needs root (the VM)"
    );
    let missing = kube_proxy::vm::missing_host_tools();
    assert!(
        missing.is_empty(),
        "the IPVS benchmark runs in the test VM, which needs {missing:?} (packages: {})",
        kube_proxy::vm::PACKAGES
    );
    let exe = std::env::current_exe().expect("this benchmark's path");
    let exe = exe.to_str().expect("a UTF-8 path").to_string();
    let vars = [
        format!("{IN_VM}=1"),
        format!("SERVICES={}", k.services),
        format!("ENDPOINTS={}", k.endpoints),
        format!("REPS={}", k.reps),
        format!("CHANGES={}", k.changes),
    ];
    let mem = u32::try_from(env_usize("VM_MEM_MB", 2048)).expect("VM_MEM_MB: a number of MB");
    let mut args: Vec<&str> = vec!["env"];
    args.extend(vars.iter().map(String::as_str));
    args.extend([exe.as_str(), "--bench"]);
    let load_start = loadavg_1m();
    progress(format!("booting the VM ({mem} MB); load average {}", loadavg()));
    let mut output = Vec::new();
    let code = Vm::new(cache_dir())
        .timeout(Duration::from_secs(3600))
        .memory_mb(mem)
        .run_streaming(&args, &mut |chunk| {
            use std::io::Write;
            let _ = std::io::stdout().write_all(chunk);
            output.extend_from_slice(chunk);
        })
        .unwrap_or_else(|e| panic!("the VM did not run the benchmark: {e}"));
    assert_eq!(code, 0, "the benchmark failed in the VM (output above)");
    let output = String::from_utf8_lossy(&output);
    let line = output
        .lines()
        .find_map(|l| l.strip_prefix(FIGURES))
        .expect("the VM printed its figures");
    let mut figures: Value = serde_json::from_str(line).expect("the figures are JSON");
    figures["load_average_start"] = json!(load_start);
    figures["load_average_end"] = json!(loadavg_1m());
    println!();
    println!(
        "IPVS, {} Services x {} endpoints, in the VM (TCG): cold sync {} ms (IPVS netlink {} ms), \
         ipvsadm --restore of the same {} ms: {}x ({}x for the netlink part); an endpoint change \
         p50 {} ms, p99 {} ms",
        thousands(k.services),
        k.endpoints,
        figures["cold_sync_ms"],
        figures["cold_sync_netlink_ms"],
        figures["floor_ms"],
        figures["ratio"],
        figures["netlink_ratio"],
        figures["change_p50_ms"],
        figures["change_p99_ms"]
    );
    println!("load average at the end: {}", loadavg());
    if let Ok(path) = std::env::var("BENCH_JSON") {
        let text = serde_json::to_string_pretty(&figures).expect("JSON");
        std::fs::write(&path, text + "\n").unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("figures written to {path}");
    }
}

fn main() {
    let k = Knobs {
        services: env_usize("SERVICES", 10_000).max(1),
        endpoints: env_usize("ENDPOINTS", 10).max(2),
        reps: env_usize("REPS", 3).max(1),
        changes: env_usize("CHANGES", 50),
    };
    common::start_clock();
    if in_vm() {
        let figures = in_the_vm(&k);
        println!("{FIGURES}{figures}");
    } else {
        on_the_host(&k);
    }
}
