//! The layer every dataplane uses and none owns: the render options all modes share, the
//! node's addresses and nodePortAddresses, and what a sync reports. The daemon speaks to every
//! mode through these types only.

pub mod addresses;
pub mod options;

use std::time::Duration;

pub use addresses::{NodePortAddresses, local_addresses};
pub use options::RenderOptions;

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
}

/// The operations in `iptables-restore` (or `ipset restore`) input: its rule and chain lines
/// (table headers and `COMMIT` carry no change of their own).
pub fn restore_operations(input: &str) -> usize {
    input
        .lines()
        .filter(|l| l.starts_with('-') || l.starts_with(':') || l.starts_with("add ") || l.starts_with("del "))
        .count()
}
