//! What the eBPF mode is told to do (`commands::run` builds it from the
//! flags and `--config`): where it pins and attaches, what it translates
//! and how long it keeps flows.

use std::{path::PathBuf, time::Duration};

use clap::ValueEnum;

use super::sock_end::SocketDestroy;
use crate::backend::{TrafficRules, conntrack_limit::ConntrackLimit};

/// The eBPF mode's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// bpffs directory of the pinned maps and links.
    pub bpffs_root: PathBuf,
    /// The cgroup v2 the socket programs attach to (`None`: the cgroup2
    /// mount's root).
    pub cgroup: Option<PathBuf>,
    pub tc_attach: TcAttachChoice,
    /// Name prefixes of pod-facing interfaces.
    pub pod_interfaces: Vec<String>,
    pub pod_interface_programs: PodInterfacePrograms,
    /// The socket programs translate for the node's network namespace only.
    pub socket_lb_host_netns_only: bool,
    pub socket_destroy: SocketDestroy,
    /// TCP sockets connected to a removed endpoint are ended too.
    pub terminate_tcp_on_endpoint_removal: bool,
    /// The most entries a service map may grow to.
    pub map_max: u32,
    /// Source ports SNAT allocates from (reserved on the node).
    pub snat_port_range: (u16, u16),
    pub traffic: TrafficRules,
    pub timeouts: FlowTimeouts,
    /// What the state maps are sized for (`state_sizes`).
    pub conntrack: ConntrackLimit,
    pub log_level: BpfLogLevel,
    /// Entries of each Maglev table.
    pub maglev_table_size: u32,
    /// Whether node interfaces run the XDP program.
    pub acceleration: Acceleration,
}

/// Idle timeouts of the flows translated per packet.
#[derive(Clone, Copy, Debug)]
pub struct FlowTimeouts {
    pub tcp_established: Duration,
    pub tcp_close_wait: Duration,
    pub tcp_time_wait: Duration,
    pub udp: Duration,
}

/// What the per-packet programs do on pod-facing interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PodInterfacePrograms {
    /// `replies` where the socket programs cover every pod (attached to the
    /// cgroup2 root, for every network namespace), `full` otherwise
    Auto,
    /// What they do on node interfaces: new flows to frontends (ClusterIP
    /// traffic that escaped the socket LB, hairpin), both directions
    Full,
    /// Only replies of per-packet flows to pods here (NodePort, externalIP,
    /// LB IP), at ingress: pods' own connections are the socket LB's
    Replies,
}

/// Whether external flows are forwarded at the driver hook (XDP) of node
/// interfaces, before the stack: Cilium's `bpf-lb-acceleration`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Acceleration {
    /// No XDP: tc does it all
    #[default]
    Disabled,
    /// XDP in driver mode on every interface holding a node address; the
    /// agent fails where a driver cannot
    Native,
    /// XDP in driver mode where the driver can; tc alone elsewhere (logged)
    BestEffort,
}

/// How the per-packet program is attached to interfaces, as asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TcAttachChoice {
    /// TCX links on kernels 6.6 and later, clsact filters before
    Auto,
    /// TCX links, pinned: they outlive the agent
    Tcx,
    /// clsact filters (netlink): removed when the agent stops
    Netlink,
}

/// Which decision records the BPF programs write into the agent's log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum BpfLogLevel {
    /// None (a compare per log point)
    #[default]
    Off,
    /// Refusals and drops: no endpoint, a source outside the ranges, no SNAT port
    Info,
    /// Also every new flow's backend (and why), SNAT, packets a flow lost
    Debug,
    /// Also connects and packets that are no service's (very verbose)
    Trace,
}

impl BpfLogLevel {
    /// The word the programs read (`proxy_common::log_level`).
    pub fn word(self) -> u8 {
        use proxy_common::log_level;
        match self {
            BpfLogLevel::Off => log_level::OFF,
            BpfLogLevel::Info => log_level::INFO,
            BpfLogLevel::Debug => log_level::DEBUG,
            BpfLogLevel::Trace => log_level::TRACE,
        }
    }
}
