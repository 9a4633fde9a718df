//! Upkeep of the per-packet conntrack map: which entries to delete. Pure
//! code; the backend reads and deletes the map entries.
//!
//! Every flow has two entries (one per direction) and each names the other:
//! the tuple it rewrites to, reversed. Both go together.

use std::{collections::BTreeSet, net::IpAddr};

use proxy_common::{CT_FLAG_REPLY, CtTuple, CtValue, IPPROTO_SCTP, IPPROTO_UDP};

use super::departures::Departures;

/// The key of the other direction's entry.
fn pair<K: CtTuple, V: CtValue<Key = K>>(key: &K, entry: &V) -> K {
    entry.rewritten(key.proto()).reversed()
}

fn with_pairs<'a, K, V>(entries: impl Iterator<Item = &'a (K, V)>) -> Vec<K>
where
    K: CtTuple + Ord + 'a,
    V: CtValue<Key = K> + 'a,
{
    let mut keys = BTreeSet::new();
    for (key, entry) in entries {
        keys.insert(*key);
        keys.insert(pair(key, entry));
    }
    keys.into_iter().collect()
}

/// Expired entries and their pairs (a flow is alive while either direction
/// is: an expired entry whose pair still lives is kept).
pub fn expired<K: CtTuple + Ord, V: CtValue<Key = K>>(entries: &[(K, V)], now_ns: u64) -> Vec<K> {
    let live: BTreeSet<K> =
        entries.iter().filter(|(_, e)| e.expires_ns() >= now_ns).map(|(k, _)| *k).collect();
    with_pairs(
        entries.iter().filter(|(k, e)| e.expires_ns() < now_ns && !live.contains(&pair(k, e))),
    )
}

/// Whether the entry belongs to a flow of a departed (frontend, backend)
/// pair: the backend is a reply entry's source, or the destination a
/// forward entry rewrites to.
pub fn names_departed<K, V>(key: &K, entry: &V, departures: &Departures) -> bool
where
    K: CtTuple<Addr: Into<IpAddr>>,
    V: CtValue<Key = K>,
{
    let (addr, port) = if entry.flags() & CT_FLAG_REPLY != 0 {
        (key.saddr(), key.sport())
    } else {
        let to = entry.rewritten(key.proto());
        (to.daddr(), to.dport())
    };
    departures.ends_flow_to(entry.rev_nat_id(), key.proto(), addr.into(), port)
}

/// Whether the flows of `proto` go with their endpoint: UDP's, as
/// kube-proxy deletes their conntrack entries so that clients pick again,
/// and SCTP's, as kube-proxy did until 1.28 (a peer keeping its port would
/// otherwise send its next INIT to the endpoint that left); a TCP
/// connection's flow ends with the connection.
pub fn flushed(proto: u8) -> bool {
    matches!(proto, IPPROTO_UDP | IPPROTO_SCTP)
}

/// Entries of the [`flushed`] protocols' flows of departed (frontend,
/// backend) pairs, and their pairs.
pub fn flows_to<K, V>(entries: &[(K, V)], departures: &Departures) -> Vec<K>
where
    K: CtTuple<Addr: Into<IpAddr>> + Ord,
    V: CtValue<Key = K>,
{
    let departed = |(k, e): &&(K, V)| flushed(k.proto()) && names_departed(k, e, departures);
    with_pairs(entries.iter().filter(departed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::{Backend, BackendFlags, CT_FLAG_SNAT, CtEntry, CtKey, IPPROTO_UDP};

    use crate::backend::ebpf::entries::BackendEntry;

    /// A flow client:40000 -> 10.96.0.10:53 sent to backend:5353, SNATed to
    /// 192.168.1.1:61000.
    fn flow(client: u8, backend: u8, expires: [u64; 2]) -> [(CtKey, CtEntry); 2] {
        let orig = CtKey {
            saddr: [10, 0, 0, client],
            daddr: [10, 96, 0, 10],
            sport: 40000,
            dport: 53,
            proto: IPPROTO_UDP,
            _pad: [0; 3],
        };
        let xlated = CtKey {
            saddr: [192, 168, 1, 1],
            daddr: [10, 244, 0, backend],
            sport: 61000 + client as u16,
            dport: 5353,
            proto: IPPROTO_UDP,
            _pad: [0; 3],
        };
        let entry = |to: CtKey, expires_ns, flags| CtEntry::new(expires_ns, &to, 1, flags);
        [
            (orig, entry(xlated, expires[0], CT_FLAG_SNAT)),
            (xlated.reversed(), entry(orig.reversed(), expires[1], CT_FLAG_SNAT | CT_FLAG_REPLY)),
        ]
    }

    #[test]
    fn expired_flows_go_with_both_entries_live_ones_stay() {
        let mut entries = Vec::new();
        entries.extend(flow(1, 2, [10, 10]));
        entries.extend(flow(2, 2, [10, 100]));
        entries.extend(flow(3, 3, [100, 100]));
        let gone = expired(&entries, 50);
        assert_eq!(gone.len(), 2, "only flow 1: flow 2's reply side is alive");
        assert!(gone.contains(&entries[0].0) && gone.contains(&entries[1].0));
    }

    #[test]
    fn flows_to_a_removed_backend_are_found_from_either_side() {
        let mut entries = Vec::new();
        entries.extend(flow(1, 2, [10, 10]));
        entries.extend(flow(2, 3, [10, 10]));
        let backend = BackendEntry::V4(Backend {
            address: [10, 244, 0, 2],
            port: 5353,
            proto: IPPROTO_UDP,
            flags: BackendFlags::EMPTY,
        });
        let departed = Departures::gone([(9, backend)]);
        let gone = flows_to(&entries, &departed);
        assert_eq!(gone.len(), 2);
        assert!(gone.contains(&entries[0].0) && gone.contains(&entries[1].0));
        // Only the reply side present (the forward entry was evicted).
        let gone = flows_to(&entries[1..2], &departed);
        assert_eq!(gone.len(), 2);
        // Leaving the flows' frontend (reverse NAT 1) only, or another one.
        let mut left = Departures::default();
        left.add(1, 9, &backend);
        assert_eq!(flows_to(&entries, &left).len(), 2);
        let mut elsewhere = Departures::default();
        elsewhere.add(2, 9, &backend);
        assert!(flows_to(&entries, &elsewhere).is_empty());
    }

    #[test]
    fn ipv6_flows_expire_and_leave_with_their_backend_as_ipv4_ones() {
        use proxy_common::{Backend6, CtEntry6, CtKey6};
        let ip = |last: u8| [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last];
        let orig = CtKey6::new(ip(1), ip(10), 40000, 53, IPPROTO_UDP);
        let xlated = CtKey6::new(ip(1), ip(2), 40000, 5353, IPPROTO_UDP);
        let forward = CtEntry6::new(10, &xlated, 1, 0);
        let reply = CtEntry6::new(10, &orig.reversed(), 1, CT_FLAG_REPLY);
        let entries = [(orig, forward), (xlated.reversed(), reply)];
        assert_eq!(expired(&entries, 50).len(), 2);
        assert!(expired(&entries, 5).is_empty());
        let flags = BackendFlags::EMPTY;
        let backend = Backend6 { address: ip(2), port: 5353, proto: IPPROTO_UDP, flags };
        let departed = Departures::gone([(9, BackendEntry::V6(backend))]);
        assert_eq!(flows_to(&entries, &departed).len(), 2);
        let other = Backend6 { address: ip(3), ..backend };
        assert!(flows_to(&entries, &Departures::gone([(9, BackendEntry::V6(other))])).is_empty());
    }
}
