//! The iptables proxier: keeps one family's kernel rules equal to the model. A full sync
//! (at start, after a failure, when the rendering context or the canaries change, and every
//! [`FULL_SYNC_PERIOD`], which the daemon schedules) writes every chain and deletes stale ones
//! found with `iptables-save`; a partial sync rewrites only the chains of service ports whose
//! state changed, edits the fixed chains whose content changed, and deletes the chains it
//! stopped using.
//!
//! Every sync is `iptables-restore --noflush` input, written in runs (see [`super::batch`]),
//! in an order that never leaves a Service without the path it had:
//! 1. nat: (full syncs) KUBE-POSTROUTING and KUBE-MARK-MASQ; then each changed Service's own
//!    chains, each flushed and refilled in one commit — a Service whose chains already exist
//!    goes from its old rules to its new ones at once;
//! 2. nat: what KUBE-SERVICES and KUBE-NODEPORTS gain (the jumps to the chains of step 1, see
//!    [`super::edits`]);
//! 3. filter, written whole when it changed (it is small: only Services without (local)
//!    endpoints, firewalls and health checks add to it);
//! 4. nat: what KUBE-SERVICES and KUBE-NODEPORTS lose, then the chains no longer used
//!    (flushed, then deleted).
//!
//! So a Service that gains its first endpoint has its DNAT (2) before its REJECT goes (3), and
//! one that loses its last has its REJECT (3) before its DNAT goes (4): iptables-restore
//! commits each table on its own, and a SYN between the two would be forwarded un-NATed (see
//! PITFALLS). A chain written whole (a Service claimed twice, many deletions) goes in step 2
//! when some Service gained endpoints, else in step 4.
//!
//! Partial syncs skip unchanged fixed chains, where upstream rewrites them every time: with
//! iptables-nft each rewritten jump rule costs a scan of every chain, so rewriting
//! KUBE-SERVICES dominates an endpoint change at 10k Services (see the README's figures).
//!
//! Memory: what a Service renders is kept only as far as later syncs compare it (its lines in
//! the fixed chains, its chain names); the rules of its own chains are written when rendered
//! and dropped, and the nat table is read back line by line, never whole.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batch::Batches;
use super::edits::{ChainWrite, Edits, contested, diff_saved};
use super::exec::{ExecError, Iptables};
use super::names::{
    KUBE_MARK_MASQ, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_PROXY_CANARY, KUBE_SERVICES, is_service_chain,
};
use super::render::{
    IptablesRenderOptions, RenderContext, ServiceFragment, filter_section, jump_rules, masquerade_rules,
    nodeports_tail, render_service,
};
use crate::config::ProxyMode;
use crate::model::{IpFamily, ProxyState, ServicePort, ServicePortName, ServicePortState};
use crate::proxy::{self, Programmed, Proxier, ReadBackError, SyncContext, SyncReport, TableRules};

/// Upstream's `FullSyncPeriod`: a full sync at least this often.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Tables that hold a canary chain (upstream's `ipt.Monitor`).
pub const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("ensuring chains and jump rules: {0}")]
    Setup(#[source] ExecError),
    #[error("listing existing chains: {0}")]
    Save(#[source] ExecError),
    #[error("applying rules: {0}")]
    Restore(#[source] ExecError),
}

struct CachedService {
    state: Arc<ServicePortState>,
    /// Its rendering, without the rules of its own chains (`chain_rules` is empty).
    fragment: ServiceFragment,
    /// How many rules its own chains hold.
    chain_rules: usize,
}

/// What is in the kernel after the last successful sync, besides the per-service fragments.
struct Applied {
    ctx: RenderContext,
    filter: String,
}

pub struct IptablesProxier<I: Iptables> {
    ipt: I,
    opts: IptablesRenderOptions,
    services: HashMap<ServicePortName, CachedService>,
    applied: Option<Applied>,
    last_attempt_full: bool,
}

impl<I: Iptables> IptablesProxier<I> {
    pub fn new(ipt: I, opts: IptablesRenderOptions) -> IptablesProxier<I> {
        IptablesProxier {
            ipt,
            opts,
            services: HashMap::new(),
            applied: None,
            last_attempt_full: false,
        }
    }

    pub fn iptables(&mut self) -> &mut I {
        &mut self.ipt
    }

    /// Replaces the rendering options (they depend on the Node, which may arrive or change
    /// after start); a change makes the next sync a full one.
    pub fn set_options(&mut self, opts: IptablesRenderOptions) {
        if opts != self.opts {
            self.opts = opts;
            self.applied = None;
        }
    }

    /// Whether the last sync attempted (successful or not) was a full one.
    pub fn last_attempt_full(&self) -> bool {
        self.last_attempt_full
    }

    /// Makes the next sync a full one (after a failure, a flush by someone else, ...).
    pub fn force_full_sync(&mut self) {
        self.applied = None;
    }

    /// Whether our canary chains and the nat entry jump are still there; if not, someone
    /// flushed or reloaded the tables and a full sync must repair them.
    pub fn canaries_intact(&mut self) -> bool {
        for table in CANARY_TABLES {
            if !self.ipt.chain_exists(table, KUBE_PROXY_CANARY).unwrap_or(false) {
                return false;
            }
        }
        jump_rules()
            .iter()
            .filter(|j| j.table == "nat" && j.chain == "PREROUTING")
            .all(|j| self.ipt.rule_exists(j.table, j.chain, &j.args).unwrap_or(false))
    }

    /// Brings the kernel in line with `state` (which must be of this proxier's family).
    pub fn sync(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        let start = Instant::now();
        let ctx = RenderContext::new(state, &self.opts);
        let full = self.applied.as_ref().is_none_or(|applied| applied.ctx != ctx);
        self.last_attempt_full = full;
        let result = self.sync_inner(state, ctx, full);
        proxy::finish_sync(start, result, || self.applied = None)
    }

    fn sync_inner(&mut self, state: &ProxyState, ctx: RenderContext, full: bool) -> Result<SyncReport, SyncError> {
        let mut report = SyncReport {
            full,
            ..SyncReport::default()
        };
        let prev = if full { None } else { self.applied.take() };
        let listed = if full {
            self.ensure_setup().map_err(SyncError::Setup)?;
            Some(Listed::read(&mut self.ipt).map_err(SyncError::Save)?)
        } else {
            None
        };
        // A full sync into a chain without rules appends, Service by Service.
        let append = Append {
            services: listed.as_ref().is_some_and(|l| l.services.is_empty()),
            nodeports: listed.as_ref().is_some_and(|l| l.nodeports.is_empty()),
        };
        let mut b = Batches::new(&mut self.ipt);

        // 1. KUBE-POSTROUTING, KUBE-MARK-MASQ and the changed Services' own chains.
        if full {
            for c in [KUBE_POSTROUTING, KUBE_MARK_MASQ] {
                b.line(&format!(":{c} - [0:0]"));
            }
            if append.nodeports {
                b.line(&format!(":{KUBE_NODEPORTS} - [0:0]"));
            }
            b.lines(&masquerade_rules(&ctx));
            b.end_unit().map_err(SyncError::Restore)?;
        }
        let mut changes = Changes::default();
        write_service_ports(
            &mut self.services, state, &ctx, full, append, &mut changes, &mut report, &mut b,
        )
        .map_err(SyncError::Restore)?;
        let fragments: Vec<&ServiceFragment> = state
            .service_ports
            .iter()
            .filter_map(|sps| self.services.get(&sps.port.name).map(|c| &c.fragment))
            .collect();

        // 2–4. The fixed chains, filter, and what goes.
        let tail = nodeports_tail(&ctx);
        let services = plan_chain(
            listed.as_ref().map(|l| l.services.as_slice()),
            append.services,
            &changes.services_edits,
            changes.services_changed,
            &fragments,
            |f| &f.services_rules,
            &tail,
        );
        let nodeports = plan_chain(
            listed.as_ref().map(|l| l.nodeports.as_slice()),
            append.nodeports,
            &changes.nodeports_edits,
            changes.nodeports_changed,
            &fragments,
            |f| &f.nodeports_rules,
            "",
        );
        let filter = if prev.is_none() || changes.filter_changed {
            Some(filter_section(&ctx, fragments.iter().copied()))
        } else {
            None
        };
        let mut stale = match &listed {
            Some(l) => {
                let active: HashSet<&str> = fragments
                    .iter()
                    .flat_map(|f| f.chains.iter().map(String::as_str))
                    .collect();
                l.service_chains
                    .iter()
                    .filter(|c| !active.contains(c.as_str()))
                    .cloned()
                    .collect()
            }
            None => std::mem::take(&mut changes.stale),
        };
        stale.sort();
        stale.dedup();
        report.removed_objects = stale.len();
        let fixed = FixedWrites {
            services,
            nodeports,
            tail: &tail,
            whole_first: changes.gained_endpoints,
        };
        write_fixed_and_filter(&mut b, &fixed, &fragments, filter.as_deref(), &stale).map_err(SyncError::Restore)?;
        let b = b.finish().map_err(SyncError::Restore)?;
        report.operations = b.operations;
        report.tables = b.tables;
        let filter = match (filter, prev) {
            (Some(f), _) => f,
            (None, Some(p)) => p.filter,
            (None, None) => String::new(),
        };
        self.applied = Some(Applied { ctx, filter });
        Ok(report)
    }

    /// The rules we own in filter and nat after a successful sync, with what `written` says
    /// the sync wrote there.
    fn owned_rules(&self, written: Vec<TableRules>) -> Vec<TableRules> {
        let count = |text: &str| text.lines().filter(|l| l.starts_with("-A ")).count();
        let Some(applied) = &self.applied else {
            return written;
        };
        let nat = count(&masquerade_rules(&applied.ctx))
            + count(&nodeports_tail(&applied.ctx))
            + self
                .services
                .values()
                .map(|c| count(&c.fragment.services_rules) + count(&c.fragment.nodeports_rules) + c.chain_rules)
                .sum::<usize>();
        let owned = [("filter", count(&applied.filter)), ("nat", nat)];
        owned
            .into_iter()
            .map(|(table, total)| TableRules {
                table: table.to_string(),
                total,
                written: written.iter().find(|w| w.table == table).map_or(0, |w| w.written),
            })
            .collect()
    }

    /// What a full sync does before the restore: our fixed chains, the jump rules from the
    /// built-in chains (upstream's `iptablesJumpChains`), and the canary chains.
    fn ensure_setup(&mut self) -> Result<(), ExecError> {
        for j in jump_rules() {
            let target = j.args.last().cloned().unwrap_or_default();
            self.ipt.ensure_chain(j.table, &target)?;
            self.ipt.ensure_rule_first(j.table, j.chain, &j.args)?;
        }
        for table in CANARY_TABLES {
            self.ipt.ensure_chain(table, KUBE_PROXY_CANARY)?;
        }
        Ok(())
    }
}

/// What a full sync reads of the nat table (`iptables-save -t nat`, line by line): the
/// per-service chains there, and the rules of KUBE-SERVICES and KUBE-NODEPORTS.
#[derive(Default)]
struct Listed {
    service_chains: Vec<String>,
    services: Vec<String>,
    nodeports: Vec<String>,
}

impl Listed {
    fn read<I: Iptables + ?Sized>(ipt: &mut I) -> Result<Listed, ExecError> {
        let mut l = Listed::default();
        let services = format!("-A {KUBE_SERVICES} ");
        let nodeports = format!("-A {KUBE_NODEPORTS} ");
        ipt.save_each("nat", &mut |line| {
            if let Some(decl) = line.strip_prefix(':') {
                let chain = decl.split_whitespace().next().unwrap_or("");
                if is_service_chain(chain) {
                    l.service_chains.push(chain.to_string());
                }
            } else if line.starts_with(&services) {
                l.services.push(line.to_string());
            } else if line.starts_with(&nodeports) {
                l.nodeports.push(line.to_string());
            }
        })?;
        Ok(l)
    }
}

/// Which fixed chains a full sync fills by appending (they hold no rule yet).
#[derive(Clone, Copy, Default)]
struct Append {
    services: bool,
    nodeports: bool,
}

/// Renders what changed (everything on a full sync) into `cache`, writing each changed
/// Service's chains as one unit (with its lines of the fixed chains it appends to) and noting
/// in `changes` what that means for the fixed chains. The work is proportional to the number
/// of changed service ports, except for cheap comparisons of the others.
#[allow(clippy::too_many_arguments)]
fn write_service_ports<I: Iptables + ?Sized>(
    cache: &mut HashMap<ServicePortName, CachedService>,
    state: &ProxyState,
    ctx: &RenderContext,
    full: bool,
    append: Append,
    changes: &mut Changes,
    report: &mut SyncReport,
    b: &mut Batches<'_, I>,
) -> Result<(), ExecError> {
    let mut old = std::mem::take(cache);
    for sps in &state.service_ports {
        let key = &sps.port.name;
        let previous = old.remove(key);
        let unchanged = !full && previous.as_ref().is_some_and(|p| p.state == *sps);
        if unchanged && let Some(p) = previous {
            cache.insert(key.clone(), p);
            continue;
        }
        let mut fragment = render_service(sps, ctx);
        match &previous {
            Some(p) => {
                report.udp_endpoints_removed |= p.state.loses_udp_endpoints_to(sps);
                changes.replaced(&p.fragment, &fragment);
            }
            None => changes.added(&fragment),
        }
        for c in &fragment.chains {
            b.line(&format!(":{c} - [0:0]"));
        }
        b.lines(&fragment.chain_rules);
        if append.services {
            b.lines(&fragment.services_rules);
        }
        if append.nodeports {
            b.lines(&fragment.nodeports_rules);
        }
        b.end_unit()?;
        report.rewritten_services += 1;
        let chain_rules = fragment.chain_rules.lines().count();
        fragment.chain_rules = String::new();
        cache.insert(
            key.clone(),
            CachedService {
                state: sps.clone(),
                fragment,
                chain_rules,
            },
        );
    }
    // Service ports that are gone.
    for gone in old.values() {
        report.udp_endpoints_removed |= gone.state.port.protocol == crate::model::Protocol::Udp;
        changes.removed(&gone.fragment);
    }
    Ok(())
}

/// How a sync writes KUBE-SERVICES (`tail`: its last rule) or KUBE-NODEPORTS (no tail):
/// appended to with the Services on a full sync into an empty chain; on another full sync, the
/// kernel's lines (`listed`) brought to the rendered ones; on a partial sync, the lines of the
/// changed Services (`edits`) edited.
fn plan_chain(
    listed: Option<&[String]>,
    append: bool,
    edits: &LineEdits,
    changed: bool,
    fragments: &[&ServiceFragment],
    lines_of: impl Fn(&ServiceFragment) -> &String,
    tail: &str,
) -> ChainWrite {
    let contested = |near: &[String]| contested(fragments.iter().map(|f| lines_of(f).as_str()), near);
    let wanted = || -> Vec<&str> {
        fragments
            .iter()
            .flat_map(|f| lines_of(f).lines())
            .chain(tail.lines())
            .collect()
    };
    let edits = match listed {
        Some(_) if append => return ChainWrite::Append,
        Some(listed) => {
            let e = diff_saved(listed, &wanted());
            // The last rule cannot be inserted at the top.
            if tail.lines().any(|t| e.new.iter().any(|n| n == t)) {
                return ChainWrite::Whole;
            }
            e
        }
        None if !changed => return ChainWrite::No,
        None => Edits {
            gone: edits.gone.clone(),
            new: wanted()
                .into_iter()
                .filter(|l| edits.new.contains(*l))
                .map(str::to_string)
                .collect(),
        },
    };
    if edits.new.is_empty() {
        return edits.into_write(&HashSet::new());
    }
    let contested = contested(&edits.new);
    edits.into_write(&contested)
}

/// Steps 2–4 of a sync (see the module documentation).
struct FixedWrites<'a> {
    services: ChainWrite,
    nodeports: ChainWrite,
    /// The last rule of KUBE-SERVICES.
    tail: &'a str,
    /// A chain written whole goes before filter (some Service gained endpoints), not after.
    whole_first: bool,
}

/// A Service's lines of one fixed chain.
type LinesOf = fn(&ServiceFragment) -> &String;

fn write_fixed_and_filter<I: Iptables + ?Sized>(
    b: &mut Batches<'_, I>,
    w: &FixedWrites<'_>,
    fragments: &[&ServiceFragment],
    filter: Option<&str>,
    stale: &[String],
) -> Result<(), ExecError> {
    let chains: [(&str, &ChainWrite, LinesOf, &str); 2] = [
        (KUBE_SERVICES, &w.services, |f| &f.services_rules, w.tail),
        (KUBE_NODEPORTS, &w.nodeports, |f| &f.nodeports_rules, ""),
    ];
    let whole = |b: &mut Batches<'_, I>, chain: &str, lines_of: LinesOf, tail: &str| {
        b.line(&format!(":{chain} - [0:0]"));
        for f in fragments {
            b.lines(lines_of(f));
        }
        b.lines(tail);
        b.end_unit()
    };
    // 2. What the fixed chains gain.
    b.section("nat");
    for (chain, write, lines_of, tail) in chains {
        match write {
            ChainWrite::Append => {
                b.lines(tail);
                b.end_unit()?;
            }
            ChainWrite::InPlace(e) => {
                for line in e.inserts() {
                    b.line(&line);
                    b.end_unit()?;
                }
            }
            ChainWrite::Whole if w.whole_first => whole(b, chain, lines_of, tail)?,
            ChainWrite::Whole | ChainWrite::No => {}
        }
    }
    // 3. filter.
    if let Some(filter) = filter {
        b.section("filter");
        b.lines(filter.trim_start_matches("*filter\n").trim_end_matches("COMMIT\n"));
        b.end_unit()?;
    }
    // 4. What the fixed chains lose, and the chains no longer used: flushed first (they may
    // jump to each other), then deleted.
    b.section("nat");
    for (chain, write, lines_of, tail) in chains {
        match write {
            ChainWrite::InPlace(e) => {
                for line in e.deletes() {
                    b.line(&line);
                    b.end_unit()?;
                }
            }
            ChainWrite::Whole if !w.whole_first => whole(b, chain, lines_of, tail)?,
            _ => {}
        }
    }
    delete_chains(b, stale)
}

/// Flushes `chains` (they may jump to each other), then deletes them, in the open table.
fn delete_chains<I: Iptables + ?Sized>(b: &mut Batches<'_, I>, chains: &[String]) -> Result<(), ExecError> {
    for c in chains {
        b.line(&format!(":{c} - [0:0]"));
        b.end_unit()?;
    }
    for c in chains {
        b.line(&format!("-X {c}"));
        b.end_unit()?;
    }
    Ok(())
}

/// What the service ports rendered in one sync change besides their own chains.
#[derive(Default)]
struct Changes {
    /// A service port has endpoints that had none (or is new with endpoints).
    gained_endpoints: bool,
    /// The content of nat KUBE-SERVICES, nat KUBE-NODEPORTS and the filter table changed.
    services_changed: bool,
    nodeports_changed: bool,
    filter_changed: bool,
    /// The lines of nat KUBE-SERVICES and KUBE-NODEPORTS that go and that come.
    services_edits: LineEdits,
    nodeports_edits: LineEdits,
    /// The chains we stopped using.
    stale: Vec<String>,
}

/// The lines of one fixed chain that a sync removes and adds (`-A CHAIN …` as rendered).
#[derive(Default)]
struct LineEdits {
    gone: Vec<String>,
    new: HashSet<String>,
}

impl LineEdits {
    fn diff(&mut self, old: &str, new: &str) {
        let old_lines: HashSet<&str> = old.lines().collect();
        let new_lines: HashSet<&str> = new.lines().collect();
        self.gone
            .extend(old.lines().filter(|l| !new_lines.contains(l)).map(str::to_string));
        self.new
            .extend(new.lines().filter(|l| !old_lines.contains(l)).map(str::to_string));
    }
}

impl Changes {
    /// A service port's fragment `old` was rendered again as `new`.
    fn replaced(&mut self, old: &ServiceFragment, new: &ServiceFragment) {
        self.gained_endpoints |= new.has_endpoints && !old.has_endpoints;
        self.services_changed |= old.services_rules != new.services_rules;
        self.nodeports_changed |= old.nodeports_rules != new.nodeports_rules;
        self.filter_changed |= old.filter_rules != new.filter_rules;
        self.services_edits.diff(&old.services_rules, &new.services_rules);
        self.nodeports_edits.diff(&old.nodeports_rules, &new.nodeports_rules);
        self.stale
            .extend(old.chains.iter().filter(|c| !new.chains.contains(c)).cloned());
    }

    /// A new service port.
    fn added(&mut self, new: &ServiceFragment) {
        self.gained_endpoints |= new.has_endpoints;
        self.services_changed |= !new.services_rules.is_empty();
        self.nodeports_changed |= !new.nodeports_rules.is_empty();
        self.filter_changed |= !new.filter_rules.is_empty();
        self.services_edits.diff("", &new.services_rules);
        self.nodeports_edits.diff("", &new.nodeports_rules);
    }

    /// A service port that is gone.
    fn removed(&mut self, old: &ServiceFragment) {
        self.services_changed |= !old.services_rules.is_empty();
        self.nodeports_changed |= !old.nodeports_rules.is_empty();
        self.filter_changed |= !old.filter_rules.is_empty();
        self.services_edits.diff(&old.services_rules, "");
        self.nodeports_edits.diff(&old.nodeports_rules, "");
        self.stale.extend(old.chains.iter().cloned());
    }
}

/// Chain names declared in `iptables-save` output.
pub fn existing_chains(saved: &str) -> Vec<String> {
    saved
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Removes everything kube-proxy owns in one family (`--cleanup`): jump rules, our chains in
/// nat and filter (fixed ones and per-service ones), and the canaries. Errors are collected,
/// not fatal: cleanup does as much as it can.
pub fn cleanup<I: Iptables>(ipt: &mut I) -> Vec<String> {
    let mut errors = Vec::new();
    for j in jump_rules() {
        if let Err(e) = ipt.delete_rule(j.table, j.chain, &j.args) {
            errors.push(e.to_string());
        }
    }
    for table in ["nat", "filter"] {
        let fixed = super::names::fixed_chains(table);
        let mut doomed: Vec<String> = Vec::new();
        let listed = ipt.save_each(table, &mut |line| {
            if let Some(c) = line.strip_prefix(':').and_then(|d| d.split_whitespace().next())
                && (fixed.contains(&c) || (table == "nat" && is_service_chain(c)))
            {
                doomed.push(c.to_string());
            }
        });
        if let Err(e) = listed {
            errors.push(e.to_string());
            continue;
        }
        let mut b = Batches::new(ipt);
        b.section(table);
        if let Err(e) = delete_chains(&mut b, &doomed).and_then(|()| b.finish().map(drop)) {
            errors.push(e.to_string());
        }
    }
    if let Err(e) = ipt.delete_chain("mangle", KUBE_PROXY_CANARY) {
        errors.push(e.to_string());
    }
    errors
}

// === impl proxy::Proxier ===

impl<I: Iptables> Proxier for IptablesProxier<I> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn family(&self) -> IpFamily {
        self.ipt.family()
    }

    fn configure(&mut self, ctx: &SyncContext<'_>) {
        let mut opts = IptablesRenderOptions::from_config(ctx.config, self.ipt.family(), ctx.node);
        opts.tcp_be_liberal = ctx.tcp_be_liberal;
        // Whether the nfacct counters exist was settled when the proxier was made (at start).
        opts.nfacct = self.opts.nfacct;
        self.set_options(opts);
    }

    fn sync_full(&mut self, state: &ProxyState) -> Result<SyncReport, proxy::SyncError> {
        self.force_full_sync();
        self.sync_changes(state)
    }

    fn sync_changes(&mut self, state: &ProxyState) -> Result<SyncReport, proxy::SyncError> {
        let mut report = self
            .sync(state)
            .map_err(|e| proxy::SyncError::new(self.last_attempt_full, e))?;
        report.tables = self.owned_rules(std::mem::take(&mut report.tables));
        Ok(report)
    }

    fn intact(&mut self) -> bool {
        self.canaries_intact()
    }

    fn full_sync_period(&self) -> Option<Duration> {
        Some(FULL_SYNC_PERIOD)
    }

    fn cleanup(&mut self) -> Vec<String> {
        self.applied = None;
        cleanup(&mut self.ipt)
    }

    fn read_back(&mut self, port: &ServicePort) -> Result<Programmed, ReadBackError> {
        if !self.ipt.lists_chains_alone() {
            return Ok(self.read_back_all(&[port])?.remove(0));
        }
        let sections = super::readback::read_port(&mut self.ipt, port)?;
        Ok(Programmed { sections })
    }

    fn read_back_all(&mut self, ports: &[&ServicePort]) -> Result<Vec<Programmed>, ReadBackError> {
        let mut tables = Vec::new();
        for table in ["filter", "nat"] {
            // The filter table holds no chains of service ports, only their rules in a few
            // fixed chains; saving it would fetch nat's 110,000 chains too at 10,000 × 10.
            let saved = if let Some(saved) = self.ipt.save_over_netlink(table) {
                saved
            } else if table == "filter" && self.ipt.lists_chains_alone() {
                super::readback::fixed_chains(&mut self.ipt, table)?
            } else {
                self.ipt.save_counters(table).map_err(|e| ReadBackError {
                    what: format!("the {table} table"),
                    message: e.to_string(),
                })?
            };
            tables.push(super::readback::SavedTable::parse(table, &saved));
        }
        Ok(ports
            .iter()
            .map(|port| Programmed {
                sections: tables.iter().flat_map(|t| t.sections(port)).collect(),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LocalDetector;
    use crate::iptables::exec::Fake;
    use crate::iptables::render::render;
    use crate::model::Protocol;

    fn opts() -> IptablesRenderOptions {
        IptablesRenderOptions {
            common: crate::proxy::RenderOptions {
                local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
                ..crate::proxy::RenderOptions::default()
            },
            ..IptablesRenderOptions::default()
        }
    }

    fn port(name: &str, ip: u8, proto: Protocol, endpoints: &[u8]) -> ServicePortState {
        crate::model::testing::port("ns", name, ip, proto, endpoints)
    }

    fn state(ports: Vec<ServicePortState>) -> ProxyState {
        crate::model::testing::state(ports, &[])
    }

    fn declared(input: &str) -> Vec<&str> {
        input
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .map(|l| l.split(' ').next().unwrap_or(""))
            .collect()
    }

    #[test]
    fn first_sync_is_full_and_leaves_what_render_writes() {
        let st = state(vec![
            port("a", 1, Protocol::Tcp, &[1, 2]),
            port("b", 2, Protocol::Tcp, &[]),
        ]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        let r = p.sync(&st).unwrap();
        assert!(r.full);
        let ipt = p.iptables();
        assert!(ipt.chains.contains("nat/KUBE-PROXY-CANARY") && ipt.chains.contains("mangle/KUBE-PROXY-CANARY"));
        assert!(
            ipt.rules
                .iter()
                .any(|r| r.starts_with("nat/PREROUTING ") && r.ends_with("-j KUBE-SERVICES"))
        );
        assert_eq!(ipt.restores.len(), 1);
        let mut tables = Tables::default();
        tables.apply(&ipt.restores[0]);
        assert_eq!(tables, Tables::of(&render(&st, &opts()).restore), "in order");
        // A Service's jump comes in the commit that creates its chains, after them.
        let input = &ipt.restores[0];
        let a = crate::iptables::names::service_port_chains("ns/a:p", "tcp").cluster;
        assert!(
            input.find(&format!(":{a} ")) < input.find(&format!("-j {a}")),
            "{input}"
        );
    }

    #[test]
    fn configure_keeps_the_nfacct_counters_the_proxier_was_made_with() {
        let cfg = crate::config::ProxyConfig::resolve(&crate::config::Flags::default()).unwrap();
        let node = crate::model::NodeInfo::default();
        let ctx = SyncContext {
            config: &cfg,
            node: &node,
            tcp_be_liberal: false,
        };
        let with = IptablesRenderOptions {
            nfacct: true,
            ..IptablesRenderOptions::default()
        };
        let st = state(vec![port("a", 1, Protocol::Tcp, &[1])]);
        for (opts, counted) in [(with, true), (IptablesRenderOptions::default(), false)] {
            let mut p = IptablesProxier::new(Fake::default(), opts);
            p.configure(&ctx);
            p.sync(&st).unwrap();
            let restore = &p.iptables().restores[0];
            assert_eq!(
                restore.contains("-m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP"),
                counted,
                "{restore}"
            );
        }
    }

    #[test]
    fn unchanged_state_writes_nothing() {
        let st = state(vec![port("a", 1, Protocol::Tcp, &[1, 2])]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        p.sync(&st).unwrap();
        let r = p.sync(&st).unwrap();
        assert!(!r.full);
        assert_eq!(r.operations, 0);
        assert_eq!(p.iptables().restores.len(), 1);
    }

    #[test]
    fn endpoint_change_rewrites_only_that_service() {
        let before = state(vec![
            port("a", 1, Protocol::Tcp, &[1, 2]),
            port("b", 2, Protocol::Tcp, &[3]),
        ]);
        let after = state(vec![
            port("a", 1, Protocol::Tcp, &[1]),
            port("b", 2, Protocol::Tcp, &[3]),
        ]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        p.sync(&before).unwrap();
        let r = p.sync(&after).unwrap();
        assert!(!r.full && r.rewritten_services == 1 && r.removed_objects == 1, "{r:?}");
        let input = p.iptables().restores.last().unwrap().clone();
        assert!(!input.contains("*filter"), "filter unchanged: {input}");
        let chains = declared(&input);
        let a = crate::iptables::names::service_port_chains("ns/a:p", "tcp");
        let gone = crate::iptables::names::endpoint_chain("ns/a:p", "tcp", "10.244.1.2:8080");
        assert!(
            chains.contains(&a.cluster.as_str()) && chains.contains(&gone.as_str()),
            "{input}"
        );
        assert!(
            !chains.contains(&"KUBE-SERVICES"),
            "KUBE-SERVICES is unchanged: {input}"
        );
        assert!(!input.contains("ns/b:p"), "service b untouched: {input}");
        assert!(input.contains(&format!("-X {gone}")));
    }

    #[test]
    fn new_service_inserts_its_kube_services_rule_and_losing_endpoints_orders_filter_first() {
        let one = state(vec![port("a", 1, Protocol::Tcp, &[1])]);
        let two = state(vec![
            port("a", 1, Protocol::Tcp, &[1]),
            port("b", 2, Protocol::Tcp, &[3]),
        ]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        p.sync(&one).unwrap();
        p.sync(&two).unwrap();
        let input = p.iptables().restores.last().unwrap().clone();
        assert!(
            !declared(&input).contains(&"KUBE-SERVICES"),
            "not rewritten whole: {input}"
        );
        assert!(
            input.contains("-I KUBE-SERVICES 1 -m comment --comment \"ns/b:p cluster IP\""),
            "b's rule inserted at the top: {input}"
        );
        assert!(input.starts_with("*nat"), "gaining endpoints: DNAT first: {input}");
        let none = state(vec![
            port("a", 1, Protocol::Tcp, &[1]),
            port("b", 2, Protocol::Tcp, &[]),
        ]);
        p.sync(&none).unwrap();
        let input = p.iptables().restores.last().unwrap().clone();
        assert!(
            input.starts_with("*filter") && input.contains("ns/b:p has no endpoints"),
            "{input}"
        );
        let b = crate::iptables::names::service_port_chains("ns/b:p", "tcp").cluster;
        assert!(
            input.contains("-D KUBE-SERVICES -m comment --comment \"ns/b:p cluster IP\"")
                && input.contains(&format!("-X {b}")),
            "only b's rule goes, before its chain: {input}"
        );
        assert!(input.find("-D KUBE-SERVICES") < input.find(&format!("-X {b}")));
    }

    /// A model of the tables `iptables-restore --noflush` input builds: table → chain → rules
    /// (as `-A CHAIN …`), with the commands the proxier sends. Like the kernel it refuses a
    /// `-D` of a rule that is not there, an `-I` past the end, and a `-X` of a chain that holds
    /// rules or that a rule jumps to.
    #[derive(Default, Debug, PartialEq)]
    struct Tables(std::collections::BTreeMap<String, std::collections::BTreeMap<String, Vec<String>>>);

    impl Tables {
        fn of(input: &str) -> Tables {
            let mut t = Tables::default();
            t.apply(input);
            t
        }

        fn apply(&mut self, input: &str) {
            let mut table = String::new();
            for line in input.lines() {
                let words: Vec<&str> = line.splitn(3, ' ').collect();
                if let Some(t) = line.strip_prefix('*') {
                    table = t.to_string();
                    self.0.entry(table.clone()).or_default();
                    continue;
                }
                let chains = self.0.get_mut(&table).expect("a table first");
                if let Some(decl) = line.strip_prefix(':') {
                    let chain = decl.split_whitespace().next().unwrap().to_string();
                    chains.insert(chain, Vec::new());
                    continue;
                }
                match words.as_slice() {
                    ["-A", chain, rest] => chains
                        .entry(chain.to_string())
                        .or_default()
                        .push(format!("-A {chain} {rest}")),
                    ["-D", chain, rest] => {
                        let rules = chains.get_mut(*chain).expect("chain exists");
                        let i = rules
                            .iter()
                            .position(|r| *r == format!("-A {chain} {rest}"))
                            .unwrap_or_else(|| panic!("no rule to delete: {line}"));
                        rules.remove(i);
                    }
                    ["-I", chain, rest] => {
                        let (n, spec) = rest.split_once(' ').unwrap();
                        let n: usize = n.parse().unwrap();
                        let rules = chains.get_mut(*chain).expect("chain exists");
                        assert!(n >= 1 && n <= rules.len() + 1, "index of insertion too big: {line}");
                        rules.insert(n - 1, format!("-A {chain} {spec}"));
                    }
                    ["-X", chain] | ["-X", chain, ..] => {
                        let rules = chains.remove(*chain).unwrap_or_default();
                        assert!(rules.is_empty(), "-X of a chain with rules: {line}");
                        let target = format!(" -j {chain}");
                        assert!(
                            !chains.values().flatten().any(|r| r.ends_with(&target)),
                            "-X of a chain still jumped to: {line}"
                        );
                    }
                    ["COMMIT"] | [""] => {}
                    other => panic!("unexpected line {other:?}"),
                }
            }
        }

        /// The tables with the rules of nat KUBE-SERVICES and KUBE-NODEPORTS sorted, but for
        /// the NodePort rule, which must be the last (checked): their order does not matter.
        fn canonical(&self) -> Tables {
            let mut t = Tables(self.0.clone());
            if let Some(nat) = t.0.get_mut("nat") {
                for chain in [KUBE_SERVICES, KUBE_NODEPORTS] {
                    let Some(rules) = nat.get_mut(chain) else { continue };
                    let tail = rules.iter().position(|r| r.contains("-j KUBE-NODEPORTS"));
                    if let Some(i) = tail {
                        assert_eq!(i, rules.len() - 1, "the NodePort rule is the last: {rules:?}");
                        rules.pop();
                    }
                    rules.sort();
                    if let Some(i) = tail {
                        rules.push(self.0["nat"][chain][i].clone());
                    }
                }
            }
            t
        }
    }

    fn node_port_state(step: &[u8]) -> ProxyState {
        let ports: Vec<ServicePortState> = step
            .iter()
            .enumerate()
            .filter(|(_, n)| **n != 4)
            .map(|(i, n)| {
                let eps: Vec<u8> = (1..=*n).map(|e| e + 10 * i as u8).collect();
                let mut sp = port(&format!("s{i}"), i as u8 + 1, Protocol::Tcp, &eps);
                if i % 2 == 0 {
                    sp.port.node_port = 30000 + i as u16;
                }
                sp
            })
            .collect();
        state(ports)
    }

    proptest::proptest! {
        /// After any sequence of states synced incrementally (Services coming and going,
        /// gaining and losing endpoints, NodePorts), split into runs of a few lines, the tables
        /// hold what a full render of the last state writes into empty tables (the rules of
        /// KUBE-SERVICES and KUBE-NODEPORTS in any order, the NodePort rule last); and a full
        /// sync puts them back in rendered order.
        #[test]
        fn incremental_syncs_leave_what_a_full_render_leaves(
            steps in proptest::collection::vec(proptest::collection::vec(0u8..5, 6), 1..12),
            batch in 1usize..40,
        ) {
            let fake = Fake { batch: Some(batch), ..Fake::default() };
            let mut p = IptablesProxier::new(fake, opts());
            let mut tables = Tables::default();
            for step in &steps {
                let st = node_port_state(step);
                p.sync(&st).unwrap();
                tables.apply(&p.iptables().restored());
                p.iptables().restores.clear();
                let fresh = Tables::of(&render(&st, &opts()).restore);
                proptest::prop_assert_eq!(tables.canonical(), fresh.canonical());
            }
        }
    }

    #[test]
    fn one_sync_split_into_runs_keeps_every_service_reachable() {
        // Ten Services, runs of about 8 lines: s0 loses its endpoints, s1 gains its first, the
        // others change theirs.
        let before: Vec<ServicePortState> = (0..10u8)
            .map(|i| {
                port(
                    &format!("s{i}"),
                    i + 1,
                    Protocol::Tcp,
                    if i == 1 { &[] } else { &[1, 2] },
                )
            })
            .collect();
        let mut after = before.clone();
        after[0].endpoints.clear();
        after[1] = port("s1", 2, Protocol::Tcp, &[7]);
        for sp in &mut after[2..] {
            sp.endpoints.pop();
        }
        let fake = Fake {
            batch: Some(8),
            ..Fake::default()
        };
        let mut p = IptablesProxier::new(fake, opts());
        p.sync(&state(before.clone())).unwrap();
        let mut tables = Tables::of(&p.iptables().restored());
        p.iptables().restores.clear();
        p.sync(&state(after.clone())).unwrap();
        let runs = p.iptables().restores.clone();
        assert!(runs.len() > 3, "{runs:?}");
        let input = runs.concat();
        let chains = |name: &str| crate::iptables::names::service_port_chains(&format!("ns/{name}:p"), "tcp");
        let (s0, s1) = (chains("s0").cluster, chains("s1").cluster);
        let pos = |needle: &str| input.find(needle).unwrap_or_else(|| panic!("{needle} in {input}"));
        // s1: chains, then its jump, then its REJECT goes (filter written whole after it).
        assert!(pos(&format!(":{s1} ")) < pos("-I KUBE-SERVICES 1 -m comment --comment \"ns/s1:p"));
        assert!(pos("-I KUBE-SERVICES 1") < pos("*filter"));
        // s0: its REJECT comes (filter) before its jump goes, and its chain goes after that.
        assert!(pos("*filter") < pos("-D KUBE-SERVICES -m comment --comment \"ns/s0:p"));
        assert!(pos("-D KUBE-SERVICES") < pos(&format!("-X {s0}")));
        // Every run holds whole units: a chain declared is filled in the same run.
        for run in &runs {
            for decl in run.lines().filter_map(|l| l.strip_prefix(':')) {
                let c = decl.split(' ').next().unwrap();
                let filled = run.contains(&format!("-A {c} ")) || run.contains(&format!("-X {c}"));
                assert!(filled || c.starts_with("KUBE-"), "{c} declared empty in {run}");
            }
            tables.apply(run);
        }
        let fresh = Tables::of(&render(&state(after), &opts()).restore);
        assert_eq!(tables.canonical(), fresh.canonical());
    }

    #[test]
    fn two_services_on_one_address_write_kube_services_whole() {
        let a = port("a", 1, Protocol::Tcp, &[1]);
        let mut b = port("b", 2, Protocol::Tcp, &[]);
        b.port.external_ips = vec!["10.96.0.1".parse().unwrap()];
        b.port.cluster_ip = "10.96.0.9".parse().unwrap();
        let mut b_up = b.clone();
        b_up.endpoints = port("x", 0, Protocol::Tcp, &[3]).endpoints;
        // a's ClusterIP is b's externalIP, on the same port: a's rule must stay first.
        assert_eq!(a.port.cluster_ip, b.port.external_ips[0]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        p.sync(&state(vec![a.clone(), b])).unwrap();
        p.sync(&state(vec![a.clone(), b_up.clone()])).unwrap();
        let input = p.iptables().restores.last().unwrap().clone();
        assert!(declared(&input).contains(&"KUBE-SERVICES"), "written whole: {input}");
        let mut tables = Tables::of(&p.iptables().restored());
        let fresh = Tables::of(&render(&state(vec![a, b_up]), &opts()).restore);
        tables.0.retain(|_, t| !t.is_empty());
        assert_eq!(
            tables.0["nat"][KUBE_SERVICES], fresh.0["nat"][KUBE_SERVICES],
            "in rendered order"
        );
    }

    #[test]
    fn failure_forces_a_full_sync_and_full_sync_deletes_leftovers() {
        let st = state(vec![port("a", 1, Protocol::Tcp, &[1])]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        p.sync(&st).unwrap();
        p.iptables().fail_next_restore = Some("iptables-restore: line 2 failed".into());
        let changed = state(vec![port("a", 1, Protocol::Tcp, &[1, 2])]);
        let err = p.sync(&changed).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        p.iptables().saved.insert(
            "nat".into(),
            ":KUBE-SEP-LEFTOVER1234567 - [0:0]\n:OTHER - [0:0]\n".into(),
        );
        let r = p.sync(&changed).unwrap();
        assert!(r.full && r.removed_objects == 1, "{r:?}");
        let input = p.iptables().restores.last().unwrap().clone();
        assert!(
            input.contains("-X KUBE-SEP-LEFTOVER1234567") && !input.contains("-X OTHER"),
            "{input}"
        );
    }

    #[test]
    fn udp_endpoint_loss_is_reported_for_conntrack_cleanup() {
        let before = state(vec![port("dns", 10, Protocol::Udp, &[1, 2])]);
        let after = state(vec![port("dns", 10, Protocol::Udp, &[2])]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        assert!(!p.sync(&before).unwrap().udp_endpoints_removed);
        assert!(p.sync(&after).unwrap().udp_endpoints_removed);
        let more = state(vec![port("dns", 10, Protocol::Udp, &[2, 3])]);
        assert!(!p.sync(&more).unwrap().udp_endpoints_removed);
    }

    #[test]
    fn canaries() {
        let mut p = IptablesProxier::new(Fake::default(), opts());
        assert!(!p.canaries_intact());
        p.sync(&state(vec![])).unwrap();
        assert!(p.canaries_intact());
        p.iptables().rules.retain(|r| !r.starts_with("nat/PREROUTING"));
        assert!(!p.canaries_intact(), "a flushed PREROUTING counts as lost");
    }

    #[test]
    fn a_large_full_sync_is_split_into_runs_and_never_touches_foreign_rules() {
        let many: Vec<u8> = (1..=250).collect();
        let ports: Vec<ServicePortState> = (0..10)
            .map(|i| port(&format!("s{i}"), i as u8 + 1, Protocol::Tcp, &many))
            .collect();
        let st = state(ports);
        let mut fake = Fake::default();
        fake.saved.insert(
            "nat".into(),
            "*nat\n:PREROUTING ACCEPT [0:0]\n:CNI-X - [0:0]\n-A PREROUTING -j CNI-X\nCOMMIT\n".into(),
        );
        let mut p = IptablesProxier::new(fake, opts());
        let r = p.sync(&st).unwrap();
        assert!(r.full);
        let ipt = p.iptables();
        let budget = crate::iptables::exec::NFT_BATCH_LINES;
        // 2,510 chains, 5,000 endpoint rules: a run per ~2,500 lines, each of whole Services
        // (one Service is 753 lines).
        assert!(ipt.restores.len() >= 3, "{}", ipt.restores.len());
        for run in &ipt.restores {
            assert!(run.lines().count() <= budget + 800, "{}", run.lines().count());
            assert!(
                !run.contains("CNI-X") && !run.contains("PREROUTING"),
                "foreign rules untouched"
            );
        }
        assert_eq!(ipt.restored().matches(":KUBE-SEP-").count(), 2500);
        let tables = Tables::of(&ipt.restored());
        assert_eq!(tables, Tables::of(&render(&st, &opts()).restore));
        // The next change is one run again.
        let mut fewer = st.clone();
        Arc::make_mut(&mut fewer.service_ports[0]).endpoints.pop();
        p.iptables().restores.clear();
        let r = p.sync(&fewer).unwrap();
        assert!(!r.full && r.removed_objects == 1);
        assert_eq!(p.iptables().restores.len(), 1);
    }

    #[test]
    fn a_full_sync_on_loaded_tables_leaves_unchanged_fixed_chains_alone() {
        let st = node_port_state(&[2, 1, 0, 3, 2, 1]);
        let mut p = IptablesProxier::new(Fake::default(), opts());
        p.sync(&st).unwrap();
        // What iptables-save lists of that (its own spelling: matches moved, /32 added).
        let respelled = |line: &str| {
            let l = line.replace("-m tcp -p tcp -d ", "-p tcp -m tcp -d ");
            match l.split_once(" -d ") {
                Some((head, rest)) => {
                    let (ip, tail) = rest.split_once(' ').unwrap();
                    format!("{head} -d {ip}/32 {tail}")
                }
                None => l,
            }
        };
        let saved: String = render(&st, &opts())
            .restore
            .lines()
            .skip_while(|l| *l != "*nat")
            .map(|l| format!("{}\n", respelled(l)))
            .collect();
        p.iptables().saved.insert("nat".into(), saved.clone());
        p.iptables().restores.clear();
        p.force_full_sync();
        let r = p.sync(&st).unwrap();
        assert!(r.full && r.removed_objects == 0, "{r:?}");
        let input = nat_only(&p.iptables().restored());
        assert!(
            !input.contains(" KUBE-SERVICES ")
                && !input.contains(" KUBE-NODEPORTS ")
                && !input.contains(":KUBE-SERVICES"),
            "{input}"
        );
        // A stale rule and a stale chain in the kernel go; a missing rule comes back.
        let dropped = saved
            .lines()
            .find(|l| l.starts_with("-A KUBE-SERVICES "))
            .unwrap()
            .to_string();
        let stale_rule = "-A KUBE-SERVICES -d 10.96.0.99/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-OLDOLDOLDOLDOLDO";
        let kernel = saved.replace(&format!("{dropped}\n"), "").replace(
            "COMMIT\n",
            &format!(":KUBE-SVC-OLDOLDOLDOLDOLDO - [0:0]\n{stale_rule}\nCOMMIT\n"),
        );
        p.iptables().saved.insert("nat".into(), kernel);
        p.iptables().restores.clear();
        p.force_full_sync();
        let r = p.sync(&st).unwrap();
        assert_eq!(r.removed_objects, 1);
        let input = p.iptables().restored();
        let spec = |l: &str| l.split_once(" KUBE-SERVICES ").unwrap().1.to_string();
        let inserted = render(&st, &opts())
            .restore
            .lines()
            .find(|l| normalized_eq(l, &dropped))
            .map(spec)
            .unwrap();
        assert!(input.contains(&format!("-I KUBE-SERVICES 1 {inserted}\n")), "{input}");
        assert!(
            input.contains(&format!("-D KUBE-SERVICES {}\n", spec(stale_rule))),
            "{input}"
        );
        assert!(input.find("-D KUBE-SERVICES") < input.find("-X KUBE-SVC-OLDOLDOLDOLDOLDO"));
        assert_eq!(
            input.matches("KUBE-SERVICES 1 ").count() + input.matches("-D KUBE-SERVICES").count(),
            2
        );
    }

    /// The lines of the `*nat` sections of restore input.
    fn nat_only(input: &str) -> String {
        let mut nat = false;
        let mut out = String::new();
        for line in input.lines() {
            if let Some(t) = line.strip_prefix('*') {
                nat = t == "nat";
            } else if nat {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    fn normalized_eq(a: &str, b: &str) -> bool {
        crate::iptables::edits::normalized(a) == crate::iptables::edits::normalized(b)
    }
}
