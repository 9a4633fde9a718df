//! Programs loaded for the first frontend that needs them, so that a node
//! without such frontends never pays their verifier run: the IPv6
//! per-packet programs (`proxy_common::TC6_PROGRAMS`, about a quarter of
//! the verifier's time at a start) and the SCTP ones
//! (`proxy_common::TC_SCTP_PROGRAMS`, about as long as `tc_ingress`). Each
//! group is put in its program array before the frontend's entries are
//! written, so its first packet is translated. Until then, and where the
//! kernel refuses them, the IPv4 TCP and UDP programs find the slot empty
//! and pass those packets untouched, as with no agent.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Instant,
};

use proxy_common::{
    TC_SCTP_INGRESS, TC_SCTP_INGRESS6, TC_SCTP_PROGRAMS, TC6_INGRESS, TC6_POD_REPLIES, TC6_PROGRAMS,
};

use super::{BpfObject, EbpfError, load};
use crate::{
    model::Protocol,
    plan::{Frontend, Plan},
};

/// A group of programs loaded on demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// The IPv6 per-packet programs, for IPv6 frontends.
    Ipv6,
    /// The SCTP per-packet programs (both families), for SCTP frontends.
    Sctp,
}

impl Group {
    pub const ALL: [Group; 2] = [Group::Ipv6, Group::Sctp];

    /// Whether `frontend` needs this group's programs.
    fn serves(self, frontend: &Frontend) -> bool {
        match self {
            Group::Ipv6 => frontend.ip.is_ipv6(),
            Group::Sctp => frontend.protocol == Protocol::Sctp,
        }
    }

    pub(super) fn programs(self) -> &'static [&'static str] {
        match self {
            Group::Ipv6 => &TC6_PROGRAMS,
            Group::Sctp => &TC_SCTP_PROGRAMS,
        }
    }

    /// The heaviest to verify, each started on a thread of its own.
    pub(super) fn heaviest(self) -> [&'static str; 2] {
        let (programs, heaviest) = match self {
            Group::Ipv6 => (&TC6_PROGRAMS[..], [TC6_INGRESS, TC6_POD_REPLIES]),
            Group::Sctp => (&TC_SCTP_PROGRAMS[..], [TC_SCTP_INGRESS, TC_SCTP_INGRESS6]),
        };
        heaviest.map(|i| programs[i as usize])
    }

    fn name(self) -> &'static str {
        match self {
            Group::Ipv6 => "IPv6",
            Group::Sctp => "SCTP",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Whether a plan's `frontends` have one this group serves; with
    /// `dirty`, among those that may have changed (the others were there
    /// at the last sync).
    pub(super) fn wanted<V>(
        self,
        frontends: &BTreeMap<Frontend, V>,
        dirty: Option<&BTreeSet<Frontend>>,
    ) -> bool {
        let serves = |f: &Frontend| self.serves(f);
        match dirty {
            Some(dirty) => dirty.iter().any(|f| serves(f) && frontends.contains_key(f)),
            None => frontends.keys().any(serves),
        }
    }
}

/// Where a group stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Stage {
    /// No frontend needed it yet: not loaded.
    #[default]
    NotNeeded,
    /// Loaded, and in its program array.
    Serving,
    /// The kernel refused them (said once): their packets pass untouched.
    Refused,
}

/// Each group's [`Stage`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Stages([Stage; Group::ALL.len()]);

impl Stages {
    pub(super) fn of(&self, group: Group) -> Stage {
        self.0[group.index()]
    }

    pub(super) fn set(&mut self, group: Group, stage: Stage) {
        self.0[group.index()] = stage;
    }
}

impl BpfObject {
    /// Loads each group the first time `plan` has a frontend it serves
    /// (see the module's comment).
    pub(super) fn serve_on_demand(&mut self, plan: &Plan, dirty: Option<&BTreeSet<Frontend>>) {
        for group in Group::ALL {
            if self.on_demand.of(group) == Stage::NotNeeded && group.wanted(&plan.frontends, dirty)
            {
                let started = Instant::now();
                let stage = self.load_group(group);
                self.record_load(group, stage, started);
            }
        }
    }

    /// Logs how loading `group` went and keeps its stage.
    pub(super) fn record_load(
        &mut self,
        group: Group,
        loaded: Result<(), EbpfError>,
        started: Instant,
    ) {
        let name = group.name();
        let stage = match loaded {
            Ok(()) => {
                let ms = started.elapsed().as_millis() as u64;
                tracing::info!(ms, "an {name} frontend: the {name} programs are loaded");
                Stage::Serving
            }
            Err(e) => {
                tracing::error!(
                    "{name} frontends are not served: the kernel refused the {name} programs: {e}"
                );
                Stage::Refused
            }
        };
        self.on_demand.set(group, stage);
    }

    /// Loads (verifies) `group`'s programs and puts them in its program
    /// array.
    pub fn load_group(&mut self, group: Group) -> Result<(), EbpfError> {
        load::verify(&mut self.ebpf, group.programs(), &group.heaviest())?;
        self.fill_group(group)
    }

    /// Puts `group`'s (loaded) programs in its program array, where the
    /// IPv4 TCP and UDP programs enter them by tail call.
    pub(super) fn fill_group(&mut self, group: Group) -> Result<(), EbpfError> {
        match group {
            Group::Ipv6 => self.maps.fill_tc6(&mut self.ebpf),
            Group::Sctp => self.maps.fill_tc_sctp(&mut self.ebpf),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn a_group_is_wanted_once_a_frontend_needs_it() {
        let vip = Ipv4Addr::new(10, 96, 0, 1).into();
        let tcp = Frontend::new(vip, 80, Protocol::Tcp);
        let sctp = Frontend::new(vip, 3868, Protocol::Sctp);
        let plan = |frontends: &[Frontend]| frontends.iter().map(|f| (*f, ())).collect();
        let (tcp_only, both): (BTreeMap<_, _>, BTreeMap<_, _>) = (plan(&[tcp]), plan(&[tcp, sctp]));
        assert!(!Group::Sctp.wanted(&tcp_only, None));
        assert!(Group::Sctp.wanted(&both, None));
        // Of the changed frontends, only one the plan still has.
        assert!(Group::Sctp.wanted(&both, Some(&BTreeSet::from([sctp]))));
        assert!(!Group::Sctp.wanted(&both, Some(&BTreeSet::from([tcp]))));
        assert!(!Group::Sctp.wanted(&tcp_only, Some(&BTreeSet::from([sctp]))), "a removed one");
        // IPv6: a frontend of that family, whatever its protocol.
        assert!(!Group::Ipv6.wanted(&both, None));
        let vip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1).into();
        let dual = plan(&[tcp, Frontend::new(vip6, 80, Protocol::Tcp)]);
        assert!(Group::Ipv6.wanted(&dual, None));
        assert!(!Group::Sctp.wanted(&dual, None));
    }

    #[test]
    fn each_group_names_its_heaviest_programs() {
        for group in Group::ALL {
            let heaviest = group.heaviest();
            assert!(heaviest.iter().all(|p| group.programs().contains(p)), "{group:?}");
            assert_ne!(heaviest[0], heaviest[1]);
        }
    }
}
