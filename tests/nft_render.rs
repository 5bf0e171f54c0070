//! nftables renderer over the checked-in scenarios: one insta snapshot per scenario and family
//! (`nft-<scenario>-<family>`, reviewed against the shapes of upstream's golden nftables
//! tests), and kernel acceptance: every transaction is checked and applied by the real `nft`
//! inside a throw-away network namespace (never the root namespace).

mod common;

use common::netns::fresh_netns;
use common::{family_name, nft_family, nft_options, numbered};
use kube_proxy::lab::netns::Netns;
use kube_proxy::model::{IpFamily, ProxyState};
use kube_proxy::nftables::{render, render_transaction};
use kube_proxy::proxy::RenderOptions;

/// Every (scenario, family, state, options) to render: the families a scenario has service
/// ports in (IPv4 when it has none).
fn cases() -> Vec<(String, IpFamily, ProxyState, RenderOptions)> {
    common::scenario_states()
        .into_iter()
        .map(|s| {
            let family = s.state.family;
            (s.name, family, s.state, nft_options(&s.flags, family))
        })
        .collect()
}

fn nft_scenario_snapshots() {
    for (name, family, state, opts) in cases() {
        let text = render(&state, &opts);
        insta::assert_snapshot!(format!("nft-{name}-{}", family_name(family)), text);
    }
}

fn nft_render_is_deterministic() {
    for (name, _, state, opts) in cases() {
        assert_eq!(render(&state, &opts), render(&state, &opts), "{name}");
    }
}

/// Runs `nft ARGS` in the namespace with `stdin` as input; returns (success, stdout+stderr).
fn nft(ns: &Netns, args: &[&str], stdin: &str) -> (bool, String) {
    ns.exec_with_input("nft", args, stdin).expect("ip netns exec runs")
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

fn nft_kernel_accepts_every_transaction() {
    for (name, family, state, opts) in cases() {
        let ctx = format!("{name} {}", family_name(family));
        let ns = fresh_netns("kp-nft-test");
        let nft_family = nft_family(family);
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

common::harness::main! {
    &[] => nft_scenario_snapshots, nft_render_is_deterministic;
    &[Root, Tool("ip"), Tool("nft")] => nft_kernel_accepts_every_transaction;
}
