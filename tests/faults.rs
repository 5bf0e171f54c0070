//! Kernel-side faults and other agents' rules, with the real daemon in a test bed (see
//! `common::cluster`), in iptables and nftables mode:
//! - a simulated CNI/firewall agent (`common::agent`) keeps writing and removing its own rules
//!   in nat and filter and in its own nftables table while the daemon does full syncs (restarts,
//!   and in iptables mode a removed canary): none of its rules may be lost or duplicated, and
//!   ours must end as a fresh render;
//! - the daemon killed (SIGKILL) in the middle of a full sync to a new state: the restart
//!   converges to a fresh render, with no duplicate and no stale rule;
//! - an `iptables-restore` that fails, and a transaction the kernel rejects: the rules keep
//!   working, the sync is retried in full and succeeds, and the failures are counted.
//!
//! `KUBE_PROXY_FAULT_SERVICES` sets how many Services the agent and kill tests run with
//! (default 1,000, which splits an iptables full sync into several restores; 10,000 is the
//! issue's size, best tried in a release build: a debug one's first sync at 10,000 can take
//! longer than the 60 s deadline: `KUBE_PROXY_FAULT_SERVICES=10000 cargo test --release --test
//! faults`).

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::cluster::{Cluster, NEEDS, SYNC_PERIOD_S, stop_daemon, with_fillers};
use common::harness::test;
use common::load::StopOnDrop;
use common::{ManifestDir, http_get, wait_until, wait_until_every};
use kube_proxy::lab::probe::ProbeArgs;
use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
use kube_proxy::lab::testbed::Testbed;
use nix::sys::signal::Signal;

static SERIAL: Mutex<()> = Mutex::new(());

/// The probed Services: on every endpoint, first and last in the sync order.
const PROBED: [(&str, &str); 2] = [("aaa-web", "10.96.165.10"), ("zzz-last", "10.96.165.30")];

/// The agent's pace: in iptables mode at 5,000 Services and more, at most a write every
/// 500 ms (see where it is used); elsewhere as fast as it goes.
fn agent_write_every(mode: &str) -> Duration {
    if mode == "iptables" && services() >= 5_000 {
        Duration::from_millis(500)
    } else {
        Duration::ZERO
    }
}

fn services() -> usize {
    std::env::var("KUBE_PROXY_FAULT_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

fn web() -> SocketAddr {
    SocketAddr::new(PROBED[0].1.parse().expect("ip"), 80)
}

/// How many lines of the daemon's log contain `needle`.
fn logged(c: &Cluster, needle: &str) -> usize {
    c.daemon_log().lines().filter(|l| l.contains(needle)).count()
}

fn synced_line(c: &Cluster) -> String {
    format!("\"Synced rules\" mode=\"{}\" ipFamily=\"IPv4\"", c.mode)
}

/// Where the kernel's rules (IPv4) differ from a fresh render of the manifests; nothing when
/// they agree. nftables: the table listed as JSON against the render applied by `nft -f` in
/// a namespace of its own. iptables: every `KUBE-*` chain of nat and filter with its rules
/// against the render's, and no rule twice in any chain (built-in ones included).
fn drift(c: &Cluster) -> Vec<String> {
    let rendered = common::render(&c.dir.0, &c.config_flags());
    if c.mode == "nftables" {
        let listed = c
            .bed
            .node
            .exec_ok("nft", ["-j", "list", "table", "ip", "kube-proxy"])
            .unwrap_or_default();
        if listed.trim().is_empty() {
            return vec!["no table ip kube-proxy".into()];
        }
        let text = rendered
            .split("# nft -f - input (IPv6)")
            .next()
            .unwrap_or_default()
            .to_string();
        let want = common::nft::applied_in_fresh_netns(text);
        return common::nft::differences(&common::nft::normalised(listed.as_bytes()), &want);
    }
    let want = common::restore_inputs(&rendered)
        .into_iter()
        .find(|(v6, _)| !v6)
        .map(|(_, text)| text)
        .unwrap_or_default();
    let kernel = format!("{}{}", c.nat(), c.filter());
    let (got, want) = (chains(&kernel), chains(&want));
    let mut out = Vec::new();
    for (chain, rules) in &got {
        let mut seen = std::collections::BTreeSet::new();
        for r in rules.iter().filter(|r| !seen.insert(*r)) {
            out.push(format!("{chain}: twice: {r}"));
        }
    }
    let ours = |k: &&String| {
        let name = k.split_whitespace().nth(1).unwrap_or_default();
        name.starts_with("KUBE-") && !name.ends_with("-CANARY") && name != "KUBE-FIREWALL"
    };
    for k in want.keys().filter(ours) {
        match got.get(k) {
            None => out.push(format!("missing chain {k}")),
            Some(r) if r.len() != want[k].len() => out.push(format!(
                "{k}: {} rules, the render has {}:\n  {}",
                r.len(),
                want[k].len(),
                r.join("\n  ")
            )),
            Some(_) => {}
        }
    }
    for k in got.keys().filter(ours).filter(|k| !want.contains_key(*k)) {
        out.push(format!("stale chain {k}: {:?}", got[k]));
    }
    out
}

/// `iptables-restore`/`iptables-save` text → "TABLE CHAIN" → its `-A` lines.
fn chains(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut table = "";
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        } else if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap_or_default();
            out.entry(format!("{table} {chain}")).or_default();
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or_default();
            out.entry(format!("{table} {chain}"))
                .or_default()
                .push(line.to_string());
        }
    }
    out
}

/// Waits (at most `timeout`) for the kernel to agree with a fresh render; panics with the
/// differences left.
fn assert_converges(c: &Cluster, timeout: Duration, what: &str) {
    let deadline = Instant::now() + timeout;
    loop {
        let d = drift(c);
        if d.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the rules still differ from a fresh render ({} differences):\n{}",
            d.len(),
            d.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn assert_web_answers(c: &Cluster) {
    let r = c.probe_client(&ProbeArgs::tcp(web()).with_count(20));
    assert_eq!(r.ok_count(), 20, "{:?}", r.errors());
}

/// The agent churns its rules while the daemon is restarted three times (SIGKILL and SIGTERM
/// alternately: each start is a full sync over the existing rules) and, in iptables mode,
/// finds its canary gone twice (a full sync in place). The agent checks its rules every 10
/// writes and at the end: none lost, none duplicated; ours end as a fresh render.
fn other_agents_rules_survive_full_syncs(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let n = services();
    let mut c = Cluster::start_in(mode, &format!("agent{}", &mode[..3]), 2, |b| {
        with_fillers(b, &PROBED, 0..n)
    });
    let stop = AtomicBool::new(false);
    let mut windows: Vec<(Instant, Instant)> = Vec::new();
    let (problems, ops, checks) = std::thread::scope(|s| {
        let bed: &Testbed = &c.bed;
        let stop = &stop;
        let agent = s.spawn(move || {
            let mut agent = Agent::install(&bed.node, 0x5eed);
            let (mut problems, mut ops, mut checks) = (Vec::new(), Vec::new(), 0);
            while !stop.load(Ordering::SeqCst) {
                let started = Instant::now();
                if let Err(lost) = agent.step() {
                    problems.push(format!("at write {}: {lost}", agent.ops));
                }
                ops.push(Instant::now());
                // Paced as a busy agent at 10,000 Services: unpaced (50 writes/s), and even at
                // 5/s, its writes restart every dump of the nat table, and the
                // `iptables-save -t nat` of a full sync (ours as upstream's) never ends.
                if let Some(rest) = (started + agent_write_every(mode)).checked_duration_since(Instant::now()) {
                    std::thread::sleep(rest);
                }
                if agent.ops.is_multiple_of(10) {
                    checks += 1;
                    problems.extend(
                        agent
                            .check()
                            .into_iter()
                            .map(|p| format!("after {} writes: {p}", agent.ops)),
                    );
                }
            }
            problems.extend(agent.check().into_iter().map(|p| format!("at the end: {p}")));
            println!("agent: {} writes, {} of its rules at the end", agent.ops, agent.rules());
            (problems, ops, checks)
        });
        let _stop = StopOnDrop(stop);
        for round in 0..3 {
            let signal = if round % 2 == 0 {
                Signal::SIGKILL
            } else {
                Signal::SIGTERM
            };
            let from = stop_daemon(&mut c.daemon, signal);
            let daemon = c.spawn_synced_daemon();
            c.daemon = Some(daemon);
            windows.push((from, Instant::now()));
            if mode == "iptables" && round < 2 {
                let full = logged(&c, "full=true");
                let from = Instant::now();
                c.bed
                    .node
                    .exec_ok("iptables", ["-w", "-t", "mangle", "-X", "KUBE-PROXY-CANARY"])
                    .expect("remove the canary");
                wait_until(
                    Duration::from_secs(SYNC_PERIOD_S * 3 + 30),
                    "a full sync after the canary went",
                    || logged(&c, "full=true") > full,
                );
                windows.push((from, Instant::now()));
            }
        }
        stop.store(true, Ordering::SeqCst);
        agent.join().expect("agent thread")
    });
    for (from, to) in &windows {
        let during = ops.iter().filter(|t| (*from..*to).contains(t)).count();
        println!("full sync over {:?}: {during} agent writes meanwhile", *to - *from);
        assert!(during >= 3, "the agent wrote during the full sync: {during} writes");
    }
    assert!(checks >= 3, "the agent checked its rules {checks} times");
    assert!(problems.is_empty(), "the agent's rules:\n{}", problems.join("\n"));
    assert_converges(&c, Duration::from_secs(10), "after the full syncs");
    assert_web_answers(&c);
}

/// The daemon killed (SIGKILL) in the middle of a full sync to a new state (a tenth of the
/// Services gone, as many new): once it logged that it built the state it syncs (`-v=2`), and
/// before it logged the sync done. In nftables mode the first round builds a deleted table
/// anew, the others replace the table in one transaction. Right after the kill the Services
/// work (by the old rules or the new), and the next start converges to a fresh render: no
/// duplicate and no stale rule, nothing missing.
fn kill_9_in_a_full_sync_converges_without_duplicates_or_stale_rules(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let n = services();
    let mut c = Cluster::start_in(mode, &format!("kill{}", &mode[..3]), 2, |b| {
        with_fillers(b, &PROBED, 0..n)
    });
    c.daemon_args.push("-v=2".into());
    let shift = n / 10;
    let mut killed_mid_sync = 0;
    for round in 1..=3 {
        stop_daemon(&mut c.daemon, Signal::SIGKILL);
        let start = (3 - round) * shift;
        c.dir.write(&with_fillers(&c.bed, &PROBED, start..start + n));
        if mode == "nftables" && round == 1 {
            c.bed
                .node
                .exec_ok("nft", ["delete", "table", "ip", "kube-proxy"])
                .expect("delete our table");
        }
        let daemon = c.spawn_daemon(&[]);
        c.daemon = Some(daemon);
        let (built, done) = ("\"Built the state\" ipFamily=\"IPv4\"", synced_line(&c));
        wait_until_every(
            Duration::from_millis(2),
            Duration::from_secs(60),
            "the full sync under way",
            || logged(&c, built) > 0 || logged(&c, &done) > 0,
        );
        stop_daemon(&mut c.daemon, Signal::SIGKILL);
        let mid = logged(&c, &done) == 0;
        killed_mid_sync += usize::from(mid);
        let d = drift(&c);
        println!(
            "round {round}: killed {} the sync ended; {} differences from the new state's render",
            if mid { "before" } else { "after" },
            d.len()
        );
        if mode == "iptables" || round > 1 {
            assert_web_answers(&c);
        }
        c.start_daemon();
        assert_converges(
            &c,
            Duration::from_secs(10),
            &format!("round {round}: after the restart"),
        );
        assert_web_answers(&c);
    }
    assert!(
        killed_mid_sync >= 2,
        "{killed_mid_sync} of 3 kills came in the middle of a sync"
    );
}

/// A wrapper directory for `PATH`: every `iptables-restore` variant runs the real tool
/// (from /usr/sbin) unless the file `failures` there holds a count above 0, which a
/// restore (a run with `--noflush`) takes one off and fails with, as a refused restore does.
fn failing_restore_tools() -> ManifestDir {
    let dir = ManifestDir::new("kp-faults-wrappers");
    let script = "#!/bin/sh\n\
        # Fails while ./failures counts above 0 (one off per restore), else the real tool.\n\
        d=$(dirname \"$0\"); n=$(cat \"$d/failures\" 2>/dev/null || echo 0)\n\
        case \" $* \" in *\" --noflush \"*) if [ \"$n\" -gt 0 ]; then\n\
          echo $((n - 1)) > \"$d/failures\"; cat > /dev/null\n\
          echo \"iptables-restore: line 2 failed (injected by the test)\" >&2; exit 1\n\
        fi;; esac\n\
        PATH=/usr/sbin:/usr/bin:/sbin:/bin exec \"$(basename \"$0\")\" \"$@\"\n";
    for tool in ["iptables-restore", "iptables-nft-restore", "iptables-legacy-restore"] {
        let path = dir.0.join(tool);
        std::fs::write(&path, script).expect("write wrapper");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    dir
}

/// The daemon's `/metrics` line for `metric` (IPv4), or "" if absent.
fn metric(c: &Cluster, metric: &str) -> String {
    let (_, body) = http_get(c.bed.node.name(), "127.0.0.1:10249".parse().expect("addr"), "/metrics")
        .expect("the metrics server answers");
    body.lines()
        .find(|l| l.starts_with(&format!("kubeproxy_{metric}{{ip_family=\"IPv4\"}}")))
        .unwrap_or_default()
        .to_string()
}

fn two_services(b: &Testbed, web_eps: &[usize]) -> String {
    let all: Vec<Ep> = b.endpoints().iter().map(|e| Ep::local(e.ip)).collect();
    let some: Vec<Ep> = web_eps.iter().map(|&i| Ep::local(b.endpoint(i).ip)).collect();
    manifests(&[
        ServiceSpec::new(PROBED[0].0, PROBED[0].1, &some),
        ServiceSpec::new(PROBED[1].0, PROBED[1].1, &all),
    ])
}

/// Probes `zzz-last` (which no change touches) until `done`; every connect must succeed.
fn steady_probe_until(c: &Cluster, done: impl Fn() -> bool) {
    let other = SocketAddr::new(PROBED[1].1.parse().expect("ip"), 80);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "not done in time:\n{}", c.daemon_log());
        let r = c.probe_client(&ProbeArgs::tcp(other).with_count(5).with_timeout_ms(500));
        assert!(r.all_ok(), "the untouched Service keeps working: {:?}", r.errors());
    }
}

/// iptables mode: two restores fail (a wrapper on the daemon's `PATH` refuses them, as
/// iptables-restore does when the kernel or the lock refuses). The partial sync of a change
/// fails, its full retry a sync period later fails too, the next full sync succeeds; the
/// untouched Service works throughout, and the metrics count 2 failures, 1 of them partial.
fn a_failing_iptables_restore_is_retried_in_full_and_counted() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Cluster::start("restorefail", 2, |b| two_services(b, &[0, 1]));
    let tools = failing_restore_tools();
    stop_daemon(&mut c.daemon, Signal::SIGTERM);
    let path = format!(
        "PATH={}:{}",
        tools.0.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let daemon = c.spawn_synced_daemon_with(&[path]);
    c.daemon = Some(daemon);
    std::fs::write(tools.0.join("failures"), "2").expect("arm the wrapper");
    let synced = logged(&c, &synced_line(&c));
    c.dir.write(&two_services(&c.bed, &[1]));
    steady_probe_until(&c, || logged(&c, &synced_line(&c)) > synced);
    let log = c.daemon_log();
    assert_eq!(
        log.matches("Sync failed; keeping the previous rules and retrying with a full sync")
            .count(),
        2,
        "{log}"
    );
    assert!(
        log.contains("injected by the test"),
        "the tool's error is logged: {log}"
    );
    assert!(
        log.lines()
            .rev()
            .find(|l| l.contains(&synced_line(&c)))
            .is_some_and(|l| l.contains("full=true")),
        "the sync that succeeded was a full one: {log}"
    );
    assert!(metric(&c, "sync_proxy_rules_iptables_restore_failures_total").ends_with(" 2"));
    assert!(metric(&c, "sync_proxy_rules_iptables_partial_restore_failures_total").ends_with(" 1"));
    let gone = c.bed.endpoint(0).name.clone();
    let r = c.probe_client(&ProbeArgs::tcp(web()).with_count(20));
    assert!(
        r.all_ok() && !r.names().contains_key(&gone),
        "the change is live after the resync: {:?}",
        r.names()
    );
    assert_converges(&c, Duration::from_secs(5), "after the resync");
}

/// nftables mode: a rule someone put in our table jumps to the chain of a Service that then
/// goes. Its chain is flushed at once; deleting it a second later is refused by the kernel
/// (the chain is in use). The failure is counted, the full sync a sync period later flushes
/// every chain of our table (the intruder's too) and succeeds, the untouched Service works
/// throughout, and the table ends as a fresh render.
fn a_transaction_the_kernel_rejects_is_retried_in_full_and_counted() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::start_in("nftables", "nftreject", 2, |b| two_services(b, &[0, 1]));
    let listed = c.rules();
    let chain = listed
        .lines()
        .filter_map(|l| l.trim().strip_prefix("chain "))
        .map(|l| l.trim_end_matches(" {").to_string())
        .find(|name| name.contains(PROBED[0].0) && name.starts_with("service-"))
        .unwrap_or_else(|| panic!("no service chain for {}:\n{listed}", PROBED[0].0));
    for cmd in [
        "add chain ip kube-proxy intruder".to_string(),
        format!("add rule ip kube-proxy intruder jump {chain}"),
    ] {
        c.bed.node.exec_ok("nft", [cmd.as_str()]).expect("the intruder's rule");
    }
    let synced = logged(&c, &synced_line(&c));
    c.dir.write(&manifests(&[ServiceSpec::new(
        PROBED[1].0,
        PROBED[1].1,
        &c.bed.endpoints().iter().map(|e| Ep::local(e.ip)).collect::<Vec<_>>(),
    )]));
    let failed = "Sync failed; keeping the previous rules and retrying with a full sync";
    steady_probe_until(&c, || logged(&c, failed) >= 1);
    let applied = logged(&c, &synced_line(&c));
    steady_probe_until(&c, || {
        c.daemon_log()
            .lines()
            .skip_while(|l| !l.contains(failed))
            .any(|l| l.contains(&synced_line(&c)) && l.contains("full=true"))
    });
    assert!(applied > synced, "the change was applied before the deletion failed");
    let log = c.daemon_log();
    assert_eq!(logged(&c, failed), 1, "{log}");
    assert!(
        metric(&c, "sync_proxy_rules_nftables_sync_failures_total").ends_with(" 1"),
        "{log}"
    );
    let r = c.probe_client(&ProbeArgs::tcp(web()).with_count(1).with_timeout_ms(300));
    assert!(!r.all_ok(), "the deleted Service is gone");
    assert_converges(&c, Duration::from_secs(5), "after the resync");
}

/// The conntrack entries in the node namespace for `protocol` to `service`, counted by the
/// endpoint that answers them (the source of their reply direction).
fn flows_by_endpoint(c: &Cluster, protocol: &str, service: &str) -> BTreeMap<String, usize> {
    let listed = c
        .bed
        .node
        .exec_ok("conntrack", ["-L", "-p", protocol, "-d", service])
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for line in listed.lines() {
        if let Some(reply) = line.split("src=").nth(2).and_then(|r| r.split_whitespace().next()) {
            *out.entry(reply.to_string()).or_default() += 1;
        }
    }
    out
}

/// Conntrack entries pointing at a deleted endpoint: its UDP entries are deleted once the
/// endpoint goes (a client would otherwise keep sending into the void until the entry times
/// out), those of the endpoint that stays are kept; its TCP entries are left to the kernel,
/// as upstream leaves them (a terminating endpoint finishes its connections). UDP flows on
/// new source ports until both endpoints answered some.
fn conntrack_entries_to_a_deleted_endpoint_are_cleaned(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const DNS: &str = "10.96.165.40";
    let both = |b: &Testbed, eps: &[usize]| {
        let eps: Vec<Ep> = eps.iter().map(|&i| Ep::local(b.endpoint(i).ip)).collect();
        let mut udp = ServiceSpec::new("dns", DNS, &eps);
        udp.protocol = "UDP";
        manifests(&[ServiceSpec::new(PROBED[0].0, PROBED[0].1, &eps), udp])
    };
    let c = Cluster::start_in(mode, &format!("ct{}", &mode[..3]), 2, |b| both(b, &[0, 1]));
    let (gone, kept) = (c.bed.endpoint(0).ip.to_string(), c.bed.endpoint(1).ip.to_string());
    let to = SocketAddr::new(DNS.parse().expect("ip"), 80);
    wait_until_every(
        Duration::ZERO,
        Duration::from_secs(30),
        "UDP flows to both endpoints",
        || {
            let r = c.probe_client(&ProbeArgs::udp(to).with_count(1).with_timeout_ms(500));
            assert!(r.all_ok(), "{:?}", r.errors());
            let f = flows_by_endpoint(&c, "udp", DNS);
            f.contains_key(&gone) && f.contains_key(&kept)
        },
    );
    assert!(c.probe_client(&ProbeArgs::tcp(web()).with_count(20)).all_ok());
    let udp = flows_by_endpoint(&c, "udp", DNS);
    let tcp = flows_by_endpoint(&c, "tcp", PROBED[0].1);
    println!("before: UDP {udp:?}, TCP {tcp:?}");
    assert!(
        tcp.contains_key(&gone),
        "TCP entries to the endpoint that goes: {tcp:?}"
    );
    c.dir.write(&both(&c.bed, &[1]));
    let took = wait_until(
        Duration::from_secs(5),
        "the gone endpoint's UDP entries deleted",
        || !flows_by_endpoint(&c, "udp", DNS).contains_key(&gone),
    );
    println!("UDP entries to the deleted endpoint gone {took:?} after the change");
    let after = flows_by_endpoint(&c, "udp", DNS);
    assert_eq!(after.get(&kept), udp.get(&kept), "the live endpoint's UDP entries stay");
    let tcp_after = flows_by_endpoint(&c, "tcp", PROBED[0].1);
    assert_eq!(
        tcp_after.get(&gone),
        tcp.get(&gone),
        "TCP entries are left to the kernel"
    );
    assert!(
        logged(&c, "Deleted stale UDP conntrack entries") >= 1,
        "{}",
        c.daemon_log()
    );
}

fn main() -> std::process::ExitCode {
    let mut tests = Vec::new();
    for mode in ["iptables", "nftables"] {
        tests.push(test(
            format!("{mode}_mode::other_agents_rules_survive_full_syncs"),
            move || other_agents_rules_survive_full_syncs(mode),
        ));
        tests.push(test(
            format!("{mode}_mode::kill_9_in_a_full_sync_converges_without_duplicates_or_stale_rules"),
            move || kill_9_in_a_full_sync_converges_without_duplicates_or_stale_rules(mode),
        ));
        tests.push(
            test(
                format!("{mode}_mode::conntrack_entries_to_a_deleted_endpoint_are_cleaned"),
                move || conntrack_entries_to_a_deleted_endpoint_are_cleaned(mode),
            )
            .needs(&[common::harness::Requirement::Tool("conntrack")]),
        );
    }
    tests.push(test(
        "a_failing_iptables_restore_is_retried_in_full_and_counted",
        a_failing_iptables_restore_is_retried_in_full_and_counted,
    ));
    tests.push(test(
        "a_transaction_the_kernel_rejects_is_retried_in_full_and_counted",
        a_transaction_the_kernel_rejects_is_retried_in_full_and_counted,
    ));
    common::harness::run(tests.into_iter().map(|t| t.needs(NEEDS)))
}
