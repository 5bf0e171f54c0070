//! The `kube-proxy` binary: upstream's flags, plus the subcommands `render` and `trace`.
//! A thin edge: parsing, reading files and printing; everything else lives in the library.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand, ValueEnum};

use kube_proxy::app;
use kube_proxy::config::{Flags, ProxyConfig, ProxyMode};
use kube_proxy::iptables::render::local_addresses;
use kube_proxy::iptables::trace::{self, Packet, TraceContext};
use kube_proxy::manifest;
use kube_proxy::model::{IpFamily, Protocol};

#[derive(Parser, Debug)]
#[command(
    name = "kube-proxy",
    version,
    about = "kube-proxy-rs: a drop-in replacement for Kubernetes' kube-proxy"
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

/// Upstream kube-proxy flags that shape the rules (same names, defaults and meaning).
#[derive(Args, Debug, Default, Clone)]
struct ProxyFlags {
    /// Path to a KubeProxyConfiguration file; it replaces the flags below except --hostname-override.
    #[arg(long, global = true)]
    config: Option<String>,
    /// iptables (default), ipvs or nftables.
    #[arg(long, global = true)]
    proxy_mode: Option<String>,
    /// The node's name (default: the hostname).
    #[arg(long, global = true)]
    hostname_override: Option<String>,
    /// Overrides the node's primary IP.
    #[arg(long, global = true)]
    bind_address: Option<String>,
    /// The pod CIDR range(s) of the cluster, comma-separated (one per family).
    #[arg(long, global = true)]
    cluster_cidr: Option<String>,
    /// ClusterCIDR (default), NodeCIDR, BridgeInterface or InterfaceNamePrefix.
    #[arg(long, global = true)]
    detect_local_mode: Option<String>,
    #[arg(long, global = true)]
    pod_bridge_interface: Option<String>,
    #[arg(long, global = true)]
    pod_interface_name_prefix: Option<String>,
    /// SNAT all traffic sent via Service cluster IPs.
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    masquerade_all: Option<bool>,
    /// CIDRs (or "primary") of the node addresses that accept NodePorts; repeatable, comma-separated.
    #[arg(long, global = true, value_delimiter = ',')]
    nodeport_addresses: Option<Vec<String>>,
    /// The fwmark bit that marks packets for SNAT (0-31).
    #[arg(long, global = true)]
    iptables_masquerade_bit: Option<i64>,
    /// Accept NodePort connections on 127.0.0.1 (IPv4 iptables mode).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    iptables_localhost_nodeports: Option<bool>,
    /// key=bool pairs, comma-separated.
    #[arg(long, global = true, value_delimiter = ',')]
    feature_gates: Vec<String>,
    /// The node's IP address(es), overriding the Node object's addresses (repeatable; new in kube-proxy-rs).
    #[arg(long = "node-ip", global = true)]
    node_ip: Vec<String>,
    /// How often rules are checked and failed syncs retried (e.g. 30s, 2m0s).
    #[arg(long, global = true)]
    iptables_sync_period: Option<String>,
    /// The minimum time between two syncs (e.g. 1s, 500ms).
    #[arg(long, global = true)]
    iptables_min_sync_period: Option<String>,
    #[arg(long, global = true)]
    conntrack_max_per_core: Option<i64>,
    #[arg(long, global = true)]
    conntrack_min: Option<i64>,
    #[arg(long, global = true)]
    conntrack_tcp_timeout_established: Option<String>,
    #[arg(long, global = true)]
    conntrack_tcp_timeout_close_wait: Option<String>,
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    conntrack_tcp_be_liberal: Option<bool>,
    #[arg(long, global = true)]
    conntrack_udp_timeout: Option<String>,
    #[arg(long, global = true)]
    conntrack_udp_timeout_stream: Option<String>,
}

/// Daemon-only flags.
#[derive(Args, Debug, Default, Clone)]
struct DaemonFlags {
    /// Take Services, EndpointSlices and the Node from this directory of manifests, re-read on
    /// change (new in kube-proxy-rs; the Kubernetes API source is not in this build yet).
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// Remove every rule kube-proxy created (all modes) and exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    cleanup: Option<bool>,
    /// Log verbosity (klog's -v).
    #[arg(short = 'v', long = "v", global = true, default_value_t = 0)]
    verbosity: u8,
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

impl ProxyFlags {
    fn to_flags(&self) -> anyhow::Result<Flags> {
        let mut gates = std::collections::BTreeMap::new();
        for g in self.feature_gates.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            let (k, v) = g
                .split_once('=')
                .with_context(|| format!("invalid value {g:?} for --feature-gates: expected key=bool"))?;
            let v: bool = v
                .trim()
                .parse()
                .with_context(|| format!("invalid value {g:?} for --feature-gates: expected key=bool"))?;
            gates.insert(k.trim().to_string(), v);
        }
        Ok(Flags {
            config: self.config.clone(),
            proxy_mode: self.proxy_mode.clone(),
            hostname_override: self.hostname_override.clone(),
            bind_address: self.bind_address.clone(),
            cluster_cidr: self.cluster_cidr.clone(),
            detect_local_mode: self.detect_local_mode.clone(),
            pod_bridge_interface: self.pod_bridge_interface.clone(),
            pod_interface_name_prefix: self.pod_interface_name_prefix.clone(),
            masquerade_all: self.masquerade_all,
            nodeport_addresses: self.nodeport_addresses.clone(),
            iptables_masquerade_bit: self.iptables_masquerade_bit,
            iptables_localhost_nodeports: self.iptables_localhost_nodeports,
            feature_gates: gates,
            node_ips: self.node_ip.clone(),
            iptables_sync_period: self.iptables_sync_period.clone(),
            iptables_min_sync_period: self.iptables_min_sync_period.clone(),
            conntrack_max_per_core: self.conntrack_max_per_core,
            conntrack_min: self.conntrack_min,
            conntrack_tcp_timeout_established: self.conntrack_tcp_timeout_established.clone(),
            conntrack_tcp_timeout_close_wait: self.conntrack_tcp_timeout_close_wait.clone(),
            conntrack_tcp_be_liberal: self.conntrack_tcp_be_liberal,
            conntrack_udp_timeout: self.conntrack_udp_timeout.clone(),
            conntrack_udp_timeout_stream: self.conntrack_udp_timeout_stream.clone(),
        })
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

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    init_logging(cli.daemon.verbosity);
    let cfg = ProxyConfig::resolve(&cli.flags.to_flags()?)?;
    for w in &cfg.warnings {
        eprintln!("warning: {w}");
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
                kube_proxy::lab::run::main(binary, cfg.mode, args.connections).map(|_| ExitCode::SUCCESS)
            }
        },
    }
}

fn init_logging(verbosity: u8) {
    let level = match verbosity {
        0 | 1 => tracing::Level::INFO,
        2 | 3 => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    };
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

fn daemon(cfg: ProxyConfig, flags: DaemonFlags) -> anyhow::Result<ExitCode> {
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
    require_iptables(&cfg)?;
    let Some(manifests) = flags.manifests else {
        bail!("no source of Services: pass --manifests DIR (the Kubernetes API source is not in this build yet)");
    };
    if !manifests.is_dir() {
        bail!(
            "invalid value {:?} for --manifests: not a directory",
            manifests.display().to_string()
        );
    }
    kube_proxy::daemon::run(kube_proxy::daemon::DaemonOptions {
        config: cfg,
        source: kube_proxy::daemon::SourceConfig::Manifests(manifests),
    })?;
    Ok(ExitCode::SUCCESS)
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
            "proxy mode {:?} is not supported by this build yet; only iptables",
            cfg.mode.as_str()
        );
    }
    Ok(())
}

fn render(cfg: &ProxyConfig, args: RenderArgs) -> anyhow::Result<ExitCode> {
    require_iptables(cfg)?;
    let objects = load(&args.paths)?;
    let families = match args.ip_family {
        Some(FamilyArg::V4) => vec![IpFamily::V4],
        Some(FamilyArg::V6) => vec![IpFamily::V6],
        None => app::families_in_use(&objects, &app::node_info(&objects, cfg)),
    };
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
    require_iptables(cfg)?;
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
    let rendered = app::render_iptables(&objects, cfg, &[family]);
    let fr = rendered.first().context("no ruleset rendered")?;
    for w in &fr.state.warnings {
        eprintln!("warning: {w}");
    }
    let packet = Packet {
        src: args.from,
        dst: args.to.ip(),
        dport: args.to.port(),
        protocol,
        in_interface: args.in_interface.clone(),
    };
    let ctx = TraceContext {
        local_addresses: local_addresses(&fr.state),
    };
    let result = trace::trace(&fr.ruleset, &ctx, &packet)?;
    match args.output {
        OutputArg::Json => println!("{}", serde_json::to_string_pretty(&result)?),
        OutputArg::Text => print!("{}", trace::render_text(&result, &packet)),
    }
    Ok(ExitCode::SUCCESS)
}
