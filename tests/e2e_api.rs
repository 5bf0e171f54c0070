//! End-to-end with the Kubernetes API source: the real daemon watches a test API server
//! (tests/support/apiserver.rs, listening inside the node namespace of a test bed) through a
//! generated kubeconfig, and real traffic checks the outcome. Also the healthz, metrics and
//! health-check node port servers, over real HTTP.

mod common;

#[path = "support/apiserver/mod.rs"]
mod apiserver;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use apiserver::ApiServer;
use common::netns::in_netns;
use common::{http_get, wait_until_every};
use kube_proxy::iptables::names;
use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::probe::ProbeArgs;
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};
use serde_json::{Value, json};

static SERIAL: Mutex<()> = Mutex::new(());
const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const SYNC_PERIOD_S: u64 = 2;

/// How often the tests poll for a change.
const POLL: Duration = Duration::from_millis(50);

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.168.49.2"}]}})
}

fn service(name: &str, ip: &str, extra: Value) -> Value {
    let mut spec = json!({"type": "ClusterIP", "clusterIP": ip, "ports": [{"name": "p", "protocol": "TCP", "port": 80, "targetPort": 8080}]});
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            spec.insert(k.clone(), v.clone());
        }
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec})
}

fn slice(service: &str, eps: &[(IpAddr, &str)]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, node)| json!({"addresses": [ip.to_string()], "nodeName": node, "conditions": {"ready": true}}))
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{service}-1"), "namespace": "default", "labels": {"kubernetes.io/service-name": service},
                        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": jiff::Timestamp::now().to_string()}},
           "addressType": "IPv4", "ports": [{"name": "p", "protocol": "TCP", "port": 8080}], "endpoints": endpoints})
}

struct Cluster {
    bed: Testbed,
    api: ApiServer,
    _kubeconfig: TempFile,
    _daemon: ChildGuard,
}

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Cluster {
    fn start(tag: &str, endpoints: usize, setup: impl FnOnce(&ApiServer, &Testbed)) -> Cluster {
        let mut spec = TestbedSpec::new(format!("kpa-{tag}"), BIN);
        spec.endpoints = endpoints;
        let bed = Testbed::build(&spec).expect("test bed");
        let api = in_netns(bed.node.name(), ApiServer::start);
        let kubeconfig = TempFile(std::env::temp_dir().join(format!("kp-api-{tag}-{}.kubeconfig", std::process::id())));
        api.write_kubeconfig(&kubeconfig.0);
        api.apply(node());
        setup(&api, &bed);
        let args: Vec<String> = [
            "--hostname-override=node-a",
            "--cluster-cidr=10.244.0.0/16",
            "--iptables-min-sync-period=0s",
            &format!("--iptables-sync-period={SYNC_PERIOD_S}s"),
            &format!("--kubeconfig={}", kubeconfig.0.display()),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let daemon = bed.spawn_in_node(Path::new(BIN), &args).expect("daemon starts");
        daemon
            .wait_for_log("Synced rules", Duration::from_secs(30))
            .expect("first sync");
        Cluster {
            bed,
            api,
            _kubeconfig: kubeconfig,
            _daemon: daemon,
        }
    }

    fn nat(&self) -> String {
        self.bed
            .node
            .exec_ok("iptables-save", ["-t", "nat"])
            .expect("iptables-save")
    }

    fn ok(&self, to: &str, n: u32) -> bool {
        let r = self
            .bed
            .probe(
                &self.bed.client,
                &ProbeArgs::tcp(to.parse().unwrap()).with_count(n).with_timeout_ms(500),
            )
            .expect("probe");
        r.all_ok()
    }
}

fn svc_chain(name: &str) -> String {
    names::service_port_chains(&format!("default/{name}:p"), "tcp").cluster
}

fn api_objects_reach_the_kernel_and_the_starting_event_is_sent() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::start("crud", 2, |api, bed| {
        api.apply(service("web", "10.96.165.10", json!({})));
        api.apply(slice("web", &[(bed.endpoint(0).ip, "node-a")]));
    });
    assert!(c.ok("10.96.165.10:80", 5), "created through the API: traffic flows");
    // Update: a second endpoint.
    c.api.apply(slice(
        "web",
        &[(c.bed.endpoint(0).ip, "node-a"), (c.bed.endpoint(1).ip, "node-a")],
    ));
    let sep = names::endpoint_chain("default/web:p", "tcp", &c.bed.endpoint(1).server_addr().to_string());
    wait_until_every(POLL, Duration::from_secs(10), "the second endpoint's chain", || {
        c.nat().contains(&format!("-A {sep} "))
    });
    let r = c
        .bed
        .probe(
            &c.bed.client,
            &ProbeArgs::tcp("10.96.165.10:80".parse().unwrap()).with_count(60),
        )
        .expect("probe");
    assert_eq!(r.names().len(), 2, "both endpoints used: {:?}", r.names());
    // A headless Service and one of another proxy are ignored (the informer selector).
    let mut other = service("other", "10.96.165.11", json!({}));
    other["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": "cilium"});
    c.api.apply(other);
    // Delete: the chains go away.
    c.api.delete("Service", "default", "web");
    wait_until_every(POLL, Duration::from_secs(10), "the Service's chains to go", || {
        !c.nat().contains(&svc_chain("web"))
    });
    assert!(!c.nat().contains(&svc_chain("other")), "other proxy's Service ignored");
    let requests = c.api.requests().join("\n");
    assert!(
        requests.contains("labelSelector=!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"),
        "{requests}"
    );
    assert!(requests.contains("fieldSelector=metadata.name=node-a"), "{requests}");
    wait_until_every(POLL, Duration::from_secs(10), "the Starting event", || {
        c.api
            .events()
            .iter()
            .any(|e| e["reason"] == "Starting" && e.to_string().contains("node-a"))
    });
}

fn api_outage_with_410_converges_without_breaking_traffic() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::start("outage", 3, |api, bed| {
        api.apply(service("a", "10.96.165.10", json!({})));
        api.apply(slice("a", &[(bed.endpoint(0).ip, "node-a")]));
        api.apply(service("b", "10.96.165.20", json!({})));
        api.apply(slice("b", &[(bed.endpoint(1).ip, "node-a")]));
    });
    assert!(c.ok("10.96.165.10:80", 3) && c.ok("10.96.165.20:80", 3));
    let stream = std::thread::scope(|s| {
        let bed = &c.bed;
        let args = ProbeArgs::tcp("10.96.165.10:80".parse().unwrap())
            .with_stream_seconds(4.0)
            .with_interval_ms(50);
        let handle = s.spawn(move || bed.probe(&bed.client, &args));
        c.api.set_unavailable(true);
        // While the API server is away, objects change: b is deleted, a gains an endpoint.
        c.api.delete("Service", "default", "b");
        c.api.delete("EndpointSlice", "default", "b-1");
        c.api.apply(slice(
            "a",
            &[(c.bed.endpoint(0).ip, "node-a"), (c.bed.endpoint(2).ip, "node-a")],
        ));
        c.api.expire_watches();
        // The rules stay exactly as they were meanwhile.
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            c.nat().contains(&svc_chain("b")),
            "rules untouched while the API server is down"
        );
        assert!(
            c.ok("10.96.165.20:80", 1),
            "b still works while we cannot know it was deleted"
        );
        c.api.set_unavailable(false);
        handle.join().expect("probe thread").expect("probe")
    });
    let st = stream.stream.expect("stream report");
    assert!(
        st.echoed == st.sent && st.errors.is_empty(),
        "traffic to a never broke: {st:?}"
    );
    let sep = names::endpoint_chain("default/a:p", "tcp", &c.bed.endpoint(2).server_addr().to_string());
    wait_until_every(POLL, Duration::from_secs(40), "convergence after the relist", || {
        let nat = c.nat();
        !nat.contains(&svc_chain("b")) && nat.contains(&format!("-A {sep} "))
    });
    assert!(c.ok("10.96.165.10:80", 5));
}

fn healthz_turns_503_while_changes_cannot_be_synced() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::start("healthz", 2, |api, bed| {
        api.apply(service("web", "10.96.165.10", json!({})));
        api.apply(slice(
            "web",
            &[(bed.endpoint(0).ip, "node-a"), (bed.endpoint(1).ip, "node-a")],
        ));
    });
    let healthz: SocketAddr = "127.0.0.1:10256".parse().unwrap();
    let node_ns = c.bed.node.name().to_string();
    wait_until_every(POLL, Duration::from_secs(10), "healthz 200", || {
        http_get(&node_ns, healthz, "/healthz").is_some_and(|(s, _)| s == 200)
    });
    // Someone else's rule points at an endpoint chain, so deleting that chain fails: every
    // sync of the change below fails until the rule goes.
    let sep = names::endpoint_chain("default/web:p", "tcp", &c.bed.endpoint(1).server_addr().to_string());
    c.bed
        .node
        .exec_ok("iptables", ["-t", "nat", "-N", "PIN"])
        .expect("chain");
    c.bed
        .node
        .exec_ok("iptables", ["-t", "nat", "-A", "PIN", "-j", &sep])
        .expect("pin rule");
    c.api.apply(slice("web", &[(c.bed.endpoint(0).ip, "node-a")]));
    let unhealthy = wait_until_every(POLL, Duration::from_secs(SYNC_PERIOD_S * 4), "healthz 503", || {
        http_get(&node_ns, healthz, "/healthz").is_some_and(|(s, body)| s == 503 && body.contains("\"healthy\":false"))
    });
    println!(
        "healthz 503 after {unhealthy:?} (2 x sync period = {}s)",
        2 * SYNC_PERIOD_S
    );
    let (_, livez) = http_get(&node_ns, healthz, "/livez").expect("livez");
    assert!(!livez.contains("nodeEligible"), "{livez}");
    c.bed
        .node
        .exec_ok("iptables", ["-t", "nat", "-F", "PIN"])
        .expect("unpin");
    wait_until_every(
        POLL,
        Duration::from_secs(SYNC_PERIOD_S * 4),
        "healthz 200 again",
        || http_get(&node_ns, healthz, "/healthz").is_some_and(|(s, _)| s == 200),
    );
    assert!(
        !c.nat().contains(&format!(":{sep} ")),
        "the chain is gone after the retry"
    );
}

fn health_check_node_port_and_metrics_over_http() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::start("hcnp", 1, |api, bed| {
        api.apply(service(
            "lb",
            "10.96.165.10",
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 31000,
                   "ports": [{"name": "p", "protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": 30080}]}),
        ));
        api.apply(slice("lb", &[(bed.endpoint(0).ip, "node-a")]));
    });
    let node_ns = c.bed.node.name().to_string();
    let out_ns = c.bed.outside.name().to_string();
    let hc: SocketAddr = "192.168.49.2:31000".parse().unwrap();
    wait_until_every(POLL, Duration::from_secs(10), "health check 200", || {
        http_get(&out_ns, hc, "/").is_some_and(|(s, b)| s == 200 && b.contains("\"localEndpoints\": 1"))
    });
    // The endpoint moves to another node: no local endpoints → 503.
    c.api.apply(slice("lb", &[(c.bed.endpoint(0).ip, "node-b")]));
    wait_until_every(POLL, Duration::from_secs(10), "health check 503", || {
        http_get(&out_ns, hc, "/").is_some_and(|(s, b)| s == 503 && b.contains("\"localEndpoints\": 0"))
    });
    let (status, text) = http_get(&node_ns, "127.0.0.1:10249".parse().unwrap(), "/metrics").expect("metrics");
    assert_eq!(status, 200);
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter",
        "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}",
    ] {
        assert!(text.contains(name), "{name} in /metrics:\n{text}");
    }
    let (_, mode) = http_get(&node_ns, "127.0.0.1:10249".parse().unwrap(), "/proxyMode").expect("proxyMode");
    assert_eq!(mode, "iptables");
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-save"), Tool("iptables-restore")] =>
        api_objects_reach_the_kernel_and_the_starting_event_is_sent,
        api_outage_with_410_converges_without_breaking_traffic,
        healthz_turns_503_while_changes_cannot_be_synced,
        health_check_node_port_and_metrics_over_http;
}
