//! The iptables rules that remain in IPVS mode: upstream's `writeIptablesRules` as the
//! `iptables-restore --noflush --counters` input (nat first, then filter), driven by which
//! ipsets are non-empty, and the jump rules ensured in the built-in chains. Pure: no I/O.
//! What iptables mode writes alike (the KUBE-FORWARD and KUBE-POSTROUTING rules, what
//! ClusterIP traffic is masqueraded) comes from [`crate::iptables::render`](mod@crate::iptables::render).

use std::fmt::Write as _;
use std::net::IpAddr;

use super::names::*;
use super::render::{Ipset, IpvsRenderOptions};
// IPVS mode programs iptables rules too: their jump rules, mark format and shared rules are
// iptables mode's.
use crate::iptables::JumpRule;
use crate::iptables::render::{
    cluster_ip_masquerade, forward_rules, inserted_at_the_top, masquerade_mark, postrouting_rules,
};
use crate::model::{IpFamily, Protocol};

/// Appends one line to a restore buffer.
macro_rules! line {
    ($buf:expr, $($fmt:tt)*) => {{
        // Writing to a String cannot fail.
        let _ = writeln!($buf, $($fmt)*);
    }};
}

/// Which table a set-driven rule goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Table {
    Nat,
    Filter,
}

/// Upstream's `ipsetWithIptablesChain`: one rule per non-empty set, `-A FROM [-p PROTO] -m
/// comment --comment COMMENT -m set --match-set SET MATCH -j TO`. The LOCAL sets come first so
/// that they RETURN before the masquerade rule of the same protocol.
#[rustfmt::skip]
const SET_RULES: [(SetId, Table, &str, &str, &str, &str); 12] = [
    // (set,                        table,         from chain,                  to,                          match,         -p)
    (SetId::LoopBack,               Table::Nat,    KUBE_POSTROUTING,            "MASQUERADE",                "dst,dst,src", ""),
    (SetId::LoadBalancer,           Table::Nat,    KUBE_SERVICES,               KUBE_LOAD_BALANCER,          "dst,dst",     ""),
    (SetId::LoadBalancerLocal,      Table::Nat,    KUBE_LOAD_BALANCER,          "RETURN",                    "dst,dst",     ""),
    (SetId::NodePortLocalTcp,       Table::Nat,    KUBE_NODE_PORT,              "RETURN",                    "dst",         "tcp"),
    (SetId::NodePortTcp,            Table::Nat,    KUBE_NODE_PORT,              KUBE_MARK_MASQ,              "dst",         "tcp"),
    (SetId::NodePortLocalUdp,       Table::Nat,    KUBE_NODE_PORT,              "RETURN",                    "dst",         "udp"),
    (SetId::NodePortUdp,            Table::Nat,    KUBE_NODE_PORT,              KUBE_MARK_MASQ,              "dst",         "udp"),
    (SetId::NodePortLocalSctp,      Table::Nat,    KUBE_NODE_PORT,              "RETURN",                    "dst,dst",     "sctp"),
    (SetId::NodePortSctp,           Table::Nat,    KUBE_NODE_PORT,              KUBE_MARK_MASQ,              "dst,dst",     "sctp"),
    (SetId::LoadBalancerFw,         Table::Filter, KUBE_PROXY_FIREWALL,         KUBE_SOURCE_RANGES_FIREWALL, "dst,dst",     ""),
    (SetId::LoadBalancerSourceCidr, Table::Filter, KUBE_SOURCE_RANGES_FIREWALL, "RETURN",                    "dst,dst,src", ""),
    (SetId::LoadBalancerSourceIp,   Table::Filter, KUBE_SOURCE_RANGES_FIREWALL, "RETURN",                    "dst,dst,src", ""),
];

/// Upstream's `writeIptablesRules`: the whole restore input, nat then filter, rule for rule.
pub(super) fn restore_input(
    family: IpFamily,
    opts: &IpvsRenderOptions,
    ipsets: &[Ipset],
    no_node_access: &[(IpAddr, Protocol, u16)],
) -> String {
    let mut r = RestoreInput {
        ipsets,
        mark: masquerade_mark(opts.common.masquerade_bit),
        nat: String::new(),
        filter: String::new(),
    };
    // Connections from localhost never go to a service.
    let loopback = match family {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1/128",
    };
    line!(r.nat, "-A {KUBE_SERVICES} -s {loopback} -j RETURN");
    r.set_rules();
    r.cluster_ip_masquerade(opts);
    r.external_ips();
    r.fixed_rules(no_node_access);
    r.accept_rules();
    r.access_filter();
    r.nat.push_str(&postrouting_rules(&r.mark, opts.random_fully));
    r.text()
}

/// The restore input being written: the rules of each table, and the sets they match.
struct RestoreInput<'a> {
    ipsets: &'a [Ipset],
    mark: String,
    nat: String,
    filter: String,
}

impl RestoreInput<'_> {
    fn set(&self, id: SetId) -> Option<&Ipset> {
        self.ipsets.iter().find(|s| s.id == id)
    }

    fn name(&self, id: SetId) -> String {
        self.set(id).map(|s| s.name.clone()).unwrap_or_default()
    }

    fn nonempty(&self, id: SetId) -> bool {
        self.set(id).is_some_and(|s| !s.is_empty())
    }

    fn comment(id: SetId) -> String {
        format!("\"{}\"", ipset_info(id).comment)
    }

    /// `-A KUBE-SERVICES -m comment --comment COMMENT -m set --match-set SET` of a set.
    fn services_match(&self, id: SetId) -> String {
        format!(
            "-A {KUBE_SERVICES} -m comment --comment {} -m set --match-set {}",
            Self::comment(id),
            self.name(id)
        )
    }

    /// [`SET_RULES`]: one rule for each non-empty set.
    fn set_rules(&mut self) {
        for (id, table, from, to, match_type, protocol) in SET_RULES {
            if !self.nonempty(id) {
                continue;
            }
            let proto = if protocol.is_empty() {
                String::new()
            } else {
                format!(" -p {protocol}")
            };
            let (comment, name) = (Self::comment(id), self.name(id));
            let buf = match table {
                Table::Nat => &mut self.nat,
                Table::Filter => &mut self.filter,
            };
            line!(
                buf,
                "-A {from}{proto} -m comment --comment {comment} -m set --match-set {name} {match_type} -j {to}"
            );
        }
    }

    fn cluster_ip_masquerade(&mut self, opts: &IpvsRenderOptions) {
        if !self.nonempty(SetId::ClusterIp) {
            return;
        }
        let base = self.services_match(SetId::ClusterIp);
        match cluster_ip_masquerade(&opts.common) {
            Some(matches) => line!(self.nat, "{base} dst,dst{matches} -j {KUBE_MARK_MASQ}"),
            // Without a detector, only node traffic whose source is a VIP (picked because the
            // VIPs sit on kube-ipvs0) is masqueraded, so that replies find their way back.
            None => line!(self.nat, "{base} src,dst -j {KUBE_MARK_MASQ}"),
        }
    }

    /// Traffic to an external IP from off the node (not bridged from a local pod) and traffic
    /// to one that routing considers local is accepted, whatever else the chains say.
    fn external_ips(&mut self) {
        for (id, masquerade) in [(SetId::ExternalIp, true), (SetId::ExternalIpLocal, false)] {
            if !self.nonempty(id) {
                continue;
            }
            let base = format!("{} dst,dst", self.services_match(id));
            if masquerade {
                line!(self.nat, "{base} -j {KUBE_MARK_MASQ}");
            }
            line!(
                self.nat,
                "{base} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"
            );
            line!(self.nat, "{base} -m addrtype --dst-type LOCAL -j ACCEPT");
        }
    }

    /// The NodePort jump, load-balancer masquerading, the source-range drop, and the drops of
    /// node → load-balancer traffic that the source ranges do not allow.
    fn fixed_rules(&mut self, no_node_access: &[(IpAddr, Protocol, u16)]) {
        line!(
            self.nat,
            "-A {KUBE_SERVICES} -m addrtype --dst-type LOCAL -j {KUBE_NODE_PORT}"
        );
        line!(self.nat, "-A {KUBE_LOAD_BALANCER} -j {KUBE_MARK_MASQ}");
        line!(self.filter, "-A {KUBE_SOURCE_RANGES_FIREWALL} -j DROP");
        // The node reaches a load-balancer IP through IPVS with that IP as source; when the
        // source ranges do not include the node, drop it here (upstream issue 119656).
        for (ip, proto, port) in no_node_access {
            line!(
                self.filter,
                "-A {KUBE_IPVS_OUT_FILTER} -s {ip} -m ipvs --vaddr {ip} --vproto {} --vport {port} -j DROP",
                proto.lower()
            );
        }
    }

    /// Accept what IPVS serves, in case other rules in these tables would drop it; these must
    /// stay at the end of KUBE-SERVICES. Then KUBE-FORWARD and the health-check node ports.
    fn accept_rules(&mut self) {
        for id in [SetId::ClusterIp, SetId::LoadBalancer] {
            if self.nonempty(id) {
                line!(
                    self.nat,
                    "-A {KUBE_SERVICES} -m set --match-set {} dst,dst -j ACCEPT",
                    self.name(id)
                );
            }
        }
        self.filter.push_str(&forward_rules(&self.mark));
        line!(
            self.filter,
            "-A {KUBE_NODE_PORT} -m comment --comment {} -m set --match-set {} dst -j ACCEPT",
            Self::comment(SetId::HealthCheckNodePort),
            self.name(SetId::HealthCheckNodePort)
        );
    }

    /// kube-ipvs0 addresses are local: without this, every port the node listens on would
    /// answer on every service address (upstream issue 72236).
    fn access_filter(&mut self) {
        for (id, match_type) in [
            (SetId::LoadBalancer, "dst,dst"),
            (SetId::ClusterIp, "dst,dst"),
            (SetId::ExternalIp, "dst,dst"),
            (SetId::ExternalIpLocal, "dst,dst"),
            (SetId::HealthCheckNodePort, "dst"),
        ] {
            line!(
                self.filter,
                "-A {KUBE_IPVS_FILTER} -m set --match-set {} {match_type} -j RETURN",
                self.name(id)
            );
        }
        line!(
            self.filter,
            "-A {KUBE_IPVS_FILTER} -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT",
            self.name(SetId::IpvsIps)
        );
    }

    /// Both tables with their chain declarations.
    fn text(self) -> String {
        let mut out = String::from("*nat\n");
        for c in NAT_CHAINS {
            line!(out, ":{c} - [0:0]");
        }
        out.push_str(&self.nat);
        out.push_str("COMMIT\n*filter\n");
        for c in FILTER_CHAINS {
            line!(out, ":{c} - [0:0]");
        }
        out.push_str(&self.filter);
        out.push_str("COMMIT\n");
        out
    }
}
/// Upstream's `iptablesJumpChain`, each ensured with "insert at the top if missing"; returned
/// in the order they end up in each built-in chain. Unlike iptables mode, none of them is
/// limited to new connections.
pub fn jump_rules() -> Vec<JumpRule> {
    let spec: [(&'static str, &'static str, &'static str, &'static str); 9] = [
        ("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
        ("nat", "PREROUTING", KUBE_SERVICES, "kubernetes service portals"),
        ("nat", "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules"),
        ("filter", "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules"),
        ("filter", "INPUT", KUBE_NODE_PORT, "kubernetes health check rules"),
        ("filter", "INPUT", KUBE_PROXY_FIREWALL, "kube-proxy firewall rules"),
        ("filter", "FORWARD", KUBE_PROXY_FIREWALL, "kube-proxy firewall rules"),
        ("filter", "INPUT", KUBE_IPVS_FILTER, "kubernetes ipvs access filter"),
        (
            "filter", "OUTPUT", KUBE_IPVS_OUT_FILTER, "kubernetes ipvs access filter",
        ),
    ];
    let mut out: Vec<JumpRule> = Vec::new();
    for (table, chain, target, comment) in spec {
        let args = vec![
            "-m".to_string(),
            "comment".to_string(),
            "--comment".to_string(),
            comment.to_string(),
            "-j".to_string(),
            target.to_string(),
        ];
        out.push(JumpRule { table, chain, args });
    }
    inserted_at_the_top(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jump_rules_in_kernel_order() {
        let jumps = jump_rules();
        let targets = |table: &str, ch: &str| -> Vec<String> {
            jumps
                .iter()
                .filter(|j| j.table == table && j.chain == ch)
                .map(|j| j.args.last().cloned().unwrap_or_default())
                .collect()
        };
        assert_eq!(
            targets("filter", "INPUT"),
            [KUBE_IPVS_FILTER, KUBE_PROXY_FIREWALL, KUBE_NODE_PORT]
        );
        assert_eq!(targets("filter", "FORWARD"), [KUBE_PROXY_FIREWALL, KUBE_FORWARD]);
        assert_eq!(targets("filter", "OUTPUT"), [KUBE_IPVS_OUT_FILTER]);
        assert_eq!(targets("nat", "PREROUTING"), [KUBE_SERVICES]);
        assert_eq!(
            jumps[0].to_command(),
            "-t nat -I OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        );
        assert!(jumps.iter().all(|j| !j.args.contains(&"--ctstate".to_string())));
    }
}
