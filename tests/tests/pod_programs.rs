//! eBPF only (an attachment choice; the rule-based modes have no hooks to
//! choose): what runs on pod interfaces where the socket LB covers every
//! pod (`--pod-interface-programs replies`, the default on a node whose
//! socket programs attach to the cgroup2 root; the lab's cgroup is below
//! it, so the lab says so). Only the interfaces of pods that back a
//! frontend (or still have per-packet flows) carry the replies program,
//! and a pod that becomes an endpoint gets it before its first flow.

use std::time::{Duration, Instant};

use proxy_lab::{EXT_IP, Lab, NODE_IP, NODE_IP6, Pod, Request, answered, node_port, v6};
use test_objects::{Protocol::*, ep, manifest, port, service, slice};

const REPLIES: [&str; 2] = ["--pod-interface-programs", "replies"];
const FULL: [&str; 2] = ["egress:tc_egress", "ingress:tc_ingress"];
const REPLIES_ONLY: [&str; 1] = ["ingress:tc_pod_replies"];

/// Service `lab/web` at 10.96.0.10, node ports 30080 (http 80 → 8080) and
/// 30053 (dns 53/UDP → 5353), over the pods at `ips` on node 0.
fn web_on(ips: &[&str]) -> String {
    let web = service("lab", "web")
        .cluster_ip("10.96.0.10")
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(30080))
        .port(port("dns", 53).udp().target(5353).node_port(30053));
    let endpoints: Vec<_> = ips.iter().map(|ip| ep(ip).node("lab-node")).collect();
    let slice = web.slice().port("http", 8080, Tcp).port("dns", 5353, Udp);
    manifest(&[&web, &slice.endpoints(endpoints)])
}

/// What runs at each hook of a node-0 interface: a pinned TCX link's
/// program, or a clsact filter's (which `tc` names).
fn programs(lab: &Lab, interface: &str) -> Vec<String> {
    let links = lab.pins.join("links");
    let mut found = Vec::new();
    for (hook, pin) in [("egress", "tc-egress"), ("ingress", "tc")] {
        let pin = links.join(format!("{pin}-{interface}"));
        let mut shown = String::new();
        if let Some(pin) = pin.to_str().filter(|_| pin.exists()) {
            // Gone between the check and the read: nothing runs there.
            if let Ok(link) = proxy_lab::sh("bpftool", &["link", "show", "pinned", pin]) {
                let id = link.split_whitespace().skip_while(|w| *w != "prog").nth(1).unwrap();
                shown += &proxy_lab::sh("bpftool", &["prog", "show", "id", id]).unwrap();
            }
        }
        let tc = ["-n", &lab.node, "filter", "show", "dev", interface, hook];
        shown += &proxy_lab::sh("tc", &tc).unwrap();
        for program in ["tc_egress", "tc_ingress", "tc_pod_replies"] {
            if shown.split_whitespace().any(|w| w == program) {
                found.push(format!("{hook}:{program}"));
            }
        }
    }
    found
}

/// Waits until `interface` runs `expected` (within 10 s: the agent takes a
/// program off only after a conntrack collection, every second or so).
fn wait_programs(lab: &Lab, interface: &str, expected: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = programs(lab, interface);
        if found == expected {
            return;
        }
        assert!(Instant::now() < deadline, "{interface} runs {found:?}, not {expected:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// NodePort flows (policy Cluster: SNAT) to a pod here still work, their
/// replies translated back on its veth; a pod that backs nothing (the
/// client) runs no program; pods reach services through the socket LB; and
/// a role change at a restart swaps the programs, clsact filters
/// (`netlink`) included.
#[test]
fn ebpf_only_pods_that_back_a_frontend_run_the_replies_program() {
    pod_interfaces_replies_only(&[]);
}

#[test]
fn ebpf_only_pods_that_back_a_frontend_run_it_with_clsact_filters() {
    pod_interfaces_replies_only(&["--tc-attach", "netlink"]);
}

fn pod_interfaces_replies_only(attach: &[&str]) {
    let mut lab = Lab::new().unwrap();
    let web_a = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&web_a, &[8080], &[5353]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.write_manifest(&web_on(&["10.244.1.2"])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    let replies: Vec<&str> = [attach, &REPLIES].concat();
    lab.start_agent(&replies).unwrap();
    assert_eq!(programs(&lab, "eth0"), FULL, "node interfaces keep both");
    assert_eq!(programs(&lab, "veth1"), REPLIES_ONLY, "web-a backs the service");
    // The client's, once a collection found no flow to it.
    wait_programs(&lab, "veth2", &[]);
    let log = lab.agent_log();
    assert!(log.contains("replies of per-packet flows only"), "the log says why: {log}");
    // `lb list` says which interface runs what (TCX links or clsact filters).
    let listed = lab.inspect_on(0, &["lb", "list"]).unwrap();
    let line = |i: &str| listed.lines().find(|l| l.trim_start().starts_with(i)).map(str::trim);
    assert_eq!(line("eth0 "), Some("eth0             tc_ingress + tc_egress"), "{listed}");
    assert_eq!(line("veth1 "), Some("veth1            tc_pod_replies"), "{listed}");
    let bare = line("none on:").unwrap_or_default();
    assert!(bare.split([' ', ',']).any(|i| i == "veth2"), "{listed}");

    for proto in ["tcp", "udp"] {
        let to = node_port(if proto == "tcp" { 30080 } else { 30053 });
        let attempts = lab.client_outside(&ext).run(Request::of(proto, &to, 10)).unwrap();
        for (name, peer, from) in answered(&attempts) {
            assert_eq!((name.as_str(), peer.split(':').next().unwrap()), ("web-a", NODE_IP));
            assert_eq!(from, to, "{proto} replies come from the NodePort");
        }
    }
    // A pod in the socket-LB cgroup: translated at connect().
    for (name, _, from) in answered(&lab.client(&client).tcp("10.96.0.10:80", 10).unwrap()) {
        assert_eq!((name.as_str(), from.as_str()), ("web-a", "10.96.0.10:80"));
    }

    // Back to full programs at a restart (the lab's cgroup is not the root:
    // `auto` gives full), on every pod interface, and per-packet ClusterIP
    // from outside the cgroup.
    lab.stop_agent_on(0);
    lab.start_agent(attach).unwrap();
    for veth in ["veth1", "veth2"] {
        assert_eq!(programs(&lab, veth), FULL, "{veth}");
    }
    for (name, _, from) in answered(&lab.client_outside(&client).tcp("10.96.0.10:80", 10).unwrap())
    {
        assert_eq!((name.as_str(), from.as_str()), ("web-a", "10.96.0.10:80"));
    }
    // And to replies again: the egress programs go, the client's too.
    lab.stop_agent_on(0);
    lab.start_agent(&replies).unwrap();
    assert_eq!(programs(&lab, "veth1"), REPLIES_ONLY);
    wait_programs(&lab, "veth2", &[]);
    answered(&lab.client_outside(&ext).tcp(&node_port(30080), 5).unwrap());
}

/// A pod that becomes a NodePort's endpoint gets the replies program before
/// its first flow needs it: again and again, a new pod (its interface bare
/// first, as it backs nothing) is made an endpoint and connected to at
/// once, from outside, until it answers; no attempt may fail (a reply the
/// program did not translate back is lost: UDP has no retry, and TCP's
/// SYN-ACK retry comes after the attempt's 800 ms).
#[test]
fn ebpf_a_new_endpoint_has_the_replies_program_before_its_first_flow() {
    let mut lab = Lab::new().unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let first = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&first, &[8080], &[5353]).unwrap();
    let mut endpoints = vec!["10.244.1.2".to_string()];
    lab.write_manifest(&web_on(&["10.244.1.2"])).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&REPLIES).unwrap();
    for round in 0..6 {
        let (name, ip) = (format!("web-n{round}"), format!("10.244.1.{}", 10 + round));
        let pod = lab.add_pod(&name, &ip).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        let veth = format!("veth{}", round + 2);
        wait_programs(&lab, &veth, &[]);
        // Old endpoints stay: no flow is flushed under the attempts.
        endpoints.push(ip);
        let ips: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        lab.write_manifest(&web_on(&ips)).unwrap();
        let proto = if round % 2 == 0 { "udp" } else { "tcp" };
        let to = node_port(if proto == "tcp" { 30080 } else { 30053 });
        connect_until_answered_by(&lab, &ext, proto, &to, &name);
        assert_eq!(programs(&lab, &veth), REPLIES_ONLY, "{name} backs the service");
    }
}

/// Connects from `ext` to `to` at once and again, one attempt at a time,
/// until `pod` answers (10 s at most); every attempt must be answered.
fn connect_until_answered_by(lab: &Lab, ext: &Pod, proto: &str, to: &str, pod: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tries = 0;
    loop {
        let attempt = lab.client_outside(ext).timeout_ms(800).run(Request::of(proto, to, 1));
        tries += 1;
        if answered(&attempt.unwrap()).iter().any(|(by, _, _)| by == pod) {
            return;
        }
        assert!(Instant::now() < deadline, "{pod} never answered in {tries} {proto} tries");
    }
}

/// The same for an IPv6 NodePort: the pod is found by its /128 route.
#[test]
fn ebpf_a_new_ipv6_endpoint_has_the_replies_program_before_its_first_flow() {
    let mut lab = Lab::new().unwrap();
    lab.dual_stack().unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let first = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&first, &[8080], &[5353]).unwrap();
    let mut endpoints = vec![v6("10.244.1.2")];
    lab.write_manifest(&web6_on(&endpoints)).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&REPLIES).unwrap();
    for (round, proto) in ["udp", "tcp"].into_iter().enumerate() {
        let (name, ip) = (format!("web-n{round}"), format!("10.244.1.{}", 10 + round));
        let pod = lab.add_pod(&name, &ip).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        let veth = format!("veth{}", round + 2);
        wait_programs(&lab, &veth, &[]);
        endpoints.push(v6(&ip));
        lab.write_manifest(&web6_on(&endpoints)).unwrap();
        let port = if proto == "tcp" { 30080 } else { 30053 };
        let to = std::net::SocketAddr::new(NODE_IP6.parse().unwrap(), port).to_string();
        connect_until_answered_by(&lab, &ext, proto, &to, &name);
        assert_eq!(programs(&lab, &veth), REPLIES_ONLY, "{name} backs the service");
    }
}

/// An IPv6-only NodePort service `lab/web6` over the IPv6 pods at `ips`,
/// on node ports 30080 and 30053 as [`web_on`]'s.
fn web6_on(ips: &[String]) -> String {
    let web = service("lab", "web6")
        .cluster_ip("fd00:96::20")
        .cluster_ips(&["fd00:96::20"])
        .ip_families(&["IPv6"])
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(30080))
        .port(port("dns", 53).udp().target(5353).node_port(30053));
    let endpoints: Vec<_> = ips.iter().map(|ip| ep(ip).node("lab-node")).collect();
    let slice = slice("lab", "web6-ipv6")
        .service("web6")
        .address_type("IPv6")
        .port("http", 8080, Tcp)
        .port("dns", 5353, Udp)
        .endpoints(endpoints);
    manifest(&[&web, &slice])
}
