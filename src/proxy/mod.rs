//! The layer every dataplane uses and none owns: the render options all modes share, the
//! node's addresses and nodePortAddresses, what a sync reports, and the [`Proxier`] trait
//! through which the daemon drives iptables, nftables and IPVS mode alike (with a recording
//! fake in [`testing`]).

pub mod addresses;
pub mod options;
pub mod testing;

use std::time::{Duration, Instant};

pub use addresses::{NodePortAddresses, local_addresses};
pub use options::RenderOptions;

use crate::config::{ProxyConfig, ProxyMode};
use crate::model::store::PortChange;
use crate::model::{IpFamily, NodeInfo, ProxyState, ServicePort};

/// What the proxiers need besides the model to decide their rules; the daemon builds it once
/// per sync and hands it to every family's proxier.
#[derive(Clone, Copy, Debug)]
pub struct SyncContext<'a> {
    pub config: &'a ProxyConfig,
    /// This node (name, labels, addresses, pod CIDRs).
    pub node: &'a NodeInfo,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` is set on the host (iptables mode then
    /// drops no INVALID packets, as upstream).
    pub tcp_be_liberal: bool,
}

/// A sync that failed. The kernel keeps the rules of the last successful sync (or, where a
/// transaction was cut short, part of the new ones); the daemon retries with a full sync.
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct SyncError {
    /// The failed sync was a full one (iptables mode counts failed partial syncs apart).
    pub full: bool,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl SyncError {
    pub fn new(full: bool, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> SyncError {
        SyncError {
            full,
            source: source.into(),
        }
    }
}

/// What the kernel holds for one service port, read back in the mode's own terms: each
/// section is where it lives (a table and chain, an nftables map or chain, an IPVS virtual
/// server) with its lines as the mode's tools print them (counters included where the kernel
/// keeps them).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Programmed {
    pub sections: Vec<ProgrammedSection>,
}

/// One place in the kernel and the lines of one service port there.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProgrammedSection {
    /// e.g. `nat KUBE-SVC-…`, `ip kube-proxy service-ips`, `TCP 10.96.0.10:53`.
    pub place: String,
    pub lines: Vec<String>,
}

/// Reading back failed (the tool or the kernel did not answer).
#[derive(Debug, thiserror::Error)]
#[error("reading back the rules of {what}: {message}")]
pub struct ReadBackError {
    pub what: String,
    pub message: String,
}

/// One IP family's dataplane, as the daemon drives it. Implemented by iptables, nftables and
/// IPVS mode; [`testing::RecordingProxier`] records what it is asked.
pub trait Proxier: Send {
    /// The mode, as `/proxyMode` and the logs name it.
    fn mode(&self) -> ProxyMode;

    fn family(&self) -> IpFamily;

    /// Takes the configuration and this node as they are for the coming sync; a change that
    /// alters the rules makes the next sync a full one.
    fn configure(&mut self, ctx: &SyncContext<'_>);

    /// Writes everything `state` needs and removes what it no longer needs, whatever the
    /// kernel holds now (at start, after a failure, after someone flushed our rules, and
    /// periodically where the mode wants that).
    fn sync_full(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError>;

    /// Writes only what changed since the last successful sync. A proxier that has no such
    /// sync to build on, or whose rendering context changed, does a full one (the report says
    /// which it was).
    fn sync_changes(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError>;

    /// As [`Proxier::sync_changes`], told which service ports differ from the state of the
    /// last successful sync: `changed` holds each one's new version (`None` where it is gone),
    /// and every other port of `state` is as it was. A mode that can use that does not walk
    /// the others; the default ignores it.
    fn sync_changed(&mut self, state: &ProxyState, changed: &[PortChange]) -> Result<SyncReport, SyncError> {
        let _ = changed;
        self.sync_changes(state)
    }

    /// Whether what marks our rules in the kernel is still there (iptables: the canary chains
    /// and the entry jump; nftables: our table; IPVS: the entry jump and `kube-ipvs0`). When
    /// it is not, someone flushed or reloaded the tables and the daemon does a full sync.
    fn intact(&mut self) -> bool;

    /// When a sync is due without any change (nftables: deleting chains flushed earlier; IPVS:
    /// re-checking real servers that drain).
    fn next_cleanup(&self) -> Option<Instant> {
        None
    }

    /// How often a full sync is due even without a change (upstream's `FullSyncPeriod` in
    /// iptables mode), if ever.
    fn full_sync_period(&self) -> Option<Duration> {
        None
    }

    /// Whether every sync period brings a sync even without a change (IPVS mode: its NodePort
    /// virtual servers follow the interface addresses, which nothing watched reports).
    fn syncs_every_period(&self) -> bool {
        false
    }

    /// Removes everything this mode programmed in this family (`--cleanup`, mode switches);
    /// the errors met, none when all went.
    fn cleanup(&mut self) -> Vec<String>;

    /// Reads back from the kernel what is programmed for `port` (`kube-proxy explain`).
    fn read_back(&mut self, port: &ServicePort) -> Result<Programmed, ReadBackError>;

    /// [`Proxier::read_back`] of many ports at once (`kube-proxy explain --all`); a mode that
    /// can read its rules once and pick every port's from them does so.
    fn read_back_all(&mut self, ports: &[&ServicePort]) -> Result<Vec<Programmed>, ReadBackError> {
        ports.iter().map(|p| self.read_back(p)).collect()
    }
}

/// What one sync did, in the same terms in every mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Everything was written (not only what changed since the last sync).
    pub full: bool,
    /// Service ports whose kernel objects this sync wrote or rewrote.
    pub rewritten_services: usize,
    /// Kernel objects of service ports that no longer need them, removed by this sync (or,
    /// in nftables mode, flushed to be deleted a little later): chains in iptables and nftables
    /// mode, virtual servers in IPVS mode.
    pub removed_objects: usize,
    /// Changes sent to the kernel, one per object: lines of `iptables-restore` and `ipset`
    /// input, operations of an nftables transaction, IPVS netlink commands (0 when nothing had
    /// to change).
    pub operations: usize,
    pub elapsed: Duration,
    /// UDP service ports that lost serving endpoints or disappeared (stale conntrack possible).
    pub udp_endpoints_removed: bool,
    /// Per iptables table the mode writes to (none in nftables mode): the rules it owns after
    /// this sync and those this sync wrote (`sync_proxy_rules_iptables_total` / `_last`).
    pub tables: Vec<TableRules>,
}

/// Rules of one iptables table after a sync.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableRules {
    pub table: String,
    /// Rules of ours in the table.
    pub total: usize,
    /// Rules the sync's restore input wrote.
    pub written: usize,
}

/// The rules (`-A` lines) per table of `iptables-restore` input, in input order; `total` is
/// left at 0 for the caller, which knows what it owns.
pub fn rules_written(input: &str) -> Vec<TableRules> {
    let mut out: Vec<TableRules> = Vec::new();
    for line in input.lines() {
        if let Some(table) = line.strip_prefix('*') {
            out.push(TableRules {
                table: table.trim().to_string(),
                ..TableRules::default()
            });
        } else if line.starts_with("-A ")
            && let Some(t) = out.last_mut()
        {
            t.written += 1;
        }
    }
    out
}

/// Finishes a sync that started at `start`: a report gets its elapsed time; a failure runs
/// `forget`, which drops the proxier's record of what it applied (what the kernel holds is no
/// longer known, so the next sync starts over).
pub fn finish_sync<E>(start: Instant, result: Result<SyncReport, E>, forget: impl FnOnce()) -> Result<SyncReport, E> {
    match result {
        Ok(mut report) => {
            report.elapsed = start.elapsed();
            Ok(report)
        }
        Err(e) => {
            forget();
            Err(e)
        }
    }
}

/// The operations in `iptables-restore` (or `ipset restore`) input: its rule and chain lines
/// (table headers and `COMMIT` carry no change of their own).
pub fn restore_operations(input: &str) -> usize {
    input
        .lines()
        .filter(|l| l.starts_with('-') || l.starts_with(':') || l.starts_with("add ") || l.starts_with("del "))
        .count()
}
