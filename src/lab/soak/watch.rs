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

/// The ready endpoints of one live Service over time: each version from when it was written,
/// and from when the kernel was seen holding it or a later one (its rules read back every few
/// hundred milliseconds: [`History::observe`]).
#[derive(Clone, Debug, Default)]
pub struct History {
    versions: Vec<Version>,
    /// The version the kernel was last seen at.
    at: usize,
    /// Read-backs that matched no version from `at` on.
    pub unmatched: usize,
}

#[derive(Clone, Debug)]
struct Version {
    written: f64,
    ready: BTreeSet<IpAddr>,
    /// First read-back that found the kernel at this version or a later one.
    reached: Option<f64>,
    /// First read-back that found the kernel at this very version.
    seen: Option<f64>,
}

impl History {
    pub fn new(t: f64, ready: BTreeSet<IpAddr>) -> History {
        let mut h = History::default();
        h.push(t, ready);
        h
    }

    pub fn push(&mut self, t: f64, ready: BTreeSet<IpAddr>) {
        self.versions.push(Version {
            written: t,
            ready,
            reached: None,
            seen: None,
        });
    }

    /// [`History::push`] unless the ready set stays what it was.
    pub fn push_if_changed(&mut self, t: f64, ready: BTreeSet<IpAddr>) {
        if self.versions.last().is_none_or(|v| v.ready != ready) {
            self.push(t, ready);
        }
    }

    /// The kernel was read at `t` and sends to `programmed`. The daemon programs the files as
    /// they are when it reads them, so the kernel moves through the versions in order (some
    /// skipped); of the versions it may be at, the earliest is taken (a set can come back:
    /// the kernel showing it may not have reached the later one yet).
    pub fn observe(&mut self, t: f64, programmed: &BTreeSet<IpAddr>) {
        let found = (self.at..self.versions.len())
            .take_while(|j| self.versions[*j].written <= t)
            .find(|j| self.versions[*j].ready == *programmed);
        let Some(j) = found else {
            self.unmatched += 1;
            return;
        };
        for v in &mut self.versions[self.at..=j] {
            v.reached.get_or_insert(t);
        }
        self.versions[j].seen.get_or_insert(t);
        self.at = j;
    }

    /// Whether a connection made between `t0` and `t1` may land on `ip`: `ip` was ready in a
    /// version written by `t1` that was still in force at `t0`. A version stays in force until
    /// the kernel was seen past it; one never passed stays to the end.
    pub fn allows(&self, ip: IpAddr, t0: f64, t1: f64) -> bool {
        self.versions.iter().enumerate().any(|(i, v)| {
            if v.written > t1 || !v.ready.contains(&ip) {
                return false;
            }
            let next = self.versions.get(i + 1).and_then(|n| n.reached);
            next.is_none_or(|end| end >= t0)
        })
    }

    /// For each change after the first version that the kernel was seen holding: seconds from
    /// its write until then (an upper bound by the read-back's period); and how many changes
    /// were never seen (superseded before the kernel had them, or before a read-back came).
    pub fn apply_latencies(&self) -> (Vec<f64>, usize) {
        let mut seen = Vec::new();
        let mut unseen = 0;
        for v in self.versions.iter().skip(1) {
            match v.seen {
                Some(t) => seen.push(t - v.written),
                None => unseen += 1,
            }
        }
        (seen, unseen)
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
        h.observe(0.5, &[a].into());
        h.push(10.0, [b].into()); // a unready from 10 s on
        // Read back before the kernel had it: nothing changes.
        h.observe(10.8, &[a].into());
        h.observe(11.5, &[b].into());
        h.observe(12.0, &[b].into());
        // Before the change, and until the kernel was seen with it (11.5 s): a is fine.
        assert!(h.allows(a, 4.0, 4.1));
        assert!(h.allows(a, 11.0, 11.1));
        // After that: a is a violation, b is right.
        assert!(!h.allows(a, 11.6, 11.7));
        assert!(h.allows(b, 11.6, 11.7));
        // b was never ready before 10 s.
        assert!(!h.allows(b, 4.0, 4.1));
        // A change the kernel was never seen with: the old version may still be in force.
        h.push(20.0, [].into());
        assert!(h.allows(b, 25.0, 25.1));
        // An address that was never ready.
        assert!(!h.allows(ip("10.244.3.2"), 1.0, 30.0));
        let (latencies, unseen) = h.apply_latencies();
        assert_eq!((latencies.len(), unseen), (1, 1));
        assert!((latencies[0] - 1.5).abs() < 1e-9);
    }

    #[test]
    fn a_version_coming_back_is_seen_anew() {
        let (a, b) = (ip("10.244.1.2"), ip("10.244.2.2"));
        let mut h = History::new(0.0, [a].into());
        h.observe(0.1, &[a].into());
        h.push(1.0, [b].into());
        h.observe(1.2, &[b].into());
        h.push(2.0, [a].into());
        // The kernel still holds b: the newest version with b is the one of 1 s.
        h.observe(2.1, &[b].into());
        assert!(h.allows(b, 2.2, 2.3));
        h.observe(2.4, &[a].into());
        assert!(!h.allows(b, 2.5, 2.6));
        assert!(h.allows(a, 2.5, 2.6));
        assert_eq!(h.unmatched, 0);
        // A set no version from the current one on has.
        h.observe(2.7, &[b].into());
        assert_eq!(h.unmatched, 1);
    }

    #[test]
    fn a_set_that_comes_back_does_not_pass_the_version_between() {
        let (a, b) = (ip("10.244.1.2"), ip("10.244.2.2"));
        let mut h = History::new(0.0, [a].into());
        h.push(10.0, [b].into());
        h.push(10.5, [a].into());
        // Still the first version's rules (the daemon read the files at 10.2 s, say).
        h.observe(10.6, &[a].into());
        h.observe(11.5, &[b].into());
        assert!(h.allows(b, 11.6, 11.7), "the kernel holds the second version");
        h.observe(12.0, &[a].into());
        assert!(!h.allows(b, 12.1, 12.2));
        assert!(h.allows(a, 12.1, 12.2));
    }
}
