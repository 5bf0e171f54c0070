//! Label and field selectors, query strings and small JSON helpers of the test API server.

use super::*;

/// Namespace, label and field selection of a list or watch.
pub(super) struct Filter {
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<(String, bool, String)>,
}

pub(super) enum LabelReq {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Filter {
    pub(super) fn new(namespace: Option<String>, q: &Query) -> Result<Filter, String> {
        Ok(Filter {
            namespace,
            labels: parse_label_selector(q.get("labelSelector").unwrap_or(""))?,
            fields: parse_field_selector(q.get("fieldSelector").unwrap_or(""))?,
        })
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && str_at(obj, &["metadata", "namespace"]).unwrap_or("") != ns
        {
            return false;
        }
        let label = |k: &str| {
            obj.get("metadata")
                .and_then(|m| m.get("labels"))
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
        };
        let labels_ok = self.labels.iter().all(|req| match req {
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
            LabelReq::In(k, vs) => label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|v| vs.iter().all(|x| x != v)),
        });
        labels_ok
            && self
                .fields
                .iter()
                .all(|(path, eq, want)| (field_value(obj, path) == *want) == *eq)
    }
}

/// Splits at commas outside parentheses.
pub(super) fn split_terms(s: &str) -> Vec<&str> {
    let (mut terms, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(s[start..].trim());
    terms.into_iter().filter(|t| !t.is_empty()).collect()
}

pub(super) fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, String> {
    let invalid = || format!("unable to parse label selector {s:?}");
    let key = |k: &str| {
        let k = k.trim();
        if k.is_empty() || k.contains(char::is_whitespace) {
            Err(invalid())
        } else {
            Ok(k.to_string())
        }
    };
    split_terms(s)
        .into_iter()
        .map(|term| {
            if let Some(k) = term.strip_prefix('!') {
                return Ok(LabelReq::NotExists(key(k)?));
            }
            if let Some(open) = term.find('(') {
                let values = term[open + 1..].strip_suffix(')').ok_or_else(invalid)?;
                let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
                let mut head = term[..open].split_whitespace();
                let (k, op) = (head.next().ok_or_else(invalid)?, head.next().ok_or_else(invalid)?);
                return match (op, head.next()) {
                    ("in", None) => Ok(LabelReq::In(key(k)?, values)),
                    ("notin", None) => Ok(LabelReq::NotIn(key(k)?, values)),
                    _ => Err(invalid()),
                };
            }
            if let Some((k, v)) = term.split_once("!=") {
                return Ok(LabelReq::NotIn(key(k)?, vec![v.trim().to_string()]));
            }
            if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                return Ok(LabelReq::In(key(k)?, vec![v.trim().to_string()]));
            }
            Ok(LabelReq::Exists(key(term)?))
        })
        .collect()
}

/// `path=value`, `path==value`, `path!=value`; `(path, equal, value)`.
pub(super) fn parse_field_selector(s: &str) -> Result<Vec<(String, bool, String)>, String> {
    split_terms(s)
        .into_iter()
        .map(|term| {
            let (path, eq, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (p, true, v)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            Ok((path.trim().to_string(), eq, value.trim().to_string()))
        })
        .collect()
}

/// A dotted path's value as a string ("" when absent), as field selectors compare it.
pub(super) fn field_value(obj: &Value, path: &str) -> String {
    match path.split('.').try_fold(obj, |v, k| v.get(k)) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Query strings

/// Decoded query parameters, in order.
pub(super) struct Query(pub(super) Vec<(String, String)>);

impl Query {
    pub(super) fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

pub(super) fn parse_query(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (form_decode(k), form_decode(v))
        })
        .collect()
}

pub(super) fn form_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn request_line(method: &Method, path: &str, query: &[(String, String)]) -> String {
    if query.is_empty() {
        return format!("{method} {path}");
    }
    let query: Vec<String> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{method} {path}?{}", query.join("&"))
}

// ---------------------------------------------------------------------------------------------
// JSON helpers

pub(super) fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(*k))?.as_str()
}

/// `obj.metadata` as a map, created if missing. Panics if `obj` is not an object.
pub(super) fn meta_mut(obj: &mut Value) -> &mut serde_json::Map<String, Value> {
    let obj = obj
        .as_object_mut()
        .expect("test API server: objects must be JSON objects");
    let meta = obj.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut().expect("metadata is an object")
}

/// `obj` as the version `api_version` of its kind serves it (the versions of a kind share one
/// storage).
pub(super) fn served_as(obj: &Value, api_version: &str) -> Value {
    let mut obj = obj.clone();
    obj["apiVersion"] = json!(api_version);
    obj
}
