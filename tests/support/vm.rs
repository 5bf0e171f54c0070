//! Running commands in the test VM: a thin wrapper around `vm/run` (see its header).
//!
//! The VM boots Debian's kernel from /boot under qemu (TCG) with the host's root filesystem
//! shared read-only under a tmpfs overlay, so a command sees this checkout and the binaries
//! cargo built at the same paths as here, and nothing it changes reaches the host. It exists
//! for kernel features this machine's own kernel lacks (IPVS, `dummy` links).
//!
//! A VM that cannot boot is a test failure, never a skip: [`run_in_vm`] panics with the
//! reason (missing package, unreadable kernel, the end of the guest's console log...).

#![allow(dead_code)]

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// What a command run in the VM did.
#[derive(Debug, Clone)]
pub struct VmOutput {
    /// The command's exit code (`bash` conventions: 128 + N when killed by signal N, 127 when
    /// not found).
    pub code: i32,
    /// Its stdout and stderr, interleaved as written.
    pub output: String,
}

/// Why no command result came back.
#[derive(Debug, Clone)]
pub enum VmError {
    /// The timeout passed (while booting or while the command ran); qemu was killed.
    Timeout(String),
    /// The VM could not be prepared or booted, or stopped before the command finished.
    Failed(String),
}

impl std::fmt::Display for VmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmError::Timeout(m) => write!(f, "timeout: {m}"),
            VmError::Failed(m) => write!(f, "{m}"),
        }
    }
}

/// `vm/run` of this checkout.
pub fn runner() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/run")
}

/// Where `vm/run` caches the kernel and initramfs it prepares: beside cargo's own output (the
/// target directory in use, whatever `CARGO_TARGET_DIR` says), never in the source tree.
fn cache_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("vm")
}

/// Runs `args` in a fresh VM (working directory: this process's) and returns its exit code
/// and output. Panics, loudly and with the reason, when the VM cannot boot or the timeout
/// passes: the VM test group must fail, not skip, where the VM is unavailable.
pub fn run_in_vm(args: &[&str], timeout: Duration) -> VmOutput {
    match try_run_in_vm(args, timeout) {
        Ok(out) => out,
        Err(e) => panic!(
            "the test VM did not run {args:?}: {e}\n\
             (VM tests need root, qemu-system-x86, linux-image-amd64, busybox-static and cpio: \
             see .ci/run; they are never skipped)"
        ),
    }
}

/// Set (to `1`) in the environment of a test binary that runs inside the VM.
pub const IN_VM: &str = "KUBE_PROXY_IN_VM";

/// Whether this test binary runs inside the VM (see [`run_this_test_in_vm`]).
pub fn in_vm() -> bool {
    std::env::var_os(IN_VM).is_some()
}

/// Runs test `name` of this very test binary inside one VM, with [`IN_VM`] set, and asserts
/// that it passed and printed `marker` (so a filter that matched no test cannot pass).
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

/// Like [`run_in_vm`], but a VM failure or timeout is returned rather than a panic.
pub fn try_run_in_vm(args: &[&str], timeout: Duration) -> Result<VmOutput, VmError> {
    assert!(!args.is_empty(), "run_in_vm needs a command");
    let secs = timeout.as_secs().max(1);
    let child = Command::new(runner())
        .arg("--timeout")
        .arg(secs.to_string())
        .arg("--")
        .args(args)
        .env("KUBE_PROXY_VM_CACHE", cache_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group (qemu stays in it), so the guard below can stop all of it.
        .process_group(0)
        .spawn()
        .map_err(|e| VmError::Failed(format!("cannot start {}: {e}", runner().display())))?;
    let mut guard = RunnerGuard { child: Some(child) };
    let child = guard.child.as_mut().expect("just set");
    let stdout = read_all(child.stdout.take().expect("piped"));
    let stderr = read_all(child.stderr.take().expect("piped"));

    // vm/run enforces the timeout itself and kills qemu; this deadline only guards against
    // the runner itself hanging. The slack covers preparing the kernel and initramfs (once per
    // kernel) and qemu's own exit.
    let deadline = Instant::now() + Duration::from_secs(secs) + Duration::from_secs(60);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                drop(guard);
                return Err(VmError::Timeout(format!(
                    "vm/run itself did not return within {secs} s + 60 s; its process group \
                     was killed"
                )));
            }
            Err(e) => return Err(VmError::Failed(format!("waiting for vm/run: {e}"))),
        }
    };
    guard.child = None;
    let output = stdout.join().unwrap_or_default();
    let errors = stderr.join().unwrap_or_default();
    classify(status, output, errors)
}

/// vm/run's own messages go to its stderr and start with `vm/run: error:` when the VM, not the
/// command, failed; the command's output is all on stdout. So an exit code of 124 or 125 from
/// the command itself is not mistaken for a VM failure.
fn classify(status: ExitStatus, output: String, errors: String) -> Result<VmOutput, VmError> {
    let Some(code) = status.code() else {
        return Err(VmError::Failed(format!(
            "vm/run was killed ({status}); its stderr:\n{errors}\noutput so far:\n{output}"
        )));
    };
    if errors.contains("vm/run: error: timeout") {
        return Err(VmError::Timeout(format!("{errors}\noutput so far:\n{output}")));
    }
    if errors.contains("vm/run: error:") {
        return Err(VmError::Failed(format!("{errors}\noutput so far:\n{output}")));
    }
    Ok(VmOutput { code, output })
}

fn read_all(mut from: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = from.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Stops vm/run and its qemu when a run is abandoned (the backstop deadline, or a panic while
/// it runs): SIGTERM first, so vm/run removes its temporary directory, then SIGKILL.
struct RunnerGuard {
    child: Option<Child>,
}

impl Drop for RunnerGuard {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        let group = Pid::from_raw(child.id() as i32);
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait();
    }
}
