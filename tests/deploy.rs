//! The deployment manifests are valid Kubernetes objects, the DaemonSet has what a node proxy
//! needs, its ConfigMap is a configuration we accept, and the ClusterRole grants nothing beyond
//! what the proxy uses.

use std::collections::BTreeSet;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde_json::Value;

fn documents() -> Vec<Value> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kube-proxy.yaml"))
        .expect("deploy/kube-proxy.yaml");
    text.split("\n---\n")
        .map(|doc| serde_saphyr::from_str::<Value>(doc).unwrap_or_else(|e| panic!("YAML: {e}\n{doc}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn typed<T: serde::de::DeserializeOwned>(kind: &str) -> T {
    let doc = documents()
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"));
    serde_path_to_error::deserialize(doc)
        .unwrap_or_else(|e| panic!("{kind} is not a valid object: {} at {}", e.inner(), e.path()))
}

#[test]
fn every_object_is_a_valid_kubernetes_object() {
    let kinds: Vec<String> = documents()
        .iter()
        .map(|d| d["kind"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"
        ]
    );
    let _: ServiceAccount = typed("ServiceAccount");
    let _: ClusterRoleBinding = typed("ClusterRoleBinding");
}

#[test]
fn cluster_role_is_least_privilege() {
    let role: ClusterRole = typed("ClusterRole");
    let allowed: BTreeSet<(&str, &str, &str)> = [
        ("", "services", "list"),
        ("", "services", "watch"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("networking.k8s.io", "servicecidrs", "list"),
        ("networking.k8s.io", "servicecidrs", "watch"),
        ("", "events", "create"),
        ("", "events", "patch"),
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    ]
    .into_iter()
    .collect();
    let mut granted = BTreeSet::new();
    for rule in role.rules.unwrap_or_default() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{rule:?}"
        );
        for g in rule.api_groups.clone().unwrap_or_default() {
            for r in rule.resources.clone().unwrap_or_default() {
                for v in &rule.verbs {
                    granted.insert((g.clone(), r.clone(), v.clone()));
                }
            }
        }
    }
    let granted: BTreeSet<(&str, &str, &str)> = granted
        .iter()
        .map(|(g, r, v)| (g.as_str(), r.as_str(), v.as_str()))
        .collect();
    assert_eq!(granted, allowed, "exactly the verbs the proxy uses");
    let binding: ClusterRoleBinding = typed("ClusterRoleBinding");
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap_or_default());
}

#[test]
fn daemonset_is_a_node_proxy() {
    let ds: DaemonSet = typed("DaemonSet");
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("kube-proxy"));
    let c = &pod.containers[0];
    let command = c.command.clone().unwrap_or_default();
    assert!(
        command.contains(&"--hostname-override=$(NODE_NAME)".to_string()),
        "{command:?}"
    );
    assert!(
        command.contains(&"--config=/var/lib/kube-proxy/config.conf".to_string()),
        "{command:?}"
    );
    let mounts: Vec<String> = c
        .volume_mounts
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.mount_path)
        .collect();
    for m in ["/run/xtables.lock", "/lib/modules", "/var/lib/kube-proxy"] {
        assert!(mounts.contains(&m.to_string()), "{m} mounted: {mounts:?}");
    }
    assert_eq!(c.security_context.as_ref().and_then(|s| s.privileged), Some(true));
}

#[test]
fn configmap_holds_a_configuration_we_accept() {
    let cm: ConfigMap = typed("ConfigMap");
    let text = cm
        .data
        .unwrap_or_default()
        .get("config.conf")
        .cloned()
        .expect("config.conf");
    let dir = std::env::temp_dir().join(format!("kp-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.conf");
    std::fs::write(&path, &text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args([
            "render",
            &format!("--config={}", path.display()),
            concat!(env!("CARGO_MANIFEST_DIR"), "/examples/web"),
        ])
        .output()
        .expect("kube-proxy runs");
    std::fs::remove_dir_all(&dir).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("unknown field"), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("! -s 10.244.0.0/16"),
        "clusterCIDR applied"
    );
}
