//! The frontends the eBPF datapath does not serve yet: SCTP's (its programs
//! translate TCP and UDP). They are left out of the plan on its way to the
//! maps, so a service's other ports are served; their services are named
//! once per change and counted. Pure code.

use std::{borrow::Cow, collections::BTreeSet};

use crate::{
    model::{Protocol, ServiceName},
    plan::{Frontend, Plan},
};

fn unserved(frontend: &Frontend) -> bool {
    frontend.protocol == Protocol::Sctp
}

/// The plan's unserved frontends, followed from sync to sync.
#[derive(Default)]
pub struct Unserved {
    frontends: BTreeSet<Frontend>,
    /// Their services, as last reported.
    services: BTreeSet<ServiceName>,
}

/// A sync's plan and changed frontends without the unserved ones.
pub struct Served<'a> {
    pub plan: Cow<'a, Plan>,
    pub dirty: Option<Cow<'a, BTreeSet<Frontend>>>,
}

impl Served<'_> {
    pub fn dirty(&self) -> Option<&BTreeSet<Frontend>> {
        self.dirty.as_deref()
    }
}

impl Unserved {
    /// Notes `plan`'s unserved frontends (only those in `dirty` may have
    /// changed, `None`: any) and returns the plan without them: borrowed
    /// while it has none, a copy otherwise (until the programs serve SCTP).
    pub fn leave_out<'a>(
        &mut self,
        plan: &'a Plan,
        dirty: Option<&'a BTreeSet<Frontend>>,
    ) -> Served<'a> {
        match dirty {
            None => {
                self.frontends = plan.frontends.keys().filter(|f| unserved(f)).copied().collect()
            }
            Some(dirty) => {
                for frontend in dirty.iter().filter(|f| unserved(f)) {
                    if plan.frontends.contains_key(frontend) {
                        self.frontends.insert(*frontend);
                    } else {
                        self.frontends.remove(frontend);
                    }
                }
            }
        }
        if self.frontends.is_empty() {
            return Served { plan: Cow::Borrowed(plan), dirty: dirty.map(Cow::Borrowed) };
        }
        let frontends = plan.frontends.iter().filter(|(f, _)| !unserved(f));
        let plan = Plan { frontends: frontends.map(|(f, fp)| (*f, fp.clone())).collect() };
        let dirty = dirty.map(|d| Cow::Owned(d.iter().filter(|f| !unserved(f)).copied().collect()));
        Served { plan: Cow::Owned(plan), dirty }
    }

    /// The services whose frontends were left out, when they differ from
    /// those last reported (`plan`: the whole plan, as given).
    pub fn changed(&mut self, plan: &Plan) -> Option<&BTreeSet<ServiceName>> {
        let services: BTreeSet<ServiceName> = self
            .frontends
            .iter()
            .filter_map(|f| plan.frontends.get(f))
            .map(|fp| fp.service.service.clone())
            .collect();
        if services == self.services {
            return None;
        }
        self.services = services;
        Some(&self.services)
    }

    /// How many services are left out.
    pub fn services(&self) -> usize {
        self.services.len()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use test_objects::{Protocol::Sctp, ServiceBuilder, port, service};

    use super::*;
    use crate::plan::Node;

    /// The plan of `services` (their cluster IPs: the node has no address).
    fn plan(services: &[&ServiceBuilder]) -> Plan {
        let services: Vec<_> = services.iter().map(|s| (*s).clone().build()).collect();
        crate::plan::plan(&crate::source::model_of(&services, &[]), &Node::default()).0
    }

    /// `mixed` at 10.96.0.1: http 80/TCP, and diameter 3868/SCTP unless
    /// `tcp_only`.
    fn mixed(tcp_only: bool) -> ServiceBuilder {
        let mixed = service("default", "mixed").cluster_ip("10.96.0.1").port(port("http", 80));
        if tcp_only { mixed } else { mixed.port(port("diameter", 3868).protocol(Sctp)) }
    }

    fn frontend(ip: u8, port: u16, protocol: Protocol) -> Frontend {
        Frontend::new(Ipv4Addr::new(10, 96, 0, ip).into(), port, protocol)
    }

    fn names(services: &BTreeSet<ServiceName>) -> Vec<String> {
        services.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn sctp_frontends_are_left_out_and_their_services_named_once_per_change() {
        let (tcp, sctp) = (frontend(1, 80, Protocol::Tcp), frontend(1, 3868, Protocol::Sctp));
        let mut unserved = Unserved::default();
        let first = plan(&[&mixed(false)]);
        assert_eq!(first.frontends.len(), 2);
        let served = unserved.leave_out(&first, None);
        assert_eq!(served.plan.frontends.keys().collect::<Vec<_>>(), [&tcp]);
        assert_eq!(unserved.changed(&first).map(names), Some(vec!["default/mixed".into()]));
        assert_eq!(unserved.services(), 1);
        unserved.leave_out(&first, None);
        assert_eq!(unserved.changed(&first), None, "unchanged: not reported again");

        // A change: only the frontends that changed are looked at.
        let telecom = service("default", "telecom").cluster_ip("10.96.0.2");
        let telecom = telecom.port(port("sigtran", 2905).protocol(Sctp));
        let second = plan(&[&mixed(false), &telecom]);
        let dirty = BTreeSet::from([frontend(2, 2905, Protocol::Sctp)]);
        let served = unserved.leave_out(&second, Some(&dirty));
        assert_eq!(served.dirty(), Some(&BTreeSet::new()));
        assert_eq!(served.plan.frontends.keys().collect::<Vec<_>>(), [&tcp]);
        let changed = unserved.changed(&second).map(names);
        assert_eq!(changed, Some(vec!["default/mixed".into(), "default/telecom".into()]));

        // Gone again: the plan passes through as it is.
        let third = plan(&[&mixed(true)]);
        let dirty = BTreeSet::from([sctp, frontend(2, 2905, Protocol::Sctp), tcp]);
        let served = unserved.leave_out(&third, Some(&dirty));
        assert!(matches!(served.plan, Cow::Borrowed(_)));
        assert_eq!(served.dirty(), Some(&dirty));
        assert_eq!(unserved.changed(&third).map(names), Some(vec![]));
        assert_eq!(unserved.services(), 0);
    }
}
