//! kube-proxy-rs: a drop-in replacement for Kubernetes' kube-proxy.
//!
//! Layout (pure core, thin edges):
//! - [`manifest`]: reads Kubernetes objects from YAML/JSON files (no I/O beyond reading files).
//! - [`model`]: Services + EndpointSlices + Node → per-family service ports and endpoint sets,
//!   exactly as upstream's change trackers and `CategorizeEndpoints` compute them.
//! - [`config`]: `KubeProxyConfiguration` (v1alpha1) and upstream's flags with their precedence.
//! - [`cli`]: the binary's command line (upstream's flags, daemon flags, subcommands) for clap.
//! - [`exec`]: runs the node's tools (`iptables-restore`, `ip`, `ipset`, `nft`) with optional
//!   stdin, for every backend.
//! - [`iptables`]: the pure `iptables-restore` renderer and the packet tracer over its output.
//! - [`netlink`]: netlink message framing (building, splitting, attributes, error replies)
//!   shared by the IPVS, nftables and conntrack edges.
//! - [`trace`]: what `kube-proxy trace` reports in every mode (packet, paths, verdicts, errors)
//!   and the parts of the walk the three tracers share.
//! - [`vm`]: a throw-away VM with a kernel that has IPVS, for the VM tests and for
//!   `kube-proxy lab --proxy-mode=ipvs` on a kernel without it.
#![forbid(unsafe_code)]

pub mod app;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod daemon;
pub mod exec;
pub mod healthz;
pub mod http;
pub mod iptables;
pub mod ipvs;
pub mod lab;
pub mod logging;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod nftables;
pub mod proxy;
pub mod source;
pub mod trace;
pub mod vm;
