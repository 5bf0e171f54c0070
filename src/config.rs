//! Configuration: upstream's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1) file,
//! the upstream flags that shape the rules, and upstream's precedence between them (a config
//! file replaces the flags, except `--hostname-override`). Validation happens here, before
//! anything touches a node, and every error names the field or flag and the value.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;

use crate::model::{IpFamily, NodeInfo};

/// Errors in configuration; fatal: the caller exits non-zero before changing anything.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid value {value:?} for {field}: {reason}")]
    Invalid {
        field: String,
        value: String,
        reason: String,
    },
}

fn invalid(field: &str, value: impl ToString, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// The v1alpha1 wire format. Every upstream field is accepted; the ones that shape rules are
/// typed, the rest are kept as raw values so that a valid upstream file always loads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    #[serde(default)]
    pub feature_gates: BTreeMap<String, bool>,
    pub client_connection: Option<serde_json::Value>,
    pub logging: Option<serde_json::Value>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    #[serde(default)]
    pub iptables: IptablesSection,
    pub ipvs: Option<serde_json::Value>,
    pub nftables: Option<serde_json::Value>,
    pub winkernel: Option<serde_json::Value>,
    pub detect_local_mode: Option<String>,
    #[serde(default)]
    pub detect_local: DetectLocalSection,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    #[serde(default)]
    pub conntrack: ConntrackSection,
    pub config_sync_period: Option<String>,
    pub port_range: Option<String>,
    pub windows_run_as_service: Option<bool>,
    /// Anything else: reported as a warning, as upstream's lenient decoding does.
    #[serde(flatten)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IptablesSection {
    pub masquerade_all: Option<bool>,
    pub masquerade_bit: Option<i64>,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocalSection {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

/// The upstream flags that affect rules, in their raw form (None = not given on the command line).
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub config: Option<String>,
    pub proxy_mode: Option<String>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub cluster_cidr: Option<String>,
    pub detect_local_mode: Option<String>,
    pub pod_bridge_interface: Option<String>,
    pub pod_interface_name_prefix: Option<String>,
    pub masquerade_all: Option<bool>,
    pub nodeport_addresses: Option<Vec<String>>,
    pub iptables_masquerade_bit: Option<i64>,
    pub iptables_localhost_nodeports: Option<bool>,
    pub feature_gates: BTreeMap<String, bool>,
    /// New: the node's IPs, overriding the Node object's addresses.
    pub node_ips: Vec<String>,
    pub iptables_sync_period: Option<String>,
    pub iptables_min_sync_period: Option<String>,
    pub conntrack_max_per_core: Option<i64>,
    pub conntrack_min: Option<i64>,
    pub conntrack_tcp_timeout_established: Option<String>,
    pub conntrack_tcp_timeout_close_wait: Option<String>,
    pub conntrack_tcp_be_liberal: Option<bool>,
    pub conntrack_udp_timeout: Option<String>,
    pub conntrack_udp_timeout_stream: Option<String>,
}

/// The `conntrack` section of the configuration (upstream's names and defaults).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackSection {
    pub max_per_core: Option<i64>,
    pub min: Option<i64>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<String>,
    pub udp_stream_timeout: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Iptables,
    Ipvs,
    Nftables,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DetectLocalMode {
    ClusterCidr,
    NodeCidr,
    BridgeInterface,
    InterfaceNamePrefix,
}

/// How one family's proxier recognises traffic from local pods (upstream's LocalTrafficDetector).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalDetector {
    /// No detector: ClusterIP traffic is never masqueraded for being off-cluster.
    None,
    /// `-s CIDR` (ClusterCIDR and NodeCIDR modes).
    Cidr(String),
    /// `-i BRIDGE`.
    Bridge(String),
    /// `-i PREFIX+`.
    InterfacePrefix(String),
}

impl LocalDetector {
    pub fn is_implemented(&self) -> bool {
        !matches!(self, LocalDetector::None)
    }

    /// Match arguments for traffic from local pods.
    pub fn if_local(&self) -> Vec<String> {
        match self {
            LocalDetector::None => vec![],
            LocalDetector::Cidr(c) => vec!["-s".into(), c.clone()],
            LocalDetector::Bridge(b) => vec!["-i".into(), b.clone()],
            LocalDetector::InterfacePrefix(p) => vec!["-i".into(), format!("{p}+")],
        }
    }

    /// Match arguments for traffic not from local pods.
    pub fn if_not_local(&self) -> Vec<String> {
        let mut v = self.if_local();
        if !v.is_empty() {
            v.insert(0, "!".into());
        }
        v
    }
}

/// The validated, effective configuration.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub mode: ProxyMode,
    pub hostname_override: Option<String>,
    pub bind_address: Option<IpAddr>,
    pub cluster_cidrs: Vec<String>,
    pub detect_local_mode: DetectLocalMode,
    pub bridge_interface: String,
    pub interface_name_prefix: String,
    pub masquerade_all: bool,
    pub masquerade_bit: u8,
    pub localhost_node_ports: bool,
    pub node_port_addresses: Vec<String>,
    pub feature_gates: BTreeMap<String, bool>,
    pub node_ips: Vec<IpAddr>,
    /// How often the rules are checked and, after a failure, retried (upstream: 30s).
    pub sync_period: Duration,
    /// The shortest time between two syncs; bursts of changes are coalesced (upstream: 1s).
    pub min_sync_period: Duration,
    pub conntrack: crate::conntrack::ConntrackConfig,
    /// Non-fatal notes for the operator (unknown fields, flags ignored because of --config).
    pub warnings: Vec<String>,
}

impl ProxyConfig {
    /// Applies upstream's precedence: with `--config`, the file replaces every flag except
    /// `--hostname-override`; without it, flags over defaults.
    pub fn resolve(flags: &Flags) -> Result<ProxyConfig, ConfigError> {
        let mut warnings = Vec::new();
        let file = match &flags.config {
            Some(path) => {
                let cfg = load_file(Path::new(path))?;
                let ignored = ignored_flags(flags);
                if !ignored.is_empty() {
                    warnings.push(format!(
                        "--config is set, so these flags are ignored (as upstream does): {}",
                        ignored.join(", ")
                    ));
                }
                for key in cfg.unknown.keys() {
                    warnings.push(format!("config file {path}: unknown field {key:?} ignored"));
                }
                Some(cfg)
            }
            None => None,
        };
        let f = file.clone().unwrap_or_default();
        let from_file = file.is_some();
        // Either the file's value or the flag's, never a mix (upstream semantics).
        macro_rules! pick {
            ($file:expr, $flag:expr) => {
                if from_file { $file } else { $flag }
            };
        }

        let mode_raw = pick!(f.mode.clone(), flags.proxy_mode.clone()).unwrap_or_default();
        let mode = match mode_raw.as_str() {
            "" | "iptables" => ProxyMode::Iptables,
            "ipvs" => ProxyMode::Ipvs,
            "nftables" => ProxyMode::Nftables,
            other => {
                return Err(invalid(
                    field_name(from_file, "mode", "--proxy-mode"),
                    other,
                    "must be iptables, ipvs or nftables",
                ));
            }
        };

        let hostname_override = flags
            .hostname_override
            .clone()
            .or(f.hostname_override.clone())
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty());

        let bind_raw = pick!(f.bind_address.clone(), flags.bind_address.clone());
        let bind_address = match bind_raw.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(s.parse::<IpAddr>().map_err(|_| {
                invalid(
                    field_name(from_file, "bindAddress", "--bind-address"),
                    s,
                    "not an IP address",
                )
            })?),
        };

        let cluster_cidr_field = field_name(from_file, "clusterCIDR", "--cluster-cidr");
        let cluster_cidrs: Vec<String> = pick!(f.cluster_cidr.clone(), flags.cluster_cidr.clone())
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        for c in &cluster_cidrs {
            c.parse::<IpNet>()
                .map_err(|_| invalid(cluster_cidr_field, c, "not a CIDR"))?;
        }
        if cluster_cidrs.len() > 2 {
            return Err(invalid(
                cluster_cidr_field,
                cluster_cidrs.join(","),
                "at most one CIDR per IP family",
            ));
        }

        let dlm_raw = pick!(f.detect_local_mode.clone(), flags.detect_local_mode.clone()).unwrap_or_default();
        let detect_local_mode = match dlm_raw.as_str() {
            "" | "ClusterCIDR" => DetectLocalMode::ClusterCidr,
            "NodeCIDR" => DetectLocalMode::NodeCidr,
            "BridgeInterface" => DetectLocalMode::BridgeInterface,
            "InterfaceNamePrefix" => DetectLocalMode::InterfaceNamePrefix,
            other => {
                return Err(invalid(
                    field_name(from_file, "detectLocalMode", "--detect-local-mode"),
                    other,
                    "must be ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix",
                ));
            }
        };
        let bridge_interface = pick!(
            f.detect_local.bridge_interface.clone(),
            flags.pod_bridge_interface.clone()
        )
        .unwrap_or_default();
        let interface_name_prefix = pick!(
            f.detect_local.interface_name_prefix.clone(),
            flags.pod_interface_name_prefix.clone()
        )
        .unwrap_or_default();
        for (name, v) in [
            ("bridgeInterface", &bridge_interface),
            ("interfaceNamePrefix", &interface_name_prefix),
        ] {
            if !v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b)) || v.len() > 15 {
                return Err(invalid(&format!("detectLocal.{name}"), v, "not a valid interface name"));
            }
        }
        if detect_local_mode == DetectLocalMode::BridgeInterface && bridge_interface.is_empty() {
            return Err(invalid(
                field_name(from_file, "detectLocal.bridgeInterface", "--pod-bridge-interface"),
                "",
                "required with detectLocalMode BridgeInterface",
            ));
        }
        if detect_local_mode == DetectLocalMode::InterfaceNamePrefix && interface_name_prefix.is_empty() {
            return Err(invalid(
                field_name(
                    from_file, "detectLocal.interfaceNamePrefix", "--pod-interface-name-prefix",
                ),
                "",
                "required with detectLocalMode InterfaceNamePrefix",
            ));
        }

        let masquerade_all = pick!(f.iptables.masquerade_all, flags.masquerade_all).unwrap_or(false);
        let bit = pick!(f.iptables.masquerade_bit, flags.iptables_masquerade_bit).unwrap_or(14);
        if !(0..=31).contains(&bit) {
            return Err(invalid(
                field_name(from_file, "iptables.masqueradeBit", "--iptables-masquerade-bit"),
                bit,
                "must be in the range 0-31",
            ));
        }
        let localhost_node_ports =
            pick!(f.iptables.localhost_node_ports, flags.iptables_localhost_nodeports).unwrap_or(true);

        let npa_field = field_name(from_file, "nodePortAddresses", "--nodeport-addresses");
        let node_port_addresses: Vec<String> = pick!(f.node_port_addresses.clone(), flags.nodeport_addresses.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        for a in &node_port_addresses {
            if a != "primary" && a.parse::<IpNet>().is_err() {
                return Err(invalid(npa_field, a, "must be a CIDR or \"primary\""));
            }
        }

        let mut feature_gates = pick!(f.feature_gates.clone(), flags.feature_gates.clone());
        feature_gates
            .entry("PreferSameTrafficDistribution".into())
            .or_insert(true);

        let mut node_ips = Vec::new();
        for raw in &flags.node_ips {
            for part in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                node_ips.push(
                    part.parse::<IpAddr>()
                        .map_err(|_| invalid("--node-ip", part, "not an IP address"))?,
                );
            }
        }

        let duration = |field: &str, flag: &str, file_v: Option<String>, flag_v: Option<String>, default: Duration| {
            let (name, raw) = if from_file { (field, file_v) } else { (flag, flag_v) };
            match raw {
                None => Ok(default),
                Some(r) => parse_duration(&r).map_err(|reason| invalid(name, &r, &reason)),
            }
        };
        let sync_period = duration(
            "iptables.syncPeriod",
            "--iptables-sync-period",
            f.iptables.sync_period.clone(),
            flags.iptables_sync_period.clone(),
            Duration::from_secs(30),
        )?;
        let min_sync_period = duration(
            "iptables.minSyncPeriod",
            "--iptables-min-sync-period",
            f.iptables.min_sync_period.clone(),
            flags.iptables_min_sync_period.clone(),
            Duration::from_secs(1),
        )?;
        if sync_period.is_zero() {
            return Err(invalid(
                field_name(from_file, "iptables.syncPeriod", "--iptables-sync-period"),
                "0s",
                "must be greater than 0",
            ));
        }
        let count = |field: &str, flag: &str, file_v: Option<i64>, flag_v: Option<i64>, default: u32| {
            let (name, raw) = if from_file { (field, file_v) } else { (flag, flag_v) };
            match raw {
                None => Ok(default),
                Some(v) if (0..=i64::from(u32::MAX)).contains(&v) => Ok(v as u32),
                Some(v) => Err(invalid(name, v, "must be a non-negative integer")),
            }
        };
        let ct = &f.conntrack;
        let conntrack = crate::conntrack::ConntrackConfig {
            max_per_core: count(
                "conntrack.maxPerCore", "--conntrack-max-per-core", ct.max_per_core, flags.conntrack_max_per_core,
                32768,
            )?,
            min: count("conntrack.min", "--conntrack-min", ct.min, flags.conntrack_min, 131072)?,
            tcp_established_timeout: duration(
                "conntrack.tcpEstablishedTimeout",
                "--conntrack-tcp-timeout-established",
                ct.tcp_established_timeout.clone(),
                flags.conntrack_tcp_timeout_established.clone(),
                Duration::from_secs(24 * 3600),
            )?,
            tcp_close_wait_timeout: duration(
                "conntrack.tcpCloseWaitTimeout",
                "--conntrack-tcp-timeout-close-wait",
                ct.tcp_close_wait_timeout.clone(),
                flags.conntrack_tcp_timeout_close_wait.clone(),
                Duration::from_secs(3600),
            )?,
            tcp_be_liberal: pick!(ct.tcp_be_liberal, flags.conntrack_tcp_be_liberal).unwrap_or(false),
            udp_timeout: duration(
                "conntrack.udpTimeout",
                "--conntrack-udp-timeout",
                ct.udp_timeout.clone(),
                flags.conntrack_udp_timeout.clone(),
                Duration::ZERO,
            )?,
            udp_stream_timeout: duration(
                "conntrack.udpStreamTimeout",
                "--conntrack-udp-timeout-stream",
                ct.udp_stream_timeout.clone(),
                flags.conntrack_udp_timeout_stream.clone(),
                Duration::ZERO,
            )?,
        };

        Ok(ProxyConfig {
            sync_period,
            min_sync_period,
            conntrack,
            mode,
            hostname_override,
            bind_address,
            cluster_cidrs,
            detect_local_mode,
            bridge_interface,
            interface_name_prefix,
            masquerade_all,
            masquerade_bit: bit as u8,
            localhost_node_ports,
            node_port_addresses,
            feature_gates,
            node_ips,
            warnings,
        })
    }

    /// The node name: `hostnameOverride`, else the machine's hostname, lower-cased (upstream).
    pub fn node_name(&self) -> String {
        match &self.hostname_override {
            Some(h) => h.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_lowercase())
                .unwrap_or_default(),
        }
    }

    pub fn feature_enabled(&self, gate: &str) -> bool {
        self.feature_gates.get(gate).copied().unwrap_or(false)
    }

    /// The local-traffic detector of one family (upstream's `getLocalDetectors`).
    pub fn local_detector(&self, family: IpFamily, node: &NodeInfo) -> LocalDetector {
        let cidr_of_family = |cidrs: &[String]| {
            cidrs
                .iter()
                .find(|c| c.parse::<IpNet>().is_ok_and(|n| family.contains(&n.addr())))
                .cloned()
        };
        match self.detect_local_mode {
            DetectLocalMode::ClusterCidr => {
                cidr_of_family(&self.cluster_cidrs).map_or(LocalDetector::None, LocalDetector::Cidr)
            }
            DetectLocalMode::NodeCidr => {
                cidr_of_family(&node.pod_cidrs).map_or(LocalDetector::None, LocalDetector::Cidr)
            }
            DetectLocalMode::BridgeInterface => LocalDetector::Bridge(self.bridge_interface.clone()),
            DetectLocalMode::InterfaceNamePrefix => LocalDetector::InterfacePrefix(self.interface_name_prefix.clone()),
        }
    }
}

/// Parses a Go `time.Duration` string: `300ms`, `1.5s`, `1m0s`, `2h45m`, `0`.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let s = raw.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return Err("not a duration like 30s, 1m0s or 500ms".into());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        let value: f64 = num
            .parse()
            .map_err(|_| "not a duration like 30s, 1m0s or 500ms".to_string())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(format!("unknown unit {unit:?} (use ns, us, ms, s, m or h)")),
        };
        total += value * scale;
        rest = tail;
    }
    Ok(Duration::from_secs_f64(total))
}

fn field_name(from_file: bool, field: &'static str, flag: &'static str) -> &'static str {
    if from_file { field } else { flag }
}

fn ignored_flags(flags: &Flags) -> Vec<&'static str> {
    let mut v = Vec::new();
    let checks: [(&'static str, bool); 20] = [
        ("--iptables-sync-period", flags.iptables_sync_period.is_some()),
        ("--iptables-min-sync-period", flags.iptables_min_sync_period.is_some()),
        ("--conntrack-max-per-core", flags.conntrack_max_per_core.is_some()),
        ("--conntrack-min", flags.conntrack_min.is_some()),
        (
            "--conntrack-tcp-timeout-established",
            flags.conntrack_tcp_timeout_established.is_some(),
        ),
        (
            "--conntrack-tcp-timeout-close-wait",
            flags.conntrack_tcp_timeout_close_wait.is_some(),
        ),
        ("--conntrack-tcp-be-liberal", flags.conntrack_tcp_be_liberal.is_some()),
        ("--conntrack-udp-timeout", flags.conntrack_udp_timeout.is_some()),
        (
            "--conntrack-udp-timeout-stream",
            flags.conntrack_udp_timeout_stream.is_some(),
        ),
        ("--proxy-mode", flags.proxy_mode.is_some()),
        ("--bind-address", flags.bind_address.is_some()),
        ("--cluster-cidr", flags.cluster_cidr.is_some()),
        ("--detect-local-mode", flags.detect_local_mode.is_some()),
        ("--pod-bridge-interface", flags.pod_bridge_interface.is_some()),
        ("--pod-interface-name-prefix", flags.pod_interface_name_prefix.is_some()),
        ("--masquerade-all", flags.masquerade_all.is_some()),
        ("--nodeport-addresses", flags.nodeport_addresses.is_some()),
        ("--iptables-masquerade-bit", flags.iptables_masquerade_bit.is_some()),
        (
            "--iptables-localhost-nodeports",
            flags.iptables_localhost_nodeports.is_some(),
        ),
        ("--feature-gates", !flags.feature_gates.is_empty()),
    ];
    for (name, set) in checks {
        if set {
            v.push(name);
        }
    }
    v
}

/// Reads a KubeProxyConfiguration file (YAML or JSON).
pub fn load_file(path: &Path) -> Result<KubeProxyConfiguration, ConfigError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: p.clone(),
        source,
    })?;
    parse_config(&p, &text)
}

pub fn parse_config(path: &str, text: &str) -> Result<KubeProxyConfiguration, ConfigError> {
    let value: serde_json::Value = serde_saphyr::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_string(),
        message: e.to_string().lines().next().unwrap_or("").to_string(),
    })?;
    let cfg: KubeProxyConfiguration = serde_path_to_error::deserialize(value).map_err(|e| ConfigError::Parse {
        path: path.to_string(),
        message: format!("field {}: {}", e.path(), e.inner()),
    })?;
    match (cfg.api_version.as_deref(), cfg.kind.as_deref()) {
        (Some("kubeproxy.config.k8s.io/v1alpha1"), Some("KubeProxyConfiguration")) => Ok(cfg),
        (a, k) => Err(ConfigError::Parse {
            path: path.to_string(),
            message: format!(
                "expected apiVersion kubeproxy.config.k8s.io/v1alpha1 and kind KubeProxyConfiguration, got {} {}",
                a.unwrap_or("<none>"),
                k.unwrap_or("<none>")
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_config(text: &str) -> (std::path::PathBuf, Flags) {
        let dir = std::env::temp_dir().join(format!("kp-cfg-{}-{}", std::process::id(), text.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.yaml");
        std::fs::write(&path, text).unwrap();
        let flags = Flags {
            config: Some(path.display().to_string()),
            ..Flags::default()
        };
        (dir, flags)
    }

    #[test]
    fn defaults_without_flags() {
        let c = ProxyConfig::resolve(&Flags::default()).unwrap();
        assert_eq!(c.mode, ProxyMode::Iptables);
        assert_eq!(c.masquerade_bit, 14);
        assert!(c.localhost_node_ports);
        assert!(!c.masquerade_all);
        assert_eq!(c.detect_local_mode, DetectLocalMode::ClusterCidr);
    }

    #[test]
    fn config_file_replaces_flags_but_not_hostname_override() {
        let (dir, mut flags) = write_config(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nhostnameOverride: from-file\nclusterCIDR: 10.0.0.0/8\niptables:\n  masqueradeBit: 5\n",
        );
        flags.masquerade_all = Some(true);
        flags.iptables_masquerade_bit = Some(7);
        flags.hostname_override = Some("from-flag".into());
        let c = ProxyConfig::resolve(&flags).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        assert_eq!(c.masquerade_bit, 5);
        assert!(!c.masquerade_all, "flags are ignored when --config is given");
        assert_eq!(c.node_name(), "from-flag");
        assert_eq!(c.cluster_cidrs, vec!["10.0.0.0/8"]);
        assert!(c.warnings.iter().any(|w| w.contains("--masquerade-all")));
    }

    #[test]
    fn invalid_values_name_field_and_value() {
        let flags = Flags {
            iptables_masquerade_bit: Some(40),
            ..Flags::default()
        };
        let e = ProxyConfig::resolve(&flags).unwrap_err().to_string();
        assert!(e.contains("--iptables-masquerade-bit") && e.contains("40"), "{e}");
        let flags = Flags {
            cluster_cidr: Some("10.0.0.0/33".into()),
            ..Flags::default()
        };
        let e = ProxyConfig::resolve(&flags).unwrap_err().to_string();
        assert!(e.contains("--cluster-cidr") && e.contains("10.0.0.0/33"), "{e}");
        let (dir, flags) = write_config(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: userspace\n",
        );
        let e = ProxyConfig::resolve(&flags).unwrap_err().to_string();
        std::fs::remove_dir_all(dir).unwrap();
        assert!(e.contains("mode") && e.contains("userspace"), "{e}");
    }

    #[test]
    fn durations_parse_like_go() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1m0s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("30").is_err() && parse_duration("-1s").is_err() && parse_duration("1x").is_err());
        let e = ProxyConfig::resolve(&Flags {
            iptables_sync_period: Some("soon".into()),
            ..Flags::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--iptables-sync-period") && e.contains("soon"), "{e}");
    }

    #[test]
    fn unknown_fields_warn() {
        let (dir, flags) =
            write_config("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nfrobnicate: 1\n");
        let c = ProxyConfig::resolve(&flags).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        assert!(c.warnings.iter().any(|w| w.contains("frobnicate")));
    }

    #[test]
    fn detectors() {
        let node = NodeInfo {
            pod_cidrs: vec!["10.244.1.0/24".into(), "fd00:1::/64".into()],
            ..NodeInfo::default()
        };
        let mut c = ProxyConfig::resolve(&Flags {
            cluster_cidr: Some("10.0.0.0/8,fd00::/48".into()),
            ..Flags::default()
        })
        .unwrap();
        assert_eq!(
            c.local_detector(IpFamily::V6, &node).if_not_local(),
            vec!["!", "-s", "fd00::/48"]
        );
        c.detect_local_mode = DetectLocalMode::NodeCidr;
        assert_eq!(
            c.local_detector(IpFamily::V4, &node).if_local(),
            vec!["-s", "10.244.1.0/24"]
        );
        c.detect_local_mode = DetectLocalMode::InterfaceNamePrefix;
        c.interface_name_prefix = "veth".into();
        assert_eq!(c.local_detector(IpFamily::V4, &node).if_local(), vec!["-i", "veth+"]);
    }
}
