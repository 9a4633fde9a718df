//! SCTP services: the iptables mode writes kube-proxy's rules for their
//! SCTP ports; the eBPF mode leaves those ports out (for now), naming the
//! services once and counting them, and serves the others.

use proxy_lab::{Lab, Mode, Pod, Tally};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// Service `web`: http 80/TCP → 8080 (NodePort 30080) and diameter
/// 3868/SCTP → 3869 (NodePort 30868), over `pods`.
fn lab(mode: Mode) -> (Lab, Vec<Pod>, Pod) {
    let mut lab = Lab::with_mode(mode).unwrap();
    let pods = lab.add_web_pods(2, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let web = service("lab", "web")
        .node_port_type()
        .cluster_ip("10.96.0.10")
        .port(port("http", 80).target(8080).node_port(30080))
        .port(port("diameter", 3868).protocol(Sctp).target(3869).node_port(30868));
    let endpoints = pods.iter().map(|p| ep(&p.ip).node("lab-node"));
    let slice = web.slice().port("http", 8080, Tcp).port("diameter", 3869, Sctp);
    lab.write_manifest(&manifest(&[&web, &slice.endpoints(endpoints)])).unwrap();
    (lab, pods, client)
}

/// The pods that answered 20 connections to web's TCP port.
fn tcp_served(lab: &Lab, client: &Pod) -> Tally {
    let attempts = lab.client_outside(client).timeout_ms(500).tcp("10.96.0.10:80", 20).unwrap();
    Tally::of(&attempts)
}

/// The rules go in (the kernel has the sctp match even where it has no
/// SCTP sockets), and the TCP port is served as before.
#[test]
fn the_iptables_mode_writes_the_sctp_rules_and_serves_the_tcp_port() {
    let (mut lab, pods, client) = lab(Mode::Iptables);
    lab.start_agent(&[]).unwrap();
    let counts = tcp_served(&lab, &client);
    assert_eq!(counts.served().len(), 2, "{counts:?}\n{}", lab.agent_log());
    let saved = lab.iptables_save_on(0).unwrap();
    for line in [
        "-A KUBE-SERVICES -d 10.96.0.10/32 -p sctp -m comment --comment \"lab/web:diameter cluster IP\" -m sctp --dport 3868 -j KUBE-SVC-",
        "-A KUBE-NODEPORTS -p sctp -m comment --comment \"lab/web:diameter\" -m sctp --dport 30868 -j KUBE-EXT-",
        &format!(
            "-p sctp -m comment --comment \"lab/web:diameter\" -m sctp -j DNAT --to-destination {}:3869",
            pods[0].ip
        ),
    ] {
        assert!(saved.contains(line), "missing {line}\n{saved}");
    }
    assert!(!lab.agent_log().contains("SCTP service ports are not served"), "{}", lab.agent_log());
    // `lb list` reads them back.
    let lb = lab.inspect_on(0, &["lb", "list"]).unwrap();
    for frontend in ["10.96.0.10:3868/sctp", "*:30868/sctp", "10.96.0.10:80/tcp"] {
        assert!(lb.contains(frontend), "{frontend} missing:\n{lb}");
    }
    assert!(lb.contains(&format!("{}:3869", pods[1].ip)), "{lb}");
}

/// The eBPF mode leaves the SCTP port out: one line names the service, the
/// metric counts it, and the TCP port is served.
#[test]
fn the_ebpf_mode_leaves_sctp_ports_out_and_says_so_once() {
    let (mut lab, _pods, client) = lab(Mode::Ebpf);
    lab.start_agent(&[]).unwrap();
    let counts = tcp_served(&lab, &client);
    assert_eq!(counts.served().len(), 2, "{counts:?}\n{}", lab.agent_log());
    let log = lab.agent_log();
    let said = log.lines().filter(|l| l.contains("SCTP service ports are not served")).count();
    assert_eq!(said, 1, "{log}");
    assert!(log.contains("their other ports are: lab/web"), "{log}");
    let metrics = lab.metrics().unwrap();
    assert!(
        metrics.contains("proxy_services_refused{reason=\"sctp_unsupported\"} 1\n"),
        "{metrics}"
    );
    // No SCTP frontend in the maps.
    let lb = lab.inspect_on(0, &["lb", "list"]).unwrap();
    assert!(lb.contains("10.96.0.10:80/tcp") && !lb.contains("sctp"), "{lb}");
}
