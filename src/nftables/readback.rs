//! One service port's objects in a model of the `kube-proxy` table (rendered, or read back
//! from the kernel over netlink by [`super::backend::NftBackend::read`]): its chains and the
//! endpoint chains they lead to (session affinity), with their rules in knftables' text; its
//! elements in the dispatch maps and the reject sets; its endpoints' intervals in the
//! `service-endpoints-…` maps (the numbers its chains' `numgen` draws) and their
//! `hairpin-endpoints` elements. Which chains and maps to read, and how to pick the port's
//! part, is here, pure; and the form in which two rule lines compare.

use std::net::IpAddr;

use super::ast::{ElemKey, ElemValue, Element, Statement, family_keyword};
use super::names::TABLE;
use super::names::{
    ENDPOINT_PREFIX, FIREWALL_IPS, HAIRPIN_ENDPOINTS, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, REJECT_NODEPORTS,
    REJECT_SERVICES, SERVICE_IPS, SERVICE_NODEPORTS, ServicePortChains, is_service_endpoints,
};
use super::ruleset::Ruleset;
use crate::model::ServicePort;
use crate::proxy::ProgrammedSection;

/// The maps whose elements lead to a service port's chains or verdicts.
pub const DISPATCH_MAPS: [&str; 5] = [
    SERVICE_IPS, SERVICE_NODEPORTS, NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS, FIREWALL_IPS,
];

/// The sets and maps whose elements [`sections`] picks by key (besides the
/// `service-endpoints-…` maps the port's rules name).
pub fn element_sets() -> impl Iterator<Item = &'static str> {
    DISPATCH_MAPS
        .into_iter()
        .chain([REJECT_SERVICES, REJECT_NODEPORTS, HAIRPIN_ENDPOINTS])
}

/// The `service-endpoints-…` map a rule line looks up, if any.
fn endpoint_map(line: &str) -> Option<&str> {
    let (_, map) = line.rsplit_once(" map @")?;
    is_service_endpoints(map).then_some(map)
}

/// The `service-endpoints-…` maps that rule lines (`nft list` text) look up.
pub fn endpoint_maps(lines: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for map in lines.iter().filter_map(|l| endpoint_map(l)) {
        if !out.iter().any(|o| o == map) {
            out.push(map.to_string());
        }
    }
    out
}

/// The chains of `port` that exist in every layout (the endpoint chains come from what they
/// jump to, see [`endpoint_chains`]).
pub fn own_chains(port: &ServicePort) -> Vec<String> {
    let n = &port.name;
    let c = ServicePortChains::new(&n.namespace, &n.name, port.protocol.lower(), &n.port);
    vec![c.cluster, c.local, c.external, c.firewall]
}

/// The endpoint chains that rule lines jump or go to.
pub fn endpoint_chains(lines: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for word in lines.iter().flat_map(|l| l.split([' ', ',', '{', '}'])) {
        if word.starts_with(ENDPOINT_PREFIX) && !out.iter().any(|o| o == word) {
            out.push(word.to_string());
        }
    }
    out
}

/// A rule line with the items of its anonymous sets merged, sorted and spaced one way
/// (`{ a,b }`, a single item bare): the kernel keeps a set's intervals, not the order, the
/// spacing or the braces they were written with.
pub fn canonical_line(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find("{ ") {
        let Some(len) = rest[start..].find(" }") else {
            break;
        };
        out.push_str(&rest[..start]);
        let inner = &rest[start + 2..start + len];
        let mut items: Vec<String> = inner.split(',').map(|i| i.trim().to_string()).collect();
        let nets: Option<Vec<ipnet::IpNet>> = items
            .iter()
            .map(|i| {
                i.parse::<ipnet::IpNet>()
                    .ok()
                    .or_else(|| i.parse::<std::net::IpAddr>().ok().map(Into::into))
            })
            .collect();
        // Addresses as the fewest CIDRs (the kernel keeps merged intervals); a verdict map's
        // entries (`0 : goto a`) keep their order.
        if let Some(nets) = nets {
            items = ipnet::IpNet::aggregate(&nets)
                .iter()
                .map(super::ast::net_text)
                .collect();
            items.sort_unstable();
        }
        // `{ x }` is `x` (nft sends a one-item set as a comparison).
        if items.len() == 1 && !inner.contains(" : ") {
            out.push_str(&items[0]);
        } else {
            out.push_str("{ ");
            out.push_str(&items.join(","));
            out.push_str(" }");
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// A `service-endpoints-…` map's name without its shard number (`service-endpoints-tcp`);
/// other names as they are.
pub fn without_shard(name: &str) -> &str {
    match name.rsplit_once('-') {
        Some((base, n)) if is_service_endpoints(name) && n.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => name,
    }
}

/// A line of a port's section in the form that does not depend on which numbers its blocks
/// are (a proxier allocates them as Services come and go; a render of the state in order
/// cannot know them): `numgen … offset N` without the offset, `@service-endpoints-tcp-07`
/// without the shard, and an interval `first-last : VALUE` of a `service-endpoints-…` map as
/// its size (`18480 : 10.244.1.5 . 8080`).
pub fn without_blocks(place: &str, line: &str) -> String {
    let in_map = place.rsplit(' ').next().is_some_and(is_service_endpoints);
    if in_map && let Some((key, value)) = line.split_once(" : ") {
        let (lo, hi) = key.split_once('-').unwrap_or((key, key));
        if let (Ok(lo), Ok(hi)) = (lo.parse::<u64>(), hi.parse::<u64>()) {
            return format!("{} : {value}", hi.saturating_sub(lo) + 1);
        }
    }
    let mut words: Vec<String> = Vec::new();
    let mut it = line.split(' ').peekable();
    while let Some(w) = it.next() {
        if w == "offset" && it.peek().is_some_and(|n| n.parse::<u32>().is_ok()) {
            it.next();
            continue;
        }
        words.push(match w.strip_prefix('@') {
            Some(set) => format!("@{}", without_shard(set)),
            None => w.to_string(),
        });
    }
    words.join(" ")
}

/// The keys of `port`'s elements in the dispatch maps: each of its addresses with its
/// protocol and port, and its NodePort.
pub fn element_keys(port: &ServicePort) -> Vec<ElemKey> {
    let addresses = std::iter::once(&port.cluster_ip)
        .chain(&port.external_ips)
        .chain(&port.load_balancer_vips);
    let mut keys: Vec<ElemKey> = addresses
        .map(|ip| ElemKey::AddrProtoPort(*ip, port.protocol, port.port))
        .collect();
    if port.node_port != 0 {
        keys.push(ElemKey::ProtoPort(port.protocol, port.node_port));
    }
    keys
}

/// The sections of `port` in a model of the table (rendered, or read back from the kernel):
/// its chains and the endpoint chains they lead to, each rule in knftables' text; its
/// elements of the dispatch maps (`key : verdict`) and of the reject sets; the intervals of
/// the `service-endpoints-…` maps within the numbers its chains draw (`first-last : ADDR .
/// PORT`), and the `hairpin-endpoints` elements of those endpoints. Direct lookups (a
/// `service-endpoints-…` map is one shard of a protocol's): cheap for every port of a large
/// table.
pub fn sections(ruleset: &Ruleset, port: &ServicePort) -> Vec<ProgrammedSection> {
    sections_and_endpoints(ruleset, port).0
}

/// The keys of `port`'s `hairpin-endpoints` elements: one per endpoint address among its
/// intervals of the `service-endpoints-…` maps in `ruleset`.
pub fn hairpin_keys(ruleset: &Ruleset, port: &ServicePort) -> Vec<ElemKey> {
    let (_, endpoints) = sections_and_endpoints(ruleset, port);
    endpoints.into_iter().map(|ip| ElemKey::AddrPair(ip, ip)).collect()
}

/// [`sections`], and the endpoint addresses of the port's intervals.
fn sections_and_endpoints(ruleset: &Ruleset, port: &ServicePort) -> (Vec<ProgrammedSection>, Vec<IpAddr>) {
    let family = ruleset.family;
    let place = |kind: &str, name: &str| format!("{} {TABLE} {kind} {name}", family_keyword(family));
    let line = |e: &Element| match &e.value {
        Some(v) => format!("{} : {v}", e.key),
        None => e.key.to_string(),
    };
    let mut out = Vec::new();
    let mut chains = own_chains(port);
    // (map, first, last) of each `dnat to numgen … map @service-endpoints-…`.
    let mut blocks: Vec<(String, u32, u32)> = Vec::new();
    let mut i = 0;
    while i < chains.len() {
        let name = chains[i].clone();
        i += 1;
        let Some(chain) = ruleset.chains.get(&name) else {
            continue;
        };
        for rule in &chain.rules {
            for t in rule.targets() {
                if t.starts_with(ENDPOINT_PREFIX) && !chains.iter().any(|c| c == t) {
                    chains.push(t.to_string());
                }
            }
            if let Statement::DnatNumgenMap { modulus, offset, map } = &rule.statement
                && *modulus > 0
            {
                blocks.push((map.clone(), *offset, offset.saturating_add(modulus - 1)));
            }
        }
        out.push(ProgrammedSection {
            place: place("chain", &name),
            lines: chain.rules.iter().map(|r| r.text(family)).collect(),
        });
    }
    let keys = element_keys(port);
    let keyed = DISPATCH_MAPS
        .iter()
        .map(|m| ("map", *m))
        .chain([REJECT_SERVICES, REJECT_NODEPORTS].map(|s| ("set", s)));
    for (kind, name) in keyed {
        let Some(set) = ruleset.sets.get(name) else {
            continue;
        };
        let lines: Vec<String> = keys.iter().filter_map(|k| set.elements.get(k)).map(line).collect();
        if !lines.is_empty() {
            out.push(ProgrammedSection {
                place: place(kind, name),
                lines,
            });
        }
    }
    let mut endpoints: Vec<IpAddr> = Vec::new();
    let mut maps: Vec<&str> = Vec::new();
    for (m, ..) in &blocks {
        if !maps.contains(&m.as_str()) {
            maps.push(m);
        }
    }
    for map in maps {
        let Some(set) = ruleset.sets.get(map) else {
            continue;
        };
        // Intervals sort by their low end: look up each block's (a map holds every port's).
        let mut ours: Vec<&Element> = blocks
            .iter()
            .filter(|(m, ..)| m == map)
            .flat_map(|(_, a, b)| {
                set.elements
                    .range(ElemKey::Range(*a, 0)..=ElemKey::Range(*b, u32::MAX))
                    .filter(|(k, _)| matches!(k, ElemKey::Range(_, hi) if hi <= b))
                    .map(|(_, e)| e)
            })
            .collect();
        ours.sort_by(|x, y| x.key.cmp(&y.key));
        ours.dedup_by(|x, y| x.key == y.key);
        for e in &ours {
            if let Some(ElemValue::AddrPort(sa)) = &e.value
                && !endpoints.contains(&sa.ip())
            {
                endpoints.push(sa.ip());
            }
        }
        if !ours.is_empty() {
            out.push(ProgrammedSection {
                place: place("map", map),
                lines: ours.into_iter().map(line).collect(),
            });
        }
    }
    if let Some(set) = ruleset.sets.get(HAIRPIN_ENDPOINTS) {
        let lines: Vec<String> = endpoints
            .iter()
            .filter_map(|ip| set.elements.get(&ElemKey::AddrPair(*ip, *ip)))
            .map(line)
            .collect();
        if !lines.is_empty() {
            out.push(ProgrammedSection {
                place: place("set", HAIRPIN_ENDPOINTS),
                lines,
            });
        }
    }
    (out, endpoints)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, ServicePortName};

    fn web() -> ServicePort {
        let name = ServicePortName {
            namespace: "default".into(),
            name: "web".into(),
            port: "http".into(),
            protocol: Protocol::Tcp,
        };
        let mut p = ServicePort::cluster_ip(name, "10.96.165.10".parse().unwrap(), 80);
        p.node_port = 32517;
        p
    }

    #[test]
    fn set_items_compare_in_any_order_and_spacing() {
        let a = canonical_line("ip saddr != { 198.51.100.0/24 , 192.0.2.0/25 } drop");
        assert_eq!(a, canonical_line("ip saddr != { 192.0.2.0/25,198.51.100.0/24 } drop"));
        assert_eq!(a, "ip saddr != { 192.0.2.0/25,198.51.100.0/24 } drop");
        let m = "numgen random mod 2 vmap { 0 : goto b , 1 : goto a }";
        assert_eq!(canonical_line(m), "numgen random mod 2 vmap { 0 : goto b,1 : goto a }");
        assert_eq!(
            canonical_line("ip saddr { 10.0.0.1 , 10.0.0.0 , 10.9.0.0/16 }"),
            canonical_line("ip saddr { 10.0.0.0/31,10.9.0.0/16 }"),
            "adjacent items merge as the kernel's intervals do"
        );
        assert_eq!(
            canonical_line("ip saddr != { 10.0.0.0/8 } drop"),
            "ip saddr != 10.0.0.0/8 drop"
        );
    }

    #[test]
    fn picks_the_ports_elements_and_endpoint_intervals() {
        let port = web();
        let mut sps = crate::model::testing::port("default", "web", 10, Protocol::Tcp, &[1, 2]);
        sps.port = port.clone();
        let other = crate::model::testing::port("default", "db", 11, Protocol::Tcp, &[3]);
        let empty = crate::model::testing::port("default", "none", 12, Protocol::Tcp, &[]);
        let mut sticky = crate::model::testing::port("default", "sticky", 13, Protocol::Tcp, &[4, 5]);
        sticky.port.session_affinity_timeout = Some(60);
        let state = crate::model::testing::state(vec![sps, other, empty.clone(), sticky.clone()], &[]);
        let tx = super::super::render::render_tx(&state, &crate::proxy::RenderOptions::default(), true);
        let table = Ruleset::from_transaction(&tx).expect("applies");
        let sections = sections(&table, &port);
        let places: Vec<&str> = sections.iter().map(|s| s.place.as_str()).collect();
        assert!(places[0].starts_with("ip kube-proxy chain service-"), "{places:?}");
        assert!(!places.iter().any(|p| p.contains("chain endpoint-")), "{places:?}");
        let lines = |prefix: &str| -> Vec<String> {
            sections
                .iter()
                .filter(|s| s.place.starts_with(prefix))
                .flat_map(|s| s.lines.clone())
                .collect()
        };
        let maps = lines("ip kube-proxy map service-ips");
        assert!(
            maps.iter()
                .any(|e| e.starts_with("10.96.165.10 . tcp . 80 : goto service-")),
            "{maps:?}"
        );
        assert!(
            lines("ip kube-proxy map service-nodeports")
                .iter()
                .any(|e| e.starts_with("tcp . 32517 : goto external-")),
            "{sections:?}"
        );
        // Its endpoints' intervals of the numbers its chain draws, and their hairpin elements.
        let intervals = lines("ip kube-proxy map service-endpoints-tcp-");
        assert_eq!(intervals.len(), 2, "{intervals:?}");
        assert!(
            intervals
                .iter()
                .all(|l| l.contains(" : 10.244.1.1 . 8080") || l.contains(" : 10.244.1.2 . 8080"))
        );
        assert_eq!(
            lines("ip kube-proxy set hairpin-endpoints"),
            vec!["10.244.1.1 . 10.244.1.1", "10.244.1.2 . 10.244.1.2"]
        );
        let all: Vec<&String> = sections.iter().flat_map(|s| &s.lines).collect();
        assert!(
            !all.iter().any(|e| e.contains("10.96.0.11") || e.contains("10.244.1.3")),
            "not db's: {all:?}"
        );

        // No endpoints: the reject set's element.
        let none = super::sections(&table, &empty.port);
        assert!(
            none.iter().any(|s| s.place == "ip kube-proxy set reject-services"
                && s.lines == vec!["10.96.0.12 . tcp . 80".to_string()]),
            "{none:?}"
        );
        // Session affinity: a chain per endpoint.
        let sticky = super::sections(&table, &sticky.port);
        assert_eq!(
            sticky.iter().filter(|s| s.place.contains("chain endpoint-")).count(),
            2,
            "{sticky:?}"
        );

        let lines = vec!["numgen random mod 2 vmap { 0 : goto endpoint-B , 1 : goto endpoint-C }".to_string()];
        assert_eq!(endpoint_chains(&lines), vec!["endpoint-B", "endpoint-C"]);
        let place = "ip kube-proxy map service-endpoints-tcp-07";
        assert_eq!(
            without_blocks(place, "110880-129359 : 10.244.1.5 . 8080"),
            "18480 : 10.244.1.5 . 8080"
        );
        assert_eq!(
            without_blocks(
                "ip kube-proxy chain service-A",
                "meta l4proto tcp dnat ip to numgen random mod 55440 offset 110880 map @service-endpoints-tcp-07"
            ),
            "meta l4proto tcp dnat ip to numgen random mod 55440 map @service-endpoints-tcp"
        );
        assert_eq!(without_shard("service-endpoints-udp-63"), "service-endpoints-udp");
        assert_eq!(without_shard("service-ips"), "service-ips");
        let listed = vec![
            "meta l4proto tcp dnat ip to numgen random mod 55440 offset 110880 map @service-endpoints-tcp-07"
                .to_string(),
        ];
        assert_eq!(endpoint_maps(&listed), vec!["service-endpoints-tcp-07"]);
    }
}
