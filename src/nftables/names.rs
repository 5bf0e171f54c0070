//! Object names of the nftables dataplane, byte-identical to upstream's nftables proxier:
//! the fixed chains/sets/maps of the `kube-proxy` table, and the per-service / per-endpoint
//! chains and affinity sets named `PREFIX-HASH8-ns/name/proto/port[__ip/port]`
//! (`hashAndTruncate`, `servicePortChainNameBase`, `servicePortEndpointChainNameBase`).

use crate::model::Protocol;
use std::net::IpAddr;

use data_encoding::BASE32;
use sha2::{Digest, Sha256};

/// Our table (in family `ip` or `ip6`).
pub const TABLE: &str = "kube-proxy";

// Base chains.
pub const FILTER_PREROUTING_PRE_DNAT: &str = "filter-prerouting-pre-dnat";
pub const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
pub const FILTER_INPUT: &str = "filter-input";
pub const FILTER_FORWARD: &str = "filter-forward";
pub const FILTER_OUTPUT: &str = "filter-output";
pub const NAT_PREROUTING: &str = "nat-prerouting";
pub const NAT_OUTPUT: &str = "nat-output";
pub const NAT_POSTROUTING: &str = "nat-postrouting";

// Service dispatch.
pub const SERVICES: &str = "services";
pub const SERVICE_IPS: &str = "service-ips";
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const CLUSTER_IPS: &str = "cluster-ips";

// Services without endpoints: `drop` verdicts in the maps, rejects by the sets (plain
// elements: no verdict element with a jump, which would make the kernel validate the table).
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const REJECT_SERVICES: &str = "reject-services";
pub const REJECT_NODEPORTS: &str = "reject-nodeports";
/// Upstream's helper chain for rejects; we create none, but delete one left by an earlier
/// layout (or by upstream's kube-proxy).
pub const REJECT_CHAIN: &str = "reject-chain";

// Endpoint selection without a chain per endpoint.
/// `numgen` number → endpoint `address . port` (see `blocks`): maps `service-endpoints-PROTO-NN`.
/// - One set of maps per protocol: nft 1.0.6 cannot re-read a rule whose `dnat` takes its port
///   from a map typed `th dport` (it reports "conflicting protocols"), so each map's data is
///   typed by its protocol's `dport`.
/// - [`SERVICE_ENDPOINTS_SHARDS`] maps per protocol, a selection's by its block: the kernel
///   checks every element added to a map against every rule that looks the map up (measured:
///   20,000 intervals take 0.7 s into a map of 10 such rules, 3.7 s into one of 5,000), so
///   one map for 10,000 service chains made a cold sync quadratic (49 s at 10k × 10).
pub const SERVICE_ENDPOINTS_SHARDS: u32 = 64;
const PROTOCOLS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

static SERVICE_ENDPOINTS_NAMES: std::sync::LazyLock<Vec<(String, Protocol)>> = std::sync::LazyLock::new(|| {
    PROTOCOLS
        .iter()
        .flat_map(|p| {
            (0..SERVICE_ENDPOINTS_SHARDS).map(move |n| (format!("service-endpoints-{}-{n:02}", p.lower()), *p))
        })
        .collect()
});

/// Every `service-endpoints-…` map, with its protocol.
pub fn service_endpoints_maps() -> impl Iterator<Item = (&'static str, Protocol)> {
    SERVICE_ENDPOINTS_NAMES.iter().map(|(n, p)| (n.as_str(), *p))
}

/// The `service-endpoints-…` map of a protocol that holds the selection of block `block`.
pub fn service_endpoints(protocol: Protocol, block: u32) -> &'static str {
    let p = PROTOCOLS.iter().position(|q| *q == protocol).unwrap_or(0);
    let i = p * SERVICE_ENDPOINTS_SHARDS as usize + (block % SERVICE_ENDPOINTS_SHARDS) as usize;
    SERVICE_ENDPOINTS_NAMES[i].0.as_str()
}

/// Whether `name` is one of the `service-endpoints-…` maps.
pub fn is_service_endpoints(name: &str) -> bool {
    name.starts_with("service-endpoints-")
}

/// `endpoint . endpoint` of every endpoint chosen through a `service-endpoints-…` map: a
/// connection DNATed to its own source is masqueraded (hairpin).
pub const HAIRPIN_ENDPOINTS: &str = "hairpin-endpoints";

/// Traffic to unallocated ClusterIPs and undefined ports of ClusterIPs.
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";

// loadBalancerSourceRanges.
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const FIREWALL_CHECK: &str = "firewall-check";

// Masquerading.
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
pub const MASQUERADING: &str = "masquerading";

pub const SERVICE_PREFIX: &str = "service-";
pub const LOCAL_PREFIX: &str = "local-";
pub const EXTERNAL_PREFIX: &str = "external-";
pub const FIREWALL_PREFIX: &str = "firewall-";
pub const ENDPOINT_PREFIX: &str = "endpoint-";
pub const AFFINITY_PREFIX: &str = "affinity-";

/// knftables' `NameLengthMax` (256) minus the longest prefix (16).
pub const CHAIN_NAME_BASE_LENGTH_MAX: usize = 256 - 16;

/// knftables' `CommentLengthMax`: the longest comment nft and the kernel take on an element.
pub const COMMENT_LENGTH_MAX: usize = 128;

/// A comment cut to [`COMMENT_LENGTH_MAX`] bytes, as upstream cuts a Service's name string
/// (kubernetes#139515: a namespace and a name of 63 characters each make a longer one, and
/// the kernel then refuses the whole transaction).
pub fn comment(text: &str) -> String {
    let mut cut = text.len().min(COMMENT_LENGTH_MAX);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text[..cut].to_string()
}

/// Upstream's `hashAndTruncate`: `HASH8-name`, cut to 240 bytes ending in `...`.
pub fn hash_and_truncate(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let encoded = BASE32.encode(&digest);
    let mut out = format!("{}-{name}", &encoded[..8]);
    if out.len() > CHAIN_NAME_BASE_LENGTH_MAX {
        // Names are ASCII (validated by the model), so byte truncation is char-safe; fall
        // back to the nearest char boundary anyway.
        let mut cut = CHAIN_NAME_BASE_LENGTH_MAX - 3;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// `HASH8-ns/name/proto/portName` (a trailing `/` for an unnamed port).
pub fn service_port_chain_name_base(namespace: &str, name: &str, protocol_lower: &str, port_name: &str) -> String {
    hash_and_truncate(&format!("{namespace}/{name}/{protocol_lower}/{port_name}"))
}

/// `HASH8-ns/name/proto/portName__ip/port`, with `:` of an IPv6 address replaced by `.`.
pub fn service_port_endpoint_chain_name_base(
    namespace: &str,
    name: &str,
    protocol_lower: &str,
    port_name: &str,
    ip: &IpAddr,
    port: u16,
) -> String {
    let ip = ip.to_string().replace(':', ".");
    hash_and_truncate(&format!("{namespace}/{name}/{protocol_lower}/{port_name}__{ip}/{port}"))
}

/// The names of one service port's chains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortChains {
    /// `service-…`: endpoints for Cluster traffic policy.
    pub cluster: String,
    /// `local-…`: endpoints for Local traffic policy.
    pub local: String,
    /// `external-…`: entry for NodePort / externalIP / LoadBalancer traffic.
    pub external: String,
    /// `firewall-…`: loadBalancerSourceRanges filter.
    pub firewall: String,
}

impl ServicePortChains {
    pub fn new(namespace: &str, name: &str, protocol_lower: &str, port_name: &str) -> ServicePortChains {
        let base = service_port_chain_name_base(namespace, name, protocol_lower, port_name);
        ServicePortChains {
            cluster: format!("{SERVICE_PREFIX}{base}"),
            local: format!("{LOCAL_PREFIX}{base}"),
            external: format!("{EXTERNAL_PREFIX}{base}"),
            firewall: format!("{FIREWALL_PREFIX}{base}"),
        }
    }
}

/// The names of one endpoint's chain and affinity set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointNames {
    /// `endpoint-…`
    pub chain: String,
    /// `affinity-…`
    pub affinity_set: String,
}

impl EndpointNames {
    pub fn new(
        namespace: &str,
        name: &str,
        protocol_lower: &str,
        port_name: &str,
        ip: &IpAddr,
        port: u16,
    ) -> EndpointNames {
        let base = service_port_endpoint_chain_name_base(namespace, name, protocol_lower, port_name, ip, port);
        EndpointNames {
            chain: format!("{ENDPOINT_PREFIX}{base}"),
            affinity_set: format!("{AFFINITY_PREFIX}{base}"),
        }
    }
}

/// Upstream's `isServiceChainName`: service and endpoint chains are the only ones with a `/`.
pub fn is_service_chain_name(chain: &str) -> bool {
    chain.contains('/')
}

/// Upstream's `isAffinitySetName`.
pub fn is_affinity_set_name(set: &str) -> bool {
    set.starts_with(AFFINITY_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_are_cut_to_128_bytes() {
        assert_eq!(comment("ns/svc:p"), "ns/svc:p");
        let long = format!("{}/{}:{}", "n".repeat(63), "s".repeat(63), "p".repeat(15));
        assert_eq!(comment(&long), long[..128]);
        assert_eq!(comment(&"é".repeat(100)).len(), 128, "cut at a char boundary");
    }

    #[test]
    fn golden_service_chain_names() {
        let c = ServicePortChains::new("ns1", "svc1", "tcp", "p80");
        assert_eq!(c.cluster, "service-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(c.local, "local-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(c.external, "external-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(c.firewall, "firewall-ULMVA6XW-ns1/svc1/tcp/p80");
        // More names from upstream's TestOverallNFTablesRules.
        assert_eq!(
            ServicePortChains::new("ns2", "svc2", "tcp", "p80").cluster,
            "service-42NFTM6N-ns2/svc2/tcp/p80"
        );
        assert_eq!(
            ServicePortChains::new("ns5", "svc5", "tcp", "p80").firewall,
            "firewall-HVFWP5L3-ns5/svc5/tcp/p80"
        );
    }

    #[test]
    fn golden_endpoint_names() {
        let e = EndpointNames::new("ns1", "svc1", "tcp", "p80", &"10.180.0.1".parse().unwrap(), 80);
        assert_eq!(e.chain, "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80");
        assert_eq!(e.affinity_set, "affinity-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80");
        let e = EndpointNames::new("ns5", "svc5", "tcp", "p80", &"10.180.0.3".parse().unwrap(), 80);
        assert_eq!(e.affinity_set, "affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80");
    }

    #[test]
    fn ipv6_endpoint_colons_become_dots() {
        // From upstream's IPv6 golden dump.
        let e = EndpointNames::new("ns1", "svc1", "tcp", "p80", &"fd00:10:180::1".parse().unwrap(), 80);
        assert_eq!(e.chain, "endpoint-ZVRFLKHO-ns1/svc1/tcp/p80__fd00.10.180..1/80");
        let e = EndpointNames::new("ns1", "svc1", "tcp", "p80", &"fd00:10:180::2:1".parse().unwrap(), 80);
        assert_eq!(e.chain, "endpoint-2CRNCTTE-ns1/svc1/tcp/p80__fd00.10.180..2.1/80");
    }

    #[test]
    fn unnamed_port_has_trailing_slash() {
        let c = ServicePortChains::new("default", "nginx", "tcp", "");
        assert!(c.cluster.ends_with("-default/nginx/tcp/"), "{}", c.cluster);
    }

    #[test]
    fn long_names_are_truncated_to_240_with_dots() {
        let long = "a".repeat(300);
        let t = hash_and_truncate(&long);
        assert_eq!(t.len(), CHAIN_NAME_BASE_LENGTH_MAX);
        assert!(t.ends_with("..."));
        assert_eq!(&t[8..9], "-");
        assert_eq!(&t[9..237], &long[..228]);
        // Exactly 240 is kept as is.
        let fits = "b".repeat(240 - 9);
        let t = hash_and_truncate(&fits);
        assert_eq!(t.len(), 240);
        assert!(!t.ends_with("..."));
        // The hash differs even when the kept prefix is the same.
        let other = format!("{}x", "a".repeat(299));
        assert_ne!(hash_and_truncate(&other)[..8], t[..8]);
    }

    #[test]
    fn classifiers() {
        assert!(is_service_chain_name("service-ULMVA6XW-ns1/svc1/tcp/p80"));
        assert!(!is_service_chain_name(SERVICES));
        assert!(is_affinity_set_name("affinity-X-ns/s/tcp/__1.2.3.4/80"));
        assert!(!is_affinity_set_name(CLUSTER_IPS));
    }
}
