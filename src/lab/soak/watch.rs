//! What the soak watches besides the kernel: the daemon's syncs (its `Synced rules` log
//! lines), its memory and CPU (`/proc/PID/status`, `/proc/PID/stat`), and where connections
//! to the churning Services landed, judged against the endpoints that were ready. Times are
//! seconds since the soak started. Pure but for [`ProcSample::read`].

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::Serialize;

/// One IPv4 sync of the daemon, seen in its log at `t`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sync {
    pub t: f64,
    pub elapsed_ms: f64,
    pub full: bool,
    pub services: usize,
}

/// The value of `key=` in a klog-style line, unquoted.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &line[start..];
    let end = rest.find(' ').unwrap_or(rest.len());
    Some(rest[..end].trim_matches('"'))
}

/// The IPv4 sync a log line reports, if it is one.
pub fn parse_sync(line: &str, t: f64) -> Option<Sync> {
    if !line.contains("\"Synced rules\"") || field(line, "ipFamily") != Some("IPv4") {
        return None;
    }
    Some(Sync {
        t,
        elapsed_ms: field(line, "elapsedMs")?.parse().ok()?,
        full: field(line, "full") == Some("true"),
        services: field(line, "services")?.parse().ok()?,
    })
}

/// The daemon's memory and CPU time at `t`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ProcSample {
    pub t: f64,
    pub rss_kib: u64,
    /// User + system CPU seconds of the daemon, and of its children that it waited for
    /// (`iptables-restore`, `nft`).
    pub cpu_s: f64,
    pub children_cpu_s: f64,
}

impl ProcSample {
    /// Reads `/proc/PID/status` and `/proc/PID/stat`; `None` once the process is gone.
    pub fn read(pid: u32, t: f64) -> Option<ProcSample> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        let (cpu_s, children_cpu_s) = cpu_seconds(&stat)?;
        Some(ProcSample {
            t,
            rss_kib,
            cpu_s,
            children_cpu_s,
        })
    }
}

/// (utime + stime, cutime + cstime) of a `/proc/PID/stat` line, in seconds.
fn cpu_seconds(stat: &str) -> Option<(f64, f64)> {
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<f64> = rest.split_whitespace().map(|v| v.parse().unwrap_or(0.0)).collect();
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??.max(1) as f64;
    // utime, stime, cutime, cstime are fields 14..=17: 11..=14 here.
    Some(((f.get(11)? + f.get(12)?) / tick, (f.get(13)? + f.get(14)?) / tick))
}

/// CPU use between consecutive samples, in % of one core: (t, daemon, children).
pub fn cpu_percent(samples: &[ProcSample]) -> Vec<(f64, f64, f64)> {
    samples
        .windows(2)
        .filter(|w| w[1].t > w[0].t)
        .map(|w| {
            let dt = w[1].t - w[0].t;
            (
                w[1].t,
                100.0 * (w[1].cpu_s - w[0].cpu_s) / dt,
                100.0 * (w[1].children_cpu_s - w[0].children_cpu_s) / dt,
            )
        })
        .collect()
}

/// RSS growth after warm-up: the mean of the last tenth of the samples after `warmup` over
/// the mean of the first tenth (at least 3 samples each), in %, with both means (KiB).
pub fn rss_growth(samples: &[ProcSample], warmup: f64) -> Option<(f64, f64, f64)> {
    let after: Vec<f64> = samples
        .iter()
        .filter(|s| s.t >= warmup)
        .map(|s| s.rss_kib as f64)
        .collect();
    let n = (after.len() / 10).max(3);
    if after.len() < 2 * n {
        return None;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (start, end) = (mean(&after[..n]), mean(&after[after.len() - n..]));
    Some((100.0 * (end / start - 1.0), start, end))
}

/// The p-quantile (0..=1) of unsorted values, nearest rank.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[(((v.len() - 1) as f64) * p).round() as usize]
}

/// The ready endpoints of one live Service over time: each version from when it was written.
#[derive(Clone, Debug, Default)]
pub struct History {
    versions: Vec<(f64, BTreeSet<IpAddr>)>,
}

impl History {
    pub fn new(t: f64, ready: BTreeSet<IpAddr>) -> History {
        History {
            versions: vec![(t, ready)],
        }
    }

    pub fn push(&mut self, t: f64, ready: BTreeSet<IpAddr>) {
        self.versions.push((t, ready));
    }

    /// [`History::push`] unless the ready set stays what it was.
    pub fn push_if_changed(&mut self, t: f64, ready: BTreeSet<IpAddr>) {
        if self.versions.last().is_none_or(|(_, r)| *r != ready) {
            self.push(t, ready);
        }
    }

    /// Whether a connection made between `t0` and `t1` may land on `ip`: `ip` was ready in a
    /// version written by `t1` that was still in force at `t0`. A version stays in force until
    /// the daemon applied its successor: until the second sync seen after the successor was
    /// written (the first may have started before), given the times of the syncs (sorted).
    /// After the last seen sync nothing is known to be applied.
    pub fn allows(&self, ip: IpAddr, t0: f64, t1: f64, syncs: &[f64]) -> bool {
        self.versions.iter().enumerate().any(|(i, (written, ready))| {
            if *written > t1 || !ready.contains(&ip) {
                return false;
            }
            match self.versions.get(i + 1) {
                None => true,
                Some((next, _)) => {
                    let after = syncs.partition_point(|s| s <= next);
                    syncs.get(after + 1).is_none_or(|applied| *applied >= t0)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_sync_line_is_parsed() {
        let line = "I1202 05:19:33.123456   12 sync_loop.rs:280] \"Synced rules\" mode=\"nftables\" ipFamily=\"IPv4\" \
            full=false services=10008 rewritten=1 removed=0 operations=4 elapsedMs=12.5";
        let s = parse_sync(line, 3.0).unwrap();
        assert_eq!((s.elapsed_ms, s.full, s.services), (12.5, false, 10008));
        assert!(parse_sync(&line.replace("IPv4", "IPv6"), 3.0).is_none());
        assert!(parse_sync("\"Starting\" x=1", 3.0).is_none());
    }

    #[test]
    fn cpu_fields_are_read_past_a_spaced_name() {
        let stat = "42 (kube proxy) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 30 20 20 0 9 0 100 1000 10";
        let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as f64;
        assert_eq!(cpu_seconds(stat), Some((300.0 / tick, 50.0 / tick)));
    }

    #[test]
    fn growth_compares_the_last_tenth_with_the_first_after_warmup() {
        let samples: Vec<ProcSample> = (0..100)
            .map(|i| ProcSample {
                t: i as f64,
                rss_kib: if i < 10 { 5000 } else { 1000 + (i as u64 / 50) * 100 },
                ..ProcSample::default()
            })
            .collect();
        let (growth, start, end) = rss_growth(&samples, 10.0).unwrap();
        assert_eq!((start, end), (1000.0, 1100.0));
        assert!((growth - 10.0).abs() < 1e-9);
        assert!(
            rss_growth(&samples[..12], 10.0).is_none(),
            "too few samples after warm-up"
        );
    }

    #[test]
    fn a_landing_is_allowed_only_while_its_endpoint_was_ready() {
        let (a, b) = (ip("10.244.1.2"), ip("10.244.2.2"));
        let mut h = History::new(0.0, [a].into());
        h.push(10.0, [b].into()); // a unready from 10 s on
        let syncs = [5.0, 10.5, 11.5, 12.5];
        // Before the change, and while the daemon had not applied it (until 11.5 s): a is fine.
        assert!(h.allows(a, 4.0, 4.1, &syncs));
        assert!(h.allows(a, 11.0, 11.1, &syncs));
        // After the second sync since the change: a is a violation, b is right.
        assert!(!h.allows(a, 11.6, 11.7, &syncs));
        assert!(h.allows(b, 11.6, 11.7, &syncs));
        // b was never ready before 10 s.
        assert!(!h.allows(b, 4.0, 4.1, &syncs));
        // A change after the last sync seen: the old version may still be in force.
        h.push(20.0, [].into());
        assert!(h.allows(b, 25.0, 25.1, &syncs));
        // An address that was never ready.
        assert!(!h.allows(ip("10.244.3.2"), 1.0, 30.0, &syncs));
    }
}
