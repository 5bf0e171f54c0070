//! Asking `kube-proxy explain` in a test bed's namespace, and reading its answer (the text
//! report and the JSON one) for the tests of `tests/explain.rs` and the VM's.
#![allow(dead_code)]

use kube_proxy::explain::report::WIDTH;
use kube_proxy::lab::netns::Netns;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");

/// What one question to `explain` answered, as text and as JSON.
pub struct Explained {
    /// The exit status.
    pub code: i32,
    pub text: String,
    pub json: Value,
}

impl Explained {
    pub fn problems(&self) -> Vec<String> {
        self.json["problems"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| p["code"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The problem's text, checked to be in the text report too.
    pub fn problem(&self, code: &str) -> String {
        let p = self.json["problems"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["code"] == code))
            .unwrap_or_else(|| panic!("no {code} problem in {:?}:\n{}", self.problems(), self.text));
        let text = p["text"].as_str().unwrap_or_default().to_string();
        // Wrapped in the text (a long word may be cut): compared without whitespace; and
        // without digits, as the two runs measure (conntrack counters, times) for themselves.
        let squeeze = |t: &str| {
            t.chars()
                .filter(|c| !c.is_whitespace() && !c.is_ascii_digit())
                .collect::<String>()
        };
        assert!(
            squeeze(&self.text).contains(&squeeze(&text)),
            "the text report says it too: {text}\n{}",
            self.text
        );
        text
    }

    pub fn port(&self) -> &Value {
        &self.json["facts"]["ports"][0]
    }
}

/// `kube-proxy explain ARGS` in the namespace `ns` (ARGS carry the configuration), as text
/// and as JSON (the same exit status both ways); every text line within the report's width.
pub fn explain(ns: &Netns, args: &[String]) -> Explained {
    let run = |output: &str| {
        let mut all: Vec<String> = vec!["explain".into()];
        all.extend(args.iter().cloned());
        all.extend(["--output".into(), output.into()]);
        let out = ns.exec(BIN, &all).expect("explain runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code().unwrap_or(-1), stdout, stderr)
    };
    let (code, text, err) = run("text");
    let (json_code, json, json_err) = run("json");
    assert_eq!(code, json_code, "text {err} / json {json_err}");
    for line in text.lines() {
        assert!(line.chars().count() <= WIDTH, "longer than {WIDTH}: {line:?}");
    }
    let json: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("JSON ({e}): {json}\n{json_err}"));
    println!("explain {}: exit {code}\n{text}", args.join(" "));
    println!("the daemon as explain saw it: {}", json["facts"]["daemon"]);
    Explained { code, text, json }
}
