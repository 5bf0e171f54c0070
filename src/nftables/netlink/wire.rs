//! The netlink wire format as nf_tables uses it: the `nfgenmsg` after `nlmsghdr`, libnftnl's
//! userdata TLVs, and the kernel's numeric constants (from `linux/netfilter/nf_tables.h`,
//! `linux/netfilter/nfnetlink.h` and libnftnl's userdata TLV types). The framing itself
//! (headers, attributes, nests) is [`crate::netlink`]'s; what to append is `encode`'s and
//! `expr`'s business.

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
pub const NFT_MSG_GETCHAIN: u16 = 4;
pub const NFT_MSG_DELCHAIN: u16 = 5;
pub const NFT_MSG_NEWRULE: u16 = 6;
pub const NFT_MSG_DELRULE: u16 = 8;
pub const NFT_MSG_NEWSET: u16 = 9;
pub const NFT_MSG_GETSET: u16 = 10;
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

/// `nfgenmsg`, the header after `nlmsghdr` of every nfnetlink message: the family, version
/// `NFNETLINK_V0`, and the resource id (the subsystem, on batch messages) in network order.
pub fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let [hi, lo] = res_id.to_be_bytes();
    [family, 0, hi, lo]
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
    use crate::netlink::{MsgBuf, NLM_F_REQUEST};

    #[test]
    fn attributes_are_padded_and_nests_flagged() {
        let mut b = MsgBuf::default();
        let start = b.begin_msg(nft_type(NFT_MSG_NEWTABLE), NLM_F_REQUEST, 7, &nfgenmsg(NFPROTO_IPV4, 0));
        b.put_str(NFTA_TABLE_NAME, "ab");
        let n = b.nest_start(NFTA_CHAIN_HOOK);
        b.put_be32(NFTA_HOOK_HOOKNUM, 1);
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
