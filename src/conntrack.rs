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

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProtocol, Tuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{Socket, SocketAddr as NlSocketAddr, protocols::NETLINK_NETFILTER};
use nix::errno::Errno;
use tracing::{debug, info, warn};

use crate::model::{IpFamily, Protocol, ProxyState};

// ---------------------------------------------------------------------------------------------
// Flows and services
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// ctnetlink
// ---------------------------------------------------------------------------------------------

/// ctnetlink is nfnetlink subsystem 1; its message types are `subsys << 8 | IPCTNL_MSG_CT_*`.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const IPPROTO_UDP: u8 = 17;
/// Large enough for any single netlink datagram: the kernel caps dump skbs at 32 KiB.
const RECV_BUFFER: usize = 64 * 1024;
/// Delete requests sent per `send`, each acknowledged separately.
const DELETE_BATCH: usize = 64;

fn nfproto(family: IpFamily) -> NetfilterProtoFamily {
    match family {
        IpFamily::V4 => NetfilterProtoFamily::IPv4,
        IpFamily::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn serialize(header: NetlinkHeader, msg: NetfilterMessage) -> Vec<u8> {
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    buf
}

/// `IPCTNL_MSG_CT_GET` with `NLM_F_DUMP`: every flow whose layer-3 protocol is the nfgenmsg family.
fn dump_request(family: IpFamily, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    header.sequence_number = seq;
    serialize(
        header,
        NetfilterMessage::new(
            NetfilterHeader::new(nfproto(family), 0, 0),
            ConntrackMessage::Get(vec![]),
        ),
    )
}

/// `IPCTNL_MSG_CT_DELETE` with `NLM_F_ACK`, identifying the flow by its `CTA_TUPLE_ORIG`.
fn delete_request(flow: &Flow, seq: u32) -> Result<Vec<u8>, Error> {
    let family = flow.family();
    if IpFamily::of(&flow.orig_src) != family {
        return Err(Error::MixedFamilies { flow: flow.clone() });
    }
    let tuple = vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(flow.orig_src),
            IPTuple::DestinationAddress(flow.orig_dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(CtProtocol::Udp),
            ProtoTuple::SourcePort(flow.orig_sport),
            ProtoTuple::DestinationPort(flow.orig_dport),
        ]),
    ];
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_ACK;
    header.sequence_number = seq;
    Ok(serialize(
        header,
        NetfilterMessage::new(
            NetfilterHeader::new(nfproto(family), 0, 0),
            ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(tuple)]),
        ),
    ))
}

/// One netlink message of a reply datagram, reduced to what the table needs.
#[derive(Debug, PartialEq)]
struct Reply {
    seq: u32,
    flags: u16,
    kind: ReplyKind,
}

#[derive(Debug, PartialEq)]
enum ReplyKind {
    /// A ctnetlink flow message: a UDP flow, another protocol, or one we could not decode.
    Flow(Result<Option<Flow>, String>),
    /// `NLMSG_DONE` (its error field, when non-zero, becomes `Nack`).
    Done,
    /// `NLMSG_ERROR` with 0: an acknowledgement.
    Ack,
    /// `NLMSG_ERROR` (or `NLMSG_DONE`) carrying `-errno`.
    Nack(i32),
    Other,
}

/// Splits a received datagram into its messages. Only a broken netlink header is an error (we
/// could not find the next message); a flow that does not decode is reported per message.
fn parse_replies(buf: &[u8]) -> Result<Vec<Reply>, String> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < buf.len() {
        let rest = &buf[off..];
        let nl = NetlinkBuffer::new_checked(rest).map_err(|e| format!("at byte {off}: {e}"))?;
        let len = nl.length() as usize;
        let (seq, flags, msg_type) = (nl.sequence_number(), nl.flags(), nl.message_type());
        let payload = nl.payload();
        let kind = match msg_type {
            NLMSG_ERROR | NLMSG_DONE => match payload.get(..4) {
                Some(code) => match i32::from_ne_bytes([code[0], code[1], code[2], code[3]]) {
                    0 if msg_type == NLMSG_DONE => ReplyKind::Done,
                    0 => ReplyKind::Ack,
                    code => ReplyKind::Nack(code),
                },
                // The kernel may send an empty NLMSG_DONE.
                None if msg_type == NLMSG_DONE => ReplyKind::Done,
                None => return Err(format!("at byte {off}: NLMSG_ERROR without an error code")),
            },
            t if t >> 8 == NFNL_SUBSYS_CTNETLINK => ReplyKind::Flow(decode_flow(&rest[..len])),
            _ => ReplyKind::Other,
        };
        out.push(Reply { seq, flags, kind });
        // Messages are 4-byte aligned within a datagram.
        off += len.div_ceil(4) * 4;
    }
    Ok(out)
}

/// Decodes one ctnetlink flow message; `Ok(None)` for a well-formed flow that is not UDP.
fn decode_flow(message: &[u8]) -> Result<Option<Flow>, String> {
    let msg = NetlinkMessage::<NetfilterMessage>::deserialize(message).map_err(|e| e.to_string())?;
    let attrs = match msg.payload {
        NetlinkPayload::InnerMessage(NetfilterMessage {
            inner:
                NetfilterMessageInner::Conntrack(
                    ConntrackMessage::New(attrs) | ConntrackMessage::Get(attrs) | ConntrackMessage::Delete(attrs),
                ),
            ..
        }) => attrs,
        _ => return Ok(None),
    };
    let (mut orig, mut reply) = (None, None);
    for attr in &attrs {
        match attr {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(TupleParts::of(t)),
            ConntrackAttribute::CtaTupleReply(t) => reply = Some(TupleParts::of(t)),
            _ => {}
        }
    }
    let (orig, reply) = match (orig, reply) {
        (Some(o), Some(r)) => (o, r),
        _ => return Err("flow without both CTA_TUPLE_ORIG and CTA_TUPLE_REPLY".to_string()),
    };
    if orig.proto != Some(IPPROTO_UDP) {
        return Ok(None);
    }
    let missing = |what: &str| format!("UDP flow without {what}");
    Ok(Some(Flow {
        orig_src: orig.src.ok_or_else(|| missing("original source"))?,
        orig_dst: orig.dst.ok_or_else(|| missing("original destination"))?,
        orig_sport: orig.sport.ok_or_else(|| missing("original source port"))?,
        orig_dport: orig.dport.ok_or_else(|| missing("original destination port"))?,
        reply_src: reply.src.ok_or_else(|| missing("reply source"))?,
        reply_dst: reply.dst.ok_or_else(|| missing("reply destination"))?,
        reply_sport: reply.sport.ok_or_else(|| missing("reply source port"))?,
        reply_dport: reply.dport.ok_or_else(|| missing("reply destination port"))?,
    }))
}

#[derive(Default)]
struct TupleParts {
    src: Option<IpAddr>,
    dst: Option<IpAddr>,
    proto: Option<u8>,
    sport: Option<u16>,
    dport: Option<u16>,
}

impl TupleParts {
    fn of(tuple: &[Tuple]) -> TupleParts {
        let mut parts = TupleParts::default();
        for t in tuple {
            match t {
                Tuple::Ip(ips) => {
                    for ip in ips {
                        match ip {
                            IPTuple::SourceAddress(a) => parts.src = Some(*a),
                            IPTuple::DestinationAddress(a) => parts.dst = Some(*a),
                            _ => {}
                        }
                    }
                }
                Tuple::Proto(protos) => {
                    for p in protos {
                        match p {
                            ProtoTuple::Protocol(n) => parts.proto = Some(u8::from(*n)),
                            ProtoTuple::SourcePort(port) => parts.sport = Some(*port),
                            ProtoTuple::DestinationPort(port) => parts.dport = Some(*port),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        parts
    }
}

fn kernel_error(what: &str, code: i32) -> Error {
    Error::Kernel {
        what: what.to_string(),
        source: io::Error::from_raw_os_error(code.saturating_neg()),
    }
}

/// The kernel's conntrack table over a `NETLINK_NETFILTER` socket (ctnetlink), in the network
/// namespace of the thread that created it.
pub struct Netlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl fmt::Debug for Netlink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Netlink")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl Netlink {
    /// Opens and connects a ctnetlink socket (needs `CAP_NET_ADMIN` to list or delete).
    pub fn new() -> Result<Netlink, Error> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(Error::Socket)?;
        socket.bind_auto().map_err(Error::Socket)?;
        socket.connect(&NlSocketAddr::new(0, 0)).map_err(Error::Socket)?;
        Ok(Netlink {
            socket,
            seq: 0,
            buf: vec![0; RECV_BUFFER],
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send(&self, bytes: &[u8], what: &str) -> Result<(), Error> {
        let send_error = |source| Error::Send {
            what: what.to_string(),
            source,
        };
        loop {
            match self.socket.send(bytes, 0) {
                Ok(n) if n == bytes.len() => return Ok(()),
                Ok(n) => {
                    return Err(send_error(io::Error::other(format!(
                        "short send: {n} of {} bytes",
                        bytes.len()
                    ))));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(send_error(e)),
            }
        }
    }

    /// Receives one datagram and splits it into messages.
    fn recv(&mut self, what: &str) -> Result<Vec<Reply>, Error> {
        let n = loop {
            match self.socket.recv(&mut &mut self.buf[..], 0) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(Error::Recv {
                        what: what.to_string(),
                        source,
                    });
                }
            }
        };
        let data = self.buf.get(..n).ok_or_else(|| Error::Decode {
            what: what.to_string(),
            detail: format!("datagram of {n} bytes truncated to {}", self.buf.len()),
        })?;
        parse_replies(data).map_err(|detail| Error::Decode {
            what: what.to_string(),
            detail,
        })
    }

    /// Sends one batch of delete requests and collects their acknowledgements.
    fn delete_batch(&mut self, batch: &[Flow], tally: &mut DeleteTally) {
        let mut bytes = Vec::new();
        let mut pending: HashMap<u32, &Flow> = HashMap::new();
        for flow in batch {
            let seq = self.next_seq();
            match delete_request(flow, seq) {
                Ok(req) => {
                    bytes.extend_from_slice(&req);
                    pending.insert(seq, flow);
                }
                Err(e) => tally.fail(e),
            }
        }
        if pending.is_empty() {
            return;
        }
        let what = format!("the deletion of {} conntrack flows", pending.len());
        if let Err(e) = self.send(&bytes, &what) {
            tally.failed += pending.len() - 1;
            tally.fail(e);
            return;
        }
        while !pending.is_empty() {
            let replies = match self.recv(&what) {
                Ok(r) => r,
                Err(e) => {
                    tally.failed += pending.len() - 1;
                    tally.fail(e);
                    return;
                }
            };
            for reply in replies {
                let Some(flow) = pending.remove(&reply.seq) else {
                    continue;
                };
                match reply.kind {
                    ReplyKind::Ack => tally.deleted += 1,
                    // Gone already (timed out, or deleted by someone else): nothing to do.
                    ReplyKind::Nack(code) if code == -(Errno::ENOENT as i32) => {
                        debug!(%flow, "Conntrack entry already gone");
                    }
                    ReplyKind::Nack(code) => tally.fail(kernel_error(&format!("deleting {flow}"), code)),
                    // Only an ack answers a delete; anything else with its sequence number is
                    // not an answer, so keep waiting for it.
                    _ => {
                        pending.insert(reply.seq, flow);
                    }
                }
            }
        }
    }
}

#[derive(Default)]
struct DeleteTally {
    deleted: usize,
    failed: usize,
    first: Option<Error>,
}

impl DeleteTally {
    fn fail(&mut self, e: Error) {
        warn!(error = %e, "Failed to delete a stale conntrack entry");
        self.failed += 1;
        self.first.get_or_insert(e);
    }
}

/// What one dump returned.
#[derive(Debug, Default)]
struct Dump {
    /// UDP flows of the asked family.
    udp: Vec<Flow>,
    /// Well-formed entries of other protocols.
    other: usize,
    /// Why each entry that did not decode was skipped.
    undecodable: Vec<String>,
    /// The kernel flagged the dump as inconsistent (the table changed while it was walked).
    interrupted: bool,
}

impl Netlink {
    fn dump(&mut self, family: IpFamily) -> Result<Dump, Error> {
        let seq = self.next_seq();
        let what = format!("the {family} conntrack dump");
        self.send(&dump_request(family, seq), &what)?;
        let mut dump = Dump::default();
        loop {
            for reply in self.recv(&what)? {
                // Leftovers of an earlier exchange that ended early carry another sequence number.
                if reply.seq != seq {
                    continue;
                }
                dump.interrupted |= reply.flags & NLM_F_DUMP_INTR != 0;
                match reply.kind {
                    ReplyKind::Done => return Ok(dump),
                    ReplyKind::Nack(code) => return Err(kernel_error(&what, code)),
                    ReplyKind::Flow(Ok(Some(flow))) if flow.family() == family => dump.udp.push(flow),
                    ReplyKind::Flow(Ok(_)) => dump.other += 1,
                    ReplyKind::Flow(Err(detail)) => dump.undecodable.push(detail),
                    ReplyKind::Ack | ReplyKind::Other => {}
                }
            }
        }
    }
}

impl ConntrackTable for Netlink {
    fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, Error> {
        let dump = self.dump(family)?;
        if dump.interrupted {
            warn!(ip_family = %family, "Conntrack dump was interrupted; continuing with a partial result");
        }
        if let Some(first) = dump.undecodable.first() {
            warn!(
                ip_family = %family,
                skipped = dump.undecodable.len(),
                first = %first,
                "Skipped conntrack entries that did not decode"
            );
        }
        debug!(ip_family = %family, udp = dump.udp.len(), other = dump.other, "Listed conntrack entries");
        Ok(dump.udp)
    }

    fn delete(&mut self, flows: &[Flow]) -> Result<usize, Error> {
        let mut tally = DeleteTally::default();
        for batch in flows.chunks(DELETE_BATCH) {
            self.delete_batch(batch, &mut tally);
        }
        match tally.first {
            None => Ok(tally.deleted),
            Some(first) => Err(Error::Delete {
                attempted: flows.len(),
                deleted: tally.deleted,
                failed: tally.failed,
                first: Box::new(first),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sysctls
// ---------------------------------------------------------------------------------------------

/// Where the conntrack module's `hashsize` parameter lives (not under /proc/sys).
pub const HASHSIZE_PATH: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// Upstream caps the scaled `nf_conntrack_max` at 1Mi entries (`getConntrackMax`).
const CONNTRACK_MAX_LIMIT: u64 = 1_048_576;

/// The `--conntrack-*` settings (`KubeProxyConntrackConfiguration`). A zero duration or zero
/// `max_per_core` means "leave the kernel's value alone".
#[derive(Clone, Debug, PartialEq)]
pub struct ConntrackConfig {
    /// `--conntrack-max-per-core`.
    pub max_per_core: u32,
    /// `--conntrack-min`.
    pub min: u32,
    /// `--conntrack-tcp-timeout-established`.
    pub tcp_established_timeout: Duration,
    /// `--conntrack-tcp-timeout-close-wait`.
    pub tcp_close_wait_timeout: Duration,
    /// `--conntrack-tcp-be-liberal`.
    pub tcp_be_liberal: bool,
    /// `--conntrack-udp-timeout`.
    pub udp_timeout: Duration,
    /// `--conntrack-udp-timeout-stream`.
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackConfig {
    /// Upstream's defaults.
    fn default() -> Self {
        ConntrackConfig {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// The `nf_conntrack_max` to ask for, as upstream's `getConntrackMax`: 0 (leave it) when
/// `max_per_core` is 0; otherwise `max_per_core × cpus`, capped at 1Mi, and raised to `min` when
/// below it (the cap wins over `min`, as upstream checks it first).
pub fn conntrack_max(cfg: &ConntrackConfig, num_cpus: usize) -> u64 {
    if cfg.max_per_core == 0 {
        return 0;
    }
    let scaled = u64::from(cfg.max_per_core).saturating_mul(num_cpus as u64);
    if scaled > CONNTRACK_MAX_LIMIT {
        CONNTRACK_MAX_LIMIT
    } else if scaled > u64::from(cfg.min) {
        scaled
    } else {
        u64::from(cfg.min)
    }
}

/// The node's online CPU count, as upstream sizes `nf_conntrack_max` by (the node's count from
/// `/sys/devices/system/cpu/online`, not this process's CPU affinity), falling back to the
/// available parallelism.
pub fn detect_num_cpus() -> usize {
    fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpu_list(&s))
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
}

/// Counts a kernel CPU list such as `0-3,8,10-11`.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                b.checked_sub(a)? + 1
            }
            None => part.parse::<usize>().map(|_| 1).ok()?,
        };
    }
    Some(n)
}

/// Writes the conntrack sysctls under `proc_sys` (normally `/proc/sys`), in upstream's order;
/// returns one warning per setting that could not be applied. Does not touch `hashsize`; see
/// [`apply_sysctls_and_hashsize`].
pub fn apply_sysctls(cfg: &ConntrackConfig, proc_sys: &Path, num_cpus: usize) -> Vec<String> {
    apply_sysctls_and_hashsize(cfg, proc_sys, None, num_cpus)
}

/// [`apply_sysctls`], plus upstream's `hashsize` adjustment when `hashsize_file` is given
/// (normally [`HASHSIZE_PATH`]): when a `nf_conntrack_max` is configured and the hash table has
/// fewer than `max / 4` buckets, it is grown to `max / 4`.
///
/// As upstream's `setSysctls`: `nf_conntrack_max` is only ever raised (written when the current
/// value is lower or unreadable); each other sysctl is written only when configured (non-zero,
/// or `tcp_be_liberal` true) and different from its current value. Unlike upstream, a failure is
/// a warning and the remaining settings are still applied: in a network namespace
/// `nf_conntrack_max` is read-only and `hashsize` refuses writes, and neither should stop the proxy.
pub fn apply_sysctls_and_hashsize(
    cfg: &ConntrackConfig,
    proc_sys: &Path,
    hashsize_file: Option<&Path>,
    num_cpus: usize,
) -> Vec<String> {
    let mut warnings = Vec::new();
    let mut warn_on = |result: Result<(), String>| {
        if let Err(w) = result {
            warn!(warning = %w, "Could not apply a conntrack setting");
            warnings.push(w);
        }
    };
    let set = |name: &str, value: u64| set_sysctl(proc_sys, name, value);

    let max = conntrack_max(cfg, num_cpus);
    if max > 0 {
        match read_u64(&proc_sys.join(NETFILTER).join("nf_conntrack_max")) {
            Ok(current) if current >= max => {
                debug!(current, wanted = max, "nf_conntrack_max already large enough");
            }
            _ => {
                info!(nf_conntrack_max = max, "Setting nf_conntrack_max");
                warn_on(set("nf_conntrack_max", max));
            }
        }
        if let Some(path) = hashsize_file {
            warn_on(grow_hashsize(path, max / 4));
        }
    }

    let seconds = |d: Duration| (!d.is_zero()).then_some(d.as_secs());
    if let Some(s) = seconds(cfg.tcp_established_timeout) {
        warn_on(set("nf_conntrack_tcp_timeout_established", s));
    }
    if let Some(s) = seconds(cfg.tcp_close_wait_timeout) {
        warn_on(set("nf_conntrack_tcp_timeout_close_wait", s));
    }
    if cfg.tcp_be_liberal {
        warn_on(set("nf_conntrack_tcp_be_liberal", 1));
    }
    if let Some(s) = seconds(cfg.udp_timeout) {
        warn_on(set("nf_conntrack_udp_timeout", s));
    }
    if let Some(s) = seconds(cfg.udp_stream_timeout) {
        warn_on(set("nf_conntrack_udp_timeout_stream", s));
    }
    warnings
}

const NETFILTER: &str = "net/netfilter";

fn read_u64(path: &Path) -> Result<u64, String> {
    let text = fs::read_to_string(path).map_err(|e| e.to_string())?;
    text.trim()
        .parse::<u64>()
        .map_err(|e| format!("{:?} is not a number: {e}", text.trim()))
}

/// Writes `value` to an existing file (never creates one: a missing sysctl is a warning).
fn write_u64(path: &Path, value: u64) -> io::Result<()> {
    let mut file = fs::OpenOptions::new().write(true).truncate(true).open(path)?;
    file.write_all(value.to_string().as_bytes())
}

/// Upstream's `setIntSysCtl`: write only when the current value differs (or cannot be read).
fn set_sysctl(proc_sys: &Path, name: &str, value: u64) -> Result<(), String> {
    let entry = format!("{NETFILTER}/{name}");
    let path = proc_sys.join(&entry);
    if read_u64(&path) == Ok(value) {
        return Ok(());
    }
    info!(entry, value, "Set sysctl");
    write_u64(&path, value).map_err(|e| format!("could not set sysctl {entry} to {value} ({}): {e}", path.display()))
}

fn grow_hashsize(path: &Path, wanted: u64) -> Result<(), String> {
    let current = read_u64(path).map_err(|e| format!("could not read conntrack hashsize ({}): {e}", path.display()))?;
    if current >= wanted {
        return Ok(());
    }
    info!(conntrack_hashsize = wanted, "Setting conntrack hashsize");
    write_u64(path, wanted)
        .map_err(|e| format!("could not set conntrack hashsize to {wanted} ({}): {e}", path.display()))
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Endpoint, NodeInfo, ServicePort, ServicePortName, ServicePortState};
    use std::net::UdpSocket;
    use std::path::PathBuf;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("test socket address")
    }

    fn set(addrs: &[&str]) -> HashSet<SocketAddr> {
        addrs.iter().map(|a| sa(a)).collect()
    }

    /// A flow from a fixed client to `dst:dport`, answered by `reply_src:reply_sport`.
    fn flow(dst: &str, dport: u16, reply_src: &str, reply_sport: u16) -> Flow {
        let client = if ip(dst).is_ipv4() {
            ip("10.0.0.1")
        } else {
            ip("fd00::1")
        };
        Flow {
            orig_src: client,
            orig_dst: ip(dst),
            orig_sport: 40000,
            orig_dport: dport,
            reply_src: ip(reply_src),
            reply_dst: client,
            reply_sport,
            reply_dport: 40000,
        }
    }

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

    // -----------------------------------------------------------------------------------------
    // ctnetlink messages: byte fixtures
    // -----------------------------------------------------------------------------------------

    #[test]
    fn dump_request_bytes() {
        #[rustfmt::skip]
        let v4: &[u8] = &[
            0x14, 0x00, 0x00, 0x00, // nlmsg_len 20
            0x01, 0x01,             // nlmsg_type: NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET
            0x01, 0x03,             // flags: NLM_F_REQUEST | NLM_F_DUMP (ROOT|MATCH)
            0x2a, 0x00, 0x00, 0x00, // seq 42
            0x00, 0x00, 0x00, 0x00, // port id: the kernel fills it in
            0x02,                   // nfgenmsg.nfgen_family: AF_INET (NFPROTO_IPV4)
            0x00,                   // version NFNETLINK_V0
            0x00, 0x00,             // res_id
        ];
        assert_eq!(dump_request(IpFamily::V4, 42), v4);
        let mut v6 = v4.to_vec();
        v6[16] = 0x0a; // AF_INET6
        assert_eq!(dump_request(IpFamily::V6, 42), v6);
    }

    /// `IPCTNL_MSG_CT_DELETE` for 10.0.0.1:40000 -> 10.96.0.10:53, as sent (the kernel accepted
    /// exactly this layout in the network-namespace test, see `kernel_netns_*`).
    #[rustfmt::skip]
    const DELETE_V4: &[u8] = &[
        0x48, 0x00, 0x00, 0x00, // nlmsg_len 72
        0x02, 0x01,             // CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE
        0x05, 0x00,             // NLM_F_REQUEST | NLM_F_ACK
        0x07, 0x00, 0x00, 0x00, // seq 7
        0x00, 0x00, 0x00, 0x00, // port id
        0x02, 0x00, 0x00, 0x00, // nfgenmsg: AF_INET, v0, res_id 0
        0x34, 0x00, 0x01, 0x80, //   CTA_TUPLE_ORIG | NLA_F_NESTED, len 52
        0x14, 0x00, 0x01, 0x80, //     CTA_TUPLE_IP | NLA_F_NESTED, len 20
        0x08, 0x00, 0x01, 0x00, 10, 0, 0, 1,   // CTA_IP_V4_SRC 10.0.0.1
        0x08, 0x00, 0x02, 0x00, 10, 96, 0, 10, // CTA_IP_V4_DST 10.96.0.10
        0x1c, 0x00, 0x02, 0x80, //     CTA_TUPLE_PROTO | NLA_F_NESTED, len 28
        0x05, 0x00, 0x01, 0x00, 0x11, 0x00, 0x00, 0x00, // CTA_PROTO_NUM 17 (UDP) + 3 pad
        0x06, 0x00, 0x02, 0x00, 0x9c, 0x40, 0x00, 0x00, // CTA_PROTO_SRC_PORT 40000 (BE) + pad
        0x06, 0x00, 0x03, 0x00, 0x00, 0x35, 0x00, 0x00, // CTA_PROTO_DST_PORT 53 (BE) + pad
    ];

    #[test]
    fn delete_request_bytes_v4() {
        let f = flow("10.96.0.10", 53, "10.244.1.5", 5353);
        assert_eq!(delete_request(&f, 7).expect("same family"), DELETE_V4);
    }

    #[test]
    fn delete_request_bytes_v6() {
        let f = flow("fd00::a", 53, "fd00::b", 5353);
        let bytes = delete_request(&f, 7).expect("same family");
        #[rustfmt::skip]
        let head: &[u8] = &[
            0x60, 0x00, 0x00, 0x00, 0x02, 0x01, 0x05, 0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x0a, 0x00, 0x00, 0x00, // nfgenmsg: AF_INET6
            0x4c, 0x00, 0x01, 0x80, //   CTA_TUPLE_ORIG, len 76
            0x2c, 0x00, 0x01, 0x80, //     CTA_TUPLE_IP, len 44
            0x14, 0x00, 0x03, 0x00, //       CTA_IP_V6_SRC, len 20
        ];
        assert_eq!(&bytes[..head.len()], head);
        assert_eq!(bytes.len(), 96);
        assert_eq!(
            &bytes[32..48],
            &ip("fd00::1")
                .to_canonical()
                .to_string()
                .parse::<std::net::Ipv6Addr>()
                .expect("v6")
                .octets()
        );
        assert_eq!(&bytes[48..52], &[0x14, 0x00, 0x04, 0x00]); // CTA_IP_V6_DST
        assert_eq!(
            &bytes[52..68],
            &"fd00::a".parse::<std::net::Ipv6Addr>().expect("v6").octets()
        );
        assert_eq!(&bytes[68..], &DELETE_V4[44..]); // the same CTA_TUPLE_PROTO
    }

    #[test]
    fn delete_request_round_trips_through_the_parser() {
        let f = flow("10.96.0.10", 53, "10.244.1.5", 5353);
        let msg = NetlinkMessage::<NetfilterMessage>::deserialize(DELETE_V4).expect("our own bytes parse");
        assert_eq!(msg.header.sequence_number, 7);
        let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::Delete(attrs)),
            ..
        }) = msg.payload
        else {
            panic!("not a conntrack delete: {:?}", msg.payload);
        };
        let [ConntrackAttribute::CtaTupleOrig(tuple)] = attrs.as_slice() else {
            panic!("attributes: {attrs:?}")
        };
        let parts = TupleParts::of(tuple);
        assert_eq!(
            (parts.src, parts.dst, parts.proto, parts.sport, parts.dport),
            (Some(f.orig_src), Some(f.orig_dst), Some(17), Some(40000), Some(53))
        );
        // A delete request carries no reply tuple, so it is no flow.
        assert!(decode_flow(DELETE_V4).is_err());
    }

    #[test]
    fn delete_request_rejects_mixed_families() {
        let mut f = flow("10.96.0.10", 53, "10.244.1.5", 5353);
        f.orig_src = ip("fd00::1");
        assert!(matches!(delete_request(&f, 1), Err(Error::MixedFamilies { .. })));
    }

    /// One message of a real IPv4 dump (captured from the kernel in a network namespace): a UDP
    /// flow 127.0.0.1:57757 -> 127.0.0.1:36175, not answered yet.
    #[rustfmt::skip]
    const KERNEL_FLOW_V4: &[u8] = &[
        0xa4, 0x00, 0x00, 0x00, // nlmsg_len 164
        0x00, 0x01,             // CTNETLINK << 8 | IPCTNL_MSG_CT_NEW (dumps answer with NEW)
        0x22, 0x00,             // NLM_F_MULTI | NLM_F_DUMP_FILTERED
        0x07, 0x00, 0x00, 0x00, // seq 7
        0x8c, 0x49, 0x00, 0x00, // our port id
        0x02, 0x00, 0x00, 0x00, // nfgenmsg: AF_INET
        0x34, 0x00, 0x01, 0x80, // CTA_TUPLE_ORIG, len 52
        0x14, 0x00, 0x01, 0x80, //   CTA_TUPLE_IP, len 20
        0x08, 0x00, 0x01, 0x00, 0x7f, 0x00, 0x00, 0x01, // CTA_IP_V4_SRC 127.0.0.1
        0x08, 0x00, 0x02, 0x00, 0x7f, 0x00, 0x00, 0x01, // CTA_IP_V4_DST 127.0.0.1
        0x1c, 0x00, 0x02, 0x80, //   CTA_TUPLE_PROTO, len 28
        0x05, 0x00, 0x01, 0x00, 0x11, 0x00, 0x00, 0x00, // CTA_PROTO_NUM 17
        0x06, 0x00, 0x02, 0x00, 0xe1, 0x9d, 0x00, 0x00, // CTA_PROTO_SRC_PORT 57757
        0x06, 0x00, 0x03, 0x00, 0x8d, 0x4f, 0x00, 0x00, // CTA_PROTO_DST_PORT 36175
        0x34, 0x00, 0x02, 0x80, // CTA_TUPLE_REPLY, len 52
        0x14, 0x00, 0x01, 0x80,
        0x08, 0x00, 0x01, 0x00, 0x7f, 0x00, 0x00, 0x01,
        0x08, 0x00, 0x02, 0x00, 0x7f, 0x00, 0x00, 0x01,
        0x1c, 0x00, 0x02, 0x80,
        0x05, 0x00, 0x01, 0x00, 0x11, 0x00, 0x00, 0x00,
        0x06, 0x00, 0x02, 0x00, 0x8d, 0x4f, 0x00, 0x00, // reply source port 36175
        0x06, 0x00, 0x03, 0x00, 0xe1, 0x9d, 0x00, 0x00, // reply destination port 57757
        0x08, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x08, // CTA_STATUS IPS_CONFIRMED
        0x08, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, // CTA_MARK 0
        0x08, 0x00, 0x0c, 0x00, 0x33, 0x73, 0xdc, 0x51, // CTA_ID
        0x08, 0x00, 0x0b, 0x00, 0x00, 0x00, 0x00, 0x01, // CTA_USE 1
        0x08, 0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x1d, // CTA_TIMEOUT 29
    ];

    /// The same from a real IPv6 dump: [::1]:40508 -> [::1]:45698.
    #[rustfmt::skip]
    const KERNEL_FLOW_V6: &[u8] = &[
        0xd4, 0x00, 0x00, 0x00, 0x00, 0x01, 0x22, 0x00, 0x07, 0x00, 0x00, 0x00, 0x8c, 0x49, 0x00, 0x00,
        0x0a, 0x00, 0x00, 0x00, // nfgenmsg: AF_INET6
        0x4c, 0x00, 0x01, 0x80, // CTA_TUPLE_ORIG, len 76
        0x2c, 0x00, 0x01, 0x80, //   CTA_TUPLE_IP, len 44
        0x14, 0x00, 0x03, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, // CTA_IP_V6_SRC ::1
        0x14, 0x00, 0x04, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, // CTA_IP_V6_DST ::1
        0x1c, 0x00, 0x02, 0x80,
        0x05, 0x00, 0x01, 0x00, 0x11, 0x00, 0x00, 0x00,
        0x06, 0x00, 0x02, 0x00, 0x9e, 0x3c, 0x00, 0x00, // 40508
        0x06, 0x00, 0x03, 0x00, 0xb2, 0x82, 0x00, 0x00, // 45698
        0x4c, 0x00, 0x02, 0x80, // CTA_TUPLE_REPLY
        0x2c, 0x00, 0x01, 0x80,
        0x14, 0x00, 0x03, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
        0x14, 0x00, 0x04, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
        0x1c, 0x00, 0x02, 0x80,
        0x05, 0x00, 0x01, 0x00, 0x11, 0x00, 0x00, 0x00,
        0x06, 0x00, 0x02, 0x00, 0xb2, 0x82, 0x00, 0x00,
        0x06, 0x00, 0x03, 0x00, 0x9e, 0x3c, 0x00, 0x00,
        0x08, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x08,
        0x08, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x08, 0x00, 0x0c, 0x00, 0xde, 0x15, 0xf2, 0x78,
        0x08, 0x00, 0x0b, 0x00, 0x00, 0x00, 0x00, 0x01,
        0x08, 0x00, 0x07, 0x00, 0x00, 0x00, 0x00, 0x1d,
    ];

    /// The end of a dump, as the kernel sent it.
    #[rustfmt::skip]
    const KERNEL_DONE: &[u8] = &[
        0x14, 0x00, 0x00, 0x00, 0x03, 0x00, // NLMSG_DONE
        0x02, 0x00,                         // NLM_F_MULTI
        0x07, 0x00, 0x00, 0x00, 0xc9, 0x9d, 0xa0, 0xc5,
        0x00, 0x00, 0x00, 0x00,             // error 0
    ];

    /// The kernel's answer to a successful delete (seq 9): NLMSG_ERROR with 0 and, as
    /// NLM_F_CAPPED (0x100) says, only the request's header.
    #[rustfmt::skip]
    const KERNEL_ACK: &[u8] = &[
        0x24, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x01, 0x09, 0x00, 0x00, 0x00, 0x91, 0x4f, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, // error 0: ACK
        0x48, 0x00, 0x00, 0x00, 0x02, 0x01, 0x05, 0x00, 0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];

    /// The kernel's answer to deleting the same flow again: -ENOENT, with the whole request.
    fn kernel_enoent() -> Vec<u8> {
        let mut request = DELETE_V4.to_vec();
        request[8] = 9; // seq 9
        #[rustfmt::skip]
        let mut bytes = vec![
            0x5c, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x00, 0x91, 0x4f, 0x00, 0x00,
            0xfe, 0xff, 0xff, 0xff, // error -2 (ENOENT)
        ];
        bytes.extend_from_slice(&request);
        bytes
    }

    #[test]
    fn parse_kernel_dump_messages() {
        let replies = parse_replies(KERNEL_FLOW_V4).expect("kernel bytes");
        let expected_v4 = Flow {
            orig_src: ip("127.0.0.1"),
            orig_dst: ip("127.0.0.1"),
            orig_sport: 57757,
            orig_dport: 36175,
            reply_src: ip("127.0.0.1"),
            reply_dst: ip("127.0.0.1"),
            reply_sport: 36175,
            reply_dport: 57757,
        };
        assert_eq!(
            replies,
            vec![Reply {
                seq: 7,
                flags: 0x22,
                kind: ReplyKind::Flow(Ok(Some(expected_v4)))
            }]
        );

        let replies = parse_replies(KERNEL_FLOW_V6).expect("kernel bytes");
        let expected_v6 = Flow {
            orig_src: ip("::1"),
            orig_dst: ip("::1"),
            orig_sport: 40508,
            orig_dport: 45698,
            reply_src: ip("::1"),
            reply_dst: ip("::1"),
            reply_sport: 45698,
            reply_dport: 40508,
        };
        assert_eq!(
            replies,
            vec![Reply {
                seq: 7,
                flags: 0x22,
                kind: ReplyKind::Flow(Ok(Some(expected_v6)))
            }]
        );
    }

    #[test]
    fn parse_several_messages_in_one_datagram() {
        let mut datagram = KERNEL_FLOW_V4.to_vec();
        datagram.extend_from_slice(KERNEL_FLOW_V6);
        datagram.extend_from_slice(KERNEL_DONE);
        let kinds: Vec<_> = parse_replies(&datagram)
            .expect("kernel bytes")
            .into_iter()
            .map(|r| r.kind)
            .collect();
        assert!(matches!(
            kinds.as_slice(),
            [
                ReplyKind::Flow(Ok(Some(_))),
                ReplyKind::Flow(Ok(Some(_))),
                ReplyKind::Done
            ]
        ));
    }

    #[test]
    fn parse_done_ack_and_enoent() {
        assert_eq!(
            parse_replies(KERNEL_DONE).expect("done"),
            vec![Reply {
                seq: 7,
                flags: 2,
                kind: ReplyKind::Done
            }]
        );
        assert_eq!(
            parse_replies(KERNEL_ACK).expect("ack"),
            vec![Reply {
                seq: 9,
                flags: 0x100,
                kind: ReplyKind::Ack
            }]
        );
        assert_eq!(
            parse_replies(&kernel_enoent()).expect("nack"),
            vec![Reply {
                seq: 9,
                flags: 0,
                kind: ReplyKind::Nack(-(Errno::ENOENT as i32))
            }]
        );
        // A dump that fails midway ends with NLMSG_DONE carrying -errno.
        let mut failed_done = KERNEL_DONE.to_vec();
        failed_done[16..20].copy_from_slice(&(-(Errno::EINTR as i32)).to_ne_bytes());
        assert_eq!(
            parse_replies(&failed_done).expect("done")[0].kind,
            ReplyKind::Nack(-(Errno::EINTR as i32))
        );
        // An empty NLMSG_DONE is allowed too.
        let mut empty_done = KERNEL_DONE[..16].to_vec();
        empty_done[0] = 16;
        assert_eq!(parse_replies(&empty_done).expect("done")[0].kind, ReplyKind::Done);
    }

    #[test]
    fn parse_skips_non_udp_flows() {
        // The same flow as TCP: orig and reply CTA_PROTO_NUM become 6.
        let mut tcp = KERNEL_FLOW_V4.to_vec();
        assert_eq!((tcp[52], tcp[104]), (17, 17));
        tcp[52] = 6;
        tcp[104] = 6;
        assert_eq!(
            parse_replies(&tcp).expect("kernel bytes")[0].kind,
            ReplyKind::Flow(Ok(None))
        );
    }

    #[test]
    fn parse_reports_incomplete_flows_per_message() {
        // Drop CTA_PROTO_DST_PORT from the original tuple by renaming it to an unknown attribute.
        let mut partial = KERNEL_FLOW_V4.to_vec();
        assert_eq!(partial[66], 3);
        partial[66] = 9;
        let replies = parse_replies(&partial).expect("the datagram itself is fine");
        assert!(matches!(&replies[0].kind, ReplyKind::Flow(Err(e)) if e.contains("original destination port")));
    }

    #[test]
    fn parse_never_panics_on_truncated_or_corrupted_input() {
        let mut datagram = KERNEL_FLOW_V4.to_vec();
        datagram.extend_from_slice(KERNEL_FLOW_V6);
        datagram.extend_from_slice(KERNEL_DONE);
        datagram.extend_from_slice(&kernel_enoent());
        for len in 0..=datagram.len() {
            let _ = parse_replies(&datagram[..len]);
        }
        // Deterministic byte corruption, including every length and type field.
        let mut state = 0x2545_f491_u32;
        for i in 0..datagram.len() {
            for value in [0x00, 0xff, 0x80, 0x01, 0x04] {
                let mut bad = datagram.clone();
                bad[i] = value;
                let _ = parse_replies(&bad);
            }
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let mut bad = datagram.clone();
            bad[i] = state as u8;
            let _ = parse_replies(&bad);
        }
        assert!(parse_replies(&[0x10, 0, 0]).is_err());
    }

    // -----------------------------------------------------------------------------------------
    // Sysctls
    // -----------------------------------------------------------------------------------------

    #[test]
    fn default_config_is_upstreams() {
        let c = ConntrackConfig::default();
        assert_eq!((c.max_per_core, c.min), (32768, 131072));
        assert_eq!(c.tcp_established_timeout, Duration::from_secs(86400));
        assert_eq!(c.tcp_close_wait_timeout, Duration::from_secs(3600));
        assert!(!c.tcp_be_liberal);
        assert_eq!((c.udp_timeout, c.udp_stream_timeout), (Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn conntrack_max_matches_upstream() {
        let cfg = |max_per_core, min| ConntrackConfig {
            max_per_core,
            min,
            ..ConntrackConfig::default()
        };
        // Upstream's TestGetConntrackMax, with 4 CPUs.
        assert_eq!(conntrack_max(&cfg(0, 0), 4), 0);
        assert_eq!(conntrack_max(&cfg(67890, 1), 4), 67890 * 4);
        assert_eq!(conntrack_max(&cfg(1, 123456), 4), 123456);
        assert_eq!(conntrack_max(&cfg(0, 123456), 4), 0);
        // Defaults: 32768 × 2 CPUs is below min; × 8 is above.
        assert_eq!(conntrack_max(&ConntrackConfig::default(), 2), 131072);
        assert_eq!(conntrack_max(&ConntrackConfig::default(), 8), 262144);
        // The 1Mi cap, which wins even over a larger min (upstream checks it first).
        assert_eq!(conntrack_max(&ConntrackConfig::default(), 64), 1_048_576);
        assert_eq!(conntrack_max(&cfg(u32::MAX, 2_000_000), 1024), 1_048_576);
    }

    #[test]
    fn count_cpu_list_reads_the_kernel_format() {
        assert_eq!(count_cpu_list("0\n"), Some(1));
        assert_eq!(count_cpu_list("0-3\n"), Some(4));
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
        assert!(detect_num_cpus() >= 1);
    }

    /// A scratch directory standing in for /proc/sys, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("kp-conntrack-{tag}-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join(NETFILTER)).expect("scratch dir");
            Scratch(dir)
        }
        fn sysctl(&self, name: &str) -> PathBuf {
            self.0.join(NETFILTER).join(name)
        }
        fn put(&self, name: &str, value: &str) {
            fs::write(self.sysctl(name), value).expect("scratch file");
        }
        fn get(&self, name: &str) -> String {
            fs::read_to_string(self.sysctl(name)).expect("scratch file")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const ALL: [&str; 6] = [
        "nf_conntrack_max", "nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait",
        "nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream",
    ];

    /// Kernel-like starting values.
    fn fill(dir: &Scratch) {
        for (name, value) in ALL.iter().zip(["65536\n", "432000\n", "60\n", "0\n", "30\n", "120\n"]) {
            dir.put(name, value);
        }
    }

    #[test]
    fn apply_sysctls_writes_configured_values() {
        let dir = Scratch::new("defaults");
        fill(&dir);
        assert_eq!(
            apply_sysctls(&ConntrackConfig::default(), &dir.0, 2),
            Vec::<String>::new()
        );
        assert_eq!(dir.get("nf_conntrack_max"), "131072");
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_established"), "86400");
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_close_wait"), "3600");
        // Not configured: left as they were.
        assert_eq!(dir.get("nf_conntrack_tcp_be_liberal"), "0\n");
        assert_eq!(dir.get("nf_conntrack_udp_timeout"), "30\n");
        assert_eq!(dir.get("nf_conntrack_udp_timeout_stream"), "120\n");

        let dir = Scratch::new("all");
        fill(&dir);
        let cfg = ConntrackConfig {
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(45),
            udp_stream_timeout: Duration::from_secs(90),
            ..ConntrackConfig::default()
        };
        assert!(apply_sysctls(&cfg, &dir.0, 8).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "262144");
        assert_eq!(dir.get("nf_conntrack_tcp_be_liberal"), "1");
        assert_eq!(dir.get("nf_conntrack_udp_timeout"), "45");
        assert_eq!(dir.get("nf_conntrack_udp_timeout_stream"), "90");
    }

    #[test]
    fn apply_sysctls_leaves_equal_values_alone() {
        let dir = Scratch::new("equal");
        fill(&dir);
        // Same value, different spelling: proves no write happened.
        dir.put("nf_conntrack_tcp_timeout_established", "86400\n");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_established"), "86400\n");
    }

    #[test]
    fn apply_sysctls_never_lowers_conntrack_max() {
        let dir = Scratch::new("nolower");
        fill(&dir);
        dir.put("nf_conntrack_max", "500000\n");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "500000\n");
        // Equal is left alone too; unreadable garbage is overwritten.
        dir.put("nf_conntrack_max", "131072\n");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "131072\n");
        dir.put("nf_conntrack_max", "garbage");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "131072");
    }

    #[test]
    fn apply_sysctls_failures_are_warnings_naming_the_sysctl() {
        let dir = Scratch::new("fail");
        fill(&dir);
        // Missing: not created. A directory in place of the file: the write fails even for root.
        fs::remove_file(dir.sysctl("nf_conntrack_max")).expect("remove");
        fs::remove_file(dir.sysctl("nf_conntrack_tcp_timeout_established")).expect("remove");
        fs::create_dir(dir.sysctl("nf_conntrack_tcp_timeout_established")).expect("dir");
        let warnings = apply_sysctls(&ConntrackConfig::default(), &dir.0, 2);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("net/netfilter/nf_conntrack_max"), "{warnings:?}");
        assert!(
            warnings[1].contains("net/netfilter/nf_conntrack_tcp_timeout_established"),
            "{warnings:?}"
        );
        assert!(
            !dir.sysctl("nf_conntrack_max").exists(),
            "a missing sysctl must not be created"
        );
        // The rest was still applied.
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_close_wait"), "3600");
    }

    #[test]
    fn apply_sysctls_nothing_configured_touches_nothing() {
        let dir = Scratch::new("none");
        let cfg = ConntrackConfig {
            max_per_core: 0,
            min: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        };
        // No files at all, yet no warnings: nothing was attempted.
        assert!(apply_sysctls_and_hashsize(&cfg, &dir.0, Some(&dir.0.join("hashsize")), 2).is_empty());
    }

    #[test]
    fn apply_sysctls_sub_second_timeout_writes_zero_like_upstream() {
        // Upstream tests `Duration > 0` and then writes whole seconds.
        let dir = Scratch::new("subsec");
        fill(&dir);
        let cfg = ConntrackConfig {
            udp_timeout: Duration::from_millis(500),
            ..ConntrackConfig::default()
        };
        assert!(apply_sysctls(&cfg, &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_udp_timeout"), "0");
    }

    #[test]
    fn hashsize_grown_to_a_quarter_of_max_never_shrunk() {
        let dir = Scratch::new("hash");
        fill(&dir);
        let hashsize = dir.0.join("hashsize");
        fs::write(&hashsize, "1024\n").expect("hashsize");
        assert!(apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2).is_empty());
        assert_eq!(fs::read_to_string(&hashsize).expect("hashsize"), "32768");
        // Checked even when nf_conntrack_max was already large enough, as upstream does.
        dir.put("nf_conntrack_max", "1000000\n");
        fs::write(&hashsize, "1024\n").expect("hashsize");
        assert!(apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2).is_empty());
        assert_eq!(fs::read_to_string(&hashsize).expect("hashsize"), "32768");
        fs::write(&hashsize, "65536\n").expect("hashsize");
        assert!(apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2).is_empty());
        assert_eq!(fs::read_to_string(&hashsize).expect("hashsize"), "65536\n");
        // Unreadable: a warning naming hashsize, and the other settings still applied.
        fs::remove_file(&hashsize).expect("remove");
        dir.put("nf_conntrack_tcp_timeout_close_wait", "60\n");
        let warnings = apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("hashsize"), "{warnings:?}");
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_close_wait"), "3600");
    }

    // -----------------------------------------------------------------------------------------
    // The real kernel, in a network namespace of our own
    // -----------------------------------------------------------------------------------------

    /// Runs `f` on a fresh thread moved into a new network namespace of its own (namespaces are
    /// per thread; this one dies with the thread, and the root namespace is never touched).
    /// `None` when the process may not create one (not root).
    fn in_new_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let joined = std::thread::spawn(move || {
            match nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
                Ok(()) => {}
                Err(Errno::EPERM) => return None,
                Err(e) => panic!("unshare(CLONE_NEWNET): {e}"),
            }
            let mine = fs::read_link("/proc/thread-self/ns/net").expect("thread netns");
            let process = fs::read_link("/proc/self/ns/net").expect("process netns");
            assert_ne!(
                mine, process,
                "the test thread must have left the process's network namespace"
            );
            // Commands started from this thread inherit its namespace.
            run("ip", &["link", "set", "lo", "up"], None);
            Some(f())
        })
        .join();
        match joined {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    fn run(cmd: &str, args: &[&str], stdin: Option<&str>) -> String {
        use std::process::{Command, Stdio};
        let mut child = Command::new(cmd)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
        if let Some(input) = stdin {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(input.as_bytes())
                .expect("write stdin");
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().expect("wait");
        assert!(
            out.status.success(),
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn bind(addr: &str) -> UdpSocket {
        let s = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s
    }

    fn port(s: &UdpSocket) -> u16 {
        s.local_addr().expect("bound").port()
    }

    /// Waits for `n` datagrams: once they are delivered, their conntrack entries are confirmed.
    fn receive(s: &UdpSocket, n: usize) {
        let mut buf = [0u8; 16];
        for _ in 0..n {
            s.recv_from(&mut buf).expect("datagram delivered");
        }
    }

    fn by_sport(flows: &[Flow], sport: u16) -> Option<&Flow> {
        flows.iter().find(|f| f.orig_sport == sport)
    }

    #[test]
    fn kernel_netns_lists_and_deletes_stale_udp_flows() {
        let ran = in_new_netns(|| {
            // Endpoint sockets. `e` sits behind three kube-proxy-like DNAT rules.
            let (b, e, f) = (bind("127.0.0.1:0"), bind("127.0.0.1:0"), bind("127.0.0.1:0"));
            let ruleset = format!(
                "table ip kpct {{\n chain out {{\n  type nat hook output priority -100; policy accept;\n  \
                 ip daddr 127.0.0.10 udp dport 5300 dnat to 127.0.0.1:{e}\n  \
                 ip daddr 127.0.0.11 udp dport 5300 dnat to 127.0.0.1:{e}\n  \
                 ip daddr 127.0.0.12 udp dport 30053 dnat to 127.0.0.1:{e}\n }}\n}}\n\
                 table ip6 kpct6 {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n  \
                 ct state new accept\n }}\n}}\n",
                e = port(&e)
            );
            // NAT (and the ip6 ct rule) make the kernel track this namespace's traffic.
            run("nft", &["-f", "-"], Some(&ruleset));

            let clients: Vec<UdpSocket> = (0..5).map(|_| bind("127.0.0.1:0")).collect();
            let targets = [
                format!("127.0.0.1:{}", port(&b)),
                "127.0.0.10:5300".into(),
                "127.0.0.11:5300".into(),
                format!("127.0.0.1:{}", port(&f)),
                "127.0.0.12:30053".into(),
            ];
            for (c, t) in clients.iter().zip(&targets) {
                c.send_to(b"ping", t.as_str()).expect("send");
            }
            receive(&b, 1);
            receive(&e, 3);
            receive(&f, 1);
            let sport: Vec<u16> = clients.iter().map(port).collect();

            let v6 = UdpSocket::bind("[::1]:0").ok().map(|server| {
                let client = bind("[::1]:0");
                client
                    .send_to(b"ping", server.local_addr().expect("bound"))
                    .expect("send v6");
                server.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
                receive(&server, 1);
                (client, server)
            });

            // A TCP connection too: its entry (with protocol info) must decode and be left out.
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            let _tcp = std::net::TcpStream::connect(listener.local_addr().expect("bound")).expect("connect");
            let _accepted = listener.accept().expect("accept");

            let mut nl = Netlink::new().expect("ctnetlink socket");
            let raw = nl.dump(IpFamily::V4).expect("v4 dump");
            assert!(raw.undecodable.is_empty(), "{:?}", raw.undecodable);
            assert!(raw.other >= 1, "the TCP entry is counted as another protocol: {raw:?}");
            assert_eq!(raw.udp.len(), 5, "{raw:?}");
            let v4_flows = nl.list_udp(IpFamily::V4).expect("v4 dump");
            assert!(v4_flows.iter().all(|fl| fl.orig_dst.is_ipv4()), "{v4_flows:?}");
            // The plain flow, exactly as conntrack records it.
            assert_eq!(
                by_sport(&v4_flows, sport[0]),
                Some(&Flow {
                    orig_src: ip("127.0.0.1"),
                    orig_dst: ip("127.0.0.1"),
                    orig_sport: sport[0],
                    orig_dport: port(&b),
                    reply_src: ip("127.0.0.1"),
                    reply_dst: ip("127.0.0.1"),
                    reply_sport: port(&b),
                    reply_dport: sport[0],
                })
            );
            // A DNATed flow: the reply comes from the endpoint, not the service IP.
            let dnat = by_sport(&v4_flows, sport[1]).expect("DNAT flow listed");
            assert_eq!((dnat.orig_dst, dnat.orig_dport), (ip("127.0.0.10"), 5300));
            assert_eq!(dnat.reply_source(), SocketAddr::new(ip("127.0.0.1"), port(&e)));
            for s in &sport {
                assert!(
                    by_sport(&v4_flows, *s).is_some(),
                    "flow from port {s} listed: {v4_flows:?}"
                );
            }

            let mut services = UdpServices::default();
            // 0: the endpoint moved to another IP -> stale.
            services.add_service_port(
                [ip("127.0.0.1")],
                port(&b),
                0,
                set(&[&format!("127.0.0.9:{}", port(&b))]),
            );
            // 1: DNATed to a serving endpoint -> kept.
            services.add_service_port([ip("127.0.0.10")], 5300, 0, set(&[&format!("127.0.0.1:{}", port(&e))]));
            // 2: same endpoint IP, new port -> stale.
            services.add_service_port([ip("127.0.0.11")], 5300, 0, set(&["127.0.0.1:9"]));
            // 3: not a service -> kept.  4: NodePort whose endpoint moved -> stale.
            services.add_service_port([ip("127.0.0.99")], 1, 30053, set(&[&format!("127.0.0.9:{}", port(&e))]));

            assert_eq!(
                clean_stale_entries(&mut nl, IpFamily::V4, &services).expect("cleanup"),
                3
            );
            let after = nl.list_udp(IpFamily::V4).expect("v4 dump");
            for (i, s) in sport.iter().enumerate() {
                let kept = i == 1 || i == 3;
                assert_eq!(
                    by_sport(&after, *s).is_some(),
                    kept,
                    "flow {i} (port {s}) after cleanup: {after:?}"
                );
            }
            // Independent check with conntrack-tools.
            let listed = run("conntrack", &["-L", "-p", "udp", "-f", "ipv4"], None);
            for (i, s) in sport.iter().enumerate() {
                let kept = i == 1 || i == 3;
                assert_eq!(
                    listed.contains(&format!("sport={s} ")),
                    kept,
                    "conntrack -L, flow {i}:\n{listed}"
                );
            }
            // Nothing left to clean; deleting a flow that is gone is not an error.
            assert_eq!(
                clean_stale_entries(&mut nl, IpFamily::V4, &services).expect("cleanup"),
                0
            );
            let gone = by_sport(&v4_flows, sport[0]).expect("listed before").clone();
            assert_eq!(nl.delete(&[gone]).expect("ENOENT is fine"), 0);

            // IPv6: listed only under its own family, and cleaned the same way.
            if let Some((client, server)) = v6 {
                let (c, s) = (port(&client), port(&server));
                assert!(by_sport(&v4_flows, c).is_none());
                let v6_flows = nl.list_udp(IpFamily::V6).expect("v6 dump");
                assert!(v6_flows.iter().all(|fl| fl.orig_dst.is_ipv6()), "{v6_flows:?}");
                let listed = by_sport(&v6_flows, c).expect("v6 flow listed");
                assert_eq!(
                    (listed.orig_dst, listed.orig_dport, listed.reply_sport),
                    (ip("::1"), s, s)
                );
                let mut services = UdpServices::default();
                services.add_service_port([ip("::1")], s, 0, set(&[&format!("[::2]:{s}")]));
                assert_eq!(
                    clean_stale_entries(&mut nl, IpFamily::V6, &services).expect("v6 cleanup"),
                    1
                );
                assert!(by_sport(&nl.list_udp(IpFamily::V6).expect("v6 dump"), c).is_none());
                let listed = run("conntrack", &["-L", "-p", "udp", "-f", "ipv6"], None);
                assert!(!listed.contains(&format!("sport={c} ")), "{listed}");
            } else {
                eprintln!("IPv6 unavailable in the test namespace; skipped the IPv6 part");
            }
        });
        if ran.is_none() {
            eprintln!("not allowed to create a network namespace (needs root); kernel test skipped");
        }
    }

    #[test]
    fn kernel_netns_conntrack_max_is_a_warning_other_sysctls_apply() {
        let ran = in_new_netns(|| {
            let proc_sys = Path::new("/proc/sys");
            let max_file = proc_sys.join(NETFILTER).join("nf_conntrack_max");
            let Ok(meta) = fs::metadata(&max_file) else {
                eprintln!("nf_conntrack not loaded; sysctl kernel test skipped");
                return;
            };
            // Only a non-initial namespace shows nf_conntrack_max read-only; refuse to write
            // anything if this might be the host's.
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                meta.permissions().mode() & 0o222,
                0,
                "nf_conntrack_max is writable: not in a child netns?"
            );
            let current = read_u64(&max_file).expect("readable");
            let cfg = ConntrackConfig {
                max_per_core: u32::MAX, // capped at 1Mi, above the kernel's value
                min: 0,
                tcp_established_timeout: Duration::ZERO,
                tcp_close_wait_timeout: Duration::ZERO,
                tcp_be_liberal: false,
                udp_timeout: Duration::from_secs(37),
                udp_stream_timeout: Duration::ZERO,
            };
            if current >= conntrack_max(&cfg, 2) {
                eprintln!("nf_conntrack_max is already {current}; sysctl kernel test skipped");
                return;
            }
            let warnings = apply_sysctls(&cfg, proc_sys, 2);
            assert_eq!(warnings.len(), 1, "{warnings:?}");
            assert!(warnings[0].contains("net/netfilter/nf_conntrack_max"), "{warnings:?}");
            assert_eq!(read_u64(&max_file), Ok(current));
            // Per-namespace and writable: applied (in this namespace only).
            assert_eq!(
                read_u64(&proc_sys.join(NETFILTER).join("nf_conntrack_udp_timeout")),
                Ok(37)
            );
        });
        if ran.is_none() {
            eprintln!("not allowed to create a network namespace (needs root); kernel test skipped");
        }
    }
}
