//! The netlink nftables path against the real kernel, each test in throw-away network
//! namespaces (never the root namespace): the same transactions applied with `nft -f -` in one
//! namespace and with `NftSocket` in another must list identically (`nft list table`); an
//! invalid op must fail the whole batch and be named in the error; large batches must go
//! through; a table read back over netlink is the model the transactions build; and, where
//! `strace` is installed, our messages must be nft's own message for message.

mod common;
#[path = "support/nft_shapes.rs"]
mod shapes;

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use common::netns::{fresh_netns, in_netns};
use common::{nft_family, nft_options, numbered};
use kube_proxy::lab::netns::Netns;
use kube_proxy::model::{IpFamily, Protocol, ProxyState};
use kube_proxy::nftables::ast::*;
use kube_proxy::nftables::netlink::{AnonSetNames, NetlinkError, NftSocket, ReadScope, encode_with};
use kube_proxy::nftables::readback::canonical_line;
use kube_proxy::nftables::render::render_tx;
use kube_proxy::proxy::RenderOptions;
use shapes::*;

// The transactions that use every shape of the ast are in tests/support/nft_shapes.rs.

// ---------------------------------------------------------------------------------------------
// Namespaces and the two ways in
// ---------------------------------------------------------------------------------------------

fn netns(tag: &str) -> Netns {
    fresh_netns(&format!("kp-nl-{tag}"))
}

fn socket_in(ns: &Netns) -> NftSocket {
    in_netns(ns.name(), NftSocket::new).expect("netlink socket")
}

/// `nft -f -` of the transaction's text; the error is nft's output.
fn nft_apply(ns: &Netns, tx: &Transaction) -> Result<(), String> {
    let (ok, out) = ns.exec_with_input("nft", ["-f", "-"], &tx.text()).expect("nft runs");
    if ok { Ok(()) } else { Err(out) }
}

/// `nft list table FAMILY kube-proxy` (`Err` when it fails, e.g. no table).
fn listing(ns: &Netns, family: IpFamily) -> Result<String, String> {
    let (ok, out) = ns
        .exec_with_input("nft", ["list", "table", nft_family(family), "kube-proxy"], "")
        .expect("nft runs");
    if ok { Ok(out) } else { Err(out) }
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

fn every_shape_lists_identically_both_ways() {
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

fn an_invalid_op_fails_the_whole_batch_and_is_named() {
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

/// A chain of another table (iptables-nft's `mangle`, where kube-proxy's canary says the nft
/// backend is in use) is found by name, and neither a missing chain nor a missing table is.
fn another_tables_chain_is_found_by_name() {
    let ns = netns("chain");
    let mut sock = socket_in(&ns);
    assert!(
        !sock
            .chain_exists(IpFamily::V4, "mangle", "KUBE-PROXY-CANARY")
            .expect("no table")
    );
    let (ok, out) = ns
        .exec_with_input(
            "nft",
            ["-f", "-"],
            "add table ip mangle\nadd chain ip mangle KUBE-PROXY-CANARY\n",
        )
        .expect("nft runs");
    assert!(ok, "{out}");
    assert!(
        sock.chain_exists(IpFamily::V4, "mangle", "KUBE-PROXY-CANARY")
            .expect("chain")
    );
    assert!(
        !sock
            .chain_exists(IpFamily::V4, "mangle", "KUBE-KUBELET-CANARY")
            .expect("other chain")
    );
    assert!(
        !sock
            .chain_exists(IpFamily::V6, "mangle", "KUBE-PROXY-CANARY")
            .expect("other family")
    );
    assert!(!sock.table_exists(IpFamily::V4).expect("not our table"));
}

/// A batch of tens of MB (one `send`), then a one-element change on the loaded table.
fn a_large_batch_goes_in_one_send() {
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

/// Every (scenario, state, options) as tests/nft_render.rs renders them.
fn scenario_cases() -> Vec<(String, ProxyState, RenderOptions)> {
    common::scenario_states()
        .into_iter()
        .map(|s| {
            let opts = nft_options(&s.flags, s.state.family);
            (format!("{} {}", s.name, s.state.family), s.state, opts)
        })
        .collect()
}

fn every_scenario_lists_identically_both_ways() {
    for (name, state, opts) in scenario_cases() {
        apply_both_and_compare(
            &format!("scenario {name}"),
            &[render_tx(&state, &opts, true), render_tx(&state, &opts, false)],
        );
    }
}

/// Applies `txs` over netlink, then reads the table back over netlink (whole, and one chain
/// and map at a time): the model the transactions build, rule for rule (sets' items in one
/// order: the kernel keeps no order), and no rule left undecoded.
fn reads_back_as_built(what: &str, txs: &[Transaction]) {
    let ns = netns("read");
    let mut sock = socket_in(&ns);
    let family = txs[0].family;
    let mut want = kube_proxy::nftables::ruleset::Ruleset::new(family);
    for tx in txs {
        sock.apply(tx).unwrap_or_else(|e| panic!("{what}: {e}"));
        want.apply_all(&tx.ops).expect("the model applies it");
    }
    let (got, undecoded) = in_netns(ns.name(), || {
        let mut s = NftSocket::new().expect("socket");
        s.read(family, &ReadScope::Whole)
    })
    .unwrap_or_else(|e| panic!("{what}: reading back: {e}"))
    .unwrap_or_else(|| panic!("{what}: no table"));
    assert_eq!(undecoded, vec![], "{what}");
    let lines = |r: &kube_proxy::nftables::ruleset::Ruleset, chain: &str| -> Vec<String> {
        r.chains[chain]
            .rules
            .iter()
            .map(|x| canonical_line(&x.text(family)))
            .collect()
    };
    assert_eq!(
        got.chains.keys().collect::<Vec<_>>(),
        want.chains.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for name in want.chains.keys() {
        assert_eq!(lines(&got, name), lines(&want, name), "{what}: chain {name}");
        assert_eq!(got.chains[name].decl, want.chains[name].decl, "{what}: chain {name}");
    }
    assert_eq!(
        got.sets.keys().collect::<Vec<_>>(),
        want.sets.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, set) in &want.sets {
        assert_eq!(got.sets[name].decl, set.decl, "{what}: set {name}");
        // Elements of timeout sets are the kernel's own (affinity entries); none here.
        assert_eq!(got.sets[name].elements, set.elements, "{what}: set {name}");
    }
    // One chain and one map alone.
    if let (Some(chain), Some(map)) = (
        want.chains.keys().find(|c| !want.chains[*c].rules.is_empty()),
        want.sets.keys().next(),
    ) {
        let scope = ReadScope::Some {
            chains: vec![chain.clone(), "no-such-chain".into()],
            maps: vec![map.clone()],
            keyed: Vec::new(),
        };
        let (some, _) = in_netns(ns.name(), || NftSocket::new().expect("socket").read(family, &scope))
            .expect("reads")
            .expect("a table");
        assert_eq!(some.chains.keys().collect::<Vec<_>>(), vec![chain], "{what}");
        assert_eq!(lines(&some, chain), lines(&want, chain), "{what}: chain {chain}");
        assert_eq!(some.sets[map].elements, want.sets[map].elements, "{what}: set {map}");
    }
    // Elements by key: of a set without intervals just those asked for (a key that is not
    // there gives nothing), of one with intervals all.
    for (name, set) in &want.sets {
        let Some(key) = set.elements.keys().next() else {
            continue;
        };
        let absent = kube_proxy::nftables::ast::ElemKey::ProtoPort(kube_proxy::model::Protocol::Sctp, 1);
        let scope = ReadScope::Some {
            chains: Vec::new(),
            maps: Vec::new(),
            keyed: vec![(name.clone(), vec![key.clone(), absent])],
        };
        let (some, _) = in_netns(ns.name(), || NftSocket::new().expect("socket").read(family, &scope))
            .expect("reads")
            .expect("a table");
        let got: Vec<_> = some.sets[name].elements.keys().collect();
        if set.decl.interval() {
            assert_eq!(some.sets[name].elements, set.elements, "{what}: set {name} whole");
        } else {
            assert_eq!(got, vec![key], "{what}: set {name} by key");
            assert_eq!(some.sets[name].elements[key], set.elements[key], "{what}: set {name}");
        }
    }
}

fn every_scenario_reads_back_over_netlink() {
    for family in [IpFamily::V4, IpFamily::V6] {
        reads_back_as_built(
            &format!("every shape, {family}"),
            &[shapes_setup(family, 50), shapes_update(family)],
        );
    }
    for (name, state, opts) in scenario_cases() {
        reads_back_as_built(&format!("scenario {name}"), &[render_tx(&state, &opts, true)]);
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

fn same_messages_as_nft() {
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

common::harness::main! {
    &[Root, Tool("ip"), Tool("nft")] =>
        every_shape_lists_identically_both_ways,
        an_invalid_op_fails_the_whole_batch_and_is_named,
        another_tables_chain_is_found_by_name,
        a_large_batch_goes_in_one_send,
        every_scenario_lists_identically_both_ways,
        every_scenario_reads_back_over_netlink;
    &[Root, Tool("ip"), Tool("nft"), Tool("strace")] => same_messages_as_nft;
}
