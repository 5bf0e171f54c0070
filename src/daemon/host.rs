//! The node's own edges that the sync loop touches besides the proxiers: a sysctl it reads, one
//! it sets, and the conntrack table it cleans. [`NodeHost`] is the real node (the process's
//! network namespace); [`RecordingHost`] records what a test's loop asked.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tracing::warn;

use crate::conntrack::{self, UdpServices};
use crate::model::IpFamily;

/// The host edges of the sync loop.
pub trait Host: Send {
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` is set.
    fn tcp_be_liberal(&mut self) -> bool;
    /// Sets `net.ipv4.conf.all.route_localnet=1` (localhost NodePorts need it).
    fn ensure_route_localnet(&mut self);
    /// Deletes conntrack entries of UDP flows to `services` whose endpoint went; how many
    /// were deleted.
    fn clean_conntrack(&mut self, family: IpFamily, services: &UdpServices) -> Result<usize, String>;
}

/// The node this process runs on.
#[derive(Debug, Default)]
pub struct NodeHost;

const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";

impl Host for NodeHost {
    fn tcp_be_liberal(&mut self) -> bool {
        std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal").is_ok_and(|v| v.trim() != "0")
    }

    fn ensure_route_localnet(&mut self) {
        if std::fs::read_to_string(ROUTE_LOCALNET)
            .map(|v| v.trim() != "1")
            .unwrap_or(true)
            && let Err(e) = std::fs::write(ROUTE_LOCALNET, "1")
        {
            warn!(error = %e, "Could not set net.ipv4.conf.all.route_localnet=1; localhost NodePorts will not work");
        }
    }

    fn clean_conntrack(&mut self, family: IpFamily, services: &UdpServices) -> Result<usize, String> {
        conntrack::Netlink::new()
            .and_then(|mut ct| conntrack::clean_stale_entries(&mut ct, family, services))
            .map_err(|e| e.to_string())
    }
}

/// What a [`RecordingHost`] was asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostCall {
    RouteLocalnet,
    CleanConntrack(IpFamily),
}

/// A host that records calls; clones share the record.
#[derive(Clone, Debug, Default)]
pub struct RecordingHost {
    calls: Arc<Mutex<Vec<(Instant, HostCall)>>>,
}

impl RecordingHost {
    pub fn calls(&self) -> MutexGuard<'_, Vec<(Instant, HostCall)>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, call: HostCall) {
        self.calls().push((tokio::time::Instant::now().into_std(), call));
    }
}

impl Host for RecordingHost {
    fn tcp_be_liberal(&mut self) -> bool {
        false
    }

    fn ensure_route_localnet(&mut self) {
        self.push(HostCall::RouteLocalnet);
    }

    fn clean_conntrack(&mut self, family: IpFamily, _services: &UdpServices) -> Result<usize, String> {
        self.push(HostCall::CleanConntrack(family));
        Ok(0)
    }
}
