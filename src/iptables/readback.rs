//! Reading back one service port's rules from `iptables-save -c` output: the rules of its own
//! chains (`KUBE-SVC/SVL/EXT/FW-…` and the `KUBE-SEP-…` chains they jump to) and its rules in
//! the fixed chains (recognised by their comment, which names the service port). Pure but for
//! [`read_port`], which lists just those chains when that is cheaper than saving the tables.

use std::collections::{BTreeSet, HashMap};

use super::exec::{ExecError, Iptables};
use super::names::{
    KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL, KUBE_SERVICES, SEP_PREFIX, service_port_chains,
};
use crate::model::ServicePort;
use crate::proxy::ProgrammedSection;

/// The fixed chains where the render puts rules of a service port, per table (the rest of a
/// port's rules are in its own chains, all in nat).
const PORT_RULES_IN: [(&str, &[&str]); 2] = [
    (
        "filter",
        &[
            KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL,
        ],
    ),
    ("nat", &[KUBE_SERVICES, KUBE_NODEPORTS]),
];

/// A chain could not be listed: which, and why.
#[derive(Debug, thiserror::Error)]
#[error("the {table} chain {chain}: {source}")]
pub struct ListError {
    pub table: &'static str,
    pub chain: String,
    #[source]
    pub source: Box<ExecError>,
}

impl From<ListError> for crate::proxy::ReadBackError {
    fn from(e: ListError) -> Self {
        crate::proxy::ReadBackError {
            what: format!("the {} chain {}", e.table, e.chain),
            message: e.source.to_string(),
        }
    }
}

/// The sections of `port` in both tables, from its chains listed one by one: the fixed chains
/// its rules are in, its own chains, and the endpoint chains these jump to (at 10,000 Services
/// × 10 endpoints about 25 listings instead of saving 110,000 chains). An endpoint chain that
/// nothing jumps to any more is not seen here; a whole save ([`SavedTable`]) shows it.
pub fn read_port<I: Iptables + ?Sized>(ipt: &mut I, port: &ServicePort) -> Result<Vec<ProgrammedSection>, ListError> {
    let own = service_port_chains(&port.name.to_string(), port.protocol.lower());
    let mut sections = Vec::new();
    for (table, _) in PORT_RULES_IN {
        let mut listed = fixed_chains(ipt, table)?;
        if table == "nat" {
            let own_rules = list_chains(
                ipt,
                table,
                [&own.firewall, &own.external, &own.cluster, &own.local].map(String::as_str),
            )?;
            let endpoints: BTreeSet<&str> = rules(&own_rules)
                .filter_map(|(_, rule)| jump_target(rule))
                .filter(|t| t.starts_with(SEP_PREFIX))
                .collect();
            listed.push_str(&own_rules);
            listed.push_str(&list_chains(ipt, table, endpoints)?);
        }
        sections.extend(SavedTable::parse(table, &listed).sections(port));
    }
    Ok(sections)
}

/// The fixed chains of `table` that hold rules of service ports, listed as `iptables-save -c`
/// writes them (for the filter table, all its rules that belong to any service port).
pub fn fixed_chains<I: Iptables + ?Sized>(ipt: &mut I, table: &'static str) -> Result<String, ListError> {
    let fixed = PORT_RULES_IN
        .iter()
        .find(|(t, _)| *t == table)
        .map_or(&[][..], |(_, c)| *c);
    list_chains(ipt, table, fixed.iter().copied())
}

/// `chains` of `table` one after the other (a chain that is not there lists nothing).
fn list_chains<'a, I: Iptables + ?Sized>(
    ipt: &mut I,
    table: &'static str,
    chains: impl IntoIterator<Item = &'a str>,
) -> Result<String, ListError> {
    let mut listed = String::new();
    for chain in chains {
        let found = ipt.list_chain(table, chain).map_err(|source| ListError {
            table,
            chain: chain.to_string(),
            source: Box::new(source),
        })?;
        listed.push_str(&found.unwrap_or_default());
    }
    Ok(listed)
}

/// One table of `iptables-save` output (with or without `-c`), indexed for picking out any
/// service port's rules without scanning the table again: by chain, and by the service port
/// a rule's comment names first (`"ns/svc:port cluster IP"`). Parse once, ask for every port.
#[derive(Clone, Debug, Default)]
pub struct SavedTable {
    pub table: String,
    /// Rule lines (as saved, counters included) per chain.
    chains: HashMap<String, Vec<String>>,
    /// Where each chain first appears, for listing sections in the table's order.
    order: HashMap<String, usize>,
    /// `(chain, line)` of every rule whose comment starts with a service port name.
    by_name: HashMap<String, Vec<(String, String)>>,
}

impl SavedTable {
    /// Indexes the saved `table`.
    pub fn parse(table: &str, saved: &str) -> SavedTable {
        let mut t = SavedTable {
            table: table.to_string(),
            ..SavedTable::default()
        };
        for (chain, rule) in rules(saved) {
            let n = t.order.len();
            t.order.entry(chain.to_string()).or_insert(n);
            t.chains.entry(chain.to_string()).or_default().push(rule.to_string());
            if let Some(name) = comment_name(rule) {
                t.by_name
                    .entry(name.to_string())
                    .or_default()
                    .push((chain.to_string(), rule.to_string()));
            }
        }
        t
    }

    /// Whether the table has `chain` with at least one rule.
    pub fn has_rules(&self, chain: &str) -> bool {
        self.chains.get(chain).is_some_and(|r| !r.is_empty())
    }

    /// The chains that have rules.
    pub fn chains(&self) -> impl Iterator<Item = &str> {
        self.chains.keys().map(String::as_str)
    }

    /// The sections (one per chain, in the table's order) that belong to `port`: its own
    /// chains (`KUBE-SVC/SVL/EXT/FW-…` and the `KUBE-SEP-…` chains they jump to) and its
    /// rules in the fixed chains.
    pub fn sections(&self, port: &ServicePort) -> Vec<ProgrammedSection> {
        let name = port.name.to_string();
        let chains = service_port_chains(&name, port.protocol.lower());
        let mut own: BTreeSet<String> = [chains.cluster, chains.local, chains.external, chains.firewall]
            .into_iter()
            .collect();
        let endpoint_chains: Vec<String> = own
            .iter()
            .filter_map(|c| self.chains.get(c))
            .flatten()
            .filter_map(|rule| jump_target(rule))
            .filter(|t| t.starts_with(SEP_PREFIX))
            .map(str::to_string)
            .collect();
        own.extend(endpoint_chains);
        let mut found: HashMap<&str, Vec<String>> = HashMap::new();
        for chain in &own {
            if let Some(rules) = self.chains.get(chain) {
                found.insert(chain, rules.clone());
            }
        }
        for (chain, rule) in self.by_name.get(&name).into_iter().flatten() {
            if !own.contains(chain) {
                found.entry(chain).or_default().push(rule.clone());
            }
        }
        let mut sections: Vec<(usize, ProgrammedSection)> = found
            .into_iter()
            .map(|(chain, lines)| {
                let at = self.order.get(chain).copied().unwrap_or(usize::MAX);
                let place = format!("{} {chain}", self.table);
                (at, ProgrammedSection { place, lines })
            })
            .collect();
        sections.sort_by_key(|(at, _)| *at);
        sections.into_iter().map(|(_, s)| s).collect()
    }
}

/// The sections of `table` (one per chain, in the order `iptables-save` lists them) that
/// belong to `port`, from that table's `iptables-save -c` output.
pub fn service_port_sections(table: &str, saved: &str, port: &ServicePort) -> Vec<ProgrammedSection> {
    SavedTable::parse(table, saved).sections(port)
}

/// The filter and nat tables as the kernel holds them now (`iptables-save`), as a ruleset the
/// tracer reads: the jump rules are among the built-in chains' own rules there.
pub fn live_ruleset(ipt: &mut dyn super::exec::Iptables) -> Result<super::Ruleset, super::exec::ExecError> {
    let mut restore = String::new();
    for table in ["filter", "nat"] {
        restore.push_str(&ipt.save(table)?);
    }
    Ok(super::Ruleset {
        family: ipt.family(),
        jumps: Vec::new(),
        restore,
    })
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
pub fn jump_target(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

/// The first word of a rule's comment when it names a service port (`ns/svc[:port]`).
fn comment_name(rule: &str) -> Option<&str> {
    let i = rule.find("--comment ")?;
    let comment = rule[i + "--comment ".len()..].trim_start_matches('"');
    let word = comment.split([' ', '"']).next()?;
    word.contains('/').then_some(word)
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

        // Listed chain by chain: the same sections, from the port's chains only.
        let mut fake = crate::iptables::exec::Fake::default();
        fake.saved.insert("nat".into(), saved.clone());
        assert_eq!(read_port(&mut fake, &p).expect("lists"), sections);
        let listed: Vec<&String> = fake.commands.iter().filter(|c| c.starts_with("list nat")).collect();
        assert!(listed.iter().any(|c| c.ends_with(" KUBE-SEP-AAAA")), "{listed:?}");
        assert!(
            !listed
                .iter()
                .any(|c| c.ends_with(" KUBE-SEP-BBBB") || c.ends_with(&other)),
            "{listed:?}"
        );
    }
}
