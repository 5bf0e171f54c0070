//! The Kubernetes API source: watches Services and EndpointSlices with upstream's label
//! selector (both `service.kubernetes.io/headless` and `service.kubernetes.io/service-proxy-name`
//! absent) and this node's Node by field selector, using kube-runtime's watcher with backoff.
//!
//! A relist (after a 410 Gone or a reconnect) is framed by `Init … InitDone`; objects that
//! vanished meanwhile get no `Delete` event, so each kind's store is swapped whole at
//! `InitDone`, which turns them into deletions. Nothing is handed to the proxy before both
//! Services and EndpointSlices have been listed once (upstream's `isInitialized`). While the
//! API server is unreachable the store, and so the rules, stay as they are. Services and
//! EndpointSlices are converted to the model's entries as they arrive (`model::store`); the
//! k8s objects are not kept.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::daemon::ApiConfig;
use crate::model::store::{self, ObjectName, object_name};
use crate::model::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME, ServiceEntry, SliceEntry};

/// Upstream's informer label selector for Services and EndpointSlices.
pub fn label_selector() -> String {
    // Requirements sorted by key, as upstream serialises them.
    format!("!{LABEL_HEADLESS},!{LABEL_SERVICE_PROXY_NAME}")
}

/// One kind's objects by `(namespace, name)`, as converted on arrival, plus the relist buffer.
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

impl<T: PartialEq> KindStore<T> {
    /// Applies one watcher event, converting objects with `convert`; true if what the proxy
    /// sees changed (an update that converts to an equal entry changes nothing).
    fn apply<K: Resource>(&mut self, event: watcher::Event<K>, convert: impl Fn(&K) -> T) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                if let Some(buf) = self.relist.as_mut() {
                    buf.insert(object_name(o.meta()), convert(&o));
                }
                false
            }
            watcher::Event::InitDone => {
                // Objects missing from the new list were deleted while we were not watching.
                self.objects = self.relist.take().unwrap_or_default();
                self.synced = true;
                true
            }
            watcher::Event::Apply(o) => {
                let name = object_name(o.meta());
                let entry = convert(&o);
                if self.objects.get(&name) == Some(&entry) {
                    return false;
                }
                self.objects.insert(name, entry);
                true
            }
            watcher::Event::Delete(o) => self.objects.remove(&object_name(o.meta())).is_some(),
        }
    }
}

#[derive(Default)]
struct Watched {
    services: KindStore<Arc<ServiceEntry>>,
    slices: KindStore<Arc<SliceEntry>>,
    nodes: KindStore<Node>,
}

/// A running API source; the watchers stop when it is dropped.
pub struct ApiSource {
    store: Arc<Mutex<Watched>>,
    _runtime: tokio::runtime::Runtime,
}

impl ApiSource {
    /// Connects and starts the watchers; `changed` gets `()` after every change.
    pub fn start(cfg: &ApiConfig, node_name: &str, changed: Sender<()>) -> anyhow::Result<ApiSource> {
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
        runtime.spawn(watch(
            Api::<Service>::all(client.clone()),
            svc_cfg.clone(),
            store.clone(),
            changed.clone(),
            |w, e| w.services.apply(e, store::service_entry),
        ));
        runtime.spawn(watch(
            Api::<EndpointSlice>::all(client.clone()),
            svc_cfg,
            store.clone(),
            changed.clone(),
            {
                let node_name = node_name.to_string();
                move |w, e| w.slices.apply(e, |s| store::slice_entry(s, &node_name))
            },
        ));
        runtime.spawn(watch(
            Api::<Node>::all(client.clone()),
            node_cfg,
            store.clone(),
            changed,
            |w, e| w.nodes.apply(e, Node::clone),
        ));
        runtime.spawn(birth_cry(client, node_name.to_string()));
        Ok(ApiSource {
            store,
            _runtime: runtime,
        })
    }

    /// The objects seen so far; `None` until Services and EndpointSlices are both listed.
    pub fn snapshot(&self) -> Option<store::Store> {
        let w = self.store.lock().ok()?;
        if !(w.services.synced && w.slices.synced) {
            return None;
        }
        Some(store::Store {
            services: w.services.objects.clone(),
            slices: w.slices.objects.clone(),
            nodes: w.nodes.objects.values().cloned().collect(),
            ..store::Store::default()
        })
    }
}

async fn client(cfg: &ApiConfig) -> anyhow::Result<Client> {
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

async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    store: Arc<Mutex<Watched>>,
    changed: Sender<()>,
    apply: impl Fn(&mut Watched, watcher::Event<K>) -> bool + Send + 'static,
) where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    let name = K::kind(&K::DynamicType::default()).to_string();
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                let changed_view = match store.lock() {
                    Ok(mut w) => apply(&mut w, event),
                    Err(_) => return,
                };
                if changed_view && changed.send(()).is_err() {
                    return;
                }
            }
            // The backoff spaces retries; the store (and so the rules) stay as they are.
            Err(e) => warn!(kind = %name, error = %e, "Watch failed; retrying"),
        }
    }
}

/// Upstream's "Starting" event on the Node (its `birthCry`).
async fn birth_cry(client: Client, node_name: String) {
    let reporter = Reporter {
        controller: "kube-proxy".into(),
        instance: Some(node_name.clone()),
    };
    let recorder = Recorder::new(client, reporter);
    let node = ObjectReference {
        kind: Some("Node".into()),
        name: Some(node_name.clone()),
        uid: Some(node_name.clone()),
        api_version: Some("v1".into()),
        ..ObjectReference::default()
    };
    let event = KubeEvent {
        type_: EventType::Normal,
        reason: "Starting".into(),
        note: None,
        action: "StartKubeProxy".into(),
        secondary: None,
    };
    match recorder.publish(&event, &node).await {
        Ok(()) => info!(node = %node_name, "Emitted the Starting event"),
        Err(e) => warn!(error = %e, "Could not emit the Starting event"),
    }
}

/// The kubeconfig path kube-proxy would use without `--kubeconfig` (for messages).
pub fn default_kubeconfig() -> Option<PathBuf> {
    std::env::var_os("KUBECONFIG").map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str) -> Service {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("d".into());
        s
    }

    #[test]
    fn relist_turns_missing_objects_into_deletions() {
        let mut k = KindStore::<Arc<ServiceEntry>>::default();
        let conv = store::service_entry;
        for e in [
            watcher::Event::Init,
            watcher::Event::InitApply(svc("a")),
            watcher::Event::InitApply(svc("b")),
        ] {
            assert!(!k.apply(e, conv));
        }
        assert!(!k.synced);
        assert!(k.apply(watcher::Event::InitDone, conv));
        assert_eq!(k.objects.len(), 2);
        // Reconnect: only "a" is listed again; "b" vanished while we were away.
        k.apply(watcher::Event::Init, conv);
        assert_eq!(k.objects.len(), 2, "the old view stays until the relist is complete");
        k.apply(watcher::Event::InitApply(svc("a")), conv);
        assert!(k.apply(watcher::Event::InitDone, conv));
        let names: Vec<_> = k.objects.keys().map(|(ns, n)| format!("{ns}/{n}")).collect();
        assert_eq!(names, vec!["d/a"]);
        assert!(k.apply(watcher::Event::Apply(svc("c")), conv));
        assert!(
            !k.apply(watcher::Event::Apply(svc("c")), conv),
            "an update the proxy cannot see is no change"
        );
        assert!(k.apply(watcher::Event::Delete(svc("c")), conv));
        assert!(!k.apply(watcher::Event::Delete(svc("zzz")), conv));
    }

    #[test]
    fn selector_is_upstreams() {
        assert_eq!(
            label_selector(),
            "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
        );
    }
}
