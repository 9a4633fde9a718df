//! IPv6 and dual-stack traffic in a dual-stack lab ([`Lab::dual_stack`]):
//! pods with an IPv4 /32 and an IPv6 /128 behind the link-local gateway
//! fe80::1, nodes and an external client on both families of the fabric.
//!
//! Every scenario runs in both modes and from the test API server
//! (`external_modes!`, XDP too): in eBPF mode a pod's sockets meet the socket LB, the
//! external client's packets (and those of a pod outside the socket-LB
//! cgroup) the per-packet programs.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use proxy_lab::{
    Attempt, EXT_IP, EXT_IP6, Lab, Mode, NODE_IP6, Pod, Request, Setup, answered_after,
    external_modes, sample, tally, v6,
};
use test_objects::{Protocol::*, ServiceBuilder, ep, manifest, port, service, slice};

external_modes!(
    a_dual_stack_service_reaches_each_familys_endpoints_on_each_cluster_ip,
    ipv6_node_port_cluster_policy_reaches_the_backend_from_the_nodes_ipv6_address,
    ipv6_node_port_local_policy_keeps_the_clients_ipv6_address,
    ipv6_hairpin_a_pod_reaches_itself_through_its_cluster_ip,
    ipv6_services_without_endpoints_refuse_pods,
    ipv6_node_ports_without_endpoints_refuse,
    ipv6_udp_flows_move_off_a_removed_endpoint,
    ipv6_connected_udp_sockets_move_off_a_removed_endpoint,
    an_ipv6_only_service_is_served_from_kube_proxys_ip6tables_chains,
    lb_and_ct_list_show_both_families,
    explain_ipv6_agrees_with_real_packets,
);

const CLUSTER_CIDRS: &str = "10.244.0.0/16,fd00:244::/32";

/// One dual-stack node; pods web-a, web-b, web-c (10.244.1.2-4 and
/// fd00:244:1::2-4) serving TCP 8080 and UDP 5353, a client pod, an
/// external client; the agent running on `manifest`.
struct DualLab {
    lab: Lab,
    pods: Vec<Pod>,
    client: Pod,
    ext: Pod,
}

fn dual_lab(setup: Setup, manifest: &str) -> DualLab {
    dual_lab_with(setup, manifest, &[])
}

/// The same, the agent taking `args` too.
fn dual_lab_with(setup: Setup, manifest: &str, args: &[&str]) -> DualLab {
    let mut lab = Lab::with(setup).unwrap();
    lab.dual_stack().unwrap();
    let mut pods = Vec::new();
    for (name, ip) in [("web-a", "10.244.1.2"), ("web-b", "10.244.1.3"), ("web-c", "10.244.1.4")] {
        let pod = lab.add_pod(name, ip).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        pods.push(pod);
    }
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.write_manifest(manifest).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&[&["--cluster-cidr", CLUSTER_CIDRS], args].concat()).unwrap();
    DualLab { lab, pods, client, ext }
}

/// `ip:port`, bracketed for IPv6.
fn at(ip: &str, port: u16) -> String {
    SocketAddr::new(ip.parse().unwrap(), port).to_string()
}

fn ip_of(addr: &str) -> IpAddr {
    addr.parse::<SocketAddr>().unwrap_or_else(|e| panic!("{addr}: {e}")).ip()
}

/// `(pod, peer address as the pod saw it, reply source)` of each attempt;
/// a failed attempt fails the test.
fn answers(attempts: &[Attempt]) -> Vec<(String, IpAddr, String)> {
    attempts
        .iter()
        .map(|a| match a {
            Attempt::Ok { name, peer, from, .. } => (name.clone(), ip_of(peer), from.clone()),
            err => panic!("failed attempt: {err:?} in {attempts:?}"),
        })
        .collect()
}

/// Pods by letter, as endpoints of `family` ("IPv4" or "IPv6") on node 0.
fn endpoints(family: &str, pods: &[&str]) -> Vec<test_objects::EndpointBuilder> {
    pods.iter()
        .map(|p| {
            let v4 = format!("10.244.1.{}", 2 + (p.as_bytes()[0] - b'a'));
            let address = if family == "IPv6" { v6(&v4) } else { v4 };
            ep(&address).node("lab-node")
        })
        .collect()
}

/// Ports http 80 → 8080 and dns 53/UDP → 5353.
fn web_ports(service: ServiceBuilder) -> ServiceBuilder {
    service.port(port("http", 80).target(8080)).port(port("dns", 53).udp().target(5353))
}

/// The same, on node ports.
fn node_ports(service: ServiceBuilder, http: i32, dns: i32) -> ServiceBuilder {
    service
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(http))
        .port(port("dns", 53).udp().target(5353).node_port(dns))
}

/// Service `name` with a slice per family over the `v4` and `v6` pods by
/// letter (a family without pods has no slice), ports http 8080 and dns
/// 5353/UDP.
fn over(service: ServiceBuilder, name: &str, v4: &[&str], v6_pods: &[&str]) -> String {
    let mut docs = manifest(&[&service]);
    for (family, pods) in [("IPv4", v4), ("IPv6", v6_pods)] {
        if pods.is_empty() {
            continue;
        }
        let slice = slice("lab", &format!("{name}-{}", family.to_lowercase()))
            .service(name)
            .address_type(family)
            .port("http", 8080, Tcp)
            .port("dns", 5353, Udp)
            .endpoints(endpoints(family, pods));
        docs = docs + "---\n" + &manifest(&[&slice]);
    }
    docs
}

/// A RequireDualStack service `name` at the two cluster IPs.
fn dual(name: &str, ip4: &str, ip6: &str) -> ServiceBuilder {
    service("lab", name)
        .cluster_ip(ip4)
        .cluster_ips(&[ip4, ip6])
        .ip_families(&["IPv4", "IPv6"])
        .ip_family_policy("RequireDualStack")
}

/// A SingleStack IPv6 service `name` at `ip6`.
fn ipv6_only(name: &str, ip6: &str) -> ServiceBuilder {
    service("lab", name).cluster_ip(ip6).cluster_ips(&[ip6]).ip_families(&["IPv6"])
}

/// Scenario 1 of issue 12: each ClusterIP reaches only its family's endpoints.
fn a_dual_stack_service_reaches_each_familys_endpoints_on_each_cluster_ip(setup: Setup) {
    let web = web_ports(dual("web", "10.96.0.10", "fd00:96::10"));
    let c = dual_lab(setup, &over(web, "web", &["a", "b"], &["c"]));
    let client6: IpAddr = v6(&c.client.ip).parse().unwrap();

    let v4 = c.lab.client(&c.client).tcp("10.96.0.10:80", 20).unwrap();
    let seen: BTreeSet<String> = answers(&v4).into_iter().map(|(name, ..)| name).collect();
    assert_eq!(seen, BTreeSet::from(["web-a".into(), "web-b".into()]), "{v4:?}");

    for proto in ["tcp", "udp"] {
        let vip = at("fd00:96::10", if proto == "tcp" { 80 } else { 53 });
        let attempts = c.lab.client(&c.client).run(Request::of(proto, &vip, 10)).unwrap();
        for (name, peer, from) in answers(&attempts) {
            assert_eq!(name, "web-c", "only the IPv6 endpoint: {attempts:?}");
            assert_eq!(peer, client6, "a pod's address is kept");
            assert_eq!(from, vip, "{proto} replies come from the IPv6 cluster IP");
        }
    }
}

/// Scenario 3 (policy Cluster): the backend sees the node's IPv6 address.
fn ipv6_node_port_cluster_policy_reaches_the_backend_from_the_nodes_ipv6_address(setup: Setup) {
    let np = node_ports(dual("np", "10.96.0.11", "fd00:96::11"), 30080, 30053);
    let c = dual_lab(setup, &over(np, "np", &["a", "b"], &["a", "b"]));
    for (proto, node_port, count) in [("tcp", 30080, 30), ("udp", 30053, 10)] {
        let to = at(NODE_IP6, node_port);
        let attempts = c.lab.client_outside(&c.ext).run(Request::of(proto, &to, count)).unwrap();
        let seen = answers(&attempts);
        for (_, peer, from) in &seen {
            assert_eq!(
                *peer,
                NODE_IP6.parse::<IpAddr>().unwrap(),
                "masqueraded to the node's IPv6"
            );
            assert_eq!(*from, to, "{proto} replies come from the NodePort");
        }
        if proto == "tcp" {
            assert_eq!(tally(&attempts).len(), 2, "both endpoints: {:?}", tally(&attempts));
        }
    }
    if setup.mode == Mode::Ebpf {
        // The IPv6 per-packet programs, loaded for the first IPv6 frontend
        // (an IPv4-only node never verifies them: `sctp.rs`), once.
        let log = c.lab.agent_log();
        assert_eq!(log.matches("the IPv6 programs are loaded").count(), 1, "{log}");
        // With XDP, IPv6 packets met `xdp_ingress6` (a kernel whose verifier
        // refuses it leaves them to tc, and says so).
        if setup.xdp {
            assert!(!log.contains("the IPv6 XDP program does not load"), "{log}");
        }
    }
    // Each TCP attempt a new flow of the service port (issue 13), in both
    // modes; the UDP client's datagrams share one socket, so one flow.
    if !setup.mode.counts() {
        return;
    }
    let series = "proxy_service_connections_total";
    let labels =
        |port: &str| format!("namespace=\"lab\",service=\"np\",port=\"{port}\",path=\"packet\"");
    let metrics = c.lab.metrics_reaching(series, &labels("dns"), 1).unwrap();
    assert_eq!(sample(&metrics, series, &labels("http")), 30, "{metrics}");
    assert_eq!(sample(&metrics, series, &labels("dns")), 1, "{metrics}");
    if setup.mode == Mode::Ebpf {
        // Packets and bytes from the flows' `CONNTRACK6` entries, summed at
        // the agent's next collection: each TCP attempt at least a SYN, a
        // SYN-ACK and an ACK, each UDP datagram answered; at least 62 bytes
        // each (Ethernet, IPv6, UDP headers).
        let series = "proxy_service_packets_total";
        let port = |port: &str| format!("namespace=\"lab\",service=\"np\",port=\"{port}\"");
        for (name, at_least) in [("http", 3 * 30), ("dns", 2 * 10)] {
            let metrics = c.lab.metrics_reaching(series, &port(name), at_least).unwrap();
            let packets = sample(&metrics, series, &port(name));
            assert!(packets >= at_least, "{name}: {packets} packets:\n{metrics}");
            let bytes = sample(&metrics, "proxy_service_bytes_total", &port(name));
            assert!(bytes >= 62 * packets, "{name}: {bytes} bytes of {packets} packets");
        }
    }
}

/// Scenario 3 (policy Local): the backend sees the client's IPv6 address.
fn ipv6_node_port_local_policy_keeps_the_clients_ipv6_address(setup: Setup) {
    let np = dual("local", "10.96.0.12", "fd00:96::12").external_policy("Local");
    let np = node_ports(np, 30081, 30054);
    let c = dual_lab(setup, &over(np, "local", &["a"], &["a"]));
    for (proto, node_port) in [("tcp", 30081), ("udp", 30054)] {
        let to = at(NODE_IP6, node_port);
        for (name, peer, from) in
            answers(&c.lab.client_outside(&c.ext).run(Request::of(proto, &to, 10)).unwrap())
        {
            assert_eq!(name, "web-a");
            assert_eq!(peer, EXT_IP6.parse::<IpAddr>().unwrap(), "the client's address is kept");
            assert_eq!(from, to);
        }
    }
}

/// Scenario 4: a pod reaching itself through its IPv6 cluster IP is
/// masqueraded, so its reply returns through the node. The pod is outside
/// the socket-LB cgroup: only the per-packet path sees its packets.
fn ipv6_hairpin_a_pod_reaches_itself_through_its_cluster_ip(setup: Setup) {
    let own = web_ports(ipv6_only("self", "fd00:96::20"));
    let c = dual_lab(setup, &over(own, "self", &[], &["a"]));
    let vip = at("fd00:96::20", 80);
    let attempts = c.lab.client_outside(&c.pods[0]).tcp(&vip, 10).unwrap();
    for (name, peer, from) in answers(&attempts) {
        assert_eq!(name, "web-a");
        assert_eq!(from, vip, "the reply comes from the service");
        assert_eq!(peer, NODE_IP6.parse::<IpAddr>().unwrap(), "masqueraded to the node");
    }
}

/// Every attempt refused (ECONNREFUSED), each within `within_ms`.
fn refused(attempts: Vec<Attempt>, within_ms: f64) {
    assert!(!attempts.is_empty());
    for attempt in &attempts {
        assert!(
            matches!(attempt, Attempt::Err { kind, ms } if kind == "ConnectionRefused" && *ms < within_ms),
            "{attempts:?}"
        );
    }
}

/// The dual-stack service without endpoints of the refusal scenarios.
fn empty_service() -> String {
    manifest(&[&node_ports(dual("empty", "10.96.0.30", "fd00:96::30"), 30090, 30093)])
}

/// Scenario 4: no endpoints is a refusal, never a timeout, for a pod. The
/// socket LB fails `connect()` at once; in the iptables mode, over TCP the
/// client sees the ICMPv6 port unreachable at the SYN's first
/// retransmission (about 1 s; over IPv4 and UDP at once): the error for the
/// first SYN reaches the client's socket while it is still locked by
/// `connect()`, which Linux's TCP over IPv6 keeps as a soft error here; the
/// rules are kube-proxy's, so a kube-proxy node behaves the same.
fn ipv6_services_without_endpoints_refuse_pods(setup: Setup) {
    let c = dual_lab(setup, &empty_service());
    refused(c.lab.client(&c.client).tcp(&at("fd00:96::30", 80), 3).unwrap(), 1500.0);
    let dns = at("fd00:96::30", 53);
    refused(c.lab.client(&c.client).run(Request::udp(&dns, 3).connected()).unwrap(), 100.0);
}

/// Scenario 4, through the IPv6 NodePort from outside (within the same
/// second as above over TCP).
fn ipv6_node_ports_without_endpoints_refuse(setup: Setup) {
    let c = dual_lab(setup, &empty_service());
    let node_port = at(NODE_IP6, 30090);
    let refused_before = rejected(&c.lab);
    refused(c.lab.client_outside(&c.ext).tcp(&node_port, 3).unwrap(), 1500.0);
    let at_least = if setup.mode.counts() { refused_before + 3 } else { 1 };
    assert!(rejected(&c.lab) >= at_least, "refused by the datapath, not the stack");
}

/// The new flows the datapath refused (the eBPF counter, or the packets of
/// the REJECT rules): the node's own stack refuses a closed port too. The
/// nftables rules count nothing: there, what stands for it is the refusal
/// in the IPv6 table (`no-endpoint-nodeports`), 1 if it is there.
fn rejected(lab: &Lab) -> u64 {
    if lab.mode.counts() {
        return lab.count_on(0, proxy_common::Counter::Rejected).unwrap();
    }
    let map = ["list", "map", "ip6", "kube-proxy", "no-endpoint-nodeports"];
    let map = lab.exec_on(0, "nft", &map).unwrap();
    u64::from(map.contains("tcp . 30090 comment \"lab/empty:http\" : goto reject-chain"))
}

/// Scenario 4: a UDP flow to an IPv6 cluster IP stays on one endpoint, and
/// leaves it within a second of its removal (no stale flow).
fn ipv6_udp_flows_move_off_a_removed_endpoint(setup: Setup) {
    udp_moves_off_a_removed_endpoint(setup, false, &[])
}

/// The same from a connected socket: the eBPF mode ends the socket the
/// socket LB connected to the pod (the client connects again), the iptables
/// mode deletes the flow's conntrack entry.
fn ipv6_connected_udp_sockets_move_off_a_removed_endpoint(setup: Setup) {
    udp_moves_off_a_removed_endpoint(setup, true, &[])
}

/// The same with sock_diag ending the socket, the way kernels without
/// `bpf_sock_destroy` (before 6.5) take.
#[test]
fn ebpf_sock_diag_ends_a_connected_ipv6_udp_socket_whose_pod_leaves() {
    let sock_diag = ["--socket-destroy", "sock-diag"];
    udp_moves_off_a_removed_endpoint(Setup::EBPF, true, &sock_diag)
}

/// From a connected socket (which connects again when ended) or not.
fn udp_moves_off_a_removed_endpoint(setup: Setup, connected: bool, agent: &[&str]) {
    let web = || web_ports(ipv6_only("web", "fd00:96::10"));
    let c = dual_lab_with(setup, &over(web(), "web", &[], &["a", "b", "c"]), agent);
    let vip = at("fd00:96::10", 53);
    let request = Request::udp(&vip, 30).interval_ms(100);
    let request = if connected { request.connected().reconnecting() } else { request };
    let mut client = c.lab.client(&c.client).spawn(request).unwrap();
    let mut lines = BufReader::new(client.stdout.take().unwrap()).lines();
    let mut next = || Attempt::parse(&lines.next().unwrap().unwrap()).unwrap();
    let first = next();
    let Attempt::Ok { name: stuck_to, from, .. } = first else { panic!("{first:?}") };
    assert_eq!(from, vip, "replies come from the cluster IP");
    let early: Vec<_> = (0..4).map(|_| next().pod().unwrap_or("<lost>").to_string()).collect();
    assert!(early.iter().all(|n| *n == stuck_to), "one flow, one backend: {stuck_to} {early:?}");

    let remaining: Vec<&str> =
        ["a", "b", "c"].into_iter().filter(|p| format!("web-{p}") != stuck_to).collect();
    c.lab.write_manifest(&over(web(), "web", &[], &remaining)).unwrap();
    let after = answered_after(lines, Instant::now(), Duration::from_secs(1));
    client.wait().unwrap();
    assert!(after.len() > 5, "{after:?}");
    assert!(after.iter().all(|n| *n != stuck_to && n != "<lost>"), "left {stuck_to}: {after:?}");
    assert_eq!(after.iter().collect::<BTreeSet<_>>().len(), 1, "and sticks again: {after:?}");
    if setup.mode == Mode::Iptables {
        let log = c.lab.agent_log();
        assert!(log.contains("stale UDP/SCTP conntrack entries deleted"), "{log}");
    }
}

/// Scenario 5: an IPv6-only service is served from kube-proxy's chains in
/// `ip6tables-save`, and nothing of it is in `iptables-save`.
fn an_ipv6_only_service_is_served_from_kube_proxys_ip6tables_chains(setup: Setup) {
    let v6only = web_ports(ipv6_only("v6only", "fd00:96::40"));
    let c = dual_lab(setup, &over(v6only, "v6only", &[], &["a", "b"]));
    let vip = at("fd00:96::40", 80);
    let attempts = c.lab.client(&c.client).tcp(&vip, 20).unwrap();
    assert_eq!(answers(&attempts).len(), 20);
    assert_eq!(tally(&attempts).len(), 2, "both endpoints: {:?}", tally(&attempts));
    if setup.mode != Mode::Iptables {
        return;
    }
    let saved6 = c.lab.exec_on(0, "ip6tables-save", &[]).unwrap();
    for needle in [
        "-A KUBE-SERVICES -d fd00:96::40/128 -p tcp -m comment --comment \"lab/v6only:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-",
        "--to-destination [fd00:244:1::2]:8080",
        "--to-destination [fd00:244:1::3]:8080",
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE",
    ] {
        assert!(saved6.contains(needle), "{needle} missing:\n{saved6}");
    }
    let saved = c.lab.exec_on(0, "iptables-save", &[]).unwrap();
    assert!(!saved.contains("lab/v6only"), "IPv6 service in iptables:\n{saved}");
    // The IPv4 family's chains are there too, for the dual-stack node.
    assert!(saved.contains(":KUBE-SERVICES"), "{saved}");
    // kube-proxy's per-family series: each family's rules are its own.
    let metrics = c.lab.metrics().unwrap();
    let nat_rules = |family: &str| {
        let series = format!(
            "kubeproxy_sync_proxy_rules_iptables_last{{ip_family=\"{family}\",table=\"nat\"}} "
        );
        let line = metrics.lines().find_map(|l| l.strip_prefix(series.as_str()));
        line.and_then(|n| n.parse::<u64>().ok()).unwrap_or_else(|| panic!("{series}:\n{metrics}"))
    };
    assert!(nat_rules("IPv6") > 0 && nat_rules("IPv4") > 0);
    let failures =
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 0";
    assert!(metrics.contains(failures), "{metrics}");
}

/// `proxy-agent lb list` and `ct list` read both families back (the IPv6
/// maps, or `ip6tables-save` and `conntrack -f ipv6`), IPv6 addresses in
/// brackets as sockets print them.
fn lb_and_ct_list_show_both_families(setup: Setup) {
    let web = web_ports(dual("web", "10.96.0.10", "fd00:96::10"));
    let c = dual_lab(setup, &over(web, "web", &["a", "b"], &["c"]));
    let json = c.lab.inspect_on(0, &["lb", "list", "-o", "json"]).unwrap();
    let entries: Vec<serde_json::Value> = serde_json::from_str(&json).expect(&json);
    let backends = |frontend: &str| -> BTreeSet<String> {
        let entry = entries.iter().find(|e| e["frontend"] == frontend);
        let entry = entry.unwrap_or_else(|| panic!("no {frontend}: {json}"));
        assert_eq!(entry["kind"], "ClusterIP");
        let list = entry["backends"].as_array().unwrap().iter();
        list.map(|b| b["address"].as_str().unwrap().to_string()).collect()
    };
    let set = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(backends("10.96.0.10:80/tcp"), set(&["10.244.1.2:8080", "10.244.1.3:8080"]));
    assert_eq!(backends("[fd00:96::10]:80/tcp"), set(&["[fd00:244:1::4]:8080"]));
    assert_eq!(backends("[fd00:96::10]:53/udp"), set(&["[fd00:244:1::4]:5353"]));

    let dns = at("fd00:96::10", 53);
    assert_eq!(answers(&c.lab.client(&c.client).udp(&dns, 3).unwrap()).len(), 3);
    let flows = c.lab.inspect_on(0, &["ct", "list", "--backend", "fd00:244:1::4", "-o", "json"]);
    let flows = flows.unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&flows).expect(&flows);
    assert!(!rows.is_empty(), "the UDP flow: {flows}");
    for row in &rows {
        assert_eq!(
            (row["frontend"].as_str(), row["service"].as_str()),
            (Some(dns.as_str()), Some("lab/web:dns")),
            "{flows}"
        );
        assert_eq!(row["backend"], "[fd00:244:1::4]:5353", "{flows}");
    }
    if setup.mode == Mode::Ebpf {
        // A node with IPv6: its flow maps as large as IPv4's.
        for (v4, v6) in [("CONNTRACK", "CONNTRACK6"), ("SOCK_REV_NAT", "SOCK_REV_NAT6")] {
            assert_eq!(c.lab.map_capacity(v6).unwrap(), c.lab.map_capacity(v4).unwrap(), "{v6}");
        }
    }
}

/// `proxy-agent explain` of an IPv6 packet, JSON.
fn explain(lab: &Lab, from: &str, to: &str) -> serde_json::Value {
    let args = ["explain", "--proto", "tcp", "--from", from, "--to", to, "-o", "json"];
    let json = lab.inspect_on(0, &args).unwrap();
    serde_json::from_str(&json).expect(&json)
}

/// Explain of IPv6 packets (issue 13) agrees with real ones: an IPv6
/// NodePort of policy Cluster from the external client is translated with
/// SNAT to the node's IPv6 address, one of policy Local without an endpoint
/// here dropped (with XDP, at the driver hook), a NodePort without
/// endpoints refused; explain runs first and, in the eBPF mode, leaves no
/// flow behind.
fn explain_ipv6_agrees_with_real_packets(setup: Setup) {
    let np = node_ports(dual("np", "10.96.0.11", "fd00:96::11"), 30080, 30053);
    let far = node_ports(dual("far", "10.96.0.14", "fd00:96::14"), 30081, 30084);
    let elsewhere = slice("lab", "far-ipv6")
        .service("far")
        .address_type("IPv6")
        .port("http", 8080, Tcp)
        .port("dns", 5353, Udp)
        .endpoints([ep("fd00:244:2::3").ready(true).node("other-node")]);
    let far = manifest(&[&far.external_policy("Local"), &elsewhere]);
    let docs = over(np, "np", &["a", "b"], &["a", "b"]) + "---\n" + &empty_service();
    let c = dual_lab(setup, &(docs + "---\n" + &far));
    let ebpf = setup.mode == Mode::Ebpf;
    let flows = || ebpf.then(|| c.lab.inspect_on(0, &["ct", "list", "-o", "json"]).unwrap());
    let before = flows();
    let node_port = explain(&c.lab, EXT_IP6, &at(NODE_IP6, 30080));
    let empty = explain(&c.lab, EXT_IP6, &at(NODE_IP6, 30090));
    let far = explain(&c.lab, EXT_IP6, &at(NODE_IP6, 30081));
    assert_eq!(flows(), before, "explain left no flow");

    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    let pods = BTreeSet::from(["[fd00:244:1::2]:8080".to_string(), "[fd00:244:1::3]:8080".into()]);
    assert_eq!(text(&node_port["outcome"]), "translated", "{node_port}");
    assert_eq!(text(&node_port["frontend"]["kind"]), "NodePort", "{node_port}");
    let candidates = node_port["backends"].as_array().unwrap().iter();
    assert_eq!(candidates.map(|b| text(&b["address"])).collect::<BTreeSet<_>>(), pods);
    if ebpf {
        assert!(pods.contains(&text(&node_port["picked"])), "{node_port}");
        assert_eq!(text(&node_port["snat"]), NODE_IP6, "{node_port}");
        assert!(text(&node_port["program"]).starts_with("tc_ingress on "), "{node_port}");
        if setup.xdp {
            // xdp_ingress6 decided it; a flow to a pod here goes up to tc.
            let up = node_port["notes"].to_string();
            assert!(up.contains("xdp_ingress on eth0 passes it up to tc ("), "{node_port}");
        }
    } else {
        assert!(text(&node_port["snat"]).starts_with("MASQUERADE"), "{node_port}");
        let program = if setup.mode == Mode::Nftables { "nft table ip6" } else { "ip6tables" };
        assert!(text(&node_port["program"]).starts_with(program), "{node_port}");
    }
    // The text, a field a line.
    let from = at(EXT_IP6, 40000);
    let args = ["explain", "--proto", "tcp", "--from", &from, "--to", &at(NODE_IP6, 30080)];
    let table = c.lab.inspect_on(0, &args).unwrap();
    println!("{table}");
    for field in ["packet:", "program:", "frontend:", "backends:", "snat:", "verdict:"] {
        assert!(table.lines().any(|l| l.starts_with(field)), "{field} in {table}");
    }
    let real = c.lab.client_outside(&c.ext).tcp(&at(NODE_IP6, 30080), 10).unwrap();
    for (_, peer, _) in answers(&real) {
        assert_eq!(peer, NODE_IP6.parse::<IpAddr>().unwrap(), "the SNAT explain named");
    }

    assert_eq!(text(&empty["outcome"]), "refused", "{empty}");
    let answer = if ebpf { "TCP reset" } else { "ICMPv6 port unreachable" };
    assert!(text(&empty["action"]).contains(answer), "{empty}");
    let refused_before = rejected(&c.lab);
    refused(c.lab.client_outside(&c.ext).tcp(&at(NODE_IP6, 30090), 1).unwrap(), 1500.0);
    // (nftables: the refusal's element stands for a count: 1.)
    let counted = rejected(&c.lab) > refused_before;
    let refusing = !setup.mode.counts() && rejected(&c.lab) == 1;
    assert!(counted || refusing, "refused by the datapath, not the stack");

    // Policy Local, no endpoint here: dropped, and real SYNs time out.
    assert_eq!(text(&far["outcome"]), "dropped", "{far}");
    assert!(text(&far["reason"]).contains("Local"), "{far}");
    if setup.xdp {
        assert_eq!(text(&far["program"]), "xdp_ingress on eth0", "{far}");
        assert!(far["notes"].to_string().contains("at the driver hook"), "{far}");
    }
    let real = c.lab.client_outside(&c.ext).timeout_ms(500).tcp(&at(NODE_IP6, 30081), 1).unwrap();
    assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "TimedOut"), "{real:?}");

    // Mixed families are refused with a message.
    let mixed = ["explain", "--proto", "tcp", "--from", EXT_IP6, "--to", "10.96.0.11:80"];
    let err = c.lab.inspect_on(0, &mixed).unwrap_err().to_string();
    assert!(err.contains("different IP families"), "{err}");
}
