//! Loading a [`Ruleset`]: its `iptables-restore` text (tables, chain declarations, `-A`, `-N`
//! and `-X` lines, split as iptables-restore splits them) and the jump rules kept in built-in
//! chains, into [`Tables`] whose targets name chains by index. Each rule's options are read by
//! `parse_rule`.

use super::rule::{ParsedRule, RuleErr, TargetSpec, parse_rule};
use super::tables::{BUILTINS, FILTER, Match, NAT, Rule, TABLE_NAMES, Table, Tables, Target};
use crate::iptables::{JumpRule, Ruleset};
use crate::model::IpFamily;
use crate::trace::{SetDim, SetLookup, TraceError};

/// Parses the restore input and the jump rules of `ruleset`; every set a rule matches must be
/// in `sets`.
pub(crate) fn load(ruleset: &Ruleset, sets: &dyn SetLookup) -> Result<Tables, TraceError> {
    let family = ruleset.family;
    let mut restore = Restore {
        family,
        tables: [Table::new(FILTER), Table::new(NAT)],
        pending: Vec::new(),
        current: None,
    };
    let mut last_line = 0;
    for (i, raw) in ruleset.restore.lines().enumerate() {
        last_line = i + 1;
        restore.line(&Line {
            line: i + 1,
            text: raw.trim(),
        })?;
    }
    if let Some((table, line)) = restore.current {
        return Err(TraceError::Parse {
            line: last_line.max(line),
            text: format!("*{}", TABLE_NAMES[table]),
            reason: "table is missing its COMMIT".to_string(),
        });
    }
    let mut tables = restore.tables;

    // Jump rules are inserted ahead of anything appended to built-in chains.
    for jump in &ruleset.jumps {
        add_jump_rule(&mut tables, jump, family, sets)?;
    }

    for p in restore.pending {
        let (table, chain) = (p.table, p.chain);
        let rule = resolve(&tables, p, sets)?;
        tables[table].chains[chain].rules.push(rule);
    }
    Ok(tables)
}

/// The restore text read so far.
struct Restore {
    family: IpFamily,
    tables: Tables,
    /// The rules appended so far; their targets are resolved once every chain is declared.
    pending: Vec<PendingRule>,
    /// The table being read and the line of its `*table`.
    current: Option<(usize, usize)>,
}

/// A restore rule waiting for all chains to be declared before its target is resolved.
struct PendingRule {
    table: usize,
    chain: usize,
    line: usize,
    text: String,
    parsed: ParsedRule,
}

/// One line of the restore text (trimmed), for its errors.
struct Line<'a> {
    /// 1-based.
    line: usize,
    text: &'a str,
}

impl Line<'_> {
    fn malformed(&self, reason: &str) -> TraceError {
        TraceError::Parse {
            line: self.line,
            text: self.text.to_string(),
            reason: reason.to_string(),
        }
    }

    fn unsupported(&self, reason: &str) -> TraceError {
        TraceError::UnsupportedRule {
            line: self.line,
            rule: self.text.to_string(),
            reason: reason.to_string(),
        }
    }
}

impl Restore {
    fn line(&mut self, at: &Line) -> Result<(), TraceError> {
        let text = at.text;
        if text.is_empty() || text.starts_with('#') {
            return Ok(());
        }
        if let Some(name) = text.strip_prefix('*') {
            if self.current.is_some() {
                return Err(at.malformed("table started before the previous table's COMMIT"));
            }
            let table = match name.trim() {
                "filter" => FILTER,
                "nat" => NAT,
                _ => return Err(at.unsupported("only the filter and nat tables are traced")),
            };
            self.current = Some((table, at.line));
            return Ok(());
        }
        if text == "COMMIT" {
            if self.current.take().is_none() {
                return Err(at.malformed("COMMIT outside a table"));
            }
            return Ok(());
        }
        let Some((table, _)) = self.current else {
            return Err(at.malformed("line outside a *table ... COMMIT block"));
        };
        match text.strip_prefix(':') {
            Some(decl) => self.declare_chain(at, table, decl),
            None => self.command(at, table),
        }
    }

    /// `:NAME POLICY [packets:bytes]`: a built-in chain's policy, or a user-defined chain.
    fn declare_chain(&mut self, at: &Line, table: usize, decl: &str) -> Result<(), TraceError> {
        let tokens = tokenize(decl).map_err(|r| at.malformed(&r))?;
        let (Some(name), Some(policy)) = (tokens.first(), tokens.get(1)) else {
            return Err(at.malformed("chain declaration needs a name and a policy"));
        };
        let t = &mut self.tables[table];
        let idx = match t.index.get(name.as_str()) {
            Some(&idx) => idx,
            None => t.declare(name, false),
        };
        let chain = &mut t.chains[idx];
        if chain.builtin {
            chain.policy_drop = match policy.as_str() {
                "ACCEPT" => false,
                "DROP" => true,
                _ => return Err(at.unsupported("built-in chain policy must be ACCEPT or DROP")),
            };
        } else if policy != "-" {
            return Err(at.malformed("a user-defined chain's policy must be `-`"));
        }
        Ok(())
    }

    /// `-A CHAIN RULE...`, `-N CHAIN` or `-X CHAIN`.
    fn command(&mut self, at: &Line, table: usize) -> Result<(), TraceError> {
        let tokens = tokenize(at.text).map_err(|r| at.malformed(&r))?;
        let command = tokens.first().map(String::as_str).unwrap_or_default();
        match command {
            "-A" | "--append" => {
                let Some(chain_name) = tokens.get(1) else {
                    return Err(at.malformed("-A needs a chain name"));
                };
                let Some(&chain) = self.tables[table].index.get(chain_name.as_str()) else {
                    return Err(TraceError::UnknownChain {
                        line: at.line,
                        table: TABLE_NAMES[table].to_string(),
                        chain: chain_name.clone(),
                        rule: at.text.to_string(),
                    });
                };
                let parsed = parse_rule(&tokens[2..], self.family, table).map_err(|e| match e {
                    RuleErr::Malformed(r) => at.malformed(&r),
                    RuleErr::Unsupported(r) => at.unsupported(&r),
                })?;
                self.pending.push(PendingRule {
                    table,
                    chain,
                    line: at.line,
                    text: at.text.to_string(),
                    parsed,
                });
            }
            // Stale chains are declared (flushed) and deleted; nothing to trace.
            "-X" | "--delete-chain" => {}
            "-N" | "--new-chain" => {
                let Some(name) = tokens.get(1) else {
                    return Err(at.malformed("-N needs a chain name"));
                };
                self.tables[table].declare(name, false);
            }
            _ => {
                return Err(at.unsupported("only chain declarations, -A, -N and -X lines are traced"));
            }
        }
        Ok(())
    }
}

/// A restore rule with its sets checked and its target's chain resolved.
fn resolve(tables: &Tables, p: PendingRule, sets: &dyn SetLookup) -> Result<Rule, TraceError> {
    check_sets(&p.parsed.matches, sets).map_err(|(set, reason)| TraceError::Set {
        line: p.line,
        set,
        rule: p.text.clone(),
        reason,
    })?;
    let chain_of = |name: &str| -> Result<usize, TraceError> {
        match tables[p.table].index.get(name) {
            Some(&idx) if !tables[p.table].chains[idx].builtin => Ok(idx),
            Some(_) => Err(TraceError::UnsupportedRule {
                line: p.line,
                rule: p.text.clone(),
                reason: format!("jumping to built-in chain {name} is not allowed"),
            }),
            None => Err(TraceError::UnknownChain {
                line: p.line,
                table: TABLE_NAMES[p.table].to_string(),
                chain: name.to_string(),
                rule: p.text.clone(),
            }),
        }
    };
    let target = match p.parsed.target {
        TargetSpec::Resolved(t) => t,
        TargetSpec::Jump(name) => Target::Jump(chain_of(&name)?),
        TargetSpec::Goto(name) => Target::Goto(chain_of(&name)?),
    };
    Ok(Rule {
        line: p.line,
        text: p.text,
        comment: p.parsed.comment,
        matches: p.parsed.matches,
        target,
    })
}

/// Checks the `-m set` matches of a rule against the sets supplied: `(set, reason)` if one is
/// missing or used in a way the tracer cannot evaluate.
fn check_sets(matches: &[Match], sets: &dyn SetLookup) -> Result<(), (String, String)> {
    for m in matches {
        let Match::Set { name, src, .. } = m else {
            continue;
        };
        let Some(dims) = sets.dimensions(name) else {
            return Err((name.clone(), "no such set".to_string()));
        };
        // Flags beyond the set's dimensions are ignored by the kernel, as in upstream's use of
        // `dst,dst` with `hash:ip,port`. Fewer flags than dimensions never match (see
        // `Tracer::set_match`).
        if dims.iter().zip(src).any(|(dim, &src)| src && *dim == SetDim::Port) {
            return Err((name.clone(), "source ports are not traced".to_string()));
        }
    }
    Ok(())
}

/// Inserts one of `Ruleset::jumps` ahead of the rules appended to its built-in chain; a jump
/// to a chain the ruleset does not declare is skipped.
fn add_jump_rule(
    tables: &mut Tables,
    jump: &JumpRule,
    family: IpFamily,
    sets: &dyn SetLookup,
) -> Result<(), TraceError> {
    let mut text = format!("-A {}", jump.chain);
    for arg in &jump.args {
        text.push(' ');
        text.push_str(&quote_arg(arg));
    }
    let err = |reason: String| TraceError::UnsupportedJumpRule {
        table: jump.table.to_string(),
        chain: jump.chain.to_string(),
        rule: text.clone(),
        reason,
    };
    let table = match jump.table {
        "filter" => FILTER,
        "nat" => NAT,
        _ => return Err(err("only the filter and nat tables are traced".to_string())),
    };
    if !BUILTINS[table].contains(&jump.chain) {
        return Err(err(format!(
            "{} is not a built-in chain of the {} table",
            jump.chain, jump.table
        )));
    }
    let parsed = parse_rule(&jump.args, family, table).map_err(|e| err(e.reason()))?;
    check_sets(&parsed.matches, sets).map_err(|(set, reason)| err(format!("ipset {set}: {reason}")))?;
    let goto = matches!(parsed.target, TargetSpec::Goto(_));
    let target = match parsed.target {
        TargetSpec::Resolved(t) => t,
        TargetSpec::Jump(name) | TargetSpec::Goto(name) => match tables[table].index.get(&name) {
            Some(&idx) if !tables[table].chains[idx].builtin => {
                if goto {
                    Target::Goto(idx)
                } else {
                    Target::Jump(idx)
                }
            }
            Some(_) => {
                return Err(err(format!("jumping to built-in chain {name} is not allowed")));
            }
            // The chain is not in this ruleset (e.g. KUBE-FIREWALL not rendered): nothing to jump to.
            None => return Ok(()),
        },
    };
    let chain = tables[table].index[jump.chain];
    let rules = &mut tables[table].chains[chain].rules;
    let at = rules.iter().take_while(|r| r.line == 0).count();
    rules.insert(
        at,
        Rule {
            line: 0,
            text,
            comment: parsed.comment,
            matches: parsed.matches,
            target,
        },
    );
    Ok(())
}

/// A rule line of `iptables-restore` input or `iptables-save` output (`-A CHAIN …`, with or
/// without `[packets:bytes]` in front) of `table`, reduced to what it means: its chain,
/// comment, matches (in any order: `iptables-save` puts `-s`/`-d`/`-p` first and spells
/// addresses as CIDRs) and target. `None` for a line the tracer cannot read.
pub fn canonical_rule(line: &str, table: &str) -> Option<String> {
    let line = match line.trim().strip_prefix('[') {
        Some(rest) => rest.split_once("] ")?.1,
        None => line.trim(),
    };
    let tokens = tokenize(line).ok()?;
    if tokens.first().map(String::as_str) != Some("-A") {
        return None;
    }
    let chain = tokens.get(1)?;
    let table = match table {
        "filter" => FILTER,
        "nat" => NAT,
        _ => return None,
    };
    let parsed = parse_rule(&tokens[2..], IpFamily::V4, table)
        .or_else(|_| parse_rule(&tokens[2..], IpFamily::V6, table))
        .ok()?;
    let mut matches: Vec<String> = parsed
        .matches
        .iter()
        .map(|m| match m {
            // The kernel keeps a probability as a 31-bit fraction (`0.3333333333` comes back
            // as `0.33333333349`): compared as that fraction.
            Match::Statistic { probability, .. } => {
                format!("Statistic({})", (probability * f64::from(1u32 << 31)).round() as u64)
            }
            m => format!("{m:?}"),
        })
        .collect();
    matches.sort();
    Some(format!(
        "{chain} {:?} [{}] {:?}",
        parsed.comment,
        matches.join(", "),
        parsed.target
    ))
}

/// Splits a line the way iptables-restore does: whitespace separates, double quotes group (and
/// a closing quote ends the token), a backslash escapes `"` or `\` inside quotes.
fn tokenize(line: &str) -> Result<Vec<String>, String> {
    let mut tokens = Vec::new();
    let mut cur = String::new();
    let mut in_token = false;
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if quoted {
            match c {
                '\\' if matches!(chars.peek(), Some('"') | Some('\\')) => {
                    if let Some(next) = chars.next() {
                        cur.push(next);
                    }
                }
                '"' => {
                    quoted = false;
                    in_token = false;
                    tokens.push(std::mem::take(&mut cur));
                }
                _ => cur.push(c),
            }
        } else if c == '"' {
            quoted = true;
            in_token = true;
        } else if c.is_whitespace() {
            if in_token {
                tokens.push(std::mem::take(&mut cur));
                in_token = false;
            }
        } else {
            cur.push(c);
            in_token = true;
        }
    }
    if quoted {
        return Err("unterminated double quote".to_string());
    }
    if in_token {
        tokens.push(cur);
    }
    Ok(tokens)
}

/// An argument as the restore text would quote it, for a jump rule's text.
fn quote_arg(arg: &str) -> String {
    if !arg.is_empty() && !arg.chars().any(|c| c.is_whitespace() || c == '"') {
        return arg.to_string();
    }
    let mut q = String::from("\"");
    for c in arg.chars() {
        if c == '"' || c == '\\' {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn saved_and_rendered_rules_are_the_same_rule() {
        let rendered = r#"-A KUBE-SERVICES -m comment --comment "ns/web:p cluster IP" -m tcp -p tcp -d 10.96.0.1 --dport 80 -j KUBE-SVC-X"#;
        let saved = r#"[3:180] -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "ns/web:p cluster IP" -m tcp --dport 80 -j KUBE-SVC-X"#;
        let other = r#"-A KUBE-SERVICES -d 10.96.0.2/32 -p tcp -m comment --comment "ns/web:p cluster IP" -m tcp --dport 80 -j KUBE-SVC-X"#;
        let a = canonical_rule(rendered, "nat").expect("parses");
        assert_eq!(Some(&a), canonical_rule(saved, "nat").as_ref());
        assert_ne!(Some(&a), canonical_rule(other, "nat").as_ref());
        assert_eq!(canonical_rule("-A X -m nosuchmodule -j Y", "nat"), None);
        let p = |x: &str| {
            canonical_rule(
                &format!("-A S -m statistic --mode random --probability {x} -j E"),
                "nat",
            )
        };
        assert_eq!(p("0.3333333333"), p("0.33333333349"), "as the kernel keeps it");
        assert_ne!(p("0.3333333333"), p("0.5000000000"));
        let rendered = "-A S -m comment --comment \"ns/web:p -> 10.244.1.2:8080\" -m recent --name KUBE-SEP-X --rcheck --seconds 10800 --reap -j KUBE-SEP-X";
        let saved = "[0:0] -A S -m comment --comment \"ns/web:p -> 10.244.1.2:8080\" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-X --mask 255.255.255.255 --rsource -j KUBE-SEP-X";
        assert_eq!(canonical_rule(rendered, "nat").map(|_| ()), Some(()));
        assert_eq!(
            canonical_rule(rendered, "nat"),
            canonical_rule(saved, "nat"),
            "recent as saved"
        );
    }

    #[test]
    fn tokenizer_groups_quotes_like_iptables_restore() {
        assert_eq!(
            tokenize(r#"-A X -m comment --comment "a b  c" -j Y"#).unwrap(),
            strs(&["-A", "X", "-m", "comment", "--comment", "a b  c", "-j", "Y"])
        );
        assert_eq!(
            tokenize(r#"--comment "say \"hi\"" x"#).unwrap(),
            strs(&["--comment", "say \"hi\"", "x"])
        );
        assert_eq!(tokenize("a\t\tb  ").unwrap(), strs(&["a", "b"]));
        assert!(tokenize("\"open").is_err());
        assert_eq!(quote_arg("a \"b\""), r#""a \"b\"""#);
    }
}
