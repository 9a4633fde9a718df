//! State that outlives an agent. Flows, affinity and socket reverse-NAT
//! entries live in the pinned maps; a new agent's programs use those very
//! maps when their layout (`proxy_common::layout`) and shape match, and get
//! converted copies when this build reads the pinned layout but another
//! shape (an upgrade or rollback that changed a value, or another size:
//! `state_sizes`). Only what it cannot
//! read starts empty, logged and counted.
//!
//! Those entries name frontends and backends by id, so the ids the previous
//! agent gave them are kept too ([`Reserved`]): the service maps are rebuilt,
//! but each frontend and backend gets its old id back.

use std::path::{Path, PathBuf};

use aya::{
    Pod,
    maps::{Array, HashMap, Map, MapData, MapError, MapType},
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, Backend6, CtEntry, CtEntryV1, CtEntryV2, CtKey, FragKey,
    FragRewrite, FrontendInfo, Layouts, RevNat, RevNat6, ServiceKey, ServiceKey6, ServiceValue,
    SockFlow, SockFlowKey, SockRevNat, SockRevNat6, SockRevNatKey, SockRevNatKey6, map_names,
};
use proxy_common::{AffinityKey6, CtEntry6, CtEntry6V1, CtEntry6V2, CtKey6};

use super::{
    entries::{BackendEntry, RevNatEntry, SlotKey},
    maps::read_all,
};
use crate::plan::Frontend;

/// What a map looks like to the kernel: a pinned map is used as it is only
/// if it has exactly the shape this build would create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub lru: bool,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

/// A map whose entries outlive the agent.
#[derive(Clone, Copy, Debug)]
pub struct StateMap {
    pub name: &'static str,
    /// Its version in a `Layouts`.
    version: fn(&Layouts) -> u32,
    /// The layouts this build converts from (its own included).
    reads: &'static [u32],
    /// Its shape but for the size, which the agent's settings give
    /// (`state_sizes`).
    shape: Shape,
}

impl StateMap {
    /// Its shape at `max_entries`.
    pub fn shape(&self, max_entries: u32) -> Shape {
        Shape { max_entries, ..self.shape }
    }
}

const fn lru<K, V>() -> Shape {
    Shape {
        lru: true,
        key_size: size_of::<K>() as u32,
        value_size: size_of::<V>() as u32,
        max_entries: 0,
    }
}

/// The state maps, in the order they are carried.
pub const STATE_MAPS: [StateMap; 8] = [
    StateMap {
        name: map_names::CONNTRACK,
        version: |l| l.conntrack,
        reads: &[1, 2],
        shape: lru::<CtKey, CtEntry>(),
    },
    StateMap {
        name: map_names::AFFINITY,
        version: |l| l.affinity,
        reads: &[1],
        shape: lru::<AffinityKey, AffinityValue>(),
    },
    StateMap {
        name: map_names::SOCK_REV_NAT,
        version: |l| l.sock_rev_nat,
        reads: &[1],
        shape: lru::<SockRevNatKey, SockRevNat>(),
    },
    StateMap {
        name: map_names::FRAGMENTS,
        version: |l| l.fragments,
        reads: &[1],
        shape: lru::<FragKey, FragRewrite>(),
    },
    StateMap {
        name: map_names::SOCK_FLOWS,
        version: |l| l.sock_flows,
        reads: &[1],
        shape: lru::<SockFlowKey, SockFlow>(),
    },
    StateMap {
        name: map_names::SOCK_REV_NAT6,
        version: |l| l.sock_rev_nat6,
        reads: &[1],
        shape: lru::<SockRevNatKey6, SockRevNat6>(),
    },
    StateMap {
        name: map_names::CONNTRACK6,
        version: |l| l.conntrack6,
        reads: &[1, 2],
        shape: lru::<CtKey6, CtEntry6>(),
    },
    StateMap {
        name: map_names::AFFINITY6,
        version: |l| l.affinity6,
        reads: &[1],
        shape: lru::<AffinityKey6, AffinityValue>(),
    },
];

/// What becomes of a previous agent's state map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carry {
    /// There is none: start empty.
    Nothing,
    /// Same layout, same shape: the new programs use the pinned map itself.
    Reuse,
    /// A layout this build reads, in another shape: its entries are
    /// converted into the new map.
    Convert { from: u32 },
    /// A layout this build cannot read: start empty.
    Reset { version: u32 },
    /// A service map not adopted ([`super::adopt`]): made again from the
    /// source, each frontend and backend under its previous id.
    Rebuilt,
}

impl Carry {
    pub fn as_str(self) -> &'static str {
        match self {
            Carry::Nothing => "none",
            Carry::Reuse => "reused",
            Carry::Convert { .. } => "converted",
            Carry::Reset { .. } => "reset",
            Carry::Rebuilt => "rebuilt",
        }
    }
}

/// The decision for one map made as `ours`, from its pinned layout
/// version and shape.
pub fn decide(map: &StateMap, ours: Shape, pinned: Option<(&Layouts, Shape)>) -> Carry {
    let Some((layouts, shape)) = pinned else { return Carry::Nothing };
    let version = (map.version)(layouts);
    let current = (map.version)(&Layouts::CURRENT);
    let same_kind = shape.lru == ours.lru && shape.key_size == ours.key_size;
    if version == current && shape == ours {
        Carry::Reuse
    } else if same_kind
        && map.reads.contains(&version)
        && value_size(map, version) == Some(shape.value_size)
    {
        Carry::Convert { from: version }
    } else {
        Carry::Reset { version }
    }
}

/// The value size of `map` in layout `version`, where this build knows it.
fn value_size(map: &StateMap, version: u32) -> Option<u32> {
    match (map.name, version) {
        (map_names::CONNTRACK, 1) => Some(size_of::<CtEntryV1>() as u32),
        (map_names::CONNTRACK, 2) => Some(size_of::<CtEntryV2>() as u32),
        (map_names::CONNTRACK6, 1) => Some(size_of::<CtEntry6V1>() as u32),
        (map_names::CONNTRACK6, 2) => Some(size_of::<CtEntry6V2>() as u32),
        _ if version == (map.version)(&Layouts::CURRENT) => Some(map.shape.value_size),
        _ => None,
    }
}

/// A previous agent's pins under `--bpffs-root`.
pub struct Pinned {
    maps: PathBuf,
    /// Its layouts; `None` when there are no pins.
    layouts: Option<Layouts>,
}

impl Pinned {
    /// Reads the layouts of the maps pinned under `root` (pins without a
    /// `LAYOUT` map are the first release's: version 1 throughout).
    pub fn open(root: &Path) -> Result<Self, MapError> {
        let maps = root.join("maps");
        let layouts = match open(&maps, map_names::LAYOUT) {
            Ok(map) => Some(Array::<_, Layouts>::try_from(map)?.get(&0, 0)?),
            Err(_) if maps.join(map_names::CONNTRACK).exists() => Some(Layouts::FIRST),
            Err(_) => None,
        };
        Ok(Pinned { maps, layouts })
    }

    /// Its layouts; `None` when there are no pins.
    pub fn layouts(&self) -> Option<Layouts> {
        self.layouts
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.maps.join(name)
    }

    /// What becomes of `map`, made with `max_entries`.
    pub fn carry(&self, map: &StateMap, max_entries: u32) -> Carry {
        let pinned = self.layouts.as_ref().and_then(|layouts| {
            let data = MapData::from_pin(self.path(map.name)).ok()?;
            let info = data.info().ok()?;
            let lru = matches!(info.map_type(), Ok(MapType::LruHash));
            let shape = Shape {
                lru,
                key_size: info.key_size(),
                value_size: info.value_size(),
                max_entries: info.max_entries(),
            };
            Some((layouts, shape))
        });
        decide(map, map.shape(max_entries), pinned)
    }

    /// The ids the previous agent gave frontends and backends, if its
    /// service maps are in a layout this build reads.
    pub fn reserved(&self) -> Result<Reserved, MapError> {
        let Some(layouts) = self.layouts else { return Ok(Reserved::default()) };
        if layouts.services != Layouts::CURRENT.services
            || layouts.backends != Layouts::CURRENT.backends
        {
            tracing::warn!(
                services = layouts.services,
                backends = layouts.backends,
                "the previous agent's service maps have a layout this build cannot read: frontends and backends get new ids (affinity is forgotten)"
            );
            return Ok(Reserved::default());
        }
        let dir = &self.maps;
        let mut reserved = Reserved::default();
        // The frontends from their reverse-NAT entries and infos (a tenth
        // of the service keys at ten endpoints a service), where the
        // previous agent's infos say their protocols.
        match named_frontends(read_frontend_infos(dir)?, read_rev_nat(dir)?) {
            Some(frontends) => reserved.frontends = frontends,
            None => {
                reserved.read_frontends::<ServiceKey>(dir, map_names::SERVICES)?;
                if dir.join(map_names::SERVICES6).exists() {
                    reserved.read_frontends::<ServiceKey6>(dir, map_names::SERVICES6)?;
                }
            }
        }
        reserved.read_backends::<ServiceKey>(dir, map_names::BACKENDS)?;
        // The IPv6 maps, where the previous agent had them.
        if dir.join(map_names::BACKENDS6).exists() {
            reserved.read_backends::<ServiceKey6>(dir, map_names::BACKENDS6)?;
        }
        Ok(reserved)
    }
}

/// A family's services-map key and backend, as the maps hold them.
trait FamilyMaps: Pod {
    type Backend: Pod;
    fn slot_key(self) -> SlotKey;
    fn backend_entry(backend: Self::Backend) -> BackendEntry;
}

impl FamilyMaps for ServiceKey {
    type Backend = Backend;
    fn slot_key(self) -> SlotKey {
        SlotKey::V4(self)
    }
    fn backend_entry(backend: Backend) -> BackendEntry {
        BackendEntry::V4(backend)
    }
}

impl FamilyMaps for ServiceKey6 {
    type Backend = Backend6;
    fn slot_key(self) -> SlotKey {
        SlotKey::V6(self)
    }
    fn backend_entry(backend: Backend6) -> BackendEntry {
        BackendEntry::V6(backend)
    }
}

impl Reserved {
    /// Adds the frontends' ids one family's service keys give: every slot is
    /// an entry, a million at 100,000 services, read in batches.
    fn read_frontends<K: FamilyMaps>(&mut self, dir: &Path, name: &str) -> Result<(), MapError> {
        let services = read_all::<K, ServiceValue>(&open(dir, name)?)?;
        let frontends = services
            .into_iter()
            .map(|(key, value)| (key.slot_key(), value))
            .filter(|(key, _)| key.slot() == 0)
            .map(|(key, value)| (key.frontend(), value.rev_nat_id));
        self.frontends.extend(frontends);
        Ok(())
    }

    /// Adds the backends' ids one family's backends map gives.
    fn read_backends<K: FamilyMaps>(&mut self, dir: &Path, name: &str) -> Result<(), MapError> {
        let backends = read_all::<u32, K::Backend>(&open(dir, name)?)?;
        self.backends.reserve(backends.len());
        self.backends.extend(backends.into_iter().map(|(id, b)| (K::backend_entry(b), id)));
        Ok(())
    }
}

fn read_frontend_infos(dir: &Path) -> Result<Vec<(u32, FrontendInfo)>, MapError> {
    read_all(&open(dir, map_names::FRONTEND_INFO)?)
}

/// Both families' reverse-NAT entries (one id space).
fn read_rev_nat(dir: &Path) -> Result<hashbrown::HashMap<u32, RevNatEntry>, MapError> {
    let v4 = read_all::<u32, RevNat>(&open(dir, map_names::REV_NAT)?)?;
    let mut entries: hashbrown::HashMap<u32, RevNatEntry> =
        v4.into_iter().map(|(id, r)| (id, RevNatEntry::V4(r))).collect();
    if dir.join(map_names::REV_NAT6).exists() {
        let v6 = read_all::<u32, RevNat6>(&open(dir, map_names::REV_NAT6)?)?;
        entries.extend(v6.into_iter().map(|(id, r)| (id, RevNatEntry::V6(r))));
    }
    Ok(entries)
}

/// Which frontend each reverse-NAT id names, from the frontends' infos and
/// reverse-NAT entries; `None` if an info does not say its frontend's
/// protocol (an older agent's: its service keys say it instead).
fn named_frontends(
    infos: Vec<(u32, FrontendInfo)>,
    rev_nat: hashbrown::HashMap<u32, RevNatEntry>,
) -> Option<hashbrown::HashMap<Frontend, u32>> {
    let mut frontends = hashbrown::HashMap::with_capacity(infos.len());
    for (id, info) in infos {
        // An info without its entry names nothing the programs serve.
        let Some(entry) = rev_nat.get(&id) else { continue };
        frontends.insert(entry.frontend(&info)?, id);
    }
    Some(frontends)
}

fn open(dir: &Path, name: &str) -> Result<Map, MapError> {
    Map::from_map_data(MapData::from_pin(dir.join(name))?)
}

/// Which ids the frontends and backends of service maps being made keep.
#[derive(Debug)]
pub enum KeptIds {
    /// The previous agent's maps themselves, adopted whole, their entries
    /// read back ([`super::adopt`]): at the start, where they can be.
    Adopted,
    /// The previous agent's, read from its pinned maps (if any): at the
    /// start.
    Pinned,
    /// These, given by the maps being replaced.
    These(Reserved),
}

/// Ids to keep, by what they name: a previous agent's, or those of maps
/// being replaced ([`KeptIds`]). Hashed, as a restart at 100,000 services
/// reads a million of them before its first write.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    pub frontends: hashbrown::HashMap<Frontend, u32>,
    pub backends: hashbrown::HashMap<BackendEntry, u32>,
}

/// A previous agent's state map whose entries are converted into ours.
pub struct Conversion {
    pub map: &'static StateMap,
    from: u32,
    old: Map,
}

impl Conversion {
    pub fn open(pinned: &Pinned, map: &'static StateMap, from: u32) -> Result<Self, MapError> {
        Ok(Conversion { map, from, old: open(&pinned.maps, map.name)? })
    }

    /// Copies the old map's entries into `new`; with `only_missing`, those
    /// `new` lacks (the programs' own entries win). Returns how many.
    pub fn copy_into(&self, new: &mut Map, only_missing: bool) -> Result<usize, MapError> {
        let flags = if only_missing { BPF_NOEXIST } else { 0 };
        match (self.map.name, self.from) {
            (map_names::CONNTRACK, 1) => copy::<CtKey, CtEntryV1, CtEntry>(&self.old, new, flags),
            (map_names::CONNTRACK, _) => copy::<CtKey, CtEntryV2, CtEntry>(&self.old, new, flags),
            (map_names::CONNTRACK6, 1) => {
                copy::<CtKey6, CtEntry6V1, CtEntry6>(&self.old, new, flags)
            }
            (map_names::CONNTRACK6, _) => {
                copy::<CtKey6, CtEntry6V2, CtEntry6>(&self.old, new, flags)
            }
            (map_names::AFFINITY6, _) => {
                copy::<AffinityKey6, AffinityValue, AffinityValue>(&self.old, new, flags)
            }
            (map_names::AFFINITY, _) => {
                copy::<AffinityKey, AffinityValue, AffinityValue>(&self.old, new, flags)
            }
            (map_names::SOCK_REV_NAT, _) => {
                copy::<SockRevNatKey, SockRevNat, SockRevNat>(&self.old, new, flags)
            }
            (map_names::SOCK_FLOWS, _) => {
                copy::<SockFlowKey, SockFlow, SockFlow>(&self.old, new, flags)
            }
            (map_names::SOCK_REV_NAT6, _) => {
                copy::<SockRevNatKey6, SockRevNat6, SockRevNat6>(&self.old, new, flags)
            }
            _ => copy::<FragKey, FragRewrite, FragRewrite>(&self.old, new, flags),
        }
    }
}

/// `bpf_map_update_elem` flag: only if the key is absent.
const BPF_NOEXIST: u64 = 1;

fn copy<K: Pod, Old: Pod, New: Pod + From<Old>>(
    old: &Map,
    new: &mut Map,
    flags: u64,
) -> Result<usize, MapError> {
    let old = HashMap::<_, K, Old>::try_from(old)?;
    let mut new = HashMap::<_, K, New>::try_from(new)?;
    let mut copied = 0;
    for (key, value) in old.iter().filter_map(Result::ok) {
        // EEXIST (only missing ones) or a full map: the entry is not carried.
        if new.insert(key, New::from(value), flags).is_ok() {
            copied += 1;
        }
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conntrack() -> &'static StateMap {
        &STATE_MAPS[0]
    }

    /// The size the maps are made with in these tests.
    const SIZE: u32 = 131_072;

    /// [`decide`] for a map made at [`SIZE`].
    fn decide_at(map: &StateMap, pinned: Option<(&Layouts, Shape)>) -> Carry {
        decide(map, map.shape(SIZE), pinned)
    }

    fn with_conntrack(version: u32) -> Layouts {
        Layouts { conntrack: version, ..Layouts::CURRENT }
    }

    fn shape_of(value: usize) -> Shape {
        Shape { value_size: value as u32, ..conntrack().shape(SIZE) }
    }

    #[test]
    fn the_same_layout_and_shape_is_reused() {
        let ours = conntrack().shape(SIZE);
        assert_eq!(decide_at(conntrack(), Some((&Layouts::CURRENT, ours))), Carry::Reuse);
        assert_eq!(decide_at(conntrack(), None), Carry::Nothing);
        let other_size = Shape { max_entries: 1024, ..ours };
        let from = Layouts::CURRENT.conntrack;
        assert_eq!(
            decide_at(conntrack(), Some((&Layouts::CURRENT, other_size))),
            Carry::Convert { from }
        );
    }

    #[test]
    fn conntrack_layouts_convert_across_upgrades_and_rollbacks() {
        for (version, size) in [(1, size_of::<CtEntryV1>()), (2, size_of::<CtEntryV2>())] {
            let carry = decide_at(conntrack(), Some((&with_conntrack(version), shape_of(size))));
            let expect = if version == Layouts::CURRENT.conntrack {
                Carry::Reuse
            } else {
                Carry::Convert { from: version }
            };
            assert_eq!(carry, expect, "from layout {version}");
        }
    }

    #[test]
    fn a_map_added_later_is_carried_only_from_agents_that_had_it() {
        let flows = STATE_MAPS.iter().find(|m| m.name == map_names::SOCK_FLOWS).unwrap();
        let ours = flows.shape(SIZE);
        assert_eq!(decide_at(flows, Some((&Layouts::CURRENT, ours))), Carry::Reuse);
        // Earlier agents left its word at 0 (reserved): whatever sits at
        // that name is not theirs to trust.
        let before = Layouts { sock_flows: 0, ..Layouts::CURRENT };
        assert_eq!(decide_at(flows, Some((&before, ours))), Carry::Reset { version: 0 });
        assert_eq!(decide_at(flows, Some((&Layouts::FIRST, ours))), Carry::Reset { version: 0 });
    }

    #[test]
    fn ipv6_conntrack_converts_as_the_ipv4_one_and_is_new_to_older_agents() {
        let map = STATE_MAPS.iter().find(|m| m.name == map_names::CONNTRACK6).unwrap();
        let other = if Layouts::CURRENT.conntrack6 == 1 { 2 } else { 1 };
        let size = if other == 1 { size_of::<CtEntry6V1>() } else { size_of::<CtEntry6V2>() };
        let pinned = Layouts { conntrack6: other, ..Layouts::CURRENT };
        let shape = Shape { value_size: size as u32, ..map.shape(SIZE) };
        assert_eq!(decide_at(map, Some((&pinned, shape))), Carry::Convert { from: other });
        let before = Layouts { conntrack6: 0, ..Layouts::CURRENT };
        assert_eq!(decide_at(map, Some((&before, map.shape(SIZE)))), Carry::Reset { version: 0 });
    }

    #[test]
    fn frontend_ids_are_read_from_infos_and_reverse_nat_entries_unless_an_older_agent_wrote_them() {
        use crate::{
            backend::ebpf::reconciler::Owner,
            model::{Protocol, ServiceName, ServicePortName},
            plan::FrontendKind,
        };
        let dns = Frontend::new("10.96.0.10".parse().unwrap(), 53, Protocol::Udp);
        let web = Frontend::new("fd00:96::a".parse().unwrap(), 80, Protocol::Sctp).internal();
        let service = ServiceName { namespace: "ns".into(), name: "web".into() };
        let service = std::sync::Arc::new(ServicePortName { service, port: "".into() });
        let owner = Owner { service, kind: FrontendKind::ClusterIp };
        let infos = vec![(3, owner.info(&dns)), (4, owner.info(&web)), (9, owner.info(&dns))];
        let rev_nat = hashbrown::HashMap::from([
            (3, RevNatEntry::new(&dns)),
            (4, RevNatEntry::new(&web)),
            (5, RevNatEntry::new(&dns)),
        ]);
        let named = named_frontends(infos.clone(), rev_nat.clone()).unwrap();
        // Id 9 has no reverse-NAT entry, id 5 no info: neither names one.
        assert_eq!(named, hashbrown::HashMap::from([(dns, 3), (web, 4)]));

        let mut older = infos;
        older[1].1 = FrontendInfo::new(older[1].1.kind, older[1].1.name());
        assert_eq!(named_frontends(older, rev_nat), None, "read from the service keys instead");
    }

    #[test]
    fn unreadable_layouts_start_afresh() {
        let future = decide_at(conntrack(), Some((&with_conntrack(9), shape_of(64))));
        assert_eq!(future, Carry::Reset { version: 9 });
        // A layout we know, but not the size it should have: not trusted.
        let v1 = decide_at(conntrack(), Some((&with_conntrack(1), shape_of(40))));
        assert_eq!(v1, Carry::Reset { version: 1 });
        let hash = Shape { lru: false, ..conntrack().shape(SIZE) };
        let current = Layouts::CURRENT.conntrack;
        assert_eq!(
            decide_at(conntrack(), Some((&Layouts::CURRENT, hash))),
            Carry::Reset { version: current }
        );
    }
}
