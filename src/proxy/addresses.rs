//! The node's own addresses as every mode sees them: which addresses are local (`addrtype
//! LOCAL`, `fib daddr type local`, IPVS's local delivery) and which of them carry NodePorts
//! (`nodePortAddresses`, upstream's `NodePortAddresses`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::model::{IpFamily, ProxyState};

/// upstream's `NodePortAddresses` for one family: the CIDRs NodePorts are served on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePortAddresses {
    cidrs: Vec<IpNet>,
    match_all: bool,
    contains_ipv4_loopback: bool,
}

impl NodePortAddresses {
    /// From `nodePortAddresses` entries (CIDRs, or `primary` for the node's primary IP
    /// `primary`); entries of the other family are ignored, and nothing left means every
    /// address.
    pub fn new(family: IpFamily, entries: &[String], primary: Option<IpAddr>) -> NodePortAddresses {
        let mut cidrs: Vec<IpNet> = Vec::new();
        for e in entries {
            if e == "primary" {
                if let Some(ip) = primary.filter(|ip| family.contains(ip)) {
                    cidrs.push(IpNet::from(ip));
                }
                continue;
            }
            if let Ok(net) = e.parse::<IpNet>()
                && family.contains(&net.addr())
            {
                cidrs.push(net.trunc());
            }
        }
        if cidrs.is_empty() {
            let any = match family {
                IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            cidrs.push(IpNet::new(any, 0).unwrap_or_else(|_| IpNet::from(any)));
        }
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let contains_ipv4_loopback = cidrs
            .iter()
            .any(|c| c.addr().is_ipv4() && (c.addr().is_loopback() || c.contains(&loopback)));
        let match_all = cidrs.iter().any(|c| c.prefix_len() == 0);
        NodePortAddresses {
            cidrs,
            match_all,
            contains_ipv4_loopback,
        }
    }

    /// Every address of the family carries NodePorts.
    pub fn match_all(&self) -> bool {
        self.match_all
    }

    /// IPv4 loopback is among the NodePort addresses (localhost NodePorts).
    pub fn contains_ipv4_loopback(&self) -> bool {
        self.contains_ipv4_loopback
    }

    /// The node's addresses (plus loopback) that fall in the configured CIDRs.
    pub fn node_ips(&self, local_addresses: &[IpAddr]) -> Vec<IpAddr> {
        let mut out = Vec::new();
        for ip in local_addresses {
            if self.cidrs.iter().any(|c| c.contains(ip)) && !out.contains(ip) {
                out.push(*ip);
            }
        }
        out
    }
}

/// The node's own addresses of `family` plus loopback: what `addrtype LOCAL` matches and what
/// nodePortAddresses select from.
pub fn local_addresses(state: &ProxyState) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = state
        .node
        .addresses
        .iter()
        .copied()
        .filter(|ip| state.family.contains(ip))
        .collect();
    v.push(match state.family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_port_addresses() {
        let v4 = NodePortAddresses::new(IpFamily::V4, &[], None);
        assert!(v4.match_all() && v4.contains_ipv4_loopback());
        let p = NodePortAddresses::new(IpFamily::V4, &["primary".into()], Some("192.168.0.2".parse().unwrap()));
        assert!(!p.match_all() && !p.contains_ipv4_loopback());
        assert_eq!(
            p.node_ips(&["192.168.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap()]),
            vec!["192.168.0.2".parse::<IpAddr>().unwrap()]
        );
        let only_v6 = NodePortAddresses::new(IpFamily::V4, &["fd00::/64".into()], None);
        assert!(only_v6.match_all(), "no CIDR of the family means all addresses");
    }
}
