//! The thin edge: a `NETLINK_NETFILTER` socket that sends one encoded batch per transaction in
//! a single `send` and reads back what the kernel said about it.
//!
//! The kernel processes a batch synchronously inside `sendmsg` and queues its replies on our
//! socket before `send` returns: an error for each message that failed (the whole batch is then
//! aborted) and an acknowledgement for the last command message, which is the only one that
//! asks for it. So after `send` the replies are drained without blocking, and the batch
//! committed iff none of them is an error.

use std::io;
use std::os::fd::AsFd;

use netlink_sys::Socket;
use nix::errno::Errno;
use nix::sys::socket::{setsockopt, sockopt};

use super::decode::{self, Undecoded};
use super::encode::{self, AnonSetNames, CheckError, EncodedBatch};
use super::wire::*;
use crate::model::IpFamily;
use crate::netlink::{self, MsgBuf, NLM_F_ACK, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR};
use crate::nftables::ast::ElemKey;
use crate::nftables::ast::Transaction;
use crate::nftables::backend::TableObjects;
use crate::nftables::names::TABLE;
use crate::nftables::ruleset::Ruleset;

/// Receive buffer to start with; raised for big batches (errors come one datagram per failed
/// message).
const MIN_RCVBUF: usize = 1 << 20;
/// Upper bound for the receive buffer: beyond it, lost replies are reported as such.
const MAX_RCVBUF: usize = 64 << 20;
/// Bytes reserved in the receive buffer per command message of a batch.
const RCVBUF_PER_MESSAGE: usize = 1024;
/// A reply datagram is small (an error with a capped echo and an extack text); this leaves
/// room for a table listing in `table_exists`.
const RECV_BUFFER: usize = 64 << 10;

/// One message of a batch that the kernel refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpFailure {
    /// Index of the op in the transaction (`None` for the batch framing itself).
    pub index: Option<usize>,
    /// The op's `nft -f` line (or "batch").
    pub op: String,
    pub errno: Errno,
    /// The kernel's extended-ack message, if it gave one.
    pub message: Option<String>,
}

impl std::fmt::Display for OpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Errno prints as "ENOENT: No such file or directory".
        match self.index {
            Some(i) => write!(f, "op {i} `{}`: {}", self.op, self.errno)?,
            None => write!(f, "{}: {}", self.op, self.errno)?,
        }
        if let Some(m) = &self.message {
            write!(f, ": {m}")?;
        }
        Ok(())
    }
}

/// Why a transaction was not applied.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// Refused before sending (see [`encode::check`]); nothing was sent.
    #[error("invalid nftables transaction: {0}")]
    Invalid(#[from] CheckError),
    /// The socket failed; for a failed send nothing was applied.
    #[error("nftables netlink socket: {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// The kernel refused the batch (nothing of it was applied). `failures` lists every
    /// refused message in batch order; the first is usually the cause.
    #[error("nftables refused the {family} transaction ({messages} messages), {}", describe(failures, *lost))]
    Rejected {
        family: IpFamily,
        messages: usize,
        failures: Vec<OpFailure>,
        /// Replies were lost to a full receive buffer (so some failures may be missing).
        lost: bool,
    },
    /// Neither an error nor the acknowledgement came back: the outcome is unknown.
    #[error("nftables sent no reply to a {family} transaction of {messages} messages")]
    NoReply { family: IpFamily, messages: usize },
}

fn describe(failures: &[OpFailure], lost: bool) -> String {
    let mut s = match failures.split_first() {
        Some((first, [])) => first.to_string(),
        Some((first, rest)) => format!("{first} (and {} more refused messages)", rest.len()),
        None => "no error reply kept".to_string(),
    };
    if lost {
        s.push_str("; some replies were lost (receive buffer full)");
    }
    s
}

impl NetlinkError {
    /// The errno of the first failure, if the kernel refused the batch.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            NetlinkError::Rejected { failures, .. } => failures.first().map(|f| f.errno),
            NetlinkError::Io { source, .. } => source.raw_os_error().map(Errno::from_raw),
            _ => None,
        }
    }
}

/// Where a socket takes anonymous-set numbers from.
#[derive(Debug)]
enum Names {
    /// The process-wide counter ([`encode::encode`]'s).
    Process,
    Own(AnonSetNames),
}

/// A netfilter netlink socket for the `kube-proxy` tables. It belongs to the network namespace
/// of the thread that created it, for its whole life.
#[derive(Debug)]
pub struct NftSocket {
    socket: Socket,
    seq: u32,
    sndbuf: usize,
    rcvbuf: usize,
    names: Names,
    buf: Vec<u8>,
}

fn io_err(context: &str) -> impl FnOnce(io::Error) -> NetlinkError + '_ {
    move |source| NetlinkError::Io {
        context: context.to_string(),
        source,
    }
}

impl NftSocket {
    /// Opens the socket (sending needs CAP_NET_ADMIN) with extended acks (the kernel's error
    /// text) and capped acks (no echo of our message in error replies).
    pub fn new() -> io::Result<NftSocket> {
        let socket = netlink::netfilter_socket()?;
        socket.set_ext_ack(true)?;
        socket.set_cap_ack(true)?;
        let mut s = NftSocket {
            socket,
            // Like nft, start from the clock, so that replies to another run never match.
            seq: u32::try_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs() & 0xffff_ffff)
                    .unwrap_or(0),
            )
            .unwrap_or(0),
            sndbuf: 0,
            rcvbuf: 0,
            names: Names::Process,
            buf: vec![0; RECV_BUFFER],
        };
        // Best effort here: without CAP_NET_ADMIN this fails, and so will every request, with
        // a clearer error from `apply` (which raises the buffers again).
        let _ = s.raise_rcvbuf(MIN_RCVBUF);
        Ok(s)
    }

    /// Numbers this socket's anonymous sets from `start` on instead of the process-wide,
    /// time-based counter (see [`AnonSetNames`]).
    pub fn set_anon_set_start(&mut self, start: u64) {
        self.names = Names::Own(AnonSetNames::starting_at(start));
    }

    fn raise_rcvbuf(&mut self, want: usize) -> io::Result<()> {
        let want = want.clamp(MIN_RCVBUF, MAX_RCVBUF);
        if want > self.rcvbuf {
            // The FORCE variant ignores net.core.rmem_max (we run with CAP_NET_ADMIN).
            setsockopt(&self.socket.as_fd(), sockopt::RcvBufForce, &want).map_err(io::Error::from)?;
            self.rcvbuf = want;
        }
        Ok(())
    }

    /// A batch must go in one `sendmsg`, and the kernel refuses a message larger than the
    /// send buffer (EMSGSIZE): raise it past `net.core.wmem_max` when needed.
    fn raise_sndbuf(&mut self, len: usize) -> io::Result<()> {
        // The kernel doubles the value and keeps 32 bytes of it for itself.
        let want = len.saturating_add(4096);
        if want > self.sndbuf {
            setsockopt(&self.socket.as_fd(), sockopt::SndBufForce, &want).map_err(io::Error::from)?;
            self.sndbuf = want;
        }
        Ok(())
    }

    /// Applies `tx` atomically: all of it, or (on error) none of it. An empty transaction
    /// sends nothing.
    pub fn apply(&mut self, tx: &Transaction) -> Result<(), NetlinkError> {
        if tx.is_empty() {
            return Ok(());
        }
        encode::check(tx)?;
        let first_seq = self.seq;
        let batch = match &mut self.names {
            Names::Process => encode::encode(tx, first_seq),
            Names::Own(names) => encode::encode_with(tx, first_seq, names),
        };
        self.seq = batch.end_seq().wrapping_add(1);
        let describe = |i: usize| tx.ops.get(i).map(|op| op_text(tx.family, op));
        self.send_batch(tx.family, &batch, &describe)
    }

    /// Applies the transactions `parts` yields as one batch, encoding each as it comes (so
    /// that the caller never holds all of them): all of it, or (on error) none of it. A
    /// refused op is named by its part and its index there, and its text when the part was
    /// the first (later parts are gone by then).
    pub fn apply_parts(
        &mut self,
        family: IpFamily,
        parts: &mut dyn Iterator<Item = Transaction>,
    ) -> Result<(), NetlinkError> {
        let first_seq = self.seq;
        // This batch's own counter, moved past what the process-wide one had handed out, and
        // the other way round afterwards (anonymous sets only need names unique per table).
        let mut names = match &self.names {
            Names::Process => encode::with_process_names(|n| AnonSetNames::starting_at(n.peek())),
            Names::Own(n) => n.clone(),
        };
        let mut starts: Vec<usize> = Vec::new();
        let mut first: Option<Transaction> = None;
        let mut enc = encode::BatchEncoder::new(family, first_seq, &mut names, 1 << 20);
        for part in parts {
            encode::check(&part).map_err(|mut e| {
                e.text = format!("part {}, {}", starts.len(), e.text);
                e.index += enc.ops();
                e
            })?;
            starts.push(enc.ops());
            enc.push(&part);
            if first.is_none() {
                first = Some(part);
            }
        }
        let batch = enc.finish();
        match &mut self.names {
            Names::Process => encode::with_process_names(|n| n.advance_to(names.peek())),
            Names::Own(n) => *n = names,
        }
        if batch.messages() == 0 {
            return Ok(());
        }
        self.seq = batch.end_seq().wrapping_add(1);
        let describe = |i: usize| {
            let part = starts.partition_point(|&s| s <= i).saturating_sub(1);
            let at = i - starts.get(part).copied().unwrap_or(0);
            match (part, &first) {
                (0, Some(tx)) => tx.ops.get(at).map(|op| op_text(family, op)),
                _ => Some(format!("part {part}, op {at}")),
            }
        };
        self.send_batch(family, &batch, &describe)
    }

    fn send_batch(
        &mut self,
        family: IpFamily,
        batch: &EncodedBatch,
        describe: &dyn Fn(usize) -> Option<String>,
    ) -> Result<(), NetlinkError> {
        self.raise_sndbuf(batch.bytes.len())
            .map_err(io_err("raising SO_SNDBUF (SO_SNDBUFFORCE)"))?;
        self.raise_rcvbuf(batch.messages().saturating_mul(RCVBUF_PER_MESSAGE))
            .map_err(io_err("raising SO_RCVBUF (SO_RCVBUFFORCE)"))?;
        // Replies left over from an earlier, interrupted call must not be taken for ours.
        self.drain(|_| {}).map_err(io_err("discarding stale replies"))?;
        self.send(&batch.bytes).map_err(io_err("sending the batch"))?;

        let last_seq = batch.end_seq().wrapping_sub(1);
        let mut failures = Vec::new();
        let mut acked = false;
        let drained = self.drain(|reply| {
            let Reply::Error { seq, errno, message } = reply else {
                return;
            };
            // Only replies to this batch count (its sequence numbers are a contiguous range).
            if seq.wrapping_sub(batch.first_seq) > batch.end_seq().wrapping_sub(batch.first_seq) {
                return;
            }
            if errno == 0 {
                acked |= seq == last_seq;
                return;
            }
            let index = batch.op_index(seq);
            let op = index.and_then(describe).unwrap_or_else(|| "batch".to_string());
            failures.push(OpFailure {
                index,
                op,
                errno: Errno::from_raw(errno.saturating_abs()),
                message,
            });
        });
        let lost = match drained {
            Ok(()) => false,
            // The kernel dropped replies: only errors are numerous enough for that.
            Err(e) if e.raw_os_error() == Some(Errno::ENOBUFS as i32) => true,
            Err(e) => return Err(io_err("reading the replies")(e)),
        };
        if !failures.is_empty() || lost {
            return Err(NetlinkError::Rejected {
                family,
                messages: batch.messages(),
                failures,
                lost,
            });
        }
        if !acked {
            return Err(NetlinkError::NoReply {
                family,
                messages: batch.messages(),
            });
        }
        Ok(())
    }

    /// The chains and named sets of the family's `kube-proxy` table (`GETCHAIN` and `GETSET`
    /// dumps); `None` when there is no table.
    pub fn objects(&mut self, family: IpFamily) -> io::Result<Option<TableObjects>> {
        if !self.table_exists(family)? {
            return Ok(None);
        }
        let mut objects = TableObjects::default();
        // After the netlink header and the nfgenmsg, the attributes.
        let attrs = |m: &[u8]| m.get(netlink::NLMSG_HDRLEN + 4..).unwrap_or_default().to_vec();
        for (_, m) in self.dump(family, NFT_MSG_GETCHAIN, |_| {})? {
            objects.chains.extend(super::objects::chain(&attrs(&m)));
        }
        // A set dump filters by table.
        for (_, m) in self.dump(family, NFT_MSG_GETSET, |b| b.put_str(NFTA_SET_TABLE, TABLE))? {
            objects.sets.extend(super::objects::set(&attrs(&m)));
        }
        Ok(Some(objects))
    }

    /// Whether `table <family> kube-proxy` exists (NFT_MSG_GETTABLE).
    pub fn table_exists(&mut self, family: IpFamily) -> io::Result<bool> {
        self.exists(family, TABLE, None)
    }

    /// Whether chain `chain` of table `table` exists in `family` (NFT_MSG_GETCHAIN): one
    /// message, where the tools (`nft list`, `iptables-nft-save`) fetch the whole ruleset
    /// first (seconds on a node with 10k Services in iptables mode).
    pub fn chain_exists(&mut self, family: IpFamily, table: &str, chain: &str) -> io::Result<bool> {
        self.exists(family, table, Some(chain))
    }

    /// Whether the table, or its chain, exists.
    fn exists(&mut self, family: IpFamily, table: &str, chain: Option<&str>) -> io::Result<bool> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let (get, new) = match chain {
            None => (NFT_MSG_GETTABLE, NFT_MSG_NEWTABLE),
            Some(_) => (NFT_MSG_GETCHAIN, NFT_MSG_NEWCHAIN),
        };
        let mut b = MsgBuf::default();
        let m = b.begin_msg(
            nft_type(get),
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            &nfgenmsg(encode::nfproto(family), 0),
        );
        match chain {
            None => b.put_str(NFTA_TABLE_NAME, table),
            Some(chain) => {
                b.put_str(NFTA_CHAIN_TABLE, table);
                b.put_str(NFTA_CHAIN_NAME, chain);
            }
        }
        b.end_msg(m);
        self.drain(|_| {})?;
        self.send(&b.buf)?;
        let mut found = false;
        let mut error = None;
        self.drain(|reply| match reply {
            Reply::Other { seq: s, msg_type } if s == seq && msg_type == nft_type(new) => found = true,
            Reply::Error { seq: s, errno, message } if s == seq && errno != 0 => error = Some((errno, message)),
            _ => {}
        })?;
        match error {
            None => Ok(found),
            Some((e, _)) if e.saturating_abs() == Errno::ENOENT as i32 => Ok(false),
            Some((e, message)) => {
                let errno = Errno::from_raw(e.saturating_abs());
                Err(io::Error::new(
                    io::Error::from(errno).kind(),
                    format!(
                        "getting {table}{}: {errno}{}",
                        chain.map(|c| format!(" chain {c}")).unwrap_or_default(),
                        message.map(|m| format!(": {m}")).unwrap_or_default()
                    ),
                ))
            }
        }
    }

    fn send(&self, bytes: &[u8]) -> io::Result<()> {
        netlink::send(&self.socket, bytes)
    }

    /// A request of `msg` for the family's objects, with the attributes `put` adds.
    fn request(&mut self, family: IpFamily, msg: u16, dump: bool, put: impl FnOnce(&mut MsgBuf)) -> (u32, Vec<u8>) {
        self.seq = self.seq.wrapping_add(1);
        let flags = if dump {
            NLM_F_REQUEST | netlink::NLM_F_DUMP
        } else {
            NLM_F_REQUEST
        };
        let mut b = MsgBuf::default();
        let m = b.begin_msg(nft_type(msg), flags, self.seq, &nfgenmsg(encode::nfproto(family), 0));
        put(&mut b);
        b.end_msg(m);
        (self.seq, b.buf)
    }

    fn dump(&mut self, family: IpFamily, msg: u16, put: impl FnOnce(&mut MsgBuf)) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let (seq, req) = self.request(family, msg, true, put);
        Ok(netlink::dump(&self.socket, &mut self.buf, &req, seq)?.messages)
    }

    /// Reads the family's `kube-proxy` table back: all of it, or only `chains` and `maps`
    /// (with the anonymous sets their rules use). `None` when the table does not exist.
    pub fn read(&mut self, family: IpFamily, scope: &ReadScope) -> io::Result<Option<(Ruleset, Vec<Undecoded>)>> {
        if !self.table_exists(family)? {
            return Ok(None);
        }
        let table = |b: &mut MsgBuf, ty| b.put_str(ty, TABLE);
        let mut messages = vec![(nft_type(NFT_MSG_NEWTABLE), Vec::new())];
        let sets = self.dump(family, NFT_MSG_GETSET, |b| table(b, NFTA_SET_TABLE))?;
        let (chains, rules) = match scope {
            ReadScope::Whole => {
                let chains = self.dump(family, NFT_MSG_GETCHAIN, |b| table(b, NFTA_CHAIN_TABLE))?;
                let rules = self.dump(family, NFT_MSG_GETRULE, |b| table(b, NFTA_RULE_TABLE))?;
                (chains, rules)
            }
            ReadScope::Some { chains, .. } => {
                let (mut found, mut rules) = (Vec::new(), Vec::new());
                for name in chains {
                    let (seq, req) = self.request(family, NFT_MSG_GETCHAIN, false, |b| {
                        b.put_str(NFTA_CHAIN_TABLE, TABLE);
                        b.put_str(NFTA_CHAIN_NAME, name);
                    });
                    if let Some(c) = netlink::get(&self.socket, &mut self.buf, &req, seq)? {
                        found.push((nft_type(NFT_MSG_NEWCHAIN), c));
                        rules.extend(self.dump(family, NFT_MSG_GETRULE, |b| {
                            b.put_str(NFTA_RULE_TABLE, TABLE);
                            b.put_str(NFTA_RULE_CHAIN, name);
                        })?);
                    }
                }
                (found, rules)
            }
        };
        // Elements: of every set, or of the maps asked for and the rules' anonymous sets.
        let wanted: Vec<String> = match scope {
            ReadScope::Whole => sets
                .iter()
                .filter_map(|(_, m)| decode::set(m, family))
                .map(|s| s.decl.name)
                .collect(),
            ReadScope::Some { maps, .. } => {
                let mut w = maps.clone();
                for (_, m) in &rules {
                    w.extend(decode::rule(m).map(|r| r.sets()).unwrap_or_default());
                }
                w
            }
        };
        // Name, whether with intervals, key length.
        let present: Vec<(String, bool, u32)> = sets
            .iter()
            .filter_map(|(_, m)| decode::set(m, family))
            .map(|s| {
                let key_len = encode::set_signature(family, &s.decl).key_len;
                (s.decl.name.clone(), s.decl.interval(), key_len)
            })
            .collect();
        let interval = |name: &str| present.iter().find(|(n, ..)| n == name).map(|(_, i, _)| *i);
        let mut by_key: Vec<(&str, Vec<&ElemKey>)> = Vec::new();
        let mut wanted = wanted;
        if let ReadScope::Some { keyed, .. } = scope {
            for (name, keys) in keyed {
                match present.iter().find(|(n, ..)| n == name) {
                    // Keys of another shape are not in the set (the kernel would refuse them).
                    Some((_, false, len)) => by_key.push((
                        name,
                        keys.iter()
                            .filter(|k| encode::key_bytes(k).len() == *len as usize)
                            .collect(),
                    )),
                    Some((_, true, _)) => wanted.push(name.clone()),
                    None => {}
                }
            }
        }
        messages.extend(chains);
        messages.extend(sets);
        let mut dumped: Vec<&str> = Vec::new();
        for name in wanted.iter().filter(|n| interval(n).is_some()) {
            if dumped.contains(&name.as_str()) {
                continue;
            }
            dumped.push(name);
            messages.extend(self.dump(family, NFT_MSG_GETSETELEM, |b| {
                b.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                b.put_str(NFTA_SET_ELEM_LIST_SET, name);
            })?);
        }
        for (name, keys) in by_key.into_iter().filter(|(n, _)| !dumped.contains(n)) {
            for key in keys {
                messages.extend(self.element(family, name, key)?);
            }
        }
        messages.extend(rules);
        Ok(Some(decode::table(family, &messages)))
    }

    /// The element of `key` in the set `set` (`GETSETELEM` with that key), if it is there.
    fn element(&mut self, family: IpFamily, set: &str, key: &ElemKey) -> io::Result<Option<(u16, Vec<u8>)>> {
        let (seq, req) = self.request(family, NFT_MSG_GETSETELEM, false, |b| {
            b.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
            b.put_str(NFTA_SET_ELEM_LIST_SET, set);
            let list = b.nest_start(NFTA_SET_ELEM_LIST_ELEMENTS);
            let elem = b.nest_start(1);
            let k = b.nest_start(NFTA_SET_ELEM_KEY);
            b.put(NFTA_DATA_VALUE, &encode::key_bytes(key));
            b.nest_end(k);
            b.nest_end(elem);
            b.nest_end(list);
        });
        let reply = netlink::get(&self.socket, &mut self.buf, &req, seq)?;
        Ok(reply.map(|m| (nft_type(NFT_MSG_NEWSETELEM), m)))
    }

    /// Reads every queued datagram without blocking, handing each message to `each`.
    fn drain(&mut self, mut each: impl FnMut(Reply)) -> io::Result<()> {
        netlink::drain(&self.socket, &mut self.buf, |datagram| {
            for reply in parse_replies(datagram) {
                each(reply);
            }
        })
    }
}

/// What [`NftSocket::read`] reads of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadScope {
    Whole,
    /// These chains (their rules) and maps (their elements), and of the sets in `keyed` the
    /// elements of these keys only (one `GETSETELEM` each: a port's few elements of sets of
    /// 100,000 at 10,000 Services × 10 endpoints; a set with intervals is read whole).
    Some {
        chains: Vec<String>,
        maps: Vec<String>,
        keyed: Vec<(String, Vec<ElemKey>)>,
    },
}

/// An op's `nft -f` line, for an error.
fn op_text(family: IpFamily, op: &crate::nftables::ast::Op) -> String {
    let mut text = String::new();
    op.write_text(family, &mut text);
    text.trim_end().to_string()
}

/// One netlink message of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `NLMSG_ERROR`: `errno` 0 is an acknowledgement. `seq` is the request's.
    Error {
        seq: u32,
        errno: i32,
        message: Option<String>,
    },
    Other {
        seq: u32,
        msg_type: u16,
    },
}

/// Splits a datagram into messages; stops at the first malformed one (and skips an error
/// message too short to say what it answers).
pub fn parse_replies(data: &[u8]) -> Vec<Reply> {
    let mut out = Vec::new();
    for m in netlink::messages(data).map_while(Result::ok) {
        match m.msg_type {
            NLMSG_ERROR => {
                if let Ok(e) = netlink::parse_error(&m) {
                    out.push(Reply::Error {
                        seq: e.seq,
                        errno: e.errno,
                        message: e.message,
                    });
                }
            }
            NLMSG_DONE => {}
            msg_type => out.push(Reply::Other { seq: m.seq, msg_type }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{NLM_F_ACK_TLVS, NLM_F_CAPPED};

    #[test]
    fn parses_a_capped_error_with_extack() {
        // NLMSG_ERROR, flags CAPPED|ACK_TLVS, error -ENOENT, echoed header (seq 42), then
        // NLMSGERR_ATTR_MSG "no chain" and NLMSGERR_ATTR_OFFS.
        let mut m = Vec::new();
        let body_len = 16 + 4 + 16 + 4 + 12 + 8;
        m.extend_from_slice(&(body_len as u32).to_ne_bytes());
        m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m.extend_from_slice(&(NLM_F_CAPPED | NLM_F_ACK_TLVS).to_ne_bytes());
        m.extend_from_slice(&42u32.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&(-2i32).to_ne_bytes());
        m.extend_from_slice(&64u32.to_ne_bytes());
        m.extend_from_slice(&nft_type(NFT_MSG_NEWRULE).to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&42u32.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[13, 0, 1, 0]);
        m.extend_from_slice(b"no chain\0\0\0\0");
        m.extend_from_slice(&[8, 0, 2, 0, 36, 0, 0, 0]);
        assert_eq!(m.len(), body_len);
        assert_eq!(
            parse_replies(&m),
            vec![Reply::Error {
                seq: 42,
                errno: -2,
                message: Some("no chain".into())
            }]
        );
        // A truncated datagram yields what is complete and no panic.
        assert!(parse_replies(&m[..10]).is_empty());
    }
}
