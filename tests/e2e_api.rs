//! End-to-end with the Kubernetes API source: the real daemon watches a test API server
//! (tests/support/apiserver.rs, listening inside the node namespace of a test bed) through a
//! generated kubeconfig, and real traffic checks the outcome. Also the healthz, metrics and
//! health-check node port servers, over real HTTP, and ServiceCIDRs from the API (v1, and
//! v1beta1 where v1 is not served) in nftables mode's cluster-ips check.

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

common::harness::main! {
    &[Root, Tool("ip"), Tool("sysctl"), Tool("iptables"), Tool("iptables-save"), Tool("iptables-restore")] =>
        api_objects_reach_the_kernel_and_the_starting_event_is_sent,
        api_outage_with_410_converges_without_breaking_traffic,
        healthz_turns_503_while_changes_cannot_be_synced,
        health_check_node_port_and_metrics_over_http;
    &[Root, Tool("ip"), Tool("sysctl"), Tool("nft")] =>
        service_cidrs_from_the_api_reach_the_kernel,
        service_cidrs_fall_back_to_v1beta1_where_v1_is_not_served;
}
