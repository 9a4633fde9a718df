//! What the datapath's maps hold when the plan does not fit whole: the
//! unit refused is the service, never the plan. Pure code.
//!
//! The services served now keep their place first (their endpoint changes
//! go through whenever the new form fits beside the others; if not, the
//! previous form stays), then the others join by name while they fit. A
//! plan that does fit can still overflow for a moment when old and new
//! entries sit side by side (make-before-break): [`steps`] splits such a
//! change into syncs that each fit, removals first, then one service at a
//! time.

use std::collections::{BTreeMap, BTreeSet};

use crate::{
    backend::Scale,
    model::{Protocol, ServiceName},
    plan::{BackendPlan, Frontend, FrontendPlan, Plan},
};

/// Entries each map holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// A frontend plus one per backend slot.
    pub services: usize,
    pub backends: usize,
    /// One per frontend.
    pub rev_nat: usize,
    pub source_ranges: usize,
}

/// Why a service is not (wholly) served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// This map would overflow (its name, as `proxy_map_entries` says it).
    MapFull(&'static str),
    /// An address it claims is still held by a service whose change did
    /// not fit.
    AddressHeld,
}

impl Reason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Reason::MapFull("SERVICES") => "services_map_full",
            Reason::MapFull("BACKENDS") => "backends_map_full",
            Reason::MapFull("REV_NAT") => "rev_nat_map_full",
            Reason::MapFull(_) => "source_ranges_map_full",
            Reason::AddressHeld => "address_held",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::MapFull(map) => write!(f, "the {map} map is full"),
            Reason::AddressHeld => write!(f, "an address it claims is still held"),
        }
    }
}

/// A service the maps do not hold as planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    /// It keeps the form it was served in (a change that did not fit);
    /// otherwise it is not served at all.
    pub kept_previous: bool,
}

/// The plan the maps can hold, and the services left out of it.
#[derive(Debug, Default)]
pub struct Fitted {
    pub plan: Plan,
    pub refused: BTreeMap<ServiceName, Refusal>,
}

/// A service's frontends in one plan.
type Form<'a> = Vec<(&'a Frontend, &'a FrontendPlan)>;

fn by_service(plan: &Plan) -> BTreeMap<&ServiceName, Form<'_>> {
    let mut services: BTreeMap<&ServiceName, Form> = BTreeMap::new();
    for (frontend, fp) in &plan.frontends {
        services.entry(&fp.service.service).or_default().push((frontend, fp));
    }
    services
}

/// The entries a set of frontends takes in each map; backends are shared
/// between frontends of one protocol, so each is counted once.
#[derive(Debug, Default)]
struct Usage {
    services: usize,
    rev_nat: usize,
    source_ranges: usize,
    backends: BTreeMap<(Protocol, BackendPlan), usize>,
}

impl Usage {
    fn add(&mut self, form: &Form) {
        for (frontend, fp) in form {
            self.services += 1 + fp.backends.len();
            self.rev_nat += 1;
            self.source_ranges += fp.source_ranges.len();
            for backend in &fp.backends {
                *self.backends.entry((frontend.protocol, backend)).or_default() += 1;
            }
        }
    }

    fn remove(&mut self, form: &Form) {
        for (frontend, fp) in form {
            self.services -= 1 + fp.backends.len();
            self.rev_nat -= 1;
            self.source_ranges -= fp.source_ranges.len();
            for backend in &fp.backends {
                let key = (frontend.protocol, backend);
                if let Some(refs) = self.backends.get_mut(&key) {
                    *refs -= 1;
                    if *refs == 0 {
                        self.backends.remove(&key);
                    }
                }
            }
        }
    }

    /// The first map it overflows.
    fn overflows(&self, capacity: &Capacity) -> Option<Reason> {
        [
            ("SERVICES", self.services, capacity.services),
            ("BACKENDS", self.backends.len(), capacity.backends),
            ("REV_NAT", self.rev_nat, capacity.rev_nat),
            ("SOURCE_RANGES", self.source_ranges, capacity.source_ranges),
        ]
        .into_iter()
        .find(|(_, used, max)| used > max)
        .map(|(map, ..)| Reason::MapFull(map))
    }
}

/// The services chosen so far, their usage and the addresses they hold.
struct Choice<'a> {
    usage: Usage,
    forms: BTreeMap<&'a ServiceName, Form<'a>>,
    holders: BTreeMap<Frontend, &'a ServiceName>,
    capacity: Capacity,
}

impl<'a> Choice<'a> {
    fn put(&mut self, name: &'a ServiceName, form: Form<'a>) {
        self.usage.add(&form);
        self.holders.extend(form.iter().map(|(f, _)| (**f, name)));
        self.forms.insert(name, form);
    }

    fn take(&mut self, name: &ServiceName) -> Option<Form<'a>> {
        let form = self.forms.remove(name)?;
        self.usage.remove(&form);
        for (frontend, _) in &form {
            self.holders.remove(*frontend);
        }
        Some(form)
    }

    /// Adds `form` for `name` if it fits; why not otherwise.
    fn try_put(&mut self, name: &'a ServiceName, form: &Form<'a>) -> Result<(), Reason> {
        if form.iter().any(|(f, _)| self.holders.contains_key(*f)) {
            return Err(Reason::AddressHeld);
        }
        self.put(name, form.clone());
        match self.usage.overflows(&self.capacity) {
            None => Ok(()),
            Some(reason) => {
                self.take(name);
                Err(reason)
            }
        }
    }
}

/// The part of `desired` the maps can hold, given what they serve now
/// (`served`, which fits).
pub fn fit(desired: &Plan, served: &Plan, capacity: Capacity) -> Fitted {
    let wanted = by_service(desired);
    let had = by_service(served);
    let mut choice = Choice {
        usage: Usage::default(),
        forms: BTreeMap::new(),
        holders: BTreeMap::new(),
        capacity,
    };
    let mut refused = BTreeMap::new();
    // Served services still wanted keep their place, as they are...
    let kept: Vec<&ServiceName> = had.keys().copied().filter(|n| wanted.contains_key(n)).collect();
    for name in &kept {
        choice.put(name, had[name].clone());
    }
    // ...then take their new form where it fits.
    for name in kept {
        let new = &wanted[name];
        if *new == had[name] {
            continue;
        }
        let old = choice.take(name).unwrap_or_default();
        if let Err(reason) = choice.try_put(name, new) {
            choice.put(name, old);
            refused.insert(name.clone(), Refusal { reason, kept_previous: true });
        }
    }
    // The others join by name while they fit.
    for (name, form) in wanted.iter().filter(|(n, _)| !had.contains_key(*n)) {
        if let Err(reason) = choice.try_put(name, form) {
            refused.insert((*name).clone(), Refusal { reason, kept_previous: false });
        }
    }
    let frontends = choice.forms.into_values().flatten().map(|(f, fp)| (*f, fp.clone()));
    Fitted { plan: Plan { frontends: frontends.collect() }, refused }
}

/// The entries `plan` takes in each map, on its own (counting the backends
/// shared between frontends of one protocol once: sorted in a vector, a
/// million take 24 MiB for a moment, where a set took more than twice
/// that).
pub fn needed(plan: &Plan) -> Capacity {
    let named = plan.frontends.values().map(|fp| fp.backends.len()).sum();
    let mut backends = Vec::with_capacity(named);
    let (mut services, mut source_ranges) = (0, 0);
    for (frontend, fp) in &plan.frontends {
        services += 1 + fp.backends.len();
        source_ranges += fp.source_ranges.len();
        backends.extend(fp.backends.iter().map(|b| (frontend.protocol, b)));
    }
    backends.sort_unstable();
    backends.dedup();
    Capacity { services, backends: backends.len(), rev_nat: plan.frontends.len(), source_ranges }
}

/// What a whole source is expected to need, from what a part of it needs
/// and how much more the whole holds: frontends (and their reverse-NAT
/// entries) as the services, backend slots and backends as the endpoints.
pub fn extrapolated(needed: Capacity, scale: Scale) -> Capacity {
    let times = |n: usize, by: f64| (n as f64 * by.max(1.0)).ceil() as usize;
    let slots = needed.services.saturating_sub(needed.rev_nat);
    Capacity {
        services: times(needed.rev_nat, scale.frontends) + times(slots, scale.endpoints),
        backends: times(needed.backends, scale.endpoints),
        rev_nat: times(needed.rev_nat, scale.frontends),
        source_ranges: needed.source_ranges,
    }
}

/// The sizes the service maps grow to so that `needed` fits with room to
/// spare (a quarter more, rounded up to a power of two: growing is rare),
/// each at most `bound`; `None` when no map outgrew `current` or none can
/// grow. Source ranges live in a map of fixed size.
pub fn grown(current: Capacity, needed: Capacity, bound: usize) -> Option<Capacity> {
    let size = |current: usize, needed: usize| {
        if needed <= current {
            return current;
        }
        (needed + needed / 4).next_power_of_two().min(bound).max(current)
    };
    let grown = Capacity {
        services: size(current.services, needed.services),
        backends: size(current.backends, needed.backends),
        rev_nat: size(current.rev_nat, needed.rev_nat),
        source_ranges: current.source_ranges,
    };
    (grown != current).then_some(grown)
}

/// The frontends to sync at each step from `served` to `target`, so that
/// no service's old and new entries wait on another's: first what goes
/// away, then each service of `target` in name order (its new entries
/// before its stale ones, as every sync writes).
pub fn steps(served: &Plan, target: &Plan) -> Vec<BTreeSet<Frontend>> {
    let removed: BTreeSet<Frontend> =
        served.frontends.keys().filter(|f| !target.frontends.contains_key(f)).copied().collect();
    let mut changed: BTreeMap<&ServiceName, BTreeSet<Frontend>> = BTreeMap::new();
    for (frontend, fp) in &target.frontends {
        if served.frontends.get(frontend) != Some(fp) {
            changed.entry(&fp.service.service).or_default().insert(*frontend);
        }
    }
    std::iter::once(removed).chain(changed.into_values()).filter(|s| !s.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, sync::Arc};

    use super::*;
    use crate::{
        model::{EndpointAddr, ServicePortName},
        plan::FrontendKind,
    };

    fn name(n: &str) -> ServiceName {
        ServiceName { namespace: "ns".into(), name: n.into() }
    }

    fn backend(e: u8) -> BackendPlan {
        let addr = EndpointAddr::new(Ipv4Addr::new(10, 244, 0, e).into(), 8080);
        BackendPlan { addr, local: false, host: false }
    }

    /// Service `n` on cluster IP 10.96.0.`ip`:80 over endpoints `eps`.
    fn add(plan: &mut Plan, n: &str, ip: u8, eps: &[u8]) {
        let frontend = Frontend::new(Ipv4Addr::new(10, 96, 0, ip).into(), 80, Protocol::Tcp);
        let service = Arc::new(ServicePortName { service: name(n), port: "".into() });
        let fp = FrontendPlan {
            service,
            kind: FrontendKind::ClusterIp,
            serves_terminating: false,
            backends: eps.iter().map(|e| backend(*e)).collect(),
            affinity_timeout_secs: None,
            external: false,
            local: false,
            drop_when_empty: false,
            source_ranges: Vec::new(),
            two_scopes: false,
            maglev: false,
            dsr: false,
        };
        plan.frontends.insert(frontend, fp);
    }

    fn cap(n: usize) -> Capacity {
        Capacity { services: n, backends: n, rev_nat: n, source_ranges: n }
    }

    fn names(plan: &Plan) -> Vec<String> {
        let services = plan.frontends.values().map(|fp| fp.service.service.name.to_string());
        services.collect::<BTreeSet<_>>().into_iter().collect()
    }

    #[test]
    fn a_plan_that_fits_is_taken_whole() {
        let mut desired = Plan::default();
        add(&mut desired, "a", 1, &[1, 2]);
        add(&mut desired, "b", 2, &[2, 3]);
        let fitted = fit(&desired, &Plan::default(), cap(6));
        assert_eq!(fitted.plan, desired);
        assert!(fitted.refused.is_empty());
    }

    #[test]
    fn only_the_services_that_do_not_fit_are_refused_by_name_order() {
        let mut desired = Plan::default();
        // 3 entries each in SERVICES (frontend + 2 slots).
        for (i, n) in ["d", "a", "c", "b"].iter().enumerate() {
            add(&mut desired, n, i as u8 + 1, &[10 + i as u8, 20 + i as u8]);
        }
        let fitted = fit(&desired, &Plan::default(), cap(7));
        assert_eq!(names(&fitted.plan), ["a", "b"]);
        let refusal = Refusal { reason: Reason::MapFull("SERVICES"), kept_previous: false };
        assert_eq!(fitted.refused, BTreeMap::from([(name("c"), refusal), (name("d"), refusal)]));
        // A smaller one later in the order still gets in.
        add(&mut desired, "e", 9, &[]);
        assert_eq!(names(&fit(&desired, &Plan::default(), cap(7)).plan), ["a", "b", "e"]);
    }

    #[test]
    fn served_services_come_first_and_their_endpoint_changes_go_through() {
        let mut served = Plan::default();
        add(&mut served, "z", 1, &[1, 2]);
        let mut desired = served.clone();
        add(&mut desired, "a", 2, &[3, 4, 5]);
        // "a" sorts first but "z" is served: "a" is the one left out.
        let fitted = fit(&desired, &served, cap(4));
        assert_eq!(names(&fitted.plan), ["z"]);
        assert_eq!(fitted.refused[&name("a")].reason, Reason::MapFull("SERVICES"));
        // An endpoint change of "z" while "a" waits: it goes through.
        add(&mut desired, "z", 1, &[1, 6, 7]);
        let fitted = fit(&desired, &fitted.plan, cap(4));
        assert_eq!(fitted.plan.frontends.values().next().unwrap().backends.len(), 3);
        assert!(!fitted.refused.contains_key(&name("z")));
    }

    #[test]
    fn a_change_that_does_not_fit_keeps_the_previous_form() {
        let mut served = Plan::default();
        add(&mut served, "a", 1, &[1]);
        add(&mut served, "b", 2, &[2]);
        let mut desired = served.clone();
        add(&mut desired, "a", 1, &[1, 3, 4]);
        let fitted = fit(&desired, &served, cap(5));
        assert_eq!(fitted.plan, served, "b is not pushed out, a stays as it was");
        assert_eq!(
            fitted.refused[&name("a")],
            Refusal { reason: Reason::MapFull("SERVICES"), kept_previous: true }
        );
    }

    #[test]
    fn a_replacement_that_fits_alone_replaces_what_is_served() {
        let mut served = Plan::default();
        for i in 0..4 {
            add(&mut served, &format!("old{i}"), i, &[i]);
        }
        let mut desired = Plan::default();
        for i in 0..4 {
            add(&mut desired, &format!("new{i}"), 10 + i, &[10 + i]);
        }
        // 8 entries either way, 16 side by side.
        let fitted = fit(&desired, &served, cap(8));
        assert_eq!(fitted.plan, desired);
        assert!(fitted.refused.is_empty());
        let steps = steps(&served, &fitted.plan);
        assert_eq!(steps.len(), 5, "removals, then one step per service: {steps:?}");
        assert_eq!(steps[0], served.frontends.keys().copied().collect());
    }

    #[test]
    fn backends_shared_between_services_are_counted_once() {
        let mut desired = Plan::default();
        add(&mut desired, "a", 1, &[1, 2]);
        add(&mut desired, "b", 2, &[1, 2]);
        let capacity = Capacity { backends: 2, ..cap(100) };
        assert!(fit(&desired, &Plan::default(), capacity).refused.is_empty());
        add(&mut desired, "c", 3, &[3]);
        let fitted = fit(&desired, &Plan::default(), capacity);
        assert_eq!(fitted.refused[&name("c")].reason, Reason::MapFull("BACKENDS"));
    }

    #[test]
    fn an_address_held_by_a_stuck_service_is_not_given_away() {
        let mut served = Plan::default();
        add(&mut served, "a", 1, &[1]);
        // "a" moves to another address with more endpoints than fit, and
        // "b" wants its old one.
        let mut desired = Plan::default();
        add(&mut desired, "a", 2, &[1, 2, 3, 4]);
        add(&mut desired, "b", 1, &[5]);
        let fitted = fit(&desired, &served, cap(3));
        assert_eq!(fitted.plan, served);
        assert!(fitted.refused[&name("a")].kept_previous);
        assert_eq!(fitted.refused[&name("b")].reason, Reason::AddressHeld);
    }

    #[test]
    fn the_maps_grow_with_room_to_spare_up_to_the_bound() {
        let mut plan = Plan::default();
        add(&mut plan, "a", 1, &[1, 2]);
        add(&mut plan, "b", 2, &[1, 3]);
        let needed = needed(&plan);
        assert_eq!(needed, Capacity { services: 6, backends: 3, rev_nat: 2, source_ranges: 0 });
        assert_eq!(grown(cap(8), needed, 1024), None, "it fits");
        let small = Capacity { services: 4, ..cap(8) };
        assert_eq!(grown(small, needed, 1024), Some(cap(8)), "6 and a quarter: 8");
        assert_eq!(grown(small, needed, 5), Some(Capacity { services: 5, ..cap(8) }));
        assert_eq!(grown(Capacity { services: 5, ..cap(8) }, needed, 5), None, "at the bound");
    }

    #[test]
    fn a_part_of_a_source_tells_what_the_whole_needs() {
        // 2 frontends of 4 slots and 3 backends, in a tenth of the services
        // and a twentieth of the endpoints.
        let part = Capacity { services: 6, backends: 3, rev_nat: 2, source_ranges: 1 };
        let whole = extrapolated(part, Scale { frontends: 10.0, endpoints: 20.0 });
        assert_eq!(
            whole,
            Capacity { services: 20 + 80, backends: 60, rev_nat: 20, source_ranges: 1 }
        );
        let same = extrapolated(part, Scale { frontends: 1.0, endpoints: 0.5 });
        assert_eq!(same, part, "never less than the part");
    }

    #[test]
    fn steps_are_removals_then_each_changed_service() {
        let mut served = Plan::default();
        add(&mut served, "a", 1, &[1]);
        add(&mut served, "b", 2, &[2]);
        let mut target = served.clone();
        target.frontends.remove(&Frontend::new([10, 96, 0, 2].into(), 80, Protocol::Tcp));
        add(&mut target, "a", 1, &[1, 3]);
        add(&mut target, "c", 3, &[3]);
        let ip = |i| Frontend::new(Ipv4Addr::new(10, 96, 0, i).into(), 80, Protocol::Tcp);
        assert_eq!(
            steps(&served, &target),
            [BTreeSet::from([ip(2)]), BTreeSet::from([ip(1)]), BTreeSet::from([ip(3)])]
        );
        assert!(steps(&target, &target).is_empty());
    }
}
