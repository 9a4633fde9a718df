//! Map keys and values shared by the BPF programs and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding fields, so a key built on
//! either side hashes to the same bytes. Addresses are `[u8; 4]` in wire order
//! and ports are host-order `u16`: `bpftool map dump` then prints
//! `"address": [10,96,0,10], "port": 80` instead of byte-swapped integers.
#![no_std]

pub mod ct;
pub mod dsr;
pub mod explain;
pub mod icmp;
pub mod layout;
pub mod log_level;
pub mod maglev;
pub mod map_names;
pub mod monitor;
pub mod prefilter;
pub mod record;
pub mod sctp;
pub mod stats;

mod affinity;
mod config;
mod conntrack;
mod counter;
mod flags;
mod fragment;
mod frontend;
#[cfg(feature = "user")]
mod pod;
mod service;
mod socket;
mod source_range;

pub use affinity::*;
pub use config::Config;
pub use conntrack::*;
pub use counter::{COUNTER_COUNT, Counter};
pub use flags::{BackendFlags, ServiceFlags};
pub use fragment::{FragKey, FragRewrite};
pub use frontend::*;
pub use layout::Layouts;
pub use service::*;
pub use socket::*;
pub use source_range::*;
pub use stats::{DROP_REASONS, DropReason, FrontendStats};

/// The IPv6 per-packet programs, by their slot in the `TC6` program array:
/// the IPv4 programs enter them by a tail call, which gives the IPv6 path a
/// stack of its own (the IPv4 path's frame would leave it too little of the
/// 512 bytes a chain of calls shares), and costs the IPv4 path nothing.
pub const TC6_PROGRAMS: [&str; 3] = ["tc_ingress6", "tc_pod_replies6", "tc_egress6"];
pub const TC6_INGRESS: u32 = 0;
pub const TC6_POD_REPLIES: u32 = 1;
pub const TC6_EGRESS: u32 = 2;

/// The SCTP per-packet programs, by their slot in the `TC_SCTP` program
/// array: the TCP and UDP programs of their family and direction hand SCTP
/// packets on by a tail call (an empty slot: they pass untouched), and the
/// agent loads them once a frontend is SCTP's. In the same programs, SCTP
/// would cost every node a third walk of the verifier through each (a
/// protocol it knows is a copy of every path after it), past its limit of
/// a million instructions for `tc_ingress`.
pub const TC_SCTP_PROGRAMS: [&str; 4] =
    ["tc_ingress_sctp", "tc_egress_sctp", "tc_ingress6_sctp", "tc_egress6_sctp"];
pub const TC_SCTP_INGRESS: u32 = 0;
pub const TC_SCTP_EGRESS: u32 = 1;
pub const TC_SCTP_INGRESS6: u32 = 2;
pub const TC_SCTP_EGRESS6: u32 = 3;

/// The programs a new IPv4 TCP or UDP flow's first packet goes on in, by
/// their slot in the `TC_NEW` program array: `tc_ingress` decides (the
/// frontend, a backend, SNAT or DSR) and hands the packet on by a tail call
/// to `tc_new_flow`, which makes the flow and sends the packet. Apart, the
/// verifier walks the sending once; inline, it walked it once for each way
/// a decision can come out: 749k instructions where the two take 233k and
/// 246k.
pub const TC_NEW_PROGRAMS: [&str; 1] = ["tc_new_flow"];
pub const TC_NEW_FLOW: u32 = 0;

/// Capacities, shared so the agent can refuse a plan that would not fit.
pub const MAX_SERVICE_ENTRIES: u32 = 65_536;
pub const MAX_BACKENDS: u32 = 65_536;
pub const MAX_REV_NAT: u32 = 65_536;
pub const MAX_SOCK_REV_NAT: u32 = 262_144;
pub const MAX_SOCK_REV_NAT6: u32 = 65_536;
pub const MAX_AFFINITY: u32 = 65_536;
pub const MAX_CONNTRACK: u32 = 262_144;
pub const MAX_CONNTRACK6: u32 = 262_144;
pub const MAX_AFFINITY6: u32 = 65_536;
pub const MAX_SOURCE_RANGES: u32 = 16_384;
pub const MAX_FRAGMENTS: u32 = 16_384;
/// Node interfaces that can carry the XDP program (`XDP_EGRESS`).
pub const MAX_XDP_INTERFACES: u32 = 64;
pub const MAX_SOCK_FLOWS: u32 = 65_536;
/// Departures handed to the socket iterator at once (more go in batches).
pub const MAX_SOCK_ENDS: u32 = 4_096;
/// Maglev table chunks (`maglev::MaglevKey`), allocated per entry: 16,384
/// frontends' tables at the default size.
pub const MAX_MAGLEV_CHUNKS: u32 = 65_536;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// The transport protocols the per-packet path translates: those whose
/// ports lie first in their header (TCP, UDP, SCTP).
#[inline(always)]
pub const fn has_ports(proto: u8) -> bool {
    matches!(proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)
}

/// `ServiceKey::scope`: the frontend every client of an address gets, the
/// only one at most addresses.
pub const SCOPE_EXTERNAL: u8 = 0;
/// `ServiceKey::scope`: at an external address of an
/// `externalTrafficPolicy: Local` service, the frontend in-cluster clients
/// (pods, the node) get instead: every endpoint, as kube-proxy
/// short-circuits their traffic to the service's cluster-wide chain.
pub const SCOPE_INTERNAL: u8 = 1;

/// The IPv6 family's own maps (`SERVICES6`, `BACKENDS6`, `REV_NAT6`,
/// `SOCK_REV_NAT6`) hold these: the IPv4 types with 16-byte addresses.
/// Separate maps keep IPv4 keys at 12 bytes and let `bpftool` print each
/// family's addresses as they are. Reverse-NAT and backend ids come from
/// one space for both families, so the maps keyed by id alone
/// (`FRONTEND_INFO`, `AFFINITY`, `SOCK_FLOWS`) serve both.
pub type Ipv6Octets = [u8; 16];

/// `address` as a v4-mapped IPv6 address (`::ffff:a.b.c.d`).
pub const fn v4_mapped(address: [u8; 4]) -> Ipv6Octets {
    let [a, b, c, d] = address;
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d]
}
