//! Names in IPVS mode, byte-identical to upstream's IPVS proxier: the iptables chains it
//! writes, the dummy device that holds the service addresses, and the ipsets with their types
//! and the comments that its iptables rules carry. IPv6 sets get upstream's `KUBE-6-` prefix
//! (cut to ipset's 31-character limit), so that both families' sets can coexist on one node.

use crate::model::IpFamily;

/// nat (service entry, NodePort tail) and the jump from PREROUTING/OUTPUT.
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// nat: masquerading of marked packets and hairpin connections.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: sets the masquerade mark.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// nat (NodePort masquerading) and filter (health-check node ports). Note the spelling:
/// iptables mode's chain is `KUBE-NODEPORTS`.
pub const KUBE_NODE_PORT: &str = "KUBE-NODE-PORT";
/// nat: masquerading of load-balancer traffic (unless externalTrafficPolicy is Local).
pub const KUBE_LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
/// filter: lets marked traffic and its replies through a FORWARD policy of DROP.
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter: entry to the loadBalancerSourceRanges checks.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter: RETURN for allowed sources of a firewalled load balancer, DROP for the rest.
pub const KUBE_SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";
/// filter (from INPUT): rejects new connections to kube-ipvs0 addresses on ports that are no
/// service (upstream issue 72236: the addresses are local, so every host port answered on them).
pub const KUBE_IPVS_FILTER: &str = "KUBE-IPVS-FILTER";
/// filter (from OUTPUT): drops node → load balancer connections that the source ranges do
/// not allow (upstream issue 119656: IPVS short-circuits them locally).
pub const KUBE_IPVS_OUT_FILTER: &str = "KUBE-IPVS-OUT-FILTER";

/// The dummy interface that holds ClusterIPs, externalIPs and load-balancer IPs.
pub const DUMMY_DEVICE: &str = "kube-ipvs0";
/// `--ipvs-scheduler` when unset.
pub const DEFAULT_SCHEDULER: &str = "rr";

/// The nat chains, in the order upstream declares them.
pub const NAT_CHAINS: [&str; 5] = [
    KUBE_SERVICES, KUBE_POSTROUTING, KUBE_NODE_PORT, KUBE_LOAD_BALANCER, KUBE_MARK_MASQ,
];
/// The filter chains, in the order upstream declares them.
pub const FILTER_CHAINS: [&str; 6] = [
    KUBE_FORWARD, KUBE_NODE_PORT, KUBE_PROXY_FIREWALL, KUBE_SOURCE_RANGES_FIREWALL, KUBE_IPVS_FILTER,
    KUBE_IPVS_OUT_FILTER,
];

/// ipset's limit on set names.
pub const IPSET_NAME_MAX: usize = 31;

/// The ipset types IPVS mode uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpsetType {
    HashIp,
    HashIpPort,
    HashIpPortIp,
    HashIpPortNet,
    BitmapPort,
}

impl IpsetType {
    /// The type as `ipset create` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            IpsetType::HashIp => "hash:ip",
            IpsetType::HashIpPort => "hash:ip,port",
            IpsetType::HashIpPortIp => "hash:ip,port,ip",
            IpsetType::HashIpPortNet => "hash:ip,port,net",
            IpsetType::BitmapPort => "bitmap:port",
        }
    }

    /// Bitmap sets hold bare ports and have no address family.
    pub fn is_hash(self) -> bool {
        self != IpsetType::BitmapPort
    }
}

/// Which of upstream's sets (its `ipsetInfo` table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetId {
    LoopBack,
    ClusterIp,
    ExternalIp,
    ExternalIpLocal,
    LoadBalancer,
    LoadBalancerFw,
    LoadBalancerLocal,
    LoadBalancerSourceIp,
    LoadBalancerSourceCidr,
    NodePortTcp,
    NodePortLocalTcp,
    NodePortUdp,
    NodePortLocalUdp,
    NodePortSctp,
    NodePortLocalSctp,
    HealthCheckNodePort,
    IpvsIps,
}

/// One set of upstream's table: its IPv4 name, type and comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpsetInfo {
    pub id: SetId,
    /// The name of the IPv4 set (see [`set_name`] for IPv6).
    pub name: &'static str,
    pub set_type: IpsetType,
    /// Upstream puts it in the `-m comment` of the iptables rules that match the set.
    pub comment: &'static str,
}

/// Every set IPVS mode creates, in upstream's order.
pub const IPSETS: [IpsetInfo; 17] = [
    IpsetInfo {
        id: SetId::LoopBack,
        name: "KUBE-LOOP-BACK",
        set_type: IpsetType::HashIpPortIp,
        comment: "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
    },
    IpsetInfo {
        id: SetId::ClusterIp,
        name: "KUBE-CLUSTER-IP",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes service cluster ip + port for masquerade purpose",
    },
    IpsetInfo {
        id: SetId::ExternalIp,
        name: "KUBE-EXTERNAL-IP",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes service external ip + port for masquerade and filter purpose",
    },
    IpsetInfo {
        id: SetId::ExternalIpLocal,
        name: "KUBE-EXTERNAL-IP-LOCAL",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes service external ip + port with externalTrafficPolicy=local",
    },
    IpsetInfo {
        id: SetId::LoadBalancer,
        name: "KUBE-LOAD-BALANCER",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes service lb portal",
    },
    IpsetInfo {
        id: SetId::LoadBalancerFw,
        name: "KUBE-LOAD-BALANCER-FW",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes service load balancer ip + port for load balancer with sourceRange",
    },
    IpsetInfo {
        id: SetId::LoadBalancerLocal,
        name: "KUBE-LOAD-BALANCER-LOCAL",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
    },
    IpsetInfo {
        id: SetId::LoadBalancerSourceIp,
        name: "KUBE-LOAD-BALANCER-SOURCE-IP",
        set_type: IpsetType::HashIpPortIp,
        comment: "Kubernetes service load balancer ip + port + source IP for packet filter purpose",
    },
    IpsetInfo {
        id: SetId::LoadBalancerSourceCidr,
        name: "KUBE-LOAD-BALANCER-SOURCE-CIDR",
        set_type: IpsetType::HashIpPortNet,
        comment: "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
    },
    IpsetInfo {
        id: SetId::NodePortTcp,
        name: "KUBE-NODE-PORT-TCP",
        set_type: IpsetType::BitmapPort,
        comment: "Kubernetes nodeport TCP port for masquerade purpose",
    },
    IpsetInfo {
        id: SetId::NodePortLocalTcp,
        name: "KUBE-NODE-PORT-LOCAL-TCP",
        set_type: IpsetType::BitmapPort,
        comment: "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
    },
    IpsetInfo {
        id: SetId::NodePortUdp,
        name: "KUBE-NODE-PORT-UDP",
        set_type: IpsetType::BitmapPort,
        comment: "Kubernetes nodeport UDP port for masquerade purpose",
    },
    IpsetInfo {
        id: SetId::NodePortLocalUdp,
        name: "KUBE-NODE-PORT-LOCAL-UDP",
        set_type: IpsetType::BitmapPort,
        comment: "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
    },
    IpsetInfo {
        id: SetId::NodePortSctp,
        name: "KUBE-NODE-PORT-SCTP-HASH",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'",
    },
    IpsetInfo {
        id: SetId::NodePortLocalSctp,
        name: "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
        set_type: IpsetType::HashIpPort,
        comment: "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'",
    },
    IpsetInfo {
        id: SetId::HealthCheckNodePort,
        name: "KUBE-HEALTH-CHECK-NODE-PORT",
        set_type: IpsetType::BitmapPort,
        comment: "Kubernetes health check node port",
    },
    IpsetInfo {
        id: SetId::IpvsIps,
        name: "KUBE-IPVS-IPS",
        set_type: IpsetType::HashIp,
        comment: "Addresses on the ipvs interface",
    },
];

/// Upstream's table entry of `id`.
pub fn ipset_info(id: SetId) -> &'static IpsetInfo {
    // Every SetId has exactly one entry; the table order follows the enum's.
    &IPSETS[id as usize]
}

/// The name of a set in `family`: IPv6 sets are `KUBE-6-…`, cut to 31 characters (so
/// `KUBE-6-LOAD-BALANCER-SOURCE-CID` and `KUBE-6-NODE-PORT-LOCAL-SCTP-HAS`), as upstream names
/// them; IPv4 names are unchanged for compatibility with existing nodes.
pub fn set_name(name: &str, family: IpFamily) -> String {
    match (family, name.strip_prefix("KUBE-")) {
        (IpFamily::V6, Some(rest)) => {
            let mut n = format!("KUBE-6-{rest}");
            // Names are ASCII, so truncating at a byte index is safe.
            n.truncate(IPSET_NAME_MAX);
            n
        }
        _ => name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_indexed_by_set_id() {
        for (i, info) in IPSETS.iter().enumerate() {
            assert_eq!(info.id as usize, i, "{}", info.name);
            assert_eq!(ipset_info(info.id).name, info.name);
        }
    }

    #[test]
    fn ipv6_names_as_upstream() {
        assert_eq!(set_name("KUBE-CLUSTER-IP", IpFamily::V4), "KUBE-CLUSTER-IP");
        assert_eq!(set_name("KUBE-CLUSTER-IP", IpFamily::V6), "KUBE-6-CLUSTER-IP");
        assert_eq!(
            set_name("KUBE-LOAD-BALANCER-SOURCE-CIDR", IpFamily::V6),
            "KUBE-6-LOAD-BALANCER-SOURCE-CID"
        );
        assert_eq!(
            set_name("KUBE-NODE-PORT-LOCAL-SCTP-HASH", IpFamily::V6),
            "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"
        );
        for info in IPSETS {
            for family in [IpFamily::V4, IpFamily::V6] {
                assert!(set_name(info.name, family).len() <= IPSET_NAME_MAX);
            }
        }
    }
}
