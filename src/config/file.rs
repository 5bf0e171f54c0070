//! The v1alpha1 wire format: `KubeProxyConfiguration` and its sections, every field typed,
//! read leniently as upstream does; upstream's v1alpha1 and Linux platform defaults; reading
//! a configuration file.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::go::{GoDuration, Quantity, TimeOrMetaDuration};
use super::{API_VERSION, ConfigError, DEFAULT_OOM_SCORE_ADJ, HEALTHZ_PORT, KIND, METRICS_PORT};

/// Go decodes `null` into a non-pointer field as its zero value.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Go writes a float32 with the shortest representation (`5`, `7.5`, `0.1`).
fn serialize_f32<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        s.serialize_i64(*v as i64)
    } else {
        s.serialize_f64(v.to_string().parse::<f64>().unwrap_or(f64::from(*v)))
    }
}

/// `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1), every field typed. `null` is
/// read as the zero value and unknown fields are kept aside (and reported), as upstream's
/// lenient decoding does. Pointer fields of the Go type are `Option`s.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, deserialize_with = "nullable", skip_serializing_if = "BTreeMap::is_empty")]
    pub feature_gates: BTreeMap<String, bool>,
    #[serde(default, deserialize_with = "nullable")]
    pub client_connection: ClientConnectionConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub logging: LoggingConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub hostname_override: String,
    #[serde(default, deserialize_with = "nullable")]
    pub bind_address: String,
    #[serde(default, deserialize_with = "nullable")]
    pub healthz_bind_address: String,
    #[serde(default, deserialize_with = "nullable")]
    pub metrics_bind_address: String,
    #[serde(default, deserialize_with = "nullable")]
    pub bind_address_hard_fail: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub enable_profiling: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub show_hidden_metrics_for_version: String,
    #[serde(default, deserialize_with = "nullable")]
    pub mode: String,
    #[serde(default, deserialize_with = "nullable")]
    pub iptables: KubeProxyIPTablesConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub ipvs: KubeProxyIPVSConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub nftables: KubeProxyNFTablesConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub winkernel: KubeProxyWinkernelConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub detect_local_mode: String,
    #[serde(default, deserialize_with = "nullable")]
    pub detect_local: DetectLocalConfiguration,
    #[serde(default, rename = "clusterCIDR", deserialize_with = "nullable")]
    pub cluster_cidr: String,
    #[serde(default)]
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(default)]
    pub oom_score_adj: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub conntrack: KubeProxyConntrackConfiguration,
    #[serde(default, deserialize_with = "nullable")]
    pub config_sync_period: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub port_range: String,
    #[serde(default, deserialize_with = "nullable", skip_serializing_if = "is_false")]
    pub windows_run_as_service: bool,
    /// Anything else: reported as a warning, as upstream's lenient decoding does.
    #[serde(flatten, skip_serializing)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

/// component-base's `ClientConnectionConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnectionConfiguration {
    #[serde(default, deserialize_with = "nullable")]
    pub kubeconfig: String,
    #[serde(default, deserialize_with = "nullable")]
    pub accept_content_types: String,
    #[serde(default, deserialize_with = "nullable")]
    pub content_type: String,
    #[serde(default, deserialize_with = "nullable", serialize_with = "serialize_f32")]
    pub qps: f32,
    #[serde(default, deserialize_with = "nullable")]
    pub burst: i32,
}

/// component-base's `LoggingConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoggingConfiguration {
    #[serde(default, deserialize_with = "nullable", skip_serializing_if = "String::is_empty")]
    pub format: String,
    #[serde(default, deserialize_with = "nullable")]
    pub flush_frequency: TimeOrMetaDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub verbosity: u32,
    #[serde(default, deserialize_with = "nullable", skip_serializing_if = "Vec::is_empty")]
    pub vmodule: Vec<VModuleItem>,
    #[serde(default, deserialize_with = "nullable")]
    pub options: FormatOptions,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VModuleItem {
    #[serde(default, deserialize_with = "nullable")]
    pub file_pattern: String,
    #[serde(default, deserialize_with = "nullable")]
    pub verbosity: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct FormatOptions {
    #[serde(default, deserialize_with = "nullable")]
    pub text: OutputRoutingOptions,
    #[serde(default, deserialize_with = "nullable")]
    pub json: OutputRoutingOptions,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OutputRoutingOptions {
    #[serde(default, deserialize_with = "nullable", skip_serializing_if = "is_false")]
    pub split_stream: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub info_buffer_size: Quantity,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyIPTablesConfiguration {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub masquerade_all: bool,
    #[serde(default)]
    pub localhost_node_ports: Option<bool>,
    #[serde(default, deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyIPVSConfiguration {
    #[serde(default, deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub scheduler: String,
    #[serde(default, rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(default, rename = "strictARP", deserialize_with = "nullable")]
    pub strict_arp: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub tcp_timeout: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub tcp_fin_timeout: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyNFTablesConfiguration {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub masquerade_all: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
}

/// Windows only; accepted and reported as ignored on Linux.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyWinkernelConfiguration {
    #[serde(default, deserialize_with = "nullable")]
    pub network_name: String,
    #[serde(default, deserialize_with = "nullable")]
    pub source_vip: String,
    #[serde(default, rename = "enableDSR", deserialize_with = "nullable")]
    pub enable_dsr: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub root_hns_endpoint_name: String,
    #[serde(default, deserialize_with = "nullable")]
    pub forward_health_check_vip: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocalConfiguration {
    #[serde(default, deserialize_with = "nullable")]
    pub bridge_interface: String,
    #[serde(default, deserialize_with = "nullable")]
    pub interface_name_prefix: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConntrackConfiguration {
    #[serde(default)]
    pub max_per_core: Option<i32>,
    #[serde(default)]
    pub min: Option<i32>,
    #[serde(default)]
    pub tcp_established_timeout: Option<GoDuration>,
    #[serde(default)]
    pub tcp_close_wait_timeout: Option<GoDuration>,
    #[serde(default, deserialize_with = "nullable")]
    pub tcp_be_liberal: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
    #[serde(default, deserialize_with = "nullable")]
    pub udp_stream_timeout: GoDuration,
}

/// Upstream's `AppendPortIfNeeded`: `ip` → `ip:port` / `[ip]:port`; anything else unchanged.
pub(super) fn append_port_if_needed(addr: &str, port: u16) -> String {
    if split_host_port(addr).is_some() {
        return addr.to_string();
    }
    match addr.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => format!("{addr}:{port}"),
        Ok(IpAddr::V6(_)) => format!("[{addr}]:{port}"),
        Err(_) => addr.to_string(),
    }
}

/// Go's `net.SplitHostPort` for the forms that matter here: `host:port`, `[v6]:port`.
pub(super) fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        let port = tail.strip_prefix(':')?;
        return (!port.contains(':')).then_some((host, port));
    }
    let (host, port) = s.rsplit_once(':')?;
    (!host.contains(':')).then_some((host, port))
}

impl KubeProxyConfiguration {
    /// Upstream's `SetDefaults_KubeProxyConfiguration` (v1alpha1).
    pub fn apply_defaults(&mut self) {
        if self.bind_address.is_empty() {
            self.bind_address = "0.0.0.0".into();
        }
        let (healthz_host, metrics_host) = match self.bind_address.parse::<IpAddr>() {
            Ok(IpAddr::V4(_)) => ("0.0.0.0", "127.0.0.1"),
            Ok(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_some() => ("0.0.0.0", "127.0.0.1"),
            _ => ("[::]", "[::1]"),
        };
        self.healthz_bind_address = if self.healthz_bind_address.is_empty() {
            format!("{healthz_host}:{HEALTHZ_PORT}")
        } else {
            append_port_if_needed(&self.healthz_bind_address, HEALTHZ_PORT)
        };
        self.metrics_bind_address = if self.metrics_bind_address.is_empty() {
            format!("{metrics_host}:{METRICS_PORT}")
        } else {
            append_port_if_needed(&self.metrics_bind_address, METRICS_PORT)
        };
        self.oom_score_adj.get_or_insert(DEFAULT_OOM_SCORE_ADJ);
        let ipt = &mut self.iptables;
        if ipt.sync_period.0 == 0 {
            ipt.sync_period = GoDuration::from_secs(30);
        }
        if ipt.min_sync_period.0 == 0 {
            ipt.min_sync_period = GoDuration::from_secs(1);
        }
        ipt.localhost_node_ports.get_or_insert(true);
        ipt.masquerade_bit.get_or_insert(14);
        if self.ipvs.sync_period.0 == 0 {
            self.ipvs.sync_period = GoDuration::from_secs(30);
        }
        let nft = &mut self.nftables;
        if nft.sync_period.0 == 0 {
            nft.sync_period = GoDuration::from_secs(30);
        }
        if nft.min_sync_period.0 == 0 {
            nft.min_sync_period = GoDuration::from_secs(1);
        }
        nft.masquerade_bit.get_or_insert(14);
        let ct = &mut self.conntrack;
        ct.max_per_core.get_or_insert(32 * 1024);
        ct.min.get_or_insert(128 * 1024);
        ct.tcp_established_timeout
            .get_or_insert(GoDuration::from_secs(24 * 3600));
        ct.tcp_close_wait_timeout.get_or_insert(GoDuration::from_secs(3600));
        if self.config_sync_period.0 == 0 {
            self.config_sync_period = GoDuration::from_secs(15 * 60);
        }
        let cc = &mut self.client_connection;
        if cc.content_type.is_empty() {
            cc.content_type = "application/vnd.kubernetes.protobuf".into();
        }
        if cc.qps == 0.0 {
            cc.qps = 5.0;
        }
        if cc.burst == 0 {
            cc.burst = 10;
        }
        // component-base's SetRecommendedLoggingConfiguration.
        let log = &mut self.logging;
        if log.format.is_empty() {
            log.format = "text".into();
        }
        if log.flush_frequency.duration.0 == 0 {
            log.flush_frequency = TimeOrMetaDuration {
                duration: GoDuration::from_secs(5),
                serialize_as_string: true,
            };
        }
        for o in [&mut log.options.text, &mut log.options.json] {
            if o.info_buffer_size.0.is_empty() {
                o.info_buffer_size = Quantity::default();
            }
        }
    }

    /// Upstream's Linux `platformApplyDefaults`, after flags and file.
    pub fn apply_platform_defaults(&mut self) {
        if self.mode.is_empty() {
            self.mode = "iptables".into();
        }
        if self.mode == "nftables" && self.node_port_addresses.as_ref().is_none_or(Vec::is_empty) {
            self.node_port_addresses = Some(vec!["primary".into()]);
        }
        if self.detect_local_mode.is_empty() {
            self.detect_local_mode = "ClusterCIDR".into();
        }
    }

    /// The defaults as `--write-config-to` without flags writes them.
    pub fn defaults() -> KubeProxyConfiguration {
        let mut c = KubeProxyConfiguration::default();
        c.apply_defaults();
        c.apply_platform_defaults();
        c.api_version = Some(API_VERSION.into());
        c.kind = Some(KIND.into());
        c
    }

    /// This configuration as a v1alpha1 YAML document (keys sorted, as upstream's encoder).
    pub fn to_yaml(&self) -> Result<String, String> {
        let value = serde_json::to_value(self).map_err(|e| e.to_string())?;
        serde_saphyr::to_string(&value).map_err(|e| e.to_string())
    }
}

/// Reads a KubeProxyConfiguration file (YAML or JSON).
pub fn load_file(path: &Path) -> Result<KubeProxyConfiguration, ConfigError> {
    read_file(path).map(|(_, cfg)| cfg)
}

/// Reads a KubeProxyConfiguration file, keeping the text it was parsed from.
pub fn read_file(path: &Path) -> Result<(String, KubeProxyConfiguration), ConfigError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read { path: p.clone(), error })?;
    let cfg = parse_config(&p, &text)?;
    Ok((text, cfg))
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
        (Some(API_VERSION), Some(KIND)) => Ok(cfg),
        (a, k) => Err(ConfigError::Parse {
            path: path.to_string(),
            message: format!(
                "expected apiVersion {API_VERSION} and kind {KIND}, got {} {}",
                a.unwrap_or("<none>"),
                k.unwrap_or("<none>")
            ),
        }),
    }
}
