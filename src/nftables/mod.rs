//! The nftables dataplane: object names, the structured commands of a transaction (`ast`),
//! the pure renderer of the transaction a full sync sends (following upstream's
//! `pkg/proxy/nftables/proxier.go`, the layout with `filter-prerouting-pre-dnat`,
//! `filter-output-pre-dnat`, `cluster-ips-check` and ServiceCIDR support), a model of the
//! programmed table (`ruleset`) and the proxier that keeps the kernel in step.

pub mod ast;
pub mod backend;
pub mod blocks;
pub mod names;
pub mod netlink;
pub mod proxier;
pub mod readback;
pub mod render;
pub mod ruleset;
pub mod trace;

pub use render::{render, render_transaction};
