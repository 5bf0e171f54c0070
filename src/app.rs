//! Glue shared by the subcommands and the tests: configuration + manifests → one rendered
//! ruleset per IP family.

use std::net::IpAddr;

use crate::config::ProxyConfig;
use crate::iptables::{self, IptablesRenderOptions, Ruleset};
use crate::manifest::Objects;
use crate::model::{IpFamily, NodeInfo, ProxyState, build_state};

/// One family's model and rules.
#[derive(Clone, Debug)]
pub struct FamilyRules {
    pub state: ProxyState,
    pub options: IptablesRenderOptions,
    pub ruleset: Ruleset,
}

/// Families worth rendering when the operator did not choose: those that any Service cluster
/// IP or node address uses; IPv4 when nothing says otherwise. (A dual-stack node runs both.)
pub fn families_in_use(objects: &Objects, node: &NodeInfo) -> Vec<IpFamily> {
    let mut v4 = node.addresses.iter().any(IpAddr::is_ipv4);
    let mut v6 = node.addresses.iter().any(IpAddr::is_ipv6);
    for svc in &objects.services {
        let Some(spec) = &svc.spec else { continue };
        let ips = spec
            .cluster_ips
            .clone()
            .unwrap_or_default()
            .into_iter()
            .chain(spec.cluster_ip.clone());
        for ip in ips {
            match ip.trim().parse::<IpAddr>() {
                Ok(IpAddr::V4(_)) => v4 = true,
                Ok(IpAddr::V6(_)) => v6 = true,
                Err(_) => {}
            }
        }
    }
    let mut out = Vec::new();
    if v4 || !v6 {
        out.push(IpFamily::V4);
    }
    if v6 {
        out.push(IpFamily::V6);
    }
    out
}

/// This node as the configuration and the manifests describe it. As upstream, a specific
/// `bindAddress` becomes the node's primary IP of its family.
pub fn node_info(objects: &Objects, cfg: &ProxyConfig) -> NodeInfo {
    node_info_from(&objects.nodes, cfg)
}

/// As [`node_info`], from the Nodes alone.
pub fn node_info_from(nodes: &[k8s_openapi::api::core::v1::Node], cfg: &ProxyConfig) -> NodeInfo {
    let mut node = NodeInfo::from_nodes(nodes, &cfg.node_name(), &cfg.node_ips);
    if let Some(bind) = cfg.bind_address.filter(|ip| !ip.is_unspecified()) {
        node.addresses.retain(|ip| *ip != bind);
        node.addresses.insert(0, bind);
    }
    node
}

/// Builds the model and renders the iptables rules of each requested family.
pub fn render_iptables(objects: &Objects, cfg: &ProxyConfig, families: &[IpFamily]) -> Vec<FamilyRules> {
    let node = node_info(objects, cfg);
    families
        .iter()
        .map(|&family| {
            let state = build_state(objects, &node, family);
            let options = IptablesRenderOptions::from_config(cfg, family, &state.node);
            let ruleset = iptables::render(&state, &options);
            FamilyRules {
                state,
                options,
                ruleset,
            }
        })
        .collect()
}
