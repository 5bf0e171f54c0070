//! nftables tables compared as data: `nft -j list table …` normalised so that two tables
//! with the same content compare equal however they were built (handles dropped, set
//! elements sorted, objects keyed by kind and name, rules kept in order per chain).

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

/// `text` applied by `nft -f` in a network namespace of its own (gone afterwards), and the
/// `ip kube-proxy` table it made, normalised.
pub fn applied_in_fresh_netns(text: String) -> BTreeMap<String, Value> {
    super::netns::in_fresh_netns(move || {
        kube_proxy::nftables::proxier::nft_apply(&text).unwrap_or_else(|e| panic!("{e}"));
        let out = Command::new("nft")
            .args(["-j", "list", "table", "ip", "kube-proxy"])
            .output()
            .expect("nft runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        normalised(&out.stdout)
    })
}

/// `json` (the output of `nft -j list table …`), normalised as the soak's drift check does
/// it (`kube_proxy::lab::soak::drift::nft_objects`).
pub fn normalised(json: &[u8]) -> BTreeMap<String, Value> {
    kube_proxy::lab::soak::drift::nft_objects(&String::from_utf8_lossy(json)).expect("nft -j prints JSON")
}

/// Where `got` and `want` differ: one line per object missing, extra or different.
pub fn differences(got: &BTreeMap<String, Value>, want: &BTreeMap<String, Value>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in want {
        match got.get(k) {
            None => out.push(format!("missing: {k}")),
            Some(g) if g != v => out.push(format!("differs: {k}:\n  got  {g}\n  want {v}")),
            Some(_) => {}
        }
    }
    for k in got.keys().filter(|k| !want.contains_key(*k)) {
        out.push(format!("extra: {k}"));
    }
    out
}
