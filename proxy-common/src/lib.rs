//! Map keys and values shared by the BPF programs and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding fields, so a key built on
//! either side hashes to the same bytes. Addresses are `[u8; 4]` in wire order
//! and ports are host-order `u16`: `bpftool map dump` then prints
//! `"address": [10,96,0,10], "port": 80` instead of byte-swapped integers.
#![no_std]

pub mod dsr;
pub mod maglev;
pub mod monitor;

/// Names of the maps in the BPF object; the agent pins each under its own name.
pub mod map_names {
    pub const SERVICES: &str = "SERVICES";
    pub const BACKENDS: &str = "BACKENDS";
    pub const REV_NAT: &str = "REV_NAT";
    pub const SOCK_REV_NAT: &str = "SOCK_REV_NAT";
    pub const AFFINITY: &str = "AFFINITY";
    pub const COUNTERS: &str = "COUNTERS";
    pub const CONNTRACK: &str = "CONNTRACK";
    pub const SOURCE_RANGES: &str = "SOURCE_RANGES";
    pub const CONFIG: &str = "CONFIG";
    pub const FRAGMENTS: &str = "FRAGMENTS";
    pub const LAYOUT: &str = "LAYOUT";
    pub const SOCK_FLOWS: &str = "SOCK_FLOWS";
    pub const SOCK_ENDS: &str = "SOCK_ENDS";
    pub const FRONTEND_INFO: &str = "FRONTEND_INFO";
    pub const PREFILTER: &str = "PREFILTER";
    pub const PREFILTER_REPLIES: &str = "PREFILTER_REPLIES";
    pub const SERVICES6: &str = "SERVICES6";
    pub const BACKENDS6: &str = "BACKENDS6";
    pub const REV_NAT6: &str = "REV_NAT6";
    pub const SOCK_REV_NAT6: &str = "SOCK_REV_NAT6";
    pub const CONNTRACK6: &str = "CONNTRACK6";
    pub const AFFINITY6: &str = "AFFINITY6";
    pub const SOURCE_RANGES6: &str = "SOURCE_RANGES6";
    pub const TC6: &str = "TC6";
    pub const EVENTS: &str = "EVENTS";
    pub const MONITOR: &str = "MONITOR";
    pub const MONITOR_LOST: &str = "MONITOR_LOST";
    pub const FRONTEND_STATS: &str = "FRONTEND_STATS";
    pub const MAGLEV: &str = "MAGLEV";
}

pub mod stats;
pub use stats::{DROP_REASONS, DropReason, FrontendStats};

/// The IPv6 per-packet programs, by their slot in the `TC6` program array:
/// the IPv4 programs enter them by a tail call, which gives the IPv6 path a
/// stack of its own (the IPv4 path's frame would leave it too little of the
/// 512 bytes a chain of calls shares), and costs the IPv4 path nothing.
pub const TC6_PROGRAMS: [&str; 3] = ["tc_ingress6", "tc_pod_replies6", "tc_egress6"];
pub const TC6_INGRESS: u32 = 0;
pub const TC6_POD_REPLIES: u32 = 1;
pub const TC6_EGRESS: u32 = 2;

/// Layout versions of the maps, so a new agent can tell whether a previous
/// agent's pinned maps hold entries it can read: the same version is reused
/// as it is, a known older (or newer) one is converted, an unknown one is
/// started afresh. Bump a map's version whenever its key or value changes.
pub mod layout {
    pub const SERVICES: u32 = 1;
    pub const BACKENDS: u32 = 1;
    /// 2: `CtEntryV2`, with packets and bytes per direction; 1:
    /// `CtEntryV1`, without them (the `ct-lean` build).
    pub const CONNTRACK: u32 = if cfg!(feature = "ct-lean") { 1 } else { 2 };
    pub const AFFINITY: u32 = 1;
    pub const SOCK_REV_NAT: u32 = 1;
    pub const FRAGMENTS: u32 = 1;
    pub const SOCK_FLOWS: u32 = 1;
    pub const SOCK_REV_NAT6: u32 = 1;
    /// As `CONNTRACK`: 1 in the `ct-lean` build.
    pub const CONNTRACK6: u32 = CONNTRACK;
    pub const AFFINITY6: u32 = 1;
}

/// Value of the one-element `LAYOUT` map: the layout version of each map as
/// the agent that pinned them wrote them. Its own layout never changes:
/// maps added later take the reserved words, in order. Pins without a
/// `LAYOUT` map are those of the first release, whose layouts are version 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Layouts {
    pub services: u32,
    pub backends: u32,
    pub conntrack: u32,
    pub affinity: u32,
    pub sock_rev_nat: u32,
    pub fragments: u32,
    pub sock_flows: u32,
    pub sock_rev_nat6: u32,
    pub conntrack6: u32,
    pub affinity6: u32,
    pub _reserved: [u32; 6],
}

impl Layouts {
    /// This build's layouts.
    pub const CURRENT: Layouts = Layouts {
        services: layout::SERVICES,
        backends: layout::BACKENDS,
        conntrack: layout::CONNTRACK,
        affinity: layout::AFFINITY,
        sock_rev_nat: layout::SOCK_REV_NAT,
        fragments: layout::FRAGMENTS,
        sock_flows: layout::SOCK_FLOWS,
        sock_rev_nat6: layout::SOCK_REV_NAT6,
        conntrack6: layout::CONNTRACK6,
        affinity6: layout::AFFINITY6,
        _reserved: [0; 6],
    };

    /// What unversioned pins (the first release) hold.
    pub const FIRST: Layouts = Layouts {
        services: 1,
        backends: 1,
        conntrack: 1,
        affinity: 1,
        sock_rev_nat: 1,
        fragments: 1,
        // The first release had no such maps.
        sock_flows: 0,
        sock_rev_nat6: 0,
        conntrack6: 0,
        affinity6: 0,
        _reserved: [0; 6],
    };
}

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
pub const MAX_SOCK_FLOWS: u32 = 65_536;
/// Departures handed to the socket iterator at once (more go in batches).
pub const MAX_SOCK_ENDS: u32 = 4_096;
/// Maglev table chunks (`maglev::MaglevKey`), allocated per entry: 16,384
/// frontends' tables at the default size.
pub const MAX_MAGLEV_CHUNKS: u32 = 65_536;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// `ServiceKey::scope`: the frontend every client of an address gets, the
/// only one at most addresses.
pub const SCOPE_EXTERNAL: u8 = 0;
/// `ServiceKey::scope`: at an external address of an
/// `externalTrafficPolicy: Local` service, the frontend in-cluster clients
/// (pods, the node) get instead: every endpoint, as kube-proxy
/// short-circuits their traffic to the service's cluster-wide chain.
pub const SCOPE_INTERNAL: u8 = 1;

/// Declares a set of one-bit flags stored as a plain integer (a map value's
/// field, so its bits are part of the map's layout): a named predicate per
/// flag and a builder that sets or clears it, so no side writes a mask.
macro_rules! flags {
    ($(#[$doc:meta])* $name:ident($bits:ty) {
        $($(#[$fdoc:meta])* $bit:literal: $is:ident, $with:ident;)*
    }) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            bits: $bits,
        }

        impl $name {
            /// No flag set.
            pub const EMPTY: Self = Self { bits: 0 };

            $(
                $(#[$fdoc])*
                #[doc = concat!("\n\nBit ", stringify!($bit), ".")]
                pub const fn $is(self) -> bool {
                    self.bits & (1 << $bit) != 0
                }

                #[doc = concat!("These flags with [`Self::", stringify!($is), "`] as `on` says.")]
                pub const fn $with(self, on: bool) -> Self {
                    let bit: $bits = 1 << $bit;
                    Self { bits: if on { self.bits | bit } else { self.bits & !bit } }
                }
            )*
        }
    };
}

flags!(
    /// `ServiceValue::flags`: how the programs treat a frontend.
    ServiceFlags(u16) {
        /// The service has `sessionAffinity: ClientIP`.
        0: is_affinity, with_affinity;
        /// A NodePort, externalIP or LoadBalancer frontend; with
        /// `externalTrafficPolicy: Cluster` its clients are SNATed to the node.
        1: is_external, with_external;
        /// The traffic policy of this frontend is Local: only local backends,
        /// and the client address is kept.
        2: is_local_only, with_local_only;
        /// With no backend, drop (policy Local with endpoints elsewhere)
        /// instead of rejecting (no endpoints at all), as kube-proxy does.
        3: drops_when_empty, with_drop_when_empty;
        /// Only sources in `SOURCE_RANGES` for this frontend may connect
        /// (loadBalancerSourceRanges).
        4: has_source_ranges, with_source_ranges;
        /// On a `SCOPE_EXTERNAL` frontend: an internal-scope frontend at the
        /// same address serves in-cluster clients (Cilium's "two scopes").
        5: has_two_scopes, with_two_scopes;
        /// No endpoint is ready: the backends are the serving, terminating
        /// ones (kube-proxy's fallback); only the decision records read it.
        6: serves_terminating, with_serves_terminating;
        /// New flows pick their backend from the frontend's Maglev table
        /// (`MAGLEV`), by a hash of their tuple, rather than at random: every
        /// node picks the same backend for a flow.
        7: uses_maglev, with_maglev;
        /// New flows to a backend on another node are sent there by direct
        /// server return (`dsr`): the client's address kept, the service
        /// carried in an IP option, the replies sent from the backend's
        /// node. Its replies come back through this node otherwise.
        8: is_dsr, with_dsr;
    }
);

flags!(
    /// `Backend::flags`: where the endpoint is.
    BackendFlags(u8) {
        /// The endpoint runs on this node (`--hostname-override`).
        0: is_local, with_local;
        /// The endpoint is one of this node's own addresses (a host-network
        /// pod): per packet it is reached through the stack, unSNATed.
        1: is_host, with_host;
    }
);

/// Key of the services map. Slot 0 is the frontend entry; slots `1..=count`
/// hold the ids of the service's backends.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub address: [u8; 4],
    pub port: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}

impl ServiceKey {
    pub const fn new(address: [u8; 4], port: u16, proto: u8, slot: u16) -> Self {
        Self { address, port, slot, proto, scope: SCOPE_EXTERNAL, _pad: [0; 2] }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }

    pub const fn with_scope(self, scope: u8) -> Self {
        Self { scope, ..self }
    }
}

/// Value of the services map. In the frontend slot `count` is the number of
/// backend slots and `backend_id` is 0; in a backend slot only `backend_id`
/// is meaningful.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub affinity_timeout_secs: u32,
    pub count: u16,
    pub flags: ServiceFlags,
}

/// Value of the backends map, keyed by a `u32` backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub address: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: BackendFlags,
}

/// Value of the reverse-NAT map, keyed by a `u32` reverse-NAT id: the
/// service address replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat {
    pub address: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Key of the socket reverse-NAT map: a socket (by cookie) and the backend it
/// was sent to. Filled by `connect4`/`sendmsg4`, read by `recvmsg4` and
/// `getpeername4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    pub cookie: u64,
    pub address: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Value of the socket reverse-NAT map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNat {
    pub address: [u8; 4],
    pub port: u16,
    pub _pad: u16,
    pub rev_nat_id: u32,
}

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

/// Key of `SERVICES6`: as [`ServiceKey`]. The IPv6 types on the per-packet
/// path are aligned as their size allows (the layout stays): the BPF target
/// copies byte arrays it cannot assume aligned one byte at a time, and
/// 16-byte addresses copied that way fill the programs' stack.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}

impl ServiceKey6 {
    pub const fn new(address: Ipv6Octets, port: u16, proto: u8, slot: u16) -> Self {
        Self { address, port, slot, proto, scope: SCOPE_EXTERNAL, _pad: [0; 2] }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }

    pub const fn with_scope(self, scope: u8) -> Self {
        Self { scope, ..self }
    }
}

/// Value of `BACKENDS6`, keyed by a `u32` backend id: as [`Backend`].
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub proto: u8,
    pub flags: BackendFlags,
}

/// Value of `REV_NAT6`, keyed by a `u32` reverse-NAT id: as [`RevNat`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub _pad: u16,
}

/// Key of `SOCK_REV_NAT6`: as [`SockRevNatKey`], for IPv6 sockets sent to
/// an IPv6 backend (`connect6`, `sendmsg6`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey6 {
    pub cookie: u64,
    pub address: Ipv6Octets,
    pub port: u16,
    pub _pad: [u8; 6],
}

/// Value of `SOCK_REV_NAT6`: as [`SockRevNat`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNat6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub _pad: u16,
    pub rev_nat_id: u32,
}

/// Key of the socket flow map: an unconnected UDP socket (by cookie) and the
/// frontend (by reverse-NAT id) it sends datagrams to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFlowKey {
    pub cookie: u64,
    pub rev_nat_id: u32,
    pub _pad: u32,
}

/// Value of the socket flow map: the backend the socket's datagrams to that
/// frontend go to, as a conntrack entry keeps a UDP 5-tuple on one pod.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFlow {
    /// `bpf_ktime_get_ns()` of the last datagram sent.
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// 1 once a reply came back (recvmsg4 reverse-translated one).
    pub answered: u8,
    pub _pad: [u8; 3],
}

/// Bytes of a frontend's service port name, `namespace/name:port`: 63 + 1
/// + 63 + 1 + 15 at most, padded.
pub const FRONTEND_NAME_LEN: usize = 148;

/// `FrontendInfo::kind`, as Kubernetes names a service's addresses.
pub const KIND_CLUSTER_IP: u8 = 0;
pub const KIND_NODE_PORT: u8 = 1;
pub const KIND_EXTERNAL_IP: u8 = 2;
pub const KIND_LOAD_BALANCER: u8 = 3;

/// Value of the frontend-info map, keyed by reverse-NAT id: what the agent
/// knows of a frontend that the programs do not need, for operators
/// (`proxy-agent lb list`, `ct list`, `bpftool map dump`). Never read by
/// the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrontendInfo {
    pub kind: u8,
    pub name_len: u8,
    pub _pad: [u8; 2],
    pub name: [u8; FRONTEND_NAME_LEN],
}

impl FrontendInfo {
    /// `name` cut to [`FRONTEND_NAME_LEN`] bytes (at a character boundary).
    pub fn new(kind: u8, name: &str) -> Self {
        let mut end = name.len().min(FRONTEND_NAME_LEN);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut info =
            FrontendInfo { kind, name_len: end as u8, _pad: [0; 2], name: [0; FRONTEND_NAME_LEN] };
        info.name[..end].copy_from_slice(&name.as_bytes()[..end]);
        info
    }

    pub fn name(&self) -> &str {
        let len = (self.name_len as usize).min(FRONTEND_NAME_LEN);
        core::str::from_utf8(&self.name[..len]).unwrap_or("?")
    }
}

/// The `bpf_sock_destroy` kfunc call as the BPF object holds it: BPF_JMP |
/// BPF_CALL (0x85), src_reg BPF_PSEUDO_KFUNC_CALL (2), off 0 (vmlinux BTF),
/// and a placeholder immediate the agent replaces with the kfunc's BTF id in
/// the running kernel before loading (aya does not resolve kfunc calls).
pub const SOCK_DESTROY_CALL: u64 = (0x5ec0_de57 << 32) | 0x2085;

/// Key of the socket-ending map: connected sockets the socket LB sent to
/// `address:port` (`proto`) for the frontend `rev_nat_id` must end, the
/// backend having left it; `rev_nat_id` 0 stands for every frontend (the
/// backend left them all). Written by the agent, read by the socket
/// iterators. Of both families: an IPv4 backend's address is v4-mapped
/// (`::ffff:a.b.c.d`), as the map lives only for one run of the iterators.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockEndKey {
    pub address: Ipv6Octets,
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
    pub rev_nat_id: u32,
}

impl SockFlow {
    /// Whether the flow still holds at `now`: for `udp_timeout_secs` after
    /// the last datagram, `udp_stream_timeout_secs` once answered, as
    /// netfilter's UDP timeouts.
    pub const fn is_fresh(&self, cfg: &Config, now: u64) -> bool {
        let secs =
            if self.answered != 0 { cfg.udp_stream_timeout_secs } else { cfg.udp_timeout_secs };
        now.wrapping_sub(self.last_used_ns) <= secs as u64 * 1_000_000_000
    }
}

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

/// A conntrack key of either family ([`CtKey`], [`CtKey6`]), for code
/// written once for both (the programs' flow tracking, the agent's upkeep).
pub trait CtTuple: Copy + PartialEq {
    type Addr: Copy + PartialEq + Default;
    fn new(saddr: Self::Addr, daddr: Self::Addr, sport: u16, dport: u16, proto: u8) -> Self;
    fn saddr(&self) -> Self::Addr;
    fn daddr(&self) -> Self::Addr;
    fn sport(&self) -> u16;
    fn dport(&self) -> u16;
    fn proto(&self) -> u8;
    /// The key of the packets flowing the other way.
    fn reversed(&self) -> Self;
    fn with_sport(self, sport: u16) -> Self;
}

/// Declares a conntrack key: a packet's tuple as it is on the wire.
macro_rules! ct_key {
    ($(#[$doc:meta])* $name:ident($addr:ty)) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            pub saddr: $addr,
            pub daddr: $addr,
            pub sport: u16,
            pub dport: u16,
            pub proto: u8,
            pub _pad: [u8; 3],
        }

        impl $name {
            /// The key of the packets flowing the other way.
            pub const fn reversed(&self) -> Self {
                Self {
                    saddr: self.daddr,
                    daddr: self.saddr,
                    sport: self.dport,
                    dport: self.sport,
                    proto: self.proto,
                    _pad: [0; 3],
                }
            }
        }

        impl CtTuple for $name {
            type Addr = $addr;
            #[inline(always)]
            fn new(saddr: $addr, daddr: $addr, sport: u16, dport: u16, proto: u8) -> Self {
                Self { saddr, daddr, sport, dport, proto, _pad: [0; 3] }
            }
            #[inline(always)]
            fn saddr(&self) -> $addr {
                self.saddr
            }
            #[inline(always)]
            fn daddr(&self) -> $addr {
                self.daddr
            }
            #[inline(always)]
            fn sport(&self) -> u16 {
                self.sport
            }
            #[inline(always)]
            fn dport(&self) -> u16 {
                self.dport
            }
            #[inline(always)]
            fn proto(&self) -> u8 {
                self.proto
            }
            #[inline(always)]
            fn reversed(&self) -> Self {
                $name::reversed(self)
            }
            #[inline(always)]
            fn with_sport(self, sport: u16) -> Self {
                Self { sport, ..self }
            }
        }
    };
}

ct_key!(
    /// Key of the conntrack map.
    CtKey([u8; 4])
);

ct_key!(
    /// Key of `CONNTRACK6`, the IPv6 flows: as [`CtKey`]. Aligned to 8
    /// (its size already is a multiple, so the layout stays): the BPF target
    /// copies byte arrays it cannot assume aligned one byte at a time, and
    /// 16-byte addresses copied that way fill the programs' stack.
    #[repr(align(8))]
    CtKey6(Ipv6Octets)
);

/// `CtEntry::flags`: the entry translates replies (backend to client).
pub const CT_FLAG_REPLY: u8 = 1 << 0;
/// The flow's source was rewritten (SNAT to the node).
pub const CT_FLAG_SNAT: u8 = 1 << 1;
/// TCP: both sides sent FIN, or one sent RST: the flow is over.
pub const CT_FLAG_CLOSED: u8 = 1 << 2;
/// A packet was seen in the reply direction.
pub const CT_FLAG_SEEN_REPLY: u8 = 1 << 3;
/// TCP: the client acknowledged after the backend answered (handshake done).
pub const CT_FLAG_ESTABLISHED: u8 = 1 << 4;
/// TCP: the client sent FIN.
pub const CT_FLAG_FIN_ORIG: u8 = 1 << 5;
/// TCP: the backend sent FIN.
pub const CT_FLAG_FIN_REPLY: u8 = 1 << 6;
/// A forward entry of a flow sent by direct server return: its packets
/// carry the service in an IP option; or, on the backend's node, the
/// reply entry a packet with that option made.
pub const CT_FLAG_DSR: u8 = 1 << 7;
/// The bits both entries of a flow share (the flow's state).
pub const CT_STATE_FLAGS: u8 = CT_FLAG_CLOSED
    | CT_FLAG_SEEN_REPLY
    | CT_FLAG_ESTABLISHED
    | CT_FLAG_FIN_ORIG
    | CT_FLAG_FIN_REPLY;

/// The flow state machine, shared by the programs and the agent's tests.
pub mod ct {
    use super::*;

    pub const TCP_FIN: u8 = 0x01;
    pub const TCP_SYN: u8 = 0x02;
    pub const TCP_RST: u8 = 0x04;
    pub const TCP_ACK: u8 = 0x10;
    /// A closed flow's SNAT port rests this long before a new flow may take
    /// it: Linux backends keep a closed connection in TIME_WAIT for 60 s, and
    /// clients use per-connection timestamp offsets, so a new SYN on that
    /// 4-tuple would often fail PAWS (answered by an ACK, not a SYN-ACK).
    pub const PORT_REST_SECS: u64 = 60;
    const NS_PER_SEC: u64 = 1_000_000_000;

    /// The flags of an entry after a packet of its direction with
    /// `tcp_flags` (0 for UDP).
    pub const fn next_flags(flags: u8, tcp_flags: u8) -> u8 {
        let reply = flags & CT_FLAG_REPLY != 0;
        let mut next = flags;
        // A DSR flow's replies never pass the node it enters: there, a
        // client's ACK without SYN says the backend answered.
        let answered = flags & CT_FLAG_SEEN_REPLY != 0
            || (flags & CT_FLAG_DSR != 0 && tcp_flags & TCP_SYN == 0);
        if reply {
            next |= CT_FLAG_SEEN_REPLY;
        } else if answered && tcp_flags & TCP_ACK != 0 {
            next |= CT_FLAG_ESTABLISHED;
        }
        if tcp_flags & TCP_FIN != 0 {
            next |= if reply { CT_FLAG_FIN_REPLY } else { CT_FLAG_FIN_ORIG };
            // Nor does the backend's FIN: on the node the flow entered (its
            // entry never sees a reply), the client's ends the flow (its
            // last ACKs still pass while the entry lives). The backend's
            // node sees both FINs and waits for them, as for any flow.
            if flags & (CT_FLAG_DSR | CT_FLAG_SEEN_REPLY) == CT_FLAG_DSR && !reply {
                next |= CT_FLAG_FIN_REPLY;
            }
        }
        let both_fins = CT_FLAG_FIN_ORIG | CT_FLAG_FIN_REPLY;
        if tcp_flags & TCP_RST != 0 || next & both_fins == both_fins {
            next |= CT_FLAG_CLOSED;
        }
        next
    }

    /// How long a flow in state `flags` lives without packets.
    pub const fn lifetime_secs(cfg: &Config, proto: u8, flags: u8) -> u32 {
        if proto == IPPROTO_UDP {
            cfg.udp_timeout_secs
        } else if flags & CT_FLAG_CLOSED != 0 {
            cfg.tcp_time_wait_timeout_secs
        } else if flags & (CT_FLAG_FIN_ORIG | CT_FLAG_FIN_REPLY) != 0 {
            cfg.tcp_close_wait_timeout_secs
        } else if flags & CT_FLAG_ESTABLISHED != 0 {
            cfg.tcp_established_timeout_secs
        } else {
            cfg.tcp_syn_timeout_secs
        }
    }

    /// What a SYN on a closed flow's entry means: on the client's entry, a
    /// new flow through the service from the same port (it restarts, as
    /// netfilter restarts a TIME_WAIT entry); on the backend's entry, a
    /// connection that never went through the service (the client reaching
    /// the backend directly from the same port), for which the closed
    /// flow's entries are stale.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Closed {
        /// The entry applies.
        Applies,
        Restarts,
        Stale,
    }

    pub const fn on_closed(flags: u8, tcp_flags: u8) -> Closed {
        if tcp_flags & TCP_SYN == 0 || flags & CT_FLAG_CLOSED == 0 {
            Closed::Applies
        } else if flags & CT_FLAG_REPLY == 0 {
            Closed::Restarts
        } else {
            Closed::Stale
        }
    }

    /// Whether the SNAT port held by a reply entry may go to a new flow: the
    /// entry expired, or its flow closed at least `PORT_REST_SECS` ago.
    pub const fn port_reusable(cfg: &Config, expires_ns: u64, flags: u8, now: u64) -> bool {
        let closed_lifetime = cfg.tcp_time_wait_timeout_secs as u64 * NS_PER_SEC;
        expires_ns < now
            || (flags & CT_FLAG_CLOSED != 0
                && expires_ns + PORT_REST_SECS * NS_PER_SEC <= now + closed_lifetime)
    }
}

/// A conntrack value of either family, for code written once for both.
pub trait CtValue: Copy {
    type Key: CtTuple;
    /// An entry rewriting packets to `to`.
    fn new(expires_ns: u64, to: &Self::Key, rev_nat_id: u32, flags: u8) -> Self;
    /// The tuple this entry rewrites packets to.
    fn rewritten(&self, proto: u8) -> Self::Key;
    fn expires_ns(&self) -> u64;
    fn flags(&self) -> u8;
    fn rev_nat_id(&self) -> u32;
    fn set_state(&mut self, flags: u8, expires_ns: u64);
    /// Whether the layout counts its packets and bytes (`account`).
    const COUNTS: bool;
    /// Counts a packet of `len` bytes (layouts with counters; else nothing).
    fn account(&mut self, len: u32);
    /// The packets and bytes counted (zero in a layout without counters).
    fn counted(&self) -> (u64, u64);
}

/// Declares a conntrack value layout: the fields every version has, then
/// the version's own (zero in a new entry; `packets` and `bytes` count).
macro_rules! ct_entry {
    ($(#[$doc:meta])* $name:ident($key:ident, $addr:ty) { $($(#[$fdoc:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub struct $name {
            /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) after which the entry is stale.
            pub expires_ns: u64,
            pub saddr: $addr,
            pub daddr: $addr,
            pub sport: u16,
            pub dport: u16,
            pub rev_nat_id: u32,
            pub flags: u8,
            pub _pad: [u8; 7],
            $($(#[$fdoc])* pub $field: $ty,)*
        }

        impl $name {
            /// An entry rewriting packets to `to`.
            pub const fn new(expires_ns: u64, to: &$key, rev_nat_id: u32, flags: u8) -> Self {
                Self {
                    expires_ns,
                    saddr: to.saddr,
                    daddr: to.daddr,
                    sport: to.sport,
                    dport: to.dport,
                    rev_nat_id,
                    flags,
                    _pad: [0; 7],
                    $($field: 0,)*
                }
            }

            /// The tuple this entry rewrites packets to.
            pub const fn rewritten(&self, proto: u8) -> $key {
                $key {
                    saddr: self.saddr,
                    daddr: self.daddr,
                    sport: self.sport,
                    dport: self.dport,
                    proto,
                    _pad: [0; 3],
                }
            }
        }

        impl CtValue for $name {
            type Key = $key;
            const COUNTS: bool = ct_entry!(@counts $($field)*);
            #[inline(always)]
            fn new(expires_ns: u64, to: &$key, rev_nat_id: u32, flags: u8) -> Self {
                $name::new(expires_ns, to, rev_nat_id, flags)
            }
            #[inline(always)]
            fn rewritten(&self, proto: u8) -> $key {
                $name::rewritten(self, proto)
            }
            #[inline(always)]
            fn expires_ns(&self) -> u64 {
                self.expires_ns
            }
            #[inline(always)]
            fn flags(&self) -> u8 {
                self.flags
            }
            #[inline(always)]
            fn rev_nat_id(&self) -> u32 {
                self.rev_nat_id
            }
            #[inline(always)]
            fn set_state(&mut self, flags: u8, expires_ns: u64) {
                self.flags = flags;
                self.expires_ns = expires_ns;
            }
            #[inline(always)]
            fn account(&mut self, _len: u32) {
                $(ct_entry!(@count self, _len, $field);)*
            }
            #[inline(always)]
            fn counted(&self) -> (u64, u64) {
                #[allow(unused_mut)]
                let mut counted = (0, 0);
                $(ct_entry!(@read self, counted, $field);)*
                counted
            }
        }
    };
    (@counts) => { false };
    (@counts $($field:ident)+) => { true };
    (@read $self:ident, $counted:ident, packets) => { $counted.0 = $self.packets };
    (@read $self:ident, $counted:ident, bytes) => { $counted.1 = $self.bytes };
    (@count $self:ident, $len:ident, packets) => { $self.packets += 1 };
    (@count $self:ident, $len:ident, bytes) => { $self.bytes += $len as u64 };
}

/// Conversions between a family's two conntrack layouts.
macro_rules! ct_layouts_convert {
    ($v1:ident, $v2:ident) => {
        impl From<$v1> for $v2 {
            /// Counting starts at the upgrade.
            fn from(v1: $v1) -> Self {
                let $v1 { expires_ns, saddr, daddr, sport, dport, rev_nat_id, flags, _pad } = v1;
                $v2 {
                    expires_ns,
                    saddr,
                    daddr,
                    sport,
                    dport,
                    rev_nat_id,
                    flags,
                    _pad,
                    packets: 0,
                    bytes: 0,
                }
            }
        }

        impl From<$v2> for $v1 {
            /// A rollback drops the counts, not the flow.
            fn from(v2: $v2) -> Self {
                let $v2 { expires_ns, saddr, daddr, sport, dport, rev_nat_id, flags, _pad, .. } =
                    v2;
                $v1 { expires_ns, saddr, daddr, sport, dport, rev_nat_id, flags, _pad }
            }
        }
    };
}

ct_entry!(
    /// Value of the conntrack map, layout 1: what a packet with the key's
    /// tuple becomes, and until when the entry lives. Each flow has two
    /// entries, one per direction; each names the other by its rewritten
    /// tuple reversed.
    CtEntryV1(CtKey, [u8; 4]) {}
);

ct_entry!(
    /// Conntrack layout 2 (the default; `ct-lean` builds use layout 1):
    /// layout 1 and what the entry's direction carried, its first packet
    /// included, as netfilter's `nf_conntrack_acct` counts. The agent sums
    /// them per frontend at each conntrack collection.
    CtEntryV2(CtKey, [u8; 4]) {
        packets: u64,
        bytes: u64,
    }
);

ct_layouts_convert!(CtEntryV1, CtEntryV2);

ct_entry!(
    /// Value of `CONNTRACK6`, layout 1: as [`CtEntryV1`].
    CtEntry6V1(CtKey6, Ipv6Octets) {}
);

ct_entry!(
    /// `CONNTRACK6` layout 2 (the default): as [`CtEntryV2`].
    CtEntry6V2(CtKey6, Ipv6Octets) {
        packets: u64,
        bytes: u64,
    }
);

ct_layouts_convert!(CtEntry6V1, CtEntry6V2);

/// The conntrack values of this build.
#[cfg(not(feature = "ct-lean"))]
pub type CtEntry = CtEntryV2;
#[cfg(feature = "ct-lean")]
pub type CtEntry = CtEntryV1;
#[cfg(not(feature = "ct-lean"))]
pub type CtEntry6 = CtEntry6V2;
#[cfg(feature = "ct-lean")]
pub type CtEntry6 = CtEntry6V1;

/// Key of the fragments map: an IP datagram whose first fragment was
/// translated, as its later fragments carry it (they have no ports).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Value of the fragments map: the addresses the first fragment got.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragRewrite {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
}

/// Data part of the `SOURCE_RANGES` LPM key: a frontend (by reverse-NAT id)
/// and a source address. The prefix length covers the 32 bits of the id,
/// then the address bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeKey {
    pub rev_nat_id: u32,
    pub address: [u8; 4],
}

/// Data part of the `SOURCE_RANGES6` LPM key: as [`SourceRangeKey`], with
/// an IPv6 source address.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeKey6 {
    pub rev_nat_id: u32,
    pub address: Ipv6Octets,
}

/// Bits of `SourceRangeKey` (and `SourceRangeKey6`) before the address.
pub const SOURCE_RANGE_PREFIX_BITS: u32 = 32;

/// ICMP errors about flows translated per packet: which flow an error is
/// about and what it becomes, as netfilter's NAT translates RELATED errors.
/// Shared by the programs and the host's tests.
pub mod icmp {
    use super::{CtKey, CtTuple};

    pub const DEST_UNREACH: u8 = 3;
    pub const TIME_EXCEEDED: u8 = 11;
    /// ICMPv6's errors (RFC 4443): all three may quote a translated packet.
    pub const DEST_UNREACH6: u8 = 1;
    pub const PACKET_TOO_BIG: u8 = 2;
    pub const TIME_EXCEEDED6: u8 = 3;

    /// An ICMP error's addresses and the tuple of the packet it quotes (`T`:
    /// its family's tuple).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct ErrorTuple<T: CtTuple = CtKey> {
        pub saddr: T::Addr,
        pub daddr: T::Addr,
        pub quoted: T,
    }

    /// The conntrack key of the flow the quoted packet belongs to. That
    /// packet left translated, and translated tuples are no keys; a packet
    /// going the other way is one, whose entry names the flow's tuples.
    #[inline(always)]
    pub fn flow_key<T: CtTuple>(quoted: &T) -> T {
        quoted.reversed()
    }

    /// `err` as the sender of the quoted packet must see it, given the tuple
    /// the flow rewrites packets of `flow_key` to: the quoted packet as that
    /// sender sent it, and the error addressed to it. Where the flow rewrites
    /// the source of packets going the error's way, the error comes from that
    /// source too (the node, a service address), as with netfilter; otherwise
    /// from whoever sent it.
    #[inline(always)]
    pub fn translate<T: CtTuple>(err: &ErrorTuple<T>, rewritten: &T) -> ErrorTuple<T> {
        let quoted = rewritten.reversed();
        let saddr = if quoted.daddr() != err.quoted.daddr() { quoted.daddr() } else { err.saddr };
        ErrorTuple { saddr, daddr: quoted.saddr(), quoted }
    }
}

/// `Config::log_level`: the programs write their decision records (aya-log)
/// at this level and the ones above it; the numbers are aya-log's levels.
/// The per-packet programs' pre-filter: a bitmap (`PREFILTER`, an array of
/// words) answering "could this packet be the datapath's?" with one inlined
/// array read per question, before any hash map is touched. A bit stands for
/// an (address, port, protocol) of one [`Kind`], of either family (an IPv6
/// address is folded into 32 bits first); the agent sets a bit before the
/// entry it stands for is written and never clears one while it runs, so a
/// set bit may be stale (the packet takes the full path) but an entry never
/// lacks its bit.
///
/// Replies of per-packet flows that were not masqueraded (whose replies come
/// from the backend to the client itself) are asked of `PREFILTER_REPLIES`
/// instead: a slot per backend (address, port, protocol) hash that the
/// datapath itself marks when it creates such a flow, so a backend's other
/// traffic (replies of connections the socket LB translated) passes. Each
/// slot is two bytes, one per generation; the datapath sets both (one
/// idempotent store: no atomics, 5.10 loads it), a packet is inspected when
/// either is set, and the agent's conntrack collection clears one
/// generation, then marks in it the flows it reads live, and clears the
/// other one the next time (see the agent's `replies` module).
pub mod prefilter {
    /// log2 of the bits: 4 Mi bits, 512 KiB. With 100,000 services and
    /// their backends set, about one lookup in twenty is a false positive.
    pub const BITS_LOG2: u32 = 22;
    pub const WORDS: u32 = 1 << (BITS_LOG2 - 6);

    /// What a bit stands for.
    #[repr(u8)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// A frontend's (address, port, protocol): new flows and their
        /// packets towards the service.
        Frontend = 1,
        /// A backend's (address, port, protocol) in a per-packet flow not
        /// masqueraded (whose replies go to the client itself): its reply
        /// slot (`reply_slot`), not a bit.
        Backend = 2,
        /// A host-network backend's: replies the node's stack sends, which
        /// `tc_egress` translates.
        HostBackend = 3,
    }

    /// log2 of the reply slots: 256 Ki slots of two bytes, 512 KiB. With
    /// 10,000 backends in per-packet flows, one backend reply in 26 that is
    /// no flow's takes the full path.
    pub const REPLY_SLOTS_LOG2: u32 = 18;
    /// `PREFILTER_REPLIES`' words: four slots each.
    pub const REPLY_WORDS: u32 = 1 << (REPLY_SLOTS_LOG2 - 2);
    /// Both generations of a slot set (a `u16` store over its two bytes).
    pub const REPLY_BOTH: u16 = 0x0101;

    /// An address of either family, as the bits hash it.
    pub trait Address: Copy {
        /// The address in 32 bits (IPv6: fully mixed, so addresses that
        /// differ in any word land apart).
        fn fold(&self) -> u32;
    }

    impl Address for [u8; 4] {
        #[inline(always)]
        fn fold(&self) -> u32 {
            u32::from_be_bytes(*self)
        }
    }

    impl Address for [u8; 16] {
        #[inline(always)]
        fn fold(&self) -> u32 {
            let w = |i: usize| u32::from_be_bytes([self[i], self[i + 1], self[i + 2], self[i + 3]]);
            mix(w(0) ^ mix(w(4) ^ mix(w(8) ^ mix(w(12)))))
        }
    }

    /// The bit of (`kind`, `addr`, `port`, `proto`). Fully mixed (a plain
    /// multiplicative hash kept sequential addresses apart so regularly that
    /// some other fixed endpoints always collided with them).
    #[inline(always)]
    pub fn bit<A: Address>(kind: Kind, addr: A, port: u16, proto: u8) -> u32 {
        let rest = ((port as u32) << 16) | ((proto as u32) << 8) | kind as u32;
        mix(addr.fold() ^ mix(rest)) >> (32 - BITS_LOG2)
    }

    /// The reply slot of a backend's (`addr`, `port`, `proto`): its word in
    /// `PREFILTER_REPLIES` and the byte offset of its two bytes there
    /// (generation 0, then 1).
    #[inline(always)]
    pub fn reply_slot<A: Address>(addr: A, port: u16, proto: u8) -> (u32, usize) {
        let slot = bit(Kind::Backend, addr, port, proto) >> (BITS_LOG2 - REPLY_SLOTS_LOG2);
        (slot >> 2, ((slot & 3) * 2) as usize)
    }

    /// A 32-bit finalizer (MurmurHash3's constants): every input bit moves
    /// every output bit.
    #[inline(always)]
    fn mix(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    }

    /// The word holding `bit`, and its mask there.
    #[inline(always)]
    pub fn word(bit: u32) -> (u32, u64) {
        (bit >> 6, 1 << (bit & 63))
    }
}

pub mod explain;

pub mod log_level {
    /// No records: each log point costs a compare.
    pub const OFF: u8 = 0;
    /// Refusals and drops: no endpoint, a source outside the ranges, no SNAT port.
    pub const INFO: u8 = 3;
    /// Every new flow's service and backend, and packets a flow has lost.
    pub const DEBUG: u8 = 4;
    /// Also the packets that are no service's.
    pub const TRACE: u8 = 5;
}

/// The datapath's settings, in a one-element array written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Config {
    /// The node address clients are SNATed to.
    pub snat_addr: [u8; 4],
    /// `--cluster-cidr`: sources outside it are masqueraded on ClusterIP
    /// traffic. A zero prefix length means no cluster CIDR is set.
    pub cluster_cidr: [u8; 4],
    pub cluster_cidr_prefix: u8,
    /// `--masquerade-all`.
    pub masquerade_all: u8,
    /// SNAT source ports are allocated in `snat_port_min..=snat_port_max`.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Which decision records the programs write (`log_level`); the agent
    /// rewrites it at run time.
    pub log_level: u8,
    pub _pad: u8,
    pub tcp_syn_timeout_secs: u32,
    pub tcp_established_timeout_secs: u32,
    /// After one side's FIN (half-closed).
    pub tcp_close_wait_timeout_secs: u32,
    /// After both FINs or an RST.
    pub tcp_time_wait_timeout_secs: u32,
    pub udp_timeout_secs: u32,
    /// A UDP flow that saw a reply (netfilter's "stream" timeout).
    pub udp_stream_timeout_secs: u32,
    /// `--socket-lb-host-netns-only`: the socket programs translate only for
    /// sockets of this network namespace (the node's); 0 for every socket.
    pub host_netns_cookie: u64,
    /// The node's IPv6 address clients are SNATed to (all zero: none).
    pub snat_addr6: Ipv6Octets,
    /// The IPv6 `--cluster-cidr`; a zero prefix length means none is set.
    pub cluster_cidr6: Ipv6Octets,
    pub cluster_cidr6_prefix: u8,
    pub _pad6: [u8; 3],
    /// `--bpf-lb-maglev-table-size`: the entries of every Maglev table.
    pub maglev_table_size: u32,
}

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
}

pub const COUNTER_COUNT: u32 = 11;

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
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all types are repr(C), Copy, and have no implicit padding.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for RevNat {}
    unsafe impl aya::Pod for SockRevNatKey {}
    unsafe impl aya::Pod for SockRevNat {}
    unsafe impl aya::Pod for SockEndKey {}
    unsafe impl aya::Pod for FrontendInfo {}
    unsafe impl aya::Pod for FrontendStats {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtEntryV1 {}
    unsafe impl aya::Pod for CtEntryV2 {}
    unsafe impl aya::Pod for Layouts {}
    unsafe impl aya::Pod for SourceRangeKey {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for FragRewrite {}
    unsafe impl aya::Pod for SockFlowKey {}
    unsafe impl aya::Pod for SockFlow {}
    unsafe impl aya::Pod for ServiceKey6 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for RevNat6 {}
    unsafe impl aya::Pod for SockRevNatKey6 {}
    unsafe impl aya::Pod for SockRevNat6 {}
    unsafe impl aya::Pod for CtKey6 {}
    unsafe impl aya::Pod for CtEntry6V1 {}
    unsafe impl aya::Pod for CtEntry6V2 {}
    unsafe impl aya::Pod for AffinityKey6 {}
    unsafe impl aya::Pod for SourceRangeKey6 {}
    unsafe impl aya::Pod for maglev::MaglevKey {}
    unsafe impl aya::Pod for maglev::MaglevChunk {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontend_names_are_kept_whole_or_cut_at_a_character() {
        let info = FrontendInfo::new(KIND_NODE_PORT, "default/web:http");
        assert_eq!((info.kind, info.name()), (KIND_NODE_PORT, "default/web:http"));
        // 147 bytes, then a 2-byte character across the limit.
        let mut long = [b'n'; FRONTEND_NAME_LEN + 1];
        long[FRONTEND_NAME_LEN - 1..].copy_from_slice("é".as_bytes());
        let long = core::str::from_utf8(&long).unwrap();
        assert_eq!(FrontendInfo::new(0, long).name(), &long[..FRONTEND_NAME_LEN - 1]);
    }
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<ServiceKey>(), 12);
        assert_eq!(size_of::<ServiceValue>(), 16);
        assert_eq!(size_of::<Backend>(), 8);
        assert_eq!(size_of::<RevNat>(), 8);
        assert_eq!(size_of::<SockRevNatKey>(), 16);
        assert_eq!(size_of::<SockRevNat>(), 12);
        assert_eq!(size_of::<SockEndKey>(), 24);
        assert_eq!(size_of::<FrontendInfo>(), 152);
        assert_eq!(size_of::<AffinityKey>(), 16);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<CtKey>(), 16);
        assert_eq!(size_of::<CtEntryV1>(), 32);
        assert_eq!(size_of::<CtEntryV2>(), 48);
        assert_eq!(size_of::<Layouts>(), 64);
        assert_eq!(size_of::<SourceRangeKey>(), 8);
        assert_eq!(size_of::<FragKey>(), 12);
        assert_eq!(size_of::<FragRewrite>(), 8);
        assert_eq!(size_of::<Config>(), 88);
        assert_eq!(size_of::<SockFlowKey>(), 16);
        assert_eq!(size_of::<SockFlow>(), 16);
        assert_eq!(size_of::<ServiceKey6>(), 24);
        assert_eq!(size_of::<Backend6>(), 20);
        assert_eq!(size_of::<RevNat6>(), 20);
        assert_eq!(size_of::<SockRevNatKey6>(), 32);
        assert_eq!(size_of::<SockRevNat6>(), 24);
        assert_eq!(size_of::<CtKey6>(), 40);
        assert_eq!(size_of::<CtEntry6V1>(), 56);
        assert_eq!(size_of::<CtEntry6V2>(), 72);
        assert_eq!(size_of::<AffinityKey6>(), 24);
        assert_eq!(size_of::<SourceRangeKey6>(), 20);
        assert_eq!(size_of::<maglev::MaglevKey>(), 8);
        assert_eq!(size_of::<maglev::MaglevChunk>(), 8192);
    }

    #[test]
    fn flags_keep_their_bits() {
        // The bits are part of the SERVICES and BACKENDS layouts.
        // SAFETY: both types are repr(transparent) over the integer.
        let svc = |f: ServiceFlags| unsafe { core::mem::transmute::<ServiceFlags, u16>(f) };
        let backend = |f: BackendFlags| unsafe { core::mem::transmute::<BackendFlags, u8>(f) };
        let e = ServiceFlags::EMPTY;
        let each = [
            e.with_affinity(true),
            e.with_external(true),
            e.with_local_only(true),
            e.with_drop_when_empty(true),
            e.with_source_ranges(true),
            e.with_two_scopes(true),
            e.with_serves_terminating(true),
            e.with_maglev(true),
            e.with_dsr(true),
        ];
        assert_eq!(each.map(svc), [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        let b = BackendFlags::EMPTY;
        assert_eq!([b.with_local(true), b.with_host(true)].map(backend), [1, 2]);

        let f = e.with_external(true).with_local_only(true).with_drop_when_empty(true);
        assert!(f.is_external() && f.is_local_only() && f.drops_when_empty());
        assert!(!f.is_affinity() && !f.has_source_ranges() && !f.has_two_scopes());
        assert_eq!(f.with_local_only(false), e.with_external(true).with_drop_when_empty(true));
        assert_eq!(ServiceFlags::default(), e);
    }

    fn cfg() -> Config {
        Config {
            tcp_syn_timeout_secs: 60,
            tcp_established_timeout_secs: 86_400,
            tcp_close_wait_timeout_secs: 3_600,
            tcp_time_wait_timeout_secs: 120,
            udp_timeout_secs: 30,
            udp_stream_timeout_secs: 120,
            ..Config::default()
        }
    }

    #[test]
    fn tcp_flows_walk_through_the_states() {
        use ct::*;
        let life = |flags| lifetime_secs(&cfg(), IPPROTO_TCP, flags);
        let (fwd, rev) = (0, CT_FLAG_REPLY);
        // SYN, SYN-ACK: not established until the client's ACK.
        let f = next_flags(fwd, TCP_SYN);
        assert_eq!(life(f), 60);
        let r = next_flags(rev | (f & CT_STATE_FLAGS), TCP_SYN | TCP_ACK);
        assert_eq!(life(r), 60, "a SYN-ACK alone does not establish (SYN floods)");
        let f = next_flags(fwd | (r & CT_STATE_FLAGS), TCP_ACK);
        assert_eq!(life(f), 86_400);
        // One FIN: half-closed; both: closed.
        let f = next_flags(f, TCP_FIN | TCP_ACK);
        assert_eq!(life(f), 3_600);
        assert_eq!(on_closed(f, TCP_SYN), Closed::Applies);
        let r = next_flags(rev | (f & CT_STATE_FLAGS), TCP_FIN | TCP_ACK);
        assert_eq!(life(r), 120);
        assert_eq!(on_closed(fwd | (r & CT_STATE_FLAGS), TCP_SYN), Closed::Restarts);
        assert_eq!(on_closed(fwd | (r & CT_STATE_FLAGS), TCP_ACK), Closed::Applies);
        // The backend answering a SYN the service never saw: a direct
        // connection from the same client port; the closed flow is stale.
        assert_eq!(on_closed(r, TCP_SYN | TCP_ACK), Closed::Stale);
        // An RST closes at once.
        assert_eq!(life(next_flags(fwd | CT_FLAG_ESTABLISHED, TCP_RST)), 120);
        assert_eq!(lifetime_secs(&cfg(), IPPROTO_UDP, CT_FLAG_ESTABLISHED), 30);
    }

    #[test]
    fn a_dsr_flow_is_established_by_the_clients_ack_alone() {
        use ct::*;
        let life = |flags| lifetime_secs(&cfg(), IPPROTO_TCP, flags);
        // Its replies never pass the node it entered.
        let f = next_flags(CT_FLAG_DSR, TCP_SYN);
        assert_eq!(life(f), 60);
        assert_eq!(life(next_flags(f, TCP_SYN | TCP_ACK)), 60, "no ACK of a SYN");
        assert_eq!(life(next_flags(f, TCP_ACK)), 86_400);
        assert_eq!(life(next_flags(0, TCP_ACK)), 60, "not without DSR");
    }

    #[test]
    fn a_dsr_flow_closes_at_the_clients_fin_and_a_new_syn_restarts_it() {
        use ct::*;
        let life = |flags| lifetime_secs(&cfg(), IPPROTO_TCP, flags);
        // The backend's FIN never passes the node the flow entered.
        let est = next_flags(next_flags(CT_FLAG_DSR, TCP_SYN), TCP_ACK);
        let closed = next_flags(est, TCP_FIN | TCP_ACK);
        assert_eq!(life(closed), 120, "time-wait, not an hour of close-wait");
        assert_eq!(life(next_flags(closed, TCP_ACK)), 120, "its last ACKs keep it closed");
        assert_eq!(on_closed(closed, TCP_SYN), Closed::Restarts);
        // Without DSR, one FIN is not the end.
        assert_eq!(life(next_flags(CT_FLAG_ESTABLISHED, TCP_FIN | TCP_ACK)), 3_600);
        // Nor on the backend's node, whose entry saw the pod's replies: a
        // client that half-closes may wait long for the rest.
        let learnt = CT_FLAG_DSR | CT_FLAG_SEEN_REPLY | CT_FLAG_ESTABLISHED;
        assert_eq!(life(next_flags(learnt, TCP_FIN | TCP_ACK)), 3_600);
    }

    #[test]
    fn socket_flows_live_longer_once_answered() {
        let s = 1_000_000_000u64;
        let flow = SockFlow { last_used_ns: 1_000 * s, ..SockFlow::default() };
        assert!(flow.is_fresh(&cfg(), 1_030 * s));
        assert!(!flow.is_fresh(&cfg(), 1_031 * s), "30 s without a reply");
        let answered = SockFlow { answered: 1, ..flow };
        assert!(answered.is_fresh(&cfg(), 1_120 * s));
        assert!(!answered.is_fresh(&cfg(), 1_121 * s), "120 s once answered");
    }

    #[test]
    fn snat_ports_rest_through_time_wait() {
        use ct::*;
        let s = 1_000_000_000u64;
        let now = 1_000 * s;
        let closed_at = |t: u64| t + 120 * s; // expiry of a flow closed at t
        assert!(port_reusable(&cfg(), now - 1, 0, now), "expired");
        assert!(!port_reusable(&cfg(), now + 10 * s, CT_FLAG_ESTABLISHED, now), "live");
        assert!(!port_reusable(&cfg(), closed_at(now - 59 * s), CT_FLAG_CLOSED, now));
        assert!(port_reusable(&cfg(), closed_at(now - 60 * s), CT_FLAG_CLOSED, now));
    }

    #[test]
    fn conntrack_layouts_convert_both_ways_keeping_the_flow() {
        let to = CtKey {
            saddr: [1, 2, 3, 4],
            daddr: [5, 6, 7, 8],
            sport: 9,
            dport: 10,
            ..Default::default()
        };
        let v1 = CtEntryV1::new(42, &to, 7, CT_FLAG_REPLY | CT_FLAG_ESTABLISHED);
        let v2 = CtEntryV2::from(v1);
        assert_eq!(
            (v2.expires_ns, v2.rewritten(IPPROTO_TCP), v2.rev_nat_id),
            (42, CtKey { proto: IPPROTO_TCP, ..to }, 7)
        );
        assert_eq!((v2.packets, v2.bytes), (0, 0));
        let mut counted = v2;
        counted.account(100);
        counted.account(200);
        assert_eq!(counted.counted(), (2, 300));
        assert_eq!(CtEntryV1::from(counted), v1);
        // Layout 1 counts nothing.
        let mut lean = v1;
        lean.account(100);
        assert_eq!((lean, lean.counted()), (v1, (0, 0)));
        const { assert!(CtEntryV2::COUNTS && !CtEntryV1::COUNTS) };
    }

    #[test]
    fn icmp_errors_reach_the_sender_of_the_quoted_packet() {
        use icmp::*;
        let key = |s: [u8; 4], sp, d: [u8; 4], dp| CtKey {
            saddr: s,
            daddr: d,
            sport: sp,
            dport: dp,
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        };
        let (client, node, pod, vip) =
            ([192, 168, 200, 2], [192, 168, 100, 11], [10, 244, 2, 2], [10, 96, 0, 10]);
        let router = [192, 168, 100, 2];
        let through = |err: &ErrorTuple, forward: CtKey, rewritten: CtKey| {
            assert_eq!(flow_key(&err.quoted), forward);
            translate(err, &rewritten)
        };

        // A NodePort flow SNATed to the node: a router towards the client
        // quotes the reply as the node sent it; the error goes to the pod.
        let err =
            ErrorTuple { saddr: router, daddr: node, quoted: key(node, 30080, client, 40000) };
        let back = through(&err, key(client, 40000, node, 30080), key(node, 20000, pod, 8080));
        let expect = ErrorTuple { saddr: node, daddr: pod, quoted: key(pod, 8080, node, 20000) };
        assert_eq!(back, expect, "from the node, as netfilter's masquerade makes it");

        // Without SNAT (policy Local): only the destination moves.
        let back = through(&err, key(client, 40000, node, 30080), key(client, 40000, pod, 8080));
        assert_eq!(back.saddr, router);
        assert_eq!(back.daddr, pod);
        assert_eq!(back.quoted, key(pod, 8080, client, 40000));

        // A ClusterIP flow from a pod, not SNATed: a router towards the
        // backend quotes the client's packet; the client learns of its
        // packet to the service address, from the service address.
        let client_pod = [10, 244, 1, 5];
        let err = ErrorTuple {
            saddr: router,
            daddr: client_pod,
            quoted: key(client_pod, 40000, pod, 8080),
        };
        let back =
            through(&err, key(pod, 8080, client_pod, 40000), key(vip, 80, client_pod, 40000));
        let expect =
            ErrorTuple { saddr: vip, daddr: client_pod, quoted: key(client_pod, 40000, vip, 80) };
        assert_eq!(back, expect);
    }

    #[test]
    fn icmpv6_errors_translate_as_icmp_ones() {
        use icmp::*;
        let key = |s: [u8; 16], sp, d: [u8; 16], dp| CtKey6::new(s, d, sp, dp, IPPROTO_UDP);
        let addr = |last: u8| {
            let mut a = [0xfd, 0, 0, 0x64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            a[15] = last;
            a
        };
        let (client, node, pod, router) = (addr(0x65), addr(0x11), addr(0x22), addr(2));
        let err =
            ErrorTuple { saddr: router, daddr: node, quoted: key(node, 30053, client, 40000) };
        assert_eq!(flow_key(&err.quoted), key(client, 40000, node, 30053));
        let back = translate(&err, &key(node, 20000, pod, 5353));
        let expect = ErrorTuple { saddr: node, daddr: pod, quoted: key(pod, 5353, node, 20000) };
        assert_eq!(back, expect);
    }

    #[test]
    fn counters_are_dense() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
    }

    #[test]
    fn prefilter_spreads_services_and_keeps_kinds_apart() {
        extern crate std;
        use prefilter::{BITS_LOG2, Kind, bit};
        let mut set = std::vec![0u64; 1 << (BITS_LOG2 - 6)];
        let mut mark = |b: u32| set[(b >> 6) as usize] |= 1 << (b & 63);
        // 100,000 ClusterIPs of one /12 at port 80, and a backend each.
        for i in 0..100_000u32 {
            mark(bit(Kind::Frontend, (0x0a60_000a + i).to_be_bytes(), 80, IPPROTO_TCP));
            mark(bit(Kind::Backend, (0x0af4_0000 + i).to_be_bytes(), 8080, IPPROTO_TCP));
        }
        let is_set = |b: u32| set[(b >> 6) as usize] & (1 << (b & 63)) != 0;
        assert!(is_set(bit(Kind::Frontend, 0x0a60_000au32.to_be_bytes(), 80, IPPROTO_TCP)));
        // The packet_bench miss: a fixed endpoint, not a frontend.
        assert!(!is_set(bit(Kind::Frontend, [192, 168, 100, 11], 22, IPPROTO_TCP)));
        // Pod-to-pod traffic and other ports: few false positives.
        let mut hits = 0;
        for i in 0..100_000u32 {
            let pod = (0x0af4_0000 + i).to_be_bytes();
            hits += u32::from(is_set(bit(Kind::Frontend, pod, 8080, IPPROTO_TCP)));
            hits += u32::from(is_set(bit(Kind::Backend, pod, 40000, IPPROTO_TCP)));
            hits += u32::from(is_set(bit(Kind::HostBackend, pod, 8080, IPPROTO_TCP)));
        }
        assert!(hits < 300_000 / 15, "{hits} false positives of 300,000");
    }

    #[test]
    fn prefilter_spreads_ipv6_addresses_and_their_reply_slots() {
        extern crate std;
        use prefilter::{BITS_LOG2, Kind, REPLY_SLOTS_LOG2, bit, reply_slot};
        let v6 = |prefix: u8, i: u32| {
            let mut a = [0xfd, 0, 0, prefix, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            a[12..].copy_from_slice(&i.to_be_bytes());
            a
        };
        let mut set = std::vec![false; 1 << BITS_LOG2];
        let mut slots = std::vec![false; 1 << REPLY_SLOTS_LOG2];
        // 100,000 IPv6 ClusterIPs at port 80; 10,000 backends in flows.
        for i in 0..100_000u32 {
            set[bit(Kind::Frontend, v6(0x96, i), 80, IPPROTO_TCP) as usize] = true;
        }
        for i in 0..10_000u32 {
            let (word, offset) = reply_slot(v6(0x10, i), 8080, IPPROTO_TCP);
            slots[word as usize * 4 + offset / 2] = true;
        }
        let (mut hits, mut replies) = (0, 0);
        for i in 0..100_000u32 {
            hits += u32::from(set[bit(Kind::Frontend, v6(0x10, i), 8080, IPPROTO_TCP) as usize]);
            let (word, offset) = reply_slot(v6(0x10, i + 10_000), 8080, IPPROTO_TCP);
            replies += u32::from(slots[word as usize * 4 + offset / 2]);
        }
        assert!(hits < 100_000 / 30, "{hits} false positives of 100,000");
        assert!(replies < 100_000 / 20, "{replies} backends of no flow inspected, of 100,000");
    }
}
