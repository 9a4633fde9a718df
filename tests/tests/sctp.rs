//! SCTP services: the iptables and nftables modes write kube-proxy's rules
//! for their SCTP ports, the eBPF mode translates them per packet in its
//! SCTP programs (loaded for the first SCTP frontend), and every mode serves
//! them (an echo where the kernel has SCTP sockets: the VM matrix's).

use std::time::{Duration, Instant};

use proxy_lab::{Attempt, EXT_IP, Lab, Mode, NODE_IP, Pod, Request, Tally, node_port, sample};
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
    // explain walks them.
    let x = explain(&lab, EXT_IP, &node_port(30868));
    assert_eq!(x["outcome"], "translated", "{x}");
    assert!(x["snat"].as_str().is_some_and(|s| s.starts_with("MASQUERADE")), "{x}");
}

/// `explain --proto sctp` as JSON.
fn explain(lab: &Lab, from: &str, to: &str) -> serde_json::Value {
    let args = ["explain", "--proto", "sctp", "--from", from, "--to", to, "-o", "json"];
    let json = lab.inspect_on(0, &args).unwrap();
    serde_json::from_str(&json).expect(&json)
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

/// The eBPF mode loads its SCTP programs once, for the first SCTP
/// frontend (a node without one never pays their verifier run, nor an
/// IPv4-only one the IPv6 programs'), and writes the SCTP frontends with
/// the others.
#[test]
fn the_ebpf_mode_loads_its_sctp_programs_for_the_first_sctp_frontend() {
    const LOADED: &str = "the SCTP programs are loaded";
    let (mut lab, pods, client) = lab(Mode::Ebpf);
    let tcp_only =
        service("lab", "web").cluster_ip("10.96.0.10").port(port("http", 80).target(8080));
    let endpoints = pods.iter().map(|p| ep(&p.ip).node("lab-node"));
    let slice = tcp_only.slice().port("http", 8080, Tcp).endpoints(endpoints);
    lab.write_manifest(&manifest(&[&tcp_only, &slice])).unwrap();
    lab.start_agent(&[]).unwrap();
    let attempts = lab.client_outside(&client).timeout_ms(500).tcp("10.96.0.10:80", 10).unwrap();
    assert_eq!(Tally::of(&attempts).served().len(), 2, "{}", lab.agent_log());
    assert!(!lab.agent_log().contains(LOADED), "{}", lab.agent_log());
    // Nor the IPv6 ones on a node with IPv4 frontends only.
    assert!(!lab.agent_log().contains("IPv6 programs"), "{}", lab.agent_log());

    lab.write_manifest(&web_manifest(&pods)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lab.inspect_on(0, &["lb", "list"]).unwrap().contains("10.96.0.10:3868/sctp") {
        assert!(Instant::now() < deadline, "no SCTP frontend:\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = lab.agent_log();
    assert_eq!(log.matches(LOADED).count(), 1, "{log}");
    let lb = lab.inspect_on(0, &["lb", "list"]).unwrap();
    // NodePorts on the node's address, not at 127.0.0.1 (no socket hook
    // sees SCTP).
    assert!(!lb.contains("127.0.0.1:30868"), "{lb}");
    for frontend in [":30868/sctp", "10.96.0.10:80/tcp"] {
        assert!(lb.contains(frontend), "{frontend} missing:\n{lb}");
    }
    assert!(lb.contains(&format!("{}:3869", pods[1].ip)), "{lb}");

    // explain runs the SCTP program on an INIT (no SCTP socket needed): a
    // NodePort association SNATed to a pod's target port, a pod's ClusterIP
    // one translated on its interface.
    let backends: Vec<String> = pods.iter().map(|p| format!("{}:3869", p.ip)).collect();
    for (from, to, snat) in
        [(EXT_IP, node_port(30868), Some(NODE_IP)), (&client.ip, "10.96.0.10:3868".into(), None)]
    {
        let x = explain(&lab, from, &to);
        assert_eq!(x["outcome"], "translated", "{x}");
        assert!(backends.iter().any(|b| x["picked"] == b.as_str()), "{x}");
        assert_eq!(x["snat"].as_str(), snat, "{x}");
    }
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
    served(lab, client, Request::sctp(addr, count))
}

/// The pod that answered one association from `client`'s port `port` to
/// `addr`: a peer with a port of its own, as Diameter peers have.
fn from_peer_port(lab: &Lab, client: &Pod, addr: &str, port: u16) -> String {
    let tally = served(lab, client, Request::sctp(addr, 1).source_port_base(port));
    tally.served().keys().next().cloned().unwrap_or_default()
}

/// The first of `client`'s ports from 40,100 up whose association to
/// `addr` reached `pod` (each tried once: in the rule-based modes a port
/// keeps its first pick).
fn peer_port_reaching(lab: &Lab, client: &Pod, addr: &str, pod: &Pod) -> u16 {
    let ports = 40_100..40_120;
    ports.clone().find(|&port| from_peer_port(lab, client, addr, port) == pod.name).unwrap_or_else(
        || panic!("{addr}: no association from ports {ports:?} reached {}", pod.name),
    )
}

/// [`sctp_served`] of any SCTP request.
fn served(lab: &Lab, client: &Pod, request: Request) -> Tally {
    let attempts = lab.client_outside(client).timeout_ms(2000).run(request).unwrap();
    for attempt in &attempts {
        if let Attempt::Ok { local, .. } = attempt {
            assert!(local.ends_with(":3869"), "translated to the target port: {attempt:?}");
        }
    }
    Tally::of(&attempts)
}

/// An SCTP echo through the cluster IP and through a NodePort whose target
/// port differs, over both endpoints; then one endpoint goes and new
/// associations all reach the other, those of a peer whose port's last
/// association was the gone endpoint's included (no stale entry keeps it
/// there), and `ct list` shows them.
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
    // The service port's metrics count its associations (both translated
    // per packet: no socket hook sees SCTP); kube-proxy's nftables rules
    // count nothing (docs/nftables.md).
    if mode != Mode::Nftables {
        let diameter = "namespace=\"lab\",service=\"web\",port=\"diameter\",path=\"packet\"";
        let conns = "proxy_service_connections_total";
        let metrics = lab.metrics_reaching(conns, diameter, 40).unwrap();
        assert!(sample(&metrics, conns, diameter) >= 40, "{metrics}");
    }

    // Peers with a port of their own, whose last association was web-1's.
    // In the eBPF mode each association from one port is picked anew: it
    // reaches web-0 too, and web-1 again. (The rule-based modes keep a
    // port's first pick while it lives: the kernel's conntrack entry of a
    // closed association keeps its NAT for the next INIT of its tuple, as
    // under kube-proxy.)
    let peers = [(&client, "10.96.0.10:3868".to_string()), (&ext, node_port(30868))];
    let mut peer_ports = Vec::new();
    for (from, addr) in &peers {
        let port = peer_port_reaching(&lab, from, addr, &pods[1]);
        if mode == Mode::Ebpf {
            for pod in [&pods[0], &pods[1]] {
                let reached = (0..30).any(|_| from_peer_port(&lab, from, addr, port) == pod.name);
                assert!(reached, "{addr}: no association from port {port} reached {}", pod.name);
            }
        }
        peer_ports.push(port);
    }

    // web-1 leaves: new associations reach web-0 alone.
    lab.write_manifest(&web_manifest(&pods[..1])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lab.inspect_on(0, &["lb", "list"]).unwrap().lines().all(|l| !l.contains(&pods[1].ip)) {
        assert!(Instant::now() < deadline, "web-1 still in the rules:\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    // First the peers, whose port's last association (closed just now) was
    // web-1's: its entry went with web-1 (none is left in `ct list`).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let flows = lab.inspect_on(0, &["ct", "list"]).unwrap();
        if !flows.lines().any(|l| l.contains(&pods[1].ip)) {
            break;
        }
        assert!(Instant::now() < deadline, "flows to web-1 left:\n{flows}\n{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    for ((from, addr), port) in peers.iter().zip(peer_ports) {
        for _ in 0..3 {
            assert_eq!(from_peer_port(&lab, from, addr, port), pods[0].name, "{addr}, port {port}");
        }
    }
    for addr in ["10.96.0.10:3868", &node_port(30868)] {
        let from = if addr.starts_with("10.96") { &client } else { &ext };
        let after = sctp_served(&lab, from, addr, 20);
        assert_eq!(after.errors, Default::default(), "{addr}: {after:?}");
        assert_eq!(after.served().keys().collect::<Vec<_>>(), [&pods[0].name], "{addr}: {after:?}");
    }
}

mod sctp_echo_follows_the_endpoints {
    #[test]
    fn ebpf() {
        super::sctp_echo_follows_the_endpoints(proxy_lab::Mode::Ebpf)
    }

    #[test]
    fn iptables() {
        super::sctp_echo_follows_the_endpoints(proxy_lab::Mode::Iptables)
    }
    #[test]
    fn nftables() {
        super::sctp_echo_follows_the_endpoints(proxy_lab::Mode::Nftables)
    }
}
