//! End-to-end in IPVS mode on a real IPVS kernel: the test VM (`vm/run`), since this machine's
//! own kernel has none. Needs root, qemu and Debian's kernel (see .ci/run); without them it is
//! reported as ignored, with what is missing.
//!
//! One VM boot for the whole file: on the host, [`ipvs_e2e_in_vm`] re-runs this test binary in
//! the VM (`--exact ipvs_e2e_in_vm` with `KUBE_PROXY_IN_VM=1`), where the same test builds the
//! namespace test bed of `tests/e2e.rs` (`kube_proxy::lab::testbed`), starts the real daemon in
//! its node namespace with `--proxy-mode=ipvs --manifests`, and sends real traffic:
//! - `/proxyMode` and the log say `ipvs` (with upstream's "Using ipvs Proxier" and its deprecation
//!   error line); the IPVS sysctls, strict ARP and the configured
//!   timeouts are set in the node's namespace, and not in the guest's own;
//! - rr: a ClusterIP's connections go round the endpoints in turn, exactly (and pass the
//!   chi-square test of the iptables suite);
//! - NodePort from the outside host (masqueraded), externalTrafficPolicy Local (client address
//!   kept, local endpoints only), loadBalancerSourceRanges (allowed source in, other dropped),
//!   sessionAffinity ClientIP (one endpoint for every connection);
//! - NodePorts follow the node's interface addresses: a second address on the node's
//!   outside-facing link, which the Node object does not list, gets the NodePort's virtual
//!   server at the next sync and answers; removed, its virtual server goes;
//! - hairpin: an endpoint reaching its own Service through it is masqueraded;
//! - a Service without endpoints: the kernel answers ICMP port unreachable itself (IPVS has a
//!   virtual server without real servers), so a client sees "connection refused" at once;
//! - graceful termination: an endpoint removed while a TCP connection to it is open keeps that
//!   connection (weight 0, no new connections), and its real server goes once the connection
//!   has closed;
//! - a scheduler whose module is missing: the daemon refuses to start, naming it;
//! - switching to iptables mode removes the virtual servers, `kube-ipvs0`, the ipsets and IPVS
//!   mode's chains once iptables mode is programmed (a virtual server with a live flow once
//!   that has expired), and back to IPVS mode removes iptables mode's chains (the switch under
//!   load is `tests/vm_switch_e2e.rs`);
//! - UDP: a flow whose endpoint is removed moves to the live one (no draining for UDP);
//! - a NodePort Service deleted while the daemon is down: the first sync after the restart
//!   deletes its virtual servers on the node addresses, and leaves someone else's virtual
//!   server in the NodePort range (direct routing) alone;
//! - sh (`--ipvs-scheduler=sh`, the daemon restarted): every client address sticks to one
//!   endpoint;
//! - `--cleanup` removes the virtual servers, `kube-ipvs0` and the ipsets;
//! - all along, someone else's virtual server on the node's address stays as it was;
//! - `trace --proxy-mode=ipvs` over the daemon's manifests agrees with where the traffic of
//!   the NodePort, zero-endpoint and source-range checks went (verdict, endpoints, masquerade).

mod common;
#[path = "support/vm.rs"]
mod vm;

use std::time::Duration;

/// Printed by the in-VM run when every check passed, so that the host knows the checks ran.
const ALL_PASSED: &str = "vm-ipvs-e2e: all checks passed";

fn ipvs_e2e_in_vm() {
    vm::checks_in_vm("ipvs_e2e_in_vm", ALL_PASSED, Duration::from_secs(600), in_vm::run);
}

mod in_vm {
    use std::collections::BTreeMap;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{IpAddr, SocketAddr, TcpStream};
    use std::path::Path;
    use std::time::{Duration, Instant};

    use kube_proxy::lab::netns::ChildGuard;
    use kube_proxy::lab::probe::{ProbeArgs, ProbeReport};
    use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
    use kube_proxy::lab::testbed::{Testbed, TestbedSpec};

    use crate::common::netns::in_netns;
    use crate::common::{ManifestDir, wait_until_every};

    const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
    const WEB: &str = "10.96.165.10";
    const EMPTY: &str = "10.96.165.11";
    const STICKY: &str = "10.96.165.12";
    const LB_CIP: &str = "10.96.165.13";
    const LB_IP: &str = "203.0.113.10";
    const LOCAL: &str = "10.96.165.14";
    const DRAIN: &str = "10.96.165.15";
    const DNS: &str = "10.96.165.16";
    const WEB_NODE_PORT: u16 = 32517;
    /// A virtual server that is not ours.
    const FOREIGN: &str = "192.168.49.2:443";
    const LB_NODE_PORT: u16 = 32518;
    const LOCAL_NODE_PORT: u16 = 32519;

    fn sa(ip: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip.parse().expect("test address"), port)
    }

    /// How often the checks poll for a change (under TCG every command costs).
    const POLL: Duration = Duration::from_millis(50);

    /// The test bed's Services; `drain` lists the endpoints of the graceful-termination one.
    fn services(bed: &Testbed, drain: &[Ep]) -> String {
        services_with_udp(bed, drain, &[Ep::local(bed.endpoint(0).ip)])
    }

    /// The Services, with the UDP one's endpoints given too.
    fn services_with_udp(bed: &Testbed, drain: &[Ep], udp: &[Ep]) -> String {
        services_but(bed, drain, udp, "")
    }

    /// The Services but the one named `skip`.
    fn services_but(bed: &Testbed, drain: &[Ep], udp: &[Ep], skip: &str) -> String {
        let all: Vec<Ep> = bed.endpoints().iter().map(|e| Ep::local(e.ip)).collect();
        let first = [Ep::local(bed.endpoint(0).ip)];
        let mut web = ServiceSpec::new("web", WEB, &all);
        web.node_port = Some(WEB_NODE_PORT);
        let empty = ServiceSpec::new("empty", EMPTY, &[]);
        let mut sticky = ServiceSpec::new("sticky", STICKY, &all);
        sticky.spec_extra = "  sessionAffinity: ClientIP\n";
        let mut lb = ServiceSpec::new("lb", LB_CIP, &first);
        lb.node_port = Some(LB_NODE_PORT);
        lb.load_balancer_ip = Some(LB_IP);
        lb.spec_extra = "  loadBalancerSourceRanges: [\"192.168.49.77/32\"]\n";
        let mixed = [
            Ep::local(bed.endpoint(0).ip),
            Ep {
                ip: bed.endpoint(1).ip,
                node: "node-b",
            },
        ];
        let mut local = ServiceSpec::new("local", LOCAL, &mixed);
        local.node_port = Some(LOCAL_NODE_PORT);
        local.spec_extra = "  externalTrafficPolicy: Local\n";
        let drain = ServiceSpec::new("drain", DRAIN, drain);
        let mut dns = ServiceSpec::new("dns", DNS, udp);
        dns.protocol = "UDP";
        let all = [web, empty, sticky, lb, local, drain, dns];
        let kept: Vec<ServiceSpec<'_>> = all.into_iter().filter(|s| s.name != skip).collect();
        manifests(&kept)
    }

    struct Node {
        bed: Testbed,
        dir: ManifestDir,
        daemon: Option<ChildGuard>,
    }

    impl Node {
        /// The daemon's arguments in `mode` (ipvs or iptables), with 2 s sync periods.
        fn args(&self, mode: &str) -> Vec<String> {
            vec![
                format!("--proxy-mode={mode}"),
                "--hostname-override=node-a".into(),
                "--cluster-cidr=10.244.0.0/16".into(),
                format!("--{mode}-min-sync-period=0s"),
                format!("--{mode}-sync-period=2s"),
                "--manifests".into(),
                self.dir.0.display().to_string(),
            ]
        }

        fn start_daemon(&mut self, extra: &[&str]) {
            self.start_daemon_in("ipvs", extra);
        }

        fn start_daemon_in(&mut self, mode: &str, extra: &[&str]) {
            drop(self.daemon.take());
            let mut args = self.args(mode);
            args.extend(extra.iter().map(|s| s.to_string()));
            let started = Instant::now();
            let daemon = self.bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
            daemon
                .wait_for_log("Synced rules", Duration::from_secs(60))
                .expect("first sync");
            println!("daemon {mode} {extra:?}: first sync after {:?}", started.elapsed());
            self.daemon = Some(daemon);
        }

        fn log(&self) -> String {
            self.daemon.as_ref().map(ChildGuard::log).unwrap_or_default()
        }

        fn ipvsadm(&self, args: &[&str]) -> String {
            self.bed.node.exec_ok("ipvsadm", args).expect("ipvsadm")
        }

        /// The real servers of a TCP virtual server: address → (weight, active, inactive).
        fn real_servers(&self, vip: SocketAddr) -> BTreeMap<SocketAddr, (u32, u32, u32)> {
            let out = self.ipvsadm(&["-Ln", "-t", &vip.to_string()]);
            out.lines()
                .filter_map(|l| l.trim().strip_prefix("-> "))
                .filter_map(|l| {
                    let w: Vec<&str> = l.split_whitespace().collect();
                    let addr = w.first()?.parse().ok()?;
                    Some((
                        addr,
                        (
                            w.get(2)?.parse().ok()?,
                            w.get(3)?.parse().ok()?,
                            w.get(4)?.parse().ok()?,
                        ),
                    ))
                })
                .collect()
        }

        fn probe(&self, from: &kube_proxy::lab::netns::Netns, args: &ProbeArgs) -> ProbeReport {
            self.bed.probe(from, args).expect("probe runs")
        }

        /// What `kube-proxy trace --proxy-mode=ipvs` says of a new connection over the
        /// daemon's manifests (pure: run outside the test bed).
        fn trace(&self, from: IpAddr, to: SocketAddr) -> Traced {
            trace_manifests(&self.dir.0, from, to)
        }
    }

    /// A trace's verdict, endpoints (sorted as strings) and masquerade.
    #[derive(Debug, PartialEq)]
    struct Traced {
        verdict: String,
        endpoints: Vec<String>,
        masquerade: bool,
    }

    impl Traced {
        fn new(verdict: &str, endpoints: &[IpAddr], masquerade: bool) -> Traced {
            let mut endpoints: Vec<String> = endpoints.iter().map(|ip| format!("{ip}:8080")).collect();
            endpoints.sort();
            Traced {
                verdict: verdict.to_string(),
                endpoints,
                masquerade,
            }
        }
    }

    fn trace_manifests(dir: &Path, from: IpAddr, to: SocketAddr) -> Traced {
        let out = std::process::Command::new(BIN)
            .args([
                "trace", "--proxy-mode=ipvs", "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16",
            ])
            .arg(dir)
            .arg(format!("--from={from}"))
            .arg(format!("--to={to}"))
            .arg("--output=json")
            .output()
            .expect("kube-proxy trace runs");
        assert!(out.status.success(), "trace: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("trace prints JSON");
        Traced {
            verdict: v["verdict"].as_str().unwrap_or_default().to_string(),
            endpoints: v["endpoints"]
                .as_array()
                .map(|a| a.iter().filter_map(|e| e.as_str()).map(str::to_string).collect())
                .unwrap_or_default(),
            masquerade: v["masquerade"] == true,
        }
    }

    pub fn run() {
        let started = Instant::now();
        let mut spec = TestbedSpec::new("kpv", BIN);
        spec.endpoints = 3;
        let bed = Testbed::build(&spec).expect("test bed builds");
        println!("test bed built in {:?}", started.elapsed());
        let dir = ManifestDir::new("kp-vm-ipvs");
        dir.write(&services(&bed, &[Ep::local(bed.endpoint(0).ip)]));
        let mut node = Node { bed, dir, daemon: None };
        // Each step's time is printed: under TCG the budget is tight.
        let step = |name: &str, f: &mut dyn FnMut()| {
            let t = Instant::now();
            f();
            println!("step {name}: {:?}", t.elapsed());
        };
        step("refusal", &mut || refuses_a_missing_scheduler(&node));
        // Someone else's virtual server on the node address: no mode, no sync, no cleanup
        // may touch it.
        node.ipvsadm(&["-A", "-t", FOREIGN, "-s", "wlc"]);
        node.ipvsadm(&["-a", "-t", FOREIGN, "-r", "10.244.1.2:8080", "-m"]);
        step("daemon (rr)", &mut || {
            node.start_daemon(&["--ipvs-tcp-timeout=600s", "--ipvs-udp-timeout=30s", "--ipvs-strict-arp"])
        });
        step("mode", &mut || mode_is_ipvs(&node));
        step("sysctls and timeouts", &mut || sysctls_and_timeouts(&node));
        step("rr", &mut || round_robin(&node));
        step("NodePort", &mut || node_port_and_local_policy(&node));
        step("NodePort on a new address", &mut || node_port_follows_addresses(&node));
        step("zero endpoints", &mut || zero_endpoints(&node));
        step("hairpin", &mut || hairpin(&node));
        step("affinity", &mut || session_affinity(&node));
        step("source ranges", &mut || source_ranges(&node));
        step("graceful termination", &mut || graceful_termination(&node));
        step("UDP", &mut || udp_moves_on(&node));
        step("Service deleted while down", &mut || deleted_while_down(&mut node));
        step("switch to iptables", &mut || {
            node.start_daemon_in("iptables", &[]);
            iptables_mode_removed_ipvs_state(&node);
        });
        step("switch back (sh)", &mut || {
            node.start_daemon(&["--ipvs-scheduler=sh"]);
            ipvs_mode_removed_iptables_chains(&node);
        });
        step("sh", &mut || source_hashing(&node));
        step("cleanup", &mut || cleanup(&mut node));
        println!("in-VM total {:?}", started.elapsed());
    }

    /// No silent fallback on a kernel with IPVS either: a scheduler whose module is missing.
    /// The guest's root is an in-memory overlay, so hiding the module file there (from
    /// `modprobe` and from the kernel's own module requests) changes nothing on the host.
    fn refuses_a_missing_scheduler(node: &Node) {
        let hide =
            "for f in $(find /lib/modules/$(uname -r) -name 'ip_vs_lblcr.ko*'); do mv \"$f\" \"$f.hidden\"; done";
        let out = std::process::Command::new("sh")
            .args(["-c", hide])
            .output()
            .expect("sh");
        assert!(out.status.success(), "{out:?}");
        assert!(!Path::new("/sys/module/ip_vs_lblcr").exists(), "lblcr is not loaded");
        let mut args = node.args("ipvs");
        args.push("--ipvs-scheduler=lblcr".into());
        let out = node.bed.node.exec(BIN, &args).expect("the daemon runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "must refuse: {stderr}");
        assert!(
            stderr.contains("kernel module ip_vs_lblcr") && stderr.contains("modprobe ip_vs_lblcr`"),
            "{:?}, stdout {:?}, stderr {stderr}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(!node.ipvsadm(&["-Ln"]).contains("TCP "), "nothing programmed");
        let unhide = "for f in $(find /lib/modules/$(uname -r) -name 'ip_vs_lblcr.ko*.hidden'); do mv \"$f\" \"${f%.hidden}\"; done";
        let out = std::process::Command::new("sh")
            .args(["-c", unhide])
            .output()
            .expect("sh");
        assert!(out.status.success(), "{out:?}");
    }

    /// Switching to iptables mode removes IPVS mode's state once iptables mode is programmed;
    /// the Services keep working. A virtual server that still carries a flow (the UDP check's,
    /// until IPVS's 30 s UDP timeout expires it) goes only then, with its address.
    fn iptables_mode_removed_ipvs_state(node: &Node) {
        let started = Instant::now();
        wait_until_every(
            Duration::from_millis(500),
            Duration::from_secs(90),
            "IPVS mode's virtual servers and kube-ipvs0 gone",
            || {
                let links = node.bed.node.ip(["-o", "link", "show"]).expect("ip link");
                virtual_servers(&node.ipvsadm(&["-Ln"])) == [format!("TCP {FOREIGN} wlc")]
                    && !links.contains("kube-ipvs0")
            },
        );
        println!(
            "to iptables: IPVS mode's state gone {:?} after the first sync",
            started.elapsed()
        );
        for l in node.log().lines().filter(|l| l.contains("proxy mode")) {
            println!("  daemon: {l}");
        }
        let list = node.ipvsadm(&["-Ln"]);
        assert_eq!(
            virtual_servers(&list),
            vec![format!("TCP {FOREIGN} wlc")],
            "only someone else's virtual server left:\n{list}"
        );
        let links = node.bed.node.ip(["-o", "link", "show"]).expect("ip link");
        assert!(!links.contains("kube-ipvs0"), "{links}");
        let sets = node.bed.node.exec_ok("ipset", ["list", "-n"]).expect("ipset");
        assert!(!sets.contains("KUBE-"), "{sets}");
        let filter = node
            .bed
            .node
            .exec_ok("iptables-save", ["-t", "filter"])
            .expect("iptables-save");
        assert!(!filter.contains("KUBE-IPVS-FILTER"), "{filter}");
        let nat = node
            .bed
            .node
            .exec_ok("iptables-save", ["-t", "nat"])
            .expect("iptables-save");
        assert!(
            !nat.contains(":KUBE-NODE-PORT ") && nat.contains(":KUBE-NODEPORTS "),
            "{nat}"
        );
        let r = node.probe(&node.bed.client, &ProbeArgs::tcp(sa(WEB, 80)).with_count(3));
        assert!(r.all_ok(), "iptables mode serves: {:?}", r.errors());
    }

    /// And back: IPVS mode removes iptables mode's own chains, once it is programmed.
    fn ipvs_mode_removed_iptables_chains(node: &Node) {
        wait_until_every(POLL, Duration::from_secs(30), "iptables mode's chains gone", || {
            let nat = node
                .bed
                .node
                .exec_ok("iptables-save", ["-t", "nat"])
                .expect("iptables-save");
            !nat.contains(":KUBE-NODEPORTS ")
        });
        let nat = node
            .bed
            .node
            .exec_ok("iptables-save", ["-t", "nat"])
            .expect("iptables-save");
        assert!(
            !nat.contains(":KUBE-NODEPORTS ") && !nat.contains(":KUBE-SVC-") && !nat.contains(":KUBE-SEP-"),
            "{nat}"
        );
        assert!(nat.contains(":KUBE-NODE-PORT "), "{nat}");
    }

    /// The IPVS sysctls and the configured timeouts, in the node's namespace only.
    fn sysctls_and_timeouts(node: &Node) {
        for (key, want) in [
            ("net.ipv4.vs.conntrack", "1"),
            ("net.ipv4.vs.expire_nodest_conn", "1"),
            ("net.ipv4.vs.expire_quiescent_template", "1"),
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.arp_ignore", "1"),
            ("net.ipv4.conf.all.arp_announce", "2"),
        ] {
            assert_eq!(
                node.bed.node.read_sysctl(key).expect("sysctl"),
                want,
                "{key} in the node"
            );
        }
        // This process runs in the guest's root namespace: untouched.
        for path in ["net/ipv4/vs/conntrack", "net/ipv4/conf/all/arp_ignore"] {
            let v = std::fs::read_to_string(Path::new("/proc/sys").join(path)).expect("sysctl");
            assert_eq!(v.trim(), "0", "{path} in the root namespace");
        }
        // Only the configured timeouts change (tcpfin keeps the kernel's 120 s).
        let t = node.ipvsadm(&["-Ln", "--timeout"]);
        assert!(t.contains("Timeout (tcp tcpfin udp): 600 120 30"), "{t}");
    }

    /// The virtual-server lines of `ipvsadm -Ln`, blanks squeezed.
    fn virtual_servers(list: &str) -> Vec<String> {
        list.lines()
            .filter(|l| l.starts_with("TCP") || l.starts_with("UDP") || l.starts_with("SCTP"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect()
    }

    fn mode_is_ipvs(node: &Node) {
        let log = node.log();
        assert!(
            log.lines()
                .any(|l| l.contains("Starting kube-proxy") && l.contains("ipvs")),
            "{log}"
        );
        // Upstream's lines, word for word and at their levels.
        for (level, line) in [
            ('I', "] \"Using ipvs Proxier\""),
            (
                'E',
                "] \"The ipvs proxier is now deprecated and may be removed in a future release. Please use 'nftables' instead.\"",
            ),
        ] {
            assert!(
                log.lines().any(|l| l.starts_with(level) && l.ends_with(line)),
                "{line}: {log}"
            );
        }
        let body = in_netns(node.bed.node.name(), || {
            let mut s = TcpStream::connect("127.0.0.1:10249").expect("metrics server");
            s.write_all(b"GET /proxyMode HTTP/1.0\r\nHost: localhost\r\n\r\n")
                .expect("request");
            let mut out = String::new();
            s.read_to_string(&mut out).expect("response");
            out
        });
        assert!(body.starts_with("HTTP/1.") && body.contains(" 200 "), "{body}");
        assert_eq!(body.split("\r\n\r\n").nth(1).map(str::trim), Some("ipvs"), "{body}");
        let list = node.ipvsadm(&["-Ln"]);
        assert!(list.contains(&format!("TCP  {WEB}:80 rr")), "{list}");
        let foreign = node.ipvsadm(&["-Ln", "-t", FOREIGN]);
        assert!(
            foreign.contains("wlc") && foreign.contains("10.244.1.2:8080"),
            "not ours, kept: {foreign}"
        );
        let links = node
            .bed
            .node
            .ip(["-o", "addr", "show", "dev", "kube-ipvs0"])
            .expect("ip addr");
        for vip in [WEB, EMPTY, STICKY, LB_CIP, LB_IP, LOCAL, DRAIN] {
            assert!(
                links.contains(&format!("inet {vip}/32")),
                "{vip} on kube-ipvs0:\n{links}"
            );
        }
    }

    fn round_robin(node: &Node) {
        let n = 300;
        let report = node.probe(&node.bed.client, &ProbeArgs::tcp(sa(WEB, 80)).with_count(n));
        assert_eq!(report.ok_count(), n as usize, "{:?}", report.errors());
        let names: Vec<&str> = report.attempts.iter().filter_map(|a| a.name.as_deref()).collect();
        // rr: the same cycle of the three endpoints, over and over.
        assert!(
            names.iter().enumerate().all(|(i, name)| *name == names[i % 3]),
            "round robin: {:?}",
            &names[..12.min(names.len())]
        );
        let counts = report.names();
        assert_eq!(counts.len(), 3, "{counts:?}");
        assert!(counts.values().all(|&c| c == 100), "{counts:?}");
        // The iptables suite's chi-square test of a uniform split (2 degrees of freedom,
        // p = 0.001 → 13.816) holds trivially for an exact split; kept as the common bound.
        let chi2: f64 = counts.values().map(|&c| (c as f64 - 100.0).powi(2) / 100.0).sum();
        assert!(chi2 < 13.816, "χ² = {chi2}");
        // In-cluster clients are not masqueraded.
        assert_eq!(
            report.seen_sources().into_iter().collect::<Vec<_>>(),
            vec![node.bed.client_ip()]
        );
        println!("rr: 300 connections {counts:?}");
    }

    fn node_port_and_local_policy(node: &Node) {
        let bed = &node.bed;
        let outside = bed.outside_ips()[0];
        let r = node.probe(
            &bed.outside,
            &ProbeArgs::tcp(SocketAddr::new(bed.node_ip(), WEB_NODE_PORT))
                .with_bind(outside)
                .with_count(6),
        );
        assert!(r.all_ok(), "NodePort from outside: {:?}", r.errors());
        assert_eq!(r.names().len(), 3, "{:?}", r.names());
        let seen = r.seen_sources();
        assert!(
            !seen.contains(&outside) && seen.iter().all(|s| s.to_string().starts_with("10.244.")),
            "masqueraded to a node address: {seen:?}"
        );
        let all: Vec<IpAddr> = bed.endpoints().iter().map(|e| e.ip).collect();
        assert_eq!(
            node.trace(outside, SocketAddr::new(bed.node_ip(), WEB_NODE_PORT)),
            Traced::new("DNAT", &all, true),
            "trace agrees: every endpoint, masqueraded"
        );
        // Local policy: only the local endpoint, and the client's own address.
        let r = node.probe(
            &bed.outside,
            &ProbeArgs::tcp(SocketAddr::new(bed.node_ip(), LOCAL_NODE_PORT))
                .with_bind(outside)
                .with_count(6),
        );
        assert!(r.all_ok(), "{:?}", r.errors());
        assert_eq!(
            r.names(),
            BTreeMap::from([(bed.endpoint(0).name.clone(), 6)]),
            "local endpoint only"
        );
        assert_eq!(r.seen_sources().into_iter().collect::<Vec<_>>(), vec![outside]);
        assert_eq!(
            node.trace(outside, SocketAddr::new(bed.node_ip(), LOCAL_NODE_PORT)),
            Traced::new("DNAT", &[bed.endpoint(0).ip], false),
            "trace agrees: the local endpoint, not masqueraded"
        );
        println!("NodePort: cluster policy masqueraded, Local policy keeps {outside}");
    }

    /// The virtual-server lines of `ipvsadm -Ln` for TCP `port`, on any address.
    fn on_port(node: &Node, port: u16) -> Vec<String> {
        let suffix = format!(":{port} ");
        virtual_servers(&node.ipvsadm(&["-Ln"]))
            .into_iter()
            .filter(|l| l.contains(&suffix))
            .collect()
    }

    /// A second address on the node's outside-facing link, not in the Node object: the next
    /// periodic sync puts the NodePort there; removed, the next one takes it away.
    fn node_port_follows_addresses(node: &Node) {
        let bed = &node.bed;
        let second = sa("192.168.49.3", WEB_NODE_PORT);
        let line = format!("TCP {second} rr");
        assert!(!on_port(node, WEB_NODE_PORT).contains(&line));
        bed.node
            .ip(["addr", "add", "192.168.49.3/24", "dev", "eth0"])
            .expect("add the address");
        let added = wait_until_every(POLL, Duration::from_secs(15), "a NodePort on the new address", || {
            on_port(node, WEB_NODE_PORT).contains(&line)
        });
        let outside = bed.outside_ips()[0];
        let r = node.probe(&bed.outside, &ProbeArgs::tcp(second).with_bind(outside).with_count(6));
        assert!(r.all_ok(), "NodePort on the new address: {:?}", r.errors());
        assert_eq!(r.names().len(), 3, "{:?}", r.names());
        bed.node
            .ip(["addr", "del", "192.168.49.3/24", "dev", "eth0"])
            .expect("delete the address");
        let removed = wait_until_every(
            POLL,
            Duration::from_secs(15),
            "the NodePort gone from the old address",
            || !on_port(node, WEB_NODE_PORT).contains(&line),
        );
        let r = node.probe(
            &bed.outside,
            &ProbeArgs::tcp(second)
                .with_bind(outside)
                .with_count(2)
                .with_timeout_ms(700),
        );
        assert_eq!(r.ok_count(), 0, "no answer there any more: {:?}", r.attempts);
        assert!(
            on_port(node, WEB_NODE_PORT).contains(&format!("TCP {} rr", sa("192.168.49.2", WEB_NODE_PORT))),
            "the Node's own address keeps it"
        );
        println!("NodePort on a new address: added after {added:?}, removed after {removed:?}");
    }

    /// The lb Service (NodePort 32518, never connected to through it) is deleted while the
    /// daemon is down: the first sync after the restart deletes its NodePort virtual servers,
    /// which are on no address of kube-ipvs0, and leaves someone else's in the NodePort range.
    fn deleted_while_down(node: &mut Node) {
        const THEIRS: &str = "192.168.49.2:32000";
        node.ipvsadm(&["-A", "-t", THEIRS, "-s", "wlc"]);
        node.ipvsadm(&["-a", "-t", THEIRS, "-r", "10.244.1.2", "-g"]);
        let before = on_port(node, LB_NODE_PORT);
        assert!(
            before.contains(&format!("TCP {} rr", sa("192.168.49.2", LB_NODE_PORT))),
            "{before:?}"
        );
        drop(node.daemon.take());
        let bed = &node.bed;
        let (new, udp) = ([Ep::local(bed.endpoint(1).ip)], [Ep::local(bed.endpoint(1).ip)]);
        node.dir.write(&services_but(bed, &new, &udp, "lb"));
        assert_eq!(
            on_port(node, LB_NODE_PORT),
            before,
            "nothing changes while the daemon is down"
        );
        node.start_daemon(&[]);
        wait_until_every(
            POLL,
            Duration::from_secs(10),
            "the NodePort virtual servers of lb gone",
            || on_port(node, LB_NODE_PORT).is_empty(),
        );
        let theirs = node.ipvsadm(&["-Ln", "-t", THEIRS]);
        assert!(
            theirs.contains("wlc") && theirs.contains("10.244.1.2:32000") && theirs.contains("Route"),
            "not ours, kept: {theirs}"
        );
        let foreign = node.ipvsadm(&["-Ln", "-t", FOREIGN]);
        assert!(foreign.contains("10.244.1.2:8080"), "{foreign}");
        assert!(
            !on_port(node, WEB_NODE_PORT).is_empty(),
            "the other NodePorts stay: {}",
            node.ipvsadm(&["-Ln"])
        );
        node.ipvsadm(&["-D", "-t", THEIRS]);
        println!("deleted while down: {} NodePort virtual servers removed", before.len());
    }

    fn zero_endpoints(node: &Node) {
        let r = node.probe(
            &node.bed.client,
            &ProbeArgs::tcp(sa(EMPTY, 80)).with_count(5).with_timeout_ms(2000),
        );
        println!("zero endpoints: {:?}", r.attempts);
        for a in &r.attempts {
            assert_eq!(
                a.error.as_deref(),
                Some("refused"),
                "ICMP port unreachable from IPVS: {a:?}"
            );
            assert!(a.elapsed_us < 500_000, "at once: {a:?}");
        }
        assert_eq!(
            node.trace(node.bed.client_ip(), sa(EMPTY, 80)),
            Traced::new("REJECT", &[], false),
            "trace agrees: refused by IPVS itself"
        );
    }

    /// An endpoint reaching its own Service lands on itself masqueraded (KUBE-LOOP-BACK), or
    /// its own reply would bypass IPVS.
    fn hairpin(node: &Node) {
        let me = node.bed.endpoint(0);
        let r = node.probe(&me.ns, &ProbeArgs::tcp(sa(WEB, 80)).with_count(6));
        assert_eq!(r.ok_count(), 6, "{:?}", r.errors());
        let to_self: Vec<_> = r
            .attempts
            .iter()
            .filter(|a| a.name.as_deref() == Some(me.name.as_str()))
            .collect();
        assert_eq!(to_self.len(), 2, "rr lands on itself every third time: {:?}", r.names());
        for a in to_self {
            assert_ne!(a.seen_src, Some(me.ip), "hairpin traffic is masqueraded: {a:?}");
        }
    }

    fn session_affinity(node: &Node) {
        let r = node.probe(&node.bed.client, &ProbeArgs::tcp(sa(STICKY, 80)).with_count(30));
        assert_eq!(r.ok_count(), 30, "{:?}", r.errors());
        assert_eq!(r.names().len(), 1, "one endpoint for all: {:?}", r.names());
        let list = node.ipvsadm(&["-Ln", "-t", &format!("{STICKY}:80")]);
        assert!(list.contains("persistent 10800"), "{list}");
    }

    fn source_ranges(node: &Node) {
        let bed = &node.bed;
        let [allowed, other] = bed.outside_ips();
        let lb = sa(LB_IP, 80);
        let ok = node.probe(&bed.outside, &ProbeArgs::tcp(lb).with_bind(allowed).with_count(3));
        assert!(ok.all_ok(), "allowed source: {:?}", ok.errors());
        let denied = node.probe(
            &bed.outside,
            &ProbeArgs::tcp(lb).with_bind(other).with_count(2).with_timeout_ms(700),
        );
        assert_eq!(
            denied.errors(),
            BTreeMap::from([("timeout".to_string(), 2)]),
            "other source dropped"
        );
        assert_eq!(
            node.trace(allowed, lb),
            Traced::new("DNAT", &[bed.endpoint(0).ip], true),
            "trace agrees: allowed"
        );
        assert_eq!(
            node.trace(other, lb),
            Traced::new("DROP", &[], false),
            "trace agrees: dropped"
        );
    }

    fn graceful_termination(node: &Node) {
        let bed = &node.bed;
        let vip = sa(DRAIN, 80);
        let (old, new) = (bed.endpoint(0), bed.endpoint(1));
        // A connection to the only endpoint, held open.
        let stream = in_netns(bed.client.name(), || {
            TcpStream::connect_timeout(&vip, Duration::from_secs(3))
        })
        .expect("connect to the drain Service");
        stream.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut line = String::new();
        reader.read_line(&mut line).expect("greeting");
        assert!(line.starts_with(&format!("{} ", old.name)), "{line}");
        let mut echo = |text: &str| {
            (&stream).write_all(format!("{text}\n").as_bytes()).expect("write");
            let mut back = String::new();
            reader.read_line(&mut back).expect("echo");
            assert_eq!(back.trim_end(), text);
        };
        echo("before");

        node.dir.write(&services(bed, &[Ep::local(new.ip)]));
        let changed = Instant::now();
        let old_rs = old.server_addr();
        wait_until_every(POLL, Duration::from_secs(15), "the old real server at weight 0", || {
            let rs = node.real_servers(vip);
            rs.get(&old_rs).is_some_and(|r| r.0 == 0) && rs.contains_key(&new.server_addr())
        });
        let rs = node.real_servers(vip);
        assert_eq!(rs[&old_rs].1, 1, "one active connection: {rs:?}");
        // New connections go to the new endpoint only; the open one still works.
        let r = node.probe(&bed.client, &ProbeArgs::tcp(vip).with_count(5));
        assert_eq!(r.names(), BTreeMap::from([(new.name.clone(), 5)]), "{:?}", r.errors());
        echo("while draining");
        assert!(node.real_servers(vip).contains_key(&old_rs), "kept while connected");

        // A reset leaves the kernel's entry in CLOSE for 10 s (a FIN would leave TIME_WAIT
        // for 2 min); the real server goes once no connection is counted.
        nix::sys::socket::setsockopt(
            &stream,
            nix::sys::socket::sockopt::Linger,
            &nix::libc::linger {
                l_onoff: 1,
                l_linger: 0,
            },
        )
        .expect("SO_LINGER");
        drop(reader);
        drop(stream);
        let closed = Instant::now();
        wait_until_every(POLL, Duration::from_secs(45), "the drained real server deleted", || {
            !node.real_servers(vip).contains_key(&old_rs)
        });
        println!(
            "graceful termination: weight 0 {:?} after the change; deleted {:?} after the connection closed",
            changed.elapsed() - closed.elapsed(),
            closed.elapsed()
        );
        assert!(node.log().contains("Synced rules"), "the daemon re-checked by itself");
    }

    /// A UDP flow whose endpoint is removed moves to the live one: the real server goes at
    /// once (no draining for UDP), and the kernel reschedules the flow's next datagrams.
    fn udp_moves_on(node: &Node) {
        let bed = &node.bed;
        let (old, new) = (bed.endpoint(0), bed.endpoint(1));
        let args = ProbeArgs::udp(sa(DNS, 80))
            .with_count(100)
            .with_interval_ms(50)
            .with_timeout_ms(300);
        let (report, changed_ms) = std::thread::scope(|s| {
            let handle = s.spawn(|| node.probe(&bed.client, &args));
            let started = Instant::now();
            // Once the kernel holds the flow (on the old endpoint: the only one), the endpoint
            // goes.
            wait_until_every(POLL, Duration::from_secs(10), "the UDP flow in the IPVS table", || {
                node.ipvsadm(&["-Lnc"])
                    .lines()
                    .any(|l| l.contains(&format!("{DNS}:80")) && l.contains(&old.server_addr().to_string()))
            });
            node.dir
                .write(&services_with_udp(bed, &[Ep::local(new.ip)], &[Ep::local(new.ip)]));
            let changed_ms = started.elapsed().as_millis() as u64;
            (handle.join().expect("probe thread"), changed_ms)
        });
        let first_old = report.attempts.iter().find(|a| a.ok);
        assert_eq!(
            first_old.and_then(|a| a.name.as_deref()),
            Some(old.name.as_str()),
            "the flow starts on the old endpoint: {report:?}"
        );
        let first_new = report
            .attempts
            .iter()
            .find(|a| a.ok && a.name.as_deref() == Some(new.name.as_str()))
            .unwrap_or_else(|| {
                panic!(
                    "never answered by the live endpoint: {:?}\n{}",
                    report.names(),
                    node.log()
                )
            });
        let later: Vec<_> = report.attempts.iter().filter(|a| a.t_ms > first_new.t_ms).collect();
        assert!(
            later
                .iter()
                .all(|a| a.ok && a.name.as_deref() == Some(new.name.as_str())),
            "stays on the live endpoint: {later:?}"
        );
        println!(
            "UDP: first answer from the live endpoint {} ms after the manifest change",
            first_new.t_ms.saturating_sub(changed_ms)
        );
        assert!(
            first_new.t_ms <= changed_ms + 4000,
            "moved within 4 s under TCG: {first_new:?}"
        );
    }

    fn source_hashing(node: &Node) {
        let bed = &node.bed;
        let list = node.ipvsadm(&["-Ln", "-t", &format!("{WEB}:80")]);
        assert!(
            list.contains(&format!("TCP  {WEB}:80 sh")),
            "scheduler updated in place:\n{list}"
        );
        let r = node.probe(&bed.client, &ProbeArgs::tcp(sa(WEB, 80)).with_count(30));
        assert_eq!(r.ok_count(), 30, "{:?}", r.errors());
        assert_eq!(r.names().len(), 1, "one endpoint per source: {:?}", r.names());
        let mut seen = Vec::new();
        for src in bed.outside_ips() {
            let r = node.probe(
                &bed.outside,
                &ProbeArgs::tcp(SocketAddr::new(bed.node_ip(), WEB_NODE_PORT))
                    .with_bind(src)
                    .with_count(10),
            );
            assert_eq!(r.ok_count(), 10, "{:?}", r.errors());
            assert_eq!(r.names().len(), 1, "{src} sticks: {:?}", r.names());
            seen.push((src, r.names()));
        }
        println!("sh: client {:?}, outside {seen:?}", r.names());
    }

    fn cleanup(node: &mut Node) {
        drop(node.daemon.take());
        let out = node.bed.node.exec(BIN, ["--cleanup"]).expect("cleanup runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let list = node.ipvsadm(&["-Ln"]);
        assert_eq!(
            virtual_servers(&list),
            vec![format!("TCP {FOREIGN} wlc")],
            "only someone else's virtual server left:\n{list}"
        );
        let links = node.bed.node.ip(["-o", "link", "show"]).expect("ip link");
        assert!(!links.contains("kube-ipvs0"), "{links}");
        let sets = node.bed.node.exec_ok("ipset", ["list", "-n"]).expect("ipset");
        assert!(!sets.contains("KUBE-"), "{sets}");
        let nat = node
            .bed
            .node
            .exec_ok("iptables-save", ["-t", "nat"])
            .expect("iptables-save");
        assert!(!nat.contains("KUBE-"), "{nat}");
    }
}

common::harness::main! {
    &[Root, Vm] => ipvs_e2e_in_vm;
}
