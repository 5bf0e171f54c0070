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

/// The proxy modes `trace` is checked in.
const MODES: [&str; 3] = ["iptables", "nftables", "ipvs"];

/// Runs `kube-proxy trace --output=json` for one case in `mode`; `flags` replace the
/// scenario's own.
fn trace(scenario: &str, flags: &[String], extra: &[String], mode: &str) -> Value {
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
    // --config replaces every other flag, --proxy-mode included.
    assert!(
        !args.iter().any(|a| a.starts_with("--config")),
        "trace cases set the mode by flag: {args:?}"
    );
    args.push(format!("--proxy-mode={mode}"));
    args.push(path.display().to_string());
    args.extend(extra.iter().cloned());
    args.push("--output=json".into());
    let out = kube_proxy(&args);
    assert_eq!(out.status, 0, "trace {}: {}", args.join(" "), out.stderr);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("trace output is JSON ({e}): {}", out.stdout))
}

/// What a case of tests/traces.txt expects: verdict, endpoints (sorted as strings), masquerade.
#[derive(Debug, PartialEq)]
struct Expect {
    verdict: String,
    endpoints: Vec<String>,
    masquerade: bool,
}

impl Expect {
    fn new(verdict: &str, endpoints: &str, masq: &str) -> Expect {
        assert!(
            masq == "masq" || masq == "nomasq",
            "masquerade is masq or nomasq, not {masq:?}"
        );
        Expect {
            verdict: verdict.to_string(),
            endpoints: if endpoints == "-" {
                vec![]
            } else {
                endpoints.split(',').map(str::to_string).collect()
            },
            masquerade: masq == "masq",
        }
    }

    fn of(got: &Value) -> Expect {
        Expect {
            verdict: got["verdict"].as_str().unwrap_or_default().to_string(),
            endpoints: got["endpoints"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
                .unwrap_or_default(),
            masquerade: got["masquerade"] == true,
        }
    }
}

/// Every case of tests/traces.txt, in every proxy mode; all failures are reported together.
#[test]
fn trace_expectations() {
    let table = std::fs::read_to_string(root().join("tests/traces.txt")).expect("tests/traces.txt");
    let mut failures = Vec::new();
    let mut cases = 0;
    // Per mode (index into MODES), the cases marked as differing from iptables mode.
    let mut differences = [0usize; MODES.len()];
    for (n, line) in table.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(f.len() >= 7, "tests/traces.txt:{}: needs 7 fields: {line}", n + 1);
        let (scenario, from, to, proto) = (f[0], f[1], f[2], f[3]);
        // The expectation of each mode: iptables mode's unless a marker says otherwise.
        let mut wants: Vec<Expect> = MODES.iter().map(|_| Expect::new(f[4], f[5], f[6])).collect();
        let mut in_iface = Vec::new();
        let mut flags = Vec::new();
        for field in &f[7..] {
            let marker = [("nft=", 1), ("ipvs=", 2)]
                .into_iter()
                .find_map(|(prefix, mode)| field.strip_prefix(prefix).map(|want| (prefix, mode, want)));
            if let Some((prefix, mode, want)) = marker {
                let parts: Vec<&str> = want.split('/').collect();
                assert!(
                    parts.len() == 3,
                    "tests/traces.txt:{}: {prefix}VERDICT/ENDPOINTS/MASQ, not {field}",
                    n + 1
                );
                let expect = Expect::new(parts[0], parts[1], parts[2]);
                assert_ne!(
                    expect,
                    wants[0],
                    "tests/traces.txt:{}: a {prefix} marker that repeats the expectation",
                    n + 1
                );
                wants[mode] = expect;
                differences[mode] += 1;
            } else if field.starts_with("--in-interface") {
                in_iface.push(field.to_string());
            } else {
                flags.push(field.to_string());
            }
        }
        let mut extra = vec![
            format!("--from={from}"),
            format!("--to={to}"),
            format!("--protocol={proto}"),
        ];
        extra.extend(in_iface);
        for (mode, want) in MODES.iter().zip(&wants) {
            let got = Expect::of(&trace(scenario, &flags, &extra, mode));
            if &got != want {
                failures.push(format!(
                    "tests/traces.txt:{} ({mode}): {line}\n  got verdict {} endpoints {:?} masquerade {}",
                    n + 1,
                    got.verdict,
                    got.endpoints,
                    got.masquerade
                ));
            }
        }
        cases += 1;
    }
    assert!(cases >= 50, "the table has its cases ({cases})");
    // The differences are the documented exceptions, not the rule (IPVS mode, the furthest
    // from iptables mode, differs in about a fifth of the cases).
    for (mode, d) in MODES.iter().zip(differences) {
        assert!(d * 4 < cases, "{d} of {cases} cases differ in {mode} mode");
    }
    assert!(
        failures.is_empty(),
        "{} of {} trace checks failed:\n{}",
        failures.len(),
        cases * MODES.len(),
        failures.join("\n")
    );
}

#[test]
fn trace_hairpin_masquerades_the_path_to_itself() {
    // 10.244.1.5 is an endpoint on this node (IPVS mode's KUBE-LOOP-BACK holds only those).
    for mode in MODES {
        let got = trace(
            "web",
            &[],
            &["--from=10.244.1.5".into(), "--to=10.96.165.10:80".into()],
            mode,
        );
        assert_eq!(got["verdict"], "DNAT", "{mode}");
        let paths = got["paths"].as_array().expect("paths");
        let to_self = paths
            .iter()
            .find(|p| p["endpoint"] == "10.244.1.5:8080")
            .expect("path to itself");
        assert_eq!(to_self["masquerade"], true, "{mode}: {got:#}");
        let other = paths
            .iter()
            .find(|p| p["endpoint"] == "10.244.2.7:8080")
            .expect("path to another endpoint");
        assert_eq!(other["masquerade"], false, "{mode}: {got:#}");
    }
}

#[test]
fn trace_session_affinity_reaches_every_endpoint_through_recent() {
    // The affinity check of each mode: `recent` in iptables, a timeout set in nftables, a
    // persistent virtual server in IPVS.
    for (mode, check) in MODES.iter().zip([
        "--rcheck --seconds 600 --reap",
        "ip saddr @affinity-",
        "TCP  10.96.40.1:80 rr persistent 600 -> ",
    ]) {
        let got = trace(
            "session-affinity",
            &[],
            &["--from=10.244.2.5".into(), "--to=10.96.40.1:80".into()],
            mode,
        );
        assert_eq!(got["verdict"], "DNAT", "{mode}");
        assert_eq!(
            got["endpoints"],
            serde_json::json!(["10.244.2.40:8080", "10.244.3.40:8080"]),
            "{mode}"
        );
        assert!(got["rules"].to_string().contains(check), "{mode}: {got:#}");
    }
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
    let out = kube_proxy(&[
        "trace",
        "--proxy-mode=nftables",
        "--hostname-override=node-a",
        "--cluster-cidr=10.244.0.0/16",
        &path.display().to_string(),
        "--from=192.168.49.77",
        "--to=10.96.165.10:80",
    ]);
    assert_eq!(out.status, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("path 1/3: filter-prerouting-pre-dnat -> nat-prerouting -> filter-forward -> nat-postrouting")
            && out
                .stdout
                .contains("  ip kube-proxy/services: ip daddr . meta l4proto . th dport vmap @service-ips")
            && out.stdout.contains("  => DNAT to 10.244.1.5:8080, masqueraded"),
        "{}",
        out.stdout
    );
    let out = kube_proxy(&[
        "trace",
        "--proxy-mode=ipvs",
        "--hostname-override=node-a",
        "--cluster-cidr=10.244.0.0/16",
        &path.display().to_string(),
        "--from=192.168.49.77",
        "--to=10.96.165.10:80",
    ]);
    assert_eq!(out.status, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("path 1/3: nat/PREROUTING -> filter/INPUT -> ipvs/LOCAL_IN -> filter/OUTPUT -> nat/POSTROUTING")
            && out.stdout.contains(
                "  nat/KUBE-SERVICES: -A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"
            )
            && out.stdout.contains("  ipvs/LOCAL_IN: TCP  10.96.165.10:80 rr -> 10.244.1.5:8080 Masq 1")
            && out.stdout.contains("  => DNAT to 10.244.1.5:8080, masqueraded"),
        "{}",
        out.stdout
    );
}

/// The mode comes from --proxy-mode or the configuration file, as for `render`.
#[test]
fn trace_mode_follows_the_configuration() {
    let dir = std::env::temp_dir().join(format!("kp-trace-mode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.yaml");
    std::fs::write(
        &cfg,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n\
         hostnameOverride: node-a\nclusterCIDR: 10.244.0.0/16\n",
    )
    .unwrap();
    let out = kube_proxy(&[
        "trace",
        &format!("--config={}", cfg.display()),
        "examples/web",
        "--from=10.244.2.30",
        "--to=10.96.165.10:80",
        "--output=json",
    ]);
    let ipvs_cfg = dir.join("ipvs.yaml");
    std::fs::write(
        &ipvs_cfg,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n\
         hostnameOverride: node-a\nclusterCIDR: 10.244.0.0/16\n",
    )
    .unwrap();
    let ipvs = kube_proxy(&[
        "trace",
        &format!("--config={}", ipvs_cfg.display()),
        "examples/web",
        "--from=10.244.2.30",
        "--to=10.96.165.10:80",
        "--output=json",
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out.status, 0, "{}", out.stderr);
    let got: Value = serde_json::from_str(&out.stdout).expect("JSON");
    assert_eq!(got["rules"][0]["table"], "ip kube-proxy", "{got:#}");
    assert_eq!(got["verdict"], "DNAT");
    assert_eq!(ipvs.status, 0, "{}", ipvs.stderr);
    let got: Value = serde_json::from_str(&ipvs.stdout).expect("JSON");
    assert_eq!(got["verdict"], "DNAT");
    assert_eq!(got["paths"][0]["hooks"][2], "ipvs/LOCAL_IN", "{got:#}");
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
