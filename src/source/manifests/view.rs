//! The manifest directory as the proxy sees it: the last good content of every file,
//! converted, and the merged view of all files (an object defined in several files keeps the
//! definition of the first file in path order, with a warning), kept up to date file by file.
//! Re-reading one file costs that file and the objects it names, not the directory: an index
//! says which files define each object, so the merged entry of a touched name is found
//! without a walk over the cluster.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::manifest::{self, ObjectKey, Objects};
use crate::model::store::{self, Change, ObjectName, Store, object_name};
use crate::model::{ServiceEntry, SliceEntry};

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

    fn has_whole_kinds(&self) -> bool {
        !self.nodes.is_empty() || !self.service_cidrs.is_empty()
    }
}

/// One reload: what changed in the merged view, and what to tell the operator.
pub struct Reload {
    /// The changes from the merged view before this reload to the one after.
    pub changes: Vec<Change>,
    /// Errors (file-level) and warnings (object-level), each naming file and object.
    pub messages: Vec<String>,
}

/// Which files define each object of one kind, in path order (the first one's wins), and
/// the objects more than one file defines (kept as files change, so that the warnings need
/// no walk over the cluster). A file's path is shared by its objects: one pointer each rather
/// than a copy of the path in a tree node of its own.
#[derive(Default)]
struct Owners {
    files: HashMap<ObjectName, Vec<Arc<Path>>>,
    twice: BTreeSet<ObjectName>,
}

/// Reloads a manifest directory, remembering the last good content of every file, converted.
pub struct ManifestSource {
    dir: PathBuf,
    /// Decides endpoint locality when slices are converted.
    node_name: String,
    files: BTreeMap<Arc<Path>, FileEntries>,
    /// The merged view of `files`.
    merged: Store,
    service_files: Owners,
    slice_files: Owners,
}

impl ManifestSource {
    /// A source for the node `node_name` (endpoints on it are local).
    pub fn new(dir: impl Into<PathBuf>, node_name: &str) -> ManifestSource {
        ManifestSource {
            dir: dir.into(),
            node_name: node_name.to_string(),
            files: BTreeMap::new(),
            merged: Store::default(),
            service_files: Owners::default(),
            slice_files: Owners::default(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads every file again (files whose text did not change keep their entries).
    pub fn reload(&mut self) -> Reload {
        let mut messages = Vec::new();
        let mut changes = Vec::new();
        match manifest::manifest_files(&self.dir) {
            Ok(files) => {
                let listed: BTreeSet<PathBuf> = files.into_iter().collect();
                let gone: Vec<Arc<Path>> = self.files.keys().filter(|f| !listed.contains(&***f)).cloned().collect();
                for file in gone {
                    changes.extend(self.replace_file(&file, None));
                }
                for file in listed {
                    changes.extend(self.reread(&file, &mut messages));
                }
            }
            // The directory itself is unreadable: keep everything we had.
            Err(e) => messages.push(format!("{e}; keeping the objects read before")),
        }
        Reload { changes, messages }
    }

    /// Reads again only `paths` (files that were created, written, renamed or removed); a
    /// path that is no manifest file of the directory is ignored.
    pub fn reload_files(&mut self, paths: &BTreeSet<PathBuf>) -> Reload {
        let mut messages = Vec::new();
        let mut changes = Vec::new();
        for path in paths {
            if !self.is_manifest(path) {
                continue;
            }
            if path.is_file() {
                changes.extend(self.reread(path, &mut messages));
            } else if self.files.contains_key(path.as_path()) {
                changes.extend(self.replace_file(path, None));
            }
        }
        Reload { changes, messages }
    }

    /// Whether `path` names a manifest file of the directory (by its place and extension:
    /// the rules of [`manifest::manifest_files`]).
    pub fn is_manifest(&self, path: &Path) -> bool {
        path.starts_with(&self.dir)
            && matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"))
    }

    /// The merged view of every file, as the last reload left it.
    pub fn merged(&self) -> &Store {
        &self.merged
    }

    /// Reads `file` again and applies what it holds now.
    fn reread(&mut self, file: &Path, messages: &mut Vec<String>) -> Vec<Change> {
        let previous = self.files.get(file);
        match read_file(file, previous, &self.node_name, messages) {
            Some(entries) => self.replace_file(file, Some(entries)),
            None => Vec::new(),
        }
    }

    /// Makes `entries` what `file` holds (`None`: the file is gone) and brings the merged
    /// view along; the changes to it.
    fn replace_file(&mut self, file: &Path, entries: Option<FileEntries>) -> Vec<Change> {
        let key: Arc<Path> = match self.files.get_key_value(file) {
            Some((k, _)) => k.clone(),
            None => Arc::from(file),
        };
        let old = match entries {
            Some(mut new) => {
                share(&self.merged.services, &mut new.services);
                share(&self.merged.slices, &mut new.slices);
                self.files.insert(key.clone(), new)
            }
            None => self.files.remove(file),
        };
        let new = self.files.get(file);
        let mut changes = Vec::new();
        let service_names = names(old.as_ref().map(|f| &f.services), new.map(|f| &f.services));
        let slice_names = names(old.as_ref().map(|f| &f.slices), new.map(|f| &f.slices));
        reindex(&mut self.service_files, &key, &service_names, new.map(|f| &f.services));
        reindex(&mut self.slice_files, &key, &slice_names, new.map(|f| &f.slices));
        for name in service_names {
            let entry = effective(&self.files, &self.service_files, &name, |f| &f.services);
            if set(&mut self.merged.services, &name, entry.clone()) {
                changes.push(Change::Service(name, entry));
            }
        }
        for name in slice_names {
            let entry = effective(&self.files, &self.slice_files, &name, |f| &f.slices);
            if set(&mut self.merged.slices, &name, entry.clone()) {
                changes.push(Change::Slice(name, entry));
            }
        }
        if old.as_ref().is_some_and(FileEntries::has_whole_kinds) || new.is_some_and(FileEntries::has_whole_kinds) {
            let nodes: Vec<Node> = self.files.values().flat_map(|f| f.nodes.iter().cloned()).collect();
            let cidrs: Vec<ServiceCIDR> = self
                .files
                .values()
                .flat_map(|f| f.service_cidrs.iter().cloned())
                .collect();
            if nodes != self.merged.nodes {
                self.merged.nodes = nodes.clone();
                changes.push(Change::Nodes(nodes));
            }
            if cidrs != self.merged.service_cidrs {
                self.merged.service_cidrs = cidrs.clone();
                changes.push(Change::ServiceCidrs(cidrs));
            }
        }
        self.merged.warnings = duplicate_warnings(&self.service_files, &self.slice_files);
        changes
    }
}

/// Reads and converts `file`; `None` when its text is what `previous` was made from. A file
/// that cannot be read or parsed keeps `previous`, and an object that stops decoding keeps
/// its previous version, each with a message.
fn read_file(
    file: &Path,
    previous: Option<&FileEntries>,
    node_name: &str,
    messages: &mut Vec<String>,
) -> Option<FileEntries> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(source) => {
            let e = manifest::ManifestError::Io {
                path: file.to_path_buf(),
                source,
            };
            messages.push(format!("{e}; keeping the objects this file had before"));
            return Some(previous.cloned().unwrap_or_default());
        }
    };
    let text_hash = {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut h);
        h.finish()
    };
    if previous.is_some_and(|p| p.text_hash == text_hash) {
        return None;
    }
    let mut parsed = Objects::default();
    match manifest::load_str(file, &text, &mut parsed) {
        Ok(()) => {
            drop(text);
            let mut entries = FileEntries::convert(&parsed, node_name, text_hash);
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
            Some(entries)
        }
        Err(e) => {
            messages.push(format!("{e}; keeping the objects this file had before"));
            // Parse it again next time, whatever its text.
            Some(FileEntries {
                text_hash: 0,
                ..previous.cloned().unwrap_or_default()
            })
        }
    }
}

/// The names in either version of one kind of a file's entries.
fn names<T>(old: Option<&Vec<(ObjectName, T)>>, new: Option<&Vec<(ObjectName, T)>>) -> BTreeSet<ObjectName> {
    old.into_iter().chain(new).flatten().map(|(n, _)| n.clone()).collect()
}

/// Files `file` under the names it defines now, and off the ones it no longer does.
fn reindex<T>(
    owners: &mut Owners,
    file: &Arc<Path>,
    touched: &BTreeSet<ObjectName>,
    now: Option<&Vec<(ObjectName, T)>>,
) {
    let defines: BTreeSet<&ObjectName> = now.into_iter().flatten().map(|(n, _)| n).collect();
    for name in touched {
        let count = if defines.contains(name) {
            let files = owners.files.entry(name.clone()).or_default();
            if let Err(i) = files.binary_search(file) {
                // Exactly one slot for the usual single file (`push` would reserve four).
                files.reserve_exact(1);
                files.insert(i, file.clone());
            }
            files.len()
        } else if let Some(files) = owners.files.get_mut(name) {
            if let Ok(i) = files.binary_search(file) {
                files.remove(i);
            }
            let count = files.len();
            if count == 0 {
                owners.files.remove(name);
            }
            count
        } else {
            0
        };
        if count > 1 {
            owners.twice.insert(name.clone());
        } else {
            owners.twice.remove(name);
        }
    }
}

/// The entry of `name` in the first file (in path order) that defines it.
fn effective<T>(
    files: &BTreeMap<Arc<Path>, FileEntries>,
    owners: &Owners,
    name: &ObjectName,
    kind: impl Fn(&FileEntries) -> &Vec<(ObjectName, Arc<T>)>,
) -> Option<Arc<T>> {
    let first = owners.files.get(name)?.first()?;
    kind(files.get(&**first)?)
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, e)| e.clone())
}

/// Sets the merged entry of `name`; whether it changed (equal entries are no change).
/// Points each of a re-read file's entries that equals the version in effect at that version,
/// so that an object whose file changed around it is held once, not twice.
fn share<T: PartialEq>(merged: &BTreeMap<ObjectName, Arc<T>>, entries: &mut [(ObjectName, Arc<T>)]) {
    for (name, entry) in entries {
        if let Some(held) = merged.get(name)
            && !Arc::ptr_eq(held, entry)
            && **held == **entry
        {
            *entry = held.clone();
        }
    }
}

fn set<T: PartialEq>(map: &mut BTreeMap<ObjectName, Arc<T>>, name: &ObjectName, entry: Option<Arc<T>>) -> bool {
    let same = match (map.get(name), &entry) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
        (None, None) => true,
        _ => false,
    };
    if !same {
        match entry {
            Some(e) => map.insert(name.clone(), e),
            None => map.remove(name),
        };
    }
    !same
}

/// "Defined more than once" for every object that more than one file defines, as
/// [`Store::insert_service`] words it (kept as files change: no walk over the cluster).
fn duplicate_warnings(services: &Owners, slices: &Owners) -> Vec<String> {
    let mut out = Vec::new();
    for (kind, owners) in [("Service", services), ("EndpointSlice", slices)] {
        for (ns, name) in &owners.twice {
            out.push(format!(
                "{kind} {ns}/{name}: defined more than once; the first definition is used"
            ));
        }
    }
    out
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
        src.reload();
        assert_eq!(src.merged().services.len(), 1);

        // A syntax error keeps the file's objects.
        std::fs::write(&f, "apiVersion: v1\nkind: [broken\n").unwrap();
        let snap = src.reload();
        assert_eq!(src.merged().services.len(), 1);
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
        let state = src
            .merged()
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
        src.reload();
        assert!(src.merged().services.is_empty());
    }

    #[test]
    fn an_object_unchanged_in_a_rewritten_file_is_held_once() {
        let dir = tempdir("once");
        let f = dir.0.join("svc.yaml");
        let other = "---\napiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: d}\nspec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}\n";
        std::fs::write(&f, format!("{SVC}{other}")).unwrap();
        let mut src = ManifestSource::new(&dir.0, "node-a");
        src.reload();
        let web = ("d".to_string(), "web".to_string());
        let before = src.merged().services[&web].clone();
        std::fs::write(&f, format!("{SVC}{}", other.replace("10.96.0.2", "10.96.0.3"))).unwrap();
        src.reload();
        let after = &src.merged().services[&web];
        assert!(Arc::ptr_eq(&before, after));
        // This one, the merged view's and the file's: no copy made from the re-read.
        assert_eq!(Arc::strong_count(after), 3);
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
        src.reload();
        let first = src.merged().clone();
        let key = |n: &str| ("d".to_string(), n.to_string());
        // b.yaml changes; a.yaml's entry is the same allocation, not a re-parsed copy.
        std::fs::write(
            dir.0.join("b.yaml"),
            SVC.replace("web", "api").replace("10.96.0.1", "10.96.0.3"),
        )
        .unwrap();
        src.reload();
        let second = src.merged().clone();
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

    /// The merged view after `edits` (file, text or None to remove), incrementally and from a
    /// fresh full read: they agree, and the changes sent turn the old view into the new one.
    fn check_incremental(tag: &str, edits: &[(&str, Option<String>)]) {
        let dir = tempdir(tag);
        let mut src = ManifestSource::new(&dir.0, "node-a");
        src.reload();
        let mut seen = src.merged().clone();
        for (file, text) in edits {
            let path = dir.0.join(file);
            match text {
                Some(t) => std::fs::write(&path, t).unwrap(),
                None => {
                    let _ = std::fs::remove_file(&path);
                }
            }
            let snap = src.reload_files(&[path].into_iter().collect());
            let mut full = ManifestSource::new(&dir.0, "node-a");
            full.reload();
            let fresh = full.merged().clone();
            let store = src.merged().clone();
            assert_eq!(
                store.services.keys().collect::<Vec<_>>(),
                fresh.services.keys().collect::<Vec<_>>()
            );
            for (k, v) in &fresh.services {
                assert_eq!(**v, *store.services[k], "{k:?} after editing {file}");
            }
            assert_eq!(store.slices.len(), fresh.slices.len());
            assert_eq!(store.warnings, fresh.warnings, "after editing {file}");
            let mut builder = crate::model::StateBuilder::with_store(seen.clone());
            builder.apply(snap.changes);
            let node = crate::model::NodeInfo::default();
            assert_eq!(
                builder.build(&node, crate::model::IpFamily::V4).service_ports,
                fresh.state(&node, crate::model::IpFamily::V4).service_ports,
                "the changes sent after editing {file}"
            );
            seen = store;
        }
    }

    #[test]
    fn re_reading_named_files_agrees_with_a_full_read() {
        let api = SVC.replace("web", "api").replace("10.96.0.1", "10.96.0.2");
        let web81 = SVC.replace("port: 80", "port: 81");
        check_incremental(
            "incr",
            &[
                ("a.yaml", Some(SVC.to_string())),
                ("b.yaml", Some(api.clone())),
                // web defined twice: a.yaml (first) wins, with a warning.
                ("c.yaml", Some(web81.clone())),
                // a.yaml loses web: c.yaml's definition takes over.
                ("a.yaml", Some(api.clone())),
                ("c.yaml", None),
                ("b.yaml", Some(format!("{SVC}---\n{api}"))),
                ("a.yaml", None),
                ("ignored.txt", Some(web81)),
            ],
        );
    }

    #[test]
    fn only_the_named_files_are_read_again() {
        let dir = tempdir("named");
        std::fs::write(dir.0.join("a.yaml"), SVC).unwrap();
        std::fs::write(dir.0.join("b.yaml"), SVC.replace("web", "api")).unwrap();
        let mut src = ManifestSource::new(&dir.0, "node-a");
        src.reload();
        assert_eq!(src.merged().services.len(), 2);
        // Both change on disk; only a.yaml is named.
        std::fs::write(dir.0.join("a.yaml"), SVC.replace("10.96.0.1", "10.96.0.9")).unwrap();
        std::fs::write(dir.0.join("b.yaml"), "kind: [broken\n").unwrap();
        let snap = src.reload_files(&[dir.0.join("a.yaml")].into_iter().collect());
        assert_eq!(snap.changes.len(), 1, "{:?}", snap.changes);
        assert!(snap.messages.is_empty(), "b.yaml was not read: {:?}", snap.messages);
    }
}
