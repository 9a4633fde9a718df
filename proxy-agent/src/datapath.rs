//! The two datapaths behind one face: what the agent syncs the desired
//! state into, looks after between syncs, attaches, and switches from.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::atomic::Ordering::Relaxed,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use proxy_common::Config;

use crate::{
    backend::{
        ebpf::{self, EbpfBackend, MapSizes, TcAttach},
        iptables::{self, CANARY, IptablesBackend, IptablesError, exec::System, render},
    },
    cli::{NodeArgs, ProxyMode, RunArgs, TcAttachArg},
    metrics::Metrics,
    model::Model,
    node,
    plan::{Frontend, Node, Plan},
    probe, sys,
};

/// A TCP flow translated per packet that never saw a reply lives this long.
const TCP_SYN_TIMEOUT_SECS: u32 = 60;
/// eBPF: expired conntrack entries are collected at least this often...
const GC_MIN: Duration = Duration::from_secs(1);
/// ...and at most this rarely.
const GC_MAX: Duration = Duration::from_secs(30);
/// Entries walked per second of interval: a collection reads the whole map
/// (two syscalls an entry), so its interval grows with the map and the
/// agent's share of a CPU stays small under heavy traffic. The programs
/// ignore expired entries, and the LRU map evicts under pressure: the
/// collection only frees room early.
const GC_ENTRIES_PER_SEC: usize = 10_000;

/// When to collect again, after a collection that left `entries`.
fn gc_interval(entries: usize) -> Duration {
    Duration::from_secs((entries / GC_ENTRIES_PER_SEC) as u64).clamp(GC_MIN, GC_MAX)
}
/// iptables: mangle's canary chain is checked every this many looks...
const CANARY_EVERY: u32 = 10;
/// ...and every canary once in this many checks.
const THOROUGH_CANARY_EVERY: u32 = 15;

/// The eBPF datapath and what looking after it needs.
pub struct Ebpf {
    backend: EbpfBackend,
    cgroup: PathBuf,
    root: PathBuf,
    /// Name prefixes of pod-facing interfaces.
    pod_interfaces: Vec<String>,
    /// When expired conntrack entries are next collected.
    next_gc: Instant,
}

pub enum Datapath {
    Ebpf(Box<Ebpf>),
    Iptables(Box<IptablesBackend<System>>),
}

/// What a successful sync did, for the metrics.
#[derive(Debug, Default)]
pub struct Synced {
    /// iptables mode: whether it was a full sync.
    pub full: Option<bool>,
    /// Distinct backends served.
    pub backends: usize,
}

impl Datapath {
    /// The mode to run: as asked, or for `auto` what the kernel can run.
    pub fn choose(asked: ProxyMode) -> ProxyMode {
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

    /// Loads (eBPF) or prepares (iptables) the datapath of `mode`.
    pub fn new(mode: ProxyMode, args: &RunArgs, node: &Node) -> anyhow::Result<Self> {
        Ok(match mode {
            ProxyMode::Iptables => Datapath::Iptables(Box::new(iptables_datapath(args, node))),
            _ => Datapath::Ebpf(Box::new(ebpf_datapath(args, node)?)),
        })
    }

    pub fn mode(&self) -> &'static str {
        match self {
            Datapath::Ebpf(_) => "ebpf",
            Datapath::Iptables(_) => "iptables",
        }
    }

    /// A new agent's maps are private until its programs attach, but rules
    /// are live as soon as they are applied: those wait for the whole source.
    pub fn live_at_once(&self) -> bool {
        matches!(self, Datapath::Iptables(_))
    }

    /// This node's zone changed (topology hints).
    pub fn set_zone(&mut self, zone: Option<String>) {
        if let Datapath::Iptables(backend) = self {
            backend.set_zone(zone);
        }
    }

    /// Brings the datapath to `plan` (eBPF) or `model` (iptables, which
    /// renders kube-proxy's rules from it); only the frontends in `dirty`
    /// may differ from the last successful sync (`None`: any may). Counts
    /// what went wrong.
    pub fn sync(
        &mut self,
        model: &Model,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        metrics: &Metrics,
    ) -> anyhow::Result<Synced> {
        match self {
            Datapath::Ebpf(dp) => {
                let report = dp.backend.sync(plan, dirty).inspect_err(|_| {
                    metrics.map_update_failures.fetch_add(1, Relaxed);
                })?;
                let state = dp.backend.state();
                let backends = state.backend_count();
                metrics.set_map_entries(&state.map_entries());
                tracing::info!(
                    frontends = state.frontend_count(),
                    backends = state.backend_count(),
                    writes = report.writes,
                    "datapath synced"
                );
                match dp.backend.flush_udp_flows(&report.removed_backends) {
                    Ok(0) => {}
                    Ok(flushed) => {
                        tracing::info!(flushed, "UDP flows to removed endpoints deleted")
                    }
                    Err(e) => tracing::warn!(error = %e, "could not flush UDP flows"),
                }
                Ok(Synced { full: None, backends })
            }
            Datapath::Iptables(backend) => {
                let report = backend.sync(model).inspect_err(|err| {
                    if let IptablesError::Restore { full, .. } = err {
                        metrics.restore_failures.fetch_add(1, Relaxed);
                        if !full {
                            metrics.partial_restore_failures.fetch_add(1, Relaxed);
                        }
                    }
                })?;
                tracing::info!(
                    full = report.full,
                    chains_written = report.chains_written,
                    chains_deleted = report.chains_deleted,
                    "rules synced"
                );
                metrics.set_iptables_rules(&report.rules_written);
                if report.flows_flushed > 0 {
                    tracing::info!(
                        sets = report.flows_flushed,
                        "stale UDP conntrack entries deleted"
                    );
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
                let backends: BTreeSet<_> =
                    plan.frontends.values().flat_map(|f| &f.backends).map(|b| b.addr).collect();
                Ok(Synced { full: Some(report.full), backends: backends.len() })
            }
        }
    }

    /// Between syncs, at every poll (`polls` counts them). eBPF: collects
    /// expired flows. iptables: checks the canary. Returns whether a (full)
    /// resync is due.
    pub fn look_after(&mut self, polls: u32, metrics: &Metrics) -> bool {
        match self {
            Datapath::Ebpf(dp) => {
                if Instant::now() >= dp.next_gc {
                    let collected = dp.backend.collect_conntrack();
                    let left = collected.as_ref().map_or(0, |(_, left)| *left);
                    dp.next_gc = Instant::now() + gc_interval(left);
                    match collected {
                        Ok((deleted, left)) => {
                            metrics.conntrack_entries.store(left as u64, Relaxed);
                            metrics.set_map_entries(&[("CONNTRACK", left)]);
                            if deleted > 0 {
                                tracing::debug!(deleted, left, "expired flows collected");
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "conntrack collection failed"),
                    }
                }
                false
            }
            Datapath::Iptables(backend) => {
                if !polls.is_multiple_of(CANARY_EVERY) {
                    return false;
                }
                // mangle's canary is cheap to check; nat's and filter's
                // (a copy of the whole table with iptables-legacy) rarely.
                let thorough = polls.is_multiple_of(CANARY_EVERY * THOROUGH_CANARY_EVERY);
                match backend.canary_gone(thorough) {
                    Ok(Some(table)) => {
                        tracing::warn!(
                            table,
                            "{CANARY} is gone: another program flushed the rules; full resync"
                        );
                        metrics.canary_resyncs.fetch_add(1, Relaxed);
                        true
                    }
                    Ok(None) => backend.full_sync_due(),
                    Err(e) => {
                        tracing::warn!("could not check {CANARY}: {e}");
                        false
                    }
                }
            }
        }
    }

    /// Whether the datapath follows interfaces as they come and go (eBPF:
    /// the per-packet programs go on node- and pod-facing ones).
    pub fn follows_interfaces(&self) -> bool {
        matches!(self, Datapath::Ebpf(_))
    }

    /// eBPF: attaches the per-packet programs to the interfaces wanted now
    /// and detaches them from those no longer wanted (or gone).
    pub fn scan_interfaces(&mut self, node_ips: &[Ipv4Addr]) {
        if let Datapath::Ebpf(dp) = self {
            match sys::interfaces() {
                Ok(interfaces) => {
                    let wanted = node::tc_interfaces(&interfaces, node_ips, &dp.pod_interfaces);
                    dp.backend.set_tc_interfaces(&dp.root, &wanted);
                }
                Err(e) => tracing::warn!(error = %e, "could not list interfaces"),
            }
        }
    }

    /// Makes the datapath serve: attaches the programs (eBPF; rules serve
    /// as soon as they are applied).
    pub fn activate(&mut self, node_ips: &[Ipv4Addr], metrics: &Metrics) -> anyhow::Result<()> {
        if let Datapath::Ebpf(dp) = self {
            let interfaces = sys::interfaces().context("listing interfaces")?;
            let wanted = node::tc_interfaces(&interfaces, node_ips, &dp.pod_interfaces);
            dp.backend
                .activate(&dp.cgroup, &wanted, &dp.root)
                .with_context(|| format!("attaching to {} and {wanted:?}", dp.cgroup.display()))?;
            metrics.set_datapath(ebpf::CounterReader::open(&dp.root)?);
            let carried = dp.backend.carried().iter().map(|(m, c)| (*m, c.as_str())).collect();
            metrics.set_carried(carried);
        }
        Ok(())
    }

    /// Removes what the other mode left: eBPF programs translate in front
    /// of the rules (so they go once the rules are in); rules would still
    /// catch host-network clients (so they go once the programs serve).
    pub fn remove_other_mode(&self, pins: &Path) -> anyhow::Result<()> {
        match self {
            Datapath::Ebpf(_) => {
                let chains = iptables::cleanup(&mut System)?;
                if chains > 0 {
                    tracing::info!(chains, "removed the iptables mode's rules");
                }
            }
            Datapath::Iptables(_) => {
                let (pins, filters) = cleanup_ebpf(pins)?;
                if pins + filters > 0 {
                    tracing::info!(pins, filters, "removed the eBPF mode's programs");
                }
            }
        }
        Ok(())
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
    let max = args.bpf_lb_map_max;
    let sizes = MapSizes { services: max, backends: max, rev_nat: max };
    let mut backend =
        EbpfBackend::load_with(tc_mode, sizes, Some(&root)).context("loading the BPF programs")?;
    backend
        .configure(&datapath_config(args, &node.ips))
        .context("writing the datapath settings")?;
    let (min, max) = args.snat_port_range;
    if let Some((low, high)) = sys::ephemeral_ports()
        && min <= high
        && low <= max
    {
        tracing::warn!(
            "--snat-port-range {min}-{max} overlaps the node's ephemeral ports {low}-{high}: reserving them leaves fewer (or none) for the node's own connections, this agent's to the API server included"
        );
    }
    sys::reserve_ports(min, max).context("reserving the SNAT port range")?;
    tracing::info!(?tc_mode, cgroup = %cgroup.display(), bpffs = %root.display(), "BPF programs loaded");
    let pod_interfaces = args.pod_interfaces.clone();
    Ok(Ebpf { backend, cgroup, root, pod_interfaces, next_gc: Instant::now() })
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

/// What the iptables rules depend on besides the services.
pub fn render_options(node: &Node, args: &NodeArgs, nfacct: bool) -> render::Options {
    render::Options {
        node_name: node.name.clone(),
        zone: node.zone.clone(),
        node_ips: node.ips.clone(),
        nodeport_addresses: args.nodeport_addresses.clone(),
        cluster_cidr: args.cluster_cidr,
        masquerade_all: args.masquerade_all,
        localhost_nodeports: args.iptables_localhost_nodeports,
        nfacct,
        random_fully: true,
        conntrack_tcp_liberal: std::fs::read_to_string(
            "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
        )
        .is_ok_and(|v| v.trim() != "0"),
    }
}

/// Removes the eBPF mode's pins under `root` and its clsact filters;
/// returns how many of each.
pub fn cleanup_ebpf(root: &Path) -> anyhow::Result<(usize, usize)> {
    let removed = ebpf::remove_pins(root)?;
    match std::fs::remove_dir(root) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", root.display()));
        }
        _ => {}
    }
    Ok((removed, ebpf::remove_tc_filters()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_collection_slows_down_as_the_map_fills() {
        assert_eq!(gc_interval(0), GC_MIN);
        assert_eq!(gc_interval(2_000), GC_MIN, "a small map is collected every second");
        assert_eq!(gc_interval(100_000), Duration::from_secs(10));
        assert_eq!(gc_interval(1_000_000), GC_MAX);
    }
}
