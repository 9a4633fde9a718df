//! The agent's loop: read the source, build the model and plan, sync the
//! datapath; log and count what was wrong, retry what failed.

use std::{
    path::Path,
    sync::{Arc, atomic::Ordering::Relaxed},
    time::{Duration, SystemTime},
};

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    PinArgs, RunArgs,
    backend::ebpf::{self, EbpfBackend},
    metrics::{self, Metrics},
    plan,
    source::{Store, manifests::Manifests},
    sys,
};

/// How often the manifests are checked; a change reaches the kernel within
/// one period plus the sync.
const POLL: Duration = Duration::from_millis(200);

struct Agent {
    manifests: Manifests,
    store: Store,
    backend: EbpfBackend,
    metrics: Arc<Metrics>,
    node_name: String,
    /// The last sync failed: try again even if nothing changed.
    retry: bool,
}

impl Agent {
    /// One round: reload, and sync when something changed or the last sync
    /// failed. Never fails: errors are logged, counted, and retried.
    fn tick(&mut self) {
        let reload = self.manifests.reload();
        for err in &reload.errors {
            tracing::warn!(kind = err.kind(), "{err}");
            self.metrics.invalid(err.kind());
        }
        if reload.changed || self.retry {
            self.sync();
        }
    }

    fn sync(&mut self) {
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
        match self.backend.sync(&plan) {
            Ok(report) => {
                self.retry = false;
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
                self.retry = true;
                self.metrics.syncs_failed.fetch_add(1, Relaxed);
                tracing::error!("sync failed, serving the previous state and retrying: {err}");
            }
        }
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
    let root = &args.pins.bpffs_root;
    sys::ensure_bpffs_dir(root).with_context(|| format!("preparing {}", root.display()))?;
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
            retry: true,
        };
        // Fill the maps before the programs see any traffic.
        agent.tick();
        agent
            .backend
            .activate(&cgroup, root)
            .with_context(|| format!("attaching to {}", cgroup.display()))?;
        agent.metrics.set_datapath(ebpf::CounterReader::open(root)?);
        tracing::info!("programs attached; serving");

        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = poll.tick() => agent.tick(),
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
            }
        }
        tracing::info!("stopping; the datapath stays pinned until `proxy-agent cleanup`");
        Ok(())
    })
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
