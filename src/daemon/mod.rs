//! The node daemon: reads Services, EndpointSlices and the Node from its source (the API
//! server or a manifest directory) and keeps the kernel's rules in sync. The parts:
//! - [`runner`]: when to sync, as a pure state machine (coalescing, `minSyncPeriod`, retries,
//!   periodic checks and full syncs, nothing before the initial lists);
//! - [`sync_loop`]: the loop that feeds the runner and drives the injected edges (proxiers,
//!   host, telemetry) on tokio's clock;
//! - [`telemetry`]: healthz, the mode's metrics and the health-check node ports;
//! - [`modes`]: per-mode set-up on the real node, mode switches and `--cleanup`;
//! - [`leftovers`]: the other modes' state after a mode switch, removed once this mode is in;
//! - [`host`]: the node's sysctls and conntrack table, as the loop touches them;
//! - [`config_watch`]: the `--config` file watch (exit when its content changes, as upstream);
//! - [`debug`]: the read-only `/debug/services` and `/debug/rules` of the metrics server.
//!
//! This module wires them for the real node: [`run`].

pub mod config_watch;
pub mod debug;
pub mod host;
pub mod leftovers;
pub mod modes;
pub mod runner;
pub mod sync_loop;
pub mod telemetry;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tracing::{error, info, warn};

use crate::config::{ClientConnection, ProxyConfig, ProxyMode};
use crate::conntrack;
use crate::healthz::ProxyHealth;
use crate::http::{self, ServiceHealthServers};
use crate::iptables::nfacct::Nfacct;
use crate::metrics::Metrics;
use crate::source::{self, Source};
pub use modes::cleanup_all;
use telemetry::Telemetry;

/// Where Services, EndpointSlices and the Node come from.
#[derive(Clone, Debug)]
pub enum SourceConfig {
    /// `--manifests DIR`: a directory of manifests, re-read on change.
    Manifests(PathBuf),
    /// The Kubernetes API (`--kubeconfig`, `--master`, in-cluster config otherwise).
    Api(ClientConnection),
}

impl SourceConfig {
    fn source(&self) -> Box<dyn Source> {
        match self {
            SourceConfig::Manifests(dir) => Box::new(source::manifests::ManifestDir(dir.clone())),
            SourceConfig::Api(cc) => Box::new(source::api::KubeApi(cc.clone())),
        }
    }
}

/// What the daemon runs on.
#[derive(Clone, Debug)]
pub struct DaemonOptions {
    pub config: ProxyConfig,
    pub source: SourceConfig,
    /// `--debug-allow-remote`: the `/debug` endpoints answer beyond loopback.
    pub debug_allow_remote: bool,
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
            debug_allow_remote: self.debug_allow_remote,
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
    pub debug_allow_remote: bool,
}

/// Runs until the source fails or the `--config` file changes (the error says which, and the
/// rules stay in the kernel); never returns on success.
pub fn run(opts: DaemonOptions) -> anyhow::Result<()> {
    let cfg = Arc::new(opts.config.clone());
    let node_name = cfg.node_name();
    modes::check_kernel(&cfg)?;
    // Watching starts before anything is touched, as upstream's does while it reads its options.
    let config_watch = match &cfg.config_file {
        Some(f) => Some(
            config_watch::start(&f.path, f.content.clone())
                .with_context(|| format!("watching the configuration file {}", f.path.display()))?,
        ),
        None => None,
    };
    info!(mode = cfg.mode.as_str(), node = %node_name, "Starting kube-proxy");
    // Before anything is programmed: the backend kubelet and earlier proxies wrote to.
    let backend = crate::iptables::backend::detect_and_log();
    let warnings = conntrack::apply_sysctls_and_hashsize(
        &cfg.conntrack,
        std::path::Path::new("/proc/sys"),
        Some(std::path::Path::new(conntrack::HASHSIZE_PATH)),
        conntrack::detect_num_cpus(),
    );
    for w in warnings {
        warn!("{w}");
    }
    let nfacct = match cfg.mode {
        ProxyMode::Iptables => modes::nfacct_counters(),
        _ => None,
    };
    let counted = nfacct.is_some();
    let (telemetry, _servers) = start_servers(&cfg, &opts.servers(), &node_name, nfacct)?;
    if let SourceConfig::Manifests(dir) = &opts.source {
        info!(manifests = %dir.display(), "Reading Services and EndpointSlices from manifests");
    }
    let mut running = opts.source.source().start(&node_name)?;
    telemetry.debug.set_source(running.status.clone());
    // The other modes' rules are found now, and removed once this mode's are in place.
    let leftovers = leftovers::OtherModes::find(cfg.mode, backend);
    modes::log_mode(cfg.mode);
    if let (ProxyMode::Ipvs, SourceConfig::Api(cc)) = (cfg.mode, &opts.source) {
        let event = source::api::start_warning("IPVSDeprecation", modes::IPVS_DEPRECATION);
        source::api::emit_on_node(cc, &node_name, event);
    }
    let proxiers = modes::proxiers(&cfg, backend, counted)?;
    let node_watched = matches!(opts.source, SourceConfig::Api(_));
    let sync_loop = sync_loop::SyncLoop::new(cfg, proxiers, Box::new(host::NodeHost), telemetry, node_watched)
        .with_leftovers(leftovers);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .thread_name("kube-proxy-sync")
        .enable_all()
        .build()
        .context("starting the sync loop's runtime")?;
    // Syncs block this runtime's one thread; the servers and sources have their own. The
    // watch is looked at between syncs, so a change never cuts one short.
    runtime.block_on(async move {
        let Some(watch) = config_watch else {
            return Ok(sync_loop.run(&mut running.updates).await?);
        };
        tokio::select! {
            r = sync_loop.run(&mut running.updates) => Ok(r?),
            changed = watch.changed() => {
                error!(error = %changed, "Error running ProxyServer");
                Err(changed.into())
            }
        }
    })
}

/// The HTTP servers, on a runtime of their own (dropping it stops them).
pub struct HttpServers {
    _runtime: tokio::runtime::Runtime,
}

/// Binds and starts the healthz and metrics servers (exporting `nfacct`'s counters, where iptables
/// mode has them) and sets up the health-check node ports.
fn start_servers(
    cfg: &ProxyConfig,
    servers: &ServerConfig,
    node_name: &str,
    nfacct: Option<Box<dyn Nfacct>>,
) -> anyhow::Result<(Arc<Telemetry>, HttpServers)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kube-proxy-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    // Upstream: unhealthy when a queued update waits longer than 2 × syncPeriod.
    let health = ProxyHealth::new(cfg.sync_period * 2);
    let metrics = Arc::new(Metrics::new(cfg.mode.as_str()));
    let debug = debug::DebugView::default();
    debug.set_nfacct(nfacct.is_some());
    metrics.record_feature_gates(&cfg.gate_states());
    if let Some(n) = nfacct {
        metrics.register_nfacct(n);
    }
    let bind = |addr: SocketAddr, what: &str| -> anyhow::Result<Option<tokio::net::TcpListener>> {
        match runtime.block_on(async { http::bind(addr) }) {
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
        )
        .merge(debug::router(debug::DebugServer {
            view: debug.clone(),
            config: Arc::new(cfg.clone()),
            allow_remote: servers.debug_allow_remote,
        }));
        runtime.spawn(http::serve(listener, router, std::future::pending()));
    }
    // Health-check servers listen on the wildcard address. (Upstream restricts them to the
    // node's addresses within specific nodePortAddresses CIDRs; not done yet.)
    let service_health = ServiceHealthServers::new(node_name, Vec::new(), health.clone());
    let mut telemetry = Telemetry::new(
        cfg.mode,
        health,
        metrics,
        service_health,
        Some(runtime.handle().clone()),
    );
    telemetry.debug = debug;
    Ok((Arc::new(telemetry), HttpServers { _runtime: runtime }))
}
