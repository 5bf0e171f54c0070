//! The command line of the `kube-proxy` binary: upstream's flags ([`Flags`], defined in
//! [`crate::config`]), the daemon-only flags, and the subcommands `render`, `trace`, `lab` and
//! `explain`,
//! as clap parses them; plus upstream's `_` → `-` normalisation of flag names.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{Flags, go_bool};

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
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub flags: Flags,
    #[command(flatten)]
    pub daemon: DaemonFlags,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print the rules a full sync would apply for the given manifests.
    Render(RenderArgs),
    /// Follow one new packet through the rules rendered for the given manifests.
    Trace(TraceArgs),
    /// Build a throw-away node, pods and an outside host in network namespaces, run the proxy
    /// there and show what it does (needs root; never touches the root namespace).
    Lab(LabArgs),
    /// Say why a Service works or not on this node: its Service and endpoints as kube-proxy
    /// sees them, the kernel's rules, conntrack, routes, and one line per problem found (run as
    /// root in the node's network namespace). Exit status: 0 nothing wrong, 1 a problem found,
    /// 2 a usage error.
    Explain(ExplainArgs),
}

#[derive(Args, Debug)]
pub struct ExplainArgs {
    /// The Service: [NAMESPACE/]NAME[:PORT] (namespace `default` when omitted; the port by name
    /// or number, all its ports when omitted).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub service: Option<String>,
    /// One line per service port of every Service, with its status.
    #[arg(long)]
    pub all: bool,
    /// A client address to check against the Service (loadBalancerSourceRanges).
    #[arg(long)]
    pub from: Option<IpAddr>,
    /// Read Services, EndpointSlices and the Node from this directory of manifests instead of
    /// asking the running daemon (works when it is down). --kubeconfig reads them from the API.
    #[arg(long, value_name = "DIR")]
    pub manifests: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "text")]
    pub output: OutputArg,
}

#[derive(Args, Debug)]
pub struct LabArgs {
    #[command(subcommand)]
    pub action: Option<LabAction>,
    /// New connections for the distribution experiment.
    #[arg(long, default_value_t = 300)]
    pub connections: u32,
}

#[derive(Subcommand, Debug)]
pub enum LabAction {
    /// A TCP+UDP server that answers with its name (used inside lab and test namespaces).
    #[command(hide = true)]
    Serve(crate::lab::probe::ServeArgs),
    /// A client that opens connections or sends datagrams and reports who answered.
    #[command(hide = true)]
    Probe(crate::lab::probe::ProbeArgs),
}

/// Daemon-only flags.
#[derive(Args, Debug, Default, Clone)]
pub struct DaemonFlags {
    /// Take Services, EndpointSlices and the Node from this directory of manifests, re-read on
    /// change, instead of the Kubernetes API (new in kube-proxy-rs).
    #[arg(long, value_name = "DIR")]
    pub manifests: Option<PathBuf>,
    /// Let the metrics server's read-only /debug endpoints (/debug/services, /debug/rules) answer
    /// clients beyond loopback; by default only 127.0.0.1 and ::1 get an answer, whatever
    /// --metrics-bind-address is (new in kube-proxy-rs).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub debug_allow_remote: Option<bool>,
    /// Write the effective configuration (defaults, flags or --config) as a v1alpha1 YAML file and exit.
    #[arg(long, value_name = "FILE", help_heading = "Configuration", allow_hyphen_values = true)]
    pub write_config_to: Option<PathBuf>,
    /// Remove every rule kube-proxy created (all modes) and exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub cleanup: Option<bool>,
    /// Do the setup that needs full root privileges (conntrack sysctls) and exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub init_only: Option<bool>,
    /// Print version information and exit (--version=raw: as JSON).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "true|raw")]
    pub version: Option<String>,
}

#[derive(Args, Debug)]
pub struct RenderArgs {
    /// Manifest files or directories (YAML or JSON).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// Render only this family (default: the families the manifests use).
    #[arg(long, value_enum)]
    pub ip_family: Option<FamilyArg>,
}

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Manifest files or directories (YAML or JSON).
    #[arg(required_unless_present = "live", conflicts_with = "live")]
    pub paths: Vec<PathBuf>,
    /// Follow the packet through the rules the kernel holds now, in the configured mode,
    /// instead of through a render (as root, in the node's network namespace).
    #[arg(long)]
    pub live: bool,
    /// Source address of the packet.
    #[arg(long)]
    pub from: IpAddr,
    /// Destination IP:PORT ([IPv6]:PORT).
    #[arg(long)]
    pub to: SocketAddr,
    #[arg(long, default_value = "TCP")]
    pub protocol: String,
    /// The interface the packet arrives on (matters for interface-based local detection).
    #[arg(long)]
    pub in_interface: Option<String>,
    #[arg(long, value_enum, default_value = "text")]
    pub output: OutputArg,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum FamilyArg {
    #[value(name = "IPv4")]
    V4,
    #[value(name = "IPv6")]
    V6,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OutputArg {
    Text,
    Json,
}

/// Upstream normalises `_` to `-` in flag names (`--cluster_cidr` ≡ `--cluster-cidr`).
pub fn normalize_args(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| match a.strip_prefix("--") {
        Some(rest) => match rest.split_once('=') {
            Some((name, value)) => format!("--{}={value}", name.replace('_', "-")),
            None => format!("--{}", rest.replace('_', "-")),
        },
        None => a,
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        // clap's own checks of the definition (duplicate names, bad defaults), which it
        // otherwise runs only in debug builds when parsing.
        Cli::command().debug_assert();
    }
}
