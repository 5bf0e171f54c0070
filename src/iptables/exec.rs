//! The edge to the kernel for the iptables dataplane: `iptables-restore`, `iptables-save` and
//! `iptables` of the chosen backend (`iptables-nft-restore`, `ip6tables-legacy-save`, ...; see
//! [`super::backend`]) executed directly (never through a shell), behind a trait with a
//! recording fake.
//!
//! **How much one `iptables-restore` is given** ([`Iptables::batch_lines`]), measured at
//! 10,000 Services × 10 endpoints (110,000 chains, 434,000 lines) on our 2-core machine:
//! - iptables-nft 1.8.9 holds a whole input in memory until it exits (505–522 MiB for that
//!   input in flush mode), and with `--noflush` its time grows with the square of the input
//!   (an input of 2,500 Services took 238 s), while inputs of 50 Services (about 2,700 lines)
//!   each take 20–40 ms on the loaded table: all of it in 200 such runs took 6.5 s and at most
//!   6 MiB per run, against 16–45 s and 522 MiB for one flush-mode run of the whole;
//! - iptables-legacy rewrites the whole table blob at each commit (2 s and 336 MiB for one
//!   endpoint change on that table), so there each run is given much more.

use std::process::{Command, Stdio};

use super::backend::Backend;
use crate::exec;
use crate::model::IpFamily;

/// Failures of the iptables tools. The caller logs them, keeps the previous rules, and retries
/// with a full sync.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The tool could not be started (not installed, not root, ...).
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The tool ran and failed.
    #[error("{program} {args} failed ({status}): {stderr}{context}")]
    Failed {
        program: String,
        args: String,
        status: String,
        stderr: String,
        /// For `iptables-restore`: the offending line of the input and its neighbours.
        context: String,
    },
}

impl From<exec::Error> for ExecError {
    fn from(e: exec::Error) -> ExecError {
        match e {
            exec::Error::Spawn { program, source } => ExecError::Spawn { program, source },
            exec::Error::Failed {
                program,
                args,
                status,
                stderr,
            } => ExecError::Failed {
                program,
                args: args.join(" "),
                status: status.to_string(),
                stderr,
                context: String::new(),
            },
        }
    }
}

/// Lines of input per `iptables-restore` with iptables-nft (see the module documentation).
pub const NFT_BATCH_LINES: usize = 2_500;
/// Lines of input per `iptables-restore` with iptables-legacy.
pub const LEGACY_BATCH_LINES: usize = 100_000;

/// The iptables operations the proxier needs, for one IP family.
pub trait Iptables: Send {
    fn family(&self) -> IpFamily;
    /// `iptables-restore --noflush --counters` with `input` on stdin.
    fn restore(&mut self, input: &str) -> Result<(), ExecError>;
    /// About how many lines one [`Iptables::restore`] should be given: larger syncs are split
    /// into several (see the module documentation).
    fn batch_lines(&mut self) -> usize {
        NFT_BATCH_LINES
    }
    /// `iptables-save -t TABLE`.
    fn save(&mut self, table: &str) -> Result<String, ExecError>;
    /// `iptables-save -t TABLE`, each line handed to `each` as the tool prints it (a full sync
    /// reads the nat table this way: 33 MB at 10,000 Services × 10 endpoints).
    fn save_each(&mut self, table: &str, each: &mut dyn FnMut(&str)) -> Result<(), ExecError>;
    /// `iptables-save -c -t TABLE` (with counters: what `explain` shows).
    fn save_counters(&mut self, table: &str) -> Result<String, ExecError>;
    /// `iptables -t TABLE -S CHAIN -v`: the chain's rules with their counters, written as
    /// `iptables-save -c` writes them (`[pkts:bytes] -A CHAIN …`); None when there is no such
    /// chain.
    fn list_chain(&mut self, table: &str, chain: &str) -> Result<Option<String>, ExecError>;
    /// Whether [`Iptables::list_chain`] reads that chain only (iptables-nft: about 7 ms for a
    /// chain of a table of 110,000 chains), so that a few chains are cheaper read one by one
    /// than the whole table saved; iptables-legacy reads the whole table blob each time.
    fn lists_chains_alone(&mut self) -> bool {
        false
    }
    /// `table` as `iptables-save -c` writes it, read over nf_tables netlink a chain at a time
    /// ([`super::netlink_save`]; at 10,000 Services × 10 endpoints the nat table in about a
    /// third of the tool's time, the filter table in 1 ms instead of 2 s); None where that
    /// cannot be done (iptables-legacy, a rule of a shape it does not print), and the caller
    /// saves with the tool.
    fn save_over_netlink(&mut self, _table: &str) -> Option<String> {
        None
    }
    /// Creates `chain` in `table` if it does not exist; true if it was created.
    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, ExecError>;
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, ExecError>;
    /// `-C`: whether the rule exists.
    fn rule_exists(&mut self, table: &str, chain: &str, args: &[String]) -> Result<bool, ExecError>;
    /// Inserts the rule at the top of `chain` unless it exists; true if it was inserted.
    fn ensure_rule_first(&mut self, table: &str, chain: &str, args: &[String]) -> Result<bool, ExecError> {
        if self.rule_exists(table, chain, args)? {
            return Ok(false);
        }
        self.run(table, &["-I", chain], args)?;
        Ok(true)
    }
    /// `-D`; a rule that is not there is not an error.
    fn delete_rule(&mut self, table: &str, chain: &str, args: &[String]) -> Result<(), ExecError> {
        if self.rule_exists(table, chain, args)? {
            self.run(table, &["-D", chain], args)?;
        }
        Ok(())
    }
    /// Flushes and deletes a chain if it exists.
    fn delete_chain(&mut self, table: &str, chain: &str) -> Result<(), ExecError> {
        if self.chain_exists(table, chain)? {
            self.run(table, &["-F", chain], &[])?;
            self.run(table, &["-X", chain], &[])?;
        }
        Ok(())
    }
    /// Runs `iptables -w -t TABLE OP... ARGS...`.
    fn run(&mut self, table: &str, op: &[&str], args: &[String]) -> Result<String, ExecError>;
}

/// The real tools of one backend, for one family.
#[derive(Clone, Debug)]
pub struct Exec {
    backend: Backend,
    family: IpFamily,
    /// Lines per restore, when set or once known.
    batch: Option<usize>,
    /// Whether the tools are iptables-legacy, once known.
    legacy: Option<bool>,
}

impl Exec {
    pub fn new(backend: Backend, family: IpFamily) -> Exec {
        Exec {
            backend,
            family,
            batch: None,
            legacy: None,
        }
    }

    /// The same tools, with `lines` per restore instead of the backend's default (benchmarks).
    pub fn with_batch_lines(mut self, lines: usize) -> Exec {
        self.batch = Some(lines.max(1));
        self
    }

    fn tool(&self, suffix: &str) -> String {
        self.backend.tool(self.family, suffix)
    }

    /// Whether the tools are iptables-legacy (the plain tools are asked, once).
    fn legacy(&mut self) -> bool {
        let (backend, family) = (self.backend, self.family);
        *self.legacy.get_or_insert_with(|| match backend {
            Backend::Legacy => true,
            Backend::Nft => false,
            // `iptables-restore v1.8.9 (nf_tables)` or `(legacy)`.
            Backend::Plain => {
                exec::run(&backend.tool(family, "-restore"), &["--version"], None).is_ok_and(|v| v.contains("legacy"))
            }
        })
    }

    fn save_args(&self, args: Vec<String>) -> Result<String, ExecError> {
        Ok(exec::run(&self.tool("-save"), &args, None)?)
    }

    fn restore_args(&self, args: Vec<String>, input: &str) -> Result<(), ExecError> {
        let program = self.tool("-restore");
        let out = exec::output(&program, &args, Some(input))?;
        if out.status.success() {
            return Ok(());
        }
        Err(ExecError::Failed {
            context: restore_error_context(&out.stderr, input),
            program,
            args: args.join(" "),
            status: out.status.to_string(),
            stderr: out.stderr,
        })
    }

    /// Whether the backend's tools of the family are installed (dual-stack needs
    /// `ip6tables-…-restore`).
    pub fn available(backend: Backend, family: IpFamily) -> bool {
        let tool = Exec::new(backend, family).tool("-restore");
        Command::new(&tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

/// `iptables -S -v` output as `iptables-save -c` writes it: the rules only, their counters
/// (`-c PKTS BYTES`, before the target) moved to the front as `[PKTS:BYTES]`.
pub fn listed_as_saved(listed: &str) -> String {
    let mut out = String::new();
    for line in listed.lines().filter(|l| l.starts_with("-A ")) {
        match counters(line) {
            Some((at, len, pkts, bytes)) => {
                out.push_str(&format!("[{pkts}:{bytes}] {}{}", &line[..at], &line[at + len..]));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Where ` -c PKTS BYTES` is in a listed rule (the last such words, ahead of the target or
/// at the end: a comment could hold the same words, but in quotes before them), its length,
/// and the two numbers.
fn counters(line: &str) -> Option<(usize, usize, &str, &str)> {
    let mut end = line.len();
    while let Some(at) = line[..end].rfind(" -c ") {
        let rest = &line[at + 4..];
        let mut words = rest.splitn(3, ' ');
        let (pkts, bytes) = (words.next()?, words.next().unwrap_or(""));
        let numeric = |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit());
        let tail = words.next();
        if numeric(pkts) && numeric(bytes) && tail.is_none_or(|t| t.starts_with('-')) {
            return Some((at, 4 + pkts.len() + 1 + bytes.len(), pkts, bytes));
        }
        end = at;
    }
    None
}

/// The input lines around the line `iptables-restore` complained about ("line N failed").
pub fn restore_error_context(stderr: &str, input: &str) -> String {
    let line = stderr.split("line ").nth(1).and_then(|rest| {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<usize>().ok()
    });
    let Some(n) = line else { return String::new() };
    let lines: Vec<&str> = input.lines().collect();
    let from = n.saturating_sub(2).max(1);
    let to = (n + 1).min(lines.len());
    let mut s = String::from("\n");
    for i in from..=to {
        if let Some(l) = lines.get(i - 1) {
            s.push_str(&format!("{}{i}: {l}\n", if i == n { "> " } else { "  " }));
        }
    }
    s
}

impl Iptables for Exec {
    fn family(&self) -> IpFamily {
        self.family
    }

    fn restore(&mut self, input: &str) -> Result<(), ExecError> {
        self.restore_args(vec!["-w".to_string(), "--noflush".into(), "--counters".into()], input)
    }

    fn batch_lines(&mut self) -> usize {
        if let Some(lines) = self.batch {
            return lines;
        }
        let lines = if self.legacy() {
            LEGACY_BATCH_LINES
        } else {
            NFT_BATCH_LINES
        };
        *self.batch.get_or_insert(lines)
    }

    fn save(&mut self, table: &str) -> Result<String, ExecError> {
        self.save_args(vec!["-t".to_string(), table.to_string()])
    }

    fn save_each(&mut self, table: &str, each: &mut dyn FnMut(&str)) -> Result<(), ExecError> {
        Ok(exec::each_line(&self.tool("-save"), &["-t", table], each)?)
    }

    fn save_counters(&mut self, table: &str) -> Result<String, ExecError> {
        self.save_args(vec!["-c".to_string(), "-t".to_string(), table.to_string()])
    }

    fn list_chain(&mut self, table: &str, chain: &str) -> Result<Option<String>, ExecError> {
        let program = self.tool("");
        let args = ["-w", "-t", table, "-S", chain, "-v"];
        let out = exec::output(&program, &args, None)?;
        if out.status.success() {
            return Ok(Some(listed_as_saved(&out.stdout)));
        }
        // iptables-legacy: "No chain/target/match by that name"; iptables-nft names the chain
        // ("chain `X' in table `nat' is incompatible").
        if out.stderr.contains("No chain") || out.stderr.contains(&format!("`{chain}'")) {
            return Ok(None);
        }
        Err(ExecError::Failed {
            program,
            args: args.join(" "),
            status: out.status.to_string(),
            stderr: out.stderr,
            context: String::new(),
        })
    }

    fn lists_chains_alone(&mut self) -> bool {
        !self.legacy()
    }

    fn save_over_netlink(&mut self, table: &str) -> Option<String> {
        if self.legacy() {
            return None;
        }
        let saved = super::netlink_save::NetlinkSave::new(self.family)
            .map_err(super::netlink_save::SaveError::from)
            .and_then(|mut reader| reader.save(table));
        match saved {
            Ok(text) => Some(text.unwrap_or_default()),
            Err(e) => {
                tracing::debug!(table, error = %e, "reading the table over netlink failed; saving it with the tool");
                None
            }
        }
    }

    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, ExecError> {
        if self.chain_exists(table, chain)? {
            return Ok(false);
        }
        self.run(table, &["-N", chain], &[])?;
        Ok(true)
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, ExecError> {
        let program = self.tool("");
        let args: Vec<String> = ["-w", "-t", table, "-S", chain].iter().map(|s| s.to_string()).collect();
        Ok(exec::output(&program, &args, None)?.status.success())
    }
    fn rule_exists(&mut self, table: &str, chain: &str, args: &[String]) -> Result<bool, ExecError> {
        let program = self.tool("");
        let mut full: Vec<String> = ["-w", "-t", table, "-C", chain].iter().map(|s| s.to_string()).collect();
        full.extend(args.iter().cloned());
        Ok(exec::output(&program, &full, None)?.status.success())
    }

    fn run(&mut self, table: &str, op: &[&str], args: &[String]) -> Result<String, ExecError> {
        let program = self.tool("");
        let mut full: Vec<String> = vec!["-w".into(), "-t".into(), table.into()];
        full.extend(op.iter().map(|s| s.to_string()));
        full.extend(args.iter().cloned());
        Ok(exec::run(&program, &full, None)?)
    }
}

/// A recording fake: keeps every restore input and command, and can be told to fail.
#[derive(Clone, Debug, Default)]
pub struct Fake {
    pub family: Option<IpFamily>,
    pub restores: Vec<String>,
    /// Lines per restore ([`NFT_BATCH_LINES`] when unset).
    pub batch: Option<usize>,
    pub commands: Vec<String>,
    /// Chains per table (as `table/chain`) that exist.
    pub chains: std::collections::BTreeSet<String>,
    /// Rules ensured in built-in chains, as `table/chain args`.
    pub rules: std::collections::BTreeSet<String>,
    /// What `save` returns, per table.
    pub saved: std::collections::BTreeMap<String, String>,
    /// When set, the next restore fails with this stderr.
    pub fail_next_restore: Option<String>,
    /// When set, the restore after this many more fails (with this stderr).
    pub fail_restore_after: Option<(usize, String)>,
    /// What [`Iptables::lists_chains_alone`] answers.
    pub lists_chains_alone: bool,
}

impl Fake {
    /// Every restore input so far, one after the other (a sync split into several restores
    /// reads as one input).
    pub fn restored(&self) -> String {
        self.restores.concat()
    }
}

impl Iptables for Fake {
    fn family(&self) -> IpFamily {
        self.family.unwrap_or(IpFamily::V4)
    }

    fn restore(&mut self, input: &str) -> Result<(), ExecError> {
        if let Some((n, stderr)) = self.fail_restore_after.take() {
            if n == 0 {
                self.fail_next_restore = Some(stderr);
            } else {
                self.fail_restore_after = Some((n - 1, stderr));
            }
        }
        if let Some(stderr) = self.fail_next_restore.take() {
            return Err(ExecError::Failed {
                context: restore_error_context(&stderr, input),
                program: "iptables-restore".into(),
                args: "--noflush --counters".into(),
                status: "exit status: 1".into(),
                stderr,
            });
        }
        self.restores.push(input.to_string());
        Ok(())
    }

    fn batch_lines(&mut self) -> usize {
        self.batch.unwrap_or(NFT_BATCH_LINES)
    }

    fn save(&mut self, table: &str) -> Result<String, ExecError> {
        self.commands.push(format!("save {table}"));
        Ok(self.saved.get(table).cloned().unwrap_or_default())
    }

    fn save_each(&mut self, table: &str, each: &mut dyn FnMut(&str)) -> Result<(), ExecError> {
        self.commands.push(format!("save {table}"));
        for line in self.saved.get(table).map(String::as_str).unwrap_or_default().lines() {
            each(line);
        }
        Ok(())
    }

    fn save_counters(&mut self, table: &str) -> Result<String, ExecError> {
        self.commands.push(format!("save -c {table}"));
        Ok(self.saved.get(table).cloned().unwrap_or_default())
    }

    /// The chain's lines of what `save` returns (a chain is there when declared or listed).
    fn list_chain(&mut self, table: &str, chain: &str) -> Result<Option<String>, ExecError> {
        self.commands.push(format!("list {table} {chain}"));
        let saved = self.saved.get(table).map(String::as_str).unwrap_or_default();
        let rule = format!("-A {chain} ");
        let mut found = saved
            .lines()
            .any(|l| l.split_whitespace().next() == Some(&format!(":{chain}")));
        let mut out = String::new();
        for line in saved.lines() {
            let rest = line
                .strip_prefix('[')
                .and_then(|r| r.split_once("] "))
                .map_or(line, |(_, r)| r);
            if rest.starts_with(&rule) {
                found = true;
                out.push_str(line);
                out.push('\n');
            }
        }
        Ok(found.then_some(out))
    }

    fn lists_chains_alone(&mut self) -> bool {
        self.lists_chains_alone
    }

    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, ExecError> {
        Ok(self.chains.insert(format!("{table}/{chain}")))
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, ExecError> {
        Ok(self.chains.contains(&format!("{table}/{chain}")))
    }

    fn rule_exists(&mut self, table: &str, chain: &str, args: &[String]) -> Result<bool, ExecError> {
        Ok(self.rules.contains(&format!("{table}/{chain} {}", args.join(" "))))
    }

    fn run(&mut self, table: &str, op: &[&str], args: &[String]) -> Result<String, ExecError> {
        let cmd = format!("-t {table} {} {}", op.join(" "), args.join(" "));
        self.commands.push(cmd.trim().to_string());
        match op {
            ["-I", chain] => {
                self.rules.insert(format!("{table}/{chain} {}", args.join(" ")));
            }
            ["-D", chain] => {
                self.rules.remove(&format!("{table}/{chain} {}", args.join(" ")));
            }
            ["-N", chain] => {
                self.chains.insert(format!("{table}/{chain}"));
            }
            ["-X", chain] => {
                self.chains.remove(&format!("{table}/{chain}"));
            }
            _ => {}
        }
        Ok(String::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_rules_read_as_saved() {
        let listed = "-N KUBE-SVC-X\n\
            -A KUBE-SVC-X -m comment --comment \"ns/a:p -c 1 2\" -m statistic --mode random --probability 0.5 -c 3 180 -j KUBE-SEP-A\n\
            -A KUBE-FW-X -m comment --comment \"other traffic\" -c 0 0\n";
        assert_eq!(
            listed_as_saved(listed),
            "[3:180] -A KUBE-SVC-X -m comment --comment \"ns/a:p -c 1 2\" -m statistic --mode random --probability 0.5 -j KUBE-SEP-A\n\
             [0:0] -A KUBE-FW-X -m comment --comment \"other traffic\"\n"
        );
    }

    #[test]
    fn error_context_points_at_the_failed_line() {
        let input = "*nat\n:A - [0:0]\n-A A -j NOPE\n-A A -j RETURN\nCOMMIT\n";
        let ctx = restore_error_context("iptables-restore: line 3 failed", input);
        assert!(ctx.contains("> 3: -A A -j NOPE"), "{ctx}");
        assert!(
            ctx.contains("  2: :A - [0:0]") && ctx.contains("  4: -A A -j RETURN"),
            "{ctx}"
        );
        assert_eq!(restore_error_context("something else", input), "");
    }
}
