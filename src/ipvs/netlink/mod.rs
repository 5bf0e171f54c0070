//! IPVS over generic netlink, without `ipvsadm`: owns the IPVS family's messages (encoding the
//! requests, decoding the kernel's replies), the socket that exchanges them, the [`Ipvs`]
//! interface the proxier programs against, and [`FakeIpvs`], an in-memory table that refuses
//! what the kernel refuses.
//!
//! Why our own: no maintained crate speaks IPVS on the netlink stack we use (see
//! `ecosystem.md`); the family is small (a dozen commands, two nested attribute sets).
//!
//! - `types` (pure): [`VirtualServer`], [`RealServer`], [`Timeouts`], [`Info`] in the words of
//!   `ipvsadm`.
//! - `message` (pure): requests built as ipvsadm 1.31 builds them (byte fixtures captured from
//!   it in `fixtures`), replies decoded without trusting lengths or presence of attributes.
//! - `wire`: the genetlink header and the kernel's constants (`linux/ip_vs.h`); the netlink
//!   framing itself is [`crate::netlink`]'s.
//! - [`IpvsHandle`] (the edge): one `NETLINK_GENERIC` socket in the caller's network namespace.
//!   Creating it fails with [`IpvsError::NotAvailable`] when the kernel has no IPVS: IPVS mode
//!   must then refuse to start.
//! - [`FakeIpvs`]: records calls; its refusals were checked against a real kernel by
//!   `tests/vm_ipvs_netlink.rs`, which runs the same operations on both.
//!
//! Kernel behaviour worth knowing (checked on Debian's 6.1 in the test VM, where the fake is
//! compared with it step by step):
//! - A missing virtual server is `ESRCH` (update, delete, and every real-server command); a
//!   missing real server is `ENOENT`; a duplicate of either is `EEXIST`; an unknown scheduler
//!   is `ENOENT` (after the kernel tried to load `ip_vs_NAME`); a scheduler name over 15 bytes
//!   is a bare `EINVAL` (attribute policy, no extack text).
//! - Listing the real servers of a missing virtual server is an empty list, not an error; the
//!   list comes newest first.
//! - Real servers need a unicast address in the namespace's routing table: in a fresh network
//!   namespace, bring `lo` up first, or every real server is refused with `EINVAL`. A real
//!   server of the other family is `EINVAL` unless tunnelled (checked before the ranges); a
//!   weight above `i32::MAX` or a lower threshold above the upper one (even an upper one of 0)
//!   is `ERANGE`. Port 0 is kept as 0 (ipvsadm fills in the service's port itself).
//! - Persistence is the `IP_VS_SVC_F_PERSISTENT` flag plus a timeout; dumps also carry the
//!   kernel's "hashed" flag. The scheduler flags (`sh-fallback`/`sh-port`, `mh-...`) are
//!   optional — `sh` and `mh` work without them — and are accepted on any scheduler. An IPv6
//!   persistence netmask outside 1..=128 is `EINVAL`.
//! - Setting a timeout to 0 leaves it unchanged; the largest accepted is `INT_MAX / HZ` seconds
//!   (8589934 with Debian's `HZ=250`), beyond that `EINVAL`.

mod error;
mod fake;
mod message;
mod socket;
mod types;
mod wire;

#[cfg(test)]
mod fixtures;

pub use error::{DecodeError, IpvsError, Op};
pub use fake::{Call, FakeIpvs, KERNEL_SCHEDULERS, MAX_SCHEDULER_NAME};
pub use socket::IpvsHandle;
pub use types::{Forward, Info, RealServer, ServiceFlags, ServiceKey, Stats, Timeouts, VirtualServer, host_netmask};

/// The IPVS operations the proxier needs; [`IpvsHandle`] talks to the kernel, [`FakeIpvs`]
/// keeps a table in memory. Every method is one request (a dump for the listings).
pub trait Ipvs {
    /// The module's version and connection-table size (`ipvsadm -Ln`'s first line).
    fn info(&mut self) -> Result<Info, IpvsError>;
    /// Every virtual server (`ipvsadm -Ln`), in no particular order.
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError>;
    /// `ipvsadm -A`.
    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError>;
    /// `ipvsadm -E`: scheduler, persistence, flags and netmask become `vs`'s.
    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError>;
    /// `ipvsadm -D`, with its real servers.
    fn delete_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError>;
    /// The real servers of `vs` (`ipvsadm -Ln -t ...`), newest first from the kernel.
    fn dests(&mut self, vs: &VirtualServer) -> Result<Vec<RealServer>, IpvsError>;
    /// `ipvsadm -a`.
    fn add_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError>;
    /// `ipvsadm -e`: weight, forwarding and thresholds become `rs`'s.
    fn update_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError>;
    /// `ipvsadm -d`.
    fn delete_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError>;
    /// `ipvsadm -C`: every virtual server of the namespace, whoever made it.
    fn flush(&mut self) -> Result<(), IpvsError>;
    /// `ipvsadm --set`; 0 leaves a timeout unchanged.
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError>;
    /// `ipvsadm -Ln --timeout`.
    fn timeouts(&mut self) -> Result<Timeouts, IpvsError>;
}
