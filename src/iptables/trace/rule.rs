//! One rule's arguments (what follows `-A CHAIN`) into its [`Match`]es and target: one function
//! per match module or target family, then the checks that need the whole rule (a statistic or
//! recent match is only complete at its end), and the parsers of the option values.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::tables::{
    CT_DNAT, CT_ESTABLISHED, CT_INVALID, CT_NEW, CT_RELATED, CT_SNAT, CT_UNTRACKED, Cidr, Match, NAT, Target, ip_bits,
};
use crate::model::{IpFamily, Protocol};
use RuleErr::{Malformed, Unsupported};

/// A target before chain names are resolved.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum TargetSpec {
    Resolved(Target),
    Jump(String),
    Goto(String),
}

#[derive(Debug)]
pub(super) struct ParsedRule {
    pub(super) comment: Option<String>,
    pub(super) matches: Vec<Match>,
    pub(super) target: TargetSpec,
}

#[derive(Debug, PartialEq)]
pub(super) enum RuleErr {
    Malformed(String),
    Unsupported(String),
}

impl RuleErr {
    pub(super) fn reason(self) -> String {
        match self {
            RuleErr::Malformed(r) | RuleErr::Unsupported(r) => r,
        }
    }
}

const MODULES: [&str; 13] = [
    "comment", "tcp", "udp", "sctp", "addrtype", "mark", "conntrack", "statistic", "recent", "nfacct", "set",
    "physdev", "ipvs",
];

#[derive(Default)]
struct RecentSpec {
    name: Option<String>,
    rcheck: bool,
    set: bool,
    seconds: bool,
    reap: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum TargetKind {
    Dnat,
    Masquerade,
    Mark,
    Reject,
    Other,
}

/// Parses the arguments after `-A CHAIN` into matches and a target.
pub(super) fn parse_rule(tokens: &[String], family: IpFamily, table: usize) -> Result<ParsedRule, RuleErr> {
    let mut rule = RuleParser::new(tokens, family, table);
    let mut neg = false;
    while let Some(opt) = rule.next_token() {
        if opt == "!" {
            if neg {
                return Err(Malformed("double `!`".to_string()));
            }
            neg = true;
            continue;
        }
        let negated = std::mem::take(&mut neg);
        rule.option(opt, negated)?;
    }
    if neg {
        return Err(Malformed("dangling `!`".to_string()));
    }
    rule.finish()
}

/// What the options of one rule have said so far.
struct RuleParser<'t> {
    tokens: &'t [String],
    /// The index of the next token.
    at: usize,
    family: IpFamily,
    table: usize,
    matches: Vec<Match>,
    comment: Option<String>,
    loaded: Vec<&'static str>,
    /// From the last tcp/udp/sctp module.
    port_protocol: Option<Protocol>,
    /// From -p, which autoloads its module.
    p_protocol: Option<Protocol>,
    stat_mode: Option<String>,
    stat_prob: Option<(f64, String)>,
    recent: Option<RecentSpec>,
    target: Option<(TargetSpec, TargetKind)>,
    to_destination: Option<(IpAddr, Option<u16>)>,
    mark_op: Option<(u32, u32)>,
}

/// Refuses a negated option that has no negated form.
fn no_neg(opt: &str, negated: bool) -> Result<(), RuleErr> {
    if negated {
        Err(Unsupported(format!("negated {opt} is not supported")))
    } else {
        Ok(())
    }
}

impl<'t> RuleParser<'t> {
    fn new(tokens: &'t [String], family: IpFamily, table: usize) -> RuleParser<'t> {
        RuleParser {
            tokens,
            at: 0,
            family,
            table,
            matches: Vec::new(),
            comment: None,
            loaded: Vec::new(),
            port_protocol: None,
            p_protocol: None,
            stat_mode: None,
            stat_prob: None,
            recent: None,
            target: None,
            to_destination: None,
            mark_op: None,
        }
    }

    fn next_token(&mut self) -> Option<&'t str> {
        let token = self.tokens.get(self.at)?;
        self.at += 1;
        Some(token.as_str())
    }

    /// The value of option `opt`: the next token.
    fn value(&mut self, opt: &str) -> Result<&'t str, RuleErr> {
        self.next_token()
            .ok_or_else(|| Malformed(format!("{opt} needs a value")))
    }

    /// Refuses an option of a match module the rule has not loaded.
    fn need(&self, opt: &str, module: &str) -> Result<(), RuleErr> {
        if self.loaded.contains(&module) {
            Ok(())
        } else {
            Err(Unsupported(format!("{opt} without -m {module}")))
        }
    }

    /// Refuses an option of a target the rule does not have.
    fn need_target(&self, opt: &str, kind: TargetKind, name: &str) -> Result<(), RuleErr> {
        match &self.target {
            Some((_, k)) if *k == kind => Ok(()),
            _ => Err(Unsupported(format!("{opt} is only valid with -j {name}"))),
        }
    }

    /// One option and its values.
    fn option(&mut self, opt: &'t str, negated: bool) -> Result<(), RuleErr> {
        match opt {
            "-p" | "--protocol" | "-s" | "--source" | "-d" | "--destination" | "-i" | "--in-interface" => {
                self.addresses_and_interfaces(opt, negated)
            }
            "-m" | "--match" => self.load_module(opt, negated),
            "-j" | "--jump" | "-g" | "--goto" => self.target(opt, negated),
            "--comment" => self.comment(opt, negated),
            "--dport" | "--destination-port" => self.dport(opt, negated),
            "--dst-type" | "--src-type" => self.addrtype(opt, negated),
            "--mark" => self.mark(opt, negated),
            "--ctstate" => self.conntrack(opt, negated),
            "--mode" | "--probability" => self.statistic(opt, negated),
            "--name" | "--rcheck" | "--set" | "--seconds" | "--reap" | "--rsource" | "--mask" => {
                self.recent(opt, negated)
            }
            "--nfacct-name" => self.nfacct(opt, negated),
            "--match-set" => self.set(opt, negated),
            "--physdev-is-in" => self.physdev(opt, negated),
            "--vaddr" | "--vproto" | "--vport" => self.ipvs(opt, negated),
            "--to-destination" | "--random" | "--persistent" | "--random-fully" | "--reject-with" => {
                self.nat_and_reject(opt, negated)
            }
            "--set-xmark" | "--set-mark" | "--or-mark" | "--xor-mark" | "--and-mark" => self.mark_target(opt, negated),
            _ => Err(Unsupported(format!("unknown option {opt}"))),
        }
    }

    /// `-p`, `-s`, `-d`, `-i`.
    fn addresses_and_interfaces(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        let v = self.value(opt)?;
        let m = match opt {
            "-p" | "--protocol" => {
                let protocol = match v.to_ascii_lowercase().as_str() {
                    "all" => None,
                    "tcp" => Some(Protocol::Tcp),
                    "udp" => Some(Protocol::Udp),
                    "sctp" => Some(Protocol::Sctp),
                    _ => return Err(Unsupported(format!("protocol {v} is not supported"))),
                };
                if !negated {
                    self.p_protocol = protocol;
                }
                Match::Protocol { protocol, neg: negated }
            }
            "-s" | "--source" => Match::Source {
                cidr: parse_cidr(v, self.family)?,
                neg: negated,
            },
            "-d" | "--destination" => Match::Destination {
                cidr: parse_cidr(v, self.family)?,
                neg: negated,
            },
            // -i, --in-interface
            _ => Match::InInterface {
                name: v.to_string(),
                neg: negated,
            },
        };
        self.matches.push(m);
        Ok(())
    }

    /// `-m MODULE`.
    fn load_module(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        let v = self.value(opt)?;
        let Some(module) = MODULES.iter().find(|m| **m == v) else {
            return Err(Unsupported(format!("match module {v} is not supported")));
        };
        if (*module == "statistic" || *module == "recent") && self.loaded.contains(module) {
            return Err(Unsupported(format!("more than one -m {module} in a rule")));
        }
        match *module {
            "tcp" => self.port_protocol = Some(Protocol::Tcp),
            "udp" => self.port_protocol = Some(Protocol::Udp),
            "sctp" => self.port_protocol = Some(Protocol::Sctp),
            "recent" => self.recent = Some(RecentSpec::default()),
            _ => {}
        }
        self.loaded.push(*module);
        Ok(())
    }

    /// `-j TARGET` or `-g CHAIN`; a target's own options come after it.
    fn target(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        let v = self.value(opt)?;
        if self.target.is_some() {
            return Err(Malformed("more than one target".to_string()));
        }
        let goto = opt == "-g" || opt == "--goto";
        let nat = self.table == NAT;
        let (spec, kind) = match v {
            _ if goto => (TargetSpec::Goto(v.to_string()), TargetKind::Other),
            "ACCEPT" => (TargetSpec::Resolved(Target::Accept), TargetKind::Other),
            "DROP" => (TargetSpec::Resolved(Target::Drop), TargetKind::Other),
            "RETURN" => (TargetSpec::Resolved(Target::Return), TargetKind::Other),
            "REJECT" if nat => {
                return Err(Unsupported("REJECT in the nat table".to_string()));
            }
            "REJECT" => (TargetSpec::Resolved(Target::Reject), TargetKind::Reject),
            "DNAT" | "MASQUERADE" if !nat => {
                return Err(Unsupported(format!("{v} outside the nat table")));
            }
            "DNAT" => (TargetSpec::Resolved(Target::None), TargetKind::Dnat),
            "MASQUERADE" => (TargetSpec::Resolved(Target::Masquerade), TargetKind::Masquerade),
            "MARK" => (TargetSpec::Resolved(Target::None), TargetKind::Mark),
            _ => (TargetSpec::Jump(v.to_string()), TargetKind::Other),
        };
        self.target = Some((spec, kind));
        Ok(())
    }

    /// `-m comment --comment TEXT`: the first comment names the rule in choice notes.
    fn comment(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        self.need(opt, "comment")?;
        let v = self.value(opt)?;
        self.comment.get_or_insert_with(|| v.to_string());
        Ok(())
    }

    /// `--dport` of `-m tcp`/`udp`/`sctp`, or of the module `-p` loads.
    fn dport(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        if self.port_protocol.is_none() {
            // iptables autoloads the protocol's match for `-p tcp --dport N`.
            self.port_protocol = self.p_protocol;
        }
        let Some(protocol) = self.port_protocol else {
            return Err(Unsupported(format!("{opt} without -p or -m tcp/udp/sctp")));
        };
        let (lo, hi) = parse_port_range(self.value(opt)?)?;
        self.matches.push(Match::Dport {
            protocol,
            lo,
            hi,
            neg: negated,
        });
        Ok(())
    }

    /// `-m addrtype --dst-type LOCAL` or `--src-type LOCAL`.
    fn addrtype(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        self.need(opt, "addrtype")?;
        let v = self.value(opt)?;
        if v != "LOCAL" {
            return Err(Unsupported(format!("address type {v} is not supported (only LOCAL)")));
        }
        self.matches.push(Match::AddrTypeLocal {
            dst: opt == "--dst-type",
            neg: negated,
        });
        Ok(())
    }

    /// `-m mark --mark V[/M]`.
    fn mark(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        self.need(opt, "mark")?;
        let (value, mask) = parse_mark(self.value(opt)?)?;
        self.matches.push(Match::Mark {
            value,
            mask,
            neg: negated,
        });
        Ok(())
    }

    /// `-m conntrack --ctstate STATES`.
    fn conntrack(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        self.need(opt, "conntrack")?;
        let states = parse_ctstates(self.value(opt)?)?;
        self.matches.push(Match::CtState { states, neg: negated });
        Ok(())
    }

    /// `-m statistic --mode MODE --probability P`, checked as a whole in [`Self::finish`].
    fn statistic(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        self.need(opt, "statistic")?;
        let v = self.value(opt)?;
        if opt == "--mode" {
            self.stat_mode = Some(v.to_string());
        } else {
            let p: f64 = v
                .parse()
                .ok()
                .filter(|p: &f64| (0.0..=1.0).contains(p))
                .ok_or_else(|| Malformed(format!("bad probability {v}")))?;
            self.stat_prob = Some((p, v.to_string()));
        }
        Ok(())
    }

    /// The options of `-m recent`, checked as a whole in [`Self::finish`].
    fn recent(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        self.need(opt, "recent")?;
        let value = match opt {
            "--name" | "--seconds" | "--mask" => Some(self.value(opt)?),
            _ => None,
        };
        let spec = self.recent.get_or_insert_with(RecentSpec::default);
        match (opt, value) {
            ("--name", Some(v)) => spec.name = Some(v.to_string()),
            ("--seconds", Some(v)) => {
                v.parse::<u64>().map_err(|_| Malformed(format!("bad --seconds {v}")))?;
                spec.seconds = true;
            }
            ("--rcheck", _) => spec.rcheck = true,
            ("--set", _) => spec.set = true,
            ("--reap", _) => spec.reap = true,
            // `iptables-save` prints the default host mask; any other groups clients.
            ("--mask", Some(v)) if v == "255.255.255.255" || v == "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff" => {}
            ("--mask", Some(v)) => return Err(Unsupported(format!("recent --mask {v} is not traced"))),
            _ => {} // --rsource is the default
        }
        Ok(())
    }

    /// `-m nfacct --nfacct-name NAME`: counts, never decides.
    fn nfacct(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        self.need(opt, "nfacct")?;
        self.value(opt)?;
        Ok(())
    }

    /// `-m set --match-set NAME FLAGS`.
    fn set(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        self.need(opt, "set")?;
        let name = self.value(opt)?.to_string();
        let flags = self.value(opt)?;
        let mut src = Vec::new();
        for flag in flags.split(',') {
            src.push(match flag {
                "src" => true,
                "dst" => false,
                _ => return Err(Malformed(format!("bad --match-set flags {flags}"))),
            });
        }
        // ipset's limit on dimensions.
        if src.len() > 6 {
            return Err(Malformed(format!("too many --match-set flags {flags}")));
        }
        self.matches.push(Match::Set {
            name,
            src,
            neg: negated,
        });
        Ok(())
    }

    /// `-m physdev --physdev-is-in`.
    fn physdev(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        self.need(opt, "physdev")?;
        self.matches.push(Match::PhysdevIsIn { neg: negated });
        Ok(())
    }

    /// `-m ipvs --vaddr CIDR`, `--vproto PROTOCOL`, `--vport PORT`.
    fn ipvs(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        self.need(opt, "ipvs")?;
        let v = self.value(opt)?;
        let m = match opt {
            "--vaddr" => Match::IpvsVaddr {
                cidr: parse_cidr(v, self.family)?,
                neg: negated,
            },
            "--vproto" => {
                let protocol = match v.to_ascii_lowercase().as_str() {
                    "tcp" | "6" => Protocol::Tcp,
                    "udp" | "17" => Protocol::Udp,
                    "sctp" | "132" => Protocol::Sctp,
                    _ => return Err(Unsupported(format!("--vproto {v} is not supported"))),
                };
                Match::IpvsVproto { protocol, neg: negated }
            }
            // --vport
            _ => Match::IpvsVport {
                port: parse_port(v)?,
                neg: negated,
            },
        };
        self.matches.push(m);
        Ok(())
    }

    /// The options of the DNAT, MASQUERADE and REJECT targets.
    fn nat_and_reject(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        match opt {
            "--to-destination" => {
                self.need_target(opt, TargetKind::Dnat, "DNAT")?;
                self.to_destination = Some(parse_to_destination(self.value(opt)?, self.family)?);
            }
            "--random" | "--persistent" => match &self.target {
                Some((_, TargetKind::Dnat)) => {}
                Some((_, TargetKind::Masquerade)) if opt == "--random" => {}
                _ => {
                    return Err(Unsupported(format!("{opt} is only valid with -j DNAT or MASQUERADE")));
                }
            },
            "--random-fully" => self.need_target(opt, TargetKind::Masquerade, "MASQUERADE")?,
            // --reject-with
            _ => {
                self.need_target(opt, TargetKind::Reject, "REJECT")?;
                self.value(opt)?;
            }
        }
        Ok(())
    }

    /// The operations of the MARK target.
    fn mark_target(&mut self, opt: &str, negated: bool) -> Result<(), RuleErr> {
        no_neg(opt, negated)?;
        self.need_target(opt, TargetKind::Mark, "MARK")?;
        if self.mark_op.is_some() {
            return Err(Malformed("more than one MARK operation".to_string()));
        }
        let v = self.value(opt)?;
        // All forms reduce to the kernel's (value, mask): mark = (mark & !mask) ^ value.
        self.mark_op = Some(match opt {
            "--set-xmark" => parse_mark(v)?,
            "--set-mark" => {
                let (value, mask) = parse_mark(v)?;
                (value, value | mask)
            }
            _ => {
                let n = parse_u32(v).ok_or_else(|| Malformed(format!("bad mark {v}")))?;
                match opt {
                    "--or-mark" => (n, n),
                    "--xor-mark" => (n, 0),
                    _ => (0, !n),
                }
            }
        });
        Ok(())
    }

    /// The rule once every option is read: the statistic and recent matches and the target
    /// are complete only now.
    fn finish(mut self) -> Result<ParsedRule, RuleErr> {
        if self.loaded.contains(&"statistic") {
            let m = statistic_match(self.stat_mode.as_deref(), self.stat_prob.take())?;
            self.matches.push(m);
        }
        if let Some(spec) = self.recent.take() {
            self.matches.push(recent_match(spec)?);
        }
        let target = match self.target {
            None => TargetSpec::Resolved(Target::None),
            Some((_, TargetKind::Dnat)) => {
                let (addr, port) = self
                    .to_destination
                    .ok_or_else(|| Malformed("DNAT needs --to-destination".to_string()))?;
                TargetSpec::Resolved(Target::Dnat { addr, port })
            }
            Some((_, TargetKind::Mark)) => {
                let (value, mask) = self
                    .mark_op
                    .ok_or_else(|| Malformed("MARK needs a mark operation".to_string()))?;
                TargetSpec::Resolved(Target::Mark { value, mask })
            }
            Some((spec, _)) => spec,
        };
        Ok(ParsedRule {
            comment: self.comment,
            matches: self.matches,
            target,
        })
    }
}

/// `-m statistic`: only the random mode, with its probability.
fn statistic_match(mode: Option<&str>, probability: Option<(f64, String)>) -> Result<Match, RuleErr> {
    match (mode, probability) {
        (Some("random"), Some((probability, text))) => Ok(Match::Statistic { probability, text }),
        (Some("random"), None) => Err(Malformed("statistic random mode needs --probability".to_string())),
        (Some(m), _) => Err(Unsupported(format!("statistic mode {m} is not supported"))),
        (None, _) => Err(Unsupported("statistic match without --mode random".to_string())),
    }
}

/// `-m recent`: `--rcheck` (with `--seconds`, maybe `--reap`) or `--set`, of set `--name`.
fn recent_match(spec: RecentSpec) -> Result<Match, RuleErr> {
    let name = spec.name.unwrap_or_else(|| "DEFAULT".to_string());
    match (spec.rcheck, spec.set) {
        (true, false) => {
            if spec.reap && !spec.seconds {
                return Err(Malformed("recent --reap needs --seconds".to_string()));
            }
            Ok(Match::RecentCheck { name })
        }
        (false, true) if !spec.seconds && !spec.reap => Ok(Match::RecentSet { name }),
        (false, true) => Err(Malformed("recent --seconds/--reap only go with --rcheck".to_string())),
        _ => Err(Unsupported(
            "recent match needs exactly one of --rcheck or --set".to_string(),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Option values

fn parse_cidr(s: &str, family: IpFamily) -> Result<Cidr, RuleErr> {
    let bad = |why: &str| RuleErr::Malformed(format!("bad address {s}: {why}"));
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let ip: IpAddr = addr
        .parse()
        .map_err(|_| bad("not an IP address (host names are not supported)"))?;
    if !family.contains(&ip) {
        return Err(bad(&format!("not an {family} address")));
    }
    let (v6, bits) = ip_bits(&ip);
    let width: u32 = if v6 { 128 } else { 32 };
    let prefix = match len {
        None => width,
        Some(l) => match l.parse::<u32>() {
            Ok(p) if p <= width => p,
            Ok(_) => return Err(bad("prefix length too long")),
            Err(_) => {
                // A dotted mask (`/255.0.0.0`), which iptables accepts when contiguous.
                let m: IpAddr = l.parse().map_err(|_| bad("bad prefix length"))?;
                let (mv6, mbits) = ip_bits(&m);
                let ones = if mv6 {
                    mbits.leading_ones()
                } else {
                    (mbits as u32).leading_ones()
                };
                let full = if mv6 {
                    mbits.count_ones()
                } else {
                    (mbits as u32).count_ones()
                };
                if mv6 != v6 || ones != full {
                    return Err(bad("mask is not contiguous"));
                }
                ones
            }
        },
    };
    let all: u128 = if v6 { u128::MAX } else { u128::from(u32::MAX) };
    let mask = if prefix == 0 {
        0
    } else {
        (all << (width - prefix)) & all
    };
    Ok(Cidr {
        v6,
        net: bits & mask,
        mask,
    })
}

fn parse_port(s: &str) -> Result<u16, RuleErr> {
    s.parse().map_err(|_| RuleErr::Malformed(format!("bad port {s}")))
}

fn parse_port_range(s: &str) -> Result<(u16, u16), RuleErr> {
    let (lo, hi) = match s.split_once(':') {
        Some((lo, hi)) => (
            if lo.is_empty() { 0 } else { parse_port(lo)? },
            if hi.is_empty() { u16::MAX } else { parse_port(hi)? },
        ),
        None => {
            let p = parse_port(s)?;
            (p, p)
        }
    };
    if lo > hi {
        return Err(RuleErr::Malformed(format!("bad port range {s}")));
    }
    Ok((lo, hi))
}

/// Parses a number like strtoul(…, 0): `0x` hex, leading `0` octal, else decimal.
fn parse_u32(s: &str) -> Option<u32> {
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16).ok()
    } else if s.len() > 1 && s.starts_with('0') {
        u32::from_str_radix(&s[1..], 8).ok()
    } else if s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse().ok()
    } else {
        None
    }
}

/// `V` or `V/M` (mask defaults to all ones).
fn parse_mark(s: &str) -> Result<(u32, u32), RuleErr> {
    let bad = || RuleErr::Malformed(format!("bad mark {s}"));
    match s.split_once('/') {
        Some((v, m)) => Ok((parse_u32(v).ok_or_else(bad)?, parse_u32(m).ok_or_else(bad)?)),
        None => Ok((parse_u32(s).ok_or_else(bad)?, u32::MAX)),
    }
}

fn parse_ctstates(s: &str) -> Result<u8, RuleErr> {
    let mut bits = 0;
    for state in s.split(',') {
        bits |= match state {
            "NEW" => CT_NEW,
            "ESTABLISHED" => CT_ESTABLISHED,
            "RELATED" => CT_RELATED,
            "INVALID" => CT_INVALID,
            "UNTRACKED" => CT_UNTRACKED,
            "SNAT" => CT_SNAT,
            "DNAT" => CT_DNAT,
            _ => return Err(RuleErr::Malformed(format!("bad conntrack state {state}"))),
        };
    }
    Ok(bits)
}

/// `ip[:port]` for IPv4, `[ip][:port]` or a bare address for IPv6.
fn parse_to_destination(s: &str, family: IpFamily) -> Result<(IpAddr, Option<u16>), RuleErr> {
    let bad = || RuleErr::Malformed(format!("bad --to-destination {s}"));
    if s.contains('-') {
        return Err(RuleErr::Unsupported(format!(
            "address or port ranges in --to-destination {s}"
        )));
    }
    let (addr, port): (IpAddr, Option<&str>) = match family {
        IpFamily::V4 => {
            let (a, p) = match s.split_once(':') {
                Some((a, p)) => (a, Some(p)),
                None => (s, None),
            };
            (IpAddr::V4(a.parse::<Ipv4Addr>().map_err(|_| bad())?), p)
        }
        IpFamily::V6 => match s.strip_prefix('[') {
            Some(rest) => {
                let (a, tail) = rest.split_once(']').ok_or_else(bad)?;
                let p = if tail.is_empty() {
                    None
                } else {
                    Some(tail.strip_prefix(':').ok_or_else(bad)?)
                };
                (IpAddr::V6(a.parse::<Ipv6Addr>().map_err(|_| bad())?), p)
            }
            None => (IpAddr::V6(s.parse::<Ipv6Addr>().map_err(|_| bad())?), None),
        },
    };
    let port = port.map(parse_port).transpose()?;
    Ok((addr, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_and_conntrack_parsing() {
        assert_eq!(parse_u32("0x004000"), Some(0x4000));
        assert_eq!(parse_u32("16384"), Some(0x4000));
        assert_eq!(parse_u32("010"), Some(8));
        assert_eq!(parse_u32("0xzz"), None);
        assert_eq!(parse_mark("0x4000/0x4000"), Ok((0x4000, 0x4000)));
        assert_eq!(parse_mark("1"), Ok((1, u32::MAX)));
        assert_eq!(
            parse_ctstates("RELATED,ESTABLISHED,DNAT"),
            Ok(CT_RELATED | CT_ESTABLISHED | CT_DNAT)
        );
        assert!(parse_ctstates("NEWISH").is_err());
        let c = parse_cidr("10.1.2.3/255.0.0.0", IpFamily::V4).unwrap();
        assert!(c.contains(&"10.200.0.1".parse().unwrap()));
        assert!(!c.contains(&"11.0.0.1".parse().unwrap()));
        assert!(parse_cidr("10.0.0.0/8", IpFamily::V6).is_err());
    }
}
