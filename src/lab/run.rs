//! `kube-proxy lab`: builds a throw-away node, client pod, outside host and three endpoints in
//! network namespaces, runs the real daemon on its own manifests, and reproduces the seed
//! experiment as a readable report. It never touches the root namespace, and removes
//! everything it created on exit and on Ctrl-C.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::netns::ChildGuard;
use super::probe::{ProbeArgs, ProbeReport};
use super::scenario::{Ep, ServiceSpec, manifests};
use super::testbed::{Testbed, TestbedSpec};
use crate::config::ProxyMode;
use crate::iptables::names;

const PREFIX: &str = "kplab";
const CLUSTER_IP: &str = "10.96.165.10";
const NODE_PORT: u16 = 32517;
const SERVICE: &str = "default/web:p";

/// Runs the lab, printing the report to stdout. Ctrl-C or SIGTERM stops it and cleans up.
pub fn main(binary: PathBuf, mode: ProxyMode, connections: u32) -> Result<()> {
    preflight(mode)?;
    let dir = std::env::temp_dir().join(format!("kube-proxy-lab-{}", std::process::id()));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let worker_dir = dir.clone();
    let worker = std::thread::spawn(move || {
        let result = run(&binary, mode, &worker_dir, connections, &mut std::io::stdout());
        let _ = done_tx.send(result);
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting signal handling")?;
    let outcome = runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            r = done_rx => Some(r),
            _ = tokio::signal::ctrl_c() => None,
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => None,
        }
    });
    match outcome {
        Some(result) => {
            let _ = worker.join();
            let _ = std::fs::remove_dir_all(&dir);
            result.unwrap_or_else(|_| bail!("the lab stopped unexpectedly"))
        }
        None => {
            eprintln!("\ninterrupted: removing the lab's namespaces and processes");
            emergency_cleanup();
            let _ = std::fs::remove_dir_all(&dir);
            bail!("interrupted")
        }
    }
}

/// Everything the lab needs, with a message that says how to get it.
fn preflight(mode: ProxyMode) -> Result<()> {
    if mode == ProxyMode::Ipvs {
        bail!(
            "the lab runs --proxy-mode=iptables and nftables; IPVS mode is exercised end to end in a VM by tests/vm_ipvs_e2e.rs (the lab's report does not cover it yet)"
        );
    }
    if !nix::unistd::geteuid().is_root() {
        bail!("the lab creates network namespaces and must run as root (e.g. sudo kube-proxy lab)");
    }
    let mut missing = Vec::new();
    for (tool, package) in [
        ("ip", "iproute2"),
        ("iptables", "iptables"),
        ("iptables-save", "iptables"),
        ("iptables-restore", "iptables"),
    ] {
        let found = Command::new(tool)
            .arg(if tool == "ip" { "-V" } else { "--version" })
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            missing.push(format!("{tool} (package {package})"));
        }
    }
    if !missing.is_empty() {
        bail!(
            "missing tools: {}; on Debian/Ubuntu: apt-get install -y iproute2 iptables conntrack",
            missing.join(", ")
        );
    }
    Ok(())
}

/// After Ctrl-C the worker's destructors do not run: find our namespaces by name and remove
/// them (killing what runs inside first).
fn emergency_cleanup() {
    let mine = format!("{PREFIX}-{}-", std::process::id());
    let listed = Command::new("ip").args(["netns", "list"]).output();
    let Ok(listed) = listed else { return };
    for line in String::from_utf8_lossy(&listed.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if !name.starts_with(&mine) {
            continue;
        }
        if let Ok(pids) = Command::new("ip").args(["netns", "pids", name]).output() {
            for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "delete", name]).status();
    }
}

fn web(eps: &[Ep]) -> String {
    let mut svc = ServiceSpec::new("web", CLUSTER_IP, eps);
    svc.node_port = Some(NODE_PORT);
    manifests(&[svc])
}

fn write_manifests(dir: &Path, yaml: &str) -> Result<()> {
    let tmp = dir.join(".web.yaml.tmp");
    std::fs::write(&tmp, yaml).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join("web.yaml")).context("replacing the manifests")?;
    Ok(())
}

fn poll(timeout: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if check() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn run(binary: &Path, mode: ProxyMode, dir: &Path, connections: u32, out: &mut impl Write) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    writeln!(
        out,
        "kube-proxy lab: {} mode, everything in network namespaces named {PREFIX}-{}-*\n",
        mode.as_str(),
        std::process::id()
    )?;

    let t = Instant::now();
    let mut spec = TestbedSpec::new(PREFIX, binary);
    spec.endpoints = 3;
    let mut bed = Testbed::build(&spec)?;
    writeln!(
        out,
        "Test bed ready in {}: node {} (pods on 10.244.<k>.0/24), client pod {}, outside host {}, endpoints {}",
        ms(t.elapsed()),
        bed.node_ip(),
        bed.client_ip(),
        bed.outside_ips()[0],
        bed.endpoints()
            .iter()
            .map(|e| format!("{} {}", e.name, e.ip))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    let eps = |bed: &Testbed| bed.endpoints().iter().map(|e| Ep::local(e.ip)).collect::<Vec<_>>();
    write_manifests(dir, &web(&eps(&bed)))?;

    let args: Vec<String> = [
        "--hostname-override=node-a",
        "--cluster-cidr=10.244.0.0/16",
        "--iptables-min-sync-period=0s",
        "--iptables-sync-period=5s",
        &format!("--proxy-mode={}", mode.as_str()),
        "--manifests",
        &dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let t = Instant::now();
    let daemon: ChildGuard = bed.spawn_in_node(binary, &args)?;
    daemon
        .wait_for_log("Synced rules", Duration::from_secs(30))
        .context("the daemon's first sync")?;
    writeln!(
        out,
        "kube-proxy started in the node namespace with --manifests {}: first sync after {}\n",
        dir.display(),
        ms(t.elapsed())
    )?;

    let cip: SocketAddr = format!("{CLUSTER_IP}:80").parse()?;
    let chains = names::service_port_chains(SERVICE, "tcp");

    let nft = mode == ProxyMode::Nftables;
    let source = if nft {
        "nft list table ip kube-proxy"
    } else {
        "iptables-save -t nat"
    };
    writeln!(
        out,
        "1. The chains of Service {SERVICE} (ClusterIP {CLUSTER_IP}:80, NodePort {NODE_PORT}), from {source}"
    )?;
    show_service(out, &bed, nft, &chains.cluster)?;

    writeln!(
        out,
        "\n2. {connections} new TCP connections from the client pod to {cip}"
    )?;
    let report = bed.probe(&bed.client, &ProbeArgs::tcp(cip).with_count(connections))?;
    print_distribution(out, &report, connections)?;

    writeln!(out, "\n3. Scale to 4 endpoints")?;
    let new = bed.add_endpoint()?;
    let (new_name, new_addr) = (new.name.clone(), new.server_addr());
    let sep = names::endpoint_chain(SERVICE, "tcp", &new_addr.to_string());
    let changed = Instant::now();
    write_manifests(dir, &web(&eps(&bed)))?;
    let live = poll(Duration::from_secs(10), || {
        rules(&bed, nft).is_ok_and(|n| n.contains(&new_addr.to_string()))
    });
    let what = if nft {
        format!("endpoint chain (dnat to {new_addr})")
    } else {
        format!("{sep} (DNAT to {new_addr})")
    };
    match live {
        Some(_) => writeln!(
            out,
            "   manifest changed -> {what} live after {}",
            ms(changed.elapsed())
        )?,
        None => writeln!(out, "   the new endpoint's chain did not appear within 10 s")?,
    }
    show_service(out, &bed, nft, &chains.cluster)?;
    let report = bed.probe(&bed.client, &ProbeArgs::tcp(cip).with_count(100))?;
    writeln!(out, "   100 new connections: {}", summary(&report))?;
    if !report.names().contains_key(&new_name) {
        writeln!(out, "   (the new endpoint {new_name} got none of them)")?;
    }

    writeln!(out, "\n4. Scale to 0 endpoints")?;
    write_manifests(dir, &web(&[]))?;
    if nft {
        let has_reject = || rules(&bed, true).unwrap_or_default().contains("goto reject-chain");
        if poll(Duration::from_secs(10), has_reject).is_some() {
            for l in rules(&bed, true)?.lines().filter(|l| l.contains("reject")) {
                writeln!(out, "   nft: {}", l.trim())?;
            }
        }
    } else {
        let reject = format!("{SERVICE} has no endpoints");
        let filter = || bed.node.exec_ok("iptables-save", ["-t", "filter"]).unwrap_or_default();
        if poll(Duration::from_secs(10), || filter().contains(&reject)).is_some() {
            for l in filter().lines().filter(|l| l.contains(&reject)) {
                writeln!(out, "   filter: {l}")?;
            }
        }
    }
    let report = bed.probe(&bed.client, &ProbeArgs::tcp(cip).with_count(3).with_timeout_ms(2000))?;
    for a in &report.attempts {
        writeln!(
            out,
            "   connect {cip}: {} after {:.1} ms",
            a.error.as_deref().unwrap_or("answered"),
            a.elapsed_us as f64 / 1000.0
        )?;
    }

    writeln!(out, "\n5. The NodePort from the outside host")?;
    write_manifests(dir, &web(&eps(&bed)))?;
    poll(Duration::from_secs(10), || {
        rules(&bed, nft).is_ok_and(|n| n.contains(&bed.endpoint(0).server_addr().to_string()))
    });
    let n = rules(&bed, nft)?;
    let external = if nft {
        "external-".to_string()
    } else {
        format!("-A {} ", chains.external)
    };
    for l in n.lines().filter(|l| {
        l.starts_with("-A KUBE-NODEPORTS") || l.contains(&external) || (nft && l.contains(&NODE_PORT.to_string()))
    }) {
        writeln!(out, "   {}", l.trim())?;
    }
    let outside = bed.outside_ips()[0];
    let np = SocketAddr::new(bed.node_ip(), NODE_PORT);
    let report = bed.probe(&bed.outside, &ProbeArgs::tcp(np).with_bind(outside).with_count(10))?;
    let seen: Vec<String> = report.seen_sources().iter().map(ToString::to_string).collect();
    writeln!(out, "   10 connections from {outside} to {np}: {}", summary(&report))?;
    writeln!(
        out,
        "   the endpoints saw the client as {} (the node's address: masqueraded, externalTrafficPolicy Cluster)",
        seen.join(", ")
    )?;

    writeln!(
        out,
        "\n6. A few conntrack entries in the node namespace (the DNAT mapping)"
    )?;
    match bed
        .node
        .exec("conntrack", ["-L", "-p", "tcp", "--orig-dst", CLUSTER_IP])
    {
        Ok(o) if o.status.success() => {
            for l in String::from_utf8_lossy(&o.stdout).lines().take(4) {
                writeln!(out, "   {l}")?;
            }
        }
        _ => writeln!(out, "   (conntrack is not installed: apt-get install -y conntrack)")?,
    }

    drop(daemon);
    drop(bed);
    writeln!(out, "\nDone: the namespaces and processes of the lab are removed.")?;
    Ok(())
}

/// The rules of the mode in use: `nft list table ip kube-proxy` or `iptables-save -t nat`.
fn rules(bed: &Testbed, nft: bool) -> Result<String> {
    if nft {
        bed.node.exec_ok("nft", ["list", "table", "ip", "kube-proxy"])
    } else {
        bed_nat(bed)
    }
}

/// The Service's entry, its endpoint choice and the DNAT of each endpoint.
fn show_service(out: &mut impl Write, bed: &Testbed, nft: bool, svc_chain: &str) -> Result<()> {
    if !nft {
        return print_chains(out, &bed_nat(bed)?, svc_chain);
    }
    let listing = rules(bed, true)?;
    for l in listing.lines().map(str::trim) {
        if l.contains(CLUSTER_IP) && l.contains("goto")
            || l.contains("numgen")
            || l.contains("dnat to")
            || (l.starts_with("chain service-") || l.starts_with("chain endpoint-")) && l.contains('/')
        {
            writeln!(out, "   {l}")?;
        }
    }
    Ok(())
}

fn bed_nat(bed: &Testbed) -> Result<String> {
    bed.node.exec_ok("iptables-save", ["-t", "nat"])
}

/// The entry rule in KUBE-SERVICES, the service chain and the endpoint chains it jumps to.
fn print_chains(out: &mut impl Write, nat: &str, svc_chain: &str) -> Result<()> {
    let lines: Vec<&str> = nat.lines().collect();
    for l in lines
        .iter()
        .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.ends_with(svc_chain))
    {
        writeln!(out, "   entry: {l}")?;
    }
    let svc_rules: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with(&format!("-A {svc_chain} ")))
        .collect();
    for l in &svc_rules {
        writeln!(out, "   svc:   {l}")?;
    }
    for l in &svc_rules {
        let Some(sep) = l.rsplit(" -j ").next().filter(|t| t.starts_with("KUBE-SEP-")) else {
            continue;
        };
        for r in lines
            .iter()
            .filter(|r| r.starts_with(&format!("-A {sep} ")) && r.contains("DNAT"))
        {
            writeln!(out, "   sep:   {r}")?;
        }
    }
    Ok(())
}

fn summary(report: &ProbeReport) -> String {
    let mut parts: Vec<String> = report.names().iter().map(|(n, c)| format!("{n} {c}")).collect();
    for (e, c) in report.errors() {
        parts.push(format!("{e} {c}"));
    }
    parts.join(", ")
}

/// Counts per endpoint, a bar chart and a chi-square test of uniformity.
fn print_distribution(out: &mut impl Write, report: &ProbeReport, total: u32) -> Result<()> {
    let names: BTreeMap<String, usize> = report.names();
    let k = names.len().max(1);
    let expected = f64::from(total) / k as f64;
    for (name, count) in &names {
        writeln!(
            out,
            "   {name}: {count:>4} {}",
            "#".repeat((*count as f64 / expected * 20.0) as usize)
        )?;
    }
    if !report.errors().is_empty() {
        writeln!(out, "   errors: {:?}", report.errors())?;
    }
    let chi2: f64 = names.values().map(|&n| (n as f64 - expected).powi(2) / expected).sum();
    // Critical values of chi-square at p = 0.001 for 1..=5 degrees of freedom.
    let critical = [10.828, 13.816, 16.266, 18.467, 20.515]
        .get(k.saturating_sub(2))
        .copied()
        .unwrap_or(20.515);
    writeln!(
        out,
        "   chi-square = {chi2:.2} with {} degrees of freedom; a uniform split stays below {critical} at p = 0.001: {}",
        k - 1,
        if chi2 < critical { "uniform" } else { "NOT uniform" }
    )?;
    Ok(())
}
