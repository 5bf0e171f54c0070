//! No silent fallback: on a kernel without IPVS (this machine's), `--proxy-mode=ipvs` makes the
//! daemon exit non-zero with a message naming the missing module and how to load it, before it
//! touches anything. Run in a fresh network namespace (needs root), never the host's.
//!
//! On a kernel that has IPVS there is nothing to refuse here (the test is reported as ignored);
//! the VM test group (`tests/vm_ipvs_e2e.rs`) checks the refusal of a scheduler whose module is
//! missing.

mod common;

use std::time::{Duration, Instant};

use kube_proxy::lab::netns::Netns;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");

fn ipvs_mode_refuses_to_start_without_the_kernel_module() {
    let ns = Netns::create(&format!("kp-ipvs-refuse-{}", std::process::id())).expect("netns");
    let dir = std::env::temp_dir().join(format!("kp-ipvs-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("manifest dir");
    std::fs::write(
        dir.join("svc.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{port: 80, protocol: TCP}]\n",
    )
    .expect("manifest");
    let args = vec![
        "--proxy-mode=ipvs".to_string(),
        "--hostname-override=node-a".to_string(),
        "--manifests".to_string(),
        dir.display().to_string(),
    ];
    let started = Instant::now();
    let out = ns.exec(BIN, &args).expect("the daemon runs");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "must exit non-zero; stderr:\n{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "exits at once, took {:?}",
        started.elapsed()
    );
    assert!(
        stderr.contains("kernel module ip_vs,") && stderr.contains("modprobe ip_vs`"),
        "names the module and how to load it:\n{stderr}"
    );
    assert!(
        stderr.contains("--proxy-mode=iptables"),
        "names the alternatives:\n{stderr}"
    );
    assert!(!stderr.contains("Synced rules"), "{stderr}");
    // Nothing was programmed: no iptables rules of ours, no dummy link.
    let nat = ns.exec_ok("iptables-save", ["-t", "nat"]).expect("iptables-save");
    assert!(!nat.contains("KUBE-"), "{nat}");
    let links = ns.ip(["-o", "link", "show"]).expect("ip link");
    assert!(!links.contains("kube-ipvs0"), "{links}");
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("iptables-save"), KernelWithout(Ipvs)]
        => ipvs_mode_refuses_to_start_without_the_kernel_module;
}
