//! ClusterIP scenarios in the lab: real connections from a client pod to
//! pods behind a ClusterIP. Each runs in both modes (`<scenario>::ebpf`,
//! `<scenario>::iptables`): in eBPF mode the client is in the socket-LB
//! cgroup; in iptables mode its packets meet the node's rules.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use proxy_common::Counter;
use proxy_lab::{
    Attempt, Client, Lab, Mode, NODE_IP, Pod, Request, Setup, Source, both_modes, tally,
};
use test_objects::{Protocol::*, ServiceBuilder, ep, manifest, port, service, slice};

both_modes!(
    tcp_connections_spread_uniformly_over_three_endpoints,
    udp_replies_and_tcp_peer_show_the_cluster_ip,
    an_unconnected_udp_socket_keeps_to_one_pod_and_per_query_sockets_spread,
    an_unconnected_udp_socket_leaves_a_removed_endpoint_within_a_second,
    endpoint_removal_and_addition_take_effect_within_a_second,
    a_service_without_endpoints_refuses_at_once,
    client_ip_affinity_sticks_until_the_timeout,
    multi_port_service_with_a_named_target_port_per_endpoint,
    malformed_services_are_reported_and_the_good_ones_served,
    a_dual_stack_service_is_served_in_ipv4_and_its_ipv6_ports_counted,
    ipv6_sockets_reach_an_ipv4_cluster_ip_through_its_v4_mapped_address,
    the_datapath_survives_an_agent_crash_and_a_restart_replaces_it,
);

const VIP: &str = "10.96.0.10";

/// A lab with `n` web pods (TCP 8080, UDP 5353) and a client pod.
/// The rule-based modes' minimum sync period (kube-proxy's, 1 s): a change
/// made within it of a sync waits for its end. A test of how soon a change
/// takes effect makes the change a period after the last sync, so the time
/// it measures is the agent's reaction, not the period's rest.
const MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);

fn web_lab(setup: Setup, n: usize) -> (Lab, Vec<Pod>, Pod) {
    let mut lab = Lab::with(setup).expect("lab");
    let pods = lab.add_web_pods(n, &[8080], &[5353]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    (lab, pods, client)
}

/// Service `web` at `cluster_ip` (80/TCP → http, 53/UDP → 5353).
fn web_service(cluster_ip: &str, affinity_secs: Option<i32>) -> ServiceBuilder {
    let web = service("lab", "web")
        .cluster_ip(cluster_ip)
        .port(port("http", 80).protocol(Tcp).target_name("http"))
        .port(port("dns", 53).udp().target(5353));
    match affinity_secs {
        Some(secs) => web.client_ip_affinity(Some(secs)),
        None => web,
    }
}

/// `web` and its slice: `pods`, ready, serving http on 8080 and dns on 5353.
fn with_slice(web: ServiceBuilder, pods: &[&Pod]) -> String {
    let endpoints = pods.iter().map(|p| ep(&p.ip).ready(true).node("lab-node"));
    let slice = web.slice().port("http", 8080, Tcp).port("dns", 5353, Udp).endpoints(endpoints);
    manifest(&[&web, &slice])
}

/// Service `web` at the VIP and its slice.
fn web_manifest(pods: &[&Pod], affinity_secs: Option<i32>) -> String {
    with_slice(web_service(VIP, affinity_secs), pods)
}

fn tcp(lab: &Lab, client: &Pod, addr: &str, count: usize) -> Vec<Attempt> {
    lab.client(client).tcp(addr, count).unwrap()
}

fn all_ok(attempts: &[Attempt]) {
    let failed: Vec<_> = attempts.iter().filter(|a| a.pod().is_none()).collect();
    assert!(failed.is_empty(), "failed attempts: {failed:?}");
}

fn tcp_connections_spread_uniformly_over_three_endpoints(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();

    let attempts = tcp(&lab, &client, "10.96.0.10:80", 300);
    all_ok(&attempts);
    let counts = tally(&attempts);
    assert_eq!(counts.len(), 3, "every endpoint answers: {counts:?}");
    for (pod, n) in &counts {
        assert!((60..=141).contains(n), "{pod} got {n}/300, outside 20%..47%: {counts:?}");
    }
    // The backend saw the client itself: no NAT on the socket path.
    if let Attempt::Ok { peer, local, .. } = &attempts[0] {
        assert!(peer.starts_with("10.244.1.100:"), "{peer}");
        assert!(local.ends_with(":8080"), "{local}");
    }
}

fn udp_replies_and_tcp_peer_show_the_cluster_ip(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 2);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();

    let udp = lab.client(&client).udp("10.96.0.10:53", 20).unwrap();
    all_ok(&udp);
    for attempt in &udp {
        let Attempt::Ok { from, local, .. } = attempt else { unreachable!() };
        assert_eq!(from, "10.96.0.10:53", "recvmsg shows the service");
        assert!(local.ends_with(":5353"), "the pod got it on its port: {local}");
    }
    let tcp = tcp(&lab, &client, "10.96.0.10:80", 5);
    all_ok(&tcp);
    for attempt in &tcp {
        let Attempt::Ok { from, .. } = attempt else { unreachable!() };
        assert_eq!(from, "10.96.0.10:80", "getpeername shows the service");
    }
}

/// As kube-proxy's conntrack keeps a UDP 5-tuple on one pod: one socket's
/// datagrams all reach one pod, a socket per query spreads.
fn an_unconnected_udp_socket_keeps_to_one_pod_and_per_query_sockets_spread(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();

    let one_socket =
        lab.client(&client).run(Request::udp("10.96.0.10:53", 1000).interval_ms(0)).unwrap();
    all_ok(&one_socket);
    assert_eq!(one_socket.len(), 1000);
    let counts = tally(&one_socket);
    assert_eq!(counts.len(), 1, "one socket, one pod: {counts:?}");
    for attempt in &one_socket {
        let Attempt::Ok { from, .. } = attempt else { unreachable!() };
        assert_eq!(from, "10.96.0.10:53", "recvmsg shows the service");
    }

    let per_query =
        lab.client(&client).run(Request::udp("10.96.0.10:53", 60).socket_per_datagram()).unwrap();
    all_ok(&per_query);
    let counts = tally(&per_query);
    assert!(counts.len() > 1, "60 sockets, one pod: {counts:?}");
}

/// As kube-proxy deletes the UDP conntrack entries of a removed endpoint:
/// a socket sending through the change moves to a live pod.
fn an_unconnected_udp_socket_leaves_a_removed_endpoint_within_a_second(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();

    let request = Request::udp("10.96.0.10:53", 100).interval_ms(50);
    let mut child = lab.client(&client).spawn(request).unwrap();
    let lines = Arc::new(Mutex::new(Vec::<(Instant, String)>::new()));
    let (stdout, sink) = (child.stdout.take().expect("piped"), lines.clone());
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            sink.lock().unwrap().push((Instant::now(), line));
        }
    });
    let attempts = |since: Instant| -> Vec<Attempt> {
        let lines = lines.lock().unwrap();
        lines.iter().filter(|(t, _)| *t >= since).filter_map(|(_, l)| Attempt::parse(l)).collect()
    };
    let start = Instant::now();
    while attempts(start).len() < 10 {
        assert!(start.elapsed() < Duration::from_secs(10), "the client stalled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = tally(&attempts(start));
    assert_eq!(before.len(), 1, "one socket, one pod: {before:?}");
    let used = before.keys().next().unwrap().clone();

    let kept: Vec<&Pod> = pods.iter().filter(|p| p.name != used).collect();
    std::thread::sleep(MIN_SYNC_PERIOD);
    lab.write_manifest(&web_manifest(&kept, None)).unwrap();
    let removed_at = Instant::now();
    let settled = removed_at + Duration::from_secs(1);
    while attempts(settled).len() < 20 {
        assert!(removed_at.elapsed() < Duration::from_secs(10), "the client stalled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();

    let after = attempts(settled);
    all_ok(&after);
    let counts = tally(&after);
    assert!(!counts.contains_key(&used), "{used} still reached a second after: {counts:?}");
    assert_eq!(counts.len(), 1, "the socket moved to one live pod: {counts:?}");
}

fn endpoint_removal_and_addition_take_effect_within_a_second(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();
    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 30));

    // Remove web-2: a second later, no new connection reaches it.
    std::thread::sleep(MIN_SYNC_PERIOD);
    lab.write_manifest(&web_manifest(&[&pods[0], &pods[1]], None)).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let after = tcp(&lab, &client, "10.96.0.10:80", 60);
    all_ok(&after);
    let counts = tally(&after);
    assert!(!counts.contains_key("web-2"), "removed endpoint still reached: {counts:?}");

    // Add a new pod: a second later, it receives connections.
    let extra = lab.add_pod("web-new", "10.244.1.50").unwrap();
    lab.serve(&extra, &[8080], &[5353]).unwrap();
    std::thread::sleep(MIN_SYNC_PERIOD);
    lab.write_manifest(&web_manifest(&[&pods[0], &pods[1], &extra], None)).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let counts = tally(&tcp(&lab, &client, "10.96.0.10:80", 60));
    assert!(counts.contains_key("web-new"), "new endpoint not reached: {counts:?}");
    assert!(!counts.contains_key("web-2"));
}

fn a_service_without_endpoints_refuses_at_once(setup: Setup) {
    let (mut lab, _pods, client) = web_lab(setup, 0);
    lab.write_manifest(&web_manifest(&[], None)).unwrap();
    lab.start_agent(&[]).unwrap();

    // Before bpf_set_retval (Linux 5.18) the socket programs can only
    // refuse with EPERM (docs/operations.md, "Kernel support").
    let refusal = match setup.mode {
        Mode::Ebpf if !proxy_lab::kernel_at_least(5, 18) => "PermissionDenied",
        _ => "ConnectionRefused",
    };
    for attempt in tcp(&lab, &client, "10.96.0.10:80", 5) {
        match attempt {
            Attempt::Err { ms, kind } => {
                assert_eq!(kind, refusal);
                // At once, not after a timeout (seconds): slower only by
                // the emulated CPU of the VM matrix.
                let at_once = proxy_lab::scaled(Duration::from_millis(100));
                assert!(ms < at_once.as_secs_f64() * 1000.0, "refusal took {ms} ms");
            }
            ok => panic!("connected to a service without endpoints: {ok:?}"),
        }
    }
    // kube-proxy's nftables rules count nothing.
    if setup.mode != Mode::Nftables {
        let refused = lab.count_on(0, Counter::NoBackend).unwrap();
        assert!(refused >= 5, "{refused} refusals counted");
    }
}

/// (backend picks, affinity hits): the datapath's counters, or the packets
/// of the rules that pick at random and of those that check `recent`; the
/// nftables rules count nothing: (the affinity sets holding the client, 0).
fn picks_and_hits(lab: &Lab, mode: Mode) -> (u64, u64) {
    match mode {
        Mode::Nftables => (lab.affinity_sets_holding(0, "10.244.1.100").unwrap(), 0),
        Mode::Ebpf => (
            lab.counter(Counter::BackendPicked).unwrap(),
            lab.counter(Counter::AffinityHit).unwrap(),
        ),
        Mode::Iptables => {
            // Without --cluster-cidr the KUBE-SVC chain holds only these.
            let hits = lab.rule_packets_on(0, "nat", "--rcheck").unwrap();
            let all = lab.rule_packets_on(0, "nat", "-A KUBE-SVC-").unwrap();
            (all - hits, hits)
        }
    }
}

fn client_ip_affinity_sticks_until_the_timeout(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), Some(2))).unwrap();
    lab.start_agent(&[]).unwrap();

    let first = tcp(&lab, &client, "10.96.0.10:80", 50);
    all_ok(&first);
    let counts = tally(&first);
    assert_eq!(counts.len(), 1, "50 connections of one client reach one backend: {counts:?}");
    let nft = setup.mode == Mode::Nftables;
    assert_eq!(picks_and_hits(&lab, setup.mode), if nft { (1, 0) } else { (1, 49) });

    // Idle past the timeout: the next connection is a fresh random pick,
    // and the ones after it stick to that pick.
    std::thread::sleep(Duration::from_millis(2500));
    if nft {
        assert_eq!(picks_and_hits(&lab, setup.mode), (0, 0), "the client's entry timed out");
    }
    let second = tcp(&lab, &client, "10.96.0.10:80", 10);
    all_ok(&second);
    assert_eq!(tally(&second).len(), 1);
    let expected = if nft { (1, 0) } else { (2, 58) };
    assert_eq!(picks_and_hits(&lab, setup.mode), expected, "a new pick after the timeout");
}

fn multi_port_service_with_a_named_target_port_per_endpoint(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    // web-a and web-b name their "http" port 8080, web-c names it 8081; all
    // serve "metrics" on 9100.
    let a = lab.add_pod("web-a", "10.244.1.2").unwrap();
    let b = lab.add_pod("web-b", "10.244.1.3").unwrap();
    let c = lab.add_pod("web-c", "10.244.1.4").unwrap();
    lab.serve(&a, &[8080, 9100], &[]).unwrap();
    lab.serve(&b, &[8080, 9100], &[]).unwrap();
    lab.serve(&c, &[8081, 9100], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let multi = service("lab", "multi")
        .cluster_ip("10.96.0.20")
        .port(port("http", 80).target_name("http"))
        .port(port("metrics", 9090).target(9100));
    let slice = |name, http, ips: &[&str]| {
        let slice = slice("lab", name).service("multi").port("http", http, Tcp);
        slice.port("metrics", 9100, Tcp).endpoints(ips.iter().map(|ip| ep(ip)))
    };
    let a = slice("multi-a", 8080, &["10.244.1.2", "10.244.1.3"]);
    let b = slice("multi-b", 8081, &["10.244.1.4"]);
    lab.write_manifest(&manifest(&[&multi, &a, &b])).unwrap();
    lab.start_agent(&[]).unwrap();

    for (vip, expect) in [("10.96.0.20:80", None), ("10.96.0.20:9090", Some(":9100"))] {
        let attempts = tcp(&lab, &client, vip, 90);
        all_ok(&attempts);
        assert_eq!(tally(&attempts).len(), 3, "{vip}: {:?}", tally(&attempts));
        for attempt in &attempts {
            let Attempt::Ok { name, local, .. } = attempt else { unreachable!() };
            let port = expect.unwrap_or(if name == "web-c" { ":8081" } else { ":8080" });
            assert!(local.ends_with(port), "{vip} reached {name} on {local}");
        }
    }
}

fn malformed_services_are_reported_and_the_good_ones_served(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 2);
    let bad = r#"
---
apiVersion: v1
kind: Service
metadata: {name: bad-ip, namespace: lab}
spec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: port-zero, namespace: lab}
spec: {clusterIP: 10.96.0.31, ports: [{port: 0}]}
---
apiVersion: v1
kind: Service
metadata: {name: bad-proto, namespace: lab}
spec: {clusterIP: 10.96.0.32, ports: [{port: 80, protocol: QUIC}]}
"#;
    // An API server refuses what does not decode; a manifest file may hold it.
    let undecodable = r#"---
apiVersion: v1
kind: Service
metadata: {name: bad-type, namespace: lab}
spec: {clusterIP: 10.96.0.33, ports: [{port: eighty}]}
"#;
    let (extra, count) = match setup.source {
        Source::Manifests => (undecodable, 4),
        Source::ApiServer => ("", 3),
    };
    let pods: Vec<&Pod> = pods.iter().collect();
    let manifest = |cluster_ip| with_slice(web_service(cluster_ip, None), &pods) + bad + extra;
    lab.write_manifest(&manifest(VIP)).unwrap();
    lab.start_agent(&[]).unwrap();

    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 20));
    // The bad ones have no frontend: their addresses stay unreachable (a
    // frontend without endpoints would refuse at once instead).
    let unserved = lab.client(&client).timeout_ms(300).tcp("10.96.0.32:80", 1).unwrap();
    assert!(
        matches!(&unserved[..], [Attempt::Err { kind, .. }] if kind == "TimedOut"),
        "{unserved:?}"
    );

    let deadline = Instant::now() + Duration::from_secs(5);
    let metrics = loop {
        let metrics = lab.metrics().unwrap();
        if metrics.contains(&format!("proxy_invalid_objects_total{{kind=\"Service\"}} {count}\n"))
            || Instant::now() > deadline
        {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let invalid = format!("proxy_invalid_objects_total{{kind=\"Service\"}} {count}\n");
    assert!(metrics.contains(&invalid), "{metrics}");
    let log = lab.agent_log();
    for name in ["lab/bad-ip", "lab/port-zero", "lab/bad-proto", "lab/bad-type"].iter().take(count)
    {
        assert!(log.contains(name), "{name} not in the log:\n{log}");
    }
    assert!(!log.contains("panicked"));

    // Breaking the good service keeps its last good version in service.
    lab.write_manifest(&manifest("10.96.0.999")).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 10));
    assert!(lab.agent_log().contains("serving the last good version"));
    assert!(lab.agent_alive());
}

/// A dual-stack service on a node without an IPv6 address: its IPv4 family
/// is served as any service. Its IPv6 ports are served by the eBPF mode's
/// socket LB (a ClusterIP needs no node address); the iptables mode, which
/// writes IPv6 rules only on a node with an IPv6 address, counts and logs
/// them as unserved (IPv6 traffic: tests/tests/ipv6.rs).
fn a_dual_stack_service_is_served_in_ipv4_and_its_ipv6_ports_counted(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 2);
    let web = web_service(VIP, None)
        .cluster_ips(&[VIP, "fd00:96::10"])
        .ip_families(&["IPv4", "IPv6"])
        .ip_family_policy("RequireDualStack");
    let v6 = slice("lab", "web-2").service("web").address_type("IPv6");
    let v6 = v6.port("http", 8080, Tcp).port("dns", 5353, Udp).endpoint(ep("fd00:244:1::2"));
    let pods: Vec<&Pod> = pods.iter().collect();
    lab.write_manifest(&(with_slice(web, &pods) + "---\n" + &manifest(&[&v6]))).unwrap();
    lab.start_agent(&[]).unwrap();

    let attempts = tcp(&lab, &client, "10.96.0.10:80", 20);
    all_ok(&attempts);
    assert_eq!(tally(&attempts).len(), 2, "only the IPv4 endpoints: {attempts:?}");
    let unserved = match setup.mode {
        Mode::Ebpf => 0,
        Mode::Iptables | Mode::Nftables => 2,
    };
    let unserved = format!("proxy_unserved_service_ports{{ip_family=\"IPv6\"}} {unserved}\n");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !lab.metrics().unwrap().contains(&unserved) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let metrics = lab.metrics().unwrap();
    assert!(metrics.contains(&unserved), "{metrics}");
    let log = lab.agent_log();
    let logged = log.matches("IPv6 service ports are not served").count();
    assert_eq!(logged, usize::from(setup.mode.rules()), "{log}");
}

/// Scenario 2 of issue 12: an AF_INET6 socket reaching an IPv4 ClusterIP
/// through its v4-mapped address, as dual-stack applications do: TCP and
/// UDP reach the IPv4 endpoints, and the socket sees `::ffff:10.96.0.10`
/// as its peer and its replies' source. eBPF: translated at `connect()` by
/// `connect6` (no per-packet flow); iptables: the kernel sends such a
/// socket's packets as IPv4, which the rules translate.
fn ipv6_sockets_reach_an_ipv4_cluster_ip_through_its_v4_mapped_address(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 2);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();
    let per_packet = || match setup.mode {
        Mode::Ebpf => lab.counter(Counter::CtNew).unwrap(),
        Mode::Iptables | Mode::Nftables => 0,
    };
    let before = per_packet();
    let attempts = tcp(&lab, &client, "[::ffff:10.96.0.10]:80", 20);
    all_ok(&attempts);
    assert_eq!(tally(&attempts).len(), 2, "both endpoints: {attempts:?}");
    let udp = lab.client(&client).udp("[::ffff:10.96.0.10]:53", 5).unwrap();
    all_ok(&udp);
    for (attempt, expected) in
        attempts.iter().map(|a| (a, "80")).chain(udp.iter().map(|a| (a, "53")))
    {
        let Attempt::Ok { from, .. } = attempt else { unreachable!() };
        assert_eq!(*from, format!("[::ffff:10.96.0.10]:{expected}"), "the service, v4-mapped");
    }
    assert_eq!(per_packet(), before, "translated at the socket, not per packet");
}

#[test]
fn maps_dump_with_field_names_and_cleanup_removes_everything() {
    let (mut lab, pods, _client) = web_lab(Setup::EBPF, 1);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();
    let services = lab.dump_map("SERVICES").unwrap();
    assert!(services.contains("\"backend_id\""), "{services}");
    let backends = lab.dump_map("BACKENDS").unwrap();
    assert!(backends.contains("\"address\": [10,244,1,2\n"), "{backends}");
    assert!(backends.contains("\"port\": 8080"), "{backends}");

    let cgroup = lab.cgroup.to_string_lossy().into_owned();
    let attached = proxy_lab::sh("bpftool", &["cgroup", "show", &cgroup]).unwrap();
    let programs = ["connect4", "sendmsg4", "recvmsg4", "getpeername4"];
    for program in programs.iter().chain(&["connect6", "sendmsg6", "recvmsg6", "getpeername6"]) {
        assert!(attached.contains(program), "{attached}");
    }
    lab.cleanup_on(0).unwrap();
    assert!(!lab.pins.exists(), "pins left behind");
    // The agent still runs and holds its maps, but no program is attached.
    let attached = proxy_lab::sh("bpftool", &["cgroup", "show", &cgroup]).unwrap();
    assert!(!attached.contains("connect4"), "{attached}");
}

fn the_datapath_survives_an_agent_crash_and_a_restart_replaces_it(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 2);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&[]).unwrap();
    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 10));
    let cgroup = lab.cgroup.to_string_lossy().into_owned();
    // The ids of the programs attached to the test cgroup (eBPF).
    let programs = || {
        let attached = proxy_lab::sh("bpftool", &["-j", "cgroup", "show", &cgroup]).unwrap();
        let attached: Vec<serde_json::Value> = serde_json::from_str(&attached).unwrap_or_default();
        attached.iter().filter_map(|p| p["id"].as_u64()).collect::<BTreeSet<_>>()
    };
    let old_programs = programs();
    assert_eq!(old_programs.is_empty(), setup.mode.rules(), "{old_programs:?}");

    lab.kill_agent();
    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 10));

    // A new agent that cannot read its source (a broken manifest, an API
    // server down) leaves the old datapath be.
    let good = web_manifest(&pods.iter().collect::<Vec<_>>(), None);
    match lab.api() {
        None => drop(lab.write_manifest("kind: [this is not yaml").unwrap()),
        Some(api) => api.set_up(false),
    }
    lab.spawn_agent_on(0, &[]).unwrap();
    // It says so every 2 s once its programs are loaded (which takes a few
    // seconds of verifier time on a loaded machine).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !lab.agent_log().contains("waiting for the whole source") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 10));
    assert!(lab.agent_log().contains("waiting for the whole source"), "{}", lab.agent_log());

    // Once it can, it takes over: eBPF attaches beside the pinned programs,
    // then retires them; iptables rewrites the rules, jumps not doubled.
    match lab.api() {
        None => drop(lab.write_manifest(&good).unwrap()),
        Some(api) => api.set_up(true),
    }
    // The watchers retry with backoff (up to 3.2 s after a few failures).
    let deadline = Instant::now() + Duration::from_secs(20);
    while lab.agent_log().matches("datapath ready; serving").count() < 2 {
        assert!(Instant::now() < deadline, "the new agent never served:\n{}", lab.agent_log());
        assert!(lab.agent_alive(), "the new agent exited:\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
    match setup.mode {
        Mode::Ebpf => {
            let attached = proxy_lab::sh("bpftool", &["cgroup", "show", &cgroup]).unwrap();
            assert_eq!(attached.matches("connect4").count(), 1, "{attached}");
            assert_eq!(attached.lines().count(), 9, "a header and eight programs: {attached}");
            let new_programs = programs();
            assert!(new_programs.is_disjoint(&old_programs), "{old_programs:?} {new_programs:?}");
        }
        Mode::Iptables => {
            let saved = lab.iptables_save_on(0).unwrap();
            assert_eq!(saved.matches("-A PREROUTING").count(), 1, "{saved}");
            assert_eq!(saved.matches("lab/web:http cluster IP").count(), 1, "{saved}");
        }
        Mode::Nftables => {
            let table = lab.exec_on(0, "nft", &["list", "table", "ip", "kube-proxy"]).unwrap();
            assert_eq!(table.matches("jump services").count(), 2, "{table}");
            assert_eq!(table.matches("10.96.0.10 . tcp . 80 : goto").count(), 1, "{table}");
        }
    }
    all_ok(&tcp(&lab, &client, "10.96.0.10:80", 30));
    assert_eq!(tally(&tcp(&lab, &client, "10.96.0.10:80", 60)).len(), 2);
}

/// `--socket-lb-host-netns-only`: the socket programs leave the sockets of
/// pods alone (a mesh sidecar or a VM sees the ClusterIP), and the
/// per-packet path serves them; the node's own sockets are still
/// translated at `connect()`. eBPF only: the iptables mode has no socket
/// path.
#[test]
fn ebpf_host_netns_only_leaves_pods_to_the_per_packet_path() {
    let (mut lab, pods, client) = web_lab(Setup::EBPF, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(&["--socket-lb-host-netns-only", "--cluster-cidr", "10.244.0.0/16"]).unwrap();

    let before = lab.counter(Counter::CtNew).unwrap();
    let attempts = tcp(&lab, &client, &format!("{VIP}:80"), 20);
    all_ok(&attempts);
    let per_packet = lab.counter(Counter::CtNew).unwrap() - before;
    assert!(per_packet >= 20, "the pod's connections went per packet: {per_packet} new flows");
    for attempt in &attempts {
        let Attempt::Ok { from, peer, .. } = attempt else { unreachable!() };
        assert_eq!(from, &format!("{VIP}:80"), "the pod's socket still sees the service");
        assert!(peer.starts_with("10.244.1.100:"), "and the backend the pod: {peer}");
    }

    let node = Pod { name: "node".into(), netns: lab.node.clone(), ip: NODE_IP.into() };
    let before = lab.counter(Counter::CtNew).unwrap();
    all_ok(&tcp(&lab, &node, &format!("{VIP}:80"), 10));
    let per_packet = lab.counter(Counter::CtNew).unwrap() - before;
    assert_eq!(per_packet, 0, "the node's own sockets are translated at connect()");
}

both_modes!(
    a_connected_udp_socket_leaves_a_removed_endpoint_within_a_second,
    a_connected_udp_socket_leaves_a_deleted_pod_within_a_second,
    a_v4_mapped_connected_udp_socket_leaves_a_removed_endpoint_within_a_second,
    a_pod_leaving_one_service_keeps_the_sockets_of_another,
);

/// A connected UDP socket talking to a pod whose endpoint is removed (the
/// pod stays and would answer): within a second it gets an error (eBPF: the
/// agent ends the socket) or a live pod's answer (iptables: the conntrack
/// entry is flushed), and after reconnecting only live pods answer. eBPF
/// mode on this kernel: the socket iterators end it.
fn a_connected_udp_socket_leaves_a_removed_endpoint_within_a_second(setup: Setup) {
    connected_udp_socket_after_its_pod_leaves(setup, false, &[], VIP_DNS)
}

/// The same when the pod is deleted with its endpoint (its network gone).
fn a_connected_udp_socket_leaves_a_deleted_pod_within_a_second(setup: Setup) {
    connected_udp_socket_after_its_pod_leaves(setup, true, &[], VIP_DNS)
}

/// The same for an IPv6 socket connected to the v4-mapped cluster IP.
fn a_v4_mapped_connected_udp_socket_leaves_a_removed_endpoint_within_a_second(setup: Setup) {
    connected_udp_socket_after_its_pod_leaves(setup, false, &[], MAPPED_DNS)
}

const VIP_DNS: &str = "10.96.0.10:53";
const MAPPED_DNS: &str = "[::ffff:10.96.0.10]:53";

/// The cases again with sock_diag ending the socket, the way kernels
/// without `bpf_sock_destroy` (before 6.5) take.
#[test]
fn ebpf_sock_diag_ends_a_connected_udp_socket_whose_pod_leaves() {
    for (delete_pod, vip) in [(false, VIP_DNS), (true, VIP_DNS), (false, MAPPED_DNS)] {
        connected_udp_socket_after_its_pod_leaves(
            Setup::EBPF,
            delete_pod,
            &["--socket-destroy", "sock-diag"],
            vip,
        );
    }
}

/// A client's attempts as it prints them, each with when it came.
struct Follow {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<(Instant, String)>,
    reader: std::thread::JoinHandle<()>,
}

impl Follow {
    fn start(client: Client, request: Request) -> Self {
        let mut child = client.spawn(request).unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send((Instant::now(), line));
            }
        });
        Follow { child, lines, reader }
    }

    fn next(&self) -> (Instant, Attempt) {
        let (at, line) = self.lines.recv_timeout(Duration::from_secs(5)).expect("it answers");
        (at, Attempt::parse(&line).unwrap_or_else(|| panic!("not an attempt: {line}")))
    }

    /// The next `n` attempts, with how long after `since` each came.
    fn take(&self, n: usize, since: Instant) -> Vec<(Duration, Attempt)> {
        (0..n)
            .map(|_| {
                let (at, attempt) = self.next();
                (at.duration_since(since), attempt)
            })
            .collect()
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = self.reader.join();
    }
}

/// Datagrams over one connected socket (reconnecting after an error), 20 a
/// second; one to a pod just deleted is lost, a short timeout reports it.
fn connected_udp(lab: &Lab, client: &Pod, vip: &str) -> Follow {
    let request = Request::udp(vip, 200).interval_ms(50).connected().reconnecting();
    Follow::start(lab.client(client).timeout_ms(300), request)
}

/// The attempts started a second or more after the change.
fn a_second_after(after: &[(Duration, Attempt)]) -> Vec<&(Duration, Attempt)> {
    let started = |(at, attempt): &&(Duration, Attempt)| {
        at.saturating_sub(Duration::from_secs_f64(attempt.ms() / 1000.0)) > Duration::from_secs(1)
    };
    let late: Vec<_> = after.iter().filter(started).collect();
    assert!(late.len() > 10, "{after:?}");
    late
}

/// The late attempts were answered by live pods through `vip`, never `gone`.
fn answered_without(after: &[(Duration, Attempt)], gone: &str, vip: &str) {
    for (at, attempt) in a_second_after(after) {
        let pod = attempt.pod().unwrap_or_else(|| panic!("failed {at:?} after: {after:?}"));
        assert_ne!(pod, gone, "{gone} still answers {at:?} after its removal: {after:?}");
        let Attempt::Ok { from, .. } = attempt else { unreachable!() };
        assert_eq!(from, vip, "{after:?}");
    }
}

fn connected_udp_socket_after_its_pod_leaves(
    setup: Setup,
    delete_pod: bool,
    agent: &[&str],
    vip: &str,
) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>(), None)).unwrap();
    lab.start_agent(agent).unwrap();
    let follow = connected_udp(&lab, &client, vip);
    let Attempt::Ok { name: gone, .. } = follow.next().1 else { panic!("first datagram") };
    // A second of the socket's datagrams first: they stay with its pod,
    // and the change comes past the minimum sync period
    // ([`MIN_SYNC_PERIOD`]).
    let before = follow.take(20, Instant::now());
    assert!(before.iter().all(|(_, a)| a.pod() == Some(gone.as_str())), "{before:?}");
    let kept: Vec<&Pod> = pods.iter().filter(|p| p.name != gone).collect();
    lab.write_manifest(&web_manifest(&kept, None)).unwrap();
    if delete_pod {
        lab.unplug_pod(pods.iter().find(|p| p.name == gone).unwrap()).unwrap();
    }
    let after = follow.take(40, Instant::now());
    follow.stop();
    answered_without(&after, &gone, vip);
}

/// A pod behind two services leaves one of them: a connected socket to
/// that service leaves it within a second, while a connected socket to the
/// other service keeps talking to it undisturbed (kube-proxy flushes per
/// service and endpoint; the eBPF mode ends per frontend and backend).
fn a_pod_leaving_one_service_keeps_the_sockets_of_another(setup: Setup) {
    let (mut lab, pods, client) = web_lab(setup, 3);
    // `dns` at 10.96.0.11 sends to the first pod only.
    let dns =
        service("lab", "dns").cluster_ip("10.96.0.11").port(port("dns", 53).udp().target(5353));
    let web = web_service(VIP, None);
    let write = |lab: &mut Lab, web_pods: &[&Pod]| {
        let ready = |p: &Pod| ep(&p.ip).ready(true).node("lab-node");
        let dns_slice = dns.slice().port("dns", 5353, Udp).endpoints([ready(&pods[0])]);
        let web_slice = web
            .slice()
            .port("http", 8080, Tcp)
            .port("dns", 5353, Udp)
            .endpoints(web_pods.iter().map(|p| ready(p)));
        lab.write_manifest(&manifest(&[&web, &web_slice, &dns, &dns_slice])).unwrap();
    };
    write(&mut lab, &pods.iter().collect::<Vec<_>>());
    lab.start_agent(&[]).unwrap();
    // Connect to `web` until the socket lands on the first pod.
    let web = (0..30)
        .map(|_| connected_udp(&lab, &client, "10.96.0.10:53"))
        .find_map(|follow| match follow.next().1.pod() {
            Some(pod) if pod == pods[0].name => Some(follow),
            _ => {
                follow.stop();
                None
            }
        })
        .expect("a socket to web lands on the first pod");
    let dns_socket = connected_udp(&lab, &client, "10.96.0.11:53");
    assert_eq!(dns_socket.next().1.pod(), Some(pods[0].name.as_str()));
    // A second of datagrams first: they stay with the first pod, and the
    // change comes past the minimum sync period ([`MIN_SYNC_PERIOD`]). The
    // other socket's, read meanwhile, are set aside: what is read of it
    // next is what came after the change.
    let before = web.take(20, Instant::now());
    assert!(before.iter().all(|(_, a)| a.pod() == Some(pods[0].name.as_str())), "{before:?}");
    drop(dns_socket.take(20, Instant::now()));

    write(&mut lab, &pods[1..].iter().collect::<Vec<_>>());
    let changed = Instant::now();
    let after_web = web.take(40, changed);
    let after_dns = dns_socket.take(40, changed);
    web.stop();
    dns_socket.stop();
    answered_without(&after_web, &pods[0].name, "10.96.0.10:53");
    for (at, attempt) in &after_dns {
        assert_eq!(attempt.pod(), Some(pods[0].name.as_str()), "{at:?}: {after_dns:?}");
    }
}

/// TCP connections to a removed endpoint are left alone by default (as
/// kube-proxy leaves established flows) and ended with
/// `--terminate-tcp-on-endpoint-removal`, by either way of ending sockets.
/// eBPF only: the flag is the socket path's.
#[test]
fn ebpf_tcp_connections_to_a_removed_endpoint_end_only_when_asked() {
    let ways = [(false, "bpf-iterator"), (true, "bpf-iterator"), (true, "sock-diag")];
    for (terminate, way) in ways {
        let mut lab = Lab::with(Setup::EBPF).unwrap();
        let pod = lab.add_pod("web-0", "10.244.1.2").unwrap();
        lab.serve_echo(&pod, 9000).unwrap();
        let client = lab.add_pod("client", "10.244.1.100").unwrap();
        let echo = service("lab", "echo").cluster_ip(VIP).port(port("echo", 90).target(9000));
        let with = |pods: &[&Pod]| {
            let endpoints = pods.iter().map(|p| ep(&p.ip).ready(true).node("lab-node"));
            manifest(&[&echo, &echo.slice().port("echo", 9000, Tcp).endpoints(endpoints)])
        };
        lab.write_manifest(&with(&[&pod])).unwrap();
        let flag: &[&str] = if terminate { &["--terminate-tcp-on-endpoint-removal"] } else { &[] };
        lab.start_agent(&[flag, &["--socket-destroy", way]].concat()).unwrap();
        let request = Request::stream("10.96.0.10:90", 60).interval_ms(50);
        let child = lab.client(&client).spawn(request).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        lab.write_manifest(&with(&[])).unwrap();
        let out = child.wait_with_output().unwrap();
        let attempts: Vec<Attempt> =
            String::from_utf8_lossy(&out.stdout).lines().filter_map(Attempt::parse).collect();
        let failed = attempts.iter().filter(|a| a.pod().is_none()).count();
        if terminate {
            assert_eq!(failed, 1, "the connection ended: {attempts:?}");
            assert!(attempts.len() < 60, "before its last exchange: {}", attempts.len());
        } else {
            assert_eq!((failed, attempts.len()), (0, 60), "left alone: {attempts:?}");
        }
    }
}
