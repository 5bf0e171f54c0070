//! The nftables proxier, first version: every sync replaces the family's `kube-proxy` table in
//! one atomic `nft -f -` transaction ("add table; delete table" — nft 1.0.6 has no `destroy` —
//! then the full rendered transaction), so no stale chain or set can survive and established
//! connections keep their conntrack NAT state. Incremental transactions (upstream's partial
//! syncs and element diffs) are the next step; the layout and names already match upstream.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::names::TABLE;
use super::render::render_transaction;
use crate::iptables::render::RenderOptions;
use crate::model::{IpFamily, ProxyState};

/// `nft` failed; the caller keeps the previous rules (the transaction is atomic) and retries.
#[derive(Debug, thiserror::Error)]
#[error("nft -f - failed: {stderr}")]
pub struct NftError {
    pub stderr: String,
}

fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// Runs `nft -f -` with `input` on stdin.
pub fn nft_apply(input: &str) -> Result<(), NftError> {
    let err = |e: std::io::Error| NftError {
        stderr: format!("running nft: {e}"),
    };
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(err)?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(input.as_bytes());
    }
    let out = child.wait_with_output().map_err(err)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NftError {
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Whether the family's table exists (our canary: someone may delete it).
pub fn table_exists(family: IpFamily) -> bool {
    Command::new("nft")
        .args(["list", "table", family_name(family), TABLE])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Deletes the family's table if it exists (cleanup, and switching to another mode).
pub fn delete_table(family: IpFamily) -> Result<(), NftError> {
    let f = family_name(family);
    nft_apply(&format!("add table {f} {TABLE}\ndelete table {f} {TABLE}\n"))
}

pub struct NftProxier {
    family: IpFamily,
    opts: RenderOptions,
    last: Option<String>,
}

impl NftProxier {
    pub fn new(family: IpFamily, opts: RenderOptions) -> NftProxier {
        NftProxier {
            family,
            opts,
            last: None,
        }
    }

    pub fn set_options(&mut self, opts: RenderOptions) {
        if opts != self.opts {
            self.opts = opts;
            self.last = None;
        }
    }

    pub fn force_full_sync(&mut self) {
        self.last = None;
    }

    /// Replaces the table when the rendered transaction differs from the applied one; returns
    /// the time taken (zero when nothing changed).
    pub fn sync(&mut self, state: &ProxyState) -> Result<Duration, NftError> {
        let start = Instant::now();
        let body = render_transaction(state, &self.opts, true);
        if self.last.as_deref() == Some(body.as_str()) {
            return Ok(Duration::ZERO);
        }
        let f = family_name(self.family);
        let input = format!("add table {f} {TABLE}\ndelete table {f} {TABLE}\n{body}");
        match nft_apply(&input) {
            Ok(()) => {
                self.last = Some(body);
                Ok(start.elapsed())
            }
            Err(e) => {
                self.last = None;
                Err(e)
            }
        }
    }
}
