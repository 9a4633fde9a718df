//! Attaching the per-packet programs to interfaces (TCX links or clsact
//! filters), by the role each interface plays.

use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        Link, LinkOrder, SchedClassifier, TcAttachType,
        links::FdLink,
        tc::{
            NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle, qdisc_add_clsact,
            qdisc_detach_program,
        },
    },
    util::KernelVersion,
};

use super::{
    BpfObject, EbpfError, pin_replacing, pinned_program, program,
    programs::{TC_PROGRAMS, TcHook, TcRole},
};
use crate::netlink;

/// How the per-packet program is attached to an interface's ingress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcAttach {
    /// A TCX link (kernel 6.6+), pinned: it outlives the agent and runs
    /// beside other programs.
    Tcx,
    /// A classic clsact filter (any kernel with clsact), at a priority and
    /// handle of its own: it lives in the kernel, serving while no agent
    /// runs; the next agent replaces its program in place.
    Netlink,
}

/// Our clsact filters' place on each hook: the next agent finds and replaces
/// them there, atomically (no packet meets a hook without the program).
pub(super) const FILTER_PRIORITY: u16 = 1;
pub(super) const FILTER_HANDLE: TcHandle = TcHandle::new(0, 0x7078);

impl TcAttach {
    /// TCX where the kernel has it, clsact filters elsewhere.
    pub fn for_this_kernel() -> Self {
        match KernelVersion::current() {
            Ok(v) if v >= KernelVersion::new(6, 6, 0) => TcAttach::Tcx,
            _ => TcAttach::Netlink,
        }
    }
}

impl BpfObject {
    /// Attaches the per-packet programs of `role` to `interface`.
    pub(super) fn attach_tc(
        &mut self,
        interface: &str,
        role: TcRole,
    ) -> Result<Vec<Attached>, EbpfError> {
        let tc_mode = self.tc_mode;
        let mut attached = Vec::new();
        for &(name, hook, prefix) in role.hooks() {
            let err = |source| EbpfError::Program { name, source };
            let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
            let link = match tc_mode {
                TcAttach::Tcx => {
                    let options = TcAttachOptions::TcxOrder(LinkOrder::default());
                    let id = prog.attach_with_options(interface, hook, options).map_err(err)?;
                    let link = prog.take_link(id).map_err(err)?;
                    let link = FdLink::try_from(link)
                        .map_err(|source| EbpfError::Link { name, source })?;
                    Attached::Tcx(link, prefix)
                }
                TcAttach::Netlink => {
                    let ours = |priority, handle| {
                        SchedClassifierLink::attached(interface, hook, priority, handle, None)
                    };
                    // A previous agent's filter: its program is replaced in
                    // place, so no packet meets the hook without one.
                    let id = match ours(FILTER_PRIORITY, FILTER_HANDLE) {
                        Ok(link) => prog.attach_to_link(link).ok(),
                        Err(_) => None,
                    };
                    let id = match id {
                        Some(id) => id,
                        None => {
                            // Present already on most interfaces; a real
                            // failure shows in the attach below.
                            let _ = qdisc_add_clsact(interface);
                            // Filters of releases that let the kernel choose
                            // their place are not replaceable: they go.
                            let _ = qdisc_detach_program(interface, hook, name);
                            let options = TcAttachOptions::Netlink(NlOptions {
                                priority: FILTER_PRIORITY,
                                handle: FILTER_HANDLE,
                                ..NlOptions::default()
                            });
                            prog.attach_with_options(interface, hook, options).map_err(err)?
                        }
                    };
                    Attached::Filter(prog.take_link(id).map_err(err)?)
                }
            };
            attached.push(link);
        }
        Ok(attached)
    }

    /// Keeps new attachments of `role`: pins TCX links, leaves filters to
    /// the kernel; and empties the hook the role leaves unused (a previous
    /// role's, or a previous agent's).
    pub(super) fn keep_tc(
        &mut self,
        root: &Path,
        interface: &str,
        role: TcRole,
        links: Vec<Attached>,
    ) -> Result<Vec<PathBuf>, EbpfError> {
        let mut pinned = Vec::new();
        for link in links {
            match link {
                Attached::Tcx(link, prefix) => {
                    let path = root.join("links").join(format!("{prefix}-{interface}"));
                    pinned.push(pin_replacing(&path, |p| link.pin(p).map(drop))?);
                }
                // Dropping the handle would remove the filter; it holds no
                // fd, so forgetting it leaks nothing.
                Attached::Filter(link) => std::mem::forget(link),
            }
        }
        for hook in role.unused() {
            self.detach_tc(root, interface, hook);
        }
        self.tc_interfaces.insert(interface.to_string(), role);
        Ok(pinned)
    }

    /// Empties `hook` of `interface`: its pin (TCX) or our filter (netlink).
    pub(super) fn detach_tc(&self, root: &Path, interface: &str, (_, hook, prefix): TcHook) {
        let path = root.join("links").join(format!("{prefix}-{interface}"));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(%interface, error = %e, "could not unpin"),
        }
        if self.tc_mode == TcAttach::Netlink {
            // Gone with its interface, most often.
            let filter = SchedClassifierLink::attached(
                interface,
                hook,
                FILTER_PRIORITY,
                FILTER_HANDLE,
                None,
            );
            let _ = filter.map(Link::detach);
        }
    }

    /// Attaches the per-packet programs to interfaces that appeared (or
    /// whose role changed), and detaches them from those that are gone or
    /// no longer wanted; XDP's likewise.
    pub fn set_interfaces(&mut self, root: &Path, wanted: &Interfaces) {
        self.set_tc_interfaces(root, &wanted.tc);
        if let Err(e) = self.set_xdp_interfaces(root, &wanted.xdp, wanted.acceleration) {
            tracing::error!(error = %e, "XDP could not be attached; tc serves these interfaces");
        }
    }

    fn set_tc_interfaces(&mut self, root: &Path, wanted: &BTreeMap<String, TcRole>) {
        let stale: Vec<(String, TcRole)> = self
            .tc_interfaces
            .iter()
            .filter(|(interface, _)| !wanted.contains_key(*interface))
            .map(|(interface, role)| (interface.clone(), *role))
            .collect();
        for (interface, role) in stale {
            self.tc_interfaces.remove(&interface);
            for &hook in role.hooks() {
                self.detach_tc(root, &interface, hook);
            }
            tracing::info!(%interface, "per-packet programs detached");
        }
        let new: Vec<(String, TcRole)> = wanted
            .iter()
            .filter(|(interface, role)| self.tc_interfaces.get(*interface) != Some(role))
            .map(|(interface, role)| (interface.clone(), *role))
            .collect();
        for (interface, role) in new {
            let attached = self
                .attach_tc(&interface, role)
                .and_then(|links| self.keep_tc(root, &interface, role, links));
            match attached {
                Ok(_) => tracing::info!(%interface, ?role, "per-packet programs attached"),
                // The interface may be gone again already; the next scan retries.
                Err(e) => tracing::warn!(%interface, error = %e, "could not attach"),
            }
        }
    }
}

/// Where the per-packet programs run: tc's on node and pod interfaces by
/// role, XDP's on the node interfaces `acceleration` takes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Interfaces {
    pub tc: BTreeMap<String, TcRole>,
    pub xdp: std::collections::BTreeSet<String>,
    pub acceleration: super::settings::Acceleration,
}

/// A fresh attachment of a per-packet program: a TCX link (with its pin
/// prefix) or a clsact filter.
pub(super) enum Attached {
    Tcx(FdLink, &'static str),
    Filter(SchedClassifierLink),
}

/// The per-packet programs each interface of the caller's network
/// namespace runs, ingress first: its TCX links' (pinned under `root`), or
/// its clsact filters' (kernels before 6.6). What `lb list` prints.
pub fn tc_attached(root: &Path) -> BTreeMap<String, Vec<String>> {
    let Ok(interfaces) = crate::sys::interfaces() else { return BTreeMap::new() };
    let hooks = [(TcAttachType::Ingress, "tc"), (TcAttachType::Egress, "tc-egress")];
    interfaces
        .into_keys()
        .filter(|interface| interface != "lo")
        .map(|interface| {
            let programs = hooks
                .iter()
                .filter_map(|(hook, prefix)| {
                    let pin = root.join("links").join(format!("{prefix}-{interface}"));
                    pinned_program(&pin).or_else(|| filter_program(&interface, *hook))
                })
                .collect();
            (interface, programs)
        })
        .collect()
}

/// The per-packet program our clsact filter on `hook` of `interface` runs.
fn filter_program(interface: &str, hook: TcAttachType) -> Option<String> {
    let parent = match hook {
        TcAttachType::Egress => netlink::TC_EGRESS_PARENT,
        _ => netlink::TC_INGRESS_PARENT,
    };
    let names = netlink::tc_filter_names(crate::sys::ifindex(interface).ok()?, parent).ok()?;
    names.into_iter().find(|name| TC_PROGRAMS.iter().any(|(ours, _, _)| ours == name))
}

/// Removes the per-packet programs' clsact filters from every interface of
/// the caller's network namespace (TCX links go with their pins); returns
/// how many hooks had one. Filters outlive the agents that attach them:
/// this is how they go.
pub fn remove_tc_filters() -> usize {
    let Ok(interfaces) = crate::sys::interfaces() else { return 0 };
    interfaces
        .keys()
        .flat_map(|interface| TC_PROGRAMS.map(|(name, hook, _)| (interface, name, hook)))
        .filter(|(interface, name, hook)| qdisc_detach_program(interface, *hook, name).is_ok())
        .count()
}
