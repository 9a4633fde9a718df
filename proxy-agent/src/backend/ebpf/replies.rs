//! The pre-filter's reply slots (`PREFILTER_REPLIES`, see
//! `proxy_common::prefilter`): which backends have per-packet flows not
//! masqueraded, whose replies must reach the full path. The programs set a
//! slot's two bytes (both generations) when they create such a flow; the
//! agent keeps the slots of flows that ended from lingering:
//!
//! - each conntrack collection clears one generation, then reads the flows
//!   and marks the live ones' slots in it; the next collection does the
//!   other generation. A packet is inspected while either byte is set, and
//!   the generation not being rebuilt holds every live flow's slot: marked
//!   by the previous rebuild, or set by the programs since. A collection
//!   that fails before its marks are done rebuilds the same generation
//!   again next time, so the other one is never cleared meanwhile.
//! - the programs set a slot after the flow's conntrack entries exist, so a
//!   clear that erases their store came after the entries were written, and
//!   the reading that follows the clear finds them and marks them again.
//! - both sides store single bytes into the mapped array (the agent with
//!   `BPF_F_MMAPABLE`, no syscall per slot): a store never rewrites its
//!   neighbours, as an update of a whole 8-byte element would.
//!
//! A new agent starts with every slot set, both generations, before its
//! programs see packets: the flows it carries over, and those the previous
//! agent's programs make until they are detached, keep their replies on the
//! full path; its first two collections clear the slots of no flow.

use std::{
    io,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::atomic::{AtomicU8, Ordering::Relaxed},
};

use aya::maps::{Map, MapError};
use proxy_common::{
    CT_FLAG_REPLY, CT_FLAG_SNAT, CtTuple, CtValue,
    prefilter::{self, Address},
};

/// The two generations of the slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Generation(usize);

/// Slots over the array's bytes (the mapping, or a test's memory).
pub struct Slots<'a>(&'a [AtomicU8]);

impl Slots<'_> {
    /// The byte of `generation` in `addr`'s slot.
    fn byte<A: Address>(&self, addr: A, port: u16, proto: u8, generation: usize) -> &AtomicU8 {
        let (word, offset) = prefilter::reply_slot(addr, port, proto);
        &self.0[word as usize * 8 + offset + generation]
    }

    /// Clears `generation` of every slot.
    pub fn clear(&self, Generation(generation): Generation) {
        for byte in self.0.iter().skip(generation).step_by(2) {
            byte.store(0, Relaxed);
        }
    }

    pub fn mark<A: Address>(&self, Generation(g): Generation, addr: A, port: u16, proto: u8) {
        self.byte(addr, port, proto, g).store(1, Relaxed);
    }

    pub fn is_marked<A: Address>(&self, addr: A, port: u16, proto: u8) -> bool {
        (0..2).any(|g| self.byte(addr, port, proto, g).load(Relaxed) != 0)
    }
}

/// The backend whose replies a conntrack entry stands for, if they must
/// reach the full path by its slot: the reply entry of a flow not
/// masqueraded (its key's source; a masqueraded flow's replies come to a
/// SNAT port, which the filter knows without a slot).
pub fn reply_backend<K: CtTuple, V: CtValue<Key = K>>(
    key: &K,
    entry: &V,
) -> Option<(K::Addr, u16)> {
    let flags = entry.flags();
    (flags & CT_FLAG_REPLY != 0 && flags & CT_FLAG_SNAT == 0).then(|| (key.saddr(), key.sport()))
}

/// `PREFILTER_REPLIES`, mapped into the agent.
pub struct Replies {
    map: Map,
    mapped: NonNull<AtomicU8>,
    len: usize,
    /// The generation the next collection rebuilds.
    next: Generation,
}

// SAFETY: the mapping is owned by this value and accessed through atomics.
unsafe impl Send for Replies {}
unsafe impl Sync for Replies {}

impl Replies {
    pub fn new(map: Map) -> Result<Self, MapError> {
        // Checks the type and the value size.
        aya::maps::Array::<_, u64>::try_from(&map)?;
        let Map::Array(data) = &map else {
            return Err(MapError::InvalidMapType {
                map_type: aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            });
        };
        let len = prefilter::REPLY_WORDS as usize * 8;
        // SAFETY: a shared mapping of the map's own fd and size; the array
        // was created BPF_F_MMAPABLE (see proxy-ebpf's maps).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        let mapped = NonNull::new(ptr.cast()).filter(|_| ptr != libc::MAP_FAILED);
        let Some(mapped) = mapped else {
            let io_error = io::Error::last_os_error();
            return Err(MapError::SyscallError(aya::sys::SyscallError { call: "mmap", io_error }));
        };
        let replies = Self { map, mapped, len, next: Generation(0) };
        for byte in replies.slots().0 {
            byte.store(1, Relaxed);
        }
        Ok(replies)
    }

    pub fn map(&self) -> &Map {
        &self.map
    }

    pub fn slots(&self) -> Slots<'_> {
        // SAFETY: `len` mapped bytes, alive while `self` is.
        Slots(unsafe { std::slice::from_raw_parts(self.mapped.as_ptr(), self.len) })
    }

    /// Clears the generation this collection rebuilds, before the flows are
    /// read.
    pub fn begin(&self) -> Generation {
        self.slots().clear(self.next);
        self.next
    }

    /// The collection marked every live flow in `generation`: the next
    /// rebuilds the other one.
    pub fn done(&mut self, Generation(g): Generation) {
        self.next = Generation(1 - g);
    }
}

impl Drop for Replies {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.mapped.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{CtEntry, CtKey, IPPROTO_TCP};

    use super::*;

    const POD: [u8; 4] = [10, 244, 2, 2];

    fn memory() -> Vec<AtomicU8> {
        (0..prefilter::REPLY_WORDS * 8).map(|_| AtomicU8::new(0)).collect()
    }

    #[test]
    fn a_flow_stays_marked_while_either_generation_is_rebuilt() {
        let memory = memory();
        let slots = Slots(&memory);
        let (g0, g1) = (Generation(0), Generation(1));
        // The programs set both bytes of a new flow's slot.
        slots.mark(g0, POD, 8080, IPPROTO_TCP);
        slots.mark(g1, POD, 8080, IPPROTO_TCP);
        // A collection rebuilds generation 0: while it reads, generation 1
        // holds the flow; it marks it again as live.
        slots.clear(g0);
        assert!(slots.is_marked(POD, 8080, IPPROTO_TCP));
        slots.mark(g0, POD, 8080, IPPROTO_TCP);
        // The next one rebuilds generation 1; the flow ended meanwhile.
        slots.clear(g1);
        assert!(slots.is_marked(POD, 8080, IPPROTO_TCP), "generation 0 still has it");
        // And the one after: no generation has it any more.
        slots.clear(g0);
        assert!(!slots.is_marked(POD, 8080, IPPROTO_TCP));
        assert!(memory.iter().all(|b| b.load(Relaxed) == 0));
    }

    #[test]
    fn clearing_a_generation_leaves_the_other_alone() {
        let memory = memory();
        let slots = Slots(&memory);
        slots.mark(Generation(1), [10, 244, 0, 7], 53, 17);
        slots.clear(Generation(0));
        assert!(slots.is_marked([10, 244, 0, 7], 53, 17));
        let ipv6 = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7];
        assert!(!slots.is_marked(ipv6, 53, 17), "IPv6 addresses hash apart");
    }

    #[test]
    fn only_replies_of_flows_not_masqueraded_have_slots() {
        let key = |saddr, sport, daddr, dport| CtKey {
            saddr,
            daddr,
            sport,
            dport,
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        };
        let (client, vip) = ([10, 244, 1, 5], [10, 96, 0, 10]);
        let from_pod = key(POD, 8080, client, 40000);
        let reply = CtEntry::new(0, &key(vip, 80, client, 40000), 1, CT_FLAG_REPLY);
        assert_eq!(reply_backend(&from_pod, &reply), Some((POD, 8080)));
        let forward = CtEntry::new(0, &key(client, 40000, POD, 8080), 1, 0);
        assert_eq!(reply_backend(&key(client, 40000, vip, 80), &forward), None);
        let masqueraded = CtEntry::new(0, &reply.rewritten(6), 1, CT_FLAG_REPLY | CT_FLAG_SNAT);
        assert_eq!(reply_backend(&from_pod, &masqueraded), None);
    }
}
