//! kube-proxy's Prometheus metrics: the `kubeproxy_*` families, their registration per proxy
//! mode, and the client_golang-compatible text exposition served on `/metrics`.
//!
//! Names, types, labels, HELP texts and buckets follow upstream's `pkg/proxy/metrics/metrics.go`
//! (newest layout: per-family `ip_family` labels, conntrack reconciler metrics). component-base
//! prefixes every HELP text with the stability level (`[ALPHA] …`), so the HELP strings here
//! carry it too. `RegisterMetrics(mode)` registers the common families for every mode and the
//! backend-specific ones only for their mode; [`Metrics::new`] does the same.
//!
//! All metric handles are always constructed, so callers may observe any of them without caring
//! about the mode; families not registered for the mode are simply never exported (as with an
//! unregistered component-base metric). Label vectors export nothing until a child is created,
//! exactly like client_golang, so a fresh process shows only the unlabelled families.
//!
//! Besides them, what component-base adds to every component: `kubernetes_build_info` (this
//! binary's version, [`BuildInfo`]) and `kubernetes_feature_enabled` (the feature gates, set by
//! [`Metrics::record_feature_gates`]); and iptables mode's two nfacct-backed counters
//! (`kubeproxy_iptables_ct_state_invalid_dropped_packets_total`,
//! `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`), read from the kernel at
//! every scrape once [`Metrics::register_nfacct`] has them.
//!
//! Not covered here: client-go's `rest_client_*` and Go's `go_*` runtime metrics.

use std::sync::Mutex;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};

use crate::config::GateState;
use crate::iptables::nfacct::Nfacct;
use crate::iptables::render::{NFACCT_CT_STATE_INVALID, NFACCT_LOCALHOST_NODEPORTS};
use prometheus::{Counter, CounterVec, Gauge, GaugeVec, HistogramOpts, HistogramVec, Opts, Registry};

/// upstream's `kubeProxySubsystem`.
const SUBSYSTEM: &str = "kubeproxy";

/// The `Content-Type` client_golang's promhttp answers a scrape with when it serves the text
/// format (newer prometheus/common appends the name-escaping scheme).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8; escaping=underscores";

/// Label names shared by several families.
pub const IP_FAMILY: &str = "ip_family";
pub const TABLE: &str = "table";
pub const TRAFFIC_POLICY: &str = "traffic_policy";
pub const CODE: &str = "code";

/// Every kube-proxy metric of the newest upstream, as fields. The field names follow the metric
/// names (without the `kubeproxy_` prefix and unit suffix); the doc of each names its labels.
pub struct Metrics {
    registry: Registry,
    /// `sync_proxy_rules_duration_seconds{ip_family}`: every sync, full or partial.
    pub sync_proxy_rules_duration: HistogramVec,
    /// `sync_full_proxy_rules_duration_seconds{ip_family}`.
    pub sync_full_proxy_rules_duration: HistogramVec,
    /// `sync_partial_proxy_rules_duration_seconds{ip_family}`.
    pub sync_partial_proxy_rules_duration: HistogramVec,
    /// `sync_proxy_rules_last_timestamp_seconds{ip_family}`: last successful sync (Unix seconds).
    pub sync_proxy_rules_last_timestamp: GaugeVec,
    /// `sync_proxy_rules_last_queued_timestamp_seconds{ip_family}`: last time a sync was queued.
    pub sync_proxy_rules_last_queued_timestamp: GaugeVec,
    /// `network_programming_duration_seconds{ip_family}`: now − EndpointSlice trigger time.
    pub network_programming_duration: HistogramVec,
    /// `sync_proxy_rules_endpoint_changes_pending`.
    pub endpoint_changes_pending: Gauge,
    /// `sync_proxy_rules_endpoint_changes_total`.
    pub endpoint_changes_total: Counter,
    /// `sync_proxy_rules_service_changes_pending`.
    pub service_changes_pending: Gauge,
    /// `sync_proxy_rules_service_changes_total`.
    pub service_changes_total: Counter,
    /// `sync_proxy_rules_no_local_endpoints_total{ip_family,traffic_policy}` (a gauge despite the
    /// name; `traffic_policy` is `internal` or `external`).
    pub no_local_endpoints: GaugeVec,
    /// `sync_proxy_rules_iptables_restore_failures_total{ip_family}`.
    pub iptables_restore_failures_total: CounterVec,
    /// `sync_proxy_rules_iptables_partial_restore_failures_total{ip_family}`.
    pub iptables_partial_restore_failures_total: CounterVec,
    /// `sync_proxy_rules_iptables_total{ip_family,table}`: rules owned by kube-proxy.
    pub iptables_rules_total: GaugeVec,
    /// `sync_proxy_rules_iptables_last{ip_family,table}`: rules written by the last restore.
    pub iptables_rules_last: GaugeVec,
    /// `sync_proxy_rules_nftables_sync_failures_total{ip_family}` (nftables mode only).
    pub nftables_sync_failures_total: CounterVec,
    /// `sync_proxy_rules_nftables_cleanup_failures_total{ip_family}` (nftables mode only).
    pub nftables_cleanup_failures_total: CounterVec,
    /// `proxy_healthz_total{code}`: answers of `/healthz` on the healthz port.
    pub proxy_healthz_total: CounterVec,
    /// `proxy_livez_total{code}`: answers of `/livez` on the healthz port.
    pub proxy_livez_total: CounterVec,
    /// `conntrack_reconciler_sync_duration_seconds{ip_family}`.
    pub conntrack_reconciler_sync_duration: HistogramVec,
    /// `conntrack_reconciler_deleted_entries_total{ip_family}`.
    pub conntrack_reconciler_deleted_entries_total: CounterVec,
    /// component-base's `kubernetes_feature_enabled{name,stage}`: 1 for an enabled gate, else 0.
    pub feature_enabled: GaugeVec,
}

// === impl Metrics ===

impl Metrics {
    /// Builds every metric and registers the ones upstream's `RegisterMetrics(mode)` registers
    /// for `mode` (`iptables`, `ipvs`, `nftables`; anything else gets only the common set), plus
    /// the process collector.
    pub fn new(mode: &str) -> Metrics {
        let sync_buckets = exponential_buckets(0.001, 2.0, 15);
        let m = Metrics {
            registry: Registry::new(),
            sync_proxy_rules_duration: histogram(
                "sync_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds",
                &sync_buckets,
                &[IP_FAMILY],
            ),
            sync_full_proxy_rules_duration: histogram(
                "sync_full_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for full resyncs",
                &sync_buckets,
                &[IP_FAMILY],
            ),
            sync_partial_proxy_rules_duration: histogram(
                "sync_partial_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for partial resyncs",
                &sync_buckets,
                &[IP_FAMILY],
            ),
            sync_proxy_rules_last_timestamp: gauge_vec(
                "sync_proxy_rules_last_timestamp_seconds",
                "The last time proxy rules were successfully synced",
                &[IP_FAMILY],
            ),
            sync_proxy_rules_last_queued_timestamp: gauge_vec(
                "sync_proxy_rules_last_queued_timestamp_seconds",
                "The last time a sync of proxy rules was queued",
                &[IP_FAMILY],
            ),
            network_programming_duration: histogram(
                "network_programming_duration_seconds",
                "In Cluster Network Programming Latency in seconds",
                &network_programming_buckets(),
                &[IP_FAMILY],
            ),
            endpoint_changes_pending: gauge(
                "sync_proxy_rules_endpoint_changes_pending",
                "Pending proxy rules Endpoint changes",
            ),
            endpoint_changes_total: counter(
                "sync_proxy_rules_endpoint_changes_total",
                "Cumulative proxy rules Endpoint changes",
            ),
            service_changes_pending: gauge(
                "sync_proxy_rules_service_changes_pending",
                "Pending proxy rules Service changes",
            ),
            service_changes_total: counter(
                "sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes",
            ),
            no_local_endpoints: gauge_vec(
                "sync_proxy_rules_no_local_endpoints_total",
                "Number of services with a Local traffic policy and no endpoints",
                &[IP_FAMILY, TRAFFIC_POLICY],
            ),
            iptables_restore_failures_total: counter_vec(
                "sync_proxy_rules_iptables_restore_failures_total",
                "Cumulative proxy iptables restore failures",
                &[IP_FAMILY],
            ),
            iptables_partial_restore_failures_total: counter_vec(
                "sync_proxy_rules_iptables_partial_restore_failures_total",
                "Cumulative proxy iptables partial restore failures",
                &[IP_FAMILY],
            ),
            iptables_rules_total: gauge_vec(
                "sync_proxy_rules_iptables_total",
                "Total number of iptables rules owned by kube-proxy",
                &[IP_FAMILY, TABLE],
            ),
            iptables_rules_last: gauge_vec(
                "sync_proxy_rules_iptables_last",
                "Number of iptables rules written by kube-proxy in last sync",
                &[IP_FAMILY, TABLE],
            ),
            nftables_sync_failures_total: counter_vec(
                "sync_proxy_rules_nftables_sync_failures_total",
                "Cumulative proxy nftables sync failures",
                &[IP_FAMILY],
            ),
            nftables_cleanup_failures_total: counter_vec(
                "sync_proxy_rules_nftables_cleanup_failures_total",
                "Cumulative proxy nftables cleanup failures",
                &[IP_FAMILY],
            ),
            proxy_healthz_total: counter_vec("proxy_healthz_total", "Cumulative proxy healthz HTTP status", &[CODE]),
            proxy_livez_total: counter_vec("proxy_livez_total", "Cumulative proxy livez HTTP status", &[CODE]),
            conntrack_reconciler_sync_duration: histogram(
                "conntrack_reconciler_sync_duration_seconds",
                "ReconcileConntrackFlowsLatency latency in seconds",
                &sync_buckets,
                &[IP_FAMILY],
            ),
            conntrack_reconciler_deleted_entries_total: counter_vec(
                "conntrack_reconciler_deleted_entries_total",
                "Cumulative conntrack flows deleted by conntrack reconciler",
                &[IP_FAMILY],
            ),
            feature_enabled: component_base_gauge(
                "kubernetes_feature_enabled",
                "[BETA] This metric records the data about the stage and enablement of a k8s feature.",
                &["name", "stage"],
            ),
        };
        m.register_for_mode(mode);
        m.register_component_base();
        m
    }

    /// `kubernetes_build_info` (constant 1, labelled with [`BuildInfo::current`]) and
    /// `kubernetes_feature_enabled`, which component-base registers for every component.
    fn register_component_base(&self) {
        let build_info = component_base_gauge(
            "kubernetes_build_info",
            "[BETA] A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree state, build date, Go version, and compiler from which Kubernetes was built, and platform on which it is running.",
            &BuildInfo::LABELS,
        );
        build_info.with_label_values(&BuildInfo::current().values()).set(1.0);
        for c in [build_info, self.feature_enabled.clone()] {
            if let Err(err) = self.registry.register(Box::new(c)) {
                tracing::error!(%err, "failed to register a component-base metric");
            }
        }
    }

    /// Sets `kubernetes_feature_enabled` to the gates in effect (component-base's `AddMetrics`).
    pub fn record_feature_gates(&self, gates: &[GateState]) {
        for g in gates {
            let v = if g.enabled { 1.0 } else { 0.0 };
            self.feature_enabled
                .with_label_values(&[g.name.as_str(), g.stage])
                .set(v);
        }
    }

    /// Exports iptables mode's nfacct counters, read through `nfacct` at every scrape (upstream's
    /// custom collectors). Call it only once the counters exist.
    pub fn register_nfacct(&self, nfacct: Box<dyn Nfacct>) {
        let collector = NfacctCollector::new(nfacct);
        if let Err(err) = self.registry.register(Box::new(collector)) {
            tracing::error!(%err, "failed to register the nfacct metrics");
        }
    }

    /// The registry behind `/metrics`; other components may register their own collectors.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The whole registry in the text exposition format 0.0.4, byte for byte as client_golang's
    /// `expfmt` writes it (families sorted by name, children by label values, Go float format).
    pub fn encode(&self) -> String {
        encode_text(&self.registry.gather())
    }

    fn register_for_mode(&self, mode: &str) {
        // Core metrics for every backend (upstream also registers network programming latency
        // and the no-local-endpoints gauge for all modes, with a FIXME for winkernel).
        let mut collectors: Vec<Box<dyn Collector>> = vec![
            Box::new(self.sync_proxy_rules_duration.clone()),
            Box::new(self.sync_proxy_rules_last_queued_timestamp.clone()),
            Box::new(self.sync_proxy_rules_last_timestamp.clone()),
            Box::new(self.endpoint_changes_pending.clone()),
            Box::new(self.endpoint_changes_total.clone()),
            Box::new(self.service_changes_pending.clone()),
            Box::new(self.service_changes_total.clone()),
            Box::new(self.proxy_healthz_total.clone()),
            Box::new(self.proxy_livez_total.clone()),
            Box::new(self.network_programming_duration.clone()),
            Box::new(self.no_local_endpoints.clone()),
        ];
        let conntrack: [Box<dyn Collector>; 2] = [
            Box::new(self.conntrack_reconciler_sync_duration.clone()),
            Box::new(self.conntrack_reconciler_deleted_entries_total.clone()),
        ];
        match mode {
            "iptables" => {
                collectors.push(Box::new(self.sync_full_proxy_rules_duration.clone()));
                collectors.push(Box::new(self.sync_partial_proxy_rules_duration.clone()));
                collectors.push(Box::new(self.iptables_restore_failures_total.clone()));
                collectors.push(Box::new(self.iptables_partial_restore_failures_total.clone()));
                collectors.push(Box::new(self.iptables_rules_total.clone()));
                collectors.push(Box::new(self.iptables_rules_last.clone()));
                collectors.extend(conntrack);
            }
            "ipvs" => {
                collectors.push(Box::new(self.iptables_restore_failures_total.clone()));
                collectors.extend(conntrack);
            }
            "nftables" => {
                collectors.push(Box::new(self.sync_full_proxy_rules_duration.clone()));
                collectors.push(Box::new(self.sync_partial_proxy_rules_duration.clone()));
                collectors.push(Box::new(self.nftables_sync_failures_total.clone()));
                collectors.push(Box::new(self.nftables_cleanup_failures_total.clone()));
                collectors.extend(conntrack);
            }
            _ => {}
        }
        #[cfg(target_os = "linux")]
        collectors.push(Box::new(prometheus::process_collector::ProcessCollector::for_self()));

        for c in collectors {
            // Names are fixed and distinct, so a failure here is a programming error; log rather
            // than take the process down over a metric.
            if let Err(err) = self.registry.register(c) {
                tracing::error!(%err, "failed to register a kube-proxy metric");
            }
        }
    }
}

/// What `kubernetes_build_info` says about this binary: kube-proxy-rs' own version in
/// component-base's labels. The git and date labels come from the build's environment
/// (`KUBE_PROXY_GIT_COMMIT`, `KUBE_PROXY_GIT_TREE_STATE`, `KUBE_PROXY_BUILD_DATE`), else hold
/// upstream's values for an unstamped build; `compiler` is `rustc`, and `go_version` is empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildInfo {
    pub major: String,
    pub minor: String,
    pub git_version: String,
    pub git_commit: String,
    pub git_tree_state: String,
    pub build_date: String,
    pub go_version: String,
    pub compiler: String,
    pub platform: String,
}

impl BuildInfo {
    /// component-base's label names, in its order.
    pub const LABELS: [&'static str; 9] = [
        "major", "minor", "git_version", "git_commit", "git_tree_state", "build_date", "go_version", "compiler",
        "platform",
    ];

    pub fn current() -> BuildInfo {
        BuildInfo {
            major: env!("CARGO_PKG_VERSION_MAJOR").into(),
            minor: env!("CARGO_PKG_VERSION_MINOR").into(),
            git_version: concat!("v", env!("CARGO_PKG_VERSION")).into(),
            git_commit: option_env!("KUBE_PROXY_GIT_COMMIT").unwrap_or("").into(),
            git_tree_state: option_env!("KUBE_PROXY_GIT_TREE_STATE").unwrap_or("").into(),
            build_date: option_env!("KUBE_PROXY_BUILD_DATE")
                .unwrap_or("1970-01-01T00:00:00Z")
                .into(),
            go_version: String::new(),
            compiler: "rustc".into(),
            platform: format!("{}/{}", std::env::consts::OS, go_arch(std::env::consts::ARCH)),
        }
    }

    /// The label values, in [`BuildInfo::LABELS`] order.
    pub fn values(&self) -> [&str; 9] {
        [
            &self.major, &self.minor, &self.git_version, &self.git_commit, &self.git_tree_state, &self.build_date,
            &self.go_version, &self.compiler, &self.platform,
        ]
    }
}

/// Go's `GOARCH` spelling of Rust's target architecture (what `platform` reads as upstream).
fn go_arch(arch: &str) -> &str {
    match arch {
        "x86_64" => "amd64",
        "x86" => "386",
        "aarch64" => "arm64",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        other => other,
    }
}

/// The two nfacct counters of iptables mode, with upstream's names and HELP texts.
const NFACCT_METRICS: [(&str, &str, &str); 2] = [
    (
        NFACCT_CT_STATE_INVALID,
        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
        "[ALPHA] packets dropped by iptables to work around conntrack problems",
    ),
    (
        NFACCT_LOCALHOST_NODEPORTS,
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
        "[ALPHA] Number of packets accepted on nodeports of loopback interface",
    ),
];

/// Reads the nfacct counters at every scrape, as upstream's custom collectors do; a counter
/// that cannot be read is left out of that scrape (and logged).
struct NfacctCollector {
    nfacct: Mutex<Box<dyn Nfacct>>,
    descs: Vec<Desc>,
}

impl NfacctCollector {
    fn new(nfacct: Box<dyn Nfacct>) -> NfacctCollector {
        let descs = NFACCT_METRICS
            .iter()
            .filter_map(|(_, name, help)| {
                Desc::new(name.to_string(), help.to_string(), vec![], Default::default()).ok()
            })
            .collect();
        NfacctCollector {
            nfacct: Mutex::new(nfacct),
            descs,
        }
    }
}

impl Collector for NfacctCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut nfacct = self.nfacct.lock().unwrap_or_else(|e| e.into_inner());
        let mut families = Vec::new();
        for (counter, name, help) in NFACCT_METRICS {
            match nfacct.get(counter) {
                Ok(c) => families.push(counter_family(name, help, c.packets as f64)),
                Err(err) => tracing::error!(%err, counter, "failed to collect nfacct counter"),
            }
        }
        families
    }
}

/// A family of one unlabelled counter sample.
fn counter_family(name: &str, help: &str, value: f64) -> MetricFamily {
    let mut c = prometheus::proto::Counter::default();
    c.set_value(value);
    let mut m = Metric::default();
    m.set_counter(c);
    let mut mf = MetricFamily::default();
    mf.set_name(name.to_string());
    mf.set_help(help.to_string());
    mf.set_field_type(MetricType::COUNTER);
    mf.set_metric(vec![m]);
    mf
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

// === constructors (component-base style: subsystem + stability prefix) ===

/// component-base's `annotateStabilityLevel`: every kube-proxy metric is ALPHA.
fn alpha(help: &str) -> String {
    format!("[ALPHA] {help}")
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, alpha(help)).subsystem(SUBSYSTEM)
}

fn histogram(name: &str, help: &str, buckets: &[f64], labels: &[&str]) -> HistogramVec {
    let o = HistogramOpts::new(name, alpha(help))
        .subsystem(SUBSYSTEM)
        .buckets(buckets.to_vec());
    HistogramVec::new(o, labels).expect("static histogram definition is valid")
}

/// A component-base gauge: no subsystem, the stability prefix already in `help`.
fn component_base_gauge(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    GaugeVec::new(Opts::new(name, help), labels).expect("static gauge definition is valid")
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    GaugeVec::new(opts(name, help), labels).expect("static gauge definition is valid")
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> CounterVec {
    CounterVec::new(opts(name, help), labels).expect("static counter definition is valid")
}

fn gauge(name: &str, help: &str) -> Gauge {
    Gauge::with_opts(opts(name, help)).expect("static gauge definition is valid")
}

fn counter(name: &str, help: &str) -> Counter {
    Counter::with_opts(opts(name, help)).expect("static counter definition is valid")
}

/// client_golang's `ExponentialBuckets`: repeated multiplication, as Go computes it.
fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    let mut next = start;
    (0..count)
        .map(|_| {
            let b = next;
            next *= factor;
            b
        })
        .collect()
}

/// client_golang's `LinearBuckets`: repeated addition, as Go computes it.
fn linear_buckets(start: f64, width: f64, count: usize) -> Vec<f64> {
    let mut next = start;
    (0..count)
        .map(|_| {
            let b = next;
            next += width;
            b
        })
        .collect()
}

/// upstream's network programming buckets. component-base's `MergeBuckets` starts from a
/// one-element zero slice, so the histogram has an `le="0"` bucket before 0.25.
fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.0];
    b.extend(linear_buckets(0.25, 0.25, 2)); // 0.25s, 0.5s
    b.extend(linear_buckets(1.0, 1.0, 59)); // 1s … 59s
    b.extend(linear_buckets(60.0, 5.0, 12)); // 60s … 115s
    b.extend(linear_buckets(120.0, 30.0, 7)); // 2min … 5min
    b
}

// === text exposition (prometheus/common expfmt, format 0.0.4) ===

/// Writes metric families the way client_golang's `expfmt.MetricFamilyToText` does. The
/// `prometheus` crate's own `TextEncoder` agrees on structure but prints floats with Rust's
/// `Display` (`1700000000`, `0.00001`) where Go prints `1.7e+09`, `1e-05`.
pub fn encode_text(families: &[MetricFamily]) -> String {
    let mut out = String::new();
    for mf in families {
        if mf.get_metric().is_empty() {
            continue;
        }
        let name = mf.name();
        if !mf.help().is_empty() {
            out.push_str("# HELP ");
            out.push_str(name);
            out.push(' ');
            out.push_str(&escape(mf.help(), false));
            out.push('\n');
        }
        let kind = mf.get_field_type();
        out.push_str("# TYPE ");
        out.push_str(name);
        out.push(' ');
        out.push_str(match kind {
            MetricType::COUNTER => "counter",
            MetricType::GAUGE => "gauge",
            MetricType::SUMMARY => "summary",
            MetricType::UNTYPED => "untyped",
            MetricType::HISTOGRAM => "histogram",
        });
        out.push('\n');
        for m in mf.get_metric() {
            write_metric(&mut out, name, kind, m);
        }
    }
    out
}

fn write_metric(out: &mut String, name: &str, kind: MetricType, m: &Metric) {
    match kind {
        MetricType::COUNTER => sample(out, name, "", m.get_label(), None, m.get_counter().get_value()),
        MetricType::GAUGE => sample(out, name, "", m.get_label(), None, m.get_gauge().get_value()),
        // The crate never produces untyped samples itself; a custom collector might.
        #[allow(deprecated)]
        MetricType::UNTYPED => sample(out, name, "", m.get_label(), None, m.get_untyped().get_value()),
        MetricType::SUMMARY => {
            let s = m.get_summary();
            for q in s.get_quantile() {
                let le = format_float(q.quantile());
                sample(out, name, "", m.get_label(), Some(("quantile", &le)), q.value());
            }
            sample(out, name, "_sum", m.get_label(), None, s.sample_sum());
            sample(out, name, "_count", m.get_label(), None, s.sample_count() as f64);
        }
        MetricType::HISTOGRAM => {
            let h = m.get_histogram();
            let mut inf_seen = false;
            for b in h.get_bucket() {
                let le = format_float(b.upper_bound());
                sample(
                    out,
                    name,
                    "_bucket",
                    m.get_label(),
                    Some(("le", &le)),
                    b.cumulative_count() as f64,
                );
                inf_seen |= b.upper_bound() == f64::INFINITY;
            }
            if !inf_seen {
                let count = h.get_sample_count() as f64;
                sample(out, name, "_bucket", m.get_label(), Some(("le", "+Inf")), count);
            }
            sample(out, name, "_sum", m.get_label(), None, h.get_sample_sum());
            sample(out, name, "_count", m.get_label(), None, h.get_sample_count() as f64);
        }
    }
}

fn sample(out: &mut String, name: &str, suffix: &str, labels: &[LabelPair], extra: Option<(&str, &str)>, v: f64) {
    out.push_str(name);
    out.push_str(suffix);
    let mut sep = '{';
    for lp in labels.iter().map(|l| (l.name(), l.value())).chain(extra) {
        out.push(sep);
        out.push_str(lp.0);
        out.push_str("=\"");
        out.push_str(&escape(lp.1, true));
        out.push('"');
        sep = ',';
    }
    if sep == ',' {
        out.push('}');
    }
    out.push(' ');
    out.push_str(&format_float(v));
    out.push('\n');
}

/// expfmt's escaping: `\` and newline always, `"` inside label values.
fn escape(s: &str, quote: bool) -> std::borrow::Cow<'_, str> {
    let needs_escape = s.contains(['\\', '\n']) || (quote && s.contains('"'));
    if !needs_escape {
        return s.into();
    }
    let mut e = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        match c {
            '\\' => e.push_str("\\\\"),
            '\n' => e.push_str("\\n"),
            '"' if quote => e.push_str("\\\""),
            c => e.push(c),
        }
    }
    e.into()
}

/// expfmt's `writeFloat`: special cases, then `strconv.FormatFloat(f, 'g', -1, 64)`.
///
/// Go's shortest `%g` uses the exponent form when the decimal exponent is below -4 or at least
/// 6 (`1e+06`, `1.7e+09`, `1e-05`), with a signed, at-least-two-digit exponent.
pub fn format_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    if f == 0.0 {
        return "0".into();
    }
    // Rust's `{:e}` yields the same shortest round-trip digits as Go's `'g', -1`.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if !(-4..6).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    // Plain decimal: place the point `exp + 1` digits into the digit string.
    let point = exp + 1;
    if point <= 0 {
        let zeros = "0".repeat(point.unsigned_abs() as usize);
        format!("{sign}0.{zeros}{digits}")
    } else {
        let point = point as usize;
        if digits.len() <= point {
            format!("{sign}{digits}{}", "0".repeat(point - digits.len()))
        } else {
            format!("{sign}{}.{}", &digits[..point], &digits[point..])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, TYPE) of every kube-proxy family upstream registers in iptables mode.
    const IPTABLES_FAMILIES: &[(&str, &str)] = &[
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_full_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_partial_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
        ("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "gauge"),
        ("kubeproxy_network_programming_duration_seconds", "histogram"),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", "gauge"),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_total", "counter"),
        ("kubeproxy_sync_proxy_rules_service_changes_pending", "gauge"),
        ("kubeproxy_sync_proxy_rules_service_changes_total", "counter"),
        ("kubeproxy_sync_proxy_rules_no_local_endpoints_total", "gauge"),
        ("kubeproxy_sync_proxy_rules_iptables_restore_failures_total", "counter"),
        (
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
            "counter",
        ),
        ("kubeproxy_sync_proxy_rules_iptables_total", "gauge"),
        ("kubeproxy_sync_proxy_rules_iptables_last", "gauge"),
        ("kubeproxy_proxy_healthz_total", "counter"),
        ("kubeproxy_proxy_livez_total", "counter"),
        ("kubeproxy_conntrack_reconciler_sync_duration_seconds", "histogram"),
        ("kubeproxy_conntrack_reconciler_deleted_entries_total", "counter"),
    ];

    /// Creates one child in every labelled family, as a running proxier would.
    fn touch_all(m: &Metrics) {
        let v4 = ["IPv4"];
        for h in [
            &m.sync_proxy_rules_duration, &m.sync_full_proxy_rules_duration, &m.sync_partial_proxy_rules_duration,
            &m.network_programming_duration, &m.conntrack_reconciler_sync_duration,
        ] {
            h.with_label_values(&v4).observe(0.02);
        }
        m.sync_proxy_rules_last_timestamp
            .with_label_values(&v4)
            .set(1_700_000_000.5);
        m.sync_proxy_rules_last_queued_timestamp
            .with_label_values(&v4)
            .set(1_700_000_000.25);
        m.no_local_endpoints.with_label_values(&["IPv4", "internal"]).set(0.0);
        for c in [
            &m.iptables_restore_failures_total,
            &m.iptables_partial_restore_failures_total,
            &m.nftables_sync_failures_total,
            &m.nftables_cleanup_failures_total,
            &m.conntrack_reconciler_deleted_entries_total,
        ] {
            c.with_label_values(&v4).inc();
        }
        m.iptables_rules_total.with_label_values(&["IPv4", "nat"]).set(12.0);
        m.iptables_rules_last.with_label_values(&["IPv4", "filter"]).set(3.0);
        m.proxy_healthz_total.with_label_values(&["200"]).inc();
        m.proxy_livez_total.with_label_values(&["503"]).inc();
    }

    #[test]
    fn encode_lists_every_upstream_iptables_metric_with_its_type() {
        let m = Metrics::new("iptables");
        touch_all(&m);
        let text = m.encode();
        for (name, kind) in IPTABLES_FAMILIES {
            assert!(
                text.contains(&format!("\n# TYPE {name} {kind}\n")),
                "missing TYPE of {name}:\n{text}"
            );
            assert!(
                text.contains(&format!("# HELP {name} [ALPHA] ")),
                "missing HELP of {name}"
            );
        }
        assert!(!text.contains("nftables"), "nftables metrics leak into iptables mode");
        assert!(text.contains("kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"nat\"} 12\n"));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 1\n"));
    }

    #[test]
    fn help_texts_match_upstream() {
        let m = Metrics::new("iptables");
        touch_all(&m);
        let text = m.encode();
        for line in [
            "# HELP kubeproxy_sync_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency in seconds",
            "# HELP kubeproxy_sync_proxy_rules_no_local_endpoints_total [ALPHA] Number of services with a Local traffic policy and no endpoints",
            "# HELP kubeproxy_sync_proxy_rules_iptables_last [ALPHA] Number of iptables rules written by kube-proxy in last sync",
            "# HELP kubeproxy_conntrack_reconciler_deleted_entries_total [ALPHA] Cumulative conntrack flows deleted by conntrack reconciler",
        ] {
            assert!(text.contains(&format!("{line}\n")), "missing {line}");
        }
    }

    #[test]
    fn unlabelled_families_are_exported_from_the_start_and_vectors_only_once_used() {
        let text = Metrics::new("iptables").encode();
        assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 0\n"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_service_changes_pending 0\n"));
        assert!(!text.contains("kubeproxy_sync_proxy_rules_duration_seconds"));
    }

    #[test]
    fn mode_selects_backend_specific_families() {
        let nft = Metrics::new("nftables");
        touch_all(&nft);
        let text = nft.encode();
        assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_nftables_sync_failures_total counter\n"));
        assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total counter\n"));
        assert!(text.contains("# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram\n"));
        assert!(!text.contains("kubeproxy_sync_proxy_rules_iptables_"));

        let ipvs = Metrics::new("ipvs");
        touch_all(&ipvs);
        let text = ipvs.encode();
        assert!(text.contains("kubeproxy_sync_proxy_rules_iptables_restore_failures_total{"));
        assert!(!text.contains("kubeproxy_sync_partial_proxy_rules_duration_seconds"));
        assert!(!text.contains("kubeproxy_sync_proxy_rules_iptables_total"));
    }

    #[test]
    fn histogram_buckets_match_upstream() {
        let m = Metrics::new("iptables");
        touch_all(&m);
        let text = m.encode();
        let bucket = |name: &str, le: &str| format!("{name}_bucket{{ip_family=\"IPv4\",le=\"{le}\"}}");
        let sync = "kubeproxy_sync_proxy_rules_duration_seconds";
        for le in ["0.001", "0.016", "1.024", "16.384", "+Inf"] {
            assert!(text.contains(&bucket(sync, le)), "{sync} lacks le={le}");
        }
        assert!(!text.contains(&bucket(sync, "32.768")));
        let npl = "kubeproxy_network_programming_duration_seconds";
        for le in ["0", "0.25", "0.5", "1", "59", "60", "115", "120", "300", "+Inf"] {
            assert!(text.contains(&bucket(npl, le)), "{npl} lacks le={le}");
        }
        assert_eq!(network_programming_buckets().len(), 1 + 2 + 59 + 12 + 7);
    }

    #[test]
    fn floats_are_formatted_like_go() {
        for (f, want) in [
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-1.0, "-1"),
            (0.001, "0.001"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (16.384, "16.384"),
            (123456.0, "123456"),
            (1_000_000.0, "1e+06"),
            (1_234_567.0, "1.234567e+06"),
            (1_700_000_000.5, "1.7000000005e+09"),
            (1.5e300, "1.5e+300"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(format_float(f), want, "format_float({f})");
        }
    }

    #[test]
    fn encoder_agrees_with_the_crate_encoder_on_small_integers() {
        // Structure (ordering, escaping, bucket lines) must match prometheus::TextEncoder, which
        // differs from Go only in float spelling; small integers are spelled the same.
        let m = Metrics::new("iptables");
        m.proxy_healthz_total.with_label_values(&["200"]).inc_by(3.0);
        m.iptables_rules_total.with_label_values(&["IPv6", "filter"]).set(7.0);
        m.sync_proxy_rules_duration.with_label_values(&["IPv6"]).observe(2.0);
        let families: Vec<_> = m
            .registry()
            .gather()
            .into_iter()
            .filter(|f| f.name().starts_with("kubeproxy_"))
            .collect();
        let ours = encode_text(&families);
        let theirs = prometheus::TextEncoder::new()
            .encode_to_string(&families)
            .expect("encodes");
        assert_eq!(ours, theirs);
    }

    #[test]
    fn component_base_metrics_are_exported_as_component_base_writes_them() {
        let m = Metrics::new("nftables");
        m.record_feature_gates(&[
            GateState {
                name: "LoggingAlphaOptions".into(),
                stage: "ALPHA",
                enabled: false,
            },
            GateState {
                name: "NFTablesProxyMode".into(),
                stage: "",
                enabled: true,
            },
        ]);
        let text = m.encode();
        let b = BuildInfo::current();
        for line in [
            "# HELP kubernetes_build_info [BETA] A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree state, build date, Go version, and compiler from which Kubernetes was built, and platform on which it is running.\n# TYPE kubernetes_build_info gauge\n".to_string(),
            format!(
                "kubernetes_build_info{{build_date=\"{}\",compiler=\"rustc\",git_commit=\"{}\",git_tree_state=\"{}\",git_version=\"v{}\",go_version=\"\",major=\"{}\",minor=\"{}\",platform=\"{}\"}} 1\n",
                b.build_date,
                b.git_commit,
                b.git_tree_state,
                env!("CARGO_PKG_VERSION"),
                b.major,
                b.minor,
                b.platform
            ),
            "# HELP kubernetes_feature_enabled [BETA] This metric records the data about the stage and enablement of a k8s feature.\n# TYPE kubernetes_feature_enabled gauge\n".to_string(),
            "kubernetes_feature_enabled{name=\"LoggingAlphaOptions\",stage=\"ALPHA\"} 0\nkubernetes_feature_enabled{name=\"NFTablesProxyMode\",stage=\"\"} 1\n".to_string(),
        ] {
            assert!(text.contains(&line), "missing {line}in:\n{text}");
        }
        if cfg!(all(target_os = "linux", target_arch = "x86_64")) {
            assert_eq!(b.platform, "linux/amd64");
        }
    }

    #[test]
    fn nfacct_counters_are_read_at_every_scrape() {
        use crate::iptables::nfacct::Fake;
        let m = Metrics::new("iptables");
        assert!(
            !m.encode().contains("kubeproxy_iptables_ct_state"),
            "absent until registered"
        );
        let mut fake = Fake::default();
        fake.counters.insert(NFACCT_CT_STATE_INVALID.into(), 7);
        fake.counters.insert(NFACCT_LOCALHOST_NODEPORTS.into(), 2);
        m.register_nfacct(Box::new(fake));
        let text = m.encode();
        for line in [
            "# HELP kubeproxy_iptables_ct_state_invalid_dropped_packets_total [ALPHA] packets dropped by iptables to work around conntrack problems\n# TYPE kubeproxy_iptables_ct_state_invalid_dropped_packets_total counter\nkubeproxy_iptables_ct_state_invalid_dropped_packets_total 7\n",
            "# HELP kubeproxy_iptables_localhost_nodeports_accepted_packets_total [ALPHA] Number of packets accepted on nodeports of loopback interface\n# TYPE kubeproxy_iptables_localhost_nodeports_accepted_packets_total counter\nkubeproxy_iptables_localhost_nodeports_accepted_packets_total 2\n",
        ] {
            assert!(text.contains(line), "missing {line}in:\n{text}");
        }
        // A counter the kernel cannot report is left out of the scrape; the rest still shows.
        let m = Metrics::new("iptables");
        let mut fake = Fake::default();
        fake.counters.insert(NFACCT_LOCALHOST_NODEPORTS.into(), 1);
        m.register_nfacct(Box::new(fake));
        let text = m.encode();
        assert!(!text.contains("kubeproxy_iptables_ct_state_invalid"), "{text}");
        assert!(text.contains("kubeproxy_iptables_localhost_nodeports_accepted_packets_total 1\n"));
    }

    #[test]
    fn escaping_follows_expfmt() {
        assert_eq!(escape("a\\b\nc\"d", true), "a\\\\b\\nc\\\"d");
        assert_eq!(escape("a\"b", false), "a\"b");
    }
}
