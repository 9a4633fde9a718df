//! `proxy-agent explain` against real packets: for each kind of verdict the
//! per-packet datapath gives (translated with and without SNAT, dropped for
//! want of a local endpoint or outside the source ranges, refused, passed),
//! explain runs first, then real connections of the same tuple, and the two
//! must agree; in the eBPF mode explain must leave no flow and no affinity
//! behind. Both modes: the iptables mode walks the rules, and names the
//! candidates, not a pick (the statistic rules pick per connection).

use std::collections::BTreeSet;

use proxy_lab::{
    Attempt, EXT_IP, Lab, Mode, NODE_IP, Pod, Setup, external_ip, external_modes, node_port, tally,
};
use test_objects::{Protocol::*, ep, manifest, port, service};

external_modes!(explain_agrees_with_real_packets);

fn explain(lab: &Lab, proto: &str, from: &str, to: &str) -> serde_json::Value {
    let args = ["explain", "--proto", proto, "--from", from, "--to", to, "-o", "json"];
    let json = lab.inspect_on(0, &args).unwrap();
    serde_json::from_str(&json).expect(&json)
}

fn text(v: &serde_json::Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// The backends explain names as candidates.
fn candidates(x: &serde_json::Value) -> BTreeSet<String> {
    x["backends"].as_array().unwrap().iter().map(|b| text(&b["address"]).to_string()).collect()
}

/// What the backends saw of successful attempts: (pod, peer address).
fn answers(attempts: &[Attempt]) -> Vec<(String, String)> {
    attempts
        .iter()
        .map(|a| match a {
            Attempt::Ok { name, peer, .. } => {
                (name.clone(), peer.split(':').next().unwrap().to_string())
            }
            err => panic!("failed attempt: {err:?} in {attempts:?}"),
        })
        .collect()
}

/// Flows and affinity entries of the node's datapath, as `ct list` and
/// bpftool see them.
fn state(lab: &Lab) -> (usize, String) {
    let flows = lab.inspect_on(0, &["ct", "list", "-o", "json"]).unwrap();
    let flows: Vec<serde_json::Value> = serde_json::from_str(&flows).unwrap();
    (flows.len(), lab.dump_map("AFFINITY").unwrap())
}

struct Scene {
    lab: Lab,
    ext: Pod,
    ext2: Pod,
    client: Pod,
}

/// web-a and web-b serve TCP 8080 on the node; `web` (NodePort 30080,
/// ClusterIP 10.96.0.10) and `sticky` (NodePort 30085, ClientIP affinity)
/// over both; `far` (NodePort 30081, policy Local) with an endpoint on
/// another node only; `empty` (NodePort 30082) without endpoints; `lb`
/// (LoadBalancer 10.200.0.10) admitting 192.168.100.101 only.
fn scene(setup: Setup) -> Scene {
    let mut lab = Lab::with(setup).unwrap();
    for (name, ip) in [("web-a", "10.244.1.2"), ("web-b", "10.244.1.3")] {
        let pod = lab.add_pod(name, ip).unwrap();
        lab.serve(&pod, &[8080], &[]).unwrap();
    }
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let ext2 = lab.add_external("ext2", &external_ip(2)).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let here = || ["10.244.1.2", "10.244.1.3"].map(|ip| ep(ip).ready(true).node("lab-node"));
    let svc = |name: &str, ip: &str, node_port: i32| {
        service("lab", name)
            .node_port_type()
            .cluster_ip(ip)
            .port(port("http", 80).target(8080).node_port(node_port))
    };
    let web = svc("web", "10.96.0.10", 30080);
    let sticky = svc("sticky", "10.96.0.15", 30085).client_ip_affinity(Some(600));
    let far = svc("far", "10.96.0.11", 30081).external_policy("Local");
    let empty = svc("empty", "10.96.0.12", 30082);
    let lb = svc("lb", "10.96.0.13", 30083)
        .load_balancer_type()
        .source_ranges(&[&format!("{EXT_IP}/32")])
        .ingress_ip("10.200.0.10");
    let slice = |s: &test_objects::ServiceBuilder| s.slice().port("http", 8080, Tcp);
    let elsewhere = [ep("10.244.2.3").ready(true).node("other-node")];
    let objects = manifest(&[
        &web,
        &slice(&web).endpoints(here()),
        &sticky,
        &slice(&sticky).endpoints(here()),
        &far,
        &slice(&far).endpoints(elsewhere),
        &empty,
        &lb,
        &slice(&lb).endpoints(here()),
    ]);
    lab.write_manifest(&objects).unwrap();
    lab.start_agent(&["--cluster-cidr", "10.244.0.0/16"]).unwrap();
    Scene { lab, ext, ext2, client }
}

fn explain_agrees_with_real_packets(setup: Setup) {
    let s = scene(setup);
    let lab = &s.lab;
    let ebpf = setup.mode == Mode::Ebpf;
    let pods = BTreeSet::from(["10.244.1.2:8080".to_string(), "10.244.1.3:8080".to_string()]);
    let pod_of = |address: &str| match address {
        "10.244.1.2:8080" => "web-a",
        "10.244.1.3:8080" => "web-b",
        other => panic!("not a pod: {other}"),
    };

    // Explain runs first, all of them: they must leave nothing behind.
    let before = ebpf.then(|| state(lab));
    let through_node_port = explain(lab, "tcp", EXT_IP, &node_port(30080));
    let cluster_ip = explain(lab, "tcp", "10.244.1.100:40000", "10.96.0.10:80");
    let sticky = explain(lab, "tcp", EXT_IP, &node_port(30085));
    let far = explain(lab, "tcp", EXT_IP, &node_port(30081));
    let empty = explain(lab, "tcp", EXT_IP, &node_port(30082));
    let outside = explain(lab, "tcp", &external_ip(2), "10.200.0.10:80");
    let inside = explain(lab, "tcp", EXT_IP, "10.200.0.10:80");
    let nothing = explain(lab, "tcp", EXT_IP, &node_port(30999));
    assert_eq!(ebpf.then(|| state(lab)), before, "explain left no flow and no affinity");

    // NodePort, policy Cluster: translated, SNAT to the node, as real
    // connections are.
    assert_eq!(text(&through_node_port["outcome"]), "translated", "{through_node_port}");
    assert_eq!(candidates(&through_node_port), pods);
    if ebpf {
        assert!(pods.contains(text(&through_node_port["picked"])), "{through_node_port}");
        assert_eq!(text(&through_node_port["snat"]), NODE_IP);
    } else {
        assert!(
            through_node_port.get("picked").is_none(),
            "chosen per connection: {through_node_port}"
        );
        assert!(text(&through_node_port["snat"]).starts_with("MASQUERADE"), "{through_node_port}");
    }
    assert_eq!(text(&through_node_port["frontend"]["kind"]), "NodePort");
    let real = lab.client_outside(&s.ext).tcp(&node_port(30080), 20).unwrap();
    for (pod, peer) in answers(&real) {
        assert!(["web-a", "web-b"].contains(&pod.as_str()));
        assert_eq!(peer, NODE_IP, "the backend saw the SNAT explain named");
    }

    // The text says the same, a field a line.
    let table = lab
        .inspect_on(
            0,
            &[
                "explain",
                "--proto",
                "tcp",
                "--from",
                &format!("{EXT_IP}:40000"),
                "--to",
                &node_port(30080),
            ],
        )
        .unwrap();
    println!("{table}");
    let fields = ["packet:", "program:", "frontend:", "backends:", "snat:", "verdict:"];
    for field in fields.iter().chain(ebpf.then_some(&"picked:")) {
        assert!(table.lines().any(|l| l.starts_with(field)), "{field} in {table}");
    }

    // ClusterIP from a pod outside the socket-LB cgroup: translated per
    // packet, its address kept.
    assert_eq!(text(&cluster_ip["outcome"]), "translated", "{cluster_ip}");
    assert!(cluster_ip.get("snat").is_none(), "{cluster_ip}");
    assert_eq!(candidates(&cluster_ip), pods);
    if ebpf {
        assert!(pods.contains(text(&cluster_ip["picked"])));
        assert!(text(&cluster_ip["program"]).starts_with("tc_ingress on "), "{cluster_ip}");
    }
    let real = lab.client_outside(&s.client).tcp("10.96.0.10:80", 10).unwrap();
    for (_, peer) in answers(&real) {
        assert_eq!(peer, "10.244.1.100");
    }

    // Affinity: explain remembered nothing; after real connections, it
    // names the backend they stick to (eBPF; iptables says affinity rules).
    let real = lab.client_outside(&s.ext).tcp(&node_port(30085), 5).unwrap();
    let stuck: Vec<String> = tally(&real).into_keys().collect();
    assert_eq!(stuck.len(), 1, "{real:?}");
    let again = explain(lab, "tcp", EXT_IP, &node_port(30085));
    if ebpf {
        assert_eq!(text(&sticky["via"]), "random", "{sticky}");
        assert_eq!(text(&again["via"]), "affinity", "{again}");
        assert_eq!(pod_of(text(&again["picked"])), stuck[0]);
    } else {
        let rules = if setup.mode == Mode::Nftables { "affinity-*" } else { "xt_recent" };
        assert!(again["notes"].to_string().contains(rules), "{again}");
    }

    // NodePort, policy Local, no endpoint here: dropped, and real SYNs time out.
    assert_eq!(text(&far["outcome"]), "dropped", "{far}");
    assert!(text(&far["reason"]).contains("Local"), "{far}");
    if setup.xdp {
        // Dropped at the driver hook; a flow to a pod here goes up to tc.
        assert!(text(&far["program"]).starts_with("xdp_ingress on "), "{far}");
        assert!(far["notes"].to_string().contains("at the driver hook"), "{far}");
        let up = through_node_port["notes"].to_string();
        assert!(up.contains("xdp_ingress on eth0 passes it up to tc"), "{through_node_port}");
    }
    let real = lab.client_outside(&s.ext).timeout_ms(500).tcp(&node_port(30081), 1).unwrap();
    assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "TimedOut"), "{real:?}");

    // No endpoints: refused with a reset, as real connections are.
    assert_eq!(text(&empty["outcome"]), "refused", "{empty}");
    let answer = if ebpf { "TCP reset" } else { "ICMP port unreachable" };
    assert!(text(&empty["action"]).contains(answer), "{empty}");
    // kube-proxy's nftables rules count nothing: 0 for them.
    let rejected = || match setup.mode.counts() {
        true => lab.count_on(0, proxy_common::Counter::Rejected).unwrap(),
        false => 0,
    };
    let refused_before = rejected();
    let real = lab.client_outside(&s.ext).tcp(&node_port(30082), 1).unwrap();
    assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"));
    let counted = rejected() > refused_before;
    assert!(counted || !setup.mode.counts(), "refused by the datapath, not the node's stack");

    // loadBalancerSourceRanges: outside dropped, inside translated.
    assert_eq!(text(&outside["outcome"]), "dropped", "{outside}");
    assert!(text(&outside["reason"]).contains("loadBalancerSourceRanges"));
    let real = lab.client_outside(&s.ext2).timeout_ms(500).tcp("10.200.0.10:80", 1).unwrap();
    assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "TimedOut"), "{real:?}");
    assert_eq!(text(&inside["outcome"]), "translated", "{inside}");
    answers(&lab.client_outside(&s.ext).tcp("10.200.0.10:80", 3).unwrap());

    // No service: passed on untouched; the node's own stack refuses it.
    assert_eq!(text(&nothing["outcome"]), "passed", "{nothing}");
    assert!(nothing.get("frontend").is_none(), "{nothing}");
    let refused_before = rejected();
    let real = lab.client_outside(&s.ext).tcp(&node_port(30999), 1).unwrap();
    assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"));
    assert_eq!(rejected(), refused_before, "not refused by the datapath");

    if setup.mode == Mode::Nftables {
        // No localhost NodePorts, as kube-proxy's nftables mode: passed on
        // to the node's stack, which refuses it.
        let web = explain(lab, "tcp", "127.0.0.1", "127.0.0.1:30080");
        assert_eq!(text(&web["outcome"]), "passed", "{web}");
        let node = lab.client_in(&lab.node, Some(&lab.cgroup));
        let real = node.tcp("127.0.0.1:30080", 1).unwrap();
        assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"));
        return;
    }
    localhost_node_ports(&s, &pods);
}

/// Localhost NodePorts, from the node itself: explain and real connections
/// agree (eBPF: the socket programs' lookup; iptables: the rules walked).
fn localhost_node_ports(s: &Scene, pods: &BTreeSet<String>) {
    let lab = &s.lab;
    let node = lab.client_in(&lab.node, Some(&lab.cgroup));
    let web = explain(lab, "tcp", "127.0.0.1", "127.0.0.1:30080");
    assert_eq!(text(&web["outcome"]), "translated", "{web}");
    assert_eq!(&candidates(&web), pods, "{web}");
    let real = node.tcp("127.0.0.1:30080", 20).unwrap();
    assert_eq!(tally(&real).len(), 2, "{real:?}");
    // Policy Local, no endpoint here: the node's own clients get every
    // endpoint (the other node's).
    let far = explain(lab, "tcp", "127.0.0.1", "127.0.0.3:30081");
    assert_eq!(text(&far["outcome"]), "translated", "{far}");
    assert_eq!(candidates(&far), BTreeSet::from(["10.244.2.3:8080".to_string()]), "{far}");
    // No endpoint: refused, as real connections are.
    let empty = explain(lab, "tcp", "127.0.0.1", "127.0.0.1:30082");
    assert_eq!(text(&empty["outcome"]), "refused", "{empty}");
    let real = node.tcp("127.0.0.1:30082", 1).unwrap();
    assert!(matches!(&real[0], Attempt::Err { kind, .. } if kind == "ConnectionRefused"));
    let nothing = explain(lab, "tcp", "127.0.0.1", "127.0.0.1:30999");
    assert_eq!(text(&nothing["outcome"]), "passed", "{nothing}");
}
