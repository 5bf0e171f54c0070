//! Glue shared by the subcommands and the tests: configuration + manifests → this node, the
//! families to show, and, per family, what the configured mode's full sync programs (`render`)
//! and where a packet goes through it (`trace`). The one place that picks the mode's renderer
//! and tracer for them.

use std::net::IpAddr;

use crate::config::{ProxyConfig, ProxyMode};
use crate::iptables::IptablesRenderOptions;
use crate::ipvs::render::IpvsRenderOptions;
use crate::manifest::Objects;
use crate::model::{IpFamily, NodeInfo, ProxyState};
use crate::proxy::{RenderOptions, local_addresses};
use crate::trace::{Packet, Trace, TraceContext, TraceError};
use crate::{iptables, ipvs, nftables};

/// One family's rules as `render` prints them, with the warnings found making them.
#[derive(Clone, Debug)]
pub struct RenderedFamily {
    pub text: String,
    pub warnings: Vec<String>,
}

/// `trace` could not follow the packet.
#[derive(Debug, thiserror::Error)]
pub enum TraceFailed {
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// Our own nftables transaction does not apply to an empty table (a bug).
    #[error("the rendered nftables transaction does not apply: {0}")]
    Nftables(nftables::ruleset::ApplyError),
    /// `--live`: the kernel's rules could not be read, or hold what the tracer cannot follow.
    #[error("reading the kernel's rules: {0}")]
    Live(String),
}

/// What the configured mode's full sync programs for `state`, as `render` prints it:
/// `iptables-restore` input with its jump rules (iptables), the `nft -f -` transaction
/// (nftables), or the IPVS table, ipsets and rules (IPVS).
pub fn render(cfg: &ProxyConfig, state: &ProxyState) -> RenderedFamily {
    let (family, node) = (state.family, &state.node);
    let mut warnings = state.warnings.clone();
    let text = match cfg.mode {
        ProxyMode::Iptables => {
            iptables::render(state, &IptablesRenderOptions::from_config(cfg, family, node)).annotated()
        }
        ProxyMode::Nftables => format!(
            "# nft -f - input ({family})\n{}",
            nftables::render(state, &RenderOptions::from_config(cfg, family, node))
        ),
        ProxyMode::Ipvs => {
            let rendered = ipvs::render::render(state, &IpvsRenderOptions::from_config(cfg, family, node));
            warnings.extend(rendered.warnings.iter().cloned());
            rendered.to_text()
        }
    };
    RenderedFamily { text, warnings }
}

/// Follows `packet` through what the configured mode's full sync programs for `state` (the
/// rules [`render`] prints); the warnings found making them come first, whatever the outcome.
pub fn trace(cfg: &ProxyConfig, state: &ProxyState, packet: &Packet) -> (Vec<String>, Result<Trace, TraceFailed>) {
    let mut warnings = state.warnings.clone();
    let result = trace_mode(cfg, state, packet, &mut warnings);
    (warnings, result)
}

fn trace_mode(
    cfg: &ProxyConfig,
    state: &ProxyState,
    packet: &Packet,
    warnings: &mut Vec<String>,
) -> Result<Trace, TraceFailed> {
    let (family, node) = (state.family, &state.node);
    let ctx = TraceContext {
        local_addresses: local_addresses(state),
    };
    Ok(match cfg.mode {
        ProxyMode::Iptables => {
            let ruleset = iptables::render(state, &IptablesRenderOptions::from_config(cfg, family, node));
            iptables::trace::trace(&ruleset, &ctx, packet)?
        }
        ProxyMode::Nftables => {
            // The table as the kernel holds it after that full sync.
            let tx = nftables::render::render_tx(state, &RenderOptions::from_config(cfg, family, node), true);
            let table = nftables::ruleset::Ruleset::from_transaction(&tx).map_err(TraceFailed::Nftables)?;
            nftables::trace::trace(&table, &ctx, packet)?
        }
        ProxyMode::Ipvs => {
            let rendered = ipvs::render::render(state, &IpvsRenderOptions::from_config(cfg, family, node));
            warnings.extend(rendered.warnings.iter().cloned());
            ipvs::trace::trace(&rendered, &ctx, packet)?
        }
    })
}

/// Follows `packet` through the rules the kernel holds now, in the configured mode
/// (`trace --live`), read back the way `explain` reads them: `iptables-save` into the iptables
/// tracer, the `kube-proxy` table over netlink into the nftables one, IPVS's virtual servers,
/// ipsets and iptables rules into the IPVS one. The node's own addresses are its interfaces'.
pub fn trace_live(cfg: &ProxyConfig, packet: &Packet) -> Result<Trace, TraceFailed> {
    use crate::ipvs::host::IpvsHost as _;
    let family = IpFamily::of(&packet.dst);
    let live = |e: &dyn std::fmt::Display| TraceFailed::Live(e.to_string());
    let mut host = crate::ipvs::host::HostExec;
    let ctx = TraceContext {
        local_addresses: host
            .other_addresses(crate::ipvs::names::DUMMY_DEVICE)
            .map_err(|e| live(&e))?
            .into_iter()
            .filter(|a| family.contains(a))
            .collect(),
    };
    // The iptables backend in use on this node (the daemon's).
    let backend = iptables::backend::in_use(&mut iptables::backend::Host);
    let mut ipt = crate::iptables::exec::Exec::new(backend, family);
    Ok(match cfg.mode {
        ProxyMode::Iptables => {
            let ruleset = iptables::readback::live_ruleset(&mut ipt).map_err(|e| live(&e))?;
            iptables::trace::trace(&ruleset, &ctx, packet)?
        }
        ProxyMode::Nftables => {
            let mut socket = nftables::netlink::NftSocket::new().map_err(|e| live(&e))?;
            let read = socket
                .read(family, &nftables::netlink::ReadScope::Whole)
                .map_err(|e| live(&e))?;
            let Some((table, foreign)) = read else {
                return Err(TraceFailed::Live(format!(
                    "no {} kube-proxy table",
                    nftables::ast::family_keyword(family)
                )));
            };
            if let Some(u) = foreign.first() {
                return Err(TraceFailed::Live(format!(
                    "chain {} holds a rule kube-proxy did not write ({}: {}); it cannot be traced",
                    u.chain, u.exprs, u.reason
                )));
            }
            nftables::trace::trace(&table, &ctx, packet)?
        }
        ProxyMode::Ipvs => {
            let mut ipvs = crate::ipvs::netlink::IpvsHandle::new().map_err(|e| live(&e))?;
            let rs = ipvs::dataplane::live_ruleset(family, &mut ipvs, &mut ipt, &mut host).map_err(|e| live(&e))?;
            ipvs::trace::trace(&rs, &ctx, packet)?
        }
    })
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
