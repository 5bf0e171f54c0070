//! Reads Kubernetes objects from manifest files: YAML or JSON, several documents per file,
//! `kind: List`, and directories of such files. It owns no semantics: objects that do not
//! decode into their k8s-openapi type are skipped with a warning naming file, line, object and
//! field; a file that is not valid YAML/JSON is an error naming file and line.

use std::fs;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Errors that stop loading: the caller should report them and not use partial results.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A document is not valid YAML or JSON.
    #[error("{path}:{line}:{column}: {message}")]
    Syntax {
        path: PathBuf,
        line: u64,
        column: u64,
        message: String,
    },
}

/// The Kubernetes objects kube-proxy consumes, in the order they were read.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    pub service_cidrs: Vec<ServiceCIDR>,
    /// One line per skipped object or document, naming where it came from and why.
    pub warnings: Vec<String>,
    /// Objects that were present but did not decode, as `(kind, namespace, name)`: a source
    /// that watches files keeps their previous good version instead of deleting them.
    pub failed: Vec<ObjectKey>,
}

impl Objects {
    /// Appends all of `other`'s objects, warnings and failures.
    pub fn extend(&mut self, other: Objects) {
        self.services.extend(other.services);
        self.endpoint_slices.extend(other.endpoint_slices);
        self.nodes.extend(other.nodes);
        self.service_cidrs.extend(other.service_cidrs);
        self.warnings.extend(other.warnings);
        self.failed.extend(other.failed);
    }
}

/// Identifies an object across reloads.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub kind: String,
    pub namespace: Option<String>,
    pub name: String,
}

/// Loads every manifest under `paths` (files, or directories read recursively for
/// `*.yaml`, `*.yml` and `*.json`, in name order).
pub fn load_paths<P: AsRef<Path>>(paths: &[P]) -> Result<Objects, ManifestError> {
    let mut objects = Objects::default();
    for path in paths {
        let path = path.as_ref();
        let mut files = Vec::new();
        collect_files(path, &mut files)?;
        for file in files {
            let text = fs::read_to_string(&file).map_err(|source| ManifestError::Io {
                path: file.clone(),
                source,
            })?;
            load_str(&file, &text, &mut objects)?;
        }
    }
    Ok(objects)
}

/// The manifest files under `path` (itself if it is a file), in the order `load_paths` reads them.
pub fn manifest_files(path: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let mut out = Vec::new();
    collect_files(path, &mut out)?;
    Ok(out)
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>) -> Result<(), ManifestError> {
    let io = |source| ManifestError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = fs::metadata(path).map_err(io)?;
    if !meta.is_dir() {
        out.push(path.to_path_buf());
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = fs::read_dir(path)
        .map_err(io)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io)?;
    entries.sort();
    for entry in entries {
        if entry.is_dir() {
            collect_files(&entry, out)?;
        } else if matches!(
            entry.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            out.push(entry);
        }
    }
    Ok(())
}

/// Parses one file's text (named `path` in messages) and appends its objects.
pub fn load_str(path: &Path, text: &str, objects: &mut Objects) -> Result<(), ManifestError> {
    for (start_line, doc) in split_documents(text) {
        let value: Value = match serde_saphyr::from_str(&doc) {
            Ok(v) => v,
            Err(err) => {
                let (line, column) = err.location().map(|l| (l.line(), l.column())).unwrap_or((1, 1));
                return Err(ManifestError::Syntax {
                    path: path.to_path_buf(),
                    line: start_line + line.saturating_sub(1),
                    column,
                    message: first_line(&err.to_string()),
                });
            }
        };
        let origin = format!("{}:{}", path.display(), start_line);
        add_value(&origin, value, objects);
    }
    Ok(())
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// Splits a YAML stream at `---` lines, keeping the 1-based line where each document starts.
/// Kubernetes manifests never need the rarer YAML stream features, and a per-document parse
/// keeps error lines exact.
fn split_documents(text: &str) -> Vec<(u64, String)> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut start = 1u64;
    for (i, line) in text.lines().enumerate() {
        let is_marker = line == "---" || line.starts_with("--- ") || line.starts_with("---\t") || line == "...";
        if is_marker {
            if !current.trim().is_empty() {
                docs.push((start, std::mem::take(&mut current)));
            }
            current.clear();
            start = i as u64 + 2;
            if let Some(rest) = line.strip_prefix("---")
                && !rest.trim().is_empty()
            {
                // `--- value` starts a document inline.
                current.push_str(rest.trim_start());
                current.push('\n');
                start = i as u64 + 1;
            }
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    if !current.trim().is_empty() {
        docs.push((start, current));
    }
    docs
}

fn add_value(origin: &str, value: Value, objects: &mut Objects) {
    let Value::Object(map) = &value else {
        if !value.is_null() {
            objects
                .warnings
                .push(format!("{origin}: document is not an object; skipped"));
        }
        return;
    };
    let kind = map.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
    let api_version = map.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_string();
    let kind = kind.as_str();
    let api_version = api_version.as_str();
    match (api_version, kind) {
        (_, "List") | (_, "ServiceList") | (_, "EndpointSliceList") | (_, "NodeList") => {
            let items = match map.get("items") {
                Some(Value::Array(items)) => items.clone(),
                None | Some(Value::Null) => Vec::new(),
                Some(_) => {
                    objects
                        .warnings
                        .push(format!("{origin}: {kind}: field items is not a list; skipped"));
                    return;
                }
            };
            for item in items {
                add_value(origin, item, objects);
            }
        }
        ("v1", "Service") => push_typed(origin, kind, value, |o| &mut o.services, objects),
        ("discovery.k8s.io/v1", "EndpointSlice") => push_typed(origin, kind, value, |o| &mut o.endpoint_slices, objects),
        ("v1", "Node") => push_typed(origin, kind, value, |o| &mut o.nodes, objects),
        ("networking.k8s.io/v1" | "networking.k8s.io/v1beta1", "ServiceCIDR") => {
            push_typed(origin, kind, value, |o| &mut o.service_cidrs, objects)
        }
        _ => objects.warnings.push(format!(
            "{origin}: ignoring {} {} (kube-proxy reads v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node and networking.k8s.io/v1 ServiceCIDR)",
            if api_version.is_empty() { "<no apiVersion>" } else { api_version },
            if kind.is_empty() { "<no kind>" } else { kind },
        )),
    }
}

fn object_key(kind: &str, value: &Value) -> ObjectKey {
    let meta = value.get("metadata");
    let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Value::as_str).map(str::to_string);
    ObjectKey {
        kind: kind.to_string(),
        namespace: field("namespace"),
        name: field("name").unwrap_or_default(),
    }
}

fn push_typed<T: DeserializeOwned>(
    origin: &str,
    kind: &str,
    value: Value,
    out: impl FnOnce(&mut Objects) -> &mut Vec<T>,
    objects: &mut Objects,
) {
    let key = object_key(kind, &value);
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(obj) => out(objects).push(obj),
        Err(err) => {
            let reference = match &key.namespace {
                Some(ns) => format!("{ns}/{}", key.name),
                None => key.name.clone(),
            };
            objects.warnings.push(format!(
                "{origin}: {kind} {reference}: field {}: {}; object skipped",
                err.path(),
                err.inner()
            ));
            if !key.name.is_empty() {
                objects.failed.push(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Objects, ManifestError> {
        let mut o = Objects::default();
        load_str(Path::new("t.yaml"), text, &mut o).map(|_| o)
    }

    #[test]
    fn reads_multi_document_and_lists() {
        let o = load(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: x}\n---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  metadata: {name: a-1, namespace: x}\n  addressType: IPv4\n  endpoints: []\n",
        )
        .unwrap();
        assert_eq!(o.services.len(), 1);
        assert_eq!(o.endpoint_slices.len(), 1);
        assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    }

    #[test]
    fn json_document() {
        let o = load(r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1"}}"#).unwrap();
        assert_eq!(o.nodes.len(), 1);
    }

    #[test]
    fn syntax_error_names_line_in_file() {
        let err = load("apiVersion: v1\nkind: Service\n---\napiVersion: v1\nkind: [unclosed\n").unwrap_err();
        match err {
            ManifestError::Syntax { line, .. } => assert!((4..=6).contains(&line), "line {line}"),
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn bad_field_skips_object_and_names_field() {
        let o = load(
            "apiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: x}\nspec:\n  ports:\n  - port: eighty\n---\napiVersion: v1\nkind: Service\nmetadata: {name: good, namespace: x}\n",
        )
        .unwrap();
        assert_eq!(o.services.len(), 1);
        assert_eq!(o.warnings.len(), 1);
        let w = &o.warnings[0];
        assert!(
            w.contains("x/bad") && w.contains("spec.ports[0].port") && w.contains("t.yaml:1"),
            "{w}"
        );
    }

    #[test]
    fn unknown_kinds_are_reported_not_fatal() {
        let o = load("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n").unwrap();
        assert_eq!(o.warnings.len(), 1);
    }
}
