//! A synthetic cluster as API objects, for the chaos test (tests/e2e_chaos.rs) and the memory
//! benchmark (benches/api_memory.rs): `services` Services × `endpoints` ready endpoints loaded
//! into the test API server ([`load`]), changed one object at a time by a seeded [`Churn`], and
//! what a node must end up with, read from the objects the server holds ([`expected`]).
//!
//! Service `i`: `ns{i % 50}/svc{i}`, ClusterIP `10.100.0.0 + i`, port `http` 80/TCP → 8080;
//! its slice `svc{i}-x`, endpoints on node-b (nothing answers there). Endpoint `j` of
//! Service `i` at generation `g` has address `10.128.0.0 + (g mod 16) · 2^19 + i · E + j`, so
//! each change gives it an address no other endpoint has.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde_json::{Value, json};

use crate::apiserver::ApiServer;

/// The synthetic Services' port and their endpoints' port.
pub const PORT: u16 = 80;
pub const TARGET_PORT: u16 = 8080;

/// What a node must program for its ClusterIPs: `ClusterIP:port` → the ready endpoints.
pub type View = BTreeMap<SocketAddr, BTreeSet<SocketAddr>>;

pub fn namespace(i: usize) -> String {
    format!("ns{}", i % 50)
}

pub fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x0a64_0000u32 + i as u32)
}

/// The Service object of synthetic Service `i`.
pub fn service(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": format!("svc{i}"), "namespace": namespace(i)},
           "spec": {"type": "ClusterIP", "clusterIP": cluster_ip(i).to_string(),
                    "ports": [{"name": "http", "protocol": "TCP", "port": PORT, "targetPort": TARGET_PORT}]}})
}

/// An EndpointSlice of Service `name` in `ns` (slice `name-x`) with these ready endpoints.
pub fn slice_of(ns: &str, name: &str, addresses: &[IpAddr], node: &str) -> Value {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "nodeName": node, "conditions": {"ready": true}}))
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{name}-x"), "namespace": ns,
                        "labels": {"kubernetes.io/service-name": name}},
           "addressType": "IPv4", "ports": [{"name": "http", "protocol": "TCP", "port": TARGET_PORT}],
           "endpoints": endpoints})
}

/// The address of endpoint `j` of Service `i` (of `per_service`) at `generation`.
pub fn endpoint_ip(i: usize, j: usize, per_service: usize, generation: u32) -> IpAddr {
    let n = ((generation % 16) << 19) + (i * per_service + j) as u32;
    IpAddr::V4(Ipv4Addr::from(0x0a80_0000u32 + n))
}

/// The slice of synthetic Service `i` whose endpoints are at these generations.
pub fn slice(i: usize, generations: &[u32]) -> Value {
    let ips: Vec<IpAddr> = generations
        .iter()
        .enumerate()
        .map(|(j, g)| endpoint_ip(i, j, generations.len(), *g))
        .collect();
    slice_of(&namespace(i), &format!("svc{i}"), &ips, "node-b")
}

/// Loads Services `0..services`, each with a slice of `endpoints` endpoints at generation 0.
pub fn load(api: &ApiServer, services: usize, endpoints: usize) {
    let zeros = vec![0; endpoints];
    for i in 0..services {
        api.apply(service(i));
        api.apply(slice(i, &zeros));
    }
}

/// What a node must program, from the Services and EndpointSlices `api` holds: each Service
/// port by ClusterIP, with the ready endpoints of its slices at the slice port of the same name.
pub fn expected(api: &ApiServer) -> View {
    let mut ports: BTreeMap<(String, String), Vec<(SocketAddr, String)>> = BTreeMap::new();
    for svc in api.objects("Service") {
        let (Some(ns), Some(name)) = (svc["metadata"]["namespace"].as_str(), svc["metadata"]["name"].as_str()) else {
            continue;
        };
        let Some(ip) = svc["spec"]["clusterIP"].as_str().and_then(|s| s.parse::<IpAddr>().ok()) else {
            continue;
        };
        let list = ports.entry((ns.to_string(), name.to_string())).or_default();
        for p in svc["spec"]["ports"].as_array().into_iter().flatten() {
            let port = p["port"].as_u64().unwrap_or(0) as u16;
            list.push((SocketAddr::new(ip, port), p["name"].as_str().unwrap_or("").to_string()));
        }
    }
    let mut view: View = ports
        .values()
        .flatten()
        .map(|(addr, _)| (*addr, BTreeSet::new()))
        .collect();
    for sl in api.objects("EndpointSlice") {
        let ns = sl["metadata"]["namespace"].as_str().unwrap_or("").to_string();
        let Some(svc) = sl["metadata"]["labels"]["kubernetes.io/service-name"].as_str() else {
            continue;
        };
        let Some(svc_ports) = ports.get(&(ns, svc.to_string())) else {
            continue;
        };
        for (addr, port_name) in svc_ports {
            let Some(target) = sl["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"].as_str().unwrap_or("") == port_name)
                .and_then(|p| p["port"].as_u64())
            else {
                continue;
            };
            let ready = sl["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| e["conditions"]["ready"].as_bool() != Some(false))
                .filter_map(|e| e["addresses"][0].as_str()?.parse::<IpAddr>().ok());
            let eps = view.entry(*addr).or_default();
            eps.extend(ready.map(|ip| SocketAddr::new(ip, target as u16)));
        }
    }
    view
}

/// How two views differ, briefly: counts, and the first few differing entries.
pub fn differences(want: &View, got: &View) -> String {
    let missing: Vec<&SocketAddr> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let extra: Vec<&SocketAddr> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    let changed: Vec<&SocketAddr> = want
        .iter()
        .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
        .map(|(k, _)| k)
        .collect();
    let first = changed
        .first()
        .map(|k| format!("; {k}: want {:?}, kernel {:?}", want[*k], got[*k]));
    format!(
        "{} Services wanted, {} in the kernel: {} missing (first {:?}), {} extra (first {:?}), {} with other endpoints{}",
        want.len(),
        got.len(),
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>(),
        extra.len(),
        extra.iter().take(3).collect::<Vec<_>>(),
        changed.len(),
        first.unwrap_or_default()
    )
}

/// Changes to the synthetic cluster, one object at a time, from a seeded generator: mostly one
/// endpoint of a Service moved to a new address, some Services deleted (with their slice) and
/// some created (beyond the loaded ones).
pub struct Churn {
    rng: u64,
    endpoints: usize,
    /// Live synthetic Services and their endpoints' generations.
    live: BTreeMap<usize, Vec<u32>>,
    next: usize,
    pub moved: usize,
    pub deleted: usize,
    pub created: usize,
}

impl Churn {
    /// For a cluster [`load`]ed with `services` × `endpoints`.
    pub fn new(seed: u64, services: usize, endpoints: usize) -> Churn {
        Churn {
            rng: seed.max(1),
            endpoints,
            live: (0..services).map(|i| (i, vec![0; endpoints])).collect(),
            next: services,
            moved: 0,
            deleted: 0,
            created: 0,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// A live Service, chosen at random (the one at or after a random index).
    fn pick(&mut self) -> Option<usize> {
        let r = (self.next_u64() % self.next as u64) as usize;
        self.live
            .range(r..)
            .next()
            .or_else(|| self.live.iter().next())
            .map(|(i, _)| *i)
    }

    /// Makes one change: 80 % an endpoint moved, 10 % a Service deleted, 10 % one created.
    pub fn step(&mut self, api: &ApiServer) {
        let roll = self.next_u64() % 10;
        match (roll, self.pick()) {
            (0, Some(i)) if self.live.len() > 1 => {
                self.live.remove(&i);
                api.delete("EndpointSlice", &namespace(i), &format!("svc{i}-x"));
                api.delete("Service", &namespace(i), &format!("svc{i}"));
                self.deleted += 1;
            }
            (1, _) | (_, None) => {
                let i = self.next;
                self.next += 1;
                let gens = vec![0; self.endpoints];
                api.apply(service(i));
                api.apply(slice(i, &gens));
                self.live.insert(i, gens);
                self.created += 1;
            }
            (_, Some(i)) => self.move_endpoint(api, i),
        }
    }

    /// One endpoint of live Service `i` moved to a new address (one object changed).
    fn move_endpoint(&mut self, api: &ApiServer, i: usize) {
        let j = (self.next_u64() % self.endpoints.max(1) as u64) as usize;
        let Some(gens) = self.live.get_mut(&i) else {
            return;
        };
        if let Some(g) = gens.get_mut(j) {
            *g += 1;
        }
        api.apply(slice(i, gens));
        self.moved += 1;
    }

    /// One endpoint of a random live Service moved.
    pub fn move_one(&mut self, api: &ApiServer) {
        if let Some(i) = self.pick() {
            self.move_endpoint(api, i);
        }
    }

    /// `n` changes.
    pub fn steps(&mut self, api: &ApiServer, n: usize) {
        for _ in 0..n {
            self.step(api);
        }
    }

    /// Changes made so far.
    pub fn total(&self) -> usize {
        self.moved + self.deleted + self.created
    }

    pub fn summary(&self) -> String {
        format!(
            "{} endpoints moved, {} Services deleted, {} created",
            self.moved, self.deleted, self.created
        )
    }
}

pub fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}
