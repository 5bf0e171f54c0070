//! Benchmark: build the model and render the full iptables ruleset for large clusters.
//! Run with `cargo bench --bench render`; prints one line per size (median of several runs):
//! the time to convert the cluster's objects into the daemon's store (done once, as objects
//! arrive), to build one family's state from the store from scratch (the first sync), to
//! build it again after one endpoint change (every later sync: only the changed Service is
//! merged again), and to render.

use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::{IptablesRenderOptions, render};
use kube_proxy::manifest::Objects;
use kube_proxy::model::{IpFamily, ProxyState, StateBuilder, Store, store, synthetic};
use kube_proxy::proxy::RenderOptions;

/// The synthetic state as the Services and EndpointSlices that describe it.
fn objects(state: &ProxyState) -> Objects {
    let mut o = Objects::default();
    for sps in &state.service_ports {
        let p = &sps.port;
        let svc = serde_json::json!({
            "metadata": {"name": p.name.name, "namespace": p.name.namespace},
            "spec": {"clusterIP": p.cluster_ip.to_string(), "type": if p.node_port != 0 { "NodePort" } else { "ClusterIP" },
                     "ports": [{"name": p.name.port, "port": p.port, "protocol": "TCP",
                                "nodePort": if p.node_port != 0 { Some(p.node_port) } else { None }}]},
        });
        let eps: Vec<_> = sps
            .endpoints
            .iter()
            .map(|e| serde_json::json!({"addresses": [e.ip.to_string()], "nodeName": if e.is_local { "node-a" } else { "node-b" }}))
            .collect();
        let slice = serde_json::json!({
            "metadata": {"name": format!("{}-x1", p.name.name), "namespace": p.name.namespace,
                         "labels": {"kubernetes.io/service-name": p.name.name}},
            "addressType": "IPv4",
            "ports": [{"name": p.name.port, "port": sps.endpoints.first().map_or(8080, |e| e.port), "protocol": "TCP"}],
            "endpoints": eps,
        });
        o.services.push(serde_json::from_value(svc).expect("a Service"));
        o.endpoint_slices
            .push(serde_json::from_value(slice).expect("an EndpointSlice"));
    }
    o
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e3
}

fn main() {
    let opts = IptablesRenderOptions {
        common: RenderOptions {
            local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
            ..RenderOptions::default()
        },
        ..IptablesRenderOptions::default()
    };
    println!(
        "{:<22} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "services x endpoints", "convert p50", "state p50", "1 change p50", "render p50", "lines", "bytes"
    );
    for (s, e) in [(1_000, 10), (10_000, 10), (44_000, 1), (5_000, 50)] {
        let st = synthetic::state(s, e);
        let objs = objects(&st);
        let mut convert = Vec::new();
        let mut build = Vec::new();
        let mut change = Vec::new();
        for round in 0..5 {
            let t = Instant::now();
            let store = Store::from_objects(&objs, &st.node.name);
            convert.push(t.elapsed());
            let t = Instant::now();
            let built = store.state(&st.node, IpFamily::V4);
            build.push(t.elapsed());
            assert_eq!(
                built.service_ports, st.service_ports,
                "the objects describe the synthetic state"
            );
            // One endpoint of one Service changes: the next build merges that Service only.
            let mut builder = StateBuilder::with_store(store);
            builder.build(&st.node, IpFamily::V4);
            let mut changed = objs.endpoint_slices[round * 7 % objs.endpoint_slices.len()].clone();
            changed.endpoints[0].addresses[0] = "10.255.255.254".into();
            let name = store::object_name(&changed.metadata);
            let t = Instant::now();
            builder.apply(vec![store::Change::Slice(
                name,
                Some(store::slice_entry(&changed, &st.node.name)),
            )]);
            let rebuilt = builder.build(&st.node, IpFamily::V4);
            change.push(t.elapsed());
            let moved = rebuilt.service_ports.iter().flat_map(|s| &s.endpoints);
            assert!(moved.into_iter().any(|e| e.ip.to_string() == "10.255.255.254"));
        }
        drop(objs);
        let mut times: Vec<Duration> = Vec::new();
        let mut lines = 0;
        let mut bytes = 0;
        for _ in 0..5 {
            let t = Instant::now();
            let rs = render(&st, &opts);
            times.push(t.elapsed());
            lines = rs.restore.lines().count();
            bytes = rs.restore.len();
        }
        println!(
            "{:<22} {:>10.1}ms {:>10.1}ms {:>10.1}ms {:>10.1}ms {:>12} {:>12}",
            format!("{s} x {e}"),
            median(convert),
            median(build),
            median(change),
            median(times),
            lines,
            bytes
        );
    }
}
