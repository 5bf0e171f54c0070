//! `kube-proxy explain`: one command that answers "why does this Service not work on this
//! node". It gathers facts (the desired state from the daemon or from the objects, the rules
//! read back from the kernel, conntrack, routes, health), diagnoses them in pure code, and
//! reports in text or JSON.
//!
//! - [`rules`]: the rules each mode programs for a port, and their comparison with the kernel's.
//! - [`view`]: the desired state as `/debug/services` serves it (pure, both ways).
pub mod diagnose;
pub mod facts;
pub mod gather;
pub mod report;
pub mod routes;
pub mod rules;
pub mod view;
