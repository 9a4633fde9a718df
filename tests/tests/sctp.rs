//! SCTP services: the iptables and nftables modes write kube-proxy's rules
//! for their SCTP ports and serve them (an echo where the kernel has SCTP sockets:
//! the VM matrix's); the eBPF mode leaves those ports out (for now), naming
//! the services once and counting them, and serves the others.

use std::time::{Duration, Instant};

use proxy_lab::{Attempt, EXT_IP, Lab, Mode, Pod, Request, Tally, node_port};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// Service `web`: http 80/TCP → 8080 (NodePort 30080) and diameter
/// 3868/SCTP → 3869 (NodePort 30868), over `pods`.
fn web_manifest(pods: &[Pod]) -> String {
    let web = service("lab", "web")
        .node_port_type()
        .cluster_ip("10.96.0.10")
        .port(port("http", 80).target(8080).node_port(30080))
        .port(port("diameter", 3868).protocol(Sctp).target(3869).node_port(30868));
    let endpoints = pods.iter().map(|p| ep(&p.ip).node("lab-node"));
    let slice = web.slice().port("http", 8080, Tcp).port("diameter", 3869, Sctp);
    manifest(&[&web, &slice.endpoints(endpoints)])
}

/// Two web pods (serving TCP) and a client, `web` over the pods.
fn lab(mode: Mode) -> (Lab, Vec<Pod>, Pod) {
    let mut lab = Lab::with_mode(mode).unwrap();
    let pods = lab.add_web_pods(2, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    lab.write_manifest(&web_manifest(&pods)).unwrap();
    (lab, pods, client)
}

/// [`lab`] with its agent started, web's TCP port served by both pods.
fn serving(mode: Mode) -> (Lab, Vec<Pod>) {
    let (mut lab, pods, client) = lab(mode);
    lab.start_agent(&[]).unwrap();
    let attempts = lab.client_outside(&client).timeout_ms(500).tcp("10.96.0.10:80", 20).unwrap();
    let counts = Tally::of(&attempts);
    assert_eq!(counts.served().len(), 2, "{counts:?}\n{}", lab.agent_log());
    (lab, pods)
}

/// The rules go in (the kernel has the sctp match even where it has no
/// SCTP sockets), and the TCP port is served as before.
#[test]
fn the_iptables_mode_writes_the_sctp_rules_and_serves_the_tcp_port() {
    let (lab, pods) = serving(Mode::Iptables);
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

/// The nftables mode's table holds the SCTP port's elements and chains,
/// and `lb list` reads them back; the TCP port is served.
#[test]
fn the_nftables_mode_writes_the_sctp_ruleset_and_serves_the_tcp_port() {
    let (lab, pods) = serving(Mode::Nftables);
    let table = lab.exec_on(0, "nft", &["list", "table", "ip", "kube-proxy"]).unwrap();
    for text in [
        "10.96.0.10 . sctp . 3868 : goto service-",
        "sctp . 30868 : goto external-",
        &format!("meta l4proto sctp dnat to {}:3869", pods[0].ip),
    ] {
        assert!(table.contains(text), "missing {text}\n{table}");
    }
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
    let (lab, _pods) = serving(Mode::Ebpf);
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

/// Whether this kernel has SCTP sockets: the development machine's has
/// none (its netfilter knows SCTP all the same), the VM matrix's do.
fn sctp_sockets() -> std::io::Result<()> {
    let sctp = socket2::Protocol::from(libc::IPPROTO_SCTP);
    socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, Some(sctp)).map(drop)
}

/// The pods that answered `count` SCTP associations from `client` to
/// `addr`, each an exchange; every answer's server side port is checked
/// to be the target port.
fn sctp_served(lab: &Lab, client: &Pod, addr: &str, count: usize) -> Tally {
    let attempts = lab.client_outside(client).timeout_ms(2000).run(Request::sctp(addr, count));
    let attempts = attempts.unwrap();
    for attempt in &attempts {
        if let Attempt::Ok { local, .. } = attempt {
            assert!(local.ends_with(":3869"), "translated to the target port: {attempt:?}");
        }
    }
    Tally::of(&attempts)
}

/// An SCTP echo through the cluster IP and through a NodePort whose target
/// port differs, over both endpoints; then one endpoint goes and new
/// associations all reach the other, and `ct list` shows them.
fn sctp_echo_follows_the_endpoints(mode: Mode) {
    if let Err(e) = sctp_sockets() {
        eprintln!("no SCTP sockets in this kernel ({e}): the SCTP echo runs in the VM matrix");
        return;
    }
    let (mut lab, pods, client) = lab(mode);
    for pod in &pods {
        lab.serve_sctp(pod, 3869).unwrap();
    }
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&[]).unwrap();

    let cluster = sctp_served(&lab, &client, "10.96.0.10:3868", 20);
    assert_eq!(cluster.errors, Default::default(), "{cluster:?}\n{}", lab.agent_log());
    assert_eq!(cluster.served().len(), 2, "both endpoints: {cluster:?}");
    let nodeport = sctp_served(&lab, &ext, &node_port(30868), 20);
    assert_eq!(nodeport.errors, Default::default(), "{nodeport:?}\n{}", lab.agent_log());
    assert_eq!(nodeport.served().len(), 2, "both endpoints: {nodeport:?}");
    let flows = lab.inspect_on(0, &["ct", "list"]).unwrap();
    assert!(flows.contains(" sctp ") && flows.contains("lab/web:diameter"), "{flows}");

    // web-1 leaves: new associations reach web-0 alone.
    lab.write_manifest(&web_manifest(&pods[..1])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lab.inspect_on(0, &["lb", "list"]).unwrap().lines().all(|l| !l.contains(&pods[1].ip)) {
        assert!(Instant::now() < deadline, "web-1 still in the rules:\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    for addr in ["10.96.0.10:3868", &node_port(30868)] {
        let from = if addr.starts_with("10.96") { &client } else { &ext };
        let after = sctp_served(&lab, from, addr, 20);
        assert_eq!(after.errors, Default::default(), "{addr}: {after:?}");
        assert_eq!(after.served().keys().collect::<Vec<_>>(), [&pods[0].name], "{addr}: {after:?}");
    }
}

/// The rule-based modes only: the eBPF mode does not serve SCTP yet.
mod sctp_echo_follows_the_endpoints {
    #[test]
    fn iptables() {
        super::sctp_echo_follows_the_endpoints(proxy_lab::Mode::Iptables)
    }
    #[test]
    fn nftables() {
        super::sctp_echo_follows_the_endpoints(proxy_lab::Mode::Nftables)
    }
}
