//! kube-proxy-rs: a drop-in replacement for Kubernetes' kube-proxy.
//!
//! Layout (pure core, thin edges; each edge behind a trait with a recording fake):
//! - [`manifest`]: reads Kubernetes objects from YAML/JSON files (no I/O beyond reading files).
//! - [`model`]: Services + EndpointSlices + Node → per-family service ports and endpoint sets,
//!   exactly as upstream's change trackers and `CategorizeEndpoints` compute them; the store of
//!   converted objects and the state builder that applies the sources' changes.
//! - [`config`]: `KubeProxyConfiguration` (v1alpha1) and upstream's flags with their precedence.
//! - [`cli`]: the binary's command line (upstream's flags, daemon flags, subcommands) for clap.
//! - [`app`]: the subcommands' glue: this node, the families to show, and the per-mode
//!   `render` and `trace` dispatch.
//! - [`proxy`]: the layer every dataplane uses and none owns: shared render options, node
//!   addresses, `SyncReport`, and the [`proxy::Proxier`] trait the daemon drives.
//! - [`iptables`], [`nftables`], [`ipvs`]: the three dataplanes, each a pure renderer, a
//!   proxier behind [`proxy::Proxier`], its kernel edge with a fake, and a tracer.
//! - [`trace`]: what `kube-proxy trace` reports in every mode (packet, paths, verdicts, errors)
//!   and the parts of the walk the three tracers share.
//! - [`source`]: where objects come from (a manifest directory or the Kubernetes API), behind
//!   one [`source::Source`] trait.
//! - [`daemon`]: the node daemon: when to sync (a pure runner), the loop over the injected
//!   proxiers, host and telemetry, and the per-mode set-up and cleanup.
//! - [`conntrack`]: stale UDP conntrack cleanup over ctnetlink, and the conntrack sysctls.
//! - [`healthz`], [`http`], [`metrics`], [`logging`]: health state, the HTTP servers,
//!   upstream's metrics, klog-style logs.
//! - [`explain`]: `kube-proxy explain`: the desired state (also served as `/debug/services`),
//!   the kernel's rules, conntrack and routes of a Service, and what is wrong with it.
//! - [`exec`]: runs the node's tools (`iptables-restore`, `ip`, `ipset`, `nft`) with optional
//!   stdin, for every backend.
//! - [`netlink`]: netlink message framing (building, splitting, attributes, error replies)
//!   shared by the IPVS, nftables and conntrack edges.
//! - [`lab`]: the network-namespace test bed and `kube-proxy lab`.
//! - [`vm`]: a throw-away VM with a kernel that has IPVS, for the VM tests and for
//!   `kube-proxy lab --proxy-mode=ipvs` on a kernel without it.
#![forbid(unsafe_code)]

pub mod app;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod daemon;
pub mod exec;
pub mod explain;
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
pub mod rtnetlink;
pub mod source;
pub mod trace;
pub mod vm;
