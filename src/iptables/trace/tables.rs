//! The filter and nat tables as the tracer holds them once loaded: chains, rules and the
//! matches and targets of the rules, in the form the walk evaluates them.

use std::collections::HashMap;
use std::net::IpAddr;

use crate::model::Protocol;

pub(super) const FILTER: usize = 0;
pub(super) const NAT: usize = 1;
pub(super) const TABLE_NAMES: [&str; 2] = ["filter", "nat"];
pub(super) const BUILTINS: [&[&str]; 2] = [
    &["INPUT", "FORWARD", "OUTPUT"],
    &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
];

/// The filter and nat tables, indexed by `FILTER` and `NAT`, as `load` parses them.
pub(crate) type Tables = [Table; 2];

/// One table's chains, the built-in ones first, and their index by name.
pub(crate) struct Table {
    pub(super) chains: Vec<Chain>,
    pub(super) index: HashMap<String, usize>,
}

/// A chain and its rules in order; a built-in chain's policy may be DROP.
pub(super) struct Chain {
    pub(super) name: String,
    pub(super) builtin: bool,
    pub(super) policy_drop: bool,
    pub(super) rules: Vec<Rule>,
}

/// A rule with its target resolved, as the walk evaluates it.
pub(super) struct Rule {
    /// 1-based restore line; 0 for a jump rule.
    pub(super) line: usize,
    pub(super) text: String,
    pub(super) comment: Option<String>,
    pub(super) matches: Vec<Match>,
    pub(super) target: Target,
}

impl Table {
    pub(super) fn new(table: usize) -> Table {
        let mut t = Table {
            chains: Vec::new(),
            index: HashMap::new(),
        };
        for name in BUILTINS[table] {
            t.declare(name, true);
        }
        t
    }

    /// Declares a chain unless it is declared already; its index either way.
    pub(super) fn declare(&mut self, name: &str, builtin: bool) -> usize {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        self.chains.push(Chain {
            name: name.to_string(),
            builtin,
            policy_drop: false,
            rules: Vec::new(),
        });
        self.index.insert(name.to_string(), self.chains.len() - 1);
        self.chains.len() - 1
    }
}

/// A CIDR of either family, as (network bits, mask bits) widened to u128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Cidr {
    pub(super) v6: bool,
    pub(super) net: u128,
    pub(super) mask: u128,
}

impl Cidr {
    pub(super) fn contains(&self, ip: &IpAddr) -> bool {
        let (v6, bits) = ip_bits(ip);
        v6 == self.v6 && bits & self.mask == self.net
    }
}

/// An address as (is IPv6, its bits widened to u128).
pub(super) fn ip_bits(ip: &IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(a) => (false, u128::from(u32::from(*a))),
        IpAddr::V6(a) => (true, u128::from(*a)),
    }
}

// Conntrack state bits (as the conntrack match sees them for our packet).
pub(super) const CT_NEW: u8 = 1;
pub(super) const CT_ESTABLISHED: u8 = 2;
pub(super) const CT_RELATED: u8 = 4;
pub(super) const CT_INVALID: u8 = 8;
pub(super) const CT_UNTRACKED: u8 = 16;
pub(super) const CT_SNAT: u8 = 32;
pub(super) const CT_DNAT: u8 = 64;

/// One match of a rule, as `parse_rule` reads it from the options of a match module.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Match {
    /// `-p`; `None` is `all`.
    Protocol {
        protocol: Option<Protocol>,
        neg: bool,
    },
    Source {
        cidr: Cidr,
        neg: bool,
    },
    Destination {
        cidr: Cidr,
        neg: bool,
    },
    InInterface {
        name: String,
        neg: bool,
    },
    /// `--dport` of the tcp/udp/sctp match (only matches packets of that protocol).
    Dport {
        protocol: Protocol,
        lo: u16,
        hi: u16,
        neg: bool,
    },
    /// `-m addrtype --dst-type LOCAL` (`dst`) or `--src-type LOCAL`.
    AddrTypeLocal {
        dst: bool,
        neg: bool,
    },
    Mark {
        value: u32,
        mask: u32,
        neg: bool,
    },
    CtState {
        states: u8,
        neg: bool,
    },
    /// Forks: matched on one path, not matched on another.
    Statistic {
        probability: f64,
        text: String,
    },
    /// Forks like statistic unless already decided on this path.
    RecentCheck {
        name: String,
    },
    /// Always matches; records the name on this path.
    RecentSet {
        name: String,
    },
    /// `-m set --match-set NAME src,dst,...`: one direction per flag, `true` for `src`.
    Set {
        name: String,
        src: Vec<bool>,
        neg: bool,
    },
    /// `-m physdev --physdev-is-in`: the packet came in through a bridge port (seen by
    /// iptables with br_netfilter). The input interface alone does not say whether it was
    /// bridged, so a packet that has one forks: bridged and not.
    PhysdevIsIn {
        neg: bool,
    },
    /// `-m ipvs --vaddr`: the packet belongs to an IPVS connection whose virtual address is in
    /// the CIDR. Like every option of the ipvs match but `--ipvs`, it never matches a packet
    /// that IPVS has not handled, negated or not.
    IpvsVaddr {
        cidr: Cidr,
        neg: bool,
    },
    /// `-m ipvs --vproto`.
    IpvsVproto {
        protocol: Protocol,
        neg: bool,
    },
    /// `-m ipvs --vport`.
    IpvsVport {
        port: u16,
        neg: bool,
    },
}

/// What a rule does when it matches; `Jump` and `Goto` name a chain of the same table.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Target {
    None,
    Jump(usize),
    Goto(usize),
    Return,
    Accept,
    Drop,
    Reject,
    Dnat {
        addr: IpAddr,
        port: Option<u16>,
    },
    Masquerade,
    /// new mark = (mark & !mask) ^ value, the kernel's MARK target.
    Mark {
        value: u32,
        mask: u32,
    },
}
