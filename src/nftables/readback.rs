//! One service port's objects in a model of the `kube-proxy` table (rendered, or read back
//! from the kernel over netlink by [`super::proxier::NftBackend::read`]): its chains and the
//! endpoint chains they lead to, with their rules in knftables' text, and its elements in the
//! dispatch maps. Which chains and maps to read, and how to pick the port's part, is here,
//! pure; and the form in which two rule lines compare.

use super::ast::{ElemKey, family_keyword};
use super::names::TABLE;
use super::names::{
    ENDPOINT_PREFIX, FIREWALL_IPS, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, SERVICE_IPS, SERVICE_NODEPORTS,
    ServicePortChains,
};
use super::ruleset::Ruleset;
use crate::model::ServicePort;
use crate::proxy::ProgrammedSection;

/// The maps whose elements lead to a service port's chains or verdicts.
pub const DISPATCH_MAPS: [&str; 5] = [
    SERVICE_IPS, SERVICE_NODEPORTS, NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS, FIREWALL_IPS,
];

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
/// its chains and the endpoint chains they lead to, each rule in knftables' text, then its
/// elements of the dispatch maps (`key : verdict`). Direct lookups: cheap for every port of
/// a large table.
pub fn sections(ruleset: &Ruleset, port: &ServicePort) -> Vec<ProgrammedSection> {
    let family = ruleset.family;
    let place = |kind: &str, name: &str| format!("{} {TABLE} {kind} {name}", family_keyword(family));
    let mut out = Vec::new();
    let mut chains = own_chains(port);
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
        }
        out.push(ProgrammedSection {
            place: place("chain", &name),
            lines: chain.rules.iter().map(|r| r.text(family)).collect(),
        });
    }
    let keys = element_keys(port);
    for map in DISPATCH_MAPS {
        let Some(set) = ruleset.sets.get(map) else {
            continue;
        };
        let lines: Vec<String> = keys
            .iter()
            .filter_map(|k| set.elements.get(k))
            .map(|e| match &e.value {
                Some(v) => format!("{} : {v}", e.key),
                None => e.key.to_string(),
            })
            .collect();
        if !lines.is_empty() {
            out.push(ProgrammedSection {
                place: place("map", map),
                lines,
            });
        }
    }
    out
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
    fn picks_the_ports_elements_and_endpoint_chains() {
        let port = web();
        let mut sps = crate::model::testing::port("default", "web", 10, Protocol::Tcp, &[1, 2]);
        sps.port = port.clone();
        let other = crate::model::testing::port("default", "db", 11, Protocol::Tcp, &[3]);
        let state = crate::model::testing::state(vec![sps, other], &[]);
        let tx = super::super::render::render_tx(&state, &crate::proxy::RenderOptions::default(), true);
        let table = Ruleset::from_transaction(&tx).expect("applies");
        let sections = sections(&table, &port);
        let places: Vec<&str> = sections.iter().map(|s| s.place.as_str()).collect();
        assert!(places[0].starts_with("ip kube-proxy chain service-"), "{places:?}");
        assert_eq!(
            places.iter().filter(|p| p.contains("chain endpoint-")).count(),
            2,
            "{places:?}"
        );
        let maps: Vec<&ProgrammedSection> = sections.iter().filter(|s| s.place.contains(" map ")).collect();
        let elements: Vec<&String> = maps.iter().flat_map(|s| &s.lines).collect();
        assert!(
            elements
                .iter()
                .any(|e| e.starts_with("10.96.165.10 . tcp . 80 : goto service-")),
            "{elements:?}"
        );
        assert!(
            elements.iter().any(|e| e.starts_with("tcp . 32517 : goto external-")),
            "{elements:?}"
        );
        assert!(
            !elements.iter().any(|e| e.contains("10.96.0.11")),
            "not db's: {elements:?}"
        );
        let lines = vec!["numgen random mod 2 vmap { 0 : goto endpoint-B , 1 : goto endpoint-C }".to_string()];
        assert_eq!(endpoint_chains(&lines), vec!["endpoint-B", "endpoint-C"]);
    }
}
