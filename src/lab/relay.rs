//! `kube-proxy lab --proxy-mode=ipvs` on a kernel without IPVS: the same binary with the same
//! arguments runs in the VM of [`crate::vm`] (Debian's kernel, which has IPVS), and its report
//! and exit code come back here. The lab in the VM builds and removes its namespaces there;
//! nothing is created on this machine but the runner's temporary directory, which goes with
//! the VM (also on Ctrl-C or SIGTERM).

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::run::{missing_tools, wait_or_signal};
use crate::config::ProxyMode;
use crate::vm::{self, IN_VM, Vm, VmError};

/// Booting plus the whole lab under TCG: 2-4 minutes on a quiet 2-core machine with the default
/// 300 connections; the rest is room for a loaded one.
const VM_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs `binary ARGS` (this lab's own command line) in the VM, streaming its output to stdout,
/// and returns its exit code. An error when the VM cannot run it (never a fallback to another
/// mode) or on Ctrl-C / SIGTERM (the VM is stopped first).
pub fn relay(binary: &Path, args: &[String]) -> Result<ExitCode> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    eprintln!(
        "kube-proxy lab: this kernel ({}) has no IPVS (no /proc/net/ip_vs, and `modprobe ip_vs` failed), \
         so the lab runs in a VM: Debian's kernel from /boot under qemu (TCG, no network device), \
         with this machine's files read-only under an in-memory overlay. Booting takes 10-20 s, and \
         everything in the VM runs several times slower than on a real node.",
        kernel.trim()
    );
    if vm::in_vm() {
        bail!(
            "this is the lab's VM ({IN_VM} is set), and its kernel has no IPVS either: \
             choose a kernel with the ip_vs modules with KUBE_PROXY_VM_KERNEL"
        );
    }
    if !nix::unistd::geteuid().is_root() {
        bail!("the lab's VM runs as root (qemu reads the kernel in /boot): e.g. sudo kube-proxy lab --proxy-mode=ipvs");
    }
    // The guest runs this machine's binaries: the lab's tools must be here too.
    let mut missing = vm::missing_host_tools();
    missing.extend(missing_tools(ProxyMode::Ipvs));
    if !missing.is_empty() {
        bail!(
            "the lab's VM needs: {}; on Debian/Ubuntu: apt-get install -y {} iproute2 iptables ipset ipvsadm conntrack",
            missing.join(", "),
            vm::PACKAGES
        );
    }
    let binary = binary
        .to_str()
        .with_context(|| format!("the binary's path {} is not UTF-8", binary.display()))?;
    let mut command = vec![binary.to_string()];
    command.extend(args.iter().cloned());

    let cache = vm::default_cache_dir();
    eprintln!(
        "kube-proxy lab: booting the VM (kernel and initramfs cached in {})",
        cache.display()
    );
    let cancel = Arc::new(AtomicBool::new(false));
    let runner = Vm::new(cache)
        .timeout(VM_TIMEOUT)
        .env(IN_VM, "1")
        .cancel_on(cancel.clone());
    let started = Instant::now();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let worker = std::thread::spawn(move || {
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        let mut stdout = std::io::stdout();
        let result = runner.run_streaming(&args, &mut |chunk| {
            // A closed stdout (`| head`) must not stop the VM half way: the rest is dropped.
            let _ = stdout.write_all(chunk).and_then(|()| stdout.flush());
        });
        let _ = done_tx.send(result);
    });
    let Some(result) = wait_or_signal(done_rx)? else {
        eprintln!("\ninterrupted: stopping the VM");
        cancel.store(true, Ordering::SeqCst);
        let _ = worker.join();
        bail!("interrupted");
    };
    let _ = worker.join();
    match result.context("the VM's thread stopped unexpectedly")? {
        Ok(code) => {
            eprintln!(
                "kube-proxy lab: the VM ran the lab in {:.0} s; it exited with {code}",
                started.elapsed().as_secs_f64()
            );
            Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
        }
        Err(VmError::Cancelled) => bail!("interrupted"),
        Err(e) => bail!(
            "the VM did not run the lab: {e}\n(the VM needs root and the packages {}; \
             KUBE_PROXY_VM_KERNEL names another kernel in /boot)",
            vm::PACKAGES
        ),
    }
}
