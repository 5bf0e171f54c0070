//! Addresses as Kubernetes objects hold them, read the way upstream reads them: with its
//! "sloppy" parsers (`netutils.ParseIPSloppy` and `ParseCIDRSloppy`, Go's parsers as they were
//! before Go 1.17). Objects stored before the API server tightened its validation may carry
//! IPv4 parts with leading zeros (`172.30.0.041`, `203.0.113.000/025`); upstream reads every
//! part as decimal (not octal: `010` is 10) and programs the normalised address, and so do we.
//! Every address field of a Service, an EndpointSlice, a Node or a ServiceCIDR goes through
//! these two functions.
//!
//! Exactly what the sloppy parsers accept beyond the strict ones:
//! - an IPv4 part is one or more decimal digits with any number of leading zeros, at most 255
//!   in value (`0377` is 377, too big, not octal 255);
//! - an IPv6 group may be longer than 4 hex digits if its value fits in 16 bits (`00001`), and
//!   an IPv4 tail of an IPv6 address follows the IPv4 rule;
//! - a CIDR's prefix length is decimal digits with leading zeros (`/025`).
//!
//! Anything else (empty parts, signs, hex or octal prefixes, zones, five parts, values out of
//! range, a CIDR without `/`) is rejected, as upstream rejects it. Surrounding whitespace is
//! ignored, as the model did before (upstream trims source ranges only; no stored address
//! has spaces, since no API server version accepted them).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Parses an IP address as upstream's `ParseIPSloppy` does; `None` when upstream rejects it.
/// Whether it is IPv4 or IPv6 is decided, as in Go, by whether a `.` or a `:` comes first.
pub fn parse_ip_sloppy(raw: &str) -> Option<IpAddr> {
    let s = raw.trim();
    match s.find(['.', ':']).map(|i| s.as_bytes()[i]) {
        Some(b'.') => parse_v4(s).map(IpAddr::V4),
        Some(_) => parse_v6(s).map(IpAddr::V6),
        None => None,
    }
}

/// Parses a CIDR as upstream's `ParseCIDRSloppy` does; the address keeps its host bits (as
/// written; callers that want the network take [`IpNet::trunc`]). `None` when upstream
/// rejects it.
pub fn parse_cidr_sloppy(raw: &str) -> Option<IpNet> {
    let (addr, prefix) = raw.trim().split_once('/')?;
    let addr = parse_v4(addr)
        .map(IpAddr::V4)
        .or_else(|| parse_v6(addr).map(IpAddr::V6))?;
    let prefix = decimal(prefix, 128)?;
    IpNet::new(addr, u8::try_from(prefix).ok()?).ok()
}

/// Four dot-separated decimal parts, each 0..=255, leading zeros allowed.
fn parse_v4(s: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        *octet = u8::try_from(decimal(parts.next()?, 255)?).ok()?;
    }
    parts.next().is_none().then_some(Ipv4Addr::from(octets))
}

/// The strict parser, after rewriting what only the sloppy one accepts: hex groups longer
/// than 4 digits lose their leading zeros, and an IPv4 tail is written canonically.
fn parse_v6(s: &str) -> Option<Ipv6Addr> {
    if !s.contains('.') && s.split(':').all(|g| g.len() <= 4) {
        return s.parse().ok();
    }
    let mut groups = Vec::new();
    for group in s.split(':') {
        if group.contains('.') {
            groups.push(parse_v4(group)?.to_string());
        } else if group.len() > 4 && group.bytes().all(|b| b.is_ascii_hexdigit()) {
            let digits = group.trim_start_matches('0');
            // More than 4 significant digits is over 0xFFFF: the strict parser rejects it.
            groups.push(if digits.is_empty() { "0" } else { digits }.to_string());
        } else {
            groups.push(group.to_string());
        }
    }
    groups.join(":").parse().ok()
}

/// A non-empty run of ASCII decimal digits (leading zeros allowed) worth at most `max`.
fn decimal(s: &str, max: u32) -> Option<u32> {
    if s.is_empty() {
        return None;
    }
    s.bytes().try_fold(0u32, |n, b| {
        let n = n * 10 + u32::from(b.is_ascii_digit().then(|| b - b'0')?);
        (n <= max).then_some(n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<String> {
        parse_ip_sloppy(s).map(|ip| ip.to_string())
    }

    fn cidr(s: &str) -> Option<String> {
        parse_cidr_sloppy(s).map(|n| n.to_string())
    }

    #[test]
    fn leading_zeros_are_decimal_not_octal() {
        // Upstream's TestBadIPs addresses.
        assert_eq!(ip("172.30.0.041").as_deref(), Some("172.30.0.41"));
        assert_eq!(ip("1.2.3.004").as_deref(), Some("1.2.3.4"));
        assert_eq!(ip("192.168.099.022").as_deref(), Some("192.168.99.22"));
        assert_eq!(ip("10.180.00.001").as_deref(), Some("10.180.0.1"));
        // Octal would read 010 as 8 and 0377 as 255.
        assert_eq!(ip("010.0.0.010").as_deref(), Some("10.0.0.10"));
        assert_eq!(ip("10.0.0.0377"), None, "377 is over 255");
        assert_eq!(ip("0123.0.0.1").as_deref(), Some("123.0.0.1"));
        assert_eq!(ip("127.000.000.001").as_deref(), Some("127.0.0.1"));
        assert_eq!(ip("0000000001.2.3.4").as_deref(), Some("1.2.3.4"));
        assert_eq!(ip(" 10.0.0.1 ").as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn what_upstream_rejects_is_rejected() {
        for bad in [
            "", "abc", "-0.0.0.0", "0.-1.0.0", "0.0.-2.0", "0.0.0.-3", "+1.2.3.4", "127.0.0.256", "256.0.0.0",
            "1.2..4", "1.2.3", "1.2.3.4.5", "1.2.3.", ".1.2.3", "0x1.2.3.4", "1.2.3.4 5", "1.2.3.4/32", "123:",
            "fe80::1%lo0", "fe80::1%911", "a1:a2:a3:a4::b1:b2:b3:b4", "::10000", "::ffff:1.2.3.0400",
            "1:2:3:4:5:6:7:8:9", "[::1]", "1.2.3.4:80",
        ] {
            assert_eq!(ip(bad), None, "{bad:?} is rejected");
        }
    }

    #[test]
    fn ipv6_groups_and_ipv4_tails() {
        assert_eq!(
            ip("2001:4860:0000:2001:0000:0000:0000:0068").as_deref(),
            Some("2001:4860:0:2001::68")
        );
        assert_eq!(ip("0:0:0:0:000000:ffff:127.1.2.3").as_deref(), Some("::ffff:127.1.2.3"));
        assert_eq!(ip("::ffff:127.001.002.003").as_deref(), Some("::ffff:127.1.2.3"));
        assert_eq!(ip("fd00::00001").as_deref(), Some("fd00::1"));
        assert_eq!(ip("FD00::1").as_deref(), Some("fd00::1"));
    }

    #[test]
    fn cidrs() {
        assert_eq!(cidr("203.0.113.000/025").as_deref(), Some("203.0.113.0/25"));
        assert_eq!(cidr("127.000.000.001/32").as_deref(), Some("127.0.0.1/32"));
        assert_eq!(cidr("010.096.000.000/012").as_deref(), Some("10.96.0.0/12"));
        assert_eq!(
            parse_cidr_sloppy("135.104.0.1/24")
                .map(|n| n.trunc().to_string())
                .as_deref(),
            Some("135.104.0.0/24"),
            "the host bits are the caller's to clear"
        );
        assert_eq!(cidr("fd00:96::/0108").as_deref(), Some("fd00:96::/108"));
        assert_eq!(cidr("abcd:2345::/65").as_deref(), Some("abcd:2345::/65"));
        assert_eq!(cidr(" 203.0.113.0/25 ").as_deref(), Some("203.0.113.0/25"));
        for bad in [
            "", "1.2.3.4", "1.2.3.4/", "/24", "192.168.1.1/255.255.255.0", "192.168.1.1/35", "192.168.1.1/033",
            "2001:db8::1/-1", "2001:db8::1/-0", "-0.0.0.0/32", "0.0.0.0/-0", "1.2.3.4/+8", "::/129", "1.2.3.4/8/8",
            "10.0.0.0377/8", "everywhere",
        ] {
            assert_eq!(cidr(bad), None, "{bad:?} is rejected");
        }
    }
}
