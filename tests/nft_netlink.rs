//! The netlink nftables path against the real kernel, each test in throw-away network
//! namespaces (never the root namespace): the same transactions applied with `nft -f -` in one
//! namespace and with `NftSocket` in another must list identically (`nft list table`); an
//! invalid op must fail the whole batch and be named in the error; large batches must go
//! through; and, where `strace` is installed, our messages must be nft's own message for
//! message.

mod common;

use std::collections::HashSet;
use std::fs::File;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use ipnet::IpNet;
use kube_proxy::config::LocalDetector;
use kube_proxy::lab::netns::Netns;
use kube_proxy::model::{IpFamily, NodeInfo, Protocol, ProxyState, build_state};
use kube_proxy::nftables::ast::*;
use kube_proxy::nftables::netlink::{AnonSetNames, NetlinkError, NftSocket, encode_with};
use kube_proxy::nftables::render::render_tx;
use kube_proxy::proxy::RenderOptions;

// ---------------------------------------------------------------------------------------------
// Namespaces and the two ways in
// ---------------------------------------------------------------------------------------------

fn which(bin: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn can_use_netns() -> bool {
    let ok = nix::unistd::geteuid().is_root() && which("nft") && which("ip");
    if !ok {
        eprintln!("skipped: needs root, nft and ip to create network namespaces");
    }
    ok
}

fn netns(tag: &str) -> Netns {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "kp-nl-{tag}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    Netns::create(&name).unwrap_or_else(|e| panic!("creating network namespace {name}: {e:#}"))
}

/// Runs `f` on a thread that has entered `ns`; a socket it creates stays in `ns`.
fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = File::open(format!("/run/netns/{}", ns.name())).expect("netns file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread")
    })
}

fn socket_in(ns: &Netns) -> NftSocket {
    in_netns(ns, NftSocket::new).expect("netlink socket")
}

fn fam(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// `nft -f -` of the transaction's text; the error is nft's output.
fn nft_apply(ns: &Netns, tx: &Transaction) -> Result<(), String> {
    let (ok, out) = ns.exec_with_input("nft", ["-f", "-"], &tx.text()).expect("nft runs");
    if ok { Ok(()) } else { Err(out) }
}

/// `nft list table FAMILY kube-proxy` (`Err` when it fails, e.g. no table).
fn listing(ns: &Netns, family: IpFamily) -> Result<String, String> {
    let (ok, out) = ns
        .exec_with_input("nft", ["list", "table", fam(family), "kube-proxy"], "")
        .expect("nft runs");
    if ok { Ok(out) } else { Err(out) }
}

fn numbered(text: &str) -> String {
    text.lines()
        .enumerate()
        .map(|(i, l)| format!("{:5} {l}\n", i + 1))
        .collect()
}

/// The first differing line of two listings, with context.
fn first_difference(a: &str, b: &str) -> String {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let at = la
        .iter()
        .zip(&lb)
        .position(|(x, y)| x != y)
        .unwrap_or(la.len().min(lb.len()));
    let from = at.saturating_sub(3);
    format!(
        "first difference at line {}:\n--- nft -f\n{}\n--- netlink\n{}",
        at + 1,
        la[from..(at + 4).min(la.len())].join("\n"),
        lb[from..(at + 4).min(lb.len())].join("\n")
    )
}

/// Applies each transaction with nft in one namespace and over netlink in another, and after
/// each compares `nft list table`. Nothing is normalised: anonymous sets (whose names differ)
/// are printed inline by `nft list`, never by name, so the listings must be byte-identical.
fn apply_both_and_compare(what: &str, txs: &[Transaction]) {
    let a = netns("nft");
    let b = netns("nl");
    let mut sock = socket_in(&b);
    for (i, tx) in txs.iter().enumerate() {
        let ctx = format!("{what}, transaction {i} ({} ops)", tx.ops.len());
        let by_nft = nft_apply(&a, tx);
        let started = Instant::now();
        let by_netlink = sock.apply(tx);
        let took = started.elapsed();
        match (&by_nft, &by_netlink) {
            (Ok(()), Ok(())) => {}
            (Err(e), _) => panic!("{ctx}: nft -f refused it:\n{e}\n{}", numbered(&tx.text())),
            (Ok(()), Err(e)) => panic!("{ctx}: netlink refused what nft accepted: {e}"),
        }
        eprintln!("{ctx}: applied over netlink in {took:?}");
        let (la, lb) = (listing(&a, tx.family), listing(&b, tx.family));
        match (&la, &lb) {
            (Ok(x), Ok(y)) if x == y => {
                if std::env::var_os("KP_NL_SHOW").is_some() {
                    eprintln!("{ctx}: listing\n{x}");
                }
            }
            (Ok(x), Ok(y)) => panic!("{ctx}: listings differ\n{}", first_difference(x, y)),
            (Err(e), Err(_)) if tx.ops.last() == Some(&Op::DeleteTable) => {
                assert!(e.contains("No such file or directory"), "{ctx}: {e}");
            }
            _ => panic!("{ctx}: one namespace has the table, the other not:\nnft -f: {la:?}\nnetlink: {lb:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Transactions that use every shape of the ast
// ---------------------------------------------------------------------------------------------

fn net(s: &str) -> IpNet {
    match s.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => IpNet::from(s.parse::<IpAddr>().expect("address or CIDR")),
    }
}

fn ip(s: &str) -> IpAddr {
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

fn chain(name: &str) -> Op {
    Op::AddChain(ChainDecl::regular(name))
}

fn rule(chain: &str, r: Rule) -> Op {
    Op::AddRule {
        chain: chain.into(),
        rule: r,
    }
}

fn set(name: &str, key: KeyType, map: bool, timeout: Option<u32>, comment: Option<&str>) -> Op {
    Op::AddSet(SetDecl {
        name: name.into(),
        key,
        map,
        timeout_seconds: timeout,
        comment: comment.map(str::to_string),
    })
}

fn elem(set: &str, key: ElemKey, value: Option<Verdict>, comment: Option<&str>) -> Op {
    Op::AddElement {
        set: set.into(),
        element: Element {
            key,
            value,
            comment: comment.map(str::to_string),
        },
    }
}

fn addr(dir: Dir, negate: bool, spec: AddrSpec) -> Match {
    Match::Addr { dir, negate, spec }
}

fn anon(items: &[&str], compact: bool) -> AddrSpec {
    AddrSpec::AnonSet {
        items: items.iter().map(|s| net(s)).collect(),
        compact,
    }
}

fn jump(c: &str) -> Verdict {
    Verdict::Jump(c.into())
}

fn goto(c: &str) -> Verdict {
    Verdict::Goto(c.into())
}

/// Chain names as long as upstream's, so that element lists need several messages.
fn big_endpoint(i: usize) -> String {
    format!(
        "endpoint-ABCDEFGH-namespace/service-name/tcp/http__10.244.{}.{}/8080",
        i / 250,
        i % 250
    )
}

/// The cold transaction: table, base chains (with the add+delete idiom), every set/map kind,
/// elements of every key and verdict kind, and rules using every match and statement shape.
/// `big` is the size of the large `numgen` map.
fn shapes_setup(family: IpFamily, big: usize) -> Transaction {
    let a = addrs(family);
    let p = |s: &str| AddrSpec::Net(net(s));
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
    let (cip, cip2, cip3) = (ip(a.cluster_ip), ip(a.cluster_ip2), ip(a.cluster_ip3));
    ops.extend([
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
    ]);

    // Base chains and the realistic chains they reach (the kernel validates those per hook).
    ops.extend([
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
    ]);
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

    // Every remaining shape, in a chain no base chain reaches (so no hook restricts it).
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
    Transaction { family, ops }
}

/// An incremental transaction on top of [`shapes_setup`]: deletions, flushes, re-adds,
/// references to sets that exist only in the kernel, and `add` of things that exist.
fn shapes_update(family: IpFamily) -> Transaction {
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

#[test]
fn every_shape_lists_identically_both_ways() {
    if !can_use_netns() {
        return;
    }
    for family in [IpFamily::V4, IpFamily::V6] {
        apply_both_and_compare(
            &format!("every shape, {family}"),
            &[
                shapes_setup(family, 1000),
                shapes_update(family),
                // Re-applying the cold transaction over the loaded table (a restarted proxy).
                shapes_setup(family, 1000),
                Transaction {
                    family,
                    ops: vec![Op::DeleteTable],
                },
            ],
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Errors, existence, size
// ---------------------------------------------------------------------------------------------

#[test]
fn an_invalid_op_fails_the_whole_batch_and_is_named() {
    if !can_use_netns() {
        return;
    }
    let ns = netns("err");
    let mut sock = socket_in(&ns);
    assert!(!sock.table_exists(IpFamily::V4).expect("table_exists"));

    // On an empty namespace: nothing of the batch may remain.
    let bad = Transaction {
        family: IpFamily::V4,
        ops: vec![
            Op::AddTable,
            chain("a"),
            rule("a", Rule::verdict(vec![], Verdict::Accept)),
            rule("a", Rule::verdict(vec![], jump("missing"))),
            chain("b"),
        ],
    };
    let err = sock.apply(&bad).expect_err("a jump to a missing chain must fail");
    let text = err.to_string();
    eprintln!("error: {text}");
    assert!(
        text.contains("add rule ip kube-proxy a jump missing"),
        "the error must name the op: {text}"
    );
    assert!(text.contains("ENOENT"), "the error must name the errno: {text}");
    match &err {
        NetlinkError::Rejected { failures, .. } => {
            assert_eq!(failures.len(), 1, "{failures:?}");
            assert_eq!(failures[0].index, Some(3));
            assert_eq!(failures[0].errno, nix::errno::Errno::ENOENT);
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(
        !sock.table_exists(IpFamily::V4).expect("table_exists"),
        "the table must not exist"
    );

    // On a loaded table: the listing must not change.
    let good = shapes_setup(IpFamily::V4, 3);
    sock.apply(&good).expect("the shapes apply");
    assert!(sock.table_exists(IpFamily::V4).expect("table_exists"));
    assert!(!sock.table_exists(IpFamily::V6).expect("table_exists"));
    let before = listing(&ns, IpFamily::V4).expect("listing");
    let bad = Transaction {
        family: IpFamily::V4,
        ops: vec![
            chain("new-chain"),
            Op::FlushChain("services".into()),
            elem("cluster-ips", ElemKey::Addr(ip("10.96.9.9")), None, None),
            rule(
                "new-chain",
                Rule::new(
                    vec![],
                    Statement::NumgenVmap(vec!["endpoint-A1".into(), "nowhere".into()]),
                ),
            ),
            Op::DeleteSet {
                name: "no-such-set".into(),
                map: false,
            },
        ],
    };
    let err = sock.apply(&bad).expect_err("must fail");
    eprintln!("error: {err}");
    match &err {
        NetlinkError::Rejected { failures, .. } => {
            let ops: Vec<Option<usize>> = failures.iter().map(|f| f.index).collect();
            // The map element to the missing chain, and the missing set.
            assert!(ops.contains(&Some(3)), "{failures:?}");
            assert!(ops.contains(&Some(4)), "{failures:?}");
            assert!(err.to_string().contains("nowhere"), "{err}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(
        listing(&ns, IpFamily::V4).expect("listing"),
        before,
        "a failed batch changed the table"
    );

    // Refused before sending: an address of the other family.
    let bad = Transaction {
        family: IpFamily::V4,
        ops: vec![elem("cluster-ips", ElemKey::Addr(ip("fd00::1")), None, None)],
    };
    let err = sock.apply(&bad).expect_err("must fail");
    assert!(matches!(err, NetlinkError::Invalid(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("add element ip kube-proxy cluster-ips { fd00::1 }"),
        "{err}"
    );

    // The socket still works afterwards, and an empty transaction is a no-op.
    sock.apply(&Transaction::new(IpFamily::V4)).expect("empty");
    sock.apply(&Transaction {
        family: IpFamily::V4,
        ops: vec![Op::DeleteTable],
    })
    .expect("delete table");
    assert!(!sock.table_exists(IpFamily::V4).expect("table_exists"));
}

/// A batch of tens of MB (one `send`), then a one-element change on the loaded table.
#[test]
fn a_large_batch_goes_in_one_send() {
    if !can_use_netns() {
        return;
    }
    let ns = netns("big");
    let mut sock = socket_in(&ns);
    let (chains, elements) = (20_000, 100_000);
    let mut ops = vec![
        Op::AddTable,
        set(
            "service-ips",
            KeyType::AddrProtoPort,
            true,
            None,
            Some("ClusterIP traffic"),
        ),
        chain("mark-for-masquerade"),
        rule("mark-for-masquerade", Rule::new(vec![], Statement::MarkSetOr(0x4000))),
    ];
    for i in 0..chains {
        let c = format!("service-{i:08}-namespace-{i}/service-name-{i}/tcp/http");
        ops.push(chain(&c));
        ops.push(rule(
            &c,
            Rule::verdict(
                vec![
                    addr(Dir::Daddr, false, AddrSpec::Net(net("172.30.0.1"))),
                    addr(Dir::Saddr, true, AddrSpec::Net(net("10.0.0.0/8"))),
                ],
                jump("mark-for-masquerade"),
            )
            .with_comment(format!("namespace-{i}/service-name-{i}:http cluster IP")),
        ));
    }
    for i in 0..elements {
        let ip = std::net::Ipv4Addr::from(0xac1e_0000u32 + i as u32);
        ops.push(elem(
            "service-ips",
            ElemKey::AddrProtoPort(IpAddr::V4(ip), Protocol::Tcp, 80),
            Some(goto(&format!(
                "service-{:08}-namespace-{0}/service-name-{0}/tcp/http",
                i % chains
            ))),
            Some(&format!("namespace-{i}/service-name-{i}:http")),
        ));
    }
    let tx = Transaction {
        family: IpFamily::V4,
        ops,
    };
    let started = Instant::now();
    let size = encode_with(&tx, 0, &mut AnonSetNames::starting_at(0)).bytes.len();
    eprintln!("large batch: encoded in {:?}", started.elapsed());
    assert!(size > 20 << 20, "the batch should be tens of MB, is {size} bytes");
    let started = Instant::now();
    sock.apply(&tx).expect("the large batch applies");
    eprintln!(
        "large batch: {} ops, {:.1} MB, applied in {:?}",
        tx.ops.len(),
        size as f64 / 1e6,
        started.elapsed()
    );
    let (ok, out) = ns
        .exec_with_input("nft", ["list", "map", "ip", "kube-proxy", "service-ips"], "")
        .expect("nft runs");
    assert!(ok, "{out}");
    assert_eq!(out.matches(" : goto ").count(), elements, "elements in the kernel");
    let (ok, out) = ns
        .exec_with_input("nft", ["list", "chains", "ip"], "")
        .expect("nft runs");
    assert!(ok, "{out}");
    assert_eq!(out.matches("chain service-").count(), chains, "chains in the kernel");

    let one = Transaction {
        family: IpFamily::V4,
        ops: vec![elem(
            "service-ips",
            ElemKey::AddrProtoPort(ip("172.31.0.1"), Protocol::Udp, 53),
            Some(goto("service-00000000-namespace-0/service-name-0/tcp/http")),
            None,
        )],
    };
    let started = Instant::now();
    sock.apply(&one).expect("one element");
    eprintln!("one element on the loaded table: {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// The renderer's full transactions, every scenario
// ---------------------------------------------------------------------------------------------

fn cluster_cidr(flags: &[String], family: IpFamily) -> String {
    flags
        .iter()
        .filter_map(|f| f.strip_prefix("--cluster-cidr="))
        .flat_map(|v| v.split(','))
        .find(|c| c.parse::<IpNet>().is_ok_and(|n| family.contains(&n.addr())))
        .unwrap_or("10.244.0.0/16")
        .to_string()
}

/// Every (scenario, state, options) as tests/nft_render.rs renders them.
fn scenario_cases() -> Vec<(String, ProxyState, RenderOptions)> {
    let mut out = Vec::new();
    for (name, path, flags) in common::scenarios() {
        let abs = common::root().join(&path);
        let objects = kube_proxy::manifest::load_paths(&[abs.as_path()]).expect("scenario loads");
        let node = NodeInfo::from_objects(&objects, "node-a", &[]);
        let states: Vec<ProxyState> = [IpFamily::V4, IpFamily::V6]
            .into_iter()
            .map(|f| build_state(&objects, &node, f))
            .collect();
        let used: Vec<&ProxyState> = states.iter().filter(|s| !s.service_ports.is_empty()).collect();
        let used = if used.is_empty() { vec![&states[0]] } else { used };
        for st in used {
            let opts = RenderOptions {
                local_detector: LocalDetector::Cidr(cluster_cidr(&flags, st.family)),
                node_port_addresses: vec!["primary".into()],
                ..RenderOptions::default()
            };
            out.push((format!("{name} {}", st.family), st.clone(), opts));
        }
    }
    assert!(!out.is_empty(), "no scenarios found");
    out
}

#[test]
fn every_scenario_lists_identically_both_ways() {
    if !can_use_netns() {
        return;
    }
    for (name, state, opts) in scenario_cases() {
        apply_both_and_compare(
            &format!("scenario {name}"),
            &[render_tx(&state, &opts, true), render_tx(&state, &opts, false)],
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Message for message against nft (needs strace)
// ---------------------------------------------------------------------------------------------

/// One netlink attribute: its type and either its bytes or its nested attributes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Attr {
    Bytes(u16, Vec<u8>),
    Nest(u16, Vec<Attr>),
}

/// One message, without sequence number; `NLM_F_ACK` is dropped (we ask for one on the last
/// message, nft for none).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Msg {
    msg_type: u16,
    flags: u16,
    header: [u8; 4],
    attrs: Vec<Attr>,
}

fn parse_attrs(b: &[u8]) -> Vec<Attr> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= b.len() {
        let len = u16::from_ne_bytes([b[at], b[at + 1]]) as usize;
        let ty = u16::from_ne_bytes([b[at + 2], b[at + 3]]);
        assert!(len >= 4 && at + len <= b.len(), "malformed attribute at {at}");
        let data = &b[at + 4..at + len];
        if ty & 0x8000 != 0 {
            out.push(Attr::Nest(ty & 0x3fff, parse_attrs(data)));
        } else {
            out.push(Attr::Bytes(ty, normalise_anon_name(data)));
        }
        at += (len + 3) & !3;
    }
    out
}

/// `__set%d` (nft) and `__set123` (ours) both become `__set*`; likewise `__map`.
fn normalise_anon_name(data: &[u8]) -> Vec<u8> {
    for prefix in [&b"__set"[..], &b"__map"[..]] {
        if let Some(rest) = data.strip_prefix(prefix)
            && let Some(n) = rest.strip_suffix(b"\0")
            && (n == b"%d" || (!n.is_empty() && n.iter().all(u8::is_ascii_digit)))
        {
            return [prefix, b"*\0"].concat();
        }
    }
    data.to_vec()
}

fn parse_batch(b: &[u8]) -> Vec<Msg> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 20 <= b.len() {
        let len = u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
        out.push(Msg {
            msg_type: u16::from_ne_bytes([b[at + 4], b[at + 5]]),
            flags: u16::from_ne_bytes([b[at + 6], b[at + 7]]) & !0x4,
            header: b[at + 16..at + 20].try_into().expect("4 bytes"),
            attrs: parse_attrs(&b[at + 20..at + len]),
        });
        at += (len + 3) & !3;
    }
    out
}

/// nft reorders the elements of consecutive `add element` commands on one set (it collapses
/// them: the first, then the others in reverse order), one message each; the kernel ends up
/// with the same set either way. Sort each such run so that only contents are compared.
fn sort_element_runs(mut msgs: Vec<Msg>) -> Vec<Msg> {
    const NEWSETELEM: u16 = 0x0a0c;
    let set_of = |m: &Msg| {
        m.attrs.iter().find_map(|a| match a {
            Attr::Bytes(2, name) => Some(name.clone()),
            _ => None,
        })
    };
    let mut start = 0;
    while start < msgs.len() {
        let mut end = start + 1;
        if msgs[start].msg_type == NEWSETELEM {
            let set = set_of(&msgs[start]);
            while end < msgs.len() && msgs[end].msg_type == NEWSETELEM && set_of(&msgs[end]) == set {
                end += 1;
            }
            msgs[start..end].sort();
        }
        start = end;
    }
    msgs
}

/// The data of every `sendmsg` in an `strace -e write=all` log, buffers concatenated.
fn strace_sends(log: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut cur: Option<Vec<u8>> = None;
    for line in log.lines() {
        if line.contains("sendmsg(") {
            out.extend(cur.take());
            cur = Some(Vec::new());
        } else if let Some(rest) = line.trim_start().strip_prefix("| ") {
            // ` | 00010  00 00 00 0a 48 00 …  ascii |`: 16 hex bytes after the offset.
            if let Some(buf) = cur.as_mut() {
                let hex: String = rest.chars().skip(7).take(49).filter(|c| !c.is_whitespace()).collect();
                buf.extend(data_encoding::HEXLOWER.decode(hex.as_bytes()).expect("strace hex"));
            }
        } else if !line.trim_start().starts_with('*') {
            out.extend(cur.take());
        }
    }
    out.extend(cur);
    out
}

/// The batch nft sends for `tx` (cold, in a fresh namespace), captured with strace.
fn nft_batch(tx: &Transaction) -> Vec<u8> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let ns = netns("strace");
    let base: PathBuf = std::env::temp_dir().join(format!(
        "kp-nl-strace-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let (input, log) = (base.with_extension("nft"), base.with_extension("log"));
    std::fs::write(&input, tx.text()).expect("write nft input");
    let out = ns
        .exec(
            "strace",
            [
                "-f",
                "-o",
                log.to_str().expect("utf-8 path"),
                "-e",
                "trace=sendmsg",
                "-e",
                "write=all",
                "-s",
                "0",
                "nft",
                "-f",
                input.to_str().expect("utf-8 path"),
            ],
        )
        .expect("strace runs");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&log);
    assert!(
        out.status.success(),
        "nft failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    strace_sends(&text)
        .into_iter()
        .find(|b| b.len() >= 6 && u16::from_ne_bytes([b[4], b[5]]) == 0x10)
        .expect("nft sent a batch")
}

#[test]
fn same_messages_as_nft() {
    if !can_use_netns() {
        return;
    }
    if !which("strace") {
        eprintln!("skipped: needs strace to capture nft's messages");
        return;
    }
    // Cold transactions only (every set is created by the batch, so set ids agree), and a
    // `numgen` map small enough for one element message (nft splits long lists elsewhere).
    for family in [IpFamily::V4, IpFamily::V6] {
        let tx = shapes_setup(family, 40);
        let theirs = sort_element_runs(parse_batch(&nft_batch(&tx)));
        let ours = sort_element_runs(parse_batch(
            &encode_with(&tx, 0, &mut AnonSetNames::starting_at(1)).bytes,
        ));
        if std::env::var_os("KP_NL_DUMP").is_some() {
            for (i, m) in theirs.iter().enumerate() {
                eprintln!("nft {i}: {:?}", m);
            }
            for (i, m) in ours.iter().enumerate() {
                eprintln!("ours {i}: {:?}", m);
            }
        }
        assert_eq!(ours.len(), theirs.len(), "{family}: number of messages");
        for (i, (o, t)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(o, t, "{family}: message {i} differs");
        }
        let names: HashSet<String> = ours
            .iter()
            .flat_map(|m| m.attrs.iter())
            .filter_map(|a| match a {
                Attr::Bytes(2, v) => Some(String::from_utf8_lossy(v).into_owned()),
                _ => None,
            })
            .collect();
        assert!(names.contains("__map*\0") && names.contains("__set*\0"), "{names:?}");
    }
}
