//! What `kube-proxy explain` reads of the conntrack table besides the flows: the statistics
//! `conntrack -S` prints (summed over the CPUs) and the table's usage (`nf_conntrack_count` /
//! `nf_conntrack_max`), as ctnetlink's `IPCTNL_MSG_CT_GET_STATS_CPU` and
//! `IPCTNL_MSG_CT_GET_STATS` give them; and [`Tracked`], one entry of any protocol with ports,
//! for counting connections per endpoint. Requests and replies are built and read here (pure);
//! the exchange is `ctnetlink`'s.

use serde::{Deserialize, Serialize};

use super::cleanup::Flow;
use crate::netlink::{Attrs, MsgBuf, NLM_F_DUMP, NLM_F_REQUEST};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET_STATS_CPU: u8 = 4;
const IPCTNL_MSG_CT_GET_STATS: u8 = 5;

// enum ctattr_stats_cpu
const CTA_STATS_FOUND: u16 = 2;
const CTA_STATS_INVALID: u16 = 4;
const CTA_STATS_INSERT: u16 = 8;
const CTA_STATS_INSERT_FAILED: u16 = 9;
const CTA_STATS_DROP: u16 = 10;
const CTA_STATS_EARLY_DROP: u16 = 11;
const CTA_STATS_ERROR: u16 = 12;
const CTA_STATS_SEARCH_RESTART: u16 = 13;
const CTA_STATS_CLASH_RESOLVE: u16 = 14;
const CTA_STATS_CHAIN_TOOLONG: u16 = 15;
// enum ctattr_stats_global
const CTA_STATS_GLOBAL_ENTRIES: u16 = 1;
const CTA_STATS_GLOBAL_MAX_ENTRIES: u16 = 2;

/// `conntrack -S`, summed over the CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Statistics {
    pub found: u64,
    pub invalid: u64,
    pub insert: u64,
    /// New connections whose entry could not be inserted (the table was full, or a clash).
    pub insert_failed: u64,
    /// Packets dropped because no entry could be made.
    pub drop: u64,
    pub early_drop: u64,
    pub error: u64,
    pub search_restart: u64,
    pub clash_resolve: u64,
    pub chain_toolong: u64,
}

impl Statistics {
    pub fn add(&mut self, o: &Statistics) {
        self.found += o.found;
        self.invalid += o.invalid;
        self.insert += o.insert;
        self.insert_failed += o.insert_failed;
        self.drop += o.drop;
        self.early_drop += o.early_drop;
        self.error += o.error;
        self.search_restart += o.search_restart;
        self.clash_resolve += o.clash_resolve;
        self.chain_toolong += o.chain_toolong;
    }
}

/// The table's entries (in this network namespace) and its maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TableUsage {
    pub count: u64,
    pub max: u64,
}

/// One entry of the table with ports: TCP (with its state), UDP or SCTP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tracked {
    /// The IP protocol number (6, 17, 132).
    pub protocol: u8,
    /// Its tuples (the type says UDP, but they are the same for every protocol with ports).
    pub flow: Flow,
    /// `TCP_CONNTRACK_*` (3 is ESTABLISHED), for TCP.
    pub tcp_state: Option<u8>,
}

/// `TCP_CONNTRACK_ESTABLISHED`.
pub const TCP_ESTABLISHED: u8 = 3;

/// Whether `ty` (the low byte of a ctnetlink message type) is a statistics reply.
pub fn is_stats(ty: u8) -> bool {
    ty == IPCTNL_MSG_CT_GET_STATS_CPU || ty == IPCTNL_MSG_CT_GET_STATS
}

fn request(ty: u8, flags: u16, seq: u32) -> Vec<u8> {
    let mut b = MsgBuf::with_capacity(20);
    // nfgenmsg: AF_UNSPEC, version 0, res_id 0.
    let m = b.begin_msg(NFNL_SUBSYS_CTNETLINK << 8 | u16::from(ty), flags, seq, &[0, 0, 0, 0]);
    b.end_msg(m);
    b.buf
}

/// The per-CPU statistics, as a dump (one reply per CPU).
pub fn cpu_request(seq: u32) -> Vec<u8> {
    request(IPCTNL_MSG_CT_GET_STATS_CPU, NLM_F_REQUEST | NLM_F_DUMP, seq)
}

/// The table's usage (one reply).
pub fn usage_request(seq: u32) -> Vec<u8> {
    request(IPCTNL_MSG_CT_GET_STATS, NLM_F_REQUEST, seq)
}

fn be32(attrs: &Attrs<'_>, ty: u16, name: &'static str) -> Result<u64, String> {
    Ok(attrs
        .raw4(ty, name)
        .map_err(|e| e.to_string())?
        .map_or(0, |b| u64::from(u32::from_be_bytes(b))))
}

/// One CPU's statistics from the attributes of its reply.
pub fn parse_cpu(attrs: &[u8]) -> Result<Statistics, String> {
    let a = Attrs::parse(attrs).map_err(|e| e.to_string())?;
    Ok(Statistics {
        found: be32(&a, CTA_STATS_FOUND, "CTA_STATS_FOUND")?,
        invalid: be32(&a, CTA_STATS_INVALID, "CTA_STATS_INVALID")?,
        insert: be32(&a, CTA_STATS_INSERT, "CTA_STATS_INSERT")?,
        insert_failed: be32(&a, CTA_STATS_INSERT_FAILED, "CTA_STATS_INSERT_FAILED")?,
        drop: be32(&a, CTA_STATS_DROP, "CTA_STATS_DROP")?,
        early_drop: be32(&a, CTA_STATS_EARLY_DROP, "CTA_STATS_EARLY_DROP")?,
        error: be32(&a, CTA_STATS_ERROR, "CTA_STATS_ERROR")?,
        search_restart: be32(&a, CTA_STATS_SEARCH_RESTART, "CTA_STATS_SEARCH_RESTART")?,
        clash_resolve: be32(&a, CTA_STATS_CLASH_RESOLVE, "CTA_STATS_CLASH_RESOLVE")?,
        chain_toolong: be32(&a, CTA_STATS_CHAIN_TOOLONG, "CTA_STATS_CHAIN_TOOLONG")?,
    })
}

/// The usage from the attributes of its reply.
pub fn parse_usage(attrs: &[u8]) -> Result<TableUsage, String> {
    let a = Attrs::parse(attrs).map_err(|e| e.to_string())?;
    Ok(TableUsage {
        count: be32(&a, CTA_STATS_GLOBAL_ENTRIES, "CTA_STATS_GLOBAL_ENTRIES")?,
        max: be32(&a, CTA_STATS_GLOBAL_MAX_ENTRIES, "CTA_STATS_GLOBAL_MAX_ENTRIES")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_ctnetlink_stats_messages() {
        #[rustfmt::skip]
        let cpu: &[u8] = &[
            0x14, 0x00, 0x00, 0x00, // nlmsg_len 20
            0x04, 0x01,             // CTNETLINK << 8 | IPCTNL_MSG_CT_GET_STATS_CPU
            0x01, 0x03,             // NLM_F_REQUEST | NLM_F_DUMP
            0x05, 0x00, 0x00, 0x00, // seq 5
            0x00, 0x00, 0x00, 0x00, // port id
            0x00, 0x00, 0x00, 0x00, // nfgenmsg: AF_UNSPEC
        ];
        assert_eq!(cpu_request(5), cpu);
        let usage = usage_request(5);
        assert_eq!((usage[4], usage[6], usage[7]), (0x05, 0x01, 0x00));
    }

    #[test]
    fn replies_decode_big_endian_counters() {
        #[rustfmt::skip]
        let cpu: &[u8] = &[
            0x08, 0x00, 0x09, 0x00, 0x00, 0x00, 0x00, 0x07, // CTA_STATS_INSERT_FAILED 7
            0x08, 0x00, 0x0a, 0x00, 0x00, 0x00, 0x01, 0x00, // CTA_STATS_DROP 256
        ];
        let s = parse_cpu(cpu).expect("decodes");
        assert_eq!((s.insert_failed, s.drop, s.found), (7, 256, 0));
        let mut total = s;
        total.add(&s);
        assert_eq!(total.drop, 512);
        #[rustfmt::skip]
        let global: &[u8] = &[
            0x08, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x2a, // entries 42
            0x08, 0x00, 0x02, 0x00, 0x00, 0x04, 0x00, 0x00, // max 262144
        ];
        assert_eq!(
            parse_usage(global),
            Ok(TableUsage {
                count: 42,
                max: 262_144
            })
        );
        assert!(
            parse_cpu(&[0x08, 0x00]).is_err(),
            "a cut attribute is an error, not a panic"
        );
    }
}
