//! The programs' event counters, read from their pinned map for the
//! metrics.

use std::path::Path;

use aya::maps::{Map, MapData, PerCpuArray};
use proxy_common::{Counter, map_names};

use super::EbpfError;
use crate::metrics::DatapathCounters;

/// A handle of its own on the pinned counters map, so readers (the metrics
/// endpoint) need nothing from the sync loop.
pub struct CounterReader(PerCpuArray<MapData, u64>);

impl CounterReader {
    pub fn open(root: &Path) -> Result<Self, EbpfError> {
        let name = map_names::COUNTERS;
        let err = |source| EbpfError::Map { name, source };
        let data = MapData::from_pin(root.join("maps").join(name)).map_err(err)?;
        let map = Map::from_map_data(data).map_err(err)?;
        Ok(Self(PerCpuArray::try_from(map).map_err(err)?))
    }
}

impl DatapathCounters for CounterReader {
    fn read(&self) -> Vec<(Counter, u64)> {
        Counter::ALL
            .iter()
            .map(|c| (*c, self.0.get(&(*c as u32), 0).map_or(0, |v| v.iter().sum())))
            .collect()
    }
}

impl super::BpfObject {
    /// This load's event counter `counter`, summed over the CPUs (tests
    /// that run the programs on crafted packets).
    pub fn counter(&self, counter: Counter) -> Result<u64, EbpfError> {
        let name = map_names::COUNTERS;
        let err = |source| EbpfError::Map { name, source };
        let map = PerCpuArray::<_, u64>::try_from(&self.maps.counters).map_err(err)?;
        Ok(map.get(&(counter as u32), 0).map_err(err)?.iter().sum())
    }
}
