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
//!
//! The parts: `go`, Go's value syntaxes (durations, quantities, booleans); `file`, the v1alpha1
//! wire format and its defaults; `flags`, upstream's flags (the clap definition itself) and
//! their mapping onto the file's fields; `types`, the typed, effective settings; `validate`,
//! upstream's validation; `resolve`, the precedence, and the warnings for settings that are
//! accepted but not implemented. Everything public is re-exported here.

mod file;
mod flags;
mod go;
mod resolve;
mod types;
mod validate;

pub use file::{
    ClientConnectionConfiguration, DetectLocalConfiguration, FormatOptions, KubeProxyConfiguration,
    KubeProxyConntrackConfiguration, KubeProxyIPTablesConfiguration, KubeProxyIPVSConfiguration,
    KubeProxyNFTablesConfiguration, KubeProxyWinkernelConfiguration, LoggingConfiguration, OutputRoutingOptions,
    VModuleItem, load_file, parse_config, read_file,
};
pub(crate) use flags::go_bool;
pub use flags::{Flags, LoggingFlags};
pub use go::{GoDuration, Quantity, TimeOrMetaDuration, parse_duration, parse_go_bool};
pub use resolve::GateState;
pub use types::{
    ClientConnection, ConfigFile, DetectLocalMode, IpvsConfig, LocalDetector, LogFormat, LoggingConfig, ProxyConfig,
    ProxyMode,
};

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

/// Helpers shared by the unit tests of the parts.
#[cfg(test)]
mod testing {
    use super::Flags;

    /// Writes `text` as a config file in a fresh directory; the flags point `--config` at it.
    pub(super) fn write_config(text: &str) -> (std::path::PathBuf, Flags) {
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

    pub(super) const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
}
