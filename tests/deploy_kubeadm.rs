//! Swapping the image of kubeadm's kube-proxy DaemonSet works unchanged. In the node namespace
//! of a test bed, the real binary runs as kubeadm's pod would run it: kubeadm's `command:`
//! (`tests/kubeadm/daemonset.yaml`, `$(NODE_NAME)` expanded as the kubelet does), in a private
//! mount namespace laid out as the pod is: the binary at the path the command names, the
//! ConfigMap of `deploy/kube-proxy.yaml` at `/var/lib/kube-proxy` (its `config.conf` and
//! `kubeconfig.conf` as they are, but for the kubeconfig's server: the test API server behind a
//! TLS front here) and the ServiceAccount's token and CA at
//! `/var/run/secrets/kubernetes.io/serviceaccount`. The API server refuses requests without the
//! token, and the TLS front has a certificate of a test CA: the daemon syncs and serves a
//! ClusterIP only if it read the token file and trusted the CA file the kubeconfig names; with
//! another CA in that file it must not sync. Nothing is mounted outside the private mount
//! namespace, and nothing is written outside a temporary directory.

mod common;

#[path = "support/apiserver/mod.rs"]
mod apiserver;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use apiserver::ApiServer;
use common::netns::in_netns;
use common::{ManifestDir, wait_until};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;
use kube_proxy::lab::netns::ChildGuard;
use kube_proxy::lab::probe::ProbeArgs;
use kube_proxy::lab::scenario::{Ep, ServiceSpec, manifests};
use kube_proxy::lab::testbed::{Testbed, TestbedSpec};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::Value;
use tokio_rustls::rustls;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const CLUSTER_IP: &str = "10.96.165.10";
const TOKEN: &str = "kube-proxy-sa-token";
/// The server of `deploy/kube-proxy.yaml`'s kubeconfig.conf, which the operator replaces.
const SERVER_PLACEHOLDER: &str = "https://CONTROL_PLANE_ENDPOINT:6443";

/// Lays out the pod's files in a private mount namespace, then runs the container's command.
/// `$1` holds the ConfigMap's files, `$2` the ServiceAccount's, `$3` is the binary.
const POD: &str = r#"set -eu
lib=$1 sa=$2 bin=$3
shift 3
mount -t tmpfs kp-pod-run /run
mkdir -p /run/secrets/kubernetes.io/serviceaccount
mount --bind "$sa" /run/secrets/kubernetes.io/serviceaccount
mount -t tmpfs kp-pod-lib /var/lib
mkdir /var/lib/kube-proxy
mount --bind "$lib" /var/lib/kube-proxy
mount -t tmpfs kp-pod-bin /usr/local/bin
touch /usr/local/bin/kube-proxy
mount --bind "$bin" /usr/local/bin/kube-proxy
exec "$@"
"#;

/// A directory `name` in `dir`, created.
fn sub(dir: &ManifestDir, name: &str) -> PathBuf {
    let sub = dir.0.join(name);
    std::fs::create_dir_all(&sub).expect("directory");
    sub
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`NAME.crt`, `NAME.key`) in `dir`.
fn make_ca(dir: &Path, name: &str) {
    let (crt, key) = (format!("{name}.crt"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-subj", "/CN=kube-proxy-rs test CA", "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
            "keyUsage=critical,keyCertSign", "-keyout", &key, "-out", &crt,
        ],
    );
}

/// `server.crt`/`server.key` for 127.0.0.1, signed by the CA `ca` in `dir`.
fn make_server_cert(dir: &Path) {
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    )
    .expect("write");
    openssl(
        dir,
        &[
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr",
        ],
    );
    openssl(
        dir,
        &[
            "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", "server.ext", "-out", "server.crt",
        ],
    );
}

/// A TLS listener on 127.0.0.1 of the namespace it is started in, passing each connection's
/// bytes on to `backend`; it stops when dropped.
struct TlsFront {
    addr: SocketAddr,
    /// TLS handshakes that failed (a client that does not trust the certificate) and succeeded.
    refused: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TlsFront {
    fn start(cert: &Path, key: &Path, backend: SocketAddr) -> TlsFront {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .expect("server.crt")
            .collect::<Result<_, _>>()
            .expect("PEM certificates");
        let key = PrivateKeyDer::from_pem_file(key).expect("server.key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("the server's certificate and key");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the TLS front");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("its address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (refused, accepted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let counts = (refused.clone(), accepted.clone());
        // The thread is created here, so it (and every socket it opens) is in this namespace.
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the TLS front's runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let serve = async {
                    while let Ok((conn, _)) = listener.accept().await {
                        let acceptor = acceptor.clone();
                        let (refused, accepted) = (counts.0.clone(), counts.1.clone());
                        tokio::spawn(async move {
                            let Ok(mut tls) = acceptor.accept(conn).await else {
                                refused.fetch_add(1, Ordering::SeqCst);
                                return;
                            };
                            accepted.fetch_add(1, Ordering::SeqCst);
                            if let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await {
                                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                            }
                        });
                    }
                };
                tokio::select! {
                    _ = serve => {}
                    _ = stopped => {}
                }
            });
            rt.shutdown_background();
        });
        TlsFront {
            addr,
            refused,
            accepted,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `config.conf` and `kubeconfig.conf` of the ConfigMap in `deploy/kube-proxy.yaml`.
fn configmap_files() -> (String, String) {
    let text = read("deploy/kube-proxy.yaml");
    let cm: ConfigMap = text
        .split("\n---\n")
        .filter_map(|doc| serde_saphyr::from_str::<Value>(doc).ok())
        .find(|d| d["kind"] == "ConfigMap")
        .map(|d| serde_json::from_value(d).expect("a ConfigMap"))
        .expect("deploy/kube-proxy.yaml has the ConfigMap");
    let data = cm.data.unwrap_or_default();
    let file = |k: &str| data.get(k).cloned().unwrap_or_else(|| panic!("no {k}"));
    (file("config.conf"), file("kubeconfig.conf"))
}

/// Kubeadm's container command, with `$(NODE_NAME)` expanded as the kubelet expands it.
fn kubeadm_command(node: &str) -> Vec<String> {
    let ds: DaemonSet = serde_saphyr::from_str(&read("tests/kubeadm/daemonset.yaml")).expect("kubeadm's DaemonSet");
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    let command = pod.containers[0].command.clone().expect("a command");
    command.into_iter().map(|a| a.replace("$(NODE_NAME)", node)).collect()
}

/// The objects of a Service with the bed's endpoints and the node, into the API server.
fn load_objects(api: &ApiServer, bed: &Testbed) {
    let eps: Vec<Ep> = bed.endpoints().iter().map(|e| Ep::local(e.ip)).collect();
    let yaml = manifests(&[ServiceSpec::new("web", CLUSTER_IP, &eps)]);
    for doc in yaml.split("\n---\n") {
        let obj: Value = serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("{e}: {doc}"));
        if !obj.is_null() {
            api.apply(obj);
        }
    }
}

/// Runs kubeadm's command in the pod's mount layout, in the node namespace.
fn start_pod(bed: &Testbed, lib: &Path, sa: &Path) -> ChildGuard {
    let mut args: Vec<String> = ["--mount", "--propagation", "private", "sh", "-c", POD, "pod"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend([lib, sa, Path::new(BIN)].map(|p| p.display().to_string()));
    args.extend(kubeadm_command("node-a"));
    bed.spawn_in_node(Path::new("unshare"), &args).expect("the pod starts")
}

fn kubeadms_daemonset_runs_our_image_unchanged() {
    let tmp = ManifestDir::new("kp-kubeadm-pod");
    let pki = sub(&tmp, "pki");
    make_ca(&pki, "ca");
    make_ca(&pki, "other-ca");
    make_server_cert(&pki);

    let mut spec = TestbedSpec::new("kpk", BIN);
    spec.endpoints = 2;
    let bed = Testbed::build(&spec).expect("test bed");
    let api = in_netns(bed.node.name(), ApiServer::start);
    api.require_token(Some(TOKEN));
    load_objects(&api, &bed);
    let front = in_netns(bed.node.name(), || {
        TlsFront::start(&pki.join("server.crt"), &pki.join("server.key"), api.addr())
    });

    let (config, kubeconfig) = configmap_files();
    assert!(kubeconfig.contains(SERVER_PLACEHOLDER), "{kubeconfig}");
    let lib = sub(&tmp, "configmap");
    std::fs::write(lib.join("config.conf"), &config).expect("write");
    let server = format!("https://{}", front.addr);
    std::fs::write(
        lib.join("kubeconfig.conf"),
        kubeconfig.replace(SERVER_PLACEHOLDER, &server),
    )
    .expect("write");
    let sa = sub(&tmp, "serviceaccount");
    // As the kubelet writes a projected token: no newline after it (client-go trims one,
    // kube-rs does not).
    std::fs::write(sa.join("token"), TOKEN).expect("write");
    std::fs::write(sa.join("namespace"), "kube-system").expect("write");

    // Another CA in the pod's ca.crt: the server is not trusted, nothing is synced.
    std::fs::copy(pki.join("other-ca.crt"), sa.join("ca.crt")).expect("copy");
    let pod = start_pod(&bed, &lib, &sa);
    pod.wait_for_log("Watch failed", Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("an untrusted server fails the watch: {e:#}\n{}", pod.log()));
    wait_until(Duration::from_secs(10), "a refused TLS handshake", || {
        front.refused.load(Ordering::SeqCst) > 0
    });
    let log = pod.log();
    assert_eq!(
        front.accepted.load(Ordering::SeqCst),
        0,
        "no handshake succeeds:\n{log}"
    );
    assert!(!log.contains("Synced rules"), "{log}");
    drop(pod);

    // The ServiceAccount's CA: trusted, the token accepted, the rules synced and serving.
    std::fs::copy(pki.join("ca.crt"), sa.join("ca.crt")).expect("copy");
    api.clear_requests();
    let pod = start_pod(&bed, &lib, &sa);
    pod.wait_for_log("Synced rules", Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("first sync: {e:#}\n{}", pod.log()));
    let log = pod.log();
    assert!(
        log.contains("node=\"node-a\""),
        "--hostname-override=$(NODE_NAME) applied:\n{log}"
    );
    assert!(!log.contains("Watch failed"), "{log}");
    let requests = api.requests();
    for path in [
        "/api/v1/services",
        "/apis/discovery.k8s.io/v1/endpointslices",
        "/api/v1/nodes",
    ] {
        assert!(
            requests.iter().any(|r| r.starts_with(&format!("GET {path}"))),
            "{path} listed: {requests:?}"
        );
    }
    let to = SocketAddr::new(CLUSTER_IP.parse().expect("an IP"), 80);
    let report = bed
        .probe(&bed.client, &ProbeArgs::tcp(to).with_count(20))
        .expect("probe runs");
    assert_eq!(report.ok_count(), 20, "{:?}\n{log}", report.errors());
    drop(pod);
    drop(front);
}

common::harness::main! {
    &[Root, Tool("ip"), Tool("unshare"), Tool("mount"), Tool("openssl"), Tool("iptables-nft-save")] =>
        kubeadms_daemonset_runs_our_image_unchanged;
}
