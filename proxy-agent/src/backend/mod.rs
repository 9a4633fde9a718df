//! The code that touches the kernel, behind one face: [`Datapath`] is what
//! the agent's loop needs from a mode (as kube-proxy's `proxy.Provider` sits
//! between its loop and its proxiers). [`start`] chooses the mode and builds
//! its datapath; nothing else names a mode.

pub mod categorize;
pub mod conntrack_flows;
pub mod conntrack_limit;
pub mod ebpf;
pub mod iptables;
pub mod nftables;
pub mod probe;
pub mod rule_modes;

use std::{collections::BTreeSet, net::IpAddr, time::Duration};

use clap::ValueEnum;

use crate::{
    metrics::Metrics,
    model::{Cidr, IpFamily, Model},
    plan::{Frontend, Node, Plan},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProxyMode {
    /// eBPF when the kernel can run it (see `probe`), else nftables where
    /// nft takes its ruleset, else iptables
    Auto,
    /// BPF programs: socket load balancing on cgroup hooks, per-packet
    /// translation in tc
    Ebpf,
    /// kube-proxy's iptables rules, applied with iptables-restore
    Iptables,
    /// kube-proxy's nftables ruleset, applied with nft
    Nftables,
}

/// What the backend is told to do: the mode, and each mode's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    pub mode: ProxyMode,
    pub ebpf: ebpf::Settings,
    pub iptables: iptables::datapath::Settings,
    pub nftables: nftables::datapath::Settings,
}

/// The node's traffic rules, as both modes apply them (kube-proxy's
/// `--nodeport-addresses`, `--cluster-cidr`, `--masquerade-all`).
#[derive(Clone, Debug, Default)]
pub struct TrafficRules {
    /// NodePorts are served only on node addresses within these (none: all).
    pub nodeport_addresses: Vec<Cidr>,
    /// The pods' CIDRs, at most one per family: ClusterIP traffic from
    /// other sources is masqueraded.
    pub cluster_cidrs: Vec<Cidr>,
    pub masquerade_all: bool,
}

impl TrafficRules {
    /// The cluster CIDR of this family (the first one given).
    pub fn cluster_cidr(&self, family: IpFamily) -> Option<Cidr> {
        self.cluster_cidrs.iter().copied().find(|c| c.family() == family)
    }
}

/// How much of the source a sync holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Extent {
    /// Everything the source holds.
    Whole,
    /// What a source still being read holds so far (given only to a
    /// datapath that is not [`Datapath::live_at_once`], before it serves):
    /// nothing may serve from it before a sync of the whole.
    Partial {
        /// How much more the whole source holds, when it can tell.
        scale: Option<Scale>,
    },
}

/// How many times more frontends, and more endpoints, a whole source holds
/// than a part of it (at least 1 each).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scale {
    pub frontends: f64,
    pub endpoints: f64,
}

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
    /// kube-proxy's rules from), which holds the source to `extent`; only
    /// the frontends in `dirty` may differ from the last successful sync
    /// (`None`: any may). Counts what went wrong.
    fn sync(
        &mut self,
        model: &Model,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        extent: Extent,
        metrics: &Metrics,
    ) -> anyhow::Result<Synced>;

    /// Between syncs, at every poll (`polls` counts them); returns whether
    /// a full resync is due.
    fn look_after(&mut self, polls: u32, metrics: &Metrics) -> bool;

    /// Whether it serves the IPv6 family's service ports.
    fn serves_ipv6(&self) -> bool {
        false
    }

    /// Whether it can serve NodePorts on 127.0.0.0/8 to the node's own
    /// clients (`Node::serves_localhost_nodeports`), where asked to.
    fn serves_localhost_nodeports(&self) -> bool {
        true
    }

    /// Whether the datapath follows interfaces as they come and go.
    fn follows_interfaces(&self) -> bool {
        false
    }

    /// Follows the interfaces of now (see `follows_interfaces`).
    /// `plan`: what the datapath serves (which pods back what).
    fn scan_interfaces(&mut self, _node_ips: &[IpAddr], _plan: &Plan) {}

    /// Takes over: makes this agent's datapath the one that serves.
    fn take_over(&mut self, node_ips: &[IpAddr], metrics: &Metrics) -> anyhow::Result<()>;

    /// Removes what the other mode left (once this one serves).
    fn remove_other_mode(&self) -> anyhow::Result<()>;
}

/// The families a rule-based mode writes rules for, as kube-proxy runs a
/// proxier per family: IPv4 always (its rules serve ClusterIPs even before
/// the node has an address), IPv6 when the node has an IPv6 address.
pub fn rule_families(node: &Node) -> Vec<IpFamily> {
    let v6 = node.ips.iter().any(|ip| IpFamily::of(*ip) == IpFamily::V6);
    if v6 { IpFamily::ALL.to_vec() } else { vec![IpFamily::V4] }
}

/// The datapath of the mode asked for, or for `auto` of the mode the kernel
/// can run, loaded (eBPF) or prepared (iptables).
pub fn start(settings: &Settings, node: &Node) -> anyhow::Result<Box<dyn Datapath>> {
    Ok(match choose(settings.mode) {
        ProxyMode::Iptables => {
            Box::new(iptables::datapath::IptablesDatapath::new(&settings.iptables, node))
        }
        ProxyMode::Nftables => {
            Box::new(nftables::datapath::NftablesDatapath::new(&settings.nftables, node))
        }
        _ => Box::new(ebpf::datapath::EbpfDatapath::new(&settings.ebpf, node)?),
    })
}

/// The mode to run: as asked, or for `auto` what the kernel can run.
fn choose(asked: ProxyMode) -> ProxyMode {
    if asked != ProxyMode::Auto {
        return asked;
    }
    let features = probe::run(probe::Reach::Mode);
    let detail = |missing: &str| {
        let found = features.iter().find(|f| f.name == missing);
        found.map(|f| f.detail.clone()).unwrap_or_default()
    };
    match probe::decide(&features) {
        probe::Decision::Ebpf => ProxyMode::Ebpf,
        probe::Decision::Nftables { missing } => {
            tracing::warn!(
                "eBPF mode unavailable, this kernel lacks: {missing} ({}); running in nftables mode",
                detail(missing)
            );
            ProxyMode::Nftables
        }
        probe::Decision::Iptables { missing } => {
            tracing::warn!(
                "eBPF mode unavailable, this kernel lacks: {missing} ({}); nftables mode unavailable: {}; running in iptables mode",
                detail(missing),
                detail(probe::NFTABLES)
            );
            ProxyMode::Iptables
        }
    }
}
