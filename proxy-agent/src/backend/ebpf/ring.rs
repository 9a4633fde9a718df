//! The reader of the programs' events: the `EVENTS` ring buffer and the
//! `MONITOR` deadline that turns emission on, pinned by the agent (or the
//! maps of a datapath loaded here, for tests and benches).

use std::path::Path;

use aya::maps::{Array, Map, MapData, MapError, PerCpuArray, RingBuf};

use super::BpfObject;
use proxy_common::{
    map_names,
    monitor::{DEADLINE_AHEAD_NS, MonitorEvent},
};

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
            if let Some(event) = read_item(&item) {
                return Some(event);
            }
        }
    }
}

/// A ring buffer item as the programs wrote it, copied out (the item
/// borrows the ring); none if it is short (none is written: a foreign
/// writer's).
pub fn read_item<T: aya::Pod>(item: &[u8]) -> Option<T> {
    // SAFETY: at least as many bytes as a `T`, which any bytes are (`Pod`).
    (item.len() >= size_of::<T>()).then(|| unsafe { item.as_ptr().cast::<T>().read_unaligned() })
}

impl BpfObject {
    /// A monitor of these programs' events (`proxy-agent monitor` reads the
    /// pinned maps; this serves tests and benches of a datapath loaded here).
    pub fn watch(&self) -> Result<Watch, WatchError> {
        let [events, deadline, lost] = &self.maps.monitor;
        Watch::new(reopen(events)?, reopen(deadline)?, reopen(lost)?)
    }
}

/// A second handle on one of the monitor's maps (by id: aya's `Map` lends
/// no `MapData`).
fn reopen(map: &Map) -> Result<MapData, WatchError> {
    let data = match map {
        Map::RingBuf(data) | Map::Array(data) | Map::PerCpuArray(data) => data,
        // Not one of the monitor's maps (they are of these types).
        _ => {
            let wrong = MapError::InvalidMapType { map_type: u32::MAX };
            return Err(WatchError::reopening(wrong));
        }
    };
    let id = data.info().map_err(WatchError::reopening)?.id();
    MapData::from_id(id).map_err(WatchError::reopening)
}
