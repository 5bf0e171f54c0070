//! The nftables proxier: keeps one family's `kube-proxy` table equal to the model by sending
//! only what changed, as one atomic transaction per sync.
//!
//! It never lists the table's contents: what it programmed is known from the service ports it
//! synced last (re-rendered on demand, so memory stays at one `ServicePortState` per port,
//! plus the numgen blocks each holds), from the owners of each set/map element (a ClusterIP in
//! `cluster-ips` may belong to several ports) and from a count per hairpin element. A sync
//! renders only changed ports, rewrites only chains whose rules changed, adds and deletes only
//! the elements that changed — for the common changes, endpoints coming, going or changing
//! readiness, nothing but elements of `service-endpoints-…` and `hairpin-endpoints` — flushes
//! chains it stopped using and deletes them at least a second later (as upstream does: a
//! flushed chain can still be referenced by rules the kernel has not released yet).
//!
//! A full sync (start, a failed transaction, a changed node/options, the table gone) lists the
//! table's chains and sets once. With no table it builds one in bounded transactions, the
//! `kubernetes` Service and cluster DNS in the first (one huge transaction of upstream's
//! layout is quadratic in the kernel, see FLOOR.md). With a table there — a restart — it
//! replaces everything in one transaction, encoded as it is rendered: until the commit every
//! Service works by the old rules, after it by the new ones, and nothing is deleted before its
//! replacement is live. Chains and sets of the old table that are no longer wanted are flushed
//! by that transaction and deleted a second later.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ast::{ChainDecl, ElemKey, ElemValue, Element, Op, Rule, SetDecl, Transaction, family_keyword};
use super::backend::{ListedSet, TableObjects, compatible};
pub use super::backend::{
    NftBackend, NftCommand, NftError, ReadTable, Recorded, RecordingBackend, delete_table, nft_apply, table_exists,
};
use super::blocks::{Blocks, PortBlocks};
use super::names::{HAIRPIN_ENDPOINTS, TABLE, is_affinity_set_name, is_service_endpoints};
use super::netlink::ReadScope;
use super::netlink::decode::Undecoded;
use super::readback;
use super::render::{ServiceRenderer, update_blocks};
use crate::config::ProxyMode;
use crate::model::store::PortChange;
use crate::model::{IpFamily, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState};
use crate::proxy::{Programmed, Proxier, ReadBackError, RenderOptions, SyncContext, SyncError, SyncReport};

/// Chains flushed by a sync are deleted by the first sync at least this much later.
pub const STALE_CHAIN_DELAY: Duration = Duration::from_secs(1);

/// A full sync without a table sends at most about this many commands per transaction.
pub const MAX_OPS_PER_TRANSACTION: usize = 20_000;

/// Services programmed in the first transaction of a full sync: without them nothing in the
/// cluster resolves names or reaches the API server.
pub const PRIORITY_SERVICES: [(&str, &str); 3] = [
    ("default", "kubernetes"),
    ("kube-system", "kube-dns"),
    ("kube-system", "coredns"),
];

/// One service port's objects, from its rendered commands.
#[derive(Default)]
struct ServiceObjects {
    /// Chains in creation order, with their rules.
    chains: Vec<(String, Vec<Rule>)>,
    sets: Vec<SetDecl>,
    /// Elements that several ports may own (tracked by owner).
    elements: Vec<(String, Element)>,
    /// Its intervals of a `service-endpoints-…` map (its blocks are its own).
    ranges: Vec<(String, Element)>,
    /// Its endpoint addresses in `hairpin-endpoints` (counted: endpoints are shared).
    hairpins: Vec<IpAddr>,
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
                Op::AddElement { set, element } if is_service_endpoints(&set) => objs.ranges.push((set, element)),
                Op::AddElement { set, element } if set == HAIRPIN_ENDPOINTS => {
                    if let ElemKey::AddrPair(ip, _) = element.key {
                        objs.hairpins.push(ip);
                    }
                }
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

/// A service port as programmed: its state and the numgen blocks of its selections (`None`:
/// a chain per endpoint).
#[derive(Clone)]
struct Port {
    state: Arc<ServicePortState>,
    blocks: Option<PortBlocks>,
}

/// The programmed ports, found by name. A set of ports keyed by the name each holds, rather
/// than a map from a copy of the name: at 44,000 ports the copies took 5 MiB.
#[derive(Default)]
struct Ports(HashSet<ByName>);

/// A [`Port`] that hashes and compares as its name.
struct ByName(Port);

impl PartialEq for ByName {
    fn eq(&self, other: &ByName) -> bool {
        self.0.state.port.name == other.0.state.port.name
    }
}

impl Eq for ByName {}

impl std::hash::Hash for ByName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.state.port.name.hash(state);
    }
}

impl std::borrow::Borrow<ServicePortName> for ByName {
    fn borrow(&self) -> &ServicePortName {
        &self.0.state.port.name
    }
}

impl Ports {
    fn get(&self, name: &ServicePortName) -> Option<&Port> {
        self.0.get(name).map(|p| &p.0)
    }

    /// Adds `port`, replacing the one of the same name.
    fn insert(&mut self, port: Port) {
        self.0.replace(ByName(port));
    }

    fn remove(&mut self, name: &ServicePortName) -> Option<Port> {
        self.0.take(name).map(|p| p.0)
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn names(&self) -> impl Iterator<Item = &ServicePortName> {
        self.0.iter().map(|p| &p.0.state.port.name)
    }
}

/// What the kernel holds after the last successful transaction.
struct Applied {
    renderer: ServiceRenderer,
    services: Ports,
    blocks: Blocks,
    /// Every element several ports may own, with its owners (the last one by name wins, as in
    /// a full render where later ports overwrite earlier ones), by set (its index in
    /// `element_sets`) and key.
    elements: HashMap<(u16, ElemKey), Owners>,
    /// The names of the sets those elements are in (a dozen: each element names its set by
    /// index, not by a copy of the name, which at 10^5 elements took 3 MiB).
    element_sets: Vec<String>,
    /// How many programmed ports have each endpoint address in `hairpin-endpoints`.
    hairpins: HashMap<IpAddr, u32>,
    /// Flushed chains waiting to be deleted, with the time they were flushed.
    stale_chains: BTreeMap<String, Instant>,
    /// Sets of an earlier table no longer wanted (flushed), with the time, and whether a map.
    stale_sets: BTreeMap<String, (bool, Instant)>,
}

impl Applied {
    fn new(renderer: ServiceRenderer) -> Applied {
        Applied {
            renderer,
            services: Ports::default(),
            blocks: Blocks::default(),
            elements: HashMap::new(),
            element_sets: Vec::new(),
            hairpins: HashMap::new(),
            stale_chains: BTreeMap::new(),
            stale_sets: BTreeMap::new(),
        }
    }

    fn objects(&self, port: &Port) -> ServiceObjects {
        ServiceObjects::from_ops(self.renderer.service(&port.state, port.blocks).ops)
    }

    /// The index of the element set `name`, if any element was ever put in it.
    fn element_set(&self, name: &str) -> Option<u16> {
        let i = self.element_sets.iter().position(|s| s == name)?;
        u16::try_from(i).ok()
    }

    /// The index of the element set `name`, added when new.
    fn element_set_or_add(&mut self, name: &str) -> u16 {
        if let Some(i) = self.element_set(name) {
            return i;
        }
        self.element_sets.push(name.to_string());
        // Sets are a fixed dozen (render.rs); 65,536 would mean a bug elsewhere.
        u16::try_from(self.element_sets.len() - 1).unwrap_or(u16::MAX)
    }

    /// The element in effect for `set` and `key`.
    fn effective(&self, set: &str, key: &ElemKey) -> Option<Element> {
        let owners = self.elements.get(&(self.element_set(set)?, key.clone()))?;
        let (value, comment) = owners.effective()?;
        Some(Element {
            key: key.clone(),
            value: value.clone(),
            comment: comment.clone(),
        })
    }
}

/// The service ports that put one element into a set, sorted by name, with the element each
/// wants. Almost always one: a sorted `Vec` costs a fraction of a `BTreeMap`'s node, and an
/// owner is the (shared) state of its port rather than a copy of its name, which matters at
/// 10^5 elements.
#[derive(Default)]
struct Owners(Vec<(Arc<ServicePortState>, Option<ElemValue>, Option<String>)>);

impl Owners {
    fn find(&self, owner: &ServicePortName) -> Result<usize, usize> {
        self.0.binary_search_by(|(o, _, _)| o.port.name.cmp(owner))
    }

    /// Records `element` (its value and comment: the key is the map's) as `owner`'s.
    fn insert(&mut self, owner: &Arc<ServicePortState>, element: Element) {
        let entry = (owner.clone(), element.value, element.comment);
        match self.find(&owner.port.name) {
            Ok(i) => self.0[i] = entry,
            Err(i) => {
                // Exactly one slot for the usual single owner (`push` would reserve four).
                self.0.reserve_exact(1);
                self.0.insert(i, entry);
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
    fn effective(&self) -> Option<(&Option<ElemValue>, &Option<String>)> {
        self.0.last().map(|(_, v, c)| (v, c))
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
    /// Hairpin addresses → whether the element was there before this transaction.
    hairpins_touched: BTreeMap<IpAddr, bool>,
    range_deletes: Vec<Op>,
    range_adds: Vec<Op>,
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

    /// Bounds the size of the transactions that build a table where there was none (tests
    /// and benchmarks).
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

    /// When a sync is due to delete flushed chains and sets, if any wait.
    pub fn next_cleanup(&self) -> Option<Instant> {
        let applied = self.applied.as_ref()?;
        let chains = applied.stale_chains.values().copied();
        let sets = applied.stale_sets.values().map(|(_, t)| *t);
        chains.chain(sets).min().map(|t| t + self.stale_delay)
    }

    /// Brings the table in line with `state` (which must be of this proxier's family).
    pub fn sync(&mut self, state: &ProxyState) -> Result<SyncReport, NftError> {
        self.sync_hinted(state, None)
    }

    /// [`NftProxier::sync`], told which service ports differ from the last programmed state
    /// (see [`Proxier::sync_changed`]): only those are compared.
    pub fn sync_changed(&mut self, state: &ProxyState, changed: &[PortChange]) -> Result<SyncReport, NftError> {
        self.sync_hinted(state, Some(changed))
    }

    fn sync_hinted(&mut self, state: &ProxyState, changed: Option<&[PortChange]>) -> Result<SyncReport, NftError> {
        let start = Instant::now();
        let renderer = ServiceRenderer::new(state, &self.opts);
        let incremental = self.applied.as_ref().is_some_and(|a| a.renderer == renderer);
        self.last_attempt_full = !incremental;
        let result = if incremental {
            self.send_changes(state, changed)
        } else {
            self.rebuild(state, renderer)
        };
        crate::proxy::finish_sync(start, result, || self.applied = None)
    }

    /// Programs the whole state: built in bounded transactions where there is no table,
    /// replacing the existing table in one transaction where there is one.
    fn rebuild(&mut self, state: &ProxyState, renderer: ServiceRenderer) -> Result<SyncReport, NftError> {
        self.applied = None;
        let existing = self.backend.objects(self.family)?;
        let mut applied = Applied::new(renderer);
        let mut order: Vec<&Arc<ServicePortState>> = state.service_ports.iter().collect();
        // Stable: the rest keeps the model's order.
        order.sort_by_key(|s| !is_priority(&s.port.name));
        let operations = match existing {
            None => self.build(&mut applied, &order)?,
            Some(objects) => self.replace(&mut applied, &order, &objects)?,
        };
        let services = applied.services.len();
        self.applied = Some(applied);
        Ok(SyncReport {
            full: true,
            rewritten_services: services,
            operations,
            udp_endpoints_removed: true,
            ..SyncReport::default()
        })
    }

    /// A table where there was none, in transactions of about `max_ops` commands (the first
    /// holds the fixed part and the priority Services, whatever the bound).
    fn build(&mut self, applied: &mut Applied, order: &[&Arc<ServicePortState>]) -> Result<usize, NftError> {
        let mut tx = Transaction::new(self.family);
        tx.push(Op::AddTable);
        tx.ops.extend(applied.renderer.setup(false).ops);
        let mut operations = 0;
        let mut rest = order;
        loop {
            let mut plan = Plan::default();
            let mut ops = tx.ops.len();
            while let Some((sps, tail)) = rest.split_first() {
                ops += add_port(&mut plan, applied, sps);
                rest = tail;
                if ops >= self.max_ops && rest.first().is_none_or(|n| !is_priority(&n.port.name)) {
                    break;
                }
            }
            finish_plan(&mut tx, plan, applied, Instant::now());
            operations += tx.ops.len();
            self.backend.apply(&tx)?;
            if rest.is_empty() {
                return Ok(operations);
            }
            tx = Transaction::new(self.family);
        }
    }

    /// Replaces the table `existing` describes with the whole state, in one transaction whose
    /// parts are rendered (and, over netlink, encoded) one service port at a time.
    fn replace(
        &mut self,
        applied: &mut Applied,
        order: &[&Arc<ServicePortState>],
        existing: &TableObjects,
    ) -> Result<usize, NftError> {
        let family = self.family;
        let prelude = replace_prelude(family, existing, &applied.renderer.setup(false));
        let mut parts = ReplaceParts {
            applied: &mut *applied,
            order,
            next: 0,
            first: Some(prelude),
            existing,
            wanted: HashSet::new(),
            operations: 0,
        };
        self.backend.apply_parts(family, &mut parts)?;
        let (wanted, operations) = (parts.wanted, parts.operations);
        // What the old table had and the new one does not: flushed above, deleted later.
        let now = Instant::now();
        for c in &existing.chains {
            if !wanted.contains(&c.name) {
                applied.stale_chains.insert(c.name.clone(), now);
            }
        }
        for s in &existing.sets {
            if !wanted.contains(&s.name) {
                applied.stale_sets.insert(s.name.clone(), (is_map(s), now));
            }
        }
        Ok(operations)
    }

    /// Sends what changed since the last sync.
    fn send_changes(&mut self, state: &ProxyState, changed: Option<&[PortChange]>) -> Result<SyncReport, NftError> {
        let stale_delay = self.stale_delay;
        let Some(applied) = self.applied.as_mut() else {
            return Err(NftError("no programmed table to update".into()));
        };
        let now = Instant::now();
        let mut plan = Plan::default();
        match changed {
            Some(changed) => {
                // As `plan_all` goes: additions and changes in the model's order, then removals.
                for new in changed.iter().filter_map(|(_, new)| new.as_ref()) {
                    match applied.services.get(&new.port.name).cloned() {
                        Some(old) if old.state == *new => {}
                        Some(old) => change_port(&mut plan, applied, &old, new),
                        None => {
                            add_port(&mut plan, applied, new);
                        }
                    }
                }
                for (name, _) in changed.iter().filter(|(_, new)| new.is_none()) {
                    remove_port(&mut plan, applied, name);
                }
            }
            None => plan_all(&mut plan, applied, state),
        }
        let rewritten = plan.rewritten;
        let udp = plan.udp_endpoints_removed;
        let mut tx = Transaction::new(self.family);
        let flushed_before = applied.stale_chains.len();
        finish_plan(&mut tx, plan, applied, now);
        let newly_stale = applied.stale_chains.len().saturating_sub(flushed_before);
        delete_due(&mut tx, applied, now, stale_delay);
        let deleted = tx
            .ops
            .iter()
            .filter(|o| matches!(o, Op::DeleteChain(_) | Op::DeleteSet { .. }))
            .count();
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

/// The parts of a replacing full sync: the prelude, then one per service port, each planned
/// against what the parts before it put in.
struct ReplaceParts<'a> {
    applied: &'a mut Applied,
    order: &'a [&'a Arc<ServicePortState>],
    next: usize,
    first: Option<Transaction>,
    existing: &'a TableObjects,
    /// The chains and sets the parts so far create.
    wanted: HashSet<String>,
    operations: usize,
}

impl Iterator for ReplaceParts<'_> {
    type Item = Transaction;

    fn next(&mut self) -> Option<Transaction> {
        let tx = match self.first.take() {
            Some(prelude) => prelude,
            None => {
                let sps = self.order.get(self.next)?;
                self.next += 1;
                let mut plan = Plan::default();
                add_port(&mut plan, self.applied, sps);
                let family = self.applied.renderer.family();
                let mut tx = Transaction::new(family);
                finish_plan(&mut tx, plan, self.applied, Instant::now());
                // An affinity set of the old table that cannot stay as it is goes first
                // (nothing refers to it: the prelude flushed every chain).
                let mut ops = Vec::with_capacity(tx.ops.len());
                for op in tx.ops {
                    if let Op::AddSet(decl) = &op
                        && let Some(old) = self.existing.sets.iter().find(|s| s.name == decl.name)
                        && !compatible(family, old, decl)
                    {
                        ops.push(Op::DeleteSet {
                            name: old.name.clone(),
                            map: is_map(old),
                        });
                    }
                    ops.push(op);
                }
                Transaction { family, ops }
            }
        };
        for op in &tx.ops {
            match op {
                Op::AddChain(decl) => self.wanted.insert(decl.name.clone()),
                Op::AddSet(decl) => self.wanted.insert(decl.name.clone()),
                _ => false,
            };
        }
        self.operations += tx.ops.len();
        Some(tx)
    }
}

/// Whether a listed set is a map (as far as its signature says).
fn is_map(s: &ListedSet) -> bool {
    s.signature.is_some_and(|g| g.data.is_some())
}

/// The start of a replacing full sync: every chain of the old table flushed (so that nothing
/// refers to what goes), its sets that cannot stay deleted or flushed (affinity sets keep
/// their clients), base chains with another hook or priority deleted, then the fixed part.
fn replace_prelude(family: IpFamily, existing: &TableObjects, setup: &Transaction) -> Transaction {
    let mut tx = Transaction::new(family);
    tx.push(Op::AddTable);
    for c in &existing.chains {
        tx.push(Op::FlushChain(c.name.clone()));
    }
    let wanted_base: HashMap<&str, &ChainDecl> = setup
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::AddChain(d) if d.base.is_some() => Some((d.name.as_str(), d)),
            _ => None,
        })
        .collect();
    for c in &existing.chains {
        let Some(decl) = wanted_base.get(c.name.as_str()) else {
            continue;
        };
        let want = decl.base.map(|b| (b.kind.to_string(), b.hook.to_string(), b.priority));
        if c.base != want {
            tx.push(Op::DeleteChain(c.name.clone()));
        }
    }
    let wanted_sets: HashMap<&str, &SetDecl> = setup
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::AddSet(d) => Some((d.name.as_str(), d)),
            _ => None,
        })
        .collect();
    for s in &existing.sets {
        let map = is_map(s);
        match wanted_sets.get(s.name.as_str()) {
            // The `service-endpoints-…` maps are flushed and refilled like the others, not
            // deleted and declared again: a map declared in the transaction finds nothing for
            // a moment after the commit (the kernel builds its lookup array after switching
            // to the new rules; the restart test saw 44 connects refused). The kernel checks
            // each interval added against the flushed ones still in the tree, so this costs
            // O(n²) per map: one map took 646 s at 10k × 10, which the 64 shards avoid.
            Some(decl) if compatible(family, s, decl) => {}
            Some(_) => tx.push(Op::DeleteSet {
                name: s.name.clone(),
                map,
            }),
            // Affinity sets stay (a port may still want it); other old sets are emptied.
            None if is_affinity_set_name(&s.name) => {}
            None => tx.push(Op::FlushSet {
                name: s.name.clone(),
                map,
            }),
        }
    }
    tx.ops.extend(setup.ops.iter().cloned());
    tx
}

/// Deletes the chains and sets flushed at least `delay` ago (and not used again since).
fn delete_due(tx: &mut Transaction, applied: &mut Applied, now: Instant, delay: Duration) {
    let due = |t: &Instant| now.duration_since(*t) >= delay;
    let chains: Vec<String> = applied
        .stale_chains
        .iter()
        .filter(|(_, t)| due(t))
        .map(|(c, _)| c.clone())
        .collect();
    for c in chains {
        tx.push(Op::DeleteChain(c.clone()));
        applied.stale_chains.remove(&c);
    }
    let sets: Vec<(String, bool)> = applied
        .stale_sets
        .iter()
        .filter(|(_, (_, t))| due(t))
        .map(|(s, (map, _))| (s.clone(), *map))
        .collect();
    for (name, map) in sets {
        applied.stale_sets.remove(&name);
        tx.push(Op::DeleteSet { name, map });
    }
}

fn is_priority(name: &ServicePortName) -> bool {
    PRIORITY_SERVICES
        .iter()
        .any(|(ns, n)| name.namespace == *ns && name.name == *n)
}

fn release(taken: &mut Blocks, blocks: PortBlocks) {
    for id in [blocks.cluster, blocks.local].into_iter().flatten() {
        taken.release(id);
    }
}

/// Plans the changes from what `applied` holds to `state`, comparing every port.
fn plan_all(plan: &mut Plan, applied: &mut Applied, state: &ProxyState) {
    // Ports still present that were programmed before; when that is all of them, nothing
    // was removed and the (per-sync, 40k-entry) search for removed ports is skipped.
    let mut kept = 0usize;
    for sps in &state.service_ports {
        let name = &sps.port.name;
        let old = applied.services.get(name).cloned();
        if old.is_some() {
            kept += 1;
        }
        if old.as_ref().is_some_and(|o| o.state == *sps) {
            continue;
        }
        match old {
            None => {
                add_port(plan, applied, sps);
                // Counted as kept from now on: it is in `applied.services`.
                kept += 1;
            }
            Some(old) => change_port(plan, applied, &old, sps),
        }
    }
    if kept < applied.services.len() {
        let present: HashSet<&ServicePortName> = state.service_ports.iter().map(|s| &s.port.name).collect();
        let gone: Vec<ServicePortName> = applied
            .services
            .names()
            .filter(|n| !present.contains(n))
            .cloned()
            .collect();
        for name in gone {
            remove_port(plan, applied, &name);
        }
    }
}

/// Plans the removal of a programmed port.
fn remove_port(plan: &mut Plan, applied: &mut Applied, name: &ServicePortName) {
    if let Some(old) = applied.services.remove(name) {
        plan.udp_endpoints_removed |= old.state.port.protocol == Protocol::Udp;
        let old_objs = applied.objects(&old);
        plan_service(plan, applied, &old.state, Some(old_objs), None);
        if let Some(b) = old.blocks {
            release(&mut applied.blocks, b);
        }
    }
}

/// Plans a port that was not programmed; returns about how many commands it adds.
fn add_port(plan: &mut Plan, applied: &mut Applied, sps: &Arc<ServicePortState>) -> usize {
    let port = Port {
        state: sps.clone(),
        blocks: update_blocks(&mut applied.blocks, sps, None),
    };
    let objs = applied.objects(&port);
    let ops = objs.chains.iter().map(|(_, r)| r.len() + 2).sum::<usize>()
        + objs.elements.len()
        + objs.ranges.len()
        + objs.hairpins.len()
        + objs.sets.len();
    plan_service(plan, applied, sps, None, Some(objs));
    applied.services.insert(port);
    ops
}

/// Plans the change of a programmed port to `sps`.
fn change_port(plan: &mut Plan, applied: &mut Applied, old: &Port, sps: &Arc<ServicePortState>) {
    plan.udp_endpoints_removed |= old.state.loses_udp_endpoints_to(sps);
    let old_objs = applied.objects(old);
    let port = Port {
        state: sps.clone(),
        blocks: update_blocks(&mut applied.blocks, sps, old.blocks),
    };
    let new_objs = applied.objects(&port);
    plan_service(plan, applied, sps, Some(old_objs), Some(new_objs));
    applied.services.insert(port);
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
    plan_chains_and_sets(plan, applied, &old, &new);
    plan_ranges(plan, &old.ranges, &new.ranges);
    plan_hairpins(plan, applied, &old.hairpins, &new.hairpins);
    for (set, element) in old.elements {
        remember_effective(plan, applied, &set, &element.key);
        let Some(id) = applied.element_set(&set) else {
            continue;
        };
        let k = (id, element.key);
        if let Some(owners) = applied.elements.get_mut(&k) {
            owners.remove(&owner.port.name);
            if owners.0.is_empty() {
                applied.elements.remove(&k);
            }
        }
    }
    for (set, element) in new.elements {
        remember_effective(plan, applied, &set, &element.key);
        let k = (applied.element_set_or_add(&set), element.key.clone());
        applied.elements.entry(k).or_default().insert(owner, element);
    }
}

fn plan_chains_and_sets(plan: &mut Plan, applied: &mut Applied, old: &ServiceObjects, new: &ServiceObjects) {
    let old_chains: HashMap<&str, &Vec<Rule>> = old.chains.iter().map(|(n, r)| (n.as_str(), r)).collect();
    let new_names: HashSet<&str> = new.chains.iter().map(|(n, _)| n.as_str()).collect();
    for decl in &new.sets {
        // A set of an earlier table wanted again is no longer due for deletion.
        applied.stale_sets.remove(&decl.name);
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
            None => plan.new_chains.push(Op::AddChain(ChainDecl::regular(name.clone()))),
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
                map: decl.map.is_some(),
            });
        }
    }
}

/// A port's intervals are its own: delete those that changed, add the new ones.
fn plan_ranges(plan: &mut Plan, old: &[(String, Element)], new: &[(String, Element)]) {
    for e in old {
        if !new.contains(e) {
            plan.range_deletes.push(Op::DeleteElement {
                set: e.0.clone(),
                key: e.1.key.clone(),
            });
        }
    }
    for e in new {
        if !old.contains(e) {
            plan.range_adds.push(Op::AddElement {
                set: e.0.clone(),
                element: e.1.clone(),
            });
        }
    }
}

fn plan_hairpins(plan: &mut Plan, applied: &mut Applied, old: &[IpAddr], new: &[IpAddr]) {
    for ip in old {
        if new.contains(ip) {
            continue;
        }
        let count = applied.hairpins.get(ip).copied().unwrap_or(0);
        plan.hairpins_touched.entry(*ip).or_insert(count > 0);
        if count <= 1 {
            applied.hairpins.remove(ip);
        } else {
            applied.hairpins.insert(*ip, count - 1);
        }
    }
    for ip in new {
        if old.contains(ip) {
            continue;
        }
        let count = applied.hairpins.entry(*ip).or_insert(0);
        plan.hairpins_touched.entry(*ip).or_insert(*count > 0);
        *count += 1;
    }
}

fn remember_effective(plan: &mut Plan, applied: &Applied, set: &str, key: &ElemKey) {
    if let std::collections::btree_map::Entry::Vacant(v) = plan.touched.entry((set.to_string(), key.clone())) {
        v.insert(applied.effective(set, key));
    }
}

/// Appends the plan's commands to `tx` in an order the kernel accepts: sets and chains
/// first (rules and elements refer to them), rules, element changes (deletes first, so that
/// an interval can take the numbers another one gives up), then the flushes and deletes of
/// what is no longer referenced.
fn finish_plan(tx: &mut Transaction, plan: Plan, applied: &mut Applied, now: Instant) {
    tx.ops.extend(plan.new_sets);
    tx.ops.extend(plan.new_chains);
    tx.ops.extend(plan.chain_rules);
    tx.ops.extend(plan.range_deletes);
    let mut adds = Vec::new();
    for (k, before) in plan.touched {
        let after = applied.effective(&k.0, &k.1);
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
    for (ip, before) in plan.hairpins_touched {
        let after = applied.hairpins.contains_key(&ip);
        let element = || Element {
            key: ElemKey::AddrPair(ip, ip),
            value: None,
            comment: None,
        };
        match (before, after) {
            (true, false) => tx.push(Op::DeleteElement {
                set: HAIRPIN_ENDPOINTS.to_string(),
                key: element().key,
            }),
            (false, true) => adds.push(Op::AddElement {
                set: HAIRPIN_ENDPOINTS.to_string(),
                element: element(),
            }),
            _ => {}
        }
    }
    tx.ops.extend(adds);
    tx.ops.extend(plan.range_adds);
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

    fn sync_changed(&mut self, state: &ProxyState, changed: &[PortChange]) -> Result<SyncReport, SyncError> {
        NftProxier::sync_changed(self, state, changed).map_err(|e| SyncError::new(self.last_attempt_full, e))
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
        // The port's own chains (with the `service-endpoints-…` maps their rules look up),
        // its elements of the dispatch maps and reject sets by key, then the endpoint chains
        // they lead to and its endpoints' `hairpin-endpoints` elements.
        let keys = readback::element_keys(port);
        let scope = ReadScope::Some {
            chains: readback::own_chains(port),
            maps: Vec::new(),
            keyed: readback::element_sets()
                .filter(|s| *s != HAIRPIN_ENDPOINTS)
                .map(|s| (s.to_string(), keys.clone()))
                .collect(),
        };
        let Some((first, mut foreign)) = self.backend.read(self.family, &scope).map_err(err)? else {
            return Ok(Programmed::default());
        };
        let endpoints: Vec<String> = readback::sections(&first, port)
            .iter()
            .flat_map(|s| s.lines.iter())
            .flat_map(|l| readback::endpoint_chains(std::slice::from_ref(l)))
            .collect();
        let hairpin = readback::hairpin_keys(&first, port);
        let mut table = first;
        if !endpoints.is_empty() || !hairpin.is_empty() {
            let scope = ReadScope::Some {
                chains: endpoints,
                maps: Vec::new(),
                keyed: vec![(HAIRPIN_ENDPOINTS.to_string(), hairpin)],
            };
            if let Some((more, f)) = self.backend.read(self.family, &scope).map_err(err)? {
                table.chains.extend(more.chains);
                for (name, set) in more.sets {
                    if let Some(s) = table.sets.get_mut(&name) {
                        s.elements.extend(set.elements);
                    }
                }
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
fn programmed(table: &super::ruleset::Ruleset, foreign: &[Undecoded], port: &ServicePort) -> Programmed {
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
    use crate::nftables::ruleset::Ruleset;

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
        // Its endpoints as intervals of the numbers its chain draws.
        assert!(text.iter().any(|l| l.ends_with(" : 10.244.1.2 . 8080")), "{text:#?}");
        assert!(text.iter().any(|l| l.contains("numgen random mod 55440")), "{text:#?}");
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
                .any(|l| l.ends_with(" : 10.244.1.3 . 8080"))
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
        // Where there was no table, nothing is deleted; the first transaction holds the fixed
        // part and the priority services.
        let first = r.applied[0].text();
        assert!(first.starts_with("add table ip kube-proxy"));
        assert!(!first.contains("delete table"), "{first}");
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

        // One more endpoint for `a`: only elements, of `service-endpoints` (the block split
        // three ways instead of two) and `hairpin-endpoints` (for a new address); no chain, no
        // rule, no verdict element (which would make the kernel validate the table), nothing
        // of `b`.
        let a2 = port("ns", "a", 1, Protocol::Tcp, &[1, 2, 3]);
        let st = state(vec![a2.clone(), b.clone()]);
        let report = p.sync(&st).unwrap();
        assert_eq!(report.rewritten_services, 1);
        let text = rec.recorded().applied.last().unwrap().text();
        assert_only_endpoint_elements(&text);
        assert_eq!(
            text.matches("delete element ip kube-proxy service-endpoints-tcp")
                .count(),
            2,
            "{text}"
        );
        assert_eq!(
            text.matches("add element ip kube-proxy service-endpoints-tcp").count(),
            3,
            "{text}"
        );
        // The new endpoint's address is `b`'s endpoint too: already in `hairpin-endpoints`.
        assert!(!text.contains("hairpin-endpoints"), "{text}");
        assert!(!text.contains("ns/b"), "{text}");
        assert_eq!(table(&rec), expected(&st));

        // An endpoint turning not ready: elements only, too.
        let mut a3 = a2.clone();
        a3.endpoints[0].ready = false;
        a3.endpoints[0].serving = false;
        let st = state(vec![a3, b]);
        p.sync(&st).unwrap();
        let text = rec.recorded().applied.last().unwrap().text();
        assert_only_endpoint_elements(&text);
        assert_eq!(table(&rec), expected(&st));
    }

    /// Every command of `text` adds or deletes an element of `service-endpoints` or
    /// `hairpin-endpoints`.
    fn assert_only_endpoint_elements(text: &str) {
        for line in text.lines() {
            assert!(
                line.starts_with("add element ip kube-proxy service-endpoints-")
                    || line.starts_with("delete element ip kube-proxy service-endpoints-")
                    || line.starts_with("add element ip kube-proxy hairpin-endpoints")
                    || line.starts_with("delete element ip kube-proxy hairpin-endpoints"),
                "not an endpoint element: {line}\n{text}"
            );
        }
    }

    #[test]
    fn losing_endpoints_swaps_elements_and_deletes_flushed_chains_a_second_later() {
        let (mut p, rec) = proxier();
        // Endpoints chosen by map: the dispatch and chains stay, the endpoints' elements go
        // and a plain element of `reject-services` comes (no verdict element, no chain).
        let a = port("ns", "a", 1, Protocol::Udp, &[1, 2]);
        p.sync(&state(vec![a])).unwrap();
        let none = port("ns", "a", 1, Protocol::Udp, &[]);
        let st = state(vec![none]);
        let report = p.sync(&st).unwrap();
        assert!(report.udp_endpoints_removed);
        let text = rec.recorded().applied.last().unwrap().text();
        assert!(
            text.contains("delete element ip kube-proxy service-endpoints-udp"),
            "{text}"
        );
        assert!(text.contains("add element ip kube-proxy reject-services"), "{text}");
        assert!(!text.contains("service-ips") && !text.contains("chain"), "{text}");
        assert_eq!(table(&rec), expected(&st));

        // With ClientIP affinity (a chain per endpoint): the dispatch element is swapped for
        // the reject and the endpoint chains are flushed, then deleted a second later.
        let (mut p, rec) = proxier();
        let mut a = port("ns", "a", 1, Protocol::Udp, &[1, 2]);
        a.port.session_affinity_timeout = Some(10800);
        p.sync(&state(vec![a.clone()])).unwrap();
        let mut none = a.clone();
        none.endpoints = Vec::new();
        let st = state(vec![none]);
        let report = p.sync(&st).unwrap();
        assert!(report.udp_endpoints_removed);
        let text = rec.recorded().applied.last().unwrap().text();
        assert!(text.contains("delete element ip kube-proxy service-ips"), "{text}");
        assert!(text.contains("add element ip kube-proxy reject-services"), "{text}");
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
    fn a_restart_replaces_the_table_in_one_transaction_without_deleting_it() {
        let (mut p, rec) = proxier();
        p.set_max_ops_per_transaction(10);
        let mut gone = port("ns", "gone", 3, Protocol::Tcp, &[4]);
        gone.port.session_affinity_timeout = Some(60);
        let st = state(vec![port("ns", "a", 1, Protocol::Tcp, &[1, 2]), gone]);
        p.sync(&st).unwrap();
        assert!(
            rec.recorded().applied.len() > 1,
            "bounded transactions where there was no table"
        );
        // A new process over the same table, with one Service gone and one changed.
        let mut p = NftProxier::with_backend(IpFamily::V4, RenderOptions::default(), Box::new(rec.clone()));
        p.set_max_ops_per_transaction(10);
        let n = rec.recorded().applied.len();
        let st = state(vec![
            port("ns", "a", 1, Protocol::Tcp, &[1, 3]),
            port("ns", "b", 2, Protocol::Udp, &[5]),
        ]);
        let report = p.sync(&st).unwrap();
        assert!(report.full);
        let r = rec.recorded();
        assert_eq!(r.applied.len(), n + 1, "one transaction");
        let text = r.applied[n].text();
        assert!(!text.contains("delete table"), "{text}");
        drop(r);
        // What the old table had and the new one does not is flushed now, deleted later (the
        // affinity set of the Service gone, too).
        let mut now = without_flushed(table(&rec));
        let old_sets = now.sets.len();
        now.sets.retain(|name, _| !name.contains("ns/gone"));
        assert_eq!(now.sets.len(), old_sets - 1);
        assert_eq!(now, expected(&st));
        p.set_stale_chain_delay(Duration::ZERO);
        p.sync(&st).unwrap();
        assert_eq!(table(&rec), expected(&st));
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

    /// The service ports that differ from `old` in `new`, as the state builder reports them.
    fn changes(old: &ProxyState, new: &ProxyState) -> Vec<PortChange> {
        let mut out: Vec<PortChange> = new
            .service_ports
            .iter()
            .filter(|n| !old.service_ports.contains(n))
            .map(|n| (n.port.name.clone(), Some(n.clone())))
            .collect();
        out.extend(
            old.service_ports
                .iter()
                .filter(|o| !new.service_ports.iter().any(|n| n.port.name == o.port.name))
                .map(|o| (o.port.name.clone(), None)),
        );
        out
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
            // Told what changed, a second proxier sends the same.
            let (mut told, told_rec) = proxier();
            let mut before: Option<ProxyState> = None;
            for specs in &steps {
                let st = build(specs);
                p.sync(&st).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(without_flushed(table(&rec)), without_flushed(expected(&st)));
                match &before {
                    Some(b) => told.sync_changed(&st, &changes(b, &st)),
                    None => told.sync(&st),
                }
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(table(&told_rec), table(&rec));
                before = Some(st);
            }
            p.set_stale_chain_delay(Duration::ZERO);
            let last = build(steps.last().unwrap());
            p.sync(&last).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(table(&rec), expected(&last));
        }
    }
}
