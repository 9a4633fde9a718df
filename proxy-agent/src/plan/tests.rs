use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;
use crate::model::{self, Choice, Endpoint, EndpointAddr, Exposure, Hints};

/// An external IP, a load-balancer IP and a source range.
fn exposed() -> Option<Box<Exposure>> {
    Exposure {
        external_ips: vec![Ipv4Addr::new(10, 200, 0, 5).into()],
        load_balancer_ips: vec![Ipv4Addr::new(10, 200, 0, 6).into()],
        source_ranges: vec![Cidr::parse("192.168.100.101/32").unwrap()],
    }
    .boxed()
}

fn port(name: &str, ip: [u8; 4], endpoints: &[(&str, bool, &str)]) -> ServicePort {
    ServicePort {
        name: Arc::new(ServicePortName {
            service: ServiceName { namespace: "default".into(), name: name.into() },
            port: "".into(),
        }),
        protocol: Protocol::Tcp,
        port: 80,
        cluster_ip: ip.into(),
        node_port: None,
        exposure: None,
        external_local: false,
        health_check_node_port: None,
        internal_local: false,
        affinity_timeout_secs: None,
        lb_algorithm: Default::default(),
        forwarding_mode: Default::default(),
        endpoints: endpoints
            .iter()
            .map(|(addr, ready, node)| {
                Endpoint::new(addr.parse().unwrap(), *ready, *ready, false)
                    .placed(Some((*node).into()), None)
            })
            .collect(),
    }
}

fn node() -> Node {
    Node {
        name: "node-a".into(),
        ips: vec![
            Ipv4Addr::new(192, 168, 100, 11).into(),
            Ipv4Addr::new(172, 16, 0, 11).into(),
            "fd00:100::11".parse().unwrap(),
        ],
        nodeport_addresses: vec![],
        localhost_nodeports: false,
        zone: None,
        lb_algorithm: LbAlgorithm::Random,
        lb_mode: LbMode::Snat,
    }
}

#[test]
fn a_frontend_of_every_endpoint_names_the_model_s_list_and_reads_as_a_copy_would() {
    let b = |addr: &str, local: bool, host: bool| BackendPlan {
        addr: addr.parse().unwrap(),
        local,
        host,
    };
    let backends = |endpoints: &[(&str, bool, &str)]| {
        at(&one(vec![port("a", [10, 96, 0, 1], endpoints)]), [10, 96, 0, 1], 80).backends.clone()
    };
    // Every endpoint, none here, or all here: the model's list, named.
    let elsewhere = backends(&[("10.0.0.2:80", true, "node-b"), ("10.0.0.3:80", true, "")]);
    assert!(elsewhere.names_endpoints());
    let expected = [b("10.0.0.2:80", false, false), b("10.0.0.3:80", false, false)];
    assert_eq!(elsewhere, expected);
    assert_eq!(elsewhere, BackendList::from(expected.to_vec()), "equal to its copy");
    assert_eq!(elsewhere.iter().len(), 2);
    let here = backends(&[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", true, "node-a")]);
    assert!(here.names_endpoints());
    assert_eq!(here, [b("10.0.0.2:80", true, false), b("10.0.0.3:80", true, false)]);
    // Some not ready, some here and some not, one at a node address:
    // a list of their own.
    let some = backends(&[("10.0.0.2:80", true, "node-b"), ("10.0.0.3:80", false, "")]);
    assert!(!some.names_endpoints());
    assert_eq!(some, [b("10.0.0.2:80", false, false)]);
    let mixed = backends(&[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", true, "node-b")]);
    assert!(!mixed.names_endpoints());
    assert_eq!(mixed, [b("10.0.0.2:80", true, false), b("10.0.0.3:80", false, false)]);
    let host = backends(&[("10.0.0.2:80", true, "node-b"), ("172.16.0.11:80", true, "node-a")]);
    assert!(!host.names_endpoints());
    assert_eq!(host, [b("10.0.0.2:80", false, false), b("172.16.0.11:80", true, true)]);
    // A list out of order (the model sorts its own) is copied, sorted.
    let unsorted = backends(&[("10.0.0.3:80", true, "node-b"), ("10.0.0.2:80", true, "")]);
    assert!(!unsorted.names_endpoints());
    assert_eq!(unsorted, expected);
}

fn one(ports: Vec<ServicePort>) -> Plan {
    let (plan, conflicts) = plan(&model::Model::from_ports(ports), &node());
    assert!(conflicts.is_empty());
    plan
}

fn at(plan: &Plan, ip: [u8; 4], port: u16) -> &FrontendPlan {
    let frontend = Frontend::new(ip.into(), port, Protocol::Tcp);
    plan.frontends.get(&frontend).unwrap_or_else(|| panic!("no frontend {frontend:?}"))
}

#[test]
fn frontends_carry_usable_endpoints_only() {
    let plan = one(vec![port(
        "a",
        [10, 96, 0, 1],
        &[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", false, "node-a")],
    )]);
    let fp = at(&plan, [10, 96, 0, 1], 80);
    let addr = "10.0.0.2:80".parse().unwrap();
    assert_eq!(fp.backends, [BackendPlan { addr, local: true, host: false }]);
    assert!(!fp.external && !fp.local && !fp.drop_when_empty && !fp.serves_terminating);
}

#[test]
fn the_terminating_fallback_is_marked() {
    let mut p = port("a", [10, 96, 0, 1], &[("10.0.0.2:80", false, "node-a")]);
    let first = &mut Arc::make_mut(&mut p.endpoints)[0];
    (first.serving, first.terminating) = (true, true);
    let fp = at(&one(vec![p]), [10, 96, 0, 1], 80).clone();
    assert_eq!(fp.backends.len(), 1);
    assert!(fp.serves_terminating);
}

#[test]
fn each_family_has_its_own_frontends_and_endpoints() {
    let mut v6 = port("a", [0; 4], &[("[fd00:244::2]:8080", true, "node-a")]);
    v6.cluster_ip = "fd00:96::1".parse().unwrap();
    v6.node_port = Some(30080);
    let external_ips = vec!["fd00:200::5".parse().unwrap()];
    v6.exposure = Exposure { external_ips, ..Exposure::default() }.boxed();
    // An endpoint of the other family never backs a frontend.
    let v4_endpoint = port("x", [0; 4], &[("10.0.0.9:8080", true, "node-a")]).endpoints;
    v6.endpoints = v6.endpoints.iter().chain(v4_endpoint.iter()).cloned().collect();
    let mut v4 = port("a", [10, 96, 0, 1], &[("10.0.0.2:8080", true, "node-a")]);
    v4.node_port = Some(30080);
    let plan = one(vec![v4, v6]);
    let ips: Vec<String> = plan.frontends.keys().map(|f| f.ip.to_string()).collect();
    assert_eq!(
        ips,
        ["10.96.0.1", "172.16.0.11", "192.168.100.11", "fd00:96::1", "fd00:100::11", "fd00:200::5"],
        "each family's cluster IP, node addresses and external IPs"
    );
    let v6_backend =
        BackendPlan { addr: "[fd00:244::2]:8080".parse().unwrap(), local: true, host: false };
    for (frontend, fp) in &plan.frontends {
        let backends: Vec<_> = fp.backends.iter().map(|b| IpFamily::of(b.addr.ip())).collect();
        assert_eq!(backends, [frontend.family()], "{frontend:?}");
        if frontend.family() == IpFamily::V6 {
            assert_eq!(fp.backends, [v6_backend]);
        }
    }
    let node_port = Frontend::new(
        Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0x11).into(),
        30080,
        Protocol::Tcp,
    );
    assert_eq!(plan.frontends[&node_port].kind, FrontendKind::NodePort);
}

#[test]
fn node_ports_external_and_load_balancer_ips_become_external_frontends() {
    let mut p = port("a", [10, 96, 0, 1], &[("10.0.0.2:8080", true, "node-b")]);
    p.node_port = Some(30080);
    p.exposure = exposed();
    let plan = one(vec![p.clone()]);
    assert_eq!(plan.frontends.len(), 5, "cluster IP, two node ports, external IP, LB IP");
    for (ip, port) in
        [([192, 168, 100, 11], 30080), ([172, 16, 0, 11], 30080), ([10, 200, 0, 5], 80)]
    {
        let fp = at(&plan, ip, port);
        assert!(fp.external && !fp.local && fp.source_ranges.is_empty());
        assert_eq!(fp.backends.len(), 1);
    }
    assert_eq!(at(&plan, [10, 200, 0, 6], 80).source_ranges.len(), 1, "ranges only on the LB IP");

    // --nodeport-addresses narrows the node ports.
    let mut n = node();
    n.nodeport_addresses = vec![Cidr::parse("192.168.100.0/24").unwrap()];
    let (narrowed, _) = super::plan(&model::Model::from_ports([p]), &n);
    assert_eq!(narrowed.frontends.len(), 4);
}

#[test]
fn localhost_node_ports_are_served_at_127_0_0_1_as_kube_proxy_decides() {
    let mut p = port("a", [10, 96, 0, 1], &[("10.0.0.2:8080", true, "node-b")]);
    p.node_port = Some(30080);
    p.external_local = true;
    let localhost = |nodeport_addresses: &[&str]| {
        let n = Node {
            localhost_nodeports: true,
            nodeport_addresses: nodeport_addresses
                .iter()
                .map(|c| Cidr::parse(c).unwrap())
                .collect(),
            ..node()
        };
        let (plan, _) = super::plan(&model::Model::from_ports([p.clone()]), &n);
        let frontend = Frontend::new(Ipv4Addr::LOCALHOST.into(), 30080, Protocol::Tcp);
        (plan.frontends.get(&frontend).cloned(), plan.frontends.get(&frontend.internal()).cloned())
    };
    // As on a node address: with the Local policy and no endpoint here, the
    // node's own clients get the cluster-wide endpoints (kube-proxy's
    // `--src-type LOCAL` short-circuit), from the internal-scope twin.
    let (external, internal) = localhost(&[]);
    let external = external.expect("a NodePort at 127.0.0.1");
    assert_eq!(external.kind, FrontendKind::NodePort);
    assert!(external.two_scopes && external.backends.is_empty() && external.drop_when_empty);
    assert_eq!(internal.expect("its in-cluster twin").backends.len(), 1);
    // --nodeport-addresses without loopback turns them off, as kube-proxy;
    // with it, or with 0.0.0.0/0, they stay.
    assert_eq!(localhost(&["192.168.100.0/24"]).0, None);
    assert!(localhost(&["192.168.100.0/24", "127.0.0.0/8"]).0.is_some());
    assert!(localhost(&["0.0.0.0/0"]).0.is_some());
    // Off unless asked for, and never on IPv6.
    let (plan, _) = super::plan(&model::Model::from_ports([p.clone()]), &node());
    assert!(plan.frontends.keys().all(|f| !f.ip.is_loopback()));
    let mut v6 = port("b", [10, 96, 0, 2], &[]);
    v6.cluster_ip = "fd00:96::2".parse().unwrap();
    v6.node_port = Some(30081);
    let n = Node { localhost_nodeports: true, ..node() };
    let (plan, _) = super::plan(&model::Model::from_ports([v6]), &n);
    assert!(plan.frontends.keys().all(|f| !f.ip.is_loopback()), "{:?}", plan.frontends.keys());
    // Nor for SCTP, which only the socket LB could serve there.
    let mut sctp = p.clone();
    sctp.protocol = Protocol::Sctp;
    let (plan, _) = super::plan(&model::Model::from_ports([sctp]), &n);
    assert!(plan.frontends.keys().any(|f| f.port == 30080), "on the node's addresses");
    assert!(plan.frontends.keys().all(|f| !f.ip.is_loopback()), "{:?}", plan.frontends.keys());
}

#[test]
fn local_policies_narrow_to_this_node_and_drop_when_only_elsewhere() {
    let mut p = port(
        "a",
        [10, 96, 0, 1],
        &[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", true, "node-b")],
    );
    p.node_port = Some(30080);
    p.external_local = true;
    let plan = one(vec![p.clone()]);
    let external = at(&plan, [192, 168, 100, 11], 30080);
    assert!(external.local && external.external && external.two_scopes);
    assert_eq!(external.backends.len(), 1);
    assert_eq!(at(&plan, [10, 96, 0, 1], 80).backends.len(), 2, "internal: every endpoint");

    p.endpoints = p.endpoints.iter().filter(|e| e.node_name() == Some("node-b")).cloned().collect();
    p.internal_local = true;
    let plan = one(vec![p.clone()]);
    for (frontend, fp) in &plan.frontends {
        if frontend.scope == Scope::External {
            assert!(fp.backends.is_empty() && fp.drop_when_empty, "{fp:?}");
        } else {
            assert_eq!(fp.backends.len(), 1, "in-cluster clients reach node-b's");
        }
    }

    p.endpoints = Arc::default();
    let plan = one(vec![p]);
    assert!(plan.frontends.values().all(|fp| !fp.drop_when_empty), "no endpoints: refuse");
}

#[test]
fn in_cluster_clients_of_local_external_addresses_get_an_internal_twin() {
    let mut p = port(
        "a",
        [10, 96, 0, 1],
        &[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", true, "node-b")],
    );
    p.node_port = Some(30080);
    p.exposure = exposed();
    p.external_local = true;
    // The twins ignore internalTrafficPolicy, as kube-proxy's KUBE-SVC.
    p.internal_local = true;
    p.affinity_timeout_secs = Some(60);
    let plan = one(vec![p.clone()]);
    let externals = [([192, 168, 100, 11], 30080), ([172, 16, 0, 11], 30080)]
        .into_iter()
        .chain([([10, 200, 0, 5], 80), ([10, 200, 0, 6], 80)]);
    assert_eq!(plan.frontends.len(), 1 + 4 * 2, "the ClusterIP, four addresses twice");
    for (ip, number) in externals {
        let twin = &plan.frontends[&Frontend::new(ip.into(), number, Protocol::Tcp).internal()];
        assert_eq!(twin.backends.len(), 2, "every endpoint");
        assert!(!twin.external && !twin.local && !twin.two_scopes && !twin.drop_when_empty);
        assert!(twin.source_ranges.is_empty(), "the external scope checks them");
        assert_eq!(twin.affinity_timeout_secs, Some(60));
    }
    assert!(!at(&plan, [10, 96, 0, 1], 80).two_scopes, "the ClusterIP has one scope");

    // No endpoint at all: the twins refuse, as the external scope.
    p.endpoints = Arc::default();
    let plan = one(vec![p.clone()]);
    assert!(plan.frontends.values().all(|fp| !fp.drop_when_empty && fp.backends.is_empty()));

    // Policy Cluster: one scope.
    p.external_local = false;
    let plan = one(vec![p]);
    assert_eq!(plan.frontends.len(), 5);
    assert!(plan.frontends.iter().all(|(f, fp)| f.scope == Scope::External && !fp.two_scopes));
}

#[test]
fn a_contested_address_and_its_twin_go_to_the_same_service() {
    let ip = Ipv4Addr::new(10, 200, 0, 5);
    let mut local = port("b", [10, 96, 0, 2], &[("10.0.0.3:80", true, "node-b")]);
    local.exposure = Exposure { external_ips: vec![ip.into()], ..Exposure::default() }.boxed();
    local.external_local = true;
    let mut cluster = port("c", [10, 96, 0, 3], &[("10.0.0.4:80", true, "node-b")]);
    cluster.exposure = local.exposure.clone();
    let external = Frontend::new(ip.into(), 80, Protocol::Tcp);
    let mut planner = Planner::new(node());
    let model = model::Model::from_ports([local.clone(), cluster.clone()]);
    planner.rebuild(&model);
    assert!(planner.plan().frontends.contains_key(&external.internal()), "b won, twin too");
    assert_eq!(planner.conflicts().len(), 1, "one conflict per address");

    // "a" (policy Cluster) takes the address over: b's twin goes with it.
    let mut first = cluster.clone();
    Arc::make_mut(&mut first.name).service.name = "a".into();
    first.cluster_ip = Ipv4Addr::new(10, 96, 0, 1).into();
    let model = model::Model::from_ports([first.clone(), local.clone(), cluster.clone()]);
    let changed = planner.update(&model, &BTreeSet::from([first.name.service.clone()]));
    assert!(changed.contains(&external) && changed.contains(&external.internal()));
    assert!(!planner.plan().frontends.contains_key(&external.internal()));
    assert_eq!(planner.conflicts().len(), 2);

    // And back when "a" goes.
    let model = model::Model::from_ports([local, cluster]);
    planner.update(&model, &BTreeSet::from([first.name.service.clone()]));
    assert_eq!(planner.plan().frontends[&external.internal()].backends.len(), 1);
}

#[test]
fn conflicting_frontends_keep_the_first_and_report_the_second() {
    let model =
        model::Model::from_ports([port("a", [10, 96, 0, 1], &[]), port("b", [10, 96, 0, 1], &[])]);
    let (plan, conflicts) = plan(&model, &node());
    assert_eq!(plan.frontends.len(), 1);
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0].loser.to_string(), "default/b");
    assert!(conflicts[0].to_string().contains("default/a"));
}

#[test]
fn a_zone_change_applies_topology_hints_on_rebuild() {
    let mut hinted = port(
        "a",
        [10, 96, 0, 1],
        &[("10.0.0.1:80", true, "node-b"), ("10.0.0.2:80", true, "node-c")],
    );
    for (endpoint, zone) in Arc::make_mut(&mut hinted.endpoints).iter_mut().zip(["za", "zb"]) {
        let node = endpoint.node_name().map(Arc::from);
        *endpoint = endpoint.clone().placed(node, Hints::new(vec![zone.into()], vec![]));
    }
    hinted.node_port = Some(30080);
    let plain = port("b", [10, 96, 0, 2], &[("10.0.0.3:80", true, "node-b")]);
    let model = model::Model::from_ports([hinted, plain]);
    let mut planner = Planner::new(node());
    assert_eq!(planner.rebuild(&model).len(), 4, "two ClusterIPs, two NodePorts");
    assert_eq!(at(planner.plan(), [10, 96, 0, 1], 80).backends.len(), 2, "no zone: all");

    planner.set_zone(Some("za".into()));
    assert_eq!(planner.node().zone.as_deref(), Some("za"));
    let changed = planner.rebuild(&model);
    let tcp = |ip: [u8; 4], port| Frontend::new(ip.into(), port, Protocol::Tcp);
    assert_eq!(
        changed,
        BTreeSet::from([
            tcp([10, 96, 0, 1], 80),
            tcp([192, 168, 100, 11], 30080),
            tcp([172, 16, 0, 11], 30080)
        ]),
        "the hinted service's frontends only"
    );
    for (ip, number) in [([10, 96, 0, 1], 80), ([192, 168, 100, 11], 30080)] {
        let backends = &at(planner.plan(), ip, number).backends;
        assert_eq!(backends.len(), 1);
        assert_eq!(backends.iter().next().unwrap().addr, "10.0.0.1:80".parse().unwrap());
    }
    let mut zoned = node();
    zoned.zone = Some("za".into());
    assert_eq!(planner.plan(), &plan(&model, &zoned).0);

    assert!(planner.rebuild(&model).is_empty(), "nothing changed");
    planner.set_zone(None);
    assert_eq!(planner.rebuild(&model), changed, "back to every endpoint");
    assert_eq!(planner.plan(), &plan(&model, &node()).0);
}

/// The plan as a single pass over the model decides it: the first claim
/// wins; each later one is a conflict (a port repeating its own claim
/// aside).
fn first_claim_wins(model: &model::Model, node: &Node) -> (Plan, Vec<ConflictError>) {
    let mut plan = Plan::default();
    let mut conflicts = Vec::new();
    for port in model.ports() {
        for (frontend, claim) in frontends(port, node) {
            match plan.frontends.get(&frontend) {
                Some(existing) if existing.service == port.name => {}
                Some(existing) => conflicts.push(ConflictError {
                    frontend,
                    winner: ServicePortName::clone(&existing.service),
                    loser: ServicePortName::clone(&port.name),
                }),
                None => plan.install(frontend, claim),
            }
        }
    }
    (plan, conflicts)
}

type ConflictKey = (Frontend, ServicePortName, ServicePortName);

fn conflict_set(conflicts: &[ConflictError]) -> BTreeSet<ConflictKey> {
    conflicts.iter().map(|c| (c.frontend, c.winner.clone(), c.loser.clone())).collect()
}

/// A linear congruential generator: the same changes on every run.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 =
            self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as usize % n
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

const ZONES: [&str; 2] = ["za", "zb"];

fn random_endpoints(rng: &mut Lcg) -> Vec<Endpoint> {
    let hinted = rng.chance(40);
    (0..rng.below(5))
        .map(|_| {
            let ready = rng.chance(70);
            let addr =
                EndpointAddr::new(Ipv4Addr::new(10, 244, 0, 1 + rng.below(8) as u8).into(), 8080);
            let endpoint =
                Endpoint::new(addr, ready, ready || rng.chance(50), !ready && rng.chance(50));
            endpoint.placed(
                Some((*rng.pick(&["node-a", "node-b"])).into()),
                Hints::new(
                    if hinted { vec![rng.pick(&ZONES).to_string()] } else { vec![] },
                    if hinted && rng.chance(20) { vec!["node-a".into()] } else { vec![] },
                ),
            )
        })
        .collect()
}

/// A service from small pools of addresses and ports, so that services
/// collide with each other (and a port with itself).
fn random_service(rng: &mut Lcg, name: &ServiceName) -> Vec<ServicePort> {
    let cluster_ip = Ipv4Addr::new(10, 96, 0, 1 + rng.below(6) as u8);
    let some_ips = |rng: &mut Lcg| -> Vec<IpAddr> {
        let ip = |rng: &mut Lcg| Ipv4Addr::new(10, 200, 0, 1 + rng.below(4) as u8).into();
        (0..rng.below(3)).map(|_| ip(rng)).collect()
    };
    (0..1 + rng.below(3))
        .map(|_| ServicePort {
            name: Arc::new(ServicePortName {
                service: name.clone(),
                port: (*rng.pick(&["", "http", "dns"])).into(),
            }),
            protocol: rng.pick(&[Protocol::Tcp, Protocol::Udp]),
            port: rng.pick(&[80, 443]),
            cluster_ip: cluster_ip.into(),
            node_port: rng.chance(30).then(|| 30_000 + rng.below(4) as u16),
            exposure: Exposure {
                external_ips: some_ips(rng),
                load_balancer_ips: some_ips(rng),
                source_ranges: if rng.chance(30) {
                    vec![Cidr::parse("192.168.100.0/24").unwrap()]
                } else {
                    vec![]
                },
            }
            .boxed(),
            external_local: rng.chance(30),
            health_check_node_port: None,
            internal_local: rng.chance(20),
            affinity_timeout_secs: rng.chance(20).then_some(10_800),
            lb_algorithm: rng.pick(&[Choice::NodeDefault, Choice::Annotated(LbAlgorithm::Maglev)]),
            forwarding_mode: rng
                .pick(&[Choice::NodeDefault, Choice::Annotated(ForwardingMode::Dsr)]),
            endpoints: random_endpoints(rng).into(),
        })
        .collect()
}

fn renamed(ports: &[ServicePort], name: &ServiceName) -> Vec<ServicePort> {
    let mut ports = ports.to_vec();
    for port in &mut ports {
        Arc::make_mut(&mut port.name).service = name.clone();
    }
    ports
}

#[test]
fn incremental_updates_match_the_full_plan() {
    let mut rng = Lcg(0x5eed);
    let names: Vec<ServiceName> = (0..40)
        .map(|i| ServiceName {
            namespace: format!("ns{}", i % 3).into(),
            name: format!("svc{i:02}").into(),
        })
        .collect();
    let mut node = node();
    let mut model = model::Model::default();
    for name in &names[..30] {
        let ports = random_service(&mut rng, name);
        model.set_service(name.clone(), ports);
    }
    let mut planner = Planner::new(node.clone());
    let mut before = Plan::default();
    let (mut conflicts_seen, mut winners_changed, mut zone_changes) = (0, 0, 0);
    for step in 0..300 {
        let changed = if step > 0 && step % 40 == 0 {
            // The node moves to another zone (or none).
            let zone = [None, Some("za"), Some("zb")][rng.below(3)].map(str::to_string);
            node.zone = zone.clone();
            planner.set_zone(zone);
            let changed = planner.rebuild(&model);
            zone_changes += usize::from(!changed.is_empty());
            changed
        } else if step == 0 {
            planner.rebuild(&model)
        } else {
            let mut touched = BTreeSet::new();
            for _ in 0..1 + rng.below(3) {
                let name = rng.pick(&names);
                match rng.below(10) {
                    // Deleted.
                    0 | 1 => model.set_service(name.clone(), vec![]),
                    // Its endpoints change.
                    2..=4 if !model.service(&name).is_empty() => {
                        let mut ports = model.service(&name).to_vec();
                        for port in &mut ports {
                            port.endpoints = random_endpoints(&mut rng).into();
                        }
                        model.set_service(name.clone(), ports);
                    }
                    // Renamed: its frontends move to a name sorting
                    // elsewhere among their claimants.
                    5 | 6 if !model.service(&name).is_empty() => {
                        let to = rng.pick(&names);
                        let ports = renamed(model.service(&name), &to);
                        model.set_service(name.clone(), vec![]);
                        model.set_service(to.clone(), ports);
                        touched.insert(to);
                    }
                    // Added or changed whole.
                    _ => {
                        let ports = random_service(&mut rng, &name);
                        model.set_service(name.clone(), ports);
                    }
                }
                touched.insert(name);
            }
            planner.update(&model, &touched)
        };

        let (full, conflicts) = plan(&model, &node);
        let (reference, reference_conflicts) = first_claim_wins(&model, &node);
        assert_eq!(full, reference, "step {step}: plan() decides as one pass would");
        assert_eq!(conflict_set(&conflicts), conflict_set(&reference_conflicts), "step {step}");
        assert_eq!(planner.plan(), &full, "step {step}");
        assert_eq!(conflict_set(&planner.conflicts()), conflict_set(&conflicts), "step {step}");
        let differ: BTreeSet<Frontend> = before
            .frontends
            .keys()
            .chain(full.frontends.keys())
            .filter(|f| before.frontends.get(f) != full.frontends.get(f))
            .copied()
            .collect();
        assert_eq!(changed, differ, "step {step}: exactly the frontends whose plan changed");
        conflicts_seen += conflicts.len();
        winners_changed += changed
            .iter()
            .filter(|f| {
                let service = |p: &Plan| p.frontends.get(f).map(|fp| fp.service.clone());
                matches!((service(&before), service(&full)), (Some(a), Some(b)) if a != b)
            })
            .count();
        before = full;
    }
    assert!(conflicts_seen > 300, "conflicts happen: {conflicts_seen}");
    assert!(winners_changed > 20, "contested frontends change hands: {winners_changed}");
    assert!(zone_changes > 0, "zone changes replan hinted services");
}
