//! Reading back one service port's rules from `iptables-save -c` output: the rules of its own
//! chains (`KUBE-SVC/SVL/EXT/FW-…` and the `KUBE-SEP-…` chains they jump to) and its rules in
//! the fixed chains (recognised by their comment, which names the service port). Pure: the
//! caller runs `iptables-save`.

use std::collections::{BTreeMap, BTreeSet};

use super::names::{SEP_PREFIX, service_port_chains};
use crate::model::ServicePort;
use crate::proxy::ProgrammedSection;

/// The sections of `table` (one per chain, in the order `iptables-save` lists them) that
/// belong to `port`, from that table's `iptables-save -c` output.
pub fn service_port_sections(table: &str, saved: &str, port: &ServicePort) -> Vec<ProgrammedSection> {
    let name = port.name.to_string();
    let chains = service_port_chains(&name, port.protocol.lower());
    let mut own: BTreeSet<String> = [chains.cluster, chains.local, chains.external, chains.firewall]
        .into_iter()
        .collect();
    // The endpoint chains are the ones the service's chains jump to.
    for (chain, rule) in rules(saved) {
        if own.contains(chain)
            && let Some(target) = jump_target(rule)
            && target.starts_with(SEP_PREFIX)
        {
            own.insert(target.to_string());
        }
    }
    let mut order: Vec<String> = Vec::new();
    let mut by_chain: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (chain, rule) in rules(saved) {
        if own.contains(chain) || names_port(rule, &name) {
            if !by_chain.contains_key(chain) {
                order.push(chain.to_string());
            }
            by_chain.entry(chain.to_string()).or_default().push(rule.to_string());
        }
    }
    order
        .into_iter()
        .map(|chain| ProgrammedSection {
            place: format!("{table} {chain}"),
            lines: by_chain.remove(&chain).unwrap_or_default(),
        })
        .collect()
}

/// `(chain, whole line)` of every rule line (`[pkts:bytes] -A CHAIN …` or `-A CHAIN …`).
fn rules(saved: &str) -> impl Iterator<Item = (&str, &str)> {
    saved.lines().filter_map(|line| {
        let rest = match line.strip_prefix('[') {
            Some(r) => r.split_once("] ")?.1,
            None => line,
        };
        let chain = rest.strip_prefix("-A ")?.split_whitespace().next()?;
        Some((chain, line))
    })
}

/// The chain a rule jumps (`-j`) or goes (`-g`) to.
fn jump_target(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

/// Whether a rule's comment names the service port `name` (`ns/svc:port`), not merely a
/// longer name it is a prefix of (`ns/svc` vs `ns/svc:http`).
fn names_port(rule: &str, name: &str) -> bool {
    let Some(i) = rule.find("--comment ") else {
        return false;
    };
    let comment = rule[i + "--comment ".len()..].trim_start_matches('"');
    comment
        .strip_prefix(name)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '"']))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, ServicePortName};

    fn port(name: &str) -> ServicePort {
        let name = ServicePortName {
            namespace: "default".into(),
            name: "web".into(),
            port: name.into(),
            protocol: Protocol::Tcp,
        };
        ServicePort::cluster_ip(name, "10.96.165.10".parse().unwrap(), 80)
    }

    #[test]
    fn picks_the_ports_own_chains_and_its_commented_rules() {
        let p = port("http");
        let svc = service_port_chains("default/web:http", "tcp").cluster;
        let other = service_port_chains("default/web", "tcp").cluster;
        let saved = format!(
            "*nat\n:KUBE-SERVICES - [0:0]\n\
             [3:180] -A KUBE-SERVICES -d 10.96.165.10/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport 80 -j {svc}\n\
             [0:0] -A KUBE-SERVICES -d 10.96.165.11/32 -p tcp -m comment --comment \"default/web cluster IP\" -m tcp --dport 81 -j {other}\n\
             [2:120] -A {svc} -m comment --comment \"default/web:http -> 10.244.1.5:8080\" -j KUBE-SEP-AAAA\n\
             [2:120] -A KUBE-SEP-AAAA -p tcp -m comment --comment default/web:http -m tcp -j DNAT --to-destination 10.244.1.5:8080\n\
             [0:0] -A KUBE-SEP-BBBB -p tcp -j DNAT --to-destination 10.244.9.9:8080\n\
             COMMIT\n"
        );
        let sections = service_port_sections("nat", &saved, &p);
        let places: Vec<&str> = sections.iter().map(|s| s.place.as_str()).collect();
        assert_eq!(
            places,
            vec![
                "nat KUBE-SERVICES".to_string(),
                format!("nat {svc}"),
                "nat KUBE-SEP-AAAA".into()
            ]
        );
        assert_eq!(sections[0].lines.len(), 1, "not the rule of default/web");
        assert!(sections[0].lines[0].starts_with("[3:180]"), "counters are kept");
    }
}
