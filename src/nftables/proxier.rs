//! The nftables proxier: keeps one family's `kube-proxy` table equal to the model by sending
//! only what changed, as one atomic transaction per sync.
//!
//! It never lists the table: what it programmed is known from the service ports it synced
//! last (re-rendered on demand, so memory stays at one `ServicePortState` per port) and from
//! the owners of each set/map element (a ClusterIP in `cluster-ips` may belong to several
//! ports). A sync renders only changed ports, rewrites only chains whose rules changed, adds
//! and deletes only the elements that changed, flushes chains it stopped using and deletes
//! them at least a second later (as upstream does: a flushed chain can still be referenced
//! by rules the kernel has not released yet).
//!
//! A full sync (start, a failed transaction, a changed node/options, the table gone) deletes
//! and rebuilds the table in bounded transactions, the `kubernetes` Service and cluster DNS
//! in the first one: one huge transaction is quadratic in the kernel (see FLOOR.md) and
//! would hold the nftables mutex for minutes at 40k Services.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ast::{ElemKey, Element, Op, Rule, SetDecl, Transaction, family_keyword};
use super::names::TABLE;
use super::netlink::ReadScope;
use super::netlink::decode::Undecoded;
use super::readback;
use super::render::ServiceRenderer;
use super::ruleset::Ruleset;
use crate::config::ProxyMode;
use crate::exec;
use crate::model::{IpFamily, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState};
use crate::proxy::{Programmed, Proxier, ReadBackError, RenderOptions, SyncContext, SyncError, SyncReport};

/// Chains flushed by a sync are deleted by the first sync at least this much later.
pub const STALE_CHAIN_DELAY: Duration = Duration::from_secs(1);

/// A full sync sends at most about this many commands per transaction (a few hundred
/// service ports of 10 endpoints; see the benchmark for the choice).
pub const MAX_OPS_PER_TRANSACTION: usize = 20_000;

/// Services programmed in the first transaction of a full sync: without them nothing in the
/// cluster resolves names or reaches the API server.
pub const PRIORITY_SERVICES: [(&str, &str); 3] = [
    ("default", "kubernetes"),
    ("kube-system", "kube-dns"),
    ("kube-system", "coredns"),
];

/// A transaction the kernel (or `nft`) refused; nothing of it was applied.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NftError(pub String);

/// Where transactions go: `nft -f -`, netlink, or a recording fake.
pub trait NftBackend: Send {
    /// Applies `tx` atomically (an empty transaction is a no-op).
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError>;
    /// Whether the family's `kube-proxy` table exists.
    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError>;
    /// The family's table as the kernel holds it, read back over netlink (whole, or some
    /// chains and maps): the model and the rules that are not of kube-proxy's shapes; `None`
    /// when the table does not exist.
    fn read(&mut self, family: IpFamily, scope: &ReadScope) -> Result<Option<ReadTable>, NftError> {
        let mut socket = super::netlink::NftSocket::new().map_err(|e| NftError(format!("opening netlink: {e}")))?;
        NftBackend::read(&mut socket, family, scope)
    }
}

/// A table read back: its model, and the rules it holds that kube-proxy did not write.
pub type ReadTable = (Ruleset, Vec<Undecoded>);

/// The `nft` command: each transaction is piped to `nft -f -`.
#[derive(Debug, Default)]
pub struct NftCommand;

impl NftBackend for NftCommand {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        if tx.is_empty() {
            return Ok(());
        }
        nft_apply(&tx.text())
    }

    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        // `list tables` prints names only; `list table` would print every rule (seconds at
        // 10k Services).
        let out = nft(&["list", "tables", family_keyword(family)], None, |status, _| {
            format!("nft list tables exited with {status}")
        })?;
        let wanted = format!("table {} {TABLE}", family_keyword(family));
        Ok(out.lines().any(|l| l.trim() == wanted))
    }
}

/// What a [`RecordingBackend`] saw: the transactions applied, and the tables they built.
#[derive(Debug, Default)]
pub struct Recorded {
    pub applied: Vec<Transaction>,
    pub tables: HashMap<IpFamily, Ruleset>,
    /// Makes the next apply fail (nothing applied).
    pub fail_next: bool,
}

impl NftBackend for super::netlink::NftSocket {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        super::netlink::NftSocket::apply(self, tx).map_err(|e| NftError(e.to_string()))
    }

    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        super::netlink::NftSocket::table_exists(self, family).map_err(|e| NftError(format!("listing tables: {e}")))
    }

    fn read(&mut self, family: IpFamily, scope: &ReadScope) -> Result<Option<ReadTable>, NftError> {
        super::netlink::NftSocket::read(self, family, scope)
            .map_err(|e| NftError(format!("reading the {} {TABLE} table: {e}", family_keyword(family))))
    }
}

/// A backend that records transactions and applies them to a model of the kernel's table,
/// refusing what the kernel would refuse. Clones share the record.
#[derive(Clone, Debug, Default)]
pub struct RecordingBackend(Arc<Mutex<Recorded>>);

impl RecordingBackend {
    pub fn recorded(&self) -> MutexGuard<'_, Recorded> {
        // A panicking test thread must not hide the record from the others.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl NftBackend for RecordingBackend {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        let mut r = self.recorded();
        if std::mem::take(&mut r.fail_next) {
            return Err(NftError("injected failure".into()));
        }
        let mut table = r
            .tables
            .get(&tx.family)
            .cloned()
            .unwrap_or_else(|| Ruleset::new(tx.family));
        table.apply_all(&tx.ops).map_err(|e| NftError(e.to_string()))?;
        r.tables.insert(tx.family, table);
        r.applied.push(tx.clone());
        Ok(())
    }

    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        Ok(self.recorded().tables.get(&family).is_some_and(|t| t.exists))
    }

    /// The recorded table (every rule is one of ours).
    fn read(&mut self, family: IpFamily, _scope: &ReadScope) -> Result<Option<ReadTable>, NftError> {
        let r = self.recorded();
        Ok(r.tables
            .get(&family)
            .filter(|t| t.exists)
            .map(|t| (t.clone(), Vec::new())))
    }
}

/// Runs `nft -f -` with `input` on stdin.
pub fn nft_apply(input: &str) -> Result<(), NftError> {
    nft(&["-f", "-"], Some(input), |_, stderr| {
        format!("nft -f - failed: {stderr}")
    })
    .map(drop)
}

/// Runs `nft ARGS` and returns its stdout; `failed` says what its exit status and stderr mean.
fn nft(
    args: &[&str],
    stdin: Option<&str>,
    failed: impl FnOnce(std::process::ExitStatus, &str) -> String,
) -> Result<String, NftError> {
    exec::run("nft", args, stdin).map_err(|e| match e {
        exec::Error::Spawn { source, .. } => NftError(format!("running nft: {source}")),
        exec::Error::Failed { status, stderr, .. } => NftError(failed(status, &stderr)),
    })
}

/// Whether the family's table exists (our canary: someone may delete it). Asked over netlink
/// (one message); `nft list tables` fetches every rule of every table first, seconds beside
/// iptables mode's rules at 10k Services.
pub fn table_exists(family: IpFamily) -> bool {
    match super::netlink::NftSocket::new().and_then(|mut s| s.table_exists(family)) {
        Ok(exists) => exists,
        Err(_) => NftCommand.table_exists(family).unwrap_or(false),
    }
}

/// Deletes the family's table if it exists (cleanup, and switching to another mode).
pub fn delete_table(family: IpFamily) -> Result<(), NftError> {
    let f = family_keyword(family);
    nft_apply(&format!("add table {f} {TABLE}\ndelete table {f} {TABLE}\n"))
}

/// One service port's objects, from its rendered commands.
#[derive(Default)]
struct ServiceObjects {
    /// Chains in creation order, with their rules.
    chains: Vec<(String, Vec<Rule>)>,
    sets: Vec<SetDecl>,
    elements: Vec<(String, Element)>,
}

impl ServiceObjects {
    fn from_ops(ops: Vec<Op>) -> ServiceObjects {
        let mut objs = ServiceObjects::default();
        let mut index: HashMap<String, usize> = HashMap::new();
        for op in ops {
            match op {
                Op::AddChain(decl) => {
                    index.entry(decl.name.clone()).or_insert_with(|| {
                        objs.chains.push((decl.name, Vec::new()));
                        objs.chains.len() - 1
                    });
                }
                Op::FlushChain(name) => {
                    if let Some(&i) = index.get(&name) {
                        objs.chains[i].1.clear();
                    }
                }
                Op::AddRule { chain, rule } => {
                    if let Some(&i) = index.get(&chain) {
                        objs.chains[i].1.push(rule);
                    }
                }
                Op::AddSet(decl) => objs.sets.push(decl),
                Op::AddElement { set, element } => {
                    objs.elements.retain(|(s, e)| !(*s == set && e.key == element.key));
                    objs.elements.push((set, element));
                }
                Op::DeleteElement { set, key } => objs.elements.retain(|(s, e)| !(*s == set && e.key == key)),
                // A service port's rendering never touches tables or deletes its own objects.
                Op::AddTable | Op::DeleteTable | Op::DeleteChain(_) | Op::FlushSet { .. } | Op::DeleteSet { .. } => {}
            }
        }
        objs
    }
}

/// What the kernel holds after the last successful transaction.
struct Applied {
    renderer: ServiceRenderer,
    services: HashMap<ServicePortName, Arc<ServicePortState>>,
    /// Every element owned by a service port, with its owners (the last one by name wins,
    /// as in a full render where later ports overwrite earlier ones).
    elements: HashMap<(String, ElemKey), Owners>,
    /// Flushed chains waiting to be deleted, with the time they were flushed.
    stale_chains: BTreeMap<String, Instant>,
}

/// The service ports that put one element into a set, sorted by name, with the element each
/// wants. Almost always one: a sorted `Vec` costs a fraction of a `BTreeMap`'s node, and an
/// owner is the (shared) state of its port rather than a copy of its name, which matters at
/// 10^5 elements.
#[derive(Default)]
struct Owners(Vec<(Arc<ServicePortState>, Element)>);

impl Owners {
    fn find(&self, owner: &ServicePortName) -> Result<usize, usize> {
        self.0.binary_search_by(|(o, _)| o.port.name.cmp(owner))
    }

    fn insert(&mut self, owner: &Arc<ServicePortState>, element: Element) {
        match self.find(&owner.port.name) {
            Ok(i) => self.0[i] = (owner.clone(), element),
            Err(i) => {
                // Exactly one slot for the usual single owner (`push` would reserve four).
                self.0.reserve_exact(1);
                self.0.insert(i, (owner.clone(), element));
            }
        }
    }

    fn remove(&mut self, owner: &ServicePortName) {
        if let Ok(i) = self.find(owner) {
            self.0.remove(i);
        }
    }

    /// The element in effect: the last owner's by name (as in a full render, where later
    /// ports overwrite earlier ones).
    fn effective(&self) -> Option<&Element> {
        self.0.last().map(|(_, e)| e)
    }
}

/// The commands of one transaction, in the order the kernel needs them.
#[derive(Default)]
struct Plan {
    new_sets: Vec<Op>,
    new_chains: Vec<Op>,
    chain_rules: Vec<Op>,
    /// (set, key) → effective element before this transaction.
    touched: BTreeMap<(String, ElemKey), Option<Element>>,
    stale_flushes: Vec<Op>,
    set_deletes: Vec<Op>,
    rewritten: usize,
    udp_endpoints_removed: bool,
}

pub struct NftProxier {
    family: IpFamily,
    opts: RenderOptions,
    backend: Box<dyn NftBackend>,
    applied: Option<Applied>,
    /// Whether the last sync attempted rebuilt the table.
    last_attempt_full: bool,
    max_ops: usize,
    stale_delay: Duration,
}

impl NftProxier {
    /// A proxier that programs the kernel through `nft -f -` (slower: `nft` lists every
    /// chain before each transaction; tests and comparisons).
    pub fn new(family: IpFamily, opts: RenderOptions) -> NftProxier {
        NftProxier::with_backend(family, opts, Box::new(NftCommand))
    }

    /// A proxier that programs the kernel over netlink (see [`super::netlink`] for why not
    /// `nft -f`), in the calling thread's network namespace. What the daemon uses.
    pub fn netlink(family: IpFamily, opts: RenderOptions) -> Result<NftProxier, NftError> {
        let socket = super::netlink::NftSocket::new()
            .map_err(|e| NftError(format!("opening the nftables netlink socket: {e}")))?;
        Ok(NftProxier::with_backend(family, opts, Box::new(socket)))
    }

    pub fn with_backend(family: IpFamily, opts: RenderOptions, backend: Box<dyn NftBackend>) -> NftProxier {
        NftProxier {
            family,
            opts,
            backend,
            applied: None,
            last_attempt_full: false,
            max_ops: MAX_OPS_PER_TRANSACTION,
            stale_delay: STALE_CHAIN_DELAY,
        }
    }

    /// Bounds the size of full-sync transactions (tests and benchmarks).
    pub fn set_max_ops_per_transaction(&mut self, max_ops: usize) {
        self.max_ops = max_ops.max(1);
    }

    /// How long flushed chains wait before they are deleted (tests).
    pub fn set_stale_chain_delay(&mut self, delay: Duration) {
        self.stale_delay = delay;
    }

    pub fn backend(&mut self) -> &mut dyn NftBackend {
        self.backend.as_mut()
    }

    pub fn set_options(&mut self, opts: RenderOptions) {
        if opts != self.opts {
            self.opts = opts;
            self.applied = None;
        }
    }

    pub fn force_full_sync(&mut self) {
        self.applied = None;
    }

    /// Whether our table is still there.
    pub fn table_exists(&mut self) -> bool {
        self.backend.table_exists(self.family).unwrap_or(false)
    }

    /// When a sync is due to delete flushed chains, if any wait.
    pub fn next_cleanup(&self) -> Option<Instant> {
        let applied = self.applied.as_ref()?;
        applied.stale_chains.values().min().map(|t| *t + self.stale_delay)
    }

    /// Brings the table in line with `state` (which must be of this proxier's family).
    pub fn sync(&mut self, state: &ProxyState) -> Result<SyncReport, NftError> {
        let start = Instant::now();
        let renderer = ServiceRenderer::new(state, &self.opts);
        let incremental = self.applied.as_ref().is_some_and(|a| a.renderer == renderer);
        self.last_attempt_full = !incremental;
        let result = if incremental {
            self.send_changes(state)
        } else {
            self.rebuild(state, renderer)
        };
        crate::proxy::finish_sync(start, result, || self.applied = None)
    }

    /// Deletes and rebuilds the table in bounded transactions, priority services first.
    fn rebuild(&mut self, state: &ProxyState, renderer: ServiceRenderer) -> Result<SyncReport, NftError> {
        self.applied = None;
        let mut applied = Applied {
            renderer,
            services: HashMap::new(),
            elements: HashMap::new(),
            stale_chains: BTreeMap::new(),
        };
        let mut order: Vec<&Arc<ServicePortState>> = state.service_ports.iter().collect();
        // Stable: the rest keeps the model's order.
        order.sort_by_key(|s| !is_priority(&s.port.name));

        let mut tx = Transaction::new(self.family);
        tx.push(Op::AddTable);
        tx.push(Op::DeleteTable);
        tx.ops.extend(applied.renderer.setup(false).ops);
        let mut bytes = 0;
        let mut rest = order.as_slice();
        loop {
            let mut plan = Plan::default();
            let mut ops = tx.ops.len();
            while let Some((sps, tail)) = rest.split_first() {
                let objs = ServiceObjects::from_ops(applied.renderer.service(sps).ops);
                ops +=
                    objs.chains.iter().map(|(_, r)| r.len() + 2).sum::<usize>() + objs.elements.len() + objs.sets.len();
                plan_service(&mut plan, &mut applied, sps, None, Some(objs));
                applied.services.insert(sps.port.name.clone(), (*sps).clone());
                rest = tail;
                // The priority services go together, whatever the bound.
                if ops >= self.max_ops && rest.first().is_none_or(|n| !is_priority(&n.port.name)) {
                    break;
                }
            }
            finish_plan(&mut tx, plan, &mut applied, Instant::now());
            bytes += tx.ops.len();
            self.backend.apply(&tx)?;
            if rest.is_empty() {
                break;
            }
            tx = Transaction::new(self.family);
        }
        let services = applied.services.len();
        self.applied = Some(applied);
        Ok(SyncReport {
            full: true,
            rewritten_services: services,
            operations: bytes,
            udp_endpoints_removed: true,
            ..SyncReport::default()
        })
    }

    /// Sends what changed since the last sync.
    fn send_changes(&mut self, state: &ProxyState) -> Result<SyncReport, NftError> {
        let stale_delay = self.stale_delay;
        let Some(applied) = self.applied.as_mut() else {
            return Err(NftError("no programmed table to update".into()));
        };
        let now = Instant::now();
        let mut plan = Plan::default();
        // Ports still present that were programmed before; when that is all of them, nothing
        // was removed and the (per-sync, 40k-entry) search for removed ports is skipped.
        let mut kept = 0usize;
        for sps in &state.service_ports {
            let name = &sps.port.name;
            let old = applied.services.get(name);
            if old.is_some() {
                kept += 1;
            }
            if old == Some(sps) {
                continue;
            }
            let was_new = old.is_none();
            let old_objs = old.map(|o| ServiceObjects::from_ops(applied.renderer.service(o).ops));
            if let Some(o) = old {
                plan.udp_endpoints_removed |= o.loses_udp_endpoints_to(sps);
            }
            let new_objs = ServiceObjects::from_ops(applied.renderer.service(sps).ops);
            plan_service(&mut plan, applied, sps, old_objs, Some(new_objs));
            if was_new {
                // Counted as kept from now on: it is in `applied.services` below.
                kept += 1;
            }
            applied.services.insert(name.clone(), sps.clone());
        }
        if kept < applied.services.len() {
            let present: HashSet<&ServicePortName> = state.service_ports.iter().map(|s| &s.port.name).collect();
            let gone: Vec<ServicePortName> = applied
                .services
                .keys()
                .filter(|n| !present.contains(n))
                .cloned()
                .collect();
            for name in gone {
                if let Some(old) = applied.services.remove(&name) {
                    plan.udp_endpoints_removed |= old.port.protocol == Protocol::Udp;
                    let old_objs = ServiceObjects::from_ops(applied.renderer.service(&old).ops);
                    plan_service(&mut plan, applied, &old, Some(old_objs), None);
                }
            }
        }
        // Chains flushed long enough ago (and not used again) can go now.
        let due: Vec<String> = applied
            .stale_chains
            .iter()
            .filter(|(_, t)| now.duration_since(**t) >= stale_delay)
            .map(|(c, _)| c.clone())
            .collect();
        let rewritten = plan.rewritten;
        let udp = plan.udp_endpoints_removed;
        let mut tx = Transaction::new(self.family);
        let flushed_before = applied.stale_chains.len();
        finish_plan(&mut tx, plan, applied, now);
        let newly_stale = applied.stale_chains.len().saturating_sub(flushed_before);
        for c in &due {
            // Still stale (not revived by this transaction)?
            if applied
                .stale_chains
                .get(c)
                .is_some_and(|t| now.duration_since(*t) >= stale_delay)
            {
                tx.push(Op::DeleteChain(c.clone()));
                applied.stale_chains.remove(c);
            }
        }
        let deleted = tx.ops.iter().filter(|o| matches!(o, Op::DeleteChain(_))).count();
        let size = tx.ops.len();
        self.backend.apply(&tx)?;
        Ok(SyncReport {
            full: false,
            rewritten_services: rewritten,
            removed_objects: deleted + newly_stale,
            operations: size,
            udp_endpoints_removed: udp,
            ..SyncReport::default()
        })
    }
}

fn is_priority(name: &ServicePortName) -> bool {
    PRIORITY_SERVICES
        .iter()
        .any(|(ns, n)| name.namespace == *ns && name.name == *n)
}

/// Adds to `plan` the commands that turn one service port's `old` objects into `new` ones,
/// and records its element ownership in `applied`.
fn plan_service(
    plan: &mut Plan,
    applied: &mut Applied,
    owner: &Arc<ServicePortState>,
    old: Option<ServiceObjects>,
    new: Option<ServiceObjects>,
) {
    plan.rewritten += 1;
    let old = old.unwrap_or_default();
    let new = new.unwrap_or_default();
    let old_chains: HashMap<&str, &Vec<Rule>> = old.chains.iter().map(|(n, r)| (n.as_str(), r)).collect();
    let new_names: HashSet<&str> = new.chains.iter().map(|(n, _)| n.as_str()).collect();

    for decl in &new.sets {
        if !old.sets.iter().any(|s| s.name == decl.name) {
            plan.new_sets.push(Op::AddSet(decl.clone()));
        }
    }
    for (name, rules) in &new.chains {
        let revived = applied.stale_chains.remove(name).is_some();
        match old_chains.get(name.as_str()) {
            Some(old_rules) if *old_rules == rules && !revived => continue,
            Some(_) => plan.chain_rules.push(Op::FlushChain(name.clone())),
            // A revived chain was flushed when it went stale; `add chain` is a no-op then.
            None => plan
                .new_chains
                .push(Op::AddChain(super::ast::ChainDecl::regular(name.clone()))),
        }
        for rule in rules {
            plan.chain_rules.push(Op::AddRule {
                chain: name.clone(),
                rule: rule.clone(),
            });
        }
    }
    for (name, _) in &old.chains {
        if !new_names.contains(name.as_str()) {
            plan.stale_flushes.push(Op::FlushChain(name.clone()));
        }
    }
    for decl in &old.sets {
        if !new.sets.iter().any(|s| s.name == decl.name) {
            plan.set_deletes.push(Op::DeleteSet {
                name: decl.name.clone(),
                map: decl.map,
            });
        }
    }

    for (set, element) in old.elements {
        let k = (set, element.key);
        remember_effective(plan, applied, &k);
        if let Some(owners) = applied.elements.get_mut(&k) {
            owners.remove(&owner.port.name);
            if owners.0.is_empty() {
                applied.elements.remove(&k);
            }
        }
    }
    for (set, element) in new.elements {
        let k = (set, element.key.clone());
        remember_effective(plan, applied, &k);
        applied.elements.entry(k).or_default().insert(owner, element);
    }
}

fn effective(applied: &Applied, k: &(String, ElemKey)) -> Option<Element> {
    applied.elements.get(k).and_then(|owners| owners.effective().cloned())
}

fn remember_effective(plan: &mut Plan, applied: &Applied, k: &(String, ElemKey)) {
    if !plan.touched.contains_key(k) {
        plan.touched.insert(k.clone(), effective(applied, k));
    }
}

/// Appends the plan's commands to `tx` in an order the kernel accepts: sets and chains
/// first (rules and elements refer to them), rules, element changes, then the flushes and
/// deletes of what is no longer referenced.
fn finish_plan(tx: &mut Transaction, plan: Plan, applied: &mut Applied, now: Instant) {
    tx.ops.extend(plan.new_sets);
    tx.ops.extend(plan.new_chains);
    tx.ops.extend(plan.chain_rules);
    let mut adds = Vec::new();
    for (k, before) in plan.touched {
        let after = effective(applied, &k);
        if before == after {
            continue;
        }
        let (set, key) = k;
        if before.is_some() {
            tx.push(Op::DeleteElement {
                set: set.clone(),
                key: key.clone(),
            });
        }
        if let Some(element) = after {
            adds.push(Op::AddElement { set, element });
        }
    }
    tx.ops.extend(adds);
    for op in &plan.stale_flushes {
        if let Op::FlushChain(name) = op {
            applied.stale_chains.insert(name.clone(), now);
        }
    }
    tx.ops.extend(plan.stale_flushes);
    tx.ops.extend(plan.set_deletes);
}

// === impl proxy::Proxier ===

impl Proxier for NftProxier {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn family(&self) -> IpFamily {
        self.family
    }

    fn configure(&mut self, ctx: &SyncContext<'_>) {
        self.set_options(RenderOptions::from_config(ctx.config, self.family, ctx.node));
    }

    fn sync_full(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        self.force_full_sync();
        self.sync_changes(state)
    }

    fn sync_changes(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        self.sync(state).map_err(|e| SyncError::new(self.last_attempt_full, e))
    }

    fn intact(&mut self) -> bool {
        self.table_exists()
    }

    fn next_cleanup(&self) -> Option<Instant> {
        NftProxier::next_cleanup(self)
    }

    fn cleanup(&mut self) -> Vec<String> {
        self.applied = None;
        let mut tx = Transaction::new(self.family);
        // add + delete: deleting a table that is not there would be an error.
        tx.push(Op::AddTable);
        tx.push(Op::DeleteTable);
        match self.backend.apply(&tx) {
            Ok(()) => Vec::new(),
            Err(e) => vec![format!(
                "deleting the {} {TABLE} table: {e}",
                family_keyword(self.family)
            )],
        }
    }

    fn read_back(&mut self, port: &ServicePort) -> Result<Programmed, ReadBackError> {
        let err = |e: NftError| ReadBackError {
            what: port.name.to_string(),
            message: e.to_string(),
        };
        // The port's own chains and maps first, then the endpoint chains they lead to.
        let maps: Vec<String> = readback::DISPATCH_MAPS.iter().map(|m| m.to_string()).collect();
        let scope = ReadScope::Some {
            chains: readback::own_chains(port),
            maps: maps.clone(),
        };
        let Some((first, mut foreign)) = self.backend.read(self.family, &scope).map_err(err)? else {
            return Ok(Programmed::default());
        };
        let endpoints: Vec<String> = readback::sections(&first, port)
            .iter()
            .flat_map(|s| s.lines.iter())
            .flat_map(|l| readback::endpoint_chains(std::slice::from_ref(l)))
            .collect();
        let mut table = first;
        if !endpoints.is_empty() {
            let scope = ReadScope::Some {
                chains: endpoints,
                maps: Vec::new(),
            };
            if let Some((more, f)) = self.backend.read(self.family, &scope).map_err(err)? {
                table.chains.extend(more.chains);
                foreign.extend(f);
            }
        }
        Ok(programmed(&table, &foreign, port))
    }

    fn read_back_all(&mut self, ports: &[&ServicePort]) -> Result<Vec<Programmed>, ReadBackError> {
        let table = self
            .backend
            .read(self.family, &ReadScope::Whole)
            .map_err(|e| ReadBackError {
                what: format!("the {} {TABLE} table", family_keyword(self.family)),
                message: e.to_string(),
            })?;
        Ok(match table {
            Some((table, foreign)) => ports.iter().map(|p| programmed(&table, &foreign, p)).collect(),
            None => vec![Programmed::default(); ports.len()],
        })
    }
}

/// The port's sections of a table read back, with the rules of its chains that kube-proxy
/// did not write (as their expressions).
fn programmed(table: &Ruleset, foreign: &[Undecoded], port: &ServicePort) -> Programmed {
    let mut sections = readback::sections(table, port);
    for s in &mut sections {
        let chain = s.place.rsplit(' ').next().unwrap_or_default();
        for u in foreign.iter().filter(|u| u.chain == chain) {
            s.lines.push(format!("<not written by kube-proxy: {}>", u.exprs));
        }
    }
    Programmed { sections }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::model::Endpoint;
    use crate::nftables::render::render_tx;

    use crate::model::testing::port;

    fn state(ports: Vec<ServicePortState>) -> ProxyState {
        crate::model::testing::state(ports, &["10.96.0.0/16"])
    }

    fn proxier() -> (NftProxier, RecordingBackend) {
        let rec = RecordingBackend::default();
        let p = NftProxier::with_backend(IpFamily::V4, RenderOptions::default(), Box::new(rec.clone()));
        (p, rec)
    }

    /// The table a full render of `st` builds in an empty namespace.
    fn expected(st: &ProxyState) -> Ruleset {
        Ruleset::from_transaction(&render_tx(st, &RenderOptions::default(), true)).unwrap()
    }

    fn table(rec: &RecordingBackend) -> Ruleset {
        rec.recorded().tables[&IpFamily::V4].clone()
    }

    /// The table without chains that are empty and unreferenced (flushed, awaiting deletion).
    fn without_flushed(mut r: Ruleset) -> Ruleset {
        let referenced: HashSet<String> = r
            .chains
            .values()
            .flat_map(|c| c.rules.iter().flat_map(|r| r.targets()).map(str::to_string))
            .chain(r.sets.values().flat_map(|s| {
                s.elements
                    .values()
                    .filter_map(|e| e.value.as_ref()?.chain().map(str::to_string))
            }))
            .collect();
        r.chains
            .retain(|name, c| !c.rules.is_empty() || referenced.contains(name) || c.decl.base.is_some());
        r
    }

    #[test]
    fn read_back_gives_each_ports_chains_and_elements() {
        let (mut p, _rec) = proxier();
        let st = state(vec![
            port("ns", "a", 1, Protocol::Tcp, &[1, 2]),
            port("ns", "b", 2, Protocol::Udp, &[3]),
        ]);
        Proxier::sync_full(&mut p, &st).expect("syncs");
        let a = &st.service_ports[0].port;
        let one = p.read_back(a).expect("reads");
        let text: Vec<&String> = one.sections.iter().flat_map(|s| &s.lines).collect();
        assert!(text.iter().any(|l| l.contains("dnat to 10.244.1.2:8080")), "{text:#?}");
        assert!(
            text.iter()
                .any(|l| l.starts_with("10.96.0.1 . tcp . 80 : goto service-")),
            "{text:#?}"
        );
        assert!(!text.iter().any(|l| l.contains("10.244.1.3")), "not b's: {text:#?}");
        let all = p.read_back_all(&[a, &st.service_ports[1].port]).expect("reads");
        assert_eq!(all[0], one, "one at a time or all at once, the same");
        assert!(
            all[1]
                .sections
                .iter()
                .flat_map(|s| &s.lines)
                .any(|l| l.contains("10.244.1.3:8080"))
        );
    }

    #[test]
    fn full_sync_builds_what_a_full_render_builds_in_bounded_transactions() {
        let (mut p, rec) = proxier();
        p.set_max_ops_per_transaction(10);
        let mut ports: Vec<ServicePortState> = (1..=6)
            .map(|i| port("ns", &format!("s{i}"), i, Protocol::Tcp, &[1, 2]))
            .collect();
        ports.push(port("default", "kubernetes", 1, Protocol::Tcp, &[9]));
        ports.push(port("kube-system", "kube-dns", 10, Protocol::Udp, &[]));
        let st = state(ports);
        let report = p.sync(&st).unwrap();
        assert!(report.full);
        assert_eq!(table(&rec), expected(&st));
        let r = rec.recorded();
        assert!(r.applied.len() > 2, "{} transactions", r.applied.len());
        // The first transaction resets the table and programs the priority services.
        let first = r.applied[0].text();
        assert!(first.starts_with("add table ip kube-proxy"));
        assert!(first.contains("delete table ip kube-proxy"));
        assert!(first.contains("default/kubernetes"), "{first}");
        assert!(first.contains("kube-system/kube-dns"), "{first}");
        assert!(!first.contains("ns/s6"));
    }

    #[test]
    fn unchanged_state_sends_nothing_and_changes_send_only_their_objects() {
        let (mut p, rec) = proxier();
        let a = port("ns", "a", 1, Protocol::Tcp, &[1, 2]);
        let b = port("ns", "b", 2, Protocol::Tcp, &[3]);
        p.sync(&state(vec![a.clone(), b.clone()])).unwrap();
        let n = rec.recorded().applied.len();
        let report = p.sync(&state(vec![a.clone(), b.clone()])).unwrap();
        assert!(!report.full);
        assert_eq!(report.rewritten_services, 0);
        assert!(rec.recorded().applied[n].is_empty());

        // One more endpoint for `a`: one new endpoint chain, the service chain rewritten, no
        // element touched (the service-ips verdict stays), nothing of `b`.
        let a2 = port("ns", "a", 1, Protocol::Tcp, &[1, 2, 3]);
        let st = state(vec![a2.clone(), b.clone()]);
        let report = p.sync(&st).unwrap();
        assert_eq!(report.rewritten_services, 1);
        let text = rec.recorded().applied.last().unwrap().text();
        assert_eq!(text.matches("add chain").count(), 1, "{text}");
        assert_eq!(text.matches("flush chain").count(), 1, "{text}");
        assert!(!text.contains("element"), "{text}");
        assert!(!text.contains("ns/b"), "{text}");
        assert_eq!(table(&rec), expected(&st));
    }

    #[test]
    fn losing_endpoints_swaps_elements_and_deletes_flushed_chains_a_second_later() {
        let (mut p, rec) = proxier();
        let a = port("ns", "a", 1, Protocol::Udp, &[1, 2]);
        p.sync(&state(vec![a])).unwrap();
        let none = port("ns", "a", 1, Protocol::Udp, &[]);
        let st = state(vec![none]);
        let report = p.sync(&st).unwrap();
        assert!(report.udp_endpoints_removed);
        let text = rec.recorded().applied.last().unwrap().text();
        assert!(text.contains("delete element ip kube-proxy service-ips"), "{text}");
        assert!(
            text.contains("add element ip kube-proxy no-endpoint-services"),
            "{text}"
        );
        assert!(!text.contains("delete chain"), "{text}");
        // Flushed, still there, and not referenced.
        assert_eq!(without_flushed(table(&rec)), expected(&st));
        assert!(table(&rec).chains.len() > expected(&st).chains.len());
        let due = p.next_cleanup().expect("a cleanup is scheduled");
        assert!(due > Instant::now());
        // Not before the delay...
        p.sync(&st).unwrap();
        assert!(table(&rec).chains.len() > expected(&st).chains.len());
        // ...and after it, a sync without changes deletes them.
        p.set_stale_chain_delay(Duration::ZERO);
        p.sync(&st).unwrap();
        assert_eq!(table(&rec), expected(&st));
        assert!(p.next_cleanup().is_none());
    }

    #[test]
    fn a_chain_coming_back_before_its_deletion_is_kept() {
        let (mut p, rec) = proxier();
        let a = port("ns", "a", 1, Protocol::Tcp, &[1, 2]);
        p.sync(&state(vec![a.clone()])).unwrap();
        p.sync(&state(vec![port("ns", "a", 1, Protocol::Tcp, &[1])])).unwrap();
        let st = state(vec![a]);
        p.sync(&st).unwrap();
        assert_eq!(table(&rec), expected(&st));
        assert!(p.next_cleanup().is_none());
    }

    #[test]
    fn removed_services_and_shared_cluster_ips() {
        let (mut p, rec) = proxier();
        // Two ports of one Service share the ClusterIP in cluster-ips.
        let mut http = port("ns", "web", 5, Protocol::Tcp, &[1]);
        http.port.name.port = "http".into();
        let mut https = port("ns", "web", 5, Protocol::Tcp, &[1]);
        https.port.name.port = "https".into();
        https.port.port = 443;
        p.sync(&state(vec![http.clone(), https])).unwrap();
        let st = state(vec![http]);
        p.sync(&st).unwrap();
        let text = rec.recorded().applied.last().unwrap().text();
        assert!(!text.contains("cluster-ips"), "{text}");
        assert_eq!(without_flushed(table(&rec)), expected(&st));
        let st = state(vec![]);
        p.sync(&st).unwrap();
        assert_eq!(without_flushed(table(&rec)), expected(&st));
    }

    #[test]
    fn failure_rebuilds_the_table_and_options_changes_are_full_syncs() {
        let (mut p, rec) = proxier();
        let st = state(vec![port("ns", "a", 1, Protocol::Tcp, &[1])]);
        p.sync(&st).unwrap();
        rec.recorded().fail_next = true;
        let st2 = state(vec![port("ns", "a", 1, Protocol::Tcp, &[1, 2])]);
        assert!(p.sync(&st2).is_err());
        let report = p.sync(&st2).unwrap();
        assert!(report.full);
        assert_eq!(table(&rec), expected(&st2));
        p.set_options(RenderOptions {
            masquerade_all: true,
            ..RenderOptions::default()
        });
        assert!(p.sync(&st2).unwrap().full);
    }

    /// One random service port: (index, protocol, endpoint bits, local bits, affinity,
    /// NodePort, ETP Local, LoadBalancer with source ranges).
    type Spec = (u8, u8, u8, u8, bool, bool, bool, bool);

    fn build(specs: &[Spec]) -> ProxyState {
        let mut seen = HashSet::new();
        let mut ports = Vec::new();
        for &(i, proto, eps, local, affinity, node_port, etp_local, lb) in specs {
            if !seen.insert(i) {
                continue;
            }
            let proto = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][usize::from(proto % 3)];
            // Two Services share a ClusterIP (different ports) to exercise shared elements.
            let mut p = port("ns", &format!("s{i}"), i / 2 + 1, proto, &[]);
            p.port.port = 80 + u16::from(i);
            p.endpoints = (0..5u8)
                .filter(|b| eps & (1 << b) != 0)
                .map(|b| {
                    let mut e = Endpoint::ready(IpAddr::V4(Ipv4Addr::new(10, 244, 1, b + 1)), 8080);
                    e.is_local = local & (1 << b) != 0;
                    e
                })
                .collect();
            p.port.session_affinity_timeout = affinity.then_some(10800);
            if node_port {
                p.port.node_port = 30000 + u16::from(i);
            }
            p.port.external_policy_local = etp_local && node_port;
            if lb {
                p.port.load_balancer_vips = vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, i))];
                p.port.load_balancer_source_ranges = vec!["192.0.2.0/24".parse().unwrap()];
            }
            ports.push(p);
        }
        state(ports)
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever sequence of states it is given, the incremental proxier leaves the table
        /// a full render would build (once flushed chains are deleted).
        #[test]
        fn incremental_syncs_converge_to_the_full_render(
            steps in proptest::collection::vec(
                proptest::collection::vec(any::<Spec>().prop_map(|mut s| { s.0 %= 6; s }), 0..6),
                1..6,
            )
        ) {
            let (mut p, rec) = proxier();
            for specs in &steps {
                let st = build(specs);
                p.sync(&st).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(without_flushed(table(&rec)), without_flushed(expected(&st)));
            }
            p.set_stale_chain_delay(Duration::ZERO);
            let last = build(steps.last().unwrap());
            p.sync(&last).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(table(&rec), expected(&last));
        }
    }
}
