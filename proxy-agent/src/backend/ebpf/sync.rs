//! Incremental, make-before-break updates of the service maps. Pure code: the
//! kernel maps sit behind [`MapWriter`], so the ordering is unit-tested.
//!
//! For every plan, writes go in this order:
//! 1. new backends;
//! 2. per frontend: its reverse-NAT entry (if new), changed backend slots,
//!    new source ranges, then the frontend slot (count, flags), then slots
//!    beyond the new count and source ranges it no longer has;
//! 3. removed frontends: the frontend slot first, then its slots, source
//!    ranges and reverse-NAT entry;
//! 4. backends no frontend uses any more.
//!
//! So a program that read a frontend count always finds slots `1..=count`,
//! and every slot names a backend that exists. `SyncState` records each
//! write only once the kernel accepted it: after a failed write it still
//! describes the maps exactly, and the next sync resumes from there.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{
    BACKEND_FLAG_HOST, BACKEND_FLAG_LOCAL, Backend, IPPROTO_TCP, IPPROTO_UDP, MAX_SOURCE_RANGES,
    RevNat, SVC_FLAG_AFFINITY, SVC_FLAG_DROP_EMPTY, SVC_FLAG_EXTERNAL, SVC_FLAG_LOCAL,
    SVC_FLAG_SOURCE_RANGES, ServiceKey, ServiceValue,
};

use crate::{
    model::{Cidr, Protocol},
    plan::{BackendPlan, Frontend, FrontendPlan, Plan},
};

/// One write to the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend { id: u32, backend: Backend },
    PutRevNat { frontend: Frontend, id: u32, value: RevNat },
    PutService { key: ServiceKey, value: ServiceValue },
    DeleteService { key: ServiceKey },
    DeleteRevNat { frontend: Frontend, id: u32 },
    PutSourceRange { frontend: Frontend, rev_nat_id: u32, cidr: Cidr },
    DeleteSourceRange { frontend: Frontend, rev_nat_id: u32, cidr: Cidr },
    DeleteBackend { id: u32 },
}

/// Applies map operations; the real one writes BPF maps.
pub trait MapWriter {
    fn apply(&mut self, op: &MapOp) -> Result<(), std::io::Error>;
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(
        "the plan needs {needed} {what} entries, the map holds {capacity}; keeping the current state"
    )]
    Capacity { what: &'static str, needed: usize, capacity: u32 },
    #[error("writing {op:?}: {source}")]
    Write { op: MapOp, source: std::io::Error },
}

/// What a sync did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub writes: usize,
    /// Backends no frontend uses any more (their flows may need flushing).
    pub removed_backends: Vec<Backend>,
}

/// Services (by reverse-NAT id) whose affinity entries may name a backend
/// they no longer have, with the backends they keep.
pub type AffinityPurge = BTreeMap<u32, BTreeSet<u32>>;

#[derive(Clone, Debug, Default)]
struct InstalledFrontend {
    rev_nat_id: u32,
    value: Option<ServiceValue>,
    slots: BTreeMap<u16, u32>,
    source_ranges: BTreeSet<Cidr>,
}

/// What the maps hold, as far as the agent wrote them.
#[derive(Debug, Default)]
pub struct SyncState {
    backends: BTreeMap<Backend, u32>,
    backend_by_id: BTreeMap<u32, Backend>,
    frontends: BTreeMap<Frontend, InstalledFrontend>,
    rev_nat: BTreeSet<u32>,
    last_backend_id: u32,
    last_rev_nat_id: u32,
    /// Affinity cleanups owed, kept across failed syncs until done.
    pending_purge: AffinityPurge,
    /// The service maps' sizes.
    capacity: super::MapSizes,
}

fn proto(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => IPPROTO_TCP,
        Protocol::Udp => IPPROTO_UDP,
    }
}

pub fn service_key(frontend: &Frontend, slot: u16) -> ServiceKey {
    ServiceKey::new(frontend.ip.octets(), frontend.port, proto(frontend.protocol), slot)
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

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// Entries of the maps the agent writes, by map name.
    pub fn map_entries(&self) -> [(&'static str, usize); 4] {
        let slots: usize = self.frontends.values().map(|f| 1 + f.slots.len()).sum();
        let ranges: usize = self.frontends.values().map(|f| f.source_ranges.len()).sum();
        [
            ("SERVICES", slots),
            ("BACKENDS", self.backends.len()),
            ("REV_NAT", self.rev_nat.len()),
            ("SOURCE_RANGES", ranges),
        ]
    }

    /// Brings the maps to `plan`, writing only what differs.
    pub fn sync(
        &mut self,
        plan: &Plan,
        writer: &mut impl MapWriter,
    ) -> Result<SyncReport, SyncError> {
        self.check_capacity(plan)?;
        let (ops, purge) = self.ops(plan);
        // Owed from now on: a write below may fail after slots changed.
        self.pending_purge.extend(purge);
        let mut report = SyncReport { writes: ops.len(), removed_backends: Vec::new() };
        for op in &ops {
            writer.apply(op).map_err(|source| SyncError::Write { op: op.clone(), source })?;
            if let MapOp::DeleteBackend { id } = op {
                report.removed_backends.extend(self.backend_by_id.get(id).copied());
            }
            self.record(op);
        }
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
    fn check_capacity(&self, plan: &Plan) -> Result<(), SyncError> {
        let desired: BTreeSet<Backend> = plan
            .frontends
            .iter()
            .flat_map(|(f, p)| p.backends.iter().map(|b| backend(f, b)))
            .collect();
        let backends = self.backends.keys().chain(&desired).collect::<BTreeSet<_>>().len();
        let installed_entries: usize = self.frontends.values().map(|f| 1 + f.slots.len()).sum();
        let new_entries: usize = plan
            .frontends
            .iter()
            .map(|(f, p)| match self.frontends.get(f) {
                // More slots than installed (fewer are deleted last).
                Some(installed) => p.backends.len().saturating_sub(installed.slots.len()),
                None => 1 + p.backends.len(),
            })
            .sum();
        let new_frontends =
            plan.frontends.keys().filter(|f| !self.frontends.contains_key(f)).count();
        let ranges: usize = self.frontends.values().map(|f| f.source_ranges.len()).sum::<usize>()
            + plan.frontends.values().map(|f| f.source_ranges.len()).sum::<usize>();
        let checks = [
            ("backend", backends, self.capacity.backends),
            ("service", installed_entries + new_entries, self.capacity.services),
            ("reverse-NAT", self.rev_nat.len() + new_frontends, self.capacity.rev_nat),
            ("source-range", ranges, MAX_SOURCE_RANGES),
        ];
        for (what, needed, capacity) in checks {
            if needed > capacity as usize {
                return Err(SyncError::Capacity { what, needed, capacity });
            }
        }
        Ok(())
    }

    fn ops(&self, plan: &Plan) -> (Vec<MapOp>, AffinityPurge) {
        let mut ops = Vec::new();
        let mut purge = AffinityPurge::new();

        // 1. Backends, with ids for the new ones.
        let mut ids = self.backends.clone();
        let mut last_id = self.last_backend_id;
        for (frontend, fp) in &plan.frontends {
            for addr in &fp.backends {
                let backend = backend(frontend, addr);
                if ids.contains_key(&backend) {
                    continue;
                }
                let id = next_free(
                    last_id,
                    |id| self.backend_by_id.contains_key(&id),
                    |id| id.checked_add(1).unwrap_or(1),
                );
                last_id = id;
                ids.insert(backend, id);
                ops.push(MapOp::PutBackend { id, backend });
            }
        }

        // 2. Frontends to create or update.
        let mut last_rev = self.last_rev_nat_id;
        let mut new_revs = BTreeSet::new();
        for (frontend, fp) in &plan.frontends {
            let installed = self.frontends.get(frontend).cloned().unwrap_or_default();
            let rev_nat_id = if installed.rev_nat_id != 0 {
                installed.rev_nat_id
            } else {
                let id = next_free(
                    last_rev,
                    |id| self.rev_nat.contains(&id) || new_revs.contains(&id),
                    |id| id.checked_add(1).unwrap_or(1),
                );
                last_rev = id;
                new_revs.insert(id);
                let value = RevNat { address: frontend.ip.octets(), port: frontend.port, _pad: 0 };
                ops.push(MapOp::PutRevNat { frontend: *frontend, id, value });
                id
            };
            let backend_ids: Vec<u32> =
                fp.backends.iter().map(|b| ids[&backend(frontend, b)]).collect();
            let slots = assign_slots(&installed.slots, &backend_ids);
            for (slot, id) in &slots {
                if installed.slots.get(slot) != Some(id) {
                    let value = ServiceValue { backend_id: *id, rev_nat_id, ..Default::default() };
                    ops.push(MapOp::PutService { key: service_key(frontend, *slot), value });
                }
            }
            let wanted: BTreeSet<Cidr> = fp.source_ranges.iter().copied().collect();
            for cidr in wanted.difference(&installed.source_ranges) {
                ops.push(MapOp::PutSourceRange { frontend: *frontend, rev_nat_id, cidr: *cidr });
            }
            let value = ServiceValue {
                backend_id: 0,
                count: backend_ids.len() as u16,
                rev_nat_id,
                affinity_timeout_secs: fp.affinity_timeout_secs.unwrap_or(0),
                flags: flags(fp),
            };
            if installed.value != Some(value) {
                ops.push(MapOp::PutService { key: service_key(frontend, 0), value });
            }
            for slot in installed.slots.keys().filter(|s| **s as usize > backend_ids.len()) {
                ops.push(MapOp::DeleteService { key: service_key(frontend, *slot) });
            }
            for cidr in installed.source_ranges.difference(&wanted) {
                ops.push(MapOp::DeleteSourceRange { frontend: *frontend, rev_nat_id, cidr: *cidr });
            }
            let kept: BTreeSet<u32> = backend_ids.iter().copied().collect();
            let had_affinity = installed.value.is_some_and(|v| v.flags & SVC_FLAG_AFFINITY != 0);
            if fp.affinity_timeout_secs.is_none() && had_affinity {
                // Switched off: entries must not resurface if it comes back.
                purge.insert(rev_nat_id, BTreeSet::new());
            } else if fp.affinity_timeout_secs.is_some()
                && installed.slots.values().any(|id| !kept.contains(id))
            {
                purge.insert(rev_nat_id, kept);
            }
        }

        // 3. Frontends that are gone: frontend slot first.
        for (frontend, installed) in &self.frontends {
            if plan.frontends.contains_key(frontend) {
                continue;
            }
            if installed.value.is_some() {
                ops.push(MapOp::DeleteService { key: service_key(frontend, 0) });
            }
            for slot in installed.slots.keys() {
                ops.push(MapOp::DeleteService { key: service_key(frontend, *slot) });
            }
            for cidr in &installed.source_ranges {
                let rev_nat_id = installed.rev_nat_id;
                ops.push(MapOp::DeleteSourceRange { frontend: *frontend, rev_nat_id, cidr: *cidr });
            }
            ops.push(MapOp::DeleteRevNat { frontend: *frontend, id: installed.rev_nat_id });
            if installed.value.is_some_and(|v| v.flags & SVC_FLAG_AFFINITY != 0) {
                purge.insert(installed.rev_nat_id, BTreeSet::new());
            }
        }

        // 4. Backends nobody uses.
        let used: BTreeSet<Backend> = plan
            .frontends
            .iter()
            .flat_map(|(f, fp)| fp.backends.iter().map(|b| backend(f, b)))
            .collect();
        for (backend, id) in &self.backends {
            if !used.contains(backend) {
                ops.push(MapOp::DeleteBackend { id: *id });
            }
        }
        (ops, purge)
    }

    /// Records a write the kernel accepted.
    fn record(&mut self, op: &MapOp) {
        match op {
            MapOp::PutBackend { id, backend } => {
                self.backends.insert(*backend, *id);
                self.backend_by_id.insert(*id, *backend);
                self.last_backend_id = *id;
            }
            MapOp::DeleteBackend { id } => {
                if let Some(backend) = self.backend_by_id.remove(id) {
                    self.backends.remove(&backend);
                }
            }
            MapOp::PutRevNat { frontend, id, .. } => {
                self.rev_nat.insert(*id);
                self.last_rev_nat_id = *id;
                self.frontends.entry(*frontend).or_default().rev_nat_id = *id;
            }
            MapOp::DeleteRevNat { frontend, id } => {
                self.rev_nat.remove(id);
                self.frontends.remove(frontend);
            }
            MapOp::PutSourceRange { frontend, cidr, .. } => {
                self.frontends.entry(*frontend).or_default().source_ranges.insert(*cidr);
            }
            MapOp::DeleteSourceRange { frontend, cidr, .. } => {
                if let Some(entry) = self.frontends.get_mut(frontend) {
                    entry.source_ranges.remove(cidr);
                }
            }
            MapOp::PutService { key, value } => {
                let entry = self.frontends.entry(frontend_of_key(key)).or_default();
                if key.slot == 0 {
                    entry.value = Some(*value);
                } else {
                    entry.slots.insert(key.slot, value.backend_id);
                }
            }
            MapOp::DeleteService { key } => {
                if let Some(entry) = self.frontends.get_mut(&frontend_of_key(key)) {
                    if key.slot == 0 {
                        entry.value = None;
                    } else {
                        entry.slots.remove(&key.slot);
                    }
                }
            }
        }
    }
}

/// The frontend flags the programs act on.
fn flags(fp: &FrontendPlan) -> u16 {
    [
        (fp.affinity_timeout_secs.is_some(), SVC_FLAG_AFFINITY),
        (fp.external, SVC_FLAG_EXTERNAL),
        (fp.local, SVC_FLAG_LOCAL),
        (fp.drop_when_empty, SVC_FLAG_DROP_EMPTY),
        (!fp.source_ranges.is_empty(), SVC_FLAG_SOURCE_RANGES),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .fold(0, |flags, (_, flag)| flags | flag)
}

/// Slot for each backend: those already installed in a slot within the new
/// count stay put, the others fill the free slots, so one endpoint change
/// rewrites one slot however the addresses sort.
fn assign_slots(installed: &BTreeMap<u16, u32>, backend_ids: &[u32]) -> BTreeMap<u16, u32> {
    let count = backend_ids.len();
    let wanted: BTreeSet<u32> = backend_ids.iter().copied().collect();
    let mut slots = BTreeMap::new();
    let mut placed = BTreeSet::new();
    for (slot, id) in installed {
        if (*slot as usize) <= count && wanted.contains(id) && placed.insert(*id) {
            slots.insert(*slot, *id);
        }
    }
    let mut free =
        (1..=count as u16).filter(|s| !slots.contains_key(s)).collect::<Vec<_>>().into_iter();
    for id in backend_ids {
        if !placed.contains(id)
            && let Some(slot) = free.next()
        {
            slots.insert(slot, *id);
        }
    }
    slots
}

fn frontend_of_key(key: &ServiceKey) -> Frontend {
    let protocol = if key.proto == IPPROTO_UDP { Protocol::Udp } else { Protocol::Tcp };
    Frontend { ip: key.address.into(), port: key.port, protocol }
}

fn backend(frontend: &Frontend, planned: &BackendPlan) -> Backend {
    Backend {
        address: planned.addr.ip().octets(),
        port: planned.addr.port(),
        proto: proto(frontend.protocol),
        flags: [(planned.local, BACKEND_FLAG_LOCAL), (planned.host, BACKEND_FLAG_HOST)]
            .iter()
            .filter(|(on, _)| *on)
            .fold(0, |flags, (_, flag)| flags | flag),
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddrV4};

    use super::*;
    use crate::{
        model::{ServiceName, ServicePortName},
        plan::{BackendPlan, FrontendPlan},
    };

    /// The maps in memory. After every write it checks what a BPF program
    /// relies on: a frontend's slots `1..=count` exist and name backends that
    /// exist, and every frontend has its reverse-NAT entry.
    #[derive(Default)]
    struct Maps {
        services: BTreeMap<ServiceKey, ServiceValue>,
        backends: BTreeMap<u32, Backend>,
        rev_nat: BTreeMap<u32, RevNat>,
        source_ranges: BTreeSet<(u32, Cidr)>,
        writes: usize,
        fail_at: Option<usize>,
    }

    impl Maps {
        fn check(&self) {
            for (key, value) in self.services.iter().filter(|(k, _)| k.slot == 0) {
                assert!(self.rev_nat.contains_key(&value.rev_nat_id), "{key:?} without rev nat");
                if value.flags & SVC_FLAG_SOURCE_RANGES != 0 {
                    let rev = value.rev_nat_id;
                    assert!(self.source_ranges.iter().any(|(r, _)| *r == rev), "{key:?} ranges");
                }
                for slot in 1..=value.count {
                    let slot_value = self.services.get(&key.with_slot(slot));
                    let slot_value =
                        slot_value.unwrap_or_else(|| panic!("{key:?} slot {slot} missing"));
                    assert!(self.backends.contains_key(&slot_value.backend_id), "dangling slot");
                }
            }
            for (key, value) in self.services.iter().filter(|(k, _)| k.slot != 0) {
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
                MapOp::DeleteBackend { id } => drop(self.backends.remove(id)),
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
            }
            self.check();
            Ok(())
        }
    }

    fn frontend(last: u8, protocol: Protocol) -> Frontend {
        Frontend { ip: Ipv4Addr::new(10, 96, 0, last), port: 53, protocol }
    }

    fn plan(frontends: &[(Frontend, &[u8], Option<u32>)]) -> Plan {
        let mut plan = Plan::default();
        for (frontend, backends, affinity) in frontends {
            // Frontends on 10.96.0.2 are load-balancer IPs with a source range.
            let ranges: Vec<Cidr> = (frontend.ip.octets()[3] == 2)
                .then(|| Cidr::parse("192.168.0.0/16").unwrap().unwrap())
                .into_iter()
                .collect();
            plan.frontends.insert(
                *frontend,
                FrontendPlan {
                    service: ServicePortName {
                        service: ServiceName { namespace: "ns".into(), name: "svc".into() },
                        port: String::new(),
                    },
                    backends: backends
                        .iter()
                        .map(|b| BackendPlan {
                            addr: SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, *b), 8080),
                            local: *b % 2 == 0,
                            host: false,
                        })
                        .collect(),
                    affinity_timeout_secs: *affinity,
                    external: !ranges.is_empty(),
                    local: false,
                    drop_when_empty: false,
                    source_ranges: ranges,
                },
            );
        }
        plan
    }

    /// What a program would choose from, per frontend: the backend addresses.
    fn view(maps: &Maps) -> BTreeMap<(ServiceKey, u16), Vec<[u8; 4]>> {
        maps.services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(k, v)| {
                let backends = (1..=v.count)
                    .map(|s| maps.backends[&maps.services[&k.with_slot(s)].backend_id].address)
                    .collect();
                ((*k, v.count), backends)
            })
            .collect()
    }

    #[test]
    fn keys_encode_as_the_programs_build_them_from_a_sockaddr() {
        // connect4 builds the key from user_ip4 (network order: wire bytes)
        // and ntohs(user_port); padding is zero.
        let key = service_key(
            &Frontend { ip: Ipv4Addr::new(10, 96, 0, 10), port: 80, protocol: Protocol::Udp },
            2,
        );
        // SAFETY: ServiceKey is repr(C) without implicit padding.
        let bytes: [u8; 12] = unsafe { std::mem::transmute(key) };
        assert_eq!(bytes, [10, 96, 0, 10, 80, 0, 2, 0, 17, 0, 0, 0]);
        let backend = backend(
            &Frontend { ip: Ipv4Addr::new(10, 96, 0, 10), port: 80, protocol: Protocol::Tcp },
            &BackendPlan { addr: "10.244.1.2:8080".parse().unwrap(), local: true, host: false },
        );
        let bytes: [u8; 8] = unsafe { std::mem::transmute(backend) };
        assert_eq!(bytes, [10, 244, 1, 2, 0x90, 0x1f, 6, BACKEND_FLAG_LOCAL]);
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
            state.sync(step, &mut maps).unwrap();
            assert_eq!(view(&maps).len(), step.frontends.len());
            for (f, fp) in &step.frontends {
                let key = service_key(f, 0);
                let value = maps.services[&key];
                assert_eq!(value.count as usize, fp.backends.len());
                let slots = maps.services.keys().filter(|k| k.slot != 0 && k.with_slot(0) == key);
                assert_eq!(slots.count(), fp.backends.len(), "no stale slots");
            }
            let used: BTreeSet<u32> = maps.services.values().map(|v| v.backend_id).collect();
            assert!(maps.backends.keys().all(|id| used.contains(id)), "no orphan backends");
            // A second sync of the same plan writes nothing.
            assert_eq!(state.sync(step, &mut maps).unwrap().writes, 0);
        }
        assert!(maps.services.is_empty() && maps.backends.is_empty() && maps.rev_nat.is_empty());
        assert!(maps.source_ranges.is_empty());
    }

    #[test]
    fn slots_stay_put_when_a_lower_address_joins() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        let many: Vec<u8> = (10..60).collect();
        state.sync(&plan(&[(tcp, &many, None)]), &mut maps).unwrap();
        let before = maps.writes;
        let mut more = many.clone();
        more.insert(0, 2);
        // One backend, one slot, the frontend count.
        assert_eq!(state.sync(&plan(&[(tcp, &more, None)]), &mut maps).unwrap().writes, 3);
        assert_eq!(maps.writes - before, 3);
        // Removing one in the middle: its slot is refilled by the last one.
        more.remove(20);
        let report = state.sync(&plan(&[(tcp, &more, None)]), &mut maps).unwrap();
        assert_eq!(report.writes, 4, "slot refill, count, slot delete, backend delete");
    }

    #[test]
    fn one_endpoint_change_rewrites_only_what_changed() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&plan(&[(tcp, &[2, 3, 4], None)]), &mut maps).unwrap();
        let before = maps.writes;
        // 4 -> 5: one new backend, one slot, one backend deletion; the
        // frontend (same count) and the other slots are untouched.
        state.sync(&plan(&[(tcp, &[2, 3, 5], None)]), &mut maps).unwrap();
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
        state.sync(&start, &mut maps).unwrap();
        let writes = state.sync(&target, &mut maps).unwrap().writes;
        assert!(writes >= 8, "the step adds, rewrites and removes: {writes} writes");
        for fail_at in 0..writes {
            let mut maps = Maps::default();
            let mut state = SyncState::default();
            state.sync(&start, &mut maps).unwrap();
            maps.fail_at = Some(maps.writes + fail_at);
            assert!(state.sync(&target, &mut maps).is_err(), "failure {fail_at} injected");
            state.sync(&target, &mut maps).unwrap();
            let (_, mut backends) = view(&maps).into_iter().next().unwrap();
            backends.sort();
            assert_eq!(backends, vec![[10, 244, 0, 2], [10, 244, 0, 3], [10, 244, 0, 6]]);
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
        state.sync(&plan(&[(tcp, &[2, 3], Some(10))]), &mut maps).unwrap();
        assert!(state.take_affinity_purge().is_empty());
        state.sync(&plan(&[(tcp, &[2, 3, 4], Some(10))]), &mut maps).unwrap();
        assert!(state.take_affinity_purge().is_empty(), "adding a backend keeps affinity");
        state.sync(&plan(&[(tcp, &[3, 4], Some(10))]), &mut maps).unwrap();
        let purge = state.take_affinity_purge();
        assert_eq!(purge.len(), 1);
        assert_eq!(purge.values().next().unwrap().len(), 2);
        // Switching affinity off forgets every entry of the service.
        state.sync(&plan(&[(tcp, &[3, 4], None)]), &mut maps).unwrap();
        let purge = state.take_affinity_purge();
        assert!(purge.values().next().unwrap().is_empty());
    }

    #[test]
    fn freed_ids_are_not_reused_at_once() {
        let tcp = frontend(1, Protocol::Tcp);
        let mut maps = Maps::default();
        let mut state = SyncState::default();
        state.sync(&plan(&[(tcp, &[2], None)]), &mut maps).unwrap();
        let first: Vec<u32> = maps.backends.keys().copied().collect();
        state.sync(&plan(&[(tcp, &[3], None)]), &mut maps).unwrap();
        assert!(maps.backends.keys().all(|id| !first.contains(id)));
    }

    #[test]
    fn plans_that_do_not_fit_are_refused_before_any_write() {
        let mut big = Plan::default();
        for i in 0..101 {
            let frontend =
                Frontend { ip: Ipv4Addr::from(0x0a60_0000 + i), port: 80, protocol: Protocol::Tcp };
            big.frontends.insert(
                frontend,
                FrontendPlan {
                    service: ServicePortName {
                        service: ServiceName { namespace: "ns".into(), name: format!("s{i}") },
                        port: String::new(),
                    },
                    backends: vec![],
                    affinity_timeout_secs: None,
                    external: false,
                    local: false,
                    drop_when_empty: false,
                    source_ranges: vec![],
                },
            );
        }
        let mut maps = Maps::default();
        let sizes = |services, rev_nat| super::super::MapSizes { services, backends: 100, rev_nat };
        let err = SyncState::with_capacity(sizes(1000, 100)).sync(&big, &mut maps).unwrap_err();
        assert!(matches!(err, SyncError::Capacity { what: "reverse-NAT", .. }), "{err}");
        assert_eq!(maps.writes, 0);

        let err = SyncState::with_capacity(sizes(100, 1000)).sync(&big, &mut maps).unwrap_err();
        assert!(matches!(err, SyncError::Capacity { what: "service", capacity: 100, .. }), "{err}");
        assert_eq!(maps.writes, 0);
    }
}
