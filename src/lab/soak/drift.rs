//! The soak's drift check: what the kernel holds, read back with the system's own tools,
//! against a fresh full render of the same manifests (`kube-proxy render`), both normalised to
//! a form in which equal means "the same rules". Pure comparisons, with the edges that run
//! the tools at the end.
//!
//! - nftables: `nft -j list table ip kube-proxy` of the node, and of a scratch namespace into
//!   which the render was loaded with `nft -f`; handles dropped, set elements sorted, objects
//!   keyed by kind and name, each chain's rules in order. Nothing of ours decodes either side.
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

/// The node's rules of `mode` as its tools list them.
pub fn kernel_text(node: &Netns, mode: &str) -> Result<String> {
    match mode {
        "nftables" => node.exec_ok("nft", ["-j", "list", "table", "ip", "kube-proxy"]),
        _ => node.exec_ok("iptables-save", std::iter::empty::<&str>()),
    }
}

/// The render of `mode` in comparable form, against the kernel's listing `kernel`. nftables:
/// `render` (`kube-proxy render`'s output) loaded into `scratch` and listed back. iptables: the
/// restore input rendered here for the objects in `dir` as the daemon renders it on this node
/// (with the nfacct counters when the node has them, and its `tcp_be_liberal`), restored into
/// `scratch` and saved back, so that both sides are spelled by `iptables-save`.
pub fn compare(mode: &str, kernel: &str, render: &str, scratch: &Netns) -> Result<Drift> {
    if mode == "nftables" {
        // The scratch table is replaced whole each time.
        let _ = scratch.exec("nft", ["delete", "table", "ip", "kube-proxy"]);
        let (ok, out) = scratch.exec_with_input("nft", ["-f", "-"], render)?;
        if !ok {
            bail!("nft -f refused the render: {out}");
        }
        let reference = scratch.exec_ok("nft", ["-j", "list", "table", "ip", "kube-proxy"])?;
        Ok(compare_nft(&nft_objects(kernel)?, &nft_objects(&reference)?))
    } else {
        let (ok, out) = scratch.exec_with_input("iptables-restore", ["--counters"], render)?;
        if !ok {
            bail!("iptables-restore refused the render: {out}");
        }
        let reference = scratch.exec_ok("iptables-save", std::iter::empty::<&str>())?;
        Ok(compare_ipt(&ipt_tables(kernel), &ipt_tables(&reference)))
    }
}

/// iptables mode's full render of the manifests in `dir` (IPv4), as the daemon started with
/// `flags` renders it in the namespace `node`: the restore input. The nfacct counters it
/// names are made in `scratch` too, for the restore there.
pub fn render_iptables(flags: &[String], dir: &Path, node: &Netns, scratch: &Netns) -> Result<String> {
    use clap::Parser as _;
    let args = std::iter::once("kube-proxy".to_string()).chain(flags.iter().cloned());
    let cli = crate::cli::Cli::try_parse_from(args).context("the daemon's flags")?;
    let cfg = crate::config::ProxyConfig::resolve(&cli.flags)?;
    let objects = crate::manifest::load_paths(&[dir])?;
    let info = crate::app::node_info(&objects, &cfg);
    let state = crate::model::build_state(&objects, &info, IpFamily::V4);
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

/// Runs `f` on a thread that entered the network namespace `ns`.
fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> T + Send) -> Result<T> {
    let file = std::fs::File::open(format!("/run/netns/{}", ns.name()))?;
    std::thread::scope(|s| {
        s.spawn(|| -> Result<T> {
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)?;
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
