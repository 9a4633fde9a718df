//! Incremental, make-before-break updates of the service maps. Pure code: the
//! kernel maps sit behind [`MapWriter`], so the ordering is unit-tested.
//!
//! For every plan, writes go in this order:
//! 1. new backends;
//! 2. the reverse-NAT entries of new frontends (and of those that changed
//!    service or kind), which no frontend slot names yet;
//! 3. per frontend (internal scopes first, so a frontend's two-scopes flag
//!    never names a twin not there yet): changed backend slots, new source
//!    ranges, its Maglev table where its slots or their backends changed
//!    (naming only slots that exist), then the frontend slot (count, flags),
//!    then slots beyond the new count, source ranges it no longer has and
//!    a table it no longer uses (so the slots of one frontend after another
//!    are one run of writes, batched);
//! 4. removed frontends (external scopes first): the frontend slot first,
//!    then its slots, source ranges, table and reverse-NAT entry;
//! 5. backends no slot names any more.
//!
//! So a program that read a frontend count always finds slots `1..=count`,
//! and every slot names a backend that exists. `SyncState` records each
//! write only once the kernel accepted it: after a failed write it still
//! describes the maps exactly, and the next sync resumes from there.
//!
//! A sync may be told which frontends changed: it then looks at those only
//! (and at their backends), so one endpoint change costs the same at 10 or
//! 100,000 services. Backends are collected by reference count (how many
//! installed slots name each), and map sizes are kept as running counts.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use hashbrown::HashMap;

use proxy_common::{
    FrontendInfo, KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER, KIND_NODE_PORT,
    MAX_MAGLEV_CHUNKS, MAX_SOURCE_RANGES, ServiceFlags, ServiceValue,
    maglev::{self as maglev_map, CHUNK_SLOTS, MaglevChunk},
};

use super::{
    batch,
    carry::Reserved,
    departures::Departures,
    entries::{BackendEntry, RevNatEntry, SlotKey},
    installed::{Backends, Pos, Slots},
};
use crate::{
    fit, maglev,
    model::{Cidr, IpFamily, ServiceName, ServicePortName},
    plan::{BackendPlan, Frontend, FrontendKind, FrontendPlan, Plan, Scope},
};

/// One write to the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend {
        id: u32,
        backend: BackendEntry,
    },
    /// Also the frontend's [`FrontendInfo`] (of its `owner`), which alone
    /// may change later.
    PutRevNat {
        frontend: Frontend,
        id: u32,
        value: RevNatEntry,
        owner: Owner,
    },
    PutService {
        key: SlotKey,
        value: ServiceValue,
    },
    DeleteService {
        key: SlotKey,
    },
    DeleteRevNat {
        frontend: Frontend,
        id: u32,
    },
    PutSourceRange {
        frontend: Frontend,
        rev_nat_id: u32,
        cidr: Cidr,
    },
    DeleteSourceRange {
        frontend: Frontend,
        rev_nat_id: u32,
        cidr: Cidr,
    },
    DeleteBackend {
        id: u32,
        family: IpFamily,
    },
    /// One chunk of a frontend's Maglev table (`proxy_common::maglev`):
    /// entries `chunk * CHUNK_SLOTS ..` of `table`, shared by the chunks.
    PutMaglev {
        frontend: Frontend,
        rev_nat_id: u32,
        chunk: u32,
        table: MaglevTable,
    },
    /// A frontend's Maglev table, its `chunks` chunks.
    DeleteMaglev {
        frontend: Frontend,
        rev_nat_id: u32,
        chunks: u32,
    },
}

/// A frontend's Maglev table as written: each entry a slot of the
/// frontend, and the digest of what it was computed from (the slots'
/// backends), which tells the next sync whether to compute it again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaglevTable {
    pub entries: Arc<[u16]>,
    pub digest: u64,
}

impl MaglevTable {
    /// Entries `chunk * CHUNK_SLOTS ..` as the map holds them (zero past
    /// the table's end).
    pub fn chunk(&self, chunk: u32) -> MaglevChunk {
        let mut value = MaglevChunk::default();
        let start = (chunk as usize * CHUNK_SLOTS).min(self.entries.len());
        let these = &self.entries[start..(start + CHUNK_SLOTS).min(self.entries.len())];
        value.slots[..these.len()].copy_from_slice(these);
        value
    }
}

/// Applies map operations; the real one writes BPF maps.
pub trait MapWriter {
    fn apply(&mut self, op: &MapOp) -> Result<(), std::io::Error>;

    /// Applies `ops`, all of one [`MapOp::batch_kind`], in order (in one
    /// go where the writer can); returns how many were applied, and the
    /// error that stopped the next one.
    fn apply_run(&mut self, ops: &[MapOp]) -> (usize, Result<(), std::io::Error>) {
        apply_each(self, ops)
    }
}

/// Applies `ops` one by one, in order, up to the first failure.
pub fn apply_each<W: MapWriter + ?Sized>(
    writer: &mut W,
    ops: &[MapOp],
) -> (usize, Result<(), std::io::Error>) {
    for (i, op) in ops.iter().enumerate() {
        if let Err(e) = writer.apply(op) {
            return (i, Err(e));
        }
    }
    (ops.len(), Ok(()))
}

/// Which map and way an operation writes, for the ones worth batching
/// (service slots and backends: nearly every write of a large sync).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchKind {
    PutService(IpFamily),
    DeleteService(IpFamily),
    PutBackend(IpFamily),
    DeleteBackend(IpFamily),
}

impl MapOp {
    pub fn batch_kind(&self) -> Option<BatchKind> {
        match self {
            MapOp::PutService { key, .. } => Some(BatchKind::PutService(key.family())),
            MapOp::DeleteService { key } => Some(BatchKind::DeleteService(key.family())),
            MapOp::PutBackend { backend, .. } => Some(BatchKind::PutBackend(backend.family())),
            MapOp::DeleteBackend { family, .. } => Some(BatchKind::DeleteBackend(*family)),
            _ => None,
        }
    }

    /// The key and (a put's) value a batchable op writes, as the map
    /// holds them.
    pub fn entry(&self) -> Option<(&[u8], Option<&[u8]>)> {
        fn one<T: aya::Pod>(value: &T) -> &[u8] {
            batch::bytes_of(std::slice::from_ref(value))
        }
        fn key(key: &SlotKey) -> &[u8] {
            match key {
                SlotKey::V4(key) => one(key),
                SlotKey::V6(key) => one(key),
            }
        }
        match self {
            MapOp::PutService { key: k, value } => Some((key(k), Some(one(value)))),
            MapOp::DeleteService { key: k } => Some((key(k), None)),
            MapOp::PutBackend { id, backend: BackendEntry::V4(backend) } => {
                Some((one(id), Some(one(backend))))
            }
            MapOp::PutBackend { id, backend: BackendEntry::V6(backend) } => {
                Some((one(id), Some(one(backend))))
            }
            MapOp::DeleteBackend { id, .. } => Some((one(id), None)),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(
        "the plan needs {needed} {what} entries, the map holds {capacity}; keeping the current state"
    )]
    Capacity { what: &'static str, needed: usize, capacity: u32 },
    #[error("writing {op:?}: {source}")]
    Write { op: Box<MapOp>, source: std::io::Error },
}

/// What a sync did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub writes: usize,
    /// Backends that left frontends, or every frontend: their flows and
    /// connected sockets go.
    pub departures: Departures,
}

impl SyncReport {
    fn merge(&mut self, more: SyncReport) {
        self.writes += more.writes;
        self.departures.merge(more.departures);
    }
}

/// Services (by reverse-NAT id) whose affinity entries may name a backend
/// they no longer have, with the backends they keep.
pub type AffinityPurge = BTreeMap<u32, BTreeSet<u32>>;

/// The service port and kind of address a frontend is, as its
/// [`FrontendInfo`] names them (the name shared with the plan's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub service: Arc<ServicePortName>,
    pub kind: FrontendKind,
}

impl Owner {
    fn of(fp: &FrontendPlan) -> Self {
        Owner { service: fp.service.clone(), kind: fp.kind }
    }

    /// What operators see of the frontend.
    pub fn info(&self) -> FrontendInfo {
        let kind = match self.kind {
            FrontendKind::ClusterIp => KIND_CLUSTER_IP,
            FrontendKind::NodePort => KIND_NODE_PORT,
            FrontendKind::ExternalIp => KIND_EXTERNAL_IP,
            FrontendKind::LoadBalancer => KIND_LOAD_BALANCER,
        };
        FrontendInfo::new(kind, &self.service.to_string())
    }
}

#[derive(Clone, Debug, Default)]
struct InstalledFrontend {
    rev_nat_id: u32,
    owner: Option<Owner>,
    value: Option<ServiceValue>,
    slots: Slots,
    /// Sorted.
    source_ranges: Vec<Cidr>,
    /// Its Maglev table's chunks in the map (0: none), and the digest of
    /// the table they hold (`None` while a write left them part old).
    maglev_chunks: u32,
    maglev_digest: Option<u64>,
}

/// What a frontend the maps do not hold is diffed against.
static NOT_INSTALLED: InstalledFrontend = InstalledFrontend {
    rev_nat_id: 0,
    owner: None,
    value: None,
    slots: Slots::EMPTY,
    source_ranges: Vec::new(),
    maglev_chunks: 0,
    maglev_digest: None,
};

/// What the maps hold, as far as the agent wrote them.
#[derive(Debug, Default)]
pub struct SyncState {
    backends: Backends,
    frontends: HashMap<Frontend, InstalledFrontend>,
    rev_nat: BTreeSet<u32>,
    /// Service map entries: frontend slots (0) and backend slots.
    service_entries: usize,
    source_range_entries: usize,
    maglev_entries: usize,
    maglev_table_size: TableSize,
    last_backend_id: u32,
    last_rev_nat_id: u32,
    /// Affinity cleanups owed, kept across failed syncs until done.
    pending_purge: AffinityPurge,
    /// Ids a previous agent gave, kept for what they named until this agent
    /// takes over (see [`SyncState::reserve`]).
    reserved: Reserved,
    reserved_ids: ReservedIds,
    /// The service maps' sizes.
    capacity: super::MapSizes,
}

/// `--bpf-lb-maglev-table-size`. Tests use the smallest size, one chunk,
/// unless they set another.
#[derive(Clone, Copy, Debug)]
struct TableSize(u32);

impl Default for TableSize {
    fn default() -> Self {
        TableSize(if cfg!(test) {
            maglev_map::TABLE_SIZES[0]
        } else {
            maglev_map::DEFAULT_TABLE_SIZE
        })
    }
}

/// The reserved ids themselves, which new frontends and backends skip.
#[derive(Debug, Default)]
struct ReservedIds {
    rev_nat: BTreeSet<u32>,
    backends: BTreeSet<u32>,
}

/// What the previous agent named that this one did not install: its flows
/// and affinity entries are stale.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// With the ids the previous agent gave them.
    pub backends: Vec<(u32, BackendEntry)>,
    pub rev_nat_ids: Vec<u32>,
}

/// What a sync works out before its first write: which frontends it
/// writes, the ids it gives (its new backends are staged in the record),
/// what its writes do to the maps' sizes and which backends it deletes.
/// The writes themselves are then made frontend by frontend and written a
/// batch at a time: a first sync's millions of them are never held at
/// once.
struct Changes<'p> {
    /// Frontends to bring to the plan, internal scopes first, with their
    /// reverse-NAT ids.
    kept: Vec<(&'p Frontend, &'p FrontendPlan, u32)>,
    /// Where the backends the kept frontends name are in the record, in
    /// their order.
    named: Vec<Pos>,
    /// Frontends to remove, external scopes first.
    removed: Vec<Frontend>,
    /// Backends no slot will name.
    deleted: Vec<(u32, IpFamily)>,
    tally: Tally,
}

/// What a sync's writes do besides their entries.
#[derive(Default)]
struct Tally {
    /// Entries the writes add per map, before any is deleted.
    added: Added,
    /// Slots naming each installed backend id gained (+) or lost (-).
    refs_delta: HashMap<u32, i64>,
    /// (reverse-NAT id, backend id): backends leaving a frontend.
    left: Vec<(u32, u32)>,
    purge: AffinityPurge,
}

#[derive(Default)]
struct Added {
    backends: usize,
    services: usize,
    rev_nat: usize,
    source_ranges: usize,
    maglev_chunks: usize,
}

/// Ids are handed out round-robin, skipping those in use, so a freed id is
/// reused as late as possible (affinity or socket entries may still hold it).
fn next_free<T: Copy + Ord>(last: T, used: impl Fn(T) -> bool, succ: impl Fn(T) -> T) -> T {
    let mut id = succ(last);
    while used(id) {
        id = succ(id);
    }
    id
}

impl SyncState {
    /// Nothing installed yet, in maps of these sizes.
    pub fn with_capacity(capacity: super::MapSizes) -> Self {
        SyncState { capacity, ..SyncState::default() }
    }

    /// Maglev tables of `size` entries (a prime of
    /// `maglev::TABLE_SIZES`): set before any table is written.
    pub fn set_maglev_table_size(&mut self, size: u32) {
        debug_assert!(self.maglev_entries == 0 || size == self.maglev_table_size.0);
        self.maglev_table_size = TableSize(size);
    }

    fn maglev_chunks(&self) -> u32 {
        maglev_map::chunks(self.maglev_table_size.0)
    }

    /// Gives frontends and backends the ids a previous agent gave them, so
    /// the flows and affinity entries it left (which name them by id) keep
    /// meaning the same thing; new ones get ids no reservation holds.
    pub fn reserve(&mut self, reserved: Reserved) {
        self.reserved_ids = ReservedIds {
            rev_nat: reserved.frontends.values().copied().collect(),
            backends: reserved.backends.values().copied().collect(),
        };
        // Round-robin resumes past the previous agent's ids.
        self.last_rev_nat_id = self.reserved_ids.rev_nat.last().copied().unwrap_or(0);
        self.last_backend_id = self.reserved_ids.backends.last().copied().unwrap_or(0);
        self.reserved = reserved;
    }

    /// Ends the reservations (once this agent serves the whole source):
    /// returns what the previous agent had and this one did not install.
    pub fn release_reserved(&mut self) -> Released {
        let Reserved { frontends, backends } = std::mem::take(&mut self.reserved);
        self.reserved_ids = ReservedIds::default();
        Released {
            backends: backends
                .into_iter()
                .filter(|(b, _)| self.backends.id_of(b).is_none())
                .map(|(b, id)| (id, b))
                .collect(),
            rev_nat_ids: frontends
                .into_iter()
                .filter(|(f, id)| self.frontends.get(f).is_none_or(|i| i.rev_nat_id != *id))
                .map(|(_, id)| id)
                .collect(),
        }
    }

    /// The id for a new backend or frontend: its reserved one if free, else
    /// the next one round-robin that is neither used nor reserved.
    fn new_id(
        reserved: Option<&u32>,
        last: &mut u32,
        used: impl Fn(u32) -> bool,
        reserved_ids: &BTreeSet<u32>,
    ) -> u32 {
        if let Some(id) = reserved.filter(|id| !used(**id)) {
            return *id;
        }
        let id = next_free(
            *last,
            |id| used(id) || reserved_ids.contains(&id),
            |id| id.checked_add(1).unwrap_or(1),
        );
        *last = id;
        id
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// What the maps hold, as a plan, each frontend named by `service` (the
    /// plan's name for it; one no plan names gets a name of its own, as it
    /// only goes away). Built when a plan does not fit (see
    /// [`crate::fit`]), so that nothing keeps a copy of the plan meanwhile.
    pub fn installed_plan(
        &self,
        service: impl Fn(&Frontend) -> Option<Arc<ServicePortName>>,
    ) -> Plan {
        let frontends = self.frontends.iter().map(|(frontend, installed)| {
            let value = installed.value.unwrap_or_default();
            let mut backends: Vec<BackendPlan> = installed
                .slots
                .ids()
                .filter_map(|id| self.backends.get(id))
                .map(BackendEntry::plan)
                .collect();
            backends.sort();
            backends.dedup();
            let backends = backends.into();
            let name = service(frontend).unwrap_or_else(|| {
                Arc::new(ServicePortName {
                    service: ServiceName {
                        namespace: "".into(),
                        name: format!("{frontend:?}").into(),
                    },
                    port: "".into(),
                })
            });
            let plan = FrontendPlan {
                service: name,
                kind: installed.owner.as_ref().map_or(FrontendKind::ClusterIp, |o| o.kind),
                serves_terminating: value.flags.serves_terminating(),
                backends,
                affinity_timeout_secs: value
                    .flags
                    .is_affinity()
                    .then_some(value.affinity_timeout_secs),
                external: value.flags.is_external(),
                local: value.flags.is_local_only(),
                drop_when_empty: value.flags.drops_when_empty(),
                source_ranges: installed.source_ranges.clone(),
                two_scopes: value.flags.has_two_scopes(),
                maglev: value.flags.uses_maglev(),
                dsr: value.flags.is_dsr(),
            };
            (*frontend, plan)
        });
        Plan { frontends: frontends.collect() }
    }

    /// Entries of the maps the agent writes, by map name.
    pub fn map_entries(&self) -> [(&'static str, usize); 5] {
        [
            ("SERVICES", self.service_entries),
            ("BACKENDS", self.backends.len()),
            ("REV_NAT", self.rev_nat.len()),
            ("SOURCE_RANGES", self.source_range_entries),
            ("MAGLEV", self.maglev_entries),
        ]
    }

    /// Brings the maps to `plan`, writing only what differs.
    ///
    /// `dirty: None` compares every frontend of the plan and of the maps (at
    /// startup, after a failure). `Some(frontends)` promises that only these
    /// may differ between `plan` and the maps (one the plan lacks is
    /// removed): the sync then costs in proportion to them and their
    /// backends, not to the plan.
    pub fn sync(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        writer: &mut impl MapWriter,
    ) -> Result<SyncReport, SyncError> {
        let result = self.sync_staged(plan, dirty, writer);
        // Refused or failed, what it staged and never wrote goes.
        self.backends.settle();
        result
    }

    fn sync_staged(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
        writer: &mut impl MapWriter,
    ) -> Result<SyncReport, SyncError> {
        let Changes { kept, named, removed, deleted, tally } = self.changes(plan, dirty);
        self.check_capacity(&tally.added)?;
        self.frontends.reserve(tally.added.rev_nat);
        // Owed from now on: a write below may fail after slots changed.
        self.pending_purge.extend(tally.purge);
        let departures = self.departures(&deleted, &tally.left);
        let mut ops = Vec::with_capacity(batch::CHUNK);
        // 1. New backends, all written before a slot names one.
        let mut backends_written = 0;
        loop {
            let staged = self.backends.staged(backends_written).take(batch::CHUNK);
            ops.extend(staged.map(|(id, backend)| MapOp::PutBackend { id, backend }));
            if ops.is_empty() {
                break;
            }
            backends_written += self.write(&mut ops, writer)?;
        }
        let mut writes = backends_written;
        // 2. Frontends to create or update: their reverse-NAT entries first
        // (no frontend slot names a new one yet), so that their slots, of
        // one kind from frontend to frontend, go in batches.
        for &(frontend, fp, rev_nat_id) in &kept {
            let installed = self.frontends.get(frontend);
            let owner = Owner::of(fp);
            if installed.is_none_or(|i| i.rev_nat_id == 0 || i.owner.as_ref() != Some(&owner)) {
                // New, or another service's now, or another kind of address.
                let value = RevNatEntry::new(frontend);
                ops.push(MapOp::PutRevNat { frontend: *frontend, id: rev_nat_id, value, owner });
                writes += self.write_full(&mut ops, writer)?;
            }
        }
        let counts = kept.iter().map(|(_, fp, _)| fp.backends.len());
        for (&(frontend, fp, rev_nat_id), named) in kept.iter().zip(cut(&named, counts)) {
            self.frontend_writes((frontend, fp, rev_nat_id), named, None, &mut |op| ops.push(op));
            writes += self.write_full(&mut ops, writer)?;
        }
        // 3. Frontends that are gone.
        for frontend in &removed {
            self.removal_writes(frontend, None, &mut |op| ops.push(op));
            writes += self.write_full(&mut ops, writer)?;
        }
        // 4. Backends no slot names any more.
        for (id, family) in deleted {
            ops.push(MapOp::DeleteBackend { id, family });
            writes += self.write_full(&mut ops, writer)?;
        }
        writes += self.write(&mut ops, writer)?;
        Ok(SyncReport { writes, departures })
    }

    /// Writes `ops` once they fill a batch; how many were written.
    fn write_full(
        &mut self,
        ops: &mut Vec<MapOp>,
        writer: &mut impl MapWriter,
    ) -> Result<usize, SyncError> {
        match ops.len() >= batch::CHUNK {
            true => self.write(ops, writer),
            false => Ok(0),
        }
    }

    /// Writes `ops` in order and records each the kernel accepted; how
    /// many were written.
    fn write(
        &mut self,
        ops: &mut Vec<MapOp>,
        writer: &mut impl MapWriter,
    ) -> Result<usize, SyncError> {
        // In order, runs of one kind together: a batch writes its entries
        // in order too, so make-before-break holds entry by entry.
        for run in batch::runs(ops, batch::CHUNK, MapOp::batch_kind) {
            let ops = &ops[run];
            let (applied, result) = writer.apply_run(ops);
            for op in &ops[..applied] {
                self.record(op);
            }
            if let Err(source) = result {
                let op = Box::new(ops[applied.min(ops.len() - 1)].clone());
                return Err(SyncError::Write { op, source });
            }
        }
        let written = ops.len();
        ops.clear();
        Ok(written)
    }

    /// What a sync takes away: backends `deleted` leave every frontend,
    /// the others only the frontends `left` names.
    fn departures(&self, deleted: &[(u32, IpFamily)], left: &[(u32, u32)]) -> Departures {
        // `deleted` is in id order.
        let is_deleted = |id: &u32| deleted.binary_search_by_key(id, |(d, _)| *d).is_ok();
        let backend = |id: &u32| self.backends.get(*id).map(|b| (*id, *b));
        let mut departures = Departures::gone(deleted.iter().filter_map(|(id, _)| backend(id)));
        for (rev_nat_id, id) in left.iter().filter(|(_, id)| !is_deleted(id)) {
            if let Some((id, backend)) = backend(id) {
                departures.add(*rev_nat_id, id, &backend);
            }
        }
        departures
    }

    /// Brings the maps from `served` (what they hold) to `target` in syncs
    /// that each fit, for a change whose old and new entries do not fit
    /// side by side: first what goes away, then one service at a time (see
    /// [`fit::steps`]), or one frontend at a time where a service's own old
    /// and new entries do not fit together.
    pub fn sync_in_steps(
        &mut self,
        served: &Plan,
        target: &Plan,
        writer: &mut impl MapWriter,
    ) -> Result<SyncReport, SyncError> {
        let mut report = SyncReport::default();
        let mut working = served.clone();
        for step in fit::steps(served, target) {
            for frontend in &step {
                match target.frontends.get(frontend) {
                    Some(fp) => working.frontends.insert(*frontend, fp.clone()),
                    None => working.frontends.remove(frontend),
                };
            }
            match self.sync(&working, Some(&step), writer) {
                Err(SyncError::Capacity { .. }) => {
                    // Internal scopes first: a two-scopes flag names its twin.
                    let mut singles: Vec<Frontend> = step.into_iter().collect();
                    singles.sort_by_key(|f| f.scope == Scope::External);
                    for frontend in singles {
                        let one = BTreeSet::from([frontend]);
                        report.merge(self.sync(&working, Some(&one), writer)?);
                    }
                }
                result => report.merge(result?),
            }
        }
        // A backend deleted in one step and added back in another still left
        // the frontends it was in: their flows go (flows made to it through
        // its new frontends during the steps, milliseconds, go too).
        Ok(report)
    }

    /// The affinity cleanups owed; the caller hands back what it could not do.
    pub fn take_affinity_purge(&mut self) -> AffinityPurge {
        std::mem::take(&mut self.pending_purge)
    }

    pub fn return_affinity_purge(&mut self, purge: AffinityPurge) {
        for (rev, kept) in purge {
            self.pending_purge.entry(rev).or_insert(kept);
        }
    }

    /// Refuses a plan whose peak (old and new entries side by side during the
    /// make-before-break window) would not fit in the maps.
    fn check_capacity(&self, added: &Added) -> Result<(), SyncError> {
        let checks = [
            ("backend", self.backends.len() + added.backends, self.capacity.backends),
            ("service", self.service_entries + added.services, self.capacity.services),
            ("reverse-NAT", self.rev_nat.len() + added.rev_nat, self.capacity.rev_nat),
            ("source-range", self.source_range_entries + added.source_ranges, MAX_SOURCE_RANGES),
            ("Maglev table chunk", self.maglev_entries + added.maglev_chunks, MAX_MAGLEV_CHUNKS),
        ];
        for (what, needed, capacity) in checks {
            if needed > capacity as usize {
                return Err(SyncError::Capacity { what, needed, capacity });
            }
        }
        Ok(())
    }

    /// Works out a sync's changes, staging its new backends.
    fn changes<'p>(&mut self, plan: &'p Plan, dirty: Option<&BTreeSet<Frontend>>) -> Changes<'p> {
        // The frontends to bring to the plan, and those to remove.
        type Kept<'a> = Vec<(&'a Frontend, &'a FrontendPlan)>;
        let (mut kept, removed): (Kept, Vec<Frontend>) = match dirty {
            None => (
                plan.frontends.iter().collect(),
                self.frontends
                    .keys()
                    .filter(|f| !plan.frontends.contains_key(f))
                    .copied()
                    .collect(),
            ),
            Some(dirty) => (
                dirty.iter().filter_map(|f| plan.frontends.get_key_value(f)).collect(),
                dirty
                    .iter()
                    .filter(|f| !plan.frontends.contains_key(f) && self.frontends.contains_key(*f))
                    .copied()
                    .collect(),
            ),
        };
        // Both lists in address order, external scope first: right for
        // removals; an address's twin goes in before its flag names it.
        let mut removed = removed;
        removed.sort_unstable();
        kept.sort_by_key(|(f, _)| f.scope == Scope::External);
        let mut tally = Tally::default();

        // 1. Backends, with ids for the new ones, staged. Round-robin moves
        // past each id it gives and skips the reserved ones, and a reserved
        // id names one backend: no id is given twice in a sync.
        self.backends.reserve(distinct_backends(&kept));
        let mut last_id = self.last_backend_id;
        let mut named = Vec::with_capacity(kept.iter().map(|(_, fp)| fp.backends.len()).sum());
        for (frontend, fp) in &kept {
            for addr in &fp.backends {
                let backend = BackendEntry::new(frontend, &addr);
                let at = self.backends.find(&backend).unwrap_or_else(|| {
                    let id = Self::new_id(
                        self.reserved.backends.get(&backend),
                        &mut last_id,
                        |id| self.backends.contains_id(id),
                        &self.reserved_ids.backends,
                    );
                    tally.added.backends += 1;
                    self.backends.stage(id, backend)
                });
                named.push(at);
            }
        }

        // 2. Frontends to create or update, with ids for the new ones.
        let mut last_rev = self.last_rev_nat_id;
        let mut new_revs = BTreeSet::new();
        let mut kept_ids = Vec::with_capacity(kept.len());
        let counts = kept.iter().map(|(_, fp)| fp.backends.len());
        for ((frontend, fp), named) in kept.iter().copied().zip(cut(&named, counts)) {
            let installed = self.frontends.get(frontend).map_or(0, |i| i.rev_nat_id);
            let rev_nat_id = if installed != 0 {
                installed
            } else {
                let id = Self::new_id(
                    self.reserved.frontends.get(frontend),
                    &mut last_rev,
                    |id| self.rev_nat.contains(&id) || new_revs.contains(&id),
                    &self.reserved_ids.rev_nat,
                );
                new_revs.insert(id);
                tally.added.rev_nat += 1;
                id
            };
            self.frontend_writes((frontend, fp, rev_nat_id), named, Some(&mut tally), &mut drop);
            kept_ids.push((frontend, fp, rev_nat_id));
        }

        // 3. Frontends that are gone.
        for frontend in &removed {
            self.removal_writes(frontend, Some(&mut tally), &mut drop);
        }

        // 4. Backends no slot will name: those losing their last one, and
        // those no slot named already.
        let mut candidates: Vec<u32> =
            tally.refs_delta.keys().copied().chain(self.backends.unreferenced()).collect();
        candidates.sort_unstable();
        candidates.dedup();
        let mut deleted = Vec::new();
        for id in candidates {
            let refs =
                i64::from(self.backends.refs(id)) + tally.refs_delta.get(&id).copied().unwrap_or(0);
            debug_assert!(refs >= 0, "backend {id}: {refs} references");
            if refs == 0
                && let Some(backend) = self.backends.get(id)
            {
                deleted.push((id, backend.family()));
            }
        }
        Changes { kept: kept_ids, named, removed, deleted, tally }
    }

    /// The writes that bring installed `frontend` to `fp` after its
    /// reverse-NAT entry (to `emit`), and what they do (to `tally`):
    /// changed backend slots, new source ranges, the frontend slot, then
    /// slots beyond the new count and source ranges it no longer has.
    fn frontend_writes(
        &self,
        (frontend, fp, rev_nat_id): (&Frontend, &FrontendPlan, u32),
        named: &[Pos],
        mut tally: Option<&mut Tally>,
        emit: &mut impl FnMut(MapOp),
    ) {
        let installed = self.frontends.get(frontend).unwrap_or(&NOT_INSTALLED);
        let backend_ids: Vec<u32> = named.iter().map(|at| self.backends.id_at(*at)).collect();
        // Only installed backends may be deleted: a first sync's million
        // new ones need no count.
        let mut new = Vec::new();
        if tally.is_some() {
            let staged = named.iter().filter(|at| !self.backends.is_installed_at(**at));
            new.extend(staged.map(|at| self.backends.id_at(*at)));
            new.sort_unstable();
        }
        let slots = assign_slots(&installed.slots, &backend_ids);
        for (slot, id) in (1..).zip(slots.iter().copied()) {
            let old = installed.slots.get(slot);
            if id != 0 && old != Some(id) {
                let value = ServiceValue { backend_id: id, rev_nat_id, ..Default::default() };
                emit(MapOp::PutService { key: SlotKey::new(frontend, slot), value });
                if let Some(tally) = tally.as_deref_mut() {
                    if new.binary_search(&id).is_err() {
                        *tally.refs_delta.entry(id).or_default() += 1;
                    }
                    match old {
                        Some(old) => *tally.refs_delta.entry(old).or_default() -= 1,
                        None => tally.added.services += 1,
                    }
                }
            }
        }
        let mut wanted = fp.source_ranges.clone();
        wanted.sort_unstable();
        wanted.dedup();
        let missing = |from: &[Cidr], of: &[Cidr]| -> Vec<Cidr> {
            from.iter().filter(|c| of.binary_search(c).is_err()).copied().collect()
        };
        for cidr in missing(&wanted, &installed.source_ranges) {
            emit(MapOp::PutSourceRange { frontend: *frontend, rev_nat_id, cidr });
            if let Some(tally) = tally.as_deref_mut() {
                tally.added.source_ranges += 1;
            }
        }
        // Its table, naming the slots just written, before the count and
        // flag that send packets to it.
        // Without backends the program refuses before it reads a table.
        let table_wanted = fp.maglev && !backend_ids.is_empty();
        if table_wanted {
            let entries: Vec<(u16, &BackendEntry)> = (1..)
                .zip(&slots)
                .map(|(slot, id)| {
                    let at = backend_ids.iter().position(|b| b == id).expect("a slot's backend");
                    (slot, self.backends.entry_at(named[at]))
                })
                .collect();
            let size = self.maglev_table_size.0;
            let digest = maglev_digest(&entries, size);
            if installed.maglev_digest != Some(digest) {
                let chunks = self.maglev_chunks();
                match tally.as_deref_mut() {
                    // The counting pass: the table is computed only for
                    // the writes.
                    Some(tally) => {
                        let had = installed.maglev_chunks as usize;
                        tally.added.maglev_chunks += (chunks as usize).saturating_sub(had);
                    }
                    None => {
                        let table =
                            MaglevTable { entries: maglev_table(&entries, size).into(), digest };
                        for chunk in 0..chunks {
                            let table = table.clone();
                            emit(MapOp::PutMaglev {
                                frontend: *frontend,
                                rev_nat_id,
                                chunk,
                                table,
                            });
                        }
                    }
                }
            }
        }
        let value = ServiceValue {
            backend_id: 0,
            count: backend_ids.len() as u16,
            rev_nat_id,
            affinity_timeout_secs: fp.affinity_timeout_secs.unwrap_or(0),
            flags: flags(fp),
        };
        if installed.value != Some(value) {
            emit(MapOp::PutService { key: SlotKey::new(frontend, 0), value });
            if let Some(tally) = tally.as_deref_mut() {
                tally.added.services += usize::from(installed.value.is_none());
            }
        }
        let beyond = installed.slots.iter().filter(|(s, _)| *s as usize > backend_ids.len());
        for (slot, id) in beyond {
            emit(MapOp::DeleteService { key: SlotKey::new(frontend, slot) });
            if let Some(tally) = tally.as_deref_mut() {
                *tally.refs_delta.entry(id).or_default() -= 1;
            }
        }
        for cidr in missing(&installed.source_ranges, &wanted) {
            emit(MapOp::DeleteSourceRange { frontend: *frontend, rev_nat_id, cidr });
        }
        if !table_wanted && installed.maglev_chunks > 0 {
            let chunks = installed.maglev_chunks;
            emit(MapOp::DeleteMaglev { frontend: *frontend, rev_nat_id, chunks });
        }
        let Some(tally) = tally else { return };
        // Only what was installed can be lost (a first sync's frontends
        // have nothing).
        let kept: BTreeSet<u32> = match installed.slots.is_empty() {
            true => BTreeSet::new(),
            false => backend_ids.iter().copied().collect(),
        };
        let lost = installed.slots.ids().filter(|id| !kept.contains(id));
        tally.left.extend(lost.map(|id| (rev_nat_id, id)));
        let had_affinity = installed.value.is_some_and(|v| v.flags.is_affinity());
        if fp.affinity_timeout_secs.is_none() && had_affinity {
            // Switched off: entries must not resurface if it comes back.
            tally.purge.insert(rev_nat_id, BTreeSet::new());
        } else if fp.affinity_timeout_secs.is_some()
            && installed.slots.ids().any(|id| !kept.contains(&id))
        {
            tally.purge.insert(rev_nat_id, kept);
        }
    }

    /// The writes that remove installed `frontend` (to `emit`), and what
    /// they do (to `tally`): the frontend slot first, then its slots,
    /// source ranges and reverse-NAT entry.
    fn removal_writes(
        &self,
        frontend: &Frontend,
        tally: Option<&mut Tally>,
        emit: &mut impl FnMut(MapOp),
    ) {
        let Some(installed) = self.frontends.get(frontend) else { return };
        let rev_nat_id = installed.rev_nat_id;
        if installed.value.is_some() {
            emit(MapOp::DeleteService { key: SlotKey::new(frontend, 0) });
        }
        for (slot, _) in installed.slots.iter() {
            emit(MapOp::DeleteService { key: SlotKey::new(frontend, slot) });
        }
        for cidr in &installed.source_ranges {
            emit(MapOp::DeleteSourceRange { frontend: *frontend, rev_nat_id, cidr: *cidr });
        }
        if installed.maglev_chunks > 0 {
            let chunks = installed.maglev_chunks;
            emit(MapOp::DeleteMaglev { frontend: *frontend, rev_nat_id, chunks });
        }
        emit(MapOp::DeleteRevNat { frontend: *frontend, id: rev_nat_id });
        let Some(tally) = tally else { return };
        for id in installed.slots.ids() {
            *tally.refs_delta.entry(id).or_default() -= 1;
        }
        tally.left.extend(installed.slots.ids().map(|id| (rev_nat_id, id)));
        if installed.value.is_some_and(|v| v.flags.is_affinity()) {
            tally.purge.insert(rev_nat_id, BTreeSet::new());
        }
    }

    /// Records a write the kernel accepted.
    fn record(&mut self, op: &MapOp) {
        match op {
            MapOp::PutBackend { id, backend } => {
                self.backends.insert(*id, *backend);
                if !self.reserved_ids.backends.contains(id) {
                    self.last_backend_id = *id;
                }
            }
            MapOp::DeleteBackend { id, .. } => drop(self.backends.remove(*id)),
            MapOp::PutRevNat { frontend, id, owner, .. } => {
                self.rev_nat.insert(*id);
                if !self.reserved_ids.rev_nat.contains(id) {
                    self.last_rev_nat_id = *id;
                }
                let entry = self.frontends.entry(*frontend).or_default();
                (entry.rev_nat_id, entry.owner) = (*id, Some(owner.clone()));
            }
            MapOp::DeleteRevNat { frontend, id } => {
                self.rev_nat.remove(id);
                // Its entries went first; forget any left all the same.
                if let Some(gone) = self.frontends.remove(frontend) {
                    self.service_entries -= usize::from(gone.value.is_some()) + gone.slots.count();
                    self.source_range_entries -= gone.source_ranges.len();
                    self.maglev_entries -= gone.maglev_chunks as usize;
                    for id in gone.slots.ids() {
                        self.backends.drop_ref(id);
                    }
                }
            }
            MapOp::PutSourceRange { frontend, cidr, .. } => {
                let ranges = &mut self.frontends.entry(*frontend).or_default().source_ranges;
                if let Err(at) = ranges.binary_search(cidr) {
                    ranges.insert(at, *cidr);
                    self.source_range_entries += 1;
                }
            }
            MapOp::DeleteSourceRange { frontend, cidr, .. } => {
                if let Some(entry) = self.frontends.get_mut(frontend)
                    && let Ok(at) = entry.source_ranges.binary_search(cidr)
                {
                    entry.source_ranges.remove(at);
                    self.source_range_entries -= 1;
                }
            }
            MapOp::PutService { key, value } => {
                let entry = self.frontends.entry(key.frontend()).or_default();
                if key.slot() == 0 {
                    if entry.value.replace(*value).is_none() {
                        self.service_entries += 1;
                    }
                } else {
                    let old = entry.slots.insert(key.slot(), value.backend_id);
                    self.backends.add_ref(value.backend_id);
                    match old {
                        Some(old) => self.backends.drop_ref(old),
                        None => self.service_entries += 1,
                    }
                }
            }
            MapOp::PutMaglev { frontend, chunk, table, .. } => {
                let last = self.maglev_chunks() - 1;
                let entry = self.frontends.entry(*frontend).or_default();
                // Part old, part new until its last chunk is in.
                entry.maglev_digest = (*chunk == last).then_some(table.digest);
                if *chunk >= entry.maglev_chunks {
                    self.maglev_entries += (*chunk + 1 - entry.maglev_chunks) as usize;
                    entry.maglev_chunks = *chunk + 1;
                }
            }
            MapOp::DeleteMaglev { frontend, .. } => {
                if let Some(entry) = self.frontends.get_mut(frontend) {
                    self.maglev_entries -= entry.maglev_chunks as usize;
                    (entry.maglev_chunks, entry.maglev_digest) = (0, None);
                }
            }
            MapOp::DeleteService { key } => {
                let Some(entry) = self.frontends.get_mut(&key.frontend()) else { return };
                if key.slot() == 0 {
                    if entry.value.take().is_some() {
                        self.service_entries -= 1;
                    }
                } else if let Some(old) = entry.slots.remove(key.slot()) {
                    self.service_entries -= 1;
                    self.backends.drop_ref(old);
                }
            }
        }
    }

    /// The running counts and references agree with what is recorded.
    #[cfg(test)]
    fn assert_consistent(&self) {
        let mut refs = BTreeMap::new();
        for id in self.frontends.values().flat_map(|f| f.slots.ids()) {
            *refs.entry(id).or_insert(0) += 1;
        }
        let recorded: BTreeMap<u32, u32> = self
            .backends
            .ids()
            .map(|id| (id, self.backends.refs(id)))
            .filter(|(_, refs)| *refs > 0)
            .collect();
        assert_eq!(refs, recorded, "references");
        let unreferenced: BTreeSet<u32> =
            self.backends.ids().filter(|id| !refs.contains_key(id)).collect();
        let recorded: BTreeSet<u32> = self.backends.unreferenced().collect();
        assert_eq!(unreferenced, recorded, "unreferenced backends");
        assert_eq!(self.backends.staged(0).count(), 0, "staged outside a sync");
        let services: usize =
            self.frontends.values().map(|f| usize::from(f.value.is_some()) + f.slots.count()).sum();
        assert_eq!(services, self.service_entries, "service entries");
        let ranges: usize = self.frontends.values().map(|f| f.source_ranges.len()).sum();
        assert_eq!(ranges, self.source_range_entries, "source-range entries");
        for id in self.backends.ids() {
            let entry = self.backends.get(id).unwrap();
            assert_eq!(self.backends.id_of(entry), Some(id), "backend {id} by entry");
        }
    }
}

/// About how many distinct backends `kept` names: the most any frontend of
/// a service port names (its frontends share them), summed. More where
/// service ports share backends; fewer where the record holds some already.
fn distinct_backends(kept: &[(&Frontend, &FrontendPlan)]) -> usize {
    let mut by_port: HashMap<*const ServicePortName, usize> = HashMap::new();
    for (_, fp) in kept {
        let most = by_port.entry(Arc::as_ptr(&fp.service)).or_default();
        *most = (*most).max(fp.backends.len());
    }
    by_port.values().sum()
}

/// `named` cut into each frontend's backends, of these counts in order.
fn cut(named: &[Pos], counts: impl IntoIterator<Item = usize>) -> impl Iterator<Item = &[Pos]> {
    let mut rest = named;
    counts.into_iter().map(move |count| {
        let (these, after) = rest.split_at(count);
        rest = after;
        these
    })
}

/// The frontend flags the programs act on.
fn flags(fp: &FrontendPlan) -> ServiceFlags {
    ServiceFlags::EMPTY
        .with_affinity(fp.affinity_timeout_secs.is_some())
        .with_external(fp.external)
        .with_local_only(fp.local)
        .with_drop_when_empty(fp.drop_when_empty)
        .with_source_ranges(!fp.source_ranges.is_empty())
        .with_two_scopes(fp.two_scopes)
        .with_serves_terminating(fp.serves_terminating)
        .with_maglev(fp.maglev)
        .with_dsr(fp.dsr)
}

/// What a frontend's Maglev table is computed from, `(slot, backend)`:
/// its digest (with the table's size).
fn maglev_digest(entries: &[(u16, &BackendEntry)], size: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    // Compared within this agent only: std's hasher will do.
    let mut hasher = std::hash::DefaultHasher::new();
    size.hash(&mut hasher);
    for (slot, backend) in entries {
        (slot, backend.addr()).hash(&mut hasher);
    }
    hasher.finish()
}

/// The Maglev table over `(slot, backend)`, `size` entries.
fn maglev_table(entries: &[(u16, &BackendEntry)], size: u32) -> Vec<u16> {
    let backends: Vec<maglev::Backend> = entries
        .iter()
        .map(|(slot, b)| maglev::Backend { slot: *slot, ip: b.addr().ip(), port: b.addr().port() })
        .collect();
    maglev::table(&backends, size)
}

/// The backend id for each slot `1..=backend_ids.len()`: those already
/// installed in a slot within the new count stay put, the others fill the
/// free slots, so one endpoint change rewrites one slot however the
/// addresses sort.
fn assign_slots(installed: &Slots, backend_ids: &[u32]) -> Vec<u32> {
    if installed.is_empty() {
        // A new frontend (all of a first sync's): slots in order.
        return backend_ids.to_vec();
    }
    let count = backend_ids.len();
    let wanted: BTreeSet<u32> = backend_ids.iter().copied().collect();
    let mut slots = vec![0; count];
    let mut placed = BTreeSet::new();
    for (slot, id) in installed.iter() {
        if (slot as usize) <= count && wanted.contains(&id) && placed.insert(id) {
            slots[slot as usize - 1] = id;
        }
    }
    let mut free = backend_ids.iter().filter(|id| !placed.contains(id));
    for slot in slots.iter_mut().filter(|id| **id == 0) {
        if let Some(id) = free.next() {
            *slot = *id;
        }
    }
    slots
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use proxy_common::ServiceKey;

    use super::*;
    use crate::{
        model::{EndpointAddr, Protocol, ServiceName, ServicePortName},
        plan::{BackendList, BackendPlan, FrontendKind, FrontendPlan},
    };

    /// The same frontend's entry in another slot.
    fn with_slot(key: &SlotKey, slot: u16) -> SlotKey {
        SlotKey::new(&key.frontend(), slot)
    }

    /// The maps in memory. After every write it checks what a BPF program
    /// relies on: a frontend's slots `1..=count` exist and name backends that
    /// exist, and every frontend has its reverse-NAT entry.
    #[derive(Default)]
    struct Maps {
        services: BTreeMap<SlotKey, ServiceValue>,
        backends: BTreeMap<u32, BackendEntry>,
        rev_nat: BTreeMap<u32, RevNatEntry>,
        source_ranges: BTreeSet<(u32, Cidr)>,
        maglev: BTreeMap<(u32, u32), MaglevChunk>,
        writes: usize,
        fail_at: Option<usize>,
        /// Skips the check after every write (it is slow on large maps).
        unchecked: bool,
    }

    impl Maps {
        fn check(&self) {
            for (key, value) in self.services.iter().filter(|(k, _)| k.slot() == 0) {
                assert!(self.rev_nat.contains_key(&value.rev_nat_id), "{key:?} without rev nat");
                if value.flags.has_source_ranges() {
                    let rev = value.rev_nat_id;
                    assert!(self.source_ranges.iter().any(|(r, _)| *r == rev), "{key:?} ranges");
                }
                if value.flags.has_two_scopes() {
                    let twin = SlotKey::new(&key.frontend().internal(), 0);
                    assert!(self.services.contains_key(&twin), "{key:?} without its twin");
                }
                if value.flags.uses_maglev() && value.count > 0 {
                    // What the program reads once it finds backends: every
                    // chunk there, every entry naming a slot that exists
                    // (past the count is fine: a table goes in before the
                    // count that grows into it).
                    let chunks =
                        self.maglev.range((value.rev_nat_id, 0)..(value.rev_nat_id + 1, 0));
                    let mut count = 0;
                    for (_, chunk) in chunks {
                        count += 1;
                        for slot in chunk.slots.iter().filter(|s| **s != 0) {
                            let slot_key = with_slot(key, *slot);
                            assert!(self.services.contains_key(&slot_key), "{key:?} table: {slot}");
                        }
                    }
                    assert!(count > 0, "{key:?} uses a table it has not");
                }
                for slot in 1..=value.count {
                    let slot_value = self.services.get(&with_slot(key, slot));
                    let slot_value =
                        slot_value.unwrap_or_else(|| panic!("{key:?} slot {slot} missing"));
                    assert!(self.backends.contains_key(&slot_value.backend_id), "dangling slot");
                }
            }
            for (key, value) in self.services.iter().filter(|(k, _)| k.slot() != 0) {
                assert!(self.backends.contains_key(&value.backend_id), "{key:?} dangling");
            }
        }
    }

    impl MapWriter for Maps {
        fn apply(&mut self, op: &MapOp) -> Result<(), std::io::Error> {
            if self.fail_at == Some(self.writes) {
                self.fail_at = None;
                return Err(std::io::Error::other("injected"));
            }
            self.writes += 1;
            match op {
                MapOp::PutBackend { id, backend } => drop(self.backends.insert(*id, *backend)),
                MapOp::DeleteBackend { id, .. } => drop(self.backends.remove(id)),
                MapOp::PutRevNat { id, value, .. } => drop(self.rev_nat.insert(*id, *value)),
                MapOp::DeleteRevNat { id, .. } => drop(self.rev_nat.remove(id)),
                MapOp::PutService { key, value } => drop(self.services.insert(*key, *value)),
                MapOp::DeleteService { key } => drop(self.services.remove(key)),
                MapOp::PutSourceRange { rev_nat_id, cidr, .. } => {
                    let _ = self.source_ranges.insert((*rev_nat_id, *cidr));
                }
                MapOp::DeleteSourceRange { rev_nat_id, cidr, .. } => {
                    let _ = self.source_ranges.remove(&(*rev_nat_id, *cidr));
                }
                MapOp::PutMaglev { rev_nat_id, chunk, table, .. } => {
                    self.maglev.insert((*rev_nat_id, *chunk), table.chunk(*chunk));
                }
                MapOp::DeleteMaglev { rev_nat_id, chunks, .. } => {
                    for chunk in 0..*chunks {
                        self.maglev.remove(&(*rev_nat_id, chunk));
                    }
                }
            }
            if !self.unchecked {
                self.check();
            }
            Ok(())
        }
    }

    fn frontend(last: u8, protocol: Protocol) -> Frontend {
        Frontend::new(Ipv4Addr::new(10, 96, 0, last).into(), 53, protocol)
    }

    fn plan(frontends: &[(Frontend, &[u8], Option<u32>)]) -> Plan {
        let mut plan = Plan::default();
        for (frontend, backends, affinity) in frontends {
            // Frontends on 10.96.0.2 are load-balancer IPs with a source range.
            let ranges: Vec<Cidr> = (frontend.ip == Ipv4Addr::new(10, 96, 0, 2))
                .then(|| Cidr::parse("192.168.0.0/16").unwrap())
                .into_iter()
                .collect();
            plan.frontends.insert(
                *frontend,
                FrontendPlan {
                    service: Arc::new(ServicePortName {
                        service: ServiceName { namespace: "ns".into(), name: "svc".into() },
                        port: "".into(),
                    }),
                    kind: FrontendKind::ClusterIp,
                    backends: backends
                        .iter()
                        .map(|b| BackendPlan {
                            addr: EndpointAddr::new(Ipv4Addr::new(10, 244, 0, *b).into(), 8080),
                            local: *b % 2 == 0,
                            host: false,
                        })
                        .collect(),
                    affinity_timeout_secs: *affinity,
                    external: !ranges.is_empty(),
                    local: false,
                    drop_when_empty: false,
                    // Load-balancer IPs use Maglev and DSR.
                    maglev: !ranges.is_empty(),
                    dsr: !ranges.is_empty(),
                    source_ranges: ranges,
                    two_scopes: false,
                    serves_terminating: false,
                },
            );
        }
        plan
    }

    /// What a program would choose from, per frontend: the backend addresses.
    fn view(maps: &Maps) -> BTreeMap<(SlotKey, u16), Vec<IpAddr>> {
        maps.services
            .iter()
            .filter(|(k, _)| k.slot() == 0)
            .map(|(k, v)| {
                let backends = (1..=v.count)
                    .map(|s| maps.backends[&maps.services[&with_slot(k, s)].backend_id].addr().ip())
                    .collect();
                ((*k, v.count), backends)
            })
            .collect()
    }

    #[test]
    fn keys_encode_as_the_programs_build_them_from_a_sockaddr() {
        // connect4 builds the key from user_ip4 (network order: wire bytes)
        // and ntohs(user_port); padding is zero.
        let udp = Frontend::new(Ipv4Addr::new(10, 96, 0, 10).into(), 80, Protocol::Udp);
        let v4 = |key: SlotKey| match key {
            SlotKey::V4(key) => key,
            SlotKey::V6(_) => panic!("an IPv4 frontend in the IPv6 map"),
        };
        let key: ServiceKey = v4(SlotKey::new(&udp, 2));
        // SAFETY: ServiceKey is repr(C) without implicit padding.
        let bytes: [u8; 12] = unsafe { std::mem::transmute(key) };
        assert_eq!(bytes, [10, 96, 0, 10, 80, 0, 2, 0, 17, 0, 0, 0]);
        let bytes: [u8; 12] = unsafe { std::mem::transmute(v4(SlotKey::new(&udp.internal(), 0))) };
        assert_eq!(bytes, [10, 96, 0, 10, 80, 0, 0, 0, 17, 1, 0, 0], "scope 1");
        assert_eq!(key.scope, 0);
        assert_eq!(SlotKey::new(&udp.internal(), 3).frontend(), udp.internal());
        let backend = BackendEntry::new(
            &Frontend::new(Ipv4Addr::new(10, 96, 0, 10).into(), 80, Protocol::Tcp),
            &BackendPlan { addr: "10.244.1.2:8080".parse().unwrap(), local: true, host: false },
        );
        let BackendEntry::V4(backend) = backend else { panic!("an IPv4 backend") };
        let bytes: [u8; 8] = unsafe { std::mem::transmute(backend) };
        assert_eq!(bytes, [10, 244, 1, 2, 0x90, 0x1f, 6, 1], "flags: local");
    }

    #[test]
    fn converges_through_churn_without_dangling_slots() {
        let (tcp, udp, other) =
            (frontend(1, Protocol::Tcp), frontend(1, Protocol::Udp), frontend(2, Protocol::Tcp));
        let steps: Vec<Plan> = vec![
            plan(&[(tcp, &[2, 3, 4], None), (udp, &[2, 3], None)]),
            plan(&[(tcp, &[2, 4], None), (udp, &[2, 3, 5], None), (other, &[], None)]),
            plan(&[(tcp, &[4], Some(10)), (other, &[3], None)]),
            plan(&[(tcp, &[2, 3, 4, 5, 6], Some(10))]),
            plan(&[]),
        ];
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        for step in &steps {
            state.sync(step, None, &mut maps).unwrap();
            assert_eq!(view(&maps).len(), step.frontends.len());
            for (f, fp) in &step.frontends {
                let key = SlotKey::new(f, 0);
                let value = maps.services[&key];
                assert_eq!(value.count as usize, fp.backends.len());
                let slots =
                    maps.services.keys().filter(|k| k.slot() != 0 && with_slot(k, 0) == key);
                assert_eq!(slots.count(), fp.backends.len(), "no stale slots");
            }
            let used: BTreeSet<u32> = maps.services.values().map(|v| v.backend_id).collect();
            assert!(maps.backends.keys().all(|id| used.contains(id)), "no orphan backends");
            // A second sync of the same plan writes nothing.
            assert_eq!(state.sync(step, None, &mut maps).unwrap().writes, 0);
        }
        assert!(maps.services.is_empty() && maps.backends.is_empty() && maps.rev_nat.is_empty());
        assert!(maps.source_ranges.is_empty());
    }

    /// `v4`'s plan with an IPv6 twin of each frontend: the same backends
    /// in `fd00:244::/64`.
    fn dual_stack(v4: Plan) -> Plan {
        let mut plan = v4.clone();
        for (frontend, fp) in v4.frontends {
            let ip = match frontend.ip {
                IpAddr::V4(ip) => ip.to_ipv6_mapped().octets(),
                IpAddr::V6(ip) => ip.octets(),
            };
            let six = |mut octets: [u8; 16]| {
                octets[..4].copy_from_slice(&[0xfd, 0, 0, 0x96]);
                IpAddr::from(octets)
            };
            let twin = Frontend { ip: six(ip), ..frontend };
            let backends = fp.backends.iter().map(|b| {
                let ip = match b.addr.ip() {
                    IpAddr::V4(ip) => ip.to_ipv6_mapped().octets(),
                    IpAddr::V6(ip) => ip.octets(),
                };
                BackendPlan { addr: EndpointAddr::new(six(ip), b.addr.port()), ..b }
            });
            let backends = backends.collect();
            plan.frontends.insert(twin, FrontendPlan { backends, source_ranges: vec![], ..fp });
        }
        plan
    }

    #[test]
    fn each_family_has_its_own_maps_and_both_share_the_id_spaces() {
        let (tcp, udp) = (frontend(1, Protocol::Tcp), frontend(3, Protocol::Udp));
        let both = dual_stack(plan(&[(tcp, &[2, 3], None), (udp, &[3, 4], Some(10))]));
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&both, None, &mut maps).unwrap();
        state.assert_consistent();
        let families = |keys: Vec<IpFamily>| {
            [IpFamily::V4, IpFamily::V6].map(|f| keys.iter().filter(|k| **k == f).count())
        };
        let slots = families(maps.services.keys().map(SlotKey::family).collect());
        assert_eq!(slots, [6, 6], "two frontends and four slots in each family's map");
        let backends = families(maps.backends.values().map(BackendEntry::family).collect());
        assert_eq!(backends, [4, 4], "a backend per address and protocol: {:?}", maps.backends);
        assert_eq!(maps.rev_nat.len(), 4, "one reverse-NAT id space");
        let v6_rev_nat = maps.rev_nat.values().filter(|r| matches!(r, RevNatEntry::V6(_)));
        assert_eq!(v6_rev_nat.count(), 2);
        for (frontend, fp) in &both.frontends {
            let key = SlotKey::new(frontend, 0);
            assert_eq!(key.family(), frontend.family());
            assert_eq!(maps.services[&key].count as usize, fp.backends.len());
        }
        // The IPv6 half goes; the IPv4 one stays as it was.
        let v4 = plan(&[(tcp, &[2, 3], None), (udp, &[3, 4], Some(10))]);
        let before: Vec<_> = maps
            .services
            .iter()
            .filter(|(k, _)| k.family() == IpFamily::V4)
            .map(|(k, v)| (*k, *v))
            .collect();
        state.sync(&v4, None, &mut maps).unwrap();
        state.assert_consistent();
        let after: Vec<_> = maps.services.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(after, before);
        assert!(maps.backends.values().all(|b| b.family() == IpFamily::V4));
        assert_eq!(maps.rev_nat.len(), 2);
    }

    #[test]
    fn slots_stay_put_when_a_lower_address_joins() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        let many: Vec<u8> = (10..60).collect();
        state.sync(&plan(&[(tcp, &many, None)]), None, &mut maps).unwrap();
        let before = maps.writes;
        let mut more = many.clone();
        more.insert(0, 2);
        // One backend, one slot, the frontend count.
        assert_eq!(state.sync(&plan(&[(tcp, &more, None)]), None, &mut maps).unwrap().writes, 3);
        assert_eq!(maps.writes - before, 3);
        // Removing one in the middle: its slot is refilled by the last one.
        more.remove(20);
        let report = state.sync(&plan(&[(tcp, &more, None)]), None, &mut maps).unwrap();
        assert_eq!(report.writes, 4, "slot refill, count, slot delete, backend delete");
    }

    #[test]
    fn one_endpoint_change_rewrites_only_what_changed() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&plan(&[(tcp, &[2, 3, 4], None)]), None, &mut maps).unwrap();
        let before = maps.writes;
        // 4 -> 5: one new backend, one slot, one backend deletion; the
        // frontend (same count) and the other slots are untouched.
        state.sync(&plan(&[(tcp, &[2, 3, 5], None)]), None, &mut maps).unwrap();
        assert_eq!(maps.writes - before, 3);
    }

    #[test]
    fn a_failed_write_leaves_a_consistent_map_and_the_next_sync_finishes() {
        let (tcp, udp) = (frontend(1, Protocol::Tcp), frontend(1, Protocol::Udp));
        let start = plan(&[(tcp, &[6, 7], Some(5)), (udp, &[6], None)]);
        let target = plan(&[(tcp, &[2, 3, 6], Some(5))]);
        // How many writes the step takes, to fail each one in turn.
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&start, None, &mut maps).unwrap();
        let writes = state.sync(&target, None, &mut maps).unwrap().writes;
        assert!(writes >= 8, "the step adds, rewrites and removes: {writes} writes");
        for fail_at in 0..writes {
            let mut maps = Maps::default();
            let mut state = SyncState::default();
            state.sync(&start, None, &mut maps).unwrap();
            maps.fail_at = Some(maps.writes + fail_at);
            assert!(state.sync(&target, None, &mut maps).is_err(), "failure {fail_at} injected");
            // The record is what the maps hold: nothing staged is left.
            state.assert_consistent();
            assert_eq!(state.backend_count(), maps.backends.len(), "failure {fail_at}");
            state.sync(&target, None, &mut maps).unwrap();
            let (_, mut backends) = view(&maps).into_iter().next().unwrap();
            backends.sort();
            let pods = [2, 3, 6].map(|p| IpAddr::from([10, 244, 0, p]));
            assert_eq!(backends, pods);
            assert_eq!(maps.backends.len(), 3);
            assert_eq!(maps.rev_nat.len(), 1);
            // The cleanup owed for backend 7 survives the failure.
            let purge = state.take_affinity_purge();
            let kept: Vec<usize> = purge.values().map(BTreeSet::len).collect();
            assert_eq!(kept, vec![3], "failure at {fail_at}: {purge:?}");
        }
    }

    #[test]
    fn affinity_entries_are_purged_for_removed_backends_only() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&plan(&[(tcp, &[2, 3], Some(10))]), None, &mut maps).unwrap();
        assert!(state.take_affinity_purge().is_empty());
        state.sync(&plan(&[(tcp, &[2, 3, 4], Some(10))]), None, &mut maps).unwrap();
        assert!(state.take_affinity_purge().is_empty(), "adding a backend keeps affinity");
        state.sync(&plan(&[(tcp, &[3, 4], Some(10))]), None, &mut maps).unwrap();
        let purge = state.take_affinity_purge();
        assert_eq!(purge.len(), 1);
        assert_eq!(purge.values().next().unwrap().len(), 2);
        // Switching affinity off forgets every entry of the service.
        state.sync(&plan(&[(tcp, &[3, 4], None)]), None, &mut maps).unwrap();
        let purge = state.take_affinity_purge();
        assert!(purge.values().next().unwrap().is_empty());
    }

    #[test]
    fn a_frontend_names_its_service_and_kind_and_follows_a_new_owner() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        let mut p = plan(&[(tcp, &[2], None)]);
        let writes = state.sync(&p, None, &mut maps).unwrap().writes;
        let info = state.frontends[&tcp].owner.as_ref().unwrap().info();
        assert_eq!((info.kind, info.name()), (KIND_CLUSTER_IP, "ns/svc"));
        // Another service (or kind) takes the address over: one write.
        let fp = p.frontends.get_mut(&tcp).unwrap();
        Arc::make_mut(&mut fp.service).service.name = "other".into();
        fp.kind = FrontendKind::ExternalIp;
        let report = state.sync(&p, None, &mut maps).unwrap();
        assert_eq!(report.writes, 1, "after {writes} at first");
        let info = state.frontends[&tcp].owner.as_ref().unwrap().info();
        assert_eq!((info.kind, info.name()), (KIND_EXTERNAL_IP, "ns/other"));
        assert_eq!(state.sync(&p, None, &mut maps).unwrap().writes, 0);
    }

    #[test]
    fn a_backend_leaving_one_of_two_frontends_departs_from_that_one_only() {
        let (a, b) = (frontend(1, Protocol::Udp), frontend(3, Protocol::Udp));
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&plan(&[(a, &[2, 3], None), (b, &[2], None)]), None, &mut maps).unwrap();
        let rev = |f: &Frontend| state.frontends[f].rev_nat_id;
        let (rev_a, rev_b) = (rev(&a), rev(&b));
        let shared = state.backends.ids().min().unwrap();
        let report =
            state.sync(&plan(&[(a, &[3], None), (b, &[2], None)]), None, &mut maps).unwrap();
        assert_eq!(report.departures.len(), 1);
        assert!(report.departures.ends(rev_a, shared), "its flows via the first go");
        assert!(!report.departures.ends(rev_b, shared), "the second keeps it");
        // Leaving the second too, it is gone: every flow to it goes.
        let report = state.sync(&plan(&[(a, &[3], None)]), None, &mut maps).unwrap();
        assert!(report.departures.ends(rev_a, shared) && report.departures.ends(rev_b, shared));
    }

    #[test]
    fn a_new_agent_gives_frontends_and_backends_their_previous_ids() {
        let (tcp, udp) = (Protocol::Tcp, Protocol::Udp);
        // The previous agent's maps.
        let mut before = SyncState::default();
        let mut old = Maps::default();
        let earlier =
            plan(&[(frontend(1, tcp), &[1, 2], Some(30)), (frontend(3, udp), &[3], None)]);
        before.sync(&earlier, None, &mut old).unwrap();
        let reserved = Reserved {
            frontends: old
                .services
                .iter()
                .filter(|(k, _)| k.slot() == 0)
                .map(|(k, v)| (k.frontend(), v.rev_nat_id))
                .collect(),
            backends: old.backends.iter().map(|(id, b)| (*b, *id)).collect(),
        };

        // The new one, on fresh maps, with a frontend and a backend more
        // and one of each less.
        let mut after = SyncState::default();
        after.reserve(reserved.clone());
        let mut new = Maps::default();
        let now = plan(&[(frontend(4, tcp), &[4], None), (frontend(1, tcp), &[4, 2, 1], Some(30))]);
        after.sync(&now, None, &mut new).unwrap();
        let rev_of = |maps: &Maps, f: &Frontend| maps.services[&SlotKey::new(f, 0)].rev_nat_id;
        assert_eq!(rev_of(&new, &frontend(1, tcp)), rev_of(&old, &frontend(1, tcp)));
        for (backend, id) in &reserved.backends {
            if new.backends.values().any(|b| b == backend) {
                assert_eq!(new.backends[id], *backend, "backend {backend:?} kept its id");
            }
        }
        let new_rev = rev_of(&new, &frontend(4, tcp));
        assert!(
            !reserved.frontends.values().any(|id| *id == new_rev),
            "no reserved id is handed out"
        );
        let new_backend = new
            .backends
            .iter()
            .find(|(_, b)| b.addr().ip() == Ipv4Addr::new(10, 244, 0, 4))
            .unwrap();
        assert!(!reserved.backends.values().any(|id| id == new_backend.0));

        let released = after.release_reserved();
        let udp_backend = reserved
            .backends
            .keys()
            .find(|b| b.addr().ip() == Ipv4Addr::new(10, 244, 0, 3))
            .unwrap();
        let udp_id = reserved.backends[udp_backend];
        assert_eq!(released.backends, vec![(udp_id, *udp_backend)], "its flows are stale");
        assert_eq!(released.rev_nat_ids, vec![reserved.frontends[&frontend(3, udp)]]);
        after.assert_consistent();
    }

    #[test]
    fn freed_ids_are_not_reused_at_once() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&plan(&[(tcp, &[2], None)]), None, &mut maps).unwrap();
        let first: Vec<u32> = maps.backends.keys().copied().collect();
        state.sync(&plan(&[(tcp, &[3], None)]), None, &mut maps).unwrap();
        assert!(maps.backends.keys().all(|id| !first.contains(id)));
    }

    #[test]
    fn plans_that_do_not_fit_are_refused_before_any_write() {
        let mut big = Plan::default();
        for i in 0..101 {
            let frontend = Frontend::new(Ipv4Addr::from(0x0a60_0000 + i).into(), 80, Protocol::Tcp);
            big.frontends.insert(
                frontend,
                FrontendPlan {
                    service: Arc::new(ServicePortName {
                        service: ServiceName {
                            namespace: "ns".into(),
                            name: format!("s{i}").into(),
                        },
                        port: "".into(),
                    }),
                    kind: FrontendKind::ClusterIp,
                    backends: BackendList::default(),
                    affinity_timeout_secs: None,
                    external: false,
                    local: false,
                    drop_when_empty: false,
                    source_ranges: vec![],
                    two_scopes: false,
                    serves_terminating: false,
                    maglev: false,
                    dsr: false,
                },
            );
        }
        let mut maps = Maps::default();
        let sizes = |services, rev_nat| super::super::MapSizes { services, backends: 100, rev_nat };
        let err =
            SyncState::with_capacity(sizes(1000, 100)).sync(&big, None, &mut maps).unwrap_err();
        assert!(matches!(err, SyncError::Capacity { what: "reverse-NAT", .. }), "{err}");
        assert_eq!(maps.writes, 0);

        let err =
            SyncState::with_capacity(sizes(100, 1000)).sync(&big, None, &mut maps).unwrap_err();
        assert!(matches!(err, SyncError::Capacity { what: "service", capacity: 100, .. }), "{err}");
        assert_eq!(maps.writes, 0);
    }

    #[test]
    fn a_replacement_that_fits_alone_goes_in_steps_that_each_fit() {
        // Services s0..s3 over one endpoint each, replaced by t0..t3 over
        // others: 8 SERVICES entries either way, 16 side by side.
        let plan = |prefix: &str, base: u32| {
            let mut plan = Plan::default();
            for i in 0..4 {
                let frontend = Frontend::new(Ipv4Addr::from(base + i).into(), 80, Protocol::Tcp);
                let mut fp = frontend_plan(vec![endpoint(base as u8 + i as u8)], None, vec![]);
                Arc::make_mut(&mut fp.service).service.name = format!("{prefix}{i}").into();
                plan.frontends.insert(frontend, fp);
            }
            plan
        };
        let (old, new) = (plan("s", 0x0a60_0000), plan("t", 0x0a60_0010));
        let sizes = super::super::MapSizes { services: 8, backends: 4, rev_nat: 4 };
        let mut state = SyncState::with_capacity(sizes);
        let mut maps = Maps::default();
        state.sync(&old, None, &mut maps).unwrap();
        let err = state.sync(&new, None, &mut maps).unwrap_err();
        assert!(matches!(err, SyncError::Capacity { .. }), "{err}");
        // Every write is checked by the maps: never a dangling slot.
        let report = state.sync_in_steps(&old, &new, &mut maps).unwrap();
        assert_eq!(report.departures.len(), 4, "the four old backends, gone");
        assert_counts(&state, &maps);
        assert_eq!(content(&maps), fresh(&new));
        assert_eq!(state.sync(&new, None, &mut maps).unwrap().writes, 0);
    }

    /// The maps' content up to backend and reverse-NAT id renaming: per
    /// frontend its flags, affinity, backends, reverse-NAT entry and source
    /// ranges; the backends map; every map's size (no stale entries).
    type Content = (
        BTreeMap<SlotKey, (u16, ServiceFlags, u32, Vec<BackendEntry>, RevNatEntry, Vec<Cidr>)>,
        Vec<BackendEntry>,
        [usize; 5],
        // Per frontend with a table, the backend of each entry.
        BTreeMap<SlotKey, Vec<BackendEntry>>,
    );

    fn content(maps: &Maps) -> Content {
        let frontends = maps
            .services
            .iter()
            .filter(|(k, _)| k.slot() == 0)
            .map(|(k, v)| {
                let mut backends: Vec<BackendEntry> = (1..=v.count)
                    .map(|s| maps.backends[&maps.services[&with_slot(k, s)].backend_id])
                    .collect();
                backends.sort();
                let rev = maps.rev_nat[&v.rev_nat_id];
                let ranges = maps.source_ranges.iter().filter(|(r, _)| *r == v.rev_nat_id);
                let ranges = ranges.map(|(_, c)| *c).collect();
                let value = (v.count, v.flags, v.affinity_timeout_secs, backends);
                (*k, (value.0, value.1, value.2, value.3, rev, ranges))
            })
            .collect();
        let mut backends: Vec<BackendEntry> = maps.backends.values().copied().collect();
        backends.sort();
        let sizes = [
            maps.services.len(),
            maps.backends.len(),
            maps.rev_nat.len(),
            maps.source_ranges.len(),
            maps.maglev.len(),
        ];
        let tables = maps
            .services
            .iter()
            .filter(|(k, v)| k.slot() == 0 && v.flags.uses_maglev())
            .map(|(k, v)| {
                let chunks = maps.maglev.range((v.rev_nat_id, 0)..(v.rev_nat_id + 1, 0));
                let entries = chunks.flat_map(|(_, c)| c.slots).filter(|s| *s != 0);
                let backend = |slot| maps.backends[&maps.services[&with_slot(k, slot)].backend_id];
                (*k, entries.map(backend).collect())
            })
            .collect();
        (frontends, backends, sizes, tables)
    }

    /// What a fresh state writes for `plan` with a full sync.
    fn fresh(plan: &Plan) -> Content {
        let mut maps = Maps { unchecked: true, ..Maps::default() };
        SyncState::default().sync(plan, None, &mut maps).unwrap();
        content(&maps)
    }

    /// The state's counts are those of the maps.
    fn assert_counts(state: &SyncState, maps: &Maps) {
        state.assert_consistent();
        let counts = state.map_entries().map(|(_, n)| n);
        let sizes = [
            maps.services.len(),
            maps.backends.len(),
            maps.rev_nat.len(),
            maps.source_ranges.len(),
            maps.maglev.len(),
        ];
        assert_eq!(counts, sizes);
    }

    /// A deterministic pseudo-random sequence (Knuth's MMIX LCG).
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// A service as the random test changes it; its frontends share backends.
    #[derive(Clone, Default)]
    struct Svc {
        endpoints: BTreeSet<u8>,
        affinity: Option<u32>,
        ranges: BTreeSet<u8>,
        /// Which of its three frontends exist (ClusterIP TCP, NodePort TCP,
        /// ClusterIP UDP).
        frontends: [bool; 3],
        /// The NodePort has policy Local: its local endpoints, and a twin
        /// (the fourth frontend) with all of them.
        local: bool,
    }

    fn svc_frontends(s: u8) -> [Frontend; 4] {
        let cluster = Ipv4Addr::new(10, 96, 1, s).into();
        let node_port =
            Frontend::new(Ipv4Addr::new(192, 168, 1, 1).into(), 30000 + s as u16, Protocol::Tcp);
        [
            Frontend::new(cluster, 80, Protocol::Tcp),
            node_port,
            Frontend::new(cluster, 53, Protocol::Udp),
            node_port.internal(),
        ]
    }

    fn endpoint(e: u8) -> BackendPlan {
        BackendPlan {
            addr: EndpointAddr::new(Ipv4Addr::new(10, 244, 0, e).into(), 8080),
            local: e.is_multiple_of(3),
            host: e.is_multiple_of(5),
        }
    }

    fn frontend_plan(
        backends: Vec<BackendPlan>,
        affinity: Option<u32>,
        ranges: Vec<Cidr>,
    ) -> FrontendPlan {
        FrontendPlan {
            service: Arc::new(ServicePortName {
                service: ServiceName { namespace: "ns".into(), name: "svc".into() },
                port: "".into(),
            }),
            kind: FrontendKind::ClusterIp,
            backends: backends.into(),
            affinity_timeout_secs: affinity,
            external: !ranges.is_empty(),
            local: false,
            drop_when_empty: false,
            // External frontends of the churn use Maglev: tables follow it.
            maglev: !ranges.is_empty(),
            dsr: !ranges.is_empty(),
            source_ranges: ranges,
            two_scopes: false,
            serves_terminating: false,
        }
    }

    fn svc_plan(services: &[Svc]) -> Plan {
        let mut plan = Plan::default();
        for (s, svc) in services.iter().enumerate() {
            let ranges: Vec<Cidr> = svc
                .ranges
                .iter()
                .map(|r| Cidr { addr: Ipv4Addr::new(172, 16, *r, 0).into(), len: 24 })
                .collect();
            let frontends = svc_frontends(s as u8);
            for (i, frontend) in
                frontends[..3].iter().enumerate().filter(|(i, _)| svc.frontends[*i])
            {
                let backends: Vec<BackendPlan> =
                    svc.endpoints.iter().map(|e| endpoint(*e)).collect();
                // Source ranges on the NodePort only.
                let ranges = if i == 1 { ranges.clone() } else { vec![] };
                let mut fp = frontend_plan(backends.clone(), svc.affinity, ranges);
                if i == 1 && svc.local {
                    let twin = frontend_plan(backends, svc.affinity, vec![]);
                    plan.frontends.insert(frontends[3], twin);
                    fp.backends = fp.backends.iter().filter(|b| b.local).collect();
                    (fp.external, fp.local, fp.two_scopes) = (true, true, true);
                }
                plan.frontends.insert(*frontend, fp);
            }
        }
        plan
    }

    /// Changes a few services at random; returns the frontends it may have changed.
    fn churn(rng: &mut Lcg, services: &mut [Svc]) -> BTreeSet<Frontend> {
        let mut dirty = BTreeSet::new();
        for _ in 0..=rng.below(3) {
            let s = rng.below(services.len() as u64) as usize;
            let svc = &mut services[s];
            let random_endpoint = |rng: &mut Lcg| 1 + rng.below(30) as u8;
            match rng.below(10) {
                0 | 1 => {
                    svc.endpoints.insert(random_endpoint(rng));
                }
                2 => {
                    let gone = svc.endpoints.iter().nth(rng.below(8) as usize).copied();
                    if let Some(e) = gone {
                        svc.endpoints.remove(&e);
                    }
                }
                3 => {
                    let gone = svc.endpoints.iter().nth(rng.below(8) as usize).copied();
                    if let Some(e) = gone {
                        svc.endpoints.remove(&e);
                    }
                    svc.endpoints.insert(random_endpoint(rng));
                }
                4 => {
                    svc.affinity = match svc.affinity {
                        Some(_) => None,
                        None => Some(10 + rng.below(3) as u32),
                    }
                }
                5 => {
                    let r = rng.below(3) as u8;
                    if !svc.ranges.remove(&r) {
                        svc.ranges.insert(r);
                    }
                }
                6 => {
                    let i = rng.below(3) as usize;
                    svc.frontends[i] = !svc.frontends[i];
                }
                7 => {
                    // Gone, or back with fresh endpoints.
                    if svc.frontends.iter().any(|f| *f) {
                        svc.frontends = [false; 3];
                    } else {
                        svc.frontends = [true, rng.below(2) == 0, rng.below(2) == 0];
                        svc.endpoints = (0..rng.below(6)).map(|_| random_endpoint(rng)).collect();
                    }
                }
                8 => svc.local = !svc.local,
                _ => svc.endpoints = (0..rng.below(12)).map(|_| random_endpoint(rng)).collect(),
            }
            dirty.extend(svc_frontends(s as u8));
        }
        // A frontend named though unchanged is fine.
        if rng.below(4) == 0 {
            dirty.extend(svc_frontends(rng.below(services.len() as u64) as u8));
        }
        dirty
    }

    #[test]
    fn a_table_goes_in_whole_before_its_flag_and_follows_its_backends() {
        let mut state = SyncState::default();
        state.set_maglev_table_size(maglev_map::DEFAULT_TABLE_SIZE);
        let mut maps = Maps::default();
        let lb = frontend(2, Protocol::Tcp);
        let chunks = maglev_map::chunks(maglev_map::DEFAULT_TABLE_SIZE) as usize;
        state.sync(&plan(&[(lb, &[1, 2, 3], None)]), None, &mut maps).unwrap();
        assert_eq!(maps.maglev.len(), chunks, "every chunk");
        assert_counts(&state, &maps);
        let table = |maps: &Maps| content(maps).3.into_values().next().unwrap_or_default();
        let before = table(&maps);
        assert_eq!(before.len(), maglev_map::DEFAULT_TABLE_SIZE as usize);

        // One backend leaves: only its entries change, and nothing is
        // rewritten for a sync that changes nothing.
        state.sync(&plan(&[(lb, &[1, 3], None)]), None, &mut maps).unwrap();
        let after = table(&maps);
        let gone = before[0..1].iter().chain(&before).find(|b| !after.contains(b)).copied();
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a && Some(**b) != gone);
        assert!(moved.count() <= before.len() / 100);
        let writes = maps.writes;
        state.sync(&plan(&[(lb, &[1, 3], None)]), None, &mut maps).unwrap();
        assert_eq!(maps.writes, writes);

        // No backends: no table; then the frontend goes.
        state.sync(&plan(&[(lb, &[], None)]), None, &mut maps).unwrap();
        assert!(maps.maglev.is_empty());
        state.sync(&plan(&[(lb, &[4], None)]), None, &mut maps).unwrap();
        assert_eq!(maps.maglev.len(), chunks);
        state.sync(&Plan::default(), None, &mut maps).unwrap();
        assert!(maps.maglev.is_empty() && maps.services.is_empty());
        assert_counts(&state, &maps);
    }

    #[test]
    fn the_installed_plan_is_the_plan_synced() {
        let mut rng = Lcg(11);
        let mut services = vec![Svc::default(); 10];
        let mut maps = Maps { unchecked: true, ..Maps::default() };
        let mut state = SyncState::default();
        for _ in 0..200 {
            churn(&mut rng, &mut services);
            let plan = svc_plan(&services);
            state.sync(&plan, None, &mut maps).unwrap();
            let names = |f: &Frontend| plan.frontends.get(f).map(|fp| fp.service.clone());
            assert_eq!(state.installed_plan(names), plan);
        }
        // A frontend the plan no longer names keeps a name of its own.
        let installed = state.installed_plan(|_| None);
        let mut names = installed.frontends.values().map(|fp| &fp.service.service);
        assert!(names.all(|n| n.namespace.is_empty()));
    }

    #[test]
    fn incremental_syncs_match_a_full_sync_of_the_same_plan() {
        let mut rng = Lcg(7);
        let mut services = vec![Svc::default(); 10];
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        let (mut failures, mut writes, mut twins) = (0, 0, 0);
        for step in 0..600 {
            let dirty = churn(&mut rng, &mut services);
            let plan = svc_plan(&services);
            twins += plan.frontends.keys().filter(|f| f.scope == Scope::Internal).count();
            // Now and then a write fails; the agent then syncs in full.
            if step % 7 == 3 {
                maps.fail_at = Some(maps.writes + rng.below(6) as usize);
            }
            match state.sync(&plan, Some(&dirty), &mut maps) {
                Ok(report) => writes += report.writes,
                Err(SyncError::Write { .. }) => {
                    failures += 1;
                    assert_counts(&state, &maps);
                    state.sync(&plan, None, &mut maps).unwrap();
                }
                Err(err) => panic!("step {step}: {err}"),
            }
            maps.fail_at = None;
            assert_counts(&state, &maps);
            assert_eq!(content(&maps), fresh(&plan), "step {step}");
            for (f, fp) in &plan.frontends {
                assert_eq!(maps.services[&SlotKey::new(f, 0)].count as usize, fp.backends.len());
            }
            assert_eq!(state.sync(&plan, None, &mut maps).unwrap().writes, 0, "step {step}");
            state.take_affinity_purge();
        }
        assert!(failures > 20 && writes > 1000, "{failures} failures, {writes} writes");
        assert!(twins > 100, "two-scope NodePorts come and go: {twins}");
    }

    #[test]
    fn a_twin_is_in_while_its_flag_names_it_whatever_write_fails() {
        let [_, nodeport, _, twin] = svc_frontends(1);
        let eps = |es: &[u8]| es.iter().map(|e| endpoint(*e)).collect::<Vec<_>>();
        let cluster_policy = Plan {
            frontends: [(nodeport, frontend_plan(eps(&[1, 2, 3, 4]), Some(5), vec![]))].into(),
        };
        let mut local = frontend_plan(eps(&[3]), Some(5), vec![]);
        (local.external, local.local, local.two_scopes) = (true, true, true);
        let local_policy = Plan {
            frontends: [
                (nodeport, local),
                (twin, frontend_plan(eps(&[1, 2, 3, 4]), Some(5), vec![])),
            ]
            .into(),
        };
        let gone = Plan::default();
        let dirty: BTreeSet<Frontend> = [nodeport, twin].into();
        let steps = [
            (&cluster_policy, &local_policy),
            (&local_policy, &cluster_policy),
            (&local_policy, &gone),
            (&gone, &local_policy),
        ];
        for (from, to) in steps {
            let mut maps = Maps::default();
            let mut state = SyncState::default();
            state.sync(from, None, &mut maps).unwrap();
            // Maps::check, after every write: a flag never names a missing twin.
            let writes = state.sync(to, Some(&dirty), &mut maps).unwrap().writes;
            assert_eq!(content(&maps), fresh(to));
            for fail_at in 0..writes {
                let mut maps = Maps::default();
                let mut state = SyncState::default();
                state.sync(from, None, &mut maps).unwrap();
                maps.fail_at = Some(maps.writes + fail_at);
                assert!(state.sync(to, Some(&dirty), &mut maps).is_err(), "failure {fail_at}");
                assert_counts(&state, &maps);
                state.sync(to, None, &mut maps).unwrap();
                assert_eq!(content(&maps), fresh(to), "failure at {fail_at}");
            }
        }
        // Each scope has its reverse-NAT id (affinity is kept per scope),
        // both naming the address.
        let mut maps = Maps::default();
        SyncState::default().sync(&local_policy, None, &mut maps).unwrap();
        let [outer, inner] = [nodeport, twin].map(|f| maps.services[&SlotKey::new(&f, 0)]);
        assert!(outer.flags.has_two_scopes() && !inner.flags.has_two_scopes());
        assert_ne!(outer.rev_nat_id, inner.rev_nat_id);
        assert_eq!(maps.rev_nat[&outer.rev_nat_id], maps.rev_nat[&inner.rev_nat_id]);
        assert_eq!((outer.count, inner.count), (1, 4));
    }

    #[test]
    fn a_failed_incremental_sync_is_finished_by_a_full_one() {
        let (cluster, nodeport, udp) =
            (svc_frontends(1)[0], svc_frontends(1)[1], svc_frontends(2)[2]);
        let eps = |es: &[u8]| es.iter().map(|e| endpoint(*e)).collect::<Vec<_>>();
        let start: Plan = Plan {
            frontends: [
                (cluster, frontend_plan(eps(&[1, 2, 3]), Some(5), vec![])),
                (nodeport, frontend_plan(eps(&[1, 2, 3]), Some(5), vec![])),
                (udp, frontend_plan(eps(&[1, 4]), None, vec![])),
            ]
            .into(),
        };
        let range = Cidr { addr: Ipv4Addr::new(172, 16, 0, 0).into(), len: 12 };
        let target: Plan = Plan {
            frontends: [
                (cluster, frontend_plan(eps(&[2, 3, 6, 7]), Some(5), vec![])),
                (nodeport, frontend_plan(eps(&[2, 3, 6, 7]), None, vec![range])),
            ]
            .into(),
        };
        let dirty: BTreeSet<Frontend> = [cluster, nodeport, udp].into();
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&start, None, &mut maps).unwrap();
        let writes = state.sync(&target, Some(&dirty), &mut maps).unwrap().writes;
        assert!(writes >= 15, "{writes} writes");
        assert_eq!(content(&maps), fresh(&target));
        for fail_at in 0..writes {
            let mut maps = Maps::default();
            let mut state = SyncState::default();
            state.sync(&start, None, &mut maps).unwrap();
            maps.fail_at = Some(maps.writes + fail_at);
            assert!(state.sync(&target, Some(&dirty), &mut maps).is_err(), "failure {fail_at}");
            assert_counts(&state, &maps);
            state.sync(&target, None, &mut maps).unwrap();
            assert_counts(&state, &maps);
            assert_eq!(content(&maps), fresh(&target), "failure at {fail_at}");
            // Affinity: the ClusterIP lost a backend, the NodePort its affinity.
            let purge = state.take_affinity_purge();
            let kept: Vec<usize> = purge.values().map(BTreeSet::len).collect();
            assert_eq!(kept, vec![4, 0], "failure at {fail_at}: {purge:?}");
        }
    }

    #[test]
    fn one_frontend_of_ten_thousand_costs_its_own_writes_and_shared_backends_stay() {
        // 5,000 services, each a ClusterIP and a NodePort on the same 3 endpoints.
        let frontends = |s: u32| {
            let cluster = Ipv4Addr::from(0x0a60_0000 + s).into();
            [
                Frontend::new(cluster, 80, Protocol::Tcp),
                Frontend::new(Ipv4Addr::new(192, 168, 1, 1).into(), 1000 + s as u16, Protocol::Tcp),
            ]
        };
        let endpoints = |s: u32, extra: &[u32]| -> Vec<BackendPlan> {
            (0..3)
                .chain(extra.iter().copied())
                .map(|i| BackendPlan {
                    addr: EndpointAddr::new(Ipv4Addr::from(0x0af4_0000 + s * 16 + i).into(), 8080),
                    local: false,
                    host: false,
                })
                .collect()
        };
        let mut plan = Plan::default();
        for s in 0..5000 {
            for f in frontends(s) {
                plan.frontends.insert(f, frontend_plan(endpoints(s, &[]), None, vec![]));
            }
        }
        let sizes =
            super::super::MapSizes { services: 100_000, backends: 100_000, rev_nat: 100_000 };
        let mut state = SyncState::with_capacity(sizes);
        // The maps' check after every write is quadratic here: off for setup.
        let mut maps = Maps { unchecked: true, ..Maps::default() };
        state.sync(&plan, None, &mut maps).unwrap();
        maps.unchecked = false;
        assert_eq!(state.frontend_count(), 10_000);
        assert_eq!(state.backend_count(), 15_000);
        let [cluster, nodeport] = frontends(7);
        let step = |state: &mut SyncState, plan: &Plan, dirty: &[Frontend], maps: &mut Maps| {
            let dirty: BTreeSet<Frontend> = dirty.iter().copied().collect();
            let report = state.sync(plan, Some(&dirty), maps).unwrap();
            assert_counts(state, maps);
            report
        };

        // A fourth endpoint on both frontends: one backend, a slot and a
        // count each.
        for f in [cluster, nodeport] {
            plan.frontends.get_mut(&f).unwrap().backends = endpoints(7, &[3]).into();
        }
        let report = step(&mut state, &plan, &[cluster, nodeport], &mut maps);
        assert_eq!(report.writes, 5);
        // Gone from the ClusterIP only: the NodePort still uses it.
        plan.frontends.get_mut(&cluster).unwrap().backends = endpoints(7, &[]).into();
        let report = step(&mut state, &plan, &[cluster], &mut maps);
        // It left the ClusterIP's flows, not the NodePort's.
        assert_eq!((report.writes, report.departures.len()), (2, 1), "count, slot");
        assert_eq!(state.backend_count(), 15_001);
        // The NodePort goes: its slot 0, 4 slots, its reverse NAT, and the
        // one backend only it used (gone), the three others leaving it.
        plan.frontends.remove(&nodeport);
        let report = step(&mut state, &plan, &[nodeport], &mut maps);
        assert_eq!((report.writes, report.departures.len()), (7, 4));
        assert_eq!(state.backend_count(), 15_000);
        // Replacing an endpoint of the ClusterIP, now their only user.
        plan.frontends.get_mut(&cluster).unwrap().backends =
            endpoints(7, &[4])[1..].to_vec().into();
        let report = step(&mut state, &plan, &[cluster], &mut maps);
        assert_eq!((report.writes, report.departures.len()), (3, 1));
        // The NodePort comes back: slot 0, 3 slots, reverse NAT; no backend.
        plan.frontends
            .insert(nodeport, frontend_plan(endpoints(7, &[4])[1..].to_vec(), None, vec![]));
        let report = step(&mut state, &plan, &[nodeport], &mut maps);
        assert_eq!(report.writes, 5);

        maps.check();
        assert_eq!(content(&maps), fresh(&plan));
        assert_eq!(state.sync(&plan, None, &mut maps).unwrap().writes, 0);
    }
}
