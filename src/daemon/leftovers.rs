//! Mode switches that lose nothing: what the other proxy modes left on the node is found at
//! start ([`OtherModes::find`]), before the running mode touches anything, and removed by the
//! loop only after the first sync in which every family of the running mode succeeded; what
//! cannot go yet is re-checked every sync period until nothing is left. The loop drives this
//! through the [`Leftovers`] edge ([`RecordingLeftovers`] in its tests). Upstream removes the
//! other modes' rules at start, which leaves the node without rules until its first sync.
//!
//! Why the two rule sets may coexist until then, for each switch (the e2e and VM tests send
//! new connections and a long-lived stream across each of them):
//! - **iptables ↔ nftables.** Both DNAT a new connection at the same hook (nat PREROUTING /
//!   OUTPUT, priority dstnat), each to a valid endpoint: the first chain that NATs it decides,
//!   the other is skipped for it. Established connections keep the NAT binding of their
//!   conntrack entry when the old rules go.
//! - **iptables → IPVS.** IPVS mode's first sync binds the addresses to `kube-ipvs0` and adds
//!   the virtual servers before it rewrites the chains the two modes share (KUBE-SERVICES,
//!   KUBE-POSTROUTING, KUBE-MARK-MASQ, KUBE-FORWARD, KUBE-PROXY-FIREWALL), so a new connection
//!   meets iptables mode's DNAT until the nat table is swapped in one commit, and IPVS after.
//!   Then iptables mode's own chains (KUBE-SVC-…, KUBE-NODEPORTS, the canaries, …) and the jump
//!   rules IPVS mode does not have go; the shared ones are IPVS mode's now and stay.
//! - **IPVS → iptables or nftables.** The new mode DNATs new connections before routing, so
//!   they never reach IPVS, although their ClusterIP is still local on `kube-ipvs0`. An
//!   established connection through IPVS is handled at LOCAL_IN from IPVS's connection table,
//!   which needs its virtual server and the address on `kube-ipvs0` (see
//!   [`crate::ipvs::cleanup`] for what the VM showed without either). So the virtual servers
//!   that still carry connections, and their addresses, stay until those close; the others, IPVS
//!   mode's ipsets and iptables rules go at once, but for the chains and jumps iptables mode
//!   now uses under the same names.
//!
//! - **The iptables backend not chosen.** Rules of ours in the backend the daemon did not choose
//!   (legacy or nft: `iptables::backend`) were left by a run that programmed the other one (an
//!   earlier image whose backend script kubeadm's `command:` bypassed): their DNAT could still
//!   catch new connections. They go like another mode's rules, once ours are in place; kubelet's
//!   chains there stay.
//!
//! While a ClusterIP stays bound for a draining connection, the node's own services answer
//! on it (IPVS mode's KUBE-IPVS-FILTER, which rejected that, went with the other rules).
//! `--cleanup` removes everything at once ([`super::modes::cleanup_all`]).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tracing::{info, warn};

use super::modes::{families, open_ipvs, remove_nftables_table};
use crate::config::ProxyMode;
use crate::iptables::backend::Backend;
use crate::iptables::exec::{Exec, Iptables};
use crate::iptables::names::{KUBE_FIREWALL, is_service_chain};
use crate::iptables::render::jump_rules;
use crate::iptables::replace::fixed_chains;
use crate::ipvs::cleanup::{self as ipvs_cleanup, IptablesFootprint, iptables_present, remove_iptables};
use crate::ipvs::host::{HostExec, IpvsHost as _};
use crate::ipvs::names::DUMMY_DEVICE;
use crate::ipvs::netlink::Ipvs;
use crate::model::IpFamily;
use crate::nftables::proxier as nft;

/// What the other modes left, removed once the running mode is programmed.
pub trait Leftovers: Send {
    /// Removes what can go now; what is still left, one line each (empty: nothing, and the
    /// loop stops asking).
    fn remove(&mut self) -> Vec<String>;
}

/// iptables mode's rules: its fixed chains in nat, filter and mangle (the canary), its
/// per-service chains in nat, and its jump rules. KUBE-FIREWALL is kubelet's too: neither the
/// chain nor the jumps to it are removed.
pub fn iptables_footprint() -> IptablesFootprint {
    fn owns(table: &str, chain: &str) -> bool {
        fixed_chains(table).contains(&chain) || (table == "nat" && is_service_chain(chain))
    }
    IptablesFootprint {
        tables: &["nat", "filter", "mangle"],
        owns,
        jumps: jump_rules()
            .into_iter()
            .filter(|j| j.args.last().map(String::as_str) != Some(KUBE_FIREWALL))
            .collect(),
    }
}

/// The iptables rules of the running mode, which removing another mode's leaves alone.
pub fn kept(running: ProxyMode) -> IptablesFootprint {
    match running {
        ProxyMode::Iptables => iptables_footprint(),
        ProxyMode::Ipvs => IptablesFootprint::ipvs(),
        ProxyMode::Nftables => IptablesFootprint::none(),
    }
}

/// The other modes' state on this node, as found at start.
#[derive(Debug)]
pub struct OtherModes {
    running: ProxyMode,
    /// The iptables backend chosen at start (every iptables call goes there).
    backend: Backend,
    /// Families whose nftables mode table is still there.
    nftables: Vec<IpFamily>,
    /// IPVS mode left state (`kube-ipvs0`, or its iptables chains).
    ipvs: bool,
    /// Families in which iptables mode left rules that the running mode does not have.
    iptables: Vec<IpFamily>,
    /// Families in which the backend not chosen holds rules of ours (either mode's).
    stale_backend: Vec<(Backend, IpFamily)>,
}

impl OtherModes {
    /// Looks for the state of the modes other than `running`; None when there is none. Call
    /// it before the running mode's first sync: afterwards the shared chains are the running
    /// mode's.
    pub fn find(running: ProxyMode, backend: Backend) -> Option<Box<dyn Leftovers>> {
        let nftables = if running == ProxyMode::Nftables {
            Vec::new()
        } else {
            [IpFamily::V4, IpFamily::V6]
                .into_iter()
                .filter(|&f| nft::table_exists(f))
                .collect()
        };
        let ipvs = running != ProxyMode::Ipvs && ipvs_present(backend);
        let iptables = if running == ProxyMode::Iptables {
            Vec::new()
        } else {
            // Rules of its own (KUBE-SVC-…, KUBE-NODEPORTS, the canaries): the shared chains
            // alone may be IPVS mode's.
            let (ours, beyond) = (iptables_footprint(), IptablesFootprint::ipvs());
            families(ProxyMode::Iptables, backend)
                .into_iter()
                .filter(|&f| iptables_present(&mut Exec::new(backend, f), &ours, &beyond))
                .collect()
        };
        let found = OtherModes {
            running,
            backend,
            nftables,
            ipvs,
            iptables,
            stale_backend: stale_backend(backend),
        };
        let modes = found.modes();
        if modes.is_empty() {
            return None;
        }
        info!(
            modes = modes.join(", "),
            "Found the rules of another proxy mode; removing them once this mode's rules are in place"
        );
        Some(Box::new(found))
    }

    fn modes(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if !self.nftables.is_empty() {
            v.push("nftables");
        }
        if self.ipvs {
            v.push("ipvs");
        }
        if !self.iptables.is_empty() {
            v.push("iptables");
        }
        if !self.stale_backend.is_empty() {
            v.push("our rules in the iptables backend not chosen");
        }
        v
    }

    /// IPVS mode's part; what is left of it.
    fn remove_ipvs(&self) -> Vec<String> {
        let mut ipvs = open_ipvs();
        // Which virtual servers still carry connections: without the table, none can go.
        let live = if ipvs.is_some() {
            match std::fs::read_to_string(ipvs_cleanup::CONNECTION_TABLE) {
                Ok(table) => ipvs_cleanup::live_connections(&table),
                Err(e) => return vec![format!("IPVS mode: reading {}: {e}", ipvs_cleanup::CONNECTION_TABLE)],
            }
        } else {
            Default::default()
        };
        let backend = self.backend;
        let mut ipts: Vec<Exec> = families(ProxyMode::Ipvs, backend)
            .into_iter()
            .map(|f| Exec::new(backend, f))
            .collect();
        let mut refs: Vec<&mut dyn Iptables> = ipts.iter_mut().map(|i| i as &mut dyn Iptables).collect();
        let removal = ipvs_cleanup::remove(
            ipvs.as_mut().map(|h| h as &mut dyn Ipvs),
            &live,
            &mut refs,
            &mut HostExec,
            true,
            &kept(self.running),
        );
        let mut left: Vec<String> = removal
            .draining
            .iter()
            .map(|(vs, n)| format!("IPVS virtual server {vs} ({n} open connection{})", plural(*n)))
            .collect();
        left.extend(removal.errors.iter().map(|e| format!("IPVS mode: {e}")));
        left
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The families in which the backend other than `chosen` holds chains of ours. Read with a
/// whole `iptables-save` (one table's would create it in a backend the kernel does not use).
fn stale_backend(chosen: Backend) -> Vec<(Backend, IpFamily)> {
    let other = match chosen {
        Backend::Legacy => Backend::Nft,
        Backend::Nft => Backend::Legacy,
        Backend::Plain => return Vec::new(),
    };
    families(ProxyMode::Iptables, other)
        .into_iter()
        .filter(|&f| {
            let saved = crate::exec::run(&other.tool(f, "-save"), &[] as &[&str], None).unwrap_or_default();
            holds_ours(&saved)
        })
        .map(|f| (other, f))
        .collect()
}

/// Whether an `iptables-save` output declares a chain of iptables or IPVS mode.
fn holds_ours(saved: &str) -> bool {
    let (ipt, ipvs) = (iptables_footprint(), IptablesFootprint::ipvs());
    let mut table = "";
    saved.lines().any(|line| {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim();
            return false;
        }
        let Some(chain) = line.strip_prefix(':').and_then(|r| r.split_whitespace().next()) else {
            return false;
        };
        (ipt.owns)(table, chain) || (ipvs.owns)(table, chain)
    })
}

/// Whether IPVS mode left state: `kube-ipvs0`, or its iptables rules in a family.
fn ipvs_present(backend: Backend) -> bool {
    HostExec.link_exists(DUMMY_DEVICE).unwrap_or(false)
        || families(ProxyMode::Ipvs, backend)
            .into_iter()
            .any(|f| ipvs_cleanup::iptables_state_present(&mut Exec::new(backend, f)))
}

impl Leftovers for OtherModes {
    fn remove(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        self.nftables.retain(|&family| match remove_nftables_table(family) {
            Ok(()) => {
                info!(ip_family = %family, "Removed the nftables mode's table");
                false
            }
            Err(e) => {
                left.push(format!("nftables mode ({family}): {e}"));
                true
            }
        });
        // IPVS mode's rules before iptables mode's: where both left some, the shared chains
        // are flushed by the first and deleted by the second.
        if self.ipvs {
            let ipvs_left = self.remove_ipvs();
            if ipvs_left.is_empty() {
                info!("Removed the IPVS mode's virtual servers, iptables rules, ipsets and kube-ipvs0");
                self.ipvs = false;
            }
            left.extend(ipvs_left);
        }
        let (ours, kept, backend) = (iptables_footprint(), kept(self.running), self.backend);
        self.iptables.retain(|&family| {
            let errors = remove_iptables(&mut Exec::new(backend, family), &ours, &kept);
            if errors.is_empty() {
                info!(ip_family = %family, "Removed the iptables mode's rules");
            }
            for e in &errors {
                left.push(format!("iptables mode ({family}): {e}"));
            }
            !errors.is_empty()
        });
        self.stale_backend.retain(|&(other, family)| {
            let mut ipt = Exec::new(other, family);
            let mut errors = remove_iptables(&mut ipt, &iptables_footprint(), &IptablesFootprint::none());
            errors.extend(remove_iptables(
                &mut ipt,
                &IptablesFootprint::ipvs(),
                &IptablesFootprint::none(),
            ));
            if errors.is_empty() {
                info!(backend = %other, ip_family = %family, "Removed our rules from the iptables backend not chosen");
            }
            for e in &errors {
                left.push(format!("iptables backend {other} ({family}): {e}"));
            }
            !errors.is_empty()
        });
        if !left.is_empty() {
            warn_failures(&left);
        }
        left
    }
}

/// Failures (not draining connections) are worth a warning of their own.
fn warn_failures(left: &[String]) {
    for l in left.iter().filter(|l| !l.starts_with("IPVS virtual server ")) {
        warn!("Could not remove the rules of another proxy mode (retrying every sync period): {l}");
    }
}

/// What a [`RecordingLeftovers`] saw: each call's time and what `observe` said then.
#[derive(Debug, Default)]
pub struct LeftoverRecord {
    pub calls: Vec<(Instant, String)>,
    /// What the next calls answer, in turn; once they are used up, nothing is left.
    pub answers: Vec<Vec<String>>,
}

type Observer = Arc<dyn Fn() -> String + Send + Sync>;

/// Leftovers that record when they were asked to go, and what `observe` (a test's view of the
/// rest of the node, e.g. whether the fake proxier was programmed) said at that moment. Clones
/// share the record.
#[derive(Clone)]
pub struct RecordingLeftovers {
    record: Arc<Mutex<LeftoverRecord>>,
    observe: Observer,
}

impl RecordingLeftovers {
    /// Answers `answers` in turn (then nothing left), recording `observe()` at each call.
    pub fn new(answers: Vec<Vec<String>>, observe: impl Fn() -> String + Send + Sync + 'static) -> Self {
        RecordingLeftovers {
            record: Arc::new(Mutex::new(LeftoverRecord {
                calls: Vec::new(),
                answers,
            })),
            observe: Arc::new(observe),
        }
    }

    pub fn record(&self) -> MutexGuard<'_, LeftoverRecord> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Leftovers for RecordingLeftovers {
    fn remove(&mut self) -> Vec<String> {
        let seen = (self.observe)();
        let mut r = self.record();
        r.calls.push((tokio::time::Instant::now().into_std(), seen));
        if r.answers.is_empty() {
            Vec::new()
        } else {
            r.answers.remove(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::exec::Fake;

    /// nat and filter after IPVS mode's first sync over iptables mode's rules (shortened): the
    /// shared chains and jumps hold IPVS mode's rules now.
    const IPVS_OVER_IPTABLES_NAT: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
        :POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n\
        :KUBE-MARK-MASQ - [0:0]\n:KUBE-NODE-PORT - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n\
        :KUBE-NODEPORTS - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-SVC-ABC - [0:0]\n:KUBE-SEP-DEF - [0:0]\n\
        -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
        -A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n\
        -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
        -A KUBE-SVC-ABC -j KUBE-SEP-DEF\n-A KUBE-SEP-DEF -s 10.244.1.2/32 -j KUBE-MARK-MASQ\n\
        -A KUBE-SEP-DEF -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080\nCOMMIT\n";

    const IPVS_OVER_IPTABLES_FILTER: &str = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n\
        :OUTPUT ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n\
        :KUBE-IPVS-FILTER - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n\
        :KUBE-NODEPORTS - [0:0]\n:KUBE-FIREWALL - [0:0]\n\
        -A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\n\
        -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
        -A INPUT -j KUBE-FIREWALL\n\
        -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
        -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT\nCOMMIT\n";

    #[test]
    fn iptables_modes_own_chains_go_after_ipvs_mode_took_over_the_shared_ones() {
        let ours = iptables_footprint();
        let kept = kept(ProxyMode::Ipvs);
        assert_eq!(
            ours.removal_input("nat", IPVS_OVER_IPTABLES_NAT, &kept),
            "*nat\n:KUBE-NODEPORTS - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-SVC-ABC - [0:0]\n\
             :KUBE-SEP-DEF - [0:0]\n-X KUBE-NODEPORTS\n-X KUBE-PROXY-CANARY\n-X KUBE-SVC-ABC\n\
             -X KUBE-SEP-DEF\nCOMMIT\n",
            "KUBE-SERVICES, KUBE-POSTROUTING, KUBE-MARK-MASQ and the nat jumps are IPVS mode's"
        );
        assert_eq!(
            ours.removal_input("filter", IPVS_OVER_IPTABLES_FILTER, &kept),
            "*filter\n\
             -D INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
             -D FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             :KUBE-SERVICES - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n\
             -X KUBE-SERVICES\n-X KUBE-EXTERNAL-SERVICES\n-X KUBE-NODEPORTS\nCOMMIT\n",
            "KUBE-FORWARD and its jump are IPVS mode's; KUBE-FIREWALL is kubelet's"
        );
    }

    #[test]
    fn ipvs_modes_own_chains_go_after_iptables_mode_took_over_the_shared_ones() {
        // nat after iptables mode's first sync over IPVS mode's rules.
        let nat = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n\
                   :KUBE-MARK-MASQ - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
                   :KUBE-LOAD-BALANCER - [0:0]\n:KUBE-SVC-ABC - [0:0]\n\
                   -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                   -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-ABC\n\
                   -A KUBE-SVC-ABC -j KUBE-MARK-MASQ\n\
                   -A KUBE-NODE-PORT -p tcp -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ\nCOMMIT\n";
        let ipvs = IptablesFootprint::ipvs();
        let kept = kept(ProxyMode::Iptables);
        assert_eq!(
            ipvs.removal_input("nat", nat, &kept),
            "*nat\n:KUBE-NODE-PORT - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n-X KUBE-NODE-PORT\n\
             -X KUBE-LOAD-BALANCER\nCOMMIT\n"
        );
        // With nftables mode running, everything of IPVS mode goes, shared names included.
        let all = ipvs.removal_input("nat", nat, &kept_none());
        assert!(
            all.contains("-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
                && all.contains(":KUBE-SERVICES - [0:0]\n"),
            "{all}"
        );
    }

    fn kept_none() -> IptablesFootprint {
        kept(ProxyMode::Nftables)
    }

    #[test]
    fn nothing_left_means_no_restore() {
        let mut ipt = Fake::default();
        ipt.saved
            .insert("nat".into(), "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n".into());
        let ours = iptables_footprint();
        let kept = kept(ProxyMode::Ipvs);
        assert!(
            !iptables_present(&mut ipt, &ours, &kept),
            "KUBE-SERVICES is IPVS mode's"
        );
        assert!(remove_iptables(&mut ipt, &ours, &kept).is_empty());
        assert!(ipt.restores.is_empty());
        assert!(
            iptables_present(&mut ipt, &ours, &kept_none()),
            "nftables mode has none"
        );
    }

    #[test]
    fn the_recording_fake_answers_in_turn() {
        let mut fake = RecordingLeftovers::new(vec![vec!["a".into()]], || "seen".into());
        assert_eq!(fake.remove(), vec!["a".to_string()]);
        assert!(fake.remove().is_empty());
        assert_eq!(fake.record().calls.len(), 2);
        assert_eq!(fake.record().calls[0].1, "seen");
    }
}
