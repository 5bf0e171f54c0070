//! The iptables dataplane: chain names, the pure renderer of `iptables-restore` input and
//! a tracer that follows one packet through rendered rules; which backend (legacy or nft) the
//! tools program.

pub mod backend;
pub mod batch;
pub mod edits;
pub mod exec;
pub mod names;
pub mod netlink_save;
pub mod nfacct;
pub mod proxier;
pub mod readback;
pub mod render;
pub mod trace;

pub use render::{IptablesRenderOptions, render};

use crate::model::IpFamily;

/// A rule that kube-proxy ensures in a built-in chain (`iptables -I`), outside the restore input,
/// because it must not flush chains that other components own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JumpRule {
    /// `filter` or `nat`.
    pub table: &'static str,
    /// The built-in chain (`INPUT`, `FORWARD`, `OUTPUT`, `PREROUTING`, `POSTROUTING`).
    pub chain: &'static str,
    /// Rule arguments after `-A CHAIN`, e.g. `["-m","comment","--comment","kubernetes service portals","-j","KUBE-SERVICES"]`.
    /// Comment arguments are stored unquoted here.
    pub args: Vec<String>,
}

/// Everything a full sync programs for one IP family.
#[derive(Clone, Debug)]
pub struct Ruleset {
    pub family: IpFamily,
    /// Jump rules in the order they end up in each built-in chain (first = evaluated first).
    pub jumps: Vec<JumpRule>,
    /// The exact `iptables-restore` (or `ip6tables-restore`) input: `*filter … COMMIT`, `*nat … COMMIT`.
    pub restore: String,
}
