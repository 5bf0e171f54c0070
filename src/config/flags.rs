//! Upstream's command-line flags: the clap definition itself ([`Flags`], [`LoggingFlags`]),
//! which flags were given, and upstream's mapping of flags onto the v1alpha1 fields (with the
//! flag that sets each field, for messages).

use std::collections::BTreeSet;

use super::file::{KubeProxyConfiguration, LoggingConfiguration, VModuleItem, append_port_if_needed, split_host_port};
use super::go::{GoDuration, Quantity, TimeOrMetaDuration, parse_go_bool};
use super::{ConfigError, HEALTHZ_PORT, METRICS_PORT, invalid};

/// Upstream kube-proxy's flags (same names, defaults, meaning and precedence), in their raw
/// form: None = not given on the command line. Durations, IPs and CIDRs stay strings so that
/// errors name the flag and the value as typed.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Flags {
    /// Path to a KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file. It replaces the
    /// other flags, except the logging flags, --hostname-override and --master.
    #[arg(long, global = true, value_name = "FILE", help_heading = "Configuration", allow_hyphen_values = true)]
    pub config: Option<String>,
    /// Feature gates as Name=true|false pairs, comma-separated (repeatable). Ignored with --config.
    #[arg(long, global = true, value_delimiter = ',', value_name = "NAME=BOOL,...", help_heading = "Configuration")]
    pub feature_gates: Vec<String>,

    /// Path to a kubeconfig file with the API server and credentials (default: in-cluster).
    #[arg(long, global = true, value_name = "FILE", help_heading = "API server", allow_hyphen_values = true)]
    pub kubeconfig: Option<String>,
    /// The address of the Kubernetes API server (overrides the kubeconfig's).
    #[arg(long, global = true, value_name = "URL", help_heading = "API server", allow_hyphen_values = true)]
    pub master: Option<String>,
    /// Content type of requests sent to the API server [default: application/vnd.kubernetes.protobuf].
    #[arg(long, global = true, value_name = "TYPE", help_heading = "API server", allow_hyphen_values = true)]
    pub kube_api_content_type: Option<String>,
    /// Queries per second to the API server [default: 5].
    #[arg(long, global = true, value_name = "QPS", help_heading = "API server", allow_negative_numbers = true)]
    pub kube_api_qps: Option<f32>,
    /// Burst of queries to the API server [default: 10].
    #[arg(long, global = true, value_name = "N", help_heading = "API server", allow_negative_numbers = true)]
    pub kube_api_burst: Option<i64>,
    /// Period of the informers' full resync, e.g. 15m0s [default: 15m0s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "API server", allow_hyphen_values = true)]
    pub config_sync_period: Option<String>,

    /// The name of this node [default: the hostname, lower-cased].
    #[arg(long, global = true, value_name = "NAME", help_heading = "Node", allow_hyphen_values = true)]
    pub hostname_override: Option<String>,
    /// Overrides the node's primary IP (despite the name, nothing binds to it) [default: 0.0.0.0].
    #[arg(long, global = true, value_name = "IP", help_heading = "Node", allow_hyphen_values = true)]
    pub bind_address: Option<String>,
    /// The node's IP address(es), overriding the Node object's addresses (repeatable,
    /// comma-separated; new in kube-proxy-rs).
    #[arg(long = "node-ip", global = true, value_name = "IP", help_heading = "Node")]
    pub node_ips: Vec<String>,
    /// The process's OOM score adjustment, -1000 to 1000 [default: -999].
    #[arg(long, global = true, value_name = "N", help_heading = "Node", allow_negative_numbers = true)]
    pub oom_score_adj: Option<i64>,

    /// IP:port of the health check server; empty disables it [default: 0.0.0.0:10256].
    #[arg(long, global = true, value_name = "IP[:PORT]", help_heading = "Servers", allow_hyphen_values = true)]
    pub healthz_bind_address: Option<String>,
    /// IP:port of the metrics server (0.0.0.0:10249 or [::]:10249 for all interfaces); empty
    /// disables it [default: 127.0.0.1:10249].
    #[arg(long, global = true, value_name = "IP[:PORT]", help_heading = "Servers", allow_hyphen_values = true)]
    pub metrics_bind_address: Option<String>,
    /// Exit if the health check or metrics server cannot bind its port.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Servers")]
    pub bind_address_hard_fail: Option<bool>,
    /// Serve /debug/pprof on the metrics server (not implemented by kube-proxy-rs).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Servers")]
    pub profiling: Option<bool>,
    /// Show metrics hidden in the given previous minor version, e.g. 1.33 (not implemented).
    #[arg(long, global = true, value_name = "X.Y", help_heading = "Servers", allow_hyphen_values = true)]
    pub show_hidden_metrics_for_version: Option<String>,
    /// Deprecated: the port of --healthz-bind-address when it has none; 0 disables the server.
    #[arg(long, global = true, hide = true, allow_negative_numbers = true)]
    pub healthz_port: Option<i64>,
    /// Deprecated: the port of --metrics-bind-address when it has none; 0 disables the server.
    #[arg(long, global = true, hide = true, allow_negative_numbers = true)]
    pub metrics_port: Option<i64>,
    /// Deprecated and unused (it configured the removed userspace proxy).
    #[arg(long, global = true, hide = true, allow_hyphen_values = true)]
    pub proxy_port_range: Option<String>,
    /// Files to read the boot id from (comma-separated, the first that exists). Accepted as
    /// upstream accepts it; nothing in kube-proxy reads it [default: /proc/sys/kernel/random/boot_id].
    #[arg(long, global = true, value_name = "FILE,...", help_heading = "Node", allow_hyphen_values = true)]
    pub boot_id_file: Option<String>,
    /// Files to read the machine id from (comma-separated, the first that exists). Accepted as
    /// upstream accepts it; nothing in kube-proxy reads it [default: /etc/machine-id,/var/lib/dbus/machine-id].
    #[arg(long, global = true, value_name = "FILE,...", help_heading = "Node", allow_hyphen_values = true)]
    pub machine_id_file: Option<String>,

    /// iptables (default), ipvs or nftables.
    #[arg(long, global = true, value_name = "MODE", help_heading = "Proxy mode", allow_hyphen_values = true)]
    pub proxy_mode: Option<String>,
    /// SNAT all traffic sent via Service cluster IPs.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Proxy mode")]
    pub masquerade_all: Option<bool>,
    /// CIDRs of the node addresses that accept NodePort connections, or "primary" for the node's
    /// primary IPs; repeatable, comma-separated [default: all local addresses; nftables: primary].
    #[arg(long, global = true, value_delimiter = ',', value_name = "CIDR,...", help_heading = "Proxy mode")]
    pub nodeport_addresses: Option<Vec<String>>,
    /// The fwmark bit (0-31) that marks packets for SNAT in iptables and ipvs modes [default: 14].
    #[arg(long, global = true, value_name = "BIT", help_heading = "Proxy mode", allow_negative_numbers = true)]
    pub iptables_masquerade_bit: Option<i64>,
    /// Accept NodePort connections on 127.0.0.1 (iptables mode, IPv4) [default: true].
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Proxy mode")]
    pub iptables_localhost_nodeports: Option<bool>,
    /// How often rules are checked and failed syncs retried, e.g. 30s, 2m0s; for every mode but
    /// ipvs [default: 30s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "Proxy mode", allow_hyphen_values = true)]
    pub iptables_sync_period: Option<String>,
    /// The minimum time between two syncs, e.g. 1s, 500ms; 0 syncs on every change; for every
    /// mode but ipvs [default: 1s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "Proxy mode", allow_hyphen_values = true)]
    pub iptables_min_sync_period: Option<String>,

    /// The sync period in ipvs mode [default: 30s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "IPVS mode", allow_hyphen_values = true)]
    pub ipvs_sync_period: Option<String>,
    /// The minimum time between two syncs in ipvs mode [default: 1s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "IPVS mode", allow_hyphen_values = true)]
    pub ipvs_min_sync_period: Option<String>,
    /// The IPVS scheduler: rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq or mh [default: rr].
    #[arg(long, global = true, value_name = "NAME", help_heading = "IPVS mode", allow_hyphen_values = true)]
    pub ipvs_scheduler: Option<String>,
    /// CIDRs the IPVS proxier must not touch when cleaning up; comma-separated.
    #[arg(long, global = true, value_delimiter = ',', value_name = "CIDR,...", help_heading = "IPVS mode")]
    pub ipvs_exclude_cidrs: Option<Vec<String>>,
    /// Set arp_ignore=1 and arp_announce=2.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "IPVS mode")]
    pub ipvs_strict_arp: Option<bool>,
    /// Idle timeout of IPVS TCP connections; 0 leaves it as is.
    #[arg(long, global = true, value_name = "DURATION", help_heading = "IPVS mode", allow_hyphen_values = true)]
    pub ipvs_tcp_timeout: Option<String>,
    /// Timeout of IPVS TCP connections after a FIN; 0 leaves it as is.
    #[arg(long, global = true, value_name = "DURATION", help_heading = "IPVS mode", allow_hyphen_values = true)]
    pub ipvs_tcpfin_timeout: Option<String>,
    /// Timeout of IPVS UDP packets; 0 leaves it as is.
    #[arg(long, global = true, value_name = "DURATION", help_heading = "IPVS mode", allow_hyphen_values = true)]
    pub ipvs_udp_timeout: Option<String>,

    /// How traffic from local pods is recognised: ClusterCIDR (default), NodeCIDR,
    /// BridgeInterface or InterfaceNamePrefix.
    #[arg(
        long,
        global = true,
        value_name = "MODE",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    pub detect_local_mode: Option<String>,
    /// The pods' CIDR range(s), comma-separated (one per IP family), for --detect-local-mode=ClusterCIDR.
    #[arg(
        long,
        global = true,
        value_name = "CIDR[,CIDR]",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    pub cluster_cidr: Option<String>,
    /// The pods' bridge, for --detect-local-mode=BridgeInterface.
    #[arg(
        long,
        global = true,
        value_name = "IFACE",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    pub pod_bridge_interface: Option<String>,
    /// The prefix of the pods' interfaces, for --detect-local-mode=InterfaceNamePrefix.
    #[arg(
        long,
        global = true,
        value_name = "PREFIX",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    pub pod_interface_name_prefix: Option<String>,

    /// Conntrack entries per CPU core; 0 leaves nf_conntrack_max (and --conntrack-min) alone [default: 32768].
    #[arg(long, global = true, value_name = "N", help_heading = "conntrack", allow_negative_numbers = true)]
    pub conntrack_max_per_core: Option<i64>,
    /// The least nf_conntrack_max to ask for [default: 131072].
    #[arg(long, global = true, value_name = "N", help_heading = "conntrack", allow_negative_numbers = true)]
    pub conntrack_min: Option<i64>,
    /// Idle timeout of established TCP connections; 0 leaves it as is [default: 24h0m0s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "conntrack", allow_hyphen_values = true)]
    pub conntrack_tcp_timeout_established: Option<String>,
    /// Timeout of TCP connections in CLOSE_WAIT; 0 leaves it as is [default: 1h0m0s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "conntrack", allow_hyphen_values = true)]
    pub conntrack_tcp_timeout_close_wait: Option<String>,
    /// Set nf_conntrack_tcp_be_liberal=1 (out-of-window TCP packets are not INVALID).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "conntrack")]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// Idle timeout of UNREPLIED UDP entries; 0 leaves it as is [default: 0s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "conntrack", allow_hyphen_values = true)]
    pub conntrack_udp_timeout: Option<String>,
    /// Idle timeout of ASSURED UDP entries; 0 leaves it as is [default: 0s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "conntrack", allow_hyphen_values = true)]
    pub conntrack_udp_timeout_stream: Option<String>,

    #[command(flatten)]
    pub logging: LoggingFlags,
}

/// component-base's logging flags; they survive `--config` (flags win over the file).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LoggingFlags {
    /// Log verbosity: 0-1 info and up, 2-3 adds debug, 4+ adds trace (6/9: libraries' debug/trace).
    #[arg(short = 'v', long = "v", global = true, value_name = "N", help_heading = "Logging")]
    pub verbosity: Option<u32>,
    /// Per-file verbosity, pattern=N pairs, comma-separated (pattern: file name without .rs, globs allowed).
    #[arg(long, global = true, value_delimiter = ',', value_name = "PATTERN=N,...", help_heading = "Logging")]
    pub vmodule: Vec<String>,
    /// Log format: text (klog lines, default) or json.
    #[arg(long, global = true, value_name = "FORMAT", help_heading = "Logging", allow_hyphen_values = true)]
    pub logging_format: Option<String>,
    /// Maximum time between log flushes (lines are written unbuffered) [default: 5s].
    #[arg(long, global = true, value_name = "DURATION", help_heading = "Logging", allow_hyphen_values = true)]
    pub log_flush_frequency: Option<String>,
    /// In JSON format, errors to stderr and the rest to stdout (needs LoggingAlphaOptions).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Logging")]
    pub log_json_split_stream: Option<bool>,
    /// In JSON format with split streams, the info stream's buffer (not implemented; needs LoggingAlphaOptions).
    #[arg(long, global = true, value_name = "SIZE", help_heading = "Logging", allow_hyphen_values = true)]
    pub log_json_info_buffer_size: Option<String>,
    /// In text format, errors to stderr and the rest to stdout (needs LoggingAlphaOptions).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Logging")]
    pub log_text_split_stream: Option<bool>,
    /// In text format with split streams, the info stream's buffer (not implemented; needs LoggingAlphaOptions).
    #[arg(long, global = true, value_name = "SIZE", help_heading = "Logging", allow_hyphen_values = true)]
    pub log_text_info_buffer_size: Option<String>,
}

/// Flags that keep their effect when `--config` is given.
pub(super) const SURVIVE_CONFIG: &[&str] = &[
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

pub(super) fn flag_for_field(field: &str) -> Option<&'static str> {
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
            ("--boot-id-file", self.boot_id_file.is_some()),
            ("--machine-id-file", self.machine_id_file.is_some()),
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
    /// The first invalid value is the error, in the order of upstream's flags.
    pub(super) fn apply_to(
        &self,
        c: &mut KubeProxyConfiguration,
        warnings: &mut Vec<String>,
    ) -> Result<(), ConfigError> {
        if let Some(m) = &self.proxy_mode {
            c.mode = m.trim().to_string();
        }
        self.apply_client_and_servers(c, warnings)?;
        self.apply_proxy_mode(c, warnings)?;
        // Upstream takes these two from Go's flag set (they belong to no kube-proxy setting).
        for (flag, given) in [
            ("--boot-id-file", self.boot_id_file.is_some()),
            ("--machine-id-file", self.machine_id_file.is_some()),
        ] {
            if given {
                warnings.push(format!(
                    "{flag} has no effect: nothing in kube-proxy reads it, upstream included"
                ));
            }
        }
        self.apply_node(c)
    }

    /// Feature gates, the API client, and the addresses of the node and the servers.
    fn apply_client_and_servers(
        &self,
        c: &mut KubeProxyConfiguration,
        warnings: &mut Vec<String>,
    ) -> Result<(), ConfigError> {
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
        if let Some(v) = flag_int32("--kube-api-burst", self.kube_api_burst)? {
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
        Ok(())
    }

    /// The settings of the proxy modes (`mode` is already set).
    fn apply_proxy_mode(&self, c: &mut KubeProxyConfiguration, warnings: &mut Vec<String>) -> Result<(), ConfigError> {
        let mode = c.mode.clone();
        if let Some(v) = flag_int32("--iptables-masquerade-bit", self.iptables_masquerade_bit)? {
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
        let ipt_sync = flag_duration("--iptables-sync-period", &self.iptables_sync_period)?;
        let ipt_min = flag_duration("--iptables-min-sync-period", &self.iptables_min_sync_period)?;
        let ipvs_sync = flag_duration("--ipvs-sync-period", &self.ipvs_sync_period)?;
        let ipvs_min = flag_duration("--ipvs-min-sync-period", &self.ipvs_min_sync_period)?;
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
            c.ipvs.exclude_cidrs = Some(trimmed_items(v));
        }
        if let Some(v) = self.ipvs_strict_arp {
            c.ipvs.strict_arp = v;
        }
        if let Some(v) = flag_duration("--ipvs-tcp-timeout", &self.ipvs_tcp_timeout)? {
            c.ipvs.tcp_timeout = v;
        }
        if let Some(v) = flag_duration("--ipvs-tcpfin-timeout", &self.ipvs_tcpfin_timeout)? {
            c.ipvs.tcp_fin_timeout = v;
        }
        if let Some(v) = flag_duration("--ipvs-udp-timeout", &self.ipvs_udp_timeout)? {
            c.ipvs.udp_timeout = v;
        }
        Ok(())
    }

    /// Local traffic detection, NodePort addresses, the process, conntrack and resync.
    fn apply_node(&self, c: &mut KubeProxyConfiguration) -> Result<(), ConfigError> {
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
            c.node_port_addresses = Some(trimmed_items(v));
        }
        if let Some(v) = flag_int32("--oom-score-adj", self.oom_score_adj)? {
            c.oom_score_adj = Some(v);
        }
        let ct = &mut c.conntrack;
        if let Some(v) = flag_int32("--conntrack-max-per-core", self.conntrack_max_per_core)? {
            ct.max_per_core = Some(v);
        }
        if let Some(v) = flag_int32("--conntrack-min", self.conntrack_min)? {
            ct.min = Some(v);
        }
        if let Some(v) = flag_duration(
            "--conntrack-tcp-timeout-established", &self.conntrack_tcp_timeout_established,
        )? {
            ct.tcp_established_timeout = Some(v);
        }
        if let Some(v) = flag_duration(
            "--conntrack-tcp-timeout-close-wait", &self.conntrack_tcp_timeout_close_wait,
        )? {
            ct.tcp_close_wait_timeout = Some(v);
        }
        if let Some(v) = self.conntrack_tcp_be_liberal {
            ct.tcp_be_liberal = v;
        }
        if let Some(v) = flag_duration("--conntrack-udp-timeout", &self.conntrack_udp_timeout)? {
            ct.udp_timeout = v;
        }
        if let Some(v) = flag_duration("--conntrack-udp-timeout-stream", &self.conntrack_udp_timeout_stream)? {
            ct.udp_stream_timeout = v;
        }
        if let Some(v) = flag_duration("--config-sync-period", &self.config_sync_period)? {
            c.config_sync_period = v;
        }
        if let Some(v) = &self.proxy_port_range {
            c.port_range = v.trim().to_string();
        }
        Ok(())
    }

    /// Upstream's copyLogsFromFlags: logging flags that were given override the configuration;
    /// `--vmodule` items come first, the file's follow.
    pub(super) fn apply_logging(&self, log: &mut LoggingConfiguration) -> Result<(), ConfigError> {
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

/// A duration flag as given (trimmed), the error naming the flag and the value as typed.
fn flag_duration(flag: &str, raw: &Option<String>) -> Result<Option<GoDuration>, ConfigError> {
    raw.as_deref()
        .map(|r| GoDuration::parse(r.trim()).map_err(|reason| invalid(flag, r, reason)))
        .transpose()
}

/// An integer flag that the configuration holds as a Go `int32`.
fn flag_int32(flag: &str, v: Option<i64>) -> Result<Option<i32>, ConfigError> {
    v.map(|v| i32::try_from(v).map_err(|_| invalid(flag, v, "must be a 32-bit integer")))
        .transpose()
}

/// A list flag's items, trimmed, without empty ones.
fn trimmed_items(v: &[String]) -> Vec<String> {
    v.iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Go's `strconv.ParseBool` as a clap value parser, as pflag's boolean flags.
pub(crate) fn go_bool(s: &str) -> Result<bool, String> {
    parse_go_bool(s).ok_or_else(|| format!("{s:?} is not a boolean (use true or false)"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::testing::{HEADER, write_config};
    use crate::config::{LogFormat, ProxyConfig};

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
}
