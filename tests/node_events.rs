//! The events kube-proxy emits on its Node besides the birth cry, through the test API server
//! (tests/support/apiserver): IPVS mode's deprecation warning reaches the API as upstream
//! sends it (events.k8s.io, type Warning, reason `IPVSDeprecation`, action `StartKubeProxy`,
//! the deprecation message as its note, about the Node).

#[path = "support/apiserver/mod.rs"]
mod apiserver;

use std::time::{Duration, Instant};

use apiserver::ApiServer;
use kube_proxy::config::ClientConnection;
use kube_proxy::daemon::modes::IPVS_DEPRECATION;
use kube_proxy::source::api::{emit_on_node, start_warning};

#[test]
fn the_ipvs_deprecation_warning_reaches_the_api() {
    let server = ApiServer::start();
    let cc = ClientConnection {
        kubeconfig: None,
        master: Some(server.url()),
        accept_content_types: String::new(),
        content_type: "application/json".into(),
        qps: 5.0,
        burst: 10,
    };
    emit_on_node(&cc, "node-a", start_warning("IPVSDeprecation", IPVS_DEPRECATION));
    let deadline = Instant::now() + Duration::from_secs(10);
    let event = loop {
        if let Some(e) = server.events().into_iter().next() {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "no event within 10 s: {:?}",
            server.requests()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(event["apiVersion"], "events.k8s.io/v1");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "IPVSDeprecation");
    assert_eq!(event["action"], "StartKubeProxy");
    assert_eq!(event["note"], IPVS_DEPRECATION);
    assert_eq!(event["reportingController"], "kube-proxy");
    assert_eq!(
        (&event["regarding"]["kind"], &event["regarding"]["name"]),
        (&"Node".into(), &"node-a".into())
    );
}
