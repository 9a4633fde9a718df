//! The session-affinity maps.

use crate::Ipv6Octets;

/// `AffinityKey::kind`: the client is a network-namespace cookie (socket LB:
/// at `connect()` the source address is not chosen yet; one pod, one netns).
pub const AFFINITY_CLIENT_NETNS: u8 = 0;
/// `AffinityKey::kind`: the client is an IPv4 source address (per packet).
pub const AFFINITY_CLIENT_IPV4: u8 = 1;

/// Key of the session-affinity map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    pub client: u64,
    pub rev_nat_id: u32,
    pub kind: u8,
    pub _pad: [u8; 3],
}

/// Key of `AFFINITY6`, per-packet session affinity of IPv6 clients: the
/// whole address. `AffinityKey::client` holds 64 bits, and a hash of 128
/// would let two clients that collide share one affinity entry, so the
/// IPv6 family has its own map keyed exactly.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey6 {
    pub client: Ipv6Octets,
    pub rev_nat_id: u32,
    pub _pad: u32,
}

/// Value of the session-affinity maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns()` of the last connection that used this entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}
