//! A simulated CNI/firewall agent in a namespace: it keeps adding and removing rules of its
//! own in nat and filter — in chains of its own and in the built-in chains we also jump from —
//! and in an nftables table of its own, remembering what it wrote. [`Agent::check`] reads the
//! kernel back and says where it differs from what the agent believes (a rule lost or
//! duplicated). Its rules match only sources in 192.0.2.0/24 (TEST-NET-1), which no test bed
//! sends from, so they never change where test traffic goes.

use std::collections::{BTreeMap, BTreeSet};

use kube_proxy::lab::netns::Netns;

/// The chains the agent writes to, per table: built-in ones and its own.
const CHAINS: &[(&str, &str)] = &[
    ("nat", "PREROUTING"),
    ("nat", "OUTPUT"),
    ("nat", "POSTROUTING"),
    ("nat", "AGENT-NAT"),
    ("filter", "INPUT"),
    ("filter", "FORWARD"),
    ("filter", "OUTPUT"),
    ("filter", "AGENT-FILTER"),
];

/// Rules per chain the agent chooses among (each is there or not).
const SLOTS: u32 = 12;

/// Its nftables table (`inet`, so beside both families' tables of ours).
const TABLE: &str = "cni-agent";

pub struct Agent<'a> {
    ns: &'a Netns,
    rng: u64,
    /// Per chain (index in [`CHAINS`]), the slots that hold a rule.
    iptables: Vec<BTreeSet<u32>>,
    /// nftables slot → rule handle.
    nft: BTreeMap<u32, u64>,
    /// Writes done so far.
    pub ops: usize,
}

fn comment(chain: &str, k: u32) -> String {
    format!("agent-{chain}-{k}")
}

impl<'a> Agent<'a> {
    /// Creates the agent's chains (with a jump from PREROUTING and FORWARD, as a CNI has) and
    /// its nftables table.
    pub fn install(ns: &'a Netns, seed: u64) -> Agent<'a> {
        for (table, chain, from) in [
            ("nat", "AGENT-NAT", "PREROUTING"),
            ("filter", "AGENT-FILTER", "FORWARD"),
        ] {
            ns.exec_ok("iptables", ["-w", "-t", table, "-N", chain])
                .expect("agent chain");
            ns.exec_ok(
                "iptables",
                [
                    "-w",
                    "-t",
                    table,
                    "-A",
                    from,
                    "-m",
                    "comment",
                    "--comment",
                    &comment(from, 999),
                    "-j",
                    chain,
                ],
            )
            .expect("agent jump");
        }
        ns.exec_ok("nft", ["add", "table", "inet", TABLE]).expect("agent table");
        ns.exec_ok(
            "nft",
            ["add chain inet cni-agent input { type filter hook input priority 10; policy accept; }"],
        )
        .expect("agent base chain");
        let mut iptables = vec![BTreeSet::new(); CHAINS.len()];
        iptables[0].insert(999);
        iptables[5].insert(999);
        Agent {
            ns,
            rng: seed | 1,
            iptables,
            nft: BTreeMap::new(),
            ops: 0,
        }
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn rule(chain: &str, k: u32) -> Vec<String> {
        let target = if chain.starts_with("AGENT") || chain == "FORWARD" {
            "RETURN"
        } else {
            "ACCEPT"
        };
        [
            "-s",
            &format!("192.0.2.{k}/32"),
            "-m",
            "comment",
            "--comment",
            &comment(chain, k),
            "-j",
            target,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// One write: a rule added (at the top or the end of its chain) or removed, in iptables
    /// or in the agent's table. A rule it cannot remove was lost: that is the error; any
    /// other refused write is a failure of the test.
    pub fn step(&mut self) -> Result<(), String> {
        let r = self.next();
        let k = (r >> 8) as u32 % SLOTS;
        let which = (r % (CHAINS.len() as u64 + 1)) as usize;
        self.ops += 1;
        if which == CHAINS.len() {
            self.step_nft(k);
            return Ok(());
        }
        let (table, chain) = CHAINS[which];
        let mut args: Vec<String> = ["-w", "-t", table].iter().map(|s| s.to_string()).collect();
        let present = self.iptables[which].contains(&k);
        args.push(
            if present {
                "-D"
            } else if r & 0x10 != 0 {
                "-I"
            } else {
                "-A"
            }
            .into(),
        );
        args.push(chain.into());
        args.extend(Self::rule(chain, k));
        let done = self.ns.exec_ok("iptables", &args);
        if present {
            self.iptables[which].remove(&k);
            done.map_err(|e| format!("{table} {chain}: rule {k} lost (removing it failed: {e:#})"))?;
        } else {
            done.unwrap_or_else(|e| panic!("agent: iptables {args:?}: {e:#}"));
            self.iptables[which].insert(k);
        }
        Ok(())
    }

    fn step_nft(&mut self, k: u32) {
        if let Some(handle) = self.nft.remove(&k) {
            self.ns
                .exec_ok(
                    "nft",
                    ["delete", "rule", "inet", TABLE, "input", "handle", &handle.to_string()],
                )
                .unwrap_or_else(|e| panic!("agent: nft delete rule {k}: {e:#}"));
            return;
        }
        let rule = format!(
            "add rule inet {TABLE} input ip saddr 192.0.2.{k} counter accept comment \"{}\"",
            comment("nft", k)
        );
        // Not `nft -e -a add rule`: echoing the handle makes nft fetch every table first,
        // tens of seconds beside iptables-nft's 10,000-Service nat table; listing the chain
        // after costs nothing.
        self.ns
            .exec_ok("nft", [&rule])
            .unwrap_or_else(|e| panic!("agent: nft {rule}: {e:#}"));
        let listed = self
            .ns
            .exec_ok("nft", ["-a", "list", "chain", "inet", TABLE, "input"])
            .unwrap_or_else(|e| panic!("agent: nft list chain: {e:#}"));
        let tag = format!("comment \"{}\" # handle ", comment("nft", k));
        let handle = listed
            .lines()
            .find_map(|l| l.split(&tag).nth(1))
            .and_then(|h| h.trim().parse().ok())
            .unwrap_or_else(|| panic!("agent: no handle for rule {k} in {listed:?}"));
        self.nft.insert(k, handle);
    }

    /// What the kernel holds of the agent's rules against what it believes: one line per
    /// difference (lost, duplicated or unexpected), none when they agree.
    pub fn check(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for table in ["nat", "filter"] {
            // Its chains one by one: `iptables-save` of a table with 10,000 Services takes
            // seconds, in which the agent would write nothing.
            let mut saved = String::new();
            for (_, chain) in CHAINS.iter().filter(|(t, _)| *t == table) {
                let listed = self.ns.exec_ok("iptables", ["-w", "-t", table, "-S", chain]);
                saved.push_str(&listed.unwrap_or_else(|e| panic!("agent: iptables -S {chain}: {e:#}")));
            }
            let mut seen: BTreeMap<(String, u32), usize> = BTreeMap::new();
            for line in saved.lines().filter(|l| l.contains("--comment agent-")) {
                let chain = line.split_whitespace().nth(1).unwrap_or_default();
                let k = line
                    .split("--comment agent-")
                    .nth(1)
                    .and_then(|c| c.split_whitespace().next())
                    .and_then(|c| c.rsplit('-').next())
                    .and_then(|k| k.parse().ok())
                    .unwrap_or(u32::MAX);
                *seen.entry((chain.to_string(), k)).or_default() += 1;
            }
            for (i, (t, chain)) in CHAINS.iter().enumerate().filter(|(_, (t, _))| *t == table) {
                for k in &self.iptables[i] {
                    match seen.remove(&(chain.to_string(), *k)) {
                        Some(1) => {}
                        None => problems.push(format!("{t} {chain}: rule {k} lost")),
                        Some(n) => problems.push(format!("{t} {chain}: rule {k} {n} times")),
                    }
                }
            }
            for ((chain, k), n) in seen {
                problems.push(format!("{table} {chain}: rule {k} there {n} times, not written"));
            }
        }
        let listed = self
            .ns
            .exec_ok("nft", ["-a", "list", "table", "inet", TABLE])
            .unwrap_or_else(|e| format!("no table: {e:#}"));
        let mut handles: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for line in listed.lines().filter(|l| l.contains("comment \"agent-nft-")) {
            let k = line
                .split("agent-nft-")
                .nth(1)
                .and_then(|c| c.split('"').next())
                .and_then(|k| k.parse().ok());
            let h = line.rsplit("# handle ").next().and_then(|h| h.trim().parse().ok());
            if let (Some(k), Some(h)) = (k, h) {
                handles.entry(k).or_default().push(h);
            }
        }
        if !listed.contains("hook input priority") {
            problems.push(format!("nftables: the agent's base chain is gone:\n{listed}"));
        }
        for (k, h) in &self.nft {
            match handles.remove(k) {
                Some(hs) if hs == [*h] => {}
                got => problems.push(format!("nftables: rule {k} (handle {h}) found as {got:?}")),
            }
        }
        for (k, hs) in handles {
            problems.push(format!("nftables: rule {k} there as {hs:?}, not written"));
        }
        problems
    }

    /// How many rules the agent holds now.
    pub fn rules(&self) -> usize {
        self.iptables.iter().map(BTreeSet::len).sum::<usize>() + self.nft.len()
    }
}
