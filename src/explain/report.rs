//! The report of `kube-proxy explain`: text that fits a 100-column terminal, in the order of
//! the operator's manual routine (the Service, its EndpointSlices, the proxy mode and the
//! daemon, the kernel's rules, conntrack, routes), then the diagnosis; or the same content as
//! JSON. `--all` gives one line per service port with its status. Pure.

use std::fmt::Write as _;

use serde::Serialize;

use super::diagnose::{Diagnosis, Problem};
use super::facts::{Facts, PortFacts};
use super::view::{EndpointView, PortView, Traffic};

/// The width the text report keeps to.
pub const WIDTH: usize = 100;

/// The JSON report: every fact and the diagnosis.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report<'a> {
    pub facts: &'a Facts,
    pub problems: &'a [Problem],
    /// Per port of `facts.ports`: its rule lines missing from the kernel or extra there.
    pub diffs: &'a [Vec<super::rules::RuleDiff>],
}

/// `facts` and `diagnosis` as JSON.
pub fn json(facts: &Facts, diagnosis: &Diagnosis) -> String {
    serde_json::to_string_pretty(&Report {
        facts,
        problems: &diagnosis.problems,
        diffs: &diagnosis.diffs,
    })
    .unwrap_or_else(|e| format!("{{\"error\": \"encoding the report: {e}\"}}"))
}

/// Appends `line` to `out`, wrapped at [`WIDTH`]: continuation lines are indented by
/// `indent` plus four spaces, breaking at spaces (a word longer than the room is cut).
pub fn push_wrapped(out: &mut String, indent: usize, line: &str) {
    let first = " ".repeat(indent);
    let next = " ".repeat(indent + 4);
    let mut current = first.clone();
    let mut empty = true;
    for word in line.split(' ') {
        let room = WIDTH.saturating_sub(current.chars().count());
        let need = word.chars().count() + usize::from(!empty);
        if !empty && need > room {
            out.push_str(current.trim_end());
            out.push('\n');
            current = next.clone();
            empty = true;
        }
        if !empty {
            current.push(' ');
        }
        // A word that does not fit even on its own line is cut into pieces.
        let mut w: Vec<char> = word.chars().collect();
        while current.chars().count() + w.len() > WIDTH && w.len() > 1 {
            let take = WIDTH.saturating_sub(current.chars().count()).max(1);
            let rest = w.split_off(take.min(w.len()));
            current.extend(w);
            out.push_str(&current);
            out.push('\n');
            current = next.clone();
            w = rest;
        }
        current.extend(w);
        empty = false;
    }
    out.push_str(current.trim_end());
    out.push('\n');
}

/// The text report of one Service (or of what was asked).
pub fn text(facts: &Facts, diagnosis: &Diagnosis, asked: &str) -> String {
    let mut out = String::new();
    let w = |out: &mut String, indent: usize, line: &str| push_wrapped(out, indent, line);
    w(
        &mut out,
        0,
        &format!(
            "explain {asked}: desired state from {}, {} mode",
            desired_from(facts),
            facts.mode
        ),
    );
    for p in &facts.ports {
        out.push('\n');
        service_section(&mut out, p);
    }
    out.push('\n');
    proxy_section(&mut out, facts);
    for (p, diffs) in facts.ports.iter().zip(&diagnosis.diffs) {
        out.push('\n');
        rules_section(&mut out, facts, p, diffs);
    }
    out.push('\n');
    conntrack_section(&mut out, facts);
    out.push('\n');
    w(&mut out, 0, "Routes toward the endpoints (ip route):");
    for p in &facts.ports {
        for r in &p.routes {
            let route = r.route.as_deref().unwrap_or("no route");
            w(
                &mut out,
                2,
                &format!("{} ({}): {} [{}]", r.ip, p.family, route, r.verdict),
            );
        }
    }
    if facts.ports.iter().all(|p| p.routes.is_empty()) {
        w(&mut out, 2, "no endpoint addresses");
    }
    out.push('\n');
    diagnosis_section(&mut out, &diagnosis.problems);
    out
}

fn desired_from(facts: &Facts) -> String {
    if facts.desired_from == "daemon" {
        format!("the daemon at {}", facts.daemon.metrics_address)
    } else {
        facts.desired_from.clone()
    }
}

fn service_section(out: &mut String, p: &PortFacts) {
    let v = &p.port;
    push_wrapped(out, 0, &format!("Service {} ({}):", v.name, p.family));
    let mut fields = vec![format!("ClusterIP {}:{}/{}", v.cluster_ip, v.port, v.protocol)];
    if v.node_port != 0 {
        fields.push(format!("NodePort {}", v.node_port));
    }
    if !v.external_ips.is_empty() {
        fields.push(format!("externalIPs {}", join(&v.external_ips)));
    }
    if !v.load_balancer_ips.is_empty() {
        fields.push(format!("load-balancer IPs {}", join(&v.load_balancer_ips)));
    }
    if !v.load_balancer_source_ranges.is_empty() {
        fields.push(format!(
            "loadBalancerSourceRanges {}",
            v.load_balancer_source_ranges.join(",")
        ));
    }
    if v.health_check_node_port != 0 {
        fields.push(format!("healthCheckNodePort {}", v.health_check_node_port));
    }
    fields.push(format!("externalTrafficPolicy {}", v.external_traffic_policy));
    fields.push(format!("internalTrafficPolicy {}", v.internal_traffic_policy));
    fields.push(match v.session_affinity_timeout_seconds {
        Some(t) => format!("sessionAffinity ClientIP ({t} s)"),
        None => "sessionAffinity None".into(),
    });
    push_wrapped(out, 2, &fields.join(", "));
    push_wrapped(
        out,
        2,
        &format!("Endpoints ({}, topology {}):", v.endpoints.len(), v.topology),
    );
    for e in &v.endpoints {
        push_wrapped(out, 4, &endpoint_line(e));
    }
    let mut programmed = format!("Programmed: internal traffic {}", traffic(&v.programmed.internal));
    if let Some(x) = &v.programmed.external {
        let _ = write!(programmed, "; external traffic {}", traffic(x));
    }
    push_wrapped(out, 2, &programmed);
}

fn endpoint_line(e: &EndpointView) -> String {
    let cond = if e.ready {
        "ready"
    } else if e.serving && e.terminating {
        "terminating"
    } else if e.terminating {
        "terminating,not-serving"
    } else {
        "not-ready"
    };
    let mut place = e.node.clone().unwrap_or_else(|| "node ?".into());
    if let Some(z) = &e.zone {
        let _ = write!(place, "/{z}");
    }
    if e.local {
        place.push_str(" (local)");
    }
    let used = if e.categories.is_empty() {
        "unused".to_string()
    } else {
        e.categories.join("+")
    };
    let mut s = format!("{:<21} {cond:<11} {place:<22} {used:<13} {}", e.address(), e.why);
    if !e.zone_hints.is_empty() || !e.node_hints.is_empty() {
        let hints: Vec<&str> = e.zone_hints.iter().chain(&e.node_hints).map(String::as_str).collect();
        let _ = write!(s, "; hints {}", hints.join(","));
    }
    s
}

fn traffic(t: &Traffic) -> String {
    match t.verdict.as_str() {
        "DNAT" if t.endpoints.is_empty() => "DNAT to nothing".into(),
        "DNAT" => format!("DNAT to {} ({})", t.endpoints.join(", "), t.using),
        "REJECT" => "REJECT (connection refused)".into(),
        "DROP" => "DROP (no answer)".into(),
        v => v.to_string(),
    }
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

fn proxy_section(out: &mut String, f: &Facts) {
    push_wrapped(
        out,
        0,
        &format!("Proxy: {} mode on node {}", f.mode, f.desired.node.name),
    );
    let d = &f.daemon;
    let daemon = if d.reachable {
        let healthz = match (d.healthz_status, &d.healthz_error) {
            (Some(s), _) => format!("/healthz at {} answers {s}", d.healthz_address),
            (None, Some(e)) => format!("/healthz at {}: {e}", d.healthz_address),
            (None, None) => "no /healthz".into(),
        };
        format!("kube-proxy answers at {}; {healthz}", d.metrics_address)
    } else {
        format!(
            "kube-proxy is down: no answer at {} ({})",
            d.metrics_address,
            d.error.as_deref().unwrap_or("no answer")
        )
    };
    push_wrapped(out, 2, &daemon);
    let s = &f.desired.source;
    if !s.kind.is_empty() {
        let state = match &s.unreachable_since {
            Some(t) => format!("unreachable since {t}"),
            None => "reachable".into(),
        };
        push_wrapped(out, 2, &format!("its source ({}): {state}", s.kind));
    }
    for fam in &f.desired.families {
        if let Some(sync) = &fam.last_sync {
            let result = match &sync.error {
                Some(e) => format!("failed: {e}"),
                None => "ok".into(),
            };
            let kind = if sync.full { "full" } else { "partial" };
            push_wrapped(
                out,
                2,
                &format!("last {} sync: {} ({kind}), {result}", fam.family, sync.time),
            );
        }
    }
    if f.leftovers.is_empty() {
        push_wrapped(out, 2, "rules of other proxy modes: none");
    }
    for l in &f.leftovers {
        push_wrapped(out, 2, &format!("rules of {} mode: {}", l.mode, l.what));
    }
    if let Some(e) = &f.ipvs_kernel_error {
        push_wrapped(out, 2, &format!("IPVS kernel check: {e}"));
    }
}

fn rules_section(out: &mut String, f: &Facts, p: &PortFacts, diffs: &[super::rules::RuleDiff]) {
    let tool = match f.mode.as_str() {
        "nftables" => "nftables table kube-proxy, over netlink",
        "ipvs" => "IPVS virtual servers with ActiveConn/InActConn, over netlink",
        _ => "iptables-save -c",
    };
    push_wrapped(
        out,
        0,
        &format!("Rules of {} ({}) in the kernel ({tool}):", p.port.name, p.family),
    );
    match (&p.actual_rules, &p.read_back_error) {
        (_, Some(e)) => push_wrapped(out, 2, &format!("could not be read: {e}")),
        (Some(a), None) if a.sections.is_empty() => push_wrapped(out, 2, "none"),
        (Some(a), None) => {
            for s in &a.sections {
                push_wrapped(out, 2, &s.place);
                for l in &s.lines {
                    push_wrapped(out, 4, l);
                }
            }
        }
        (None, None) => push_wrapped(out, 2, "not read"),
    }
    if diffs.is_empty() {
        push_wrapped(out, 2, "differences from the desired rules: none");
    } else {
        push_wrapped(out, 2, "differences from the desired rules:");
        for d in diffs {
            push_wrapped(out, 4, &format!("{} in {}: {}", d.kind, d.place, d.line));
        }
    }
}

fn conntrack_section(out: &mut String, f: &Facts) {
    push_wrapped(out, 0, "Connection tracking (conntrack -S, nf_conntrack_count/max):");
    let ct = &f.conntrack;
    if let Some(e) = &ct.error {
        push_wrapped(out, 2, &format!("could not be read: {e}"));
    }
    if let Some(u) = ct.usage {
        let share = if u.max > 0 {
            100.0 * u.count as f64 / u.max as f64
        } else {
            0.0
        };
        push_wrapped(
            out,
            2,
            &format!("table: {} of {} entries ({share:.0} %)", u.count, u.max),
        );
    }
    if let (Some(b), Some(a)) = (ct.before, ct.after) {
        push_wrapped(
            out,
            2,
            &format!(
                "insert_failed {} (+{}), drop {} (+{}), early_drop {} (+{}) while watched for {} ms",
                a.insert_failed,
                a.insert_failed.saturating_sub(b.insert_failed),
                a.drop,
                a.drop.saturating_sub(b.drop),
                a.early_drop,
                a.early_drop.saturating_sub(b.early_drop),
                ct.window_ms
            ),
        );
    }
    for p in &f.ports {
        connections_lines(out, p);
    }
}

fn connections_lines(out: &mut String, p: &PortFacts) {
    let c = &p.connections;
    let v: &PortView = &p.port;
    let mut parts: Vec<String> = c
        .per_endpoint
        .iter()
        .map(|(ep, n)| {
            let gone = if v.endpoints.iter().any(|e| e.address() == *ep) {
                ""
            } else {
                ", gone"
            };
            format!("{ep} {} ({} established{gone})", n.total, n.established)
        })
        .collect();
    if c.not_translated > 0 {
        parts.push(format!("{} not translated", c.not_translated));
    }
    let list = if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join("; ")
    };
    push_wrapped(out, 2, &format!("{} ({}) entries: {list}", v.name, p.family));
    if !c.stale_udp.is_empty() {
        push_wrapped(out, 4, &format!("stale UDP entries: {}", c.stale_udp.len()));
        for s in c.stale_udp.iter().take(5) {
            push_wrapped(out, 6, s);
        }
    }
}

fn diagnosis_section(out: &mut String, problems: &[Problem]) {
    if problems.is_empty() {
        push_wrapped(out, 0, "Diagnosis: nothing wrong found.");
        return;
    }
    push_wrapped(out, 0, &format!("Diagnosis ({} problems):", problems.len()));
    for p in problems {
        push_wrapped(out, 2, &problem_line(p));
    }
}

fn problem_line(p: &Problem) -> String {
    match &p.port {
        Some(port) => format!("- {port}: {}", p.text),
        None => format!("- {}", p.text),
    }
}

/// `--all`: one line per service port (status, name, family, its first problem), then the
/// node's problems.
pub fn all_text(facts: &Facts, diagnosis: &Diagnosis) -> String {
    let mut out = String::new();
    push_wrapped(
        &mut out,
        0,
        &format!(
            "explain --all: {} service ports, desired state from {}, {} mode",
            facts.ports.len(),
            desired_from(facts),
            facts.mode
        ),
    );
    for p in &facts.ports {
        let label = p.label();
        let first = diagnosis
            .problems
            .iter()
            .find(|x| x.port.as_deref() == Some(label.as_str()));
        let mut line = match first {
            None => format!("ok       {label}"),
            Some(x) => format!("PROBLEM  {label}: {} - {}", x.code, x.text),
        };
        if line.chars().count() > WIDTH {
            line = line.chars().take(WIDTH - 3).collect::<String>() + "...";
        }
        out.push_str(&line);
        out.push('\n');
    }
    let node: Vec<Problem> = diagnosis
        .problems
        .iter()
        .filter(|p| p.port.is_none())
        .cloned()
        .collect();
    out.push('\n');
    diagnosis_section(&mut out, &node);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_keeps_to_the_width() {
        let mut out = String::new();
        let long = format!(
            "-A KUBE-SVC-X {} -j KUBE-SEP-Y",
            "-m comment --comment \"ns/web:http -> 10.244.1.5:8080\"".repeat(4)
        );
        push_wrapped(&mut out, 4, &long);
        push_wrapped(&mut out, 2, &"x".repeat(250));
        for l in out.lines() {
            assert!(l.chars().count() <= WIDTH, "{l:?}");
        }
        assert!(out.lines().nth(1).is_some_and(|l| l.starts_with("        ")), "{out}");
        let words: String = out.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(words.starts_with("-A KUBE-SVC-X -m comment"), "nothing lost: {words}");
    }
}
