//! Services → service ports of one IP family, as upstream's service change tracker and
//! `newBaseServiceInfo` compute them.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServicePort as ApiServicePort, ServiceSpec};

use super::addr::{parse_cidr_sloppy, parse_ip_sloppy};
use super::{IpFamily, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME, Protocol, is_valid_label, is_valid_port_name};

/// Upstream's `ServicePortName`: `ns/name` plus the port name, with the protocol carried
/// alongside. Its `Display` is `ns/name[:port]`, the string used in comments and chain hashes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        Ok(())
    }
}

/// One port of one Service in one IP family: everything the dataplanes program for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub cluster_ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// 0 when the Service has no NodePort for this port.
    pub node_port: u16,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` with ipMode VIP (or unset), of this family.
    pub load_balancer_vips: Vec<IpAddr>,
    /// Network addresses (host bits cleared), of this family.
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// 0 unless the Service needs a health check (LoadBalancer with externalTrafficPolicy Local).
    pub health_check_node_port: u16,
    /// `Some(timeout)` for sessionAffinity ClientIP.
    pub session_affinity_timeout: Option<u32>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
}

impl ServicePort {
    /// A plain ClusterIP service port: no NodePort, external addresses, affinity or Local policy.
    pub fn cluster_ip(name: ServicePortName, cluster_ip: IpAddr, port: u16) -> ServicePort {
        ServicePort {
            protocol: name.protocol,
            name,
            cluster_ip,
            port,
            node_port: 0,
            external_ips: Vec::new(),
            load_balancer_vips: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            health_check_node_port: 0,
            session_affinity_timeout: None,
            external_policy_local: false,
            internal_policy_local: false,
        }
    }

    /// NodePort, LoadBalancer IPs or externalIPs make it reachable from outside.
    pub fn externally_accessible(&self) -> bool {
        self.node_port != 0 || !self.load_balancer_vips.is_empty() || !self.external_ips.is_empty()
    }

    /// Cluster endpoints are needed for Cluster internal policy, and for any externally
    /// accessible service (to short-circuit pod traffic even with Local external policy).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }
}

/// Upstream's default for `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_CLIENT_IP_TIMEOUT: u32 = 10800;

/// Computes the service ports of `family`, sorted by name and protocol. Skipped Services and
/// fields are reported in `warnings`.
pub fn service_ports(services: &[Service], family: IpFamily, warnings: &mut Vec<String>) -> Vec<ServicePort> {
    let mut out = Vec::new();
    for svc in services {
        service_to_ports(svc, family, warnings, &mut out);
    }
    sort_and_dedup(&mut out, warnings);
    out
}

/// Sorts service ports by name and protocol and keeps the first of ports that share both.
pub(crate) fn sort_and_dedup(ports: &mut Vec<ServicePort>, warnings: &mut Vec<String>) {
    ports.sort_by(|a, b| a.name.cmp(&b.name));
    ports.dedup_by(|b, a| {
        if a.name == b.name {
            warnings.push(format!(
                "Service {}/{}: duplicate port {} {}; the first one is used",
                a.name.namespace, a.name.name, a.name, a.protocol
            ));
            true
        } else {
            false
        }
    });
}

/// One Service reduced to what the proxy programs, converted once when it arrives: its
/// service ports in each family and what was wrong with it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceEntry {
    /// IPv4 ports and warnings, then IPv6.
    families: [(Vec<ServicePort>, Vec<String>); 2],
}

impl ServiceEntry {
    pub fn from_service(svc: &Service) -> ServiceEntry {
        let convert = |family| {
            let (mut ports, mut warnings) = (Vec::new(), Vec::new());
            service_to_ports(svc, family, &mut warnings, &mut ports);
            ports.shrink_to_fit();
            (ports, warnings)
        };
        ServiceEntry {
            families: [convert(IpFamily::V4), convert(IpFamily::V6)],
        }
    }

    /// The service ports of `family`.
    pub fn ports(&self, family: IpFamily) -> &[ServicePort] {
        &self.families[family_index(family)].0
    }

    /// What was wrong with the Service, as seen by the proxier of `family`.
    pub fn warnings(&self, family: IpFamily) -> &[String] {
        &self.families[family_index(family)].1
    }
}

fn family_index(family: IpFamily) -> usize {
    match family {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

fn service_to_ports(svc: &Service, family: IpFamily, warnings: &mut Vec<String>, out: &mut Vec<ServicePort>) {
    let meta = &svc.metadata;
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".to_string());
    let name = meta.name.clone().unwrap_or_default();
    let labels = meta.labels.clone().unwrap_or_default();
    // The informer's label selector: both labels must be absent.
    if labels.contains_key(LABEL_SERVICE_PROXY_NAME) || labels.contains_key(LABEL_HEADLESS) {
        return;
    }
    let id = format!("Service {namespace}/{name}");
    if !is_valid_label(&namespace) || !is_valid_label(&name) {
        warnings.push(format!(
            "Service {namespace:?}/{name:?}: field metadata.name/namespace: not a valid Kubernetes name; skipped"
        ));
        return;
    }
    let Some(spec) = &svc.spec else { return };
    // Upstream's ShouldSkipService: no cluster IP ("None" or empty) or ExternalName.
    let cluster_ip_field = spec.cluster_ip.as_deref().unwrap_or("");
    if cluster_ip_field.is_empty() || cluster_ip_field == "None" {
        return;
    }
    if spec.type_.as_deref() == Some("ExternalName") {
        return;
    }
    let Some(cluster_ip) = cluster_ip_of_family(
        spec.cluster_ip.as_deref(),
        spec.cluster_ips.as_deref(),
        family,
        &id,
        warnings,
    ) else {
        return;
    };
    let mut c = Conversion { id, family, warnings };

    let svc_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    let externally_typed = svc_type == "LoadBalancer" || svc_type == "NodePort";
    let external_ips_raw = spec.external_ips.clone().unwrap_or_default();
    let external_policy_local =
        (externally_typed || !external_ips_raw.is_empty()) && spec.external_traffic_policy.as_deref() == Some("Local");
    let session_affinity_timeout = c.session_affinity_timeout(spec);
    let external_ips = c.external_ips(&external_ips_raw);
    let Some(load_balancer_source_ranges) = c.load_balancer_source_ranges(spec) else {
        return;
    };
    let load_balancer_vips = c.load_balancer_vips(svc);
    let needs_health_check = svc_type == "LoadBalancer" && external_policy_local;
    let health_check_node_port = if needs_health_check {
        c.health_check_node_port(spec)
    } else {
        0
    };
    // What every port of the Service shares.
    let shared = ServicePort {
        name: ServicePortName {
            namespace,
            name,
            port: String::new(),
            protocol: Protocol::Tcp,
        },
        cluster_ip,
        port: 0,
        protocol: Protocol::Tcp,
        node_port: 0,
        external_ips,
        load_balancer_vips,
        load_balancer_source_ranges,
        health_check_node_port,
        session_affinity_timeout,
        external_policy_local,
        internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
    };
    for (i, port) in spec.ports.clone().unwrap_or_default().iter().enumerate() {
        let Some((port_name, protocol, port, node_port)) = c.port(i, port) else {
            continue;
        };
        out.push(ServicePort {
            name: ServicePortName {
                port: port_name,
                protocol,
                ..shared.name.clone()
            },
            port,
            protocol,
            node_port,
            ..shared.clone()
        });
    }
}

/// The conversion of one Service's fields in one family: what is of another family is left
/// out, and what is invalid is skipped with a warning about the field.
struct Conversion<'a> {
    /// `Service ns/name`, as warnings begin.
    id: String,
    family: IpFamily,
    warnings: &'a mut Vec<String>,
}

impl Conversion<'_> {
    fn warn(&mut self, field: &str, what: &str) {
        self.warnings.push(format!("{}: field {field}: {what}", self.id));
    }

    /// The ClientIP affinity timeout, None without ClientIP affinity.
    fn session_affinity_timeout(&mut self, spec: &ServiceSpec) -> Option<u32> {
        if spec.session_affinity.as_deref() != Some("ClientIP") {
            return None;
        }
        let t = spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .unwrap_or(DEFAULT_CLIENT_IP_TIMEOUT as i32);
        if !(1..=86400).contains(&t) {
            self.warn(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                &format!("{t} is outside 1..86400; using {DEFAULT_CLIENT_IP_TIMEOUT}"),
            );
            Some(DEFAULT_CLIENT_IP_TIMEOUT)
        } else {
            Some(t as u32)
        }
    }

    /// The IP in `field` if it is of this family; an invalid one is warned about.
    fn ip_of_family(&mut self, field: impl FnOnce() -> String, raw: &str) -> Option<IpAddr> {
        match parse_ip_sloppy(raw) {
            Some(ip) => self.family.contains(&ip).then_some(ip),
            None => {
                self.warn(&field(), &format!("invalid IP {raw:?}; skipped"));
                None
            }
        }
    }

    fn external_ips(&mut self, raw: &[String]) -> Vec<IpAddr> {
        let mut external_ips = Vec::new();
        for (i, raw) in raw.iter().enumerate() {
            external_ips.extend(self.ip_of_family(|| format!("spec.externalIPs[{i}]"), raw));
        }
        external_ips
    }

    /// The source ranges of this family; None when none of the ranges is valid (the
    /// Service is then skipped).
    fn load_balancer_source_ranges(&mut self, spec: &ServiceSpec) -> Option<Vec<IpNet>> {
        let mut ranges = Vec::new();
        let ranges_raw = spec.load_balancer_source_ranges.clone().unwrap_or_default();
        let mut any_valid_range = false;
        for (i, raw) in ranges_raw.iter().enumerate() {
            match parse_cidr_sloppy(raw) {
                Some(net) => {
                    any_valid_range = true;
                    if self.family.contains(&net.addr()) {
                        ranges.push(net.trunc());
                    }
                }
                None => self.warn(
                    &format!("spec.loadBalancerSourceRanges[{i}]"),
                    &format!("invalid CIDR {raw:?}; skipped"),
                ),
            }
        }
        if !ranges_raw.is_empty() && !any_valid_range {
            // Dropping every range would open the load balancer to the world: fail closed.
            self.warn(
                "spec.loadBalancerSourceRanges",
                "no valid CIDR; Service skipped rather than opened to every source",
            );
            return None;
        }
        Some(ranges)
    }

    /// The load-balancer ingress IPs of this family that are VIPs.
    fn load_balancer_vips(&mut self, svc: &Service) -> Vec<IpAddr> {
        let mut vips = Vec::new();
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.clone())
            .unwrap_or_default();
        for (i, ing) in ingress.iter().enumerate() {
            let Some(raw) = ing.ip.as_deref().filter(|s| !s.is_empty()) else {
                continue;
            };
            // ipMode Proxy load balancers deliver to the node, not to the VIP.
            if ing.ip_mode.as_deref().is_some_and(|m| m != "VIP") {
                continue;
            }
            vips.extend(self.ip_of_family(|| format!("status.loadBalancer.ingress[{i}].ip"), raw));
        }
        vips
    }

    /// The health-check node port of a Service that needs one; 0 when it has none.
    fn health_check_node_port(&mut self, spec: &ServiceSpec) -> u16 {
        match spec.health_check_node_port {
            Some(p) if (1..=65535).contains(&p) => return p as u16,
            Some(p) if p != 0 => self.warn("spec.healthCheckNodePort", &format!("{p} is not a valid port; skipped")),
            _ => self.warn("spec.healthCheckNodePort", "Service has no health check node port"),
        }
        0
    }

    /// Port `i` of the Service as (name, protocol, port, nodePort); None (with a warning)
    /// when it is invalid.
    fn port(&mut self, i: usize, port: &ApiServicePort) -> Option<(String, Protocol, u16, u16)> {
        let port_name = port.name.clone().unwrap_or_default();
        if !is_valid_port_name(&port_name) {
            self.warn(
                &format!("spec.ports[{i}].name"),
                &format!("invalid port name {port_name:?}; port skipped"),
            );
            return None;
        }
        let proto_raw = port.protocol.as_deref().unwrap_or("TCP");
        let Some(protocol) = Protocol::from_api(proto_raw) else {
            self.warn(
                &format!("spec.ports[{i}].protocol"),
                &format!("unknown protocol {proto_raw:?}; port skipped"),
            );
            return None;
        };
        if !(1..=65535).contains(&port.port) {
            self.warn(
                &format!("spec.ports[{i}].port"),
                &format!("{} is out of range 1-65535; port skipped", port.port),
            );
            return None;
        }
        let node_port = port.node_port.unwrap_or(0);
        if !(0..=65535).contains(&node_port) {
            self.warn(
                &format!("spec.ports[{i}].nodePort"),
                &format!("{node_port} is out of range 1-65535; port skipped"),
            );
            return None;
        }
        Some((port_name, protocol, port.port as u16, node_port as u16))
    }
}

/// Upstream's `GetClusterIPByFamily`: the entry of `clusterIPs` of that family, else
/// `clusterIP` if it is of that family.
fn cluster_ip_of_family(
    cluster_ip: Option<&str>,
    cluster_ips: Option<&[String]>,
    family: IpFamily,
    id: &str,
    warnings: &mut Vec<String>,
) -> Option<IpAddr> {
    let candidates: Vec<(String, &str)> = match cluster_ips {
        Some(list) if !list.is_empty() => list
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("spec.clusterIPs[{i}]"), s.as_str()))
            .collect(),
        _ => cluster_ip
            .map(|s| ("spec.clusterIP".to_string(), s))
            .into_iter()
            .collect(),
    };
    for (field, raw) in &candidates {
        match parse_ip_sloppy(raw) {
            Some(ip) => {
                if family.contains(&ip) {
                    return Some(ip);
                }
            }
            None => warnings.push(format!("{id}: field {field}: invalid IP {raw:?}; skipped")),
        }
    }
    None
}
