//! The maps the agent writes or reads, and the writes of a sync applied
//! to them ([`MapWriter`]: one at a time, or in batches).

use std::{io, net::IpAddr};

use aya::{
    Ebpf,
    maps::{
        HashMap, Map, MapError, ProgramArray,
        lpm_trie::{Key, LpmTrie},
    },
    programs::SchedClassifier,
};
use proxy_common::{
    Backend, Backend6, FrontendInfo, RevNat, RevNat6, SOURCE_RANGE_PREFIX_BITS, ServiceKey,
    ServiceKey6, ServiceValue, SourceRangeKey, SourceRangeKey6, TC_NEW_PROGRAMS, TC_SCTP_PROGRAMS,
    TC6_PROGRAMS,
    maglev::{MaglevChunk, MaglevKey},
    map_names,
};

use super::{
    EbpfError, batch,
    entries::{BackendEntry, RevNatEntry, SlotKey},
    frontend_stats, prefilter,
    prefilter::Prefilter,
    program,
    reconciler::{BatchKind, MapOp, MapWriter, apply_each},
    replies::Replies,
};
use crate::model::IpFamily;

/// The maps the agent writes or reads.
pub(super) struct Maps {
    pub(super) services: Map,
    pub(super) backends: Map,
    pub(super) rev_nat: Map,
    pub(super) services6: Map,
    pub(super) backends6: Map,
    pub(super) rev_nat6: Map,
    pub(super) sock_rev_nat6: Map,
    pub(super) conntrack6: Map,
    pub(super) affinity6: Map,
    pub(super) source_ranges6: Map,
    pub(super) tc6: Map,
    pub(super) tc_sctp: Map,
    pub(super) tc_new: Map,
    pub(super) frontend_info: Map,
    pub(super) frontend_stats: Map,
    pub(super) sock_rev_nat: Map,
    pub(super) affinity: Map,
    pub(super) conntrack: Map,
    pub(super) source_ranges: Map,
    pub(super) maglev: Map,
    pub(super) config: Map,
    pub(super) fragments: Map,
    pub(super) sock_flows: Map,
    pub(super) counters: Map,
    pub(super) layout: Map,
    pub(super) prefilter: Prefilter,
    /// `proxy-agent monitor`'s, pinned for it (`proxy_common::monitor`).
    pub(super) monitor: [Map; 3],
    pub(super) replies: Replies,
}

impl Maps {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, EbpfError> {
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
            tc_sctp: take(map_names::TC_SCTP)?,
            tc_new: take(map_names::TC_NEW)?,
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
    pub(super) fn state_map(&mut self, name: &str) -> &mut Map {
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

    pub(super) fn by_name(&self) -> [(&'static str, &Map); 30] {
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
            // Pinned so the new-flow, IPv6 and SCTP programs stay in them
            // while no agent runs (the kernel empties a program array its
            // last holder closes).
            (map_names::TC_NEW, &self.tc_new),
            (map_names::TC6, &self.tc6),
            (map_names::TC_SCTP, &self.tc_sctp),
            (map_names::EVENTS, &self.monitor[0]),
            (map_names::MONITOR, &self.monitor[1]),
            (map_names::MONITOR_LOST, &self.monitor[2]),
        ]
    }

    /// Puts the new-flow program in `TC_NEW`, where `tc_ingress` enters it
    /// by tail call: before `tc_ingress` is attached.
    pub(super) fn fill_tc_new(&mut self, ebpf: &mut Ebpf) -> Result<(), EbpfError> {
        fill(ebpf, &mut self.tc_new, map_names::TC_NEW, &TC_NEW_PROGRAMS)
    }

    /// Puts the IPv6 per-packet programs in `TC6`, where the IPv4 ones
    /// enter them by tail call.
    pub(super) fn fill_tc6(&mut self, ebpf: &mut Ebpf) -> Result<(), EbpfError> {
        fill(ebpf, &mut self.tc6, map_names::TC6, &TC6_PROGRAMS)
    }

    /// Puts the (loaded) SCTP programs in `TC_SCTP`, where the TCP and UDP
    /// ones enter them by tail call.
    pub(super) fn fill_tc_sctp(&mut self, ebpf: &mut Ebpf) -> Result<(), EbpfError> {
        fill(ebpf, &mut self.tc_sctp, map_names::TC_SCTP, &TC_SCTP_PROGRAMS)
    }
}

/// Puts the loaded `programs` in the program array `map` (`name`), each
/// at its index.
pub(super) fn fill(
    ebpf: &mut Ebpf,
    map: &mut Map,
    name: &'static str,
    programs: &[&'static str],
) -> Result<(), EbpfError> {
    let mut array =
        ProgramArray::try_from(map).map_err(|source| EbpfError::Map { name, source })?;
    for (slot, program_name) in (0..).zip(programs) {
        let prog = program::<SchedClassifier>(ebpf, program_name)?;
        let fd = prog.fd().map_err(|source| EbpfError::Program { name: program_name, source })?;
        array.set(slot, fd, 0).map_err(|source| EbpfError::Map { name, source })?;
    }
    Ok(())
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
                MapOp::PutRevNat { frontend, id, value, owner } => {
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
                        owner.info(frontend),
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

/// Every entry of a hash map (plain or LRU), read in batches where the
/// kernel has them (a pinned map of a million entries: well under a second,
/// where two syscalls per entry took seconds), else one by one.
pub(super) fn read_all<K: aya::Pod, V: aya::Pod>(map: &Map) -> Result<Vec<(K, V)>, MapError> {
    let mut entries = Vec::new();
    read_each(map, |key, value| entries.push((key, value)))?;
    Ok(entries)
}

/// [`read_all`], each entry handed to `each` as it is read: a map of a
/// million entries is never held whole.
pub(super) fn read_each<K: aya::Pod, V: aya::Pod>(
    map: &Map,
    mut each: impl FnMut(K, V),
) -> Result<(), MapError> {
    if let Some(fd) = hash_fd(map)
        && let Some(read) = super::batch::lookup_each(fd, &mut each)
    {
        return read.map_err(|io_error| {
            MapError::SyscallError(aya::sys::SyscallError {
                call: "BPF_MAP_LOOKUP_BATCH",
                io_error,
            })
        });
    }
    let map = aya::maps::HashMap::<_, K, V>::try_from(map)?;
    map.iter().filter_map(Result::ok).for_each(|(key, value)| each(key, value));
    Ok(())
}

/// The fd of a hash map (plain or LRU), for the batched operations.
pub(super) fn hash_fd(map: &Map) -> Option<std::os::fd::BorrowedFd<'_>> {
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
