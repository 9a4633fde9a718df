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
    /// eBPF mode with `--bpf-lb-acceleration native`: the nodes' uplinks
    /// run the XDP program too.
    pub xdp: bool,
}

impl Setup {
    pub const EBPF: Setup = Setup::of(Mode::Ebpf, Source::Manifests);
    pub const IPTABLES: Setup = Setup::of(Mode::Iptables, Source::Manifests);
    pub const NFTABLES: Setup = Setup::of(Mode::Nftables, Source::Manifests);
    pub const API: Setup = Setup::of(Mode::Ebpf, Source::ApiServer);
    pub const XDP: Setup = Setup { xdp: true, ..Setup::EBPF };

    /// Agents in `mode` reading `source`, without XDP.
    pub const fn of(mode: Mode, source: Source) -> Setup {
        Setup { mode, source, xdp: false }
    }
}
