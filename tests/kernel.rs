//! The kernel's own parser accepts every rendered ruleset: each scenario is loaded with
//! `iptables-restore --test` and then applied for real (with its jump rules) inside a network
//! namespace that the test creates and always removes; `iptables-save` must then show every
//! chain we declared. Nothing touches the machine's root namespace.

mod common;

use common::netns::{fresh_netns, in_fresh_netns};
use common::*;
use kube_proxy::lab::netns::Netns;

/// Runs `cmd args` inside the namespace with `stdin`, returning (success, stdout+stderr).
fn run(ns: &Netns, cmd: &str, args: &[&str], stdin: &str) -> (bool, String) {
    ns.exec_with_input(cmd, args, stdin).expect("ip netns exec runs")
}

fn jump_commands(rendered: &str, ipv6: bool) -> Vec<Vec<String>> {
    // The annotated header lists the jump rules as `#   -t TABLE -I CHAIN ARGS`, per family block.
    let mut in_block = false;
    let mut out = Vec::new();
    for line in rendered.lines() {
        if line.starts_with("# ip6tables-restore") {
            in_block = ipv6;
        } else if line.starts_with("# iptables-restore") {
            in_block = !ipv6;
        } else if in_block && let Some(cmd) = line.strip_prefix("#   ") {
            out.push(split_quoted(cmd));
        }
    }
    out
}

fn split_quoted(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn check_accepted(label: &str, rendered: &str) {
    let inputs = restore_inputs(rendered);
    assert!(!inputs.is_empty(), "{label}: no ruleset rendered");
    for (ipv6, restore) in inputs {
        let (restore_cmd, save_cmd, iptables) = if ipv6 {
            ("ip6tables-restore", "ip6tables-save", "ip6tables")
        } else {
            ("iptables-restore", "iptables-save", "iptables")
        };
        let ns = fresh_netns("kp-kernel");
        let (ok, out) = run(&ns, restore_cmd, &["--test", "--noflush", "--counters"], &restore);
        assert!(
            ok,
            "{label} ({restore_cmd} --test) rejected the ruleset: {out}\n{restore}"
        );
        // Apply for real: the jump rules first need their chains, as a full sync ensures them.
        let (ok, out) = run(&ns, restore_cmd, &["--noflush", "--counters"], &restore);
        assert!(ok, "{label} ({restore_cmd}) failed: {out}");
        for mut cmd in jump_commands(rendered, ipv6) {
            let table = cmd[1].clone();
            let target = cmd.last().cloned().unwrap_or_default();
            // KUBE-FIREWALL may not be in the restore input; a full sync creates it empty.
            let _ = run(&ns, iptables, &["-t", &table, "-N", &target], "");
            cmd.insert(0, "-w".into());
            let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
            let (ok, out) = run(&ns, iptables, &args, "");
            assert!(ok, "{label}: {iptables} {} failed: {out}", args.join(" "));
        }
        let (ok, saved) = run(&ns, save_cmd, &[], "");
        assert!(ok, "{label}: {save_cmd} failed: {saved}");
        for line in restore.lines().filter(|l| l.starts_with(':')) {
            let chain = line[1..].split_whitespace().next().unwrap_or("");
            assert!(
                saved.contains(&format!(":{chain} ")),
                "{label}: chain {chain} missing after restore:\n{saved}"
            );
        }
        let rules_in = restore.lines().filter(|l| l.starts_with("-A ")).count();
        let kube_rules_saved = saved.lines().filter(|l| l.starts_with("-A KUBE-")).count();
        assert_eq!(
            kube_rules_saved, rules_in,
            "{label}: every rule is in the kernel:\n{saved}"
        );
        assert!(
            saved.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"),
            "{label}: jump rules applied:\n{saved}"
        );
        netlink_save_is_what_the_tool_saves(&ns, label, ipv6);
    }
}

/// Every rule line of `saved`, grouped by chain, in order within each chain.
fn rules_by_chain(saved: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for line in saved.lines() {
        let rest = line.split_once("] ").map_or(line, |(_, r)| r);
        if let Some(chain) = rest.strip_prefix("-A ").and_then(|r| r.split_whitespace().next()) {
            out.entry(chain.to_string()).or_default().push(line.to_string());
        }
    }
    out
}

/// `explain --all`'s read of the tables over nf_tables netlink prints every rule as
/// `iptables-save -c` prints it, chain for chain.
fn netlink_save_is_what_the_tool_saves(ns: &Netns, label: &str, ipv6: bool) {
    use kube_proxy::iptables::netlink_save::NetlinkSave;
    use kube_proxy::model::IpFamily;
    let (family, save_cmd) = if ipv6 {
        (IpFamily::V6, "ip6tables-save")
    } else {
        (IpFamily::V4, "iptables-save")
    };
    // The canary nothing jumps to, and a stale endpoint chain nothing jumps to any more.
    let iptables = if ipv6 { "ip6tables" } else { "iptables" };
    for args in [
        &["-t", "nat", "-N", "KUBE-PROXY-CANARY"][..],
        &["-t", "nat", "-N", "KUBE-SEP-STALE"],
        &["-t", "nat", "-A", "KUBE-SEP-STALE", "-j", "RETURN"],
    ] {
        let (ok, out) = run(ns, iptables, args, "");
        assert!(ok || out.contains("exists"), "{label}: {iptables} {args:?}: {out}");
    }
    for table in ["filter", "nat"] {
        let (ok, tool) = run(ns, save_cmd, &["-c", "-t", table], "");
        assert!(ok, "{label}: {save_cmd}: {tool}");
        let ours = common::netns::in_netns(ns.name(), || {
            let mut reader = NetlinkSave::new(family).expect("a netfilter socket");
            reader.save(table)
        });
        let ours = match ours {
            Ok(Some(text)) => text,
            other => panic!("{label}: {table} over netlink: {other:?}"),
        };
        let (want, got) = (rules_by_chain(&tool), rules_by_chain(&ours));
        for (chain, lines) in &want {
            assert_eq!(
                got.get(chain),
                Some(lines),
                "{label}: {table} {chain} over netlink:\n{ours}"
            );
        }
        assert_eq!(got.len(), want.len(), "{label}: {table}: the same chains:\n{ours}");
        if table == "nat" {
            assert!(
                got.contains_key("KUBE-SEP-STALE"),
                "{label}: the stale chain is read:\n{ours}"
            );
        }
    }
}

fn kernel_accepts_every_scenario() {
    for (name, path, flags) in scenarios() {
        let rendered = render(&path, &flags);
        check_accepted(&name, &rendered);
    }
}

fn kernel_accepts_every_config_variant() {
    let variants: &[&[&str]] = &[
        &[
            "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--masquerade-all",
            "--iptables-masquerade-bit=31",
        ],
        &[
            "--hostname-override=node-a", "--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cni0",
        ],
        &[
            "--hostname-override=node-a",
            "--detect-local-mode=InterfaceNamePrefix",
            "--pod-interface-name-prefix=veth",
        ],
        &[
            "--hostname-override=node-a",
            "--detect-local-mode=NodeCIDR",
            "--nodeport-addresses=192.168.49.0/24,127.0.0.0/8",
        ],
        &["--config=examples/kube-proxy-config.yaml"],
    ];
    for flags in variants {
        let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        let rendered = render(std::path::Path::new("examples/web"), &flags);
        check_accepted(&flags.join(" "), &rendered);
    }
}

/// The rules of KUBE-SERVICES and KUBE-NODEPORTS as `iptables-save` lists them, each chain's
/// sorted but for the NodePort rule, which must be the last of KUBE-SERVICES (checked): partial
/// syncs insert at the top, and no other order is visible to a packet (each of those rules
/// matches its own protocol, address and port).
fn fixed_chains(saved: &str) -> Vec<String> {
    let mut out = Vec::new();
    for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS"] {
        let prefix = format!("-A {chain} ");
        let mut rules: Vec<String> = saved
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .map(str::to_string)
            .collect();
        let tail = rules.iter().position(|r| r.ends_with("-j KUBE-NODEPORTS"));
        let tail = tail.map(|i| {
            assert_eq!(i, rules.len() - 1, "the NodePort rule is the last:\n{saved}");
            rules.remove(i)
        });
        rules.sort();
        out.extend(rules);
        out.extend(tail);
    }
    out
}

/// Partial syncs edit KUBE-SERVICES in place (`-D`/`-I`) when a Service gains or loses its
/// last endpoint or comes and goes: the kernel accepts the edits, and after each sync the
/// chains hold what a full render of the same state gives in a fresh namespace (the same
/// rules, the NodePort rule last).
fn partial_syncs_edit_kube_services_in_place_as_a_full_render_would_write_it() {
    use kube_proxy::iptables::backend::Backend;
    use kube_proxy::iptables::exec::{Exec, Iptables};
    use kube_proxy::iptables::proxier::IptablesProxier;
    use kube_proxy::iptables::{IptablesRenderOptions, render};
    use kube_proxy::model::testing::{port, state};
    use kube_proxy::model::{IpFamily, Protocol};
    let steps: [&[(u8, &[u8])]; 6] = [
        &[(1, &[1]), (2, &[2, 3]), (3, &[])],
        &[(1, &[]), (2, &[2, 3]), (3, &[])],
        &[(1, &[1]), (2, &[2, 3]), (3, &[4])],
        &[(1, &[1]), (3, &[4]), (4, &[5])],
        &[(1, &[1]), (2, &[2]), (3, &[]), (4, &[5])],
        &[(2, &[2])],
    ];
    let opts = IptablesRenderOptions::default();
    let states: Vec<_> = steps
        .iter()
        .map(|step| {
            let ports = step
                .iter()
                .map(|(i, eps)| port("ns", &format!("s{i}"), *i, Protocol::Tcp, eps))
                .collect();
            state(ports, &[])
        })
        .collect();
    let incremental: Vec<Vec<String>> = in_fresh_netns(|| {
        std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip");
        let mut p = IptablesProxier::new(Exec::new(Backend::Plain, IpFamily::V4), opts.clone());
        states
            .iter()
            .map(|st| {
                let r = p.sync(st).unwrap_or_else(|e| panic!("sync: {e}"));
                let saved = p.iptables().save("nat").expect("iptables-save");
                assert!(r.full || !saved.is_empty());
                fixed_chains(&saved)
            })
            .collect()
    });
    for (i, st) in states.iter().enumerate() {
        let fresh = in_fresh_netns(|| {
            let mut ipt = Exec::new(Backend::Plain, IpFamily::V4);
            ipt.restore(&render(st, &opts).restore).expect("full render applies");
            fixed_chains(&ipt.save("nat").expect("iptables-save"))
        });
        assert_eq!(incremental[i], fresh, "after step {i}");
    }
}

/// IPVS mode's node addresses, read over rtnetlink, are what `ip -o addr show` lists, link by
/// link: both families, a link's own addresses only, thousands of them (a dump of many
/// datagrams), and no link at all for one that does not exist.
fn node_addresses_over_rtnetlink_are_what_ip_lists() {
    use kube_proxy::ipvs::host::{HostExec, IpvsHost, parse_ip_addr};
    use std::net::IpAddr;
    let ns = fresh_netns("kp-rtnl");
    // The host's kernel may have no dummy links: a veth pair stands in for kube-ipvs0 and eth0.
    ns.ip(["link", "add", "kube-ipvs0", "type", "veth", "peer", "name", "eth0"])
        .expect("a veth pair");
    let mut batch = String::from("addr add 192.168.0.2/24 dev eth0\naddr add 2001:db8::2/64 dev eth0 nodad\n");
    for i in 0..3000u32 {
        batch.push_str(&format!(
            "addr add 10.96.{}.{}/32 dev kube-ipvs0\n",
            i / 250,
            1 + i % 250
        ));
    }
    batch.push_str("addr add fd00::10/128 dev kube-ipvs0 nodad\n");
    let (ok, out) = run(&ns, "ip", &["-batch", "-"], &batch);
    assert!(ok, "ip -batch: {out}");
    for link in ["lo", "eth0"] {
        ns.link_up(link).expect("link up");
    }
    let listed = parse_ip_addr(&ns.exec_ok("ip", ["-o", "addr", "show"]).expect("ip -o addr show"));
    let of = |want: &dyn Fn(&str) -> bool| -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = listed.iter().filter(|(l, _)| want(l)).map(|(_, a)| *a).collect();
        v.sort();
        v
    };
    let sorted = |mut v: Vec<IpAddr>| {
        v.sort();
        v
    };
    let (on_dummy, others, missing) = common::netns::in_netns(ns.name(), || {
        let mut host = HostExec;
        (
            host.addresses("kube-ipvs0").expect("addresses"),
            host.other_addresses("kube-ipvs0").expect("other addresses"),
            host.addresses("no-such-link").expect("addresses of no link"),
        )
    });
    assert_eq!(on_dummy.len(), 3001, "every address of kube-ipvs0");
    assert_eq!(sorted(on_dummy), of(&|l| l == "kube-ipvs0"));
    let others = sorted(others);
    assert_eq!(others, of(&|l| l != "kube-ipvs0"));
    for a in ["127.0.0.1", "192.168.0.2", "2001:db8::2"] {
        assert!(others.contains(&a.parse().expect("ip")), "{a} in {others:?}");
    }
    assert!(missing.is_empty(), "{missing:?}");
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("iptables-restore"), Tool("ip6tables-restore")]
        => kernel_accepts_every_scenario, kernel_accepts_every_config_variant,
           partial_syncs_edit_kube_services_in_place_as_a_full_render_would_write_it;
    &[Root, Tool("ip")] => node_addresses_over_rtnetlink_are_what_ip_lists;
}
