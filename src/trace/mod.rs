//! `kube-proxy trace`'s vocabulary, shared by the tracers of every mode (`crate::iptables::trace`,
//! `crate::nftables::trace`, `crate::ipvs::trace`): the [`Packet`] to follow, what the tracer
//! knows about the node ([`TraceContext`]), the [`Trace`] it reports (one [`TracePath`] per way
//! the packet can go, with its [`Verdict`] and matched rules), the [`TraceError`]s, the text
//! form of a report ([`render_text`]), and the ipsets a rule walk looks up ([`SetLookup`]).
//!
//! The modes answer in the same form so that their answers compare; `walk` holds the pieces
//! of the walk that are the same in every mode (a path's state, chain nesting, forking, the
//! hook sequence and the assembly of the report).

use std::collections::BTreeSet;
use std::fmt::{self, Write as _};
use std::net::{IpAddr, SocketAddr};

use serde::Serialize;

use crate::model::{IpFamily, Protocol};

pub(crate) mod walk;

/// Upper bound on the number of paths one trace may fork into.
pub const MAX_PATHS: usize = 10_000;
/// Upper bound on chain nesting; deeper means a jump loop (the kernel refuses loops too).
pub const MAX_DEPTH: usize = 64;

/// The packet to trace: the first packet of a new connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    pub protocol: Protocol,
    /// The interface the packet arrives on; ignored for locally generated packets.
    pub in_interface: Option<String>,
}

/// What the tracer needs to know about the node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceContext {
    /// The node's own addresses; loopback (127.0.0.0/8, ::1) always counts as local too.
    pub local_addresses: Vec<IpAddr>,
}

impl TraceContext {
    /// Whether `ip` is one of the node's addresses: what `-m addrtype --dst-type LOCAL`,
    /// `fib daddr type local` and routing find local.
    pub fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local_addresses.contains(ip)
    }
}

/// What one dimension of an ipset is keyed on: an address (`ip`, and `net`, which is matched
/// by an address too) or a port with its protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetDim {
    Addr,
    Port,
}

/// One element of the key a `-m set --match-set NAME src,dst,...` rule builds from the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetValue {
    Addr(IpAddr),
    Port(Protocol, u16),
}

/// The ipsets that `-m set --match-set` rules look up. The iptables walk knows the match; the
/// sets come from the mode that programs them apart from the rules (IPVS mode's `ipset restore`
/// input, see `crate::ipvs::trace`), so neither owns this interface.
pub trait SetLookup {
    /// The dimensions of set `name` (`hash:ip,port` is `[Addr, Port]`), or `None` when there
    /// is no such set.
    fn dimensions(&self, name: &str) -> Option<&'static [SetDim]>;
    /// Whether set `name` holds `key`, which has one value per dimension.
    fn contains(&self, name: &str, key: &[SetValue]) -> bool;
}

/// Where a packet (or one path of it) ends up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// DNATed to an endpoint and not stopped afterwards.
    Dnat,
    /// A rule of ours rejected it.
    Reject,
    /// A rule of ours (or a DROP chain policy) dropped it.
    Drop,
    /// A rule of ours accepted it explicitly and no DNAT happened.
    Accept,
    /// No rule of ours changed or stopped it.
    Pass,
}

impl Verdict {
    /// The verdict of a path that went through every hook without being stopped.
    pub(crate) fn after_all_hooks(dnat: bool, accepted: bool) -> Verdict {
        if dnat {
            Verdict::Dnat
        } else if accepted {
            Verdict::Accept
        } else {
            Verdict::Pass
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Dnat => "DNAT",
            Verdict::Reject => "REJECT",
            Verdict::Drop => "DROP",
            Verdict::Accept => "ACCEPT",
            Verdict::Pass => "PASS",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The result of a mode's `trace` (e.g. [`crate::iptables::trace::trace`]).
#[derive(Clone, Debug, Serialize)]
pub struct Trace {
    /// The verdict shared by all paths; if they disagree, DNAT if any path is DNAT, else the
    /// first path's verdict.
    pub verdict: Verdict,
    /// Sorted (as strings), de-duplicated DNAT destinations of the paths whose verdict is DNAT.
    pub endpoints: Vec<String>,
    /// True if the MASQUERADE rule matched on any path.
    pub masquerade: bool,
    /// Every matched rule, in order, path after path.
    pub rules: Vec<TracedRule>,
    pub paths: Vec<TracePath>,
    /// The packet was generated on the node (it took the output hooks); for [`render_text`].
    #[serde(skip)]
    pub from_node: bool,
}

impl Trace {
    /// Summarizes finished paths: the common verdict (DNAT if any path DNATs and they
    /// disagree, else the first path's), the endpoints of the DNAT paths and whether any path
    /// is masqueraded. Shared by the iptables and nftables tracers so their answers compare.
    pub fn from_paths(rules: Vec<TracedRule>, paths: Vec<TracePath>, from_node: bool) -> Trace {
        let first_verdict = paths.first().map_or(Verdict::Pass, |p| p.verdict);
        let verdict = if paths.iter().all(|p| p.verdict == first_verdict) {
            first_verdict
        } else if paths.iter().any(|p| p.verdict == Verdict::Dnat) {
            Verdict::Dnat
        } else {
            first_verdict
        };
        // Sorted as strings (what the JSON consumer sees), not by address.
        let endpoints: BTreeSet<String> = paths
            .iter()
            .filter(|p| p.verdict == Verdict::Dnat)
            .filter_map(|p| p.endpoint.clone())
            .collect();
        Trace {
            verdict,
            endpoints: endpoints.into_iter().collect(),
            masquerade: paths.iter().any(|p| p.masquerade),
            rules,
            paths,
            from_node,
        }
    }
}

/// One matched rule on one path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TracedRule {
    /// `filter` or `nat`.
    pub table: String,
    pub chain: String,
    /// The rule as `-A CHAIN ...` text, quoted as in the input.
    pub rule: String,
    /// Index into [`Trace::paths`].
    pub path: usize,
}

/// One way the packet can go.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TracePath {
    pub verdict: Verdict,
    /// The DNAT destination (`ip:port`, `[v6]:port`), if the packet was DNATed on this path.
    pub endpoint: Option<String>,
    /// True if the MASQUERADE rule matched on this path.
    pub masquerade: bool,
    /// Human notes of the branch choices that lead to this path.
    pub choices: Vec<String>,
    /// The hooks evaluated, in order, e.g. `["nat/PREROUTING", "filter/FORWARD", "nat/POSTROUTING"]`.
    pub hooks: Vec<String>,
}

/// Why a trace could not be produced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// A line of the restore text is malformed (bad quoting, missing value, bad address,
    /// missing COMMIT, ...).
    #[error("restore line {line}: malformed `{text}`: {reason}")]
    Parse { line: usize, text: String, reason: String },
    /// A line of the restore text uses something the tracer does not model (an unknown option,
    /// match module, target, table or command).
    #[error("restore line {line}: unsupported rule `{rule}`: {reason}")]
    UnsupportedRule { line: usize, rule: String, reason: String },
    /// A rule of `Ruleset::jumps` is malformed or uses something the tracer does not model.
    #[error("jump rule `{rule}` in {table}/{chain}: {reason}")]
    UnsupportedJumpRule {
        table: String,
        chain: String,
        rule: String,
        reason: String,
    },
    /// A restore rule appends to, jumps to or goes to a chain that is not declared in its table.
    #[error("restore line {line}: chain or target {chain} does not exist in table {table}: `{rule}`")]
    UnknownChain {
        line: usize,
        table: String,
        chain: String,
        rule: String,
    },
    /// Chain jumps nest into a loop or deeper than [`MAX_DEPTH`].
    #[error("jump loop in table {table}: {stack}")]
    Loop { table: String, stack: String },
    /// The walk forks into more than [`MAX_PATHS`] paths.
    #[error("the trace forks into more than {limit} paths")]
    TooManyPaths { limit: usize },
    /// A restore rule matches an ipset that the caller did not supply (`iptables-restore`
    /// refuses such a rule too), or uses it in a way the tracer does not model.
    #[error("restore line {line}: ipset {set}: {reason}: `{rule}`")]
    Set {
        line: usize,
        set: String,
        rule: String,
        reason: String,
    },
    /// A line of the `ipset restore` input is malformed or uses something the tracer does not
    /// model (a set type, option or entry syntax).
    #[error("ipset restore line {line}: `{text}`: {reason}")]
    Ipset { line: usize, text: String, reason: String },
    /// A packet address is not of the ruleset's IP family.
    #[error("packet address {address} is not {family} like the ruleset")]
    FamilyMismatch { family: IpFamily, address: IpAddr },
    /// The nftables table holds something the kernel would refuse or the nftables tracer does
    /// not model (a missing chain or set, a set of the wrong type, NAT where it cannot NAT).
    #[error("{table} chain {chain}: {reason}")]
    Nftables {
        table: String,
        chain: String,
        reason: String,
    },
}
/// Both addresses of the packet must be of the ruleset's family.
pub(crate) fn check_family(family: IpFamily, packet: &Packet) -> Result<(), TraceError> {
    for address in [packet.src, packet.dst] {
        if !family.contains(&address) {
            return Err(TraceError::FamilyMismatch { family, address });
        }
    }
    Ok(())
}

/// Renders a trace for humans: the packet, each path's matched rules and outcome, a summary.
pub fn render_text(trace: &Trace, packet: &Packet) -> String {
    let mut out = String::new();
    let family = IpFamily::of(&packet.dst);
    // A locally generated packet has no input interface, whatever --in-interface said.
    let origin = match &packet.in_interface {
        _ if trace.from_node => " from this node".to_string(),
        Some(i) => format!(" in {i}"),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "packet: {} {} -> {}{} ({family}, new connection)",
        packet.protocol,
        packet.src,
        SocketAddr::new(packet.dst, packet.dport),
        origin
    );
    let total = trace.paths.len();
    for (index, path) in trace.paths.iter().enumerate() {
        let _ = writeln!(out, "path {}/{}: {}", index + 1, total, path.hooks.join(" -> "));
        for rule in trace.rules.iter().filter(|r| r.path == index) {
            let _ = writeln!(out, "  {}/{}: {}", rule.table, rule.chain, rule.rule);
        }
        for choice in &path.choices {
            let _ = writeln!(out, "  choice: {choice}");
        }
        let outcome = match (path.verdict, &path.endpoint) {
            (Verdict::Dnat, Some(ep)) => format!("DNAT to {ep}"),
            (Verdict::Pass, _) => "PASS (no kube-proxy rule changed or stopped the packet)".to_string(),
            (v, Some(ep)) => format!("{v} (after DNAT to {ep})"),
            (v, None) => v.to_string(),
        };
        let masq = if path.masquerade { ", masqueraded" } else { "" };
        let _ = writeln!(out, "  => {outcome}{masq}");
    }
    let endpoints = if trace.endpoints.is_empty() {
        "none".to_string()
    } else {
        trace.endpoints.join(", ")
    };
    let _ = writeln!(
        out,
        "verdict: {}; endpoints: {}; masquerade: {}",
        trace.verdict,
        endpoints,
        if trace.masquerade { "yes" } else { "no" }
    );
    out
}
