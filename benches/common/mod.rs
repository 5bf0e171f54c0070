//! What the daemon benchmarks (`dataplane`, `latency`) share: their environment knobs, running
//! code inside a network namespace, the machine's load, temporary directories, progress lines
//! and reading klog-style lines of the daemon's log.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use kube_proxy::model::ProxyState;

pub fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .replace(['_', ','], "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

pub fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Thousands separators: 30000 → "30,000".
pub fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Starts the clock of [`progress`].
pub fn start_clock() {
    START.get_or_init(Instant::now);
}

/// A progress line, with the time since the start of the benchmark.
pub fn progress(msg: impl AsRef<str>) {
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    println!("  [{t:>6.1} s] {}", msg.as_ref());
}

/// Runs `f` on a thread that entered the network namespace `ns` (sockets it creates stay
/// there; processes it starts run there). The calling thread never changes namespace.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("the netns file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns (needs root)");
            f()
        })
        .join()
        .expect("the thread in the namespace panicked")
    })
}

/// `/proc/loadavg`'s three averages: the timings share the machine with whatever else runs.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The one-minute load average.
pub fn loadavg_1m() -> f64 {
    loadavg()
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("kp-bench-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The value of `key=` in a klog-style line, unquoted.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &line[start..];
    let end = rest.find(' ').unwrap_or(rest.len());
    Some(rest[..end].trim_matches('"'))
}

/// NodePorts as an API server hands them out: unique, 30000–32767; the rest lose theirs.
pub fn unique_node_ports(state: &mut ProxyState) {
    let mut next: u32 = 30000;
    for sps in &mut state.service_ports {
        let sps = std::sync::Arc::make_mut(sps);
        if sps.port.node_port != 0 {
            if next <= 32767 {
                sps.port.node_port = next as u16;
                next += 1;
            } else {
                sps.port.node_port = 0;
            }
        }
    }
}

/// Nearest-rank percentile (`p` in 0..=1) of `v`, sorted in place; 0 for none.
pub fn percentile_of(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[(((v.len() - 1) as f64) * p).round() as usize]
}
