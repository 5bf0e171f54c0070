//! The generic-netlink wire format as the IPVS family uses it: the `genlmsghdr` after
//! `nlmsghdr`, and the kernel's numeric constants (`linux/genetlink.h`, `linux/ip_vs.h`). The
//! framing itself (headers, attributes, nests, the attribute reader) is [`crate::netlink`]'s;
//! what to put in a message is `message`'s business.
//!
//! Byte order: IPVS attributes are host order (`nla_get_u16/u32`), except the ports (network
//! order) and the persistence netmask, which the kernel copies as raw bytes (`nla_get_be32`).

use super::error::DecodeError;
use crate::netlink::{Attrs, MsgBuf};

/// `genlmsghdr`: cmd, version, 2 reserved bytes.
pub const GENL_HDRLEN: usize = 4;

/// The generic-netlink controller (`linux/genetlink.h`).
pub const GENL_ID_CTRL: u16 = 0x10;
pub const CTRL_CMD_NEWFAMILY: u8 = 1;
pub const CTRL_CMD_GETFAMILY: u8 = 3;
pub const CTRL_ATTR_FAMILY_ID: u16 = 1;
pub const CTRL_ATTR_FAMILY_NAME: u16 = 2;
pub const CTRL_ATTR_VERSION: u16 = 3;
pub const CTRL_ATTR_MAXATTR: u16 = 5;
/// The controller's own message version (what libnl sends).
pub const CTRL_VERSION: u8 = 1;

/// The IPVS family (`IPVS_GENL_NAME`, `IPVS_GENL_VERSION`).
pub const IPVS_GENL_NAME: &str = "IPVS";
pub const IPVS_GENL_VERSION: u8 = 1;

// `enum` of IPVS commands.
pub const IPVS_CMD_NEW_SERVICE: u8 = 1;
pub const IPVS_CMD_SET_SERVICE: u8 = 2;
pub const IPVS_CMD_DEL_SERVICE: u8 = 3;
pub const IPVS_CMD_GET_SERVICE: u8 = 4;
pub const IPVS_CMD_NEW_DEST: u8 = 5;
pub const IPVS_CMD_SET_DEST: u8 = 6;
pub const IPVS_CMD_DEL_DEST: u8 = 7;
pub const IPVS_CMD_GET_DEST: u8 = 8;
pub const IPVS_CMD_SET_CONFIG: u8 = 12;
pub const IPVS_CMD_GET_CONFIG: u8 = 13;
/// The command of the kernel's reply to `GET_INFO`.
pub const IPVS_CMD_SET_INFO: u8 = 14;
pub const IPVS_CMD_GET_INFO: u8 = 15;
pub const IPVS_CMD_FLUSH: u8 = 17;

// Top-level attributes.
pub const IPVS_CMD_ATTR_SERVICE: u16 = 1;
pub const IPVS_CMD_ATTR_DEST: u16 = 2;
pub const IPVS_CMD_ATTR_TIMEOUT_TCP: u16 = 4;
pub const IPVS_CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
pub const IPVS_CMD_ATTR_TIMEOUT_UDP: u16 = 6;

// Inside IPVS_CMD_ATTR_SERVICE.
pub const IPVS_SVC_ATTR_AF: u16 = 1;
pub const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
pub const IPVS_SVC_ATTR_ADDR: u16 = 3;
pub const IPVS_SVC_ATTR_PORT: u16 = 4;
pub const IPVS_SVC_ATTR_FWMARK: u16 = 5;
pub const IPVS_SVC_ATTR_SCHED_NAME: u16 = 6;
pub const IPVS_SVC_ATTR_FLAGS: u16 = 7;
pub const IPVS_SVC_ATTR_TIMEOUT: u16 = 8;
pub const IPVS_SVC_ATTR_NETMASK: u16 = 9;
pub const IPVS_SVC_ATTR_STATS: u16 = 10;
pub const IPVS_SVC_ATTR_STATS64: u16 = 12;

// Inside IPVS_CMD_ATTR_DEST.
pub const IPVS_DEST_ATTR_ADDR: u16 = 1;
pub const IPVS_DEST_ATTR_PORT: u16 = 2;
pub const IPVS_DEST_ATTR_FWD_METHOD: u16 = 3;
pub const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
pub const IPVS_DEST_ATTR_U_THRESH: u16 = 5;
pub const IPVS_DEST_ATTR_L_THRESH: u16 = 6;
pub const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
pub const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
pub const IPVS_DEST_ATTR_PERSIST_CONNS: u16 = 9;
pub const IPVS_DEST_ATTR_STATS: u16 = 10;
pub const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;
pub const IPVS_DEST_ATTR_STATS64: u16 = 12;
pub const IPVS_DEST_ATTR_TUN_TYPE: u16 = 13;
pub const IPVS_DEST_ATTR_TUN_PORT: u16 = 14;
pub const IPVS_DEST_ATTR_TUN_FLAGS: u16 = 15;

// Inside the STATS / STATS64 nests (u32 resp. u64 values; bytes are u64 in both).
pub const IPVS_STATS_ATTR_CONNS: u16 = 1;
pub const IPVS_STATS_ATTR_INPKTS: u16 = 2;
pub const IPVS_STATS_ATTR_OUTPKTS: u16 = 3;
pub const IPVS_STATS_ATTR_INBYTES: u16 = 4;
pub const IPVS_STATS_ATTR_OUTBYTES: u16 = 5;
pub const IPVS_STATS_ATTR_CPS: u16 = 6;
pub const IPVS_STATS_ATTR_INPPS: u16 = 7;
pub const IPVS_STATS_ATTR_OUTPPS: u16 = 8;
pub const IPVS_STATS_ATTR_INBPS: u16 = 9;
pub const IPVS_STATS_ATTR_OUTBPS: u16 = 10;

// In the GET_INFO reply.
pub const IPVS_INFO_ATTR_VERSION: u16 = 1;
pub const IPVS_INFO_ATTR_CONN_TAB_SIZE: u16 = 2;

/// Service flags (`IP_VS_SVC_F_*`).
pub const IP_VS_SVC_F_PERSISTENT: u32 = 0x1;
pub const IP_VS_SVC_F_HASHED: u32 = 0x2;

/// Address families and protocols as IPVS names them.
pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;
pub const IPPROTO_TCP: u16 = 6;
pub const IPPROTO_UDP: u16 = 17;
pub const IPPROTO_SCTP: u16 = 132;

/// Starts a generic-netlink request in a buffer of its own: `nlmsghdr` and `genlmsghdr`.
/// [`finish`] closes it.
pub fn genl_msg(msg_type: u16, flags: u16, seq: u32, cmd: u8, version: u8) -> MsgBuf {
    let mut b = MsgBuf::with_capacity(256);
    b.begin_msg(msg_type, flags, seq, &[cmd, version, 0, 0]);
    b
}

/// The request started by [`genl_msg`], its length filled in.
pub fn finish(mut b: MsgBuf) -> Vec<u8> {
    b.end_msg(0);
    b.buf
}

/// A generic-netlink payload: its command and version, and its attributes.
pub fn genl_payload(payload: &[u8]) -> Result<(u8, u8, Attrs<'_>), DecodeError> {
    let hdr = payload
        .get(..GENL_HDRLEN)
        .ok_or(DecodeError::Truncated("generic netlink header"))?;
    Ok((hdr[0], hdr[1], Attrs::parse(&payload[GENL_HDRLEN..])?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{NLM_F_REQUEST, split_messages};

    #[test]
    fn attributes_are_padded_and_nests_flagged() {
        let mut b = genl_msg(0x20, NLM_F_REQUEST, 7, IPVS_CMD_NEW_SERVICE, 1);
        let n = b.nest_start(IPVS_CMD_ATTR_SERVICE);
        b.put_u16(IPVS_SVC_ATTR_AF, AF_INET);
        b.put_str(IPVS_SVC_ATTR_SCHED_NAME, "rr");
        b.nest_end(n);
        let bytes = finish(b);
        let expected: Vec<u8> = [
            &[40u8, 0, 0, 0, 0x20, 0, 1, 0, 7, 0, 0, 0, 0, 0, 0, 0][..],
            &[1, 1, 0, 0],
            &[20, 0, 1, 0x80, 6, 0, 1, 0, 2, 0, 0, 0, 7, 0, 6, 0, b'r', b'r', 0, 0],
        ]
        .concat();
        assert_eq!(bytes, expected);

        let msgs = split_messages(&bytes).expect("framed");
        assert_eq!(msgs.len(), 1);
        let (cmd, version, attrs) = genl_payload(msgs[0].payload).expect("genl");
        assert_eq!((cmd, version), (IPVS_CMD_NEW_SERVICE, 1));
        let svc = attrs.nested(IPVS_CMD_ATTR_SERVICE).expect("nest").expect("present");
        assert_eq!(svc.u16(IPVS_SVC_ATTR_AF, "af").expect("u16"), Some(AF_INET));
        assert_eq!(svc.str(IPVS_SVC_ATTR_SCHED_NAME, "sched").expect("str"), Some("rr"));
    }
}
