//! The objects the proxy keeps between syncs, in compact form: each Service and EndpointSlice
//! is converted once, when it arrives, into what the model needs from it (`ServiceEntry`,
//! `SliceEntry`); the k8s-openapi objects are not kept. Entries are shared (`Arc`) between a
//! source's own view and the snapshots it hands out, so a snapshot costs pointers, and two
//! snapshots compare entry by entry, mostly by pointer.
//!
//! At 10,000 Services × 10 endpoints the objects take ~62 MiB as k8s-openapi values and ~12
//! MiB as entries (see docs/nftables.md, "Daemon memory").

use std::collections::BTreeMap;
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
        let mut warnings = self.warnings.clone();
        let mut ports = Vec::new();
        for entry in self.services.values() {
            ports.extend_from_slice(entry.ports(family));
            warnings.extend(entry.warnings(family).iter().cloned());
        }
        sort_and_dedup(&mut ports, &mut warnings);
        let mut merge = EndpointMerge::default();
        for entry in self.slices.values() {
            merge.add(entry, family, &mut warnings);
        }
        let mut endpoints = merge.finish();
        let service_ports = ports
            .into_iter()
            .map(|port| {
                let eps = endpoints.remove(&port.name).unwrap_or_default();
                ServicePortState { port, endpoints: eps }
            })
            .collect();
        ProxyState {
            family,
            node: node.clone(),
            service_ports,
            service_cidrs: service_cidrs(&self.service_cidrs, family, &mut warnings),
            warnings,
        }
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

    /// Whether any Service has a cluster IP of `family` (to choose the families to render).
    pub fn uses_family(&self, family: IpFamily) -> bool {
        let i = usize::from(family == IpFamily::V6);
        self.services.values().any(|s| s.cluster_ip_families[i])
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
    let mut out: Vec<&ObjectName> = new
        .iter()
        .filter(|(k, v)| old.get(*k).is_none_or(|o| !Arc::ptr_eq(o, v) && o != *v))
        .map(|(k, _)| k)
        .collect();
    out.extend(old.keys().filter(|k| !new.contains_key(*k)));
    out
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
        assert!(store.uses_family(IpFamily::V4) && !store.uses_family(IpFamily::V6));
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
}
