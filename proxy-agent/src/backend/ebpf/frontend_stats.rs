//! Reads the pinned per-frontend counters (`FRONTEND_STATS`) with their
//! frontends' names (`FRONTEND_INFO`), for [`crate::service_stats`]; and
//! deletes an id's counters with the id.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use aya::maps::{HashMap, Map, MapData, MapError, PerCpuHashMap};
use proxy_common::{FrontendInfo, FrontendStats, map_names};

use super::EbpfError;
use crate::service_stats::{Coverage, Snapshot, Source};

/// The counters of the datapath pinned under a root.
pub struct Pinned(pub PathBuf);

impl Source for Pinned {
    fn read(&mut self) -> anyhow::Result<Snapshot> {
        Ok(read(&self.0)?)
    }

    fn coverage(&self) -> Coverage {
        Coverage::Everything
    }

    /// A lookup per frontend with traffic: cheap enough for every scrape.
    fn min_interval(&self) -> Duration {
        Duration::ZERO
    }
}

fn open(root: &Path, name: &'static str) -> Result<MapData, EbpfError> {
    MapData::from_pin(root.join("maps").join(name))
        .map_err(|source| EbpfError::Map { name, source })
}

/// Every frontend's counters summed over CPUs, from the maps pinned under
/// `root`: one lookup per frontend that saw traffic.
pub fn read(root: &Path) -> Result<Snapshot, EbpfError> {
    let name = map_names::FRONTEND_STATS;
    let err = |source| EbpfError::Map { name, source };
    let data = open(root, name)?;
    let map_id = data.info().map_err(err)?.id();
    let stats =
        PerCpuHashMap::<_, u32, FrontendStats>::try_from(Map::from_map_data(data).map_err(err)?)
            .map_err(err)?;
    let info_err = |source| EbpfError::Map { name: map_names::FRONTEND_INFO, source };
    let infos = HashMap::<_, u32, FrontendInfo>::try_from(
        Map::from_map_data(open(root, map_names::FRONTEND_INFO)?).map_err(info_err)?,
    )
    .map_err(info_err)?;
    let mut frontends = Vec::new();
    for entry in stats.iter() {
        let (id, per_cpu) = match entry {
            Ok(entry) => entry,
            // Deleted while we iterated: the next read sees it gone.
            Err(MapError::KeyNotFound) => continue,
            Err(source) => return Err(err(source)),
        };
        let mut sum = FrontendStats::default();
        per_cpu.iter().for_each(|cpu| sum.add(cpu));
        let name = infos.get(&id, 0).ok().map(|info| info.name().to_string());
        frontends.push((id, name, sum));
    }
    Ok(Snapshot { map_id, frontends })
}

/// Deletes `id`'s counters (absent: it saw no traffic).
pub fn remove(map: &mut Map, id: u32) -> Result<(), MapError> {
    // The kernel answers a missing key with ENOENT (aya passes it on as a
    // failed syscall, not `KeyNotFound`).
    match PerCpuHashMap::<_, u32, FrontendStats>::try_from(map)?.remove(&id) {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}
