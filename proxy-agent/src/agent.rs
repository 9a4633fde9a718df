//! The agent's loop: read the source, build the model and plan, sync the
//! datapath (eBPF or iptables); log and count what was wrong, retry what
//! failed.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{Arc, atomic::Ordering::Relaxed},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};

use proxy_common::Config;

use crate::{
    backend::{
        ebpf::{self, EbpfBackend, TcAttach},
        iptables::{self, CANARY, IptablesBackend, IptablesError, exec::System, render},
    },
    cli::{NodeArgs, PinArgs, ProxyMode, RenderIptablesArgs, RunArgs, TcAttachArg},
    metrics::{self, Metrics},
    model::Model,
    plan::{self, Node, Plan},
    probe,
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
/// eBPF: expired conntrack entries are collected every this many polls.
const GC_EVERY: u32 = 5;
/// iptables: mangle's canary chain is checked every this many polls...
const CANARY_EVERY: u32 = 10;
/// ...and every canary once in this many checks.
const THOROUGH_CANARY_EVERY: u32 = 15;
/// Failed attachments and removals of the other mode's datapath are
/// retried every this many polls.
const RETRY_EVERY: u32 = 25;
/// A TCP flow translated per packet that never saw a reply lives this long.
const TCP_SYN_TIMEOUT_SECS: u32 = 60;
/// What the agent logs once its datapath serves the source.
const SERVING: &str = "datapath ready; serving";

/// What the datapath should hold: the model, and the plan (which also
/// reports conflicting frontends, in either mode).
#[derive(Default)]
struct Desired {
    model: Model,
    plan: Plan,
}

/// The eBPF datapath and what looking after it needs.
struct Ebpf {
    backend: EbpfBackend,
    cgroup: PathBuf,
    root: PathBuf,
    /// Name prefixes of pod-facing interfaces.
    pod_interfaces: Vec<String>,
}

enum Datapath {
    Ebpf(Box<Ebpf>),
    Iptables(Box<IptablesBackend<System>>),
}

impl Datapath {
    fn mode(&self) -> &'static str {
        match self {
            Datapath::Ebpf(_) => "ebpf",
            Datapath::Iptables(_) => "iptables",
        }
    }
}

struct Agent {
    manifests: Manifests,
    store: Store,
    datapath: Datapath,
    metrics: Arc<Metrics>,
    node: Node,
    /// `--bpffs-root`: the eBPF mode's pins (removed in iptables mode).
    pins: PathBuf,
    desired: Desired,
    /// When to sync `desired` into the datapath; `None`: it holds it.
    due: Option<Instant>,
    retry_after: Duration,
    /// Every manifest has been read once: the datapath may be replaced.
    complete: bool,
    /// The datapath serves `desired` (programs attached, rules applied).
    serving: bool,
    /// The other mode's datapath may still be there.
    leftovers: bool,
    polls: u32,
}

impl Agent {
    /// One round: reload; on a change, compute the desired state; sync it
    /// when due; look after the datapath. Never fails: errors are logged,
    /// counted and retried.
    fn tick(&mut self) {
        let reload = self.manifests.reload();
        for err in &reload.errors {
            tracing::warn!(kind = err.kind(), "{err}");
            self.metrics.invalid(err.kind());
        }
        self.complete |= reload.complete;
        if reload.changed {
            self.desired = self.desired();
            self.due = Some(Instant::now());
            self.retry_after = FIRST_RETRY;
        }
        if self.due.is_some_and(|due| Instant::now() >= due) && self.may_sync() {
            self.sync();
        }
        self.polls = self.polls.wrapping_add(1);
        if self.serving {
            self.look_after_datapath();
        }
    }

    /// Store, model and plan for the current manifests; each problem is
    /// logged and counted once per change.
    fn desired(&mut self) -> Desired {
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
        let (plan, conflicts) = plan::plan(&model, &self.node);
        for conflict in &conflicts {
            tracing::warn!("{conflict}");
            self.metrics.invalid("Service");
        }
        Desired { model, plan }
    }

    fn sync(&mut self) {
        let plan = &self.desired.plan;
        let result = match &mut self.datapath {
            Datapath::Ebpf(dp) => sync_ebpf(&mut dp.backend, plan),
            Datapath::Iptables(backend) => {
                sync_iptables(backend, &self.desired.model, &self.metrics)
            }
        };
        match result {
            Ok(()) => {
                self.due = None;
                self.metrics.syncs_ok.fetch_add(1, Relaxed);
                let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH);
                self.metrics.last_sync_seconds.store(now.map_or(0, |d| d.as_secs()), Relaxed);
                let backends: BTreeSet<_> =
                    plan.frontends.values().flat_map(|f| &f.backends).map(|b| b.addr).collect();
                self.metrics.frontends.store(plan.frontends.len() as u64, Relaxed);
                self.metrics.backends.store(backends.len() as u64, Relaxed);
            }
            Err(err) => {
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

    /// eBPF: follows interfaces that come and go, and collects expired
    /// flows. iptables: resyncs when someone flushed the rules, and hourly.
    fn look_after_datapath(&mut self) {
        match &mut self.datapath {
            Datapath::Ebpf(dp) => {
                match sys::interfaces() {
                    Ok(interfaces) => {
                        let wanted = tc_interfaces(&interfaces, &self.node.ips, &dp.pod_interfaces);
                        dp.backend.set_tc_interfaces(&dp.root, &wanted);
                    }
                    Err(e) => tracing::warn!(error = %e, "could not list interfaces"),
                }
                if self.polls.is_multiple_of(GC_EVERY) {
                    match dp.backend.collect_conntrack() {
                        Ok((deleted, left)) => {
                            self.metrics.conntrack_entries.store(left as u64, Relaxed);
                            if deleted > 0 {
                                tracing::debug!(deleted, left, "expired flows collected");
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "conntrack collection failed"),
                    }
                }
            }
            Datapath::Iptables(backend) => {
                if self.due.is_some() || !self.polls.is_multiple_of(CANARY_EVERY) {
                    return;
                }
                // mangle's canary is cheap to check; nat's and filter's
                // (a copy of the whole table with iptables-legacy) rarely.
                let thorough = self.polls.is_multiple_of(CANARY_EVERY * THOROUGH_CANARY_EVERY);
                match backend.canary_gone(thorough) {
                    Ok(Some(table)) => {
                        tracing::warn!(
                            table,
                            "{CANARY} is gone: another program flushed the rules; full resync"
                        );
                        self.metrics.canary_resyncs.fetch_add(1, Relaxed);
                        self.due = Some(Instant::now());
                    }
                    Ok(None) if backend.full_sync_due() => self.due = Some(Instant::now()),
                    Ok(None) => {}
                    Err(e) => tracing::warn!("could not check {CANARY}: {e}"),
                }
            }
        }
        if self.leftovers && self.polls.is_multiple_of(RETRY_EVERY) {
            self.remove_other_modes_datapath();
        }
    }

    /// Removes what the other mode left (eBPF programs keep translating in
    /// front of the rules; rules would still catch host-network clients);
    /// retried until it works.
    fn remove_other_modes_datapath(&mut self) {
        let result: anyhow::Result<()> = match &self.datapath {
            // Socket LB and tc translate before netfilter sees a packet:
            // the rules only go once the programs serve.
            Datapath::Ebpf(_) => iptables::cleanup(&mut System).map_err(Into::into).map(|chains| {
                if chains > 0 {
                    tracing::info!(chains, "removed the iptables mode's rules");
                }
            }),
            // The rules are in; the programs go.
            Datapath::Iptables(_) => cleanup_ebpf(&self.pins).map(|(pins, filters)| {
                if pins + filters > 0 {
                    tracing::info!(pins, filters, "removed the eBPF mode's programs");
                }
            }),
        };
        match result {
            Ok(()) => self.leftovers = false,
            Err(e) => {
                self.metrics.mode_cleanup_failures.fetch_add(1, Relaxed);
                tracing::warn!("could not remove the other mode's datapath (will retry): {e:#}");
            }
        }
    }

    /// A new agent's maps are private until its programs attach, but rules
    /// are live as soon as they are applied: they wait for every manifest,
    /// so an unreadable file never replaces good rules with fewer.
    fn may_sync(&self) -> bool {
        self.complete || matches!(self.datapath, Datapath::Ebpf(_))
    }

    /// Whether the datapath holds the whole source: only then may it
    /// replace a previous agent's (or the other mode's).
    fn ready(&self) -> bool {
        self.complete && self.due.is_none()
    }

    /// Once the datapath holds the whole source, makes it serve: attaches
    /// the programs (eBPF; until then a previous agent's datapath keeps
    /// serving), then removes what the other mode left.
    fn serve_when_ready(&mut self, waiting_since: &mut Option<Instant>) -> anyhow::Result<()> {
        if !self.ready() {
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                tracing::warn!(
                    "waiting for every manifest to be readable before taking over the datapath"
                );
                *waiting_since = Some(Instant::now());
            }
            return Ok(());
        }
        if let Datapath::Ebpf(dp) = &mut self.datapath {
            let interfaces = sys::interfaces().context("listing interfaces")?;
            let wanted = tc_interfaces(&interfaces, &self.node.ips, &dp.pod_interfaces);
            dp.backend
                .activate(&dp.cgroup, &wanted, &dp.root)
                .with_context(|| format!("attaching to {} and {wanted:?}", dp.cgroup.display()))?;
            self.metrics.set_datapath(ebpf::CounterReader::open(&dp.root)?);
        }
        self.remove_other_modes_datapath();
        tracing::info!(mode = self.datapath.mode(), "{SERVING}");
        self.serving = true;
        Ok(())
    }
}

fn sync_ebpf(backend: &mut EbpfBackend, plan: &Plan) -> anyhow::Result<()> {
    let report = backend.sync(plan)?;
    let state = backend.state();
    tracing::info!(
        frontends = state.frontend_count(),
        backends = state.backend_count(),
        writes = report.writes,
        "datapath synced"
    );
    match backend.flush_udp_flows(&report.removed_backends) {
        Ok(0) => {}
        Ok(flushed) => tracing::info!(flushed, "UDP flows to removed endpoints deleted"),
        Err(e) => tracing::warn!(error = %e, "could not flush UDP flows"),
    }
    Ok(())
}

fn sync_iptables(
    backend: &mut IptablesBackend<System>,
    model: &Model,
    metrics: &Metrics,
) -> anyhow::Result<()> {
    let report = match backend.sync(model) {
        Ok(report) => report,
        Err(err) => {
            if let IptablesError::Restore { full, .. } = &err {
                metrics.restore_failures.fetch_add(1, Relaxed);
                if !full {
                    metrics.partial_restore_failures.fetch_add(1, Relaxed);
                }
            }
            return Err(err.into());
        }
    };
    tracing::info!(
        full = report.full,
        chains_written = report.chains_written,
        chains_deleted = report.chains_deleted,
        "rules synced"
    );
    if report.flows_flushed > 0 {
        tracing::info!(sets = report.flows_flushed, "stale UDP conntrack entries deleted");
    }
    if report.untranslated_deleted > 0 {
        tracing::info!(
            flows = report.untranslated_deleted,
            "conntrack entries made while the rules were missing deleted"
        );
    }
    for e in &report.flow_errors {
        metrics.conntrack_cleanup_failures.fetch_add(1, Relaxed);
        tracing::warn!("could not delete stale conntrack entries (will retry): {e}");
    }
    Ok(())
}

/// The interfaces whose ingress runs the per-packet program: those holding a
/// node address, and pod-facing ones (by name prefix).
fn tc_interfaces(
    interfaces: &BTreeMap<String, Vec<Ipv4Addr>>,
    node_ips: &[Ipv4Addr],
    pod_prefixes: &[String],
) -> BTreeSet<String> {
    interfaces
        .iter()
        .filter(|(name, addrs)| {
            pod_prefixes.iter().any(|p| !p.is_empty() && name.starts_with(p.as_str()))
                || addrs.iter().any(|a| node_ips.contains(a))
        })
        .map(|(name, _)| name.clone())
        .filter(|name| name != "lo")
        .collect()
}

/// `--node-ip`, or the IPv4 addresses of the interfaces that are neither
/// loopback nor pod-facing, those of the default route's interface first
/// (the first is the SNAT address: replies must find their way back to it).
fn node_ips(node_ip: &[Ipv4Addr], pod_interfaces: &[String]) -> anyhow::Result<Vec<Ipv4Addr>> {
    if !node_ip.is_empty() {
        return Ok(node_ip.to_vec());
    }
    let mut interfaces: Vec<(String, Vec<Ipv4Addr>)> =
        sys::interfaces().context("listing interfaces")?.into_iter().collect();
    let uplink = sys::default_route_interface();
    interfaces.sort_by_key(|(name, _)| Some(name) != uplink.as_ref());
    let is_pod =
        |name: &str| pod_interfaces.iter().any(|p| !p.is_empty() && name.starts_with(p.as_str()));
    let ips: Vec<Ipv4Addr> = interfaces
        .iter()
        .filter(|(name, _)| !is_pod(name))
        .flat_map(|(_, addrs)| addrs.iter().copied())
        .filter(|ip| !ip.is_loopback() && !ip.is_link_local())
        .collect();
    anyhow::ensure!(!ips.is_empty(), "no node address found: pass --node-ip");
    Ok(ips)
}

fn datapath_config(args: &RunArgs, node_ips: &[Ipv4Addr]) -> Config {
    let (cidr, prefix) = args.node.cluster_cidr.map_or(([0; 4], 0), |c| (c.addr.octets(), c.len));
    let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX).max(1);
    Config {
        snat_addr: node_ips[0].octets(),
        cluster_cidr: cidr,
        cluster_cidr_prefix: prefix,
        masquerade_all: args.node.masquerade_all as u8,
        snat_port_min: args.snat_port_range.0,
        snat_port_max: args.snat_port_range.1,
        _pad: 0,
        tcp_syn_timeout_secs: TCP_SYN_TIMEOUT_SECS,
        tcp_established_timeout_secs: secs(args.conntrack_tcp_timeout_established),
        tcp_close_wait_timeout_secs: secs(args.conntrack_tcp_timeout_close_wait),
        tcp_time_wait_timeout_secs: secs(args.conntrack_tcp_timeout_time_wait),
        udp_timeout_secs: secs(args.conntrack_udp_timeout),
    }
}

fn node_name(hostname_override: &Option<String>) -> anyhow::Result<String> {
    if let Some(name) = hostname_override {
        return Ok(name.clone());
    }
    let name =
        std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading the hostname")?;
    Ok(name.trim().to_lowercase())
}

/// The mode to run: as asked, or for `auto` what the kernel can run.
fn choose_mode(asked: ProxyMode) -> ProxyMode {
    if asked != ProxyMode::Auto {
        return asked;
    }
    let features = probe::run();
    match probe::decide(&features) {
        probe::Decision::Ebpf => ProxyMode::Ebpf,
        probe::Decision::Iptables { missing } => {
            let detail = features.iter().find(|f| f.name == missing).map(|f| f.detail.as_str());
            tracing::warn!(
                "eBPF mode unavailable, this kernel lacks: {missing} ({}); running in iptables mode",
                detail.unwrap_or_default()
            );
            ProxyMode::Iptables
        }
    }
}

fn ebpf_datapath(args: &RunArgs, node: &Node) -> anyhow::Result<Ebpf> {
    let cgroup = match &args.cgroup_path {
        Some(path) => path.clone(),
        None => sys::cgroup2_root().context("finding the cgroup2 mount")?,
    };
    let root = args.pins.bpffs_root.clone();
    sys::ensure_bpffs_dir(&root).with_context(|| format!("preparing {}", root.display()))?;
    let tc_mode = match args.tc_attach {
        TcAttachArg::Auto => TcAttach::for_this_kernel(),
        TcAttachArg::Tcx => TcAttach::Tcx,
        TcAttachArg::Netlink => TcAttach::Netlink,
    };
    let mut backend = EbpfBackend::load(tc_mode).context("loading the BPF programs")?;
    backend
        .configure(&datapath_config(args, &node.ips))
        .context("writing the datapath settings")?;
    let (min, max) = args.snat_port_range;
    sys::reserve_ports(min, max).context("reserving the SNAT port range")?;
    tracing::info!(?tc_mode, cgroup = %cgroup.display(), bpffs = %root.display(), "BPF programs loaded");
    Ok(Ebpf { backend, cgroup, root, pod_interfaces: args.pod_interfaces.clone() })
}

fn iptables_datapath(args: &RunArgs, node: &Node) -> IptablesBackend<System> {
    let options = render_options(node, &args.node, false);
    if options.localhost_nodeports() {
        // As kube-proxy: NodePorts on 127.0.0.1 need DNAT of loopback traffic.
        if let Err(e) = sys::set_sysctl("net/ipv4/conf/all/route_localnet", "1") {
            tracing::warn!("could not enable route_localnet (localhost NodePorts): {e}");
        }
    }
    IptablesBackend::new(System, options)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let node = Node {
        name: node_name(&args.node.hostname_override)?,
        ips: node_ips(&args.node.node_ip, &args.pod_interfaces)?,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
    };
    let datapath = match choose_mode(args.proxy_mode) {
        ProxyMode::Iptables => Datapath::Iptables(Box::new(iptables_datapath(&args, &node))),
        _ => Datapath::Ebpf(Box::new(ebpf_datapath(&args, &node)?)),
    };
    tracing::info!(mode = datapath.mode(), node = %node.name, node_ips = ?node.ips, "starting");

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
            datapath,
            metrics,
            node,
            pins: args.pins.bpffs_root.clone(),
            desired: Desired::default(),
            due: None,
            retry_after: FIRST_RETRY,
            complete: false,
            serving: false,
            leftovers: true,
            polls: 0,
        };
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut waiting_since: Option<Instant> = None;
        // Every poll until an attempt fails, then less often.
        let mut retry_every = 1;
        loop {
            tokio::select! {
                _ = poll.tick() => {
                    agent.tick();
                    if !agent.serving
                        && agent.polls.is_multiple_of(retry_every)
                        && let Err(e) = agent.serve_when_ready(&mut waiting_since)
                    {
                        agent.metrics.activation_failures.fetch_add(1, Relaxed);
                        tracing::error!("could not take over the datapath (will retry): {e:#}");
                        retry_every = RETRY_EVERY;
                    }
                }
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
            }
        }
        tracing::info!("stopping; the datapath stays in place until `proxy-agent cleanup`");
        Ok(())
    })
}

/// What the iptables rules depend on besides the services.
fn render_options(node: &Node, args: &NodeArgs, nfacct: bool) -> render::Options {
    render::Options {
        node_name: node.name.clone(),
        node_ips: node.ips.clone(),
        nodeport_addresses: args.nodeport_addresses.clone(),
        cluster_cidr: args.cluster_cidr,
        masquerade_all: args.masquerade_all,
        // What current kube-proxy writes with current iptables.
        localhost_nodeports: true,
        nfacct,
        random_fully: true,
        conntrack_tcp_liberal: std::fs::read_to_string(
            "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
        )
        .is_ok_and(|v| v.trim() != "0"),
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
    for err in store.replace(manifests.snapshot()).errors {
        tracing::warn!("invalid object skipped: {err}");
    }
    let model = store.model();
    let pod_interfaces: Vec<String> =
        crate::cli::DEFAULT_POD_INTERFACES.split(',').map(String::from).collect();
    let node = Node {
        name: node_name(&args.node.hostname_override)?,
        ips: node_ips(&args.node.node_ip, &pod_interfaces)?,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
    };
    let options = render_options(&node, &args.node, !args.no_nfacct);
    print!("{}", render::render(&model, &options));
    Ok(())
}

/// Removes both modes' datapaths: pins (links detach, maps go), clsact
/// filters and iptables rules of the caller's network namespace.
pub fn cleanup(args: &PinArgs) -> anyhow::Result<()> {
    let root = &args.bpffs_root;
    let (pins, filters) = cleanup_ebpf(root)?;
    let chains = iptables::cleanup(&mut System).context("removing the iptables rules")?;
    tracing::info!(pins, filters, chains, root = %root.display(), "removed pinned links and maps, clsact filters and iptables chains");
    Ok(())
}

/// Removes the eBPF mode's pins under `root` and its clsact filters;
/// returns how many of each.
fn cleanup_ebpf(root: &Path) -> anyhow::Result<(usize, usize)> {
    let removed = ebpf::remove_pins(root)?;
    remove_empty_dir(root)?;
    Ok((removed, ebpf::remove_tc_filters()))
}

fn remove_empty_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_packet_interfaces_are_node_and_pod_facing_ones() {
        let interfaces: BTreeMap<String, Vec<Ipv4Addr>> = [
            ("lo", vec![Ipv4Addr::LOCALHOST]),
            ("eth0", vec![Ipv4Addr::new(192, 168, 100, 11)]),
            ("eth1", vec![Ipv4Addr::new(172, 16, 0, 1)]),
            ("veth1", vec![Ipv4Addr::new(169, 254, 1, 1)]),
            ("lxc12", vec![]),
            ("docker0", vec![Ipv4Addr::new(172, 17, 0, 1)]),
        ]
        .into_iter()
        .map(|(n, a)| (n.to_string(), a))
        .collect();
        let wanted = tc_interfaces(
            &interfaces,
            &[Ipv4Addr::new(192, 168, 100, 11)],
            &["veth".into(), "lxc".into()],
        );
        let names: Vec<&str> = wanted.iter().map(String::as_str).collect();
        assert_eq!(names, ["eth0", "lxc12", "veth1"]);
    }
}
