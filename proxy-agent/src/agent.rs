//! The agent's loop: read the source, build the model and plan, sync the
//! datapath; log and count what was wrong, retry what failed.

use std::{
    path::Path,
    sync::{Arc, atomic::Ordering::Relaxed},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    PinArgs, RunArgs,
    backend::ebpf::{self, EbpfBackend},
    metrics::{self, Metrics},
    plan::{self, Plan},
    source::{Store, manifests::Manifests},
    sys,
};

/// How often the manifests are checked. New bytes are taken on the second
/// read that finds them, so a change reaches the kernel within two periods
/// plus the sync.
const POLL: Duration = Duration::from_millis(200);
/// Failed syncs are retried after this, doubling up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(10);

struct Agent {
    manifests: Manifests,
    store: Store,
    backend: EbpfBackend,
    metrics: Arc<Metrics>,
    node_name: String,
    /// A plan the maps do not hold yet, and when to try again.
    pending: Option<(Plan, Instant)>,
    retry_after: Duration,
    /// Every manifest has been read once: the datapath may be replaced.
    complete: bool,
}

impl Agent {
    /// One round: reload; on a change, compute a new plan; sync the pending
    /// plan when due. Never fails: errors are logged, counted and retried.
    fn tick(&mut self) {
        let reload = self.manifests.reload();
        for err in &reload.errors {
            tracing::warn!(kind = err.kind(), "{err}");
            self.metrics.invalid(err.kind());
        }
        self.complete |= reload.complete;
        if reload.changed {
            self.pending = Some((self.plan(), Instant::now()));
            self.retry_after = FIRST_RETRY;
        }
        if let Some((plan, due)) = self.pending.take() {
            if Instant::now() < due {
                self.pending = Some((plan, due));
            } else {
                self.sync(plan);
            }
        }
    }

    /// Store, model and plan for the current manifests; each problem is
    /// logged and counted once per change.
    fn plan(&mut self) -> Plan {
        let update = self.store.replace(self.manifests.snapshot());
        for err in &update.errors {
            tracing::warn!(kind = err.kind(), "invalid object skipped: {err}");
            self.metrics.invalid(err.kind());
        }
        for kept in &update.kept {
            tracing::warn!(kind = %kept.kind, name = %kept.name, "serving the last good version");
            self.metrics.kept_objects.fetch_add(1, Relaxed);
        }
        let model = self.store.model();
        for err in &model.errors {
            tracing::warn!(kind = err.kind(), "{err}");
            self.metrics.invalid(err.kind());
        }
        let (plan, conflicts) = plan::plan(&model, &self.node_name);
        for conflict in &conflicts {
            tracing::warn!("{conflict}");
            self.metrics.invalid("Service");
        }
        plan
    }

    fn sync(&mut self, plan: Plan) {
        match self.backend.sync(&plan) {
            Ok(report) => {
                self.metrics.syncs_ok.fetch_add(1, Relaxed);
                let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH);
                self.metrics.last_sync_seconds.store(now.map_or(0, |d| d.as_secs()), Relaxed);
                let state = self.backend.state();
                self.metrics.frontends.store(state.frontend_count() as u64, Relaxed);
                self.metrics.backends.store(state.backend_count() as u64, Relaxed);
                tracing::info!(
                    frontends = state.frontend_count(),
                    backends = state.backend_count(),
                    writes = report.writes,
                    "datapath synced"
                );
            }
            Err(err) => {
                self.metrics.syncs_failed.fetch_add(1, Relaxed);
                tracing::error!(
                    retry_in = ?self.retry_after,
                    "sync failed, serving the previous state: {err}"
                );
                self.pending = Some((plan, Instant::now() + self.retry_after));
                self.retry_after = (self.retry_after * 2).min(MAX_RETRY);
            }
        }
    }

    /// Whether the maps hold the whole source: only then may they replace a
    /// previous agent's datapath.
    fn ready(&self) -> bool {
        self.complete && self.pending.is_none()
    }
}

fn node_name(args: &RunArgs) -> anyhow::Result<String> {
    if let Some(name) = &args.hostname_override {
        return Ok(name.clone());
    }
    let name =
        std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading the hostname")?;
    Ok(name.trim().to_lowercase())
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let cgroup = match &args.cgroup_path {
        Some(path) => path.clone(),
        None => sys::cgroup2_root().context("finding the cgroup2 mount")?,
    };
    let root = args.pins.bpffs_root.clone();
    sys::ensure_bpffs_dir(&root).with_context(|| format!("preparing {}", root.display()))?;
    let backend = EbpfBackend::load().context("loading the BPF programs")?;
    let node_name = node_name(&args)?;
    tracing::info!(mode = ?args.proxy_mode, node = %node_name, cgroup = %cgroup.display(), bpffs = %root.display(), "starting");

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let metrics = Arc::new(Metrics::default());
        let listener = tokio::net::TcpListener::bind(args.metrics_bind_address)
            .await
            .with_context(|| format!("binding metrics to {}", args.metrics_bind_address))?;
        tokio::spawn(metrics::serve(listener, metrics.clone()));

        let mut agent = Agent {
            manifests: Manifests::new(&args.manifests),
            store: Store::default(),
            backend,
            metrics,
            node_name,
            pending: None,
            retry_after: FIRST_RETRY,
            complete: false,
        };
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut attached = false;
        let mut waiting_since: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = poll.tick() => {
                    agent.tick();
                    if !attached {
                        attached = activate_when_ready(&mut agent, &cgroup, &root, &mut waiting_since)?;
                    }
                }
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
            }
        }
        tracing::info!("stopping; the datapath stays pinned until `proxy-agent cleanup`");
        Ok(())
    })
}

/// Attaches the programs once the maps hold the whole source. Until then a
/// previous agent's datapath keeps serving: a restart with unreadable
/// manifests must not replace it with empty maps.
fn activate_when_ready(
    agent: &mut Agent,
    cgroup: &Path,
    root: &Path,
    waiting_since: &mut Option<Instant>,
) -> anyhow::Result<bool> {
    if !agent.ready() {
        let since = *waiting_since.get_or_insert_with(Instant::now);
        if since.elapsed() > Duration::from_secs(2) {
            tracing::warn!(
                "waiting for every manifest to be readable before taking over the datapath"
            );
            *waiting_since = Some(Instant::now());
        }
        return Ok(false);
    }
    agent
        .backend
        .activate(cgroup, root)
        .with_context(|| format!("attaching to {}", cgroup.display()))?;
    agent.metrics.set_datapath(ebpf::CounterReader::open(root)?);
    tracing::info!("programs attached; serving");
    Ok(true)
}

pub fn cleanup(args: &PinArgs) -> anyhow::Result<()> {
    let root = &args.bpffs_root;
    let removed = ebpf::remove_pins(root)?;
    remove_empty_dir(root)?;
    tracing::info!(removed, root = %root.display(), "removed pinned links and maps");
    Ok(())
}

fn remove_empty_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}
