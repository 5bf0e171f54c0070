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

/// `json` (the output of `nft -j list table …`), normalised.
pub fn normalised(json: &[u8]) -> BTreeMap<String, Value> {
    let v: Value = serde_json::from_slice(json).expect("nft -j prints JSON");
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.remove("handle");
                for (k, val) in m.iter_mut() {
                    strip(val);
                    if k == "elem"
                        && let Value::Array(a) = val
                    {
                        a.sort_by_key(|e| e.to_string());
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    let mut rules: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for mut obj in v["nftables"].as_array().cloned().unwrap_or_default() {
        strip(&mut obj);
        let Some((kind, body)) = obj.as_object().and_then(|m| m.iter().next()) else {
            continue;
        };
        match kind.as_str() {
            "metainfo" => {}
            "rule" => rules
                .entry(body["chain"].as_str().unwrap_or_default().to_string())
                .or_default()
                .push(body.clone()),
            _ => {
                out.insert(
                    format!("{kind} {}", body["name"].as_str().unwrap_or_default()),
                    body.clone(),
                );
            }
        }
    }
    for (chain, rs) in rules {
        out.insert(format!("rules {chain}"), Value::Array(rs));
    }
    out
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
