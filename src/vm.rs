//! The VM for kernel features this machine's kernel may lack (IPVS, `dummy` links): runs one
//! command in a throw-away VM and reports its exit code and output. Used by the VM tests and
//! by `kube-proxy lab --proxy-mode=ipvs` on a kernel without IPVS.
//!
//! The VM is the one `vm/run` boots (see its header): Debian's kernel from /boot under qemu
//! (TCG), the host's root filesystem shared read-only under a tmpfs overlay, so the command
//! sees the same binaries and working directory as here and nothing it changes reaches the
//! host; no network device. The four runner scripts are compiled into this library, so a
//! `kube-proxy` binary installed outside a checkout carries them: [`Vm`] writes them once into
//! its cache directory (under a name that hashes their content) and runs them from there.
//!
//! A VM that cannot boot is an error that says why ([`VmError`]); nothing here falls back to
//! running the command on this machine.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use sha2::{Digest, Sha256};

/// Set (to `1`) in the environment of a command that the lab or a test runs inside the VM, so
/// that it knows not to boot another one.
pub const IN_VM: &str = "KUBE_PROXY_IN_VM";

/// Overrides where the prepared kernel, initramfs and runner scripts are kept (read by
/// [`default_cache_dir`] and, for the kernel and initramfs, by `vm/prepare` itself).
pub const CACHE_ENV: &str = "KUBE_PROXY_VM_CACHE";

/// The runner scripts, by file name, as `vm/` of the checkout this was built from holds them.
const SCRIPTS: [(&str, &str); 4] = [
    ("run", include_str!("../vm/run")),
    ("prepare", include_str!("../vm/prepare")),
    ("init", include_str!("../vm/init")),
    ("host-modprobe", include_str!("../vm/host-modprobe")),
];

/// What the runner and `vm/prepare` need on this machine, with the Debian package of each.
/// The guest runs this machine's own binaries, so the command's tools come from here too.
const HOST_TOOLS: [(&str, &str); 6] = [
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("cpio", "cpio"),
    ("modprobe", "kmod"),
    ("flock", "util-linux"),
    ("timeout", "coreutils"),
];

/// Every package the VM needs, for error messages (zstd and xz unpack the kernel image).
pub const PACKAGES: &str = "qemu-system-x86 linux-image-amd64 busybox-static cpio kmod xz-utils zstd";

/// Whether this process runs inside the VM (see [`IN_VM`]).
pub fn in_vm() -> bool {
    std::env::var_os(IN_VM).is_some()
}

/// What a command run in the VM did.
#[derive(Debug, Clone)]
pub struct VmOutput {
    /// The command's exit code (`bash` conventions: 128 + N when killed by signal N, 127 when
    /// not found).
    pub code: i32,
    /// Its stdout and stderr, interleaved as written.
    pub output: String,
}

/// Why no command result came back. None of these is retried: the caller reports it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VmError {
    /// The timeout passed (while booting or while the command ran); qemu was killed.
    #[error("timeout: {0}")]
    Timeout(String),
    /// The VM could not be prepared or booted, or stopped before the command finished.
    #[error("{0}")]
    Failed(String),
    /// The caller asked to stop (see [`Vm::cancel_on`]); qemu was killed.
    #[error("stopped on request")]
    Cancelled,
}

/// The tools the runner needs (qemu, busybox, cpio, modprobe...) that are missing here, as
/// `tool (package P)`, and a kernel in /boot when there is none. Empty when the runner can
/// start; it still checks the details itself (a kernel with IPVS modules, a statically linked
/// busybox...).
pub fn missing_host_tools() -> Vec<String> {
    let mut missing: Vec<String> = HOST_TOOLS
        .iter()
        .filter(|(tool, _)| find_program(tool).is_none())
        .map(|(tool, package)| format!("{tool} (package {package})"))
        .collect();
    let kernels = std::fs::read_dir("/boot").map(|d| {
        d.filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with("vmlinuz-"))
    });
    if !kernels.unwrap_or(false) {
        missing.push("a kernel in /boot (package linux-image-amd64)".to_string());
    }
    missing
}

/// Where `name` is on `PATH`, or in /usr/sbin or /sbin (root's tools, also where PATH lacks
/// them, as under `sudo` with a user's PATH). Looked up rather than run: some tools fail
/// without the kernel feature they drive (`ipvsadm --version` without IPVS).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `$KUBE_PROXY_VM_CACHE`, else `$XDG_CACHE_HOME/kube-proxy-rs/vm`, else
/// `$HOME/.cache/kube-proxy-rs/vm`, else a directory under the system's temporary directory.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|d| !d.is_empty())
                .map(|h| Path::new(&h).join(".cache"))
        })
        .unwrap_or_else(std::env::temp_dir);
    base.join("kube-proxy-rs").join("vm")
}

/// Writes the runner scripts into `cache/runner-<hash>/` unless they are there already, and
/// returns the path of `run`. The directory is filled under a temporary name and renamed into
/// place, so a concurrent caller never sees it half written.
pub fn install_runner(cache: &Path) -> Result<PathBuf, VmError> {
    let mut hash = Sha256::new();
    for (name, text) in SCRIPTS {
        hash.update(name.as_bytes());
        hash.update([0]);
        hash.update(text.as_bytes());
    }
    let key = data_encoding::HEXLOWER.encode(&hash.finalize()[..8]);
    let dir = cache.join(format!("runner-{key}"));
    let run = dir.join("run");
    if run.is_file() {
        return Ok(run);
    }
    let failed =
        |what: &str, path: &Path, e: std::io::Error| VmError::Failed(format!("cannot {what} {}: {e}", path.display()));
    std::fs::create_dir_all(cache).map_err(|e| failed("create", cache, e))?;
    // Unique per call: tests run in threads of one process, and another process may race too.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = cache.join(format!(".runner-{key}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| failed("create", &tmp, e))?;
    for (name, text) in SCRIPTS {
        let path = tmp.join(name);
        std::fs::write(&path, text).map_err(|e| failed("write", &path, e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| failed("make executable", &path, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process won the race: its copy has the same content.
        if !run.is_file() {
            return Err(failed("rename into place", &dir, e));
        }
    }
    Ok(run)
}

/// One way to run commands in the VM: where its cache lives, how long a run may take, the
/// environment the command gets, and an optional flag that stops a run.
#[derive(Debug, Clone)]
pub struct Vm {
    cache: PathBuf,
    timeout: Duration,
    memory_mb: Option<u32>,
    envs: Vec<String>,
    cancel: Option<Arc<AtomicBool>>,
}

impl Vm {
    /// A VM whose prepared kernel, initramfs and runner scripts live in `cache`; 600 s per run.
    pub fn new(cache: impl Into<PathBuf>) -> Vm {
        Vm {
            cache: cache.into(),
            timeout: Duration::from_secs(600),
            memory_mb: None,
            envs: Vec::new(),
            cancel: None,
        }
    }

    /// How long booting plus the command may take (whole seconds, at least 1).
    pub fn timeout(mut self, timeout: Duration) -> Vm {
        self.timeout = timeout;
        self
    }

    /// The guest's memory (the runner's default otherwise: 1024 MB).
    pub fn memory_mb(mut self, mb: u32) -> Vm {
        self.memory_mb = Some(mb);
        self
    }

    /// Adds `NAME=VALUE` to the command's environment (which is otherwise minimal: PATH, HOME,
    /// LANG).
    pub fn env(mut self, name: &str, value: &str) -> Vm {
        self.envs.push(format!("{name}={value}"));
        self
    }

    /// Stops a run (qemu killed, [`VmError::Cancelled`]) once `flag` is set, e.g. from a
    /// signal handler's thread.
    pub fn cancel_on(mut self, flag: Arc<AtomicBool>) -> Vm {
        self.cancel = Some(flag);
        self
    }

    /// Runs `args` in a fresh VM (working directory: this process's) and returns its exit code
    /// and output.
    pub fn run(&self, args: &[&str]) -> Result<VmOutput, VmError> {
        let mut output = Vec::new();
        let result = self.run_streaming(args, &mut |chunk| output.extend_from_slice(chunk));
        let output = String::from_utf8_lossy(&output).into_owned();
        match result {
            Ok(code) => Ok(VmOutput { code, output }),
            Err(VmError::Timeout(m)) => Err(VmError::Timeout(format!("{m}\noutput so far:\n{output}"))),
            Err(VmError::Failed(m)) => Err(VmError::Failed(format!("{m}\noutput so far:\n{output}"))),
            Err(VmError::Cancelled) => Err(VmError::Cancelled),
        }
    }

    /// Like [`Vm::run`], but hands the command's output (stdout and stderr, one stream) to
    /// `sink` as it arrives, and returns only the exit code.
    pub fn run_streaming(&self, args: &[&str], sink: &mut dyn FnMut(&[u8])) -> Result<i32, VmError> {
        if args.is_empty() {
            return Err(VmError::Failed("no command to run in the VM".to_string()));
        }
        let runner = install_runner(&self.cache)?;
        let secs = self.timeout.as_secs().max(1);
        let mut cmd = Command::new(&runner);
        cmd.arg("--timeout").arg(secs.to_string());
        if let Some(mb) = self.memory_mb {
            cmd.arg("--mem").arg(mb.to_string());
        }
        for e in &self.envs {
            cmd.arg("--env").arg(e);
        }
        let child = cmd
            .arg("--")
            .args(args)
            .env(CACHE_ENV, &self.cache)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group (qemu stays in it), so the guard below can stop all of it.
            .process_group(0)
            .spawn()
            .map_err(|e| VmError::Failed(format!("cannot start {}: {e}", runner.display())))?;
        let mut guard = RunnerGuard { child: Some(child) };
        let child = guard
            .child
            .as_mut()
            .expect("the guard holds the child until it is waited for");
        let (chunks, stdout) = stream(child.stdout.take().expect("stdout is piped"));
        let stderr = read_all(child.stderr.take().expect("stderr is piped"));

        // vm/run enforces the timeout itself and kills qemu; this deadline only guards against
        // the runner itself hanging. The slack covers preparing the kernel and initramfs (once
        // per kernel) and qemu's own exit.
        let deadline = Instant::now() + Duration::from_secs(secs) + Duration::from_secs(60);
        let status = loop {
            // Waiting for output doubles as the pause between checks of the runner.
            match chunks.recv_timeout(Duration::from_millis(20)) {
                Ok(chunk) => sink(&chunk),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
            }
            if self.cancel.as_ref().is_some_and(|c| c.load(Ordering::SeqCst)) {
                drop(guard);
                return Err(VmError::Cancelled);
            }
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => {}
                Ok(None) => {
                    drop(guard);
                    return Err(VmError::Timeout(format!(
                        "vm/run itself did not return within {secs} s + 60 s; its process group was killed"
                    )));
                }
                Err(e) => return Err(VmError::Failed(format!("waiting for vm/run: {e}"))),
            }
        };
        guard.child = None;
        // The rest of the output: the reader ends at EOF, once the runner's tail has exited.
        for chunk in chunks {
            sink(&chunk);
        }
        let _ = stdout.join();
        let errors = stderr.join().unwrap_or_default();
        classify(status, &errors)
    }
}

/// vm/run's own messages go to its stderr and start with `vm/run: error:` when the VM, not the
/// command, failed; the command's output is all on stdout. So an exit code of 124 or 125 from
/// the command itself is not mistaken for a VM failure.
fn classify(status: ExitStatus, errors: &str) -> Result<i32, VmError> {
    let Some(code) = status.code() else {
        return Err(VmError::Failed(format!(
            "vm/run was killed ({status}); its stderr:\n{errors}"
        )));
    };
    if errors.contains("vm/run: error: timeout") {
        return Err(VmError::Timeout(errors.to_string()));
    }
    if errors.contains("vm/run: error:") {
        return Err(VmError::Failed(errors.to_string()));
    }
    Ok(code)
}

/// Reads `from` on a thread and sends what it reads, chunk by chunk, until EOF.
fn stream(mut from: impl Read + Send + 'static) -> (mpsc::Receiver<Vec<u8>>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    });
    (rx, handle)
}

fn read_all(mut from: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = from.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Stops vm/run and its qemu when a run is abandoned (timeout, cancel, or a panic while it
/// runs): SIGTERM first, so vm/run removes its temporary directory, then SIGKILL.
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
        let Ok(pid) = i32::try_from(child.id()) else {
            let _ = child.kill();
            let _ = child.wait();
            return;
        };
        let group = Pid::from_raw(pid);
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            // vm/run's trap stops qemu and waits for it before exiting.
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[test]
    fn concurrent_installs_in_one_process_all_succeed() {
        let cache = std::env::temp_dir().join(format!("kp-vm-install-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let cache = cache.clone();
                std::thread::spawn(move || install_runner(&cache))
            })
            .collect();
        let runs: Vec<_> = threads.into_iter().map(|t| t.join().expect("no panic")).collect();
        let _ = std::fs::remove_dir_all(&cache);
        let paths: Vec<PathBuf> = runs.into_iter().map(|r| r.expect("installed")).collect();
        assert!(paths.windows(2).all(|w| w[0] == w[1]), "{paths:?}");
    }

    #[test]
    fn runner_failures_are_told_apart_from_the_commands_exit_code() {
        let exit = |code: i32| ExitStatus::from_raw(code << 8);
        assert_eq!(classify(exit(125), "").unwrap(), 125, "the command's own 125");
        assert!(matches!(
            classify(exit(124), "vm/run: error: timeout: the VM did not boot"),
            Err(VmError::Timeout(_))
        ));
        let e = classify(exit(125), "vm/run: error: no qemu-system-x86_64").unwrap_err();
        assert!(e.to_string().contains("no qemu-system-x86_64"), "{e}");
        assert!(matches!(classify(ExitStatus::from_raw(9), ""), Err(VmError::Failed(_))));
    }

    #[test]
    fn installs_the_scripts_once_executable() {
        let cache = std::env::temp_dir().join(format!("kp-vm-unit-{}", std::process::id()));
        let run = install_runner(&cache).unwrap();
        let dir = run.parent().unwrap().to_path_buf();
        for (name, text) in SCRIPTS {
            let path = dir.join(name);
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o111, 0o111, "{name} is executable");
        }
        assert_eq!(install_runner(&cache).unwrap(), run, "the same directory again");
        let entries = std::fs::read_dir(&cache).unwrap().count();
        std::fs::remove_dir_all(&cache).unwrap();
        assert_eq!(entries, 1, "no temporary directory left");
    }
}
