//! When to sync: the daemon's bounded-frequency runner as a pure state machine. It is told
//! what happened (objects changed, the initial lists arrived, a sync succeeded or failed, a
//! family's rules were found flushed) with the time, and answers what to do next: check the
//! rules, sync some families (fully or only what changed), or wait until a given time.
//!
//! The rules, as upstream's `BoundedFrequencyRunner` and proxiers apply them:
//! - nothing is synced before Services and EndpointSlices have both been listed once;
//! - changes are coalesced: a sync starts no sooner than `min_sync_period` after the previous
//!   one, and covers everything that arrived meanwhile;
//! - every `sync_period` the rules are checked (canaries, tables, entry jumps); a family whose
//!   rules were flushed gets a full sync, and modes that want it sync anyway;
//! - a failed sync keeps the previous rules and is retried, as a full sync, `sync_period`
//!   later (upstream's `RetryAfter(syncPeriod)`); no other sync runs before that;
//! - a family whose mode wants a periodic full sync (iptables: every hour) gets one;
//! - a family whose proxier has cleanup due (nftables' flushed chains, IPVS draining real
//!   servers) syncs when it is due.

use std::time::{Duration, Instant};

use crate::model::IpFamily;

/// The periods of the runner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerConfig {
    /// `minSyncPeriod`: the least time between the starts of two syncs.
    pub min_sync_period: Duration,
    /// `syncPeriod`: how often the rules are checked, and how long after a failure the retry
    /// waits.
    pub sync_period: Duration,
}

/// What the runner knows of one family's proxier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FamilyTraits {
    pub family: IpFamily,
    /// A full sync at least this often (`Proxier::full_sync_period`).
    pub full_sync_period: Option<Duration>,
    /// A sync every sync period, changes or not (`Proxier::syncs_every_period`).
    pub syncs_every_period: bool,
}

/// Which sync a family gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// Everything, whatever the kernel holds.
    Full,
    /// What changed since the last successful sync.
    Changes,
}

/// What the daemon does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Check each family's rules ([`Runner::checked`] takes the answers).
    Check,
    /// Sync these families, in this order ([`Runner::synced`] takes each result).
    Sync(Vec<(IpFamily, SyncKind)>),
    /// Nothing to do until this time, or until something happens (`None`: only then).
    Wait(Option<Instant>),
}

#[derive(Clone, Debug)]
struct Family {
    traits: FamilyTraits,
    /// A sync of this family is due (changes arrived, a check asked for one, or the last
    /// attempt failed).
    pending: bool,
    /// The next sync must be a full one.
    full_due: bool,
    /// When the last full sync succeeded.
    last_full: Option<Instant>,
    /// When the proxier wants a sync to clean up.
    cleanup_at: Option<Instant>,
}

/// The state machine (see the module documentation).
#[derive(Clone, Debug)]
pub struct Runner {
    config: RunnerConfig,
    families: Vec<Family>,
    /// Services and EndpointSlices have both been listed.
    ready: bool,
    /// When the last sync started.
    last_sync: Option<Instant>,
    /// After a failure, no sync before this.
    retry_at: Option<Instant>,
    next_check: Instant,
}

impl Runner {
    /// A runner for `families`, started at `now`: each family's first sync is a full one.
    pub fn new(config: RunnerConfig, families: &[FamilyTraits], now: Instant) -> Runner {
        Runner {
            config,
            families: families
                .iter()
                .map(|&traits| Family {
                    traits,
                    pending: true,
                    full_due: true,
                    last_full: None,
                    cleanup_at: None,
                })
                .collect(),
            ready: false,
            last_sync: None,
            retry_at: None,
            next_check: now + config.sync_period,
        }
    }

    /// Services and EndpointSlices have both been listed: syncing may start.
    pub fn ready(&mut self) {
        self.ready = true;
    }

    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The objects changed: every family needs a sync.
    pub fn changed(&mut self) {
        for f in &mut self.families {
            f.pending = true;
        }
    }

    /// Families with a sync due (for telemetry: "a sync is queued").
    pub fn pending(&self) -> Vec<IpFamily> {
        self.families
            .iter()
            .filter(|f| f.pending)
            .map(|f| f.traits.family)
            .collect()
    }

    /// The answer of one family's check: rules not intact need a full sync.
    pub fn checked(&mut self, family: IpFamily, intact: bool) {
        if let Some(f) = self.family(family) {
            if !intact {
                f.full_due = true;
                f.pending = true;
            }
            f.pending |= f.traits.syncs_every_period;
        }
    }

    /// The result of one family's sync (`Ok(full)`: it succeeded, and whether it was full),
    /// and when its proxier next wants a cleanup.
    pub fn synced(&mut self, family: IpFamily, now: Instant, result: Result<bool, ()>, cleanup_at: Option<Instant>) {
        let retry = now + self.config.sync_period;
        let Some(f) = self.family(family) else { return };
        f.cleanup_at = cleanup_at;
        match result {
            Ok(full) => {
                f.pending = false;
                f.full_due = false;
                if full {
                    f.last_full = Some(now);
                }
            }
            Err(()) => {
                f.pending = true;
                f.full_due = true;
                self.retry_at = Some(retry);
            }
        }
    }

    /// What to do at `now`.
    pub fn next(&mut self, now: Instant) -> Action {
        if !self.ready {
            return Action::Wait(None);
        }
        if now >= self.next_check {
            self.next_check = now + self.config.sync_period;
            return Action::Check;
        }
        for f in &mut self.families {
            if f.cleanup_at.is_some_and(|t| t <= now) {
                f.pending = true;
            }
            if let Some(due) = full_sync_due(f)
                && due <= now
            {
                f.pending = true;
                f.full_due = true;
            }
        }
        if self.families.iter().any(|f| f.pending) {
            let earliest = self.last_sync.map_or(now, |t| t + self.config.min_sync_period);
            let start = self.retry_at.map_or(earliest, |r| r.max(earliest));
            if now < start {
                return Action::Wait(Some(start.min(self.next_check)));
            }
            self.last_sync = Some(now);
            self.retry_at = None;
            let syncs = self
                .families
                .iter()
                .filter(|f| f.pending)
                .map(|f| {
                    let kind = if f.full_due { SyncKind::Full } else { SyncKind::Changes };
                    (f.traits.family, kind)
                })
                .collect();
            return Action::Sync(syncs);
        }
        let wake = self
            .families
            .iter()
            .flat_map(|f| [f.cleanup_at, full_sync_due(f)])
            .flatten()
            .fold(self.next_check, Instant::min);
        Action::Wait(Some(wake))
    }

    fn family(&mut self, family: IpFamily) -> Option<&mut Family> {
        self.families.iter_mut().find(|f| f.traits.family == family)
    }
}

/// When the family's periodic full sync is due (never before its first full sync).
fn full_sync_due(f: &Family) -> Option<Instant> {
    Some(f.last_full? + f.traits.full_sync_period?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn traits(family: IpFamily) -> FamilyTraits {
        FamilyTraits {
            family,
            full_sync_period: None,
            syncs_every_period: false,
        }
    }

    fn runner(t0: Instant) -> Runner {
        let config = RunnerConfig {
            min_sync_period: SEC,
            sync_period: 30 * SEC,
        };
        Runner::new(config, &[traits(IpFamily::V4), traits(IpFamily::V6)], t0)
    }

    fn both(kind: SyncKind) -> Action {
        Action::Sync(vec![(IpFamily::V4, kind), (IpFamily::V6, kind)])
    }

    fn ok(r: &mut Runner, now: Instant, full: bool) {
        r.synced(IpFamily::V4, now, Ok(full), None);
        r.synced(IpFamily::V6, now, Ok(full), None);
    }

    #[test]
    fn waits_for_the_initial_lists_then_syncs_everything_in_full() {
        let t0 = Instant::now();
        let mut r = runner(t0);
        r.changed();
        assert_eq!(r.next(t0), Action::Wait(None));
        assert_eq!(r.next(t0 + 100 * SEC), Action::Wait(None), "no check before either");
        r.ready();
        assert_eq!(r.next(t0), both(SyncKind::Full));
    }

    #[test]
    fn changes_within_min_sync_period_wait_and_go_together() {
        let t0 = Instant::now();
        let mut r = runner(t0);
        r.ready();
        assert_eq!(r.next(t0), both(SyncKind::Full));
        ok(&mut r, t0, true);
        r.changed();
        let t = t0 + SEC / 2;
        assert_eq!(r.next(t), Action::Wait(Some(t0 + SEC)));
        r.changed();
        assert_eq!(r.next(t0 + SEC), both(SyncKind::Changes));
        ok(&mut r, t0 + SEC, false);
        assert_eq!(r.next(t0 + 2 * SEC), Action::Wait(Some(t0 + 30 * SEC)));
    }

    #[test]
    fn a_failure_is_retried_in_full_after_the_sync_period_and_blocks_other_syncs() {
        let t0 = Instant::now();
        let mut r = runner(t0);
        r.ready();
        r.next(t0);
        r.synced(IpFamily::V4, t0, Err(()), None);
        r.synced(IpFamily::V6, t0, Ok(true), None);
        r.changed();
        assert_eq!(r.next(t0 + 2 * SEC), Action::Wait(Some(t0 + 30 * SEC)));
        // The check comes first at that moment, then the retry.
        assert_eq!(r.next(t0 + 30 * SEC), Action::Check);
        assert_eq!(
            r.next(t0 + 30 * SEC),
            Action::Sync(vec![(IpFamily::V4, SyncKind::Full), (IpFamily::V6, SyncKind::Changes)])
        );
    }

    #[test]
    fn a_lost_canary_brings_a_full_sync_of_that_family() {
        let t0 = Instant::now();
        let mut r = runner(t0);
        r.ready();
        r.next(t0);
        ok(&mut r, t0, true);
        let t = t0 + 30 * SEC;
        assert_eq!(r.next(t), Action::Check);
        r.checked(IpFamily::V4, false);
        r.checked(IpFamily::V6, true);
        assert_eq!(r.next(t), Action::Sync(vec![(IpFamily::V4, SyncKind::Full)]));
    }

    #[test]
    fn periodic_full_syncs_and_cleanups_are_scheduled() {
        let t0 = Instant::now();
        let config = RunnerConfig {
            min_sync_period: SEC,
            sync_period: 30 * SEC,
        };
        let v4 = FamilyTraits {
            full_sync_period: Some(3600 * SEC),
            ..traits(IpFamily::V4)
        };
        let mut r = Runner::new(config, &[v4], t0);
        r.ready();
        r.next(t0);
        r.synced(IpFamily::V4, t0, Ok(true), Some(t0 + 5 * SEC));
        assert_eq!(r.next(t0 + SEC), Action::Wait(Some(t0 + 5 * SEC)));
        assert_eq!(
            r.next(t0 + 5 * SEC),
            Action::Sync(vec![(IpFamily::V4, SyncKind::Changes)])
        );
        r.synced(IpFamily::V4, t0 + 5 * SEC, Ok(false), None);
        let hour = t0 + 3600 * SEC;
        // Checks every 30 s meanwhile; at the hour, a full sync.
        let mut t = t0 + 30 * SEC;
        while t < hour {
            assert_eq!(r.next(t), Action::Check);
            r.checked(IpFamily::V4, true);
            t += 30 * SEC;
        }
        assert_eq!(r.next(hour - SEC), Action::Wait(Some(hour)));
        assert_eq!(r.next(hour), Action::Check);
        r.checked(IpFamily::V4, true);
        assert_eq!(r.next(hour), Action::Sync(vec![(IpFamily::V4, SyncKind::Full)]));
    }

    #[test]
    fn modes_that_sync_every_period_do() {
        let t0 = Instant::now();
        let config = RunnerConfig {
            min_sync_period: SEC,
            sync_period: 30 * SEC,
        };
        let ipvs = FamilyTraits {
            syncs_every_period: true,
            ..traits(IpFamily::V4)
        };
        let mut r = Runner::new(config, &[ipvs], t0);
        r.ready();
        r.next(t0);
        r.synced(IpFamily::V4, t0, Ok(true), None);
        assert_eq!(r.next(t0 + 30 * SEC), Action::Check);
        r.checked(IpFamily::V4, true);
        assert_eq!(
            r.next(t0 + 30 * SEC),
            Action::Sync(vec![(IpFamily::V4, SyncKind::Changes)])
        );
    }
}
