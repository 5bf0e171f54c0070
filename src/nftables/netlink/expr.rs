//! A rule's matches and statement as nf_tables expressions, register for register and
//! attribute for attribute as nft 1.0.6 generates them (checked against `nft --debug=netlink`
//! and the bytes nft sends), so that `nft list` prints a rule we sent exactly as it prints the
//! same rule sent by `nft -f`.
//!
//! Anonymous sets (`{ a, b }`, `numgen … vmap { … }`) are created by `encode` before the rule
//! message; here a rule only refers to them by name and set id ([`AnonRef`]).

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::wire::*;
use crate::model::{IpFamily, Protocol};
use crate::netlink::MsgBuf;
use crate::nftables::ast::{AddrSpec, Dir, Match, Rule, Statement, Verdict, VmapKey};

/// Size of an address of the family, in bytes.
fn addr_len(family: IpFamily) -> u32 {
    addr_field(family, Dir::Daddr).1
}

// Payload bases.
pub(super) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(super) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
pub(super) const NFTA_PAYLOAD_DREG: u16 = 1;
pub(super) const NFTA_PAYLOAD_BASE: u16 = 2;
pub(super) const NFTA_PAYLOAD_OFFSET: u16 = 3;
pub(super) const NFTA_PAYLOAD_LEN: u16 = 4;

pub(super) const NFTA_CMP_SREG: u16 = 1;
pub(super) const NFTA_CMP_OP: u16 = 2;
pub(super) const NFTA_CMP_DATA: u16 = 3;
pub(super) const NFT_CMP_EQ: u32 = 0;
pub(super) const NFT_CMP_NEQ: u32 = 1;

pub(super) const NFTA_BITWISE_SREG: u16 = 1;
pub(super) const NFTA_BITWISE_DREG: u16 = 2;
pub(super) const NFTA_BITWISE_LEN: u16 = 3;
pub(super) const NFTA_BITWISE_MASK: u16 = 4;
pub(super) const NFTA_BITWISE_XOR: u16 = 5;
pub(super) const NFTA_BITWISE_OP: u16 = 6;
pub(super) const NFT_BITWISE_BOOL: u32 = 0;

pub(super) const NFTA_META_DREG: u16 = 1;
pub(super) const NFTA_META_KEY: u16 = 2;
pub(super) const NFTA_META_SREG: u16 = 3;
pub(super) const NFT_META_MARK: u32 = 3;
pub(super) const NFT_META_IIFNAME: u32 = 6;
pub(super) const NFT_META_L4PROTO: u32 = 16;

pub(super) const NFTA_CT_DREG: u16 = 1;
pub(super) const NFTA_CT_KEY: u16 = 2;
pub(super) const NFT_CT_STATE: u32 = 0;
pub(super) const NFT_CT_STATUS: u32 = 2;
/// `NF_CT_STATE_BIT(IP_CT_NEW)`.
pub(super) const CT_STATE_NEW_BIT: u32 = 1 << 3;
/// `IPS_DST_NAT`: the connection's destination was translated.
pub(super) const IPS_DST_NAT: u32 = 1 << 5;

pub(super) const NFTA_BYTEORDER_SREG: u16 = 1;
pub(super) const NFTA_BYTEORDER_DREG: u16 = 2;
pub(super) const NFTA_BYTEORDER_OP: u16 = 3;
pub(super) const NFTA_BYTEORDER_LEN: u16 = 4;
pub(super) const NFTA_BYTEORDER_SIZE: u16 = 5;
pub(super) const NFT_BYTEORDER_HTON: u32 = 1;

pub(super) const NFTA_LOOKUP_SET: u16 = 1;
pub(super) const NFTA_LOOKUP_SREG: u16 = 2;
pub(super) const NFTA_LOOKUP_DREG: u16 = 3;
pub(super) const NFTA_LOOKUP_SET_ID: u16 = 4;
pub(super) const NFTA_LOOKUP_FLAGS: u16 = 5;
pub(super) const NFT_LOOKUP_F_INV: u32 = 1;

pub(super) const NFTA_IMMEDIATE_DREG: u16 = 1;
pub(super) const NFTA_IMMEDIATE_DATA: u16 = 2;

pub(super) const NFTA_REJECT_TYPE: u16 = 1;
pub(super) const NFTA_REJECT_ICMP_CODE: u16 = 2;
pub(super) const NFT_REJECT_ICMP_UNREACH: u32 = 0;
/// ICMP_PORT_UNREACH / ICMPV6_PORT_UNREACH: what nft's plain `reject` sends per family.
pub(super) const ICMP_PORT_UNREACH: u8 = 3;
pub(super) const ICMPV6_PORT_UNREACH: u8 = 4;

pub(super) const NFTA_FIB_DREG: u16 = 1;
pub(super) const NFTA_FIB_RESULT: u16 = 2;
pub(super) const NFTA_FIB_FLAGS: u16 = 3;
pub(super) const NFTA_FIB_F_SADDR: u32 = 1;
pub(super) const NFTA_FIB_F_DADDR: u32 = 2;
pub(super) const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
/// `RTN_LOCAL`, compared in host byte order as nft does.
pub(super) const RTN_LOCAL: u32 = 2;

pub(super) const NFTA_NG_DREG: u16 = 1;
pub(super) const NFTA_NG_MODULUS: u16 = 2;
pub(super) const NFTA_NG_TYPE: u16 = 3;
pub(super) const NFTA_NG_OFFSET: u16 = 4;
pub(super) const NFT_NG_RANDOM: u32 = 1;

pub(super) const NFTA_MASQ_FLAGS: u16 = 1;
pub(super) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
pub(super) const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;

pub(super) const NFTA_NAT_TYPE: u16 = 1;
pub(super) const NFTA_NAT_FAMILY: u16 = 2;
pub(super) const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
pub(super) const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
pub(super) const NFTA_NAT_FLAGS: u16 = 7;
pub(super) const NFT_NAT_DNAT: u32 = 1;

pub(super) const NFTA_DYNSET_SET_NAME: u16 = 1;
pub(super) const NFTA_DYNSET_SET_ID: u16 = 2;
pub(super) const NFTA_DYNSET_OP: u16 = 3;
pub(super) const NFTA_DYNSET_SREG_KEY: u16 = 4;
pub(super) const NFT_DYNSET_OP_UPDATE: u32 = 1;

/// `IFNAMSIZ`: `meta iifname` loads (and an exact name compares) this many bytes.
pub const IFNAMSIZ: usize = 16;

/// An anonymous set created for a rule in the same batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnonRef {
    pub name: String,
    pub id: u32,
}

/// What a rule refers to: the set ids of named sets created earlier in the same batch (the
/// kernel finds those by name too; nft sends the id as well), and the rule's anonymous sets in
/// the order its matches and statement use them.
pub struct RuleRefs<'a> {
    pub set_id: &'a dyn Fn(&str) -> Option<u32>,
    pub anon: &'a [AnonRef],
}

/// Whether an address match needs an anonymous set (nft turns a one-item `{ x }` into a plain
/// comparison).
pub fn needs_anon_set(spec: &AddrSpec) -> bool {
    matches!(spec, AddrSpec::AnonSet { items, .. } if items.len() > 1)
}

/// The bytes of an address in network order.
pub fn addr_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

pub fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// Offset and length of the source/destination address in the network header.
pub(super) fn addr_field(family: IpFamily, dir: Dir) -> (u32, u32) {
    match (family, dir) {
        (IpFamily::V4, Dir::Saddr) => (12, 4),
        (IpFamily::V4, Dir::Daddr) => (16, 4),
        (IpFamily::V6, Dir::Saddr) => (8, 16),
        (IpFamily::V6, Dir::Daddr) => (24, 16),
    }
}

/// The register number nft writes for the 32-bit slot `slot` counted from `NFT_REG_1`: the
/// 16-byte register number when the slot starts one (slot 4 is `NFT_REG_2`), else the 32-bit
/// one (slot 1 is `NFT_REG32_01` = 9). So a concatenation after an IPv4 address uses 9 and 10,
/// after an IPv6 address 2 and 13 — as nft does.
fn reg_for_slot(slot: u32) -> u32 {
    if slot.is_multiple_of(4) {
        REG_1 + slot / 4
    } else {
        REG32_00 + slot
    }
}

/// Encodes the rule's expressions (the contents of `NFTA_RULE_EXPRESSIONS`).
pub fn rule_exprs(b: &mut MsgBuf, family: IpFamily, rule: &Rule, refs: &RuleRefs<'_>) {
    // `encode` created one anonymous set per anonymous-set match and numgen vmap, in order.
    let mut anon = refs.anon.iter();
    for m in &rule.matches {
        match_exprs(b, family, m, refs, &mut anon);
    }
    statement_exprs(b, family, &rule.statement, refs, &mut anon);
}

/// The expressions of one match.
fn match_exprs<'r>(
    b: &mut MsgBuf,
    family: IpFamily,
    m: &Match,
    refs: &RuleRefs<'_>,
    anon: &mut impl Iterator<Item = &'r AnonRef>,
) {
    match m {
        // ct state and ct status are bitmasks in host byte order: nft tests the bit and
        // compares the result with zero.
        Match::CtStateNew => ct_bit(b, NFT_CT_STATE, CT_STATE_NEW_BIT),
        Match::Addr { dir, negate, spec } => {
            let (offset, len) = addr_field(family, *dir);
            match spec {
                AddrSpec::Net(net) => prefix_match(b, offset, len, *negate, net),
                AddrSpec::AnonSet { items, .. } if items.len() == 1 => prefix_match(b, offset, len, *negate, &items[0]),
                AddrSpec::Set(name) => {
                    payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
                    lookup(b, None, name, (refs.set_id)(name), *negate);
                }
                AddrSpec::AnonSet { .. } => {
                    payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
                    // `encode` created one anonymous set per such match, in this order.
                    if let Some(a) = anon.next() {
                        lookup(b, None, &a.name, Some(a.id), *negate);
                    }
                }
            }
        }
        Match::Iifname { negate, pattern } => {
            meta_load(b, NFT_META_IIFNAME, REG_1);
            let op = if *negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
            match pattern.strip_suffix('*') {
                // A wildcard compares only the prefix's bytes.
                Some(prefix) => cmp(b, op, prefix.as_bytes()),
                None => {
                    let mut name = pattern.as_bytes().to_vec();
                    name.resize(IFNAMSIZ.max(name.len()), 0);
                    cmp(b, op, &name);
                }
            }
        }
        Match::FibLocal(dir) => {
            let flag = match dir {
                Dir::Saddr => NFTA_FIB_F_SADDR,
                Dir::Daddr => NFTA_FIB_F_DADDR,
            };
            expr(b, "fib", |b| {
                b.put_be32(NFTA_FIB_FLAGS, flag);
                b.put_be32(NFTA_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE);
                b.put_be32(NFTA_FIB_DREG, REG_1);
            });
            cmp(b, NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes());
        }
        Match::L4proto(p) => {
            meta_load(b, NFT_META_L4PROTO, REG_1);
            cmp(b, NFT_CMP_EQ, &[proto_number(*p)]);
        }
        Match::MarkAndZero(mark) => {
            meta_load(b, NFT_META_MARK, REG_1);
            bitwise(b, 4, &mark.to_ne_bytes(), &[0; 4], true);
            cmp(b, NFT_CMP_EQ, &[0; 4]);
        }
        Match::CtStatusDnat => ct_bit(b, NFT_CT_STATUS, IPS_DST_NAT),
        Match::InSet { key, set } => {
            load_key(b, family, *key);
            lookup(b, None, set, (refs.set_id)(set), false);
        }
    }
}

/// `ct KEY & BIT != 0`.
fn ct_bit(b: &mut MsgBuf, key: u32, bit: u32) {
    expr(b, "ct", |b| {
        b.put_be32(NFTA_CT_KEY, key);
        b.put_be32(NFTA_CT_DREG, REG_1);
    });
    bitwise(b, 4, &bit.to_ne_bytes(), &[0; 4], false);
    cmp(b, NFT_CMP_NEQ, &[0; 4]);
}

/// The expressions of a rule's statement.
fn statement_exprs<'r>(
    b: &mut MsgBuf,
    family: IpFamily,
    statement: &Statement,
    refs: &RuleRefs<'_>,
    anon: &mut impl Iterator<Item = &'r AnonRef>,
) {
    match statement {
        Statement::Verdict(Verdict::Reject) => {
            let code = match family {
                IpFamily::V4 => ICMP_PORT_UNREACH,
                IpFamily::V6 => ICMPV6_PORT_UNREACH,
            };
            expr(b, "reject", |b| {
                b.put_be32(NFTA_REJECT_TYPE, NFT_REJECT_ICMP_UNREACH);
                b.put(NFTA_REJECT_ICMP_CODE, &[code]);
            });
        }
        Statement::Verdict(v) => {
            expr(b, "immediate", |b| {
                b.put_be32(NFTA_IMMEDIATE_DREG, REG_VERDICT);
                let d = b.nest_start(NFTA_IMMEDIATE_DATA);
                verdict_data(b, v);
                b.nest_end(d);
            });
        }
        Statement::Vmap { key, map } => {
            load_key(b, family, *key);
            lookup(b, Some(REG_VERDICT), map, (refs.set_id)(map), false);
        }
        Statement::DnatNumgenMap { modulus, offset, map } => {
            numgen(b, *modulus, *offset);
            // numgen writes host byte order; the map's keys are in network order.
            expr(b, "byteorder", |b| {
                b.put_be32(NFTA_BYTEORDER_SREG, REG_1);
                b.put_be32(NFTA_BYTEORDER_DREG, REG_1);
                b.put_be32(NFTA_BYTEORDER_OP, NFT_BYTEORDER_HTON);
                b.put_be32(NFTA_BYTEORDER_LEN, 4);
                b.put_be32(NFTA_BYTEORDER_SIZE, 4);
            });
            // The map's value (address, then port in the next 32-bit slot) lands in the
            // registers the nat expression reads.
            lookup(b, Some(REG_1), map, (refs.set_id)(map), false);
            let family_code = match family {
                IpFamily::V4 => NFPROTO_IPV4,
                IpFamily::V6 => NFPROTO_IPV6,
            };
            expr(b, "nat", |b| {
                b.put_be32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
                b.put_be32(NFTA_NAT_FAMILY, u32::from(family_code));
                b.put_be32(NFTA_NAT_REG_ADDR_MIN, REG_1);
                b.put_be32(NFTA_NAT_REG_PROTO_MIN, reg_for_slot(addr_len(family) / 4));
            });
        }
        Statement::NumgenVmap(chains) => {
            numgen(b, u32::try_from(chains.len()).unwrap_or(u32::MAX), 0);
            if let Some(a) = anon.next() {
                lookup(b, Some(REG_VERDICT), &a.name, Some(a.id), false);
            }
        }
        Statement::MarkSetOr(mark) => {
            meta_load(b, NFT_META_MARK, REG_1);
            bitwise(b, 4, &(!mark).to_ne_bytes(), &mark.to_ne_bytes(), true);
            meta_set(b, NFT_META_MARK, REG_1);
        }
        Statement::MarkSetXor(mark) => {
            meta_load(b, NFT_META_MARK, REG_1);
            bitwise(b, 4, &u32::MAX.to_ne_bytes(), &mark.to_ne_bytes(), true);
            meta_set(b, NFT_META_MARK, REG_1);
        }
        Statement::Masquerade => {
            expr(b, "masq", |b| {
                b.put_be32(NFTA_MASQ_FLAGS, NF_NAT_RANGE_PROTO_RANDOM_FULLY)
            });
        }
        Statement::Dnat(to) => dnat(b, to),
        Statement::UpdateSaddr(set) => {
            let (offset, len) = addr_field(family, Dir::Saddr);
            payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
            let id = (refs.set_id)(set);
            expr(b, "dynset", |b| {
                b.put_be32(NFTA_DYNSET_SREG_KEY, REG_1);
                b.put_be32(NFTA_DYNSET_OP, NFT_DYNSET_OP_UPDATE);
                b.put_str(NFTA_DYNSET_SET_NAME, set);
                if let Some(id) = id {
                    b.put_be32(NFTA_DYNSET_SET_ID, id);
                }
            });
        }
    }
}

/// `numgen random mod MODULUS offset OFFSET` into register 1.
fn numgen(b: &mut MsgBuf, modulus: u32, offset: u32) {
    expr(b, "numgen", |b| {
        b.put_be32(NFTA_NG_DREG, REG_1);
        b.put_be32(NFTA_NG_MODULUS, modulus);
        b.put_be32(NFTA_NG_TYPE, NFT_NG_RANDOM);
        b.put_be32(NFTA_NG_OFFSET, offset);
    });
}

/// Loads a lookup key from the packet, each concatenation field in whole 32-bit slots from
/// register 1 on.
fn load_key(b: &mut MsgBuf, family: IpFamily, key: VmapKey) {
    let alen = addr_len(family);
    let (saddr_offset, _) = addr_field(family, Dir::Saddr);
    let (daddr_offset, _) = addr_field(family, Dir::Daddr);
    // The slot where `meta l4proto . th dport` starts.
    let proto_slot = match key {
        VmapKey::DaddrProtoPort => {
            payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, daddr_offset, alen);
            alen / 4
        }
        VmapKey::ProtoPort => 0,
        VmapKey::SaddrDaddr => {
            payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, saddr_offset, alen);
            payload(
                b,
                reg_for_slot(alen / 4),
                NFT_PAYLOAD_NETWORK_HEADER,
                daddr_offset,
                alen,
            );
            return;
        }
    };
    meta_load(b, NFT_META_L4PROTO, reg_for_slot(proto_slot));
    payload(b, reg_for_slot(proto_slot + 1), NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
}

/// `NFTA_DATA_VERDICT` with its code and target chain. `reject` is not a verdict the kernel
/// knows (it is a statement); `encode::check` refuses it as a map value beforehand, and here it
/// degrades to `drop` rather than being sent as garbage.
pub fn verdict_data(b: &mut MsgBuf, v: &Verdict) {
    let (code, chain) = match v {
        Verdict::Accept => (NF_ACCEPT, None),
        Verdict::Drop | Verdict::Reject => (NF_DROP, None),
        Verdict::Return => (NFT_RETURN, None),
        Verdict::Jump(c) => (NFT_JUMP, Some(c)),
        Verdict::Goto(c) => (NFT_GOTO, Some(c)),
    };
    let n = b.nest_start(NFTA_DATA_VERDICT);
    b.put(NFTA_VERDICT_CODE, &code.to_be_bytes());
    if let Some(c) = chain {
        b.put_str(NFTA_VERDICT_CHAIN, c);
    }
    b.nest_end(n);
}

/// One expression: `NFTA_LIST_ELEM { NFTA_EXPR_NAME, NFTA_EXPR_DATA { … } }`.
fn expr(b: &mut MsgBuf, name: &str, body: impl FnOnce(&mut MsgBuf)) {
    let e = b.nest_start(NFTA_LIST_ELEM);
    b.put_str(NFTA_EXPR_NAME, name);
    let d = b.nest_start(NFTA_EXPR_DATA);
    body(b);
    b.nest_end(d);
    b.nest_end(e);
}

fn payload(b: &mut MsgBuf, dreg: u32, base: u32, offset: u32, len: u32) {
    expr(b, "payload", |b| {
        b.put_be32(NFTA_PAYLOAD_DREG, dreg);
        b.put_be32(NFTA_PAYLOAD_BASE, base);
        b.put_be32(NFTA_PAYLOAD_OFFSET, offset);
        b.put_be32(NFTA_PAYLOAD_LEN, len);
    });
}

fn cmp(b: &mut MsgBuf, op: u32, data: &[u8]) {
    expr(b, "cmp", |b| {
        b.put_be32(NFTA_CMP_SREG, REG_1);
        b.put_be32(NFTA_CMP_OP, op);
        let d = b.nest_start(NFTA_CMP_DATA);
        b.put(NFTA_DATA_VALUE, data);
        b.nest_end(d);
    });
}

/// `reg1 = (reg1 & mask) ^ xor`. nft sends `NFTA_BITWISE_OP` only for the bitwise operations
/// of statements and `mark and …` (binary expressions), not for the masks of prefix and
/// flag matches.
fn bitwise(b: &mut MsgBuf, len: u32, mask: &[u8], xor: &[u8], with_op: bool) {
    expr(b, "bitwise", |b| {
        b.put_be32(NFTA_BITWISE_SREG, REG_1);
        b.put_be32(NFTA_BITWISE_DREG, REG_1);
        if with_op {
            b.put_be32(NFTA_BITWISE_OP, NFT_BITWISE_BOOL);
        }
        b.put_be32(NFTA_BITWISE_LEN, len);
        let m = b.nest_start(NFTA_BITWISE_MASK);
        b.put(NFTA_DATA_VALUE, mask);
        b.nest_end(m);
        let x = b.nest_start(NFTA_BITWISE_XOR);
        b.put(NFTA_DATA_VALUE, xor);
        b.nest_end(x);
    });
}

fn meta_load(b: &mut MsgBuf, key: u32, dreg: u32) {
    expr(b, "meta", |b| {
        b.put_be32(NFTA_META_KEY, key);
        b.put_be32(NFTA_META_DREG, dreg);
    });
}

fn meta_set(b: &mut MsgBuf, key: u32, sreg: u32) {
    expr(b, "meta", |b| {
        b.put_be32(NFTA_META_KEY, key);
        b.put_be32(NFTA_META_SREG, sreg);
    });
}

/// A set lookup of register 1; `dreg` for a map (the verdict register).
fn lookup(b: &mut MsgBuf, dreg: Option<u32>, set: &str, set_id: Option<u32>, invert: bool) {
    expr(b, "lookup", |b| {
        b.put_be32(NFTA_LOOKUP_SREG, REG_1);
        if let Some(d) = dreg {
            b.put_be32(NFTA_LOOKUP_DREG, d);
        }
        b.put_str(NFTA_LOOKUP_SET, set);
        if let Some(id) = set_id {
            b.put_be32(NFTA_LOOKUP_SET_ID, id);
        }
        if invert {
            b.put_be32(NFTA_LOOKUP_FLAGS, NFT_LOOKUP_F_INV);
        }
    });
}

/// An address or CIDR compared with a header field, as nft does it: a whole address or a
/// byte-aligned prefix loads only the bytes it compares; any other prefix (and `/0`) loads the
/// whole field and masks it.
fn prefix_match(b: &mut MsgBuf, offset: u32, len: u32, negate: bool, net: &IpNet) {
    let op = if negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
    let addr = addr_bytes(&net.network());
    let plen = u32::from(net.prefix_len());
    if plen == u32::from(net.max_prefix_len()) {
        payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
        cmp(b, op, &addr);
    } else if plen > 0 && plen % 8 == 0 {
        let bytes = plen / 8;
        payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, bytes);
        cmp(b, op, &addr[..bytes as usize]);
    } else {
        payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
        let mask = addr_bytes(&net.netmask());
        bitwise(b, len, &mask, &vec![0; mask.len()], false);
        cmp(b, op, &addr);
    }
}

/// `dnat to IP:PORT`: address and port into registers 1 and 2, then the nat expression.
fn dnat(b: &mut MsgBuf, to: &SocketAddr) {
    let (family, addr) = match to.ip() {
        IpAddr::V4(a) => (NFPROTO_IPV4, a.octets().to_vec()),
        IpAddr::V6(a) => (NFPROTO_IPV6, a.octets().to_vec()),
    };
    immediate_value(b, REG_1, &addr);
    immediate_value(b, REG_2, &to.port().to_be_bytes());
    expr(b, "nat", |b| {
        b.put_be32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
        b.put_be32(NFTA_NAT_FAMILY, u32::from(family));
        b.put_be32(NFTA_NAT_REG_ADDR_MIN, REG_1);
        b.put_be32(NFTA_NAT_REG_PROTO_MIN, REG_2);
        b.put_be32(NFTA_NAT_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
    });
}

fn immediate_value(b: &mut MsgBuf, dreg: u32, data: &[u8]) {
    expr(b, "immediate", |b| {
        b.put_be32(NFTA_IMMEDIATE_DREG, dreg);
        let d = b.nest_start(NFTA_IMMEDIATE_DATA);
        b.put(NFTA_DATA_VALUE, data);
        b.nest_end(d);
    });
}
