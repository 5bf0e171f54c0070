//! `kube-proxy explain` on a real node: each diagnosis is produced by creating its condition
//! for real in the namespace test bed (the daemon running on a manifest directory, in
//! iptables and in nftables mode), with real traffic where traffic is the cause or the proof,
//! and checked in both the text and the JSON output; a healthy Service gives exit status 0
//! and no diagnosis line; with the daemon stopped, explain reports from the manifests and
//! says the daemon is down. (IPVS diagnoses and conntrack-table pressure: `vm_ipvs_e2e.rs`.)

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use common::cluster::{BIN, Cluster, NEEDS, names_endpoint};
use common::explain::Explained;
use common::wait_until;
use kube_proxy::lab::probe::{ProbeArgs, ProbeReport};
use kube_proxy::lab::scenario::{Ep, NODE, ServiceSpec, manifests};
use kube_proxy::lab::testbed::Testbed;

static SERIAL: Mutex<()> = Mutex::new(());

const CLUSTER_IP: &str = "10.96.165.10";
const NODE_PORT: u16 = 32517;
const LB_IP: &str = "203.0.113.10";

fn cip() -> SocketAddr {
    SocketAddr::new(CLUSTER_IP.parse().unwrap(), 80)
}

fn web(eps: &[Ep]) -> String {
    let mut svc = ServiceSpec::new("web", CLUSTER_IP, eps);
    svc.node_port = Some(NODE_PORT);
    manifests(&[svc])
}

fn all_local(b: &Testbed) -> Vec<Ep> {
    b.endpoints().iter().map(|e| Ep::local(e.ip)).collect()
}

/// `kube-proxy explain ARGS` in the node namespace with the daemon's configuration.
fn explain(c: &Cluster, args: &[&str]) -> Explained {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(c.config_flags());
    common::explain::explain(&c.bed.node, &all)
}

fn probe(c: &Cluster, args: &ProbeArgs) -> ProbeReport {
    c.bed.probe(&c.bed.client, args).expect("probe runs")
}

fn probe_outside(c: &Cluster, args: &ProbeArgs) -> ProbeReport {
    c.bed.probe(&c.bed.outside, args).expect("probe runs")
}

fn start(mode: &'static str, tag: &str, endpoints: usize, manifests: impl Fn(&Testbed) -> String) -> Cluster {
    Cluster::start_in(mode, &format!("x{tag}"), endpoints, manifests)
}

fn a_healthy_service_has_no_diagnosis(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "ok", 3, |b| web(&all_local(b)));
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(30));
    assert_eq!(r.ok_count(), 30, "{:?}", r.errors());
    let x = explain(&c, &["web"]);
    assert_eq!(x.code, 0, "{}", x.text);
    assert_eq!(x.problems(), Vec::<String>::new());
    assert!(x.text.contains("Diagnosis: nothing wrong found."), "{}", x.text);
    // The kernel's own rule lines, each endpoint's DNAT among them (in nftables mode, its
    // interval of the `service-endpoints-…` map).
    for e in c.bed.endpoints() {
        let dnat = if mode == "nftables" {
            format!(" : {} . {}", e.ip, e.server_addr().port())
        } else {
            format!("--to-destination {}", e.server_addr())
        };
        assert!(x.text.contains(&dnat), "{dnat}:\n{}", x.text);
    }
    // The 30 connections, counted per endpoint from conntrack.
    let per = x.port()["connections"]["perEndpoint"].as_object().expect("counts");
    let total: u64 = per.values().filter_map(|v| v["total"].as_u64()).sum();
    assert_eq!(total, 30, "{per:?}");
    for r in x.port()["routes"].as_array().expect("routes") {
        assert_eq!(r["verdict"], "route", "{r}");
    }
    assert_eq!(x.json["facts"]["daemon"]["healthzStatus"], 200);
}

fn no_endpoints_clients_get_reject(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "none", 1, |_| web(&[]));
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(2).with_timeout_ms(1000));
    assert_eq!(r.errors().get("refused"), Some(&2), "{:?}", r.errors());
    let x = explain(&c, &["default/web"]);
    assert_eq!(x.code, 1);
    assert_eq!(x.problems(), vec!["no-endpoints"]);
    assert!(x.problem("no-endpoints").contains("connection refused"));
}

fn no_ready_endpoint_uses_the_terminating_ones(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "unready", 2, |b| {
        let mut terminating = Ep::local(b.endpoint(0).ip);
        terminating.conditions = "{ready: false, serving: true, terminating: true}";
        let mut unready = Ep::local(b.endpoint(1).ip);
        unready.conditions = "{ready: false, serving: false}";
        web(&[terminating, unready])
    });
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(5));
    assert_eq!(
        r.names().keys().collect::<Vec<_>>(),
        vec![&c.bed.endpoint(0).name],
        "{r:?}"
    );
    let x = explain(&c, &["web:p"]);
    assert_eq!(x.code, 1);
    assert_eq!(x.problems(), vec!["none-ready"]);
    assert!(
        x.problem("none-ready")
            .contains("1 terminating endpoints that still serve")
    );
}

fn external_traffic_policy_local_without_a_local_endpoint(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "etp", 1, |b| {
        let there = [Ep::on(b.endpoint(0).ip, "node-b")];
        let mut svc = ServiceSpec::new("web", CLUSTER_IP, &there);
        svc.node_port = Some(NODE_PORT);
        svc.load_balancer_ip = Some(LB_IP);
        svc.spec_extra = "  externalTrafficPolicy: Local\n  healthCheckNodePort: 32600\n";
        manifests(&[svc])
    });
    let lb: SocketAddr = format!("{LB_IP}:80").parse().unwrap();
    let r = probe_outside(&c, &ProbeArgs::tcp(lb).with_count(2).with_timeout_ms(700));
    assert_eq!(r.errors().get("timeout"), Some(&2), "dropped: {:?}", r.errors());
    // The health-check server opens after the sync that found the Service.
    wait_until(Duration::from_secs(10), "the health-check node port", || {
        !c.bed
            .node
            .exec_ok("ss", ["-Hltn", "sport = :32600"])
            .unwrap_or_default()
            .trim()
            .is_empty()
    });
    let x = explain(&c, &["web"]);
    assert_eq!(x.code, 1);
    assert_eq!(x.problems(), vec!["external-local-no-endpoint"]);
    let text = x.problem("external-local-no-endpoint");
    assert!(text.contains("dropped") && text.contains("32600 answers 503"), "{text}");
}

fn internal_traffic_policy_local_without_a_local_endpoint(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "itp", 1, |b| {
        let there = [Ep::on(b.endpoint(0).ip, "node-b")];
        let mut svc = ServiceSpec::new("web", CLUSTER_IP, &there);
        svc.spec_extra = "  internalTrafficPolicy: Local\n";
        manifests(&[svc])
    });
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(2).with_timeout_ms(700));
    assert_eq!(r.errors().get("timeout"), Some(&2), "dropped: {:?}", r.errors());
    let x = explain(&c, &["web"]);
    assert_eq!(x.problems(), vec!["internal-local-no-endpoint"]);
    assert!(x.problem("internal-local-no-endpoint").contains("are dropped"));
}

fn source_ranges_that_exclude_the_client(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "lbsr", 1, |b| {
        let eps = [Ep::local(b.endpoint(0).ip)];
        let mut svc = ServiceSpec::new("web", CLUSTER_IP, &eps);
        svc.node_port = Some(NODE_PORT);
        svc.load_balancer_ip = Some(LB_IP);
        svc.spec_extra = "  loadBalancerSourceRanges: [\"192.168.49.77/32\"]\n";
        manifests(&[svc])
    });
    let [allowed, other] = c.bed.outside_ips();
    let lb: SocketAddr = format!("{LB_IP}:80").parse().unwrap();
    let r = probe_outside(
        &c,
        &ProbeArgs::tcp(lb).with_bind(other).with_count(2).with_timeout_ms(700),
    );
    assert_eq!(r.errors().get("timeout"), Some(&2), "{:?}", r.errors());
    let x = explain(&c, &["web", "--from", &other.to_string()]);
    assert_eq!(x.problems(), vec!["source-range-excluded"]);
    assert!(x.problem("source-range-excluded").contains(&format!("exclude {other}")));
    let ok = explain(&c, &["web", "--from", &allowed.to_string()]);
    assert_eq!((ok.code, ok.problems()), (0, vec![]), "{}", ok.text);
}

fn rules_changed_behind_the_daemons_back(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "edit", 1, |b| web(&all_local(b)));
    let ep = c.bed.endpoint(0).server_addr();
    if mode == "nftables" {
        // The endpoint is an interval of the `service-endpoints-…` map the Service's chain
        // looks up: the map flushed, nothing is DNATed.
        let table = c
            .bed
            .node
            .exec_ok("nft", ["list", "table", "ip", "kube-proxy"])
            .expect("nft");
        let lines: Vec<String> = table.lines().map(|l| l.trim().to_string()).collect();
        let map = kube_proxy::nftables::readback::endpoint_maps(&lines)
            .into_iter()
            .next()
            .expect("a service-endpoints map");
        c.bed
            .node
            .exec_ok("nft", ["flush", "map", "ip", "kube-proxy", &map])
            .expect("flush");
    } else {
        let nat = c.nat();
        let sep = nat
            .lines()
            .find(|l| l.starts_with(":KUBE-SEP-"))
            .and_then(|l| l[1..].split_whitespace().next())
            .expect("an endpoint chain")
            .to_string();
        c.bed
            .node
            .exec_ok("iptables", ["-t", "nat", "-F", &sep])
            .expect("flush");
    }
    // The flushed endpoint chain (map) no longer translates: the connections go nowhere.
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(2).with_timeout_ms(700));
    assert_eq!(r.ok_count(), 0, "{:?}", r.errors());
    let x = explain(&c, &["web"]);
    assert_eq!(x.problems(), vec!["rules-differ"]);
    assert!(x.problem("rules-differ").contains("succeeded, so someone changed them"));
    let diffs = x.json["diffs"][0].as_array().expect("diffs");
    assert!(
        diffs
            .iter()
            .any(|d| d["kind"] == "missing" && names_endpoint(d["line"].as_str().unwrap_or(""), ep)),
        "{diffs:?}"
    );
    assert!(x.text.contains("missing in "), "{}", x.text);
}

fn a_failing_sync_is_named_with_its_error() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = start("iptables", "fail", 1, |b| web(&all_local(b)));
    drop(c.daemon.take());
    // The node's iptables-restore refuses every input (as it does for a kernel without a
    // match module): the daemon keeps the rules it had and reports the failure. (Whichever
    // backend the daemon chooses: it calls that backend's tool by name.)
    let bin = c.config.0.join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let tools = ["iptables", "ip6tables"]
        .into_iter()
        .flat_map(|t| ["", "-nft", "-legacy"].map(|b| format!("{t}{b}-restore")));
    for tool in tools {
        let script = bin.join(tool);
        std::fs::write(
            &script,
            "#!/bin/sh\necho 'iptables-restore: line 7 failed' >&2\nexit 1\n",
        )
        .expect("script");
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    }
    // Change something, so that the rules in the kernel are no longer what is wanted.
    let eps = [
        Ep::local(c.bed.endpoint(0).ip),
        Ep::local("10.244.1.9".parse().unwrap()),
    ];
    c.dir.write(&web(&eps));
    let path = format!("PATH={}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let daemon = c.spawn_daemon(&[path]);
    daemon
        .wait_for_log("Sync failed", Duration::from_secs(20))
        .expect("a failed sync");
    let x = explain(&c, &["web"]);
    assert!(x.problems().contains(&"rules-differ".to_string()), "{:?}", x.problems());
    let text = x.problem("rules-differ");
    assert!(
        text.contains("last sync failed") && text.contains("line 7 failed"),
        "{text}"
    );
    drop(daemon);
}

/// A kubeconfig whose API server does not answer.
const DEAD_API_KUBECONFIG: &str = concat!(
    "apiVersion: v1\nkind: Config\n",
    "clusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\", insecure-skip-tls-verify: true}}]\n",
    "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n",
    "current-context: x\n",
);

fn a_daemon_cut_off_from_the_api_server() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = start("iptables", "noapi", 1, |b| web(&all_local(b)));
    drop(c.daemon.take());
    let kubeconfig = c.config.0.join("kubeconfig");
    std::fs::write(&kubeconfig, DEAD_API_KUBECONFIG).expect("kubeconfig");
    // (--config replaces --kubeconfig, as upstream: the file names it.)
    c.config_extra = format!("clientConnection:\n  kubeconfig: {}\n", kubeconfig.display());
    let daemon = c
        .bed
        .spawn_in_node(Path::new(BIN), &c.config_flags())
        .expect("daemon starts");
    daemon
        .wait_for_log("Watch failed", Duration::from_secs(20))
        .expect("failing watches");
    let x = explain(&c, &["web"]);
    let text = x.problem("api-unreachable");
    assert!(text.contains("cannot reach the API server since 20"), "{text}");
    assert!(x.json["facts"]["desired"]["source"]["unreachableSince"].is_string());
    drop(daemon);
}

fn a_daemon_whose_healthz_fails() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The Node is being deleted: upstream's healthz answers 503 then.
    let deleted = NODE.replacen(
        "metadata: {name: node-a}",
        "metadata: {name: node-a, deletionTimestamp: \"2024-01-01T00:00:00Z\"}",
        1,
    );
    let c = start("iptables", "hz", 1, |b| web(&all_local(b)).replacen(NODE, &deleted, 1));
    let x = explain(&c, &["web"]);
    assert_eq!(x.problems(), vec!["healthz-failing"]);
    assert!(x.problem("healthz-failing").contains("answers 503"));
    assert_eq!(x.json["facts"]["daemon"]["healthzStatus"], 503);
}

/// A second kube-proxy of the other mode ran on the node (a botched migration) and was killed:
/// its rules are left, next to the running daemon's.
fn rules_left_by_another_mode(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = start(mode, "left", 1, |b| web(&all_local(b)));
    let other = if mode == "nftables" { "iptables" } else { "nftables" };
    // Its own ports (set in its file: --config replaces the flags, as upstream).
    c.config_extra = "metricsBindAddress: 127.0.0.1:20249\nhealthzBindAddress: 127.0.0.1:20256\n".into();
    let mut flags = c.config_flags_for(other);
    c.config_extra.clear();
    flags.extend(["--manifests".to_string(), c.dir.0.display().to_string()]);
    let mut proxy = c.bed.spawn_in_node(Path::new(BIN), &flags).expect("second proxy");
    proxy
        .wait_for_log("Synced rules", Duration::from_secs(20))
        .expect("its sync");
    proxy.kill().expect("kill -9");
    // The daemon repairs its own rules (the other one removed them at its start) at its next
    // check (the other mode's rules would carry the traffic meanwhile).
    let own = || match mode {
        "nftables" => c
            .bed
            .node
            .exec_ok("nft", ["list", "table", "ip", "kube-proxy"])
            .unwrap_or_default(),
        _ => c.nat(),
    };
    wait_until(Duration::from_secs(15), "the daemon's rules back", || {
        own().contains(CLUSTER_IP) && names_endpoint(&own(), c.bed.endpoint(0).server_addr())
    });
    let x = explain(&c, &["web"]);
    assert_eq!(x.problems(), vec!["leftover-mode"], "{}", x.text);
    assert!(x.problem("leftover-mode").contains(&format!("rules of {other} mode")));
    c.daemon.take();
}

fn session_affinity_pins_the_client(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "aff", 3, |b| {
        let eps = all_local(b);
        let mut svc = ServiceSpec::new("web", CLUSTER_IP, &eps);
        svc.spec_extra = "  sessionAffinity: ClientIP\n";
        manifests(&[svc])
    });
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(50));
    assert_eq!((r.ok_count(), r.names().len()), (50, 1), "{r:?}");
    let x = explain(&c, &["web"]);
    assert_eq!(x.problems(), vec!["session-affinity"]);
    assert!(x.problem("session-affinity").contains("50 of 50 connections"));
}

fn long_lived_connections_stay_on_one_endpoint(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "long", 3, |b| web(&[Ep::local(b.endpoint(0).ip)]));
    let streams = 12;
    std::thread::scope(|s| {
        let bed = &c.bed;
        let handles: Vec<_> = (0..streams)
            .map(|_| {
                s.spawn(move || {
                    let args = ProbeArgs::tcp(cip()).with_stream_seconds(12.0).with_interval_ms(500);
                    bed.probe(&bed.client, &args)
                })
            })
            .collect();
        // Opened while the Service had one endpoint; then it gets two more.
        std::thread::sleep(Duration::from_secs(2));
        c.dir.write(&web(&all_local(&c.bed)));
        let third = c.bed.endpoint(2).server_addr();
        wait_until(Duration::from_secs(10), "three endpoints", || {
            names_endpoint(&c.rules(), third)
        });
        let x = explain(&c, &["web"]);
        assert_eq!(x.problems(), vec!["concentrated"], "{}", x.text);
        let text = x.problem("concentrated");
        assert!(text.contains(&format!("{streams} of {streams} connections")), "{text}");
        assert!(text.contains(&c.bed.endpoint(0).server_addr().to_string()), "{text}");
        for h in handles {
            let r = h.join().expect("probe thread").expect("probe");
            let st = r.stream.as_ref().expect("a stream");
            assert!(st.errors.is_empty() && st.echoed == st.sent, "{st:?}");
        }
    });
}

fn stale_udp_entries_while_the_daemon_is_down(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dns = |eps: &[Ep]| {
        let mut svc = ServiceSpec::new("dns", CLUSTER_IP, eps);
        svc.protocol = "UDP";
        manifests(&[svc])
    };
    let mut c = start(mode, "udp", 2, |b| dns(&[Ep::local(b.endpoint(0).ip)]));
    let r = probe(&c, &ProbeArgs::udp(cip()).with_count(3).with_interval_ms(100));
    assert!(r.all_ok(), "{:?}", r.errors());
    drop(c.daemon.take());
    c.dir.write(&dns(&[Ep::local(c.bed.endpoint(1).ip)]));
    let dir = c.dir.0.display().to_string();
    let x = explain(&c, &["dns", "--manifests", &dir]);
    let problems = x.problems();
    for code in ["daemon-down", "stale-udp", "rules-differ"] {
        assert!(problems.contains(&code.to_string()), "{code}: {problems:?}");
    }
    assert!(x.problem("daemon-down").contains("kube-proxy does not answer"));
    assert!(
        x.problem("stale-udp")
            .contains(&c.bed.endpoint(0).server_addr().to_string())
    );
    assert!(x.text.contains("kube-proxy is down"), "{}", x.text);
    assert_eq!(x.json["facts"]["desiredFrom"], format!("manifests {dir}"));
}

fn an_endpoint_address_without_a_route(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ghost = "10.244.200.2";
    let c = start(mode, "ghost", 1, |_| web(&[Ep::local(ghost.parse().unwrap())]));
    let r = probe(&c, &ProbeArgs::tcp(cip()).with_count(1).with_timeout_ms(700));
    assert!(!r.all_ok(), "nothing answers for a ghost: {r:?}");
    let x = explain(&c, &["web"]);
    assert_eq!(x.problems(), vec!["no-route"]);
    assert!(x.problem("no-route").contains(&format!("{ghost} (only default via")));
}

fn a_node_port_not_served_on_an_address(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let node = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus:\n  addresses: [{type: InternalIP, address: 192.168.49.2}, {type: ExternalIP, address: 192.168.49.3}]\n";
    let mut c = start(mode, "npa", 1, |b| web(&all_local(b)).replacen(NODE, node, 1));
    c.bed
        .node
        .ip(["addr", "add", "192.168.49.3/24", "dev", "eth0"])
        .expect("second address");
    let mut old = c.daemon.take().expect("running");
    old.kill().expect("stopped");
    c.config_extra = "nodePortAddresses: [\"192.168.49.2/32\"]\n".into();
    c.start_daemon();
    let at = |ip: &str| SocketAddr::new(ip.parse().unwrap(), NODE_PORT);
    let served = probe_outside(&c, &ProbeArgs::tcp(at("192.168.49.2")).with_count(2));
    assert!(served.all_ok(), "{:?}", served.errors());
    let not = probe_outside(
        &c,
        &ProbeArgs::tcp(at("192.168.49.3")).with_count(1).with_timeout_ms(700),
    );
    assert!(!not.all_ok(), "{not:?}");
    let x = explain(&c, &["web"]);
    assert_eq!(
        x.problems(),
        vec!["node-port-excluded"],
        "{}\n{}",
        x.json["facts"]["daemon"],
        c.daemon_log()
    );
    assert!(x.problem("node-port-excluded").contains("not served on 192.168.49.3"));
}

fn the_daemon_stopped_explain_reads_the_manifests(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = start(mode, "down", 2, |b| web(&all_local(b)));
    drop(c.daemon.take());
    let dir = c.dir.0.display().to_string();
    let x = explain(&c, &["web", "--manifests", &dir]);
    assert_eq!(
        x.problems(),
        vec!["daemon-down"],
        "the rules are still right: {}",
        x.text
    );
    assert!(
        x.text.contains(&format!("desired state from manifests {dir}")),
        "{}",
        x.text
    );
    assert!(x.text.contains("kube-proxy is down"));
    assert_eq!(x.port()["port"]["endpoints"].as_array().map(Vec::len), Some(2));
    // Without the manifests there is nothing to compare with: still said, and why.
    let y = explain(&c, &["web"]);
    assert!(y.problem("daemon-down").contains("--manifests DIR"));
}

fn all_gives_one_line_per_service_port(mode: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start(mode, "all", 1, |b| {
        let eps = all_local(b);
        manifests(&[
            ServiceSpec::new("web", CLUSTER_IP, &eps),
            ServiceSpec::new("empty", "10.96.165.11", &[]),
        ])
    });
    let x = explain(&c, &["--all"]);
    assert_eq!(x.code, 1);
    let lines: Vec<&str> = x.text.lines().collect();
    assert!(
        lines.iter().any(|l| l.starts_with("ok       default/web:p (IPv4)")),
        "{}",
        x.text
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("PROBLEM  default/empty:p (IPv4): no-endpoints")),
        "{}",
        x.text
    );
    assert_eq!(x.problems(), vec!["no-endpoints"]);
}

fn usage_errors_exit_2() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = start("iptables", "usage", 1, |b| web(&all_local(b)));
    for args in [
        vec!["explain", "Not/A_Name"],
        vec!["explain"],
        vec!["explain", "web", "--manifests", "/no/such/dir"],
    ] {
        let out = c.bed.node.exec(BIN, &args).expect("runs");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

const IN_EVERY_MODE: &[(&str, common::harness::PerModeTest)] = &common::harness::named![
    a_healthy_service_has_no_diagnosis,
    no_endpoints_clients_get_reject,
    no_ready_endpoint_uses_the_terminating_ones,
    external_traffic_policy_local_without_a_local_endpoint,
    internal_traffic_policy_local_without_a_local_endpoint,
    source_ranges_that_exclude_the_client,
    rules_changed_behind_the_daemons_back,
    rules_left_by_another_mode,
    session_affinity_pins_the_client,
    long_lived_connections_stay_on_one_endpoint,
    stale_udp_entries_while_the_daemon_is_down,
    an_endpoint_address_without_a_route,
    a_node_port_not_served_on_an_address,
    the_daemon_stopped_explain_reads_the_manifests,
    all_gives_one_line_per_service_port,
];

const ONCE: &[(&str, fn())] = &common::harness::named![
    a_failing_sync_is_named_with_its_error, a_daemon_cut_off_from_the_api_server, a_daemon_whose_healthz_fails,
    usage_errors_exit_2,
];

fn main() -> ExitCode {
    common::harness::run_per_mode(IN_EVERY_MODE, ONCE, NEEDS)
}
