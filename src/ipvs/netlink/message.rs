//! The IPVS messages (pure): requests as bytes, replies as values.
//!
//! Requests are built attribute for attribute as `ipvsadm` 1.31 (libnl) builds them, so that
//! the byte fixtures captured from it apply (see `fixtures`), with one deliberate difference:
//! a command that names an existing service (delete it, or add, change, delete or list its real
//! servers) carries only the attributes that identify the service (family, then protocol,
//! address and port, or the firewall mark), and deleting a real server only those that identify
//! it (family, address, port). The kernel reads no more for those commands; ipvsadm sends its
//! defaults for the rest, and a field the kernel's policy refuses (a 16-byte scheduler name)
//! would then fail an unrelated delete.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::error::DecodeError;
use super::types::{Forward, Info, RealServer, ServiceFlags, ServiceKey, Stats, Timeouts, VirtualServer};
use super::wire::*;
use crate::model::{IpFamily, Protocol};
use crate::netlink::{
    Attrs, MsgBuf, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, read_i32, read_u32,
    split_messages,
};

/// A request to the IPVS family.
#[derive(Clone, Copy, Debug)]
pub enum Request<'a> {
    GetInfo,
    GetConfig,
    SetConfig(&'a Timeouts),
    Flush,
    NewService(&'a VirtualServer),
    SetService(&'a VirtualServer),
    DelService(&'a VirtualServer),
    /// All services (a dump).
    DumpServices,
    NewDest(&'a VirtualServer, &'a RealServer),
    SetDest(&'a VirtualServer, &'a RealServer),
    DelDest(&'a VirtualServer, &'a RealServer),
    /// All real servers of a service (a dump).
    DumpDests(&'a VirtualServer),
}

impl Request<'_> {
    pub fn is_dump(&self) -> bool {
        matches!(self, Request::DumpServices | Request::DumpDests(_))
    }
}

/// `CTRL_CMD_GETFAMILY` for "IPVS": asks the generic-netlink controller for the family's id.
pub fn encode_get_family(seq: u32) -> Vec<u8> {
    let mut b = genl_msg(
        GENL_ID_CTRL,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        CTRL_CMD_GETFAMILY,
        CTRL_VERSION,
    );
    b.put_str(CTRL_ATTR_FAMILY_NAME, IPVS_GENL_NAME);
    finish(b)
}

/// The bytes of `req` for the IPVS family with id `family` (from [`decode_family`]).
pub fn encode(req: &Request<'_>, family: u16, seq: u32) -> Vec<u8> {
    let (cmd, flags) = match req {
        Request::GetInfo => (IPVS_CMD_GET_INFO, 0),
        Request::GetConfig => (IPVS_CMD_GET_CONFIG, 0),
        Request::SetConfig(_) => (IPVS_CMD_SET_CONFIG, 0),
        Request::Flush => (IPVS_CMD_FLUSH, 0),
        Request::NewService(_) => (IPVS_CMD_NEW_SERVICE, 0),
        Request::SetService(_) => (IPVS_CMD_SET_SERVICE, 0),
        Request::DelService(_) => (IPVS_CMD_DEL_SERVICE, 0),
        Request::DumpServices => (IPVS_CMD_GET_SERVICE, NLM_F_DUMP),
        Request::NewDest(..) => (IPVS_CMD_NEW_DEST, 0),
        Request::SetDest(..) => (IPVS_CMD_SET_DEST, 0),
        Request::DelDest(..) => (IPVS_CMD_DEL_DEST, 0),
        Request::DumpDests(_) => (IPVS_CMD_GET_DEST, NLM_F_DUMP),
    };
    // Every request asks for an acknowledgement, so that success is a reply too; a dump ends
    // with NLMSG_DONE instead.
    let mut b = genl_msg(family, NLM_F_REQUEST | NLM_F_ACK | flags, seq, cmd, IPVS_GENL_VERSION);
    match req {
        Request::GetInfo | Request::GetConfig | Request::Flush | Request::DumpServices => {}
        Request::SetConfig(t) => {
            b.put_u32(IPVS_CMD_ATTR_TIMEOUT_TCP, t.tcp);
            b.put_u32(IPVS_CMD_ATTR_TIMEOUT_TCP_FIN, t.tcp_fin);
            b.put_u32(IPVS_CMD_ATTR_TIMEOUT_UDP, t.udp);
        }
        Request::NewService(s) | Request::SetService(s) => put_service(&mut b, s),
        Request::DelService(s) | Request::DumpDests(s) => put_service_key(&mut b, s),
        Request::NewDest(s, d) | Request::SetDest(s, d) => {
            put_service_key(&mut b, s);
            put_dest(&mut b, d);
        }
        Request::DelDest(s, d) => {
            put_service_key(&mut b, s);
            let n = b.nest_start(IPVS_CMD_ATTR_DEST);
            put_dest_key(&mut b, d);
            b.nest_end(n);
        }
    }
    finish(b)
}

fn af(family: IpFamily) -> u16 {
    match family {
        IpFamily::V4 => AF_INET,
        IpFamily::V6 => AF_INET6,
    }
}

fn protocol_number(p: Protocol) -> u16 {
    match p {
        Protocol::Tcp => IPPROTO_TCP,
        Protocol::Udp => IPPROTO_UDP,
        Protocol::Sctp => IPPROTO_SCTP,
    }
}

/// `union nf_inet_addr`: 16 bytes, an IPv4 address in the first 4.
fn addr16(a: IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match a {
        IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out = v6.octets(),
    }
    out
}

/// The netmask as the kernel keeps it: an IPv4 mask is stored as the mask's bytes (network
/// order); an IPv6 prefix length as a host-order integer in the same field.
fn netmask_bytes(family: IpFamily, netmask: u32) -> [u8; 4] {
    match family {
        IpFamily::V4 => netmask.to_be_bytes(),
        IpFamily::V6 => netmask.to_ne_bytes(),
    }
}

fn put_identity(b: &mut MsgBuf, s: &VirtualServer) {
    b.put_u16(IPVS_SVC_ATTR_AF, af(s.family()));
    match s.fwmark {
        Some(mark) => b.put_u32(IPVS_SVC_ATTR_FWMARK, mark),
        None => {
            b.put_u16(IPVS_SVC_ATTR_PROTOCOL, protocol_number(s.protocol));
            b.put(IPVS_SVC_ATTR_ADDR, &addr16(s.address));
            b.put(IPVS_SVC_ATTR_PORT, &s.port.to_be_bytes());
        }
    }
}

fn put_service_key(b: &mut MsgBuf, s: &VirtualServer) {
    let n = b.nest_start(IPVS_CMD_ATTR_SERVICE);
    put_identity(b, s);
    b.nest_end(n);
}

/// The whole service, as `NEW_SERVICE` / `SET_SERVICE` need it (the kernel wants scheduler,
/// flags, timeout and netmask all present).
fn put_service(b: &mut MsgBuf, s: &VirtualServer) {
    let n = b.nest_start(IPVS_CMD_ATTR_SERVICE);
    put_identity(b, s);
    b.put_str(IPVS_SVC_ATTR_SCHED_NAME, &s.scheduler);
    let mut flags = s.flags.0 & !(IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_HASHED);
    if s.persistent_timeout.is_some() {
        flags |= IP_VS_SVC_F_PERSISTENT;
    }
    // struct ip_vs_flags { flags, mask }: a full mask sets every flag to ours (on an update,
    // bits outside the mask would keep the old service's values).
    let mut fl = [0u8; 8];
    fl[..4].copy_from_slice(&flags.to_ne_bytes());
    fl[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
    b.put(IPVS_SVC_ATTR_FLAGS, &fl);
    b.put_u32(IPVS_SVC_ATTR_TIMEOUT, s.persistent_timeout.unwrap_or(0));
    b.put(IPVS_SVC_ATTR_NETMASK, &netmask_bytes(s.family(), s.netmask));
    b.nest_end(n);
}

fn put_dest_key(b: &mut MsgBuf, d: &RealServer) {
    b.put_u16(IPVS_DEST_ATTR_ADDR_FAMILY, af(d.family()));
    b.put(IPVS_DEST_ATTR_ADDR, &addr16(d.address));
    b.put(IPVS_DEST_ATTR_PORT, &d.port.to_be_bytes());
}

fn put_dest(b: &mut MsgBuf, d: &RealServer) {
    let n = b.nest_start(IPVS_CMD_ATTR_DEST);
    put_dest_key(b, d);
    b.put_u32(IPVS_DEST_ATTR_FWD_METHOD, d.forward.to_raw());
    b.put_u32(IPVS_DEST_ATTR_WEIGHT, d.weight);
    // Tunnel type IPIP, port 0, no checksum flags: the kernel's defaults, as ipvsadm sends
    // them (kernels before 5.3 ignore these attributes).
    b.put_u8(IPVS_DEST_ATTR_TUN_TYPE, 0);
    b.put(IPVS_DEST_ATTR_TUN_PORT, &0u16.to_be_bytes());
    b.put_u16(IPVS_DEST_ATTR_TUN_FLAGS, 0);
    b.put_u32(IPVS_DEST_ATTR_U_THRESH, d.upper_threshold);
    b.put_u32(IPVS_DEST_ATTR_L_THRESH, d.lower_threshold);
    b.nest_end(n);
}

/// One message of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    /// `NLMSG_ERROR`: `errno` 0 acknowledges the request with sequence number `seq`.
    Error {
        seq: u32,
        errno: i32,
        message: Option<String>,
    },
    /// `NLMSG_DONE`: the end of a dump (with the dump's error, if it failed midway).
    Done { seq: u32, errno: i32 },
    /// Anything else: for us, a message of the IPVS or controller family.
    Data {
        seq: u32,
        msg_type: u16,
        /// The dump was interrupted by a change to the table: its parts are inconsistent.
        interrupted: bool,
        payload: &'a [u8],
    },
}

/// Reads the messages of one datagram.
pub fn parse_replies(data: &[u8]) -> Result<Vec<Reply<'_>>, DecodeError> {
    split_messages(data)?
        .into_iter()
        .map(|m| match m.msg_type {
            NLMSG_ERROR => {
                let e = crate::netlink::parse_error(&m)?;
                Ok(Reply::Error {
                    seq: e.seq,
                    errno: e.errno,
                    message: e.message,
                })
            }
            NLMSG_DONE => Ok(Reply::Done {
                seq: m.seq,
                // Some kernels send DONE with no payload at all.
                errno: read_i32(m.payload, 0).unwrap_or(0),
            }),
            msg_type => Ok(Reply::Data {
                seq: m.seq,
                msg_type,
                interrupted: m.flags & NLM_F_DUMP_INTR != 0,
                payload: m.payload,
            }),
        })
        .collect()
}

/// What the controller says about a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    pub id: u16,
    pub version: u32,
    pub max_attr: u32,
}

/// The controller's `CTRL_CMD_NEWFAMILY` reply (payload after `nlmsghdr`).
pub fn decode_family(payload: &[u8]) -> Result<Family, DecodeError> {
    let (cmd, _, attrs) = genl_payload(payload)?;
    if cmd != CTRL_CMD_NEWFAMILY {
        return Err(DecodeError::Unexpected {
            msg_type: GENL_ID_CTRL,
            cmd,
        });
    }
    Ok(Family {
        id: Attrs::need(
            attrs.u16(CTRL_ATTR_FAMILY_ID, "CTRL_ATTR_FAMILY_ID"),
            "CTRL_ATTR_FAMILY_ID",
        )?,
        version: attrs.u32(CTRL_ATTR_VERSION, "CTRL_ATTR_VERSION")?.unwrap_or(0),
        max_attr: attrs.u32(CTRL_ATTR_MAXATTR, "CTRL_ATTR_MAXATTR")?.unwrap_or(0),
    })
}

/// The top-level attributes of an IPVS message whose command must be `want`.
pub fn ipvs_attrs(payload: &[u8], msg_type: u16, want: u8) -> Result<Attrs<'_>, DecodeError> {
    let (cmd, _, attrs) = genl_payload(payload)?;
    if cmd != want {
        return Err(DecodeError::Unexpected { msg_type, cmd });
    }
    Ok(attrs)
}

fn family_of(af_value: u16) -> Result<IpFamily, DecodeError> {
    match af_value {
        AF_INET => Ok(IpFamily::V4),
        AF_INET6 => Ok(IpFamily::V6),
        other => Err(DecodeError::Family(other)),
    }
}

/// An address attribute of `family`: 16 bytes (`nf_inet_addr`), or exactly the address.
fn address(attrs: &Attrs<'_>, ty: u16, name: &'static str, family: IpFamily) -> Result<IpAddr, DecodeError> {
    let raw = attrs.get(ty).ok_or(DecodeError::Missing(name))?;
    let len = raw.len();
    match family {
        IpFamily::V4 => raw
            .get(..4)
            .filter(|_| len == 4 || len == 16)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        IpFamily::V6 => <[u8; 16]>::try_from(raw).ok().map(|b| IpAddr::V6(Ipv6Addr::from(b))),
    }
    .ok_or(DecodeError::Length { attr: name, len })
}

fn unspecified(family: IpFamily) -> IpAddr {
    match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

fn protocol(n: u16) -> Result<Protocol, DecodeError> {
    match n {
        IPPROTO_TCP => Ok(Protocol::Tcp),
        IPPROTO_UDP => Ok(Protocol::Udp),
        IPPROTO_SCTP => Ok(Protocol::Sctp),
        other => Err(DecodeError::Protocol(other)),
    }
}

/// The identifying part of a service nest: family, then mark or protocol/address/port.
pub fn decode_service_key(a: &Attrs<'_>) -> Result<ServiceKey, DecodeError> {
    let family = family_of(Attrs::need(
        a.u16(IPVS_SVC_ATTR_AF, "IPVS_SVC_ATTR_AF"),
        "IPVS_SVC_ATTR_AF",
    )?)?;
    if let Some(mark) = a.u32(IPVS_SVC_ATTR_FWMARK, "IPVS_SVC_ATTR_FWMARK")? {
        return Ok(ServiceKey::Fwmark { family, mark });
    }
    Ok(ServiceKey::Addr {
        protocol: protocol(Attrs::need(
            a.u16(IPVS_SVC_ATTR_PROTOCOL, "IPVS_SVC_ATTR_PROTOCOL"),
            "IPVS_SVC_ATTR_PROTOCOL",
        )?)?,
        address: address(a, IPVS_SVC_ATTR_ADDR, "IPVS_SVC_ATTR_ADDR", family)?,
        port: Attrs::need(a.be16(IPVS_SVC_ATTR_PORT, "IPVS_SVC_ATTR_PORT"), "IPVS_SVC_ATTR_PORT")?,
    })
}

/// A whole service nest (a dump entry, or what `NEW_SERVICE` / `SET_SERVICE` carry).
pub fn decode_service(a: &Attrs<'_>) -> Result<VirtualServer, DecodeError> {
    let key = decode_service_key(a)?;
    let flags_raw = a
        .get(IPVS_SVC_ATTR_FLAGS)
        .ok_or(DecodeError::Missing("IPVS_SVC_ATTR_FLAGS"))?;
    // struct ip_vs_flags { flags, mask }: only the flags matter here.
    let flags = read_u32(flags_raw, 0)
        .filter(|_| flags_raw.len() == 8)
        .ok_or(DecodeError::Length {
            attr: "IPVS_SVC_ATTR_FLAGS",
            len: flags_raw.len(),
        })?;
    let timeout = a.u32(IPVS_SVC_ATTR_TIMEOUT, "IPVS_SVC_ATTR_TIMEOUT")?.unwrap_or(0);
    let (address, protocol, port, fwmark, family) = match key {
        ServiceKey::Addr {
            protocol,
            address,
            port,
        } => (address, protocol, port, None, IpFamily::of(&address)),
        ServiceKey::Fwmark { family, mark } => (unspecified(family), Protocol::Tcp, 0, Some(mark), family),
    };
    let netmask = match a.raw4(IPVS_SVC_ATTR_NETMASK, "IPVS_SVC_ATTR_NETMASK")? {
        Some(b) => match family {
            IpFamily::V4 => u32::from_be_bytes(b),
            IpFamily::V6 => u32::from_ne_bytes(b),
        },
        None => super::types::host_netmask(family),
    };
    Ok(VirtualServer {
        address,
        protocol,
        port,
        fwmark,
        scheduler: Attrs::need(
            a.str(IPVS_SVC_ATTR_SCHED_NAME, "IPVS_SVC_ATTR_SCHED_NAME"),
            "IPVS_SVC_ATTR_SCHED_NAME",
        )?
        .to_string(),
        persistent_timeout: (flags & IP_VS_SVC_F_PERSISTENT != 0).then_some(timeout),
        flags: ServiceFlags(flags & !(IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_HASHED)),
        netmask,
        stats: decode_stats(a, IPVS_SVC_ATTR_STATS64, IPVS_SVC_ATTR_STATS)?,
    })
}

/// The 64-bit statistics nest if present (kernels since 4.1), else the older one whose
/// counters are 32 bits (bytes are 64 bits in both).
fn decode_stats(a: &Attrs<'_>, ty64: u16, ty32: u16) -> Result<Stats, DecodeError> {
    let (s, wide) = match a.nested(ty64)? {
        Some(s) => (s, true),
        None => match a.nested(ty32)? {
            Some(s) => (s, false),
            None => return Ok(Stats::default()),
        },
    };
    let get = |ty: u16, name: &'static str, always_wide: bool| -> Result<u64, DecodeError> {
        if wide || always_wide {
            Ok(s.u64(ty, name)?.unwrap_or(0))
        } else {
            Ok(s.u32(ty, name)?.map(u64::from).unwrap_or(0))
        }
    };
    Ok(Stats {
        connections: get(IPVS_STATS_ATTR_CONNS, "IPVS_STATS_ATTR_CONNS", false)?,
        in_packets: get(IPVS_STATS_ATTR_INPKTS, "IPVS_STATS_ATTR_INPKTS", false)?,
        out_packets: get(IPVS_STATS_ATTR_OUTPKTS, "IPVS_STATS_ATTR_OUTPKTS", false)?,
        in_bytes: get(IPVS_STATS_ATTR_INBYTES, "IPVS_STATS_ATTR_INBYTES", true)?,
        out_bytes: get(IPVS_STATS_ATTR_OUTBYTES, "IPVS_STATS_ATTR_OUTBYTES", true)?,
        cps: get(IPVS_STATS_ATTR_CPS, "IPVS_STATS_ATTR_CPS", false)?,
        in_pps: get(IPVS_STATS_ATTR_INPPS, "IPVS_STATS_ATTR_INPPS", false)?,
        out_pps: get(IPVS_STATS_ATTR_OUTPPS, "IPVS_STATS_ATTR_OUTPPS", false)?,
        in_bps: get(IPVS_STATS_ATTR_INBPS, "IPVS_STATS_ATTR_INBPS", false)?,
        out_bps: get(IPVS_STATS_ATTR_OUTBPS, "IPVS_STATS_ATTR_OUTBPS", false)?,
    })
}

/// A destination nest. Its family comes from `IPVS_DEST_ATTR_ADDR_FAMILY` (kernels since 3.18)
/// or else is the service's, `service_family`.
pub fn decode_dest(a: &Attrs<'_>, service_family: IpFamily) -> Result<RealServer, DecodeError> {
    let family = match a.u16(IPVS_DEST_ATTR_ADDR_FAMILY, "IPVS_DEST_ATTR_ADDR_FAMILY")? {
        Some(v) => family_of(v)?,
        None => service_family,
    };
    let u32_or_0 = |ty: u16, name: &'static str| -> Result<u32, DecodeError> { Ok(a.u32(ty, name)?.unwrap_or(0)) };
    Ok(RealServer {
        address: address(a, IPVS_DEST_ATTR_ADDR, "IPVS_DEST_ATTR_ADDR", family)?,
        port: Attrs::need(
            a.be16(IPVS_DEST_ATTR_PORT, "IPVS_DEST_ATTR_PORT"),
            "IPVS_DEST_ATTR_PORT",
        )?,
        weight: u32_or_0(IPVS_DEST_ATTR_WEIGHT, "IPVS_DEST_ATTR_WEIGHT")?,
        forward: Forward::from_raw(u32_or_0(IPVS_DEST_ATTR_FWD_METHOD, "IPVS_DEST_ATTR_FWD_METHOD")?),
        upper_threshold: u32_or_0(IPVS_DEST_ATTR_U_THRESH, "IPVS_DEST_ATTR_U_THRESH")?,
        lower_threshold: u32_or_0(IPVS_DEST_ATTR_L_THRESH, "IPVS_DEST_ATTR_L_THRESH")?,
        active_conns: u32_or_0(IPVS_DEST_ATTR_ACTIVE_CONNS, "IPVS_DEST_ATTR_ACTIVE_CONNS")?,
        inactive_conns: u32_or_0(IPVS_DEST_ATTR_INACT_CONNS, "IPVS_DEST_ATTR_INACT_CONNS")?,
        persistent_conns: u32_or_0(IPVS_DEST_ATTR_PERSIST_CONNS, "IPVS_DEST_ATTR_PERSIST_CONNS")?,
        stats: decode_stats(a, IPVS_DEST_ATTR_STATS64, IPVS_DEST_ATTR_STATS)?,
    })
}

/// A service dump entry (`IPVS_CMD_NEW_SERVICE` with the service nest).
pub fn decode_service_msg(payload: &[u8], msg_type: u16) -> Result<VirtualServer, DecodeError> {
    let attrs = ipvs_attrs(payload, msg_type, IPVS_CMD_NEW_SERVICE)?;
    let svc = attrs
        .nested(IPVS_CMD_ATTR_SERVICE)?
        .ok_or(DecodeError::Missing("IPVS_CMD_ATTR_SERVICE"))?;
    decode_service(&svc)
}

/// A destination dump entry (`IPVS_CMD_NEW_DEST` with the destination nest).
pub fn decode_dest_msg(payload: &[u8], msg_type: u16, service_family: IpFamily) -> Result<RealServer, DecodeError> {
    let attrs = ipvs_attrs(payload, msg_type, IPVS_CMD_NEW_DEST)?;
    let dest = attrs
        .nested(IPVS_CMD_ATTR_DEST)?
        .ok_or(DecodeError::Missing("IPVS_CMD_ATTR_DEST"))?;
    decode_dest(&dest, service_family)
}

/// The `GET_INFO` reply (`IPVS_CMD_SET_INFO`).
pub fn decode_info(payload: &[u8], msg_type: u16) -> Result<Info, DecodeError> {
    let a = ipvs_attrs(payload, msg_type, IPVS_CMD_SET_INFO)?;
    Ok(Info {
        version: Attrs::need(
            a.u32(IPVS_INFO_ATTR_VERSION, "IPVS_INFO_ATTR_VERSION"),
            "IPVS_INFO_ATTR_VERSION",
        )?,
        conn_table_size: Attrs::need(
            a.u32(IPVS_INFO_ATTR_CONN_TAB_SIZE, "IPVS_INFO_ATTR_CONN_TAB_SIZE"),
            "IPVS_INFO_ATTR_CONN_TAB_SIZE",
        )?,
    })
}

/// The `GET_CONFIG` reply (`IPVS_CMD_SET_CONFIG`). A kernel built without one of the protocols
/// leaves its timeout out; that reads as 0.
pub fn decode_timeouts(payload: &[u8], msg_type: u16) -> Result<Timeouts, DecodeError> {
    let a = ipvs_attrs(payload, msg_type, IPVS_CMD_SET_CONFIG)?;
    Ok(Timeouts {
        tcp: a
            .u32(IPVS_CMD_ATTR_TIMEOUT_TCP, "IPVS_CMD_ATTR_TIMEOUT_TCP")?
            .unwrap_or(0),
        tcp_fin: a
            .u32(IPVS_CMD_ATTR_TIMEOUT_TCP_FIN, "IPVS_CMD_ATTR_TIMEOUT_TCP_FIN")?
            .unwrap_or(0),
        udp: a
            .u32(IPVS_CMD_ATTR_TIMEOUT_UDP, "IPVS_CMD_ATTR_TIMEOUT_UDP")?
            .unwrap_or(0),
    })
}
