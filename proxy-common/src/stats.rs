//! Per-frontend traffic counters (`FRONTEND_STATS`, a per-CPU hash keyed by
//! reverse-NAT id): the programs create a frontend's entry at its first
//! event, so frontends without traffic cost nothing; the agent sums the
//! CPUs, folds the ids into service ports and deletes an id's entry when it
//! frees the id.

/// Why the datapath dropped a packet to a frontend. The index of
/// `FrontendStats::dropped`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// The source is outside the frontend's loadBalancerSourceRanges.
    SourceOutsideRanges = 0,
    /// Policy Local and no endpoint on this node.
    NoLocalEndpoint,
    /// No SNAT port was free for a masqueraded flow.
    NoSnatPort,
    /// The conntrack map refused the flow's entries.
    ConntrackFull,
    /// The packet could not be rewritten (or a refusal not built).
    RewriteFailed,
}

pub const DROP_REASONS: usize = 5;

impl DropReason {
    pub const ALL: [DropReason; DROP_REASONS] = [
        DropReason::SourceOutsideRanges,
        DropReason::NoLocalEndpoint,
        DropReason::NoSnatPort,
        DropReason::ConntrackFull,
        DropReason::RewriteFailed,
    ];

    /// The `reason` label the agent exports it under.
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::SourceOutsideRanges => "source_outside_ranges",
            DropReason::NoLocalEndpoint => "no_local_endpoint",
            DropReason::NoSnatPort => "no_snat_port",
            DropReason::ConntrackFull => "conntrack_full",
            DropReason::RewriteFailed => "rewrite_failed",
        }
    }
}

/// One frontend's counters on one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FrontendStats {
    /// Socket LB: connect() calls, and datagrams starting a socket's flow,
    /// translated to a backend.
    pub sock_connections: u64,
    /// Socket LB: calls refused (no endpoint).
    pub sock_refused: u64,
    /// Per packet: new flows translated and tracked.
    pub flows: u64,
    /// Per packet, `ct-lean` builds only: packets translated, both
    /// directions (new and tracked). The default build counts them in the
    /// flows' conntrack entries (zero here), which the agent sums.
    pub packets: u64,
    /// Per packet, as `packets`: their bytes as tc sees them (L2 header
    /// included).
    pub bytes: u64,
    /// Per packet: new flows refused (TCP RST, ICMP unreachable).
    pub refused: u64,
    /// Per packet: packets dropped, by [`DropReason`].
    pub dropped: [u64; DROP_REASONS],
}

impl FrontendStats {
    /// Field-wise sum, for the agent's totals over CPUs and ids.
    pub fn add(&mut self, other: &FrontendStats) {
        self.sock_connections += other.sock_connections;
        self.sock_refused += other.sock_refused;
        self.flows += other.flows;
        self.packets += other.packets;
        self.bytes += other.bytes;
        self.refused += other.refused;
        for (d, o) in self.dropped.iter_mut().zip(other.dropped) {
            *d += o;
        }
    }

    /// Field-wise `self - earlier`, where every field grew; `None` when one
    /// shrank (the entry was deleted and made anew meanwhile).
    pub fn since(&self, earlier: &FrontendStats) -> Option<FrontendStats> {
        let sub = |a: u64, b: u64| a.checked_sub(b);
        let mut dropped = [0; DROP_REASONS];
        for (i, d) in dropped.iter_mut().enumerate() {
            *d = sub(self.dropped[i], earlier.dropped[i])?;
        }
        Some(FrontendStats {
            sock_connections: sub(self.sock_connections, earlier.sock_connections)?,
            sock_refused: sub(self.sock_refused, earlier.sock_refused)?,
            flows: sub(self.flows, earlier.flows)?,
            packets: sub(self.packets, earlier.packets)?,
            bytes: sub(self.bytes, earlier.bytes)?,
            refused: sub(self.refused, earlier.refused)?,
            dropped,
        })
    }

    /// All the traffic it counts, for ranking frontends by how busy they are.
    pub fn activity(&self) -> u64 {
        let dropped: u64 = self.dropped.iter().sum();
        self.sock_connections
            + self.sock_refused
            + self.flows
            + self.packets
            + self.refused
            + dropped
    }
}
