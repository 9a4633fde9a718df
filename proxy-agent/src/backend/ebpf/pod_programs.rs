//! Which pod interfaces carry the replies program (`tc_pod_replies`), where
//! the socket LB covers every pod: only those whose pod backs a frontend,
//! or still has per-packet flows. Pure code; the datapath reads the routes
//! and the flows, and attaches.
//!
//! A pod's own connections never need a program on its interface (the
//! socket LB translated them at `connect()`); what does is a reply of a
//! per-packet flow (NodePort, externalIP, load-balancer IP, ClusterIP
//! traffic from outside the node) whose backend is the pod: it must be
//! translated before the node routes it. So the program follows the
//! endpoints:
//!
//! - a pod is known by the host routes (a /32 or /128 to one interface) the
//!   CNI gives it; an interface with none (a bridge's port, say, or one
//!   whose route is not there yet) keeps the program, as it cannot be told
//!   which pods are behind it;
//! - a sync puts the program on the interfaces of pods that now back a
//!   frontend *before* it writes the maps that send them flows
//!   (make-before-break), looking at the frontends it changes only;
//! - an interface whose pod no longer backs anything keeps its program
//!   until a conntrack collection that began afterwards finds no flow to
//!   it: established flows to a removed endpoint keep being translated, as
//!   kube-proxy's conntrack keeps them;
//! - until the first collection, which flows exist is not known (a previous
//!   agent's are carried over): every pod interface keeps the program.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    time::Instant,
};

use hashbrown::HashMap;

use crate::plan::{Frontend, Plan};

/// The pods behind pod interfaces, what they back, and their flows.
#[derive(Debug, Default)]
pub struct PodPrograms {
    /// Pod addresses routed to a pod-facing interface, and that interface.
    routed: HashMap<IpAddr, String>,
    /// The frontends with backends among the routed addresses, and those.
    backing: HashMap<Frontend, Box<[IpAddr]>>,
    /// How many frontends each routed address backs (none: absent).
    backs: HashMap<IpAddr, u32>,
    /// Interfaces whose pods stopped backing, since when.
    idle_since: BTreeMap<String, Instant>,
    /// When the last conntrack collection began, and the backends of the
    /// flows it found.
    flows: Option<(Instant, HashSet<IpAddr>)>,
    /// Whether the routes were read at all.
    read: bool,
}

impl PodPrograms {
    /// Takes the host routes to pod-facing interfaces (any other route's
    /// address is not a pod's); returns whether the routed addresses
    /// changed, when what they back is to be worked out again from the
    /// whole plan ([`Self::plan`] without `dirty`).
    pub fn routes(&mut self, routed: impl IntoIterator<Item = (IpAddr, String)>) -> bool {
        self.read = true;
        let routed: HashMap<IpAddr, String> = routed.into_iter().collect();
        let same =
            routed.len() == self.routed.len() && routed.keys().all(|a| self.routed.contains_key(a));
        self.routed = routed;
        let routed_to: BTreeSet<&String> = self.routed.values().collect();
        self.idle_since.retain(|i, _| routed_to.contains(i));
        !same
    }

    /// Whether [`Self::routes`] was given the routes once.
    pub fn routes_read(&self) -> bool {
        self.read
    }

    /// Whether `address` is one this node routes to a pod interface.
    pub fn is_routed(&self, address: IpAddr) -> bool {
        self.routed.contains_key(&address)
    }

    /// Follows the frontends `dirty` names (every one without) to what
    /// `plan` says they balance over.
    pub fn plan(&mut self, plan: &Plan, dirty: Option<&BTreeSet<Frontend>>) {
        let backing_of = |frontend: &Frontend| -> Option<Box<[IpAddr]>> {
            let backends = &plan.frontends.get(frontend)?.backends;
            let mut ours: Vec<IpAddr> = backends
                .iter()
                .map(|b| b.addr.ip())
                .filter(|ip| self.routed.contains_key(ip))
                .collect();
            ours.dedup();
            (!ours.is_empty()).then(|| ours.into_boxed_slice())
        };
        let changed: Vec<(Frontend, Option<Box<[IpAddr]>>)> = match dirty {
            Some(dirty) => dirty.iter().map(|f| (*f, backing_of(f))).collect(),
            None => {
                self.backing.clear();
                self.backs.clear();
                if self.routed.is_empty() {
                    return;
                }
                plan.frontends.keys().filter_map(|f| Some((*f, Some(backing_of(f)?)))).collect()
            }
        };
        for (frontend, backing) in changed {
            for ip in self.backing.remove(&frontend).iter().flatten() {
                if let Some(n) = self.backs.get_mut(ip) {
                    *n -= 1;
                    if *n == 0 {
                        self.backs.remove(ip);
                    }
                }
            }
            if let Some(backing) = backing {
                for ip in &backing {
                    *self.backs.entry(*ip).or_default() += 1;
                }
                self.backing.insert(frontend, backing);
            }
        }
    }

    /// What the last conntrack collection found: when it began, and the
    /// backend addresses of the flows it left.
    pub fn flows(&mut self, began: Instant, backends: HashSet<IpAddr>) {
        self.flows = Some((began, backends));
    }

    /// The pod interfaces that need no program now (`now`: when a pod
    /// that stopped backing is taken to have stopped); every other one
    /// carries it, those not seen by [`Self::routes`] yet too.
    pub fn bare(&mut self, now: Instant) -> BTreeSet<String> {
        let mut addresses: BTreeMap<&str, Vec<IpAddr>> = BTreeMap::new();
        for (ip, interface) in &self.routed {
            addresses.entry(interface).or_default().push(*ip);
        }
        let mut bare = BTreeSet::new();
        for (interface, pods) in addresses {
            if pods.iter().any(|ip| self.backs.contains_key(ip)) {
                self.idle_since.remove(interface);
                continue;
            }
            let since = *self.idle_since.entry(interface.to_string()).or_insert(now);
            let idle = match &self.flows {
                None => false,
                // Flows made before it stopped backing may not have been seen.
                Some((began, _)) if *began <= since => false,
                Some((_, backends)) => !pods.iter().any(|ip| backends.contains(ip)),
            };
            if idle {
                bare.insert(interface.to_string());
            }
        }
        bare
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        model::{EndpointAddr, Protocol},
        plan::{BackendPlan, FrontendKind, FrontendPlan},
    };

    fn frontend(last: u8) -> Frontend {
        Frontend::new(IpAddr::from([10, 96, 0, last]), 80, Protocol::Tcp)
    }

    fn pod(last: u8) -> IpAddr {
        IpAddr::from([10, 244, 0, last])
    }

    fn plan_of(frontends: &[(u8, &[u8])]) -> Plan {
        let mut plan = Plan::default();
        for (f, pods) in frontends {
            let backends = pods
                .iter()
                .map(|p| BackendPlan {
                    addr: EndpointAddr::new(pod(*p), 8080),
                    local: true,
                    host: false,
                })
                .collect();
            let fp = FrontendPlan::plain(&format!("s{f}"), FrontendKind::NodePort, backends);
            plan.frontends.insert(frontend(*f), fp);
        }
        plan
    }

    fn interfaces(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn routes(pairs: &[(u8, &str)]) -> Vec<(IpAddr, String)> {
        pairs.iter().map(|(p, i)| (pod(*p), i.to_string())).collect()
    }

    /// Pods 1 and 2 behind veth1 and veth2.
    fn programs(plan: &Plan) -> PodPrograms {
        let mut pods = PodPrograms::default();
        assert!(pods.routes(routes(&[(1, "veth1"), (2, "veth2")])));
        pods.plan(plan, None);
        pods
    }

    #[test]
    fn only_pods_that_back_nothing_and_have_no_flow_go_bare() {
        let plan = plan_of(&[(1, &[1, 5])]);
        let mut pods = programs(&plan);
        let t0 = Instant::now();
        // Until a collection began after it was first seen backing nothing.
        assert!(pods.bare(t0).is_empty());
        let t1 = t0 + Duration::from_secs(1);
        pods.flows(t1, HashSet::new());
        assert_eq!(pods.bare(t1), interfaces(&["veth2"]));
        assert!(pods.is_routed(pod(1)) && !pods.is_routed(pod(5)));
    }

    #[test]
    fn until_flows_are_known_every_pod_interface_keeps_it() {
        let plan = plan_of(&[(1, &[1])]);
        let mut pods = programs(&plan);
        assert!(pods.bare(Instant::now()).is_empty());
    }

    #[test]
    fn a_pod_that_becomes_a_backend_gets_it_at_the_sync_that_names_it() {
        let mut plan = plan_of(&[(1, &[1])]);
        let mut pods = programs(&plan);
        let t0 = Instant::now();
        pods.bare(t0);
        let t1 = t0 + Duration::from_secs(1);
        pods.flows(t1, HashSet::new());
        assert!(pods.bare(t1).contains("veth2"));
        plan = plan_of(&[(1, &[1]), (2, &[2])]);
        pods.plan(&plan, Some(&BTreeSet::from([frontend(2)])));
        assert!(pods.bare(t1).is_empty());
    }

    #[test]
    fn a_pod_that_stops_backing_keeps_it_while_it_may_have_flows() {
        let plan = plan_of(&[(1, &[1]), (2, &[1])]);
        let mut pods = programs(&plan);
        let t0 = Instant::now();
        pods.flows(t0, HashSet::new());
        // Still backing frontend 2.
        let plan = plan_of(&[(2, &[1])]);
        pods.plan(&plan, Some(&BTreeSet::from([frontend(1)])));
        assert!(!pods.bare(t0).contains("veth1"));
        // Backing nothing from t1: the collection of t0 began before.
        let t1 = t0 + Duration::from_secs(1);
        pods.plan(&Plan::default(), Some(&BTreeSet::from([frontend(2)])));
        assert!(!pods.bare(t1).contains("veth1"));
        // A later collection that found a flow to it: kept.
        let t2 = t1 + Duration::from_secs(1);
        pods.flows(t2, HashSet::from([pod(1)]));
        assert!(!pods.bare(t2).contains("veth1"));
        // One that found none: it goes.
        let t3 = t2 + Duration::from_secs(1);
        pods.flows(t3, HashSet::new());
        assert!(pods.bare(t3).contains("veth1"));
    }

    #[test]
    fn a_whole_plan_and_new_routes_count_again() {
        let plan = plan_of(&[(1, &[1, 2]), (2, &[2])]);
        let mut pods = programs(&plan);
        let t0 = Instant::now();
        pods.bare(t0);
        assert_eq!(pods.backs.get(&pod(2)), Some(&2));
        pods.plan(&plan_of(&[(2, &[2])]), None);
        assert_eq!((pods.backs.get(&pod(1)), pods.backs.get(&pod(2))), (None, Some(&1)));
        // Pod 5 gets an interface, pod 1's goes.
        assert!(!pods.routes(routes(&[(2, "veth2"), (1, "veth1")])), "the same routes");
        assert!(pods.routes(routes(&[(2, "veth2"), (5, "veth5")])));
        pods.plan(&plan_of(&[(2, &[2, 5])]), None);
        let t1 = t0 + Duration::from_secs(1);
        pods.flows(t1, HashSet::new());
        assert!(pods.bare(t1).is_empty());
        assert!(!pods.idle_since.contains_key("veth1"), "gone with its interface");
    }
}
