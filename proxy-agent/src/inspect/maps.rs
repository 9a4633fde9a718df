//! The service table from the eBPF mode's pinned maps: `SERVICES` (each
//! frontend's slot 0 and its backend slots), `BACKENDS` and
//! `FRONTEND_INFO` (service name and kind, by reverse-NAT id).

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
};

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common::{
    Backend, CtEntryV1, CtEntryV2, CtKey, FrontendInfo, IPPROTO_TCP, IPPROTO_UDP, KIND_CLUSTER_IP,
    KIND_EXTERNAL_IP, KIND_LOAD_BALANCER, KIND_NODE_PORT, SCOPE_INTERNAL, ServiceKey, ServiceValue,
    SockRevNat, SockRevNatKey, map_names,
};

use super::{LbBackend, LbEntry, ct, ct::CtRow, flag};

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

/// The table of the maps pinned under `root`.
pub fn read_pinned(root: &Path) -> Result<Vec<LbEntry>, ReadError> {
    let services = read(root, map_names::SERVICES)?;
    let backends = read(root, map_names::BACKENDS)?;
    let infos = read(root, map_names::FRONTEND_INFO)?;
    Ok(entries(&services, &backends, &infos))
}

/// The flows of the maps pinned under `root` at `now_ns`: per packet
/// (`CONNTRACK`, either layout) and per socket (`SOCK_REV_NAT`).
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
    let sockets: Vec<(SockRevNatKey, SockRevNat)> = read(root, map_names::SOCK_REV_NAT)?;
    let mut rows = ct::flows(&conntrack, &infos, now_ns);
    rows.extend(ct::sockets(&sockets, &infos, &lb));
    Ok(rows)
}

pub fn protocol(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "tcp",
        IPPROTO_UDP => "udp",
        _ => "?",
    }
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
    services: &BTreeMap<ServiceKey, ServiceValue>,
    backends: &BTreeMap<u32, Backend>,
    infos: &BTreeMap<u32, FrontendInfo>,
) -> Vec<LbEntry> {
    services
        .iter()
        .filter(|(key, _)| key.slot == 0)
        .map(|(key, value)| {
            let info = infos.get(&value.rev_nat_id);
            let f = value.flags;
            let flags = [
                (f.is_affinity(), flag::AFFINITY),
                (f.is_local_only(), flag::LOCAL_POLICY),
                (f.has_source_ranges(), flag::SOURCE_RANGES),
                (f.drops_when_empty(), flag::DROP_WHEN_EMPTY),
                (key.scope == SCOPE_INTERNAL, flag::IN_CLUSTER),
            ];
            let slots = (1..=value.count).filter_map(|slot| services.get(&key.with_slot(slot)));
            LbEntry {
                frontend: format!(
                    "{}:{}/{}",
                    Ipv4Addr::from(key.address),
                    key.port,
                    protocol(key.proto)
                ),
                kind: info.map_or("?", kind).to_string(),
                service: info.map_or("?", FrontendInfo::name).to_string(),
                flags: flags.into_iter().filter(|(on, _)| *on).map(|(_, name)| name).collect(),
                backends: slots
                    .filter_map(|slot| backends.get(&slot.backend_id))
                    .map(|b| LbBackend {
                        address: SocketAddrV4::new(b.address.into(), b.port).to_string(),
                        local: Some(b.flags.is_local()),
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

    #[test]
    fn frontends_are_joined_with_their_backends_and_names() {
        let key = ServiceKey::new([10, 96, 0, 10], 53, IPPROTO_UDP, 0);
        let flags = ServiceFlags::EMPTY.with_affinity(true);
        let front = ServiceValue { count: 2, rev_nat_id: 7, flags, ..Default::default() };
        let slot = |slot, backend_id| {
            (key.with_slot(slot), ServiceValue { backend_id, rev_nat_id: 7, ..Default::default() })
        };
        let services = BTreeMap::from([(key, front), slot(1, 1), slot(2, 2)]);
        let backend =
            |last, flags| Backend { address: [10, 244, 1, last], port: 5353, proto: 17, flags };
        let backends = BTreeMap::from([
            (1, backend(2, BackendFlags::EMPTY.with_local(true))),
            (2, backend(3, BackendFlags::EMPTY)),
        ]);
        let infos = BTreeMap::from([(7, FrontendInfo::new(KIND_CLUSTER_IP, "demo/web:dns"))]);
        let table = entries(&services, &backends, &infos);
        assert_eq!(table.len(), 1);
        let e = &table[0];
        assert_eq!((e.frontend.as_str(), e.kind.as_str()), ("10.96.0.10:53/udp", "ClusterIP"));
        assert_eq!(
            (e.service.as_str(), e.flags.as_slice()),
            ("demo/web:dns", &[flag::AFFINITY][..])
        );
        let addrs: Vec<_> = e.backends.iter().map(|b| (b.address.as_str(), b.local)).collect();
        assert_eq!(addrs, [("10.244.1.2:5353", Some(true)), ("10.244.1.3:5353", Some(false))]);
    }
}
