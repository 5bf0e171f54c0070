//! Load for the mode-switch tests: new TCP connections to one address, one after another in
//! batches of `lab probe`, from the bed's client until told to stop. Each connect gets a
//! source port of the kernel's choosing: the client closes first, so its TIME_WAIT keeps the
//! port from being used again towards the same address within a test (60 s), and no connect
//! meets a conntrack entry of an earlier one (see PITFALLS.md).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kube_proxy::lab::probe::{Attempt, ProbeArgs, ProbeReport};
use kube_proxy::lab::testbed::Testbed;

/// What a load saw: each batch with the time it started.
pub struct LoadReport {
    pub batches: Vec<(Instant, ProbeReport)>,
    pub elapsed: Duration,
}

impl LoadReport {
    /// Every attempt, with when it started (its batch's start plus its offset in it: the
    /// probe starts its clock a little after).
    pub fn attempts(&self) -> impl Iterator<Item = (Instant, &Attempt)> {
        self.batches.iter().flat_map(|(start, r)| {
            r.attempts
                .iter()
                .map(move |a| (*start + Duration::from_millis(a.t_ms), a))
        })
    }

    /// The attempts that started between `from` and `to`, and how many of them failed.
    pub fn during(&self, from: Instant, to: Instant) -> (usize, usize) {
        self.attempts()
            .filter(|(at, _)| (from..to).contains(at))
            .fold((0, 0), |(n, failed), (_, a)| (n + 1, failed + usize::from(!a.ok)))
    }

    pub fn failed(&self) -> Vec<(Instant, &Attempt)> {
        self.attempts().filter(|(_, a)| !a.ok).collect()
    }

    /// Connections per second, over the whole load.
    pub fn rate(&self) -> f64 {
        self.attempts().count() as f64 / self.elapsed.as_secs_f64()
    }
}

/// Runs `batch` (a TCP probe of many connections) from the bed's client again and again until
/// `stop`; `batches` counts the batches done.
pub fn connect_until(bed: &Testbed, batch: &ProbeArgs, stop: &AtomicBool, batches: &AtomicUsize) -> LoadReport {
    let started = Instant::now();
    let mut done = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let at = Instant::now();
        done.push((at, bed.probe(&bed.client, batch).expect("probe runs")));
        batches.fetch_add(1, Ordering::SeqCst);
    }
    LoadReport {
        batches: done,
        elapsed: started.elapsed(),
    }
}

/// Sets the flag when dropped: stops a load also when the test panics (a scoped load thread
/// would otherwise keep the scope, and the test, from ending).
pub struct StopOnDrop<'a>(pub &'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}
