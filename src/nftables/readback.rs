//! Reading back one service port's objects from the `kube-proxy` table: its chains (and the
//! endpoint chains they lead to) and its elements in the dispatch maps, as `nft list` prints
//! them. The listing itself is the backend's ([`super::proxier::NftBackend::list`]); what to
//! list and how to pick the port's lines out of a listing is here, pure.

use super::ast::{ElemKey, family_keyword};
use super::names::TABLE;
use super::names::{
    ENDPOINT_PREFIX, FIREWALL_IPS, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, SERVICE_IPS, SERVICE_NODEPORTS,
    ServicePortChains,
};
use super::ruleset::Ruleset;
use crate::model::ServicePort;
use crate::proxy::ProgrammedSection;

/// An object of the table that `nft list` can print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NftObject {
    Chain(String),
    Map(String),
}

impl NftObject {
    /// `chain NAME` / `map NAME`, as `nft list` takes it.
    pub fn kind(&self) -> &'static str {
        match self {
            NftObject::Chain(_) => "chain",
            NftObject::Map(_) => "map",
        }
    }

    pub fn name(&self) -> &str {
        match self {
            NftObject::Chain(n) | NftObject::Map(n) => n,
        }
    }
}

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

/// The rule lines of a `nft list chain` output (without the table and chain framing).
pub fn chain_lines(listing: &str) -> Vec<String> {
    listing
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && *l != "}" && !l.starts_with("table ") && !l.starts_with("chain "))
        .map(str::to_string)
        .collect()
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

/// The elements (`key : verdict`) of a `nft list map` output.
pub fn map_elements(listing: &str) -> Vec<String> {
    let Some(start) = listing.find("elements = {") else {
        return Vec::new();
    };
    let body = &listing[start + "elements = {".len()..];
    let body = body.split('}').next().unwrap_or("");
    body.split(',')
        .map(|e| e.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|e| !e.is_empty())
        .collect()
}

/// Whether a map element belongs to `port`: its key is one of the port's addresses and ports,
/// or its verdict leads to one of the port's chains.
pub fn element_of(element: &str, port: &ServicePort, chains: &[String]) -> bool {
    let (key, verdict) = element.split_once(" : ").unwrap_or((element, ""));
    if verdict.split_whitespace().any(|w| chains.iter().any(|c| c == w)) {
        return true;
    }
    let proto = port.protocol.lower();
    let addresses = std::iter::once(&port.cluster_ip)
        .chain(&port.external_ips)
        .chain(&port.load_balancer_vips);
    let mut keys: Vec<String> = addresses.map(|ip| format!("{ip} . {proto} . {}", port.port)).collect();
    if port.node_port != 0 {
        keys.push(format!("{proto} . {}", port.node_port));
    }
    keys.iter().any(|k| k == key.trim())
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
    fn picks_the_ports_elements_and_endpoint_chains() {
        let port = web();
        let chains = own_chains(&port);
        let listing = format!(
            "table ip kube-proxy {{\n\tmap service-ips {{\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\t\t\
             elements = {{ 10.96.165.10 . tcp . 80 : goto {},\n\t\t\t     10.96.0.1 . tcp . 443 : goto service-X }}\n\t}}\n}}\n",
            chains[0]
        );
        let elements = map_elements(&listing);
        assert_eq!(elements.len(), 2);
        let ours: Vec<&String> = elements.iter().filter(|e| element_of(e, &port, &chains)).collect();
        assert_eq!(ours.len(), 1);
        assert!(ours[0].starts_with("10.96.165.10 . tcp . 80"));
        assert!(
            element_of("tcp . 32517 : goto external-Y", &port, &chains),
            "by NodePort key"
        );

        let chain = "table ip kube-proxy {\n\tchain service-A {\n\t\tnumgen random mod 2 vmap { 0 : goto endpoint-B, 1 : goto endpoint-C }\n\t}\n}\n";
        let lines = chain_lines(chain);
        assert_eq!(lines.len(), 1);
        assert_eq!(endpoint_chains(&lines), vec!["endpoint-B", "endpoint-C"]);
    }
}
