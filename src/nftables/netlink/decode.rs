//! The other direction of `encode`: the `kube-proxy` table as the kernel dumps it (chains,
//! sets and maps with their elements, rules as expression lists) read back into the table
//! model ([`Ruleset`]) that the renderer's transactions produce, so that `explain` compares
//! and `trace --live` walks the kernel's table with the same code as a render. Pure.
//!
//! Sets are typed by the kernel's key type and length and nft's userdata (a `typeof numgen`
//! key's modulus, a DNAT map's protocol); the intervals of a numgen map (a start with its
//! value, an end flagged one past its last number) become `first-last` elements.
//!
//! Rules are recognised by the expression sequences `expr` writes for each [`Match`] and
//! [`Statement`]; a rule of any other shape (someone else's, or an edit by hand) is not
//! guessed at: it is reported with its expression names. What the kernel does not keep (the
//! order and spacing of a set's items, a one-item `{ x }`, which nft sends as a comparison)
//! is not restored: such rules compare equal by
//! [`canonical_line`](crate::nftables::readback::canonical_line).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::encode::{PROTO_DESC_SCTP, PROTO_DESC_TCP, PROTO_DESC_UDP, TYPE_BITS, TYPE_INTEGER};
use super::expr::*;
use super::wire::*;
use crate::model::{IpFamily, Protocol};
use crate::netlink::{Attrs, NLMSG_HDRLEN};
use crate::nftables::ast::{
    AddrSpec, BaseHook, ChainDecl, Dir, ElemKey, ElemValue, Element, KeyType, MapValue, Match, Rule, SetDecl,
    Statement, Verdict, VmapKey,
};
use crate::nftables::ruleset::{Chain, Ruleset, Set};

/// A chain message: its table and declaration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainMsg {
    pub table: String,
    pub decl: ChainDecl,
}

/// A set message: its table, declaration, and whether it is anonymous (a rule's `{ … }`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetMsg {
    pub table: String,
    pub decl: SetDecl,
    pub anonymous: bool,
    pub interval: bool,
    /// Key length in bytes (4 for a numgen map).
    pub key_len: u32,
}

/// One element as the kernel keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElemMsg {
    pub key: Vec<u8>,
    pub verdict: Option<Verdict>,
    /// The data of a map of values (not verdicts): `address . port` of a DNAT.
    pub value: Option<Vec<u8>>,
    pub interval_end: bool,
    pub comment: Option<String>,
}

/// A rule of the table that is not of a shape kube-proxy writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undecoded {
    pub chain: String,
    /// The expression names, e.g. `payload cmp counter`.
    pub exprs: String,
    pub reason: String,
}

fn payload_of(msg: &[u8]) -> Option<&[u8]> {
    msg.get(NLMSG_HDRLEN + 4..)
}

fn be32(a: &Attrs<'_>, ty: u16) -> Option<u32> {
    a.raw4(ty, "attribute").ok().flatten().map(u32::from_be_bytes)
}

fn string(a: &Attrs<'_>, ty: u16) -> Option<String> {
    a.str(ty, "string").ok().flatten().map(str::to_string)
}

/// The value of type `ty` in libnftnl userdata TLVs.
pub fn udata_get(data: Option<&[u8]>, ty: u8) -> Option<&[u8]> {
    let mut rest = data?;
    while let [t, len, tail @ ..] = rest {
        let len = usize::from(*len);
        let value = tail.get(..len)?;
        if *t == ty {
            return Some(value);
        }
        rest = &tail[len..];
    }
    None
}

/// A u32 in userdata (host byte order, as `nftnl_udata_put_u32` stores it).
fn udata_u32(data: Option<&[u8]>, ty: u8) -> Option<u32> {
    Some(u32::from_ne_bytes(udata_get(data, ty)?.try_into().ok()?))
}

/// The comment in libnftnl userdata TLVs of type `ty`.
fn udata_comment(data: Option<&[u8]>, ty: u8) -> Option<String> {
    let value = udata_get(data, ty)?;
    Some(String::from_utf8_lossy(value.split(|c| *c == 0).next().unwrap_or_default()).into_owned())
}

/// The modulus of a `typeof numgen random mod M` key, from the set's userdata.
fn numgen_modulus(udata: Option<&[u8]>) -> Option<u32> {
    let key_typeof = udata_get(udata, UDATA_SET_KEY_TYPEOF)?;
    let numgen = udata_get(Some(key_typeof), UDATA_SET_TYPEOF_DATA)?;
    udata_u32(Some(numgen), 1)
}

/// The protocol of a `typeof … : ip daddr . tcp dport` map's data, from the set's userdata.
fn data_port_protocol(udata: Option<&[u8]>) -> Option<Protocol> {
    let data_typeof = udata_get(udata, UDATA_SET_DATA_TYPEOF)?;
    let fields = udata_get(Some(data_typeof), UDATA_SET_TYPEOF_DATA)?;
    let port = udata_get(Some(udata_get(Some(fields), 1)?), UDATA_SET_TYPEOF_DATA)?;
    match udata_u32(Some(port), 0)? {
        PROTO_DESC_TCP => Some(Protocol::Tcp),
        PROTO_DESC_UDP => Some(Protocol::Udp),
        PROTO_DESC_SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

fn hook_name(n: u32) -> Option<&'static str> {
    Some(match n {
        0 => "prerouting",
        1 => "input",
        2 => "forward",
        3 => "output",
        4 => "postrouting",
        _ => return None,
    })
}

/// A `NEWCHAIN` message (a dump's reply or a batch's command).
pub fn chain(msg: &[u8]) -> Option<ChainMsg> {
    let a = Attrs::parse(payload_of(msg)?).ok()?;
    let name = string(&a, NFTA_CHAIN_NAME)?;
    let base = match a.nested(NFTA_CHAIN_HOOK).ok().flatten() {
        Some(h) => {
            let kind = match string(&a, NFTA_CHAIN_TYPE).as_deref() {
                Some("nat") => "nat",
                Some("route") => "route",
                _ => "filter",
            };
            let priority = a
                .get(NFTA_CHAIN_HOOK)
                .and_then(|_| h.raw4(NFTA_HOOK_PRIORITY, "priority").ok().flatten())
                .map_or(0, i32::from_be_bytes);
            Some(BaseHook {
                kind,
                hook: hook_name(be32(&h, NFTA_HOOK_HOOKNUM)?)?,
                priority,
            })
        }
        None => None,
    };
    Some(ChainMsg {
        table: string(&a, NFTA_CHAIN_TABLE)?,
        decl: ChainDecl {
            name,
            comment: if base.is_some() {
                None
            } else {
                udata_comment(a.get(NFTA_CHAIN_USERDATA), UDATA_CHAIN_COMMENT)
            },
            base,
        },
    })
}

/// A `NEWSET` message.
pub fn set(msg: &[u8], family: IpFamily) -> Option<SetMsg> {
    let a = Attrs::parse(payload_of(msg)?).ok()?;
    let flags = be32(&a, NFTA_SET_FLAGS).unwrap_or(0);
    let key_len = be32(&a, NFTA_SET_KEY_LEN)?;
    let key_type = be32(&a, NFTA_SET_KEY_TYPE).unwrap_or(0);
    let addr_len = if family == IpFamily::V4 { 4 } else { 16 };
    let udata = a.get(NFTA_SET_USERDATA);
    // An address pair's type is two address types concatenated; a numgen key is an integer.
    let pair = key_type >> TYPE_BITS != 0 && key_type >> TYPE_BITS == key_type & ((1 << TYPE_BITS) - 1);
    let key = match key_len {
        4 if key_type == TYPE_INTEGER => KeyType::Numgen(numgen_modulus(udata).unwrap_or(0)),
        l if l == 2 * addr_len && pair => KeyType::AddrPair,
        l if l == addr_len => KeyType::Addr,
        l if l == addr_len + 8 => KeyType::AddrProtoPort,
        8 => KeyType::ProtoPort,
        _ => KeyType::Addr,
    };
    let map = match be32(&a, NFTA_SET_DATA_TYPE) {
        _ if flags & NFT_SET_MAP == 0 => None,
        Some(NFT_DATA_VERDICT) => Some(MapValue::Verdict),
        // Only the numgen maps hold addresses and ports (typeof, with the protocol's port).
        _ => Some(MapValue::AddrPort(data_port_protocol(udata).unwrap_or(Protocol::Tcp))),
    };
    let timeout = a
        .u64(NFTA_SET_TIMEOUT, "timeout")
        .ok()
        .flatten()
        .map(|t| (u64::from_be(t) / 1000) as u32);
    Some(SetMsg {
        table: string(&a, NFTA_SET_TABLE)?,
        decl: SetDecl {
            name: string(&a, NFTA_SET_NAME)?,
            key,
            map,
            timeout_seconds: timeout.filter(|_| flags & NFT_SET_TIMEOUT != 0),
            comment: udata_comment(a.get(NFTA_SET_USERDATA), UDATA_SET_COMMENT),
        },
        anonymous: flags & NFT_SET_ANONYMOUS != 0,
        interval: flags & NFT_SET_INTERVAL != 0,
        key_len,
    })
}

fn verdict_of(data: &Attrs<'_>) -> Option<Verdict> {
    let v = data.nested(NFTA_DATA_VERDICT).ok()??;
    let code = v.raw4(NFTA_VERDICT_CODE, "code").ok()?.map(i32::from_be_bytes)?;
    let chain = string(&v, NFTA_VERDICT_CHAIN);
    Some(match code {
        NF_ACCEPT => Verdict::Accept,
        NF_DROP => Verdict::Drop,
        NFT_RETURN => Verdict::Return,
        NFT_JUMP => Verdict::Jump(chain?),
        NFT_GOTO => Verdict::Goto(chain?),
        _ => return None,
    })
}

/// The set name and elements of a `NEWSETELEM` message.
pub fn elements(msg: &[u8]) -> Option<(String, Vec<ElemMsg>)> {
    let a = Attrs::parse(payload_of(msg)?).ok()?;
    let set = string(&a, NFTA_SET_ELEM_LIST_SET)?;
    let mut out = Vec::new();
    let Some(list) = a.get(NFTA_SET_ELEM_LIST_ELEMENTS) else {
        return Some((set, out));
    };
    for (_, elem) in crate::netlink::attributes_of(list)? {
        let e = Attrs::parse(elem).ok()?;
        let key = e.nested(NFTA_SET_ELEM_KEY).ok()??.get(NFTA_DATA_VALUE)?.to_vec();
        let data = e.nested(NFTA_SET_ELEM_DATA).ok().flatten();
        let verdict = data.as_ref().and_then(verdict_of);
        let value = data.as_ref().and_then(|d| d.get(NFTA_DATA_VALUE)).map(<[u8]>::to_vec);
        out.push(ElemMsg {
            key,
            verdict,
            value,
            interval_end: be32(&e, NFTA_SET_ELEM_FLAGS).unwrap_or(0) & NFT_SET_ELEM_INTERVAL_END != 0,
            comment: udata_comment(e.get(NFTA_SET_ELEM_USERDATA), UDATA_SET_ELEM_COMMENT),
        });
    }
    Some((set, out))
}

fn protocol(n: u8) -> Option<Protocol> {
    match n {
        6 => Some(Protocol::Tcp),
        17 => Some(Protocol::Udp),
        132 => Some(Protocol::Sctp),
        _ => None,
    }
}

fn ip_of(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(b).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(b).ok()?)),
        _ => None,
    }
}

/// An element key of a set with `key` type.
pub fn elem_key(key: KeyType, family: IpFamily, b: &[u8]) -> Option<ElemKey> {
    let addr_len = if family == IpFamily::V4 { 4 } else { 16 };
    let proto_port = |at: usize| -> Option<(Protocol, u16)> {
        let p = protocol(*b.get(at)?)?;
        let port = u16::from_be_bytes([*b.get(at + 4)?, *b.get(at + 5)?]);
        Some((p, port))
    };
    Some(match key {
        KeyType::Addr => ElemKey::Addr(ip_of(b.get(..addr_len)?)?),
        KeyType::AddrProtoPort => {
            let (p, port) = proto_port(addr_len)?;
            ElemKey::AddrProtoPort(ip_of(b.get(..addr_len)?)?, p, port)
        }
        KeyType::ProtoPort => {
            let (p, port) = proto_port(0)?;
            ElemKey::ProtoPort(p, port)
        }
        KeyType::AddrPair => ElemKey::AddrPair(ip_of(b.get(..addr_len)?)?, ip_of(b.get(addr_len..2 * addr_len)?)?),
        // One number (an interval's ends are paired by `ranges`).
        KeyType::Numgen(_) => {
            let n = u32::from_be_bytes(b.get(..4)?.try_into().ok()?);
            ElemKey::Range(n, n)
        }
    })
}

/// The `address . port` value of a DNAT map element (the port in the next 32-bit slot).
fn addr_port_of(family: IpFamily, b: &[u8]) -> Option<SocketAddr> {
    let addr_len = if family == IpFamily::V4 { 4 } else { 16 };
    let ip = ip_of(b.get(..addr_len)?)?;
    let port = u16::from_be_bytes(b.get(addr_len..addr_len + 2)?.try_into().ok()?);
    Some(SocketAddr::new(ip, port))
}

/// The elements of an interval map of numbers: each start (with its value) paired with the
/// end element after it (flagged, one past the last number); a start without one reaches the
/// top. An end at the same number as the next start comes first (the previous interval's).
fn ranges(family: IpFamily, elems: Vec<ElemMsg>) -> Vec<Element> {
    let number = |e: &ElemMsg| Some(u32::from_be_bytes(e.key.get(..4)?.try_into().ok()?));
    let mut points: Vec<(u32, bool, ElemMsg)> = elems
        .into_iter()
        .filter_map(|e| Some((number(&e)?, !e.interval_end, e)))
        .collect();
    points.sort_by_key(|(n, start, _)| (*n, *start));
    let mut out = Vec::new();
    let mut it = points.into_iter().peekable();
    while let Some((lo, start, e)) = it.next() {
        if !start {
            continue;
        }
        let hi = match it.peek() {
            Some((end, false, _)) => end.saturating_sub(1),
            Some((next, true, _)) => next.saturating_sub(1),
            None => u32::MAX,
        };
        out.push(Element {
            key: ElemKey::Range(lo, hi),
            value: elem_value(family, &e),
            comment: e.comment,
        });
    }
    out
}

/// A map element's value: its verdict, or the `address . port` it holds.
fn elem_value(family: IpFamily, e: &ElemMsg) -> Option<ElemValue> {
    match (&e.verdict, &e.value) {
        (Some(v), _) => Some(ElemValue::Verdict(v.clone())),
        (None, Some(b)) => addr_port_of(family, b).map(ElemValue::AddrPort),
        (None, None) => None,
    }
}

/// One expression of a rule, its attributes decoded as far as the shapes need.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Expr {
    Payload {
        dreg: u32,
        base: u32,
        offset: u32,
        len: u32,
    },
    Cmp {
        op: u32,
        data: Vec<u8>,
    },
    Bitwise {
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    Meta {
        key: u32,
        dreg: Option<u32>,
        sreg: Option<u32>,
    },
    Ct {
        key: u32,
    },
    Byteorder,
    Lookup {
        set: String,
        dreg: Option<u32>,
        inv: bool,
    },
    ImmVerdict(Verdict),
    ImmValue {
        dreg: u32,
        data: Vec<u8>,
    },
    Reject,
    Fib {
        flags: u32,
    },
    Numgen {
        modulus: u32,
        offset: u32,
    },
    Masq,
    Nat {
        kind: u32,
    },
    Dynset {
        set: String,
        op: u32,
    },
    Other(String),
}

fn data_value(a: &Attrs<'_>, ty: u16) -> Vec<u8> {
    a.nested(ty)
        .ok()
        .flatten()
        .and_then(|d| d.get(NFTA_DATA_VALUE).map(<[u8]>::to_vec))
        .unwrap_or_default()
}

fn expr(name: &str, a: &Attrs<'_>) -> Expr {
    let u = |ty| be32(a, ty);
    match name {
        "payload" => Expr::Payload {
            dreg: u(NFTA_PAYLOAD_DREG).unwrap_or(0),
            base: u(NFTA_PAYLOAD_BASE).unwrap_or(0),
            offset: u(NFTA_PAYLOAD_OFFSET).unwrap_or(0),
            len: u(NFTA_PAYLOAD_LEN).unwrap_or(0),
        },
        "cmp" => Expr::Cmp {
            op: u(NFTA_CMP_OP).unwrap_or(0),
            data: data_value(a, NFTA_CMP_DATA),
        },
        "bitwise" => Expr::Bitwise {
            mask: data_value(a, NFTA_BITWISE_MASK),
            xor: data_value(a, NFTA_BITWISE_XOR),
        },
        "meta" => Expr::Meta {
            key: u(NFTA_META_KEY).unwrap_or(u32::MAX),
            dreg: u(NFTA_META_DREG),
            sreg: u(NFTA_META_SREG),
        },
        "ct" => Expr::Ct {
            key: u(NFTA_CT_KEY).unwrap_or(u32::MAX),
        },
        "lookup" => Expr::Lookup {
            set: string(a, NFTA_LOOKUP_SET).unwrap_or_default(),
            dreg: u(NFTA_LOOKUP_DREG),
            inv: u(NFTA_LOOKUP_FLAGS).unwrap_or(0) & NFT_LOOKUP_F_INV != 0,
        },
        "immediate" => {
            let dreg = u(NFTA_IMMEDIATE_DREG).unwrap_or(u32::MAX);
            match a.nested(NFTA_IMMEDIATE_DATA).ok().flatten() {
                Some(d) if dreg == REG_VERDICT => match verdict_of(&d) {
                    Some(v) => Expr::ImmVerdict(v),
                    None => Expr::Other("immediate".into()),
                },
                Some(d) => Expr::ImmValue {
                    dreg,
                    data: d.get(NFTA_DATA_VALUE).map(<[u8]>::to_vec).unwrap_or_default(),
                },
                None => Expr::Other("immediate".into()),
            }
        }
        "reject" => Expr::Reject,
        "fib" => Expr::Fib {
            flags: u(NFTA_FIB_FLAGS).unwrap_or(0),
        },
        "numgen" => Expr::Numgen {
            modulus: u(NFTA_NG_MODULUS).unwrap_or(0),
            offset: u(NFTA_NG_OFFSET).unwrap_or(0),
        },
        "byteorder" => Expr::Byteorder,
        "masq" => Expr::Masq,
        "nat" => Expr::Nat {
            kind: u(NFTA_NAT_TYPE).unwrap_or(u32::MAX),
        },
        "dynset" => Expr::Dynset {
            set: string(a, NFTA_DYNSET_SET_NAME).unwrap_or_default(),
            op: u(NFTA_DYNSET_OP).unwrap_or(u32::MAX),
        },
        other => Expr::Other(other.to_string()),
    }
}

fn expr_name(e: &Expr) -> &str {
    match e {
        Expr::Payload { .. } => "payload",
        Expr::Cmp { .. } => "cmp",
        Expr::Bitwise { .. } => "bitwise",
        Expr::Meta { .. } => "meta",
        Expr::Ct { .. } => "ct",
        Expr::Lookup { .. } => "lookup",
        Expr::ImmVerdict(_) | Expr::ImmValue { .. } => "immediate",
        Expr::Reject => "reject",
        Expr::Fib { .. } => "fib",
        Expr::Numgen { .. } => "numgen",
        Expr::Byteorder => "byteorder",
        Expr::Masq => "masq",
        Expr::Nat { .. } => "nat",
        Expr::Dynset { .. } => "dynset",
        Expr::Other(n) => n,
    }
}

/// A rule message: its table, chain, expressions and comment.
pub struct RuleMsg {
    pub table: String,
    pub chain: String,
    exprs: Vec<Expr>,
    comment: Option<String>,
}

/// A `NEWRULE` message.
pub fn rule(msg: &[u8]) -> Option<RuleMsg> {
    let a = Attrs::parse(payload_of(msg)?).ok()?;
    let mut exprs = Vec::new();
    if let Some(list) = a.get(NFTA_RULE_EXPRESSIONS) {
        for (_, e) in crate::netlink::attributes_of(list)? {
            let e = Attrs::parse(e).ok()?;
            let name = string(&e, NFTA_EXPR_NAME)?;
            let data = e.nested(NFTA_EXPR_DATA).ok().flatten();
            exprs.push(match data {
                Some(d) => expr(&name, &d),
                None => expr(&name, &Attrs::parse(&[]).ok()?),
            });
        }
    }
    Some(RuleMsg {
        table: string(&a, NFTA_RULE_TABLE)?,
        chain: string(&a, NFTA_RULE_CHAIN)?,
        exprs,
        comment: udata_comment(a.get(NFTA_RULE_USERDATA), UDATA_RULE_COMMENT),
    })
}

impl RuleMsg {
    /// The sets its lookups name (anonymous ones among them).
    pub fn sets(&self) -> Vec<String> {
        self.exprs
            .iter()
            .filter_map(|e| match e {
                Expr::Lookup { set, .. } => Some(set.clone()),
                _ => None,
            })
            .collect()
    }
}

/// What a rule's anonymous sets hold: CIDRs of an address set, chains of a numgen map.
#[derive(Clone, Debug, Default)]
pub struct AnonSets {
    pub cidrs: HashMap<String, Vec<IpNet>>,
    pub chains: HashMap<String, Vec<String>>,
}

impl AnonSets {
    /// Records an anonymous set's elements.
    pub fn add(&mut self, family: IpFamily, s: &SetMsg, elems: &[ElemMsg]) {
        if s.decl.map.is_some() {
            let mut by_index: Vec<(u32, String)> = elems
                .iter()
                .filter_map(|e| {
                    let k = u32::from_ne_bytes(e.key.get(..4)?.try_into().ok()?);
                    Some((k, e.verdict.as_ref()?.chain()?.to_string()))
                })
                .collect();
            by_index.sort();
            self.chains
                .insert(s.decl.name.clone(), by_index.into_iter().map(|(_, c)| c).collect());
        } else {
            self.cidrs
                .insert(s.decl.name.clone(), cidrs_of(family, s.interval, elems));
        }
    }
}

/// An address set's elements as CIDRs, sorted: the keys of a hash set, or the intervals of an
/// interval set (a start key, then the key after its end, flagged; the last may be open).
fn cidrs_of(family: IpFamily, interval: bool, elems: &[ElemMsg]) -> Vec<IpNet> {
    let value = |e: &ElemMsg| -> Option<u128> {
        Some(match ip_of(&e.key)? {
            IpAddr::V4(a) => u128::from(u32::from(a)),
            IpAddr::V6(a) => u128::from(a),
        })
    };
    let bits: u32 = if family == IpFamily::V4 { 32 } else { 128 };
    let mut out = Vec::new();
    if !interval {
        out.extend(elems.iter().filter_map(|e| ip_of(&e.key)).map(IpNet::from));
        out.sort();
        return out;
    }
    let mut points: Vec<(u128, bool)> = elems.iter().filter_map(|e| Some((value(e)?, e.interval_end))).collect();
    points.sort();
    let top: u128 = if bits == 128 { u128::MAX } else { (1u128 << bits) - 1 };
    let mut i = 0;
    while i < points.len() {
        let (start, end_flag) = points[i];
        i += 1;
        if end_flag {
            continue;
        }
        let last = match points.get(i) {
            Some((e, true)) => {
                i += 1;
                e.saturating_sub(1)
            }
            _ => top,
        };
        out.extend(range_cidrs(family, start, last));
    }
    out
}

/// The fewest CIDRs covering `[start, last]`.
fn range_cidrs(family: IpFamily, mut start: u128, last: u128) -> Vec<IpNet> {
    let bits: u32 = if family == IpFamily::V4 { 32 } else { 128 };
    let mut out = Vec::new();
    loop {
        // The largest block aligned at `start` that stays within the range.
        let mut size = if start == 0 {
            bits
        } else {
            start.trailing_zeros().min(bits)
        };
        while size > 0 && (size >= 128 || start.saturating_add((1u128 << size) - 1) > last) {
            size -= 1;
        }
        let ip = match family {
            IpFamily::V4 => IpAddr::from(std::net::Ipv4Addr::from(start as u32)),
            IpFamily::V6 => IpAddr::from(std::net::Ipv6Addr::from(start)),
        };
        if let Ok(net) = IpNet::new(ip, (bits - size) as u8) {
            out.push(net);
        }
        let span = if size >= 128 { u128::MAX } else { (1u128 << size) - 1 };
        match start.checked_add(span).filter(|e| *e < last) {
            Some(e) => start = e + 1,
            None => return out,
        }
    }
}

/// The rule a message's expressions are, or why they are not one of kube-proxy's shapes.
pub fn rule_of(msg: &RuleMsg, family: IpFamily, anon: &AnonSets) -> Result<Rule, Undecoded> {
    let fail = |reason: String| Undecoded {
        chain: msg.chain.clone(),
        exprs: msg.exprs.iter().map(expr_name).collect::<Vec<_>>().join(" "),
        reason,
    };
    let mut matches = Vec::new();
    let mut statement = None;
    let mut rest = msg.exprs.as_slice();
    while !rest.is_empty() {
        if statement.is_some() {
            return Err(fail("expressions after the statement".into()));
        }
        let (taken, m, s) = one(rest, family, anon).map_err(fail)?;
        rest = &rest[taken..];
        matches.extend(m);
        statement = s.or(statement);
    }
    let statement = statement.ok_or_else(|| fail("no statement".into()))?;
    Ok(Rule {
        matches,
        statement,
        comment: msg.comment.clone(),
    })
}

type Step = (usize, Option<Match>, Option<Statement>);

/// The match or statement at the start of `e`, and how many expressions it took.
fn one(e: &[Expr], family: IpFamily, anon: &AnonSets) -> Result<Step, String> {
    let m = |n: usize, m: Match| Ok((n, Some(m), None));
    let s = |n: usize, s: Statement| Ok((n, None, Some(s)));
    if let Some((n, key)) = key_load(e, family) {
        match e.get(n) {
            Some(Expr::Lookup {
                set,
                dreg: Some(REG_VERDICT),
                ..
            }) => return s(n + 1, Statement::Vmap { key, map: set.clone() }),
            Some(Expr::Lookup {
                set,
                dreg: None,
                inv: false,
            }) => return m(n + 1, Match::InSet { key, set: set.clone() }),
            _ => {}
        }
    }
    match e {
        [
            Expr::Ct { key: NFT_CT_STATE },
            Expr::Bitwise { .. },
            Expr::Cmp { op: NFT_CMP_NEQ, .. },
            ..,
        ] => m(3, Match::CtStateNew),
        [
            Expr::Ct { key: NFT_CT_STATUS },
            Expr::Bitwise { mask, .. },
            Expr::Cmp { op: NFT_CMP_NEQ, .. },
            ..,
        ] if u32_ne(mask) == Ok(IPS_DST_NAT) => m(3, Match::CtStatusDnat),
        [
            Expr::Payload {
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset,
                len,
                ..
            },
            tail @ ..,
        ] => address(family, *offset, *len, tail, anon),
        [Expr::Fib { flags }, Expr::Cmp { .. }, ..] => {
            let dir = if flags & NFTA_FIB_F_SADDR != 0 {
                Dir::Saddr
            } else {
                Dir::Daddr
            };
            m(2, Match::FibLocal(dir))
        }
        [Expr::Meta { .. }, ..] => meta(e),
        [Expr::Reject, ..] => s(1, Statement::Verdict(Verdict::Reject)),
        [Expr::ImmVerdict(v), ..] => s(1, Statement::Verdict(v.clone())),
        [
            Expr::Numgen { modulus, offset },
            Expr::Byteorder,
            Expr::Lookup {
                set, dreg: Some(REG_1), ..
            },
            Expr::Nat { kind: NFT_NAT_DNAT },
            ..,
        ] => s(
            4,
            Statement::DnatNumgenMap {
                modulus: *modulus,
                offset: *offset,
                map: set.clone(),
            },
        ),
        [
            Expr::Numgen { .. },
            Expr::Lookup {
                set,
                dreg: Some(REG_VERDICT),
                ..
            },
            ..,
        ] => {
            let chains = anon
                .chains
                .get(set)
                .cloned()
                .ok_or(format!("the map {set} was not read"))?;
            s(2, Statement::NumgenVmap(chains))
        }
        [Expr::Masq, ..] => s(1, Statement::Masquerade),
        [
            Expr::ImmValue {
                dreg: REG_1,
                data: addr,
            },
            Expr::ImmValue {
                dreg: REG_2,
                data: port,
            },
            Expr::Nat { kind: NFT_NAT_DNAT },
            ..,
        ] => {
            let ip = ip_of(addr).ok_or("a DNAT address of an odd length")?;
            let port = <[u8; 2]>::try_from(port.as_slice()).map_err(|_| "a DNAT port of an odd length")?;
            s(3, Statement::Dnat(SocketAddr::new(ip, u16::from_be_bytes(port))))
        }
        [first, ..] => Err(format!("{} is not where kube-proxy writes it", expr_name(first))),
        [] => Err("empty".into()),
    }
}

/// The lookup key loaded at the start of `e` (as `expr` loads each [`VmapKey`]), and how
/// many expressions that took.
fn key_load(e: &[Expr], family: IpFamily) -> Option<(usize, VmapKey)> {
    let (saddr, _) = addr_field(family, Dir::Saddr);
    let (daddr, _) = addr_field(family, Dir::Daddr);
    match e {
        [
            Expr::Payload {
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset,
                ..
            },
            Expr::Meta {
                key: NFT_META_L4PROTO, ..
            },
            Expr::Payload {
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                ..
            },
            ..,
        ] if *offset == daddr => Some((3, VmapKey::DaddrProtoPort)),
        [
            Expr::Meta {
                key: NFT_META_L4PROTO, ..
            },
            Expr::Payload {
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                ..
            },
            ..,
        ] => Some((2, VmapKey::ProtoPort)),
        [
            Expr::Payload {
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: a,
                ..
            },
            Expr::Payload {
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: b,
                ..
            },
            ..,
        ] if (*a, *b) == (saddr, daddr) => Some((2, VmapKey::SaddrDaddr)),
        _ => None,
    }
}

/// A match or statement that starts with a `meta` load: an interface name, the protocol,
/// the mark.
fn meta(e: &[Expr]) -> Result<Step, String> {
    let m = |n: usize, m: Match| Ok((n, Some(m), None));
    let s = |n: usize, s: Statement| Ok((n, None, Some(s)));
    match e {
        [
            Expr::Meta {
                key: NFT_META_IIFNAME,
                dreg: Some(_),
                ..
            },
            Expr::Cmp { op, data },
            ..,
        ] => {
            let negate = *op == NFT_CMP_NEQ;
            let name: Vec<u8> = data.iter().copied().take_while(|c| *c != 0).collect();
            let mut pattern = String::from_utf8_lossy(&name).into_owned();
            // An exact name is compared with its padding; a wildcard only by its prefix.
            if data.len() < IFNAMSIZ {
                pattern.push('*');
            }
            m(2, Match::Iifname { negate, pattern })
        }
        [
            Expr::Meta {
                key: NFT_META_L4PROTO,
                dreg: Some(_),
                ..
            },
            Expr::Cmp { data, .. },
            ..,
        ] => {
            let p = data.first().and_then(|n| protocol(*n)).ok_or("an unknown protocol")?;
            m(2, Match::L4proto(p))
        }
        [
            Expr::Meta {
                key: NFT_META_MARK,
                dreg: Some(_),
                ..
            },
            Expr::Bitwise { mask, xor },
            Expr::Meta {
                key: NFT_META_MARK,
                sreg: Some(_),
                ..
            },
            ..,
        ] => {
            let mask = u32_ne(mask)?;
            let xor = u32_ne(xor)?;
            if mask == u32::MAX {
                s(3, Statement::MarkSetXor(xor))
            } else {
                s(3, Statement::MarkSetOr(xor))
            }
        }
        [
            Expr::Meta {
                key: NFT_META_MARK,
                dreg: Some(_),
                ..
            },
            Expr::Bitwise { mask, .. },
            Expr::Cmp { .. },
            ..,
        ] => m(3, Match::MarkAndZero(u32_ne(mask)?)),
        [first, ..] => Err(format!("{} is not where kube-proxy writes it", expr_name(first))),
        [] => Err("empty".into()),
    }
}

fn u32_ne(b: &[u8]) -> Result<u32, String> {
    Ok(u32::from_ne_bytes(
        b.try_into().map_err(|_| "a 32-bit value of an odd length")?,
    ))
}

/// An address match (or `update @set { ip saddr }`) after a network-header payload load.
fn address(family: IpFamily, offset: u32, len: u32, tail: &[Expr], anon: &AnonSets) -> Result<Step, String> {
    let dir = if (offset, len) == addr_field(family, Dir::Saddr) || offset == addr_field(family, Dir::Saddr).0 {
        Dir::Saddr
    } else {
        Dir::Daddr
    };
    let (_, full) = addr_field(family, dir);
    let net = |data: &[u8], prefix: u8| -> Result<IpNet, String> {
        let mut bytes = data.to_vec();
        bytes.resize(full as usize, 0);
        let ip = ip_of(&bytes).ok_or("an address of an odd length")?;
        IpNet::new(ip, prefix).map_err(|e| e.to_string())
    };
    let addr = |n: usize, negate: bool, spec: AddrSpec| Ok((n, Some(Match::Addr { dir, negate, spec }), None));
    match tail {
        [Expr::Cmp { op, data }, ..] => {
            let prefix = if len == full { full * 8 } else { len * 8 };
            addr(2, *op == NFT_CMP_NEQ, AddrSpec::Net(net(data, prefix as u8)?))
        }
        [Expr::Bitwise { mask, .. }, Expr::Cmp { op, data }, ..] => {
            let prefix: u32 = mask.iter().map(|b| b.count_ones()).sum();
            addr(3, *op == NFT_CMP_NEQ, AddrSpec::Net(net(data, prefix as u8)?))
        }
        [Expr::Lookup { set, dreg: None, inv }, ..] => match anon.cidrs.get(set) {
            Some(items) => addr(
                2,
                *inv,
                AddrSpec::AnonSet {
                    items: items.clone(),
                    compact: dir == Dir::Daddr,
                },
            ),
            None if set.starts_with("__set") => Err(format!("the set {set} was not read")),
            None => addr(2, *inv, AddrSpec::Set(set.clone())),
        },
        [
            Expr::Dynset {
                set,
                op: NFT_DYNSET_OP_UPDATE,
            },
            ..,
        ] => Ok((2, None, Some(Statement::UpdateSaddr(set.clone())))),
        _ => Err("an address load without a comparison".into()),
    }
}

/// The table of `family` from the messages of a dump (or a batch): chains, sets with their
/// elements, and rules, of table `kube-proxy` only. Rules that are not of kube-proxy's shapes
/// are left out of the model and returned.
pub fn table(family: IpFamily, messages: &[(u16, Vec<u8>)]) -> (Ruleset, Vec<Undecoded>) {
    let mut r = Ruleset::new(family);
    let mut undecoded = Vec::new();
    let mut sets: BTreeMap<String, SetMsg> = BTreeMap::new();
    let mut elems: HashMap<String, Vec<ElemMsg>> = HashMap::new();
    let mut rules = Vec::new();
    let ty = |t: u16| t & 0xff;
    for (t, msg) in messages {
        match ty(*t) {
            NFT_MSG_NEWTABLE => r.exists = true,
            NFT_MSG_NEWCHAIN => {
                if let Some(c) = chain(msg).filter(|c| c.table == crate::nftables::names::TABLE) {
                    r.exists = true;
                    r.chains.insert(
                        c.decl.name.clone(),
                        Chain {
                            decl: c.decl,
                            rules: Vec::new(),
                        },
                    );
                }
            }
            NFT_MSG_NEWSET => {
                if let Some(s) = set(msg, family).filter(|s| s.table == crate::nftables::names::TABLE) {
                    sets.insert(s.decl.name.clone(), s);
                }
            }
            NFT_MSG_NEWSETELEM => {
                if let Some((set, list)) = elements(msg) {
                    elems.entry(set).or_default().extend(list);
                }
            }
            NFT_MSG_NEWRULE => {
                if let Some(m) = rule(msg).filter(|m| m.table == crate::nftables::names::TABLE) {
                    rules.push(m);
                }
            }
            _ => {}
        }
    }
    let mut anon = AnonSets::default();
    for s in sets.values() {
        let list = elems.remove(&s.decl.name).unwrap_or_default();
        if s.anonymous {
            anon.add(family, s, &list);
            continue;
        }
        let mut set = Set {
            decl: s.decl.clone(),
            elements: BTreeMap::new(),
        };
        if s.decl.interval() {
            set.elements
                .extend(ranges(family, list).into_iter().map(|e| (e.key.clone(), e)));
        } else {
            for e in list {
                if let Some(key) = elem_key(s.decl.key, family, &e.key) {
                    let value = elem_value(family, &e);
                    set.elements.insert(
                        key.clone(),
                        Element {
                            key,
                            value,
                            comment: e.comment,
                        },
                    );
                }
            }
        }
        r.sets.insert(s.decl.name.clone(), set);
    }
    for m in rules {
        match rule_of(&m, family, &anon) {
            Ok(rule) => {
                if let Some(c) = r.chains.get_mut(&m.chain) {
                    c.rules.push(rule);
                }
            }
            Err(u) => undecoded.push(u),
        }
    }
    (r, undecoded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testing;
    use crate::nftables::netlink::encode;
    use crate::proxy::RenderOptions;

    fn messages(bytes: &[u8]) -> Vec<(u16, Vec<u8>)> {
        crate::netlink::messages(bytes)
            .map(|m| m.expect("framed"))
            .map(|m| (m.msg_type, m.bytes.to_vec()))
            .collect()
    }

    /// A rendered table, sent as a batch, read back as a dump would give it: the same model.
    #[test]
    fn a_rendered_table_reads_back_as_the_same_model() {
        let mut web = testing::port("ns", "web", 1, Protocol::Tcp, &[1, 2, 3]);
        web.port.node_port = 30001;
        web.port.session_affinity_timeout = Some(60);
        let mut lb = testing::port("ns", "lb", 2, Protocol::Udp, &[4]);
        lb.port.load_balancer_vips = vec!["203.0.113.7".parse().unwrap()];
        lb.port.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().unwrap(), "192.0.2.0/25".parse().unwrap()];
        let empty = testing::port("ns", "empty", 3, Protocol::Sctp, &[]);
        let state = testing::state(vec![web, lb, empty], &["10.96.0.0/16"]);
        let opts = RenderOptions {
            local_detector: crate::config::LocalDetector::Cidr("10.244.0.0/16".into()),
            node_port_addresses: vec!["10.0.0.0/8".into()],
            ..RenderOptions::default()
        };
        let tx = crate::nftables::render::render_tx(&state, &opts, true);
        let want = Ruleset::from_transaction(&tx).expect("applies");
        let batch = encode(&tx, 1);
        let (got, undecoded) = table(IpFamily::V4, &messages(&batch.bytes));
        assert_eq!(undecoded, vec![], "every rule is one of ours");
        assert_eq!(
            got.chains.keys().collect::<Vec<_>>(),
            want.chains.keys().collect::<Vec<_>>()
        );
        for (name, chain) in &want.chains {
            let text = |c: &Chain| {
                c.rules
                    .iter()
                    .map(|r| crate::nftables::readback::canonical_line(&r.text(IpFamily::V4)))
                    .collect::<Vec<_>>()
            };
            assert_eq!(text(&got.chains[name]), text(chain), "chain {name}");
            assert_eq!(got.chains[name].decl, chain.decl, "chain {name}");
        }
        assert_eq!(got.sets, want.sets);
    }

    #[test]
    fn foreign_rules_are_reported_not_guessed() {
        let msg = RuleMsg {
            table: "kube-proxy".into(),
            chain: "services".into(),
            exprs: vec![Expr::Other("counter".into()), Expr::ImmVerdict(Verdict::Accept)],
            comment: None,
        };
        let e = rule_of(&msg, IpFamily::V4, &AnonSets::default()).expect_err("not ours");
        assert_eq!(e.exprs, "counter immediate");
    }

    #[test]
    fn numgen_intervals_pair_each_start_with_its_end() {
        let elem = |n: u32, end: bool, to: Option<&str>| ElemMsg {
            key: n.to_be_bytes().to_vec(),
            verdict: None,
            value: to.map(|t| {
                let sa: SocketAddr = t.parse().unwrap();
                let mut v = crate::nftables::netlink::encode::key_bytes(&ElemKey::Addr(sa.ip()));
                v.extend_from_slice(&sa.port().to_be_bytes());
                v.extend_from_slice(&[0, 0]);
                v
            }),
            interval_end: end,
            comment: None,
        };
        // As the kernel dumps them (in no particular order): nft's end element at 0, two
        // adjacent intervals (the first one's end at the second one's start), an open last one.
        let got = ranges(
            IpFamily::V4,
            vec![
                elem(200, false, Some("10.0.0.3:80")),
                elem(10, true, None),
                elem(10, false, Some("10.0.0.2:80")),
                elem(0, true, None),
                elem(0, false, Some("10.0.0.1:80")),
                elem(20, true, None),
            ],
        );
        let shown: Vec<String> = got
            .iter()
            .map(|e| format!("{} : {}", e.key, e.value.as_ref().unwrap()))
            .collect();
        assert_eq!(
            shown,
            vec![
                "0-9 : 10.0.0.1 . 80",
                "10-19 : 10.0.0.2 . 80",
                &format!("200-{} : 10.0.0.3 . 80", u32::MAX)
            ]
        );
    }

    #[test]
    fn ranges_become_the_fewest_cidrs() {
        let f = IpFamily::V4;
        let v = |s: &str| u128::from(u32::from(s.parse::<std::net::Ipv4Addr>().unwrap()));
        let show = |x: Vec<IpNet>| x.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(
            show(range_cidrs(f, v("10.96.0.0"), v("10.96.255.255"))),
            vec!["10.96.0.0/16"]
        );
        assert_eq!(
            show(range_cidrs(f, v("10.0.0.1"), v("10.0.0.6"))),
            vec!["10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31", "10.0.0.6/32"]
        );
        assert_eq!(show(range_cidrs(f, 0, u128::from(u32::MAX))), vec!["0.0.0.0/0"]);
    }
}
