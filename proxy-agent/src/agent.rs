//! The agent's loop: read the source, build the model and plan, sync the
//! datapath; log and count what was wrong, retry what failed.

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
    backend::ebpf::{self, EbpfBackend, TcAttach},
    backend::iptables::render,
    cli::{PinArgs, RenderIptablesArgs, RunArgs, TcAttachArg},
    metrics::{self, Metrics},
    plan::{self, Node, Plan},
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
/// Expired conntrack entries are collected every this many polls.
const GC_EVERY: u32 = 5;
/// A TCP flow translated per packet that never saw a reply lives this long.
const TCP_SYN_TIMEOUT_SECS: u32 = 60;

struct Agent {
    manifests: Manifests,
    store: Store,
    backend: EbpfBackend,
    metrics: Arc<Metrics>,
    node: Node,
    /// Name prefixes of pod-facing interfaces.
    pod_interfaces: Vec<String>,
    root: PathBuf,
    /// The programs are attached: interfaces and conntrack are looked after.
    attached: bool,
    polls: u32,
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
        if self.attached {
            self.look_after_datapath();
        }
    }

    /// Follows interfaces that come and go, and collects expired flows.
    fn look_after_datapath(&mut self) {
        match sys::interfaces() {
            Ok(interfaces) => {
                let wanted = tc_interfaces(&interfaces, &self.node.ips, &self.pod_interfaces);
                self.backend.set_tc_interfaces(&self.root, &wanted);
            }
            Err(e) => tracing::warn!(error = %e, "could not list interfaces"),
        }
        self.polls = self.polls.wrapping_add(1);
        if self.polls.is_multiple_of(GC_EVERY) {
            match self.backend.collect_conntrack() {
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
        let (plan, conflicts) = plan::plan(&model, &self.node);
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
                match self.backend.flush_udp_flows(&report.removed_backends) {
                    Ok(0) => {}
                    Ok(flushed) => {
                        tracing::info!(flushed, "UDP flows to removed endpoints deleted")
                    }
                    Err(e) => tracing::warn!(error = %e, "could not flush UDP flows"),
                }
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

pub fn run(args: RunArgs) -> anyhow::Result<()> {
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
    let node = Node {
        name: node_name(&args.node.hostname_override)?,
        ips: node_ips(&args.node.node_ip, &args.pod_interfaces)?,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
    };
    backend
        .configure(&datapath_config(&args, &node.ips))
        .context("writing the datapath settings")?;
    let (min, max) = args.snat_port_range;
    sys::reserve_ports(min, max).context("reserving the SNAT port range")?;
    tracing::info!(mode = ?args.proxy_mode, ?tc_mode, node = %node.name, node_ips = ?node.ips, cgroup = %cgroup.display(), bpffs = %root.display(), "starting");

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
            node,
            pod_interfaces: args.pod_interfaces.clone(),
            root: root.clone(),
            attached: false,
            polls: 0,
            pending: None,
            retry_after: FIRST_RETRY,
            complete: false,
        };
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut waiting_since: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = poll.tick() => {
                    agent.tick();
                    if !agent.attached {
                        agent.attached = activate_when_ready(&mut agent, &cgroup, &mut waiting_since)?;
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
    let interfaces = sys::interfaces().context("listing interfaces")?;
    let wanted = tc_interfaces(&interfaces, &agent.node.ips, &agent.pod_interfaces);
    agent
        .backend
        .activate(cgroup, &wanted, &agent.root)
        .with_context(|| format!("attaching to {} and {wanted:?}", cgroup.display()))?;
    agent.metrics.set_datapath(ebpf::CounterReader::open(&agent.root)?);
    tracing::info!("programs attached; serving");
    Ok(true)
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
    let options = render::Options {
        node_name: node_name(&args.node.hostname_override)?,
        node_ips: node_ips(&args.node.node_ip, &pod_interfaces)?,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
        cluster_cidr: args.node.cluster_cidr,
        masquerade_all: args.node.masquerade_all,
        // What current kube-proxy writes with current iptables.
        localhost_nodeports: true,
        nfacct: !args.no_nfacct,
        random_fully: true,
        conntrack_tcp_liberal: std::fs::read_to_string(
            "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
        )
        .is_ok_and(|v| v.trim() != "0"),
    };
    print!("{}", render::render(&model, &options));
    Ok(())
}

pub fn cleanup(args: &PinArgs) -> anyhow::Result<()> {
    let root = &args.bpffs_root;
    let removed = ebpf::remove_pins(root)?;
    remove_empty_dir(root)?;
    let filters = ebpf::remove_tc_filters();
    tracing::info!(removed, filters, root = %root.display(), "removed pinned links and maps, and clsact filters");
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
