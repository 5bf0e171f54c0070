//! The IPVS proxier: keeps one family's share of the node in line with the model, as
//! upstream's IPVS proxier does on every sync — the virtual servers and their real servers
//! (through [`Ipvs`]), the `kube-ipvs0` dummy link and its addresses, the ipsets, and the
//! iptables rules that remain in IPVS mode — all rendered by [`super::render`].
//!
//! What a sync does, in an order that never leaves a Service without a path it had:
//! 1. (first sync, or new options) the sysctls and IPVS timeouts;
//! 2. the dummy link; every wanted virtual server added or updated, its real servers added or
//!    updated, the ones no longer wanted drained (below);
//! 3. the missing addresses bound to `kube-ipvs0`;
//! 4. the ipsets brought to their wanted entries by one `ipset restore -exist` of `add` and
//!    `del` lines (never a flush-then-refill of a live set);
//! 5. the iptables rules (`iptables-restore --noflush`) and the jumps to them;
//! 6. virtual servers we own that are no longer wanted drained and deleted, and addresses no
//!    longer wanted unbound.
//!
//! **Full syncs and syncs of differences.** A full sync (the first, after a failure or new
//! options, when `intact` finds our marks gone, and every [`crate::iptables::proxier::FULL_SYNC_PERIOD`]
//! for drift) lists the kernel's virtual servers, each one's real servers, the addresses of
//! `kube-ipvs0` and the ipsets, and reconciles them. Every other sync compares the rendering
//! with what the last successful one left (kept as rendered, [`Applied`]) and sends only the
//! steps above for what differs: the virtual servers that are new, changed or gone, the real
//! servers that come, change weight or go, the addresses that come or go, the ipset entries
//! that come or go, and the iptables input only when it changed. Nothing is listed but the
//! real servers of a virtual server that loses one (their connection counts decide between
//! deleting it and draining it) or goes. An endpoint change at 10,000 Services is then a few
//! netlink messages, where listing the table took one dump per virtual server.
//!
//! **Node addresses.** Every sync lists the addresses of the namespace's links but
//! `kube-ipvs0` (upstream re-reads them on every sync too) and renders with them: NodePort
//! virtual servers go on those nodePortAddresses selects, so an address that appears gets
//! them at the next sync, and one that goes loses them (they are ours: we programmed them).
//!
//! **Ownership.** Only virtual servers of this family that are ours are ever changed or
//! deleted: those whose address is on `kube-ipvs0`, those this proxier programmed itself, and
//! NodePort-looking ones on a node address (in the default NodePort range, Masq real servers
//! only, as `--cleanup` recognises them), so that a Service deleted while the daemon was down
//! loses its NodePort virtual servers at the first sync after the restart. Firewall-mark
//! services and those within `--ipvs-exclude-cidrs` never. (Upstream's cleanLegacyService
//! deletes every virtual server of its family outside the excluded CIDRs; we leave other
//! users' services alone.)
//!
//! **Graceful termination** (upstream's `graceful_termination.go`): a real server no longer
//! wanted is not deleted at once when it has connections. It gets weight 0 (no new
//! connections; existing ones keep working) and is deleted once the kernel counts no active
//! and no inactive connections to it, re-checked by later syncs: [`IpvsProxier::next_cleanup`]
//! tells the daemon when, backing off from 1 s to 10 s. UDP and SCTP real servers are deleted
//! at once, as upstream does: a UDP "connection" lives as long as its client keeps sending
//! (a resolver reusing its source port would stay on a deleted pod for ever), and with
//! `expire_nodest_conn=1` the kernel moves such flows on their next packet. A virtual server
//! no longer wanted is deleted once its last real server is; its address stays bound until
//! then, so that its open connections still reach IPVS. One whose address the node no longer
//! has (a NodePort on an address that went) is deleted at once: nothing reaches it to drain.
//!
//! A sync whose rendering equals the last applied one (the daemon's drain re-checks, periodic
//! syncs) only re-checks draining real servers.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use nix::errno::Errno;

use super::cleanup::{NODE_PORT_RANGE, node_port_looking};
use super::host::{HostError, IpvsHost, entry_for_restore};
use super::kernel::{conn_reuse_mode_fix_needed, kernel_release};
use super::names::DUMMY_DEVICE;
use super::netlink::{Ipvs, IpvsError, RealServer, ServiceFlags, ServiceKey, Timeouts, VirtualServer};
use super::render::{IpvsRenderOptions, IpvsRuleset, IpvsService, render};
// IPVS mode programs iptables rules beside its virtual servers, through the iptables edge.
use crate::iptables::exec::{ExecError, Iptables};
use crate::model::{IpFamily, Protocol, ProxyState};
use crate::proxy::{SyncReport, restore_operations};

// The daemon still reaches cleanup and the kernel checks here.

/// The first re-check of a draining real server comes this long after it started draining.
pub const DRAIN_CHECK_FIRST: Duration = Duration::from_secs(1);
/// Re-checks back off (doubling) up to this interval while something drains.
pub const DRAIN_CHECK_MAX: Duration = Duration::from_secs(10);

/// What failed in a sync; the previous state stays, and the next sync is a full one.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("IPVS: {0}")]
    Ipvs(#[from] IpvsError),
    #[error("{0}")]
    Host(#[from] HostError),
    #[error("iptables: {0}")]
    Iptables(#[from] ExecError),
}

/// One virtual server as the last successful sync left it: its settings and its real
/// servers with their weights.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AppliedServer {
    server: VirtualServer,
    dests: BTreeMap<SocketAddr, u32>,
}

/// What the last successful sync programmed, as rendered: a sync whose rendering equals it has
/// nothing to send, and one whose rendering differs sends only the differences (see
/// [`IpvsProxier::sync_differences`]).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Applied {
    virtual_servers: BTreeMap<ServiceKey, AppliedServer>,
    bound: BTreeSet<IpAddr>,
    ipsets: BTreeMap<String, BTreeSet<String>>,
    restore: String,
}

impl Applied {
    fn of(rs: &IpvsRuleset) -> Applied {
        let virtual_servers = rs
            .virtual_servers
            .iter()
            .map(|svc| {
                let server = virtual_server(svc);
                let dests = svc
                    .destinations
                    .iter()
                    .map(|d| (SocketAddr::new(d.address, d.port), d.weight))
                    .collect();
                (server.key(), AppliedServer { server, dests })
            })
            .collect();
        Applied {
            virtual_servers,
            bound: rs.bound_addresses.iter().copied().collect(),
            ipsets: rs
                .ipsets
                .iter()
                .map(|set| (set.name.clone(), set.entries.iter().cloned().collect()))
                .collect(),
            restore: rs.restore.clone(),
        }
    }
}

pub struct IpvsProxier<V: Ipvs, I: Iptables, H: IpvsHost> {
    family: IpFamily,
    opts: IpvsRenderOptions,
    ipvs: V,
    ipt: I,
    host: H,
    applied: Option<Applied>,
    /// Sysctls and timeouts are set (for the current options).
    setup_done: bool,
    /// Virtual servers this proxier programmed (see "Ownership" above).
    programmed: BTreeSet<ServiceKey>,
    /// The node's addresses of this family outside `kube-ipvs0`, as listed for the last sync.
    node_addresses: BTreeSet<IpAddr>,
    /// Real servers on their way out, with their virtual server.
    draining: BTreeMap<(ServiceKey, SocketAddr), VirtualServer>,
    /// Virtual servers no longer wanted, deleted once their last real server is.
    retiring: BTreeMap<ServiceKey, VirtualServer>,
    /// This family's addresses on `kube-ipvs0`: as listed by the last full sync, with what
    /// syncs bound and unbound since.
    bound: BTreeSet<IpAddr>,
    next_check: Option<Instant>,
    check_interval: Duration,
}

/// The kernel's virtual server for a rendered one.
pub fn virtual_server(s: &IpvsService) -> VirtualServer {
    VirtualServer {
        address: s.address,
        protocol: s.protocol,
        port: s.port,
        fwmark: None,
        scheduler: s.scheduler.clone(),
        persistent_timeout: s.persistent,
        flags: ServiceFlags(s.sched_flags),
        netmask: s.netmask,
        stats: Default::default(),
    }
}

/// Whether the kernel's virtual server has the settings of ours.
fn same_settings(have: &VirtualServer, want: &VirtualServer) -> bool {
    have.scheduler == want.scheduler
        && have.persistent_timeout == want.persistent_timeout
        && have.flags == want.flags
        // The netmask only matters with persistence.
        && (want.persistent_timeout.is_none() || have.netmask == want.netmask)
}

/// Whether the kernel must keep a removed real server until its connections are gone.
fn needs_draining(protocol: Protocol) -> bool {
    protocol == Protocol::Tcp
}

/// A missing object is what we wanted anyway.
pub(super) fn gone_ok(r: Result<(), IpvsError>) -> Result<(), IpvsError> {
    match r {
        Err(e) if matches!(e.errno(), Some(Errno::ESRCH | Errno::ENOENT)) => Ok(()),
        r => r,
    }
}

/// ipset prints a host-sized net without its prefix length (`…,10.0.0.1` for `10.0.0.1/32`):
/// entries compare in that spelling.
fn canonical_entry(e: &str) -> &str {
    e.strip_suffix("/32").or_else(|| e.strip_suffix("/128")).unwrap_or(e)
}

/// The `ipset restore -exist` input that brings the sets to `rs`'s entries, given what the
/// kernel holds (`current`): each set that is missing or changes created (a no-op when it
/// exists), missing entries added, extra ones deleted, their protocols by number
/// ([`entry_for_restore`]). Empty when nothing changes.
pub fn ipset_changes(rs: &IpvsRuleset, current: &BTreeMap<String, BTreeSet<String>>) -> String {
    let mut out = String::new();
    for set in &rs.ipsets {
        let have = current.get(&set.name);
        let have_canon: BTreeSet<&str> = have.into_iter().flatten().map(|e| canonical_entry(e)).collect();
        let want_canon: BTreeSet<&str> = set.entries.iter().map(|e| canonical_entry(e)).collect();
        let mut lines = String::new();
        for e in &set.entries {
            if !have_canon.contains(canonical_entry(e)) {
                lines.push_str(&format!("add {} {}\n", set.name, entry_for_restore(e)));
            }
        }
        for e in have.into_iter().flatten() {
            if !want_canon.contains(canonical_entry(e)) {
                lines.push_str(&format!("del {} {}\n", set.name, entry_for_restore(e)));
            }
        }
        if have.is_none() || !lines.is_empty() {
            out.push_str(&set.create_line());
            out.push('\n');
            out.push_str(&lines);
        }
    }
    out
}

impl<V: Ipvs, I: Iptables, H: IpvsHost> IpvsProxier<V, I, H> {
    pub fn new(family: IpFamily, opts: IpvsRenderOptions, ipvs: V, ipt: I, host: H) -> Self {
        IpvsProxier {
            family,
            opts,
            ipvs,
            ipt,
            host,
            applied: None,
            setup_done: false,
            programmed: BTreeSet::new(),
            node_addresses: BTreeSet::new(),
            draining: BTreeMap::new(),
            retiring: BTreeMap::new(),
            bound: BTreeSet::new(),
            next_check: None,
            check_interval: DRAIN_CHECK_FIRST,
        }
    }

    pub fn ipvs(&mut self) -> &mut V {
        &mut self.ipvs
    }

    pub fn iptables(&mut self) -> &mut I {
        &mut self.ipt
    }

    pub fn host(&mut self) -> &mut H {
        &mut self.host
    }

    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// The three edges at once (cleanup needs them together).
    pub fn parts(&mut self) -> (&mut V, &mut I, &mut H) {
        (&mut self.ipvs, &mut self.ipt, &mut self.host)
    }

    /// New options (they depend on the Node, which may change); a change makes the next sync
    /// a full one and sets sysctls and timeouts again.
    pub fn set_options(&mut self, opts: IpvsRenderOptions) {
        if opts != self.opts {
            self.opts = opts;
            self.applied = None;
            self.setup_done = false;
        }
    }

    pub fn force_full_sync(&mut self) {
        self.applied = None;
    }

    /// Whether the next sync lists and reconciles everything (no successful sync to build on).
    pub fn next_sync_is_full(&self) -> bool {
        self.applied.is_none()
    }

    /// Whether our entry jump and the dummy link are still there (someone may flush nat or
    /// delete the link); if not, the daemon forces a full sync.
    pub fn intact(&mut self) -> bool {
        let entry = super::iptables::jump_rules()
            .into_iter()
            .filter(|j| j.table == "nat" && j.chain == "PREROUTING")
            .all(|j| self.ipt.rule_exists(j.table, j.chain, &j.args).unwrap_or(false));
        entry && self.host.link_exists(DUMMY_DEVICE).unwrap_or(false)
    }

    /// When draining real servers are due for a re-check, if any drain.
    pub fn next_cleanup(&self) -> Option<Instant> {
        if self.draining.is_empty() && self.retiring.is_empty() {
            None
        } else {
            self.next_check
        }
    }

    /// Real servers draining now, as (virtual server, real server).
    pub fn draining(&self) -> Vec<(ServiceKey, SocketAddr)> {
        self.draining.keys().copied().collect()
    }

    /// Brings the kernel in line with `state` (which must be of this proxier's family).
    pub fn sync(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        let start = Instant::now();
        let family = self.family;
        // Listed on every sync: an address that appears or goes changes the rendering, which
        // makes this sync a full one.
        let listed: Vec<IpAddr> = match self.host.other_addresses(DUMMY_DEVICE) {
            Ok(a) => a.into_iter().filter(|ip| family.contains(ip)).collect(),
            Err(e) => {
                self.applied = None;
                return Err(e.into());
            }
        };
        self.node_addresses = listed.iter().copied().collect();
        let opts = IpvsRenderOptions {
            node_addresses: Some(listed),
            ..self.opts.clone()
        };
        let rs = render(state, &opts);
        let result = self.sync_inner(&rs);
        crate::proxy::finish_sync(start, result, || self.applied = None)
    }

    fn sync_inner(&mut self, rs: &IpvsRuleset) -> Result<SyncReport, SyncError> {
        let mut report = SyncReport::default();
        if !self.setup_done {
            self.setup(rs)?;
            self.setup_done = true;
        }
        let applied = Applied::of(rs);
        match self.applied.take() {
            Some(prev) if prev == applied => {
                // Nothing new: only the draining real servers may have something to do.
                self.applied = Some(prev);
                self.check_draining(&mut report, false)?;
                return Ok(report);
            }
            Some(prev) => self.sync_differences(rs, &prev, &applied, &mut report)?,
            None => {
                report.full = true;
                self.full_sync(rs, &applied, &mut report)?;
            }
        }
        self.applied = Some(applied);
        self.check_draining(&mut report, true)?;
        Ok(report)
    }

    /// Sysctls and IPVS timeouts (upstream sets them when the proxier is created).
    fn setup(&mut self, rs: &IpvsRuleset) -> Result<(), SyncError> {
        let mut sysctls: Vec<(&str, u32)> = rs.sysctls.clone();
        if conn_reuse_mode_fix_needed(&kernel_release()) {
            sysctls.push(("net/ipv4/vs/conn_reuse_mode", 0));
        }
        for (path, value) in sysctls {
            let value = value.to_string();
            if self.host.read_sysctl(path)? != value {
                self.host.write_sysctl(path, &value)?;
            }
        }
        if let Some(t) = rs.timeouts {
            // 0 leaves the kernel's value: only the configured ones change.
            self.ipvs.set_timeouts(&Timeouts {
                tcp: t.tcp.as_secs().min(u64::from(u32::MAX)) as u32,
                tcp_fin: t.tcp_fin.as_secs().min(u64::from(u32::MAX)) as u32,
                udp: t.udp.as_secs().min(u64::from(u32::MAX)) as u32,
            })?;
        }
        Ok(())
    }

    fn excluded(&self, ip: &IpAddr) -> bool {
        self.opts.exclude_cidrs.iter().any(|c| c.contains(ip))
    }

    fn full_sync(&mut self, rs: &IpvsRuleset, want: &Applied, report: &mut SyncReport) -> Result<(), SyncError> {
        let family = self.family;
        self.host.ensure_dummy(DUMMY_DEVICE)?;
        let bound_now: BTreeSet<IpAddr> = self
            .host
            .addresses(DUMMY_DEVICE)?
            .into_iter()
            .filter(|ip| family.contains(ip))
            .collect();
        let current: BTreeMap<ServiceKey, VirtualServer> = self
            .ipvs
            .services()?
            .into_iter()
            .filter(|vs| vs.fwmark.is_none() && vs.family() == family)
            .map(|vs| (vs.key(), vs))
            .collect();

        // 2. Wanted virtual servers and their real servers.
        for (key, w) in &want.virtual_servers {
            self.retiring.remove(key);
            let existing = match current.get(key) {
                None => {
                    self.ipvs.add_service(&w.server)?;
                    report.operations += 1;
                    false
                }
                Some(have) => {
                    if !same_settings(have, &w.server) {
                        self.ipvs.update_service(&w.server)?;
                        report.operations += 1;
                    }
                    true
                }
            };
            let settings_changed = !current.get(key).is_some_and(|h| same_settings(h, &w.server));
            self.programmed.insert(*key);
            let have: BTreeMap<SocketAddr, RealServer> = if existing {
                self.ipvs.dests(&w.server)?.into_iter().map(|d| (d.key(), d)).collect()
            } else {
                BTreeMap::new()
            };
            let dests_changed = self.apply_dests(w, &have, report)?;
            if settings_changed || dests_changed {
                report.rewritten_services += 1;
            }
        }

        // 3. Addresses: the wanted ones now; unwanted ones after their services are gone.
        let want_bound = &want.bound;
        let add: Vec<IpAddr> = want_bound.difference(&bound_now).copied().collect();
        self.host.change_addresses(DUMMY_DEVICE, &add, &[])?;
        self.bound = bound_now.iter().chain(&add).copied().collect();

        // 4. ipsets, before the rules that match on them.
        let sets = ipset_changes(rs, &self.host.ipsets()?);
        if !sets.is_empty() {
            self.host.ipset_restore(&sets)?;
        }

        // 5. iptables: the restore declares (creates) every chain the jumps lead to. Each jump
        // is inserted at the top when missing, so insert the last of each chain first.
        self.ipt.restore(&rs.restore)?;
        report.operations += restore_operations(&rs.restore) + restore_operations(&sets);
        for j in rs.jumps.iter().rev() {
            self.ipt.ensure_rule_first(j.table, j.chain, &j.args)?;
        }

        // 6. Virtual servers we own and no longer want.
        for (key, vs) in &current {
            if want.virtual_servers.contains_key(key) || self.excluded(&vs.address) {
                continue;
            }
            // No packet for an address the node no longer has reaches IPVS (it only sees
            // local input): a virtual server there has nothing left to drain.
            let unreachable = !bound_now.contains(&vs.address) && !self.node_addresses.contains(&vs.address);
            if self.retiring.contains_key(key) {
                if unreachable {
                    self.delete_now(*key, vs)?;
                }
                continue;
            }
            if unreachable && self.programmed.contains(key) {
                self.delete_now(*key, vs)?;
                report.rewritten_services += 1;
                continue;
            }
            let known = bound_now.contains(&vs.address) || self.programmed.contains(key);
            let on_node = self.node_addresses.contains(&vs.address) && NODE_PORT_RANGE.contains(&vs.port);
            if !known && !on_node {
                continue;
            }
            let dests = self.ipvs.dests(vs)?;
            // One left by an earlier run, whose Service went while the daemon was down.
            if !known && !node_port_looking(vs, &dests, &self.node_addresses) {
                continue;
            }
            for d in &dests {
                self.retire_dest(vs, d, report)?;
            }
            self.retiring.insert(*key, vs.without_stats());
            report.rewritten_services += 1;
        }
        self.delete_empty_retiring()?;
        self.unbind_unused(&bound_now, want_bound)?;
        Ok(())
    }

    /// Brings the real servers of `w` (a virtual server the kernel has) from `have` to the
    /// wanted ones: missing ones added, changed weights updated, the others retired. True when
    /// something changed.
    fn apply_dests(
        &mut self,
        w: &AppliedServer,
        have: &BTreeMap<SocketAddr, RealServer>,
        report: &mut SyncReport,
    ) -> Result<bool, SyncError> {
        let key = w.server.key();
        let mut changed = false;
        for (addr, weight) in &w.dests {
            let rs_want = RealServer::new(addr.ip(), addr.port(), *weight);
            self.draining.remove(&(key, *addr));
            match have.get(addr) {
                None => {
                    self.ipvs.add_dest(&w.server, &rs_want)?;
                    report.operations += 1;
                    changed = true;
                }
                Some(h) if h.weight != rs_want.weight || h.forward != rs_want.forward => {
                    self.ipvs.update_dest(&w.server, &rs_want)?;
                    report.operations += 1;
                    changed = true;
                }
                Some(_) => {}
            }
        }
        for (addr, h) in have {
            if !w.dests.contains_key(addr) {
                changed |= self.retire_dest(&w.server, h, report)?;
            }
        }
        Ok(changed)
    }

    /// A sync after a successful one (`prev`) sends only what differs from it: nothing is
    /// listed but the real servers of a virtual server that loses some (their connection
    /// counts decide between deleting and draining) or goes. Steps and order as in a full sync.
    fn sync_differences(
        &mut self,
        rs: &IpvsRuleset,
        prev: &Applied,
        want: &Applied,
        report: &mut SyncReport,
    ) -> Result<(), SyncError> {
        // 2. Virtual servers that are new or changed, and their real servers.
        for (key, w) in &want.virtual_servers {
            let before = prev.virtual_servers.get(key);
            if before == Some(w) {
                continue;
            }
            let was_retiring = self.retiring.remove(key).is_some();
            let have = match before {
                Some(b) => {
                    if !same_settings(&b.server, &w.server) {
                        self.ipvs.update_service(&w.server)?;
                        report.operations += 1;
                    }
                    self.known_dests(b, w)?
                }
                None if was_retiring => {
                    // Still in the kernel, draining: its settings and real servers as they are.
                    self.ipvs.update_service(&w.server)?;
                    report.operations += 1;
                    self.ipvs.dests(&w.server)?.into_iter().map(|d| (d.key(), d)).collect()
                }
                None => {
                    self.ipvs.add_service(&w.server)?;
                    report.operations += 1;
                    BTreeMap::new()
                }
            };
            self.programmed.insert(*key);
            self.apply_dests(w, &have, report)?;
            report.rewritten_services += 1;
        }

        // 3. Addresses that come.
        let add: Vec<IpAddr> = want.bound.difference(&self.bound).copied().collect();
        if !add.is_empty() {
            self.host.change_addresses(DUMMY_DEVICE, &add, &[])?;
            self.bound.extend(add);
        }

        // 4. ipsets, entry by entry, from what the last sync left.
        let sets = ipset_changes(rs, &prev.ipsets);
        if !sets.is_empty() {
            self.host.ipset_restore(&sets)?;
        }

        // 5. iptables, when its rules changed (the jumps are checked by `intact`).
        if rs.restore != prev.restore {
            self.ipt.restore(&rs.restore)?;
            report.operations += restore_operations(&rs.restore);
        }
        report.operations += restore_operations(&sets);

        // 6. Virtual servers that go, and retiring ones nothing can reach any more.
        let unreachable =
            |p: &Self, vs: &VirtualServer| !p.bound.contains(&vs.address) && !p.node_addresses.contains(&vs.address);
        for (key, b) in &prev.virtual_servers {
            if want.virtual_servers.contains_key(key) {
                continue;
            }
            report.rewritten_services += 1;
            if unreachable(self, &b.server) {
                self.delete_now(*key, &b.server)?;
                continue;
            }
            for d in self.ipvs.dests(&b.server)? {
                self.retire_dest(&b.server, &d, report)?;
            }
            self.retiring.insert(*key, b.server.clone());
        }
        let cut_off: Vec<(ServiceKey, VirtualServer)> = self
            .retiring
            .iter()
            .filter(|(_, vs)| unreachable(self, vs))
            .map(|(k, vs)| (*k, vs.clone()))
            .collect();
        for (key, vs) in cut_off {
            self.delete_now(key, &vs)?;
        }
        self.delete_empty_retiring()?;
        let bound = self.bound.clone();
        self.unbind_unused(&bound, &want.bound)
    }

    /// The real servers of `b` as the last sync left them, and those draining (weight 0); when
    /// one of them is not wanted in `w` and may have to drain, as the kernel lists them (with
    /// their connection counts).
    fn known_dests(
        &mut self,
        b: &AppliedServer,
        w: &AppliedServer,
    ) -> Result<BTreeMap<SocketAddr, RealServer>, SyncError> {
        let key = b.server.key();
        let leaving = b.dests.keys().any(|a| !w.dests.contains_key(a));
        if leaving && needs_draining(b.server.protocol) {
            return Ok(self.ipvs.dests(&w.server)?.into_iter().map(|d| (d.key(), d)).collect());
        }
        let mut have: BTreeMap<SocketAddr, RealServer> = b
            .dests
            .iter()
            .map(|(a, w)| (*a, RealServer::new(a.ip(), a.port(), *w)))
            .collect();
        for (_, addr) in self.draining.keys().filter(|(k, _)| *k == key) {
            have.entry(*addr)
                .or_insert_with(|| RealServer::new(addr.ip(), addr.port(), 0));
        }
        Ok(have)
    }

    /// Takes a real server out of `vs`: at once when nothing needs it, else weight 0 and onto
    /// the draining list. True when something changed.
    fn retire_dest(&mut self, vs: &VirtualServer, d: &RealServer, report: &mut SyncReport) -> Result<bool, SyncError> {
        let key = (vs.key(), d.key());
        if self.draining.contains_key(&key) {
            return Ok(false);
        }
        if !needs_draining(vs.protocol) || d.active_conns + d.inactive_conns == 0 {
            gone_ok(self.ipvs.delete_dest(vs, d))?;
            report.operations += 1;
            report.udp_endpoints_removed |= vs.protocol == Protocol::Udp;
            return Ok(true);
        }
        let quiet = RealServer {
            weight: 0,
            ..d.without_counters()
        };
        if d.weight != 0 {
            self.ipvs.update_dest(vs, &quiet)?;
            report.operations += 1;
        }
        self.draining.insert(key, vs.without_stats());
        self.schedule_check(true);
        Ok(true)
    }

    /// Plans the next re-check: soon after a new real server started draining, then backing off.
    fn schedule_check(&mut self, reset: bool) {
        if reset {
            self.check_interval = DRAIN_CHECK_FIRST;
        } else {
            self.check_interval = (self.check_interval * 2).min(DRAIN_CHECK_MAX);
        }
        self.next_check = Some(Instant::now() + self.check_interval);
    }

    /// Deletes one of our virtual servers with its real servers, draining or not.
    fn delete_now(&mut self, key: ServiceKey, vs: &VirtualServer) -> Result<(), SyncError> {
        gone_ok(self.ipvs.delete_service(vs))?;
        self.draining.retain(|(k, _), _| *k != key);
        self.retiring.remove(&key);
        self.programmed.remove(&key);
        Ok(())
    }

    /// Deletes retiring virtual servers that have no real servers left.
    fn delete_empty_retiring(&mut self) -> Result<(), SyncError> {
        let keys: Vec<ServiceKey> = self.retiring.keys().copied().collect();
        for key in keys {
            let Some(vs) = self.retiring.get(&key).cloned() else {
                continue;
            };
            let left = self.draining.keys().any(|(k, _)| *k == key);
            if left {
                continue;
            }
            gone_ok(self.ipvs.delete_service(&vs))?;
            self.retiring.remove(&key);
            self.programmed.remove(&key);
        }
        Ok(())
    }

    /// Unbinds addresses of this family that are neither wanted nor still used by a retiring
    /// virtual server.
    fn unbind_unused(&mut self, bound_now: &BTreeSet<IpAddr>, want: &BTreeSet<IpAddr>) -> Result<(), SyncError> {
        let in_use: BTreeSet<IpAddr> = self.retiring.values().map(|v| v.address).collect();
        let del: Vec<IpAddr> = bound_now
            .iter()
            .filter(|ip| !want.contains(ip) && !in_use.contains(ip))
            .copied()
            .collect();
        if !del.is_empty() {
            self.host.change_addresses(DUMMY_DEVICE, &[], &del)?;
        }
        for ip in &del {
            self.bound.remove(ip);
        }
        Ok(())
    }

    /// Re-checks draining real servers (when due, or always with `now`): deletes those without
    /// connections, then retiring virtual servers left empty, and unbinds their addresses.
    fn check_draining(&mut self, report: &mut SyncReport, now: bool) -> Result<(), SyncError> {
        if self.draining.is_empty() && self.retiring.is_empty() {
            self.next_check = None;
            return Ok(());
        }
        if !now && self.next_check.is_some_and(|t| Instant::now() < t) {
            return Ok(());
        }
        let services: BTreeMap<ServiceKey, VirtualServer> =
            self.draining.values().map(|vs| (vs.key(), vs.clone())).collect();
        for (key, vs) in services {
            let dests: BTreeMap<SocketAddr, RealServer> =
                self.ipvs.dests(&vs)?.into_iter().map(|d| (d.key(), d)).collect();
            let ours: Vec<(ServiceKey, SocketAddr)> =
                self.draining.keys().filter(|(k, _)| *k == key).copied().collect();
            for k in ours {
                match dests.get(&k.1) {
                    // Deleted by someone else (or the virtual server is gone).
                    None => {
                        self.draining.remove(&k);
                    }
                    Some(d) if d.active_conns + d.inactive_conns == 0 => {
                        gone_ok(self.ipvs.delete_dest(&vs, d))?;
                        report.operations += 1;
                        self.draining.remove(&k);
                        // Stale objects removed (chains in the other modes): here, drained
                        // real servers.
                        report.removed_objects += 1;
                    }
                    Some(d) if d.weight != 0 => {
                        // Someone raised it again: it still has to drain.
                        let quiet = RealServer {
                            weight: 0,
                            ..d.without_counters()
                        };
                        self.ipvs.update_dest(&vs, &quiet)?;
                        report.operations += 1;
                    }
                    Some(_) => {}
                }
            }
        }
        let retiring_before: BTreeSet<IpAddr> = self.retiring.values().map(|v| v.address).collect();
        self.delete_empty_retiring()?;
        if let Some(applied) = &self.applied {
            let want: BTreeSet<IpAddr> = applied.bound.iter().copied().collect();
            let bound_now: BTreeSet<IpAddr> = self
                .host
                .addresses(DUMMY_DEVICE)?
                .into_iter()
                .filter(|ip| retiring_before.contains(ip))
                .collect();
            self.unbind_unused(&bound_now, &want)?;
        }
        if self.draining.is_empty() && self.retiring.is_empty() {
            self.next_check = None;
        } else if !now || self.next_check.is_none_or(|t| Instant::now() >= t) {
            self.schedule_check(false);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::exec::Fake;
    use crate::ipvs::host::FakeHost;
    use crate::ipvs::names::IPSETS;
    use crate::ipvs::netlink::{Call, FakeIpvs};
    use crate::model::{Endpoint, NodeInfo, ServicePort, ServicePortName, ServicePortState};

    type P = IpvsProxier<FakeIpvs, Fake, FakeHost>;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn port(name: &str, cip: &str, proto: Protocol, eps: &[&str]) -> ServicePortState {
        let spn = ServicePortName {
            namespace: "ns".into(),
            name: name.into(),
            port: "p".into(),
            protocol: proto,
        };
        let mut sp = ServicePort::cluster_ip(spn, ip(cip), 80);
        sp.protocol = proto;
        ServicePortState {
            port: sp,
            endpoints: eps.iter().map(|e| Endpoint::ready(ip(e), 8080)).collect(),
        }
    }

    fn state(mut ports: Vec<ServicePortState>) -> ProxyState {
        ports.sort_by(|a, b| a.port.name.cmp(&b.port.name));
        ProxyState {
            family: IpFamily::V4,
            node: NodeInfo {
                name: "node-a".into(),
                addresses: vec![ip("192.168.49.2")],
                ..NodeInfo::default()
            },
            service_ports: crate::model::shared(ports),
            service_cidrs: vec![],
            warnings: vec![],
        }
    }

    /// A proxier on a node whose interfaces hold loopback and 192.168.49.2 (the Node's address).
    fn proxier() -> P {
        let host = FakeHost {
            other: vec![ip("127.0.0.1"), ip("192.168.49.2"), ip("::1")],
            ..FakeHost::default()
        };
        IpvsProxier::new(
            IpFamily::V4,
            IpvsRenderOptions::default(),
            FakeIpvs::new(),
            Fake::default(),
            host,
        )
    }

    fn tcp_key(addr: &str, port: u16) -> ServiceKey {
        ServiceKey::Addr {
            protocol: Protocol::Tcp,
            address: ip(addr),
            port,
        }
    }

    fn dests(p: &P, key: ServiceKey) -> Vec<(SocketAddr, u32)> {
        p.ipvs
            .table()
            .get(&key)
            .map(|(_, d)| d.iter().map(|r| (r.key(), r.weight)).collect())
            .unwrap_or_default()
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn first_sync_programs_everything() {
        let mut p = proxier();
        let st = state(vec![port(
            "web",
            "10.96.0.10",
            Protocol::Tcp,
            &["10.244.1.2", "10.244.2.2"],
        )]);
        let report = p.sync(&st).expect("sync");
        assert!(report.full);
        assert_eq!(
            dests(&p, tcp_key("10.96.0.10", 80)),
            vec![(sa("10.244.1.2:8080"), 1), (sa("10.244.2.2:8080"), 1)]
        );
        let (vs, _) = &p.ipvs.table()[&tcp_key("10.96.0.10", 80)];
        assert_eq!(vs.scheduler, "rr");
        assert_eq!(p.host.links[DUMMY_DEVICE], BTreeSet::from([ip("10.96.0.10")]));
        assert_eq!(
            p.host.sets["KUBE-CLUSTER-IP"],
            BTreeSet::from(["10.96.0.10,tcp:80".to_string()])
        );
        // Every set exists, even empty.
        for info in IPSETS {
            assert!(p.host.sets.contains_key(info.name), "{}", info.name);
        }
        assert_eq!(p.ipt.restores.len(), 1);
        assert!(p.ipt.restores[0].contains("-A KUBE-SERVICES"));
        // The jumps end up in the rendered order in each built-in chain.
        for j in super::super::iptables::jump_rules() {
            assert!(
                p.ipt
                    .rules
                    .contains(&format!("{}/{} {}", j.table, j.chain, j.args.join(" "))),
                "{j:?}"
            );
        }
        // Each is inserted at the top: the last inserted is evaluated first.
        let mut inserted: Vec<&str> = p
            .ipt
            .commands
            .iter()
            .filter(|c| c.contains(" -I INPUT "))
            .filter_map(|c| c.rsplit(' ').next())
            .collect();
        inserted.reverse();
        let rendered: Vec<&str> = rs_jumps_of("INPUT");
        assert_eq!(inserted, rendered);
        assert_eq!(p.host.sysctls["net/ipv4/vs/conntrack"], "1");
        assert_eq!(p.host.sysctls["net/ipv4/vs/expire_nodest_conn"], "1");
        assert_eq!(p.host.sysctls["net/ipv4/vs/expire_quiescent_template"], "1");
        assert_eq!(p.host.sysctls["net/ipv4/ip_forward"], "1");
        assert!(!p.host.sysctls.contains_key("net/ipv4/conf/all/arp_ignore"));
        assert!(p.intact());
    }

    fn rs_jumps_of(chain: &str) -> Vec<&'static str> {
        super::super::iptables::jump_rules()
            .into_iter()
            .filter(|j| j.chain == chain)
            .filter_map(|j| {
                super::super::names::FILTER_CHAINS
                    .iter()
                    .find(|c| j.args.last().is_some_and(|a| a == *c))
                    .copied()
            })
            .collect()
    }

    #[test]
    fn an_unchanged_sync_changes_nothing() {
        let mut p = proxier();
        let st = state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]);
        p.sync(&st).expect("sync");
        p.ipvs.take_calls();
        let host_calls = p.host.calls.len();
        let restores = p.ipt.restores.len();
        let report = p.sync(&st).expect("sync");
        assert!(!report.full);
        assert!(p.ipvs.calls().iter().all(|c| !c.is_mutation()), "{:?}", p.ipvs.calls());
        assert_eq!(p.host.calls.len(), host_calls);
        assert_eq!(p.ipt.restores.len(), restores);
        // A forced full sync lists and compares, but changes nothing either.
        p.force_full_sync();
        let report = p.sync(&st).expect("sync");
        assert!(report.full);
        assert!(p.ipvs.calls().iter().all(|c| !c.is_mutation()), "{:?}", p.ipvs.calls());
        assert_eq!(p.host.calls.len(), host_calls, "{:?}", p.host.calls);
    }

    /// 40 Services of 3 endpoints each, the endpoints of Service i in 10.244.i.0/24.
    fn many(changed: Option<(usize, &[&str])>) -> ProxyState {
        let ports = (0..40)
            .map(|i| {
                let eps: Vec<String> = (1..=3).map(|j| format!("10.244.{i}.{j}")).collect();
                let mut eps: Vec<&str> = eps.iter().map(String::as_str).collect();
                if let Some((k, other)) = changed
                    && k == i
                {
                    eps = other.to_vec();
                }
                port(&format!("s{i}"), &format!("10.96.1.{i}"), Protocol::Tcp, &eps)
            })
            .collect();
        state(ports)
    }

    #[test]
    fn an_endpoint_change_sends_only_the_changed_real_servers() {
        let mut p = proxier();
        p.sync(&many(None)).expect("sync");
        p.ipvs.take_calls();
        let (host_calls, restores, ipt_restores) = (p.host.calls.len(), p.host.restores.len(), p.ipt.restores.len());

        // Service 7 replaces one endpoint (a rolling update).
        let report = p
            .sync(&many(Some((7, &["10.244.7.1", "10.244.7.2", "10.244.7.9"]))))
            .expect("sync");
        assert!(!report.full);
        assert_eq!(report.rewritten_services, 1);
        let key = tcp_key("10.96.1.7", 80);
        assert_eq!(
            p.ipvs.calls(),
            [
                // Only its real servers are listed, for the connection count of the one that goes.
                Call::Dests(key),
                Call::AddDest(key, RealServer::new(ip("10.244.7.9"), 8080, 1)),
                Call::DeleteDest(key, sa("10.244.7.3:8080")),
            ]
        );
        assert_eq!(
            dests(&p, key),
            vec![
                (sa("10.244.7.1:8080"), 1),
                (sa("10.244.7.2:8080"), 1),
                (sa("10.244.7.9:8080"), 1)
            ]
        );
        // No set holds a remote endpoint, and no address changes: nothing else is sent.
        assert_eq!(p.host.restores.len(), restores);
        assert_eq!(p.host.calls.len(), host_calls, "{:?}", p.host.calls);
        assert_eq!(p.ipt.restores.len(), ipt_restores, "the iptables rules did not change");

        // A UDP-less, connection-less endpoint that only gains: no listing at all.
        p.ipvs.take_calls();
        p.sync(&many(Some((
            7,
            &["10.244.7.1", "10.244.7.2", "10.244.7.9", "10.244.7.10"],
        ))))
        .expect("sync");
        assert_eq!(
            p.ipvs.calls(),
            [Call::AddDest(key, RealServer::new(ip("10.244.7.10"), 8080, 1))]
        );
    }

    #[test]
    fn services_that_come_and_go_are_sent_alone_and_a_full_sync_repairs_drift() {
        let mut p = proxier();
        let mut st = many(None);
        p.sync(&st).expect("sync");
        p.ipvs.take_calls();
        let mut ports: Vec<ServicePortState> = st.service_ports.iter().map(|s| (**s).clone()).collect();
        ports.retain(|s| s.port.name.name != "s3");
        ports.push(port("new", "10.96.2.1", Protocol::Tcp, &["10.244.99.1"]));
        st = state(ports);
        let report = p.sync(&st).expect("sync");
        assert!(!report.full);
        let (gone, new) = (tcp_key("10.96.1.3", 80), tcp_key("10.96.2.1", 80));
        let mut calls = p.ipvs.take_calls();
        calls.sort_by_key(|c| format!("{c:?}"));
        let mut want = vec![
            Call::AddService(virtual_server(&render(&st, &p.opts).virtual_servers[0]).without_stats()),
            Call::AddDest(new, RealServer::new(ip("10.244.99.1"), 8080, 1)),
            Call::Dests(gone),
            Call::DeleteDest(gone, sa("10.244.3.1:8080")),
            Call::DeleteDest(gone, sa("10.244.3.2:8080")),
            Call::DeleteDest(gone, sa("10.244.3.3:8080")),
            Call::DeleteService(gone),
        ];
        // The rendered list is sorted by address: find the new one's virtual server.
        let new_vs = render(&st, &p.opts)
            .virtual_servers
            .iter()
            .find(|v| v.address == ip("10.96.2.1"))
            .map(virtual_server)
            .expect("rendered");
        want[0] = Call::AddService(new_vs);
        want.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(calls, want);
        assert!(p.host.links[DUMMY_DEVICE].contains(&ip("10.96.2.1")));
        assert!(!p.host.links[DUMMY_DEVICE].contains(&ip("10.96.1.3")));

        // Someone deletes one of our real servers: a sync of changes does not look, the
        // periodic full sync lists everything and puts it back.
        let key = tcp_key("10.96.1.5", 80);
        let vs = p.ipvs.table()[&key].0.clone();
        p.ipvs
            .delete_dest(&vs, &RealServer::new(ip("10.244.5.1"), 8080, 1))
            .expect("deleted behind its back");
        p.ipvs.take_calls();
        p.sync(&st).expect("sync");
        assert!(p.ipvs.calls().is_empty(), "{:?}", p.ipvs.calls());
        assert_eq!(dests(&p, key).len(), 2);
        p.force_full_sync();
        assert!(p.sync(&st).expect("sync").full);
        assert!(p.ipvs.calls().contains(&Call::Services));
        assert_eq!(dests(&p, key).len(), 3);
    }

    #[test]
    fn ipsets_are_changed_entry_by_entry_never_flushed() {
        let mut p = proxier();
        p.sync(&state(vec![
            port("a", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"]),
            port("b", "10.96.0.11", Protocol::Tcp, &["10.244.1.2"]),
        ]))
        .expect("sync");
        p.sync(&state(vec![
            port("a", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"]),
            port("c", "10.96.0.12", Protocol::Tcp, &["10.244.1.2"]),
        ]))
        .expect("sync");
        let last = p.host.restores.last().expect("a restore");
        assert!(last.contains("add KUBE-CLUSTER-IP 10.96.0.12,6:80\n"), "{last}");
        assert!(last.contains("del KUBE-CLUSTER-IP 10.96.0.11,6:80\n"), "{last}");
        assert!(
            !last.contains("10.96.0.10,tcp:80"),
            "unchanged entries untouched: {last}"
        );
        assert!(!last.contains("flush") && !last.contains("destroy") && !last.contains("swap"));
        // Only the sets that change are named (the ClusterIPs, and the addresses of kube-ipvs0).
        let named: BTreeSet<&str> = last.lines().filter_map(|l| l.split_whitespace().nth(1)).collect();
        assert_eq!(named, BTreeSet::from(["KUBE-CLUSTER-IP", "KUBE-IPVS-IPS"]), "{last}");
        assert_eq!(
            p.host.sets["KUBE-CLUSTER-IP"],
            BTreeSet::from(["10.96.0.10,tcp:80".to_string(), "10.96.0.12,tcp:80".to_string()])
        );
        // The address of the removed Service is unbound, its virtual server deleted.
        assert_eq!(
            p.host.links[DUMMY_DEVICE],
            BTreeSet::from([ip("10.96.0.10"), ip("10.96.0.12")])
        );
        assert!(!p.ipvs.table().contains_key(&tcp_key("10.96.0.11", 80)));
    }

    #[test]
    fn host_sized_nets_compare_as_ipset_prints_them() {
        let mut p = proxier();
        let st = state(vec![port("a", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]);
        let rs = render(&st, &p.opts);
        p.host.sets.insert(
            "KUBE-LOAD-BALANCER-SOURCE-CIDR".into(),
            BTreeSet::from(["1.2.3.4,tcp:80,10.0.0.1".to_string()]),
        );
        let mut rs2 = rs.clone();
        for s in &mut rs2.ipsets {
            if s.name == "KUBE-LOAD-BALANCER-SOURCE-CIDR" {
                s.entries = vec!["1.2.3.4,tcp:80,10.0.0.1/32".into()];
            }
        }
        let input = ipset_changes(&rs2, &p.host.sets);
        assert!(!input.contains("1.2.3.4"), "same entry, other spelling: {input}");
    }

    #[test]
    fn a_removed_endpoint_with_connections_drains_then_goes() {
        let mut p = proxier();
        let key = tcp_key("10.96.0.10", 80);
        p.sync(&state(vec![port(
            "web",
            "10.96.0.10",
            Protocol::Tcp,
            &["10.244.1.2", "10.244.2.2"],
        )]))
        .expect("sync");
        assert!(p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 1, 0));
        let st = state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.2.2"])]);
        p.sync(&st).expect("sync");
        assert_eq!(
            dests(&p, key),
            vec![(sa("10.244.1.2:8080"), 0), (sa("10.244.2.2:8080"), 1)],
            "weight 0 while connected"
        );
        assert_eq!(p.draining(), vec![(key, sa("10.244.1.2:8080"))]);
        let due = p.next_cleanup().expect("a re-check is scheduled");
        assert!(due <= Instant::now() + DRAIN_CHECK_FIRST);

        // Not due yet: an unchanged sync does not even look.
        p.ipvs.take_calls();
        p.sync(&st).expect("sync");
        assert!(p.ipvs.calls().is_empty(), "{:?}", p.ipvs.calls());

        // Due, still connected: kept, and the next check backs off.
        p.next_check = Some(Instant::now());
        p.sync(&st).expect("sync");
        assert_eq!(dests(&p, key).len(), 2);
        let later = p.next_cleanup().expect("still scheduled");
        assert!(later > Instant::now() + DRAIN_CHECK_FIRST, "backed off");

        // Inactive connections (TIME_WAIT, CLOSE...) still count for TCP.
        assert!(p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 0, 3));
        p.next_check = Some(Instant::now());
        p.sync(&st).expect("sync");
        assert_eq!(dests(&p, key).len(), 2);

        assert!(p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 0, 0));
        p.next_check = Some(Instant::now());
        p.sync(&st).expect("sync");
        assert_eq!(dests(&p, key), vec![(sa("10.244.2.2:8080"), 1)]);
        assert!(p.draining().is_empty());
        assert_eq!(p.next_cleanup(), None);
    }

    #[test]
    fn a_draining_endpoint_that_comes_back_gets_its_weight_back() {
        let mut p = proxier();
        let key = tcp_key("10.96.0.10", 80);
        let both = state(vec![port(
            "web",
            "10.96.0.10",
            Protocol::Tcp,
            &["10.244.1.2", "10.244.2.2"],
        )]);
        p.sync(&both).expect("sync");
        p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 2, 0);
        p.sync(&state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.2.2"])]))
            .expect("sync");
        p.sync(&both).expect("sync");
        assert_eq!(
            dests(&p, key),
            vec![(sa("10.244.1.2:8080"), 1), (sa("10.244.2.2:8080"), 1)]
        );
        assert!(p.draining().is_empty());
    }

    #[test]
    fn udp_real_servers_go_at_once() {
        let mut p = proxier();
        let key = ServiceKey::Addr {
            protocol: Protocol::Udp,
            address: ip("10.96.0.53"),
            port: 80,
        };
        p.sync(&state(vec![port(
            "dns",
            "10.96.0.53",
            Protocol::Udp,
            &["10.244.1.2", "10.244.2.2"],
        )]))
        .expect("sync");
        p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 0, 5);
        let report = p
            .sync(&state(vec![port("dns", "10.96.0.53", Protocol::Udp, &["10.244.2.2"])]))
            .expect("sync");
        assert_eq!(dests(&p, key), vec![(sa("10.244.2.2:8080"), 1)]);
        assert!(report.udp_endpoints_removed);
        assert!(p.draining().is_empty());
    }

    #[test]
    fn a_removed_service_drains_keeps_its_address_then_goes() {
        let mut p = proxier();
        let key = tcp_key("10.96.0.10", 80);
        p.sync(&state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]))
            .expect("sync");
        p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 1, 0);
        let empty = state(vec![]);
        p.sync(&empty).expect("sync");
        assert_eq!(dests(&p, key), vec![(sa("10.244.1.2:8080"), 0)]);
        assert!(
            p.host.links[DUMMY_DEVICE].contains(&ip("10.96.0.10")),
            "bound while its connections drain"
        );
        assert!(p.host.sets["KUBE-CLUSTER-IP"].is_empty(), "no new connections");
        p.ipvs.set_conns(&key, sa("10.244.1.2:8080"), 0, 0);
        p.next_check = Some(Instant::now());
        p.sync(&empty).expect("sync");
        assert!(p.ipvs.table().is_empty(), "{:?}", p.ipvs.table());
        assert!(p.host.links[DUMMY_DEVICE].is_empty());
        assert_eq!(p.next_cleanup(), None);
    }

    #[test]
    fn other_users_virtual_servers_are_left_alone() {
        let mut p = proxier();
        // Someone else's, on a node address and on an address we never bound.
        for (addr, port) in [("192.168.49.2", 443), ("172.16.0.1", 80)] {
            let vs = VirtualServer::new(ip(addr), Protocol::Tcp, port, "wlc");
            p.ipvs.add_service(&vs).expect("add");
            p.ipvs
                .add_dest(&vs, &RealServer::new(ip("10.0.0.9"), 443, 1))
                .expect("add dest");
        }
        // A stale one of ours (on kube-ipvs0 from an earlier run), and one in an excluded CIDR.
        p.host.links.insert(
            DUMMY_DEVICE.into(),
            BTreeSet::from([ip("10.96.0.99"), ip("10.100.0.1")]),
        );
        for addr in ["10.96.0.99", "10.100.0.1"] {
            p.ipvs
                .add_service(&VirtualServer::new(ip(addr), Protocol::Tcp, 80, "rr"))
                .expect("add");
        }
        p.set_options(IpvsRenderOptions {
            exclude_cidrs: vec!["10.100.0.0/16".parse().expect("cidr")],
            ..IpvsRenderOptions::default()
        });
        p.sync(&state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]))
            .expect("sync");
        let table = p.ipvs.table();
        assert!(table.contains_key(&tcp_key("192.168.49.2", 443)));
        assert!(table.contains_key(&tcp_key("172.16.0.1", 80)));
        assert!(table.contains_key(&tcp_key("10.100.0.1", 80)), "excluded CIDR");
        assert!(!table.contains_key(&tcp_key("10.96.0.99", 80)), "stale one of ours");
        assert!(table.contains_key(&tcp_key("10.96.0.10", 80)));
    }

    #[test]
    fn settings_changes_update_the_virtual_server_in_place() {
        let mut p = proxier();
        let key = tcp_key("10.96.0.10", 80);
        let mut sp = port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"]);
        p.sync(&state(vec![sp.clone()])).expect("sync");
        sp.port.session_affinity_timeout = Some(600);
        p.ipvs.take_calls();
        p.sync(&state(vec![sp])).expect("sync");
        let calls = p.ipvs.take_calls();
        assert!(
            calls
                .iter()
                .any(|c| matches!(c, Call::UpdateService(vs) if vs.persistent_timeout == Some(600))),
            "{calls:?}"
        );
        assert!(
            !calls
                .iter()
                .any(|c| matches!(c, Call::DeleteService(_) | Call::AddService(_)))
        );
        assert_eq!(p.ipvs.table()[&key].0.persistent_timeout, Some(600));
    }

    #[test]
    fn timeouts_and_strict_arp_are_set_once() {
        let mut p = proxier();
        p.set_options(IpvsRenderOptions {
            strict_arp: true,
            tcp_timeout: Duration::from_secs(100),
            udp_timeout: Duration::from_secs(7),
            ..IpvsRenderOptions::default()
        });
        p.sync(&state(vec![])).expect("sync");
        let t = p.ipvs.timeouts().expect("timeouts");
        assert_eq!((t.tcp, t.tcp_fin, t.udp), (100, Timeouts::KERNEL_DEFAULT.tcp_fin, 7));
        assert_eq!(p.host.sysctls["net/ipv4/conf/all/arp_ignore"], "1");
        assert_eq!(p.host.sysctls["net/ipv4/conf/all/arp_announce"], "2");
        p.ipvs.take_calls();
        p.force_full_sync();
        p.sync(&state(vec![])).expect("sync");
        assert!(!p.ipvs.calls().iter().any(|c| matches!(c, Call::SetTimeouts(_))));
    }

    #[test]
    fn a_failed_step_makes_the_next_sync_full() {
        let mut p = proxier();
        let st = state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]);
        p.host.fail_next_restore = true;
        assert!(p.sync(&st).is_err());
        let report = p.sync(&st).expect("retry");
        assert!(report.full);
        assert!(p.host.sets["KUBE-CLUSTER-IP"].contains("10.96.0.10,tcp:80"));
        p.ipt.fail_next_restore = Some("iptables-restore: line 3 failed".into());
        p.force_full_sync();
        let err = p.sync(&st).expect_err("iptables failure");
        assert!(err.to_string().contains("line 3"), "{err}");
        assert!(p.sync(&st).expect("retry").full);
    }

    #[test]
    fn read_back_of_every_port_lists_the_virtual_servers_once() {
        use crate::proxy::Proxier;
        let mut p = proxier();
        let mut web = port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2", "10.244.1.3"]);
        web.port.node_port = 30080;
        let dns = port("dns", "10.96.0.11", Protocol::Udp, &["10.244.2.2"]);
        let empty = port("empty", "10.96.0.12", Protocol::Tcp, &[]);
        let st = state(vec![web.clone(), dns.clone(), empty.clone()]);
        p.sync(&st).expect("sync");
        p.ipvs.take_calls();
        let ports = [&web.port, &dns.port, &empty.port];
        let read = p.read_back_all(&ports).expect("read back");
        let calls = p.ipvs.take_calls();
        assert_eq!(
            calls.iter().filter(|c| matches!(c, Call::Services)).count(),
            1,
            "{calls:?}"
        );
        let places = |i: usize| -> Vec<&str> { read[i].sections.iter().map(|s| s.place.as_str()).collect() };
        assert_eq!(places(0), vec!["TCP  10.96.0.10:80 rr", "TCP  192.168.49.2:30080 rr"]);
        assert_eq!(read[0].sections[0].lines.len(), 2, "both real servers");
        assert_eq!(places(1), vec!["UDP  10.96.0.11:80 rr"]);
        assert!(
            read[2].sections.iter().all(|s| s.lines.is_empty()),
            "no real servers: {:?}",
            read[2]
        );
        // One port alone reads the same as in the whole read.
        assert_eq!(p.read_back(&web.port).expect("read back"), read[0]);
    }

    #[test]
    fn node_port_virtual_servers_follow_the_interface_addresses() {
        let mut p = proxier();
        let mut sp = port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"]);
        sp.port.node_port = 30080;
        let mut st = state(vec![sp.clone()]);
        // An address of the Node object that no interface holds carries no NodePort.
        st.node.addresses.push(ip("172.16.0.9"));
        p.sync(&st).expect("sync");
        let np = tcp_key("192.168.49.2", 30080);
        let second = tcp_key("192.168.49.3", 30080);
        let node_ports = |p: &P| -> Vec<IpAddr> {
            let mut v: Vec<IpAddr> = p
                .ipvs
                .table()
                .values()
                .filter(|(vs, _)| vs.port == 30080)
                .map(|(vs, _)| vs.address)
                .collect();
            v.sort();
            v
        };
        assert_eq!(node_ports(&p), [ip("192.168.49.2")], "not on loopback nor 172.16.0.9");
        assert!(
            !p.host.links[DUMMY_DEVICE].contains(&ip("192.168.49.2")),
            "node addresses are not bound"
        );

        // A second address appears on an interface: the next sync, nothing else new, adds it
        // (as a difference: no listing of the table).
        p.host.other.push(ip("192.168.49.3"));
        p.ipvs.take_calls();
        let report = p.sync(&st).expect("sync");
        assert!(!report.full);
        assert!(!p.ipvs.calls().contains(&Call::Services), "{:?}", p.ipvs.calls());
        assert_eq!(node_ports(&p), [ip("192.168.49.2"), ip("192.168.49.3")]);
        assert_eq!(dests(&p, second), vec![(sa("10.244.1.2:8080"), 1)]);
        // An unchanged sync lists again, changes nothing.
        p.ipvs.take_calls();
        assert!(!p.sync(&st).expect("sync").full);
        assert!(p.ipvs.calls().iter().all(|c| !c.is_mutation()));

        // It goes: so does its virtual server (ours: we programmed it), at once even with
        // connections (no packet to the address reaches IPVS any more).
        assert!(p.ipvs.set_conns(&second, sa("10.244.1.2:8080"), 0, 4));
        p.host.other.retain(|a| *a != ip("192.168.49.3"));
        p.sync(&st).expect("sync");
        assert_eq!(node_ports(&p), [ip("192.168.49.2")]);
        assert!(p.draining().is_empty());
        assert_eq!(p.next_cleanup(), None);

        // The NodePort goes away: its virtual server too.
        sp.port.node_port = 0;
        p.sync(&state(vec![sp])).expect("sync");
        assert!(!p.ipvs.table().contains_key(&np));
    }

    #[test]
    fn node_ports_left_by_an_earlier_run_go_foreign_ones_stay() {
        // After a restart: the kernel still holds virtual servers of Services deleted while
        // the daemon was down, and other users' ones.
        let mut p = proxier();
        p.host.other.extend([ip("10.0.2.15"), ip("10.0.3.15")]);
        let masq = |vs: &VirtualServer, p: &mut P| {
            p.ipvs
                .add_dest(vs, &RealServer::new(ip("10.244.3.3"), 8080, 1))
                .expect("add dest");
        };
        let add = |addr: &str, port: u16, p: &mut P| {
            let vs = VirtualServer::new(ip(addr), Protocol::Tcp, port, "rr");
            p.ipvs.add_service(&vs).expect("add");
            vs
        };
        // Ours: Masq or no real servers, NodePort range, node address (any interface's).
        let stale = add("192.168.49.2", 30080, &mut p);
        masq(&stale, &mut p);
        let stale_empty = add("192.168.49.2", 31000, &mut p);
        let stale_other_address = add("10.0.3.15", 30080, &mut p);
        masq(&stale_other_address, &mut p);
        // Not ours: direct routing; outside the range; not a node address; loopback;
        // an excluded CIDR.
        let routed = add("192.168.49.2", 30500, &mut p);
        p.ipvs
            .add_dest(
                &routed,
                &RealServer {
                    forward: crate::ipvs::netlink::Forward::DirectRoute,
                    ..RealServer::new(ip("10.0.9.9"), 30500, 1)
                },
            )
            .expect("add dest");
        let out_of_range = add("192.168.49.2", 443, &mut p);
        masq(&out_of_range, &mut p);
        let elsewhere = add("172.16.0.1", 30080, &mut p);
        masq(&elsewhere, &mut p);
        let lo = add("127.0.0.1", 30080, &mut p);
        masq(&lo, &mut p);
        p.set_options(IpvsRenderOptions {
            exclude_cidrs: vec!["10.0.2.0/24".parse().expect("cidr")],
            ..IpvsRenderOptions::default()
        });
        let excluded = add("10.0.2.15", 30081, &mut p);
        masq(&excluded, &mut p);

        p.sync(&state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]))
            .expect("first sync");
        let table = p.ipvs.table();
        for gone in [&stale, &stale_empty, &stale_other_address] {
            assert!(!table.contains_key(&gone.key()), "{gone:?}");
        }
        for kept in [&routed, &out_of_range, &elsewhere, &lo, &excluded] {
            assert!(table.contains_key(&kept.key()), "{kept:?}");
        }
        assert_eq!(table[&routed.key()].1.len(), 1, "untouched");
        assert!(table.contains_key(&tcp_key("10.96.0.10", 80)));
    }

    #[test]
    fn a_stale_node_port_with_connections_drains_first() {
        let mut p = proxier();
        let stale = VirtualServer::new(ip("192.168.49.2"), Protocol::Tcp, 30080, "rr");
        p.ipvs.add_service(&stale).expect("add");
        p.ipvs
            .add_dest(&stale, &RealServer::new(ip("10.244.3.3"), 8080, 1))
            .expect("add dest");
        assert!(p.ipvs.set_conns(&stale.key(), sa("10.244.3.3:8080"), 1, 0));
        let st = state(vec![]);
        p.sync(&st).expect("sync");
        assert_eq!(dests(&p, stale.key()), vec![(sa("10.244.3.3:8080"), 0)]);
        p.ipvs.set_conns(&stale.key(), sa("10.244.3.3:8080"), 0, 0);
        p.next_check = Some(Instant::now());
        p.sync(&st).expect("sync");
        assert!(!p.ipvs.table().contains_key(&stale.key()));
    }

    #[test]
    fn a_draining_node_port_goes_with_its_address() {
        let mut p = proxier();
        p.host.other.push(ip("192.168.49.3"));
        let mut sp = port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"]);
        sp.port.node_port = 30080;
        p.sync(&state(vec![sp.clone()])).expect("sync");
        let (first, second) = (tcp_key("192.168.49.2", 30080), tcp_key("192.168.49.3", 30080));
        for key in [&first, &second] {
            assert!(p.ipvs.set_conns(key, sa("10.244.1.2:8080"), 1, 0));
        }
        // The NodePort goes: its virtual server drains...
        sp.port.node_port = 0;
        let st = state(vec![sp]);
        p.sync(&st).expect("sync");
        assert_eq!(dests(&p, second), vec![(sa("10.244.1.2:8080"), 0)]);
        // ...until its address goes too.
        p.host.other.retain(|a| *a != ip("192.168.49.3"));
        p.force_full_sync();
        p.sync(&st).expect("sync");
        assert!(!p.ipvs.table().contains_key(&second));
        assert_eq!(p.draining(), vec![(first, sa("10.244.1.2:8080"))], "still draining");
    }

    #[test]
    fn failing_to_list_addresses_fails_the_sync() {
        let mut p = proxier();
        let st = state(vec![port("web", "10.96.0.10", Protocol::Tcp, &["10.244.1.2"])]);
        p.sync(&st).expect("sync");
        p.host.fail_next_list = true;
        let err = p.sync(&st).expect_err("no addresses");
        assert!(err.to_string().contains("ip -o addr show"), "{err}");
        assert!(p.sync(&st).expect("retry").full);
    }
}
