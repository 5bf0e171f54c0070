//! kube-proxy-rs: a drop-in replacement for Kubernetes' kube-proxy.
//!
//! Layout (pure core, thin edges):
//! - [`manifest`]: reads Kubernetes objects from YAML/JSON files (no I/O beyond reading files).
//! - [`model`]: Services + EndpointSlices + Node → per-family service ports and endpoint sets,
//!   exactly as upstream's change trackers and `CategorizeEndpoints` compute them.
//! - [`config`]: `KubeProxyConfiguration` (v1alpha1) and upstream's flags with their precedence.
//! - [`iptables`]: the pure `iptables-restore` renderer and the packet tracer over its output.
//! - [`trace`]: what `kube-proxy trace` reports in every mode (packet, paths, verdicts, errors)
//!   and the parts of the walk the three tracers share.
//! - [`vm`]: a throw-away VM with a kernel that has IPVS, for the VM tests and for
//!   `kube-proxy lab --proxy-mode=ipvs` on a kernel without it.
#![forbid(unsafe_code)]

pub mod app;
pub mod config;
pub mod conntrack;
pub mod daemon;
pub mod healthz;
pub mod http;
pub mod iptables;
pub mod ipvs;
pub mod kube_source;
pub mod lab;
pub mod logging;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod nftables;
pub mod proxy;
pub mod source;
pub mod trace;
pub mod vm;
