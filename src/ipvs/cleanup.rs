//! Removing what IPVS mode leaves on a node: the virtual servers that are ours, IPVS mode's
//! iptables jumps and chains, its ipsets and the `kube-ipvs0` dummy link. Either all at once
//! (`kube-proxy --cleanup`: [`cleanup`]), or while another mode runs after a mode switch
//! ([`remove`]), where two things differ:
//! - a virtual server through which IPVS still carries connections stays, and so does its
//!   address on `kube-ipvs0`, until they have closed. IPVS handles an established connection at
//!   LOCAL_IN from its own connection table, which needs the virtual server (deleted, IPVS
//!   expires the connection with its conntrack entry, and the next packets are picked up
//!   mid-stream by the new mode's DNAT, towards any endpoint: in the VM, 2 of 4 streams over 2
//!   endpoints were reset) and the address (unbound, the packets are routed away: the stream
//!   stalled). New connections never need them: the new mode DNATs them before routing.
//!   [`live_connections`] reads which virtual servers still carry connections from IPVS's
//!   connection table;
//! - the running mode's iptables rules stay: IPVS and iptables modes share chain names and
//!   four jump rules ([`IptablesFootprint`]), which iptables mode rewrote on its first sync.
//!
//! Also what tells a virtual server of ours from another user's, which the proxier's syncs
//! share.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::host::{HostError, IpvsHost};
use super::names::{DUMMY_DEVICE, FILTER_CHAINS, IPSETS, NAT_CHAINS, set_name};
use super::netlink::{Ipvs, RealServer, ServiceKey, VirtualServer};
use super::proxier::gone_ok;
// IPVS mode's iptables rules go through the iptables edge, as they came.
use crate::iptables::JumpRule;
use crate::iptables::exec::Iptables;
use crate::model::{IpFamily, Protocol};

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

/// Removes IPVS mode's state at once: virtual servers on `kube-ipvs0` addresses (and, with
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
    remove(
        ipvs,
        &BTreeMap::new(),
        ipts,
        host,
        node_ports,
        &IptablesFootprint::none(),
    )
    .errors
}

/// What a [`remove`] left.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    /// Virtual servers of ours kept because IPVS still carries connections through them, with
    /// how many.
    pub draining: Vec<(ServiceKey, usize)>,
    /// What failed (retried by the next call).
    pub errors: Vec<String>,
}

impl Removal {
    /// Nothing of IPVS mode is left.
    pub fn is_done(&self) -> bool {
        self.draining.is_empty() && self.errors.is_empty()
    }
}

/// Removes IPVS mode's state as [`cleanup`] does, but for the virtual servers in `live` (with
/// connections that can still carry data: see [`live_connections`]), which stay with their
/// `kube-ipvs0` addresses (the link too, while one of them is there), and for the iptables
/// rules that `kept` (the running mode) also has. Called again, it removes what has drained
/// since.
pub fn remove<H: IpvsHost>(
    ipvs: Option<&mut dyn Ipvs>,
    live: &BTreeMap<ServiceKey, usize>,
    ipts: &mut [&mut dyn Iptables],
    host: &mut H,
    node_ports: bool,
    kept: &IptablesFootprint,
) -> Removal {
    let mut r = Removal::default();
    // Unknown addresses: nothing on kube-ipvs0 can be told ours, and the link stays.
    let dummy: Option<BTreeSet<IpAddr>> = match host.addresses(DUMMY_DEVICE) {
        Ok(a) => Some(a.into_iter().collect()),
        Err(e) => {
            r.errors.push(e.to_string());
            None
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
        let on_dummy = dummy.clone().unwrap_or_default();
        r.draining = remove_virtual_servers(ipvs, live, &on_dummy, &others, &mut r.errors);
    }
    let ours = IptablesFootprint::ipvs();
    for ipt in ipts.iter_mut() {
        r.errors.extend(remove_iptables(&mut **ipt, &ours, kept));
    }
    // Sets referenced by rules cannot be destroyed: the rules went first.
    match host.ipsets() {
        Ok(sets) => {
            for name in ipset_names() {
                if sets.contains_key(&name)
                    && let Err(e) = host.ipset_destroy(&name)
                {
                    r.errors.push(e.to_string());
                }
            }
        }
        // No ipset tool or no ipset in the kernel: there are no sets of ours either.
        Err(HostError::Spawn { .. }) => {}
        Err(e) => r.errors.push(e.to_string()),
    }
    if let Some(dummy) = dummy
        && let Err(e) = unbind_drained(host, &dummy, &r.draining)
    {
        r.errors.push(e.to_string());
    }
    r
}

/// Unbinds the addresses of `kube-ipvs0` that no draining virtual server is on, or deletes
/// the link when none is.
fn unbind_drained<H: IpvsHost>(
    host: &mut H,
    dummy: &BTreeSet<IpAddr>,
    draining: &[(ServiceKey, usize)],
) -> Result<(), HostError> {
    let held: BTreeSet<IpAddr> = draining
        .iter()
        .filter_map(|(k, _)| match k {
            ServiceKey::Addr { address, .. } => Some(*address),
            ServiceKey::Fwmark { .. } => None,
        })
        .filter(|a| dummy.contains(a))
        .collect();
    if held.is_empty() {
        return host.delete_link(DUMMY_DEVICE);
    }
    let unbind: Vec<IpAddr> = dummy.difference(&held).copied().collect();
    host.change_addresses(DUMMY_DEVICE, &[], &unbind)
}

/// Deletes our virtual servers but those in `live`; the ones kept, with their connections.
fn remove_virtual_servers(
    ipvs: &mut dyn Ipvs,
    live: &BTreeMap<ServiceKey, usize>,
    dummy: &BTreeSet<IpAddr>,
    others: &BTreeSet<IpAddr>,
    errors: &mut Vec<String>,
) -> Vec<(ServiceKey, usize)> {
    let services = match ipvs.services() {
        Ok(s) => s,
        Err(e) => {
            errors.push(e.to_string());
            return Vec::new();
        }
    };
    let mut draining = Vec::new();
    for vs in services.iter().filter(|v| v.fwmark.is_none()) {
        let ours = dummy.contains(&vs.address)
            || (others.contains(&vs.address)
                && NODE_PORT_RANGE.contains(&vs.port)
                && ipvs.dests(vs).is_ok_and(|d| node_port_looking(vs, &d, others)));
        if !ours {
            continue;
        }
        match live.get(&vs.key()) {
            Some(&n) => draining.push((vs.key(), n)),
            None => {
                if let Err(e) = gone_ok(ipvs.delete_service(vs)) {
                    errors.push(e.to_string());
                }
            }
        }
    }
    draining
}

/// Where `/proc/net/ip_vs_conn` is (per network namespace, present while IPVS is loaded).
pub const CONNECTION_TABLE: &str = "/proc/net/ip_vs_conn";

/// States of an IPVS connection entry that IPVS carries no data for: TCP's TIME_WAIT and
/// CLOSE, SCTP's CLOSED and REJECTED, persistence templates (NONE, ASSURED), and TCP's
/// SYN_SENT. IPVS enters SYN_SENT when it sees a SYN from the real server's side first, which a
/// connection a client opened through a NAT virtual server never does: after a switch, the
/// SYN-ACK of a new connection of the new mode, from a client port that an earlier IPVS
/// connection to the same endpoint used, finds that entry in TIME_WAIT and turns it SYN_SENT
/// for 2 minutes (228 of them in the VM while the load went on, every one the new mode's
/// connection). Every other state is a live connection: ESTABLISHED, SYN_RECV (the handshake),
/// a half-closed FIN_WAIT, CLOSE_WAIT or LAST_ACK, a UDP flow.
const DONE_STATES: [&str; 7] = [
    "TIME_WAIT", "CLOSE", "CLOSED", "REJECTED", "NONE", "ASSURED", "SYN_SENT",
];

/// The live connections per virtual server in IPVS's connection table, as the kernel lists
/// it in [`CONNECTION_TABLE`]: `Pro FromIP FPrt ToIP TPrt DestIP DPrt State Expires ...`, with
/// IPv4 addresses in hex (`0A60000A`), IPv6 ones in full (`fd00:0096:0000:...`) and ports in
/// hex. Lines it cannot read are skipped.
pub fn live_connections(table: &str) -> BTreeMap<ServiceKey, usize> {
    let mut live = BTreeMap::new();
    for line in table.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let (Some(proto), Some(vaddr), Some(vport), Some(state)) = (w.first(), w.get(3), w.get(4), w.get(7)) else {
            continue;
        };
        let protocol = match *proto {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            // The header, and templates of firewall-mark services ("IP").
            _ => continue,
        };
        if DONE_STATES.contains(state) {
            continue;
        }
        let address = match u32::from_str_radix(vaddr, 16) {
            Ok(v4) if vaddr.len() == 8 => IpAddr::V4(Ipv4Addr::from(v4)),
            _ => match vaddr.parse::<Ipv6Addr>() {
                Ok(v6) => IpAddr::V6(v6),
                Err(_) => continue,
            },
        };
        let Ok(port) = u16::from_str_radix(vport, 16) else {
            continue;
        };
        *live
            .entry(ServiceKey::Addr {
                protocol,
                address,
                port,
            })
            .or_insert(0) += 1;
    }
    live
}

/// Whether the node holds IPVS mode's iptables rules (its own filter chain exists).
pub fn iptables_state_present(ipt: &mut dyn Iptables) -> bool {
    ipt.chain_exists("filter", super::names::KUBE_IPVS_FILTER)
        .unwrap_or(false)
}

/// One mode's iptables rules: the tables it has chains in, which chains there are its, and its
/// jump rules in the built-in chains. IPVS and iptables modes share chain names
/// (KUBE-SERVICES, KUBE-POSTROUTING, KUBE-MARK-MASQ, KUBE-FORWARD, KUBE-PROXY-FIREWALL) and
/// four jump rules (into KUBE-SERVICES from PREROUTING and OUTPUT, KUBE-POSTROUTING and
/// KUBE-FORWARD): removing one mode's rules while the other runs leaves alone what the running
/// one has.
#[derive(Clone, Debug)]
pub struct IptablesFootprint {
    pub tables: &'static [&'static str],
    /// Whether chain (second argument) of table (first) is the mode's.
    pub owns: fn(&str, &str) -> bool,
    pub jumps: Vec<JumpRule>,
}

fn owns_nothing(_table: &str, _chain: &str) -> bool {
    false
}

fn ipvs_owns(table: &str, chain: &str) -> bool {
    match table {
        "nat" => NAT_CHAINS.contains(&chain),
        "filter" => FILTER_CHAINS.contains(&chain),
        _ => false,
    }
}

impl IptablesFootprint {
    /// A mode without iptables rules (nftables mode; nothing kept).
    pub fn none() -> IptablesFootprint {
        IptablesFootprint {
            tables: &[],
            owns: owns_nothing,
            jumps: Vec::new(),
        }
    }

    /// IPVS mode's.
    pub fn ipvs() -> IptablesFootprint {
        IptablesFootprint {
            tables: &["nat", "filter"],
            owns: ipvs_owns,
            jumps: super::iptables::jump_rules(),
        }
    }

    /// The `iptables-restore --noflush` input that removes this mode's jumps and chains from
    /// `table`, given its `iptables-save` output, but those `kept` has too; empty when there
    /// is nothing to remove. Every chain removed is flushed; one that a rule staying behind
    /// still jumps to (the other mode's, where both left state and the chains share names,
    /// or someone else's) is left for its owner instead of deleted.
    pub fn removal_input(&self, table: &str, saved: &str, kept: &IptablesFootprint) -> String {
        let existing = crate::iptables::proxier::existing_chains(saved);
        let ours: Vec<&str> = existing
            .iter()
            .map(String::as_str)
            .filter(|c| (self.owns)(table, c) && !(kept.owns)(table, c))
            .collect();
        let jumps: Vec<String> = self
            .jumps
            .iter()
            .filter(|j| j.table == table && !kept.jumps.contains(j))
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
}

/// The jump rule as `iptables-save` prints it.
fn saved_form(j: &JumpRule) -> String {
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

/// The restore inputs that remove `removed`'s rules but `kept`'s from one family, one per
/// table with something to remove (one `iptables-save` per table); the errors of the saves.
fn removal_inputs(
    ipt: &mut dyn Iptables,
    removed: &IptablesFootprint,
    kept: &IptablesFootprint,
) -> (Vec<String>, Vec<String>) {
    let mut inputs = Vec::new();
    let mut errors = Vec::new();
    for table in removed.tables {
        match ipt.save(table) {
            Ok(saved) => {
                let input = removed.removal_input(table, &saved, kept);
                if !input.is_empty() {
                    inputs.push(input);
                }
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    (inputs, errors)
}

/// Removes `removed`'s jumps and chains from one family but what `kept` has: one
/// `iptables-save` and at most one `iptables-restore` per table. The errors met.
pub fn remove_iptables(ipt: &mut dyn Iptables, removed: &IptablesFootprint, kept: &IptablesFootprint) -> Vec<String> {
    let (inputs, mut errors) = removal_inputs(ipt, removed, kept);
    for input in inputs {
        if let Err(e) = ipt.restore(&input) {
            errors.push(e.to_string());
        }
    }
    errors
}

/// Whether one family holds rules of `removed` that `kept` does not have (a table that cannot
/// be read counts as holding none).
pub fn iptables_present(ipt: &mut dyn Iptables, removed: &IptablesFootprint, kept: &IptablesFootprint) -> bool {
    !removal_inputs(ipt, removed, kept).0.is_empty()
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

    /// No virtual server yet; `kube-ipvs0` holds `bound`, and the node has 192.168.49.2.
    fn node(bound: &[&str]) -> (FakeIpvs, FakeHost) {
        let mut host = FakeHost::default();
        host.links
            .insert(DUMMY_DEVICE.into(), bound.iter().map(|a| ip(a)).collect());
        host.other = vec![ip("192.168.49.2")];
        (FakeIpvs::new(), host)
    }

    #[test]
    fn cleanup_removes_ours_only() {
        let (mut ipvs, mut host) = node(&["10.96.0.10"]);
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
        let removal = |table: &str, saved: &str| {
            IptablesFootprint::ipvs().removal_input(table, saved, &IptablesFootprint::none())
        };
        let input = removal("nat", saved);
        assert!(input.contains(":KUBE-MARK-MASQ - [0:0]\n"), "{input}");
        assert!(
            !input.contains("-X KUBE-MARK-MASQ"),
            "iptables mode's KUBE-SVC-X uses it: {input}"
        );
        assert!(
            input.contains("-X KUBE-NODE-PORT\n") && input.contains("-X KUBE-SERVICES\n"),
            "{input}"
        );
        assert_eq!(removal("filter", "*filter\nCOMMIT\n"), "");
    }

    /// `/proc/net/ip_vs_conn` as the VM's kernel (6.x) printed it: two streams established,
    /// one closed (TIME_WAIT), one half-closed (FIN_WAIT), an IPv6 one, a UDP flow, a
    /// persistence template, and an entry a new mode's connection turned SYN_SENT.
    const CONN_TABLE: &str = "\
Pro FromIP   FPrt ToIP     TPrt DestIP   DPrt State       Expires PEName PEData
TCP fd00:0000:0000:0000:0000:0000:0000:0002 A53E fd00:0096:0000:0000:0000:0000:0000:0010 0050 fd00:0001:0000:0000:0000:0000:0000:0002 1F90 ESTABLISHED     899
TCP 0AF40002 CD02 0A60000C 0050 0AF40102 1F90 ESTABLISHED     899
TCP 0AF40002 E1FA 0A60000A 0050 0AF40102 1F90 ESTABLISHED     899
TCP 0AF40002 93FA 0A60000A 0050 0AF40202 1F90 TIME_WAIT       102
TCP 0AF40002 B204 0A60000B 0050 0AF40102 1F90 FIN_WAIT        109
UDP 0AF40002 D431 0A600010 0035 0AF40102 1F90 UDP             299
TCP 0AF40002 0000 0A60000D 0050 0AF40102 1F90 NONE          10799
TCP 0AF40902 C8B2 0A60A50A 0050 0AF40202 1F90 SYN_SENT         61
";

    fn tcp(addr: &str, port: u16) -> ServiceKey {
        ServiceKey::Addr {
            protocol: Protocol::Tcp,
            address: ip(addr),
            port,
        }
    }

    #[test]
    fn live_connections_are_those_that_can_still_carry_data() {
        let live = live_connections(CONN_TABLE);
        let udp = ServiceKey::Addr {
            protocol: Protocol::Udp,
            address: ip("10.96.0.16"),
            port: 53,
        };
        assert_eq!(
            live,
            BTreeMap::from([
                (tcp("10.96.0.10", 80), 1),
                (tcp("10.96.0.11", 80), 1),
                (tcp("10.96.0.12", 80), 1),
                (udp, 1),
                (tcp("fd00:96::10", 80), 1),
            ]),
            "TIME_WAIT, SYN_SENT and the template do not count, FIN_WAIT does"
        );
        assert!(live_connections("").is_empty());
        assert!(live_connections("TCP garbage\n").is_empty());
    }

    #[test]
    fn after_a_switch_virtual_servers_with_connections_stay_with_their_addresses() {
        let (mut ipvs, mut host) = node(&["10.96.0.10", "10.96.0.11"]);
        let (busy, idle) = (ip("10.96.0.10"), ip("10.96.0.11"));
        host.sets.insert("KUBE-CLUSTER-IP".into(), BTreeSet::new());
        let node_port = VirtualServer::new(ip("192.168.49.2"), Protocol::Tcp, 30080, "rr");
        for vs in [
            VirtualServer::new(busy, Protocol::Tcp, 80, "rr"),
            VirtualServer::new(busy, Protocol::Tcp, 443, "rr"),
            VirtualServer::new(idle, Protocol::Tcp, 80, "rr"),
            node_port.clone(),
        ] {
            ipvs.add_service(&vs).expect("add");
        }
        let mut ipt = Fake::default();
        let live = BTreeMap::from([(tcp("10.96.0.10", 80), 2), (node_port.key(), 1)]);
        let r = remove(
            Some(&mut ipvs),
            &live,
            &mut [&mut ipt],
            &mut host,
            true,
            &IptablesFootprint::none(),
        );
        assert_eq!(r.errors, Vec::<String>::new());
        assert_eq!(r.draining, vec![(tcp("10.96.0.10", 80), 2), (node_port.key(), 1)]);
        let left: Vec<ServiceKey> = ipvs.table().keys().copied().collect();
        assert_eq!(left, vec![tcp("10.96.0.10", 80), node_port.key()], "the idle ones went");
        assert_eq!(
            host.links.get(DUMMY_DEVICE),
            Some(&BTreeSet::from([busy])),
            "the busy address stays bound, the idle one is unbound"
        );
        assert!(host.sets.is_empty(), "the sets go at once");
        // The connections closed: the next call removes the rest.
        let r = remove(
            Some(&mut ipvs),
            &BTreeMap::new(),
            &mut [&mut ipt],
            &mut host,
            true,
            &IptablesFootprint::none(),
        );
        assert!(r.is_done(), "{r:?}");
        assert!(ipvs.table().is_empty());
        assert!(!host.links.contains_key(DUMMY_DEVICE));
    }

    #[test]
    fn a_draining_node_port_alone_does_not_hold_kube_ipvs0() {
        let (mut ipvs, mut host) = node(&["10.96.0.10"]);
        let node_port = VirtualServer::new(ip("192.168.49.2"), Protocol::Tcp, 30080, "rr");
        ipvs.add_service(&node_port).expect("add");
        let live = BTreeMap::from([(node_port.key(), 1)]);
        let r = remove(
            Some(&mut ipvs),
            &live,
            &mut [],
            &mut host,
            true,
            &IptablesFootprint::none(),
        );
        assert_eq!(r.draining, vec![(node_port.key(), 1)]);
        assert!(!host.links.contains_key(DUMMY_DEVICE));
    }

    #[test]
    fn the_running_modes_chains_and_jumps_are_left_alone() {
        // As iptables mode leaves nat after its first sync over IPVS mode's rules: it rewrote
        // KUBE-SERVICES and KUBE-POSTROUTING, whose jumps are the same in both modes.
        let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
                     :KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
                     :KUBE-NODE-PORT - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n:KUBE-SVC-X - [0:0]\n\
                     -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                     -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
                     -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X\n\
                     -A KUBE-NODE-PORT -p tcp -j KUBE-MARK-MASQ\nCOMMIT\n";
        fn iptables_like(table: &str, chain: &str) -> bool {
            table == "nat" && ["KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"].contains(&chain)
                || chain.starts_with("KUBE-SVC-")
        }
        let ipvs = IptablesFootprint::ipvs();
        let kept = IptablesFootprint {
            tables: &["nat"],
            owns: iptables_like,
            jumps: ipvs.jumps.iter().filter(|j| j.table == "nat").cloned().collect(),
        };
        assert_eq!(
            ipvs.removal_input("nat", saved, &kept),
            "*nat\n:KUBE-NODE-PORT - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n-X KUBE-NODE-PORT\n-X KUBE-LOAD-BALANCER\nCOMMIT\n"
        );
        let mut ipt = Fake::default();
        ipt.saved.insert("nat".into(), saved.into());
        assert!(iptables_present(&mut ipt, &ipvs, &kept));
        ipt.saved
            .insert("nat".into(), "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n".into());
        assert!(
            !iptables_present(&mut ipt, &ipvs, &kept),
            "only the running mode's chains"
        );
    }
}
