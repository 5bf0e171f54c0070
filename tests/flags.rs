//! The command line and the configuration file, through the real binary: every upstream flag
//! (in its `--flag=value`, `--flag value` and `--flag_name` spellings), the v1alpha1 file,
//! `--write-config-to`, validation errors, warnings for settings that are accepted but not
//! implemented, `--version`, and the log formats. Every run uses `--write-config-to` (or fails
//! validation first), so nothing is applied to the node and no root is needed.

use std::path::PathBuf;
use std::process::Command;

use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run<S: AsRef<str>>(args: &[S]) -> Out {
    let out = Command::new(BIN)
        .args(args.iter().map(AsRef::as_ref))
        .output()
        .expect("the kube-proxy binary runs");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kp-flags-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn yaml(text: &str) -> Value {
    serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("valid YAML ({e}):\n{text}"))
}

/// Runs with `--write-config-to` and returns the written configuration.
fn written<S: AsRef<str>>(dir: &std::path::Path, args: &[S]) -> Result<Value, Out> {
    let file = dir.join("written.yaml");
    let _ = std::fs::remove_file(&file);
    let mut all: Vec<String> = args.iter().map(|a| a.as_ref().to_string()).collect();
    all.push(format!("--write-config-to={}", file.display()));
    let out = run(&all);
    if out.code != 0 {
        return Err(out);
    }
    Ok(yaml(
        &std::fs::read_to_string(&file).expect("--write-config-to wrote the file"),
    ))
}

fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    v.pointer(path).unwrap_or_else(|| panic!("{path} in {v:#}"))
}

/// `--flag-name` → `--flag_name`.
fn underscored(flag: &str) -> String {
    format!("--{}", flag.trim_start_matches("--").replace('-', "_"))
}

/// (flag, value (None: boolean), other arguments, JSON pointer in the written config, expected).
type Case = (
    &'static str,
    Option<&'static str>,
    &'static [&'static str],
    &'static str,
    Value,
);

/// Every flag, the groups in upstream's order.
fn cases() -> Vec<Case> {
    [
        client_and_server_cases(),
        proxy_mode_cases(),
        node_cases(),
        logging_and_other_cases(),
    ]
    .concat()
}

/// Feature gates, the API client, the node's and the servers' addresses.
fn client_and_server_cases() -> Vec<Case> {
    vec![
        (
            "--feature-gates",
            Some("PreferSameTrafficDistribution=false"),
            &[],
            "/featureGates/PreferSameTrafficDistribution",
            json!(false),
        ),
        (
            "--kubeconfig",
            Some("/etc/kube-proxy/kubeconfig"),
            &[],
            "/clientConnection/kubeconfig",
            json!("/etc/kube-proxy/kubeconfig"),
        ),
        (
            "--master",
            Some("https://192.168.49.2:6443"),
            &[],
            "/clientConnection/kubeconfig",
            json!(""),
        ),
        (
            "--kube-api-content-type",
            Some("application/json"),
            &[],
            "/clientConnection/contentType",
            json!("application/json"),
        ),
        ("--kube-api-qps", Some("7.5"), &[], "/clientConnection/qps", json!(7.5)),
        (
            "--kube-api-burst",
            Some("20"),
            &[],
            "/clientConnection/burst",
            json!(20),
        ),
        (
            "--hostname-override",
            Some("Node-A"),
            &[],
            "/hostnameOverride",
            json!("node-a"),
        ),
        (
            "--bind-address",
            Some("192.168.49.2"),
            &[],
            "/bindAddress",
            json!("192.168.49.2"),
        ),
        (
            "--healthz-bind-address",
            Some("127.0.0.1:10266"),
            &[],
            "/healthzBindAddress",
            json!("127.0.0.1:10266"),
        ),
        (
            "--metrics-bind-address",
            Some("0.0.0.0:10259"),
            &[],
            "/metricsBindAddress",
            json!("0.0.0.0:10259"),
        ),
        (
            "--bind-address-hard-fail",
            None,
            &[],
            "/bindAddressHardFail",
            json!(true),
        ),
        ("--profiling", None, &[], "/enableProfiling", json!(true)),
        (
            "--show-hidden-metrics-for-version",
            Some("1.33"),
            &[],
            "/showHiddenMetricsForVersion",
            json!("1.33"),
        ),
    ]
}

/// The proxy mode and the settings of the iptables and IPVS modes.
fn proxy_mode_cases() -> Vec<Case> {
    const IPVS: &[&str] = &["--proxy-mode=ipvs"];
    vec![
        ("--proxy-mode", Some("nftables"), &[], "/mode", json!("nftables")),
        (
            "--iptables-masquerade-bit",
            Some("5"),
            &[],
            "/iptables/masqueradeBit",
            json!(5),
        ),
        ("--masquerade-all", None, &[], "/iptables/masqueradeAll", json!(true)),
        (
            "--iptables-localhost-nodeports",
            Some("false"),
            &[],
            "/iptables/localhostNodePorts",
            json!(false),
        ),
        (
            "--iptables-sync-period",
            Some("1m"),
            &[],
            "/iptables/syncPeriod",
            json!("1m0s"),
        ),
        (
            "--iptables-min-sync-period",
            Some("500ms"),
            &[],
            "/iptables/minSyncPeriod",
            json!("500ms"),
        ),
        (
            "--ipvs-sync-period",
            Some("45s"),
            IPVS,
            "/ipvs/syncPeriod",
            json!("45s"),
        ),
        (
            "--ipvs-min-sync-period",
            Some("5s"),
            IPVS,
            "/ipvs/minSyncPeriod",
            json!("5s"),
        ),
        ("--ipvs-scheduler", Some("wrr"), IPVS, "/ipvs/scheduler", json!("wrr")),
        (
            "--ipvs-exclude-cidrs",
            Some("10.0.0.0/8,fd00::/64"),
            IPVS,
            "/ipvs/excludeCIDRs",
            json!(["10.0.0.0/8", "fd00::/64"]),
        ),
        ("--ipvs-strict-arp", None, IPVS, "/ipvs/strictARP", json!(true)),
        (
            "--ipvs-tcp-timeout",
            Some("15m"),
            IPVS,
            "/ipvs/tcpTimeout",
            json!("15m0s"),
        ),
        (
            "--ipvs-tcpfin-timeout",
            Some("30s"),
            IPVS,
            "/ipvs/tcpFinTimeout",
            json!("30s"),
        ),
        (
            "--ipvs-udp-timeout",
            Some("5m"),
            IPVS,
            "/ipvs/udpTimeout",
            json!("5m0s"),
        ),
    ]
}

/// Local traffic detection, NodePort addresses, OOM score, conntrack, resync, deprecated ports.
fn node_cases() -> Vec<Case> {
    vec![
        (
            "--detect-local-mode",
            Some("NodeCIDR"),
            &[],
            "/detectLocalMode",
            json!("NodeCIDR"),
        ),
        (
            "--pod-bridge-interface",
            Some("cni0"),
            &["--detect-local-mode=BridgeInterface"],
            "/detectLocal/bridgeInterface",
            json!("cni0"),
        ),
        (
            "--pod-interface-name-prefix",
            Some("veth"),
            &["--detect-local-mode=InterfaceNamePrefix"],
            "/detectLocal/interfaceNamePrefix",
            json!("veth"),
        ),
        (
            "--cluster-cidr",
            Some("10.244.0.0/16,fd00:10:244::/56"),
            &[],
            "/clusterCIDR",
            json!("10.244.0.0/16,fd00:10:244::/56"),
        ),
        (
            "--nodeport-addresses",
            Some("192.168.49.0/24,127.0.0.0/8"),
            &[],
            "/nodePortAddresses",
            json!(["192.168.49.0/24", "127.0.0.0/8"]),
        ),
        ("--oom-score-adj", Some("-500"), &[], "/oomScoreAdj", json!(-500)),
        (
            "--conntrack-max-per-core",
            Some("0"),
            &[],
            "/conntrack/maxPerCore",
            json!(0),
        ),
        ("--conntrack-min", Some("1000"), &[], "/conntrack/min", json!(1000)),
        (
            "--conntrack-tcp-timeout-established",
            Some("12h"),
            &[],
            "/conntrack/tcpEstablishedTimeout",
            json!("12h0m0s"),
        ),
        (
            "--conntrack-tcp-timeout-close-wait",
            Some("30m"),
            &[],
            "/conntrack/tcpCloseWaitTimeout",
            json!("30m0s"),
        ),
        (
            "--conntrack-tcp-be-liberal",
            None,
            &[],
            "/conntrack/tcpBeLiberal",
            json!(true),
        ),
        (
            "--conntrack-udp-timeout",
            Some("30s"),
            &[],
            "/conntrack/udpTimeout",
            json!("30s"),
        ),
        (
            "--conntrack-udp-timeout-stream",
            Some("2m"),
            &[],
            "/conntrack/udpStreamTimeout",
            json!("2m0s"),
        ),
        (
            "--config-sync-period",
            Some("10m"),
            &[],
            "/configSyncPeriod",
            json!("10m0s"),
        ),
        (
            "--healthz-port",
            Some("10300"),
            &["--healthz-bind-address=127.0.0.1"],
            "/healthzBindAddress",
            json!("127.0.0.1:10300"),
        ),
        ("--metrics-port", Some("0"), &[], "/metricsBindAddress", json!("")),
        (
            "--proxy-port-range",
            Some("30000-32767"),
            &[],
            "/portRange",
            json!("30000-32767"),
        ),
        // Upstream takes these from Go's flag set; no setting of kube-proxy holds them.
        (
            "--boot-id-file",
            Some("/proc/sys/kernel/random/boot_id"),
            &[],
            "/mode",
            json!("iptables"),
        ),
        (
            "--machine-id-file",
            Some("/etc/machine-id,/var/lib/dbus/machine-id"),
            &[],
            "/mode",
            json!("iptables"),
        ),
    ]
}

/// Logging, the exit-early flags and kube-proxy-rs' additions.
fn logging_and_other_cases() -> Vec<Case> {
    const ALPHA: &[&str] = &["--feature-gates=LoggingAlphaOptions=true"];
    vec![
        ("--v", Some("4"), &[], "/logging/verbosity", json!(4)),
        (
            "--vmodule",
            Some("proxier=5"),
            &[],
            "/logging/vmodule/0",
            json!({"filePattern": "proxier", "verbosity": 5}),
        ),
        ("--logging-format", Some("json"), &[], "/logging/format", json!("json")),
        (
            "--log-flush-frequency",
            Some("2s"),
            &[],
            "/logging/flushFrequency",
            json!("2s"),
        ),
        (
            "--log-json-split-stream",
            None,
            ALPHA,
            "/logging/options/json/splitStream",
            json!(true),
        ),
        (
            "--log-json-info-buffer-size",
            Some("1Mi"),
            ALPHA,
            "/logging/options/json/infoBufferSize",
            json!("1Mi"),
        ),
        (
            "--log-text-split-stream",
            None,
            ALPHA,
            "/logging/options/text/splitStream",
            json!(true),
        ),
        (
            "--log-text-info-buffer-size",
            Some("2Ki"),
            ALPHA,
            "/logging/options/text/infoBufferSize",
            json!("2Ki"),
        ),
        // Exit-early flags: --write-config-to comes first, as upstream, so nothing is done.
        ("--cleanup", None, &[], "/mode", json!("iptables")),
        ("--init-only", None, &[], "/mode", json!("iptables")),
        // kube-proxy-rs additions.
        ("--node-ip", Some("192.168.49.2"), &[], "/mode", json!("iptables")),
        ("--manifests", Some("/nonexistent"), &[], "/mode", json!("iptables")),
    ]
}

#[test]
fn every_upstream_flag_parses_in_every_spelling() {
    let dir = scratch("every-flag");
    let mut failures = Vec::new();
    for (flag, value, extra, path, expected) in cases() {
        let mut spellings: Vec<Vec<String>> = match value {
            // A boolean's value only ever follows '='.
            Some(v @ ("true" | "false")) => {
                vec![vec![format!("{flag}={v}")], vec![format!("{}={v}", underscored(flag))]]
            }
            Some(v) => vec![
                vec![format!("{flag}={v}")],
                vec![flag.to_string(), v.to_string()],
                vec![format!("{}={v}", underscored(flag))],
            ],
            None => vec![vec![flag.to_string()], vec![format!("{}=true", underscored(flag))]],
        };
        if flag == "--v" {
            spellings.extend([vec!["-v=4".into()], vec!["-v".into(), "4".into()], vec!["-v4".into()]]);
        }
        for spelling in spellings {
            let args: Vec<String> = extra.iter().map(|s| s.to_string()).chain(spelling.clone()).collect();
            match written(&dir, &args) {
                Err(out) => failures.push(format!("{args:?}: exit {}: {}", out.code, out.stderr)),
                Ok(cfg) => {
                    if at(&cfg, path) != &expected {
                        failures.push(format!("{args:?}: {path} is {}, expected {expected}", at(&cfg, path)));
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn booleans_are_pflag_booleans() {
    let dir = scratch("booleans");
    let cfg = written(&dir, &["--masquerade-all"]).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/iptables/masqueradeAll"), &json!(true));
    let cfg = written(&dir, &["--masquerade-all=false"]).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/iptables/masqueradeAll"), &json!(false));
    for v in ["1", "t", "T", "TRUE", "True"] {
        let cfg = written(&dir, &[format!("--masquerade-all={v}")]).unwrap_or_else(|o| panic!("{}", o.stderr));
        assert_eq!(at(&cfg, "/iptables/masqueradeAll"), &json!(true), "{v}");
    }
    // As pflag: a boolean takes no separate value, so "false" is a stray argument.
    let out = written(&dir, &["--masquerade-all", "false"]).expect_err("--masquerade-all false fails");
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("false"), "{}", out.stderr);
    let out = written(&dir, &["--masquerade-all=maybe"]).expect_err("a non-boolean fails");
    assert!(
        out.stderr.contains("--masquerade-all") && out.stderr.contains("maybe"),
        "{}",
        out.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_config_to_writes_upstream_defaults() {
    let dir = scratch("defaults");
    let out = written(&dir, &[] as &[&str]).unwrap_or_else(|o| panic!("{}", o.stderr));
    for (path, expected) in [
        ("/apiVersion", json!("kubeproxy.config.k8s.io/v1alpha1")),
        ("/kind", json!("KubeProxyConfiguration")),
        ("/bindAddress", json!("0.0.0.0")),
        ("/healthzBindAddress", json!("0.0.0.0:10256")),
        ("/metricsBindAddress", json!("127.0.0.1:10249")),
        ("/mode", json!("iptables")),
        ("/detectLocalMode", json!("ClusterCIDR")),
        ("/iptables/masqueradeBit", json!(14)),
        ("/iptables/masqueradeAll", json!(false)),
        ("/iptables/localhostNodePorts", json!(true)),
        ("/iptables/syncPeriod", json!("30s")),
        ("/iptables/minSyncPeriod", json!("1s")),
        ("/ipvs/syncPeriod", json!("30s")),
        ("/ipvs/minSyncPeriod", json!("0s")),
        ("/nftables/masqueradeBit", json!(14)),
        ("/nftables/syncPeriod", json!("30s")),
        ("/conntrack/maxPerCore", json!(32768)),
        ("/conntrack/min", json!(131072)),
        ("/conntrack/tcpEstablishedTimeout", json!("24h0m0s")),
        ("/conntrack/tcpCloseWaitTimeout", json!("1h0m0s")),
        ("/conntrack/udpTimeout", json!("0s")),
        ("/oomScoreAdj", json!(-999)),
        ("/configSyncPeriod", json!("15m0s")),
        (
            "/clientConnection/contentType",
            json!("application/vnd.kubernetes.protobuf"),
        ),
        ("/clientConnection/qps", json!(5)),
        ("/clientConnection/burst", json!(10)),
        ("/logging/format", json!("text")),
        ("/logging/flushFrequency", json!("5s")),
        ("/logging/verbosity", json!(0)),
        ("/nodePortAddresses", json!(null)),
    ] {
        assert_eq!(at(&out, path), &expected, "{path}");
    }
    // IPv6 bindAddress: IPv6 defaults (as upstream's defaulting of a file).
    let file = dir.join("v6.yaml");
    std::fs::write(&file, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nbindAddress: fd00::2\nmode: nftables\n").unwrap();
    let v6 = written(&dir, &[format!("--config={}", file.display())]).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&v6, "/healthzBindAddress"), &json!("[::]:10256"));
    assert_eq!(at(&v6, "/metricsBindAddress"), &json!("[::1]:10249"));
    assert_eq!(
        at(&v6, "/nodePortAddresses"),
        &json!(["primary"]),
        "nftables mode defaults to primary"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every v1alpha1 field set to a value other than its default (`logging.format` stays text,
/// which `vmodule` needs), in the canonical form the writer uses.
const FULL_CONFIG: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
featureGates:
  LoggingAlphaOptions: true
  PreferSameTrafficDistribution: false
clientConnection:
  kubeconfig: /etc/kubernetes/kube-proxy.kubeconfig
  acceptContentTypes: application/json
  contentType: application/json
  qps: 7.5
  burst: 20
logging:
  format: text
  flushFrequency: 2s
  verbosity: 3
  vmodule:
  - filePattern: proxier
    verbosity: 5
  options:
    text:
      splitStream: true
      infoBufferSize: 1Mi
    json:
      splitStream: true
      infoBufferSize: 2Ki
hostnameOverride: node-a
bindAddress: 192.168.49.2
healthzBindAddress: 192.168.49.2:10266
metricsBindAddress: 0.0.0.0:10259
bindAddressHardFail: true
enableProfiling: true
showHiddenMetricsForVersion: "1.33"
mode: ipvs
iptables:
  masqueradeBit: 5
  masqueradeAll: true
  localhostNodePorts: false
  syncPeriod: 1m0s
  minSyncPeriod: 2s
ipvs:
  syncPeriod: 45s
  minSyncPeriod: 5s
  scheduler: wrr
  excludeCIDRs:
  - 10.0.0.0/8
  - fd00::/64
  strictARP: true
  tcpTimeout: 15m0s
  tcpFinTimeout: 30s
  udpTimeout: 5m0s
nftables:
  masqueradeBit: 6
  masqueradeAll: true
  syncPeriod: 40s
  minSyncPeriod: 3s
winkernel:
  networkName: l2bridge
  sourceVip: 10.0.0.5
  enableDSR: true
  rootHnsEndpointName: cbr1
  forwardHealthCheckVip: true
detectLocalMode: InterfaceNamePrefix
detectLocal:
  bridgeInterface: cni0
  interfaceNamePrefix: veth
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
nodePortAddresses:
- 192.168.49.0/24
- fd00::/64
oomScoreAdj: -500
conntrack:
  maxPerCore: 65536
  min: 262144
  tcpEstablishedTimeout: 12h0m0s
  tcpCloseWaitTimeout: 30m0s
  tcpBeLiberal: true
  udpTimeout: 30s
  udpStreamTimeout: 2m0s
configSyncPeriod: 10m0s
portRange: 30000-32767
windowsRunAsService: true
"#;

#[test]
fn config_file_with_every_field_round_trips() {
    let dir = scratch("round-trip");
    let file = dir.join("full.yaml");
    std::fs::write(&file, FULL_CONFIG).unwrap();
    let original = yaml(FULL_CONFIG);
    let defaults = written(&dir, &[] as &[&str]).unwrap_or_else(|o| panic!("{}", o.stderr));
    // Every field of the written defaults is set here, to something else.
    fn leaves(v: &Value, path: String, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, v)| leaves(v, format!("{path}/{k}"), out)),
            _ => out.push(path),
        }
    }
    let mut paths = Vec::new();
    leaves(&defaults, String::new(), &mut paths);
    for p in paths
        .iter()
        .filter(|p| !["/apiVersion", "/kind", "/logging/format"].contains(&p.as_str()))
    {
        let set = original
            .pointer(p)
            .unwrap_or_else(|| panic!("{p} is set in FULL_CONFIG"));
        assert_ne!(set, at(&defaults, p), "{p} differs from its default");
    }

    let back = written(&dir, &[format!("--config={}", file.display())]).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(back, original, "written:\n{back:#}");
    // And the written file loads again to the same configuration.
    let again_file = dir.join("again.yaml");
    std::fs::copy(dir.join("written.yaml"), &again_file).unwrap();
    let again =
        written(&dir, &[format!("--config={}", again_file.display())]).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(again, original);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_file_replaces_flags_except_logging_and_hostname_override() {
    let dir = scratch("precedence");
    let file = dir.join("c.yaml");
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.0.0.0/8\nhostnameOverride: from-file\n",
    )
    .unwrap();
    let args = [
        format!("--config={}", file.display()),
        "--cluster-cidr=10.1.0.0/16".into(),
        "--masquerade-all".into(),
        "--hostname-override=From-Flag".into(),
        "-v=3".into(),
    ];
    let cfg = written(&dir, &args).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/clusterCIDR"), &json!("10.0.0.0/8"));
    assert_eq!(at(&cfg, "/iptables/masqueradeAll"), &json!(false));
    assert_eq!(at(&cfg, "/hostnameOverride"), &json!("from-flag"));
    assert_eq!(at(&cfg, "/logging/verbosity"), &json!(3));
    let out = run(&[
        args.to_vec(),
        vec![format!("--write-config-to={}", dir.join("w.yaml").display())],
    ]
    .concat());
    let ignored: Vec<&str> = out.stderr.lines().filter(|l| l.contains("flags are ignored")).collect();
    assert_eq!(ignored.len(), 1, "{}", out.stderr);
    assert!(
        ignored[0].contains("--cluster-cidr") && ignored[0].contains("--masquerade-all"),
        "{}",
        ignored[0]
    );
    assert!(!ignored[0].contains("--hostname-override"), "{}", ignored[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn invalid_values_name_the_flag_or_field_and_the_value() {
    let dir = scratch("invalid");
    let bad_file = |name: &str, body: &str| {
        let f = dir.join(name);
        std::fs::write(
            &f,
            format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{body}"),
        )
        .unwrap();
        format!("--config={}", f.display())
    };
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec!["--iptables-masquerade-bit=32".into()],
            vec!["--iptables-masquerade-bit", "32"],
        ),
        (
            vec!["--iptables-sync-period=abc".into()],
            vec!["--iptables-sync-period", "abc"],
        ),
        (
            vec![
                "--iptables-sync-period=10s".into(),
                "--iptables-min-sync-period=1m0s".into(),
            ],
            vec!["--iptables-min-sync-period", "1m0s"],
        ),
        (
            vec!["--iptables-sync-period=0s".into()],
            vec!["--iptables-sync-period", "0s"],
        ),
        (
            vec!["--cluster-cidr=10.0.0.0/33".into()],
            vec!["--cluster-cidr", "10.0.0.0/33"],
        ),
        (
            vec!["--cluster-cidr=10.0.0.0/8,10.1.0.0/16".into()],
            vec!["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"],
        ),
        (
            vec!["--metrics-bind-address=localhost:10249".into()],
            vec!["--metrics-bind-address", "localhost:10249"],
        ),
        (
            vec!["--healthz-bind-address=1.2.3.4:99999".into()],
            vec!["--healthz-bind-address", "1.2.3.4:99999"],
        ),
        (
            vec!["--bind-address=not-an-ip".into()],
            vec!["--bind-address", "not-an-ip"],
        ),
        (vec!["--proxy-mode=userspace".into()], vec!["--proxy-mode", "userspace"]),
        (vec!["--logging-format=xml".into()], vec!["--logging-format", "xml"]),
        (vec!["--oom-score-adj=5000".into()], vec!["--oom-score-adj", "5000"]),
        (vec!["--kube-api-burst=-1".into()], vec!["--kube-api-burst", "-1"]),
        (vec!["--kube-api-qps=-2".into()], vec!["--kube-api-qps", "-2"]),
        (vec!["--conntrack-min=-5".into()], vec!["--conntrack-min", "-5"]),
        (
            vec!["--conntrack-udp-timeout=-1s".into()],
            vec!["--conntrack-udp-timeout", "-1s"],
        ),
        (
            vec!["--detect-local-mode=Magic".into()],
            vec!["--detect-local-mode", "Magic"],
        ),
        (
            vec!["--detect-local-mode=BridgeInterface".into()],
            vec!["--pod-bridge-interface"],
        ),
        (
            vec!["--nodeport-addresses=everywhere".into()],
            vec!["--nodeport-addresses", "everywhere"],
        ),
        (
            vec!["--feature-gates=Foo=maybe".into()],
            vec!["--feature-gates", "Foo=maybe"],
        ),
        (
            vec!["--config-sync-period=0s".into()],
            vec!["--config-sync-period", "0s"],
        ),
        (
            vec!["--proxy-mode=ipvs".into(), "--ipvs-scheduler=fancy".into()],
            vec!["--ipvs-scheduler", "fancy"],
        ),
        (vec!["--vmodule=proxier".into()], vec!["--vmodule", "proxier"]),
        (
            vec!["--log-json-split-stream".into()],
            vec!["--log-json-split-stream", "LoggingAlphaOptions"],
        ),
        (vec!["--kube-api-burst=many".into()], vec!["--kube-api-burst", "many"]),
        (vec!["--v=-1".into()], vec!["-1"]),
        (
            vec![bad_file("bit.yaml", "iptables:\n  masqueradeBit: 32\n")],
            vec!["iptables.masqueradeBit", "32", "bit.yaml"],
        ),
        (
            vec![bad_file("oom.yaml", "oomScoreAdj: 5000\n")],
            vec!["oomScoreAdj", "5000", "oom.yaml"],
        ),
        (
            vec![bad_file("sync.yaml", "iptables:\n  syncPeriod: abc\n")],
            vec!["iptables.syncPeriod", "abc", "sync.yaml"],
        ),
        (
            vec![bad_file("mode.yaml", "mode: userspace\n")],
            vec!["mode", "userspace"],
        ),
        (
            vec![bad_file("fmt.yaml", "logging:\n  format: xml\n")],
            vec!["logging.format", "xml"],
        ),
    ];
    let target = dir.join("never.yaml");
    let mut failures = Vec::new();
    for (args, needles) in cases {
        let mut all = args.clone();
        all.push(format!("--write-config-to={}", target.display()));
        let out = run(&all);
        if out.code == 0 || target.exists() {
            failures.push(format!(
                "{args:?}: exit {}, expected a failure before writing",
                out.code
            ));
        } else if let Some(n) = needles.iter().find(|n| !out.stderr.contains(*n)) {
            failures.push(format!("{args:?}: {n:?} not in: {}", out.stderr.trim()));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unimplemented_settings_warn_exactly_once() {
    let dir = scratch("warnings");
    let file = |name: &str, body: &str| {
        let f = dir.join(name);
        std::fs::write(
            &f,
            format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{body}"),
        )
        .unwrap();
        format!("--config={}", f.display())
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--profiling".into()], "--profiling"),
        (
            vec!["--show-hidden-metrics-for-version=1.33".into()],
            "--show-hidden-metrics-for-version",
        ),
        (vec!["--ipvs-scheduler=wrr".into()], "--ipvs-scheduler"),
        (vec!["--ipvs-strict-arp".into()], "--ipvs-strict-arp"),
        (vec!["--ipvs-exclude-cidrs=10.0.0.0/8".into()], "--ipvs-exclude-cidrs"),
        (vec!["--ipvs-tcp-timeout=1m".into()], "--ipvs-tcp-timeout"),
        (vec!["--ipvs-sync-period=5s".into()], "--ipvs-sync-period"),
        (vec!["--ipvs-min-sync-period=5s".into()], "--ipvs-min-sync-period"),
        (
            vec!["--proxy-mode=ipvs".into(), "--iptables-sync-period=5s".into()],
            "--iptables-sync-period",
        ),
        (vec!["--proxy-port-range=30000-32767".into()], "--proxy-port-range"),
        (vec!["--healthz-port=0".into()], "--healthz-port"),
        (vec!["--metrics-port=0".into()], "--metrics-port"),
        (vec!["--boot-id-file=/run/boot_id".into()], "--boot-id-file"),
        (vec!["--machine-id-file=/etc/machine-id".into()], "--machine-id-file"),
        (vec!["--feature-gates=SomethingNew=true".into()], "SomethingNew"),
        (
            vec![
                "--proxy-mode=nftables".into(),
                "--iptables-localhost-nodeports=false".into(),
            ],
            "--iptables-localhost-nodeports",
        ),
        (
            vec![
                "--feature-gates=LoggingAlphaOptions=true".into(),
                "--log-text-info-buffer-size=1Mi".into(),
            ],
            "--log-text-info-buffer-size",
        ),
        (vec![file("prof.yaml", "enableProfiling: true\n")], "enableProfiling"),
        (
            vec![file("win.yaml", "winkernel:\n  enableDSR: true\n")],
            "winkernel.enableDSR",
        ),
        (
            vec![file("wras.yaml", "windowsRunAsService: true\n")],
            "windowsRunAsService",
        ),
        (vec![file("ipvs.yaml", "ipvs:\n  scheduler: sh\n")], "ipvs.scheduler"),
        (
            vec![file("nft.yaml", "nftables:\n  masqueradeAll: true\n")],
            "nftables.masqueradeAll",
        ),
        (
            vec![file(
                "act.yaml",
                "clientConnection:\n  acceptContentTypes: application/json\n",
            )],
            "acceptContentTypes",
        ),
        (vec![file("unknown.yaml", "frobnicate: 1\n")], "frobnicate"),
    ];
    let mut failures = Vec::new();
    for (args, name) in cases {
        match written(&dir, &args) {
            Err(out) => failures.push(format!("{args:?}: exit {}: {}", out.code, out.stderr)),
            Ok(_) => {
                let out = run(&[
                    args.clone(),
                    vec![format!("--write-config-to={}", dir.join("w.yaml").display())],
                ]
                .concat());
                let lines: Vec<&str> = out.stderr.lines().filter(|l| l.contains(name)).collect();
                if lines.len() != 1 || !lines[0].starts_with('W') {
                    failures.push(format!(
                        "{args:?}: expected one warning naming {name}, got:\n{}",
                        out.stderr
                    ));
                }
            }
        }
    }
    // Defaults produce no warning at all.
    let out = run(&[format!("--write-config-to={}", dir.join("d.yaml").display())]);
    if out.stderr.lines().any(|l| l.starts_with('W')) {
        failures.push(format!("defaults warn: {}", out.stderr));
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn deprecated_port_flags_mean_what_upstream_means() {
    let dir = scratch("ports");
    // The port of an address that has none. The defaults have ports, so alone the flag
    // changes nothing (upstream's default addresses are complete before the flag is applied).
    let cfg = written(&dir, &["--metrics-port=10300"]).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/metricsBindAddress"), &json!("127.0.0.1:10249"));
    let cfg = written(&dir, &["--metrics-port=10300", "--metrics-bind-address=0.0.0.0"])
        .unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/metricsBindAddress"), &json!("0.0.0.0:10300"));
    let args = ["--healthz-port=10300", "--healthz-bind-address=127.0.0.1:9999"];
    let cfg = written(&dir, &args).unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/healthzBindAddress"), &json!("127.0.0.1:9999"));
    let out = run(&[
        args[0].to_string(),
        args[1].to_string(),
        format!("--write-config-to={}", dir.join("w.yaml").display()),
    ]);
    assert!(
        out.stderr
            .lines()
            .any(|l| l.starts_with('W') && l.contains("--healthz-port") && l.contains("no effect")),
        "{}",
        out.stderr
    );
    // 0 disables the server; IPv6 addresses get brackets.
    let cfg = written(
        &dir,
        &["--healthz-port=0", "--metrics-bind-address=::1", "--metrics-port=9"],
    )
    .unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/healthzBindAddress"), &json!(""));
    assert_eq!(at(&cfg, "/metricsBindAddress"), &json!("[::1]:9"));
    // Like every flag but the logging ones and --hostname-override, ignored with --config.
    let file = dir.join("c.yaml");
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n",
    )
    .unwrap();
    let cfg = written(
        &dir,
        &[format!("--config={}", file.display()), "--healthz-port=0".into()],
    )
    .unwrap_or_else(|o| panic!("{}", o.stderr));
    assert_eq!(at(&cfg, "/healthzBindAddress"), &json!("0.0.0.0:10256"));
    // Not a port: an error naming the flag.
    let out = written(&dir, &["--metrics-port=70000"]).expect_err("out of range");
    assert!(
        out.stderr.contains("--metrics-port") && out.stderr.contains("70000"),
        "{}",
        out.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn version_prints_and_exits() {
    let out = run(&["--version"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.starts_with("kube-proxy-rs ") && out.stdout.contains(env!("CARGO_PKG_VERSION")),
        "{}",
        out.stdout
    );
    let raw = run(&["--version=raw"]);
    assert_eq!(raw.code, 0);
    let v: Value = serde_json::from_str(&raw.stdout).expect("--version=raw is JSON");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
}

#[test]
fn help_lists_every_flag() {
    let out = run(&["--help"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let hidden = ["--healthz-port", "--metrics-port", "--proxy-port-range"];
    for (flag, ..) in cases() {
        if !hidden.contains(&flag) {
            assert!(
                out.stdout.contains(&format!("{flag} ")) || out.stdout.contains(&format!("{flag}[")),
                "{flag} in --help"
            );
        }
    }
    for flag in ["--config", "--write-config-to", "--version", "-h, --help", "-v, --v"] {
        assert!(out.stdout.contains(flag), "{flag} in --help");
    }
}

#[test]
fn logs_are_klog_text_or_json() {
    let dir = scratch("log-formats");
    let target = dir.join("w.yaml");
    let out = run(&[format!("--write-config-to={}", target.display())]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("Wrote configuration"))
        .expect("a log line");
    // I + MMDD + space + hh:mm:ss.uuuuuu + pid + file:line] "msg" key="value"
    let b = line.as_bytes();
    assert!(
        b[0] == b'I' && b[1..5].iter().all(u8::is_ascii_digit) && b[5] == b' ',
        "{line}"
    );
    assert!(
        b[8] == b':' && b[11] == b':' && b[14] == b'.' && b[21] == b' ',
        "{line}"
    );
    assert!(
        line.contains(" main.rs:") && line.contains("] \"Wrote configuration\" file=\""),
        "{line}"
    );

    let out = run(&[
        "--logging-format=json".to_string(),
        format!("--write-config-to={}", target.display()),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for l in out.stderr.lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("JSON line ({e}): {l}"));
        assert!(
            v["msg"].is_string() && v["caller"].as_str().is_some_and(|c| c.contains(".rs:")),
            "{l}"
        );
        assert!(v["ts"].is_f64() || v["ts"].is_u64(), "{l}");
    }
    let wrote = out
        .stderr
        .lines()
        .find(|l| l.contains("Wrote configuration"))
        .expect("a JSON line");
    let v: Value = serde_json::from_str(wrote).unwrap();
    assert_eq!(
        (v["msg"].as_str(), v["v"].as_u64()),
        (Some("Wrote configuration"), Some(0))
    );
    assert_eq!(v["file"].as_str(), Some(target.to_str().unwrap()));
    std::fs::remove_dir_all(&dir).unwrap();
}
