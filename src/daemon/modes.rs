//! Per-mode set-up and cleanup on the real node: which families a mode can program here, the
//! real proxiers of a mode (with upstream's "Using … Proxier" line, and iptables mode's nfacct
//! counters where the kernel has them), the kernel checks before anything is touched, the
//! nftables and IPVS edges that removing another mode's state uses (mode switches:
//! [`super::leftovers`]), and `--cleanup`. Every iptables call goes to the backend chosen at
//! start (`iptables::backend`), passed in as `backend`.

use anyhow::Context as _;
use tracing::{error, info};

use crate::config::{ProxyConfig, ProxyMode};
use crate::iptables::IptablesRenderOptions;
use crate::iptables::backend::Backend;
use crate::iptables::exec::{Exec, Iptables};
use crate::iptables::nfacct::{self, Nfacct};
use crate::iptables::proxier::{IptablesProxier, cleanup as cleanup_iptables};
use crate::iptables::render::{NFACCT_CT_STATE_INVALID, NFACCT_LOCALHOST_NODEPORTS};
use crate::ipvs::host::HostExec;
use crate::ipvs::netlink::{Ipvs, IpvsHandle};
use crate::ipvs::proxier::IpvsProxier;
use crate::ipvs::render::IpvsRenderOptions;
use crate::model::{IpFamily, NodeInfo};
use crate::nftables::proxier::{self as nft, NftProxier};
use crate::proxy::{Proxier, RenderOptions};

/// The families `mode` can program on this node: IPv4, and IPv6 where the mode's tools and
/// the kernel have it (upstream creates one proxier per family and drops a family that fails).
pub fn families(mode: ProxyMode, backend: Backend) -> Vec<IpFamily> {
    let v6 = match mode {
        // nftables mode speaks netlink: it needs the kernel's IPv6, not ip6tables.
        ProxyMode::Nftables => kernel_has_ipv6(),
        // IPVS mode programs ip6tables rules beside its virtual servers.
        ProxyMode::Iptables | ProxyMode::Ipvs => Exec::available(backend, IpFamily::V6),
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

/// Upstream's deprecation message for IPVS mode (KEP-5495), logged at error level and sent
/// as the Warning event `IPVSDeprecation` on the Node.
pub const IPVS_DEPRECATION: &str =
    "The ipvs proxier is now deprecated and may be removed in a future release. Please use 'nftables' instead.";

/// Logs the mode in use as upstream does, word for word (operators grep for these lines), and
/// in IPVS mode its deprecation.
pub fn log_mode(mode: ProxyMode) {
    match mode {
        ProxyMode::Iptables => info!("Using iptables Proxier"),
        ProxyMode::Ipvs => {
            info!("Using ipvs Proxier");
            error!("{IPVS_DEPRECATION}");
        }
        ProxyMode::Nftables => info!("Using nftables Proxier"),
    }
}

/// iptables mode's nfacct counters, created where the kernel has nfacct (as upstream does at
/// start): the handle that reads them, or None, and then no rule counts into them.
pub fn nfacct_counters() -> Option<Box<dyn Nfacct>> {
    let mut handle = match nfacct::Netlink::new() {
        Ok(h) => h,
        Err(e) => {
            error!(error = %e, "Failed to create nfacct runner, nfacct based metrics won't be available");
            return None;
        }
    };
    nfacct::ensure_all(&mut handle, &[NFACCT_CT_STATE_INVALID, NFACCT_LOCALHOST_NODEPORTS])
        .then(|| Box::new(handle) as Box<dyn Nfacct>)
}

/// The real proxiers of the configured mode, one per family. Their options are set by each
/// sync's `configure`; these are placeholders until then, except `nfacct` (iptables mode: the
/// counters exist, so two rules count into them).
pub fn proxiers(cfg: &ProxyConfig, backend: Backend, nfacct: bool) -> anyhow::Result<Vec<Box<dyn Proxier>>> {
    families(cfg.mode, backend)
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
                        Exec::new(backend, family),
                        HostExec,
                    ))
                }
                ProxyMode::Iptables => Box::new(IptablesProxier::new(
                    Exec::new(backend, family),
                    IptablesRenderOptions {
                        nfacct,
                        ..IptablesRenderOptions::default()
                    },
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
fn remove_ipvs_mode(backend: Backend) -> Vec<String> {
    let mut ipts: Vec<Exec> = families(ProxyMode::Ipvs, backend)
        .into_iter()
        .map(|f| Exec::new(backend, f))
        .collect();
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
pub fn cleanup_all(backend: Backend) -> Vec<String> {
    let mut errors = Vec::new();
    // IPVS mode's rules first: its chains share names with iptables mode's.
    errors.extend(remove_ipvs_mode(backend).into_iter().map(|e| format!("IPVS mode: {e}")));
    for family in families(ProxyMode::Iptables, backend) {
        let mut ipt = Exec::new(backend, family);
        errors.extend(cleanup_iptables(&mut ipt).into_iter().map(|e| format!("{family}: {e}")));
    }
    errors.extend(remove_nftables_mode());
    errors
}
