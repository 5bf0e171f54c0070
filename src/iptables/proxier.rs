//! The iptables proxier: keeps one family's kernel rules equal to the model. A full sync
//! (at start, after a failure, when the rendering context or the canaries change, and every
//! [`FULL_SYNC_PERIOD`], which the daemon schedules) writes every chain and deletes stale ones found with `iptables-save`; a
//! partial sync rewrites only the chains of service ports whose state changed, plus the fixed
//! chains whose content changed, and deletes the chains it stopped using.
//!
//! Partial syncs skip unchanged fixed chains, where upstream rewrites them every time: with
//! iptables-nft each rewritten jump rule costs a scan of every chain, so rewriting
//! KUBE-SERVICES dominates an endpoint change at 10k Services (see the README's figures).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::exec::{ExecError, Iptables};
use super::names::{
    KUBE_MARK_MASQ, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_PROXY_CANARY, KUBE_SERVICES, is_service_chain,
};
use super::render::{
    IptablesRenderOptions, RenderContext, ServiceFragment, filter_section, jump_rules, masquerade_rules, nat_section,
    nodeports_tail, render_service,
};
use super::replace::merge_table;
use crate::config::ProxyMode;
use crate::model::{IpFamily, ProxyState, ServicePort, ServicePortName, ServicePortState};
use crate::proxy::{
    self, Programmed, Proxier, ReadBackError, SyncContext, SyncReport, TableRules, restore_operations, rules_written,
};

/// Upstream's `FullSyncPeriod`: a full sync at least this often.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// A full sync that declares more chains than this replaces the nat and filter tables in one
/// flush-mode restore (keeping other components' rules, see [`super::replace`]) instead of
/// `--noflush`, whose cost grows with chains² in iptables-nft (1.1 s at 5.5k chains, > 300 s at
/// 110k, against 0.2 s and 10 s in flush mode).
pub const REPLACE_TABLES_ABOVE_CHAINS: usize = 2000;

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
    fragment: ServiceFragment,
}

/// What is in the kernel after the last successful sync.
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
        let chain_count: usize = state.service_ports.iter().map(|s| s.endpoints.len() + 1).sum();
        let by_replacing = full && chain_count > REPLACE_TABLES_ABOVE_CHAINS;
        if full && !by_replacing {
            self.ensure_setup().map_err(SyncError::Setup)?;
        }

        let mut changes = Changes::default();
        let order = self.render_service_ports(state, &ctx, full, &mut changes, &mut report);
        report.rewritten_services = order.iter().filter(|(_, changed)| *changed).count();
        let fragments: Vec<(&ServiceFragment, bool)> = order
            .iter()
            .map(|(k, changed)| (&self.services[*k].fragment, *changed))
            .collect();

        let prev = if full { None } else { self.applied.take() };
        let write = Writes {
            filter: prev.is_none() || changes.filter_changed,
            services: Write::of(prev.is_none(), changes.services_changed, &changes.services_edits),
            nodeports: Write::of(prev.is_none(), changes.nodeports_changed, &changes.nodeports_edits),
            masquerade: prev.is_none(),
        };
        let filter = if write.filter {
            filter_section(&ctx, fragments.iter().map(|(f, _)| *f))
        } else {
            prev.as_ref().map(|a| a.filter.clone()).unwrap_or_default()
        };
        let masquerade = masquerade_rules(&ctx);

        if by_replacing {
            let (report, applied) = replace_tables(
                &mut self.ipt, &ctx, &filter, &masquerade, &fragments, changes.gained_endpoints, report,
            )?;
            self.applied = Some(applied);
            return Ok(report);
        }

        let mut stale = std::mem::take(&mut changes.stale);
        // On a full sync, delete whatever the kernel has that we do not use (rules left by an
        // earlier run, ours or upstream's).
        if prev.is_none() {
            let saved = self.ipt.save("nat").map_err(SyncError::Save)?;
            stale = unused_service_chains(&saved, &fragments);
        }
        stale.sort();
        stale.dedup();
        report.removed_objects = stale.len();

        let nat_section = noflush_nat_section(&ctx, &fragments, &write, &changes, &masquerade, &stale);
        let filter_section = if write.filter { filter.as_str() } else { "" };
        // iptables-restore commits each table on its own. A Service that gains endpoints must
        // get its DNAT before its REJECT goes, and one that loses them its REJECT before its
        // DNAT goes (see PITFALLS: a SYN in between is forwarded un-NATed).
        let input = if changes.gained_endpoints {
            format!("{nat_section}{filter_section}")
        } else {
            format!("{filter_section}{nat_section}")
        };
        if !input.is_empty() {
            self.ipt.restore(&input).map_err(SyncError::Restore)?;
        }
        report.operations = restore_operations(&input);
        report.tables = rules_written(&input);
        self.applied = Some(Applied { ctx, filter });
        Ok(report)
    }

    /// Renders what changed (everything on a full sync) into the cache, noting in `changes`
    /// what that means for the fixed chains. The work is proportional to the number of
    /// changed service ports, except for cheap comparisons of the others. Returns every
    /// service port in order, with whether its chains are to be rewritten.
    fn render_service_ports<'s>(
        &mut self,
        state: &'s ProxyState,
        ctx: &RenderContext,
        full: bool,
        changes: &mut Changes,
        report: &mut SyncReport,
    ) -> Vec<(&'s ServicePortName, bool)> {
        let mut old = std::mem::take(&mut self.services);
        let mut order: Vec<(&ServicePortName, bool)> = Vec::with_capacity(state.service_ports.len());
        for sps in &state.service_ports {
            let key = &sps.port.name;
            let previous = old.remove(key);
            let reuse = !full && previous.as_ref().is_some_and(|p| p.state == *sps);
            let cached = match previous {
                Some(p) if reuse => p,
                previous => {
                    let fragment = render_service(sps, ctx);
                    match &previous {
                        Some(p) => {
                            report.udp_endpoints_removed |= p.state.loses_udp_endpoints_to(sps);
                            changes.replaced(&p.fragment, &fragment);
                        }
                        None => changes.added(&fragment),
                    }
                    CachedService {
                        state: sps.clone(),
                        fragment,
                    }
                }
            };
            order.push((key, !reuse));
            self.services.insert(key.clone(), cached);
        }
        // Service ports that are gone.
        for gone in old.values() {
            report.udp_endpoints_removed |= gone.state.port.protocol == crate::model::Protocol::Udp;
            changes.removed(&gone.fragment);
        }
        order
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
                .map(|c| {
                    let f = &c.fragment;
                    count(&f.services_rules) + count(&f.nodeports_rules) + count(&f.chain_rules)
                })
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

    fn len(&self) -> usize {
        self.gone.len() + self.new.len()
    }
}

/// Above this many line edits a fixed chain is written whole rather than edited in place.
const MAX_IN_PLACE_EDITS: usize = 64;

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

/// How a `--noflush` sync writes one fixed chain.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    /// Not at all: unchanged.
    No,
    /// Declared (flushed) and written whole.
    Whole,
    /// Its changed lines only: `-D` of the lines that go, `-I` of the ones that come, at
    /// their place. At 10k Services KUBE-SERVICES is 1.4 MB, and iptables-nft scans every
    /// chain for each jump it reads: one rule instead of the chain when a Service gains or
    /// loses its last endpoint.
    InPlace,
}

impl Write {
    /// Whole on a full sync, else in place when the edits are few.
    fn of(full: bool, changed: bool, edits: &LineEdits) -> Write {
        match (full, changed) {
            (true, _) => Write::Whole,
            (false, false) => Write::No,
            (false, true) if edits.len() <= MAX_IN_PLACE_EDITS => Write::InPlace,
            (false, true) => Write::Whole,
        }
    }
}

/// Which fixed parts a `--noflush` sync writes.
struct Writes {
    filter: bool,
    /// nat KUBE-SERVICES (and, written whole, its NodePort tail).
    services: Write,
    /// nat KUBE-NODEPORTS.
    nodeports: Write,
    /// nat KUBE-POSTROUTING and KUBE-MARK-MASQ.
    masquerade: bool,
}

/// The per-service chains in `iptables-save` output (`saved`) that no fragment uses.
fn unused_service_chains(saved: &str, fragments: &[(&ServiceFragment, bool)]) -> Vec<String> {
    let active: HashSet<&str> = fragments
        .iter()
        .flat_map(|(f, _)| f.chains.iter().map(String::as_str))
        .collect();
    existing_chains(saved)
        .into_iter()
        .filter(|c| is_service_chain(c) && !active.contains(c.as_str()))
        .collect()
}

/// The `*nat` part of a `--noflush` restore: the fixed chains in `write`, the chains of the
/// changed service ports, and the deletion of `stale` ones; empty when it declares nothing.
fn noflush_nat_section(
    ctx: &RenderContext,
    fragments: &[(&ServiceFragment, bool)],
    write: &Writes,
    changes: &Changes,
    masquerade: &str,
    stale: &[String],
) -> String {
    let mut nat = String::new();
    let mut declared = 0usize;
    let mut declare = |nat: &mut String, c: &str| {
        let _ = writeln!(nat, ":{c} - [0:0]");
        declared += 1;
    };
    for (c, write) in [
        (KUBE_SERVICES, write.services == Write::Whole),
        (KUBE_NODEPORTS, write.nodeports == Write::Whole),
        (KUBE_POSTROUTING, write.masquerade),
        (KUBE_MARK_MASQ, write.masquerade),
    ] {
        if write {
            declare(&mut nat, c);
        }
    }
    for (f, changed) in fragments {
        if *changed {
            for c in &f.chains {
                declare(&mut nat, c);
            }
        }
    }
    for c in stale {
        declare(&mut nat, c);
    }
    let mut rules = String::new();
    if write.masquerade {
        rules.push_str(masquerade);
    }
    // In-place edits first: a jump that goes must go before its chain is deleted below.
    let mut edited = 0usize;
    if write.services == Write::InPlace {
        edited += edit_in_place(&mut rules, KUBE_SERVICES, &changes.services_edits, fragments, |f| {
            &f.services_rules
        });
    }
    if write.nodeports == Write::InPlace {
        edited += edit_in_place(&mut rules, KUBE_NODEPORTS, &changes.nodeports_edits, fragments, |f| {
            &f.nodeports_rules
        });
    }
    // Upstream's order: each service's KUBE-SERVICES and KUBE-NODEPORTS lines, then its chains.
    for (f, changed) in fragments {
        if write.services == Write::Whole {
            rules.push_str(&f.services_rules);
        }
        if write.nodeports == Write::Whole {
            rules.push_str(&f.nodeports_rules);
        }
        if *changed {
            rules.push_str(&f.chain_rules);
        }
    }
    if write.services == Write::Whole {
        rules.push_str(&nodeports_tail(ctx));
    }
    for c in stale {
        let _ = writeln!(rules, "-X {c}");
    }
    if declared > 0 || edited > 0 {
        format!("*nat\n{nat}{rules}COMMIT\n")
    } else {
        String::new()
    }
}

/// Appends the in-place edits of `chain`: `-D` of each line that goes, then `-I` of each line
/// that comes at its place in the rendered order (positions ascending, so each lands where a
/// full write would put it); the number of edits.
fn edit_in_place(
    rules: &mut String,
    chain: &str,
    edits: &LineEdits,
    fragments: &[(&ServiceFragment, bool)],
    lines_of: impl Fn(&ServiceFragment) -> &String,
) -> usize {
    let prefix = format!("-A {chain} ");
    for line in &edits.gone {
        if let Some(spec) = line.strip_prefix(&prefix) {
            let _ = writeln!(rules, "-D {chain} {spec}");
        }
    }
    let mut position = 0usize;
    for (f, _) in fragments {
        for line in lines_of(f).lines() {
            position += 1;
            if edits.new.contains(line)
                && let Some(spec) = line.strip_prefix(&prefix)
            {
                let _ = writeln!(rules, "-I {chain} {position} {spec}");
            }
        }
    }
    edits.len()
}

/// A full sync by whole-table replacement (see [`REPLACE_TABLES_ABOVE_CHAINS`]).
fn replace_tables<I: Iptables>(
    ipt: &mut I,
    ctx: &RenderContext,
    filter: &str,
    masquerade: &str,
    fragments: &[(&ServiceFragment, bool)],
    gained_endpoints: bool,
    mut report: SyncReport,
) -> Result<(SyncReport, Applied), SyncError> {
    let nat = nat_section(ctx, masquerade, fragments.iter().map(|(f, _)| *f));
    let jumps = jump_rules();
    let saved_nat = ipt.save_counters("nat").map_err(SyncError::Save)?;
    let saved_filter = ipt.save_counters("filter").map_err(SyncError::Save)?;
    let nat = merge_table("nat", &saved_nat, &nat, &jumps);
    let filter_merged = merge_table("filter", &saved_filter, filter, &jumps);
    report.removed_objects = nat.dropped_service_chains;
    let input = if gained_endpoints {
        format!("{}{}", nat.text, filter_merged.text)
    } else {
        format!("{}{}", filter_merged.text, nat.text)
    };
    ipt.replace(&input).map_err(SyncError::Restore)?;
    ipt.ensure_chain("mangle", KUBE_PROXY_CANARY)
        .map_err(SyncError::Setup)?;
    report.operations = restore_operations(&input);
    report.tables = rules_written(&input);
    Ok((
        report,
        Applied {
            ctx: ctx.clone(),
            filter: filter.to_string(),
        },
    ))
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
    for (table, fixed) in [
        (
            "nat",
            &[
                KUBE_SERVICES, KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_MARK_MASQ, KUBE_PROXY_CANARY,
            ][..],
        ),
        (
            "filter",
            &[
                KUBE_SERVICES,
                super::names::KUBE_EXTERNAL_SERVICES,
                super::names::KUBE_FORWARD,
                KUBE_NODEPORTS,
                super::names::KUBE_PROXY_FIREWALL,
                KUBE_PROXY_CANARY,
            ][..],
        ),
    ] {
        let saved = match ipt.save(table) {
            Ok(s) => s,
            Err(e) => {
                errors.push(e.to_string());
                continue;
            }
        };
        let existing = existing_chains(&saved);
        let doomed: Vec<&String> = existing
            .iter()
            .filter(|c| fixed.contains(&c.as_str()) || (table == "nat" && is_service_chain(c)))
            .collect();
        if doomed.is_empty() {
            continue;
        }
        let mut input = format!("*{table}\n");
        for c in &doomed {
            let _ = writeln!(input, ":{c} - [0:0]");
        }
        for c in &doomed {
            let _ = writeln!(input, "-X {c}");
        }
        input.push_str("COMMIT\n");
        if let Err(e) = ipt.restore(&input) {
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
        Ok(self.read_back_all(&[port])?.remove(0))
    }

    fn read_back_all(&mut self, ports: &[&ServicePort]) -> Result<Vec<Programmed>, ReadBackError> {
        let mut tables = Vec::new();
        for table in ["filter", "nat"] {
            let saved = self.ipt.save_counters(table).map_err(|e| ReadBackError {
                what: format!("the {table} table"),
                message: e.to_string(),
            })?;
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
    fn first_sync_is_full_and_writes_what_render_writes() {
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
        // Same text as `render` (tables in nat-first order because services gained endpoints).
        let rendered = render(&st, &opts()).restore;
        let (filter, nat) = rendered.split_at(rendered.find("*nat").unwrap());
        assert_eq!(ipt.restores[0], format!("{nat}{filter}"));
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
            input.contains("-I KUBE-SERVICES 2 -m comment --comment \"ns/b:p cluster IP\""),
            "b's rule inserted after a's: {input}"
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
    /// `-D` of a rule that is not there and an `-I` past the end.
    #[derive(Default, Debug, PartialEq)]
    struct Tables(std::collections::BTreeMap<String, std::collections::BTreeMap<String, Vec<String>>>);

    impl Tables {
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
                        chains.remove(*chain);
                    }
                    ["COMMIT"] | [""] => {}
                    other => panic!("unexpected line {other:?}"),
                }
            }
        }
    }

    proptest::proptest! {
        /// After any sequence of states synced incrementally (Services coming and going,
        /// gaining and losing endpoints, NodePorts), the tables hold exactly what a full
        /// render of the last state writes into empty tables, rule order included.
        #[test]
        fn incremental_syncs_leave_what_a_full_render_leaves(steps in proptest::collection::vec(proptest::collection::vec(0u8..5, 6), 1..12)) {
            let mut p = IptablesProxier::new(Fake::default(), opts());
            let mut tables = Tables::default();
            for step in steps {
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
                let st = state(ports);
                p.sync(&st).unwrap();
                let input = p.iptables().restores.last().cloned().unwrap_or_default();
                if !p.iptables().restores.is_empty() {
                    tables.apply(&input);
                    p.iptables().restores.clear();
                }
                let mut fresh = Tables::default();
                fresh.apply(&render(&st, &opts()).restore);
                proptest::prop_assert_eq!(&tables, &fresh);
            }
        }
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
    fn large_full_sync_replaces_tables_keeping_foreign_rules() {
        let many: Vec<u8> = (1..=250).collect();
        let ports: Vec<ServicePortState> = (0..10)
            .map(|i| port(&format!("s{i}"), i as u8 + 1, Protocol::Tcp, &many))
            .collect();
        let st = state(ports);
        let mut fake = Fake::default();
        fake.saved.insert(
            "nat".into(),
            "*nat\n:PREROUTING ACCEPT [0:0]\n:CNI-X - [0:0]\n[1:60] -A PREROUTING -j CNI-X\nCOMMIT\n".into(),
        );
        let mut p = IptablesProxier::new(fake, opts());
        let r = p.sync(&st).unwrap();
        assert!(r.full);
        let ipt = p.iptables();
        assert!(ipt.restores.is_empty(), "no --noflush restore for a large full sync");
        assert_eq!(ipt.replaces.len(), 1);
        let text = &ipt.replaces[0];
        assert!(text.contains("[1:60] -A PREROUTING -j CNI-X") && text.contains(":CNI-X - [0:0]"));
        assert_eq!(text.matches(":KUBE-SEP-").count(), 2500);
        // The next change is a partial --noflush restore again.
        let mut fewer = st.clone();
        Arc::make_mut(&mut fewer.service_ports[0]).endpoints.pop();
        let r = p.sync(&fewer).unwrap();
        assert!(!r.full && r.removed_objects == 1);
        assert_eq!(p.iptables().restores.len(), 1);
    }
}
