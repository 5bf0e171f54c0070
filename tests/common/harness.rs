//! The test harness of the files that need root, a tool or a kernel feature (the `[[test]]`
//! targets with `harness = false` in Cargo.toml). Each test declares what it needs; a test whose
//! needs are not met here is reported as ignored, with the reason, in the usual summary
//! (`test NAME ... ignored (needs root)`), so it never passes without running. Otherwise it
//! runs, and a panic is a failure, as under libtest. Command-line arguments are libtest's
//! (`FILTER`, `--exact`, `--skip`, `--list`, `--test-threads`, `--nocapture`...), parsed by
//! `libtest-mimic`; output is never captured.
//!
//! A file converts in a few lines: put `harness = false` on it in Cargo.toml, `mod common;` at
//! its top, drop `#[test]` and the early returns from its test functions, and end it with
//!
//! ```ignore
//! common::harness::main! {
//!     &[] => a_pure_test, another_one;
//!     &[Root, Tool("nft")] => a_test_that_applies_rules;
//! }
//! ```
//!
//! In such a file `#[test]` compiles the function out; a test function left out of `main!` is
//! unused code, which the compiler warns about.
//!
//! A condition only the test itself can see (a host value it cannot change) ends it with
//! [`skip`], reported the same way. With `KUBE_PROXY_TESTS_REQUIRE_ALL=1` (as `.ci/run` sets
//! it: CI has every package and runs as root) an unmet requirement or a skip is a failure.

use std::path::Path;
use std::process::ExitCode;

use libtest_mimic::{Arguments, Completion, Trial};

/// Something a test needs from the machine it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requirement {
    /// An effective user id of 0 (network namespaces, rules, `/boot`).
    Root,
    /// A program on `PATH`, or in /usr/sbin or /sbin (where root's tools are).
    Tool(&'static str),
    /// A kernel that has the feature (loaded now).
    Kernel(KernelFeature),
    /// A kernel that lacks the feature: the test checks what happens without it.
    KernelWithout(KernelFeature),
    /// The test VM (`kube_proxy::vm`): its host tools and a kernel in /boot, or being in it
    /// already (a VM test re-runs its binary there). Root is a separate requirement.
    Vm,
    /// Not in the test VM: the test is about the host (in the VM it is never selected).
    Host,
    /// Any one of these.
    AnyOf(&'static [Requirement]),
}

/// A kernel feature that some tests need and others check the absence of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFeature {
    /// IP Virtual Server, the `ip_vs` module.
    Ipvs,
    /// Connection tracking, the `nf_conntrack` module.
    Conntrack,
    /// IPv6.
    Ipv6,
}

impl KernelFeature {
    pub fn present(self) -> bool {
        Path::new(self.path()).exists()
    }

    fn path(self) -> &'static str {
        match self {
            KernelFeature::Ipvs => "/proc/net/ip_vs",
            KernelFeature::Conntrack => "/proc/sys/net/netfilter/nf_conntrack_max",
            KernelFeature::Ipv6 => "/proc/net/if_inet6",
        }
    }

    fn describe(self) -> String {
        let name = match self {
            KernelFeature::Ipvs => "IPVS",
            KernelFeature::Conntrack => "connection tracking",
            KernelFeature::Ipv6 => "IPv6",
        };
        format!("{name} ({})", self.path())
    }
}

/// What a test that ends itself with [`skip`] panics with.
struct Skipped(String);

/// Ends the running test as skipped, for `reason` (a condition of this host that the test
/// cannot create); the summary reports it as ignored, with the reason.
#[allow(dead_code)]
pub fn skip(reason: impl Into<String>) -> ! {
    std::panic::panic_any(Skipped(reason.into()))
}

/// Whether every test must run here (CI): then an unmet requirement is a failure.
fn require_all() -> bool {
    std::env::var("KUBE_PROXY_TESTS_REQUIRE_ALL").is_ok_and(|v| v == "1")
}

impl Requirement {
    /// `None` when this machine meets the requirement, else what is missing, in words.
    pub fn unmet(self) -> Option<String> {
        let missing = |met: bool, why: String| (!met).then_some(why);
        match self {
            Requirement::Root => missing(nix::unistd::geteuid().is_root(), "root".to_string()),
            Requirement::Tool(tool) => missing(super::which(tool), tool.to_string()),
            Requirement::Kernel(f) => missing(f.present(), format!("a kernel with {}", f.describe())),
            Requirement::KernelWithout(f) => missing(!f.present(), format!("a kernel without {}", f.describe())),
            Requirement::Vm => {
                if kube_proxy::vm::in_vm() {
                    return None;
                }
                let tools = kube_proxy::vm::missing_host_tools();
                missing(tools.is_empty(), format!("the test VM: {}", tools.join(", ")))
            }
            Requirement::Host => missing(!kube_proxy::vm::in_vm(), "the host, not the test VM".to_string()),
            Requirement::AnyOf(options) => {
                let unmet: Option<Vec<String>> = options.iter().map(|r| r.unmet()).collect();
                unmet.map(|all| format!("one of: {}", all.join(" or ")))
            }
        }
    }
}

/// What of `needs` this machine lacks, as the reason of a skip (`None`: the test can run).
pub fn unmet(needs: &[Requirement]) -> Option<String> {
    let unmet: Vec<String> = needs.iter().filter_map(|r| r.unmet()).collect();
    (!unmet.is_empty()).then(|| format!("needs {}", unmet.join("; ")))
}

/// What a test that runs the daemon in a test bed (`kube_proxy::lab::testbed`) needs, in
/// iptables or nftables mode, with the tools the tests read the rules with.
#[allow(dead_code)]
pub const DAEMON_IN_A_BED: &[Requirement] = &[
    Requirement::Root,
    Requirement::Tool("ip"),
    Requirement::Tool("sysctl"),
    Requirement::Tool("iptables"),
    Requirement::Tool("iptables-save"),
    Requirement::Tool("iptables-restore"),
    Requirement::Tool("nft"),
];

/// One test: a name (what filters and `--exact` match), what it needs, and its body.
pub struct Test {
    name: String,
    needs: Vec<Requirement>,
    body: Box<dyn FnOnce() + Send>,
}

/// A test that needs nothing yet (see [`Test::needs`]).
pub fn test(name: impl Into<String>, body: impl FnOnce() + Send + 'static) -> Test {
    Test {
        name: name.into(),
        needs: Vec::new(),
        body: Box::new(body),
    }
}

impl Test {
    pub fn needs(mut self, needs: &[Requirement]) -> Test {
        self.needs.extend_from_slice(needs);
        self
    }

    /// The needs are checked when the test is about to run, as an early return inside it would
    /// have been (a test before it may have loaded a module).
    fn into_trial(self) -> Trial {
        let Test { name, needs, body } = self;
        Trial::ignorable_test(name, move || {
            let ignored = |reason: String| {
                if require_all() {
                    Err(format!("{reason}, and KUBE_PROXY_TESTS_REQUIRE_ALL=1 says every test must run").into())
                } else {
                    Ok(Completion::ignored_with(reason))
                }
            };
            if let Some(reason) = unmet(&needs) {
                return ignored(reason);
            }
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
                Ok(()) => Ok(Completion::Completed),
                Err(payload) => match payload.downcast::<Skipped>() {
                    Ok(skipped) => ignored(skipped.0),
                    Err(panic) => std::panic::resume_unwind(panic),
                },
            }
        })
    }
}

/// Runs `tests` as the command line asks; the exit code is libtest's (101 when one failed).
pub fn run(tests: impl IntoIterator<Item = Test>) -> ExitCode {
    let mut args = Arguments::from_args();
    // libtest also takes the thread count from the environment; libtest-mimic does not.
    if args.test_threads.is_none() {
        args.test_threads = std::env::var("RUST_TEST_THREADS").ok().and_then(|n| n.parse().ok());
    }
    let trials: Vec<Trial> = tests.into_iter().map(Test::into_trial).collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// A test that holds in every proxy mode, given the mode.
pub type PerModeTest = fn(&'static str);

/// Runs the tests of a file that checks a proxy behaviour in iptables and nftables mode:
/// each of `in_every_mode` once per mode (named `MODE_mode::NAME`), each of `once` once, all
/// needing `needs`.
#[allow(dead_code)]
pub fn run_per_mode(
    in_every_mode: &[(&'static str, PerModeTest)],
    once: &[(&'static str, fn())],
    needs: &'static [Requirement],
) -> ExitCode {
    let mut tests = Vec::new();
    for mode in ["iptables", "nftables"] {
        for &(name, f) in in_every_mode {
            tests.push(test(format!("{mode}_mode::{name}"), move || f(mode)).needs(needs));
        }
    }
    for &(name, f) in once {
        tests.push(test(name, f).needs(needs));
    }
    run(tests)
}

/// `[(name, function)]` of test functions, each named after its function, for a `fn main`
/// that builds its tests itself (e.g. one per proxy mode).
#[allow(unused_macros)]
macro_rules! named {
    ($($test:ident),+ $(,)?) => {
        [$((stringify!($test), $test as _)),+]
    };
}
#[allow(unused_imports)]
pub(crate) use named;

/// `fn main` of a test file: groups of test functions, each group after what its tests need
/// (`&[]` for nothing). Tests are named after their functions, as libtest names them.
#[allow(unused_macros)]
macro_rules! main {
    ($($needs:expr => $($test:ident),+ $(,)? ;)*) => {
        fn main() -> std::process::ExitCode {
            #[allow(unused_imports)]
            use $crate::common::harness::{KernelFeature::*, Requirement::*};
            $crate::common::harness::run(vec![$($(
                $crate::common::harness::test(stringify!($test), $test).needs($needs),
            )+)*])
        }
    };
}
#[allow(unused_imports)]
pub(crate) use main;
