//! The eBPF mode's side of `monitor`: the `EVENTS` ring buffer and the
//! `MONITOR` deadline that turns emission on, pinned by the agent (or the
//! maps of a datapath loaded here, for tests and benches), and the names
//! the lines take from the pinned maps.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use aya::maps::{Array, Map, MapData, MapError, PerCpuArray, RingBuf};
use proxy_common::{
    FrontendInfo, map_names,
    monitor::{DEADLINE_AHEAD_NS, MonitorEvent},
};

use crate::inspect::maps::{read, read_pinned};

#[derive(Debug, thiserror::Error)]
#[error(
    "the monitor's map {name} (is the eBPF mode running here, with this --bpffs-root?): {source}"
)]
pub struct WatchError {
    name: &'static str,
    source: MapError,
}

impl WatchError {
    /// A datapath's own map, opened a second time.
    pub fn reopening(source: MapError) -> Self {
        WatchError { name: "EVENTS/MONITOR/MONITOR_LOST", source }
    }
}

/// A reader of the events, keeping emission on while it lives.
pub struct Watch {
    ring: RingBuf<MapData>,
    deadline: Array<MapData, u64>,
    lost: PerCpuArray<MapData, u64>,
    lost_at_start: u64,
}

impl Watch {
    /// The maps pinned under `root`.
    pub fn open(root: &Path) -> Result<Self, WatchError> {
        let pin = |name| {
            MapData::from_pin(root.join("maps").join(name))
                .map_err(|source| WatchError { name, source })
        };
        Self::new(pin(map_names::EVENTS)?, pin(map_names::MONITOR)?, pin(map_names::MONITOR_LOST)?)
    }

    /// `EVENTS`, `MONITOR` and `MONITOR_LOST`.
    pub fn new(events: MapData, deadline: MapData, lost: MapData) -> Result<Self, WatchError> {
        let err = |name| move |source| WatchError { name, source };
        let ring = RingBuf::try_from(Map::from_map_data(events).map_err(err(map_names::EVENTS))?)
            .map_err(err(map_names::EVENTS))?;
        let deadline =
            Array::try_from(Map::from_map_data(deadline).map_err(err(map_names::MONITOR))?)
                .map_err(err(map_names::MONITOR))?;
        let lost =
            PerCpuArray::try_from(Map::from_map_data(lost).map_err(err(map_names::MONITOR_LOST))?)
                .map_err(err(map_names::MONITOR_LOST))?;
        let mut watch = Watch { ring, deadline, lost, lost_at_start: 0 };
        watch.lost_at_start = watch.lost_total();
        Ok(watch)
    }

    /// Keeps emission on for [`DEADLINE_AHEAD_NS`] from `now_ns` (the
    /// monotonic clock), never shortening another monitor's deadline.
    pub fn keep_on(&mut self, now_ns: u64) -> Result<(), WatchError> {
        let current = self.deadline.get(&0, 0).unwrap_or(0);
        self.set_deadline(current.max(now_ns + DEADLINE_AHEAD_NS))
    }

    /// Sets the deadline as it is (0: off at once; benches).
    pub fn set_deadline(&mut self, ns: u64) -> Result<(), WatchError> {
        let name = map_names::MONITOR;
        self.deadline.set(0, ns, 0).map_err(|source| WatchError { name, source })
    }

    /// Events lost to a full ring buffer since this watch began.
    pub fn lost(&self) -> u64 {
        self.lost_total().saturating_sub(self.lost_at_start)
    }

    fn lost_total(&self) -> u64 {
        self.lost.get(&0, 0).map_or(0, |per_cpu| per_cpu.iter().sum())
    }
}

/// The events waiting, oldest first.
impl Iterator for Watch {
    type Item = MonitorEvent;

    fn next(&mut self) -> Option<MonitorEvent> {
        loop {
            let item = self.ring.next()?;
            // A short item (none is written) would be a foreign writer's.
            if item.len() >= size_of::<MonitorEvent>() {
                // SAFETY: as many bytes as an event; copied out, as the
                // item borrows the ring.
                return Some(unsafe { item.as_ptr().cast::<MonitorEvent>().read_unaligned() });
            }
        }
    }
}

/// Names of services (from the pinned `FRONTEND_INFO` and service table)
/// and interfaces, cached; read again on a miss, at most once a second.
pub struct PinnedNames {
    root: PathBuf,
    by_id: BTreeMap<u32, String>,
    by_frontend: BTreeMap<String, String>,
    interfaces: BTreeMap<u32, Option<String>>,
    read_at: Option<Instant>,
    clocks: (u64, SystemTime),
}

impl PinnedNames {
    pub fn new(root: &Path) -> Self {
        PinnedNames {
            root: root.to_path_buf(),
            by_id: BTreeMap::new(),
            by_frontend: BTreeMap::new(),
            interfaces: BTreeMap::new(),
            read_at: None,
            clocks: (crate::sys::monotonic_ns(), SystemTime::now()),
        }
    }

    fn reread(&mut self) {
        if self.read_at.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.read_at = Some(Instant::now());
        match read::<u32, FrontendInfo, BTreeMap<_, _>>(&self.root, map_names::FRONTEND_INFO) {
            Ok(infos) => {
                self.by_id = infos.into_iter().map(|(id, i)| (id, i.name().to_string())).collect()
            }
            Err(e) => tracing::warn!(error = %e, "service names unavailable"),
        }
        match read_pinned(&self.root) {
            Ok(entries) => {
                self.by_frontend = entries.into_iter().map(|e| (e.frontend, e.service)).collect()
            }
            Err(e) => tracing::warn!(error = %e, "service table unavailable"),
        }
    }

    fn cached(&self, rev_nat_id: u32, frontend: &str) -> Option<String> {
        self.by_id.get(&rev_nat_id).or_else(|| self.by_frontend.get(frontend)).cloned()
    }
}

impl super::Context for PinnedNames {
    fn service(&mut self, rev_nat_id: u32, frontend: &str) -> Option<String> {
        if let Some(name) = self.cached(rev_nat_id, frontend) {
            return Some(name);
        }
        self.reread();
        self.cached(rev_nat_id, frontend)
    }

    fn interface(&mut self, ifindex: u32) -> Option<String> {
        self.interfaces.entry(ifindex).or_insert_with(|| interface_name(ifindex)).clone()
    }

    fn wall_time(&self, ns: u64) -> SystemTime {
        super::wall_time(ns, self.clocks.0, self.clocks.1)
    }
}

fn interface_name(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has IF_NAMESIZE bytes, as the call needs.
    let name = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: filled with a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}
