//! Reading back one service port's objects from the `kube-proxy` table: its chains (and the
//! endpoint chains they lead to), its elements in the dispatch maps and sets, and its
//! endpoints' intervals in `service-endpoints-…` (the numbers its chains' `numgen` draws), as
//! `nft list` prints them. The listing itself is the backend's ([`super::proxier::NftBackend::list`]); what to
//! list and how to pick the port's lines out of a listing is here, pure.

use super::names::{
    ENDPOINT_PREFIX, FIREWALL_IPS, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, REJECT_NODEPORTS, REJECT_SERVICES,
    SERVICE_IPS, SERVICE_NODEPORTS, ServicePortChains, is_service_endpoints,
};
use crate::model::ServicePort;

/// An object of the table that `nft list` can print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NftObject {
    Chain(String),
    Map(String),
    Set(String),
}

impl NftObject {
    /// `chain NAME` / `map NAME`, as `nft list` takes it.
    pub fn kind(&self) -> &'static str {
        match self {
            NftObject::Chain(_) => "chain",
            NftObject::Map(_) => "map",
            NftObject::Set(_) => "set",
        }
    }

    pub fn name(&self) -> &str {
        match self {
            NftObject::Chain(n) | NftObject::Map(n) | NftObject::Set(n) => n,
        }
    }
}

/// The maps whose elements lead to a service port's chains or verdicts.
pub const DISPATCH_MAPS: [&str; 5] = [
    SERVICE_IPS, SERVICE_NODEPORTS, NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS, FIREWALL_IPS,
];

/// The maps and sets that hold a service port's elements: the dispatch maps, the reject
/// sets, and `endpoint_maps`, the `service-endpoints-…` maps its chains look up (see
/// [`endpoint_maps`]).
pub fn dispatch_objects(endpoint_maps: &[String]) -> Vec<NftObject> {
    let maps = DISPATCH_MAPS
        .iter()
        .map(|m| m.to_string())
        .chain(endpoint_maps.iter().cloned())
        .map(NftObject::Map);
    let sets = [REJECT_SERVICES, REJECT_NODEPORTS].map(|s| NftObject::Set(s.to_string()));
    maps.chain(sets).collect()
}

/// The `service-endpoints-…` map a rule line looks up, if any.
fn endpoint_map(line: &str) -> Option<&str> {
    let (_, map) = line.rsplit_once(" map @")?;
    is_service_endpoints(map).then_some(map)
}

/// The `service-endpoints-…` maps that rule lines look up.
pub fn endpoint_maps(lines: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for map in lines.iter().filter_map(|l| endpoint_map(l)) {
        if !out.iter().any(|o| o == map) {
            out.push(map.to_string());
        }
    }
    out
}

/// The numbers (first, last) that rule lines draw with `numgen random mod M [offset O]`
/// to look up in a `service-endpoints-…` map.
pub fn numgen_blocks(lines: &[String]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for line in lines.iter().filter(|l| endpoint_map(l).is_some()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let after = |key: &str| {
            words
                .iter()
                .position(|w| *w == key)
                .and_then(|i| words.get(i + 1))
                .and_then(|w| w.parse::<u32>().ok())
        };
        if let Some(modulus) = after("mod").filter(|m| *m > 0) {
            let offset = after("offset").unwrap_or(0);
            out.push((offset, offset.saturating_add(modulus - 1)));
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

/// Whether a map or set element belongs to `port`: its key is one of the port's addresses
/// and ports, its verdict leads to one of the port's chains, or it is an interval of numbers
/// within one of the port's `blocks` (see [`numgen_blocks`]).
pub fn element_of(element: &str, port: &ServicePort, chains: &[String], blocks: &[(u32, u32)]) -> bool {
    let (key, verdict) = element.split_once(" : ").unwrap_or((element, ""));
    if verdict.split_whitespace().any(|w| chains.iter().any(|c| c == w)) {
        return true;
    }
    let (lo, hi) = key.trim().split_once('-').unwrap_or((key.trim(), key.trim()));
    if let (Ok(lo), Ok(hi)) = (lo.parse::<u32>(), hi.parse::<u32>()) {
        return blocks.iter().any(|(a, b)| *a <= lo && hi <= *b);
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
        let ours: Vec<&String> = elements.iter().filter(|e| element_of(e, &port, &chains, &[])).collect();
        assert_eq!(ours.len(), 1);
        assert!(ours[0].starts_with("10.96.165.10 . tcp . 80"));
        assert!(
            element_of("tcp . 32517 : goto external-Y", &port, &chains, &[]),
            "by NodePort key"
        );

        // Endpoints chosen through service-endpoints-tcp: the intervals of the chain's block.
        let lines = chain_lines(
            "table ip kube-proxy {\n\tchain service-A {\n\t\tmeta l4proto tcp dnat ip to numgen random mod 55440 offset 110880 map @service-endpoints-tcp-07\n\t}\n}\n",
        );
        let blocks = numgen_blocks(&lines);
        assert_eq!(blocks, vec![(110880, 166319)]);
        let listing = "table ip kube-proxy {\n\tmap service-endpoints-tcp-07 {\n\t\ttypeof numgen random mod 55440 : ip daddr . tcp dport\n\t\tflags interval\n\t\t\
             elements = { 0-55439 : 10.0.0.1 . 80, 110880-138599 : 10.244.1.5 . 8080,\n\t\t\t     138600-166319 : 10.244.2.7 . 8080 }\n\t}\n}\n";
        let ours: Vec<String> = map_elements(listing)
            .into_iter()
            .filter(|e| element_of(e, &port, &chains, &blocks))
            .collect();
        assert_eq!(
            ours,
            vec!["110880-138599 : 10.244.1.5 . 8080", "138600-166319 : 10.244.2.7 . 8080"]
        );
        assert_eq!(
            numgen_blocks(&["dnat ip to numgen random mod 55440 map @service-endpoints-udp-00".into()]),
            vec![(0, 55439)]
        );
        assert!(dispatch_objects(&[]).contains(&NftObject::Set(REJECT_SERVICES.into())));
        assert_eq!(endpoint_maps(&lines), vec!["service-endpoints-tcp-07"]);
        assert!(dispatch_objects(&endpoint_maps(&lines)).contains(&NftObject::Map("service-endpoints-tcp-07".into())));

        let chain = "table ip kube-proxy {\n\tchain service-A {\n\t\tnumgen random mod 2 vmap { 0 : goto endpoint-B, 1 : goto endpoint-C }\n\t}\n}\n";
        let lines = chain_lines(chain);
        assert_eq!(lines.len(), 1);
        assert_eq!(endpoint_chains(&lines), vec!["endpoint-B", "endpoint-C"]);
    }
}
