//! The agent's loop: read the source (manifests or the API server), build
//! the model and plan, sync the datapath; serve health and metrics; log and
//! count what was wrong, retry what failed.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::{Arc, atomic::Ordering::Relaxed},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    backend::iptables::{self, exec::System, render},
    cli::{PinArgs, PrepareArgs, ProxyMode, RenderIptablesArgs, RunArgs},
    datapath::{self, Datapath},
    health::{self, NodeEligibility, ProxyHealth, ServiceCheck, ServiceChecks},
    link_events::{LinkEvents, Rescan},
    metrics::Metrics,
    model::{Model, ServiceName, ServicePort},
    node::{self, NodeInfo},
    plan::{Frontend, Node, Planner},
    source::{
        Store, StoreUpdate,
        kube::KubeSource,
        manifests::{Manifests, Reload},
    },
    sys,
};

/// How often the manifests are checked (new bytes are taken on the second
/// read that finds them), and the datapath looked after.
const POLL: Duration = Duration::from_millis(200);
/// API server changes are taken as they come (with whatever else arrived
/// meanwhile), up to this many in `BURST_WINDOW`...
const BURST_TAKES: usize = 20;
const BURST_WINDOW: Duration = Duration::from_millis(100);
/// ...beyond that, in a burst, the events that follow within this much of
/// each other are taken together...
const QUIET: Duration = Duration::from_millis(3);
/// ...up to this long after the first.
const MAX_COALESCE: Duration = Duration::from_millis(250);
/// Failed syncs are retried after this, doubling up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(10);
/// Failed attachments and removals of the other mode's datapath are
/// retried every this many polls.
const RETRY_EVERY: u32 = 25;
/// How long to wait for this node's Node object for its addresses.
const NODE_WAIT: Duration = Duration::from_secs(30);
/// What the agent logs once its datapath serves the source.
const SERVING: &str = "datapath ready; serving";

/// Where Services and EndpointSlices come from.
enum Source {
    Manifests(Manifests),
    Kube(KubeSource),
}

impl Source {
    fn reload(&mut self) -> Reload {
        match self {
            Source::Manifests(manifests) => manifests.reload(),
            Source::Kube(kube) => {
                let (changed, complete) = kube.poll();
                Reload { changed, complete, errors: Vec::new() }
            }
        }
    }

    /// Brings `store` up to date with the source.
    fn update(&self, store: &mut Store) -> StoreUpdate {
        match self {
            Source::Manifests(manifests) => store.replace(manifests.snapshot()),
            Source::Kube(kube) => store.apply(kube.take_changes()),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Source::Manifests(_) => "manifests",
            Source::Kube(_) => "API server",
        }
    }
}

struct Agent {
    source: Source,
    store: Store,
    datapath: Datapath,
    metrics: Arc<Metrics>,
    health: Arc<ProxyHealth>,
    service_checks: ServiceChecks,
    node: Node,
    /// `--bpffs-root`: the eBPF mode's pins (removed in iptables mode).
    pins: PathBuf,
    /// The plan of the store's model, kept up to date service by service.
    planner: Planner,
    /// Whether the planner has planned the whole model once.
    planned: bool,
    /// The frontends whose plan changed since the last successful sync;
    /// `None`: any may have (the next sync compares them all).
    dirty: Option<BTreeSet<Frontend>>,
    stats: ServiceStats,
    /// When to sync the plan into the datapath; `None`: it holds it.
    due: Option<Instant>,
    retry_after: Duration,
    /// Syncs are at least this far apart; and the datapath is resynced
    /// (iptables) at least this often.
    min_sync_period: Duration,
    sync_period: Duration,
    last_sync: Option<Instant>,
    /// The source has been read whole once.
    complete: bool,
    /// A sync of the whole source succeeded: the datapath may take over.
    synced_whole: bool,
    /// Health-check node ports that could not be opened are retried.
    checks_failed: bool,
    /// The problems reported for the current objects (each is logged and
    /// counted once, not again at every change).
    reported: std::collections::BTreeSet<String>,
    /// The node addresses came from the Node object: if they change, the
    /// agent must restart (as kube-proxy does).
    ips_from_node: bool,
    restart: Option<String>,
    /// The datapath serves `desired` (programs attached, rules applied).
    serving: bool,
    /// When the interfaces are scanned again (eBPF).
    rescan: Rescan,
    /// The other mode's datapath may still be there.
    leftovers: bool,
    polls: u32,
    started: SystemTime,
    /// When the changes not yet synced were triggered (EndpointSlice
    /// annotations), for the network programming latency.
    triggers: Vec<SystemTime>,
}

impl Agent {
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
        self.health.updated(SystemTime::now());
        loop {
            if let Some(why) = self.restart.take() {
                anyhow::bail!("{why}: restarting to use them (as kube-proxy does)");
            }
            let due = self.due.filter(|_| self.may_sync());
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
                        Ok(()) if self.serving => self.rescan.changed(Instant::now()),
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
                && !self.serving
                && self.polls.is_multiple_of(retry_every)
                && let Err(e) = self.serve_when_ready(&mut waiting_since)
            {
                self.metrics.activation_failures.fetch_add(1, Relaxed);
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

    /// Rules are live as soon as they are applied: they wait for the whole
    /// source, so an unreadable file never replaces good rules with fewer
    /// (a new agent's maps are private until its programs attach).
    fn may_sync(&self) -> bool {
        self.complete || !self.datapath.live_at_once()
    }

    /// One round: reload; on a change, compute the desired state; sync it
    /// when due; at polls, look after the datapath. Never fails: errors are
    /// logged, counted and retried.
    fn tick(&mut self, polled: bool) {
        let reload = self.source.reload();
        for err in &reload.errors {
            tracing::warn!(kind = err.kind(), "{err}");
            self.metrics.invalid(err.kind());
        }
        let whole_now = reload.complete && !self.complete;
        self.complete |= reload.complete;
        if reload.changed {
            self.changed();
        }
        if whole_now {
            let services = self.store.model().service_names().count();
            tracing::info!(source = self.source.name(), services, "source read whole");
        }
        if self.may_sync() && self.due.is_some_and(|due| Instant::now() >= due) {
            self.sync();
        }
        if polled {
            if let Source::Kube(kube) = &self.source {
                self.metrics.set_apiserver_errors(kube.errors());
            }
            self.polls = self.polls.wrapping_add(1);
            if self.serving {
                self.look_after_datapath();
            }
        }
        if self.serving && self.rescan.due(Instant::now(), polled) {
            self.datapath.scan_interfaces(&self.node.ips);
            self.rescan.scanned(Instant::now());
        }
    }

    /// The source changed: the store, model and plan follow (only the
    /// services touched are replanned), and a sync is due as soon as the
    /// minimum sync period allows.
    fn changed(&mut self) {
        let mut replan_all = !self.planned;
        if let Source::Kube(kube) = &self.source {
            let info = NodeInfo::of(kube.node().as_ref());
            self.health.set_node(info.eligibility);
            if self.ips_from_node
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
        self.stats.update(model, update.touched.iter(), &self.node.name);
        let replanned = if replan_all {
            self.planned = true;
            self.stats.update(model, model.service_names(), &self.node.name);
            self.planner.rebuild(model)
        } else {
            self.planner.update(model, &update.touched)
        };
        if let Some(dirty) = &mut self.dirty {
            dirty.extend(replanned);
        }
        self.report_problems(&update);
        if update.touched.is_empty() && !replan_all && self.synced_whole {
            return;
        }
        let now = Instant::now();
        let earliest = self.last_sync.map_or(now, |t| t + self.min_sync_period);
        self.due = Some(earliest.max(now));
        self.retry_after = FIRST_RETRY;
        // As kube-proxy, nothing is queued before the source is whole (a
        // slow first list must not fail /livez).
        if self.may_sync() {
            let wall = SystemTime::now();
            self.health.queued(wall);
            self.metrics.queued_at(wall);
        }
    }

    /// The change counters and the trigger times of the changes.
    fn count_changes(&mut self, update: &StoreUpdate) {
        for (total, pending, n) in [
            (
                &self.metrics.service_changes,
                &self.metrics.service_changes_pending,
                update.service_changes,
            ),
            (
                &self.metrics.endpoint_changes,
                &self.metrics.endpoint_changes_pending,
                update.endpoint_changes,
            ),
        ] {
            total.fetch_add(n as u64, Relaxed);
            pending.fetch_add(n as u64, Relaxed);
        }
        // Only changes made while this agent watched measure its latency.
        let started = self.started;
        self.triggers.extend(update.trigger_times.iter().filter(|t| **t > started));
    }

    /// Logs and counts each problem with the objects once, for as long as
    /// it lasts.
    fn report_problems(&mut self, update: &StoreUpdate) {
        let mut problems = self.store.problems();
        for err in &update.unnamed {
            problems.push((err.kind(), format!("invalid object skipped: {err}")));
        }
        for conflict in self.planner.conflicts() {
            problems.push(("Service", conflict.to_string()));
        }
        let current: BTreeSet<String> = problems.iter().map(|(_, m)| m.clone()).collect();
        for (kind, message) in &problems {
            if self.reported.contains(message) {
                continue;
            }
            tracing::warn!(kind = %kind, "{message}");
            match *kind {
                "kept" => drop(self.metrics.kept_objects.fetch_add(1, Relaxed)),
                kind => self.metrics.invalid(kind),
            }
        }
        self.reported = current;
    }

    fn sync(&mut self) {
        let start = Instant::now();
        self.last_sync = Some(start);
        let (model, plan) = (self.store.model(), self.planner.plan());
        let result = self.datapath.sync(model, plan, self.dirty.as_ref(), &self.metrics);
        let took = start.elapsed();
        self.metrics.sync_duration.observe(took);
        match result {
            Ok(synced) => {
                match synced.full {
                    Some(true) => self.metrics.full_sync_duration.observe(took),
                    Some(false) => self.metrics.partial_sync_duration.observe(took),
                    None => {}
                }
                self.dirty = Some(BTreeSet::new());
                self.synced(synced.backends);
            }
            Err(err) => {
                // Where it stopped is known to the datapath: the next sync
                // compares every frontend.
                self.dirty = None;
                self.metrics.syncs_failed.fetch_add(1, Relaxed);
                tracing::error!(
                    retry_in = ?self.retry_after,
                    "sync failed, serving the previous state: {err:#}"
                );
                self.due = Some(Instant::now() + self.retry_after);
                self.retry_after = (self.retry_after * 2).min(MAX_RETRY);
            }
        }
    }

    /// After a successful sync: health, metrics, health-check node ports.
    fn synced(&mut self, backends: usize) {
        self.due = None;
        self.synced_whole |= self.complete;
        let now = SystemTime::now();
        self.health.updated(now);
        let m = &self.metrics;
        m.syncs_ok.fetch_add(1, Relaxed);
        m.synced_at(now);
        m.service_changes_pending.store(0, Relaxed);
        m.endpoint_changes_pending.store(0, Relaxed);
        for trigger in self.triggers.drain(..) {
            m.network_programming.observe(now.duration_since(trigger).unwrap_or_default());
        }
        m.frontends.store(self.planner.plan().frontends.len() as u64, Relaxed);
        m.backends.store(backends as u64, Relaxed);
        let (internal, external) = self.stats.no_local_endpoints();
        m.no_local_endpoints_internal.store(internal, Relaxed);
        m.no_local_endpoints_external.store(external, Relaxed);
        self.update_service_checks();
    }

    /// Opens and closes health-check node ports to match the services.
    fn update_service_checks(&mut self) {
        let failed = self.service_checks.set(self.stats.service_checks());
        self.checks_failed = !failed.is_empty();
        for (port, check, why) in failed {
            self.metrics.health_check_failures.fetch_add(1, Relaxed);
            tracing::warn!(service = %check.service, port, "could not open the health-check node port (will retry): {why}");
        }
    }

    /// Between syncs: the datapath's upkeep, the periodic resync (iptables),
    /// and the other mode's leftovers.
    fn look_after_datapath(&mut self) {
        if self.datapath.look_after(self.polls, &self.metrics) {
            self.dirty = None;
            self.due.get_or_insert_with(Instant::now);
        }
        let resync_due = self.last_sync.is_none_or(|t| t.elapsed() >= self.sync_period);
        if self.datapath.live_at_once() && resync_due {
            // As kube-proxy: rules someone changed come back within a period.
            self.due.get_or_insert_with(Instant::now);
        }
        if self.polls.is_multiple_of(RETRY_EVERY) {
            if self.leftovers {
                self.remove_other_mode();
            }
            if self.checks_failed {
                self.update_service_checks();
            }
        }
    }

    fn remove_other_mode(&mut self) {
        match self.datapath.remove_other_mode(&self.pins) {
            Ok(()) => self.leftovers = false,
            Err(e) => {
                self.metrics.mode_cleanup_failures.fetch_add(1, Relaxed);
                tracing::warn!("could not remove the other mode's datapath (will retry): {e:#}");
            }
        }
    }

    /// Once the datapath holds the whole source, makes it serve (attaches
    /// the programs; until then a previous agent's datapath keeps serving),
    /// then removes what the other mode left.
    fn serve_when_ready(&mut self, waiting_since: &mut Option<Instant>) -> anyhow::Result<()> {
        if !self.synced_whole {
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                tracing::warn!(
                    source = self.source.name(),
                    "waiting for the whole source to be readable before taking over the datapath"
                );
                *waiting_since = Some(Instant::now());
            }
            return Ok(());
        }
        self.datapath.activate(&self.node.ips, &self.metrics)?;
        // Activation attached to the interfaces of now.
        self.rescan.scanned(Instant::now());
        self.remove_other_mode();
        tracing::info!(mode = self.datapath.mode(), source = self.source.name(), "{SERVING}");
        self.serving = true;
        Ok(())
    }
}

/// What the metrics and health checks need from each service, kept up to
/// date with the services a change touches (only services with something
/// to count are held).
#[derive(Debug, Default)]
struct ServiceStats {
    /// Services with a Local policy and endpoints, but none usable here:
    /// (internal, external).
    no_local: BTreeMap<ServiceName, (u64, u64)>,
    /// Health-check node ports, by service.
    checks: BTreeMap<ServiceName, BTreeMap<u16, ServiceCheck>>,
}

impl ServiceStats {
    fn update<'a>(
        &mut self,
        model: &Model,
        names: impl Iterator<Item = &'a ServiceName>,
        node_name: &str,
    ) {
        for name in names {
            let ports = model.service(name);
            match no_local_endpoints(ports, node_name) {
                (0, 0) => self.no_local.remove(name),
                counts => self.no_local.insert(name.clone(), counts),
            };
            let checks = health::service_checks(ports, node_name);
            match checks.is_empty() {
                true => self.checks.remove(name),
                false => self.checks.insert(name.clone(), checks),
            };
        }
    }

    /// kube-proxy's `no_local_endpoints` gauges (internal, external).
    fn no_local_endpoints(&self) -> (u64, u64) {
        self.no_local.values().fold((0, 0), |(i, e), (di, de)| (i + di, e + de))
    }

    fn service_checks(&self) -> BTreeMap<u16, ServiceCheck> {
        self.checks.values().flat_map(|c| c.iter().map(|(p, c)| (*p, c.clone()))).collect()
    }
}

/// Service ports with a Local policy and endpoints somewhere, but none
/// usable on this node (internal, external).
fn no_local_endpoints(ports: &[ServicePort], node_name: &str) -> (u64, u64) {
    let mut counts = (0, 0);
    for port in ports.iter().filter(|p| p.has_endpoints()) {
        let none_here = port.usable_endpoints(Some(node_name)).is_empty();
        let external = port.node_port.is_some()
            || !port.external_ips.is_empty()
            || !port.load_balancer_ips.is_empty();
        counts.0 += u64::from(port.internal_local && none_here);
        counts.1 += u64::from(port.external_local && external && none_here);
    }
    counts
}

/// The source the flags ask for: `--manifests`, else the API server.
async fn source(args: &RunArgs, node_name: &str) -> anyhow::Result<Source> {
    if let Some(path) = &args.manifests {
        return Ok(Source::Manifests(Manifests::new(path)));
    }
    let client = crate::source::kube::client(args.kubeconfig.as_deref()).await?;
    Ok(Source::Kube(KubeSource::start(client, node_name)))
}

/// `--node-ip`; else the Node object's InternalIPs (waiting a while for
/// it); else the interfaces' addresses.
async fn node_ips(args: &RunArgs, source: &Source) -> anyhow::Result<Vec<std::net::Ipv4Addr>> {
    if !args.node.node_ip.is_empty() {
        return Ok(args.node.node_ip.clone());
    }
    if let Source::Kube(kube) = source {
        let deadline = Instant::now() + NODE_WAIT;
        while !kube.node_listed() && Instant::now() < deadline {
            tokio::time::sleep(POLL).await;
        }
        let ips = NodeInfo::of(kube.node().as_ref()).internal_ips;
        if !ips.is_empty() {
            return Ok(ips);
        }
        tracing::warn!("no InternalIP in this node's Node object: using the interfaces' addresses");
    }
    node::interface_ips(&args.pod_interfaces)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let name = node::name(&args.node.hostname_override)?;
        let source = source(&args, &name).await?;
        let ips = node_ips(&args, &source).await?;
        let ips_from_node = args.node.node_ip.is_empty()
            && matches!(&source, Source::Kube(k) if NodeInfo::of(k.node().as_ref()).internal_ips == ips);
        let mut node = Node {
            name,
            ips,
            nodeport_addresses: args.node.nodeport_addresses.clone(),
            zone: None,
        };
        let eligibility = match &source {
            Source::Manifests(_) => NodeEligibility::NoApiServer,
            Source::Kube(kube) => {
                let info = NodeInfo::of(kube.node().as_ref());
                node.zone = info.zone;
                info.eligibility
            }
        };
        let mode = Datapath::choose(args.proxy_mode);
        let datapath = Datapath::new(mode, &args, &node)?;
        tracing::info!(mode = datapath.mode(), source = source.name(), node = %node.name, node_ips = ?node.ips, zone = ?node.zone, "starting");

        // kube-proxy: unhealthy once a change waits twice the sync period.
        let health = Arc::new(ProxyHealth::new(2 * args.sync_period, eligibility));
        let metrics = Arc::new(Metrics::new(health.clone(), datapath.mode()));
        let http = crate::http::server_thread().context("starting the endpoints' thread")?;
        metrics.clone().serve(&http, args.metrics_bind_address);
        health.clone().serve(&http, args.healthz_bind_address);
        let check_addresses = if args.node.nodeport_addresses.is_empty() {
            Vec::new()
        } else {
            let within = |ip: &std::net::Ipv4Addr| {
                args.node.nodeport_addresses.iter().any(|c| c.contains(*ip))
            };
            node.ips.iter().copied().filter(within).collect()
        };
        let min_sync_period = args.min_sync_period.unwrap_or(match mode {
            // iptables-restore is costly: kube-proxy's default.
            ProxyMode::Iptables => Duration::from_secs(1),
            _ => Duration::ZERO,
        });
        let mut agent = Agent {
            source,
            store: Store::default(),
            datapath,
            service_checks: ServiceChecks::new(health.clone(), http, check_addresses),
            metrics,
            health,
            planner: Planner::new(node.clone()),
            node,
            pins: args.pins.bpffs_root.clone(),
            planned: false,
            dirty: None,
            stats: ServiceStats::default(),
            due: None,
            retry_after: FIRST_RETRY,
            min_sync_period,
            sync_period: args.sync_period,
            last_sync: None,
            complete: false,
            synced_whole: false,
            checks_failed: false,
            reported: Default::default(),
            ips_from_node,
            restart: None,
            serving: false,
            rescan: Rescan::new(args.interface_rescan_period, Instant::now()),
            leftovers: true,
            polls: 0,
            started: SystemTime::now(),
            triggers: Vec::new(),
        };
        agent.run_loop().await
    })
}

async fn changed(notify: Option<&tokio::sync::Notify>) {
    match notify {
        Some(notify) => notify.notified().await,
        None => std::future::pending().await,
    }
}

/// When to take a change at once and when to wait for more: at most
/// `BURST_TAKES` changes go at once in any `BURST_WINDOW`.
#[derive(Debug, Default)]
struct Pace {
    taken: std::collections::VecDeque<Instant>,
}

impl Pace {
    /// Whether a change arriving at `now` should wait for those following.
    fn coalesce(&mut self, now: Instant) -> bool {
        while self.taken.front().is_some_and(|t| now.duration_since(*t) >= BURST_WINDOW) {
            self.taken.pop_front();
        }
        if self.taken.len() >= BURST_TAKES {
            return true;
        }
        self.taken.push_back(now);
        false
    }
}

/// Waits until the events stop coming for `QUIET`, or `MAX_COALESCE`.
async fn coalesce(notify: Option<&tokio::sync::Notify>) {
    let deadline = tokio::time::Instant::now() + MAX_COALESCE;
    loop {
        tokio::select! {
            _ = changed(notify) => {}
            _ = tokio::time::sleep(QUIET) => return,
            _ = tokio::time::sleep_until(deadline) => return,
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

/// `render iptables`: kube-proxy's restore input for the manifests, on stdout.
pub fn render_iptables(args: &RenderIptablesArgs) -> anyhow::Result<()> {
    let mut manifests = Manifests::new(&args.manifests);
    // New bytes are taken on the second read that finds them.
    manifests.reload();
    let reload = manifests.reload();
    for err in &reload.errors {
        tracing::warn!("{err}");
    }
    anyhow::ensure!(
        reload.complete,
        "could not read every manifest under {}",
        args.manifests.display()
    );
    let mut store = Store::default();
    for err in store.replace(manifests.snapshot()).unnamed {
        tracing::warn!("invalid object skipped: {err}");
    }
    for (_, problem) in store.problems() {
        tracing::warn!("{problem}");
    }
    let model = store.into_model();
    let pod_interfaces: Vec<String> =
        crate::cli::DEFAULT_POD_INTERFACES.split(',').map(String::from).collect();
    let ips = match args.node.node_ip.as_slice() {
        [] => node::interface_ips(&pod_interfaces)?,
        ips => ips.to_vec(),
    };
    let node = Node {
        name: node::name(&args.node.hostname_override)?,
        ips,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
        zone: args.zone.clone(),
    };
    let options = datapath::render_options(&node, &args.node, !args.no_nfacct);
    print!("{}", render::render(&model, &options));
    Ok(())
}

/// `prepare-node`: the node settings `run` needs and checks, made as root.
pub fn prepare_node(args: &PrepareArgs) -> anyhow::Result<()> {
    let root = &args.pins.bpffs_root;
    sys::ensure_bpffs_dir(root).with_context(|| format!("preparing {}", root.display()))?;
    let (min, max) = args.snat_port_range;
    sys::reserve_ports(min, max).context("reserving the SNAT port range")?;
    if args.iptables_localhost_nodeports {
        sys::set_sysctl("net/ipv4/conf/all/route_localnet", "1")
            .context("enabling route_localnet")?;
    }
    tracing::info!(bpffs = %root.display(), min, max, "node prepared");
    Ok(())
}

/// Removes both modes' datapaths: pins (links detach, maps go), clsact
/// filters and iptables rules of the caller's network namespace.
pub fn cleanup(args: &PinArgs) -> anyhow::Result<()> {
    let root = &args.bpffs_root;
    let (pins, filters) = datapath::cleanup_ebpf(root)?;
    let chains = iptables::cleanup(&mut System).context("removing the iptables rules")?;
    tracing::info!(pins, filters, chains, root = %root.display(), "removed pinned links and maps, clsact filters and iptables chains");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_go_at_once_until_a_burst_then_wait() {
        let mut pace = Pace::default();
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        assert!((0..BURST_TAKES as u64).all(|i| !pace.coalesce(at(i))));
        assert!(pace.coalesce(at(50)), "the 21st within 100 ms waits");
        assert!(!pace.coalesce(at(100)), "the first has left the window");
        assert!(pace.coalesce(at(100)), "and only the first");
        assert!(!pace.coalesce(at(300)));
    }

    #[test]
    fn services_with_local_policies_and_no_endpoint_here_are_counted() {
        let model = crate::source::model_from_yaml(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {type: NodePort, clusterIP: 10.96.0.1, externalTrafficPolicy: Local, internalTrafficPolicy: Local, ports: [{port: 80, nodePort: 30080}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: 10.96.0.2, internalTrafficPolicy: Local, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a-1, labels: {kubernetes.io/service-name: a}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.244.2.2], nodeName: other}]\n",
        );
        // b has no endpoints at all: not counted, as kube-proxy.
        let mut stats = ServiceStats::default();
        stats.update(&model, model.service_names(), "here");
        assert_eq!(stats.no_local_endpoints(), (1, 1));
        stats.update(&model, model.service_names(), "other");
        assert_eq!(stats.no_local_endpoints(), (0, 0));
    }
}
