//! A model of one family's `kube-proxy` table as the kernel holds it: chains with their rules,
//! sets/maps with their elements. Replaying a [`Transaction`] on it gives the table that the
//! kernel would hold after committing it ([`Ruleset::apply`]); the incremental proxier keeps
//! the programmed table this way instead of listing it, and `trace` evaluates packets on it.

use std::collections::BTreeMap;

use super::ast::{ChainDecl, ElemKey, Element, Op, Rule, SetDecl, Transaction};
use crate::model::IpFamily;

/// A chain and its rules, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub decl: ChainDecl,
    pub rules: Vec<Rule>,
}

/// A set or verdict map and its elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub decl: SetDecl,
    pub elements: BTreeMap<ElemKey, Element>,
}

/// One family's table. `exists` is false until an `add table`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruleset {
    pub family: IpFamily,
    pub exists: bool,
    pub chains: BTreeMap<String, Chain>,
    pub sets: BTreeMap<String, Set>,
}

/// A command that the kernel would refuse (the model refuses it too).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ApplyError(pub String);

impl Ruleset {
    pub fn new(family: IpFamily) -> Ruleset {
        Ruleset {
            family,
            exists: false,
            chains: BTreeMap::new(),
            sets: BTreeMap::new(),
        }
    }

    /// The table after committing `tx` on an empty namespace.
    pub fn from_transaction(tx: &Transaction) -> Result<Ruleset, ApplyError> {
        let mut r = Ruleset::new(tx.family);
        r.apply_all(&tx.ops)?;
        Ok(r)
    }

    pub fn apply_all(&mut self, ops: &[Op]) -> Result<(), ApplyError> {
        for op in ops {
            self.apply(op)?;
        }
        Ok(())
    }

    /// Applies one command as the kernel would (errors where the kernel returns one).
    pub fn apply(&mut self, op: &Op) -> Result<(), ApplyError> {
        if !matches!(op, Op::AddTable) && !self.exists {
            return Err(ApplyError("no such table".into()));
        }
        match op {
            Op::AddTable => self.exists = true,
            Op::DeleteTable => *self = Ruleset::new(self.family),
            Op::AddChain(decl) => {
                self.chains.entry(decl.name.clone()).or_insert_with(|| Chain {
                    decl: decl.clone(),
                    rules: Vec::new(),
                });
            }
            Op::FlushChain(name) => self.chain_mut(name)?.rules.clear(),
            Op::DeleteChain(name) => {
                if self.chains.remove(name).is_none() {
                    return Err(ApplyError(format!("delete chain {name}: no such chain")));
                }
            }
            Op::AddRule { chain, rule } => {
                for target in rule.targets() {
                    if !self.chains.contains_key(target) {
                        return Err(ApplyError(format!("rule in {chain}: no such chain {target}")));
                    }
                }
                self.chain_mut(chain)?.rules.push(rule.clone());
            }
            Op::AddSet(decl) => {
                self.sets.entry(decl.name.clone()).or_insert_with(|| Set {
                    decl: decl.clone(),
                    elements: BTreeMap::new(),
                });
            }
            Op::FlushSet { name, .. } => self.set_mut(name)?.elements.clear(),
            Op::DeleteSet { name, .. } => {
                if self.sets.remove(name).is_none() {
                    return Err(ApplyError(format!("delete set {name}: no such set")));
                }
            }
            Op::AddElement { set, element } => {
                if let Some(target) = element.value.as_ref().and_then(|v| v.chain())
                    && !self.chains.contains_key(target)
                {
                    return Err(ApplyError(format!("element of {set}: no such chain {target}")));
                }
                let s = self.set_mut(set)?;
                if let ElemKey::Range(lo, hi) = element.key
                    && let Some(other) = s
                        .elements
                        .keys()
                        .find(|k| **k != element.key && matches!(k, ElemKey::Range(a, b) if *a <= hi && lo <= *b))
                {
                    return Err(ApplyError(format!(
                        "interval {} of {set} overlaps {other}",
                        element.key
                    )));
                }
                match s.elements.get(&element.key) {
                    // `add` of an existing element with other data fails in the kernel.
                    Some(e) if e.value != element.value => {
                        return Err(ApplyError(format!("element {} of {set} exists", element.key)));
                    }
                    Some(_) => {}
                    None => {
                        s.elements.insert(element.key.clone(), element.clone());
                    }
                }
            }
            Op::DeleteElement { set, key } => {
                if self.set_mut(set)?.elements.remove(key).is_none() {
                    return Err(ApplyError(format!("delete element {key} of {set}: no such element")));
                }
            }
        }
        Ok(())
    }

    fn chain_mut(&mut self, name: &str) -> Result<&mut Chain, ApplyError> {
        self.chains
            .get_mut(name)
            .ok_or_else(|| ApplyError(format!("no such chain {name}")))
    }

    fn set_mut(&mut self, name: &str) -> Result<&mut Set, ApplyError> {
        self.sets
            .get_mut(name)
            .ok_or_else(|| ApplyError(format!("no such set {name}")))
    }
}
