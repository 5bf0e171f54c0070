//! Stale UDP flow cleanup, the pure part and its seam: which flows point at something that is
//! no longer a serving endpoint ([`stale_flows`], over [`UdpServices`]), the [`ConntrackTable`]
//! the cleanup lists and deletes through, its in-memory [`Fake`], and [`clean_stale_entries`],
//! which ties them together. The kernel's table is in `ctnetlink`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

use tracing::debug;

use crate::model::{IpFamily, Protocol, ProxyState};

/// One UDP flow as conntrack knows it: the original tuple (as the client sent it) and the reply
/// tuple (as the kernel expects the answer, i.e. after DNAT the reply source is the endpoint).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Flow {
    pub orig_src: IpAddr,
    pub orig_dst: IpAddr,
    pub orig_sport: u16,
    pub orig_dport: u16,
    pub reply_src: IpAddr,
    pub reply_dst: IpAddr,
    pub reply_sport: u16,
    pub reply_dport: u16,
}

impl Flow {
    /// The family of the flow (of its original destination).
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.orig_dst)
    }

    /// Where the reply comes from: for a DNATed service flow, the endpoint it was sent to.
    pub fn reply_source(&self) -> SocketAddr {
        SocketAddr::new(self.reply_src, self.reply_sport)
    }
}

impl fmt::Display for Flow {
    /// `udp 10.0.0.1:5000 -> 10.96.0.10:53 reply 10.244.1.5:53 -> 10.0.0.1:5000`, IPv6 bracketed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "udp {} -> {} reply {} -> {}",
            SocketAddr::new(self.orig_src, self.orig_sport),
            SocketAddr::new(self.orig_dst, self.orig_dport),
            SocketAddr::new(self.reply_src, self.reply_sport),
            SocketAddr::new(self.reply_dst, self.reply_dport),
        )
    }
}

/// What the proxy knows about the UDP service ports of one family.
///
/// Endpoints are `ip:port`, as upstream compares them (`net.JoinHostPort(endpoint.IP(), port)`):
/// an endpoint that keeps its IP but changes its port makes the old flows stale too.
#[derive(Clone, Debug, Default)]
pub struct UdpServices {
    /// Service IP (ClusterIP, external IP or LoadBalancer IP) and service port → serving endpoints.
    pub by_ip_port: HashMap<(IpAddr, u16), HashSet<SocketAddr>>,
    /// NodePort (any destination IP) → serving endpoints.
    pub by_node_port: HashMap<u16, HashSet<SocketAddr>>,
}

impl UdpServices {
    /// Records one UDP service port the way `CleanStaleEntries` builds its maps: every frontend IP
    /// at `port`, plus `*:node_port` when `node_port` is not 0. A port without serving endpoints
    /// is not recorded at all, so its flows are left alone.
    pub fn add_service_port(
        &mut self,
        frontend_ips: impl IntoIterator<Item = IpAddr>,
        port: u16,
        node_port: u16,
        serving: HashSet<SocketAddr>,
    ) {
        if serving.is_empty() {
            return;
        }
        for ip in frontend_ips {
            self.by_ip_port.insert((ip, port), serving.clone());
        }
        if node_port != 0 {
            self.by_node_port.insert(node_port, serving);
        }
    }

    /// The UDP service ports of one family's proxy state: ClusterIP, LoadBalancer VIPs and external
    /// IPs at the service port, and the NodePort, each mapped to the port's serving endpoints.
    ///
    /// Serving, not ready: upstream deliberately ignores traffic policies, topology and terminating
    /// state here so that UDP flows live exactly as long as a TCP connection would. Two service
    /// ports claiming the same frontend is a conflict upstream resolves in map order; here the
    /// later one (in the state's sorted order) wins.
    pub fn from_state(state: &ProxyState) -> UdpServices {
        let mut services = UdpServices::default();
        for sps in &state.service_ports {
            let port = &sps.port;
            if port.protocol != Protocol::Udp {
                continue;
            }
            let serving: HashSet<SocketAddr> = sps
                .endpoints
                .iter()
                .filter(|e| e.serving)
                .map(|e| SocketAddr::new(e.ip, e.port))
                .collect();
            let frontends = std::iter::once(port.cluster_ip)
                .chain(port.load_balancer_vips.iter().copied())
                .chain(port.external_ips.iter().copied());
            services.add_service_port(frontends, port.port, port.node_port, serving);
        }
        services
    }

    pub fn is_empty(&self) -> bool {
        self.by_ip_port.is_empty() && self.by_node_port.is_empty()
    }
}

/// The flows that must go, in input order, each once.
///
/// A flow is stale when
/// 1. its original destination `ip:port` is a service frontend and its reply source `ip:port` is
///    not one of that port's serving endpoints (upstream's `filterForIPPortNAT` case), or else
/// 2. its original destination port is a NodePort — whatever the destination IP — and its reply
///    source `ip:port` is not one of that NodePort's serving endpoints (`filterForPortNAT`).
///
/// Like upstream, a flow whose frontend matches but whose endpoint is serving still goes through
/// the NodePort check. Empty endpoint sets are skipped (a service with no serving endpoints keeps
/// its flows), whether or not they came through [`UdpServices::add_service_port`].
pub fn stale_flows(flows: &[Flow], services: &UdpServices) -> Vec<Flow> {
    let stale_for = |serving: Option<&HashSet<SocketAddr>>, flow: &Flow| {
        serving.is_some_and(|set| !set.is_empty() && !set.contains(&flow.reply_source()))
    };
    flows
        .iter()
        .filter(|flow| {
            stale_for(services.by_ip_port.get(&(flow.orig_dst, flow.orig_dport)), flow)
                || stale_for(services.by_node_port.get(&flow.orig_dport), flow)
        })
        .cloned()
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The conntrack table
// ---------------------------------------------------------------------------------------------

/// Errors talking to the kernel's conntrack table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not open a NETLINK_NETFILTER socket: {0}")]
    Socket(#[source] io::Error),
    #[error("could not send {what} to ctnetlink: {source}")]
    Send {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("could not receive the ctnetlink reply to {what}: {source}")]
    Recv {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("ctnetlink refused {what}: {source}")]
    Kernel {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("malformed ctnetlink reply to {what}: {detail}")]
    Decode { what: String, detail: String },
    #[error("cannot delete flow {flow}: its addresses are of different families")]
    MixedFamilies { flow: Flow },
    #[error(
        "{failed} of {attempted} stale conntrack flows could not be deleted ({deleted} deleted); first failure: {first}"
    )]
    Delete {
        attempted: usize,
        deleted: usize,
        failed: usize,
        #[source]
        first: Box<Error>,
    },
}

/// The kernel's conntrack table, as far as stale UDP cleanup needs it.
pub trait ConntrackTable {
    /// All UDP flows of `family`. A dump the kernel flags as interrupted still yields what it
    /// returned (upstream cleans with a partial result too).
    fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, Error>;
    /// Deletes these flows (by original tuple); returns how many the kernel actually removed.
    /// A flow that is already gone is not an error and is not counted.
    fn delete(&mut self, flows: &[Flow]) -> Result<usize, Error>;
}

/// Lists the family's flows once, filters them with [`stale_flows`] and deletes the stale ones;
/// returns how many were deleted. Upstream's `CleanStaleEntries`, minus its metrics.
pub fn clean_stale_entries(
    ct: &mut dyn ConntrackTable,
    family: IpFamily,
    services: &UdpServices,
) -> Result<usize, Error> {
    let start = Instant::now();
    debug!(ip_family = %family, "Started to reconcile conntrack entries");
    let mut flows = ct.list_udp(family)?;
    // The table is asked for one family; keep the filter honest if an implementation is not.
    flows.retain(|f| f.family() == family);
    let stale = stale_flows(&flows, services);
    for flow in &stale {
        debug!(ip_family = %family, %flow, "Deleting stale conntrack entry");
    }
    let deleted = if stale.is_empty() { 0 } else { ct.delete(&stale)? };
    debug!(
        ip_family = %family,
        entries_listed = flows.len(),
        entries_deleted = deleted,
        took = ?start.elapsed(),
        "Finished reconciling conntrack entries"
    );
    Ok(deleted)
}

/// An in-memory conntrack table: `list_udp` returns the flows of the asked family, `delete` moves
/// the flows it finds from `flows` to `deleted`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fake {
    pub flows: Vec<Flow>,
    pub deleted: Vec<Flow>,
}

impl Fake {
    pub fn new(flows: Vec<Flow>) -> Fake {
        Fake {
            flows,
            deleted: Vec::new(),
        }
    }
}

impl ConntrackTable for Fake {
    fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, Error> {
        Ok(self.flows.iter().filter(|f| f.family() == family).cloned().collect())
    }

    fn delete(&mut self, flows: &[Flow]) -> Result<usize, Error> {
        let mut n = 0;
        for flow in flows {
            if let Some(pos) = self.flows.iter().position(|f| f == flow) {
                self.deleted.push(self.flows.remove(pos));
                n += 1;
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conntrack::testing::{flow, ip, set};
    use crate::model::{Endpoint, NodeInfo, ServicePort, ServicePortName, ServicePortState};

    // -----------------------------------------------------------------------------------------
    // stale_flows: the cases of upstream's cleanup_test.go (TestCleanStaleEntries and friends)
    // -----------------------------------------------------------------------------------------

    const CLUSTER_IP: &str = "172.30.1.1";
    const EXTERNAL_IP: &str = "192.168.99.100";
    const LB_IP: &str = "1.2.3.4";
    const NODE_IP: &str = "10.0.0.10";
    const SERVING_EP: &str = "10.240.0.4";
    const NON_SERVING_EP: &str = "10.240.1.5";
    const DELETED_EP: &str = "10.240.2.6";
    const OLD_EP_PORT: u16 = 8080;
    const EP_PORT: u16 = 9090;
    const SVC_PORT: u16 = 8000;
    const NODE_PORT: u16 = 32000;
    const NON_SVC_PORT: u16 = 3000;

    /// The UDP port of upstream's test Service: ClusterIP, external IP, LB IP, NodePort, one
    /// serving and one non-serving endpoint (only the serving one counts).
    fn upstream_services() -> UdpServices {
        let mut s = UdpServices::default();
        s.add_service_port(
            [ip(CLUSTER_IP), ip(LB_IP), ip(EXTERNAL_IP)],
            SVC_PORT,
            NODE_PORT,
            set(&[&format!("{SERVING_EP}:{EP_PORT}")]),
        );
        s
    }

    /// Upstream's flows (the UDP ones: the TCP and SCTP copies never reach `stale_flows`, the
    /// table lists UDP only) and whether each must be cleaned.
    fn upstream_flows() -> Vec<(Flow, bool)> {
        let mut flows = Vec::new();
        // The endpoint kept its IP but changed port: stale on every frontend.
        for dst in [CLUSTER_IP, LB_IP, EXTERNAL_IP] {
            flows.push((flow(dst, SVC_PORT, SERVING_EP, OLD_EP_PORT), true));
        }
        for dnat in [SERVING_EP, NON_SERVING_EP, DELETED_EP] {
            for dst in [CLUSTER_IP, LB_IP, EXTERNAL_IP] {
                for port in [SVC_PORT, NON_SVC_PORT] {
                    flows.push((flow(dst, port, dnat, EP_PORT), port == SVC_PORT && dnat != SERVING_EP));
                }
            }
            // *:NodePort, here on the node's IP (any destination IP matches).
            flows.push((flow(NODE_IP, NODE_PORT, dnat, EP_PORT), dnat != SERVING_EP));
        }
        // Flows that were never DNATed (no endpoints when they started): the reply comes from
        // the service IP itself, which is no endpoint.
        for dst in [CLUSTER_IP, LB_IP, EXTERNAL_IP] {
            for port in [SVC_PORT, NON_SVC_PORT] {
                flows.push((flow(dst, port, dst, port), port == SVC_PORT));
            }
        }
        flows
    }

    #[test]
    fn stale_flows_upstream_cleanup_table() {
        let cases = upstream_flows();
        let flows: Vec<Flow> = cases.iter().map(|(f, _)| f.clone()).collect();
        let expected: Vec<Flow> = cases
            .iter()
            .filter(|(_, stale)| *stale)
            .map(|(f, _)| f.clone())
            .collect();
        assert_eq!(
            expected.len(),
            3 + 2 * 3 + 2 + 3,
            "upstream's count of cleaned UDP flows"
        );
        assert_eq!(stale_flows(&flows, &upstream_services()), expected);
    }

    #[test]
    fn clean_stale_entries_upstream_cleanup_table_with_fake() {
        let cases = upstream_flows();
        let mut fake = Fake::new(cases.iter().map(|(f, _)| f.clone()).collect());
        let n = clean_stale_entries(&mut fake, IpFamily::V4, &upstream_services()).expect("fake never fails");
        let kept: Vec<Flow> = cases
            .iter()
            .filter(|(_, stale)| !stale)
            .map(|(f, _)| f.clone())
            .collect();
        let gone: Vec<Flow> = cases
            .iter()
            .filter(|(_, stale)| *stale)
            .map(|(f, _)| f.clone())
            .collect();
        assert_eq!(n, gone.len());
        assert_eq!(fake.flows, kept);
        assert_eq!(fake.deleted, gone);
    }

    #[test]
    fn stale_flows_each_frontend_kind() {
        let s = upstream_services();
        let ep = SERVING_EP;
        for dst in [CLUSTER_IP, EXTERNAL_IP, LB_IP] {
            assert!(
                stale_flows(&[flow(dst, SVC_PORT, ep, EP_PORT)], &s).is_empty(),
                "{dst} to serving endpoint"
            );
            assert_eq!(
                stale_flows(&[flow(dst, SVC_PORT, DELETED_EP, EP_PORT)], &s).len(),
                1,
                "{dst} to gone endpoint"
            );
            assert!(
                stale_flows(&[flow(dst, NON_SVC_PORT, DELETED_EP, EP_PORT)], &s).is_empty(),
                "{dst} other port"
            );
        }
        // NodePort: any destination IP, even one that is no service IP at all.
        for dst in [NODE_IP, "192.0.2.77", CLUSTER_IP] {
            assert_eq!(
                stale_flows(&[flow(dst, NODE_PORT, DELETED_EP, EP_PORT)], &s).len(),
                1,
                "{dst}:NodePort"
            );
            assert!(
                stale_flows(&[flow(dst, NODE_PORT, ep, EP_PORT)], &s).is_empty(),
                "{dst}:NodePort serving"
            );
        }
        // A flow to an unrelated destination is never touched.
        assert!(stale_flows(&[flow("8.8.8.8", 53, "8.8.8.8", 53)], &s).is_empty());
    }

    #[test]
    fn stale_flows_service_without_serving_endpoints_is_skipped() {
        // Upstream's TestServiceWithoutEndpoints: the slice belongs to another service, so the
        // port has no endpoints at all and both flows stay.
        let mut s = UdpServices::default();
        s.add_service_port(
            [ip(CLUSTER_IP), ip(LB_IP), ip(EXTERNAL_IP)],
            SVC_PORT,
            NODE_PORT,
            HashSet::new(),
        );
        assert!(s.is_empty(), "a port without serving endpoints is not recorded");
        let flows = [
            flow(EXTERNAL_IP, SVC_PORT, SERVING_EP, EP_PORT),
            flow(EXTERNAL_IP, SVC_PORT, DELETED_EP, EP_PORT),
        ];
        assert!(stale_flows(&flows, &s).is_empty());

        // The same when someone fills the maps by hand with empty sets.
        let mut s = UdpServices::default();
        s.by_ip_port.insert((ip(EXTERNAL_IP), SVC_PORT), HashSet::new());
        s.by_node_port.insert(NODE_PORT, HashSet::new());
        let flows = [
            flow(EXTERNAL_IP, SVC_PORT, DELETED_EP, EP_PORT),
            flow(NODE_IP, NODE_PORT, DELETED_EP, EP_PORT),
        ];
        assert!(stale_flows(&flows, &s).is_empty());
    }

    #[test]
    fn stale_flows_ipv6() {
        let mut s = UdpServices::default();
        s.add_service_port(
            [ip("fd00:10:96::a"), ip("2001:db8::5")],
            53,
            30053,
            set(&["[fd00:10:244::5]:5353"]),
        );
        let keep = flow("fd00:10:96::a", 53, "fd00:10:244::5", 5353);
        let gone_ep = flow("fd00:10:96::a", 53, "fd00:10:244::6", 5353);
        let gone_port = flow("2001:db8::5", 53, "fd00:10:244::5", 53);
        let gone_nodeport = flow("2001:db8::99", 30053, "fd00:10:244::7", 5353);
        let other = flow("2001:db8::99", 30054, "fd00:10:244::7", 5353);
        let flows = [keep, gone_ep.clone(), gone_port.clone(), gone_nodeport.clone(), other];
        assert_eq!(stale_flows(&flows, &s), vec![gone_ep, gone_port, gone_nodeport]);
    }

    #[test]
    fn stale_flows_nodeport_checked_even_when_frontend_endpoint_serves() {
        // Upstream checks the NodePort map whether or not the frontend check fired: a flow to
        // service A's clusterIP:port that A's endpoint answers is still cleaned when that port
        // number is also service B's NodePort and the endpoint is not B's.
        let mut s = UdpServices::default();
        s.add_service_port([ip("10.96.0.1")], 30000, 0, set(&["10.244.0.1:53"]));
        s.add_service_port([ip("10.96.0.2")], 53, 30000, set(&["10.244.0.2:53"]));
        let f = flow("10.96.0.1", 30000, "10.244.0.1", 53);
        assert_eq!(stale_flows(std::slice::from_ref(&f), &s), vec![f.clone()]);
        // And a flow stale by both rules is listed once.
        let both = flow("10.96.0.1", 30000, "10.244.9.9", 53);
        assert_eq!(stale_flows(std::slice::from_ref(&both), &s), vec![both]);
    }

    #[test]
    fn udp_services_from_state_mirrors_upstream_maps() {
        let name = |port: &str, protocol| ServicePortName {
            namespace: "ns".into(),
            name: "svc".into(),
            port: port.into(),
            protocol,
        };
        let mut udp = ServicePort::cluster_ip(name("dns", Protocol::Udp), ip("10.96.0.10"), 53);
        udp.node_port = 30053;
        udp.external_ips = vec![ip("192.0.2.1")];
        udp.load_balancer_vips = vec![ip("198.51.100.1")];
        let mut terminating = Endpoint::ready(ip("10.244.0.6"), 5353);
        terminating.ready = false;
        terminating.terminating = true; // still serving: counts
        let mut not_serving = Endpoint::ready(ip("10.244.0.7"), 5353);
        not_serving.ready = false;
        not_serving.serving = false;
        let tcp = ServicePort::cluster_ip(name("tcp", Protocol::Tcp), ip("10.96.0.11"), 80);
        let empty = ServicePort::cluster_ip(name("empty", Protocol::Udp), ip("10.96.0.12"), 99);
        let state = ProxyState {
            family: IpFamily::V4,
            node: NodeInfo::default(),
            service_ports: crate::model::shared(vec![
                ServicePortState {
                    port: udp,
                    endpoints: vec![
                        Endpoint::ready(ip("10.244.0.5"), 5353),
                        terminating,
                        not_serving.clone(),
                    ],
                },
                ServicePortState {
                    port: tcp,
                    endpoints: vec![Endpoint::ready(ip("10.244.0.8"), 80)],
                },
                ServicePortState {
                    port: empty,
                    endpoints: vec![not_serving],
                },
            ]),
            service_cidrs: vec![],
            warnings: vec![],
        };
        let s = UdpServices::from_state(&state);
        let serving = set(&["10.244.0.5:5353", "10.244.0.6:5353"]);
        let expected: HashMap<(IpAddr, u16), HashSet<SocketAddr>> = [
            ((ip("10.96.0.10"), 53), serving.clone()),
            ((ip("192.0.2.1"), 53), serving.clone()),
            ((ip("198.51.100.1"), 53), serving.clone()),
        ]
        .into_iter()
        .collect();
        assert_eq!(s.by_ip_port, expected);
        assert_eq!(s.by_node_port, [(30053, serving)].into_iter().collect());
    }

    // -----------------------------------------------------------------------------------------
    // clean_stale_entries and the fake
    // -----------------------------------------------------------------------------------------

    /// Counts calls, to check that cleanup lists once and deletes once.
    struct Counting {
        inner: Fake,
        lists: Vec<IpFamily>,
        deletes: usize,
    }

    impl ConntrackTable for Counting {
        fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, Error> {
            self.lists.push(family);
            self.inner.list_udp(family)
        }
        fn delete(&mut self, flows: &[Flow]) -> Result<usize, Error> {
            self.deletes += 1;
            self.inner.delete(flows)
        }
    }

    #[test]
    fn clean_stale_entries_lists_once_deletes_once() {
        let v6 = flow("fd00::a", SVC_PORT, "fd00::dead", EP_PORT);
        let stale = flow(CLUSTER_IP, SVC_PORT, DELETED_EP, EP_PORT);
        let kept = flow(CLUSTER_IP, SVC_PORT, SERVING_EP, EP_PORT);
        let mut s = upstream_services();
        // A v6 service with the same port must not touch v4 cleanup (and vice versa).
        s.add_service_port([ip("fd00::a")], SVC_PORT, 0, set(&["[fd00::1]:9090"]));
        let mut t = Counting {
            inner: Fake::new(vec![v6.clone(), stale.clone(), kept.clone()]),
            lists: vec![],
            deletes: 0,
        };
        assert_eq!(clean_stale_entries(&mut t, IpFamily::V4, &s).expect("fake"), 1);
        assert_eq!((t.lists.as_slice(), t.deletes), (&[IpFamily::V4][..], 1));
        assert_eq!(t.inner.flows, vec![v6.clone(), kept.clone()]);
        assert_eq!(t.inner.deleted, vec![stale]);

        // Nothing stale: no delete call at all.
        assert_eq!(clean_stale_entries(&mut t, IpFamily::V4, &s).expect("fake"), 0);
        assert_eq!(t.deletes, 1);

        assert_eq!(clean_stale_entries(&mut t, IpFamily::V6, &s).expect("fake"), 1);
        assert_eq!(t.inner.flows, vec![kept]);
        assert_eq!(t.inner.deleted.last(), Some(&v6));
    }

    #[test]
    fn fake_lists_by_family_and_counts_only_present_flows() {
        let a = flow(CLUSTER_IP, 1, SERVING_EP, 1);
        let b = flow("fd00::a", 1, "fd00::b", 1);
        let mut fake = Fake::new(vec![a.clone(), b.clone()]);
        assert_eq!(fake.list_udp(IpFamily::V4).expect("fake"), vec![a.clone()]);
        assert_eq!(fake.list_udp(IpFamily::V6).expect("fake"), vec![b.clone()]);
        assert_eq!(fake.delete(&[a.clone(), a.clone()]).expect("fake"), 1);
        assert_eq!((fake.flows, fake.deleted), (vec![b], vec![a]));
    }

    #[test]
    fn flow_display() {
        let f = flow("fd00::a", 53, "fd00::b", 5353);
        assert_eq!(
            f.to_string(),
            "udp [fd00::1]:40000 -> [fd00::a]:53 reply [fd00::b]:5353 -> [fd00::1]:40000"
        );
    }
}
