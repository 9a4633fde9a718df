//! Conntrack collection: expired flows deleted, flows of departed
//! backends flushed, what flows counted gathered; and stale affinity
//! entries purged.

use std::{collections::HashSet, net::IpAddr};

use aya::maps::{HashMap, Map};
use proxy_common::{
    AffinityValue, CT_FLAG_REPLY, CtEntry, CtEntry6, CtKey, CtKey6, CtTuple, CtValue, FrontendInfo,
    FrontendStats, SockFlow, SockFlowKey, map_names,
};

use super::{
    BpfObject, EbpfError, conntrack,
    departures::Departures,
    flow_counts::{FlowCounts, Growth},
    maps::read_all,
    prefilter,
    prefilter::Prefilter,
    reconciler::AffinityPurge,
    replies,
};

impl BpfObject {
    /// Sets the pre-filter bits of every flow in `CONNTRACK` and
    /// `CONNTRACK6` (carried over from a previous agent), so their packets
    /// keep reaching them (the reply slots start all set: [`replies`]);
    /// what they counted so far is the previous agent's (a baseline).
    pub(super) fn mark_flows(&mut self) -> Result<(), EbpfError> {
        let maps = &mut self.maps;
        let (v4, v6) = (&maps.conntrack, &maps.conntrack6);
        let prefilter = &mut maps.prefilter;
        mark_flows::<CtKey, CtEntry>(v4, map_names::CONNTRACK, prefilter, &mut self.flow_counts)?;
        mark_flows::<CtKey6, CtEntry6>(v6, map_names::CONNTRACK6, prefilter, &mut self.flow_counts6)
    }

    /// Deletes expired flows (both directions, both families), rebuilds
    /// a generation of the reply slots from the live ones (see
    /// [`replies`]) and adds what the flows counted to
    /// [`BpfObject::take_flow_growth`]'s; returns (deleted, left).
    pub fn collect_conntrack(&mut self) -> Result<Collected, EbpfError> {
        let now = crate::sys::monotonic_ns();
        let generation = self.maps.replies.begin();
        let slots = self.maps.replies.slots();
        let (v4, v6) = (&mut self.maps.conntrack, &mut self.maps.conntrack6);
        let mut collected = Collected::default();
        let counts = (&mut self.flow_counts, &mut self.flow_growth);
        let at = (now, &slots, generation);
        collect::<CtKey, CtEntry>(v4, map_names::CONNTRACK, at, counts, &mut collected)?;
        let counts = (&mut self.flow_counts6, &mut self.flow_growth);
        let left4 = collected.left;
        collect::<CtKey6, CtEntry6>(v6, map_names::CONNTRACK6, at, counts, &mut collected)?;
        self.maps.replies.done(generation);
        self.held6 = collected.left - left4;
        Ok(collected)
    }

    /// The IPv6 flow entries the last collection left.
    pub fn ipv6_flows_held(&self) -> usize {
        self.held6
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

    /// Deletes the UDP and SCTP flows of backends that left their
    /// frontends, per packet and per socket (unconnected UDP), as the
    /// rule-based modes delete their conntrack entries: the next datagram or
    /// association picks a live backend.
    pub fn flush_departed_flows(&mut self, departures: &Departures) -> Result<usize, EbpfError> {
        if !departures.has_proto(conntrack::flushed) {
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
pub(super) fn conntrack_entries<K: aya::Pod, V: aya::Pod>(
    map: &Map,
    name: &'static str,
) -> Result<Vec<(K, V)>, EbpfError> {
    read_all(map).map_err(|source| EbpfError::Map { name, source })
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

/// What a conntrack collection did and found.
#[derive(Debug, Default)]
pub struct Collected {
    pub deleted: usize,
    pub left: usize,
    /// The backends of the flows left (a reply entry's source).
    pub backends: HashSet<IpAddr>,
}

impl Collected {
    /// (deleted, left).
    pub fn counts(&self) -> (usize, usize) {
        (self.deleted, self.left)
    }
}

/// Deletes a conntrack map's expired flows, marking the reply slots of the
/// others in `generation` and counting what every flow counted since the
/// last read; adds to `collected`.
fn collect<K, V>(
    map: &mut Map,
    name: &'static str,
    (now, slots, generation): (u64, &replies::Slots<'_>, replies::Generation),
    (counts, growth): Counting<'_, K>,
    collected: &mut Collected,
) -> Result<(), EbpfError>
where
    K: CtTuple<Addr: proxy_common::prefilter::Address + Into<IpAddr>> + Ord + aya::Pod,
    V: CtValue<Key = K> + aya::Pod,
{
    let entries = conntrack_entries::<K, V>(map, name)?;
    counts.observe(&entries, Some(growth));
    let stale = conntrack::expired(&entries, now);
    for (key, entry) in &entries {
        if stale.binary_search(key).is_ok() {
            continue;
        }
        if let Some((addr, port)) = replies::reply_backend(key, entry) {
            slots.mark(generation, addr, port, key.proto());
        }
        if entry.flags() & CT_FLAG_REPLY != 0 {
            collected.backends.insert(key.saddr().into());
        }
    }
    // A key the datapath gave a new flow meanwhile has a later expiry.
    let deleted = delete_conntrack(map, name, &stale, |_, e: &V| e.expires_ns() < now)?;
    counts.deleted(&deleted, growth);
    collected.deleted += deleted.len();
    collected.left += entries.len().saturating_sub(deleted.len());
    Ok(())
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
pub(super) fn purge_affinity<K: aya::Pod>(
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
