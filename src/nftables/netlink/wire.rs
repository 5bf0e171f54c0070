//! The netlink wire format as nf_tables uses it: message headers (`nlmsghdr` + `nfgenmsg`),
//! attributes with their 4-byte padding, nests, and the kernel's numeric constants (from
//! `linux/netfilter/nf_tables.h`, `linux/netfilter/nfnetlink.h` and libnftnl's userdata TLV
//! types). Everything here only appends bytes to a buffer; what to append is `encode`'s and
//! `expr`'s business.

/// Netlink header flags (`linux/netlink.h`).
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
/// Reply flags: the error carries TLVs (extack) / the echoed request was trimmed.
pub const NLM_F_CAPPED: u16 = 0x100;
pub const NLM_F_ACK_TLVS: u16 = 0x200;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLMSG_HDRLEN: usize = 16;
/// `NLMSGERR_ATTR_MSG`: the extack text in an error reply.
pub const NLMSGERR_ATTR_MSG: u16 = 1;

pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_TYPE_MASK: u16 = 0x3fff;

/// nfnetlink batch framing.
pub const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub const NFNL_MSG_BATCH_END: u16 = 0x11;
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;

pub const NFPROTO_UNSPEC: u8 = 0;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

/// `enum nf_tables_msg_types`.
pub const NFT_MSG_NEWTABLE: u16 = 0;
pub const NFT_MSG_GETTABLE: u16 = 1;
pub const NFT_MSG_DELTABLE: u16 = 2;
pub const NFT_MSG_NEWCHAIN: u16 = 3;
pub const NFT_MSG_DELCHAIN: u16 = 5;
pub const NFT_MSG_NEWRULE: u16 = 6;
pub const NFT_MSG_DELRULE: u16 = 8;
pub const NFT_MSG_NEWSET: u16 = 9;
pub const NFT_MSG_DELSET: u16 = 11;
pub const NFT_MSG_NEWSETELEM: u16 = 12;
pub const NFT_MSG_DELSETELEM: u16 = 14;

/// The netlink message type of an nf_tables message.
pub fn nft_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

// Table, chain, hook and rule attributes.
pub const NFTA_TABLE_NAME: u16 = 1;
pub const NFTA_TABLE_FLAGS: u16 = 2;
pub const NFTA_TABLE_USERDATA: u16 = 6;
pub const NFTA_CHAIN_TABLE: u16 = 1;
pub const NFTA_CHAIN_NAME: u16 = 3;
pub const NFTA_CHAIN_HOOK: u16 = 4;
pub const NFTA_CHAIN_TYPE: u16 = 7;
pub const NFTA_CHAIN_USERDATA: u16 = 12;
pub const NFTA_HOOK_HOOKNUM: u16 = 1;
pub const NFTA_HOOK_PRIORITY: u16 = 2;
pub const NFTA_RULE_TABLE: u16 = 1;
pub const NFTA_RULE_CHAIN: u16 = 2;
pub const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub const NFTA_RULE_USERDATA: u16 = 7;

// Sets and elements.
pub const NFTA_SET_TABLE: u16 = 1;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFTA_SET_KEY_TYPE: u16 = 4;
pub const NFTA_SET_KEY_LEN: u16 = 5;
pub const NFTA_SET_DATA_TYPE: u16 = 6;
pub const NFTA_SET_DATA_LEN: u16 = 7;
pub const NFTA_SET_DESC: u16 = 9;
pub const NFTA_SET_ID: u16 = 10;
pub const NFTA_SET_TIMEOUT: u16 = 11;
pub const NFTA_SET_USERDATA: u16 = 13;
pub const NFTA_SET_DESC_SIZE: u16 = 1;
pub const NFT_SET_ANONYMOUS: u32 = 0x1;
pub const NFT_SET_CONSTANT: u32 = 0x2;
pub const NFT_SET_INTERVAL: u32 = 0x4;
pub const NFT_SET_MAP: u32 = 0x8;
pub const NFT_SET_TIMEOUT: u32 = 0x10;
pub const NFT_SET_EVAL: u32 = 0x20;
pub const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
pub const NFTA_SET_ELEM_KEY: u16 = 1;
pub const NFTA_SET_ELEM_DATA: u16 = 2;
pub const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub const NFTA_SET_ELEM_USERDATA: u16 = 6;
pub const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;
/// `NFT_DATA_VERDICT`: the data type of a verdict map.
pub const NFT_DATA_VERDICT: u32 = 0xffff_ff00;

// Data and verdicts.
pub const NFTA_DATA_VALUE: u16 = 1;
pub const NFTA_DATA_VERDICT: u16 = 2;
pub const NFTA_VERDICT_CODE: u16 = 1;
pub const NFTA_VERDICT_CHAIN: u16 = 2;
pub const NF_DROP: i32 = 0;
pub const NF_ACCEPT: i32 = 1;
pub const NFT_JUMP: i32 = -3;
pub const NFT_GOTO: i32 = -4;
pub const NFT_RETURN: i32 = -5;

// Expressions.
pub const NFTA_LIST_ELEM: u16 = 1;
pub const NFTA_EXPR_NAME: u16 = 1;
pub const NFTA_EXPR_DATA: u16 = 2;

/// Registers: `NFT_REG_VERDICT`, the 16-byte `NFT_REG_1` / `NFT_REG_2`, and `NFT_REG32_00`
/// (the first 32-bit register, the same storage as `NFT_REG_1`'s first 4 bytes).
pub const REG_VERDICT: u32 = 0;
pub const REG_1: u32 = 1;
pub const REG_2: u32 = 2;
pub const REG32_00: u32 = 8;

/// Userdata TLV types (libnftnl `udata.h`): nft stores comments and the hints `nft list` needs
/// to print keys in these.
pub const UDATA_TABLE_COMMENT: u8 = 0;
pub const UDATA_CHAIN_COMMENT: u8 = 0;
pub const UDATA_RULE_COMMENT: u8 = 0;
pub const UDATA_SET_KEYBYTEORDER: u8 = 0;
pub const UDATA_SET_DATABYTEORDER: u8 = 1;
pub const UDATA_SET_MERGE_ELEMENTS: u8 = 2;
pub const UDATA_SET_KEY_TYPEOF: u8 = 3;
pub const UDATA_SET_DATA_TYPEOF: u8 = 4;
pub const UDATA_SET_DATA_INTERVAL: u8 = 6;
pub const UDATA_SET_COMMENT: u8 = 7;
pub const UDATA_SET_TYPEOF_EXPR: u8 = 0;
pub const UDATA_SET_TYPEOF_DATA: u8 = 1;
pub const UDATA_SET_ELEM_COMMENT: u8 = 0;
pub const UDATA_SET_ELEM_FLAGS: u8 = 1;
/// `NFTNL_SET_ELEM_F_INTERVAL_OPEN`: the interval has no end element (it reaches the top).
pub const SET_ELEM_F_INTERVAL_OPEN: u32 = 0x1;

/// A growing buffer of netlink messages.
#[derive(Debug, Default)]
pub struct MsgBuf {
    pub buf: Vec<u8>,
}

fn pad(len: usize) -> usize {
    (len + 3) & !3
}

impl MsgBuf {
    pub fn with_capacity(n: usize) -> MsgBuf {
        MsgBuf {
            buf: Vec::with_capacity(n),
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Starts a message: `nlmsghdr` (length filled in by [`MsgBuf::end_msg`]) and `nfgenmsg`.
    /// Returns the message's offset.
    pub fn begin_msg(&mut self, msg_type: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&msg_type.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        // Port id 0: the kernel.
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.push(family);
        // NFNETLINK_V0
        self.buf.push(0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        start
    }

    /// Fills in the length of the message started at `start`.
    pub fn end_msg(&mut self, start: usize) {
        let len = self.buf.len() - start;
        // A netlink message longer than 4 GiB cannot be sent anyway; the kernel rejects the
        // truncated length.
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    /// ORs `flags` into the header flags of the message at `start`.
    pub fn add_msg_flags(&mut self, start: usize, flags: u16) {
        let at = start + 6;
        let old = u16::from_ne_bytes([self.buf[at], self.buf[at + 1]]);
        self.buf[at..at + 2].copy_from_slice(&(old | flags).to_ne_bytes());
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

    /// A big-endian u32 attribute (nf_tables' integers are network order on the wire).
    pub fn put_u32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_be_bytes());
    }

    pub fn put_u64(&mut self, ty: u16, v: u64) {
        self.put(ty, &v.to_be_bytes());
    }

    /// A NUL-terminated string attribute.
    pub fn put_str(&mut self, ty: u16, s: &str) {
        let len = 4 + s.len() + 1;
        self.buf
            .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.buf.resize(self.buf.len() + pad(len) - len, 0);
    }

    /// Starts a nested attribute (flagged `NLA_F_NESTED`, as libmnl does); returns its offset.
    pub fn nest_start(&mut self, ty: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        start
    }

    /// Closes the nest started at `start`. Callers keep nests under 64 KiB (element lists are
    /// split into several messages for that); an oversized nest gets a length the kernel
    /// rejects rather than a wrapped one.
    pub fn nest_end(&mut self, start: usize) {
        let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// libnftnl's userdata: a sequence of (type u8, length u8, value) TLVs.
#[derive(Debug, Default)]
pub struct Udata {
    pub buf: Vec<u8>,
}

impl Udata {
    pub fn new() -> Udata {
        Udata::default()
    }

    pub fn put(&mut self, ty: u8, value: &[u8]) -> &mut Udata {
        self.buf.push(ty);
        // Values are comments (checked to be at most 128 bytes) and small integers.
        self.buf.push(u8::try_from(value.len()).unwrap_or(u8::MAX));
        self.buf.extend_from_slice(value);
        self
    }

    /// A u32 in host byte order, as `nftnl_udata_put_u32` stores it.
    pub fn put_u32(&mut self, ty: u8, v: u32) -> &mut Udata {
        self.put(ty, &v.to_ne_bytes())
    }

    /// A NUL-terminated string.
    pub fn put_str(&mut self, ty: u8, s: &str) -> &mut Udata {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.put(ty, &v)
    }

    /// A nested TLV list.
    pub fn put_nested(&mut self, ty: u8, inner: &Udata) -> &mut Udata {
        self.put(ty, &inner.buf)
    }

    /// A userdata holding one comment TLV.
    pub fn comment(ty: u8, comment: &str) -> Udata {
        let mut u = Udata::new();
        u.put_str(ty, comment);
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nests_flagged() {
        let mut b = MsgBuf::default();
        let start = b.begin_msg(nft_type(NFT_MSG_NEWTABLE), NLM_F_REQUEST, 7, NFPROTO_IPV4, 0);
        b.put_str(NFTA_TABLE_NAME, "ab");
        let n = b.nest_start(NFTA_CHAIN_HOOK);
        b.put_u32(NFTA_HOOK_HOOKNUM, 1);
        b.nest_end(n);
        b.end_msg(start);
        let expected: Vec<u8> = [
            &[40u8, 0, 0, 0, 0, 10, 1, 0, 7, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0][..],
            &[7, 0, 1, 0, b'a', b'b', 0, 0],
            &[12, 0, 4, 0x80, 8, 0, 1, 0, 0, 0, 0, 1],
        ]
        .concat();
        assert_eq!(b.buf, expected);
    }
}
