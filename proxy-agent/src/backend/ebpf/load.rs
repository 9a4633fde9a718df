//! Loading the BPF object: the programs by name, the loader's map sizes
//! and carried-over state maps, the verifier run (in parallel), and the
//! programs' settings and decision records.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use aya::{
    Ebpf,
    maps::{Array, MapData, RingBuf},
    programs::{CgroupSockAddr, Program, SchedClassifier},
};
use proxy_common::{Config, Layouts, TC_NEW_PROGRAMS, map_names};

use super::{
    BpfObject, EbpfError, MapSizes, ServiceMaps, adopt,
    attach::TcAttach,
    carry,
    carry::{Carry, Conversion, KeptIds, Pinned, STATE_MAPS},
    flow_counts::{FlowCounts, Growth},
    maps::Maps,
    on_demand::{Group, Stage, Stages},
    programs::{INGRESS, PROGRAMS, TC_PROGRAMS},
    reconciler::{Reconciler, SyncError, SyncReport},
    records, sock_end,
    sock_end::SocketEnding,
    state_sizes::StateSizes,
};
use crate::plan::{Frontend, Plan};

/// The socket programs' global saying whether they may call
/// `bpf_set_retval`.
pub(super) const SET_RETVAL: &str = "SET_RETVAL";

/// Whether the socket programs can fail `connect()` with ECONNREFUSED
/// (`bpf_set_retval`, Linux 5.18+); without it a refusal is EPERM.
pub fn has_set_retval() -> bool {
    aya::sys::is_helper_supported(
        aya::programs::ProgramType::CgroupSockAddr,
        aya::sys::BpfHelper::BPF_FUNC_set_retval,
    )
    .unwrap_or(false)
}

pub(super) static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// The programs every load verifies: the IPv4 per-packet ones (the
/// new-flow one included) and the socket programs (the IPv6 and SCTP
/// per-packet ones are loaded on demand: [`super::on_demand`]).
/// `tc_ingress` and `tc_new_flow` are the heaviest to verify (about 0.2 s
/// each here; 1.2 s as one program, `proxy_common::TC_NEW_PROGRAMS`), so
/// they start first, each on a thread of its own.
fn base_programs() -> (Vec<&'static str>, [&'static str; 2]) {
    let tc = TC_PROGRAMS.map(|(name, _, _)| name);
    let names = tc.into_iter().chain(TC_NEW_PROGRAMS).chain(PROGRAMS).collect();
    (names, [INGRESS.0, TC_NEW_PROGRAMS[0]])
}

/// Loads the programs `names` on up to [`VERIFIER_THREADS`] threads, each
/// taking the next program in turn, the `heaviest` first: each is verified
/// on its own, and all of them take seconds of CPU at every start.
pub(super) fn verify(
    ebpf: &mut Ebpf,
    names: &[&'static str],
    heaviest: &[&'static str],
) -> Result<(), EbpfError> {
    let [programs] = pick(ebpf, [names])?;
    verify_set(programs, heaviest)
}

/// `ebpf`'s programs named in each of `sets` (disjoint), to verify apart.
fn pick<'a, const N: usize>(
    ebpf: &'a mut Ebpf,
    sets: [&[&'static str]; N],
) -> Result<[Vec<(&'static str, &'a mut Program)>; N], EbpfError> {
    let mut picked = [(); N].map(|()| Vec::new());
    for (name, program) in ebpf.programs_mut() {
        for (set, names) in picked.iter_mut().zip(sets) {
            if let Some(name) = names.iter().find(|n| **n == name) {
                set.push((*name, &mut *program));
                break;
            }
        }
    }
    for (set, names) in picked.iter().zip(sets) {
        if let Some(name) = names.iter().find(|n| !set.iter().any(|(p, _)| p == *n)) {
            return Err(EbpfError::Missing { what: "program", name });
        }
    }
    Ok(picked)
}

/// [`verify`] of programs picked.
fn verify_set(
    mut programs: Vec<(&'static str, &mut Program)>,
    heaviest: &[&'static str],
) -> Result<(), EbpfError> {
    programs.sort_by_key(|(name, _)| !heaviest.contains(name));
    let queue = std::sync::Mutex::new(programs.into_iter());
    let next = || queue.lock().unwrap_or_else(|e| e.into_inner()).next();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(VERIFIER_THREADS);
    std::thread::scope(|scope| {
        let loading: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    std::iter::from_fn(next).try_for_each(|(name, p)| load_program(name, p))
                })
            })
            .collect();
        loading
            .into_iter()
            .try_for_each(|thread| thread.join().unwrap_or(Err(EbpfError::VerifierThread)))
    })
}

/// At most this many programs are verified at once.
const VERIFIER_THREADS: usize = 4;

fn load_program(name: &'static str, program: &mut Program) -> Result<(), EbpfError> {
    let err = |source| EbpfError::Program { name, source };
    if PROGRAMS.contains(&name) {
        <&mut CgroupSockAddr>::try_from(program).map_err(err)?.load().map_err(err)
    } else {
        <&mut SchedClassifier>::try_from(program).map_err(err)?.load().map_err(err)
    }
}

impl BpfObject {
    /// Loads and verifies the programs with the default service map sizes
    /// and the smallest state maps, carrying nothing over: to verify or
    /// test the programs.
    pub fn load(tc_mode: TcAttach) -> Result<Self, EbpfError> {
        Self::load_with(tc_mode, MapSizes::default(), StateSizes::SMALLEST, None)
    }

    /// Loads and verifies the programs; nothing is attached yet. With the
    /// bpffs `root` of a previous agent, its state maps are carried over
    /// and its ids reserved (see [`carry`]).
    pub fn load_with(
        tc_mode: TcAttach,
        sizes: MapSizes,
        state: StateSizes,
        root: Option<&Path>,
    ) -> Result<Self, EbpfError> {
        let mut backend = Self::prepare(tc_mode, sizes, state, root, KeptIds::Pinned)?;
        backend.verify()?;
        Ok(backend)
    }

    /// [`Self::load_with`] but for the programs: the maps are made (and the
    /// state maps carried over), the programs are not verified yet
    /// ([`Self::verify`], [`Self::verify_while_syncing`]). The state maps
    /// take `state`'s sizes; frontends and backends keep the ids `ids`
    /// gives.
    pub fn prepare(
        tc_mode: TcAttach,
        sizes: MapSizes,
        state: StateSizes,
        root: Option<&Path>,
        ids: KeptIds,
    ) -> Result<Self, EbpfError> {
        crate::sys::raise_memlock_rlimit();
        let set_retval = u8::from(has_set_retval());
        let mut loader = aya::EbpfLoader::new();
        loader
            .override_global(SET_RETVAL, &set_retval, true)
            .map_max_entries(map_names::SERVICES, sizes.services)
            .map_max_entries(map_names::BACKENDS, sizes.backends)
            .map_max_entries(map_names::REV_NAT, sizes.rev_nat)
            // Each family's maps are sized alike, for both families' entries
            // together (the IPv6 ones are allocated per entry).
            .map_max_entries(map_names::SERVICES6, sizes.services)
            .map_max_entries(map_names::BACKENDS6, sizes.backends)
            .map_max_entries(map_names::REV_NAT6, sizes.rev_nat)
            .map_max_entries(map_names::FRONTEND_INFO, sizes.rev_nat)
            .map_max_entries(map_names::FRONTEND_STATS, sizes.rev_nat);
        for map in &STATE_MAPS {
            loader.map_max_entries(map.name, state.entries(map.name));
        }
        let pinned = root.map(Pinned::open).transpose().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not read the previous agent's map layouts; starting afresh");
            None
        });
        let adopting = matches!(ids, KeptIds::Adopted);
        if let (true, Some(pinned)) = (adopting, &pinned) {
            adopt::reuse(pinned, &mut loader);
        }
        let mut carried = Vec::new();
        let mut conversions = Vec::new();
        for map in &STATE_MAPS {
            let Some(pinned) = &pinned else { break };
            let carry = pinned.carry(map, state.entries(map.name));
            if let Some(conversion) = carry_over(pinned, map, carry, &mut loader) {
                conversions.push(conversion);
            }
            carried.push((map.name, carry));
        }
        if pinned.as_ref().is_some_and(|p| p.layouts().is_some()) {
            let carry = if adopting { Carry::Reuse } else { Carry::Rebuilt };
            carried.extend(adopt::names().map(|name| (name, carry)));
        }
        // The kernel's types, for its kfuncs (absent: none is called).
        let kernel_btf = aya::Btf::from_sys_fs().ok();
        let mut ebpf = loader.load(&sock_end::resolve_kfunc(OBJECT, kernel_btf.as_ref()))?;
        let mut maps = Maps::take(&mut ebpf)?;
        let mut state = Reconciler::with_capacity(sizes);
        let service_maps = match adopting {
            true => ServiceMaps::Adopted,
            false => ServiceMaps::Made,
        };
        match ids {
            // Read back on a thread of their own (`adopt::Adoption`).
            KeptIds::Adopted => {}
            KeptIds::These(reserved) => state.reserve(reserved),
            KeptIds::Pinned => {
                if let Some(reserved) = pinned.as_ref().and_then(previous_ids) {
                    state.reserve(reserved);
                }
            }
        }
        for conversion in &conversions {
            let name = conversion.map.name;
            let copied = conversion
                .copy_into(maps.state_map(name), false)
                .map_err(|source| EbpfError::Map { name, source })?;
            tracing::info!(map = name, entries = copied, "converted the previous agent's entries");
        }
        let tc_interfaces = BTreeMap::new();
        Ok(Self {
            ebpf,
            maps,
            reconciler: state,
            tc_mode,
            tc_interfaces,
            carried,
            conversions,
            socket_ending: SocketEnding::Unavailable,
            records: None,
            socket_protocols: Vec::new(),
            flow_counts: FlowCounts::default(),
            flow_counts6: FlowCounts::default(),
            flow_growth: Growth::new(),
            held6: 0,
            on_demand: Stages::default(),
            xdp_interfaces: BTreeMap::new(),
            xdp6: None,
            service_maps,
        })
    }

    /// Loads the programs (the verifier runs), the IPv6 ones included, and
    /// points `TC6` at them: what a test or an inspection loads.
    pub fn verify(&mut self) -> Result<(), EbpfError> {
        let (names, heaviest) = base_programs();
        verify(&mut self.ebpf, &names, &heaviest)?;
        self.maps.fill_tc_new(&mut self.ebpf)?;
        self.load_group(Group::Ipv6)?;
        self.on_demand.set(Group::Ipv6, Stage::Serving);
        Ok(())
    }

    /// The agent's load: the programs verified on other threads while
    /// this one brings the maps to `plan` ([`Self::sync`]), so that at a
    /// first sync of many services the verifier's seconds no longer come
    /// before the writes; the IPv6 ones beside them when `plan` has an IPv6
    /// frontend (see [`super::on_demand`]), the SCTP ones after.
    pub fn verify_while_syncing(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> Result<Result<SyncReport, SyncError>, EbpfError> {
        let ipv6 = self.on_demand.of(Group::Ipv6) == Stage::NotNeeded
            && Group::Ipv6.wanted(&plan.frontends, None);
        let (names, heaviest) = base_programs();
        let names6 = if ipv6 { Group::Ipv6.programs() } else { &[] };
        let started = std::time::Instant::now();
        let (ebpf, state, maps) = (&mut self.ebpf, &mut self.reconciler, &mut self.maps);
        let [base, tc6] = pick(ebpf, [&names[..], names6])?;
        let (verified, verified6, synced) = std::thread::scope(|scope| {
            let verifying = scope.spawn(|| verify_set(base, &heaviest));
            let verifying6 = ipv6.then(|| scope.spawn(|| verify_set(tc6, &Group::Ipv6.heaviest())));
            let synced = state.sync(plan, dirty, maps);
            let join = |thread: std::thread::ScopedJoinHandle<'_, Result<(), EbpfError>>| {
                thread.join().unwrap_or(Err(EbpfError::VerifierThread))
            };
            (join(verifying), verifying6.map_or(Ok(()), join), synced)
        });
        match self.service_maps {
            // Serving maps: affinity entries naming backends the sync took
            // away go, as at any sync.
            ServiceMaps::Adopted => self.purge_owed(),
            // Before serving: see `sync_unserved`.
            ServiceMaps::Made => drop(self.reconciler.take_affinity_purge()),
        }
        verified?;
        self.maps.fill_tc_new(&mut self.ebpf)?;
        if ipv6 {
            let loaded = verified6.and_then(|()| self.fill_group(Group::Ipv6));
            self.record_load(Group::Ipv6, loaded, started);
        }
        // Before the programs serve (the caller attaches them next).
        self.serve_on_demand(plan, None);
        Ok(synced)
    }

    /// What became of each state map of the previous agent.
    pub fn carried(&self) -> &[(&'static str, Carry)] {
        &self.carried
    }

    /// Writes the datapath settings (before the programs see traffic), and
    /// the maps' layouts for the next agent.
    pub fn configure(&mut self, config: &Config) -> Result<(), EbpfError> {
        self.reconciler.set_maglev_table_size(config.maglev_table_size);
        let name = map_names::CONFIG;
        let err = |source| EbpfError::Map { name, source };
        Array::<_, Config>::try_from(&mut self.maps.config)
            .map_err(err)?
            .set(0, config, 0)
            .map_err(err)?;
        let name = map_names::LAYOUT;
        let err = |source| EbpfError::Map { name, source };
        Array::<_, Layouts>::try_from(&mut self.maps.layout)
            .map_err(err)?
            .set(0, Layouts::CURRENT, 0)
            .map_err(err)
    }

    /// The ring buffer of the programs' decision records (once).
    pub fn take_records(&mut self) -> Result<RingBuf<MapData>, EbpfError> {
        let name = map_names::RECORDS;
        let map = self.ebpf.take_map(name).ok_or(EbpfError::Missing { what: "map", name })?;
        RingBuf::try_from(map).map_err(|source| EbpfError::Map { name, source })
    }

    /// Keeps the task reading the records: it stops when these programs go.
    pub fn keep_records_reader(&mut self, reader: records::Reader) {
        self.records = Some(reader);
    }
}

/// The ids the previous agent pinned under `pinned` gave, logged.
fn previous_ids(pinned: &Pinned) -> Option<carry::Reserved> {
    let started = std::time::Instant::now();
    match pinned.reserved() {
        Ok(reserved) => {
            let (frontends, backends) = (reserved.frontends.len(), reserved.backends.len());
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            tracing::info!(frontends, backends, ms, "the previous agent's ids kept");
            Some(reserved)
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read the previous agent's ids; frontends and backends get new ones");
            None
        }
    }
}

/// Prepares carrying `map` over as `carry` says: the loader reuses the
/// pinned map, or a conversion reads it.
pub(super) fn carry_over(
    pinned: &Pinned,
    map: &'static carry::StateMap,
    carry: Carry,
    loader: &mut aya::EbpfLoader<'_>,
) -> Option<Conversion> {
    let name = map.name;
    match carry {
        // (`Rebuilt` is a service map's, never a state map's.)
        Carry::Nothing | Carry::Rebuilt => None,
        Carry::Reuse => {
            tracing::info!(map = name, "carrying the previous agent's map over");
            loader.map_pin_path(name, pinned.path(name));
            None
        }
        Carry::Convert { from } => match Conversion::open(pinned, map, from) {
            Ok(conversion) => Some(conversion),
            Err(e) => {
                tracing::warn!(map = name, error = %e, "could not open the previous map; its entries are lost");
                None
            }
        },
        Carry::Reset { version } => {
            tracing::warn!(
                map = name,
                version,
                ours = ?Layouts::CURRENT,
                "the previous agent's map has a layout this build cannot read; its entries are lost"
            );
            None
        }
    }
}
