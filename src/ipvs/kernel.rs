//! What IPVS mode needs of the running kernel: the checks made before the daemon starts in
//! IPVS mode (IPVS itself, the `ipset` tool, the scheduler's module), and which kernels need
//! upstream's `conn_reuse_mode` work-around.

use nix::errno::Errno;

use super::netlink::{Ipvs, IpvsError, VirtualServer};
use crate::model::IpFamily;

/// `net/ipv4/vs/conn_reuse_mode=0` is what upstream sets on kernels 4.1 to 5.8, whose IPVS
/// drops the first packet of a reused connection to a removed real server for a second
/// (kubernetes#81775); 5.9 fixed it, and before 4.1 the sysctl does not exist.
pub fn conn_reuse_mode_fix_needed(release: &str) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor) >= (4, 1) && (major, minor) < (5, 9)
}

/// The running kernel's release (`uname -r`).
pub(super) fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Why IPVS mode cannot start on this kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelCheckError {
    #[error(
        "IPVS mode needs the kernel module ip_vs, which is neither loaded nor loadable: run `modprobe ip_vs`, or choose --proxy-mode=iptables or --proxy-mode=nftables"
    )]
    NoIpvs,
    #[error("IPVS mode: cannot use IPVS: {0}")]
    Ipvs(#[source] IpvsError),
    #[error(
        "IPVS mode needs the kernel module ip_vs_{0} for the scheduler {0:?} (--ipvs-scheduler): run `modprobe ip_vs_{0}`, or choose another scheduler, or --proxy-mode=iptables or --proxy-mode=nftables"
    )]
    NoScheduler(String),
    #[error(
        "IPVS mode needs the ipset tool, which does not run ({0}): install it (Debian/Ubuntu: apt-get install ipset)"
    )]
    NoIpset(String),
}

/// Checks that the node can run IPVS mode with `scheduler`: IPVS answers, the `ipset` tool
/// runs, and the
/// scheduler's module is loaded, built in, loadable with `modprobe`, or loaded by the kernel
/// on demand (a firewall-mark probe service, added and deleted at once; no packet carries its
/// mark). Never falls back to anything.
pub fn check_kernel(scheduler: &str) -> Result<(), KernelCheckError> {
    let mut ipvs = match super::netlink::IpvsHandle::new() {
        Ok(h) => h,
        Err(IpvsError::NotAvailable) => return Err(KernelCheckError::NoIpvs),
        Err(e) => return Err(KernelCheckError::Ipvs(e)),
    };
    ipvs.info().map_err(KernelCheckError::Ipvs)?;
    // Every sync restores ipsets: without the tool, no sync could ever succeed.
    match std::process::Command::new("ipset").arg("version").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(KernelCheckError::NoIpset(
                String::from_utf8_lossy(&o.stderr).trim().to_string(),
            ));
        }
        Err(e) => return Err(KernelCheckError::NoIpset(e.to_string())),
    }
    let module = format!("ip_vs_{scheduler}");
    let loaded = || std::path::Path::new("/sys/module").join(&module).exists();
    if loaded() {
        return Ok(());
    }
    let builtin = std::fs::read_to_string(format!("/lib/modules/{}/modules.builtin", kernel_release()))
        .is_ok_and(|b| b.lines().any(|l| l.ends_with(&format!("/{module}.ko"))));
    if builtin {
        return Ok(());
    }
    let _ = std::process::Command::new("modprobe")
        .arg(&module)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if loaded() {
        return Ok(());
    }
    // No modprobe here (a container), but the kernel may still load it itself.
    let probe = VirtualServer::fwmark(IpFamily::V4, PROBE_FWMARK, scheduler);
    match ipvs.add_service(&probe) {
        Ok(()) => {
            let _ = ipvs.delete_service(&probe);
            Ok(())
        }
        Err(e) if e.errno() == Some(Errno::EEXIST) => Ok(()),
        Err(e) if e.errno() == Some(Errno::ENOENT) => Err(KernelCheckError::NoScheduler(scheduler.to_string())),
        Err(e) => Err(KernelCheckError::Ipvs(e)),
    }
}

/// What [`check_kernel`] checks, without loading or adding anything (`kube-proxy explain`):
/// IPVS is loaded (`/proc/net/ip_vs`), and the scheduler's module is loaded, built in, or on
/// disk where `modprobe` (or the kernel's own module request) finds it.
pub fn check_kernel_read_only(scheduler: &str) -> Result<(), KernelCheckError> {
    if !std::path::Path::new("/proc/net/ip_vs").exists() {
        return Err(KernelCheckError::NoIpvs);
    }
    let module = format!("ip_vs_{scheduler}");
    if std::path::Path::new("/sys/module").join(&module).exists() {
        return Ok(());
    }
    let dir = std::path::PathBuf::from(format!("/lib/modules/{}", kernel_release()));
    let builtin = std::fs::read_to_string(dir.join("modules.builtin"))
        .is_ok_and(|b| b.lines().any(|l| l.ends_with(&format!("/{module}.ko"))));
    let dep = std::fs::read_to_string(dir.join("modules.dep")).unwrap_or_default();
    let on_disk = dep
        .lines()
        .filter_map(|l| l.split(':').next())
        .filter(|path| {
            let file = path.rsplit('/').next().unwrap_or("");
            file == format!("{module}.ko") || file.starts_with(&format!("{module}.ko."))
        })
        .any(|path| dir.join(path).exists());
    if builtin || on_disk {
        Ok(())
    } else {
        Err(KernelCheckError::NoScheduler(scheduler.to_string()))
    }
}

/// The firewall mark of the scheduler probe.
const PROBE_FWMARK: u32 = 0x7fff_fffe;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_reuse_mode_only_on_affected_kernels() {
        assert!(conn_reuse_mode_fix_needed("4.19.0-21-amd64"));
        assert!(conn_reuse_mode_fix_needed("5.4.0"));
        assert!(!conn_reuse_mode_fix_needed("5.9.0"));
        assert!(!conn_reuse_mode_fix_needed("6.1.0-57-amd64"));
        assert!(!conn_reuse_mode_fix_needed("3.10.0-1160.el7"));
        assert!(!conn_reuse_mode_fix_needed(""));
    }
}
