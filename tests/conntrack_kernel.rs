//! The conntrack module against the real kernel, each test in a network namespace of its own
//! (created on a thread that dies with it; the root namespace is never touched): ctnetlink
//! lists and deletes the flows of traffic made for the test, and the sysctls behave as a
//! child namespace makes them. Needs root, connection tracking and IPv6 in the kernel, and
//! `ip`, `nft` and `conntrack` (the harness reports a test whose needs are not met as ignored).

mod common;

use std::fs;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::Path;
use std::time::Duration;

use kube_proxy::conntrack::{
    ConntrackConfig, ConntrackTable, Flow, Netlink, UdpServices, apply_sysctls, clean_stale_entries, conntrack_max,
};
use kube_proxy::exec;
use kube_proxy::model::IpFamily;
use nix::sched::{CloneFlags, unshare};

/// Runs `f` on a fresh thread moved into a new network namespace of its own (namespaces are
/// per thread; this one dies with the thread, and the root namespace is never touched).
fn in_new_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let joined = std::thread::spawn(move || {
        unshare(CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("unshare(CLONE_NEWNET): {e}"));
        let mine = fs::read_link("/proc/thread-self/ns/net").expect("thread netns");
        let process = fs::read_link("/proc/self/ns/net").expect("process netns");
        assert_ne!(
            mine, process,
            "the test thread must have left the process's network namespace"
        );
        // Commands started from this thread inherit its namespace.
        run("ip", &["link", "set", "lo", "up"], None);
        f()
    })
    .join();
    match joined {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Runs `cmd args` (with `stdin`), which must succeed; its stdout.
fn run(cmd: &str, args: &[&str], stdin: Option<&str>) -> String {
    exec::run(cmd, args, stdin).unwrap_or_else(|e| panic!("{e}"))
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

fn set(addrs: &[&str]) -> std::collections::HashSet<SocketAddr> {
    addrs.iter().map(|a| a.parse().expect("test socket address")).collect()
}

fn bind(addr: &str) -> UdpSocket {
    let s = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s
}

fn port(s: &UdpSocket) -> u16 {
    s.local_addr().expect("bound").port()
}

/// Waits for `n` datagrams: once they are delivered, their conntrack entries are confirmed.
fn receive(s: &UdpSocket, n: usize) {
    let mut buf = [0u8; 16];
    for _ in 0..n {
        s.recv_from(&mut buf).expect("datagram delivered");
    }
}

fn by_sport(flows: &[Flow], sport: u16) -> Option<&Flow> {
    flows.iter().find(|f| f.orig_sport == sport)
}

/// The traffic whose flows the stale-flow test lists and cleans, its sockets kept open.
struct Traffic {
    /// Endpoint sockets. `e` sits behind three kube-proxy-like DNAT rules.
    b: UdpSocket,
    e: UdpSocket,
    _f: UdpSocket,
    _clients: Vec<UdpSocket>,
    /// The source ports of the five IPv4 clients, in the order of their targets.
    sport: Vec<u16>,
    /// An IPv6 client and server, when the namespace has IPv6.
    v6: Option<(UdpSocket, UdpSocket)>,
    _tcp: (TcpListener, TcpStream, (TcpStream, SocketAddr)),
}

/// Programs the DNAT rules, then sends one datagram from each of five IPv4 clients (and one
/// over IPv6) and opens a TCP connection.
fn start_traffic() -> Traffic {
    // Endpoint sockets. `e` sits behind three kube-proxy-like DNAT rules.
    let (b, e, f) = (bind("127.0.0.1:0"), bind("127.0.0.1:0"), bind("127.0.0.1:0"));
    let ruleset = format!(
        "table ip kpct {{\n chain out {{\n  type nat hook output priority -100; policy accept;\n  \
         ip daddr 127.0.0.10 udp dport 5300 dnat to 127.0.0.1:{e}\n  \
         ip daddr 127.0.0.11 udp dport 5300 dnat to 127.0.0.1:{e}\n  \
         ip daddr 127.0.0.12 udp dport 30053 dnat to 127.0.0.1:{e}\n }}\n}}\n\
         table ip6 kpct6 {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n  \
         ct state new accept\n }}\n}}\n",
        e = port(&e)
    );
    // NAT (and the ip6 ct rule) make the kernel track this namespace's traffic.
    run("nft", &["-f", "-"], Some(&ruleset));

    let clients: Vec<UdpSocket> = (0..5).map(|_| bind("127.0.0.1:0")).collect();
    let targets = [
        format!("127.0.0.1:{}", port(&b)),
        "127.0.0.10:5300".into(),
        "127.0.0.11:5300".into(),
        format!("127.0.0.1:{}", port(&f)),
        "127.0.0.12:30053".into(),
    ];
    for (c, t) in clients.iter().zip(&targets) {
        c.send_to(b"ping", t.as_str()).expect("send");
    }
    receive(&b, 1);
    receive(&e, 3);
    receive(&f, 1);
    let sport: Vec<u16> = clients.iter().map(port).collect();

    let v6 = UdpSocket::bind("[::1]:0").ok().map(|server| {
        let client = bind("[::1]:0");
        client
            .send_to(b"ping", server.local_addr().expect("bound"))
            .expect("send v6");
        server.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        receive(&server, 1);
        (client, server)
    });

    // A TCP connection too: its entry (with protocol info) must decode and be left out.
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let tcp = TcpStream::connect(listener.local_addr().expect("bound")).expect("connect");
    let accepted = listener.accept().expect("accept");
    Traffic {
        b,
        e,
        _f: f,
        _clients: clients,
        sport,
        v6,
        _tcp: (listener, tcp, accepted),
    }
}

fn kernel_netns_lists_and_deletes_stale_udp_flows() {
    in_new_netns(|| {
        let traffic = start_traffic();
        let (b, e, sport) = (&traffic.b, &traffic.e, &traffic.sport);

        let mut nl = Netlink::new().expect("ctnetlink socket");
        let raw = nl.dump(IpFamily::V4).expect("v4 dump");
        assert!(raw.undecodable.is_empty(), "{:?}", raw.undecodable);
        assert!(raw.other >= 1, "the TCP entry is counted as another protocol: {raw:?}");
        assert_eq!(raw.udp.len(), 5, "{raw:?}");
        let v4_flows = nl.list_udp(IpFamily::V4).expect("v4 dump");
        assert!(v4_flows.iter().all(|fl| fl.orig_dst.is_ipv4()), "{v4_flows:?}");
        // The plain flow, exactly as conntrack records it.
        assert_eq!(
            by_sport(&v4_flows, sport[0]),
            Some(&Flow {
                orig_src: ip("127.0.0.1"),
                orig_dst: ip("127.0.0.1"),
                orig_sport: sport[0],
                orig_dport: port(b),
                reply_src: ip("127.0.0.1"),
                reply_dst: ip("127.0.0.1"),
                reply_sport: port(b),
                reply_dport: sport[0],
            })
        );
        // A DNATed flow: the reply comes from the endpoint, not the service IP.
        let dnat = by_sport(&v4_flows, sport[1]).expect("DNAT flow listed");
        assert_eq!((dnat.orig_dst, dnat.orig_dport), (ip("127.0.0.10"), 5300));
        assert_eq!(dnat.reply_source(), SocketAddr::new(ip("127.0.0.1"), port(e)));
        for s in sport {
            assert!(
                by_sport(&v4_flows, *s).is_some(),
                "flow from port {s} listed: {v4_flows:?}"
            );
        }

        let mut services = UdpServices::default();
        // 0: the endpoint moved to another IP -> stale.
        services.add_service_port([ip("127.0.0.1")], port(b), 0, set(&[&format!("127.0.0.9:{}", port(b))]));
        // 1: DNATed to a serving endpoint -> kept.
        services.add_service_port([ip("127.0.0.10")], 5300, 0, set(&[&format!("127.0.0.1:{}", port(e))]));
        // 2: same endpoint IP, new port -> stale.
        services.add_service_port([ip("127.0.0.11")], 5300, 0, set(&["127.0.0.1:9"]));
        // 3: not a service -> kept.  4: NodePort whose endpoint moved -> stale.
        services.add_service_port([ip("127.0.0.99")], 1, 30053, set(&[&format!("127.0.0.9:{}", port(e))]));

        assert_eq!(
            clean_stale_entries(&mut nl, IpFamily::V4, &services).expect("cleanup"),
            3
        );
        let after = nl.list_udp(IpFamily::V4).expect("v4 dump");
        for (i, s) in sport.iter().enumerate() {
            let kept = i == 1 || i == 3;
            assert_eq!(
                by_sport(&after, *s).is_some(),
                kept,
                "flow {i} (port {s}) after cleanup: {after:?}"
            );
        }
        // Independent check with conntrack-tools.
        let listed = run("conntrack", &["-L", "-p", "udp", "-f", "ipv4"], None);
        for (i, s) in sport.iter().enumerate() {
            let kept = i == 1 || i == 3;
            assert_eq!(
                listed.contains(&format!("sport={s} ")),
                kept,
                "conntrack -L, flow {i}:\n{listed}"
            );
        }
        // Nothing left to clean; deleting a flow that is gone is not an error.
        assert_eq!(
            clean_stale_entries(&mut nl, IpFamily::V4, &services).expect("cleanup"),
            0
        );
        let gone = by_sport(&v4_flows, sport[0]).expect("listed before").clone();
        assert_eq!(nl.delete(&[gone]).expect("ENOENT is fine"), 0);

        stale_udp_flows_ipv6(&mut nl, &v4_flows, traffic.v6.as_ref());
    });
}

/// The IPv6 part of [`kernel_netns_lists_and_deletes_stale_udp_flows`]: listed only under its
/// own family, and cleaned the same way.
fn stale_udp_flows_ipv6(nl: &mut Netlink, v4_flows: &[Flow], v6: Option<&(UdpSocket, UdpSocket)>) {
    if let Some((client, server)) = v6 {
        let (c, s) = (port(client), port(server));
        assert!(by_sport(v4_flows, c).is_none());
        let v6_flows = nl.list_udp(IpFamily::V6).expect("v6 dump");
        assert!(v6_flows.iter().all(|fl| fl.orig_dst.is_ipv6()), "{v6_flows:?}");
        let listed = by_sport(&v6_flows, c).expect("v6 flow listed");
        assert_eq!(
            (listed.orig_dst, listed.orig_dport, listed.reply_sport),
            (ip("::1"), s, s)
        );
        let mut services = UdpServices::default();
        services.add_service_port([ip("::1")], s, 0, set(&[&format!("[::2]:{s}")]));
        assert_eq!(clean_stale_entries(nl, IpFamily::V6, &services).expect("v6 cleanup"), 1);
        assert!(by_sport(&nl.list_udp(IpFamily::V6).expect("v6 dump"), c).is_none());
        let listed = run("conntrack", &["-L", "-p", "udp", "-f", "ipv6"], None);
        assert!(!listed.contains(&format!("sport={c} ")), "{listed}");
    } else {
        panic!("IPv6 unavailable in the test namespace although the kernel has it");
    }
}

/// Where the conntrack sysctls live under /proc/sys.
const NETFILTER: &str = "net/netfilter";

/// A sysctl's value, read independently of the code under test.
fn read_u64(path: &Path) -> Result<u64, String> {
    let text = fs::read_to_string(path).map_err(|e| e.to_string())?;
    text.trim().parse().map_err(|e| format!("{}: {e}", path.display()))
}

fn kernel_netns_conntrack_max_is_a_warning_other_sysctls_apply() {
    in_new_netns(|| {
        let proc_sys = Path::new("/proc/sys");
        let max_file = proc_sys.join(NETFILTER).join("nf_conntrack_max");
        let meta = fs::metadata(&max_file).expect("nf_conntrack_max (the kernel has connection tracking)");
        // Only a non-initial namespace shows nf_conntrack_max read-only; refuse to write
        // anything if this might be the host's.
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            meta.permissions().mode() & 0o222,
            0,
            "nf_conntrack_max is writable: not in a child netns?"
        );
        let current = read_u64(&max_file).expect("readable");
        let cfg = ConntrackConfig {
            max_per_core: u32::MAX, // capped at 1Mi, above the kernel's value
            min: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            tcp_be_liberal: false,
            udp_timeout: Duration::from_secs(37),
            udp_stream_timeout: Duration::ZERO,
        };
        if current >= conntrack_max(&cfg, 2) {
            common::harness::skip(format!(
                "nf_conntrack_max is already {current}, above what the test can ask for"
            ));
        }
        let warnings = apply_sysctls(&cfg, proc_sys, 2);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("net/netfilter/nf_conntrack_max"), "{warnings:?}");
        assert_eq!(read_u64(&max_file), Ok(current));
        // Per-namespace and writable: applied (in this namespace only).
        assert_eq!(
            read_u64(&proc_sys.join(NETFILTER).join("nf_conntrack_udp_timeout")),
            Ok(37)
        );
    });
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("nft"), Tool("conntrack"), Kernel(Conntrack), Kernel(Ipv6)]
        => kernel_netns_lists_and_deletes_stale_udp_flows, kernel_netns_conntrack_max_is_a_warning_other_sysctls_apply;
}
