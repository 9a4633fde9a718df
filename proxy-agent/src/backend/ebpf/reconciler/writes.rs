//! The writes that bring one frontend to its plan, or remove it; and what
//! a sync changes, worked out from the plan and the record.

use std::{collections::BTreeSet, sync::Arc};

use hashbrown::HashMap;

use proxy_common::{ServiceFlags, ServiceValue};

use super::{Changes, MaglevTable, MapOp, NOT_INSTALLED, Reconciler, Tally};
use crate::backend::ebpf::{
    entries::{BackendEntry, SlotKey},
    installed::{Pos, Slots},
};
use crate::{
    maglev,
    model::{Cidr, ServicePortName},
    plan::{Frontend, FrontendPlan, Plan, Scope},
};

impl Reconciler {
    /// Works out a sync's changes, staging its new backends.
    pub(super) fn changes<'p>(
        &mut self,
        plan: &'p Plan,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> Changes<'p> {
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
        // Given, if not written yet: a failed sync's staged backends keep
        // theirs, and an id passed over is only reused later.
        self.last_backend_id = last_id;

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
        self.last_rev_nat_id = last_rev;

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
    pub(super) fn frontend_writes(
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
    pub(super) fn removal_writes(
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
pub(super) fn cut(
    named: &[Pos],
    counts: impl IntoIterator<Item = usize>,
) -> impl Iterator<Item = &[Pos]> {
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
