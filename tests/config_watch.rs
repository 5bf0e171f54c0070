//! The `--config` file watch, end to end: the real daemon, with `--config` and `--manifests`,
//! in the node namespace of a test bed, exits within 2 s with upstream's message and a
//! non-zero status when the file's content changes — written in place, written and renamed
//! over, or swapped behind symlinks as a ConfigMap volume updates — and its rules stay in the
//! kernel and keep carrying traffic. A rewrite with the same content, or a touch, keeps it
//! running. Each start also shows upstream's "Using … Proxier" line for its mode.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::harness::{DAEMON_IN_A_BED, test};
use common::{ManifestDir, wait_until};
use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::probe::ProbeArgs;
use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};

static SERIAL: Mutex<()> = Mutex::new(());

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const CLUSTER_IP: &str = "10.96.165.10";
/// Upstream's lines, as klog writes them.
const EXIT_LINE: &str =
    "\"Error running ProxyServer\" err=\"content of the proxy server's configuration file was updated\"";
const UNCHANGED: &str = "The configuration file's content is unchanged";

fn config(mode: &str, sync_period: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\nclusterCIDR: 10.244.0.0/16\n{mode}:\n  syncPeriod: {sync_period}\n  minSyncPeriod: 0s\n"
    )
}

/// How the test lays the config file out and changes it.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// A plain file, rewritten in place (same inode).
    InPlace,
    /// A plain file, replaced by writing a temporary file and renaming it over.
    Rename,
    /// A ConfigMap volume: `config.conf` → `..data/config.conf`, `..data` → `..<timestamp>`.
    ConfigMap,
}

/// The directory holding the config file in one of the layouts.
struct ConfigDir {
    dir: ManifestDir,
    layout: Layout,
    generation: u32,
}

impl ConfigDir {
    fn new(tag: &str, layout: Layout, text: &str) -> ConfigDir {
        let mut c = ConfigDir {
            dir: ManifestDir::new(&format!("kp-cw-{tag}")),
            layout,
            generation: 0,
        };
        match layout {
            Layout::InPlace | Layout::Rename => std::fs::write(c.path(), text).expect("config"),
            Layout::ConfigMap => {
                let first = c.publish(text);
                std::os::unix::fs::symlink(&first, c.dir.0.join("..data")).expect("..data");
                std::os::unix::fs::symlink("..data/config.conf", c.path()).expect("config.conf");
            }
        }
        c
    }

    /// The path the daemon is given.
    fn path(&self) -> PathBuf {
        self.dir.0.join("config.conf")
    }

    /// kubelet's first step: a new timestamped directory holding the files.
    fn publish(&mut self, text: &str) -> String {
        self.generation += 1;
        let name = format!("..2024_06_01_12_00_0{}.{}", self.generation, 100 + self.generation);
        std::fs::create_dir(self.dir.0.join(&name)).expect("timestamped dir");
        std::fs::write(self.dir.0.join(&name).join("config.conf"), text).expect("config");
        name
    }

    /// Replaces the content the way the layout does.
    fn update(&mut self, text: &str) {
        match self.layout {
            Layout::InPlace => std::fs::write(self.path(), text).expect("rewrite"),
            Layout::Rename => {
                let tmp = self.dir.0.join(".config.conf.swp");
                std::fs::write(&tmp, text).expect("temporary file");
                std::fs::rename(&tmp, self.path()).expect("rename over");
            }
            Layout::ConfigMap => {
                // kubelet's AtomicWriter: new directory, `..data_tmp` → it, renamed over
                // `..data`, the old directory removed.
                let old = std::fs::read_link(self.dir.0.join("..data")).expect("..data");
                let new = self.publish(text);
                let tmp = self.dir.0.join("..data_tmp");
                std::os::unix::fs::symlink(&new, &tmp).expect("..data_tmp");
                std::fs::rename(&tmp, self.dir.0.join("..data")).expect("swap ..data");
                std::fs::remove_dir_all(self.dir.0.join(old)).expect("remove the old generation");
            }
        }
    }
}

struct Node {
    bed: Testbed,
    manifests: ManifestDir,
}

impl Node {
    fn new(tag: &str) -> Node {
        let mut spec = TestbedSpec::new(format!("kpw-{tag}"), BIN);
        spec.endpoints = 1;
        let bed = Testbed::build(&spec).expect("test bed builds (root and iproute2 needed)");
        let manifests = ManifestDir::new(&format!("kp-cw-{tag}-manifests"));
        manifests.write(&web(&bed));
        Node { bed, manifests }
    }

    /// The daemon with `--config` at `path` and `-v=2` (the watch's looks are debug lines).
    fn start(&self, path: &Path, mode: &str) -> ChildGuard {
        let args = vec![
            "--hostname-override=node-a".to_string(),
            "-v=2".into(),
            format!("--config={}", path.display()),
            "--manifests".into(),
            self.manifests.0.display().to_string(),
        ];
        let daemon = self.bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
        daemon
            .wait_for_log("Synced rules", Duration::from_secs(20))
            .expect("first sync");
        let using = format!("] \"Using {mode} Proxier\"");
        let log = daemon.log();
        assert!(
            log.lines().any(|l| l.starts_with('I') && l.ends_with(&using)),
            "upstream's info line {using:?}:\n{log}"
        );
        // The watch's first look, at start, found the file as it was read.
        daemon
            .wait_for_log(UNCHANGED, Duration::from_secs(5))
            .expect("the first look");
        daemon
    }

    /// Connections to the Service get answers (rules in the kernel, whoever put them there).
    fn serves(&self) -> bool {
        let to = SocketAddr::new(CLUSTER_IP.parse().unwrap(), 80);
        self.bed
            .probe(&self.bed.client, &ProbeArgs::tcp(to).with_count(3))
            .is_ok_and(|r| r.all_ok())
    }

    fn rules(&self, mode: &str) -> String {
        let (tool, args): (&str, &[&str]) = match mode {
            "nftables" => ("nft", &["list", "ruleset"]),
            _ => ("iptables-save", &["-t", "nat"]),
        };
        let text = self.bed.node.exec_ok(tool, args).expect("list the rules");
        // iptables-save stamps its output with the time.
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect()
    }
}

fn web(bed: &Testbed) -> String {
    manifests(&[ServiceSpec::new("web", CLUSTER_IP, &[Ep::local(bed.endpoint(0).ip)])])
}

/// Waits up to 2 s after `changed` for the daemon's exit; asserts upstream's error line and a
/// non-zero status.
fn assert_exits_with_the_message(daemon: &mut ChildGuard, changed: Instant, what: &str) {
    let status = daemon
        .wait_timeout(Duration::from_secs(2).saturating_sub(changed.elapsed()))
        .expect("wait");
    let log = daemon.log();
    let Some(status) = status else {
        panic!("{what}: still running 2 s after the change:\n{log}");
    };
    println!("{what}: exited {:?} after the change ({status})", changed.elapsed());
    assert!(!status.success(), "{what}: exit status {status}");
    assert!(
        log.lines().any(|l| l.starts_with('E') && l.ends_with(EXIT_LINE)),
        "{what}: upstream's error line:\n{log}"
    );
}

/// One layout in iptables mode: an unchanged rewrite and a touch keep the daemon; a change
/// stops it, leaving its rules, which still serve.
fn a_changed_config_file_stops_the_daemon_and_leaves_the_rules(layout: Layout) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tag = format!("{layout:?}").to_lowercase();
    let node = Node::new(&tag);
    let before = config("iptables", "2s");
    let mut file = ConfigDir::new(&tag, layout, &before);
    let mut daemon = node.start(&file.path(), "iptables");
    assert!(node.serves(), "serves before the change");

    // Same content, written the layout's way, then a touch: each gets a look, and no exit.
    let looks = |d: &ChildGuard| d.log().matches(UNCHANGED).count();
    let seen = looks(&daemon);
    file.update(&before);
    wait_until(Duration::from_secs(5), "a look at the unchanged rewrite", || {
        looks(&daemon) > seen
    });
    let target = std::fs::canonicalize(file.path()).expect("the file behind the path");
    let mtime = std::fs::File::options()
        .write(true)
        .open(&target)
        .and_then(|f| f.set_modified(std::time::SystemTime::now()));
    mtime.expect("touch");
    let seen = looks(&daemon);
    wait_until(Duration::from_secs(5), "a look at the touch", || looks(&daemon) > seen);
    assert!(
        daemon.try_wait().expect("check").is_none(),
        "an unchanged file keeps the daemon:\n{}",
        daemon.log()
    );

    // A real change: a longer sync period.
    let rules = node.rules("iptables");
    let changed = Instant::now();
    file.update(&config("iptables", "3s"));
    assert_exits_with_the_message(&mut daemon, changed, &format!("{layout:?}"));
    assert_eq!(node.rules("iptables"), rules, "the rules stay as they were");
    assert!(node.serves(), "the rules still serve after the exit");
}

fn in_place_rewrite() {
    a_changed_config_file_stops_the_daemon_and_leaves_the_rules(Layout::InPlace);
}

fn write_and_rename() {
    a_changed_config_file_stops_the_daemon_and_leaves_the_rules(Layout::Rename);
}

fn configmap_symlink_swap() {
    a_changed_config_file_stops_the_daemon_and_leaves_the_rules(Layout::ConfigMap);
}

/// nftables mode: its start line, and the same exit on a ConfigMap update.
fn nftables_mode_exits_the_same_way() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let node = Node::new("nft");
    let mut file = ConfigDir::new("nft", Layout::ConfigMap, &config("nftables", "2s"));
    let mut daemon = node.start(&file.path(), "nftables");
    assert!(node.serves());
    let rules = node.rules("nftables");
    let changed = Instant::now();
    file.update(&config("nftables", "3s"));
    assert_exits_with_the_message(&mut daemon, changed, "nftables, ConfigMap");
    assert_eq!(node.rules("nftables"), rules, "the table stays as it was");
    assert!(node.serves());
}

fn main() -> ExitCode {
    let tests: &[(&str, fn())] = &common::harness::named![
        in_place_rewrite, write_and_rename, configmap_symlink_swap, nftables_mode_exits_the_same_way,
    ];
    common::harness::run(tests.iter().map(|&(name, f)| test(name, f).needs(DAEMON_IN_A_BED)))
}
