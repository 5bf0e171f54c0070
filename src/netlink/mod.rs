//! Netlink framing shared by every backend that talks to the kernel over netlink (IPVS over
//! generic netlink, nftables and conntrack over nfnetlink): what `linux/netlink.h` defines and
//! no family adds to.
//!
//! - `msg` (pure): [`MsgBuf`], messages being built: `nlmsghdr` and the family's fixed header,
//!   attributes with their 4-byte padding, nests.
//! - `parse` (pure): a datagram split into [`RawMsg`]s, attributes read back ([`Attrs`]), and
//!   the kernel's `NLMSG_ERROR` ([`ErrorReply`]: errno, echoed sequence number, extack text),
//!   none of it trusting a length.
//! - `socket`: opening a `NETLINK_NETFILTER` socket; sending and receiving datagrams on a
//!   `netlink_sys::Socket`, interrupted calls retried; a whole dump read ([`dump`]).
//!
//! What a family puts in its messages (genetlink's or nfnetlink's header, nftables' batches,
//! the kernel's constants of that family) stays in the family's own `wire` module.

mod msg;
mod parse;
mod socket;
#[cfg(test)]
pub(crate) mod testing;

pub use msg::MsgBuf;
pub use parse::{
    Attrs, ErrorReply, RawMsg, attributes_of, messages, parse_error, read_i32, read_u16, read_u32, split_messages,
};
pub use socket::{Channel, Dumped, drain, dump, get, netfilter_socket, recv, send};

/// Netlink header flags (`linux/netlink.h`).
pub const NLM_F_REQUEST: u16 = 0x1;
/// Set on every part of a dump.
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
/// Set on the parts of a dump when the table changed while it was being dumped.
pub const NLM_F_DUMP_INTR: u16 = 0x10;
/// `NLM_F_ROOT | NLM_F_MATCH`.
pub const NLM_F_DUMP: u16 = 0x300;
/// Flags of a `NEW` request.
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
/// Error-reply flags: the echoed request was trimmed to its header / TLVs (extack) follow.
pub const NLM_F_CAPPED: u16 = 0x100;
pub const NLM_F_ACK_TLVS: u16 = 0x200;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLMSG_HDRLEN: usize = 16;
/// `NLMSGERR_ATTR_MSG`: the extack text in an error reply.
pub const NLMSGERR_ATTR_MSG: u16 = 1;

pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_TYPE_MASK: u16 = 0x3fff;

/// Messages and attributes are aligned to 4 bytes (`NLMSG_ALIGN`, `NLA_ALIGN`).
pub fn align(len: usize) -> usize {
    len.saturating_add(3) & !3
}

/// A kernel message that cannot be read: malformed, or not what the family's decoder expects.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{0} truncated")]
    Truncated(&'static str),
    #[error("attribute {0} missing")]
    Missing(&'static str),
    #[error("attribute {attr} has {len} bytes")]
    Length { attr: &'static str, len: usize },
    #[error("attribute {0} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("unknown address family {0}")]
    Family(u16),
    #[error("unknown protocol {0}")]
    Protocol(u16),
    /// A message of another type, or (generic netlink) with another command, than the one
    /// expected.
    #[error("unexpected reply: netlink type {msg_type:#x}, command {cmd}")]
    Unexpected { msg_type: u16, cmd: u8 },
}
