//! Direct server return in the lab (eBPF mode; the iptables mode
//! masquerades, as kube-proxy). Two nodes, pod a on node 0, b and c on
//! node 1, an external client whose route to the load-balancer IPs goes
//! through node 0 and can be moved to node 1 (an ECMP rehash, a drained
//! node). Every node drops conntrack-INVALID forwards, as kube-proxy's
//! KUBE-FORWARD does.

use std::{
    io::{BufRead, BufReader},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use proxy_lab::{Attempt, Lab, Pod, Setup, answered, sh, two_node_endpoints, two_node_web_cluster};
use test_objects::{Protocol::*, ServiceBuilder, manifest, port, service};

const CLUSTER_CIDR: &str = "10.244.0.0/16";
const CLIENT: &str = "192.168.100.101";
const LB_IP: &str = "10.200.0.10";

/// LoadBalancer service `lab/lb` at `LB_IP` (http 80 → 8080, dns 53/UDP →
/// 5353, echo 90 → 9000) over `pods`, with `annotations`.
fn balanced(annotations: &[(&str, &str)], pods: &[&str]) -> String {
    let mut svc: ServiceBuilder = service("lab", "lb")
        .cluster_ip("10.96.0.20")
        .load_balancer_type()
        .port(port("http", 80).target(8080))
        .port(port("dns", 53).udp().target(5353))
        .port(port("echo", 90).target(9000))
        .ingress_ip(LB_IP);
    for (key, value) in annotations {
        svc = svc.annotation(key, value);
    }
    let slice = svc.slice().port("http", 8080, Tcp).port("dns", 5353, Udp).port("echo", 9000, Tcp);
    manifest(&[&svc, &slice.endpoints(two_node_endpoints(pods))])
}

const DSR: (&str, &str) = ("service.cilium.io/forwarding-mode", "dsr");
const MAGLEV: (&str, &str) = ("proxy-agent.io/lb-algorithm", "maglev");

/// Counts, in the client's namespace, the packets that arrive from node
/// `node`'s MAC address (a rule per node in a chain of its own).
fn count_arrivals_by_node(lab: &Lab, ext: &Pod) {
    let ipt = |args: &[&str]| {
        let args: Vec<&str> = ["netns", "exec", &ext.netns, "iptables"]
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
        ipt(&[
            "-A",
            "FROM-NODES",
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
fn arrivals(lab: &Lab, ext: &Pod) -> Vec<(String, u64)> {
    let out =
        sh("ip", &["netns", "exec", &ext.netns, "iptables", "-L", "FROM-NODES", "-v", "-x", "-n"])
            .unwrap();
    lab.nodes()
        .iter()
        .map(|node| {
            let line = out.lines().find(|l| l.contains(&format!("/* {} */", node.name))).unwrap();
            (node.name.clone(), line.split_whitespace().next().unwrap().parse().unwrap())
        })
        .collect()
}

fn ip_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(ip, _)| ip)
}

#[test]
fn the_pod_sees_the_client_and_replies_leave_from_its_node() {
    let (lab, ext) = two_node_web_cluster(Setup::EBPF, &balanced(&[DSR], &["b", "c"]), &[]);
    count_arrivals_by_node(&lab, &ext);
    let tcp = lab.client_outside(&ext, &["tcp", &format!("{LB_IP}:80"), "20"]).unwrap();
    let udp = lab.client_outside(&ext, &["udp", &format!("{LB_IP}:53"), "20"]).unwrap();
    for (proto, attempts, service) in [("tcp", &tcp, ":80"), ("udp", &udp, ":53")] {
        for (pod, peer, from) in answered(attempts) {
            assert_eq!(ip_of(&peer), CLIENT, "{proto}: {pod} saw {peer}, not the client");
            assert_eq!(from, format!("{LB_IP}{service}"), "{proto}: the reply's source");
        }
    }
    // A 1 MB download at MTU 1500 everywhere.
    let bulk = lab.client_outside(&ext, &["bulk", &format!("{LB_IP}:80"), "1000000"]).unwrap();
    assert!(matches!(&bulk[..], [Attempt::Ok { bytes: Some(1_000_000), .. }]), "{bulk:?}");
    // Received as the client's stack counts them (GRO merges a download's
    // segments): every answer above is at least one.
    let seen = arrivals(&lab, &ext);
    let (via_ingress, via_backend) = (seen[0].1, seen[1].1);
    assert!(via_backend > 40, "the replies came from the backends' node: {seen:?}");
    assert_eq!(via_ingress, 0, "none came back through the ingress node: {seen:?}");
    let listed = lab.inspect_on(0, &["lb", "list", "--service", "lab/lb"]).unwrap();
    assert!(listed.contains("dsr"), "{listed}");
}

#[test]
fn hybrid_sends_tcp_by_dsr_and_masquerades_udp() {
    let (lab, ext) = two_node_web_cluster(
        Setup::EBPF,
        &balanced(&[], &["b", "c"]),
        &["--bpf-lb-mode", "hybrid"],
    );
    let tcp = lab.client_outside(&ext, &["tcp", &format!("{LB_IP}:80"), "10"]).unwrap();
    let udp = lab.client_outside(&ext, &["udp", &format!("{LB_IP}:53"), "10"]).unwrap();
    assert!(answered(&tcp).iter().all(|(_, peer, _)| ip_of(peer) == CLIENT), "{tcp:?}");
    let node0 = lab.nodes()[0].ip.clone();
    assert!(answered(&udp).iter().all(|(_, peer, _)| ip_of(peer) == node0), "{udp:?}");
}

/// A stream of exchanges every 50 ms to the echo port, its lines
/// collected as they come.
struct Stream {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<Attempt>>>,
}

impl Stream {
    fn open(lab: &mut Lab, ext: &Pod, exchanges: usize) -> Stream {
        let count = exchanges.to_string();
        let args = ["stream", &format!("{LB_IP}:90"), &count, "--interval-ms", "50"];
        let mut child = lab.spawn_outside(ext, &args).unwrap();
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
fn failover(annotations: &[(&str, &str)]) -> (Vec<Attempt>, usize) {
    let (mut lab, ext) =
        two_node_web_cluster(Setup::EBPF, &balanced(annotations, &["a", "b", "c"]), &[]);
    let stream = Stream::open(&mut lab, &ext, 80);
    stream.until(20);
    lab.route_external_via(&ext, 1).unwrap();
    let attempts = stream.finish();
    let ok = attempts.iter().take_while(|a| a.pod().is_some()).count();
    (attempts, ok)
}

#[test]
fn a_dsr_maglev_stream_survives_a_change_of_ingress_node() {
    let (attempts, ok) = failover(&[DSR, MAGLEV]);
    assert_eq!((attempts.len(), ok), (80, 80), "{attempts:?}");
    let pods: std::collections::BTreeSet<&str> = attempts.iter().filter_map(Attempt::pod).collect();
    assert_eq!(pods.len(), 1, "one pod all along: {pods:?}");
}

#[test]
fn a_snat_stream_breaks_at_a_change_of_ingress_node() {
    let (attempts, ok) = failover(&[MAGLEV]);
    assert!((20..80).contains(&ok), "the break is documented, not hidden: {attempts:?}");
}

#[test]
fn agent_restarts_on_either_node_lose_no_dsr_exchange() {
    let (mut lab, ext) = two_node_web_cluster(Setup::EBPF, &balanced(&[DSR], &["b", "c"]), &[]);
    let stream = Stream::open(&mut lab, &ext, 120);
    let args = ["--cluster-cidr", CLUSTER_CIDR];
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
