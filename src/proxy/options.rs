//! The render options every mode shares: what, besides the model, changes the rules of one
//! family whatever the dataplane. Each backend wraps these with its own extras
//! (`iptables::IptablesRenderOptions`, `ipvs::render::IpvsRenderOptions`); nftables mode needs
//! nothing more.

use crate::config::{LocalDetector, ProxyConfig};
use crate::model::{IpFamily, NodeInfo};

/// Everything besides the model that changes the rules of one family, in every mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderOptions {
    /// `masqueradeAll`: masquerade every packet to a ClusterIP.
    pub masquerade_all: bool,
    /// The mark is `1 << masquerade_bit` (`iptables.masqueradeBit`, used by every mode).
    pub masquerade_bit: u8,
    /// How traffic from this node's pods is told apart (`detectLocalMode`).
    pub local_detector: LocalDetector,
    /// `nodePortAddresses`: CIDRs and/or `primary`; empty means every local address.
    pub node_port_addresses: Vec<String>,
    /// The `PreferSameTrafficDistribution` feature gate (node hints).
    pub prefer_same_node: bool,
}

impl Default for RenderOptions {
    /// Upstream's defaults: mark bit 14, no local-traffic detector, every node address.
    fn default() -> Self {
        RenderOptions {
            masquerade_all: false,
            masquerade_bit: 14,
            local_detector: LocalDetector::None,
            node_port_addresses: Vec::new(),
            prefer_same_node: true,
        }
    }
}

impl RenderOptions {
    /// The options of one family's proxier for a configuration on the node `node`.
    pub fn from_config(cfg: &ProxyConfig, family: IpFamily, node: &NodeInfo) -> RenderOptions {
        RenderOptions {
            masquerade_all: cfg.masquerade_all,
            masquerade_bit: cfg.masquerade_bit,
            local_detector: cfg.local_detector(family, node),
            node_port_addresses: cfg.node_port_addresses.clone(),
            prefer_same_node: cfg.feature_enabled("PreferSameTrafficDistribution"),
        }
    }
}
