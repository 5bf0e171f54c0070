//! Which iptables backend the node's rules live in, and so which one we program: `legacy`
//! (the kernel's x_tables) or `nft` (the same rules translated to nf_tables). The two do not see
//! each other's rules, so a proxy writing to the other backend than kubelet and the host's
//! firewall gets chains that the rest of the node never jumps to, in an order nobody chose.
//!
//! The choice follows upstream's iptables-wrapper (the one kube-proxy's image runs through),
//! in its order:
//! 1. kubelet's `KUBE-IPTABLES-HINT` or `KUBE-KUBELET-CANARY` chain in nft's mangle table
//!    (IPv4, then IPv6): nft;
//! 2. the same chains in the legacy backend (its full `-save`: asking the legacy backend for one
//!    table would make the kernel create it): legacy;
//! 3. otherwise the backend with more rules (lines `-A …` of both families' `-save`) wins;
//!    legacy only with strictly more, so nft when both are empty.
//!
//! Where only one backend's tools are installed that one is used; where neither is (an
//! iptables without the `-legacy`/`-nft` names) the plain `iptables` tools are.
//!
//! [`detect`] is the decision, a pure function of what the tools print (behind [`Tools`], with
//! fixtures in the tests); [`Host`] is the edge that runs them; [`detect_and_log`] logs the
//! outcome once at start.

use std::fmt;

use tracing::{info, warn};

use super::names::KUBE_PROXY_CANARY;
use crate::model::IpFamily;

/// The chains kubelet (1.17 and later) creates in the mangle table of the backend it uses.
pub const KUBELET_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// An iptables backend: which tools every iptables call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `iptables-legacy`, `iptables-legacy-save`, `iptables-legacy-restore` (and `ip6tables-…`).
    Legacy,
    /// `iptables-nft`, `iptables-nft-save`, `iptables-nft-restore` (and `ip6tables-…`).
    Nft,
    /// `iptables`, `iptables-save`, `iptables-restore`: neither of the others is installed.
    Plain,
}

impl Backend {
    /// The name of one tool of this backend: `suffix` is `""`, `"-save"` or `"-restore"`.
    pub fn tool(self, family: IpFamily, suffix: &str) -> String {
        let base = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        match self {
            Backend::Legacy => format!("{base}-legacy{suffix}"),
            Backend::Nft => format!("{base}-nft{suffix}"),
            Backend::Plain => format!("{base}{suffix}"),
        }
    }

    /// `legacy`, `nft` or `plain`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Legacy => "legacy",
            Backend::Nft => "nft",
            Backend::Plain => "plain",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What decided the choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Kubelet's `chain` is in `backend`'s tables of `family`.
    KubeletChain {
        backend: Backend,
        family: IpFamily,
        chain: &'static str,
    },
    /// No kubelet chain in either backend; the rules each holds (both families).
    RuleCounts { legacy: usize, nft: usize },
    /// No kubelet chain and no rule in legacy: nft, without counting its rules.
    NoLegacyRules,
    /// Only this backend's tools are installed.
    OnlyInstalled,
    /// Neither `iptables-legacy-save` nor `iptables-nft-save` is installed.
    NoneInstalled,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::KubeletChain { backend, family, chain } => {
                write!(f, "kubelet's chain {chain} is in the {backend} backend ({family})")
            }
            Reason::RuleCounts { legacy, nft } => {
                write!(f, "no kubelet chain; {legacy} rules in legacy, {nft} in nft")
            }
            Reason::NoLegacyRules => f.write_str("no kubelet chain and no rules in legacy: nft by default"),
            Reason::OnlyInstalled => f.write_str("only this backend's tools are installed"),
            Reason::NoneInstalled => f.write_str("neither iptables-legacy nor iptables-nft is installed"),
        }
    }
}

/// The backend to program, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detection {
    pub backend: Backend,
    pub reason: Reason,
}

/// How the detection looks at the node: whether a tool is installed, and what it prints.
pub trait Tools {
    fn installed(&mut self, program: &str) -> bool;
    /// The standard output of `program args…`; empty when it fails (a backend the kernel does
    /// not have reports nothing, which is what it holds).
    fn output(&mut self, program: &str, args: &[&str]) -> String;
    /// Whether chain `chain` of nft table `ip <table>` (`ip6` for IPv6) exists, asked without
    /// the tools (which fetch the whole ruleset first); `None` where that cannot be asked.
    fn nft_chain_exists(&mut self, _family: IpFamily, _table: &str, _chain: &str) -> Option<bool> {
        None
    }
}

/// The first of kubelet's chains that an `iptables-save` output declares.
pub fn kubelet_chain(save: &str) -> Option<&'static str> {
    save.lines().find_map(|line| {
        let name = line.strip_prefix(':')?.split_whitespace().next()?;
        KUBELET_CHAINS.into_iter().find(|c| *c == name)
    })
}

/// The rules (`-A …` lines) in an `iptables-save` output.
pub fn rule_count(save: &str) -> usize {
    save.lines().filter(|l| l.starts_with('-')).count()
}

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// Chooses the backend from what the tools report (see the module doc for the order).
pub fn detect(tools: &mut dyn Tools) -> Detection {
    let legacy = tools.installed(&Backend::Legacy.tool(IpFamily::V4, "-save"));
    let nft = tools.installed(&Backend::Nft.tool(IpFamily::V4, "-save"));
    let only = |backend| Detection {
        backend,
        reason: Reason::OnlyInstalled,
    };
    match (legacy, nft) {
        (false, false) => {
            return Detection {
                backend: Backend::Plain,
                reason: Reason::NoneInstalled,
            };
        }
        (true, false) => return only(Backend::Legacy),
        (false, true) => return only(Backend::Nft),
        (true, true) => {}
    }
    let kubelet = |backend, family, save: &str| {
        kubelet_chain(save).map(|chain| Detection {
            backend,
            reason: Reason::KubeletChain { backend, family, chain },
        })
    };
    // nft first, and only its mangle table: kubelet's chains are there. Asked over netlink
    // where it can be: iptables-nft-save fetches the whole ruleset even for one table, seconds
    // at 10,000 Services, and a dump that another agent's writes keep restarting never ends.
    for family in FAMILIES {
        let mut asked = Some(None);
        for chain in KUBELET_CHAINS {
            match tools.nft_chain_exists(family, "mangle", chain) {
                Some(true) => {
                    asked = Some(Some(chain));
                    break;
                }
                Some(false) => {}
                None => {
                    asked = None;
                    break;
                }
            }
        }
        let found = match asked {
            Some(found) => found,
            None => kubelet_chain(&tools.output(&Backend::Nft.tool(family, "-save"), &["-t", "mangle"])),
        };
        if let Some(chain) = found {
            return Detection {
                backend: Backend::Nft,
                reason: Reason::KubeletChain {
                    backend: Backend::Nft,
                    family,
                    chain,
                },
            };
        }
    }
    let mut legacy_rules = 0;
    for family in FAMILIES {
        let all = tools.output(&Backend::Legacy.tool(family, "-save"), &[]);
        if let Some(d) = kubelet(Backend::Legacy, family, &all) {
            return d;
        }
        legacy_rules += rule_count(&all);
    }
    // With no legacy rules nft wins whatever it holds: no need to dump it (a dump of the
    // whole ruleset, as above).
    if legacy_rules == 0 {
        return Detection {
            backend: Backend::Nft,
            reason: Reason::NoLegacyRules,
        };
    }
    let nft_rules: usize = FAMILIES
        .into_iter()
        .map(|family| rule_count(&tools.output(&Backend::Nft.tool(family, "-save"), &[])))
        .sum();
    Detection {
        backend: if legacy_rules > nft_rules {
            Backend::Legacy
        } else {
            Backend::Nft
        },
        reason: Reason::RuleCounts {
            legacy: legacy_rules,
            nft: nft_rules,
        },
    }
}

/// The backend a running iptables or IPVS mode daemon programs, for `kube-proxy explain`,
/// which reads what is there: the nft backend when its mangle table holds kube-proxy's canary
/// chain (asked over netlink; where that cannot be asked, from a dump of that table), else
/// what [`detect`] chooses, as the daemon did. (Full dumps are what is slow on a node with
/// 10^5 rules; iptables-nft fetches the whole ruleset even for one table.)
pub fn in_use(tools: &mut dyn Tools) -> Backend {
    let canary_in_nft = tools
        .nft_chain_exists(IpFamily::V4, "mangle", KUBE_PROXY_CANARY)
        .unwrap_or_else(|| {
            let save = Backend::Nft.tool(IpFamily::V4, "-save");
            let declares = |line: &str| {
                line.strip_prefix(':').and_then(|r| r.split_whitespace().next()) == Some(KUBE_PROXY_CANARY)
            };
            tools.installed(&save) && tools.output(&save, &["-t", "mangle"]).lines().any(declares)
        });
    if canary_in_nft {
        return Backend::Nft;
    }
    detect(tools).backend
}

/// The node's own tools, in the process's network namespace.
pub struct Host;

impl Tools for Host {
    fn installed(&mut self, program: &str) -> bool {
        crate::vm::find_program(program).is_some()
    }

    fn output(&mut self, program: &str, args: &[&str]) -> String {
        match crate::exec::output(program, args, None) {
            Ok(out) if out.status.success() => out.stdout,
            _ => String::new(),
        }
    }

    fn nft_chain_exists(&mut self, family: IpFamily, table: &str, chain: &str) -> Option<bool> {
        crate::nftables::netlink::NftSocket::new()
            .and_then(|mut s| s.chain_exists(family, table, chain))
            .ok()
    }
}

/// The backend the daemon chooses on a node without rules in either backend (a namespace of
/// the lab): the tools installed decide alone.
pub fn on_empty_node() -> Backend {
    struct Empty;
    impl Tools for Empty {
        fn installed(&mut self, program: &str) -> bool {
            Host.installed(program)
        }
        fn output(&mut self, _: &str, _: &[&str]) -> String {
            String::new()
        }
    }
    detect(&mut Empty).backend
}

/// Detects the backend on this node and logs what was found and chosen (once, at start).
pub fn detect_and_log() -> Backend {
    let d = detect(&mut Host);
    if d.reason == Reason::NoneInstalled {
        warn!(backend = %d.backend, reason = %d.reason, "Using the plain iptables tools");
    } else {
        info!(backend = %d.backend, reason = %d.reason, "Chose the iptables backend");
    }
    d.backend
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Fixture tools: what each `program args` prints, which programs exist, and every call.
    #[derive(Default)]
    struct Fixture {
        installed: Vec<&'static str>,
        outputs: BTreeMap<String, String>,
        calls: Vec<String>,
        /// The chains of the nft backend that netlink reports (`None`: it cannot be asked).
        netlink: Option<Vec<(IpFamily, &'static str, &'static str)>>,
    }

    impl Fixture {
        fn both() -> Fixture {
            Fixture {
                installed: vec!["iptables-legacy-save", "iptables-nft-save"],
                ..Fixture::default()
            }
        }

        fn with(mut self, command: &str, output: &str) -> Fixture {
            self.outputs.insert(command.to_string(), output.to_string());
            self
        }
    }

    impl Tools for Fixture {
        fn installed(&mut self, program: &str) -> bool {
            self.installed.contains(&program)
        }

        fn output(&mut self, program: &str, args: &[&str]) -> String {
            let command = [program].iter().chain(args).copied().collect::<Vec<_>>().join(" ");
            self.calls.push(command.clone());
            self.outputs.get(&command).cloned().unwrap_or_default()
        }

        fn nft_chain_exists(&mut self, family: IpFamily, table: &str, chain: &str) -> Option<bool> {
            let chains = self.netlink.as_ref()?;
            Some(chains.contains(&(family, table, chain)))
        }
    }

    #[test]
    fn kubelets_nft_chains_are_asked_over_netlink_without_a_dump() {
        let mut t = Fixture::both().with("iptables-legacy-save", THREE_RULES);
        t.netlink = Some(vec![(IpFamily::V6, "mangle", "KUBE-KUBELET-CANARY")]);
        let d = detect(&mut t);
        assert_eq!(
            d.reason,
            Reason::KubeletChain {
                backend: Backend::Nft,
                family: IpFamily::V6,
                chain: "KUBE-KUBELET-CANARY"
            }
        );
        assert!(t.calls.is_empty(), "no dump: {:?}", t.calls);
        // Nothing in the nft backend: on to legacy's dumps, still without nft's mangle dump.
        let mut t = Fixture::both().with("iptables-legacy-save", CANARY_ONLY);
        t.netlink = Some(Vec::new());
        assert_eq!(detect(&mut t).backend, Backend::Legacy);
        assert!(
            !t.calls.iter().any(|c| c.contains("nft-save -t mangle")),
            "{:?}",
            t.calls
        );
    }

    const KUBELET_MANGLE: &str =
        "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
    const CANARY_ONLY: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
    const THREE_RULES: &str = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n-A INPUT -i lo -j ACCEPT\n-A INPUT -p tcp --dport 22 -j ACCEPT\n-A FORWARD -j DROP\nCOMMIT\n";
    const ONE_RULE: &str = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\nCOMMIT\n";

    fn chose(d: &Detection) -> (Backend, String) {
        (d.backend, d.reason.to_string())
    }

    #[test]
    fn in_use_is_the_nft_backend_holding_our_canary_without_a_full_dump() {
        let ours = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n";
        let mut t = Fixture::both().with("iptables-nft-save -t mangle", ours);
        assert_eq!(in_use(&mut t), Backend::Nft);
        assert_eq!(t.calls, ["iptables-nft-save -t mangle"]);
        // Not there: the daemon's own choice (here the backend with more rules).
        let mut t = Fixture::both().with("iptables-legacy-save", THREE_RULES);
        assert_eq!(in_use(&mut t), Backend::Legacy);
    }

    #[test]
    fn kubelet_chains_in_nft_mangle_win_even_against_more_legacy_rules() {
        let mut t = Fixture::both()
            .with("iptables-nft-save -t mangle", KUBELET_MANGLE)
            .with("iptables-legacy-save", THREE_RULES);
        let d = detect(&mut t);
        assert_eq!(
            d.reason,
            Reason::KubeletChain {
                backend: Backend::Nft,
                family: IpFamily::V4,
                chain: "KUBE-IPTABLES-HINT"
            }
        );
        assert_eq!(d.backend, Backend::Nft);
        assert_eq!(t.calls, ["iptables-nft-save -t mangle"], "stops at the first finding");
    }

    #[test]
    fn kubelet_chains_in_ipv6_count_too() {
        let mut t = Fixture::both().with("ip6tables-nft-save -t mangle", KUBELET_MANGLE);
        assert_eq!(detect(&mut t).backend, Backend::Nft);
        let mut t = Fixture::both()
            .with("ip6tables-legacy-save", CANARY_ONLY)
            .with("iptables-nft-save", THREE_RULES);
        let d = detect(&mut t);
        assert_eq!(
            chose(&d),
            (
                Backend::Legacy,
                "kubelet's chain KUBE-KUBELET-CANARY is in the legacy backend (IPv6)".to_string()
            )
        );
    }

    #[test]
    fn legacy_kubelet_chains_win_over_more_nft_rules_and_legacy_is_read_whole() {
        let mut t = Fixture::both()
            .with("iptables-legacy-save", KUBELET_MANGLE)
            .with("iptables-nft-save", THREE_RULES);
        assert_eq!(detect(&mut t).backend, Backend::Legacy);
        assert!(
            !t.calls.iter().any(|c| c.starts_with("iptables-legacy-save -t")),
            "asking legacy for one table would create it: {:?}",
            t.calls
        );
    }

    #[test]
    fn without_kubelet_chains_the_backend_with_more_rules_wins() {
        let mut t = Fixture::both()
            .with("iptables-legacy-save", THREE_RULES)
            .with("ip6tables-nft-save", ONE_RULE);
        assert_eq!(
            chose(&detect(&mut t)),
            (
                Backend::Legacy,
                "no kubelet chain; 3 rules in legacy, 1 in nft".to_string()
            )
        );
        // Rules of both families add up: 1 + 3 nft against 3 legacy.
        let mut t = Fixture::both()
            .with("iptables-legacy-save", THREE_RULES)
            .with("iptables-nft-save", ONE_RULE)
            .with("ip6tables-nft-save", THREE_RULES);
        assert_eq!(detect(&mut t).backend, Backend::Nft);
        // A tie goes to nft, as nothing at all does.
        let mut t = Fixture::both()
            .with("iptables-legacy-save", ONE_RULE)
            .with("iptables-nft-save", ONE_RULE);
        assert_eq!(detect(&mut t).backend, Backend::Nft);
        // No legacy rules: nft, without a dump of it.
        let mut t = Fixture::both().with("iptables-nft-save", ONE_RULE);
        let d = detect(&mut t);
        assert_eq!(
            chose(&d),
            (
                Backend::Nft,
                "no kubelet chain and no rules in legacy: nft by default".to_string()
            )
        );
        assert!(!t.calls.iter().any(|c| c.ends_with("nft-save")), "{:?}", t.calls);
    }

    #[test]
    fn what_is_installed_decides_first() {
        let legacy_only = Fixture {
            installed: vec!["iptables-legacy-save"],
            ..Fixture::default()
        };
        let mut t = legacy_only.with("iptables-nft-save -t mangle", KUBELET_MANGLE);
        let d = detect(&mut t);
        assert_eq!((d.backend, d.reason), (Backend::Legacy, Reason::OnlyInstalled));
        assert!(t.calls.is_empty(), "{:?}", t.calls);
        let nft_only = Fixture {
            installed: vec!["iptables-nft-save"],
            ..Fixture::default()
        };
        let mut t = nft_only.with("iptables-legacy-save", THREE_RULES);
        assert_eq!(detect(&mut t).backend, Backend::Nft);
        let d = detect(&mut Fixture::default());
        assert_eq!((d.backend, d.reason), (Backend::Plain, Reason::NoneInstalled));
    }

    #[test]
    fn tool_names_per_backend_and_family() {
        assert_eq!(
            Backend::Legacy.tool(IpFamily::V4, "-restore"),
            "iptables-legacy-restore"
        );
        assert_eq!(Backend::Nft.tool(IpFamily::V6, "-save"), "ip6tables-nft-save");
        assert_eq!(Backend::Plain.tool(IpFamily::V6, ""), "ip6tables");
    }

    #[test]
    fn chain_declarations_only() {
        // A rule that merely mentions the name, or a longer name, is not kubelet's chain.
        assert_eq!(
            kubelet_chain("-A X -j KUBE-KUBELET-CANARY\n:KUBE-IPTABLES-HINTS - [0:0]\n"),
            None
        );
        assert_eq!(
            kubelet_chain(":KUBE-KUBELET-CANARY - [0:0]"),
            Some("KUBE-KUBELET-CANARY")
        );
        assert_eq!(rule_count(THREE_RULES), 3);
        assert_eq!(rule_count(""), 0);
    }
}
