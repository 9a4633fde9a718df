//! The SCTP programs (`proxy_common::TC_SCTP_PROGRAMS`): loaded once a
//! frontend is SCTP's, so that a node without SCTP services never pays
//! their verifier run (about as long as `tc_ingress`'s), and put in
//! `TC_SCTP` before the frontend's entries are written, so its first packet
//! is translated. Until then, and where the kernel refuses them, the TCP and
//! UDP programs find the slot empty and pass SCTP packets untouched.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Instant,
};

use proxy_common::{TC_SCTP_INGRESS, TC_SCTP_INGRESS6, TC_SCTP_PROGRAMS};

use super::{BpfObject, EbpfError, load};
use crate::{
    model::Protocol,
    plan::{Frontend, Plan},
};

/// Where the SCTP programs stand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum SctpPrograms {
    /// No SCTP frontend yet: not loaded.
    #[default]
    NotNeeded,
    /// Loaded, and in `TC_SCTP`.
    Serving,
    /// The kernel refused them (said once): SCTP packets pass untouched.
    Refused,
}

/// Whether a plan's `frontends` have an SCTP one; with `dirty`, among
/// those that may have changed (the others were there at the last sync).
fn wanted<V>(frontends: &BTreeMap<Frontend, V>, dirty: Option<&BTreeSet<Frontend>>) -> bool {
    let sctp = |f: &Frontend| f.protocol == Protocol::Sctp;
    match dirty {
        Some(dirty) => dirty.iter().any(|f| sctp(f) && frontends.contains_key(f)),
        None => frontends.keys().any(sctp),
    }
}

impl BpfObject {
    /// Loads the SCTP programs the first time `plan` has an SCTP frontend
    /// (see the module's comment).
    pub(super) fn serve_sctp(&mut self, plan: &Plan, dirty: Option<&BTreeSet<Frontend>>) {
        if self.sctp != SctpPrograms::NotNeeded || !wanted(&plan.frontends, dirty) {
            return;
        }
        let started = Instant::now();
        self.sctp = match self.load_sctp_programs() {
            Ok(()) => {
                let ms = started.elapsed().as_millis() as u64;
                tracing::info!(ms, "an SCTP frontend: the SCTP programs are loaded");
                SctpPrograms::Serving
            }
            Err(e) => {
                tracing::error!(
                    "SCTP frontends are not served: the kernel refused the SCTP programs: {e}"
                );
                SctpPrograms::Refused
            }
        };
    }

    /// Loads (verifies) the SCTP programs and puts them in `TC_SCTP`.
    pub fn load_sctp_programs(&mut self) -> Result<(), EbpfError> {
        let heaviest = [TC_SCTP_INGRESS, TC_SCTP_INGRESS6].map(|i| TC_SCTP_PROGRAMS[i as usize]);
        load::verify(&mut self.ebpf, &TC_SCTP_PROGRAMS, &heaviest)?;
        self.maps.fill_tc_sctp(&mut self.ebpf)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn the_programs_are_wanted_once_a_frontend_is_sctps() {
        let vip = Ipv4Addr::new(10, 96, 0, 1).into();
        let tcp = Frontend::new(vip, 80, Protocol::Tcp);
        let sctp = Frontend::new(vip, 3868, Protocol::Sctp);
        let plan = |frontends: &[Frontend]| frontends.iter().map(|f| (*f, ())).collect();
        let (tcp_only, both): (BTreeMap<_, _>, BTreeMap<_, _>) = (plan(&[tcp]), plan(&[tcp, sctp]));
        assert!(!wanted(&tcp_only, None));
        assert!(wanted(&both, None));
        // Of the changed frontends, only one the plan still has.
        assert!(wanted(&both, Some(&BTreeSet::from([sctp]))));
        assert!(!wanted(&both, Some(&BTreeSet::from([tcp]))));
        assert!(!wanted(&tcp_only, Some(&BTreeSet::from([sctp]))), "a removed one");
    }
}
