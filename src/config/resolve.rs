//! Upstream's precedence between flags and a configuration file, resolved into the validated
//! [`ProxyConfig`]; the feature gates kube-proxy-rs knows; one warning per setting that is
//! accepted but has no effect here.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::file::{KubeProxyConfiguration, read_file};
use super::flags::{Flags, SURVIVE_CONFIG};
use super::types::{
    ClientConnection, ConfigFile, DetectLocalMode, IpvsConfig, LogFormat, LoggingConfig, ProxyConfig, ProxyMode,
};
use super::validate::{Namer, parse_bind};
use super::{API_VERSION, ConfigError, DEFAULT_OOM_SCORE_ADJ, KIND, invalid};

/// What kube-proxy-rs does with a feature gate.
enum Gate {
    /// Both values are honoured; the default applies when unset.
    Honoured(bool),
    /// The behaviour is fixed (the feature is GA or locked upstream); only this value is honoured.
    Fixed(bool),
}

/// The feature gates kube-proxy-rs knows, with upstream's stage of each in the newest release
/// (the `stage` label of `kubernetes_feature_enabled`: `ALPHA`, `BETA`, `""` for GA; `None`: a
/// gate upstream no longer has, which is not exported). Others are accepted with a warning
/// (upstream knows every Kubernetes gate and rejects unknown names; a cluster-wide list must
/// still load here).
const FEATURE_GATES: &[(&str, Gate, Option<&str>)] = &[
    ("PreferSameTrafficDistribution", Gate::Honoured(true), Some("")),
    ("LoggingAlphaOptions", Gate::Honoured(false), Some("ALPHA")),
    ("LoggingBetaOptions", Gate::Fixed(true), Some("BETA")),
    ("ContextualLogging", Gate::Fixed(true), Some("BETA")),
    ("TopologyAwareHints", Gate::Fixed(true), Some("")),
    ("ServiceTrafficDistribution", Gate::Fixed(true), Some("")),
    ("KubeProxyDrainingTerminatingNodes", Gate::Fixed(true), None),
    ("NFTablesProxyMode", Gate::Fixed(true), Some("")),
];

/// The gates every component-base feature gate lists besides its own (exported with the value
/// given, off by default; kube-proxy-rs has no gate they would switch on).
const META_GATES: &[(&str, &str)] = &[("AllAlpha", "ALPHA"), ("AllBeta", "BETA")];

/// One row of `kubernetes_feature_enabled`: a gate, its stage, whether it is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateState {
    pub name: String,
    pub stage: &'static str,
    pub enabled: bool,
}

impl ProxyConfig {
    /// The known gates as they are in effect, for `kubernetes_feature_enabled` (component-base
    /// lists every gate of the component; these are the ones kube-proxy-rs has).
    pub fn gate_states(&self) -> Vec<GateState> {
        let known = FEATURE_GATES.iter().filter_map(|(name, gate, stage)| {
            let enabled = match gate {
                Gate::Fixed(v) => *v,
                Gate::Honoured(_) => self.feature_enabled(name),
            };
            stage.map(|stage| GateState {
                name: name.to_string(),
                stage,
                enabled,
            })
        });
        let meta = META_GATES.iter().map(|(name, stage)| GateState {
            name: name.to_string(),
            stage,
            enabled: self.feature_enabled(name),
        });
        let mut all: Vec<GateState> = known.chain(meta).collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }
}

impl ProxyConfig {
    /// Applies upstream's precedence (see the module documentation), validates, and returns the
    /// effective configuration with its warnings.
    pub fn resolve(flags: &Flags) -> Result<ProxyConfig, ConfigError> {
        let mut warnings = Vec::new();
        let given = flags.given();
        let mut config_file = None;
        let mut kpc = match &flags.config {
            Some(path) => {
                let (text, mut file) = read_file(Path::new(path))?;
                config_file = Some(ConfigFile {
                    path: PathBuf::from(path),
                    content: text.into_bytes(),
                });
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
        let mut cfg = ProxyConfig::from_effective(kpc, flags, node_ips, warnings);
        cfg.config_file = config_file;
        Ok(cfg)
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
        for (name, gate, _) in FEATURE_GATES {
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
            config_file: None,
            effective: c,
            warnings,
        }
    }
}

/// What `unimplemented_warnings` reports through: a setting (by its field) and what happens to it.
type Note<'a> = dyn FnMut(&str, &str) + 'a;

impl KubeProxyConfiguration {
    /// One warning per setting that is accepted but has no effect in kube-proxy-rs.
    fn unimplemented_warnings(&self, n: &Namer) -> Vec<String> {
        let mut w = Vec::new();
        let d = KubeProxyConfiguration::defaults();
        let mode = ProxyMode::parse(&self.mode).unwrap_or(ProxyMode::Iptables);
        let mut note = |field: &str, what: &str| w.push(format!("{}: {what}", n.label(field)));
        self.warn_not_implemented(&d, &mut note);
        self.warn_other_modes(&d, mode, n.file.is_some(), &mut note);
        self.warn_logging_and_gates(&mut note);
        w
    }

    /// Settings kube-proxy-rs does not implement, and the Windows-only ones.
    fn warn_not_implemented(&self, d: &KubeProxyConfiguration, note: &mut Note) {
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
    }

    /// The sections of the proxy modes other than `mode` (set to other than their defaults).
    fn warn_other_modes(&self, d: &KubeProxyConfiguration, mode: ProxyMode, in_file: bool, note: &mut Note) {
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
            if in_file {
                if a.sync_period != b.sync_period {
                    note("iptables.syncPeriod", &only("iptables"));
                }
                if a.min_sync_period != b.min_sync_period {
                    note("iptables.minSyncPeriod", &only("iptables"));
                }
            }
        }
    }

    /// Logging buffers, and feature gates that are unknown or fixed here.
    fn warn_logging_and_gates(&self, note: &mut Note) {
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
            match FEATURE_GATES.iter().find(|(g, _, _)| g == name) {
                None => note(
                    "featureGates",
                    &format!("feature gate {name}={value} is not known to kube-proxy-rs; ignored"),
                ),
                Some((_, Gate::Fixed(fixed), _)) if fixed != value => note(
                    "featureGates",
                    &format!(
                        "feature gate {name}={value} is not supported by kube-proxy-rs (it always behaves as {name}={fixed}); ignored"
                    ),
                ),
                Some(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::{HEADER, write_config};

    #[test]
    fn gate_states_list_the_known_gates_with_upstream_stages() {
        let c = ProxyConfig::resolve(&Flags {
            feature_gates: vec!["LoggingAlphaOptions=true".into(), "AllBeta=true".into()],
            ..Flags::default()
        })
        .unwrap();
        let states = c.gate_states();
        let find = |n: &str| states.iter().find(|g| g.name == n).map(|g| (g.stage, g.enabled));
        assert_eq!(find("LoggingAlphaOptions"), Some(("ALPHA", true)));
        assert_eq!(find("LoggingBetaOptions"), Some(("BETA", true)));
        assert_eq!(find("NFTablesProxyMode"), Some(("", true)));
        assert_eq!(find("PreferSameTrafficDistribution"), Some(("", true)));
        assert_eq!(find("AllAlpha"), Some(("ALPHA", false)));
        assert_eq!(find("AllBeta"), Some(("BETA", true)));
        assert_eq!(find("KubeProxyDrainingTerminatingNodes"), None, "removed upstream");
        let names: Vec<&str> = states.iter().map(|g| g.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
    }

    #[test]
    fn the_config_file_is_kept_as_it_was_read() {
        // An unusual length: `write_config` names its directory by it.
        let text = format!("{HEADER}mode: nftables\n# the config-file watch compares these bytes, comment and all\n");
        let (dir, flags) = write_config(&text);
        let c = ProxyConfig::resolve(&flags).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        let f = c.config_file.expect("--config given");
        assert_eq!(f.content, text.as_bytes());
        assert_eq!(Some(f.path.display().to_string()), flags.config);
        assert!(ProxyConfig::resolve(&Flags::default()).unwrap().config_file.is_none());
    }

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
}
