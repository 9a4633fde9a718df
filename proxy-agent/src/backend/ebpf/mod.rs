//! The eBPF backend: loads the programs, attaches the socket-LB ones to a
//! cgroup and the per-packet one to the ingress of node and pod interfaces
//! (TCX), pins maps and links under the bpffs root, keeps the maps in step
//! with the plan, and keeps the conntrack map clean.
//!
//! Pin layout (`--bpffs-root`, default `/sys/fs/bpf/proxy`):
//! `maps/<MAP>` for every map, `links/<program>` for the cgroup attachments
//! and `links/tc-<interface>` for the TCX ones, so the datapath keeps serving
//! while the agent restarts and `bpftool` can inspect it (clsact filters
//! live in the kernel on their own). A new agent carries the state maps over
//! ([`carry`]), attaches its programs beside the old ones (or in place of the
//! old filters), then retires the old pins; `cleanup` removes them all.

pub mod batch;
pub mod carry;
pub mod conntrack;
pub mod datapath;
pub mod departures;
pub mod entries;
pub mod explain;
pub mod flow_counts;
pub mod frontend_stats;
mod installed;
pub mod prefilter;
pub mod records;
pub mod replies;
pub mod sock_end;
pub mod sync;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{
        Array, HashMap, Map, MapData, MapError, PerCpuArray, ProgramArray,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{
        CgroupAttachMode, CgroupSockAddr, Link, LinkOrder, ProgramError, SchedClassifier,
        TcAttachType, TestRun, TestRunOptions,
        links::FdLink,
        tc::{
            NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle, qdisc_add_clsact,
            qdisc_detach_program,
        },
    },
    util::KernelVersion,
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, Backend6, Config, Counter, CtEntry, CtKey, FrontendInfo,
    FrontendStats, IPPROTO_TCP, IPPROTO_UDP, Layouts, MAX_BACKENDS, MAX_REV_NAT,
    MAX_SERVICE_ENTRIES, RevNat, RevNat6, SOURCE_RANGE_PREFIX_BITS, ServiceKey, ServiceKey6,
    ServiceValue, SockFlow, SockFlowKey, SockRevNat, SockRevNat6, SockRevNatKey, SockRevNatKey6,
    SourceRangeKey,
    maglev::{MaglevChunk, MaglevKey},
    map_names,
};
use proxy_common::{
    AffinityKey6, CtEntry6, CtKey6, CtTuple, CtValue, SourceRangeKey6, TC6_PROGRAMS,
};

use carry::{Carry, Conversion, Pinned, STATE_MAPS};
use departures::Departures;
use entries::{BackendEntry, RevNatEntry, SlotKey};
use flow_counts::{FlowCounts, Growth};
use prefilter::Prefilter;
use replies::Replies;
use sock_end::{Iterators, SocketDestroy, SocketEnding};
pub use sync::{AffinityPurge, SyncError, SyncReport, SyncState};
use sync::{BatchKind, MapOp, MapWriter, apply_each};

use crate::{
    model::IpFamily,
    plan::{Frontend, Plan},
    sockets::Peer,
};

/// The socket-LB programs, by their function names in proxy-ebpf: IPv4
/// sockets, and IPv6 ones reaching IPv4 services through v4-mapped
/// addresses.
pub const PROGRAMS: [&str; 8] = [
    "connect4",
    "sendmsg4",
    "recvmsg4",
    "getpeername4",
    "connect6",
    "sendmsg6",
    "recvmsg6",
    "getpeername6",
];
/// The per-packet program, attached to the ingress of node and pod interfaces.
pub const TC_INGRESS: &str = "tc_ingress";
/// Its egress companion (replies the stack sends for translated flows).
pub const TC_EGRESS: &str = "tc_egress";
/// The ingress program of pod interfaces whose pods the socket LB covers:
/// replies of per-packet flows only.
pub const TC_POD_REPLIES: &str = "tc_pod_replies";
/// A per-packet program: its name, hook, and the prefix of its pin under
/// `links/`. Both ingress programs pin as `tc-IFACE`, so a role change
/// replaces one with the other in place.
type TcHook = (&'static str, TcAttachType, &'static str);
const INGRESS: TcHook = (TC_INGRESS, TcAttachType::Ingress, "tc");
const EGRESS: TcHook = (TC_EGRESS, TcAttachType::Egress, "tc-egress");
const POD_REPLIES: TcHook = (TC_POD_REPLIES, TcAttachType::Ingress, "tc");
/// Every per-packet program (loading, cleanup).
const TC_PROGRAMS: [TcHook; 3] = [INGRESS, EGRESS, POD_REPLIES];

/// What the per-packet programs do on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TcRole {
    /// Translate new flows to frontends and the flows they track, both
    /// directions: node interfaces, and pod interfaces whose pods' sockets
    /// the socket LB does not all cover.
    Full,
    /// Only replies of per-packet flows, at ingress: pod interfaces whose
    /// pods' connections the socket LB translates (it covers the root
    /// cgroup for every network namespace), so a pod never sends to a
    /// frontend, and no reply the stack sends a pod was per-packet
    /// translated.
    PodReplies,
}

impl TcRole {
    fn hooks(self) -> &'static [TcHook] {
        match self {
            TcRole::Full => &[INGRESS, EGRESS],
            TcRole::PodReplies => &[POD_REPLIES],
        }
    }

    /// The hooks the role leaves empty.
    fn unused(self) -> impl Iterator<Item = TcHook> {
        [INGRESS, EGRESS]
            .into_iter()
            .filter(move |(_, _, prefix)| self.hooks().iter().all(|h| h.2 != *prefix))
    }
}

/// The socket programs' global saying whether they may call
/// `bpf_set_retval`.
const SET_RETVAL: &str = "SET_RETVAL";

/// Whether the socket programs can fail `connect()` with ECONNREFUSED
/// (`bpf_set_retval`, Linux 5.18+); without it a refusal is EPERM.
pub fn has_set_retval() -> bool {
    aya::sys::is_helper_supported(
        aya::programs::ProgramType::CgroupSockAddr,
        aya::sys::BpfHelper::BPF_FUNC_set_retval,
    )
    .unwrap_or(false)
}

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("loading the BPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("BPF object has no {what} {name}")]
    Missing { what: &'static str, name: &'static str },
    #[error("program {name}: {source}")]
    Program { name: &'static str, source: ProgramError },
    #[error("program {name}: its link cannot be pinned (kernel older than 5.7?): {source}")]
    Link { name: &'static str, source: aya::programs::links::LinkError },
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: MapError },
    #[error("{action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: io::Error },
    #[error("pinning {path}: {source}")]
    Pin { path: PathBuf, source: aya::pin::PinError },
    #[error(
        "the pinned maps have the layouts {pinned:?}, this build {:?}: run the running agent's own binary",
        Layouts::CURRENT
    )]
    Layout { pinned: Layouts },
    #[error("the thread loading the programs stopped before it finished")]
    VerifierThread,
}

/// Loads every program of the object, on up to [`VERIFIER_THREADS`]
/// threads, each taking the next program in turn: each is verified on its
/// own, and all of them take seconds of CPU on the way to serving at every
/// start. The per-packet entry points come first: `tc_ingress` and
/// `tc_ingress6` are most of that time (1.3 s and 0.6 s of 2.3 s here), so
/// each starts on a thread of its own.
fn verify_programs(ebpf: &mut Ebpf) -> Result<(), EbpfError> {
    let tc = TC_PROGRAMS.map(|(name, _, _)| name);
    let names: Vec<&'static str> = tc.into_iter().chain(TC6_PROGRAMS).chain(PROGRAMS).collect();
    let mut programs: Vec<_> = ebpf
        .programs_mut()
        .filter_map(|(name, program)| Some((*names.iter().find(|n| **n == name)?, program)))
        .collect();
    if let Some(name) = names.iter().find(|n| !programs.iter().any(|(p, _)| p == *n)) {
        return Err(EbpfError::Missing { what: "program", name });
    }
    let heaviest = [INGRESS.0, TC6_PROGRAMS[0]];
    programs.sort_by_key(|(name, _)| !heaviest.contains(name));
    let queue = std::sync::Mutex::new(programs.into_iter());
    let next = || queue.lock().unwrap_or_else(|e| e.into_inner()).next();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(VERIFIER_THREADS);
    std::thread::scope(|scope| {
        let loading: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    std::iter::from_fn(next).try_for_each(|(name, p)| load_program(name, p))
                })
            })
            .collect();
        loading
            .into_iter()
            .try_for_each(|thread| thread.join().unwrap_or(Err(EbpfError::VerifierThread)))
    })
}

/// At most this many programs are verified at once.
const VERIFIER_THREADS: usize = 4;

fn load_program(name: &'static str, program: &mut aya::programs::Program) -> Result<(), EbpfError> {
    let err = |source| EbpfError::Program { name, source };
    if PROGRAMS.contains(&name) {
        <&mut CgroupSockAddr>::try_from(program).map_err(err)?.load().map_err(err)
    } else {
        <&mut SchedClassifier>::try_from(program).map_err(err)?.load().map_err(err)
    }
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> EbpfError {
    let path = path.to_path_buf();
    move |source| EbpfError::Io { action, path, source }
}

/// The maps the agent writes or reads.
struct Maps {
    services: Map,
    backends: Map,
    rev_nat: Map,
    services6: Map,
    backends6: Map,
    rev_nat6: Map,
    sock_rev_nat6: Map,
    conntrack6: Map,
    affinity6: Map,
    source_ranges6: Map,
    tc6: Map,
    frontend_info: Map,
    frontend_stats: Map,
    sock_rev_nat: Map,
    affinity: Map,
    conntrack: Map,
    source_ranges: Map,
    maglev: Map,
    config: Map,
    fragments: Map,
    sock_flows: Map,
    counters: Map,
    layout: Map,
    prefilter: Prefilter,
    /// `proxy-agent monitor`'s, pinned for it (`proxy_common::monitor`).
    monitor: [Map; 3],
    replies: Replies,
}

impl Maps {
    fn take(ebpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let mut take = |name: &'static str| {
            ebpf.take_map(name).ok_or(EbpfError::Missing { what: "map", name })
        };
        Ok(Self {
            services: take(map_names::SERVICES)?,
            backends: take(map_names::BACKENDS)?,
            rev_nat: take(map_names::REV_NAT)?,
            services6: take(map_names::SERVICES6)?,
            backends6: take(map_names::BACKENDS6)?,
            rev_nat6: take(map_names::REV_NAT6)?,
            sock_rev_nat6: take(map_names::SOCK_REV_NAT6)?,
            conntrack6: take(map_names::CONNTRACK6)?,
            affinity6: take(map_names::AFFINITY6)?,
            source_ranges6: take(map_names::SOURCE_RANGES6)?,
            tc6: take(map_names::TC6)?,
            frontend_info: take(map_names::FRONTEND_INFO)?,
            frontend_stats: take(map_names::FRONTEND_STATS)?,
            sock_rev_nat: take(map_names::SOCK_REV_NAT)?,
            affinity: take(map_names::AFFINITY)?,
            conntrack: take(map_names::CONNTRACK)?,
            source_ranges: take(map_names::SOURCE_RANGES)?,
            maglev: take(map_names::MAGLEV)?,
            config: take(map_names::CONFIG)?,
            fragments: take(map_names::FRAGMENTS)?,
            sock_flows: take(map_names::SOCK_FLOWS)?,
            counters: take(map_names::COUNTERS)?,
            layout: take(map_names::LAYOUT)?,
            prefilter: Prefilter::new(take(map_names::PREFILTER)?),
            monitor: [
                take(map_names::EVENTS)?,
                take(map_names::MONITOR)?,
                take(map_names::MONITOR_LOST)?,
            ],
            replies: Replies::new(take(map_names::PREFILTER_REPLIES)?)
                .map_err(|source| EbpfError::Map { name: map_names::PREFILTER_REPLIES, source })?,
        })
    }

    /// A map whose entries outlive the agent, by name.
    fn state_map(&mut self, name: &str) -> &mut Map {
        match name {
            map_names::CONNTRACK => &mut self.conntrack,
            map_names::AFFINITY => &mut self.affinity,
            map_names::SOCK_REV_NAT => &mut self.sock_rev_nat,
            map_names::SOCK_FLOWS => &mut self.sock_flows,
            map_names::SOCK_REV_NAT6 => &mut self.sock_rev_nat6,
            map_names::CONNTRACK6 => &mut self.conntrack6,
            map_names::AFFINITY6 => &mut self.affinity6,
            _ => &mut self.fragments,
        }
    }

    fn by_name(&self) -> [(&'static str, &Map); 28] {
        [
            (map_names::SERVICES, &self.services),
            (map_names::MAGLEV, &self.maglev),
            (map_names::BACKENDS, &self.backends),
            (map_names::REV_NAT, &self.rev_nat),
            (map_names::FRONTEND_INFO, &self.frontend_info),
            (map_names::FRONTEND_STATS, &self.frontend_stats),
            (map_names::SOCK_REV_NAT, &self.sock_rev_nat),
            (map_names::AFFINITY, &self.affinity),
            (map_names::CONNTRACK, &self.conntrack),
            (map_names::SOURCE_RANGES, &self.source_ranges),
            (map_names::CONFIG, &self.config),
            (map_names::FRAGMENTS, &self.fragments),
            (map_names::SOCK_FLOWS, &self.sock_flows),
            (map_names::COUNTERS, &self.counters),
            (map_names::LAYOUT, &self.layout),
            (map_names::PREFILTER, self.prefilter.map()),
            (map_names::PREFILTER_REPLIES, self.replies.map()),
            (map_names::SERVICES6, &self.services6),
            (map_names::BACKENDS6, &self.backends6),
            (map_names::REV_NAT6, &self.rev_nat6),
            (map_names::SOCK_REV_NAT6, &self.sock_rev_nat6),
            (map_names::CONNTRACK6, &self.conntrack6),
            (map_names::AFFINITY6, &self.affinity6),
            (map_names::SOURCE_RANGES6, &self.source_ranges6),
            // Pinned so the IPv6 programs stay in it while no agent runs
            // (the kernel empties a program array its last holder closes).
            (map_names::TC6, &self.tc6),
            (map_names::EVENTS, &self.monitor[0]),
            (map_names::MONITOR, &self.monitor[1]),
            (map_names::MONITOR_LOST, &self.monitor[2]),
        ]
    }

    /// Puts the IPv6 per-packet programs in `TC6`, where the IPv4 ones
    /// enter them by tail call.
    fn fill_tc6(&mut self, ebpf: &mut Ebpf) -> Result<(), EbpfError> {
        let name = map_names::TC6;
        let mut array = ProgramArray::try_from(&mut self.tc6)
            .map_err(|source| EbpfError::Map { name, source })?;
        for (slot, program_name) in (0..).zip(TC6_PROGRAMS) {
            let prog = program::<SchedClassifier>(ebpf, program_name)?;
            let fd =
                prog.fd().map_err(|source| EbpfError::Program { name: program_name, source })?;
            array.set(slot, fd, 0).map_err(|source| EbpfError::Map { name, source })?;
        }
        Ok(())
    }
}

impl MapWriter for Maps {
    fn apply(&mut self, op: &MapOp) -> Result<(), io::Error> {
        let mut write = || -> Result<(), MapError> {
            // The pre-filter lets the entry's packets through before it exists.
            self.prefilter.set(prefilter::bits_of(op))?;
            match op {
                MapOp::PutBackend { id, backend: BackendEntry::V4(backend) } => {
                    HashMap::<_, u32, Backend>::try_from(&mut self.backends)?.insert(id, backend, 0)
                }
                MapOp::PutBackend { id, backend: BackendEntry::V6(backend) } => {
                    HashMap::<_, u32, Backend6>::try_from(&mut self.backends6)?
                        .insert(id, backend, 0)
                }
                MapOp::DeleteBackend { id, family: IpFamily::V4 } => {
                    HashMap::<_, u32, Backend>::try_from(&mut self.backends)?.remove(id)
                }
                MapOp::DeleteBackend { id, family: IpFamily::V6 } => {
                    HashMap::<_, u32, Backend6>::try_from(&mut self.backends6)?.remove(id)
                }
                MapOp::PutRevNat { id, value, owner, .. } => {
                    match value {
                        RevNatEntry::V4(value) => {
                            HashMap::<_, u32, RevNat>::try_from(&mut self.rev_nat)?
                                .insert(id, value, 0)?
                        }
                        RevNatEntry::V6(value) => {
                            HashMap::<_, u32, RevNat6>::try_from(&mut self.rev_nat6)?
                                .insert(id, value, 0)?
                        }
                    }
                    HashMap::<_, u32, FrontendInfo>::try_from(&mut self.frontend_info)?.insert(
                        id,
                        owner.info(),
                        0,
                    )
                }
                MapOp::DeleteRevNat { frontend, id } => {
                    // Absent when a previous write failed: fine.
                    let _ = HashMap::<_, u32, FrontendInfo>::try_from(&mut self.frontend_info)?
                        .remove(id);
                    frontend_stats::remove(&mut self.frontend_stats, *id)?;
                    match frontend.family() {
                        IpFamily::V4 => {
                            HashMap::<_, u32, RevNat>::try_from(&mut self.rev_nat)?.remove(id)
                        }
                        IpFamily::V6 => {
                            HashMap::<_, u32, RevNat6>::try_from(&mut self.rev_nat6)?.remove(id)
                        }
                    }
                }
                MapOp::PutService { key: SlotKey::V4(key), value } => {
                    HashMap::<_, ServiceKey, ServiceValue>::try_from(&mut self.services)?
                        .insert(key, value, 0)
                }
                MapOp::PutService { key: SlotKey::V6(key), value } => {
                    HashMap::<_, ServiceKey6, ServiceValue>::try_from(&mut self.services6)?
                        .insert(key, value, 0)
                }
                MapOp::DeleteService { key: SlotKey::V4(key) } => {
                    HashMap::<_, ServiceKey, ServiceValue>::try_from(&mut self.services)?
                        .remove(key)
                }
                MapOp::DeleteService { key: SlotKey::V6(key) } => {
                    HashMap::<_, ServiceKey6, ServiceValue>::try_from(&mut self.services6)?
                        .remove(key)
                }
                MapOp::PutSourceRange { rev_nat_id, cidr, .. } => {
                    self.source_ranges(*rev_nat_id, cidr, true)
                }
                MapOp::DeleteSourceRange { rev_nat_id, cidr, .. } => {
                    self.source_ranges(*rev_nat_id, cidr, false)
                }
                MapOp::PutMaglev { rev_nat_id, chunk, table, .. } => {
                    let key = MaglevKey { rev_nat_id: *rev_nat_id, chunk: *chunk };
                    HashMap::<_, MaglevKey, MaglevChunk>::try_from(&mut self.maglev)?.insert(
                        key,
                        table.chunk(*chunk),
                        0,
                    )
                }
                MapOp::DeleteMaglev { rev_nat_id, chunks, .. } => {
                    let mut map = HashMap::<_, MaglevKey, MaglevChunk>::try_from(&mut self.maglev)?;
                    for chunk in 0..*chunks {
                        // Absent when a previous write failed: fine.
                        let _ = map.remove(&MaglevKey { rev_nat_id: *rev_nat_id, chunk });
                    }
                    Ok(())
                }
            }
        };
        write().map_err(io::Error::other)
    }

    fn apply_run(&mut self, ops: &[MapOp]) -> (usize, Result<(), io::Error>) {
        // A single write needs no batch.
        if ops.len() < 2 {
            return apply_each(self, ops);
        }
        // The pre-filter lets the entries' packets through before they exist.
        if let Err(e) = self.prefilter.set(ops.iter().flat_map(prefilter::bits_of)) {
            return (0, Err(io::Error::other(e)));
        }
        self.apply_batched(ops).unwrap_or_else(|| apply_each(self, ops))
    }
}

/// The fd of a hash map (plain or LRU), for the batched operations.
fn hash_fd(map: &Map) -> Option<std::os::fd::BorrowedFd<'_>> {
    use std::os::fd::AsFd;
    match map {
        Map::HashMap(data) | Map::LruHashMap(data) => Some(data.fd().as_fd()),
        _ => None,
    }
}

impl Maps {
    /// `ops` (of one [`MapOp::batch_kind`]) in batches, where the kernel
    /// and the map have them.
    fn apply_batched(&self, ops: &[MapOp]) -> Option<batch::Outcome> {
        let fd = match ops.first()?.batch_kind()? {
            BatchKind::PutService(IpFamily::V4) | BatchKind::DeleteService(IpFamily::V4) => {
                hash_fd(&self.services)?
            }
            BatchKind::PutService(IpFamily::V6) | BatchKind::DeleteService(IpFamily::V6) => {
                hash_fd(&self.services6)?
            }
            BatchKind::PutBackend(IpFamily::V4) | BatchKind::DeleteBackend(IpFamily::V4) => {
                hash_fd(&self.backends)?
            }
            BatchKind::PutBackend(IpFamily::V6) | BatchKind::DeleteBackend(IpFamily::V6) => {
                hash_fd(&self.backends6)?
            }
        };
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for op in ops {
            let (key, value) = op.entry()?;
            keys.extend_from_slice(key);
            values.extend_from_slice(value.unwrap_or_default());
        }
        batch::write(fd, &keys, &values, ops.len())
    }
}

impl Maps {
    /// Writes (or, `put` false, deletes) a frontend's source range in its
    /// family's trie: each family's programs look up their own, so a range
    /// of the other family than the frontend's matches none of its clients,
    /// as kube-proxy's per-family rules ignore it.
    fn source_ranges(
        &mut self,
        rev_nat_id: u32,
        cidr: &crate::model::Cidr,
        put: bool,
    ) -> Result<(), MapError> {
        let bits = SOURCE_RANGE_PREFIX_BITS + cidr.len as u32;
        match cidr.addr {
            IpAddr::V4(addr) => {
                let key = Key::new(bits, SourceRangeKey { rev_nat_id, address: addr.octets() });
                let mut trie = LpmTrie::<_, SourceRangeKey, u8>::try_from(&mut self.source_ranges)?;
                if put { trie.insert(&key, 1, 0) } else { trie.remove(&key) }
            }
            IpAddr::V6(addr) => {
                let key = Key::new(bits, SourceRangeKey6 { rev_nat_id, address: addr.octets() });
                let mut trie =
                    LpmTrie::<_, SourceRangeKey6, u8>::try_from(&mut self.source_ranges6)?;
                if put { trie.insert(&key, 1, 0) } else { trie.remove(&key) }
            }
        }
    }
}

/// How the per-packet program is attached to an interface's ingress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcAttach {
    /// A TCX link (kernel 6.6+), pinned: it outlives the agent and runs
    /// beside other programs.
    Tcx,
    /// A classic clsact filter (any kernel with clsact), at a priority and
    /// handle of its own: it lives in the kernel, serving while no agent
    /// runs; the next agent replaces its program in place.
    Netlink,
}

/// Our clsact filters' place on each hook: the next agent finds and replaces
/// them there, atomically (no packet meets a hook without the program).
const FILTER_PRIORITY: u16 = 1;
const FILTER_HANDLE: TcHandle = TcHandle::new(0, 0x7078);

impl TcAttach {
    /// TCX where the kernel has it, clsact filters elsewhere.
    pub fn for_this_kernel() -> Self {
        match KernelVersion::current() {
            Ok(v) if v >= KernelVersion::new(6, 6, 0) => TcAttach::Tcx,
            _ => TcAttach::Netlink,
        }
    }
}

/// Loaded programs and their maps.
pub struct EbpfBackend {
    ebpf: Ebpf,
    maps: Maps,
    state: SyncState,
    tc_mode: TcAttach,
    /// Interfaces running the per-packet programs, and which (held by pins
    /// or, as filters, by the kernel).
    tc_interfaces: BTreeMap<String, TcRole>,
    /// What became of each state map of the previous agent.
    carried: Vec<(&'static str, Carry)>,
    /// Previous maps whose entries are converted into ours: once more after
    /// the takeover, for the flows the old programs made meanwhile.
    conversions: Vec<Conversion>,
    /// How sockets connected to departed backends are ended, and of which
    /// protocols (see [`EbpfBackend::choose_socket_ending`]).
    socket_ending: SocketEnding,
    socket_protocols: Vec<u8>,
    /// The task reading these programs' decision records, stopped with them.
    records: Option<records::Reader>,
    /// What each conntrack entry counted at the last read (`flow_counts`).
    flow_counts: FlowCounts<CtKey>,
    flow_counts6: FlowCounts<CtKey6>,
    /// Packets and bytes flows counted since [`EbpfBackend::take_flow_growth`].
    flow_growth: Growth,
}

/// How many entries the service maps hold (`--bpf-lb-map-max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// SERVICES: one entry per frontend plus one per backend slot.
    pub services: u32,
    pub backends: u32,
    /// REV_NAT: one entry per frontend.
    pub rev_nat: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes { services: MAX_SERVICE_ENTRIES, backends: MAX_BACKENDS, rev_nat: MAX_REV_NAT }
    }
}

impl EbpfBackend {
    /// Loads and verifies the programs with the default map sizes, carrying
    /// nothing over.
    pub fn load(tc_mode: TcAttach) -> Result<Self, EbpfError> {
        Self::load_with(tc_mode, MapSizes::default(), None)
    }

    /// Loads and verifies the programs; nothing is attached yet. With the
    /// bpffs `root` of a previous agent, its state maps are carried over
    /// and its ids reserved (see [`carry`]).
    pub fn load_with(
        tc_mode: TcAttach,
        sizes: MapSizes,
        root: Option<&Path>,
    ) -> Result<Self, EbpfError> {
        let mut backend = Self::prepare(tc_mode, sizes, root)?;
        backend.verify()?;
        Ok(backend)
    }

    /// [`Self::load_with`] but for the programs: the maps are made (and the
    /// state maps carried over), the programs are not verified yet
    /// ([`Self::verify`], [`Self::verify_while_syncing`]).
    pub fn prepare(
        tc_mode: TcAttach,
        sizes: MapSizes,
        root: Option<&Path>,
    ) -> Result<Self, EbpfError> {
        crate::sys::raise_memlock_rlimit();
        let set_retval = u8::from(has_set_retval());
        let mut loader = aya::EbpfLoader::new();
        loader
            .override_global(SET_RETVAL, &set_retval, true)
            .map_max_entries(map_names::SERVICES, sizes.services)
            .map_max_entries(map_names::BACKENDS, sizes.backends)
            .map_max_entries(map_names::REV_NAT, sizes.rev_nat)
            // Each family's maps are sized alike, for both families' entries
            // together (the IPv6 ones are allocated per entry).
            .map_max_entries(map_names::SERVICES6, sizes.services)
            .map_max_entries(map_names::BACKENDS6, sizes.backends)
            .map_max_entries(map_names::REV_NAT6, sizes.rev_nat)
            .map_max_entries(map_names::FRONTEND_INFO, sizes.rev_nat)
            .map_max_entries(map_names::FRONTEND_STATS, sizes.rev_nat);
        let pinned = root.map(Pinned::open).transpose().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not read the previous agent's map layouts; starting afresh");
            None
        });
        let mut carried = Vec::new();
        let mut conversions = Vec::new();
        for map in &STATE_MAPS {
            let Some(pinned) = &pinned else { break };
            let carry = pinned.carry(map);
            if let Some(conversion) = carry_over(pinned, map, carry, &mut loader) {
                conversions.push(conversion);
            }
            carried.push((map.name, carry));
        }
        // The kernel's types, for its kfuncs (absent: none is called).
        let kernel_btf = aya::Btf::from_sys_fs().ok();
        let mut ebpf = loader.load(&sock_end::resolve_kfunc(OBJECT, kernel_btf.as_ref()))?;
        let mut maps = Maps::take(&mut ebpf)?;
        let mut state = SyncState::with_capacity(sizes);
        if let Some(pinned) = &pinned {
            match pinned.reserved() {
                Ok(reserved) => state.reserve(reserved),
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the previous agent's ids; frontends and backends get new ones")
                }
            }
        }
        for conversion in &conversions {
            let name = conversion.map.name;
            let copied = conversion
                .copy_into(maps.state_map(name), false)
                .map_err(|source| EbpfError::Map { name, source })?;
            tracing::info!(map = name, entries = copied, "converted the previous agent's entries");
        }
        let tc_interfaces = BTreeMap::new();
        Ok(Self {
            ebpf,
            maps,
            state,
            tc_mode,
            tc_interfaces,
            carried,
            conversions,
            socket_ending: SocketEnding::Unavailable,
            records: None,
            socket_protocols: Vec::new(),
            flow_counts: FlowCounts::default(),
            flow_counts6: FlowCounts::default(),
            flow_growth: Growth::new(),
        })
    }

    /// Loads the programs (the verifier runs) and points `TC6` at the
    /// IPv6 ones.
    pub fn verify(&mut self) -> Result<(), EbpfError> {
        verify_programs(&mut self.ebpf)?;
        self.maps.fill_tc6(&mut self.ebpf)
    }

    /// [`Self::verify`] on another thread while this one brings the maps
    /// to `plan` ([`Self::sync`]): at a first sync of many services the
    /// verifier's second or two then no longer come before the writes.
    pub fn verify_while_syncing(
        &mut self,
        plan: &Plan,
    ) -> Result<Result<SyncReport, SyncError>, EbpfError> {
        let (ebpf, state, maps) = (&mut self.ebpf, &mut self.state, &mut self.maps);
        let (verified, synced) = std::thread::scope(|scope| {
            let verifying = scope.spawn(|| verify_programs(ebpf));
            let synced = state.sync(plan, None, maps);
            let verified = verifying.join().unwrap_or_else(|_| Err(EbpfError::VerifierThread));
            (verified, synced)
        });
        self.purge_owed();
        verified?;
        self.maps.fill_tc6(&mut self.ebpf)?;
        Ok(synced)
    }

    /// Picks how the sockets the socket LB connected to departed backends
    /// are ended (`want`; `auto` tries the socket iterators, then
    /// sock_diag), for UDP and, with `tcp`, TCP. Says once in the log what
    /// it picked, or why nothing works here.
    pub fn choose_socket_ending(&mut self, want: SocketDestroy, tcp: bool) -> &SocketEnding {
        let iterators = match want {
            SocketDestroy::SockDiag => None,
            SocketDestroy::Auto | SocketDestroy::BpfIterator => Some(self.load_socket_iterators()),
        };
        self.socket_ending = match iterators {
            Some(Ok(())) => std::mem::take(&mut self.socket_ending),
            Some(Err(e)) if want == SocketDestroy::BpfIterator => {
                tracing::warn!(error = %e, "--socket-destroy bpf-iterator: the socket iterators do not load here (bpf_sock_destroy needs Linux 6.5+): connected sockets keep an endpoint that was removed until they reconnect");
                SocketEnding::Unavailable
            }
            iterators => {
                if let Some(Err(e)) = iterators {
                    tracing::debug!(error = %e, "no socket iterators with bpf_sock_destroy; trying sock_diag");
                }
                match crate::sockets::probe() {
                    Ok(()) => SocketEnding::SockDiag,
                    Err(e) => {
                        tracing::warn!(error = %e, "this kernel does not end sockets on request (neither bpf_sock_destroy nor CONFIG_INET_DIAG_DESTROY): a connected UDP socket keeps an endpoint that was removed until it reconnects");
                        SocketEnding::Unavailable
                    }
                }
            }
        };
        self.socket_protocols =
            if tcp { vec![IPPROTO_UDP, IPPROTO_TCP] } else { vec![IPPROTO_UDP] };
        // The kernel's types parsed for the iterators' loading.
        crate::sys::release_freed_memory();
        &self.socket_ending
    }

    /// Loads the socket iterators (verified: the kernel has
    /// `bpf_sock_destroy` and lets them call it) and makes them the way
    /// sockets are ended.
    pub fn load_socket_iterators(&mut self) -> Result<(), EbpfError> {
        if !matches!(self.socket_ending, SocketEnding::Iterators(_)) {
            // Their attach targets and kfunc are the running kernel's
            // types: parsed again here (about 20 ms) rather than kept from
            // the programs' loading, tens of MiB through the first sync.
            let kernel_btf = aya::Btf::from_sys_fs().ok();
            let iterators = Iterators::load(&mut self.ebpf, kernel_btf.as_ref())?;
            self.socket_ending = SocketEnding::Iterators(iterators);
        }
        Ok(())
    }

    /// What became of each state map of the previous agent.
    pub fn carried(&self) -> &[(&'static str, Carry)] {
        &self.carried
    }

    /// Writes the datapath settings (before the programs see traffic), and
    /// the maps' layouts for the next agent.
    pub fn configure(&mut self, config: &Config) -> Result<(), EbpfError> {
        self.state.set_maglev_table_size(config.maglev_table_size);
        let name = map_names::CONFIG;
        let err = |source| EbpfError::Map { name, source };
        Array::<_, Config>::try_from(&mut self.maps.config)
            .map_err(err)?
            .set(0, config, 0)
            .map_err(err)?;
        let name = map_names::LAYOUT;
        let err = |source| EbpfError::Map { name, source };
        Array::<_, Layouts>::try_from(&mut self.maps.layout)
            .map_err(err)?
            .set(0, Layouts::CURRENT, 0)
            .map_err(err)
    }

    /// The reader of the programs' decision records, into `logger` (once).
    pub fn take_records_with<L: log::Log>(
        &mut self,
        logger: L,
    ) -> Result<aya_log::EbpfLogger<L>, aya_log::Error> {
        aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, logger)
    }

    /// A monitor of these programs' events (`proxy-agent monitor` reads the
    /// pinned maps; this serves tests and benches of a datapath loaded here).
    pub fn watch(&self) -> Result<crate::monitor::ring::Watch, crate::monitor::ring::WatchError> {
        let [events, deadline, lost] = &self.maps.monitor;
        crate::monitor::ring::Watch::new(reopen(events)?, reopen(deadline)?, reopen(lost)?)
    }

    /// Keeps the task reading the records: it stops when these programs go.
    pub fn keep_records_reader(&mut self, reader: records::Reader) {
        self.records = Some(reader);
    }

    /// Brings the maps to `plan` (see [`sync`] for the write order), then
    /// drops affinity entries that name backends their service lost.
    /// `dirty`: the frontends that may have changed, `None` for all (see
    /// [`SyncState::sync`]).
    pub fn sync(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> Result<SyncReport, SyncError> {
        let result = self.state.sync(plan, dirty, &mut self.maps);
        self.purge_owed();
        result
    }

    /// From `served` to `target` in syncs that each fit (see
    /// [`SyncState::sync_in_steps`]).
    pub fn sync_in_steps(&mut self, served: &Plan, target: &Plan) -> Result<SyncReport, SyncError> {
        let result = self.state.sync_in_steps(served, target, &mut self.maps);
        self.purge_owed();
        result
    }

    /// Drops affinity entries that name backends their service lost; also
    /// after a failed sync, as slots may have changed before the failure.
    fn purge_owed(&mut self) {
        let purge = self.state.take_affinity_purge();
        if !purge.is_empty()
            && let Err(err) = self.purge_affinity(&purge)
        {
            tracing::warn!(error = %err, "could not purge stale affinity entries; will retry");
            self.state.return_affinity_purge(purge);
        }
    }

    fn purge_affinity(&mut self, purge: &AffinityPurge) -> Result<(), EbpfError> {
        let (v4, v6) = (&mut self.maps.affinity, &mut self.maps.affinity6);
        purge_affinity::<AffinityKey>(v4, map_names::AFFINITY, |k| k.rev_nat_id, purge)?;
        purge_affinity::<AffinityKey6>(v6, map_names::AFFINITY6, |k| k.rev_nat_id, purge)
    }

    pub fn state(&self) -> &SyncState {
        &self.state
    }

    /// Attaches the socket programs to `cgroup` and the per-packet program to
    /// `interfaces`, and pins maps and links under `root`, replacing what a
    /// previous agent pinned there.
    pub fn activate(
        &mut self,
        cgroup: &Path,
        interfaces: &BTreeMap<String, TcRole>,
        root: &Path,
    ) -> Result<(), EbpfError> {
        let cgroup_dir = File::open(cgroup).map_err(io_err("opening cgroup", cgroup))?;
        let mut links = Vec::new();
        for name in PROGRAMS {
            let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
            let err = |source| EbpfError::Program { name, source };
            // A bpf_link attachment always runs beside other links (the
            // kernel refuses the ALLOW_MULTI flag on links), so a previous
            // agent's programs serve until they are retired below.
            let id = prog.attach(&cgroup_dir, CgroupAttachMode::Single).map_err(err)?;
            let link = prog.take_link(id).map_err(err)?;
            let link = FdLink::try_from(link).map_err(|source| EbpfError::Link { name, source })?;
            links.push((name, link));
        }
        self.mark_flows()?;
        let mut tc_links = Vec::new();
        for (interface, &role) in interfaces {
            // One interface that will not take the program (gone already, an
            // odd device) must not keep the others unserved: the periodic
            // scan tries it again.
            match self.attach_tc(interface, role) {
                Ok(links) => tc_links.push((interface.clone(), role, links)),
                Err(e) => tracing::warn!(%interface, error = %e, "could not attach; will retry"),
            }
        }
        // Each pin is replaced in one step and the previous agent's other
        // pins go last, so a crash at any point leaves every program
        // attached, by the old pins or the new ones.
        let (maps_dir, links_dir) = (root.join("maps"), root.join("links"));
        for dir in [&maps_dir, &links_dir] {
            crate::sys::private_dir(dir).map_err(io_err("creating", dir))?;
        }
        let mut pinned = BTreeSet::new();
        for (name, map) in self.maps.by_name() {
            pinned.insert(pin_replacing(&maps_dir.join(name), |p| map.pin(p))?);
        }
        for (name, link) in links {
            // The pin keeps the attachment; our fd closes when this drops.
            pinned.insert(pin_replacing(&links_dir.join(name), |p| link.pin(p).map(drop))?);
        }
        for (interface, role, links) in tc_links {
            pinned.extend(self.keep_tc(root, &interface, role, links)?);
        }
        remove_pins_except(root, &pinned)?;
        self.finish_takeover();
        Ok(())
    }

    /// Once the old programs are gone: the entries they made since the
    /// conversion, then what the previous agent named and this one does not
    /// serve (UDP flows to such backends go, as at any endpoint removal;
    /// affinity entries of such frontends too).
    fn finish_takeover(&mut self) {
        for conversion in std::mem::take(&mut self.conversions) {
            let name = conversion.map.name;
            match conversion.copy_into(self.maps.state_map(name), true) {
                Ok(0) => {}
                Ok(entries) => tracing::info!(
                    map = name,
                    entries,
                    "converted entries made during the takeover"
                ),
                Err(e) => {
                    tracing::warn!(map = name, error = %e, "could not convert the entries made during the takeover")
                }
            }
        }
        // Flows the old programs made since `activate` looked.
        if let Err(e) = self.mark_flows() {
            tracing::warn!(error = %e, "could not mark the flows made during the takeover in the pre-filter");
        }
        let released = self.state.release_reserved();
        let departures = Departures::gone(released.backends);
        match self.flush_udp_flows(&departures) {
            Ok(0) => {}
            Ok(flushed) => {
                tracing::info!(flushed, "UDP flows to endpoints removed while no agent ran deleted")
            }
            Err(e) => tracing::warn!(error = %e, "could not flush UDP flows to removed endpoints"),
        }
        match self.end_sockets(&departures) {
            Ok(0) => {}
            Ok(ended) => {
                tracing::info!(
                    ended,
                    "sockets connected to endpoints removed while no agent ran ended"
                )
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not end sockets connected to removed endpoints")
            }
        }
        let purge: AffinityPurge =
            released.rev_nat_ids.into_iter().map(|id| (id, BTreeSet::new())).collect();
        if !purge.is_empty()
            && let Err(e) = self.purge_affinity(&purge)
        {
            tracing::warn!(error = %e, "could not purge the affinity entries of removed services");
        }
    }

    /// Attaches the per-packet programs of `role` to `interface`.
    fn attach_tc(&mut self, interface: &str, role: TcRole) -> Result<Vec<Attached>, EbpfError> {
        let tc_mode = self.tc_mode;
        let mut attached = Vec::new();
        for &(name, hook, prefix) in role.hooks() {
            let err = |source| EbpfError::Program { name, source };
            let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
            let link = match tc_mode {
                TcAttach::Tcx => {
                    let options = TcAttachOptions::TcxOrder(LinkOrder::default());
                    let id = prog.attach_with_options(interface, hook, options).map_err(err)?;
                    let link = prog.take_link(id).map_err(err)?;
                    let link = FdLink::try_from(link)
                        .map_err(|source| EbpfError::Link { name, source })?;
                    Attached::Tcx(link, prefix)
                }
                TcAttach::Netlink => {
                    let ours = |priority, handle| {
                        SchedClassifierLink::attached(interface, hook, priority, handle, None)
                    };
                    // A previous agent's filter: its program is replaced in
                    // place, so no packet meets the hook without one.
                    let id = match ours(FILTER_PRIORITY, FILTER_HANDLE) {
                        Ok(link) => prog.attach_to_link(link).ok(),
                        Err(_) => None,
                    };
                    let id = match id {
                        Some(id) => id,
                        None => {
                            // Present already on most interfaces; a real
                            // failure shows in the attach below.
                            let _ = qdisc_add_clsact(interface);
                            // Filters of releases that let the kernel choose
                            // their place are not replaceable: they go.
                            let _ = qdisc_detach_program(interface, hook, name);
                            let options = TcAttachOptions::Netlink(NlOptions {
                                priority: FILTER_PRIORITY,
                                handle: FILTER_HANDLE,
                                ..NlOptions::default()
                            });
                            prog.attach_with_options(interface, hook, options).map_err(err)?
                        }
                    };
                    Attached::Filter(prog.take_link(id).map_err(err)?)
                }
            };
            attached.push(link);
        }
        Ok(attached)
    }

    /// Keeps new attachments of `role`: pins TCX links, leaves filters to
    /// the kernel; and empties the hook the role leaves unused (a previous
    /// role's, or a previous agent's).
    fn keep_tc(
        &mut self,
        root: &Path,
        interface: &str,
        role: TcRole,
        links: Vec<Attached>,
    ) -> Result<Vec<PathBuf>, EbpfError> {
        let mut pinned = Vec::new();
        for link in links {
            match link {
                Attached::Tcx(link, prefix) => {
                    let path = root.join("links").join(format!("{prefix}-{interface}"));
                    pinned.push(pin_replacing(&path, |p| link.pin(p).map(drop))?);
                }
                // Dropping the handle would remove the filter; it holds no
                // fd, so forgetting it leaks nothing.
                Attached::Filter(link) => std::mem::forget(link),
            }
        }
        for hook in role.unused() {
            self.detach_tc(root, interface, hook);
        }
        self.tc_interfaces.insert(interface.to_string(), role);
        Ok(pinned)
    }

    /// Empties `hook` of `interface`: its pin (TCX) or our filter (netlink).
    fn detach_tc(&self, root: &Path, interface: &str, (_, hook, prefix): TcHook) {
        let path = root.join("links").join(format!("{prefix}-{interface}"));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(%interface, error = %e, "could not unpin"),
        }
        if self.tc_mode == TcAttach::Netlink {
            // Gone with its interface, most often.
            let filter = SchedClassifierLink::attached(
                interface,
                hook,
                FILTER_PRIORITY,
                FILTER_HANDLE,
                None,
            );
            let _ = filter.map(Link::detach);
        }
    }

    /// Attaches the per-packet programs to interfaces that appeared (or
    /// whose role changed), and detaches them from those that are gone or
    /// no longer wanted.
    pub fn set_tc_interfaces(&mut self, root: &Path, wanted: &BTreeMap<String, TcRole>) {
        let stale: Vec<(String, TcRole)> = self
            .tc_interfaces
            .iter()
            .filter(|(interface, _)| !wanted.contains_key(*interface))
            .map(|(interface, role)| (interface.clone(), *role))
            .collect();
        for (interface, role) in stale {
            self.tc_interfaces.remove(&interface);
            for &hook in role.hooks() {
                self.detach_tc(root, &interface, hook);
            }
            tracing::info!(%interface, "per-packet programs detached");
        }
        let new: Vec<(String, TcRole)> = wanted
            .iter()
            .filter(|(interface, role)| self.tc_interfaces.get(*interface) != Some(role))
            .map(|(interface, role)| (interface.clone(), *role))
            .collect();
        for (interface, role) in new {
            let attached = self
                .attach_tc(&interface, role)
                .and_then(|links| self.keep_tc(root, &interface, role, links));
            match attached {
                Ok(_) => tracing::info!(%interface, ?role, "per-packet programs attached"),
                // The interface may be gone again already; the next scan retries.
                Err(e) => tracing::warn!(%interface, error = %e, "could not attach"),
            }
        }
    }

    /// Sets the pre-filter bits of every flow in `CONNTRACK` and
    /// `CONNTRACK6` (carried over from a previous agent), so their packets
    /// keep reaching them (the reply slots start all set: [`replies`]);
    /// what they counted so far is the previous agent's (a baseline).
    fn mark_flows(&mut self) -> Result<(), EbpfError> {
        let maps = &mut self.maps;
        let (v4, v6) = (&maps.conntrack, &maps.conntrack6);
        let prefilter = &mut maps.prefilter;
        mark_flows::<CtKey, CtEntry>(v4, map_names::CONNTRACK, prefilter, &mut self.flow_counts)?;
        mark_flows::<CtKey6, CtEntry6>(v6, map_names::CONNTRACK6, prefilter, &mut self.flow_counts6)
    }

    /// Deletes expired flows (both directions, both families), rebuilds
    /// a generation of the reply slots from the live ones (see
    /// [`replies`]) and adds what the flows counted to
    /// [`EbpfBackend::take_flow_growth`]'s; returns (deleted, left).
    pub fn collect_conntrack(&mut self) -> Result<(usize, usize), EbpfError> {
        let now = crate::sys::monotonic_ns();
        let generation = self.maps.replies.begin();
        let slots = self.maps.replies.slots();
        let (v4, v6) = (&mut self.maps.conntrack, &mut self.maps.conntrack6);
        let counts = (&mut self.flow_counts, &mut self.flow_growth);
        let (deleted, left) =
            collect::<CtKey, CtEntry>(v4, map_names::CONNTRACK, now, &slots, generation, counts)?;
        let counts = (&mut self.flow_counts6, &mut self.flow_growth);
        let (deleted6, left6) = collect::<CtKey6, CtEntry6>(
            v6,
            map_names::CONNTRACK6,
            now,
            &slots,
            generation,
            counts,
        )?;
        self.maps.replies.done(generation);
        Ok((deleted + deleted6, left + left6))
    }

    /// The packets and bytes flows counted per reverse-NAT id since the
    /// last call (at conntrack collections and deletions), with each id's
    /// frontend name where it still has one.
    pub fn take_flow_growth(&mut self) -> Vec<(u32, Option<String>, FrontendStats)> {
        let growth = std::mem::take(&mut self.flow_growth);
        let infos = HashMap::<_, u32, FrontendInfo>::try_from(&self.maps.frontend_info).ok();
        growth
            .into_iter()
            .map(|(id, counted)| {
                let name = infos.as_ref().and_then(|m| m.get(&id, 0).ok());
                (id, name.map(|info| info.name().to_string()), counted)
            })
            .collect()
    }

    /// Ends the sockets the socket LB connected to backends that left
    /// their frontends, in the way and for the protocols chosen (see
    /// [`crate::sockets`]); returns how many.
    pub fn end_sockets(&mut self, departures: &Departures) -> Result<usize, EbpfError> {
        let protocols = &self.socket_protocols;
        let keys = departures.socket_keys(protocols);
        if keys.is_empty() {
            return Ok(0);
        }
        let io = |source| EbpfError::Io {
            action: "ending sockets to",
            path: PathBuf::from("removed endpoints"),
            source,
        };
        match &mut self.socket_ending {
            SocketEnding::Iterators(iterators) => iterators.end(&mut self.ebpf, &keys, protocols),
            SocketEnding::SockDiag => {
                let map_err = |name| move |source| EbpfError::Map { name, source };
                let (v4, v6) = (map_names::SOCK_REV_NAT, map_names::SOCK_REV_NAT6);
                let map =
                    HashMap::<_, SockRevNatKey, SockRevNat>::try_from(&self.maps.sock_rev_nat)
                        .map_err(map_err(v4))?;
                let map6 =
                    HashMap::<_, SockRevNatKey6, SockRevNat6>::try_from(&self.maps.sock_rev_nat6)
                        .map_err(map_err(v6))?;
                // The frontend the socket LB sent the socket's peer for.
                let frontend = |peer: &Peer| {
                    let (cookie, port) = (peer.cookie, peer.port);
                    match peer.address {
                        IpAddr::V4(ip) => {
                            let address = ip.octets();
                            let key = SockRevNatKey { cookie, address, port, _pad: 0 };
                            map.get(&key, 0).ok().map(|t| t.rev_nat_id)
                        }
                        IpAddr::V6(ip) => {
                            let address = ip.octets();
                            let key = SockRevNatKey6 { cookie, address, port, _pad: [0; 6] };
                            map6.get(&key, 0).ok().map(|t| t.rev_nat_id)
                        }
                    }
                };
                let mut ended = 0;
                for proto in protocols.iter().filter(|p| departures.has_proto(**p)) {
                    let must_end = |peer: &Peer| {
                        frontend(peer).is_some_and(|rev_nat_id| {
                            departures.ends_flow_to(rev_nat_id, *proto, peer.address, peer.port)
                        })
                    };
                    ended += crate::sockets::destroy(*proto, &must_end).map_err(io)?;
                }
                Ok(ended)
            }
            SocketEnding::Unavailable => Ok(0),
        }
    }

    /// Deletes the UDP flows of backends that left their frontends, per
    /// packet and per socket, as kube-proxy clears their conntrack entries:
    /// the next datagram picks a live backend.
    pub fn flush_udp_flows(&mut self, departures: &Departures) -> Result<usize, EbpfError> {
        if !departures.has_proto(IPPROTO_UDP) {
            return Ok(0);
        }
        let sockets = self.flush_socket_flows(departures)?;
        let (v4, v6) = (&mut self.maps.conntrack, &mut self.maps.conntrack6);
        let counts = (&mut self.flow_counts, &mut self.flow_growth);
        let flows = flush::<CtKey, CtEntry>(v4, map_names::CONNTRACK, departures, counts)?;
        let counts = (&mut self.flow_counts6, &mut self.flow_growth);
        let flows6 = flush::<CtKey6, CtEntry6>(v6, map_names::CONNTRACK6, departures, counts)?;
        Ok(sockets + flows + flows6)
    }

    /// Deletes the socket flows (unconnected UDP) of departed pairs.
    fn flush_socket_flows(&mut self, departures: &Departures) -> Result<usize, EbpfError> {
        let name = map_names::SOCK_FLOWS;
        let err = |source| EbpfError::Map { name, source };
        let mut map = HashMap::<_, SockFlowKey, SockFlow>::try_from(&mut self.maps.sock_flows)
            .map_err(err)?;
        let stale: Vec<SockFlowKey> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, flow)| departures.ends(key.rev_nat_id, flow.backend_id))
            .map(|(key, _)| key)
            .collect();
        // Read again before deletion: the socket may have moved on meanwhile.
        Ok(stale
            .iter()
            .filter(|key| {
                map.get(key, 0).is_ok_and(|f| departures.ends(key.rev_nat_id, f.backend_id))
                    && map.remove(key).is_ok()
            })
            .count())
    }
}

/// Every flow of a conntrack map, read in batches where the kernel has them.
fn conntrack_entries<K: aya::Pod, V: aya::Pod>(
    map: &Map,
    name: &'static str,
) -> Result<Vec<(K, V)>, EbpfError> {
    let err = |source| EbpfError::Map { name, source };
    if let Some(read) = hash_fd(map).and_then(batch::lookup_all) {
        return read.map_err(|io_error| {
            err(MapError::SyscallError(aya::sys::SyscallError {
                call: "BPF_MAP_LOOKUP_BATCH",
                io_error,
            }))
        });
    }
    let map = HashMap::<_, K, V>::try_from(map).map_err(err)?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// Deletes the `keys` whose entry `still_stale` says may go: the map moves
/// on while we scan, so each entry is read again before deletion. Returns
/// the entries deleted, as last read (their final counts).
fn delete_conntrack<K: aya::Pod, V: aya::Pod>(
    map: &mut Map,
    name: &'static str,
    keys: &[K],
    still_stale: impl Fn(&K, &V) -> bool,
) -> Result<Vec<(K, V)>, EbpfError> {
    let mut map =
        HashMap::<_, K, V>::try_from(map).map_err(|source| EbpfError::Map { name, source })?;
    let mut deleted = Vec::new();
    for key in keys {
        // Already gone (LRU eviction) is fine.
        let Ok(entry) = map.get(key, 0) else { continue };
        if still_stale(key, &entry) && map.remove(key).is_ok() {
            deleted.push((*key, entry));
        }
    }
    Ok(deleted)
}

/// A conntrack map's counts at the last read, and where growth goes.
type Counting<'a, K> = (&'a mut FlowCounts<K>, &'a mut Growth);

/// Deletes a conntrack map's expired flows, marking the reply slots of the
/// others in `generation` and counting what every flow counted since the
/// last read; returns (deleted, left).
fn collect<K, V>(
    map: &mut Map,
    name: &'static str,
    now: u64,
    slots: &replies::Slots<'_>,
    generation: replies::Generation,
    (counts, growth): Counting<'_, K>,
) -> Result<(usize, usize), EbpfError>
where
    K: CtTuple<Addr: proxy_common::prefilter::Address> + Ord + aya::Pod,
    V: CtValue<Key = K> + aya::Pod,
{
    let entries = conntrack_entries::<K, V>(map, name)?;
    counts.observe(&entries, Some(growth));
    let stale = conntrack::expired(&entries, now);
    for (key, entry) in &entries {
        if let Some((addr, port)) = replies::reply_backend(key, entry)
            && stale.binary_search(key).is_err()
        {
            slots.mark(generation, addr, port, key.proto());
        }
    }
    // A key the datapath gave a new flow meanwhile has a later expiry.
    let deleted = delete_conntrack(map, name, &stale, |_, e: &V| e.expires_ns() < now)?;
    counts.deleted(&deleted, growth);
    Ok((deleted.len(), entries.len().saturating_sub(deleted.len())))
}

/// Sets the pre-filter bits of every flow in a conntrack map, and takes
/// their counts as the baseline.
fn mark_flows<K, V>(
    map: &Map,
    name: &'static str,
    prefilter: &mut Prefilter,
    counts: &mut FlowCounts<K>,
) -> Result<(), EbpfError>
where
    K: CtTuple<Addr: proxy_common::prefilter::Address> + Ord + aya::Pod,
    V: CtValue<Key = K> + aya::Pod,
{
    let entries = conntrack_entries::<K, V>(map, name)?;
    counts.observe(&entries, None);
    let bits = entries.iter().map(|(key, entry)| prefilter::flow_bit(key, entry));
    let name = map_names::PREFILTER;
    prefilter.set(bits).map_err(|source| EbpfError::Map { name, source })
}

/// Deletes a conntrack map's flows of departed (frontend, backend) pairs,
/// counting what they counted since the last read.
fn flush<K, V>(
    map: &mut Map,
    name: &'static str,
    departures: &Departures,
    (counts, growth): Counting<'_, K>,
) -> Result<usize, EbpfError>
where
    K: CtTuple<Addr: Into<IpAddr>> + Ord + aya::Pod,
    V: CtValue<Key = K> + aya::Pod,
{
    let entries = conntrack_entries::<K, V>(map, name)?;
    let flows = conntrack::flows_to(&entries, departures);
    // Only entries still naming a departed pair (not a new flow's).
    let still = |k: &K, e: &V| conntrack::names_departed(k, e, departures);
    let deleted = delete_conntrack(map, name, &flows, still)?;
    counts.deleted(&deleted, growth);
    Ok(deleted.len())
}

/// Drops the entries of an affinity map (`rev_nat_id` of its key type)
/// naming backends their frontend lost.
fn purge_affinity<K: aya::Pod>(
    map: &mut Map,
    name: &'static str,
    rev_nat_id: fn(&K) -> u32,
    purge: &AffinityPurge,
) -> Result<(), EbpfError> {
    let mut affinity = HashMap::<_, K, AffinityValue>::try_from(map)
        .map_err(|source| EbpfError::Map { name, source })?;
    let stale: Vec<K> = affinity
        .iter()
        .filter_map(Result::ok)
        .filter(|(key, value)| {
            purge.get(&rev_nat_id(key)).is_some_and(|kept| !kept.contains(&value.backend_id))
        })
        .map(|(key, _)| key)
        .collect();
    for key in &stale {
        // Already gone (LRU eviction) is fine.
        let _ = affinity.remove(key);
    }
    Ok(())
}

/// Prepares carrying `map` over as `carry` says: the loader reuses the
/// pinned map, or a conversion reads it.
fn carry_over(
    pinned: &Pinned,
    map: &'static carry::StateMap,
    carry: Carry,
    loader: &mut aya::EbpfLoader<'_>,
) -> Option<Conversion> {
    let name = map.name;
    match carry {
        Carry::Nothing => None,
        Carry::Reuse => {
            tracing::info!(map = name, "carrying the previous agent's map over");
            loader.map_pin_path(name, pinned.path(name));
            None
        }
        Carry::Convert { from } => match Conversion::open(pinned, map, from) {
            Ok(conversion) => Some(conversion),
            Err(e) => {
                tracing::warn!(map = name, error = %e, "could not open the previous map; its entries are lost");
                None
            }
        },
        Carry::Reset { version } => {
            tracing::warn!(
                map = name,
                version,
                ours = ?Layouts::CURRENT,
                "the previous agent's map has a layout this build cannot read; its entries are lost"
            );
            None
        }
    }
}

/// A fresh attachment of a per-packet program: a TCX link (with its pin
/// prefix) or a clsact filter.
enum Attached {
    Tcx(FdLink, &'static str),
    Filter(SchedClassifierLink),
}

/// Removes the per-packet programs' clsact filters from every interface of
/// the caller's network namespace (TCX links go with their pins); returns
/// how many hooks had one. Filters outlive the agents that attach them:
/// this is how they go.
pub fn remove_tc_filters() -> usize {
    let Ok(interfaces) = crate::sys::interfaces() else { return 0 };
    interfaces
        .keys()
        .flat_map(|interface| TC_PROGRAMS.map(|(name, hook, _)| (interface, name, hook)))
        .filter(|(interface, name, hook)| qdisc_detach_program(interface, *hook, name).is_ok())
        .count()
}

/// What the per-packet program did to one packet under `BPF_PROG_TEST_RUN`.
#[derive(Debug)]
pub struct PacketRun {
    /// The tc verdict: -1 next/pass, 0 to the stack, 2 drop, 7 redirect.
    pub verdict: i32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
    /// Mean time of one run, as the kernel measured it.
    pub duration: std::time::Duration,
}

impl EbpfBackend {
    /// Whether replies from this backend endpoint reach the full path by
    /// its reply slot (a per-packet flow not masqueraded goes to it, or a
    /// collection has not yet cleared a slot it shares with one that did).
    pub fn reply_slot_set(&self, addr: IpAddr, port: u16, proto: u8) -> bool {
        let slots = self.maps.replies.slots();
        match addr {
            IpAddr::V4(ip) => slots.is_marked(ip.octets(), port, proto),
            IpAddr::V6(ip) => slots.is_marked(ip.octets(), port, proto),
        }
    }

    /// Runs the per-packet program on `packet` `repeat` times in the kernel
    /// without sending anything (packet-level tests and benchmarks).
    pub fn run_tc(&mut self, packet: &[u8], repeat: u32) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_INGRESS, packet, repeat)
    }

    /// As `run_tc`, with the egress program (packets the node's stack sends).
    pub fn run_tc_egress(&mut self, packet: &[u8], repeat: u32) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_EGRESS, packet, repeat)
    }

    /// As `run_tc`, with the ingress program of pod interfaces the socket LB
    /// covers (replies only).
    pub fn run_tc_pod_replies(
        &mut self,
        packet: &[u8],
        repeat: u32,
    ) -> Result<PacketRun, EbpfError> {
        self.run_program(TC_POD_REPLIES, packet, repeat)
    }

    /// As `run_tc`, once, as an explain run (`explain`): no state is
    /// written, the decision is read back.
    pub fn explain_tc(&mut self, packet: &[u8]) -> Result<explain::ExplainRun, EbpfError> {
        let name = TC_INGRESS;
        let prog = program::<SchedClassifier>(&mut self.ebpf, name)?;
        explain::test_run(prog, packet, 0).map_err(|source| EbpfError::Program { name, source })
    }

    fn run_program(
        &mut self,
        name: &'static str,
        packet: &[u8],
        repeat: u32,
    ) -> Result<PacketRun, EbpfError> {
        let err = |source| EbpfError::Program { name, source };
        let prog: &SchedClassifier = self
            .ebpf
            .program(name)
            .ok_or(EbpfError::Missing { what: "program", name })?
            .try_into()
            .map_err(err)?;
        // Room for the largest packet the program builds from a small one.
        let mut out = vec![0u8; packet.len() + 128];
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                repeat,
                ..TestRunOptions::new()
            })
            .map_err(err)?;
        out.truncate(result.data_size_out as usize);
        Ok(PacketRun {
            verdict: result.return_value as i32,
            packet: out,
            duration: result.duration,
        })
    }
}

/// A handle of its own on the pinned counters map, so readers (the metrics
/// endpoint) need nothing from the sync loop.
pub struct CounterReader(PerCpuArray<MapData, u64>);

/// Sets the programs' decision-record level (`Config::log_level`) in the
/// `CONFIG` map pinned under `root`: effective at the next packet, no
/// reload. Returns the previous level's word.
pub fn set_pinned_log_level(root: &Path, word: u8) -> Result<u8, EbpfError> {
    let name = map_names::CONFIG;
    let err = |source| EbpfError::Map { name, source };
    let data = MapData::from_pin(root.join("maps").join(name)).map_err(err)?;
    let mut config =
        Array::<_, Config>::try_from(Map::from_map_data(data).map_err(err)?).map_err(err)?;
    let mut value = config.get(&0, 0).map_err(err)?;
    let previous = std::mem::replace(&mut value.log_level, word);
    config.set(0, value, 0).map_err(err)?;
    Ok(previous)
}

impl CounterReader {
    pub fn open(root: &Path) -> Result<Self, EbpfError> {
        let name = map_names::COUNTERS;
        let err = |source| EbpfError::Map { name, source };
        let data = MapData::from_pin(root.join("maps").join(name)).map_err(err)?;
        let map = Map::from_map_data(data).map_err(err)?;
        Ok(Self(PerCpuArray::try_from(map).map_err(err)?))
    }

    /// Per-counter totals over all CPUs.
    pub fn read(&self) -> Vec<(Counter, u64)> {
        Counter::ALL
            .iter()
            .map(|c| (*c, self.0.get(&(*c as u32), 0).map_or(0, |v| v.iter().sum())))
            .collect()
    }
}

/// A second handle on one of the monitor's maps (by id: aya's `Map` lends
/// no `MapData`).
fn reopen(map: &Map) -> Result<MapData, crate::monitor::ring::WatchError> {
    let data = match map {
        Map::RingBuf(data) | Map::Array(data) | Map::PerCpuArray(data) => data,
        // Not one of the monitor's maps (they are of these types).
        _ => {
            let wrong = MapError::InvalidMapType { map_type: u32::MAX };
            return Err(crate::monitor::ring::WatchError::reopening(wrong));
        }
    };
    let id = data.info().map_err(crate::monitor::ring::WatchError::reopening)?.id();
    MapData::from_id(id).map_err(crate::monitor::ring::WatchError::reopening)
}

/// A program of the object, as its type (`CgroupSockAddr`, `SchedClassifier`).
fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, EbpfError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(EbpfError::Missing { what: "program", name })?
        .try_into()
        .map_err(|source| EbpfError::Program { name, source })
}

/// Whether an agent's maps are pinned under `root`: its datapath serves.
pub fn pinned(root: &Path) -> bool {
    std::fs::read_dir(root.join("maps")).is_ok_and(|mut pins| pins.next().is_some())
}

/// Removes the eBPF mode's pins under `root` (and the directory) and its
/// clsact filters in the caller's network namespace; returns how many of
/// each.
pub fn cleanup(root: &Path) -> Result<(usize, usize), EbpfError> {
    let removed = remove_pins(root)?;
    match std::fs::remove_dir(root) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("removing", root)(e)),
        _ => {}
    }
    Ok((removed, remove_tc_filters()))
}

/// Removes the pins under `root`: unpinning a link detaches its program
/// (once no process holds it), unpinning a map frees it once no program
/// uses it. Returns how many pins were removed.
pub fn remove_pins(root: &Path) -> Result<usize, EbpfError> {
    let removed = remove_pins_except(root, &BTreeSet::new())?;
    for dir in [root.join("links"), root.join("maps")] {
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(io_err("removing", &dir)(e));
            }
            _ => {}
        }
    }
    Ok(removed)
}

/// Removes the pins under `root` other than `keep`: a previous agent's,
/// and what a crash left staged.
fn remove_pins_except(root: &Path, keep: &BTreeSet<PathBuf>) -> Result<usize, EbpfError> {
    let mut removed = 0;
    for dir in [root.join("links"), root.join("maps")] {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("reading", &dir)(e)),
        };
        for entry in entries {
            let path = entry.map_err(io_err("reading", &dir))?.path();
            if !keep.contains(&path) {
                std::fs::remove_file(&path).map_err(io_err("unpinning", &path))?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}

/// Pins an object at `path` in place of what is pinned there, in one step:
/// under a staging name first, made private, then renamed over the old pin
/// (bpffs renames like any filesystem). Returns `path`.
fn pin_replacing(
    path: &Path,
    pin: impl FnOnce(&Path) -> Result<(), aya::pin::PinError>,
) -> Result<PathBuf, EbpfError> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // bpffs refuses names with a dot.
    let staged = path.with_file_name(format!("{name}~new"));
    // A crash's leftover would make the pin fail with EEXIST.
    match std::fs::remove_file(&staged) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("unpinning", &staged)(e));
        }
        _ => {}
    }
    pin(&staged).map_err(|source| EbpfError::Pin { path: staged.clone(), source })?;
    crate::sys::private_file(&staged).map_err(io_err("restricting", &staged))?;
    std::fs::rename(&staged, path).map_err(io_err("renaming", &staged))?;
    Ok(path.to_path_buf())
}
