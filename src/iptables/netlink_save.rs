//! iptables-nft's tables read over nf_tables netlink and written as `iptables-nft-save -c`
//! writes them, for `explain --all`.
//!
//! Why: `iptables-nft-save` asks the kernel for every chain of the family in one dump, and the
//! kernel walks the table's chain list again from the start for each 32 KiB part of it: at
//! 110,000 chains that is most of 5 s. Here each chain's rules are one dump of that chain
//! alone (the kernel finds it by name), starting from the built-in chains and following the
//! jumps; the whole chain list is asked for only when the table holds chains that no jump
//! reaches (its use count says so).
//!
//! - [`rule_line`] (pure): one rule message as its save line, for the shapes iptables-nft gives
//!   the rules kube-proxy writes (native address, interface, protocol, port and mark matches;
//!   the xt matches and targets it keeps as such). Anything else is [`Undecodable`], and the
//!   caller saves the table with the tool instead.
//! - [`NetlinkSave`] (the edge): the socket, the walk and the text.

use std::collections::{HashSet, VecDeque};
use std::fmt::Write as _;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;

use netlink_sys::Socket;

use crate::model::IpFamily;
use crate::netlink::{self, Attrs, MsgBuf, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_HDRLEN, read_u16, read_u32};
use crate::nftables::netlink::wire::*;
use crate::nftables::netlink::{nfproto, udata_get};

// Attributes and constants not in `wire` (linux/netfilter/nf_tables.h, nf_tables_compat.h).
const NFTA_TABLE_USE: u16 = 3;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_COUNTERS: u16 = 8;
const NFTA_COUNTER_BYTES: u16 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_MARK: u32 = 3;
const NFT_META_IIFNAME: u32 = 6;
const NFT_META_OIFNAME: u32 = 7;
const NFT_META_L4PROTO: u32 = 16;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFTA_RANGE_SREG: u16 = 1;
const NFTA_RANGE_OP: u16 = 2;
const NFTA_RANGE_FROM_DATA: u16 = 3;
const NFTA_RANGE_TO_DATA: u16 = 4;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_XT_NAME: u16 = 1;
const NFTA_XT_REV: u16 = 2;
const NFTA_XT_INFO: u16 = 3;

/// A rule (or a chain of rules) that is not of a shape this reader prints.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {chain} rule: {reason}")]
pub struct Undecodable {
    pub chain: String,
    pub reason: String,
}

/// Why the tables could not be read this way.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("nf_tables netlink: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Undecodable(#[from] Undecodable),
}

/// One rule: its chain, its save line and the chain it jumps or goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    pub line: String,
    pub target: Option<String>,
}

/// A value loaded into a register, waiting for its comparison.
#[derive(Clone, Debug)]
enum Load {
    Meta(u32),
    Network { offset: u32, len: u32 },
    Transport { offset: u32, len: u32 },
}

/// An address match (`-s`, `-d`): the value, the mask's bytes, inverted.
#[derive(Clone, Debug)]
struct AddrMatch {
    value: Vec<u8>,
    mask: Vec<u8>,
    inverted: bool,
}

/// A port range of a native port match, inverted or not.
#[derive(Clone, Copy, Debug)]
struct Ports {
    low: u16,
    high: u16,
    inverted: bool,
}

/// What the rule's expressions said, in the order `iptables-save` prints the parts.
#[derive(Debug, Default)]
struct Parts {
    src: Option<AddrMatch>,
    dst: Option<AddrMatch>,
    iif: Option<(String, bool)>,
    oif: Option<(String, bool)>,
    proto: Option<(u8, bool)>,
    /// `-m …` pieces in expression order; a native port match is filled in place.
    matches: Vec<Piece>,
    target: String,
    jump: Option<String>,
    counters: (u64, u64),
}

#[derive(Debug)]
enum Piece {
    Text(String),
    /// `-m tcp/udp/sctp` from native port comparisons: source, destination ports.
    Ports(Option<Ports>, Option<Ports>),
}

/// The save line of one `NEWRULE` message (`[pkts:bytes] -A CHAIN …`) and its jump target.
pub fn rule_line(msg: &[u8], family: IpFamily) -> Result<SavedRule, Undecodable> {
    let bad = |chain: &str, reason: String| Undecodable {
        chain: chain.to_string(),
        reason,
    };
    let a = msg
        .get(NLMSG_HDRLEN + 4..)
        .and_then(|p| Attrs::parse(p).ok())
        .ok_or_else(|| bad("?", "a rule message that does not parse".into()))?;
    let chain = a
        .str(NFTA_RULE_CHAIN, "chain")
        .ok()
        .flatten()
        .ok_or_else(|| bad("?", "a rule message without its chain".into()))?
        .to_string();
    let mut parts = Parts::default();
    let exprs = a.get(NFTA_RULE_EXPRESSIONS).unwrap_or_default();
    let list = netlink::attributes_of(exprs).ok_or_else(|| bad(&chain, "expressions that do not parse".into()))?;
    let mut regs: Vec<(u32, Load, Option<Vec<u8>>)> = Vec::new();
    for (_, e) in list {
        let e = Attrs::parse(e).map_err(|_| bad(&chain, "an expression that does not parse".into()))?;
        let name = e
            .str(NFTA_EXPR_NAME, "name")
            .ok()
            .flatten()
            .unwrap_or_default()
            .to_string();
        let data = e.nested(NFTA_EXPR_DATA).ok().flatten().unwrap_or_default();
        expression(&name, &data, family, &mut regs, &mut parts).map_err(|reason| bad(&chain, reason))?;
    }
    // A comment kept in the rule's userdata (not as `-m comment`) would be lost here: the tool
    // prints such a rule, this reader does not.
    if udata_get(a.get(NFTA_RULE_USERDATA), UDATA_RULE_COMMENT).is_some() {
        return Err(bad(&chain, "a comment in the rule's userdata".into()));
    }
    let line = print(&chain, &parts, family);
    Ok(SavedRule {
        chain,
        line,
        target: parts.jump,
    })
}

fn be32(a: &Attrs<'_>, ty: u16) -> Option<u32> {
    a.raw4(ty, "attribute").ok().flatten().map(u32::from_be_bytes)
}

fn be64(a: &Attrs<'_>, ty: u16) -> Option<u64> {
    a.u64(ty, "attribute").ok().flatten().map(u64::from_be)
}

/// The bytes of a `NFTA_DATA_VALUE` nest.
fn data_value(a: &Attrs<'_>, ty: u16) -> Option<Vec<u8>> {
    a.nested(ty).ok().flatten()?.get(NFTA_DATA_VALUE).map(<[u8]>::to_vec)
}

fn expression(
    name: &str,
    d: &Attrs<'_>,
    family: IpFamily,
    regs: &mut Vec<(u32, Load, Option<Vec<u8>>)>,
    parts: &mut Parts,
) -> Result<(), String> {
    let set_reg = |regs: &mut Vec<(u32, Load, Option<Vec<u8>>)>, reg: u32, load: Load, mask: Option<Vec<u8>>| {
        regs.retain(|(r, ..)| *r != reg);
        regs.push((reg, load, mask));
    };
    match name {
        "meta" => {
            let (reg, key) = (be32(d, NFTA_META_DREG), be32(d, NFTA_META_KEY));
            match (reg, key) {
                (Some(reg), Some(key)) => set_reg(regs, reg, Load::Meta(key), None),
                _ => return Err("a meta statement".into()),
            }
        }
        "payload" => {
            let (Some(reg), Some(base), Some(offset), Some(len)) = (
                be32(d, NFTA_PAYLOAD_DREG),
                be32(d, NFTA_PAYLOAD_BASE),
                be32(d, NFTA_PAYLOAD_OFFSET),
                be32(d, NFTA_PAYLOAD_LEN),
            ) else {
                return Err("a payload write".into());
            };
            let load = match base {
                NFT_PAYLOAD_NETWORK_HEADER => Load::Network { offset, len },
                NFT_PAYLOAD_TRANSPORT_HEADER => Load::Transport { offset, len },
                _ => return Err(format!("a payload load of base {base}")),
            };
            set_reg(regs, reg, load, None);
        }
        "bitwise" => {
            let (Some(sreg), Some(dreg), Some(mask), Some(xor)) = (
                be32(d, NFTA_BITWISE_SREG),
                be32(d, NFTA_BITWISE_DREG),
                data_value(d, NFTA_BITWISE_MASK),
                data_value(d, NFTA_BITWISE_XOR),
            ) else {
                return Err("a bitwise shift".into());
            };
            if xor.iter().any(|b| *b != 0) {
                return Err("a bitwise xor".into());
            }
            let load = regs
                .iter()
                .find(|(r, ..)| *r == sreg)
                .map(|(_, l, _)| l.clone())
                .ok_or("a bitwise on an empty register")?;
            set_reg(regs, dreg, load, Some(mask));
        }
        "cmp" => {
            let (Some(reg), Some(op), Some(value)) = (
                be32(d, NFTA_CMP_SREG),
                be32(d, NFTA_CMP_OP),
                data_value(d, NFTA_CMP_DATA),
            ) else {
                return Err("a cmp without its operands".into());
            };
            let inverted = match op {
                NFT_CMP_EQ => false,
                NFT_CMP_NEQ => true,
                _ => return Err(format!("a cmp of op {op}")),
            };
            let (load, mask) = regs
                .iter()
                .find(|(r, ..)| *r == reg)
                .map(|(_, l, m)| (l.clone(), m.clone()))
                .ok_or("a cmp on an empty register")?;
            compared(&load, mask, &value, None, inverted, family, parts)?;
        }
        "range" => {
            let (Some(reg), Some(op), Some(from), Some(to)) = (
                be32(d, NFTA_RANGE_SREG),
                be32(d, NFTA_RANGE_OP),
                data_value(d, NFTA_RANGE_FROM_DATA),
                data_value(d, NFTA_RANGE_TO_DATA),
            ) else {
                return Err("a range without its operands".into());
            };
            let load = regs
                .iter()
                .find(|(r, ..)| *r == reg)
                .map(|(_, l, _)| l.clone())
                .ok_or("a range on an empty register")?;
            compared(&load, None, &from, Some(&to), op == NFT_CMP_NEQ, family, parts)?;
        }
        "counter" => {
            parts.counters = (
                be64(d, NFTA_COUNTER_PACKETS).unwrap_or(0),
                be64(d, NFTA_COUNTER_BYTES).unwrap_or(0),
            );
        }
        "immediate" => {
            if be32(d, NFTA_IMMEDIATE_DREG) != Some(REG_VERDICT) {
                return Err("an immediate value".into());
            }
            let v = d
                .nested(NFTA_IMMEDIATE_DATA)
                .ok()
                .flatten()
                .and_then(|data| data.nested(NFTA_DATA_VERDICT).ok().flatten())
                .ok_or("an immediate without its verdict")?;
            let code = be32(&v, NFTA_VERDICT_CODE).map(|c| c as i32);
            let chain = v.str(NFTA_VERDICT_CHAIN, "chain").ok().flatten().map(str::to_string);
            parts.target = match (code, chain) {
                (Some(NF_ACCEPT), _) => " -j ACCEPT".into(),
                (Some(NF_DROP), _) => " -j DROP".into(),
                (Some(NFT_RETURN), _) => " -j RETURN".into(),
                (Some(NFT_JUMP), Some(c)) => {
                    let t = format!(" -j {c}");
                    parts.jump = Some(c);
                    t
                }
                (Some(NFT_GOTO), Some(c)) => {
                    let t = format!(" -g {c}");
                    parts.jump = Some(c);
                    t
                }
                (code, _) => return Err(format!("the verdict {code:?}")),
            };
        }
        "match" | "target" => {
            let xt_name = d.str(NFTA_XT_NAME, "name").ok().flatten().unwrap_or_default();
            let rev = be32(d, NFTA_XT_REV).unwrap_or(u32::MAX);
            let info = d.get(NFTA_XT_INFO).unwrap_or_default();
            if name == "match" {
                let text = xt_match(xt_name, rev, info, family)
                    .ok_or_else(|| format!("the match {xt_name} revision {rev}"))?;
                parts.matches.push(Piece::Text(format!(" -m {xt_name}{text}")));
            } else {
                let text = xt_target(xt_name, rev, info, family)
                    .ok_or_else(|| format!("the target {xt_name} revision {rev}"))?;
                parts.target = format!(" -j {xt_name}{text}");
            }
        }
        other => return Err(format!("the expression {other}")),
    }
    Ok(())
}

/// A comparison of a loaded value (`to`: the end of a range).
fn compared(
    load: &Load,
    mask: Option<Vec<u8>>,
    value: &[u8],
    to: Option<&[u8]>,
    inverted: bool,
    family: IpFamily,
    parts: &mut Parts,
) -> Result<(), String> {
    let (src_at, dst_at, proto_at, full) = match family {
        IpFamily::V4 => (12, 16, Some(9), 4),
        IpFamily::V6 => (8, 24, None, 16),
    };
    match (load, to) {
        (Load::Meta(NFT_META_L4PROTO), None) if value.len() == 1 => parts.proto = Some((value[0], inverted)),
        (Load::Network { offset, len: 1 }, None) if Some(*offset) == proto_at && mask.is_none() => {
            parts.proto = Some((value[0], inverted))
        }
        (Load::Meta(key @ (NFT_META_IIFNAME | NFT_META_OIFNAME)), None) => {
            let name = match value.iter().position(|b| *b == 0) {
                Some(end) => String::from_utf8_lossy(&value[..end]).into_owned(),
                None => format!("{}+", String::from_utf8_lossy(value)),
            };
            if *key == NFT_META_IIFNAME {
                parts.iif = Some((name, inverted));
            } else {
                parts.oif = Some((name, inverted));
            }
        }
        (Load::Meta(NFT_META_MARK), None) if value.len() == 4 => {
            let mark = u32::from_ne_bytes(value.try_into().map_err(|_| "a mark")?);
            let mask = match mask {
                Some(m) => u32::from_ne_bytes(m.as_slice().try_into().map_err(|_| "a mark's mask")?),
                None => u32::MAX,
            };
            let mut t = String::from(" -m mark");
            if inverted {
                t.push_str(" !");
            }
            let _ = write!(t, " --mark 0x{mark:x}");
            if mask != u32::MAX {
                let _ = write!(t, "/0x{mask:x}");
            }
            parts.matches.push(Piece::Text(t));
        }
        (Load::Network { offset, len }, None) if (*offset == src_at || *offset == dst_at) && *len <= full => {
            let pad = |b: &[u8]| {
                let mut v = b.to_vec();
                v.resize(full as usize, 0);
                v
            };
            let mask = match mask {
                Some(m) => pad(&m),
                None => pad(&vec![0xff; *len as usize]),
            };
            let m = AddrMatch {
                value: pad(value),
                mask,
                inverted,
            };
            if *offset == src_at {
                parts.src = Some(m);
            } else {
                parts.dst = Some(m);
            }
        }
        (
            Load::Transport {
                offset: offset @ (0 | 2),
                len: 2,
            },
            _,
        ) if mask.is_none() && value.len() == 2 => {
            let low = u16::from_be_bytes([value[0], value[1]]);
            let high = match to {
                Some([a, b]) => u16::from_be_bytes([*a, *b]),
                Some(_) => return Err("a port range".into()),
                None => low,
            };
            let ports = Ports { low, high, inverted };
            match parts.matches.last_mut() {
                Some(Piece::Ports(sport, dport))
                    if (*offset == 0 && sport.is_none()) || (*offset == 2 && dport.is_none()) =>
                {
                    if *offset == 0 {
                        *sport = Some(ports);
                    } else {
                        *dport = Some(ports);
                    }
                }
                _ => parts.matches.push(if *offset == 0 {
                    Piece::Ports(Some(ports), None)
                } else {
                    Piece::Ports(None, Some(ports))
                }),
            }
        }
        (load, _) => return Err(format!("a comparison of {load:?}")),
    }
    Ok(())
}

/// The protocol's name as `iptables-save` prints it after `-p`.
fn proto_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        136 => "udplite".into(),
        1 => "icmp".into(),
        58 => "ipv6-icmp".into(),
        50 => "esp".into(),
        51 => "ah".into(),
        135 => "mh".into(),
        0 => "all".into(),
        n => n.to_string(),
    }
}

fn address(b: &[u8], family: IpFamily) -> String {
    match family {
        IpFamily::V4 => match <[u8; 4]>::try_from(b) {
            Ok(a) => Ipv4Addr::from(a).to_string(),
            Err(_) => String::from("?"),
        },
        IpFamily::V6 => match <[u8; 16]>::try_from(b) {
            Ok(a) => Ipv6Addr::from(a).to_string(),
            Err(_) => String::from("?"),
        },
    }
}

/// `addr/len` for a contiguous mask, `addr/mask` otherwise (the value is masked, as the tool
/// prints it).
fn address_match(m: &AddrMatch, family: IpFamily) -> String {
    let value: Vec<u8> = m.value.iter().zip(&m.mask).map(|(v, k)| v & k).collect();
    let bits: u32 = m.mask.iter().map(|b| b.count_ones()).sum();
    let contiguous = m
        .mask
        .iter()
        .flat_map(|b| (0..8).rev().map(move |i| b >> i & 1))
        .skip(bits as usize)
        .all(|bit| bit == 0);
    if contiguous {
        format!("{}/{bits}", address(&value, family))
    } else {
        format!("{}/{}", address(&value, family), address(&m.mask, family))
    }
}

fn print(chain: &str, p: &Parts, family: IpFamily) -> String {
    let mut s = format!("[{}:{}] -A {chain}", p.counters.0, p.counters.1);
    let not = |inv: bool| if inv { " !" } else { "" };
    for (flag, m) in [("s", &p.src), ("d", &p.dst)] {
        if let Some(m) = m {
            let _ = write!(s, "{} -{flag} {}", not(m.inverted), address_match(m, family));
        }
    }
    for (flag, m) in [("i", &p.iif), ("o", &p.oif)] {
        if let Some((name, inv)) = m {
            let _ = write!(s, "{} -{flag} {name}", not(*inv));
        }
    }
    if let Some((proto, inv)) = p.proto {
        let _ = write!(s, "{} -p {}", not(inv), proto_name(proto));
    }
    let proto = p.proto.map(|(n, _)| proto_name(n)).unwrap_or_else(|| "tcp".into());
    for m in &p.matches {
        match m {
            Piece::Text(t) => s.push_str(t),
            Piece::Ports(sport, dport) => {
                let _ = write!(s, " -m {proto}");
                for (flag, ports) in [("sport", sport), ("dport", dport)] {
                    if let Some(ports) = ports {
                        s.push_str(&port_option(flag, ports.low, ports.high, ports.inverted));
                    }
                }
            }
        }
    }
    s.push_str(&p.target);
    s
}

/// ` [!] --dport N` or ` [!] --dport N:M`, as libxt_tcp/udp/sctp print it.
fn port_option(flag: &str, low: u16, high: u16, inverted: bool) -> String {
    let not = if inverted { " !" } else { "" };
    if low == high {
        format!("{not} --{flag} {low}")
    } else {
        format!("{not} --{flag} {low}:{high}")
    }
}

/// A string as libxtables' `xtables_save_string` writes it: bare when it is only letters,
/// digits, `_` and `-`, else in double quotes with `"`, `\` and `'` escaped.
pub fn save_string(value: &str) -> String {
    let bare = !value.is_empty() && value.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        return format!(" {value}");
    }
    let mut s = String::from(" \"");
    for c in value.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('"');
    s
}

fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn be16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// The address of `family` at `at` in a `union nf_inet_addr`.
fn inet_addr_at(b: &[u8], at: usize, family: IpFamily) -> Option<IpAddr> {
    Some(match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(b.get(at..at + 4)?).ok()?)),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b.get(at..at + 16)?).ok()?)),
    })
}

const ADDRTYPES: [&str; 12] = [
    "UNSPEC", "UNICAST", "LOCAL", "BROADCAST", "ANYCAST", "MULTICAST", "BLACKHOLE", "UNREACHABLE", "PROHIBIT", "THROW",
    "NAT", "XRESOLVE",
];

/// The options an xt match prints after `-m NAME` (its extension's `save`), for the
/// revisions iptables 1.8 uses; None for any other.
fn xt_match(name: &str, rev: u32, info: &[u8], family: IpFamily) -> Option<String> {
    match (name, rev) {
        // struct xt_comment_info { char comment[256]; }
        ("comment", 0) => Some(format!(" --comment{}", save_string(&c_string(info)))),
        // struct xt_statistic_info { u16 mode, flags; union { u32 probability; … } }
        ("statistic", 0) => {
            let (mode, flags, p) = (read_u16(info, 0)?, read_u16(info, 2)?, read_u32(info, 4)?);
            if mode != 0 {
                return None;
            }
            let not = if flags & 1 != 0 { " !" } else { "" };
            Some(format!(
                " --mode random{not} --probability {:.11}",
                f64::from(p) / f64::from(0x8000_0000u32)
            ))
        }
        // struct xt_recent_mtinfo_v1 { u32 seconds, hit_count; u8 check_set, invert;
        // char name[200]; u8 side; union nf_inet_addr mask; }
        ("recent", 1) => {
            let (seconds, hits) = (read_u32(info, 0)?, read_u32(info, 4)?);
            let (check, invert) = (*info.get(8)?, *info.get(9)?);
            let rname = c_string(info.get(10..210)?);
            let side = *info.get(210)?;
            let mask = inet_addr_at(info, 212, family)?;
            let mut s = String::new();
            if invert != 0 {
                s.push_str(" !");
            }
            for (bit, opt) in [(2, " --set"), (1, " --rcheck"), (4, " --update"), (8, " --remove")] {
                if check & bit != 0 {
                    s.push_str(opt);
                }
            }
            if seconds != 0 {
                let _ = write!(s, " --seconds {seconds}");
            }
            if check & 32 != 0 {
                s.push_str(" --reap");
            }
            if hits != 0 {
                let _ = write!(s, " --hitcount {hits}");
            }
            if check & 16 != 0 {
                s.push_str(" --rttl");
            }
            let _ = write!(s, " --name {rname} --mask {mask}");
            s.push_str(match side {
                0 => " --rsource",
                1 => " --rdest",
                _ => "",
            });
            Some(s)
        }
        // struct xt_addrtype_info_v1 { u16 source, dest; u32 flags; }
        ("addrtype", 1) => {
            let (src, dst, flags) = (read_u16(info, 0)?, read_u16(info, 2)?, read_u32(info, 4)?);
            let types = |mask: u16| {
                ADDRTYPES
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, n)| *n)
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let mut s = String::new();
            if src != 0 {
                let not = if flags & 1 != 0 { " !" } else { "" };
                let _ = write!(s, "{not} --src-type {}", types(src));
            }
            if dst != 0 {
                let not = if flags & 2 != 0 { " !" } else { "" };
                let _ = write!(s, "{not} --dst-type {}", types(dst));
            }
            if flags & 4 != 0 {
                s.push_str(" --limit-iface-in");
            }
            if flags & 8 != 0 {
                s.push_str(" --limit-iface-out");
            }
            Some(s)
        }
        // struct xt_conntrack_mtinfo3: 8 addresses (128 bytes), u32 expires_min, max; u16
        // l4proto; 4 × be16 ports; u16 match_flags, invert_flags, state_mask, status_mask; …
        ("conntrack", 3) => {
            let (flags, invert, states) = (read_u16(info, 146)?, read_u16(info, 148)?, read_u16(info, 150)?);
            // Only --ctstate: other options print text this reader does not produce.
            if flags != 1 {
                return None;
            }
            let names = [
                (1 << 0, "INVALID"),
                (1 << 3, "NEW"),
                (1 << 2, "RELATED"),
                (1 << 1, "ESTABLISHED"),
                (1 << 8, "UNTRACKED"),
                (1 << 6, "SNAT"),
                (1 << 7, "DNAT"),
            ];
            let listed: Vec<&str> = names.iter().filter(|(b, _)| states & b != 0).map(|(_, n)| *n).collect();
            let not = if invert & 1 != 0 { " !" } else { "" };
            Some(format!("{not} --ctstate {}", listed.join(",")))
        }
        // struct xt_tcp { u16 spts[2], dpts[2]; u8 option, flg_mask, flg_cmp, invflags; }
        // struct xt_udp { u16 spts[2], dpts[2]; u8 invflags; }
        ("tcp" | "udp", 0) => {
            let (s0, s1, d0, d1) = (
                read_u16(info, 0)?,
                read_u16(info, 2)?,
                read_u16(info, 4)?,
                read_u16(info, 6)?,
            );
            let inv = if name == "tcp" {
                if info.get(8..11)?.iter().any(|b| *b != 0) {
                    return None;
                }
                *info.get(11)?
            } else {
                *info.get(8)?
            };
            let mut s = String::new();
            if (s0, s1) != (0, u16::MAX) {
                s.push_str(&port_option("sport", s0, s1, inv & 1 != 0));
            }
            if (d0, d1) != (0, u16::MAX) {
                s.push_str(&port_option("dport", d0, d1, inv & 2 != 0));
            }
            Some(s)
        }
        // struct xt_sctp_info { u16 dpts[2], spts[2]; u32 chunkmap[64], chunk_match_type;
        // flag_info[4] (12 bytes); int flag_count; u32 flags, invflags; }
        ("sctp", 0) => {
            let (d0, d1, s0, s1) = (
                read_u16(info, 0)?,
                read_u16(info, 2)?,
                read_u16(info, 4)?,
                read_u16(info, 6)?,
            );
            let (flags, inv) = (read_u32(info, 284)?, read_u32(info, 288)?);
            if flags & !3 != 0 {
                return None;
            }
            let mut s = String::new();
            if flags & 1 != 0 {
                s.push_str(&port_option("sport", s0, s1, inv & 1 != 0));
            }
            if flags & 2 != 0 {
                s.push_str(&port_option("dport", d0, d1, inv & 2 != 0));
            }
            Some(s)
        }
        // struct xt_mark_mtinfo1 { u32 mark, mask; u8 invert; }
        ("mark", 1) => {
            let (mark, mask, invert) = (read_u32(info, 0)?, read_u32(info, 4)?, *info.get(8)?);
            let not = if invert != 0 { " !" } else { "" };
            let mask = if mask == u32::MAX {
                String::new()
            } else {
                format!("/0x{mask:x}")
            };
            Some(format!("{not} --mark 0x{mark:x}{mask}"))
        }
        // struct xt_nfacct_match_info { char name[32]; … }
        ("nfacct", 0 | 1) => Some(format!(" --nfacct-name {}", c_string(info.get(..32)?))),
        _ => None,
    }
}

/// The options an xt target prints after `-j NAME`.
fn xt_target(name: &str, rev: u32, info: &[u8], family: IpFamily) -> Option<String> {
    const MAP_IPS: u32 = 1;
    const PROTO_SPECIFIED: u32 = 2;
    const RANDOM: u32 = 4;
    const PERSISTENT: u32 = 8;
    const RANDOM_FULLY: u32 = 16;
    let nat_flags = |flags: u32| {
        let mut s = String::new();
        for (bit, opt) in [
            (RANDOM, " --random"),
            (RANDOM_FULLY, " --random-fully"),
            (PERSISTENT, " --persistent"),
        ] {
            if flags & bit != 0 {
                s.push_str(opt);
            }
        }
        s
    };
    match (name, rev) {
        // struct nf_nat_range(2) { u32 flags; nf_inet_addr min_addr, max_addr; be16 min_proto,
        // max_proto; … }
        ("DNAT", 1 | 2) => {
            let flags = read_u32(info, 0)?;
            if flags & !(MAP_IPS | PROTO_SPECIFIED | RANDOM | PERSISTENT | RANDOM_FULLY) != 0 || flags & MAP_IPS == 0 {
                return None;
            }
            let (min, max) = (inet_addr_at(info, 4, family)?, inet_addr_at(info, 20, family)?);
            let (low, high) = (be16_at(info, 36)?, be16_at(info, 38)?);
            let v6 = family == IpFamily::V6;
            let mut s = String::from(" --to-destination ");
            let ports = flags & PROTO_SPECIFIED != 0;
            if v6 && ports {
                s.push('[');
            }
            let _ = write!(s, "{min}");
            if max != min {
                let _ = write!(s, "-{max}");
            }
            if v6 && ports {
                s.push(']');
            }
            if ports {
                let _ = write!(s, ":{low}");
                if high != low {
                    let _ = write!(s, "-{high}");
                }
            }
            s.push_str(&nat_flags(flags & !(MAP_IPS | PROTO_SPECIFIED)));
            Some(s)
        }
        // struct xt_mark_tginfo2 { u32 mark, mask; }
        ("MARK", 2) => Some(format!(
            " --set-xmark 0x{:x}/0x{:x}",
            read_u32(info, 0)?,
            read_u32(info, 4)?
        )),
        // IPv4: struct nf_nat_ipv4_multi_range_compat { u32 rangesize; { u32 flags; be32
        // min_ip, max_ip; be16 min, max; } }; IPv6: struct nf_nat_range.
        ("MASQUERADE", 0) => {
            let (flags, ports_at) = match family {
                IpFamily::V4 => (read_u32(info, 4)?, 16),
                IpFamily::V6 => (read_u32(info, 0)?, 36),
            };
            let mut s = String::new();
            if flags & PROTO_SPECIFIED != 0 {
                let (low, high) = (be16_at(info, ports_at)?, be16_at(info, ports_at + 2)?);
                let _ = write!(s, " --to-ports {low}");
                if high != low {
                    let _ = write!(s, "-{high}");
                }
            }
            s.push_str(&nat_flags(flags & !PROTO_SPECIFIED));
            Some(s)
        }
        // struct ipt_reject_info / ip6t_reject_info { u32 with; }
        ("REJECT", 0) => {
            let with = read_u32(info, 0)?;
            let names: &[&str] = match family {
                IpFamily::V4 => &[
                    "icmp-net-unreachable", "icmp-host-unreachable", "icmp-proto-unreachable", "icmp-port-unreachable",
                    "", "icmp-net-prohibited", "icmp-host-prohibited", "tcp-reset", "icmp-admin-prohibited",
                ],
                IpFamily::V6 => &[
                    "icmp6-no-route", "icmp6-adm-prohibited", "", "icmp6-addr-unreachable", "icmp6-port-unreachable",
                    "", "tcp-reset", "icmp6-policy-fail", "icmp6-reject-route",
                ],
            };
            let n = names.get(with as usize).filter(|n| !n.is_empty())?;
            Some(format!(" --reject-with {n}"))
        }
        _ => None,
    }
}

/// The built-in chains of an iptables table, in the order the tool lists them.
fn builtin_chains(table: &str) -> &'static [&'static str] {
    match table {
        "filter" => &["INPUT", "FORWARD", "OUTPUT"],
        "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        "mangle" => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        "raw" => &["PREROUTING", "OUTPUT"],
        "security" => &["INPUT", "FORWARD", "OUTPUT"],
        _ => &[],
    }
}

/// Chains that kube-proxy and the kubelet create and nothing jumps to.
const CANARIES: [&str; 2] = ["KUBE-PROXY-CANARY", "KUBE-KUBELET-CANARY"];

/// The edge: a `NETLINK_NETFILTER` socket in the calling thread's network namespace.
pub struct NetlinkSave {
    socket: Socket,
    buf: Vec<u8>,
    seq: u32,
    family: IpFamily,
}

/// What the walk found of one chain.
struct ChainRead {
    declaration: String,
    rules: Vec<String>,
}

/// The chains reached so far, by any of the reading threads.
type Seen = Mutex<HashSet<String>>;

/// Queues `chain` unless it was reached before.
fn reach(seen: &Seen, queue: &mut VecDeque<String>, chain: &str) {
    let fresh = match seen.lock() {
        Ok(mut s) => s.insert(chain.to_string()),
        Err(poisoned) => poisoned.into_inner().insert(chain.to_string()),
    };
    if fresh {
        queue.push_back(chain.to_string());
    }
}

impl NetlinkSave {
    pub fn new(family: IpFamily) -> io::Result<NetlinkSave> {
        Ok(NetlinkSave {
            socket: netlink::netfilter_socket()?,
            buf: vec![0; 64 * 1024],
            seq: 0,
            family,
        })
    }

    fn request(&mut self, msg: u16, dump: bool, put: impl FnOnce(&mut MsgBuf)) -> (u32, Vec<u8>) {
        self.seq = self.seq.wrapping_add(1);
        let flags = if dump {
            NLM_F_REQUEST | NLM_F_DUMP
        } else {
            NLM_F_REQUEST
        };
        let mut b = MsgBuf::default();
        let m = b.begin_msg(nft_type(msg), flags, self.seq, &nfgenmsg(nfproto(self.family), 0));
        put(&mut b);
        b.end_msg(m);
        (self.seq, b.buf)
    }

    fn get(&mut self, msg: u16, put: impl FnOnce(&mut MsgBuf)) -> io::Result<Option<Vec<u8>>> {
        let (seq, req) = self.request(msg, false, put);
        netlink::get(&self.socket, &mut self.buf, &req, seq)
    }

    fn dump(&mut self, msg: u16, put: impl FnOnce(&mut MsgBuf)) -> io::Result<Vec<Vec<u8>>> {
        let (seq, req) = self.request(msg, true, put);
        let dumped = netlink::dump(&self.socket, &mut self.buf, &req, seq)?;
        if dumped.interrupted {
            return Err(io::Error::other("the table changed while it was read"));
        }
        Ok(dumped.messages.into_iter().map(|(_, m)| m).collect())
    }

    /// `table` as `iptables-save -c -t TABLE` writes it (chains in the order the jumps reach
    /// them), or None when there is no such table. Chains of other owners (not `KUBE-…`) are
    /// followed for their jumps; their rules that this reader cannot print are left out.
    pub fn save(&mut self, table: &str) -> Result<Option<String>, SaveError> {
        let Some(t) = self.get(NFT_MSG_GETTABLE, |b| b.put_str(NFTA_TABLE_NAME, table))? else {
            return Ok(None);
        };
        let use_count = t
            .get(NLMSG_HDRLEN + 4..)
            .and_then(|p| Attrs::parse(p).ok())
            .and_then(|a| be32(&a, NFTA_TABLE_USE));
        let seen = Seen::default();
        let (mut queue, mut read) = (VecDeque::new(), Vec::new());
        for b in builtin_chains(table) {
            reach(&seen, &mut queue, b);
        }
        self.walk_all(table, &seen, queue, &mut read)?;
        // The table counts its chains (and sets: iptables-nft makes none for these rules).
        let unreached = |read: &Vec<ChainRead>| use_count.is_none_or(|n| n as usize > read.len());
        // The canaries are there and reached by no jump: asked for by name, they spare the
        // whole list on a healthy node.
        if unreached(&read) {
            let mut queue = VecDeque::new();
            for canary in CANARIES {
                if self.chain_exists(table, canary)? {
                    reach(&seen, &mut queue, canary);
                }
            }
            self.walk_all(table, &seen, queue, &mut read)?;
        }
        // Chains still unreached (stale ones, another owner's): only the whole list names them.
        if unreached(&read) {
            let mut queue = VecDeque::new();
            for name in self.chain_names(table)? {
                reach(&seen, &mut queue, &name);
            }
            self.walk_all(table, &seen, queue, &mut read)?;
        }
        let mut out = format!("*{table}\n");
        for c in &read {
            out.push_str(&c.declaration);
            out.push('\n');
        }
        for c in &read {
            for r in &c.rules {
                out.push_str(r);
                out.push('\n');
            }
        }
        out.push_str("COMMIT\n");
        Ok(Some(out))
    }

    /// Reads the chains of `queue` and every chain they lead to: one after the other until the
    /// queue is wide, then on a socket per core (the kernel's encoding of the rules is most of
    /// the time).
    fn walk_all(
        &mut self,
        table: &str,
        seen: &Seen,
        mut queue: VecDeque<String>,
        read: &mut Vec<ChainRead>,
    ) -> Result<(), SaveError> {
        const WIDE: usize = 64;
        self.walk(table, seen, &mut queue, read, Some(WIDE))?;
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4);
        if queue.is_empty() || workers == 1 {
            return self.walk(table, seen, &mut queue, read, None);
        }
        let per = queue.len().div_ceil(workers);
        let parts: Vec<VecDeque<String>> = Vec::from(queue)
            .chunks(per)
            .map(|c| c.iter().cloned().collect())
            .collect();
        let family = self.family;
        let results: Vec<Result<Vec<ChainRead>, SaveError>> = std::thread::scope(|s| {
            let handles: Vec<_> = parts
                .into_iter()
                .map(|mut part| {
                    s.spawn(move || {
                        let mut reader = NetlinkSave::new(family)?;
                        let mut out = Vec::new();
                        reader.walk(table, seen, &mut part, &mut out, None)?;
                        Ok(out)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(io::Error::other("a reading thread panicked").into()))
                })
                .collect()
        });
        for r in results {
            read.extend(r?);
        }
        Ok(())
    }

    /// Reads the chains of `queue`, queueing the chains their rules jump to, until the queue
    /// is empty or holds `until` chains.
    fn walk(
        &mut self,
        table: &str,
        seen: &Seen,
        queue: &mut VecDeque<String>,
        read: &mut Vec<ChainRead>,
        until: Option<usize>,
    ) -> Result<(), SaveError> {
        while until.is_none_or(|n| queue.len() < n)
            && let Some(chain) = queue.pop_front()
        {
            let declaration = if builtin_chains(table).contains(&chain.as_str()) {
                // iptables-nft creates a built-in chain when it first needs it.
                match self.builtin_declaration(table, &chain)? {
                    Some(d) => d,
                    None => continue,
                }
            } else {
                format!(":{chain} - [0:0]")
            };
            let messages = self.dump(NFT_MSG_GETRULE, |b| {
                b.put_str(NFTA_RULE_TABLE, table);
                b.put_str(NFTA_RULE_CHAIN, &chain);
            })?;
            let ours = chain.starts_with("KUBE-");
            let mut rules = Vec::with_capacity(messages.len());
            for m in &messages {
                match rule_line(m, self.family) {
                    Ok(r) => {
                        if let Some(t) = &r.target {
                            reach(seen, queue, t);
                        }
                        rules.push(r.line);
                    }
                    Err(e) if ours => return Err(e.into()),
                    // Another owner's rule: its jump is followed, its line left out.
                    Err(_) => {
                        if let Some(t) = jump_of(m) {
                            reach(seen, queue, &t);
                        }
                    }
                }
            }
            read.push(ChainRead { declaration, rules });
        }
        Ok(())
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, SaveError> {
        let found = self.get(NFT_MSG_GETCHAIN, |b| {
            b.put_str(NFTA_CHAIN_TABLE, table);
            b.put_str(NFTA_CHAIN_NAME, chain);
        })?;
        Ok(found.is_some())
    }

    /// `:CHAIN POLICY [pkts:bytes]` of a built-in chain, None when it is not there.
    fn builtin_declaration(&mut self, table: &str, chain: &str) -> Result<Option<String>, SaveError> {
        let Some(msg) = self.get(NFT_MSG_GETCHAIN, |b| {
            b.put_str(NFTA_CHAIN_TABLE, table);
            b.put_str(NFTA_CHAIN_NAME, chain);
        })?
        else {
            return Ok(None);
        };
        let a = Some(msg.as_slice())
            .and_then(|m| m.get(NLMSG_HDRLEN + 4..))
            .and_then(|p| Attrs::parse(p).ok());
        let policy = match a.as_ref().and_then(|a| be32(a, NFTA_CHAIN_POLICY)) {
            Some(p) if p as i32 == NF_DROP => "DROP",
            _ => "ACCEPT",
        };
        let counters = a.as_ref().and_then(|a| a.nested(NFTA_CHAIN_COUNTERS).ok().flatten());
        let (pkts, bytes) = counters
            .map(|c| {
                (
                    be64(&c, NFTA_COUNTER_PACKETS).unwrap_or(0),
                    be64(&c, NFTA_COUNTER_BYTES).unwrap_or(0),
                )
            })
            .unwrap_or((0, 0));
        Ok(Some(format!(":{chain} {policy} [{pkts}:{bytes}]")))
    }

    /// The names of every chain of `table` (the dump of the family's chains, the costly part
    /// of `iptables-save`).
    fn chain_names(&mut self, table: &str) -> Result<Vec<String>, SaveError> {
        let messages = self.dump(NFT_MSG_GETCHAIN, |b| b.put_str(NFTA_CHAIN_TABLE, table))?;
        Ok(messages
            .iter()
            .filter_map(|m| {
                let a = Attrs::parse(m.get(NLMSG_HDRLEN + 4..)?).ok()?;
                (a.str(NFTA_CHAIN_TABLE, "table").ok().flatten()? == table)
                    .then(|| a.str(NFTA_CHAIN_NAME, "name").ok().flatten().map(str::to_string))
                    .flatten()
            })
            .collect())
    }
}

/// The chain a rule message's verdict jumps or goes to, whatever else the rule holds.
fn jump_of(msg: &[u8]) -> Option<String> {
    let a = Attrs::parse(msg.get(NLMSG_HDRLEN + 4..)?).ok()?;
    for (_, e) in netlink::attributes_of(a.get(NFTA_RULE_EXPRESSIONS)?)? {
        let e = Attrs::parse(e).ok()?;
        if e.str(NFTA_EXPR_NAME, "name").ok().flatten() != Some("immediate") {
            continue;
        }
        let d = e.nested(NFTA_EXPR_DATA).ok().flatten()?;
        let v = d
            .nested(NFTA_IMMEDIATE_DATA)
            .ok()
            .flatten()?
            .nested(NFTA_DATA_VERDICT)
            .ok()
            .flatten()?;
        if let Some(c) = v.str(NFTA_VERDICT_CHAIN, "chain").ok().flatten() {
            return Some(c.to_string());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An expression's name and what puts its attributes.
    type Expr<'a> = (&'a str, &'a dyn Fn(&mut MsgBuf));

    /// A rule message as the kernel sends it in a dump, with `exprs`.
    fn rule_msg(chain: &str, exprs: &[Expr<'_>]) -> Vec<u8> {
        let mut b = MsgBuf::default();
        let m = b.begin_msg(nft_type(NFT_MSG_NEWRULE), 0, 1, &nfgenmsg(NFPROTO_IPV4, 0));
        b.put_str(NFTA_RULE_TABLE, "nat");
        b.put_str(NFTA_RULE_CHAIN, chain);
        let list = b.nest_start(NFTA_RULE_EXPRESSIONS);
        for (name, put) in exprs {
            let e = b.nest_start(NFTA_LIST_ELEM);
            b.put_str(NFTA_EXPR_NAME, name);
            let d = b.nest_start(NFTA_EXPR_DATA);
            put(&mut b);
            b.nest_end(d);
            b.nest_end(e);
        }
        b.nest_end(list);
        b.end_msg(m);
        b.buf
    }

    fn value(b: &mut MsgBuf, ty: u16, v: &[u8]) {
        let n = b.nest_start(ty);
        b.put(NFTA_DATA_VALUE, v);
        b.nest_end(n);
    }

    fn cmp(b: &mut MsgBuf, op: u32, v: &[u8]) {
        b.put_be32(NFTA_CMP_SREG, 1);
        b.put_be32(NFTA_CMP_OP, op);
        value(b, NFTA_CMP_DATA, v);
    }

    fn payload(b: &mut MsgBuf, base: u32, offset: u32, len: u32) {
        b.put_be32(NFTA_PAYLOAD_DREG, 1);
        b.put_be32(NFTA_PAYLOAD_BASE, base);
        b.put_be32(NFTA_PAYLOAD_OFFSET, offset);
        b.put_be32(NFTA_PAYLOAD_LEN, len);
    }

    fn xt(b: &mut MsgBuf, name: &str, rev: u32, info: &[u8]) {
        b.put_str(NFTA_XT_NAME, name);
        b.put_be32(NFTA_XT_REV, rev);
        b.put(NFTA_XT_INFO, info);
    }

    fn jump(b: &mut MsgBuf, chain: &str) {
        b.put_be32(NFTA_IMMEDIATE_DREG, REG_VERDICT);
        let data = b.nest_start(NFTA_IMMEDIATE_DATA);
        let v = b.nest_start(NFTA_DATA_VERDICT);
        b.put_be32(NFTA_VERDICT_CODE, NFT_JUMP as u32);
        b.put_str(NFTA_VERDICT_CHAIN, chain);
        b.nest_end(v);
        b.nest_end(data);
    }

    fn comment(text: &str) -> Vec<u8> {
        let mut info = vec![0u8; 256];
        info[..text.len()].copy_from_slice(text.as_bytes());
        info
    }

    #[test]
    fn a_service_rule_reads_as_the_tool_saves_it() {
        let msg = rule_msg(
            "KUBE-SERVICES",
            &[
                ("meta", &|b| {
                    b.put_be32(NFTA_META_DREG, 1);
                    b.put_be32(NFTA_META_KEY, NFT_META_L4PROTO);
                }),
                ("cmp", &|b| cmp(b, NFT_CMP_EQ, &[6])),
                ("payload", &|b| payload(b, NFT_PAYLOAD_NETWORK_HEADER, 16, 4)),
                ("cmp", &|b| cmp(b, NFT_CMP_EQ, &[10, 96, 0, 1])),
                ("payload", &|b| payload(b, NFT_PAYLOAD_NETWORK_HEADER, 12, 2)),
                ("cmp", &|b| cmp(b, NFT_CMP_NEQ, &[10, 244])),
                ("match", &|b| {
                    xt(b, "comment", 0, &comment("default/web:http cluster IP"))
                }),
                ("payload", &|b| payload(b, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2)),
                ("cmp", &|b| cmp(b, NFT_CMP_EQ, &80u16.to_be_bytes())),
                ("counter", &|b| {
                    b.put_be64(NFTA_COUNTER_BYTES, 180);
                    b.put_be64(NFTA_COUNTER_PACKETS, 3);
                }),
                ("immediate", &|b| jump(b, "KUBE-SVC-ABC")),
            ],
        );
        let r = rule_line(&msg, IpFamily::V4).expect("decodes");
        assert_eq!(
            r.line,
            "[3:180] -A KUBE-SERVICES ! -s 10.244.0.0/16 -d 10.96.0.1/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-ABC"
        );
        assert_eq!(r.target.as_deref(), Some("KUBE-SVC-ABC"));
    }

    #[test]
    fn targets_and_masks_read_as_the_tool_saves_them() {
        // MARK --or-mark 0x4000 after a mark match with a mask.
        let msg = rule_msg(
            "KUBE-POSTROUTING",
            &[
                ("meta", &|b| {
                    b.put_be32(NFTA_META_DREG, 1);
                    b.put_be32(NFTA_META_KEY, NFT_META_MARK);
                }),
                ("bitwise", &|b| {
                    b.put_be32(NFTA_BITWISE_SREG, 1);
                    b.put_be32(NFTA_BITWISE_DREG, 1);
                    value(b, NFTA_BITWISE_MASK, &0x4000u32.to_ne_bytes());
                    value(b, NFTA_BITWISE_XOR, &[0; 4]);
                }),
                ("cmp", &|b| cmp(b, NFT_CMP_NEQ, &0x4000u32.to_ne_bytes())),
                ("target", &|b| {
                    let mut info = 0x4000u32.to_ne_bytes().to_vec();
                    info.extend(0u32.to_ne_bytes());
                    xt(b, "MARK", 2, &info)
                }),
            ],
        );
        let r = rule_line(&msg, IpFamily::V4).expect("decodes");
        assert_eq!(
            r.line,
            "[0:0] -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j MARK --set-xmark 0x4000/0x0"
        );
        assert_eq!(r.target, None);

        // DNAT to [fd00::5]:8080 (struct nf_nat_range2).
        let mut range = vec![0u8; 44];
        range[..4].copy_from_slice(&3u32.to_ne_bytes());
        let addr: Ipv6Addr = "fd00::5".parse().expect("address");
        range[4..20].copy_from_slice(&addr.octets());
        range[20..36].copy_from_slice(&addr.octets());
        range[36..38].copy_from_slice(&8080u16.to_be_bytes());
        range[38..40].copy_from_slice(&8080u16.to_be_bytes());
        let msg = rule_msg("KUBE-SEP-X", &[("target", &|b| xt(b, "DNAT", 2, &range))]);
        let r = rule_line(&msg, IpFamily::V6).expect("decodes");
        assert_eq!(r.line, "[0:0] -A KUBE-SEP-X -j DNAT --to-destination [fd00::5]:8080");
    }

    #[test]
    fn a_shape_it_does_not_print_is_undecodable_not_guessed() {
        let msg = rule_msg("KUBE-SVC-X", &[("match", &|b| xt(b, "multiport", 1, &[0; 8]))]);
        let e = rule_line(&msg, IpFamily::V4).expect_err("multiport is not printed here");
        assert_eq!(e.chain, "KUBE-SVC-X");
        assert!(e.reason.contains("multiport"), "{e}");
        let msg = rule_msg("KUBE-SVC-X", &[("lookup", &|b| b.put_str(1, "set"))]);
        assert!(rule_line(&msg, IpFamily::V4).is_err());
        // A comment in the rule's userdata: the tool would print it, so this reader refuses.
        let mut msg = rule_msg("KUBE-SVC-X", &[]);
        let mut b = MsgBuf::default();
        b.put(NFTA_RULE_USERDATA, &[UDATA_RULE_COMMENT, 2, b'h', b'i']);
        let len = u32::from_ne_bytes(msg[..4].try_into().expect("length")) as usize + b.buf.len();
        msg.extend_from_slice(&b.buf);
        msg[..4].copy_from_slice(&(len as u32).to_ne_bytes());
        let e = rule_line(&msg, IpFamily::V4).expect_err("a userdata comment");
        assert!(e.reason.contains("userdata"), "{e}");
    }

    #[test]
    fn strings_are_quoted_as_libxtables_quotes_them() {
        assert_eq!(save_string("web-1_a"), " web-1_a");
        assert_eq!(save_string("ns/svc:port"), " \"ns/svc:port\"");
        assert_eq!(save_string("a\"b'c\\d"), " \"a\\\"b\\'c\\\\d\"");
        assert_eq!(save_string(""), " \"\"");
    }
}
