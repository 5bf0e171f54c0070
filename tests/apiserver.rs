//! Proves the test API server (`tests/support/apiserver.rs`) speaks the protocol of the real
//! kube-rs client: lists with selectors and paging, the runtime watcher's list/watch/relist
//! cycle, raw watch streams (bookmarks, 410, timeouts, cut connections), outages, delays, truncated
//! responses and event recording. No root needed; every test is bounded by a timeout.

#[path = "support/apiserver/mod.rs"]
mod apiserver;

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use apiserver::ApiServer;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(10);
const SELECTOR: &str = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";

/// Runs a test body under the global time limit.
async fn bounded(body: impl Future<Output = Result<()>>) -> Result<()> {
    tokio::time::timeout(LIMIT, body).await.context("test timed out")?
}

/// A kube-rs client built the way kube-proxy builds it: from a kubeconfig file.
async fn client(server: &ApiServer) -> Result<Client> {
    let path = std::env::temp_dir().join(format!(
        "apiserver-test-{}-{}.kubeconfig",
        std::process::id(),
        server.addr().port()
    ));
    server.write_kubeconfig(&path);
    let kubeconfig = Kubeconfig::read_from(&path);
    let _ = std::fs::remove_file(&path);
    let config = kube::Config::from_custom_kubeconfig(kubeconfig?, &KubeConfigOptions::default()).await?;
    ensure!(
        config.cluster_url.to_string().starts_with("http://127.0.0.1:"),
        "cluster url {}",
        config.cluster_url
    );
    Ok(Client::try_from(config)?)
}

/// Polls `cond` until it holds (the caller's timeout bounds it).
async fn wait_for(cond: impl Fn() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn svc(ns: &str, name: &str, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    json!({
        "kind": "Service",
        "metadata": { "name": name, "namespace": ns, "labels": labels },
        "spec": { "clusterIP": "10.96.0.10", "ports": [{ "port": 80, "protocol": "TCP" }] },
    })
}

fn node(name: &str, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    json!({ "kind": "Node", "metadata": { "name": name, "labels": labels } })
}

fn key<K: Resource>(o: &K) -> String {
    match o.meta().namespace.as_deref() {
        Some(ns) => format!("{ns}/{}", o.name_any()),
        None => o.name_any(),
    }
}

fn keys<K: Resource>(items: &[K]) -> Vec<String> {
    items.iter().map(key).collect()
}

fn describe<K: Resource>(ev: &Event<K>) -> String {
    match ev {
        Event::Init => "Init".into(),
        Event::InitApply(o) => format!("InitApply({})", key(o)),
        Event::InitDone => "InitDone".into(),
        Event::Apply(o) => format!("Apply({})", key(o)),
        Event::Delete(o) => format!("Delete({})", key(o)),
    }
}

/// The next watcher event, described; errors fail the test.
async fn next<K: Resource>(w: &mut (impl Stream<Item = Result<Event<K>, watcher::Error>> + Unpin)) -> Result<String> {
    match w.next().await {
        Some(Ok(ev)) => Ok(describe(&ev)),
        Some(Err(e)) => bail!("watcher error: {e}"),
        None => bail!("watcher ended"),
    }
}

async fn expect_events<K: Resource>(
    w: &mut (impl Stream<Item = Result<Event<K>, watcher::Error>> + Unpin),
    want: &[&str],
) -> Result<()> {
    for expected in want {
        let got = next(w).await?;
        ensure!(got == *expected, "expected {expected}, got {got}");
    }
    Ok(())
}

/// A fast constant backoff so outage tests recover quickly.
struct Fast;

impl Iterator for Fast {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(Duration::from_millis(50))
    }
}

impl Backoff for Fast {
    fn reset(&mut self) {}
}

#[tokio::test]
async fn list_honours_label_selectors_and_namespaces() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(svc("default", "plain", &[]));
        server.apply(svc("other", "web", &[("app", "web")]));
        server.apply(svc("default", "headless", &[("service.kubernetes.io/headless", "")]));
        server.apply(svc(
            "default",
            "foreign",
            &[("service.kubernetes.io/service-proxy-name", "other"), ("app", "db")],
        ));
        let client = client(&server).await?;
        let api = Api::<Service>::all(client.clone());

        let list = api.list(&ListParams::default().labels(SELECTOR)).await?;
        assert_eq!(keys(&list.items), ["default/plain", "other/web"]);
        assert_eq!(
            list.metadata.resource_version,
            Some(server.resource_version().to_string())
        );
        assert!(list.metadata.continue_.is_none());
        let uid = list.items[0].metadata.uid.clone().context("uid")?;
        assert!(!uid.is_empty() && list.items[0].metadata.creation_timestamp.is_some());
        assert!(
            server
                .requests()
                .contains(&format!("GET /api/v1/services?labelSelector={SELECTOR}")),
            "{:?}",
            server.requests()
        );

        for (selector, want) in [
            ("app", vec!["default/foreign", "other/web"]),
            ("app=web", vec!["other/web"]),
            ("app==web", vec!["other/web"]),
            ("app!=web", vec!["default/foreign", "default/headless", "default/plain"]),
            ("app in (db, web)", vec!["default/foreign", "other/web"]),
            (
                "app notin (db),!service.kubernetes.io/headless",
                vec!["default/plain", "other/web"],
            ),
        ] {
            let list = api.list(&ListParams::default().labels(selector)).await?;
            assert_eq!(keys(&list.items), want, "selector {selector}");
        }
        let bad = api.list(&ListParams::default().labels("app in (web")).await;
        assert!(matches!(bad, Err(kube::Error::Api(ref s)) if s.code == 400), "{bad:?}");

        let other = Api::<Service>::namespaced(client.clone(), "other")
            .list(&ListParams::default())
            .await?;
        assert_eq!(keys(&other.items), ["other/web"]);
        let one = Api::<Service>::namespaced(client, "default").get("plain").await?;
        assert_eq!(one.metadata.uid.as_deref(), Some(uid.as_str()));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn every_kind_lists() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(json!({
            "kind": "EndpointSlice",
            "metadata": { "name": "web-abc", "namespace": "default", "labels": { "kubernetes.io/service-name": "web" } },
            "addressType": "IPv4",
            "endpoints": [{ "addresses": ["10.0.0.1"] }],
            "ports": [{ "port": 8080, "protocol": "TCP" }],
        }));
        server.apply(json!({ "kind": "ServiceCIDR", "metadata": { "name": "kubernetes", "namespace": "ignored" }, "spec": { "cidrs": ["10.96.0.0/12"] } }));
        let client = client(&server).await?;
        let slices = Api::<EndpointSlice>::all(client.clone()).list(&ListParams::default()).await?;
        assert_eq!(keys(&slices.items), ["default/web-abc"]);
        let slices = Api::<EndpointSlice>::namespaced(client.clone(), "default")
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await?;
        assert_eq!(slices.items[0].endpoints[0].addresses, ["10.0.0.1"]);
        let cidrs = Api::<ServiceCIDR>::all(client.clone()).list(&ListParams::default()).await?;
        assert_eq!(keys(&cidrs.items), ["kubernetes"], "cluster-scoped: no namespace");
        assert_eq!(client.apiserver_version().await?.minor, "33");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn watcher_sees_initial_list_then_changes() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(svc("default", "a", &[]));
        server.apply(svc("default", "b", &[]));
        server.apply(svc("default", "headless", &[("service.kubernetes.io/headless", "")]));
        let api = Api::<Service>::all(client(&server).await?);
        let mut w = watcher(api, watcher::Config::default().labels(SELECTOR)).boxed();
        expect_events(
            &mut w,
            &["Init", "InitApply(default/a)", "InitApply(default/b)", "InitDone"],
        )
        .await?;

        server.apply(svc("default", "c", &[]));
        expect_events(&mut w, &["Apply(default/c)"]).await?;
        server.apply(svc("default", "c", &[("app", "x")]));
        expect_events(&mut w, &["Apply(default/c)"]).await?;
        // Leaving or entering the selection reads as a deletion or an addition.
        server.apply(svc("default", "c", &[("service.kubernetes.io/headless", "")]));
        expect_events(&mut w, &["Delete(default/c)"]).await?;
        server.apply(svc("default", "headless", &[]));
        expect_events(&mut w, &["Apply(default/headless)"]).await?;
        server.delete("Service", "default", "a").context("a existed")?;
        expect_events(&mut w, &["Delete(default/a)"]).await?;

        let requests = server.requests();
        assert!(
            requests.contains(&format!("GET /api/v1/services?labelSelector={SELECTOR}&limit=500")),
            "{requests:?}"
        );
        let watch = requests
            .iter()
            .find(|r| r.contains("watch=true"))
            .context("a watch request")?;
        assert!(
            watch.contains("allowWatchBookmarks=true") && watch.contains("timeoutSeconds=290"),
            "{watch}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn expired_watch_forces_a_relist() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(svc("default", "a", &[]));
        server.apply(svc("default", "b", &[]));
        let api = Api::<Service>::all(client(&server).await?);
        let mut w = watcher(api, watcher::Config::default()).boxed();
        expect_events(
            &mut w,
            &["Init", "InitApply(default/a)", "InitApply(default/b)", "InitDone"],
        )
        .await?;
        server.apply(svc("default", "c", &[]));
        expect_events(&mut w, &["Apply(default/c)"]).await?;

        // The watcher is not polled now: "b" goes while it is cut off by the 410.
        server.expire_watches();
        server.delete("Service", "default", "b").context("b existed")?;
        match w.next().await {
            Some(Err(watcher::Error::WatchError(status))) => assert_eq!(status.code, 410),
            other => bail!(
                "expected the 410 watch error, got {:?}",
                other.map(|r| r.map(|e| describe(&e)))
            ),
        }
        expect_events(
            &mut w,
            &["Init", "InitApply(default/a)", "InitApply(default/c)", "InitDone"],
        )
        .await?;
        server.apply(svc("default", "d", &[]));
        expect_events(&mut w, &["Apply(default/d)"]).await?;
        let lists = server
            .requests()
            .iter()
            .filter(|r| r.starts_with("GET /api/v1/services?limit=500"))
            .count();
        assert_eq!(lists, 2);
        Ok(())
    })
    .await
}

#[tokio::test]
async fn raw_watch_protocol() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.set_bookmark_interval(Duration::from_millis(50));
        let api = Api::<Service>::all(client(&server).await?);
        let rv0 = server.resource_version().to_string();
        server.apply(svc("default", "a", &[]));

        // Replay after rv0, bookmarks at the current version, the end after timeoutSeconds.
        let started = Instant::now();
        let mut s = api.watch(&WatchParams::default().timeout(1), &rv0).await?.boxed();
        match s.next().await {
            Some(Ok(WatchEvent::Added(o))) => assert_eq!(key(&o), "default/a"),
            other => bail!("expected ADDED a, got {other:?}"),
        }
        let mut bookmarks = 0;
        while let Some(ev) = s.next().await {
            match ev? {
                WatchEvent::Bookmark(b) => {
                    assert_eq!(b.metadata.resource_version, server.resource_version().to_string());
                    assert_eq!(b.types.kind, "Service");
                    bookmarks += 1;
                }
                other => bail!("unexpected {other:?}"),
            }
        }
        assert!(bookmarks > 0);
        assert!(started.elapsed() >= Duration::from_secs(1));

        // From "0": the current state as ADDEDs.
        let mut s = api
            .watch(&WatchParams::default().disable_bookmarks(), "0")
            .await?
            .boxed();
        assert!(matches!(s.next().await, Some(Ok(WatchEvent::Added(_)))));
        server.apply(svc("default", "a", &[("x", "y")]));
        assert!(matches!(s.next().await, Some(Ok(WatchEvent::Modified(_)))));
        drop(s);

        // A compacted version gets one 410 ERROR event and the end of the stream.
        server.expire_watches();
        let mut s = api.watch(&WatchParams::default(), &rv0).await?.boxed();
        match s.next().await {
            Some(Ok(WatchEvent::Error(e))) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
            other => bail!("expected a 410 ERROR event, got {other:?}"),
        }
        assert!(s.next().await.is_none());

        // A cut connection ends the stream without an ERROR event.
        let mut s = api
            .watch(&WatchParams::default(), &server.resource_version().to_string())
            .await?
            .boxed();
        wait_for(|| server.open_watches() >= 1).await;
        server.drop_connections();
        while let Some(ev) = s.next().await {
            assert!(
                !matches!(ev, Ok(WatchEvent::Error(_)) | Ok(WatchEvent::Added(_))),
                "{ev:?}"
            );
        }
        Ok(())
    })
    .await
}

#[tokio::test]
async fn watcher_resumes_after_dropped_connection_without_relisting() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(svc("default", "a", &[]));
        let api = Api::<Service>::all(client(&server).await?);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut w = watcher(api, watcher::Config::default()).backoff(Fast).boxed();
            while let Some(ev) = w.next().await {
                let ev = ev.map(|e| describe(&e)).map_err(|e| e.to_string());
                if tx.send(ev).is_err() {
                    break;
                }
            }
        });
        for want in ["Init", "InitApply(default/a)", "InitDone"] {
            assert_eq!(rx.recv().await.context("watcher ended")?, Ok(want.to_string()));
        }
        wait_for(|| server.open_watches() == 1).await;
        let watches = || server.requests().iter().filter(|r| r.contains("watch=true")).count();
        let before = watches();
        server.drop_connections();
        wait_for(|| watches() > before && server.open_watches() == 1).await;
        server.apply(svc("default", "b", &[]));
        loop {
            match rx.recv().await.context("watcher ended")? {
                Ok(ev) if ev == "Apply(default/b)" => break,
                Ok(ev) => bail!("unexpected {ev} (a relist?)"),
                Err(_) => {} // the cut may surface as an error before the stream ends
            }
        }
        assert_eq!(
            server.requests().iter().filter(|r| r.contains("limit=500")).count(),
            1,
            "no relist"
        );
        task.abort();
        Ok(())
    })
    .await
}

#[tokio::test]
async fn paging_follows_continue_tokens() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        for i in 0..5 {
            server.apply(svc("default", &format!("s{i}"), &[]));
        }
        let api = Api::<Service>::all(client(&server).await?);
        let mut lp = ListParams::default().limit(1);
        let (mut seen, mut versions, mut pages) = (Vec::new(), Vec::new(), 0);
        loop {
            let page = api.list(&lp).await?;
            pages += 1;
            assert_eq!(page.items.len(), 1);
            seen.extend(keys(&page.items));
            versions.push(page.metadata.resource_version.clone());
            if pages == 1 {
                // Later pages come from the first page's snapshot.
                server.apply(svc("default", "s9", &[]));
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => lp = lp.continue_token(&token),
                None => break,
            }
        }
        assert_eq!(
            seen,
            ["default/s0", "default/s1", "default/s2", "default/s3", "default/s4"]
        );
        assert_eq!(pages, 5);
        assert!(versions.iter().all(|v| v == &versions[0]), "{versions:?}");
        assert!(
            server.requests().iter().any(|r| r.contains("limit=1&continue=")),
            "{:?}",
            server.requests()
        );

        // Fresh list sees the new object; an expired continue token gets 410.
        let page = api.list(&ListParams::default().limit(4)).await?;
        assert_eq!(page.items.len(), 4);
        let token = page.metadata.continue_.context("a continue token")?;
        server.expire_watches();
        let res = api.list(&ListParams::default().limit(4).continue_token(&token)).await;
        assert!(matches!(res, Err(kube::Error::Api(ref s)) if s.code == 410), "{res:?}");
        assert_eq!(api.list(&ListParams::default()).await?.items.len(), 6);
        Ok(())
    })
    .await
}

#[tokio::test]
async fn field_selector_picks_one_node() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(node("node-a", &[]));
        server.apply(node("node-b", &[]));
        let api = Api::<Node>::all(client(&server).await?);
        let list = api.list(&ListParams::default().fields("metadata.name=node-a")).await?;
        assert_eq!(keys(&list.items), ["node-a"]);
        let list = api.list(&ListParams::default().fields("metadata.name!=node-a")).await?;
        assert_eq!(keys(&list.items), ["node-b"]);
        assert_eq!(api.get("node-a").await?.name_any(), "node-a");
        let missing = api.get("node-z").await;
        assert!(
            matches!(missing, Err(kube::Error::Api(ref s)) if s.code == 404),
            "{missing:?}"
        );

        let mut w = watcher(api, watcher::Config::default().fields("metadata.name=node-a")).boxed();
        expect_events(&mut w, &["Init", "InitApply(node-a)", "InitDone"]).await?;
        // node-b's change is filtered out, so node-a's is the next event.
        server.apply(node("node-b", &[("x", "1")]));
        server.apply(node("node-a", &[("x", "1")]));
        expect_events(&mut w, &["Apply(node-a)"]).await?;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn unavailable_fails_requests_and_the_watcher_recovers() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        server.apply(svc("default", "a", &[]));
        let client = client(&server).await?;
        let api = Api::<Service>::all(client.clone());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut w = watcher(api, watcher::Config::default()).backoff(Fast).boxed();
            while let Some(ev) = w.next().await {
                let ev = ev.map(|e| describe(&e)).map_err(|e| e.to_string());
                if tx.send(ev).is_err() {
                    break;
                }
            }
        });
        for want in ["Init", "InitApply(default/a)", "InitDone"] {
            assert_eq!(rx.recv().await.context("watcher ended")?, Ok(want.to_string()));
        }

        server.set_unavailable(true);
        let api = Api::<Service>::all(client);
        let failed = api.list(&ListParams::default()).await;
        assert!(failed.is_err(), "list succeeded while unavailable");
        eprintln!("while unavailable, list fails with: {}", failed.unwrap_err());
        // The watcher keeps failing (and retrying after its backoff) while the outage lasts.
        for _ in 0..3 {
            match rx.recv().await.context("watcher ended")? {
                Err(e) => eprintln!("while unavailable, the watcher reports: {e}"),
                Ok(ev) => bail!("unexpected {ev} while unavailable"),
            }
        }
        server.apply(svc("default", "b", &[]));

        server.set_unavailable(false);
        loop {
            match rx.recv().await.context("watcher ended")? {
                Ok(ev) if ev.ends_with("(default/b)") => break,
                _ => {}
            }
        }
        assert_eq!(
            keys(&api.list(&ListParams::default()).await?.items),
            ["default/a", "default/b"]
        );
        task.abort();
        Ok(())
    })
    .await
}

#[tokio::test]
async fn truncated_responses_fail_mid_object_and_the_watcher_recovers() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        for i in 0..3 {
            server.apply(svc("default", &format!("s{i}"), &[]));
        }
        let client = client(&server).await?;
        let api = Api::<Service>::all(client.clone());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let watched = api.clone();
        let task = tokio::spawn(async move {
            let mut w = watcher(watched, watcher::Config::default()).backoff(Fast).boxed();
            while let Some(ev) = w.next().await {
                let ev = ev.map(|e| describe(&e)).map_err(|e| e.to_string());
                if tx.send(ev).is_err() {
                    break;
                }
            }
        });
        for want in [
            "Init", "InitApply(default/s0)", "InitApply(default/s1)", "InitApply(default/s2)", "InitDone",
        ] {
            assert_eq!(rx.recv().await.context("watcher ended")?, Ok(want.to_string()));
        }
        server.set_truncated(true);
        // A list gets half a body and fails; so does a single GET.
        let failed = api.list(&ListParams::default()).await;
        eprintln!("a truncated list fails with: {:?}", failed.as_ref().err());
        ensure!(failed.is_err(), "a truncated list succeeded");
        ensure!(api.get("s0").await.is_err(), "a truncated GET succeeded");
        // The open watch is cut at its next event (half a line): an error, no event.
        server.apply(svc("default", "s3", &[]));
        match rx.recv().await.context("watcher ended")? {
            Err(e) => eprintln!("a truncated watch event: {e}"),
            Ok(ev) => bail!("{ev} from a truncated watch"),
        }
        // A relist while responses are truncated never completes: no InitDone, so a client
        // never takes half a list for the whole one.
        let lists = || server.requests().iter().filter(|r| !r.contains("watch=")).count();
        let before = lists();
        server.expire_watches();
        server.delete("Service", "default", "s1");
        let until = Instant::now() + Duration::from_millis(1500);
        while let Ok(ev) = tokio::time::timeout_at(until.into(), rx.recv()).await {
            let ev = ev.context("watcher ended")?;
            ensure!(
                !matches!(&ev, Ok(e) if e.contains("InitDone") || e.starts_with("Apply")),
                "{ev:?} while truncated"
            );
        }
        ensure!(
            lists() > before + 1,
            "the 410 went through whole and the watcher relisted"
        );
        server.set_truncated(false);
        loop {
            if rx.recv().await.context("watcher ended")? == Ok("InitDone".into()) {
                break;
            }
        }
        assert_eq!(
            keys(&api.list(&ListParams::default()).await?.items),
            ["default/s0", "default/s2", "default/s3"]
        );
        task.abort();
        Ok(())
    })
    .await
}

#[tokio::test]
async fn delay_holds_back_responses() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        let api = Api::<Service>::all(client(&server).await?);
        server.set_delay(Duration::from_millis(300));
        let started = Instant::now();
        api.list(&ListParams::default()).await?;
        assert!(started.elapsed() >= Duration::from_millis(300));
        server.set_delay(Duration::ZERO);
        Ok(())
    })
    .await
}

#[tokio::test]
async fn events_are_recorded() -> Result<()> {
    bounded(async {
        let server = ApiServer::start();
        let client = client(&server).await?;
        // What kube-proxy's birth cry does: events.k8s.io, created then patched as a series.
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "kube-proxy".into(),
                instance: Some("node-a".into()),
            },
        );
        let node = ObjectReference {
            kind: Some("Node".into()),
            name: Some("node-a".into()),
            uid: Some("node-a".into()),
            api_version: Some("v1".into()),
            ..ObjectReference::default()
        };
        let event = KubeEvent {
            type_: EventType::Normal,
            reason: "Starting".into(),
            note: None,
            action: "StartKubeProxy".into(),
            secondary: None,
        };
        recorder.publish(&event, &node).await?;
        recorder.publish(&event, &node).await?;
        let events = server.events();
        assert_eq!(events.len(), 1, "{events:?}");
        let e = &events[0];
        assert_eq!(
            (e["apiVersion"].as_str(), e["reason"].as_str()),
            (Some("events.k8s.io/v1"), Some("Starting"))
        );
        assert_eq!(e["regarding"]["name"], "node-a");
        assert_eq!(e["metadata"]["namespace"], "default");
        assert_eq!(e["series"]["count"], 2);
        assert!(e["metadata"]["resourceVersion"].is_string() && e["metadata"]["uid"].is_string());
        let requests = server.requests();
        assert!(
            requests
                .iter()
                .any(|r| r == "POST /apis/events.k8s.io/v1/namespaces/default/events"),
            "{requests:?}"
        );
        assert!(
            requests
                .iter()
                .any(|r| r.starts_with("PATCH /apis/events.k8s.io/v1/namespaces/default/events/")),
            "{requests:?}"
        );

        // Core v1 events are recorded too.
        let core: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
            "metadata": { "generateName": "kube-proxy-" },
            "involvedObject": { "kind": "Node", "name": "node-a" },
            "reason": "Hello",
        }))?;
        let created = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client, "kube-system")
            .create(&PostParams::default(), &core)
            .await?;
        assert!(created.name_any().starts_with("kube-proxy-"));
        let events = server.events();
        assert_eq!(events.len(), 2);
        assert_eq!(
            (
                events[1]["reason"].as_str(),
                events[1]["metadata"]["namespace"].as_str()
            ),
            (Some("Hello"), Some("kube-system"))
        );
        Ok(())
    })
    .await
}
