//! The rules a mode programs for one service port, as sections in the read-back's terms
//! (a place and its lines: `nat KUBE-SVC-…`, `ip kube-proxy chain service-…`, an IPVS virtual
//! server), and their comparison with what the kernel holds: missing, extra and stale lines.
//! Pure: rendering with the configuration, then picking each port's part.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::config::{ProxyConfig, ProxyMode};
use crate::iptables::IptablesRenderOptions;
use crate::iptables::render::{RenderContext, render_service};
use crate::ipvs::render::{IpvsRenderOptions, IpvsService};
use crate::model::{ProxyState, ServicePort, ServicePortName, ServicePortState};
use crate::nftables::blocks::{Blocks, PortBlocks};
use crate::nftables::render::{ServiceRenderer, allocate_blocks};
use crate::nftables::ruleset::Ruleset;
use crate::proxy::{Programmed, ProgrammedSection, RenderOptions};
use crate::{ipvs, nftables};

/// What a mode needs, rendered once per state, to give any port's rules.
pub enum DesiredRules {
    Iptables(Box<RenderContext>),
    /// The table's setup (fixed chains, empty maps), to which each port's part is added, and
    /// the numgen blocks of each port, allocated in state order as a sync from nothing does.
    Nftables(Box<ServiceRenderer>, Box<Ruleset>, HashMap<ServicePortName, PortBlocks>),
    /// The virtual servers of each service port.
    Ipvs(HashMap<ServicePortName, Vec<IpvsService>>),
}

impl DesiredRules {
    /// Renders what is shared by the ports of `state` in `mode`.
    pub fn new(cfg: &ProxyConfig, mode: ProxyMode, state: &ProxyState) -> DesiredRules {
        DesiredRules::counted(cfg, mode, state, false)
    }

    /// [`DesiredRules::new`], with iptables mode's localhost NodePort rules counting into the
    /// nfacct counters when `nfacct` (the daemon writes them so where the counters exist).
    pub fn counted(cfg: &ProxyConfig, mode: ProxyMode, state: &ProxyState, nfacct: bool) -> DesiredRules {
        let (family, node) = (state.family, &state.node);
        match mode {
            ProxyMode::Iptables => {
                let opts = IptablesRenderOptions {
                    nfacct,
                    ..IptablesRenderOptions::from_config(cfg, family, node)
                };
                DesiredRules::Iptables(Box::new(RenderContext::new(state, &opts)))
            }
            ProxyMode::Nftables => {
                let renderer = ServiceRenderer::new(state, &RenderOptions::from_config(cfg, family, node));
                // Our own setup always applies to an empty table.
                let base = Ruleset::from_transaction(&renderer.setup(true)).unwrap_or_else(|_| Ruleset::new(family));
                let mut taken = Blocks::default();
                let blocks = state
                    .service_ports
                    .iter()
                    .filter_map(|sps| Some((sps.port.name.clone(), allocate_blocks(&mut taken, sps)?)))
                    .collect();
                DesiredRules::Nftables(Box::new(renderer), Box::new(base), blocks)
            }
            ProxyMode::Ipvs => {
                let rendered = ipvs::render::render(state, &IpvsRenderOptions::from_config(cfg, family, node));
                let mut by_port: HashMap<ServicePortName, Vec<IpvsService>> = HashMap::new();
                for vs in rendered.virtual_servers {
                    by_port.entry(vs.service.clone()).or_default().push(vs);
                }
                DesiredRules::Ipvs(by_port)
            }
        }
    }

    /// The rules of one port.
    pub fn of(&self, sps: &ServicePortState) -> Programmed {
        let sections = match self {
            DesiredRules::Iptables(ctx) => {
                let f = render_service(sps, ctx);
                let mut sections = by_chain("filter", &f.filter_rules);
                let nat = format!("{}{}{}", f.services_rules, f.nodeports_rules, f.chain_rules);
                sections.extend(by_chain("nat", &nat));
                sections
            }
            DesiredRules::Nftables(renderer, base, blocks) => {
                let mut table = (**base).clone();
                let port_blocks = blocks.get(&sps.port.name).copied();
                match table.apply_all(&renderer.service(sps, port_blocks).ops) {
                    Ok(()) => nftables::readback::sections(&table, &sps.port),
                    Err(_) => Vec::new(),
                }
            }
            DesiredRules::Ipvs(by_port) => by_port
                .get(&sps.port.name)
                .into_iter()
                .flatten()
                .map(|vs| ProgrammedSection {
                    place: vs.ipvsadm_line(),
                    lines: vs
                        .destinations
                        .iter()
                        .map(|d| ipvs::dataplane::real_server_text(d.address, d.port, d.weight))
                        .collect(),
                })
                .collect(),
        };
        Programmed { sections }
    }
}

/// `-A CHAIN …` lines grouped by chain, in order of first appearance.
fn by_chain(table: &str, text: &str) -> Vec<ProgrammedSection> {
    let mut out: Vec<ProgrammedSection> = Vec::new();
    for line in text.lines() {
        let Some(chain) = line.strip_prefix("-A ").and_then(|r| r.split_whitespace().next()) else {
            continue;
        };
        let place = format!("{table} {chain}");
        match out.iter_mut().find(|s| s.place == place) {
            Some(s) => s.lines.push(line.to_string()),
            None => out.push(ProgrammedSection {
                place,
                lines: vec![line.to_string()],
            }),
        }
    }
    out
}

/// A difference between what the mode should program for a port and what the kernel holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleDiff {
    /// `missing` (wanted, not in the kernel) or `extra` (in the kernel, not wanted: stale).
    pub kind: String,
    pub place: String,
    pub line: String,
}

/// What two lines must share to be the same rule, per mode: iptables rules compared by their
/// parsed matches and target (`iptables-save` orders and spells options its own way, and
/// prefixes counters), IPVS real servers without their connection counts, nftables rules as
/// the model prints them with their sets' items in one order.
pub fn canonical(mode: ProxyMode, place: &str, line: &str) -> String {
    match mode {
        ProxyMode::Iptables => {
            let table = place.split_whitespace().next().unwrap_or("");
            crate::iptables::trace::canonical_rule(line, table).unwrap_or_else(|| line.to_string())
        }
        ProxyMode::Ipvs => line.split(" active ").next().unwrap_or(line).to_string(),
        // Which numbers a port's blocks are is the proxier's bookkeeping (see `without_blocks`).
        ProxyMode::Nftables => nftables::readback::without_blocks(place, &nftables::readback::canonical_line(line)),
    }
}

/// The lines of `port` missing from `actual` and the extra ones in it, place by place.
pub fn compare(mode: ProxyMode, port: &ServicePort, desired: &Programmed, actual: &Programmed) -> Vec<RuleDiff> {
    let key = |s: &ProgrammedSection| place_key(mode, port, &s.place);
    let mut out = Vec::new();
    let lines_of = |p: &Programmed, place: &str| -> Vec<(String, String)> {
        p.sections
            .iter()
            .filter(|s| key(s) == place)
            .flat_map(|s| s.lines.iter().map(|l| (canonical(mode, &s.place, l), l.clone())))
            .collect()
    };
    let mut places: Vec<String> = Vec::new();
    for s in desired.sections.iter().chain(&actual.sections) {
        let k = key(s);
        if !places.contains(&k) {
            places.push(k);
        }
    }
    for place in places {
        let want = lines_of(desired, &place);
        let have = lines_of(actual, &place);
        // NodePort virtual servers the render put on no address (a Node object without
        // addresses): nothing to compare them with.
        if place.contains(" *:") && want.is_empty() && !desired.sections.iter().any(|s| key(s) == place) {
            continue;
        }
        let shown = |p: &Programmed| {
            p.sections
                .iter()
                .find(|s| key(s) == place)
                .map(|s| s.place.clone())
                .unwrap_or_else(|| place.clone())
        };
        for (c, line) in &want {
            if !have.iter().any(|(h, _)| h == c) {
                out.push(RuleDiff {
                    kind: "missing".into(),
                    place: shown(desired),
                    line: line.clone(),
                });
            }
        }
        for (c, line) in &have {
            // A draining IPVS real server (weight 0) is graceful termination, not a stale rule.
            let draining = mode == ProxyMode::Ipvs && c.ends_with(" weight 0");
            if !draining && !want.iter().any(|(w, _)| w == c) {
                out.push(RuleDiff {
                    kind: "extra".into(),
                    place: shown(actual),
                    line: line.clone(),
                });
            }
        }
    }
    out
}

/// Places compared as equal: IPVS NodePort virtual servers by protocol and port only (their
/// addresses are the node's interfaces, which the daemon lists and a render cannot know);
/// nftables' `service-endpoints-…` maps without their shard.
fn place_key(mode: ProxyMode, port: &ServicePort, place: &str) -> String {
    if mode == ProxyMode::Nftables {
        // A port's intervals are in one shard of `service-endpoints-…`, which by its block.
        return match place.rsplit_once(' ') {
            Some((kind, name)) => format!("{kind} {}", nftables::readback::without_shard(name)),
            None => place.to_string(),
        };
    }
    let mut words = place.split_whitespace();
    let (Some(proto), Some(addr), rest) = (words.next(), words.next(), words.collect::<Vec<_>>()) else {
        return place.to_string();
    };
    let Ok(sa) = addr.parse::<std::net::SocketAddr>() else {
        return place.to_string();
    };
    let service_address = std::iter::once(&port.cluster_ip)
        .chain(&port.external_ips)
        .chain(&port.load_balancer_vips)
        .any(|ip| *ip == sa.ip());
    if mode != ProxyMode::Ipvs || port.node_port == 0 || sa.port() != port.node_port || service_address {
        return place.to_string();
    }
    format!("{proto} *:{} {}", sa.port(), rest.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, testing};

    fn cfg(mode: ProxyMode) -> ProxyConfig {
        let flags = crate::config::Flags {
            hostname_override: Some("node-a".into()),
            proxy_mode: Some(mode.as_str().into()),
            cluster_cidr: Some("10.244.0.0/16".into()),
            ..crate::config::Flags::default()
        };
        ProxyConfig::resolve(&flags).expect("valid")
    }

    fn state() -> ProxyState {
        let mut web = testing::port("ns", "web", 1, Protocol::Tcp, &[1, 2]);
        web.port.node_port = 30001;
        testing::state(
            vec![web, testing::port("ns", "db", 2, Protocol::Tcp, &[3])],
            &["10.96.0.0/16"],
        )
    }

    #[test]
    fn each_mode_gives_the_ports_own_rules() {
        let st = state();
        let web = st
            .service_ports
            .iter()
            .find(|p| p.port.name.name == "web")
            .expect("web");
        for mode in [ProxyMode::Iptables, ProxyMode::Nftables, ProxyMode::Ipvs] {
            let d = DesiredRules::new(&cfg(mode), mode, &st).of(web);
            let text: Vec<String> = d.sections.iter().flat_map(|s| s.lines.clone()).collect();
            assert!(
                text.iter().any(|l| l.contains("10.244.1.1") && l.contains("8080")),
                "{mode:?}: {text:#?}"
            );
            assert!(
                !text.iter().any(|l| l.contains("10.244.1.3")),
                "{mode:?}: not db's: {text:#?}"
            );
            assert_eq!(compare(mode, &web.port, &d, &d), vec![], "{mode:?}");
        }
    }

    #[test]
    fn differences_are_missing_and_extra_lines() {
        let st = state();
        let web = &st.service_ports[1];
        let mode = ProxyMode::Iptables;
        let desired = DesiredRules::new(&cfg(mode), mode, &st).of(web);
        let mut actual = desired.clone();
        // As iptables-save prints it: counters, options in its own order.
        let sep = actual
            .sections
            .iter_mut()
            .find(|s| s.place.starts_with("nat KUBE-SEP-"))
            .expect("an endpoint chain");
        let chain = sep.place.trim_start_matches("nat ").to_string();
        sep.lines = vec![
            format!("[0:0] -A {chain} -s 10.244.1.1/32 -m comment --comment ns/web:p -j KUBE-MARK-MASQ"),
            format!(
                "[5:300] -A {chain} -p tcp -m comment --comment ns/web:p -m tcp -j DNAT --to-destination 10.244.1.9:8080"
            ),
        ];
        let diffs = compare(mode, &web.port, &desired, &actual);
        let kinds: Vec<(&str, bool)> = diffs
            .iter()
            .map(|d| (d.kind.as_str(), d.line.contains("10.244.1.9")))
            .collect();
        assert_eq!(kinds, vec![("missing", false), ("extra", true)], "{diffs:#?}");
    }

    #[test]
    fn ipvs_node_ports_compare_by_port() {
        let mut st = state();
        st.node.addresses = vec!["192.168.49.2".parse().unwrap()];
        let web = st.service_ports[1].clone();
        let mode = ProxyMode::Ipvs;
        let desired = DesiredRules::new(&cfg(mode), mode, &st).of(&web);
        let np = desired
            .sections
            .iter()
            .find(|s| s.place.contains("192.168.49.2:30001"))
            .expect("a NodePort VS");
        let mut actual = desired.clone();
        // The daemon put it on another interface address too; its counters are shown.
        let mut other = np.clone();
        other.place = np.place.replace("192.168.49.2", "10.244.1.1");
        actual.sections.push(other);
        for s in &mut actual.sections {
            s.lines = s.lines.iter().map(|l| format!("{l} active 3 inactive 0")).collect();
        }
        assert_eq!(compare(mode, &web.port, &desired, &actual), vec![]);
        actual.sections[0]
            .lines
            .push("-> 10.244.1.7:8080 Masq weight 0 active 0 inactive 1".into());
        assert_eq!(
            compare(mode, &web.port, &desired, &actual),
            vec![],
            "draining is not stale"
        );
        actual.sections[0]
            .lines
            .push("-> 10.244.1.8:8080 Masq weight 1 active 0 inactive 0".into());
        assert_eq!(compare(mode, &web.port, &desired, &actual).len(), 1);
    }
}
