//! The incremental nftables proxier against the real kernel: random sequences of states are
//! synced one after the other (every transaction must be accepted), and the table the
//! kernel ends with must list exactly like a fresh full render applied by `nft -f`.
//! Each side runs in a thread that unshared its own network namespace (gone with the
//! thread), never in the root namespace.

mod common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::Duration;

use common::netns::in_fresh_netns;
use kube_proxy::config::LocalDetector;
use kube_proxy::model::{
    Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, ServicePortState,
};
use kube_proxy::nftables::proxier::{NftBackend, NftCommand, NftProxier};
use kube_proxy::nftables::render_transaction;
use kube_proxy::proxy::RenderOptions;
use serde_json::Value;

fn opts() -> RenderOptions {
    RenderOptions {
        local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
        ..RenderOptions::default()
    }
}

/// A deterministic pseudo-random state: `seed` picks which of 12 Services exist, their
/// endpoints (some local), affinity, NodePorts, ETP Local and LoadBalancer source ranges.
fn state(seed: u64) -> ProxyState {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ports = Vec::new();
    for i in 0..12u8 {
        let r = next();
        if r % 4 == 0 {
            continue;
        }
        let protocol = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][(r >> 3) as usize % 3];
        let name = ServicePortName {
            namespace: "ns".into(),
            name: format!("s{i}"),
            port: "p".into(),
            protocol,
        };
        // Pairs of Services share a ClusterIP on different ports.
        let mut port =
            ServicePort::cluster_ip(name, IpAddr::V4(Ipv4Addr::new(10, 96, 0, i / 2 + 1)), 80 + u16::from(i));
        if r & (1 << 8) != 0 {
            port.session_affinity_timeout = Some(10800);
        }
        if r & (1 << 9) != 0 {
            port.node_port = 30000 + u16::from(i);
            port.external_policy_local = r & (1 << 10) != 0;
        }
        if r & (1 << 11) != 0 {
            port.load_balancer_vips = vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, i))];
            port.load_balancer_source_ranges = vec!["192.0.2.0/24".parse().expect("cidr")];
        }
        let mut endpoints: Vec<Endpoint> = (0..6u8)
            .filter(|b| r & (1 << (16 + b)) != 0)
            .map(|b| {
                let mut e = Endpoint::ready(IpAddr::V4(Ipv4Addr::new(10, 244, 1, b + 1)), 8080);
                e.is_local = r & (1 << (24 + b)) != 0;
                e
            })
            .collect();
        endpoints.sort_by_key(|e| e.to_string());
        ports.push(ServicePortState { port, endpoints });
    }
    ports.sort_by(|a, b| a.port.name.cmp(&b.port.name));
    ProxyState {
        family: IpFamily::V4,
        node: NodeInfo {
            name: "node-a".into(),
            addresses: vec![IpAddr::V4(Ipv4Addr::new(192, 168, 49, 2))],
            ..NodeInfo::default()
        },
        service_ports: kube_proxy::model::shared(ports),
        service_cidrs: vec!["10.96.0.0/16".parse().expect("cidr")],
        warnings: vec![],
    }
}

/// `nft -j list table ip kube-proxy`, normalised (see [`common::nft`]).
fn listing() -> BTreeMap<String, Value> {
    let out = Command::new("nft")
        .args(["-j", "list", "table", "ip", "kube-proxy"])
        .output()
        .expect("nft runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    common::nft::normalised(&out.stdout)
}

fn reference(st: ProxyState) -> BTreeMap<String, Value> {
    common::nft::applied_in_fresh_netns(render_transaction(&st, &opts(), true))
}

fn incremental_matches_full_render(backend: fn() -> Box<dyn NftBackend>) {
    synced_states_match_full_render(backend, None);
}

/// Syncs six random states, restarting the proxier (a new one over the same table) before
/// the state at index `restart_at`, and compares the table with a full render of the last.
fn synced_states_match_full_render(backend: fn() -> Box<dyn NftBackend>, restart_at: Option<usize>) {
    for run in 0..4u64 {
        let seeds: Vec<u64> = (0..6).map(|i| run * 100 + i).collect();
        let last = state(*seeds.last().expect("seeds"));
        let got = in_fresh_netns(move || {
            let new = || {
                let mut p = NftProxier::with_backend(IpFamily::V4, opts(), backend());
                // Small transactions, so full syncs are split too.
                p.set_max_ops_per_transaction(40);
                p
            };
            let mut p = new();
            for (i, s) in seeds.iter().enumerate() {
                if restart_at == Some(i) {
                    p = new();
                }
                let st = state(*s);
                if let Err(e) = p.sync(&st) {
                    panic!("sync of state {s} failed: {e}");
                }
            }
            p.set_stale_chain_delay(Duration::ZERO);
            p.sync(&state(*seeds.last().expect("seeds"))).expect("final sync");
            listing()
        });
        let want = reference(last);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "run {run}: objects differ"
        );
        for (k, v) in &want {
            assert_eq!(&got[k], v, "run {run}: {k} differs");
        }
    }
}

fn incremental_syncs_with_nft_match_a_full_render() {
    incremental_matches_full_render(|| Box::new(NftCommand));
}

fn incremental_syncs_over_netlink_match_a_full_render() {
    incremental_matches_full_render(|| {
        Box::new(kube_proxy::nftables::netlink::NftSocket::new().expect("netlink socket"))
    });
}

/// A restart finds the table of the previous process and replaces it in place.
fn a_restart_over_netlink_replaces_the_table_and_matches_a_full_render() {
    synced_states_match_full_render(
        || Box::new(kube_proxy::nftables::netlink::NftSocket::new().expect("netlink socket")),
        Some(3),
    );
}

fn a_restart_with_nft_replaces_the_table_and_matches_a_full_render() {
    synced_states_match_full_render(|| Box::new(NftCommand), Some(3));
}

common::harness::main! {
    &[Root, Tool("nft")] =>
        incremental_syncs_with_nft_match_a_full_render,
        incremental_syncs_over_netlink_match_a_full_render,
        a_restart_over_netlink_replaces_the_table_and_matches_a_full_render,
        a_restart_with_nft_replaces_the_table_and_matches_a_full_render;
}
