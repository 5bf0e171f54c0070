//! Byte fixtures: what `ipvsadm` 1.31 (libnl 3) sent to Debian's 6.1 kernel and what the kernel
//! answered, captured in the test VM with
//! `vm/run -- ip netns exec X strace -e trace=sendmsg,recvmsg -e write=all -e read=all ipvsadm ...`
//! in a fresh network namespace (lo up), one ipvsadm command after another (the commands are
//! named on each fixture; the IPVS family id was 0x20 in that kernel).
//!
//! Requests: ours must equal ipvsadm's bytes, given the same sequence number, with two
//! documented differences applied to the captured bytes here: the port id in the header is 0 in
//! ours (the kernel fills in the sender; libnl writes its own), and for commands that name an
//! existing service or real server we send only the identifying attributes (see `message`),
//! so the captured nest is cut down to those ([`identity_only`]); ipvsadm itself sends exactly
//! that form in its dump requests ([`DUMP_DESTS`]), which the kernel accepts. Each request is
//! also decoded back into the value it was made from.
//!
//! Replies: decoded into the values ipvsadm was told to create.

use std::net::IpAddr;

use proptest::prelude::*;

use super::message::*;
use super::types::*;
use super::wire::*;
use crate::model::{IpFamily, Protocol};
use crate::netlink::testing::hex;
use crate::netlink::{Attrs, NLA_TYPE_MASK, NLM_F_MULTI, NLMSG_HDRLEN, read_u16, read_u32, split_messages};

/// CTRL_CMD_GETFAMILY "IPVS".
const GET_FAMILY: &[&str] = &["20000000100005008c9e0d6b8500c04403010000090002004950565300000000"];

/// The controller's reply: IPVS is family 0x20.
const NEW_FAMILY: &[&str] = &[
    "84010000100000008c9e0d6b8500c0440102000009000200495056530000000006000100200000000800030001000000",
    "0800040000000000080005000600000044010600140001000800010001000000080002000b0000001400020008000100",
    "02000000080002000b000000140003000800010003000000080002000b00000014000400080001000400000008000200",
    "0f000000140005000800010005000000080002000b000000140006000800010006000000080002000b00000014000700",
    "0800010007000000080002000b000000140008000800010008000000080002000d000000140009000800010009000000",
    "080002000b00000014000a00080001000a000000080002000b00000014000b00080001000b000000080002000d000000",
    "14000c00080001000c000000080002000b00000014000d00080001000d000000080002000b00000014000e0008000100",
    "0f000000080002000b00000014000f000800010010000000080002000b00000014001000080001001100000008000200",
    "0b000000",
];

/// IPVS_CMD_GET_INFO.
const GET_INFO: &[&str] = &["14000000200005008e9e0d6b8500805f0f010000"];

/// Its reply.
const INFO_REPLY: &[&str] = &["24000000200000008e9e0d6b8500805f0e01000008000100010201000800020000100000"];

/// `ipvsadm -A -t 10.0.0.1:80 -s rr`
const NEW_SERVICE_RR: &[&str] = &[
    "68000000200005008e9e0d6b85004082010100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000007000600727200000c00070000000000ffffffff0800080000000000",
    "08000900ffffffff",
];

/// `ipvsadm -A -u [fd00::1]:53 -s wrr -p 600 -M 64`
const NEW_SERVICE_V6: &[&str] = &[
    "6800000020000500909e0d6b8900c0810101000054000180060001000a000000060002001100000014000300fd000000",
    "000000000000000000000001060004000035000008000600777272000c00070001000000ffffffff0800080058020000",
    "0800090040000000",
];

/// `ipvsadm -A --sctp-service 10.0.0.2:3868 -s sh -b sh-fallback,sh-port`
const NEW_SERVICE_SCTP_SH: &[&str] = &[
    "6800000020000500919e0d6b8d00408f010100005400018006000100020000000600020084000000140003000a000002",
    "000000000000000000000000060004000f1c000007000600736800000c00070018000000ffffffff0800080000000000",
    "08000900ffffffff",
];

/// `ipvsadm -A -t 10.0.0.3:443 -s mh -p -M 255.255.255.0 -b mh-port` (ipvsadm's default persistence: 360 s)
const NEW_SERVICE_MH: &[&str] = &[
    "6800000020000500929e0d6b9100408f010100005400018006000100020000000600020006000000140003000a000003",
    "0000000000000000000000000600040001bb0000070006006d6800000c00070011000000ffffffff0800080068010000",
    "08000900ffffff00",
];

/// `ipvsadm -A -f 7 -s lc`
const NEW_SERVICE_FWMARK: &[&str] = &[
    "4c00000020000500939e0d6b9500c08e010100003800018006000100020000000800050007000000070006006c630000",
    "0c00070000000000ffffffff080008000000000008000900ffffffff",
];

/// `ipvsadm -E -t 10.0.0.1:80 -s wlc -p 10800`
const SET_SERVICE: &[&str] = &[
    "6800000020000500949e0d6b9900008f020100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000008000600776c63000c00070001000000ffffffff08000800302a0000",
    "08000900ffffffff",
];

/// `ipvsadm -D -t 10.0.0.1:80`
const DEL_SERVICE: &[&str] = &[
    "6800000020000500ab9e0d6bd200c088030100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000005000600000000000c00070000000000ffffffff0800080000000000",
    "08000900ffffffff",
];

/// `ipvsadm -a -t 10.0.0.1:80 -r 10.244.0.2:8080 -m -w 3`
const NEW_DEST: &[&str] = &[
    "c800000020000500959e0d6b9d00008f050100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000005000600000000000c00070000000000ffffffff0800080000000000",
    "08000900ffffffff6000028006000b0002000000140001000af40002000000000000000000000000060002001f900000",
    "0800030000000000080004000300000005000d000000000006000e000000000006000f00000000000800050000000000",
    "0800060000000000",
];

/// `ipvsadm -a -t 10.0.0.1:80 -r 10.244.0.3:8080 -m -x 100 -y 10`
const NEW_DEST_THRESHOLDS: &[&str] = &[
    "c800000020000500959e0d6ba1004088050100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000005000600000000000c00070000000000ffffffff0800080000000000",
    "08000900ffffffff6000028006000b0002000000140001000af40003000000000000000000000000060002001f900000",
    "0800030000000000080004000100000005000d000000000006000e000000000006000f00000000000800050064000000",
    "080006000a000000",
];

/// `ipvsadm -a -u [fd00::1]:53 -r [fd00:244::5]:5353 -m`
const NEW_DEST_V6: &[&str] = &[
    "c800000020000500969e0d6ba50080880501000054000180060001000a000000060002001100000014000300fd000000",
    "000000000000000000000001060004000035000005000600000000000c00070000000000ffffffff0800080000000000",
    "08000900800000006000028006000b000a00000014000100fd0002440000000000000000000000050600020014e90000",
    "0800030000000000080004000100000005000d000000000006000e000000000006000f00000000000800050000000000",
    "0800060000000000",
];

/// `ipvsadm -e -t 10.0.0.1:80 -r 10.244.0.2:8080 -m -w 0`
const SET_DEST: &[&str] = &[
    "c800000020000500979e0d6ba900c08f060100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000005000600000000000c00070000000000ffffffff0800080000000000",
    "08000900ffffffff6000028006000b0002000000140001000af40002000000000000000000000000060002001f900000",
    "0800030000000000080004000000000005000d000000000006000e000000000006000f00000000000800050000000000",
    "0800060000000000",
];

/// `ipvsadm -d -t 10.0.0.1:80 -r 10.244.0.2:8080` (ipvsadm fills in its defaults: direct routing, weight 1)
const DEL_DEST: &[&str] = &[
    "c800000020000500a09e0d6bb900008e070100005400018006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000005000600000000000c00070000000000ffffffff0800080000000000",
    "08000900ffffffff6000028006000b0002000000140001000af40002000000000000000000000000060002001f900000",
    "0800030003000000080004000100000005000d000000000006000e000000000006000f00000000000800050000000000",
    "0800060000000000",
];

/// `ipvsadm -Ln`: the service dump request
const DUMP_SERVICES: &[&str] = &["1400000020000503989e0d6bad00008804010000"];

/// `ipvsadm --set 900 120 300`
const SET_CONFIG: &[&str] =
    &["2c00000020000500ae9e0d6bd600408a0c01000008000400840300000800050078000000080006002c010000"];

/// `ipvsadm --set 0 0 60`
const SET_CONFIG_KEEP: &[&str] =
    &["2c00000020000500b09e0d6bde00008a0c01000008000400000000000800050000000000080006003c000000"];

/// `ipvsadm -Ln --timeout`: the request
const GET_CONFIG: &[&str] = &["1400000020000500af9e0d6bda00808a0d010000"];

/// `ipvsadm -C`
const FLUSH: &[&str] = &["1400000020000500b29e0d6be600809711010000"];

/// `ipvsadm -Ln`: the dest dump request for TCP 10.0.0.1:80
const DUMP_DESTS: &[&str] = &[
    "4400000020000503999e0d6bad00c0b2080100003000018006000100020000000600020006000000140003000a000001",
    "0000000000000000000000000600040000500000",
];

/// `ipvsadm -Ln`: the service dump, one message per service (mh, sctp sh, udp v6 wrr, tcp wlc, fwmark lc)
const SERVICE_DUMP: &[&str] = &[
    "4001000020000200989e0d6bad000088010100002c01010006000100020000000600020006000000140003000a000003",
    "0000000000000000000000000600040001bb0000070006006d6800000c00070013000000ffffffff0800080068010000",
    "08000900ffffff005c000a000800010000000000080002000000000008000300000000000c0004000000000000000000",
    "0c0005000000000000000000080006000000000008000700000000000800080000000000080009000000000008000a00",
    "000000007c000c000c00010000000000000000000c00020000000000000000000c00030000000000000000000c000400",
    "00000000000000000c00050000000000000000000c00060000000000000000000c00070000000000000000000c000800",
    "00000000000000000c00090000000000000000000c000a000000000000000000",
    "4001000020000200989e0d6bad000088010100002c01010006000100020000000600020084000000140003000a000002",
    "000000000000000000000000060004000f1c000007000600736800000c0007001a000000ffffffff0800080000000000",
    "08000900ffffffff5c000a000800010000000000080002000000000008000300000000000c0004000000000000000000",
    "0c0005000000000000000000080006000000000008000700000000000800080000000000080009000000000008000a00",
    "000000007c000c000c00010000000000000000000c00020000000000000000000c00030000000000000000000c000400",
    "00000000000000000c00050000000000000000000c00060000000000000000000c00070000000000000000000c000800",
    "00000000000000000c00090000000000000000000c000a000000000000000000",
    "4001000020000200989e0d6bad000088010100002c010100060001000a000000060002001100000014000300fd000000",
    "000000000000000000000001060004000035000008000600777272000c00070003000000ffffffff0800080058020000",
    "08000900400000005c000a000800010000000000080002000000000008000300000000000c0004000000000000000000",
    "0c0005000000000000000000080006000000000008000700000000000800080000000000080009000000000008000a00",
    "000000007c000c000c00010000000000000000000c00020000000000000000000c00030000000000000000000c000400",
    "00000000000000000c00050000000000000000000c00060000000000000000000c00070000000000000000000c000800",
    "00000000000000000c00090000000000000000000c000a000000000000000000",
    "4001000020000200989e0d6bad000088010100002c01010006000100020000000600020006000000140003000a000001",
    "000000000000000000000000060004000050000008000600776c63000c00070003000000ffffffff08000800302a0000",
    "08000900ffffffff5c000a000800010000000000080002000000000008000300000000000c0004000000000000000000",
    "0c0005000000000000000000080006000000000008000700000000000800080000000000080009000000000008000a00",
    "000000007c000c000c00010000000000000000000c00020000000000000000000c00030000000000000000000c000400",
    "00000000000000000c00050000000000000000000c00060000000000000000000c00070000000000000000000c000800",
    "00000000000000000c00090000000000000000000c000a000000000000000000",
    "2401000020000200989e0d6bad000088010100001001010006000100020000000800050007000000070006006c630000",
    "0c00070002000000ffffffff080008000000000008000900ffffffff5c000a0008000100000000000800020000000000",
    "08000300000000000c00040000000000000000000c000500000000000000000008000600000000000800070000000000",
    "0800080000000000080009000000000008000a00000000007c000c000c00010000000000000000000c00020000000000",
    "000000000c00030000000000000000000c00040000000000000000000c00050000000000000000000c00060000000000",
    "000000000c00070000000000000000000c00080000000000000000000c00090000000000000000000c000a0000000000",
    "00000000",
];

/// The dest dump of TCP 10.0.0.1:80 (newest first: 10.244.0.3 with thresholds, 10.244.0.2 at weight 0)
const DEST_DUMP: &[&str] = &[
    "6401000020000200999e0d6bad00c0b20501000050010200140001000af4000300000000000000000000000006000200",
    "1f9000000800030000000000080004000100000005000d000000000006000e000000000006000f000000000008000500",
    "64000000080006000a00000008000700000000000800080000000000080009000000000006000b00020000005c000a00",
    "0800010000000000080002000000000008000300000000000c00040000000000000000000c0005000000000000000000",
    "080006000000000008000700000000000800080000000000080009000000000008000a00000000007c000c000c000100",
    "00000000000000000c00020000000000000000000c00030000000000000000000c00040000000000000000000c000500",
    "00000000000000000c00060000000000000000000c00070000000000000000000c00080000000000000000000c000900",
    "00000000000000000c000a000000000000000000",
    "6401000020000200999e0d6bad00c0b20501000050010200140001000af4000200000000000000000000000006000200",
    "1f9000000800030000000000080004000000000005000d000000000006000e000000000006000f000000000008000500",
    "00000000080006000000000008000700000000000800080000000000080009000000000006000b00020000005c000a00",
    "0800010000000000080002000000000008000300000000000c00040000000000000000000c0005000000000000000000",
    "080006000000000008000700000000000800080000000000080009000000000008000a00000000007c000c000c000100",
    "00000000000000000c00020000000000000000000c00030000000000000000000c00040000000000000000000c000500",
    "00000000000000000c00060000000000000000000c00070000000000000000000c00080000000000000000000c000900",
    "00000000000000000c000a000000000000000000",
];

/// The dest dump of UDP [fd00::1]:53
const DEST_DUMP_V6: &[&str] = &[
    "6401000020000200999e0d6bad00002b050100005001020014000100fd00024400000000000000000000000506000200",
    "14e900000800030000000000080004000100000005000d000000000006000e000000000006000f000000000008000500",
    "00000000080006000000000008000700000000000800080000000000080009000000000006000b000a0000005c000a00",
    "0800010000000000080002000000000008000300000000000c00040000000000000000000c0005000000000000000000",
    "080006000000000008000700000000000800080000000000080009000000000008000a00000000007c000c000c000100",
    "00000000000000000c00020000000000000000000c00030000000000000000000c00040000000000000000000c000500",
    "00000000000000000c00060000000000000000000c00070000000000000000000c00080000000000000000000c000900",
    "00000000000000000c000a000000000000000000",
];

/// NLMSG_DONE ending a dump
const DONE: &[&str] = &["1400000003000200989e0d6bad00008800000000"];

/// The GET_CONFIG reply: 900 120 300
const CONFIG_REPLY: &[&str] =
    &["2c00000020000000af9e0d6bda00808a0c01000008000400840300000800050078000000080006002c010000"];

/// `ipvsadm -D -t 10.0.0.9:80`: the error reply (not capped: the request is echoed)
const ERR_ESRCH: &[&str] = &[
    "7c00000002000000a59e0d6bc100008bfdffffff6800000020000500a59e0d6bc100008b030100005400018006000100",
    "020000000600020006000000140003000a00000900000000000000000000000006000400005000000500060000000000",
    "0c00070000000000ffffffff080008000000000008000900ffffffff",
];

/// `ipvsadm -A -t 10.0.0.1:80 -s rr` again
const ERR_EEXIST: &[&str] = &[
    "7c00000002000000a69e0d6bc5008094efffffff6800000020000500a69e0d6bc5008094010100005400018006000100",
    "020000000600020006000000140003000a00000100000000000000000000000006000400005000000700060072720000",
    "0c00070000000000ffffffff080008000000000008000900ffffffff",
];

/// `ipvsadm -A -t 10.0.0.9:80 -s nosuch`
const ERR_NO_SCHEDULER: &[&str] = &[
    "8000000002000000a89e0d6bc9000094feffffff6c00000020000500a89e0d6bc9000094010100005800018006000100",
    "020000000600020006000000140003000a00000900000000000000000000000006000400005000000b0006006e6f7375",
    "636800000c00070000000000ffffffff080008000000000008000900ffffffff",
];

/// `ipvsadm -d -t 10.0.0.1:80 -r 10.244.0.99:8080`
const ERR_NO_DEST: &[&str] = &[
    "dc00000002000000a29e0d6bbd008093feffffffc800000020000500a29e0d6bbd008093070100005400018006000100",
    "020000000600020006000000140003000a00000100000000000000000000000006000400005000000500060000000000",
    "0c00070000000000ffffffff080008000000000008000900ffffffff6000028006000b0002000000140001000af40063",
    "000000000000000000000000060002001f9000000800030003000000080004000100000005000d000000000006000e00",
    "0000000006000f000000000008000500000000000800060000000000",
];

const FAMILY: u16 = 0x20;

/// A captured request as we send it: port id 0.
fn sent(lines: &[&str]) -> Vec<u8> {
    let mut b = hex(lines);
    b[12..16].copy_from_slice(&[0; 4]);
    b
}

fn seq_of(msg: &[u8]) -> u32 {
    read_u32(msg, 8).expect("header")
}

/// `msg` with each listed nest reduced to the listed inner attributes (kept in their order),
/// lengths fixed up.
fn identity_only(msg: &[u8], keep: &[(u16, &[u16])]) -> Vec<u8> {
    let body_at = NLMSG_HDRLEN + GENL_HDRLEN;
    let mut out = msg[..body_at].to_vec();
    let mut at = body_at;
    while at < msg.len() {
        let len = read_u16(msg, at).expect("attr") as usize;
        let raw_ty = read_u16(msg, at + 2).expect("attr");
        let attr = &msg[at..at + len];
        match keep.iter().find(|(t, _)| *t == raw_ty & NLA_TYPE_MASK) {
            None => out.extend_from_slice(&msg[at..at + ((len + 3) & !3)]),
            Some((_, inner)) => {
                let start = out.len();
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&raw_ty.to_ne_bytes());
                let mut i = 4;
                while i < len {
                    let ilen = read_u16(attr, i).expect("inner") as usize;
                    let ity = read_u16(attr, i + 2).expect("inner") & NLA_TYPE_MASK;
                    if inner.contains(&ity) {
                        out.extend_from_slice(&attr[i..i + ((ilen + 3) & !3)]);
                    }
                    i += (ilen + 3) & !3;
                }
                let nlen = (out.len() - start) as u16;
                out[start..start + 2].copy_from_slice(&nlen.to_ne_bytes());
            }
        }
        at += (len + 3) & !3;
    }
    let total = out.len() as u32;
    out[..4].copy_from_slice(&total.to_ne_bytes());
    out
}

const SERVICE_IDENTITY: (u16, &[u16]) = (
    IPVS_CMD_ATTR_SERVICE,
    &[
        IPVS_SVC_ATTR_AF, IPVS_SVC_ATTR_PROTOCOL, IPVS_SVC_ATTR_ADDR, IPVS_SVC_ATTR_PORT, IPVS_SVC_ATTR_FWMARK,
    ],
);
const DEST_IDENTITY: (u16, &[u16]) = (
    IPVS_CMD_ATTR_DEST,
    &[IPVS_DEST_ATTR_ADDR_FAMILY, IPVS_DEST_ATTR_ADDR, IPVS_DEST_ATTR_PORT],
);

/// Hex dump around the first differing byte, for a readable failure.
fn assert_bytes(name: &str, got: &[u8], want: &[u8]) {
    crate::netlink::testing::assert_bytes(name, "ipvsadm", got, want);
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

/// The top-level attributes of one message we encoded.
fn attrs_of(msg: &[u8]) -> (u8, Attrs<'_>) {
    let msgs = split_messages(msg).expect("framed");
    assert_eq!(msgs.len(), 1);
    let (cmd, version, attrs) = genl_payload(msgs[0].payload).expect("genl");
    assert_eq!(version, IPVS_GENL_VERSION);
    (cmd, attrs)
}

/// Our service request decodes back into the service it was made from.
fn service_round_trip(msg: &[u8], want_cmd: u8, vs: &VirtualServer) {
    let (cmd, attrs) = attrs_of(msg);
    assert_eq!(cmd, want_cmd);
    let nest = attrs.nested(IPVS_CMD_ATTR_SERVICE).expect("nest").expect("service");
    assert_eq!(&decode_service(&nest).expect("decodes"), vs);
}

/// Our real-server request names `vs` and decodes back into `rs` (or its key).
fn dest_round_trip(msg: &[u8], want_cmd: u8, vs: &VirtualServer, rs: &RealServer, full: bool) {
    let (cmd, attrs) = attrs_of(msg);
    assert_eq!(cmd, want_cmd);
    let svc = attrs.nested(IPVS_CMD_ATTR_SERVICE).expect("nest").expect("service");
    assert_eq!(decode_service_key(&svc).expect("key"), vs.key());
    let dest = attrs.nested(IPVS_CMD_ATTR_DEST).expect("nest").expect("dest");
    let got = decode_dest(&dest, vs.family()).expect("decodes");
    if full {
        assert_eq!(&got, rs);
    } else {
        assert_eq!(got.key(), rs.key());
    }
}

fn tcp80() -> VirtualServer {
    VirtualServer::new(ip("10.0.0.1"), Protocol::Tcp, 80, "rr")
}

fn udp_v6() -> VirtualServer {
    VirtualServer {
        netmask: 64,
        ..VirtualServer::new(ip("fd00::1"), Protocol::Udp, 53, "wrr").with_persistence(600)
    }
}

fn sctp_sh() -> VirtualServer {
    VirtualServer::new(ip("10.0.0.2"), Protocol::Sctp, 3868, "sh")
        .with_flags(ServiceFlags::SH_FALLBACK | ServiceFlags::SH_PORT)
}

fn tcp_mh() -> VirtualServer {
    VirtualServer {
        netmask: 0xffff_ff00,
        ..VirtualServer::new(ip("10.0.0.3"), Protocol::Tcp, 443, "mh")
            .with_persistence(360)
            .with_flags(ServiceFlags::MH_PORT)
    }
}

fn fwmark7() -> VirtualServer {
    VirtualServer::fwmark(IpFamily::V4, 7, "lc")
}

/// `tcp80` after `ipvsadm -E -t 10.0.0.1:80 -s wlc -p 10800`.
fn tcp80_edited() -> VirtualServer {
    VirtualServer {
        scheduler: "wlc".into(),
        ..tcp80().with_persistence(10800)
    }
}

#[test]
fn family_resolution() {
    let want = sent(GET_FAMILY);
    assert_bytes("GETFAMILY", &encode_get_family(seq_of(&want)), &want);
    let reply = hex(NEW_FAMILY);
    let msgs = split_messages(&reply).expect("framed");
    assert_eq!(
        decode_family(msgs[0].payload).expect("decodes"),
        Family {
            id: 0x20,
            version: 1,
            max_attr: 6
        }
    );
}

#[test]
fn info() {
    let want = sent(GET_INFO);
    assert_bytes("GET_INFO", &encode(&Request::GetInfo, FAMILY, seq_of(&want)), &want);
    let reply = hex(INFO_REPLY);
    let msgs = split_messages(&reply).expect("framed");
    let info = decode_info(msgs[0].payload, msgs[0].msg_type).expect("decodes");
    assert_eq!(
        info,
        Info {
            version: 0x010201,
            conn_table_size: 4096
        }
    );
    assert_eq!(info.version_string(), "1.2.1");
}

#[test]
fn add_and_edit_services() {
    for (name, fixture, vs, cmd) in [
        ("rr", NEW_SERVICE_RR, tcp80(), IPVS_CMD_NEW_SERVICE),
        ("udp v6 persistent /64", NEW_SERVICE_V6, udp_v6(), IPVS_CMD_NEW_SERVICE),
        ("sctp sh flags", NEW_SERVICE_SCTP_SH, sctp_sh(), IPVS_CMD_NEW_SERVICE),
        ("mh persistent mask", NEW_SERVICE_MH, tcp_mh(), IPVS_CMD_NEW_SERVICE),
        ("fwmark", NEW_SERVICE_FWMARK, fwmark7(), IPVS_CMD_NEW_SERVICE),
        ("edit", SET_SERVICE, tcp80_edited(), IPVS_CMD_SET_SERVICE),
    ] {
        let want = sent(fixture);
        let req = if cmd == IPVS_CMD_NEW_SERVICE {
            Request::NewService(&vs)
        } else {
            Request::SetService(&vs)
        };
        let ours = encode(&req, FAMILY, seq_of(&want));
        assert_bytes(name, &ours, &want);
        service_round_trip(&ours, cmd, &vs);
    }
}

#[test]
fn delete_service() {
    let want = identity_only(&sent(DEL_SERVICE), &[SERVICE_IDENTITY]);
    let ours = encode(&Request::DelService(&tcp80_edited()), FAMILY, seq_of(&want));
    assert_bytes("DEL_SERVICE", &ours, &want);
    let (cmd, attrs) = attrs_of(&ours);
    assert_eq!(cmd, IPVS_CMD_DEL_SERVICE);
    let nest = attrs.nested(IPVS_CMD_ATTR_SERVICE).expect("nest").expect("service");
    assert_eq!(decode_service_key(&nest).expect("key"), tcp80().key());
}

#[test]
fn real_servers() {
    let w3 = RealServer::new(ip("10.244.0.2"), 8080, 3);
    let thresholds = RealServer {
        upper_threshold: 100,
        lower_threshold: 10,
        ..RealServer::new(ip("10.244.0.3"), 8080, 1)
    };
    let v6 = RealServer::new(ip("fd00:244::5"), 5353, 1);
    let w0 = RealServer::new(ip("10.244.0.2"), 8080, 0);
    for (name, fixture, vs, rs, cmd) in [
        ("add", NEW_DEST, tcp80_edited(), &w3, IPVS_CMD_NEW_DEST),
        (
            "add thresholds",
            NEW_DEST_THRESHOLDS,
            tcp80_edited(),
            &thresholds,
            IPVS_CMD_NEW_DEST,
        ),
        ("add v6", NEW_DEST_V6, udp_v6(), &v6, IPVS_CMD_NEW_DEST),
        ("edit weight 0", SET_DEST, tcp80_edited(), &w0, IPVS_CMD_SET_DEST),
    ] {
        let want = identity_only(&sent(fixture), &[SERVICE_IDENTITY]);
        let req = if cmd == IPVS_CMD_NEW_DEST {
            Request::NewDest(&vs, rs)
        } else {
            Request::SetDest(&vs, rs)
        };
        let ours = encode(&req, FAMILY, seq_of(&want));
        assert_bytes(name, &ours, &want);
        dest_round_trip(&ours, cmd, &vs, rs, true);
    }
    let want = identity_only(&sent(DEL_DEST), &[SERVICE_IDENTITY, DEST_IDENTITY]);
    let ours = encode(&Request::DelDest(&tcp80_edited(), &w3), FAMILY, seq_of(&want));
    assert_bytes("DEL_DEST", &ours, &want);
    dest_round_trip(&ours, IPVS_CMD_DEL_DEST, &tcp80_edited(), &w3, false);
}

#[test]
fn dump_requests() {
    let want = sent(DUMP_SERVICES);
    assert_bytes(
        "GET_SERVICE dump",
        &encode(&Request::DumpServices, FAMILY, seq_of(&want)),
        &want,
    );
    // ipvsadm's own dump request carries the identity form unchanged.
    let want = sent(DUMP_DESTS);
    assert_bytes(
        "GET_DEST dump",
        &encode(&Request::DumpDests(&tcp80_edited()), FAMILY, seq_of(&want)),
        &want,
    );
}

/// The kernel's dump lists what the ipvsadm commands created, as our values say it.
#[test]
fn service_and_dest_dumps() {
    let dump = hex(SERVICE_DUMP);
    let got: Vec<VirtualServer> = split_messages(&dump)
        .expect("framed")
        .iter()
        .map(|m| {
            assert_eq!(m.flags & NLM_F_MULTI, NLM_F_MULTI);
            decode_service_msg(m.payload, m.msg_type).expect("decodes")
        })
        .collect();
    assert_eq!(got, vec![tcp_mh(), sctp_sh(), udp_v6(), tcp80_edited(), fwmark7()]);

    let dump = hex(DEST_DUMP);
    let got: Vec<RealServer> = split_messages(&dump)
        .expect("framed")
        .iter()
        .map(|m| decode_dest_msg(m.payload, m.msg_type, IpFamily::V4).expect("decodes"))
        .collect();
    assert_eq!(
        got,
        vec![
            RealServer {
                upper_threshold: 100,
                lower_threshold: 10,
                ..RealServer::new(ip("10.244.0.3"), 8080, 1)
            },
            RealServer::new(ip("10.244.0.2"), 8080, 0),
        ]
    );
    let dump = hex(DEST_DUMP_V6);
    let msgs = split_messages(&dump).expect("framed");
    // The family comes from the dest's own attribute, whatever the caller assumed.
    assert_eq!(
        decode_dest_msg(msgs[0].payload, msgs[0].msg_type, IpFamily::V4).expect("decodes"),
        RealServer::new(ip("fd00:244::5"), 5353, 1)
    );

    let done = hex(DONE);
    assert_eq!(
        parse_replies(&done).expect("parses"),
        vec![Reply::Done {
            seq: seq_of(&done),
            errno: 0
        }]
    );
}

#[test]
fn timeouts_and_flush() {
    for (name, fixture, t) in [
        (
            "set",
            SET_CONFIG,
            Timeouts {
                tcp: 900,
                tcp_fin: 120,
                udp: 300,
            },
        ),
        (
            "set, keeping tcp and tcpfin",
            SET_CONFIG_KEEP,
            Timeouts {
                tcp: 0,
                tcp_fin: 0,
                udp: 60,
            },
        ),
    ] {
        let want = sent(fixture);
        assert_bytes(name, &encode(&Request::SetConfig(&t), FAMILY, seq_of(&want)), &want);
    }
    let want = sent(GET_CONFIG);
    assert_bytes("GET_CONFIG", &encode(&Request::GetConfig, FAMILY, seq_of(&want)), &want);
    let reply = hex(CONFIG_REPLY);
    let msgs = split_messages(&reply).expect("framed");
    assert_eq!(
        decode_timeouts(msgs[0].payload, msgs[0].msg_type).expect("decodes"),
        Timeouts::KERNEL_DEFAULT
    );
    let want = sent(FLUSH);
    assert_bytes("FLUSH", &encode(&Request::Flush, FAMILY, seq_of(&want)), &want);
}

/// The kernel's refusals: errno (negative) and the refused request's sequence number.
#[test]
fn error_replies() {
    for (name, fixture, errno) in [
        ("delete missing service", ERR_ESRCH, -3),
        ("add existing service", ERR_EEXIST, -17),
        ("unknown scheduler", ERR_NO_SCHEDULER, -2),
        ("delete missing real server", ERR_NO_DEST, -2),
    ] {
        let bytes = hex(fixture);
        // The echoed request starts after the errno; its sequence number is the reply's.
        let echoed_seq = read_u32(&bytes, NLMSG_HDRLEN + 4 + 8).expect("echo");
        assert_eq!(
            parse_replies(&bytes).expect("parses"),
            vec![Reply::Error {
                seq: echoed_seq,
                errno,
                message: None
            }],
            "{name}"
        );
    }
}

/// Every prefix of every captured datagram: an error or a value, never a panic.
#[test]
fn truncated_replies_do_not_panic() {
    for fixture in [
        NEW_FAMILY, INFO_REPLY, SERVICE_DUMP, DEST_DUMP, DEST_DUMP_V6, CONFIG_REPLY, ERR_ESRCH, DONE,
    ] {
        let bytes = hex(fixture);
        for n in 0..bytes.len() {
            let Ok(msgs) = split_messages(&bytes[..n]) else {
                continue;
            };
            for m in msgs {
                let _ = decode_service_msg(m.payload, m.msg_type);
                let _ = decode_dest_msg(m.payload, m.msg_type, IpFamily::V4);
                let _ = decode_info(m.payload, m.msg_type);
                let _ = decode_timeouts(m.payload, m.msg_type);
                let _ = decode_family(m.payload);
            }
            let _ = parse_replies(&bytes[..n]);
        }
    }
}

fn arb_service() -> impl Strategy<Value = VirtualServer> {
    let addr = prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u8; 16]>().prop_map(IpAddr::from),
    ];
    let protocol = prop_oneof![Just(Protocol::Tcp), Just(Protocol::Udp), Just(Protocol::Sctp)];
    (
        addr,
        protocol,
        any::<u16>(),
        proptest::option::of(1u32..),
        proptest::sample::select(super::fake::KERNEL_SCHEDULERS),
        proptest::option::of(any::<u32>()),
        0u32..0x40,
        any::<u32>(),
    )
        .prop_map(|(address, protocol, port, fwmark, sched, timeout, flags, netmask)| {
            let mut vs = match fwmark {
                Some(mark) => VirtualServer::fwmark(IpFamily::of(&address), mark, sched),
                None => VirtualServer::new(address, protocol, port, sched),
            };
            vs.persistent_timeout = timeout;
            // Persistence is `persistent_timeout`; the hashed bit is the kernel's.
            vs.flags = ServiceFlags(flags & !0x3);
            vs.netmask = netmask;
            vs
        })
}

fn arb_dest() -> impl Strategy<Value = RealServer> {
    let addr = prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u8; 16]>().prop_map(IpAddr::from),
    ];
    (addr, any::<u16>(), any::<u32>(), 0u32..8, any::<u32>(), any::<u32>()).prop_map(
        |(address, port, weight, fwd, upper, lower)| RealServer {
            forward: Forward::from_raw(fwd),
            upper_threshold: upper,
            lower_threshold: lower,
            ..RealServer::new(address, port, weight)
        },
    )
}

proptest! {
    #[test]
    fn services_round_trip(vs in arb_service(), seq in any::<u32>()) {
        let bytes = encode(&Request::NewService(&vs), FAMILY, seq);
        service_round_trip(&bytes, IPVS_CMD_NEW_SERVICE, &vs);
    }

    #[test]
    fn dests_round_trip(vs in arb_service(), rs in arb_dest(), seq in any::<u32>()) {
        let bytes = encode(&Request::NewDest(&vs, &rs), FAMILY, seq);
        dest_round_trip(&bytes, IPVS_CMD_NEW_DEST, &vs, &rs, true);
    }

    #[test]
    fn garbage_does_not_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(msgs) = split_messages(&bytes) {
            for m in msgs {
                let _ = decode_service_msg(m.payload, m.msg_type);
                let _ = decode_dest_msg(m.payload, m.msg_type, IpFamily::V6);
                let _ = decode_family(m.payload);
            }
        }
        let _ = parse_replies(&bytes);
    }
}
