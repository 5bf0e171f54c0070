//! EndpointSlices → the endpoints of each service port, as upstream's EndpointSlice cache
//! merges them: all slices of a Service, matched by port name and protocol, conditions with
//! their nil defaults, locality, family filtering and de-duplication by `ip:port`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::services::parse_ip;
use super::{
    IpFamily, LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, Protocol, ServicePortName, is_valid_name,
    is_valid_port_name,
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
    pub zone_hints: BTreeSet<String>,
    pub node_hints: BTreeSet<String>,
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
            zone_hints: BTreeSet::new(),
            node_hints: BTreeSet::new(),
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
    let mut ordered: Vec<&EndpointSlice> = slices.iter().collect();
    ordered.sort_by(|a, b| (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name)));
    let mut by_port: HashMap<ServicePortName, BTreeMap<String, Endpoint>> = HashMap::new();
    for slice in ordered {
        add_slice(slice, family, node_name, warnings, &mut by_port);
    }
    by_port
        .into_iter()
        .map(|(k, v)| (k, v.into_values().collect()))
        .collect()
}

fn add_slice(
    slice: &EndpointSlice,
    family: IpFamily,
    node_name: &str,
    warnings: &mut Vec<String>,
    by_port: &mut HashMap<ServicePortName, BTreeMap<String, Endpoint>>,
) {
    let namespace = slice
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_string());
    let slice_name = slice.metadata.name.clone().unwrap_or_default();
    let id = format!("EndpointSlice {namespace}/{slice_name}");
    if !is_valid_name(&namespace) || !is_valid_name(&slice_name) {
        warnings.push(format!(
            "EndpointSlice {namespace:?}/{slice_name:?}: field metadata.name/namespace: not a valid Kubernetes name; skipped"
        ));
        return;
    }
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    if labels.contains_key(LABEL_SERVICE_PROXY_NAME) || labels.contains_key(LABEL_HEADLESS) {
        return;
    }
    let Some(service) = labels.get(LABEL_SERVICE_NAME) else {
        warnings.push(format!(
            "{id}: field metadata.labels: no {LABEL_SERVICE_NAME} label; slice skipped"
        ));
        return;
    };
    if !is_valid_name(&namespace) || !is_valid_name(service) {
        warnings.push(format!(
            "{id}: field metadata.labels[{LABEL_SERVICE_NAME}]: {service:?} is not a valid Service name; slice skipped"
        ));
        return;
    }
    let slice_family = match slice.address_type.as_str() {
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
    if slice_family != family {
        return;
    }

    let mut endpoints = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let Some(raw) = ep.addresses.first() else {
            warnings.push(format!("{id}: field endpoints[{i}].addresses: empty; endpoint skipped"));
            continue;
        };
        let Some(ip) = parse_ip(raw) else {
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
        if endpoints.iter().any(|e: &Endpoint| e.ip == ip) {
            warnings.push(format!(
                "{id}: field endpoints[{i}].addresses[0]: duplicate endpoint {ip}; skipped"
            ));
            continue;
        }
        let cond = ep.conditions.clone().unwrap_or_default();
        let hints = ep.hints.clone().unwrap_or_default();
        endpoints.push(Endpoint {
            ip,
            port: 0,
            is_local: ep.node_name.as_deref().is_some_and(|n| n == node_name),
            // Upstream's nil defaults: ready and serving default to true, terminating to false.
            ready: cond.ready.unwrap_or(true),
            serving: cond.serving.unwrap_or(true),
            terminating: cond.terminating.unwrap_or(false),
            zone_hints: hints
                .for_zones
                .unwrap_or_default()
                .into_iter()
                .map(|z| z.name)
                .collect(),
            node_hints: hints
                .for_nodes
                .unwrap_or_default()
                .into_iter()
                .map(|n| n.name)
                .collect(),
        });
    }

    for (i, port) in slice.ports.clone().unwrap_or_default().iter().enumerate() {
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
        let key = ServicePortName {
            namespace: namespace.clone(),
            name: service.clone(),
            port: port_name,
            protocol,
        };
        let entry = by_port.entry(key).or_default();
        for ep in &endpoints {
            let ep = Endpoint {
                port: number as u16,
                ..ep.clone()
            };
            let key = ep.to_string();
            // Duplicates (same ip:port, possibly in several slices) collapse into one; a
            // local copy wins, as upstream prefers it.
            match entry.get(&key) {
                Some(_) if !ep.is_local => {}
                _ => {
                    entry.insert(key, ep);
                }
            }
        }
    }
}
