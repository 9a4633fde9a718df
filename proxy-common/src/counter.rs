//! The per-CPU counters (`COUNTERS`).

/// Indexes of the per-CPU counters array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// A socket address matched a service frontend.
    ServiceHit = 0,
    /// A backend was picked at random.
    BackendPicked,
    /// A backend came from the affinity map.
    AffinityHit,
    /// A service had no backend: the call was refused.
    NoBackend,
    /// A backend slot or backend id was missing (a racing update).
    SlotMiss,
    /// A reply or peer address was reverse-translated.
    RevNat,
    /// A packet matched a conntrack entry and was translated.
    CtHit,
    /// A new flow was translated per packet and tracked.
    CtNew,
    /// A new flow was refused (TCP RST or ICMP port unreachable).
    Rejected,
    /// A packet was dropped (policy Local without a local endpoint, a source
    /// outside loadBalancerSourceRanges, no SNAT port, a full conntrack map).
    Dropped,
    /// An ICMP error about a translated flow was translated back.
    IcmpRevNat,
    /// A decision record found `RECORDS` full and was not written.
    RecordLost,
    /// A tracked packet was sent on at the driver hook (XDP), before the
    /// stack: counted in `CtHit` too.
    XdpForwarded,
}

pub const COUNTER_COUNT: u32 = 13;

impl Counter {
    pub const ALL: [Counter; COUNTER_COUNT as usize] = [
        Counter::ServiceHit,
        Counter::BackendPicked,
        Counter::AffinityHit,
        Counter::NoBackend,
        Counter::SlotMiss,
        Counter::RevNat,
        Counter::CtHit,
        Counter::CtNew,
        Counter::Rejected,
        Counter::Dropped,
        Counter::IcmpRevNat,
        Counter::RecordLost,
        Counter::XdpForwarded,
    ];

    /// The Prometheus-style name the agent exports it under.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::ServiceHit => "service_hit",
            Counter::BackendPicked => "backend_picked",
            Counter::AffinityHit => "affinity_hit",
            Counter::NoBackend => "no_backend",
            Counter::SlotMiss => "slot_miss",
            Counter::RevNat => "rev_nat",
            Counter::CtHit => "ct_hit",
            Counter::CtNew => "ct_new",
            Counter::Rejected => "rejected",
            Counter::Dropped => "dropped",
            Counter::IcmpRevNat => "icmp_rev_nat",
            Counter::RecordLost => "record_lost",
            Counter::XdpForwarded => "xdp_forwarded",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_dense() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
    }
}
