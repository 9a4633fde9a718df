//! The driver hook (`--bpf-lb-acceleration`): `xdp_ingress` on the
//! interfaces holding node addresses, by pinned XDP links a restart takes
//! over in place (one XDP program per interface: the next agent's replaces
//! this one's in the link, atomically), and `XDP_EGRESS`, the interfaces XDP
//! may send packets on.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    path::{Path, PathBuf},
};

use aya::{
    maps::{DevMapHash, Map, ProgramArray},
    programs::{
        Xdp,
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpMode},
    },
};

use proxy_common::map_names;

use super::{BpfObject, EbpfError, pin_replacing, program, settings::Acceleration};

/// The XDP programs, by their function names in proxy-ebpf.
pub const XDP_INGRESS: &str = "xdp_ingress";
pub const XDP_INGRESS6: &str = "xdp_ingress6";
/// The map of the interfaces XDP sends packets on.
pub(super) const XDP_EGRESS: &str = "XDP_EGRESS";

/// An interface's XDP link pin under `root`.
fn pin_path(root: &Path, interface: &str) -> PathBuf {
    root.join("links").join(format!("xdp-{interface}"))
}

/// Where the program went on an interface.
enum Outcome {
    /// Attached and pinned at this path.
    Pinned(PathBuf),
    /// Attached by netlink (a kernel without XDP links, before 5.9): held
    /// by the kernel, not pinned.
    Held,
}

impl BpfObject {
    /// Runs `xdp_ingress` on `wanted` (node interfaces) as `acceleration`
    /// says, and on no other interface; returns the pins that hold it.
    /// `native`: an interface whose driver cannot is an error, and the
    /// interfaces this call attached are detached again (all or none);
    /// `best-effort`: it is logged and left to tc.
    pub(super) fn set_xdp_interfaces(
        &mut self,
        root: &Path,
        wanted: &BTreeSet<String>,
        acceleration: Acceleration,
    ) -> Result<Vec<PathBuf>, EbpfError> {
        let wanted = match acceleration {
            Acceleration::Disabled => &BTreeSet::new(),
            _ => wanted,
        };
        let stale: Vec<String> =
            self.xdp_interfaces.keys().filter(|i| !wanted.contains(*i)).cloned().collect();
        for interface in stale {
            self.detach_xdp(root, &interface);
        }
        let mut pinned: Vec<PathBuf> =
            self.xdp_interfaces.keys().map(|i| pin_path(root, i)).collect();
        let new: Vec<&String> =
            wanted.iter().filter(|i| !self.xdp_interfaces.contains_key(*i)).collect();
        let mut attached = Vec::new();
        for interface in new {
            match self.attach_xdp(root, interface) {
                Ok((ifindex, outcome)) => {
                    self.xdp_interfaces.insert(interface.clone(), ifindex);
                    attached.push(interface);
                    if let Outcome::Pinned(path) = outcome {
                        pinned.push(path);
                    }
                    tracing::info!(%interface, "XDP program attached (driver mode): external flows made and forwarded at the driver hook");
                }
                Err(e) if acceleration == Acceleration::Native => {
                    for done in attached {
                        self.detach_xdp(root, done);
                    }
                    return Err(EbpfError::Xdp {
                        interface: interface.clone(),
                        source: Box::new(e),
                    });
                }
                Err(e) => {
                    tracing::warn!(%interface, error = %e, "XDP cannot run on this interface in driver mode (--bpf-lb-acceleration best-effort): tc alone serves it")
                }
            }
        }
        Ok(pinned)
    }

    /// Loads (verifies) the XDP programs, once: `xdp_ingress`, and
    /// `xdp_ingress6` in `XDP6`, where the first hands IPv6 packets on. A
    /// kernel that refuses the IPv6 one gets XDP for IPv4 (IPv6 packets go
    /// up to tc, as without XDP), said in the log.
    pub fn load_xdp(&mut self) -> Result<(), EbpfError> {
        if self.xdp6.is_some() {
            return Ok(());
        }
        load(&mut self.ebpf, XDP_INGRESS)?;
        let name = map_names::XDP6;
        let mut map = self.ebpf.take_map(name).ok_or(EbpfError::Missing { what: "map", name })?;
        if let Err(e) = fill_xdp6(&mut self.ebpf, &mut map) {
            let e = e.to_string();
            let e = e.lines().next().unwrap_or_default();
            tracing::warn!(
                error = e,
                "the IPv6 XDP program does not load on this kernel: IPv6 packets go up to tc"
            );
        }
        self.xdp6 = Some(map);
        Ok(())
    }

    /// `XDP6`, once loaded: pinned with the maps, so that the pinned XDP
    /// links keep their IPv6 program while no agent runs.
    pub(super) fn xdp6(&self) -> Option<&Map> {
        self.xdp6.as_ref()
    }

    /// Interfaces running the XDP program.
    pub fn xdp_interfaces(&self) -> impl Iterator<Item = &str> {
        self.xdp_interfaces.keys().map(String::as_str)
    }

    /// Loads the program (once), names `interface` in `XDP_EGRESS`, then
    /// attaches: in a previous agent's pinned link (its program replaced in
    /// place), else in a new one.
    fn attach_xdp(&mut self, root: &Path, interface: &str) -> Result<(u32, Outcome), EbpfError> {
        let name = XDP_INGRESS;
        let err = |source| EbpfError::Program { name, source };
        let ifindex = crate::sys::ifindex(interface).map_err(|source| EbpfError::Io {
            action: "finding",
            path: interface.into(),
            source,
        })?;
        // Before the program runs there: it sends only where this says.
        self.egress_map()?.insert(ifindex, ifindex, None, 0)?;
        self.load_xdp()?;
        let prog: &mut Xdp = program(&mut self.ebpf, name)?;
        let path = pin_path(root, interface);
        let previous = PinnedLink::from_pin(&path)
            .ok()
            .and_then(|pinned| XdpLink::try_from(FdLink::from(pinned)).ok());
        let id = match previous {
            Some(link) => prog.attach_to_link(link).map_err(err)?,
            None => prog.attach(interface, XdpMode::Driver).map_err(err)?,
        };
        let link = prog.take_link(id).map_err(err)?;
        match FdLink::try_from(link) {
            Ok(link) => {
                let path = pin_replacing(&path, |p| link.pin(p).map(drop))?;
                Ok((ifindex, Outcome::Pinned(path)))
            }
            Err(_) => Ok((ifindex, Outcome::Held)),
        }
    }

    /// Takes the program off `interface` (its pin; a netlink attachment by
    /// its link's owner, gone already) and out of `XDP_EGRESS`.
    fn detach_xdp(&mut self, root: &Path, interface: &str) {
        let Some(ifindex) = self.xdp_interfaces.remove(interface) else { return };
        let path = pin_path(root, interface);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(%interface, error = %e, "could not unpin the XDP link"),
        }
        if let Ok(mut map) = self.egress_map() {
            let _ = map.remove(ifindex);
        }
        tracing::info!(%interface, "XDP program detached");
    }

    fn egress_map(&mut self) -> Result<DevMapHash<&mut aya::maps::MapData>, EbpfError> {
        let name = XDP_EGRESS;
        let map = self.ebpf.map_mut(name).ok_or(EbpfError::Missing { what: "map", name })?;
        DevMapHash::try_from(map).map_err(|source| EbpfError::Map { name, source })
    }
}

/// Loads `xdp_ingress6` and puts it in `XDP6` (`map`, the object's), where
/// `xdp_ingress` hands IPv6 packets on.
pub(super) fn fill_xdp6(ebpf: &mut aya::Ebpf, map: &mut Map) -> Result<(), EbpfError> {
    load(ebpf, XDP_INGRESS6)?;
    let name = map_names::XDP6;
    let mut array =
        ProgramArray::try_from(map).map_err(|source| EbpfError::Map { name, source })?;
    let prog: &Xdp = program(ebpf, XDP_INGRESS6)?;
    let fd = prog.fd().map_err(|source| EbpfError::Program { name: XDP_INGRESS6, source })?;
    array.set(0, fd, 0).map_err(|source| EbpfError::Map { name, source })
}

/// Loads the XDP program `name`, once.
fn load(ebpf: &mut aya::Ebpf, name: &'static str) -> Result<(), EbpfError> {
    let prog: &mut Xdp = program(ebpf, name)?;
    if prog.fd().is_err() {
        prog.load().map_err(|source| EbpfError::Program { name, source })?;
    }
    Ok(())
}

/// The interfaces whose XDP links are pinned under `root` (what `lb list`
/// says runs XDP).
pub fn xdp_pinned(root: &Path) -> Vec<String> {
    let Ok(links) = std::fs::read_dir(root.join("links")) else { return Vec::new() };
    let mut names: Vec<String> = links
        .filter_map(|l| l.ok()?.file_name().to_str()?.strip_prefix("xdp-").map(str::to_string))
        .filter(|name| !name.ends_with("~new"))
        .collect();
    names.sort();
    names
}

/// The node interfaces of `facing` (what XDP accelerates).
pub fn node_interfaces(facing: &BTreeMap<String, crate::node::Facing>) -> BTreeSet<String> {
    facing
        .iter()
        .filter(|(_, f)| **f == crate::node::Facing::Node)
        .map(|(name, _)| name.clone())
        .collect()
}
