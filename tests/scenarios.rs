//! Scenario tests: checked-in manifests → the rendered rules (insta snapshots, reviewed by
//! hand against upstream's rule shapes) and `trace` expectations for the behaviour that
//! matters to an operator.

mod common;

use common::*;
use std::path::PathBuf;

use serde_json::Value;

/// Flag variants of the README example that exercise configuration-dependent rules.
fn web_variants() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("web-config-file", vec!["--config=examples/kube-proxy-config.yaml"]),
        ("web-no-detector", vec!["--hostname-override=node-a"]),
        (
            "web-node-cidr",
            vec!["--hostname-override=node-a", "--detect-local-mode=NodeCIDR"],
        ),
        (
            "web-bridge",
            vec![
                "--hostname-override=node-a", "--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cni0",
            ],
        ),
        (
            "web-iface-prefix",
            vec![
                "--hostname-override=node-a",
                "--detect-local-mode=InterfaceNamePrefix",
                "--pod-interface-name-prefix=veth",
            ],
        ),
        (
            "web-masquerade-all",
            vec![
                "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--masquerade-all",
                "--iptables-masquerade-bit=5",
            ],
        ),
        (
            "web-nodeport-addresses",
            vec![
                "--hostname-override=node-a",
                "--cluster-cidr=10.244.0.0/16",
                "--nodeport-addresses=192.168.49.0/24,127.0.0.0/8",
            ],
        ),
        (
            "web-nodeport-primary",
            vec![
                "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--nodeport-addresses=primary",
            ],
        ),
        (
            "web-no-localhost-nodeports",
            vec![
                "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--iptables-localhost-nodeports=false",
            ],
        ),
    ]
}

#[test]
fn scenario_snapshots() {
    for (name, path, flags) in scenarios() {
        let out = kube_proxy(
            &[
                vec!["render".to_string()],
                flags.clone(),
                vec![path.display().to_string()],
            ]
            .concat(),
        );
        assert_eq!(out.status, 0, "{name}: {}", out.stderr);
        insta::assert_snapshot!(format!("render-{name}"), out.stdout);
        insta::assert_snapshot!(format!("warnings-{name}"), out.stderr);
    }
}

#[test]
fn web_variant_snapshots() {
    for (name, flags) in web_variants() {
        let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        let out = render(&std::path::PathBuf::from("examples/web"), &flags);
        insta::assert_snapshot!(format!("render-{name}"), out);
    }
}

const WEB: &[&str] = &["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16"];

/// Runs `kube-proxy trace --output=json` for one case; `flags` replace the scenario's own.
fn trace(scenario: &str, flags: &[String], extra: &[String]) -> Value {
    let path = if scenario == "web" {
        PathBuf::from("examples/web")
    } else {
        PathBuf::from(format!("tests/scenarios/{scenario}.yaml"))
    };
    let mut args: Vec<String> = vec!["trace".into()];
    if !flags.is_empty() {
        args.extend(flags.iter().cloned());
    } else if scenario == "web" {
        args.extend(WEB.iter().map(|s| s.to_string()));
    } else {
        args.extend(flags_of(&root().join(&path)));
    }
    args.push(path.display().to_string());
    args.extend(extra.iter().cloned());
    args.push("--output=json".into());
    let out = kube_proxy(&args);
    assert_eq!(out.status, 0, "trace {}: {}", args.join(" "), out.stderr);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("trace output is JSON ({e}): {}", out.stdout))
}

/// Every case of tests/traces.txt; all failures are reported together.
#[test]
fn trace_expectations() {
    let table = std::fs::read_to_string(root().join("tests/traces.txt")).expect("tests/traces.txt");
    let mut failures = Vec::new();
    let mut cases = 0;
    for (n, line) in table.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(f.len() >= 7, "tests/traces.txt:{}: needs 7 fields: {line}", n + 1);
        let (scenario, from, to, proto, verdict, eps, masq) = (f[0], f[1], f[2], f[3], f[4], f[5], f[6]);
        let (in_iface, flags): (Vec<String>, Vec<String>) = f[7..]
            .iter()
            .map(|s| s.to_string())
            .partition(|s| s.starts_with("--in-interface"));
        let mut extra = vec![
            format!("--from={from}"),
            format!("--to={to}"),
            format!("--protocol={proto}"),
        ];
        extra.extend(in_iface);
        let got = trace(scenario, &flags, &extra);
        let want_eps: Vec<&str> = if eps == "-" { vec![] } else { eps.split(',').collect() };
        let got_eps: Vec<&str> = got["endpoints"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let ok = got["verdict"] == verdict && got_eps == want_eps && got["masquerade"] == (masq == "masq");
        if !ok {
            failures.push(format!(
                "tests/traces.txt:{}: {line}\n  got verdict {} endpoints {:?} masquerade {}",
                n + 1,
                got["verdict"],
                got_eps,
                got["masquerade"]
            ));
        }
        cases += 1;
    }
    assert!(cases >= 50, "the table has its cases ({cases})");
    assert!(
        failures.is_empty(),
        "{} of {cases} trace cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn trace_hairpin_masquerades_the_path_to_itself() {
    let got = trace("web", &[], &["--from=10.244.2.7".into(), "--to=10.96.165.10:80".into()]);
    assert_eq!(got["verdict"], "DNAT");
    let paths = got["paths"].as_array().expect("paths");
    let to_self = paths
        .iter()
        .find(|p| p["endpoint"] == "10.244.2.7:8080")
        .expect("path to itself");
    assert_eq!(to_self["masquerade"], true, "{got:#}");
    let other = paths
        .iter()
        .find(|p| p["endpoint"] == "10.244.1.5:8080")
        .expect("path to another endpoint");
    assert_eq!(other["masquerade"], false, "{got:#}");
}

#[test]
fn trace_session_affinity_reaches_every_endpoint_through_recent() {
    let got = trace(
        "session-affinity",
        &[],
        &["--from=10.244.2.5".into(), "--to=10.96.40.1:80".into()],
    );
    assert_eq!(got["verdict"], "DNAT");
    assert_eq!(
        got["endpoints"],
        serde_json::json!(["10.244.2.40:8080", "10.244.3.40:8080"])
    );
    assert!(
        got["rules"].to_string().contains("--rcheck --seconds 600 --reap"),
        "{got:#}"
    );
}

#[test]
fn trace_text_output_lists_matched_rules() {
    let path = std::path::PathBuf::from("examples/web");
    let out = kube_proxy(&[
        "trace",
        "--hostname-override=node-a",
        "--cluster-cidr=10.244.0.0/16",
        &path.display().to_string(),
        "--from=192.168.49.77",
        "--to=10.96.165.10:80",
    ]);
    assert_eq!(out.status, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("KUBE-SERVICES")
            && out.stdout.contains("KUBE-SVC-CDGGSHYLG3RE2FKL")
            && out.stdout.contains("DNAT"),
        "{}",
        out.stdout
    );
}

#[test]
fn cli_errors_name_the_problem() {
    let path = std::path::PathBuf::from("examples/web").display().to_string();
    let out = kube_proxy(&["render", "--iptables-masquerade-bit=99", &path]);
    assert_ne!(out.status, 0);
    assert!(
        out.stderr.contains("--iptables-masquerade-bit") && out.stderr.contains("99"),
        "{}",
        out.stderr
    );
    let dir = std::env::temp_dir().join(format!("kp-bad-yaml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("broken.yaml");
    std::fs::write(&f, "apiVersion: v1\nkind: Service\nmetadata: {name: x\n").unwrap();
    let out = kube_proxy(&["render", &f.display().to_string()]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("broken.yaml:"), "{}", out.stderr);
}

#[test]
fn flag_names_accept_underscores() {
    let path = std::path::PathBuf::from("examples/web").display().to_string();
    let a = render(
        std::path::Path::new(&path),
        &[
            "--hostname-override=node-a".into(),
            "--cluster_cidr=10.244.0.0/16".into(),
        ],
    );
    let b = render(
        std::path::Path::new(&path),
        &[
            "--hostname-override=node-a".into(),
            "--cluster-cidr=10.244.0.0/16".into(),
        ],
    );
    assert_eq!(a, b);
    assert!(a.contains("! -s 10.244.0.0/16"));
}
