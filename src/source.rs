//! The standalone source (`--manifests DIR`): Services, EndpointSlices, Nodes and ServiceCIDRs
//! read from a directory of manifests and re-read when files change (inotify through the
//! `notify` crate). Bad edits lose nothing: a file that stops parsing keeps the objects it had,
//! and an object that stops decoding keeps its previous version, each with a logged error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;

use notify::{RecursiveMode, Watcher};

use crate::manifest::{self, Objects};

/// Reloads a manifest directory, remembering the last good content of every file.
pub struct ManifestSource {
    dir: PathBuf,
    files: BTreeMap<PathBuf, Objects>,
}

/// One reload: the merged objects and what to tell the operator.
pub struct Snapshot {
    pub objects: Objects,
    /// Errors (file-level) and warnings (object-level), each naming file and object.
    pub messages: Vec<String>,
}

impl ManifestSource {
    pub fn new(dir: impl Into<PathBuf>) -> ManifestSource {
        ManifestSource {
            dir: dir.into(),
            files: BTreeMap::new(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads every file again.
    pub fn reload(&mut self) -> Snapshot {
        let mut messages = Vec::new();
        let files = match manifest::manifest_files(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                // The directory itself is unreadable: keep everything we had.
                messages.push(format!("{e}; keeping the objects read before"));
                return Snapshot {
                    objects: self.merged(),
                    messages,
                };
            }
        };
        let mut next = BTreeMap::new();
        for file in files {
            let previous = self.files.get(&file);
            let parsed = std::fs::read_to_string(&file)
                .map_err(|source| manifest::ManifestError::Io {
                    path: file.clone(),
                    source,
                })
                .and_then(|text| {
                    let mut o = Objects::default();
                    manifest::load_str(&file, &text, &mut o).map(|_| o)
                });
            let objects = match parsed {
                Ok(mut o) => {
                    if let Some(prev) = previous {
                        for key in o.keep_previous_versions(prev) {
                            messages.push(format!(
                                "{}: keeping the previous version of {} {}{}",
                                file.display(),
                                key.kind,
                                key.namespace.map(|n| format!("{n}/")).unwrap_or_default(),
                                key.name
                            ));
                        }
                    }
                    messages.append(&mut o.warnings);
                    o
                }
                Err(e) => {
                    messages.push(format!("{e}; keeping the objects this file had before"));
                    previous.cloned().unwrap_or_default()
                }
            };
            next.insert(file, objects);
        }
        self.files = next;
        Snapshot {
            objects: self.merged(),
            messages,
        }
    }

    fn merged(&self) -> Objects {
        let mut all = Objects::default();
        for o in self.files.values() {
            let mut o = o.clone();
            o.warnings.clear();
            all.extend(o);
        }
        all
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
        let mut src = ManifestSource::new(&dir.0);
        assert_eq!(src.reload().objects.services.len(), 1);

        // A syntax error keeps the file's objects.
        std::fs::write(&f, "apiVersion: v1\nkind: [broken\n").unwrap();
        let snap = src.reload();
        assert_eq!(snap.objects.services.len(), 1);
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
        assert_eq!(snap.objects.services.len(), 1);
        assert_eq!(
            snap.objects.services[0].spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
            80
        );
        assert!(
            snap.messages
                .iter()
                .any(|m| m.contains("keeping the previous version of Service d/web")),
            "{:?}",
            snap.messages
        );

        // Removing the file removes its objects.
        std::fs::remove_file(&f).unwrap();
        assert!(src.reload().objects.services.is_empty());
    }
}
