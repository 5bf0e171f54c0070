//! Benchmark of the nftables mode as it is today (every sync replaces the table in one
//! transaction). Needs root; runs in network namespaces of its own. For `SERVICES` (default
//! 1,000) × `ENDPOINTS` (default 10) it reports: render time, `nft -f` alone on the same
//! transaction in a fresh namespace (the floor), a cold sync by the proxier, and one endpoint
//! change (p50/p99 of `CHANGES`, default 10). Run with `cargo bench --bench nft_sync`.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::RenderOptions;
use kube_proxy::model::{IpFamily, synthetic};
use kube_proxy::nftables::{proxier::NftProxier, render};
use nix::sched::{CloneFlags, unshare};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let (services, endpoints, changes) = (env("SERVICES", 1000), env("ENDPOINTS", 10), env("CHANGES", 10));
    let opts = RenderOptions {
        local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
        ..RenderOptions::default()
    };
    let state = synthetic::state(services, endpoints);
    println!("{services} Services x {endpoints} endpoints, nftables mode (whole-table transactions)");

    let t = Instant::now();
    let text = render(&state, &opts);
    println!(
        "{:<48} {:>12}   ({} lines)",
        "render",
        ms(t.elapsed()),
        text.lines().count()
    );

    unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) needs root");
    let t = Instant::now();
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    assert!(child.wait().expect("wait").success(), "nft -f failed");
    println!(
        "{:<48} {:>12}",
        "nft -f alone, same transaction (floor)",
        ms(t.elapsed())
    );

    unshare(CloneFlags::CLONE_NEWNET).expect("second namespace");
    let mut proxier = NftProxier::new(IpFamily::V4, opts);
    let t = Instant::now();
    proxier.sync(&state).expect("cold sync");
    println!("{:<48} {:>12}", "cold sync by the proxier", ms(t.elapsed()));

    let mut current = state.clone();
    let mut times = Vec::new();
    for round in 0..changes {
        let idx = (round * 7919) % services;
        let name = current.service_ports[idx].port.name.name.clone();
        let i: usize = name.trim_start_matches("svc").parse().expect("synthetic name");
        let mut eps = current.service_ports[idx].endpoints.clone();
        eps.pop();
        eps.extend(
            synthetic::service(i, endpoints, 1 + round as u32)
                .endpoints
                .into_iter()
                .take(1),
        );
        eps.sort_by_key(|e| e.to_string());
        current.service_ports[idx].endpoints = eps;
        let t = Instant::now();
        proxier.sync(&current).expect("change");
        times.push(t.elapsed());
    }
    times.sort();
    let p = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{:<48} {:>12}   p99 {}  (n = {changes})",
        "one endpoint change p50",
        ms(p(0.5)),
        ms(p(0.99))
    );
}
