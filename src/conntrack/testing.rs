//! Test helpers shared by the conntrack modules' unit tests.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use super::Flow;

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

pub fn sa(s: &str) -> SocketAddr {
    s.parse().expect("test socket address")
}

pub fn set(addrs: &[&str]) -> HashSet<SocketAddr> {
    addrs.iter().map(|a| sa(a)).collect()
}

/// A flow from a fixed client to `dst:dport`, answered by `reply_src:reply_sport`.
pub fn flow(dst: &str, dport: u16, reply_src: &str, reply_sport: u16) -> Flow {
    let client = if ip(dst).is_ipv4() {
        ip("10.0.0.1")
    } else {
        ip("fd00::1")
    };
    Flow {
        orig_src: client,
        orig_dst: ip(dst),
        orig_sport: 40000,
        orig_dport: dport,
        reply_src: ip(reply_src),
        reply_dst: client,
        reply_sport,
        reply_dport: 40000,
    }
}
