//! The typed, effective settings the rest of the program reads: [`ProxyConfig`] and its parts
//! (proxy mode, local-traffic detection, API client, IPVS and logging settings).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

use super::file::KubeProxyConfiguration;
use crate::model::{IpFamily, NodeInfo};

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

    /// The configuration's `mode` (empty means iptables, upstream's Linux default).
    pub fn parse(s: &str) -> Option<ProxyMode> {
        match s {
            "" | "iptables" => Some(ProxyMode::Iptables),
            "ipvs" => Some(ProxyMode::Ipvs),
            "nftables" => Some(ProxyMode::Nftables),
            _ => None,
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

impl DetectLocalMode {
    pub fn parse(s: &str) -> Option<DetectLocalMode> {
        match s {
            "" | "ClusterCIDR" => Some(DetectLocalMode::ClusterCidr),
            "NodeCIDR" => Some(DetectLocalMode::NodeCidr),
            "BridgeInterface" => Some(DetectLocalMode::BridgeInterface),
            "InterfaceNamePrefix" => Some(DetectLocalMode::InterfaceNamePrefix),
            _ => None,
        }
    }
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

/// How to reach the API server: `clientConnection` plus `--master`.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientConnection {
    /// `--kubeconfig` / `clientConnection.kubeconfig`; None: in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    /// `--master`: overrides the kubeconfig's server (kept even with `--config`).
    pub master: Option<String>,
    /// `clientConnection.acceptContentTypes` (not used by kube-proxy-rs; warned about).
    pub accept_content_types: String,
    /// `--kube-api-content-type` (default `application/vnd.kubernetes.protobuf`).
    pub content_type: String,
    /// `--kube-api-qps` (default 5).
    pub qps: f32,
    /// `--kube-api-burst` (default 10).
    pub burst: i32,
}

/// The `ipvs` settings (validated in IPVS mode and reported as ignored in the others).
#[derive(Clone, Debug, PartialEq)]
pub struct IpvsConfig {
    pub scheduler: String,
    pub exclude_cidrs: Vec<IpNet>,
    pub strict_arp: bool,
    pub tcp_timeout: Duration,
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
}

/// Log output format (`--logging-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// klog's text lines (default).
    #[default]
    Text,
    /// component-base's JSON lines.
    Json,
}

/// The effective logging settings (component-base `LoggingConfiguration`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoggingConfig {
    pub format: LogFormat,
    /// `-v`: 0–1 info, 2–3 debug, 4+ trace (see [`crate::logging`]).
    pub verbosity: u32,
    /// `--vmodule`: (file pattern, verbosity) overrides, first match wins.
    pub vmodule: Vec<(String, u32)>,
    /// `--log-flush-frequency` (lines are written unbuffered, so this is an upper bound kept).
    pub flush_frequency: Duration,
    /// `--log-{text,json}-split-stream` of the chosen format: errors to stderr, the rest to stdout.
    pub split_stream: bool,
    /// `--log-{text,json}-info-buffer-size` of the chosen format (not implemented; warned about).
    pub info_buffer_size: u64,
}

/// The `--config` file as it was read: the daemon's config-file watch compares the file with
/// `content` and exits when it differs (upstream restarts to apply a changed configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigFile {
    /// The path as given (not resolved: a ConfigMap volume swaps the symlinks behind it).
    pub path: PathBuf,
    pub content: Vec<u8>,
}

/// The validated, effective configuration.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub mode: ProxyMode,
    /// The node name override, trimmed and lower-cased (upstream's `GetHostname`).
    pub hostname_override: Option<String>,
    /// `bindAddress` when it names a specific IP (the node's primary IP override); None for
    /// the unspecified defaults `0.0.0.0` / `::`.
    pub bind_address: Option<IpAddr>,
    pub cluster_cidrs: Vec<String>,
    pub detect_local_mode: DetectLocalMode,
    pub bridge_interface: String,
    pub interface_name_prefix: String,
    pub masquerade_all: bool,
    pub masquerade_bit: u8,
    pub localhost_node_ports: bool,
    pub node_port_addresses: Vec<String>,
    /// The effective feature gates: the configured ones plus the defaults of those kube-proxy-rs honours.
    pub feature_gates: BTreeMap<String, bool>,
    pub node_ips: Vec<IpAddr>,
    /// How often the rules are checked and, after a failure, retried (upstream: 30s).
    pub sync_period: Duration,
    /// The shortest time between two syncs; bursts of changes are coalesced (upstream: 1s).
    pub min_sync_period: Duration,
    pub conntrack: crate::conntrack::ConntrackConfig,
    /// The health check server's address (`healthzBindAddress`); None: disabled (empty value,
    /// `--healthz-port=0`, or port 0).
    pub healthz_bind_address: Option<SocketAddr>,
    /// The metrics server's address (`metricsBindAddress`); None: disabled.
    pub metrics_bind_address: Option<SocketAddr>,
    /// Exit when the healthz or metrics server cannot bind (`bindAddressHardFail`).
    pub bind_address_hard_fail: bool,
    /// `enableProfiling` (not implemented; warned about).
    pub enable_profiling: bool,
    /// `showHiddenMetricsForVersion` (not implemented; warned about).
    pub show_hidden_metrics_for_version: Option<String>,
    pub client_connection: ClientConnection,
    /// `configSyncPeriod`: upstream's informer resync period (default 15m).
    pub config_sync_period: Duration,
    /// `oomScoreAdj` (default -999), written to /proc/self/oom_score_adj at daemon start.
    pub oom_score_adj: i32,
    pub ipvs: IpvsConfig,
    pub logging: LoggingConfig,
    /// `--config`, when given: the file and the bytes the configuration was read from.
    pub config_file: Option<ConfigFile>,
    /// The effective v1alpha1 object (defaults + flags, or the file), as `--write-config-to` writes it.
    pub effective: KubeProxyConfiguration,
    /// Non-fatal notes for the operator (unknown fields, flags ignored because of --config,
    /// settings accepted but not implemented), one per setting.
    pub warnings: Vec<String>,
}

impl ProxyConfig {
    /// The effective configuration as a v1alpha1 YAML document (`--write-config-to`).
    pub fn to_yaml(&self) -> Result<String, String> {
        self.effective.to_yaml()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Flags;

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
