//! Scenario tests: checked-in manifests → the rendered rules (insta snapshots, reviewed by
//! hand against upstream's rule shapes) and `trace` expectations for the behaviour that
//! matters to an operator.

mod common;

use common::*;
use serde_json::Value;

/// Flag variants of the README example that exercise configuration-dependent rules.
fn web_variants() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("web-config-file", vec!["--config=examples/kube-proxy-config.yaml"]),
        ("web-no-detector", vec!["--hostname-override=node-a"]),
        ("web-node-cidr", vec!["--hostname-override=node-a", "--detect-local-mode=NodeCIDR"]),
        ("web-bridge", vec!["--hostname-override=node-a", "--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cni0"]),
        ("web-iface-prefix", vec!["--hostname-override=node-a", "--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=veth"]),
        ("web-masquerade-all", vec!["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--masquerade-all", "--iptables-masquerade-bit=5"]),
        ("web-nodeport-addresses", vec!["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--nodeport-addresses=192.168.49.0/24,127.0.0.0/8"]),
        ("web-nodeport-primary", vec!["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--nodeport-addresses=primary"]),
        ("web-no-localhost-nodeports", vec!["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--iptables-localhost-nodeports=false"]),
    ]
}

#[test]
fn scenario_snapshots() {
    for (name, path, flags) in scenarios() {
        let out = kube_proxy(&[vec!["render".to_string()], flags.clone(), vec![path.display().to_string()]].concat());
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

struct Expect {
    verdict: &'static str,
    endpoints: &'static [&'static str],
    masquerade: bool,
}

fn trace(scenario: &str, flags: &[&str], from: &str, to: &str, protocol: &str) -> Value {
    let path = if scenario == "web" {
        std::path::PathBuf::from("examples/web")
    } else {
        std::path::PathBuf::from(format!("tests/scenarios/{scenario}.yaml"))
    };
    let mut args: Vec<String> = vec!["trace".into()];
    if flags.is_empty() && scenario != "web" {
        args.extend(flags_of(&root().join(&path)));
    } else {
        args.extend(flags.iter().map(|s| s.to_string()));
    }
    args.extend([
        path.display().to_string(),
        format!("--from={from}"),
        format!("--to={to}"),
        format!("--protocol={protocol}"),
        "--output=json".into(),
    ]);
    let out = kube_proxy(&args);
    assert_eq!(out.status, 0, "trace {scenario} {from} -> {to}: {}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("trace output is JSON ({e}): {}", out.stdout))
}

fn check(scenario: &str, flags: &[&str], from: &str, to: &str, protocol: &str, want: Expect) {
    let got = trace(scenario, flags, from, to, protocol);
    let ctx = format!("{scenario}: {from} -> {to}/{protocol}: {got:#}");
    assert_eq!(got["verdict"], want.verdict, "verdict, {ctx}");
    let eps: Vec<&str> = got["endpoints"].as_array().expect("endpoints list").iter().filter_map(Value::as_str).collect();
    assert_eq!(eps, want.endpoints, "endpoints, {ctx}");
    assert_eq!(got["masquerade"], want.masquerade, "masquerade, {ctx}");
    assert!(!got["rules"].as_array().expect("rules list").is_empty() || want.verdict == "PASS", "rules, {ctx}");
}

const WEB: &[&str] = &["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16"];
const WEB_EPS: &[&str] = &["10.244.1.5:8080", "10.244.2.7:8080", "10.244.3.9:8080"];

#[test]
fn trace_cluster_ip_from_pod_is_not_masqueraded() {
    check("web", WEB, "10.244.2.30", "10.96.165.10:80", "TCP", Expect { verdict: "DNAT", endpoints: WEB_EPS, masquerade: false });
}

#[test]
fn trace_cluster_ip_from_outside_cluster_cidr_is_masqueraded() {
    check("web", WEB, "192.168.49.77", "10.96.165.10:80", "TCP", Expect { verdict: "DNAT", endpoints: WEB_EPS, masquerade: true });
}

#[test]
fn trace_cluster_ip_without_detector_is_never_masqueraded() {
    check("web", &["--hostname-override=node-a"], "192.168.49.77", "10.96.165.10:80", "TCP", Expect { verdict: "DNAT", endpoints: WEB_EPS, masquerade: false });
}

#[test]
fn trace_masquerade_all() {
    check("web", &["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--masquerade-all"], "10.244.2.30", "10.96.165.10:80", "TCP", Expect { verdict: "DNAT", endpoints: WEB_EPS, masquerade: true });
}

#[test]
fn trace_nodeport_from_outside_goes_through_ext_and_masquerades() {
    check("web", WEB, "192.168.49.77", "192.168.49.2:32517", "TCP", Expect { verdict: "DNAT", endpoints: WEB_EPS, masquerade: true });
    let got = trace("web", WEB, "192.168.49.77", "192.168.49.2:32517", "TCP");
    let rules = got["rules"].to_string();
    assert!(rules.contains("KUBE-NODEPORTS") && rules.contains("KUBE-EXT-"), "{rules}");
}

#[test]
fn trace_nodeport_on_unselected_address_passes() {
    // nodePortAddresses=primary: only 192.168.49.2 accepts NodePorts, not loopback.
    check("web", &["--hostname-override=node-a", "--nodeport-addresses=primary"], "127.0.0.1", "127.0.0.1:32517", "TCP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
}

#[test]
fn trace_wrong_port_or_protocol_passes() {
    check("web", WEB, "10.244.2.30", "10.96.165.10:81", "TCP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
    check("web", WEB, "10.244.2.30", "10.96.165.10:80", "UDP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
}

#[test]
fn trace_hairpin_masquerades_the_path_to_itself() {
    let got = trace("web", WEB, "10.244.2.7", "10.96.165.10:80", "TCP");
    assert_eq!(got["verdict"], "DNAT");
    let paths = got["paths"].as_array().expect("paths");
    let to_self = paths.iter().find(|p| p["endpoint"] == "10.244.2.7:8080").expect("path to itself");
    assert_eq!(to_self["masquerade"], true, "{got:#}");
    let other = paths.iter().find(|p| p["endpoint"] == "10.244.1.5:8080").expect("path to another endpoint");
    assert_eq!(other["masquerade"], false, "{got:#}");
}

#[test]
fn trace_etp_local_keeps_source_and_uses_local_endpoints() {
    check("traffic-policy-local", &[], "198.51.100.99", "203.0.113.10:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.20:8080"], masquerade: false });
    check("traffic-policy-local", &[], "198.51.100.99", "192.168.49.2:30080", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.20:8080"], masquerade: false });
    // Pod traffic to the external address is short-circuited to all endpoints.
    check("traffic-policy-local", &[], "10.244.2.5", "203.0.113.10:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.20:8080", "10.244.2.20:8080"], masquerade: false });
}

#[test]
fn trace_etp_local_without_local_endpoints_drops() {
    check("traffic-policy-local", &[], "198.51.100.99", "203.0.113.11:80", "TCP", Expect { verdict: "DROP", endpoints: &[], masquerade: false });
    check("traffic-policy-local", &[], "198.51.100.99", "192.168.49.2:30081", "TCP", Expect { verdict: "DROP", endpoints: &[], masquerade: false });
    check("traffic-policy-local", &[], "198.51.100.99", "192.168.49.100:80", "TCP", Expect { verdict: "DROP", endpoints: &[], masquerade: false });
    // ClusterIP traffic of the same Service still works.
    check("traffic-policy-local", &[], "10.244.2.5", "10.96.20.2:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.21:8080"], masquerade: false });
}

#[test]
fn trace_health_check_node_port_is_accepted() {
    check("traffic-policy-local", &[], "198.51.100.99", "192.168.49.2:31001", "TCP", Expect { verdict: "ACCEPT", endpoints: &[], masquerade: false });
}

#[test]
fn trace_itp_local() {
    check("traffic-policy-local", &[], "10.244.2.5", "10.96.20.3:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.22:8080"], masquerade: false });
    check("traffic-policy-local", &[], "10.244.2.5", "10.96.20.4:80", "TCP", Expect { verdict: "DROP", endpoints: &[], masquerade: false });
}

#[test]
fn trace_source_ranges() {
    // Allowed range (whitespace trimmed in the manifest).
    check("external-and-firewall", &[], "203.0.113.5", "198.51.100.50:443", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.50:8443"], masquerade: true });
    // Not allowed: falls through KUBE-FW and is dropped by KUBE-PROXY-FIREWALL.
    check("external-and-firewall", &[], "203.0.113.200", "198.51.100.50:443", "TCP", Expect { verdict: "DROP", endpoints: &[], masquerade: false });
    // The VIP itself is allowed because a range contains the node's IP.
    check("external-and-firewall", &[], "198.51.100.51", "198.51.100.51:443", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.50:8443"], masquerade: true });
    // ipMode Proxy ingress is not captured.
    check("external-and-firewall", &[], "203.0.113.5", "198.51.100.52:443", "TCP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
    // NodePorts are not subject to source ranges.
    check("external-and-firewall", &[], "203.0.113.200", "192.168.49.2:30443", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.50:8443"], masquerade: true });
    // externalIPs are not subject to source ranges either.
    check("external-and-firewall", &[], "203.0.113.200", "198.51.100.7:443", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.50:8443"], masquerade: true });
}

#[test]
fn trace_zero_endpoints_rejects_everywhere() {
    for to in ["10.96.50.2:443", "198.51.100.8:443", "198.51.100.60:443", "192.168.49.2:30444"] {
        check("external-and-firewall", &[], "203.0.113.5", to, "TCP", Expect { verdict: "REJECT", endpoints: &[], masquerade: false });
    }
}

#[test]
fn trace_terminating_fallback_and_conditions() {
    check("endpoint-conditions", &[], "10.244.2.5", "10.96.10.1:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.10:8080", "10.244.2.1:8080"], masquerade: false });
    check("endpoint-conditions", &[], "10.244.2.5", "10.96.10.1:9090", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.10:9090", "10.244.2.1:9090"], masquerade: false });
    check("endpoint-conditions", &[], "10.244.2.5", "10.96.10.2:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.3.1:8080"], masquerade: false });
}

#[test]
fn trace_topology_hints() {
    check("topology-hints", &[], "10.244.2.5", "10.96.30.1:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.30:8080", "10.244.3.30:8080"], masquerade: false });
    check("topology-hints", &[], "10.244.2.5", "10.96.30.2:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.31:8080", "10.244.2.31:8080"], masquerade: false });
    check("topology-hints", &[], "10.244.2.5", "10.96.30.3:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.32:8080"], masquerade: false });
    check("topology-hints", &["--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", "--feature-gates=PreferSameTrafficDistribution=false"], "10.244.2.5", "10.96.30.3:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.32:8080", "10.244.1.33:8080"], masquerade: false });
}

#[test]
fn trace_session_affinity_reaches_every_endpoint_through_recent() {
    let got = trace("session-affinity", &[], "10.244.2.5", "10.96.40.1:80", "TCP");
    assert_eq!(got["verdict"], "DNAT");
    assert_eq!(got["endpoints"], serde_json::json!(["10.244.2.40:8080", "10.244.3.40:8080"]));
    assert!(got["rules"].to_string().contains("--rcheck --seconds 600 --reap"), "{got:#}");
}

#[test]
fn trace_protocols() {
    check("protocols", &[], "10.244.2.5", "10.96.0.10:53", "UDP", Expect { verdict: "DNAT", endpoints: &["10.244.1.2:53", "10.244.2.2:53"], masquerade: false });
    check("protocols", &[], "10.244.2.5", "10.96.0.10:3868", "SCTP", Expect { verdict: "DNAT", endpoints: &["10.244.1.2:3868", "10.244.2.2:3868"], masquerade: false });
    check("protocols", &[], "10.244.2.5", "10.96.0.10:3868", "TCP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
}

#[test]
fn trace_dual_stack_ipv6() {
    check("dual-stack", &[], "fd00:10:244:2::5", "[fd00:96::60:1]:80", "TCP", Expect { verdict: "DNAT", endpoints: &["[fd00:10:244:1::60]:8080", "[fd00:10:244:2::61]:8080"], masquerade: false });
    check("dual-stack", &[], "2001:db8::1", "[fd00:49::2]:30600", "TCP", Expect { verdict: "DNAT", endpoints: &["[fd00:10:244:1::60]:8080", "[fd00:10:244:2::61]:8080"], masquerade: true });
    check("dual-stack", &[], "10.244.2.5", "10.96.60.1:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.1.60:8080"], masquerade: false });
}

#[test]
fn trace_bad_input_keeps_good_service_working() {
    check("bad-input", &[], "10.244.2.5", "10.96.70.1:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.70:8080"], masquerade: false });
    check("bad-input", &[], "10.244.2.5", "198.51.100.70:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.70:8080"], masquerade: true });
}

#[test]
fn trace_skipped_services_have_no_rules() {
    check("skipped-services", &[], "10.244.2.5", "10.96.0.21:80", "TCP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
    check("skipped-services", &[], "10.244.2.5", "10.96.0.20:80", "TCP", Expect { verdict: "PASS", endpoints: &[], masquerade: false });
    check("skipped-services", &[], "10.244.2.5", "10.96.0.22:80", "TCP", Expect { verdict: "DNAT", endpoints: &["10.244.2.10:8080"], masquerade: false });
}

#[test]
fn trace_text_output_lists_matched_rules() {
    let path = std::path::PathBuf::from("examples/web");
    let out = kube_proxy(&["trace", "--hostname-override=node-a", "--cluster-cidr=10.244.0.0/16", &path.display().to_string(), "--from=192.168.49.77", "--to=10.96.165.10:80"]);
    assert_eq!(out.status, 0, "{}", out.stderr);
    assert!(out.stdout.contains("KUBE-SERVICES") && out.stdout.contains("KUBE-SVC-CDGGSHYLG3RE2FKL") && out.stdout.contains("DNAT"), "{}", out.stdout);
}

#[test]
fn cli_errors_name_the_problem() {
    let path = std::path::PathBuf::from("examples/web").display().to_string();
    let out = kube_proxy(&["render", "--iptables-masquerade-bit=99", &path]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("--iptables-masquerade-bit") && out.stderr.contains("99"), "{}", out.stderr);
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
    let a = render(std::path::Path::new(&path), &["--hostname-override=node-a".into(), "--cluster_cidr=10.244.0.0/16".into()]);
    let b = render(std::path::Path::new(&path), &["--hostname-override=node-a".into(), "--cluster-cidr=10.244.0.0/16".into()]);
    assert_eq!(a, b);
    assert!(a.contains("! -s 10.244.0.0/16"));
}
