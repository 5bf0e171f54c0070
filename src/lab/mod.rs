//! The lab and the end-to-end test bed: network namespaces that play a node, pods and an
//! outside host, a tiny TCP+UDP server that answers with its name, and a probing client; what
//! the lab reads of IPVS state, and the relay that runs the lab in the VM where the kernel
//! lacks IPVS.

pub mod ipvs;
pub mod netns;
pub mod probe;
pub mod relay;
pub mod run;
pub mod scenario;
pub mod soak;
pub mod testbed;
