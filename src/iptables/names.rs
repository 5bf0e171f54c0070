//! Chain names, byte-identical to upstream's iptables proxier: fixed chains, and the
//! per-service / per-endpoint chains named by a truncated base32(SHA-256) hash so that they
//! fit iptables' 28-character limit and stay stable across restarts and implementations.

use data_encoding::BASE32;
use sha2::{Digest, Sha256};

pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub const KUBE_PROXY_CANARY: &str = "KUBE-PROXY-CANARY";
/// A duplicate of kubelet's chain holding the anti-martian rule for localhost NodePorts.
pub const KUBE_FIREWALL: &str = "KUBE-FIREWALL";

pub const SVC_PREFIX: &str = "KUBE-SVC-";
pub const SVL_PREFIX: &str = "KUBE-SVL-";
pub const EXT_PREFIX: &str = "KUBE-EXT-";
pub const FW_PREFIX: &str = "KUBE-FW-";
pub const SEP_PREFIX: &str = "KUBE-SEP-";

/// First 16 characters of base32(SHA-256(input)), upstream's `portProtoHash`.
fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut encoded = BASE32.encode(&digest);
    encoded.truncate(16);
    encoded
}

/// The hashed names of one service port's chains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortChains {
    /// `KUBE-SVC-…`: endpoints for Cluster traffic policy.
    pub cluster: String,
    /// `KUBE-SVL-…`: endpoints for Local traffic policy.
    pub local: String,
    /// `KUBE-EXT-…`: entry for NodePort / externalIP / LoadBalancer traffic.
    pub external: String,
    /// `KUBE-FW-…`: loadBalancerSourceRanges filter.
    pub firewall: String,
}

/// Chains of the service port `name` (`ns/svc[:port]`) with protocol `protocol_lower` (`tcp`).
///
/// ```
/// use kube_proxy::iptables::names::service_port_chains;
/// // The example from upstream's proxier tests.
/// assert_eq!(service_port_chains("ns1/svc1:p80", "tcp").cluster, "KUBE-SVC-XPGD46QRK7WJZT7O");
/// ```
pub fn service_port_chains(name: &str, protocol_lower: &str) -> ServicePortChains {
    let h = hash16(&format!("{name}{protocol_lower}"));
    ServicePortChains {
        cluster: format!("{SVC_PREFIX}{h}"),
        local: format!("{SVL_PREFIX}{h}"),
        external: format!("{EXT_PREFIX}{h}"),
        firewall: format!("{FW_PREFIX}{h}"),
    }
}

/// `KUBE-SEP-…` for an endpoint written as `ip:port` (`[ip6]:port` for IPv6).
///
/// ```
/// use kube_proxy::iptables::names::endpoint_chain;
/// assert_eq!(endpoint_chain("ns1/svc1:p80", "tcp", "10.180.0.1:80"), "KUBE-SEP-SXIVWICOYRO3J4NJ");
/// ```
pub fn endpoint_chain(name: &str, protocol_lower: &str, endpoint: &str) -> String {
    format!("{SEP_PREFIX}{}", hash16(&format!("{name}{protocol_lower}{endpoint}")))
}

/// Whether a chain is one of the per-service chains that kube-proxy creates and deletes.
pub fn is_service_chain(chain: &str) -> bool {
    [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX]
        .iter()
        .any(|p| chain.starts_with(p))
}

/// The fixed chains kube-proxy owns in `table` (KUBE-FIREWALL is kubelet's unless we render it).
pub fn fixed_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &[
            KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ, KUBE_PROXY_CANARY,
        ],
        "filter" => &[
            KUBE_SERVICES, KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL, KUBE_PROXY_CANARY,
        ],
        _ => &[KUBE_PROXY_CANARY],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Examples from upstream's proxier_test.go and public iptables dumps.
    #[test]
    fn matches_upstream_examples() {
        assert_eq!(
            service_port_chains("ns1/svc1:p80", "tcp").cluster,
            "KUBE-SVC-XPGD46QRK7WJZT7O"
        );
        assert_eq!(
            endpoint_chain("ns1/svc1:p80", "tcp", "10.180.0.1:80"),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
        assert_eq!(
            service_port_chains("default/kubernetes:https", "tcp").cluster,
            "KUBE-SVC-NPX46M4PTMTKRN6Y"
        );
        assert_eq!(
            service_port_chains("kube-system/kube-dns:dns", "udp").cluster,
            "KUBE-SVC-TCOU7JCQXEZGVUNU"
        );
        assert_eq!(
            service_port_chains("kube-system/kube-dns:dns-tcp", "tcp").cluster,
            "KUBE-SVC-ERIFXISQEP7F7OF4"
        );
        assert_eq!(
            service_port_chains("default/nginx", "tcp").cluster,
            "KUBE-SVC-2CMXP7HKUVJN7L6M"
        );
    }

    #[test]
    fn prefixes_share_the_hash() {
        let c = service_port_chains("ns1/svc1:p80", "tcp");
        assert_eq!(c.local, "KUBE-SVL-XPGD46QRK7WJZT7O");
        assert_eq!(c.external, "KUBE-EXT-XPGD46QRK7WJZT7O");
        assert_eq!(c.firewall, "KUBE-FW-XPGD46QRK7WJZT7O");
        assert!(is_service_chain(&c.firewall));
        assert!(!is_service_chain(KUBE_SERVICES));
    }
}
