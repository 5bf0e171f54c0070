//! Benchmark of the nftables mode. Needs root; every case runs in a network namespace of its
//! own (`unshare(CLONE_NEWNET)`), so nothing touches the machine's rules.
//!
//! For each size in `SIZES` (default `10000x10,44000x1,5000x50`: Services × endpoints) and
//! each backend in `BACKENDS` (default `netlink,nft`) it reports:
//! - render: the model → one full transaction (what `kube-proxy render` prints);
//! - floor: `nft -f` alone on the same bounded transactions the proxier sends in a cold
//!   sync (captured first, then piped to `nft -f -` one by one in a fresh namespace);
//! - cold: a cold full sync by the proxier (empty namespace → every rule live), and its
//!   ratio to the floor;
//! - change: one Service's endpoint replaced, made live by an incremental sync, p50/p99
//!   over `CHANGES` (default 100).
//!
//! Run with `cargo bench --bench nft_sync`. `FLOOR=0` skips the floor (it is slow with
//! `nft`: it lists every chain before each transaction); `MAX_OPS=N` bounds full-sync
//! transactions to N commands instead of the proxier's default (how the bound was chosen).
//! With the netlink backend it also prints the kernel's own cost of each kind of change on
//! the loaded table (set, map and verdict-map elements, chains with rules of several kinds:
//! which make the kernel validate every chain reachable from the base chains), and the time
//! a restart takes: a new proxier replacing the loaded table in one transaction.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::model::{IpFamily, ProxyState, synthetic};
use kube_proxy::nftables::ast::Transaction;
use kube_proxy::nftables::backend::TableObjects;
use kube_proxy::nftables::proxier::{NftBackend, NftCommand, NftError, NftProxier};
use kube_proxy::nftables::render_transaction;
use kube_proxy::proxy::RenderOptions;
use nix::sched::{CloneFlags, unshare};

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn fresh_namespace() {
    unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) needs root");
}

fn backend(name: &str) -> Box<dyn NftBackend> {
    match name {
        "nft" => Box::new(NftCommand),
        "netlink" => Box::new(kube_proxy::nftables::netlink::NftSocket::new().expect("netlink socket")),
        other => panic!("unknown backend {other} (netlink, nft)"),
    }
}

/// Captures transactions without applying them.
#[derive(Default)]
struct Capture(std::sync::Arc<std::sync::Mutex<Vec<Transaction>>>);

impl NftBackend for Capture {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        self.0.lock().expect("capture").push(tx.clone());
        Ok(())
    }
    fn table_exists(&mut self, _: IpFamily) -> Result<bool, NftError> {
        Ok(true)
    }
    fn objects(&mut self, _: IpFamily) -> Result<Option<TableObjects>, NftError> {
        Ok(None)
    }
}

/// Measures the time spent in the backend (the kernel, or `nft`) apart from ours.
struct Timed(Box<dyn NftBackend>, std::sync::Arc<std::sync::Mutex<Duration>>);

impl NftBackend for Timed {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        let t = Instant::now();
        let r = self.0.apply(tx);
        *self.1.lock().expect("timer") += t.elapsed();
        r
    }
    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        self.0.table_exists(family)
    }
    fn objects(&mut self, family: IpFamily) -> Result<Option<TableObjects>, NftError> {
        self.0.objects(family)
    }
    fn apply_parts(&mut self, family: IpFamily, parts: &mut dyn Iterator<Item = Transaction>) -> Result<(), NftError> {
        let t = Instant::now();
        let r = self.0.apply_parts(family, parts);
        *self.1.lock().expect("timer") += t.elapsed();
        r
    }
}

/// The commands of one change, and those that undo it.
type AddUndo = (Vec<kube_proxy::nftables::ast::Op>, Vec<kube_proxy::nftables::ast::Op>);

/// The kernel's own cost of each kind of change on the loaded table, over netlink (median of
/// 20 commits of an add, each undone by a second transaction): which kinds make the kernel
/// validate every chain reachable from the base chains at commit (loop detection and hook
/// checks), and which do not.
fn kernel_floor(state: &ProxyState) {
    use kube_proxy::nftables::ast::{ChainDecl, ElemKey, ElemValue, Element, Match, Op, Rule, Statement, Verdict};
    use kube_proxy::nftables::names::service_endpoints;
    let mut socket = kube_proxy::nftables::netlink::NftSocket::new().expect("netlink socket");
    let sp = &state.service_ports[0].port;
    let chain = kube_proxy::nftables::names::ServicePortChains::new(
        &sp.name.namespace,
        &sp.name.name,
        sp.protocol.lower(),
        &sp.name.port,
    )
    .cluster;
    let ip: std::net::IpAddr = "10.255.255.254".parse().expect("ip");
    let tcp = kube_proxy::model::Protocol::Tcp;
    let mut run = |add: Vec<Op>, undo: Vec<Op>| {
        let mut times = Vec::new();
        for _ in 0..20 {
            let tx = |ops: &Vec<Op>| Transaction {
                family: IpFamily::V4,
                ops: ops.clone(),
            };
            let t = Instant::now();
            socket.apply(&tx(&add)).expect("add");
            times.push(t.elapsed());
            socket.apply(&tx(&undo)).expect("undo");
        }
        times.sort();
        times[times.len() / 2]
    };
    let element = |set: &str, key: ElemKey, value: Option<ElemValue>| {
        let add = vec![Op::AddElement {
            set: set.into(),
            element: Element {
                key: key.clone(),
                value,
                comment: None,
            },
        }];
        let undo = vec![Op::DeleteElement { set: set.into(), key }];
        (add, undo)
    };
    // A chain nothing refers to, with one rule; its deletion undoes it.
    let lone_chain = |rule: Rule| {
        let add = vec![
            Op::AddChain(ChainDecl::regular("bench-lone")),
            Op::AddRule {
                chain: "bench-lone".into(),
                rule,
            },
        ];
        let undo = vec![
            Op::FlushChain("bench-lone".into()),
            Op::DeleteChain("bench-lone".into()),
        ];
        (add, undo)
    };
    // Numbers above the last block: never allocated.
    let free = kube_proxy::nftables::blocks::start(kube_proxy::nftables::blocks::BLOCKS);
    let cases: Vec<(&str, AddUndo)> = vec![
        ("a set element", element("cluster-ips", ElemKey::Addr(ip), None)),
        (
            "an interval → address . port (endpoint)",
            element(
                service_endpoints(tcp, kube_proxy::nftables::blocks::BLOCKS),
                ElemKey::Range(free, free + 99),
                Some(ElemValue::AddrPort("10.244.0.1:80".parse().expect("sa"))),
            ),
        ),
        (
            "a vmap element: drop",
            element(
                "no-endpoint-services",
                ElemKey::AddrProtoPort(ip, tcp, 80),
                Some(Verdict::Drop.into()),
            ),
        ),
        (
            "a vmap element: goto chain",
            element(
                "service-ips",
                ElemKey::AddrProtoPort(ip, tcp, 80),
                Some(Verdict::Goto(chain.clone()).into()),
            ),
        ),
        (
            "a chain + rule: accept",
            lone_chain(Rule::verdict(vec![], Verdict::Accept)),
        ),
        (
            "a chain + rule: dnat",
            lone_chain(Rule::new(
                vec![Match::L4proto(tcp)],
                Statement::Dnat("10.244.0.1:80".parse().expect("sa")),
            )),
        ),
        (
            "a chain + rule: goto chain",
            lone_chain(Rule::verdict(vec![], Verdict::Goto(chain.clone()))),
        ),
    ];
    for (what, (add, undo)) in cases {
        let d = run(add, undo);
        println!("{:<44} {:>12}", format!("  kernel: add {what}"), ms(d));
    }
}

fn nft_f(text: &str) {
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
}

fn change(current: &mut ProxyState, round: usize, endpoints: usize) {
    let services = current.service_ports.len();
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
    std::sync::Arc::make_mut(&mut current.service_ports[idx]).endpoints = eps;
}

fn main() {
    let sizes = env("SIZES", "10000x10,44000x1,5000x50");
    let backends = env("BACKENDS", "netlink,nft");
    let changes: usize = env("CHANGES", "100").parse().expect("CHANGES");
    let floor = env("FLOOR", "1") != "0";
    let opts = RenderOptions {
        local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
        ..RenderOptions::default()
    };
    let mut summary = Vec::new();
    for size in sizes.split(',') {
        let (s, e) = size.split_once('x').expect("SIZES like 10000x10");
        let (services, endpoints): (usize, usize) = (s.parse().expect("services"), e.parse().expect("endpoints"));
        let state = synthetic::state(services, endpoints);
        println!("== {services} Services x {endpoints} endpoints");
        let t = Instant::now();
        let text = render_transaction(&state, &opts, true);
        println!(
            "{:<44} {:>12}   ({} lines)",
            "render (one full transaction)",
            ms(t.elapsed()),
            text.lines().count()
        );
        drop(text);

        let mut floor_time = None;
        if floor {
            let captured = Capture::default();
            let txs = captured.0.clone();
            let mut p = NftProxier::with_backend(IpFamily::V4, opts.clone(), Box::new(captured));
            p.sync(&state).expect("capture");
            let txs = std::mem::take(&mut *txs.lock().expect("capture"));
            let texts: Vec<String> = txs.iter().map(Transaction::text).collect();
            fresh_namespace();
            let t = Instant::now();
            for text in &texts {
                nft_f(text);
            }
            let d = t.elapsed();
            println!(
                "{:<44} {:>12}   ({} transactions)",
                "floor: nft -f alone, same transactions",
                ms(d),
                texts.len()
            );
            floor_time = Some(d);
        }

        for b in backends.split(',') {
            fresh_namespace();
            let in_backend = std::sync::Arc::new(std::sync::Mutex::new(Duration::ZERO));
            let mut p = NftProxier::with_backend(
                IpFamily::V4,
                opts.clone(),
                Box::new(Timed(backend(b), in_backend.clone())),
            );
            if let Ok(max) = std::env::var("MAX_OPS") {
                p.set_max_ops_per_transaction(max.parse().expect("MAX_OPS"));
            }
            let t = Instant::now();
            p.sync(&state).expect("cold sync");
            let cold = t.elapsed();
            let ratio = floor_time.map_or(String::new(), |f| {
                format!("   ({:.2}x the floor)", cold.as_secs_f64() / f.as_secs_f64())
            });
            println!("{:<44} {:>12}{ratio}", format!("cold sync, {b}"), ms(cold));

            println!(
                "{:<44} {:>12}",
                "  of which in the backend",
                ms(*in_backend.lock().expect("timer"))
            );
            if b == "netlink" {
                kernel_floor(&state);
            }
            let mut current = state.clone();
            let mut times = Vec::new();
            let mut backend_times = Vec::new();
            for round in 0..changes {
                change(&mut current, round, endpoints);
                *in_backend.lock().expect("timer") = Duration::ZERO;
                let t = Instant::now();
                p.sync(&current).expect("change");
                times.push(t.elapsed());
                backend_times.push(*in_backend.lock().expect("timer"));
            }
            times.sort();
            backend_times.sort();
            let pct = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize];
            println!(
                "{:<44} {:>12}   p99 {}  (n = {changes})",
                format!("one endpoint change p50, {b}"),
                ms(pct(0.5)),
                ms(pct(0.99))
            );
            println!(
                "{:<44} {:>12}   p99 {}",
                "  of which in the backend p50",
                ms(backend_times[backend_times.len() / 2]),
                ms(backend_times[((backend_times.len() as f64 - 1.0) * 0.99).round() as usize])
            );
            // A restart: a new proxier over the loaded table replaces it in one transaction.
            let restart = if b == "netlink" && env("RESTART", "1") != "0" {
                drop(p);
                let mut p = NftProxier::with_backend(IpFamily::V4, opts.clone(), backend(b));
                let t = Instant::now();
                p.sync(&current).expect("restart sync");
                let d = t.elapsed();
                println!("{:<44} {:>12}", "restart: replace the loaded table", ms(d));
                ms(d)
            } else {
                "–".into()
            };
            summary.push(format!(
                "| {services} × {endpoints} | {b} | {} | {} | {} | {} | {} | {restart} |",
                floor_time.map_or("–".into(), ms),
                ms(cold),
                floor_time.map_or("–".into(), |f| format!("{:.2}", cold.as_secs_f64() / f.as_secs_f64())),
                ms(pct(0.5)),
                ms(pct(0.99)),
            ));
        }
    }
    println!(
        "\n| Services × endpoints | backend | floor (nft -f, same transactions) | cold sync | ratio | change p50 | change p99 | restart |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for line in summary {
        println!("{line}");
    }
}
