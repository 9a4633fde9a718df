//! How a lab runs its agents: the mode and where they read objects from.

/// The agent's `--proxy-mode`: the same scenarios run in each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Ebpf,
    Iptables,
    Nftables,
}

impl Mode {
    pub fn as_arg(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        }
    }

    /// Whether its datapath counts what it does (the eBPF mode's counters,
    /// the iptables rules' packet counts): kube-proxy's nftables rules
    /// count nothing.
    pub fn counts(self) -> bool {
        self != Mode::Nftables
    }

    /// A mode of netfilter rules (iptables, nftables): NAT in conntrack,
    /// the same answers on the wire.
    pub fn rules(self) -> bool {
        self != Mode::Ebpf
    }
}

/// Where the agents read Services and EndpointSlices from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The lab's manifest file (`--manifests`).
    Manifests,
    /// The test API server, fed the same manifest (`--kubeconfig`).
    ApiServer,
}

/// How a lab runs its agents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setup {
    pub mode: Mode,
    pub source: Source,
}

impl Setup {
    pub const EBPF: Setup = Setup { mode: Mode::Ebpf, source: Source::Manifests };
    pub const IPTABLES: Setup = Setup { mode: Mode::Iptables, source: Source::Manifests };
    pub const NFTABLES: Setup = Setup { mode: Mode::Nftables, source: Source::Manifests };
    pub const API: Setup = Setup { mode: Mode::Ebpf, source: Source::ApiServer };
}
