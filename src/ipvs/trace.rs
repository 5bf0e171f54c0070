//! `kube-proxy trace --proxy-mode=ipvs`: follows one new packet through what the IPVS renderer
//! produced ([`IpvsRuleset`]) and reports it in the same [`Trace`] form as the iptables and
//! nftables tracers, so that the modes can be compared.
//!
//! This module owns the two things IPVS mode adds to the iptables tracer's walk:
//!
//! - the ipsets, read back from the `ipset restore` input ([`Ipsets`]), which answer the
//!   `-m set --match-set` matches of the IPVS-mode rules with ipset's semantics for each set
//!   type (`hash:ip`, `hash:net`, `hash:ip,port`, `hash:ip,port,ip`, `hash:ip,port,net`,
//!   `bitmap:port`) and family;
//! - the IPVS step and the hook order around it. Service addresses are bound to `kube-ipvs0`
//!   (and NodePorts sit on node addresses), so routing delivers the packet locally; IPVS
//!   hooks LOCAL_IN after filter INPUT (priority NF_IP_PRI_NAT_SRC - 1) and LOCAL_OUT after
//!   nat OUTPUT (NF_IP_PRI_NAT_DST + 2). It looks the virtual server up by protocol, address
//!   and port. With real servers it NATs to one of them (every one with a weight above 0 is
//!   a path) and sends the packet out through LOCAL_OUT again, so filter OUTPUT and nat
//!   POSTROUTING see it. A virtual server with no real server to schedule makes the kernel
//!   answer ICMP port unreachable (`ip_vs_leave`; a client sees "connection refused", as our
//!   VM test measures): a REJECT. Without a virtual server the packet is simply delivered
//!   locally, after filter INPUT (where KUBE-IPVS-FILTER rejects new connections to
//!   kube-ipvs0 addresses on ports that are no service).
//!
//! A packet from the node takes nat OUTPUT, IPVS (LOCAL_OUT), filter OUTPUT and nat
//! POSTROUTING, and comes back in through `lo` to filter INPUT when it is still for the node;
//! a packet from elsewhere takes nat PREROUTING, then filter INPUT and IPVS (LOCAL_IN) for a
//! local destination or filter FORWARD and nat POSTROUTING for any other.
//!
//! The iptables rules themselves are parsed, matched and walked by the iptables tracer.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::render::{IpvsDestination, IpvsRuleset, IpvsService};
// IPVS mode programs iptables rules around IPVS: they are loaded and walked by the iptables tracer.
use crate::iptables::Ruleset;
use crate::iptables::trace::parse::load;
use crate::iptables::trace::walk::{Hook, ModeState, PathState, Step, Tracer, VirtualService, finish};
use crate::model::{IpFamily, Protocol};
use crate::trace::walk::{AfterHook, AfterStage, HookOrder};
use crate::trace::{Packet, SetDim, SetLookup, SetValue, Trace, TraceContext, TraceError, Verdict, check_family};

/// Follows `packet` through `rs` and reports every path it can take.
pub fn trace(rs: &IpvsRuleset, ctx: &TraceContext, packet: &Packet) -> Result<Trace, TraceError> {
    check_family(rs.family, packet)?;
    let sets = Ipsets::parse(&rs.ipset_restore())?;
    let rules = Ruleset {
        family: rs.family,
        jumps: rs.jumps.clone(),
        restore: rs.restore.clone(),
    };
    let tables = load(&rules, &sets)?;
    // kube-ipvs0's addresses are the node's too: that is how IPVS gets to see their packets.
    let mut local = ctx.clone();
    for a in &rs.bound_addresses {
        if !local.local_addresses.contains(a) {
            local.local_addresses.push(*a);
        }
    }
    let from_node = local.is_local(&packet.src);
    let mut walk = Walk {
        tracer: Tracer::new(&tables, &sets, &local),
        rs,
        from_node,
    };
    let first = if from_node {
        Stage::Hook(Hook::NatOutput)
    } else {
        Stage::Hook(Hook::NatPrerouting)
    };
    let mut finished = Vec::new();
    let start = PathState::start(packet, from_node, ModeState::default());
    walk.walk(first, start, &mut finished)?;
    Ok(finish(&tables, finished, from_node))
}

// ---------------------------------------------------------------------------------------------
// The walk

/// Where IPVS hooks in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IpvsHook {
    /// Packets from elsewhere to a local address, after filter INPUT.
    LocalIn,
    /// Packets from the node, after nat OUTPUT.
    LocalOut,
}

impl IpvsHook {
    fn chain(self) -> &'static str {
        match self {
            IpvsHook::LocalIn => "LOCAL_IN",
            IpvsHook::LocalOut => "LOCAL_OUT",
        }
    }

    fn label(self) -> &'static str {
        match self {
            IpvsHook::LocalIn => "ipvs/LOCAL_IN",
            IpvsHook::LocalOut => "ipvs/LOCAL_OUT",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Hook(Hook),
    Ipvs(IpvsHook),
}

/// The name the report gives IPVS's steps (as if it were a table).
const IPVS_TABLE: &str = "ipvs";

struct Walk<'a> {
    tracer: Tracer<'a>,
    rs: &'a IpvsRuleset,
    from_node: bool,
}

impl HookOrder<'static, Step, ModeState> for Walk<'_> {
    type Stage = Stage;

    fn run_stage(&mut self, stage: Stage, st: PathState) -> Result<AfterStage<'static, Step, ModeState>, TraceError> {
        match stage {
            Stage::Hook(hook) => self.tracer.run_hook(hook, st),
            Stage::Ipvs(hook) => self.ipvs(hook, st),
        }
    }

    /// The stage after `stage`, or `None` when the packet is delivered or sent.
    fn next_stage(&self, stage: Stage, st: &mut PathState) -> Option<Stage> {
        let local_dst = self.tracer.is_local(&st.dst);
        let next = match stage {
            Stage::Hook(Hook::NatOutput) => Some(Stage::Ipvs(IpvsHook::LocalOut)),
            // Scheduled or not, the packet goes on through LOCAL_OUT.
            Stage::Ipvs(IpvsHook::LocalOut) => Some(Stage::Hook(Hook::FilterOutput)),
            Stage::Hook(Hook::FilterOutput) | Stage::Hook(Hook::FilterForward) => {
                Some(Stage::Hook(Hook::NatPostrouting))
            }
            Stage::Hook(Hook::NatPostrouting) if self.from_node && local_dst => Some(Stage::Hook(Hook::FilterInput)),
            Stage::Hook(Hook::NatPostrouting) => None,
            Stage::Hook(Hook::NatPrerouting) if local_dst => Some(Stage::Hook(Hook::FilterInput)),
            Stage::Hook(Hook::NatPrerouting) => Some(Stage::Hook(Hook::FilterForward)),
            // The node's own packets met IPVS on the way out already.
            Stage::Hook(Hook::FilterInput) if self.from_node => None,
            Stage::Hook(Hook::FilterInput) => Some(Stage::Ipvs(IpvsHook::LocalIn)),
            // IPVS NATs to a real server elsewhere by sending the packet out through LOCAL_OUT
            // (ip_vs_nat_send_or_cont); one on the node itself gets it delivered here, as
            // does a packet for no virtual server.
            Stage::Ipvs(IpvsHook::LocalIn) if st.mode.ipvs.is_some() && !local_dst => {
                Some(Stage::Hook(Hook::FilterOutput))
            }
            Stage::Ipvs(IpvsHook::LocalIn) => None,
        };
        if next == Some(Stage::Hook(Hook::FilterInput)) && self.from_node {
            st.loop_back();
        }
        next
    }
}

impl Walk<'_> {
    /// IPVS's lookup and scheduling: the packet as it goes on, once per real server it can
    /// be sent to; stopped (REJECT) when its virtual server has none.
    fn ipvs(&mut self, hook: IpvsHook, mut st: PathState) -> Result<AfterStage<'static, Step, ModeState>, TraceError> {
        st.hooks.push(hook.label());
        let rs = self.rs;
        let Some(vs) = rs.virtual_server(st.protocol, st.dst, st.dport) else {
            return Ok(vec![AfterHook::GoesOn(st)]);
        };
        // The schedulers skip real servers of weight 0 (draining ones).
        let eligible: Vec<&IpvsDestination> = vs.destinations.iter().filter(|d| d.weight > 0).collect();
        if eligible.is_empty() {
            let what = if vs.destinations.is_empty() {
                "no real servers"
            } else {
                "no real server with a weight above 0"
            };
            st.rules.push(step(
                hook,
                format!(
                    "{}: {what}, the kernel answers ICMP port unreachable",
                    vs.ipvsadm_line()
                ),
            ));
            st.verdict = Verdict::Reject;
            return Ok(vec![AfterHook::Stopped(st)]);
        }
        let virtual_service = VirtualService {
            protocol: vs.protocol,
            addr: vs.address,
            port: vs.port,
        };
        let mut out = Vec::new();
        for (i, d) in eligible.iter().enumerate() {
            if i > 0 {
                self.tracer.fork()?;
            }
            let dest = SocketAddr::new(d.address, d.port);
            let mut s = st.clone();
            s.rules
                .push(step(hook, format!("{} -> {dest} Masq {}", vs.ipvsadm_line(), d.weight)));
            if eligible.len() > 1 {
                s.choices.push(schedule_choice(vs, &dest, eligible.len()));
            }
            s.dnat_to(dest);
            s.mode.ipvs = Some(virtual_service);
            out.push(AfterHook::GoesOn(s));
        }
        Ok(out)
    }
}

fn step(hook: IpvsHook, text: String) -> Step {
    Step::Other {
        table: IPVS_TABLE,
        chain: hook.chain(),
        text,
    }
}

/// Why a path went to `dest`: which scheduler chose among how many, and what persistence does.
fn schedule_choice(vs: &IpvsService, dest: &SocketAddr, of: usize) -> String {
    let vip = SocketAddr::new(vs.address, vs.port);
    let persistence = match vs.persistent {
        Some(timeout) => {
            format!(", persistent {timeout} s: a client's new connections stay on the real server of its first")
        }
        None => String::new(),
    };
    format!(
        "ipvs {} {vip} ({}{persistence}): real server {dest}, one of {of} it schedules",
        vs.protocol, vs.scheduler
    )
}

// ---------------------------------------------------------------------------------------------
// ipsets

/// The ipsets that an `ipset restore` input creates, by name, matched as the kernel does.
#[derive(Debug, Default)]
pub struct Ipsets {
    sets: HashMap<String, Set>,
}

#[derive(Debug)]
struct Set {
    kind: SetKind,
    options: CreateOptions,
    /// One entry per `add`, a part per dimension.
    members: Vec<Vec<Part>>,
}

/// What a `create` line says besides the name and type.
#[derive(Debug)]
struct CreateOptions {
    /// Hash sets hold one family (inet unless told); bitmap sets have none.
    family: Option<IpFamily>,
    /// The ports a bitmap set can hold.
    range: Option<(u16, u16)>,
}

/// One part of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// An address is stored as a host network.
    Net(IpNet),
    /// `None` protocol: bitmap:port, which stores bare ports and matches any protocol's.
    Ports {
        protocol: Option<Protocol>,
        lo: u16,
        hi: u16,
    },
}

/// How each dimension of an entry is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Syntax {
    /// An address (a CIDR adds every address in it).
    Ip,
    /// A network; a bare address is a host network.
    Net,
    /// `[proto:]port[-port]` (the protocol defaults to tcp).
    ProtoPort,
    /// `port[-port]`.
    Port,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SetKind {
    HashIp,
    HashNet,
    HashIpPort,
    HashIpPortIp,
    HashIpPortNet,
    BitmapPort,
}

impl SetKind {
    fn parse(name: &str) -> Option<SetKind> {
        Some(match name {
            "hash:ip" => SetKind::HashIp,
            "hash:net" => SetKind::HashNet,
            "hash:ip,port" => SetKind::HashIpPort,
            "hash:ip,port,ip" => SetKind::HashIpPortIp,
            "hash:ip,port,net" => SetKind::HashIpPortNet,
            "bitmap:port" => SetKind::BitmapPort,
            _ => return None,
        })
    }

    fn syntax(self) -> &'static [Syntax] {
        match self {
            SetKind::HashIp => &[Syntax::Ip],
            SetKind::HashNet => &[Syntax::Net],
            SetKind::HashIpPort => &[Syntax::Ip, Syntax::ProtoPort],
            SetKind::HashIpPortIp => &[Syntax::Ip, Syntax::ProtoPort, Syntax::Ip],
            SetKind::HashIpPortNet => &[Syntax::Ip, Syntax::ProtoPort, Syntax::Net],
            SetKind::BitmapPort => &[Syntax::Port],
        }
    }

    fn dimensions(self) -> &'static [SetDim] {
        match self {
            SetKind::HashIp | SetKind::HashNet => &[SetDim::Addr],
            SetKind::HashIpPort => &[SetDim::Addr, SetDim::Port],
            SetKind::HashIpPortIp | SetKind::HashIpPortNet => &[SetDim::Addr, SetDim::Port, SetDim::Addr],
            SetKind::BitmapPort => &[SetDim::Port],
        }
    }
}

impl Ipsets {
    /// Reads `create NAME TYPE [OPTIONS]` and `add NAME ENTRY` lines, as `ipset save` writes
    /// them and `ipset restore` reads them; anything else (other commands, set options or
    /// entry flags such as `nomatch`) is an error, as is what ipset itself would refuse (a
    /// set created twice, an entry of the wrong family, a port outside a bitmap's range).
    pub fn parse(input: &str) -> Result<Ipsets, TraceError> {
        let mut sets: HashMap<String, Set> = HashMap::new();
        for (i, raw) in input.lines().enumerate() {
            let text = raw.trim();
            let err = |reason: String| TraceError::Ipset {
                line: i + 1,
                text: text.to_string(),
                reason,
            };
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let words: Vec<&str> = text.split_whitespace().collect();
            match words.as_slice() {
                ["create", name, kind, options @ ..] => {
                    let kind = SetKind::parse(kind).ok_or_else(|| err(format!("set type {kind} is not traced")))?;
                    if sets.contains_key(*name) {
                        return Err(err(format!("set {name} is created twice")));
                    }
                    let options = create_options(kind, options).map_err(err)?;
                    sets.insert(
                        name.to_string(),
                        Set {
                            kind,
                            options,
                            members: Vec::new(),
                        },
                    );
                }
                ["add", name, entry] => {
                    let set = sets
                        .get_mut(*name)
                        .ok_or_else(|| err(format!("set {name} is added to before it is created")))?;
                    let member = parse_entry(set.kind, set.options.family, entry).map_err(err)?;
                    if let Some((lo, hi)) = set.options.range {
                        for p in &member {
                            if let Part::Ports { lo: a, hi: b, .. } = p
                                && (*a < lo || *b > hi)
                            {
                                return Err(err(format!("port outside the set's range {lo}-{hi}")));
                            }
                        }
                    }
                    set.members.push(member);
                }
                ["add", _, _, _, ..] => return Err(err("entry options are not traced".to_string())),
                ["add", ..] => return Err(err("add needs a set and an entry".to_string())),
                ["create", ..] => return Err(err("create needs a set name and a type".to_string())),
                _ => return Err(err("only create and add lines are traced".to_string())),
            }
        }
        Ok(Ipsets { sets })
    }
}

/// The options of a `create` line: `family`, `hashsize` and `maxelem` for hash sets, `range`
/// for bitmap sets.
fn create_options(kind: SetKind, options: &[&str]) -> Result<CreateOptions, String> {
    let bitmap = kind == SetKind::BitmapPort;
    let mut family = (!bitmap).then_some(IpFamily::V4);
    let mut range = None;
    let mut it = options.iter();
    while let Some(&opt) = it.next() {
        let value = it.next().ok_or_else(|| format!("{opt} needs a value"))?;
        match opt {
            "family" if !bitmap => {
                family = Some(match *value {
                    "inet" => IpFamily::V4,
                    "inet6" => IpFamily::V6,
                    _ => return Err(format!("bad family {value}")),
                });
            }
            "hashsize" | "maxelem" if !bitmap => {
                value.parse::<u32>().map_err(|_| format!("bad {opt} {value}"))?;
            }
            "range" if bitmap => range = Some(port_range(value)?),
            _ => return Err(format!("option {opt} is not traced for {}", kind_name(kind))),
        }
    }
    if bitmap && range.is_none() {
        return Err("bitmap:port needs a range".to_string());
    }
    Ok(CreateOptions { family, range })
}

fn kind_name(kind: SetKind) -> &'static str {
    match kind {
        SetKind::HashIp => "hash:ip",
        SetKind::HashNet => "hash:net",
        SetKind::HashIpPort => "hash:ip,port",
        SetKind::HashIpPortIp => "hash:ip,port,ip",
        SetKind::HashIpPortNet => "hash:ip,port,net",
        SetKind::BitmapPort => "bitmap:port",
    }
}

/// One entry (`10.96.0.1,tcp:443`, `8080`, ...) of a set of `kind`.
fn parse_entry(kind: SetKind, family: Option<IpFamily>, entry: &str) -> Result<Vec<Part>, String> {
    let fields: Vec<&str> = entry.split(',').collect();
    let syntax = kind.syntax();
    if fields.len() != syntax.len() {
        return Err(format!("a {} entry has {} parts", kind_name(kind), syntax.len()));
    }
    let mut parts = Vec::new();
    for (field, syntax) in fields.iter().zip(syntax) {
        parts.push(match syntax {
            Syntax::Ip | Syntax::Net => {
                let net = match field.parse::<IpNet>() {
                    Ok(net) => net.trunc(),
                    Err(_) => IpNet::from(field.parse::<IpAddr>().map_err(|_| format!("bad address {field}"))?),
                };
                if family.is_some_and(|f| !f.contains(&net.addr())) {
                    return Err(format!("{field} is not of the set's family"));
                }
                Part::Net(net)
            }
            Syntax::ProtoPort => {
                let (protocol, ports) = match field.split_once(':') {
                    Some((name, ports)) => (
                        match name.to_ascii_lowercase().as_str() {
                            "tcp" => Protocol::Tcp,
                            "udp" => Protocol::Udp,
                            "sctp" => Protocol::Sctp,
                            _ => return Err(format!("protocol {name} is not traced")),
                        },
                        ports,
                    ),
                    None => (Protocol::Tcp, *field),
                };
                let (lo, hi) = port_range(ports)?;
                Part::Ports {
                    protocol: Some(protocol),
                    lo,
                    hi,
                }
            }
            Syntax::Port => {
                let (lo, hi) = port_range(field)?;
                Part::Ports { protocol: None, lo, hi }
            }
        });
    }
    Ok(parts)
}

/// `port` or `lo-hi`.
fn port_range(s: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| p.parse::<u16>().map_err(|_| format!("bad port {p}"));
    let (lo, hi) = match s.split_once('-') {
        Some((lo, hi)) => (port(lo)?, port(hi)?),
        None => (port(s)?, port(s)?),
    };
    if lo > hi {
        return Err(format!("bad port range {s}"));
    }
    Ok((lo, hi))
}

impl SetLookup for Ipsets {
    fn dimensions(&self, name: &str) -> Option<&'static [SetDim]> {
        self.sets.get(name).map(|s| s.kind.dimensions())
    }

    fn contains(&self, name: &str, key: &[SetValue]) -> bool {
        let Some(set) = self.sets.get(name) else {
            return false;
        };
        // A hash set of the other family never matches (the set match checks the family).
        let other_family = key
            .iter()
            .any(|v| matches!((v, set.options.family), (SetValue::Addr(a), Some(f)) if !f.contains(a)));
        if other_family {
            return false;
        }
        set.members.iter().any(|member| {
            member.iter().zip(key).all(|(part, value)| match (part, value) {
                (Part::Net(net), SetValue::Addr(a)) => net.contains(a),
                (Part::Ports { protocol, lo, hi }, SetValue::Port(p, port)) => {
                    protocol.is_none_or(|want| want == *p) && (*lo..=*hi).contains(port)
                }
                _ => false,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LocalDetector;
    use crate::ipvs::render::{IpvsRenderOptions, render};
    use crate::model::{Endpoint, NodeInfo, ProxyState, ServicePort, ServicePortName, ServicePortState};
    use crate::proxy::RenderOptions;
    use crate::trace::render_text;

    const NODE_IP: &str = "192.168.0.2";

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    // === ipsets ===

    const SETS: &str = "\
create CIP hash:ip,port family inet hashsize 1024 maxelem 65536
add CIP 10.96.0.1,tcp:443
add CIP 10.96.0.10,udp:53
create LOOP hash:ip,port,ip family inet hashsize 1024 maxelem 65536
add LOOP 10.244.1.5,tcp:8080,10.244.1.5
create CIDR hash:ip,port,net family inet hashsize 1024 maxelem 65536
add CIDR 203.0.113.10,tcp:80,192.168.0.0/16
create NP bitmap:port range 0-65535
add NP 30000-30010
add NP 32517
create IPS hash:ip family inet hashsize 1024 maxelem 65536
add IPS 10.96.0.1
create NETS hash:net family inet6 hashsize 1024 maxelem 65536
add NETS fd00:10::/64
create SIX hash:ip,port family inet6 hashsize 1024 maxelem 65536
add SIX fd00::1,sctp:3868
";

    fn has(sets: &Ipsets, name: &str, key: &[SetValue]) -> bool {
        sets.contains(name, key)
    }

    fn a(s: &str) -> SetValue {
        SetValue::Addr(ip(s))
    }

    fn tcp(p: u16) -> SetValue {
        SetValue::Port(Protocol::Tcp, p)
    }

    #[test]
    fn set_types_match_as_ipset_does() {
        let sets = Ipsets::parse(SETS).unwrap();
        assert_eq!(sets.dimensions("CIP"), Some(&[SetDim::Addr, SetDim::Port][..]));
        assert_eq!(sets.dimensions("NOPE"), None);
        // hash:ip,port: the protocol is part of the entry.
        assert!(has(&sets, "CIP", &[a("10.96.0.1"), tcp(443)]));
        assert!(!has(
            &sets,
            "CIP",
            &[a("10.96.0.1"), SetValue::Port(Protocol::Udp, 443)]
        ));
        assert!(has(&sets, "CIP", &[a("10.96.0.10"), SetValue::Port(Protocol::Udp, 53)]));
        assert!(!has(&sets, "CIP", &[a("10.96.0.1"), tcp(80)]));
        // hash:ip,port,ip: the third address is exact.
        assert!(has(&sets, "LOOP", &[a("10.244.1.5"), tcp(8080), a("10.244.1.5")]));
        assert!(!has(&sets, "LOOP", &[a("10.244.1.5"), tcp(8080), a("10.244.1.6")]));
        // hash:ip,port,net: the third is a network.
        assert!(has(&sets, "CIDR", &[a("203.0.113.10"), tcp(80), a("192.168.77.1")]));
        assert!(!has(&sets, "CIDR", &[a("203.0.113.10"), tcp(80), a("10.0.0.1")]));
        // bitmap:port: ranges, any protocol.
        assert!(has(&sets, "NP", &[tcp(30005)]));
        assert!(has(&sets, "NP", &[SetValue::Port(Protocol::Udp, 32517)]));
        assert!(!has(&sets, "NP", &[tcp(30011)]));
        assert!(has(&sets, "IPS", &[a("10.96.0.1")]));
        assert!(!has(&sets, "IPS", &[a("10.96.0.2")]));
        // IPv6 sets, and the family check.
        assert!(has(&sets, "NETS", &[a("fd00:10::99")]));
        assert!(!has(&sets, "NETS", &[a("10.0.0.1")]));
        assert!(has(&sets, "SIX", &[a("fd00::1"), SetValue::Port(Protocol::Sctp, 3868)]));
        // An entry without a protocol is tcp.
        let sets = Ipsets::parse("create X hash:ip,port\nadd X 10.0.0.1,80\n").unwrap();
        assert!(has(&sets, "X", &[a("10.0.0.1"), tcp(80)]));
    }

    #[test]
    fn ipset_input_errors_name_the_line() {
        let cases = [
            ("create X hash:mac\n", 1, "set type"),
            ("create X hash:ip\ncreate X hash:ip\n", 2, "twice"),
            ("add X 10.0.0.1\n", 1, "before it is created"),
            ("create X hash:ip family inet6\nadd X 10.0.0.1\n", 2, "family"),
            ("create X bitmap:port range 100-200\nadd X 300\n", 2, "range"),
            ("create X bitmap:port\n", 1, "range"),
            ("create X hash:ip timeout 5\n", 1, "timeout"),
            ("create X hash:ip,port\nadd X 10.0.0.1,icmp:8\n", 2, "protocol"),
            ("create X hash:ip,port\nadd X 10.0.0.1\n", 2, "parts"),
            ("create X hash:net\nadd X 10.0.0.0/8 nomatch\n", 2, "entry options"),
            ("flush X\n", 1, "only create and add"),
            ("create X\n", 1, "a set name and a type"),
            ("create X hash:ip\nadd X\n", 2, "a set and an entry"),
        ];
        for (input, line, why) in cases {
            match Ipsets::parse(input) {
                Err(TraceError::Ipset { line: l, reason, .. }) => {
                    assert_eq!(l, line, "{input}");
                    assert!(reason.contains(why), "{input}: {reason}");
                }
                other => panic!("{input}: {other:?}"),
            }
        }
    }

    /// A rule naming a set that does not exist fails to load, as in iptables-restore; flags
    /// are taken per dimension, `src` or `dst`.
    #[test]
    fn set_match_flags_pick_source_or_destination() {
        let sets = Ipsets::parse(SETS).unwrap();
        let rules = |rule: &str| Ruleset {
            family: IpFamily::V4,
            jumps: vec![],
            restore: format!("*filter\n:X - [0:0]\n{rule}\nCOMMIT\n"),
        };
        let load_err = |rule: &str| match load(&rules(rule), &sets) {
            Ok(_) => panic!("{rule} loads"),
            Err(e) => e,
        };
        let err = load_err("-A X -m set --match-set NOPE dst -j DROP");
        assert!(
            matches!(&err, TraceError::Set { line: 3, set, .. } if set == "NOPE"),
            "{err:?}"
        );
        let err = load_err("-A X -m set --match-set CIP dst,src -j DROP");
        assert!(
            matches!(&err, TraceError::Set { reason, .. } if reason.contains("source ports")),
            "{err:?}"
        );
        let err = load_err("-A X -m set --match-set CIP dst,dest -j DROP");
        assert!(matches!(err, TraceError::Parse { line: 3, .. }), "{err:?}");
        assert!(load(&rules("-A X -m set ! --match-set CIP src,dst -j DROP"), &sets).is_ok());
    }

    // === the IPVS step, over rendered rulesets ===

    fn name(svc: &str, proto: Protocol) -> ServicePortName {
        ServicePortName {
            namespace: "ns".into(),
            name: svc.into(),
            port: "p".into(),
            protocol: proto,
        }
    }

    fn ep(addr: &str, port: u16, local: bool) -> Endpoint {
        Endpoint {
            is_local: local,
            ..Endpoint::ready(ip(addr), port)
        }
    }

    /// web: 10.96.0.10:80 (NodePort 30080) with three endpoints, one on this node; empty:
    /// 10.96.0.20:80 without endpoints; sticky: 10.96.0.30:80 with ClientIP affinity;
    /// fw: 10.96.0.40:80 with LB 203.0.113.40 open to 198.51.100.0/24 only; local: LB
    /// 203.0.113.50 with externalTrafficPolicy Local.
    fn state() -> ProxyState {
        let web = ServicePort {
            node_port: 30080,
            ..ServicePort::cluster_ip(name("web", Protocol::Tcp), ip("10.96.0.10"), 80)
        };
        let empty = ServicePort::cluster_ip(name("empty", Protocol::Tcp), ip("10.96.0.20"), 80);
        let sticky = ServicePort {
            session_affinity_timeout: Some(10800),
            ..ServicePort::cluster_ip(name("sticky", Protocol::Tcp), ip("10.96.0.30"), 80)
        };
        let fw = ServicePort {
            load_balancer_vips: vec![ip("203.0.113.40")],
            load_balancer_source_ranges: vec!["198.51.100.0/24".parse().unwrap()],
            ..ServicePort::cluster_ip(name("fw", Protocol::Tcp), ip("10.96.0.40"), 80)
        };
        let local = ServicePort {
            load_balancer_vips: vec![ip("203.0.113.50")],
            external_policy_local: true,
            health_check_node_port: 31050,
            ..ServicePort::cluster_ip(name("local", Protocol::Tcp), ip("10.96.0.50"), 80)
        };
        let three = vec![
            ep("10.244.1.5", 8080, true),
            ep("10.244.2.7", 8080, false),
            ep("10.244.3.9", 8080, false),
        ];
        let mut service_ports = vec![
            ServicePortState {
                port: web,
                endpoints: three.clone(),
            },
            ServicePortState {
                port: empty,
                endpoints: vec![],
            },
            ServicePortState {
                port: sticky,
                endpoints: three[1..].to_vec(),
            },
            ServicePortState {
                port: fw,
                endpoints: three[..1].to_vec(),
            },
            ServicePortState {
                port: local,
                endpoints: three.clone(),
            },
        ];
        service_ports.sort_by(|a, b| a.port.name.cmp(&b.port.name));
        ProxyState {
            family: IpFamily::V4,
            node: NodeInfo {
                name: "node-a".into(),
                addresses: vec![ip(NODE_IP)],
                ..NodeInfo::default()
            },
            service_ports: crate::model::shared(service_ports),
            service_cidrs: vec![],
            warnings: vec![],
        }
    }

    fn rendered() -> IpvsRuleset {
        let opts = IpvsRenderOptions {
            common: RenderOptions {
                local_detector: LocalDetector::Cidr("10.244.0.0/16".into()),
                ..RenderOptions::default()
            },
            ..IpvsRenderOptions::default()
        };
        render(&state(), &opts)
    }

    fn ctx() -> TraceContext {
        TraceContext {
            local_addresses: vec![ip(NODE_IP), ip("127.0.0.1")],
        }
    }

    fn pkt(src: &str, dst: &str, port: u16, iface: Option<&str>) -> Packet {
        Packet {
            src: ip(src),
            dst: ip(dst),
            dport: port,
            protocol: Protocol::Tcp,
            in_interface: iface.map(str::to_string),
        }
    }

    fn run(p: &Packet) -> Trace {
        trace(&rendered(), &ctx(), p).unwrap()
    }

    fn path_rules(t: &Trace, path: usize) -> Vec<String> {
        t.rules
            .iter()
            .filter(|r| r.path == path)
            .map(|r| format!("{}/{}: {}", r.table, r.chain, r.rule))
            .collect()
    }

    #[test]
    fn cluster_ip_is_scheduled_to_every_real_server_after_filter_input() {
        let t = run(&pkt("10.244.2.30", "10.96.0.10", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(
            t.endpoints,
            strs(&["10.244.1.5:8080", "10.244.2.7:8080", "10.244.3.9:8080"])
        );
        assert!(!t.masquerade, "a pod is not masqueraded");
        assert_eq!(t.paths.len(), 3);
        assert_eq!(
            t.paths[0].hooks,
            strs(&[
                "nat/PREROUTING", "filter/INPUT", "ipvs/LOCAL_IN", "filter/OUTPUT", "nat/POSTROUTING"
            ])
        );
        assert_eq!(
            t.paths[0].choices,
            strs(&["ipvs TCP 10.96.0.10:80 (rr): real server 10.244.1.5:8080, one of 3 it schedules"])
        );
        let rules = path_rules(&t, 0);
        assert!(
            rules.contains(&"ipvs/LOCAL_IN: TCP  10.96.0.10:80 rr -> 10.244.1.5:8080 Masq 1".to_string()),
            "{rules:#?}"
        );
        assert!(
            rules
                .iter()
                .any(|r| r.starts_with("filter/KUBE-IPVS-FILTER: ") && r.contains("KUBE-CLUSTER-IP dst,dst -j RETURN")),
            "{rules:#?}"
        );
        // From outside the cluster CIDR: masqueraded through the mark.
        let t = run(&pkt("192.168.0.77", "10.96.0.10", 80, Some("eth0")));
        assert!(t.masquerade && t.paths.iter().all(|p| p.masquerade));
    }

    #[test]
    fn hairpin_is_masqueraded_by_the_loop_back_set_on_that_path_only() {
        let t = run(&pkt("10.244.1.5", "10.96.0.10", 80, Some("cni0")));
        let masq: Vec<(Option<&str>, bool)> = t.paths.iter().map(|p| (p.endpoint.as_deref(), p.masquerade)).collect();
        assert_eq!(
            masq,
            vec![
                (Some("10.244.1.5:8080"), true),
                (Some("10.244.2.7:8080"), false),
                (Some("10.244.3.9:8080"), false)
            ]
        );
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("KUBE-LOOP-BACK dst,dst,src -j MASQUERADE"))
        );
    }

    #[test]
    fn no_real_servers_is_refused_by_ipvs_itself() {
        let t = run(&pkt("10.244.2.30", "10.96.0.20", 80, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Reject);
        assert!(t.endpoints.is_empty() && !t.masquerade);
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/PREROUTING", "filter/INPUT", "ipvs/LOCAL_IN"])
        );
        assert_eq!(
            t.rules.last().map(|r| r.rule.as_str()),
            Some("TCP  10.96.0.20:80 rr: no real servers, the kernel answers ICMP port unreachable")
        );
    }

    #[test]
    fn weight_zero_real_servers_are_never_scheduled() {
        let mut rs = rendered();
        let vs = rs
            .virtual_servers
            .iter_mut()
            .find(|v| v.address == ip("10.96.0.10"))
            .unwrap();
        vs.destinations[0].weight = 0;
        let p = pkt("10.244.2.30", "10.96.0.10", 80, Some("cni0"));
        let t = trace(&rs, &ctx(), &p).unwrap();
        assert_eq!(t.endpoints, strs(&["10.244.2.7:8080", "10.244.3.9:8080"]));
        for d in &mut rs
            .virtual_servers
            .iter_mut()
            .find(|v| v.address == ip("10.96.0.10"))
            .unwrap()
            .destinations
        {
            d.weight = 0;
        }
        let t = trace(&rs, &ctx(), &p).unwrap();
        assert_eq!(t.verdict, Verdict::Reject);
        assert!(
            t.rules
                .last()
                .unwrap()
                .rule
                .contains("no real server with a weight above 0")
        );
    }

    #[test]
    fn persistence_is_reported_with_the_choice() {
        let t = run(&pkt("10.244.2.30", "10.96.0.30", 80, Some("cni0")));
        assert_eq!(t.endpoints, strs(&["10.244.2.7:8080", "10.244.3.9:8080"]));
        assert!(
            t.rules
                .iter()
                .any(|r| r.rule.starts_with("TCP  10.96.0.30:80 rr persistent 10800 -> "))
        );
        assert!(t.paths[0].choices[0].contains("(rr, persistent 10800 s: a client's new connections stay"));
    }

    #[test]
    fn a_kube_ipvs0_address_on_a_port_of_no_service_is_rejected_by_the_filter() {
        let t = run(&pkt("10.244.2.30", "10.96.0.10", 81, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Reject);
        assert_eq!(t.paths[0].hooks, strs(&["nat/PREROUTING", "filter/INPUT"]));
        assert!(t.rules.last().unwrap().rule.contains("KUBE-IPVS-IPS dst -j REJECT"));
        // A node address is no kube-ipvs0 address: delivered to whatever listens.
        let t = run(&pkt("10.244.2.30", NODE_IP, 22, Some("cni0")));
        assert_eq!(t.verdict, Verdict::Pass);
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/PREROUTING", "filter/INPUT", "ipvs/LOCAL_IN"])
        );
    }

    #[test]
    fn node_port_is_a_virtual_server_on_the_node_address_and_masqueraded() {
        let t = run(&pkt("198.18.0.9", NODE_IP, 30080, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints.len(), 3);
        assert!(t.masquerade);
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ"))
        );
        // No localhost NodePorts in IPVS mode.
        let t = run(&pkt("127.0.0.1", "127.0.0.1", 30080, None));
        assert_eq!(t.verdict, Verdict::Pass);
        assert!(t.endpoints.is_empty());
    }

    #[test]
    fn the_node_goes_through_ipvs_on_the_way_out() {
        let t = run(&pkt(NODE_IP, "10.96.0.10", 80, None));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/OUTPUT", "ipvs/LOCAL_OUT", "filter/OUTPUT", "nat/POSTROUTING"])
        );
        // The node is outside the cluster CIDR: masqueraded.
        assert!(t.masquerade);
        let text = render_text(&t, &pkt(NODE_IP, "10.96.0.10", 80, None));
        assert!(
            text.contains("  ipvs/LOCAL_OUT: TCP  10.96.0.10:80 rr -> 10.244.2.7:8080 Masq 1"),
            "{text}"
        );
        // No virtual server: back in through lo to filter INPUT, where KUBE-IPVS-FILTER rejects.
        let t = run(&pkt(NODE_IP, "10.96.0.10", 81, None));
        assert_eq!(t.verdict, Verdict::Reject);
        assert_eq!(
            t.paths[0].hooks,
            strs(&[
                "nat/OUTPUT", "ipvs/LOCAL_OUT", "filter/OUTPUT", "nat/POSTROUTING", "filter/INPUT"
            ])
        );
    }

    #[test]
    fn source_ranges_drop_in_filter_input_before_ipvs() {
        let allowed = run(&pkt("198.51.100.7", "203.0.113.40", 80, Some("eth0")));
        assert_eq!(allowed.verdict, Verdict::Dnat);
        assert_eq!(allowed.endpoints, strs(&["10.244.1.5:8080"]));
        assert!(allowed.masquerade);
        let denied = run(&pkt("198.18.0.9", "203.0.113.40", 80, Some("eth0")));
        assert_eq!(denied.verdict, Verdict::Drop);
        assert_eq!(denied.paths[0].hooks, strs(&["nat/PREROUTING", "filter/INPUT"]));
        assert_eq!(
            denied.rules.last().unwrap().rule,
            "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP"
        );
        // The node may not reach it either: it would leave with the VIP as its source, which
        // KUBE-IPVS-OUT-FILTER drops after IPVS scheduled it (-m ipvs).
        let from_vip = run(&pkt("203.0.113.40", "203.0.113.40", 80, None));
        assert_eq!(from_vip.verdict, Verdict::Drop);
        assert_eq!(
            from_vip.paths[0].hooks,
            strs(&["nat/OUTPUT", "ipvs/LOCAL_OUT", "filter/OUTPUT"])
        );
        assert!(
            from_vip
                .rules
                .last()
                .unwrap()
                .rule
                .contains("-m ipvs --vaddr 203.0.113.40")
        );
        assert_eq!(from_vip.paths[0].endpoint.as_deref(), Some("10.244.1.5:8080"));
    }

    #[test]
    fn local_policy_keeps_the_source_and_uses_local_endpoints() {
        let t = run(&pkt("198.18.0.9", "203.0.113.50", 80, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["10.244.1.5:8080"]));
        assert!(!t.masquerade);
        assert!(
            path_rules(&t, 0)
                .iter()
                .any(|r| r.contains("KUBE-LOAD-BALANCER-LOCAL dst,dst -j RETURN"))
        );
        // The health-check node port is accepted in filter INPUT.
        let t = run(&pkt("198.18.0.9", NODE_IP, 31050, Some("eth0")));
        assert_eq!(t.verdict, Verdict::Accept);
    }

    #[test]
    fn a_real_server_on_the_node_is_delivered_locally() {
        let mut rs = rendered();
        let vs = rs
            .virtual_servers
            .iter_mut()
            .find(|v| v.address == ip("10.96.0.10"))
            .unwrap();
        vs.destinations = vec![IpvsDestination {
            address: ip(NODE_IP),
            port: 10250,
            weight: 1,
        }];
        let t = trace(&rs, &ctx(), &pkt("10.244.2.30", "10.96.0.10", 80, Some("cni0"))).unwrap();
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["192.168.0.2:10250"]));
        assert_eq!(
            t.paths[0].hooks,
            strs(&["nat/PREROUTING", "filter/INPUT", "ipvs/LOCAL_IN"])
        );
    }

    #[test]
    fn external_ips_fork_on_bridging_without_changing_the_outcome() {
        let mut st = state();
        let web = st
            .service_ports
            .iter_mut()
            .find(|s| s.port.name.name == "web")
            .map(std::sync::Arc::make_mut)
            .expect("web");
        web.port.external_ips = vec![ip("198.51.100.60")];
        let svc = web.port.clone();
        let rs = render(&st, &IpvsRenderOptions::default());
        let p = pkt("198.18.0.9", "198.51.100.60", svc.port, Some("eth0"));
        let t = trace(&rs, &ctx(), &p).unwrap();
        let n = rs
            .virtual_server(Protocol::Tcp, ip("198.51.100.60"), svc.port)
            .unwrap()
            .destinations
            .len();
        assert_eq!(n, 3);
        assert_eq!(t.paths.len(), 2 * n);
        assert!(t.paths[0].choices[0].starts_with("physdev: eth0 is not a bridge"));
        assert!(t.paths.iter().all(|p| p.masquerade == t.paths[0].masquerade));
        assert!(t.masquerade);
        // From the node there is nothing to bridge: no fork.
        let t = trace(&rs, &ctx(), &pkt(NODE_IP, "198.51.100.60", svc.port, None)).unwrap();
        assert_eq!(t.paths.len(), n);
    }

    #[test]
    fn ipv6_sets_and_virtual_servers() {
        let svc = ServicePort {
            node_port: 30600,
            ..ServicePort::cluster_ip(name("six", Protocol::Tcp), ip("fd00:96::1"), 80)
        };
        let st = ProxyState {
            family: IpFamily::V6,
            node: NodeInfo {
                name: "node-a".into(),
                addresses: vec![ip("fd00:49::2")],
                ..NodeInfo::default()
            },
            service_ports: crate::model::shared(vec![ServicePortState {
                port: svc,
                endpoints: vec![ep("fd00:10:244:1::60", 8080, false)],
            }]),
            service_cidrs: vec![],
            warnings: vec![],
        };
        let rs = render(&st, &IpvsRenderOptions::default());
        let ctx6 = TraceContext {
            local_addresses: vec![ip("fd00:49::2"), ip("::1")],
        };
        let t = trace(&rs, &ctx6, &pkt("2001:db8::1", "fd00:49::2", 30600, Some("eth0"))).unwrap();
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(t.endpoints, strs(&["[fd00:10:244:1::60]:8080"]));
        assert!(t.masquerade);
        assert!(t.rules.iter().any(|r| r.rule.contains("KUBE-6-NODE-PORT-TCP")));
        let err = trace(&rs, &ctx6, &pkt("10.0.0.1", "fd00:49::2", 30600, None)).unwrap_err();
        assert!(matches!(err, TraceError::FamilyMismatch { .. }));
    }

    #[test]
    fn json_has_the_shape_of_the_other_modes() {
        let t = run(&pkt("192.168.0.77", "10.96.0.10", 80, Some("eth0")));
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["verdict"], "DNAT");
        assert_eq!(json["masquerade"], true);
        assert_eq!(json["endpoints"].as_array().map(Vec::len), Some(3));
        assert!(json["rules"].as_array().unwrap().iter().any(|r| r["table"] == "ipvs"));
        assert_eq!(json["paths"][0]["hooks"][2], "ipvs/LOCAL_IN");
    }
}
