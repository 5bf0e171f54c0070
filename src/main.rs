//! The `kube-proxy` binary: the command line ([`kube_proxy::cli`]), then the daemon or one of
//! the subcommands `render`, `trace`, `lab` and `explain`. A thin edge: reading files and printing;
//! everything else lives in the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use tracing::{info, warn};

use kube_proxy::app;
use kube_proxy::cli::{
    Cli, Command, DaemonFlags, ExplainArgs, FamilyArg, LabAction, OutputArg, RenderArgs, TraceArgs, normalize_args,
};
use kube_proxy::config::ProxyConfig;
use kube_proxy::manifest;
use kube_proxy::model::{IpFamily, Protocol, build_state};
use kube_proxy::trace::{self, Packet};

/// The allocator: jemalloc, with one arena.
///
/// glibc malloc fragments under the daemon's churn. In the soak at 10,000 Services × 10
/// endpoints (40 changes/s, the cluster shrinking from 10,000 to 8,000 Services) its RSS rose
/// by 6.9 % in 30 minutes, linearly from the tenth minute, even with its mmap threshold fixed
/// (docs/soak.md). jemalloc keeps small objects in slabs by size class and returns freed pages
/// to the kernel after a few seconds: built in with one arena, the same run went from 70.4 to
/// 66.7 MiB as the cluster shrank (−5.25 %). One arena, as the daemon's threads rarely allocate
/// at the same moment (each thread still caches), so that memory freed by one thread is reused
/// by all and the footprint does not grow with the node's cores (jemalloc's default is four
/// arenas per core). `_RJEM_MALLOC_CONF` in the environment adds to or overrides this.
#[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc reads its options from this C string (`malloc_conf`, with the crate's symbol
/// prefix); a thin pointer to its first byte, as C declares it.
#[cfg(all(feature = "jemalloc", target_os = "linux", target_env = "gnu"))]
#[unsafe(export_name = "_rjem_malloc_conf")]
#[allow(non_upper_case_globals)]
pub static malloc_conf: &u8 = &b"narenas:1\0"[0];

/// glibc malloc tuned for a long-lived daemon, in a build without jemalloc (each setting
/// unless the environment sets it): one arena for every thread (memory freed in one arena
/// stays there; at 10,000 × 10 with default arenas the daemon held 81.5 MiB, with one
/// 64.2 MiB), and a fixed mmap threshold of 128 KiB (glibc raises it to the size of each large
/// block freed, so the megabyte buffers of every sync come from the heap, among long-lived
/// small objects). Called first, before any thread exists.
fn tune_malloc() {
    #[cfg(all(not(feature = "jemalloc"), target_os = "linux", target_env = "gnu"))]
    for (var, param, value) in [
        ("MALLOC_ARENA_MAX", nix::libc::M_ARENA_MAX, 1),
        ("MALLOC_MMAP_THRESHOLD_", nix::libc::M_MMAP_THRESHOLD, 128 * 1024),
    ] {
        if std::env::var_os(var).is_none() {
            // SAFETY: mallopt only sets a glibc malloc parameter; no other thread runs yet.
            unsafe {
                nix::libc::mallopt(param, value);
            }
        }
    }
}

fn main() -> ExitCode {
    tune_malloc();
    let cli = Cli::parse_from(normalize_args(std::env::args()));
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

const VERSION_LINE: &str = concat!(
    "kube-proxy-rs ",
    env!("CARGO_PKG_VERSION"),
    " (compatible with Kubernetes kube-proxy; configuration kubeproxy.config.k8s.io/v1alpha1)"
);

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if let Some(v) = &cli.daemon.version {
        match v.as_str() {
            "raw" => {
                let raw = serde_json::json!({
                    "name": "kube-proxy-rs",
                    "version": env!("CARGO_PKG_VERSION"),
                    "configAPIVersion": kube_proxy::config::API_VERSION,
                });
                println!("{}", serde_json::to_string_pretty(&raw)?);
                return Ok(ExitCode::SUCCESS);
            }
            other => match kube_proxy::config::parse_go_bool(other) {
                Some(true) => {
                    println!("{VERSION_LINE}");
                    return Ok(ExitCode::SUCCESS);
                }
                Some(false) => {}
                None => bail!("invalid value {other:?} for --version: must be true, false or raw"),
            },
        }
    }
    let cfg = ProxyConfig::resolve(&cli.flags)?;
    kube_proxy::logging::init(&cfg.logging);
    // The CLI tools print plain warnings; the daemon logs them.
    let tool = cli.command.is_some();
    for w in &cfg.warnings {
        if tool {
            eprintln!("warning: {w}");
        } else {
            warn!("{w}");
        }
    }
    let api = cli.flags.kubeconfig.is_some() || cli.flags.master.is_some();
    match cli.command {
        None => daemon(cfg, cli.daemon),
        Some(Command::Explain(args)) => Ok(explain_cmd(&cfg, args, api)),
        Some(Command::Render(args)) => render(&cfg, args),
        Some(Command::Trace(args)) => trace_cmd(&cfg, args),
        Some(Command::Lab(args)) => match args.action {
            Some(LabAction::Serve(a)) => kube_proxy::lab::probe::serve(&a).map(|_| ExitCode::SUCCESS),
            Some(LabAction::Probe(a)) => kube_proxy::lab::probe::probe(&a).map(|_| ExitCode::SUCCESS),
            None => {
                let binary = std::env::current_exe().context("locating the kube-proxy binary")?;
                // As given: where the lab runs again in the VM, it parses them there itself.
                let argv: Vec<String> = std::env::args().skip(1).collect();
                kube_proxy::lab::run::main(binary, cfg.mode, args.connections, &argv)
            }
        },
    }
}

/// As upstream's `Options.Run`: --write-config-to, then --cleanup, then --init-only, then the daemon.
fn daemon(cfg: ProxyConfig, flags: DaemonFlags) -> anyhow::Result<ExitCode> {
    if let Some(path) = &flags.write_config_to {
        let yaml = cfg
            .to_yaml()
            .map_err(anyhow::Error::msg)
            .context("encoding the configuration")?;
        std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))?;
        info!(file = %path.display(), "Wrote configuration");
        return Ok(ExitCode::SUCCESS);
    }
    if flags.cleanup == Some(true) {
        let errors = kube_proxy::daemon::cleanup_all(kube_proxy::iptables::backend::detect_and_log());
        for e in &errors {
            eprintln!("error: cleanup: {e}");
        }
        return Ok(if errors.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    if flags.init_only == Some(true) {
        // Failures are logged (as warnings) by the conntrack module itself.
        let warnings = kube_proxy::conntrack::apply_sysctls_and_hashsize(
            &cfg.conntrack,
            Path::new("/proc/sys"),
            Some(Path::new(kube_proxy::conntrack::HASHSIZE_PATH)),
            kube_proxy::conntrack::detect_num_cpus(),
        );
        info!(warnings = warnings.len(), "Initialization done (--init-only)");
        return Ok(ExitCode::SUCCESS);
    }
    let source = match flags.manifests {
        Some(dir) => {
            if !dir.is_dir() {
                bail!(
                    "invalid value {:?} for --manifests: not a directory",
                    dir.display().to_string()
                );
            }
            kube_proxy::daemon::SourceConfig::Manifests(dir)
        }
        None => kube_proxy::daemon::SourceConfig::Api(cfg.client_connection.clone()),
    };
    apply_oom_score_adj(cfg.oom_score_adj);
    kube_proxy::daemon::run(kube_proxy::daemon::DaemonOptions {
        config: cfg,
        source,
        debug_allow_remote: flags.debug_allow_remote == Some(true),
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `oomScoreAdj`: upstream's OOMAdjuster on its own process; a failure is not fatal.
fn apply_oom_score_adj(value: i32) {
    match std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        Ok(()) => info!(oom_score_adj = value, "Set the OOM score adjustment"),
        Err(e) => warn!(oom_score_adj = value, error = %e, "Could not set the OOM score adjustment"),
    }
}

fn load(paths: &[PathBuf]) -> anyhow::Result<manifest::Objects> {
    let objects = manifest::load_paths(paths)?;
    for w in &objects.warnings {
        eprintln!("warning: {w}");
    }
    Ok(objects)
}

fn render(cfg: &ProxyConfig, args: RenderArgs) -> anyhow::Result<ExitCode> {
    let objects = load(&args.paths)?;
    let node = app::node_info(&objects, cfg);
    let families = match args.ip_family {
        Some(FamilyArg::V4) => vec![IpFamily::V4],
        Some(FamilyArg::V6) => vec![IpFamily::V6],
        None => app::families_in_use(&objects, &node),
    };
    // A Service-level problem is found once per family; report it once.
    let mut reported = std::collections::HashSet::new();
    for (i, family) in families.into_iter().enumerate() {
        let rendered = app::render(cfg, &build_state(&objects, &node, family));
        for w in rendered.warnings.iter().filter(|w| reported.insert((*w).clone())) {
            eprintln!("warning: {w}");
        }
        if i > 0 {
            println!();
        }
        print!("{}", rendered.text);
    }
    Ok(ExitCode::SUCCESS)
}

fn trace_cmd(cfg: &ProxyConfig, args: TraceArgs) -> anyhow::Result<ExitCode> {
    let protocol = Protocol::from_api(&args.protocol.to_ascii_uppercase()).with_context(|| {
        format!(
            "invalid value {:?} for --protocol: must be TCP, UDP or SCTP",
            args.protocol
        )
    })?;
    if IpFamily::of(&args.from) != IpFamily::of(&args.to.ip()) {
        bail!("--from {} and --to {} are of different IP families", args.from, args.to);
    }
    let packet = Packet {
        src: args.from,
        dst: args.to.ip(),
        dport: args.to.port(),
        protocol,
        in_interface: args.in_interface.clone(),
    };
    let result = if args.live {
        app::trace_live(cfg, &packet)?
    } else {
        let objects = load(&args.paths)?;
        let state = build_state(&objects, &app::node_info(&objects, cfg), IpFamily::of(&args.to.ip()));
        let (warnings, result) = app::trace(cfg, &state, &packet);
        for w in &warnings {
            eprintln!("warning: {w}");
        }
        result?
    };
    match args.output {
        OutputArg::Json => println!("{}", serde_json::to_string_pretty(&result)?),
        OutputArg::Text => print!("{}", trace::render_text(&result, &packet)),
    }
    Ok(ExitCode::SUCCESS)
}

/// `explain`: 0 when nothing is wrong, 1 when a problem is diagnosed, 2 on a usage error
/// (including what makes the question unanswerable: unreadable manifests, an API that does
/// not list the objects).
fn explain_cmd(cfg: &ProxyConfig, args: ExplainArgs, api: bool) -> ExitCode {
    use kube_proxy::explain::{diagnose, gather, report, view::ServiceRef};
    const USAGE: u8 = 2;
    let target = match args.service.as_deref().map(ServiceRef::parse).transpose() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: invalid value for SERVICE: {e}");
            return ExitCode::from(USAGE);
        }
    };
    if let Some(dir) = args.manifests.as_ref().filter(|d| !d.is_dir()) {
        eprintln!(
            "error: invalid value {:?} for --manifests: not a directory",
            dir.display().to_string()
        );
        return ExitCode::from(USAGE);
    }
    let req = gather::Request {
        target: target.clone(),
        all: args.all,
        from: args.from,
        manifests: args.manifests.clone(),
        api,
    };
    let facts = match gather::gather(cfg, &req) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(USAGE);
        }
    };
    let asked = target.as_ref().map(ToString::to_string);
    let diagnosing = std::time::Instant::now();
    let diagnosis = diagnose::diagnose(&facts, asked.as_deref());
    if std::env::var_os(gather::TIMINGS_ENV).is_some() {
        eprintln!(
            "explain timing: the diagnosis took {} ms",
            diagnosing.elapsed().as_millis()
        );
    }
    match args.output {
        OutputArg::Json => println!("{}", report::json(&facts, &diagnosis)),
        OutputArg::Text if args.all => print!("{}", report::all_text(&facts, &diagnosis)),
        OutputArg::Text => print!(
            "{}",
            report::text(&facts, &diagnosis, asked.as_deref().unwrap_or("--all"))
        ),
    }
    if diagnosis.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
