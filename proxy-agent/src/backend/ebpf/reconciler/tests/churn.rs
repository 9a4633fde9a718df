//! Syncs in steps, incremental syncs against full ones, and random churn:
//! the maps always match a fresh sync of the same plan.

use super::*;

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
    let sizes = crate::backend::ebpf::MapSizes { services: 8, backends: 4, rev_nat: 4 };
    let mut state = Reconciler::with_capacity(sizes);
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
    let sizes = maps.sizes();
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
    Reconciler::default().sync(plan, None, &mut maps).unwrap();
    content(&maps)
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
        for (i, frontend) in frontends[..3].iter().enumerate().filter(|(i, _)| svc.frontends[*i]) {
            let backends: Vec<BackendPlan> = svc.endpoints.iter().map(|e| endpoint(*e)).collect();
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
    let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
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
    let mut state = Reconciler::default();
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
    let cluster_policy =
        Plan { frontends: [(nodeport, frontend_plan(eps(&[1, 2, 3, 4]), Some(5), vec![]))].into() };
    let mut local = frontend_plan(eps(&[3]), Some(5), vec![]);
    (local.external, local.local, local.two_scopes) = (true, true, true);
    let local_policy = Plan {
        frontends: [(nodeport, local), (twin, frontend_plan(eps(&[1, 2, 3, 4]), Some(5), vec![]))]
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
        let mut state = Reconciler::default();
        state.sync(from, None, &mut maps).unwrap();
        // Maps::check, after every write: a flag never names a missing twin.
        let writes = state.sync(to, Some(&dirty), &mut maps).unwrap().writes;
        assert_eq!(content(&maps), fresh(to));
        for fail_at in 0..writes {
            let mut maps = Maps::default();
            let mut state = Reconciler::default();
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
    Reconciler::default().sync(&local_policy, None, &mut maps).unwrap();
    let [outer, inner] = [nodeport, twin].map(|f| maps.services[&SlotKey::new(&f, 0)]);
    assert!(outer.flags.has_two_scopes() && !inner.flags.has_two_scopes());
    assert_ne!(outer.rev_nat_id, inner.rev_nat_id);
    assert_eq!(maps.rev_nat[&outer.rev_nat_id], maps.rev_nat[&inner.rev_nat_id]);
    assert_eq!((outer.count, inner.count), (1, 4));
}

#[test]
fn a_failed_incremental_sync_is_finished_by_a_full_one() {
    let (cluster, nodeport, udp) = (svc_frontends(1)[0], svc_frontends(1)[1], svc_frontends(2)[2]);
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
    let mut state = Reconciler::default();
    state.sync(&start, None, &mut maps).unwrap();
    let writes = state.sync(&target, Some(&dirty), &mut maps).unwrap().writes;
    assert!(writes >= 15, "{writes} writes");
    assert_eq!(content(&maps), fresh(&target));
    for fail_at in 0..writes {
        let mut maps = Maps::default();
        let mut state = Reconciler::default();
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
        crate::backend::ebpf::MapSizes { services: 100_000, backends: 100_000, rev_nat: 100_000 };
    let mut state = Reconciler::with_capacity(sizes);
    // The maps' check after every write is quadratic here: off for setup.
    let mut maps = Maps { unchecked: true, ..Maps::default() };
    state.sync(&plan, None, &mut maps).unwrap();
    maps.unchecked = false;
    assert_eq!(state.frontend_count(), 10_000);
    assert_eq!(state.backend_count(), 15_000);
    let [cluster, nodeport] = frontends(7);
    let step = |state: &mut Reconciler, plan: &Plan, dirty: &[Frontend], maps: &mut Maps| {
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
    plan.frontends.get_mut(&cluster).unwrap().backends = endpoints(7, &[4])[1..].to_vec().into();
    let report = step(&mut state, &plan, &[cluster], &mut maps);
    assert_eq!((report.writes, report.departures.len()), (3, 1));
    // The NodePort comes back: slot 0, 3 slots, reverse NAT; no backend.
    plan.frontends.insert(nodeport, frontend_plan(endpoints(7, &[4])[1..].to_vec(), None, vec![]));
    let report = step(&mut state, &plan, &[nodeport], &mut maps);
    assert_eq!(report.writes, 5);

    maps.check();
    assert_eq!(content(&maps), fresh(&plan));
    assert_eq!(state.sync(&plan, None, &mut maps).unwrap().writes, 0);
}
