//! EndpointSlices → the endpoints of each service port, as upstream's EndpointSlice cache
//! merges them: all slices of a Service, matched by port name and protocol, conditions with
//! their nil defaults, locality, family filtering and de-duplication by `ip:port`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::addr::parse_ip_sloppy;
use super::places::Place;
use super::{
    IpFamily, LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, Protocol, ServicePortName, is_valid_label,
    is_valid_name, is_valid_port_name,
};

/// One endpoint of one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    /// `nodeName` equals this node's name.
    pub is_local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub zone_hints: Hints,
    pub node_hints: Hints,
    /// Its `nodeName` and `zone` (shown by `explain`; locality is `is_local`).
    pub place: Place,
}

/// Topology hints of an endpoint (zone or node names). Most endpoints have none: an empty
/// list is one null pointer, which keeps `Endpoint` at 40 bytes (10^5 of them at 10k × 10).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[allow(clippy::box_collection)] // a thin pointer on purpose: `Box<[String]>` would take 16 bytes
pub struct Hints(Option<Box<Vec<String>>>);

impl Hints {
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0
            .as_ref()
            .is_some_and(|v| v.binary_search_by(|h| h.as_str().cmp(name)).is_ok())
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().flat_map(|v| v.iter().map(String::as_str))
    }
}

impl FromIterator<String> for Hints {
    fn from_iter<I: IntoIterator<Item = String>>(iter: I) -> Hints {
        let mut v: Vec<String> = iter.into_iter().collect();
        v.sort();
        v.dedup();
        Hints((!v.is_empty()).then(|| Box::new(v)))
    }
}

impl Endpoint {
    /// A ready, serving, non-terminating endpoint on another node, without hints.
    pub fn ready(ip: IpAddr, port: u16) -> Endpoint {
        Endpoint {
            ip,
            port,
            is_local: false,
            ready: true,
            serving: true,
            terminating: false,
            zone_hints: Hints::default(),
            node_hints: Hints::default(),
            place: Place::default(),
        }
    }
}

impl fmt::Display for Endpoint {
    /// `ip:port`, or `[ip]:port` for IPv6 (Go's `net.JoinHostPort`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.port),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

/// Groups the endpoints of all usable slices by service port. Each list is sorted by the
/// endpoint's `ip:port` string, as upstream sorts it.
pub fn endpoints_by_service_port(
    slices: &[EndpointSlice],
    family: IpFamily,
    node_name: &str,
    warnings: &mut Vec<String>,
) -> HashMap<ServicePortName, Vec<Endpoint>> {
    // Slices in a stable order (namespace, name) so that de-duplication is deterministic.
    let mut entries: Vec<SliceEntry> = slices.iter().map(|s| SliceEntry::from_slice(s, node_name)).collect();
    entries.sort_by(|a, b| a.key.cmp(&b.key));
    let mut merged = EndpointMerge::default();
    for entry in &entries {
        if entry.reported_in(family) {
            warnings.extend(entry.warnings.iter().cloned());
        }
        merged.add(entry, family);
    }
    merged.finish()
}

/// One EndpointSlice reduced to what the proxy uses, converted once when the slice arrives:
/// its Service, family, ports and endpoints (port 0 until merged with a port), and what was
/// wrong with it. Locality is decided here, against this node's name.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceEntry {
    /// `(namespace, name)` of the slice itself.
    pub key: (String, String),
    /// `(namespace, name)` of its Service; `None` when the slice is not usable at all.
    pub service: Option<(String, String)>,
    /// The slice's address family; `None` for FQDN and unusable slices.
    pub family: Option<IpFamily>,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, for the network-programming latency.
    pub trigger_time: Option<std::time::SystemTime>,
    /// Problems found converting it, each naming the slice and the field.
    pub warnings: Vec<String>,
}

/// A port of an EndpointSlice that can be matched with a service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// The annotation holding when the change behind a slice's last update was triggered.
const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

impl SliceEntry {
    /// Converts `slice` as seen by the node `node_name`.
    pub fn from_slice(slice: &EndpointSlice, node_name: &str) -> SliceEntry {
        let namespace = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string());
        let slice_name = slice.metadata.name.clone().unwrap_or_default();
        let mut entry = SliceEntry {
            key: (namespace, slice_name),
            service: None,
            family: None,
            ports: Vec::new(),
            endpoints: Vec::new(),
            trigger_time: slice
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
                .and_then(|v| v.parse::<jiff::Timestamp>().ok())
                .map(std::time::SystemTime::from),
            warnings: Vec::new(),
        };
        entry.convert(slice, node_name);
        entry
    }

    fn convert(&mut self, slice: &EndpointSlice, node_name: &str) {
        let (namespace, slice_name) = &self.key;
        let warnings = &mut self.warnings;
        let id = format!("EndpointSlice {namespace}/{slice_name}");
        if !is_valid_label(namespace) || !is_valid_name(slice_name) {
            warnings.push(format!(
                "EndpointSlice {namespace:?}/{slice_name:?}: field metadata.name/namespace: not a valid Kubernetes name; skipped"
            ));
            return;
        }
        let labels = slice.metadata.labels.as_ref();
        let label = |key: &str| labels.and_then(|l| l.get(key));
        if label(LABEL_SERVICE_PROXY_NAME).is_some() || label(LABEL_HEADLESS).is_some() {
            return;
        }
        let Some(service) = label(LABEL_SERVICE_NAME) else {
            warnings.push(format!(
                "{id}: field metadata.labels: no {LABEL_SERVICE_NAME} label; slice skipped"
            ));
            return;
        };
        if !is_valid_label(service) {
            warnings.push(format!(
                "{id}: field metadata.labels[{LABEL_SERVICE_NAME}]: {service:?} is not a valid Service name; slice skipped"
            ));
            return;
        }
        let family = match slice.address_type.as_str() {
            "IPv4" => IpFamily::V4,
            "IPv6" => IpFamily::V6,
            "FQDN" => return,
            other => {
                warnings.push(format!(
                    "{id}: field addressType: unknown address type {other:?}; slice skipped"
                ));
                return;
            }
        };

        for (i, ep) in slice.endpoints.iter().enumerate() {
            let Some(raw) = ep.addresses.first() else {
                warnings.push(format!("{id}: field endpoints[{i}].addresses: empty; endpoint skipped"));
                continue;
            };
            let Some(ip) = parse_ip_sloppy(raw) else {
                warnings.push(format!(
                    "{id}: field endpoints[{i}].addresses[0]: invalid IP {raw:?}; endpoint skipped"
                ));
                continue;
            };
            if !family.contains(&ip) {
                warnings.push(format!(
                    "{id}: field endpoints[{i}].addresses[0]: {ip} is an {} address in an {} slice; endpoint skipped",
                    IpFamily::of(&ip),
                    family
                ));
                continue;
            }
            if self.endpoints.iter().any(|e: &Endpoint| e.ip == ip) {
                warnings.push(format!(
                    "{id}: field endpoints[{i}].addresses[0]: duplicate endpoint {ip}; skipped"
                ));
                continue;
            }
            let cond = ep.conditions.as_ref();
            let hints = ep.hints.as_ref();
            self.endpoints.push(Endpoint {
                ip,
                port: 0,
                is_local: ep.node_name.as_deref().is_some_and(|n| n == node_name),
                // Upstream's nil defaults: ready and serving default to true, terminating to false.
                ready: cond.and_then(|c| c.ready).unwrap_or(true),
                serving: cond.and_then(|c| c.serving).unwrap_or(true),
                terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
                zone_hints: hints
                    .and_then(|h| h.for_zones.as_ref())
                    .into_iter()
                    .flatten()
                    .map(|z| z.name.clone())
                    .collect(),
                node_hints: hints
                    .and_then(|h| h.for_nodes.as_ref())
                    .into_iter()
                    .flatten()
                    .map(|n| n.name.clone())
                    .collect(),
                place: Place::new(ep.node_name.as_deref(), ep.zone.as_deref()),
            });
        }

        for (i, port) in slice.ports.iter().flatten().enumerate() {
            // Ports without a name or number carry no usable information.
            let (Some(port_name), Some(number)) = (port.name.clone(), port.port) else {
                continue;
            };
            if !is_valid_port_name(&port_name) {
                warnings.push(format!(
                    "{id}: field ports[{i}].name: invalid port name {port_name:?}; port skipped"
                ));
                continue;
            }
            if number == 0 {
                continue;
            }
            if !(1..=65535).contains(&number) {
                warnings.push(format!(
                    "{id}: field ports[{i}].port: {number} is out of range 1-65535; port skipped"
                ));
                continue;
            }
            let proto_raw = port.protocol.as_deref().unwrap_or("TCP");
            let Some(protocol) = Protocol::from_api(proto_raw) else {
                warnings.push(format!(
                    "{id}: field ports[{i}].protocol: unknown protocol {proto_raw:?}; port skipped"
                ));
                continue;
            };
            self.ports.push(SlicePort {
                name: port_name,
                port: number as u16,
                protocol,
            });
        }
        self.endpoints.shrink_to_fit();
        self.ports.shrink_to_fit();
        self.service = Some((namespace.clone(), service.clone()));
        self.family = Some(family);
    }

    /// Whether this slice's warnings belong to the state of `family` (a slice skipped before
    /// its family was known is reported in every family, as it would be by each proxier).
    pub fn reported_in(&self, family: IpFamily) -> bool {
        self.family.is_none_or(|f| f == family)
    }
}

/// Merges the endpoints of slices, in the order they are added, into per-port lists.
#[derive(Default)]
pub struct EndpointMerge {
    by_port: HashMap<ServicePortName, BTreeMap<String, Endpoint>>,
}

impl EndpointMerge {
    /// Adds `entry`'s endpoints to the ports of its Service, if it is of `family`.
    pub fn add(&mut self, entry: &SliceEntry, family: IpFamily) {
        let (Some((namespace, service)), Some(f)) = (&entry.service, entry.family) else {
            return;
        };
        if f != family {
            return;
        }
        for port in &entry.ports {
            let key = ServicePortName {
                namespace: namespace.clone(),
                name: service.clone(),
                port: port.name.clone(),
                protocol: port.protocol,
            };
            let merged = self.by_port.entry(key).or_default();
            for ep in &entry.endpoints {
                let ep = Endpoint {
                    port: port.port,
                    ..ep.clone()
                };
                let key = ep.to_string();
                // Duplicates (same ip:port, possibly in several slices) collapse into one; a
                // local copy wins, as upstream prefers it.
                match merged.get(&key) {
                    Some(_) if !ep.is_local => {}
                    _ => {
                        merged.insert(key, ep);
                    }
                }
            }
        }
    }

    /// Each port's endpoints, sorted by their `ip:port` string.
    pub fn finish(self) -> HashMap<ServicePortName, Vec<Endpoint>> {
        self.by_port
            .into_iter()
            .map(|(k, v)| (k, v.into_values().collect()))
            .collect()
    }
}
