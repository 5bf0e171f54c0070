//! The soak's drift check: what the kernel holds, read back with the system's own tools,
//! against a fresh full render of the same manifests (`kube-proxy render`), both normalised to
//! a form in which equal means "the same rules". Pure comparisons, with the edges that run
//! the tools at the end.
//!
//! - nftables: the node's `ip kube-proxy` table read over netlink, against the table a fresh
//!   render's transaction makes ([`nft_form`]). Which numbers a port's `numgen` blocks are
//!   and which `service-endpoints-…` shard holds them is the proxier's bookkeeping (a render
//!   in state order cannot know them), so each `dnat … numgen … map` rule is followed by the
//!   intervals it draws, as sizes and targets; intervals that no rule draws are a difference.
//!   [`nft_objects`] (the `nft -j` form) stays for tests that compare listings literally.
//! - iptables: `iptables-save` of the node against the render's restore input, table by table:
//!   the `KUBE-*` chains declared on each side, and each chain's rules in the form
//!   [`crate::iptables::edits::normalized`] gives (how `iptables-save` spells a rule differs
//!   from how it was written). `KUBE-SERVICES` and `KUBE-NODEPORTS` compare as multisets
//!   (`KUBE-SERVICES` with the same last rule, the jump to `KUBE-NODEPORTS`): between full
//!   syncs the daemon inserts their new rules at the top, by design (see `iptables::edits`),
//!   and no packet can tell. The chains the daemon keeps
//!   outside any render (the canaries) and the built-in chains (its jump rules, ensured on
//!   their own) are not compared.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::iptables::IptablesRenderOptions;
use crate::iptables::edits::normalized;
use crate::lab::netns::Netns;
use crate::model::IpFamily;
use crate::nftables::ast::{ElemKey, Statement};
use crate::nftables::names::is_service_endpoints;
use crate::nftables::netlink::{NftSocket, ReadScope};
use crate::nftables::readback::{without_blocks, without_shard};
use crate::nftables::ruleset::Ruleset;

/// Chains the daemon creates outside the rendered rules.
const UNRENDERED_CHAINS: [&str; 2] = ["KUBE-KUBELET-CANARY", "KUBE-PROXY-CANARY"];
/// Chains whose rule order may differ from the render's between full syncs.
const UNORDERED_CHAINS: [&str; 2] = ["KUBE-SERVICES", "KUBE-NODEPORTS"];

/// What one comparison found: how many objects differ, and the first few, in words.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Drift {
    pub differences: usize,
    pub examples: Vec<String>,
    /// Objects compared (chains, sets, maps; rule lists count per chain).
    pub compared: usize,
}

impl Drift {
    fn note(&mut self, what: String) {
        self.differences += 1;
        if self.examples.len() < 5 {
            self.examples.push(what);
        }
    }
}

/// `nft -j list` output as comparable objects.
pub fn nft_objects(json: &str) -> Result<BTreeMap<String, Value>> {
    let v: Value = serde_json::from_str(json).context("nft -j prints JSON")?;
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
    Ok(out)
}

/// Compares two normalised nft listings (the kernel's first).
pub fn compare_nft(kernel: &BTreeMap<String, Value>, render: &BTreeMap<String, Value>) -> Drift {
    let mut d = Drift::default();
    let keys: BTreeSet<&String> = kernel.keys().chain(render.keys()).collect();
    d.compared = keys.len();
    for k in keys {
        match (kernel.get(k), render.get(k)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) => d.note(format!("{k}: kernel {} vs render {}", short(a), short(b))),
            (Some(_), None) => d.note(format!("{k}: in the kernel only")),
            (None, Some(_)) => d.note(format!("{k}: in the render only")),
            (None, None) => {}
        }
    }
    d
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 300 {
        format!("{}…", &s[..s.floor_char_boundary(300)])
    } else {
        s
    }
}

/// A `kube-proxy` table in comparable form: each chain and set by name, with its lines.
pub type NftForm = BTreeMap<String, Vec<String>>;

/// `table` in the form in which two tables that send every packet the same way are equal
/// (see the module's notes). Sets with timeouts (affinity) compare by declaration only: their
/// elements are the kernel's.
pub fn nft_form(table: &Ruleset) -> NftForm {
    let family = table.family;
    let mut out = NftForm::new();
    let mut drawn: BTreeMap<&str, BTreeSet<&ElemKey>> = BTreeMap::new();
    for (name, chain) in &table.chains {
        let place = format!("chain {name}");
        let mut lines = vec![format!("{:?}", chain.decl)];
        for rule in &chain.rules {
            lines.push(without_blocks(&place, &rule.text(family)));
            let Statement::DnatNumgenMap { modulus, offset, map } = &rule.statement else {
                continue;
            };
            let Some(set) = table.sets.get(map).filter(|_| *modulus > 0) else {
                lines.push(format!("  draws from {map}, which is missing"));
                continue;
            };
            let hi = offset.saturating_add(modulus - 1);
            let mut draws = Vec::new();
            for (key, e) in set
                .elements
                .range(ElemKey::Range(*offset, 0)..=ElemKey::Range(hi, u32::MAX))
            {
                if let ElemKey::Range(a, b) = key
                    && *b <= hi
                {
                    let value = e.value.as_ref().map(ToString::to_string).unwrap_or_default();
                    draws.push(format!("  draws {} : {value}", b - a + 1));
                    drawn.entry(map.as_str()).or_default().insert(key);
                }
            }
            // Which endpoint a block's first interval holds does not change where packets go.
            draws.sort();
            lines.extend(draws);
        }
        out.insert(place, lines);
    }
    for (name, set) in &table.sets {
        if is_service_endpoints(name) {
            let stray: Vec<String> = set
                .elements
                .iter()
                .filter(|(k, _)| !drawn.get(name.as_str()).is_some_and(|d| d.contains(k)))
                .map(|(_, e)| format!("{e:?}"))
                .collect();
            if !stray.is_empty() {
                out.entry(format!("map {}: intervals no rule draws", without_shard(name)))
                    .or_default()
                    .extend(stray);
            }
            continue;
        }
        let mut lines = vec![format!("{:?}", set.decl)];
        if set.decl.timeout_seconds.is_none() {
            lines.extend(set.elements.values().map(|e| format!("{e:?}")));
        }
        out.insert(format!("set {name}"), lines);
    }
    out
}

/// Compares the kernel's table with the render's, both in [`nft_form`]; `undecoded` are the
/// kernel's rules that are not of a shape we write (each a difference).
pub fn compare_nft_forms(kernel: &NftForm, undecoded: &[String], render: &NftForm) -> Drift {
    let mut d = Drift::default();
    for u in undecoded {
        d.note(format!("a rule the read-back cannot decode: {u}"));
    }
    let keys: BTreeSet<&String> = kernel.keys().chain(render.keys()).collect();
    d.compared = keys.len();
    for k in keys {
        match (kernel.get(k), render.get(k)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) => {
                let detail = match a.iter().zip(b).find(|(x, y)| x != y) {
                    Some((x, y)) => format!("kernel `{x}` vs render `{y}`"),
                    None => format!("{} lines in the kernel, {} rendered", a.len(), b.len()),
                };
                d.note(format!("{k}: {detail}"));
            }
            (Some(_), None) => d.note(format!("{k}: in the kernel only")),
            (None, Some(_)) => d.note(format!("{k}: in the render only")),
            (None, None) => {}
        }
    }
    d
}

/// The node's `ip kube-proxy` table, read over netlink, and the rules it could not decode.
pub fn kernel_nftables(node: &Netns) -> Result<(Ruleset, Vec<String>)> {
    let read = in_netns(node, || NftSocket::new()?.read(IpFamily::V4, &ReadScope::Whole))?
        .with_context(|| format!("reading the kube-proxy table of {}", node.name()))?;
    let (table, undecoded) = read.with_context(|| format!("{} has no ip kube-proxy table", node.name()))?;
    let undecoded = undecoded
        .iter()
        .map(|u| format!("{}: {} ({})", u.chain, u.exprs, u.reason))
        .collect();
    Ok((table, undecoded))
}

/// Whether `table` sends traffic to `ip` (an interval of a `service-endpoints-…` map has it).
pub fn nft_serves(table: &Ruleset, ip: std::net::IpAddr) -> bool {
    let prefix = format!("{ip} ");
    table
        .sets
        .iter()
        .filter(|(name, _)| is_service_endpoints(name))
        .flat_map(|(_, set)| set.elements.values())
        .any(|e| e.value.as_ref().is_some_and(|v| v.to_string().starts_with(&prefix)))
}

/// nftables mode's full render of the manifests in `dir` (IPv4) as the daemon started with
/// `flags` renders it: the table its transaction makes.
pub fn render_nftables(flags: &[String], dir: &Path) -> Result<Ruleset> {
    let (cfg, state, info) = desired(flags, dir)?;
    let opts = crate::proxy::RenderOptions::from_config(&cfg, IpFamily::V4, &info);
    let tx = crate::nftables::render::render_tx(&state, &opts, true);
    Ruleset::from_transaction(&tx).context("the render's transaction")
}

/// The configuration the daemon started with `flags` resolves, and the state and node of the
/// manifests in `dir`.
pub fn desired(
    flags: &[String],
    dir: &Path,
) -> Result<(
    crate::config::ProxyConfig,
    crate::model::ProxyState,
    crate::model::NodeInfo,
)> {
    use clap::Parser as _;
    let args = std::iter::once("kube-proxy".to_string()).chain(flags.iter().cloned());
    let cli = crate::cli::Cli::try_parse_from(args).context("the daemon's flags")?;
    let cfg = crate::config::ProxyConfig::resolve(&cli.flags)?;
    let objects = crate::manifest::load_paths(&[dir])?;
    let info = crate::app::node_info(&objects, &cfg);
    let state = crate::model::build_state(&objects, &info, IpFamily::V4);
    Ok((cfg, state, info))
}

/// One table of iptables text (restore input or save output): its `KUBE-*` chains and their
/// normalised rules, in order.
pub type IptTables = BTreeMap<String, BTreeMap<String, Vec<Vec<String>>>>;

/// Parses `*table` … `COMMIT` blocks; keeps `KUBE-*` chains (declared or with rules) but the
/// unrendered ones.
pub fn ipt_tables(text: &str) -> IptTables {
    let mut out: IptTables = BTreeMap::new();
    let mut table = String::new();
    let kept = |c: &str| c.starts_with("KUBE-") && !UNRENDERED_CHAINS.contains(&c);
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_string();
        } else if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap_or_default();
            if kept(chain) {
                out.entry(table.clone())
                    .or_default()
                    .entry(chain.to_string())
                    .or_default();
            }
        } else if line.starts_with("-A ") {
            let rule = normalized(line);
            if let Some(chain) = rule.get(1)
                && kept(chain)
            {
                out.entry(table.clone())
                    .or_default()
                    .entry(chain.clone())
                    .or_default()
                    .push(rule);
            }
        }
    }
    out
}

/// Compares the kernel's iptables tables with the render's, for the tables the render has.
pub fn compare_ipt(kernel: &IptTables, render: &IptTables) -> Drift {
    let mut d = Drift::default();
    let empty = BTreeMap::new();
    for (table, want) in render {
        let got = kernel.get(table).unwrap_or(&empty);
        let chains: BTreeSet<&String> = got.keys().chain(want.keys()).collect();
        d.compared += chains.len();
        for chain in chains {
            let (a, b) = match (got.get(chain), want.get(chain)) {
                (Some(a), Some(b)) => (a, b),
                (Some(_), None) => {
                    d.note(format!("{table} {chain}: in the kernel only"));
                    continue;
                }
                (None, _) => {
                    d.note(format!("{table} {chain}: in the render only"));
                    continue;
                }
            };
            let same = if UNORDERED_CHAINS.contains(&chain.as_str()) {
                let sorted = |v: &Vec<Vec<String>>| {
                    let mut v = v.clone();
                    v.sort();
                    v
                };
                // KUBE-SERVICES ends with the jump to KUBE-NODEPORTS, which must stay last.
                (chain != "KUBE-SERVICES" || a.last() == b.last()) && sorted(a) == sorted(b)
            } else {
                a == b
            };
            if !same {
                let first = a.iter().zip(b).find(|(x, y)| x != y);
                let detail = match first {
                    Some((x, y)) => format!("kernel `{}` vs render `{}`", x.join(" "), y.join(" ")),
                    None => format!("{} rules in the kernel, {} rendered", a.len(), b.len()),
                };
                d.note(format!("{table} {chain}: {detail}"));
            }
        }
    }
    d
}

/// The node's iptables rules as `iptables-save` lists them.
pub fn kernel_iptables(node: &Netns) -> Result<String> {
    node.exec_ok("iptables-save", std::iter::empty::<&str>())
}

/// The render (`render_iptables`' restore input) restored into `scratch` and saved back, so
/// that both sides are spelled by `iptables-save`, against the kernel's listing `kernel`.
pub fn compare_iptables(kernel: &str, render: &str, scratch: &Netns) -> Result<Drift> {
    let (ok, out) = scratch.exec_with_input("iptables-restore", ["--counters"], render)?;
    if !ok {
        bail!("iptables-restore refused the render: {out}");
    }
    let reference = scratch.exec_ok("iptables-save", std::iter::empty::<&str>())?;
    Ok(compare_ipt(&ipt_tables(kernel), &ipt_tables(&reference)))
}

/// iptables mode's full render of the manifests in `dir` (IPv4), as the daemon started with
/// `flags` renders it in the namespace `node`: the restore input. The nfacct counters it
/// names are made in `scratch` too, for the restore there.
pub fn render_iptables(flags: &[String], dir: &Path, node: &Netns, scratch: &Netns) -> Result<String> {
    let (cfg, state, info) = desired(flags, dir)?;
    let mut opts = IptablesRenderOptions::from_config(&cfg, IpFamily::V4, &info);
    opts.nfacct = in_netns(node, crate::daemon::modes::nfacct_counters_present)?;
    if opts.nfacct && !in_netns(scratch, || crate::daemon::modes::nfacct_counters().is_some())? {
        bail!("cannot make the nfacct counters in {}", scratch.name());
    }
    opts.tcp_be_liberal = node
        .read_sysctl("net.netfilter.nf_conntrack_tcp_be_liberal")
        .is_ok_and(|v| v.trim() == "1");
    Ok(crate::iptables::render(&state, &opts).restore)
}

/// Moves the calling thread into the network namespace `ns` (the rest of the process stays).
pub fn enter(ns: &Netns) -> Result<()> {
    let file = std::fs::File::open(format!("/run/netns/{}", ns.name()))?;
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("entering the namespace {}", ns.name()))
}

/// Runs `f` on a thread that entered the network namespace `ns`.
fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> T + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| -> Result<T> {
            enter(ns)?;
            Ok(f())
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread in {} panicked", ns.name()))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RENDER: &str = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n:KUBE-SEP-A - [0:0]\n\
        -A KUBE-SERVICES -m comment --comment \"a/a:p cluster IP\" -m tcp -p tcp -d 10.96.0.1 --dport 80 -j KUBE-SVC-A\n\
        -A KUBE-SERVICES -m comment --comment \"b/b:p cluster IP\" -m tcp -p tcp -d 10.96.0.2 --dport 80 -j KUBE-SVC-B\n\
        -A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n\
        -A KUBE-SVC-A -j KUBE-SEP-A\n-A KUBE-SEP-A -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080\nCOMMIT\n";

    /// As `iptables-save` lists RENDER after a partial sync inserted the b rule at the top.
    const SAVED: &str = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n\
        :KUBE-SVC-A - [0:0]\n:KUBE-SEP-A - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n\
        -A KUBE-SERVICES -d 10.96.0.2/32 -p tcp -m comment --comment \"b/b:p cluster IP\" -m tcp --dport 80 -j KUBE-SVC-B\n\
        -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"a/a:p cluster IP\" -m tcp --dport 80 -j KUBE-SVC-A\n\
        -A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n\
        -A KUBE-SVC-A -j KUBE-SEP-A\n-A KUBE-SEP-A -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080\nCOMMIT\n";

    #[test]
    fn iptables_save_of_the_render_has_no_drift() {
        let d = compare_ipt(&ipt_tables(SAVED), &ipt_tables(RENDER));
        assert_eq!(d.differences, 0, "{:?}", d.examples);
        assert_eq!(d.compared, 3);
    }

    #[test]
    fn iptables_drift_is_found() {
        // A stale endpoint, a missing chain, a leftover chain, a moved last rule.
        let stale = SAVED.replace("10.244.1.2:8080", "10.244.1.3:8080");
        assert_eq!(compare_ipt(&ipt_tables(&stale), &ipt_tables(RENDER)).differences, 1);
        let missing = SAVED.replace(":KUBE-SEP-A - [0:0]\n", "").replace(
            "-A KUBE-SEP-A -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080\n",
            "",
        );
        assert_eq!(compare_ipt(&ipt_tables(&missing), &ipt_tables(RENDER)).differences, 1);
        let extra = SAVED.replace(":KUBE-SEP-A", ":KUBE-SEP-OLD - [0:0]\n:KUBE-SEP-A");
        let d = compare_ipt(&ipt_tables(&extra), &ipt_tables(RENDER));
        assert_eq!(d.differences, 1);
        assert!(d.examples[0].contains("KUBE-SEP-OLD: in the kernel only"), "{d:?}");
        let lines: Vec<&str> = SAVED.lines().collect();
        let mut moved = lines.clone();
        moved.swap(9, 10);
        let d = compare_ipt(&ipt_tables(&moved.join("\n")), &ipt_tables(RENDER));
        assert_eq!(d.differences, 1, "the NodePort rule must stay last");
    }

    /// A render's table with the numgen block of its first `dnat … map` rule moved up by
    /// `by`, as a proxier that allocated it elsewhere holds it.
    fn moved_block(mut t: Ruleset, by: u32) -> Ruleset {
        let (map, lo, hi) = t
            .chains
            .values_mut()
            .flat_map(|c| c.rules.iter_mut())
            .find_map(|r| match &mut r.statement {
                Statement::DnatNumgenMap { modulus, offset, map } => {
                    let old = *offset;
                    *offset += by;
                    Some((map.clone(), old, old + *modulus - 1))
                }
                _ => None,
            })
            .expect("a dnat numgen rule");
        let set = t.sets.get_mut(&map).expect("its map");
        let moved: Vec<_> = set
            .elements
            .extract_if(.., |k, _| matches!(k, ElemKey::Range(a, _) if *a >= lo && *a <= hi))
            .collect();
        assert!(!moved.is_empty());
        for (k, mut e) in moved {
            if let ElemKey::Range(a, b) = k {
                e.key = ElemKey::Range(a + by, b + by);
                set.elements.insert(e.key.clone(), e);
            }
        }
        t
    }

    #[test]
    fn nft_tables_compare_without_their_block_placement() {
        use crate::model::Protocol;
        use crate::model::testing::{port, state};
        let st = state(
            vec![
                port("ns", "a", 1, Protocol::Tcp, &[1, 2]),
                port("ns", "b", 2, Protocol::Tcp, &[3, 4, 5]),
            ],
            &["10.96.0.0/16"],
        );
        let tx = crate::nftables::render::render_tx(&st, &crate::proxy::RenderOptions::default(), true);
        let render = Ruleset::from_transaction(&tx).expect("applies");
        let moved = moved_block(render.clone(), 1_000_000);
        assert_ne!(moved, render);
        let d = compare_nft_forms(&nft_form(&moved), &[], &nft_form(&render));
        assert_eq!(d.differences, 0, "{:?}", d.examples);
        assert!(d.compared > 5);
        // An endpoint's interval lost; an interval left behind; an undecoded rule.
        let mut lost = moved.clone();
        let map = lost
            .sets
            .values_mut()
            .find(|s| is_service_endpoints(&s.decl.name) && !s.elements.is_empty())
            .expect("a map");
        let first = map.elements.keys().next().cloned().expect("an interval");
        let mut stray = map.elements.remove(&first).expect("removed");
        let d = compare_nft_forms(&nft_form(&lost), &[], &nft_form(&render));
        assert_eq!(d.differences, 1, "{:?}", d.examples);
        let mut left = moved.clone();
        let map = left
            .sets
            .values_mut()
            .find(|s| is_service_endpoints(&s.decl.name) && !s.elements.is_empty())
            .expect("a map");
        stray.key = ElemKey::Range(u32::MAX - 9, u32::MAX);
        map.elements.insert(stray.key.clone(), stray);
        let d = compare_nft_forms(&nft_form(&left), &[], &nft_form(&render));
        assert_eq!(d.differences, 1, "{:?}", d.examples);
        assert!(d.examples[0].contains("intervals no rule draws"), "{d:?}");
        let d = compare_nft_forms(&nft_form(&moved), &["x".to_string()], &nft_form(&render));
        assert_eq!(d.differences, 1);
    }

    #[test]
    fn nft_listings_compare_without_handles_and_element_order() {
        let a = r#"{"nftables":[{"metainfo":{"version":"1"}},{"table":{"family":"ip","name":"kube-proxy","handle":1}},
            {"map":{"family":"ip","name":"m","table":"kube-proxy","handle":3,"elem":[["b","x"],["a","y"]]}},
            {"rule":{"family":"ip","table":"kube-proxy","chain":"c","handle":7,"expr":[{"accept":null}]}},
            {"rule":{"family":"ip","table":"kube-proxy","chain":"c","handle":8,"expr":[{"drop":null}]}}]}"#;
        let b = a
            .replace("\"handle\":3", "\"handle\":30")
            .replace(r#"[["b","x"],["a","y"]]"#, r#"[["a","y"],["b","x"]]"#);
        let d = compare_nft(&nft_objects(a).unwrap(), &nft_objects(&b).unwrap());
        assert_eq!((d.differences, d.compared), (0, 3));
        // Rules in another order, an element changed: two differences.
        let c = a
            .replace(r#"{"accept":null}"#, "X")
            .replace(r#"{"drop":null}"#, r#"{"accept":null}"#)
            .replace("X", r#"{"drop":null}"#)
            .replace(r#"["a","y"]"#, r#"["a","z"]"#);
        assert_eq!(
            compare_nft(&nft_objects(a).unwrap(), &nft_objects(&c).unwrap()).differences,
            2
        );
    }
}
