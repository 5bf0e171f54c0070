//! The IPVS table in the words `ipvsadm` uses: virtual servers (services), their real servers
//! (destinations), the connection timeouts and the module's info. Plain values; what they look
//! like on the wire is `message`'s business.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::model::{IpFamily, Protocol};

/// Scheduler flags of a virtual server (`IP_VS_SVC_F_*` other than persistence, which is
/// [`VirtualServer::persistent_timeout`], and the kernel's own "hashed" bookkeeping bit).
/// `ipvsadm -b` names them per scheduler: `sh-fallback`/`mh-fallback` is [`ServiceFlags::SCHED1`],
/// `sh-port`/`mh-port` is [`ServiceFlags::SCHED2`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceFlags(pub u32);

impl ServiceFlags {
    pub const NONE: ServiceFlags = ServiceFlags(0);
    /// `IP_VS_SVC_F_ONEPACKET`: schedule every UDP datagram on its own (`ipvsadm -o`).
    pub const ONE_PACKET: ServiceFlags = ServiceFlags(0x4);
    /// `IP_VS_SVC_F_SCHED1`.
    pub const SCHED1: ServiceFlags = ServiceFlags(0x8);
    /// `IP_VS_SVC_F_SCHED2`.
    pub const SCHED2: ServiceFlags = ServiceFlags(0x10);
    /// `IP_VS_SVC_F_SCHED3`.
    pub const SCHED3: ServiceFlags = ServiceFlags(0x20);
    /// `sh`: when the hashed real server is unavailable (weight 0, overloaded), pick another
    /// instead of dropping.
    pub const SH_FALLBACK: ServiceFlags = ServiceFlags::SCHED1;
    /// `sh`: hash the source port too, not only the source address.
    pub const SH_PORT: ServiceFlags = ServiceFlags::SCHED2;
    pub const MH_FALLBACK: ServiceFlags = ServiceFlags::SCHED1;
    pub const MH_PORT: ServiceFlags = ServiceFlags::SCHED2;

    pub fn contains(self, other: ServiceFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for ServiceFlags {
    type Output = ServiceFlags;
    fn bitor(self, rhs: ServiceFlags) -> ServiceFlags {
        ServiceFlags(self.0 | rhs.0)
    }
}

/// What identifies a virtual server in the kernel: address family, protocol, address and port
/// — or, for a firewall-mark service, family and mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServiceKey {
    Addr {
        protocol: Protocol,
        address: IpAddr,
        port: u16,
    },
    Fwmark {
        family: IpFamily,
        mark: u32,
    },
}

impl fmt::Display for ServiceKey {
    /// As `ipvsadm -Ln` prints it: `TCP 10.0.0.1:80`, `UDP [fd00::1]:53`, `FWM 7`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceKey::Addr {
                protocol,
                address,
                port,
            } => write!(f, "{protocol} {}", SocketAddr::new(*address, *port)),
            ServiceKey::Fwmark {
                family: IpFamily::V4,
                mark,
            } => write!(f, "FWM {mark}"),
            ServiceKey::Fwmark {
                family: IpFamily::V6,
                mark,
            } => write!(f, "FWM {mark} IPv6"),
        }
    }
}

/// Counters and rates the kernel keeps for a virtual or real server (decoded from dumps, never
/// sent). Rates are per second, averaged by the kernel's 2-second estimator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stats {
    pub connections: u64,
    pub in_packets: u64,
    pub out_packets: u64,
    pub in_bytes: u64,
    pub out_bytes: u64,
    pub cps: u64,
    pub in_pps: u64,
    pub out_pps: u64,
    pub in_bps: u64,
    pub out_bps: u64,
}

/// A virtual server (IPVS service): `ipvsadm -A -t ADDRESS:PORT -s SCHEDULER [-p TIMEOUT]`.
///
/// `stats` is filled in by dumps and ignored when sending.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VirtualServer {
    /// The virtual address; its family is the service's. For a firewall-mark service, the
    /// unspecified address of its family.
    pub address: IpAddr,
    /// For a firewall-mark service the kernel records TCP.
    pub protocol: Protocol,
    pub port: u16,
    /// A firewall-mark service (`ipvsadm -f MARK`) matches packets by mark instead of
    /// protocol, address and port. kube-proxy makes none; dumps can hold them.
    pub fwmark: Option<u32>,
    /// The scheduler's name (`rr`, `wrr`, `lc`, `wlc`, `sh`, `dh`, `sed`, `nq`, `mh`, ...): the
    /// kernel loads module `ip_vs_NAME` for it. At most 15 bytes.
    pub scheduler: String,
    /// Persistence (`ipvsadm -p SECONDS`): connections from one client (within `netmask`) go
    /// to the same real server while a template of that age lives. kube-proxy uses this for
    /// `sessionAffinity: ClientIP` with `timeoutSeconds`.
    pub persistent_timeout: Option<u32>,
    pub flags: ServiceFlags,
    /// Persistence granularity (`ipvsadm -M`), as the kernel keeps it: for IPv4 a mask
    /// (`u32::from(Ipv4Addr)`, so `0xffff_ffff` is a /32), for IPv6 a prefix length (1 to 128).
    pub netmask: u32,
    pub stats: Stats,
}

impl VirtualServer {
    /// A service on `address:port` without persistence or flags, with the host netmask.
    pub fn new(address: IpAddr, protocol: Protocol, port: u16, scheduler: &str) -> VirtualServer {
        VirtualServer {
            address,
            protocol,
            port,
            fwmark: None,
            scheduler: scheduler.to_string(),
            persistent_timeout: None,
            flags: ServiceFlags::NONE,
            netmask: host_netmask(IpFamily::of(&address)),
            stats: Stats::default(),
        }
    }

    /// A firewall-mark service of `family`.
    pub fn fwmark(family: IpFamily, mark: u32, scheduler: &str) -> VirtualServer {
        let address = match family {
            IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        VirtualServer {
            fwmark: Some(mark),
            port: 0,
            protocol: Protocol::Tcp,
            ..VirtualServer::new(address, Protocol::Tcp, 0, scheduler)
        }
    }

    pub fn with_persistence(mut self, timeout: u32) -> VirtualServer {
        self.persistent_timeout = Some(timeout);
        self
    }

    pub fn with_flags(mut self, flags: ServiceFlags) -> VirtualServer {
        self.flags = flags;
        self
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.address)
    }

    pub fn key(&self) -> ServiceKey {
        match self.fwmark {
            Some(mark) => ServiceKey::Fwmark {
                family: self.family(),
                mark,
            },
            None => ServiceKey::Addr {
                protocol: self.protocol,
                address: self.address,
                port: self.port,
            },
        }
    }

    /// The same service with the kernel's counters cleared: what to compare a dump with.
    pub fn without_stats(&self) -> VirtualServer {
        VirtualServer {
            stats: Stats::default(),
            ..self.clone()
        }
    }
}

impl fmt::Display for VirtualServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.key().fmt(f)
    }
}

/// The netmask that makes persistence per client address.
pub fn host_netmask(family: IpFamily) -> u32 {
    match family {
        IpFamily::V4 => u32::MAX,
        IpFamily::V6 => 128,
    }
}

/// How IPVS forwards to a real server (`IP_VS_CONN_F_FWD_MASK` values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Forward {
    /// NAT (`ipvsadm -m`, "Masq"): what kube-proxy uses.
    #[default]
    Masq,
    /// The real server is this host ("Local").
    Local,
    /// IP-in-IP (`-i`, "Tunnel"); tunnel options are not modelled (IPIP, no checksum).
    Tunnel,
    /// Direct routing (`-g`, "Route").
    DirectRoute,
    /// A value this module does not know (the kernel keeps 3 bits).
    Other(u32),
}

impl Forward {
    pub fn to_raw(self) -> u32 {
        match self {
            Forward::Masq => 0,
            Forward::Local => 1,
            Forward::Tunnel => 2,
            Forward::DirectRoute => 3,
            Forward::Other(v) => v,
        }
    }

    pub fn from_raw(v: u32) -> Forward {
        match v {
            0 => Forward::Masq,
            1 => Forward::Local,
            2 => Forward::Tunnel,
            3 => Forward::DirectRoute,
            v => Forward::Other(v),
        }
    }

    /// `ipvsadm -Ln`'s column.
    pub fn name(self) -> &'static str {
        match self {
            Forward::Masq => "Masq",
            Forward::Local => "Local",
            Forward::Tunnel => "Tunnel",
            Forward::DirectRoute => "Route",
            Forward::Other(_) => "Unknown",
        }
    }
}

/// A real server (IPVS destination) of a virtual server: `ipvsadm -a ... -r ADDRESS:PORT -m -w
/// WEIGHT`.
///
/// `active_conns`, `inactive_conns`, `persistent_conns` and `stats` are filled in by dumps and
/// ignored when sending.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RealServer {
    pub address: IpAddr,
    pub port: u16,
    /// 0 stops new connections (kube-proxy's graceful termination) and keeps existing ones.
    /// At most `i32::MAX` (the kernel's type).
    pub weight: u32,
    pub forward: Forward,
    /// Connection thresholds (`-x`, `-y`); 0 means none. The lower must not exceed the upper.
    pub upper_threshold: u32,
    pub lower_threshold: u32,
    /// Connections in ESTABLISHED (TCP) state.
    pub active_conns: u32,
    /// Connections in any other state (TIME_WAIT, FIN_WAIT, UDP, ...).
    pub inactive_conns: u32,
    /// Persistence templates pointing at this server.
    pub persistent_conns: u32,
    pub stats: Stats,
}

impl RealServer {
    /// A NAT ("Masq") real server, as kube-proxy makes them.
    pub fn new(address: IpAddr, port: u16, weight: u32) -> RealServer {
        RealServer {
            address,
            port,
            weight,
            forward: Forward::Masq,
            upper_threshold: 0,
            lower_threshold: 0,
            active_conns: 0,
            inactive_conns: 0,
            persistent_conns: 0,
            stats: Stats::default(),
        }
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.address)
    }

    pub fn key(&self) -> SocketAddr {
        SocketAddr::new(self.address, self.port)
    }

    /// The same real server with the kernel's counters cleared: what to compare a dump with.
    pub fn without_counters(&self) -> RealServer {
        RealServer {
            active_conns: 0,
            inactive_conns: 0,
            persistent_conns: 0,
            stats: Stats::default(),
            ..self.clone()
        }
    }
}

impl fmt::Display for RealServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.key().fmt(f)
    }
}

/// IPVS connection timeouts in seconds (`ipvsadm --set TCP TCPFIN UDP`): how long an idle
/// established TCP connection, a TCP connection after its FIN, and a UDP "connection" stay in
/// the IPVS table. When setting, 0 leaves that timeout as it is (the kernel's rule; it is also
/// what kube-proxy's `--ipvs-tcp-timeout=0` etc. mean).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Timeouts {
    pub tcp: u32,
    pub tcp_fin: u32,
    pub udp: u32,
}

impl Timeouts {
    /// A fresh network namespace's values (15 min, 2 min, 5 min).
    pub const KERNEL_DEFAULT: Timeouts = Timeouts {
        tcp: 900,
        tcp_fin: 120,
        udp: 300,
    };
}

impl fmt::Display for Timeouts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tcp {} s, tcpfin {} s, udp {} s", self.tcp, self.tcp_fin, self.udp)
    }
}

/// What `GET_INFO` says about the IPVS module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Info {
    /// `0x010201` is version 1.2.1 (every kernel since 2.6 says so).
    pub version: u32,
    /// Buckets of the connection hash table (`ip_vs conn_tab_bits`; 4096 by default).
    pub conn_table_size: u32,
}

impl Info {
    /// `1.2.1`.
    pub fn version_string(&self) -> String {
        format!(
            "{}.{}.{}",
            (self.version >> 16) & 0xff,
            (self.version >> 8) & 0xff,
            self.version & 0xff
        )
    }
}
