//! The Kubernetes API source: watches Services and EndpointSlices with upstream's label
//! selector (both `service.kubernetes.io/headless` and `service.kubernetes.io/service-proxy-name`
//! absent) and this node's Node by field selector, using kube-runtime's watcher with backoff.
//!
//! A relist (after a 410 Gone or a reconnect) is framed by `Init … InitDone`; objects that
//! vanished meanwhile get no `Delete` event, so each kind's store is swapped whole at
//! `InitDone`, which turns them into deletions. Updates say whether both Services and
//! EndpointSlices have been listed once (upstream's `isInitialized`); the daemon syncs nothing
//! before. While the API server is unreachable nothing is sent, so the rules stay as they
//! are. Services and EndpointSlices are converted to the model's entries as they arrive
//! (`model::store`); the k8s objects are not kept. Each event that changes what the proxy sees
//! becomes an [`Update`] (an update that converts to an equal entry is none).
//!
//! Objects are watched as [`Raw`] JSON and decoded one by one ([`super::decode`]): one that
//! does not fit the typed struct is skipped with a warning naming it and the field, and keeps
//! the version the source had of it (none if it never decoded); the rest of the list or
//! watch goes on. A deletion needs only the name, so it is never lost that way.
//!
//! ServiceCIDRs (nftables mode's `cluster-ips-check`) are watched as `networking.k8s.io/v1`,
//! else as `v1beta1` where the API server answers the v1 list with 404 (the version is not
//! served: before 1.33, where v1beta1 may be enabled); when neither is served the check has no
//! ServiceCIDRs, and both are asked again every [`UNSERVED_RECHECK`]. The 404 of the list itself
//! is the answer, so a cluster serving v1 costs no discovery request. They do not hold back the
//! first sync (upstream's `isInitialized` waits for Services and EndpointSlices only), and a
//! refused list (403: RBAC without `servicecidrs`) is retried like any other watch: the check
//! only adds drops, so programming it a moment later loses nothing.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::api::networking::v1beta1::ServiceCIDR as ServiceCIDRV1beta1;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, info, warn};

use super::decode::Raw;

use crate::config::ClientConnection;
use crate::model::store::{self, Change, ObjectName, object_name};
use crate::model::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME, ServiceEntry, SliceEntry};
use crate::source::{Running, Source, SourceStatus, Update};

/// Upstream's informer label selector for Services and EndpointSlices.
pub fn label_selector() -> String {
    // Requirements sorted by key, as upstream serialises them.
    format!("!{LABEL_HEADLESS},!{LABEL_SERVICE_PROXY_NAME}")
}

/// A kind handed on one object at a time (Services, EndpointSlices). The source keeps none of
/// its objects: the daemon's store holds each entry once and compares every version handed on
/// with its own (an equal one is no change), so the source needs only a relist's objects, until
/// the relist completes. (Keeping a copy here held 20 MiB at 44,000 Services.)
struct Forwarded<T> {
    /// During a relist: the objects listed so far, and the names listed (also of objects that
    /// did not decode, which keep the version the daemon has).
    relist: Option<Relist<T>>,
    synced: bool,
}

/// A relist in progress: the objects listed so far, and every name listed.
type Relist<T> = (Vec<(ObjectName, T)>, HashSet<ObjectName>);

impl<T> Default for Forwarded<T> {
    fn default() -> Self {
        Forwarded {
            relist: None,
            synced: false,
        }
    }
}

impl<T> Forwarded<T> {
    /// Applies one watcher event, decoding and converting objects with `convert`: the changes
    /// to hand on, made by `change` (a version, or `None` for a deletion) and, when a relist
    /// completes, `listed` (the names listed: the others were deleted meanwhile).
    fn apply<K: Kind>(
        &mut self,
        event: watcher::Event<Raw<K>>,
        convert: impl Fn(&K) -> T,
        change: impl Fn(ObjectName, Option<T>) -> Change,
        listed: impl FnOnce(HashSet<ObjectName>) -> Change,
    ) -> Vec<Change> {
        match event {
            watcher::Event::Init => {
                self.relist = Some((Vec::new(), HashSet::new()));
                Vec::new()
            }
            watcher::Event::InitApply(o) => {
                let name = object_name(o.meta());
                let entry = decoded(o, convert);
                if let Some((objects, names)) = self.relist.as_mut() {
                    if let Some(entry) = entry {
                        objects.push((name.clone(), entry));
                    }
                    names.insert(name);
                }
                Vec::new()
            }
            watcher::Event::InitDone => {
                self.synced = true;
                let (objects, names) = self.relist.take().unwrap_or_default();
                let mut out = Vec::with_capacity(objects.len() + 1);
                out.push(listed(names));
                out.extend(objects.into_iter().map(|(name, entry)| change(name, Some(entry))));
                out
            }
            watcher::Event::Apply(o) => {
                let name = object_name(o.meta());
                decoded(o, convert)
                    .map(|entry| change(name, Some(entry)))
                    .into_iter()
                    .collect()
            }
            watcher::Event::Delete(o) => vec![change(object_name(o.meta()), None)],
        }
    }
}

/// `raw` decoded and converted. One that does not decode is reported (naming it and the field)
/// and handed on as nothing: the version the daemon has of it, if any, stays.
fn decoded<K: Kind, T>(raw: Raw<K>, convert: impl Fn(&K) -> T) -> Option<T> {
    match raw.decode() {
        Ok(o) => Some(convert(&o)),
        Err(e) => {
            warn!("{e}; object skipped (a version of it the proxy has stays)");
            None
        }
    }
}

/// A kind handed on whole (Nodes, ServiceCIDRs: few), by `(namespace, name)`, plus the relist
/// buffer.
struct KindStore<T> {
    objects: BTreeMap<ObjectName, T>,
    relist: Option<BTreeMap<ObjectName, T>>,
    synced: bool,
}

impl<T> Default for KindStore<T> {
    fn default() -> Self {
        KindStore {
            objects: BTreeMap::new(),
            relist: None,
            synced: false,
        }
    }
}

/// The k8s-openapi kinds the source watches (decoded from [`Raw`] one by one).
pub trait Kind: k8s_openapi::Resource + DeserializeOwned + Send + Sync + 'static {}

impl<K: k8s_openapi::Resource + DeserializeOwned + Send + Sync + 'static> Kind for K {}

impl<T: PartialEq + Clone> KindStore<T> {
    /// Applies one watcher event, decoding and converting objects with `convert`: every
    /// object, if anything changed (an update that converts to an equal entry changes nothing,
    /// nor does one that does not decode, which keeps its version).
    fn apply_whole<K: Kind>(&mut self, event: watcher::Event<Raw<K>>, convert: impl Fn(&K) -> T) -> Option<Vec<T>> {
        let changed = match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                let name = object_name(o.meta());
                let entry = decoded(o, convert).or_else(|| self.objects.get(&name).cloned());
                if let (Some(buf), Some(entry)) = (self.relist.as_mut(), entry) {
                    buf.insert(name, entry);
                }
                false
            }
            watcher::Event::InitDone => {
                let new = self.relist.take().unwrap_or_default();
                self.synced = true;
                std::mem::replace(&mut self.objects, new) != self.objects
            }
            watcher::Event::Apply(o) => {
                let name = object_name(o.meta());
                match decoded(o, convert) {
                    Some(entry) if self.objects.get(&name) != Some(&entry) => {
                        self.objects.insert(name, entry);
                        true
                    }
                    _ => false,
                }
            }
            watcher::Event::Delete(o) => self.objects.remove(&object_name(o.meta())).is_some(),
        };
        changed.then(|| self.objects.values().cloned().collect())
    }
}

#[derive(Default)]
struct Watched {
    services: Forwarded<Arc<ServiceEntry>>,
    slices: Forwarded<Arc<SliceEntry>>,
    nodes: KindStore<Node>,
    service_cidrs: KindStore<ServiceCIDR>,
}

impl Watched {
    /// Both initial lists are in.
    fn synced(&self) -> bool {
        self.services.synced && self.slices.synced
    }
}

/// The source's handling of watch events without a server: each line of a replay is one
/// watch event (`{"type":"ADDED"|"MODIFIED"|"DELETED","object":{...}}`) of a Service,
/// EndpointSlice or Node (by the object's `kind`), or `INIT` / `INIT_DONE`, which frame a
/// relist as the watcher does (objects in between are listed, not applied). Each line goes
/// through the decoding and the stores the watchers use; what they hand the daemon comes back
/// as [`Change`]s (versions equal to the daemon's are among them: its store finds them no
/// change). For the fuzz target over watch events, and tests.
pub struct Replay {
    watched: Watched,
    node_name: String,
    relisting: bool,
}

impl Replay {
    pub fn new(node_name: &str) -> Replay {
        Replay {
            watched: Watched::default(),
            node_name: node_name.to_string(),
            relisting: false,
        }
    }

    /// Applies one line; an error (and no change) for a line that is no watch event of a kind
    /// the source watches, as a watch stream reports and skips it.
    pub fn line(&mut self, line: &str) -> Result<Vec<Change>, String> {
        let w = &mut self.watched;
        let node_name = self.node_name.clone();
        type Events = (
            Option<watcher::Event<Raw<Service>>>,
            Option<watcher::Event<Raw<EndpointSlice>>>,
            Option<watcher::Event<Raw<Node>>>,
        );
        let (services, slices, nodes): Events = match line.trim() {
            "INIT" => {
                self.relisting = true;
                (
                    Some(watcher::Event::Init),
                    Some(watcher::Event::Init),
                    Some(watcher::Event::Init),
                )
            }
            "INIT_DONE" => {
                self.relisting = false;
                let done = Some(watcher::Event::InitDone);
                (done, Some(watcher::Event::InitDone), Some(watcher::Event::InitDone))
            }
            text => {
                let value: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
                let kind = value.get("object").and_then(|o| o.get("kind")).and_then(|k| k.as_str());
                match kind {
                    Some("Service") => (Some(replayed(value, self.relisting)?), None, None),
                    Some("EndpointSlice") => (None, Some(replayed(value, self.relisting)?), None),
                    Some("Node") => (None, None, Some(replayed(value, self.relisting)?)),
                    other => return Err(format!("not a watched kind: {other:?}")),
                }
            }
        };
        let mut out = Vec::new();
        if let Some(e) = services {
            out.extend(
                w.services
                    .apply(e, store::service_entry, Change::Service, Change::ServicesListed),
            );
        }
        if let Some(e) = slices {
            let convert = |s: &EndpointSlice| store::slice_entry(s, &node_name);
            out.extend(w.slices.apply(e, convert, Change::Slice, Change::SlicesListed));
        }
        if let Some(e) = nodes {
            out.extend(w.nodes.apply_whole(e, Node::clone).map(Change::Nodes));
        }
        Ok(out)
    }
}

/// A watch event line as the watcher hands it on (inside a relist, as listed).
fn replayed<K: Kind>(value: serde_json::Value, relisting: bool) -> Result<watcher::Event<Raw<K>>, String> {
    use kube::core::WatchEvent;
    let event: WatchEvent<Raw<K>> = serde_json::from_value(value).map_err(|e| e.to_string())?;
    match event {
        WatchEvent::Added(o) | WatchEvent::Modified(o) if relisting => Ok(watcher::Event::InitApply(o)),
        WatchEvent::Added(o) | WatchEvent::Modified(o) => Ok(watcher::Event::Apply(o)),
        WatchEvent::Deleted(o) => Ok(watcher::Event::Delete(o)),
        WatchEvent::Bookmark(_) | WatchEvent::Error(_) => Err("no object".into()),
    }
}

/// The Kubernetes API as a [`Source`], reached as `clientConnection` (and `--master`) say.
#[derive(Clone, Debug)]
pub struct KubeApi(pub ClientConnection);

impl Source for KubeApi {
    fn start(self: Box<Self>, node_name: &str) -> anyhow::Result<Running> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let status = SourceStatus::new("api");
        let source = ApiSource::start(&self.0, node_name, tx, status.clone())?;
        Ok(Running::new(rx, status, source))
    }
}

/// A running API source; the watchers stop when it is dropped.
pub struct ApiSource {
    _runtime: tokio::runtime::Runtime,
}

impl ApiSource {
    /// Connects and starts the watchers; every change goes to `updates`, each watch's failures
    /// and recoveries to `status`.
    pub fn start(
        cfg: &ClientConnection,
        node_name: &str,
        updates: UnboundedSender<Update>,
        status: SourceStatus,
    ) -> anyhow::Result<ApiSource> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kube-source")
            .enable_all()
            .build()
            .context("starting the API source's runtime")?;
        let client = runtime.block_on(client(cfg))?;
        // kube-rs speaks JSON and has no client-side rate limiter; both settings shape only
        // the (few) list/watch requests, so they are reported, not emulated.
        if cfg.content_type.contains("protobuf") {
            info!(content_type = %cfg.content_type, "clientConnection.contentType: using application/json (protobuf is not implemented)");
        }
        info!(
            qps = cfg.qps,
            burst = cfg.burst,
            "clientConnection.qps/burst are not enforced (only list and watch requests are made)"
        );
        let store = Arc::new(Mutex::new(Watched::default()));
        let selector = label_selector();
        let svc_cfg = watcher::Config::default().labels(&selector);
        let node_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        runtime.spawn(watch::<Service>(
            client.clone(),
            svc_cfg.clone(),
            (store.clone(), updates.clone(), status.clone()),
            |w, e| {
                w.services
                    .apply(e, store::service_entry, Change::Service, Change::ServicesListed)
            },
        ));
        runtime.spawn(watch::<EndpointSlice>(
            client.clone(),
            svc_cfg,
            (store.clone(), updates.clone(), status.clone()),
            {
                let node_name = node_name.to_string();
                move |w, e| {
                    let convert = |s: &EndpointSlice| store::slice_entry(s, &node_name);
                    w.slices.apply(e, convert, Change::Slice, Change::SlicesListed)
                }
            },
        ));
        runtime.spawn(watch::<Node>(
            client.clone(),
            node_cfg,
            (store.clone(), updates.clone(), status.clone()),
            |w, e| {
                w.nodes
                    .apply_whole(e, Node::clone)
                    .map(Change::Nodes)
                    .into_iter()
                    .collect()
            },
        ));
        runtime.spawn(watch_service_cidrs(client.clone(), (store, updates, status)));
        runtime.spawn(birth_cry(client, node_name.to_string()));
        Ok(ApiSource { _runtime: runtime })
    }
}

async fn client(cfg: &ClientConnection) -> anyhow::Result<Client> {
    let mut config = match &cfg.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => match &cfg.master {
            Some(master) => kube::Config::new(
                master
                    .parse()
                    .with_context(|| format!("invalid value {master:?} for --master"))?,
            ),
            None => kube::Config::infer()
                .await
                .context("no --kubeconfig or --master, and no in-cluster configuration")?,
        },
    };
    if let (Some(master), Some(_)) = (&cfg.master, &cfg.kubeconfig) {
        // Upstream: --master overrides the kubeconfig's server.
        config.cluster_url = master
            .parse()
            .with_context(|| format!("invalid value {master:?} for --master"))?;
    }
    Client::try_from(config).context("building the API client")
}

/// Where a watch delivers: the shared store, the daemon's channel, the source's status.
type WatchSinks = (Arc<Mutex<Watched>>, UnboundedSender<Update>, SourceStatus);

/// Watches one kind for as long as the daemon runs.
async fn watch<K: Kind>(
    client: Client,
    config: watcher::Config,
    sinks: WatchSinks,
    apply: impl Fn(&mut Watched, watcher::Event<Raw<K>>) -> Vec<Change> + Send + 'static,
) {
    watch_until(client, config, sinks, apply, false).await;
}

/// Why [`watch_until`] stopped.
#[derive(Debug, PartialEq, Eq)]
enum WatchEnd {
    /// The daemon is gone (or the store poisoned): nothing more to do.
    Closed,
    /// The API server answered 404: it does not serve this kind in this version.
    NotServed,
}

/// Watches one kind until the daemon is gone or, with `stop_if_not_served`, until the API
/// server says it does not serve it (any other error is retried with the backoff).
async fn watch_until<K: Kind>(
    client: Client,
    config: watcher::Config,
    (store, updates, status): WatchSinks,
    apply: impl Fn(&mut Watched, watcher::Event<Raw<K>>) -> Vec<Change> + Send + 'static,
    stop_if_not_served: bool,
) -> WatchEnd {
    let name = K::KIND;
    let api = Api::<Raw<K>>::all(client);
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                status.ok(name);
                let update = match store.lock() {
                    Ok(mut w) => {
                        let was_synced = w.synced();
                        let changes = apply(&mut w, event);
                        let synced = w.synced();
                        if !changes.is_empty() {
                            // When each change arrived, for latency tracing (benches/latency.rs).
                            debug!(kind = %name, changes = changes.len(), "Watch event");
                        }
                        (!changes.is_empty() || synced != was_synced).then_some(Update { changes, synced })
                    }
                    Err(_) => return WatchEnd::Closed,
                };
                if let Some(update) = update
                    && updates.send(update).is_err()
                {
                    return WatchEnd::Closed;
                }
            }
            Err(e) if stop_if_not_served && not_served(&e) => return WatchEnd::NotServed,
            // The backoff spaces retries; the store (and so the rules) stay as they are.
            Err(e) => {
                status.failed(name, &e.to_string());
                warn!(kind = %name, error = %e, "Watch failed; retrying");
            }
        }
    }
    WatchEnd::Closed
}

/// A 404 from the API server: the resource is not served at that group and version.
fn not_served(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}

/// How long to wait before asking again for ServiceCIDRs that neither version serves.
pub const UNSERVED_RECHECK: Duration = Duration::from_secs(300);

/// ServiceCIDRs, as `networking.k8s.io/v1` or, where that is not served, `v1beta1` (both
/// converted to the same entry); neither served: asked again every [`UNSERVED_RECHECK`].
async fn watch_service_cidrs(client: Client, sinks: WatchSinks) {
    let mut said = false;
    loop {
        if watch_service_cidr_version(&client, &sinks, v1_cidrs).await == WatchEnd::Closed {
            return;
        }
        if !said {
            info!("networking.k8s.io/v1 ServiceCIDRs are not served; watching networking.k8s.io/v1beta1");
        }
        if watch_service_cidr_version(&client, &sinks, v1beta1_cidrs).await == WatchEnd::Closed {
            return;
        }
        if !said {
            info!(
                recheck_s = UNSERVED_RECHECK.as_secs(),
                "ServiceCIDRs are not served (neither networking.k8s.io/v1 nor v1beta1): nftables mode drops no traffic to unallocated ClusterIPs"
            );
            said = true;
        }
        tokio::time::sleep(UNSERVED_RECHECK).await;
    }
}

/// `spec.cidrs` of a `networking.k8s.io/v1` ServiceCIDR.
fn v1_cidrs(c: &ServiceCIDR) -> Option<&[String]> {
    c.spec.as_ref()?.cidrs.as_deref()
}

/// `spec.cidrs` of a `networking.k8s.io/v1beta1` ServiceCIDR.
fn v1beta1_cidrs(c: &ServiceCIDRV1beta1) -> Option<&[String]> {
    c.spec.as_ref()?.cidrs.as_deref()
}

/// Watches the ServiceCIDRs of one API version (`cidrs` reads its `spec.cidrs`) until the daemon
/// is gone or the version is not served.
async fn watch_service_cidr_version<K>(
    client: &Client,
    sinks: &WatchSinks,
    cidrs: fn(&K) -> Option<&[String]>,
) -> WatchEnd
where
    K: Kind + k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
{
    let apply = move |w: &mut Watched, e: watcher::Event<Raw<K>>| service_cidr_changes(w, e, cidrs);
    watch_until(client.clone(), watcher::Config::default(), sinks.clone(), apply, true).await
}

/// The ServiceCIDRs, whole, if `event` changed them (`cidrs` reads an object's `spec.cidrs`).
fn service_cidr_changes<K>(
    w: &mut Watched,
    event: watcher::Event<Raw<K>>,
    cidrs: fn(&K) -> Option<&[String]>,
) -> Vec<Change>
where
    K: Kind + k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
{
    let convert = |c: &K| store::service_cidr_entry(c.meta().name.as_deref(), cidrs(c));
    let all = w.service_cidrs.apply_whole(event, convert);
    all.map(Change::ServiceCidrs).into_iter().collect()
}

/// Upstream's "Starting" event on the Node (its `birthCry`).
async fn birth_cry(client: Client, node_name: String) {
    let event = KubeEvent {
        type_: EventType::Normal,
        reason: "Starting".into(),
        note: None,
        action: START_ACTION.into(),
        secondary: None,
    };
    publish_on_node(client, &node_name, &event).await;
}

/// The action of the events kube-proxy emits while it starts.
const START_ACTION: &str = "StartKubeProxy";

/// A Warning event about starting, as upstream's `Recorder.Eventf(NodeRef, nil, Warning,
/// reason, "StartKubeProxy", note)`.
pub fn start_warning(reason: &str, note: &str) -> KubeEvent {
    KubeEvent {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.into()),
        action: START_ACTION.into(),
        secondary: None,
    }
}

/// Emits `event` on the Node `node_name`, reaching the API as `cc` says, from a thread of its
/// own: the daemon does not wait for it, and a failure is logged.
pub fn emit_on_node(cc: &ClientConnection, node_name: &str, event: KubeEvent) {
    let (cc, node_name) = (cc.clone(), node_name.to_string());
    let spawned = std::thread::Builder::new().name("kube-event".into()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => return warn!(error = %e, reason = %event.reason, "Could not emit the event"),
        };
        runtime.block_on(async {
            match client(&cc).await {
                Ok(c) => publish_on_node(c, &node_name, &event).await,
                Err(e) => warn!(error = %format!("{e:#}"), reason = %event.reason, "Could not emit the event"),
            }
        });
    });
    if let Err(e) = spawned {
        warn!(error = %e, "Could not start the thread that emits an event");
    }
}

/// Publishes `event` about the Node `node_name` as kube-proxy (events.k8s.io, with the Node's
/// name as its UID, as upstream's `NodeRef`).
async fn publish_on_node(client: Client, node_name: &str, event: &KubeEvent) {
    let reporter = Reporter {
        controller: "kube-proxy".into(),
        instance: Some(node_name.to_string()),
    };
    let recorder = Recorder::new(client, reporter);
    let node = ObjectReference {
        kind: Some("Node".into()),
        name: Some(node_name.to_string()),
        uid: Some(node_name.to_string()),
        api_version: Some("v1".into()),
        ..ObjectReference::default()
    };
    match recorder.publish(event, &node).await {
        Ok(()) => info!(node = %node_name, reason = %event.reason, "Emitted an event"),
        Err(e) => warn!(error = %e, reason = %event.reason, "Could not emit the event"),
    }
}

/// The kubeconfig path kube-proxy would use without `--kubeconfig` (for messages).
pub fn default_kubeconfig() -> Option<PathBuf> {
    std::env::var_os("KUBECONFIG").map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `o` as it arrives from the API server.
    fn raw<K: k8s_openapi::Resource + serde::Serialize>(o: &K) -> Raw<K> {
        Raw::from_json(serde_json::to_value(o).expect("serializes"))
    }

    fn svc(name: &str) -> Raw<Service> {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("d".into());
        raw(&s)
    }

    /// A Service that does not decode (a port number that is a string).
    fn undecodable(name: &str) -> Raw<Service> {
        Raw::from_json(serde_json::json!({
            "metadata": {"name": name, "namespace": "d"},
            "spec": {"clusterIP": "10.0.0.1", "ports": [{"port": "eighty"}]},
        }))
    }

    fn with_ip(name: &str, ip: &str) -> Raw<Service> {
        Raw::from_json(serde_json::json!({
            "metadata": {"name": name, "namespace": "d"},
            "spec": {"clusterIP": ip, "ports": [{"port": 80}]},
        }))
    }

    #[test]
    fn a_replay_goes_through_the_watchers_decoding_and_stores() {
        let mut r = Replay::new("node-a");
        let svc = r#"{"type":"ADDED","object":{"kind":"Service","metadata":{"name":"a","namespace":"d"},"spec":{"clusterIP":"10.0.0.1","ports":[{"port":80}]}}}"#;
        let bad = r#"{"type":"MODIFIED","object":{"kind":"Service","metadata":{"name":"a","namespace":"d"},"spec":{"ports":"x"}}}"#;
        let slice = r#"{"type":"ADDED","object":{"kind":"EndpointSlice","metadata":{"name":"a-1","namespace":"d","labels":{"kubernetes.io/service-name":"a"}},"addressType":"IPv4","endpoints":[{"addresses":["10.1.0.1"]}]}}"#;
        assert!(matches!(&r.line(svc).unwrap()[..], [Change::Service(_, Some(_))]));
        assert!(r.line(bad).unwrap().is_empty(), "does not decode: no change");
        assert!(matches!(&r.line(slice).unwrap()[..], [Change::Slice(_, Some(_))]));
        assert!(r.line("nonsense").is_err());
        assert!(r.line(r#"{"type":"ADDED","object":{"kind":"Pod"}}"#).is_err());
        // A relist without the Service deletes it; the slice stays.
        r.line("INIT").unwrap();
        assert!(r.line(&slice.replace("ADDED", "MODIFIED")).unwrap().is_empty());
        let done = r.line("INIT_DONE").unwrap();
        assert!(
            matches!(&done[..], [Change::ServicesListed(names), Change::SlicesListed(slices), Change::Slice(..)] if names.is_empty() && slices.len() == 1),
            "{done:?}"
        );
    }

    /// Service events through the source's handling and then the daemon's store, as the
    /// daemon applies them.
    #[derive(Default)]
    struct Pipeline {
        services: Forwarded<Arc<ServiceEntry>>,
        builder: store::StateBuilder,
    }

    impl Pipeline {
        /// How many Services changed for the proxy.
        fn event(&mut self, e: watcher::Event<Raw<Service>>) -> usize {
            let changes = self
                .services
                .apply(e, store::service_entry, Change::Service, Change::ServicesListed);
            self.builder.apply(changes).services
        }

        fn held(&self, name: &str) -> Option<Arc<ServiceEntry>> {
            self.builder
                .store()
                .services
                .get(&("d".to_string(), name.to_string()))
                .cloned()
        }

        fn names(&self) -> Vec<String> {
            let services = &self.builder.store().services;
            services.keys().map(|(ns, n)| format!("{ns}/{n}")).collect()
        }
    }

    #[test]
    fn an_object_that_does_not_decode_is_skipped_and_keeps_its_previous_version() {
        let mut p = Pipeline::default();
        for e in [
            watcher::Event::Init,
            watcher::Event::InitApply(with_ip("a", "10.0.0.1")),
            watcher::Event::InitApply(undecodable("never")),
        ] {
            assert_eq!(p.event(e), 0);
        }
        assert_eq!(
            p.event(watcher::Event::InitDone),
            1,
            "the list completes without the bad object"
        );
        assert!(p.services.synced);
        // An update that does not decode changes nothing: a keeps 10.0.0.1.
        assert_eq!(p.event(watcher::Event::Apply(undecodable("a"))), 0);
        let expected = store::service_entry(&with_ip("a", "10.0.0.1").decode().unwrap());
        assert_eq!(p.held("a"), Some(expected));
        // Neither does a relist in which it still does not.
        p.event(watcher::Event::Init);
        p.event(watcher::Event::InitApply(undecodable("a")));
        assert_eq!(p.event(watcher::Event::InitDone), 0, "a is kept, not deleted");
        assert_eq!(p.names(), vec!["d/a"]);
        // A later good version applies, and a deletion needs only the name.
        assert_eq!(p.event(watcher::Event::Apply(with_ip("a", "10.0.0.2"))), 1);
        assert_eq!(p.event(watcher::Event::Delete(undecodable("a"))), 1);
        assert!(p.names().is_empty());
    }

    #[test]
    fn relist_turns_missing_objects_into_deletions() {
        let mut p = Pipeline::default();
        for e in [
            watcher::Event::Init,
            watcher::Event::InitApply(svc("a")),
            watcher::Event::InitApply(svc("b")),
        ] {
            assert_eq!(p.event(e), 0);
        }
        assert!(!p.services.synced);
        assert_eq!(p.event(watcher::Event::InitDone), 2);
        assert_eq!(p.names(), vec!["d/a", "d/b"]);
        // Reconnect: only "a" is listed again; "b" vanished while we were away.
        let held = p.held("a").expect("a");
        p.event(watcher::Event::Init);
        assert_eq!(p.names().len(), 2, "the old view stays until the relist is complete");
        p.event(watcher::Event::InitApply(svc("a")));
        assert_eq!(
            p.event(watcher::Event::InitDone),
            1,
            "b is deleted; a, unchanged, is no change"
        );
        assert_eq!(p.names(), vec!["d/a"]);
        assert_eq!(p.held("a"), Some(held), "a as it was");
        assert_eq!(p.event(watcher::Event::Apply(svc("c"))), 1);
        assert_eq!(
            p.event(watcher::Event::Apply(svc("c"))),
            0,
            "an update the proxy cannot see is no change"
        );
        assert_eq!(p.event(watcher::Event::Delete(svc("c"))), 1);
        assert_eq!(p.event(watcher::Event::Delete(svc("zzz"))), 0);
    }

    #[test]
    fn the_source_keeps_no_copy_of_services_or_slices() {
        let mut p = Pipeline::default();
        for e in [
            watcher::Event::Init,
            watcher::Event::InitApply(svc("a")),
            watcher::Event::InitDone,
        ] {
            p.event(e);
        }
        p.event(watcher::Event::Apply(svc("b")));
        let held = p.held("a").expect("a");
        assert!(p.services.relist.is_none());
        assert_eq!(
            Arc::strong_count(&held),
            2,
            "the store's entry and this one: no other copy"
        );
    }

    #[test]
    fn only_a_404_means_not_served() {
        let api = |code| kube::Error::Api(kube::core::Status::failure("x", "y").with_code(code).boxed());
        assert!(not_served(&watcher::Error::InitialListFailed(api(404))));
        assert!(not_served(&watcher::Error::WatchStartFailed(api(404))));
        assert!(not_served(&watcher::Error::WatchError(
            kube::core::Status::failure("x", "NotFound").with_code(404).boxed()
        )));
        for retried in [403, 410, 500, 503] {
            assert!(
                !not_served(&watcher::Error::InitialListFailed(api(retried))),
                "{retried}"
            );
        }
        assert!(!not_served(&watcher::Error::NoResourceVersion));
    }

    #[test]
    fn service_cidrs_of_either_version_convert_alike_and_only_their_cidrs_count() {
        let mut w = Watched::default();
        let v1 = |rv: &str, cidrs: &[&str]| {
            let mut c = ServiceCIDR::default();
            c.metadata.name = Some("kubernetes".into());
            c.metadata.resource_version = Some(rv.into());
            c.spec = Some(k8s_openapi::api::networking::v1::ServiceCIDRSpec {
                cidrs: Some(cidrs.iter().map(|s| s.to_string()).collect()),
            });
            c
        };
        let changes = service_cidr_changes(
            &mut w,
            watcher::Event::Apply(raw(&v1("1", &["10.96.0.0/16"]))),
            v1_cidrs,
        );
        assert!(
            matches!(&changes[..], [Change::ServiceCidrs(l)] if l.len() == 1),
            "{changes:?}"
        );
        assert!(
            service_cidr_changes(
                &mut w,
                watcher::Event::Apply(raw(&v1("2", &["10.96.0.0/16"]))),
                v1_cidrs
            )
            .is_empty(),
            "a new resource version with the same CIDRs is no change"
        );
        // The same object as v1beta1 (after a fallback) is the same entry.
        let mut beta = ServiceCIDRV1beta1::default();
        beta.metadata.name = Some("kubernetes".into());
        beta.spec = Some(k8s_openapi::api::networking::v1beta1::ServiceCIDRSpec {
            cidrs: Some(vec!["10.96.0.0/16".into()]),
        });
        assert!(service_cidr_changes(&mut w, watcher::Event::Apply(raw(&beta)), v1beta1_cidrs).is_empty());
        beta.spec = Some(k8s_openapi::api::networking::v1beta1::ServiceCIDRSpec {
            cidrs: Some(vec!["10.96.0.0/16".into(), "10.97.0.0/24".into()]),
        });
        let changes = service_cidr_changes(&mut w, watcher::Event::Apply(raw(&beta)), v1beta1_cidrs);
        let Some(Change::ServiceCidrs(list)) = changes.first() else {
            panic!("{changes:?}")
        };
        assert_eq!(
            list[0].spec.as_ref().and_then(|s| s.cidrs.clone()).map(|c| c.len()),
            Some(2)
        );
        let changes = service_cidr_changes(&mut w, watcher::Event::Delete(raw(&beta)), v1beta1_cidrs);
        assert!(
            matches!(&changes[..], [Change::ServiceCidrs(l)] if l.is_empty()),
            "{changes:?}"
        );
        assert!(!w.synced(), "ServiceCIDRs do not make the source synced");
    }

    #[test]
    fn selector_is_upstreams() {
        assert_eq!(
            label_selector(),
            "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
        );
    }
}
