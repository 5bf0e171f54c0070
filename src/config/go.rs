//! Go's value syntaxes as upstream reads and writes them: `time.Duration` (`30s`, `1m0s`),
//! component-base's `TimeOrMetaDuration`, `resource.Quantity` (`512`, `2Ki`) and
//! `strconv.ParseBool`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A Go `time.Duration` (`metav1.Duration` on the wire): signed nanoseconds, parsed and written
/// as Go does (`"30s"`, `"1m0s"`, `"24h0m0s"`, `"500ms"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub i64);

const NS_PER_SEC: i64 = 1_000_000_000;

impl GoDuration {
    pub const ZERO: GoDuration = GoDuration(0);

    pub const fn from_secs(s: i64) -> GoDuration {
        GoDuration(s * NS_PER_SEC)
    }

    /// Go's `time.ParseDuration`: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, or `0`.
    pub fn parse(raw: &str) -> Result<GoDuration, String> {
        let bad = || format!("time: invalid duration {raw:?} (use e.g. 30s, 1m0s, 500ms or 2h45m)");
        let mut s = raw;
        let negative = match s.as_bytes().first() {
            Some(b'-') => {
                s = &s[1..];
                true
            }
            Some(b'+') => {
                s = &s[1..];
                false
            }
            _ => false,
        };
        if s == "0" {
            return Ok(GoDuration(0));
        }
        if s.is_empty() {
            return Err(bad());
        }
        let mut total: i128 = 0;
        while !s.is_empty() {
            let int_len = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (int_part, rest) = s.split_at(int_len);
            let (frac_part, rest) = match rest.strip_prefix('.') {
                Some(r) => {
                    let n = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
                    r.split_at(n)
                }
                None => ("", rest),
            };
            if int_part.is_empty() && frac_part.is_empty() {
                return Err(bad());
            }
            let unit_len = rest
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(rest.len());
            let (unit, rest) = rest.split_at(unit_len);
            let scale: i128 = match unit {
                "ns" => 1,
                "us" | "µs" | "μs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                "" => return Err(format!("time: missing unit in duration {raw:?} (use e.g. 30s)")),
                other => {
                    return Err(format!(
                        "time: unknown unit {other:?} in duration {raw:?} (use ns, us, ms, s, m or h)"
                    ));
                }
            };
            let int: i128 = if int_part.is_empty() {
                0
            } else {
                int_part.parse().map_err(|_| bad())?
            };
            let mut frac: i128 = 0;
            let mut frac_scale: i128 = 1;
            for d in frac_part.bytes().take(18) {
                frac = frac * 10 + i128::from(d - b'0');
                frac_scale *= 10;
            }
            total = int
                .checked_mul(scale)
                .and_then(|v| v.checked_add(frac * scale / frac_scale))
                .and_then(|v| total.checked_add(v))
                .filter(|v| *v <= i128::from(i64::MAX))
                .ok_or_else(bad)?;
            s = rest;
        }
        let total = total as i64;
        Ok(GoDuration(if negative { -total } else { total }))
    }

    pub fn is_negative(self) -> bool {
        self.0 < 0
    }

    /// The duration, with negative values as zero (validation rejects them first).
    pub fn to_std(self) -> Duration {
        Duration::from_nanos(self.0.max(0) as u64)
    }

    pub fn from_std(d: Duration) -> GoDuration {
        GoDuration(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    }
}

/// Go's `Duration.String()`.
impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let neg = self.0 < 0;
        let u = self.0.unsigned_abs();
        let sign = if neg { "-" } else { "" };
        if u == 0 {
            return f.write_str("0s");
        }
        // The fraction of `v / 10^prec`, without trailing zeros.
        fn frac(v: u64, prec: u32) -> String {
            let p = 10u64.pow(prec);
            let (whole, rem) = (v / p, v % p);
            if rem == 0 {
                return whole.to_string();
            }
            let digits = format!("{rem:0width$}", width = prec as usize);
            format!("{whole}.{}", digits.trim_end_matches('0'))
        }
        if u < 1_000_000_000 {
            return if u < 1_000 {
                write!(f, "{sign}{u}ns")
            } else if u < 1_000_000 {
                write!(f, "{sign}{}µs", frac(u, 3))
            } else {
                write!(f, "{sign}{}ms", frac(u, 6))
            };
        }
        let secs_total = u / 1_000_000_000;
        let nanos = u % 1_000_000_000;
        let secs = frac((secs_total % 60) * 1_000_000_000 + nanos, 9);
        let mins_total = secs_total / 60;
        if mins_total == 0 {
            return write!(f, "{sign}{secs}s");
        }
        let (hours, mins) = (mins_total / 60, mins_total % 60);
        if hours == 0 {
            write!(f, "{sign}{mins}m{secs}s")
        } else {
            write!(f, "{sign}{hours}h{mins}m{secs}s")
        }
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(GoDuration(0)),
            Some(s) => GoDuration::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// component-base's `TimeOrMetaDuration` (`logging.flushFrequency`): a duration string, or an
/// integer number of nanoseconds; written back in the form it was read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimeOrMetaDuration {
    pub duration: GoDuration,
    pub serialize_as_string: bool,
}

impl Serialize for TimeOrMetaDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.serialize_as_string {
            self.duration.serialize(s)
        } else {
            s.serialize_i64(self.duration.0)
        }
    }
}

impl<'de> Deserialize<'de> for TimeOrMetaDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            S(String),
            N(i64),
        }
        match Option::<Raw>::deserialize(d)? {
            None => Ok(TimeOrMetaDuration::default()),
            Some(Raw::N(n)) => Ok(TimeOrMetaDuration {
                duration: GoDuration(n),
                serialize_as_string: false,
            }),
            Some(Raw::S(s)) => GoDuration::parse(&s)
                .map(|duration| TimeOrMetaDuration {
                    duration,
                    serialize_as_string: true,
                })
                .map_err(serde::de::Error::custom),
        }
    }
}

/// A Kubernetes `resource.Quantity` (`512`, `1K`, `2Ki`, `5Mi`, `1e3`), kept as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantity(pub String);

impl Default for Quantity {
    fn default() -> Self {
        Quantity("0".into())
    }
}

impl Quantity {
    /// The value in units (bytes), rounded up as `Quantity.Value()` does.
    pub fn value(&self) -> Result<i128, String> {
        let s = self.0.trim();
        let bad = || format!("{s:?} is not a quantity like 512, 1K, 2Ki, 5Mi or 1e3");
        let num_len = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
            .unwrap_or(s.len());
        let (num, suffix) = s.split_at(num_len);
        let n: f64 = num.parse().map_err(|_| bad())?;
        let scale: f64 = match suffix {
            "" => 1.0,
            "Ki" => 1024f64,
            "Mi" => 1024f64.powi(2),
            "Gi" => 1024f64.powi(3),
            "Ti" => 1024f64.powi(4),
            "Pi" => 1024f64.powi(5),
            "Ei" => 1024f64.powi(6),
            "n" => 1e-9,
            "u" => 1e-6,
            "m" => 1e-3,
            "k" => 1e3,
            "M" => 1e6,
            "G" => 1e9,
            "T" => 1e12,
            "P" => 1e15,
            "E" => 1e18,
            e if e.starts_with(['e', 'E']) => {
                let exp: i32 = e[1..].parse().map_err(|_| bad())?;
                10f64.powi(exp)
            }
            _ => return Err(bad()),
        };
        Ok((n * scale).ceil() as i128)
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<serde_json::Value>::deserialize(d)? {
            None => Ok(Quantity::default()),
            Some(serde_json::Value::String(s)) => Ok(Quantity(s)),
            Some(serde_json::Value::Number(n)) => Ok(Quantity(n.to_string())),
            Some(other) => Err(serde::de::Error::custom(format!("invalid quantity {other}"))),
        }
    }
}

/// Go's `strconv.ParseBool`.
pub fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Parses a non-negative Go `time.Duration` string: `300ms`, `1.5s`, `1m0s`, `2h45m`, `0`.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let d = GoDuration::parse(raw.trim())?;
    if d.is_negative() {
        return Err("must be greater than or equal to 0".into());
    }
    Ok(d.to_std())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Flags, ProxyConfig};

    #[test]
    fn durations_parse_and_print_like_go() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1m0s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("30").is_err() && parse_duration("-1s").is_err() && parse_duration("1x").is_err());
        assert_eq!(GoDuration::parse("-1.5h").unwrap(), GoDuration(-5_400_000_000_000));
        for (d, s) in [
            (GoDuration(0), "0s"),
            (GoDuration::from_secs(30), "30s"),
            (GoDuration::from_secs(60), "1m0s"),
            (GoDuration::from_secs(90), "1m30s"),
            (GoDuration::from_secs(3600), "1h0m0s"),
            (GoDuration::from_secs(86400), "24h0m0s"),
            (GoDuration(1_500_000_000), "1.5s"),
            (GoDuration(500_000_000), "500ms"),
            (GoDuration(1_500), "1.5µs"),
            (GoDuration(7), "7ns"),
            (GoDuration(-61_000_000_000), "-1m1s"),
        ] {
            assert_eq!(d.to_string(), s);
            assert_eq!(GoDuration::parse(s).unwrap(), d, "{s}");
        }
        let e = ProxyConfig::resolve(&Flags {
            iptables_sync_period: Some("soon".into()),
            ..Flags::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--iptables-sync-period") && e.contains("soon"), "{e}");
    }
}
