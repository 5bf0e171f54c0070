//! The generic-netlink wire format as the IPVS family uses it: message headers (`nlmsghdr` +
//! `genlmsghdr`), attributes with their 4-byte padding, nests, a bounds-checked attribute
//! reader, and the kernel's numeric constants (`linux/netlink.h`, `linux/genetlink.h`,
//! `linux/ip_vs.h`). What to put in a message is `message`'s business.
//!
//! Byte order: IPVS attributes are host order (`nla_get_u16/u32`), except the ports (network
//! order) and the persistence netmask, which the kernel copies as raw bytes (`nla_get_be32`).

use super::error::DecodeError;

/// Netlink header flags (`linux/netlink.h`).
pub const NLM_F_REQUEST: u16 = 0x1;
/// Set on every part of a dump (checked by the fixtures).
#[cfg(test)]
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
/// Set on the parts of a dump when the table changed while it was being dumped.
pub const NLM_F_DUMP_INTR: u16 = 0x10;
/// `NLM_F_ROOT | NLM_F_MATCH`.
pub const NLM_F_DUMP: u16 = 0x300;
/// Error-reply flags: the echoed request was trimmed / TLVs (extack) follow.
pub const NLM_F_CAPPED: u16 = 0x100;
pub const NLM_F_ACK_TLVS: u16 = 0x200;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLMSG_HDRLEN: usize = 16;
/// `genlmsghdr`: cmd, version, 2 reserved bytes.
pub const GENL_HDRLEN: usize = 4;
/// `NLMSGERR_ATTR_MSG`: the extack text in an error reply.
pub const NLMSGERR_ATTR_MSG: u16 = 1;

pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_TYPE_MASK: u16 = 0x3fff;

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

fn pad(len: usize) -> usize {
    (len + 3) & !3
}

/// A netlink message being built.
#[derive(Debug, Default)]
pub struct MsgBuf {
    pub buf: Vec<u8>,
    nests: Vec<usize>,
}

impl MsgBuf {
    /// Starts the one message of this buffer: `nlmsghdr` (length filled in by
    /// [`MsgBuf::finish`]; port id 0, which the kernel fills in itself) and `genlmsghdr`.
    pub fn new(msg_type: u16, flags: u16, seq: u32, cmd: u8, version: u8) -> MsgBuf {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&msg_type.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[cmd, version, 0, 0]);
        MsgBuf { buf, nests: Vec::new() }
    }

    /// The finished message, its length filled in. Our messages are a few hundred bytes;
    /// nests left open (a bug) are closed here rather than sent with a zero length.
    pub fn finish(mut self) -> Vec<u8> {
        while let Some(start) = self.nests.pop() {
            self.close(start);
        }
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }

    /// Appends one attribute (header, data, padding).
    pub fn put(&mut self, ty: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf
            .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(self.buf.len() + pad(len) - len, 0);
    }

    pub fn put_u8(&mut self, ty: u16, v: u8) {
        self.put(ty, &[v]);
    }

    /// A host-order u16.
    pub fn put_u16(&mut self, ty: u16, v: u16) {
        self.put(ty, &v.to_ne_bytes());
    }

    /// A host-order u32.
    pub fn put_u32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_ne_bytes());
    }

    /// A NUL-terminated string.
    pub fn put_str(&mut self, ty: u16, s: &str) {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.put(ty, &v);
    }

    /// Opens a nested attribute, flagged `NLA_F_NESTED` as libnl flags the nests it sends.
    pub fn nest(&mut self, ty: u16) {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    }

    /// Closes the innermost open nest.
    pub fn end_nest(&mut self) {
        if let Some(start) = self.nests.pop() {
            self.close(start);
        }
    }

    fn close(&mut self, start: usize) {
        let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// One netlink message of a datagram, header decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawMsg<'a> {
    pub msg_type: u16,
    pub flags: u16,
    pub seq: u32,
    /// Everything after `nlmsghdr`.
    pub payload: &'a [u8],
}

/// Splits a datagram into its messages. A message whose length runs past the datagram (or is
/// shorter than a header) is an error: the rest of the datagram cannot be framed.
pub fn split_messages(data: &[u8]) -> Result<Vec<RawMsg<'_>>, DecodeError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let len = read_u32(data, at).ok_or(DecodeError::Truncated("netlink message header"))? as usize;
        let msg = data
            .get(at..at.saturating_add(len))
            .filter(|_| len >= NLMSG_HDRLEN)
            .ok_or(DecodeError::Truncated("netlink message"))?;
        out.push(RawMsg {
            msg_type: read_u16(msg, 4).ok_or(DecodeError::Truncated("netlink message header"))?,
            flags: read_u16(msg, 6).ok_or(DecodeError::Truncated("netlink message header"))?,
            seq: read_u32(msg, 8).ok_or(DecodeError::Truncated("netlink message header"))?,
            payload: &msg[NLMSG_HDRLEN..],
        });
        at = at.saturating_add(pad(len));
    }
    Ok(out)
}

/// A generic-netlink payload: its command and version, and its attributes.
pub fn genl_payload(payload: &[u8]) -> Result<(u8, u8, Attrs<'_>), DecodeError> {
    let hdr = payload
        .get(..GENL_HDRLEN)
        .ok_or(DecodeError::Truncated("generic netlink header"))?;
    Ok((hdr[0], hdr[1], Attrs::parse(&payload[GENL_HDRLEN..])?))
}

pub fn read_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The attributes of one level, in the order they came. Lookups take the last of a type, as
/// the kernel's own parser does.
#[derive(Clone, Debug, Default)]
pub struct Attrs<'a> {
    list: Vec<(u16, &'a [u8])>,
}

impl<'a> Attrs<'a> {
    /// Reads a run of attributes; the `NLA_F_NESTED` / byte-order flags are masked off the
    /// types (the kernel sets no flag on the nests it sends, libnl sets `NLA_F_NESTED`).
    pub fn parse(mut b: &'a [u8]) -> Result<Attrs<'a>, DecodeError> {
        let mut list = Vec::new();
        while !b.is_empty() {
            let len = read_u16(b, 0).ok_or(DecodeError::Truncated("attribute header"))? as usize;
            let ty = read_u16(b, 2).ok_or(DecodeError::Truncated("attribute header"))? & NLA_TYPE_MASK;
            if len < 4 || len > b.len() {
                return Err(DecodeError::Truncated("attribute"));
            }
            list.push((ty, &b[4..len]));
            b = b.get(pad(len)..).unwrap_or_default();
        }
        Ok(Attrs { list })
    }

    pub fn get(&self, ty: u16) -> Option<&'a [u8]> {
        self.list.iter().rev().find(|(t, _)| *t == ty).map(|(_, v)| *v)
    }

    /// The attribute's value, which must be exactly `N` bytes.
    fn fixed<const N: usize>(&self, ty: u16, name: &'static str) -> Result<Option<[u8; N]>, DecodeError> {
        match self.get(ty) {
            None => Ok(None),
            Some(v) => v.try_into().map(Some).map_err(|_| DecodeError::Length {
                attr: name,
                len: v.len(),
            }),
        }
    }

    pub fn u16(&self, ty: u16, name: &'static str) -> Result<Option<u16>, DecodeError> {
        Ok(self.fixed::<2>(ty, name)?.map(u16::from_ne_bytes))
    }

    pub fn be16(&self, ty: u16, name: &'static str) -> Result<Option<u16>, DecodeError> {
        Ok(self.fixed::<2>(ty, name)?.map(u16::from_be_bytes))
    }

    pub fn u32(&self, ty: u16, name: &'static str) -> Result<Option<u32>, DecodeError> {
        Ok(self.fixed::<4>(ty, name)?.map(u32::from_ne_bytes))
    }

    pub fn raw4(&self, ty: u16, name: &'static str) -> Result<Option<[u8; 4]>, DecodeError> {
        self.fixed::<4>(ty, name)
    }

    pub fn u64(&self, ty: u16, name: &'static str) -> Result<Option<u64>, DecodeError> {
        Ok(self.fixed::<8>(ty, name)?.map(u64::from_ne_bytes))
    }

    /// A NUL-terminated (or unterminated) UTF-8 string.
    pub fn str(&self, ty: u16, name: &'static str) -> Result<Option<&'a str>, DecodeError> {
        let Some(v) = self.get(ty) else {
            return Ok(None);
        };
        let text = v.split(|&c| c == 0).next().unwrap_or_default();
        std::str::from_utf8(text)
            .map(Some)
            .map_err(|_| DecodeError::NotUtf8(name))
    }

    pub fn nested(&self, ty: u16) -> Result<Option<Attrs<'a>>, DecodeError> {
        self.get(ty).map(Attrs::parse).transpose()
    }

    /// Like the typed getters, for an attribute that must be there.
    pub fn need<T>(got: Result<Option<T>, DecodeError>, name: &'static str) -> Result<T, DecodeError> {
        got?.ok_or(DecodeError::Missing(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nests_flagged() {
        let mut b = MsgBuf::new(0x20, NLM_F_REQUEST, 7, IPVS_CMD_NEW_SERVICE, 1);
        b.nest(IPVS_CMD_ATTR_SERVICE);
        b.put_u16(IPVS_SVC_ATTR_AF, AF_INET);
        b.put_str(IPVS_SVC_ATTR_SCHED_NAME, "rr");
        b.end_nest();
        let bytes = b.finish();
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

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        // An attribute claiming more bytes than there are.
        assert!(Attrs::parse(&[8, 0, 1, 0, 1, 0]).is_err());
        // A length below the header size.
        assert!(Attrs::parse(&[2, 0, 1, 0]).is_err());
        // A message claiming more than the datagram holds, and one shorter than its header.
        assert!(split_messages(&[64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(split_messages(&[4, 0, 0, 0]).is_err());
        // A wrong-sized integer.
        let a = Attrs::parse(&[6, 0, 1, 0, 1, 2, 0, 0]).expect("parses");
        assert!(matches!(a.u32(1, "x"), Err(DecodeError::Length { attr: "x", len: 2 })));
    }
}
