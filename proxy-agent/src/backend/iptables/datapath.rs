//! The iptables mode as the agent's loop drives it: kube-proxy's rules
//! ([`IptablesBackend`]), their canary, and the eBPF mode's leftovers.
//!
//! As kube-proxy runs a proxier per family, there is a backend per family
//! the node has an address of: IPv4 always (its rules serve ClusterIPs even
//! before the node has an address), IPv6 when a node address is IPv6
//! (`ip6tables-restore`; its stale conntrack entries with `conntrack -f
//! ipv6`).

use std::{
    collections::BTreeSet, net::IpAddr, path::PathBuf, sync::atomic::Ordering::Relaxed,
    time::Duration,
};

use super::{
    CANARY, IptablesBackend, IptablesError,
    counters::RuleCounters,
    exec::{Runner as _, System, Xtables},
    render,
};
use crate::{
    backend::{
        Datapath, Extent, Synced, TrafficRules,
        conntrack_limit::ConntrackLimit,
        ebpf, nftables, rule_families,
        rule_modes::{RuleOptions, raise_conntrack_max, synced, timed_sync},
    },
    metrics::Metrics,
    model::{IpFamily, Model},
    plan::{Frontend, Node, Plan},
    sys,
};

/// mangle's canary chain is checked every this many looks...
const CANARY_EVERY: u32 = 10;
/// ...and every canary once in this many checks.
const THOROUGH_CANARY_EVERY: u32 = 15;

/// The iptables mode's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The iptables implementation to program.
    pub xtables: Xtables,
    pub traffic: TrafficRules,
    /// Where the eBPF mode pins, to remove its datapath.
    pub bpffs_root: PathBuf,
    /// What the kernel's conntrack table is raised to.
    pub conntrack: ConntrackLimit,
}

pub struct IptablesDatapath {
    /// One per family served, IPv4 first.
    backends: Vec<IptablesBackend<System>>,
    /// The eBPF mode's pins, removed once the rules serve.
    pins: PathBuf,
    /// A previous agent's rules (or eBPF datapath, which serves in front
    /// of the rules until this agent serves) were in place at start.
    previous: bool,
    /// Whether the log said that Maglev and DSR are the eBPF mode's (once).
    ebpf_only_told: bool,
    /// The kernel's conntrack maximum to raise once the rules serve (they
    /// load `nf_conntrack`, whose settings appear with it).
    conntrack_max: Option<u32>,
}

impl IptablesDatapath {
    pub fn new(settings: &Settings, node: &Node) -> Self {
        let options = |family| render_options(node, &settings.traffic, false, family);
        if options(IpFamily::V4).localhost_nodeports() {
            // As kube-proxy: NodePorts on 127.0.0.1 need DNAT of loopback traffic.
            if let Err(e) = sys::set_sysctl("net/ipv4/conf/all/route_localnet", "1") {
                tracing::warn!("could not enable route_localnet (localhost NodePorts): {e}");
            }
        }
        let xtables = settings.xtables.resolve(&mut System::default());
        let families = rule_families(node);
        // As kube-proxy: `--random-fully` only where iptables has it, else
        // every restore would be refused.
        let version = System::new(xtables).run("iptables", &["--version"], None);
        let random_fully = version.as_deref().is_ok_and(super::random_fully);
        if !random_fully {
            tracing::warn!(version = ?version.as_deref().map(str::trim), "MASQUERADE without --random-fully (iptables 1.6.2+ has it)");
        }
        tracing::info!(backend = ?xtables, ?families, "iptables implementation");
        let mut backends: Vec<_> = families
            .into_iter()
            .map(|family| {
                let options = render::Options { random_fully, ..options(family) };
                IptablesBackend::new(System::new(xtables).for_family(family), options)
            })
            .collect();
        let previous = backends.first_mut().is_some_and(|b| b.rules_present())
            || ebpf::pinned(&settings.bpffs_root);
        let pins = settings.bpffs_root.clone();
        let conntrack_max = settings.conntrack.max(sys::cpu_count());
        IptablesDatapath { backends, pins, previous, ebpf_only_told: false, conntrack_max }
    }
}

impl IptablesDatapath {
    /// The per-service counters of the rules, each family's.
    fn rule_counters(&self) -> RuleCounters {
        RuleCounters::new(self.backends.iter().map(|b| *b.runner()).collect())
    }
}

impl Datapath for IptablesDatapath {
    fn mode(&self) -> &'static str {
        "iptables"
    }

    fn replaces_previous(&self) -> bool {
        self.previous
    }

    fn live_at_once(&self) -> bool {
        true
    }

    /// iptables-restore is costly: kube-proxy's default.
    fn min_sync_period(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn set_zone(&mut self, zone: Option<String>) {
        self.backends.iter_mut().for_each(|b| b.set_zone(zone.clone()));
    }

    /// On a node with an IPv6 address (its rules are written then).
    fn serves_ipv6(&self) -> bool {
        self.backends.iter().any(|b| b.family() == IpFamily::V6)
    }

    /// Renders the rules from `model`; the plan only counts backends.
    fn sync(
        &mut self,
        model: &Model,
        plan: &Plan,
        _dirty: Option<&BTreeSet<Frontend>>,
        // Always whole: its rules are live (`live_at_once`).
        _extent: Extent,
        metrics: &Metrics,
    ) -> anyhow::Result<Synced> {
        // The rules' counters restart with the rules a sync writes.
        metrics.fold_service_stats(|| Box::new(self.rule_counters()));
        for backend in &mut self.backends {
            let family = backend.family();
            let refused = |err: &IptablesError| match err {
                IptablesError::Restore { full, .. } => Some(*full),
                _ => None,
            };
            let report = timed_sync(family, metrics, || backend.sync(model), |r| r.full, refused)?;
            report_sync(family, &report, metrics);
        }
        Ok(synced(plan, &mut self.ebpf_only_told, "the iptables rules"))
    }

    /// Checks the canary chains of each family: a full resync is due when
    /// one is gone, or when a backend asks for one.
    fn look_after(&mut self, polls: u32, metrics: &Metrics) -> bool {
        if !polls.is_multiple_of(CANARY_EVERY) {
            return false;
        }
        // mangle's canary is cheap to check; nat's and filter's (a copy of
        // the whole table with iptables-legacy) rarely.
        let thorough = polls.is_multiple_of(CANARY_EVERY * THOROUGH_CANARY_EVERY);
        let mut due = false;
        for backend in &mut self.backends {
            due |= look_after_family(backend, thorough, metrics);
        }
        due
    }

    /// Rules serve as soon as they are applied; the kernel's conntrack
    /// table is raised then.
    fn take_over(&mut self, _node_ips: &[IpAddr], _metrics: &Metrics) -> anyhow::Result<()> {
        if let Some(max) = self.conntrack_max.take() {
            raise_conntrack_max(max);
        }
        Ok(())
    }

    /// eBPF programs translate in front of the rules, and the nftables
    /// mode's table beside them: they go once the rules are in.
    fn remove_other_mode(&self) -> anyhow::Result<()> {
        let (pins, filters) = ebpf::cleanup(&self.pins)?;
        if pins + filters > 0 {
            tracing::info!(pins, filters, "removed the eBPF mode's programs");
        }
        let tables = nftables::cleanup(&mut System::default())?;
        if tables > 0 {
            tracing::info!(tables, "removed the nftables mode's tables");
        }
        Ok(())
    }
}

/// Logs and counts what one family's sync did.
fn report_sync(family: IpFamily, report: &super::SyncReport, metrics: &Metrics) {
    tracing::info!(
        %family,
        full = report.full,
        chains_written = report.chains_written,
        chains_deleted = report.chains_deleted,
        "rules synced"
    );
    metrics.rules(family).set_written(&report.rules_written);
    report.flows.report(metrics);
}

/// Whether one family's rules need a full resync: its canary is gone (then
/// counted and logged) or its backend asks for one.
fn look_after_family(
    backend: &mut IptablesBackend<System>,
    thorough: bool,
    metrics: &Metrics,
) -> bool {
    match backend.canary_gone(thorough) {
        Ok(Some(table)) => {
            let family = backend.family();
            tracing::warn!(
                table,
                %family,
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

/// What the iptables rules of `family` depend on besides the services.
pub fn render_options(
    node: &Node,
    traffic: &TrafficRules,
    nfacct: bool,
    family: IpFamily,
) -> render::Options {
    render::Options {
        rules: RuleOptions::new(node, traffic, family),
        localhost_nodeports: node.serves_localhost_nodeports(),
        nfacct,
        // kube-proxy's for any iptables of these years: the running mode
        // asks its iptables (`random_fully`).
        random_fully: true,
        conntrack_tcp_liberal: std::fs::read_to_string(
            "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
        )
        .is_ok_and(|v| v.trim() != "0"),
        // Tried: a kernel without the sctp match refuses them, and the
        // backend leaves SCTP ports out from then on.
        sctp: true,
    }
}
