//! The lab and the end-to-end test bed: network namespaces that play a node, pods and an
//! outside host, a tiny TCP+UDP server that answers with its name, and a probing client.

pub mod netns;
pub mod probe;
pub mod run;
pub mod scenario;
pub mod testbed;
