//! Per-frontend packets and bytes of the per-packet flows, from the counts
//! in their conntrack entries (layout 2): the datapath adds each tracked
//! packet to the entry it looked up, with no other map on that path, and
//! the agent sums each entry's growth per frontend when it reads the whole
//! map (each conntrack collection, and when it deletes flows). Pure code:
//! the backend reads and deletes the entries.
//!
//! What each counting entry held at the last read is remembered, sorted by
//! key: 32 bytes per IPv4 entry, 56 per IPv6 one (8 MiB for a full
//! 262,144-entry `CONNTRACK`; nothing for entries that counted nothing, as
//! every entry of a `ct-lean` build). Growth an entry had after the last
//! read is lost if the entry goes without the agent deleting it (an LRU
//! eviction, the datapath's own removal of a stale flow).

use std::collections::BTreeMap;

use proxy_common::{CtValue, FrontendStats};

/// Packets and bytes, of an entry or summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub packets: u64,
    pub bytes: u64,
}

impl Counts {
    fn of<V: CtValue>(entry: &V) -> Self {
        let (packets, bytes) = entry.counted();
        Counts { packets, bytes }
    }

    /// What an entry counted since it held `before`: all it holds if it
    /// holds less (a new flow on the same tuple made it anew).
    fn since(self, before: Counts) -> Counts {
        match (self.packets.checked_sub(before.packets), self.bytes.checked_sub(before.bytes)) {
            (Some(packets), Some(bytes)) => Counts { packets, bytes },
            _ => self,
        }
    }
}

/// Growth per reverse-NAT id, as the per-service totals take it (only
/// `packets` and `bytes` set).
pub type Growth = BTreeMap<u32, FrontendStats>;

fn add(growth: &mut Growth, rev_nat_id: u32, counts: Counts) {
    if counts == Counts::default() {
        return;
    }
    let total = growth.entry(rev_nat_id).or_default();
    total.packets += counts.packets;
    total.bytes += counts.bytes;
}

/// What one conntrack map's entries held at the last read.
#[derive(Debug)]
pub struct FlowCounts<K> {
    seen: Vec<(K, Counts)>,
}

impl<K> Default for FlowCounts<K> {
    fn default() -> Self {
        FlowCounts { seen: Vec::new() }
    }
}

impl<K: Ord + Copy> FlowCounts<K> {
    /// A read of the whole map: adds each entry's growth since the last
    /// read to its frontend's in `growth` (none given: a baseline, whose
    /// counts are not this agent's, as at a takeover), and remembers what
    /// the entries hold now; entries no longer there are forgotten.
    pub fn observe<V: CtValue<Key = K>>(
        &mut self,
        entries: &[(K, V)],
        growth: Option<&mut Growth>,
    ) {
        let mut seen: Vec<(K, Counts)> = entries
            .iter()
            .map(|(key, entry)| (*key, Counts::of(entry)))
            .filter(|(_, counts)| *counts != Counts::default())
            .collect();
        seen.sort_unstable_by_key(|(key, _)| *key);
        // Kept until the next read: no room to spare (a full map's worth).
        seen.shrink_to_fit();
        if let Some(growth) = growth {
            for (key, entry) in entries {
                add(growth, entry.rev_nat_id(), Counts::of(entry).since(self.last(key)));
            }
        }
        self.seen = seen;
    }

    /// Entries the agent deleted, as read just before the deletion: their
    /// growth since the last read goes to `growth`, and they are forgotten.
    pub fn deleted<V: CtValue<Key = K>>(&mut self, entries: &[(K, V)], growth: &mut Growth) {
        for (key, entry) in entries {
            add(growth, entry.rev_nat_id(), Counts::of(entry).since(self.last(key)));
        }
        let mut gone: Vec<K> = entries.iter().map(|(key, _)| *key).collect();
        gone.sort_unstable();
        self.seen.retain(|(key, _)| gone.binary_search(key).is_err());
    }

    fn last(&self, key: &K) -> Counts {
        match self.seen.binary_search_by(|(k, _)| k.cmp(key)) {
            Ok(i) => self.seen[i].1,
            Err(_) => Counts::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{CtEntry6V2, CtEntryV1, CtEntryV2, CtKey, CtKey6, CtTuple, IPPROTO_TCP};

    use super::*;

    fn key(port: u16) -> CtKey {
        CtKey {
            saddr: [10, 0, 0, 1],
            daddr: [10, 96, 0, 10],
            sport: port,
            dport: 80,
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        }
    }

    /// An entry of frontend `id` that counted `packets` of 100 bytes.
    fn entry(id: u32, packets: u64) -> CtEntryV2 {
        let to = key(1);
        CtEntryV2 { packets, bytes: packets * 100, ..CtEntryV2::new(u64::MAX, &to, id, 0) }
    }

    fn counted(packets: u64) -> FrontendStats {
        FrontendStats { packets, bytes: packets * 100, ..FrontendStats::default() }
    }

    #[test]
    fn each_read_adds_only_what_entries_counted_since_the_last() {
        let mut flows = FlowCounts::default();
        let mut growth = Growth::new();
        flows.observe(&[(key(1), entry(7, 3)), (key(2), entry(7, 2))], Some(&mut growth));
        assert_eq!(growth, Growth::from([(7, counted(5))]));
        let mut growth = Growth::new();
        let read = [(key(1), entry(7, 4)), (key(2), entry(7, 2)), (key(3), entry(9, 1))];
        flows.observe(&read, Some(&mut growth));
        assert_eq!(growth, Growth::from([(7, counted(1)), (9, counted(1))]));
        // Nothing new: nothing added, not even an empty entry.
        let mut growth = Growth::new();
        flows.observe(&read, Some(&mut growth));
        assert!(growth.is_empty());
    }

    #[test]
    fn a_baseline_counts_nothing_and_later_reads_count_from_it() {
        let mut flows = FlowCounts::default();
        flows.observe(&[(key(1), entry(7, 1000))], None);
        let mut growth = Growth::new();
        flows.observe(&[(key(1), entry(7, 1002))], Some(&mut growth));
        assert_eq!(growth, Growth::from([(7, counted(2))]));
    }

    #[test]
    fn an_entry_made_anew_counts_all_it_holds_and_a_gone_one_is_forgotten() {
        let mut flows = FlowCounts::default();
        flows.observe(&[(key(1), entry(7, 10)), (key(2), entry(7, 10))], None);
        // Key 1: a new flow (of another frontend) on the same tuple. Key 2:
        // evicted, then a new flow on it after a read without it.
        let mut growth = Growth::new();
        flows.observe(&[(key(1), entry(8, 3))], Some(&mut growth));
        assert_eq!(growth, Growth::from([(8, counted(3))]));
        let mut growth = Growth::new();
        flows.observe(&[(key(1), entry(8, 3)), (key(2), entry(7, 12))], Some(&mut growth));
        assert_eq!(growth, Growth::from([(7, counted(12))]), "not 2: key 2 was forgotten");
    }

    #[test]
    fn deleted_entries_add_their_last_growth_once() {
        let mut flows = FlowCounts::default();
        let mut growth = Growth::new();
        flows.observe(&[(key(1), entry(7, 5)), (key(2), entry(7, 5))], Some(&mut growth));
        // Read again just before deletion: 1 packet more.
        flows.deleted(&[(key(1), entry(7, 6))], &mut growth);
        assert_eq!(growth, Growth::from([(7, counted(11))]));
        // Deleted without a read since (a flush between collections).
        flows.deleted(&[(key(2), entry(7, 8))], &mut growth);
        assert_eq!(growth, Growth::from([(7, counted(14))]));
        // A new flow on key 1 counts from zero.
        let mut growth = Growth::new();
        flows.observe(&[(key(1), entry(7, 2))], Some(&mut growth));
        assert_eq!(growth, Growth::from([(7, counted(2))]));
    }

    #[test]
    fn layouts_without_counters_are_not_remembered() {
        let mut flows = FlowCounts::default();
        let mut growth = Growth::new();
        let lean = CtEntryV1::new(u64::MAX, &key(1), 7, 0);
        flows.observe(&[(key(1), lean)], Some(&mut growth));
        assert!(growth.is_empty() && flows.seen.is_empty());
    }

    #[test]
    fn ipv6_entries_count_as_ipv4_ones() {
        let ip = |last: u8| [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last];
        let k = CtKey6::new(ip(1), ip(10), 40000, 80, IPPROTO_TCP);
        let e = |packets| CtEntry6V2 {
            packets,
            bytes: packets * 100,
            ..CtEntry6V2::new(u64::MAX, &k, 3, 0)
        };
        let mut flows = FlowCounts::default();
        let mut growth = Growth::new();
        flows.observe(&[(k, e(2))], Some(&mut growth));
        flows.observe(&[(k, e(5))], Some(&mut growth));
        assert_eq!(growth, Growth::from([(3, counted(5))]));
    }
}
