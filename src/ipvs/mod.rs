//! The IPVS dataplane. [`netlink`] owns talking to the kernel's IPVS table (virtual servers,
//! real servers, timeouts) over generic netlink, plus a fake of that table for tests; the
//! modules beside it decide what the table should hold, and [`trace`] follows a packet
//! through what they decided. [`kernel`] checks that the node can run IPVS mode at all, and
//! [`cleanup`] removes what IPVS mode leaves on a node.

pub mod cleanup;
pub mod dataplane;
pub mod host;
pub mod iptables;
pub mod kernel;
pub mod names;
pub mod netlink;
pub mod proxier;
pub mod render;
pub mod trace;
