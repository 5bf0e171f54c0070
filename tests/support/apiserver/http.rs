//! The test API server's HTTP side: routing, GET and LIST (with paging), event writes, and
//! the Kubernetes `Status` answers.

use super::*;

pub(super) async fn handle(
    AxState(sh): AxState<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let query = parse_query(uri.query());
    let (delay, token) = {
        let mut st = sh.lock();
        st.requests.push(request_line(&method, uri.path(), &query));
        (st.delay, st.token.clone())
    };
    if let Some(token) = token {
        let sent = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if sent != Some(format!("Bearer {token}").as_str()) {
            return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
        }
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let query = Query(query);
    let watch = matches!(query.get("watch"), Some("true" | "1"));
    let response = route(&sh, &method, uri.path(), &query, &headers, &body);
    // Watch streams cut themselves (see `WatchStream::next_chunk`).
    if method == Method::GET && !watch && response.status() == StatusCode::OK && sh.lock().truncated {
        return truncated(response).await;
    }
    response
}

/// `response` with the `Content-Length` of its whole body and only the first half of it sent,
/// then the connection aborted.
async fn truncated(response: Response) -> Response {
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "body");
    };
    parts
        .headers
        .insert(header::CONTENT_LENGTH, header::HeaderValue::from(bytes.len()));
    let half = bytes.slice(..bytes.len() / 2);
    let chunks: [Result<Bytes, io::Error>; 2] = [
        Ok(half),
        Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "response truncated by the test API server",
        )),
    ];
    Response::from_parts(parts, Body::from_stream(futures::stream::iter(chunks)))
}

pub(super) fn route(
    sh: &Arc<Shared>,
    method: &Method,
    path: &str,
    q: &Query,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    if path == "/version" && method == Method::GET {
        return Json(json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0", "gitCommit": "test", "gitTreeState": "clean",
            "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"
        }))
        .into_response();
    }
    let served = |res: &Resource| !sh.lock().unserved.contains(&res.api_version);
    let Some((res, ns, name)) = parse_path(path).filter(|(res, _, _)| served(res)) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        );
    };
    if res.event {
        return write_event(
            sh,
            res,
            ns.as_deref().unwrap_or("default"),
            name.as_deref(),
            method,
            headers,
            body,
        );
    }
    match (method, name) {
        (&Method::GET, Some(name)) => get(sh, res, ns.as_deref().unwrap_or(""), &name),
        (&Method::GET, None) if matches!(q.get("watch"), Some("true" | "1")) => start_watch(sh, res, ns, q),
        (&Method::GET, None) => list(sh, res, ns, q),
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the test API server does not support {method} on {}", res.plural),
        ),
    }
}

/// Splits `/api/v1[/namespaces/{ns}]/{plural}[/{name}]` (or `/apis/{group}/{version}/…`).
pub(super) fn parse_path(path: &str) -> Option<(&'static Resource, Option<String>, Option<String>)> {
    let (prefix, rest) = if let Some(rest) = path.strip_prefix("/api/v1/") {
        ("/api/v1".to_string(), rest)
    } else {
        let rest = path.strip_prefix("/apis/")?;
        let mut it = rest.splitn(3, '/');
        let (group, version, rest) = (it.next()?, it.next()?, it.next()?);
        (format!("/apis/{group}/{version}"), rest)
    };
    let segs: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    let (ns, plural, name) = match segs.as_slice() {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        _ => return None,
    };
    let res = RESOURCES.iter().find(|r| r.prefix == prefix && r.plural == plural)?;
    if ns.is_some() && !res.namespaced || [ns, Some(plural), name].iter().flatten().any(|s| s.is_empty()) {
        return None;
    }
    Some((res, ns.map(str::to_string), name.map(str::to_string)))
}

pub(super) fn get(sh: &Shared, res: &'static Resource, ns: &str, name: &str) -> Response {
    let st = sh.lock();
    match st.objects.get(&(res.kind, ns.to_string(), name.to_string())) {
        Some(obj) => Json(served_as(obj, res.api_version)).into_response(),
        None => not_found(res, name),
    }
}

pub(super) fn list(sh: &Shared, res: &'static Resource, ns: Option<String>, q: &Query) -> Response {
    let filter = match Filter::new(ns, q) {
        Ok(f) => f,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e),
    };
    let limit = match q.get("limit").map(str::parse::<usize>).transpose() {
        Ok(limit) => limit.filter(|&l| l > 0),
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid limit"),
    };
    let mut st = sh.lock();
    let (snapshot, rv, items, offset) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let Some((id, offset)) = decode_continue(token) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid continue token");
            };
            let Some((rv, items)) = st.snapshots.get(&id).cloned() else {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                );
            };
            let offset = offset.min(items.len());
            (Some(id), rv, items, offset)
        }
        None => {
            if q.get("resourceVersionMatch") == Some("Exact")
                && q.get("resourceVersion") != Some(st.rv.to_string().as_str())
            {
                return status(StatusCode::GONE, "Expired", "too old resource version");
            }
            let items: Vec<Value> = st
                .objects
                .iter()
                .filter(|((k, _, _), o)| *k == res.kind && filter.matches(o))
                .map(|(_, o)| o.clone())
                .collect();
            (None, st.rv, Arc::new(items), 0)
        }
    };
    let end = limit.map_or(items.len(), |l| (offset + l).min(items.len()));
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if end < items.len() {
        let id = snapshot.unwrap_or_else(|| {
            st.snapshot_seq += 1;
            let id = st.snapshot_seq;
            st.snapshots.insert(id, (rv, items.clone()));
            while st.snapshots.len() > SNAPSHOT_CAPACITY {
                st.snapshots.pop_first();
            }
            id
        });
        metadata["continue"] = json!(encode_continue(id, end));
        metadata["remainingItemCount"] = json!(items.len() - end);
    }
    Json(json!({
        "apiVersion": res.api_version,
        "kind": format!("{}List", res.kind),
        "metadata": metadata,
        "items": items[offset..end].iter().map(|o| served_as(o, res.api_version)).collect::<Vec<_>>(),
    }))
    .into_response()
}

/// Continue tokens are opaque to clients: hex of `snapshot-id:offset`.
pub(super) fn encode_continue(id: u64, offset: usize) -> String {
    format!("{id}:{offset}").bytes().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn decode_continue(token: &str) -> Option<(u64, usize)> {
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| token.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect::<Option<Vec<u8>>>()?;
    let (id, offset) = std::str::from_utf8(&bytes).ok()?.split_once(':')?;
    Some((id.parse().ok()?, offset.parse().ok()?))
}

pub(super) fn write_event(
    sh: &Shared,
    res: &'static Resource,
    ns: &str,
    name: Option<&str>,
    method: &Method,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let bad = |msg: String| status(StatusCode::BAD_REQUEST, "BadRequest", msg);
    let parse_body = || -> Result<Value, String> {
        match serde_json::from_slice::<Value>(body) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err("the body must be a JSON object".into()),
            Err(e) => Err(format!("invalid JSON body: {e}")),
        }
    };
    let mut st = sh.lock();
    match (method, name) {
        (&Method::POST, None) => {
            let mut obj = match parse_body() {
                Ok(o) => o,
                Err(msg) => return bad(msg),
            };
            let name = match str_at(&obj, &["metadata", "name"]).filter(|n| !n.is_empty()) {
                Some(n) => n.to_string(),
                None => match str_at(&obj, &["metadata", "generateName"]) {
                    Some(prefix) => format!("{prefix}{:05x}", st.rv + 1),
                    None => {
                        return status(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "Invalid",
                            "metadata.name or generateName is required",
                        );
                    }
                },
            };
            if st.event_index(ns, &name).is_some() {
                return status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    format!("events {name:?} already exists"),
                );
            }
            prepare_event(&mut obj, res, ns, &name);
            st.stamp(&mut obj, None);
            st.events.push(obj.clone());
            (StatusCode::CREATED, Json(obj)).into_response()
        }
        (&Method::PUT, Some(name)) => {
            let mut obj = match parse_body() {
                Ok(o) => o,
                Err(msg) => return bad(msg),
            };
            prepare_event(&mut obj, res, ns, name);
            match st.event_index(ns, name) {
                Some(i) => {
                    let previous = st.events[i].clone();
                    st.stamp(&mut obj, Some(&previous));
                    st.events[i] = obj.clone();
                    Json(obj).into_response()
                }
                None => {
                    st.stamp(&mut obj, None);
                    st.events.push(obj.clone());
                    (StatusCode::CREATED, Json(obj)).into_response()
                }
            }
        }
        (&Method::PATCH, Some(name)) => {
            let content_type = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if content_type.starts_with("application/json-patch+json") {
                return status(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "JSON patches are not supported by the test API server",
                );
            }
            // Merge, strategic-merge and (JSON-encoded) apply patches are all applied as merge patches.
            let patch = match parse_body() {
                Ok(o) => o,
                Err(msg) => return bad(msg),
            };
            let existing = st.event_index(ns, name);
            let apply = content_type.starts_with("application/apply-patch");
            let mut obj = match existing {
                Some(i) => st.events[i].clone(),
                None if apply => json!({}),
                None => return status(StatusCode::NOT_FOUND, "NotFound", format!("events {name:?} not found")),
            };
            merge_patch(&mut obj, &patch);
            prepare_event(&mut obj, res, ns, name);
            match existing {
                Some(i) => {
                    let previous = st.events[i].clone();
                    st.stamp(&mut obj, Some(&previous));
                    st.events[i] = obj.clone();
                    Json(obj).into_response()
                }
                None => {
                    st.stamp(&mut obj, None);
                    st.events.push(obj.clone());
                    (StatusCode::CREATED, Json(obj)).into_response()
                }
            }
        }
        (&Method::DELETE, Some(name)) => match st.event_index(ns, name) {
            Some(i) => Json(st.events.remove(i)).into_response(),
            None => status(StatusCode::NOT_FOUND, "NotFound", format!("events {name:?} not found")),
        },
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the test API server only records writes to events, not {method}"),
        ),
    }
}

pub(super) fn prepare_event(obj: &mut Value, res: &Resource, ns: &str, name: &str) {
    if obj.get("apiVersion").is_none_or(Value::is_null) {
        obj["apiVersion"] = json!(res.api_version);
    }
    obj["kind"] = json!("Event");
    let meta = meta_mut(obj);
    meta.insert("namespace".into(), json!(ns));
    meta.insert("name".into(), json!(name));
}

/// RFC 7386 JSON merge patch.
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

pub(super) fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response {
    (code, Json(status_object(code.as_u16(), reason, &message.into()))).into_response()
}

pub(super) fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

pub(super) fn not_found(res: &Resource, name: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{} \"{name}\" not found", res.plural), "reason": "NotFound",
            "details": { "name": name, "kind": res.plural }, "code": 404,
        })),
    )
        .into_response()
}
