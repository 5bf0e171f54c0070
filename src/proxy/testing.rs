//! A recording [`Proxier`] for tests of what drives the proxiers (the daemon's loop): it keeps
//! every call, the state of each sync, and can be told to fail, to report lost canaries, or
//! to want cleanups at given times. Clones share the record, so a test keeps one handle and
//! gives the other away.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Programmed, ProgrammedSection, Proxier, ReadBackError, SyncContext, SyncError, SyncReport};
use crate::config::ProxyMode;
use crate::model::store::PortChange;
use crate::model::{IpFamily, ProxyState, ServicePort};

/// One call the fake received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// `configure`, with the node's name.
    Configure(String),
    /// `sync_full`, with the number of service ports in the state.
    SyncFull(usize),
    /// `sync_changes`, with the number of service ports in the state.
    SyncChanges(usize),
    Intact,
    Cleanup,
    ReadBack(String),
}

impl Call {
    /// Whether this is a sync, of either kind.
    pub fn is_sync(&self) -> bool {
        matches!(self, Call::SyncFull(_) | Call::SyncChanges(_))
    }
}

/// What the fake saw, and how it is told to behave.
#[derive(Debug)]
pub struct Record {
    pub calls: Vec<Call>,
    /// When each call came (tokio's clock, so that tests with paused time can check it).
    pub times: Vec<Instant>,
    /// The last state synced successfully (what "the kernel" holds).
    pub programmed: Option<ProxyState>,
    /// The next this many syncs fail (nothing applied).
    pub fail_next: usize,
    /// What `intact` answers.
    pub intact: bool,
    /// What `next_cleanup` answers.
    pub cleanup_due: Option<Instant>,
    pub full_sync_period: Option<Duration>,
    pub syncs_every_period: bool,
    /// For each `sync_changed`: how many changed ports it was told of, or what was wrong
    /// with them (they do not turn the programmed state into the new one).
    pub told: Vec<Result<usize, String>>,
}

impl Default for Record {
    fn default() -> Self {
        Record {
            calls: Vec::new(),
            times: Vec::new(),
            programmed: None,
            fail_next: 0,
            intact: true,
            cleanup_due: None,
            full_sync_period: None,
            syncs_every_period: false,
            told: Vec::new(),
        }
    }
}

impl Record {
    /// The syncs received, in order.
    pub fn syncs(&self) -> Vec<Call> {
        self.calls.iter().filter(|c| c.is_sync()).cloned().collect()
    }

    /// The syncs received, with their times.
    pub fn syncs_at(&self) -> Vec<(Instant, Call)> {
        self.times
            .iter()
            .copied()
            .zip(self.calls.iter().cloned())
            .filter(|(_, c)| c.is_sync())
            .collect()
    }

    fn push(&mut self, call: Call) {
        self.calls.push(call);
        self.times.push(tokio::time::Instant::now().into_std());
    }
}

/// A [`Proxier`] of `mode` and `family` that records its calls.
#[derive(Clone, Debug)]
pub struct RecordingProxier {
    mode: ProxyMode,
    family: IpFamily,
    record: Arc<Mutex<Record>>,
}

impl RecordingProxier {
    pub fn new(mode: ProxyMode, family: IpFamily) -> RecordingProxier {
        RecordingProxier {
            mode,
            family,
            record: Arc::default(),
        }
    }

    pub fn record(&self) -> MutexGuard<'_, Record> {
        // A panicking test thread must not hide the record from the others.
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sync(&mut self, state: &ProxyState, full: bool) -> Result<SyncReport, SyncError> {
        let mut r = self.record();
        let n = state.service_ports.len();
        r.push(if full { Call::SyncFull(n) } else { Call::SyncChanges(n) });
        if r.fail_next > 0 {
            r.fail_next -= 1;
            return Err(SyncError::new(full, "injected failure"));
        }
        r.programmed = Some(state.clone());
        Ok(SyncReport {
            full,
            rewritten_services: n,
            ..SyncReport::default()
        })
    }
}

impl Proxier for RecordingProxier {
    fn mode(&self) -> ProxyMode {
        self.mode
    }

    fn family(&self) -> IpFamily {
        self.family
    }

    fn configure(&mut self, ctx: &SyncContext<'_>) {
        self.record().push(Call::Configure(ctx.node.name.clone()));
    }

    fn sync_full(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        self.sync(state, true)
    }

    fn sync_changes(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        // Nothing programmed yet: a full sync, as the real proxiers do.
        let full = self.record().programmed.is_none();
        self.sync(state, full)
    }

    fn sync_changed(&mut self, state: &ProxyState, changed: &[PortChange]) -> Result<SyncReport, SyncError> {
        let check = check_changes(self.record().programmed.as_ref(), state, changed);
        self.record().told.push(check.map(|()| changed.len()));
        self.sync_changes(state)
    }

    fn intact(&mut self) -> bool {
        let mut r = self.record();
        r.push(Call::Intact);
        r.intact
    }

    fn next_cleanup(&self) -> Option<Instant> {
        self.record().cleanup_due
    }

    fn full_sync_period(&self) -> Option<Duration> {
        self.record().full_sync_period
    }

    fn syncs_every_period(&self) -> bool {
        self.record().syncs_every_period
    }

    fn cleanup(&mut self) -> Vec<String> {
        let mut r = self.record();
        r.push(Call::Cleanup);
        r.programmed = None;
        Vec::new()
    }

    fn read_back(&mut self, port: &ServicePort) -> Result<Programmed, ReadBackError> {
        let mut r = self.record();
        r.push(Call::ReadBack(port.name.to_string()));
        let lines = r
            .programmed
            .iter()
            .flat_map(|s| &s.service_ports)
            .filter(|s| s.port.name == port.name)
            .flat_map(|s| s.endpoints.iter().map(|e| e.to_string()))
            .collect();
        Ok(Programmed {
            sections: vec![ProgrammedSection {
                place: port.name.to_string(),
                lines,
            }],
        })
    }
}

/// Whether `changed` turns the service ports of `programmed` into those of `state`.
fn check_changes(programmed: Option<&ProxyState>, state: &ProxyState, changed: &[PortChange]) -> Result<(), String> {
    let Some(programmed) = programmed else {
        return Err("told of changes with nothing programmed".into());
    };
    let mut ports: std::collections::BTreeMap<_, _> = programmed
        .service_ports
        .iter()
        .map(|p| (p.port.name.clone(), p.clone()))
        .collect();
    for (name, new) in changed {
        match new {
            Some(new) => ports.insert(name.clone(), new.clone()),
            None => ports.remove(name),
        };
    }
    let got: Vec<_> = ports.into_values().collect();
    let mut want = state.service_ports.clone();
    want.sort_by(|a, b| a.port.name.cmp(&b.port.name));
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "{changed:?} from {:?} gives {got:?}, not {want:?}",
            programmed.service_ports
        ))
    }
}
