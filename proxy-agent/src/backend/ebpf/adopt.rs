//! A previous agent's service maps, adopted whole. A restart used to make
//! new service maps and write every entry again (2.2 million at 100,000
//! services × 10 endpoints, after reading a million ids to keep); where the
//! pinned maps are what this build would make, its programs use them as they
//! are, and the reconciler's record is read back from their entries (on a
//! thread of its own, while the source is read). The sync of the whole
//! source then writes only what changed while no agent ran.
//!
//! The previous agent's programs serve from those very maps until the new
//! ones take over: the sync of the whole source writes make-before-break
//! like any serving agent's, nothing is written before it, and
//! what it takes away is flushed as at any endpoint removal. Maps that
//! cannot be adopted (another layout or shape, larger than
//! `--bpf-lb-map-max`, Maglev tables of another size) are made afresh, the
//! previous agent's ids kept ([`super::carry::Reserved`]).

use std::{fmt, sync::Arc};

use hashbrown::HashMap;

use aya::maps::{
    Array, HashMap as BpfHashMap, Map, MapData, MapError, MapType,
    lpm_trie::{Key, LpmTrie},
};
use proxy_common::{
    Backend, Backend6, Config, FrontendInfo, FrontendStats, Layouts, MAX_MAGLEV_CHUNKS,
    MAX_SOURCE_RANGES, RevNat, RevNat6, SOURCE_RANGE_PREFIX_BITS, ServiceKey, ServiceKey6,
    ServiceValue, SourceRangeKey, SourceRangeKey6,
    maglev::{MaglevChunk, MaglevKey},
    map_names,
};

use super::{
    MapSizes,
    carry::Pinned,
    entries::{BackendEntry, RevNatEntry, SlotKey},
    maps::{read_all, read_each},
    prefilter,
    reconciler::{MapOp, Owner, Reconciler},
};
use crate::{
    model::{Cidr, ServiceName, ServicePortName},
    plan::{Frontend, FrontendKind},
};

/// A service map as this build makes it, but for its size.
struct ServiceMap {
    name: &'static str,
    kind: MapType,
    key_size: usize,
    value_size: usize,
    /// Its size, given the services, backends and reverse-NAT maps' sizes.
    entries: fn(&MapSizes) -> u32,
}

const fn map<K, V>(name: &'static str, kind: MapType, entries: fn(&MapSizes) -> u32) -> ServiceMap {
    ServiceMap { name, kind, key_size: size_of::<K>(), value_size: size_of::<V>(), entries }
}

/// The maps a sync writes and the programs read frontends from (the
/// frontends' counters too: they go on counting), adopted together or not
/// at all.
const SERVICE_MAPS: [ServiceMap; 11] = [
    map::<ServiceKey, ServiceValue>(map_names::SERVICES, MapType::Hash, |s| s.services),
    map::<ServiceKey6, ServiceValue>(map_names::SERVICES6, MapType::Hash, |s| s.services),
    map::<u32, Backend>(map_names::BACKENDS, MapType::Hash, |s| s.backends),
    map::<u32, Backend6>(map_names::BACKENDS6, MapType::Hash, |s| s.backends),
    map::<u32, RevNat>(map_names::REV_NAT, MapType::Hash, |s| s.rev_nat),
    map::<u32, RevNat6>(map_names::REV_NAT6, MapType::Hash, |s| s.rev_nat),
    map::<u32, FrontendInfo>(map_names::FRONTEND_INFO, MapType::Hash, |s| s.rev_nat),
    map::<u32, FrontendStats>(map_names::FRONTEND_STATS, MapType::PerCpuHash, |s| s.rev_nat),
    map::<Key<SourceRangeKey>, u8>(map_names::SOURCE_RANGES, MapType::LpmTrie, |_| {
        MAX_SOURCE_RANGES
    }),
    map::<Key<SourceRangeKey6>, u8>(map_names::SOURCE_RANGES6, MapType::LpmTrie, |_| {
        MAX_SOURCE_RANGES
    }),
    map::<MaglevKey, MaglevChunk>(map_names::MAGLEV, MapType::Hash, |_| MAX_MAGLEV_CHUNKS),
];

/// Why a previous agent's service maps are not adopted.
#[derive(Debug, PartialEq, Eq)]
pub enum NotAdopted {
    /// There are none (a first start).
    None,
    /// Another agent still runs on them (a DaemonSet's surge): its writes
    /// would not be in this agent's record.
    InUse,
    Layout(Layouts),
    /// A map is missing, or not as this build makes it.
    Shape(&'static str),
    /// Larger than `--bpf-lb-map-max` allows now.
    Bound {
        entries: u32,
        bound: u32,
    },
    /// Its Maglev tables have another size than `--bpf-lb-maglev-table-size`.
    MaglevTableSize {
        theirs: u32,
        ours: u32,
    },
}

impl fmt::Display for NotAdopted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotAdopted::None => write!(f, "there are none"),
            NotAdopted::InUse => write!(f, "another agent still runs on them"),
            NotAdopted::Layout(l) => {
                write!(
                    f,
                    "their layout (services {}, backends {}) is not this build's",
                    l.services, l.backends
                )
            }
            NotAdopted::Shape(name) => write!(f, "{name} is missing or not as this build makes it"),
            NotAdopted::Bound { entries, bound } => {
                write!(f, "they hold up to {entries} entries, over --bpf-lb-map-max {bound}")
            }
            NotAdopted::MaglevTableSize { theirs, ours } => {
                write!(
                    f,
                    "their Maglev tables have {theirs} entries, --bpf-lb-maglev-table-size {ours}"
                )
            }
        }
    }
}

/// The sizes of the service maps a previous agent pinned, if this build
/// can adopt them: its layouts, every map's kind, key and value as this
/// build makes them, their sizes within `bound`, and Maglev tables of
/// `maglev_table_size` entries.
pub fn adoptable(
    pinned: &Pinned,
    bound: u32,
    maglev_table_size: u32,
) -> Result<MapSizes, NotAdopted> {
    let layouts = pinned.layouts().ok_or(NotAdopted::None)?;
    let ours = Layouts::CURRENT;
    if layouts.services != ours.services || layouts.backends != ours.backends {
        return Err(NotAdopted::Layout(layouts));
    }
    let info = |name: &'static str| {
        let info = MapData::from_pin(pinned.path(name)).and_then(|m| m.info());
        info.map_err(|_| NotAdopted::Shape(name))
    };
    let entries = |name| info(name).map(|i| i.max_entries());
    let sizes = MapSizes {
        services: entries(map_names::SERVICES)?,
        backends: entries(map_names::BACKENDS)?,
        rev_nat: entries(map_names::REV_NAT)?,
    };
    for map in &SERVICE_MAPS {
        let info = info(map.name)?;
        let same = info.map_type().is_ok_and(|kind| kind == map.kind)
            && info.key_size() as usize == map.key_size
            && info.value_size() as usize == map.value_size
            && info.max_entries() == (map.entries)(&sizes);
        if !same {
            return Err(NotAdopted::Shape(map.name));
        }
    }
    let entries = sizes.services.max(sizes.backends).max(sizes.rev_nat);
    if entries > bound {
        return Err(NotAdopted::Bound { entries, bound });
    }
    let config = MapData::from_pin(pinned.path(map_names::CONFIG))
        .ok()
        .and_then(|data| Array::<_, Config>::try_from(Map::Array(data)).ok())
        .and_then(|array| array.get(&0, 0).ok())
        .ok_or(NotAdopted::Shape(map_names::CONFIG))?;
    if config.maglev_table_size != maglev_table_size {
        let theirs = config.maglev_table_size;
        return Err(NotAdopted::MaglevTableSize { theirs, ours: maglev_table_size });
    }
    Ok(sizes)
}

/// The service maps' names.
pub fn names() -> impl Iterator<Item = &'static str> {
    SERVICE_MAPS.iter().map(|map| map.name)
}

/// Points the loader at the pinned service maps: the programs use them.
pub fn reuse(pinned: &Pinned, loader: &mut aya::EbpfLoader<'_>) {
    for map in &SERVICE_MAPS {
        loader.map_pin_path(map.name, pinned.path(map.name));
    }
}

/// What the adopted maps hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    pub frontends: usize,
    pub backends: usize,
    pub service_entries: usize,
}

/// An adopted map that could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("opening {name}: {source}")]
    Open { name: &'static str, source: MapError },
    #[error("reading {name}: {source}")]
    Read { name: &'static str, source: MapError },
    #[error("reverse-NAT id {0} has no frontend info saying its protocol (an older agent's)")]
    Unnamed(u32),
    #[error("the thread reading them back failed")]
    Thread,
}

/// The adopted maps the record is read back from, opened from their pins
/// (descriptors of their own, for a thread of their own).
struct Pins {
    services: Map,
    services6: Map,
    backends: Map,
    backends6: Map,
    rev_nat: Map,
    rev_nat6: Map,
    frontend_info: Map,
    source_ranges: Map,
    source_ranges6: Map,
    maglev: Map,
}

impl Pins {
    fn open(pinned: &Pinned) -> Result<Self, AdoptError> {
        let open = |name| {
            MapData::from_pin(pinned.path(name))
                .and_then(Map::from_map_data)
                .map_err(|source| AdoptError::Open { name, source })
        };
        Ok(Pins {
            services: open(map_names::SERVICES)?,
            services6: open(map_names::SERVICES6)?,
            backends: open(map_names::BACKENDS)?,
            backends6: open(map_names::BACKENDS6)?,
            rev_nat: open(map_names::REV_NAT)?,
            rev_nat6: open(map_names::REV_NAT6)?,
            frontend_info: open(map_names::FRONTEND_INFO)?,
            source_ranges: open(map_names::SOURCE_RANGES)?,
            source_ranges6: open(map_names::SOURCE_RANGES6)?,
            maglev: open(map_names::MAGLEV)?,
        })
    }
}

/// What reading adopted maps back gives: the record of what they hold,
/// and the pre-filter bits their entries need.
pub struct ReadBack {
    pub record: Reconciler,
    pub bits: Vec<u32>,
}

/// Adopted maps being read back on a thread of their own, while the agent
/// reads its source (a second or two at 100,000 services: the loop must
/// not wait for it before the source is whole).
pub struct Adoption(std::thread::JoinHandle<Result<ReadBack, AdoptError>>);

impl Adoption {
    /// Reads the maps pinned under `pinned` back into `record` (empty).
    pub fn start(pinned: &Pinned, mut record: Reconciler) -> Result<Self, AdoptError> {
        let pins = Pins::open(pinned)?;
        let read = move || {
            let started = std::time::Instant::now();
            let mut bits = Vec::new();
            let adopted = read_back(&pins, &mut record, &mut bits)?;
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            let Adopted { frontends, backends, service_entries } = adopted;
            tracing::info!(
                frontends,
                backends,
                service_entries,
                ms,
                "the previous agent's service maps adopted and read back: the first sync writes only what changed"
            );
            Ok(ReadBack { record, bits })
        };
        let thread = std::thread::Builder::new().name("adopt".into()).spawn(read);
        thread.map(Adoption).map_err(|_| AdoptError::Thread)
    }

    /// The read-back, once done.
    pub fn finish(self) -> Result<ReadBack, AdoptError> {
        self.0.join().unwrap_or(Err(AdoptError::Thread))
    }
}

/// Records the adopted maps' entries in `record` (empty), as the writes
/// that made them, and collects the pre-filter's bits for them in `bits`:
/// backends first, then the frontends' reverse-NAT entries and infos, their
/// slots, source ranges and Maglev tables. Each map's entries as they are
/// read, a batch at a time.
fn read_back(
    maps: &Pins,
    record: &mut Reconciler,
    bits: &mut Vec<u32>,
) -> Result<Adopted, AdoptError> {
    let read = |name| move |source| AdoptError::Read { name, source };
    let by_id = frontends(maps)?;
    let backends = count::<Backend>(&maps.backends).map_err(read(map_names::BACKENDS))?
        + count::<Backend6>(&maps.backends6).map_err(read(map_names::BACKENDS6))?;
    record.make_room(by_id.len(), backends);
    let mut replay = |op: MapOp| {
        // A frontend's bit once, from its slot 0 (its other slots share it).
        if !matches!(&op, MapOp::PutService { key, .. } if key.slot() != 0) {
            bits.extend(prefilter::bits_of(&op));
        }
        record.adopt(&op);
    };
    let v4 = |id, b| replay(MapOp::PutBackend { id, backend: BackendEntry::V4(b) });
    read_each(&maps.backends, v4).map_err(read(map_names::BACKENDS))?;
    let v6 = |id, b| replay(MapOp::PutBackend { id, backend: BackendEntry::V6(b) });
    read_each(&maps.backends6, v6).map_err(read(map_names::BACKENDS6))?;
    for (&id, (frontend, value, owner)) in &by_id {
        let owner = owner.clone();
        replay(MapOp::PutRevNat { frontend: *frontend, id, value: *value, owner });
    }
    let mut service_entries = 0;
    let mut slot = |key: SlotKey, value| {
        service_entries += 1;
        replay(MapOp::PutService { key, value });
    };
    read_each(&maps.services, |key, value| slot(SlotKey::V4(key), value))
        .map_err(read(map_names::SERVICES))?;
    read_each(&maps.services6, |key, value| slot(SlotKey::V6(key), value))
        .map_err(read(map_names::SERVICES6))?;
    for (rev_nat_id, cidr) in source_ranges(maps)? {
        if let Some((frontend, ..)) = by_id.get(&rev_nat_id) {
            record.adopt(&MapOp::PutSourceRange { frontend: *frontend, rev_nat_id, cidr });
        }
    }
    let chunks = BpfHashMap::<_, MaglevKey, MaglevChunk>::try_from(&maps.maglev)
        .map_err(read(map_names::MAGLEV))?;
    for key in chunks.keys() {
        let key = key.map_err(read(map_names::MAGLEV))?;
        if let Some((frontend, ..)) = by_id.get(&key.rev_nat_id) {
            record.adopt_maglev_chunk(frontend, key.chunk);
        }
    }
    record.adopted();
    Ok(Adopted { frontends: by_id.len(), backends, service_entries })
}

/// How many entries one family's backends map holds.
fn count<B: aya::Pod>(map: &Map) -> Result<usize, MapError> {
    let mut entries = 0;
    read_each::<u32, B>(map, |_, _| entries += 1)?;
    Ok(entries)
}

/// A frontend as its reverse-NAT entry and info name it.
type Named = (Frontend, RevNatEntry, Owner);

/// The frontends by reverse-NAT id, from both families' entries and the
/// infos that name them (one without its info is not adopted).
fn frontends(maps: &Pins) -> Result<HashMap<u32, Named>, AdoptError> {
    let read = |name| move |source| AdoptError::Read { name, source };
    let infos: HashMap<u32, FrontendInfo> = read_all(&maps.frontend_info)
        .map_err(read(map_names::FRONTEND_INFO))?
        .into_iter()
        .collect();
    let v4 = read_all::<u32, RevNat>(&maps.rev_nat).map_err(read(map_names::REV_NAT))?;
    let v6 = read_all::<u32, RevNat6>(&maps.rev_nat6).map_err(read(map_names::REV_NAT6))?;
    let entries = v4
        .into_iter()
        .map(|(id, r)| (id, RevNatEntry::V4(r)))
        .chain(v6.into_iter().map(|(id, r)| (id, RevNatEntry::V6(r))));
    let mut names = Names::default();
    let mut frontends = HashMap::with_capacity(infos.len());
    for (id, entry) in entries {
        let info = infos.get(&id).ok_or(AdoptError::Unnamed(id))?;
        let frontend = entry.frontend(info).ok_or(AdoptError::Unnamed(id))?;
        frontends.insert(id, (frontend, entry, names.owner(info)));
    }
    Ok(frontends)
}

/// Both families' source ranges, by reverse-NAT id.
fn source_ranges(maps: &Pins) -> Result<Vec<(u32, Cidr)>, AdoptError> {
    let mut ranges = Vec::new();
    let v4 = |k: &SourceRangeKey| (k.rev_nat_id, k.address.into());
    read_trie(&maps.source_ranges, map_names::SOURCE_RANGES, v4, &mut ranges)?;
    let v6 = |k: &SourceRangeKey6| (k.rev_nat_id, k.address.into());
    read_trie(&maps.source_ranges6, map_names::SOURCE_RANGES6, v6, &mut ranges)?;
    Ok(ranges)
}

/// One family's source ranges (`parts`: a key's id and address) into
/// `ranges`.
fn read_trie<K: aya::Pod>(
    map: &Map,
    name: &'static str,
    parts: impl Fn(&K) -> (u32, std::net::IpAddr),
    ranges: &mut Vec<(u32, Cidr)>,
) -> Result<(), AdoptError> {
    let read = |source| AdoptError::Read { name, source };
    let trie = LpmTrie::<_, K, u8>::try_from(map).map_err(read)?;
    for key in trie.keys() {
        let key = key.map_err(read)?;
        let (rev_nat_id, addr) = parts(&key.data());
        let len = key.prefix_len().saturating_sub(SOURCE_RANGE_PREFIX_BITS) as u8;
        ranges.push((rev_nat_id, Cidr { addr, len }));
    }
    Ok(())
}

/// The service port names the infos hold, each read once (a service's
/// frontends share it, as they share the plan's).
#[derive(Default)]
struct Names(HashMap<String, Arc<ServicePortName>>);

impl Names {
    fn owner(&mut self, info: &FrontendInfo) -> Owner {
        let name = info.name();
        let service = match self.0.get(name) {
            Some(service) => service.clone(),
            None => {
                let service = Arc::new(service_port_name(name));
                self.0.insert(name.to_string(), service.clone());
                service
            }
        };
        Owner { service, kind: kind(info.kind) }
    }
}

/// `namespace/name:port` (or `namespace/name`) as [`ServicePortName`]
/// writes it. A name the info cut short reads as another service: the
/// first sync then writes its info again, which is all it costs.
fn service_port_name(text: &str) -> ServicePortName {
    let (namespace, rest) = text.split_once('/').unwrap_or(("", text));
    let (name, port) = rest.split_once(':').unwrap_or((rest, ""));
    ServicePortName {
        service: ServiceName { namespace: namespace.into(), name: name.into() },
        port: port.into(),
    }
}

fn kind(kind: u8) -> FrontendKind {
    match kind {
        proxy_common::KIND_NODE_PORT => FrontendKind::NodePort,
        proxy_common::KIND_EXTERNAL_IP => FrontendKind::ExternalIp,
        proxy_common::KIND_LOAD_BALANCER => FrontendKind::LoadBalancer,
        _ => FrontendKind::ClusterIp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_port_names_read_back_as_they_were_written() {
        for name in [
            ServicePortName::of("default", "web", "http"),
            ServicePortName::of("kube-system", "kube-dns", ""),
        ] {
            assert_eq!(service_port_name(&name.to_string()), name);
        }
    }

    #[test]
    fn frontend_kinds_read_back_as_owners_write_them() {
        let frontend =
            Frontend::new("10.96.0.10".parse().unwrap(), 53, crate::model::Protocol::Udp);
        let mut names = Names::default();
        for kind in [
            FrontendKind::ClusterIp,
            FrontendKind::NodePort,
            FrontendKind::ExternalIp,
            FrontendKind::LoadBalancer,
        ] {
            let owner = Owner { service: Arc::new(ServicePortName::of("ns", "dns", "dns")), kind };
            let read = names.owner(&owner.info(&frontend));
            assert_eq!(read, owner);
        }
        assert_eq!(names.0.len(), 1, "one name shared by the frontends of a service port");
    }
}
