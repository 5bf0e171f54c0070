//! Helpers shared by the integration tests: running the real binary on scenario files, the
//! states the scenarios make, looking up tools, polling with a deadline, manifest directories;
//! network namespaces ([`netns`]), the harness of the tests that need root or a kernel
//! feature ([`harness`]), the connection load of the mode-switch tests ([`load`]), a
//! simulated agent writing rules beside ours ([`agent`]) and nftables listings compared
//! ([`nft`]).
#![allow(dead_code)]

pub mod agent;
pub mod cluster;
pub mod explain;
pub mod harness;
pub mod load;
pub mod netns;
pub mod nft;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::model::{IpFamily, NodeInfo, ProxyState, build_state};
use kube_proxy::proxy::RenderOptions;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every scenario file under tests/scenarios plus the README example, with the flags written
/// on its `# flags:` line.
pub fn scenarios() -> Vec<(String, PathBuf, Vec<String>)> {
    let mut out = Vec::new();
    let dir = root().join("tests/scenarios");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/scenarios exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for f in files {
        let name = f.file_stem().unwrap().to_string_lossy().to_string();
        let flags = flags_of(&f);
        // Relative paths keep file names in messages (and snapshots) independent of the checkout.
        let rel = f.strip_prefix(root()).map(Path::to_path_buf).unwrap_or(f);
        out.push((name, rel, flags));
    }
    out
}

/// One state a scenario renders: its name and flags, its node, and the state of one family.
pub struct ScenarioState {
    pub name: String,
    pub flags: Vec<String>,
    pub node: NodeInfo,
    pub state: ProxyState,
}

/// The states of every scenario: those of the families it has service ports in (IPv4 when it
/// has none), each scenario's IPv4 first.
pub fn scenario_states() -> Vec<ScenarioState> {
    let mut out = Vec::new();
    for (name, path, flags) in scenarios() {
        let abs = root().join(&path);
        let objects = kube_proxy::manifest::load_paths(&[abs.as_path()]).expect("scenario loads");
        let node = NodeInfo::from_objects(&objects, "node-a", &[]);
        let states: Vec<ProxyState> = [IpFamily::V4, IpFamily::V6]
            .into_iter()
            .map(|f| build_state(&objects, &node, f))
            .collect();
        let used: Vec<&ProxyState> = states.iter().filter(|s| !s.service_ports.is_empty()).collect();
        let used = if used.is_empty() { vec![&states[0]] } else { used };
        for st in used {
            out.push(ScenarioState {
                name: name.clone(),
                flags: flags.clone(),
                node: node.clone(),
                state: st.clone(),
            });
        }
    }
    assert!(!out.is_empty(), "no scenarios found");
    out
}

/// `ipv4` or `ipv6`, as snapshot names spell a family.
pub fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4",
        IpFamily::V6 => "ipv6",
    }
}

/// nftables' name of the family (`ip`, `ip6`).
pub fn nft_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// The `--cluster-cidr` of `family` from a scenario's flags, else the IPv4 default the brief
/// of these tests uses (which the renderer ignores for IPv6).
pub fn cluster_cidr(flags: &[String], family: IpFamily) -> String {
    flags
        .iter()
        .filter_map(|f| f.strip_prefix("--cluster-cidr="))
        .flat_map(|v| v.split(','))
        .find(|c| c.parse::<ipnet::IpNet>().is_ok_and(|n| family.contains(&n.addr())))
        .unwrap_or("10.244.0.0/16")
        .to_string()
}

/// The nftables render options of a scenario's flags.
pub fn nft_options(flags: &[String], family: IpFamily) -> RenderOptions {
    RenderOptions {
        local_detector: LocalDetector::Cidr(cluster_cidr(flags, family)),
        // nftables mode defaults nodePortAddresses to the node's primary IPs.
        node_port_addresses: vec!["primary".into()],
        ..RenderOptions::default()
    }
}

pub fn flags_of(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("scenario readable");
    text.lines()
        .find_map(|l| l.strip_prefix("# flags:"))
        .map(|f| f.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

pub struct Output {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `kube-proxy ARGS`.
pub fn kube_proxy<S: AsRef<str>>(args: &[S]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(args.iter().map(|a| a.as_ref()))
        .current_dir(root())
        .output()
        .expect("kube-proxy binary runs");
    Output {
        status: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `kube-proxy render FLAGS PATH` → stdout, asserting success.
pub fn render(path: &Path, flags: &[String]) -> String {
    let mut args: Vec<String> = vec!["render".into()];
    args.extend(flags.iter().cloned());
    args.push(path.display().to_string());
    let out = kube_proxy(&args);
    assert_eq!(out.status, 0, "render {} failed: {}", path.display(), out.stderr);
    out.stdout
}

/// Splits the output of `render` into (family header, restore input without comments).
pub fn restore_inputs(rendered: &str) -> Vec<(bool, String)> {
    let mut out: Vec<(bool, String)> = Vec::new();
    for line in rendered.lines() {
        if line.starts_with("# ip6tables-restore") {
            out.push((true, String::new()));
        } else if line.starts_with("# iptables-restore") {
            out.push((false, String::new()));
        } else if !line.starts_with('#')
            && !line.is_empty()
            && let Some(last) = out.last_mut()
        {
            last.1.push_str(line);
            last.1.push('\n');
        }
    }
    out
}

/// Whether `tool` is installed: on `PATH`, or in /usr/sbin or /sbin (looked up, not run).
pub fn which(tool: &str) -> bool {
    kube_proxy::vm::find_program(tool).is_some()
}

/// `text` with line numbers, for failure messages about a ruleset.
pub fn numbered(text: &str) -> String {
    text.lines()
        .enumerate()
        .map(|(i, l)| format!("{:4} {l}\n", i + 1))
        .collect()
}

/// Polls `check` every 20 ms until it is true; panics after `timeout`. Returns the time it
/// took.
pub fn wait_until(timeout: Duration, what: &str, check: impl FnMut() -> bool) -> Duration {
    wait_until_every(Duration::from_millis(20), timeout, what, check)
}

/// [`wait_until`], polling every `every`.
pub fn wait_until_every(every: Duration, timeout: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if check() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(every);
    }
}

/// A manifest directory (`NAME-PID` in the temporary directory), removed on drop.
pub struct ManifestDir(pub PathBuf);

impl ManifestDir {
    pub fn new(name: &str) -> ManifestDir {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create manifest dir");
        ManifestDir(dir)
    }

    /// Replaces the manifests atomically (write + rename), as a config management tool would.
    pub fn write(&self, yaml: &str) {
        let tmp = self.0.join(".services.yaml.tmp");
        std::fs::write(&tmp, yaml).expect("write manifests");
        std::fs::rename(&tmp, self.0.join("services.yaml")).expect("rename manifests");
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `GET path` over plain HTTP/1.0 from inside `ns`: (status, body).
pub fn http_get(ns: &str, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    netns::in_netns(ns, || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let status = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Some((status, body))
    })
}
