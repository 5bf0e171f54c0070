//! Conntrack: stale UDP flow cleanup and the `--conntrack-*` sysctls.
//!
//! This module owns two things upstream kube-proxy does to the kernel's connection tracker:
//!
//! - **Stale UDP flow cleanup**, as upstream's `CleanStaleEntries` (pkg/proxy/conntrack/cleanup.go) in
//!   its newest form: list every flow of one family once, decide in pure code which UDP flows point
//!   at something that is no longer a serving endpoint of the service they were sent to, and delete
//!   exactly those flows. UDP has no connection teardown, so without this a client keeps sending to
//!   a dead backend for as long as it keeps the flow alive. The pure part is [`stale_flows`]; the
//!   kernel side is the [`ConntrackTable`] trait with a ctnetlink implementation ([`Netlink`]) and a
//!   recording fake ([`Fake`]); [`clean_stale_entries`] ties them together.
//! - **Conntrack sysctls** set once at start, as upstream's `SetSysctls` (pkg/proxy/conntrack/sysctls.go):
//!   [`apply_sysctls`]. Unlike upstream, a setting the kernel refuses (read-only in a network namespace,
//!   missing module, ...) becomes a warning and never stops the daemon.
//!
//! When to call the cleanup (after a successful rule sync, with the maps of that sync) is the
//! caller's business; this module only knows flows, service frontends and serving endpoints.
//!
//! Submodules: `cleanup` (pure: flows, services, the table trait and its fake), `ctnetlink`
//! (the kernel's table: flows of every protocol with ports, statistics), `stats` (what
//! `kube-proxy explain` reads besides flows: `conntrack -S` and the table's usage), `sysctl`. Everything is used through the re-exports here.

mod cleanup;
mod ctnetlink;
mod stats;
mod sysctl;
#[cfg(test)]
mod testing;

pub use cleanup::{ConntrackTable, Error, Fake, Flow, UdpServices, clean_stale_entries, stale_flows};
pub use ctnetlink::{Dump, Netlink};
pub use stats::{Statistics, TCP_ESTABLISHED, TableUsage, Tracked};
pub use sysctl::{
    ConntrackConfig, HASHSIZE_PATH, apply_sysctls, apply_sysctls_and_hashsize, conntrack_max, detect_num_cpus,
};
