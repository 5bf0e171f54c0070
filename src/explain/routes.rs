//! The route check of `kube-proxy explain`: does the node have a route toward each endpoint
//! IP? The routing tables are dumped over rtnetlink (`RTM_GETROUTE`, with `RTM_GETLINK` for
//! interface names) and looked up here in pure code, the way the kernel's default policy
//! rules do (table `local`, then `main`, then `default`; longest prefix, lowest metric first).
//! Policy rules beyond the default ones are not followed.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::netlink::{self, Attrs};
use crate::rtnetlink::{dump_request, route_socket};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const IFLA_IFNAME: u16 = 3;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_PRIORITY: u16 = 6;
const RTA_TABLE: u16 = 15;
const RTN_LOCAL: u8 = 2;
const RTN_BLACKHOLE: u8 = 6;
const RTN_UNREACHABLE: u8 = 7;
const RTN_PROHIBIT: u8 = 8;
const TABLES_IN_ORDER: [u32; 3] = [255, 254, 253];

/// One route of the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNet,
    pub table: u32,
    /// `RTN_*`: 1 unicast, 2 local, 6 blackhole, 7 unreachable, 8 prohibit, ...
    pub kind: u8,
    pub gateway: Option<IpAddr>,
    pub dev: Option<String>,
    pub metric: u32,
}

impl Route {
    /// As `ip route` would print it, roughly: `10.244.1.0/24 dev veth1`, `default via …`.
    pub fn describe(&self) -> String {
        let mut s = match self.kind {
            RTN_LOCAL => format!("local {}", self.dst.addr()),
            RTN_BLACKHOLE => format!("blackhole {}", self.dst),
            RTN_UNREACHABLE => format!("unreachable {}", self.dst),
            RTN_PROHIBIT => format!("prohibit {}", self.dst),
            _ if self.dst.prefix_len() == 0 => "default".to_string(),
            _ => self.dst.to_string(),
        };
        if let Some(g) = self.gateway {
            s.push_str(&format!(" via {g}"));
        }
        if let Some(d) = &self.dev {
            s.push_str(&format!(" dev {d}"));
        }
        s
    }
}

/// What the check found for one endpoint IP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteCheck {
    pub ip: IpAddr,
    /// `route` (a route that is not the default one), `default` (only the default route),
    /// `local` (an address of this node), `none` (no route, or an unreachable, blackhole or
    /// prohibit one).
    pub verdict: String,
    /// The route used, as `ip route` prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
}

/// The routes indexed for lookups: by table and destination network (the lowest metric of
/// each), with the prefix lengths each table has, longest first. An IPVS node holds a local
/// route per Service address (10,000 and more): a scan per endpoint would be quadratic.
pub struct RouteTable<'a> {
    by_network: HashMap<(u32, IpNet), &'a Route>,
    /// Per table and family (IPv4 first), the prefix lengths present, longest first.
    lengths: HashMap<(u32, bool), Vec<u8>>,
}

impl<'a> RouteTable<'a> {
    pub fn new(routes: &'a [Route]) -> RouteTable<'a> {
        let mut by_network: HashMap<(u32, IpNet), &Route> = HashMap::new();
        let mut lengths: HashMap<(u32, bool), Vec<u8>> = HashMap::new();
        for r in routes {
            let best = by_network.entry((r.table, r.dst.trunc())).or_insert(r);
            if r.metric < best.metric {
                *best = r;
            }
            let l = lengths.entry((r.table, r.dst.addr().is_ipv4())).or_default();
            if !l.contains(&r.dst.prefix_len()) {
                l.push(r.dst.prefix_len());
            }
        }
        for l in lengths.values_mut() {
            l.sort_unstable_by(|a, b| b.cmp(a));
        }
        RouteTable { by_network, lengths }
    }

    /// The route the kernel would use toward `ip`.
    pub fn lookup(&self, ip: IpAddr) -> Option<&'a Route> {
        TABLES_IN_ORDER.iter().find_map(|table| {
            self.lengths.get(&(*table, ip.is_ipv4()))?.iter().find_map(|len| {
                let net = IpNet::new(ip, *len).ok()?.trunc();
                self.by_network.get(&(*table, net)).copied()
            })
        })
    }

    /// The check of `ip`.
    pub fn check(&self, ip: IpAddr) -> RouteCheck {
        let found = self.lookup(ip);
        let verdict = match found {
            None => "none",
            Some(r) if matches!(r.kind, RTN_BLACKHOLE | RTN_UNREACHABLE | RTN_PROHIBIT) => "none",
            Some(r) if r.kind == RTN_LOCAL => "local",
            Some(r) if r.dst.prefix_len() == 0 => "default",
            Some(_) => "route",
        };
        RouteCheck {
            ip,
            verdict: verdict.into(),
            route: found.map(Route::describe),
        }
    }
}

/// The route the kernel would use toward `ip` (for one lookup; index with [`RouteTable`] for
/// many).
pub fn lookup(routes: &[Route], ip: IpAddr) -> Option<&Route> {
    RouteTable::new(routes).lookup(ip)
}

/// The check of `ip` against `routes`.
pub fn check(routes: &[Route], ip: IpAddr) -> RouteCheck {
    RouteTable::new(routes).check(ip)
}

/// One `RTM_NEWROUTE` message (whole, header included) as a [`Route`]; `None` for families
/// other than IPv4/IPv6 and for malformed messages.
fn parse_route(msg: &[u8], names: &[(u32, String)]) -> Option<Route> {
    let rtm = msg.get(netlink::NLMSG_HDRLEN..netlink::NLMSG_HDRLEN + 12)?;
    let (family, dst_len, table8, kind) = (rtm[0], rtm[1], rtm[4], rtm[7]);
    let attrs = Attrs::parse(msg.get(netlink::NLMSG_HDRLEN + 12..)?).ok()?;
    let ip = |b: &[u8]| -> Option<IpAddr> {
        match (family, b.len()) {
            (2, 4) => Some(IpAddr::from(<[u8; 4]>::try_from(b).ok()?)),
            (10, 16) => Some(IpAddr::from(<[u8; 16]>::try_from(b).ok()?)),
            _ => None,
        }
    };
    let unspecified: IpAddr = match family {
        2 => IpAddr::from([0u8; 4]),
        10 => IpAddr::from([0u8; 16]),
        _ => return None,
    };
    let dst = attrs.get(RTA_DST).and_then(ip).unwrap_or(unspecified);
    let oif = attrs.u32(RTA_OIF, "RTA_OIF").ok().flatten();
    Some(Route {
        dst: IpNet::new(dst, dst_len).ok()?.trunc(),
        table: attrs
            .u32(RTA_TABLE, "RTA_TABLE")
            .ok()
            .flatten()
            .unwrap_or(u32::from(table8)),
        kind,
        gateway: attrs.get(RTA_GATEWAY).and_then(ip),
        dev: oif.and_then(|i| names.iter().find(|(n, _)| *n == i).map(|(_, s)| s.clone())),
        metric: attrs.u32(RTA_PRIORITY, "RTA_PRIORITY").ok().flatten().unwrap_or(0),
    })
}

/// One `RTM_NEWLINK` message as `(index, name)`.
fn parse_link(msg: &[u8]) -> Option<(u32, String)> {
    // struct ifinfomsg: family, pad, type (u16), index (i32), flags, change.
    let index = netlink::read_u32(msg, netlink::NLMSG_HDRLEN + 4)?;
    let attrs = Attrs::parse(msg.get(netlink::NLMSG_HDRLEN + 16..)?).ok()?;
    Some((index, attrs.str(IFLA_IFNAME, "IFLA_IFNAME").ok()??.to_string()))
}

/// Every route of every table of this network namespace, both families.
pub fn dump_routes() -> io::Result<Vec<Route>> {
    let socket = route_socket()?;
    let mut buf = vec![0; 64 * 1024];
    let links = netlink::dump(&socket, &mut buf, &dump_request(RTM_GETLINK, 1, &[0; 16]), 1)?;
    let names: Vec<(u32, String)> = links
        .messages
        .iter()
        .filter(|(t, _)| *t == RTM_NEWLINK)
        .filter_map(|(_, m)| parse_link(m))
        .collect();
    // struct rtmsg with family AF_UNSPEC: every family, every table.
    let routes = netlink::dump(&socket, &mut buf, &dump_request(RTM_GETROUTE, 2, &[0; 12]), 2)?;
    Ok(routes
        .messages
        .iter()
        .filter(|(t, _)| *t == RTM_NEWROUTE)
        .filter_map(|(_, m)| parse_route(m, &names))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::MsgBuf;

    const RTN_UNICAST: u8 = 1;

    fn route(dst: &str, table: u32, kind: u8, via: Option<&str>, dev: &str) -> Route {
        Route {
            dst: dst.parse().unwrap(),
            table,
            kind,
            gateway: via.map(|v| v.parse().unwrap()),
            dev: Some(dev.into()),
            metric: 0,
        }
    }

    fn table() -> Vec<Route> {
        vec![
            route("0.0.0.0/0", 254, RTN_UNICAST, Some("192.168.49.77"), "eth0"),
            route("10.244.1.0/24", 254, RTN_UNICAST, None, "veth1"),
            route("10.244.7.0/24", 254, RTN_UNREACHABLE, None, "lo"),
            route("10.244.1.1/32", 255, RTN_LOCAL, None, "veth1"),
        ]
    }

    #[test]
    fn longest_prefix_in_table_order() {
        let t = table();
        let c = |ip: &str| check(&t, ip.parse().unwrap());
        assert_eq!(c("10.244.1.2").verdict, "route");
        assert_eq!(c("10.244.1.2").route.as_deref(), Some("10.244.1.0/24 dev veth1"));
        assert_eq!(c("10.244.1.1").verdict, "local");
        assert_eq!(c("10.244.200.2").verdict, "default");
        assert_eq!(
            c("10.244.200.2").route.as_deref(),
            Some("default via 192.168.49.77 dev eth0")
        );
        assert_eq!(c("10.244.7.3").verdict, "none");
        assert_eq!(check(&t[1..2], "10.9.9.9".parse().unwrap()).verdict, "none");
    }

    #[test]
    fn route_messages_decode() {
        let mut b = MsgBuf::default();
        // rtmsg: AF_INET, /24, src 0, tos 0, table main, proto kernel, scope link, unicast.
        let m = b.begin_msg(RTM_NEWROUTE, 0, 1, &[2, 24, 0, 0, 254, 2, 253, 1, 0, 0, 0, 0]);
        b.put(RTA_DST, &[10, 244, 1, 0]);
        b.put_u32(RTA_OIF, 7);
        b.put_u32(RTA_TABLE, 254);
        b.end_msg(m);
        let r = parse_route(&b.buf, &[(7, "veth1".into())]).expect("a route");
        assert_eq!(r, route("10.244.1.0/24", 254, RTN_UNICAST, None, "veth1"));
        assert_eq!(parse_route(&b.buf[..20], &[]), None, "cut short: no route, no panic");
    }
}
