//! Running commands in the test VM, for the VM test group (`tests/vm_*.rs`): the panicking
//! edge over [`kube_proxy::vm`], which owns the runner (shared with `kube-proxy lab`).
//!
//! Where root or the VM's packages are missing, the VM tests are reported as ignored with what
//! is missing (their `Requirement::Vm` in tests/common/harness.rs); a VM that still cannot boot
//! is a test failure: [`run_in_vm`] panics with the reason (unreadable kernel, the end of the
//! guest's console log...).

// Each VM test file uses a different part of this.
#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use kube_proxy::vm::{IN_VM, Vm, VmError, VmOutput, in_vm};

/// Where the VM tests keep the kernel and initramfs `vm/prepare` derives (and the runner
/// scripts): beside cargo's own output (the target directory in use, whatever
/// `CARGO_TARGET_DIR` says), never in the source tree.
pub fn cache_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("vm")
}

/// Runs `args` in a fresh VM (working directory: this process's) and returns its exit code
/// and output. Panics, loudly and with the reason, when the VM cannot boot or the timeout
/// passes.
pub fn run_in_vm(args: &[&str], timeout: Duration) -> VmOutput {
    match try_run_in_vm(args, timeout) {
        Ok(out) => out,
        Err(e) => panic!(
            "the test VM did not run {args:?}: {e}\n\
             (VM tests need root and {}: see .ci/run)",
            kube_proxy::vm::PACKAGES
        ),
    }
}

/// Like [`run_in_vm`], but a VM failure or timeout is returned rather than a panic.
pub fn try_run_in_vm(args: &[&str], timeout: Duration) -> Result<VmOutput, VmError> {
    Vm::new(cache_dir()).timeout(timeout).run(args)
}

/// The body of a test whose checks run in the VM: there (this binary re-run by
/// [`run_this_test_in_vm`]), runs `checks` and prints `marker` once they passed; on the host,
/// re-runs test `name` in the VM.
pub fn checks_in_vm(name: &str, marker: &str, timeout: Duration, checks: fn()) {
    if in_vm() {
        checks();
        println!("{marker}");
    } else {
        run_this_test_in_vm(name, marker, timeout);
    }
}

/// Runs test `name` of this very test binary inside one VM, with [`IN_VM`] set, and asserts
/// that it passed and printed `marker` (so a filter that matched no test, or a test the harness
/// ignored in the VM, cannot pass). The arguments are libtest's, which the harness takes too.
pub fn run_this_test_in_vm(name: &str, marker: &str, timeout: Duration) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let exe = exe.to_str().expect("a UTF-8 path");
    let started = Instant::now();
    let out = run_in_vm(
        &[
            "env",
            &format!("{IN_VM}=1"),
            exe,
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ],
        timeout,
    );
    eprintln!(
        "VM run took {:.1} s; its output:\n{}",
        started.elapsed().as_secs_f64(),
        out.output
    );
    assert_eq!(out.code, 0, "the in-VM checks failed (output above)");
    assert!(out.output.contains(marker), "the in-VM checks did not run");
}
