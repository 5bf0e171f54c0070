//! Log output in upstream's formats, as a `tracing_subscriber` layer of our own.
//!
//! * `text` (default, `--logging-format=text`): klog's header and structured message,
//!   ```text
//!   I1130 13:05:01.123456   12345 daemon.rs:123] "Synced rules" ipFamily="IPv4" full=true
//!   ```
//!   severity letter (`E` error, `W` warning, `I` everything else, as klog prints `V(n)` lines),
//!   month and day, time with microseconds (UTC), the process id padded to 7, the source file's
//!   base name and line, the message quoted as Go's `strconv.Quote`, then `key=value` pairs:
//!   strings quoted (multi-line ones in klog's `key=<` … ` >` block), numbers and booleans bare.
//! * `json` (`--logging-format=json`): component-base's zap encoder,
//!   ```text
//!   {"ts":1701349501123.456,"caller":"src/daemon.rs:123","msg":"Synced rules","v":0,"ipFamily":"IPv4","full":true}
//!   ```
//!   `ts` is milliseconds since the Unix epoch as a float (zap's `epochMillisTimeEncoder`, as
//!   upstream), `caller` is the last two path components and the line (zap's short caller), `v`
//!   the verbosity of the line; error lines have no `v` (zapr's `Error`).
//!
//! Field names are turned from our snake_case into upstream's camelCase (`ip_family` →
//! `ipFamily`), and `error` becomes klog's `err`.
//!
//! **Verbosity** (`-v N`, `--vmodule pattern=N`): every event has a klog level `v` and is written
//! when `v <= N`. Errors, warnings and info events of every crate are `v=0`; debug events of
//! kube-proxy-rs are `v=2` and trace events `v=4`; debug and trace events of libraries (the API
//! client, HTTP) are `v=6` and `v=9`. So `-v 0`/`-v 1` show info and up, `-v 2`/`-v 3` add our
//! debug events, `-v 4`+ our trace events, and `-v 6`/`-v 9` the libraries' debug/trace events.
//! `--vmodule` patterns (klog's: a glob over the file's base name without `.rs`, or over its
//! path when the pattern has a `/`) override `-v` for matching files; the first match wins.
//!
//! Lines are written unbuffered (one `write` per line), to stderr; with
//! `--log-{text,json}-split-stream` errors go to stderr and everything else to stdout.

use std::fmt::{self, Write as _};
use std::io::{self, Write};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::{Context, Layer};

use crate::config::{LogFormat, LoggingConfig};

/// Installs the global logger for `cfg` (a second call is a no-op).
pub fn init(cfg: &LoggingConfig) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let layer = KlogLayer::new(
        cfg,
        StdOutput {
            split_stream: cfg.split_stream,
        },
    );
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// The klog verbosity of an event (see the module documentation).
pub fn event_verbosity(meta: &Metadata<'_>) -> u32 {
    let ours = meta.target().starts_with("kube_proxy");
    match *meta.level() {
        Level::ERROR | Level::WARN | Level::INFO => 0,
        Level::DEBUG => {
            if ours {
                2
            } else {
                6
            }
        }
        _ => {
            if ours {
                4
            } else {
                9
            }
        }
    }
}

/// The layer: filters by verbosity and writes each event as one line.
pub struct KlogLayer<W> {
    format: LogFormat,
    verbosity: u32,
    vmodule: Vec<(String, u32)>,
    pid: u32,
    writer: W,
}

impl<W> KlogLayer<W> {
    pub fn new(cfg: &LoggingConfig, writer: W) -> KlogLayer<W> {
        KlogLayer {
            format: cfg.format,
            verbosity: cfg.verbosity,
            vmodule: cfg.vmodule.clone(),
            pid: std::process::id(),
            writer,
        }
    }

    /// The verbosity threshold for events of this callsite (`--vmodule`, else `-v`).
    fn threshold(&self, meta: &Metadata<'_>) -> u32 {
        if let Some(file) = meta.file() {
            for (pattern, v) in &self.vmodule {
                if vmodule_matches(pattern, file) {
                    return *v;
                }
            }
        }
        self.verbosity
    }

    fn is_enabled(&self, meta: &Metadata<'_>) -> bool {
        matches!(*meta.level(), Level::ERROR | Level::WARN) || event_verbosity(meta) <= self.threshold(meta)
    }

    /// One output line (with its newline) for `event` at `now`.
    pub fn format_event(&self, event: &Event<'_>, now: SystemTime) -> String {
        let meta = event.metadata();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let file = fields.log_file.clone().or_else(|| meta.file().map(str::to_string));
        let line = fields.log_line.or(meta.line()).unwrap_or(0);
        match self.format {
            LogFormat::Text => {
                let base = file.as_deref().map_or("???", |f| f.rsplit('/').next().unwrap_or(f));
                let mut out = klog_header(severity(meta.level()), now, self.pid, base, line);
                out.push_str(&go_quote(&fields.message));
                for (k, v) in &fields.kvs {
                    out.push(' ');
                    out.push_str(k);
                    out.push('=');
                    v.write_text(&mut out);
                }
                out.push('\n');
                out
            }
            LogFormat::Json => {
                let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
                let ts = since.as_secs_f64() * 1000.0;
                let caller = file.as_deref().map_or_else(|| "???".to_string(), short_caller);
                let mut out = String::from("{\"ts\":");
                out.push_str(&serde_json::to_string(&ts).unwrap_or_else(|_| "0".into()));
                out.push_str(",\"caller\":");
                out.push_str(&json_string(&format!("{caller}:{line}")));
                out.push_str(",\"msg\":");
                out.push_str(&json_string(&fields.message));
                if *meta.level() != Level::ERROR {
                    let _ = write!(out, ",\"v\":{}", event_verbosity(meta));
                }
                for (k, v) in &fields.kvs {
                    out.push(',');
                    out.push_str(&json_string(k));
                    out.push(':');
                    v.write_json(&mut out);
                }
                out.push_str("}\n");
                out
            }
        }
    }
}

impl<S, W> Layer<S> for KlogLayer<W>
where
    S: Subscriber,
    W: for<'a> MakeWriter<'a> + 'static,
{
    fn register_callsite(&self, _meta: &'static Metadata<'static>) -> Interest {
        // Decided per event in `enabled` (cheap), so that the callsite cache never pins a
        // decision of another subscriber (tests install several).
        Interest::sometimes()
    }

    fn enabled(&self, meta: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        self.is_enabled(meta)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        let max = self
            .vmodule
            .iter()
            .map(|(_, v)| *v)
            .chain([self.verbosity])
            .max()
            .unwrap_or(0);
        Some(if max >= 4 {
            LevelFilter::TRACE
        } else if max >= 2 {
            LevelFilter::DEBUG
        } else {
            LevelFilter::INFO
        })
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if !self.is_enabled(event.metadata()) {
            return;
        }
        let line = self.format_event(event, SystemTime::now());
        let mut w = self.writer.make_writer_for(event.metadata());
        let _ = w.write_all(line.as_bytes());
        let _ = w.flush();
    }
}

/// stderr, or with split streams: errors to stderr, the rest to stdout.
pub struct StdOutput {
    pub split_stream: bool,
}

pub enum StdStream {
    Out(io::Stdout),
    Err(io::Stderr),
}

impl Write for StdStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            StdStream::Out(o) => o.write(buf),
            StdStream::Err(e) => e.write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            StdStream::Out(o) => o.lock().write_all(buf),
            StdStream::Err(e) => e.lock().write_all(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            StdStream::Out(o) => o.flush(),
            StdStream::Err(e) => e.flush(),
        }
    }
}

impl<'a> MakeWriter<'a> for StdOutput {
    type Writer = StdStream;

    fn make_writer(&'a self) -> StdStream {
        StdStream::Err(io::stderr())
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> StdStream {
        if self.split_stream && *meta.level() != Level::ERROR {
            StdStream::Out(io::stdout())
        } else {
            StdStream::Err(io::stderr())
        }
    }
}

fn severity(level: &Level) -> char {
    match *level {
        Level::ERROR => 'E',
        Level::WARN => 'W',
        _ => 'I',
    }
}

/// klog's header: `Lmmdd hh:mm:ss.uuuuuu threadid file:line] ` (UTC).
pub fn klog_header(severity: char, now: SystemTime, pid: u32, file: &str, line: u32) -> String {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs() as i64;
    let (_, month, day) = civil_from_days(secs.div_euclid(86400));
    let tod = secs.rem_euclid(86400);
    format!(
        "{severity}{month:02}{day:02} {:02}:{:02}:{:02}.{:06} {pid:>7} {file}:{line}] ",
        tod / 3600,
        tod / 60 % 60,
        tod % 60,
        since.subsec_micros()
    )
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm); also
/// `/healthz`'s RFC 3339 times.
pub(crate) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// zap's short caller: the last two path components.
fn short_caller(file: &str) -> String {
    let parts: Vec<&str> = file.rsplitn(3, '/').collect();
    match parts.as_slice() {
        [name, dir, ..] => format!("{dir}/{name}"),
        _ => file.to_string(),
    }
}

/// klog's `--vmodule` match: a glob (`*`, `?`) over the base name without `.rs`, or over the
/// whole path without `.rs` when the pattern contains `/`.
pub fn vmodule_matches(pattern: &str, file: &str) -> bool {
    let file = file.strip_suffix(".rs").unwrap_or(file);
    let subject = if pattern.contains('/') {
        file
    } else {
        file.rsplit('/').next().unwrap_or(file)
    };
    glob(pattern.as_bytes(), subject.as_bytes())
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && glob(rest, &s[1..]),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

/// Go's `strconv.Quote`.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c == '\x7f' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `ip_family` → `ipFamily`; `error` → `err` (klog's key for errors).
pub fn klog_key(name: &str) -> String {
    if name == "error" {
        return "err".into();
    }
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' && !out.is_empty() {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

enum Value {
    Str(String),
    Int(i128),
    Float(f64),
    Bool(bool),
}

impl Value {
    /// klog's text form.
    fn write_text(&self, out: &mut String) {
        match self {
            Value::Str(s) => write_klog_string(out, s),
            Value::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Value::Float(f) => {
                let _ = write!(out, "{f}");
            }
            Value::Bool(b) => {
                let _ = write!(out, "{b}");
            }
        }
    }

    fn write_json(&self, out: &mut String) {
        match self {
            Value::Str(s) => out.push_str(&json_string(s)),
            Value::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Value::Float(f) if f.is_finite() => out.push_str(&serde_json::to_string(f).unwrap_or_default()),
            Value::Float(f) => out.push_str(&json_string(&f.to_string())),
            Value::Bool(b) => {
                let _ = write!(out, "{b}");
            }
        }
    }
}

/// klog's `writeStringValue`: quoted, or a `<` … ` >` block for multi-line strings.
fn write_klog_string(out: &mut String, s: &str) {
    if !s.contains('\n') {
        out.push_str(&go_quote(s));
        return;
    }
    out.push_str("<\n");
    let mut rest = s;
    while let Some(i) = rest.find('\n') {
        out.push('\t');
        out.push_str(&rest[..=i]);
        rest = &rest[i + 1..];
    }
    if rest.is_empty() {
        out.push_str(" >");
    } else {
        out.push('\t');
        out.push_str(rest);
        out.push_str("\n >");
    }
}

/// An event's message and key/value pairs, in order.
#[derive(Default)]
struct Fields {
    message: String,
    kvs: Vec<(String, Value)>,
    /// The source location of events bridged from the `log` crate.
    log_file: Option<String>,
    log_line: Option<u32>,
}

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        let name = field.name();
        match (name, value) {
            ("message", Value::Str(s)) => self.message = s,
            ("log.file", Value::Str(s)) => self.log_file = Some(s),
            ("log.line", Value::Int(i)) => self.log_line = u32::try_from(i).ok(),
            (n, _) if n.starts_with("log.") => {}
            (n, v) => self.kvs.push((klog_key(n), v)),
        }
    }
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::Str(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::Str(value.to_string()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::Int(i128::from(value)));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::Int(i128::from(value)));
    }

    fn record_i128(&mut self, field: &Field, value: i128) {
        self.put(field, Value::Int(value));
    }

    fn record_u128(&mut self, field: &Field, value: u128) {
        match i128::try_from(value) {
            Ok(v) => self.put(field, Value::Int(v)),
            Err(_) => self.put(field, Value::Str(value.to_string())),
        }
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Value::Float(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::Bool(value));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::Str(value.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tracing_subscriber::layer::SubscriberExt;

    /// Captures everything written, as one string.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Capture {
        type Writer = Capture;
        fn make_writer(&'a self) -> Capture {
            self.clone()
        }
    }

    fn capture(cfg: LoggingConfig, f: impl FnOnce()) -> String {
        let out = Capture::default();
        let subscriber = tracing_subscriber::registry().with(KlogLayer::new(&cfg, out.clone()));
        tracing::subscriber::with_default(subscriber, f);
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    fn text(verbosity: u32) -> LoggingConfig {
        LoggingConfig {
            verbosity,
            ..LoggingConfig::default()
        }
    }

    /// `I` + MMDD + space + hh:mm:ss.uuuuuu + space + pid padded to 7 + space; returns the rest.
    fn strip_header(line: &str, sev: char) -> &str {
        let b = line.as_bytes();
        assert_eq!(b[0] as char, sev, "{line}");
        assert!(b[1..5].iter().all(u8::is_ascii_digit), "{line}");
        assert_eq!(b[5], b' ', "{line}");
        let time = &line[6..21];
        assert!(
            time.bytes().enumerate().all(|(i, c)| match i {
                2 | 5 => c == b':',
                8 => c == b'.',
                _ => c.is_ascii_digit(),
            }),
            "{line}"
        );
        assert_eq!(b[21], b' ', "{line}");
        let pid = format!("{:>7}", std::process::id());
        assert_eq!(&line[22..29], pid, "{line}");
        assert_eq!(b[29], b' ', "{line}");
        &line[30..]
    }

    #[test]
    fn klog_text_line() {
        let out = capture(text(0), || {
            tracing::info!(ip_family = "IPv4", full = true, deleted_chains = 3u64, "Synced rules");
        });
        let rest = strip_header(&out, 'I');
        let (caller, body) = rest.split_once("] ").unwrap();
        assert!(caller.starts_with("logging.rs:"), "{out}");
        assert!(caller["logging.rs:".len()..].parse::<u32>().is_ok(), "{out}");
        assert_eq!(body, "\"Synced rules\" ipFamily=\"IPv4\" full=true deletedChains=3\n");
    }

    #[test]
    fn severities_errors_and_quoting() {
        let err = io::Error::other("permission \"denied\"");
        let out = capture(text(0), || {
            tracing::warn!(node = %"node-a", "Could not do it");
            tracing::error!(error = %err, "Sync failed");
            tracing::info!(detail = "line one\nline two", "Multi");
        });
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            strip_header(lines[0], 'W').ends_with("] \"Could not do it\" node=\"node-a\""),
            "{out}"
        );
        assert!(
            strip_header(lines[1], 'E').ends_with("] \"Sync failed\" err=\"permission \\\"denied\\\"\""),
            "{out}"
        );
        assert!(strip_header(lines[2], 'I').ends_with("] \"Multi\" detail=<"), "{out}");
        assert_eq!(lines[3], "\tline one");
        assert_eq!(lines[4], "\tline two");
        assert_eq!(lines[5], " >");
    }

    #[test]
    fn verbosity_levels() {
        let emit = || {
            tracing::info!("info");
            tracing::debug!("debug");
            tracing::trace!("trace");
        };
        let count = |v| capture(text(v), emit).lines().count();
        assert_eq!((count(0), count(1), count(2), count(3), count(4)), (1, 1, 2, 2, 3));
        let vmodule = LoggingConfig {
            vmodule: vec![("log*".into(), 4)],
            ..text(0)
        };
        assert_eq!(capture(vmodule, emit).lines().count(), 3);
        let other = LoggingConfig {
            vmodule: vec![("daemon".into(), 4)],
            ..text(0)
        };
        assert_eq!(capture(other, emit).lines().count(), 1);
        assert!(vmodule_matches("src/log*", "src/logging.rs") && !vmodule_matches("src/x*", "src/logging.rs"));
    }

    #[test]
    fn json_lines() {
        let cfg = LoggingConfig {
            format: LogFormat::Json,
            verbosity: 2,
            ..LoggingConfig::default()
        };
        let out = capture(cfg, || {
            tracing::info!(ip_family = "IPv4", full = true, elapsed_ms = 1.5, "Synced rules");
            tracing::debug!(n = -3i64, "Detail");
            tracing::error!(error = "boom", "Failed");
        });
        let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).expect(l)).collect();
        assert_eq!(lines.len(), 3, "{out}");
        let first = &lines[0];
        assert_eq!(first["msg"], "Synced rules");
        assert!(
            first["caller"].as_str().unwrap().starts_with("src/logging.rs:"),
            "{out}"
        );
        assert!(first["ts"].as_f64().unwrap() > 1.6e12, "milliseconds: {out}");
        assert_eq!(
            (first["v"].as_u64(), first["ipFamily"].as_str()),
            (Some(0), Some("IPv4"))
        );
        assert_eq!(
            (first["full"].as_bool(), first["elapsedMs"].as_f64()),
            (Some(true), Some(1.5))
        );
        assert_eq!((lines[1]["v"].as_u64(), lines[1]["n"].as_i64()), (Some(2), Some(-3)));
        assert!(lines[2].get("v").is_none() && lines[2]["err"] == "boom", "{out}");
        // Keys in zap's order.
        assert!(out.lines().next().unwrap().starts_with("{\"ts\":"), "{out}");
    }

    #[test]
    fn header_and_helpers() {
        // 2023-11-30 13:05:01.123456 UTC.
        let t = UNIX_EPOCH + Duration::from_micros(1_701_349_501_123_456);
        assert_eq!(
            klog_header('I', t, 12345, "daemon.rs", 123),
            "I1130 13:05:01.123456   12345 daemon.rs:123] "
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(klog_key("nf_conntrack_max"), "nfConntrackMax");
        assert_eq!(klog_key("error"), "err");
        assert_eq!(go_quote("a\"b\\c\x01é"), "\"a\\\"b\\\\c\\x01é\"");
        assert_eq!(short_caller("/x/y/src/iptables/proxier.rs"), "iptables/proxier.rs");
    }
}
