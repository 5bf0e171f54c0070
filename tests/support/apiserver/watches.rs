//! The test API server's WATCH: a stream of the event log after a resource version, with
//! bookmarks, expiry (410) and cut connections.

use super::*;

pub(super) fn start_watch(sh: &Arc<Shared>, res: &'static Resource, ns: Option<String>, q: &Query) -> Response {
    let filter = match Filter::new(ns, q) {
        Ok(f) => f,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e),
    };
    let timeout = match q.get("timeoutSeconds").map(str::parse::<u64>).transpose() {
        Ok(t) => t.filter(|&t| t > 0).unwrap_or(1800),
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid timeoutSeconds"),
    };
    let from = match q
        .get("resourceVersion")
        .filter(|rv| !rv.is_empty() && *rv != "0")
        .map(str::parse::<u64>)
        .transpose()
    {
        Ok(rv) => rv,
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid resourceVersion"),
    };
    let bookmarks = q.get("allowWatchBookmarks") == Some("true");
    let initial_events = q.get("sendInitialEvents");

    let mut changed = sh.changed.subscribe();
    changed.mark_unchanged();
    let st = sh.lock();
    let now = Instant::now();
    let mut w = WatchStream {
        _guard: WatchGuard::new(sh.clone()),
        shared: sh.clone(),
        kind: res.kind,
        api_version: res.api_version,
        filter,
        bookmark_every: bookmarks.then_some(st.bookmark_interval.max(Duration::from_millis(10))),
        last_rv: st.rv,
        pending: VecDeque::new(),
        deadline: now + Duration::from_secs(timeout),
        next_bookmark: now + st.bookmark_interval,
        expire_gen: st.expire_gen,
        drop_gen: st.drop_gen,
        changed,
        done: false,
        cut: false,
    };
    match from {
        Some(rv) if rv < st.compacted => {
            w.pending.push_back(event_line(
                "ERROR",
                &status_object(410, "Expired", "too old resource version"),
            ));
            w.done = true;
        }
        Some(rv) => w.last_rv = rv,
        // No version (or "0"): the current state as synthetic ADDEDs, then changes from now on.
        None if initial_events != Some("false") => {
            for (_, obj) in st
                .objects
                .iter()
                .filter(|((k, _, _), o)| *k == res.kind && w.filter.matches(o))
            {
                w.pending
                    .push_back(event_line("ADDED", &served_as(obj, res.api_version)));
            }
            if initial_events == Some("true") {
                let mut bookmark = w.bookmark(st.rv);
                bookmark["metadata"]["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
                w.pending.push_back(event_line("BOOKMARK", &bookmark));
            }
        }
        None => {}
    }
    drop(st);
    let stream = futures::stream::unfold(w, WatchStream::next_chunk);
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .expect("a valid watch response")
}

/// One watch response body, produced lazily by `next_chunk`.
pub(super) struct WatchStream {
    _guard: WatchGuard,
    shared: Arc<Shared>,
    kind: &'static str,
    api_version: &'static str,
    filter: Filter,
    bookmark_every: Option<Duration>,
    /// Every change up to this version has been looked at.
    last_rv: u64,
    pending: VecDeque<Bytes>,
    deadline: Instant,
    next_bookmark: Instant,
    expire_gen: u64,
    drop_gen: u64,
    changed: watch::Receiver<u64>,
    done: bool,
    /// Half an event line was sent: the stream ends with an error.
    cut: bool,
}

impl WatchStream {
    pub(super) async fn next_chunk(mut self) -> Option<(Result<Bytes, io::Error>, WatchStream)> {
        loop {
            if self.cut {
                self.done = true;
                return Some((
                    Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "watch event truncated by the test API server",
                    )),
                    self,
                ));
            }
            if let Some(line) = self.pending.pop_front() {
                if self.shared.lock().truncated && carries_object(&line) {
                    // Half an event, then the connection aborted (the next call).
                    self.cut = true;
                    self.pending.clear();
                    return Some((Ok(line.slice(..line.len() / 2)), self));
                }
                return Some((Ok(line), self));
            }
            if self.done {
                return None;
            }
            self.changed.borrow_and_update();
            {
                let shared = self.shared.clone();
                let st = shared.lock();
                if st.drop_gen != self.drop_gen {
                    // An error from the body makes hyper abort the connection mid-chunk.
                    drop(st);
                    self.done = true;
                    return Some((
                        Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "watch dropped by the test API server",
                        )),
                        self,
                    ));
                }
                if st.unserved.contains(&self.api_version) {
                    // No longer served: the stream ends; the client's next request gets 404.
                    self.done = true;
                    continue;
                }
                if st.expire_gen != self.expire_gen {
                    self.pending.push_back(event_line(
                        "ERROR",
                        &status_object(410, "Expired", "too old resource version"),
                    ));
                    self.done = true;
                    continue;
                }
                let start = st.log.partition_point(|e| e.rv <= self.last_rv);
                for entry in st.log.range(start..) {
                    if let Some(line) = self.translate(entry) {
                        self.pending.push_back(line);
                    }
                }
                self.last_rv = self.last_rv.max(st.rv);
                let now = Instant::now();
                if let Some(every) = self.bookmark_every
                    && self.pending.is_empty()
                    && now >= self.next_bookmark
                {
                    let bookmark = self.bookmark(self.last_rv);
                    self.pending.push_back(event_line("BOOKMARK", &bookmark));
                    self.next_bookmark = now + every;
                }
            }
            if !self.pending.is_empty() {
                continue;
            }
            if Instant::now() >= self.deadline {
                return None;
            }
            let wake = if self.bookmark_every.is_some() {
                self.deadline.min(self.next_bookmark)
            } else {
                self.deadline
            };
            tokio::select! {
                _ = self.changed.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// The event this watcher sees for a change, if any: objects entering or leaving the
    /// selection are ADDED or DELETED.
    pub(super) fn translate(&self, e: &LogEntry) -> Option<Bytes> {
        if e.kind != self.kind {
            return None;
        }
        let now = self.filter.matches(&e.object);
        let before = e.previous.as_ref().is_some_and(|p| self.filter.matches(p));
        let ty = match (e.event, before, now) {
            ("ADDED", _, true) | ("MODIFIED", false, true) => "ADDED",
            ("MODIFIED", true, true) => "MODIFIED",
            ("MODIFIED", true, false) | ("DELETED", _, true) => "DELETED",
            _ => return None,
        };
        Some(event_line(ty, &served_as(&e.object, self.api_version)))
    }

    pub(super) fn bookmark(&self, rv: u64) -> Value {
        json!({ "kind": self.kind, "apiVersion": self.api_version, "metadata": { "resourceVersion": rv.to_string() } })
    }
}

/// Counts open watch streams.
pub(super) struct WatchGuard(Arc<Shared>);

impl WatchGuard {
    pub(super) fn new(shared: Arc<Shared>) -> WatchGuard {
        shared.open_watches.fetch_add(1, Ordering::SeqCst);
        WatchGuard(shared)
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn event_line(ty: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": ty, "object": object })).expect("JSON");
    line.push(b'\n');
    Bytes::from(line)
}

/// Whether a watch event line carries an object (ADDED, MODIFIED, DELETED), not a `Status`
/// (ERROR) or a bookmark.
fn carries_object(line: &[u8]) -> bool {
    let has = |needle: &[u8]| line.windows(needle.len()).any(|w| w == needle);
    !has(br#""type":"ERROR""#) && !has(br#""type":"BOOKMARK""#)
}
