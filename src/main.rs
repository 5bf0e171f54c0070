//! The `kube-proxy` binary: upstream's flags, plus the subcommands `render`, `trace` and `lab`.
//! A thin edge: parsing, reading files and printing; everything else lives in the library.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tracing::{info, warn};

use kube_proxy::app;
use kube_proxy::config::{Flags, LoggingFlags, ProxyConfig, ProxyMode};
use kube_proxy::manifest;
use kube_proxy::model::{IpFamily, Protocol};
use kube_proxy::proxy::local_addresses;
use kube_proxy::trace::{self, Packet, TraceContext};

#[derive(Parser, Debug)]
#[command(
    name = "kube-proxy",
    about = "kube-proxy-rs: a drop-in replacement for Kubernetes' kube-proxy",
    long_about = "kube-proxy-rs: a drop-in replacement for Kubernetes' kube-proxy.\n\n\
        Without a subcommand it runs the node daemon: it watches Services, EndpointSlices and its Node \
        (from the API server, or from --manifests DIR) and keeps the node's iptables rules in sync. \
        It takes upstream kube-proxy's flags and KubeProxyConfiguration (v1alpha1) file, with \
        upstream's defaults and precedence: --config replaces the other flags except the logging \
        flags, --hostname-override and --master. Flag names also accept '_' for '-', and booleans \
        take --flag or --flag=false (not --flag false), as in upstream.",
    disable_version_flag = true,
    max_term_width = 110
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    flags: ProxyFlags,
    #[command(flatten)]
    daemon: DaemonFlags,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the rules a full sync would apply for the given manifests.
    Render(RenderArgs),
    /// Follow one new packet through the rules rendered for the given manifests.
    Trace(TraceArgs),
    /// Build a throw-away node, pods and an outside host in network namespaces, run the proxy
    /// there and show what it does (needs root; never touches the root namespace).
    Lab(LabArgs),
}

#[derive(Args, Debug)]
struct LabArgs {
    #[command(subcommand)]
    action: Option<LabAction>,
    /// New connections for the distribution experiment.
    #[arg(long, default_value_t = 300)]
    connections: u32,
}

#[derive(Subcommand, Debug)]
enum LabAction {
    /// A TCP+UDP server that answers with its name (used inside lab and test namespaces).
    #[command(hide = true)]
    Serve(kube_proxy::lab::probe::ServeArgs),
    /// A client that opens connections or sends datagrams and reports who answered.
    #[command(hide = true)]
    Probe(kube_proxy::lab::probe::ProbeArgs),
}

/// Upstream kube-proxy's flags (same names, defaults, meaning and precedence).
#[derive(Args, Debug, Default, Clone)]
struct ProxyFlags {
    /// Path to a KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file. It replaces the
    /// other flags, except the logging flags, --hostname-override and --master.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        help_heading = "Configuration",
        allow_hyphen_values = true
    )]
    config: Option<String>,
    /// Feature gates as Name=true|false pairs, comma-separated (repeatable). Ignored with --config.
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        value_name = "NAME=BOOL,...",
        help_heading = "Configuration"
    )]
    feature_gates: Vec<String>,

    /// Path to a kubeconfig file with the API server and credentials (default: in-cluster).
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        help_heading = "API server",
        allow_hyphen_values = true
    )]
    kubeconfig: Option<String>,
    /// The address of the Kubernetes API server (overrides the kubeconfig's).
    #[arg(
        long,
        global = true,
        value_name = "URL",
        help_heading = "API server",
        allow_hyphen_values = true
    )]
    master: Option<String>,
    /// Content type of requests sent to the API server [default: application/vnd.kubernetes.protobuf].
    #[arg(
        long,
        global = true,
        value_name = "TYPE",
        help_heading = "API server",
        allow_hyphen_values = true
    )]
    kube_api_content_type: Option<String>,
    /// Queries per second to the API server [default: 5].
    #[arg(
        long,
        global = true,
        value_name = "QPS",
        help_heading = "API server",
        allow_negative_numbers = true
    )]
    kube_api_qps: Option<f32>,
    /// Burst of queries to the API server [default: 10].
    #[arg(
        long,
        global = true,
        value_name = "N",
        help_heading = "API server",
        allow_negative_numbers = true
    )]
    kube_api_burst: Option<i64>,
    /// Period of the informers' full resync, e.g. 15m0s [default: 15m0s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "API server",
        allow_hyphen_values = true
    )]
    config_sync_period: Option<String>,

    /// The name of this node [default: the hostname, lower-cased].
    #[arg(
        long,
        global = true,
        value_name = "NAME",
        help_heading = "Node",
        allow_hyphen_values = true
    )]
    hostname_override: Option<String>,
    /// Overrides the node's primary IP (despite the name, nothing binds to it) [default: 0.0.0.0].
    #[arg(
        long,
        global = true,
        value_name = "IP",
        help_heading = "Node",
        allow_hyphen_values = true
    )]
    bind_address: Option<String>,
    /// The node's IP address(es), overriding the Node object's addresses (repeatable,
    /// comma-separated; new in kube-proxy-rs).
    #[arg(long = "node-ip", global = true, value_name = "IP", help_heading = "Node")]
    node_ip: Vec<String>,
    /// The process's OOM score adjustment, -1000 to 1000 [default: -999].
    #[arg(
        long,
        global = true,
        value_name = "N",
        help_heading = "Node",
        allow_negative_numbers = true
    )]
    oom_score_adj: Option<i64>,

    /// IP:port of the health check server; empty disables it [default: 0.0.0.0:10256].
    #[arg(
        long,
        global = true,
        value_name = "IP[:PORT]",
        help_heading = "Servers",
        allow_hyphen_values = true
    )]
    healthz_bind_address: Option<String>,
    /// IP:port of the metrics server (0.0.0.0:10249 or [::]:10249 for all interfaces); empty
    /// disables it [default: 127.0.0.1:10249].
    #[arg(
        long,
        global = true,
        value_name = "IP[:PORT]",
        help_heading = "Servers",
        allow_hyphen_values = true
    )]
    metrics_bind_address: Option<String>,
    /// Exit if the health check or metrics server cannot bind its port.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Servers")]
    bind_address_hard_fail: Option<bool>,
    /// Serve /debug/pprof on the metrics server (not implemented by kube-proxy-rs).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Servers")]
    profiling: Option<bool>,
    /// Show metrics hidden in the given previous minor version, e.g. 1.33 (not implemented).
    #[arg(
        long,
        global = true,
        value_name = "X.Y",
        help_heading = "Servers",
        allow_hyphen_values = true
    )]
    show_hidden_metrics_for_version: Option<String>,
    /// Deprecated: the port of --healthz-bind-address when it has none; 0 disables the server.
    #[arg(long, global = true, hide = true, allow_negative_numbers = true)]
    healthz_port: Option<i64>,
    /// Deprecated: the port of --metrics-bind-address when it has none; 0 disables the server.
    #[arg(long, global = true, hide = true, allow_negative_numbers = true)]
    metrics_port: Option<i64>,
    /// Deprecated and unused (it configured the removed userspace proxy).
    #[arg(long, global = true, hide = true, allow_hyphen_values = true)]
    proxy_port_range: Option<String>,

    /// iptables (default), ipvs or nftables.
    #[arg(
        long,
        global = true,
        value_name = "MODE",
        help_heading = "Proxy mode",
        allow_hyphen_values = true
    )]
    proxy_mode: Option<String>,
    /// SNAT all traffic sent via Service cluster IPs.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Proxy mode")]
    masquerade_all: Option<bool>,
    /// CIDRs of the node addresses that accept NodePort connections, or "primary" for the node's
    /// primary IPs; repeatable, comma-separated [default: all local addresses; nftables: primary].
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        value_name = "CIDR,...",
        help_heading = "Proxy mode"
    )]
    nodeport_addresses: Option<Vec<String>>,
    /// The fwmark bit (0-31) that marks packets for SNAT in iptables and ipvs modes [default: 14].
    #[arg(
        long,
        global = true,
        value_name = "BIT",
        help_heading = "Proxy mode",
        allow_negative_numbers = true
    )]
    iptables_masquerade_bit: Option<i64>,
    /// Accept NodePort connections on 127.0.0.1 (iptables mode, IPv4) [default: true].
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Proxy mode")]
    iptables_localhost_nodeports: Option<bool>,
    /// How often rules are checked and failed syncs retried, e.g. 30s, 2m0s; for every mode but
    /// ipvs [default: 30s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "Proxy mode",
        allow_hyphen_values = true
    )]
    iptables_sync_period: Option<String>,
    /// The minimum time between two syncs, e.g. 1s, 500ms; 0 syncs on every change; for every
    /// mode but ipvs [default: 1s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "Proxy mode",
        allow_hyphen_values = true
    )]
    iptables_min_sync_period: Option<String>,

    /// The sync period in ipvs mode [default: 30s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "IPVS mode",
        allow_hyphen_values = true
    )]
    ipvs_sync_period: Option<String>,
    /// The minimum time between two syncs in ipvs mode [default: 1s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "IPVS mode",
        allow_hyphen_values = true
    )]
    ipvs_min_sync_period: Option<String>,
    /// The IPVS scheduler: rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq or mh [default: rr].
    #[arg(
        long,
        global = true,
        value_name = "NAME",
        help_heading = "IPVS mode",
        allow_hyphen_values = true
    )]
    ipvs_scheduler: Option<String>,
    /// CIDRs the IPVS proxier must not touch when cleaning up; comma-separated.
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        value_name = "CIDR,...",
        help_heading = "IPVS mode"
    )]
    ipvs_exclude_cidrs: Option<Vec<String>>,
    /// Set arp_ignore=1 and arp_announce=2.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "IPVS mode")]
    ipvs_strict_arp: Option<bool>,
    /// Idle timeout of IPVS TCP connections; 0 leaves it as is.
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "IPVS mode",
        allow_hyphen_values = true
    )]
    ipvs_tcp_timeout: Option<String>,
    /// Timeout of IPVS TCP connections after a FIN; 0 leaves it as is.
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "IPVS mode",
        allow_hyphen_values = true
    )]
    ipvs_tcpfin_timeout: Option<String>,
    /// Timeout of IPVS UDP packets; 0 leaves it as is.
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "IPVS mode",
        allow_hyphen_values = true
    )]
    ipvs_udp_timeout: Option<String>,

    /// How traffic from local pods is recognised: ClusterCIDR (default), NodeCIDR,
    /// BridgeInterface or InterfaceNamePrefix.
    #[arg(
        long,
        global = true,
        value_name = "MODE",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    detect_local_mode: Option<String>,
    /// The pods' CIDR range(s), comma-separated (one per IP family), for --detect-local-mode=ClusterCIDR.
    #[arg(
        long,
        global = true,
        value_name = "CIDR[,CIDR]",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    cluster_cidr: Option<String>,
    /// The pods' bridge, for --detect-local-mode=BridgeInterface.
    #[arg(
        long,
        global = true,
        value_name = "IFACE",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    pod_bridge_interface: Option<String>,
    /// The prefix of the pods' interfaces, for --detect-local-mode=InterfaceNamePrefix.
    #[arg(
        long,
        global = true,
        value_name = "PREFIX",
        help_heading = "Local traffic detection",
        allow_hyphen_values = true
    )]
    pod_interface_name_prefix: Option<String>,

    /// Conntrack entries per CPU core; 0 leaves nf_conntrack_max (and --conntrack-min) alone [default: 32768].
    #[arg(
        long,
        global = true,
        value_name = "N",
        help_heading = "conntrack",
        allow_negative_numbers = true
    )]
    conntrack_max_per_core: Option<i64>,
    /// The least nf_conntrack_max to ask for [default: 131072].
    #[arg(
        long,
        global = true,
        value_name = "N",
        help_heading = "conntrack",
        allow_negative_numbers = true
    )]
    conntrack_min: Option<i64>,
    /// Idle timeout of established TCP connections; 0 leaves it as is [default: 24h0m0s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "conntrack",
        allow_hyphen_values = true
    )]
    conntrack_tcp_timeout_established: Option<String>,
    /// Timeout of TCP connections in CLOSE_WAIT; 0 leaves it as is [default: 1h0m0s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "conntrack",
        allow_hyphen_values = true
    )]
    conntrack_tcp_timeout_close_wait: Option<String>,
    /// Set nf_conntrack_tcp_be_liberal=1 (out-of-window TCP packets are not INVALID).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "conntrack")]
    conntrack_tcp_be_liberal: Option<bool>,
    /// Idle timeout of UNREPLIED UDP entries; 0 leaves it as is [default: 0s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "conntrack",
        allow_hyphen_values = true
    )]
    conntrack_udp_timeout: Option<String>,
    /// Idle timeout of ASSURED UDP entries; 0 leaves it as is [default: 0s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "conntrack",
        allow_hyphen_values = true
    )]
    conntrack_udp_timeout_stream: Option<String>,

    /// Log verbosity: 0-1 info and up, 2-3 adds debug, 4+ adds trace (6/9: libraries' debug/trace).
    #[arg(short = 'v', long = "v", global = true, value_name = "N", help_heading = "Logging")]
    verbosity: Option<u32>,
    /// Per-file verbosity, pattern=N pairs, comma-separated (pattern: file name without .rs, globs allowed).
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        value_name = "PATTERN=N,...",
        help_heading = "Logging"
    )]
    vmodule: Vec<String>,
    /// Log format: text (klog lines, default) or json.
    #[arg(
        long,
        global = true,
        value_name = "FORMAT",
        help_heading = "Logging",
        allow_hyphen_values = true
    )]
    logging_format: Option<String>,
    /// Maximum time between log flushes (lines are written unbuffered) [default: 5s].
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        help_heading = "Logging",
        allow_hyphen_values = true
    )]
    log_flush_frequency: Option<String>,
    /// In JSON format, errors to stderr and the rest to stdout (needs LoggingAlphaOptions).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Logging")]
    log_json_split_stream: Option<bool>,
    /// In JSON format with split streams, the info stream's buffer (not implemented; needs LoggingAlphaOptions).
    #[arg(
        long,
        global = true,
        value_name = "SIZE",
        help_heading = "Logging",
        allow_hyphen_values = true
    )]
    log_json_info_buffer_size: Option<String>,
    /// In text format, errors to stderr and the rest to stdout (needs LoggingAlphaOptions).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL", help_heading = "Logging")]
    log_text_split_stream: Option<bool>,
    /// In text format with split streams, the info stream's buffer (not implemented; needs LoggingAlphaOptions).
    #[arg(
        long,
        global = true,
        value_name = "SIZE",
        help_heading = "Logging",
        allow_hyphen_values = true
    )]
    log_text_info_buffer_size: Option<String>,
}

/// Daemon-only flags.
#[derive(Args, Debug, Default, Clone)]
struct DaemonFlags {
    /// Take Services, EndpointSlices and the Node from this directory of manifests, re-read on
    /// change, instead of the Kubernetes API (new in kube-proxy-rs).
    #[arg(long, value_name = "DIR")]
    manifests: Option<PathBuf>,
    /// Write the effective configuration (defaults, flags or --config) as a v1alpha1 YAML file and exit.
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "Configuration",
        allow_hyphen_values = true
    )]
    write_config_to: Option<PathBuf>,
    /// Remove every rule kube-proxy created (all modes) and exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    cleanup: Option<bool>,
    /// Do the setup that needs full root privileges (conntrack sysctls) and exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    init_only: Option<bool>,
    /// Print version information and exit (--version=raw: as JSON).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "true|raw")]
    version: Option<String>,
}

#[derive(Args, Debug)]
struct RenderArgs {
    /// Manifest files or directories (YAML or JSON).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Render only this family (default: the families the manifests use).
    #[arg(long, value_enum)]
    ip_family: Option<FamilyArg>,
}

#[derive(Args, Debug)]
struct TraceArgs {
    /// Manifest files or directories (YAML or JSON).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Source address of the packet.
    #[arg(long)]
    from: IpAddr,
    /// Destination IP:PORT ([IPv6]:PORT).
    #[arg(long)]
    to: SocketAddr,
    #[arg(long, default_value = "TCP")]
    protocol: String,
    /// The interface the packet arrives on (matters for interface-based local detection).
    #[arg(long)]
    in_interface: Option<String>,
    #[arg(long, value_enum, default_value = "text")]
    output: OutputArg,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FamilyArg {
    #[value(name = "IPv4")]
    V4,
    #[value(name = "IPv6")]
    V6,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OutputArg {
    Text,
    Json,
}

/// Go's `strconv.ParseBool`, as pflag's boolean flags.
fn go_bool(s: &str) -> Result<bool, String> {
    kube_proxy::config::parse_go_bool(s).ok_or_else(|| format!("{s:?} is not a boolean (use true or false)"))
}

impl ProxyFlags {
    fn to_flags(&self) -> Flags {
        Flags {
            config: self.config.clone(),
            feature_gates: self.feature_gates.clone(),
            kubeconfig: self.kubeconfig.clone(),
            master: self.master.clone(),
            kube_api_content_type: self.kube_api_content_type.clone(),
            kube_api_qps: self.kube_api_qps,
            kube_api_burst: self.kube_api_burst,
            hostname_override: self.hostname_override.clone(),
            bind_address: self.bind_address.clone(),
            healthz_bind_address: self.healthz_bind_address.clone(),
            metrics_bind_address: self.metrics_bind_address.clone(),
            bind_address_hard_fail: self.bind_address_hard_fail,
            profiling: self.profiling,
            show_hidden_metrics_for_version: self.show_hidden_metrics_for_version.clone(),
            proxy_mode: self.proxy_mode.clone(),
            iptables_masquerade_bit: self.iptables_masquerade_bit,
            masquerade_all: self.masquerade_all,
            iptables_localhost_nodeports: self.iptables_localhost_nodeports,
            iptables_sync_period: self.iptables_sync_period.clone(),
            iptables_min_sync_period: self.iptables_min_sync_period.clone(),
            ipvs_sync_period: self.ipvs_sync_period.clone(),
            ipvs_min_sync_period: self.ipvs_min_sync_period.clone(),
            ipvs_scheduler: self.ipvs_scheduler.clone(),
            ipvs_exclude_cidrs: self.ipvs_exclude_cidrs.clone(),
            ipvs_strict_arp: self.ipvs_strict_arp,
            ipvs_tcp_timeout: self.ipvs_tcp_timeout.clone(),
            ipvs_tcpfin_timeout: self.ipvs_tcpfin_timeout.clone(),
            ipvs_udp_timeout: self.ipvs_udp_timeout.clone(),
            detect_local_mode: self.detect_local_mode.clone(),
            pod_bridge_interface: self.pod_bridge_interface.clone(),
            pod_interface_name_prefix: self.pod_interface_name_prefix.clone(),
            cluster_cidr: self.cluster_cidr.clone(),
            nodeport_addresses: self.nodeport_addresses.clone(),
            oom_score_adj: self.oom_score_adj,
            conntrack_max_per_core: self.conntrack_max_per_core,
            conntrack_min: self.conntrack_min,
            conntrack_tcp_timeout_established: self.conntrack_tcp_timeout_established.clone(),
            conntrack_tcp_timeout_close_wait: self.conntrack_tcp_timeout_close_wait.clone(),
            conntrack_tcp_be_liberal: self.conntrack_tcp_be_liberal,
            conntrack_udp_timeout: self.conntrack_udp_timeout.clone(),
            conntrack_udp_timeout_stream: self.conntrack_udp_timeout_stream.clone(),
            config_sync_period: self.config_sync_period.clone(),
            healthz_port: self.healthz_port,
            metrics_port: self.metrics_port,
            proxy_port_range: self.proxy_port_range.clone(),
            node_ips: self.node_ip.clone(),
            logging: LoggingFlags {
                verbosity: self.verbosity,
                vmodule: self.vmodule.clone(),
                logging_format: self.logging_format.clone(),
                log_flush_frequency: self.log_flush_frequency.clone(),
                log_json_split_stream: self.log_json_split_stream,
                log_json_info_buffer_size: self.log_json_info_buffer_size.clone(),
                log_text_split_stream: self.log_text_split_stream,
                log_text_info_buffer_size: self.log_text_info_buffer_size.clone(),
            },
        }
    }
}

/// Upstream normalises `_` to `-` in flag names (`--cluster_cidr` ≡ `--cluster-cidr`).
fn normalize_args(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| match a.strip_prefix("--") {
        Some(rest) => match rest.split_once('=') {
            Some((name, value)) => format!("--{}={value}", name.replace('_', "-")),
            None => format!("--{}", rest.replace('_', "-")),
        },
        None => a,
    })
    .collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(normalize_args(std::env::args()));
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

const VERSION_LINE: &str = concat!(
    "kube-proxy-rs ",
    env!("CARGO_PKG_VERSION"),
    " (compatible with Kubernetes kube-proxy; configuration kubeproxy.config.k8s.io/v1alpha1)"
);

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if let Some(v) = &cli.daemon.version {
        match v.as_str() {
            "raw" => {
                let raw = serde_json::json!({
                    "name": "kube-proxy-rs",
                    "version": env!("CARGO_PKG_VERSION"),
                    "configAPIVersion": kube_proxy::config::API_VERSION,
                });
                println!("{}", serde_json::to_string_pretty(&raw)?);
                return Ok(ExitCode::SUCCESS);
            }
            other => match kube_proxy::config::parse_go_bool(other) {
                Some(true) => {
                    println!("{VERSION_LINE}");
                    return Ok(ExitCode::SUCCESS);
                }
                Some(false) => {}
                None => bail!("invalid value {other:?} for --version: must be true, false or raw"),
            },
        }
    }
    let cfg = ProxyConfig::resolve(&cli.flags.to_flags())?;
    kube_proxy::logging::init(&cfg.logging);
    // The CLI tools print plain warnings; the daemon logs them.
    let tool = cli.command.is_some();
    for w in &cfg.warnings {
        if tool {
            eprintln!("warning: {w}");
        } else {
            warn!("{w}");
        }
    }
    match cli.command {
        None => daemon(cfg, cli.daemon),
        Some(Command::Render(args)) => render(&cfg, args),
        Some(Command::Trace(args)) => trace_cmd(&cfg, args),
        Some(Command::Lab(args)) => match args.action {
            Some(LabAction::Serve(a)) => kube_proxy::lab::probe::serve(&a).map(|_| ExitCode::SUCCESS),
            Some(LabAction::Probe(a)) => kube_proxy::lab::probe::probe(&a).map(|_| ExitCode::SUCCESS),
            None => {
                let binary = std::env::current_exe().context("locating the kube-proxy binary")?;
                // As given: where the lab runs again in the VM, it parses them there itself.
                let argv: Vec<String> = std::env::args().skip(1).collect();
                kube_proxy::lab::run::main(binary, cfg.mode, args.connections, &argv)
            }
        },
    }
}

/// As upstream's `Options.Run`: --write-config-to, then --cleanup, then --init-only, then the daemon.
fn daemon(cfg: ProxyConfig, flags: DaemonFlags) -> anyhow::Result<ExitCode> {
    if let Some(path) = &flags.write_config_to {
        let yaml = cfg
            .to_yaml()
            .map_err(anyhow::Error::msg)
            .context("encoding the configuration")?;
        std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))?;
        info!(file = %path.display(), "Wrote configuration");
        return Ok(ExitCode::SUCCESS);
    }
    if flags.cleanup == Some(true) {
        let errors = kube_proxy::daemon::cleanup_all();
        for e in &errors {
            eprintln!("error: cleanup: {e}");
        }
        return Ok(if errors.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if flags.init_only == Some(true) {
        // Failures are logged (as warnings) by the conntrack module itself.
        let warnings = kube_proxy::conntrack::apply_sysctls_and_hashsize(
            &cfg.conntrack,
            Path::new("/proc/sys"),
            Some(Path::new(kube_proxy::conntrack::HASHSIZE_PATH)),
            kube_proxy::conntrack::detect_num_cpus(),
        );
        info!(warnings = warnings.len(), "Initialization done (--init-only)");
        return Ok(ExitCode::SUCCESS);
    }
    let source = match flags.manifests {
        Some(dir) => {
            if !dir.is_dir() {
                bail!(
                    "invalid value {:?} for --manifests: not a directory",
                    dir.display().to_string()
                );
            }
            kube_proxy::daemon::SourceConfig::Manifests(dir)
        }
        None => {
            let cc = &cfg.client_connection;
            kube_proxy::daemon::SourceConfig::Api(kube_proxy::daemon::ApiConfig {
                kubeconfig: cc.kubeconfig.clone(),
                master: cc.master.clone(),
                qps: cc.qps,
                burst: cc.burst,
                content_type: cc.content_type.clone(),
            })
        }
    };
    apply_oom_score_adj(cfg.oom_score_adj);
    kube_proxy::daemon::run(kube_proxy::daemon::DaemonOptions { config: cfg, source })?;
    Ok(ExitCode::SUCCESS)
}

/// `oomScoreAdj`: upstream's OOMAdjuster on its own process; a failure is not fatal.
fn apply_oom_score_adj(value: i32) {
    match std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        Ok(()) => info!(oom_score_adj = value, "Set the OOM score adjustment"),
        Err(e) => warn!(oom_score_adj = value, error = %e, "Could not set the OOM score adjustment"),
    }
}

fn load(paths: &[PathBuf]) -> anyhow::Result<manifest::Objects> {
    let objects = manifest::load_paths(paths)?;
    for w in &objects.warnings {
        eprintln!("warning: {w}");
    }
    Ok(objects)
}

fn require_iptables(cfg: &ProxyConfig) -> anyhow::Result<()> {
    if cfg.mode != ProxyMode::Iptables {
        bail!(
            "this command does not support proxy mode {:?} yet (iptables and nftables only)",
            cfg.mode.as_str()
        );
    }
    Ok(())
}

fn render(cfg: &ProxyConfig, args: RenderArgs) -> anyhow::Result<ExitCode> {
    let objects = load(&args.paths)?;
    let families = match args.ip_family {
        Some(FamilyArg::V4) => vec![IpFamily::V4],
        Some(FamilyArg::V6) => vec![IpFamily::V6],
        None => app::families_in_use(&objects, &app::node_info(&objects, cfg)),
    };
    if cfg.mode == ProxyMode::Nftables {
        // The transaction a full sync sends to `nft -f -`, per family.
        let node = app::node_info(&objects, cfg);
        let mut reported: std::collections::HashSet<String> = std::collections::HashSet::new();
        for (i, family) in families.iter().enumerate() {
            let state = kube_proxy::model::build_state(&objects, &node, *family);
            for w in state.warnings.iter().filter(|w| reported.insert((*w).clone())) {
                eprintln!("warning: {w}");
            }
            let opts = kube_proxy::proxy::RenderOptions::from_config(cfg, *family, &node);
            if i > 0 {
                println!();
            }
            println!("# nft -f - input ({family})");
            print!("{}", kube_proxy::nftables::render(&state, &opts));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if cfg.mode == ProxyMode::Ipvs {
        // The virtual servers, ipsets and iptables rules a full sync programs, per family.
        let node = app::node_info(&objects, cfg);
        let mut reported: std::collections::HashSet<String> = std::collections::HashSet::new();
        for (i, family) in families.iter().enumerate() {
            let state = kube_proxy::model::build_state(&objects, &node, *family);
            let opts = kube_proxy::ipvs::render::IpvsRenderOptions::from_config(cfg, *family, &node);
            let rendered = kube_proxy::ipvs::render::render(&state, &opts);
            for w in state.warnings.iter().chain(&rendered.warnings) {
                if reported.insert(w.clone()) {
                    eprintln!("warning: {w}");
                }
            }
            if i > 0 {
                println!();
            }
            print!("{}", rendered.to_text());
        }
        return Ok(ExitCode::SUCCESS);
    }
    require_iptables(cfg)?;
    let rendered = app::render_iptables(&objects, cfg, &families);
    let mut out = String::new();
    // A Service-level problem is found once per family; report it once.
    let mut reported = std::collections::HashSet::new();
    for (i, fr) in rendered.iter().enumerate() {
        for w in fr.state.warnings.iter().filter(|w| reported.insert(w.as_str())) {
            eprintln!("warning: {w}");
        }
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&fr.ruleset.annotated());
    }
    print!("{out}");
    Ok(ExitCode::SUCCESS)
}

fn trace_cmd(cfg: &ProxyConfig, args: TraceArgs) -> anyhow::Result<ExitCode> {
    if !matches!(cfg.mode, ProxyMode::Nftables | ProxyMode::Ipvs) {
        require_iptables(cfg)?;
    }
    let protocol = Protocol::from_api(&args.protocol.to_ascii_uppercase()).with_context(|| {
        format!(
            "invalid value {:?} for --protocol: must be TCP, UDP or SCTP",
            args.protocol
        )
    })?;
    if IpFamily::of(&args.from) != IpFamily::of(&args.to.ip()) {
        bail!("--from {} and --to {} are of different IP families", args.from, args.to);
    }
    let objects = load(&args.paths)?;
    let family = IpFamily::of(&args.to.ip());
    let packet = Packet {
        src: args.from,
        dst: args.to.ip(),
        dport: args.to.port(),
        protocol,
        in_interface: args.in_interface.clone(),
    };
    let result = if cfg.mode == ProxyMode::Nftables {
        // The table as the kernel holds it after the full sync that `render` prints.
        let node = app::node_info(&objects, cfg);
        let state = kube_proxy::model::build_state(&objects, &node, family);
        for w in &state.warnings {
            eprintln!("warning: {w}");
        }
        let opts = kube_proxy::proxy::RenderOptions::from_config(cfg, family, &node);
        let tx = kube_proxy::nftables::render::render_tx(&state, &opts, true);
        let table = kube_proxy::nftables::ruleset::Ruleset::from_transaction(&tx)
            .context("the rendered nftables transaction does not apply")?;
        let ctx = TraceContext {
            local_addresses: local_addresses(&state),
        };
        kube_proxy::nftables::trace::trace(&table, &ctx, &packet)?
    } else if cfg.mode == ProxyMode::Ipvs {
        // The virtual servers, ipsets and rules of the full sync that `render` prints.
        let node = app::node_info(&objects, cfg);
        let state = kube_proxy::model::build_state(&objects, &node, family);
        let opts = kube_proxy::ipvs::render::IpvsRenderOptions::from_config(cfg, family, &node);
        let rendered = kube_proxy::ipvs::render::render(&state, &opts);
        for w in state.warnings.iter().chain(&rendered.warnings) {
            eprintln!("warning: {w}");
        }
        let ctx = TraceContext {
            local_addresses: local_addresses(&state),
        };
        kube_proxy::ipvs::trace::trace(&rendered, &ctx, &packet)?
    } else {
        let rendered = app::render_iptables(&objects, cfg, &[family]);
        let fr = rendered.first().context("no ruleset rendered")?;
        for w in &fr.state.warnings {
            eprintln!("warning: {w}");
        }
        let ctx = TraceContext {
            local_addresses: local_addresses(&fr.state),
        };
        kube_proxy::iptables::trace::trace(&fr.ruleset, &ctx, &packet)?
    };
    match args.output {
        OutputArg::Json => println!("{}", serde_json::to_string_pretty(&result)?),
        OutputArg::Text => print!("{}", trace::render_text(&result, &packet)),
    }
    Ok(ExitCode::SUCCESS)
}
