//! Benchmark: build the model and render the full iptables ruleset for large clusters.
//! Run with `cargo bench --bench render`; prints one line per size (median of several runs).

use std::time::{Duration, Instant};

use kube_proxy::config::LocalDetector;
use kube_proxy::iptables::{RenderOptions, render};
use kube_proxy::model::synthetic;

fn main() {
    let opts = RenderOptions {
        local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
        ..RenderOptions::default()
    };
    println!(
        "{:<22} {:>12} {:>12} {:>12}",
        "services x endpoints", "render p50", "lines", "bytes"
    );
    for (s, e) in [(1_000, 10), (10_000, 10), (44_000, 1), (5_000, 50)] {
        let st = synthetic::state(s, e);
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
        times.sort();
        println!(
            "{:<22} {:>10.1}ms {:>12} {:>12}",
            format!("{s} x {e}"),
            times[2].as_secs_f64() * 1e3,
            lines,
            bytes
        );
    }
}
