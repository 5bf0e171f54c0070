//! Manifests for the lab and the end-to-end tests: the node and Services with their
//! EndpointSlices, written as YAML the way an operator would.

use std::net::IpAddr;

/// The node object of the test bed (`node-a`, InternalIP 192.168.49.2).
pub const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus:\n  addresses: [{type: InternalIP, address: 192.168.49.2}]\n";

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

/// A Service (port `p`, 80 → 8080) and its EndpointSlice.
#[derive(Clone, Debug)]
pub struct ServiceSpec<'a> {
    pub name: &'a str,
    pub cluster_ip: &'a str,
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
            .map(|ip| format!("status:\n  loadBalancer: {{ingress: [{{ip: {ip}}}]}}\n"))
            .unwrap_or_default();
        let mut endpoints = String::new();
        for e in self.endpoints {
            endpoints.push_str(&format!(
                "\n- addresses: [\"{}\"]\n  nodeName: {}\n  conditions: {}",
                e.ip, e.node, e.conditions
            ));
        }
        if endpoints.is_empty() {
            endpoints.push_str(" []");
        }
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: {kind}\n  clusterIP: {cluster_ip}\n  ports: [{{name: p, protocol: {protocol}, port: 80, targetPort: 8080{np}}}]\n{}{status}---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: p, protocol: {protocol}, port: 8080}}]\nendpoints:{endpoints}\n",
            self.spec_extra
        )
    }
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
        let text = manifests(&[ServiceSpec::new("a", "10.96.0.1", &[]), lb]);
        let mut o = Objects::default();
        load_str(Path::new("x.yaml"), &text, &mut o).unwrap();
        assert!(o.warnings.is_empty(), "{:?}\n{text}", o.warnings);
        assert_eq!((o.services.len(), o.endpoint_slices.len(), o.nodes.len()), (2, 2, 1));
        assert_eq!(
            o.services[1].spec.as_ref().unwrap().type_.as_deref(),
            Some("LoadBalancer")
        );
    }
}
