//! What the sync recorded of the service maps, in structures sized for a
//! million backends: the backends by id and by entry, and a frontend's
//! slots. Hash tables rather than B-trees (filled in address order, those
//! were half empty, and their searches a fifth of a first sync's CPU), of
//! positions in one vector of backends: a table of 4-byte positions holds
//! a million backends found two ways in 20 MiB, where a map of 32-byte
//! entries held them one way in 64. A sync's new backends are staged here
//! (given ids, found by entry) before it writes them, rather than listed
//! and indexed beside the record: a first sync's million were held twice.
//! Pure code.

use std::hash::{BuildHasher, Hash};

use hashbrown::{DefaultHashBuilder, HashSet, HashTable, hash_table::Entry};

use super::entries::BackendEntry;

/// A recorded backend: its id, entry, and whether the map holds it yet
/// and how many installed slots name it. 32 bytes: a first sync records
/// a million.
#[derive(Clone, Copy, Debug)]
struct Backend {
    id: u32,
    state: State,
    entry: BackendEntry,
}

const _: () = assert!(std::mem::size_of::<Option<Backend>>() == 32);

/// Staged, or installed and named by so many installed slots: one word
/// (an enum with a count would take two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State(u32);

impl State {
    /// Given its id by a sync that has yet to write it: found by id and
    /// entry (no second id is given to it, nor its id to another), but not
    /// installed, so no slot names it. Above any count of slots, which the
    /// maps' sizes bound far below.
    const STAGED: State = State(u32::MAX);
    const UNREFERENCED: State = State(0);

    fn is_staged(self) -> bool {
        self == State::STAGED
    }

    fn is_installed(self) -> bool {
        !self.is_staged()
    }

    /// How many installed slots name it.
    fn refs(self) -> u32 {
        if self.is_staged() { 0 } else { self.0 }
    }

    /// One more installed slot names it (an installed one: never reaching
    /// the staged word).
    fn named(&mut self) {
        debug_assert!(self.is_installed() && self.0 < State::STAGED.0 - 1);
        self.0 += 1;
    }

    /// One installed slot less names it, if any did.
    fn unnamed(&mut self) {
        if self.is_installed() && self.0 > 0 {
            self.0 -= 1;
        }
    }
}

/// Where a recorded backend is: valid until it is removed (a sync removes
/// backends only after its last use of a position). A sync finds each
/// backend it names once by entry and then reaches it here, where a first
/// sync's new ones sit in order, rather than searching again by id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pos(u32);

/// The installed backends, found by id or by entry, and those a sync
/// staged.
#[derive(Debug, Default)]
pub struct Backends {
    /// The backends, each at a position a removal frees for the next.
    slab: Vec<Option<Backend>>,
    free: Vec<u32>,
    /// Positions in `slab`, hashed by id.
    by_id: HashTable<u32>,
    /// Positions in `slab`, hashed by entry.
    by_entry: HashTable<u32>,
    hasher: DefaultHashBuilder,
    /// The largest id ever recorded: any above it is free, known without a
    /// search (a first sync gives a million).
    max_id: u32,
    /// How many are staged.
    staged: usize,
    /// Where the last backend written or referenced is: a first sync
    /// writes its new backends in the order staged and then names them in
    /// that order, each next to the last, found there without a search.
    last: u32,
    /// Backends no installed slot names (left by a failed sync, or whose
    /// last slot went in this one): deleted by the next sync.
    unreferenced: HashSet<u32>,
    /// Where the backends staged or written since the last
    /// [`Backends::settle`] are, in that order: unreferenced unless a slot
    /// names them since (a sync writes its new backends before their slots,
    /// and a first sync's million would otherwise pass through
    /// `unreferenced` one by one), or never written. A position freed
    /// since holds nothing, or one listed again.
    written: Vec<u32>,
}

impl Backends {
    /// How many are installed.
    pub fn len(&self) -> usize {
        self.by_id.len() - self.staged
    }

    fn hash(&self, key: impl Hash) -> u64 {
        self.hasher.hash_one(key)
    }

    fn at(&self, position: u32) -> &Backend {
        filled(&self.slab, &position)
    }

    fn position(&self, id: u32) -> Option<u32> {
        if id > self.max_id {
            return None;
        }
        self.by_id.find(self.hash(id), |p| self.at(*p).id == id).copied()
    }

    fn backend(&self, id: u32) -> Option<&Backend> {
        let backend = self.at(self.position(id)?);
        backend.state.is_installed().then_some(backend)
    }

    /// [`Self::position`], tried first next to the last one found here.
    fn position_near(&mut self, id: u32) -> Option<u32> {
        let near = [self.last, self.last.wrapping_add(1)];
        let holds =
            |p: &u32| self.slab.get(*p as usize).is_some_and(|b| b.is_some_and(|b| b.id == id));
        let position = near.into_iter().find(holds).or_else(|| self.position(id))?;
        self.last = position;
        Some(position)
    }

    fn backend_mut(&mut self, id: u32) -> Option<&mut Backend> {
        let position = self.position_near(id)?;
        self.slab[position as usize].as_mut().filter(|b| b.state.is_installed())
    }

    /// The entry of installed backend `id`.
    pub fn get(&self, id: u32) -> Option<&BackendEntry> {
        self.backend(id).map(|b| &b.entry)
    }

    /// Whether `id` names a backend, installed or staged.
    pub fn contains_id(&self, id: u32) -> bool {
        self.position(id).is_some()
    }

    /// The backend with this entry, installed or staged.
    pub fn find(&self, entry: &BackendEntry) -> Option<Pos> {
        let found = self.by_entry.find(self.hash(entry), |p| self.at(*p).entry == *entry)?;
        Some(Pos(*found))
    }

    pub fn id_at(&self, at: Pos) -> u32 {
        self.at(at.0).id
    }

    /// The entry of the backend at `at`, installed or staged.
    pub fn entry_at(&self, at: Pos) -> &BackendEntry {
        &self.at(at.0).entry
    }

    pub fn is_installed_at(&self, at: Pos) -> bool {
        self.at(at.0).state.is_installed()
    }

    /// The id of the backend with this entry, installed or staged.
    pub fn id_of(&self, entry: &BackendEntry) -> Option<u32> {
        self.find(entry).map(|at| self.id_at(at))
    }

    /// How many installed slots name `id`.
    pub fn refs(&self, id: u32) -> u32 {
        self.backend(id).map_or(0, |b| b.state.refs())
    }

    /// The installed backends with their ids, in no order.
    pub fn installed(&self) -> impl Iterator<Item = (u32, &BackendEntry)> + '_ {
        let installed = self.slab.iter().flatten().filter(|b| b.state.is_installed());
        installed.map(|b| (b.id, &b.entry))
    }

    /// The installed ids, in no order.
    #[cfg(test)]
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.installed().map(|(id, _)| id)
    }

    /// The backends `written` lists, from its `skip`th on.
    fn listed(&self, skip: usize) -> impl Iterator<Item = &Backend> + '_ {
        self.written.iter().skip(skip).filter_map(|p| self.slab[*p as usize].as_ref())
    }

    /// May name an id twice.
    pub fn unreferenced(&self) -> impl Iterator<Item = u32> + '_ {
        let written = self.listed(0).filter(|b| b.state == State::UNREFERENCED);
        self.unreferenced.iter().copied().chain(written.map(|b| b.id))
    }

    /// Room for `total` backends in all, made at once rather than by
    /// doubling as they are staged (each doubling rehashes every one, with
    /// the old and new tables side by side).
    pub fn reserve(&mut self, total: usize) {
        let additional = total.saturating_sub(self.by_id.len());
        self.slab.reserve(additional.saturating_sub(self.free.len()));
        self.written.reserve(additional);
        let (slab, hasher) = (&self.slab, &self.hasher);
        let at = |p: &u32| filled(slab, p);
        self.by_id.reserve(additional, |p| hasher.hash_one(at(p).id));
        self.by_entry.reserve(additional, |p| hasher.hash_one(at(p).entry));
    }

    /// Gives new backend `entry` (no recorded one has it) the unused
    /// `id`, to be written next; the staged backends since the last
    /// [`Backends::settle`] are [`Backends::staged`].
    pub fn stage(&mut self, id: u32, entry: BackendEntry) -> Pos {
        debug_assert!(self.id_of(&entry).is_none() && !self.contains_id(id));
        let position = self.add(Backend { id, state: State::STAGED, entry });
        self.staged += 1;
        self.written.push(position);
        Pos(position)
    }

    /// The staged backends from the `skip`th on, in the order staged (the
    /// first `skip` of them are written).
    pub fn staged(&self, skip: usize) -> impl Iterator<Item = (u32, BackendEntry)> + '_ {
        let staged = self.listed(skip).filter(|b| b.state.is_staged());
        staged.map(|b| (b.id, b.entry))
    }

    /// Drops the staged backends never written, and files those written
    /// since the last call that no slot names.
    pub fn settle(&mut self) {
        for position in std::mem::take(&mut self.written) {
            let Some(backend) = self.slab[position as usize] else { continue };
            match backend.state {
                State::STAGED => drop(self.remove(backend.id)),
                State::UNREFERENCED => drop(self.unreferenced.insert(backend.id)),
                _ => {}
            }
        }
    }

    /// Records backend `id`, which maps being adopted hold as `entry`: as
    /// [`Backends::insert`] would, without looking for what no adopted
    /// entry can be (an id recorded already).
    pub fn adopt(&mut self, id: u32, entry: BackendEntry) {
        if self.contains_id(id) {
            return self.insert(id, entry);
        }
        let position = self.add(Backend { id, state: State::UNREFERENCED, entry });
        self.written.push(position);
    }

    /// Records backend `id` written as `entry` (a rewrite keeps its
    /// references; an entry written under a second id is found by that one).
    pub fn insert(&mut self, id: u32, entry: BackendEntry) {
        let position = self.position_near(id);
        if let Some(staged) = position.and_then(|p| self.slab[p as usize].as_mut())
            && staged.state.is_staged()
            && staged.entry == entry
        {
            // Listed in `written` when it was staged.
            staged.state = State::UNREFERENCED;
            self.staged -= 1;
            return;
        }
        let refs = self.refs(id);
        self.remove(id);
        let position = self.add(Backend { id, state: State(refs), entry });
        if refs == 0 {
            self.written.push(position);
        }
    }

    /// Puts `backend` in a free position and both tables; returns the
    /// position.
    fn add(&mut self, backend: Backend) -> u32 {
        let Backend { id, entry, .. } = backend;
        self.max_id = self.max_id.max(id);
        let backend = Some(backend);
        let position = match self.free.pop() {
            Some(p) => {
                self.slab[p as usize] = backend;
                p
            }
            None => {
                self.slab.push(backend);
                (self.slab.len() - 1) as u32
            }
        };
        let (slab, hasher) = (&self.slab, &self.hasher);
        let at = |p: &u32| filled(slab, p);
        self.by_id.insert_unique(hasher.hash_one(id), position, |p| hasher.hash_one(at(p).id));
        let eq = |p: &u32| at(p).entry == entry;
        let rehash = |p: &u32| hasher.hash_one(at(p).entry);
        match self.by_entry.entry(hasher.hash_one(entry), eq, rehash) {
            Entry::Occupied(mut other) => *other.get_mut() = position,
            Entry::Vacant(vacant) => drop(vacant.insert(position)),
        }
        position
    }

    /// Forgets backend `id`, deleted from the map (or staged and never
    /// written).
    pub fn remove(&mut self, id: u32) -> Option<BackendEntry> {
        let hash = self.hash(id);
        let slab = &self.slab;
        let found = self.by_id.find_entry(hash, |p| filled(slab, p).id == id);
        let (position, _) = found.ok()?.remove();
        let gone = self.slab[position as usize].take().expect("a filled position");
        // Its entry may have been written under a second id since, which
        // is the one found by entry then.
        if let Ok(found) =
            self.by_entry.find_entry(self.hasher.hash_one(gone.entry), |p| *p == position)
        {
            found.remove();
        }
        self.free.push(position);
        self.unreferenced.remove(&id);
        self.staged -= usize::from(gone.state.is_staged());
        Some(gone.entry)
    }

    /// One more installed slot names backend `id`.
    pub fn add_ref(&mut self, id: u32) {
        if let Some(backend) = self.backend_mut(id) {
            backend.state.named();
            if backend.state.refs() == 1 {
                self.unreferenced.remove(&id);
            }
        }
    }

    /// One installed slot less names backend `id`.
    pub fn drop_ref(&mut self, id: u32) {
        if let Some(backend) = self.backend_mut(id)
            && backend.state.refs() > 0
        {
            backend.state.unnamed();
            if backend.state == State::UNREFERENCED {
                self.unreferenced.insert(id);
            }
        }
    }
}

/// The backend at a position the tables name: always a filled one.
fn filled<'s>(slab: &'s [Option<Backend>], position: &u32) -> &'s Backend {
    slab[*position as usize].as_ref().expect("tables name only filled positions")
}

/// A frontend's backend slots as installed: slot `s` names the backend id
/// at `s - 1` (ids start at 1, so 0 is a slot not installed: a failed sync
/// may leave gaps). No trailing empty slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slots(Vec<u32>);

impl Slots {
    pub const EMPTY: Slots = Slots(Vec::new());

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn get(&self, slot: u16) -> Option<u32> {
        let id = *self.0.get(usize::from(slot).checked_sub(1)?)?;
        (id != 0).then_some(id)
    }

    /// The installed slots and the ids they name, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (u16, u32)> + '_ {
        (1..).zip(self.0.iter().copied()).filter(|(_, id)| *id != 0)
    }

    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter().map(|(_, id)| id)
    }

    /// How many slots are installed.
    pub fn count(&self) -> usize {
        self.ids().count()
    }

    /// Installs `slot` naming `id`; returns the id it named before.
    pub fn insert(&mut self, slot: u16, id: u32) -> Option<u32> {
        debug_assert!(slot > 0 && id != 0);
        let index = usize::from(slot) - 1;
        if self.0.len() <= index {
            self.0.resize(index + 1, 0);
        }
        let old = std::mem::replace(&mut self.0[index], id);
        (old != 0).then_some(old)
    }

    /// Removes `slot`; returns the id it named.
    pub fn remove(&mut self, slot: u16) -> Option<u32> {
        let index = usize::from(slot).checked_sub(1)?;
        let old = std::mem::take(self.0.get_mut(index)?);
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
        (old != 0).then_some(old)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proxy_common::{Backend as V4, BackendFlags};

    use super::*;

    fn entry(last: u8) -> BackendEntry {
        let flags = BackendFlags::EMPTY;
        BackendEntry::V4(V4 { address: [10, 0, 0, last], port: 80, proto: 6, flags })
    }

    #[test]
    fn backends_are_found_by_id_and_entry_and_counted_by_reference() {
        let mut backends = Backends::default();
        backends.insert(7, entry(1));
        backends.insert(9, entry(2));
        assert_eq!((backends.id_of(&entry(1)), backends.id_of(&entry(2))), (Some(7), Some(9)));
        assert_eq!(backends.unreferenced().count(), 2);
        backends.add_ref(7);
        backends.add_ref(7);
        backends.drop_ref(7);
        assert_eq!((backends.refs(7), backends.unreferenced().collect::<Vec<_>>()), (1, vec![9]));
        // Filed, the same: the written ones that no slot named since.
        backends.settle();
        assert_eq!(backends.unreferenced().collect::<Vec<_>>(), vec![9]);
        backends.drop_ref(7);
        assert_eq!(backends.unreferenced().collect::<BTreeSet<_>>(), BTreeSet::from([7, 9]));
        backends.add_ref(7);
        assert_eq!(backends.remove(9), Some(entry(2)));
        assert_eq!((backends.id_of(&entry(2)), backends.len()), (None, 1));
        assert_eq!(backends.unreferenced().count(), 0);
        // Written and deleted before it was filed: not reported.
        backends.insert(11, entry(3));
        backends.remove(11);
        assert_eq!(backends.unreferenced().count(), 0);
        // A rewrite keeps the references.
        backends.insert(7, entry(1));
        assert_eq!((backends.id_of(&entry(1)), backends.refs(7)), (Some(7), 1));
    }

    #[test]
    fn a_staged_backend_has_its_id_but_is_installed_only_once_written() {
        let mut backends = Backends::default();
        backends.insert(1, entry(1));
        backends.settle();
        backends.stage(2, entry(2));
        backends.stage(3, entry(3));
        // Found, so no second id is given to it nor its id to another...
        assert_eq!((backends.id_of(&entry(2)), backends.contains_id(3)), (Some(2), true));
        // ... but not installed.
        let at = backends.find(&entry(2)).unwrap();
        assert_eq!(
            (backends.get(2), backends.is_installed_at(at), backends.len()),
            (None, false, 1)
        );
        assert_eq!(backends.unreferenced().collect::<Vec<_>>(), vec![1]);
        assert_eq!(backends.staged(0).collect::<Vec<_>>(), vec![(2, entry(2)), (3, entry(3))]);
        // Written: installed, and unreferenced until a slot names it.
        backends.insert(2, entry(2));
        assert_eq!((backends.get(2), backends.len()), (Some(&entry(2)), 2));
        assert!(backends.is_installed_at(at) && backends.id_at(at) == 2);
        assert_eq!(backends.staged(1).collect::<Vec<_>>(), vec![(3, entry(3))]);
        assert_eq!(backends.unreferenced().collect::<BTreeSet<_>>(), BTreeSet::from([1, 2]));
        // Never written: gone at the settle, its id and entry free again.
        backends.settle();
        assert_eq!((backends.id_of(&entry(3)), backends.contains_id(3)), (None, false));
        assert_eq!((backends.staged(0).count(), backends.len()), (0, 2));
        assert_eq!(backends.unreferenced().collect::<BTreeSet<_>>(), BTreeSet::from([1, 2]));
    }

    #[test]
    fn backends_are_found_next_to_the_last_and_anywhere_else() {
        let mut backends = Backends::default();
        backends.reserve(5);
        for last in 1..=5 {
            backends.stage(u32::from(last) * 10, entry(last));
        }
        for last in 1..=5 {
            backends.insert(u32::from(last) * 10, entry(last));
        }
        // In order (each next to the last), then out of it.
        for id in [10, 20, 30, 40, 50, 40, 10, 50, 50, 20] {
            backends.add_ref(id);
        }
        let refs: Vec<u32> = [10, 20, 30, 40, 50].map(|id| backends.refs(id)).into();
        assert_eq!(refs, vec![2, 2, 1, 2, 3]);
        assert_eq!((backends.len(), backends.unreferenced().count()), (5, 0));
    }

    #[test]
    fn a_removed_backends_position_is_taken_by_the_next_and_both_tables_still_find_each() {
        let mut backends = Backends::default();
        for (id, last) in [(1, 1), (2, 2), (3, 3)] {
            backends.insert(id, entry(last));
        }
        assert_eq!(backends.remove(2), Some(entry(2)));
        backends.insert(4, entry(4));
        assert_eq!(backends.slab.len(), 3, "position reused");
        for (id, last) in [(1, 1), (3, 3), (4, 4)] {
            assert_eq!(
                (backends.get(id), backends.id_of(&entry(last))),
                (Some(&entry(last)), Some(id))
            );
        }
        assert_eq!((backends.get(2), backends.id_of(&entry(2))), (None, None));
        // An entry written under a second id is found by that one; the
        // first keeps its own position, found by id.
        backends.insert(5, entry(1));
        assert_eq!((backends.id_of(&entry(1)), backends.get(1)), (Some(5), Some(&entry(1))));
        assert_eq!(backends.remove(1), Some(entry(1)));
        assert_eq!((backends.id_of(&entry(1)), backends.len()), (Some(5), 3));
        assert_eq!(backends.ids().collect::<BTreeSet<_>>(), BTreeSet::from([3, 4, 5]));
    }

    #[test]
    fn slots_keep_gaps_and_drop_trailing_empties() {
        let mut slots = Slots::EMPTY;
        for (slot, id) in [(3, 6), (1, 4), (2, 5)] {
            assert_eq!(slots.insert(slot, id), None);
        }
        assert_eq!(slots.remove(2), Some(5));
        assert_eq!(slots.iter().collect::<Vec<_>>(), vec![(1, 4), (3, 6)]);
        assert_eq!((slots.get(2), slots.count()), (None, 2));
        assert_eq!(slots.remove(3), Some(6));
        assert_eq!(slots, Slots(vec![4]));
        assert_eq!(slots.insert(3, 9), None);
        assert_eq!(slots.insert(1, 2), Some(4));
        assert_eq!(slots.iter().collect::<Vec<_>>(), vec![(1, 2), (3, 9)]);
        assert_eq!(slots.remove(1).and(slots.remove(3)), Some(9));
        assert!(slots.is_empty());
    }
}
