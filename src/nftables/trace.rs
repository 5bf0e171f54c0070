//! `kube-proxy trace --proxy-mode=nftables`: follows one new packet through the `kube-proxy`
//! table as the kernel holds it ([`Ruleset`]), and reports every path it can take in the same
//! [`Trace`] form as the iptables tracer, so that the two modes can be compared.
//!
//! The walk follows netfilter: conntrack (priority -200, so `ct state new` holds for the
//! traced first packet), then the table's base chains of each hook in priority order —
//! prerouting (`filter-prerouting-pre-dnat` at -110 before `nat-prerouting` at -100), the
//! routing decision on the possibly DNATed destination (input for one of the node's
//! addresses, else forward), postrouting; a packet from one of the node's addresses takes the
//! output hook instead of prerouting and, when it is for the node itself, comes back in
//! through `lo`. Rules are evaluated with nftables' jump/goto/return semantics, verdict-map
//! lookups on the elements of the named maps, static and anonymous sets, `fib ... type
//! local` against the node's addresses, marks, and terminal `dnat` / `masquerade`.
//!
//! What cannot be known at trace time forks the walk, as `statistic` and `recent` do in the
//! iptables tracer: `numgen random mod N` takes each of its N branches, and a lookup in a
//! dynamic (session-affinity) set is followed both as a hit and as a miss.
//!
//! Like the iptables tracer it is strict: a reference the kernel would refuse (a missing
//! chain or set, a set of the wrong type, NAT in a chain that cannot NAT) is a
//! [`TraceError`], never silently skipped.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;

use super::ast::Verdict as NftVerdict;
use super::ast::{
    AddrSpec, BaseHook, Dir, ElemKey, ElemValue, KeyType, MapValue, Match, Rule, Statement, VmapKey, family_keyword,
    numgen_text,
};
use super::names::TABLE;
use super::ruleset::{Ruleset, Set};
use crate::trace::walk::{self as shared, AfterHook, AfterStage, End, Forks, HookOrder, Work, nested, run_rules};
use crate::trace::{Packet, Trace, TraceContext, TraceError, TracedRule, check_family};

/// Follows `packet` through `ruleset` and reports every path it can take.
pub fn trace(ruleset: &Ruleset, ctx: &TraceContext, packet: &Packet) -> Result<Trace, TraceError> {
    check_family(ruleset.family, packet)?;
    let table = format!("{} {TABLE}", family_keyword(ruleset.family));
    let from_node = ctx.is_local(&packet.src);
    let mut tracer = Tracer {
        ruleset,
        table: &table,
        ctx,
        hooks: base_chains(ruleset, &table)?,
        forks: Forks::new(),
        from_node,
    };
    let first = if from_node { Stage::Output } else { Stage::Prerouting };
    let mut finished = Vec::new();
    let start = PathState::start(packet, from_node, ModeState::default());
    tracer.walk(first, start, &mut finished)?;
    Ok(shared::report(finished, from_node, |r, path| TracedRule {
        table: table.clone(),
        chain: r.chain.to_string(),
        rule: r.rule.text(ruleset.family),
        path,
    }))
}

// ---------------------------------------------------------------------------------------------
// Hooks and base chains

/// A netfilter hook as the traced packet meets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
    /// Prerouting of a locally generated packet looped back through `lo`: conntrack already
    /// holds the connection (still `new`, no reply seen) with its NAT decided in output, so
    /// only the filter chains run.
    LoopbackPrerouting,
}

impl Stage {
    fn hook(self) -> &'static str {
        match self {
            Stage::Prerouting | Stage::LoopbackPrerouting => "prerouting",
            Stage::Input => "input",
            Stage::Forward => "forward",
            Stage::Output => "output",
            Stage::Postrouting => "postrouting",
        }
    }
}

/// One base chain of the table.
#[derive(Clone, Copy, Debug)]
struct BaseChain<'a> {
    name: &'a str,
    hook: BaseHook,
}

/// The table's base chains per hook, in the order the kernel runs them (priority; chains of
/// equal priority by name, where the kernel's order is that of registration).
fn base_chains<'a>(
    ruleset: &'a Ruleset,
    table: &str,
) -> Result<BTreeMap<&'static str, Vec<BaseChain<'a>>>, TraceError> {
    let mut out: BTreeMap<&'static str, Vec<BaseChain<'a>>> = BTreeMap::new();
    for (name, chain) in &ruleset.chains {
        let Some(hook) = chain.decl.base else { continue };
        if hook.kind != "filter" && hook.kind != "nat" {
            return Err(TraceError::Nftables {
                table: table.to_string(),
                chain: name.clone(),
                reason: format!("base chain type {} is not traced (only filter and nat)", hook.kind),
            });
        }
        let Some(key) = ["prerouting", "input", "forward", "output", "postrouting"]
            .into_iter()
            .find(|h| *h == hook.hook)
        else {
            return Err(TraceError::Nftables {
                table: table.to_string(),
                chain: name.clone(),
                reason: format!("hook {} is not traced", hook.hook),
            });
        };
        out.entry(key).or_default().push(BaseChain { name, hook });
    }
    for chains in out.values_mut() {
        chains.sort_by(|a, b| (a.hook.priority, a.name).cmp(&(b.hook.priority, b.name)));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Walking the packet

/// A matched rule on a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct RuleRef<'a> {
    chain: &'a str,
    index: usize,
    rule: &'a Rule,
}

/// The packet and its history on one path.
type PathState<'a> = shared::PathState<'a, RuleRef<'a>, ModeState<'a>>;

/// What the nftables walk tracks on a path besides the packet.
#[derive(Clone, Debug, Default)]
struct ModeState<'a> {
    /// Session-affinity set lookups already decided on this path (set -> saddr in it).
    affinity: BTreeMap<&'a str, bool>,
}

/// Where a rule is evaluated: for error messages, choice notes and NAT validation.
#[derive(Clone, Copy)]
struct Place<'a> {
    /// The base chain whose evaluation reached this rule.
    base: BaseChain<'a>,
    chain: &'a str,
    index: usize,
    rule: &'a Rule,
}

struct Tracer<'a> {
    ruleset: &'a Ruleset,
    /// `ip kube-proxy` / `ip6 kube-proxy`
    table: &'a str,
    ctx: &'a TraceContext,
    hooks: BTreeMap<&'static str, Vec<BaseChain<'a>>>,
    forks: Forks,
    /// The packet was generated on the node.
    from_node: bool,
}

impl<'a> HookOrder<'a, RuleRef<'a>, ModeState<'a>> for Tracer<'a> {
    type Stage = Stage;

    /// Runs the base chains of `stage` in priority order: a path stopped in one goes no further.
    fn run_stage(
        &mut self,
        stage: Stage,
        st: PathState<'a>,
    ) -> Result<AfterStage<'a, RuleRef<'a>, ModeState<'a>>, TraceError> {
        let chains: Vec<BaseChain<'a>> = self
            .hooks
            .get(stage.hook())
            .map(|c| {
                c.iter()
                    .copied()
                    // NAT for the looped-back packet was decided in output.
                    .filter(|b| stage != Stage::LoopbackPrerouting || b.hook.kind != "nat")
                    .collect()
            })
            .unwrap_or_default();
        let mut stopped = Vec::new();
        let mut current = vec![st];
        for base in chains {
            let mut next = Vec::new();
            for mut s in current {
                s.hooks.push(base.name);
                for (s, end) in self.run_chain(base, base.name, s, &mut Vec::new())? {
                    // Base chain policy accept: the next base chain sees the packet.
                    match s.after(end) {
                        AfterHook::GoesOn(s) => next.push(s),
                        stop => stopped.push(stop),
                    }
                }
            }
            current = next;
        }
        stopped.extend(current.into_iter().map(AfterHook::GoesOn));
        Ok(stopped)
    }

    /// The kernel's hook order; routing decides on the (possibly DNATed) destination.
    fn next_stage(&self, stage: Stage, st: &mut PathState<'a>) -> Option<Stage> {
        let next = match stage {
            Stage::Prerouting if self.is_local(&st.dst) => Some(Stage::Input),
            Stage::Prerouting => Some(Stage::Forward),
            Stage::Forward | Stage::Output => Some(Stage::Postrouting),
            // Local traffic to a local address loops back in through `lo`.
            Stage::Postrouting if self.from_node && self.is_local(&st.dst) => Some(Stage::LoopbackPrerouting),
            Stage::LoopbackPrerouting => Some(Stage::Input),
            Stage::Postrouting | Stage::Input => None,
        };
        if next == Some(Stage::LoopbackPrerouting) {
            st.loop_back();
        }
        next
    }
}

impl<'a> Tracer<'a> {
    /// Loopback and the node's addresses: what `fib ... type local` finds local.
    fn is_local(&self, ip: &IpAddr) -> bool {
        self.ctx.is_local(ip)
    }

    fn error(&self, chain: &str, rule: Option<&Rule>, reason: impl Into<String>) -> TraceError {
        let reason = reason.into();
        TraceError::Nftables {
            table: self.table.to_string(),
            chain: chain.to_string(),
            reason: match rule {
                Some(r) => format!("rule `{}`: {reason}", r.text(self.ruleset.family)),
                None => reason,
            },
        }
    }

    /// Runs one path through `chain`, inside the chains on `stack`, for the base chain `base`:
    /// every resulting path with how it left the chain.
    fn run_chain(
        &mut self,
        base: BaseChain<'a>,
        chain: &'a str,
        st: PathState<'a>,
        stack: &mut Vec<&'a str>,
    ) -> Result<Vec<(PathState<'a>, End)>, TraceError> {
        let (ruleset, table) = (self.ruleset, self.table);
        nested(
            stack,
            chain,
            table,
            |c| c,
            |stack| {
                let Some(c) = ruleset.chains.get(chain) else {
                    // Only reachable from a hand-built Ruleset: the kernel refuses such a rule.
                    return Err(self.error(chain, None, "no such chain"));
                };
                run_rules(&c.rules, st, |index, rule, st| {
                    let place = Place {
                        base,
                        chain,
                        index,
                        rule,
                    };
                    self.eval_rule(place, st, stack)
                })
            },
        )
    }

    /// Evaluates the rule at `place` for one path: where each path it leads to goes.
    fn eval_rule(
        &mut self,
        place: Place<'a>,
        st: PathState<'a>,
        stack: &mut Vec<&'a str>,
    ) -> Result<Vec<Work<PathState<'a>>>, TraceError> {
        let Place {
            chain, index: i, rule, ..
        } = place;
        let mut next = Vec::new();
        for (mut s, matched) in self.eval_matches(place, st)? {
            if !matched {
                next.push(Work::At(i + 1, s));
                continue;
            }
            let r = RuleRef { chain, index: i, rule };
            match &rule.statement {
                Statement::Verdict(v) => {
                    s.rules.push(r);
                    self.apply_verdict(place, v, s, stack, &mut next)?;
                }
                Statement::Vmap { key, map } => {
                    let map = self.set(place, map, Some(MapValue::Verdict))?;
                    let Some(elem_key) = packet_key(*key, map.decl.key, &s) else {
                        return Err(self.error(chain, Some(rule), "the map's key type does not fit the lookup"));
                    };
                    match map.elements.get(&elem_key) {
                        // No element: the lookup does not match, the next rule runs.
                        None => next.push(Work::At(i + 1, s)),
                        Some(element) => {
                            let Some(v) = element.value.as_ref().and_then(|v| v.verdict()) else {
                                return Err(self.error(
                                    chain,
                                    Some(rule),
                                    format!("element {elem_key} of @{} has no verdict", map.decl.name),
                                ));
                            };
                            s.rules.push(r);
                            self.apply_verdict(place, v, s, stack, &mut next)?;
                        }
                    }
                }
                Statement::NumgenVmap(targets) => {
                    if targets.is_empty() {
                        return Err(self.error(chain, Some(rule), "numgen with no targets"));
                    }
                    self.forks.add(targets.len() - 1)?;
                    s.rules.push(r);
                    for (n, target) in targets.iter().enumerate() {
                        let mut b = s.clone();
                        // One target is no choice.
                        if targets.len() > 1 {
                            b.choices.push(format!(
                                "numgen random mod {} = {n} (goto {target}): {}",
                                targets.len(),
                                self.where_(place)
                            ));
                        }
                        self.apply_verdict(place, &NftVerdict::Goto(target.clone()), b, stack, &mut next)?;
                    }
                }
                Statement::MarkSetOr(m) => {
                    s.mark |= m;
                    s.rules.push(r);
                    next.push(Work::At(i + 1, s));
                }
                Statement::MarkSetXor(m) => {
                    s.mark ^= m;
                    s.rules.push(r);
                    next.push(Work::At(i + 1, s));
                }
                Statement::Masquerade => {
                    self.check_nat(place, "postrouting")?;
                    s.masquerade = true;
                    s.rules.push(r);
                    next.push(Work::Done(s, End::Accept));
                }
                Statement::Dnat(to) => {
                    self.check_nat(place, "prerouting")?;
                    s.dnat_to(*to);
                    s.rules.push(r);
                    next.push(Work::Done(s, End::Accept));
                }
                Statement::DnatNumgenMap { modulus, offset, map } => {
                    self.check_nat(place, "prerouting")?;
                    self.dnat_numgen_map(place, (*modulus, *offset, map), s, &mut next)?;
                }
                Statement::UpdateSaddr(set) => {
                    let decl = &self.set(place, set, None)?.decl;
                    if decl.timeout_seconds.is_none() || decl.key != KeyType::Addr {
                        return Err(self.error(chain, Some(rule), format!("@{set} is not a dynamic address set")));
                    }
                    // The source is in the set from now on (a later lookup on this path hits).
                    s.mode.affinity.insert(decl.name.as_str(), true);
                    s.rules.push(r);
                    next.push(Work::At(i + 1, s));
                }
            }
        }
        Ok(next)
    }

    /// Continues a path after a verdict (a rule's, or a verdict map's value).
    fn apply_verdict(
        &mut self,
        place: Place<'a>,
        verdict: &NftVerdict,
        mut s: PathState<'a>,
        stack: &mut Vec<&'a str>,
        next: &mut Vec<Work<PathState<'a>>>,
    ) -> Result<(), TraceError> {
        match verdict {
            NftVerdict::Accept => {
                s.accepted = true;
                next.push(Work::Done(s, End::Accept));
            }
            NftVerdict::Drop => next.push(Work::Done(s, End::Drop)),
            NftVerdict::Reject => next.push(Work::Done(s, End::Reject)),
            NftVerdict::Return => next.push(Work::Done(s, End::Fall)),
            NftVerdict::Jump(target) => {
                let target = self.chain_name(place, target)?;
                next.extend(Work::after_jump(
                    self.run_chain(place.base, target, s, stack)?,
                    place.index,
                ));
            }
            NftVerdict::Goto(target) => {
                let target = self.chain_name(place, target)?;
                next.extend(Work::after_goto(self.run_chain(place.base, target, s, stack)?));
            }
        }
        Ok(())
    }

    /// The ruleset's own copy of a chain name (so paths can borrow it).
    fn chain_name(&self, place: Place<'a>, name: &str) -> Result<&'a str, TraceError> {
        let ruleset = self.ruleset;
        match ruleset.chains.get_key_value(name) {
            Some((k, c)) if c.decl.base.is_none() => Ok(k.as_str()),
            Some(_) => Err(self.error(
                place.chain,
                Some(place.rule),
                format!("jump or goto to base chain {name}"),
            )),
            None => Err(self.error(place.chain, Some(place.rule), format!("no such chain {name}"))),
        }
    }

    /// A named set (`map == None`) or map of the table.
    fn set(&self, place: Place<'a>, name: &str, map: Option<MapValue>) -> Result<&'a Set, TraceError> {
        let ruleset = self.ruleset;
        let kind = |m: Option<MapValue>| match m {
            None => "a set",
            Some(MapValue::Verdict) => "a verdict map",
            Some(MapValue::AddrPort(_)) => "a map of addresses and ports",
        };
        match ruleset.sets.get(name) {
            Some(s) if s.decl.map == map => Ok(s),
            Some(s) => Err(self.error(
                place.chain,
                Some(place.rule),
                format!("@{name} is {}, not {}", kind(s.decl.map), kind(map)),
            )),
            None => Err(self.error(place.chain, Some(place.rule), format!("no such set or map @{name}"))),
        }
    }

    /// `dnat to numgen random mod M offset O map @map`: one path per interval of the map
    /// within `O .. O + M` (each endpoint's share of the random numbers), plus a path on which
    /// the rule does not match if part of that range has no interval.
    fn dnat_numgen_map(
        &mut self,
        place: Place<'a>,
        (modulus, offset, map): (u32, u32, &str),
        s: PathState<'a>,
        next: &mut Vec<Work<PathState<'a>>>,
    ) -> Result<(), TraceError> {
        let Place {
            chain, index: i, rule, ..
        } = place;
        let set = self.set(place, map, Some(MapValue::AddrPort(s.protocol)))?;
        if !matches!(set.decl.key, KeyType::Numgen(_)) {
            return Err(self.error(chain, Some(rule), format!("@{map} is not keyed by numgen")));
        }
        let (lo, hi) = (u64::from(offset), u64::from(offset) + u64::from(modulus) - 1);
        let mut hits = Vec::new();
        let mut covered = 0u64;
        for element in set.elements.values() {
            let ElemKey::Range(a, b) = element.key else {
                return Err(self.error(chain, Some(rule), format!("@{map} holds a non-interval key")));
            };
            let (a, b) = (u64::from(a).max(lo), u64::from(b).min(hi));
            if a > b {
                continue;
            }
            let Some(ElemValue::AddrPort(to)) = element.value else {
                return Err(self.error(
                    chain,
                    Some(rule),
                    format!("element {} of @{map} has no address", element.key),
                ));
            };
            covered += b - a + 1;
            hits.push((a, b, to));
        }
        let misses = covered < u64::from(modulus);
        let branches = hits.len() + usize::from(misses);
        if branches > 1 {
            self.forks.add(branches - 1)?;
        }
        let r = RuleRef { chain, index: i, rule };
        let choice = |s: &mut PathState<'a>, what: String| {
            if branches > 1 {
                s.choices.push(format!(
                    "{} = {what}: {}",
                    numgen_text(modulus, offset),
                    self.where_(place)
                ));
            }
        };
        for (a, b, to) in hits {
            let mut b_state = s.clone();
            choice(&mut b_state, format!("{a}-{b} (dnat to {to})"));
            b_state.dnat_to(to);
            b_state.rules.push(r);
            next.push(Work::Done(b_state, End::Accept));
        }
        if misses {
            let mut m = s;
            choice(&mut m, "no interval (no match)".to_string());
            next.push(Work::At(i + 1, m));
        }
        Ok(())
    }

    /// `dnat` is only valid in nat chains of prerouting/output, `masquerade` in nat chains of
    /// postrouting; the kernel refuses the rule otherwise.
    fn check_nat(&self, place: Place<'a>, hook: &str) -> Result<(), TraceError> {
        let b = place.base.hook;
        let ok = b.kind == "nat" && (b.hook == hook || (hook == "prerouting" && b.hook == "output"));
        if ok {
            Ok(())
        } else {
            Err(self.error(
                place.chain,
                Some(place.rule),
                format!(
                    "reached from {} ({} {}), where it cannot NAT",
                    place.base.name, b.kind, b.hook
                ),
            ))
        }
    }

    /// `ip kube-proxy CHAIN rule N (comment)`, for choice notes.
    fn where_(&self, place: Place<'a>) -> String {
        let mut s = format!("{} {} rule {}", self.table, place.chain, place.index + 1);
        if let Some(c) = &place.rule.comment {
            let _ = write!(s, " ({c})");
        }
        s
    }

    /// Evaluates a rule's matches; returns one entry per resulting path (matched first).
    fn eval_matches(&mut self, place: Place<'a>, st: PathState<'a>) -> Result<Vec<(PathState<'a>, bool)>, TraceError> {
        // Deterministic matches first, so a rule that cannot match does not fork.
        let mut undecided = Vec::new();
        for m in &place.rule.matches {
            match self.static_match(place, m, &st)? {
                Some(false) => return Ok(vec![(st, false)]),
                Some(true) => {}
                None => undecided.push(m),
            }
        }
        let mut branches = vec![(st, true)];
        for m in undecided {
            // Only affinity lookups are undecided (see static_match).
            let Match::Addr {
                dir,
                negate,
                spec: AddrSpec::Set(name),
            } = m
            else {
                continue;
            };
            let set = self.set(place, name, None)?;
            let name = set.decl.name.as_str();
            let mut forked = Vec::new();
            for (s, ok) in branches {
                if !ok {
                    forked.push((s, false));
                    continue;
                }
                match s.mode.affinity.get(name) {
                    Some(&hit) => forked.push((s, hit != *negate)),
                    None => {
                        self.forks.add(1)?;
                        let ip_x = family_keyword(self.ruleset.family);
                        let dir = dir.keyword();
                        let mut hit = s.clone();
                        hit.mode.affinity.insert(name, true);
                        hit.choices.push(format!(
                            "{ip_x} {dir} in @{name} (session affinity hit): {}",
                            self.where_(place)
                        ));
                        let mut miss = s;
                        miss.mode.affinity.insert(name, false);
                        miss.choices
                            .push(format!("{ip_x} {dir} not in @{name} (miss): {}", self.where_(place)));
                        forked.push((hit, !*negate));
                        forked.push((miss, *negate));
                    }
                }
            }
            branches = forked;
        }
        // Matched branches first, as in the iptables tracer.
        branches.sort_by_key(|(_, ok)| !*ok);
        Ok(branches)
    }

    /// The result of a match that does not fork, or `None` for a lookup in a dynamic set
    /// (its contents depend on earlier connections).
    fn static_match(&self, place: Place<'a>, m: &Match, st: &PathState<'a>) -> Result<Option<bool>, TraceError> {
        Ok(Some(match m {
            // Conntrack (priority -200) has seen only this packet.
            Match::CtStateNew => true,
            Match::Addr { dir, negate, spec } => {
                let ip = match dir {
                    Dir::Saddr => st.src,
                    Dir::Daddr => st.dst,
                };
                let hit = match spec {
                    AddrSpec::Net(net) => net.contains(&ip),
                    AddrSpec::AnonSet { items, .. } => items.iter().any(|n| n.contains(&ip)),
                    AddrSpec::Set(name) => {
                        let set = self.set(place, name, None)?;
                        if set.decl.key != KeyType::Addr {
                            return Err(self.error(
                                place.chain,
                                Some(place.rule),
                                format!("@{name} is not a set of addresses"),
                            ));
                        }
                        if set.decl.timeout_seconds.is_some() {
                            return match st.mode.affinity.get(set.decl.name.as_str()) {
                                Some(&hit) => Ok(Some(hit != *negate)),
                                None => Ok(None),
                            };
                        }
                        set.elements.contains_key(&ElemKey::Addr(ip))
                    }
                };
                hit != *negate
            }
            Match::Iifname { negate, pattern } => {
                // The kernel compares an empty name when there is no input device (output).
                let iface = st.in_interface.as_deref().unwrap_or("");
                let hit = match pattern.strip_suffix('*') {
                    Some(prefix) => iface.starts_with(prefix),
                    None => iface == pattern,
                };
                hit != *negate
            }
            Match::FibLocal(dir) => self.is_local(match dir {
                Dir::Saddr => &st.src,
                Dir::Daddr => &st.dst,
            }),
            Match::L4proto(p) => st.protocol == *p,
            Match::MarkAndZero(mark) => st.mark & mark == 0,
            Match::CtStatusDnat => st.dnat.is_some(),
            Match::InSet { key, set } => {
                let set = self.set(place, set, None)?;
                let Some(k) = packet_key(*key, set.decl.key, st) else {
                    return Err(self.error(
                        place.chain,
                        Some(place.rule),
                        format!("@{} has a key type that does not fit the lookup", set.decl.name),
                    ));
                };
                set.elements.contains_key(&k)
            }
        }))
    }
}

/// The key a lookup of `key` builds from the packet, when the set's key type fits it.
fn packet_key(key: VmapKey, set_key: KeyType, s: &PathState<'_>) -> Option<ElemKey> {
    if key.key_type() != set_key {
        return None;
    }
    Some(match key {
        VmapKey::DaddrProtoPort => ElemKey::AddrProtoPort(s.dst, s.protocol, s.dport),
        VmapKey::ProtoPort => ElemKey::ProtoPort(s.protocol, s.dport),
        VmapKey::SaddrDaddr => ElemKey::AddrPair(s.src, s.dst),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LocalDetector;
    use crate::model::{
        Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
    };
    use crate::nftables::ast::{ChainDecl, Element, Op, SetDecl, Transaction};
    use crate::nftables::render::render_tx;
    use crate::proxy::{RenderOptions, local_addresses};
    use crate::trace::{MAX_PATHS, Verdict, render_text};

    const NODE_IP: &str = "192.168.0.2";

    fn name(ns: &str, svc: &str) -> ServicePortName {
        ServicePortName {
            namespace: ns.into(),
            name: svc.into(),
            port: "p80".into(),
            protocol: Protocol::Tcp,
        }
    }

    fn ep(ip: &str) -> Endpoint {
        Endpoint::ready(ip.parse().unwrap(), 80)
    }

    /// The services of upstream's golden nftables test, more or less: a ClusterIP with three
    /// endpoints and an external IP and a NodePort, one without endpoints, ETP Local without
    /// local endpoints, ClientIP affinity, a LoadBalancer with source ranges.
    fn state() -> ProxyState {
        let mut svc1 = ServicePort::cluster_ip(name("ns1", "svc1"), "172.30.0.41".parse().unwrap(), 80);
        svc1.node_port = 3001;
        svc1.external_ips = vec!["192.168.99.11".parse().unwrap()];
        let svc2 = ServicePort::cluster_ip(name("ns2", "svc2"), "172.30.0.42".parse().unwrap(), 80);
        let mut svc3 = ServicePort::cluster_ip(name("ns3", "svc3"), "172.30.0.43".parse().unwrap(), 80);
        svc3.node_port = 3003;
        svc3.external_policy_local = true;
        svc3.health_check_node_port = 30000;
        let mut svc4 = ServicePort::cluster_ip(name("ns4", "svc4"), "172.30.0.44".parse().unwrap(), 80);
        svc4.session_affinity_timeout = Some(10800);
        let mut svc5 = ServicePort::cluster_ip(name("ns5", "svc5"), "172.30.0.45".parse().unwrap(), 80);
        svc5.load_balancer_vips = vec!["5.6.7.8".parse().unwrap()];
        svc5.load_balancer_source_ranges = vec!["203.0.113.0/25".parse().unwrap()];
        let sps = |port, endpoints| ServicePortState { port, endpoints };
        ProxyState {
            family: IpFamily::V4,
            node: NodeInfo {
                name: "node1".into(),
                addresses: vec![NODE_IP.parse().unwrap()],
                ..NodeInfo::default()
            },
            service_ports: crate::model::shared(vec![
                sps(svc1, vec![ep("10.180.0.1"), ep("10.180.0.2"), ep("10.180.0.3")]),
                sps(svc2, vec![]),
                sps(svc3, vec![ep("10.180.0.4")]),
                sps(svc4, vec![ep("10.180.0.7"), ep("10.180.0.8")]),
                sps(svc5, vec![ep("10.180.0.5")]),
            ]),
            service_cidrs: vec!["172.30.0.0/16".parse().unwrap()],
            warnings: vec![],
        }
    }

    fn opts() -> RenderOptions {
        RenderOptions {
            local_detector: LocalDetector::Cidr("10.0.0.0/8".into()),
            node_port_addresses: vec!["primary".into()],
            ..RenderOptions::default()
        }
    }

    fn ruleset_of(st: &ProxyState, o: &RenderOptions) -> Ruleset {
        Ruleset::from_transaction(&render_tx(st, o, true)).unwrap()
    }

    fn ctx_of(st: &ProxyState) -> TraceContext {
        TraceContext {
            local_addresses: local_addresses(st),
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
        let st = state();
        trace(&ruleset_of(&st, &opts()), &ctx_of(&st), p).unwrap()
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn path_rules(t: &Trace, path: usize) -> Vec<String> {
        t.rules
            .iter()
            .filter(|r| r.path == path)
            .map(|r| format!("{}: {}", r.chain, r.rule))
            .collect()
    }

    const FORWARDED: [&str; 4] = [
        "filter-prerouting-pre-dnat", "nat-prerouting", "filter-forward", "nat-postrouting",
    ];

    #[test]
    fn cluster_ip_from_pod_dnats_to_every_endpoint_without_masquerade() {
        let t = run(&pkt("10.1.2.3", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["10.180.0.1:80", "10.180.0.2:80", "10.180.0.3:80"]));
        assert!(!t.masquerade);
        assert_eq!(t.paths.len(), 3);
        for (n, p) in t.paths.iter().enumerate() {
            assert_eq!(p.hooks, strs(&FORWARDED));
            assert_eq!(p.choices.len(), 1);
            // Each endpoint's third of the port's block of numbers.
            let ep = format!("10.180.0.{}:80", n + 1);
            assert!(
                p.choices[0].starts_with("numgen random mod 55440 offset ")
                    && p.choices[0].contains(&format!("(dnat to {ep})")),
                "{p:?}"
            );
        }
        let rules = path_rules(&t, 0);
        assert_eq!(rules[0], "filter-prerouting-pre-dnat: ct state new jump firewall-check");
        assert!(rules.contains(&"nat-prerouting: jump services".to_string()));
        assert!(rules.contains(&"services: ip daddr . meta l4proto . th dport vmap @service-ips".to_string()));
        assert!(
            rules
                .iter()
                .any(|r| r.contains("map @service-endpoints-tcp-") && r.contains("meta l4proto tcp dnat to numgen"))
        );
        // The masquerade check returned: the mark is clear.
        assert_eq!(rules.last().unwrap(), "masquerading: mark and 0x004000 == 0 return");
        assert_eq!(t.rules[0].table, "ip kube-proxy");
    }

    #[test]
    fn cluster_ip_from_outside_masquerades() {
        let t = run(&pkt("192.168.5.5", "172.30.0.41", 80, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(t.paths.iter().all(|p| p.masquerade));
        assert_eq!(
            path_rules(&t, 0).last().unwrap(),
            "masquerading: masquerade fully-random"
        );
    }

    #[test]
    fn unknown_port_of_a_cluster_ip_is_rejected_and_an_unallocated_one_dropped() {
        let t = run(&pkt("10.1.2.3", "172.30.0.41", 81, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Reject);
        assert_eq!(t.paths[0].hooks, strs(&FORWARDED[..3]));
        assert!(
            t.rules
                .last()
                .unwrap()
                .rule
                .contains("Reject traffic to invalid ports of ClusterIPs")
        );
        let t = run(&pkt("10.1.2.3", "172.30.9.9", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Drop);
        assert!(
            t.rules
                .last()
                .unwrap()
                .rule
                .contains("Drop traffic to unallocated ClusterIPs")
        );
        // Outside every ServiceCIDR: not ours.
        let t = run(&pkt("10.1.2.3", "8.8.8.8", 53, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Pass);
        assert!(t.endpoints.is_empty());
    }

    #[test]
    fn no_endpoints_rejects_through_the_reject_set() {
        let t = run(&pkt("10.1.2.3", "172.30.0.42", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Reject);
        let rules = path_rules(&t, 0);
        assert_eq!(
            rules.last().unwrap(),
            "service-endpoints-check: ip daddr . meta l4proto . th dport @reject-services reject"
        );
    }

    #[test]
    fn node_port_from_outside_masquerades_and_is_forwarded() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 3001, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints.len(), 3);
        assert!(t.masquerade);
        assert_eq!(t.paths[0].hooks, strs(&FORWARDED));
        let rules = path_rules(&t, 0);
        assert!(
            rules.contains(
                &"services: ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports".to_string()
            )
        );
        // Only the primary IP takes NodePorts; loopback never does in nftables mode.
        for dst in ["192.168.0.99", "127.0.0.1"] {
            assert_eq!(
                run(&pkt("198.51.100.9", dst, 3001, Some("eth0"))).verdict,
                Verdict::Pass,
                "{dst}"
            );
        }
    }

    #[test]
    fn external_policy_local_without_local_endpoints_drops_in_input() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 3003, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Drop);
        assert_eq!(
            t.paths[0].hooks,
            strs(&["filter-prerouting-pre-dnat", "nat-prerouting", "filter-input"])
        );
        assert!(t.rules.last().unwrap().rule.contains("vmap @no-endpoint-nodeports"));
        // A pod short-circuits to the cluster endpoints; the node masquerades and does too.
        let pod = run(&pkt("10.1.2.3", NODE_IP, 3003, Some("cni0")));
        assert_eq!(pod.endpoints, strs(&["10.180.0.4:80"]));
        assert!(!pod.masquerade);
        let node = run(&pkt(NODE_IP, NODE_IP, 3003, None));
        assert_eq!(node.endpoints, strs(&["10.180.0.4:80"]));
        assert!(node.masquerade);
        // Health-check node ports get no rule in nftables mode.
        assert_eq!(
            run(&pkt("198.51.100.9", NODE_IP, 30000, Some("eth0"))).verdict,
            Verdict::Pass
        );
    }

    #[test]
    fn load_balancer_source_ranges_allow_or_drop_before_dnat() {
        let allowed = run(&pkt("203.0.113.5", "5.6.7.8", 80, Some("eth0")));
        assert_eq!(allowed.verdict, Verdict::Dnat);
        assert_eq!(allowed.endpoints, strs(&["10.180.0.5:80"]));
        assert!(allowed.masquerade);
        let denied = run(&pkt("198.51.100.7", "5.6.7.8", 80, Some("eth0")));
        assert_eq!(denied.verdict, Verdict::Drop);
        assert_eq!(denied.paths[0].hooks, strs(&["filter-prerouting-pre-dnat"]));
        assert!(
            denied
                .rules
                .last()
                .unwrap()
                .rule
                .starts_with("ip saddr != { 203.0.113.0/25 } drop")
        );
    }

    #[test]
    fn hairpin_masquerades_only_the_path_back_to_the_source_pod() {
        let t = run(&pkt("10.180.0.1", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.paths.len(), 3);
        assert!(t.paths[0].masquerade);
        assert_eq!(t.paths[0].endpoint.as_deref(), Some("10.180.0.1:80"));
        assert!(!t.paths[1].masquerade && !t.paths[2].masquerade);
        assert!(t.masquerade);
    }

    #[test]
    fn session_affinity_sets_are_followed_both_ways() {
        let t = run(&pkt("10.1.2.3", "172.30.0.44", 80, Some("cni0")));
        // Hit on endpoint 7; miss 7 + hit 8; miss both + numgen either way.
        assert_eq!(t.paths.len(), 4);
        let eps: Vec<_> = t.paths.iter().map(|p| p.endpoint.clone().unwrap()).collect();
        assert_eq!(
            eps,
            strs(&["10.180.0.7:80", "10.180.0.8:80", "10.180.0.7:80", "10.180.0.8:80"])
        );
        assert!(t.paths[0].choices[0].contains("in @affinity-") && t.paths[0].choices[0].contains("hit"));
        assert!(t.paths[1].choices[0].contains("not in @affinity-"));
        assert_eq!(t.paths[3].choices.len(), 3);
        assert!(path_rules(&t, 0).iter().any(|r| r.contains("update @affinity-")));
        assert_eq!(t.endpoints, strs(&["10.180.0.7:80", "10.180.0.8:80"]));
    }

    #[test]
    fn locally_generated_packets_take_the_output_hooks() {
        let p = pkt(NODE_IP, "172.30.0.41", 80, Some("eth0"));
        let t = run(&p);
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(
            t.paths[0].hooks,
            strs(&[
                "filter-output-pre-dnat", "nat-output", "filter-output", "nat-postrouting"
            ])
        );
        assert!(t.masquerade, "the node is outside the pod CIDR");
        assert!(render_text(&t, &p).starts_with("packet: TCP 192.168.0.2 -> 172.30.0.41:80 from this node"));
        // To itself: back in through lo, where the filter prerouting chain sees it again.
        let t = run(&pkt(NODE_IP, NODE_IP, 22, None));
        assert_eq!(t.verdict, Verdict::Pass);
        assert_eq!(
            t.paths[0].hooks,
            strs(&[
                "filter-output-pre-dnat", "nat-output", "filter-output", "nat-postrouting",
                "filter-prerouting-pre-dnat", "filter-input",
            ])
        );
    }

    #[test]
    fn interface_detector_uses_prefix_patterns() {
        let st = state();
        let mut o = opts();
        o.local_detector = LocalDetector::InterfacePrefix("veth".into());
        let rs = ruleset_of(&st, &o);
        let ctx = ctx_of(&st);
        let masq = |src: &str, iface: Option<&str>| {
            trace(&rs, &ctx, &pkt(src, "172.30.0.41", 80, iface))
                .unwrap()
                .masquerade
        };
        assert!(!masq("10.1.2.3", Some("veth12")));
        assert!(masq("10.1.2.3", Some("eth0")));
        // No input interface compares as "", which `iifname != veth*` matches.
        assert!(masq(NODE_IP, Some("veth12")));
    }

    #[test]
    fn ipv6_table_dnats_to_bracketed_endpoints() {
        let mut st = state();
        st.family = IpFamily::V6;
        st.node.addresses = vec!["fd00:1::2".parse().unwrap()];
        st.service_cidrs = vec![];
        st.service_ports = crate::model::shared(vec![ServicePortState {
            port: ServicePort::cluster_ip(name("ns1", "v6"), "fd00:96::1".parse().unwrap(), 80),
            endpoints: vec![Endpoint::ready("fd00:10::1".parse().unwrap(), 8080)],
        }]);
        let mut o = opts();
        o.local_detector = LocalDetector::Cidr("fd00:10::/64".into());
        let rs = ruleset_of(&st, &o);
        let t = trace(&rs, &ctx_of(&st), &pkt("fd00:10::5", "fd00:96::1", 80, Some("cni0"))).unwrap();
        assert_eq!(t.endpoints, strs(&["[fd00:10::1]:8080"]));
        assert!(!t.masquerade);
        assert_eq!(t.rules[0].table, "ip6 kube-proxy");
        let err = trace(&rs, &ctx_of(&st), &pkt("10.1.2.3", "fd00:96::1", 80, None)).unwrap_err();
        assert!(matches!(err, TraceError::FamilyMismatch { .. }), "{err:?}");
    }

    #[test]
    fn udp_and_sctp_match_their_own_protocol() {
        let mut st = state();
        let mut udp = ServicePort::cluster_ip(name("ns9", "dns"), "172.30.0.10".parse().unwrap(), 53);
        udp.protocol = Protocol::Udp;
        udp.name.protocol = Protocol::Udp;
        st.service_ports.push(std::sync::Arc::new(ServicePortState {
            port: udp,
            endpoints: vec![Endpoint::ready("10.180.0.53".parse().unwrap(), 53)],
        }));
        let rs = ruleset_of(&st, &opts());
        let mut p = pkt("10.1.2.3", "172.30.0.10", 53, Some("cni0"));
        p.protocol = Protocol::Udp;
        assert_eq!(
            trace(&rs, &ctx_of(&st), &p).unwrap().endpoints,
            strs(&["10.180.0.53:53"])
        );
        p.protocol = Protocol::Tcp;
        // A cluster IP on another protocol is an invalid port: rejected.
        assert_eq!(trace(&rs, &ctx_of(&st), &p).unwrap().verdict, Verdict::Reject);
    }

    /// A hand-built table: the shapes the renderer never emits must still be right or refused.
    fn table(rules: &[(&str, Rule)]) -> Ruleset {
        let mut tx = Transaction::new(IpFamily::V4);
        tx.push(Op::AddTable);
        let mut base = ChainDecl::regular("pre");
        base.base = Some(BaseHook {
            kind: "nat",
            hook: "prerouting",
            priority: -100,
        });
        tx.push(Op::AddChain(base));
        for c in ["a", "b", "c"] {
            tx.push(Op::AddChain(ChainDecl::regular(c)));
        }
        for (chain, rule) in rules {
            tx.push(Op::AddRule {
                chain: chain.to_string(),
                rule: rule.clone(),
            });
        }
        Ruleset::from_transaction(&tx).unwrap()
    }

    fn dnat(to: &str) -> Rule {
        Rule::new(vec![], Statement::Dnat(to.parse().unwrap()))
    }

    fn ctx() -> TraceContext {
        TraceContext {
            local_addresses: vec![NODE_IP.parse().unwrap()],
        }
    }

    #[test]
    fn goto_returns_to_the_caller_and_jump_continues() {
        let rs = table(&[
            ("pre", Rule::verdict(vec![], NftVerdict::Jump("a".into()))),
            ("pre", dnat("10.0.0.9:9")),
            ("a", Rule::verdict(vec![], NftVerdict::Goto("b".into()))),
            ("a", dnat("10.0.0.1:1")),
            ("b", Rule::new(vec![], Statement::MarkSetOr(1))),
            ("b", Rule::verdict(vec![Match::MarkAndZero(1)], NftVerdict::Return)),
            ("b", Rule::verdict(vec![], NftVerdict::Return)),
            ("b", dnat("10.0.0.2:2")),
        ]);
        let t = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap();
        // b returns to pre (a was left by goto), so pre's DNAT runs, not a's nor b's; the
        // mark set in b makes its `mark and 1 == 0 return` not match.
        assert_eq!(t.endpoints, strs(&["10.0.0.9:9"]));
        let chains: Vec<&str> = t.rules.iter().map(|r| r.chain.as_str()).collect();
        assert_eq!(chains, ["pre", "a", "b", "b", "pre"]);
    }

    #[test]
    fn broken_references_loops_and_fan_out_are_errors() {
        let mut rs = table(&[("pre", Rule::verdict(vec![], NftVerdict::Jump("a".into())))]);
        rs.chains.remove("a");
        let err = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert!(
            matches!(&err, TraceError::Nftables { reason, .. } if reason.contains("no such chain a")),
            "{err}"
        );

        let rs = table(&[(
            "pre",
            Rule::verdict(
                vec![Match::Addr {
                    dir: Dir::Daddr,
                    negate: false,
                    spec: AddrSpec::Set("nope".into()),
                }],
                NftVerdict::Drop,
            ),
        )]);
        let err = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert!(err.to_string().contains("no such set or map @nope"), "{err}");

        let rs = table(&[
            ("pre", Rule::verdict(vec![], NftVerdict::Jump("a".into()))),
            ("a", Rule::verdict(vec![], NftVerdict::Jump("b".into()))),
            ("b", Rule::verdict(vec![], NftVerdict::Goto("a".into()))),
        ]);
        let err = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert!(
            matches!(&err, TraceError::Loop { stack, .. } if stack == "pre -> a -> b -> a"),
            "{err:?}"
        );

        // Each jump forks in two (numgen's goto returns from a, back to pre).
        let mut rules = vec![(
            "a",
            Rule::new(vec![], Statement::NumgenVmap(vec!["c".into(), "c".into()])),
        )];
        for _ in 0..20 {
            rules.push(("pre", Rule::verdict(vec![], NftVerdict::Jump("a".into()))));
        }
        let err = trace(&table(&rules), &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert_eq!(err, TraceError::TooManyPaths { limit: MAX_PATHS });

        // The kernel refuses masquerade outside postrouting.
        let rs = table(&[("pre", Rule::new(vec![], Statement::Masquerade))]);
        let err = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert!(err.to_string().contains("cannot NAT"), "{err}");
    }

    #[test]
    fn verdict_maps_look_up_exact_keys() {
        let mut rs = table(&[(
            "pre",
            Rule::new(
                vec![],
                Statement::Vmap {
                    key: VmapKey::DaddrProtoPort,
                    map: "m".into(),
                },
            ),
        )]);
        rs.sets.insert(
            "m".into(),
            Set {
                decl: SetDecl {
                    name: "m".into(),
                    key: KeyType::AddrProtoPort,
                    map: Some(super::super::ast::MapValue::Verdict),
                    timeout_seconds: None,
                    comment: None,
                },
                elements: [(
                    ElemKey::AddrProtoPort("1.2.3.4".parse().unwrap(), Protocol::Tcp, 80),
                    Element {
                        key: ElemKey::AddrProtoPort("1.2.3.4".parse().unwrap(), Protocol::Tcp, 80),
                        value: Some(NftVerdict::Accept.into()),
                        comment: None,
                    },
                )]
                .into(),
            },
        );
        let hit = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap();
        assert_eq!(hit.verdict, Verdict::Accept);
        assert_eq!(hit.rules.len(), 1);
        let miss = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 81, None)).unwrap();
        assert_eq!(miss.verdict, Verdict::Pass);
        assert!(miss.rules.is_empty(), "a lookup without an element is no match");
    }

    #[test]
    fn json_shape_matches_the_iptables_tracer() {
        let t = run(&pkt("192.168.5.5", "172.30.0.41", 80, Some("eth0")));
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["verdict"], "DNAT");
        assert_eq!(json["masquerade"], true);
        assert_eq!(json["rules"][0]["table"], "ip kube-proxy");
        assert_eq!(json["rules"][0]["chain"], "filter-prerouting-pre-dnat");
        assert_eq!(json["paths"][0]["hooks"][1], "nat-prerouting");
        assert!(json.get("from_node").is_none());
    }
}
