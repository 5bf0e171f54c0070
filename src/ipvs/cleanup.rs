//! Removing what IPVS mode leaves on a node (`kube-proxy --cleanup`, or a switch to another
//! mode): the virtual servers that are ours, IPVS mode's iptables jumps and chains, its ipsets
//! and the `kube-ipvs0` dummy link. Also what tells a virtual server of ours from another
//! user's, which the proxier's syncs share.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::host::{HostError, IpvsHost};
use super::names::{DUMMY_DEVICE, IPSETS, set_name};
use super::netlink::{Ipvs, RealServer, VirtualServer};
use super::proxier::gone_ok;
// IPVS mode's iptables rules go through the iptables edge, as they came.
use crate::iptables::exec::Iptables;
use crate::model::IpFamily;

/// Names of every ipset IPVS mode creates, in both families.
pub fn ipset_names() -> Vec<String> {
    let mut v = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        for info in IPSETS {
            v.push(set_name(info.name, family));
        }
    }
    v
}

/// The NodePort range upstream's apiserver defaults to (kube-proxy is never told the real
/// one): a Masq virtual server on a node address within it is taken for ours.
pub(super) const NODE_PORT_RANGE: std::ops::RangeInclusive<u16> = 30000..=32767;

/// Whether a virtual server looks like one of our NodePorts: on one of `node_addresses`, its
/// port in the default NodePort range, and every real server NAT-forwarded ("Masq", the only
/// forwarding we program; none at all for a Service without endpoints).
pub fn node_port_looking(vs: &VirtualServer, dests: &[RealServer], node_addresses: &BTreeSet<IpAddr>) -> bool {
    vs.fwmark.is_none()
        // Never ours: NodePorts do not go on loopback in IPVS mode.
        && !vs.address.is_loopback()
        && node_addresses.contains(&vs.address)
        && NODE_PORT_RANGE.contains(&vs.port)
        && dests.iter().all(|r| r.forward == super::netlink::Forward::Masq)
}

/// Removes IPVS mode's state: virtual servers on `kube-ipvs0` addresses (and, with
/// `node_ports`, NodePort-looking ones on node addresses: in the default NodePort range with
/// only Masq real servers), the iptables rules and chains of IPVS mode in each of `ipts`, the
/// ipsets and the dummy link. `ipvs` is None when the kernel has no IPVS loaded (then there are
/// no virtual servers). Errors are collected; cleanup does what it can.
pub fn cleanup<H: IpvsHost>(
    ipvs: Option<&mut dyn Ipvs>,
    ipts: &mut [&mut dyn Iptables],
    host: &mut H,
    node_ports: bool,
) -> Vec<String> {
    let mut errors = Vec::new();
    let dummy: BTreeSet<IpAddr> = match host.addresses(DUMMY_DEVICE) {
        Ok(a) => a.into_iter().collect(),
        Err(e) => {
            errors.push(e.to_string());
            BTreeSet::new()
        }
    };
    if let Some(ipvs) = ipvs {
        let others: BTreeSet<IpAddr> = if node_ports {
            host.other_addresses(DUMMY_DEVICE)
                .map(|a| a.into_iter().collect())
                .unwrap_or_default()
        } else {
            BTreeSet::new()
        };
        match ipvs.services() {
            Ok(services) => {
                for vs in services.iter().filter(|v| v.fwmark.is_none()) {
                    let ours = dummy.contains(&vs.address)
                        || (others.contains(&vs.address)
                            && NODE_PORT_RANGE.contains(&vs.port)
                            && ipvs.dests(vs).is_ok_and(|d| node_port_looking(vs, &d, &others)));
                    if ours && let Err(e) = gone_ok(ipvs.delete_service(vs)) {
                        errors.push(e.to_string());
                    }
                }
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    for ipt in ipts.iter_mut() {
        errors.extend(cleanup_iptables(&mut **ipt));
    }
    // Sets referenced by rules cannot be destroyed: the rules went first.
    match host.ipsets() {
        Ok(sets) => {
            for name in ipset_names() {
                if sets.contains_key(&name)
                    && let Err(e) = host.ipset_destroy(&name)
                {
                    errors.push(e.to_string());
                }
            }
        }
        // No ipset tool or no ipset in the kernel: there are no sets of ours either.
        Err(HostError::Spawn { .. }) => {}
        Err(e) => errors.push(e.to_string()),
    }
    if let Err(e) = host.delete_link(DUMMY_DEVICE) {
        errors.push(e.to_string());
    }
    errors
}

/// Whether the node holds IPVS mode's iptables rules (its own filter chain exists).
pub fn iptables_state_present(ipt: &mut dyn Iptables) -> bool {
    ipt.chain_exists("filter", super::names::KUBE_IPVS_FILTER)
        .unwrap_or(false)
}

/// The jump rule as `iptables-save` prints it.
fn saved_form(j: &crate::iptables::JumpRule) -> String {
    let args: Vec<String> = j
        .args
        .iter()
        .map(|a| if a.contains(' ') { format!("\"{a}\"") } else { a.clone() })
        .collect();
    format!("-A {} {}", j.chain, args.join(" "))
}

/// The chain a saved rule jumps or goes to.
fn rule_target(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

/// The `iptables-restore --noflush` input that removes IPVS mode's jumps and chains from one
/// table, given its `iptables-save` output; empty when there are none. Every chain of ours is
/// flushed; one that rules we keep still reference (iptables mode's, where both modes left
/// state: the chains share names) is left for that mode's cleanup instead of deleted.
pub fn iptables_cleanup_input(table: &str, saved: &str) -> String {
    let chains: &[&str] = match table {
        "nat" => &super::names::NAT_CHAINS,
        "filter" => &super::names::FILTER_CHAINS,
        _ => &[],
    };
    let existing = crate::iptables::proxier::existing_chains(saved);
    let ours: Vec<&str> = chains
        .iter()
        .copied()
        .filter(|c| existing.iter().any(|e| e == c))
        .collect();
    let jumps: Vec<String> = super::iptables::jump_rules()
        .iter()
        .filter(|j| j.table == table)
        .map(saved_form)
        .filter(|l| saved.lines().any(|s| s == l))
        .collect();
    if ours.is_empty() && jumps.is_empty() {
        return String::new();
    }
    let kept_targets: BTreeSet<&str> = saved
        .lines()
        .filter(|l| l.starts_with("-A ") && !jumps.iter().any(|j| j == l))
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|c| !ours.contains(&c)))
        .filter_map(rule_target)
        .collect();
    let mut input = format!("*{table}\n");
    for j in &jumps {
        input.push_str(&format!("-D {}\n", &j[3..]));
    }
    for c in &ours {
        input.push_str(&format!(":{c} - [0:0]\n"));
    }
    for c in ours.iter().filter(|c| !kept_targets.contains(*c)) {
        input.push_str(&format!("-X {c}\n"));
    }
    input.push_str("COMMIT\n");
    input
}

/// Deletes IPVS mode's jumps and chains in one family: one `iptables-save` and at most one
/// `iptables-restore` per table.
fn cleanup_iptables(ipt: &mut dyn Iptables) -> Vec<String> {
    let mut errors = Vec::new();
    for table in ["nat", "filter"] {
        let input = match ipt.save(table) {
            Ok(saved) => iptables_cleanup_input(table, &saved),
            Err(e) => {
                errors.push(e.to_string());
                continue;
            }
        };
        if !input.is_empty()
            && let Err(e) = ipt.restore(&input)
        {
            errors.push(e.to_string());
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::exec::Fake;
    use crate::ipvs::host::FakeHost;
    use crate::ipvs::netlink::{FakeIpvs, ServiceKey};
    use crate::model::Protocol;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn cleanup_removes_ours_only() {
        let mut ipvs = FakeIpvs::new();
        let mut host = FakeHost::default();
        host.links
            .insert(DUMMY_DEVICE.into(), BTreeSet::from([ip("10.96.0.10")]));
        host.other = vec![ip("192.168.49.2")];
        host.sets.insert("KUBE-CLUSTER-IP".into(), BTreeSet::new());
        host.sets.insert("SOMEONE-ELSE".into(), BTreeSet::new());
        let ours = VirtualServer::new(ip("10.96.0.10"), Protocol::Tcp, 80, "rr");
        let node_port = VirtualServer::new(ip("192.168.49.2"), Protocol::Tcp, 30080, "rr");
        let theirs = VirtualServer::new(ip("192.168.49.2"), Protocol::Tcp, 443, "rr");
        for vs in [&ours, &node_port, &theirs] {
            ipvs.add_service(vs).expect("add");
        }
        let mut ipt = Fake::default();
        ipt.chains.insert("filter/KUBE-IPVS-FILTER".into());
        assert!(iptables_state_present(&mut ipt));
        ipt.saved.insert(
            "nat".into(),
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:OTHER - [0:0]\n\
             -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A PREROUTING -j OTHER\n-A KUBE-SERVICES -j KUBE-MARK-MASQ\nCOMMIT\n"
                .into(),
        );
        let errors = cleanup(Some(&mut ipvs), &mut [&mut ipt], &mut host, true);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            ipt.restores,
            vec![
                "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                 :KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n-X KUBE-SERVICES\n-X KUBE-MARK-MASQ\nCOMMIT\n"
                    .to_string()
            ],
            "someone else's chain and jump stay; nothing to do in filter"
        );
        let left: Vec<ServiceKey> = ipvs.table().keys().copied().collect();
        assert_eq!(left, vec![theirs.key()]);
        assert!(!host.links.contains_key(DUMMY_DEVICE));
        assert_eq!(host.sets.keys().collect::<Vec<_>>(), vec!["SOMEONE-ELSE"]);
    }

    #[test]
    fn chains_iptables_mode_still_uses_are_flushed_not_deleted() {
        let saved = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
                     :KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-MARK-MASQ\n-A KUBE-NODE-PORT -j KUBE-MARK-MASQ\nCOMMIT\n";
        let input = iptables_cleanup_input("nat", saved);
        assert!(input.contains(":KUBE-MARK-MASQ - [0:0]\n"), "{input}");
        assert!(
            !input.contains("-X KUBE-MARK-MASQ"),
            "iptables mode's KUBE-SVC-X uses it: {input}"
        );
        assert!(
            input.contains("-X KUBE-NODE-PORT\n") && input.contains("-X KUBE-SERVICES\n"),
            "{input}"
        );
        assert_eq!(iptables_cleanup_input("filter", "*filter\nCOMMIT\n"), "");
    }
}
