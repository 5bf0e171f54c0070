//! The end-to-end test bed on its own, without any kube-proxy rules: plain routing between the
//! namespaces, the name server and the probe. Needs root (creates network namespaces).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use common::netns::netns_list;
use kube_proxy::lab::probe::{ERR_REFUSED, ERR_TIMEOUT, ERR_UNREACHABLE, ProbeArgs};
use kube_proxy::lab::testbed::{SERVER_PORT, Testbed, TestbedSpec};
use kube_proxy::model::IpFamily;

const PREFIX: &str = "kptb";

fn spec(endpoints: usize) -> TestbedSpec {
    TestbedSpec {
        endpoints,
        ..TestbedSpec::new(PREFIX, PathBuf::from(env!("CARGO_BIN_EXE_kube-proxy")))
    }
}

fn build(endpoints: usize) -> Testbed {
    let started = Instant::now();
    let bed = Testbed::build(&spec(endpoints)).expect("test bed builds (needs root)");
    eprintln!(
        "bed {} with {endpoints} endpoints built in {:?}",
        bed.id(),
        started.elapsed()
    );
    bed
}

fn client_reaches_every_endpoint_over_tcp_and_udp() {
    let bed = build(3);
    assert_eq!(bed.endpoints().len(), 3);
    for (i, ep) in bed.endpoints().iter().enumerate() {
        assert_eq!(ep.name, format!("ep{}", i + 1));
        assert_eq!(ep.ip.to_string(), format!("10.244.{}.2", i + 1));
        for args in [
            ProbeArgs::tcp(ep.server_addr()).with_count(3),
            ProbeArgs::udp(ep.server_addr()).with_count(3),
        ] {
            let r = bed.probe(&bed.client, &args).unwrap();
            assert!(r.all_ok(), "{args:?}: {r:?}");
            assert_eq!(r.attempts.len(), 3);
            assert_eq!(
                r.names().into_iter().collect::<Vec<_>>(),
                vec![(ep.name.clone(), 3)],
                "{r:?}"
            );
            assert_eq!(
                r.seen_sources().into_iter().collect::<Vec<_>>(),
                vec![bed.client_ip()],
                "{r:?}"
            );
        }
    }
}

fn outside_host_reaches_an_endpoint_through_the_node() {
    let bed = build(2);
    let ep = bed.endpoint(1);
    for src in bed.outside_ips() {
        let r = bed
            .probe(&bed.outside, &ProbeArgs::tcp(ep.server_addr()).with_bind(src))
            .unwrap();
        assert!(r.all_ok(), "{r:?}");
        assert_eq!(r.attempts[0].name.as_deref(), Some(ep.name.as_str()));
        assert_eq!(r.attempts[0].seen_src, Some(src));
    }
    let r = bed.probe(&bed.outside, &ProbeArgs::udp(ep.server_addr())).unwrap();
    assert!(r.all_ok(), "{r:?}");
    // And the node reaches the outside host's and the client's addresses.
    let r = bed
        .probe(&bed.node, &ProbeArgs::tcp(bed.endpoint(0).server_addr()))
        .unwrap();
    assert_eq!(r.attempts[0].seen_src, Some("10.244.1.1".parse().unwrap()), "{r:?}");
}

fn an_added_endpoint_answers() {
    let mut bed = build(3);
    let started = Instant::now();
    let ep = bed.add_endpoint().unwrap();
    eprintln!("endpoint added in {:?}", started.elapsed());
    assert_eq!(ep.name, "ep4");
    assert_eq!(ep.ip.to_string(), "10.244.4.2");
    let addr = ep.server_addr();
    let r = bed.probe(&bed.client, &ProbeArgs::tcp(addr)).unwrap();
    assert!(r.all_ok(), "{r:?}");
    assert_eq!(r.attempts[0].name.as_deref(), Some("ep4"));
    assert_eq!(bed.endpoints().len(), 4);
    bed.remove_endpoint("ep2").unwrap();
    assert_eq!(
        bed.endpoints().iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        ["ep1", "ep3", "ep4"]
    );
    assert!(!netns_list().iter().any(|n| n == &format!("{}-ep2", bed.id())));
    // The next endpoint skips subnet 9 (the client's) only when it gets there.
    assert_eq!(bed.add_endpoint().unwrap().name, "ep5");
}

fn a_closed_port_is_refused_quickly() {
    let bed = build(1);
    let closed = SocketAddr::new(bed.endpoint(0).ip, 9);
    let r = bed
        .probe(&bed.client, &ProbeArgs::tcp(closed).with_count(5).with_timeout_ms(3000))
        .unwrap();
    assert_eq!(r.attempts.len(), 5);
    for a in &r.attempts {
        assert!(!a.ok);
        assert_eq!(a.error.as_deref(), Some(ERR_REFUSED), "{r:?}");
        assert!(a.elapsed_us < 500_000, "refusal took {} µs", a.elapsed_us);
    }
    // UDP to a closed port: the endpoint's ICMP port-unreachable (no rate limit: every one).
    let r = bed
        .probe(&bed.client, &ProbeArgs::udp(closed).with_count(20).with_interval_ms(0))
        .unwrap();
    assert_eq!(r.errors().get(ERR_REFUSED), Some(&20), "{r:?}");
}

fn a_stream_echoes_every_line() {
    let bed = build(1);
    let ep = bed.endpoint(0);
    let r = bed
        .probe(
            &bed.client,
            &ProbeArgs::tcp(ep.server_addr())
                .with_stream_seconds(1.0)
                .with_interval_ms(50),
        )
        .unwrap();
    let s = r.stream.as_ref().expect("a stream report");
    assert!(r.all_ok(), "{r:?}");
    assert!(s.sent >= 10, "{s:?}");
    assert_eq!(s.echoed, s.sent, "{s:?}");
    assert!(s.errors.is_empty(), "{s:?}");
    assert_eq!(r.attempts[0].name.as_deref(), Some("ep1"));
}

fn unrouted_addresses_time_out_or_are_unreachable() {
    let bed = build(1);
    // No endpoint 10.244.200.2: the node forwards it along its default route to the outside
    // host, which does not forward and drops it.
    let nowhere = SocketAddr::new("10.244.200.2".parse().unwrap(), SERVER_PORT);
    let r = bed
        .probe(&bed.client, &ProbeArgs::tcp(nowhere).with_timeout_ms(300))
        .unwrap();
    assert_eq!(r.attempts[0].error.as_deref(), Some(ERR_TIMEOUT), "{r:?}");
    let r = bed
        .probe(&bed.client, &ProbeArgs::udp(nowhere).with_timeout_ms(300))
        .unwrap();
    assert_eq!(r.attempts[0].error.as_deref(), Some(ERR_TIMEOUT), "{r:?}");
    // The outside host has no default route: no route to 10.0.0.1 at all.
    let r = bed
        .probe(&bed.outside, &ProbeArgs::tcp("10.0.0.1:80".parse().unwrap()))
        .unwrap();
    assert_eq!(r.attempts[0].error.as_deref(), Some(ERR_UNREACHABLE), "{r:?}");
}

fn the_bed_is_dual_stack_the_same_paths_work_over_ipv6() {
    let bed = build(2);
    assert!(bed.has_ipv6());
    let v6 = IpFamily::V6;
    let client = bed.client_ip_in(v6);
    assert_eq!(client.to_string(), "fd00:10:244:9::2");
    for (i, ep) in bed.endpoints().iter().enumerate() {
        assert_eq!(ep.ip_in(v6).to_string(), format!("fd00:10:244:{}::2", i + 1));
        for args in [
            ProbeArgs::tcp(ep.server_addr_in(v6)).with_count(3),
            ProbeArgs::udp(ep.server_addr_in(v6)).with_count(3),
        ] {
            let r = bed.probe(&bed.client, &args).unwrap();
            assert!(r.all_ok(), "{args:?}: {r:?}");
            assert_eq!(r.names().into_iter().collect::<Vec<_>>(), vec![(ep.name.clone(), 3)]);
            assert_eq!(r.seen_sources().into_iter().collect::<Vec<_>>(), vec![client], "{r:?}");
        }
    }
    // The outside host reaches a pod through the node, with its own address kept.
    let ep = bed.endpoint(1);
    for src in bed.outside_ips_in(v6) {
        // 3 s: room for one SYN retransmission (after 1 s) should the first SYN go while the
        // node is still resolving the pod's neighbour entry.
        let r = bed
            .probe(
                &bed.outside,
                &ProbeArgs::tcp(ep.server_addr_in(v6))
                    .with_bind(src)
                    .with_timeout_ms(3000),
            )
            .unwrap();
        assert!(r.all_ok(), "{r:?}");
        assert_eq!(r.attempts[0].seen_src, Some(src));
    }
    // The node's own traffic to a pod leaves from its side of the pod's link.
    let r = bed
        .probe(&bed.node, &ProbeArgs::tcp(bed.endpoint(0).server_addr_in(v6)))
        .unwrap();
    assert_eq!(r.attempts[0].seen_src, Some(bed.endpoint(0).gateway_in(v6)), "{r:?}");
    // No forwarding on the outside host: nothing outside the routed prefixes gets anywhere.
    let r = bed
        .probe(&bed.outside, &ProbeArgs::tcp("[fd00:99::1]:80".parse().unwrap()))
        .unwrap();
    assert_eq!(r.attempts[0].error.as_deref(), Some(ERR_UNREACHABLE), "{r:?}");
}

/// An ICMPv6 port unreachable from the node (an ip6tables REJECT in the node's namespace, as
/// kube-proxy's rules send it) is seen as a refusal at once, not on the SYN retry a second
/// later: the probe sets IPV6_RECVERR.
fn an_ipv6_reject_on_the_node_is_refused_at_once() {
    let bed = build(1);
    let to = SocketAddr::new(bed.endpoint(0).ip_in(IpFamily::V6), SERVER_PORT);
    bed.node
        .exec_ok(
            "ip6tables",
            ["-A", "FORWARD", "-p", "tcp", "--dport", "8080", "-j", "REJECT"],
        )
        .unwrap();
    let r = bed
        .probe(&bed.client, &ProbeArgs::tcp(to).with_count(10).with_timeout_ms(3000))
        .unwrap();
    for a in &r.attempts {
        assert_eq!(a.error.as_deref(), Some(ERR_REFUSED), "{r:?}");
        assert!(a.elapsed_us < 100_000, "refusal took {} µs", a.elapsed_us);
    }
    assert_eq!(r.attempts.len(), 10);
}

fn dropping_a_bed_removes_its_namespaces_and_processes() {
    let bed = build(2);
    let id = bed.id().to_string();
    let names = bed.namespace_names();
    assert_eq!(names.len(), 5);
    let list = netns_list();
    for n in &names {
        assert!(list.contains(n), "{n} not in {list:?}");
    }
    let pids: Vec<u32> = bed.endpoints().iter().map(|e| e.server().pid()).collect();
    // A process spawned in the node and left running is killed too.
    let sleeper = bed
        .spawn_in_node(std::path::Path::new("sleep"), &["1000".to_string()])
        .unwrap();
    let sleeper_pid = sleeper.pid();
    std::mem::forget(sleeper); // not reaped by its guard: the namespace's Drop must kill it
    drop(bed);
    let left: Vec<String> = netns_list()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{id}-")))
        .collect();
    assert!(left.is_empty(), "left over: {left:?}");
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "server {pid} still there"
        );
    }
    // The forgotten sleeper was killed (a zombie until this process exits, as nobody reaps it).
    let status = std::fs::read_to_string(format!("/proc/{sleeper_pid}/status")).unwrap_or_default();
    assert!(
        status.is_empty() || status.contains("State:\tZ"),
        "sleeper still alive: {status}"
    );
}

fn a_panicking_test_still_cleans_up() {
    let id = std::sync::Mutex::new(String::new());
    let res = std::panic::catch_unwind(|| {
        let bed = build(1);
        *id.lock().unwrap() = bed.id().to_string();
        panic!("boom");
    });
    assert!(res.is_err());
    let id = id.into_inner().unwrap();
    assert!(!id.is_empty());
    let left: Vec<String> = netns_list()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{id}-")))
        .collect();
    assert!(left.is_empty(), "left over: {left:?}");
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl")] =>
        client_reaches_every_endpoint_over_tcp_and_udp,
        outside_host_reaches_an_endpoint_through_the_node,
        an_added_endpoint_answers,
        a_closed_port_is_refused_quickly,
        a_stream_echoes_every_line,
        unrouted_addresses_time_out_or_are_unreachable,
        dropping_a_bed_removes_its_namespaces_and_processes,
        a_panicking_test_still_cleans_up;
    &[Root, Tool("ip"), Tool("sysctl"), Kernel(Ipv6)] =>
        the_bed_is_dual_stack_the_same_paths_work_over_ipv6;
    &[Root, Tool("ip"), Tool("sysctl"), Tool("ip6tables"), Kernel(Ipv6)] =>
        an_ipv6_reject_on_the_node_is_refused_at_once;
}
