//! `kube-proxy lab` runs end to end as root, prints every section of its report, and leaves
//! no namespace or process behind.

mod common;

use std::process::Command;

fn lab_reports_every_step_and_cleans_up() {
    let child = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(["lab", "--connections", "90"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("lab runs");
    // Namespaces are named after the lab's pid (other tests may run labs at the same time).
    let pid = child.id();
    let out = child.wait_with_output().expect("lab finishes");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "lab failed: {stderr}\n{stdout}");
    for needle in [
        "1. The chains of Service default/web:p",
        "-m statistic --mode random --probability 0.33333333349",
        "DNAT --to-destination 10.244.1.2:8080",
        "2. 90 new TCP connections",
        ": uniform",
        "3. Scale to 4 endpoints",
        "DNAT to 10.244.4.2:8080) live after",
        "has no endpoints",
        "refused after",
        // explain at the scale step (healthy) and at zero endpoints (the REJECT named).
        "$ kube-proxy explain default/web   (exit status 0)",
        "| Diagnosis: nothing wrong found.",
        "$ kube-proxy explain default/web   (exit status 1)",
        "no endpoints: clients get REJECT",
        "5. The NodePort from the outside host",
        "6. A few conntrack entries",
        "Done:",
    ] {
        assert!(stdout.contains(needle), "report lacks {needle:?}:\n{stdout}");
    }
    let leftover = common::netns::lab_namespaces(pid);
    assert!(leftover.is_empty(), "namespaces left behind: {leftover:?}");
}

fn lab_runs_in_nftables_mode() {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(["lab", "--proxy-mode=nftables", "--connections", "60"])
        .output()
        .expect("lab runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "lab failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "nftables mode", "to numgen random mod 55440 offset", "(10.244.4.2 . 8080) live", "@reject-services reject",
        "refused after", "| Diagnosis: nothing wrong found.", "(exit status 1)", "Done:",
    ] {
        assert!(stdout.contains(needle), "report lacks {needle:?}:\n{stdout}");
    }
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-save"), Tool("iptables-restore")]
        => lab_reports_every_step_and_cleans_up;
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-save"), Tool("iptables-restore"), Tool("nft")]
        => lab_runs_in_nftables_mode;
}
