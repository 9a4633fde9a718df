//! Pins and take-over: the maps and links pinned under the bpffs root in
//! place of a previous agent's, what is finished once they serve, and the
//! removal of pins.

use std::{
    collections::BTreeSet,
    fs::File,
    io,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, Map, MapData},
    programs::{
        CgroupAttachMode, CgroupSockAddr,
        links::{FdLink, PinnedLink},
        loaded_programs,
    },
};
use proxy_common::{Config, map_names};

use super::{
    BpfObject, EbpfError, attach::Interfaces, departures::Departures, io_err, pin_replacing,
    program, programs::PROGRAMS, reconciler::AffinityPurge, remove_tc_filters, xdp::XDP_EGRESS,
};

impl BpfObject {
    /// Attaches the per-packet programs to `interfaces` (XDP's first, then
    /// tc's) and the socket programs to `cgroup`, and pins maps and links
    /// under `root`, replacing what a previous agent pinned there.
    pub fn activate(
        &mut self,
        cgroup: &Path,
        interfaces: &Interfaces,
        root: &Path,
    ) -> Result<(), EbpfError> {
        let cgroup_dir = File::open(cgroup).map_err(io_err("opening cgroup", cgroup))?;
        let (maps_dir, links_dir) = (root.join("maps"), root.join("links"));
        for dir in [&maps_dir, &links_dir] {
            crate::sys::private_dir(dir).map_err(io_err("creating", dir))?;
        }
        // XDP first: `native` refuses an interface whose driver cannot before
        // anything else is attached, so a refused take-over leaves the
        // previous datapath serving as it was (XDP then hands packets up
        // to the tc programs there, the previous agent's until ours follow).
        let mut pinned = BTreeSet::new();
        pinned.extend(self.set_xdp_interfaces(root, &interfaces.xdp, interfaces.acceleration)?);
        let mut links = Vec::new();
        for name in PROGRAMS {
            let prog: &mut CgroupSockAddr = program(&mut self.ebpf, name)?;
            let err = |source| EbpfError::Program { name, source };
            // A bpf_link attachment always runs beside other links (the
            // kernel refuses the ALLOW_MULTI flag on links), so a previous
            // agent's programs serve until they are retired below.
            let id = prog.attach(&cgroup_dir, CgroupAttachMode::Single).map_err(err)?;
            let link = prog.take_link(id).map_err(err)?;
            let link = FdLink::try_from(link).map_err(|source| EbpfError::Link { name, source })?;
            links.push((name, link));
        }
        self.mark_flows()?;
        let mut tc_links = Vec::new();
        for (interface, &role) in &interfaces.tc {
            // One interface that will not take the program (gone already, an
            // odd device) must not keep the others unserved: the periodic
            // scan tries it again.
            match self.attach_tc(interface, role) {
                Ok(links) => tc_links.push((interface.clone(), role, links)),
                Err(e) => tracing::warn!(%interface, error = %e, "could not attach; will retry"),
            }
        }
        // Each pin is replaced in one step and the previous agent's other
        // pins go last, so a crash at any point leaves every program
        // attached, by the old pins or the new ones.
        for (name, map) in self.maps.by_name() {
            pinned.insert(pin_replacing(&maps_dir.join(name), |p| map.pin(p))?);
        }
        // For `explain`'s runs of the XDP program: where it may send.
        if let Some(map) = self.ebpf.map(XDP_EGRESS) {
            pinned.insert(pin_replacing(&maps_dir.join(XDP_EGRESS), |p| map.pin(p))?);
        }
        if let Some(array) = self.xdp6() {
            let path = maps_dir.join(map_names::XDP6);
            pinned.insert(pin_replacing(&path, |p| array.pin(p))?);
        }
        for (name, link) in links {
            // The pin keeps the attachment; our fd closes when this drops.
            pinned.insert(pin_replacing(&links_dir.join(name), |p| link.pin(p).map(drop))?);
        }
        for (interface, role, links) in tc_links {
            pinned.extend(self.keep_tc(root, &interface, role, links)?);
        }
        remove_pins_except(root, &pinned)?;
        self.finish_takeover();
        Ok(())
    }

    /// Once the old programs are gone: the entries they made since the
    /// conversion, then what the previous agent named and this one does not
    /// serve (UDP flows to such backends go, as at any endpoint removal;
    /// affinity entries of such frontends too).
    pub(super) fn finish_takeover(&mut self) {
        for conversion in std::mem::take(&mut self.conversions) {
            let name = conversion.map.name;
            match conversion.copy_into(self.maps.state_map(name), true) {
                Ok(0) => {}
                Ok(entries) => tracing::info!(
                    map = name,
                    entries,
                    "converted entries made during the takeover"
                ),
                Err(e) => {
                    tracing::warn!(map = name, error = %e, "could not convert the entries made during the takeover")
                }
            }
        }
        // Flows the old programs made since `activate` looked.
        if let Err(e) = self.mark_flows() {
            tracing::warn!(error = %e, "could not mark the flows made during the takeover in the pre-filter");
        }
        let released = self.reconciler.release_reserved();
        let departures = Departures::gone(released.backends);
        match self.flush_departed_flows(&departures) {
            Ok(0) => {}
            Ok(flushed) => tracing::info!(
                flushed,
                "UDP/SCTP flows to endpoints removed while no agent ran deleted"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "could not flush UDP/SCTP flows to removed endpoints")
            }
        }
        match self.end_sockets(&departures) {
            Ok(0) => {}
            Ok(ended) => {
                tracing::info!(
                    ended,
                    "sockets connected to endpoints removed while no agent ran ended"
                )
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not end sockets connected to removed endpoints")
            }
        }
        let purge: AffinityPurge =
            released.rev_nat_ids.into_iter().map(|id| (id, BTreeSet::new())).collect();
        if !purge.is_empty()
            && let Err(e) = self.purge_affinity(&purge)
        {
            tracing::warn!(error = %e, "could not purge the affinity entries of removed services");
        }
    }
}

/// Sets the programs' decision-record level (`Config::log_level`) in the
/// `CONFIG` map pinned under `root`: effective at the next packet, no
/// reload. Returns the previous level's word.
pub fn set_pinned_log_level(root: &Path, word: u8) -> Result<u8, EbpfError> {
    let name = map_names::CONFIG;
    let err = |source| EbpfError::Map { name, source };
    let data = MapData::from_pin(root.join("maps").join(name)).map_err(err)?;
    let mut config =
        Array::<_, Config>::try_from(Map::from_map_data(data).map_err(err)?).map_err(err)?;
    let mut value = config.get(&0, 0).map_err(err)?;
    let previous = std::mem::replace(&mut value.log_level, word);
    config.set(0, value, 0).map_err(err)?;
    Ok(previous)
}

/// The name of the program a pinned link runs.
pub fn pinned_program(pin: &Path) -> Option<String> {
    let info = FdLink::from(PinnedLink::from_pin(pin).ok()?).info().ok()?;
    let program = loaded_programs().filter_map(Result::ok).find(|p| p.id() == info.program_id());
    program?.name_as_str().map(str::to_string)
}

/// Whether an agent's maps are pinned under `root`: its datapath serves.
pub fn pinned(root: &Path) -> bool {
    std::fs::read_dir(root.join("maps")).is_ok_and(|mut pins| pins.next().is_some())
}

/// Removes the eBPF mode's pins under `root` (and the directory) and its
/// clsact filters in the caller's network namespace; returns how many of
/// each.
pub fn cleanup(root: &Path) -> Result<(usize, usize), EbpfError> {
    let removed = remove_pins(root)?;
    match std::fs::remove_dir(root) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("removing", root)(e)),
        _ => {}
    }
    Ok((removed, remove_tc_filters()))
}

/// Removes the pins under `root`: unpinning a link detaches its program
/// (once no process holds it), unpinning a map frees it once no program
/// uses it. Returns how many pins were removed.
pub fn remove_pins(root: &Path) -> Result<usize, EbpfError> {
    let removed = remove_pins_except(root, &BTreeSet::new())?;
    for dir in [root.join("links"), root.join("maps")] {
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(io_err("removing", &dir)(e));
            }
            _ => {}
        }
    }
    Ok(removed)
}

/// Removes the pins under `root` other than `keep`: a previous agent's,
/// and what a crash left staged.
pub(super) fn remove_pins_except(
    root: &Path,
    keep: &BTreeSet<PathBuf>,
) -> Result<usize, EbpfError> {
    let mut removed = 0;
    for dir in [root.join("links"), root.join("maps")] {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("reading", &dir)(e)),
        };
        for entry in entries {
            let path = entry.map_err(io_err("reading", &dir))?.path();
            if !keep.contains(&path) {
                std::fs::remove_file(&path).map_err(io_err("unpinning", &path))?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}
