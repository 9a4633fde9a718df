//! Per-packet scenarios in the lab: two nodes on a fabric with routed pod
//! CIDRs, external clients, NodePorts, load-balancer and external IPs, and
//! ClusterIP traffic from pods outside the socket-LB cgroup. Each node drops
//! conntrack-INVALID forwards, as kube-proxy's KUBE-FORWARD chain does.
//! Each scenario runs in both modes (`<scenario>::ebpf`, `::iptables`);
//! what the eBPF datapath counts, the iptables rules count too.

use std::{
    io::{BufRead, BufReader},
    time::{Duration, Instant},
};

use proxy_common::Counter;
use proxy_lab::{
    Attempt, EXT_IP, Lab, Mode, NODE_IP, Pod, Request, Setup, answered, answered_after,
    external_ip, external_modes, node_ip, node_port, tally, two_node_endpoints,
};
use test_objects::{Protocol::*, ServiceBuilder, ep, manifest, port, service};

external_modes!(
    node_port_cluster_policy_reaches_every_endpoint_snated_to_the_node,
    node_port_local_policy_keeps_the_client_ip_and_drops_without_local_endpoints,
    local_policy_addresses_give_in_cluster_clients_every_endpoint,
    load_balancer_and_external_ips_with_source_ranges,
    hairpin_a_pod_reaches_itself_through_its_cluster_ip,
    cluster_ip_from_a_pod_outside_the_cgroup_to_the_other_node,
    a_thousand_concurrent_node_port_connections_and_no_leaked_flows,
    udp_node_port_flows_stick_and_move_off_a_removed_endpoint,
    fragmented_datagrams_through_a_node_port,
    no_endpoints_are_refused_not_timed_out,
    internal_local_policy_and_client_ip_affinity_per_packet,
    host_network_backends_are_reached_through_the_stack_and_answer_as_the_service,
    path_mtu_discovery_through_a_node_port_and_a_cluster_ip,
    the_stacks_refusal_for_a_host_network_backend_names_the_node_port,
    localhost_node_ports_answer_the_node_itself,
);

const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// Two nodes, each running an agent on the same manifest; pods a (node 0),
/// b and c (node 1) serve TCP 8080 and UDP 5353; two external clients.
struct Cluster {
    lab: Lab,
    pods: Vec<Pod>,
    ext: Pod,
    ext2: Pod,
}

fn cluster(setup: Setup, manifest: &str) -> Cluster {
    let mut lab = Lab::with(setup).unwrap();
    lab.add_node().unwrap();
    let mut pods = Vec::new();
    for (node, name, ip) in
        [(0, "web-a", "10.244.1.2"), (1, "web-b", "10.244.2.2"), (1, "web-c", "10.244.2.3")]
    {
        let pod = lab.add_pod_on(node, name, ip).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        pods.push(pod);
    }
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let ext2 = lab.add_external("ext2", &external_ip(2)).unwrap();
    lab.write_manifest(manifest).unwrap();
    for node in 0..2 {
        lab.drop_invalid_forwards(node).unwrap();
        lab.start_agent_on(node, &["--cluster-cidr", CLUSTER_CIDR]).unwrap();
    }
    Cluster { lab, pods, ext, ext2 }
}

/// Service `lab/name` at `cluster_ip`.
fn svc(name: &str, cluster_ip: &str) -> ServiceBuilder {
    service("lab", name).cluster_ip(cluster_ip)
}

/// `service` with a slice over the pods `a`, `b`, `c` as given (see
/// [`two_node_endpoints`]), their ports http 8080 and dns 5353/UDP.
fn over(service: ServiceBuilder, pods: &[&str]) -> String {
    let slice = service.slice().port("http", 8080, Tcp).port("dns", 5353, Udp);
    manifest(&[&service, &slice.endpoints(two_node_endpoints(pods))])
}

/// A NodePort service: http 80 → 8080 on `http`, dns 53/UDP → 5353 on `dns`.
fn node_ports(name: &str, cluster_ip: &str, http: i32, dns: i32) -> ServiceBuilder {
    svc(name, cluster_ip)
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(http))
        .port(port("dns", 53).udp().target(5353).node_port(dns))
}

/// Service `web` on node ports 30080 and 30053 over `pods`.
fn web(pods: &[&str]) -> String {
    over(node_ports("web", "10.96.0.10", 30080, 30053), pods)
}

/// Node 0 itself, as a host-network endpoint.
fn host_endpoint() -> test_objects::EndpointBuilder {
    ep(NODE_IP).node("lab-node")
}

fn peer_ip(peer: &str) -> &str {
    peer.split(':').next().unwrap()
}

fn node_port_cluster_policy_reaches_every_endpoint_snated_to_the_node(setup: Setup) {
    let c = cluster(setup, &web(&["a", "b", "c"]));
    let attempts = c.lab.client_outside(&c.ext).tcp(&node_port(30080), 90).unwrap();
    let seen = answered(&attempts);
    assert_eq!(tally(&attempts).len(), 3, "every endpoint: {:?}", tally(&attempts));
    for (name, peer, _) in &seen {
        assert_eq!(peer_ip(peer), NODE_IP, "{name} saw {peer}, not the node");
    }
    let new_flows = match setup.mode {
        Mode::Ebpf => c.lab.counter_on(0, Counter::CtNew).unwrap(),
        Mode::Iptables => c.lab.rule_packets_on(0, "nat", "-A KUBE-NODEPORTS").unwrap(),
        Mode::Nftables => {
            c.lab.flows_on(0, &["-p", "tcp", "--orig-port-dst", "30080", "--dst-nat"]).unwrap()
        }
    };
    assert!(new_flows >= 90, "{new_flows}");
    if setup.xdp {
        // Each connection's packets after its first, both ways, to and
        // from the other node's pods.
        let forwarded = c.lab.counter_on(0, Counter::XdpForwarded).unwrap();
        assert!(forwarded >= 90, "tracked packets forwarded at XDP: {forwarded}");
    }
}

fn node_port_local_policy_keeps_the_client_ip_and_drops_without_local_endpoints(setup: Setup) {
    let local = node_ports("web", "10.96.0.10", 30080, 30053).external_policy("Local");
    let elsewhere = node_ports("far", "10.96.0.11", 30081, 30054).external_policy("Local");
    let manifest = over(local, &["a", "b", "c"]) + &over(elsewhere, &["b", "c"]);
    let c = cluster(setup, &manifest);

    // Node 0 has only web-a; node 1 has web-b and web-c.
    for (node_ip, expect) in [(NODE_IP, vec!["web-a"]), (&node_ip(1), vec!["web-b", "web-c"])] {
        let attempts = c.lab.client_outside(&c.ext).tcp(&format!("{node_ip}:30080"), 40).unwrap();
        for (name, peer, _) in answered(&attempts) {
            assert!(expect.contains(&name.as_str()), "{node_ip} sent to {name}");
            assert_eq!(peer_ip(&peer), EXT_IP, "the client IP is kept");
        }
        assert_eq!(tally(&attempts).len(), expect.len());
    }

    // No local endpoint for "far" on node 0: dropped, not refused.
    let dropped = || setup.mode.counts().then(|| c.lab.count_on(0, Counter::Dropped).unwrap());
    let dropped_before = dropped();
    let attempts = c.lab.client_outside(&c.ext).timeout_ms(500).tcp(&node_port(30081), 1).unwrap();
    assert!(
        matches!(&attempts[0], Attempt::Err { kind, .. } if kind == "TimedOut"),
        "{attempts:?}"
    );
    assert!(dropped() > dropped_before || !setup.mode.counts());
    // Node 1 serves it.
    answered(&c.lab.client_outside(&c.ext).tcp(&format!("{}:30081", node_ip(1)), 5).unwrap());
}

fn local_policy_addresses_give_in_cluster_clients_every_endpoint(setup: Setup) {
    let web = svc("web", "10.96.0.10")
        .load_balancer_type()
        .external_policy("Local")
        .port(port("http", 80).target(8080).node_port(30080))
        .ingress_ip("10.200.0.10");
    let mut c = cluster(setup, &over(web, &["a", "b", "c"]));
    let addresses = [&node_port(30080), "10.200.0.10:80"];

    // External clients: node 0's endpoint only, their address kept.
    for addr in addresses {
        let attempts = c.lab.client_outside(&c.ext).tcp(addr, 10).unwrap();
        for (name, peer, _) in answered(&attempts) {
            assert_eq!((name.as_str(), peer_ip(&peer)), ("web-a", EXT_IP), "{addr}");
        }
    }

    // In-cluster clients: every endpoint (kube-proxy's short-circuit to the
    // service's cluster chain), answered from the address they called. A
    // pod on node 0 per packet (its address kept) and through the socket
    // hooks, and node 0 itself (kube-proxy's "LOCAL traffic" rules).
    let client = c.lab.add_pod_on(0, "client", "10.244.1.100").unwrap();
    let node = c.lab.client_in(&c.lab.node, Some(&c.lab.cgroup));
    for addr in addresses {
        let per_packet = c.lab.client_outside(&client).tcp(addr, 60).unwrap();
        for (_, peer, _) in answered(&per_packet) {
            assert_eq!(peer_ip(&peer), "10.244.1.100", "{addr}: pods are not masqueraded");
        }
        let from_node = node.tcp(addr, 60).unwrap();
        let clients =
            [("pod", per_packet), ("pod in cgroup", c.lab.client(&client).tcp(addr, 60).unwrap())]
                .into_iter()
                .chain([("node", from_node)]);
        for (who, attempts) in clients {
            assert_eq!(attempts.len(), 60, "{who} to {addr}");
            for (_, _, from) in answered(&attempts) {
                assert_eq!(from, addr, "{who}: the reply comes from the address called");
            }
            let answered: Vec<String> = tally(&attempts).into_keys().collect();
            assert_eq!(answered, ["web-a", "web-b", "web-c"], "{who} to {addr}");
        }
    }
}

/// kube-proxy's localhost NodePorts (`localhostNodePorts`, on by default):
/// the node's own clients reach a NodePort on any 127.0.0.0/8 address, as
/// "LOCAL" traffic: with the Local policy every endpoint, masqueraded.
fn localhost_node_ports_answer_the_node_itself(setup: Setup) {
    let web = node_ports("web", "10.96.0.10", 30080, 30053);
    let far = node_ports("far", "10.96.0.11", 30081, 30054).external_policy("Local");
    let mut c = cluster(setup, &(over(web, &["a", "b", "c"]) + &over(far, &["b", "c"])));
    let pod = c.lab.add_pod_on(0, "client", "10.244.1.100").unwrap();
    let node = c.lab.client_in(&c.lab.node, Some(&c.lab.cgroup));
    // `far` has no endpoint on node 0: its node's clients get node 1's.
    let cases = [
        ("127.0.0.1:30080", vec!["web-a", "web-b", "web-c"]),
        ("127.0.0.5:30080", vec!["web-a", "web-b", "web-c"]),
        ("127.0.0.1:30081", vec!["web-b", "web-c"]),
        (&node_port(30081), vec!["web-b", "web-c"]),
    ];
    for (addr, expect) in cases {
        if setup.mode == Mode::Nftables && addr.starts_with("127.") {
            // As kube-proxy's nftables mode: no NodePort on 127.0.0.0/8.
            let node = c.lab.client_in(&c.lab.node, Some(&c.lab.cgroup)).timeout_ms(500);
            let attempts = node.tcp(addr, 1).unwrap();
            assert!(
                matches!(&attempts[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"),
                "{addr}: {attempts:?}"
            );
            continue;
        }
        let attempts = node.tcp(addr, 60).unwrap();
        for (name, peer, from) in answered(&attempts) {
            assert_eq!(from, addr, "the node sees the address it called");
            assert!(!peer_ip(&peer).starts_with("127."), "{name} saw {peer}: not masqueraded");
        }
        let answered: Vec<String> = tally(&attempts).into_keys().collect();
        assert_eq!(answered, expect, "{addr}");
    }
    if setup.mode != Mode::Nftables {
        let datagrams = node.udp("127.0.0.1:30053", 20).unwrap();
        for (_, _, from) in answered(&datagrams) {
            assert_eq!(from, "127.0.0.1:30053", "a datagram's reply comes from the address called");
        }
    }

    // A pod's loopback is its own: nothing listens there.
    for client in [c.lab.client(&pod), c.lab.client_outside(&pod)] {
        let attempts = client.timeout_ms(500).tcp("127.0.0.1:30080", 1).unwrap();
        assert!(
            matches!(&attempts[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"),
            "a pod's 127.0.0.1:30080: {attempts:?}"
        );
    }
}

fn load_balancer_and_external_ips_with_source_ranges(setup: Setup) {
    let lb = node_ports("lb", "10.96.0.12", 30090, 30091)
        .load_balancer_type()
        .external_ips(&["10.200.0.11"])
        .source_ranges(&[&format!("{EXT_IP}/32")])
        .ingress_ip("10.200.0.10");
    let mut c = cluster(setup, &over(lb, &["a", "b", "c"]));
    let guarded = |c: &Cluster| {
        let admitted = c.lab.client_outside(&c.ext).tcp("10.200.0.10:80", 30).unwrap();
        assert_eq!(tally(&admitted).len(), 3, "the LB IP reaches the service: {admitted:?}");
        let refused =
            c.lab.client_outside(&c.ext2).timeout_ms(500).tcp("10.200.0.10:80", 1).unwrap();
        assert!(
            matches!(&refused[0], Attempt::Err { kind, .. } if kind == "TimedOut"),
            "{refused:?}"
        );
        // The source ranges guard the LB IP only, as in kube-proxy.
        answered(&c.lab.client_outside(&c.ext2).tcp("10.200.0.11:80", 10).unwrap());
        answered(&c.lab.client_outside(&c.ext2).tcp(&node_port(30090), 10).unwrap());
    };
    guarded(&c);
    // So does the next agent (eBPF: on the service maps it adopts, read
    // back exactly, source ranges included: nothing to write).
    c.lab.kill_agent_on(0);
    let before = c.lab.agent_log_on(0).len();
    c.lab.start_agent_on(0, &["--cluster-cidr", CLUSTER_CIDR]).unwrap();
    guarded(&c);
    if setup.mode == Mode::Ebpf {
        let log = c.lab.agent_log_on(0)[before..].to_string();
        let whole = log.lines().find(|l| l.contains("datapath synced") && l.contains("whole"));
        assert!(whole.is_some_and(|l| l.contains(" writes=0 ")), "{log}");
    }
}

fn hairpin_a_pod_reaches_itself_through_its_cluster_ip(setup: Setup) {
    let web = svc("self", "10.96.0.20").port(port("http", 80).target(8080));
    let c = cluster(setup, &over(web, &["a"]));
    // web-a is outside the socket-LB cgroup: only tc sees its packets.
    let attempts = c.lab.client_outside(&c.pods[0]).tcp("10.96.0.20:80", 10).unwrap();
    for (name, peer, from) in answered(&attempts) {
        assert_eq!(name, "web-a");
        assert_eq!(from, "10.96.0.20:80", "the reply comes from the service");
        assert_eq!(peer_ip(&peer), NODE_IP, "SNATed so the reply returns via the node");
    }
}

fn cluster_ip_from_a_pod_outside_the_cgroup_to_the_other_node(setup: Setup) {
    let far = svc("far", "10.96.0.21")
        .port(port("http", 80).target(8080))
        .port(port("dns", 53).udp().target(5353));
    let mut c = cluster(setup, &over(far, &["b", "c"]));
    let client = c.lab.add_pod_on(0, "client", "10.244.1.100").unwrap();
    let attempts = c.lab.client_outside(&client).tcp("10.96.0.21:80", 40).unwrap();
    assert_eq!(tally(&attempts).len(), 2);
    for (_, peer, from) in answered(&attempts) {
        assert_eq!(peer_ip(&peer), "10.244.1.100", "in-cluster sources are not masqueraded");
        assert_eq!(from, "10.96.0.21:80");
    }
    for (_, _, from) in answered(&c.lab.client_outside(&client).udp("10.96.0.21:53", 5).unwrap()) {
        assert_eq!(from, "10.96.0.21:53", "UDP replies come from the service");
    }
}

fn a_thousand_concurrent_node_port_connections_and_no_leaked_flows(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    let pod = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[]).unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.write_manifest(&web(&["a"])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&["--conntrack-tcp-timeout-time-wait", "2s"]).unwrap();

    let attempts =
        lab.client_outside(&ext).run(Request::tcp_concurrent(&node_port(30080), 1000)).unwrap();
    assert_eq!(attempts.len(), 1000);
    let failed: Vec<_> = attempts.iter().filter(|a| a.pod().is_none()).collect();
    assert!(failed.is_empty(), "{} failed, e.g. {:?}", failed.len(), failed.first());
    // The kernel's conntrack holds these flows, not the agent.
    match setup.mode {
        Mode::Iptables => {
            assert!(lab.rule_packets_on(0, "nat", "-A KUBE-NODEPORTS").unwrap() >= 1000);
            return;
        }
        Mode::Nftables => {
            let nat = ["-p", "tcp", "--orig-port-dst", "30080", "--dst-nat"];
            assert!(lab.flows_on(0, &nat).unwrap() >= 1000);
            return;
        }
        Mode::Ebpf => {}
    }
    assert!(lab.counter(Counter::CtNew).unwrap() >= 1000);

    // Closed flows expire after 2 s and the agent collects them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left = usize::MAX;
    while Instant::now() < deadline {
        left = lab.dump_map("CONNTRACK").unwrap().matches("\"expires_ns\"").count();
        if left == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(left, 0, "conntrack entries left behind");
}

fn udp_node_port_flows_stick_and_move_off_a_removed_endpoint(setup: Setup) {
    let c = cluster(setup, &web(&["a", "b", "c"]));
    // One socket, one flow: 30 datagrams over 3 s.
    let mut client = c
        .lab
        .client_outside(&c.ext)
        .spawn(Request::udp(&node_port(30053), 30).interval_ms(100))
        .unwrap();
    let mut lines = BufReader::new(client.stdout.take().unwrap()).lines();
    let mut next = || Attempt::parse(&lines.next().unwrap().unwrap()).unwrap();
    let first = next();
    let Attempt::Ok { name: stuck_to, from, .. } = first else { panic!("{first:?}") };
    assert_eq!(from, node_port(30053), "replies come from the node port");
    let early: Vec<_> = (0..4).map(|_| next().pod().unwrap_or("<lost>").to_string()).collect();
    assert!(early.iter().all(|n| *n == stuck_to), "one flow, one backend: {stuck_to} {early:?}");

    let remaining: Vec<&str> =
        ["a", "b", "c"].into_iter().filter(|p| format!("web-{p}") != stuck_to).collect();
    c.lab.write_manifest(&web(&remaining)).unwrap();
    let after = answered_after(lines, Instant::now(), Duration::from_secs(1));
    client.wait().unwrap();
    assert!(after.len() > 5, "{after:?}");
    assert!(
        after.iter().all(|n| *n != stuck_to && n != "<lost>"),
        "within a second the flow left {stuck_to}: {after:?}"
    );
    assert_eq!(
        after.iter().collect::<std::collections::BTreeSet<_>>().len(),
        1,
        "and sticks again"
    );
    if setup.mode == Mode::Iptables {
        let log = c.lab.agent_log();
        assert!(log.contains("stale UDP/SCTP conntrack entries deleted"), "{log}");
    }
}

fn fragmented_datagrams_through_a_node_port(setup: Setup) {
    let c = cluster(setup, &web(&["a", "b", "c"]));
    // 4000 bytes: three fragments on a 1500-byte MTU.
    let attempts =
        c.lab.client_outside(&c.ext).run(Request::udp(&node_port(30053), 10).size(4000)).unwrap();
    for (_, peer, from) in answered(&attempts) {
        assert_eq!(from, node_port(30053));
        assert_eq!(peer_ip(&peer), NODE_IP, "SNATed like any datagram");
    }
}

fn no_endpoints_are_refused_not_timed_out(setup: Setup) {
    let c = cluster(setup, &over(node_ports("empty", "10.96.0.30", 30080, 30053), &[]));
    let attempts = c.lab.client_outside(&c.ext).tcp(&node_port(30080), 3).unwrap();
    // Refused before TCP's first SYN retransmission (1 s) would have come:
    // an answer, not a timeout (the VM's emulated CPU took 297 ms once).
    for attempt in &attempts {
        assert!(
            matches!(attempt, Attempt::Err { kind, ms } if kind == "ConnectionRefused" && *ms < 900.0),
            "{attempts:?}"
        );
    }
    let udp =
        c.lab.client_outside(&c.ext).run(Request::udp(&node_port(30053), 1).connected()).unwrap();
    assert!(matches!(&udp[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"), "{udp:?}");
    if setup.mode.counts() {
        assert!(c.lab.count_on(0, Counter::Rejected).unwrap() >= 4);
    }
}

fn internal_local_policy_and_client_ip_affinity_per_packet(setup: Setup) {
    let local =
        svc("loc", "10.96.0.40").internal_policy("Local").port(port("http", 80).target(8080));
    let sticky = svc("sticky", "10.96.0.41")
        .node_port_type()
        .client_ip_affinity(Some(60))
        .port(port("http", 80).target(8080).node_port(30085));
    let manifest = over(local, &["a", "b", "c"]) + &over(sticky, &["a", "b", "c"]);
    let mut c = cluster(setup, &manifest);

    // internalTrafficPolicy: Local keeps ClusterIP traffic on the node.
    let client0 = c.lab.add_pod_on(0, "client0", "10.244.1.100").unwrap();
    let client1 = c.lab.add_pod_on(1, "client1", "10.244.2.100").unwrap();
    let from0 = c.lab.client_outside(&client0).tcp("10.96.0.40:80", 20).unwrap();
    answered(&from0);
    assert_eq!(tally(&from0).keys().collect::<Vec<_>>(), ["web-a"]);
    let from1 = c.lab.client_outside(&client1).tcp("10.96.0.40:80", 40).unwrap();
    answered(&from1);
    assert_eq!(tally(&from1).keys().collect::<Vec<_>>(), ["web-b", "web-c"]);

    // ClientIP affinity: each external client sticks to one backend, and
    // the clients are told apart (ten clients, not all on one pod: by
    // chance they would be one run in 3^9).
    let mut picks = std::collections::BTreeSet::new();
    for i in 0..8 {
        let client = c.lab.add_external(&format!("sticky{i}"), &external_ip(3 + i)).unwrap();
        let addr = &client.ip;
        let sticky = c.lab.client_outside(&client).tcp(&node_port(30085), 20).unwrap();
        answered(&sticky);
        assert_eq!(tally(&sticky).len(), 1, "{addr}: {:?}", tally(&sticky));
        picks.extend(tally(&sticky).into_keys());
    }
    for client in [&c.ext, &c.ext2] {
        let sticky = c.lab.client_outside(client).tcp(&node_port(30085), 20).unwrap();
        picks.extend(tally(&sticky).into_keys());
    }
    assert!(picks.len() > 1, "ten clients, all on {picks:?}: is the client in the key?");
    if setup.mode.counts() {
        assert!(c.lab.count_on(0, Counter::AffinityHit).unwrap() >= 10 * 19);
    }
}

#[test]
fn clsact_filters_serve_node_ports_where_tcx_is_missing() {
    let mut lab = Lab::new().unwrap();
    let pod = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[5353]).unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.write_manifest(&web(&["a"])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    let netlink = ["--tc-attach", "netlink"];
    lab.start_agent(&netlink).unwrap();
    let node = lab.node.clone();
    let filters = || {
        proxy_lab::sh(
            "ip",
            &["netns", "exec", &node, "tc", "filter", "show", "dev", "eth0", "ingress"],
        )
        .unwrap()
        .lines()
        .filter(|line| line.contains("tc_ingress"))
        .count()
    };
    assert_eq!(filters(), 1);
    assert!(!lab.pins.join("links").join("tc-eth0").exists(), "filters are not pinned");
    for (_, peer, _) in answered(&lab.client_outside(&ext).tcp(&node_port(30080), 20).unwrap()) {
        assert_eq!(peer_ip(&peer), NODE_IP);
    }

    // A crashed agent leaves its filter; the next one replaces it.
    lab.kill_agent();
    assert_eq!(filters(), 1);
    lab.start_agent(&netlink).unwrap();
    assert_eq!(filters(), 1, "one filter after the restart");
    answered(&lab.client_outside(&ext).tcp(&node_port(30080), 20).unwrap());

    // `cleanup` (in the node's namespace) removes filters as it does pins.
    lab.kill_agent();
    lab.cleanup_on(0).unwrap();
    assert_eq!(filters(), 0);
}

/// eBPF only: the flow maps take the size `--conntrack-max-per-core` and
/// `--conntrack-min` give (the iptables mode hands them to the kernel's
/// conntrack table), the IPv6 ones a token size on a node without IPv6;
/// more flows than the maps hold evict the oldest and traffic goes on.
#[test]
fn ebpf_flow_maps_take_the_conntrack_size_and_ipv6_ones_a_token_size() {
    let mut lab = Lab::new().unwrap();
    let pod = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.write_manifest(&web(&["a"])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    // One per core is below the minimum on any machine: 8192 flows.
    let sizes = ["--conntrack-max-per-core", "1", "--conntrack-min", "8192"];
    lab.start_agent(&[&sizes[..], &["--cluster-cidr", CLUSTER_CIDR]].concat()).unwrap();
    let expected = [
        ("CONNTRACK", 8192),
        ("SOCK_REV_NAT", 8192),
        ("AFFINITY", 2048),
        ("SOCK_FLOWS", 2048),
        ("CONNTRACK6", 1024),
        ("SOCK_REV_NAT6", 1024),
        ("AFFINITY6", 1024),
    ];
    for (map, entries) in expected {
        assert_eq!(lab.map_capacity(map).unwrap(), entries, "{map}");
    }
    let log = lab.agent_log();
    assert!(log.contains("flows=8192") && log.contains("ipv6_flows=1024"), "{log}");

    // Three rounds of 1500 concurrent ClusterIP flows translated per packet
    // (from outside the socket-LB cgroup; no SNAT port involved): two
    // CONNTRACK entries each, 9000 in all, kept 120 s after they close:
    // the last rounds take the room of the first.
    let per_packet = Request::tcp_concurrent("10.96.0.10:80", 1500);
    for round in 0..3 {
        let attempts = lab.client_outside(&client).run(per_packet.clone()).unwrap();
        let failed: Vec<_> = attempts.iter().filter(|a| a.pod().is_none()).collect();
        assert!(failed.is_empty(), "round {round}: {} failed, e.g. {:?}", failed.len(), failed[0]);
    }
    let held = lab.dump_map("CONNTRACK").unwrap().matches("\"expires_ns\"").count();
    assert!((6000..=8192).contains(&held), "{held} entries");
    answered(&lab.client(&client).tcp("10.96.0.10:80", 20).unwrap());
    answered(&lab.client_outside(&ext).tcp(&node_port(30080), 20).unwrap());
}

/// eBPF only: the iptables mode writes no decision records (its rules'
/// packet counters tell what matched).
#[test]
fn ebpf_decision_records_trace_a_refused_connect_and_a_snated_node_port_flow() {
    let mut lab = Lab::new().unwrap();
    let pod = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[5353]).unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let empty = over(node_ports("empty", "10.96.0.30", 30081, 30054), &[]);
    lab.write_manifest(&(web(&["a"]) + &empty)).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&[]).unwrap();
    // Off by default: a refusal writes nothing; then switched on at run
    // time, the programs unchanged.
    let _ = lab.client(&pod).tcp("10.96.0.30:80", 1).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!lab.agent_log().contains("no endpoint, refused"), "{}", lab.agent_log());
    lab.inspect_on(0, &["bpf-log-level", "debug"]).unwrap();

    let refused = lab.client(&pod).tcp("10.96.0.30:80", 1).unwrap();
    assert!(
        matches!(&refused[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"),
        "{refused:?}"
    );
    answered(&lab.client_outside(&ext).tcp(&node_port(30080), 1).unwrap());

    // The agent reads the records as they come; a moment may pass.
    let wanted = [
        ("connect4", "10.96.0.30:80 proto 6: no endpoint, refused"),
        (
            "tc_ingress",
            &format!(
                "-> {NODE_IP}:30080 proto 6: backend 10.244.1.2:8080 by its algorithm (random or Maglev)"
            ),
        ),
        ("tc_ingress", &format!("-> {NODE_IP}:30080 proto 6: SNAT to {NODE_IP}:")),
    ];
    let found = |log: &str| {
        wanted.iter().all(|(program, text)| {
            log.lines().any(|l| l.contains(&format!("program=\"{program}\"")) && l.contains(text))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !found(&lab.agent_log()) {
        assert!(Instant::now() < deadline, "records missing: {}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// eBPF only: the iptables mode follows no interfaces.
#[test]
fn ebpf_pods_created_after_the_agent_are_served_per_packet_through_link_notifications() {
    let mut lab = Lab::new().unwrap();
    let web = svc("web", "10.96.0.10").port(port("http", 80).target(8080));
    lab.write_manifest(&over(web, &["a"])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    // The safety-net scan effectively off: only notifications attach in time.
    lab.start_agent(&["--cluster-cidr", CLUSTER_CIDR, "--interface-rescan-period", "1h"]).unwrap();
    let links = lab.pins.join("links");
    let tc_pins = || -> std::collections::BTreeSet<String> {
        let entries = std::fs::read_dir(&links).unwrap();
        entries.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
    };

    // Each waits (5 s at most) for the agent to attach to its veth, as a
    // CNI would before starting the pod.
    let web = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&web, &[8080], &[]).unwrap();
    let before = tc_pins();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let client_pins: Vec<String> = tc_pins().difference(&before).cloned().collect();
    assert!(!client_pins.is_empty(), "the client's veth has its pins");
    // Outside the cgroup: translated on the client's veth, reverse-translated
    // on web-a's.
    for (name, peer, from) in
        answered(&lab.client_outside(&client).tcp("10.96.0.10:80", 10).unwrap())
    {
        assert_eq!(name, "web-a");
        assert_eq!(peer_ip(&peer), "10.244.1.100");
        assert_eq!(from, "10.96.0.10:80");
    }

    // Deleting the client's veth pair: the agent lets go of it.
    proxy_lab::sh("ip", &["-n", &client.netns, "link", "del", "eth0"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while client_pins.iter().any(|pin| links.join(pin).exists()) {
        assert!(Instant::now() < deadline, "still pinned: {:?}", tc_pins());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = lab.agent_log();
    assert!(log.contains("per-packet programs detached"), "{log}");
    assert!(!log.contains("interface notifications"), "no fallback to scans: {log}");
}

fn host_network_backends_are_reached_through_the_stack_and_answer_as_the_service(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    // A host-network "pod": a server in the node's own namespace.
    let host = Pod { name: "host".into(), netns: lab.node.clone(), ip: NODE_IP.into() };
    lab.serve(&host, &[9090], &[]).unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let hostnet = svc("hostnet", "10.96.0.50")
        .node_port_type()
        .port(port("http", 80).target(9090).node_port(30099));
    let slice = hostnet.slice().port("http", 9090, Tcp).endpoint(host_endpoint());
    lab.write_manifest(&manifest(&[&hostnet, &slice])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&["--cluster-cidr", CLUSTER_CIDR]).unwrap();

    for (name, peer, from) in
        answered(&lab.client_outside(&ext).tcp(&node_port(30099), 10).unwrap())
    {
        assert_eq!(name, "host");
        assert_eq!(peer_ip(&peer), EXT_IP, "delivered locally, not SNATed");
        assert_eq!(from, node_port(30099));
    }
    // From a pod outside the cgroup, per packet: the reply comes from the VIP.
    for (_, peer, from) in answered(&lab.client_outside(&client).tcp("10.96.0.50:80", 10).unwrap())
    {
        assert_eq!(peer_ip(&peer), "10.244.1.100");
        assert_eq!(from, "10.96.0.50:80");
    }
}

/// A client behind a router whose link towards it is narrower (1280) than
/// the MSS it advertises (1460): a large download only completes if the
/// router's "fragmentation needed", which quotes the reply as translated,
/// reaches the backend translated back. Both paths SNAT to node 0 (a
/// NodePort with policy Cluster, a ClusterIP from outside the cluster CIDR)
/// towards web-b on node 1.
fn path_mtu_discovery_through_a_node_port_and_a_cluster_ip(setup: Setup) {
    let mut c = cluster(setup, &web(&["b"]));
    let far = c.lab.add_far_external("far", 1280).unwrap();
    for target in [&node_port(30080), "10.96.0.10:80"] {
        // A stalled transfer fails at its first read of more than 5 s.
        let attempts =
            c.lab.client_outside(&far).timeout_ms(5000).run(Request::bulk(target, 200000)).unwrap();
        let [Attempt::Ok { bytes: Some(bytes), name, peer, from, .. }] = &attempts[..] else {
            panic!("{target}: {attempts:?}");
        };
        assert_eq!(*bytes, 200_000, "{target}: the whole download");
        assert_eq!((name.as_str(), from.as_str()), ("web-b", target));
        assert_eq!(peer_ip(peer), NODE_IP, "masqueraded to node 0");
    }
    assert!(c.lab.far_router_unreachables().unwrap() >= 2, "the narrow link was met");
    if setup.mode == Mode::Ebpf {
        assert!(c.lab.counter_on(0, Counter::IcmpRevNat).unwrap() >= 2);
    }
}

/// A datagram for a host-network backend with nothing listening: the node's
/// stack refuses it with an ICMP port unreachable about the translated
/// datagram, which must name the node port the client used (translated on
/// its way out) for the client's connected socket to take it.
fn the_stacks_refusal_for_a_host_network_backend_names_the_node_port(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let hostnet = svc("hostnet", "10.96.0.50")
        .node_port_type()
        .port(port("dns", 53).udp().target(9053).node_port(30098));
    let slice = hostnet.slice().port("dns", 9053, Udp).endpoint(host_endpoint());
    lab.write_manifest(&manifest(&[&hostnet, &slice])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&["--cluster-cidr", CLUSTER_CIDR]).unwrap();
    // The node's stack refuses a closed node port by itself: the datagram
    // must have gone to the backend, and the error come back through the
    // datapath.
    let translated = || match setup.mode {
        Mode::Ebpf => lab.counter(Counter::IcmpRevNat).unwrap(),
        Mode::Iptables => {
            lab.rule_packets_on(0, "nat", &format!("--to-destination {NODE_IP}:9053")).unwrap()
        }
        Mode::Nftables => lab
            // Translated to the node's own address: only the port tells.
            .flows_on(0, &["-p", "udp", "--orig-port-dst", "30098", "--reply-port-src", "9053"])
            .unwrap(),
    };
    let before = translated();
    let udp = lab.client_outside(&ext).run(Request::udp(&node_port(30098), 1).connected()).unwrap();
    assert!(matches!(&udp[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"), "{udp:?}");
    assert!(translated() > before, "the refusal came back through the datapath");
}

/// A node without an address (none on its interfaces, no `--node-ip`)
/// still serves ClusterIPs, with a warning; when an address appears the
/// agent restarts to serve NodePorts on it, as kube-proxy restarts for new
/// node addresses. The API variant does not apply: there the Node object
/// gives the address.
#[test]
fn a_node_without_an_address_serves_cluster_ips_then_node_ports_once_it_has_one() {
    for setup in [Setup::EBPF, Setup::IPTABLES] {
        let mut lab = Lab::with(setup).unwrap();
        let pod = lab.add_pod("web-a", "10.244.1.2").unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        let client = lab.add_pod("client", "10.244.1.100").unwrap();
        let ext = lab.add_external("ext", EXT_IP).unwrap();
        lab.write_manifest(&web(&["a"])).unwrap();
        let node = lab.node.clone();
        let uplink = ["-n", &node, "addr", "del", &format!("{NODE_IP}/24"), "dev", "eth0"];
        proxy_lab::sh("ip", &uplink).unwrap();
        lab.omit_node_ip(0);
        lab.start_agent(&["--cluster-cidr", CLUSTER_CIDR]).unwrap();
        assert!(lab.agent_log().contains("no node address found"), "{}", lab.agent_log());
        let attempts = lab.client(&client).tcp("10.96.0.10:80", 5).unwrap();
        assert_eq!(tally(&attempts).get("web-a"), Some(&5), "{attempts:?}");

        let readd = ["-n", &node, "addr", "add", &format!("{NODE_IP}/24"), "dev", "eth0"];
        proxy_lab::sh("ip", &readd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        while lab.agent_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(!lab.agent_alive(), "the agent restarts for its new address");
        assert!(lab.agent_log().contains("this node has an address now"), "{}", lab.agent_log());
        lab.start_agent(&["--cluster-cidr", CLUSTER_CIDR]).unwrap();
        let attempts = lab.client_outside(&ext).tcp(&node_port(30080), 5).unwrap();
        assert_eq!(tally(&attempts).get("web-a"), Some(&5), "{attempts:?}");
    }
}
