//! End-to-end with the Kubernetes API source: the real daemon watches a test API server
//! (tests/support/apiserver.rs, listening inside the node namespace of a test bed) through a
//! generated kubeconfig, and real traffic checks the outcome. Also the healthz, metrics and
//! health-check node port servers, over real HTTP, ServiceCIDRs from the API (v1, and
//! v1beta1 where v1 is not served) in nftables mode's cluster-ips check, and hostile objects
//! (huge, at the limits, unknown, malformed, undecodable) in iptables and nftables modes.

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
    daemon: ChildGuard,
}

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Cluster {
    fn start(tag: &str, endpoints: usize, setup: impl FnOnce(&ApiServer, &Testbed)) -> Cluster {
        Cluster::start_with(tag, endpoints, &[], setup)
    }

    /// As [`Cluster::start`], with more daemon flags.
    fn start_with(tag: &str, endpoints: usize, flags: &[&str], setup: impl FnOnce(&ApiServer, &Testbed)) -> Cluster {
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
        .chain(flags)
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
            daemon,
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

/// An address of a ServiceCIDR that is no ClusterIP, and one outside every ServiceCIDR at
/// first. Both sit on the outside host with a server behind them: the node routes traffic to
/// them out of its default route, as a real node leaks traffic to unallocated ClusterIPs, so
/// without a drop the connection is answered by "outside", and with it it times out.
const UNALLOCATED: &str = "10.96.200.200:8080";
const OTHER_RANGE: &str = "10.97.0.50:8080";

fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": name},
           "spec": {"cidrs": cidrs}})
}

/// A Cluster in nftables mode whose API server does not serve the API versions `unserved`: the
/// Service web (10.96.165.10) with one endpoint, and the ServiceCIDR kubernetes (10.96.0.0/16);
/// the outside host answers on [`UNALLOCATED`] and [`OTHER_RANGE`].
fn nftables_cluster(tag: &str, unserved: &[&str]) -> (Cluster, ChildGuard) {
    let c = Cluster::start_with(tag, 1, &["--proxy-mode=nftables"], |api, bed| {
        for version in unserved {
            api.set_served(version, false);
        }
        api.apply(service("web", "10.96.165.10", json!({})));
        api.apply(slice("web", &[(bed.endpoint(0).ip, "node-a")]));
        api.apply(service_cidr("kubernetes", &["10.96.0.0/16"]));
    });
    for addr in [UNALLOCATED, OTHER_RANGE] {
        let ip = addr.split(':').next().unwrap_or_default();
        c.bed
            .outside
            .exec_ok("ip", ["addr", "add", &format!("{ip}/32"), "dev", "lo"])
            .expect("address on the outside host");
    }
    let args: Vec<String> = ["lab", "serve", "--name", "outside", "--port", "8080"]
        .map(String::from)
        .into();
    let outside = c
        .bed
        .spawn_in(&c.bed.outside, Path::new(BIN), &args)
        .expect("outside server");
    (c, outside)
}

impl Cluster {
    /// Who answers one TCP connection from the client pod to `to`: the server's name, or the
    /// error (`timeout` when dropped, `refused` when rejected).
    fn answer(&self, to: &str) -> String {
        let r = self
            .bed
            .probe(
                &self.bed.client,
                &ProbeArgs::tcp(to.parse().unwrap()).with_count(1).with_timeout_ms(300),
            )
            .expect("probe");
        let a = r.attempts.first().expect("one attempt");
        a.name.clone().or_else(|| a.error.clone()).unwrap_or_default()
    }

    fn cluster_ips_check(&self) -> String {
        self.bed
            .node
            .exec_ok("nft", ["list", "chain", "ip", "kube-proxy", "cluster-ips-check"])
            .expect("nft list chain")
    }
}

/// Waits until a connection to `to` is answered as `want` (a server name, `timeout`, `refused`).
fn wait_for_answer(c: &Cluster, to: &str, want: &str, what: &str) {
    let mut last = String::new();
    let took = wait_until_every(POLL, Duration::from_secs(15), what, || {
        last = c.answer(to);
        last == want
    });
    println!("{what}: {to} -> {last} after {took:?}");
}

fn service_cidrs_from_the_api_reach_the_kernel() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (c, _outside) = nftables_cluster("cidr", &[]);
    wait_for_answer(&c, OTHER_RANGE, "outside", "outside every ServiceCIDR: delivered");
    wait_for_answer(&c, UNALLOCATED, "timeout", "an unallocated ClusterIP: dropped");
    assert_eq!(c.answer("10.96.165.10:80"), "ep1", "an allocated ClusterIP is served");
    assert_eq!(
        c.answer("10.96.165.10:81"),
        "refused",
        "an undefined port of it is rejected"
    );
    assert_eq!(c.answer(OTHER_RANGE), "outside", "still delivered");
    // Added while running: its unallocated addresses are dropped too.
    c.api.apply(service_cidr("extra", &["10.97.0.0/24"]));
    wait_for_answer(&c, OTHER_RANGE, "timeout", "a ServiceCIDR added live: dropped");
    // Removed while running: its addresses are no longer ours.
    c.api.delete("ServiceCIDR", "", "kubernetes");
    wait_for_answer(&c, UNALLOCATED, "outside", "a ServiceCIDR removed live: delivered");
    assert_eq!(c.answer("10.96.165.10:80"), "ep1", "the Service is unaffected");
    assert_eq!(c.answer(OTHER_RANGE), "timeout", "the other ServiceCIDR still drops");
    let chain = c.cluster_ips_check();
    assert!(
        chain.contains("10.97.0.0/24") && !chain.contains("10.96.0.0"),
        "{chain}"
    );
    // A Service and endpoint of a legacy object (leading zeros, read in decimal): served,
    // and its ClusterIP is an allocated one, not dropped.
    let ep = c.bed.endpoint(0).ip;
    let IpAddr::V4(ep4) = ep else { panic!("IPv4 test bed") };
    let zeros = ep4.octets().map(|o| format!("{o:03}")).join(".");
    c.api.apply(service("legacy", "10.96.165.011", json!({})));
    let mut legacy = slice("legacy", &[(ep, "node-a")]);
    legacy["endpoints"][0]["addresses"] = json!([zeros]);
    c.api.apply(legacy);
    c.api.apply(service_cidr("kubernetes", &["010.096.000.000/016"]));
    wait_for_answer(&c, "10.96.165.11:80", "ep1", "a legacy Service (10.96.165.011)");
    wait_for_answer(&c, UNALLOCATED, "timeout", "a legacy ServiceCIDR (010.096.000.000/016)");
    let chain = c.cluster_ips_check();
    assert!(
        chain.contains("10.96.0.0-10.97.0.255"),
        "the two, adjacent, merged: {chain}"
    );
    let requests = c.api.requests().join("\n");
    assert!(
        requests.contains("GET /apis/networking.k8s.io/v1/servicecidrs?")
            && !requests.contains("/apis/networking.k8s.io/v1beta1/"),
        "v1 is served: no fallback\n{requests}"
    );
}

fn service_cidrs_fall_back_to_v1beta1_where_v1_is_not_served() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (c, _outside) = nftables_cluster("cidrb", &["networking.k8s.io/v1"]);
    c.daemon
        .wait_for_log(
            "networking.k8s.io/v1 ServiceCIDRs are not served; watching networking.k8s.io/v1beta1",
            Duration::from_secs(10),
        )
        .expect("the fallback is logged");
    wait_for_answer(&c, OTHER_RANGE, "outside", "outside every ServiceCIDR: delivered");
    wait_for_answer(
        &c,
        UNALLOCATED,
        "timeout",
        "an unallocated ClusterIP (v1beta1): dropped",
    );
    assert_eq!(c.answer("10.96.165.10:80"), "ep1", "an allocated ClusterIP is served");
    c.api.apply(service_cidr("extra", &["10.97.0.0/24"]));
    wait_for_answer(
        &c,
        OTHER_RANGE,
        "timeout",
        "a ServiceCIDR added live (v1beta1): dropped",
    );
    let requests = c.api.requests().join("\n");
    assert!(
        requests.contains("GET /apis/networking.k8s.io/v1/servicecidrs?")
            && requests.contains("GET /apis/networking.k8s.io/v1beta1/servicecidrs?")
            && requests.contains("watch=true"),
        "{requests}"
    );
    // Neither version served any more: said once; the CIDRs the proxy has stay programmed
    // (a source never withdraws what it cannot read), and nothing polls in a loop.
    c.api.set_served("networking.k8s.io/v1beta1", false);
    c.daemon
        .wait_for_log(
            "ServiceCIDRs are not served (neither networking.k8s.io/v1 nor v1beta1)",
            Duration::from_secs(10),
        )
        .expect("not served is logged");
    c.api.clear_requests();
    std::thread::sleep(Duration::from_millis(1500));
    let asked = c.api.requests().iter().filter(|r| r.contains("servicecidrs")).count();
    assert_eq!(asked, 0, "no request until the recheck: {:?}", c.api.requests());
    assert_eq!(c.answer(UNALLOCATED), "timeout", "still dropped");
    assert_eq!(c.answer("10.96.165.10:80"), "ep1");
}

// === hostile objects ===

const WEB: &str = "10.96.165.10";

/// JSON of an EndpointSlice `name` of Service `service` (port `p` → 8080), with `endpoints`
/// as given (JSON, so that they can be malformed).
fn raw_slice(name: &str, service: &str, address_type: &str, endpoints: Value) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
           "addressType": address_type, "ports": [{"name": "p", "protocol": "TCP", "port": 8080}], "endpoints": endpoints})
}

/// A ready endpoint on this node, as slice JSON.
fn ep_json(ip: impl ToString) -> Value {
    json!({"addresses": [ip.to_string()], "nodeName": "node-a", "conditions": {"ready": true}})
}

/// A Service whose port number is a string: it does not decode into the typed struct.
fn undecodable_service(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
           "spec": {"clusterIP": "10.96.165.99", "ports": [{"name": "p", "port": "eighty"}]}})
}

/// `n` fake endpoints (10.246.x.y: nothing answers there), as slice JSON.
fn fake_endpoints(n: usize, offset: usize) -> Vec<Value> {
    (offset..offset + n)
        .map(|i| ep_json(format!("10.246.{}.{}", i / 250, i % 250 + 1)))
        .collect()
}

/// The names at the longest the API allows: a namespace and a Service name of 63
/// characters (DNS labels), a port name of 15 (an IANA service name), a slice name of 253.
struct LongNames {
    namespace: String,
    service: String,
    port: String,
    slice: String,
}

fn long_names() -> LongNames {
    LongNames {
        namespace: format!("ns-{}", "n".repeat(60)),
        service: format!("svc-{}", "s".repeat(59)),
        port: format!("port-{}", "p".repeat(10)),
        slice: format!("slice-{}", "e".repeat(247)),
    }
}

/// Every hostile object, sent while the daemon watches. Returns the ClusterIPs of the ones
/// that must still be served by `ep2` (the third endpoint): (what, address).
fn send_hostile_objects(api: &ApiServer, bed: &Testbed) -> Vec<(&'static str, String)> {
    let ep = |i: usize| bed.endpoint(i).ip;
    // One Service with 1,000 ports, its endpoint in 10 slices of 100 ports (the API's limit).
    let ports: Vec<Value> = (0..1000)
        .map(|i| json!({"name": format!("p{i}"), "protocol": "TCP", "port": 1000 + i, "targetPort": 8080}))
        .collect();
    api.apply(service("many-ports", "10.96.165.30", json!({"ports": ports})));
    for k in 0..10 {
        let mut sl = raw_slice(
            &format!("many-ports-{k}"),
            "many-ports",
            "IPv4",
            json!([ep_json(ep(2))]),
        );
        sl["ports"] = (k * 100..k * 100 + 100)
            .map(|i| json!({"name": format!("p{i}"), "protocol": "TCP", "port": 8080}))
            .collect();
        api.apply(sl);
    }
    // One Service with 100 EndpointSlices, and one slice with 1,000 endpoints.
    api.apply(service("many-slices", "10.96.165.31", json!({})));
    for k in 0..100 {
        let eps = json!(fake_endpoints(1, k));
        api.apply(raw_slice(&format!("many-slices-{k}"), "many-slices", "IPv4", eps));
    }
    api.apply(service("big-slice", "10.96.165.32", json!({})));
    api.apply(raw_slice(
        "big-slice-1",
        "big-slice",
        "IPv4",
        json!(fake_endpoints(1000, 0)),
    ));
    // Names at the maximum length (served), and one past it (skipped).
    let n = long_names();
    let mut long = service(&n.service, "10.96.165.33", json!({}));
    long["metadata"]["namespace"] = json!(n.namespace);
    long["spec"]["ports"][0]["name"] = json!(n.port);
    api.apply(long);
    let mut sl = raw_slice(&n.slice, &n.service, "IPv4", json!([ep_json(ep(2))]));
    sl["metadata"]["namespace"] = json!(n.namespace);
    sl["ports"][0]["name"] = json!(n.port);
    api.apply(sl);
    let mut empty = service(&format!("{}-", &n.service[..62]), "10.96.165.34", json!({}));
    empty["metadata"]["namespace"] = json!(n.namespace);
    empty["spec"]["ports"][0]["name"] = json!(n.port);
    api.apply(empty);
    api.apply(service(&"x".repeat(64), "10.96.165.35", json!({})));
    // Unknown protocols, address types and conditions.
    api.apply(service(
        "protocols",
        "10.96.165.36",
        json!({"ports": [{"name": "q", "protocol": "QUIC", "port": 443, "targetPort": 8080},
                         {"name": "p", "protocol": "TCP", "port": 80, "targetPort": 8080}]}),
    ));
    let mut odd = ep_json(ep(2));
    odd["conditions"]["fabulous"] = json!(true);
    api.apply(raw_slice("protocols-1", "protocols", "IPv4", json!([odd])));
    api.apply(raw_slice("protocols-2", "protocols", "IPv7", json!([ep_json(ep(0))])));
    // Duplicate endpoints across slices (and within one).
    api.apply(service("duplicates", "10.96.165.37", json!({})));
    for k in 0..3 {
        api.apply(raw_slice(
            &format!("duplicates-{k}"),
            "duplicates",
            "IPv4",
            json!([ep_json(ep(2)), ep_json(ep(2))]),
        ));
    }
    // Legacy (leading zeros, read in decimal) and malformed addresses.
    let IpAddr::V4(ep2) = ep(2) else {
        panic!("IPv4 endpoint")
    };
    let zeros = ep2.octets().map(|o| format!("{o:03}")).join(".");
    api.apply(service("addresses", "10.96.165.38", json!({})));
    let eps = json!([
        ep_json(zeros),
        ep_json("10.244.1.2.3"),
        ep_json("not-an-ip"),
        ep_json("fd00::1"),
        ep_json("")
    ]);
    api.apply(raw_slice("addresses-1", "addresses", "IPv4", eps));
    // Objects that do not decode, by watch: a Service and a slice; then the Service fixed.
    api.apply(undecodable_service("broken-watch"));
    let mut bad = raw_slice("broken-watch-1", "broken-watch", "IPv4", json!([ep_json(ep(2))]));
    bad["endpoints"][0]["conditions"]["ready"] = json!("yes");
    api.apply(bad);
    api.apply(service("broken-watch", "10.96.165.39", json!({})));
    api.apply(raw_slice(
        "broken-watch-2",
        "broken-watch",
        "IPv4",
        json!([ep_json(ep(2))]),
    ));
    vec![
        ("a Service with 1,000 ports, its first", "10.96.165.30:1000".into()),
        ("a Service with 1,000 ports, its last", "10.96.165.30:1999".into()),
        ("names at the maximum length", "10.96.165.33:80".into()),
        (
            "the known protocol of a Service with an unknown one",
            "10.96.165.36:80".into(),
        ),
        ("duplicate endpoints across slices", "10.96.165.37:80".into()),
        ("a legacy address beside malformed ones", "10.96.165.38:80".into()),
        (
            "a Service fixed after an update that did not decode",
            "10.96.165.39:80".into(),
        ),
    ]
}

/// The messages the hostile objects must produce, each naming the object and the field.
fn hostile_messages() -> Vec<String> {
    vec![
        "Service default/broken-list: field spec.ports[0].port: invalid type: string \"eighty\"".into(),
        "EndpointSlice default/broken-list-1: field endpoints[0].conditions.ready: invalid type".into(),
        "Service default/broken-watch: field spec.ports[0].port: invalid type".into(),
        "EndpointSlice default/broken-watch-1: field endpoints[0].conditions.ready: invalid type".into(),
        format!("Service \"default\"/\"{}\": field metadata.name/namespace: not a valid Kubernetes name", "x".repeat(64)),
        "Service default/protocols: field spec.ports[0].protocol: unknown protocol \"QUIC\"; port skipped".into(),
        "EndpointSlice default/protocols-2: field addressType: unknown address type \"IPv7\"; slice skipped".into(),
        "EndpointSlice default/duplicates-0: field endpoints[1].addresses[0]: duplicate endpoint".into(),
        "EndpointSlice default/addresses-1: field endpoints[1].addresses[0]: invalid IP \"10.244.1.2.3\"".into(),
        "EndpointSlice default/addresses-1: field endpoints[2].addresses[0]: invalid IP \"not-an-ip\"".into(),
        "EndpointSlice default/addresses-1: field endpoints[3].addresses[0]: fd00::1 is an IPv6 address in an IPv4 slice".into(),
        "EndpointSlice default/addresses-1: field endpoints[4].addresses[0]: invalid IP \"\"".into(),
    ]
}

impl Cluster {
    /// How many endpoints the kernel has for port `p` (TCP) of the Service default/`name`.
    fn endpoints_in_kernel(&self, nft: bool, name: &str) -> usize {
        if nft {
            let ruleset = self.bed.node.exec_ok("nft", ["list", "ruleset"]).expect("nft");
            nft_endpoints(&ruleset, name)
        } else {
            let chain = svc_chain(name);
            self.nat()
                .lines()
                .filter(|l| l.starts_with(&format!("-A {chain} ")) && l.contains("-j KUBE-SEP-"))
                .count()
        }
    }

    /// Who answers a connection from the client pod to `to` (a name, or the error).
    fn who(&self, to: &str) -> String {
        let r = self
            .bed
            .probe(
                &self.bed.client,
                &ProbeArgs::tcp(to.parse().unwrap()).with_timeout_ms(500),
            )
            .expect("probe");
        let a = r.attempts.first().expect("one attempt");
        a.name.clone().or_else(|| a.error.clone()).unwrap_or_default()
    }

    /// Moves web's only endpoint to endpoint `i` and waits until traffic follows: the watch
    /// goes on, and a change of another Service is not held back.
    fn move_web_to(&self, i: usize, what: &str) {
        self.api.apply(slice("web", &[(self.bed.endpoint(i).ip, "node-a")]));
        let want = self.bed.endpoint(i).name.clone();
        let started = std::time::Instant::now();
        while self.who(&format!("{WEB}:80")) != want {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{what}: web not moved to {want} in 20 s; the daemon's log ends:\n{}",
                tail(&self.daemon.log())
            );
            std::thread::sleep(POLL);
        }
        println!("{what}: web moved to {want} in {:?}", started.elapsed());
    }
}

/// Hostile objects by watch (and undecodable ones in the first list): each is skipped or
/// trimmed with a message naming the object and the field, the watches go on, and another
/// Service keeps being served and changed, before and after a relist (410).
fn hostile_objects_are_skipped_and_the_rest_keeps_working(mode: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let nft = mode == "nftables";
    let flags: &[&str] = if nft { &["--proxy-mode=nftables"] } else { &[] };
    let c = Cluster::start_with(&format!("hostile-{mode}"), 3, flags, |api, bed| {
        api.apply(service("web", WEB, json!({})));
        api.apply(slice("web", &[(bed.endpoint(0).ip, "node-a")]));
        // In the first list: a relist that failed on them would never complete.
        api.apply(undecodable_service("broken-list"));
        let mut bad = raw_slice(
            "broken-list-1",
            "broken-list",
            "IPv4",
            json!([ep_json(bed.endpoint(2).ip)]),
        );
        bad["endpoints"][0]["conditions"]["ready"] = json!("yes");
        api.apply(bad);
    });
    assert_eq!(
        c.who(&format!("{WEB}:80")),
        c.bed.endpoint(0).name,
        "served from the first list"
    );
    let served = send_hostile_objects(&c.api, &c.bed);
    c.move_web_to(1, "after the hostile objects");
    c.api.apply(service("web2", "10.96.165.11", json!({})));
    c.api.apply(slice("web2", &[(c.bed.endpoint(0).ip, "node-a")]));
    let ep2 = c.bed.endpoint(2).name.clone();
    let check = |when: &str| {
        for (what, to) in &served {
            let mut last = String::new();
            wait_until_every(POLL, Duration::from_secs(20), what, || {
                last = c.who(to);
                last == ep2
            });
            println!("{when}: {what} ({to}) answered by {last}");
        }
        // Created after the hostile objects: served once its own sync comes.
        let ep0 = c.bed.endpoint(0).name.clone();
        wait_until_every(POLL, Duration::from_secs(20), &format!("{when}: web2"), || {
            c.who("10.96.165.11:80") == ep0
        });
        for (name, want) in [
            ("many-slices", 100),
            ("big-slice", 1000),
            ("duplicates", 1),
            ("addresses", 1),
        ] {
            assert_eq!(c.endpoints_in_kernel(nft, name), want, "{when}: endpoints of {name}");
        }
        assert_eq!(
            c.who("10.96.165.35:80"),
            "timeout",
            "{when}: the over-long name is not programmed"
        );
        assert_eq!(
            c.who("10.96.165.34:80"),
            "refused",
            "{when}: names at the maximum length without endpoints"
        );
        // klog quotes the message: its own quotes come escaped.
        let log = c.daemon.log().replace("\\\"", "\"");
        for m in hostile_messages() {
            assert!(
                log.contains(&m),
                "{when}: message {m:?} in the log:
{}",
                tail(&log)
            );
        }
    };
    check("by watch");
    // A relist (410 Gone) with every hostile object in the list.
    c.api.expire_watches();
    c.move_web_to(2, "after the relist");
    c.move_web_to(0, "and once more");
    check("after the relist");
}

/// The last lines of a long log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn hostile_objects_in_iptables_mode() {
    hostile_objects_are_skipped_and_the_rest_keeps_working("iptables");
}

fn hostile_objects_in_nftables_mode() {
    hostile_objects_are_skipped_and_the_rest_keeps_working("nftables");
}

/// The endpoints nftables mode programs for Service `name` (`nft list ruleset` text): the
/// intervals of the `service-endpoints-…` map that fall within the numbers its chain draws
/// (`numgen random mod M offset N … map @MAP`).
fn nft_endpoints(ruleset: &str, name: &str) -> usize {
    let chain = format!("-default/{name}/tcp/p {{");
    let mut lines = ruleset.lines();
    if !lines
        .by_ref()
        .any(|l| l.trim_start().starts_with("chain service-") && l.contains(&chain))
    {
        return 0;
    }
    let Some(rule) = lines
        .take_while(|l| l.trim() != "}")
        .find(|l| l.contains("numgen random mod"))
    else {
        return 0;
    };
    let after = |word: &str| rule.split_whitespace().skip_while(|w| *w != word).nth(1).unwrap_or("");
    let (modulus, offset): (u64, u64) = (after("mod").parse().unwrap_or(0), after("offset").parse().unwrap_or(0));
    let map = after("map").trim_start_matches('@');
    let Some(body) = ruleset.find(&format!("map {map} {{")).map(|i| &ruleset[i..]) else {
        return 0;
    };
    let Some(elements) = body.find("elements = {").map(|i| &body[i + "elements = {".len()..]) else {
        return 0;
    };
    let elements = &elements[..elements.find('}').unwrap_or(elements.len())];
    elements
        .split(',')
        .filter_map(|e| e.split(" : ").next())
        .filter_map(|k| {
            let (lo, hi) = k.trim().split_once('-').unwrap_or((k.trim(), k.trim()));
            Some((lo.parse::<u64>().ok()?, hi.parse::<u64>().ok()?))
        })
        .filter(|&(lo, hi)| lo >= offset && hi < offset + modulus)
        .count()
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-save"), Tool("iptables-restore")] =>
        api_objects_reach_the_kernel_and_the_starting_event_is_sent,
        api_outage_with_410_converges_without_breaking_traffic,
        healthz_turns_503_while_changes_cannot_be_synced,
        health_check_node_port_and_metrics_over_http,
        hostile_objects_in_iptables_mode;
    &[Root, Tool("ip"), Tool("sysctl"), Tool("nft")] =>
        hostile_objects_in_nftables_mode,
        service_cidrs_from_the_api_reach_the_kernel,
        service_cidrs_fall_back_to_v1beta1_where_v1_is_not_served;
}
