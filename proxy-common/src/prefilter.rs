//! The per-packet programs' pre-filter: a bitmap (`PREFILTER`, an array of
//! words) answering "could this packet be the datapath's?" with one inlined
//! array read per question, before any hash map is touched. A bit stands for
//! an (address, port, protocol) of one [`Kind`], of either family (an IPv6
//! address is folded into 32 bits first); the agent sets a bit before the
//! entry it stands for is written and never clears one while it runs, so a
//! set bit may be stale (the packet takes the full path) but an entry never
//! lacks its bit.
//!
//! Replies of per-packet flows that were not masqueraded (whose replies come
//! from the backend to the client itself) are asked of `PREFILTER_REPLIES`
//! instead: a slot per backend (address, port, protocol) hash that the
//! datapath itself marks when it creates such a flow, so a backend's other
//! traffic (replies of connections the socket LB translated) passes. Each
//! slot is two bytes, one per generation; the datapath sets both (one
//! idempotent store: no atomics, 5.10 loads it), a packet is inspected when
//! either is set, and the agent's conntrack collection clears one
//! generation, then marks in it the flows it reads live, and clears the
//! other one the next time (see the agent's `replies` module).

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IPPROTO_TCP;

    #[test]
    fn prefilter_spreads_services_and_keeps_kinds_apart() {
        extern crate std;
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
