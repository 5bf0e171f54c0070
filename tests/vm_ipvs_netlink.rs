//! `kube_proxy::ipvs::netlink` against a real IPVS: the kernel of the test VM (`vm/run`), since
//! this machine's own kernel has none. Needs root, qemu and Debian's kernel (see .ci/run);
//! without them it is reported as ignored, with what is missing.
//!
//! One VM boot for the whole file: on the host, [`ipvs_netlink_in_vm`] re-runs this very test
//! binary inside the VM (`--exact ipvs_netlink_in_vm` with `KUBE_PROXY_IN_VM=1`), where the
//! same test does the real work in a fresh network namespace (IPVS tables are per namespace):
//! - every scheduler kube-proxy offers, persistence, flags, IPv6, SCTP and a firewall-mark
//!   service, with real servers, read back by our dump and by `ipvsadm -Ln`;
//! - the same sequence of operations (including refused ones) on the kernel and on
//!   [`FakeIpvs`], comparing every result and the whole table after every step: the fake
//!   refuses what the kernel refuses, with the same errno;
//! - timeouts, flush, and dumps that span many datagrams.

mod common;
#[path = "support/vm.rs"]
mod vm;

use std::time::Duration;

use kube_proxy::ipvs::netlink::IpvsError;

/// Printed by the in-VM run when every check passed, so that the host knows the checks ran
/// (and not, say, a filter that matched no test).
const ALL_PASSED: &str = "ipvs-netlink-in-vm: all checks passed";

fn ipvs_netlink_in_vm() {
    vm::checks_in_vm("ipvs_netlink_in_vm", ALL_PASSED, Duration::from_secs(600), in_vm::run);
}

/// Where the kernel has no IPVS at all (this machine's), creating a handle says so in the words
/// the daemon shows, and does not fall back to anything.
fn no_ipvs_is_a_clear_error() {
    match kube_proxy::ipvs::netlink::IpvsHandle::new() {
        Err(e @ IpvsError::NotAvailable) => assert_eq!(
            e.to_string(),
            "the kernel has no IPVS (ip_vs module not loaded): run `modprobe ip_vs`"
        ),
        // A host with IPVS (loaded, or loaded on demand by the lookup): nothing to check here;
        // the VM test covers it.
        Ok(_) => assert!(
            std::path::Path::new("/proc/net/ip_vs").exists(),
            "the family resolved, so ip_vs must be loaded"
        ),
        Err(e) => panic!("expected NotAvailable or a handle, got: {e}"),
    }
}

mod in_vm {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    use std::net::IpAddr;
    use std::process::Command;

    use kube_proxy::ipvs::netlink::*;
    use kube_proxy::model::{IpFamily, Protocol};

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn tcp(addr: &str, port: u16, sched: &str) -> VirtualServer {
        VirtualServer::new(ip(addr), Protocol::Tcp, port, sched)
    }

    fn rs(addr: &str, port: u16, weight: u32) -> RealServer {
        RealServer::new(ip(addr), port, weight)
    }

    /// Runs `cmd` (in this thread's network namespace: a child inherits the forking thread's).
    fn sh(cmd: &str, args: &[&str]) -> String {
        let out = Command::new(cmd)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running {cmd}: {e}"));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{cmd} {args:?} failed: {text}");
        text
    }

    /// Runs `f` on a thread in a new network namespace with `lo` up (without it, the kernel
    /// refuses every real server: it wants a unicast route for the address).
    fn in_fresh_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        crate::common::netns::in_fresh_netns(|| {
            sh("ip", &["link", "set", "lo", "up"]);
            f()
        })
    }

    pub fn run() {
        in_fresh_netns(basics);
        in_fresh_netns(kernel_and_fake_agree);
        in_fresh_netns(big_dumps);
    }

    /// The whole table, comparable: services without counters by key, each with its real
    /// servers without counters by address.
    fn snapshot(ipvs: &mut dyn Ipvs) -> BTreeMap<ServiceKey, (VirtualServer, Vec<RealServer>)> {
        let mut out = BTreeMap::new();
        for vs in ipvs.services().expect("services") {
            let mut dests: Vec<RealServer> = ipvs
                .dests(&vs)
                .expect("dests")
                .iter()
                .map(RealServer::without_counters)
                .collect();
            dests.sort_by_key(RealServer::key);
            out.insert(vs.key(), (vs.without_stats(), dests));
        }
        out
    }

    /// `ipvsadm -Ln` as (service line, its real-server lines), blanks collapsed.
    fn ipvsadm_list() -> BTreeMap<String, Vec<String>> {
        let text = sh("ipvsadm", &["-Ln"]);
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut current = None;
        for line in text.lines().skip(3) {
            let words = line.split_whitespace().collect::<Vec<_>>().join(" ");
            if let Some(dest) = words.strip_prefix("-> ") {
                let key: &String = current.as_ref().expect("a real server after its service");
                out.get_mut(key).expect("service").push(dest.to_string());
            } else {
                out.insert(words.clone(), Vec::new());
                current = Some(words);
            }
        }
        for dests in out.values_mut() {
            dests.sort();
        }
        out
    }

    /// Our dump in `ipvsadm -Ln`'s words (the parts of it this module models).
    fn as_ipvsadm(table: &BTreeMap<ServiceKey, (VirtualServer, Vec<RealServer>)>) -> BTreeMap<String, Vec<String>> {
        table
            .values()
            .map(|(vs, dests)| {
                let mut line = format!("{} {}", vs.key(), vs.scheduler);
                let flag_names: Vec<&str> = [(ServiceFlags::SCHED1, "fallback"), (ServiceFlags::SCHED2, "port")]
                    .iter()
                    .filter(|(f, _)| vs.flags.contains(*f))
                    .map(|(_, n)| *n)
                    .collect();
                if !flag_names.is_empty() {
                    let names: Vec<String> = flag_names.iter().map(|n| format!("{}-{n}", vs.scheduler)).collect();
                    write!(line, " ({})", names.join(",")).expect("string");
                }
                if let Some(t) = vs.persistent_timeout {
                    write!(line, " persistent {t}").expect("string");
                    let host = host_netmask(vs.family());
                    if vs.netmask != host {
                        match vs.family() {
                            IpFamily::V4 => write!(line, " mask {}", std::net::Ipv4Addr::from(vs.netmask)),
                            IpFamily::V6 => write!(line, " mask {}", vs.netmask),
                        }
                        .expect("string");
                    }
                }
                let mut d: Vec<String> = dests
                    .iter()
                    .map(|d| {
                        format!(
                            "{} {} {} {} {}",
                            d.key(),
                            d.forward.name(),
                            d.weight,
                            d.active_conns,
                            d.inactive_conns
                        )
                    })
                    .collect();
                d.sort();
                (line, d)
            })
            .collect()
    }

    fn basics() {
        let mut k = IpvsHandle::new().expect("IPVS is in the VM's kernel");
        eprintln!("IPVS family id {:#x}", k.family_id());
        let info = k.info().expect("info");
        assert_eq!(info.version_string(), "1.2.1");
        assert!(info.conn_table_size > 0, "{info:?}");
        assert!(k.services().expect("services").is_empty(), "a fresh namespace");
        assert_eq!(k.timeouts().expect("timeouts"), Timeouts::KERNEL_DEFAULT);

        // Every scheduler kube-proxy offers, as kube-proxy would use them, and the rest of
        // what the module models.
        let mut services = Vec::new();
        for (i, sched) in ["rr", "wrr", "lc", "wlc", "sh", "dh", "sed", "nq", "mh"]
            .iter()
            .enumerate()
        {
            let mut vs = tcp(&format!("10.0.1.{}", i + 1), 80, sched);
            if *sched == "sh" {
                vs.flags = ServiceFlags::SH_FALLBACK | ServiceFlags::SH_PORT;
            }
            if *sched == "mh" {
                vs.flags = ServiceFlags::MH_FALLBACK | ServiceFlags::MH_PORT;
            }
            services.push(vs);
        }
        services.push(tcp("10.0.2.1", 443, "rr").with_persistence(10800));
        services.push(VirtualServer {
            netmask: 0xffff_ff00,
            ..tcp("10.0.2.2", 443, "rr").with_persistence(60)
        });
        services.push(VirtualServer::new(ip("fd00::10"), Protocol::Udp, 53, "wrr").with_persistence(600));
        services.push(VirtualServer::new(ip("10.0.2.3"), Protocol::Sctp, 3868, "rr"));
        services.push(VirtualServer::fwmark(IpFamily::V4, 7, "lc"));
        let mut want = BTreeMap::new();
        for (i, vs) in services.iter().enumerate() {
            k.add_service(vs).unwrap_or_else(|e| panic!("{e}"));
            let dests: Vec<RealServer> = match vs.family() {
                IpFamily::V4 => vec![
                    rs(&format!("10.244.{i}.2"), 8080, 1),
                    rs(&format!("10.244.{i}.3"), 8080, 2),
                ],
                IpFamily::V6 => vec![rs("fd00:244::2", 5353, 1), rs("fd00:244::3", 5353, 3)],
            };
            for d in &dests {
                k.add_dest(vs, d).unwrap_or_else(|e| panic!("{e}"));
            }
            want.insert(vs.key(), (vs.clone(), dests));
        }
        let got = snapshot(&mut k);
        assert_eq!(got, want, "our dump is what we added");
        assert_eq!(ipvsadm_list(), as_ipvsadm(&got), "ipvsadm -Ln agrees with our dump");

        // Changes, read back.
        let mut rr = services[0].clone();
        rr.scheduler = "wlc".into();
        rr.persistent_timeout = Some(300);
        k.update_service(&rr).expect("update service");
        let mut d = rs("10.244.0.2", 8080, 0);
        k.update_dest(&rr, &d).expect("weight 0");
        d.weight = 0;
        let mut back: Vec<RealServer> = k
            .dests(&rr)
            .expect("dests")
            .iter()
            .map(RealServer::without_counters)
            .collect();
        back.sort_by_key(RealServer::key);
        assert_eq!(back, vec![d.clone(), rs("10.244.0.3", 8080, 2)]);
        rr.persistent_timeout = None;
        k.update_service(&rr).expect("persistence off");
        let got = snapshot(&mut k);
        assert_eq!(got[&rr.key()].0, rr, "persistence switched off again");
        assert_eq!(ipvsadm_list(), as_ipvsadm(&got), "ipvsadm -Ln agrees after updates");

        k.delete_dest(&rr, &d).expect("delete dest");
        k.delete_service(&services[1]).expect("delete service");
        let got = snapshot(&mut k);
        assert_eq!(got.len(), services.len() - 1);
        assert_eq!(got[&rr.key()].1, vec![rs("10.244.0.3", 8080, 2)]);

        // Timeouts: 0 keeps a value.
        k.set_timeouts(&Timeouts {
            tcp: 1000,
            tcp_fin: 0,
            udp: 60,
        })
        .expect("set timeouts");
        let want_t = Timeouts {
            tcp: 1000,
            tcp_fin: 120,
            udp: 60,
        };
        assert_eq!(k.timeouts().expect("timeouts"), want_t);
        assert_eq!(
            sh("ipvsadm", &["-Ln", "--timeout"]).trim(),
            "Timeout (tcp tcpfin udp): 1000 120 60"
        );

        k.flush().expect("flush");
        assert!(k.services().expect("services").is_empty());
        assert_eq!(
            sh("ipvsadm", &["-Ln"]).lines().count(),
            3,
            "ipvsadm sees an empty table"
        );
        eprintln!("basics: ok");
    }

    #[derive(Clone, Debug)]
    enum Step {
        AddService(VirtualServer),
        UpdateService(VirtualServer),
        DeleteService(VirtualServer),
        Dests(VirtualServer),
        AddDest(VirtualServer, RealServer),
        UpdateDest(VirtualServer, RealServer),
        DeleteDest(VirtualServer, RealServer),
        SetTimeouts(Timeouts),
        Timeouts,
        Flush,
    }

    fn apply(ipvs: &mut dyn Ipvs, step: &Step) -> Result<String, IpvsError> {
        Ok(match step {
            Step::AddService(vs) => ipvs.add_service(vs).map(|()| String::new())?,
            Step::UpdateService(vs) => ipvs.update_service(vs).map(|()| String::new())?,
            Step::DeleteService(vs) => ipvs.delete_service(vs).map(|()| String::new())?,
            Step::Dests(vs) => {
                let mut d: Vec<RealServer> = ipvs.dests(vs)?.iter().map(RealServer::without_counters).collect();
                d.sort_by_key(RealServer::key);
                format!("{d:?}")
            }
            Step::AddDest(vs, rs) => ipvs.add_dest(vs, rs).map(|()| String::new())?,
            Step::UpdateDest(vs, rs) => ipvs.update_dest(vs, rs).map(|()| String::new())?,
            Step::DeleteDest(vs, rs) => ipvs.delete_dest(vs, rs).map(|()| String::new())?,
            Step::SetTimeouts(t) => ipvs.set_timeouts(t).map(|()| String::new())?,
            Step::Timeouts => format!("{:?}", ipvs.timeouts()?),
            Step::Flush => ipvs.flush().map(|()| String::new())?,
        })
    }

    fn steps() -> Vec<Step> {
        use Step::*;
        let a = tcp("10.0.0.1", 80, "rr");
        let b = VirtualServer::new(ip("fd00::1"), Protocol::Udp, 53, "sh").with_flags(ServiceFlags::SH_PORT);
        let missing = tcp("10.0.0.9", 80, "rr");
        let d1 = rs("10.244.0.2", 8080, 1);
        let d2 = rs("10.244.0.3", 8080, 1);
        let d6 = rs("fd00:244::2", 53, 1);
        let fw = VirtualServer::fwmark(IpFamily::V4, 7, "lc");
        vec![
            AddService(a.clone()),
            AddService(a.clone()),
            AddService(b.clone()),
            AddService(tcp("10.0.0.2", 80, "nosuch")),
            // Longer than the kernel's 15 bytes.
            AddService(tcp("10.0.0.2", 80, "abcdefghijklmnopq")),
            AddService(VirtualServer {
                netmask: 0,
                ..VirtualServer::new(ip("fd00::2"), Protocol::Tcp, 80, "rr").with_persistence(10)
            }),
            AddService(VirtualServer {
                netmask: 129,
                ..VirtualServer::new(ip("fd00::2"), Protocol::Tcp, 80, "rr").with_persistence(10)
            }),
            UpdateService(missing.clone()),
            UpdateService(tcp("10.0.0.1", 80, "nosuch")),
            UpdateService(tcp("10.0.0.1", 80, "wrr").with_persistence(30)),
            DeleteService(missing.clone()),
            Dests(missing.clone()),
            AddDest(missing.clone(), d1.clone()),
            AddDest(a.clone(), d1.clone()),
            AddDest(a.clone(), d1.clone()),
            AddDest(a.clone(), d2.clone()),
            AddDest(b.clone(), d6.clone()),
            Dests(a.clone()),
            // A real server of the other family needs tunnelling.
            AddDest(a.clone(), d6.clone()),
            AddDest(b.clone(), d1.clone()),
            AddDest(a.clone(), rs("0.0.0.0", 80, 1)),
            AddDest(a.clone(), rs("224.0.0.1", 80, 1)),
            AddDest(
                a.clone(),
                RealServer {
                    upper_threshold: 5,
                    lower_threshold: 10,
                    ..rs("10.244.0.4", 80, 1)
                },
            ),
            AddDest(
                a.clone(),
                RealServer {
                    upper_threshold: 0,
                    lower_threshold: 10,
                    ..rs("10.244.0.4", 80, 1)
                },
            ),
            AddDest(a.clone(), rs("10.244.0.4", 80, u32::MAX)),
            // Duplicate checks before range checks?
            AddDest(
                a.clone(),
                RealServer {
                    upper_threshold: 5,
                    lower_threshold: 10,
                    ..d1.clone()
                },
            ),
            UpdateDest(a.clone(), rs("10.244.0.2", 8080, 0)),
            UpdateDest(a.clone(), rs("10.244.0.9", 8080, 0)),
            UpdateDest(missing.clone(), d1.clone()),
            UpdateDest(
                a.clone(),
                RealServer {
                    upper_threshold: 1,
                    lower_threshold: 2,
                    ..rs("10.244.0.9", 8080, 0)
                },
            ),
            DeleteDest(a.clone(), rs("10.244.0.9", 8080, 0)),
            DeleteDest(missing.clone(), d1.clone()),
            DeleteDest(a.clone(), d2.clone()),
            // A port-0 real server (does the kernel fill in the service's port?).
            AddDest(a.clone(), rs("10.244.0.5", 0, 1)),
            // Which comes first: the family check or the range check?
            AddDest(
                a.clone(),
                RealServer {
                    upper_threshold: 1,
                    lower_threshold: 2,
                    ..d6.clone()
                },
            ),
            // Changing a real server that does not exist, with an address that never could.
            UpdateDest(a.clone(), rs("224.0.0.1", 80, 1)),
            // Scheduler flags on a scheduler that has no use for them.
            AddService(tcp("10.0.0.3", 80, "rr").with_flags(ServiceFlags::SCHED1 | ServiceFlags::ONE_PACKET)),
            // Firewall-mark services, of both families, with a port-0 real server.
            AddService(fw.clone()),
            AddService(fw.clone()),
            AddService(VirtualServer::fwmark(IpFamily::V6, 7, "wlc")),
            AddDest(fw.clone(), rs("10.244.0.6", 0, 1)),
            UpdateService(VirtualServer {
                netmask: 0xffff_0000,
                ..fw.clone().with_persistence(100)
            }),
            DeleteService(fw.clone()),
            Timeouts,
            SetTimeouts(kube_proxy::ipvs::netlink::Timeouts {
                tcp: 0,
                tcp_fin: 30,
                udp: 0,
            }),
            Timeouts,
            SetTimeouts(kube_proxy::ipvs::netlink::Timeouts {
                tcp: i32::MAX as u32,
                tcp_fin: 0,
                udp: 0,
            }),
            SetTimeouts(kube_proxy::ipvs::netlink::Timeouts {
                tcp: 8_589_934,
                tcp_fin: 0,
                udp: 0,
            }),
            SetTimeouts(kube_proxy::ipvs::netlink::Timeouts {
                tcp: 8_589_935,
                tcp_fin: 0,
                udp: 0,
            }),
            Timeouts,
            DeleteService(a.clone()),
            Dests(a.clone()),
            Flush,
            Flush,
        ]
    }

    /// The same steps on the kernel and on the fake: equal results (errno for errno) and equal
    /// tables after every step. Differences are collected and reported together.
    fn kernel_and_fake_agree() {
        let mut k = IpvsHandle::new().expect("IPVS");
        let mut f = FakeIpvs::new();
        let mut differences = Vec::new();
        for (i, step) in steps().iter().enumerate() {
            let kr = apply(&mut k, step);
            let fr = apply(&mut f, step);
            let show = |r: &Result<String, IpvsError>| match r {
                Ok(s) => format!("ok {s}"),
                Err(e) => format!("{:?} ({e})", e.errno()),
            };
            eprintln!("step {i}: {step:?}\n  kernel: {}\n  fake:   {}", show(&kr), show(&fr));
            let same = match (&kr, &fr) {
                (Ok(a), Ok(b)) => a == b,
                (Err(a), Err(b)) => a.errno().is_some() && a.errno() == b.errno(),
                _ => false,
            };
            if !same {
                differences.push(format!("step {i} {step:?}: kernel {}, fake {}", show(&kr), show(&fr)));
            }
            let (ks, fs) = (snapshot(&mut k), snapshot(&mut f));
            if ks != fs {
                differences.push(format!(
                    "after step {i} {step:?}: kernel table {ks:?}\n  fake table {fs:?}"
                ));
            }
        }
        assert!(
            differences.is_empty(),
            "the fake and the kernel differ:\n{}",
            differences.join("\n")
        );
        eprintln!("kernel and fake agree: ok");
    }

    /// Dumps longer than one datagram (the kernel sends a dump in parts of at most 32 KiB).
    fn big_dumps() {
        let mut k = IpvsHandle::new().expect("IPVS");
        let n = 600;
        for i in 0..n {
            let vs = tcp(&format!("10.1.{}.{}", i / 250, i % 250 + 1), 80, "rr");
            k.add_service(&vs).unwrap_or_else(|e| panic!("{e}"));
        }
        let vs = tcp("10.2.0.1", 80, "rr");
        k.add_service(&vs).expect("add");
        let m = 400;
        for i in 0..m {
            let d = rs(&format!("10.3.{}.{}", i / 250, i % 250 + 1), 8080, 1);
            k.add_dest(&vs, &d).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(k.services().expect("services").len(), n + 1);
        assert_eq!(k.dests(&vs).expect("dests").len(), m);
        k.flush().expect("flush");
        assert!(k.services().expect("services").is_empty());
        eprintln!("big dumps ({n} services, {m} real servers): ok");
    }
}

common::harness::main! {
    &[Root, Vm] => ipvs_netlink_in_vm;
    &[Host] => no_ipvs_is_a_clear_error;
}
