//! Upstream's `validation.Validate` (and component-base's logging validation) on the
//! effective v1alpha1 object, reporting every problem at once, each named by the flag that set
//! it or by the field of the config file ([`Namer`]).

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::ConfigError;
use super::file::{KubeProxyConfiguration, split_host_port};
use super::flags::{SURVIVE_CONFIG, flag_for_field};
use super::go::GoDuration;
use super::types::{DetectLocalMode, ProxyMode};

/// Names fields in messages: the flag that set it, or the field of the config file.
pub(super) struct Namer {
    pub(super) file: Option<String>,
    pub(super) given: BTreeSet<&'static str>,
}

impl Namer {
    /// (display name, whether it is a field of the config file).
    pub(super) fn name(&self, field: &str) -> (String, bool) {
        if let Some(flag) = flag_for_field(field)
            && (self.file.is_none() || (self.given.contains(flag) && SURVIVE_CONFIG.contains(&flag)))
        {
            return (flag.to_string(), false);
        }
        (field.to_string(), self.file.is_some())
    }

    pub(super) fn invalid(&self, field: &str, value: impl fmt::Display, reason: impl Into<String>) -> ConfigError {
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
    pub(super) fn label(&self, field: &str) -> String {
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
pub(super) fn parse_bind(s: &str) -> Result<Option<SocketAddr>, &'static str> {
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
    /// configuration with defaults applied. Every problem is reported, in upstream's order.
    pub(super) fn validate(&self, n: &Namer) -> Result<(), ConfigError> {
        let mut errs = Vec::new();
        self.check_proxy_modes(n, &mut errs);
        self.check_conntrack(n, &mut errs);
        self.check_client_and_addresses(n, &mut errs);
        self.check_detect_local(n, &mut errs);
        self.check_logging(n, &mut errs);
        match errs.len() {
            0 => Ok(()),
            1 => Err(errs.remove(0)),
            _ => Err(ConfigError::Many(errs)),
        }
    }

    /// `mode` and the sections of the proxy modes (`iptables`, `ipvs`, `nftables`).
    fn check_proxy_modes(&self, n: &Namer, errs: &mut Vec<ConfigError>) {
        let mode = ProxyMode::parse(&self.mode);
        if mode.is_none() {
            errs.push(n.invalid(
                "mode",
                &self.mode,
                "must be iptables, ipvs, nftables or blank (blank means iptables)",
            ));
        }
        check_bit(n, errs, "iptables.masqueradeBit", self.iptables.masquerade_bit);
        check_periods(
            n, errs, "iptables", self.iptables.sync_period, self.iptables.min_sync_period,
        );
        if mode == Some(ProxyMode::Ipvs) {
            let v = &self.ipvs;
            check_periods(n, errs, "ipvs", v.sync_period, v.min_sync_period);
            check_non_negative(n, errs, "ipvs.tcpTimeout", v.tcp_timeout);
            check_non_negative(n, errs, "ipvs.tcpFinTimeout", v.tcp_fin_timeout);
            check_non_negative(n, errs, "ipvs.udpTimeout", v.udp_timeout);
            if !IPVS_SCHEDULERS.contains(&v.scheduler.as_str()) {
                errs.push(n.invalid(
                    "ipvs.scheduler",
                    &v.scheduler,
                    "must be one of rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq, mh, or blank (rr)",
                ));
            }
            for c in v.exclude_cidrs.iter().flatten() {
                if c.parse::<IpNet>().is_err() {
                    errs.push(n.invalid(
                        "ipvs.excludeCIDRs",
                        c,
                        "must be a valid CIDR block (e.g. 10.100.0.0/16)",
                    ));
                }
            }
        }
        if mode == Some(ProxyMode::Nftables) {
            check_bit(n, errs, "nftables.masqueradeBit", self.nftables.masquerade_bit);
            check_periods(
                n, errs, "nftables", self.nftables.sync_period, self.nftables.min_sync_period,
            );
        }
    }

    fn check_conntrack(&self, n: &Namer, errs: &mut Vec<ConfigError>) {
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
            check_non_negative(n, errs, field, d);
        }
    }

    /// The API client, the process, the servers' and the node's addresses and ranges.
    fn check_client_and_addresses(&self, n: &Namer, errs: &mut Vec<ConfigError>) {
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
    }

    /// `detectLocalMode` and the interfaces of `detectLocal`.
    fn check_detect_local(&self, n: &Namer, errs: &mut Vec<ConfigError>) {
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
    }

    /// component-base's logsapi.Validate.
    fn check_logging(&self, n: &Namer, errs: &mut Vec<ConfigError>) {
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
    }
}

fn check_bit(n: &Namer, errs: &mut Vec<ConfigError>, field: &str, v: Option<i32>) {
    if let Some(b) = v.filter(|b| !(0..=31).contains(b)) {
        errs.push(n.invalid(field, b, "must be within the range [0, 31]"));
    }
}

/// A section's `syncPeriod` and `minSyncPeriod`.
fn check_periods(n: &Namer, errs: &mut Vec<ConfigError>, section: &str, sync: GoDuration, min: GoDuration) {
    let (sf, mf) = (format!("{section}.syncPeriod"), format!("{section}.minSyncPeriod"));
    if sync.0 <= 0 {
        errs.push(n.invalid(&sf, sync, "must be greater than 0"));
    }
    if min.is_negative() {
        errs.push(n.invalid(&mf, min, "must be greater than or equal to 0"));
    } else if sync.0 > 0 && min > sync {
        errs.push(n.invalid(&mf, min, format!("must not be greater than {} ({sync})", n.name(&sf).0)));
    }
}

fn check_non_negative(n: &Namer, errs: &mut Vec<ConfigError>, field: &str, d: GoDuration) {
    if d.is_negative() {
        errs.push(n.invalid(field, d, "must be greater than or equal to 0"));
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{HEADER, write_config};
    use crate::config::{Flags, ProxyConfig};

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
}
