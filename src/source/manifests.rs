//! The standalone source (`--manifests DIR`): Services, EndpointSlices, Nodes and ServiceCIDRs
//! read from a directory of manifests and re-read when files change (inotify through the
//! `notify` crate). Bad edits lose nothing: a file that stops parsing keeps the objects it had,
//! and an object that stops decoding keeps its previous version, each with a logged error.
//! Objects are converted to the model's entries as they are read (see `model::store`); a file
//! whose text did not change is not parsed again (nor are its warnings repeated).
//!
//! Running ([`ManifestDir`]), a thread of its own waits for the watch, coalesces a burst of
//! file events into one re-read, and sends what changed between the merged views before and
//! after as one [`Update`]; the first update holds the whole directory and counts as synced.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use crate::manifest::{self, ObjectKey, Objects};
use crate::model::store::{self, ObjectName, Store, object_name};
use crate::model::{ServiceEntry, SliceEntry};
use crate::source::{Running, Source, Update};

/// `--manifests DIR` as a [`Source`].
#[derive(Clone, Debug)]
pub struct ManifestDir(pub PathBuf);

impl Source for ManifestDir {
    fn start(self: Box<Self>, node_name: &str) -> anyhow::Result<Running> {
        use anyhow::Context as _;
        let dir = self.0;
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

/// Re-reads the directory once at start and then after every burst of file events, sending
/// the changes; ends when the watcher or the daemon is gone.
fn follow(mut source: ManifestSource, events: &Receiver<()>, tx: &UnboundedSender<Update>) {
    let mut current = Store::default();
    let mut first = true;
    loop {
        let start = Instant::now();
        let snapshot = source.reload();
        for m in &snapshot.messages {
            warn!("{m}");
        }
        // Objects defined twice: said again only when that changes.
        if snapshot.store.warnings != current.warnings {
            for w in &snapshot.store.warnings {
                warn!("{w}");
            }
        }
        let changes = snapshot.store.diff(&current);
        debug!(
            services = snapshot.store.services.len(),
            slices = snapshot.store.slices.len(),
            changes = changes.len(),
            elapsed_ms = start.elapsed().as_secs_f64() * 1000.0,
            "Read the manifests"
        );
        current = snapshot.store;
        // The first update always goes: it says the directory has been read.
        if (first || !changes.is_empty()) && tx.send(Update { changes, synced: true }).is_err() {
            return;
        }
        first = false;
        if events.recv().is_err() {
            return;
        }
        // Coalesce a burst of file events into one re-read.
        while events.try_recv().is_ok() {}
    }
}

/// Reloads a manifest directory, remembering the last good content of every file, converted.
pub struct ManifestSource {
    dir: PathBuf,
    /// Decides endpoint locality when slices are converted.
    node_name: String,
    files: BTreeMap<PathBuf, FileEntries>,
}

/// What one file held, converted; the k8s objects themselves are not kept.
#[derive(Clone, Default)]
struct FileEntries {
    /// Hash of the file's text: an unchanged file is not parsed again.
    text_hash: u64,
    services: Vec<(ObjectName, Arc<ServiceEntry>)>,
    slices: Vec<(ObjectName, Arc<SliceEntry>)>,
    nodes: Vec<Node>,
    service_cidrs: Vec<ServiceCIDR>,
}

impl FileEntries {
    fn convert(objects: &Objects, node_name: &str, text_hash: u64) -> FileEntries {
        FileEntries {
            text_hash,
            services: objects
                .services
                .iter()
                .map(|s| (object_name(&s.metadata), store::service_entry(s)))
                .collect(),
            slices: objects
                .endpoint_slices
                .iter()
                .map(|s| (object_name(&s.metadata), store::slice_entry(s, node_name)))
                .collect(),
            nodes: objects.nodes.clone(),
            service_cidrs: objects.service_cidrs.clone(),
        }
    }

    /// Brings back the previous version of an object that no longer decodes; true if there
    /// was one.
    fn keep_previous(&mut self, previous: &FileEntries, key: &ObjectKey) -> bool {
        let name = (
            key.namespace.clone().unwrap_or_else(|| "default".to_string()),
            key.name.clone(),
        );
        fn find<T: Clone>(list: &[(ObjectName, T)], name: &ObjectName) -> Option<(ObjectName, T)> {
            list.iter().find(|(n, _)| n == name).cloned()
        }
        let by_meta = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            m.name.as_deref() == Some(key.name.as_str()) && m.namespace == key.namespace
        };
        match key.kind.as_str() {
            "Service" => find(&previous.services, &name).map(|e| self.services.push(e)).is_some(),
            "EndpointSlice" => find(&previous.slices, &name).map(|e| self.slices.push(e)).is_some(),
            "Node" => previous
                .nodes
                .iter()
                .find(|n| by_meta(&n.metadata))
                .map(|n| self.nodes.push(n.clone()))
                .is_some(),
            "ServiceCIDR" => previous
                .service_cidrs
                .iter()
                .find(|c| by_meta(&c.metadata))
                .map(|c| self.service_cidrs.push(c.clone()))
                .is_some(),
            _ => false,
        }
    }
}

/// One reload: the merged objects and what to tell the operator.
pub struct Snapshot {
    pub store: Store,
    /// Errors (file-level) and warnings (object-level), each naming file and object.
    pub messages: Vec<String>,
}

impl ManifestSource {
    /// A source for the node `node_name` (endpoints on it are local).
    pub fn new(dir: impl Into<PathBuf>, node_name: &str) -> ManifestSource {
        ManifestSource {
            dir: dir.into(),
            node_name: node_name.to_string(),
            files: BTreeMap::new(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads every file again (files whose text did not change keep their entries).
    pub fn reload(&mut self) -> Snapshot {
        let mut messages = Vec::new();
        let files = match manifest::manifest_files(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                // The directory itself is unreadable: keep everything we had.
                messages.push(format!("{e}; keeping the objects read before"));
                return Snapshot {
                    store: self.merged(),
                    messages,
                };
            }
        };
        let mut next = BTreeMap::new();
        for file in files {
            let previous = self.files.get(&file);
            let text = match std::fs::read_to_string(&file) {
                Ok(text) => text,
                Err(source) => {
                    let e = manifest::ManifestError::Io {
                        path: file.clone(),
                        source,
                    };
                    messages.push(format!("{e}; keeping the objects this file had before"));
                    next.insert(file, previous.cloned().unwrap_or_default());
                    continue;
                }
            };
            let text_hash = {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                text.hash(&mut h);
                h.finish()
            };
            if let Some(prev) = previous.filter(|p| p.text_hash == text_hash) {
                next.insert(file, prev.clone());
                continue;
            }
            let mut parsed = Objects::default();
            let entries = match manifest::load_str(&file, &text, &mut parsed) {
                Ok(()) => {
                    drop(text);
                    let mut entries = FileEntries::convert(&parsed, &self.node_name, text_hash);
                    for key in &parsed.failed {
                        if let Some(prev) = previous
                            && entries.keep_previous(prev, key)
                        {
                            messages.push(format!(
                                "{}: keeping the previous version of {} {}{}",
                                file.display(),
                                key.kind,
                                key.namespace.as_ref().map(|n| format!("{n}/")).unwrap_or_default(),
                                key.name
                            ));
                        }
                    }
                    messages.append(&mut parsed.warnings);
                    entries
                }
                Err(e) => {
                    messages.push(format!("{e}; keeping the objects this file had before"));
                    // Parse it again next time, whatever its text.
                    FileEntries {
                        text_hash: 0,
                        ..previous.cloned().unwrap_or_default()
                    }
                }
            };
            next.insert(file, entries);
        }
        self.files = next;
        Snapshot {
            store: self.merged(),
            messages,
        }
    }

    fn merged(&self) -> Store {
        let mut store = Store::default();
        for f in self.files.values() {
            for (name, entry) in &f.services {
                store.insert_service(name.clone(), entry.clone());
            }
            for (name, entry) in &f.slices {
                store.insert_slice(name.clone(), entry.clone());
            }
            store.nodes.extend(f.nodes.iter().cloned());
            store.service_cidrs.extend(f.service_cidrs.iter().cloned());
        }
        store
    }
}

/// Watches `dir` recursively and sends `()` on every change of its files; the watcher stops
/// when dropped. Reads (including our own reloads) are not changes.
pub fn watch(dir: &Path, tx: Sender<()>) -> notify::Result<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let is_change = match event {
            Ok(e) => !matches!(e.kind, notify::EventKind::Access(_)),
            // A lost event (queue overflow) may hide a change: reload to be safe.
            Err(_) => true,
        };
        if is_change {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(dir, RecursiveMode::Recursive)?;
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("kp-src-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n";

    #[test]
    fn bad_edits_keep_the_previous_objects() {
        let dir = tempdir("bad");
        let f = dir.0.join("svc.yaml");
        std::fs::write(&f, SVC).unwrap();
        let mut src = ManifestSource::new(&dir.0, "node-a");
        assert_eq!(src.reload().store.services.len(), 1);

        // A syntax error keeps the file's objects.
        std::fs::write(&f, "apiVersion: v1\nkind: [broken\n").unwrap();
        let snap = src.reload();
        assert_eq!(snap.store.services.len(), 1);
        assert!(
            snap.messages
                .iter()
                .any(|m| m.contains("svc.yaml") && m.contains("keeping")),
            "{:?}",
            snap.messages
        );

        // A field that does not decode keeps the object's previous version.
        std::fs::write(&f, SVC.replace("port: 80", "port: eighty")).unwrap();
        let snap = src.reload();
        let state = snap
            .store
            .state(&crate::model::NodeInfo::default(), crate::model::IpFamily::V4);
        assert_eq!(state.service_ports.len(), 1);
        assert_eq!(state.service_ports[0].port.port, 80);
        assert!(
            snap.messages
                .iter()
                .any(|m| m.contains("keeping the previous version of Service d/web")),
            "{:?}",
            snap.messages
        );

        // Removing the file removes its objects.
        std::fs::remove_file(&f).unwrap();
        assert!(src.reload().store.services.is_empty());
    }

    #[test]
    fn unchanged_files_keep_their_entries_and_a_snapshot_shares_them() {
        let dir = tempdir("reuse");
        std::fs::write(dir.0.join("a.yaml"), SVC).unwrap();
        std::fs::write(
            dir.0.join("b.yaml"),
            SVC.replace("web", "api").replace("10.96.0.1", "10.96.0.2"),
        )
        .unwrap();
        let mut src = ManifestSource::new(&dir.0, "node-a");
        let first = src.reload().store;
        let key = |n: &str| ("d".to_string(), n.to_string());
        // b.yaml changes; a.yaml's entry is the same allocation, not a re-parsed copy.
        std::fs::write(
            dir.0.join("b.yaml"),
            SVC.replace("web", "api").replace("10.96.0.1", "10.96.0.3"),
        )
        .unwrap();
        let second = src.reload().store;
        assert!(Arc::ptr_eq(&first.services[&key("web")], &second.services[&key("web")]));
        assert!(!Arc::ptr_eq(
            &first.services[&key("api")],
            &second.services[&key("api")]
        ));
        let changes = second.diff(&first);
        assert!(
            matches!(&changes[..], [crate::model::store::Change::Service(name, Some(_))] if *name == key("api")),
            "{changes:?}"
        );
    }
}
