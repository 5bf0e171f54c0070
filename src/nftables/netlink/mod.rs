//! nftables over netlink, without the `nft` binary: owns the translation of a
//! [`Transaction`](crate::nftables::ast::Transaction) into one nfnetlink batch and the socket
//! that sends it.
//!
//! Why: `nft -f` lists every chain of the table before it sends anything (about 1 s per change
//! at 110k chains, see FLOOR.md); a batch sent directly pays only the kernel's own work.
//!
//! - [`encode()`] (pure): the batch bytes, built message for message as nft 1.0.6 builds them for
//!   the transaction's text form (`tx.text()`), so that `nft list table` prints the same thing
//!   whichever way the transaction went in; plus, for each message, the op it came from. The
//!   few deliberate differences (sequence numbers, one ACK, concrete anonymous-set names, set
//!   ids) are listed on [`encode()`].
//! - [`NftSocket`] (the edge): one `send` per transaction, then the kernel's verdict, with the
//!   failing op's text, errno and extack message in [`NetlinkError`].
//!
//! Submodules: `wire` (the nfnetlink header, userdata and constants; the framing is
//! [`crate::netlink`]'s), `expr` (rule expressions), `encode`
//! (ops → messages, anonymous sets, validation), `socket`.

pub mod decode;
mod encode;
mod expr;
mod objects;
mod socket;
pub(crate) mod wire;

#[cfg(test)]
mod fixtures;

pub use decode::udata_get;
pub use encode::{
    AnonSetNames, BatchEncoder, CheckError, EncodedBatch, MAX_COMMENT, check, encode, encode_with, key_bytes, nfproto,
    set_signature, with_process_names,
};
pub use socket::{NetlinkError, NftSocket, OpFailure, ReadScope, Reply, parse_replies};
