//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): the table a
//! frontend's flows are looked up in, and the flow hash both sides agree
//! on. The agent computes the tables (`proxy-agent`'s `maglev` module);
//! the per-packet program hashes a new flow's tuple and reads the slot.
//!
//! A table of `M` entries (a prime) is stored in the `MAGLEV` map in chunks
//! of [`CHUNK_SLOTS`] entries, keyed by the frontend's reverse-NAT id and
//! the chunk's number: a map value must have one size for every table
//! size, and the program's index into a chunk is then bounded by a
//! constant, as the verifier wants. Each entry is a backend slot of the
//! frontend (`1..=count` in `SERVICES`), 16 bits: 32 KiB a frontend at the
//! default size.

/// Table entries per `MAGLEV` value (8 KiB): every size but the two
/// smallest is a few entries short of a whole number of chunks.
pub const CHUNK_SLOTS: usize = 4096;

/// The table sizes `--bpf-lb-maglev-table-size` takes: Cilium's list of
/// primes, so a value valid there is valid here.
pub const TABLE_SIZES: [u32; 10] = [251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071];

/// Cilium's default: about 100 entries a backend for up to 160 backends,
/// which keeps the disruption of a backend change near the ideal 1/N.
pub const DEFAULT_TABLE_SIZE: u32 = 16381;

/// The chunks a table of `size` entries takes.
pub const fn chunks(size: u32) -> u32 {
    size.div_ceil(CHUNK_SLOTS as u32)
}

/// Key of the `MAGLEV` map: a frontend's table, one chunk of it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub rev_nat_id: u32,
    pub chunk: u32,
}

/// Value of the `MAGLEV` map: entries `chunk * CHUNK_SLOTS ..` of a table,
/// each a backend slot of the frontend (0 past the table's end).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaglevChunk {
    pub slots: [u16; CHUNK_SLOTS],
}

impl Default for MaglevChunk {
    fn default() -> Self {
        MaglevChunk { slots: [0; CHUNK_SLOTS] }
    }
}

/// The hash of a flow that picks its table entry: over the client's
/// address and port and the frontend's port and protocol. Not over the
/// frontend's address: a NodePort reached at another node's address is
/// another frontend whose table is the same, and a flow keeps its backend
/// whichever node it enters by. Every node computes it alike (no seed of
/// its own), the per-packet program for real packets and the agent for
/// `explain`. `saddr` is the client's address as 32-bit words in wire order
/// (one for IPv4, four for IPv6).
#[inline(always)]
pub fn flow_hash<const N: usize>(saddr: &[u32; N], sport: u16, dport: u16, proto: u8) -> u32 {
    let mut h = SEED;
    // A constant length: unrolled in the BPF program.
    for word in saddr {
        h = mix(h, *word);
    }
    h = mix(h, ((sport as u32) << 16) | dport as u32);
    h = mix(h, proto as u32);
    finish(h)
}

/// The table entry of a flow of hash `hash` in a table of `size` entries.
/// Every size is an odd prime, which `| 1` leaves as it is: it only shows
/// the compiler that the divisor is never zero (no panic path, and no
/// branch, in the BPF program).
#[inline(always)]
pub const fn entry(hash: u32, size: u32) -> u32 {
    hash % (size | 1)
}

const SEED: u32 = 0x4d61_676c;

/// One round of MurmurHash3's 32-bit body.
#[inline(always)]
const fn mix(h: u32, word: u32) -> u32 {
    let k = word.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
    (h ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

/// MurmurHash3's finaliser: every input bit reaches every output bit.
#[inline(always)]
const fn finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_size_is_a_prime_and_fits_its_chunks() {
        for size in TABLE_SIZES {
            assert!((2..size).take_while(|d| d * d <= size).all(|d| size % d != 0), "{size}");
            assert!(chunks(size) as usize * CHUNK_SLOTS >= size as usize);
            assert!((chunks(size) as usize - 1) * CHUNK_SLOTS < size as usize);
        }
        assert!(TABLE_SIZES.contains(&DEFAULT_TABLE_SIZE));
        assert_eq!(chunks(DEFAULT_TABLE_SIZE), 4);
    }

    #[test]
    fn the_flow_hash_spreads_neighbouring_ports_and_depends_on_each_field() {
        let base = flow_hash(&[0x0a00_0001], 40000, 80, 6);
        assert_ne!(base, flow_hash(&[0x0a00_0002], 40000, 80, 6));
        assert_ne!(base, flow_hash(&[0x0a00_0001], 40001, 80, 6));
        assert_ne!(base, flow_hash(&[0x0a00_0001], 40000, 81, 6));
        assert_ne!(base, flow_hash(&[0x0a00_0001], 40000, 80, 17));
        // Consecutive source ports land all over a small table.
        let mut hits = [0u32; 251];
        for sport in 0..25_100u16 {
            hits[entry(flow_hash(&[0x0a00_0001], sport, 80, 6), 251) as usize] += 1;
        }
        let (min, max) = (hits.iter().min().unwrap(), hits.iter().max().unwrap());
        assert!(*min > 50 && *max < 160, "{min}..{max}");
    }
}
