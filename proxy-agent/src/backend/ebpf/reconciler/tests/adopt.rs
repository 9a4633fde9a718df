//! A record read back from maps a previous agent wrote (`super::adopt`):
//! the plan that made them needs no write but the Maglev tables, a changed
//! one is written make-before-break, and what the maps hold that no
//! complete sync leaves (a crash's) goes.

use super::*;

/// What a new agent records of `maps`, the entries replayed in the order
/// `adopt::read_back` reads them; `owner` names each frontend as its info
/// would.
fn adopted(maps: &Maps, owner: impl Fn(&Frontend) -> Owner) -> Reconciler {
    let mut record = Reconciler::default();
    record.make_room(maps.rev_nat.len(), maps.backends.len());
    for (id, backend) in &maps.backends {
        record.adopt(&MapOp::PutBackend { id: *id, backend: *backend });
    }
    // The infos say each id's frontend; here the frontend slots do.
    let frontend_of: BTreeMap<u32, Frontend> = maps
        .services
        .iter()
        .filter(|(k, _)| k.slot() == 0)
        .map(|(k, v)| (v.rev_nat_id, k.frontend()))
        .collect();
    for (id, value) in &maps.rev_nat {
        let frontend = frontend_of[id];
        let owner = owner(&frontend);
        record.adopt(&MapOp::PutRevNat { frontend, id: *id, value: *value, owner });
    }
    for (key, value) in &maps.services {
        record.adopt(&MapOp::PutService { key: *key, value: *value });
    }
    for (rev_nat_id, cidr) in &maps.source_ranges {
        let frontend = frontend_of[rev_nat_id];
        record.adopt(&MapOp::PutSourceRange { frontend, rev_nat_id: *rev_nat_id, cidr: *cidr });
    }
    for (rev_nat_id, chunk) in maps.maglev.keys() {
        record.adopt_maglev_chunk(&frontend_of[rev_nat_id], *chunk);
    }
    record.adopted();
    record
}

fn owners(plan: &Plan) -> impl Fn(&Frontend) -> Owner + '_ {
    |f| Owner::of(&plan.frontends[f])
}

/// A ClusterIP with affinity, a UDP one, and a load-balancer IP with a
/// source range, Maglev and DSR (see [`plan`]).
fn previous() -> Plan {
    let (tcp, udp) = (Protocol::Tcp, Protocol::Udp);
    plan(&[
        (frontend(1, tcp), &[1, 2], Some(30)),
        (frontend(2, tcp), &[2, 3, 4], None),
        (frontend(3, udp), &[5], None),
    ])
}

#[test]
fn the_plan_that_made_adopted_maps_rewrites_only_their_maglev_tables() {
    let plan = previous();
    let mut maps = Maps::default();
    Reconciler::default().sync(&plan, None, &mut maps).unwrap();
    let before = (maps.services.clone(), maps.backends.clone(), maps.rev_nat.clone());

    let mut record = adopted(&maps, owners(&plan));
    record.assert_consistent();
    assert_counts(&record, &maps);
    maps.writes = 0;
    let report = record.sync(&plan, None, &mut maps).unwrap();
    // A Maglev table's digest is not in the map: it is computed again.
    assert_eq!((report.writes, maps.writes), (maps.maglev.len(), maps.maglev.len()));
    assert!(report.departures.is_empty());
    assert_eq!((maps.services.clone(), maps.backends.clone(), maps.rev_nat.clone()), before);
    maps.writes = 0;
    assert_eq!(record.sync(&plan, None, &mut maps).unwrap().writes, 0, "then nothing");
}

#[test]
fn adopted_maps_follow_a_changed_plan_make_before_break_with_new_ids_past_theirs() {
    let (tcp, udp) = (Protocol::Tcp, Protocol::Udp);
    let earlier = previous();
    let mut maps = Maps::default();
    Reconciler::default().sync(&earlier, None, &mut maps).unwrap();
    let old_backends = maps.backends.clone();
    let old_rev_nat = maps.rev_nat.clone();

    let mut record = adopted(&maps, owners(&earlier));
    // While no agent ran: 10.244.0.1 left the first frontend, the UDP one
    // went, a new one came with a new endpoint.
    let now = plan(&[
        (frontend(1, tcp), &[2], Some(30)),
        (frontend(2, tcp), &[2, 3, 4], None),
        (frontend(4, udp), &[6], None),
    ]);
    // `Maps` checks every write: never a dangling slot or a missing entry.
    let report = record.sync(&now, None, &mut maps).unwrap();
    assert_counts(&record, &maps);
    let id_of = |ip: u8| {
        let ip = Ipv4Addr::new(10, 244, 0, ip);
        old_backends.iter().find(|(_, b)| b.addr().ip() == ip).map(|(id, _)| *id).unwrap()
    };
    let rev_of = |maps: &Maps, f: &Frontend| maps.services[&SlotKey::new(f, 0)].rev_nat_id;
    assert!(report.departures.ends(rev_of(&maps, &frontend(1, tcp)), id_of(1)));
    assert!(report.departures.ends(0, id_of(5)), "the UDP frontend's backend is gone");
    assert!(!report.departures.ends(rev_of(&maps, &frontend(2, tcp)), id_of(2)));
    // Kept frontends and backends keep their ids; new ones get others.
    assert_eq!(maps.backends[&id_of(2)], old_backends[&id_of(2)]);
    let new_rev = rev_of(&maps, &frontend(4, udp));
    assert!(!old_rev_nat.contains_key(&new_rev), "a new frontend's id is new");
    let new_id = maps.backends.keys().find(|id| !old_backends.contains_key(id));
    assert!(new_id.is_some_and(|id| *id > *old_backends.keys().max().unwrap()));
    // As a fresh sync of the same plan into empty maps would serve.
    let mut fresh = Maps::default();
    Reconciler::default().sync(&now, None, &mut fresh).unwrap();
    let ips = |maps: &Maps| {
        view(maps).into_iter().map(|((k, _), ips)| (k.frontend(), ips)).collect::<BTreeMap<_, _>>()
    };
    assert_eq!(ips(&maps), ips(&fresh));
}

#[test]
fn what_a_crash_left_in_adopted_maps_goes_at_the_first_sync() {
    let tcp = Protocol::Tcp;
    let plan = previous();
    let mut maps = Maps::default();
    Reconciler::default().sync(&plan, None, &mut maps).unwrap();
    // A backend written before the slots that were to name it, and a slot
    // past its frontend's count (written before the count grew into it).
    let stray = BackendEntry::V4(proxy_common::Backend {
        address: [10, 244, 0, 9],
        port: 8080,
        proto: proxy_common::IPPROTO_TCP,
        ..Default::default()
    });
    maps.backends.insert(900, stray);
    let key = SlotKey::new(&frontend(2, tcp), 0);
    let count = maps.services[&key].count;
    let past = with_slot(&key, count + 1);
    maps.services.insert(past, ServiceValue { backend_id: 900, ..Default::default() });

    let mut record = adopted(&maps, owners(&plan));
    record.assert_consistent();
    record.sync(&plan, None, &mut maps).unwrap();
    assert!(!maps.services.contains_key(&past), "the slot past the count");
    assert!(!maps.backends.contains_key(&900), "the backend nothing names");
    assert_counts(&record, &maps);
}
