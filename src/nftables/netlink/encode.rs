//! A [`Transaction`] → the bytes of one nfnetlink batch, message for message as nft 1.0.6
//! builds them for the same `nft -f` input (same attributes, order, flags and userdata), except
//! where documented on [`encode`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use super::expr::{self, AnonRef, IFNAMSIZ, RuleRefs, addr_bytes, proto_number};
use super::wire::*;
use crate::model::{IpFamily, Protocol};
use crate::netlink::{MsgBuf, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST};
use crate::nftables::ast::{
    AddrSpec, ChainDecl, ElemKey, ElemValue, Element, KeyType, MapValue, Match, Op, Rule, SetDecl, Statement,
    Transaction, Verdict,
};
use crate::nftables::backend::SetSignature;
use crate::nftables::names::TABLE;

/// nft's data type ids (`enum datatypes`), as sent in `NFTA_SET_KEY_TYPE`.
pub(super) const TYPE_INTEGER: u32 = 4;
pub(super) const TYPE_IPADDR: u32 = 7;
pub(super) const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
/// Bits per component in a concatenation's type id.
pub(super) const TYPE_BITS: u32 = 6;

/// nft's expression type ids and payload template ids, as stored in a set's "typeof" userdata.
const EXPR_VERDICT: u32 = 1;
const EXPR_PAYLOAD: u32 = 7;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;
/// `NFT_NG_RANDOM`, as nft stores it in a numgen "typeof".
const NG_RANDOM: u32 = 1;
/// nft's protocol descriptions of TCP, UDP and SCTP, and their destination port field.
pub(super) const PROTO_DESC_UDP: u32 = 6;
pub(super) const PROTO_DESC_TCP: u32 = 8;
pub(super) const PROTO_DESC_SCTP: u32 = 10;
const L4HDR_DPORT: u32 = 2;
const PROTO_DESC_IP: u32 = 12;
const PROTO_DESC_IP6: u32 = 13;
const IPHDR_SADDR: u32 = 11;
const IPHDR_DADDR: u32 = 12;
const IP6HDR_SADDR: u32 = 8;
const IP6HDR_DADDR: u32 = 9;

/// nft's `enum byteorder`.
const BYTEORDER_INVALID: u32 = 0;
const BYTEORDER_HOST_ENDIAN: u32 = 1;
const BYTEORDER_BIG_ENDIAN: u32 = 2;

/// Longest comment nft accepts (`NFTNL_UDATA_COMMENT_MAXLEN`).
pub const MAX_COMMENT: usize = 128;

/// Element lists are split over several messages so that the nested list stays well under the
/// 64 KiB an attribute length can describe (nft splits the same way, at a similar size).
const MAX_ELEMENTS_NEST: usize = 60 * 1024;

/// One encoded batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedBatch {
    /// `NFNL_MSG_BATCH_BEGIN`, the command messages, `NFNL_MSG_BATCH_END`.
    pub bytes: Vec<u8>,
    /// Sequence number of `NFNL_MSG_BATCH_BEGIN`; command messages follow it one by one.
    pub first_seq: u32,
    /// For each command message, in order (sequence `first_seq + 1 + i`), the index of the
    /// [`Op`] in the transaction it came from.
    pub op_of_message: Vec<usize>,
}

impl EncodedBatch {
    /// The index of the op whose message had sequence number `seq`.
    pub fn op_index(&self, seq: u32) -> Option<usize> {
        let i = seq.wrapping_sub(self.first_seq).checked_sub(1)?;
        self.op_of_message.get(usize::try_from(i).ok()?).copied()
    }

    /// Number of command messages (without the batch framing).
    pub fn messages(&self) -> usize {
        self.op_of_message.len()
    }

    /// Sequence number of the batch end; the next batch may start after it.
    pub fn end_seq(&self) -> u32 {
        self.first_seq
            .wrapping_add(u32::try_from(self.op_of_message.len()).unwrap_or(u32::MAX))
            .wrapping_add(1)
    }
}

/// Where the numbers in anonymous-set names come from.
///
/// nft names anonymous sets `__set%d` / `__map%d` and lets the kernel pick the number, which it
/// does by parsing the name of every set in the table: O(sets) per anonymous set, O(n²) for a
/// cold load (see FLOOR.md). We name them ourselves, `__set<N>` / `__map<N>`, with `N` from one
/// counter. The kernel still refuses a name that is taken (ENFILE), so `N` must not repeat
/// names left in the table by an earlier process (ours, or nft's small numbers): by default a
/// process starts counting at the current time in microseconds since the Unix epoch, which a
/// previous process could only have reached by creating more than one anonymous set per
/// microsecond of its whole life. `nft list` never shows these names (anonymous sets print
/// inline).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnonSetNames {
    next: u64,
}

impl AnonSetNames {
    /// Counting from `start` (tests, or a caller that knows the table's state).
    pub fn starting_at(start: u64) -> AnonSetNames {
        AnonSetNames { next: start }
    }

    /// Counting from the current time in microseconds since the Unix epoch.
    pub fn time_based() -> AnonSetNames {
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2))
            .unwrap_or(0);
        AnonSetNames::starting_at(micros)
    }

    /// Takes the next number.
    pub fn take(&mut self) -> u64 {
        let n = self.next;
        self.next = self.next.wrapping_add(1);
        n
    }

    /// The number the next name will carry.
    pub fn peek(&self) -> u64 {
        self.next
    }

    /// Moves on past `n` (numbers another counter took).
    pub fn advance_to(&mut self, n: u64) {
        self.next = self.next.max(n);
    }
}

/// The process-wide counter that [`encode`] (and a default [`super::NftSocket`]) draws from,
/// so that every batch of this process names its anonymous sets differently.
static PROCESS_NAMES: Mutex<Option<AnonSetNames>> = Mutex::new(None);

/// Runs `f` with the process-wide counter (started time-based on first use).
pub fn with_process_names<T>(f: impl FnOnce(&mut AnonSetNames) -> T) -> T {
    // A panic while holding the lock cannot leave the counter inconsistent (it only grows).
    let mut guard = PROCESS_NAMES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    f(guard.get_or_insert_with(AnonSetNames::time_based))
}

/// Encodes `tx` as one batch whose `NFNL_MSG_BATCH_BEGIN` has sequence number `first_seq`,
/// naming anonymous sets from the process-wide counter (see [`AnonSetNames`]).
///
/// Equivalent to `nft -f -` of `tx.text()`, message for message, with these differences, none
/// of which changes what the kernel holds or `nft list` prints:
/// - sequence numbers start at `first_seq`; only the last command message asks for an ACK
///   (`NLM_F_ACK`), nft asks for none;
/// - anonymous sets have concrete names instead of nft's `__set%d` / `__map%d`;
/// - set ids (`NFTA_SET_ID`, a per-batch handle) are numbered from 1 over the sets this batch
///   creates, and sent only for those: nft also sends ids it made up for sets already in the
///   kernel, which the kernel finds by name anyway;
/// - element lists longer than ~60 KiB are split over several messages at a slightly different
///   point than nft's, each with its own sequence number;
/// - consecutive `add element` commands on one set are sent in transaction order (nft sends
///   the first, then the others in reverse order);
/// - after an IPv6 address, a concatenation continues in `NFT_REG_2` and `NFT_REG32_05` (2 and
///   13), as nft does, rather than `NFT_REG32_04` (12, the same storage as `NFT_REG_2`);
/// - an interval of a named interval map (`a-b`) is sent as its start and end elements only.
///   nft 1.0.6 also sends an end element at 0 when the interval is the lowest of the set as
///   nft's cache knows it, and, for a set created in the same batch, every element of the
///   batch once more, merged, right after the set; neither changes what the kernel matches
///   (a key below the lowest start finds no interval) or what `nft list` prints.
///
/// An empty transaction gives just the batch framing. Inputs that nft would refuse to parse
/// (see [`check`]) are encoded as given; the kernel may or may not refuse them.
pub fn encode(tx: &Transaction, first_seq: u32) -> EncodedBatch {
    with_process_names(|names| encode_with(tx, first_seq, names))
}

/// [`encode`] with an explicit anonymous-set counter (deterministic, for tests and callers
/// that manage names themselves).
pub fn encode_with(tx: &Transaction, first_seq: u32, names: &mut AnonSetNames) -> EncodedBatch {
    let mut batch = BatchEncoder::new(tx.family, first_seq, names, estimate_size(tx));
    batch.push(tx);
    batch.finish()
}

/// One batch built from several transactions, encoded as they come (as if their ops were one
/// transaction's, numbered on across them), so that a caller need not hold them all.
pub struct BatchEncoder<'a> {
    e: Encoder<'a>,
    first_seq: u32,
    /// Ops encoded so far.
    ops: usize,
}

impl<'a> BatchEncoder<'a> {
    /// A batch whose `NFNL_MSG_BATCH_BEGIN` has sequence number `first_seq`; `capacity` bytes
    /// reserved.
    pub fn new(family: IpFamily, first_seq: u32, names: &'a mut AnonSetNames, capacity: usize) -> BatchEncoder<'a> {
        let mut e = Encoder {
            b: MsgBuf::with_capacity(capacity),
            family,
            nfproto: nfproto(family),
            seq: first_seq,
            op: 0,
            op_of_message: Vec::new(),
            set_ids: HashMap::new(),
            next_set_id: 1,
            names,
            last_msg: None,
        };
        let begin = e.b.begin_msg(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            first_seq,
            &nfgenmsg(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES),
        );
        e.b.end_msg(begin);
        BatchEncoder { e, first_seq, ops: 0 }
    }

    /// Appends the ops of `tx` (of the batch's family).
    pub fn push(&mut self, tx: &Transaction) {
        self.e.op_of_message.reserve(tx.ops.len() + tx.ops.len() / 4);
        for op in &tx.ops {
            self.e.op = self.ops;
            self.e.encode_op(op);
            self.ops += 1;
        }
    }

    /// Ops encoded so far.
    pub fn ops(&self) -> usize {
        self.ops
    }

    pub fn finish(self) -> EncodedBatch {
        let mut e = self.e;
        if let Some(last) = e.last_msg {
            e.b.add_msg_flags(last, NLM_F_ACK);
        }
        e.seq = e.seq.wrapping_add(1);
        let end = e.b.begin_msg(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            e.seq,
            &nfgenmsg(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES),
        );
        e.b.end_msg(end);
        EncodedBatch {
            bytes: e.b.buf,
            first_seq: self.first_seq,
            op_of_message: e.op_of_message,
        }
    }
}

/// A rough size so that large batches are not reallocated many times.
fn estimate_size(tx: &Transaction) -> usize {
    tx.ops.len().saturating_mul(200).saturating_add(64)
}

pub fn nfproto(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => NFPROTO_IPV4,
        IpFamily::V6 => NFPROTO_IPV6,
    }
}

struct Encoder<'a> {
    b: MsgBuf,
    family: IpFamily,
    nfproto: u8,
    /// Sequence number of the last message started.
    seq: u32,
    /// Index of the op being encoded.
    op: usize,
    op_of_message: Vec<usize>,
    /// Sets created by this batch (by name) and their `NFTA_SET_ID`.
    set_ids: HashMap<String, u32>,
    next_set_id: u32,
    names: &'a mut AnonSetNames,
    /// Offset of the last command message (it gets `NLM_F_ACK`).
    last_msg: Option<usize>,
}

impl Encoder<'_> {
    /// Starts a command message for the current op.
    fn begin(&mut self, msg: u16, flags: u16) -> usize {
        self.seq = self.seq.wrapping_add(1);
        self.op_of_message.push(self.op);
        let start = self.b.begin_msg(
            nft_type(msg),
            NLM_F_REQUEST | flags,
            self.seq,
            &nfgenmsg(self.nfproto, 0),
        );
        self.last_msg = Some(start);
        start
    }

    fn alloc_set_id(&mut self) -> u32 {
        let id = self.next_set_id;
        self.next_set_id = self.next_set_id.wrapping_add(1);
        id
    }

    fn encode_op(&mut self, op: &Op) {
        match op {
            Op::AddTable => {
                // nft sends `add table` without NLM_F_CREATE; the kernel creates a missing
                // table either way and, without NLM_F_EXCL, leaves an existing one alone.
                let m = self.begin(NFT_MSG_NEWTABLE, 0);
                self.b.put_str(NFTA_TABLE_NAME, TABLE);
                self.b.put_be32(NFTA_TABLE_FLAGS, 0);
                let u = Udata::comment(UDATA_TABLE_COMMENT, "rules for kube-proxy");
                self.b.put(NFTA_TABLE_USERDATA, &u.buf);
                self.b.end_msg(m);
            }
            Op::DeleteTable => {
                let m = self.begin(NFT_MSG_DELTABLE, 0);
                self.b.put_str(NFTA_TABLE_NAME, TABLE);
                self.b.end_msg(m);
                self.set_ids.clear();
            }
            Op::AddChain(decl) => self.add_chain(decl),
            Op::FlushChain(chain) => {
                // DELRULE with only table and chain removes every rule of the chain.
                let m = self.begin(NFT_MSG_DELRULE, 0);
                self.b.put_str(NFTA_RULE_TABLE, TABLE);
                self.b.put_str(NFTA_RULE_CHAIN, chain);
                self.b.end_msg(m);
            }
            Op::DeleteChain(chain) => {
                let m = self.begin(NFT_MSG_DELCHAIN, 0);
                self.b.put_str(NFTA_CHAIN_TABLE, TABLE);
                self.b.put_str(NFTA_CHAIN_NAME, chain);
                self.b.end_msg(m);
            }
            Op::AddRule { chain, rule } => self.add_rule(chain, rule),
            Op::AddSet(decl) => self.add_set(decl),
            Op::FlushSet { name, .. } => {
                // DELSETELEM without elements flushes the set (nft puts the set name first).
                let m = self.begin(NFT_MSG_DELSETELEM, 0);
                self.b.put_str(NFTA_SET_ELEM_LIST_SET, name);
                self.b.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                self.b.end_msg(m);
            }
            Op::DeleteSet { name, .. } => {
                let m = self.begin(NFT_MSG_DELSET, 0);
                self.b.put_str(NFTA_SET_TABLE, TABLE);
                self.b.put_str(NFTA_SET_NAME, name);
                self.b.end_msg(m);
                self.set_ids.remove(name);
            }
            Op::AddElement { set, element } => {
                let elems = named_element(element);
                let id = self.set_ids.get(set).copied();
                self.add_elements(set, id, &elems);
            }
            Op::DeleteElement { set, key } => {
                let m = self.begin(NFT_MSG_DELSETELEM, 0);
                self.b.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                self.b.put_str(NFTA_SET_ELEM_LIST_SET, set);
                let list = self.b.nest_start(NFTA_SET_ELEM_LIST_ELEMENTS);
                // An interval is deleted by its start and end elements, as it was added.
                for (i, e) in key_elements(key).iter().enumerate() {
                    let n = self.b.nest_start(u16::try_from(i + 1).unwrap_or(u16::MAX));
                    if e.interval_end {
                        self.b.put_be32(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
                    }
                    let k = self.b.nest_start(NFTA_SET_ELEM_KEY);
                    self.b.put(NFTA_DATA_VALUE, &e.key);
                    self.b.nest_end(k);
                    self.b.nest_end(n);
                }
                self.b.nest_end(list);
                self.b.end_msg(m);
            }
        }
    }

    fn add_chain(&mut self, decl: &ChainDecl) {
        let m = self.begin(NFT_MSG_NEWCHAIN, NLM_F_CREATE);
        self.b.put_str(NFTA_CHAIN_TABLE, TABLE);
        self.b.put_str(NFTA_CHAIN_NAME, &decl.name);
        match (&decl.base, &decl.comment) {
            (Some(base), _) => {
                // The text form has no comment on base chains either.
                self.b.put_str(NFTA_CHAIN_TYPE, base.kind);
                let h = self.b.nest_start(NFTA_CHAIN_HOOK);
                self.b.put_be32(NFTA_HOOK_HOOKNUM, hook_number(base.hook));
                self.b.put(NFTA_HOOK_PRIORITY, &base.priority.to_be_bytes());
                self.b.nest_end(h);
            }
            (None, Some(comment)) => {
                let u = Udata::comment(UDATA_CHAIN_COMMENT, comment);
                self.b.put(NFTA_CHAIN_USERDATA, &u.buf);
            }
            (None, None) => {}
        }
        self.b.end_msg(m);
    }

    fn add_set(&mut self, decl: &SetDecl) {
        let id = self.alloc_set_id();
        let m = self.begin(NFT_MSG_NEWSET, NLM_F_CREATE);
        self.b.put_str(NFTA_SET_TABLE, TABLE);
        self.b.put_str(NFTA_SET_NAME, &decl.name);
        let sig = set_signature(self.family, decl);
        self.b.put_be32(NFTA_SET_FLAGS, sig.flags);
        self.b.put_be32(NFTA_SET_KEY_TYPE, sig.key_type);
        self.b.put_be32(NFTA_SET_KEY_LEN, sig.key_len);
        if let Some((data_type, data_len)) = sig.data {
            self.b.put_be32(NFTA_SET_DATA_TYPE, data_type);
            self.b.put_be32(NFTA_SET_DATA_LEN, data_len);
        }
        self.b.put_be32(NFTA_SET_ID, id);
        if let Some(t) = sig.timeout_ms {
            self.b.put_be64(NFTA_SET_TIMEOUT, t);
        }
        self.b.put(NFTA_SET_USERDATA, &set_udata(self.family, decl).buf);
        self.b.end_msg(m);
        self.set_ids.insert(decl.name.clone(), id);
    }

    fn add_rule(&mut self, chain: &str, rule: &Rule) {
        // Anonymous sets first, in the order the rule uses them.
        let mut anon = Vec::new();
        for m in &rule.matches {
            if let Match::Addr { dir, spec, .. } = m
                && expr::needs_anon_set(spec)
                && let AddrSpec::AnonSet { items, .. } = spec
            {
                anon.push(self.anon_cidr_set(*dir, items));
            }
        }
        if let Statement::NumgenVmap(chains) = &rule.statement {
            anon.push(self.anon_numgen_map(chains));
        }
        let m = self.begin(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND);
        self.b.put_str(NFTA_RULE_TABLE, TABLE);
        self.b.put_str(NFTA_RULE_CHAIN, chain);
        let list = self.b.nest_start(NFTA_RULE_EXPRESSIONS);
        let set_ids = &self.set_ids;
        let lookup = |name: &str| set_ids.get(name).copied();
        let refs = RuleRefs {
            set_id: &lookup,
            anon: &anon,
        };
        expr::rule_exprs(&mut self.b, self.family, rule, &refs);
        self.b.nest_end(list);
        if let Some(c) = &rule.comment {
            let u = Udata::comment(UDATA_RULE_COMMENT, c);
            self.b.put(NFTA_RULE_USERDATA, &u.buf);
        }
        self.b.end_msg(m);
    }

    /// `{ a, b, … }` as nft builds it: a hash set when every item is a single address,
    /// otherwise an interval set of the merged ranges.
    fn anon_cidr_set(&mut self, dir: crate::nftables::ast::Dir, items: &[ipnet::IpNet]) -> AnonRef {
        let hosts_only = items.iter().all(|n| n.prefix_len() == n.max_prefix_len());
        let (elems, size) = if hosts_only {
            let elems: Vec<Elem> = items.iter().map(|n| Elem::key(addr_bytes(&n.addr()))).collect();
            let size = elems.len();
            (elems, size)
        } else {
            intervals(self.family, items)
        };
        let name = format!("__set{}", self.names.take());
        let id = self.alloc_set_id();
        let m = self.begin(NFT_MSG_NEWSET, NLM_F_CREATE);
        self.b.put_str(NFTA_SET_TABLE, TABLE);
        self.b.put_str(NFTA_SET_NAME, &name);
        let mut flags = NFT_SET_ANONYMOUS | NFT_SET_CONSTANT;
        if !hosts_only {
            flags |= NFT_SET_INTERVAL;
        }
        self.b.put_be32(NFTA_SET_FLAGS, flags);
        let (key_type, key_len) = key_type_len(self.family, KeyType::Addr);
        self.b.put_be32(NFTA_SET_KEY_TYPE, key_type);
        self.b.put_be32(NFTA_SET_KEY_LEN, key_len);
        self.b.put_be32(NFTA_SET_ID, id);
        self.put_desc_size(size);
        let mut u = Udata::new();
        u.put_u32(UDATA_SET_KEYBYTEORDER, BYTEORDER_BIG_ENDIAN);
        if !hosts_only {
            u.put_u32(UDATA_SET_MERGE_ELEMENTS, 1);
        }
        u.put_nested(UDATA_SET_KEY_TYPEOF, &typeof_addr(self.family, dir));
        self.b.put(NFTA_SET_USERDATA, &u.buf);
        self.b.end_msg(m);
        self.add_elements(&name, Some(id), &elems);
        AnonRef { name, id }
    }

    /// The constant verdict map of `numgen random mod N vmap { 0 : goto c0, … }`.
    fn anon_numgen_map(&mut self, chains: &[String]) -> AnonRef {
        let name = format!("__map{}", self.names.take());
        let id = self.alloc_set_id();
        let m = self.begin(NFT_MSG_NEWSET, NLM_F_CREATE);
        self.b.put_str(NFTA_SET_TABLE, TABLE);
        self.b.put_str(NFTA_SET_NAME, &name);
        self.b
            .put_be32(NFTA_SET_FLAGS, NFT_SET_ANONYMOUS | NFT_SET_CONSTANT | NFT_SET_MAP);
        self.b.put_be32(NFTA_SET_KEY_TYPE, TYPE_INTEGER);
        self.b.put_be32(NFTA_SET_KEY_LEN, 4);
        self.b.put_be32(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
        self.b.put_be32(NFTA_SET_DATA_LEN, 0);
        self.b.put_be32(NFTA_SET_ID, id);
        self.put_desc_size(chains.len());
        let mut u = Udata::new();
        u.put_u32(UDATA_SET_KEYBYTEORDER, BYTEORDER_HOST_ENDIAN);
        u.put_u32(UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
        let mut data_typeof = Udata::new();
        data_typeof.put_u32(UDATA_SET_TYPEOF_EXPR, EXPR_VERDICT);
        data_typeof.put(UDATA_SET_TYPEOF_DATA, &[]);
        u.put_nested(UDATA_SET_DATA_TYPEOF, &data_typeof);
        u.put_u32(UDATA_SET_DATA_INTERVAL, 0);
        self.b.put(NFTA_SET_USERDATA, &u.buf);
        self.b.end_msg(m);
        // numgen writes its result in host byte order; the keys are stored the same way.
        let elems: Vec<Elem> = chains
            .iter()
            .enumerate()
            .map(|(i, c)| Elem {
                data: Some(ElemValue::Verdict(Verdict::Goto(c.clone()))),
                ..Elem::key(u32::try_from(i).unwrap_or(u32::MAX).to_ne_bytes().to_vec())
            })
            .collect();
        self.add_elements(&name, Some(id), &elems);
        AnonRef { name, id }
    }

    fn put_desc_size(&mut self, size: usize) {
        let d = self.b.nest_start(NFTA_SET_DESC);
        self.b
            .put_be32(NFTA_SET_DESC_SIZE, u32::try_from(size).unwrap_or(u32::MAX));
        self.b.nest_end(d);
    }

    /// NEWSETELEM messages for `elems`, as many as needed to keep each list under 64 KiB.
    fn add_elements(&mut self, set: &str, set_id: Option<u32>, elems: &[Elem]) {
        let mut rest = elems;
        // At least one message, even for an empty list (nft sends none, but an op must not
        // vanish from the batch; an empty NEWSETELEM is a no-op in the kernel).
        loop {
            let m = self.begin(NFT_MSG_NEWSETELEM, NLM_F_CREATE);
            self.b.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
            self.b.put_str(NFTA_SET_ELEM_LIST_SET, set);
            if let Some(id) = set_id {
                self.b.put_be32(NFTA_SET_ELEM_LIST_SET_ID, id);
            }
            let list = self.b.nest_start(NFTA_SET_ELEM_LIST_ELEMENTS);
            let mut index: u16 = 0;
            while let Some((e, tail)) = rest.split_first() {
                if index > 0 && self.b.len() - list > MAX_ELEMENTS_NEST {
                    break;
                }
                index = index.wrapping_add(1);
                self.put_element(index, e);
                rest = tail;
            }
            self.b.nest_end(list);
            self.b.end_msg(m);
            if rest.is_empty() {
                break;
            }
        }
    }

    fn put_element(&mut self, index: u16, e: &Elem) {
        let n = self.b.nest_start(index);
        if e.interval_end {
            self.b.put_be32(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
        }
        let k = self.b.nest_start(NFTA_SET_ELEM_KEY);
        self.b.put(NFTA_DATA_VALUE, &e.key);
        self.b.nest_end(k);
        if let Some(v) = &e.data {
            let d = self.b.nest_start(NFTA_SET_ELEM_DATA);
            match v {
                ElemValue::Verdict(v) => expr::verdict_data(&mut self.b, v),
                ElemValue::AddrPort(sa) => {
                    let mut value = addr_bytes(&sa.ip());
                    value.extend_from_slice(&sa.port().to_be_bytes());
                    value.extend_from_slice(&[0, 0]);
                    self.b.put(NFTA_DATA_VALUE, &value);
                }
            }
            self.b.nest_end(d);
        }
        let mut u = Udata::new();
        if let Some(c) = &e.comment {
            u.put_str(UDATA_SET_ELEM_COMMENT, c);
        }
        if e.interval_open {
            u.put_u32(UDATA_SET_ELEM_FLAGS, SET_ELEM_F_INTERVAL_OPEN);
        }
        if !u.buf.is_empty() {
            self.b.put(NFTA_SET_ELEM_USERDATA, &u.buf);
        }
        self.b.nest_end(n);
    }
}

/// One set element as sent.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Elem {
    key: Vec<u8>,
    data: Option<ElemValue>,
    comment: Option<String>,
    /// `NFT_SET_ELEM_INTERVAL_END`: this key ends the previous interval.
    interval_end: bool,
    /// The last interval reaches the top of the address space and has no end element.
    interval_open: bool,
}

impl Elem {
    fn key(key: Vec<u8>) -> Elem {
        Elem {
            key,
            data: None,
            comment: None,
            interval_end: false,
            interval_open: false,
        }
    }
}

/// The elements a named set's element is sent as: itself, or for an interval its start
/// (with the value and comment) and its end.
fn named_element(e: &Element) -> Vec<Elem> {
    let mut elems = key_elements(&e.key);
    if let Some(first) = elems.first_mut() {
        first.data = e.value.clone();
        first.comment = e.comment.clone();
    }
    elems
}

/// The start (and, for an interval, end) element of a key. An interval `a-b` is a start at
/// `a` and an end flagged `INTERVAL_END` at `b + 1`, as nft sends it (without the end element
/// at 0 that nft 1.0.6 adds when the lowest interval of a set goes in: see [`encode`]).
fn key_elements(key: &ElemKey) -> Vec<Elem> {
    match key {
        ElemKey::Range(lo, hi) => vec![
            Elem::key(lo.to_be_bytes().to_vec()),
            Elem {
                interval_end: true,
                ..Elem::key(hi.saturating_add(1).to_be_bytes().to_vec())
            },
        ],
        _ => vec![Elem::key(key_bytes(key))],
    }
}

/// An element key as the kernel stores it: each concatenation field padded to 4 bytes.
pub fn key_bytes(key: &ElemKey) -> Vec<u8> {
    let proto_port = |p, port: u16| {
        let port = port.to_be_bytes();
        [proto_number(p), 0, 0, 0, port[0], port[1], 0, 0]
    };
    match key {
        ElemKey::Addr(ip) => addr_bytes(ip),
        ElemKey::AddrProtoPort(ip, p, port) => {
            let mut v = addr_bytes(ip);
            v.extend_from_slice(&proto_port(*p, *port));
            v
        }
        ElemKey::ProtoPort(p, port) => proto_port(*p, *port).to_vec(),
        ElemKey::AddrPair(a, b) => {
            let mut v = addr_bytes(a);
            v.extend(addr_bytes(b));
            v
        }
        ElemKey::Range(lo, _) => lo.to_be_bytes().to_vec(),
    }
}

/// What the kernel holds for a set declared as `decl`: flags, key and data types and lengths
/// (as sent in `NFTA_SET_*`), timeout.
pub fn set_signature(family: IpFamily, decl: &SetDecl) -> SetSignature {
    let mut flags = 0;
    if decl.interval() {
        flags |= NFT_SET_INTERVAL;
    }
    if decl.map.is_some() {
        flags |= NFT_SET_MAP;
    }
    if decl.timeout_seconds.is_some() {
        // `flags dynamic,timeout`
        flags |= NFT_SET_TIMEOUT | NFT_SET_EVAL;
    }
    let (key_type, key_len) = key_type_len(family, decl.key);
    let data = match decl.map {
        Some(MapValue::Verdict) => Some((NFT_DATA_VERDICT, 0)),
        Some(MapValue::AddrPort(_)) => {
            let (addr_type, addr_len) = addr_type_len(family);
            Some(((addr_type << TYPE_BITS) | TYPE_INET_SERVICE, addr_len + 4))
        }
        None => None,
    };
    SetSignature {
        flags,
        key_type,
        key_len,
        data,
        timeout_ms: decl.timeout_seconds.map(|t| u64::from(t) * 1000),
    }
}

/// nft's type id and the size of an address of the family.
fn addr_type_len(family: IpFamily) -> (u32, u32) {
    match family {
        IpFamily::V4 => (TYPE_IPADDR, 4),
        IpFamily::V6 => (TYPE_IP6ADDR, 16),
    }
}

/// `NFTA_SET_KEY_TYPE` (nft's type id; a concatenation's is its components' ids, 6 bits
/// each) and `NFTA_SET_KEY_LEN` (fields padded to 4 bytes).
fn key_type_len(family: IpFamily, key: KeyType) -> (u32, u32) {
    let (addr_type, addr_len) = addr_type_len(family);
    let concat = |types: &[u32]| types.iter().fold(0, |acc, t| (acc << TYPE_BITS) | t);
    match key {
        KeyType::Addr => (addr_type, addr_len),
        KeyType::AddrProtoPort => (
            concat(&[addr_type, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]),
            addr_len + 8,
        ),
        KeyType::ProtoPort => (concat(&[TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]), 8),
        KeyType::AddrPair => (concat(&[addr_type, addr_type]), 2 * addr_len),
        KeyType::Numgen(_) => (TYPE_INTEGER, 4),
    }
}

/// The hints nft keeps with a set for printing it: byte order of key (and data), the key's
/// "typeof" (a concatenation's, or the numgen expression of a `typeof numgen` key), the data's
/// "typeof" for a `typeof` map, whether map data are intervals, then the comment.
fn set_udata(family: IpFamily, decl: &SetDecl) -> Udata {
    let mut u = Udata::new();
    let key_order = match decl.key {
        KeyType::Addr => BYTEORDER_BIG_ENDIAN,
        KeyType::Numgen(_) => BYTEORDER_HOST_ENDIAN,
        KeyType::AddrProtoPort | KeyType::ProtoPort | KeyType::AddrPair => BYTEORDER_INVALID,
    };
    u.put_u32(UDATA_SET_KEYBYTEORDER, key_order);
    if decl.map.is_some() {
        u.put_u32(UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
    }
    match decl.key {
        KeyType::Addr => {}
        KeyType::Numgen(modulus) => {
            let mut ng = Udata::new();
            ng.put_u32(0, NG_RANDOM).put_u32(1, modulus).put_u32(2, 0);
            let mut t = Udata::new();
            t.put_u32(UDATA_SET_TYPEOF_EXPR, EXPR_NUMGEN);
            t.put_nested(UDATA_SET_TYPEOF_DATA, &ng);
            u.put_nested(UDATA_SET_KEY_TYPEOF, &t);
        }
        _ => {
            u.put_nested(UDATA_SET_KEY_TYPEOF, &typeof_concat());
        }
    }
    if let Some(MapValue::AddrPort(protocol)) = decl.map {
        // `typeof ... : ip daddr . tcp dport` (udp, sctp)
        let (desc, daddr) = match family {
            IpFamily::V4 => (PROTO_DESC_IP, IPHDR_DADDR),
            IpFamily::V6 => (PROTO_DESC_IP6, IP6HDR_DADDR),
        };
        let mut fields = Udata::new();
        fields
            .put_nested(0, &typeof_payload(desc, daddr))
            .put_nested(1, &typeof_payload(proto_desc(protocol), L4HDR_DPORT));
        let mut t = Udata::new();
        t.put_u32(UDATA_SET_TYPEOF_EXPR, EXPR_CONCAT);
        t.put_nested(UDATA_SET_TYPEOF_DATA, &fields);
        u.put_nested(UDATA_SET_DATA_TYPEOF, &t);
    }
    if decl.map.is_some() {
        u.put_u32(UDATA_SET_DATA_INTERVAL, 0);
    }
    if let Some(c) = &decl.comment {
        u.put_str(UDATA_SET_COMMENT, c);
    }
    u
}

fn proto_desc(protocol: Protocol) -> u32 {
    match protocol {
        Protocol::Tcp => PROTO_DESC_TCP,
        Protocol::Udp => PROTO_DESC_UDP,
        Protocol::Sctp => PROTO_DESC_SCTP,
    }
}

/// The "typeof" of a payload field (`ip daddr`, `th dport`, ...).
fn typeof_payload(desc: u32, field: u32) -> Udata {
    let mut payload = Udata::new();
    payload.put_u32(0, desc).put_u32(1, field);
    let mut t = Udata::new();
    t.put_u32(UDATA_SET_TYPEOF_EXPR, EXPR_PAYLOAD);
    t.put_nested(UDATA_SET_TYPEOF_DATA, &payload);
    t
}

/// The "typeof" nft stores for a set declared with a concatenated `type` (an empty concat).
fn typeof_concat() -> Udata {
    let mut t = Udata::new();
    t.put_u32(UDATA_SET_TYPEOF_EXPR, EXPR_CONCAT);
    t.put(UDATA_SET_TYPEOF_DATA, &[]);
    t
}

/// The "typeof" of an anonymous address set: the payload field it is matched against.
fn typeof_addr(family: IpFamily, dir: crate::nftables::ast::Dir) -> Udata {
    use crate::nftables::ast::Dir;
    let (desc, field) = match (family, dir) {
        (IpFamily::V4, Dir::Saddr) => (PROTO_DESC_IP, IPHDR_SADDR),
        (IpFamily::V4, Dir::Daddr) => (PROTO_DESC_IP, IPHDR_DADDR),
        (IpFamily::V6, Dir::Saddr) => (PROTO_DESC_IP6, IP6HDR_SADDR),
        (IpFamily::V6, Dir::Daddr) => (PROTO_DESC_IP6, IP6HDR_DADDR),
    };
    typeof_payload(desc, field)
}

/// The elements of an interval set holding `items`, as nft 1.0.6 computes them for an
/// anonymous set: ranges sorted and merged when they overlap or touch; an end element (flag
/// `INTERVAL_END`) after each range, plus one at 0 before the first range unless it starts at
/// 0; a range that reaches the top gets no end element but the "open" userdata flag instead.
/// Also returns `NFTA_SET_DESC_SIZE`, which nft counts before dropping that last end element.
fn intervals(family: IpFamily, items: &[ipnet::IpNet]) -> (Vec<Elem>, usize) {
    let bits: u32 = match family {
        IpFamily::V4 => 32,
        IpFamily::V6 => 128,
    };
    let top: u128 = if bits == 128 { u128::MAX } else { (1u128 << bits) - 1 };
    // Inclusive ranges, so that the top of the address space needs no overflow.
    let mut ranges: Vec<(u128, u128)> = items
        .iter()
        .map(|n| {
            let start = addr_value(&n.network());
            let host_bits = u32::from(n.max_prefix_len() - n.prefix_len());
            let span = if host_bits >= 128 {
                u128::MAX
            } else {
                (1u128 << host_bits) - 1
            };
            (start, start.saturating_add(span).min(top))
        })
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::with_capacity(ranges.len());
    for (start, last) in ranges {
        match merged.last_mut() {
            Some(prev) if prev.1 == top || start <= prev.1 + 1 => prev.1 = prev.1.max(last),
            _ => merged.push((start, last)),
        }
    }
    let to_bytes = |v: u128| -> Vec<u8> {
        match family {
            IpFamily::V4 => u32::try_from(v).unwrap_or(u32::MAX).to_be_bytes().to_vec(),
            IpFamily::V6 => v.to_be_bytes().to_vec(),
        }
    };
    let mut elems = Vec::with_capacity(merged.len() * 2 + 1);
    let mut size = 0;
    if merged.first().is_some_and(|r| r.0 != 0) {
        elems.push(Elem {
            interval_end: true,
            ..Elem::key(to_bytes(0))
        });
        size += 1;
    }
    for (start, last) in merged {
        size += 2;
        if last == top {
            elems.push(Elem {
                interval_open: true,
                ..Elem::key(to_bytes(start))
            });
        } else {
            elems.push(Elem::key(to_bytes(start)));
            elems.push(Elem {
                interval_end: true,
                ..Elem::key(to_bytes(last + 1))
            });
        }
    }
    (elems, size)
}

fn addr_value(ip: &std::net::IpAddr) -> u128 {
    match ip {
        std::net::IpAddr::V4(a) => u128::from(u32::from(*a)),
        std::net::IpAddr::V6(a) => u128::from(*a),
    }
}

fn hook_number(hook: &str) -> u32 {
    // NF_INET_* hook numbers. The hook names come from the renderer's fixed table; an unknown
    // one is sent as an invalid number so that the kernel refuses it ([`check`] reports it
    // first).
    match hook {
        "prerouting" => 0,
        "input" => 1,
        "forward" => 2,
        "output" => 3,
        "postrouting" => 4,
        _ => u32::MAX,
    }
}

/// An op that nft would refuse to parse, or that the encoding cannot express faithfully.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("op {index} ({text}): {reason}")]
pub struct CheckError {
    pub index: usize,
    /// The op's `nft -f` line.
    pub text: String,
    pub reason: String,
}

/// Refuses what `nft -f` would refuse before talking to the kernel and what would otherwise be
/// encoded into something with another meaning: addresses of the other family, empty
/// anonymous sets, `numgen` over no chains, interface names longer than 15 bytes, comments
/// longer than nft's 128 bytes, `reject` as a map value, unknown hooks, a `dnat` to a map
/// without a protocol match, intervals that are empty or reach 2^32 - 1.
pub fn check(tx: &Transaction) -> Result<(), CheckError> {
    for (index, op) in tx.ops.iter().enumerate() {
        if let Err(reason) = check_op(tx.family, op) {
            let mut text = String::new();
            op.write_text(tx.family, &mut text);
            return Err(CheckError {
                index,
                text: text.trim_end().to_string(),
                reason,
            });
        }
    }
    Ok(())
}

fn check_op(family: IpFamily, op: &Op) -> Result<(), String> {
    let ip_ok = |ip: &std::net::IpAddr| {
        if family.contains(ip) {
            Ok(())
        } else {
            Err(format!("{ip} is not an {family} address"))
        }
    };
    let comment_ok = |c: &Option<String>| match c {
        Some(c) if c.len() > MAX_COMMENT => Err(format!("comment longer than {MAX_COMMENT} bytes")),
        Some(c) if c.contains('\0') => Err("comment contains NUL".to_string()),
        _ => Ok(()),
    };
    let value_ok = |v: &Option<ElemValue>| match v {
        Some(ElemValue::Verdict(Verdict::Reject)) => Err("reject is not a verdict-map value".to_string()),
        Some(ElemValue::AddrPort(sa)) => ip_ok(&sa.ip()),
        _ => Ok(()),
    };
    match op {
        Op::AddChain(decl) => {
            comment_ok(&decl.comment)?;
            if let Some(base) = &decl.base
                && hook_number(base.hook) == u32::MAX
            {
                return Err(format!("unknown hook {}", base.hook));
            }
        }
        Op::AddSet(decl) => comment_ok(&decl.comment)?,
        Op::AddRule { rule, .. } => {
            comment_ok(&rule.comment)?;
            for m in &rule.matches {
                match m {
                    Match::Addr { spec, .. } => match spec {
                        AddrSpec::Net(n) => ip_ok(&n.addr())?,
                        AddrSpec::AnonSet { items, .. } => {
                            if items.is_empty() {
                                return Err("empty anonymous set".to_string());
                            }
                            for n in items {
                                ip_ok(&n.addr())?;
                            }
                        }
                        AddrSpec::Set(_) => {}
                    },
                    Match::Iifname { pattern, .. } => {
                        let name = pattern.strip_suffix('*').unwrap_or(pattern);
                        if name.len() >= IFNAMSIZ || name.contains(['\0', '*']) {
                            return Err(format!("invalid interface name {pattern:?}"));
                        }
                        if name.is_empty() {
                            return Err("empty interface name".to_string());
                        }
                    }
                    _ => {}
                }
            }
            match &rule.statement {
                Statement::NumgenVmap(chains) if chains.is_empty() => {
                    return Err("numgen over no chains".to_string());
                }
                Statement::Dnat(sa) => ip_ok(&sa.ip())?,
                Statement::DnatNumgenMap { modulus, offset, .. } => {
                    if *modulus == 0 || offset.checked_add(*modulus).is_none() {
                        return Err(format!("numgen random mod {modulus} offset {offset} overflows"));
                    }
                    // nft: "transport protocol mapping is only valid after transport
                    // protocol match".
                    if !rule.matches.iter().any(|m| matches!(m, Match::L4proto(_))) {
                        return Err("a dnat to an address and port needs a meta l4proto match".to_string());
                    }
                }
                _ => {}
            }
        }
        Op::AddElement { element, .. } => {
            comment_ok(&element.comment)?;
            value_ok(&element.value)?;
            check_key(&element.key, &ip_ok)?;
        }
        Op::DeleteElement { key, .. } => check_key(key, &ip_ok)?,
        _ => {}
    }
    Ok(())
}

fn check_key(key: &ElemKey, ip_ok: &dyn Fn(&std::net::IpAddr) -> Result<(), String>) -> Result<(), String> {
    match key {
        ElemKey::Addr(ip) | ElemKey::AddrProtoPort(ip, _, _) => ip_ok(ip),
        ElemKey::AddrPair(a, b) => ip_ok(a).and(ip_ok(b)),
        ElemKey::ProtoPort(..) => Ok(()),
        // The end element is at `hi + 1`.
        ElemKey::Range(lo, hi) if lo > hi || *hi == u32::MAX => Err(format!("invalid interval {lo}-{hi}")),
        ElemKey::Range(..) => Ok(()),
    }
}

impl fmt::Display for EncodedBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "nfnetlink batch of {} messages, {} bytes",
            self.messages(),
            self.bytes.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(items: &[&str]) -> Vec<ipnet::IpNet> {
        items.iter().map(|s| s.parse().expect("test CIDR")).collect()
    }

    /// (key, end, open) per element, keys as text.
    fn shape(family: IpFamily, items: &[&str]) -> (Vec<(String, bool, bool)>, usize) {
        let (elems, size) = intervals(family, &nets(items));
        let text = |k: &[u8]| match k.len() {
            4 => std::net::Ipv4Addr::from(<[u8; 4]>::try_from(k).expect("4 bytes")).to_string(),
            _ => std::net::Ipv6Addr::from(<[u8; 16]>::try_from(k).expect("16 bytes")).to_string(),
        };
        (
            elems
                .iter()
                .map(|e| (text(&e.key), e.interval_end, e.interval_open))
                .collect(),
            size,
        )
    }

    #[test]
    fn intervals_merge_and_mark_ends_as_nft_does() {
        let (e, size) = shape(
            IpFamily::V4,
            &["203.0.113.0/25", "198.51.100.51/32", "198.51.100.50/32"],
        );
        let want = [
            ("0.0.0.0", true, false),
            ("198.51.100.50", false, false),
            ("198.51.100.52", true, false),
            ("203.0.113.0", false, false),
            ("203.0.113.128", true, false),
        ];
        assert_eq!(e, want.map(|(k, a, b)| (k.to_string(), a, b)));
        assert_eq!(size, 5);
        // Starting at 0 (no leading end element), overlapping, reaching the top (no end).
        let (e, size) = shape(
            IpFamily::V4,
            &["0.0.0.0/8", "10.1.0.0/16", "10.0.0.0/8", "255.255.255.0/24"],
        );
        let want = [
            ("0.0.0.0", false, false),
            ("1.0.0.0", true, false),
            ("10.0.0.0", false, false),
            ("11.0.0.0", true, false),
            ("255.255.255.0", false, true),
        ];
        assert_eq!(e, want.map(|(k, a, b)| (k.to_string(), a, b)));
        assert_eq!(size, 6);
        let (e, size) = shape(IpFamily::V6, &["::/0", "fd00::1/128"]);
        assert_eq!(e, vec![("::".to_string(), false, true)]);
        assert_eq!(size, 2);
        // Host bits of a prefix are ignored, as nft masks them.
        let (e, _) = shape(IpFamily::V4, &["10.0.0.1/8", "1.2.3.4/32"]);
        assert_eq!(e[3], ("10.0.0.0".to_string(), false, false));
    }

    #[test]
    fn check_refuses_what_nft_would() {
        let mut tx = Transaction::new(IpFamily::V4);
        tx.push(Op::AddTable);
        assert!(check(&tx).is_ok());
        tx.push(Op::AddRule {
            chain: "c".into(),
            rule: Rule::new(vec![], Statement::Dnat("[fd00::1]:80".parse().expect("sockaddr"))),
        });
        let err = check(&tx).expect_err("an IPv6 dnat in an ip table");
        assert_eq!(err.index, 1);
        assert!(err.text.starts_with("add rule ip kube-proxy c "), "{err}");
        let long = Transaction {
            family: IpFamily::V4,
            ops: vec![Op::AddRule {
                chain: "c".into(),
                rule: Rule::verdict(
                    vec![Match::Iifname {
                        negate: false,
                        pattern: "a-very-long-ifname".into(),
                    }],
                    Verdict::Accept,
                ),
            }],
        };
        assert!(check(&long).is_err());
    }
}
