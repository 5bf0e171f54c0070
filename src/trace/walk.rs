//! The parts of a packet walk that are the same in every mode: the state of one path
//! ([`PathState`], with what a mode adds in its `mode` field), how a chain traversal ends
//! ([`End`]) and what that makes of the path for its hook ([`AfterHook`]), the depth-first run
//! through a chain's rules ([`run_rules`]), jump nesting ([`nested`]), the bound on forking
//! ([`Forks`]), the sequence of hooks ([`HookOrder`]) and the report of the finished paths
//! ([`report`]).
//!
//! What the rules are, how they match and in which order a mode's hooks come stays with that
//! mode's tracer.

use std::collections::HashSet;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};

use super::{MAX_DEPTH, MAX_PATHS, Packet, Trace, TraceError, TracePath, TracedRule, Verdict};
use crate::model::Protocol;

/// The packet and its history on one path. `R` is how the mode records a matched rule, `M`
/// what it tracks besides (decisions already taken on this path).
#[derive(Clone, Debug)]
pub(crate) struct PathState<'a, R, M> {
    pub(crate) src: IpAddr,
    pub(crate) dst: IpAddr,
    pub(crate) dport: u16,
    pub(crate) protocol: Protocol,
    pub(crate) in_interface: Option<String>,
    pub(crate) mark: u32,
    pub(crate) dnat: Option<SocketAddr>,
    pub(crate) masquerade: bool,
    /// A rule of ours accepted it explicitly.
    pub(crate) accepted: bool,
    pub(crate) rules: Vec<R>,
    pub(crate) choices: Vec<String>,
    pub(crate) hooks: Vec<&'a str>,
    pub(crate) verdict: Verdict,
    pub(crate) mode: M,
}

impl<'a, R, M> PathState<'a, R, M> {
    /// The packet before the first hook: a packet from the node has no input interface.
    pub(crate) fn start(packet: &Packet, from_node: bool, mode: M) -> Self {
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
            rules: Vec::new(),
            choices: Vec::new(),
            hooks: Vec::new(),
            verdict: Verdict::Pass,
            mode,
        }
    }

    /// Local traffic to a local address comes back in through `lo`.
    pub(crate) fn loop_back(&mut self) {
        self.in_interface = Some("lo".to_string());
    }

    /// The packet is DNATed to `to`: later rules see the new destination.
    pub(crate) fn dnat_to(&mut self, to: SocketAddr) {
        self.dst = to.ip();
        self.dport = to.port();
        self.dnat = Some(to);
    }

    /// The path after a hook's chain ended with `end`: stopped there with its verdict, or
    /// going on.
    pub(crate) fn after(mut self, end: End) -> AfterHook<Self> {
        match end {
            End::Drop => {
                self.verdict = Verdict::Drop;
                AfterHook::Stopped(self)
            }
            End::Reject => {
                self.verdict = Verdict::Reject;
                AfterHook::Stopped(self)
            }
            End::Fall | End::Accept => AfterHook::GoesOn(self),
        }
    }
}

/// How a chain traversal ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// Fell off the end or returned.
    Fall,
    /// Accepted, DNATed or masqueraded: the hook (in nftables, the base chain) is done with
    /// the packet.
    Accept,
    Drop,
    Reject,
}

/// A path after one hook.
pub(crate) enum AfterHook<P> {
    /// Dropped or rejected there; its verdict is set.
    Stopped(P),
    /// Goes on to the next hook.
    GoesOn(P),
}

/// Where a path goes after a rule: to rule `n` of the same chain, or out of the chain.
pub(crate) enum Work<P> {
    At(usize, P),
    Done(P, End),
}

impl<P> Work<P> {
    /// The paths back from a chain that rule `n` jumped to: one that fell off its end (or
    /// returned) goes on at rule `n + 1`, the others are done with the calling chain too.
    pub(crate) fn after_jump(returned: Vec<(P, End)>, n: usize) -> impl Iterator<Item = Work<P>> {
        returned.into_iter().map(move |(s, end)| match end {
            End::Fall => Work::At(n + 1, s),
            _ => Work::Done(s, end),
        })
    }

    /// The paths back from a chain gone to (goto): falling off its end (or returning from it)
    /// returns from the calling chain, so every one is done with it.
    pub(crate) fn after_goto(returned: Vec<(P, End)>) -> impl Iterator<Item = Work<P>> {
        returned.into_iter().map(|(s, end)| Work::Done(s, end))
    }
}

/// Runs one path through a chain's `rules` and returns every resulting path with how it left
/// the chain, depth first in rule order. `eval(n, rule, path)` evaluates rule `n` for one path
/// and says where each path it leads to goes; past the last rule a path falls off the end.
pub(crate) fn run_rules<'r, T, P>(
    rules: &'r [T],
    start: P,
    mut eval: impl FnMut(usize, &'r T, P) -> Result<Vec<Work<P>>, TraceError>,
) -> Result<Vec<(P, End)>, TraceError> {
    let mut out = Vec::new();
    // A stack of work items, pushed in reverse so paths come out depth-first in rule order.
    let mut work = vec![Work::At(0, start)];
    while let Some(item) = work.pop() {
        match item {
            Work::Done(s, end) => out.push((s, end)),
            Work::At(n, s) => match rules.get(n) {
                Some(rule) => work.extend(eval(n, rule, s)?.into_iter().rev()),
                None => out.push((s, End::Fall)),
            },
        }
    }
    Ok(out)
}

/// Runs `run` inside `chain` of `table`. `stack` holds the chains the path is already in,
/// outermost first: entering one of them again, or nesting deeper than [`MAX_DEPTH`], is a
/// jump loop (which the kernel refuses too); `name` says how the error names a chain.
pub(crate) fn nested<'n, C: Copy + PartialEq, T>(
    stack: &mut Vec<C>,
    chain: C,
    table: &str,
    name: impl Fn(C) -> &'n str,
    run: impl FnOnce(&mut Vec<C>) -> Result<T, TraceError>,
) -> Result<T, TraceError> {
    if stack.contains(&chain) || stack.len() >= MAX_DEPTH {
        let names: Vec<&str> = stack.iter().copied().chain([chain]).map(name).collect();
        return Err(TraceError::Loop {
            table: table.to_string(),
            stack: names.join(" -> "),
        });
    }
    stack.push(chain);
    let result = run(stack);
    stack.pop();
    result
}

/// The number of paths a walk has created so far, at most [`MAX_PATHS`].
#[derive(Debug)]
pub(crate) struct Forks(usize);

impl Forks {
    /// A walk starts with one path.
    pub(crate) fn new() -> Forks {
        Forks(1)
    }

    /// Counts the `extra` paths a fork adds (its branches beyond the first).
    pub(crate) fn add(&mut self, extra: usize) -> Result<(), TraceError> {
        self.0 += extra;
        if self.0 > MAX_PATHS {
            return Err(TraceError::TooManyPaths { limit: MAX_PATHS });
        }
        Ok(())
    }
}

/// The paths one stage of a walk leaves, in order.
pub(crate) type AfterStage<'a, R, M> = Vec<AfterHook<PathState<'a, R, M>>>;

/// A mode's sequence of hooks: what each stage does to a path and which stage comes next.
pub(crate) trait HookOrder<'a, R, M> {
    type Stage: Copy;

    /// Runs `stage` for one path: each resulting path, stopped there or going on.
    fn run_stage(&mut self, stage: Self::Stage, path: PathState<'a, R, M>) -> Result<AfterStage<'a, R, M>, TraceError>;

    /// The stage after `stage` for a path that goes on, or `None` when the packet is delivered
    /// or sent; it may change the path on the way (a packet looped back in through `lo`).
    fn next_stage(&self, stage: Self::Stage, path: &mut PathState<'a, R, M>) -> Option<Self::Stage>;

    /// Evaluates `stage` and every later one for one path, pushing finished paths to `out`.
    fn walk(
        &mut self,
        stage: Self::Stage,
        path: PathState<'a, R, M>,
        out: &mut Vec<PathState<'a, R, M>>,
    ) -> Result<(), TraceError> {
        for after in self.run_stage(stage, path)? {
            let mut s = match after {
                AfterHook::Stopped(s) => {
                    out.push(s);
                    continue;
                }
                AfterHook::GoesOn(s) => s,
            };
            match self.next_stage(stage, &mut s) {
                Some(next) => self.walk(next, s, out)?,
                None => {
                    s.verdict = Verdict::after_all_hooks(s.dnat.is_some(), s.accepted);
                    out.push(s);
                }
            }
        }
        Ok(())
    }
}

/// The report of a walk's finished paths, in order; `traced(rule, n)` is how a matched rule
/// of path `n` is reported.
pub(crate) fn report<R: Clone + Eq + Hash, M>(
    mut finished: Vec<PathState<'_, R, M>>,
    from_node: bool,
    mut traced: impl FnMut(&R, usize) -> TracedRule,
) -> Trace {
    // Identical rule sequences to the same destination are the same path reached twice; keep
    // the first. (One rule can lead to several destinations: nftables' `dnat to numgen … map`.)
    let mut seen = HashSet::new();
    finished.retain(|p| seen.insert((p.rules.clone(), p.dnat)));

    let mut rules = Vec::new();
    let mut paths = Vec::new();
    for (index, p) in finished.into_iter().enumerate() {
        rules.extend(p.rules.iter().map(|r| traced(r, index)));
        paths.push(TracePath {
            verdict: p.verdict,
            endpoint: p.dnat.map(|a| a.to_string()),
            // A rejected or dropped packet never leaves through postrouting, whichever order
            // the walk visited the hooks in: it is not masqueraded.
            masquerade: p.masquerade && !matches!(p.verdict, Verdict::Reject | Verdict::Drop),
            choices: p.choices,
            hooks: p.hooks.iter().map(|h| h.to_string()).collect(),
        });
    }
    Trace::from_paths(rules, paths, from_node)
}
