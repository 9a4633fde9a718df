//! Keeping large `BTreeMap`s dense. A map filled entry by entry in key
//! order (a first list, a first plan: a hundred thousand services in name
//! or address order) splits each full node in two and leaves it half
//! empty; one built at once from its sorted entries has full nodes.

use std::collections::BTreeMap;

/// Rebuilds `map` with full nodes when at least a quarter of its entries
/// came in since it was last dense (`grown` of them): after a first list,
/// not after one change.
pub fn refill<K: Ord, V>(map: &mut BTreeMap<K, V>, grown: usize) {
    if grown >= 4096 && grown * 4 >= map.len() {
        // In order already: the rebuild's sort is one pass.
        *map = std::mem::take(map).into_iter().collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_arrival_is_refilled_and_a_small_one_is_left() {
        let mut map: BTreeMap<u32, u64> = (0..10_000).map(|i| (i, u64::from(i))).collect();
        let before: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
        refill(&mut map, 10_000);
        assert_eq!(map.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(), before);
        refill(&mut map, 10);
        assert_eq!(map.len(), 10_000);
    }
}
