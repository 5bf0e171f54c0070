//! `kube-proxy trace` in iptables mode: follows one new packet through the rules kube-proxy
//! rendered ([`Ruleset`]) and reports every path it can take as a [`Trace`].
//!
//! The tracer parses the `iptables-restore` text plus the jump rules kept in built-in chains
//! (`parse`, with each rule's options read by `rule` into the `tables` model), then models
//! the kernel's netfilter hook order (nat PREROUTING/OUTPUT, routing, filter
//! INPUT/FORWARD/OUTPUT, nat POSTROUTING), evaluating the matches and targets kube-proxy uses
//! and following every path the packet can take: random load-balancing and session affinity
//! fork the walk (`walk`).
//!
//! It is deliberately strict: any option it does not model is a [`TraceError`], because a
//! tracer that silently skips a match answers with confidence and is wrong.
//!
//! The IPVS-mode tracer (`crate::ipvs::trace`) walks the same parsed rules with its own hook
//! order (IPVS sits in LOCAL_IN and LOCAL_OUT): it loads them with `parse::load`, supplies the
//! ipsets that `-m set --match-set` looks up through [`SetLookup`], and runs one hook at a time
//! with `walk::Tracer::run_hook`.

use crate::iptables::Ruleset;
use crate::trace::walk::HookOrder;
use crate::trace::{Packet, SetDim, SetLookup, SetValue, Trace, TraceContext, TraceError, check_family};

pub(crate) mod parse;
mod rule;
mod tables;
pub(crate) mod walk;

pub use parse::canonical_rule;
use walk::{Hook, Hooks, ModeState, PathState, Tracer, finish};

/// No ipsets at all: iptables mode creates none, so a rule naming one is an error, as it
/// would be for `iptables-restore`.
pub struct NoSets;

impl SetLookup for NoSets {
    fn dimensions(&self, _name: &str) -> Option<&'static [SetDim]> {
        None
    }

    fn contains(&self, _name: &str, _key: &[SetValue]) -> bool {
        false
    }
}

/// Follows `packet` through `ruleset` and reports every path it can take.
pub fn trace(ruleset: &Ruleset, ctx: &TraceContext, packet: &Packet) -> Result<Trace, TraceError> {
    check_family(ruleset.family, packet)?;
    let tables = parse::load(ruleset, &NoSets)?;
    let from_node = ctx.is_local(&packet.src);
    let mut hooks = Hooks {
        tracer: Tracer::new(&tables, &NoSets, ctx),
        from_node,
    };
    let first = if from_node {
        Hook::NatOutput
    } else {
        Hook::NatPrerouting
    };
    let mut finished = Vec::new();
    let start = PathState::start(packet, from_node, ModeState::default());
    hooks.walk(first, start, &mut finished)?;
    Ok(finish(&tables, finished, from_node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::JumpRule;
    use crate::model::{IpFamily, Protocol};
    use crate::trace::{MAX_PATHS, Verdict, render_text};

    const NODE_IP: &str = "192.168.0.2";

    const RESTORE_V4: &str = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-SERVICES -m comment --comment "ns1/svc2:p80 has no endpoints" -m tcp -p tcp -d 172.30.0.42 --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/svc2:p80 has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3002 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc3:p80 has no local endpoints" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j DROP
-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc3:p80 has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3003 -j DROP
-A KUBE-NODEPORTS -m comment --comment "ns2/svc3:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
-A KUBE-PROXY-FIREWALL -m comment --comment "ns5/svc5:p80 traffic not accepted by KUBE-FW-NUKIZ6OKUXPJNT4C" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-EXT-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SEP-CCCCCCCCCCCCCCCC - [0:0]
:KUBE-SVC-AFFINITYAFFINITY - [0:0]
:KUBE-SEP-DDDDDDDDDDDDDDDD - [0:0]
:KUBE-SEP-EEEEEEEEEEEEEEEE - [0:0]
:KUBE-FW-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-EXT-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-SVC-NUKIZ6OKUXPJNT4C - [0:0]
:KUBE-SEP-FFFFFFFFFFFFFFFF - [0:0]
:KUBE-SEP-OLDOLDOLDOLDOLDO - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 external IP" -m tcp -p tcp -d 192.168.99.11 --dport 80 -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 -j KUBE-SVC-AFFINITYAFFINITY
-A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 loadbalancer IP" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j KUBE-FW-NUKIZ6OKUXPJNT4C
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp -d 127.0.0.0/8 --dport 3001 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-SXIVWICOYRO3J4NJ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.2:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.3:80" -j KUBE-SEP-CCCCCCCCCCCCCCCC
-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
-A KUBE-SEP-BBBBBBBBBBBBBBBB -m comment --comment ns1/svc1:p80 -s 10.180.0.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-BBBBBBBBBBBBBBBB -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.2:80
-A KUBE-SEP-CCCCCCCCCCCCCCCC -m comment --comment ns1/svc1:p80 -s 10.180.0.3 -j KUBE-MARK-MASQ
-A KUBE-SEP-CCCCCCCCCCCCCCCC -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80
-A KUBE-EXT-XPGD46QRK7WJZT7O -m comment --comment "masquerade traffic for ns1/svc1:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-XPGD46QRK7WJZT7O -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.7:80" -m recent --name KUBE-SEP-DDDDDDDDDDDDDDDD --rcheck --seconds 10800 --reap -j KUBE-SEP-DDDDDDDDDDDDDDDD
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.8:80" -m recent --name KUBE-SEP-EEEEEEEEEEEEEEEE --rcheck --seconds 10800 --reap -j KUBE-SEP-EEEEEEEEEEEEEEEE
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.7:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-DDDDDDDDDDDDDDDD
-A KUBE-SVC-AFFINITYAFFINITY -m comment --comment "ns4/svc4:p80 -> 10.180.0.8:80" -j KUBE-SEP-EEEEEEEEEEEEEEEE
-A KUBE-SEP-DDDDDDDDDDDDDDDD -m comment --comment ns4/svc4:p80 -s 10.180.0.7 -j KUBE-MARK-MASQ
-A KUBE-SEP-DDDDDDDDDDDDDDDD -m comment --comment ns4/svc4:p80 -m recent --name KUBE-SEP-DDDDDDDDDDDDDDDD --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.7:80
-A KUBE-SEP-EEEEEEEEEEEEEEEE -m comment --comment ns4/svc4:p80 -s 10.180.0.8 -j KUBE-MARK-MASQ
-A KUBE-SEP-EEEEEEEEEEEEEEEE -m comment --comment ns4/svc4:p80 -m recent --name KUBE-SEP-EEEEEEEEEEEEEEEE --set -m tcp -p tcp -j DNAT --to-destination 10.180.0.8:80
-A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 loadbalancer IP" -s 203.0.113.0/25 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
-A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "other traffic to ns5/svc5:p80 will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-EXT-NUKIZ6OKUXPJNT4C -m comment --comment "masquerade traffic for ns5/svc5:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-NUKIZ6OKUXPJNT4C -j KUBE-SVC-NUKIZ6OKUXPJNT4C
-A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 10.180.0.5:80" -j KUBE-SEP-FFFFFFFFFFFFFFFF
-A KUBE-SEP-FFFFFFFFFFFFFFFF -m comment --comment ns5/svc5:p80 -s 10.180.0.5 -j KUBE-MARK-MASQ
-A KUBE-SEP-FFFFFFFFFFFFFFFF -m comment --comment ns5/svc5:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.5:80
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-X KUBE-SEP-OLDOLDOLDOLDOLDO
COMMIT
"#;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    fn jump(table: &'static str, chain: &'static str, a: &[&str]) -> JumpRule {
        JumpRule {
            table,
            chain,
            args: args(a),
        }
    }

    /// The jump rules upstream kube-proxy keeps in the built-in chains.
    fn upstream_jumps() -> Vec<JumpRule> {
        let new = ["-m", "conntrack", "--ctstate", "NEW"];
        let with_new = |comment: &str, target: &str| -> Vec<String> {
            let mut v = args(&new);
            v.extend(args(&["-m", "comment", "--comment", comment, "-j", target]));
            v
        };
        let mk = |table: &'static str, chain: &'static str, args: Vec<String>| JumpRule { table, chain, args };
        vec![
            mk(
                "filter",
                "INPUT",
                with_new("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
            ),
            jump(
                "filter",
                "INPUT",
                &[
                    "-m", "comment", "--comment", "kubernetes health check service ports", "-j", "KUBE-NODEPORTS",
                ],
            ),
            mk(
                "filter",
                "INPUT",
                with_new(
                    "kubernetes externally-visible service portals",
                    "KUBE-EXTERNAL-SERVICES",
                ),
            ),
            jump("filter", "INPUT", &["-j", "KUBE-FIREWALL"]),
            mk(
                "filter",
                "FORWARD",
                with_new("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
            ),
            jump(
                "filter",
                "FORWARD",
                &[
                    "-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD",
                ],
            ),
            mk(
                "filter",
                "FORWARD",
                with_new("kubernetes service portals", "KUBE-SERVICES"),
            ),
            mk(
                "filter",
                "FORWARD",
                with_new(
                    "kubernetes externally-visible service portals",
                    "KUBE-EXTERNAL-SERVICES",
                ),
            ),
            mk(
                "filter",
                "OUTPUT",
                with_new("kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
            ),
            mk(
                "filter",
                "OUTPUT",
                with_new("kubernetes service portals", "KUBE-SERVICES"),
            ),
            jump("filter", "OUTPUT", &["-j", "KUBE-FIREWALL"]),
            jump(
                "nat",
                "OUTPUT",
                &[
                    "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES",
                ],
            ),
            jump(
                "nat",
                "PREROUTING",
                &[
                    "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES",
                ],
            ),
            jump(
                "nat",
                "POSTROUTING",
                &[
                    "-m", "comment", "--comment", "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING",
                ],
            ),
        ]
    }

    fn ruleset(family: IpFamily, restore: &str) -> Ruleset {
        Ruleset {
            family,
            jumps: upstream_jumps(),
            restore: restore.to_string(),
        }
    }

    fn ctx() -> TraceContext {
        TraceContext {
            local_addresses: vec![NODE_IP.parse().unwrap()],
        }
    }

    fn pkt(src: &str, dst: &str, dport: u16, iface: Option<&str>) -> Packet {
        Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            dport,
            protocol: Protocol::Tcp,
            in_interface: iface.map(str::to_string),
        }
    }

    fn run(p: &Packet) -> Trace {
        trace(&ruleset(IpFamily::V4, RESTORE_V4), &ctx(), p).unwrap()
    }

    fn path_rules(t: &Trace, path: usize) -> Vec<String> {
        t.rules
            .iter()
            .filter(|r| r.path == path)
            .map(|r| format!("{}/{}: {}", r.table, r.chain, r.rule))
            .collect()
    }

    fn strs(v: &[&str]) -> Vec<String> {
        args(v)
    }

    #[test]
    fn cluster_ip_from_pod_dnats_to_every_endpoint_without_masquerade() {
        let t = run(&pkt("10.1.2.3", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["10.180.0.1:80", "10.180.0.2:80", "10.180.0.3:80"]));
        assert!(!t.masquerade);
        for p in &t.paths {
            assert_eq!(p.hooks, strs(&["nat/PREROUTING", "filter/FORWARD", "nat/POSTROUTING"]));
            assert!(!p.masquerade);
        }
        // The first rule is the PREROUTING jump, rendered with its comment quoted.
        assert_eq!(
            t.rules[0].rule,
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        );
        assert_eq!(
            (t.rules[0].table.as_str(), t.rules[0].chain.as_str()),
            ("nat", "PREROUTING")
        );
    }

    #[test]
    fn cluster_ip_from_outside_pod_cidr_masquerades() {
        let t = run(&pkt("192.168.5.5", "172.30.0.41", 80, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(t.masquerade);
        assert!(t.paths.iter().all(|p| p.masquerade && p.verdict == Verdict::Dnat));
        // The masquerade mark makes KUBE-FORWARD accept, but the verdict stays DNAT.
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("kubernetes forwarding rules"))
        );
        assert!(path_rules(&t, 0).last().unwrap().contains("MASQUERADE --random-fully"));
    }

    #[test]
    fn probability_rules_fan_out_one_path_per_endpoint() {
        let t = run(&pkt("10.1.2.3", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.paths.len(), 3);
        let eps: Vec<_> = t.paths.iter().map(|p| p.endpoint.clone().unwrap()).collect();
        assert_eq!(eps, strs(&["10.180.0.1:80", "10.180.0.2:80", "10.180.0.3:80"]));
        assert_eq!(t.paths[0].choices.len(), 1);
        assert!(t.paths[0].choices[0].starts_with("statistic probability 0.3333333333 matched"));
        assert!(t.paths[1].choices[0].starts_with("statistic probability 0.3333333333 not matched"));
        assert!(t.paths[1].choices[1].starts_with("statistic probability 0.5000000000 matched"));
        assert!(t.paths[2].choices[1].starts_with("statistic probability 0.5000000000 not matched"));
        // Rules are grouped per path: path 1's rules do not include path 0's statistic rule.
        assert!(!path_rules(&t, 1).iter().any(|r| r.contains("0.3333333333")));
        assert!(path_rules(&t, 1).iter().any(|r| r.contains("0.5000000000")));
    }

    #[test]
    fn service_without_endpoints_is_rejected_in_filter_forward_without_dnat() {
        let t = run(&pkt("10.1.2.3", "172.30.0.42", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Reject);
        assert_eq!(t.paths.len(), 1);
        assert_eq!(t.paths[0].endpoint, None);
        assert!(t.endpoints.is_empty());
        assert_eq!(t.paths[0].hooks, strs(&["nat/PREROUTING", "filter/FORWARD"]));
        let last = t.rules.last().unwrap();
        assert_eq!((last.table.as_str(), last.chain.as_str()), ("filter", "KUBE-SERVICES"));
        assert!(last.rule.ends_with("-j REJECT"));
        // UDP to the same port is not the TCP service.
        let mut udp = pkt("10.1.2.3", "172.30.0.42", 80, Some("cni0"));
        udp.protocol = Protocol::Udp;
        assert_eq!(run(&udp).verdict, Verdict::Pass);
    }

    #[test]
    fn node_port_from_outside_goes_through_ext_chain_and_masquerades() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 3001, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(t.masquerade);
        assert_eq!(t.endpoints.len(), 3);
        let rules = path_rules(&t, 0);
        let pos = |needle: &str| rules.iter().position(|r| r.contains(needle)).unwrap();
        assert!(pos("nat/KUBE-SERVICES: ") < pos("nat/KUBE-NODEPORTS: "));
        assert!(pos("nat/KUBE-NODEPORTS: ") < pos("masquerade traffic for ns1/svc1:p80"));
        assert!(pos("masquerade traffic for ns1/svc1:p80") < pos("DNAT --to-destination 10.180.0.1:80"));
        // The DNATed packet is no longer for the node: it is forwarded, not input.
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/PREROUTING", "filter/FORWARD", "nat/POSTROUTING"])
        );
        // The same port on an address that is not the node's is not a node port.
        assert_eq!(
            run(&pkt("198.51.100.9", "192.168.0.99", 3001, Some("eth0"))).verdict,
            Verdict::Pass
        );
    }

    #[test]
    fn localhost_node_port_goes_through_the_nfacct_rule() {
        let t = run(&pkt("198.51.100.9", "127.0.0.1", 3001, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("--nfacct-name localhost_nps_accepted_pkts"))
        );
    }

    #[test]
    fn external_traffic_policy_local_without_local_endpoints_is_dropped_only_for_local_destinations() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 3003, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Drop);
        assert_eq!(t.paths[0].hooks, strs(&["nat/PREROUTING", "filter/INPUT"]));
        let last = t.rules.last().unwrap();
        assert_eq!(last.chain, "KUBE-EXTERNAL-SERVICES");
        assert!(last.rule.contains("--dst-type LOCAL"));
        // Not a local destination: the addrtype match fails and the packet passes.
        assert_eq!(
            run(&pkt("198.51.100.9", "192.168.0.99", 3003, Some("eth0"))).verdict,
            Verdict::Pass
        );
        // The external IP rule drops regardless of addrtype.
        assert_eq!(
            run(&pkt("198.51.100.9", "192.168.99.22", 80, Some("eth0"))).verdict,
            Verdict::Drop
        );
    }

    #[test]
    fn health_check_node_port_is_accepted() {
        let t = run(&pkt("198.51.100.9", NODE_IP, 30000, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Accept);
        assert!(t.rules.last().unwrap().rule.contains("health check node port"));
    }

    #[test]
    fn load_balancer_source_ranges_allow_or_drop() {
        let allowed = run(&pkt("203.0.113.5", "5.6.7.8", 80, Some("eth0")));
        assert_eq!(allowed.verdict, Verdict::Dnat);
        assert_eq!(allowed.endpoints, strs(&["10.180.0.5:80"]));
        assert!(allowed.masquerade);

        let denied = run(&pkt("198.51.100.7", "5.6.7.8", 80, Some("eth0")));
        assert_eq!(denied.verdict, Verdict::Drop);
        assert_eq!(denied.paths[0].endpoint, None);
        assert_eq!(denied.paths[0].hooks, strs(&["nat/PREROUTING", "filter/FORWARD"]));
        let rules = path_rules(&denied, 0);
        // The comment-only rule matched and did nothing; the filter firewall dropped.
        assert!(
            rules
                .iter()
                .any(|r| r.contains("will be dropped by KUBE-PROXY-FIREWALL"))
        );
        assert!(rules.last().unwrap().starts_with("filter/KUBE-PROXY-FIREWALL: "));
    }

    #[test]
    fn hairpin_masquerades_only_the_path_back_to_the_source_pod() {
        let t = run(&pkt("10.180.0.1", "172.30.0.41", 80, Some("cni0")));
        assert_eq!(t.paths.len(), 3);
        assert!(t.paths[0].masquerade);
        assert_eq!(t.paths[0].endpoint.as_deref(), Some("10.180.0.1:80"));
        assert!(!t.paths[1].masquerade);
        assert!(!t.paths[2].masquerade);
        assert!(t.masquerade);
    }

    #[test]
    fn session_affinity_rcheck_is_followed_both_ways() {
        let t = run(&pkt("10.1.2.3", "172.30.0.44", 80, Some("cni0")));
        // Hit on endpoint 7; miss 7 + hit 8; miss both + statistic either way.
        assert_eq!(t.paths.len(), 4);
        let eps: Vec<_> = t.paths.iter().map(|p| p.endpoint.clone().unwrap()).collect();
        assert_eq!(
            eps,
            strs(&["10.180.0.7:80", "10.180.0.8:80", "10.180.0.7:80", "10.180.0.8:80"])
        );
        assert!(t.paths[0].choices[0].starts_with("recent KUBE-SEP-DDDDDDDDDDDDDDDD rcheck hit"));
        assert!(t.paths[1].choices[0].starts_with("recent KUBE-SEP-DDDDDDDDDDDDDDDD rcheck miss"));
        assert!(t.paths[1].choices[1].starts_with("recent KUBE-SEP-EEEEEEEEEEEEEEEE rcheck hit"));
        assert_eq!(t.paths[3].choices.len(), 3);
        assert_eq!(t.endpoints, strs(&["10.180.0.7:80", "10.180.0.8:80"]));
    }

    #[test]
    fn unknown_option_is_an_unsupported_rule_with_its_line() {
        let restore = "*filter\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -m tcp -p tcp --sport 80 -j DROP\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        match err {
            TraceError::UnsupportedRule { line, rule, reason } => {
                assert_eq!(line, 3);
                assert!(rule.starts_with("-A KUBE-SERVICES"));
                assert!(reason.contains("--sport"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let restore = "*nat\n:X - [0:0]\n-A X -m physdev --physdev-in eth0 -j RETURN\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert!(matches!(err, TraceError::UnsupportedRule { line: 3, .. }), "{err:?}");
    }

    #[test]
    fn malformed_lines_are_parse_errors_with_their_line() {
        let cases = [
            (
                "*nat\n:X - [0:0]\n-A X -m comment --comment \"unterminated -j RETURN\nCOMMIT\n",
                3,
            ),
            ("*nat\n:X - [0:0]\n-A X -s 10.0.0.0/33 -j RETURN\nCOMMIT\n", 3),
            ("*nat\n:X - [0:0]\n-A X -j DNAT --to-destination nowhere\nCOMMIT\n", 3),
            ("*nat\n:X - [0:0]\n-A X -j RETURN\n", 3),
            ("-A X -j RETURN\n", 1),
        ];
        for (restore, want) in cases {
            let err = trace(
                &ruleset(IpFamily::V4, restore),
                &ctx(),
                &pkt("10.1.2.3", "1.2.3.4", 80, None),
            )
            .unwrap_err();
            assert!(
                matches!(err, TraceError::Parse { line, .. } if line == want),
                "{restore}: {err:?}"
            );
        }
        let restore = "*nat\n:X - [0:0]\n-A X -j KUBE-NOPE\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert!(
            matches!(err, TraceError::UnknownChain { line: 3, ref chain, .. } if chain == "KUBE-NOPE"),
            "{err:?}"
        );
    }

    #[test]
    fn ipv6_ruleset_dnats_to_bracketed_endpoint() {
        let restore = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-V6 - [0:0]
:KUBE-SEP-V6 - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d fd00:10:96::1 --dport 80 -j KUBE-SVC-V6
-A KUBE-SVC-V6 -m tcp -p tcp -d fd00:10:96::1 --dport 80 ! -s fd00:10::/64 -j KUBE-MARK-MASQ
-A KUBE-SVC-V6 -m comment --comment "ns1/svc1:p80 -> [fd00::1]:80" -j KUBE-SEP-V6
-A KUBE-SEP-V6 -s fd00::1/128 -j KUBE-MARK-MASQ
-A KUBE-SEP-V6 -m tcp -p tcp -j DNAT --to-destination [fd00::1]:80
COMMIT
"#;
        let rs = ruleset(IpFamily::V6, restore);
        let ctx6 = TraceContext {
            local_addresses: vec!["fd00:1::2".parse().unwrap()],
        };
        let t = trace(&rs, &ctx6, &pkt("fd00:10::5", "fd00:10:96::1", 80, Some("cni0"))).unwrap();
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["[fd00::1]:80"]));
        assert!(!t.masquerade);
        let t = trace(&rs, &ctx6, &pkt("2001:db8::9", "fd00:10:96::1", 80, Some("eth0"))).unwrap();
        assert!(t.masquerade);
        // An IPv4 packet cannot be traced through an IPv6 ruleset.
        let err = trace(&rs, &ctx6, &pkt("10.1.2.3", "fd00:10:96::1", 80, None)).unwrap_err();
        assert!(matches!(err, TraceError::FamilyMismatch { .. }));
    }

    #[test]
    fn packet_matching_nothing_passes() {
        let mut p = pkt("10.1.2.3", "8.8.8.8", 53, Some("cni0"));
        p.protocol = Protocol::Udp;
        let t = run(&p);
        assert_eq!(t.verdict, Verdict::Pass);
        assert!(t.endpoints.is_empty());
        assert!(!t.masquerade);
        assert_eq!(t.paths.len(), 1);
        // Only the jump rules and the POSTROUTING return matched.
        assert!(t.rules.iter().all(|r| !r.rule.contains("DNAT")));
    }

    #[test]
    fn localnet_firewall_drops_only_when_not_dnated() {
        let restore = r#"*filter
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
*nat
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -m tcp -p tcp -d 127.0.0.1 --dport 8080 -j DNAT --to-destination 127.0.0.1:8081
COMMIT
"#;
        let rs = ruleset(IpFamily::V4, restore);
        let dnated = trace(&rs, &ctx(), &pkt("198.51.100.9", "127.0.0.1", 8080, Some("eth0"))).unwrap();
        assert_eq!(dnated.verdict, Verdict::Dnat);
        assert_eq!(dnated.paths[0].hooks, strs(&["nat/PREROUTING", "filter/INPUT"]));
        let plain = trace(&rs, &ctx(), &pkt("198.51.100.9", "127.0.0.1", 9999, Some("eth0"))).unwrap();
        assert_eq!(plain.verdict, Verdict::Drop);
        assert!(
            plain
                .rules
                .last()
                .unwrap()
                .rule
                .contains("block incoming localnet connections")
        );
    }

    #[test]
    fn locally_generated_packet_uses_output_hooks() {
        let t = run(&pkt(NODE_IP, "172.30.0.41", 80, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.rules[0].chain, "OUTPUT");
        assert_eq!(t.rules[0].table, "nat");
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/OUTPUT", "filter/OUTPUT", "nat/POSTROUTING"])
        );
        // The node is outside the pod CIDR, so the cluster IP rule marks it for masquerade.
        assert!(t.masquerade);
        // Local traffic to a local address loops back through filter INPUT.
        assert!(
            render_text(&t, &pkt(NODE_IP, "172.30.0.41", 80, Some("eth0")))
                .starts_with("packet: TCP 192.168.0.2 -> 172.30.0.41:80 from this node")
        );
        let hc = run(&pkt(NODE_IP, NODE_IP, 30000, None));
        assert_eq!(hc.verdict, Verdict::Accept);
        assert_eq!(
            hc.paths[0].hooks,
            strs(&["nat/OUTPUT", "filter/OUTPUT", "nat/POSTROUTING", "filter/INPUT"])
        );
    }

    #[test]
    fn interface_matches_use_prefix_wildcards_and_never_match_without_an_interface() {
        let restore = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -d 172.30.0.41 ! -i cni+ -j KUBE-MARK-MASQ
-A KUBE-SERVICES -d 172.30.0.41 -j DNAT --to-destination 10.180.0.1
COMMIT
"#;
        let rs = ruleset(IpFamily::V4, restore);
        let from = |src: &str, iface: Option<&str>| trace(&rs, &ctx(), &pkt(src, "172.30.0.41", 80, iface)).unwrap();
        assert!(!from("10.1.2.3", Some("cni0")).masquerade);
        assert!(from("10.1.2.3", Some("eth0")).masquerade);
        assert!(
            from(NODE_IP, Some("cni0")).masquerade,
            "local packets have no input interface"
        );
        // DNAT without a port keeps the destination port.
        assert_eq!(from("10.1.2.3", Some("cni0")).endpoints, strs(&["10.180.0.1:80"]));
    }

    #[test]
    fn endpoints_are_deduplicated_and_sorted_as_strings() {
        let restore = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-X - [0:0]
-A KUBE-SERVICES -d 172.30.0.9 -j KUBE-SVC-X
-A KUBE-SVC-X -m statistic --mode random --probability 0.5000000000 -j DNAT --to-destination 10.0.0.2:80
-A KUBE-SVC-X -m recent --name A --rcheck --seconds 60 --reap -j DNAT --to-destination 10.0.0.10:80
-A KUBE-SVC-X -j DNAT --to-destination 10.0.0.2:80
COMMIT
"#;
        let rs = ruleset(IpFamily::V4, restore);
        let t = trace(&rs, &ctx(), &pkt("10.1.2.3", "172.30.0.9", 80, Some("cni0"))).unwrap();
        assert_eq!(t.paths.len(), 3);
        assert_eq!(t.endpoints, strs(&["10.0.0.10:80", "10.0.0.2:80"]));
    }

    #[test]
    fn jump_loops_are_errors() {
        let restore =
            "*nat\n:KUBE-SERVICES - [0:0]\n:A - [0:0]\n-A KUBE-SERVICES -j A\n-A A -j KUBE-SERVICES\nCOMMIT\n";
        let err = trace(
            &ruleset(IpFamily::V4, restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert!(
            matches!(err, TraceError::Loop { ref stack, .. } if stack.ends_with("A -> KUBE-SERVICES")),
            "{err:?}"
        );
    }

    #[test]
    fn fan_out_is_bounded() {
        let mut restore = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
        for _ in 0..20 {
            restore.push_str("-A KUBE-SERVICES -m statistic --mode random --probability 0.5 -j MARK --xor-mark 0x1\n");
        }
        restore.push_str("COMMIT\n");
        let err = trace(
            &ruleset(IpFamily::V4, &restore),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap_err();
        assert_eq!(err, TraceError::TooManyPaths { limit: MAX_PATHS });
    }

    #[test]
    fn jump_to_undeclared_chain_is_skipped_and_bad_jump_rules_are_errors() {
        // Neither KUBE-FIREWALL nor any filter chain exists here; the jumps to them are skipped.
        let t = trace(
            &ruleset(IpFamily::V4, "*nat\nCOMMIT\n"),
            &ctx(),
            &pkt("10.1.2.3", "1.2.3.4", 80, None),
        )
        .unwrap();
        assert_eq!(t.verdict, Verdict::Pass);
        assert!(t.rules.is_empty());
        let mut rs = ruleset(IpFamily::V4, RESTORE_V4);
        rs.jumps
            .push(jump("nat", "PREROUTING", &["-m", "frobnicate", "-j", "KUBE-SERVICES"]));
        let err = trace(&rs, &ctx(), &pkt("10.1.2.3", "1.2.3.4", 80, None)).unwrap_err();
        assert!(matches!(err, TraceError::UnsupportedJumpRule { .. }), "{err:?}");
    }

    #[test]
    fn render_text_and_json_shapes() {
        let p = pkt("192.168.5.5", "172.30.0.41", 80, Some("eth0"));
        let t = run(&p);
        let text = render_text(&t, &p);
        let mut lines = text.lines();
        assert_eq!(
            lines.next().unwrap(),
            "packet: TCP 192.168.5.5 -> 172.30.0.41:80 in eth0 (IPv4, new connection)"
        );
        assert!(text.contains("path 1/3: nat/PREROUTING -> filter/FORWARD -> nat/POSTROUTING"));
        assert!(text.contains("  nat/KUBE-SEP-SXIVWICOYRO3J4NJ: -A KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(text.contains("  => DNAT to 10.180.0.1:80, masqueraded"));
        assert_eq!(
            text.lines().last().unwrap(),
            "verdict: DNAT; endpoints: 10.180.0.1:80, 10.180.0.2:80, 10.180.0.3:80; masquerade: yes"
        );
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["verdict"], "DNAT");
        assert_eq!(json["paths"][0]["verdict"], "DNAT");
        assert_eq!(json["rules"][0]["path"], 0);
        assert_eq!(serde_json::to_value(Verdict::Pass).unwrap(), "PASS");
    }
}
