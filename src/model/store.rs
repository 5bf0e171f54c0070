//! The objects the proxy keeps between syncs, in compact form: each Service and EndpointSlice
//! is converted once, when it arrives, into what the model needs from it (`ServiceEntry`,
//! `SliceEntry`); the k8s-openapi objects are not kept. Entries are shared (`Arc`) between a
//! source's own view and the snapshots it hands out, so a snapshot costs pointers, and two
//! snapshots compare entry by entry, mostly by pointer.
//!
//! Sources hand the daemon object-level [`Change`]s (a source knows what changed when an
//! event arrives or a file is re-read); the [`StateBuilder`] applies them to its store and
//! re-merges only the Services they touch. That is the one place a change is detected.
//!
//! At 10,000 Services × 10 endpoints the objects take ~62 MiB as k8s-openapi values and ~12
//! MiB as entries (see docs/nftables.md, "Daemon memory").

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::addr::parse_cidr_sloppy;
use super::endpoints::{EndpointMerge, SliceEntry};
use super::services::{ServiceEntry, sort_and_dedup};
use super::{IpFamily, NodeInfo, ProxyState, ServicePortName, ServicePortState};
use crate::manifest::Objects;

/// `(namespace, name)` of an object.
pub type ObjectName = (String, String);

/// The Services, EndpointSlices, Nodes and ServiceCIDRs a proxy sees, converted.
#[derive(Clone, Debug, Default)]
pub struct Store {
    pub services: BTreeMap<ObjectName, Arc<ServiceEntry>>,
    pub slices: BTreeMap<ObjectName, Arc<SliceEntry>>,
    /// Nodes are few (the API source watches only this node) and kept whole.
    pub nodes: Vec<Node>,
    pub service_cidrs: Vec<ServiceCIDR>,
    /// Problems with the set of objects itself (an object defined twice).
    pub warnings: Vec<String>,
}

/// The namespace of an object, defaulted as the API server defaults it.
pub fn object_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjectName {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".to_string()),
        meta.name.clone().unwrap_or_default(),
    )
}

impl Store {
    /// Converts `objects` as seen by the node `node_name` (which decides endpoint locality).
    /// An object defined twice keeps its first definition, with a warning.
    pub fn from_objects(objects: &Objects, node_name: &str) -> Store {
        let mut store = Store {
            nodes: objects.nodes.clone(),
            service_cidrs: objects.service_cidrs.clone(),
            ..Store::default()
        };
        for svc in &objects.services {
            store.insert_service(object_name(&svc.metadata), Arc::new(ServiceEntry::from_service(svc)));
        }
        for slice in &objects.endpoint_slices {
            store.insert_slice(
                object_name(&slice.metadata),
                Arc::new(SliceEntry::from_slice(slice, node_name)),
            );
        }
        store
    }

    /// Adds a Service unless one of that name is already there.
    pub fn insert_service(&mut self, name: ObjectName, entry: Arc<ServiceEntry>) {
        insert_first(&mut self.services, name, entry, "Service", &mut self.warnings);
    }

    /// Adds an EndpointSlice unless one of that name is already there.
    pub fn insert_slice(&mut self, name: ObjectName, entry: Arc<SliceEntry>) {
        insert_first(&mut self.slices, name, entry, "EndpointSlice", &mut self.warnings);
    }

    /// The state of `family` as the node `node` programs it: service ports sorted by name and
    /// protocol, each with its endpoints merged from all slices of its Service.
    pub fn state(&self, node: &NodeInfo, family: IpFamily) -> ProxyState {
        StateBuilder::with_store(self.clone()).build(node, family)
    }

    /// The changes that turn `old` into `self`, object by object (a source that re-reads a
    /// whole view, such as a manifest directory or a relist, compares its views this way).
    pub fn diff(&self, old: &Store) -> Vec<Change> {
        let mut out = Vec::new();
        for key in changed_keys(&old.services, &self.services) {
            out.push(Change::Service(key.clone(), self.services.get(key).cloned()));
        }
        for key in changed_keys(&old.slices, &self.slices) {
            out.push(Change::Slice(key.clone(), self.slices.get(key).cloned()));
        }
        if old.nodes != self.nodes {
            out.push(Change::Nodes(self.nodes.clone()));
        }
        if old.service_cidrs != self.service_cidrs {
            out.push(Change::ServiceCidrs(self.service_cidrs.clone()));
        }
        out
    }

    /// Applies one change; the entry it replaced, for the caller to compare.
    fn apply(&mut self, change: Change) -> Applied {
        match change {
            Change::Service(name, Some(entry)) => {
                self.services.insert(name, entry);
                Applied::Service
            }
            Change::Service(name, None) => {
                self.services.remove(&name);
                Applied::Service
            }
            Change::Slice(name, Some(entry)) => Applied::Slice(self.slices.insert(name, entry)),
            Change::Slice(name, None) => Applied::Slice(self.slices.remove(&name)),
            Change::Nodes(nodes) => Applied::Other(std::mem::replace(&mut self.nodes, nodes) != self.nodes),
            Change::ServiceCidrs(cidrs) => {
                Applied::Other(std::mem::replace(&mut self.service_cidrs, cidrs) != self.service_cidrs)
            }
            // Turned into deletions by the builder ([`StateBuilder::apply`]) before they come
            // here; alone they delete the Services or slices not listed.
            Change::ServicesListed(names) => {
                let before = self.services.len();
                self.services.retain(|k, _| names.contains(k));
                Applied::Other(self.services.len() != before)
            }
            Change::SlicesListed(names) => {
                let before = self.slices.len();
                self.slices.retain(|k, _| names.contains(k));
                Applied::Other(self.slices.len() != before)
            }
        }
    }

    /// `change`, with a relist's list of names turned into the deletions it means.
    fn expand(&self, change: Change, out: &mut Vec<Change>) {
        match change {
            Change::ServicesListed(names) => out.extend(
                self.services
                    .keys()
                    .filter(|k| !names.contains(*k))
                    .map(|k| Change::Service(k.clone(), None)),
            ),
            Change::SlicesListed(names) => out.extend(
                self.slices
                    .keys()
                    .filter(|k| !names.contains(*k))
                    .map(|k| Change::Slice(k.clone(), None)),
            ),
            other => out.push(other),
        }
    }
}

/// One object-level change, as a source hands it to the daemon.
#[derive(Clone, Debug)]
pub enum Change {
    /// A Service was added or changed (`Some`), or deleted (`None`).
    Service(ObjectName, Option<Arc<ServiceEntry>>),
    /// An EndpointSlice was added or changed, or deleted.
    Slice(ObjectName, Option<Arc<SliceEntry>>),
    /// The Nodes the source sees, whole (the API source watches only this node).
    Nodes(Vec<Node>),
    /// The ServiceCIDRs, whole.
    ServiceCidrs(Vec<ServiceCIDR>),
    /// A relist of Services completed: these are the names listed, and every other Service
    /// was deleted meanwhile (the listed versions come as changes of their own).
    ServicesListed(HashSet<ObjectName>),
    /// The same for EndpointSlices.
    SlicesListed(HashSet<ObjectName>),
}

/// What [`Store::apply`] replaced.
enum Applied {
    /// A Service (its old version is not needed: the builder compared before).
    Service,
    Slice(Option<Arc<SliceEntry>>),
    /// Whether the Nodes or ServiceCIDRs differ.
    Other(bool),
}

/// Keeps the objects (a [`Store`]) and builds the state of each family from them, merging
/// again only the Services whose Service object or EndpointSlices changed since that
/// family's previous build: a sync after one endpoint change costs that Service, not the
/// cluster (at 10k × 10, 82 ms for a whole build; see `cargo bench --bench render`).
pub struct StateBuilder {
    /// The objects as the changes applied so far left them.
    store: Store,
    /// The slices of each Service (sorted by name), by the Service they name: the store's
    /// entries themselves, not copies of their names. A `Vec`: most Services have one slice,
    /// and a set would allocate a whole tree node for it.
    slices_of: HashMap<ObjectName, Vec<Arc<SliceEntry>>>,
    /// IPv4, then IPv6.
    families: [FamilyCache; 2],
}

/// What the builder keeps for one family.
#[derive(Default)]
struct FamilyCache {
    /// Per Service with ports in this family, in name order: its service ports with merged
    /// endpoints, and the warnings found merging them.
    services: BTreeMap<ObjectName, (Vec<Arc<ServicePortState>>, Vec<String>)>,
    /// Services changed since this family was last built.
    dirty: BTreeSet<ObjectName>,
    /// EndpointSlices changed since then (their warnings).
    dirty_slices: BTreeSet<ObjectName>,
    /// The warnings of Service and EndpointSlice entries in this family, where there are any,
    /// and the Services whose merge found problems: a build gathers them without walking
    /// every object.
    service_warnings: BTreeMap<ObjectName, Vec<String>>,
    slice_warnings: BTreeMap<ObjectName, Vec<String>>,
    merge_warned: BTreeSet<ObjectName>,
    /// The service ports of the last build, handed back ([`StateBuilder::recycle`]) to be
    /// patched where Services changed instead of gathered again (10^4–10^5 `Arc`s).
    ports: Option<Vec<Arc<ServicePortState>>>,
    /// The last build's state has not been handed back yet.
    lent: bool,
    /// Built at least once: until then nothing is tracked (a family the node never builds
    /// must not collect changes forever), and the first build merges every Service.
    built: bool,
}

/// One service port that differs from the previous build of its family: its new version, or
/// `None` where it is gone.
pub type PortChange = (ServicePortName, Option<Arc<ServicePortState>>);

impl Default for StateBuilder {
    fn default() -> Self {
        StateBuilder::new()
    }
}

impl StateBuilder {
    pub fn new() -> StateBuilder {
        StateBuilder::with_store(Store::default())
    }

    /// A builder over `store` (whose Services all count as changed for each family's first
    /// build).
    pub fn with_store(store: Store) -> StateBuilder {
        let mut builder = StateBuilder {
            store: Store::default(),
            slices_of: HashMap::new(),
            families: [FamilyCache::default(), FamilyCache::default()],
        };
        builder.store.warnings = store.warnings.clone();
        builder.apply(store.diff(&Store::default()));
        builder
    }

    /// The objects as they stand.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Applies the changes a source reported and notes, for every family already built,
    /// which Services they touch; what actually changed (a change to an equal entry is none).
    pub fn apply(&mut self, changes: Vec<Change>) -> Changes {
        let mut summary = Changes::default();
        let mut dirty: BTreeSet<ObjectName> = BTreeSet::new();
        let mut dirty_slices: BTreeSet<ObjectName> = BTreeSet::new();
        let mut expanded = Vec::with_capacity(changes.len());
        for change in changes {
            self.store.expand(change, &mut expanded);
        }
        for change in expanded {
            match change {
                // A version equal to the one held changes nothing, and the one held stays
                // (a relist hands every object on again).
                Change::Service(name, entry) if same(self.store.services.get(&name), entry.as_ref()) => {}
                Change::Slice(name, entry) if same(self.store.slices.get(&name), entry.as_ref()) => {}
                // Not equal to the one held (above): a change.
                Change::Service(name, entry) => {
                    self.store.apply(Change::Service(name.clone(), entry));
                    summary.services += 1;
                    dirty.insert(name);
                }
                Change::Slice(name, entry) => {
                    let new = entry.clone();
                    let Applied::Slice(old) = self.store.apply(Change::Slice(name.clone(), entry)) else {
                        continue;
                    };
                    summary.slices += 1;
                    summary.triggers.extend(new.as_ref().and_then(|s| s.trigger_time));
                    self.move_slice(&name, old.as_deref(), new.as_ref(), &mut dirty);
                    dirty_slices.insert(name);
                }
                other => {
                    if let Applied::Other(changed) = self.store.apply(other) {
                        summary.others |= changed;
                    }
                }
            }
        }
        for cache in self.families.iter_mut().filter(|c| c.built) {
            cache.dirty.extend(dirty.iter().cloned());
            cache.dirty_slices.extend(dirty_slices.iter().cloned());
        }
        summary
    }

    /// Files the slice `key` under its new Service; both Services need merging again.
    fn move_slice(
        &mut self,
        key: &ObjectName,
        old: Option<&SliceEntry>,
        new: Option<&Arc<SliceEntry>>,
        dirty: &mut BTreeSet<ObjectName>,
    ) {
        if let Some(svc) = old.and_then(|s| s.service.as_ref()) {
            dirty.insert(svc.clone());
            if let Some(list) = self.slices_of.get_mut(svc) {
                if let Ok(i) = list.binary_search_by(|s| s.key.cmp(key)) {
                    list.remove(i);
                }
                if list.is_empty() {
                    self.slices_of.remove(svc);
                }
            }
        }
        if let Some(entry) = new
            && let Some(svc) = entry.service.as_ref()
        {
            dirty.insert(svc.clone());
            let list = self.slices_of.entry(svc.clone()).or_default();
            match list.binary_search_by(|s| s.key.cmp(key)) {
                Ok(i) => list[i] = entry.clone(),
                Err(i) => {
                    list.reserve_exact(1);
                    list.insert(i, entry.clone());
                }
            }
        }
    }

    /// The state of `family` as the node `node` programs it (see [`Store::state`]).
    pub fn build(&mut self, node: &NodeInfo, family: IpFamily) -> ProxyState {
        self.build_changed(node, family).0
    }

    /// As [`StateBuilder::build`], with the service ports that differ from the previous build
    /// of `family` (`None` at its first build: everything is new). Costs what changed, not
    /// the cluster, when the previous build's state was handed back
    /// ([`StateBuilder::recycle`]).
    pub fn build_changed(&mut self, node: &NodeInfo, family: IpFamily) -> (ProxyState, Option<Vec<PortChange>>) {
        let store = &self.store;
        let cache = &mut self.families[usize::from(family == IpFamily::V6)];
        let first = !cache.built;
        if first {
            cache.built = true;
            cache.dirty = store.services.keys().cloned().collect();
            cache.dirty_slices = store.slices.keys().cloned().collect();
        }
        let mut changed = Vec::new();
        for svc in std::mem::take(&mut cache.dirty) {
            let entry = store.services.get(&svc);
            set_warnings(
                &mut cache.service_warnings,
                &svc,
                entry.map_or(&[][..], |e| e.warnings(family)),
            );
            let old = cache.services.remove(&svc).map(|(p, _)| p).unwrap_or_default();
            let ports = entry.map_or(&[][..], |e| e.ports(family));
            let mut warnings = Vec::new();
            let mut states = Vec::with_capacity(ports.len());
            if !ports.is_empty() {
                let mut ports = ports.to_vec();
                sort_and_dedup(&mut ports, &mut warnings);
                let mut merge = EndpointMerge::default();
                for slice in self.slices_of.get(&svc).into_iter().flatten() {
                    merge.add(slice, family);
                }
                let mut endpoints = merge.finish();
                for port in ports {
                    let new = ServicePortState {
                        endpoints: endpoints.remove(&port.name).unwrap_or_default(),
                        port,
                    };
                    // An equal port keeps its allocation: later comparisons stop at the pointer.
                    match old.iter().find(|o| o.port.name == new.port.name) {
                        Some(o) if **o == new => states.push(o.clone()),
                        _ => {
                            let new = Arc::new(new);
                            changed.push((new.port.name.clone(), Some(new.clone())));
                            states.push(new);
                        }
                    }
                }
            }
            for o in &old {
                if !states.iter().any(|n| n.port.name == o.port.name) {
                    changed.push((o.port.name.clone(), None));
                }
            }
            if let Some(list) = cache.ports.as_mut()
                && !patch(list, &svc, &old, &states)
            {
                cache.ports = None;
            }
            if warnings.is_empty() {
                cache.merge_warned.remove(&svc);
            } else {
                cache.merge_warned.insert(svc.clone());
            }
            if !states.is_empty() {
                cache.services.insert(svc, (states, warnings));
            }
        }
        for name in std::mem::take(&mut cache.dirty_slices) {
            let warnings = store
                .slices
                .get(&name)
                .filter(|s| s.reported_in(family))
                .map_or(&[][..], |s| &s.warnings[..]);
            set_warnings(&mut cache.slice_warnings, &name, warnings);
        }

        // Names sort by namespace, then name: Services in name order give ports in order.
        let recycled = if cache.lent { None } else { cache.ports.take() };
        cache.ports = None;
        cache.lent = true;
        let service_ports = recycled.unwrap_or_else(|| {
            let mut all = Vec::with_capacity(cache.services.values().map(|(p, _)| p.len()).sum());
            for (ports, _) in cache.services.values() {
                all.extend(ports.iter().cloned());
            }
            all
        });
        let mut warnings = store.warnings.clone();
        warnings.extend(cache.service_warnings.values().flatten().cloned());
        warnings.extend(cache.slice_warnings.values().flatten().cloned());
        for svc in &cache.merge_warned {
            warnings.extend(cache.services.get(svc).into_iter().flat_map(|(_, w)| w.iter().cloned()));
        }
        let state = ProxyState {
            family,
            node: node.clone(),
            service_ports,
            service_cidrs: service_cidrs(&store.service_cidrs, family, &mut warnings),
            warnings,
        };
        (state, (!first).then_some(changed))
    }

    /// Hands back the state of the last build of its family, whose service ports the next
    /// build then patches instead of gathering them again.
    pub fn recycle(&mut self, state: ProxyState) {
        let cache = &mut self.families[usize::from(state.family == IpFamily::V6)];
        if cache.lent {
            cache.lent = false;
            cache.ports = Some(state.service_ports);
        }
    }
}

/// Replaces the service ports of `svc` in `list` (`old`, found by name) by `new`; `false` if
/// they are not where they should be (the list is then not the last build's).
fn patch(
    list: &mut Vec<Arc<ServicePortState>>,
    svc: &ObjectName,
    old: &[Arc<ServicePortState>],
    new: &[Arc<ServicePortState>],
) -> bool {
    fn key(p: &ServicePortState) -> (&str, &str) {
        (p.port.name.namespace.as_str(), p.port.name.name.as_str())
    }
    let target = (svc.0.as_str(), svc.1.as_str());
    let lo = list.partition_point(|p| key(p) < target);
    let hi = lo + list[lo..].partition_point(|p| key(p) == target);
    let here = &list[lo..hi];
    if here.len() != old.len() || here.iter().zip(old).any(|(a, b)| !Arc::ptr_eq(a, b)) {
        return false;
    }
    list.splice(lo..hi, new.iter().cloned());
    true
}

/// Keeps `warnings` as `name`'s in `map`, or drops its entry when there are none.
fn set_warnings(map: &mut BTreeMap<ObjectName, Vec<String>>, name: &ObjectName, warnings: &[String]) {
    if warnings.is_empty() {
        map.remove(name);
    } else if map.get(name).is_none_or(|w| w[..] != *warnings) {
        map.insert(name.clone(), warnings.to_vec());
    }
}

fn insert_first<T>(
    map: &mut BTreeMap<ObjectName, Arc<T>>,
    name: ObjectName,
    entry: Arc<T>,
    kind: &str,
    warnings: &mut Vec<String>,
) {
    match map.entry(name) {
        std::collections::btree_map::Entry::Vacant(v) => {
            v.insert(entry);
        }
        std::collections::btree_map::Entry::Occupied(o) => {
            let (ns, name) = o.key();
            warnings.push(format!(
                "{kind} {ns}/{name}: defined more than once; the first definition is used"
            ));
        }
    }
}

/// Whether two versions of an entry are equal (equal pointers are equal entries).
fn same<T: PartialEq>(a: Option<&Arc<T>>, b: Option<&Arc<T>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
        (None, None) => true,
        _ => false,
    }
}

/// Keys whose entries differ (added, removed or changed); equal pointers are equal entries.
fn changed_keys<'a, T: PartialEq>(
    old: &'a BTreeMap<ObjectName, Arc<T>>,
    new: &'a BTreeMap<ObjectName, Arc<T>>,
) -> Vec<&'a ObjectName> {
    // One walk over both maps in key order (no lookups: this runs on every change).
    let mut out = Vec::new();
    let (mut a, mut b) = (old.iter().peekable(), new.iter().peekable());
    loop {
        match (a.peek(), b.peek()) {
            (None, None) => return out,
            (Some((k, _)), None) => {
                out.push(*k);
                a.next();
            }
            (None, Some((k, _))) => {
                out.push(*k);
                b.next();
            }
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(kb) {
                std::cmp::Ordering::Less => {
                    out.push(*ka);
                    a.next();
                }
                std::cmp::Ordering::Greater => {
                    out.push(*kb);
                    b.next();
                }
                std::cmp::Ordering::Equal => {
                    if !Arc::ptr_eq(va, vb) && va != vb {
                        out.push(*kb);
                    }
                    a.next();
                    b.next();
                }
            },
        }
    }
}

/// ServiceCIDRs of `family` (nftables mode's cluster-ips check).
fn service_cidrs(list: &[ServiceCIDR], family: IpFamily, warnings: &mut Vec<String>) -> Vec<IpNet> {
    let mut out = Vec::new();
    for sc in list {
        let name = sc.metadata.name.as_deref().unwrap_or("<unnamed>");
        let cidrs = sc.spec.as_ref().and_then(|s| s.cidrs.as_ref());
        for (i, cidr) in cidrs.into_iter().flatten().enumerate() {
            match parse_cidr_sloppy(cidr) {
                Some(net) if family.contains(&net.addr()) => out.push(net.trunc()),
                Some(_) => {}
                None => warnings.push(format!(
                    "ServiceCIDR {name}: field spec.cidrs[{i}]: invalid CIDR {cidr:?}; skipped"
                )),
            }
        }
    }
    out
}

/// What a batch of changes changed, as [`StateBuilder::apply`] found it.
#[derive(Debug, Default)]
pub struct Changes {
    /// Services added, changed or removed.
    pub services: usize,
    /// EndpointSlices added, changed or removed.
    pub slices: usize,
    /// Nodes or ServiceCIDRs changed.
    pub others: bool,
    /// `last-change-trigger-time` of the changed slices that have one
    /// (`network_programming_duration_seconds`).
    pub triggers: Vec<SystemTime>,
}

impl Changes {
    pub fn any(&self) -> bool {
        self.services > 0 || self.slices > 0 || self.others
    }
}

/// Converts one Service (what a watcher does when it arrives).
pub fn service_entry(svc: &Service) -> Arc<ServiceEntry> {
    Arc::new(ServiceEntry::from_service(svc))
}

/// Converts one EndpointSlice as seen by the node `node_name`.
pub fn slice_entry(slice: &EndpointSlice, node_name: &str) -> Arc<SliceEntry> {
    Arc::new(SliceEntry::from_slice(slice, node_name))
}

/// A ServiceCIDR reduced to what the proxy reads, its name and CIDRs, whichever API version it
/// came in (`networking.k8s.io/v1` or `v1beta1` share the fields): an update that changes
/// neither (status, labels, resource version) converts to an equal entry.
pub fn service_cidr_entry(name: Option<&str>, cidrs: Option<&[String]>) -> ServiceCIDR {
    ServiceCIDR {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: name.map(str::to_string),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::networking::v1::ServiceCIDRSpec {
            cidrs: cidrs.map(<[String]>::to_vec),
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::load_str;

    fn objects(yaml: &str) -> Objects {
        let mut o = Objects::default();
        load_str(std::path::Path::new("test.yaml"), yaml, &mut o).expect("parses");
        o
    }

    const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: d\n  labels: {kubernetes.io/service-name: web}\n  annotations: {endpoints.kubernetes.io/last-change-trigger-time: \"2026-01-01T00:00:00Z\"}\naddressType: IPv4\nports: [{name: \"\", port: 8080}]\nendpoints:\n- {addresses: [10.1.0.1], nodeName: node-a}\n- {addresses: [10.1.0.2], nodeName: node-b}\n";

    #[test]
    fn an_entry_is_held_once_and_an_equal_version_changes_nothing() {
        let o = objects(WEB);
        let key = ("d".to_string(), "web-1".to_string());
        let slice = slice_entry(&o.endpoint_slices[0], "node-a");
        let mut b = StateBuilder::new();
        let node = NodeInfo::default();
        b.build(&node, IpFamily::V4);
        let svc = Change::Service(("d".into(), "web".into()), Some(service_entry(&o.services[0])));
        let first = b.apply(vec![svc, Change::Slice(key.clone(), Some(slice.clone()))]);
        assert_eq!((first.services, first.slices), (1, 1));
        // The store's and the index of slices by Service: the same entry, not a copy.
        assert_eq!(Arc::strong_count(&slice), 3);
        let again = slice_entry(&o.endpoint_slices[0], "node-a");
        assert!(!b.apply(vec![Change::Slice(key.clone(), Some(again.clone()))]).any());
        assert_eq!(Arc::strong_count(&again), 1, "the equal version is not kept");
        assert!(Arc::ptr_eq(&b.store().slices[&key], &slice));
        // A new version replaces it in both.
        let mut changed = (*slice).clone();
        changed.endpoints.pop();
        let changed = Arc::new(changed);
        assert_eq!(b.apply(vec![Change::Slice(key, Some(changed.clone()))]).slices, 1);
        assert_eq!(Arc::strong_count(&slice), 1);
        assert_eq!(Arc::strong_count(&changed), 3);
        let state = b.build(&node, IpFamily::V4);
        assert_eq!(state.service_ports[0].endpoints.len(), 1);
    }

    #[test]
    fn state_merges_entries_and_decides_locality_on_arrival() {
        let store = Store::from_objects(&objects(WEB), "node-a");
        let node = NodeInfo {
            name: "node-a".into(),
            ..NodeInfo::default()
        };
        let state = store.state(&node, IpFamily::V4);
        assert_eq!(state.service_ports.len(), 1);
        let eps = &state.service_ports[0].endpoints;
        assert_eq!(
            eps.iter().map(|e| (e.to_string(), e.is_local)).collect::<Vec<_>>(),
            vec![
                ("10.1.0.1:8080".to_string(), true),
                ("10.1.0.2:8080".to_string(), false)
            ]
        );
        assert!(store.state(&node, IpFamily::V6).service_ports.is_empty());
    }

    #[test]
    fn changes_count_objects_and_collect_trigger_times() {
        let a = Store::from_objects(&objects(WEB), "node-a");
        let mut builder = StateBuilder::with_store(a.clone());
        let same = Store::from_objects(&objects(WEB), "node-a");
        assert!(same.diff(&a).is_empty(), "equal entries are no change");
        // A source that sends equal entries anyway (new allocations) changes nothing either.
        let resent: Vec<Change> = same
            .services
            .iter()
            .map(|(k, v)| Change::Service(k.clone(), Some(v.clone())))
            .collect();
        assert!(!builder.apply(resent).any(), "equal entries are no change");
        let b = Store::from_objects(&objects(&WEB.replace("10.1.0.2", "10.1.0.3")), "node-a");
        let c = builder.apply(b.diff(&a));
        assert_eq!((c.services, c.slices, c.others), (0, 1, false));
        assert_eq!(c.triggers.len(), 1);
        let none = Store::default();
        let c = builder.apply(none.diff(&b));
        assert_eq!((c.services, c.slices), (1, 1), "deletions count");
        assert!(c.triggers.is_empty(), "a deleted slice has no trigger time");
    }

    #[test]
    fn a_family_built_late_is_complete_and_an_unbuilt_one_tracks_nothing() {
        let node = NodeInfo {
            name: "node-a".into(),
            ..NodeInfo::default()
        };
        let dual = WEB.replace(
            "clusterIP: 10.96.0.1,",
            "clusterIP: 10.96.0.1, clusterIPs: [10.96.0.1, \"fd00::1\"],",
        ) + "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-6\n  namespace: d\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv6\nports: [{name: \"\", port: 8080}]\nendpoints:\n- {addresses: [\"fd00:10::1\"]}\n";
        let first = Store::from_objects(&objects(WEB), "node-a");
        let mut builder = StateBuilder::with_store(first.clone());
        builder.build(&node, IpFamily::V4);
        let store = Store::from_objects(&objects(&dual), "node-a");
        builder.apply(store.diff(&first));
        builder.build(&node, IpFamily::V4);
        assert!(
            builder.families[1].dirty.is_empty(),
            "IPv6 was never built: nothing tracked"
        );
        let v6 = builder.build(&node, IpFamily::V6);
        assert_eq!(v6.service_ports, store.state(&node, IpFamily::V6).service_ports);
        assert_eq!(v6.service_ports.len(), 1);
        assert_eq!(v6.service_ports[0].endpoints.len(), 1);
    }

    #[test]
    fn an_object_defined_twice_keeps_its_first_definition() {
        let twice = format!("{WEB}---\n{}", WEB.replace("port: 80", "port: 81"));
        let store = Store::from_objects(&objects(&twice), "node-a");
        let state = store.state(&NodeInfo::default(), IpFamily::V4);
        assert_eq!(state.service_ports.len(), 1);
        assert_eq!(state.service_ports[0].port.port, 80);
        assert!(
            state
                .warnings
                .iter()
                .any(|w| w == "Service d/web: defined more than once; the first definition is used"),
            "{:?}",
            state.warnings
        );
    }

    mod incremental {
        use proptest::prelude::*;

        use super::*;
        use crate::model::{endpoints_by_service_port, service_ports};

        /// A small cluster: Services s0..s3 (some dual-port), slices of them (some moved to
        /// another Service, some with a duplicate endpoint or a bad address).
        fn object(kind: u8, n: u8, variant: u8) -> String {
            let svc = n % 4;
            if kind == 0 {
                let second = if variant % 2 == 1 { ", {name: b, port: 81}" } else { "" };
                format!(
                    "apiVersion: v1\nkind: Service\nmetadata: {{name: s{svc}, namespace: d}}\nspec: {{clusterIP: 10.96.0.{svc}, ports: [{{name: a, port: 80}}{second}]}}\n"
                )
            } else {
                let owner = (svc + variant / 4) % 5; // s4 has no Service
                let bad = if variant.is_multiple_of(3) {
                    "\n- {addresses: [not-an-ip]}"
                } else {
                    ""
                };
                format!(
                    "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: e{n}\n  namespace: d\n  labels: {{kubernetes.io/service-name: s{owner}}}\naddressType: IPv4\nports: [{{name: a, port: 8080}}, {{name: b, port: 8081}}]\nendpoints:\n- {{addresses: [10.1.{svc}.{}], nodeName: node-{}}}\n- {{addresses: [10.1.0.1], nodeName: node-a}}{bad}\n",
                    variant % 7,
                    if variant.is_multiple_of(2) { "a" } else { "b" }
                )
            }
        }

        /// The state as the whole-cluster functions compute it from k8s objects.
        fn reference(objects: &Objects, node: &NodeInfo) -> Vec<Arc<ServicePortState>> {
            let mut warnings = Vec::new();
            let mut eps = endpoints_by_service_port(&objects.endpoint_slices, IpFamily::V4, &node.name, &mut warnings);
            service_ports(&objects.services, IpFamily::V4, &mut warnings)
                .into_iter()
                .map(|port| {
                    Arc::new(ServicePortState {
                        endpoints: eps.remove(&port.name).unwrap_or_default(),
                        port,
                    })
                })
                .collect()
        }

        proptest! {
            /// After any sequence of additions, changes and removals, the incremental state
            /// equals the one computed from scratch from the same objects.
            #[test]
            fn incremental_builds_equal_whole_builds(steps in proptest::collection::vec((0u8..2, 0u8..6, 0u8..12, any::<bool>()), 1..30)) {
                let node = NodeInfo { name: "node-a".into(), ..NodeInfo::default() };
                let mut present: BTreeMap<(u8, u8), String> = BTreeMap::new();
                let mut builder = StateBuilder::new();
                let mut previous = Store::default();
                let mut last: Option<Vec<Arc<ServicePortState>>> = None;
                for (step, (kind, n, variant, remove)) in steps.into_iter().enumerate() {
                    let n = if kind == 0 { n % 4 } else { n };
                    if remove {
                        present.remove(&(kind, n));
                    } else {
                        present.insert((kind, n), object(kind, n, variant));
                    }
                    let mut objects = Objects::default();
                    let text = present.values().cloned().collect::<Vec<_>>().join("---\n");
                    crate::manifest::load_str(std::path::Path::new("p.yaml"), &text, &mut objects).expect("parses");
                    let store = Store::from_objects(&objects, "node-a");
                    builder.apply(store.diff(&previous));
                    let (built, changed) = builder.build_changed(&node, IpFamily::V4);
                    prop_assert_eq!(&built.service_ports, &reference(&objects, &node));
                    let fresh = store.state(&node, IpFamily::V4);
                    prop_assert_eq!(&built.warnings, &fresh.warnings);
                    // The changes turn the previous build into this one.
                    match (last.take(), changed) {
                        (None, None) => {}
                        (Some(before), Some(changed)) => {
                            let mut ports: BTreeMap<ServicePortName, Arc<ServicePortState>> =
                                before.into_iter().map(|p| (p.port.name.clone(), p)).collect();
                            for (name, new) in changed {
                                match new {
                                    Some(new) => ports.insert(name, new),
                                    None => ports.remove(&name),
                                };
                            }
                            let now: BTreeMap<_, _> = built.service_ports.iter().map(|p| (p.port.name.clone(), p.clone())).collect();
                            prop_assert_eq!(ports, now);
                        }
                        (before, changed) => prop_assert!(false, "changes {:?} after {:?}", changed.is_some(), before.is_some()),
                    }
                    last = Some(built.service_ports.clone());
                    // Every other build patches the previous one's ports.
                    if step % 2 == 0 {
                        builder.recycle(built);
                    }
                    previous = store;
                }
            }
        }
    }
}
