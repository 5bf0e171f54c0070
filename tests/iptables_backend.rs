//! The daemon chooses the iptables backend (legacy or nft) that holds the node's other rules,
//! and every iptables call of its modes goes there: in the node namespace of a test bed, seeded
//! with kubelet's chains in one backend only, the real daemon (`--manifests`, iptables mode)
//! must log its choice, program its chains in that backend and not in the other, and serve a
//! ClusterIP with real connections; then a switch to nftables mode removes iptables mode's
//! chains from that backend (kubelet's stay), and `--cleanup` leaves nothing of ours. Rules of
//! ours that an earlier run left in the other backend go once the daemon's are in place.
//! The decision itself is unit-tested on fixtures in `src/iptables/backend.rs`.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use common::harness::Requirement;
use common::{ManifestDir, wait_until};
use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::probe::ProbeArgs;
use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};

static SERIAL: Mutex<()> = Mutex::new(());

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const CLUSTER_IP: &str = "10.96.165.10";
/// The comment of the host firewall's rule in the seeded backend.
const HOST_RULE: &str = "host firewall: ssh";

/// A node namespace with kubelet's rules in `backend` (`legacy` or `nft`) only, a Service with
/// the bed's endpoints, and the daemon when one runs.
struct Node {
    bed: Testbed,
    backend: &'static str,
    other: &'static str,
    dir: ManifestDir,
    daemon: Option<ChildGuard>,
}

impl Node {
    fn new(backend: &'static str) -> Node {
        let mut spec = TestbedSpec::new(format!("kpb-{backend}"), BIN);
        spec.endpoints = 2;
        let bed = Testbed::build(&spec).expect("test bed builds");
        let dir = ManifestDir::new(&format!("kp-backend-{backend}"));
        let eps: Vec<Ep> = bed.endpoints().iter().map(|e| Ep::local(e.ip)).collect();
        dir.write(&manifests(&[ServiceSpec::new("web", CLUSTER_IP, &eps)]));
        let node = Node {
            bed,
            backend,
            other: if backend == "legacy" { "nft" } else { "legacy" },
            dir,
            daemon: None,
        };
        node.seed_kubelet_rules();
        node
    }

    fn iptables(&self, backend: &str, args: &[&str]) -> String {
        self.bed
            .node
            .exec_ok(format!("iptables-{backend}"), args)
            .unwrap_or_else(|e| panic!("iptables-{backend} {args:?}: {e:#}"))
    }

    fn save(&self, backend: &str, table: &str) -> String {
        self.bed
            .node
            .exec_ok(format!("iptables-{backend}-save"), ["-t", table])
            .unwrap_or_else(|e| panic!("iptables-{backend}-save: {e:#}"))
    }

    /// What kubelet (1.17 and later) leaves in the backend it uses, its hint and canaries, and a
    /// rule of the host's firewall beside them. (Kubelet's KUBE-FIREWALL of older releases is
    /// left out: iptables mode writes the same jumps to it and, as upstream, removes them.)
    fn seed_kubelet_rules(&self) {
        let b = self.backend;
        self.iptables(b, &["-w", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"]);
        for table in ["mangle", "nat", "filter"] {
            self.iptables(b, &["-w", "-t", table, "-N", "KUBE-KUBELET-CANARY"]);
        }
        self.iptables(
            b,
            &[
                "-w", "-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "22", "-m", "comment", "--comment",
                HOST_RULE, "-j", "ACCEPT",
            ],
        );
    }

    fn start_daemon(&mut self, mode: &str) {
        self.daemon = None;
        let args: Vec<String> = [
            "--hostname-override=node-a",
            "--cluster-cidr=10.244.0.0/16",
            &format!("--proxy-mode={mode}"),
            "--manifests",
            &self.dir.0.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let daemon = self.bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
        daemon
            .wait_for_log("Synced rules", Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("first sync: {e:#}\n{}", daemon.log()));
        self.daemon = Some(daemon);
    }

    fn log(&self) -> String {
        self.daemon.as_ref().map(ChildGuard::log).unwrap_or_default()
    }

    /// 20 new connections to the ClusterIP, every one answered by an endpoint of the bed.
    fn assert_served(&self) {
        let to = SocketAddr::new(CLUSTER_IP.parse().expect("an IP"), 80);
        let report = self
            .bed
            .probe(&self.bed.client, &ProbeArgs::tcp(to).with_count(20))
            .expect("probe runs");
        assert_eq!(
            report.ok_count(),
            20,
            "every connection answered: {:?}",
            report.errors()
        );
        let endpoints: Vec<&str> = self.bed.endpoints().iter().map(|e| e.name.as_str()).collect();
        for name in report.names().keys() {
            assert!(
                endpoints.contains(&name.as_str()),
                "{name} is not an endpoint: {endpoints:?}"
            );
        }
    }

    fn has_chain(&self, backend: &str, table: &str, chain: &str) -> bool {
        self.save(backend, table)
            .lines()
            .any(|l| l.strip_prefix(':').and_then(|r| r.split_whitespace().next()) == Some(chain))
    }

    /// Kubelet's chains and the host's rule are where they were, untouched by whatever we did.
    fn assert_kubelet_rules_kept(&self) {
        assert!(self.has_chain(self.backend, "mangle", "KUBE-IPTABLES-HINT"));
        for table in ["mangle", "nat", "filter"] {
            assert!(self.has_chain(self.backend, table, "KUBE-KUBELET-CANARY"), "{table}");
        }
        let filter = self.save(self.backend, "filter");
        assert!(filter.contains(HOST_RULE), "{filter}");
    }
}

fn chooses_and_programs_the_backend_kubelet_uses(backend: &'static str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut node = Node::new(backend);
    node.start_daemon("iptables");
    let log = node.log();
    let choice = log
        .lines()
        .find(|l| l.contains("Chose the iptables backend"))
        .unwrap_or_else(|| panic!("the choice is logged:\n{log}"));
    println!("{choice}");
    assert!(
        choice.contains(&format!("backend=\"{backend}\"")) && choice.contains("kubelet's chain KUBE-"),
        "{choice}"
    );
    for (table, chain) in [
        ("nat", "KUBE-SERVICES"),
        ("filter", "KUBE-FORWARD"),
        ("nat", "KUBE-PROXY-CANARY"),
    ] {
        assert!(node.has_chain(backend, table, chain), "{chain} in {backend}'s {table}");
        assert!(
            !node.has_chain(node.other, table, chain),
            "no {chain} in {}'s {table}",
            node.other
        );
    }
    assert!(node.save(backend, "nat").contains(CLUSTER_IP), "the Service's rule");
    node.assert_served();

    // A mode switch removes iptables mode's chains from the same backend.
    node.start_daemon("nftables");
    wait_until(Duration::from_secs(10), "iptables mode's chains removed", || {
        !node.has_chain(backend, "nat", "KUBE-SERVICES")
    });
    assert!(!node.has_chain(backend, "filter", "KUBE-FORWARD"));
    node.assert_served();
    node.assert_kubelet_rules_kept();

    // Back to iptables mode, then `--cleanup`: nothing of ours in either backend.
    node.start_daemon("iptables");
    assert!(node.has_chain(backend, "nat", "KUBE-SERVICES"));
    node.daemon = None;
    let out = node
        .bed
        .node
        .exec(BIN, ["--cleanup"])
        .expect("kube-proxy --cleanup runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for b in [backend, node.other] {
        let rules = format!("{}{}", node.save(b, "nat"), node.save(b, "filter"));
        for ours in ["KUBE-SERVICES", "KUBE-FORWARD", "KUBE-PROXY-CANARY", "KUBE-POSTROUTING"] {
            assert!(!rules.contains(ours), "{ours} left in {b}:\n{rules}");
        }
    }
    node.assert_kubelet_rules_kept();
}

/// Rules of ours that an earlier run left in the backend not chosen (here: a DNAT of the
/// ClusterIP to an address where nothing answers) go once the daemon's own are in place, and
/// the Service is served; kubelet's chains stay.
fn stale_rules_in_the_backend_not_chosen_are_removed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut node = Node::new("legacy");
    let stale = "nft";
    node.iptables(stale, &["-w", "-t", "nat", "-N", "KUBE-SERVICES"]);
    node.iptables(stale, &["-w", "-t", "nat", "-N", "KUBE-SVC-STALESTALESTALE"]);
    node.iptables(
        stale,
        &[
            "-w", "-t", "nat", "-A", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j",
            "KUBE-SERVICES",
        ],
    );
    node.iptables(
        stale,
        &[
            "-w", "-t", "nat", "-A", "KUBE-SERVICES", "-d", CLUSTER_IP, "-p", "tcp", "--dport", "80", "-j",
            "KUBE-SVC-STALESTALESTALE",
        ],
    );
    node.iptables(
        stale,
        &[
            "-w", "-t", "nat", "-A", "KUBE-SVC-STALESTALESTALE", "-p", "tcp", "-j", "DNAT", "--to-destination",
            "10.99.99.99:80",
        ],
    );
    node.start_daemon("iptables");
    wait_until(Duration::from_secs(10), "our stale rules removed from nft", || {
        !node.has_chain(stale, "nat", "KUBE-SERVICES") && !node.has_chain(stale, "nat", "KUBE-SVC-STALESTALESTALE")
    });
    let nat = node.save(stale, "nat");
    assert!(!nat.contains("kubernetes service portals"), "the jump went too:\n{nat}");
    assert!(node.has_chain("legacy", "nat", "KUBE-SERVICES"), "ours are in legacy");
    assert!(
        node.log()
            .contains("Removed our rules from the iptables backend not chosen"),
        "{}",
        node.log()
    );
    node.assert_served();
    node.assert_kubelet_rules_kept();
}

fn main() -> std::process::ExitCode {
    use Requirement::*;
    const NEEDS: &[Requirement] = &[
        Root,
        Tool("ip"),
        Tool("iptables-legacy"),
        Tool("iptables-legacy-save"),
        Tool("iptables-legacy-restore"),
        Tool("iptables-nft"),
        Tool("iptables-nft-save"),
        Tool("iptables-nft-restore"),
    ];
    let mut tests: Vec<common::harness::Test> = ["legacy", "nft"]
        .map(|backend| {
            common::harness::test(
                format!("chooses_and_programs_{backend}_where_kubelet_uses_it"),
                move || chooses_and_programs_the_backend_kubelet_uses(backend),
            )
            .needs(NEEDS)
        })
        .into();
    tests.push(
        common::harness::test(
            "stale_rules_in_the_backend_not_chosen_are_removed",
            stale_rules_in_the_backend_not_chosen_are_removed,
        )
        .needs(NEEDS),
    );
    common::harness::run(tests)
}
