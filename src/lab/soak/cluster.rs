//! The soak's cluster as the benchmark holds it: synthetic Services (files of
//! [`SERVICES_PER_FILE`]), a few stable Services and a few churning ("live") Services whose
//! endpoints are the test bed's pods, and a tick Service that marks a drift check's point in
//! time. Each change is one seeded random edit of one Service, written back as its whole file
//! (the daemon's `--manifests` source re-reads a file that changed). Pure: the caller writes
//! the files.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};

use crate::lab::scenario::{Ep, NODE, ServiceSpec};

/// Synthetic Services per manifest file: a change re-reads one file of this many.
pub const SERVICES_PER_FILE: usize = 100;
/// Most endpoints a synthetic Service is scaled to.
pub const MAX_ENDPOINTS: usize = 15;
/// The namespace of the synthetic Services.
const NAMESPACE: &str = "soak";

/// What one change did (counted per kind in the report).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    Created,
    Deleted,
    Scaled,
    ReadinessFlipped,
    PortChanged,
    /// A live Service (real pods): readiness flipped or scaled among the pods.
    LiveEndpoints,
}

impl Change {
    pub fn as_str(self) -> &'static str {
        match self {
            Change::Created => "service_created",
            Change::Deleted => "service_deleted",
            Change::Scaled => "endpoints_scaled",
            Change::ReadinessFlipped => "readiness_flipped",
            Change::PortChanged => "port_changed",
            Change::LiveEndpoints => "live_endpoints_changed",
        }
    }
}

/// One synthetic Service.
#[derive(Clone, Debug, PartialEq)]
struct Synthetic {
    present: bool,
    port: u16,
    node_port: Option<u16>,
    /// Readiness of endpoints 0..len (their addresses follow from the index).
    ready: Vec<bool>,
}

/// A Service whose endpoints are real pods: the pods it lists, and which of them are ready.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveService {
    pub cluster_ip: Ipv4Addr,
    /// (pod address, ready), in pool order.
    pub endpoints: Vec<(IpAddr, bool)>,
}

impl LiveService {
    /// The addresses a connection may land on now.
    pub fn ready(&self) -> BTreeSet<IpAddr> {
        self.endpoints.iter().filter(|(_, r)| *r).map(|(ip, _)| *ip).collect()
    }

    fn spec_endpoints(&self) -> Vec<Ep> {
        self.endpoints
            .iter()
            .map(|(ip, ready)| Ep {
                ip: *ip,
                node: "node-a",
                conditions: if *ready {
                    "{ready: true, serving: true, terminating: false}"
                } else {
                    "{ready: false, serving: false, terminating: false}"
                },
            })
            .collect()
    }
}

/// xorshift64*: deterministic changes for a given seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The whole cluster.
#[derive(Clone, Debug)]
pub struct SoakCluster {
    synthetic: Vec<Synthetic>,
    /// Stable Services: (ClusterIP, pods), never changed.
    pub stable: Vec<(Ipv4Addr, Vec<IpAddr>)>,
    pub live: Vec<LiveService>,
    /// The pods the live Services draw from.
    pods: Vec<IpAddr>,
    tick: u32,
    rng: Rng,
}

/// ClusterIP of synthetic Service `i`: 10.97.0.0 upwards (inside 10.96.0.0/12).
fn synthetic_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 97, 0, 0)) + i as u32)
}

/// Address of endpoint `j` of synthetic Service `i`: 10.128.0.0/14, 16 per Service (no pod
/// has it: nobody connects to the synthetic Services).
fn synthetic_endpoint(i: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * 16 + j) as u32)
}

const TICK_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 202, 1);

impl SoakCluster {
    /// `services` synthetic Services of `endpoints` ready endpoints each (every tenth a
    /// NodePort), `stable` stable Services on pairs of `pods`, and `live` Services each
    /// listing every pod, the first half of them ready.
    pub fn new(
        services: usize,
        endpoints: usize,
        pods: &[IpAddr],
        stable: usize,
        live: usize,
        seed: u64,
    ) -> SoakCluster {
        assert!(endpoints <= MAX_ENDPOINTS && services <= 65_000, "the address plan");
        let synthetic = (0..services)
            .map(|i| Synthetic {
                present: true,
                port: 80,
                node_port: (i % 10 == 0).then(|| 30000 + (i / 10) as u16),
                ready: vec![true; endpoints],
            })
            .collect();
        let stable = (0..stable)
            .map(|k| {
                let eps = (0..2).map(|j| pods[(2 * k + j) % pods.len()]).collect();
                (Ipv4Addr::new(10, 96, 200, k as u8 + 1), eps)
            })
            .collect();
        let live = (0..live)
            .map(|k| LiveService {
                cluster_ip: Ipv4Addr::new(10, 96, 201, k as u8 + 1),
                endpoints: pods
                    .iter()
                    .enumerate()
                    .map(|(j, ip)| (*ip, j < pods.len().div_ceil(2)))
                    .collect(),
            })
            .collect();
        SoakCluster {
            synthetic,
            stable,
            live,
            pods: pods.to_vec(),
            tick: 0,
            rng: Rng::new(seed),
        }
    }

    /// Every file: (name, contents).
    pub fn files(&self) -> Vec<(String, String)> {
        let mut out = vec![
            ("00-node.yaml".to_string(), NODE.to_string()),
            ("01-stable.yaml".to_string(), self.stable_yaml()),
            ("02-live.yaml".to_string(), self.live_yaml()),
            ("03-tick.yaml".to_string(), self.tick_yaml()),
        ];
        for f in 0..self.synthetic.len().div_ceil(SERVICES_PER_FILE) {
            out.push((synthetic_file(f), self.synthetic_yaml(f)));
        }
        out
    }

    /// Service ports that exist now (a render has this many).
    pub fn service_count(&self) -> usize {
        self.synthetic.iter().filter(|s| s.present).count() + self.stable.len() + self.live.len() + 1
    }

    /// One random change: what it was, and the file to write (name, contents). One in five
    /// goes to a live Service.
    pub fn change(&mut self) -> (Change, String, String) {
        if !self.live.is_empty() && (self.synthetic.is_empty() || self.rng.below(5) == 0) {
            self.change_live();
            return (Change::LiveEndpoints, "02-live.yaml".to_string(), self.live_yaml());
        }
        let i = self.rng.below(self.synthetic.len());
        let kind = self.rng.below(4);
        let roll = self.rng.below(1 << 16);
        let s = &mut self.synthetic[i];
        let change = if !s.present || kind == 0 {
            s.present = !s.present;
            if s.present { Change::Created } else { Change::Deleted }
        } else if kind == 1 {
            let n = 1 + roll % MAX_ENDPOINTS;
            s.ready = vec![true; n];
            Change::Scaled
        } else if kind == 2 && !s.ready.is_empty() {
            let j = roll % s.ready.len();
            s.ready[j] = !s.ready[j];
            Change::ReadinessFlipped
        } else {
            s.port = if s.port == 80 { 1000 + (roll % 9000) as u16 } else { 80 };
            Change::PortChanged
        };
        let f = i / SERVICES_PER_FILE;
        (change, synthetic_file(f), self.synthetic_yaml(f))
    }

    fn change_live(&mut self) {
        let k = self.rng.below(self.live.len());
        let flip = self.rng.below(3) != 0;
        let roll = self.rng.below(1 << 16);
        let svc = &mut self.live[k];
        if flip && !svc.endpoints.is_empty() {
            let j = roll % svc.endpoints.len();
            svc.endpoints[j].1 = !svc.endpoints[j].1;
        } else {
            // Scaled among the pods: the first n listed, the new ones ready.
            let n = 1 + roll % self.pods.len();
            let old = std::mem::take(&mut svc.endpoints);
            svc.endpoints = self.pods[..n]
                .iter()
                .map(|ip| (*ip, old.iter().find(|(o, _)| o == ip).is_none_or(|(_, r)| *r)))
                .collect();
        }
    }

    /// A new tick: the tick Service's single endpoint moves to a fresh address, which the
    /// drift check then waits to see in the kernel. The file and the address.
    pub fn next_tick(&mut self) -> ((String, String), IpAddr) {
        self.tick += 1;
        (("03-tick.yaml".to_string(), self.tick_yaml()), self.tick_ip())
    }

    fn tick_ip(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 250, 0, 1)) + self.tick))
    }

    fn tick_yaml(&self) -> String {
        let eps = [Ep::on(self.tick_ip(), "node-b")];
        ServiceSpec::new("soak-tick", &TICK_IP.to_string(), &eps).yaml()
    }

    fn stable_yaml(&self) -> String {
        let mut out = String::new();
        for (k, (ip, pods)) in self.stable.iter().enumerate() {
            let eps: Vec<Ep> = pods.iter().map(|p| Ep::local(*p)).collect();
            out.push_str(&ServiceSpec::new(&format!("stable-{k}"), &ip.to_string(), &eps).yaml());
        }
        out
    }

    fn live_yaml(&self) -> String {
        let mut out = String::new();
        for (k, svc) in self.live.iter().enumerate() {
            let eps = svc.spec_endpoints();
            out.push_str(&ServiceSpec::new(&format!("live-{k}"), &svc.cluster_ip.to_string(), &eps).yaml());
        }
        out
    }

    fn synthetic_yaml(&self, f: usize) -> String {
        let mut out = String::new();
        let end = ((f + 1) * SERVICES_PER_FILE).min(self.synthetic.len());
        for i in f * SERVICES_PER_FILE..end {
            let s = &self.synthetic[i];
            if s.present {
                synthetic_service_yaml(&mut out, i, s);
            }
        }
        out
    }
}

fn synthetic_file(f: usize) -> String {
    format!("svc-{f:04}.yaml")
}

/// Synthetic Service `i` and its EndpointSlice (endpoints on another node).
fn synthetic_service_yaml(out: &mut String, i: usize, s: &Synthetic) {
    let (kind, node_port) = match s.node_port {
        Some(p) => ("NodePort", format!(", nodePort: {p}")),
        None => ("ClusterIP", String::new()),
    };
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: {NAMESPACE}}}\nspec:\n  type: {kind}\n  \
         clusterIP: {}\n  ports: [{{name: p, protocol: TCP, port: {}, targetPort: 8080{node_port}}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: s{i}-x1\n  namespace: {NAMESPACE}\n  \
         labels: {{kubernetes.io/service-name: s{i}}}\naddressType: IPv4\nports: [{{name: p, protocol: TCP, port: 8080}}]\nendpoints:",
        synthetic_ip(i),
        s.port
    );
    if s.ready.is_empty() {
        out.push_str(" []");
    }
    for (j, ready) in s.ready.iter().enumerate() {
        let _ = write!(
            out,
            "\n- addresses: [\"{}\"]\n  nodeName: node-b\n  conditions: {{ready: {ready}, serving: {ready}, terminating: false}}",
            synthetic_endpoint(i, j)
        );
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::manifest::{Objects, load_str};
    use crate::model::{IpFamily, NodeInfo, build_state};

    fn pods() -> Vec<IpAddr> {
        (1..=6).map(|k| IpAddr::V4(Ipv4Addr::new(10, 244, k, 2))).collect()
    }

    fn load(c: &SoakCluster) -> Objects {
        let mut o = Objects::default();
        for (name, text) in c.files() {
            load_str(Path::new(&name), &text, &mut o).unwrap();
        }
        assert!(o.warnings.is_empty(), "{:?}", o.warnings);
        o
    }

    #[test]
    fn files_load_into_the_service_ports_counted() {
        let mut c = SoakCluster::new(250, 10, &pods(), 3, 3, 1);
        let o = load(&c);
        let node = NodeInfo::from_objects(&o, "node-a", &[]);
        let st = build_state(&o, &node, IpFamily::V4);
        assert_eq!(st.service_ports.len(), c.service_count());
        assert_eq!(st.service_ports.len(), 250 + 3 + 3 + 1);
        let eps: usize = st.service_ports.iter().map(|s| s.endpoints.len()).sum();
        // Synthetic 250 × 10, stable 3 × 2, live 3 × 6 (every pod listed, half ready), the tick.
        assert_eq!(eps, 2500 + 6 + 18 + 1);
        // Changes keep the files loadable and the count right; every kind happens.
        let mut kinds = BTreeSet::new();
        for _ in 0..2000 {
            let (kind, name, _) = c.change();
            assert!(c.files().iter().any(|(n, _)| *n == name));
            kinds.insert(kind);
        }
        assert_eq!(kinds.len(), 6, "{kinds:?}");
        let o = load(&c);
        let st = build_state(&o, &NodeInfo::from_objects(&o, "node-a", &[]), IpFamily::V4);
        assert_eq!(st.service_ports.len(), c.service_count());
        for svc in &c.live {
            let name = format!("live-{}", c.live.iter().position(|s| s == svc).unwrap());
            let sps = st.service_ports.iter().find(|s| s.port.name.name == name).unwrap();
            let got: BTreeSet<IpAddr> = sps.endpoints.iter().filter(|e| e.ready).map(|e| e.ip).collect();
            assert_eq!(got, svc.ready(), "{name}");
        }
    }

    #[test]
    fn a_tick_moves_the_tick_endpoint() {
        let mut c = SoakCluster::new(0, 10, &pods(), 1, 1, 1);
        let ((_, a), ip_a) = c.next_tick();
        let ((_, b), ip_b) = c.next_tick();
        assert_ne!(ip_a, ip_b);
        assert!(a.contains(&ip_a.to_string()) && b.contains(&ip_b.to_string()));
    }
}
