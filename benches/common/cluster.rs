//! What the daemon benchmarks that run the real daemon against a synthetic cluster (`latency`,
//! `restart`) share: their cases (`MODE:SERVICESxENDPOINTS`, the source), the objects and
//! where they are stored (the test API server in the node namespace, or manifest files), a
//! prober that connects to a Service from a thread in the client namespace, and the daemon's
//! start. Included with `#[path]` by those benchmarks, which also declare `mod apiserver`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::apiserver::ApiServer;
use crate::common::{TempDir, field, in_netns, thousands, unique_node_ports};
use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::testbed::{NODE_IP, NODE_IP6, POD_CIDR};
use kube_proxy::model::{ServicePortState, synthetic};
use nix::libc;
use nix::sys::socket::{setsockopt, sockopt};
use serde_json::{Value, json};

pub const SERVICE_PORT: u16 = 80;
pub const PORT_NAME: &str = "http";
/// A connect or its answer taking longer counts as failed.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
pub const FIRST_SYNC_TIMEOUT: Duration = Duration::from_secs(900);
const SERVICES_PER_FILE: usize = 500;

// ---------------------------------------------------------------------------------------------
// The cases.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Api,
    Manifests,
}

impl Source {
    pub fn parse(s: &str) -> Source {
        match s {
            "api" => Source::Api,
            "manifests" => Source::Manifests,
            _ => panic!("SOURCES: unknown source {s:?} (api, manifests)"),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Source::Api => "api",
            Source::Manifests => "manifests",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Case {
    pub mode: String,
    pub services: usize,
    pub endpoints: usize,
}

impl Case {
    /// `MODE:SERVICESxENDPOINTS`, e.g. `nftables:10000x10`.
    pub fn parse(s: &str) -> Case {
        let bad = || -> ! { panic!("CASES: {s:?} is not MODE:SERVICESxENDPOINTS") };
        let (mode, size) = s.split_once(':').unwrap_or_else(|| bad());
        let (n, e) = size.split_once('x').unwrap_or_else(|| bad());
        let num = |v: &str| v.replace('_', "").parse::<usize>().unwrap_or_else(|_| bad());
        assert!(
            mode == "iptables" || mode == "nftables",
            "CASES: mode {mode:?} (iptables, nftables)"
        );
        Case {
            mode: mode.to_string(),
            services: num(n),
            endpoints: num(e).max(1),
        }
    }

    pub fn label(&self) -> String {
        format!("{} {}x{}", self.mode, thousands(self.services), self.endpoints)
    }
}

/// The cases of `CASES` (`MODE:SERVICESxENDPOINTS,…`), `default` when it is unset.
pub fn cases_from_env(default: &str) -> Vec<Case> {
    crate::common::env_list("CASES", default)
        .iter()
        .map(|c| Case::parse(c))
        .collect()
}

/// The sources of `SOURCES` (`api`, `manifests`), `default` when it is unset.
pub fn sources_from_env(default: &str) -> Vec<Source> {
    crate::common::env_list("SOURCES", default)
        .iter()
        .map(|s| Source::parse(s))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The objects.

pub fn node_object(ipv6: bool) -> Value {
    let mut addresses = vec![json!({"type": "InternalIP", "address": NODE_IP.to_string()})];
    if ipv6 {
        addresses.push(json!({"type": "InternalIP", "address": NODE_IP6.to_string()}));
    }
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}, "status": {"addresses": addresses}})
}

pub fn slice_object(ns: &str, name: &str, target: u16, endpoints: Vec<Value>) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{name}-x1"), "namespace": ns, "labels": {"kubernetes.io/service-name": name}},
           "addressType": "IPv4", "ports": [{"name": PORT_NAME, "protocol": "TCP", "port": target}],
           "endpoints": endpoints})
}

pub fn endpoint_object(ip: IpAddr, node: &str) -> Value {
    json!({"addresses": [ip.to_string()], "nodeName": node, "conditions": {"ready": true}})
}

pub fn service_object(ns: &str, name: &str, cluster_ip: &str, node_port: u16, target: u16) -> Value {
    let mut port = json!({"name": PORT_NAME, "protocol": "TCP", "port": SERVICE_PORT, "targetPort": target});
    let kind = if node_port != 0 {
        port["nodePort"] = json!(node_port);
        "NodePort"
    } else {
        "ClusterIP"
    };
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
           "spec": {"type": kind, "clusterIP": cluster_ip, "ports": [port]}})
}

/// One synthetic service port as its Service and EndpointSlice.
pub fn synthetic_objects(sps: &ServicePortState) -> [Value; 2] {
    let p = &sps.port;
    assert_eq!(p.name.port, PORT_NAME, "the synthetic ports are named {PORT_NAME}");
    let target = sps.endpoints.first().map_or(8080, |e| e.port);
    let endpoints = sps
        .endpoints
        .iter()
        .map(|e| endpoint_object(e.ip, if e.is_local { "node-a" } else { "node-b" }))
        .collect();
    [
        service_object(
            &p.name.namespace,
            &p.name.name,
            &p.cluster_ip.to_string(),
            p.node_port,
            target,
        ),
        slice_object(&p.name.namespace, &p.name.name, target, endpoints),
    ]
}

/// The synthetic service ports of a case (unique NodePorts, as an API server has them).
pub fn synthetic_ports(case: &Case) -> Vec<Arc<ServicePortState>> {
    let mut state = synthetic::state(case.services, case.endpoints);
    unique_node_ports(&mut state);
    state.service_ports
}

// ---------------------------------------------------------------------------------------------
// Where the daemon reads the cluster from.

pub enum Feed {
    Api { api: ApiServer, kubeconfig: PathBuf },
    Manifests { dir: TempDir },
}

impl Feed {
    /// The cluster stored in a test API server in the node namespace `node_ns`: the Node, the
    /// synthetic ports' Services and slices, and each group of `extra` objects.
    pub fn api(node_ns: &str, ports: &[Arc<ServicePortState>], node: Value, extra: &[(&str, Vec<Value>)]) -> Feed {
        let api = in_netns(node_ns, ApiServer::start);
        let kubeconfig = std::env::temp_dir().join(format!("kp-bench-{}.kubeconfig", std::process::id()));
        api.write_kubeconfig(&kubeconfig);
        api.apply(node);
        for sps in ports {
            for o in synthetic_objects(sps) {
                api.apply(o);
            }
        }
        for o in extra.iter().flat_map(|(_, docs)| docs) {
            api.apply(o.clone());
        }
        Feed::Api { api, kubeconfig }
    }

    /// The cluster written as manifests: the Node, 500 Services per file, and each group of
    /// `extra` objects in a file of its own, `NAME.yaml`.
    pub fn manifests(ports: &[Arc<ServicePortState>], node: Value, extra: &[(&str, Vec<Value>)]) -> Feed {
        let dir = TempDir::new("cluster");
        write_docs(&dir.path().join("00-node.yaml"), &[node]);
        for (k, chunk) in ports.chunks(SERVICES_PER_FILE).enumerate() {
            let docs: Vec<Value> = chunk.iter().flat_map(|s| synthetic_objects(s)).collect();
            write_docs(&dir.path().join(format!("svc-{k:04}.yaml")), &docs);
        }
        for (name, docs) in extra {
            write_docs(&dir.path().join(format!("{name}.yaml")), docs);
        }
        let objects = kube_proxy::manifest::load_paths(&[dir.path()]).expect("the manifests load");
        assert!(
            objects.warnings.is_empty(),
            "manifest warnings: {:?}",
            objects.warnings.first()
        );
        let services = ports.len()
            + extra
                .iter()
                .flat_map(|(_, d)| d)
                .filter(|o| o["kind"] == "Service")
                .count();
        assert_eq!(objects.services.len(), services, "every Service reads back");
        Feed::Manifests { dir }
    }

    pub fn daemon_arg(&self) -> String {
        match self {
            Feed::Api { kubeconfig, .. } => format!("--kubeconfig={}", kubeconfig.display()),
            Feed::Manifests { dir } => format!("--manifests={}", dir.path().display()),
        }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        if let Feed::Api { kubeconfig, .. } = self {
            let _ = std::fs::remove_file(kubeconfig);
        }
    }
}

/// Objects as YAML documents (JSON is YAML).
pub fn write_docs(path: &Path, docs: &[Value]) {
    let mut text = String::new();
    for d in docs {
        text.push_str("---\n");
        text.push_str(&serde_json::to_string(d).expect("JSON"));
        text.push('\n');
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

// ---------------------------------------------------------------------------------------------
// The prober.

#[derive(Clone, Copy, Debug)]
pub struct Probe {
    pub start: Instant,
    /// The index of the pod that answered, or `None`: the connect or its answer failed.
    pub pod: Option<usize>,
}

/// Connects to a Service every interval from a thread in the client namespace and
/// records who answered; stopped and joined on drop.
pub struct Prober {
    records: Arc<Mutex<Vec<Probe>>>,
    pub first_error: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Prober {
    pub fn start(client_ns: &str, to: SocketAddr, pods: Vec<String>, interval: Duration) -> Prober {
        let records = Arc::new(Mutex::new(Vec::with_capacity(1 << 18)));
        let first_error = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, e, s, ns) = (
            records.clone(),
            first_error.clone(),
            stop.clone(),
            client_ns.to_string(),
        );
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("the client's netns file");
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns (needs root)");
            while !s.load(Ordering::Relaxed) {
                let start = Instant::now();
                let pod = match probe_once(to, &pods) {
                    Ok(i) => Some(i),
                    Err(err) => {
                        lock(&e).get_or_insert(err);
                        None
                    }
                };
                lock(&r).push(Probe { start, pod });
                // Pacing, not synchronisation.
                if let Some(rest) = (start + interval).checked_duration_since(Instant::now()) {
                    std::thread::sleep(rest);
                }
            }
        });
        Prober {
            records,
            first_error,
            stop,
            thread: Some(thread),
        }
    }

    pub fn len(&self) -> usize {
        lock(&self.records).len()
    }

    /// The start of the first probe from record `from` on that began at or after `t0` and was
    /// answered by `pod`, waiting for it until `deadline`.
    pub fn first_answer(&self, from: usize, t0: Instant, pod: usize, deadline: Instant) -> Option<Instant> {
        let mut next = from;
        loop {
            {
                let records = lock(&self.records);
                if let Some(p) = records[next..].iter().find(|p| p.start >= t0 && p.pod == Some(pod)) {
                    return Some(p.start);
                }
                next = records.len();
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn records(&self) -> Vec<Probe> {
        lock(&self.records).clone()
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One connect: the index in `pods` of the name the server answered with.
pub fn probe_once(to: SocketAddr, pods: &[String]) -> Result<usize, String> {
    let stream = TcpStream::connect_timeout(&to, PROBE_TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(PROBE_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| format!("read: {e}"))?;
    // An RST: no TIME_WAIT, and the next connect takes the kernel's next port.
    let rst = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(&stream, sockopt::Linger, &rst).map_err(|e| format!("SO_LINGER: {e}"))?;
    let name = line.split_whitespace().next().unwrap_or_default();
    pods.iter()
        .position(|p| p == name)
        .ok_or_else(|| format!("an answer from no pod: {line:?}"))
}

pub fn daemon_args(mode: &str, feed: &Feed) -> Vec<String> {
    vec![
        "--hostname-override=node-a".into(),
        format!("--cluster-cidr={POD_CIDR}"),
        format!("--proxy-mode={mode}"),
        "-v".into(),
        "2".into(),
        feed.daemon_arg(),
    ]
}

/// Waits for the daemon's first IPv4 sync of every Service; fails if it exits first.
pub fn wait_first_sync(daemon: &mut ChildGuard, services: usize) {
    let deadline = Instant::now() + FIRST_SYNC_TIMEOUT;
    let want = services.to_string();
    loop {
        let log = daemon.log();
        let synced = log.lines().any(|l| {
            l.contains("\"Synced rules\"")
                && field(l, "ipFamily") == Some("IPv4")
                && field(l, "services") == Some(want.as_str())
        });
        if synced {
            return;
        }
        if let Ok(Some(st)) = daemon.try_wait() {
            panic!("the daemon exited ({st}) before its first sync:\n{log}");
        }
        assert!(
            Instant::now() < deadline,
            "no first sync within {FIRST_SYNC_TIMEOUT:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

pub fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
