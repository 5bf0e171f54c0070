//! Helpers shared by the integration tests: running the real binary on scenario files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every scenario file under tests/scenarios plus the README example, with the flags written
/// on its `# flags:` line.
pub fn scenarios() -> Vec<(String, PathBuf, Vec<String>)> {
    let mut out = Vec::new();
    let dir = root().join("tests/scenarios");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/scenarios exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for f in files {
        let name = f.file_stem().unwrap().to_string_lossy().to_string();
        let flags = flags_of(&f);
        // Relative paths keep file names in messages (and snapshots) independent of the checkout.
        let rel = f.strip_prefix(root()).map(Path::to_path_buf).unwrap_or(f);
        out.push((name, rel, flags));
    }
    out
}

pub fn flags_of(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("scenario readable");
    text.lines()
        .find_map(|l| l.strip_prefix("# flags:"))
        .map(|f| f.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

pub struct Output {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `kube-proxy ARGS`.
pub fn kube_proxy<S: AsRef<str>>(args: &[S]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(args.iter().map(|a| a.as_ref()))
        .current_dir(root())
        .output()
        .expect("kube-proxy binary runs");
    Output {
        status: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `kube-proxy render FLAGS PATH` → stdout, asserting success.
pub fn render(path: &Path, flags: &[String]) -> String {
    let mut args: Vec<String> = vec!["render".into()];
    args.extend(flags.iter().cloned());
    args.push(path.display().to_string());
    let out = kube_proxy(&args);
    assert_eq!(out.status, 0, "render {} failed: {}", path.display(), out.stderr);
    out.stdout
}

/// Splits the output of `render` into (family header, restore input without comments).
pub fn restore_inputs(rendered: &str) -> Vec<(bool, String)> {
    let mut out: Vec<(bool, String)> = Vec::new();
    for line in rendered.lines() {
        if line.starts_with("# ip6tables-restore") {
            out.push((true, String::new()));
        } else if line.starts_with("# iptables-restore") {
            out.push((false, String::new()));
        } else if !line.starts_with('#')
            && !line.is_empty()
            && let Some(last) = out.last_mut()
        {
            last.1.push_str(line);
            last.1.push('\n');
        }
    }
    out
}
