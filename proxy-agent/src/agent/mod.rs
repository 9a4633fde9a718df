//! The agent's loop: read the source (manifests or the API server), build
//! the model and plan, sync the datapath; serve health and metrics; log and
//! count what was wrong, retry what failed.

mod lifecycle;
mod pace;
mod stats;

use std::{
    collections::BTreeSet,
    sync::{Arc, atomic::Ordering::Relaxed},
    time::{Duration, Instant, SystemTime},
};

use tokio::signal::unix::{SignalKind, signal};

use self::{
    lifecycle::{Event, Phase},
    pace::{Pace, changed, coalesce},
    stats::ServiceStats,
};
use crate::{
    backend::{Datapath, Extent, Scale},
    health::{ProxyHealth, ServiceChecks},
    link_events::{LinkEvents, Rescan},
    metrics::Metrics,
    node::{AddressSource, NodeInfo},
    plan::{Frontend, Node, Planner},
    source::{Store, StoreUpdate, manifests::Reload},
};

pub use crate::source::Source;

/// How often the manifests are checked (new bytes are taken on the second
/// read that finds them), and the datapath looked after.
pub(crate) const POLL: Duration = Duration::from_millis(200);
/// Failed syncs are retried after this, doubling up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(10);
/// Failed attachments and removals of the other mode's datapath are
/// retried every this many polls.
const RETRY_EVERY: u32 = 25;
/// While the source is still being read, what it holds so far is synced at
/// most this often (only where the datapath is private until it serves):
/// each sync writes what came since the last, in batches, and the sync of
/// the whole source writes only what came in the last period.
const PARTIAL_SYNC_PERIOD: Duration = Duration::from_millis(100);
/// What the agent logs once its datapath serves the source.
const SERVING: &str = "datapath ready; serving";

/// What the loop starts from (`commands::run` builds it).
pub struct Start {
    pub source: Source,
    pub datapath: Box<dyn Datapath>,
    pub node: Node,
    /// Where the node addresses came from: when new ones restart the agent.
    pub addresses: AddressSource,
    pub metrics: Arc<Metrics>,
    pub health: Arc<ProxyHealth>,
    pub service_checks: ServiceChecks,
    pub settings: LoopSettings,
}

/// The loop's periods.
#[derive(Clone, Copy, Debug)]
pub struct LoopSettings {
    /// `--min-sync-period`, else the mode's default.
    pub min_sync_period: Option<Duration>,
    pub sync_period: Duration,
    pub interface_rescan_period: Duration,
    /// `--unreadable-source-grace`: how long a takeover from a previous
    /// datapath waits for files that do not parse.
    pub unreadable_source_grace: Duration,
}

/// Runs the loop until SIGTERM or SIGINT (or a reason to restart).
pub async fn run(start: Start) -> anyhow::Result<()> {
    Agent::new(start).run_loop().await
}

struct Agent {
    source: Source,
    store: Store,
    /// The plan of the store's model, kept up to date service by service.
    planner: Planner,
    /// Whether the planner has planned the whole model once.
    planned: bool,
    datapath: Box<dyn Datapath>,
    node: Node,
    addresses: AddressSource,
    /// Why the agent must restart, once it must.
    restart: Option<String>,
    phase: Phase,
    /// Since when the source has files that do not parse or still change.
    partial_since: Option<Instant>,
    unreadable_source_grace: Duration,
    pacing: Pacing,
    services: Services,
    report: Reporting,
    /// When the interfaces are scanned again (eBPF).
    rescan: Rescan,
}

/// When the plan is synced into the datapath.
struct Pacing {
    /// The frontends whose plan changed since the last successful sync;
    /// `None`: any may have (the next sync compares them all).
    dirty: Option<BTreeSet<Frontend>>,
    /// When to sync; `None`: the datapath holds the plan.
    due: Option<Instant>,
    retry_after: Duration,
    /// Syncs are at least this far apart; and the datapath is resynced
    /// (iptables) at least this often.
    min_sync_period: Duration,
    sync_period: Duration,
    last_sync: Option<Instant>,
    /// How long the last successful sync took.
    last_took: Duration,
    polls: u32,
}

/// Per-service figures and the health-check node ports they open.
struct Services {
    stats: ServiceStats,
    checks: ServiceChecks,
    /// Health-check node ports that could not be opened are retried.
    checks_failed: bool,
}

/// What the agent tells: metrics, health, the problems of the objects, and
/// the trigger times behind the network programming latency.
struct Reporting {
    metrics: Arc<Metrics>,
    health: Arc<ProxyHealth>,
    /// The problems reported for the current objects (each is logged and
    /// counted once, not again at every change).
    reported: BTreeSet<String>,
    /// The source's errors at the last reload (one that lasts, such as a
    /// missing manifests path, is logged and counted once).
    source_errors: BTreeSet<String>,
    started: SystemTime,
    /// When the changes not yet synced were triggered (EndpointSlice
    /// annotations).
    triggers: Vec<SystemTime>,
}

impl Agent {
    fn new(start: Start) -> Self {
        let Start {
            source,
            datapath,
            node,
            addresses,
            metrics,
            health,
            service_checks,
            settings:
                LoopSettings {
                    min_sync_period,
                    sync_period,
                    interface_rescan_period,
                    unreadable_source_grace,
                },
        } = start;
        Agent {
            source,
            store: Store::default(),
            planner: Planner::new(node.clone()),
            planned: false,
            pacing: Pacing {
                dirty: None,
                due: None,
                retry_after: FIRST_RETRY,
                min_sync_period: min_sync_period.unwrap_or(datapath.min_sync_period()),
                sync_period,
                last_sync: None,
                last_took: Duration::ZERO,
                polls: 0,
            },
            datapath,
            node,
            addresses,
            restart: None,
            phase: Phase::Reading,
            partial_since: None,
            unreadable_source_grace,
            services: Services {
                stats: ServiceStats::default(),
                checks: service_checks,
                checks_failed: false,
            },
            report: Reporting {
                metrics,
                health,
                reported: BTreeSet::new(),
                source_errors: BTreeSet::new(),
                started: SystemTime::now(),
                triggers: Vec::new(),
            },
            rescan: Rescan::new(interface_rescan_period, Instant::now()),
        }
    }

    /// Until SIGTERM or SIGINT: a round at every poll, at every API server
    /// change (after a short coalescing wait), when a sync falls due, and
    /// soon after an interface or address changed.
    async fn run_loop(&mut self) -> anyhow::Result<()> {
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let notify = match &self.source {
            Source::Kube(kube) => Some(kube.notify()),
            Source::Manifests(_) => None,
        };
        let mut links = self.link_events();
        let mut waiting_since = None;
        let mut pace = Pace::default();
        // Every poll until an attempt to take over fails, then less often.
        let mut retry_every = 1;
        // As kube-proxy at the start of its sync loop: nothing is late yet.
        self.report.health.updated(SystemTime::now());
        loop {
            if let Some(why) = self.restart.take() {
                anyhow::bail!("{why}: restarting to use them (as kube-proxy does)");
            }
            let due = self.pacing.due.filter(|_| self.may_sync());
            let scan_at = self.rescan.wake_at();
            let mut lost = None;
            let polled = tokio::select! {
                _ = poll.tick() => true,
                _ = changed(notify.as_deref()) => {
                    if pace.coalesce(Instant::now()) {
                        coalesce(notify.as_deref()).await;
                    }
                    false
                }
                _ = until(due) => false,
                _ = until(scan_at) => false,
                event = link_change(links.as_ref()) => {
                    match event {
                        // Before serving, activation lists the interfaces.
                        Ok(()) if self.phase.serving() => self.rescan.changed(Instant::now()),
                        Ok(()) => {}
                        Err(e) => lost = Some(e),
                    }
                    false
                }
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
            };
            if let Some(e) = lost {
                self.notifications_lost("failed", &e);
                links = None;
            }
            self.tick(polled);
            if polled
                && !self.phase.serving()
                && self.pacing.polls.is_multiple_of(retry_every)
                && let Err(e) = self.serve_when_ready(&mut waiting_since)
            {
                self.report.metrics.activation_failures.fetch_add(1, Relaxed);
                tracing::error!("could not take over the datapath (will retry): {e:#}");
                retry_every = RETRY_EVERY;
            }
        }
        tracing::info!("stopping; the datapath stays in place until `proxy-agent cleanup`");
        Ok(())
    }

    /// The notifications of interface and address changes, if the datapath
    /// follows interfaces.
    fn link_events(&mut self) -> Option<LinkEvents> {
        if !self.datapath.follows_interfaces() {
            return None;
        }
        LinkEvents::open().inspect_err(|e| self.notifications_lost("unavailable", e)).ok()
    }

    /// Without notifications the interfaces are scanned at every poll, as
    /// before they existed (logged once: the socket is not retried).
    fn notifications_lost(&mut self, how: &str, e: &std::io::Error) {
        tracing::warn!(
            error = %e,
            "interface notifications {how}: scanning the interfaces every {POLL:?} instead"
        );
        self.rescan.every_poll();
    }

    /// Rules are live as soon as they are applied: they wait for the source
    /// to be taken (`source_taken`), so a file that does not parse replaces
    /// a previous agent's rules with fewer only after the grace (a new
    /// agent's maps are private until its programs attach).
    fn may_sync(&self) -> bool {
        self.phase.source_whole() || !self.datapath.live_at_once()
    }

    /// One round: reload; on a change, compute the desired state; sync it
    /// when due; at polls, look after the datapath. Never fails: errors are
    /// logged, counted and retried.
    fn tick(&mut self, polled: bool) {
        if let Some(reload) = self.source.reload(polled) {
            self.take_reload(&reload);
        }
        if self.may_sync() && self.pacing.due.is_some_and(|due| Instant::now() >= due) {
            self.sync();
        }
        if polled {
            if let Source::Kube(kube) = &self.source {
                self.report.metrics.set_apiserver_errors(kube.errors());
            }
            self.pacing.polls = self.pacing.polls.wrapping_add(1);
            if self.phase.serving() {
                self.look_after_datapath();
            }
        }
        if self.phase.serving() && self.rescan.due(Instant::now(), polled) {
            self.datapath.scan_interfaces(&self.node.ips, self.planner.plan());
            self.rescan.scanned(Instant::now());
            self.await_addresses();
        }
    }

    /// What a reload found: errors reported, changes taken, a sync scheduled
    /// when they change the desired state or complete the source.
    fn take_reload(&mut self, reload: &Reload) {
        self.report_source_errors(reload);
        let changes = reload.changed.then(|| self.take_changes());
        let mut needs_sync = changes.unwrap_or(false);
        if !self.phase.source_whole() && self.source_taken(reload) {
            self.advance(Event::SourceWhole);
            needs_sync = true;
        }
        if needs_sync {
            self.schedule_sync();
        }
    }

    /// Without a node address at start, the first one an interface gets
    /// restarts the agent, which then serves NodePorts on it.
    fn await_addresses(&mut self) {
        let AddressSource::AwaitingInterfaces { pod_interfaces } = &self.addresses else { return };
        match crate::node::interface_ips(pod_interfaces) {
            Ok(ips) if !ips.is_empty() => {
                self.restart = Some(format!("this node has an address now: {ips:?}"));
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "could not list the interfaces' addresses"),
        }
    }

    /// Logs and counts the source's errors, each once: a file's errors come
    /// once per change of it, a lasting one (a missing path) is not
    /// repeated at every poll.
    fn report_source_errors(&mut self, reload: &Reload) {
        let mut current = BTreeSet::new();
        let mut warned = Warned::default();
        for err in &reload.errors {
            let message = err.to_string();
            if !self.report.source_errors.contains(&message) {
                warned.log(err.kind(), &message);
                self.report.metrics.invalid(err.kind());
                self.report.metrics.source_error(err.path(), err.kind());
            }
            current.insert(message);
        }
        warned.summary("more errors in the source: each at debug level (RUST_LOG=debug), counted in proxy_invalid_objects_total and proxy_source_errors_total");
        self.report.source_errors = current;
    }

    /// Whether the source can be taken as it stands: read whole; or with
    /// manifest files that do not parse (or never stop changing), see
    /// `lifecycle::take_partial`. An API server's lists are always waited
    /// for: a partial list would delete services. Taking the source
    /// without some files is said loudly.
    fn source_taken(&mut self, reload: &Reload) -> bool {
        if reload.complete {
            return true;
        }
        if reload.unreadable.is_empty() && reload.moving.is_empty() {
            return false;
        }
        let since = *self.partial_since.get_or_insert_with(Instant::now);
        let (previous, settled) = (self.datapath.replaces_previous(), reload.moving.is_empty());
        let grace = self.unreadable_source_grace;
        if !lifecycle::take_partial(previous, settled, since.elapsed(), grace) {
            return false;
        }
        let names = |paths: &[std::path::PathBuf]| -> Vec<String> {
            paths.iter().map(|p| p.display().to_string()).collect()
        };
        tracing::warn!(
            files = ?names(&reload.unreadable),
            still_changing = ?names(&reload.moving),
            waited = ?since.elapsed(),
            "taking over without the services of these files, which do not parse (or never stop changing): they are not served until they do"
        );
        true
    }

    /// The source changed: the store, model and plan follow (only the
    /// services touched are replanned). Returns whether a sync is needed.
    fn take_changes(&mut self) -> bool {
        let mut replan_all = !self.planned;
        // While the lists arrive, the Node may not be listed yet: its zone
        // and addresses are taken once it is.
        if let Source::Kube(kube) = &self.source
            && kube.node_listed()
        {
            let info = NodeInfo::of(kube.node().as_ref());
            self.report.health.set_node(info.eligibility);
            if self.addresses == AddressSource::NodeObject
                && !info.internal_ips.is_empty()
                && info.internal_ips != self.node.ips
            {
                self.restart = Some(format!(
                    "this node's addresses changed from {:?} to {:?}",
                    self.node.ips, info.internal_ips
                ));
            }
            if info.zone != self.node.zone {
                tracing::info!(zone = ?info.zone, "this node's zone changed");
                self.node.zone = info.zone.clone();
                self.planner.set_zone(info.zone.clone());
                self.datapath.set_zone(info.zone);
                replan_all = true;
            }
        }
        let update = self.source.update(&mut self.store);
        self.count_changes(&update);
        let model = self.store.model();
        // Deleted services are among the touched ones, not the model's.
        self.services.stats.update(model, update.touched.iter(), &self.node.name);
        let replanned = if replan_all {
            self.planned = true;
            self.services.stats.update(model, model.service_names(), &self.node.name);
            self.planner.rebuild(model)
        } else {
            self.planner.update(model, &update.touched)
        };
        if let Some(dirty) = &mut self.pacing.dirty {
            dirty.extend(replanned);
        }
        self.report_problems(&update);
        // Before the source is whole, a sync only if something changed:
        // a page of the lists may bring nothing to plan yet.
        let unsynced_whole = self.phase.source_whole() && !self.phase.synced_whole();
        !update.touched.is_empty() || replan_all || unsynced_whole
    }

    /// A sync is due as soon as the minimum sync period allows.
    fn schedule_sync(&mut self) {
        let now = Instant::now();
        let period = match self.phase.source_whole() {
            true => self.pacing.min_sync_period,
            false => PARTIAL_SYNC_PERIOD,
        };
        let earliest = self.pacing.last_sync.map_or(now, |t| t + period);
        self.pacing.due = Some(earliest.max(now));
        self.pacing.retry_after = FIRST_RETRY;
        // As kube-proxy, nothing is queued before the source is whole (a
        // slow first list must not fail /livez, also where what it brought
        // so far is synced).
        if self.phase.source_whole() {
            let wall = SystemTime::now();
            self.report.health.queued(wall);
            self.report.metrics.queued_at(wall);
        }
    }

    /// The change counters and the trigger times of the changes.
    fn count_changes(&mut self, update: &StoreUpdate) {
        for (total, pending, n) in [
            (
                &self.report.metrics.service_changes,
                &self.report.metrics.service_changes_pending,
                update.service_changes,
            ),
            (
                &self.report.metrics.endpoint_changes,
                &self.report.metrics.endpoint_changes_pending,
                update.endpoint_changes,
            ),
        ] {
            total.fetch_add(n as u64, Relaxed);
            pending.fetch_add(n as u64, Relaxed);
        }
        // Only changes made while this agent watched measure its latency.
        let started = self.report.started;
        self.report.triggers.extend(update.trigger_times.iter().filter(|t| **t > started));
    }

    /// Logs and counts each problem with the objects once, for as long as
    /// it lasts: the first few of an update as warnings, the rest at debug
    /// level behind one summary line (36,000 invalid Services must not
    /// flood the log).
    fn report_problems(&mut self, update: &StoreUpdate) {
        let mut problems = self.store.problems();
        for err in &update.unnamed {
            problems.push((err.kind(), format!("invalid object skipped: {err}")));
        }
        for conflict in self.planner.conflicts() {
            problems.push(("Service", conflict.to_string()));
        }
        let current: BTreeSet<String> = problems.iter().map(|(_, m)| m.clone()).collect();
        let new = problems.iter().filter(|(_, m)| !self.report.reported.contains(m));
        let mut warned = Warned::default();
        for (kind, message) in new {
            warned.log(kind, message);
            match *kind {
                "kept" => drop(self.report.metrics.kept_objects.fetch_add(1, Relaxed)),
                kind => self.report.metrics.invalid(kind),
            }
        }
        warned.summary("more problems with objects: each at debug level (RUST_LOG=debug), counted in proxy_invalid_objects_total and proxy_kept_objects_total");
        self.report.reported = current;
    }

    fn sync(&mut self) {
        let start = Instant::now();
        self.pacing.last_sync = Some(start);
        let extent = match self.phase.source_whole() {
            true => Extent::Whole,
            false => Extent::Partial { scale: self.scale() },
        };
        let (model, plan) = (self.store.model(), self.planner.plan());
        let dirty = self.pacing.dirty.as_ref();
        let result = self.datapath.sync(model, plan, dirty, extent, &self.report.metrics);
        let took = start.elapsed();
        self.report.metrics.sync_duration.observe(took);
        match result {
            Ok(synced) => {
                self.pacing.dirty = Some(BTreeSet::new());
                self.pacing.last_took = took;
                match extent {
                    Extent::Whole => self.synced(synced.backends),
                    // Nothing serves from it: health, metrics and the
                    // health-check ports wait for the whole.
                    Extent::Partial { .. } => self.pacing.due = None,
                }
            }
            Err(err) => {
                // Where it stopped is known to the datapath: the next sync
                // compares every frontend.
                self.pacing.dirty = None;
                self.report.metrics.syncs_failed.fetch_add(1, Relaxed);
                // Pending until a sync succeeds: failing for longer than
                // the health window makes /healthz and /livez fail.
                self.report.health.queued(SystemTime::now());
                tracing::error!(
                    retry_in = ?self.pacing.retry_after,
                    "sync failed, serving the previous state: {err:#}"
                );
                self.pacing.due = Some(Instant::now() + self.pacing.retry_after);
                self.pacing.retry_after = (self.pacing.retry_after * 2).min(MAX_RETRY);
            }
        }
    }

    /// How much more the whole source holds than what was taken of it,
    /// where it can tell (the API server's counts).
    fn scale(&self) -> Option<Scale> {
        let Source::Kube(kube) = &self.source else { return None };
        let (frontends, endpoints) = kube.progress().ratios()?;
        Some(Scale { frontends, endpoints })
    }

    /// After a successful sync: health, metrics, health-check node ports.
    fn synced(&mut self, backends: usize) {
        self.pacing.due = None;
        self.advance(Event::Synced);
        let now = SystemTime::now();
        self.report.health.updated(now);
        let m = &self.report.metrics;
        m.syncs_ok.fetch_add(1, Relaxed);
        m.synced_at(now);
        m.service_changes_pending.store(0, Relaxed);
        m.endpoint_changes_pending.store(0, Relaxed);
        for trigger in self.report.triggers.drain(..) {
            m.network_programming.observe(now.duration_since(trigger).unwrap_or_default());
        }
        m.frontends.store(self.planner.plan().frontends.len() as u64, Relaxed);
        m.backends.store(backends as u64, Relaxed);
        let (internal, external) = self.services.stats.no_local_endpoints();
        m.no_local_endpoints_internal.store(internal, Relaxed);
        m.no_local_endpoints_external.store(external, Relaxed);
        let serves_ipv6 = self.datapath.serves_ipv6();
        m.ipv6_served.store(serves_ipv6, Relaxed);
        let ipv6 = if serves_ipv6 { 0 } else { self.services.stats.ipv6_ports() };
        if m.unserved_ipv6_ports.swap(ipv6, Relaxed) == 0 && ipv6 > 0 {
            tracing::warn!(
                ports = ipv6,
                mode = self.datapath.mode(),
                "IPv6 service ports are not served: the node has no IPv6 address (counted in proxy_unserved_service_ports)"
            );
        }
        self.update_service_checks();
    }

    /// Opens and closes health-check node ports to match the services.
    fn update_service_checks(&mut self) {
        let failed = self.services.checks.set(self.services.stats.service_checks());
        self.services.checks_failed = !failed.is_empty();
        for (port, check, why) in failed {
            self.report.metrics.health_check_failures.fetch_add(1, Relaxed);
            tracing::warn!(service = %check.service, port, "could not open the health-check node port (will retry): {why}");
        }
    }

    /// Between syncs: the datapath's upkeep, the periodic resync (iptables),
    /// and the other mode's leftovers.
    fn look_after_datapath(&mut self) {
        if self.datapath.look_after(self.pacing.polls, &self.report.metrics) {
            self.pacing.dirty = None;
            self.pacing.due.get_or_insert_with(Instant::now);
        }
        let resync_due =
            self.pacing.last_sync.is_none_or(|t| t.elapsed() >= self.pacing.sync_period);
        if self.datapath.live_at_once() && resync_due {
            // As kube-proxy: rules someone changed come back within a period.
            self.pacing.due.get_or_insert_with(Instant::now);
        }
        if self.pacing.polls.is_multiple_of(RETRY_EVERY) {
            if self.phase == (Phase::Serving { leftovers: true }) && self.remove_other_mode() {
                self.advance(Event::OtherModeRemoved);
            }
            if self.services.checks_failed {
                self.update_service_checks();
            }
        }
    }

    /// Removes what the other mode left; whether it is gone.
    fn remove_other_mode(&mut self) -> bool {
        match self.datapath.remove_other_mode() {
            Ok(()) => true,
            Err(e) => {
                self.report.metrics.mode_cleanup_failures.fetch_add(1, Relaxed);
                tracing::warn!("could not remove the other mode's datapath (will retry): {e:#}");
                false
            }
        }
    }

    /// Moves the agent on, if `event` does; each transition is logged once.
    fn advance(&mut self, event: Event) {
        let Some(next) = self.phase.after(event) else { return };
        match (self.phase, next) {
            (_, Phase::SourceWhole) => {
                let services = self.store.model().service_names().count();
                tracing::info!(source = self.source.name(), services, "source read whole");
            }
            (_, Phase::SyncedWhole) => {
                let ms = self.pacing.last_took.as_secs_f64() * 1000.0;
                tracing::info!(ms, "the datapath holds the whole source");
            }
            (Phase::SyncedWhole, Phase::Serving { .. }) => {
                let (mode, source) = (self.datapath.mode(), self.source.name());
                // /healthz answers 200 from now on (while syncs keep up).
                self.report.health.serving();
                tracing::info!(mode, source, "{SERVING}");
            }
            (_, Phase::Serving { .. }) => tracing::info!("the other mode's datapath is gone"),
            (_, Phase::Reading) => {}
        }
        self.phase = next;
    }

    /// Once the datapath holds the whole source, makes it serve (attaches
    /// the programs; until then a previous agent's datapath keeps serving),
    /// then removes what the other mode left.
    fn serve_when_ready(&mut self, waiting_since: &mut Option<Instant>) -> anyhow::Result<()> {
        if !self.phase.synced_whole() {
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                let source = self.source.name();
                if self.phase.source_whole() {
                    // The sync's own error says why (logged as it fails).
                    tracing::warn!(
                        source,
                        "the source is read whole, but its plan is not in the datapath yet: no sync succeeded; waiting for one before taking over the datapath"
                    );
                } else if let Source::Kube(kube) = &self.source {
                    tracing::warn!(
                        source,
                        listing = ?kube.listing(),
                        "waiting for the whole source: the API server's lists are not complete; nothing serves from them before they are"
                    );
                } else {
                    tracing::warn!(
                        source,
                        "waiting for the whole source to be readable before taking over the datapath"
                    );
                }
                *waiting_since = Some(Instant::now());
            }
            return Ok(());
        }
        self.datapath.take_over(&self.node.ips, &self.report.metrics)?;
        // Taking over attached to the interfaces of now.
        self.rescan.scanned(Instant::now());
        let leftovers = !self.remove_other_mode();
        self.advance(Event::TookOver { leftovers });
        Ok(())
    }
}

/// Problems logged in one round: the first few as warnings, the rest at
/// debug level and summed in one warning (a file of 36,000 invalid objects
/// must not write a line each).
#[derive(Default)]
struct Warned {
    count: usize,
}

impl Warned {
    const EXAMPLES: usize = 10;

    fn log(&mut self, kind: &str, message: &str) {
        self.count += 1;
        if self.count <= Self::EXAMPLES {
            tracing::warn!(kind, "{message}");
        } else {
            tracing::debug!(kind, "{message}");
        }
    }

    fn summary(&self, what: &str) {
        if self.count > Self::EXAMPLES {
            tracing::warn!(more = self.count - Self::EXAMPLES, "{what}");
        }
    }
}

async fn link_change(links: Option<&LinkEvents>) -> std::io::Result<()> {
    match links {
        Some(links) => links.changed().await,
        None => std::future::pending().await,
    }
}

async fn until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due.into()).await,
        None => std::future::pending().await,
    }
}
