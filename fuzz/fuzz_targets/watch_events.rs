//! Fuzzes the API source on watch events: any sequence of lines (watch events of Services,
//! EndpointSlices and the Node, `INIT` / `INIT_DONE` around relists) goes through the
//! watchers' decoding and stores and the state builder without panicking, and what both
//! renderers make of the result stays within what the tools and the kernel take, so that one
//! object can never fail a whole sync: one line per rule, balanced quotes, iptables comments
//! of at most 255 characters, nftables comments of at most 128 bytes.
#![no_main]

use kube_proxy::config::{Flags, ProxyConfig};
use kube_proxy::iptables::{IptablesRenderOptions, render};
use kube_proxy::model::{IpFamily, NodeInfo, StateBuilder};
use kube_proxy::proxy::RenderOptions;
use kube_proxy::source::api::Replay;
use libfuzzer_sys::fuzz_target;

/// The texts after each `marker` in `text`: a quoted string, or a word.
fn comments<'a>(text: &'a str, marker: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(marker) {
        rest = &rest[i + marker.len()..];
        let end = match rest.strip_prefix('"') {
            Some(quoted) => {
                rest = quoted;
                rest.find('"').unwrap_or(rest.len())
            }
            None => rest.find(' ').unwrap_or(rest.len()),
        };
        out.push(&rest[..end]);
        rest = &rest[end..];
    }
    out
}

/// One rule a line, balanced quotes, and comments (after `marker`) of at most `max` bytes.
fn check_lines(what: &str, text: &str, marker: &str, max: usize) {
    for line in text.lines() {
        assert!(
            !line.contains('\r') && !line.contains('\0'),
            "{what}: control character in {line:?}"
        );
        assert!(
            line.matches('"').count() % 2 == 0,
            "{what}: unbalanced quotes in {line:?}"
        );
        for c in comments(line, marker) {
            assert!(c.len() <= max, "{what}: comment of {} bytes in {line:?}", c.len());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut replay = Replay::new("node-a");
    let mut builder = StateBuilder::new();
    for line in text.lines().take(500) {
        // A line that is no watch event is skipped, as the watch stream skips it.
        if let Ok(changes) = replay.line(line) {
            builder.apply(changes);
        }
    }
    let cfg = ProxyConfig::resolve(&Flags {
        hostname_override: Some("node-a".into()),
        cluster_cidr: Some("10.244.0.0/16,fd00::/48".into()),
        ..Flags::default()
    })
    .expect("static config is valid");
    let node = NodeInfo::from_nodes(&builder.store().nodes, "node-a", &[]);
    for family in [IpFamily::V4, IpFamily::V6] {
        let state = builder.build(&node, family);
        let rs = render(&state, &IptablesRenderOptions::from_config(&cfg, family, &node));
        check_lines("iptables", &rs.restore, "--comment ", 255);
        let nft = kube_proxy::nftables::render(&state, &RenderOptions::from_config(&cfg, family, &node));
        check_lines("nftables", &nft, "comment ", 128);
    }
});
