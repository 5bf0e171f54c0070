//! What the nftables dataplane programs, as plain data: the commands of a transaction
//! ([`Op`]) over tables, chains, rules, sets/maps and elements, and the handful of rule shapes
//! upstream's nftables proxier uses ([`Rule`] = matches + one statement + comment).
//!
//! One structure serves three consumers: knftables' text form (`nft -f -`, `render`, the
//! golden tests; [`Transaction::text`]), the netlink encoder (expressions per rule shape) and
//! the nftables `trace` (evaluating matches, maps, `numgen` and verdicts). Only shapes that
//! the renderer emits exist here, so each consumer can handle every case exhaustively.

use std::fmt::{self, Write as _};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::names::TABLE;
use crate::model::{IpFamily, Protocol};

/// `ip` or `ip6`: the nftables family (and the payload keyword) of an [`IpFamily`].
pub fn family_keyword(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// A verdict, as a rule's statement or a verdict map's value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    Accept,
    Drop,
    /// `reject`: ICMP port unreachable (ICMPv6 for `ip6`), as nft's default.
    Reject,
    Return,
    Jump(String),
    Goto(String),
}

impl Verdict {
    /// The chain this verdict continues in, if any.
    pub fn chain(&self) -> Option<&str> {
        match self {
            Verdict::Jump(c) | Verdict::Goto(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Accept => f.write_str("accept"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Reject => f.write_str("reject"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(c) => write!(f, "jump {c}"),
            Verdict::Goto(c) => write!(f, "goto {c}"),
        }
    }
}

/// Source or destination address of the network header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dir {
    Saddr,
    Daddr,
}

impl Dir {
    pub fn keyword(self) -> &'static str {
        match self {
            Dir::Saddr => "saddr",
            Dir::Daddr => "daddr",
        }
    }
}

/// The right-hand side of an address match.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AddrSpec {
    /// One address (host prefix, printed without `/len`) or one CIDR.
    Net(IpNet),
    /// A named set of the table: `@name`.
    Set(String),
    /// An anonymous set of CIDRs/addresses: `{ a,b }` (`compact`) or `{ a , b }`.
    AnonSet { items: Vec<IpNet>, compact: bool },
}

/// Prints a CIDR as nft does: a host prefix as the bare address.
pub fn net_text(net: &IpNet) -> String {
    if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.to_string()
    }
}

/// One match of a rule; all matches of a rule must hold for its statement to run.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Match {
    /// `ct state new`
    CtStateNew,
    /// `ip daddr 10.0.0.1`, `ip saddr != 10.244.0.0/16`, `ip daddr @cluster-ips`, ...
    Addr { dir: Dir, negate: bool, spec: AddrSpec },
    /// `iifname cbr0`, `iifname != veth*` (a trailing `*` matches a prefix).
    Iifname { negate: bool, pattern: String },
    /// `fib saddr type local` / `fib daddr type local`
    FibLocal(Dir),
    /// `meta l4proto tcp`
    L4proto(Protocol),
    /// `mark and 0x4000 == 0`
    MarkAndZero(u32),
    /// `ct status dnat`: the connection's destination was translated.
    CtStatusDnat,
    /// `ip daddr . meta l4proto . th dport @set` (and the other [`VmapKey`]s): the packet's
    /// key is an element of the named set.
    InSet { key: VmapKey, set: String },
}

/// The key of a verdict-map lookup or a set lookup from the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VmapKey {
    /// `ip daddr . meta l4proto . th dport`
    DaddrProtoPort,
    /// `meta l4proto . th dport`
    ProtoPort,
    /// `ip saddr . ip daddr` (after DNAT, a hairpin connection has the endpoint as both)
    SaddrDaddr,
}

impl VmapKey {
    /// The key's text, as nft prints it.
    pub fn text(self, family: IpFamily) -> String {
        let ip_x = family_keyword(family);
        match self {
            VmapKey::DaddrProtoPort => format!("{ip_x} daddr . meta l4proto . th dport"),
            VmapKey::ProtoPort => "meta l4proto . th dport".to_string(),
            VmapKey::SaddrDaddr => format!("{ip_x} saddr . {ip_x} daddr"),
        }
    }

    /// The set key type this lookup reads.
    pub fn key_type(self) -> KeyType {
        match self {
            VmapKey::DaddrProtoPort => KeyType::AddrProtoPort,
            VmapKey::ProtoPort => KeyType::ProtoPort,
            VmapKey::SaddrDaddr => KeyType::AddrPair,
        }
    }
}

/// What a rule does once its matches hold.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Statement {
    Verdict(Verdict),
    /// `<key> vmap @map`
    Vmap {
        key: VmapKey,
        map: String,
    },
    /// `numgen random mod N vmap { 0 : goto c0 , 1 : goto c1 ... }`
    NumgenVmap(Vec<String>),
    /// `mark set mark or MARK`
    MarkSetOr(u32),
    /// `mark set mark xor MARK`
    MarkSetXor(u32),
    /// `masquerade fully-random`
    Masquerade,
    /// `dnat to IP:PORT`
    Dnat(SocketAddr),
    /// `dnat to numgen random mod MODULUS offset OFFSET map @MAP`: a random number in
    /// `OFFSET .. OFFSET + MODULUS` looked up in an interval map of `address . port` (which
    /// needs a `meta l4proto` match first). No match in the map: the rule does not match.
    DnatNumgenMap {
        modulus: u32,
        offset: u32,
        map: String,
    },
    /// `update @set { ip saddr }` (then continue with the next rule)
    UpdateSaddr(String),
}

/// One rule: matches, a statement and an optional comment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub statement: Statement,
    pub comment: Option<String>,
}

impl Rule {
    pub fn new(matches: Vec<Match>, statement: Statement) -> Rule {
        Rule {
            matches,
            statement,
            comment: None,
        }
    }

    pub fn verdict(matches: Vec<Match>, verdict: Verdict) -> Rule {
        Rule::new(matches, Statement::Verdict(verdict))
    }

    pub fn with_comment(mut self, comment: impl Into<String>) -> Rule {
        self.comment = Some(comment.into());
        self
    }

    /// knftables' text of the rule (without the `add rule ip kube-proxy CHAIN` prefix).
    pub fn text(&self, family: IpFamily) -> String {
        let ip_x = family_keyword(family);
        let mut parts: Vec<String> = Vec::new();
        for m in &self.matches {
            parts.push(match m {
                Match::CtStateNew => "ct state new".to_string(),
                Match::Addr { dir, negate, spec } => {
                    let neg = if *negate { "!= " } else { "" };
                    let rhs = match spec {
                        AddrSpec::Net(n) => net_text(n),
                        AddrSpec::Set(s) => format!("@{s}"),
                        AddrSpec::AnonSet { items, compact } => {
                            let items: Vec<String> = items.iter().map(net_text).collect();
                            format!("{{ {} }}", items.join(if *compact { "," } else { " , " }))
                        }
                    };
                    format!("{ip_x} {} {neg}{rhs}", dir.keyword())
                }
                Match::Iifname { negate, pattern } => {
                    format!("iifname {}{pattern}", if *negate { "!= " } else { "" })
                }
                Match::FibLocal(dir) => format!("fib {} type local", dir.keyword()),
                Match::L4proto(p) => format!("meta l4proto {}", p.lower()),
                Match::MarkAndZero(mark) => format!("mark and {} == 0", mark_text(*mark)),
                Match::CtStatusDnat => "ct status dnat".to_string(),
                Match::InSet { key, set } => format!("{} @{set}", key.text(family)),
            });
        }
        parts.push(match &self.statement {
            Statement::Verdict(v) => v.to_string(),
            Statement::Vmap { key, map } => format!("{} vmap @{map}", key.text(family)),
            Statement::NumgenVmap(chains) => {
                let elems: Vec<String> = chains
                    .iter()
                    .enumerate()
                    .map(|(i, c)| format!("{i} : goto {c}"))
                    .collect();
                format!("numgen random mod {} vmap {{ {} }}", chains.len(), elems.join(" , "))
            }
            Statement::MarkSetOr(m) => format!("mark set mark or {}", mark_text(*m)),
            Statement::MarkSetXor(m) => format!("mark set mark xor {}", mark_text(*m)),
            Statement::Masquerade => "masquerade fully-random".to_string(),
            Statement::Dnat(sa) => format!("dnat to {sa}"),
            Statement::DnatNumgenMap { modulus, offset, map } => {
                format!("dnat to {} map @{map}", numgen_text(*modulus, *offset))
            }
            Statement::UpdateSaddr(set) => format!("update @{set} {{ {ip_x} saddr }}"),
        });
        let mut out = parts.join(" ");
        if let Some(c) = &self.comment {
            let _ = write!(out, " comment \"{c}\"");
        }
        out
    }

    /// Chains this rule may continue in (jump/goto targets, numgen targets).
    pub fn targets(&self) -> Vec<&str> {
        match &self.statement {
            Statement::Verdict(v) => v.chain().into_iter().collect(),
            Statement::NumgenVmap(chains) => chains.iter().map(String::as_str).collect(),
            _ => Vec::new(),
        }
    }
}

/// `numgen random mod M [offset O]` (nft prints no `offset 0`).
pub fn numgen_text(modulus: u32, offset: u32) -> String {
    if offset == 0 {
        format!("numgen random mod {modulus}")
    } else {
        format!("numgen random mod {modulus} offset {offset}")
    }
}

/// Upstream's mark format (`%#08x`, e.g. `0x004000`).
pub fn mark_text(mark: u32) -> String {
    format!("{mark:#08x}")
}

/// A base chain's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BaseHook {
    /// `filter` or `nat`
    pub kind: &'static str,
    /// `prerouting`, `input`, `forward`, `output`, `postrouting`
    pub hook: &'static str,
    pub priority: i32,
}

/// A chain declaration.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChainDecl {
    pub name: String,
    pub base: Option<BaseHook>,
    pub comment: Option<String>,
}

impl ChainDecl {
    pub fn regular(name: impl Into<String>) -> ChainDecl {
        ChainDecl {
            name: name.into(),
            base: None,
            comment: None,
        }
    }
}

/// The key type of a set or map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyType {
    /// `ipv4_addr` / `ipv6_addr`
    Addr,
    /// `ipv4_addr . inet_proto . inet_service`
    AddrProtoPort,
    /// `inet_proto . inet_service`
    ProtoPort,
    /// `ipv4_addr . ipv4_addr`
    AddrPair,
    /// `typeof numgen random mod M`, intervals of it (`flags interval`).
    Numgen(u32),
}

/// What a map's elements map to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapValue {
    /// `: verdict`
    Verdict,
    /// `: ip daddr . tcp dport` (typeof; `udp`, `sctp` by the protocol), an address and a
    /// port: the target of a `dnat`.
    AddrPort(Protocol),
}

/// A named set or map.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SetDecl {
    pub name: String,
    pub key: KeyType,
    /// A map (`: verdict`, `: ADDR . PORT`) rather than a set.
    pub map: Option<MapValue>,
    /// `flags dynamic,timeout ; timeout Ns` (ClientIP affinity sets).
    pub timeout_seconds: Option<u32>,
    pub comment: Option<String>,
}

impl SetDecl {
    fn spec(&self, family: IpFamily) -> String {
        let addr = match family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        };
        let key = match self.key {
            KeyType::Addr => addr.to_string(),
            KeyType::AddrProtoPort => format!("{addr} . inet_proto . inet_service"),
            KeyType::ProtoPort => "inet_proto . inet_service".to_string(),
            KeyType::AddrPair => format!("{addr} . {addr}"),
            KeyType::Numgen(modulus) => numgen_text(modulus, 0),
        };
        // A numgen key has no `type` name (its size is the modulus'): nft declares it by
        // `typeof`, and then the data too.
        let mut spec = match self.key {
            KeyType::Numgen(_) => format!("typeof {key}"),
            _ => format!("type {key}"),
        };
        match (self.map, self.key) {
            (None, _) => {}
            (Some(MapValue::Verdict), _) => spec.push_str(" : verdict"),
            (Some(MapValue::AddrPort(p)), KeyType::Numgen(_)) => {
                let _ = write!(spec, " : {} daddr . {} dport", family_keyword(family), p.lower());
            }
            (Some(MapValue::AddrPort(_)), _) => {
                let _ = write!(spec, " : {addr} . inet_service");
            }
        }
        if self.interval() {
            spec.push_str(" ; flags interval");
        }
        if let Some(t) = self.timeout_seconds {
            let _ = write!(spec, " ; flags dynamic,timeout ; timeout {t}s");
        }
        if let Some(c) = &self.comment {
            let _ = write!(spec, " ; comment \"{c}\"");
        }
        spec
    }

    fn kind(&self) -> &'static str {
        if self.map.is_some() { "map" } else { "set" }
    }

    /// Whether elements are intervals of keys (`flags interval`).
    pub fn interval(&self) -> bool {
        matches!(self.key, KeyType::Numgen(_))
    }

    /// A verdict map.
    pub fn is_vmap(&self) -> bool {
        self.map == Some(MapValue::Verdict)
    }
}

/// The key of a set/map element.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemKey {
    Addr(IpAddr),
    AddrProtoPort(IpAddr, Protocol, u16),
    ProtoPort(Protocol, u16),
    /// (source, destination)
    AddrPair(IpAddr, IpAddr),
    /// An interval of numbers, both ends included.
    Range(u32, u32),
}

impl ElemKey {
    /// Whether `n` falls in this key (a range; a number equals no other key).
    pub fn contains(&self, n: u32) -> bool {
        matches!(self, ElemKey::Range(lo, hi) if (*lo..=*hi).contains(&n))
    }
}

impl fmt::Display for ElemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElemKey::Addr(ip) => write!(f, "{ip}"),
            ElemKey::AddrProtoPort(ip, p, port) => write!(f, "{ip} . {} . {port}", p.lower()),
            ElemKey::ProtoPort(p, port) => write!(f, "{} . {port}", p.lower()),
            ElemKey::AddrPair(a, b) => write!(f, "{a} . {b}"),
            ElemKey::Range(lo, hi) if lo == hi => write!(f, "{lo}"),
            ElemKey::Range(lo, hi) => write!(f, "{lo}-{hi}"),
        }
    }
}

/// The value of a map element.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemValue {
    Verdict(Verdict),
    /// `ADDR . PORT` (printed `[fd00::1] . 80`-free: nft prints `fd00::1 . 80`).
    AddrPort(SocketAddr),
}

impl ElemValue {
    /// The chain a verdict value continues in, if any.
    pub fn chain(&self) -> Option<&str> {
        match self {
            ElemValue::Verdict(v) => v.chain(),
            ElemValue::AddrPort(_) => None,
        }
    }

    pub fn verdict(&self) -> Option<&Verdict> {
        match self {
            ElemValue::Verdict(v) => Some(v),
            ElemValue::AddrPort(_) => None,
        }
    }
}

impl From<Verdict> for ElemValue {
    fn from(v: Verdict) -> ElemValue {
        ElemValue::Verdict(v)
    }
}

impl fmt::Display for ElemValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElemValue::Verdict(v) => v.fmt(f),
            ElemValue::AddrPort(sa) => write!(f, "{} . {}", sa.ip(), sa.port()),
        }
    }
}

/// A set element (`value: None`) or a map element.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Element {
    pub key: ElemKey,
    pub value: Option<ElemValue>,
    pub comment: Option<String>,
}

/// One command of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `add table` (with upstream's comment); a no-op when it exists.
    AddTable,
    DeleteTable,
    /// `add chain`: creates the chain, a no-op when it exists.
    AddChain(ChainDecl),
    FlushChain(String),
    DeleteChain(String),
    AddRule {
        chain: String,
        rule: Rule,
    },
    /// `add set` / `add map`: creates it, a no-op when it exists with the same type.
    AddSet(SetDecl),
    /// `flush set` / `flush map`: removes every element.
    FlushSet {
        name: String,
        map: bool,
    },
    DeleteSet {
        name: String,
        map: bool,
    },
    AddElement {
        set: String,
        element: Element,
    },
    DeleteElement {
        set: String,
        key: ElemKey,
    },
}

/// A list of commands that the kernel applies atomically, for one family's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transaction {
    pub family: IpFamily,
    pub ops: Vec<Op>,
}

impl Transaction {
    pub fn new(family: IpFamily) -> Transaction {
        Transaction {
            family,
            ops: Vec::new(),
        }
    }

    pub fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// knftables' text form: one command per line, as `nft -f -` reads it.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for op in &self.ops {
            op.write_text(self.family, &mut out);
        }
        out
    }
}

impl Op {
    /// Appends the op's command line (knftables' text form) to `out`.
    pub fn write_text(&self, family: IpFamily, out: &mut String) {
        let f = family_keyword(family);
        // Writing to a String cannot fail.
        let _ = match self {
            Op::AddTable => writeln!(out, "add table {f} {TABLE} {{ comment \"rules for kube-proxy\" ; }}"),
            Op::DeleteTable => writeln!(out, "delete table {f} {TABLE}"),
            Op::AddChain(c) => match (&c.base, &c.comment) {
                (Some(b), _) => writeln!(
                    out,
                    "add chain {f} {TABLE} {} {{ type {} hook {} priority {} ; }}",
                    c.name, b.kind, b.hook, b.priority
                ),
                (None, Some(comment)) => {
                    writeln!(out, "add chain {f} {TABLE} {} {{ comment \"{comment}\" ; }}", c.name)
                }
                (None, None) => writeln!(out, "add chain {f} {TABLE} {}", c.name),
            },
            Op::FlushChain(c) => writeln!(out, "flush chain {f} {TABLE} {c}"),
            Op::DeleteChain(c) => writeln!(out, "delete chain {f} {TABLE} {c}"),
            Op::AddRule { chain, rule } => {
                writeln!(out, "add rule {f} {TABLE} {chain} {}", rule.text(family))
            }
            Op::AddSet(s) => writeln!(
                out,
                "add {} {f} {TABLE} {} {{ {} ; }}",
                s.kind(),
                s.name,
                s.spec(family)
            ),
            Op::FlushSet { name, map } => {
                writeln!(out, "flush {} {f} {TABLE} {name}", if *map { "map" } else { "set" })
            }
            Op::DeleteSet { name, map } => {
                writeln!(out, "delete {} {f} {TABLE} {name}", if *map { "map" } else { "set" })
            }
            Op::AddElement { set, element } => {
                let comment = element
                    .comment
                    .as_ref()
                    .map(|c| format!(" comment \"{c}\""))
                    .unwrap_or_default();
                match &element.value {
                    Some(v) => writeln!(
                        out,
                        "add element {f} {TABLE} {set} {{ {}{comment} : {v} }}",
                        element.key
                    ),
                    None => writeln!(out, "add element {f} {TABLE} {set} {{ {}{comment} }}", element.key),
                }
            }
            Op::DeleteElement { set, key } => {
                writeln!(out, "delete element {f} {TABLE} {set} {{ {key} }}")
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_print_as_knftables_text() {
        let r = Rule::verdict(
            vec![
                Match::Addr {
                    dir: Dir::Daddr,
                    negate: false,
                    spec: AddrSpec::Net("172.30.0.41/32".parse().unwrap()),
                },
                Match::Addr {
                    dir: Dir::Saddr,
                    negate: true,
                    spec: AddrSpec::Net("10.0.0.0/8".parse().unwrap()),
                },
            ],
            Verdict::Jump("mark-for-masquerade".into()),
        );
        assert_eq!(
            r.text(IpFamily::V4),
            "ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade"
        );
        let r = Rule::new(vec![], Statement::NumgenVmap(vec!["a".into(), "b".into()]));
        assert_eq!(
            r.text(IpFamily::V6),
            "numgen random mod 2 vmap { 0 : goto a , 1 : goto b }"
        );
        let r = Rule::new(
            vec![Match::L4proto(Protocol::Tcp)],
            Statement::Dnat("[fd00::1]:80".parse().unwrap()),
        );
        assert_eq!(r.text(IpFamily::V6), "meta l4proto tcp dnat to [fd00::1]:80");
        let r = Rule::verdict(vec![Match::MarkAndZero(0x4000)], Verdict::Return);
        assert_eq!(r.text(IpFamily::V4), "mark and 0x004000 == 0 return");
    }
}
