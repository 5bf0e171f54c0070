//! The `--conntrack-*` sysctls, set once at start as upstream's `SetSysctls`
//! (pkg/proxy/conntrack/sysctls.go): [`conntrack_max`] sizes the table by the node's CPUs
//! ([`detect_num_cpus`]), [`apply_sysctls`] writes the settings, and
//! [`apply_sysctls_and_hashsize`] also grows the module's `hashsize`. A setting the kernel
//! refuses is a warning, never an error.

use std::fs;
use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use tracing::{debug, info, warn};

/// Where the conntrack module's `hashsize` parameter lives (not under /proc/sys).
pub const HASHSIZE_PATH: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// Upstream caps the scaled `nf_conntrack_max` at 1Mi entries (`getConntrackMax`).
const CONNTRACK_MAX_LIMIT: u64 = 1_048_576;

/// The `--conntrack-*` settings (`KubeProxyConntrackConfiguration`). A zero duration or zero
/// `max_per_core` means "leave the kernel's value alone".
#[derive(Clone, Debug, PartialEq)]
pub struct ConntrackConfig {
    /// `--conntrack-max-per-core`.
    pub max_per_core: u32,
    /// `--conntrack-min`.
    pub min: u32,
    /// `--conntrack-tcp-timeout-established`.
    pub tcp_established_timeout: Duration,
    /// `--conntrack-tcp-timeout-close-wait`.
    pub tcp_close_wait_timeout: Duration,
    /// `--conntrack-tcp-be-liberal`.
    pub tcp_be_liberal: bool,
    /// `--conntrack-udp-timeout`.
    pub udp_timeout: Duration,
    /// `--conntrack-udp-timeout-stream`.
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackConfig {
    /// Upstream's defaults.
    fn default() -> Self {
        ConntrackConfig {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// The `nf_conntrack_max` to ask for, as upstream's `getConntrackMax`: 0 (leave it) when
/// `max_per_core` is 0; otherwise `max_per_core × cpus`, capped at 1Mi, and raised to `min` when
/// below it (the cap wins over `min`, as upstream checks it first).
pub fn conntrack_max(cfg: &ConntrackConfig, num_cpus: usize) -> u64 {
    if cfg.max_per_core == 0 {
        return 0;
    }
    let scaled = u64::from(cfg.max_per_core).saturating_mul(num_cpus as u64);
    if scaled > CONNTRACK_MAX_LIMIT {
        CONNTRACK_MAX_LIMIT
    } else if scaled > u64::from(cfg.min) {
        scaled
    } else {
        u64::from(cfg.min)
    }
}

/// The node's online CPU count, as upstream sizes `nf_conntrack_max` by (the node's count from
/// `/sys/devices/system/cpu/online`, not this process's CPU affinity), falling back to the
/// available parallelism.
pub fn detect_num_cpus() -> usize {
    fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpu_list(&s))
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
}

/// Counts a kernel CPU list such as `0-3,8,10-11`.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                b.checked_sub(a)? + 1
            }
            None => part.parse::<usize>().map(|_| 1).ok()?,
        };
    }
    Some(n)
}

/// Writes the conntrack sysctls under `proc_sys` (normally `/proc/sys`), in upstream's order;
/// returns one warning per setting that could not be applied. Does not touch `hashsize`; see
/// [`apply_sysctls_and_hashsize`].
pub fn apply_sysctls(cfg: &ConntrackConfig, proc_sys: &Path, num_cpus: usize) -> Vec<String> {
    apply_sysctls_and_hashsize(cfg, proc_sys, None, num_cpus)
}

/// [`apply_sysctls`], plus upstream's `hashsize` adjustment when `hashsize_file` is given
/// (normally [`HASHSIZE_PATH`]): when a `nf_conntrack_max` is configured and the hash table has
/// fewer than `max / 4` buckets, it is grown to `max / 4`.
///
/// As upstream's `setSysctls`: `nf_conntrack_max` is only ever raised (written when the current
/// value is lower or unreadable); each other sysctl is written only when configured (non-zero,
/// or `tcp_be_liberal` true) and different from its current value. Unlike upstream, a failure is
/// a warning and the remaining settings are still applied: in a network namespace
/// `nf_conntrack_max` is read-only and `hashsize` refuses writes, and neither should stop the proxy.
pub fn apply_sysctls_and_hashsize(
    cfg: &ConntrackConfig,
    proc_sys: &Path,
    hashsize_file: Option<&Path>,
    num_cpus: usize,
) -> Vec<String> {
    let mut warnings = Vec::new();
    let mut warn_on = |result: Result<(), String>| {
        if let Err(w) = result {
            warn!(warning = %w, "Could not apply a conntrack setting");
            warnings.push(w);
        }
    };
    let set = |name: &str, value: u64| set_sysctl(proc_sys, name, value);

    let max = conntrack_max(cfg, num_cpus);
    if max > 0 {
        match read_u64(&proc_sys.join(NETFILTER).join("nf_conntrack_max")) {
            Ok(current) if current >= max => {
                debug!(current, wanted = max, "nf_conntrack_max already large enough");
            }
            _ => {
                info!(nf_conntrack_max = max, "Setting nf_conntrack_max");
                warn_on(set("nf_conntrack_max", max));
            }
        }
        if let Some(path) = hashsize_file {
            warn_on(grow_hashsize(path, max / 4));
        }
    }

    let seconds = |d: Duration| (!d.is_zero()).then_some(d.as_secs());
    if let Some(s) = seconds(cfg.tcp_established_timeout) {
        warn_on(set("nf_conntrack_tcp_timeout_established", s));
    }
    if let Some(s) = seconds(cfg.tcp_close_wait_timeout) {
        warn_on(set("nf_conntrack_tcp_timeout_close_wait", s));
    }
    if cfg.tcp_be_liberal {
        warn_on(set("nf_conntrack_tcp_be_liberal", 1));
    }
    if let Some(s) = seconds(cfg.udp_timeout) {
        warn_on(set("nf_conntrack_udp_timeout", s));
    }
    if let Some(s) = seconds(cfg.udp_stream_timeout) {
        warn_on(set("nf_conntrack_udp_timeout_stream", s));
    }
    warnings
}

const NETFILTER: &str = "net/netfilter";

fn read_u64(path: &Path) -> Result<u64, String> {
    let text = fs::read_to_string(path).map_err(|e| e.to_string())?;
    text.trim()
        .parse::<u64>()
        .map_err(|e| format!("{:?} is not a number: {e}", text.trim()))
}

/// Writes `value` to an existing file (never creates one: a missing sysctl is a warning).
fn write_u64(path: &Path, value: u64) -> io::Result<()> {
    let mut file = fs::OpenOptions::new().write(true).truncate(true).open(path)?;
    file.write_all(value.to_string().as_bytes())
}

/// Upstream's `setIntSysCtl`: write only when the current value differs (or cannot be read).
fn set_sysctl(proc_sys: &Path, name: &str, value: u64) -> Result<(), String> {
    let entry = format!("{NETFILTER}/{name}");
    let path = proc_sys.join(&entry);
    if read_u64(&path) == Ok(value) {
        return Ok(());
    }
    info!(entry, value, "Set sysctl");
    write_u64(&path, value).map_err(|e| format!("could not set sysctl {entry} to {value} ({}): {e}", path.display()))
}

fn grow_hashsize(path: &Path, wanted: u64) -> Result<(), String> {
    let current = read_u64(path).map_err(|e| format!("could not read conntrack hashsize ({}): {e}", path.display()))?;
    if current >= wanted {
        return Ok(());
    }
    info!(conntrack_hashsize = wanted, "Setting conntrack hashsize");
    write_u64(path, wanted)
        .map_err(|e| format!("could not set conntrack hashsize to {wanted} ({}): {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn default_config_is_upstreams() {
        let c = ConntrackConfig::default();
        assert_eq!((c.max_per_core, c.min), (32768, 131072));
        assert_eq!(c.tcp_established_timeout, Duration::from_secs(86400));
        assert_eq!(c.tcp_close_wait_timeout, Duration::from_secs(3600));
        assert!(!c.tcp_be_liberal);
        assert_eq!((c.udp_timeout, c.udp_stream_timeout), (Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn conntrack_max_matches_upstream() {
        let cfg = |max_per_core, min| ConntrackConfig {
            max_per_core,
            min,
            ..ConntrackConfig::default()
        };
        // Upstream's TestGetConntrackMax, with 4 CPUs.
        assert_eq!(conntrack_max(&cfg(0, 0), 4), 0);
        assert_eq!(conntrack_max(&cfg(67890, 1), 4), 67890 * 4);
        assert_eq!(conntrack_max(&cfg(1, 123456), 4), 123456);
        assert_eq!(conntrack_max(&cfg(0, 123456), 4), 0);
        // Defaults: 32768 × 2 CPUs is below min; × 8 is above.
        assert_eq!(conntrack_max(&ConntrackConfig::default(), 2), 131072);
        assert_eq!(conntrack_max(&ConntrackConfig::default(), 8), 262144);
        // The 1Mi cap, which wins even over a larger min (upstream checks it first).
        assert_eq!(conntrack_max(&ConntrackConfig::default(), 64), 1_048_576);
        assert_eq!(conntrack_max(&cfg(u32::MAX, 2_000_000), 1024), 1_048_576);
    }

    #[test]
    fn count_cpu_list_reads_the_kernel_format() {
        assert_eq!(count_cpu_list("0\n"), Some(1));
        assert_eq!(count_cpu_list("0-3\n"), Some(4));
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
        assert!(detect_num_cpus() >= 1);
    }

    /// A scratch directory standing in for /proc/sys, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("kp-conntrack-{tag}-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join(NETFILTER)).expect("scratch dir");
            Scratch(dir)
        }
        fn sysctl(&self, name: &str) -> PathBuf {
            self.0.join(NETFILTER).join(name)
        }
        fn put(&self, name: &str, value: &str) {
            fs::write(self.sysctl(name), value).expect("scratch file");
        }
        fn get(&self, name: &str) -> String {
            fs::read_to_string(self.sysctl(name)).expect("scratch file")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const ALL: [&str; 6] = [
        "nf_conntrack_max", "nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait",
        "nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream",
    ];

    /// Kernel-like starting values.
    fn fill(dir: &Scratch) {
        for (name, value) in ALL.iter().zip(["65536\n", "432000\n", "60\n", "0\n", "30\n", "120\n"]) {
            dir.put(name, value);
        }
    }

    #[test]
    fn apply_sysctls_writes_configured_values() {
        let dir = Scratch::new("defaults");
        fill(&dir);
        assert_eq!(
            apply_sysctls(&ConntrackConfig::default(), &dir.0, 2),
            Vec::<String>::new()
        );
        assert_eq!(dir.get("nf_conntrack_max"), "131072");
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_established"), "86400");
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_close_wait"), "3600");
        // Not configured: left as they were.
        assert_eq!(dir.get("nf_conntrack_tcp_be_liberal"), "0\n");
        assert_eq!(dir.get("nf_conntrack_udp_timeout"), "30\n");
        assert_eq!(dir.get("nf_conntrack_udp_timeout_stream"), "120\n");

        let dir = Scratch::new("all");
        fill(&dir);
        let cfg = ConntrackConfig {
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(45),
            udp_stream_timeout: Duration::from_secs(90),
            ..ConntrackConfig::default()
        };
        assert!(apply_sysctls(&cfg, &dir.0, 8).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "262144");
        assert_eq!(dir.get("nf_conntrack_tcp_be_liberal"), "1");
        assert_eq!(dir.get("nf_conntrack_udp_timeout"), "45");
        assert_eq!(dir.get("nf_conntrack_udp_timeout_stream"), "90");
    }

    #[test]
    fn apply_sysctls_leaves_equal_values_alone() {
        let dir = Scratch::new("equal");
        fill(&dir);
        // Same value, different spelling: proves no write happened.
        dir.put("nf_conntrack_tcp_timeout_established", "86400\n");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_established"), "86400\n");
    }

    #[test]
    fn apply_sysctls_never_lowers_conntrack_max() {
        let dir = Scratch::new("nolower");
        fill(&dir);
        dir.put("nf_conntrack_max", "500000\n");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "500000\n");
        // Equal is left alone too; unreadable garbage is overwritten.
        dir.put("nf_conntrack_max", "131072\n");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "131072\n");
        dir.put("nf_conntrack_max", "garbage");
        assert!(apply_sysctls(&ConntrackConfig::default(), &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_max"), "131072");
    }

    #[test]
    fn apply_sysctls_failures_are_warnings_naming_the_sysctl() {
        let dir = Scratch::new("fail");
        fill(&dir);
        // Missing: not created. A directory in place of the file: the write fails even for root.
        fs::remove_file(dir.sysctl("nf_conntrack_max")).expect("remove");
        fs::remove_file(dir.sysctl("nf_conntrack_tcp_timeout_established")).expect("remove");
        fs::create_dir(dir.sysctl("nf_conntrack_tcp_timeout_established")).expect("dir");
        let warnings = apply_sysctls(&ConntrackConfig::default(), &dir.0, 2);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("net/netfilter/nf_conntrack_max"), "{warnings:?}");
        assert!(
            warnings[1].contains("net/netfilter/nf_conntrack_tcp_timeout_established"),
            "{warnings:?}"
        );
        assert!(
            !dir.sysctl("nf_conntrack_max").exists(),
            "a missing sysctl must not be created"
        );
        // The rest was still applied.
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_close_wait"), "3600");
    }

    #[test]
    fn apply_sysctls_nothing_configured_touches_nothing() {
        let dir = Scratch::new("none");
        let cfg = ConntrackConfig {
            max_per_core: 0,
            min: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        };
        // No files at all, yet no warnings: nothing was attempted.
        assert!(apply_sysctls_and_hashsize(&cfg, &dir.0, Some(&dir.0.join("hashsize")), 2).is_empty());
    }

    #[test]
    fn apply_sysctls_sub_second_timeout_writes_zero_like_upstream() {
        // Upstream tests `Duration > 0` and then writes whole seconds.
        let dir = Scratch::new("subsec");
        fill(&dir);
        let cfg = ConntrackConfig {
            udp_timeout: Duration::from_millis(500),
            ..ConntrackConfig::default()
        };
        assert!(apply_sysctls(&cfg, &dir.0, 2).is_empty());
        assert_eq!(dir.get("nf_conntrack_udp_timeout"), "0");
    }

    #[test]
    fn hashsize_grown_to_a_quarter_of_max_never_shrunk() {
        let dir = Scratch::new("hash");
        fill(&dir);
        let hashsize = dir.0.join("hashsize");
        fs::write(&hashsize, "1024\n").expect("hashsize");
        assert!(apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2).is_empty());
        assert_eq!(fs::read_to_string(&hashsize).expect("hashsize"), "32768");
        // Checked even when nf_conntrack_max was already large enough, as upstream does.
        dir.put("nf_conntrack_max", "1000000\n");
        fs::write(&hashsize, "1024\n").expect("hashsize");
        assert!(apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2).is_empty());
        assert_eq!(fs::read_to_string(&hashsize).expect("hashsize"), "32768");
        fs::write(&hashsize, "65536\n").expect("hashsize");
        assert!(apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2).is_empty());
        assert_eq!(fs::read_to_string(&hashsize).expect("hashsize"), "65536\n");
        // Unreadable: a warning naming hashsize, and the other settings still applied.
        fs::remove_file(&hashsize).expect("remove");
        dir.put("nf_conntrack_tcp_timeout_close_wait", "60\n");
        let warnings = apply_sysctls_and_hashsize(&ConntrackConfig::default(), &dir.0, Some(&hashsize), 2);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("hashsize"), "{warnings:?}");
        assert_eq!(dir.get("nf_conntrack_tcp_timeout_close_wait"), "3600");
    }
}
