//! The `--config` file watch. Upstream applies a changed configuration by exiting (the pod
//! restarts with the new file): it logs `"Error running ProxyServer"
//! err="content of the proxy server's configuration file was updated"` and exits 1. The daemon
//! does the same whenever the file's *content* differs from what the configuration was read
//! from, whichever way it changed:
//!
//! - written in place, or replaced by a rename (what editors and `kubectl cp` do);
//! - swapped behind symlinks, as a ConfigMap volume updates: `config.conf` → `..data/config.conf`,
//!   and kubelet replaces the `..data` symlink with one to a new timestamped directory. A
//!   watch on the file itself sees that as a removal and then watches nothing (upstream's
//!   watch misses these updates); this one watches the directory and compares the content.
//!
//! A touch, or a rewrite that leaves the content as it was, changes nothing. A file that cannot
//! be read (removed for a moment, or for good) keeps the daemon running with the rules it has;
//! a restart could not read it either. The exit runs no cleanup: the rules stay in the kernel
//! for the restarted daemon to take over.
//!
//! The parts: [`compare`] (pure: content against the loaded bytes), [`wait_for_change`] (when
//! to look: after each burst of directory events has settled; tested on tokio's paused
//! clock), and [`start`], the thin inotify edge (the `notify` crate).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tracing::{debug, warn};

/// Upstream's message, the error the daemon exits with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("content of the proxy server's configuration file was updated")]
pub struct ConfigChanged;

/// How long the directory must be quiet before the file is compared: a rewrite in place passes
/// through an empty or partial file, which is not a change if it ends as it began.
pub const SETTLE: Duration = Duration::from_millis(200);

/// What one look at the file found.
#[derive(Debug, PartialEq, Eq)]
pub enum Look {
    Same,
    Changed,
    /// It could not be read (why, in words).
    Unreadable(String),
}

/// The file's content now against the bytes the configuration was read from.
pub fn compare(loaded: &[u8], now: io::Result<Vec<u8>>) -> Look {
    match now {
        Ok(bytes) if bytes == loaded => Look::Same,
        Ok(_) => Look::Changed,
        Err(e) => Look::Unreadable(e.to_string()),
    }
}

/// Resolves once the file's content differs from `loaded`, looking after every burst of
/// `events` has been quiet for `settle` (`read` reads the file). Never resolves once `events`
/// has closed and the last look found no change.
pub async fn wait_for_change(
    loaded: &[u8],
    events: &mut UnboundedReceiver<()>,
    mut read: impl FnMut() -> io::Result<Vec<u8>>,
    settle: Duration,
) -> ConfigChanged {
    let mut unreadable = false;
    while events.recv().await.is_some() {
        // Absorb the rest of the burst: the look comes once the writer is done.
        while let Ok(Some(())) = tokio::time::timeout(settle, events.recv()).await {}
        match compare(loaded, read()) {
            Look::Changed => return ConfigChanged,
            Look::Same => {
                debug!("The configuration file's content is unchanged");
                unreadable = false;
            }
            Look::Unreadable(why) => {
                // Said once per stretch of unreadability, not at every event.
                if !unreadable {
                    warn!(error = %why, "Cannot read the configuration file; keeping the configuration it was read with");
                }
                unreadable = true;
            }
        }
    }
    std::future::pending().await
}

/// A running watch on the directory (or directories) the config file lives in.
pub struct ConfigWatch {
    pub path: PathBuf,
    pub loaded: Vec<u8>,
    pub events: UnboundedReceiver<()>,
    watcher: notify::RecommendedWatcher,
    watched: Vec<PathBuf>,
}

impl ConfigWatch {
    /// Resolves once the file's content differs from the loaded one (see [`wait_for_change`]).
    pub async fn changed(self) -> ConfigChanged {
        let ConfigWatch {
            path,
            loaded,
            mut events,
            mut watcher,
            mut watched,
        } = self;
        let read = || {
            // The symlinks may lead elsewhere now (a ConfigMap's next generation).
            watch_dirs(&mut watcher, &mut watched, &path);
            std::fs::read(&path)
        };
        wait_for_change(&loaded, &mut events, read, SETTLE).await
    }
}

/// Adds a watch on each directory of [`watched_dirs`] not watched yet.
fn watch_dirs(watcher: &mut notify::RecommendedWatcher, watched: &mut Vec<PathBuf>, path: &Path) {
    for dir in watched_dirs(path) {
        if watched.contains(&dir) {
            continue;
        }
        match watcher.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => debug!(dir = %dir.display(), "Watching the configuration file's directory"),
            Err(e) => warn!(dir = %dir.display(), error = %e, "Cannot watch a directory of the configuration file"),
        }
        watched.push(dir);
    }
}

/// The directories whose entries decide what `path` reads: its own (first), and, when it is a
/// symlink leading elsewhere, the directory of the file it resolves to now.
fn watched_dirs(path: &Path) -> Vec<PathBuf> {
    let parent = |p: &Path| match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut dirs = vec![parent(path)];
    if let Ok(target) = std::fs::canonicalize(path) {
        let d = parent(&target);
        if std::fs::canonicalize(&dirs[0]).ok().as_ref() != Some(&d) {
            dirs.push(d);
        }
    }
    dirs
}

/// Whether an inotify event can be a change of a file's content or of a name in the directory.
/// Reads (the watch's own among them) are not; the close after a write is.
fn may_change(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// Starts watching the config file `path`, whose content was `loaded`. One look is due at
/// once: a change between reading the configuration and now has no event of its own.
pub fn start(path: &Path, loaded: Vec<u8>) -> notify::Result<ConfigWatch> {
    let (tx, events): (UnboundedSender<()>, _) = unbounded_channel();
    let _ = tx.send(());
    let sender = tx.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // A lost event (queue overflow) may hide a change: look to be safe.
        if event.as_ref().map_or(true, |e| may_change(&e.kind)) {
            let _ = sender.send(());
        }
    })?;
    // The file's own directory must be watched; the others are a best effort.
    let own = watched_dirs(path).swap_remove(0);
    watcher.watch(&own, RecursiveMode::NonRecursive)?;
    let mut watched = vec![own];
    watch_dirs(&mut watcher, &mut watched, path);
    Ok(ConfigWatch {
        path: path.to_path_buf(),
        loaded,
        events,
        watcher,
        watched,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A file whose content the test sets, and how often it was read.
    #[derive(Clone, Default)]
    struct File(Arc<Mutex<(Option<Vec<u8>>, usize)>>);

    impl File {
        fn with(content: &str) -> File {
            let f = File::default();
            f.set(Some(content));
            f
        }
        fn set(&self, content: Option<&str>) {
            self.0.lock().unwrap().0 = content.map(|c| c.as_bytes().to_vec());
        }
        fn reads(&self) -> usize {
            self.0.lock().unwrap().1
        }
        fn read(&self) -> io::Result<Vec<u8>> {
            let mut s = self.0.lock().unwrap();
            s.1 += 1;
            s.0.clone().ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
        }
    }

    /// Runs the watch on `file` for `within`; Some(elapsed) if it resolved.
    async fn outcome(file: &File, events: &mut UnboundedReceiver<()>, within: Duration) -> Option<Duration> {
        let start = tokio::time::Instant::now();
        let f = file.clone();
        tokio::time::timeout(
            within,
            wait_for_change(b"mode: iptables\n", events, move || f.read(), SETTLE),
        )
        .await
        .ok()
        .map(|ConfigChanged| start.elapsed())
    }

    #[test]
    fn compare_looks_at_the_bytes() {
        assert_eq!(compare(b"a", Ok(b"a".to_vec())), Look::Same);
        assert_eq!(compare(b"a", Ok(b"a\n".to_vec())), Look::Changed);
        assert!(matches!(
            compare(b"a", Err(io::Error::from(io::ErrorKind::NotFound))),
            Look::Unreadable(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_changed_content_resolves_once_the_writes_have_settled() {
        let file = File::with("mode: nftables\n");
        let (tx, mut rx) = unbounded_channel();
        // A burst of events 50 ms apart: the look comes SETTLE after the last one.
        let burst = tokio::spawn(async move {
            for _ in 0..4 {
                tx.send(()).unwrap();
                tokio::time::sleep(50 * MS).await;
            }
            tx
        });
        let elapsed = outcome(&file, &mut rx, Duration::from_secs(5)).await;
        assert_eq!(elapsed, Some(150 * MS + SETTLE));
        assert_eq!(file.reads(), 1, "one look per burst");
        drop(burst.await);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unchanged_rewrite_or_touch_changes_nothing() {
        let file = File::with("mode: iptables\n");
        let (tx, mut rx) = unbounded_channel();
        for _ in 0..3 {
            tx.send(()).unwrap();
        }
        assert_eq!(outcome(&file, &mut rx, Duration::from_secs(10)).await, None);
        assert_eq!(file.reads(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rewrite_seen_mid_write_is_not_a_change_when_it_ends_as_it_began() {
        // The truncate and the write come 20 ms apart; only the settled content counts.
        let file = File::with("");
        let (tx, mut rx) = unbounded_channel();
        let f = file.clone();
        let writer = tokio::spawn(async move {
            tx.send(()).unwrap();
            tokio::time::sleep(20 * MS).await;
            f.set(Some("mode: iptables\n"));
            tx.send(()).unwrap();
            tx
        });
        assert_eq!(outcome(&file, &mut rx, Duration::from_secs(10)).await, None);
        drop(writer.await);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreadable_file_keeps_the_daemon_until_it_reappears_changed() {
        let file = File::default();
        let (tx, mut rx) = unbounded_channel();
        let f = file.clone();
        let later = tokio::spawn(async move {
            tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            f.set(Some("mode: nftables\n"));
            tx.send(()).unwrap();
            tx
        });
        let elapsed = outcome(&file, &mut rx, Duration::from_secs(10)).await;
        assert_eq!(elapsed, Some(Duration::from_secs(5) + SETTLE));
        drop(later.await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_watch_never_resolves() {
        let file = File::with("mode: nftables\n");
        let (tx, mut rx) = unbounded_channel::<()>();
        drop(tx);
        assert_eq!(outcome(&file, &mut rx, Duration::from_secs(10)).await, None);
        assert_eq!(file.reads(), 0);
    }

    #[test]
    fn reads_are_not_changes_but_the_close_after_a_write_is() {
        use notify::event::{CreateKind, ModifyKind, RenameMode};
        assert!(!may_change(&EventKind::Access(AccessKind::Open(AccessMode::Any))));
        assert!(!may_change(&EventKind::Access(AccessKind::Close(AccessMode::Read))));
        assert!(may_change(&EventKind::Access(AccessKind::Close(AccessMode::Write))));
        assert!(may_change(&EventKind::Modify(ModifyKind::Name(RenameMode::To))));
        assert!(may_change(&EventKind::Create(CreateKind::Any)));
    }

    #[test]
    fn a_symlinked_file_has_its_target_directory_watched_too() {
        let base = std::env::temp_dir().join(format!("kp-cw-{}", std::process::id()));
        let (dir, elsewhere) = (base.join("etc"), base.join("data"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("config.conf"), "x").unwrap();
        std::os::unix::fs::symlink(elsewhere.join("config.conf"), dir.join("config.conf")).unwrap();
        std::fs::write(dir.join("plain.conf"), "x").unwrap();
        let linked = watched_dirs(&dir.join("config.conf"));
        let plain = watched_dirs(&dir.join("plain.conf"));
        let relative = watched_dirs(Path::new("config.conf"));
        let data = std::fs::canonicalize(&elsewhere).unwrap();
        std::fs::remove_dir_all(&base).unwrap();
        assert_eq!(linked, vec![dir.clone(), data]);
        assert_eq!(plain, vec![dir]);
        assert_eq!(relative[0], PathBuf::from("."));
    }
}
