//! One sync's `iptables-restore --noflush` input, written as it is rendered and handed to the
//! tool in runs of about [`super::exec::Iptables::batch_lines`] lines each (see
//! [`super::exec`] for why), so that neither we nor the tool ever hold a large sync whole.
//!
//! The caller adds *units*: lines that must be committed together (a Service's chains with
//! their rules: a chain is flushed when declared, so its rules must land in the same commit).
//! A run ends only between units, with a `COMMIT` of the open table; a new table section
//! (`*filter` after `*nat`, `*nat` again after it) starts a new commit. Each run is a separate
//! `iptables-restore`, so a sync split into several is several commits, applied in order: what
//! the caller puts first is in the kernel before what it puts later, which is what keeps a
//! Service reachable throughout (its chains before the jump to them, the jump before the
//! REJECT goes; see the proxier).

use super::exec::{ExecError, Iptables};
use crate::proxy::{TableRules, restore_operations, rules_written};

/// The restore input being built and the runs sent so far.
pub struct Batches<'a, I: Iptables + ?Sized> {
    ipt: &'a mut I,
    budget: usize,
    /// The run being built, ending in an open table section (no `COMMIT` yet).
    text: String,
    lines: usize,
    /// The table of the open section, if one is open.
    open: Option<&'static str>,
    /// The table the next lines go to.
    table: &'static str,
    /// Operations and rules per table of the runs sent.
    pub operations: usize,
    pub tables: Vec<TableRules>,
    /// Runs of the tool so far.
    pub runs: usize,
}

impl<'a, I: Iptables + ?Sized> Batches<'a, I> {
    pub fn new(ipt: &'a mut I) -> Batches<'a, I> {
        let budget = ipt.batch_lines().max(1);
        Batches {
            ipt,
            budget,
            text: String::new(),
            lines: 0,
            open: None,
            table: "nat",
            operations: 0,
            tables: Vec::new(),
            runs: 0,
        }
    }

    /// The following lines go to `table`, in a new commit (also when it is the open one's).
    pub fn section(&mut self, table: &'static str) {
        self.close();
        self.table = table;
    }

    /// Adds one line (no newline) to the current unit.
    pub fn line(&mut self, line: &str) {
        if self.open.is_none() {
            self.text.push('*');
            self.text.push_str(self.table);
            self.text.push('\n');
            self.open = Some(self.table);
        }
        self.text.push_str(line);
        self.text.push('\n');
        self.lines += 1;
    }

    /// Adds every line of `block` (newline-terminated lines) to the current unit.
    pub fn lines(&mut self, block: &str) {
        for l in block.lines() {
            self.line(l);
        }
    }

    /// Ends a unit: when the run has reached its size, it is sent.
    pub fn end_unit(&mut self) -> Result<(), ExecError> {
        if self.lines >= self.budget { self.send() } else { Ok(()) }
    }

    /// Sends what is left.
    pub fn finish(mut self) -> Result<Batches<'a, I>, ExecError> {
        self.send()?;
        Ok(self)
    }

    fn close(&mut self) {
        if self.open.take().is_some() {
            self.text.push_str("COMMIT\n");
        }
    }

    fn send(&mut self) -> Result<(), ExecError> {
        let table = self.open.unwrap_or(self.table);
        self.close();
        if self.text.is_empty() {
            return Ok(());
        }
        self.ipt.restore(&self.text)?;
        self.runs += 1;
        self.operations += restore_operations(&self.text);
        for written in rules_written(&self.text) {
            match self.tables.iter_mut().find(|t| t.table == written.table) {
                Some(t) => t.written += written.written,
                None => self.tables.push(written),
            }
        }
        self.text.clear();
        self.lines = 0;
        // The next unit continues in the same table, in the next run.
        self.table = table;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::exec::Fake;

    #[test]
    fn units_are_never_split_and_sections_commit_in_order() {
        let mut fake = Fake {
            batch: Some(3),
            ..Fake::default()
        };
        let mut b = Batches::new(&mut fake);
        b.lines(":A - [0:0]\n-A A -j RETURN\n");
        b.end_unit().unwrap();
        b.lines(":B - [0:0]\n-A B -j RETURN\n");
        b.end_unit().unwrap();
        b.line("-I KUBE-SERVICES 1 -j B");
        b.end_unit().unwrap();
        b.section("filter");
        b.line("-A F -j ACCEPT");
        b.end_unit().unwrap();
        b.section("nat");
        b.line("-X A");
        let b = b.finish().unwrap();
        assert_eq!((b.runs, b.operations), (2, 7));
        assert_eq!(
            b.tables,
            vec![
                TableRules {
                    table: "nat".into(),
                    total: 0,
                    written: 2
                },
                TableRules {
                    table: "filter".into(),
                    total: 0,
                    written: 1
                }
            ]
        );
        assert_eq!(
            fake.restores,
            [
                "*nat\n:A - [0:0]\n-A A -j RETURN\n:B - [0:0]\n-A B -j RETURN\nCOMMIT\n",
                "*nat\n-I KUBE-SERVICES 1 -j B\nCOMMIT\n*filter\n-A F -j ACCEPT\nCOMMIT\n*nat\n-X A\nCOMMIT\n",
            ]
        );
    }

    #[test]
    fn nothing_to_write_runs_nothing() {
        let mut fake = Fake::default();
        let mut b = Batches::new(&mut fake);
        b.section("filter");
        b.end_unit().unwrap();
        let b = b.finish().unwrap();
        assert_eq!(b.runs, 0);
        assert!(fake.restores.is_empty());
    }

    #[test]
    fn a_failed_run_stops_the_batches() {
        let mut fake = Fake {
            batch: Some(1),
            fail_restore_after: Some((1, "iptables-restore: line 2 failed".into())),
            ..Fake::default()
        };
        let mut b = Batches::new(&mut fake);
        b.line("-A A -j RETURN");
        b.end_unit().unwrap();
        b.line("-A B -j RETURN");
        let err = b.end_unit().unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        assert_eq!(fake.restores.len(), 1);
    }
}
