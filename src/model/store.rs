//! The objects the proxy keeps between syncs, in compact form: each Service and EndpointSlice
//! is converted once, when it arrives, into what the model needs from it (`ServiceEntry`,
//! `SliceEntry`); the k8s-openapi objects are not kept. Entries are shared (`Arc`) between a
//! source's own view and the snapshots it hands out, so a snapshot costs pointers, and two
//! snapshots compare entry by entry, mostly by pointer.
//!
//! At 10,000 Services × 10 endpoints the objects take ~62 MiB as k8s-openapi values and ~12
//! MiB as entries (see docs/nftables.md, "Daemon memory").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::endpoints::{EndpointMerge, SliceEntry};
use super::services::{ServiceEntry, sort_and_dedup};
use super::{IpFamily, NodeInfo, ProxyState, ServicePortState};
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
        StateBuilder::new().build(self, node, family)
    }

    /// What changed from `old` to `self`, object by object.
    pub fn changes_since(&self, old: &Store) -> Changes {
        let services = changed_keys(&old.services, &self.services).len();
        let changed_slices = changed_keys(&old.slices, &self.slices);
        let triggers = changed_slices
            .iter()
            .filter_map(|k| self.slices.get(*k))
            .filter_map(|s| s.trigger_time)
            .collect();
        Changes {
            services,
            slices: changed_slices.len(),
            others: old.nodes != self.nodes || old.service_cidrs != self.service_cidrs,
            triggers,
        }
    }
}

/// Builds the state of one family from successive snapshots of a store, merging again only
/// the Services whose Service object or EndpointSlices changed since the previous build: a
/// sync after one endpoint change costs that Service, not the cluster (at 10k × 10, 82 ms
/// for a whole build; see `cargo bench --bench render`).
pub struct StateBuilder {
    /// The snapshot of the previous build (its entries are shared, not copied).
    last: Store,
    /// The slices of each Service (sorted), by the Service they name. A `Vec`: most Services
    /// have one slice, and a set would allocate a whole tree node for it.
    slices_of: HashMap<ObjectName, Vec<ObjectName>>,
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
    /// Built at least once: until then nothing is tracked (a family the node never builds
    /// must not collect changes forever), and the first build merges every Service.
    built: bool,
}

impl Default for StateBuilder {
    fn default() -> Self {
        StateBuilder::new()
    }
}

impl StateBuilder {
    pub fn new() -> StateBuilder {
        StateBuilder {
            last: Store::default(),
            slices_of: HashMap::new(),
            families: [FamilyCache::default(), FamilyCache::default()],
        }
    }

    /// Notes which Services changed from the previous snapshot to `store`, for every family.
    fn advance(&mut self, store: &Store) {
        let mut dirty: BTreeSet<ObjectName> = changed_keys(&self.last.services, &store.services)
            .into_iter()
            .cloned()
            .collect();
        let changed_slices = changed_keys(&self.last.slices, &store.slices);
        if dirty.is_empty() && changed_slices.is_empty() {
            // Also the second family's build after the first one's.
            return;
        }
        for key in changed_slices {
            if let Some(svc) = self.last.slices.get(key).and_then(|s| s.service.as_ref()) {
                dirty.insert(svc.clone());
                if let Some(list) = self.slices_of.get_mut(svc) {
                    if let Ok(i) = list.binary_search(key) {
                        list.remove(i);
                    }
                    if list.is_empty() {
                        self.slices_of.remove(svc);
                    }
                }
            }
            if let Some(svc) = store.slices.get(key).and_then(|s| s.service.as_ref()) {
                dirty.insert(svc.clone());
                let list = self.slices_of.entry(svc.clone()).or_default();
                if let Err(i) = list.binary_search(key) {
                    list.reserve_exact(1);
                    list.insert(i, key.clone());
                }
            }
        }
        for cache in self.families.iter_mut().filter(|c| c.built) {
            cache.dirty.extend(dirty.iter().cloned());
        }
        self.last = store.clone();
    }

    /// The state of `family` in `store` as the node `node` programs it (see [`Store::state`]).
    pub fn build(&mut self, store: &Store, node: &NodeInfo, family: IpFamily) -> ProxyState {
        self.advance(store);
        let cache = &mut self.families[usize::from(family == IpFamily::V6)];
        if !cache.built {
            cache.built = true;
            cache.dirty = store.services.keys().cloned().collect();
        }
        for svc in std::mem::take(&mut cache.dirty) {
            let ports = store.services.get(&svc).map_or(&[][..], |e| e.ports(family));
            if ports.is_empty() {
                cache.services.remove(&svc);
                continue;
            }
            let mut warnings = Vec::new();
            let mut ports = ports.to_vec();
            sort_and_dedup(&mut ports, &mut warnings);
            let mut merge = EndpointMerge::default();
            for slice in self.slices_of.get(&svc).into_iter().flatten() {
                if let Some(slice) = store.slices.get(slice) {
                    merge.add(slice, family);
                }
            }
            let mut endpoints = merge.finish();
            let mut states = Vec::with_capacity(ports.len());
            for port in ports {
                states.push(Arc::new(ServicePortState {
                    endpoints: endpoints.remove(&port.name).unwrap_or_default(),
                    port,
                }));
            }
            cache.services.insert(svc, (states, warnings));
        }

        let mut warnings = store.warnings.clone();
        for entry in store.services.values() {
            warnings.extend(entry.warnings(family).iter().cloned());
        }
        for entry in store.slices.values().filter(|s| s.reported_in(family)) {
            warnings.extend(entry.warnings.iter().cloned());
        }
        // Names sort by namespace, then name: Services in name order give ports in order.
        let mut service_ports = Vec::with_capacity(cache.services.values().map(|(p, _)| p.len()).sum());
        for (ports, merge_warnings) in cache.services.values() {
            service_ports.extend(ports.iter().cloned());
            warnings.extend(merge_warnings.iter().cloned());
        }
        ProxyState {
            family,
            node: node.clone(),
            service_ports,
            service_cidrs: service_cidrs(&store.service_cidrs, family, &mut warnings),
            warnings,
        }
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
            match cidr.trim().parse::<IpNet>() {
                Ok(net) if family.contains(&net.addr()) => out.push(net.trunc()),
                Ok(_) => {}
                Err(_) => warnings.push(format!(
                    "ServiceCIDR {name}: field spec.cidrs[{i}]: invalid CIDR {cidr:?}; skipped"
                )),
            }
        }
    }
    out
}

/// What changed between two snapshots of a [`Store`].
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
        let same = Store::from_objects(&objects(WEB), "node-a");
        assert!(!same.changes_since(&a).any(), "equal entries are no change");
        let b = Store::from_objects(&objects(&WEB.replace("10.1.0.2", "10.1.0.3")), "node-a");
        let c = b.changes_since(&a);
        assert_eq!((c.services, c.slices, c.others), (0, 1, false));
        assert_eq!(c.triggers.len(), 1);
        let none = Store::default();
        let c = none.changes_since(&a);
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
        let mut builder = StateBuilder::new();
        builder.build(&Store::from_objects(&objects(WEB), "node-a"), &node, IpFamily::V4);
        let store = Store::from_objects(&objects(&dual), "node-a");
        builder.build(&store, &node, IpFamily::V4);
        assert!(
            builder.families[1].dirty.is_empty(),
            "IPv6 was never built: nothing tracked"
        );
        let v6 = builder.build(&store, &node, IpFamily::V6);
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
                for (kind, n, variant, remove) in steps {
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
                    let built = builder.build(&store, &node, IpFamily::V4);
                    prop_assert_eq!(&built.service_ports, &reference(&objects, &node));
                    let fresh = store.state(&node, IpFamily::V4);
                    prop_assert_eq!(&built.warnings, &fresh.warnings);
                }
            }
        }
    }
}
