//! Transactions that use every shape of the nftables ast: a cold one (table, base chains,
//! every set and map kind, elements of every key and verdict kind, rules with every match and
//! statement) and an incremental one on top of it, for both families.

use std::net::IpAddr;

use ipnet::IpNet;
use kube_proxy::model::{IpFamily, Protocol};
use kube_proxy::nftables::ast::*;

pub fn net(s: &str) -> IpNet {
    match s.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => IpNet::from(s.parse::<IpAddr>().expect("address or CIDR")),
    }
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// Addresses of one family for each role in the shape transactions.
struct Addrs {
    cluster_ip: &'static str,
    cluster_ip2: &'static str,
    cluster_ip3: &'static str,
    node_ip: &'static str,
    lb_ip: &'static str,
    pod_cidr: &'static str,
    /// A prefix that is not a multiple of 8 bits.
    odd_prefix: &'static str,
    any: &'static str,
    endpoints: [&'static str; 3],
    /// Source ranges with adjacent hosts, a range at the very top and one at 0.
    ranges: [&'static str; 5],
    more_ranges: [&'static str; 3],
    hosts: [&'static str; 3],
}

fn addrs(family: IpFamily) -> Addrs {
    match family {
        IpFamily::V4 => Addrs {
            cluster_ip: "10.96.0.10",
            cluster_ip2: "10.96.0.11",
            cluster_ip3: "10.96.0.12",
            node_ip: "192.168.49.2",
            lb_ip: "198.51.100.70",
            pod_cidr: "10.244.0.0/16",
            odd_prefix: "10.16.0.0/12",
            any: "0.0.0.0/0",
            endpoints: ["10.244.1.5", "10.244.2.6", "10.244.3.7"],
            ranges: [
                "203.0.113.0/25", "192.168.49.0/24", "198.51.100.50", "198.51.100.51", "255.255.255.0/24",
            ],
            more_ranges: ["0.0.0.0/8", "10.0.0.0/8", "10.1.0.0/16"],
            hosts: ["5.6.7.8", "1.2.3.4", "1.2.3.4"],
        },
        IpFamily::V6 => Addrs {
            cluster_ip: "fd00:96::10",
            cluster_ip2: "fd00:96::11",
            cluster_ip3: "fd00:96::12",
            node_ip: "fd00:49::2",
            lb_ip: "2001:db8:70::70",
            pod_cidr: "fd00:10:244::/48",
            odd_prefix: "fd00:10:244::/63",
            any: "::/0",
            endpoints: ["fd00:10:244:1::5", "fd00:10:244:2::6", "fd00:10:244:3::7"],
            ranges: [
                "2001:db8::/64", "2001:db8:1::/48", "2001:db8:2::1", "2001:db8:2::2", "ffff::/16",
            ],
            more_ranges: ["::/8", "fd00::/8", "fd00:1::/32"],
            hosts: ["2001:db8::8", "2001:db8::4", "2001:db8::4"],
        },
    }
}

fn base(name: &str, kind: &'static str, hook: &'static str, priority: i32) -> Op {
    Op::AddChain(ChainDecl {
        name: name.into(),
        base: Some(BaseHook { kind, hook, priority }),
        comment: None,
    })
}

pub fn chain(name: &str) -> Op {
    Op::AddChain(ChainDecl::regular(name))
}

pub fn rule(chain: &str, r: Rule) -> Op {
    Op::AddRule {
        chain: chain.into(),
        rule: r,
    }
}

pub fn set(name: &str, key: KeyType, map: bool, timeout: Option<u32>, comment: Option<&str>) -> Op {
    Op::AddSet(SetDecl {
        name: name.into(),
        key,
        map: map.then_some(MapValue::Verdict),
        timeout_seconds: timeout,
        comment: comment.map(str::to_string),
    })
}

pub fn elem(set: &str, key: ElemKey, value: Option<Verdict>, comment: Option<&str>) -> Op {
    Op::AddElement {
        set: set.into(),
        element: Element {
            key,
            value: value.map(Into::into),
            comment: comment.map(str::to_string),
        },
    }
}

pub fn addr(dir: Dir, negate: bool, spec: AddrSpec) -> Match {
    Match::Addr { dir, negate, spec }
}

fn anon(items: &[&str], compact: bool) -> AddrSpec {
    AddrSpec::AnonSet {
        items: items.iter().map(|s| net(s)).collect(),
        compact,
    }
}

pub fn jump(c: &str) -> Verdict {
    Verdict::Jump(c.into())
}

pub fn goto(c: &str) -> Verdict {
    Verdict::Goto(c.into())
}

/// Chain names as long as upstream's, so that element lists need several messages.
pub fn big_endpoint(i: usize) -> String {
    format!(
        "endpoint-ABCDEFGH-namespace/service-name/tcp/http__10.244.{}.{}/8080",
        i / 250,
        i % 250
    )
}

/// The cold transaction: table, base chains (with the add+delete idiom), every set/map kind,
/// elements of every key and verdict kind, and rules using every match and statement shape.
/// `big` is the size of the large `numgen` map.
pub fn shapes_setup(family: IpFamily, big: usize) -> Transaction {
    let a = addrs(family);
    let mut ops = declarations(big);
    ops.extend(elements(&a));
    // Base chains and the realistic chains they reach (the kernel validates those per hook).
    ops.extend(filter_rules());
    ops.extend(nat_rules());
    ops.extend(service_rules(&a, big));
    ops.extend(shape_rules(&a));
    Transaction { family, ops }
}

/// The table, every chain and every set and map.
fn declarations(big: usize) -> Vec<Op> {
    let mut ops = vec![
        Op::AddTable,
        base("filter-input", "filter", "input", 0),
        base("filter-forward", "filter", "forward", 0),
        base("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
        base("nat-prerouting", "nat", "prerouting", -100),
        // Upstream's "add, then delete" idiom, then the real chain.
        chain("nat-output"),
        Op::DeleteChain("nat-output".into()),
        base("nat-output", "nat", "output", -100),
        base("nat-postrouting", "nat", "postrouting", 100),
        Op::AddChain(ChainDecl {
            name: "reject-chain".into(),
            base: None,
            comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".into()),
        }),
    ];
    for c in [
        "filter-checks", "services", "masquerading", "mark-for-masquerade", "service-A", "service-one", "service-big",
        "external-A", "firewall-A", "endpoint-A1", "endpoint-A2", "endpoint-A3", "shapes",
    ] {
        ops.push(chain(c));
    }
    for i in 0..big {
        ops.push(chain(&big_endpoint(i)));
    }
    ops.extend([
        set("cluster-ips", KeyType::Addr, false, None, Some("Active ClusterIPs")),
        set("nodeport-ips", KeyType::Addr, false, None, None),
        set(
            "service-ips",
            KeyType::AddrProtoPort,
            true,
            None,
            Some("ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ),
        set(
            "service-nodeports",
            KeyType::ProtoPort,
            true,
            None,
            Some("NodePort traffic"),
        ),
        set("no-endpoint-services", KeyType::AddrProtoPort, true, None, None),
        set("no-endpoint-nodeports", KeyType::ProtoPort, true, None, None),
        set(
            "firewall-ips",
            KeyType::AddrProtoPort,
            true,
            None,
            Some("destinations that are subject to LoadBalancerSourceRanges"),
        ),
        set("affinity-A", KeyType::Addr, false, Some(10800), None),
        set("affinity-B", KeyType::Addr, false, Some(600), Some("sticky")),
        set("pp-set", KeyType::ProtoPort, false, None, None),
        set(
            "app-set",
            KeyType::AddrProtoPort,
            false,
            None,
            Some("a set keyed by a concatenation"),
        ),
        set(
            "addr-map",
            KeyType::Addr,
            true,
            None,
            Some("a verdict map keyed by an address"),
        ),
    ]);
    ops
}

/// Elements of every key and verdict kind.
fn elements(a: &Addrs) -> Vec<Op> {
    let (cip, cip2, cip3) = (ip(a.cluster_ip), ip(a.cluster_ip2), ip(a.cluster_ip3));
    vec![
        elem("cluster-ips", ElemKey::Addr(cip), None, None),
        elem("cluster-ips", ElemKey::Addr(cip2), None, Some("ns/svc2 cluster IP")),
        elem("nodeport-ips", ElemKey::Addr(ip(a.node_ip)), None, None),
        elem(
            "service-ips",
            ElemKey::AddrProtoPort(cip, Protocol::Tcp, 80),
            Some(goto("service-A")),
            None,
        ),
        elem(
            "service-ips",
            ElemKey::AddrProtoPort(cip, Protocol::Udp, 53),
            Some(goto("service-one")),
            Some("ns/svc:dns"),
        ),
        elem(
            "service-ips",
            ElemKey::AddrProtoPort(cip2, Protocol::Sctp, 3868),
            Some(jump("service-big")),
            None,
        ),
        elem(
            "service-ips",
            ElemKey::AddrProtoPort(ip(a.lb_ip), Protocol::Tcp, 80),
            Some(goto("external-A")),
            Some("ns/svc:http loadbalancer IP"),
        ),
        elem(
            "service-nodeports",
            ElemKey::ProtoPort(Protocol::Tcp, 30080),
            Some(goto("external-A")),
            None,
        ),
        elem(
            "no-endpoint-services",
            ElemKey::AddrProtoPort(cip3, Protocol::Tcp, 80),
            Some(goto("reject-chain")),
            Some("ns/empty:p has no endpoints"),
        ),
        elem(
            "no-endpoint-services",
            ElemKey::AddrProtoPort(cip3, Protocol::Udp, 81),
            Some(Verdict::Drop),
            None,
        ),
        elem(
            "no-endpoint-nodeports",
            ElemKey::ProtoPort(Protocol::Sctp, 30081),
            Some(Verdict::Drop),
            Some("drop"),
        ),
        elem(
            "firewall-ips",
            ElemKey::AddrProtoPort(ip(a.lb_ip), Protocol::Tcp, 80),
            Some(goto("firewall-A")),
            None,
        ),
        elem("pp-set", ElemKey::ProtoPort(Protocol::Udp, 53), None, None),
        elem(
            "app-set",
            ElemKey::AddrProtoPort(cip, Protocol::Tcp, 443),
            None,
            Some("with a comment"),
        ),
        elem("addr-map", ElemKey::Addr(cip), Some(Verdict::Accept), None),
        elem("addr-map", ElemKey::Addr(cip2), Some(Verdict::Return), None),
        elem("addr-map", ElemKey::Addr(cip3), Some(jump("service-A")), Some("jump")),
    ]
}

/// The filter base chains and the checks they jump to.
fn filter_rules() -> Vec<Op> {
    vec![
        rule(
            "filter-input",
            Rule::verdict(vec![Match::CtStateNew], jump("filter-checks")),
        ),
        rule(
            "filter-forward",
            Rule::verdict(vec![Match::CtStateNew], jump("filter-checks")),
        ),
        rule(
            "filter-checks",
            Rule::verdict(
                vec![addr(Dir::Daddr, false, AddrSpec::Set("cluster-ips".into()))],
                Verdict::Reject,
            )
            .with_comment("Reject traffic to invalid ports of ClusterIPs"),
        ),
        rule(
            "filter-checks",
            Rule::new(
                vec![],
                Statement::Vmap {
                    key: VmapKey::DaddrProtoPort,
                    map: "no-endpoint-services".into(),
                },
            ),
        ),
        rule(
            "filter-checks",
            Rule::new(
                vec![addr(Dir::Daddr, false, AddrSpec::Set("nodeport-ips".into()))],
                Statement::Vmap {
                    key: VmapKey::ProtoPort,
                    map: "no-endpoint-nodeports".into(),
                },
            ),
        ),
        rule("reject-chain", Rule::verdict(vec![], Verdict::Reject)),
        rule(
            "filter-prerouting-pre-dnat",
            Rule::new(
                vec![Match::CtStateNew],
                Statement::Vmap {
                    key: VmapKey::DaddrProtoPort,
                    map: "firewall-ips".into(),
                },
            ),
        ),
    ]
}

/// The nat base chains, the service dispatch and masquerading.
fn nat_rules() -> Vec<Op> {
    vec![
        rule("nat-prerouting", Rule::verdict(vec![], jump("services"))),
        rule("nat-output", Rule::verdict(vec![], jump("services"))),
        rule("nat-postrouting", Rule::verdict(vec![], jump("masquerading"))),
        rule(
            "services",
            Rule::new(
                vec![],
                Statement::Vmap {
                    key: VmapKey::DaddrProtoPort,
                    map: "service-ips".into(),
                },
            ),
        ),
        rule(
            "services",
            Rule::new(
                vec![
                    addr(Dir::Daddr, false, AddrSpec::Set("nodeport-ips".into())),
                    Match::FibLocal(Dir::Daddr),
                ],
                Statement::Vmap {
                    key: VmapKey::ProtoPort,
                    map: "service-nodeports".into(),
                },
            ),
        ),
        rule(
            "masquerading",
            Rule::verdict(vec![Match::MarkAndZero(0x4000)], Verdict::Return),
        ),
        rule("masquerading", Rule::new(vec![], Statement::MarkSetXor(0x4000))),
        rule("masquerading", Rule::new(vec![], Statement::Masquerade)),
        rule("mark-for-masquerade", Rule::new(vec![], Statement::MarkSetOr(0x4000))),
    ]
}

/// The chains of a Service and its endpoints (and `big` endpoints of another).
fn service_rules(a: &Addrs, big: usize) -> Vec<Op> {
    let p = |s: &str| AddrSpec::Net(net(s));
    let mut ops = vec![
        rule(
            "service-A",
            Rule::verdict(
                vec![
                    addr(Dir::Daddr, false, p(a.cluster_ip)),
                    addr(Dir::Saddr, true, p(a.pod_cidr)),
                ],
                jump("mark-for-masquerade"),
            ),
        ),
        rule(
            "service-A",
            Rule::verdict(
                vec![addr(Dir::Saddr, false, AddrSpec::Set("affinity-A".into()))],
                goto("endpoint-A1"),
            ),
        ),
        rule(
            "service-A",
            Rule::new(
                vec![],
                Statement::NumgenVmap(vec!["endpoint-A1".into(), "endpoint-A2".into(), "endpoint-A3".into()]),
            ),
        ),
        rule(
            "service-one",
            Rule::new(vec![], Statement::NumgenVmap(vec!["endpoint-A1".into()])),
        ),
        rule(
            "external-A",
            Rule::verdict(vec![Match::FibLocal(Dir::Saddr)], jump("mark-for-masquerade"))
                .with_comment("masquerade local traffic"),
        ),
        rule(
            "external-A",
            Rule::verdict(vec![Match::FibLocal(Dir::Saddr)], goto("service-A"))
                .with_comment("short-circuit local traffic"),
        ),
        rule("external-A", Rule::verdict(vec![], goto("service-A"))),
        rule(
            "firewall-A",
            Rule::verdict(vec![addr(Dir::Saddr, true, anon(&a.ranges, false))], Verdict::Drop),
        ),
    ];
    if big > 0 {
        ops.push(rule(
            "service-big",
            Rule::new(vec![], Statement::NumgenVmap((0..big).map(big_endpoint).collect())),
        ));
    }
    for (i, ep) in a.endpoints.iter().enumerate() {
        let c = format!("endpoint-A{}", i + 1);
        ops.extend([
            rule(
                &c,
                Rule::verdict(vec![addr(Dir::Saddr, false, p(ep))], jump("mark-for-masquerade")),
            ),
            rule(&c, Rule::new(vec![], Statement::UpdateSaddr("affinity-A".into()))),
            rule(
                &c,
                Rule::new(
                    vec![Match::L4proto(Protocol::Tcp)],
                    Statement::Dnat(std::net::SocketAddr::new(ip(ep), 8080)),
                ),
            ),
        ]);
    }
    ops
}

/// Every remaining shape, in a chain no base chain reaches (so no hook restricts it).
fn shape_rules(a: &Addrs) -> Vec<Op> {
    let p = |s: &str| AddrSpec::Net(net(s));
    let mut ops = Vec::new();
    let shape = |matches: Vec<Match>, v: Verdict| rule("shapes", Rule::verdict(matches, v));
    for dir in [Dir::Saddr, Dir::Daddr] {
        for negate in [false, true] {
            for s in [a.cluster_ip, a.pod_cidr, a.odd_prefix, a.any] {
                ops.push(shape(vec![addr(dir, negate, p(s))], Verdict::Accept));
            }
            ops.push(shape(
                vec![addr(dir, negate, AddrSpec::Set("cluster-ips".into()))],
                Verdict::Drop,
            ));
            // One item (nft compares directly), hosts only (a hash set, duplicates kept),
            // ranges (an interval set: merged, with end elements).
            ops.push(shape(
                vec![addr(dir, negate, anon(&[a.cluster_ip], true))],
                Verdict::Accept,
            ));
            ops.push(shape(
                vec![addr(dir, negate, anon(&[a.pod_cidr], false))],
                Verdict::Accept,
            ));
            ops.push(shape(
                vec![addr(dir, negate, anon(&[a.odd_prefix], false))],
                Verdict::Accept,
            ));
            ops.push(shape(vec![addr(dir, negate, anon(&a.hosts, true))], Verdict::Accept));
            ops.push(shape(
                vec![addr(dir, negate, anon(&a.hosts[..2], false))],
                Verdict::Accept,
            ));
            ops.push(shape(vec![addr(dir, negate, anon(&a.ranges, false))], Verdict::Accept));
            ops.push(shape(
                vec![addr(dir, negate, anon(&a.more_ranges, true))],
                Verdict::Accept,
            ));
            ops.push(shape(
                vec![addr(dir, negate, anon(&[a.any, a.cluster_ip], false))],
                Verdict::Accept,
            ));
        }
    }
    for negate in [false, true] {
        for pattern in ["cbr0", "veth*", "eth0.100", "a*"] {
            ops.push(shape(
                vec![Match::Iifname {
                    negate,
                    pattern: pattern.into(),
                }],
                Verdict::Return,
            ));
        }
    }
    for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
        ops.push(shape(vec![Match::L4proto(proto)], Verdict::Accept));
    }
    ops.extend([
        shape(vec![Match::FibLocal(Dir::Saddr)], Verdict::Drop),
        shape(vec![Match::FibLocal(Dir::Daddr)], goto("service-A")),
        shape(vec![Match::MarkAndZero(0x0001_0000)], Verdict::Return),
        shape(vec![Match::CtStateNew, Match::L4proto(Protocol::Udp)], Verdict::Reject),
        shape(vec![], Verdict::Reject),
        shape(
            vec![
                Match::CtStateNew,
                addr(Dir::Daddr, false, p(a.cluster_ip)),
                addr(Dir::Saddr, true, anon(&a.more_ranges, false)),
                Match::Iifname {
                    negate: true,
                    pattern: "veth*".into(),
                },
                Match::L4proto(Protocol::Tcp),
            ],
            jump("mark-for-masquerade"),
        ),
        rule(
            "shapes",
            Rule::new(
                vec![addr(Dir::Saddr, false, anon(&a.ranges[..3], false))],
                Statement::NumgenVmap(vec!["endpoint-A2".into(), "endpoint-A3".into()]),
            )
            .with_comment("an anonymous set and an anonymous map in one rule"),
        ),
        rule("shapes", Rule::new(vec![], Statement::MarkSetOr(0xffff_ffff))),
        rule("shapes", Rule::new(vec![], Statement::MarkSetXor(1))),
        rule("shapes", Rule::new(vec![], Statement::UpdateSaddr("affinity-B".into()))),
        rule(
            "shapes",
            Rule::new(vec![], Statement::Masquerade).with_comment("a/b c:d \\ e"),
        ),
        rule(
            "shapes",
            Rule::new(
                vec![Match::L4proto(Protocol::Sctp)],
                Statement::Dnat(std::net::SocketAddr::new(ip(a.endpoints[2]), 3868)),
            ),
        ),
    ]);
    ops
}

/// An incremental transaction on top of [`shapes_setup`]: deletions, flushes, re-adds,
/// An incremental transaction on top of [`shapes_setup`]: deletions, flushes, re-adds,
/// references to sets that exist only in the kernel, and `add` of things that exist.
pub fn shapes_update(family: IpFamily) -> Transaction {
    let a = addrs(family);
    let (cip, cip2) = (ip(a.cluster_ip), ip(a.cluster_ip2));
    let ops = vec![
        Op::AddTable,
        chain("services"),
        set("cluster-ips", KeyType::Addr, false, None, Some("Active ClusterIPs")),
        Op::DeleteElement {
            set: "cluster-ips".into(),
            key: ElemKey::Addr(cip2),
        },
        Op::DeleteElement {
            set: "service-ips".into(),
            key: ElemKey::AddrProtoPort(cip, Protocol::Udp, 53),
        },
        Op::FlushSet {
            name: "pp-set".into(),
            map: false,
        },
        Op::FlushSet {
            name: "no-endpoint-nodeports".into(),
            map: true,
        },
        // The shapes and service-A reference endpoint-A3: flush them before deleting it.
        Op::FlushChain("shapes".into()),
        rule(
            "shapes",
            Rule::verdict(
                vec![addr(Dir::Daddr, true, AddrSpec::Set("cluster-ips".into()))],
                Verdict::Accept,
            ),
        ),
        rule("shapes", Rule::new(vec![], Statement::UpdateSaddr("affinity-B".into()))),
        Op::FlushChain("service-A".into()),
        rule(
            "service-A",
            Rule::new(
                vec![],
                Statement::NumgenVmap(vec!["endpoint-A1".into(), "endpoint-A2".into()]),
            ),
        ),
        Op::FlushChain("endpoint-A3".into()),
        Op::DeleteChain("endpoint-A3".into()),
        Op::DeleteSet {
            name: "app-set".into(),
            map: false,
        },
        Op::DeleteSet {
            name: "addr-map".into(),
            map: true,
        },
        elem(
            "cluster-ips",
            ElemKey::Addr(cip2),
            None,
            Some("back, with another comment"),
        ),
        elem(
            "no-endpoint-nodeports",
            ElemKey::ProtoPort(Protocol::Tcp, 30090),
            Some(goto("reject-chain")),
            None,
        ),
        set("fresh", KeyType::ProtoPort, true, None, None),
        elem(
            "fresh",
            ElemKey::ProtoPort(Protocol::Udp, 9),
            Some(Verdict::Accept),
            None,
        ),
    ];
    Transaction { family, ops }
}
