//! The per-packet programs' pre-filter (`PREFILTER`, see
//! `proxy_common::prefilter`): the bits of every frontend and host-network
//! backend the maps name, of both families, set before the entry is
//! written. Bits are never cleared while the agent runs: a flow outlives its
//! frontend or backend (an established connection keeps its pod, as under
//! kube-proxy), and its packets must keep finding it; a stale bit only sends
//! some packets down the full path. A new agent starts from a clean bitmap
//! and sets the bits of its plan and of the flows it carries over. (Replies
//! of flows to other backends are asked of the reply slots: [`super::replies`].)

use aya::maps::{Array, Map, MapError};
use proxy_common::{
    CT_FLAG_REPLY, CtTuple, CtValue,
    prefilter::{self, Address, Kind, bit},
};

use super::{
    entries::{BackendEntry, SlotKey},
    reconciler::MapOp,
};

/// The bitmap in the kernel and this agent's copy of it.
pub struct Prefilter {
    map: Map,
    words: Vec<u64>,
}

impl Prefilter {
    pub fn new(map: Map) -> Self {
        Self { map, words: vec![0; prefilter::WORDS as usize] }
    }

    pub fn map(&self) -> &Map {
        &self.map
    }

    /// Sets `bits`, writing each word that changes.
    pub fn set(&mut self, bits: impl IntoIterator<Item = u32>) -> Result<(), MapError> {
        let mut array = Array::<_, u64>::try_from(&mut self.map)?;
        for (index, mask) in bits.into_iter().map(prefilter::word) {
            let word = self.words[index as usize];
            if word & mask == 0 {
                array.set(index, word | mask, 0)?;
                self.words[index as usize] = word | mask;
            }
        }
        Ok(())
    }
}

/// The bits a map write needs set first: a frontend's, a host-network
/// backend's (whose replies the node's stack sends, through `tc_egress`).
pub fn bits_of(op: &MapOp) -> Vec<u32> {
    match op {
        MapOp::PutService { key: SlotKey::V4(key), .. } => {
            vec![bit(Kind::Frontend, key.address, key.port, key.proto)]
        }
        MapOp::PutService { key: SlotKey::V6(key), .. } => {
            vec![bit(Kind::Frontend, key.address, key.port, key.proto)]
        }
        MapOp::PutBackend { backend: BackendEntry::V4(b), .. } if b.flags.is_host() => {
            vec![bit(Kind::HostBackend, b.address, b.port, b.proto)]
        }
        MapOp::PutBackend { backend: BackendEntry::V6(b), .. } if b.flags.is_host() => {
            vec![bit(Kind::HostBackend, b.address, b.port, b.proto)]
        }
        _ => Vec::new(),
    }
}

/// The bit that keeps a carried flow's packets on the full path: its
/// requests go to the frontend; its replies come from the backend, which
/// may be on the host network (the flag is not in the entry; replies from
/// other backends are marked in the reply slots).
pub fn flow_bit<K, V>(key: &K, entry: &V) -> u32
where
    K: CtTuple<Addr: Address>,
    V: CtValue<Key = K>,
{
    if entry.flags() & CT_FLAG_REPLY == 0 {
        bit(Kind::Frontend, key.daddr(), key.dport(), key.proto())
    } else {
        bit(Kind::HostBackend, key.saddr(), key.sport(), key.proto())
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{
        Backend, BackendFlags, CtEntry, CtKey, IPPROTO_TCP, ServiceKey, ServiceKey6, ServiceValue,
    };

    use super::*;

    fn key(saddr: [u8; 4], sport: u16, daddr: [u8; 4], dport: u16) -> CtKey {
        CtKey { saddr, daddr, sport, dport, proto: IPPROTO_TCP, _pad: [0; 3] }
    }

    #[test]
    fn writes_set_the_bits_packets_are_checked_against() {
        let vip = [10, 96, 0, 10];
        let put = MapOp::PutService {
            key: SlotKey::V4(ServiceKey::new(vip, 80, IPPROTO_TCP, 0)),
            value: ServiceValue::default(),
        };
        assert_eq!(bits_of(&put), [bit(Kind::Frontend, vip, 80, IPPROTO_TCP)]);
        let vip6 = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10];
        let put = MapOp::PutService {
            key: SlotKey::V6(ServiceKey6::new(vip6, 80, IPPROTO_TCP, 0)),
            value: ServiceValue::default(),
        };
        assert_eq!(bits_of(&put), [bit(Kind::Frontend, vip6, 80, IPPROTO_TCP)]);
        let pod = [10, 244, 1, 2];
        let mut backend =
            Backend { address: pod, port: 8080, proto: IPPROTO_TCP, ..Default::default() };
        let put = MapOp::PutBackend { id: 1, backend: BackendEntry::V4(backend) };
        assert!(bits_of(&put).is_empty(), "a pod's replies are asked of its reply slot");
        backend.flags = BackendFlags::default().with_host(true);
        let put = MapOp::PutBackend { id: 1, backend: BackendEntry::V4(backend) };
        assert_eq!(bits_of(&put), [bit(Kind::HostBackend, pod, 8080, IPPROTO_TCP)]);
        let family = crate::model::IpFamily::V4;
        assert!(bits_of(&MapOp::DeleteBackend { id: 1, family }).is_empty());
    }

    #[test]
    fn carried_flows_keep_requests_and_host_network_replies_inspected() {
        let (client, vip, pod) = ([10, 244, 1, 5], [10, 96, 0, 10], [10, 244, 2, 2]);
        let forward = CtEntry::new(0, &key(client, 40000, pod, 8080), 1, 0);
        let request = key(client, 40000, vip, 80);
        assert_eq!(flow_bit(&request, &forward), bit(Kind::Frontend, vip, 80, IPPROTO_TCP));
        let reply = CtEntry::new(0, &key(vip, 80, client, 40000), 1, CT_FLAG_REPLY);
        let from_pod = key(pod, 8080, client, 40000);
        assert_eq!(flow_bit(&from_pod, &reply), bit(Kind::HostBackend, pod, 8080, IPPROTO_TCP));
    }
}
