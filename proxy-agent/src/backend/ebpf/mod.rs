//! The eBPF mode: loads the programs, attaches the socket-LB ones to a
//! cgroup and the per-packet one to the ingress of node and pod interfaces
//! (TCX), pins maps and links under the bpffs root, keeps the maps in step
//! with the plan, and keeps the conntrack map clean.
//!
//! A plan passes through three layers on its way to the kernel:
//! - [`datapath::EbpfDatapath`], the mode as the agent's loop drives it:
//!   fits the plan into the maps ([`fit`]), grows them, takes over and
//!   looks after the flows;
//! - [`BpfObject`], the loaded programs and their maps: writes the plan
//!   through and purges what it leaves stale;
//! - [`reconciler::Reconciler`], pure: the map writes that take the maps
//!   from what they hold to the plan, in an order that never serves a
//!   half-written frontend, applied by a [`reconciler::MapWriter`] (the
//!   maps themselves, [`maps`]).
//!
//! The object's other concerns each have a module: [`load`]ing the
//! programs, [`attach`]ing them, [`pins`] and take-over, conntrack
//! collection ([`flows`]), ending sockets ([`sock_end`], [`sock_diag`]),
//! [`test_run`]s, the event [`ring`] and [`counters`].
//!
//! Pin layout (`--bpffs-root`, default `/sys/fs/bpf/proxy`):
//! `maps/<MAP>` for every map, `links/<program>` for the cgroup attachments,
//! `links/tc-<interface>` for the TCX ones and `links/xdp-<interface>` for
//! the XDP ones ([`xdp`]), so the datapath keeps serving
//! while the agent restarts and `bpftool` can inspect it (clsact filters
//! live in the kernel on their own). A new agent carries the state maps over
//! ([`carry`]), attaches its programs beside the old ones (or in place of the
//! old filters), then retires the old pins; `cleanup` removes them all.

pub mod adopt;
mod attach;
pub mod batch;
pub mod carry;
pub mod conntrack;
mod counters;
pub mod datapath;
pub mod departures;
pub mod entries;
pub mod explain;
pub mod fit;
pub mod flow_counts;
mod flows;
pub mod frontend_stats;
mod installed;
mod load;
mod maps;
pub mod on_demand;
mod pins;
pub mod pod_programs;
pub mod prefilter;
mod programs;
pub mod reconciler;
pub mod records;
pub mod replies;
pub mod ring;
pub mod settings;
pub mod sock_diag;
pub mod sock_end;
pub mod state_sizes;
mod test_run;
mod xdp;

pub use attach::{TcAttach, remove_tc_filters, tc_attached};
pub use counters::CounterReader;
pub use load::has_set_retval;
pub use pins::{cleanup, pinned, pinned_program, remove_pins, set_pinned_log_level};
pub use programs::{PROGRAMS, TC_EGRESS, TC_INGRESS, TC_POD_REPLIES, TcRole};
pub use reconciler::{AffinityPurge, Reconciler, SyncError, SyncReport};
pub use settings::Settings;
pub use test_run::PacketRun;
pub use xdp::{XDP_INGRESS, XDP_INGRESS6, node_interfaces, xdp_pinned};

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    path::{Path, PathBuf},
};

use aya::{Ebpf, maps::MapError, programs::ProgramError};
use proxy_common::{
    AffinityKey, AffinityKey6, CtKey, CtKey6, Layouts, MAX_BACKENDS, MAX_REV_NAT,
    MAX_SERVICE_ENTRIES, map_names,
};

use carry::{Carry, Conversion};
use flow_counts::{FlowCounts, Growth};
use flows::purge_affinity;
use maps::Maps;
use sock_end::SocketEnding;

use crate::plan::{Frontend, Plan};

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("loading the BPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("adopting the previous agent's service maps: {0}")]
    Adopt(#[from] adopt::AdoptError),
    #[error("BPF object has no {what} {name}")]
    Missing { what: &'static str, name: &'static str },
    #[error("program {name}: {source}")]
    Program { name: &'static str, source: ProgramError },
    #[error("program {name}: its link cannot be pinned (kernel older than 5.7?): {source}")]
    Link { name: &'static str, source: aya::programs::links::LinkError },
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: MapError },
    #[error("{action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: io::Error },
    #[error("pinning {path}: {source}")]
    Pin { path: PathBuf, source: aya::pin::PinError },
    #[error(
        "the pinned maps have the layouts {pinned:?}, this build {:?}: run the running agent's own binary",
        Layouts::CURRENT
    )]
    Layout { pinned: Layouts },
    #[error("the thread loading the programs stopped before it finished")]
    VerifierThread,
    #[error(
        "XDP on {interface} in driver mode (--bpf-lb-acceleration native; best-effort leaves such interfaces to tc)"
    )]
    Xdp { interface: String, source: Box<EbpfError> },
    #[error("map XDP_EGRESS: {0}")]
    XdpMap(#[from] aya::maps::xdp::XdpMapError),
}

/// Pins an object at `path` in place of what is pinned there, in one step:
/// under a staging name first, made private, then renamed over the old pin
/// (bpffs renames like any filesystem). Returns `path`.
fn pin_replacing(
    path: &Path,
    pin: impl FnOnce(&Path) -> Result<(), aya::pin::PinError>,
) -> Result<PathBuf, EbpfError> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // bpffs refuses names with a dot.
    let staged = path.with_file_name(format!("{name}~new"));
    // A crash's leftover would make the pin fail with EEXIST.
    match std::fs::remove_file(&staged) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("unpinning", &staged)(e));
        }
        _ => {}
    }
    pin(&staged).map_err(|source| EbpfError::Pin { path: staged.clone(), source })?;
    crate::sys::private_file(&staged).map_err(io_err("restricting", &staged))?;
    std::fs::rename(&staged, path).map_err(io_err("renaming", &staged))?;
    Ok(path.to_path_buf())
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> EbpfError {
    let path = path.to_path_buf();
    move |source| EbpfError::Io { action, path, source }
}

/// The loaded BPF object: its programs, their maps and attachments.
pub struct BpfObject {
    ebpf: Ebpf,
    maps: Maps,
    reconciler: Reconciler,
    tc_mode: TcAttach,
    /// Interfaces running the per-packet programs, and which (held by pins
    /// or, as filters, by the kernel).
    tc_interfaces: BTreeMap<String, TcRole>,
    /// What became of each state map of the previous agent.
    carried: Vec<(&'static str, Carry)>,
    /// Previous maps whose entries are converted into ours: once more after
    /// the takeover, for the flows the old programs made meanwhile.
    conversions: Vec<Conversion>,
    /// How sockets connected to departed backends are ended, and of which
    /// protocols (see [`BpfObject::choose_socket_ending`]).
    socket_ending: SocketEnding,
    socket_protocols: Vec<u8>,
    /// The task reading these programs' decision records, stopped with them.
    records: Option<records::Reader>,
    /// What each conntrack entry counted at the last read (`flow_counts`).
    flow_counts: FlowCounts<CtKey>,
    flow_counts6: FlowCounts<CtKey6>,
    /// Packets and bytes flows counted since [`BpfObject::take_flow_growth`].
    flow_growth: Growth,
    /// The IPv6 flow entries the last conntrack collection left.
    held6: usize,
    /// The programs loaded on demand, and where each group stands.
    on_demand: on_demand::Stages,
    /// Interfaces running the XDP program, with their index.
    xdp_interfaces: BTreeMap<String, u32>,
    /// `XDP6`, holding `xdp_ingress6`, once the XDP programs are loaded.
    xdp6: Option<aya::maps::Map>,
    /// Whose service maps its programs use.
    service_maps: ServiceMaps,
}

/// Whose service maps an object's programs use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceMaps {
    /// Its own, made with it: nothing serves from them before it does.
    Made,
    /// A previous agent's, adopted ([`adopt`]): its programs serve from
    /// them until these take over, so every write is a serving one.
    Adopted,
}

/// How many entries the service maps hold (`--bpf-lb-map-max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// SERVICES: one entry per frontend plus one per backend slot.
    pub services: u32,
    pub backends: u32,
    /// REV_NAT: one entry per frontend.
    pub rev_nat: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes { services: MAX_SERVICE_ENTRIES, backends: MAX_BACKENDS, rev_nat: MAX_REV_NAT }
    }
}

impl BpfObject {
    /// Brings the maps to `plan` (see [`reconciler`] for the write order), then
    /// drops affinity entries that name backends their service lost.
    /// `dirty`: the frontends that may have changed, `None` for all (see
    /// [`Reconciler::sync`]).
    pub fn sync(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> Result<SyncReport, SyncError> {
        self.serve_on_demand(plan, dirty);
        let result = self.reconciler.sync(plan, dirty, &mut self.maps);
        self.purge_owed();
        result
    }

    /// As [`Self::sync`], before the programs serve: the affinity entries
    /// that name backends a frontend lost are not purged. Those backends
    /// were in this agent's maps only (a partial source's, never served),
    /// and the affinity map may be a previous agent's, serving.
    pub fn sync_unserved(
        &mut self,
        plan: &Plan,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> Result<SyncReport, SyncError> {
        let result = self.reconciler.sync(plan, dirty, &mut self.maps);
        drop(self.reconciler.take_affinity_purge());
        result
    }

    /// From `served` to `target` in syncs that each fit (see
    /// [`Reconciler::sync_in_steps`]).
    pub fn sync_in_steps(&mut self, served: &Plan, target: &Plan) -> Result<SyncReport, SyncError> {
        self.serve_on_demand(target, None);
        let result = self.reconciler.sync_in_steps(served, target, &mut self.maps);
        self.purge_owed();
        result
    }

    /// Drops affinity entries that name backends their service lost; also
    /// after a failed sync, as slots may have changed before the failure.
    fn purge_owed(&mut self) {
        let purge = self.reconciler.take_affinity_purge();
        if !purge.is_empty()
            && let Err(err) = self.purge_affinity(&purge)
        {
            tracing::warn!(error = %err, "could not purge stale affinity entries; will retry");
            self.reconciler.return_affinity_purge(purge);
        }
    }

    fn purge_affinity(&mut self, purge: &AffinityPurge) -> Result<(), EbpfError> {
        let (v4, v6) = (&mut self.maps.affinity, &mut self.maps.affinity6);
        purge_affinity::<AffinityKey>(v4, map_names::AFFINITY, |k| k.rev_nat_id, purge)?;
        purge_affinity::<AffinityKey6>(v6, map_names::AFFINITY6, |k| k.rev_nat_id, purge)
    }

    /// Whether its service maps are a previous agent's, which that
    /// agent's programs serve from (see [`ServiceMaps`]).
    pub fn adopted(&self) -> bool {
        self.service_maps == ServiceMaps::Adopted
    }

    /// Takes what its adopted maps hold, read back: the record, and the
    /// pre-filter's bits for it (before its programs serve).
    pub fn take_adopted(&mut self, read: adopt::ReadBack) -> Result<(), EbpfError> {
        let name = map_names::PREFILTER;
        let err = |source| EbpfError::Map { name, source };
        self.maps.prefilter.set(read.bits).map_err(err)?;
        self.reconciler = read.record;
        Ok(())
    }

    /// What the maps hold, as the reconciler records it.
    pub fn reconciler(&self) -> &Reconciler {
        &self.reconciler
    }
}

/// A program of the object, as its type (`CgroupSockAddr`, `SchedClassifier`).
fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, EbpfError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(EbpfError::Missing { what: "program", name })?
        .try_into()
        .map_err(|source| EbpfError::Program { name, source })
}
