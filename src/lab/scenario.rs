//! Manifests for the lab and the end-to-end tests: the node and Services with their
//! EndpointSlices, written as YAML the way an operator would.

use std::net::IpAddr;

/// The node object of the test bed (`node-a`, InternalIPs 192.168.49.2 and fd00:49::2).
pub const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus:\n  addresses: [{type: InternalIP, address: 192.168.49.2}, {type: InternalIP, address: \"fd00:49::2\"}]\n";

/// An endpoint in a slice: its IP and the node it runs on.
#[derive(Clone, Debug)]
pub struct Ep {
    pub ip: IpAddr,
    pub node: &'static str,
    /// Its `conditions` in YAML flow style.
    pub conditions: &'static str,
}

impl Ep {
    /// A ready endpoint on this node (`node-a`).
    pub fn local(ip: IpAddr) -> Ep {
        Ep::on(ip, "node-a")
    }

    /// A ready endpoint on `node`.
    pub fn on(ip: IpAddr, node: &'static str) -> Ep {
        Ep {
            ip,
            node,
            conditions: "{ready: true}",
        }
    }
}

/// A Service (port `p`, 80 → 8080) and its EndpointSlices, one per family of its endpoints
/// (`<name>-1` for the first family, `<name>-2` for the second). The Service is of the family
/// of its ClusterIP, or dual-stack with `second_cluster_ip`.
#[derive(Clone, Debug)]
pub struct ServiceSpec<'a> {
    pub name: &'a str,
    pub cluster_ip: &'a str,
    /// A ClusterIP of the other family: the Service is `RequireDualStack`, in this order.
    pub second_cluster_ip: Option<&'a str>,
    /// `TCP` or `UDP`.
    pub protocol: &'a str,
    pub node_port: Option<u16>,
    /// YAML lines added under `spec:` (two-space indented), e.g. `  sessionAffinity: ClientIP\n`.
    pub spec_extra: &'a str,
    /// A LoadBalancer ingress IP (makes the Service type LoadBalancer).
    pub load_balancer_ip: Option<&'a str>,
    pub endpoints: &'a [Ep],
}

impl<'a> ServiceSpec<'a> {
    pub fn new(name: &'a str, cluster_ip: &'a str, endpoints: &'a [Ep]) -> ServiceSpec<'a> {
        ServiceSpec {
            name,
            cluster_ip,
            second_cluster_ip: None,
            protocol: "TCP",
            node_port: None,
            spec_extra: "",
            load_balancer_ip: None,
            endpoints,
        }
    }

    pub fn yaml(&self) -> String {
        let ServiceSpec {
            name,
            cluster_ip,
            protocol,
            ..
        } = self;
        let kind = match (self.load_balancer_ip, self.node_port) {
            (Some(_), _) => "LoadBalancer",
            (None, Some(_)) => "NodePort",
            (None, None) => "ClusterIP",
        };
        let np = self.node_port.map(|p| format!(", nodePort: {p}")).unwrap_or_default();
        let status = self
            .load_balancer_ip
            .map(|ip| format!("status:\n  loadBalancer: {{ingress: [{{ip: \"{ip}\"}}]}}\n"))
            .unwrap_or_default();
        let ips: Vec<&str> = std::iter::once(*cluster_ip).chain(self.second_cluster_ip).collect();
        let families: Vec<&str> = ips.iter().map(|ip| family_of(ip)).collect();
        let policy = if ips.len() > 1 {
            "RequireDualStack"
        } else {
            "SingleStack"
        };
        let quoted = |v: &[&str]| v.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ");
        let mut out = format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: {kind}\n  clusterIP: \"{cluster_ip}\"\n  clusterIPs: [{}]\n  ipFamilies: [{}]\n  ipFamilyPolicy: {policy}\n  ports: [{{name: p, protocol: {protocol}, port: 80, targetPort: 8080{np}}}]\n{}{status}",
            quoted(&ips),
            families.join(", "),
            self.spec_extra
        );
        // One slice per family with endpoints; a Service without any gets one empty slice.
        let mut slices: Vec<(&str, Vec<&Ep>)> = families
            .iter()
            .map(|f| {
                (
                    *f,
                    self.endpoints
                        .iter()
                        .filter(|e| family_of(&e.ip.to_string()) == *f)
                        .collect(),
                )
            })
            .filter(|(_, eps): &(&str, Vec<&Ep>)| !eps.is_empty())
            .collect();
        if slices.is_empty() {
            slices.push((families[0], Vec::new()));
        }
        for (i, (family, eps)) in slices.iter().enumerate() {
            let mut endpoints = String::new();
            for e in eps {
                endpoints.push_str(&format!(
                    "\n- addresses: [\"{}\"]\n  nodeName: {}\n  conditions: {}",
                    e.ip, e.node, e.conditions
                ));
            }
            if endpoints.is_empty() {
                endpoints.push_str(" []");
            }
            out.push_str(&format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-{}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: {family}\nports: [{{name: p, protocol: {protocol}, port: 8080}}]\nendpoints:{endpoints}\n",
                i + 1
            ));
        }
        out
    }
}

/// `IPv4` or `IPv6`, as the API spells an address's family (anything else counts as IPv4).
fn family_of(ip: &str) -> &'static str {
    if ip.contains(':') { "IPv6" } else { "IPv4" }
}

/// The node plus the given Services.
pub fn manifests(services: &[ServiceSpec<'_>]) -> String {
    let mut s = NODE.to_string();
    for svc in services {
        s.push_str(&svc.yaml());
    }
    s
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::manifest::{Objects, load_str};

    #[test]
    fn manifests_parse_without_warnings() {
        let eps = [Ep::local("10.244.1.2".parse().unwrap())];
        let mut lb = ServiceSpec::new("lb", "10.96.0.2", &eps);
        lb.load_balancer_ip = Some("203.0.113.10");
        lb.node_port = Some(30000);
        let both = [
            Ep::local("10.244.1.2".parse().unwrap()),
            Ep::local("fd00:10:244:1::2".parse().unwrap()),
        ];
        let mut dual = ServiceSpec::new("dual", "fd00:10:96::10", &both);
        dual.second_cluster_ip = Some("10.96.0.3");
        let text = manifests(&[ServiceSpec::new("a", "10.96.0.1", &[]), lb, dual]);
        let mut o = Objects::default();
        load_str(Path::new("x.yaml"), &text, &mut o).unwrap();
        assert!(o.warnings.is_empty(), "{:?}\n{text}", o.warnings);
        assert_eq!((o.services.len(), o.endpoint_slices.len(), o.nodes.len()), (3, 4, 1));
        assert_eq!(
            o.services[1].spec.as_ref().unwrap().type_.as_deref(),
            Some("LoadBalancer")
        );
        let spec = o.services[2].spec.as_ref().unwrap();
        assert_eq!(
            spec.ip_families.as_deref(),
            Some(&["IPv6".to_string(), "IPv4".to_string()][..])
        );
        assert_eq!(spec.ip_family_policy.as_deref(), Some("RequireDualStack"));
        let types: Vec<&str> = o.endpoint_slices[2..].iter().map(|s| s.address_type.as_str()).collect();
        assert_eq!(types, ["IPv6", "IPv4"], "one slice per family, the Service's order");
    }
}
