//! Where the nftables proxier's transactions go ([`NftBackend`]): netlink (what the daemon
//! uses), `nft -f -` ([`NftCommand`], tests and comparisons), or a recording fake that applies
//! them to a model of the kernel's table ([`RecordingBackend`]). Besides applying, a backend
//! says whether the table exists, lists its chains and sets once for a full sync that replaces
//! a table already there ([`TableObjects`]), and reads the table back into the model
//! ([`NftBackend::read`]: explain and `trace --live`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::ast::{SetDecl, Transaction, family_keyword};
use super::names::TABLE;
use super::netlink::ReadScope;
use super::netlink::decode::Undecoded;
use super::ruleset::Ruleset;
use crate::exec;
use crate::model::IpFamily;

/// A transaction the kernel (or `nft`) refused; nothing of it was applied.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NftError(pub String);

/// A chain of the table as listed: its name and, for a base chain, its hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedChain {
    pub name: String,
    /// (type, hook, priority) of a base chain.
    pub base: Option<(String, String, i32)>,
}

/// A named (not anonymous) set or map of the table as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedSet {
    pub name: String,
    /// What its elements are, when the backend can tell; `None`: unknown (taken to be what
    /// the proxier wants).
    pub signature: Option<SetSignature>,
}

/// What decides whether an existing set can stay as it is (the kernel refuses to re-declare a
/// set with other types or flags): key and data types and lengths as the kernel holds them,
/// flags, timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SetSignature {
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    pub data: Option<(u32, u32)>,
    pub timeout_ms: Option<u64>,
}

impl SetSignature {
    /// The signature the kernel holds for a set declared as `decl`.
    pub fn of(family: IpFamily, decl: &SetDecl) -> SetSignature {
        super::netlink::set_signature(family, decl)
    }
}

/// The chains and named sets of one family's table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableObjects {
    pub chains: Vec<ListedChain>,
    pub sets: Vec<ListedSet>,
}

pub trait NftBackend: Send {
    /// Applies `tx` atomically (an empty transaction is a no-op).
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError>;

    /// Applies the transactions `parts` yields as one atomic transaction. A backend may encode
    /// each part as it comes, so that a full sync never holds all its commands at once; this
    /// default joins them.
    fn apply_parts(&mut self, family: IpFamily, parts: &mut dyn Iterator<Item = Transaction>) -> Result<(), NftError> {
        let mut all = Transaction::new(family);
        for part in parts {
            all.ops.extend(part.ops);
        }
        self.apply(&all)
    }

    /// Whether the family's `kube-proxy` table exists.
    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError>;

    /// The chains and named sets of the family's table; `None` when there is no table.
    fn objects(&mut self, family: IpFamily) -> Result<Option<TableObjects>, NftError>;

    /// The family's table as the kernel holds it, read back over netlink (whole, or some
    /// chains and maps): the model and the rules that are not of kube-proxy's shapes; `None`
    /// when the table does not exist.
    fn read(&mut self, family: IpFamily, scope: &ReadScope) -> Result<Option<ReadTable>, NftError> {
        let mut socket = super::netlink::NftSocket::new().map_err(|e| NftError(format!("opening netlink: {e}")))?;
        NftBackend::read(&mut socket, family, scope)
    }
}

/// A table read back: its model, and the rules it holds that kube-proxy did not write.
pub type ReadTable = (Ruleset, Vec<Undecoded>);

/// The `nft` command: each transaction is piped to `nft -f -`.
#[derive(Debug, Default)]
pub struct NftCommand;

impl NftBackend for NftCommand {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        if tx.is_empty() {
            return Ok(());
        }
        nft_apply(&tx.text())
    }

    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        // `list tables` prints names only; `list table` would print every rule (seconds at
        // 10k Services).
        let out = nft(&["list", "tables", family_keyword(family)], None, |status, _| {
            format!("nft list tables exited with {status}")
        })?;
        let wanted = format!("table {} {TABLE}", family_keyword(family));
        Ok(out.lines().any(|l| l.trim() == wanted))
    }

    /// From `nft -j list chains` and `nft -j list sets` (set signatures unknown).
    fn objects(&mut self, family: IpFamily) -> Result<Option<TableObjects>, NftError> {
        if !self.table_exists(family)? {
            return Ok(None);
        }
        let f = family_keyword(family);
        let json = |what: &str| -> Result<Vec<serde_json::Value>, NftError> {
            let out = nft(&["-j", "list", what, f], None, |status, stderr| {
                format!("nft -j list {what} exited with {status}: {stderr}")
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&out).map_err(|e| NftError(format!("nft -j list {what}: {e}")))?;
            Ok(v["nftables"].as_array().cloned().unwrap_or_default())
        };
        let mut objects = TableObjects::default();
        for item in json("chains")? {
            let c = &item["chain"];
            if c["table"] != TABLE {
                continue;
            }
            let Some(name) = c["name"].as_str() else { continue };
            let base = match (c["type"].as_str(), c["hook"].as_str(), c["prio"].as_i64()) {
                (Some(t), Some(h), Some(p)) => Some((t.to_string(), h.to_string(), i32::try_from(p).unwrap_or(0))),
                _ => None,
            };
            objects.chains.push(ListedChain {
                name: name.to_string(),
                base,
            });
        }
        for item in json("sets")?.into_iter().chain(json("maps")?) {
            let s = item.get("set").or_else(|| item.get("map"));
            let Some(s) = s.filter(|s| s["table"] == TABLE) else {
                continue;
            };
            if let Some(name) = s["name"].as_str() {
                objects.sets.push(ListedSet {
                    name: name.to_string(),
                    signature: None,
                });
            }
        }
        Ok(Some(objects))
    }
}

impl NftBackend for super::netlink::NftSocket {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        super::netlink::NftSocket::apply(self, tx).map_err(|e| NftError(e.to_string()))
    }

    fn apply_parts(&mut self, family: IpFamily, parts: &mut dyn Iterator<Item = Transaction>) -> Result<(), NftError> {
        super::netlink::NftSocket::apply_parts(self, family, parts).map_err(|e| NftError(e.to_string()))
    }

    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        super::netlink::NftSocket::table_exists(self, family).map_err(|e| NftError(format!("listing tables: {e}")))
    }

    fn objects(&mut self, family: IpFamily) -> Result<Option<TableObjects>, NftError> {
        super::netlink::NftSocket::objects(self, family).map_err(|e| NftError(format!("listing the table: {e}")))
    }

    fn read(&mut self, family: IpFamily, scope: &ReadScope) -> Result<Option<ReadTable>, NftError> {
        super::netlink::NftSocket::read(self, family, scope)
            .map_err(|e| NftError(format!("reading the {} {TABLE} table: {e}", family_keyword(family))))
    }
}

/// What a [`RecordingBackend`] saw: the transactions applied, and the tables they built.
#[derive(Debug, Default)]
pub struct Recorded {
    pub applied: Vec<Transaction>,
    pub tables: HashMap<IpFamily, Ruleset>,
    /// Makes the next apply fail (nothing applied).
    pub fail_next: bool,
}

/// A backend that records transactions and applies them to a model of the kernel's table,
/// refusing what the kernel would refuse. Clones share the record.
#[derive(Clone, Debug, Default)]
pub struct RecordingBackend(Arc<Mutex<Recorded>>);

impl RecordingBackend {
    pub fn recorded(&self) -> MutexGuard<'_, Recorded> {
        // A panicking test thread must not hide the record from the others.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl NftBackend for RecordingBackend {
    fn apply(&mut self, tx: &Transaction) -> Result<(), NftError> {
        let mut r = self.recorded();
        if std::mem::take(&mut r.fail_next) {
            return Err(NftError("injected failure".into()));
        }
        let mut table = r
            .tables
            .get(&tx.family)
            .cloned()
            .unwrap_or_else(|| Ruleset::new(tx.family));
        table.apply_all(&tx.ops).map_err(|e| NftError(e.to_string()))?;
        r.tables.insert(tx.family, table);
        r.applied.push(tx.clone());
        Ok(())
    }

    fn table_exists(&mut self, family: IpFamily) -> Result<bool, NftError> {
        Ok(self.recorded().tables.get(&family).is_some_and(|t| t.exists))
    }

    fn objects(&mut self, family: IpFamily) -> Result<Option<TableObjects>, NftError> {
        let r = self.recorded();
        let Some(table) = r.tables.get(&family).filter(|t| t.exists) else {
            return Ok(None);
        };
        Ok(Some(TableObjects {
            chains: table
                .chains
                .values()
                .map(|c| ListedChain {
                    name: c.decl.name.clone(),
                    base: c
                        .decl
                        .base
                        .map(|b| (b.kind.to_string(), b.hook.to_string(), b.priority)),
                })
                .collect(),
            sets: table
                .sets
                .values()
                .map(|s| ListedSet {
                    name: s.decl.name.clone(),
                    signature: Some(SetSignature::of(family, &s.decl)),
                })
                .collect(),
        }))
    }

    /// The recorded table (every rule is one of ours).
    fn read(&mut self, family: IpFamily, _scope: &ReadScope) -> Result<Option<ReadTable>, NftError> {
        let r = self.recorded();
        Ok(r.tables
            .get(&family)
            .filter(|t| t.exists)
            .map(|t| (t.clone(), Vec::new())))
    }
}

/// Runs `nft -f -` with `input` on stdin.
pub fn nft_apply(input: &str) -> Result<(), NftError> {
    nft(&["-f", "-"], Some(input), |_, stderr| {
        format!("nft -f - failed: {stderr}")
    })
    .map(drop)
}

/// Runs `nft ARGS` and returns its stdout; `failed` says what its exit status and stderr mean.
fn nft(
    args: &[&str],
    stdin: Option<&str>,
    failed: impl FnOnce(std::process::ExitStatus, &str) -> String,
) -> Result<String, NftError> {
    exec::run("nft", args, stdin).map_err(|e| match e {
        exec::Error::Spawn { source, .. } => NftError(format!("running nft: {source}")),
        exec::Error::Failed { status, stderr, .. } => NftError(failed(status, &stderr)),
    })
}

/// Whether the family's table exists (our canary: someone may delete it). Asked over netlink
/// (one message); `nft list tables` fetches every rule of every table first, seconds beside
/// iptables mode's rules at 10k Services.
pub fn table_exists(family: IpFamily) -> bool {
    match super::netlink::NftSocket::new().and_then(|mut s| s.table_exists(family)) {
        Ok(exists) => exists,
        Err(_) => NftCommand.table_exists(family).unwrap_or(false),
    }
}

/// Deletes the family's table if it exists (cleanup, and switching to another mode).
pub fn delete_table(family: IpFamily) -> Result<(), NftError> {
    let f = family_keyword(family);
    nft_apply(&format!("add table {f} {TABLE}\ndelete table {f} {TABLE}\n"))
}

/// Whether a listed set may stay for `decl` (same name assumed): same signature, or unknown.
pub fn compatible(family: IpFamily, listed: &ListedSet, decl: &SetDecl) -> bool {
    listed.signature.is_none_or(|s| s == SetSignature::of(family, decl))
}
