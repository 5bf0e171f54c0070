//! `kube-proxy lab --proxy-mode=ipvs`, whole, in the VM test group: this machine's kernel has
//! no IPVS, so the lab boots the test VM itself (`src/lab/relay.rs`), runs again there with the
//! same arguments, and relays the report and the exit code. Needs root, qemu and Debian's
//! kernel (see .ci/run); without them the tests are reported as ignored, with what is missing.
//! On a kernel with IPVS the first test checks the lab run here instead, and the two others,
//! about the VM, are ignored.
//!
//! The checks are on the report's content, section by section (rr's exact split, the real
//! servers, the kernel's refusal with no endpoint, the NodePort's virtual server, IPVS's
//! connection table), and on cleanup: no namespace here, nothing left of the VM (its runner's
//! temporary directory is the lab's own `TMPDIR`, which must end empty, and no process may
//! still name it), and, in the VM, the lab's own check of `ip netns list` in its last line.

mod common;
#[path = "support/vm.rs"]
mod vm;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");

/// One VM at a time: two under TCG on two cores would only slow both down.
static ONE_VM: Mutex<()> = Mutex::new(());

/// A lab process with its own `TMPDIR` (where the VM runner keeps its files), its output
/// collected on threads as it comes.
struct Lab {
    child: Child,
    tmp: PathBuf,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
}

/// What a finished lab printed.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

fn collect(mut from: impl Read + Send + 'static, into: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            into.lock().unwrap_or_else(|e| e.into_inner()).push_str(&text);
        }
    })
}

impl Lab {
    fn start(name: &str, args: &[&str]) -> Lab {
        let tmp = std::env::temp_dir().join(format!("kp-vm-lab-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).expect("the lab's TMPDIR");
        let mut child = Command::new(BIN)
            .arg("lab")
            .args(args)
            .env("TMPDIR", &tmp)
            .env(kube_proxy::vm::CACHE_ENV, vm::cache_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the lab starts");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let readers = vec![
            collect(child.stdout.take().expect("piped"), stdout.clone()),
            collect(child.stderr.take().expect("piped"), stderr.clone()),
        ];
        Lab {
            child,
            tmp,
            stdout,
            stderr,
            readers,
        }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("a pid"))
    }

    fn stdout(&self) -> String {
        self.stdout.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the report contains `needle`; panics after `timeout` or if the lab exits.
    fn wait_for_report(&mut self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.stdout().contains(needle) {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "the lab exited ({status}) before printing {needle:?}:\n{}",
                    self.stdout()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} within {timeout:?}:\n{}",
                self.stdout()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the lab to exit; past `timeout` it gets SIGTERM (it stops its VM) and the
    /// test fails.
    fn finish(&mut self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = kill(self.pid(), Signal::SIGTERM);
                let _ = self.child.wait();
                panic!("the lab did not finish within {timeout:?}; stopped:\n{}", self.stdout());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        Finished {
            status,
            stdout: self.stdout(),
            stderr: self.stderr.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }

    /// Nothing of the VM is left: its runner's directory is gone from the lab's `TMPDIR`, no
    /// process (qemu, tail...) names that directory any more, and this machine has no
    /// namespace of the lab.
    fn assert_nothing_left(&self) {
        let left: Vec<_> = std::fs::read_dir(&self.tmp)
            .expect("the lab's TMPDIR")
            .filter_map(Result::ok)
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "left in the lab's TMPDIR: {left:?}");
        let users = processes_naming(&self.tmp);
        assert!(users.is_empty(), "processes still using the VM's files: {users:?}");
        let namespaces = common::netns::lab_namespaces(self.child.id());
        assert!(namespaces.is_empty(), "namespaces on this machine: {namespaces:?}");
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // A failed assertion while it runs: stop it the way an operator would (it stops the
        // VM), then reap it.
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(self.pid(), Signal::SIGTERM);
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir(&self.tmp);
    }
}

/// Command lines (pid: cmdline) that contain `path`.
fn processes_naming(path: &Path) -> Vec<String> {
    let needle = path.to_string_lossy().into_owned();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|e| {
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            let line = String::from_utf8_lossy(&raw).replace('\0', " ");
            line.contains(&needle)
                .then(|| format!("{}: {line}", e.file_name().to_string_lossy()))
        })
        .collect()
}

fn has_ipvs() -> bool {
    Path::new("/proc/net/ip_vs").exists()
}

/// The report's section `n` (from its `n. ` heading to the next heading), blanks squeezed so
/// that ipvsadm's padded columns compare as single spaces.
fn section(report: &str, n: u32) -> String {
    let head = format!("{n}. ");
    let next = format!("{}. ", n + 1);
    let lines: Vec<String> = report
        .lines()
        .skip_while(|l| !l.starts_with(&head))
        .take_while(|l| !l.starts_with(&next) && !l.starts_with("Done:"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert!(!lines.is_empty(), "no section {n} in the report:\n{report}");
    lines.join("\n")
}

fn assert_has(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

fn lab_in_ipvs_mode_reports_from_the_vm() {
    let _one = ONE_VM.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    // Fewer connections than the default 300: under TCG every one costs.
    let mut lab = Lab::start("report", &["--proxy-mode=ipvs", "--connections", "30"]);
    let Finished { status, stdout, stderr } = lab.finish(Duration::from_secs(1000));
    eprintln!("the lab took {:.0} s", started.elapsed().as_secs_f64());
    assert!(status.success(), "the lab failed ({status}):\n{stderr}\n{stdout}");
    if !has_ipvs() {
        assert_has(&stderr, &["has no IPVS", "so the lab runs in a VM", "it exited with 0"]);
    }
    let o = &stdout;
    assert_has(o, &["kube-proxy lab: ipvs mode on kernel "]);

    let s1 = section(o, 1);
    assert_has(
        &s1,
        &[
            "TCP 10.96.165.10:80 rr",
            "-> 10.244.1.2:8080 Masq 1 0 0",
            "-> 10.244.2.2:8080 Masq 1 0 0",
            "-> 10.244.3.2:8080 Masq 1 0 0",
            "ip addr: kube-ipvs0 inet 10.96.165.10/32",
            "net.ipv4.vs.conntrack=1 net.ipv4.vs.expire_nodest_conn=1 net.ipv4.vs.expire_quiescent_template=1",
        ],
    );

    // rr: exactly a third each, in turn.
    let s2 = section(o, 2);
    assert_has(
        &s2,
        &[
            "ep1: 10 #",
            "ep2: 10 #",
            "ep3: 10 #",
            ": uniform",
            "rr: every connection went to the next endpoint in turn",
        ],
    );
    assert!(!s2.contains("errors"), "{s2}");

    let s3 = section(o, 3);
    assert_has(
        &s3,
        &[
            "real server 10.244.4.2:8080 (Masq, weight 1) live after",
            "-> 10.244.4.2:8080 Masq 1 0 0",
            "100 new connections: ep1 25, ep2 25, ep3 25, ep4 25",
        ],
    );

    // No endpoints: the old real servers drain at weight 0 and the kernel refuses at once.
    let s4 = section(o, 4);
    assert_has(
        &s4,
        &[
            "TCP 10.96.165.10:80 rr",
            "-> 10.244.1.2:8080 Masq 0 0",
            "-> 10.244.4.2:8080 Masq 0 0",
            "IPVS itself answers ICMP port unreachable",
        ],
    );
    assert!(!s4.contains("Masq 1"), "no real server takes connections:\n{s4}");
    assert_eq!(s4.matches(": refused after").count(), 3, "every connect refused:\n{s4}");

    let s5 = section(o, 5);
    assert_has(
        &s5,
        &[
            "TCP 192.168.49.2:32517 rr",
            "--match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
            "10 connections from 192.168.49.77 to 192.168.49.2:32517: ep",
        ],
    );
    let np = s5
        .lines()
        .find(|l| l.starts_with("10 connections"))
        .expect("the NodePort line");
    assert!(!np.contains("timeout") && !np.contains("refused"), "all answered: {np}");
    let seen = s5
        .lines()
        .find(|l| l.starts_with("the endpoints saw the client as"))
        .expect("the source line");
    assert!(
        seen.contains("as 10.244.") && !seen.contains("192.168.49.77"),
        "masqueraded: {seen}"
    );

    let s6 = section(o, 6);
    assert_has(
        &s6,
        &["pro expire state source virtual destination", "TIME_WAIT 10.244.9.2:"],
    );
    assert!(s6.contains("10.96.165.10:80 10.244."), "{s6}");

    assert_has(
        o,
        &["Done: the namespaces and processes of the lab are removed (`ip netns list` shows none named kplab-"],
    );
    lab.assert_nothing_left();
}

/// SIGTERM while the lab runs in the VM (its test bed built there): the lab stops the VM and
/// exits non-zero soon, leaving nothing behind.
fn sigterm_stops_the_vm_and_leaves_nothing() {
    let _one = ONE_VM.lock().unwrap_or_else(|e| e.into_inner());
    let mut lab = Lab::start("sigterm", &["--proxy-mode=ipvs"]);
    // The report streams out of the VM as it is written: once the test bed line is here, the
    // lab in the VM has namespaces and processes running.
    lab.wait_for_report("Test bed ready", Duration::from_secs(600));
    kill(lab.pid(), Signal::SIGTERM).expect("SIGTERM to the lab");
    let stopped = Instant::now();
    let Finished { status, stderr, .. } = lab.finish(Duration::from_secs(60));
    eprintln!("the lab stopped {:.1} s after SIGTERM", stopped.elapsed().as_secs_f64());
    assert!(!status.success(), "an interrupted lab fails");
    assert_has(&stderr, &["interrupted: stopping the VM", "error: interrupted"]);
    lab.assert_nothing_left();
}

/// A VM that cannot boot (here: a kernel that is not in /boot) is an error that says why, and
/// no report from any other mode.
fn a_vm_that_cannot_boot_fails_clearly() {
    let out = Command::new(BIN)
        .args(["lab", "--proxy-mode=ipvs"])
        .env(kube_proxy::vm::CACHE_ENV, vm::cache_dir())
        .env("KUBE_PROXY_VM_KERNEL", "0.0-no-such-kernel")
        .output()
        .expect("the lab runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_has(
        &stderr,
        &[
            "the VM did not run the lab",
            "cannot read /boot/vmlinuz-0.0-no-such-kernel",
            "qemu-system-x86",
        ],
    );
    assert!(!stdout.contains("kube-proxy lab:"), "no report: {stdout}");
}

/// What `kube-proxy lab --proxy-mode=ipvs` runs (it checks for these itself, and fails).
const LAB_TOOLS: &[common::harness::Requirement] = {
    use common::harness::Requirement::Tool;
    &[
        Tool("ip"),
        Tool("sysctl"),
        Tool("iptables"),
        Tool("iptables-save"),
        Tool("iptables-restore"),
        Tool("ipset"),
        Tool("ipvsadm"),
    ]
};

common::harness::main! {
    &[&[Root, AnyOf(&[Kernel(Ipvs), Vm])], LAB_TOOLS].concat() => lab_in_ipvs_mode_reports_from_the_vm;
    &[&[Root, KernelWithout(Ipvs), Vm], LAB_TOOLS].concat() =>
        sigterm_stops_the_vm_and_leaves_nothing, a_vm_that_cannot_boot_fails_clearly;
}
