//! Per-mode set-up and cleanup on the real node: which families a mode can program here, the
//! real proxiers of a mode, the kernel checks before anything is touched, the nftables and
//! IPVS edges that removing another mode's state uses (mode switches: [`super::leftovers`]),
//! and `--cleanup`.

use anyhow::Context as _;

use crate::config::{ProxyConfig, ProxyMode};
use crate::iptables::IptablesRenderOptions;
use crate::iptables::exec::{Exec, Iptables};
use crate::iptables::proxier::{IptablesProxier, cleanup as cleanup_iptables};
use crate::ipvs::host::HostExec;
use crate::ipvs::netlink::{Ipvs, IpvsHandle};
use crate::ipvs::proxier::IpvsProxier;
use crate::ipvs::render::IpvsRenderOptions;
use crate::model::{IpFamily, NodeInfo};
use crate::nftables::proxier::{self as nft, NftProxier};
use crate::proxy::{Proxier, RenderOptions};

/// The families `mode` can program on this node: IPv4, and IPv6 where the mode's tools and
/// the kernel have it (upstream creates one proxier per family and drops a family that fails).
pub fn families(mode: ProxyMode) -> Vec<IpFamily> {
    let v6 = match mode {
        // nftables mode speaks netlink: it needs the kernel's IPv6, not ip6tables.
        ProxyMode::Nftables => kernel_has_ipv6(),
        // IPVS mode programs ip6tables rules beside its virtual servers.
        ProxyMode::Iptables | ProxyMode::Ipvs => Exec::available(IpFamily::V6),
    };
    let mut v = vec![IpFamily::V4];
    if v6 {
        v.push(IpFamily::V6);
    }
    v
}

fn kernel_has_ipv6() -> bool {
    std::path::Path::new("/proc/net/if_inet6").exists()
}

/// Refuses to start a mode the kernel cannot run, before anything on the node is touched
/// (never a silent fallback: IPVS without its module or scheduler).
pub fn check_kernel(cfg: &ProxyConfig) -> anyhow::Result<()> {
    if cfg.mode == ProxyMode::Ipvs {
        let scheduler = IpvsRenderOptions::from_config(cfg, IpFamily::V4, &NodeInfo::default()).scheduler;
        crate::ipvs::kernel::check_kernel(&scheduler)?;
    }
    Ok(())
}

/// The real proxiers of the configured mode, one per family. Their options are set by each
/// sync's `configure`; these are placeholders until then.
pub fn proxiers(cfg: &ProxyConfig) -> anyhow::Result<Vec<Box<dyn Proxier>>> {
    families(cfg.mode)
        .into_iter()
        .map(|family| -> anyhow::Result<Box<dyn Proxier>> {
            Ok(match cfg.mode {
                ProxyMode::Nftables => Box::new(NftProxier::netlink(family, RenderOptions::default())?),
                ProxyMode::Ipvs => {
                    let ipvs = IpvsHandle::new().context("IPVS mode")?;
                    Box::new(IpvsProxier::new(
                        family,
                        IpvsRenderOptions::default(),
                        ipvs,
                        Exec::new(family),
                        HostExec,
                    ))
                }
                ProxyMode::Iptables => Box::new(IptablesProxier::new(
                    Exec::new(family),
                    IptablesRenderOptions::default(),
                )),
            })
        })
        .collect()
}

/// Deletes the nftables mode's table of `family` where there is one.
pub(super) fn remove_nftables_table(family: IpFamily) -> Result<(), nft::NftError> {
    // The table may not exist (or nft may not be installed): only a present table matters.
    if nft::table_exists(family) {
        nft::delete_table(family)?;
    }
    Ok(())
}

/// Deletes the nftables mode's tables that exist; the errors met.
fn remove_nftables_mode() -> Vec<String> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .filter_map(|family| remove_nftables_table(family).err().map(|e| format!("{family}: {e}")))
        .collect()
}

/// The IPVS netlink handle when the kernel has IPVS loaded (without it there are no virtual
/// servers, and opening one would load it).
pub(super) fn open_ipvs() -> Option<IpvsHandle> {
    if std::path::Path::new("/proc/net/ip_vs").exists() {
        IpvsHandle::new().ok()
    } else {
        None
    }
}

/// Removes whatever IPVS mode left: virtual servers on `kube-ipvs0` addresses and
/// NodePort-looking ones on node addresses (only when the kernel has IPVS loaded: without it
/// there are none, and looking would load it), its iptables rules, ipsets and `kube-ipvs0`.
fn remove_ipvs_mode() -> Vec<String> {
    let mut ipts: Vec<Exec> = families(ProxyMode::Ipvs).into_iter().map(Exec::new).collect();
    let mut ipvs = open_ipvs();
    let mut refs: Vec<&mut dyn Iptables> = ipts.iter_mut().map(|i| i as &mut dyn Iptables).collect();
    crate::ipvs::cleanup::cleanup(
        ipvs.as_mut().map(|h| h as &mut dyn Ipvs),
        &mut refs,
        &mut HostExec,
        true,
    )
}

/// `--cleanup`: removes everything we own in both families (iptables chains and jumps, the
/// nftables `kube-proxy` tables of the nftables mode, and IPVS mode's virtual servers, ipsets
/// and `kube-ipvs0`). Returns the errors met.
pub fn cleanup_all() -> Vec<String> {
    let mut errors = Vec::new();
    // IPVS mode's rules first: its chains share names with iptables mode's.
    errors.extend(remove_ipvs_mode().into_iter().map(|e| format!("IPVS mode: {e}")));
    for family in families(ProxyMode::Iptables) {
        let mut ipt = Exec::new(family);
        errors.extend(cleanup_iptables(&mut ipt).into_iter().map(|e| format!("{family}: {e}")));
    }
    errors.extend(remove_nftables_mode());
    errors
}
