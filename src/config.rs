//! Configuration: upstream's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1) file,
//! upstream's command-line flags, and upstream's precedence between them.
//!
//! * Without `--config`: upstream's v1alpha1 defaults, then the flags on top.
//! * With `--config FILE`: the file (with the v1alpha1 defaults for what it leaves out)
//!   replaces every flag, except the logging flags (merged in, flags win), `--hostname-override`
//!   (applied after loading) and `--master`; the ignored flags are named in one warning.
//! * Then upstream's Linux platform defaults (`mode` → iptables, `detectLocalMode` →
//!   ClusterCIDR, `nodePortAddresses` → `[primary]` in nftables mode).
//!
//! The result is kept twice: as the effective v1alpha1 object ([`ProxyConfig::effective`],
//! what `--write-config-to` writes) and as typed settings for the rest of the program.
//! Validation follows upstream's `validation.go` and happens here, before anything touches a
//! node; every error names the flag (or, for a config file, the field and the file) and the
//! value. Settings that kube-proxy-rs accepts but does not implement produce exactly one
//! warning each in [`ProxyConfig::warnings`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::model::{IpFamily, NodeInfo};

/// `apiVersion` of the configuration file.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// `kind` of the configuration file.
pub const KIND: &str = "KubeProxyConfiguration";
/// Upstream's `ports.ProxyHealthzPort`.
pub const HEALTHZ_PORT: u16 = 10256;
/// Upstream's `ports.ProxyStatusPort` (metrics).
pub const METRICS_PORT: u16 = 10249;
/// Upstream's `qos.KubeProxyOOMScoreAdj`.
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;

/// Errors in configuration; fatal: the caller exits non-zero before changing anything.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    /// A value given on the command line (`field` is the flag), or a value of the
    /// configuration without a file (`field` is the field path).
    #[error("invalid value {value:?} for {field}: {reason}")]
    Invalid {
        field: String,
        value: String,
        reason: String,
    },
    /// An invalid value in the config file.
    #[error("config file {path}: invalid value {value:?} for {field}: {reason}")]
    InFile {
        path: String,
        field: String,
        value: String,
        reason: String,
    },
    /// Several of the above (upstream reports every validation error at once).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Many(Vec<ConfigError>),
}

fn invalid(field: &str, value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Go value types of the wire format
// ---------------------------------------------------------------------------------------------

/// A Go `time.Duration` (`metav1.Duration` on the wire): signed nanoseconds, parsed and written
/// as Go does (`"30s"`, `"1m0s"`, `"24h0m0s"`, `"500ms"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub i64);

const NS_PER_SEC: i64 = 1_000_000_000;

impl GoDuration {
    pub const ZERO: GoDuration = GoDuration(0);

    pub const fn from_secs(s: i64) -> GoDuration {
        GoDuration(s * NS_PER_SEC)
    }

    /// Go's `time.ParseDuration`: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, or `0`.
    pub fn parse(raw: &str) -> Result<GoDuration, String> {
        let bad = || format!("time: invalid duration {raw:?} (use e.g. 30s, 1m0s, 500ms or 2h45m)");
        let mut s = raw;
        let negative = match s.as_bytes().first() {
            Some(b'-') => {
                s = &s[1..];
                true
            }
            Some(b'+') => {
                s = &s[1..];
                false
            }
            _ => false,
        };
        if s == "0" {
            return Ok(GoDuration(0));
        }
        if s.is_empty() {
            return Err(bad());
        }
        let mut total: i128 = 0;
        while !s.is_empty() {
            let int_len = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (int_part, rest) = s.split_at(int_len);
            let (frac_part, rest) = match rest.strip_prefix('.') {
                Some(r) => {
                    let n = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
                    r.split_at(n)
                }
                None => ("", rest),
            };
            if int_part.is_empty() && frac_part.is_empty() {
                return Err(bad());
            }
            let unit_len = rest
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(rest.len());
            let (unit, rest) = rest.split_at(unit_len);
            let scale: i128 = match unit {
                "ns" => 1,
                "us" | "µs" | "μs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                "" => return Err(format!("time: missing unit in duration {raw:?} (use e.g. 30s)")),
                other => {
                    return Err(format!(
                        "time: unknown unit {other:?} in duration {raw:?} (use ns, us, ms, s, m or h)"
                    ));
                }
            };
            let int: i128 = if int_part.is_empty() {
                0
            } else {
                int_part.parse().map_err(|_| bad())?
            };
            let mut frac: i128 = 0;
            let mut frac_scale: i128 = 1;
            for d in frac_part.bytes().take(18) {
                frac = frac * 10 + i128::from(d - b'0');
                frac_scale *= 10;
            }
            total = int
                .checked_mul(scale)
                .and_then(|v| v.checked_add(frac * scale / frac_scale))
                .and_then(|v| total.checked_add(v))
                .filter(|v| *v <= i128::from(i64::MAX))
                .ok_or_else(bad)?;
            s = rest;
        }
        let total = total as i64;
        Ok(GoDuration(if negative { -total } else { total }))
    }

    pub fn is_negative(self) -> bool {
        self.0 < 0
    }

    /// The duration, with negative values as zero (validation rejects them first).
    pub fn to_std(self) -> Duration {
        Duration::from_nanos(self.0.max(0) as u64)
    }

    pub fn from_std(d: Duration) -> GoDuration {
        GoDuration(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    }
}

/// Go's `Duration.String()`.
impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let neg = self.0 < 0;
        let u = self.0.unsigned_abs();
        let sign = if neg { "-" } else { "" };
        if u == 0 {
            return f.write_str("0s");
        }
        // The fraction of `v / 10^prec`, without trailing zeros.
        fn frac(v: u64, prec: u32) -> String {
            let p = 10u64.pow(prec);
            let (whole, rem) = (v / p, v % p);
            if rem == 0 {
                return whole.to_string();
            }
            let digits = format!("{rem:0width$}", width = prec as usize);
            format!("{whole}.{}", digits.trim_end_matches('0'))
        }
        if u < 1_000_000_000 {
            return if u < 1_000 {
                write!(f, "{sign}{u}ns")
            } else if u < 1_000_000 {
                write!(f, "{sign}{}µs", frac(u, 3))
            } else {
                write!(f, "{sign}{}ms", frac(u, 6))
            };
        }
        let secs_total = u / 1_000_000_000;
        let nanos = u % 1_000_000_000;
        let secs = frac((secs_total % 60) * 1_000_000_000 + nanos, 9);
        let mins_total = secs_total / 60;
        if mins_total == 0 {
            return write!(f, "{sign}{secs}s");
        }
        let (hours, mins) = (mins_total / 60, mins_total % 60);
        if hours == 0 {
            write!(f, "{sign}{mins}m{secs}s")
        } else {
            write!(f, "{sign}{hours}h{mins}m{secs}s")
        }
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(GoDuration(0)),
            Some(s) => GoDuration::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// component-base's `TimeOrMetaDuration` (`logging.flushFrequency`): a duration string, or an
/// integer number of nanoseconds; written back in the form it was read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimeOrMetaDuration {
    pub duration: GoDuration,
    pub serialize_as_string: bool,
}

impl Serialize for TimeOrMetaDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.serialize_as_string {
            self.duration.serialize(s)
        } else {
            s.serialize_i64(self.duration.0)
        }
    }
}

impl<'de> Deserialize<'de> for TimeOrMetaDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            S(String),
            N(i64),
        }
        match Option::<Raw>::deserialize(d)? {
            None => Ok(TimeOrMetaDuration::default()),
            Some(Raw::N(n)) => Ok(TimeOrMetaDuration {
                duration: GoDuration(n),
                serialize_as_string: false,
            }),
            Some(Raw::S(s)) => GoDuration::parse(&s)
                .map(|duration| TimeOrMetaDuration {
                    duration,
                    serialize_as_string: true,
                })
                .map_err(serde::de::Error::custom),
        }
    }
}

/// A Kubernetes `resource.Quantity` (`512`, `1K`, `2Ki`, `5Mi`, `1e3`), kept as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantity(pub String);

impl Default for Quantity {
    fn default() -> Self {
        Quantity("0".into())
    }
}

impl Quantity {
    /// The value in units (bytes), rounded up as `Quantity.Value()` does.
    pub fn value(&self) -> Result<i128, String> {
        let s = self.0.trim();
        let bad = || format!("{s:?} is not a quantity like 512, 1K, 2Ki, 5Mi or 1e3");
        let num_len = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
            .unwrap_or(s.len());
        let (num, suffix) = s.split_at(num_len);
        let n: f64 = num.parse().map_err(|_| bad())?;
        let scale: f64 = match suffix {
            "" => 1.0,
            "Ki" => 1024f64,
            "Mi" => 1024f64.powi(2),
            "Gi" => 1024f64.powi(3),
            "Ti" => 1024f64.powi(4),
            "Pi" => 1024f64.powi(5),
            "Ei" => 1024f64.powi(6),
            "n" => 1e-9,
            "u" => 1e-6,
            "m" => 1e-3,
            "k" => 1e3,
            "M" => 1e6,
            "G" => 1e9,
            "T" => 1e12,
            "P" => 1e15,
            "E" => 1e18,
            e if e.starts_with(['e', 'E']) => {
                let exp: i32 = e[1..].parse().map_err(|_| bad())?;
                10f64.powi(exp)
            }
            _ => return Err(bad()),
        };
        Ok((n * scale).ceil() as i128)
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<serde_json::Value>::deserialize(d)? {
            None => Ok(Quantity::default()),
            Some(serde_json::Value::String(s)) => Ok(Quantity(s)),
            Some(serde_json::Value::Number(n)) => Ok(Quantity(n.to_string())),
            Some(other) => Err(serde::de::Error::custom(format!("invalid quantity {other}"))),
        }
    }
}

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

// ---------------------------------------------------------------------------------------------
// The v1alpha1 wire format
// ---------------------------------------------------------------------------------------------

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
fn append_port_if_needed(addr: &str, port: u16) -> String {
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
fn split_host_port(s: &str) -> Option<(&str, &str)> {
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

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// Upstream's flags in their raw form (None = not given on the command line). Durations, IPs
/// and CIDRs stay strings so that errors name the flag and the value as typed.
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub config: Option<String>,
    /// `--feature-gates` items (`Name=bool`), from every occurrence.
    pub feature_gates: Vec<String>,
    pub kubeconfig: Option<String>,
    pub master: Option<String>,
    pub kube_api_content_type: Option<String>,
    pub kube_api_qps: Option<f32>,
    pub kube_api_burst: Option<i64>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub proxy_mode: Option<String>,
    pub iptables_masquerade_bit: Option<i64>,
    pub masquerade_all: Option<bool>,
    pub iptables_localhost_nodeports: Option<bool>,
    pub iptables_sync_period: Option<String>,
    pub iptables_min_sync_period: Option<String>,
    pub ipvs_sync_period: Option<String>,
    pub ipvs_min_sync_period: Option<String>,
    pub ipvs_scheduler: Option<String>,
    pub ipvs_exclude_cidrs: Option<Vec<String>>,
    pub ipvs_strict_arp: Option<bool>,
    pub ipvs_tcp_timeout: Option<String>,
    pub ipvs_tcpfin_timeout: Option<String>,
    pub ipvs_udp_timeout: Option<String>,
    pub detect_local_mode: Option<String>,
    pub pod_bridge_interface: Option<String>,
    pub pod_interface_name_prefix: Option<String>,
    pub cluster_cidr: Option<String>,
    pub nodeport_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i64>,
    pub conntrack_max_per_core: Option<i64>,
    pub conntrack_min: Option<i64>,
    pub conntrack_tcp_timeout_established: Option<String>,
    pub conntrack_tcp_timeout_close_wait: Option<String>,
    pub conntrack_tcp_be_liberal: Option<bool>,
    pub conntrack_udp_timeout: Option<String>,
    pub conntrack_udp_timeout_stream: Option<String>,
    pub config_sync_period: Option<String>,
    /// Deprecated: the port of `--healthz-bind-address` when it has none; 0 disables.
    pub healthz_port: Option<i64>,
    /// Deprecated: the port of `--metrics-bind-address` when it has none; 0 disables.
    pub metrics_port: Option<i64>,
    /// Deprecated, unused.
    pub proxy_port_range: Option<String>,
    /// New: the node's IPs, overriding the Node object's addresses.
    pub node_ips: Vec<String>,
    pub logging: LoggingFlags,
}

/// component-base's logging flags; they survive `--config` (flags win over the file).
#[derive(Clone, Debug, Default)]
pub struct LoggingFlags {
    /// `-v` / `--v`.
    pub verbosity: Option<u32>,
    /// `--vmodule` items (`pattern=N`), from every occurrence.
    pub vmodule: Vec<String>,
    pub logging_format: Option<String>,
    pub log_flush_frequency: Option<String>,
    pub log_json_split_stream: Option<bool>,
    pub log_json_info_buffer_size: Option<String>,
    pub log_text_split_stream: Option<bool>,
    pub log_text_info_buffer_size: Option<String>,
}

/// Flags that keep their effect when `--config` is given.
const SURVIVE_CONFIG: &[&str] = &[
    "--hostname-override", "--master", "--node-ip", "-v", "--vmodule", "--logging-format", "--log-flush-frequency",
    "--log-json-split-stream", "--log-json-info-buffer-size", "--log-text-split-stream", "--log-text-info-buffer-size",
];

/// The flag that sets each v1alpha1 field (for error and warning messages).
const FIELD_FLAGS: &[(&str, &str)] = &[
    ("featureGates", "--feature-gates"),
    ("clientConnection.kubeconfig", "--kubeconfig"),
    ("clientConnection.contentType", "--kube-api-content-type"),
    ("clientConnection.qps", "--kube-api-qps"),
    ("clientConnection.burst", "--kube-api-burst"),
    ("hostnameOverride", "--hostname-override"),
    ("bindAddress", "--bind-address"),
    ("healthzBindAddress", "--healthz-bind-address"),
    ("metricsBindAddress", "--metrics-bind-address"),
    ("bindAddressHardFail", "--bind-address-hard-fail"),
    ("enableProfiling", "--profiling"),
    ("showHiddenMetricsForVersion", "--show-hidden-metrics-for-version"),
    ("mode", "--proxy-mode"),
    ("iptables.masqueradeBit", "--iptables-masquerade-bit"),
    ("iptables.masqueradeAll", "--masquerade-all"),
    ("nftables.masqueradeAll", "--masquerade-all"),
    ("iptables.localhostNodePorts", "--iptables-localhost-nodeports"),
    ("iptables.syncPeriod", "--iptables-sync-period"),
    ("iptables.minSyncPeriod", "--iptables-min-sync-period"),
    ("nftables.syncPeriod", "--iptables-sync-period"),
    ("nftables.minSyncPeriod", "--iptables-min-sync-period"),
    ("ipvs.syncPeriod", "--ipvs-sync-period"),
    ("ipvs.minSyncPeriod", "--ipvs-min-sync-period"),
    ("ipvs.scheduler", "--ipvs-scheduler"),
    ("ipvs.excludeCIDRs", "--ipvs-exclude-cidrs"),
    ("ipvs.strictARP", "--ipvs-strict-arp"),
    ("ipvs.tcpTimeout", "--ipvs-tcp-timeout"),
    ("ipvs.tcpFinTimeout", "--ipvs-tcpfin-timeout"),
    ("ipvs.udpTimeout", "--ipvs-udp-timeout"),
    ("detectLocalMode", "--detect-local-mode"),
    ("detectLocal.bridgeInterface", "--pod-bridge-interface"),
    ("detectLocal.interfaceNamePrefix", "--pod-interface-name-prefix"),
    ("clusterCIDR", "--cluster-cidr"),
    ("nodePortAddresses", "--nodeport-addresses"),
    ("oomScoreAdj", "--oom-score-adj"),
    ("conntrack.maxPerCore", "--conntrack-max-per-core"),
    ("conntrack.min", "--conntrack-min"),
    ("conntrack.tcpEstablishedTimeout", "--conntrack-tcp-timeout-established"),
    ("conntrack.tcpCloseWaitTimeout", "--conntrack-tcp-timeout-close-wait"),
    ("conntrack.tcpBeLiberal", "--conntrack-tcp-be-liberal"),
    ("conntrack.udpTimeout", "--conntrack-udp-timeout"),
    ("conntrack.udpStreamTimeout", "--conntrack-udp-timeout-stream"),
    ("configSyncPeriod", "--config-sync-period"),
    ("portRange", "--proxy-port-range"),
    ("logging.format", "--logging-format"),
    ("logging.flushFrequency", "--log-flush-frequency"),
    ("logging.verbosity", "-v"),
    ("logging.vmodule", "--vmodule"),
    ("logging.options.text.splitStream", "--log-text-split-stream"),
    ("logging.options.text.infoBufferSize", "--log-text-info-buffer-size"),
    ("logging.options.json.splitStream", "--log-json-split-stream"),
    ("logging.options.json.infoBufferSize", "--log-json-info-buffer-size"),
];

fn flag_for_field(field: &str) -> Option<&'static str> {
    FIELD_FLAGS.iter().find(|(f, _)| *f == field).map(|(_, flag)| *flag)
}

impl Flags {
    /// Every flag given on the command line (by its upstream name), `--config` excluded.
    pub fn given(&self) -> BTreeSet<&'static str> {
        let l = &self.logging;
        let checks: &[(&'static str, bool)] = &[
            ("--feature-gates", !self.feature_gates.is_empty()),
            ("--kubeconfig", self.kubeconfig.is_some()),
            ("--master", self.master.is_some()),
            ("--kube-api-content-type", self.kube_api_content_type.is_some()),
            ("--kube-api-qps", self.kube_api_qps.is_some()),
            ("--kube-api-burst", self.kube_api_burst.is_some()),
            ("--hostname-override", self.hostname_override.is_some()),
            ("--bind-address", self.bind_address.is_some()),
            ("--healthz-bind-address", self.healthz_bind_address.is_some()),
            ("--metrics-bind-address", self.metrics_bind_address.is_some()),
            ("--bind-address-hard-fail", self.bind_address_hard_fail.is_some()),
            ("--profiling", self.profiling.is_some()),
            (
                "--show-hidden-metrics-for-version",
                self.show_hidden_metrics_for_version.is_some(),
            ),
            ("--proxy-mode", self.proxy_mode.is_some()),
            ("--iptables-masquerade-bit", self.iptables_masquerade_bit.is_some()),
            ("--masquerade-all", self.masquerade_all.is_some()),
            (
                "--iptables-localhost-nodeports",
                self.iptables_localhost_nodeports.is_some(),
            ),
            ("--iptables-sync-period", self.iptables_sync_period.is_some()),
            ("--iptables-min-sync-period", self.iptables_min_sync_period.is_some()),
            ("--ipvs-sync-period", self.ipvs_sync_period.is_some()),
            ("--ipvs-min-sync-period", self.ipvs_min_sync_period.is_some()),
            ("--ipvs-scheduler", self.ipvs_scheduler.is_some()),
            ("--ipvs-exclude-cidrs", self.ipvs_exclude_cidrs.is_some()),
            ("--ipvs-strict-arp", self.ipvs_strict_arp.is_some()),
            ("--ipvs-tcp-timeout", self.ipvs_tcp_timeout.is_some()),
            ("--ipvs-tcpfin-timeout", self.ipvs_tcpfin_timeout.is_some()),
            ("--ipvs-udp-timeout", self.ipvs_udp_timeout.is_some()),
            ("--detect-local-mode", self.detect_local_mode.is_some()),
            ("--pod-bridge-interface", self.pod_bridge_interface.is_some()),
            ("--pod-interface-name-prefix", self.pod_interface_name_prefix.is_some()),
            ("--cluster-cidr", self.cluster_cidr.is_some()),
            ("--nodeport-addresses", self.nodeport_addresses.is_some()),
            ("--oom-score-adj", self.oom_score_adj.is_some()),
            ("--conntrack-max-per-core", self.conntrack_max_per_core.is_some()),
            ("--conntrack-min", self.conntrack_min.is_some()),
            (
                "--conntrack-tcp-timeout-established",
                self.conntrack_tcp_timeout_established.is_some(),
            ),
            (
                "--conntrack-tcp-timeout-close-wait",
                self.conntrack_tcp_timeout_close_wait.is_some(),
            ),
            ("--conntrack-tcp-be-liberal", self.conntrack_tcp_be_liberal.is_some()),
            ("--conntrack-udp-timeout", self.conntrack_udp_timeout.is_some()),
            (
                "--conntrack-udp-timeout-stream",
                self.conntrack_udp_timeout_stream.is_some(),
            ),
            ("--config-sync-period", self.config_sync_period.is_some()),
            ("--healthz-port", self.healthz_port.is_some()),
            ("--metrics-port", self.metrics_port.is_some()),
            ("--proxy-port-range", self.proxy_port_range.is_some()),
            ("--node-ip", !self.node_ips.is_empty()),
            ("-v", l.verbosity.is_some()),
            ("--vmodule", !l.vmodule.is_empty()),
            ("--logging-format", l.logging_format.is_some()),
            ("--log-flush-frequency", l.log_flush_frequency.is_some()),
            ("--log-json-split-stream", l.log_json_split_stream.is_some()),
            ("--log-json-info-buffer-size", l.log_json_info_buffer_size.is_some()),
            ("--log-text-split-stream", l.log_text_split_stream.is_some()),
            ("--log-text-info-buffer-size", l.log_text_info_buffer_size.is_some()),
        ];
        checks.iter().filter(|(_, set)| *set).map(|(name, _)| *name).collect()
    }

    /// Upstream's flag → configuration mapping (no `--config`), onto a defaulted configuration.
    fn apply_to(&self, c: &mut KubeProxyConfiguration, warnings: &mut Vec<String>) -> Result<(), ConfigError> {
        let dur = |flag: &str, raw: &Option<String>| -> Result<Option<GoDuration>, ConfigError> {
            raw.as_deref()
                .map(|r| GoDuration::parse(r.trim()).map_err(|reason| invalid(flag, r, reason)))
                .transpose()
        };
        let int32 = |flag: &str, v: Option<i64>| -> Result<Option<i32>, ConfigError> {
            v.map(|v| i32::try_from(v).map_err(|_| invalid(flag, v, "must be a 32-bit integer")))
                .transpose()
        };
        if let Some(m) = &self.proxy_mode {
            c.mode = m.trim().to_string();
        }
        let mode = c.mode.clone();
        for item in &self.feature_gates {
            let (name, value) = parse_gate(item)?;
            c.feature_gates.insert(name, value);
        }
        if let Some(v) = &self.kubeconfig {
            c.client_connection.kubeconfig = v.clone();
        }
        if let Some(v) = &self.kube_api_content_type {
            c.client_connection.content_type = v.clone();
        }
        if let Some(v) = self.kube_api_qps {
            c.client_connection.qps = v;
        }
        if let Some(v) = int32("--kube-api-burst", self.kube_api_burst)? {
            c.client_connection.burst = v;
        }
        if let Some(v) = &self.bind_address {
            c.bind_address = v.trim().to_string();
        }
        if let Some(v) = &self.healthz_bind_address {
            c.healthz_bind_address = v.trim().to_string();
        }
        if let Some(v) = &self.metrics_bind_address {
            c.metrics_bind_address = v.trim().to_string();
        }
        // Upstream's addressFromDeprecatedFlags: the port when the address has none; 0 disables.
        for (flag, port, addr, default, replacement) in [
            (
                "--healthz-port", self.healthz_port, &mut c.healthz_bind_address, HEALTHZ_PORT,
                "--healthz-bind-address",
            ),
            (
                "--metrics-port", self.metrics_port, &mut c.metrics_bind_address, METRICS_PORT,
                "--metrics-bind-address",
            ),
        ] {
            let port = match port {
                None => default,
                Some(p) => {
                    let p = u16::try_from(p).map_err(|_| invalid(flag, p, "must be a port number 0-65535"))?;
                    let effect = if p == 0 {
                        "disables the server".to_string()
                    } else if split_host_port(addr).is_some() {
                        format!("has no effect because {replacement} has a port")
                    } else {
                        format!("sets the port of {replacement}")
                    };
                    warnings.push(format!(
                        "{flag} is deprecated, use {replacement} instead ({flag}={p} {effect})"
                    ));
                    p
                }
            };
            *addr = if port == 0 {
                String::new()
            } else {
                append_port_if_needed(addr, port)
            };
        }
        if let Some(v) = self.bind_address_hard_fail {
            c.bind_address_hard_fail = v;
        }
        if let Some(v) = self.profiling {
            c.enable_profiling = v;
        }
        if let Some(v) = &self.show_hidden_metrics_for_version {
            c.show_hidden_metrics_for_version = v.trim().to_string();
        }
        if let Some(v) = int32("--iptables-masquerade-bit", self.iptables_masquerade_bit)? {
            c.iptables.masquerade_bit = Some(v);
        }
        if let Some(v) = self.masquerade_all {
            if mode == "nftables" {
                c.nftables.masquerade_all = v;
            } else {
                c.iptables.masquerade_all = v;
            }
        }
        if let Some(v) = self.iptables_localhost_nodeports {
            c.iptables.localhost_node_ports = Some(v);
        }
        // Upstream's processV1Alpha1Flags: the sync-period flags of the other kind of mode are
        // dropped; the internal sync period (30s / 1s unless set) lands in the mode's section.
        let ipt_sync = dur("--iptables-sync-period", &self.iptables_sync_period)?;
        let ipt_min = dur("--iptables-min-sync-period", &self.iptables_min_sync_period)?;
        let ipvs_sync = dur("--ipvs-sync-period", &self.ipvs_sync_period)?;
        let ipvs_min = dur("--ipvs-min-sync-period", &self.ipvs_min_sync_period)?;
        let (sync, min) = if mode == "ipvs" {
            (ipvs_sync, ipvs_min)
        } else {
            (ipt_sync, ipt_min)
        };
        let sync = sync.unwrap_or(GoDuration::from_secs(30));
        let min = min.unwrap_or(GoDuration::from_secs(1));
        match mode.as_str() {
            "ipvs" => (c.ipvs.sync_period, c.ipvs.min_sync_period) = (sync, min),
            "nftables" => (c.nftables.sync_period, c.nftables.min_sync_period) = (sync, min),
            _ => (c.iptables.sync_period, c.iptables.min_sync_period) = (sync, min),
        }
        let (other, other_mode) = if mode == "ipvs" {
            (
                [
                    ("--iptables-sync-period", ipt_sync),
                    ("--iptables-min-sync-period", ipt_min),
                ],
                "every proxy mode but ipvs (use --ipvs-sync-period and --ipvs-min-sync-period)",
            )
        } else {
            (
                [("--ipvs-sync-period", ipvs_sync), ("--ipvs-min-sync-period", ipvs_min)],
                "proxy mode ipvs",
            )
        };
        for (flag, v) in other {
            if v.is_some() {
                warnings.push(format!("{flag} applies only to {other_mode}; ignored"));
            }
        }
        if let Some(v) = &self.ipvs_scheduler {
            c.ipvs.scheduler = v.trim().to_string();
        }
        if let Some(v) = &self.ipvs_exclude_cidrs {
            c.ipvs.exclude_cidrs = Some(
                v.iter()
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect(),
            );
        }
        if let Some(v) = self.ipvs_strict_arp {
            c.ipvs.strict_arp = v;
        }
        if let Some(v) = dur("--ipvs-tcp-timeout", &self.ipvs_tcp_timeout)? {
            c.ipvs.tcp_timeout = v;
        }
        if let Some(v) = dur("--ipvs-tcpfin-timeout", &self.ipvs_tcpfin_timeout)? {
            c.ipvs.tcp_fin_timeout = v;
        }
        if let Some(v) = dur("--ipvs-udp-timeout", &self.ipvs_udp_timeout)? {
            c.ipvs.udp_timeout = v;
        }
        if let Some(v) = &self.detect_local_mode {
            c.detect_local_mode = v.trim().to_string();
        }
        if let Some(v) = &self.pod_bridge_interface {
            c.detect_local.bridge_interface = v.trim().to_string();
        }
        if let Some(v) = &self.pod_interface_name_prefix {
            c.detect_local.interface_name_prefix = v.trim().to_string();
        }
        if let Some(v) = &self.cluster_cidr {
            c.cluster_cidr = v.trim().to_string();
        }
        if let Some(v) = &self.nodeport_addresses {
            c.node_port_addresses = Some(
                v.iter()
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect(),
            );
        }
        if let Some(v) = int32("--oom-score-adj", self.oom_score_adj)? {
            c.oom_score_adj = Some(v);
        }
        let ct = &mut c.conntrack;
        if let Some(v) = int32("--conntrack-max-per-core", self.conntrack_max_per_core)? {
            ct.max_per_core = Some(v);
        }
        if let Some(v) = int32("--conntrack-min", self.conntrack_min)? {
            ct.min = Some(v);
        }
        if let Some(v) = dur(
            "--conntrack-tcp-timeout-established", &self.conntrack_tcp_timeout_established,
        )? {
            ct.tcp_established_timeout = Some(v);
        }
        if let Some(v) = dur(
            "--conntrack-tcp-timeout-close-wait", &self.conntrack_tcp_timeout_close_wait,
        )? {
            ct.tcp_close_wait_timeout = Some(v);
        }
        if let Some(v) = self.conntrack_tcp_be_liberal {
            ct.tcp_be_liberal = v;
        }
        if let Some(v) = dur("--conntrack-udp-timeout", &self.conntrack_udp_timeout)? {
            ct.udp_timeout = v;
        }
        if let Some(v) = dur("--conntrack-udp-timeout-stream", &self.conntrack_udp_timeout_stream)? {
            ct.udp_stream_timeout = v;
        }
        if let Some(v) = dur("--config-sync-period", &self.config_sync_period)? {
            c.config_sync_period = v;
        }
        if let Some(v) = &self.proxy_port_range {
            c.port_range = v.trim().to_string();
        }
        Ok(())
    }

    /// Upstream's copyLogsFromFlags: logging flags that were given override the configuration;
    /// `--vmodule` items come first, the file's follow.
    fn apply_logging(&self, log: &mut LoggingConfiguration) -> Result<(), ConfigError> {
        let l = &self.logging;
        if let Some(v) = &l.logging_format {
            log.format = v.trim().to_string();
        }
        if let Some(v) = &l.log_flush_frequency {
            let d = GoDuration::parse(v.trim()).map_err(|reason| invalid("--log-flush-frequency", v, reason))?;
            log.flush_frequency = TimeOrMetaDuration {
                duration: d,
                serialize_as_string: true,
            };
        }
        if let Some(v) = l.verbosity {
            log.verbosity = v;
        }
        if !l.vmodule.is_empty() {
            let mut items = Vec::new();
            for item in l.vmodule.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
                let (pattern, level) = item
                    .split_once('=')
                    .ok_or_else(|| invalid("--vmodule", item, "must be pattern=N"))?;
                let verbosity = level
                    .trim()
                    .parse::<u32>()
                    .map_err(|_| invalid("--vmodule", item, "the verbosity N of pattern=N must be a number"))?;
                items.push(VModuleItem {
                    file_pattern: pattern.trim().to_string(),
                    verbosity,
                });
            }
            items.append(&mut log.vmodule);
            log.vmodule = items;
        }
        if let Some(v) = l.log_json_split_stream {
            log.options.json.split_stream = v;
        }
        if let Some(v) = &l.log_json_info_buffer_size {
            log.options.json.info_buffer_size = Quantity(v.trim().to_string());
        }
        if let Some(v) = l.log_text_split_stream {
            log.options.text.split_stream = v;
        }
        if let Some(v) = &l.log_text_info_buffer_size {
            log.options.text.info_buffer_size = Quantity(v.trim().to_string());
        }
        Ok(())
    }
}

/// One `--feature-gates` item: `Name=bool` (Go's `strconv.ParseBool` values).
fn parse_gate(item: &str) -> Result<(String, bool), ConfigError> {
    let bad = || invalid("--feature-gates", item, "expected Name=true or Name=false");
    let (k, v) = item.split_once('=').ok_or_else(bad)?;
    let k = k.trim();
    if k.is_empty() {
        return Err(bad());
    }
    Ok((k.to_string(), parse_go_bool(v.trim()).ok_or_else(bad)?))
}

/// Go's `strconv.ParseBool`.
pub fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Feature gates
// ---------------------------------------------------------------------------------------------

/// What kube-proxy-rs does with a feature gate.
enum Gate {
    /// Both values are honoured; the default applies when unset.
    Honoured(bool),
    /// The behaviour is fixed (the feature is GA or locked upstream); only this value is honoured.
    Fixed(bool),
}

/// The feature gates kube-proxy-rs knows. Others are accepted with a warning (upstream knows
/// every Kubernetes gate and rejects unknown names; a cluster-wide list must still load here).
const FEATURE_GATES: &[(&str, Gate)] = &[
    ("PreferSameTrafficDistribution", Gate::Honoured(true)),
    ("LoggingAlphaOptions", Gate::Honoured(false)),
    ("LoggingBetaOptions", Gate::Fixed(true)),
    ("ContextualLogging", Gate::Fixed(true)),
    ("TopologyAwareHints", Gate::Fixed(true)),
    ("ServiceTrafficDistribution", Gate::Fixed(true)),
    ("KubeProxyDrainingTerminatingNodes", Gate::Fixed(true)),
    ("NFTablesProxyMode", Gate::Fixed(true)),
];

// ---------------------------------------------------------------------------------------------
// The effective configuration
// ---------------------------------------------------------------------------------------------

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
    /// `--config`, when given.
    pub config_file: Option<PathBuf>,
    /// The effective v1alpha1 object (defaults + flags, or the file), as `--write-config-to` writes it.
    pub effective: KubeProxyConfiguration,
    /// Non-fatal notes for the operator (unknown fields, flags ignored because of --config,
    /// settings accepted but not implemented), one per setting.
    pub warnings: Vec<String>,
}

/// Names fields in messages: the flag that set it, or the field of the config file.
struct Namer {
    file: Option<String>,
    given: BTreeSet<&'static str>,
}

impl Namer {
    /// (display name, whether it is a field of the config file).
    fn name(&self, field: &str) -> (String, bool) {
        if let Some(flag) = flag_for_field(field)
            && (self.file.is_none() || (self.given.contains(flag) && SURVIVE_CONFIG.contains(&flag)))
        {
            return (flag.to_string(), false);
        }
        (field.to_string(), self.file.is_some())
    }

    fn invalid(&self, field: &str, value: impl fmt::Display, reason: impl Into<String>) -> ConfigError {
        let (name, in_file) = self.name(field);
        match (&self.file, in_file) {
            (Some(path), true) => ConfigError::InFile {
                path: path.clone(),
                field: name,
                value: value.to_string(),
                reason: reason.into(),
            },
            _ => ConfigError::Invalid {
                field: name,
                value: value.to_string(),
                reason: reason.into(),
            },
        }
    }

    /// The setting as a warning names it: `--flag`, or `field (config file PATH)`.
    fn label(&self, field: &str) -> String {
        match self.name(field) {
            (name, true) => format!("{name} (config file {})", self.file.as_deref().unwrap_or("")),
            (name, false) => name,
        }
    }
}

const IPVS_SCHEDULERS: &[&str] = &[
    "", "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh",
];

fn valid_interface_name(v: &str) -> bool {
    v.len() <= 15 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
}

/// A `host:port` bind address: None when empty or port 0 (disabled).
fn parse_bind(s: &str) -> Result<Option<SocketAddr>, &'static str> {
    if s.is_empty() {
        return Ok(None);
    }
    let (host, port) = split_host_port(s).ok_or("must be IP:port (or empty to disable)")?;
    let ip: IpAddr = host.parse().map_err(|_| "must be IP:port with a valid IP")?;
    let port: u16 = port
        .parse()
        .map_err(|_| "must be IP:port with a valid port (1-65535, or 0 to disable)")?;
    Ok((port != 0).then_some(SocketAddr::new(ip, port)))
}

/// Upstream's `ParsePortRange`: empty, `N`, `N-M` or `N+M`.
fn valid_port_range(s: &str) -> bool {
    let s = s.trim();
    if s.is_empty() {
        return true;
    }
    let port = |p: &str| p.trim().parse::<u16>().ok();
    if let Some((a, b)) = s.split_once('-') {
        return matches!((port(a), port(b)), (Some(a), Some(b)) if a <= b);
    }
    if let Some((a, b)) = s.split_once('+') {
        return matches!((port(a), port(b)), (Some(a), Some(b)) if u32::from(a) + u32::from(b) <= 65536);
    }
    port(s).is_some()
}

impl KubeProxyConfiguration {
    /// Upstream's `validation.Validate` (plus component-base's logging validation), on a
    /// configuration with defaults applied. Every problem is reported.
    fn validate(&self, n: &Namer) -> Result<(), ConfigError> {
        let mut errs = Vec::new();
        let mode = ProxyMode::parse(&self.mode);
        if mode.is_none() {
            errs.push(n.invalid(
                "mode",
                &self.mode,
                "must be iptables, ipvs, nftables or blank (blank means iptables)",
            ));
        }
        let bit = |errs: &mut Vec<ConfigError>, field: &str, v: Option<i32>| {
            if let Some(b) = v.filter(|b| !(0..=31).contains(b)) {
                errs.push(n.invalid(field, b, "must be within the range [0, 31]"));
            }
        };
        let periods = |errs: &mut Vec<ConfigError>, section: &str, sync: GoDuration, min: GoDuration| {
            let (sf, mf) = (format!("{section}.syncPeriod"), format!("{section}.minSyncPeriod"));
            if sync.0 <= 0 {
                errs.push(n.invalid(&sf, sync, "must be greater than 0"));
            }
            if min.is_negative() {
                errs.push(n.invalid(&mf, min, "must be greater than or equal to 0"));
            } else if sync.0 > 0 && min > sync {
                errs.push(n.invalid(&mf, min, format!("must not be greater than {} ({sync})", n.name(&sf).0)));
            }
        };
        let non_negative = |errs: &mut Vec<ConfigError>, field: &str, d: GoDuration| {
            if d.is_negative() {
                errs.push(n.invalid(field, d, "must be greater than or equal to 0"));
            }
        };
        let cidrs = |errs: &mut Vec<ConfigError>, field: &str, list: &Option<Vec<String>>| {
            for c in list.iter().flatten() {
                if c.parse::<IpNet>().is_err() {
                    errs.push(n.invalid(field, c, "must be a valid CIDR block (e.g. 10.100.0.0/16)"));
                }
            }
        };

        bit(&mut errs, "iptables.masqueradeBit", self.iptables.masquerade_bit);
        periods(
            &mut errs, "iptables", self.iptables.sync_period, self.iptables.min_sync_period,
        );
        if mode == Some(ProxyMode::Ipvs) {
            let v = &self.ipvs;
            periods(&mut errs, "ipvs", v.sync_period, v.min_sync_period);
            non_negative(&mut errs, "ipvs.tcpTimeout", v.tcp_timeout);
            non_negative(&mut errs, "ipvs.tcpFinTimeout", v.tcp_fin_timeout);
            non_negative(&mut errs, "ipvs.udpTimeout", v.udp_timeout);
            if !IPVS_SCHEDULERS.contains(&v.scheduler.as_str()) {
                errs.push(n.invalid(
                    "ipvs.scheduler",
                    &v.scheduler,
                    "must be one of rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq, mh, or blank (rr)",
                ));
            }
            cidrs(&mut errs, "ipvs.excludeCIDRs", &v.exclude_cidrs);
        }
        if mode == Some(ProxyMode::Nftables) {
            bit(&mut errs, "nftables.masqueradeBit", self.nftables.masquerade_bit);
            periods(
                &mut errs, "nftables", self.nftables.sync_period, self.nftables.min_sync_period,
            );
        }

        let ct = &self.conntrack;
        for (field, v) in [("conntrack.maxPerCore", ct.max_per_core), ("conntrack.min", ct.min)] {
            if let Some(v) = v.filter(|v| *v < 0) {
                errs.push(n.invalid(field, v, "must be greater than or equal to 0"));
            }
        }
        for (field, d) in [
            (
                "conntrack.tcpEstablishedTimeout",
                ct.tcp_established_timeout.unwrap_or_default(),
            ),
            (
                "conntrack.tcpCloseWaitTimeout",
                ct.tcp_close_wait_timeout.unwrap_or_default(),
            ),
            ("conntrack.udpTimeout", ct.udp_timeout),
            ("conntrack.udpStreamTimeout", ct.udp_stream_timeout),
        ] {
            non_negative(&mut errs, field, d);
        }

        let cc = &self.client_connection;
        if cc.burst < 0 {
            errs.push(n.invalid("clientConnection.burst", cc.burst, "must be greater than or equal to 0"));
        }
        if !(cc.qps.is_finite() && cc.qps >= 0.0) {
            errs.push(n.invalid("clientConnection.qps", cc.qps, "must be greater than or equal to 0"));
        }
        if let Some(o) = self.oom_score_adj.filter(|o| !(-1000..=1000).contains(o)) {
            errs.push(n.invalid("oomScoreAdj", o, "must be within the range [-1000, 1000]"));
        }
        if self.config_sync_period.0 <= 0 {
            errs.push(n.invalid("configSyncPeriod", self.config_sync_period, "must be greater than 0"));
        }
        if self.bind_address.parse::<IpAddr>().is_err() {
            errs.push(n.invalid("bindAddress", &self.bind_address, "must be an IP address"));
        }
        for field in ["healthzBindAddress", "metricsBindAddress"] {
            let v = if field == "healthzBindAddress" {
                &self.healthz_bind_address
            } else {
                &self.metrics_bind_address
            };
            if let Err(reason) = parse_bind(v) {
                errs.push(n.invalid(field, v, reason));
            }
        }

        if !self.cluster_cidr.is_empty() {
            let parts: Vec<&str> = self.cluster_cidr.split(',').map(str::trim).collect();
            let nets: Vec<Option<IpNet>> = parts.iter().map(|p| p.parse().ok()).collect();
            if let Some(bad) = parts.iter().zip(&nets).find(|(_, n)| n.is_none()) {
                errs.push(n.invalid(
                    "clusterCIDR",
                    bad.0,
                    "must be a valid CIDR block (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
                ));
            } else if parts.len() > 2 {
                errs.push(n.invalid(
                    "clusterCIDR",
                    &self.cluster_cidr,
                    "only one CIDR allowed or a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
                ));
            } else if let [Some(a), Some(b)] = nets.as_slice()
                && a.addr().is_ipv4() == b.addr().is_ipv4()
            {
                errs.push(n.invalid(
                    "clusterCIDR",
                    &self.cluster_cidr,
                    "must be a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
                ));
            }
        }
        if !valid_port_range(&self.port_range) {
            errs.push(n.invalid(
                "portRange",
                &self.port_range,
                "must be a valid port range (e.g. 300-2000)",
            ));
        }
        for a in self.node_port_addresses.iter().flatten() {
            if a != "primary" && a.parse::<IpNet>().is_err() {
                errs.push(n.invalid("nodePortAddresses", a, "must be a CIDR or \"primary\""));
            }
        }
        let v = &self.show_hidden_metrics_for_version;
        if !v.is_empty() {
            let ok = v
                .split_once('.')
                .is_some_and(|(a, b)| a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok());
            if !ok {
                errs.push(n.invalid("showHiddenMetricsForVersion", v, "must be <major>.<minor>, e.g. 1.33"));
            }
        }

        match DetectLocalMode::parse(&self.detect_local_mode) {
            None => errs.push(n.invalid(
                "detectLocalMode",
                &self.detect_local_mode,
                "must be ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix",
            )),
            Some(DetectLocalMode::BridgeInterface) if self.detect_local.bridge_interface.is_empty() => {
                errs.push(n.invalid(
                    "detectLocal.bridgeInterface",
                    "",
                    "required with detectLocalMode BridgeInterface",
                ))
            }
            Some(DetectLocalMode::InterfaceNamePrefix) if self.detect_local.interface_name_prefix.is_empty() => errs
                .push(n.invalid(
                    "detectLocal.interfaceNamePrefix",
                    "",
                    "required with detectLocalMode InterfaceNamePrefix",
                )),
            Some(_) => {}
        }
        for (field, v) in [
            ("detectLocal.bridgeInterface", &self.detect_local.bridge_interface),
            (
                "detectLocal.interfaceNamePrefix", &self.detect_local.interface_name_prefix,
            ),
        ] {
            if !valid_interface_name(v) {
                errs.push(n.invalid(field, v, "not a valid interface name"));
            }
        }

        // component-base's logsapi.Validate.
        let log = &self.logging;
        if !matches!(log.format.as_str(), "text" | "json") {
            errs.push(n.invalid(
                "logging.format",
                &log.format,
                "unsupported log format: must be text or json",
            ));
        }
        if log.verbosity > i32::MAX as u32 {
            errs.push(n.invalid("logging.verbosity", log.verbosity, format!("must be <= {}", i32::MAX)));
        }
        if !log.vmodule.is_empty() && log.format != "text" {
            let items: Vec<String> = log
                .vmodule
                .iter()
                .map(|i| format!("{}={}", i.file_pattern, i.verbosity))
                .collect();
            errs.push(n.invalid(
                "logging.vmodule",
                items.join(","),
                "only supported for the text log format",
            ));
        }
        for item in &log.vmodule {
            if item.file_pattern.is_empty() || item.file_pattern.contains(['=', ',']) {
                errs.push(n.invalid(
                    "logging.vmodule",
                    &item.file_pattern,
                    "the file pattern must not be empty nor contain '=' or ','",
                ));
            }
            if item.verbosity > i32::MAX as u32 {
                errs.push(n.invalid("logging.vmodule", item.verbosity, format!("must be <= {}", i32::MAX)));
            }
        }
        if log.flush_frequency.duration.0 <= 0 {
            errs.push(n.invalid(
                "logging.flushFrequency", log.flush_frequency.duration, "must be greater than 0",
            ));
        }
        let alpha = self.feature_gates.get("LoggingAlphaOptions").copied().unwrap_or(false);
        for (kind, o) in [("text", &log.options.text), ("json", &log.options.json)] {
            let size_field = format!("logging.options.{kind}.infoBufferSize");
            let size = match o.info_buffer_size.value() {
                Ok(s) if s >= 0 => s,
                Ok(_) => {
                    errs.push(n.invalid(&size_field, &o.info_buffer_size.0, "must not be negative"));
                    0
                }
                Err(reason) => {
                    errs.push(n.invalid(&size_field, &o.info_buffer_size.0, reason));
                    0
                }
            };
            if !alpha {
                if o.split_stream {
                    errs.push(n.invalid(
                        &format!("logging.options.{kind}.splitStream"),
                        true,
                        "requires the LoggingAlphaOptions feature gate",
                    ));
                }
                if size != 0 {
                    errs.push(n.invalid(
                        &size_field,
                        &o.info_buffer_size.0,
                        "requires the LoggingAlphaOptions feature gate",
                    ));
                }
            }
        }

        match errs.len() {
            0 => Ok(()),
            1 => Err(errs.remove(0)),
            _ => Err(ConfigError::Many(errs)),
        }
    }

    /// One warning per setting that is accepted but has no effect in kube-proxy-rs.
    fn unimplemented_warnings(&self, n: &Namer) -> Vec<String> {
        let mut w = Vec::new();
        let d = KubeProxyConfiguration::defaults();
        let mode = ProxyMode::parse(&self.mode).unwrap_or(ProxyMode::Iptables);
        let mut note = |field: &str, what: &str| w.push(format!("{}: {what}", n.label(field)));

        if self.enable_profiling {
            note(
                "enableProfiling",
                "profiling (/debug/pprof) is not implemented by kube-proxy-rs; ignored",
            );
        }
        if !self.show_hidden_metrics_for_version.is_empty() {
            note(
                "showHiddenMetricsForVersion",
                "hidden metrics are not implemented by kube-proxy-rs; ignored",
            );
        }
        if !self.client_connection.accept_content_types.is_empty() {
            note(
                "clientConnection.acceptContentTypes",
                "not supported by kube-proxy-rs; ignored",
            );
        }
        if !self.port_range.is_empty() {
            note(
                "portRange",
                "deprecated and unused (it configured the removed userspace proxy); ignored",
            );
        }
        if self.winkernel != d.winkernel {
            let (a, b) = (&self.winkernel, &d.winkernel);
            for (field, differs) in [
                ("winkernel.networkName", a.network_name != b.network_name),
                ("winkernel.sourceVip", a.source_vip != b.source_vip),
                ("winkernel.enableDSR", a.enable_dsr != b.enable_dsr),
                (
                    "winkernel.rootHnsEndpointName",
                    a.root_hns_endpoint_name != b.root_hns_endpoint_name,
                ),
                (
                    "winkernel.forwardHealthCheckVip",
                    a.forward_health_check_vip != b.forward_health_check_vip,
                ),
            ] {
                if differs {
                    note(field, "Windows only; ignored on Linux");
                }
            }
        }
        if self.windows_run_as_service {
            note("windowsRunAsService", "Windows only; ignored on Linux");
        }
        if mode != ProxyMode::Ipvs {
            let (a, b) = (&self.ipvs, &d.ipvs);
            for (field, differs) in [
                ("ipvs.syncPeriod", a.sync_period != b.sync_period),
                ("ipvs.minSyncPeriod", a.min_sync_period != b.min_sync_period),
                ("ipvs.scheduler", a.scheduler != b.scheduler),
                ("ipvs.excludeCIDRs", !a.exclude_cidrs.as_ref().is_none_or(Vec::is_empty)),
                ("ipvs.strictARP", a.strict_arp != b.strict_arp),
                ("ipvs.tcpTimeout", a.tcp_timeout != b.tcp_timeout),
                ("ipvs.tcpFinTimeout", a.tcp_fin_timeout != b.tcp_fin_timeout),
                ("ipvs.udpTimeout", a.udp_timeout != b.udp_timeout),
            ] {
                if differs {
                    note(
                        field,
                        &format!(
                            "applies only to proxy mode ipvs (the mode is {}); ignored",
                            mode.as_str()
                        ),
                    );
                }
            }
        }
        if mode != ProxyMode::Nftables {
            let (a, b) = (&self.nftables, &d.nftables);
            for (field, differs) in [
                ("nftables.masqueradeBit", a.masquerade_bit != b.masquerade_bit),
                ("nftables.masqueradeAll", a.masquerade_all != b.masquerade_all),
                ("nftables.syncPeriod", a.sync_period != b.sync_period),
                ("nftables.minSyncPeriod", a.min_sync_period != b.min_sync_period),
            ] {
                if differs {
                    note(
                        field,
                        &format!(
                            "applies only to proxy mode nftables (the mode is {}); ignored",
                            mode.as_str()
                        ),
                    );
                }
            }
        }
        if mode != ProxyMode::Iptables {
            let (a, b) = (&self.iptables, &d.iptables);
            let only = |modes: &str| {
                format!(
                    "applies only to proxy mode {modes} (the mode is {}); ignored",
                    mode.as_str()
                )
            };
            if a.localhost_node_ports != b.localhost_node_ports {
                note("iptables.localhostNodePorts", &only("iptables"));
            }
            if mode == ProxyMode::Nftables {
                if a.masquerade_bit != b.masquerade_bit {
                    note("iptables.masqueradeBit", &only("iptables or ipvs"));
                }
                if a.masquerade_all != b.masquerade_all {
                    note("iptables.masqueradeAll", &only("iptables or ipvs"));
                }
            }
            if n.file.is_some() {
                if a.sync_period != b.sync_period {
                    note("iptables.syncPeriod", &only("iptables"));
                }
                if a.min_sync_period != b.min_sync_period {
                    note("iptables.minSyncPeriod", &only("iptables"));
                }
            }
        }
        let infos = [
            ("text", &self.logging.options.text),
            ("json", &self.logging.options.json),
        ];
        for (kind, o) in infos {
            if o.info_buffer_size.value().unwrap_or(0) != 0 {
                note(
                    &format!("logging.options.{kind}.infoBufferSize"),
                    "buffering is not implemented by kube-proxy-rs (log lines are written unbuffered); ignored",
                );
            }
        }
        for (name, value) in &self.feature_gates {
            match FEATURE_GATES.iter().find(|(g, _)| g == name) {
                None => note(
                    "featureGates",
                    &format!("feature gate {name}={value} is not known to kube-proxy-rs; ignored"),
                ),
                Some((_, Gate::Fixed(fixed))) if fixed != value => note(
                    "featureGates",
                    &format!(
                        "feature gate {name}={value} is not supported by kube-proxy-rs (it always behaves as {name}={fixed}); ignored"
                    ),
                ),
                Some(_) => {}
            }
        }
        w
    }
}

impl ProxyConfig {
    /// Applies upstream's precedence (see the module documentation), validates, and returns the
    /// effective configuration with its warnings.
    pub fn resolve(flags: &Flags) -> Result<ProxyConfig, ConfigError> {
        let mut warnings = Vec::new();
        let given = flags.given();
        let mut kpc = match &flags.config {
            Some(path) => {
                let mut file = load_file(Path::new(path))?;
                for key in file.unknown.keys() {
                    warnings.push(format!("config file {path}: unknown field {key:?} ignored"));
                }
                let ignored: Vec<&str> = given.iter().copied().filter(|f| !SURVIVE_CONFIG.contains(f)).collect();
                if !ignored.is_empty() {
                    warnings.push(format!(
                        "--config is set, so these flags are ignored (as upstream does): {}",
                        ignored.join(", ")
                    ));
                }
                file.unknown.clear();
                file.apply_defaults();
                file
            }
            None => {
                let mut c = KubeProxyConfiguration::default();
                c.apply_defaults();
                flags.apply_to(&mut c, &mut warnings)?;
                c
            }
        };
        flags.apply_logging(&mut kpc.logging)?;
        kpc.apply_platform_defaults();
        if let Some(h) = &flags.hostname_override
            && !h.is_empty()
        {
            let t = h.trim();
            if t.is_empty() {
                return Err(invalid("--hostname-override", h, "must not be blank"));
            }
            kpc.hostname_override = t.to_lowercase();
        }
        kpc.api_version = Some(API_VERSION.into());
        kpc.kind = Some(KIND.into());

        let namer = Namer {
            file: flags.config.clone(),
            given,
        };
        kpc.validate(&namer)?;
        warnings.extend(kpc.unimplemented_warnings(&namer));

        let mut node_ips = Vec::new();
        for raw in &flags.node_ips {
            for part in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                node_ips.push(
                    part.parse::<IpAddr>()
                        .map_err(|_| invalid("--node-ip", part, "not an IP address"))?,
                );
            }
        }
        Ok(ProxyConfig::from_effective(kpc, flags, node_ips, warnings))
    }

    /// The typed settings of a validated configuration.
    fn from_effective(
        c: KubeProxyConfiguration,
        flags: &Flags,
        node_ips: Vec<IpAddr>,
        warnings: Vec<String>,
    ) -> ProxyConfig {
        let mode = ProxyMode::parse(&c.mode).unwrap_or(ProxyMode::Iptables);
        let (sync, min) = match mode {
            ProxyMode::Iptables => (c.iptables.sync_period, c.iptables.min_sync_period),
            ProxyMode::Ipvs => (c.ipvs.sync_period, c.ipvs.min_sync_period),
            ProxyMode::Nftables => (c.nftables.sync_period, c.nftables.min_sync_period),
        };
        let (masquerade_all, bit) = match mode {
            ProxyMode::Nftables => (c.nftables.masquerade_all, c.nftables.masquerade_bit),
            _ => (c.iptables.masquerade_all, c.iptables.masquerade_bit),
        };
        let hostname = c.hostname_override.trim().to_lowercase();
        let bind_address = c.bind_address.parse::<IpAddr>().ok().filter(|ip| !ip.is_unspecified());
        let mut feature_gates = c.feature_gates.clone();
        for (name, gate) in FEATURE_GATES {
            if let Gate::Honoured(default) = gate {
                feature_gates.entry((*name).to_string()).or_insert(*default);
            }
        }
        let ct = &c.conntrack;
        let non_negative = |v: Option<i32>, default: u32| v.map_or(default, |v| u32::try_from(v).unwrap_or(0));
        let conntrack = crate::conntrack::ConntrackConfig {
            max_per_core: non_negative(ct.max_per_core, 32768),
            min: non_negative(ct.min, 131072),
            tcp_established_timeout: ct.tcp_established_timeout.unwrap_or_default().to_std(),
            tcp_close_wait_timeout: ct.tcp_close_wait_timeout.unwrap_or_default().to_std(),
            tcp_be_liberal: ct.tcp_be_liberal,
            udp_timeout: ct.udp_timeout.to_std(),
            udp_stream_timeout: ct.udp_stream_timeout.to_std(),
        };
        let log = &c.logging;
        let format = if log.format == "json" {
            LogFormat::Json
        } else {
            LogFormat::Text
        };
        let routing = if format == LogFormat::Json {
            &log.options.json
        } else {
            &log.options.text
        };
        let logging = LoggingConfig {
            format,
            verbosity: log.verbosity,
            vmodule: log
                .vmodule
                .iter()
                .map(|i| (i.file_pattern.clone(), i.verbosity))
                .collect(),
            flush_frequency: log.flush_frequency.duration.to_std(),
            split_stream: routing.split_stream,
            info_buffer_size: u64::try_from(routing.info_buffer_size.value().unwrap_or(0)).unwrap_or(0),
        };
        let cc = &c.client_connection;
        ProxyConfig {
            mode,
            hostname_override: (!hostname.is_empty()).then_some(hostname),
            bind_address,
            cluster_cidrs: c
                .cluster_cidr
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            detect_local_mode: DetectLocalMode::parse(&c.detect_local_mode).unwrap_or(DetectLocalMode::ClusterCidr),
            bridge_interface: c.detect_local.bridge_interface.clone(),
            interface_name_prefix: c.detect_local.interface_name_prefix.clone(),
            masquerade_all,
            masquerade_bit: bit.unwrap_or(14).clamp(0, 31) as u8,
            localhost_node_ports: c.iptables.localhost_node_ports.unwrap_or(true),
            node_port_addresses: c
                .node_port_addresses
                .iter()
                .flatten()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            feature_gates,
            node_ips,
            sync_period: sync.to_std(),
            min_sync_period: min.to_std(),
            conntrack,
            healthz_bind_address: parse_bind(&c.healthz_bind_address).ok().flatten(),
            metrics_bind_address: parse_bind(&c.metrics_bind_address).ok().flatten(),
            bind_address_hard_fail: c.bind_address_hard_fail,
            enable_profiling: c.enable_profiling,
            show_hidden_metrics_for_version: Some(c.show_hidden_metrics_for_version.clone()).filter(|s| !s.is_empty()),
            client_connection: ClientConnection {
                kubeconfig: Some(cc.kubeconfig.trim()).filter(|s| !s.is_empty()).map(PathBuf::from),
                master: flags
                    .master
                    .as_deref()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
                accept_content_types: cc.accept_content_types.clone(),
                content_type: cc.content_type.clone(),
                qps: cc.qps,
                burst: cc.burst,
            },
            config_sync_period: c.config_sync_period.to_std(),
            oom_score_adj: c.oom_score_adj.unwrap_or(DEFAULT_OOM_SCORE_ADJ),
            ipvs: IpvsConfig {
                scheduler: c.ipvs.scheduler.clone(),
                exclude_cidrs: c
                    .ipvs
                    .exclude_cidrs
                    .iter()
                    .flatten()
                    .filter_map(|s| s.parse().ok())
                    .collect(),
                strict_arp: c.ipvs.strict_arp,
                tcp_timeout: c.ipvs.tcp_timeout.to_std(),
                tcp_fin_timeout: c.ipvs.tcp_fin_timeout.to_std(),
                udp_timeout: c.ipvs.udp_timeout.to_std(),
            },
            logging,
            config_file: flags.config.as_ref().map(PathBuf::from),
            effective: c,
            warnings,
        }
    }

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

/// Parses a non-negative Go `time.Duration` string: `300ms`, `1.5s`, `1m0s`, `2h45m`, `0`.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let d = GoDuration::parse(raw.trim())?;
    if d.is_negative() {
        return Err("must be greater than or equal to 0".into());
    }
    Ok(d.to_std())
}

/// Reads a KubeProxyConfiguration file (YAML or JSON).
pub fn load_file(path: &Path) -> Result<KubeProxyConfiguration, ConfigError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read { path: p.clone(), error })?;
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

    const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    #[test]
    fn defaults_without_flags() {
        let c = ProxyConfig::resolve(&Flags::default()).unwrap();
        assert_eq!(c.mode, ProxyMode::Iptables);
        assert_eq!(c.masquerade_bit, 14);
        assert!(c.localhost_node_ports);
        assert!(!c.masquerade_all);
        assert_eq!(c.detect_local_mode, DetectLocalMode::ClusterCidr);
        assert_eq!(c.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(c.metrics_bind_address, Some("127.0.0.1:10249".parse().unwrap()));
        assert_eq!(c.oom_score_adj, -999);
        assert_eq!(c.config_sync_period, Duration::from_secs(900));
        assert_eq!(c.client_connection.qps, 5.0);
        assert_eq!(c.client_connection.burst, 10);
        assert_eq!(c.bind_address, None);
        assert_eq!(c.sync_period, Duration::from_secs(30));
        assert_eq!(c.min_sync_period, Duration::from_secs(1));
        assert_eq!(c.conntrack, crate::conntrack::ConntrackConfig::default());
        assert!(c.feature_enabled("PreferSameTrafficDistribution"));
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        assert_eq!(c.effective, KubeProxyConfiguration::defaults());
    }

    #[test]
    fn config_file_replaces_flags_but_not_hostname_override() {
        let (dir, mut flags) = write_config(&format!(
            "{HEADER}hostnameOverride: from-file\nclusterCIDR: 10.0.0.0/8\niptables:\n  masqueradeBit: 5\n"
        ));
        flags.masquerade_all = Some(true);
        flags.iptables_masquerade_bit = Some(7);
        flags.hostname_override = Some("From-Flag ".into());
        flags.logging.verbosity = Some(3);
        let c = ProxyConfig::resolve(&flags).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        assert_eq!(c.masquerade_bit, 5);
        assert!(!c.masquerade_all, "flags are ignored when --config is given");
        assert_eq!(c.node_name(), "from-flag");
        assert_eq!(c.cluster_cidrs, vec!["10.0.0.0/8"]);
        assert_eq!(c.logging.verbosity, 3, "logging flags survive --config");
        let ignored: Vec<_> = c
            .warnings
            .iter()
            .filter(|w| w.contains("ignored (as upstream does)"))
            .collect();
        assert_eq!(ignored.len(), 1, "{:?}", c.warnings);
        assert!(ignored[0].contains("--masquerade-all") && ignored[0].contains("--iptables-masquerade-bit"));
        assert!(!ignored[0].contains("--hostname-override") && !ignored[0].contains("-v,"));
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
        let (dir, flags) = write_config(&format!("{HEADER}mode: userspace\n"));
        let e = ProxyConfig::resolve(&flags).unwrap_err().to_string();
        std::fs::remove_dir_all(dir).unwrap();
        assert!(
            e.contains("mode") && e.contains("userspace") && e.contains("config.yaml"),
            "{e}"
        );
    }

    #[test]
    fn validation_reports_every_problem() {
        let flags = Flags {
            iptables_sync_period: Some("10s".into()),
            iptables_min_sync_period: Some("1m0s".into()),
            oom_score_adj: Some(5000),
            healthz_bind_address: Some("nowhere:1".into()),
            kube_api_burst: Some(-1),
            ..Flags::default()
        };
        let e = ProxyConfig::resolve(&flags).unwrap_err().to_string();
        for needle in [
            "--iptables-min-sync-period", "1m0s", "--oom-score-adj", "5000", "--healthz-bind-address", "nowhere:1",
            "--kube-api-burst",
        ] {
            assert!(e.contains(needle), "{needle} in {e}");
        }
    }

    #[test]
    fn sync_period_flags_follow_the_mode() {
        let flags = Flags {
            proxy_mode: Some("nftables".into()),
            iptables_sync_period: Some("10s".into()),
            ipvs_sync_period: Some("20s".into()),
            masquerade_all: Some(true),
            ..Flags::default()
        };
        let c = ProxyConfig::resolve(&flags).unwrap();
        assert_eq!(c.sync_period, Duration::from_secs(10));
        assert_eq!(c.effective.nftables.sync_period, GoDuration::from_secs(10));
        assert_eq!(c.effective.iptables.sync_period, GoDuration::from_secs(30));
        assert!(c.masquerade_all && c.effective.nftables.masquerade_all);
        assert_eq!(c.node_port_addresses, vec!["primary"]);
        let w: Vec<_> = c.warnings.iter().filter(|w| w.contains("--ipvs-sync-period")).collect();
        assert_eq!(w.len(), 1, "{:?}", c.warnings);

        let flags = Flags {
            proxy_mode: Some("ipvs".into()),
            ipvs_sync_period: Some("20s".into()),
            ..Flags::default()
        };
        let c = ProxyConfig::resolve(&flags).unwrap();
        assert_eq!(c.sync_period, Duration::from_secs(20));
        assert_eq!(c.min_sync_period, Duration::from_secs(1));
    }

    #[test]
    fn bind_addresses() {
        let c = ProxyConfig::resolve(&Flags {
            healthz_bind_address: Some("127.0.0.2".into()),
            metrics_bind_address: Some(String::new()),
            ..Flags::default()
        })
        .unwrap();
        assert_eq!(c.healthz_bind_address, Some("127.0.0.2:10256".parse().unwrap()));
        assert_eq!(c.metrics_bind_address, None);
        let c = ProxyConfig::resolve(&Flags {
            healthz_port: Some(0),
            metrics_bind_address: Some("::1".into()),
            metrics_port: Some(9999),
            ..Flags::default()
        })
        .unwrap();
        assert_eq!(c.healthz_bind_address, None);
        assert_eq!(c.metrics_bind_address, Some("[::1]:9999".parse().unwrap()));
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        // A file with an IPv6 bindAddress gets IPv6 defaults.
        let (dir, flags) = write_config(&format!("{HEADER}bindAddress: fd00::1\n"));
        let c = ProxyConfig::resolve(&flags).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        assert_eq!(c.effective.healthz_bind_address, "[::]:10256");
        assert_eq!(c.effective.metrics_bind_address, "[::1]:10249");
        assert_eq!(c.bind_address, Some("fd00::1".parse().unwrap()));
    }

    #[test]
    fn durations_parse_and_print_like_go() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1m0s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("30").is_err() && parse_duration("-1s").is_err() && parse_duration("1x").is_err());
        assert_eq!(GoDuration::parse("-1.5h").unwrap(), GoDuration(-5_400_000_000_000));
        for (d, s) in [
            (GoDuration(0), "0s"),
            (GoDuration::from_secs(30), "30s"),
            (GoDuration::from_secs(60), "1m0s"),
            (GoDuration::from_secs(90), "1m30s"),
            (GoDuration::from_secs(3600), "1h0m0s"),
            (GoDuration::from_secs(86400), "24h0m0s"),
            (GoDuration(1_500_000_000), "1.5s"),
            (GoDuration(500_000_000), "500ms"),
            (GoDuration(1_500), "1.5µs"),
            (GoDuration(7), "7ns"),
            (GoDuration(-61_000_000_000), "-1m1s"),
        ] {
            assert_eq!(d.to_string(), s);
            assert_eq!(GoDuration::parse(s).unwrap(), d, "{s}");
        }
        let e = ProxyConfig::resolve(&Flags {
            iptables_sync_period: Some("soon".into()),
            ..Flags::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--iptables-sync-period") && e.contains("soon"), "{e}");
    }

    #[test]
    fn unknown_fields_and_unimplemented_settings_warn_once() {
        let (dir, flags) = write_config(&format!(
            "{HEADER}frobnicate: 1\nenableProfiling: true\nwinkernel:\n  enableDSR: true\nfeatureGates:\n  Foo: true\n"
        ));
        let c = ProxyConfig::resolve(&flags).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        for needle in ["frobnicate", "enableProfiling", "winkernel.enableDSR", "Foo=true"] {
            assert_eq!(
                c.warnings.iter().filter(|w| w.contains(needle)).count(),
                1,
                "{needle}: {:?}",
                c.warnings
            );
        }
    }

    #[test]
    fn logging_settings() {
        let c = ProxyConfig::resolve(&Flags {
            logging: LoggingFlags {
                verbosity: Some(4),
                vmodule: vec!["proxier=6".into(), "daemon*=2".into()],
                ..LoggingFlags::default()
            },
            ..Flags::default()
        })
        .unwrap();
        assert_eq!(c.logging.verbosity, 4);
        assert_eq!(
            c.logging.vmodule,
            vec![("proxier".to_string(), 6), ("daemon*".to_string(), 2)]
        );
        let e = ProxyConfig::resolve(&Flags {
            logging: LoggingFlags {
                logging_format: Some("xml".into()),
                ..LoggingFlags::default()
            },
            ..Flags::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--logging-format") && e.contains("xml"), "{e}");
        let e = ProxyConfig::resolve(&Flags {
            logging: LoggingFlags {
                log_json_split_stream: Some(true),
                ..LoggingFlags::default()
            },
            ..Flags::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--log-json-split-stream") && e.contains("LoggingAlphaOptions"),
            "{e}"
        );
        let c = ProxyConfig::resolve(&Flags {
            feature_gates: vec!["LoggingAlphaOptions=true".into()],
            logging: LoggingFlags {
                logging_format: Some("json".into()),
                log_json_split_stream: Some(true),
                ..LoggingFlags::default()
            },
            ..Flags::default()
        })
        .unwrap();
        assert!(c.logging.split_stream && c.logging.format == LogFormat::Json);
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
