//! IPVS on a real kernel: tests that run in the test VM (`vm/run`), because this machine's own
//! kernel has no IPVS. They need root, qemu and Debian's kernel (see .ci/run); without them they
//! are reported as ignored, with what is missing.
//!
//! A VM boot costs several seconds under TCG, so each test boots once and runs a whole script;
//! the script prints `--- NAME` / `--- end` sections that the test then checks one by one.

mod common;
#[path = "support/vm.rs"]
mod vm;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kube_proxy::lab::probe::ProbeReport;
use vm::{VmError, run_in_vm, try_run_in_vm};

/// The lines between `--- NAME` and the next `--- end`.
fn section<'a>(output: &'a str, name: &str) -> Vec<&'a str> {
    let header = format!("--- {name}");
    let mut lines = output.lines().skip_while(|l| *l != header);
    assert!(
        lines.next().is_some(),
        "no section `{name}` in the VM's output:\n{output}"
    );
    lines.take_while(|l| *l != "--- end").collect()
}

/// Lines with their runs of blanks made single spaces (ipvsadm pads its columns).
fn words(lines: &[&str]) -> String {
    let lines: Vec<String> = lines
        .iter()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    lines.join("\n")
}

/// Bash, run in the guest as `bash -c SCRIPT vm-script KUBE_PROXY`. Exits 42 when every step
/// went through, so the test also sees the command's own exit code come back through the VM
/// (a failing step exits with its own, different code under `set -e`). Nothing here needs
/// cleaning up: the guest, its namespaces and its processes vanish when it powers off.
const SCRIPT: &str = r#"
set -euo pipefail
kube_proxy=$1

# Poll COMMAND until it succeeds, for at most 20 s.
wait_for() {
	local deadline=$((SECONDS + 20))
	until "$@"; do
		if ((SECONDS >= deadline)); then echo "gave up waiting for: $*" >&2; return 1; fi
		sleep 0.05
	done
}

echo "--- guest"
uname -r
pwd
# Paths tests write to are writable (guest memory only).
touch /tmp/vm-test /run/vm-test /var/run/vm-test && echo writable
echo "to stderr" >&2
echo "--- end"

# A virtual service and a real server in a fresh namespace, as ipvsadm lists them.
ip netns add smoke
# Without lo up a fresh namespace has no local routing table yet, and IPVS refuses every real
# server with EINVAL ("address not unicast": it classifies the address in that table).
ip -n smoke link set lo up
ip netns exec smoke ipvsadm -A -t 10.0.0.1:80 -s rr
ip netns exec smoke ipvsadm -a -t 10.0.0.1:80 -r 10.244.0.2:8080 -m
echo "--- ipvsadm smoke"
ip netns exec smoke ipvsadm -Ln
echo "--- end"
# IPVS tables are per network namespace: the guest's root namespace has none of it.
echo "--- ipvsadm root"
ipvsadm -Ln
echo "--- end"

# Real packets: client -> node (IPVS, NAT/masq forwarding) -> pod-a | pod-b.
#   client 192.168.77.2 -- 192.168.77.1 node 10.244.1.1 -- 10.244.1.2 pod-a
#                                         node 10.244.2.1 -- 10.244.2.2 pod-b
# The virtual address sits on a dummy kube-ipvs0 in the node, as kube-proxy puts it there.
for ns in client node pod-a pod-b; do
	ip netns add "$ns"
	ip -n "$ns" link set lo up
done
ip netns exec node sysctl -qw net.ipv4.ip_forward=1
ip -n node link add kube-ipvs0 type dummy
ip -n node addr add 10.96.0.10/32 dev kube-ipvs0
ip -n node link add eth0 type veth peer name eth0 netns client
ip -n node addr add 192.168.77.1/24 dev eth0
ip -n node link set eth0 up
ip -n client addr add 192.168.77.2/24 dev eth0
ip -n client link set eth0 up
ip -n client route add default via 192.168.77.1
i=1
for pod in pod-a pod-b; do
	ip -n node link add "veth-$pod" type veth peer name eth0 netns "$pod"
	ip -n node addr add "10.244.$i.1/24" dev "veth-$pod"
	ip -n node link set "veth-$pod" up
	ip -n "$pod" addr add "10.244.$i.2/24" dev eth0
	ip -n "$pod" link set eth0 up
	ip -n "$pod" route add default via "10.244.$i.1"
	ip netns exec "$pod" "$kube_proxy" lab serve --name "$pod" --port 8080 >"/tmp/$pod.log" 2>&1 &
	i=$((i + 1))
done
ip netns exec node ipvsadm -A -t 10.96.0.10:80 -s rr
ip netns exec node ipvsadm -a -t 10.96.0.10:80 -r 10.244.1.2:8080 -m
ip netns exec node ipvsadm -a -t 10.96.0.10:80 -r 10.244.2.2:8080 -m
wait_for grep -q ready /tmp/pod-a.log
wait_for grep -q ready /tmp/pod-b.log
echo "--- probe"
ip netns exec client "$kube_proxy" lab probe --to 10.96.0.10:80 --count 6 --timeout 5000
echo "--- end"
# The kernel's own counters lag: IPVS sums its per-CPU counters on a 2 s timer.
six_connections() {
	[[ $(ip netns exec node ipvsadm -Ln --stats -t 10.96.0.10:80 | awk '$1 == "TCP" { print $3 }') == 6 ]]
}
wait_for six_connections
echo "--- ipvsadm node"
ip netns exec node ipvsadm -Ln --stats
echo "--- end"
exit 42
"#;

/// One boot: the runner's basics (output, working directory, writable paths, exit code), the
/// smoke test of IPVS itself, and real TCP connections through an IPVS virtual service.
fn ipvs_in_vm() {
    let kube_proxy = env!("CARGO_BIN_EXE_kube-proxy");
    let started = Instant::now();
    let out = run_in_vm(
        &["bash", "-c", SCRIPT, "vm-script", kube_proxy],
        Duration::from_secs(300),
    );
    eprintln!("VM run took {:.1} s", started.elapsed().as_secs_f64());
    let o = &out.output;
    assert_eq!(out.code, 42, "the script's own exit code comes back; output:\n{o}");

    let guest = section(o, "guest");
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("host kernel release");
    assert_ne!(
        guest[0],
        host_kernel.trim(),
        "the guest runs Debian's kernel, not this machine's"
    );
    let cwd = std::env::current_dir().expect("cwd");
    assert_eq!(
        guest[1],
        cwd.to_str().expect("utf-8 cwd"),
        "the caller's working directory"
    );
    assert!(guest.contains(&"writable"), "{guest:?}");
    assert!(guest.contains(&"to stderr"), "stderr is in the same stream: {guest:?}");

    let smoke = words(&section(o, "ipvsadm smoke"));
    assert!(smoke.contains("TCP 10.0.0.1:80 rr"), "virtual service listed:\n{smoke}");
    assert!(
        smoke.contains("-> 10.244.0.2:8080 Masq 1 0 0"),
        "real server listed:\n{smoke}"
    );
    let root = words(&section(o, "ipvsadm root"));
    assert!(
        !root.contains("10.0.0.1"),
        "the guest's root namespace is untouched:\n{root}"
    );

    let probe = section(o, "probe");
    assert_eq!(probe.len(), 1, "one JSON report: {probe:?}");
    let report: ProbeReport = serde_json::from_str(probe[0]).expect("probe report is JSON");
    assert!(report.all_ok(), "every connection answered: {report:?}\n{o}");
    // rr takes the real servers in turn: exactly half each, alternating.
    let names: Vec<&str> = report.attempts.iter().filter_map(|a| a.name.as_deref()).collect();
    assert_eq!(
        report.names(),
        BTreeMap::from([("pod-a".to_string(), 3), ("pod-b".to_string(), 3)]),
        "rr over 2 real servers: {names:?}"
    );
    assert!(names.windows(2).all(|w| w[0] != w[1]), "rr alternates: {names:?}");
    // NAT forwarding without masquerade: the pod sees the client's own address.
    let client: IpAddr = "192.168.77.2".parse().expect("ip");
    assert!(
        report.attempts.iter().all(|a| a.seen_src == Some(client)),
        "pods see the client's address: {report:?}"
    );
    let stats = words(&section(o, "ipvsadm node"));
    // The kernel's own count agrees: 6 connections, 3 to each real server.
    for line in ["TCP 10.96.0.10:80 6 ", "-> 10.244.1.2:8080 3 ", "-> 10.244.2.2:8080 3 "] {
        assert!(stats.contains(line), "`{line}` in ipvsadm --stats:\n{stats}");
    }
}

/// A command that outlives the timeout ends the run with a timeout error (and qemu killed),
/// not a hang: with 1 s, the VM has not even booted.
fn timeout_stops_the_vm() {
    let started = Instant::now();
    let err = try_run_in_vm(&["sleep", "600"], Duration::from_secs(1)).expect_err("a 1 s run cannot finish");
    let took = started.elapsed();
    assert!(matches!(err, VmError::Timeout(_)), "{err}");
    assert!(err.to_string().contains("did not boot within 1 s"), "{err}");
    // vm/run gives qemu 5 s after SIGTERM before SIGKILL; the rest is preparing the initramfs.
    assert!(took < Duration::from_secs(30), "returned after {took:?}");
}

common::harness::main! {
    &[Root, Vm] => ipvs_in_vm, timeout_stops_the_vm;
}
