//! The maps, declared with BTF so `bpftool map dump` prints field names.
//! The agent pins them under `--bpffs-root` by these names.

use crate::packet::{DsrPending, Flow};
use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray},
    macros::{btf_map, map},
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, COUNTER_COUNT, Config, Counter, CtEntry, CtKey, FragKey,
    FragRewrite, FrontendInfo, FrontendStats, Layouts, MAX_AFFINITY, MAX_BACKENDS, MAX_CONNTRACK,
    MAX_FRAGMENTS, MAX_REV_NAT, MAX_SERVICE_ENTRIES, MAX_SOCK_ENDS, MAX_SOCK_FLOWS,
    MAX_SOCK_REV_NAT, MAX_SOURCE_RANGES, MAX_XDP_INTERFACES, RevNat, ServiceKey, ServiceValue,
    SockEndKey, SockFlow, SockFlowKey, SockRevNat, SockRevNatKey, SourceRangeKey, prefilter,
};
use proxy_common::{
    AffinityKey6, Backend6, CtEntry6, CtKey6, MAX_AFFINITY6, MAX_CONNTRACK6, MAX_SOCK_REV_NAT6,
    RevNat6, ServiceKey6, SockRevNat6, SockRevNatKey6, SourceRangeKey6, TC_NEW_PROGRAMS,
    TC_SCTP_PROGRAMS, TC6_PROGRAMS,
};
use proxy_common::{
    MAX_MAGLEV_CHUNKS,
    maglev::{MaglevChunk, MaglevKey},
};

/// The service maps are allocated per entry, as Cilium's are by default:
/// sized for a large cluster (and with headroom to grow), a preallocated
/// map would cost its whole size in memory and in the time to clear it
/// before the first write (hundreds of MiB at 100,000 services), while a
/// lookup costs the same. Only the agent writes them.
#[btf_map]
pub static SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { MAX_SERVICE_ENTRIES as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map]
pub static BACKENDS: HashMap<
    u32,
    Backend,
    { MAX_BACKENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map]
pub static REV_NAT: HashMap<u32, RevNat, { MAX_REV_NAT as usize }, { BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// The Maglev tables of the frontends that use one (`proxy_common::maglev`),
/// in chunks, by reverse-NAT id: allocated per entry, so a cluster without
/// Maglev pays nothing. Only the agent writes them.
#[btf_map]
pub static MAGLEV: HashMap<
    MaglevKey,
    MaglevChunk,
    { MAX_MAGLEV_CHUNKS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// The service port name and kind of each frontend, by reverse-NAT id: for
/// operators only (the programs never read it), allocated per entry.
#[btf_map]
pub static FRONTEND_INFO: HashMap<
    u32,
    FrontendInfo,
    { MAX_REV_NAT as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// The IPv6 family's services, backends and reverse-NAT addresses, by the
/// same ids as the IPv4 maps (allocated per entry too).
#[btf_map]
pub static SERVICES6: HashMap<
    ServiceKey6,
    ServiceValue,
    { MAX_SERVICE_ENTRIES as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map]
pub static BACKENDS6: HashMap<
    u32,
    Backend6,
    { MAX_BACKENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map]
pub static REV_NAT6: HashMap<
    u32,
    RevNat6,
    { MAX_REV_NAT as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map]
pub static SOCK_REV_NAT6: LruHashMap<SockRevNatKey6, SockRevNat6, { MAX_SOCK_REV_NAT6 as usize }> =
    LruHashMap::new();

#[btf_map]
pub static SOCK_REV_NAT: LruHashMap<SockRevNatKey, SockRevNat, { MAX_SOCK_REV_NAT as usize }> =
    LruHashMap::new();

/// Unconnected UDP: the backend each socket's datagrams to a frontend go
/// to, while the flow is fresh.
#[btf_map]
pub static SOCK_FLOWS: LruHashMap<SockFlowKey, SockFlow, { MAX_SOCK_FLOWS as usize }> =
    LruHashMap::new();

/// Backends whose connected sockets the socket iterators end (see
/// `sock_end`); filled and emptied by the agent around each run.
#[btf_map]
pub static SOCK_ENDS: HashMap<SockEndKey, u8, { MAX_SOCK_ENDS as usize }> = HashMap::new();

#[btf_map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue, { MAX_AFFINITY as usize }> =
    LruHashMap::new();

/// Both directions of every flow translated per packet (tc).
#[btf_map]
pub static CONNTRACK: LruHashMap<CtKey, CtEntry, { MAX_CONNTRACK as usize }> = LruHashMap::new();

/// The IPv6 flows translated per packet: as `CONNTRACK`.
#[btf_map]
pub static CONNTRACK6: LruHashMap<CtKey6, CtEntry6, { MAX_CONNTRACK6 as usize }> =
    LruHashMap::new();

/// Per-packet session affinity of IPv6 clients (`AffinityKey6`).
#[btf_map]
pub static AFFINITY6: LruHashMap<AffinityKey6, AffinityValue, { MAX_AFFINITY6 as usize }> =
    LruHashMap::new();

/// The IPv6 per-packet programs (`proxy_common::TC6_PROGRAMS`), entered by
/// a tail call; the agent fills it.
#[btf_map]
pub static TC6: ProgramArray<{ TC6_PROGRAMS.len() }> = ProgramArray::new();

/// The SCTP per-packet programs (`proxy_common::TC_SCTP_PROGRAMS`),
/// entered by a tail call; the agent fills it once a frontend needs them.
#[btf_map]
pub static TC_SCTP: ProgramArray<{ TC_SCTP_PROGRAMS.len() }> = ProgramArray::new();

/// The new-flow program (`proxy_common::TC_NEW_PROGRAMS`), entered by a
/// tail call from `tc_ingress`; the agent fills it before attaching.
#[btf_map]
pub static TC_NEW: ProgramArray<{ TC_NEW_PROGRAMS.len() }> = ProgramArray::new();

/// The IPv6 per-packet path's packet and tuples (`packet::Flow`), one per
/// CPU: off the stack. No BTF: scratch space, never read from outside.
#[map]
pub static FLOW6: aya_ebpf::maps::PerCpuArray<Flow<CtKey6>> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// What direct server return does to the packet being forwarded
/// (`packet::DsrPending`), one per CPU: set before `forward`, read there
/// (`Family::pend_dsr`). No BTF: scratch space, never read from outside.
#[map]
pub static DSR_PENDING: aya_ebpf::maps::PerCpuArray<DsrPending<[u8; 4]>> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// `DSR_PENDING` of the IPv6 path.
#[map]
pub static DSR_PENDING6: aya_ebpf::maps::PerCpuArray<DsrPending<[u8; 16]>> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// loadBalancerSourceRanges of IPv6 frontends: as `SOURCE_RANGES`.
#[btf_map]
pub static SOURCE_RANGES6: LpmTrie<SourceRangeKey6, u8, { MAX_SOURCE_RANGES as usize }> =
    LpmTrie::new();

/// loadBalancerSourceRanges: (frontend, source prefix) -> 1.
#[btf_map]
pub static SOURCE_RANGES: LpmTrie<SourceRangeKey, u8, { MAX_SOURCE_RANGES as usize }> =
    LpmTrie::new();

#[btf_map]
pub static CONFIG: Array<Config, 1> = Array::new();

/// The per-packet programs' pre-filter (`proxy_common::prefilter`): bits
/// the agent sets, the programs only read.
#[btf_map]
pub static PREFILTER: Array<u64, { prefilter::WORDS as usize }> = Array::new();

/// The pre-filter's reply slots (`proxy_common::prefilter::reply_slot`):
/// set by the programs for the flows they create, cleared a generation at a
/// time by the agent, which maps the array to write single bytes.
#[btf_map]
pub static PREFILTER_REPLIES: Array<
    u64,
    { prefilter::REPLY_WORDS as usize },
    { BPF_F_MMAPABLE as usize },
> = Array::new();

/// Datagrams whose first fragment was translated: their later fragments
/// (no ports) get the same addresses.
#[btf_map]
pub static FRAGMENTS: LruHashMap<FragKey, FragRewrite, { MAX_FRAGMENTS as usize }> =
    LruHashMap::new();

/// The layout version of each map, written by the agent: the next agent
/// reads it to tell which pinned maps it can carry over.
#[btf_map]
pub static LAYOUT: Array<Layouts, 1> = Array::new();

/// Per-frontend traffic counters by reverse-NAT id (`stats`): allocated
/// per entry, made by the programs at a frontend's first event, deleted by
/// the agent with the id.
#[btf_map]
pub static FRONTEND_STATS: PerCpuHashMap<
    u32,
    FrontendStats,
    { MAX_REV_NAT as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

/// A zero `FrontendStats`, never written: the value `FRONTEND_STATS`'
/// entries are made from (off the stack).
#[btf_map]
pub static STATS_ZERO: Array<FrontendStats, 1> = Array::new();

/// The IPv6 XDP program (`xdp_ingress6`), entered by tail call from
/// `xdp_ingress`; empty: IPv6 packets go up to tc untouched.
#[btf_map]
pub static XDP6: ProgramArray<1> = ProgramArray::new();

/// The node interfaces carrying `xdp_ingress`, by ifindex: where XDP may
/// send a packet on (a driver takes XDP frames only where XDP is set up).
/// Only the agent writes it.
#[map]
pub static XDP_EGRESS: aya_ebpf::maps::DevMapHash =
    aya_ebpf::maps::DevMapHash::with_max_entries(MAX_XDP_INTERFACES, 0);

#[btf_map]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_COUNT as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, and BPF programs are not preempted on one CPU
        // by another program of these types.
        unsafe { *slot += 1 };
    }
}
