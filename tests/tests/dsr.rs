//! Direct server return in the lab (eBPF mode; the iptables mode
//! masquerades, as kube-proxy). Two dual-stack nodes, pod a on node 0, b
//! and c on node 1, an external client whose routes to the load-balancer
//! IPs go through node 0 and can be moved to node 1 (an ECMP rehash, a
//! drained node). Every node drops conntrack-INVALID forwards, as
//! kube-proxy's KUBE-FORWARD does. Each scenario that applies to both
//! families runs in both: IPv4's option and IPv6's destination-options
//! header.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use proxy_lab::{
    Attempt, EXT_IP, EXT_IP6, Lab, Pod, Request, Setup, Stack, answered, sh, two_node_endpoints,
    two_node_endpoints6, two_node_web_cluster_on,
};
use test_objects::{Protocol::*, ServiceBuilder, manifest, port, service};

/// The family a scenario runs in: the service's address, the client's.
#[derive(Clone, Copy, Debug)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn lb_ip(self) -> &'static str {
        match self {
            Family::V4 => "10.200.0.10",
            Family::V6 => "fd00:200::10",
        }
    }

    fn client(self) -> &'static str {
        match self {
            Family::V4 => EXT_IP,
            Family::V6 => EXT_IP6,
        }
    }

    /// The load-balancer IP's `port`, as a socket address.
    fn at(self, port: u16) -> String {
        SocketAddr::new(self.lb_ip().parse().unwrap(), port).to_string()
    }

    /// The client's firewall tool.
    fn tables(self) -> &'static str {
        match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        }
    }
}

/// LoadBalancer service `lab/lb` of `family` at its `lb_ip` (http 80 →
/// 8080, dns 53/UDP → 5353, echo 90 → 9000) over `pods`, with
/// `annotations`.
fn balanced_in(family: Family, annotations: &[(&str, &str)], pods: &[&str]) -> String {
    let mut svc: ServiceBuilder = service("lab", "lb");
    svc = match family {
        Family::V4 => svc.cluster_ip("10.96.0.20"),
        Family::V6 => {
            svc.cluster_ip("fd00:96::20").cluster_ips(&["fd00:96::20"]).ip_families(&["IPv6"])
        }
    };
    svc = svc
        .load_balancer_type()
        .port(port("http", 80).target(8080))
        .port(port("dns", 53).udp().target(5353))
        .port(port("echo", 90).target(9000))
        .ingress_ip(family.lb_ip());
    for (key, value) in annotations {
        svc = svc.annotation(key, value);
    }
    let slice = svc.slice().port("http", 8080, Tcp).port("dns", 5353, Udp).port("echo", 9000, Tcp);
    let slice = match family {
        Family::V4 => slice.endpoints(two_node_endpoints(pods)),
        Family::V6 => slice.address_type("IPv6").endpoints(two_node_endpoints6(pods)),
    };
    manifest(&[&svc, &slice])
}

/// The IPv4 service.
fn balanced(annotations: &[(&str, &str)], pods: &[&str]) -> String {
    balanced_in(Family::V4, annotations, pods)
}

/// The two-node dual-stack cluster on `manifest`, agents with `flags`.
fn cluster(manifest: &str, flags: &[&str]) -> (Lab, Pod) {
    cluster_in(Setup::EBPF, manifest, flags)
}

/// As [`cluster`], in `setup` (XDP's too).
fn cluster_in(setup: Setup, manifest: &str, flags: &[&str]) -> (Lab, Pod) {
    two_node_web_cluster_on(Stack::Dual, setup, manifest, flags)
}

const DSR: (&str, &str) = ("service.cilium.io/forwarding-mode", "dsr");
const MAGLEV: (&str, &str) = ("proxy-agent.io/lb-algorithm", "maglev");

/// Counts, in the client's namespace, the packets of `family` that arrive
/// from node `node`'s MAC address (a rule per node in a chain of its own).
fn count_arrivals_by_node(lab: &Lab, ext: &Pod, family: Family) {
    let ipt = |args: &[&str]| {
        let args: Vec<&str> = ["netns", "exec", &ext.netns, family.tables()]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        sh("ip", &args).unwrap();
    };
    ipt(&["-N", "FROM-NODES"]);
    ipt(&["-A", "INPUT", "-j", "FROM-NODES"]);
    for node in lab.nodes() {
        let link = sh("ip", &["-n", &node.netns, "-br", "link", "show", "eth0"]).unwrap();
        let mac = link.split_whitespace().nth(2).unwrap().to_string();
        // Neighbour discovery and other ICMP are no replies.
        let icmp = match family {
            Family::V4 => "icmp",
            Family::V6 => "ipv6-icmp",
        };
        ipt(&[
            "-A",
            "FROM-NODES",
            "!",
            "-p",
            icmp,
            "-m",
            "mac",
            "--mac-source",
            &mac,
            "-m",
            "comment",
            "--comment",
            &node.name,
        ]);
    }
}

/// Packets the client received from each node's MAC since
/// [`count_arrivals_by_node`], by node name.
fn arrivals(lab: &Lab, ext: &Pod, family: Family) -> Vec<(String, u64)> {
    let args = ["netns", "exec", &ext.netns, family.tables(), "-L", "FROM-NODES", "-v", "-x", "-n"];
    let out = sh("ip", &args).unwrap();
    lab.nodes()
        .iter()
        .map(|node| {
            let line = out.lines().find(|l| l.contains(&format!("/* {} */", node.name))).unwrap();
            (node.name.clone(), line.split_whitespace().next().unwrap().parse().unwrap())
        })
        .collect()
}

fn ip_of(addr: &str) -> String {
    addr.parse::<SocketAddr>().map_or(addr.to_string(), |a| a.ip().to_string())
}

/// Through node 0, to pods on node 1 only: TCP and UDP keep the client's
/// address and are answered from the service, by node 1 directly; a 1 MB
/// download works at MTU 1500.
fn the_pod_sees_the_client_and_replies_leave_from_its_node(setup: Setup, family: Family) {
    let (lab, ext) = cluster_in(setup, &balanced_in(family, &[DSR], &["b", "c"]), &[]);
    count_arrivals_by_node(&lab, &ext, family);
    let tcp = lab.client_outside(&ext).tcp(&family.at(80), 20).unwrap();
    let udp = lab.client_outside(&ext).udp(&family.at(53), 20).unwrap();
    for (proto, attempts, service) in [("tcp", &tcp, 80), ("udp", &udp, 53)] {
        for (pod, peer, from) in answered(attempts) {
            assert_eq!(ip_of(&peer), family.client(), "{proto}: {pod} saw {peer}, not the client");
            assert_eq!(from, family.at(service), "{proto}: the reply's source");
        }
    }
    let bulk = lab.client_outside(&ext).run(Request::bulk(&family.at(80), 1000000)).unwrap();
    assert!(matches!(&bulk[..], [Attempt::Ok { bytes: Some(1_000_000), .. }]), "{bulk:?}");
    // Received as the client's stack counts them (GRO merges a download's
    // segments): every answer above is at least one.
    let seen = arrivals(&lab, &ext, family);
    let (via_ingress, via_backend) = (seen[0].1, seen[1].1);
    assert!(via_backend > 40, "the replies came from the backends' node: {seen:?}");
    assert_eq!(via_ingress, 0, "none came back through the ingress node: {seen:?}");
    let listed = lab.inspect_on(0, &["lb", "list", "--service", "lab/lb"]).unwrap();
    assert!(listed.contains("dsr"), "{listed}");
}

#[test]
fn the_pod_sees_the_client_and_replies_leave_from_its_node_ipv4() {
    the_pod_sees_the_client_and_replies_leave_from_its_node(Setup::EBPF, Family::V4);
}

#[test]
fn the_pod_sees_the_client_and_replies_leave_from_its_node_ipv6() {
    the_pod_sees_the_client_and_replies_leave_from_its_node(Setup::EBPF, Family::V6);
}

/// With XDP: a DSR flow is decided at the driver hook and handed to tc,
/// which makes it and inserts the option (XDP does not grow packets).
#[test]
fn the_pod_sees_the_client_and_replies_leave_from_its_node_with_xdp() {
    the_pod_sees_the_client_and_replies_leave_from_its_node(Setup::XDP, Family::V4);
}

/// Full-size packets from the client (its offloads off: every segment
/// leaves at MTU 1500, as from a real NIC without GSO) still reach the pod
/// with the option added: the pod's SYN-ACK announced an MSS lowered by
/// the option's size. Without that, each would be 8 (IPv6: 24) bytes too
/// big for the link to node 1 and the upload would stall.
fn full_size_uploads_fit_with_the_option(family: Family) {
    let (lab, ext) = cluster(&balanced_in(family, &[DSR], &["b", "c"]), &[]);
    let offloads = ["netns", "exec", &ext.netns, "ethtool", "-K", "eth0", "tso", "off"];
    sh("ip", &[&offloads[..], &["gso", "off"]].concat()).unwrap();
    let upload = lab.client_outside(&ext).run(Request::upload(&family.at(80), 1000000)).unwrap();
    assert!(matches!(&upload[..], [Attempt::Ok { bytes: Some(1_000_000), .. }]), "{upload:?}");
    let (_, peer, _) = &answered(&upload)[0];
    assert_eq!(ip_of(peer), family.client(), "by DSR: the pod saw the client");
}

#[test]
fn full_size_uploads_fit_with_the_option_ipv4() {
    full_size_uploads_fit_with_the_option(Family::V4);
}

#[test]
fn full_size_uploads_fit_with_the_option_ipv6() {
    full_size_uploads_fit_with_the_option(Family::V6);
}

fn hybrid_sends_tcp_by_dsr_and_masquerades_udp(setup: Setup) {
    let (lab, ext) = cluster_in(setup, &balanced(&[], &["b", "c"]), &["--bpf-lb-mode", "hybrid"]);
    let v4 = Family::V4;
    let tcp = lab.client_outside(&ext).tcp(&v4.at(80), 10).unwrap();
    let udp = lab.client_outside(&ext).udp(&v4.at(53), 10).unwrap();
    assert!(answered(&tcp).iter().all(|(_, peer, _)| ip_of(peer) == v4.client()), "{tcp:?}");
    let node0 = lab.nodes()[0].ip.clone();
    assert!(answered(&udp).iter().all(|(_, peer, _)| ip_of(peer) == node0), "{udp:?}");
    if setup.xdp {
        // The UDP flows (SNAT) went through XDP both ways.
        let forwarded = lab.counter_on(0, proxy_common::Counter::XdpForwarded).unwrap();
        assert!(forwarded >= 20, "{forwarded}");
    }
}

#[test]
fn hybrid_sends_tcp_by_dsr_and_masquerades_udp_ebpf() {
    hybrid_sends_tcp_by_dsr_and_masquerades_udp(Setup::EBPF);
}

/// With XDP, IPv6: a load-balancer IP's flows to pods on the other node,
/// masqueraded (SNAT), made and sent on at the driver hook both ways
/// (`xdp_ingress6`), and a DSR frontend's left to tc, which serves them.
#[test]
fn ipv6_flows_are_made_and_sent_at_xdp_and_dsr_ones_left_to_tc() {
    let v6 = Family::V6;
    let (lab, ext) = cluster_in(Setup::XDP, &balanced_in(v6, &[], &["b", "c"]), &[]);
    let snat = lab.client_outside(&ext).tcp(&v6.at(80), 20).unwrap();
    let node0 = lab.nodes()[0].ip6.clone().unwrap();
    assert!(answered(&snat).iter().all(|(_, peer, _)| ip_of(peer) == node0), "{snat:?}");
    let forwarded = lab.counter_on(0, proxy_common::Counter::XdpForwarded).unwrap();
    assert!(forwarded >= 40, "IPv6 packets sent on at XDP: {forwarded}");

    let (lab, ext) = cluster_in(Setup::XDP, &balanced_in(v6, &[DSR], &["b", "c"]), &[]);
    let dsr = lab.client_outside(&ext).tcp(&v6.at(80), 10).unwrap();
    assert!(answered(&dsr).iter().all(|(_, peer, _)| ip_of(peer) == v6.client()), "{dsr:?}");
}

/// With XDP: TCP decided there and made at tc, UDP made and sent at XDP.
#[test]
fn hybrid_sends_tcp_by_dsr_and_masquerades_udp_with_xdp() {
    hybrid_sends_tcp_by_dsr_and_masquerades_udp(Setup::XDP);
}

/// A client reusing its port right after its last connection closed (as
/// busy clients and load generators do) is answered at once, by the pod
/// Maglev gives its 5-tuple: neither node's closed flow delays the new
/// SYN-ACK (a lost one would be sent again after a second, past the
/// client's timeout).
#[test]
fn a_reused_client_port_is_a_new_flow_at_once() {
    let (lab, ext) = cluster(&balanced(&[DSR, MAGLEV], &["b", "c"]), &[]);
    let to = Family::V4.at(80);
    let client = lab.client_outside(&ext).timeout_ms(700);
    let request = || Request::tcp(&to, 1).source_port_base(40000);
    let pods: Vec<String> =
        (0..3).map(|_| answered(&client.run(request()).unwrap())[0].0.clone()).collect();
    assert!(pods.iter().all(|p| *p == pods[0]), "{pods:?}");
}

/// A stream of exchanges every 50 ms to the echo port, its lines
/// collected as they come.
struct Stream {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<Attempt>>>,
}

impl Stream {
    fn open(lab: &mut Lab, ext: &Pod, family: Family, exchanges: usize) -> Stream {
        let request = Request::stream(&family.at(90), exchanges).interval_ms(50);
        let mut child = lab.client_outside(ext).spawn(request).unwrap();
        let stdout = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().unwrap().extend(Attempt::parse(&line));
            }
        });
        Stream { child, lines }
    }

    /// Waits until `n` exchanges were reported (20 s at most).
    fn until(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.lines.lock().unwrap().len() < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn finish(mut self) -> Vec<Attempt> {
        let _ = self.child.wait();
        std::thread::sleep(Duration::from_millis(100));
        self.lines.lock().unwrap().clone()
    }
}

/// The route moves from node 0 to node 1 in the middle of a stream: with
/// DSR and Maglev it goes on (node 1, with no state for it, picks the same
/// pod and keeps the client's address); with SNAT it breaks, as the pod
/// sees another source (what this proxy, like kube-proxy, cannot avoid).
fn failover(family: Family, annotations: &[(&str, &str)]) -> (Vec<Attempt>, usize) {
    let (mut lab, ext) = cluster(&balanced_in(family, annotations, &["a", "b", "c"]), &[]);
    let stream = Stream::open(&mut lab, &ext, family, 80);
    stream.until(20);
    lab.route_external_via(&ext, 1).unwrap();
    let attempts = stream.finish();
    let ok = attempts.iter().take_while(|a| a.pod().is_some()).count();
    (attempts, ok)
}

fn a_dsr_maglev_stream_survives_a_change_of_ingress_node(family: Family) {
    let (attempts, ok) = failover(family, &[DSR, MAGLEV]);
    assert_eq!((attempts.len(), ok), (80, 80), "{attempts:?}");
    let pods: std::collections::BTreeSet<&str> = attempts.iter().filter_map(Attempt::pod).collect();
    assert_eq!(pods.len(), 1, "one pod all along: {pods:?}");
}

#[test]
fn a_dsr_maglev_stream_survives_a_change_of_ingress_node_ipv4() {
    a_dsr_maglev_stream_survives_a_change_of_ingress_node(Family::V4);
}

#[test]
fn a_dsr_maglev_stream_survives_a_change_of_ingress_node_ipv6() {
    a_dsr_maglev_stream_survives_a_change_of_ingress_node(Family::V6);
}

#[test]
fn a_snat_stream_breaks_at_a_change_of_ingress_node() {
    let (attempts, ok) = failover(Family::V4, &[MAGLEV]);
    assert!((20..80).contains(&ok), "the break is documented, not hidden: {attempts:?}");
}

#[test]
fn agent_restarts_on_either_node_lose_no_dsr_exchange() {
    let (mut lab, ext) = cluster(&balanced(&[DSR], &["b", "c"]), &[]);
    let stream = Stream::open(&mut lab, &ext, Family::V4, 120);
    let args = ["--cluster-cidr", Stack::Dual.cluster_cidrs()];
    for (node, after) in [(0, 10), (1, 50)] {
        stream.until(after);
        lab.kill_agent_on(node);
        std::thread::sleep(Duration::from_millis(500));
        lab.start_agent_on(node, &args).unwrap();
    }
    let attempts = stream.finish();
    let failed: Vec<&Attempt> = attempts.iter().filter(|a| a.pod().is_none()).collect();
    assert!(attempts.len() == 120 && failed.is_empty(), "{failed:?} of {}", attempts.len());
}
