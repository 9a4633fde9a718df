//! The code that touches the kernel, behind one face: [`Datapath`] is what
//! the agent's loop needs from a mode (as kube-proxy's `proxy.Provider` sits
//! between its loop and its proxiers). [`start`] chooses the mode and builds
//! its datapath; nothing else names a mode.

pub mod ebpf;
pub mod iptables;

use std::{collections::BTreeSet, net::IpAddr, time::Duration};

use crate::{
    cli::{ProxyMode, RunArgs},
    metrics::Metrics,
    model::Model,
    plan::{Frontend, Node, Plan},
    probe,
};

/// What a successful sync did, for the metrics.
#[derive(Debug, Default)]
pub struct Synced {
    /// Distinct backends served.
    pub backends: usize,
}

/// A datapath as the agent's loop drives it (`Send`: it is made on a
/// blocking thread, beside the source's first lists).
pub trait Datapath: Send {
    /// The mode's name, as `/proxyMode` and the logs say it.
    fn mode(&self) -> &'static str;

    /// Whether what a sync writes serves at once (rules), rather than once
    /// the datapath takes over (a new agent's maps are private until its
    /// programs attach): a live datapath waits for the whole source.
    fn live_at_once(&self) -> bool;

    /// Whether a previous agent's datapath of this mode was serving when
    /// this one started (pins, rules): then an unreadable source is waited
    /// for a while before taking over (`--unreadable-source-grace`).
    fn replaces_previous(&self) -> bool;

    /// The default `--min-sync-period` for this mode.
    fn min_sync_period(&self) -> Duration;

    /// This node's zone changed (topology hints).
    fn set_zone(&mut self, _zone: Option<String>) {}

    /// Brings the datapath to `plan` (or `model`, which iptables renders
    /// kube-proxy's rules from); only the frontends in `dirty` may differ
    /// from the last successful sync (`None`: any may). Counts what went
    /// wrong.
    fn sync(
        &mut self,
        model: &Model,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        metrics: &Metrics,
    ) -> anyhow::Result<Synced>;

    /// Between syncs, at every poll (`polls` counts them); returns whether
    /// a full resync is due.
    fn look_after(&mut self, polls: u32, metrics: &Metrics) -> bool;

    /// Whether it serves the IPv6 family's service ports.
    fn serves_ipv6(&self) -> bool {
        false
    }

    /// Whether the datapath follows interfaces as they come and go.
    fn follows_interfaces(&self) -> bool {
        false
    }

    /// Follows the interfaces of now (see `follows_interfaces`).
    fn scan_interfaces(&mut self, _node_ips: &[IpAddr]) {}

    /// Takes over: makes this agent's datapath the one that serves.
    fn take_over(&mut self, node_ips: &[IpAddr], metrics: &Metrics) -> anyhow::Result<()>;

    /// Removes what the other mode left (once this one serves).
    fn remove_other_mode(&self) -> anyhow::Result<()>;
}

/// The datapath of the mode asked for, or for `auto` of the mode the kernel
/// can run, loaded (eBPF) or prepared (iptables).
pub fn start(args: &RunArgs, node: &Node) -> anyhow::Result<Box<dyn Datapath>> {
    Ok(match choose(args.proxy_mode) {
        ProxyMode::Iptables => Box::new(iptables::datapath::IptablesDatapath::new(args, node)),
        _ => Box::new(ebpf::datapath::EbpfDatapath::new(args, node)?),
    })
}

/// The mode to run: as asked, or for `auto` what the kernel can run.
fn choose(asked: ProxyMode) -> ProxyMode {
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
