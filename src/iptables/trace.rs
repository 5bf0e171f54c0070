//! `kube-proxy trace`: follows one new packet through the rules kube-proxy rendered.
//!
//! This module owns the whole tracer: parsing `iptables-restore` text plus the jump rules kept
//! in built-in chains, modelling the kernel's netfilter hook order (nat PREROUTING/OUTPUT,
//! routing, filter INPUT/FORWARD/OUTPUT, nat POSTROUTING), evaluating the matches and targets
//! kube-proxy uses, and reporting every path the packet can take (random load-balancing and
//! session affinity fork the walk) as a [`Trace`], as JSON or as text via [`render_text`].
//!
//! It is deliberately strict: any option it does not model is a [`TraceError`], because a
//! tracer that silently skips a match answers with confidence and is wrong.
//!
//! The IPVS-mode tracer (`crate::ipvs::trace`) walks the same parsed rules with its own hook
//! order (IPVS sits in LOCAL_IN and LOCAL_OUT): it loads them with `load`, supplies the
//! ipsets that `-m set --match-set` looks up through [`SetLookup`], and runs one hook at a time
//! with `Tracer::run_hook`; the walk state and the report assembly are shared.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::Serialize;

use crate::iptables::{JumpRule, Ruleset};
use crate::model::{IpFamily, Protocol};

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

/// The ipsets that `-m set --match-set` rules look up. The tracer knows the match; the sets
/// come from the caller (IPVS mode's `ipset restore` input, see `crate::ipvs::trace`), because
/// they are programmed apart from the iptables rules.
pub trait SetLookup {
    /// The dimensions of set `name` (`hash:ip,port` is `[Addr, Port]`), or `None` when there
    /// is no such set.
    fn dimensions(&self, name: &str) -> Option<&'static [SetDim]>;
    /// Whether set `name` holds `key`, which has one value per dimension.
    fn contains(&self, name: &str, key: &[SetValue]) -> bool;
}

/// No ipsets at all: iptables mode creates none, so a rule naming one is an error, as it
/// would be for `iptables-restore`.
pub struct NoSets;

impl SetLookup for NoSets {
    fn dimensions(&self, _name: &str) -> Option<&'static [SetDim]> {
        None
    }

    fn contains(&self, _name: &str, _key: &[SetValue]) -> bool {
        false
    }
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

/// The result of [`trace`].
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

/// Follows `packet` through `ruleset` and reports every path it can take.
pub fn trace(ruleset: &Ruleset, ctx: &TraceContext, packet: &Packet) -> Result<Trace, TraceError> {
    check_family(ruleset.family, packet)?;
    let tables = load(ruleset, &NoSets)?;
    let mut tracer = Tracer::new(&tables, &NoSets, &ctx.local_addresses);
    let from_node = tracer.is_local(&packet.src);
    let first = if from_node {
        Hook::NatOutput
    } else {
        Hook::NatPrerouting
    };
    let mut finished = Vec::new();
    tracer.walk(first, PathState::start(packet, from_node), from_node, &mut finished)?;
    Ok(finish(&tables, finished, from_node))
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

/// Turns the finished paths of a walk into the report.
pub(crate) fn finish(tables: &Tables, mut finished: Vec<PathState>, from_node: bool) -> Trace {
    // Identical step sequences are the same path reached twice; keep the first.
    let mut seen = HashSet::new();
    finished.retain(|p| seen.insert(p.rules.clone()));

    let mut rules = Vec::new();
    let mut paths = Vec::new();
    for (index, p) in finished.iter().enumerate() {
        for step in &p.rules {
            rules.push(match step {
                Step::Rule(r) => {
                    let chain = &tables[r.table].chains[r.chain];
                    TracedRule {
                        table: TABLE_NAMES[r.table].to_string(),
                        chain: chain.name.clone(),
                        rule: chain.rules[r.rule].text.clone(),
                        path: index,
                    }
                }
                Step::Other { table, chain, text } => TracedRule {
                    table: (*table).to_string(),
                    chain: (*chain).to_string(),
                    rule: text.clone(),
                    path: index,
                },
            });
        }
        paths.push(TracePath {
            verdict: p.verdict,
            endpoint: p.dnat.map(|a| a.to_string()),
            masquerade: p.masquerade,
            choices: p.choices.clone(),
            hooks: p.hooks.iter().map(|h| h.to_string()).collect(),
        });
    }
    Trace::from_paths(rules, paths, from_node)
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

// ---------------------------------------------------------------------------------------------
// Parsed rules

const FILTER: usize = 0;
const NAT: usize = 1;
const TABLE_NAMES: [&str; 2] = ["filter", "nat"];
const BUILTINS: [&[&str]; 2] = [
    &["INPUT", "FORWARD", "OUTPUT"],
    &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
];

/// The filter and nat tables, indexed by `FILTER` and `NAT`, as `load` parses them.
pub(crate) type Tables = [Table; 2];

pub(crate) struct Table {
    chains: Vec<Chain>,
    index: HashMap<String, usize>,
}

struct Chain {
    name: String,
    builtin: bool,
    policy_drop: bool,
    rules: Vec<Rule>,
}

struct Rule {
    /// 1-based restore line; 0 for a jump rule.
    line: usize,
    text: String,
    comment: Option<String>,
    matches: Vec<Match>,
    target: Target,
}

impl Table {
    fn new(table: usize) -> Table {
        let mut t = Table {
            chains: Vec::new(),
            index: HashMap::new(),
        };
        for name in BUILTINS[table] {
            t.declare(name, true);
        }
        t
    }

    fn declare(&mut self, name: &str, builtin: bool) -> usize {
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
struct Cidr {
    v6: bool,
    net: u128,
    mask: u128,
}

impl Cidr {
    fn contains(&self, ip: &IpAddr) -> bool {
        let (v6, bits) = ip_bits(ip);
        v6 == self.v6 && bits & self.mask == self.net
    }
}

fn ip_bits(ip: &IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(a) => (false, u128::from(u32::from(*a))),
        IpAddr::V6(a) => (true, u128::from(*a)),
    }
}

// Conntrack state bits (as the conntrack match sees them for our packet).
const CT_NEW: u8 = 1;
const CT_ESTABLISHED: u8 = 2;
const CT_RELATED: u8 = 4;
const CT_INVALID: u8 = 8;
const CT_UNTRACKED: u8 = 16;
const CT_SNAT: u8 = 32;
const CT_DNAT: u8 = 64;

#[derive(Clone, Debug, PartialEq)]
enum Match {
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

#[derive(Clone, Debug, PartialEq)]
enum Target {
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

/// A target before chain names are resolved.
#[derive(Clone, Debug, PartialEq)]
enum TargetSpec {
    Resolved(Target),
    Jump(String),
    Goto(String),
}

#[derive(Debug)]
struct ParsedRule {
    comment: Option<String>,
    matches: Vec<Match>,
    target: TargetSpec,
}

#[derive(Debug, PartialEq)]
enum RuleErr {
    Malformed(String),
    Unsupported(String),
}

impl RuleErr {
    fn reason(self) -> String {
        match self {
            RuleErr::Malformed(r) | RuleErr::Unsupported(r) => r,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Loading the ruleset

/// A restore rule waiting for all chains to be declared before its target is resolved.
struct PendingRule {
    table: usize,
    chain: usize,
    line: usize,
    text: String,
    parsed: ParsedRule,
}

/// Parses the restore input and the jump rules of `ruleset`; every set a rule matches must be
/// in `sets`.
pub(crate) fn load(ruleset: &Ruleset, sets: &dyn SetLookup) -> Result<Tables, TraceError> {
    let family = ruleset.family;
    let mut tables = [Table::new(FILTER), Table::new(NAT)];
    let mut pending = Vec::new();
    let mut current: Option<(usize, usize)> = None; // (table, line of `*table`)
    let mut last_line = 0;

    for (i, raw) in ruleset.restore.lines().enumerate() {
        let line = i + 1;
        last_line = line;
        let text = raw.trim();
        let parse_err = |reason: &str| TraceError::Parse {
            line,
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let unsupported = |reason: &str| TraceError::UnsupportedRule {
            line,
            rule: text.to_string(),
            reason: reason.to_string(),
        };
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        if let Some(name) = text.strip_prefix('*') {
            if current.is_some() {
                return Err(parse_err("table started before the previous table's COMMIT"));
            }
            let table = match name.trim() {
                "filter" => FILTER,
                "nat" => NAT,
                _ => return Err(unsupported("only the filter and nat tables are traced")),
            };
            current = Some((table, line));
            continue;
        }
        if text == "COMMIT" {
            if current.take().is_none() {
                return Err(parse_err("COMMIT outside a table"));
            }
            continue;
        }
        let Some((table, _)) = current else {
            return Err(parse_err("line outside a *table ... COMMIT block"));
        };
        if let Some(decl) = text.strip_prefix(':') {
            let tokens = tokenize(decl).map_err(|r| parse_err(&r))?;
            let (Some(name), Some(policy)) = (tokens.first(), tokens.get(1)) else {
                return Err(parse_err("chain declaration needs a name and a policy"));
            };
            let idx = match tables[table].index.get(name.as_str()) {
                Some(&idx) => idx,
                None => tables[table].declare(name, false),
            };
            let chain = &mut tables[table].chains[idx];
            if chain.builtin {
                chain.policy_drop = match policy.as_str() {
                    "ACCEPT" => false,
                    "DROP" => true,
                    _ => return Err(unsupported("built-in chain policy must be ACCEPT or DROP")),
                };
            } else if policy != "-" {
                return Err(parse_err("a user-defined chain's policy must be `-`"));
            }
            continue;
        }
        let tokens = tokenize(text).map_err(|r| parse_err(&r))?;
        let command = tokens.first().map(String::as_str).unwrap_or_default();
        match command {
            "-A" | "--append" => {
                let Some(chain_name) = tokens.get(1) else {
                    return Err(parse_err("-A needs a chain name"));
                };
                let Some(&chain) = tables[table].index.get(chain_name.as_str()) else {
                    return Err(TraceError::UnknownChain {
                        line,
                        table: TABLE_NAMES[table].to_string(),
                        chain: chain_name.clone(),
                        rule: text.to_string(),
                    });
                };
                let parsed = parse_rule(&tokens[2..], family, table).map_err(|e| match e {
                    RuleErr::Malformed(r) => parse_err(&r),
                    RuleErr::Unsupported(r) => unsupported(&r),
                })?;
                pending.push(PendingRule {
                    table,
                    chain,
                    line,
                    text: text.to_string(),
                    parsed,
                });
            }
            // Stale chains are declared (flushed) and deleted; nothing to trace.
            "-X" | "--delete-chain" => {}
            "-N" | "--new-chain" => {
                let Some(name) = tokens.get(1) else {
                    return Err(parse_err("-N needs a chain name"));
                };
                tables[table].declare(name, false);
            }
            _ => {
                return Err(unsupported("only chain declarations, -A, -N and -X lines are traced"));
            }
        }
    }
    if let Some((table, line)) = current {
        return Err(TraceError::Parse {
            line: last_line.max(line),
            text: format!("*{}", TABLE_NAMES[table]),
            reason: "table is missing its COMMIT".to_string(),
        });
    }

    // Jump rules are inserted ahead of anything appended to built-in chains.
    for jump in &ruleset.jumps {
        add_jump_rule(&mut tables, jump, family, sets)?;
    }

    for p in pending {
        check_sets(&p.parsed.matches, sets).map_err(|(set, reason)| TraceError::Set {
            line: p.line,
            set,
            rule: p.text.clone(),
            reason,
        })?;
        let resolve = |name: &str| -> Result<usize, TraceError> {
            match tables[p.table].index.get(name) {
                Some(&idx) if !tables[p.table].chains[idx].builtin => Ok(idx),
                Some(_) => Err(TraceError::UnsupportedRule {
                    line: p.line,
                    rule: p.text.clone(),
                    reason: format!("jumping to built-in chain {name} is not allowed"),
                }),
                None => Err(TraceError::UnknownChain {
                    line: p.line,
                    table: TABLE_NAMES[p.table].to_string(),
                    chain: name.to_string(),
                    rule: p.text.clone(),
                }),
            }
        };
        let target = match p.parsed.target {
            TargetSpec::Resolved(t) => t,
            TargetSpec::Jump(name) => Target::Jump(resolve(&name)?),
            TargetSpec::Goto(name) => Target::Goto(resolve(&name)?),
        };
        tables[p.table].chains[p.chain].rules.push(Rule {
            line: p.line,
            text: p.text,
            comment: p.parsed.comment,
            matches: p.parsed.matches,
            target,
        });
    }
    Ok(tables)
}

/// Checks the `-m set` matches of a rule against the sets supplied: `(set, reason)` if one is
/// missing or used in a way the tracer cannot evaluate.
fn check_sets(matches: &[Match], sets: &dyn SetLookup) -> Result<(), (String, String)> {
    for m in matches {
        let Match::Set { name, src, .. } = m else {
            continue;
        };
        let Some(dims) = sets.dimensions(name) else {
            return Err((name.clone(), "no such set".to_string()));
        };
        // Flags beyond the set's dimensions are ignored by the kernel, as in upstream's use of
        // `dst,dst` with `hash:ip,port`. Fewer flags than dimensions never match (see
        // `Tracer::set_match`).
        if dims.iter().zip(src).any(|(dim, &src)| src && *dim == SetDim::Port) {
            return Err((name.clone(), "source ports are not traced".to_string()));
        }
    }
    Ok(())
}

fn add_jump_rule(
    tables: &mut Tables,
    jump: &JumpRule,
    family: IpFamily,
    sets: &dyn SetLookup,
) -> Result<(), TraceError> {
    let mut text = format!("-A {}", jump.chain);
    for arg in &jump.args {
        text.push(' ');
        text.push_str(&quote_arg(arg));
    }
    let err = |reason: String| TraceError::UnsupportedJumpRule {
        table: jump.table.to_string(),
        chain: jump.chain.to_string(),
        rule: text.clone(),
        reason,
    };
    let table = match jump.table {
        "filter" => FILTER,
        "nat" => NAT,
        _ => return Err(err("only the filter and nat tables are traced".to_string())),
    };
    if !BUILTINS[table].contains(&jump.chain) {
        return Err(err(format!(
            "{} is not a built-in chain of the {} table",
            jump.chain, jump.table
        )));
    }
    let parsed = parse_rule(&jump.args, family, table).map_err(|e| err(e.reason()))?;
    check_sets(&parsed.matches, sets).map_err(|(set, reason)| err(format!("ipset {set}: {reason}")))?;
    let goto = matches!(parsed.target, TargetSpec::Goto(_));
    let target = match parsed.target {
        TargetSpec::Resolved(t) => t,
        TargetSpec::Jump(name) | TargetSpec::Goto(name) => match tables[table].index.get(&name) {
            Some(&idx) if !tables[table].chains[idx].builtin => {
                if goto {
                    Target::Goto(idx)
                } else {
                    Target::Jump(idx)
                }
            }
            Some(_) => {
                return Err(err(format!("jumping to built-in chain {name} is not allowed")));
            }
            // The chain is not in this ruleset (e.g. KUBE-FIREWALL not rendered): nothing to jump to.
            None => return Ok(()),
        },
    };
    let chain = tables[table].index[jump.chain];
    let rules = &mut tables[table].chains[chain].rules;
    let at = rules.iter().take_while(|r| r.line == 0).count();
    rules.insert(
        at,
        Rule {
            line: 0,
            text,
            comment: parsed.comment,
            matches: parsed.matches,
            target,
        },
    );
    Ok(())
}

/// Splits a line the way iptables-restore does: whitespace separates, double quotes group (and
/// a closing quote ends the token), a backslash escapes `"` or `\` inside quotes.
fn tokenize(line: &str) -> Result<Vec<String>, String> {
    let mut tokens = Vec::new();
    let mut cur = String::new();
    let mut in_token = false;
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if quoted {
            match c {
                '\\' if matches!(chars.peek(), Some('"') | Some('\\')) => {
                    if let Some(next) = chars.next() {
                        cur.push(next);
                    }
                }
                '"' => {
                    quoted = false;
                    in_token = false;
                    tokens.push(std::mem::take(&mut cur));
                }
                _ => cur.push(c),
            }
        } else if c == '"' {
            quoted = true;
            in_token = true;
        } else if c.is_whitespace() {
            if in_token {
                tokens.push(std::mem::take(&mut cur));
                in_token = false;
            }
        } else {
            cur.push(c);
            in_token = true;
        }
    }
    if quoted {
        return Err("unterminated double quote".to_string());
    }
    if in_token {
        tokens.push(cur);
    }
    Ok(tokens)
}

fn quote_arg(arg: &str) -> String {
    if !arg.is_empty() && !arg.chars().any(|c| c.is_whitespace() || c == '"') {
        return arg.to_string();
    }
    let mut q = String::from("\"");
    for c in arg.chars() {
        if c == '"' || c == '\\' {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q
}

const MODULES: [&str; 13] = [
    "comment", "tcp", "udp", "sctp", "addrtype", "mark", "conntrack", "statistic", "recent", "nfacct", "set",
    "physdev", "ipvs",
];

#[derive(Default)]
struct RecentSpec {
    name: Option<String>,
    rcheck: bool,
    set: bool,
    seconds: bool,
    reap: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum TargetKind {
    Dnat,
    Masquerade,
    Mark,
    Reject,
    Other,
}

/// Parses the arguments after `-A CHAIN` into matches and a target.
fn parse_rule(tokens: &[String], family: IpFamily, table: usize) -> Result<ParsedRule, RuleErr> {
    use RuleErr::{Malformed, Unsupported};

    let mut matches = Vec::new();
    let mut comment = None;
    let mut loaded: Vec<&str> = Vec::new();
    let mut port_protocol: Option<Protocol> = None; // from the last tcp/udp/sctp module
    let mut p_protocol: Option<Protocol> = None; // from -p, autoloads its module
    let mut dports: Vec<(u16, u16, bool)> = Vec::new();
    let mut stat_mode: Option<String> = None;
    let mut stat_prob: Option<(f64, String)> = None;
    let mut recent: Option<RecentSpec> = None;
    let mut target: Option<(TargetSpec, TargetKind)> = None;
    let mut to_destination: Option<(IpAddr, Option<u16>)> = None;
    let mut mark_op: Option<(u32, u32)> = None;
    let mut neg = false;

    let mut i = 0;
    while i < tokens.len() {
        let opt = tokens[i].as_str();
        i += 1;
        if opt == "!" {
            if neg {
                return Err(Malformed("double `!`".to_string()));
            }
            neg = true;
            continue;
        }
        let negated = std::mem::take(&mut neg);
        let mut value = || -> Result<&str, RuleErr> {
            let v = tokens
                .get(i)
                .map(String::as_str)
                .ok_or_else(|| Malformed(format!("{opt} needs a value")))?;
            i += 1;
            Ok(v)
        };
        let no_neg = |negated: bool| -> Result<(), RuleErr> {
            if negated {
                Err(Unsupported(format!("negated {opt} is not supported")))
            } else {
                Ok(())
            }
        };
        let need = |module: &str| -> Result<(), RuleErr> {
            if loaded.contains(&module) {
                Ok(())
            } else {
                Err(Unsupported(format!("{opt} without -m {module}")))
            }
        };
        let need_target = |kind: TargetKind, name: &str| -> Result<(), RuleErr> {
            match &target {
                Some((_, k)) if *k == kind => Ok(()),
                _ => Err(Unsupported(format!("{opt} is only valid with -j {name}"))),
            }
        };
        match opt {
            "-p" | "--protocol" => {
                let v = value()?;
                let protocol = match v.to_ascii_lowercase().as_str() {
                    "all" => None,
                    "tcp" => Some(Protocol::Tcp),
                    "udp" => Some(Protocol::Udp),
                    "sctp" => Some(Protocol::Sctp),
                    _ => return Err(Unsupported(format!("protocol {v} is not supported"))),
                };
                if !negated {
                    p_protocol = protocol;
                }
                matches.push(Match::Protocol { protocol, neg: negated });
            }
            "-s" | "--source" => {
                let cidr = parse_cidr(value()?, family)?;
                matches.push(Match::Source { cidr, neg: negated });
            }
            "-d" | "--destination" => {
                let cidr = parse_cidr(value()?, family)?;
                matches.push(Match::Destination { cidr, neg: negated });
            }
            "-i" | "--in-interface" => {
                let name = value()?.to_string();
                matches.push(Match::InInterface { name, neg: negated });
            }
            "-m" | "--match" => {
                no_neg(negated)?;
                let v = value()?;
                let Some(module) = MODULES.iter().find(|m| **m == v) else {
                    return Err(Unsupported(format!("match module {v} is not supported")));
                };
                if (*module == "statistic" || *module == "recent") && loaded.contains(module) {
                    return Err(Unsupported(format!("more than one -m {module} in a rule")));
                }
                match *module {
                    "tcp" => port_protocol = Some(Protocol::Tcp),
                    "udp" => port_protocol = Some(Protocol::Udp),
                    "sctp" => port_protocol = Some(Protocol::Sctp),
                    "recent" => recent = Some(RecentSpec::default()),
                    _ => {}
                }
                loaded.push(module);
            }
            "-j" | "--jump" | "-g" | "--goto" => {
                no_neg(negated)?;
                let v = value()?;
                if target.is_some() {
                    return Err(Malformed("more than one target".to_string()));
                }
                let goto = opt == "-g" || opt == "--goto";
                let (spec, kind) = match v {
                    _ if goto => (TargetSpec::Goto(v.to_string()), TargetKind::Other),
                    "ACCEPT" => (TargetSpec::Resolved(Target::Accept), TargetKind::Other),
                    "DROP" => (TargetSpec::Resolved(Target::Drop), TargetKind::Other),
                    "RETURN" => (TargetSpec::Resolved(Target::Return), TargetKind::Other),
                    "REJECT" if table == NAT => {
                        return Err(Unsupported("REJECT in the nat table".to_string()));
                    }
                    "REJECT" => (TargetSpec::Resolved(Target::Reject), TargetKind::Reject),
                    "DNAT" | "MASQUERADE" if table != NAT => {
                        return Err(Unsupported(format!("{v} outside the nat table")));
                    }
                    "DNAT" => (TargetSpec::Resolved(Target::None), TargetKind::Dnat),
                    "MASQUERADE" => (TargetSpec::Resolved(Target::Masquerade), TargetKind::Masquerade),
                    "MARK" => (TargetSpec::Resolved(Target::None), TargetKind::Mark),
                    _ => (TargetSpec::Jump(v.to_string()), TargetKind::Other),
                };
                target = Some((spec, kind));
            }
            "--comment" => {
                no_neg(negated)?;
                need("comment")?;
                let v = value()?;
                comment.get_or_insert_with(|| v.to_string());
            }
            "--dport" | "--destination-port" => {
                if port_protocol.is_none() {
                    // iptables autoloads the protocol's match for `-p tcp --dport N`.
                    port_protocol = p_protocol;
                }
                if port_protocol.is_none() {
                    return Err(Unsupported(format!("{opt} without -p or -m tcp/udp/sctp")));
                }
                let (lo, hi) = parse_port_range(value()?)?;
                dports.push((lo, hi, negated));
                let protocol = port_protocol.unwrap_or(Protocol::Tcp);
                matches.push(Match::Dport {
                    protocol,
                    lo,
                    hi,
                    neg: negated,
                });
            }
            "--dst-type" | "--src-type" => {
                need("addrtype")?;
                let v = value()?;
                if v != "LOCAL" {
                    return Err(Unsupported(format!("address type {v} is not supported (only LOCAL)")));
                }
                matches.push(Match::AddrTypeLocal {
                    dst: opt == "--dst-type",
                    neg: negated,
                });
            }
            "--mark" => {
                need("mark")?;
                let (value, mask) = parse_mark(value()?)?;
                matches.push(Match::Mark {
                    value,
                    mask,
                    neg: negated,
                });
            }
            "--ctstate" => {
                need("conntrack")?;
                let states = parse_ctstates(value()?)?;
                matches.push(Match::CtState { states, neg: negated });
            }
            "--mode" => {
                no_neg(negated)?;
                need("statistic")?;
                stat_mode = Some(value()?.to_string());
            }
            "--probability" => {
                no_neg(negated)?;
                need("statistic")?;
                let v = value()?;
                let p: f64 = v
                    .parse()
                    .ok()
                    .filter(|p: &f64| (0.0..=1.0).contains(p))
                    .ok_or_else(|| Malformed(format!("bad probability {v}")))?;
                stat_prob = Some((p, v.to_string()));
            }
            "--name" | "--rcheck" | "--set" | "--seconds" | "--reap" | "--rsource" => {
                no_neg(negated)?;
                need("recent")?;
                let spec = recent.get_or_insert_with(RecentSpec::default);
                match opt {
                    "--name" => spec.name = Some(value()?.to_string()),
                    "--rcheck" => spec.rcheck = true,
                    "--set" => spec.set = true,
                    "--seconds" => {
                        let v = value()?;
                        v.parse::<u64>().map_err(|_| Malformed(format!("bad --seconds {v}")))?;
                        spec.seconds = true;
                    }
                    "--reap" => spec.reap = true,
                    _ => {} // --rsource is the default
                }
            }
            "--nfacct-name" => {
                no_neg(negated)?;
                need("nfacct")?;
                value()?;
            }
            "--match-set" => {
                need("set")?;
                let name = value()?.to_string();
                let flags = value()?;
                let mut src = Vec::new();
                for flag in flags.split(',') {
                    src.push(match flag {
                        "src" => true,
                        "dst" => false,
                        _ => return Err(Malformed(format!("bad --match-set flags {flags}"))),
                    });
                }
                // ipset's limit on dimensions.
                if src.len() > 6 {
                    return Err(Malformed(format!("too many --match-set flags {flags}")));
                }
                matches.push(Match::Set {
                    name,
                    src,
                    neg: negated,
                });
            }
            "--physdev-is-in" => {
                need("physdev")?;
                matches.push(Match::PhysdevIsIn { neg: negated });
            }
            "--vaddr" => {
                need("ipvs")?;
                let cidr = parse_cidr(value()?, family)?;
                matches.push(Match::IpvsVaddr { cidr, neg: negated });
            }
            "--vproto" => {
                need("ipvs")?;
                let v = value()?;
                let protocol = match v.to_ascii_lowercase().as_str() {
                    "tcp" | "6" => Protocol::Tcp,
                    "udp" | "17" => Protocol::Udp,
                    "sctp" | "132" => Protocol::Sctp,
                    _ => return Err(Unsupported(format!("--vproto {v} is not supported"))),
                };
                matches.push(Match::IpvsVproto { protocol, neg: negated });
            }
            "--vport" => {
                need("ipvs")?;
                let port = parse_port(value()?)?;
                matches.push(Match::IpvsVport { port, neg: negated });
            }
            "--to-destination" => {
                no_neg(negated)?;
                need_target(TargetKind::Dnat, "DNAT")?;
                to_destination = Some(parse_to_destination(value()?, family)?);
            }
            "--random" | "--persistent" => {
                no_neg(negated)?;
                match &target {
                    Some((_, TargetKind::Dnat)) => {}
                    Some((_, TargetKind::Masquerade)) if opt == "--random" => {}
                    _ => {
                        return Err(Unsupported(format!("{opt} is only valid with -j DNAT or MASQUERADE")));
                    }
                }
            }
            "--random-fully" => {
                no_neg(negated)?;
                need_target(TargetKind::Masquerade, "MASQUERADE")?;
            }
            "--reject-with" => {
                no_neg(negated)?;
                need_target(TargetKind::Reject, "REJECT")?;
                value()?;
            }
            "--set-xmark" | "--set-mark" | "--or-mark" | "--xor-mark" | "--and-mark" => {
                no_neg(negated)?;
                need_target(TargetKind::Mark, "MARK")?;
                if mark_op.is_some() {
                    return Err(Malformed("more than one MARK operation".to_string()));
                }
                let v = value()?;
                // All forms reduce to the kernel's (value, mask): mark = (mark & !mask) ^ value.
                mark_op = Some(match opt {
                    "--set-xmark" => parse_mark(v)?,
                    "--set-mark" => {
                        let (value, mask) = parse_mark(v)?;
                        (value, value | mask)
                    }
                    _ => {
                        let n = parse_u32(v).ok_or_else(|| Malformed(format!("bad mark {v}")))?;
                        match opt {
                            "--or-mark" => (n, n),
                            "--xor-mark" => (n, 0),
                            _ => (0, !n),
                        }
                    }
                });
            }
            _ => return Err(Unsupported(format!("unknown option {opt}"))),
        }
    }
    if neg {
        return Err(Malformed("dangling `!`".to_string()));
    }

    if loaded.contains(&"statistic") {
        match (stat_mode.as_deref(), stat_prob) {
            (Some("random"), Some((probability, text))) => matches.push(Match::Statistic { probability, text }),
            (Some("random"), None) => {
                return Err(Malformed("statistic random mode needs --probability".to_string()));
            }
            (Some(m), _) => {
                return Err(Unsupported(format!("statistic mode {m} is not supported")));
            }
            (None, _) => {
                return Err(Unsupported("statistic match without --mode random".to_string()));
            }
        }
    }
    if let Some(spec) = recent {
        let name = spec.name.unwrap_or_else(|| "DEFAULT".to_string());
        match (spec.rcheck, spec.set) {
            (true, false) => {
                if spec.reap && !spec.seconds {
                    return Err(Malformed("recent --reap needs --seconds".to_string()));
                }
                matches.push(Match::RecentCheck { name });
            }
            (false, true) if !spec.seconds && !spec.reap => matches.push(Match::RecentSet { name }),
            (false, true) => {
                return Err(Malformed("recent --seconds/--reap only go with --rcheck".to_string()));
            }
            _ => {
                return Err(Unsupported(
                    "recent match needs exactly one of --rcheck or --set".to_string(),
                ));
            }
        }
    }

    let target = match target {
        None => TargetSpec::Resolved(Target::None),
        Some((_, TargetKind::Dnat)) => {
            let (addr, port) = to_destination.ok_or_else(|| Malformed("DNAT needs --to-destination".to_string()))?;
            TargetSpec::Resolved(Target::Dnat { addr, port })
        }
        Some((_, TargetKind::Mark)) => {
            let (value, mask) = mark_op.ok_or_else(|| Malformed("MARK needs a mark operation".to_string()))?;
            TargetSpec::Resolved(Target::Mark { value, mask })
        }
        Some((spec, _)) => spec,
    };
    Ok(ParsedRule {
        comment,
        matches,
        target,
    })
}

fn parse_cidr(s: &str, family: IpFamily) -> Result<Cidr, RuleErr> {
    let bad = |why: &str| RuleErr::Malformed(format!("bad address {s}: {why}"));
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let ip: IpAddr = addr
        .parse()
        .map_err(|_| bad("not an IP address (host names are not supported)"))?;
    if !family.contains(&ip) {
        return Err(bad(&format!("not an {family} address")));
    }
    let (v6, bits) = ip_bits(&ip);
    let width: u32 = if v6 { 128 } else { 32 };
    let prefix = match len {
        None => width,
        Some(l) => match l.parse::<u32>() {
            Ok(p) if p <= width => p,
            Ok(_) => return Err(bad("prefix length too long")),
            Err(_) => {
                // A dotted mask (`/255.0.0.0`), which iptables accepts when contiguous.
                let m: IpAddr = l.parse().map_err(|_| bad("bad prefix length"))?;
                let (mv6, mbits) = ip_bits(&m);
                let ones = if mv6 {
                    mbits.leading_ones()
                } else {
                    (mbits as u32).leading_ones()
                };
                let full = if mv6 {
                    mbits.count_ones()
                } else {
                    (mbits as u32).count_ones()
                };
                if mv6 != v6 || ones != full {
                    return Err(bad("mask is not contiguous"));
                }
                ones
            }
        },
    };
    let all: u128 = if v6 { u128::MAX } else { u128::from(u32::MAX) };
    let mask = if prefix == 0 {
        0
    } else {
        (all << (width - prefix)) & all
    };
    Ok(Cidr {
        v6,
        net: bits & mask,
        mask,
    })
}

fn parse_port(s: &str) -> Result<u16, RuleErr> {
    s.parse().map_err(|_| RuleErr::Malformed(format!("bad port {s}")))
}

fn parse_port_range(s: &str) -> Result<(u16, u16), RuleErr> {
    let (lo, hi) = match s.split_once(':') {
        Some((lo, hi)) => (
            if lo.is_empty() { 0 } else { parse_port(lo)? },
            if hi.is_empty() { u16::MAX } else { parse_port(hi)? },
        ),
        None => {
            let p = parse_port(s)?;
            (p, p)
        }
    };
    if lo > hi {
        return Err(RuleErr::Malformed(format!("bad port range {s}")));
    }
    Ok((lo, hi))
}

/// Parses a number like strtoul(…, 0): `0x` hex, leading `0` octal, else decimal.
fn parse_u32(s: &str) -> Option<u32> {
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16).ok()
    } else if s.len() > 1 && s.starts_with('0') {
        u32::from_str_radix(&s[1..], 8).ok()
    } else if s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse().ok()
    } else {
        None
    }
}

/// `V` or `V/M` (mask defaults to all ones).
fn parse_mark(s: &str) -> Result<(u32, u32), RuleErr> {
    let bad = || RuleErr::Malformed(format!("bad mark {s}"));
    match s.split_once('/') {
        Some((v, m)) => Ok((parse_u32(v).ok_or_else(bad)?, parse_u32(m).ok_or_else(bad)?)),
        None => Ok((parse_u32(s).ok_or_else(bad)?, u32::MAX)),
    }
}

fn parse_ctstates(s: &str) -> Result<u8, RuleErr> {
    let mut bits = 0;
    for state in s.split(',') {
        bits |= match state {
            "NEW" => CT_NEW,
            "ESTABLISHED" => CT_ESTABLISHED,
            "RELATED" => CT_RELATED,
            "INVALID" => CT_INVALID,
            "UNTRACKED" => CT_UNTRACKED,
            "SNAT" => CT_SNAT,
            "DNAT" => CT_DNAT,
            _ => return Err(RuleErr::Malformed(format!("bad conntrack state {state}"))),
        };
    }
    Ok(bits)
}

/// `ip[:port]` for IPv4, `[ip][:port]` or a bare address for IPv6.
fn parse_to_destination(s: &str, family: IpFamily) -> Result<(IpAddr, Option<u16>), RuleErr> {
    let bad = || RuleErr::Malformed(format!("bad --to-destination {s}"));
    if s.contains('-') {
        return Err(RuleErr::Unsupported(format!(
            "address or port ranges in --to-destination {s}"
        )));
    }
    let (addr, port): (IpAddr, Option<&str>) = match family {
        IpFamily::V4 => {
            let (a, p) = match s.split_once(':') {
                Some((a, p)) => (a, Some(p)),
                None => (s, None),
            };
            (IpAddr::V4(a.parse::<Ipv4Addr>().map_err(|_| bad())?), p)
        }
        IpFamily::V6 => match s.strip_prefix('[') {
            Some(rest) => {
                let (a, tail) = rest.split_once(']').ok_or_else(bad)?;
                let p = if tail.is_empty() {
                    None
                } else {
                    Some(tail.strip_prefix(':').ok_or_else(bad)?)
                };
                (IpAddr::V6(a.parse::<Ipv6Addr>().map_err(|_| bad())?), p)
            }
            None => (IpAddr::V6(s.parse::<Ipv6Addr>().map_err(|_| bad())?), None),
        },
    };
    let port = port.map(parse_port).transpose()?;
    Ok((addr, port))
}

// ---------------------------------------------------------------------------------------------
// Walking the packet

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RuleRef {
    table: usize,
    chain: usize,
    rule: usize,
}

/// One entry of a path's report.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Step {
    /// A matched iptables rule.
    Rule(RuleRef),
    /// A step outside the iptables tables (IPVS), as the report prints it.
    Other {
        table: &'static str,
        chain: &'static str,
        text: String,
    },
}

/// The virtual service of the IPVS connection a packet belongs to (what `-m ipvs` checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VirtualService {
    pub(crate) protocol: Protocol,
    pub(crate) addr: IpAddr,
    pub(crate) port: u16,
}

/// The packet and its history on one path.
#[derive(Clone, Debug)]
pub(crate) struct PathState {
    pub(crate) src: IpAddr,
    pub(crate) dst: IpAddr,
    pub(crate) dport: u16,
    pub(crate) protocol: Protocol,
    in_interface: Option<String>,
    mark: u32,
    pub(crate) dnat: Option<SocketAddr>,
    masquerade: bool,
    /// A rule of ours said `-j ACCEPT`.
    pub(crate) accepted: bool,
    /// Session-affinity decisions already taken on this path (name -> hit).
    recent: BTreeMap<String, bool>,
    /// Whether the packet was bridged, once a physdev match asked.
    bridged: Option<bool>,
    /// Set once IPVS has scheduled the packet.
    pub(crate) ipvs: Option<VirtualService>,
    pub(crate) rules: Vec<Step>,
    pub(crate) choices: Vec<String>,
    pub(crate) hooks: Vec<&'static str>,
    pub(crate) verdict: Verdict,
}

impl PathState {
    /// The packet before the first hook: a packet from the node has no input interface.
    pub(crate) fn start(packet: &Packet, from_node: bool) -> PathState {
        PathState {
            src: packet.src,
            dst: packet.dst,
            dport: packet.dport,
            protocol: packet.protocol,
            in_interface: if from_node { None } else { packet.in_interface.clone() },
            mark: 0,
            dnat: None,
            masquerade: false,
            accepted: false,
            recent: BTreeMap::new(),
            bridged: None,
            ipvs: None,
            rules: Vec::new(),
            choices: Vec::new(),
            hooks: Vec::new(),
            verdict: Verdict::Pass,
        }
    }

    /// Local traffic to a local address comes back in through `lo`.
    pub(crate) fn loop_back(&mut self) {
        self.in_interface = Some("lo".to_string());
    }
}

/// A path after one hook.
pub(crate) enum AfterHook {
    /// Dropped or rejected there; its verdict is set.
    Stopped(PathState),
    /// Goes on to the next hook.
    GoesOn(PathState),
}

/// How a chain traversal ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Fell off the end or hit RETURN.
    Fall,
    /// ACCEPT, DNAT or MASQUERADE: the hook is done with the packet.
    Accept,
    Drop,
    Reject,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hook {
    NatPrerouting,
    NatOutput,
    FilterInput,
    FilterForward,
    FilterOutput,
    NatPostrouting,
}

impl Hook {
    fn table(self) -> usize {
        match self {
            Hook::NatPrerouting | Hook::NatOutput | Hook::NatPostrouting => NAT,
            Hook::FilterInput | Hook::FilterForward | Hook::FilterOutput => FILTER,
        }
    }

    fn chain(self) -> &'static str {
        match self {
            Hook::NatPrerouting => "PREROUTING",
            Hook::NatOutput | Hook::FilterOutput => "OUTPUT",
            Hook::FilterInput => "INPUT",
            Hook::FilterForward => "FORWARD",
            Hook::NatPostrouting => "POSTROUTING",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Hook::NatPrerouting => "nat/PREROUTING",
            Hook::NatOutput => "nat/OUTPUT",
            Hook::FilterInput => "filter/INPUT",
            Hook::FilterForward => "filter/FORWARD",
            Hook::FilterOutput => "filter/OUTPUT",
            Hook::NatPostrouting => "nat/POSTROUTING",
        }
    }
}

enum Work {
    At(usize, PathState),
    Done(PathState, End),
}

/// Walks paths through parsed tables.
pub(crate) struct Tracer<'a> {
    tables: &'a Tables,
    sets: &'a dyn SetLookup,
    /// The node's addresses; loopback counts as local whether listed or not.
    local: &'a [IpAddr],
    /// Paths created so far (each fork adds one).
    forks: usize,
}

impl<'a> Tracer<'a> {
    pub(crate) fn new(tables: &'a Tables, sets: &'a dyn SetLookup, local: &'a [IpAddr]) -> Tracer<'a> {
        Tracer {
            tables,
            sets,
            local,
            forks: 1,
        }
    }

    pub(crate) fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(ip)
    }

    /// Counts one more path, failing past [`MAX_PATHS`].
    pub(crate) fn fork(&mut self) -> Result<(), TraceError> {
        self.forks += 1;
        if self.forks > MAX_PATHS {
            return Err(TraceError::TooManyPaths { limit: MAX_PATHS });
        }
        Ok(())
    }

    /// Runs the built-in chain of `hook` for one path; returns each resulting path, in rule
    /// order, stopped there (DROP, REJECT, a DROP policy) or going on.
    pub(crate) fn run_hook(&mut self, hook: Hook, mut st: PathState) -> Result<Vec<AfterHook>, TraceError> {
        let tables = self.tables;
        let table = hook.table();
        st.hooks.push(hook.label());
        let chain = tables[table].index[hook.chain()];
        let policy_drop = tables[table].chains[chain].policy_drop;
        let mut out = Vec::new();
        for (mut s, end) in self.run_chain(table, chain, st, &mut Vec::new())? {
            let end = if end == End::Fall && policy_drop {
                End::Drop
            } else {
                end
            };
            out.push(match end {
                End::Drop => {
                    s.verdict = Verdict::Drop;
                    AfterHook::Stopped(s)
                }
                End::Reject => {
                    s.verdict = Verdict::Reject;
                    AfterHook::Stopped(s)
                }
                End::Fall | End::Accept => AfterHook::GoesOn(s),
            });
        }
        Ok(out)
    }

    /// Evaluates `hook` and every later hook for one path in iptables mode's hook order,
    /// pushing finished paths to `out`.
    fn walk(&mut self, hook: Hook, st: PathState, local_src: bool, out: &mut Vec<PathState>) -> Result<(), TraceError> {
        for after in self.run_hook(hook, st)? {
            let mut s = match after {
                AfterHook::Stopped(s) => {
                    out.push(s);
                    continue;
                }
                AfterHook::GoesOn(s) => s,
            };
            match self.next_hook(hook, &s, local_src) {
                Some(next) => {
                    if next == Hook::FilterInput && local_src {
                        s.loop_back();
                    }
                    self.walk(next, s, local_src, out)?;
                }
                None => {
                    s.verdict = Verdict::after_all_hooks(s.dnat.is_some(), s.accepted);
                    out.push(s);
                }
            }
        }
        Ok(())
    }

    /// The kernel's hook order; routing decides on the (possibly DNATed) destination.
    fn next_hook(&self, hook: Hook, st: &PathState, local_src: bool) -> Option<Hook> {
        match hook {
            Hook::NatOutput => Some(Hook::FilterOutput),
            Hook::FilterOutput => Some(Hook::NatPostrouting),
            Hook::NatPostrouting if local_src && self.is_local(&st.dst) => Some(Hook::FilterInput),
            Hook::NatPostrouting | Hook::FilterInput => None,
            Hook::NatPrerouting if self.is_local(&st.dst) => Some(Hook::FilterInput),
            Hook::NatPrerouting => Some(Hook::FilterForward),
            Hook::FilterForward => Some(Hook::NatPostrouting),
        }
    }

    fn run_chain(
        &mut self,
        table: usize,
        chain: usize,
        st: PathState,
        stack: &mut Vec<usize>,
    ) -> Result<Vec<(PathState, End)>, TraceError> {
        if stack.contains(&chain) || stack.len() >= MAX_DEPTH {
            let chains = &self.tables[table].chains;
            let names: Vec<&str> = stack.iter().chain([&chain]).map(|&c| chains[c].name.as_str()).collect();
            return Err(TraceError::Loop {
                table: TABLE_NAMES[table].to_string(),
                stack: names.join(" -> "),
            });
        }
        stack.push(chain);
        let result = self.run_chain_inner(table, chain, st, stack);
        stack.pop();
        result
    }

    fn run_chain_inner(
        &mut self,
        table: usize,
        chain: usize,
        st: PathState,
        stack: &mut Vec<usize>,
    ) -> Result<Vec<(PathState, End)>, TraceError> {
        let tables = self.tables;
        let rules = &tables[table].chains[chain].rules;
        let mut out = Vec::new();
        // A stack of work items, pushed in reverse so paths come out depth-first in rule order.
        let mut work = vec![Work::At(0, st)];
        while let Some(item) = work.pop() {
            let (i, st) = match item {
                Work::Done(s, end) => {
                    out.push((s, end));
                    continue;
                }
                Work::At(i, s) => (i, s),
            };
            let Some(rule) = rules.get(i) else {
                out.push((st, End::Fall));
                continue;
            };
            let mut next = Vec::new();
            for (mut s, matched) in self.eval_matches(table, chain, rule, st)? {
                if !matched {
                    next.push(Work::At(i + 1, s));
                    continue;
                }
                s.rules.push(Step::Rule(RuleRef { table, chain, rule: i }));
                for m in &rule.matches {
                    if let Match::RecentSet { name } = m {
                        s.recent.insert(name.clone(), true);
                    }
                }
                match &rule.target {
                    Target::None => next.push(Work::At(i + 1, s)),
                    Target::Return => next.push(Work::Done(s, End::Fall)),
                    Target::Accept => {
                        s.accepted = true;
                        next.push(Work::Done(s, End::Accept));
                    }
                    Target::Drop => next.push(Work::Done(s, End::Drop)),
                    Target::Reject => next.push(Work::Done(s, End::Reject)),
                    Target::Dnat { addr, port } => {
                        s.dst = *addr;
                        s.dport = port.unwrap_or(s.dport);
                        s.dnat = Some(SocketAddr::new(s.dst, s.dport));
                        next.push(Work::Done(s, End::Accept));
                    }
                    Target::Masquerade => {
                        s.masquerade = true;
                        next.push(Work::Done(s, End::Accept));
                    }
                    Target::Mark { value, mask } => {
                        s.mark = (s.mark & !mask) ^ value;
                        next.push(Work::At(i + 1, s));
                    }
                    Target::Jump(sub) => {
                        for (s2, end) in self.run_chain(table, *sub, s, stack)? {
                            next.push(match end {
                                End::Fall => Work::At(i + 1, s2),
                                _ => Work::Done(s2, end),
                            });
                        }
                    }
                    // Falling off a goto'd chain returns from this chain.
                    Target::Goto(sub) => {
                        for (s2, end) in self.run_chain(table, *sub, s, stack)? {
                            next.push(Work::Done(s2, end));
                        }
                    }
                }
            }
            work.extend(next.into_iter().rev());
        }
        Ok(out)
    }

    /// Evaluates a rule's matches; returns one entry per resulting path (matched first).
    fn eval_matches(
        &mut self,
        table: usize,
        chain: usize,
        rule: &Rule,
        st: PathState,
    ) -> Result<Vec<(PathState, bool)>, TraceError> {
        // Deterministic matches first, so a rule that cannot match does not fork.
        for m in &rule.matches {
            if self.static_match(m, &st) == Some(false) {
                return Ok(vec![(st, false)]);
            }
        }
        let mut branches = vec![(st, true)];
        for m in &rule.matches {
            let mut forked = Vec::new();
            for (s, ok) in branches {
                if !ok {
                    forked.push((s, false));
                    continue;
                }
                match m {
                    Match::Statistic { probability, text } if *probability > 0.0 && *probability < 1.0 => {
                        self.fork()?;
                        let place = self.place(table, chain, rule);
                        let mut hit = s.clone();
                        hit.choices
                            .push(format!("statistic probability {text} matched: {place}"));
                        let mut miss = s;
                        miss.choices
                            .push(format!("statistic probability {text} not matched: {place}"));
                        forked.push((hit, true));
                        forked.push((miss, false));
                    }
                    Match::Statistic { probability, .. } => forked.push((s, *probability >= 1.0)),
                    Match::PhysdevIsIn { neg } => match (s.bridged, s.in_interface.clone()) {
                        (Some(bridged), _) => forked.push((s, bridged != *neg)),
                        // Without an input interface (from the node) nothing was bridged.
                        (None, None) => forked.push((s, *neg)),
                        (None, Some(iface)) => {
                            self.fork()?;
                            let place = self.place(table, chain, rule);
                            let mut bridged = s.clone();
                            bridged.bridged = Some(true);
                            bridged
                                .choices
                                .push(format!("physdev: bridged into {iface} (br_netfilter): {place}"));
                            let mut routed = s;
                            routed.bridged = Some(false);
                            routed
                                .choices
                                .push(format!("physdev: {iface} is not a bridge: {place}"));
                            // The path on which the rule matches first.
                            let (first, second) = if *neg { (routed, bridged) } else { (bridged, routed) };
                            forked.push((first, true));
                            forked.push((second, false));
                        }
                    },
                    Match::RecentCheck { name } => match s.recent.get(name) {
                        Some(&hit) => forked.push((s, hit)),
                        None => {
                            self.fork()?;
                            let place = self.place(table, chain, rule);
                            let mut hit = s.clone();
                            hit.recent.insert(name.clone(), true);
                            hit.choices
                                .push(format!("recent {name} rcheck hit (session affinity): {place}"));
                            let mut miss = s;
                            miss.recent.insert(name.clone(), false);
                            miss.choices.push(format!("recent {name} rcheck miss: {place}"));
                            forked.push((hit, true));
                            forked.push((miss, false));
                        }
                    },
                    _ => forked.push((s, true)),
                }
            }
            branches = forked;
        }
        Ok(branches)
    }

    fn place(&self, table: usize, chain: usize, rule: &Rule) -> String {
        let name = &self.tables[table].chains[chain].name;
        let mut place = if rule.line == 0 {
            format!("{}/{name} jump rule", TABLE_NAMES[table])
        } else {
            format!("{}/{name} line {}", TABLE_NAMES[table], rule.line)
        };
        if let Some(c) = &rule.comment {
            let _ = write!(place, " ({c})");
        }
        place
    }

    /// The result of a match that does not fork, or `None` for forking ones.
    fn static_match(&self, m: &Match, st: &PathState) -> Option<bool> {
        Some(match m {
            Match::Protocol { protocol, neg } => protocol.is_none_or(|p| p == st.protocol) != *neg,
            Match::Source { cidr, neg } => cidr.contains(&st.src) != *neg,
            Match::Destination { cidr, neg } => cidr.contains(&st.dst) != *neg,
            Match::InInterface { name, neg } => {
                let hit = st
                    .in_interface
                    .as_deref()
                    .is_some_and(|iface| match name.strip_suffix('+') {
                        Some(prefix) => iface.starts_with(prefix),
                        None => iface == name,
                    });
                hit != *neg
            }
            Match::Dport { protocol, lo, hi, neg } => {
                st.protocol == *protocol && ((*lo..=*hi).contains(&st.dport) != *neg)
            }
            Match::AddrTypeLocal { dst, neg } => self.is_local(if *dst { &st.dst } else { &st.src }) != *neg,
            Match::Mark { value, mask, neg } => (st.mark & mask == *value) != *neg,
            Match::CtState { states, neg } => {
                // Always a new connection; connections DNATed by iptables also carry the DNAT
                // state. IPVS rewrites only the reply tuple of its connections, so they don't.
                let dnat = st.dnat.is_some() && st.ipvs.is_none();
                let current = CT_NEW | if dnat { CT_DNAT } else { 0 };
                (states & current != 0) != *neg
            }
            Match::RecentSet { .. } => true,
            Match::Set { name, src, neg } => self.set_match(name, src, st) != *neg,
            Match::PhysdevIsIn { neg } => match (st.bridged, &st.in_interface) {
                (Some(bridged), _) => bridged != *neg,
                (None, None) => *neg,
                (None, Some(_)) => return None,
            },
            Match::IpvsVaddr { cidr, neg } => st.ipvs.is_some_and(|v| cidr.contains(&v.addr) != *neg),
            Match::IpvsVproto { protocol, neg } => st.ipvs.is_some_and(|v| (v.protocol == *protocol) != *neg),
            Match::IpvsVport { port, neg } => st.ipvs.is_some_and(|v| (v.port == *port) != *neg),
            Match::Statistic { .. } | Match::RecentCheck { .. } => return None,
        })
    }

    /// `-m set --match-set NAME FLAGS`: the key takes, for each dimension of the set, the
    /// packet's source or destination address or destination port, as its flag says.
    fn set_match(&self, name: &str, src: &[bool], st: &PathState) -> bool {
        // The set exists: `load` checked it.
        let Some(dims) = self.sets.dimensions(name) else {
            return false;
        };
        // The kernel's set match needs a flag per dimension; with fewer it never matches.
        if src.len() < dims.len() {
            return false;
        }
        let key: Vec<SetValue> = dims
            .iter()
            .zip(src)
            .map(|(dim, &from_src)| match dim {
                SetDim::Addr => SetValue::Addr(if from_src { st.src } else { st.dst }),
                // Source ports were refused when loading.
                SetDim::Port => SetValue::Port(st.protocol, st.dport),
            })
            .collect();
        self.sets.contains(name, &key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE_IP: &str = "192.168.0.2";

    const RESTORE_V4: &str = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-SERVICES -m comment --comment "ns1/svc2:p80 has no endpoints" -m tcp -p tcp -d 172.30.0.42 --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc2:p80 has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3002 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc3:p80 has no local endpoints" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j DROP
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc3:p80 has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3003 -j DROP
-A KUBE-NODEPORTS -m comment --comment "ns2/svc3:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
-A KUBE-PROXY-FIREWALL -m comment --comment "ns5/svc5:p80 traffic not accepted by KUBE-FW-NUKIZ6OKUXPJNT4C" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-EXT-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SEP-CCCCCCCCCCCCCCCC - [0:0]
:KUBE-SVC-AFFINITYAFFINITY - [0:0]
:KUBE-SEP-DDDDDDDDDDDDDDDD - [0:0]
:KUBE-SEP-EEEEEEEEEEEEEEEE - [0:0]
:KUBE-FW-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-EXT-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-SVC-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-SEP-FFFFFFFFFFFFFFFF - [0:0]
:KUBE-SEP-OLDOLDOLDOLDOLDO - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 external IP" -m tcp -p tcp -d 192.168.99.11 --dport 80 -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 -j KUBE-SVC-AFFINITYAFFINITY
-A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 loadbalancer IP" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j KUBE-FW-NUKIZ6OKUXPJNT4C
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp -d 127.0.0.0/8 --dport 3001 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-SXIVWICOYRO3J4NJ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.2:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.3:80" -j KUBE-SEP-CCCCCCCCCCCCCCCC
-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
-A KUBE-SEP-BBBBBBBBBBBBBBBB -m comment --comment ns1/svc1:p80 -s 10.180.0.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-BBBBBBBBBBBBBBBB -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.2:80
-A KUBE-SEP-CCCCCCCCCCCCCCCC -m comment --comment ns1/svc1:p80 -s 10.180.0.3 -j KUBE-MARK-MASQ
-A KUBE-SEP-CCCCCCCCCCCCCCCC -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80
-A KUBE-EXT-XPGD46QRK7WJZT7O -m comment --comment "masquerade traffic for ns1/svc1:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-XPGD46QRK7WJZT7O -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.7:80" -m recent --name KUBE-SEP-DDDDDDDDDDDDDDDD --rcheck --seconds 10800 --reap -j KUBE-SEP-DDDDDDDDDDDDDDDD
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.8:80" -m recent --name KUBE-SEP-EEEEEEEEEEEEEEEE --rcheck --seconds 10800 --reap -j KUBE-SEP-EEEEEEEEEEEEEEEE
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.7:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-DDDDDDDDDDDDDDDD
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.8:80" -j KUBE-SEP-EEEEEEEEEEEEEEEE
-A KUBE-SEP-DDDDDDDDDDDDDDDD -m comment --comment ns4/svc4:p80 -s 10.180.0.7 -j KUBE-MARK-MASQ
-A KUBE-SEP-DDDDDDDDDDDDDDDD -m comment --comment ns4/svc4:p80 -m recent --name KUBE-SEP-DDDDDDDDDDDDDDDD --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.7:80
-A KUBE-SEP-EEEEEEEEEEEEEEEE -m comment --comment ns4/svc4:p80 -s 10.180.0.8 -j KUBE-MARK-MASQ
-A KUBE-SEP-EEEEEEEEEEEEEEEE -m comment --comment ns4/svc4:p80 -m recent --name KUBE-SEP-EEEEEEEEEEEEEEEE --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.8:80
-A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 loadbalancer IP" -s 203.0.113.0/25 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
-A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "other traffic to ns5/svc5:p80 will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-EXT-NUKIZ6OKUXPJNT4C -m comment --comment "masquerade traffic for ns5/svc5:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-NUKIZ6OKUXPJNT4C -j KUBE-SVC-NUKIZ6OKUXPJNT4C
-A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 10.180.0.5:80" -j KUBE-SEP-FFFFFFFFFFFFFFFF
-A KUBE-SEP-FFFFFFFFFFFFFFFF -m comment --comment ns5/svc5:p80 -s 10.180.0.5 -j KUBE-MARK-MASQ
-A KUBE-SEP-FFFFFFFFFFFFFFFF -m comment --comment ns5/svc5:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.5:80
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-X KUBE-SEP-OLDOLDOLDOLDOLDO
COMMIT
"#;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    fn jump(table: &'static str, chain: &'static str, a: &[&str]) -> JumpRule {
        JumpRule {
            table,
            chain,
            args: args(a),
        }
    }

    /// The jump rules upstream kube-proxy keeps in the built-in chains.
    fn upstream_jumps() -> Vec<JumpRule> {
        let new = ["-m", "conntrack", "--ctstate", "NEW"];
        let with_new = |comment: &str, target: &str| -> Vec<String> {
            let mut v = args(&new);
            v.extend(args(&["-m", "comment", "--comment", comment, "-j", target]));
            v
        };
        let mk = |table: &'static str, chain: &'static str, args: Vec<String>| JumpRule { table, chain, args };
        vec![
            mk(
                "filter",
                "INPUT",
                with_new("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
            ),
            jump(
                "filter",
                "INPUT",
                &[
                    "-m", "comment", "--comment", "kubernetes health check service ports", "-j", "KUBE-NODEPORTS",
                ],
            ),
            mk(
                "filter",
                "INPUT",
                with_new(
                    "kubernetes externally-visible service portals",
                    "KUBE-EXTERNAL-SERVICES",
                ),
            ),
            jump("filter", "INPUT", &["-j", "KUBE-FIREWALL"]),
            mk(
                "filter",
                "FORWARD",
                with_new("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
            ),
            jump(
                "filter",
                "FORWARD",
                &[
                    "-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD",
                ],
            ),
            mk(
                "filter",
                "FORWARD",
                with_new("kubernetes service portals", "KUBE-SERVICES"),
            ),
            mk(
                "filter",
                "FORWARD",
                with_new(
                    "kubernetes externally-visible service portals",
                    "KUBE-EXTERNAL-SERVICES",
                ),
            ),
            mk(
                "filter",
                "OUTPUT",
                with_new("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
            ),
            mk(
                "filter",
                "OUTPUT",
                with_new("kubernetes service portals", "KUBE-SERVICES"),
            ),
            jump("filter", "OUTPUT", &["-j", "KUBE-FIREWALL"]),
            jump(
                "nat",
                "OUTPUT",
                &[
                    "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES",
                ],
            ),
            jump(
                "nat",
                "PREROUTING",
                &[
                    "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES",
                ],
            ),
            jump(
                "nat",
                "POSTROUTING",
                &[
                    "-m", "comment", "--comment", "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING",
                ],
            ),
        ]
    }

    fn ruleset(family: IpFamily, restore: &str) -> Ruleset {
        Ruleset {
            family,
            jumps: upstream_jumps(),
            restore: restore.to_string(),
        }
    }

    fn ctx() -> TraceContext {
        TraceContext {
            local_addresses: vec![NODE_IP.parse().unwrap()],
        }
    }

    fn pkt(src: &str, dst: &str, dport: u16, iface: Option<&str>) -> Packet {
        Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            dport,
            protocol: Protocol::Tcp,
            in_interface: iface.map(str::to_string),
        }
    }

    fn run(p: &Packet) -> Trace {
        trace(&ruleset(IpFamily::V4, RESTORE_V4), &ctx(), p).unwrap()
    }

    fn path_rules(t: &Trace, path: usize) -> Vec<String> {
        t.rules
            .iter()
            .filter(|r| r.path == path)
            .map(|r| format!("{}/{}: {}", r.table, r.chain, r.rule))
            .collect()
    }

    fn strs(v: &[&str]) -> Vec<String> {
        args(v)
    }

    #[test]
    fn cluster_ip_from_pod_dnats_to_every_endpoint_without_masquerade() {
        let t = run(&pkt("10.1.2.3", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["10.180.0.1:80", "10.180.0.2:80", "10.180.0.3:80"]));
        assert!(!t.masquerade);
        for p in &t.paths {
            assert_eq!(p.hooks, strs(&["nat/PREROUTING", "filter/FORWARD", "nat/POSTROUTING"]));
            assert!(!p.masquerade);
        }
        // The first rule is the PREROUTING jump, rendered with its comment quoted.
        assert_eq!(
            t.rules[0].rule,
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        );
        assert_eq!(
            (t.rules[0].table.as_str(), t.rules[0].chain.as_str()),
            ("nat", "PREROUTING")
        );
    }

    #[test]
    fn cluster_ip_from_outside_pod_cidr_masquerades() {
        let t = run(&pkt("192.168.5.5", "172.30.0.41", 80, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(t.masquerade);
        assert!(t.paths.iter().all(|p| p.masquerade && p.verdict == Verdict::Dnat));
        // The masquerade mark makes KUBE-FORWARD accept, but the verdict stays DNAT.
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("kubernetes forwarding rules"))
        );
        assert!(path_rules(&t, 0).last().unwrap().contains("MASQUERADE --random-fully"));
    }

    #[test]
    fn probability_rules_fan_out_one_path_per_endpoint() {
        let t = run(&pkt("10.1.2.3", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.paths.len(), 3);
        let eps: Vec<_> = t.paths.iter().map(|p| p.endpoint.clone().unwrap()).collect();
        assert_eq!(eps, strs(&["10.180.0.1:80", "10.180.0.2:80", "10.180.0.3:80"]));
        assert_eq!(t.paths[0].choices.len(), 1);
        assert!(t.paths[0].choices[0].starts_with("statistic probability 0.3333333333 matched"));
        assert!(t.paths[1].choices[0].starts_with("statistic probability 0.3333333333 not matched"));
        assert!(t.paths[1].choices[1].starts_with("statistic probability 0.5000000000 matched"));
        assert!(t.paths[2].choices[1].starts_with("statistic probability 0.5000000000 not matched"));
        // Rules are grouped per path: path 1's rules do not include path 0's statistic rule.
        assert!(!path_rules(&t, 1).iter().any(|r| r.contains("0.3333333333")));
        assert!(path_rules(&t, 1).iter().any(|r| r.contains("0.5000000000")));
    }

    #[test]
    fn service_without_endpoints_is_rejected_in_filter_forward_without_dnat() {
        let t = run(&pkt("10.1.2.3", "172.30.0.42", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Reject);
        assert_eq!(t.paths.len(), 1);
        assert_eq!(t.paths[0].endpoint, None);
        assert!(t.endpoints.is_empty());
        assert_eq!(t.paths[0].hooks, strs(&["nat/PREROUTING", "filter/FORWARD"]));
        let last = t.rules.last().unwrap();
        assert_eq!((last.table.as_str(), last.chain.as_str()), ("filter", "KUBE-SERVICES"));
        assert!(last.rule.ends_with("-j REJECT"));
        // UDP to the same port is not the TCP service.
        let mut udp = pkt("10.1.2.3", "172.30.0.42", 80, Some("cni0"));
        udp.protocol = Protocol::Udp;
        assert_eq!(run(&udp).verdict, Verdict::Pass);
    }

    #[test]
    fn node_port_from_outside_goes_through_ext_chain_and_masquerades() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 3001, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(t.masquerade);
        assert_eq!(t.endpoints.len(), 3);
        let rules = path_rules(&t, 0);
        let pos = |needle: &str| rules.iter().position(|r| r.contains(needle)).unwrap();
        assert!(pos("nat/KUBE-SERVICES: ") < pos("nat/KUBE-NODEPORTS: "));
        assert!(pos("nat/KUBE-NODEPORTS: ") < pos("masquerade traffic for ns1/svc1:p80"));
        assert!(pos("masquerade traffic for ns1/svc1:p80") < pos("DNAT --to-destination 10.180.0.1:80"));
        // The DNATed packet is no longer for the node: it is forwarded, not input.
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/PREROUTING", "filter/FORWARD", "nat/POSTROUTING"])
        );
        // The same port on an address that is not the node's is not a node port.
        assert_eq!(
            run(&pkt("198.51.100.9", "192.168.0.99", 3001, Some("eth0"))).verdict,
            Verdict::Pass
        );
    }

    #[test]
    fn localhost_node_port_goes_through_the_nfacct_rule() {
        let t = run(&pkt("198.51.100.9", "127.0.0.1", 3001, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("--nfacct-name localhost_nps_accepted_pkts"))
        );
    }

    #[test]
    fn external_traffic_policy_local_without_local_endpoints_is_dropped_only_for_local_destinations() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 3003, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Drop);
        assert_eq!(t.paths[0].hooks, strs(&["nat/PREROUTING", "filter/INPUT"]));
        let last = t.rules.last().unwrap();
        assert_eq!(last.chain, "KUBE-EXTERNAL-SERVICES");
        assert!(last.rule.contains("--dst-type LOCAL"));
        // Not a local destination: the addrtype match fails and the packet passes.
        assert_eq!(
            run(&pkt("198.51.100.9", "192.168.0.99", 3003, Some("eth0"))).verdict,
            Verdict::Pass
        );
        // The external IP rule drops regardless of addrtype.
        assert_eq!(
            run(&pkt("198.51.100.9", "192.168.99.22", 80, Some("eth0"))).verdict,
            Verdict::Drop
        );
    }

    #[test]
    fn health_check_node_port_is_accepted() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 30000, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Accept);
        assert!(t.rules.last().unwrap().rule.contains("health check node port"));
    }

    #[test]
    fn load_balancer_source_ranges_allow_or_drop() {
        let allowed = run(&pkt("203.0.113.5", "5.6.7.8", 80, Some("eth0")));
        assert_eq!(allowed.verdict, Verdict::Dnat);
        assert_eq!(allowed.endpoints, strs(&["10.180.0.5:80"]));
        assert!(allowed.masquerade);

        let denied = run(&pkt("198.51.100.7", "5.6.7.8", 80, Some("eth0")));
        assert_eq!(denied.verdict, Verdict::Drop);
        assert_eq!(denied.paths[0].endpoint, None);
        assert_eq!(denied.paths[0].hooks, strs(&["nat/PREROUTING", "filter/FORWARD"]));
        let rules = path_rules(&denied, 0);
        // The comment-only rule matched and did nothing; the filter firewall dropped.
        assert!(
            rules
                .iter()
                .any(|r| r.contains("will be dropped by KUBE-PROXY-FIREWALL"))
        );
        assert!(rules.last().unwrap().starts_with("filter/KUBE-PROXY-FIREWALL: "));
    }

    #[test]
    fn hairpin_masquerades_only_the_path_back_to_the_source_pod() {
        let t = run(&pkt("10.180.0.1", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.paths.len(), 3);
        assert!(t.paths[0].masquerade);
        assert_eq!(t.paths[0].endpoint.as_deref(), Some("10.180.0.1:80"));
        assert!(!t.paths[1].masquerade);
        assert!(!t.paths[2].masquerade);
        assert!(t.masquerade);
    }

    #[test]
    fn session_affinity_rcheck_is_followed_both_ways() {
        let t = run(&pkt("10.1.2.3", "172.30.0.44", 80, Some("cni0")));
        // Hit on endpoint 7; miss 7 + hit 8; miss both + statistic either way.
        assert_eq!(t.paths.len(), 4);
        let eps: Vec<_> = t.paths.iter().map(|p| p.endpoint.clone().unwrap()).collect();
        assert_eq!(
            eps,
            strs(&["10.180.0.7:80", "10.180.0.8:80", "10.180.0.7:80", "10.180.0.8:80"])
        );
        assert!(t.paths[0].choices[0].starts_with("recent KUBE-SEP-DDDDDDDDDDDDDDDD rcheck hit"));
        assert!(t.paths[1].choices[0].starts_with("recent KUBE-SEP-DDDDDDDDDDDDDDDD rcheck miss"));
        assert!(t.paths[1].choices[1].starts_with("recent KUBE-SEP-EEEEEEEEEEEEEEEE rcheck hit"));
        assert_eq!(t.paths[3].choices.len(), 3);
        assert_eq!(t.endpoints, strs(&["10.180.0.7:80", "10.180.0.8:80"]));
    }

    #[test]
    fn unknown_option_is_an_unsupported_rule_with_its_line() {
        let restore = "*filter\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -m tcp -p tcp --sport 80 -j DROP\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        match err {
            TraceError::UnsupportedRule { line, rule, reason } => {
                assert_eq!(line, 3);
                assert!(rule.starts_with("-A KUBE-SERVICES"));
                assert!(reason.contains("--sport"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let restore = "*nat\n:X - [0:0]\n-A X -m physdev --physdev-in eth0 -j RETURN\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert!(matches!(err, TraceError::UnsupportedRule { line: 3, .. }), "{err:?}");
    }

    #[test]
    fn malformed_lines_are_parse_errors_with_their_line() {
        let cases = [
            (
                "*nat\n:X - [0:0]\n-A X -m comment --comment \"unterminated -j RETURN\nCOMMIT\n",
                3,
            ),
            ("*nat\n:X - [0:0]\n-A X -s 10.0.0.0/33 -j RETURN\nCOMMIT\n", 3),
            ("*nat\n:X - [0:0]\n-A X -j DNAT --to-destination nowhere\nCOMMIT\n", 3),
            ("*nat\n:X - [0:0]\n-A X -j RETURN\n", 3),
            ("-A X -j RETURN\n", 1),
        ];
        for (restore, want) in cases {
            let err = trace(
                &ruleset(IpFamily::V4, restore),
                &ctx(),
                &pkt("10.1.2.3", "1.2.3.4", 80, None),
            )
            .unwrap_err();
            assert!(
                matches!(err, TraceError::Parse { line, .. } if line == want),
                "{restore}: {err:?}"
            );
        }
        let restore = "*nat\n:X - [0:0]\n-A X -j KUBE-NOPE\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert!(
            matches!(err, TraceError::UnknownChain { line: 3, ref chain, .. } if chain == "KUBE-NOPE"),
            "{err:?}"
        );
    }

    #[test]
    fn ipv6_ruleset_dnats_to_bracketed_endpoint() {
        let restore = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-V6 - [0:0]
:KUBE-SEP-V6 - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d fd00:10:96::1 --dport 80 -j KUBE-SVC-V6
-A KUBE-SVC-V6 -m tcp -p tcp -d fd00:10:96::1 --dport 80 ! -s fd00:10::/64 -j KUBE-MARK-MASQ
-A KUBE-SVC-V6 -m comment --comment "ns1/svc1:p80 -> [fd00::1]:80" -j KUBE-SEP-V6
-A KUBE-SEP-V6 -s fd00::1/128 -j KUBE-MARK-MASQ
-A KUBE-SEP-V6 -m tcp -p tcp -j DNAT --to-destination [fd00::1]:80
COMMIT
"#;
        let rs = ruleset(IpFamily::V6, restore);
        let ctx6 = TraceContext {
            local_addresses: vec!["fd00:1::2".parse().unwrap()],
        };
        let t = trace(&rs, &ctx6, &pkt("fd00:10::5", "fd00:10:96::1", 80, Some("cni0"))).unwrap();
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["[fd00::1]:80"]));
        assert!(!t.masquerade);
        let t = trace(&rs, &ctx6, &pkt("2001:db8::9", "fd00:10:96::1", 80, Some("eth0"))).unwrap();
        assert!(t.masquerade);
        // An IPv4 packet cannot be traced through an IPv6 ruleset.
        let err = trace(&rs, &ctx6, &pkt("10.1.2.3", "fd00:10:96::1", 80, None)).unwrap_err();
        assert!(matches!(err, TraceError::FamilyMismatch { .. }));
    }

    #[test]
    fn packet_matching_nothing_passes() {
        let mut p = pkt("10.1.2.3", "8.8.8.8", 53, Some("cni0"));
        p.protocol = Protocol::Udp;
        let t = run(&p);
        assert_eq!(t.verdict, Verdict::Pass);
        assert!(t.endpoints.is_empty());
        assert!(!t.masquerade);
        assert_eq!(t.paths.len(), 1);
        // Only the jump rules and the POSTROUTING return matched.
        assert!(t.rules.iter().all(|r| !r.rule.contains("DNAT")));
    }

    #[test]
    fn localnet_firewall_drops_only_when_not_dnated() {
        let restore = r#"*filter
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
*nat
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -m tcp -p tcp -d 127.0.0.1 --dport 8080 -j DNAT --to-destination 127.0.0.1:8081
COMMIT
"#;
        let rs = ruleset(IpFamily::V4, restore);
        let dnated = trace(&rs, &ctx(), &pkt("198.51.100.9", "127.0.0.1", 8080, Some("eth0"))).unwrap();
        assert_eq!(dnated.verdict, Verdict::Dnat);
        assert_eq!(dnated.paths[0].hooks, strs(&["nat/PREROUTING", "filter/INPUT"]));
        let plain = trace(&rs, &ctx(), &pkt("198.51.100.9", "127.0.0.1", 9999, Some("eth0"))).unwrap();
        assert_eq!(plain.verdict, Verdict::Drop);
        assert!(
            plain
                .rules
                .last()
                .unwrap()
                .rule
                .contains("block incoming localnet connections")
        );
    }

    #[test]
    fn locally_generated_packet_uses_output_hooks() {
        let t = run(&pkt(NODE_IP, "172.30.0.41", 80, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.rules[0].chain, "OUTPUT");
        assert_eq!(t.rules[0].table, "nat");
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/OUTPUT", "filter/OUTPUT", "nat/POSTROUTING"])
        );
        // The node is outside the pod CIDR, so the cluster IP rule marks it for masquerade.
        assert!(t.masquerade);
        // Local traffic to a local address loops back through filter INPUT.
        assert!(
            render_text(&t, &pkt(NODE_IP, "172.30.0.41", 80, Some("eth0")))
                .starts_with("packet: TCP 192.168.0.2 -> 172.30.0.41:80 from this node")
        );
        let hc = run(&pkt(NODE_IP, NODE_IP, 30000, None));
        assert_eq!(hc.verdict, Verdict::Accept);
        assert_eq!(
            hc.paths[0].hooks,
            strs(&["nat/OUTPUT", "filter/OUTPUT", "nat/POSTROUTING", "filter/INPUT"])
        );
    }

    #[test]
    fn interface_matches_use_prefix_wildcards_and_never_match_without_an_interface() {
        let restore = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -d 172.30.0.41 ! -i cni+ -j KUBE-MARK-MASQ
-A KUBE-SERVICES -d 172.30.0.41 -j DNAT --to-destination 10.180.0.1
COMMIT
"#;
        let rs = ruleset(IpFamily::V4, restore);
        let from = |src: &str, iface: Option<&str>| trace(&rs, &ctx(), &pkt(src, "172.30.0.41", 80, iface)).unwrap();
        assert!(!from("10.1.2.3", Some("cni0")).masquerade);
        assert!(from("10.1.2.3", Some("eth0")).masquerade);
        assert!(
            from(NODE_IP, Some("cni0")).masquerade,
            "local packets have no input interface"
        );
        // DNAT without a port keeps the destination port.
        assert_eq!(from("10.1.2.3", Some("cni0")).endpoints, strs(&["10.180.0.1:80"]));
    }

    #[test]
    fn endpoints_are_deduplicated_and_sorted_as_strings() {
        let restore = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-X - [0:0]
-A KUBE-SERVICES -d 172.30.0.9 -j KUBE-SVC-X
-A KUBE-SVC-X -m statistic --mode random --probability 0.5000000000 -j DNAT --to-destination 10.0.0.2:80
-A KUBE-SVC-X -m recent --name A --rcheck --seconds 60 --reap -j DNAT --to-destination 10.0.0.10:80
-A KUBE-SVC-X -j DNAT --to-destination 10.0.0.2:80
COMMIT
"#;
        let rs = ruleset(IpFamily::V4, restore);
        let t = trace(&rs, &ctx(), &pkt("10.1.2.3", "172.30.0.9", 80, Some("cni0"))).unwrap();
        assert_eq!(t.paths.len(), 3);
        assert_eq!(t.endpoints, strs(&["10.0.0.10:80", "10.0.0.2:80"]));
    }

    #[test]
    fn jump_loops_are_errors() {
        let restore =
            "*nat\n:KUBE-SERVICES - [0:0]\n:A - [0:0]\n-A KUBE-SERVICES -j A\n-A A -j KUBE-SERVICES\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert!(
            matches!(err, TraceError::Loop { ref stack, .. } if stack.ends_with("A -> KUBE-SERVICES")),
            "{err:?}"
        );
    }

    #[test]
    fn fan_out_is_bounded() {
        let mut restore = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
        for _ in 0..20 {
            restore.push_str("-A KUBE-SERVICES -m statistic --mode random --probability 0.5 -j MARK --xor-mark 0x1\n");
        }
        restore.push_str("COMMIT\n");
        let err = trace(
            &ruleset(IpFamily::V4, &restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert_eq!(err, TraceError::TooManyPaths { limit: MAX_PATHS });
    }

    #[test]
    fn jump_to_undeclared_chain_is_skipped_and_bad_jump_rules_are_errors() {
        // Neither KUBE-FIREWALL nor any filter chain exists here; the jumps to them are skipped.
        let t = trace(
            &ruleset(IpFamily::V4, "*nat\nCOMMIT\n"),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap();
        assert_eq!(t.verdict, Verdict::Pass);
        assert!(t.rules.is_empty());
        let mut rs = ruleset(IpFamily::V4, RESTORE_V4);
        rs.jumps
            .push(jump("nat", "PREROUTING", &["-m", "frobnicate", "-j", "KUBE-SERVICES"]));
        let err = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert!(matches!(err, TraceError::UnsupportedJumpRule { .. }), "{err:?}");
    }

    #[test]
    fn tokenizer_groups_quotes_like_iptables_restore() {
        assert_eq!(
            tokenize(r#"-A X -m comment --comment "a b  c" -j Y"#).unwrap(),
            strs(&["-A", "X", "-m", "comment", "--comment", "a b  c", "-j", "Y"])
        );
        assert_eq!(
            tokenize(r#"--comment "say \"hi\"" x"#).unwrap(),
            strs(&["--comment", "say \"hi\"", "x"])
        );
        assert_eq!(tokenize("a\t\tb  ").unwrap(), strs(&["a", "b"]));
        assert!(tokenize("\"open").is_err());
        assert_eq!(quote_arg("a \"b\""), r#""a \"b\"""#);
    }

    #[test]
    fn mark_and_conntrack_parsing() {
        assert_eq!(parse_u32("0x004000"), Some(0x4000));
        assert_eq!(parse_u32("16384"), Some(0x4000));
        assert_eq!(parse_u32("010"), Some(8));
        assert_eq!(parse_u32("0xzz"), None);
        assert_eq!(parse_mark("0x4000/0x4000"), Ok((0x4000, 0x4000)));
        assert_eq!(parse_mark("1"), Ok((1, u32::MAX)));
        assert_eq!(
            parse_ctstates("RELATED,ESTABLISHED,DNAT"),
            Ok(CT_RELATED | CT_ESTABLISHED | CT_DNAT)
        );
        assert!(parse_ctstates("NEWISH").is_err());
        let c = parse_cidr("10.1.2.3/255.0.0.0", IpFamily::V4).unwrap();
        assert!(c.contains(&"10.200.0.1".parse().unwrap()));
        assert!(!c.contains(&"11.0.0.1".parse().unwrap()));
        assert!(parse_cidr("10.0.0.0/8", IpFamily::V6).is_err());
    }

    #[test]
    fn render_text_and_json_shapes() {
        let p = pkt("192.168.5.5", "172.30.0.41", 80, Some("eth0"));
        let t = run(&p);
        let text = render_text(&t, &p);
        let mut lines = text.lines();
        assert_eq!(
            lines.next().unwrap(),
            "packet: TCP 192.168.5.5 -> 172.30.0.41:80 in eth0 (IPv4, new connection)"
        );
        assert!(text.contains("path 1/3: nat/PREROUTING -> filter/FORWARD -> nat/POSTROUTING"));
        assert!(text.contains("  nat/KUBE-SEP-SXIVWICOYRO3J4NJ: -A KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(text.contains("  => DNAT to 10.180.0.1:80, masqueraded"));
        assert_eq!(
            text.lines().last().unwrap(),
            "verdict: DNAT; endpoints: 10.180.0.1:80, 10.180.0.2:80, 10.180.0.3:80; masquerade: yes"
        );
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["verdict"], "DNAT");
        assert_eq!(json["paths"][0]["verdict"], "DNAT");
        assert_eq!(json["rules"][0]["path"], 0);
        assert_eq!(serde_json::to_value(Verdict::Pass).unwrap(), "PASS");
    }
}
