//! A test bed with the real daemon running in its node namespace on a manifest directory
//! (`--manifests`), in iptables or nftables mode: what the end-to-end and `explain` tests
//! start from.

use std::path::Path;
use std::time::Duration;

use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::probe::{ProbeArgs, ProbeReport};
use kube_proxy::lab::testbed::{CLUSTER_CIDRS, Testbed, TestbedSpec};

use super::ManifestDir;
use super::harness::{KernelFeature, Requirement, Requirement::*};

/// What a bed with the daemon in either mode needs, with the tools the tests read the rules
/// with.
pub const NEEDS: &[Requirement] = &[
    Root,
    Tool("ip"),
    Tool("ss"),
    Tool("sysctl"),
    Tool("iptables"),
    Tool("iptables-save"),
    Tool("iptables-restore"),
    Tool("nft"),
    Kernel(KernelFeature::Conntrack),
];

pub const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
/// How long a started daemon may take to its first sync: a deadline, long enough for
/// thousands of Services in a debug build on a loaded machine.
pub const FIRST_SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// The daemon's sync period in these beds (short, so that repairs are quick).
pub const SYNC_PERIOD_S: u64 = 2;

/// Whether the rules name endpoint `ep`: `IP:PORT` in a DNAT (iptables, and nftables endpoint
/// chains), `IP . PORT` in an element of nftables' `service-endpoints-…` maps.
pub fn names_endpoint(rules: &str, ep: std::net::SocketAddr) -> bool {
    rules.contains(&ep.to_string()) || rules.contains(&format!("{} . {}", ep.ip(), ep.port()))
}

/// Stops the running daemon in `daemon` with `signal` and waits (at most 5 s) for it to exit;
/// returns when it was signalled. (A field, not the cluster: its test bed stays borrowed by
/// the load's threads.)
pub fn stop_daemon(daemon: &mut Option<ChildGuard>, signal: nix::sys::signal::Signal) -> std::time::Instant {
    let mut old = daemon.take().expect("daemon running");
    let at = std::time::Instant::now();
    old.signal(signal).unwrap_or_else(|e| panic!("{signal}: {e}"));
    old.wait_timeout(Duration::from_secs(5))
        .expect("wait")
        .expect("daemon exited");
    at
}

/// Manifests with the `probed` Services (name, ClusterIP) on every endpoint of the bed and,
/// between them in the sync order, one-endpoint Services `fill-NNNNN` for each index of
/// `fillers` (ClusterIP 10.96.<10 + i / 250>.<1 + i % 250>: an index keeps its address
/// whatever the range, so two ranges make two states with Services in common).
pub fn with_fillers(b: &Testbed, probed: &[(&str, &str)], fillers: std::ops::Range<usize>) -> String {
    use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
    let eps: Vec<Ep> = b.endpoints().iter().map(|e| Ep::local(e.ip)).collect();
    let one = [Ep::local(b.endpoint(0).ip)];
    let fillers: Vec<(String, String)> = fillers
        .map(|i| (filler(i), format!("10.96.{}.{}", 10 + i / 250, 1 + i % 250)))
        .collect();
    let mut specs: Vec<ServiceSpec> = probed.iter().map(|(n, ip)| ServiceSpec::new(n, ip, &eps)).collect();
    specs.extend(fillers.iter().map(|(n, ip)| ServiceSpec::new(n, ip, &one)));
    manifests(&specs)
}

/// The name of filler Service `i` of [`with_fillers`].
pub fn filler(i: usize) -> String {
    format!("mmm-fill-{i:05}")
}

pub struct Cluster {
    pub bed: Testbed,
    pub dir: ManifestDir,
    /// Holds the daemon's `--config` file (nftables mode's sync periods have no flags upstream).
    pub config: ManifestDir,
    pub daemon: Option<ChildGuard>,
    pub mode: &'static str,
    /// YAML lines added to the configuration file (e.g. `nodePortAddresses: [...]`).
    pub config_extra: String,
    /// Flags added to the daemon's command line (e.g. `-v=2`).
    pub daemon_args: Vec<String>,
}

impl Cluster {
    pub fn start(tag: &str, endpoints: usize, manifests: impl Fn(&Testbed) -> String) -> Cluster {
        Cluster::start_in("iptables", tag, endpoints, manifests)
    }

    /// A bed with the daemon running in proxy mode `mode`.
    pub fn start_in(
        mode: &'static str,
        tag: &str,
        endpoints: usize,
        manifests: impl Fn(&Testbed) -> String,
    ) -> Cluster {
        let mut spec = TestbedSpec::new(format!("kpe-{tag}"), BIN);
        spec.endpoints = endpoints;
        let bed = Testbed::build(&spec).expect("test bed builds (root and iproute2 needed)");
        let dir = ManifestDir::new(&format!("kp-e2e-{mode}-{tag}"));
        dir.write(&manifests(&bed));
        let mut c = Cluster {
            bed,
            dir,
            config: ManifestDir::new(&format!("kp-e2e-{mode}-{tag}-config")),
            daemon: None,
            mode,
            config_extra: String::new(),
            daemon_args: Vec::new(),
        };
        c.start_daemon();
        c
    }

    /// Everything the kernel has: the iptables tables of both families (iptables mode) or
    /// the nft ruleset.
    pub fn rules(&self) -> String {
        if self.mode == "nftables" {
            self.bed
                .node
                .exec_ok("nft", ["list", "ruleset"])
                .expect("nft list ruleset")
        } else {
            format!("{}{}{}", self.nat(), self.filter(), self.ip6tables())
        }
    }

    /// Every ip6tables table, as `ip6tables-save` prints them.
    pub fn ip6tables(&self) -> String {
        self.bed
            .node
            .exec_ok("ip6tables-save", std::iter::empty::<&str>())
            .expect("ip6tables-save")
    }

    /// The configuration file of this bed's mode (written now): the mode, the cluster CIDR,
    /// short sync periods, and `config_extra`.
    pub fn config_flags(&self) -> Vec<String> {
        self.config_flags_for(self.mode)
    }

    /// [`Cluster::config_flags`] for another mode `mode` (its own file).
    pub fn config_flags_for(&self, mode: &str) -> Vec<String> {
        let path = self.config.0.join(format!("kube-proxy-{mode}.yaml"));
        let config = format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\nclusterCIDR: {CLUSTER_CIDRS}\n\
             iptables:\n  syncPeriod: {SYNC_PERIOD_S}s\n  minSyncPeriod: 0s\nnftables:\n  syncPeriod: {SYNC_PERIOD_S}s\n  \
             minSyncPeriod: 0s\n{}",
            self.config_extra
        );
        std::fs::write(&path, config).expect("write config");
        vec![
            "--hostname-override=node-a".into(),
            format!("--config={}", path.display()),
        ]
    }

    /// Starts the daemon and waits for its first sync.
    pub fn start_daemon(&mut self) {
        let daemon = self.spawn_synced_daemon();
        self.daemon = Some(daemon);
    }

    /// Starts the daemon in `self.mode` and waits for its first sync of every family.
    pub fn spawn_synced_daemon(&self) -> ChildGuard {
        self.spawn_synced_daemon_with(&[])
    }

    /// [`Cluster::spawn_synced_daemon`] with `env` settings (see [`Cluster::spawn_daemon`]).
    pub fn spawn_synced_daemon_with(&self, env: &[String]) -> ChildGuard {
        let daemon = self.spawn_daemon(env);
        // Each family syncs on its own: a test may start once all of them did.
        let families: &[&str] = if self.bed.has_ipv6() {
            &["IPv4", "IPv6"]
        } else {
            &["IPv4"]
        };
        for family in families {
            daemon
                .wait_for_log(
                    &format!("\"Synced rules\" mode=\"{}\" ipFamily=\"{family}\"", self.mode),
                    FIRST_SYNC_TIMEOUT,
                )
                .expect("first sync");
        }
        daemon
    }

    /// iptables mode's rules in nat, filter and mangle, as `iptables-save` lines, and in
    /// ip6tables (kubelet's KUBE-FIREWALL, which iptables mode also writes, is not removed on
    /// a switch).
    pub fn iptables_mode_rules(&self) -> Vec<String> {
        let mangle = self
            .bed
            .node
            .exec_ok("iptables-save", ["-t", "mangle"])
            .expect("iptables-save");
        format!("{}{}{mangle}{}", self.nat(), self.filter(), self.ip6tables())
            .lines()
            .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-FIREWALL"))
            .map(str::to_string)
            .collect()
    }

    /// Whether nftables mode's table is there.
    pub fn nftables_table(&self) -> bool {
        self.bed
            .node
            .exec_ok("nft", ["list", "tables"])
            .expect("nft list tables")
            .contains("kube-proxy")
    }

    /// Spawns the daemon on the manifest directory, with `env` settings (`NAME=VALUE`) first,
    /// once a daemon stopped before has let go of its metrics port.
    pub fn spawn_daemon(&self, env: &[String]) -> ChildGuard {
        let listening = || {
            self.bed
                .node
                .exec_ok("ss", ["-Hltnp", "sport = :10249"])
                .unwrap_or_default()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !listening().trim().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the daemon's ports are still taken:\n{}",
                listening()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut args: Vec<String> = env.to_vec();
        args.push(BIN.into());
        args.extend(["--manifests".to_string(), self.dir.0.display().to_string()]);
        args.extend(self.config_flags());
        args.extend(self.daemon_args.iter().cloned());
        self.bed.spawn_in_node(Path::new("env"), &args).expect("daemon starts")
    }

    /// `kube-proxy trace --live` in the node namespace and `kube-proxy trace` on the
    /// manifests (the render), with the daemon's configuration: they must agree on where a new
    /// connection from `from` to `to` goes (verdict, endpoints, masquerade).
    pub fn assert_live_trace_agrees(&self, from: std::net::IpAddr, to: std::net::SocketAddr, protocol: &str) {
        let trace = |source: &[String]| -> (String, Vec<String>, bool) {
            let mut args: Vec<String> = vec!["trace".into()];
            args.extend(source.iter().cloned());
            args.extend([
                format!("--from={from}"),
                format!("--to={to}"),
                format!("--protocol={protocol}"),
                "--output=json".into(),
            ]);
            args.extend(self.config_flags());
            let out = self.bed.node.exec(BIN, &args).expect("trace runs");
            assert!(
                out.status.success(),
                "trace {source:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            trace_outcome(&out.stdout)
        };
        let live = trace(&["--live".to_string()]);
        let rendered = trace(&[self.dir.0.display().to_string()]);
        assert_eq!(
            live, rendered,
            "{protocol} {from} -> {to}: trace --live (left) and trace (right)"
        );
        println!("trace --live agrees with trace for {protocol} {from} -> {to}: {live:?}");
    }

    pub fn nat(&self) -> String {
        self.bed
            .node
            .exec_ok("iptables-save", ["-t", "nat"])
            .expect("iptables-save")
    }

    pub fn filter(&self) -> String {
        self.bed
            .node
            .exec_ok("iptables-save", ["-t", "filter"])
            .expect("iptables-save")
    }

    pub fn probe_client(&self, args: &ProbeArgs) -> ProbeReport {
        self.bed.probe(&self.bed.client, args).expect("probe runs")
    }

    pub fn daemon_log(&self) -> String {
        self.daemon.as_ref().map(ChildGuard::log).unwrap_or_default()
    }
}

/// Where `kube-proxy trace --output=json` says a new connection goes: its verdict, its
/// endpoints (sorted) and whether it is masqueraded.
pub fn trace_outcome(json: &[u8]) -> (String, Vec<String>, bool) {
    let v: serde_json::Value = serde_json::from_slice(json).expect("trace prints JSON");
    let mut endpoints: Vec<String> = v["endpoints"]
        .as_array()
        .map(|a| a.iter().filter_map(|e| e.as_str()).map(str::to_string).collect())
        .unwrap_or_default();
    endpoints.sort();
    (
        v["verdict"].as_str().unwrap_or_default().to_string(),
        endpoints,
        v["masquerade"] == true,
    )
}
