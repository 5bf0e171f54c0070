//! Fuzzes manifest parsing + model + iptables rendering: any input must either be rejected
//! with an error or render without panicking, and every rendered line must stay one line.
#![no_main]

use std::path::Path;

use kube_proxy::config::{Flags, ProxyConfig};
use kube_proxy::iptables::{IptablesRenderOptions, render};
use kube_proxy::manifest::{Objects, load_str};
use kube_proxy::model::{IpFamily, NodeInfo, build_state};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut objects = Objects::default();
    if load_str(Path::new("fuzz.yaml"), text, &mut objects).is_err() {
        return;
    }
    let cfg = ProxyConfig::resolve(&Flags {
        hostname_override: Some("node-a".into()),
        cluster_cidr: Some("10.244.0.0/16,fd00::/48".into()),
        ..Flags::default()
    })
    .expect("static config is valid");
    let node = NodeInfo::from_objects(&objects, "node-a", &[]);
    for family in [IpFamily::V4, IpFamily::V6] {
        let state = build_state(&objects, &node, family);
        let rs = render(&state, &IptablesRenderOptions::from_config(&cfg, family, &node));
        for line in rs.restore.lines() {
            assert!(!line.contains('\r') && !line.contains('\0'), "control character in {line:?}");
            assert!(line.matches('"').count() % 2 == 0, "unbalanced quotes in {line:?}");
        }
    }
});
