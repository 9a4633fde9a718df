//! The service table from the eBPF mode's pinned maps: `SERVICES` and
//! `SERVICES6` (each frontend's slot 0 and its backend slots), `BACKENDS`
//! and `BACKENDS6`, `FRONTEND_INFO` (service name and kind, by
//! reverse-NAT id) and `MAGLEV` (each backend's share of its frontend's
//! table).

use std::{collections::BTreeMap, net::SocketAddr, path::Path};

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common::{
    Backend, Backend6, CtEntry6V1, CtEntry6V2, CtEntryV1, CtEntryV2, CtKey, CtKey6, FrontendInfo,
    KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER, KIND_NODE_PORT, ServiceKey, ServiceKey6,
    ServiceValue, SockRevNat, SockRevNat6, SockRevNatKey, SockRevNatKey6,
    maglev::{MaglevChunk, MaglevKey},
    map_names,
};

use super::{
    LbBackend, LbEntry, ct,
    ct::{CtRow, TranslatedSocket},
    flag,
};
use crate::{
    backend::ebpf::entries::{BackendEntry, SlotKey},
    plan::Scope,
};

#[derive(Debug, thiserror::Error)]
#[error(
    "reading the pinned map {name} (is the eBPF mode running here, with this --bpffs-root?): {source}"
)]
pub struct ReadError {
    name: &'static str,
    source: MapError,
}

/// A pinned hash map's entries.
pub fn read<K: aya::Pod, V: aya::Pod, C: FromIterator<(K, V)>>(
    root: &Path,
    name: &'static str,
) -> Result<C, ReadError> {
    let err = |source| ReadError { name, source };
    let data = MapData::from_pin(root.join("maps").join(name)).map_err(err)?;
    let map = Map::from_map_data(data).map_err(err)?;
    let map = HashMap::<_, K, V>::try_from(&map).map_err(err)?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// A pinned map an older agent did not pin (the IPv6 family's, `MAGLEV`):
/// none where it is not there.
fn read_if_pinned<K: aya::Pod, V: aya::Pod>(
    root: &Path,
    name: &'static str,
) -> Result<Vec<(K, V)>, ReadError> {
    match root.join("maps").join(name).exists() {
        true => read(root, name),
        false => Ok(Vec::new()),
    }
}

/// The table of the maps pinned under `root`.
pub fn read_pinned(root: &Path) -> Result<Vec<LbEntry>, ReadError> {
    let v4: Vec<(ServiceKey, ServiceValue)> = read(root, map_names::SERVICES)?;
    let v6: Vec<(ServiceKey6, ServiceValue)> = read_if_pinned(root, map_names::SERVICES6)?;
    let services = v4.into_iter().map(|(k, v)| (SlotKey::V4(k), v));
    let services = services.chain(v6.into_iter().map(|(k, v)| (SlotKey::V6(k), v))).collect();
    let v4: Vec<(u32, Backend)> = read(root, map_names::BACKENDS)?;
    let v6: Vec<(u32, Backend6)> = read_if_pinned(root, map_names::BACKENDS6)?;
    let backends = v4.into_iter().map(|(id, b)| (id, BackendEntry::V4(b)));
    let backends = backends.chain(v6.into_iter().map(|(id, b)| (id, BackendEntry::V6(b))));
    let infos = read(root, map_names::FRONTEND_INFO)?;
    let chunks: Vec<(MaglevKey, MaglevChunk)> = read_if_pinned(root, map_names::MAGLEV)?;
    Ok(entries(&services, &backends.collect(), &infos, &maglev_shares(&chunks)))
}

/// Per frontend (reverse-NAT id) with a Maglev table, the entries naming
/// each slot.
pub type MaglevShares = BTreeMap<u32, BTreeMap<u16, u32>>;

fn maglev_shares(chunks: &[(MaglevKey, MaglevChunk)]) -> MaglevShares {
    let mut shares = MaglevShares::new();
    for (key, chunk) in chunks {
        let of_frontend = shares.entry(key.rev_nat_id).or_default();
        // Zero: past the table's end.
        for slot in chunk.slots.iter().filter(|s| **s != 0) {
            *of_frontend.entry(*slot).or_default() += 1;
        }
    }
    shares
}

/// The flows of the maps pinned under `root` at `now_ns`: per packet
/// (`CONNTRACK`, `CONNTRACK6`, either layout) and per socket
/// (`SOCK_REV_NAT`, `SOCK_REV_NAT6`).
pub fn read_flows(root: &Path, now_ns: u64) -> Result<Vec<CtRow>, ReadError> {
    let infos = read(root, map_names::FRONTEND_INFO)?;
    let lb = read_pinned(root)?;
    // The layout the pins hold, whichever this build writes.
    let conntrack: Vec<(CtKey, CtEntryV1)> = match read(root, map_names::CONNTRACK) {
        Ok(v1) => v1,
        Err(_) => {
            let v2: Vec<(CtKey, CtEntryV2)> = read(root, map_names::CONNTRACK)?;
            v2.into_iter().map(|(k, v2)| (k, v2.into())).collect()
        }
    };
    let conntrack6: Vec<(CtKey6, CtEntry6V1)> = match read_if_pinned(root, map_names::CONNTRACK6) {
        Ok(v1) => v1,
        Err(_) => {
            let v2: Vec<(CtKey6, CtEntry6V2)> = read_if_pinned(root, map_names::CONNTRACK6)?;
            v2.into_iter().map(|(k, v2)| (k, v2.into())).collect()
        }
    };
    let v4: Vec<(SockRevNatKey, SockRevNat)> = read(root, map_names::SOCK_REV_NAT)?;
    let v6: Vec<(SockRevNatKey6, SockRevNat6)> = read_if_pinned(root, map_names::SOCK_REV_NAT6)?;
    let sockets: Vec<TranslatedSocket> =
        v4.into_iter().map(Into::into).chain(v6.into_iter().map(Into::into)).collect();
    let mut rows = ct::flows(&conntrack, &infos, now_ns);
    rows.extend(ct::flows(&conntrack6, &infos, now_ns));
    rows.extend(ct::sockets(&sockets, &infos, &lb));
    Ok(rows)
}

pub fn kind(info: &FrontendInfo) -> &'static str {
    match info.kind {
        KIND_CLUSTER_IP => "ClusterIP",
        KIND_NODE_PORT => "NodePort",
        KIND_EXTERNAL_IP => "ExternalIP",
        KIND_LOAD_BALANCER => "LoadBalancer",
        _ => "?",
    }
}

/// The table of these map contents.
pub fn entries(
    services: &BTreeMap<SlotKey, ServiceValue>,
    backends: &BTreeMap<u32, BackendEntry>,
    infos: &BTreeMap<u32, FrontendInfo>,
    maglev: &MaglevShares,
) -> Vec<LbEntry> {
    services
        .iter()
        .filter(|(key, _)| key.slot() == 0)
        .map(|(key, value)| {
            let frontend = key.frontend();
            let info = infos.get(&value.rev_nat_id);
            let f = value.flags;
            let flags = [
                (f.is_affinity(), flag::AFFINITY),
                (f.is_local_only(), flag::LOCAL_POLICY),
                (f.has_source_ranges(), flag::SOURCE_RANGES),
                (f.drops_when_empty(), flag::DROP_WHEN_EMPTY),
                (frontend.scope == Scope::Internal, flag::IN_CLUSTER),
                (f.uses_maglev(), flag::MAGLEV),
                (f.is_dsr(), flag::DSR),
            ];
            let slot = |slot| Some((slot, services.get(&SlotKey::new(&frontend, slot))?));
            let slots = (1..=value.count).filter_map(slot);
            let table = maglev.get(&value.rev_nat_id).filter(|_| f.uses_maglev());
            let protocol = frontend.protocol.as_str().to_lowercase();
            LbEntry {
                frontend: format!("{}/{protocol}", SocketAddr::new(frontend.ip, frontend.port)),
                kind: info.map_or("?", kind).to_string(),
                service: info.map_or("?", FrontendInfo::name).to_string(),
                flags: flags.into_iter().filter(|(on, _)| *on).map(|(_, name)| name).collect(),
                backends: slots
                    .filter_map(|(n, slot)| Some((n, backends.get(&slot.backend_id)?)))
                    .map(|(n, b)| LbBackend {
                        address: b.addr().to_string(),
                        local: Some(b.flags().is_local()),
                        maglev_share: table.map(|t| t.get(&n).copied().unwrap_or(0)),
                    })
                    .collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proxy_common::{BackendFlags, ServiceFlags};

    use super::*;
    use proxy_common::{IPPROTO_TCP, IPPROTO_UDP};

    #[test]
    fn frontends_are_joined_with_their_backends_and_names() {
        let key = ServiceKey::new([10, 96, 0, 10], 53, IPPROTO_UDP, 0);
        let key6 = ServiceKey6::new(
            [0xfd, 0, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10],
            80,
            IPPROTO_TCP,
            0,
        );
        let flags = ServiceFlags::EMPTY.with_affinity(true).with_maglev(true);
        let front = ServiceValue { count: 2, rev_nat_id: 7, flags, ..Default::default() };
        let front6 = ServiceValue { count: 1, rev_nat_id: 8, ..Default::default() };
        let slot =
            |backend_id, rev_nat_id| ServiceValue { backend_id, rev_nat_id, ..Default::default() };
        let services = BTreeMap::from([
            (SlotKey::V4(key), front),
            (SlotKey::V4(key.with_slot(1)), slot(1, 7)),
            (SlotKey::V4(key.with_slot(2)), slot(2, 7)),
            (SlotKey::V6(key6), front6),
            (SlotKey::V6(key6.with_slot(1)), slot(3, 8)),
        ]);
        let backend = |last, flags| {
            BackendEntry::V4(Backend { address: [10, 244, 1, last], port: 5353, proto: 17, flags })
        };
        let mut address6 = key6.address;
        address6[3] = 0x44;
        let backend6 =
            Backend6 { address: address6, port: 8080, proto: 6, flags: BackendFlags::EMPTY };
        let backends = BTreeMap::from([
            (1, backend(2, BackendFlags::EMPTY.with_local(true))),
            (2, backend(3, BackendFlags::EMPTY)),
            (3, BackendEntry::V6(backend6)),
        ]);
        let infos = BTreeMap::from([
            (7, FrontendInfo::new(KIND_CLUSTER_IP, "demo/web:dns")),
            (8, FrontendInfo::new(KIND_CLUSTER_IP, "demo/web:http")),
        ]);
        let mut chunk = MaglevChunk::default();
        chunk.slots[..251].iter_mut().enumerate().for_each(|(i, s)| *s = 1 + (i % 3 == 0) as u16);
        let shares = maglev_shares(&[(MaglevKey { rev_nat_id: 7, chunk: 0 }, chunk)]);
        let table = entries(&services, &backends, &infos, &shares);
        assert_eq!(table.len(), 2);
        let e = &table[0];
        assert_eq!((e.frontend.as_str(), e.kind.as_str()), ("10.96.0.10:53/udp", "ClusterIP"));
        assert_eq!(
            (e.service.as_str(), e.flags.as_slice()),
            ("demo/web:dns", &[flag::AFFINITY, flag::MAGLEV][..])
        );
        let addrs: Vec<_> =
            e.backends.iter().map(|b| (b.address.as_str(), b.local, b.maglev_share)).collect();
        assert_eq!(
            addrs,
            [
                ("10.244.1.2:5353", Some(true), Some(167)),
                ("10.244.1.3:5353", Some(false), Some(84))
            ]
        );
        let e = &table[1];
        assert_eq!(
            (e.frontend.as_str(), e.service.as_str()),
            ("[fd00:96::10]:80/tcp", "demo/web:http")
        );
        assert_eq!(e.backends[0].address, "[fd00:44::10]:8080");
        assert_eq!(e.backends[0].maglev_share, None, "no table");
    }
}
