//! Maglev lookup tables (Eisenbud et al., "Maglev: A Fast and Reliable
//! Software Network Load Balancer", NSDI 2016, §3.4). Pure.
//!
//! Each backend gets a permutation of the table's `M` entries (a prime)
//! from two hashes of its address and port, `offset` and `skip`; the
//! backends then take turns claiming the next free entry of their own
//! permutation until the table is full. Every backend ends up with `M / N`
//! entries, give or take one, and removing one backend frees only its own
//! entries plus a few others: near-minimal disruption once `M` is much
//! larger than `N` (the default 16381 is about 100 entries a backend for
//! 160 backends).
//!
//! Every node must compute the same table for the same backends, so that a
//! flow entering any node picks the same backend: the backends are ordered
//! by address and port (never by ids or slots, which differ per node), and
//! hashed with a hash fixed here rather than std's (whose algorithm may
//! change between Rust releases, and so between two agents' builds). The
//! table's entries are then written as this node's slots of those backends.

use std::net::IpAddr;

/// A backend as the table sees it: its slot on this node and its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    pub slot: u16,
    pub ip: IpAddr,
    pub port: u16,
}

impl Backend {
    /// The name its permutation is hashed from: the address's bytes (4 or
    /// 16) and the port, big-endian. An IPv4 backend and its v4-mapped IPv6
    /// twin are different backends (different families' frontends).
    fn name(&self) -> ([u8; 18], usize) {
        let mut name = [0; 18];
        let len = match self.ip {
            IpAddr::V4(ip) => {
                name[..4].copy_from_slice(&ip.octets());
                4
            }
            IpAddr::V6(ip) => {
                name[..16].copy_from_slice(&ip.octets());
                16
            }
        };
        name[len..len + 2].copy_from_slice(&self.port.to_be_bytes());
        (name, len + 2)
    }

    fn order_key(&self) -> (u8, [u8; 18]) {
        (u8::from(self.ip.is_ipv6()), self.name().0)
    }
}

/// The table of `size` entries (a prime) over `backends`: each entry the
/// slot of the backend that owns it. Empty without backends.
pub fn table(backends: &[Backend], size: u32) -> Vec<u16> {
    if backends.is_empty() {
        return Vec::new();
    }
    let mut sorted = backends.to_vec();
    sorted.sort_by_key(Backend::order_key);
    sorted.dedup_by_key(|b| b.order_key());
    let m = u64::from(size);
    // (offset, skip, next position in its permutation) per backend.
    let mut turns: Vec<(u64, u64, u64)> = sorted
        .iter()
        .map(|b| {
            let (name, len) = b.name();
            let offset = hash(&name[..len], OFFSET_SEED) % m;
            let skip = hash(&name[..len], SKIP_SEED) % (m - 1) + 1;
            (offset, skip, 0)
        })
        .collect();
    const FREE: u16 = u16::MAX;
    let mut entries = vec![FREE; size as usize];
    let mut filled = 0;
    'fill: loop {
        for (backend, (offset, skip, next)) in sorted.iter().zip(turns.iter_mut()) {
            // Its permutation's next entry not yet taken. The j-th entry of
            // a permutation is offset + j * skip (mod M); M prime and skip
            // in 1..M make it visit every entry once.
            let mut entry = (*offset + *next * *skip) % m;
            while entries[entry as usize] != FREE {
                *next += 1;
                entry = (*offset + *next * *skip) % m;
            }
            entries[entry as usize] = backend.slot;
            *next += 1;
            filled += 1;
            if filled == entries.len() {
                break 'fill;
            }
        }
    }
    entries
}

const OFFSET_SEED: u64 = 0x6d61_676c_6576_6f66;
const SKIP_SEED: u64 = 0x6d61_676c_6576_736b;

/// FNV-1a over the bytes from `seed`, then SplitMix64's finaliser (FNV
/// alone spreads the last bytes poorly). Fixed here: every agent, of any
/// build, hashes a backend alike.
fn hash(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    for byte in bytes {
        h = (h ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proxy_common::maglev::{DEFAULT_TABLE_SIZE, TABLE_SIZES};

    use super::*;

    fn backends(n: u16) -> Vec<Backend> {
        (1..=n)
            .map(|i| Backend {
                slot: i,
                ip: format!("10.244.{}.{}", i / 200, i % 200 + 2).parse().unwrap(),
                port: 8080,
            })
            .collect()
    }

    fn shares(table: &[u16]) -> BTreeMap<u16, usize> {
        let mut shares = BTreeMap::new();
        for slot in table {
            *shares.entry(*slot).or_default() += 1;
        }
        shares
    }

    #[test]
    fn every_backend_gets_an_even_share_at_every_size() {
        for size in TABLE_SIZES {
            for n in [1, 2, 3, 10, 100] {
                let table = table(&backends(n), size);
                assert_eq!(table.len(), size as usize);
                let shares = shares(&table);
                assert_eq!(shares.len(), n as usize, "every backend has entries");
                let even = size as usize / n as usize;
                for (slot, share) in shares {
                    // The paper's bound: within one entry of even once
                    // the table is full, but the last round of claims
                    // may leave a backend short of it by its skips.
                    assert!(share + 1 >= even && share <= even + 1, "{size}/{n}: {slot} {share}");
                }
            }
        }
    }

    #[test]
    fn every_node_computes_the_same_table_whatever_its_slots_and_order() {
        let here = backends(10);
        // Another node: the same backends in other slots, listed in another order.
        let mut there: Vec<Backend> =
            here.iter().map(|b| Backend { slot: 11 - b.slot, ..*b }).collect();
        there.reverse();
        let (a, b) = (table(&here, DEFAULT_TABLE_SIZE), table(&there, DEFAULT_TABLE_SIZE));
        let address =
            |list: &[Backend], slot: u16| list.iter().find(|b| b.slot == slot).unwrap().ip;
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(address(&here, *x), address(&there, *y));
        }
    }

    #[test]
    fn removing_one_backend_moves_its_flows_and_few_others() {
        // At the default size up to tens of backends; a hundred want a
        // larger table (at the default, 1.4% of the others' flows move).
        for (n, size) in [(3, DEFAULT_TABLE_SIZE), (10, DEFAULT_TABLE_SIZE), (100, 65521)] {
            let before = table(&backends(n), size);
            // Backend 2 leaves; the others keep their slots.
            let rest: Vec<Backend> = backends(n).into_iter().filter(|b| b.slot != 2).collect();
            let after = table(&rest, size);
            let moved =
                before.iter().zip(&after).filter(|(b, a)| **b != 2 && b != a).count() as f64;
            let share = moved / f64::from(size);
            assert!(
                share <= 0.01,
                "{n} backends: {:.2}% of the others' entries moved",
                share * 100.0
            );
            assert!(after.iter().all(|slot| *slot != 2));
        }
    }

    #[test]
    fn adding_one_backend_takes_its_share_mostly_from_the_others_evenly() {
        let before = table(&backends(10), DEFAULT_TABLE_SIZE);
        let after = table(&backends(11), DEFAULT_TABLE_SIZE);
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
        let to_new = after.iter().filter(|s| **s == 11).count();
        assert!(
            moved - to_new <= DEFAULT_TABLE_SIZE as usize / 100,
            "{moved} moved, {to_new} to 11"
        );
    }

    #[test]
    fn no_backends_no_table_and_duplicates_count_once() {
        assert!(table(&[], 251).is_empty());
        let one = backends(1)[0];
        assert_eq!(shares(&table(&[one, Backend { slot: 1, ..one }], 251)).len(), 1);
    }

    #[test]
    fn the_hash_is_fixed() {
        // A change here changes every table: flows move at the upgrade.
        assert_eq!(hash(b"", 0), 17665956581633026203);
        assert_ne!(hash(b"a", OFFSET_SEED), hash(b"a", SKIP_SEED));
    }
}
