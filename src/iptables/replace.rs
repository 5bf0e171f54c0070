//! Whole-table replacement for large full syncs. `iptables-restore --noflush` with iptables-nft
//! 1.8.x scans every chain for each rule that jumps to a chain, so a full sync is quadratic
//! (over 300 s at 10k Services × 10 endpoints, see the README), while a restore that replaces
//! the table (flush mode) is linear. Replacing a table must not lose what other components put
//! there, so this module rebuilds the complete table text: every chain and rule that is not
//! ours is copied from `iptables-save -c` (with its counters), ours come from the renderer, and
//! our jump rules go first in the built-in chains, as upstream's "insert if missing" puts them.

use std::collections::HashSet;
use std::fmt::Write as _;

use super::JumpRule;
use super::names::{self, is_service_chain};

const BUILTIN_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// The fixed chains kube-proxy owns in `table` (KUBE-FIREWALL is kubelet's unless we render it).
pub fn fixed_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &[
            names::KUBE_SERVICES,
            names::KUBE_NODEPORTS,
            names::KUBE_POSTROUTING,
            names::KUBE_MARK_MASQ,
            names::KUBE_PROXY_CANARY,
        ],
        "filter" => &[
            names::KUBE_SERVICES,
            names::KUBE_EXTERNAL_SERVICES,
            names::KUBE_FORWARD,
            names::KUBE_NODEPORTS,
            names::KUBE_PROXY_FIREWALL,
            names::KUBE_PROXY_CANARY,
        ],
        _ => &[names::KUBE_PROXY_CANARY],
    }
}

/// The result of a merge.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Merged {
    /// `*table … COMMIT` ready for a flush-mode restore.
    pub text: String,
    /// Per-service chains that were in the kernel and are not any more.
    pub dropped_service_chains: usize,
}

fn quote(arg: &str) -> String {
    if arg.contains(' ') {
        format!("\"{arg}\"")
    } else {
        arg.to_string()
    }
}

/// Merges `saved` (`iptables-save -c -t TABLE` output) with `ours` (our `*TABLE … COMMIT`
/// section) and our `jumps` of that table.
pub fn merge_table(table: &str, saved: &str, ours: &str, jumps: &[JumpRule]) -> Merged {
    let our_decls: Vec<&str> = ours.lines().filter(|l| l.starts_with(':')).collect();
    let our_rules: Vec<&str> = ours
        .lines()
        .filter(|l| l.starts_with("-A ") || l.starts_with("-X "))
        .collect();
    let ours_declared: HashSet<String> = our_decls.iter().map(|l| chain_of_decl(l).to_string()).collect();
    let mut declared = ours_declared.clone();
    let fixed = fixed_chains(table);
    let owned = |c: &str| fixed.contains(&c) || is_service_chain(c) || ours_declared.contains(c);
    let jump_targets: HashSet<String> = jumps
        .iter()
        .filter(|j| j.table == table)
        .filter_map(|j| j.args.last().cloned())
        .collect();

    let mut out = format!("*{table}\n");
    let mut foreign_rules = String::new();
    let mut dropped = 0;
    for line in saved.lines() {
        if line.starts_with(':') {
            let chain = chain_of_decl(line);
            if owned(chain) {
                dropped += usize::from(is_service_chain(chain) && !ours_declared.contains(chain));
            } else {
                out.push_str(line);
                out.push('\n');
            }
            continue;
        }
        // Rules, with or without a `[packets:bytes]` counter prefix.
        let rule = match line.strip_prefix('[') {
            Some(rest) => rest.split_once("] ").map_or(line, |(_, r)| r),
            None => line,
        };
        let Some(after) = rule.strip_prefix("-A ") else {
            continue;
        };
        let chain = after.split(' ').next().unwrap_or("");
        if owned(chain) {
            continue;
        }
        // Our old jump rules are replaced by the ones written below.
        let target = rule.rsplit_once(" -j ").map(|(_, t)| t.trim());
        if BUILTIN_CHAINS.contains(&chain) && target.is_some_and(|t| jump_targets.contains(t)) {
            continue;
        }
        foreign_rules.push_str(line);
        foreign_rules.push('\n');
    }
    let mut decls = String::new();
    for d in &our_decls {
        decls.push_str(d);
        decls.push('\n');
    }
    if table != "mangle" && !declared.contains(names::KUBE_PROXY_CANARY) {
        let _ = writeln!(decls, ":{} - [0:0]", names::KUBE_PROXY_CANARY);
        declared.insert(names::KUBE_PROXY_CANARY.to_string());
    }
    // A jump target that neither we nor the saved table declare is created empty, as a full
    // sync's "ensure chain" does (kubelet's KUBE-FIREWALL, for instance).
    let saved_decls: HashSet<&str> = saved
        .lines()
        .filter(|l| l.starts_with(':'))
        .map(chain_of_decl)
        .collect();
    let mut targets: Vec<&String> = jump_targets.iter().collect();
    targets.sort();
    for t in targets {
        let kept_foreign = saved_decls.contains(t.as_str()) && !owned(t);
        if !declared.contains(t.as_str()) && !kept_foreign {
            let _ = writeln!(decls, ":{t} - [0:0]");
            declared.insert(t.clone());
        }
    }
    out.push_str(&decls);
    for j in jumps.iter().filter(|j| j.table == table) {
        let args: Vec<String> = j.args.iter().map(|a| quote(a)).collect();
        let _ = writeln!(out, "-A {} {}", j.chain, args.join(" "));
    }
    out.push_str(&foreign_rules);
    for r in our_rules.iter().filter(|r| r.starts_with("-A ")) {
        out.push_str(r);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    Merged {
        text: out,
        dropped_service_chains: dropped,
    }
}

fn chain_of_decl(line: &str) -> &str {
    line.trim_start_matches(':').split_whitespace().next().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::render::jump_rules;

    const SAVED: &str = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [10:600]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [5:300]\n:POSTROUTING ACCEPT [5:300]\n:CNI-HOSTPORT-DNAT - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SEP-OLDOLDOLDOLDOLDO - [0:0]\n[7:420] -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n[3:180] -A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n[0:0] -A CNI-HOSTPORT-DNAT -p tcp --dport 8080 -j DNAT --to-destination 10.1.1.1:80\n[0:0] -A KUBE-SERVICES -d 10.96.0.9/32 -j KUBE-SEP-OLDOLDOLDOLDOLDO\n[0:0] -A KUBE-SEP-OLDOLDOLDOLDOLDO -j DNAT --to-destination 10.2.2.2:80\nCOMMIT\n";

    #[test]
    fn keeps_foreign_rules_and_counters_and_replaces_ours() {
        let ours = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-SVC-NEWNEWNEWNEWNEWN - [0:0]\n-A KUBE-SERVICES -d 10.96.0.1 -j KUBE-SVC-NEWNEWNEWNEWNEWN\nCOMMIT\n";
        let m = merge_table("nat", SAVED, ours, &jump_rules());
        let t = &m.text;
        assert_eq!(m.dropped_service_chains, 1);
        assert!(
            t.contains(":PREROUTING ACCEPT [10:600]\n") && t.contains(":CNI-HOSTPORT-DNAT - [0:0]\n"),
            "{t}"
        );
        assert!(
            t.contains("[3:180] -A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n"),
            "{t}"
        );
        assert!(t.contains("[0:0] -A CNI-HOSTPORT-DNAT -p tcp --dport 8080 -j DNAT --to-destination 10.1.1.1:80\n"));
        assert!(!t.contains("OLDOLD"), "stale chains and their rules are gone: {t}");
        assert_eq!(
            t.matches("-j KUBE-SERVICES").count(),
            2,
            "one jump each from PREROUTING and OUTPUT: {t}"
        );
        let ours_first = t
            .find("-A PREROUTING -m comment --comment \"kubernetes service portals\"")
            .unwrap();
        let foreign = t.find("-A PREROUTING -m addrtype").unwrap();
        assert!(ours_first < foreign, "our jump comes first: {t}");
        assert!(
            t.contains(":KUBE-POSTROUTING - [0:0]") && t.contains(":KUBE-PROXY-CANARY - [0:0]"),
            "{t}"
        );
        assert!(
            t.ends_with("-A KUBE-SERVICES -d 10.96.0.1 -j KUBE-SVC-NEWNEWNEWNEWNEWN\nCOMMIT\n"),
            "{t}"
        );
    }

    #[test]
    fn kubelet_firewall_chain_is_kept_unless_we_render_it() {
        let saved = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n[0:0] -A INPUT -j KUBE-FIREWALL\n[0:0] -A KUBE-FIREWALL -m comment --comment \"kubelet rule\" -j DROP\nCOMMIT\n";
        let ours = "*filter\n:KUBE-SERVICES - [0:0]\nCOMMIT\n";
        let t = merge_table("filter", saved, ours, &jump_rules()).text;
        assert!(
            t.contains("kubelet rule") && t.matches(":KUBE-FIREWALL ").count() == 1,
            "{t}"
        );
        let ours = "*filter\n:KUBE-FIREWALL - [0:0]\n-A KUBE-FIREWALL -m comment --comment \"ours\" -j DROP\nCOMMIT\n";
        let t = merge_table("filter", saved, ours, &jump_rules()).text;
        assert!(!t.contains("kubelet rule") && t.contains("\"ours\""), "{t}");
    }
}
