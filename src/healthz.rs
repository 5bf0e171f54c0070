//! The proxy's own health state, as upstream's `ProxyHealthServer` keeps it
//! (`pkg/proxy/healthcheck/proxy_health.go`), and the `/healthz` and `/livez` answers built from it.
//!
//! Each proxier (one per IP family) reports `queued_update` when it receives a change that needs
//! a sync and `updated` after every successful sync (and when its sync loop starts). A family is
//! unhealthy when its oldest queued update has waited `health_timeout` (2 × syncPeriod) or more.
//! As upstream's `Health()` does, only families that have reported `updated` at least once are
//! judged: a proxier that is still starting counts as healthy.
//!
//! `/healthz` is healthy ∧ node eligible (the Node is not being deleted and carries no
//! `ToBeDeletedByClusterAutoscaler` taint); `/livez` is healthy alone. Both answer with
//! upstream's JSON `ProxyHealth` document and count their status codes in
//! `kubeproxy_proxy_healthz_total` / `kubeproxy_proxy_livez_total`.
//!
//! Pure state: no sockets here (see [`crate::http`]); time comes from an injectable clock.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Node;
use serde::Serialize;

use crate::metrics::Metrics;
use crate::model::IpFamily;

/// The taint the Cluster Autoscaler puts on a Node before deleting it (upstream's
/// `ToBeDeletedTaint`).
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// The headers upstream sets on every `/healthz`, `/livez` and health-check node port answer.
pub const JSON_HEADERS: [(&str, &str); 2] = [
    ("Content-Type", "application/json"),
    ("X-Content-Type-Options", "nosniff"),
];

/// A source of wall-clock time; tests substitute a manual one.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Whether upstream considers the Node eligible to receive load-balancer traffic: not marked
/// for deletion and not tainted by the Cluster Autoscaler.
pub fn node_eligible(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_deref()).unwrap_or_default();
    !taints.iter().any(|t| t.key == TO_BE_DELETED_TAINT)
}

/// Shared, cheaply cloneable handle on the proxy's health state.
#[derive(Clone)]
pub struct ProxyHealth(Arc<Inner>);

struct Inner {
    clock: Clock,
    health_timeout: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    last_updated: BTreeMap<IpFamily, SystemTime>,
    oldest_pending_queued: BTreeMap<IpFamily, SystemTime>,
    node_eligible: bool,
}

/// A snapshot of the health state, as upstream's `Health()` computes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthStatus {
    /// Every judged family is healthy (node eligibility is not part of this).
    pub healthy: bool,
    /// The most recent `updated` of any family; `None` is Go's zero time.
    pub last_updated: Option<SystemTime>,
    /// The clock reading the snapshot was judged at.
    pub current_time: SystemTime,
    /// Per family that has reported `updated`: its last update and whether it is healthy.
    pub families: BTreeMap<IpFamily, FamilyHealth>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FamilyHealth {
    pub last_updated: SystemTime,
    pub healthy: bool,
}

/// A ready-to-send answer: status code and body. The headers are [`JSON_HEADERS`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReply {
    pub status: u16,
    pub body: String,
}

// === impl ProxyHealth ===

impl ProxyHealth {
    /// Health state on the real clock. `health_timeout` is upstream's `2 × syncPeriod`.
    pub fn new(health_timeout: Duration) -> ProxyHealth {
        ProxyHealth::with_clock(health_timeout, Arc::new(SystemTime::now))
    }

    /// Health state reading time from `clock`.
    pub fn with_clock(health_timeout: Duration, clock: Clock) -> ProxyHealth {
        // Eligible until told otherwise: upstream waits for the Node object before serving, and
        // the older ProxyHealthServer started eligible for the same reason.
        let state = State {
            node_eligible: true,
            ..State::default()
        };
        ProxyHealth(Arc::new(Inner {
            clock,
            health_timeout,
            state: Mutex::new(state),
        }))
    }

    pub fn health_timeout(&self) -> Duration {
        self.0.health_timeout
    }

    /// The proxier of `family` has changes it has not yet pushed to the dataplane. Only the
    /// oldest pending one matters, so later calls keep the first timestamp.
    pub fn queued_update(&self, family: IpFamily) {
        let now = self.now();
        self.lock().oldest_pending_queued.entry(family).or_insert(now);
    }

    /// The proxier of `family` has just synced successfully.
    pub fn updated(&self, family: IpFamily) {
        let now = self.now();
        let mut st = self.lock();
        st.oldest_pending_queued.remove(&family);
        st.last_updated.insert(family, now);
    }

    /// Upstream's `Health()`.
    pub fn health(&self) -> HealthStatus {
        let st = self.lock();
        let now = self.now();
        let mut status = HealthStatus {
            healthy: true,
            last_updated: st.last_updated.values().max().copied(),
            current_time: now,
            families: BTreeMap::new(),
        };
        for (&family, &last_updated) in &st.last_updated {
            let healthy = match st.oldest_pending_queued.get(&family) {
                // Nothing pending: starting up or fully synced.
                None => true,
                // A clock that went backwards reads as "not late yet".
                Some(&queued) => now.duration_since(queued).unwrap_or_default() < self.0.health_timeout,
            };
            status.healthy &= healthy;
            status.families.insert(family, FamilyHealth { last_updated, healthy });
        }
        status
    }

    /// The proxier health alone, ignoring the Node (upstream's `IsHealthy`); the service
    /// health-check ports report this as `serviceProxyHealthy`.
    pub fn is_healthy(&self) -> bool {
        self.health().healthy
    }

    /// Records the Node's eligibility as computed by [`node_eligible`].
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    /// Records the current Node object; a missing Node is not eligible (newest upstream).
    pub fn sync_node(&self, node: Option<&Node>) {
        self.set_node_eligible(node.is_some_and(node_eligible));
    }

    pub fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// The `/healthz` answer (upstream's `healthzHandler`), counted in `proxy_healthz_total`.
    pub fn healthz_reply(&self, metrics: &Metrics) -> HealthReply {
        let eligible = self.node_eligible();
        let reply = self.reply(Some(eligible));
        metrics
            .proxy_healthz_total
            .with_label_values(&[&reply.status.to_string()])
            .inc();
        reply
    }

    /// The `/livez` answer (upstream's `livezHandler`), counted in `proxy_livez_total`.
    pub fn livez_reply(&self, metrics: &Metrics) -> HealthReply {
        let reply = self.reply(None);
        metrics
            .proxy_livez_total
            .with_label_values(&[&reply.status.to_string()])
            .inc();
        reply
    }

    fn reply(&self, node_eligible: Option<bool>) -> HealthReply {
        let health = self.health();
        let healthy = health.healthy && node_eligible.unwrap_or(true);
        // Older releases reported the last sync-loop run as lastUpdated; to keep that meaning
        // upstream reports "now" whenever the answer is healthy.
        let last_updated = if healthy { Some(self.now()) } else { health.last_updated };
        let doc = ProxyHealthJson {
            last_updated: format_rfc3339_nano(last_updated),
            current_time: format_rfc3339_nano(Some(health.current_time)),
            node_eligible,
            healthy: health.healthy,
            status: health
                .families
                .iter()
                .map(|(f, h)| {
                    let fh = ProxierHealthJson {
                        last_updated: format_rfc3339_nano(Some(h.last_updated)),
                        healthy: h.healthy,
                    };
                    (f.as_str(), fh)
                })
                .collect(),
        };
        // Serialising plain strings and bools cannot fail; an empty body beats a panic.
        let body = serde_json::to_string(&doc).unwrap_or_default();
        HealthReply {
            status: if healthy { 200 } else { 503 },
            body,
        }
    }

    fn now(&self) -> SystemTime {
        (self.0.clock)()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panicking holder (single-field updates).
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for ProxyHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHealth")
            .field("health_timeout", &self.0.health_timeout)
            .finish_non_exhaustive()
    }
}

/// upstream's `ProxyHealth` JSON struct; field order is the wire order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProxyHealthJson {
    last_updated: String,
    current_time: String,
    /// A pointer with `omitempty` upstream: present on /healthz only.
    #[serde(skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    /// `map[v1.IPFamily]ProxierHealth` with `omitempty`: Go sorts the keys.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<&'static str, ProxierHealthJson>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProxierHealthJson {
    last_updated: String,
    healthy: bool,
}

/// Go's `time.Time` JSON form (RFC 3339 with nanoseconds, trailing zeros trimmed), in UTC;
/// `None` is Go's zero time.
pub fn format_rfc3339_nano(t: Option<SystemTime>) -> String {
    let Some(t) = t else {
        return "0001-01-01T00:00:00Z".into();
    };
    let (secs, nanos) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            match d.subsec_nanos() {
                0 => (-(d.as_secs() as i64), 0),
                n => (-(d.as_secs() as i64) - 1, 1_000_000_000 - n),
            }
        }
    };
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = crate::logging::civil_from_days(days);
    let mut s = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        sod / 3600,
        sod / 60 % 60,
        sod % 60
    );
    if nanos > 0 {
        let frac = format!("{nanos:09}");
        s.push('.');
        s.push_str(frac.trim_end_matches('0'));
    }
    s.push('Z');
    s
}

/// A manual clock for tests in this crate: starts at a fixed instant and moves only when told.
#[cfg(test)]
pub(crate) mod test_clock {
    use super::*;

    #[derive(Clone)]
    pub(crate) struct ManualClock(Arc<Mutex<SystemTime>>);

    impl ManualClock {
        /// 2024-01-01T10:00:00Z.
        pub(crate) fn new() -> ManualClock {
            ManualClock(Arc::new(Mutex::new(UNIX_EPOCH + Duration::from_secs(1_704_103_200))))
        }
        pub(crate) fn advance(&self, d: Duration) {
            let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
            *t += d;
        }
        pub(crate) fn clock(&self) -> Clock {
            let inner = self.0.clone();
            Arc::new(move || *inner.lock().unwrap_or_else(|e| e.into_inner()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_clock::ManualClock;
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};

    const TIMEOUT: Duration = Duration::from_secs(60);

    fn health() -> (ProxyHealth, ManualClock) {
        let clock = ManualClock::new();
        (ProxyHealth::with_clock(TIMEOUT, clock.clock()), clock)
    }

    #[test]
    fn healthy_before_any_report() {
        let (h, _) = health();
        let s = h.health();
        assert!(s.healthy);
        assert_eq!(s.last_updated, None);
        assert!(s.families.is_empty());
    }

    #[test]
    fn late_queued_update_is_unhealthy_until_the_next_sync() {
        let (h, clock) = health();
        h.updated(IpFamily::V4);
        h.queued_update(IpFamily::V4);
        clock.advance(TIMEOUT - Duration::from_nanos(1));
        assert!(h.is_healthy(), "not late yet");
        clock.advance(Duration::from_nanos(1));
        assert!(!h.is_healthy(), "waited the whole timeout");
        h.updated(IpFamily::V4);
        assert!(h.is_healthy());
    }

    #[test]
    fn the_oldest_queued_update_counts() {
        let (h, clock) = health();
        h.updated(IpFamily::V6);
        h.queued_update(IpFamily::V6);
        clock.advance(TIMEOUT / 2);
        h.queued_update(IpFamily::V6);
        clock.advance(TIMEOUT / 2);
        assert!(!h.is_healthy());
    }

    #[test]
    fn only_families_that_have_synced_are_judged() {
        let (h, clock) = health();
        h.updated(IpFamily::V4);
        // IPv6 queued but never synced: upstream's Health() iterates lastUpdated only.
        h.queued_update(IpFamily::V6);
        clock.advance(TIMEOUT * 2);
        let s = h.health();
        assert!(s.healthy);
        assert_eq!(s.families.keys().copied().collect::<Vec<_>>(), vec![IpFamily::V4]);

        h.updated(IpFamily::V6);
        h.queued_update(IpFamily::V6);
        clock.advance(TIMEOUT);
        let s = h.health();
        assert!(!s.healthy);
        assert!(s.families[&IpFamily::V4].healthy);
        assert!(!s.families[&IpFamily::V6].healthy);
    }

    #[test]
    fn node_eligibility_follows_deletion_and_autoscaler_taint() {
        let mut node = Node::default();
        assert!(node_eligible(&node));
        node.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "other".into(),
                effect: "NoSchedule".into(),
                ..Taint::default()
            }]),
            ..NodeSpec::default()
        });
        assert!(node_eligible(&node));
        let mut tainted = node.clone();
        if let Some(t) = tainted.spec.as_mut().and_then(|s| s.taints.as_mut()) {
            t.push(Taint {
                key: TO_BE_DELETED_TAINT.into(),
                effect: "NoSchedule".into(),
                ..Taint::default()
            });
        }
        assert!(!node_eligible(&tainted));
        let mut deleting = node.clone();
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert!(!node_eligible(&deleting));

        let (h, _) = health();
        assert!(h.node_eligible());
        h.sync_node(Some(&tainted));
        assert!(!h.node_eligible());
        h.sync_node(Some(&node));
        assert!(h.node_eligible());
        h.sync_node(None);
        assert!(!h.node_eligible());
    }

    #[test]
    fn healthz_body_is_upstreams_json() {
        let (h, clock) = health();
        let metrics = Metrics::new("iptables");
        // No proxier has reported yet: no status map, lastUpdated is "now".
        let r = h.healthz_reply(&metrics);
        assert_eq!(r.status, 200);
        assert_eq!(
            r.body,
            r#"{"lastUpdated":"2024-01-01T10:00:00Z","currentTime":"2024-01-01T10:00:00Z","nodeEligible":true,"healthy":true}"#
        );

        h.updated(IpFamily::V4);
        h.updated(IpFamily::V6);
        clock.advance(Duration::from_millis(1500));
        h.queued_update(IpFamily::V4);
        clock.advance(TIMEOUT);
        let r = h.healthz_reply(&metrics);
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body,
            concat!(
                r#"{"lastUpdated":"2024-01-01T10:00:00Z","currentTime":"2024-01-01T10:01:01.5Z","#,
                r#""nodeEligible":true,"healthy":false,"status":{"#,
                r#""IPv4":{"lastUpdated":"2024-01-01T10:00:00Z","healthy":false},"#,
                r#""IPv6":{"lastUpdated":"2024-01-01T10:00:00Z","healthy":true}}}"#
            )
        );
        let text = metrics.encode();
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 1\n"));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1\n"));
    }

    #[test]
    fn livez_omits_node_eligibility_and_ignores_it() {
        let (h, _) = health();
        let metrics = Metrics::new("iptables");
        h.updated(IpFamily::V4);
        h.set_node_eligible(false);

        let hz = h.healthz_reply(&metrics);
        assert_eq!(hz.status, 503);
        // Unhealthy only through the Node: "healthy" is the proxier's own verdict.
        assert!(
            hz.body.contains(r#""nodeEligible":false,"healthy":true,"#),
            "{}",
            hz.body
        );

        let lz = h.livez_reply(&metrics);
        assert_eq!(lz.status, 200);
        assert_eq!(
            lz.body,
            concat!(
                r#"{"lastUpdated":"2024-01-01T10:00:00Z","currentTime":"2024-01-01T10:00:00Z","healthy":true,"#,
                r#""status":{"IPv4":{"lastUpdated":"2024-01-01T10:00:00Z","healthy":true}}}"#
            )
        );
        assert!(
            metrics
                .encode()
                .contains("kubeproxy_proxy_livez_total{code=\"200\"} 1\n")
        );
    }

    #[test]
    fn times_are_formatted_like_go_json() {
        let at = |secs: u64, nanos: u32| Some(UNIX_EPOCH + Duration::new(secs, nanos));
        assert_eq!(format_rfc3339_nano(None), "0001-01-01T00:00:00Z");
        assert_eq!(format_rfc3339_nano(at(0, 0)), "1970-01-01T00:00:00Z");
        assert_eq!(
            format_rfc3339_nano(at(1_704_103_200, 123_000_000)),
            "2024-01-01T10:00:00.123Z"
        );
        assert_eq!(
            format_rfc3339_nano(at(1_709_210_096, 1)),
            "2024-02-29T12:34:56.000000001Z"
        );
        assert_eq!(
            format_rfc3339_nano(Some(UNIX_EPOCH - Duration::new(1, 500_000_000))),
            "1969-12-31T23:59:58.5Z"
        );
    }
}
