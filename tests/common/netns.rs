//! Network namespaces for the tests (all need root): throw-away named ones, and running code on
//! a thread inside one, so that sockets it opens stay there. Nothing here touches the
//! namespace of the process itself.

use std::sync::atomic::{AtomicUsize, Ordering};

use kube_proxy::lab::netns::Netns;
use nix::sched::{CloneFlags, setns, unshare};

/// A new named namespace `PREFIX-PID-N`, deleted on drop (also when the test fails).
pub fn fresh_netns(prefix: &str) -> Netns {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    Netns::create(&name).unwrap_or_else(|e| panic!("creating network namespace {name}: {e:#}"))
}

/// Runs `f` on a thread that has entered the named namespace (`/run/netns/NAME`); sockets it
/// creates stay in that namespace after it returns them. A panic in `f` is this call's.
pub fn in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> T {
    on_thread(|| {
        let file = std::fs::File::open(format!("/run/netns/{name}")).expect("the namespace exists");
        setns(file, CloneFlags::CLONE_NEWNET).expect("setns (needs root)");
        f()
    })
}

/// Runs `f` on a thread in a network namespace of its own (unnamed: gone with the thread's
/// last socket). A panic in `f` is this call's.
pub fn in_fresh_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    on_thread(|| {
        unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) (needs root)");
        f()
    })
}

fn on_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
}

/// The names of this machine's named namespaces (`ip netns list`).
pub fn netns_list() -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list runs");
    assert!(
        out.status.success(),
        "ip netns list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// The named namespaces that the lab with pid `pid` would have made (`kplab-PID-...`).
pub fn lab_namespaces(pid: u32) -> Vec<String> {
    let prefix = format!("kplab-{pid}-");
    netns_list().into_iter().filter(|n| n.starts_with(&prefix)).collect()
}
