//! The kernel's conntrack table over ctnetlink ([`Netlink`]): one dump request lists a
//! family's flows, delete requests (acknowledged one by one, sent in batches) remove the stale
//! ones. Messages are built and read with the `netlink-packet-netfilter` crate, datagrams
//! split and sent with [`crate::netlink`]; this module runs the exchange and reduces flow
//! messages to [`Flow`]s.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Protocol as CtProtocol, Tuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use nix::errno::Errno;
use tracing::{debug, warn};

use super::cleanup::{ConntrackTable, Error, Flow};
use super::stats::{self, Statistics, TableUsage, Tracked};
use crate::model::IpFamily;
use crate::netlink::{self, NLMSG_DONE, NLMSG_ERROR};

/// ctnetlink is nfnetlink subsystem 1; its message types are `subsys << 8 | IPCTNL_MSG_CT_*`.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_SCTP: u8 = 132;
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
    /// A ctnetlink flow message: an entry with ports (TCP, UDP, SCTP), another protocol, or
    /// one we could not decode.
    Flow(Result<Option<Tracked>, String>),
    /// One CPU's statistics (`IPCTNL_MSG_CT_GET_STATS_CPU`) or the table's usage
    /// (`IPCTNL_MSG_CT_GET_STATS`), their attributes as sent.
    Stats(u8, Vec<u8>),
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
    for m in netlink::messages(buf) {
        let m = m.map_err(|e| e.to_string())?;
        let kind = match m.msg_type {
            NLMSG_ERROR | NLMSG_DONE => match netlink::read_i32(m.payload, 0) {
                Some(0) if m.msg_type == NLMSG_DONE => ReplyKind::Done,
                Some(0) => ReplyKind::Ack,
                Some(code) => ReplyKind::Nack(code),
                // The kernel may send an empty NLMSG_DONE.
                None if m.msg_type == NLMSG_DONE => ReplyKind::Done,
                None => return Err("NLMSG_ERROR without an error code".to_string()),
            },
            t if t >> 8 == NFNL_SUBSYS_CTNETLINK && stats::is_stats(t as u8) => {
                ReplyKind::Stats(t as u8, m.payload.get(4..).unwrap_or_default().to_vec())
            }
            t if t >> 8 == NFNL_SUBSYS_CTNETLINK => ReplyKind::Flow(decode_entry(m.bytes)),
            _ => ReplyKind::Other,
        };
        out.push(Reply {
            seq: m.seq,
            flags: m.flags,
            kind,
        });
    }
    Ok(out)
}

/// Decodes one ctnetlink flow message; `Ok(None)` for a well-formed entry without ports
/// (ICMP, GRE, ...).
fn decode_entry(message: &[u8]) -> Result<Option<Tracked>, String> {
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
    let (mut orig, mut reply, mut tcp_state) = (None, None, None);
    for attr in &attrs {
        match attr {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(TupleParts::of(t)),
            ConntrackAttribute::CtaTupleReply(t) => reply = Some(TupleParts::of(t)),
            ConntrackAttribute::CtaProtoInfo(info) => {
                for i in info {
                    if let ProtoInfo::TCP(tcp) = i {
                        for t in tcp {
                            if let ProtoInfoTCP::State(state) = t {
                                tcp_state = Some(*state);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let (orig, reply) = match (orig, reply) {
        (Some(o), Some(r)) => (o, r),
        _ => return Err("flow without both CTA_TUPLE_ORIG and CTA_TUPLE_REPLY".to_string()),
    };
    let Some(protocol) = orig.proto else {
        return Err("flow without a protocol".to_string());
    };
    if !matches!(protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
        return Ok(None);
    }
    let name = match protocol {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        _ => "SCTP",
    };
    let missing = |what: &str| format!("{name} flow without {what}");
    Ok(Some(Tracked {
        protocol,
        flow: Flow {
            orig_src: orig.src.ok_or_else(|| missing("original source"))?,
            orig_dst: orig.dst.ok_or_else(|| missing("original destination"))?,
            orig_sport: orig.sport.ok_or_else(|| missing("original source port"))?,
            orig_dport: orig.dport.ok_or_else(|| missing("original destination port"))?,
            reply_src: reply.src.ok_or_else(|| missing("reply source"))?,
            reply_dst: reply.dst.ok_or_else(|| missing("reply destination"))?,
            reply_sport: reply.sport.ok_or_else(|| missing("reply source port"))?,
            reply_dport: reply.dport.ok_or_else(|| missing("reply destination port"))?,
        },
        tcp_state,
    }))
}

/// Decodes one ctnetlink flow message; `Ok(None)` for a well-formed flow that is not UDP.
#[cfg(test)]
fn decode_flow(message: &[u8]) -> Result<Option<Flow>, String> {
    Ok(decode_entry(message)?
        .filter(|t| t.protocol == IPPROTO_UDP)
        .map(|t| t.flow))
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
#[derive(Debug)]
pub struct Netlink {
    channel: netlink::Channel,
}

impl Netlink {
    /// Opens and connects a ctnetlink socket (needs `CAP_NET_ADMIN` to list or delete).
    pub fn new() -> Result<Netlink, Error> {
        let channel = netlink::Channel::netfilter(RECV_BUFFER).map_err(Error::Socket)?;
        Ok(Netlink { channel })
    }

    fn next_seq(&mut self) -> u32 {
        self.channel.next_seq()
    }

    fn send(&self, bytes: &[u8], what: &str) -> Result<(), Error> {
        self.channel.send(bytes).map_err(|source| Error::Send {
            what: what.to_string(),
            source,
        })
    }

    /// Receives one datagram and splits it into messages.
    fn recv(&mut self, what: &str) -> Result<Vec<Reply>, Error> {
        let capacity = self.channel.buffer_len();
        let (data, n) = self.channel.recv().map_err(|source| Error::Recv {
            what: what.to_string(),
            source,
        })?;
        if n > data.len() {
            return Err(Error::Decode {
                what: what.to_string(),
                detail: format!("datagram of {n} bytes truncated to {capacity}"),
            });
        }
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

/// What one dump returned: more than [`ConntrackTable::list_udp`] keeps, for the kernel test
/// (`tests/conntrack_kernel.rs`) to see that other protocols decode and are left out.
#[derive(Debug, Default)]
pub struct Dump {
    /// UDP flows of the asked family.
    pub udp: Vec<Flow>,
    /// Every entry with ports (TCP, UDP, SCTP) of the asked family, UDP included.
    pub tracked: Vec<Tracked>,
    /// Well-formed entries of protocols other than UDP.
    pub other: usize,
    /// Why each entry that did not decode was skipped.
    pub undecodable: Vec<String>,
    /// The kernel flagged the dump as inconsistent (the table changed while it was walked).
    pub interrupted: bool,
}

impl Netlink {
    /// Lists every flow of `family` once, sorted into UDP flows, others and undecodable ones.
    pub fn dump(&mut self, family: IpFamily) -> Result<Dump, Error> {
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
                    ReplyKind::Flow(Ok(Some(t))) if t.flow.family() == family => {
                        if t.protocol == IPPROTO_UDP {
                            dump.udp.push(t.flow.clone());
                        } else {
                            dump.other += 1;
                        }
                        dump.tracked.push(t);
                    }
                    ReplyKind::Flow(Ok(_)) => dump.other += 1,
                    ReplyKind::Flow(Err(detail)) => dump.undecodable.push(detail),
                    ReplyKind::Ack | ReplyKind::Stats(..) | ReplyKind::Other => {}
                }
            }
        }
    }
}

impl Netlink {
    /// The statistics `conntrack -S` prints, summed over the CPUs (this network namespace's).
    pub fn statistics(&mut self) -> Result<Statistics, Error> {
        let seq = self.next_seq();
        let what = "the conntrack statistics".to_string();
        self.send(&stats::cpu_request(seq), &what)?;
        let mut total = Statistics::default();
        loop {
            for reply in self.recv(&what)? {
                if reply.seq != seq {
                    continue;
                }
                match reply.kind {
                    ReplyKind::Done => return Ok(total),
                    ReplyKind::Nack(code) => return Err(kernel_error(&what, code)),
                    ReplyKind::Stats(_, attrs) => {
                        total.add(&stats::parse_cpu(&attrs).map_err(|detail| Error::Decode {
                            what: what.clone(),
                            detail,
                        })?)
                    }
                    _ => {}
                }
            }
        }
    }

    /// The table's entries in this network namespace and its maximum (`nf_conntrack_count`,
    /// `nf_conntrack_max`).
    pub fn usage(&mut self) -> Result<TableUsage, Error> {
        let seq = self.next_seq();
        let what = "the conntrack table's usage".to_string();
        self.send(&stats::usage_request(seq), &what)?;
        loop {
            for reply in self.recv(&what)? {
                if reply.seq != seq {
                    continue;
                }
                match reply.kind {
                    ReplyKind::Nack(code) => return Err(kernel_error(&what, code)),
                    ReplyKind::Stats(_, attrs) => {
                        return stats::parse_usage(&attrs).map_err(|detail| Error::Decode { what, detail });
                    }
                    ReplyKind::Done => {
                        return Err(Error::Decode {
                            what,
                            detail: "no answer before NLMSG_DONE".into(),
                        });
                    }
                    _ => {}
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conntrack::testing::{flow, ip};

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

    fn udp(flow: Flow) -> Tracked {
        Tracked {
            protocol: IPPROTO_UDP,
            flow,
            tcp_state: None,
        }
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
                kind: ReplyKind::Flow(Ok(Some(udp(expected_v4))))
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
                kind: ReplyKind::Flow(Ok(Some(udp(expected_v6))))
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
    fn parse_keeps_tcp_entries_apart_from_udp_flows() {
        // The same flow as TCP: orig and reply CTA_PROTO_NUM become 6.
        let mut tcp = KERNEL_FLOW_V4.to_vec();
        assert_eq!((tcp[52], tcp[104]), (17, 17));
        tcp[52] = 6;
        tcp[104] = 6;
        let ReplyKind::Flow(Ok(Some(t))) = &parse_replies(&tcp).expect("kernel bytes")[0].kind else {
            panic!("a TCP entry");
        };
        assert_eq!(t.protocol, IPPROTO_TCP);
        assert_eq!(decode_flow(&tcp), Ok(None), "not a UDP flow");
        // ICMP (1) has no ports: not an entry we count.
        tcp[52] = 1;
        tcp[104] = 1;
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
}
