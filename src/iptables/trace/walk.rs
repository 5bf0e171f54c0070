//! Walking a packet through loaded [`Tables`]: the built-in chains of each netfilter hook
//! ([`Hook`]), jumps and gotos between chains, the evaluation of every match and target, and the
//! forks where the outcome cannot be known at trace time (`statistic`, `recent --rcheck`,
//! `physdev`). iptables mode's hook order is [`Hooks`]; IPVS mode runs the same hooks with its
//! own order around them (`crate::ipvs::trace`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use super::tables::{CT_DNAT, CT_NEW, FILTER, Match, NAT, Rule, TABLE_NAMES, Tables, Target};
use crate::model::Protocol;
use crate::trace::walk::{self as shared, AfterStage, End, Forks, HookOrder, Work, nested, run_rules};
use crate::trace::{SetDim, SetLookup, SetValue, Trace, TraceContext, TraceError, TracedRule};

/// The packet and its history on one path of the iptables walk.
pub(crate) type PathState = shared::PathState<'static, Step, ModeState>;

/// What the iptables walk tracks on a path besides the packet.
#[derive(Clone, Debug, Default)]
pub(crate) struct ModeState {
    /// Session-affinity decisions already taken on this path (name -> hit).
    recent: BTreeMap<String, bool>,
    /// Whether the packet was bridged, once a physdev match asked.
    bridged: Option<bool>,
    /// Set once IPVS has scheduled the packet.
    pub(crate) ipvs: Option<VirtualService>,
}

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

/// Turns the finished paths of a walk into the report.
pub(crate) fn finish(tables: &Tables, finished: Vec<PathState>, from_node: bool) -> Trace {
    shared::report(finished, from_node, |step, path| match step {
        Step::Rule(r) => {
            let chain = &tables[r.table].chains[r.chain];
            TracedRule {
                table: TABLE_NAMES[r.table].to_string(),
                chain: chain.name.clone(),
                rule: chain.rules[r.rule].text.clone(),
                path,
            }
        }
        Step::Other { table, chain, text } => TracedRule {
            table: (*table).to_string(),
            chain: (*chain).to_string(),
            rule: text.clone(),
            path,
        },
    })
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

/// iptables mode's hook order over a [`Tracer`].
pub(super) struct Hooks<'a> {
    pub(super) tracer: Tracer<'a>,
    /// The packet was generated on the node.
    pub(super) from_node: bool,
}

impl HookOrder<'static, Step, ModeState> for Hooks<'_> {
    type Stage = Hook;

    fn run_stage(&mut self, hook: Hook, path: PathState) -> Result<AfterStage<'static, Step, ModeState>, TraceError> {
        self.tracer.run_hook(hook, path)
    }

    /// The kernel's hook order; routing decides on the (possibly DNATed) destination.
    fn next_stage(&self, hook: Hook, st: &mut PathState) -> Option<Hook> {
        let local_dst = self.tracer.is_local(&st.dst);
        let next = match hook {
            Hook::NatOutput => Some(Hook::FilterOutput),
            Hook::FilterOutput => Some(Hook::NatPostrouting),
            Hook::NatPostrouting if self.from_node && local_dst => Some(Hook::FilterInput),
            Hook::NatPostrouting | Hook::FilterInput => None,
            Hook::NatPrerouting if local_dst => Some(Hook::FilterInput),
            Hook::NatPrerouting => Some(Hook::FilterForward),
            Hook::FilterForward => Some(Hook::NatPostrouting),
        };
        if next == Some(Hook::FilterInput) && self.from_node {
            st.loop_back();
        }
        next
    }
}

/// Walks paths through parsed tables.
pub(crate) struct Tracer<'a> {
    tables: &'a Tables,
    sets: &'a dyn SetLookup,
    /// The node's addresses; loopback counts as local whether listed or not.
    ctx: &'a TraceContext,
    forks: Forks,
}

impl<'a> Tracer<'a> {
    pub(crate) fn new(tables: &'a Tables, sets: &'a dyn SetLookup, ctx: &'a TraceContext) -> Tracer<'a> {
        Tracer {
            tables,
            sets,
            ctx,
            forks: Forks::new(),
        }
    }

    pub(crate) fn is_local(&self, ip: &IpAddr) -> bool {
        self.ctx.is_local(ip)
    }

    /// Counts one more path, failing past [`crate::trace::MAX_PATHS`].
    pub(crate) fn fork(&mut self) -> Result<(), TraceError> {
        self.forks.add(1)
    }

    /// Runs the built-in chain of `hook` for one path; returns each resulting path, in rule
    /// order, stopped there (DROP, REJECT, a DROP policy) or going on.
    pub(crate) fn run_hook(
        &mut self,
        hook: Hook,
        mut st: PathState,
    ) -> Result<AfterStage<'static, Step, ModeState>, TraceError> {
        let tables = self.tables;
        let table = hook.table();
        st.hooks.push(hook.label());
        let chain = tables[table].index[hook.chain()];
        let policy_drop = tables[table].chains[chain].policy_drop;
        let mut out = Vec::new();
        for (s, end) in self.run_chain(table, chain, st, &mut Vec::new())? {
            let end = if end == End::Fall && policy_drop {
                End::Drop
            } else {
                end
            };
            out.push(s.after(end));
        }
        Ok(out)
    }

    /// Runs one path through `chain`, inside the chains on `stack`: every resulting path with
    /// how it left the chain.
    fn run_chain(
        &mut self,
        table: usize,
        chain: usize,
        st: PathState,
        stack: &mut Vec<usize>,
    ) -> Result<Vec<(PathState, End)>, TraceError> {
        let tables = self.tables;
        let chains = &tables[table].chains;
        nested(
            stack,
            chain,
            TABLE_NAMES[table],
            |c| chains[c].name.as_str(),
            |stack| {
                run_rules(&chains[chain].rules, st, |i, rule, st| {
                    self.eval_rule(RuleRef { table, chain, rule: i }, rule, st, stack)
                })
            },
        )
    }

    /// Evaluates rule `at` for one path: where each path it leads to goes.
    fn eval_rule(
        &mut self,
        at: RuleRef,
        rule: &Rule,
        st: PathState,
        stack: &mut Vec<usize>,
    ) -> Result<Vec<Work<PathState>>, TraceError> {
        let RuleRef { table, chain, rule: i } = at;
        let mut next = Vec::new();
        for (mut s, matched) in self.eval_matches(table, chain, rule, st)? {
            if !matched {
                next.push(Work::At(i + 1, s));
                continue;
            }
            s.rules.push(Step::Rule(at));
            for m in &rule.matches {
                if let Match::RecentSet { name } = m {
                    s.mode.recent.insert(name.clone(), true);
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
                    s.dnat_to(SocketAddr::new(*addr, port.unwrap_or(s.dport)));
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
                Target::Jump(sub) => next.extend(Work::after_jump(self.run_chain(table, *sub, s, stack)?, i)),
                Target::Goto(sub) => next.extend(Work::after_goto(self.run_chain(table, *sub, s, stack)?)),
            }
        }
        Ok(next)
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
                    Match::PhysdevIsIn { neg } => match (s.mode.bridged, s.in_interface.clone()) {
                        (Some(bridged), _) => forked.push((s, bridged != *neg)),
                        // Without an input interface (from the node) nothing was bridged.
                        (None, None) => forked.push((s, *neg)),
                        (None, Some(iface)) => {
                            self.fork()?;
                            let place = self.place(table, chain, rule);
                            let mut bridged = s.clone();
                            bridged.mode.bridged = Some(true);
                            bridged
                                .choices
                                .push(format!("physdev: bridged into {iface} (br_netfilter): {place}"));
                            let mut routed = s;
                            routed.mode.bridged = Some(false);
                            routed
                                .choices
                                .push(format!("physdev: {iface} is not a bridge: {place}"));
                            // The path on which the rule matches first.
                            let (first, second) = if *neg { (routed, bridged) } else { (bridged, routed) };
                            forked.push((first, true));
                            forked.push((second, false));
                        }
                    },
                    Match::RecentCheck { name } => match s.mode.recent.get(name) {
                        Some(&hit) => forked.push((s, hit)),
                        None => {
                            self.fork()?;
                            let place = self.place(table, chain, rule);
                            let mut hit = s.clone();
                            hit.mode.recent.insert(name.clone(), true);
                            hit.choices
                                .push(format!("recent {name} rcheck hit (session affinity): {place}"));
                            let mut miss = s;
                            miss.mode.recent.insert(name.clone(), false);
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
                let dnat = st.dnat.is_some() && st.mode.ipvs.is_none();
                let current = CT_NEW | if dnat { CT_DNAT } else { 0 };
                (states & current != 0) != *neg
            }
            Match::RecentSet { .. } => true,
            Match::Set { name, src, neg } => self.set_match(name, src, st) != *neg,
            Match::PhysdevIsIn { neg } => match (st.mode.bridged, &st.in_interface) {
                (Some(bridged), _) => bridged != *neg,
                (None, None) => *neg,
                (None, Some(_)) => return None,
            },
            Match::IpvsVaddr { cidr, neg } => st.mode.ipvs.is_some_and(|v| cidr.contains(&v.addr) != *neg),
            Match::IpvsVproto { protocol, neg } => st.mode.ipvs.is_some_and(|v| (v.protocol == *protocol) != *neg),
            Match::IpvsVport { port, neg } => st.mode.ipvs.is_some_and(|v| (v.port == *port) != *neg),
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
