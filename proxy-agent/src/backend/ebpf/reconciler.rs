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
//! and every slot names a backend that exists. `Reconciler` records each
//! write only once the kernel accepted it: after a failed write it still
//! describes the maps exactly, and the next sync resumes from there.
//!
//! A sync may be told which frontends changed: it then looks at those only
//! (and at their backends), so one endpoint change costs the same at 10 or
//! 100,000 services. Backends are collected by reference count (how many
//! installed slots name each), and map sizes are kept as running counts.

mod ops;
#[cfg(test)]
mod tests;
mod writes;

pub use ops::{BatchKind, MaglevTable, MapOp, MapWriter, apply_each};
use writes::cut;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use hashbrown::HashMap;

use proxy_common::{
    FrontendInfo, KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER, KIND_NODE_PORT,
    MAX_MAGLEV_CHUNKS, MAX_SOURCE_RANGES, ServiceValue,
    maglev::{self as maglev_map},
};

use super::{
    batch,
    carry::Reserved,
    departures::Departures,
    entries::{BackendEntry, RevNatEntry},
    fit,
    installed::{Backends, Pos, Slots},
};
use crate::{
    model::{Cidr, IpFamily, ServiceName, ServicePortName},
    plan::{BackendPlan, Frontend, FrontendKind, FrontendPlan, Plan, Scope},
};

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

    /// What operators (and the next agent) see of `frontend`, which this
    /// owns.
    pub fn info(&self, frontend: &Frontend) -> FrontendInfo {
        let kind = match self.kind {
            FrontendKind::ClusterIp => KIND_CLUSTER_IP,
            FrontendKind::NodePort => KIND_NODE_PORT,
            FrontendKind::ExternalIp => KIND_EXTERNAL_IP,
            FrontendKind::LoadBalancer => KIND_LOAD_BALANCER,
        };
        let (proto, scope) = super::entries::proto_and_scope(frontend);
        FrontendInfo::new(kind, &self.service.to_string()).with_key(proto, scope)
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
pub struct Reconciler {
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
    /// takes over (see [`Reconciler::reserve`]).
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
    rev_nat: IdSet,
    backends: IdSet,
}

/// Ids in order, searched by bisection: a restart at 100,000 services
/// reserves a million at once, sorted in a fraction of what hashing them
/// takes.
#[derive(Debug, Default)]
struct IdSet(Vec<u32>);

impl IdSet {
    fn contains(&self, id: u32) -> bool {
        self.0.binary_search(&id).is_ok()
    }

    fn last(&self) -> Option<u32> {
        self.0.last().copied()
    }

    /// Those of these ids that `present` does not hold.
    fn absent(&self, present: impl IntoIterator<Item = u32>) -> IdSet {
        let mut found = vec![false; self.0.len()];
        for id in present {
            if let Ok(at) = self.0.binary_search(&id) {
                found[at] = true;
            }
        }
        IdSet(self.0.iter().zip(found).filter(|(_, found)| !found).map(|(id, _)| *id).collect())
    }
}

impl FromIterator<u32> for IdSet {
    fn from_iter<I: IntoIterator<Item = u32>>(ids: I) -> Self {
        let mut ids: Vec<u32> = ids.into_iter().collect();
        ids.sort_unstable();
        IdSet(ids)
    }
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

impl Reconciler {
    /// Nothing installed yet, in maps of these sizes.
    pub fn with_capacity(capacity: super::MapSizes) -> Self {
        Reconciler { capacity, ..Reconciler::default() }
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
        self.last_rev_nat_id = self.reserved_ids.rev_nat.last().unwrap_or(0);
        self.last_backend_id = self.reserved_ids.backends.last().unwrap_or(0);
        self.reserved = reserved;
    }

    /// The ids maps made to replace these (larger, or afresh after a failed
    /// load) are to keep: those installed here, and the previous agent's
    /// while they are reserved. Known here, where reading them back from
    /// the pinned maps took seconds at 100,000 services.
    pub fn kept_ids(&self) -> Reserved {
        let mut kept = self.reserved.clone();
        kept.frontends.extend(self.frontends.iter().map(|(f, i)| (*f, i.rev_nat_id)));
        kept.backends.extend(self.backends.installed().map(|(id, entry)| (*entry, id)));
        kept
    }

    /// Ends the reservations (once this agent serves the whole source):
    /// returns what the previous agent had and this one did not install.
    pub fn release_reserved(&mut self) -> Released {
        let backends = std::mem::take(&mut self.reserved).backends;
        let ids = std::mem::take(&mut self.reserved_ids);
        // A reserved id is given to what held it and to nothing else: those
        // not installed are what this agent did not install. Found by id,
        // as a restart at 100,000 services releases a million.
        let gone = ids.backends.absent(self.backends.installed().map(|(id, _)| id));
        Released {
            backends: backends
                .into_iter()
                .filter(|(_, id)| gone.contains(*id))
                .map(|(b, id)| (id, b))
                .collect(),
            rev_nat_ids: ids.rev_nat.absent(self.rev_nat.iter().copied()).0,
        }
    }

    /// The id for a new backend or frontend: its reserved one if free, else
    /// the next one round-robin that is neither used nor reserved.
    fn new_id(
        reserved: Option<&u32>,
        last: &mut u32,
        used: impl Fn(u32) -> bool,
        reserved_ids: &IdSet,
    ) -> u32 {
        if let Some(id) = reserved.filter(|id| !used(**id)) {
            return *id;
        }
        let id = next_free(
            *last,
            |id| used(id) || reserved_ids.contains(id),
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
    /// [`fit`]), so that nothing keeps a copy of the plan meanwhile.
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

    /// Records a write the kernel accepted.
    fn record(&mut self, op: &MapOp) {
        match op {
            MapOp::PutBackend { id, backend } => {
                self.backends.insert(*id, *backend);
            }
            MapOp::DeleteBackend { id, .. } => drop(self.backends.remove(*id)),
            MapOp::PutRevNat { frontend, id, owner, .. } => {
                self.rev_nat.insert(*id);
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

    /// Records an entry of adopted maps (see [`super::adopt`]) as the write
    /// that made it; slots after the backends they name and their
    /// frontend's reverse-NAT entry.
    pub fn adopt(&mut self, op: &MapOp) {
        match op {
            MapOp::PutBackend { id, backend } => self.backends.adopt(*id, *backend),
            op => self.record(op),
        }
    }

    /// Room for `frontends` and `backends`, before adopting them.
    pub fn make_room(&mut self, frontends: usize, backends: usize) {
        self.frontends.reserve(frontends);
        self.backends.reserve(backends);
    }

    /// Records chunk `chunk` of an adopted frontend's Maglev table. What
    /// it was computed from is not known: the first sync computes it again.
    pub fn adopt_maglev_chunk(&mut self, frontend: &Frontend, chunk: u32) {
        let entry = self.frontends.entry(*frontend).or_default();
        entry.maglev_digest = None;
        if chunk >= entry.maglev_chunks {
            self.maglev_entries += (chunk + 1 - entry.maglev_chunks) as usize;
            entry.maglev_chunks = chunk + 1;
        }
    }

    /// Once every adopted entry is recorded: backends no slot names are
    /// the next sync's to delete, and new ids go past the adopted ones.
    pub fn adopted(&mut self) {
        self.backends.settle();
        self.last_backend_id = self.backends.installed().map(|(id, _)| id).max().unwrap_or(0);
        self.last_rev_nat_id = self.rev_nat.last().copied().unwrap_or(0);
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
