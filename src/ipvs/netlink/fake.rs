//! A recording, in-memory IPVS table for tests of what drives IPVS (no root, no kernel).
//!
//! It refuses what the kernel refuses, with the kernel's errno: the rules below were checked
//! against a real kernel (Debian's 6.1, in the test VM: `tests/vm_ipvs_netlink.rs` runs the
//! same operations on both and compares every result). Where the kernel consults state the
//! fake does not have (routing tables, loadable modules), the fake follows a fixed rule,
//! documented on the method.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use nix::errno::Errno;

use super::Ipvs;
use super::error::{IpvsError, Op};
use super::types::{Info, RealServer, ServiceFlags, ServiceKey, Stats, Timeouts, VirtualServer};
use super::wire::{IP_VS_SVC_F_HASHED, IP_VS_SVC_F_PERSISTENT};

/// One call made on the fake, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Info,
    Services,
    AddService(VirtualServer),
    UpdateService(VirtualServer),
    DeleteService(ServiceKey),
    Dests(ServiceKey),
    AddDest(ServiceKey, RealServer),
    UpdateDest(ServiceKey, RealServer),
    DeleteDest(ServiceKey, SocketAddr),
    Flush,
    SetTimeouts(Timeouts),
    Timeouts,
}

impl Call {
    /// Whether the call changes the table (or the timeouts).
    pub fn is_mutation(&self) -> bool {
        !matches!(self, Call::Info | Call::Services | Call::Dests(_) | Call::Timeouts)
    }
}

/// The schedulers the fake knows unless told otherwise: those of a stock kernel
/// (`net/netfilter/ipvs/ip_vs_*.c`).
pub const KERNEL_SCHEDULERS: &[&str] = &[
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos",
];

/// The longest scheduler name the kernel takes.
pub const MAX_SCHEDULER_NAME: usize = 15;

/// The kernel's jiffies per second on Debian's kernels (`CONFIG_HZ=250`): timeouts are kept in
/// jiffies in an `int`, so larger ones are refused.
const HZ: u32 = 250;

#[derive(Clone, Debug)]
struct Entry {
    service: VirtualServer,
    /// Newest first, as the kernel lists them.
    dests: Vec<RealServer>,
}

/// The fake. `Default` is an empty table with the kernel's default timeouts and schedulers.
#[derive(Clone, Debug)]
pub struct FakeIpvs {
    services: BTreeMap<ServiceKey, Entry>,
    timeouts: Timeouts,
    schedulers: BTreeSet<String>,
    calls: Vec<Call>,
    fail_next: Option<Errno>,
}

impl Default for FakeIpvs {
    fn default() -> FakeIpvs {
        FakeIpvs {
            services: BTreeMap::new(),
            timeouts: Timeouts::KERNEL_DEFAULT,
            schedulers: KERNEL_SCHEDULERS.iter().map(|s| s.to_string()).collect(),
            calls: Vec::new(),
            fail_next: None,
        }
    }
}

impl FakeIpvs {
    pub fn new() -> FakeIpvs {
        FakeIpvs::default()
    }

    /// A kernel that has only these scheduler modules.
    pub fn with_schedulers(schedulers: &[&str]) -> FakeIpvs {
        FakeIpvs {
            schedulers: schedulers.iter().map(|s| s.to_string()).collect(),
            ..FakeIpvs::default()
        }
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// The calls so far, forgetting them.
    pub fn take_calls(&mut self) -> Vec<Call> {
        std::mem::take(&mut self.calls)
    }

    /// Makes the next call fail with `errno` (and change nothing), as a kernel error would.
    pub fn fail_next(&mut self, errno: Errno) {
        self.fail_next = Some(errno);
    }

    /// The table as a map, for assertions: services (without stats) and their real servers
    /// sorted by address.
    pub fn table(&self) -> BTreeMap<ServiceKey, (VirtualServer, Vec<RealServer>)> {
        self.services
            .iter()
            .map(|(k, e)| {
                let mut dests = e.dests.clone();
                dests.sort_by_key(RealServer::key);
                (*k, (e.service.clone(), dests))
            })
            .collect()
    }

    /// Sets a real server's connection counters, as traffic would (for graceful-termination
    /// tests). Returns false when there is no such real server.
    pub fn set_conns(&mut self, service: &ServiceKey, dest: SocketAddr, active: u32, inactive: u32) -> bool {
        let Some(d) = self
            .services
            .get_mut(service)
            .and_then(|e| e.dests.iter_mut().find(|d| d.key() == dest))
        else {
            return false;
        };
        d.active_conns = active;
        d.inactive_conns = inactive;
        true
    }

    fn begin(&mut self, call: Call, op: &Op) -> Result<(), IpvsError> {
        self.calls.push(call);
        match self.fail_next.take() {
            Some(errno) => Err(IpvsError::kernel(op.clone(), errno, None, None)),
            None => Ok(()),
        }
    }

    /// The service as the kernel stores it: flags without persistence/hashed bits (those are
    /// `persistent_timeout` and bookkeeping), no counters.
    fn stored(vs: &VirtualServer) -> VirtualServer {
        VirtualServer {
            flags: ServiceFlags(vs.flags.0 & !(IP_VS_SVC_F_PERSISTENT | IP_VS_SVC_F_HASHED)),
            stats: Stats::default(),
            ..vs.clone()
        }
    }

    /// What the kernel checks of a service's settings (add and update alike).
    fn check_service(&self, op: &Op, vs: &VirtualServer) -> Result<(), IpvsError> {
        // The kernel's attribute policy: at most IP_VS_SCHEDNAME_MAXLEN - 1 bytes.
        if vs.scheduler.len() > MAX_SCHEDULER_NAME {
            return Err(IpvsError::kernel(op.clone(), Errno::EINVAL, None, Some(&vs.scheduler)));
        }
        // The kernel asks for module ip_vs_NAME and gives up with ENOENT.
        if !self.schedulers.contains(&vs.scheduler) {
            return Err(IpvsError::kernel(op.clone(), Errno::ENOENT, None, Some(&vs.scheduler)));
        }
        // An IPv6 persistence netmask is a prefix length.
        if matches!(vs.address, IpAddr::V6(_)) && !(1..=128).contains(&vs.netmask) {
            return Err(IpvsError::kernel(op.clone(), Errno::EINVAL, None, None));
        }
        Ok(())
    }

    /// What the kernel checks of a real server before adding or changing it.
    fn check_dest(op: &Op, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        // NAT and direct routing need the service's family; only tunnels may cross. (Checked
        // first: before the real server's own values.)
        if rs.family() != vs.family() && rs.forward != super::types::Forward::Tunnel {
            return Err(IpvsError::kernel(op.clone(), Errno::EINVAL, None, None));
        }
        // `weight` is signed in the kernel; the lower threshold may not exceed the upper one,
        // even when the upper one is 0 ("none").
        if rs.weight > i32::MAX as u32 || rs.lower_threshold > rs.upper_threshold {
            return Err(IpvsError::kernel(op.clone(), Errno::ERANGE, None, None));
        }
        Ok(())
    }

    /// A new real server's address must be unicast in the namespace's routing table; the fake
    /// knows no routes, so it refuses what is never unicast.
    fn check_unicast(op: &Op, rs: &RealServer) -> Result<(), IpvsError> {
        let never_unicast = match rs.address {
            IpAddr::V4(a) => a.is_unspecified() || a.is_multicast() || a.is_broadcast(),
            IpAddr::V6(a) => a.is_unspecified() || a.is_multicast(),
        };
        if never_unicast {
            return Err(IpvsError::kernel(op.clone(), Errno::EINVAL, None, None));
        }
        Ok(())
    }

    fn entry(&mut self, op: &Op, key: &ServiceKey) -> Result<&mut Entry, IpvsError> {
        self.services
            .get_mut(key)
            .ok_or_else(|| IpvsError::kernel(op.clone(), Errno::ESRCH, None, None))
    }

    /// A real server as stored: counters kept from `old` (the kernel's, not the caller's).
    fn stored_dest(rs: &RealServer, old: Option<&RealServer>) -> RealServer {
        let fresh = rs.without_counters();
        match old {
            Some(o) => RealServer {
                active_conns: o.active_conns,
                inactive_conns: o.inactive_conns,
                persistent_conns: o.persistent_conns,
                stats: o.stats,
                ..fresh
            },
            None => fresh,
        }
    }
}

impl Ipvs for FakeIpvs {
    fn info(&mut self) -> Result<Info, IpvsError> {
        self.begin(Call::Info, &Op::Info)?;
        Ok(Info {
            version: 0x010201,
            conn_table_size: 4096,
        })
    }

    /// Sorted by key (the kernel's order is its hash table's).
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        self.begin(Call::Services, &Op::ListServices)?;
        Ok(self.services.values().map(|e| e.service.clone()).collect())
    }

    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let op = Op::AddService(vs.key());
        self.begin(Call::AddService(vs.clone()), &op)?;
        if self.services.contains_key(&vs.key()) {
            return Err(IpvsError::kernel(op, Errno::EEXIST, None, None));
        }
        self.check_service(&op, vs)?;
        self.services.insert(
            vs.key(),
            Entry {
                service: Self::stored(vs),
                dests: Vec::new(),
            },
        );
        Ok(())
    }

    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let op = Op::UpdateService(vs.key());
        self.begin(Call::UpdateService(vs.clone()), &op)?;
        self.entry(&op, &vs.key())?;
        self.check_service(&op, vs)?;
        let entry = self.entry(&op, &vs.key())?;
        entry.service = Self::stored(vs);
        Ok(())
    }

    fn delete_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let op = Op::DeleteService(vs.key());
        self.begin(Call::DeleteService(vs.key()), &op)?;
        self.services
            .remove(&vs.key())
            .map(drop)
            .ok_or_else(|| IpvsError::kernel(op, Errno::ESRCH, None, None))
    }

    /// Like the kernel, a service that does not exist has no real servers (no error).
    fn dests(&mut self, vs: &VirtualServer) -> Result<Vec<RealServer>, IpvsError> {
        let op = Op::ListDests(vs.key());
        self.begin(Call::Dests(vs.key()), &op)?;
        Ok(self
            .services
            .get(&vs.key())
            .map(|e| e.dests.clone())
            .unwrap_or_default())
    }

    fn add_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        let op = Op::AddDest(vs.key(), rs.key());
        self.begin(Call::AddDest(vs.key(), rs.clone()), &op)?;
        let entry = self.entry(&op, &vs.key())?;
        let service = entry.service.clone();
        Self::check_dest(&op, &service, rs)?;
        let entry = self.entry(&op, &vs.key())?;
        if entry.dests.iter().any(|d| d.key() == rs.key()) {
            return Err(IpvsError::kernel(op, Errno::EEXIST, None, None));
        }
        Self::check_unicast(&op, rs)?;
        let entry = self.entry(&op, &vs.key())?;
        entry.dests.insert(0, Self::stored_dest(rs, None));
        Ok(())
    }

    fn update_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        let op = Op::UpdateDest(vs.key(), rs.key());
        self.begin(Call::UpdateDest(vs.key(), rs.clone()), &op)?;
        let service = self.entry(&op, &vs.key())?.service.clone();
        Self::check_dest(&op, &service, rs)?;
        let entry = self.entry(&op, &vs.key())?;
        let Some(d) = entry.dests.iter_mut().find(|d| d.key() == rs.key()) else {
            return Err(IpvsError::kernel(op, Errno::ENOENT, None, None));
        };
        *d = Self::stored_dest(rs, Some(d));
        Ok(())
    }

    fn delete_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        let op = Op::DeleteDest(vs.key(), rs.key());
        self.begin(Call::DeleteDest(vs.key(), rs.key()), &op)?;
        let entry = self.entry(&op, &vs.key())?;
        let before = entry.dests.len();
        entry.dests.retain(|d| d.key() != rs.key());
        if entry.dests.len() == before {
            return Err(IpvsError::kernel(op, Errno::ENOENT, None, None));
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), IpvsError> {
        self.begin(Call::Flush, &Op::Flush)?;
        self.services.clear();
        Ok(())
    }

    /// 0 leaves a timeout unchanged; a timeout beyond `INT_MAX` jiffies is refused.
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        let op = Op::SetTimeouts(*t);
        self.begin(Call::SetTimeouts(*t), &op)?;
        let limit = i32::MAX as u32 / HZ;
        if [t.tcp, t.tcp_fin, t.udp].iter().any(|&v| v > limit) {
            return Err(IpvsError::kernel(op, Errno::EINVAL, None, None));
        }
        let keep = |new: u32, old: u32| if new == 0 { old } else { new };
        self.timeouts = Timeouts {
            tcp: keep(t.tcp, self.timeouts.tcp),
            tcp_fin: keep(t.tcp_fin, self.timeouts.tcp_fin),
            udp: keep(t.udp, self.timeouts.udp),
        };
        Ok(())
    }

    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        self.begin(Call::Timeouts, &Op::GetTimeouts)?;
        Ok(self.timeouts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn vs(addr: &str, port: u16, sched: &str) -> VirtualServer {
        VirtualServer::new(addr.parse().expect("ip"), Protocol::Tcp, port, sched)
    }

    fn rs(addr: &str, port: u16, weight: u32) -> RealServer {
        RealServer::new(addr.parse().expect("ip"), port, weight)
    }

    #[test]
    fn refuses_what_the_kernel_refuses() {
        let mut f = FakeIpvs::new();
        let s = vs("10.0.0.1", 80, "rr");
        f.add_service(&s).expect("add");
        let e = f.add_service(&s).expect_err("duplicate");
        assert_eq!(e.errno(), Some(Errno::EEXIST));
        let missing = vs("10.0.0.9", 80, "rr");
        for e in [
            f.update_service(&missing).expect_err("update missing"),
            f.delete_service(&missing).expect_err("delete missing"),
            f.add_dest(&missing, &rs("10.1.0.1", 80, 1))
                .expect_err("dest of missing"),
        ] {
            assert_eq!(e.errno(), Some(Errno::ESRCH), "{e}");
        }
        let e = f.add_service(&vs("10.0.0.2", 80, "nosuch")).expect_err("scheduler");
        assert_eq!(e.errno(), Some(Errno::ENOENT));
        assert!(e.to_string().contains("modprobe ip_vs_nosuch"), "{e}");

        f.add_dest(&s, &rs("10.1.0.1", 8080, 1)).expect("add dest");
        let e = f.add_dest(&s, &rs("10.1.0.1", 8080, 3)).expect_err("duplicate dest");
        assert_eq!(e.errno(), Some(Errno::EEXIST));
        let e = f.delete_dest(&s, &rs("10.1.0.2", 8080, 1)).expect_err("missing dest");
        assert_eq!(e.errno(), Some(Errno::ENOENT));
        let e = f.add_dest(&s, &rs("fd00::1", 8080, 1)).expect_err("family");
        assert_eq!(e.errno(), Some(Errno::EINVAL));

        // Nothing of the refused calls changed the table; every call is recorded.
        assert_eq!(f.table().len(), 1);
        assert_eq!(f.calls().iter().filter(|c| c.is_mutation()).count(), f.calls().len());
        assert_eq!(f.calls().len(), 10);
    }

    #[test]
    fn updates_keep_counters_and_timeouts_keep_zeroes() {
        let mut f = FakeIpvs::new();
        let s = vs("10.0.0.1", 80, "rr");
        f.add_service(&s).expect("add");
        f.add_dest(&s, &rs("10.1.0.1", 8080, 1)).expect("add dest");
        assert!(f.set_conns(&s.key(), "10.1.0.1:8080".parse().expect("addr"), 2, 5));
        f.update_dest(&s, &rs("10.1.0.1", 8080, 0)).expect("weight 0");
        let d = &f.dests(&s).expect("dests")[0];
        assert_eq!((d.weight, d.active_conns, d.inactive_conns), (0, 2, 5));

        f.set_timeouts(&Timeouts {
            tcp: 0,
            tcp_fin: 30,
            udp: 0,
        })
        .expect("set");
        assert_eq!(
            f.timeouts().expect("get"),
            Timeouts {
                tcp: 900,
                tcp_fin: 30,
                udp: 300
            }
        );
        f.fail_next(Errno::ENOMEM);
        assert_eq!(f.flush().expect_err("injected").errno(), Some(Errno::ENOMEM));
        assert_eq!(f.services().expect("list").len(), 1);
    }
}
