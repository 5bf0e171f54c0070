//! IPVS mode behind the daemon's [`Proxier`] trait: what a sync, a cleanup and a read-back
//! mean for [`IpvsProxier`]. A full sync lists and reconciles the whole table (as upstream's
//! every sync does) at start, after a failure and every [`FULL_SYNC_PERIOD`]; a sync of
//! changes sends only the differences from the last one. The daemon syncs every sync period
//! (the NodePort virtual servers follow the interface addresses).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::cleanup::cleanup;
use super::host::IpvsHost;
use super::names::{DUMMY_DEVICE, IPSETS, set_name};
use super::netlink::{Ipvs, RealServer, VirtualServer};
use super::proxier::IpvsProxier;
use super::render::{
    FLAG_SCHED1, FLAG_SCHED2, FLAG_SCHED3, Ipset, IpvsDestination, IpvsRenderOptions, IpvsRuleset, IpvsService,
    NodeAddressSource, VirtualServerKind,
};
use crate::config::ProxyMode;
// IPVS mode programs iptables rules too (masquerading, NodePorts, source ranges).
use crate::iptables::exec::Iptables;
// The same period as iptables mode's full syncs (upstream's `FullSyncPeriod`).
use crate::iptables::proxier::FULL_SYNC_PERIOD;
use crate::model::{IpFamily, Protocol, ProxyState, ServicePort, ServicePortName};
use crate::proxy::{Programmed, ProgrammedSection, Proxier, ReadBackError, SyncContext, SyncError, SyncReport};

impl<V: Ipvs + Send, I: Iptables, H: IpvsHost + Send> Proxier for IpvsProxier<V, I, H> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ipvs
    }

    fn family(&self) -> IpFamily {
        IpvsProxier::family(self)
    }

    fn configure(&mut self, ctx: &SyncContext<'_>) {
        let family = IpvsProxier::family(self);
        self.set_options(IpvsRenderOptions::from_config(ctx.config, family, ctx.node));
    }

    fn sync_full(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        self.force_full_sync();
        self.sync_changes(state)
    }

    fn sync_changes(&mut self, state: &ProxyState) -> Result<SyncReport, SyncError> {
        let full = self.next_sync_is_full();
        self.sync(state).map_err(|e| SyncError::new(full, e))
    }

    fn full_sync_period(&self) -> Option<Duration> {
        // The periodic reconcile that repairs drift (a real server someone deleted, an
        // address someone unbound): other syncs send only what changed in the model.
        Some(FULL_SYNC_PERIOD)
    }

    fn intact(&mut self) -> bool {
        IpvsProxier::intact(self)
    }

    fn next_cleanup(&self) -> Option<Instant> {
        IpvsProxier::next_cleanup(self)
    }

    fn syncs_every_period(&self) -> bool {
        true
    }

    fn cleanup(&mut self) -> Vec<String> {
        self.force_full_sync();
        let (ipvs, ipt, host) = self.parts();
        let mut ipts: [&mut dyn Iptables; 1] = [ipt];
        cleanup(Some(ipvs as &mut dyn Ipvs), &mut ipts, host, true)
    }

    fn read_back(&mut self, port: &ServicePort) -> Result<Programmed, ReadBackError> {
        Ok(self.read_back_all(&[port])?.remove(0))
    }

    /// One listing of the virtual servers for all `ports`, then the real servers of each
    /// port's own (a listing per port would be quadratic: 10,000 ports × 11,000 servers).
    fn read_back_all(&mut self, ports: &[&ServicePort]) -> Result<Vec<Programmed>, ReadBackError> {
        let ipvs = self.ipvs();
        let services = ipvs.services().map_err(|e| ReadBackError {
            what: "the IPVS virtual servers".into(),
            message: e.to_string(),
        })?;
        // Indices into `services`, by protocol and port.
        let mut by_port: HashMap<(Protocol, u16), Vec<usize>> = HashMap::new();
        for (i, vs) in services.iter().enumerate().filter(|(_, vs)| vs.fwmark.is_none()) {
            by_port.entry((vs.protocol, vs.port)).or_default().push(i);
        }
        let mut out = Vec::with_capacity(ports.len());
        for port in ports {
            let addresses: Vec<_> = std::iter::once(port.cluster_ip)
                .chain(port.external_ips.iter().copied())
                .chain(port.load_balancer_vips.iter().copied())
                .collect();
            let at = |p: u16| by_port.get(&(port.protocol, p)).into_iter().flatten().copied();
            let mut mine: Vec<usize> = at(port.port)
                .filter(|i| addresses.contains(&services[*i].address))
                .collect();
            if port.node_port != 0 {
                mine.extend(at(port.node_port));
            }
            // In the kernel's order, once each (a NodePort equal to the port is both).
            mine.sort_unstable();
            mine.dedup();
            let mut sections = Vec::new();
            for vs in mine.into_iter().map(|i| &services[i]) {
                let dests = ipvs.dests(vs).map_err(|e| ReadBackError {
                    what: port.name.to_string(),
                    message: e.to_string(),
                })?;
                sections.push(ProgrammedSection {
                    place: virtual_server_line(vs),
                    lines: dests.iter().map(real_server_line).collect(),
                });
            }
            out.push(Programmed { sections });
        }
        Ok(out)
    }
}

/// What IPVS mode has programmed in `family`, read back from the kernel as a ruleset the
/// tracer walks (`kube-proxy trace --live`): the virtual servers and their real servers over
/// netlink, the ipsets (`ipset save`), `kube-ipvs0`'s addresses and the filter and nat
/// tables (`iptables-save`).
pub fn live_ruleset(
    family: IpFamily,
    ipvs: &mut dyn Ipvs,
    ipt: &mut dyn Iptables,
    host: &mut dyn IpvsHost,
) -> Result<IpvsRuleset, String> {
    let mut virtual_servers = Vec::new();
    for vs in ipvs.services().map_err(|e| e.to_string())? {
        if vs.fwmark.is_some() || !family.contains(&vs.address) {
            continue;
        }
        let mut destinations: Vec<IpvsDestination> = ipvs
            .dests(&vs)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|d| IpvsDestination {
                address: d.address,
                port: d.port,
                weight: d.weight,
            })
            .collect();
        destinations.sort();
        virtual_servers.push(IpvsService {
            address: vs.address,
            protocol: vs.protocol,
            port: vs.port,
            scheduler: vs.scheduler.clone(),
            persistent: vs.persistent_timeout,
            netmask: vs.netmask,
            sched_flags: vs.flags.0 & (FLAG_SCHED1 | FLAG_SCHED2 | FLAG_SCHED3),
            destinations,
            // The kernel does not know whose it is.
            service: ServicePortName {
                namespace: String::new(),
                name: String::new(),
                port: String::new(),
                protocol: vs.protocol,
            },
            kind: VirtualServerKind::ClusterIp,
        });
    }
    virtual_servers.sort_by_key(|v| (v.protocol, v.address, v.port));
    let saved = host.ipsets().map_err(|e| e.to_string())?;
    let ipsets = IPSETS
        .iter()
        .map(|info| {
            let name = set_name(info.name, family);
            Ipset {
                id: info.id,
                entries: saved
                    .get(&name)
                    .map(|e| e.iter().cloned().collect())
                    .unwrap_or_default(),
                name,
                set_type: info.set_type,
                family,
                comment: info.comment,
            }
        })
        .collect();
    let iptables = crate::iptables::readback::live_ruleset(ipt).map_err(|e| e.to_string())?;
    let bound_addresses = host.addresses(DUMMY_DEVICE).map_err(|e| e.to_string())?;
    Ok(IpvsRuleset {
        family,
        virtual_servers,
        bound_addresses: bound_addresses.into_iter().filter(|a| family.contains(a)).collect(),
        node_port_addresses: Vec::new(),
        node_addresses_from: NodeAddressSource::Interfaces,
        ipsets,
        jumps: Vec::new(),
        restore: iptables.restore,
        sysctls: Vec::new(),
        timeouts: None,
        exclude_cidrs: Vec::new(),
        warnings: Vec::new(),
    })
}

/// `TCP  10.96.0.10:53 rr [persistent 10800]`, as `ipvsadm -Ln` heads a virtual server.
fn virtual_server_line(vs: &VirtualServer) -> String {
    let mut s = format!(
        "{:<4} {} {}",
        vs.protocol.api(),
        SocketAddr::new(vs.address, vs.port),
        vs.scheduler
    );
    if let Some(t) = vs.persistent_timeout {
        s.push_str(&format!(" persistent {t}"));
    }
    s
}

/// `-> 10.244.1.5:53 Masq weight 1 active 0 inactive 0`.
fn real_server_line(rs: &RealServer) -> String {
    format!(
        "-> {} {} weight {} active {} inactive {}",
        SocketAddr::new(rs.address, rs.port),
        rs.forward.name(),
        rs.weight,
        rs.active_conns,
        rs.inactive_conns
    )
}

/// `-> 10.244.1.5:53 Masq weight 1`: a real server as kube-proxy programs it (always NAT), the
/// start of its read-back line.
pub fn real_server_text(address: std::net::IpAddr, port: u16, weight: u32) -> String {
    format!("-> {} Masq weight {weight}", SocketAddr::new(address, port))
}
