//! Gives the allocator's free memory back to the kernel between syncs. glibc's malloc returns
//! only the top of its heap on `free`; the pages of chunks freed in the middle stay in the
//! process. A sync at 10,000 Services builds and drops states and transactions of megabytes,
//! which leaves such holes, so that RSS crept up by ~0.2 MiB a minute in the soak while the
//! live heap stayed flat (heaptrack, docs/soak.md). `malloc_trim(0)` releases every free page
//! of every arena (glibc ≥ 2.8); it is asked for while the loop is idle, at most every
//! [`TRIM_EVERY`], and only when a sync ran since the last one. The call itself is the
//! binary's ([`set_trim`]): this library holds no unsafe code.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tracing::debug;

/// The least time between two trims (each walks the heap: milliseconds at 10,000 Services).
pub const TRIM_EVERY: Duration = Duration::from_secs(10);

/// When the heap was last trimmed, and whether a sync ran since.
#[derive(Debug, Default)]
pub struct Trimmer {
    last: Option<Instant>,
    synced: bool,
}

impl Trimmer {
    /// A sync ran: there may be holes to give back.
    pub fn synced(&mut self) {
        self.synced = true;
    }

    /// Whether a trim is due at `now` (the loop is about to wait); if so, it counts as done.
    pub fn due(&mut self, now: Instant) -> bool {
        if !self.synced || self.last.is_some_and(|t| now < t + TRIM_EVERY) {
            return false;
        }
        self.synced = false;
        self.last = Some(now);
        true
    }
}

/// What releases the allocator's free pages: set once by the binary (`malloc_trim(0)` under
/// glibc), returning whether memory was released.
static TRIM: OnceLock<fn() -> bool> = OnceLock::new();

/// Sets how [`trim`] releases free memory; the first call wins.
pub fn set_trim(f: fn() -> bool) {
    let _ = TRIM.set(f);
}

/// Releases the allocator's free pages to the kernel, if the binary said how.
pub fn trim() {
    if let Some(f) = TRIM.get() {
        let start = Instant::now();
        let released = f();
        debug!(
            released,
            elapsed_ms = start.elapsed().as_secs_f64() * 1000.0,
            "Trimmed the heap"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_is_due_after_a_sync_and_not_more_often_than_every_ten_seconds() {
        let t0 = Instant::now();
        let mut t = Trimmer::default();
        assert!(!t.due(t0), "nothing synced yet");
        t.synced();
        assert!(t.due(t0));
        assert!(!t.due(t0), "no sync since");
        t.synced();
        assert!(!t.due(t0 + Duration::from_secs(5)), "too soon");
        assert!(t.due(t0 + TRIM_EVERY));
        trim();
    }
}
