//! Per-service traffic counters on /metrics (issue 13): a known number of
//! connections through a ClusterIP (by the socket LB and, from a pod outside
//! the socket-LB cgroup, per packet), a NodePort, a service without
//! endpoints and a source-range drop, and each counter equals what was sent.

use proxy_lab::{Attempt, EXT_IP, Lab, Mode, Setup, external_modes, node_port, sample};
use test_objects::{Protocol::*, ServiceBuilder, ep, manifest, port, service};

// With XDP too: a flow decided or dropped there is counted once.
external_modes!(per_service_counters_match_the_traffic_sent);

/// `name` with endpoints `pods` (ip) on node 0, serving http on 8080.
fn with_endpoints(svc: ServiceBuilder, pods: &[&str]) -> String {
    let endpoints = pods.iter().map(|ip| ep(ip).ready(true).node("lab-node"));
    let slice = svc.slice().port("http", 8080, Tcp).endpoints(endpoints);
    manifest(&[&svc, &slice])
}

fn oks(attempts: &[Attempt]) -> usize {
    attempts.iter().filter(|a| a.pod().is_some()).count()
}

fn per_service_counters_match_the_traffic_sent(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    let web_a = lab.add_pod("web-a", "10.244.1.2").unwrap();
    lab.serve(&web_a, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    // Per-packet clients from another address: the socket LB's connections
    // reach web-a from the client's own address, and web-a keeps them in
    // TIME_WAIT. A per-packet flow given one of their ports would meet that
    // state, be reset and start again: two flows for one connection.
    let outside = lab.add_pod("outside", "10.244.1.101").unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let web = service("lab", "web")
        .cluster_ip("10.96.0.10")
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(30080));
    let empty = service("lab", "empty")
        .cluster_ip("10.96.0.30")
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(30081));
    let guarded = service("lab", "guarded")
        .cluster_ip("10.96.0.40")
        .load_balancer_type()
        .port(port("http", 80).target(8080).node_port(30082))
        .source_ranges(&["192.168.100.250/32"])
        .ingress_ip("10.200.0.10");
    let yaml = with_endpoints(web, &["10.244.1.2"])
        + &with_endpoints(empty, &[])
        + &with_endpoints(guarded, &["10.244.1.2"]);
    lab.write_manifest(&yaml).unwrap();
    lab.drop_invalid_forwards(0).unwrap();
    lab.start_agent(&["--cluster-cidr", "10.244.0.0/16"]).unwrap();

    // Socket LB: 7 connections; per packet: 5 from the pod outside the
    // cgroup, 6 through the NodePort.
    assert_eq!(oks(&lab.client(&client).tcp("10.96.0.10:80", 7).unwrap()), 7);
    assert_eq!(oks(&lab.client_outside(&outside).tcp("10.96.0.10:80", 5).unwrap()), 5);
    assert_eq!(oks(&lab.client_outside(&ext).tcp(&node_port(30080), 6).unwrap()), 6);
    // No endpoints: 3 refused by the socket LB, 4 per packet.
    lab.client(&client).tcp("10.96.0.30:80", 3).unwrap();
    lab.client_outside(&ext).tcp(&node_port(30081), 4).unwrap();
    // Outside the source ranges: one SYN, dropped (no retransmission
    // within the timeout).
    lab.client_outside(&ext).timeout_ms(500).tcp("10.200.0.10:80", 1).unwrap();

    let web = "namespace=\"lab\",service=\"web\",port=\"http\"";
    if setup.mode == Mode::Nftables {
        // kube-proxy's nftables rules count nothing: no per-service series
        // (docs/nftables.md), and none made up.
        let metrics = lab.metrics().unwrap();
        assert!(!metrics.contains("proxy_service_connections_total{"), "{metrics}");
        assert!(
            metrics.contains("kubeproxy_sync_proxy_rules_nftables_sync_failures_total"),
            "{metrics}"
        );
        return;
    }
    let packet_conns = format!("{web},path=\"packet\"");
    let expected = if setup.mode == Mode::Ebpf { 11 } else { 18 };
    let metrics =
        lab.metrics_reaching("proxy_service_connections_total", &packet_conns, expected).unwrap();
    let empty = "namespace=\"lab\",service=\"empty\",port=\"http\"";
    let guarded = "namespace=\"lab\",service=\"guarded\",port=\"http\"";
    let get = |name: &str, labels: &str| sample(&metrics, name, labels);
    match setup.mode {
        Mode::Ebpf => {
            let conns = "proxy_service_connections_total";
            assert_eq!(get(conns, &format!("{web},path=\"socket\"")), 7, "{metrics}");
            assert_eq!(get(conns, &format!("{web},path=\"packet\"")), 11, "{metrics}");
            let refused = "proxy_service_refused_total";
            assert_eq!(get(refused, &format!("{empty},path=\"socket\"")), 3, "{metrics}");
            assert_eq!(get(refused, &format!("{empty},path=\"packet\"")), 4, "{metrics}");
            let dropped = format!("{guarded},reason=\"source_outside_ranges\"");
            assert_eq!(get("proxy_service_dropped_total", &dropped), 1, "{metrics}");
            // Each TCP connection is at least a SYN, a SYN-ACK and an ACK,
            // of at least 54 bytes each (Ethernet, IPv4, TCP headers),
            // counted in the flows' conntrack entries: the agent sums them
            // at its next collection (a second apart with so few flows).
            let metrics = lab.metrics_reaching("proxy_service_packets_total", web, 3 * 11).unwrap();
            let get = |name: &str, labels: &str| sample(&metrics, name, labels);
            let packets = get("proxy_service_packets_total", web);
            assert!(packets >= 3 * 11, "{packets} packets:\n{metrics}");
            let bytes = get("proxy_service_bytes_total", web);
            assert!(bytes >= 54 * packets, "{bytes} bytes of {packets} packets");
        }
        Mode::Iptables | Mode::Nftables => {
            // The nat table sees each new connection's first packet; the
            // socket path does not exist.
            let conns = "proxy_service_connections_total";
            assert_eq!(get(conns, &format!("{web},path=\"packet\"")), 18, "{metrics}");
            let refused = "proxy_service_refused_total";
            assert_eq!(get(refused, &format!("{empty},path=\"packet\"")), 7, "{metrics}");
            let dropped = format!("{guarded},reason=\"source_outside_ranges\"");
            assert_eq!(get("proxy_service_dropped_total", &dropped), 1, "{metrics}");
        }
    }
}
