//! iptables mode's nfacct counters on a real kernel: the daemon (real binary, in the node
//! namespace of a test bed) creates the accounting objects, its rules count into them with
//! `-m nfacct`, and real packets show up in `/metrics`:
//! - a connection from the node to `127.0.0.1:NODEPORT` counts in
//!   `kubeproxy_iptables_localhost_nodeports_accepted_packets_total` (once per connection: only
//!   a connection's first packet passes the nat table);
//! - a packet of a connection conntrack no longer knows (its table flushed, and
//!   `nf_conntrack_tcp_loose=0` in the node namespace, so a mid-stream packet is INVALID) is
//!   dropped by `KUBE-FORWARD` and counts in
//!   `kubeproxy_iptables_ct_state_invalid_dropped_packets_total`.
//!
//! On a kernel without nfacct the test is skipped, with the reason.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use common::harness::{DAEMON_IN_A_BED, Requirement::Tool, skip, test};
use common::netns::{in_fresh_netns, in_netns};
use common::{ManifestDir, http_get, wait_until};
use kube_proxy::iptables::nfacct::{self, Nfacct};
use kube_proxy::lab::probe::ProbeArgs;
use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const NODE_PORT: u16 = 32517;
const LOCALHOST: &str = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total";
const INVALID: &str = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total";

/// Whether this kernel can hold nfacct objects (tried in a namespace of its own).
fn kernel_has_nfacct() -> Result<(), String> {
    in_fresh_netns(|| {
        let mut n = nfacct::Netlink::new().map_err(|e| e.to_string())?;
        n.ensure("kube-proxy-test").map_err(|e| e.to_string())
    })
}

/// A sample of `/metrics` in the node namespace: `name`'s value, if exported.
fn sample(bed: &Testbed, name: &str) -> Option<f64> {
    let (status, body) = http_get(bed.node.name(), "127.0.0.1:10249".parse().unwrap(), "/metrics")?;
    assert_eq!(status, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

fn nfacct_counters_count_real_packets() {
    if let Err(why) = kernel_has_nfacct() {
        skip(format!("a kernel with nfacct (nfnetlink_acct): {why}"));
    }
    let mut spec = TestbedSpec::new("kpn-acct", BIN);
    spec.endpoints = 1;
    let bed = Testbed::build(&spec).expect("test bed builds (root and iproute2 needed)");
    let dir = ManifestDir::new("kp-nfacct");
    let here = [Ep::local(bed.endpoint(0).ip)];
    let mut web = ServiceSpec::new("web", "10.96.165.10", &here);
    web.node_port = Some(NODE_PORT);
    dir.write(&manifests(&[web]));
    let args: Vec<String> = [
        "--hostname-override=node-a",
        "--cluster-cidr=10.244.0.0/16",
        "--iptables-min-sync-period=0s",
        "--iptables-sync-period=2s",
        "--manifests",
        &dir.0.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let daemon = bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
    daemon
        .wait_for_log("Synced rules", Duration::from_secs(20))
        .expect("first sync");

    // The daemon's own rules count into the two objects.
    let filter = bed
        .node
        .exec_ok("iptables-save", ["-t", "filter"])
        .expect("iptables-save");
    let nat = bed.node.exec_ok("iptables-save", ["-t", "nat"]).expect("iptables-save");
    assert!(
        filter.lines().any(|l| l.starts_with("-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP")),
        "{filter}"
    );
    assert!(
        nat.lines().any(|l| l.starts_with("-A KUBE-NODEPORTS -d 127.0.0.0/8 ")
            && l.contains(&format!(
                "--dport {NODE_PORT} -m nfacct --nfacct-name  localhost_nps_accepted_pkts -j KUBE-EXT-"
            ))),
        "{nat}"
    );
    wait_until(Duration::from_secs(5), "the metrics server", || {
        sample(&bed, LOCALHOST).is_some()
    });
    assert_eq!(sample(&bed, LOCALHOST), Some(0.0));
    assert_eq!(sample(&bed, INVALID), Some(0.0));

    // Three connections from the node to 127.0.0.1:NODEPORT.
    let to = SocketAddr::new("127.0.0.1".parse().unwrap(), NODE_PORT);
    let r = bed.probe(&bed.node, &ProbeArgs::tcp(to).with_count(3)).expect("probe");
    assert!(r.all_ok(), "localhost NodePort answers: {:?}", r.errors());
    assert_eq!(sample(&bed, LOCALHOST), Some(3.0), "one per connection");

    // A connection from the pod to the endpoint, then conntrack forgets it.
    bed.node
        .sysctl("net.netfilter.nf_conntrack_tcp_loose", "0")
        .expect("tcp_loose in the node namespace");
    let endpoint = bed.endpoint(0).server_addr();
    let node_ns = bed.node.name().to_string();
    let echoed = in_netns(bed.client.name(), || {
        let stream = TcpStream::connect_timeout(&endpoint, Duration::from_secs(2)).expect("connect to the endpoint");
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut greeting = String::new();
        reader.read_line(&mut greeting).expect("greeting");
        let flushed = std::process::Command::new("ip")
            .args(["netns", "exec", &node_ns, "conntrack", "-F"])
            .status()
            .expect("conntrack -F");
        assert!(flushed.success());
        (&stream).write_all(b"after the flush\n").expect("write");
        let mut echo = String::new();
        reader.read_line(&mut echo).is_ok_and(|n| n > 0)
    });
    assert!(!echoed, "the INVALID packet is dropped, so nothing is echoed");
    let dropped = sample(&bed, INVALID).unwrap_or(0.0);
    assert!(dropped >= 1.0, "{INVALID} counts the dropped packet(s): {dropped}");
    println!("localhost NodePort connections counted: 3; INVALID packets dropped: {dropped}");
}

fn main() -> ExitCode {
    common::harness::run([
        test("nfacct_counters_count_real_packets", nfacct_counters_count_real_packets)
            .needs(DAEMON_IN_A_BED)
            .needs(&[Tool("conntrack")]),
    ])
}
