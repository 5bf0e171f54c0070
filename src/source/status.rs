//! How a source is doing, for `/debug/services` and `kube-proxy explain`: whether it reaches
//! its objects, and since when it has not (the API server away, a watch failing), with the
//! last error. Shared between the source's tasks (which report) and the daemon's debug view
//! (which reads).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// What the source reports, as `/debug/services` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceHealth {
    /// `api` or `manifests`.
    pub kind: String,
    /// Since when (RFC 3339) a part of the source has been failing; absent while all is well.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreachable_since: Option<String>,
    /// The last error of each failing part (e.g. the Service watch).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub errors: BTreeMap<String, String>,
}

/// The shared status of one source.
#[derive(Clone, Debug, Default)]
pub struct SourceStatus(Arc<Mutex<Inner>>);

#[derive(Debug, Default)]
struct Inner {
    kind: String,
    /// Per failing part: since when, and the last error.
    failing: BTreeMap<String, (SystemTime, String)>,
}

impl SourceStatus {
    /// The status of a source of `kind` (`api`, `manifests`).
    pub fn new(kind: &str) -> SourceStatus {
        SourceStatus(Arc::new(Mutex::new(Inner {
            kind: kind.to_string(),
            failing: BTreeMap::new(),
        })))
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        // A panic elsewhere while holding the lock leaves a consistent map.
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// `part` failed with `error` (the time of its first failure in a row is kept).
    pub fn failed(&self, part: &str, error: &str) {
        self.with(|i| {
            let since = i.failing.get(part).map_or_else(SystemTime::now, |(t, _)| *t);
            i.failing.insert(part.to_string(), (since, error.to_string()));
        });
    }

    /// `part` works (again).
    pub fn ok(&self, part: &str) {
        self.with(|i| i.failing.remove(part));
    }

    pub fn health(&self) -> SourceHealth {
        self.with(|i| SourceHealth {
            kind: i.kind.clone(),
            unreachable_since: i.failing.values().map(|(t, _)| *t).min().map(rfc3339),
            errors: i.failing.iter().map(|(k, (_, e))| (k.clone(), e.clone())).collect(),
        })
    }
}

/// `t` as RFC 3339 UTC with seconds (`2024-01-01T10:00:00Z`).
pub fn rfc3339(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .map(|ts| {
            ts.round(jiff::Unit::Second)
                .map_or_else(|_| ts.to_string(), |r| r.to_string())
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_failure_in_a_row_is_the_time_since() {
        let s = SourceStatus::new("api");
        assert_eq!(s.health().unreachable_since, None);
        s.failed("Service", "connection refused");
        let first = s.health().unreachable_since.expect("failing");
        std::thread::sleep(std::time::Duration::from_millis(1100));
        s.failed("Service", "connection reset");
        let h = s.health();
        assert_eq!(h.unreachable_since.as_deref(), Some(first.as_str()));
        assert_eq!(h.errors["Service"], "connection reset");
        s.ok("Service");
        assert_eq!(
            s.health(),
            SourceHealth {
                kind: "api".into(),
                ..SourceHealth::default()
            }
        );
    }
}
