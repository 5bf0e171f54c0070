//! IPVS-mode renderer over the checked-in scenarios: one insta snapshot per scenario and family
//! (`ipvs-<scenario>-<family>`: the virtual servers as `ipvsadm -Ln` lists them, the ipsets,
//! the iptables rules), the `render --proxy-mode=ipvs` command, and kernel acceptance: in a
//! throw-away network namespace (never the root namespace) every `ipset restore` input is
//! applied and read back, and every iptables-restore input is checked by the real
//! `iptables-restore` against those sets and then applied (the `-m ipvs` match of
//! KUBE-IPVS-OUT-FILTER needs the kernel's xt_ipvs, which only a kernel with IPVS has: rulesets
//! using it are checked with `--test` only).

mod common;

use std::collections::BTreeSet;

use common::netns::fresh_netns;
use common::{family_name, numbered};
use kube_proxy::config::{Flags, ProxyConfig};
use kube_proxy::ipvs::render::{IpvsRenderOptions, IpvsRuleset, render};
use kube_proxy::model::{IpFamily, ProxyState};

/// The scenario's flags (the only ones they use: `--hostname-override` and `--cluster-cidr`)
/// in IPVS mode, through the real configuration code.
fn config(flags: &[String]) -> ProxyConfig {
    let mut f = Flags {
        proxy_mode: Some("ipvs".into()),
        ..Flags::default()
    };
    for flag in flags {
        if let Some(v) = flag.strip_prefix("--cluster-cidr=") {
            f.cluster_cidr = Some(v.to_string());
        } else if let Some(v) = flag.strip_prefix("--hostname-override=") {
            f.hostname_override = Some(v.to_string());
        } else {
            panic!("scenario flag {flag} is not handled by this test");
        }
    }
    ProxyConfig::resolve(&f).expect("scenario flags are valid")
}

/// Every (scenario, family, state, options) to render: the families a scenario has service
/// ports in (IPv4 when it has none).
fn cases() -> Vec<(String, IpFamily, ProxyState, IpvsRenderOptions)> {
    common::scenario_states()
        .into_iter()
        .map(|s| {
            let opts = IpvsRenderOptions::from_config(&config(&s.flags), s.state.family, &s.node);
            (s.name, s.state.family, s.state, opts)
        })
        .collect()
}

fn ipvs_scenario_snapshots() {
    for (name, family, state, opts) in cases() {
        let rs = render(&state, &opts);
        insta::assert_snapshot!(format!("ipvs-{name}-{}", family_name(family)), rs.to_text());
    }
}

fn ipvs_render_is_deterministic() {
    for (name, _, state, opts) in cases() {
        assert_eq!(
            render(&state, &opts).to_text(),
            render(&state, &opts).to_text(),
            "{name}"
        );
    }
}

/// Invariants that hold for every scenario, whatever its services.
fn ipvs_every_virtual_server_has_its_set_entry_and_address() {
    for (name, family, state, opts) in cases() {
        let rs = render(&state, &opts);
        let ctx = format!("{name} {}", family_name(family));
        let ipvs_ips: BTreeSet<&str> = rs
            .ipset(kube_proxy::ipvs::names::SetId::IpvsIps)
            .map(|s| s.entries.iter().map(String::as_str).collect())
            .unwrap_or_default();
        let bound: BTreeSet<String> = rs.bound_addresses.iter().map(ToString::to_string).collect();
        assert_eq!(
            ipvs_ips,
            bound.iter().map(String::as_str).collect(),
            "{ctx}: KUBE-IPVS-IPS must hold exactly the kube-ipvs0 addresses"
        );
        for sp in &state.service_ports {
            assert!(
                rs.bound_addresses.contains(&sp.port.cluster_ip),
                "{ctx}: ClusterIP {} not bound",
                sp.port.cluster_ip
            );
            assert!(
                rs.virtual_server(sp.port.protocol, sp.port.cluster_ip, sp.port.port)
                    .is_some(),
                "{ctx}: no virtual server for {}",
                sp.port.name
            );
        }
        for vs in &rs.virtual_servers {
            assert!(family.contains(&vs.address), "{ctx}: {vs:?}");
            assert!(
                vs.destinations
                    .iter()
                    .all(|d| family.contains(&d.address) && d.weight == 1)
            );
        }
    }
}

fn render_command_in_ipvs_mode() {
    let (_, path, flags) = common::scenarios()
        .into_iter()
        .find(|(n, _, _)| n == "dual-stack")
        .expect("dual-stack scenario");
    let mut args: Vec<String> = vec![
        "render".into(),
        "--proxy-mode=ipvs".into(),
        "--ipvs-scheduler=mh".into(),
    ];
    args.extend(flags);
    args.push(path.display().to_string());
    let out = common::kube_proxy(&args);
    assert_eq!(out.status, 0, "{}", out.stderr);
    assert!(out.stdout.starts_with("# IPVS proxy mode (IPv4)\n"), "{}", out.stdout);
    assert!(out.stdout.contains("\n# IPVS proxy mode (IPv6)\n"), "{}", out.stdout);
    assert!(out.stdout.contains(" mh (mh-port)"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("create KUBE-6-CLUSTER-IP hash:ip,port family inet6")
    );
    assert!(
        out.stdout
            .contains("# ip6tables-restore --noflush --counters input (IPv6)\n")
    );
}

/// `ipset save`'s `add` lines, as a set, with ipset's canonical spelling of host-sized nets
/// (it prints `1.2.3.4,tcp:80,10.0.0.1` for a `/32` net) applied to ours too.
fn add_lines(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| l.starts_with("add "))
        .map(|l| l.trim_end_matches("/32").trim_end_matches("/128").to_string())
        .collect()
}

/// The `create` lines without the parameters the kernel adds (`bucketsize`, `initval`).
fn create_lines(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| l.starts_with("create "))
        .map(|l| l.split(" bucketsize ").next().unwrap_or(l).to_string())
        .collect()
}

fn apply_in_netns(ctx: &str, family: IpFamily, rs: &IpvsRuleset) {
    let ns = fresh_netns("kp-ipvs-test");
    let ipsets = rs.ipset_restore();
    let (ok, msg) = ns.exec_with_input("ipset", ["restore"], &ipsets).expect("ipset runs");
    assert!(
        ok,
        "{ctx}: ipset restore rejected the input:\n{msg}\n{}",
        numbered(&ipsets)
    );
    // A later sync re-applies it over existing sets.
    let (ok, msg) = ns
        .exec_with_input("ipset", ["restore", "-exist"], &ipsets)
        .expect("ipset runs");
    assert!(ok, "{ctx}: ipset restore -exist failed on existing sets:\n{msg}");
    let saved = ns.exec_ok("ipset", ["save"]).expect("ipset save");
    assert_eq!(
        create_lines(&saved),
        create_lines(&ipsets),
        "{ctx}: sets as the kernel holds them"
    );
    assert_eq!(
        add_lines(&saved),
        add_lines(&ipsets),
        "{ctx}: entries as the kernel holds them"
    );

    let (restore_bin, tables_bin, save_bin) = match family {
        IpFamily::V4 => ("iptables-restore", "iptables", "iptables-save"),
        IpFamily::V6 => ("ip6tables-restore", "ip6tables", "ip6tables-save"),
    };
    let (ok, msg) = ns
        .exec_with_input(restore_bin, ["--test", "--noflush", "--counters"], &rs.restore)
        .expect("iptables-restore runs");
    assert!(
        ok,
        "{ctx}: {restore_bin} --test rejected the input:\n{msg}\n{}",
        numbered(&rs.restore)
    );
    if rs.restore.contains(" -m ipvs ") && !std::path::Path::new("/proc/net/ip_vs").exists() {
        // xt_ipvs exists only with IPVS; the VM tests apply these on a kernel that has it.
        return;
    }
    let (ok, msg) = ns
        .exec_with_input(restore_bin, ["--noflush", "--counters"], &rs.restore)
        .expect("iptables-restore runs");
    assert!(ok, "{ctx}: {restore_bin} failed:\n{msg}\n{}", numbered(&rs.restore));
    for j in &rs.jumps {
        let mut args: Vec<String> = vec!["-t".into(), j.table.into(), "-I".into(), j.chain.into()];
        args.extend(j.args.iter().cloned());
        ns.exec_ok(tables_bin, &args)
            .unwrap_or_else(|e| panic!("{ctx}: {tables_bin} {args:?}: {e:#}"));
    }
    // A second full sync over the first one applies too.
    let (ok, msg) = ns
        .exec_with_input(restore_bin, ["--noflush", "--counters"], &rs.restore)
        .expect("iptables-restore runs");
    assert!(ok, "{ctx}: re-applying failed:\n{msg}");
    let saved = ns.exec_ok(save_bin, Vec::<String>::new()).expect("iptables-save");
    for chain in ["KUBE-IPVS-FILTER", "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-LOAD-BALANCER"] {
        assert!(
            saved.contains(&format!(":{chain} ")),
            "{ctx}: {chain} missing:\n{saved}"
        );
    }
    assert!(
        saved.contains("-A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER"),
        "{ctx}:\n{saved}"
    );
}

fn ipvs_kernel_accepts_every_ruleset() {
    for (name, family, state, opts) in cases() {
        let rs = render(&state, &opts);
        apply_in_netns(&format!("{name} {}", family_name(family)), family, &rs);
    }
    // Settings the scenarios do not use: masquerade-all, a bridge detector, mh, a /0 range.
    let (_, _, state, _) = cases()
        .into_iter()
        .find(|(n, f, _, _)| n == "external-and-firewall" && *f == IpFamily::V4)
        .expect("scenario");
    let mut st = state.clone();
    for sp in &mut st.service_ports {
        let sp = std::sync::Arc::make_mut(sp);
        if !sp.port.load_balancer_source_ranges.is_empty() {
            sp.port
                .load_balancer_source_ranges
                .push("0.0.0.0/0".parse().expect("cidr"));
        }
    }
    for opts in [
        IpvsRenderOptions {
            common: kube_proxy::proxy::RenderOptions {
                masquerade_all: true,
                ..Default::default()
            },
            scheduler: "mh".into(),
            ..IpvsRenderOptions::default()
        },
        IpvsRenderOptions {
            common: kube_proxy::proxy::RenderOptions {
                local_detector: kube_proxy::config::LocalDetector::Bridge("cni0".into()),
                ..Default::default()
            },
            random_fully: false,
            ..IpvsRenderOptions::default()
        },
    ] {
        apply_in_netns("external-and-firewall (variant)", IpFamily::V4, &render(&st, &opts));
    }
}

common::harness::main! {
    &[] => ipvs_scenario_snapshots, ipvs_render_is_deterministic,
        ipvs_every_virtual_server_has_its_set_entry_and_address, render_command_in_ipvs_mode;
    &[Root, Tool("ip"), Tool("ipset"), Tool("iptables-restore"), Tool("ip6tables-restore")]
        => ipvs_kernel_accepts_every_ruleset;
}
