//! Network namespaces as guards, driven by `ip netns` / `ip -n`.
//!
//! A [`Netns`] is created with `ip netns add` and deleted on Drop (after killing whatever still
//! runs inside it). Nothing here ever touches the root namespace: links are created inside a
//! namespace (`ip -n A link add … peer name … netns B`), and sysctls are written through
//! `ip netns exec NAME sysctl -w`.
//!
//! [`ChildGuard`] owns a process started inside a namespace: it collects the process' stdout
//! and stderr into an in-memory log (so a chatty daemon never blocks on a full pipe), lets a
//! caller wait for a line to appear in that log, and kills (SIGKILL) and reaps the process on
//! Drop.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::IpAddr;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use ipnet::IpNet;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Longest interface name the kernel accepts (IFNAMSIZ - 1).
pub const MAX_IFNAME: usize = 15;

/// A network namespace created by us; deleted on Drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

fn render_cmd(program: &OsStr, args: &[&OsStr]) -> String {
    let mut s = program.to_string_lossy().into_owned();
    for a in args {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs a command to completion; an error (with the command line, exit status and stderr) if it
/// cannot start or exits non-zero. Returns its stdout.
fn run_checked(cmd: &mut Command) -> Result<String> {
    let line = render_cmd(cmd.get_program(), &cmd.get_args().collect::<Vec<_>>());
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{line}`"))?;
    check_output(&line, &out)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn check_output(line: &str, out: &Output) -> Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "`{line}` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

fn spawn_piped(cmd: &mut Command, line: &str) -> Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{line}`"))
}

fn check_ifname(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_IFNAME || name.contains(['/', ' ', ':']) {
        bail!("invalid interface name {name:?} (1 to {MAX_IFNAME} characters, no '/', ':' or spaces)");
    }
    Ok(())
}

impl Netns {
    /// `ip netns add NAME`, then brings `lo` up inside it. Fails if the name exists already.
    pub fn create(name: &str) -> Result<Netns> {
        if name.is_empty() || name.contains(['/', ' ']) || name == "." || name == ".." {
            bail!("invalid network namespace name {name:?}");
        }
        // Concurrent first uses of `ip netns add` race on making /run/netns a shared mount;
        // retry a few times when the namespace did not get created.
        let mut last_err = None;
        for _ in 0..5 {
            match run_checked(Command::new("ip").args(["netns", "add", name])) {
                Ok(_) => {
                    last_err = None;
                    break;
                }
                Err(e) => {
                    if Self::exists(name) {
                        // Possibly ours from a half-failed attempt, possibly someone else's:
                        // never adopt it.
                        return Err(e.context(format!("network namespace {name} already exists")));
                    }
                    last_err = Some(e);
                }
            }
        }
        if let Some(e) = last_err {
            return Err(e.context(format!("cannot create network namespace {name}")));
        }
        let ns = Netns { name: name.to_string() };
        ns.link_up("lo")?;
        Ok(ns)
    }

    /// Whether `/run/netns/NAME` exists.
    pub fn exists(name: &str) -> bool {
        std::path::Path::new("/run/netns").join(name).exists()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A `Command` for `ip netns exec NAME program args…`; configure its stdio and run it.
    pub fn command<P, I, S>(&self, program: P, args: I) -> Command
    where
        P: AsRef<OsStr>,
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program).args(args);
        cmd
    }

    /// Runs `program args…` inside the namespace with `stdin` as its input, to completion;
    /// returns (success, stdout followed by stderr). An error only when it cannot be run.
    pub fn exec_with_input<P, I, S>(&self, program: P, args: I, stdin: &str) -> Result<(bool, String)>
    where
        P: AsRef<OsStr>,
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut child = self
            .command(program, args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running a command in network namespace {}", self.name))?;
        if let Some(mut pipe) = child.stdin.take() {
            // A command that exits early closes the pipe; its status tells the story.
            let _ = pipe.write_all(stdin.as_bytes());
        }
        let out = child.wait_with_output().context("waiting for the command")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text))
    }

    /// Runs `program args…` inside the namespace to completion and returns its output whatever
    /// its exit status; an error only when it cannot be run. See [`Netns::exec_ok`].
    pub fn exec<P, I, S>(&self, program: P, args: I) -> Result<Output>
    where
        P: AsRef<OsStr>,
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(program, args);
        let line = render_cmd(cmd.get_program(), &cmd.get_args().collect::<Vec<_>>());
        cmd.stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run `{line}`"))
    }

    /// Like [`Netns::exec`] but an error (command line, status, stderr) on a non-zero exit;
    /// returns stdout.
    pub fn exec_ok<P, I, S>(&self, program: P, args: I) -> Result<String>
    where
        P: AsRef<OsStr>,
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run_checked(&mut self.command(program, args))
    }

    /// Starts `program args…` inside the namespace: stdin from /dev/null, stdout and stderr
    /// piped (the caller must drain them, or use [`Netns::spawn_guarded`]).
    pub fn spawn<P, I, S>(&self, program: P, args: I) -> Result<Child>
    where
        P: AsRef<OsStr>,
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(program, args);
        let line = render_cmd(cmd.get_program(), &cmd.get_args().collect::<Vec<_>>());
        spawn_piped(&mut cmd, &line)
    }

    /// Starts `program args…` inside the namespace as a [`ChildGuard`] (output collected in
    /// memory, killed on Drop).
    pub fn spawn_guarded<P, I, S>(&self, program: P, args: I) -> Result<ChildGuard>
    where
        P: AsRef<OsStr>,
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(program, args);
        let line = render_cmd(cmd.get_program(), &cmd.get_args().collect::<Vec<_>>());
        let child = spawn_piped(&mut cmd, &line)?;
        Ok(ChildGuard::new(child, line))
    }

    /// `ip -n NAME args…`, checked; returns stdout.
    pub fn ip<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run_checked(Command::new("ip").args(["-n", &self.name]).args(args))
    }

    /// `sysctl -w KEY=VALUE` inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.sysctls(&[(key, value)])
    }

    /// Several `KEY=VALUE` in one `sysctl -w` run inside the namespace.
    pub fn sysctls(&self, pairs: &[(&str, &str)]) -> Result<()> {
        let mut args = vec!["-q".to_string(), "-w".to_string()];
        args.extend(pairs.iter().map(|(k, v)| format!("{k}={v}")));
        self.exec_ok("sysctl", &args)
            .with_context(|| format!("cannot set sysctls in network namespace {}", self.name))?;
        Ok(())
    }

    /// The value of a sysctl inside the namespace (`sysctl -n KEY`), trimmed.
    pub fn read_sysctl(&self, key: &str) -> Result<String> {
        Ok(self.exec_ok("sysctl", ["-n", key])?.trim().to_string())
    }

    /// `ip link set IF up`.
    pub fn link_up(&self, ifname: &str) -> Result<()> {
        self.ip(["link", "set", ifname, "up"]).map(drop)
    }

    /// `ip addr add ADDR/PREFIX dev IF`.
    pub fn add_addr(&self, ifname: &str, addr: IpNet) -> Result<()> {
        self.ip(["addr", "add", &addr.to_string(), "dev", ifname]).map(drop)
    }

    /// `ip -4|-6 route add DEST via GATEWAY` (DEST may be `default`), in the gateway's family.
    pub fn add_route(&self, dest: &str, via: IpAddr) -> Result<()> {
        let family = if via.is_ipv4() { "-4" } else { "-6" };
        self.ip([family, "route", "add", dest, "via", &via.to_string()])
            .map(drop)
    }

    /// `ip route add default via GATEWAY`.
    pub fn add_default_route(&self, via: IpAddr) -> Result<()> {
        self.add_route("default", via)
    }

    /// Process ids currently inside the namespace (`ip netns pids NAME`).
    pub fn pids(&self) -> Result<Vec<i32>> {
        let out = run_checked(Command::new("ip").args(["netns", "pids", &self.name]))?;
        Ok(out.split_whitespace().filter_map(|p| p.parse().ok()).collect())
    }

    /// Kills what still runs inside the namespace (SIGKILL; all of them were started by us,
    /// since the namespace is ours) and deletes it.
    fn destroy(&self) -> Result<()> {
        // A process we do not wait for (not our child) may need a moment to leave; bounded.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids().unwrap_or_default();
            if pids.is_empty() || Instant::now() >= deadline {
                break;
            }
            for pid in pids {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        run_checked(Command::new("ip").args(["netns", "del", &self.name]))
            .with_context(|| format!("cannot delete network namespace {}", self.name))?;
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            eprintln!("warning: {e:#}");
        }
    }
}

/// One address on one side of a veth pair.
#[derive(Debug, Clone, Copy)]
pub struct VethEnd<'a> {
    pub ns: &'a Netns,
    pub ifname: &'a str,
    pub addrs: &'a [IpNet],
}

/// Creates a veth pair between two namespaces (`ip -n A link add A_IF type veth peer name B_IF
/// netns B`), assigns the addresses and brings both ends up. The root namespace is never
/// involved, so interface names need only be unique inside their own namespace.
pub fn connect_veth(a: VethEnd<'_>, b: VethEnd<'_>) -> Result<()> {
    check_ifname(a.ifname)?;
    check_ifname(b.ifname)?;
    a.ns.ip([
        "link",
        "add",
        a.ifname,
        "type",
        "veth",
        "peer",
        "name",
        b.ifname,
        "netns",
        b.ns.name(),
    ])
    .with_context(|| {
        format!(
            "cannot create veth {}:{} <-> {}:{}",
            a.ns.name(),
            a.ifname,
            b.ns.name(),
            b.ifname
        )
    })?;
    for end in [a, b] {
        for addr in end.addrs {
            end.ns.add_addr(end.ifname, *addr)?;
        }
        end.ns.link_up(end.ifname)?;
    }
    Ok(())
}

#[derive(Debug, Default)]
struct LogState {
    text: String,
    /// Output streams (stdout, stderr) not yet at EOF.
    open: u8,
}

type SharedLog = Arc<(Mutex<LogState>, Condvar)>;

/// A process started inside a namespace. Its stdout and stderr are collected, line by line,
/// into one in-memory log; Drop kills it (SIGKILL) and reaps it.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    label: String,
    log: SharedLog,
}

fn drain<R: Read + Send + 'static>(stream: R, log: SharedLog) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let (lock, cv) = &*log;
                    if let Ok(mut st) = lock.lock() {
                        st.text.push_str(&String::from_utf8_lossy(&buf));
                        if !st.text.ends_with('\n') {
                            st.text.push('\n');
                        }
                    }
                    cv.notify_all();
                }
            }
        }
        let (lock, cv) = &*log;
        if let Ok(mut st) = lock.lock() {
            st.open = st.open.saturating_sub(1);
        }
        cv.notify_all();
    });
}

impl ChildGuard {
    /// Wraps a child whose stdout/stderr are piped (either may be absent) and starts draining.
    pub fn new(mut child: Child, label: String) -> ChildGuard {
        let log: SharedLog = Arc::new((Mutex::new(LogState::default()), Condvar::new()));
        let mut open = 0;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        open += u8::from(stdout.is_some()) + u8::from(stderr.is_some());
        if let Ok(mut st) = log.0.lock() {
            st.open = open;
        }
        if let Some(s) = stdout {
            drain(s, log.clone());
        }
        if let Some(s) = stderr {
            drain(s, log.clone());
        }
        ChildGuard { child, label, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The command line it was started with.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Everything it wrote so far (stdout and stderr interleaved by line).
    pub fn log(&self) -> String {
        self.log.0.lock().map(|st| st.text.clone()).unwrap_or_default()
    }

    /// Waits until its output contains `needle` (checking the whole log, so a line written
    /// before the call counts). An error, with the log, if the process closes its output
    /// (exits) first or the deadline passes.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.log;
        let mut st = lock.lock().map_err(|_| anyhow!("log lock poisoned"))?;
        loop {
            if st.text.contains(needle) {
                return Ok(());
            }
            if st.open == 0 {
                bail!(
                    "`{}` ended its output before writing {needle:?}; its output:\n{}",
                    self.label,
                    st.text
                );
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "`{}` did not write {needle:?} within {timeout:?}; its output:\n{}",
                    self.label,
                    st.text
                );
            }
            st = cv
                .wait_timeout(st, deadline - now)
                .map_err(|_| anyhow!("log lock poisoned"))?
                .0;
        }
    }

    /// Its exit status if it has exited (non-blocking).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.child
            .try_wait()
            .with_context(|| format!("cannot check on `{}`", self.label))
    }

    /// Sends a signal (e.g. SIGTERM for a graceful stop).
    pub fn signal(&self, sig: Signal) -> Result<()> {
        let pid = i32::try_from(self.child.id()).context("pid out of range")?;
        kill(Pid::from_raw(pid), sig).with_context(|| format!("cannot send {sig} to `{}`", self.label))
    }

    /// Polls for its exit until the deadline; `None` if it is still running then.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_wait()? {
                return Ok(Some(st));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL and reap (what Drop does); returns the exit status.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(st) = self.try_wait()? {
            return Ok(st);
        }
        // The process may exit between the check and the kill; the wait below settles it.
        let _ = self.child.kill();
        self.child
            .wait()
            .with_context(|| format!("cannot reap `{}`", self.label))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            eprintln!("warning: {e:#}");
        }
    }
}

/// `VmRSS` and `VmHWM` (the peak) of process `pid`, in KiB, from `/proc/PID/status`; panics if
/// it cannot be read (the lab's and the benchmarks' own children).
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let get = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
    };
    (get("VmRSS:"), get("VmHWM:"))
}

/// Resets the peak RSS (`VmHWM`) of process `pid` to its current RSS (`5` into
/// `/proc/PID/clear_refs`, root only), so that a later `VmHWM` is the peak of what came after.
pub fn reset_peak(pid: u32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
}
