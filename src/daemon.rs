//! The node daemon: reads Services, EndpointSlices and the Node from its source (the API
//! server or a manifest directory), and keeps the kernel's rules in sync through a
//! bounded-frequency loop like upstream's runner: changes are coalesced and applied no more
//! often than `minSyncPeriod`; every `syncPeriod` the canary chains are checked (a flushed or
//! reloaded table forces a full sync) and a failed sync is retried as a full one; the previous
//! rules stay in place meanwhile. It also feeds the healthz state, the metrics and the
//! health-check node ports, whose servers run on a small runtime of their own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::Context;
use tracing::{debug, error, info, warn};

use crate::app;
use crate::config::{ProxyConfig, ProxyMode};
use crate::conntrack::{self, UdpServices};
use crate::healthz::ProxyHealth;
use crate::http::{self, ServiceHealthServers, ServiceKey};
use crate::iptables::IptablesRenderOptions;
use crate::iptables::exec::Exec;
use crate::iptables::proxier::{Proxier, cleanup};
use crate::ipvs::host::HostExec;
use crate::ipvs::netlink::IpvsHandle;
use crate::ipvs::proxier::IpvsProxier;
use crate::ipvs::render::IpvsRenderOptions;
use crate::kube_source::ApiSource;
use crate::metrics::Metrics;
use crate::model::{IpFamily, NodeInfo, ProxyState, StateBuilder, Store};
use crate::nftables::{self, proxier::NftProxier};
use crate::proxy::{NodePortAddresses, RenderOptions, SyncReport};
use crate::source::{self, ManifestSource};

/// Where Services, EndpointSlices and the Node come from.
#[derive(Clone, Debug)]
pub enum SourceConfig {
    /// `--manifests DIR`: a directory of manifests, re-read on change.
    Manifests(PathBuf),
    /// The Kubernetes API (`--kubeconfig`, `--master`, in-cluster config otherwise).
    Api(ApiConfig),
}

/// How to reach the API server (upstream's `clientConnection` plus `--master`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ApiConfig {
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
    pub qps: f32,
    pub burst: i32,
    pub content_type: String,
}

/// What the daemon runs on.
#[derive(Clone, Debug)]
pub struct DaemonOptions {
    pub config: ProxyConfig,
    pub source: SourceConfig,
}

impl DaemonOptions {
    /// The HTTP servers of this configuration.
    pub fn servers(&self) -> ServerConfig {
        let c = &self.config;
        ServerConfig {
            healthz: c.healthz_bind_address,
            metrics: c.metrics_bind_address,
            hard_fail: c.bind_address_hard_fail,
            configz: serde_json::to_value(&c.effective).unwrap_or_default(),
        }
    }
}

/// The families this node programs: IPv4, plus IPv6 when its tools exist (upstream runs both).
pub fn families() -> Vec<IpFamily> {
    let mut v = vec![IpFamily::V4];
    if Exec::available(IpFamily::V6) {
        v.push(IpFamily::V6);
    }
    v
}

/// IPVS mode's proxier on the real kernel and tools.
type IpvsDataplane = IpvsProxier<IpvsHandle, Exec, HostExec>;

/// The dataplane of one family.
enum Dataplane {
    Iptables(Box<Proxier<Exec>>),
    Nftables(Box<NftProxier>),
    Ipvs(Box<IpvsDataplane>),
}

impl Dataplane {
    fn new(cfg: &ProxyConfig, family: IpFamily, objects: &Store) -> anyhow::Result<Dataplane> {
        Ok(match cfg.mode {
            ProxyMode::Nftables => Dataplane::Nftables(Box::new(NftProxier::netlink(
                family,
                nft_options(cfg, family, objects),
            )?)),
            ProxyMode::Ipvs => {
                let ipvs = IpvsHandle::new().context("IPVS mode")?;
                Dataplane::Ipvs(Box::new(IpvsProxier::new(
                    family,
                    ipvs_options(cfg, family, objects),
                    ipvs,
                    Exec::new(family),
                    HostExec,
                )))
            }
            ProxyMode::Iptables => {
                Dataplane::Iptables(Box::new(Proxier::new(Exec::new(family), options(cfg, family, objects))))
            }
        })
    }

    /// Our canaries (iptables), our table (nftables), or our entry jump and dummy link (IPVS)
    /// are still there.
    fn intact(&mut self) -> bool {
        match self {
            Dataplane::Iptables(p) => p.canaries_intact(),
            Dataplane::Nftables(p) => p.table_exists(),
            Dataplane::Ipvs(p) => p.intact(),
        }
    }

    /// When a sync is due without any change (nftables: deleting chains flushed earlier; IPVS:
    /// re-checking real servers that drain).
    fn cleanup_due(&self) -> Option<Instant> {
        match self {
            Dataplane::Iptables(_) => None,
            Dataplane::Nftables(p) => p.next_cleanup(),
            Dataplane::Ipvs(p) => p.next_cleanup(),
        }
    }

    /// Whether each sync period brings a sync even without a change: IPVS mode, whose NodePort
    /// virtual servers follow the node's interface addresses, which nothing watched reports
    /// (upstream's periodic syncs re-read them too). A sync that renders what is applied
    /// changes nothing.
    fn syncs_periodically(&self) -> bool {
        matches!(self, Dataplane::Ipvs(_))
    }

    fn force_full_sync(&mut self) {
        match self {
            Dataplane::Iptables(p) => p.force_full_sync(),
            Dataplane::Nftables(p) => p.force_full_sync(),
            Dataplane::Ipvs(p) => p.force_full_sync(),
        }
    }

    fn set_options(&mut self, cfg: &ProxyConfig, family: IpFamily, objects: &Store) {
        match self {
            Dataplane::Iptables(p) => p.set_options(options(cfg, family, objects)),
            Dataplane::Nftables(p) => p.set_options(nft_options(cfg, family, objects)),
            Dataplane::Ipvs(p) => p.set_options(ipvs_options(cfg, family, objects)),
        }
    }

    /// One sync; on failure, whether it was a full one.
    fn sync(&mut self, state: &ProxyState) -> Result<SyncReport, (String, bool)> {
        match self {
            Dataplane::Iptables(p) => p.sync(state).map_err(|e| (e.to_string(), p.last_attempt_full())),
            Dataplane::Nftables(p) => p.sync(state).map_err(|e| (e.to_string(), true)),
            Dataplane::Ipvs(p) => p.sync(state).map_err(|e| (e.to_string(), true)),
        }
    }
}

struct FamilyProxier {
    family: IpFamily,
    proxier: Dataplane,
    /// A sync of this family is due (a change arrived, or the last attempt failed).
    pending: bool,
}

/// A running source of objects.
enum Source {
    Manifests {
        src: ManifestSource,
        _watcher: notify::RecommendedWatcher,
    },
    Api(ApiSource),
}

impl Source {
    /// The current objects; `None` until the first complete view.
    fn snapshot(&mut self) -> Option<Store> {
        match self {
            Source::Manifests { src, .. } => Some(reload(src)),
            Source::Api(api) => api.snapshot(),
        }
    }
}

/// Runs until the source fails; never returns on success.
pub fn run(opts: DaemonOptions) -> anyhow::Result<()> {
    let cfg = &opts.config;
    let node_name = cfg.node_name();
    if cfg.mode == ProxyMode::Ipvs {
        // Never a silent fallback: without IPVS or the scheduler's module, refuse to start
        // (before anything on the node is touched).
        let scheduler = ipvs_options(cfg, IpFamily::V4, &Store::default()).scheduler;
        crate::ipvs::proxier::check_kernel(&scheduler)?;
    }
    info!(mode = cfg.mode.as_str(), node = %node_name, "Starting kube-proxy");
    let warnings = conntrack::apply_sysctls_and_hashsize(
        &cfg.conntrack,
        std::path::Path::new("/proc/sys"),
        Some(std::path::Path::new(conntrack::HASHSIZE_PATH)),
        conntrack::detect_num_cpus(),
    );
    for w in warnings {
        warn!("{w}");
    }

    let telemetry = Telemetry::start(cfg, &opts.servers(), &node_name)?;
    let is_api = matches!(opts.source, SourceConfig::Api(_));
    let (tx, rx) = mpsc::channel();
    let mut source = match &opts.source {
        SourceConfig::Manifests(dir) => {
            info!(manifests = %dir.display(), "Reading Services and EndpointSlices from manifests");
            let watcher = source::watch(dir, tx).with_context(|| format!("watching {}", dir.display()))?;
            Source::Manifests {
                src: ManifestSource::new(dir, &node_name),
                _watcher: watcher,
            }
        }
        SourceConfig::Api(api) => Source::Api(ApiSource::start(api, &node_name, tx)?),
    };
    let mut objects = source.snapshot();
    if objects.is_none() {
        info!("Not syncing rules until Services and Endpoints have been received from master");
    }

    // Rules of the mode not in use are removed, as upstream does at start.
    remove_other_modes(cfg.mode);
    let mut proxiers: Vec<FamilyProxier> = families()
        .into_iter()
        .map(|family| {
            Ok(FamilyProxier {
                family,
                proxier: Dataplane::new(cfg, family, &Store::default())?,
                pending: true,
            })
        })
        .collect::<anyhow::Result<_>>()?;

    // Re-merges only the Services that changed since the last sync (both families).
    let mut states_builder = StateBuilder::new();
    let mut last_sync: Option<Instant> = None;
    let mut retry_at: Option<Instant> = None;
    let mut next_check = Instant::now() + cfg.sync_period;
    loop {
        let now = Instant::now();
        let pending = objects.is_some() && proxiers.iter().any(|p| p.pending);
        let earliest = last_sync.map_or(now, |t| t + cfg.min_sync_period);
        let cleanup = proxiers.iter().filter_map(|p| p.proxier.cleanup_due()).min();
        let wake = if pending {
            retry_at.unwrap_or(earliest).max(earliest)
        } else {
            cleanup.map_or(next_check, |c| c.min(next_check))
        };
        match rx.recv_timeout(wake.saturating_duration_since(now)) {
            Ok(()) => {
                // Coalesce a burst of changes into one snapshot.
                while rx.try_recv().is_ok() {}
                let next = source.snapshot();
                let diff = next
                    .as_ref()
                    .map(|n| n.changes_since(objects.as_ref().unwrap_or(&Store::default())));
                if let (Some(next), Some(diff)) = (next, diff)
                    && (objects.is_none() || diff.any())
                {
                    telemetry.changed(diff.services, diff.slices, diff.triggers);
                    objects = Some(next);
                    for p in &mut proxiers {
                        p.pending = true;
                    }
                    telemetry.queued(&proxiers.iter().map(|p| p.family).collect::<Vec<_>>());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => anyhow::bail!("the source of Services stopped"),
        }
        let Some(current) = objects.as_ref() else { continue };
        let now = Instant::now();
        for p in &mut proxiers {
            if p.proxier.cleanup_due().is_some_and(|t| t <= now) {
                p.pending = true;
            }
        }
        if now >= next_check {
            next_check = now + cfg.sync_period;
            for p in &mut proxiers {
                if !p.proxier.intact() {
                    warn!(ip_family = %p.family, "Canary chains or jump rules are missing (tables flushed or reloaded by someone else); doing a full sync");
                    p.proxier.force_full_sync();
                    p.pending = true;
                }
                p.pending |= p.proxier.syncs_periodically();
            }
        }
        if !proxiers.iter().any(|p| p.pending) || now < earliest || retry_at.is_some_and(|t| now < t) {
            continue;
        }
        last_sync = Some(now);
        retry_at = None;
        ensure_route_localnet(cfg, current);
        let node = current
            .nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(node_name.as_str()));
        // Upstream counts a missing Node as not eligible; a manifest directory need not hold one.
        if is_api || node.is_some() {
            telemetry.health.sync_node(node);
        }
        let mut states = Vec::new();
        for p in proxiers.iter_mut().filter(|p| p.pending) {
            p.proxier.set_options(cfg, p.family, current);
            match sync_family(cfg, p, current, &mut states_builder) {
                Ok((state, report)) => {
                    telemetry.synced(p.family, &report);
                    p.pending = false;
                    states.push(state);
                }
                Err(full) => {
                    telemetry.failed(p.family, full);
                    retry_at = Some(Instant::now() + cfg.sync_period);
                }
            }
        }
        if !states.is_empty() {
            telemetry.sync_service_health(&states);
        }
        if proxiers.iter().all(|p| !p.pending) {
            telemetry.all_synced(&proxiers.iter().map(|p| p.family).collect::<Vec<_>>());
        }
    }
}

/// Where the HTTP servers listen (upstream's healthzBindAddress, metricsBindAddress,
/// bindAddressHardFail); `None` disables a server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub healthz: Option<SocketAddr>,
    pub metrics: Option<SocketAddr>,
    pub hard_fail: bool,
    /// What `/configz` shows under `kubeproxy.config.k8s.io`.
    pub configz: serde_json::Value,
}

/// Health, metrics and the health-check node ports, shared by the sync loop and the servers.
struct Telemetry {
    health: ProxyHealth,
    metrics: Arc<Metrics>,
    service_health: ServiceHealthServers,
    runtime: tokio::runtime::Runtime,
    /// Trigger times of EndpointSlice changes not yet synced.
    triggers: std::sync::Mutex<Vec<std::time::SystemTime>>,
}

impl Telemetry {
    fn start(cfg: &ProxyConfig, servers: &ServerConfig, node_name: &str) -> anyhow::Result<Telemetry> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kube-proxy-http")
            .enable_all()
            .build()
            .context("starting the HTTP runtime")?;
        // Upstream: unhealthy when a queued update waits longer than 2 × syncPeriod.
        let health = ProxyHealth::new(cfg.sync_period * 2);
        let metrics = Arc::new(Metrics::new(cfg.mode.as_str()));
        let bind = |addr: SocketAddr, what: &str| -> anyhow::Result<Option<tokio::net::TcpListener>> {
            match runtime.block_on(tokio::net::TcpListener::bind(addr)) {
                Ok(l) => {
                    info!(address = %addr, server = what, "Serving");
                    Ok(Some(l))
                }
                Err(e) if servers.hard_fail => Err(e).with_context(|| format!("binding the {what} server to {addr}")),
                Err(e) => {
                    error!(address = %addr, server = what, error = %e, "Could not bind; continuing without it (set --bind-address-hard-fail to exit instead)");
                    Ok(None)
                }
            }
        };
        if let Some(addr) = servers.healthz
            && let Some(listener) = bind(addr, "healthz")?
        {
            let router = http::healthz_router(health.clone(), metrics.clone());
            runtime.spawn(http::serve(listener, router, std::future::pending()));
        }
        if let Some(addr) = servers.metrics
            && let Some(listener) = bind(addr, "metrics")?
        {
            let router = http::metrics_router(
                metrics.clone(),
                health.clone(),
                cfg.mode.as_str(),
                servers.configz.clone(),
            );
            runtime.spawn(http::serve(listener, router, std::future::pending()));
        }
        let addresses = health_check_addresses(cfg);
        let service_health = ServiceHealthServers::new(node_name, addresses, health.clone());
        Ok(Telemetry {
            health,
            metrics,
            service_health,
            runtime,
            triggers: std::sync::Mutex::new(Vec::new()),
        })
    }

    fn queued(&self, families: &[IpFamily]) {
        for f in families {
            self.health.queued_update(*f);
            self.metrics
                .sync_proxy_rules_last_queued_timestamp
                .with_label_values(&[f.as_str()])
                .set(unix_now());
        }
    }

    fn changed(&self, services: usize, slices: usize, triggers: Vec<std::time::SystemTime>) {
        self.metrics.service_changes_total.inc_by(services as f64);
        self.metrics.endpoint_changes_total.inc_by(slices as f64);
        self.metrics.service_changes_pending.add(services as f64);
        self.metrics.endpoint_changes_pending.add(slices as f64);
        if let Ok(mut pending) = self.triggers.lock() {
            pending.extend(triggers);
        }
    }

    /// After a sync of every family: pending changes are applied; the network-programming
    /// latency of each changed EndpointSlice is observed.
    fn all_synced(&self, families: &[IpFamily]) {
        self.metrics.service_changes_pending.set(0.0);
        self.metrics.endpoint_changes_pending.set(0.0);
        let triggers = self
            .triggers
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        let now = std::time::SystemTime::now();
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

    fn synced(&self, family: IpFamily, report: &SyncReport) {
        let f = [family.as_str()];
        let secs = report.elapsed.as_secs_f64();
        self.metrics
            .sync_proxy_rules_duration
            .with_label_values(&f)
            .observe(secs);
        if report.full {
            self.metrics
                .sync_full_proxy_rules_duration
                .with_label_values(&f)
                .observe(secs);
        } else {
            self.metrics
                .sync_partial_proxy_rules_duration
                .with_label_values(&f)
                .observe(secs);
        }
        self.metrics
            .sync_proxy_rules_last_timestamp
            .with_label_values(&f)
            .set(unix_now());
        self.health.updated(family);
    }

    fn failed(&self, family: IpFamily, full: bool) {
        let f = [family.as_str()];
        self.metrics.iptables_restore_failures_total.with_label_values(&f).inc();
        if !full {
            self.metrics
                .iptables_partial_restore_failures_total
                .with_label_values(&f)
                .inc();
        }
    }

    /// Health-check node ports of ETP-Local LoadBalancers and their local ready endpoints.
    fn sync_service_health(&self, states: &[ProxyState]) {
        let mut ports: BTreeMap<ServiceKey, u16> = BTreeMap::new();
        let mut local: BTreeMap<ServiceKey, BTreeSet<std::net::IpAddr>> = BTreeMap::new();
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
        for e in self.runtime.block_on(self.service_health.sync_services(ports)) {
            warn!(error = %e, "Health-check node port");
        }
        self.service_health
            .sync_endpoints(local.into_iter().map(|(k, v)| (k, v.len())).collect());
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Health-check servers listen on the wildcard address. (Upstream restricts them to the
/// node's addresses within specific nodePortAddresses CIDRs; not done yet.)
fn health_check_addresses(_cfg: &ProxyConfig) -> Vec<std::net::IpAddr> {
    Vec::new()
}

fn reload(src: &mut ManifestSource) -> Store {
    let start = Instant::now();
    let snapshot = src.reload();
    for m in &snapshot.messages {
        warn!("{m}");
    }
    debug!(
        services = snapshot.store.services.len(),
        slices = snapshot.store.slices.len(),
        elapsed_ms = start.elapsed().as_secs_f64() * 1000.0,
        "Read the manifests"
    );
    snapshot.store
}

fn nft_options(cfg: &ProxyConfig, family: IpFamily, objects: &Store) -> RenderOptions {
    RenderOptions::from_config(cfg, family, &app::node_info_from(&objects.nodes, cfg))
}

fn options(cfg: &ProxyConfig, family: IpFamily, objects: &Store) -> IptablesRenderOptions {
    let mut opts = IptablesRenderOptions::from_config(cfg, family, &app::node_info_from(&objects.nodes, cfg));
    opts.tcp_be_liberal = read_sysctl("net/netfilter/nf_conntrack_tcp_be_liberal").is_some_and(|v| v != "0");
    opts
}

fn ipvs_options(cfg: &ProxyConfig, family: IpFamily, objects: &Store) -> IpvsRenderOptions {
    IpvsRenderOptions::from_config(cfg, family, &app::node_info_from(&objects.nodes, cfg))
}

fn read_sysctl(key: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/sys/{key}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Localhost NodePorts need `route_localnet` (upstream sets it when they are in effect).
fn ensure_route_localnet(cfg: &ProxyConfig, objects: &Store) {
    let node: NodeInfo = app::node_info_from(&objects.nodes, cfg);
    let npa = NodePortAddresses::new(IpFamily::V4, &cfg.node_port_addresses, node.primary_ip(IpFamily::V4));
    if cfg.localhost_node_ports && npa.contains_ipv4_loopback() {
        let path = "/proc/sys/net/ipv4/conf/all/route_localnet";
        if std::fs::read_to_string(path).map(|v| v.trim() != "1").unwrap_or(true)
            && let Err(e) = std::fs::write(path, "1")
        {
            warn!(error = %e, "Could not set net.ipv4.conf.all.route_localnet=1; localhost NodePorts will not work");
        }
    }
}

/// One sync of one family: its state and report, or (on failure, retried as a full sync)
/// whether the failed sync was a full one.
fn sync_family(
    cfg: &ProxyConfig,
    p: &mut FamilyProxier,
    objects: &Store,
    builder: &mut StateBuilder,
) -> Result<(ProxyState, SyncReport), bool> {
    let node = app::node_info_from(&objects.nodes, cfg);
    let start = Instant::now();
    let state = builder.build(objects, &node, p.family);
    debug!(ip_family = %p.family, elapsed_ms = start.elapsed().as_secs_f64() * 1000.0, "Built the state");
    for w in &state.warnings {
        warn!(ip_family = %p.family, "{w}");
    }
    match p.proxier.sync(&state) {
        Ok(report) => {
            info!(
                mode = cfg.mode.as_str(),
                ip_family = %p.family,
                full = report.full,
                services = state.service_ports.len(),
                rewritten = report.rewritten_services,
                removed = report.removed_objects,
                operations = report.operations,
                elapsed_ms = report.elapsed.as_secs_f64() * 1000.0,
                "Synced rules"
            );
            if report.udp_endpoints_removed || report.full {
                clean_conntrack(p.family, &state);
            }
            Ok((state, report))
        }
        Err((e, full)) => {
            error!(ip_family = %p.family, error = %e, "Sync failed; keeping the previous rules and retrying with a full sync");
            Err(full)
        }
    }
}

fn clean_conntrack(family: IpFamily, state: &crate::model::ProxyState) {
    let services = UdpServices::from_state(state);
    if services.by_ip_port.is_empty() && services.by_node_port.is_empty() {
        return;
    }
    let result =
        conntrack::Netlink::new().and_then(|mut ct| conntrack::clean_stale_entries(&mut ct, family, &services));
    match result {
        Ok(n) if n > 0 => info!(ip_family = %family, deleted = n, "Deleted stale UDP conntrack entries"),
        Ok(_) => debug!(ip_family = %family, "No stale UDP conntrack entries"),
        Err(e) => warn!(ip_family = %family, error = %e, "Could not clean stale UDP conntrack entries"),
    }
}

/// Removes the rules of the modes other than `mode` (switching modes, every way).
fn remove_other_modes(mode: ProxyMode) {
    if mode != ProxyMode::Nftables {
        for family in [IpFamily::V4, IpFamily::V6] {
            if nftables::proxier::table_exists(family)
                && let Err(e) = nftables::proxier::delete_table(family)
            {
                warn!(ip_family = %family, error = %e, "Could not remove the nftables mode's table");
            }
        }
    }
    // IPVS mode's state goes before iptables mode's: it references chains the two share.
    if mode != ProxyMode::Ipvs {
        for e in remove_ipvs_mode(false) {
            warn!(error = %e, "Could not remove the IPVS mode's state");
        }
    }
    match mode {
        ProxyMode::Nftables => remove_iptables_mode(),
        // IPVS mode rewrites the chains it shares with iptables mode (KUBE-SERVICES, ...) on
        // its first sync; iptables mode's own chains go only where iptables mode left some, so
        // that restarting IPVS mode never empties its chains in between.
        ProxyMode::Ipvs => {
            if families().into_iter().any(|f| iptables_mode_present(&mut Exec::new(f))) {
                remove_iptables_mode();
            }
        }
        ProxyMode::Iptables => {}
    }
}

fn remove_iptables_mode() {
    for family in families() {
        for e in cleanup(&mut Exec::new(family)) {
            warn!(ip_family = %family, error = %e, "Could not remove the iptables mode's rules");
        }
    }
}

/// Whether iptables mode left its own chains (ones IPVS mode does not have).
fn iptables_mode_present(ipt: &mut Exec) -> bool {
    use crate::iptables::exec::Iptables as _;
    [
        ("nat", crate::iptables::names::KUBE_NODEPORTS),
        ("nat", crate::iptables::names::KUBE_PROXY_CANARY),
        ("filter", crate::iptables::names::KUBE_EXTERNAL_SERVICES),
    ]
    .iter()
    .any(|(table, chain)| ipt.chain_exists(table, chain).unwrap_or(false))
}

/// Removes IPVS mode's state where there is some (or, with `all` for `--cleanup`, whatever is
/// left): virtual servers on `kube-ipvs0` addresses and NodePort-looking ones on node
/// addresses (only when the kernel has IPVS loaded: without it there are none, and looking
/// would load it), its iptables rules, ipsets and `kube-ipvs0`. Silent where there is nothing.
fn remove_ipvs_mode(all: bool) -> Vec<String> {
    use crate::ipvs::host::IpvsHost as _;
    let mut host = HostExec;
    let mut ipts: Vec<Exec> = families().into_iter().map(Exec::new).collect();
    let link = host.link_exists(crate::ipvs::names::DUMMY_DEVICE).unwrap_or(false);
    let rules = ipts.iter_mut().any(|i| crate::ipvs::proxier::iptables_state_present(i));
    if !(all || link || rules) {
        return Vec::new();
    }
    let mut ipvs = if std::path::Path::new("/proc/net/ip_vs").exists() {
        IpvsHandle::new().ok()
    } else {
        None
    };
    let mut refs: Vec<&mut dyn crate::iptables::exec::Iptables> = ipts
        .iter_mut()
        .map(|i| i as &mut dyn crate::iptables::exec::Iptables)
        .collect();
    crate::ipvs::proxier::cleanup(
        ipvs.as_mut().map(|h| h as &mut dyn crate::ipvs::netlink::Ipvs),
        &mut refs,
        &mut host,
        true,
    )
}

/// `--cleanup`: removes everything we own in both families (iptables chains and jumps, the
/// nftables `kube-proxy` tables of the nftables mode, and IPVS mode's virtual servers, ipsets
/// and `kube-ipvs0`). Returns the errors met.
pub fn cleanup_all() -> Vec<String> {
    let mut errors = Vec::new();
    // IPVS mode's rules first: its chains share names with iptables mode's.
    errors.extend(remove_ipvs_mode(true).into_iter().map(|e| format!("IPVS mode: {e}")));
    for family in families() {
        let mut ipt = Exec::new(family);
        errors.extend(cleanup(&mut ipt).into_iter().map(|e| format!("{family}: {e}")));
    }
    for family in ["ip", "ip6"] {
        // The table may not exist (or nft may not be installed): only a present table matters.
        let listed = std::process::Command::new("nft")
            .args(["list", "table", family, "kube-proxy"])
            .output();
        if listed.is_ok_and(|o| o.status.success()) {
            let deleted = std::process::Command::new("nft")
                .args(["delete", "table", family, "kube-proxy"])
                .output();
            if !deleted.is_ok_and(|o| o.status.success()) {
                errors.push(format!("nft delete table {family} kube-proxy failed"));
            }
        }
    }
    errors
}
