//! The deployment manifests are valid Kubernetes objects, the DaemonSet has what a node proxy
//! needs and runs as kubeadm's does (command, mounts), its ConfigMap is a configuration we accept
//! with a kubeconfig as kubeadm writes it, the image puts the binary where kubeadm's command
//! runs it, and the ClusterRole grants nothing beyond what the proxy uses. Kubeadm's own
//! DaemonSet and config.conf are in `tests/kubeadm/`. That the daemon runs from these files
//! unchanged, against an API server over TLS with the token, is `tests/deploy_kubeadm.rs`.

mod common;

use std::collections::BTreeSet;

use common::ManifestDir;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn documents() -> Vec<Value> {
    let text = read("deploy/kube-proxy.yaml");
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
    let _: ClusterRole = typed("ClusterRole");
    let _: ConfigMap = typed("ConfigMap");
    let _: DaemonSet = typed("DaemonSet");
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

fn configmap_file(key: &str) -> String {
    let cm: ConfigMap = typed("ConfigMap");
    cm.data
        .unwrap_or_default()
        .get(key)
        .cloned()
        .unwrap_or_else(|| panic!("the ConfigMap has no {key}"))
}

/// Writes `text` to `dir/name`; the path.
fn write(dir: &ManifestDir, name: &str, text: &str) -> String {
    let path = dir.0.join(name);
    std::fs::write(&path, text).expect("write");
    path.display().to_string()
}

#[test]
fn configmap_holds_a_configuration_we_accept() {
    let dir = ManifestDir::new("kp-deploy-render");
    let path = write(&dir, "config.conf", &configmap_file("config.conf"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(["render", &format!("--config={path}"), &format!("{ROOT}/examples/web")])
        .output()
        .expect("kube-proxy runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("unknown field"), "{stderr}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("! -s 10.244.0.0/16"),
        "clusterCIDR applied"
    );
}

/// The API server's address (not the `kubernetes` Service's ClusterIP, which needs a running
/// proxy), the pod's ServiceAccount token and CA: the kubeconfig.conf kubeadm writes.
#[test]
fn configmap_kubeconfig_is_kubeadms() {
    let text = configmap_file("kubeconfig.conf");
    let kc = kube::config::Kubeconfig::from_yaml(&text).unwrap_or_else(|e| panic!("not a kubeconfig: {e}\n{text}"));
    let context = kc.current_context.clone().expect("current-context");
    let ctx = kc
        .contexts
        .iter()
        .find(|c| c.name == context)
        .and_then(|c| c.context.clone())
        .expect("the current context exists");
    let cluster = kc
        .clusters
        .iter()
        .find(|c| c.name == ctx.cluster)
        .and_then(|c| c.cluster.clone())
        .expect("the context's cluster exists");
    let user = kc
        .auth_infos
        .iter()
        .find(|u| Some(&u.name) == ctx.user.as_ref())
        .and_then(|u| u.auth_info.clone())
        .expect("the context's user exists");
    const SA: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    assert_eq!(cluster.certificate_authority, Some(format!("{SA}/ca.crt")));
    assert_eq!(user.token_file, Some(format!("{SA}/token")));
    let server = cluster.server.expect("server");
    assert!(server.starts_with("https://"), "{server}");
    assert!(
        !server.contains("kubernetes.default"),
        "not through the Service: {server}"
    );
    // config.conf points at it where the DaemonSet mounts the ConfigMap.
    let config: Value = serde_saphyr::from_str(&configmap_file("config.conf")).expect("config.conf is YAML");
    let kubeconfig = config["clientConnection"]["kubeconfig"].as_str().unwrap_or_default();
    assert_eq!(
        kubeconfig,
        format!("{}/kubeconfig.conf", config_mount(&typed("DaemonSet")))
    );
}

/// Where the pod sees the `kube-proxy` ConfigMap.
fn config_mount(ds: &DaemonSet) -> String {
    let pod = ds.spec.clone().expect("spec").template.spec.expect("pod spec");
    let volume = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.config_map.as_ref().is_some_and(|c| c.name == "kube-proxy"))
        .expect("a volume of the kube-proxy ConfigMap");
    pod.containers[0]
        .volume_mounts
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|m| m.name == volume.name)
        .expect("the ConfigMap is mounted")
        .mount_path
}

/// The container of a DaemonSet, with what kubeadm's pod relies on: command, environment,
/// mounts (path, read-only, the volume behind each), host network, ServiceAccount.
fn pod_contract(ds: &DaemonSet) -> Value {
    let pod = ds.spec.clone().expect("spec").template.spec.expect("pod spec");
    let c = &pod.containers[0];
    let volumes = pod.volumes.clone().unwrap_or_default();
    let mounts: Vec<Value> = c
        .volume_mounts
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|m| {
            let v = volumes
                .iter()
                .find(|v| v.name == m.name)
                .expect("a mounted volume exists");
            serde_json::json!({
                "path": m.mount_path,
                "readOnly": m.read_only.unwrap_or(false),
                "configMap": v.config_map.as_ref().map(|c| c.name.clone()),
                "hostPath": v.host_path.as_ref().map(|h| (h.path.clone(), h.type_.clone())),
            })
        })
        .collect();
    serde_json::json!({
        "name": c.name,
        "command": c.command,
        "args": c.args,
        "env": c.env,
        "mounts": mounts,
        "hostNetwork": pod.host_network,
        "serviceAccountName": pod.service_account_name,
        "privileged": c.security_context.as_ref().and_then(|s| s.privileged),
    })
}

#[test]
fn daemonset_runs_as_kubeadms() {
    let kubeadm: DaemonSet =
        serde_saphyr::from_str(&read("tests/kubeadm/daemonset.yaml")).expect("kubeadm's DaemonSet");
    assert_eq!(pod_contract(&typed("DaemonSet")), pod_contract(&kubeadm));
}

/// The image puts the binary where kubeadm's command runs it and adds no wrapper in front.
#[test]
fn image_has_the_binary_where_kubeadms_command_runs_it() {
    let kubeadm: DaemonSet =
        serde_saphyr::from_str(&read("tests/kubeadm/daemonset.yaml")).expect("kubeadm's DaemonSet");
    let pod = kubeadm.spec.expect("spec").template.spec.expect("pod spec");
    let binary = pod.containers[0].command.clone().unwrap_or_default()[0].clone();
    let containerfile = read("deploy/Containerfile");
    let copy = containerfile
        .lines()
        .find(|l| l.starts_with("COPY --from=build") && l.contains("target/release/kube-proxy"))
        .expect("the binary is copied into the image");
    assert_eq!(copy.split_whitespace().last(), Some(binary.as_str()), "{copy}");
    let entrypoint = containerfile
        .lines()
        .find(|l| l.starts_with("ENTRYPOINT"))
        .unwrap_or_default();
    assert_eq!(entrypoint, format!("ENTRYPOINT [\"{binary}\"]"));
    assert!(!std::path::Path::new(&format!("{ROOT}/deploy/iptables-backend.sh")).exists());
}

/// Kubeadm's config.conf (every field, zeros where unset) with kubeadm's flags: accepted, with
/// upstream's defaults in place of the zeros and the kubeconfig kept.
#[test]
fn kubeadms_config_and_flags_are_accepted() {
    let dir = ManifestDir::new("kp-deploy-kubeadm");
    let config = write(&dir, "config.conf", &read("tests/kubeadm/config.conf"));
    let out_path = dir.0.join("effective.yaml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args([
            format!("--config={config}"),
            "--hostname-override=node-a".to_string(),
            format!("--write-config-to={}", out_path.display()),
        ])
        .output()
        .expect("kube-proxy runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("unknown field"), "{stderr}");
    let effective: Value = serde_saphyr::from_str(&std::fs::read_to_string(&out_path).expect("written")).expect("YAML");
    for (path, want) in [
        (
            "/clientConnection/kubeconfig",
            serde_json::json!("/var/lib/kube-proxy/kubeconfig.conf"),
        ),
        ("/hostnameOverride", serde_json::json!("node-a")),
        ("/mode", serde_json::json!("iptables")),
        ("/clientConnection/qps", serde_json::json!(5)),
        ("/iptables/syncPeriod", serde_json::json!("30s")),
        ("/iptables/masqueradeBit", serde_json::json!(14)),
        ("/healthzBindAddress", serde_json::json!("0.0.0.0:10256")),
        ("/conntrack/maxPerCore", serde_json::json!(32768)),
    ] {
        assert_eq!(effective.pointer(path), Some(&want), "{path} in\n{effective:#}");
    }
}
