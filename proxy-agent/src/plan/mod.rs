//! From the model to the desired datapath state: which frontends exist, which
//! backends each balances over, and how it treats its clients. Pure code.
//!
//! Per service port: the ClusterIP (internal traffic), and the external
//! frontends: the NodePort on every node address (within
//! `--nodeport-addresses`), each externalIP and each load-balancer IP. As in
//! kube-proxy, a traffic policy of Local narrows a frontend to this node's
//! endpoints; with none here but some elsewhere its traffic is dropped,
//! while a service without any endpoint refuses (TCP RST, ICMP unreachable).
//! In-cluster clients of an external address with the Local policy (pods,
//! the node) get every endpoint instead, as kube-proxy short-circuits them
//! to the service's cluster-wide chain: the plan holds for them a second
//! frontend at that address, of internal scope.
//!
//! The plan holds both families: each service port is of one (the model
//! splits a dual-stack service per family), and its frontends are addresses
//! of that family, its backends endpoints of that family.

pub mod backends;

use std::{
    collections::{BTreeMap, BTreeSet, btree_map::Entry},
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

pub use self::backends::{BackendList, BackendPlan, Iter};
use crate::compact;
use crate::model::{
    Cidr, Endpoint, ForwardingMode, IpFamily, LbAlgorithm, LbMode, Model, Protocol, ServiceName,
    ServicePort, ServicePortName,
};

/// An address clients connect to, and which of its clients it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

/// Which clients of an address a frontend serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Every client, unless an internal-scope frontend shares the address.
    External,
    /// In-cluster clients (pods, the node) of an external address whose
    /// frontend has `two_scopes`.
    Internal,
}

impl Frontend {
    /// A frontend of external scope: every one but the in-cluster twins.
    pub fn new(ip: IpAddr, port: u16, protocol: Protocol) -> Self {
        Frontend { ip, port, protocol, scope: Scope::External }
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.ip)
    }

    /// The internal-scope frontend at the same address.
    pub fn internal(self) -> Self {
        Frontend { scope: Scope::Internal, ..self }
    }
}

/// Which address of its service a frontend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    ExternalIp,
    LoadBalancer,
}

impl FrontendKind {
    pub const ALL: [FrontendKind; 4] = [
        FrontendKind::ClusterIp,
        FrontendKind::NodePort,
        FrontendKind::ExternalIp,
        FrontendKind::LoadBalancer,
    ];

    /// As Kubernetes and kube-proxy's comments name it.
    pub fn name(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::ExternalIp => "ExternalIP",
            FrontendKind::LoadBalancer => "LoadBalancer",
        }
    }
}

/// What a frontend balances over, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendPlan {
    /// Shared by the service port's frontends and claims.
    pub service: Arc<ServicePortName>,
    /// The address of the service it is (an internal-scope twin: its
    /// external frontend's).
    pub kind: FrontendKind,
    pub backends: BackendList,
    pub affinity_timeout_secs: Option<u32>,
    /// NodePort, externalIP or load-balancer IP (not the ClusterIP).
    pub external: bool,
    /// Its traffic policy is Local: this node's endpoints, client IP kept.
    pub local: bool,
    /// No backend here but endpoints elsewhere: drop rather than refuse.
    pub drop_when_empty: bool,
    /// Only these sources may connect (load-balancer IPs with
    /// loadBalancerSourceRanges); empty means anyone. Of the frontend's
    /// family.
    pub source_ranges: Vec<Cidr>,
    /// In-cluster clients get the internal-scope frontend at this address
    /// (an external frontend with the Local policy).
    pub two_scopes: bool,
    /// No endpoint is ready: the backends are the serving, terminating
    /// ones (kube-proxy's fallback). Only the datapath's logs tell it.
    pub serves_terminating: bool,
    /// An external frontend whose new flows pick their backend from a
    /// Maglev table (eBPF mode; the iptables mode picks at random).
    pub maglev: bool,
    /// An external IPv4 frontend with the Cluster policy whose new flows
    /// from outside the cluster reach backends on other nodes by direct
    /// server return (eBPF mode; the iptables mode masquerades).
    pub dsr: bool,
}

#[cfg(test)]
impl FrontendPlan {
    /// A frontend of `kind` balancing over `backends` at random, with the
    /// Cluster policy and nothing else set (tests).
    pub fn plain(service: &str, kind: FrontendKind, backends: BackendList) -> Self {
        let (namespace, name) = service.split_once('/').unwrap_or(("default", service));
        let service = ServiceName { namespace: namespace.into(), name: name.into() };
        FrontendPlan {
            service: Arc::new(ServicePortName { service, port: "".into() }),
            kind,
            backends,
            affinity_timeout_secs: None,
            external: kind != FrontendKind::ClusterIp,
            local: false,
            drop_when_empty: false,
            source_ranges: Vec::new(),
            two_scopes: false,
            serves_terminating: false,
            maglev: false,
            dsr: false,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub frontends: BTreeMap<Frontend, FrontendPlan>,
}

/// The plans at an address (external scope first) before an update: boxed,
/// and none at an address without any (a first list touches a hundred
/// thousand, and left them inline in a map as large as the plan).
type AtAddress = Option<Box<[Option<FrontendPlan>; 2]>>;

/// What a service port claims at an address: its frontend and, when that
/// one has two scopes, the internal-scope twin. The two are won and lost
/// together, so a conflict is decided (and reported) once per address.
#[derive(Clone, Debug)]
struct Claim {
    plan: FrontendPlan,
    internal: Option<FrontendPlan>,
}

impl Plan {
    fn install(&mut self, frontend: Frontend, claim: Claim) {
        if let Some(internal) = claim.internal {
            self.frontends.insert(frontend.internal(), internal);
        }
        self.frontends.insert(frontend, claim.plan);
    }

    fn uninstall(&mut self, frontend: Frontend) -> Option<Claim> {
        let plan = self.frontends.remove(&frontend)?;
        Some(Claim { plan, internal: self.frontends.remove(&frontend.internal()) })
    }

    /// The plans at `frontend`'s address.
    fn at_address(&self, frontend: Frontend) -> AtAddress {
        let plans = [frontend, frontend.internal()].map(|f| self.frontends.get(&f).cloned());
        plans.iter().any(Option::is_some).then(|| Box::new(plans))
    }
}

/// The node the plan is for.
#[derive(Clone, Debug, Default)]
pub struct Node {
    pub name: String,
    /// Its addresses, of both families: NodePorts are served on those in
    /// `nodeport_addresses`, each family's on its service ports.
    pub ips: Vec<IpAddr>,
    /// `--nodeport-addresses`; empty means every node address.
    pub nodeport_addresses: Vec<Cidr>,
    /// `--localhost-nodeports`: NodePorts also answer on 127.0.0.0/8, to
    /// the node's own clients, where `nodeport_addresses` allows.
    pub localhost_nodeports: bool,
    /// Its `topology.kubernetes.io/zone`, for EndpointSlice hints.
    pub zone: Option<String>,
    /// `--bpf-lb-algorithm`: how external frontends pick a backend where
    /// their service's annotations do not say.
    pub lb_algorithm: LbAlgorithm,
    /// `--bpf-lb-mode`: how they reach backends on other nodes, likewise.
    pub lb_mode: LbMode,
}

impl Node {
    /// Whether `ip` is within `--nodeport-addresses` (none: every address).
    fn serves_nodeports_on(&self, ip: IpAddr) -> bool {
        self.nodeport_addresses.is_empty() || self.nodeport_addresses.iter().any(|c| c.contains(ip))
    }

    /// Whether NodePorts answer on 127.0.0.0/8, as kube-proxy decides: asked
    /// for, and `--nodeport-addresses` (if given) holds 127.0.0.1. IPv4
    /// only: nothing answers on `::1`.
    pub fn serves_localhost_nodeports(&self) -> bool {
        self.localhost_nodeports && self.serves_nodeports_on(Ipv4Addr::LOCALHOST.into())
    }

    /// The addresses NodePorts of `family` and `protocol` are served on:
    /// the node's within `--nodeport-addresses`, and 127.0.0.1 for
    /// localhost NodePorts (the datapath's: any 127.0.0.0/8 address is that
    /// one), which only the socket LB serves: never SCTP's, which no socket
    /// hook sees (the iptables mode serves them, from its own rules).
    fn nodeport_ips(
        &self,
        family: IpFamily,
        protocol: Protocol,
    ) -> impl Iterator<Item = IpAddr> + '_ {
        let of_family = move |ip: &IpAddr| IpFamily::of(*ip) == family;
        let node = self.ips.iter().copied().filter(move |ip| self.serves_nodeports_on(*ip));
        let localhost = (self.serves_localhost_nodeports() && protocol != Protocol::Sctp)
            .then_some(Ipv4Addr::LOCALHOST.into());
        node.chain(localhost).filter(of_family)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Service {loser}: {} {}:{} is already used by {winner}; ignored", frontend.protocol.as_str(), frontend.ip, frontend.port)]
pub struct ConflictError {
    pub frontend: Frontend,
    pub winner: ServicePortName,
    pub loser: ServicePortName,
}

/// Builds the plan for `node`. Two service ports claiming one frontend is a
/// conflict: the first by name keeps it, the other is reported.
pub fn plan(model: &Model, node: &Node) -> (Plan, Vec<ConflictError>) {
    let mut planner = Planner::new(node.clone());
    planner.rebuild(model);
    let conflicts = planner.conflicts();
    (planner.plan, conflicts)
}

/// Keeps the plan of a model up to date one service at a time.
///
/// Every service port claims its frontends (an internal-scope twin goes
/// with its address's claim). Of the claims on one frontend the smallest
/// `ServicePortName` wins (the first in the model's order, as a full pass
/// would decide) and is in the plan; the others wait in `losers`, ready to
/// take over when the winner goes away. Replanning a service withdraws its
/// claims and makes its new ones, touching only its own frontends:
/// O(its frontends × log N).
#[derive(Clone, Debug)]
pub struct Planner {
    node: Node,
    plan: Plan,
    /// Per service, the frontends its ports claim (won or lost), one claim
    /// per frontend and port name.
    claims: BTreeMap<ServiceName, Vec<(Frontend, Arc<ServicePortName>)>>,
    /// Per contested frontend, the claims that did not win it.
    losers: BTreeMap<Frontend, BTreeMap<Arc<ServicePortName>, Claim>>,
}

impl Planner {
    pub fn new(node: Node) -> Self {
        Planner { node, plan: Plan::default(), claims: BTreeMap::new(), losers: BTreeMap::new() }
    }

    pub fn node(&self) -> &Node {
        &self.node
    }

    /// This node's zone changed: every plan may change (call rebuild after).
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.node.zone = zone;
    }

    /// Replans every service of `model` (first plan, node changes). Returns
    /// the frontends whose plan changed (added, removed or different).
    pub fn rebuild(&mut self, model: &Model) -> BTreeSet<Frontend> {
        let services: BTreeSet<ServiceName> =
            self.claims.keys().chain(model.service_names()).cloned().collect();
        self.update(model, &services)
    }

    /// Replans the services named (their ports as `model` now has them; a
    /// name absent from the model was deleted). Returns the frontends whose
    /// plan changed.
    pub fn update(
        &mut self,
        model: &Model,
        services: &BTreeSet<ServiceName>,
    ) -> BTreeSet<Frontend> {
        // The plans at the addresses touched (both scopes), as they were.
        let mut before: BTreeMap<Frontend, AtAddress> = BTreeMap::new();
        for name in services {
            for (frontend, port) in self.claims.remove(name).unwrap_or_default() {
                before.entry(frontend).or_insert_with(|| self.plan.at_address(frontend));
                self.withdraw(frontend, &port);
            }
        }
        for name in services {
            let ports = model.service(name);
            let mut claimed = BTreeSet::new();
            let mut claims = Vec::new();
            for port in ports {
                for (frontend, claim) in frontends(port, &self.node) {
                    // The same address listed twice by one service port:
                    // the first (a load-balancer IP, with its source ranges)
                    // stands.
                    if !claimed.insert((frontend, &port.name)) {
                        continue;
                    }
                    before.entry(frontend).or_insert_with(|| self.plan.at_address(frontend));
                    claims.push((frontend, claim.plan.service.clone()));
                    self.claim(frontend, claim);
                }
            }
            if !claims.is_empty() {
                claims.shrink_to_fit();
                self.claims.insert(name.clone(), claims);
            }
        }
        compact::refill(&mut self.plan.frontends, before.len());
        compact::refill(&mut self.claims, services.len());
        let mut changed = BTreeSet::new();
        for (frontend, old) in before {
            self.settle(frontend);
            let old = old.map_or([None, None], |old| *old);
            for (f, was) in [frontend, frontend.internal()].into_iter().zip(old) {
                if self.plan.frontends.get(&f) != was.as_ref() {
                    changed.insert(f);
                }
            }
        }
        changed
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The conflicts as they stand (loser, winner, frontend), in a stable
    /// order: by loser, then frontend.
    pub fn conflicts(&self) -> Vec<ConflictError> {
        let mut conflicts: Vec<ConflictError> = self
            .losers
            .iter()
            .flat_map(|(frontend, losers)| {
                let winner = &self.plan.frontends[frontend].service;
                losers.keys().map(move |loser| ConflictError {
                    frontend: *frontend,
                    winner: ServicePortName::clone(winner),
                    loser: ServicePortName::clone(loser),
                })
            })
            .collect();
        conflicts.sort_by(|a, b| a.loser.cmp(&b.loser).then(a.frontend.cmp(&b.frontend)));
        conflicts
    }

    /// Takes back the claim of `port` on `frontend`, won or lost.
    fn withdraw(&mut self, frontend: Frontend, port: &ServicePortName) {
        if self.plan.frontends.get(&frontend).is_some_and(|fp| *fp.service == *port) {
            self.plan.uninstall(frontend);
        } else if let Entry::Occupied(mut losers) = self.losers.entry(frontend) {
            losers.get_mut().remove(port);
            if losers.get().is_empty() {
                losers.remove();
            }
        }
    }

    /// Claims a frontend: it is won if free, else waits (`settle` orders).
    fn claim(&mut self, frontend: Frontend, claim: Claim) {
        if self.plan.frontends.contains_key(&frontend) {
            self.losers.entry(frontend).or_default().insert(claim.plan.service.clone(), claim);
        } else {
            self.plan.install(frontend, claim);
        }
    }

    /// Gives `frontend` to its smallest claimant.
    fn settle(&mut self, frontend: Frontend) {
        let Entry::Occupied(mut losers) = self.losers.entry(frontend) else { return };
        let waiting = losers.get_mut();
        let takes_over = match self.plan.frontends.get(&frontend) {
            None => true,
            Some(winner) => {
                waiting.first_key_value().is_some_and(|(name, _)| *name < winner.service)
            }
        };
        if takes_over {
            let (_, first) = waiting.pop_first().expect("no empty loser sets");
            if let Some(lost) = self.plan.uninstall(frontend) {
                waiting.insert(lost.plan.service.clone(), lost);
            }
            self.plan.install(frontend, first);
        }
        if losers.get().is_empty() {
            losers.remove();
        }
    }
}

fn frontends(port: &ServicePort, node: &Node) -> Vec<(Frontend, Claim)> {
    let (cluster_ip, family) = (port.cluster_ip, port.family());
    let of_family = move |ip: &IpAddr| IpFamily::of(*ip) == family;
    let at = |ip, number| Frontend::new(ip, number, port.protocol);
    // Shared with the model (and the parsed Service).
    let name = port.name.clone();
    let mode = port.forwarding_mode.or(node.lb_mode.for_protocol(port.protocol));
    let dsr = mode == ForwardingMode::Dsr;
    let for_policy = |kind: FrontendKind, local: bool, source_ranges: Vec<Cidr>| {
        let external = kind != FrontendKind::ClusterIp;
        let endpoints = if local {
            port.usable_endpoints(Some(&node.name))
        } else {
            port.cluster_endpoints(&node.name, node.zone.as_deref())
        };
        let picked: Vec<&Endpoint> =
            endpoints.iter().copied().filter(|e| of_family(&e.addr.ip())).collect();
        let backends = BackendList::of(&port.endpoints, &picked, &node.name, &node.ips);
        FrontendPlan {
            service: name.clone(),
            kind,
            drop_when_empty: backends.is_empty() && port.has_endpoints(),
            serves_terminating: !endpoints.is_empty() && endpoints.iter().all(|e| !e.ready),
            backends,
            affinity_timeout_secs: port.affinity_timeout_secs,
            external,
            local,
            source_ranges,
            two_scopes: external && local,
            maglev: external && port.lb_algorithm.or(node.lb_algorithm) == LbAlgorithm::Maglev,
            dsr: external && !local && dsr,
        }
    };
    // What in-cluster clients of the external addresses get with the Local
    // policy: the cluster-wide endpoints, as kube-proxy's KUBE-SVC chain
    // (whatever internalTrafficPolicy says), affinity as the service has.
    let in_cluster =
        port.external_local.then(|| for_policy(FrontendKind::ClusterIp, false, vec![]));
    let claim = |kind, source_ranges| {
        let plan = for_policy(kind, port.external_local, source_ranges);
        let internal =
            in_cluster.clone().map(|twin| FrontendPlan { kind, external: false, ..twin });
        Claim { plan, internal }
    };
    let cluster_ip_plan = for_policy(FrontendKind::ClusterIp, port.internal_local, vec![]);
    let mut out =
        vec![(at(cluster_ip, port.port), Claim { plan: cluster_ip_plan, internal: None })];
    if let Some(node_port) = port.node_port {
        let node_port_claim = claim(FrontendKind::NodePort, vec![]);
        out.extend(
            node.nodeport_ips(family, port.protocol)
                .map(|ip| (at(ip, node_port), node_port_claim.clone())),
        );
    }
    let balanced = claim(FrontendKind::LoadBalancer, port.source_ranges().to_vec());
    let ips = |ips: &[IpAddr]| ips.iter().copied().filter(of_family).collect::<Vec<_>>();
    out.extend(
        ips(port.load_balancer_ips()).into_iter().map(|ip| (at(ip, port.port), balanced.clone())),
    );
    let external = claim(FrontendKind::ExternalIp, vec![]);
    out.extend(
        ips(port.external_ips()).into_iter().map(|ip| (at(ip, port.port), external.clone())),
    );
    out
}

#[cfg(test)]
mod tests;
