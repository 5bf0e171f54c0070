//! What the daemon tells the world: the healthz state, the `kubeproxy_*` metrics of its mode,
//! and the health-check node ports of ETP-Local LoadBalancers. The sync loop reports events
//! here; which metric an event feeds depends on the mode, as upstream's proxiers do it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use tracing::warn;

use super::debug::DebugView;
use crate::config::ProxyMode;
use crate::healthz::ProxyHealth;
use crate::http::{ServiceHealthServers, ServiceKey};
use crate::metrics::Metrics;
use crate::model::store::Changes;
use crate::model::{IpFamily, ProxyState, categorize_endpoints};
use crate::proxy::SyncReport;

/// Health, metrics and the health-check node ports, shared by the sync loop and the servers.
pub struct Telemetry {
    pub health: ProxyHealth,
    pub metrics: Arc<Metrics>,
    /// What the last syncs programmed, for the `/debug` endpoints.
    pub debug: DebugView,
    mode: ProxyMode,
    service_health: ServiceHealthServers,
    /// The runtime the health-check servers run on (the HTTP servers'); `None`: the caller's.
    servers: Option<tokio::runtime::Handle>,
    /// Trigger times of EndpointSlice changes not yet synced.
    triggers: Mutex<Vec<SystemTime>>,
}

impl Telemetry {
    pub fn new(
        mode: ProxyMode,
        health: ProxyHealth,
        metrics: Arc<Metrics>,
        service_health: ServiceHealthServers,
        servers: Option<tokio::runtime::Handle>,
    ) -> Telemetry {
        Telemetry {
            health,
            metrics,
            debug: DebugView::default(),
            mode,
            service_health,
            servers,
            triggers: Mutex::new(Vec::new()),
        }
    }

    /// Telemetry without servers for `mode` on the node `node_name` (tests, tools).
    pub fn detached(mode: ProxyMode, node_name: &str, health_timeout: Duration) -> Telemetry {
        let health = ProxyHealth::new(health_timeout);
        let service_health = ServiceHealthServers::new(node_name, Vec::new(), health.clone());
        Telemetry::new(
            mode,
            health,
            Arc::new(Metrics::new(mode.as_str())),
            service_health,
            None,
        )
    }

    /// Objects changed (counted per Service and EndpointSlice, as upstream's change trackers).
    pub fn changed(&self, changes: &Changes) {
        let (services, slices) = (changes.services as f64, changes.slices as f64);
        self.metrics.service_changes_total.inc_by(services);
        self.metrics.endpoint_changes_total.inc_by(slices);
        self.metrics.service_changes_pending.add(services);
        self.metrics.endpoint_changes_pending.add(slices);
        if let Ok(mut pending) = self.triggers.lock() {
            pending.extend(changes.triggers.iter().copied());
        }
    }

    /// A sync of these families is queued.
    pub fn queued(&self, families: &[IpFamily]) {
        for f in families {
            self.health.queued_update(*f);
            self.metrics
                .sync_proxy_rules_last_queued_timestamp
                .with_label_values(&[f.as_str()])
                .set(unix_now());
        }
    }

    /// The Node as the source sees it (`None`: not there).
    pub fn sync_node(&self, node: Option<&Node>) {
        self.health.sync_node(node);
    }

    /// One family synced.
    pub fn synced(&self, family: IpFamily, report: &SyncReport, state: &ProxyState, prefer_same_node: bool) {
        let f = [family.as_str()];
        let m = &self.metrics;
        let secs = report.elapsed.as_secs_f64();
        m.sync_proxy_rules_duration.with_label_values(&f).observe(secs);
        let by_kind = if report.full {
            &m.sync_full_proxy_rules_duration
        } else {
            &m.sync_partial_proxy_rules_duration
        };
        by_kind.with_label_values(&f).observe(secs);
        m.sync_proxy_rules_last_timestamp.with_label_values(&f).set(unix_now());
        for t in &report.tables {
            let labels = [family.as_str(), t.table.as_str()];
            m.iptables_rules_total.with_label_values(&labels).set(t.total as f64);
            m.iptables_rules_last.with_label_values(&labels).set(t.written as f64);
        }
        let (internal, external) = no_local_endpoints(state, prefer_same_node);
        m.no_local_endpoints
            .with_label_values(&[family.as_str(), "internal"])
            .set(internal as f64);
        m.no_local_endpoints
            .with_label_values(&[family.as_str(), "external"])
            .set(external as f64);
        self.health.updated(family);
        self.debug.synced(state, report.full);
    }

    /// One family's sync of `state` failed (`full`: it was a full one) with `error`. The
    /// counter is the mode's.
    pub fn failed(&self, state: &ProxyState, full: bool, error: &str) {
        let family = state.family;
        self.debug.failed(state, full, error);
        let f = [family.as_str()];
        let m = &self.metrics;
        match self.mode {
            ProxyMode::Nftables => m.nftables_sync_failures_total.with_label_values(&f).inc(),
            ProxyMode::Iptables | ProxyMode::Ipvs => {
                m.iptables_restore_failures_total.with_label_values(&f).inc();
                if !full && self.mode == ProxyMode::Iptables {
                    m.iptables_partial_restore_failures_total.with_label_values(&f).inc();
                }
            }
        }
    }

    /// Stale conntrack entries were reconciled for `family`.
    pub fn conntrack_reconciled(&self, family: IpFamily, deleted: usize, took: Duration) {
        let f = [family.as_str()];
        self.metrics
            .conntrack_reconciler_sync_duration
            .with_label_values(&f)
            .observe(took.as_secs_f64());
        self.metrics
            .conntrack_reconciler_deleted_entries_total
            .with_label_values(&f)
            .inc_by(deleted as f64);
    }

    /// After a sync of every family: pending changes are applied; the network-programming
    /// latency of each changed EndpointSlice is observed.
    pub fn all_synced(&self, families: &[IpFamily]) {
        self.metrics.service_changes_pending.set(0.0);
        self.metrics.endpoint_changes_pending.set(0.0);
        let triggers = self
            .triggers
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        let now = SystemTime::now();
        for t in triggers {
            let latency = now.duration_since(t).map(|d| d.as_secs_f64()).unwrap_or(0.0);
            for f in families {
                self.metrics
                    .network_programming_duration
                    .with_label_values(&[f.as_str()])
                    .observe(latency);
            }
        }
    }

    /// Health-check node ports of ETP-Local LoadBalancers and their local ready endpoints.
    pub async fn sync_service_health(&self, states: &[ProxyState]) {
        let mut ports: BTreeMap<ServiceKey, u16> = BTreeMap::new();
        let mut local: BTreeMap<ServiceKey, BTreeSet<IpAddr>> = BTreeMap::new();
        for state in states {
            for sps in &state.service_ports {
                let key = (sps.port.name.namespace.clone(), sps.port.name.name.clone());
                if sps.port.health_check_node_port != 0 {
                    ports.insert(key.clone(), sps.port.health_check_node_port);
                }
                let ready = local.entry(key).or_default();
                ready.extend(sps.endpoints.iter().filter(|e| e.is_local && e.ready).map(|e| e.ip));
            }
        }
        let servers = self.service_health.clone();
        let errors = match &self.servers {
            // The listeners must live on the servers' runtime, not the sync loop's.
            Some(handle) => handle
                .spawn(async move { servers.sync_services(ports).await })
                .await
                .unwrap_or_else(|e| vec![format!("health-check servers: {e}")]),
            None => servers.sync_services(ports).await,
        };
        for e in errors {
            warn!(error = %e, "Health-check node port");
        }
        self.service_health
            .sync_endpoints(local.into_iter().map(|(k, v)| (k, v.len())).collect());
    }
}

/// Service ports with a Local traffic policy and no local endpoint, though they have
/// endpoints elsewhere: `(internal, external)`, as upstream's proxiers count them for
/// `sync_proxy_rules_no_local_endpoints_total`.
pub fn no_local_endpoints(state: &ProxyState, prefer_same_node: bool) -> (usize, usize) {
    let (mut internal, mut external) = (0, 0);
    let zone = state.node.zone();
    for sps in &state.service_ports {
        let port = &sps.port;
        if !(port.internal_policy_local || port.external_policy_local) {
            continue;
        }
        let sets = categorize_endpoints(&sps.endpoints, port, &state.node.name, zone, prefer_same_node);
        if !sets.has_any || !sets.local.is_empty() {
            continue;
        }
        internal += usize::from(port.internal_policy_local);
        external += usize::from(port.external_policy_local);
    }
    (internal, external)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
