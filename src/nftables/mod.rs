//! The nftables dataplane: object names and the pure renderer of the transaction a full sync
//! sends to `nft -f -` (knftables' one-command-per-line text form), following upstream's
//! `pkg/proxy/nftables/proxier.go` (the layout with `filter-prerouting-pre-dnat`,
//! `filter-output-pre-dnat`, `cluster-ips-check` and ServiceCIDR support).

pub mod names;
pub mod proxier;
pub mod render;

pub use render::{render, render_transaction};
