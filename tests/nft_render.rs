//! nftables renderer over the checked-in scenarios: one insta snapshot per scenario and family
//! (`nft-<scenario>-<family>`, reviewed against the shapes of upstream's golden nftables
//! tests), and kernel acceptance: every transaction is checked and applied by the real `nft`
//! inside a throw-away network namespace (never the root namespace).

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use kube_proxy::config::LocalDetector;
use kube_proxy::lab::netns::Netns;
use kube_proxy::model::{IpFamily, NodeInfo, ProxyState, build_state};
use kube_proxy::nftables::{render, render_transaction};
use kube_proxy::proxy::RenderOptions;

/// The `--cluster-cidr` of `family` from a scenario's flags, else the IPv4 default the brief
/// of these tests uses (which the renderer ignores for IPv6).
fn cluster_cidr(flags: &[String], family: IpFamily) -> String {
    flags
        .iter()
        .filter_map(|f| f.strip_prefix("--cluster-cidr="))
        .flat_map(|v| v.split(','))
        .find(|c| c.parse::<ipnet::IpNet>().is_ok_and(|n| family.contains(&n.addr())))
        .unwrap_or("10.244.0.0/16")
        .to_string()
}

fn options(flags: &[String], family: IpFamily) -> RenderOptions {
    RenderOptions {
        local_detector: LocalDetector::Cidr(cluster_cidr(flags, family)),
        // nftables mode defaults nodePortAddresses to the node's primary IPs.
        node_port_addresses: vec!["primary".into()],
        ..RenderOptions::default()
    }
}

fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4",
        IpFamily::V6 => "ipv6",
    }
}

/// Every (scenario, family, state, options) to render: the families a scenario has service
/// ports in (IPv4 when it has none).
fn cases() -> Vec<(String, IpFamily, ProxyState, RenderOptions)> {
    let mut out = Vec::new();
    for (name, path, flags) in common::scenarios() {
        let abs = common::root().join(&path);
        let objects = kube_proxy::manifest::load_paths(&[abs.as_path()]).expect("scenario loads");
        let node = NodeInfo::from_objects(&objects, "node-a", &[]);
        let states: Vec<ProxyState> = [IpFamily::V4, IpFamily::V6]
            .into_iter()
            .map(|f| build_state(&objects, &node, f))
            .collect();
        let used: Vec<&ProxyState> = states.iter().filter(|s| !s.service_ports.is_empty()).collect();
        let used = if used.is_empty() { vec![&states[0]] } else { used };
        for st in used {
            out.push((name.clone(), st.family, st.clone(), options(&flags, st.family)));
        }
    }
    assert!(!out.is_empty(), "no scenarios found");
    out
}

#[test]
fn nft_scenario_snapshots() {
    for (name, family, state, opts) in cases() {
        let text = render(&state, &opts);
        insta::assert_snapshot!(format!("nft-{name}-{}", family_name(family)), text);
    }
}

#[test]
fn nft_render_is_deterministic() {
    for (name, _, state, opts) in cases() {
        assert_eq!(render(&state, &opts), render(&state, &opts), "{name}");
    }
}

/// A throw-away network namespace (deleted on drop, whatever happens in between).
fn netns() -> Option<Netns> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    Netns::create(&format!(
        "kp-nft-test-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    ))
    .ok()
}

/// Runs `nft ARGS` in the namespace with `stdin` as input; returns (success, stdout+stderr).
fn nft(ns: &Netns, args: &[&str], stdin: &str) -> (bool, String) {
    ns.exec_with_input("nft", args, stdin).expect("ip netns exec runs")
}

fn can_use_netns() -> bool {
    nix::unistd::geteuid().is_root() && which("nft") && which("ip")
}

fn which(bin: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The blank-line separated blocks (sets, maps, chains) of an `nft list table`, sorted.
fn blocks(listing: &str) -> Vec<String> {
    let mut v: Vec<String> = listing
        .split("\n\n")
        .map(|b| b.trim_end_matches(|c: char| c == '}' || c.is_whitespace()).to_string())
        .collect();
    v.sort();
    v
}

fn numbered(text: &str) -> String {
    text.lines()
        .enumerate()
        .map(|(i, l)| format!("{:4} {l}\n", i + 1))
        .collect()
}

#[test]
fn nft_kernel_accepts_every_transaction() {
    if !can_use_netns() {
        eprintln!("skipped: needs root and nft to create a network namespace");
        return;
    }
    for (name, family, state, opts) in cases() {
        let ctx = format!("{name} {}", family_name(family));
        let Some(ns) = netns() else {
            panic!("{ctx}: `ip netns add` failed");
        };
        let nft_family = match family {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        };
        let first = render(&state, &opts);
        let (ok, msg) = nft(&ns, &["--check", "-f", "-"], &first);
        assert!(
            ok,
            "{ctx}: nft --check rejected the transaction:\n{msg}\n{}",
            numbered(&first)
        );
        let (ok, msg) = nft(&ns, &["-f", "-"], &first);
        assert!(ok, "{ctx}: nft -f failed:\n{msg}\n{}", numbered(&first));
        let (ok, listing) = nft(&ns, &["list", "table", nft_family, "kube-proxy"], "");
        assert!(ok, "{ctx}: nft list table failed:\n{listing}");
        assert!(listing.contains("chain services"), "{ctx}:\n{listing}");
        assert!(listing.contains("map service-ips"), "{ctx}:\n{listing}");

        // A restarted kube-proxy's first sync over the existing table, then a later full
        // sync (without the base-chain re-creation), must both apply too.
        let (ok, msg) = nft(&ns, &["-f", "-"], &first);
        assert!(ok, "{ctx}: re-applying the first sync failed:\n{msg}");
        let resync = render_transaction(&state, &opts, false);
        let (ok, msg) = nft(&ns, &["-f", "-"], &resync);
        assert!(ok, "{ctx}: full resync failed:\n{msg}\n{}", numbered(&resync));
        let (ok, again) = nft(&ns, &["list", "table", nft_family, "kube-proxy"], "");
        assert!(ok, "{ctx}: nft list table failed after resync:\n{again}");
        // Re-created base chains are listed last, so compare the blocks in any order.
        assert_eq!(blocks(&listing), blocks(&again), "{ctx}: a resync changed the ruleset");
    }
}
