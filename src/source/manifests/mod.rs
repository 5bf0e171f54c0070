//! The standalone source (`--manifests DIR`): Services, EndpointSlices, Nodes and ServiceCIDRs
//! read from a directory of manifests and re-read when files change (inotify through the
//! `notify` crate). Bad edits lose nothing: a file that stops parsing keeps the objects it had,
//! and an object that stops decoding keeps its previous version, each with a logged error.
//! Objects are converted to the model's entries as they are read (see `model::store`); a file
//! whose text did not change is not parsed again (nor are its warnings repeated).
//!
//! Running ([`ManifestDir`]), a thread of its own waits for the watch, coalesces a burst of
//! file events into one re-read of the files they name (the whole directory only when an
//! event names a directory or events were lost), and sends what changed in the merged view
//! ([`view`]) as one [`Update`]; the first update holds the whole directory and counts as
//! synced.

mod view;

pub use view::{ManifestSource, Reload};

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use crate::source::{Running, Source, Update};

/// `--manifests DIR` as a [`Source`].
#[derive(Clone, Debug)]
pub struct ManifestDir(pub PathBuf);

impl Source for ManifestDir {
    fn start(self: Box<Self>, node_name: &str) -> anyhow::Result<Running> {
        use anyhow::Context as _;
        // Events name absolute paths: so do the files read, to compare them.
        let dir = std::fs::canonicalize(&self.0).with_context(|| format!("reading {}", self.0.display()))?;
        let (events_tx, events) = std::sync::mpsc::channel();
        let watcher = watch(&dir, events_tx).with_context(|| format!("watching {}", dir.display()))?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let source = ManifestSource::new(&dir, node_name);
        std::thread::Builder::new()
            .name("kube-manifests".into())
            .spawn(move || follow(source, &events, &tx))
            .context("starting the manifest source's thread")?;
        Ok(Running::new(rx, crate::source::SourceStatus::new("manifests"), watcher))
    }
}

/// What a burst of file events asks for.
#[derive(Debug, Default)]
pub enum Touched {
    /// Nothing yet.
    #[default]
    Nothing,
    /// These files (created, written, renamed from or to, removed).
    Files(BTreeSet<PathBuf>),
    /// The whole directory: an event named a directory, or events were lost.
    Everything,
}

impl Touched {
    fn add(&mut self, event: FileEvent, source: &ManifestSource) {
        match event {
            FileEvent::Paths(paths) if !matches!(self, Touched::Everything) => {
                for path in paths {
                    if path.is_dir() || path == source.dir() {
                        *self = Touched::Everything;
                        return;
                    }
                    if source.is_manifest(&path) {
                        match self {
                            Touched::Files(set) => {
                                set.insert(path);
                            }
                            _ => *self = Touched::Files(BTreeSet::from([path])),
                        }
                    }
                }
            }
            FileEvent::Paths(_) => {}
            FileEvent::Lost => *self = Touched::Everything,
        }
    }
}

/// What the watch reports.
#[derive(Debug)]
pub enum FileEvent {
    /// A change to these paths.
    Paths(Vec<PathBuf>),
    /// Events may have been lost (the kernel's queue overflowed): anything may have changed.
    Lost,
}

/// Reads the directory once at start and then what every burst of file events names, sending
/// the changes; ends when the watcher or the daemon is gone.
fn follow(mut source: ManifestSource, events: &Receiver<FileEvent>, tx: &UnboundedSender<Update>) {
    let mut touched = Touched::Everything;
    let mut warnings: Vec<String> = Vec::new();
    let mut first = true;
    loop {
        let start = Instant::now();
        let reload = match std::mem::take(&mut touched) {
            Touched::Everything => source.reload(),
            Touched::Files(files) => source.reload_files(&files),
            Touched::Nothing => source.reload_files(&BTreeSet::new()),
        };
        for m in &reload.messages {
            warn!("{m}");
        }
        // Objects defined twice: said again only when that changes.
        if source.merged().warnings != warnings {
            warnings = source.merged().warnings.clone();
            for w in &warnings {
                warn!("{w}");
            }
        }
        debug!(
            services = source.merged().services.len(),
            slices = source.merged().slices.len(),
            changes = reload.changes.len(),
            elapsed_ms = start.elapsed().as_secs_f64() * 1000.0,
            "Read the manifests"
        );
        let changes = reload.changes;
        // The first update always goes: it says the directory has been read.
        if (first || !changes.is_empty()) && tx.send(Update { changes, synced: true }).is_err() {
            return;
        }
        first = false;
        match events.recv() {
            Ok(e) => touched.add(e, &source),
            Err(_) => return,
        }
        // Coalesce a burst of file events into one re-read.
        while let Ok(e) = events.try_recv() {
            touched.add(e, &source);
        }
        if matches!(touched, Touched::Nothing) {
            // Only files that are no manifests changed: wait for the next event.
            continue;
        }
    }
}

/// Watches `dir` recursively and sends the paths of every change of its files; the watcher
/// stops when dropped. Reads (including our own reloads) are not changes.
pub fn watch(dir: &Path, tx: Sender<FileEvent>) -> notify::Result<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let event = match event {
            Ok(e) if matches!(e.kind, notify::EventKind::Access(_)) => return,
            // The kernel's queue overflowed: every file may have changed.
            Ok(e) if e.need_rescan() => FileEvent::Lost,
            Ok(e) => FileEvent::Paths(e.paths),
            // A lost event may hide a change: read everything to be safe.
            Err(_) => FileEvent::Lost,
        };
        let _ = tx.send(event);
    })?;
    watcher.watch(dir, RecursiveMode::Recursive)?;
    Ok(watcher)
}
