//! The IPVS dataplane. [`netlink`] owns talking to the kernel's IPVS table (virtual servers,
//! real servers, timeouts) over generic netlink, plus a fake of that table for tests; the
//! modules beside it decide what the table should hold, and [`trace`] follows a packet
//! through what they decided.

pub mod dataplane;
pub mod host;
pub mod names;
pub mod netlink;
pub mod proxier;
pub mod render;
pub mod trace;
