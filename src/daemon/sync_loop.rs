//! The daemon's loop: takes the source's updates, asks the [`Runner`] what to do, and does it
//! through the injected edges — the proxiers ([`Proxier`]), the host ([`Host`]) and the
//! [`Telemetry`] — on tokio's clock, which tests pause and advance. It builds this node's info
//! and the state of each family once per sync, from the state builder that holds the objects.
//!
//! The other modes' leftovers ([`Leftovers`], after a mode switch) are removed right after the
//! first sync in which every family has succeeded at least once, never before: until then the
//! old mode's rules are what serves the node. What they could not remove yet (IPVS virtual
//! servers with open connections, a failure) is asked again at each periodic check, with a log
//! line, until nothing is left.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant as StdInstant;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::host::Host;
use super::leftovers::Leftovers;
use super::runner::{Action, FamilyTraits, Runner, RunnerConfig, SyncKind};
use super::telemetry::Telemetry;
use crate::app;
use crate::config::ProxyConfig;
use crate::conntrack::UdpServices;
use crate::model::{IpFamily, NodeInfo, ProxyState, StateBuilder};
use crate::proxy::{NodePortAddresses, Proxier, SyncContext, SyncReport};
use crate::source::Update;

/// The source stopped for good: the daemon cannot keep its rules current any more.
#[derive(Debug, thiserror::Error)]
#[error("the source of Services stopped")]
pub struct SourceStopped;

/// The loop and everything it drives.
pub struct SyncLoop {
    config: Arc<ProxyConfig>,
    proxiers: Vec<Box<dyn Proxier>>,
    host: Box<dyn Host>,
    telemetry: Arc<Telemetry>,
    builder: StateBuilder,
    runner: Runner,
    /// The source watches this node by name (the API): a missing Node then counts as not
    /// eligible for health, as upstream; a manifest directory need not hold one.
    node_watched: bool,
    /// What the other modes left, until it is all gone.
    leftovers: Option<Box<dyn Leftovers>>,
    /// The families that have synced successfully since the start.
    programmed: BTreeSet<IpFamily>,
    /// Every family has: the leftovers may go (and are re-checked at each periodic check).
    removing: bool,
    /// The families whose last sync succeeded on the builder's latest state: the changes of
    /// their next build are exactly what their proxier has yet to program.
    in_step: BTreeSet<IpFamily>,
}

impl SyncLoop {
    pub fn new(
        config: Arc<ProxyConfig>,
        proxiers: Vec<Box<dyn Proxier>>,
        host: Box<dyn Host>,
        telemetry: Arc<Telemetry>,
        node_watched: bool,
    ) -> SyncLoop {
        let traits: Vec<FamilyTraits> = proxiers
            .iter()
            .map(|p| FamilyTraits {
                family: p.family(),
                full_sync_period: p.full_sync_period(),
                syncs_every_period: p.syncs_every_period(),
            })
            .collect();
        let periods = RunnerConfig {
            min_sync_period: config.min_sync_period,
            sync_period: config.sync_period,
        };
        SyncLoop {
            runner: Runner::new(periods, &traits, now()),
            config,
            proxiers,
            host,
            telemetry,
            builder: StateBuilder::new(),
            node_watched,
            leftovers: None,
            programmed: BTreeSet::new(),
            removing: false,
            in_step: BTreeSet::new(),
        }
    }

    /// What the other modes left (a mode switch), to remove once this mode is programmed.
    pub fn with_leftovers(mut self, leftovers: Option<Box<dyn Leftovers>>) -> SyncLoop {
        self.leftovers = leftovers;
        self
    }

    /// Runs until the source stops (the error says so); never returns otherwise.
    pub async fn run(mut self, updates: &mut UnboundedReceiver<Update>) -> Result<(), SourceStopped> {
        info!("Not syncing rules until Services and Endpoints have been received from master");
        loop {
            match self.runner.next(now()) {
                Action::Check => self.check(),
                Action::Sync(syncs) => self.sync(&syncs).await,
                Action::Wait(until) => {
                    let update = match until {
                        None => updates.recv().await,
                        Some(t) => tokio::select! {
                            u = updates.recv() => u,
                            () = tokio::time::sleep_until(Instant::from_std(t)) => continue,
                        },
                    };
                    self.receive(update.ok_or(SourceStopped)?);
                    // Coalesce what else arrived into the same sync.
                    while let Ok(u) = updates.try_recv() {
                        self.receive(u);
                    }
                }
            }
        }
    }

    /// Applies one update; the runner learns whether anything changed.
    fn receive(&mut self, update: Update) {
        let changes = self.builder.apply(update.changes);
        if update.synced && !self.runner.is_ready() {
            self.runner.ready();
            self.runner.changed();
        }
        if changes.any() {
            self.telemetry.changed(&changes);
            self.runner.changed();
            self.telemetry.queued(&self.runner.pending());
        }
    }

    /// The periodic check of every family's rules.
    fn check(&mut self) {
        for p in &mut self.proxiers {
            let intact = p.intact();
            if !intact {
                warn!(ip_family = %p.family(), "Canary chains or jump rules are missing (tables flushed or reloaded by someone else); doing a full sync");
            }
            self.runner.checked(p.family(), intact);
        }
        if self.removing {
            self.remove_leftovers();
        }
    }

    /// Asks the leftovers to go; logs what is still there.
    fn remove_leftovers(&mut self) {
        let Some(leftovers) = self.leftovers.as_mut() else {
            return;
        };
        let left = leftovers.remove();
        if left.is_empty() {
            info!("Nothing is left of the other proxy modes' rules");
            self.leftovers = None;
        } else {
            info!(
                left = left.join("; "),
                "Some of another proxy mode's state is still in use or could not be removed; checking again in a sync period"
            );
        }
    }

    /// Syncs the families the runner named.
    async fn sync(&mut self, syncs: &[(IpFamily, SyncKind)]) {
        let cfg = self.config.clone();
        let node = app::node_info_from(&self.builder.store().nodes, &cfg);
        self.prepare_node(&cfg, &node);
        let ctx = SyncContext {
            config: &cfg,
            node: &node,
            tcp_be_liberal: self.host.tcp_be_liberal(),
        };
        let mut states = Vec::new();
        for &(family, kind) in syncs {
            let Some(i) = self.proxiers.iter().position(|p| p.family() == family) else {
                continue;
            };
            let start = StdInstant::now();
            let (state, changed) = self.builder.build_changed(&node, family);
            debug!(ip_family = %family, elapsed_ms = ms(start), "Built the state");
            for w in &state.warnings {
                warn!(ip_family = %family, "{w}");
            }
            let in_step = self.in_step.remove(&family);
            let p = &mut self.proxiers[i];
            p.configure(&ctx);
            let result = match (kind, changed) {
                (SyncKind::Full, _) => p.sync_full(&state),
                (SyncKind::Changes, Some(changed)) if in_step => p.sync_changed(&state, &changed),
                (SyncKind::Changes, _) => p.sync_changes(&state),
            };
            let cleanup_at = p.next_cleanup();
            match result {
                Ok(report) => {
                    log_sync(&cfg, family, &state, &report);
                    if report.udp_endpoints_removed || report.full {
                        self.clean_conntrack(family, &state);
                    }
                    let prefer_same_node = cfg.feature_enabled("PreferSameTrafficDistribution");
                    self.telemetry.synced(family, &report, &state, prefer_same_node);
                    self.runner.synced(family, now(), Ok(report.full), cleanup_at);
                    self.programmed.insert(family);
                    self.in_step.insert(family);
                    states.push(state);
                }
                Err(e) => {
                    error!(ip_family = %family, error = %e, "Sync failed; keeping the previous rules and retrying with a full sync");
                    self.telemetry.failed(&state, e.full, &e.to_string());
                    self.runner.synced(family, now(), Err(()), cleanup_at);
                    self.builder.recycle(state);
                }
            }
        }
        if !self.removing && self.proxiers.iter().all(|p| self.programmed.contains(&p.family())) {
            self.removing = true;
            self.remove_leftovers();
        }
        if !states.is_empty() {
            self.telemetry.sync_service_health(&states).await;
        }
        for state in states {
            self.builder.recycle(state);
        }
        if self.runner.pending().is_empty() {
            let families: Vec<IpFamily> = self.proxiers.iter().map(|p| p.family()).collect();
            self.telemetry.all_synced(&families);
        }
    }

    /// What a sync needs of the node first: its health eligibility and, for localhost
    /// NodePorts, `route_localnet` (upstream sets it when they are in effect).
    fn prepare_node(&mut self, cfg: &ProxyConfig, node: &NodeInfo) {
        let nodes = &self.builder.store().nodes;
        let object = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(node.name.as_str()));
        if self.node_watched || object.is_some() {
            self.telemetry.sync_node(object);
        }
        let npa = NodePortAddresses::new(IpFamily::V4, &cfg.node_port_addresses, node.primary_ip(IpFamily::V4));
        if cfg.localhost_node_ports && npa.contains_ipv4_loopback() {
            self.host.ensure_route_localnet();
        }
    }

    fn clean_conntrack(&mut self, family: IpFamily, state: &ProxyState) {
        let services = UdpServices::from_state(state);
        if services.is_empty() {
            return;
        }
        let start = StdInstant::now();
        match self.host.clean_conntrack(family, &services) {
            Ok(n) => {
                self.telemetry.conntrack_reconciled(family, n, start.elapsed());
                if n > 0 {
                    info!(ip_family = %family, deleted = n, "Deleted stale UDP conntrack entries");
                } else {
                    debug!(ip_family = %family, "No stale UDP conntrack entries");
                }
            }
            Err(e) => warn!(ip_family = %family, error = %e, "Could not clean stale UDP conntrack entries"),
        }
    }
}

/// tokio's clock as a std instant (paused and advanced in tests).
fn now() -> StdInstant {
    Instant::now().into_std()
}

fn ms(since: StdInstant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn log_sync(cfg: &ProxyConfig, family: IpFamily, state: &ProxyState, report: &SyncReport) {
    info!(
        mode = cfg.mode.as_str(),
        ip_family = %family,
        full = report.full,
        services = state.service_ports.len(),
        rewritten = report.rewritten_services,
        removed = report.removed_objects,
        operations = report.operations,
        elapsed_ms = report.elapsed.as_secs_f64() * 1000.0,
        "Synced rules"
    );
}

#[cfg(test)]
mod tests {
    //! The loop driven with recording fakes on paused time: each behaviour of the runner seen
    //! from outside (what the proxier is asked, and when), plus the metrics each mode feeds.

    use std::time::Duration;

    use tokio::sync::mpsc::UnboundedSender;

    use super::*;
    use crate::config::{Flags, ProxyMode};
    use crate::daemon::host::RecordingHost;
    use crate::daemon::leftovers::RecordingLeftovers;
    use crate::manifest::{Objects, load_str};
    use crate::model::store::{Change, Store};
    use crate::proxy::testing::{Call, RecordingProxier};

    const SEC: Duration = Duration::from_secs(1);

    /// Service `d/web` (ClusterIP, internalTrafficPolicy Local) with endpoints 10.1.0.1..=n on
    /// node-b (so none is local to node-a).
    fn cluster(n: u8) -> Store {
        let mut yaml = String::from(
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.1, internalTrafficPolicy: Local, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: d\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv4\nports: [{name: \"\", port: 8080}]\nendpoints:\n",
        );
        for i in 1..=n {
            yaml.push_str(&format!("- {{addresses: [10.1.0.{i}], nodeName: node-b}}\n"));
        }
        if n == 0 {
            yaml.push_str("[]\n");
        }
        let mut objects = Objects::default();
        load_str(
            std::path::Path::new("t.yaml"),
            &yaml.replace("endpoints:\n[]", "endpoints: []"),
            &mut objects,
        )
        .expect("parses");
        Store::from_objects(&objects, "node-a")
    }

    /// The changes from `old` to `new`, split as a watch delivers them: Services, then slices.
    fn services_and_slices(new: &Store, old: &Store) -> (Vec<Change>, Vec<Change>) {
        new.diff(old)
            .into_iter()
            .partition(|c| matches!(c, Change::Service(..)))
    }

    fn config(mode: ProxyMode) -> Arc<ProxyConfig> {
        let flags = Flags {
            hostname_override: Some("node-a".into()),
            proxy_mode: Some(mode.as_str().into()),
            iptables_min_sync_period: Some("1s".into()),
            iptables_sync_period: Some("30s".into()),
            ipvs_min_sync_period: Some("1s".into()),
            ipvs_sync_period: Some("30s".into()),
            ..Flags::default()
        };
        Arc::new(ProxyConfig::resolve(&flags).expect("a valid configuration"))
    }

    struct Harness {
        tx: UnboundedSender<Update>,
        v4: RecordingProxier,
        telemetry: Arc<Telemetry>,
        t0: StdInstant,
        task: tokio::task::JoinHandle<Result<(), SourceStopped>>,
    }

    impl Harness {
        /// A loop in `mode` over one IPv4 fake, which `tune` may set up first.
        fn start(mode: ProxyMode, tune: impl FnOnce(&mut crate::proxy::testing::Record)) -> Harness {
            let v4 = RecordingProxier::new(mode, IpFamily::V4);
            tune(&mut v4.record());
            Harness::start_with(mode, v4, None, None)
        }

        /// A loop in `mode` over `v4` (and `v6`), with the other modes' `leftovers`.
        fn start_with(
            mode: ProxyMode,
            v4: RecordingProxier,
            v6: Option<RecordingProxier>,
            leftovers: Option<RecordingLeftovers>,
        ) -> Harness {
            let cfg = config(mode);
            let telemetry = Arc::new(Telemetry::detached(mode, "node-a", cfg.sync_period * 2));
            let mut proxiers: Vec<Box<dyn Proxier>> = vec![Box::new(v4.clone())];
            proxiers.extend(v6.map(|p| Box::new(p) as Box<dyn Proxier>));
            let sync_loop = SyncLoop::new(
                cfg,
                proxiers,
                Box::new(RecordingHost::default()),
                telemetry.clone(),
                true,
            )
            .with_leftovers(leftovers.map(|l| Box::new(l) as Box<dyn Leftovers>));
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let task = tokio::spawn(async move { sync_loop.run(&mut rx).await });
            Harness {
                tx,
                v4,
                telemetry,
                t0: now(),
                task,
            }
        }

        fn send(&self, changes: Vec<Change>, synced: bool) {
            self.tx.send(Update { changes, synced }).expect("the loop runs");
        }

        /// Lets the loop run for `d` of (paused, auto-advancing) time.
        async fn run_for(&self, d: Duration) {
            tokio::time::sleep(d).await;
        }

        /// The syncs so far, with their times relative to the start.
        fn syncs(&self) -> Vec<(Duration, Call)> {
            self.v4
                .record()
                .syncs_at()
                .into_iter()
                .map(|(t, c)| (t.duration_since(self.t0), c))
                .collect()
        }

        /// Starts the loop with `cluster(1)` listed and waits for the first sync.
        async fn listed(mode: ProxyMode, tune: impl FnOnce(&mut crate::proxy::testing::Record)) -> Harness {
            let h = Harness::start(mode, tune);
            h.send(cluster(1).diff(&Store::default()), true);
            h.run_for(SEC / 10).await;
            h
        }
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_synced_before_services_and_slices_are_both_listed() {
        let h = Harness::start(ProxyMode::Iptables, |_| {});
        let (services, slices) = services_and_slices(&cluster(2), &Store::default());
        h.send(services, false);
        h.run_for(120 * SEC).await;
        assert!(h.syncs().is_empty(), "{:?}", h.syncs());
        assert!(!h.v4.record().calls.contains(&Call::Intact), "no check either");
        h.send(slices, true);
        h.run_for(SEC / 10).await;
        assert_eq!(h.syncs(), vec![(120 * SEC, Call::SyncFull(1))]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_changes_is_one_sync_no_sooner_than_min_sync_period() {
        let h = Harness::listed(ProxyMode::Iptables, |_| {}).await;
        let mut previous = cluster(1);
        for n in 2..=6 {
            let next = cluster(n);
            h.send(next.diff(&previous), true);
            previous = next;
        }
        h.run_for(5 * SEC).await;
        assert_eq!(
            h.syncs(),
            vec![(Duration::ZERO, Call::SyncFull(1)), (SEC, Call::SyncChanges(1))],
            "five changes, one sync, min-sync-period after the first"
        );
        let programmed = h.v4.record().programmed.clone().expect("synced");
        assert_eq!(programmed.service_ports[0].endpoints.len(), 6, "the last of the burst");
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_after_min_sync_period_goes_at_once() {
        let h = Harness::listed(ProxyMode::Iptables, |_| {}).await;
        h.run_for(10 * SEC).await;
        let sent = now().duration_since(h.t0);
        h.send(cluster(3).diff(&cluster(1)), true);
        h.run_for(SEC / 10).await;
        assert_eq!(
            h.syncs()[1..],
            [(sent, Call::SyncChanges(1))],
            "no wait when none is due"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxier_in_step_is_told_what_changed_and_one_after_a_failure_is_not() {
        let h = Harness::listed(ProxyMode::Nftables, |_| {}).await;
        h.send(cluster(2).diff(&cluster(1)), true);
        h.run_for(2 * SEC).await;
        assert_eq!(h.v4.record().told, vec![Ok(1)], "one service port changed");
        h.v4.record().fail_next = 1;
        h.send(cluster(3).diff(&cluster(2)), true);
        h.run_for(2 * SEC).await;
        assert_eq!(h.v4.record().told, vec![Ok(1), Ok(1)], "told, and it failed");
        // The retry (a full sync) and the change after it.
        h.run_for(40 * SEC).await;
        h.send(cluster(0).diff(&cluster(3)), true);
        h.run_for(2 * SEC).await;
        assert_eq!(h.v4.record().told, vec![Ok(1), Ok(1), Ok(1)]);
        let syncs: Vec<Call> = h.syncs().into_iter().map(|(_, c)| c).collect();
        assert_eq!(
            syncs,
            vec![
                Call::SyncFull(1),
                Call::SyncChanges(1),
                Call::SyncChanges(1),
                Call::SyncFull(1),
                Call::SyncChanges(1)
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_sync_keeps_the_rules_and_is_retried_in_full_after_the_sync_period() {
        let h = Harness::listed(ProxyMode::Iptables, |r| r.fail_next = 1).await;
        let cfg = config(ProxyMode::Iptables);
        let last = |h: &Harness| h.telemetry.debug.services(&cfg, None).families[0].last_sync.clone();
        let failed = last(&h).expect("a sync was tried");
        assert_eq!((failed.result.as_str(), failed.full), ("error", true), "{failed:?}");
        assert!(failed.error.is_some() && failed.last_success.is_none(), "{failed:?}");
        // A change meanwhile does not bring the retry forward.
        h.send(cluster(2).diff(&cluster(1)), true);
        h.run_for(40 * SEC).await;
        let ok = last(&h).expect("synced");
        assert_eq!(
            (ok.result.as_str(), ok.full),
            ("ok", true),
            "the /debug view follows the syncs"
        );
        assert_eq!(
            h.syncs(),
            vec![(Duration::ZERO, Call::SyncFull(1)), (30 * SEC, Call::SyncFull(1))]
        );
        let text = h.telemetry.metrics.encode();
        assert!(
            text.contains("kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 1"),
            "{text}"
        );
        assert!(
            !text.contains("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{"),
            "the failed sync was a full one: {text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nftables_failures_are_counted_in_nftables_terms() {
        let h = Harness::listed(ProxyMode::Nftables, |r| r.fail_next = 1).await;
        let text = h.telemetry.metrics.encode();
        assert!(
            text.contains("kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1"),
            "{text}"
        );
        assert!(!text.contains("iptables_restore_failures_total"), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn rules_found_flushed_at_a_check_get_a_full_sync() {
        let h = Harness::listed(ProxyMode::Iptables, |_| {}).await;
        h.run_for(10 * SEC).await;
        h.v4.record().intact = false;
        h.run_for(25 * SEC).await;
        assert_eq!(
            h.syncs(),
            vec![(Duration::ZERO, Call::SyncFull(1)), (30 * SEC, Call::SyncFull(1))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_periodic_full_sync_comes_without_changes() {
        let h = Harness::listed(ProxyMode::Iptables, |r| r.full_sync_period = Some(3600 * SEC)).await;
        h.run_for(3700 * SEC).await;
        assert_eq!(
            h.syncs(),
            vec![(Duration::ZERO, Call::SyncFull(1)), (3600 * SEC, Call::SyncFull(1))]
        );
        let checks = h.v4.record().calls.iter().filter(|c| **c == Call::Intact).count();
        assert_eq!(checks, 3700 / 30, "a check every sync period");
    }

    #[tokio::test(start_paused = true)]
    async fn modes_that_sync_every_period_do_so_without_changes() {
        let h = Harness::listed(ProxyMode::Ipvs, |r| r.syncs_every_period = true).await;
        h.run_for(65 * SEC).await;
        let times: Vec<Duration> = h.syncs().into_iter().map(|(t, _)| t).collect();
        assert_eq!(times, vec![Duration::ZERO, 30 * SEC, 60 * SEC]);
    }

    #[tokio::test(start_paused = true)]
    async fn rules_stay_as_they_are_while_the_api_is_away() {
        let h = Harness::listed(ProxyMode::Iptables, |_| {}).await;
        let before = h.v4.record().programmed.clone().expect("synced");
        // Ten minutes without a word from the API server: checks only.
        h.run_for(600 * SEC).await;
        assert_eq!(h.syncs().len(), 1, "{:?}", h.syncs());
        assert!(h.v4.record().calls.iter().all(|c| *c != Call::Cleanup));
        // It comes back and relists the same objects (new allocations): still nothing to do.
        let relisted: Vec<Change> = cluster(1)
            .services
            .into_iter()
            .map(|(k, v)| Change::Service(k, Some(v)))
            .collect();
        h.send(relisted, true);
        h.run_for(5 * SEC).await;
        assert_eq!(h.syncs().len(), 1, "{:?}", h.syncs());
        let after = h.v4.record().programmed.clone().expect("synced");
        assert_eq!(before.service_ports, after.service_ports);
        // A real change goes through.
        h.send(cluster(2).diff(&cluster(1)), true);
        h.run_for(SEC).await;
        assert_eq!(h.syncs().last().map(|(_, c)| c.clone()), Some(Call::SyncChanges(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_source_ends_the_loop() {
        let h = Harness::listed(ProxyMode::Iptables, |_| {}).await;
        drop(h.tx);
        let ended = tokio::time::timeout(SEC, h.task).await.expect("the loop ends");
        assert!(ended.expect("no panic").is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn syncs_feed_the_common_metrics() {
        let h = Harness::listed(ProxyMode::Iptables, |_| {}).await;
        h.send(cluster(2).diff(&cluster(1)), true);
        h.run_for(2 * SEC).await;
        let text = h.telemetry.metrics.encode();
        for line in [
            // The Service is internalTrafficPolicy Local with no endpoint on this node.
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 2",
            "kubeproxy_sync_proxy_rules_service_changes_total 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }

    /// Leftovers of another mode whose `remove` records whether `v4` was programmed then.
    fn leftovers_watching(v4: &RecordingProxier, answers: Vec<Vec<String>>) -> RecordingLeftovers {
        let v4 = v4.clone();
        RecordingLeftovers::new(answers, move || {
            if v4.record().programmed.is_some() {
                "programmed".into()
            } else {
                "not programmed".into()
            }
        })
    }

    /// The times of the leftovers' calls, relative to the start, and what they saw.
    fn removals(h: &Harness, l: &RecordingLeftovers) -> Vec<(Duration, String)> {
        l.record()
            .calls
            .iter()
            .map(|(t, seen)| (t.duration_since(h.t0), seen.clone()))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_of_another_mode_is_removed_before_this_mode_is_programmed() {
        let v4 = RecordingProxier::new(ProxyMode::Nftables, IpFamily::V4);
        let l = leftovers_watching(&v4, Vec::new());
        let h = Harness::start_with(ProxyMode::Nftables, v4, None, Some(l.clone()));
        // No lists yet: no sync, and the old mode's rules keep serving.
        h.run_for(120 * SEC).await;
        assert!(l.record().calls.is_empty(), "{:?}", removals(&h, &l));
        h.send(cluster(1).diff(&Store::default()), true);
        h.run_for(SEC / 10).await;
        assert_eq!(h.syncs(), vec![(120 * SEC, Call::SyncFull(1))]);
        assert_eq!(
            removals(&h, &l),
            vec![(120 * SEC, "programmed".to_string())],
            "removed right after the first sync, once"
        );
        h.run_for(100 * SEC).await;
        assert_eq!(l.record().calls.len(), 1, "nothing was left: never asked again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_first_sync_removes_nothing() {
        let v4 = RecordingProxier::new(ProxyMode::Iptables, IpFamily::V4);
        v4.record().fail_next = 1;
        let l = leftovers_watching(&v4, Vec::new());
        let h = Harness::start_with(ProxyMode::Iptables, v4, None, Some(l.clone()));
        h.send(cluster(1).diff(&Store::default()), true);
        h.run_for(20 * SEC).await;
        assert_eq!(h.syncs(), vec![(Duration::ZERO, Call::SyncFull(1))]);
        assert!(l.record().calls.is_empty(), "the sync failed: {:?}", removals(&h, &l));
        h.run_for(20 * SEC).await;
        assert_eq!(
            removals(&h, &l),
            vec![(30 * SEC, "programmed".to_string())],
            "after the retry succeeded"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn every_family_must_be_programmed_first() {
        let v4 = RecordingProxier::new(ProxyMode::Iptables, IpFamily::V4);
        let v6 = RecordingProxier::new(ProxyMode::Iptables, IpFamily::V6);
        v6.record().fail_next = 1;
        let l = leftovers_watching(&v4, Vec::new());
        let h = Harness::start_with(ProxyMode::Iptables, v4, Some(v6.clone()), Some(l.clone()));
        h.send(cluster(1).diff(&Store::default()), true);
        h.run_for(20 * SEC).await;
        assert!(h.v4.record().programmed.is_some(), "IPv4 is programmed");
        assert!(l.record().calls.is_empty(), "IPv6 failed: {:?}", removals(&h, &l));
        h.run_for(20 * SEC).await;
        assert!(v6.record().programmed.is_some());
        assert_eq!(removals(&h, &l), vec![(30 * SEC, "programmed".to_string())]);
    }

    #[tokio::test(start_paused = true)]
    async fn leftovers_still_in_use_are_asked_again_every_sync_period_until_gone() {
        let v4 = RecordingProxier::new(ProxyMode::Nftables, IpFamily::V4);
        let draining = vec!["IPVS virtual server TCP 10.96.0.1:80 (1 open connection)".to_string()];
        let l = leftovers_watching(&v4, vec![draining.clone(), draining]);
        let h = Harness::start_with(ProxyMode::Nftables, v4, None, Some(l.clone()));
        h.send(cluster(1).diff(&Store::default()), true);
        h.run_for(150 * SEC).await;
        let times: Vec<Duration> = removals(&h, &l).into_iter().map(|(t, _)| t).collect();
        assert_eq!(
            times,
            vec![Duration::ZERO, 30 * SEC, 60 * SEC],
            "at the first sync, then at each check until nothing is left"
        );
    }
}
