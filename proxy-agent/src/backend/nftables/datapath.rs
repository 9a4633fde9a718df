//! The nftables mode as the agent's loop drives it: kube-proxy's nftables
//! ruleset ([`NftablesBackend`]) per family, and the other modes'
//! leftovers.
//!
//! As kube-proxy runs a proxier per family, there is a backend per family
//! the node has an address of: IPv4 always (its table serves ClusterIPs even
//! before the node has an address), IPv6 when a node address is IPv6.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::PathBuf,
    sync::atomic::Ordering::Relaxed,
    time::{Duration, Instant},
};

use super::{NftablesBackend, NftablesError, SyncReport, render, rules_gone};
use crate::{
    backend::{
        Datapath, Extent, Synced, TrafficRules,
        conntrack_limit::ConntrackLimit,
        ebpf, iptables,
        iptables::exec::{ExecError, System},
        rule_families,
        rule_modes::{RuleOptions, raise_conntrack_max, synced, timed_sync},
    },
    metrics::Metrics,
    model::{IpFamily, Model},
    plan::{Frontend, Node, Plan},
};

/// The tables are looked for every this many looks (200 ms apart).
const TABLE_CHECK_EVERY: u32 = 10;
/// Their rules are checked, beside the loop, at most this share of the
/// time: at every look while that is cheap, less often where nft 1.0.6
/// reads every rule to list one chain (every 36 s at 10,000 services, 0.9 s
/// a check; 37 s at 100,000).
const RULES_CHECK_SHARE: u32 = 40;

/// A check of the tables' rules running in a thread of its own, so that a
/// slow one delays no sync.
struct RulesCheck {
    started: Instant,
    thread: std::thread::JoinHandle<Vec<(IpFamily, Result<bool, ExecError>)>>,
}

impl RulesCheck {
    fn start(families: Vec<IpFamily>) -> Self {
        let check = move || {
            let runner = &mut System::default();
            families.into_iter().map(|f| (f, rules_gone(runner, f))).collect()
        };
        RulesCheck { started: Instant::now(), thread: std::thread::spawn(check) }
    }
}

/// The nftables mode's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    pub traffic: TrafficRules,
    /// Where the eBPF mode pins, to remove its datapath.
    pub bpffs_root: PathBuf,
    /// What the kernel's conntrack table is raised to.
    pub conntrack: ConntrackLimit,
}

pub struct NftablesDatapath {
    /// One per family served, IPv4 first.
    backends: Vec<NftablesBackend<System>>,
    /// The eBPF mode's pins, removed once the ruleset serves.
    pins: PathBuf,
    /// A previous agent's table (or eBPF datapath) was serving at start.
    previous: bool,
    /// Whether the log said that Maglev and DSR are the eBPF mode's (once).
    ebpf_only_told: bool,
    /// The kernel's conntrack maximum to raise once the ruleset serves
    /// (its NAT loads `nf_conntrack`, whose settings appear with it).
    conntrack_max: Option<u32>,
    /// When the tables' rules are checked next (their presence is at
    /// every look), and the check running.
    next_rules_check: Instant,
    rules_check: Option<RulesCheck>,
}

impl NftablesDatapath {
    pub fn new(settings: &Settings, node: &Node) -> Self {
        let families = rule_families(node);
        tracing::info!(?families, "nftables tables");
        let mut backends: Vec<_> = families
            .into_iter()
            .map(|family| {
                let options = render_options(node, &settings.traffic, family);
                NftablesBackend::new(System::default(), options)
            })
            .collect();
        let previous = backends.first_mut().is_some_and(|b| b.table_present())
            || ebpf::pinned(&settings.bpffs_root);
        NftablesDatapath {
            backends,
            pins: settings.bpffs_root.clone(),
            previous,
            ebpf_only_told: false,
            conntrack_max: settings.conntrack.max(crate::sys::cpu_count()),
            next_rules_check: Instant::now(),
            rules_check: None,
        }
    }
}

impl Datapath for NftablesDatapath {
    fn mode(&self) -> &'static str {
        "nftables"
    }

    fn replaces_previous(&self) -> bool {
        self.previous
    }

    fn live_at_once(&self) -> bool {
        true
    }

    /// kube-proxy's default: a transaction is cheap, but not free.
    fn min_sync_period(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn set_zone(&mut self, zone: Option<String>) {
        self.backends.iter_mut().for_each(|b| b.set_zone(zone.clone()));
    }

    /// On a node with an IPv6 address (its table is written then).
    fn serves_ipv6(&self) -> bool {
        self.backends.iter().any(|b| b.family() == IpFamily::V6)
    }

    /// kube-proxy's nftables mode serves no NodePort on 127.0.0.0/8: its
    /// rules exclude loopback destinations.
    fn serves_localhost_nodeports(&self) -> bool {
        false
    }

    /// Renders the ruleset from `model`; the plan only counts backends.
    fn sync(
        &mut self,
        model: &Model,
        plan: &Plan,
        _dirty: Option<&BTreeSet<Frontend>>,
        // Always whole: its rules are live (`live_at_once`).
        _extent: Extent,
        metrics: &Metrics,
    ) -> anyhow::Result<Synced> {
        for backend in &mut self.backends {
            let family = backend.family();
            let refused = |err: &NftablesError| match err {
                NftablesError::Apply { full, .. } => Some(*full),
                _ => None,
            };
            let report = timed_sync(family, metrics, || backend.sync(model), |r| r.full, refused)?;
            report_sync(family, &report, metrics);
        }
        Ok(synced(plan, &mut self.ebpf_only_told, "the nftables ruleset's rules"))
    }

    /// Looks for each family's table, and checks its rules beside the loop
    /// ([`RULES_CHECK_SHARE`]): a full resync is due when one was deleted
    /// or flushed, or when a backend asks for one; a sync, when chains
    /// flushed a while ago are still to be deleted (after a change, or an
    /// older agent's chains after the first sync).
    fn look_after(&mut self, polls: u32, metrics: &Metrics) -> bool {
        if !polls.is_multiple_of(TABLE_CHECK_EVERY) {
            return false;
        }
        let lost = |family: IpFamily, what: &'static str| {
            tracing::warn!(%family, "table kube-proxy was {what} by another program; full resync");
            metrics.canary_resyncs.fetch_add(1, Relaxed);
        };
        let mut due = false;
        for backend in &mut self.backends {
            let family = backend.family();
            due |= match backend.table_gone() {
                Ok(true) => {
                    lost(family, "deleted");
                    true
                }
                Ok(false) => backend.full_sync_due() || backend.stale_chains_due(),
                Err(e) => {
                    tracing::warn!(%family, "could not look for table kube-proxy: {e}");
                    false
                }
            };
        }
        due | self.rules_checked(&lost)
    }

    /// The ruleset serves as soon as it is applied; the kernel's conntrack
    /// table is raised then, as in the iptables mode.
    fn take_over(&mut self, _node_ips: &[IpAddr], _metrics: &Metrics) -> anyhow::Result<()> {
        if let Some(max) = self.conntrack_max.take() {
            raise_conntrack_max(max);
        }
        Ok(())
    }

    /// The eBPF mode's programs (which translate in front of the ruleset)
    /// and the iptables mode's rules go once the ruleset is in.
    fn remove_other_mode(&self) -> anyhow::Result<()> {
        let (pins, filters) = ebpf::cleanup(&self.pins)?;
        if pins + filters > 0 {
            tracing::info!(pins, filters, "removed the eBPF mode's programs");
        }
        let chains = iptables::cleanup_every_backend()?;
        if chains > 0 {
            tracing::info!(chains, "removed the iptables mode's rules");
        }
        Ok(())
    }
}

impl NftablesDatapath {
    /// Takes the rules check's result when it has finished (a full resync
    /// due where a table lost its rules, `lost` telling it), or starts the
    /// next one when it is time.
    fn rules_checked(&mut self, lost: &dyn Fn(IpFamily, &'static str)) -> bool {
        let Some(check) = self.rules_check.take_if(|c| c.thread.is_finished()) else {
            if self.rules_check.is_none() && Instant::now() >= self.next_rules_check {
                let families = self.backends.iter().map(|b| b.family()).collect();
                self.rules_check = Some(RulesCheck::start(families));
            }
            return false;
        };
        self.next_rules_check = Instant::now() + check.started.elapsed() * RULES_CHECK_SHARE;
        let mut due = false;
        for (family, gone) in check.thread.join().unwrap_or_default() {
            let backend = self.backends.iter_mut().find(|b| b.family() == family);
            match (gone, backend) {
                // Not told twice: a deleted table was, by the look for it.
                (Ok(true), Some(backend)) if !backend.full_sync_due() => {
                    lost(family, "flushed");
                    backend.lost_its_rules();
                    due = true;
                }
                (Err(e), _) => {
                    tracing::warn!(%family, "could not check table kube-proxy's rules: {e}")
                }
                _ => {}
            }
        }
        due
    }
}

/// Logs and counts what one family's sync did.
fn report_sync(family: IpFamily, report: &SyncReport, metrics: &Metrics) {
    tracing::info!(
        %family,
        full = report.full,
        chains_written = report.chains_written,
        chains_deleted = report.chains_deleted,
        elements_written = report.elements_written,
        "nftables synced"
    );
    if let Some(e) = &report.cleanup_error {
        metrics.rules(family).cleanup_failures.fetch_add(1, Relaxed);
        tracing::warn!(%family, "could not delete stale chains (a full sync will): {e}");
    }
    report.flows.report(metrics);
}

/// What the nftables ruleset of `family` depends on besides the services.
pub fn render_options(node: &Node, traffic: &TrafficRules, family: IpFamily) -> render::Options {
    RuleOptions::new(node, traffic, family)
}
