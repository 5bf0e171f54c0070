//! Byte fixtures: for a few transactions, the exact batch nft 1.0.6 sends for their text form
//! (captured with `strace -e write=all nft -f FILE` in a throw-away network namespace, after a
//! preparatory `nft -f` that created the table and chains they refer to), compared with ours.
//!
//! The captured bytes are kept as nft sent them; the two documented differences of [`encode`]
//! are applied to them in [`expected`]: `NLM_F_ACK` on the last command message, and our
//! concrete anonymous-set name (`__set10` / `__map10`, counter started at 10 so that the name
//! has the length of nft's `__set%d`). Sequence numbers agree as they are: nft numbers its
//! batch from 0, as `encode_with(tx, 0, …)` does.

use ipnet::IpNet;

use super::encode::{AnonSetNames, encode_with};
use super::wire::NFNL_MSG_BATCH_END;
use crate::model::{IpFamily, Protocol};
use crate::netlink::NLM_F_ACK;
use crate::netlink::testing::hex;
use crate::nftables::ast::*;

fn net(s: &str) -> IpNet {
    s.parse().expect("test CIDR")
}

/// nft's bytes with our two deliberate differences applied.
fn expected(lines: &[&str]) -> Vec<u8> {
    let mut b = hex(lines);
    // NLM_F_ACK on the message before NFNL_MSG_BATCH_END.
    let mut at = 0;
    let mut last = None;
    while at + 16 <= b.len() {
        let len = u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
        let ty = u16::from_ne_bytes(b[at + 4..at + 6].try_into().expect("2 bytes"));
        if ty == NFNL_MSG_BATCH_END {
            break;
        }
        last = Some(at);
        at += (len + 3) & !3;
    }
    if let Some(m) = last.filter(|&m| m > 0) {
        let flags = u16::from_ne_bytes(b[m + 6..m + 8].try_into().expect("2 bytes")) | NLM_F_ACK;
        b[m + 6..m + 8].copy_from_slice(&flags.to_ne_bytes());
    }
    // `__set%d` / `__map%d` → `__set10` / `__map10` (same length).
    for prefix in [&b"__set%d\0"[..], &b"__map%d\0"[..]] {
        let mut i = 0;
        while let Some(pos) = b[i..].windows(prefix.len()).position(|w| w == prefix) {
            let at = i + pos + 5;
            b[at..at + 2].copy_from_slice(b"10");
            i = at;
        }
    }
    b
}

fn ours(tx: &Transaction) -> Vec<u8> {
    encode_with(tx, 0, &mut AnonSetNames::starting_at(10)).bytes
}

/// Hex dump with the first differing offset, for a readable failure.
fn assert_bytes(name: &str, got: &[u8], want: &[u8]) {
    crate::netlink::testing::assert_bytes(name, "nft", got, want);
}

fn tx(family: IpFamily, ops: Vec<Op>) -> Transaction {
    Transaction { family, ops }
}

fn rule(chain: &str, r: Rule) -> Op {
    Op::AddRule {
        chain: chain.into(),
        rule: r,
    }
}

/// `add table ip kube-proxy { comment "rules for kube-proxy" ; }`: the batch framing, the
/// table and its comment userdata.
#[test]
fn table_and_batch_framing() {
    assert_bytes(
        "table",
        &ours(&tx(IpFamily::V4, vec![Op::AddTable])),
        &expected(NFT_TABLE),
    );
}

/// A base chain (ip6) and a regular chain with a comment.
#[test]
fn chains() {
    let t = tx(
        IpFamily::V6,
        vec![
            Op::AddChain(ChainDecl {
                name: "nat-prerouting".into(),
                base: Some(BaseHook {
                    kind: "nat",
                    hook: "prerouting",
                    priority: -100,
                }),
                comment: None,
            }),
            Op::AddChain(ChainDecl {
                name: "reject-chain".into(),
                base: None,
                comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".into()),
            }),
        ],
    );
    assert_bytes("chains", &ours(&t), &expected(NFT_CHAINS));
}

/// A verdict map keyed by a concatenation, with its comment, and one element with a comment.
#[test]
fn map_and_element() {
    let t = tx(
        IpFamily::V4,
        vec![
            Op::AddSet(SetDecl {
                name: "service-ips".into(),
                key: KeyType::AddrProtoPort,
                map: Some(MapValue::Verdict),
                timeout_seconds: None,
                comment: Some("ClusterIP, ExternalIP and LoadBalancer IP traffic".into()),
            }),
            Op::AddElement {
                set: "service-ips".into(),
                element: Element {
                    key: ElemKey::AddrProtoPort("10.96.0.1".parse().expect("ip"), Protocol::Tcp, 80),
                    value: Some(Verdict::Goto("c".into()).into()),
                    comment: Some("ns/svc:http".into()),
                },
            },
        ],
    );
    assert_bytes("map", &ours(&t), &expected(NFT_MAP_ELEMENT));
}

/// A ClientIP-affinity set (timeout, dynamic), a lookup in it and the dynset update.
#[test]
fn affinity_set_and_rules() {
    let t = tx(
        IpFamily::V4,
        vec![
            Op::AddSet(SetDecl {
                name: "affinity-X".into(),
                key: KeyType::Addr,
                map: None,
                timeout_seconds: Some(10800),
                comment: None,
            }),
            rule(
                "c",
                Rule::verdict(
                    vec![Match::Addr {
                        dir: Dir::Saddr,
                        negate: false,
                        spec: AddrSpec::Set("affinity-X".into()),
                    }],
                    Verdict::Goto("c".into()),
                ),
            ),
            rule("c", Rule::new(vec![], Statement::UpdateSaddr("affinity-X".into()))),
        ],
    );
    assert_bytes("affinity", &ours(&t), &expected(NFT_AFFINITY));
}

/// ct state, address and prefix matches, marks, masquerade, dnat, an interface prefix, fib,
/// and a rule comment.
#[test]
fn rule_shapes() {
    let jump = || Verdict::Jump("c".into());
    let t = tx(
        IpFamily::V4,
        vec![
            rule("c", Rule::verdict(vec![Match::CtStateNew], jump())),
            rule(
                "c",
                Rule::verdict(
                    vec![
                        Match::Addr {
                            dir: Dir::Daddr,
                            negate: false,
                            spec: AddrSpec::Net(net("10.96.0.1/32")),
                        },
                        Match::Addr {
                            dir: Dir::Saddr,
                            negate: true,
                            spec: AddrSpec::Net(net("10.244.0.0/16")),
                        },
                    ],
                    jump(),
                ),
            ),
            rule("c", Rule::verdict(vec![Match::MarkAndZero(0x4000)], Verdict::Return)),
            rule("c", Rule::new(vec![], Statement::MarkSetOr(0x4000))),
            rule("c", Rule::new(vec![], Statement::Masquerade)),
            rule(
                "c",
                Rule::new(
                    vec![Match::L4proto(Protocol::Tcp)],
                    Statement::Dnat("10.244.1.5:8080".parse().expect("sockaddr")),
                ),
            ),
            rule(
                "c",
                Rule::verdict(
                    vec![Match::Iifname {
                        negate: true,
                        pattern: "veth*".into(),
                    }],
                    Verdict::Accept,
                ),
            ),
            rule(
                "c",
                Rule::verdict(vec![Match::FibLocal(Dir::Daddr)], jump()).with_comment("local"),
            ),
        ],
    );
    assert_bytes("rules", &ours(&t), &expected(NFT_RULES));
}

/// `numgen random mod 2 vmap { … }`: the anonymous constant map, its elements, the rule.
#[test]
fn numgen_vmap() {
    let t = tx(
        IpFamily::V4,
        vec![rule(
            "c",
            Rule::new(vec![], Statement::NumgenVmap(vec!["c".into(), "c".into()])),
        )],
    );
    assert_bytes("numgen", &ours(&t), &expected(NFT_NUMGEN));
}

/// An anonymous interval set of CIDRs (ip6, negated), with merged adjacent hosts.
#[test]
fn anonymous_cidr_set() {
    let t = tx(
        IpFamily::V6,
        vec![rule(
            "c",
            Rule::verdict(
                vec![Match::Addr {
                    dir: Dir::Saddr,
                    negate: true,
                    spec: AddrSpec::AnonSet {
                        items: vec![net("2001:db8::/64"), net("fd00::1/128"), net("fd00::2/128")],
                        compact: false,
                    },
                }],
                Verdict::Drop,
            ),
        )],
    );
    assert_bytes("anon set", &ours(&t), &expected(NFT_ANON_CIDR_SET));
}

/// Element deletion, map flush, chain flush, chain/set/table deletion.
#[test]
fn deletes_and_flushes() {
    let t = tx(
        IpFamily::V4,
        vec![
            Op::DeleteElement {
                set: "s".into(),
                key: ElemKey::Addr("10.0.0.1".parse().expect("ip")),
            },
            Op::FlushSet {
                name: "m".into(),
                map: true,
            },
            Op::FlushChain("c".into()),
            Op::DeleteChain("d".into()),
            Op::DeleteSet {
                name: "s".into(),
                map: false,
            },
            Op::DeleteTable,
        ],
    );
    assert_bytes("deletes", &ours(&t), &expected(NFT_DELETES));
}

#[test]
fn every_message_maps_to_its_op() {
    let t = tx(
        IpFamily::V4,
        vec![
            Op::AddTable,
            Op::AddChain(ChainDecl::regular("c")),
            rule("c", Rule::new(vec![], Statement::NumgenVmap(vec!["c".into(); 3]))),
            Op::FlushChain("c".into()),
        ],
    );
    let b = encode_with(&t, 100, &mut AnonSetNames::starting_at(0));
    // table, chain, (map, its elements, rule), flush.
    assert_eq!(b.op_of_message, vec![0, 1, 2, 2, 2, 3]);
    assert_eq!(b.op_index(101), Some(0));
    assert_eq!(b.op_index(105), Some(2));
    assert_eq!(b.op_index(106), Some(3));
    assert_eq!(b.op_index(100), None);
    assert_eq!(b.op_index(107), None);
    assert_eq!(b.end_seq(), 107);
}

#[test]
fn long_element_lists_are_split_under_64k() {
    let chains: Vec<String> = (0..2000)
        .map(|i| format!("endpoint-ABCDEFGH-ns/svc/tcp/http__10.1.{}.{}/80", i / 250, i % 250))
        .collect();
    let t = tx(
        IpFamily::V4,
        vec![rule("c", Rule::new(vec![], Statement::NumgenVmap(chains)))],
    );
    let b = encode_with(&t, 0, &mut AnonSetNames::starting_at(0));
    assert!(b.messages() >= 4, "{b}");
    let mut at = 0;
    while at < b.bytes.len() {
        let len = u32::from_ne_bytes(b.bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        assert!(len < 65536, "message of {len} bytes at {at}");
        at += (len + 3) & !3;
    }
}

/// nft's batch for:
/// add table ip kube-proxy { comment "rules for kube-proxy" ; }
const NFT_TABLE: &[&str] = &[
    "140000001000010000000000000000000000000a48000000000a010001000000",
    "00000000020000000f0001006b7562652d70726f787900000800020000000000",
    "1b000600001572756c657320666f72206b7562652d70726f7879000014000000",
    "1100010002000000000000000000000a",
];

/// nft's batch for:
/// add chain ip6 kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
/// add chain ip6 kube-proxy reject-chain { comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }
const NFT_CHAINS: &[&str] = &[
    "140000001000010000000000000000000000000a54000000030a010401000000",
    "000000000a0000000f0001006b7562652d70726f78790000130003006e61742d",
    "707265726f7574696e670000080007006e617400140004800800010000000000",
    "08000200ffffff9c78000000030a010402000000000000000a0000000f000100",
    "6b7562652d70726f787900001100030072656a6563742d636861696e00000000",
    "40000c00003a68656c70657220666f7220406e6f2d656e64706f696e742d7365",
    "727669636573202f20406e6f2d656e64706f696e742d6e6f6465706f72747300",
    "140000001100010003000000000000000000000a",
];

/// nft's batch for:
/// add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }
/// add element ip kube-proxy service-ips { 10.96.0.1 . tcp . 80 comment "ns/svc:http" : goto c }
const NFT_MAP_ELEMENT: &[&str] = &[
    "140000001000010000000000000000000000000ab8000000090a010401000000",
    "00000000020000000f0001006b7562652d70726f787900001000020073657276",
    "6963652d697073000800030000000008080004000000730d080005000000000c",
    "08000600ffffff00080007000000000008000a000000000154000d0000040000",
    "0000010400000000030800040d00000001000604000000000732436c75737465",
    "7249502c2045787465726e616c495020616e64204c6f616442616c616e636572",
    "204950207472616666696300840000000c0a0104020000000000000002000000",
    "0f0001006b7562652d70726f7879000010000200736572766963652d69707300",
    "0800040000000001480003804400018014000180100001000a60000106000000",
    "00500000180002801400028008000100fffffffc060002006300000012000600",
    "000c6e732f7376633a6874747000000014000000110001000300000000000000",
    "0000000a",
];

/// nft's batch for:
/// add set ip kube-proxy affinity-X { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }
/// add rule ip kube-proxy c ip saddr @affinity-X goto c
/// add rule ip kube-proxy c update @affinity-X { ip saddr }
const NFT_AFFINITY: &[&str] = &[
    "140000001000010000000000000000000000000a6c000000090a010401000000",
    "00000000020000000f0001006b7562652d70726f787900000f00020061666669",
    "6e6974792d580000080003000000003008000400000000070800050000000004",
    "08000a00000000010c000b000000000000a4cb800a000d000004020000000000",
    "d0000000060a010c0200000000000000020000000f0001006b7562652d70726f",
    "787900000600020063000000a4000480340001800c0001007061796c6f616400",
    "2400028008000100000000010800020000000001080003000000000c08000400",
    "00000004340001800b0001006c6f6f6b75700000240002800800020000000001",
    "0f000100616666696e6974792d5800000800040000000001380001800e000100",
    "696d6d6564696174650000002400028008000100000000001800028014000280",
    "08000100fffffffc0600020063000000a0000000060a010c0300000000000000",
    "020000000f0001006b7562652d70726f78790000060002006300000074000480",
    "340001800c0001007061796c6f61640024000280080001000000000108000200",
    "00000001080003000000000c08000400000000043c0001800b00010064796e73",
    "657400002c000280080004000000000108000300000000010f00010061666669",
    "6e6974792d580000080002000000000114000000110001000400000000000000",
    "0000000a",
];

/// nft's batch for:
/// add rule ip kube-proxy c ct state new jump c
/// add rule ip kube-proxy c ip daddr 10.96.0.1 ip saddr != 10.244.0.0/16 jump c
/// add rule ip kube-proxy c mark and 0x004000 == 0 return
/// add rule ip kube-proxy c mark set mark or 0x004000
/// add rule ip kube-proxy c masquerade fully-random
/// add rule ip kube-proxy c meta l4proto tcp dnat to 10.244.1.5:8080
/// add rule ip kube-proxy c iifname != veth* accept
/// add rule ip kube-proxy c fib daddr type local jump c comment "local"
const NFT_RULES: &[&str] = &[
    "140000001000010000000000000000000000000af8000000060a010c01000000",
    "00000000020000000f0001006b7562652d70726f787900000600020063000000",
    "cc00048020000180070001006374000014000280080002000000000008000100",
    "00000001440001800c0001006269747769736500340002800800010000000001",
    "080002000000000108000300000000040c00048008000100080000000c000580",
    "08000100000000002c00018008000100636d7000200002800800010000000001",
    "08000200000000010c0003800800010000000000380001800e000100696d6d65",
    "6469617465000000240002800800010000000000180002801400028008000100",
    "fffffffd060002006300000028010000060a010c020000000000000002000000",
    "0f0001006b7562652d70726f787900000600020063000000fc00048034000180",
    "0c0001007061796c6f6164002400028008000100000000010800020000000001",
    "080003000000001008000400000000042c00018008000100636d700020000280",
    "080001000000000108000200000000000c000380080001000a60000134000180",
    "0c0001007061796c6f6164002400028008000100000000010800020000000001",
    "080003000000000c08000400000000022c00018008000100636d700020000280",
    "080001000000000108000200000000010c000380060001000af4000038000180",
    "0e000100696d6d65646961746500000024000280080001000000000018000280",
    "1400028008000100fffffffd0600020063000000fc000000060a010c03000000",
    "00000000020000000f0001006b7562652d70726f787900000600020063000000",
    "d000048024000180090001006d65746100000000140002800800020000000003",
    "08000100000000014c0001800c00010062697477697365003c00028008000100",
    "000000010800020000000001080006000000000008000300000000040c000480",
    "08000100004000000c00058008000100000000002c00018008000100636d7000",
    "20000280080001000000000108000200000000000c0003800800010000000000",
    "300001800e000100696d6d6564696174650000001c0002800800010000000000",
    "100002800c00028008000100fffffffbc4000000060a010c0400000000000000",
    "020000000f0001006b7562652d70726f78790000060002006300000098000480",
    "24000180090001006d6574610000000014000280080002000000000308000100",
    "000000014c0001800c00010062697477697365003c0002800800010000000001",
    "0800020000000001080006000000000008000300000000040c00048008000100",
    "ffbfffff0c000580080001000040000024000180090001006d65746100000000",
    "14000280080002000000000308000300000000014c000000060a010c05000000",
    "00000000020000000f0001006b7562652d70726f787900000600020063000000",
    "200004801c000180090001006d617371000000000c0002800800010000000010",
    "10010000060a010c0600000000000000020000000f0001006b7562652d70726f",
    "787900000600020063000000e400048024000180090001006d65746100000000",
    "14000280080002000000001008000100000000012c00018008000100636d7000",
    "20000280080001000000000108000200000000000c0003800500010006000000",
    "2c0001800e000100696d6d656469617465000000180002800800010000000001",
    "0c000280080001000af401052c0001800e000100696d6d656469617465000000",
    "1800028008000100000000020c000280060001001f9000003800018008000100",
    "6e6174002c000280080001000000000108000200000000020800030000000001",
    "08000500000000020800070000000002b0000000060a010c0700000000000000",
    "020000000f0001006b7562652d70726f78790000060002006300000084000480",
    "24000180090001006d6574610000000014000280080002000000000608000100",
    "000000012c00018008000100636d700020000280080001000000000108000200",
    "000000010c0003800800010076657468300001800e000100696d6d6564696174",
    "650000001c0002800800010000000000100002800c0002800800010000000001",
    "c8000000060a010c0800000000000000020000000f0001006b7562652d70726f",
    "787900000600020063000000900004802800018008000100666962001c000280",
    "0800030000000002080002000000000308000100000000012c00018008000100",
    "636d700020000280080001000000000108000200000000000c00038008000100",
    "02000000380001800e000100696d6d6564696174650000002400028008000100",
    "00000000180002801400028008000100fffffffd06000200630000000c000700",
    "00066c6f63616c00140000001100010009000000000000000000000a",
];

/// nft's batch for:
/// add rule ip kube-proxy c numgen random mod 2 vmap { 0 : goto c , 1 : goto c }
const NFT_NUMGEN: &[&str] = &[
    "140000001000010000000000000000000000000a8c000000090a010401000000",
    "00000000020000000f0001006b7562652d70726f787900000c0002005f5f6d61",
    "70256400080003000000000b0800040000000004080005000000000408000600",
    "ffffff00080007000000000008000a00000000010c0009800800010000000002",
    "20000d0000040100000001040000000004080004010000000100060400000000",
    "8c0000000c0a01040200000000000000020000000f0001006b7562652d70726f",
    "787900000c0002005f5f6d617025640008000400000000015400038028000180",
    "0c0001800800010000000000180002801400028008000100fffffffc06000200",
    "63000000280002800c0001800800010001000000180002801400028008000100",
    "fffffffc06000200630000009c000000060a010c030000000000000002000000",
    "0f0001006b7562652d70726f7879000006000200630000007000048034000180",
    "0b0001006e756d67656e00002400028008000100000000010800020000000002",
    "08000300000000010800040000000000380001800b0001006c6f6f6b75700000",
    "28000280080002000000000108000300000000000c0001005f5f6d6170256400",
    "0800040000000001140000001100010004000000000000000000000a",
];

/// nft's batch for:
/// add rule ip6 kube-proxy c ip6 saddr != { 2001:db8::/64 , fd00::1 , fd00::2 } drop
const NFT_ANON_CIDR_SET: &[&str] = &[
    "140000001000010000000000000000000000000a84000000090a010401000000",
    "000000000a0000000f0001006b7562652d70726f787900000c0002005f5f7365",
    "7425640008000300000000070800040000000008080005000000001008000a00",
    "000000010c000980080001000000000526000d00000402000000020401000000",
    "0314000407000000010c00040d0000000104080000000000e00000000c0a0104",
    "02000000000000000a0000000f0001006b7562652d70726f787900000c000200",
    "5f5f7365742564000800040000000001a8000380240001800800030000000001",
    "1800018014000100000000000000000000000000000000001c00028018000180",
    "1400010020010db8000000000000000000000000240003800800030000000001",
    "180001801400010020010db80000000100000000000000001c00048018000180",
    "14000100fd000000000000000000000000000001240005800800030000000001",
    "1800018014000100fd000000000000000000000000000003cc000000060a010c",
    "03000000000000000a0000000f0001006b7562652d70726f7879000006000200",
    "63000000a0000480340001800c0001007061796c6f6164002400028008000100",
    "0000000108000200000000010800030000000008080004000000001038000180",
    "0b0001006c6f6f6b757000002800028008000200000000010c0001005f5f7365",
    "7425640008000400000000010800050000000001300001800e000100696d6d65",
    "64696174650000001c0002800800010000000000100002800c00028008000100",
    "00000000140000001100010004000000000000000000000a",
];

/// nft's batch for:
/// delete element ip kube-proxy s { 10.0.0.1 }
/// flush map ip kube-proxy m
/// flush chain ip kube-proxy c
/// delete chain ip kube-proxy d
/// delete set ip kube-proxy s
/// delete table ip kube-proxy
const NFT_DELETES: &[&str] = &[
    "140000001000010000000000000000000000000a400000000e0a010001000000",
    "00000000020000000f0001006b7562652d70726f787900000600020073000000",
    "14000380100001800c000180080001000a0000012c0000000e0a010002000000",
    "0000000002000000060002006d0000000f0001006b7562652d70726f78790000",
    "2c000000080a01000300000000000000020000000f0001006b7562652d70726f",
    "7879000006000200630000002c000000050a0100040000000000000002000000",
    "0f0001006b7562652d70726f7879000006000300640000002c0000000b0a0100",
    "0500000000000000020000000f0001006b7562652d70726f7879000006000200",
    "7300000024000000020a01000600000000000000020000000f0001006b756265",
    "2d70726f78790000140000001100010007000000000000000000000a",
];
