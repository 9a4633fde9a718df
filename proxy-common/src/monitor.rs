//! `proxy-agent monitor`: the datapath's events for operators, one per
//! decision (a new flow and its translation, a drop, a refusal), written
//! to the `EVENTS` ring buffer only while a monitor keeps the deadline in
//! `MONITOR` ahead of the clock: nobody watching costs one array lookup at
//! each decision point, and nothing on the paths of tracked flows or
//! packets to no service.

/// The ring buffer's size in bytes (a power-of-2 multiple of the page
/// size): about 2,500 events.
pub const EVENTS_BYTES: u32 = 256 * 1024;

/// How far ahead a monitor keeps the deadline (ns): emission stops by
/// itself this long after the last monitor dies, even killed.
pub const DEADLINE_AHEAD_NS: u64 = 5_000_000_000;

/// Where the decision was made (`MonitorEvent::hook`).
pub mod hook {
    pub const TC_INGRESS: u8 = 0;
    pub const CONNECT4: u8 = 1;
    pub const SENDMSG4: u8 = 2;
    pub const CONNECT6: u8 = 3;
    pub const SENDMSG6: u8 = 4;
    /// The driver hook (`xdp_ingress`).
    pub const XDP: u8 = 5;

    /// Whether the hook sees packets (else calls of a socket).
    pub const fn sees_packets(hook: u8) -> bool {
        hook == TC_INGRESS || hook == XDP
    }
}

/// What became of the packet or call (`MonitorEvent::verdict`).
pub mod verdict {
    /// A new flow, translated to `after`.
    pub const TRANSLATED: u8 = 0;
    pub const DROPPED: u8 = 1;
    /// Refused: TCP RST or ICMP port unreachable (tc), ECONNREFUSED (socket).
    pub const REFUSED: u8 = 2;
}

/// Why a packet was dropped or refused (`MonitorEvent::reason`).
pub mod reason {
    pub const NONE: u8 = 0;
    pub const SOURCE_OUTSIDE_RANGES: u8 = 1;
    pub const NO_LOCAL_ENDPOINT: u8 = 2;
    pub const NO_ENDPOINT: u8 = 3;
    pub const NO_SNAT_PORT: u8 = 4;
    pub const CONNTRACK_FULL: u8 = 5;
}

/// An address as events and records hold it: family 4 in the first 4
/// bytes, else IPv6.
pub fn address(family: u8, bytes: &[u8; 16]) -> core::net::IpAddr {
    match family {
        4 => core::net::Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]).into(),
        _ => core::net::Ipv6Addr::from(*bytes).into(),
    }
}

/// A tuple of either family: an IPv4 address fills the first 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventTuple {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// One event. A socket hook's `before` has no source (the socket may not
/// be bound yet): all zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorEvent {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC).
    pub ts_ns: u64,
    /// The interface of a tc hook (0 for socket hooks).
    pub ifindex: u32,
    /// The frontend's reverse-NAT id (`FRONTEND_INFO`); 0 when the event
    /// does not carry it (drops and refusals: the agent finds the service
    /// by `before`'s destination).
    pub rev_nat_id: u32,
    pub before: EventTuple,
    /// The translated tuple (a translation; else `before` again).
    pub after: EventTuple,
    pub hook: u8,
    /// 4 or 6.
    pub family: u8,
    pub verdict: u8,
    pub reason: u8,
    pub _pad: [u8; 4],
}

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::MonitorEvent {}
}
