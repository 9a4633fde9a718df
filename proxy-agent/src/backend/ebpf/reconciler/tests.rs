use proxy_common::ServiceKey;

use super::*;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use proxy_common::{
    KIND_CLUSTER_IP, KIND_EXTERNAL_IP, ServiceFlags, ServiceValue,
    maglev::{self as maglev_map, MaglevChunk},
};

use crate::backend::ebpf::{
    carry::Reserved,
    entries::{BackendEntry, RevNatEntry, SlotKey},
};
use crate::{
    model::{Cidr, EndpointAddr, IpFamily, Protocol, ServiceName, ServicePortName},
    plan::{BackendList, BackendPlan, Frontend, FrontendKind, FrontendPlan, Plan, Scope},
};

mod adopt;
mod churn;

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
    /// Entries per map, in `Reconciler::map_entries`'s order.
    fn sizes(&self) -> [usize; 5] {
        [
            self.services.len(),
            self.backends.len(),
            self.rev_nat.len(),
            self.source_ranges.len(),
            self.maglev.len(),
        ]
    }

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
                let chunks = self.maglev.range((value.rev_nat_id, 0)..(value.rev_nat_id + 1, 0));
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

/// The state's counts are those of the maps.
fn assert_counts(state: &Reconciler, maps: &Maps) {
    state.assert_consistent();
    let counts = state.map_entries().map(|(_, n)| n);
    assert_eq!(counts, maps.sizes());
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
    let mut state = Reconciler::default();
    for step in &steps {
        state.sync(step, None, &mut maps).unwrap();
        assert_eq!(view(&maps).len(), step.frontends.len());
        for (f, fp) in &step.frontends {
            let key = SlotKey::new(f, 0);
            let value = maps.services[&key];
            assert_eq!(value.count as usize, fp.backends.len());
            let slots = maps.services.keys().filter(|k| k.slot() != 0 && with_slot(k, 0) == key);
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
    let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
    state.sync(&start, None, &mut maps).unwrap();
    let writes = state.sync(&target, None, &mut maps).unwrap().writes;
    assert!(writes >= 8, "the step adds, rewrites and removes: {writes} writes");
    for fail_at in 0..writes {
        let mut maps = Maps::default();
        let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
    let mut p = plan(&[(tcp, &[2], None)]);
    let writes = state.sync(&p, None, &mut maps).unwrap().writes;
    let info = state.frontends[&tcp].owner.as_ref().unwrap().info(&tcp);
    assert_eq!((info.kind, info.name()), (KIND_CLUSTER_IP, "ns/svc"));
    // Another service (or kind) takes the address over: one write.
    let fp = p.frontends.get_mut(&tcp).unwrap();
    Arc::make_mut(&mut fp.service).service.name = "other".into();
    fp.kind = FrontendKind::ExternalIp;
    let report = state.sync(&p, None, &mut maps).unwrap();
    assert_eq!(report.writes, 1, "after {writes} at first");
    let info = state.frontends[&tcp].owner.as_ref().unwrap().info(&tcp);
    assert_eq!((info.kind, info.name()), (KIND_EXTERNAL_IP, "ns/other"));
    assert_eq!(state.sync(&p, None, &mut maps).unwrap().writes, 0);
}

#[test]
fn a_backend_leaving_one_of_two_frontends_departs_from_that_one_only() {
    let (a, b) = (frontend(1, Protocol::Udp), frontend(3, Protocol::Udp));
    let mut maps = Maps::default();
    let mut state = Reconciler::default();
    state.sync(&plan(&[(a, &[2, 3], None), (b, &[2], None)]), None, &mut maps).unwrap();
    let rev = |f: &Frontend| state.frontends[f].rev_nat_id;
    let (rev_a, rev_b) = (rev(&a), rev(&b));
    let shared = state.backends.ids().min().unwrap();
    let report = state.sync(&plan(&[(a, &[3], None), (b, &[2], None)]), None, &mut maps).unwrap();
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
    let mut before = Reconciler::default();
    let mut old = Maps::default();
    let earlier = plan(&[(frontend(1, tcp), &[1, 2], Some(30)), (frontend(3, udp), &[3], None)]);
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
    let mut after = Reconciler::default();
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
    assert!(!reserved.frontends.values().any(|id| *id == new_rev), "no reserved id is handed out");
    let new_backend =
        new.backends.iter().find(|(_, b)| b.addr().ip() == Ipv4Addr::new(10, 244, 0, 4)).unwrap();
    assert!(!reserved.backends.values().any(|id| id == new_backend.0));

    let released = after.release_reserved();
    let udp_backend =
        reserved.backends.keys().find(|b| b.addr().ip() == Ipv4Addr::new(10, 244, 0, 3)).unwrap();
    let udp_id = reserved.backends[udp_backend];
    assert_eq!(released.backends, vec![(udp_id, *udp_backend)], "its flows are stale");
    assert_eq!(released.rev_nat_ids, vec![reserved.frontends[&frontend(3, udp)]]);
    after.assert_consistent();
}

#[test]
fn maps_made_again_keep_every_id() {
    let (tcp, udp) = (Protocol::Tcp, Protocol::Udp);
    let mut previous = Reconciler::default();
    previous.sync(&plan(&[(frontend(3, udp), &[3], None)]), None, &mut Maps::default()).unwrap();
    let mut serving = Reconciler::default();
    serving.reserve(previous.kept_ids());
    let now = plan(&[(frontend(1, tcp), &[1, 2], Some(30)), (frontend(4, tcp), &[4], None)]);
    let mut maps = Maps::default();
    serving.sync(&now, None, &mut maps).unwrap();

    // Before the take-over, the previous agent's ids are kept too, the
    // ones no plan names yet included.
    let kept = serving.kept_ids();
    assert_eq!(kept.frontends.len(), 3);
    assert_eq!(kept.backends.len(), 4);
    let mut again = Reconciler::default();
    again.reserve(kept);
    let mut larger = Maps::default();
    again.sync(&now, None, &mut larger).unwrap();
    assert_eq!(larger.services, maps.services, "every frontend and slot as it was");
    assert_eq!(larger.backends, maps.backends, "every backend under its id");

    // After it, what is installed.
    drop(serving.release_reserved());
    let kept = serving.kept_ids();
    assert_eq!(kept.frontends.len(), 2);
    assert_eq!(kept.backends.len(), 3);
    assert!(kept.backends.iter().all(|(backend, id)| maps.backends[id] == *backend));
}

#[test]
fn freed_ids_are_not_reused_at_once() {
    let tcp = frontend(1, Protocol::Tcp);
    let mut maps = Maps::default();
    let mut state = Reconciler::default();
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
                    service: ServiceName { namespace: "ns".into(), name: format!("s{i}").into() },
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
    let err = Reconciler::with_capacity(sizes(1000, 100)).sync(&big, None, &mut maps).unwrap_err();
    assert!(matches!(err, SyncError::Capacity { what: "reverse-NAT", .. }), "{err}");
    assert_eq!(maps.writes, 0);

    let err = Reconciler::with_capacity(sizes(100, 1000)).sync(&big, None, &mut maps).unwrap_err();
    assert!(matches!(err, SyncError::Capacity { what: "service", capacity: 100, .. }), "{err}");
    assert_eq!(maps.writes, 0);
}
