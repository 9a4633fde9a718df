//! Maglev consistent hashing in the lab (eBPF mode only: the iptables
//! rules pick at random, as kube-proxy's, which the last scenario checks).
//! Two nodes, pods a (node 0), b and
//! c (node 1), an external client that reaches the load-balancer IP through
//! either node: its route moves from node 0 to node 1 as an ECMP rehash or
//! a drained node moves a flow. Each scenario runs from the manifests and
//! from the test API server.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use proxy_common::Counter;
use proxy_lab::{Attempt, Lab, Pod, Request, Setup, two_node_endpoints, two_node_web_cluster};
use test_objects::{Protocol::*, ServiceBuilder, manifest, port, service};

macro_rules! both_sources {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[test]
            fn ebpf() {
                super::$scenario(proxy_lab::Setup::EBPF)
            }
            #[test]
            fn api() {
                super::$scenario(proxy_lab::Setup::API)
            }
        }
    )*};
}

both_sources!(
    every_node_sends_a_flow_to_the_same_pod,
    removing_a_backend_moves_only_its_flows,
    the_node_default_and_an_unknown_annotation,
    a_restarted_node_sends_new_flows_where_the_others_do,
);

#[test]
fn the_iptables_mode_serves_maglev_services_at_random_and_says_so_once() {
    let manifest = balanced("lb", "10.96.0.20", LB_IP, Some((CILIUM, "maglev")), &["a", "b", "c"]);
    let (lab, ext) =
        two_node_web_cluster(Setup::IPTABLES, &manifest, &["--bpf-lb-algorithm", "maglev"]);
    let pods = pods_by_port(&lab, &ext, "tcp", &format!("{LB_IP}:80"), 47000, 30);
    let spread: std::collections::BTreeSet<&String> = pods.values().collect();
    assert_eq!(spread.len(), 3, "{pods:?}");
    let log = lab.agent_log_on(0);
    assert_eq!(log.matches("are eBPF-mode features").count(), 1, "{log}");
}

const LB_IP: &str = "10.200.0.10";
const RANDOM_LB_IP: &str = "10.200.0.11";

/// LoadBalancer service `name` at `lb_ip` (http 80 → 8080, dns 53/UDP →
/// 5353) over `pods`, with the algorithm annotation `algorithm` if given.
fn balanced(
    name: &str,
    cluster_ip: &str,
    lb_ip: &str,
    algorithm: Option<(&str, &str)>,
    pods: &[&str],
) -> String {
    let mut svc: ServiceBuilder = service("lab", name)
        .cluster_ip(cluster_ip)
        .load_balancer_type()
        .port(port("http", 80).target(8080).node_port(0))
        .port(port("dns", 53).udp().target(5353).node_port(0))
        .ingress_ip(lb_ip);
    if let Some((key, value)) = algorithm {
        svc = svc.annotation(key, value);
    }
    let slice = svc.slice().port("http", 8080, Tcp).port("dns", 5353, Udp);
    manifest(&[&svc, &slice.endpoints(two_node_endpoints(pods))])
}

const CILIUM: &str = "service.cilium.io/lb-algorithm";
const OURS: &str = "proxy-agent.io/lb-algorithm";

/// Which pod answered each of `count` requests (`tcp` or `udp` to `addr`),
/// sent from source ports `base..`; panics on a failed attempt.
fn pods_by_port(
    lab: &Lab,
    ext: &Pod,
    proto: &str,
    addr: &str,
    base: u16,
    count: u16,
) -> BTreeMap<u16, String> {
    let request = Request::of(proto, addr, count.into()).source_port_base(base);
    let attempts = lab.client_outside(ext).run(request).unwrap();
    assert_eq!(attempts.len(), count as usize, "{attempts:?}");
    (base..)
        .zip(&attempts)
        .map(|(port, a)| match a {
            Attempt::Ok { name, .. } => (port, name.clone()),
            err => panic!("{proto} from port {port}: {err:?} in {attempts:?}"),
        })
        .collect()
}

fn differing(a: &BTreeMap<u16, String>, b: &BTreeMap<u16, String>) -> usize {
    a.iter().filter(|(port, pod)| b.get(port) != Some(pod)).count()
}

/// Waits until node `node`'s `lb list` for `lab/name` no longer names `ip`.
fn wait_until_gone(lab: &Lab, node: usize, name: &str, ip: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = lab.inspect_on(node, &["lb", "list", "--service", name]).unwrap();
        if !out.contains(ip) {
            return;
        }
        assert!(Instant::now() < deadline, "{ip} still in node {node}'s {name}:\n{out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn every_node_sends_a_flow_to_the_same_pod(setup: Setup) {
    let manifest = balanced("lb", "10.96.0.20", LB_IP, Some((CILIUM, "maglev")), &["a", "b", "c"])
        + &balanced("rnd", "10.96.0.21", RANDOM_LB_IP, None, &["a", "b", "c"]);
    let (lab, ext) = two_node_web_cluster(setup, &manifest, &[]);
    for (proto, port, base) in [("udp", 53, 41000), ("tcp", 80, 43000)] {
        let (addr, random) = (format!("{LB_IP}:{port}"), format!("{RANDOM_LB_IP}:{port}"));
        lab.route_external_via(&ext, 0).unwrap();
        let created = lab.counter_on(1, Counter::CtNew).unwrap();
        let via_0 = pods_by_port(&lab, &ext, proto, &addr, base, 50);
        let random_via_0 = pods_by_port(&lab, &ext, proto, &random, base + 100, 50);
        assert_eq!(lab.counter_on(1, Counter::CtNew).unwrap(), created, "node 1 saw none of it");
        let spread: std::collections::BTreeSet<&String> = via_0.values().collect();
        assert_eq!(spread.len(), 3, "{proto}: the table spreads flows over every pod: {via_0:?}");

        // The same tuples through node 1, which has no state for them.
        lab.route_external_via(&ext, 1).unwrap();
        let via_1 = pods_by_port(&lab, &ext, proto, &addr, base, 50);
        let random_via_1 = pods_by_port(&lab, &ext, proto, &random, base + 100, 50);
        assert!(
            lab.counter_on(1, Counter::CtNew).unwrap() >= created + 100,
            "node 1 decided each flow itself"
        );
        assert_eq!(differing(&via_0, &via_1), 0, "{proto}: {via_0:?}\n{via_1:?}");
        // The control: picked at random on each node, most tuples differ.
        let moved = differing(&random_via_0, &random_via_1);
        assert!(moved >= 10, "{proto}: the random service moved only {moved} of 50");
    }
    let listed = lab.inspect_on(0, &["lb", "list", "--service", "lab/lb"]).unwrap();
    assert!(listed.contains("maglev"), "{listed}");
}

fn removing_a_backend_moves_only_its_flows(setup: Setup) {
    let with = |pods: &[&str]| balanced("lb", "10.96.0.20", LB_IP, Some((OURS, "Maglev")), pods);
    let (lab, ext) = two_node_web_cluster(setup, &with(&["a", "b", "c"]), &[]);
    let addr = format!("{LB_IP}:53");
    lab.route_external_via(&ext, 1).unwrap();
    let before = pods_by_port(&lab, &ext, "udp", &addr, 45000, 60);
    let on_c = before.values().filter(|p| *p == "web-c").count();
    assert!(on_c > 5 && on_c < 60, "{before:?}");

    lab.write_manifest(&with(&["a", "b"])).unwrap();
    wait_until_gone(&lab, 0, "lab/lb", "10.244.2.3");
    // Through node 0, which never saw these tuples: a table lookup each.
    lab.route_external_via(&ext, 0).unwrap();
    let after = pods_by_port(&lab, &ext, "udp", &addr, 45000, 60);
    for (port, pod) in &before {
        match pod.as_str() {
            "web-c" => assert_ne!(after[port], "web-c", "port {port} left the removed pod"),
            kept => assert_eq!(&after[port], kept, "port {port} moved though its pod stayed"),
        }
    }
}

/// The restarted agent adopts its predecessor's service maps, whose Maglev
/// tables it writes again: new tuples through it go where node 0 sends
/// them.
fn a_restarted_node_sends_new_flows_where_the_others_do(setup: Setup) {
    let manifest = balanced("lb", "10.96.0.20", LB_IP, Some((CILIUM, "maglev")), &["a", "b", "c"]);
    let (mut lab, ext) = two_node_web_cluster(setup, &manifest, &[]);
    let addr = format!("{LB_IP}:53");
    lab.route_external_via(&ext, 0).unwrap();
    let via_0 = pods_by_port(&lab, &ext, "udp", &addr, 46000, 60);

    lab.kill_agent_on(1);
    let before = lab.agent_log_on(1).len();
    lab.start_agent_on(1, &[]).unwrap();
    let log = lab.agent_log_on(1)[before..].to_string();
    assert!(log.contains("the previous agent's service maps adopted"), "{log}");
    lab.route_external_via(&ext, 1).unwrap();
    let via_1 = pods_by_port(&lab, &ext, "udp", &addr, 46000, 60);
    assert_eq!(differing(&via_0, &via_1), 0, "{via_0:?}\n{via_1:?}");
}

fn the_node_default_and_an_unknown_annotation(setup: Setup) {
    // The node's default is Maglev; one service asks for random, one for
    // nonsense (which gets the default, and a warning naming it).
    let manifest = balanced("lb", "10.96.0.20", LB_IP, Some((OURS, "random")), &["a", "b", "c"])
        + &balanced("odd", "10.96.0.21", RANDOM_LB_IP, Some((CILIUM, "fastest")), &["a", "b", "c"]);
    let (lab, _ext) = two_node_web_cluster(setup, &manifest, &["--bpf-lb-algorithm", "maglev"]);
    let lb = lab.inspect_on(0, &["lb", "list", "--service", "lab/lb"]).unwrap();
    let odd = lab.inspect_on(0, &["lb", "list", "--service", "lab/odd"]).unwrap();
    assert!(!lb.contains("maglev"), "{lb}");
    assert!(odd.contains("maglev"), "{odd}");
    let log = lab.agent_log_on(0);
    assert!(log.contains("Service lab/odd: annotation"), "{log}");
    let json = lab.inspect_on(0, &["lb", "list", "--service", "lab/odd", "-o", "json"]).unwrap();
    assert!(json.contains("\"maglev_share\""), "{json}");
}
