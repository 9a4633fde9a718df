//! Packet-level tests of the per-packet program: the loaded program runs on
//! crafted packets with `BPF_PROG_TEST_RUN` (nothing is sent), and the test
//! checks the packet it produced byte by byte, recomputing every checksum
//! itself. Each test runs in a network namespace of its own (empty, so FIB
//! lookups find no route and translated packets are handed to the "stack").
//! Needs root.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use proxy_agent::{
    backend::ebpf::{BpfObject, PacketRun, TcAttach},
    model::{Cidr, EndpointAddr, Protocol, ServiceName, ServicePortName},
    packet_craft::{
        self, ICMP, ICMPV6, TCP, UDP, fold, l4_checksum_ok, set_ipv4_checksum, set_l4_checksum,
        sum16, with_ports,
    },
    plan::{BackendPlan, Frontend, FrontendKind, FrontendPlan, Plan},
};
use proxy_common::{
    Config, Counter,
    explain::{AFFINITY, Decided, SNAT, decode},
    log_level,
    record::{Kind, Outcome, Program, Record},
};

const NEXT: i32 = -1;
const STACK: i32 = 0;
const SHOT: i32 = 2;
const REDIRECT: i32 = 7;

const NODE: [u8; 4] = [192, 168, 100, 11];
const CLIENT: [u8; 4] = [192, 168, 100, 101];
const POD: [u8; 4] = [10, 244, 2, 2];
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const RST: u8 = 0x04;

fn in_own_netns() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "packet tests load BPF programs: run as root");
    // SAFETY: moves this test's thread alone into a new, empty namespace.
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare(CLONE_NEWNET)");
}

fn frontend(ip: impl Into<IpAddr>, port: u16, protocol: Protocol) -> Frontend {
    Frontend::new(ip.into(), port, protocol)
}

/// Of either family: `[u8; 4]` or `[u8; 16]` addresses.
fn frontend_plan<A: Into<IpAddr> + Copy>(
    backends: &[(A, u16)],
    external: bool,
    ranges: &[&str],
) -> FrontendPlan {
    FrontendPlan {
        service: Arc::new(ServicePortName {
            service: ServiceName { namespace: "t".into(), name: "svc".into() },
            port: "".into(),
        }),
        kind: if external { FrontendKind::NodePort } else { FrontendKind::ClusterIp },
        backends: backends
            .iter()
            .map(|(ip, port)| BackendPlan {
                addr: EndpointAddr::new((*ip).into(), *port),
                local: false,
                host: false,
            })
            .collect(),
        affinity_timeout_secs: None,
        external,
        maglev: false,
        dsr: false,
        local: false,
        drop_when_empty: false,
        source_ranges: ranges.iter().map(|r| Cidr::parse(r).unwrap()).collect(),
        two_scopes: false,
        serves_terminating: false,
    }
}

fn datapath(frontends: Vec<(Frontend, FrontendPlan)>) -> BpfObject {
    in_own_netns();
    let mut backend = BpfObject::load(TcAttach::Tcx).expect("load the programs");
    backend.configure(&test_config()).unwrap();
    backend.sync(&Plan { frontends: frontends.into_iter().collect() }, None).unwrap();
    backend
}

fn test_config() -> Config {
    Config {
        snat_addr: NODE,
        cluster_cidr: [10, 244, 0, 0],
        cluster_cidr_prefix: 16,
        masquerade_all: 0,
        snat_port_min: 61000,
        snat_port_max: 65000,
        tcp_syn_timeout_secs: 60,
        tcp_established_timeout_secs: 3600,
        tcp_close_wait_timeout_secs: 3600,
        tcp_time_wait_timeout_secs: 120,
        udp_timeout_secs: 30,
        udp_stream_timeout_secs: 120,
        snat_addr6: NODE6,
        cluster_cidr6: POD_CLIENT6,
        cluster_cidr6_prefix: 48,
        ..Config::default()
    }
}

/// Distinct MACs (destination, source), for the programs that swap them.
const MACS: [u8; 12] = [2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2];

/// Ethernet + IP (valid header checksum) + L4 header (`src` and `dst`'s
/// ports, then `l4_rest`) and payload, its L4 checksum left as given.
fn frame<const N: usize>(
    proto: u8,
    src: ([u8; N], u16),
    dst: ([u8; N], u16),
    rest: &[u8],
) -> Vec<u8>
where
    IpAddr: From<[u8; N]>,
{
    let l4 = with_ports(src.1, dst.1, rest);
    let mut p = packet_craft::frame(proto, IpAddr::from(src.0), IpAddr::from(dst.0), &l4);
    p[..12].copy_from_slice(&MACS);
    p
}

/// Ethernet + IPv4 (valid header checksum) + L4 header and payload.
fn packet(proto: u8, src: ([u8; 4], u16), dst: ([u8; 4], u16), l4_rest: &[u8]) -> Vec<u8> {
    frame(proto, src, dst, l4_rest)
}

/// A 32-byte TCP header with the given flags, seq 1000, MSS and SACK options, and a
/// valid checksum.
fn tcp(src: ([u8; 4], u16), dst: ([u8; 4], u16), flags: u8) -> Vec<u8> {
    let mut p = packet(TCP, src, dst, &tcp_rest(flags));
    set_l4_checksum(&mut p);
    p
}

/// A TCP header after its ports: seq 1000, MSS and SACK options.
fn tcp_rest(flags: u8) -> Vec<u8> {
    let mut rest = vec![0, 0, 0x03, 0xe8, 0, 0, 0, 0, 0x80, flags, 0xfa, 0xf0, 0, 0, 0, 0];
    rest.extend_from_slice(&[2, 4, 0x05, 0xb4, 4, 2, 1, 1, 1, 1, 1, 0]);
    rest
}

/// A UDP header after its ports (checksum 0) and a payload.
fn udp_rest() -> Vec<u8> {
    let payload = b"hello";
    let mut rest = vec![0, 0, 0, 0];
    rest[0..2].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    rest.extend_from_slice(payload);
    rest
}

fn udp(src: ([u8; 4], u16), dst: ([u8; 4], u16), with_checksum: bool) -> Vec<u8> {
    let mut p = packet(UDP, src, dst, &udp_rest());
    if with_checksum {
        set_l4_checksum(&mut p);
    }
    p
}

fn csum_offset(p: &[u8]) -> usize {
    34 + if p[23] == TCP { 16 } else { 6 }
}

/// Checks the IPv4 header checksum and the TCP/UDP/ICMP one.
fn assert_checksums(p: &[u8]) {
    assert!(packet_craft::ipv4_checksum_ok(p), "IPv4 header checksum of {p:02x?}");
    if p[23] == UDP && p[csum_offset(p)..csum_offset(p) + 2] == [0, 0] {
        return;
    }
    assert!(l4_checksum_ok(p), "L4 checksum of {p:02x?}");
}

fn tuple(p: &[u8]) -> (([u8; 4], u16), ([u8; 4], u16)) {
    let addr = |o: usize| [p[o], p[o + 1], p[o + 2], p[o + 3]];
    let port = |o: usize| u16::from_be_bytes([p[o], p[o + 1]]);
    ((addr(26), port(34)), (addr(30), port(36)))
}

fn run(backend: &mut BpfObject, p: &[u8]) -> PacketRun {
    backend.run_tc(p, 1).expect("test run")
}

#[test]
fn node_port_flow_is_translated_both_ways_with_valid_checksums() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30080, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], true, &[]),
    )]);
    let syn = tcp((CLIENT, 40000), (NODE, 30080), SYN);
    let out = run(&mut dp, &syn);
    assert_eq!(out.verdict, STACK, "no route in an empty netns: the stack gets it");
    let ((src, sport), dst) = tuple(&out.packet);
    assert_eq!(src, NODE, "external traffic with policy Cluster is SNATed");
    assert!((61000..=65000).contains(&sport), "SNAT port {sport} in range");
    assert_eq!(dst, (POD, 8080));
    assert_eq!(out.packet.len(), syn.len());
    assert_checksums(&out.packet);
    assert_eq!(out.packet[34 + 20..], syn[34 + 20..], "options untouched");
    assert_eq!(out.packet[22], 64, "the stack decrements the TTL of what it forwards");

    let syn_ack = tcp((POD, 8080), (NODE, sport), SYN | ACK);
    let back = run(&mut dp, &syn_ack);
    assert_eq!(back.verdict, STACK);
    assert_eq!(tuple(&back.packet), ((NODE, 30080), (CLIENT, 40000)));
    assert_checksums(&back.packet);

    // The same client packet again follows the same flow.
    let again = run(&mut dp, &syn);
    assert_eq!(again.packet, out.packet, "a tracked packet, rewritten as the first");
}

/// Where the socket LB translates every pod's connections, pod interfaces
/// run `tc_pod_replies`: a pod's packet to a frontend passes as it is, while
/// the reply of a NodePort flow to a pod here is translated back.
#[test]
fn pod_interfaces_covered_by_the_socket_lb_translate_only_replies() {
    let vip = [10, 96, 0, 10];
    let mut dp = datapath(vec![
        (frontend(NODE, 30080, Protocol::Tcp), frontend_plan(&[(POD, 8080)], true, &[])),
        (frontend(vip, 80, Protocol::Tcp), frontend_plan(&[(POD, 8080)], false, &[])),
    ]);
    let pod_replies = |dp: &mut BpfObject, p: &[u8]| dp.run_tc_pod_replies(p, 1).unwrap();
    let to_service = tcp(([10, 244, 1, 5], 50000), (vip, 80), SYN);
    let out = pod_replies(&mut dp, &to_service);
    assert_eq!((out.verdict, &out.packet), (NEXT, &to_service), "left to the socket LB");
    assert_eq!(run(&mut dp, &to_service).verdict, STACK, "tc_ingress translates it");

    let out = run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), SYN));
    let ((_, sport), _) = tuple(&out.packet);
    let back = pod_replies(&mut dp, &tcp((POD, 8080), (NODE, sport), SYN | ACK));
    assert_eq!(back.verdict, STACK);
    assert_eq!(tuple(&back.packet), ((NODE, 30080), (CLIENT, 40000)));
    assert_checksums(&back.packet);
}

/// The pre-filter lets a backend's replies reach the full path only while
/// it has per-packet flows not masqueraded: the datapath marks its reply
/// slot when it creates one, and the conntrack collection, a generation at
/// a time, clears the slots of flows that ended. Replies of connections the
/// socket LB translated (no per-packet flow) pass untouched.
#[test]
fn replies_reach_the_full_path_only_from_backends_with_per_packet_flows() {
    let (vip, dns) = ([10, 96, 0, 10], [10, 96, 0, 53]);
    let mut dp = datapath(vec![
        (frontend(vip, 80, Protocol::Tcp), frontend_plan(&[(POD, 8080)], false, &[])),
        (frontend(dns, 53, Protocol::Udp), frontend_plan(&[(POD, 5353)], false, &[])),
    ]);
    let pod_replies = |dp: &mut BpfObject, p: &[u8]| dp.run_tc_pod_replies(p, 1).unwrap();
    let (pod, client) = (IpAddr::from(POD), [10, 244, 1, 5]);
    // A new datapath inspects every reply (the flows it may have carried
    // over), until two collections have rebuilt both generations.
    assert!(dp.reply_slot_set(pod, 8080, TCP));
    dp.collect_conntrack().unwrap();
    assert!(dp.reply_slot_set(pod, 8080, TCP), "one generation still all set");
    dp.collect_conntrack().unwrap();
    // A socket-LB connection: the backend answers a client directly.
    let socket_lb_reply = tcp((POD, 8080), (client, 50000), SYN | ACK);
    assert!(!dp.reply_slot_set(pod, 8080, TCP), "no per-packet flow");
    for out in [pod_replies(&mut dp, &socket_lb_reply), run(&mut dp, &socket_lb_reply)] {
        assert_eq!((out.verdict, &out.packet), (NEXT, &socket_lb_reply));
    }

    // A pod's per-packet flow through the ClusterIP (not masqueraded).
    let out = run(&mut dp, &tcp((client, 40000), (vip, 80), SYN));
    assert_eq!(tuple(&out.packet), ((client, 40000), (POD, 8080)));
    assert!(dp.reply_slot_set(pod, 8080, TCP));
    let back = pod_replies(&mut dp, &tcp((POD, 8080), (client, 40000), SYN | ACK));
    assert_eq!(tuple(&back.packet), ((vip, 80), (client, 40000)), "its reply is translated");
    // Collections keep a live flow's slot, whichever generation they rebuild.
    for _ in 0..3 {
        dp.collect_conntrack().unwrap();
        assert!(dp.reply_slot_set(pod, 8080, TCP));
    }
    let out = pod_replies(&mut dp, &socket_lb_reply);
    assert_eq!((out.verdict, &out.packet), (NEXT, &socket_lb_reply), "no flow of its own");

    // A UDP flow that expires: after the collections that rebuild both
    // generations, its backend's replies pass untouched again.
    dp.configure(&Config { udp_timeout_secs: 1, ..test_config() }).unwrap();
    let out = run(&mut dp, &udp((client, 40001), (dns, 53), true));
    assert_eq!(tuple(&out.packet).1, (POD, 5353));
    assert!(dp.reply_slot_set(pod, 5353, UDP));
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(
        dp.collect_conntrack().unwrap().counts(),
        (2, 2),
        "the UDP flow went, the TCP one stays"
    );
    assert!(dp.reply_slot_set(pod, 5353, UDP), "the other generation still has it");
    dp.collect_conntrack().unwrap();
    assert!(!dp.reply_slot_set(pod, 5353, UDP));
    assert!(dp.reply_slot_set(pod, 8080, TCP));
    let late = udp((POD, 5353), (client, 40001), true);
    let out = pod_replies(&mut dp, &late);
    assert_eq!((out.verdict, &out.packet), (NEXT, &late));
}

/// IPv6 packets take the pre-filter too: a miss passes, a flow not
/// masqueraded marks its backend's reply slot and its replies translate.
#[test]
fn ipv6_replies_reach_the_full_path_only_from_backends_with_per_packet_flows() {
    let mut dp = datapath(vec![(
        frontend(CLUSTER_IP6, 80, Protocol::Tcp),
        frontend_plan(&[(POD6, 8080)], false, &[]),
    )]);
    let mut client = POD_CLIENT6;
    client[15] = 5;
    let pod = IpAddr::from(POD6);
    let socket_lb_reply = tcp6((POD6, 8080), (client, 50000), SYN | ACK);
    for _ in 0..2 {
        dp.collect_conntrack().unwrap();
    }
    assert!(!dp.reply_slot_set(pod, 8080, TCP));
    let miss = tcp6((client, 40000), (CLUSTER_IP6, 22), SYN);
    for p in [&socket_lb_reply, &miss] {
        let out = run(&mut dp, p);
        assert_eq!((out.verdict, &out.packet), (NEXT, p));
    }
    let out = run(&mut dp, &tcp6((client, 40000), (CLUSTER_IP6, 80), SYN));
    assert_eq!(tuple6(&out.packet), ((client, 40000), (POD6, 8080)));
    assert!(dp.reply_slot_set(pod, 8080, TCP));
    assert!(!dp.reply_slot_set(IpAddr::from(POD), 8080, TCP), "IPv4 slot apart");
    let back = dp.run_tc_pod_replies(&tcp6((POD6, 8080), (client, 40000), SYN | ACK), 1).unwrap();
    assert_eq!(tuple6(&back.packet), ((CLUSTER_IP6, 80), (client, 40000)));
    assert_checksums6(&back.packet);
}

/// The conntrack collection reads the map in batches (the kernel has them:
/// 5.6+) and sees both directions of a live flow; the sync wrote its
/// service slots and backends in batches too.
#[test]
fn the_conntrack_collection_reads_live_flows_in_batches() {
    let backends: Vec<([u8; 4], u16)> = (0..50).map(|i| ([10, 244, 3, i], 8080)).collect();
    let mut dp =
        datapath(vec![(frontend(NODE, 30080, Protocol::Tcp), frontend_plan(&backends, true, &[]))]);
    for port in 40000..40010 {
        let out = run(&mut dp, &tcp((CLIENT, port), (NODE, 30080), SYN));
        assert_eq!(out.verdict, STACK);
    }
    assert_eq!(dp.collect_conntrack().unwrap().counts(), (0, 20), "ten flows, both directions");
    assert!(proxy_agent::backend::ebpf::batch::supported());
}

/// An explain run takes the real path and says what it decided, but leaves
/// no flow behind (so no SNAT port is chosen); a tracked flow is followed
/// without its entries being refreshed.
#[test]
fn explain_runs_decide_without_leaving_state() {
    let lb = [10, 200, 0, 10];
    let mut affine = frontend_plan(&[(POD, 8080), ([10, 244, 2, 3], 8080)], true, &[]);
    affine.affinity_timeout_secs = Some(600);
    let mut dp = datapath(vec![
        (frontend(NODE, 30080, Protocol::Tcp), affine),
        (frontend(NODE, 30081, Protocol::Tcp), frontend_plan::<[u8; 4]>(&[], true, &[])),
        (
            frontend(lb, 80, Protocol::Tcp),
            frontend_plan(&[(POD, 8080)], true, &["192.168.100.96/29"]),
        ),
    ]);
    let syn = tcp((CLIENT, 40000), (NODE, 30080), SYN);
    let out = dp.explain_tc(&syn).unwrap();
    assert_eq!(out.verdict, STACK);
    let (decided, flags) = decode(out.cb[2]).expect("a decision");
    assert_eq!((decided, flags & SNAT, flags & AFFINITY), (Decided::Translated, SNAT, 0));
    assert_ne!(out.cb[3], 0, "the frontend's reverse-NAT id");
    assert_eq!(tuple(&out.packet).0, (NODE, 40000), "SNAT port chosen only with a flow");
    assert!([(POD, 8080), ([10, 244, 2, 3], 8080)].contains(&tuple(&out.packet).1));
    assert_checksums(&out.packet);
    assert_eq!(dp.collect_conntrack().unwrap().counts(), (0, 0), "no flow created");
    // No affinity was remembered: explain runs never say "affinity".
    for port in 40001..40010 {
        let again = dp.explain_tc(&tcp((CLIENT, port), (NODE, 30080), SYN)).unwrap();
        assert_eq!(decode(again.cb[2]).unwrap().1 & AFFINITY, 0);
    }
    // A real packet creates the flow; explaining it then finds it tracked.
    let real = run(&mut dp, &syn);
    assert_eq!(dp.collect_conntrack().unwrap().counts(), (0, 2));
    let tracked = dp.explain_tc(&tcp((CLIENT, 40000), (NODE, 30080), ACK)).unwrap();
    assert_eq!((tracked.verdict, tracked.cb[2]), (STACK, 0), "no new decision");
    assert_eq!(tuple(&tracked.packet), tuple(&real.packet));

    let refused = dp.explain_tc(&tcp((CLIENT, 40000), (NODE, 30081), SYN)).unwrap();
    assert_eq!(refused.verdict, REDIRECT);
    assert_eq!(decode(refused.cb[2]), Some((Decided::Refused, 0)));
    assert_eq!(refused.packet[34 + 13], RST | ACK);
    let dropped = dp.explain_tc(&tcp(([192, 168, 100, 200], 40000), (lb, 80), SYN)).unwrap();
    assert_eq!(dropped.verdict, SHOT);
    assert_eq!(decode(dropped.cb[2]), Some((Decided::SourceOutsideRanges, 0)));
    let passed = dp.explain_tc(&tcp((CLIENT, 40000), (NODE, 22), SYN)).unwrap();
    assert_eq!((passed.verdict, passed.cb[2], passed.cb[3]), (NEXT, 0, 0));
    assert_eq!(dp.collect_conntrack().unwrap().counts(), (0, 2), "still only the real flow");
}

#[test]
fn a_direct_connection_reusing_a_closed_flows_tuple_is_left_alone() {
    const FIN: u8 = 0x01;
    let vip = ([10, 96, 0, 10], 80);
    let mut dp = datapath(vec![(
        frontend(vip.0, vip.1, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], false, &[]),
    )]);
    // A pod's flow through the ClusterIP, opened and closed both ways.
    let client = ([10, 244, 1, 5], 40000);
    for (from, to, flags) in [
        (client, vip, SYN),
        ((POD, 8080), client, SYN | ACK),
        (client, vip, ACK),
        (client, vip, FIN | ACK),
        ((POD, 8080), client, FIN | ACK),
        (client, vip, ACK),
    ] {
        let out = run(&mut dp, &tcp(from, to, flags));
        let expected = if to == vip { (client, (POD, 8080)) } else { (vip, client) };
        assert_eq!(tuple(&out.packet), expected, "flags {flags:#x}");
    }
    // The same pod port now connects to the backend directly (socket LB, or
    // its own choice): the backend's SYN-ACK and what follows are its own.
    for flags in [SYN | ACK, ACK] {
        let direct = tcp((POD, 8080), client, flags);
        let out = run(&mut dp, &direct);
        assert_eq!(out.verdict, NEXT, "flags {flags:#x}");
        assert_eq!(out.packet, direct, "not rewritten for the closed flow");
    }
}

#[test]
fn udp_checksums_stay_valid_and_zero_stays_zero() {
    let mut dp = datapath(vec![(
        frontend([10, 96, 0, 10], 53, Protocol::Udp),
        frontend_plan(&[(POD, 5353)], false, &[]),
    )]);
    let client = ([10, 244, 1, 5], 40000);
    let with = run(&mut dp, &udp(client, ([10, 96, 0, 10], 53), true));
    assert_eq!(tuple(&with.packet), (client, (POD, 5353)), "in-cluster source: no SNAT");
    assert_ne!(with.packet[40..42], [0, 0]);
    assert_checksums(&with.packet);

    let without = run(&mut dp, &udp(([10, 244, 1, 6], 40001), ([10, 96, 0, 10], 53), false));
    assert_eq!(tuple(&without.packet).1, (POD, 5353));
    assert_eq!(without.packet[40..42], [0, 0], "no checksum stays no checksum");
    assert_checksums(&without.packet);
}

#[test]
fn foreign_packets_pass_untouched() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30080, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], true, &[]),
    )]);
    let mut icmp = packet(1, (CLIENT, 0x0800), (NODE, 0), &[0, 0, 0, 1]);
    icmp[34] = 8;
    let mut arp = tcp((CLIENT, 40000), (NODE, 30080), SYN);
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    let not_a_service = tcp((CLIENT, 40000), (NODE, 22), SYN);
    let mut unknown_fragment = udp((CLIENT, 40000), (NODE, 30053), true);
    unknown_fragment[20..22].copy_from_slice(&[0x00, 0x10]); // offset 128, no first seen
    for p in [icmp, arp, not_a_service, unknown_fragment] {
        let out = run(&mut dp, &p);
        assert_eq!(out.verdict, NEXT, "{p:02x?}");
        assert_eq!(out.packet, p);
    }
}

/// At `trace` a packet of no service is recorded: a record its tuple and
/// outcome, read back from `RECORDS`; a flood nobody reads fills the ring
/// buffer, and each record that found it full is counted, none is lost
/// silently.
#[test]
fn decision_records_are_written_and_those_a_full_ring_refuses_counted() {
    let mut dp = datapath(vec![]);
    dp.configure(&Config { log_level: log_level::TRACE, ..test_config() }).unwrap();
    let not_a_service = tcp((CLIENT, 40000), (NODE, 22), SYN);
    assert_eq!(run(&mut dp, &not_a_service).verdict, NEXT);
    let mut ring = dp.take_records().unwrap();
    let item = ring.next().expect("a record");
    // SAFETY: the programs write whole `Record`s.
    let record = unsafe { item.as_ptr().cast::<Record>().read_unaligned() };
    drop(item);
    assert_eq!(record.kind, Kind::Outcome as u8);
    assert_eq!(record.detail, Outcome::NoService as u8);
    assert_eq!((record.program, record.level), (Program::TcIngress as u8, log_level::TRACE));
    assert_eq!((&record.tuple.saddr[..4], record.tuple.sport), (&CLIENT[..], 40000));
    assert_eq!((&record.tuple.daddr[..4], record.tuple.dport), (&NODE[..], 22));
    assert!(ring.next().is_none());
    assert_eq!(dp.counter(Counter::RecordLost).unwrap(), 0);

    // 128 KiB of 80-byte entries (a record and the ring's header) hold 1,638.
    let flood = 3000;
    dp.run_tc(&not_a_service, flood).unwrap();
    let mut written = 0;
    while ring.next().is_some() {
        written += 1;
    }
    let lost = dp.counter(Counter::RecordLost).unwrap();
    assert!((1000..2000).contains(&written), "{written} written");
    assert_eq!(written + lost, u64::from(flood));
}

#[test]
fn fragments_of_a_datagram_follow_the_first() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30053, Protocol::Udp),
        frontend_plan(&[(POD, 5353)], true, &[]),
    )]);
    // First fragment: more-fragments set, offset 0; its UDP checksum covers
    // the whole datagram, so only the incremental change can be checked.
    let whole = udp((CLIENT, 40000), (NODE, 30053), true);
    let mut first = whole.clone();
    first[20] |= 0x20;
    set_ipv4_checksum(&mut first);
    let out = run(&mut dp, &first);
    let ((src, sport), dst) = tuple(&out.packet);
    assert_eq!((src, dst), (NODE, (POD, 5353)));
    assert!(packet_craft::ipv4_checksum_ok(&out.packet), "IPv4 header checksum");
    // The same rewrite applied to the unfragmented datagram gives the same
    // UDP checksum: the incremental update is right for the whole datagram.
    let mut expect = whole.clone();
    expect[26..30].copy_from_slice(&NODE);
    expect[30..34].copy_from_slice(&POD);
    expect[34..36].copy_from_slice(&sport.to_be_bytes());
    expect[36..38].copy_from_slice(&5353u16.to_be_bytes());
    set_l4_checksum(&mut expect);
    assert_eq!(out.packet[40..42], expect[40..42]);

    // A later fragment (offset 8 bytes, same id): addresses only.
    let mut later = packet(UDP, (CLIENT, 0x6162), (NODE, 0x6364), b"efgh");
    later[20..22].copy_from_slice(&[0x00, 0x01]);
    set_ipv4_checksum(&mut later);
    let moved = run(&mut dp, &later);
    assert_eq!(moved.packet[26..30], NODE);
    assert_eq!(moved.packet[30..34], POD);
    assert_eq!(moved.packet[34..], later[34..], "payload untouched");
    assert!(packet_craft::ipv4_checksum_ok(&moved.packet), "IPv4 header checksum");
}

#[test]
fn a_service_without_endpoints_answers_a_syn_with_a_valid_rst() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30080, Protocol::Tcp),
        frontend_plan::<[u8; 4]>(&[], true, &[]),
    )]);
    let syn = tcp((CLIENT, 40000), (NODE, 30080), SYN);
    let out = run(&mut dp, &syn);
    assert_eq!(out.verdict, REDIRECT, "sent back out of the interface it came from");
    let p = &out.packet;
    assert_eq!(tuple(p), ((NODE, 30080), (CLIENT, 40000)));
    assert_eq!(p[0..6], syn[6..12], "MACs swapped");
    assert_eq!(p[34 + 13], RST | ACK);
    assert_eq!(u32::from_be_bytes(p[38..42].try_into().unwrap()), 0, "seq 0");
    assert_eq!(u32::from_be_bytes(p[42..46].try_into().unwrap()), 1001, "acks the SYN");
    assert_checksums(p);
}

#[test]
fn a_service_without_endpoints_answers_udp_with_port_unreachable() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30053, Protocol::Udp),
        frontend_plan::<[u8; 4]>(&[], true, &[]),
    )]);
    let datagram = udp((CLIENT, 40000), (NODE, 30053), true);
    let out = run(&mut dp, &datagram);
    assert_eq!(out.verdict, REDIRECT);
    let p = &out.packet;
    assert_eq!(p.len(), 14 + 20 + 8 + 28);
    assert_eq!(p[23], 1, "ICMP");
    assert_eq!(p[26..30], NODE);
    assert_eq!(p[30..34], CLIENT);
    assert_eq!(p[34..36], [3, 3], "destination unreachable, port unreachable");
    assert_eq!(p[42..70], datagram[14..42], "quotes the IP header and 8 bytes");
    assert_checksums(p);
}

#[test]
fn a_pod_reaching_itself_is_snated_to_the_node() {
    let pod = ([10, 244, 1, 7], 8080);
    let mut dp = datapath(vec![(
        frontend([10, 96, 0, 20], 80, Protocol::Tcp),
        frontend_plan(&[pod], false, &[]),
    )]);
    let out = run(&mut dp, &tcp(([10, 244, 1, 7], 50000), ([10, 96, 0, 20], 80), SYN));
    let ((src, _), dst) = tuple(&out.packet);
    assert_eq!((src, dst), (NODE, pod));
    assert_checksums(&out.packet);
}

#[test]
fn load_balancer_source_ranges_admit_and_drop() {
    let lb = [10, 200, 0, 10];
    let mut dp = datapath(vec![(
        frontend(lb, 80, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], true, &["192.168.100.96/29"]),
    )]);
    let inside = run(&mut dp, &tcp((CLIENT, 40000), (lb, 80), SYN));
    assert_eq!(tuple(&inside.packet).1, (POD, 8080));
    let outside = run(&mut dp, &tcp(([192, 168, 100, 200], 40000), (lb, 80), SYN));
    assert_eq!(outside.verdict, SHOT);
}

#[test]
fn in_cluster_sources_of_a_local_node_port_get_the_internal_scope_unsnated() {
    // Distinct backend sets tell the scopes apart: the external one has
    // this node's endpoint, the internal one (every endpoint) another.
    let local_pod = ([10, 244, 1, 2], 8080);
    let node_port = frontend(NODE, 30080, Protocol::Tcp);
    let mut outer = frontend_plan(&[local_pod], true, &[]);
    (outer.local, outer.two_scopes) = (true, true);
    let mut dp = datapath(vec![
        (node_port, outer),
        (node_port.internal(), frontend_plan(&[(POD, 8080)], false, &[])),
    ]);
    let external = run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), SYN));
    assert_eq!(tuple(&external.packet), ((CLIENT, 40000), local_pod), "client IP kept");
    // Another node's address is no in-cluster source (as for kube-proxy).
    let other_node = ([192, 168, 100, 12], 40000);
    let from_node = run(&mut dp, &tcp(other_node, (NODE, 30080), SYN));
    assert_eq!(tuple(&from_node.packet).1, local_pod);

    let pod = ([10, 244, 1, 5], 40000);
    let out = run(&mut dp, &tcp(pod, (NODE, 30080), SYN));
    assert_eq!(tuple(&out.packet), (pod, (POD, 8080)), "every endpoint, not SNATed");
    assert_checksums(&out.packet);
    let back = run(&mut dp, &tcp((POD, 8080), pod, SYN | ACK));
    assert_eq!(tuple(&back.packet), ((NODE, 30080), pod), "replies come from the node port");
    // A pod reaching itself is still SNATed (kube-proxy's KUBE-SEP rule).
    let hairpin = run(&mut dp, &tcp((POD, 40001), (NODE, 30080), SYN));
    assert_eq!((tuple(&hairpin.packet).0.0, tuple(&hairpin.packet).1), (NODE, (POD, 8080)));
}

#[test]
fn masquerade_of_sources_outside_the_cluster_cidr() {
    let mut dp = datapath(vec![(
        frontend([10, 96, 0, 30], 80, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], false, &[]),
    )]);
    let from_pod = run(&mut dp, &tcp(([10, 244, 1, 9], 40000), ([10, 96, 0, 30], 80), SYN));
    assert_eq!(tuple(&from_pod.packet).0, ([10, 244, 1, 9], 40000));
    let from_outside = run(&mut dp, &tcp((CLIENT, 40000), ([10, 96, 0, 30], 80), SYN));
    assert_eq!(tuple(&from_outside.packet).0.0, NODE, "off-cluster source masqueraded");
}

const ROUTER: [u8; 4] = [192, 168, 100, 2];

/// An ICMP error from `from` to `to` quoting `quoted` (a frame built above)
/// from its IP header on, `quote` bytes of it; `rest` is the header's second
/// word (the next-hop MTU of a "fragmentation needed").
fn icmp_error(
    from: [u8; 4],
    to: [u8; 4],
    (kind, code): (u8, u8),
    rest: [u8; 4],
    quoted: &[u8],
    quote: usize,
) -> Vec<u8> {
    let mut msg = rest.to_vec();
    msg.extend_from_slice(&quoted[14..14 + quote]);
    let mut p = packet(ICMP, (from, u16::from_be_bytes([kind, code])), (to, 0), &msg);
    set_l4_checksum(&mut p);
    p
}

type Endpoint = ([u8; 4], u16);

/// What an ICMP error says: its addresses and the tuple it quotes.
fn icmp_tuples(p: &[u8]) -> (([u8; 4], [u8; 4]), (Endpoint, Endpoint)) {
    let outer = ((p[26..30].try_into().unwrap()), (p[30..34].try_into().unwrap()));
    // The quoted packet, as a frame of its own (checksum helpers and
    // `tuple` read frames).
    let mut quoted = p[..14].to_vec();
    quoted.extend_from_slice(&p[42..]);
    (outer, tuple(&quoted))
}

/// All three checksums of an ICMP error: the IP header, the ICMP message,
/// and the quoted IP header (with no options).
fn assert_icmp_checksums(p: &[u8]) {
    assert_checksums(p);
    assert_eq!(fold(sum16(&p[42..62])), 0, "quoted IPv4 header checksum of {p:02x?}");
}

const FRAG_NEEDED: (u8, u8) = (3, 4);
const MTU_1280: [u8; 4] = [0, 0, 0x05, 0x00];

#[test]
fn fragmentation_needed_about_a_node_port_reply_reaches_the_backend() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30080, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], true, &[]),
    )]);
    let out = run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), SYN));
    let ((_, snat_port), _) = tuple(&out.packet);
    // A router towards the client cannot forward the (translated) reply.
    let reply = tcp((NODE, 30080), (CLIENT, 40000), SYN | ACK);
    let error = icmp_error(ROUTER, NODE, FRAG_NEEDED, MTU_1280, &reply, reply.len() - 14);
    assert_icmp_checksums(&error);

    let out = run(&mut dp, &error);
    assert_eq!(out.verdict, STACK, "sent on as translated packets are (no route here)");
    let p = &out.packet;
    assert_eq!(p.len(), error.len());
    assert_eq!(
        icmp_tuples(p),
        ((NODE, POD), ((POD, 8080), (NODE, snat_port))),
        "to the backend, from the node (as netfilter's masquerade), quoting its own packet"
    );
    assert_eq!(p[34..36], [3, 4], "fragmentation needed");
    assert_eq!(p[38..42], MTU_1280, "next-hop MTU");
    assert_icmp_checksums(p);
    assert_eq!(p[66..], error[66..], "the rest of the quote (its TCP checksum) untouched");
    assert_eq!(out.packet[22], 64, "TTL: not decremented when handed to the stack");

    // An error is not the flow's traffic, and it may come again.
    let again = run(&mut dp, &error);
    assert_eq!(again.packet, out.packet);
}

#[test]
fn time_exceeded_about_a_cluster_ip_flow_reaches_the_client_pod_from_the_service() {
    let vip = ([10, 96, 0, 10], 80);
    let mut dp = datapath(vec![(
        frontend(vip.0, vip.1, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], false, &[]),
    )]);
    let client = ([10, 244, 1, 5], 40000);
    let out = run(&mut dp, &tcp(client, vip, SYN));
    assert_eq!(tuple(&out.packet), (client, (POD, 8080)), "a pod's flow: not SNATed");
    // A router towards the backend: the client's packet, as translated.
    let error = icmp_error(ROUTER, client.0, (11, 0), [0; 4], &out.packet, 28);

    let out = run(&mut dp, &error);
    assert_eq!(out.verdict, STACK);
    assert_eq!(
        icmp_tuples(&out.packet),
        ((vip.0, client.0), (client, vip)),
        "the client learns of its packet to the service, from the service"
    );
    assert_icmp_checksums(&out.packet);
}

#[test]
fn port_unreachable_from_a_udp_backend_reaches_the_external_client() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30053, Protocol::Udp),
        frontend_plan(&[(POD, 5353)], true, &[]),
    )]);
    let out = run(&mut dp, &udp((CLIENT, 40000), (NODE, 30053), true));
    // The backend's own error about the datagram it got.
    let error = icmp_error(POD, NODE, (3, 3), [0; 4], &out.packet, 28);
    let back = run(&mut dp, &error);
    assert_eq!(icmp_tuples(&back.packet), ((NODE, CLIENT), ((CLIENT, 40000), (NODE, 30053))));
    assert_icmp_checksums(&back.packet);
    assert_eq!(back.packet[68..70], error[68..70], "quoted UDP checksum left as it was");
}

#[test]
fn port_unreachable_the_stack_sends_for_a_host_network_backend_names_the_node_port() {
    let mut plan = frontend_plan(&[(NODE, 9090)], true, &[]);
    plan.backends = plan.backends.iter().map(|b| BackendPlan { host: true, ..b }).collect();
    let mut dp = datapath(vec![(frontend(NODE, 30099, Protocol::Udp), plan)]);
    let out = run(&mut dp, &udp((CLIENT, 40000), (NODE, 30099), true));
    assert_eq!(tuple(&out.packet), ((CLIENT, 40000), (NODE, 9090)));
    // Nothing listens on 9090: the node's stack answers on its way out.
    let error = icmp_error(NODE, CLIENT, (3, 3), [0; 4], &out.packet, 28);
    let sent = dp.run_tc_egress(&error, 1).unwrap();
    assert_eq!(sent.verdict, NEXT, "the stack routed it already");
    assert_eq!(icmp_tuples(&sent.packet), ((NODE, CLIENT), ((CLIENT, 40000), (NODE, 30099))));
    assert_icmp_checksums(&sent.packet);
}

#[test]
fn icmp_errors_about_no_translated_flow_pass_untouched() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30080, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], true, &[]),
    )]);
    run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), SYN));
    let other_port = tcp((NODE, 30080), (CLIENT, 40001), SYN | ACK);
    let not_a_flow = icmp_error(ROUTER, NODE, FRAG_NEEDED, MTU_1280, &other_port, 28);
    // A redirect (type 5) about a translated packet is not translated.
    let reply = tcp((NODE, 30080), (CLIENT, 40000), SYN | ACK);
    let redirect = icmp_error(ROUTER, NODE, (5, 1), ROUTER, &reply, 28);
    // A quote cut short before the ports.
    let short = icmp_error(ROUTER, NODE, FRAG_NEEDED, MTU_1280, &reply, 22);
    for p in [not_a_flow, redirect, short] {
        let out = run(&mut dp, &p);
        assert_eq!(out.verdict, NEXT, "{p:02x?}");
        assert_eq!(out.packet, p);
    }
}

// IPv6: the same paths, with the family's own header (no header checksum;
// the L4 pseudo-header holds the 16-byte addresses). The frontends are
// written by `sync` into SERVICES6/BACKENDS6.

const NODE6: [u8; 16] = [0xfd, 0, 0, 0x64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x11];
const CLIENT6: [u8; 16] = [0x20, 0x01, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x1, 0x01];
const POD6: [u8; 16] = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2];
/// In the IPv6 cluster CIDR of `datapath` (its /48).
const POD_CLIENT6: [u8; 16] = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
const CLUSTER_IP6: [u8; 16] = [0xfd, 0, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];

type Endpoint6 = ([u8; 16], u16);

/// Ethernet + IPv6 (next header `proto`) + L4 header and payload.
fn packet6(proto: u8, src: Endpoint6, dst: Endpoint6, l4_rest: &[u8]) -> Vec<u8> {
    frame(proto, src, dst, l4_rest)
}

fn tcp6(src: Endpoint6, dst: Endpoint6, flags: u8) -> Vec<u8> {
    let mut p = packet6(TCP, src, dst, &tcp_rest(flags));
    set_l4_checksum(&mut p);
    p
}

fn udp6(src: Endpoint6, dst: Endpoint6) -> Vec<u8> {
    let mut p = packet6(UDP, src, dst, &udp_rest());
    set_l4_checksum(&mut p);
    p
}

fn csum_offset6(p: &[u8]) -> usize {
    54 + match p[20] {
        TCP => 16,
        UDP => 6,
        _ => 2,
    }
}

/// Checks the TCP, UDP or ICMPv6 checksum (a UDP one must not be zero).
fn assert_checksums6(p: &[u8]) {
    assert_eq!(u16::from_be_bytes([p[18], p[19]]) as usize, p.len() - 54, "payload length");
    let off = csum_offset6(p);
    assert_ne!(p[off..off + 2], [0, 0], "IPv6 checksums are never zero");
    assert!(l4_checksum_ok(p), "L4 checksum of {p:02x?}");
}

fn tuple6(p: &[u8]) -> (Endpoint6, Endpoint6) {
    let addr = |o: usize| <[u8; 16]>::try_from(&p[o..o + 16]).unwrap();
    let port = |o: usize| u16::from_be_bytes([p[o], p[o + 1]]);
    ((addr(22), port(54)), (addr(38), port(56)))
}

#[test]
fn ipv6_node_port_flow_is_snated_and_translated_back_with_valid_checksums() {
    let mut dp = datapath(vec![(
        frontend(NODE6, 30080, Protocol::Tcp),
        frontend_plan(&[(POD6, 8080)], true, &[]),
    )]);
    let syn = tcp6((CLIENT6, 40000), (NODE6, 30080), SYN);
    let out = run(&mut dp, &syn);
    assert_eq!(out.verdict, STACK, "no route in an empty netns: the stack gets it");
    let ((src, sport), dst) = tuple6(&out.packet);
    assert_eq!(src, NODE6, "external traffic with policy Cluster is SNATed");
    assert!((61000..=65000).contains(&sport), "SNAT port {sport} in range");
    assert_eq!(dst, (POD6, 8080));
    assert_eq!(out.packet.len(), syn.len());
    assert_checksums6(&out.packet);
    assert_eq!(out.packet[54 + 20..], syn[54 + 20..], "options untouched");

    let syn_ack = tcp6((POD6, 8080), (NODE6, sport), SYN | ACK);
    let back = run(&mut dp, &syn_ack);
    assert_eq!(back.verdict, STACK);
    assert_eq!(tuple6(&back.packet), ((NODE6, 30080), (CLIENT6, 40000)));
    assert_checksums6(&back.packet);

    let again = run(&mut dp, &syn);
    assert_eq!(tuple6(&again.packet), tuple6(&out.packet), "the same flow");
    assert_eq!(dp.collect_conntrack().unwrap().counts(), (0, 2), "both directions in CONNTRACK6");
    // The frontend is IPv6 only: the IPv4 node address at that port is none.
    let v4 = run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), SYN));
    assert_eq!(v4.verdict, NEXT);
}

/// An IPv6 explain run (the frame `explain` crafts) takes the IPv4
/// program's pre-filter and tail call, as a real packet does; the IPv6
/// program leaves its decision in `cb` and no flow behind.
#[test]
fn ipv6_explain_runs_decide_without_leaving_state() {
    use proxy_agent::inspect::explain::craft;
    let mut dp = datapath(vec![
        (frontend(NODE6, 30080, Protocol::Tcp), frontend_plan(&[(POD6, 8080)], true, &[])),
        (frontend(NODE6, 30081, Protocol::Tcp), frontend_plan::<[u8; 16]>(&[], true, &[])),
    ]);
    let at = |ip: [u8; 16], port| SocketAddr::from((ip, port));
    let syn = |port| craft(Protocol::Tcp, at(CLIENT6, 40000), at(NODE6, port));
    let out = dp.explain_tc(&syn(30080)).unwrap();
    assert_eq!(out.verdict, STACK);
    assert_eq!(decode(out.cb[2]), Some((Decided::Translated, SNAT)));
    assert_ne!(out.cb[3], 0, "the frontend's reverse-NAT id");
    assert_eq!(tuple6(&out.packet), ((NODE6, 40000), (POD6, 8080)), "no SNAT port chosen");
    assert_checksums6(&out.packet);
    let refused = dp.explain_tc(&syn(30081)).unwrap();
    assert_eq!(refused.verdict, REDIRECT);
    assert_eq!(decode(refused.cb[2]), Some((Decided::Refused, 0)));
    assert_eq!(refused.packet[54 + 13], RST | ACK);
    assert_eq!(dp.collect_conntrack().unwrap().counts(), (0, 0), "no flow created");
}

#[test]
fn ipv6_cluster_ip_datagrams_from_a_pod_keep_its_address_and_come_back_from_the_service() {
    let mut dp = datapath(vec![(
        frontend(CLUSTER_IP6, 53, Protocol::Udp),
        frontend_plan(&[(POD6, 5353)], false, &[]),
    )]);
    let mut client = POD_CLIENT6;
    client[15] = 5;
    let query = udp6((client, 40000), (CLUSTER_IP6, 53));
    let out = run(&mut dp, &query);
    assert_eq!(tuple6(&out.packet), ((client, 40000), (POD6, 5353)), "DNAT only");
    assert_checksums6(&out.packet);

    let answer = run(&mut dp, &udp6((POD6, 5353), (client, 40000)));
    assert_eq!(tuple6(&answer.packet), ((CLUSTER_IP6, 53), (client, 40000)));
    assert_checksums6(&answer.packet);

    // From outside the cluster CIDR: masqueraded.
    let outside = run(&mut dp, &udp6((CLIENT6, 40001), (CLUSTER_IP6, 53)));
    assert_eq!(tuple6(&outside.packet).0.0, NODE6);
    assert_checksums6(&outside.packet);
}

#[test]
fn ipv6_services_without_endpoints_answer_with_a_valid_rst_or_port_unreachable() {
    let mut dp = datapath(vec![
        (frontend(NODE6, 30080, Protocol::Tcp), frontend_plan::<[u8; 16]>(&[], true, &[])),
        (frontend(NODE6, 30053, Protocol::Udp), frontend_plan::<[u8; 16]>(&[], true, &[])),
    ]);
    let syn = tcp6((CLIENT6, 40000), (NODE6, 30080), SYN);
    let out = run(&mut dp, &syn);
    assert_eq!(out.verdict, REDIRECT, "sent back out of the interface it came from");
    let p = &out.packet;
    assert_eq!(tuple6(p), ((NODE6, 30080), (CLIENT6, 40000)));
    assert_eq!(p[0..6], syn[6..12], "MACs swapped");
    assert_eq!(p[54 + 13], RST | ACK);
    assert_eq!(u32::from_be_bytes(p[58..62].try_into().unwrap()), 0, "seq 0");
    assert_eq!(u32::from_be_bytes(p[62..66].try_into().unwrap()), 1001, "acks the SYN");
    assert_checksums6(p);

    let datagram = udp6((CLIENT6, 40000), (NODE6, 30053));
    let out = run(&mut dp, &datagram);
    assert_eq!(out.verdict, REDIRECT);
    let p = &out.packet;
    assert_eq!(p.len(), 14 + 40 + 8 + 48);
    assert_eq!((p[12..14].to_vec(), p[14] >> 4, p[20], p[21]), (vec![0x86, 0xdd], 6, ICMPV6, 64));
    assert_eq!((p[22..38].to_vec(), p[38..54].to_vec()), (NODE6.to_vec(), CLIENT6.to_vec()));
    assert_eq!(p[54..56], [1, 4], "destination unreachable, port unreachable");
    assert_eq!(p[62..110], datagram[14..62], "quotes the IPv6 header and 8 bytes");
    assert_checksums6(p);
}

#[test]
fn ipv6_packets_the_datapath_does_not_handle_pass_untouched() {
    let mut dp = datapath(vec![(
        frontend(NODE6, 30080, Protocol::Tcp),
        frontend_plan(&[(POD6, 8080)], true, &[]),
    )]);
    // A hop-by-hop options header before the TCP header.
    let mut extension = tcp6((CLIENT6, 40000), (NODE6, 30080), SYN);
    extension[20] = 0;
    let neighbour_solicitation = packet6(ICMPV6, (CLIENT6, 0x8700), (NODE6, 0), &[0; 20]);
    let not_a_service = tcp6((CLIENT6, 40000), (NODE6, 22), SYN);
    for p in [extension, neighbour_solicitation, not_a_service] {
        let out = run(&mut dp, &p);
        assert_eq!(out.verdict, NEXT, "{p:02x?}");
        assert_eq!(out.packet, p);
    }
}

#[test]
fn ipv6_source_ranges_affinity_and_local_policy() {
    let (lb, local) = (CLUSTER_IP6.map(|b| b ^ 0x01), CLUSTER_IP6.map(|b| b ^ 0x02));
    let pod = |i: u8| {
        let mut address = POD6;
        address[15] = i;
        (address, 8080)
    };
    let pods: Vec<Endpoint6> = (1..=8).map(pod).collect();
    let mut sticky = frontend_plan(&pods, false, &[]);
    sticky.affinity_timeout_secs = Some(100);
    let mut empty_local = frontend_plan::<[u8; 16]>(&[], true, &[]);
    (empty_local.local, empty_local.drop_when_empty) = (true, true);
    let mut dp = datapath(vec![
        (
            frontend(lb, 80, Protocol::Tcp),
            frontend_plan(&[(POD6, 8080)], true, &["2001:db8::100/120"]),
        ),
        (frontend(CLUSTER_IP6, 80, Protocol::Tcp), sticky),
        (frontend(local, 80, Protocol::Tcp), empty_local),
    ]);
    let inside = run(&mut dp, &tcp6((CLIENT6, 40000), (lb, 80), SYN));
    assert_eq!(tuple6(&inside.packet).1, (POD6, 8080));
    let mut stranger = CLIENT6;
    stranger[13] = 1;
    assert_eq!(run(&mut dp, &tcp6((stranger, 40000), (lb, 80), SYN)).verdict, SHOT);

    // Every connection of one client to the same pod (AFFINITY6).
    let first = tuple6(&run(&mut dp, &tcp6((CLIENT6, 41000), (CLUSTER_IP6, 80), SYN)).packet).1;
    for port in 41001..41010 {
        let next = run(&mut dp, &tcp6((CLIENT6, port), (CLUSTER_IP6, 80), SYN));
        assert_eq!(tuple6(&next.packet).1, first, "affinity");
    }

    // Policy Local without a local endpoint: dropped, not refused.
    assert_eq!(run(&mut dp, &tcp6((CLIENT6, 40000), (local, 80), SYN)).verdict, SHOT);
}

/// Runs `ip` or `sysctl` in this test's network namespace (a child
/// process shares the namespace of the thread that starts it).
fn sh(program: &str, args: &str) {
    let status = std::process::Command::new(program).args(args.split(' ')).status().unwrap();
    assert!(status.success(), "{program} {args}");
}

#[test]
fn ipv6_packets_are_forwarded_by_a_fib_lookup_with_the_hop_limit_decremented() {
    let mut dp = datapath(vec![(
        frontend(NODE6, 30080, Protocol::Tcp),
        frontend_plan(&[(POD6, 8080)], true, &[]),
    )]);
    // A link towards the pod's network, and IPv6 forwarding on (else the FIB
    // lookup leaves the packet to the stack).
    sh("ip", "link add pods type veth peer name pods-peer");
    sh("ip", "link set pods-peer up");
    sh("ip", "link set pods up");
    sh("ip", "-6 addr add fd00:10:244:2::1/64 dev pods nodad");
    sh("sysctl", "-qw net.ipv6.conf.all.forwarding=1");

    // No neighbour entry yet: bpf_redirect_neigh resolves it.
    let out = run(&mut dp, &tcp6((CLIENT6, 40000), (NODE6, 30080), SYN));
    assert_eq!(out.verdict, REDIRECT);
    assert_eq!(out.packet[21], 63, "hop limit decremented");
    assert_eq!(tuple6(&out.packet).1, (POD6, 8080));
    assert_checksums6(&out.packet);

    // A known neighbour: its MAC address, and a plain redirect.
    sh("ip", "-6 neigh add fd00:10:244:2::2 lladdr 02:00:00:00:00:22 dev pods");
    let out = run(&mut dp, &tcp6((CLIENT6, 40001), (NODE6, 30080), SYN));
    assert_eq!(out.verdict, REDIRECT);
    assert_eq!(out.packet[0..6], [2, 0, 0, 0, 0, 0x22], "the neighbour's MAC");
    assert_eq!(out.packet[21], 63);
    assert_checksums6(&out.packet);
}

const ROUTER6: [u8; 16] = [0xfd, 0, 0, 0x64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02];
const PACKET_TOO_BIG: (u8, u8) = (2, 0);
const MTU_1280_6: [u8; 4] = [0, 0, 0x05, 0x00];

/// An ICMPv6 error from `from` to `to` quoting `quoted` (a frame built
/// above) from its IPv6 header on, `quote` bytes of it; `rest` is the
/// header's second word (the MTU of a "packet too big"). Its checksum is
/// computed here, over the pseudo-header with these outer addresses.
fn icmp6_error(
    from: [u8; 16],
    to: [u8; 16],
    (kind, code): (u8, u8),
    rest: [u8; 4],
    quoted: &[u8],
    quote: usize,
) -> Vec<u8> {
    let mut body = rest.to_vec();
    body.extend_from_slice(&quoted[14..14 + quote]);
    let type_code = u16::from_be_bytes([kind, code]);
    let mut p = packet6(ICMPV6, (from, type_code), (to, 0), &body);
    set_l4_checksum(&mut p);
    p
}

/// What an ICMPv6 error says: its addresses and the tuple it quotes.
fn icmp6_tuples(p: &[u8]) -> (([u8; 16], [u8; 16]), (Endpoint6, Endpoint6)) {
    let ((src, _), (dst, _)) = tuple6(p);
    let mut quoted = p[..14].to_vec();
    quoted.extend_from_slice(&p[62..]);
    ((src, dst), tuple6(&quoted))
}

/// The ICMPv6 checksum, recomputed: next header 58, and the pseudo-header
/// with the outer addresses as they are now.
fn assert_icmp6_checksum(p: &[u8]) {
    assert_eq!(p[20], ICMPV6);
    assert_checksums6(p);
}

/// `frame` with its tuple (IPv6 addresses, ports) replaced; nothing else,
/// no checksum, changes.
fn with_tuple6(frame: &[u8], (src, dst): (Endpoint6, Endpoint6)) -> Vec<u8> {
    let mut p = frame.to_vec();
    p[22..38].copy_from_slice(&src.0);
    p[38..54].copy_from_slice(&dst.0);
    p[54..56].copy_from_slice(&src.1.to_be_bytes());
    p[56..58].copy_from_slice(&dst.1.to_be_bytes());
    p
}

#[test]
fn ipv6_packet_too_big_about_a_node_port_reply_reaches_the_backend() {
    let mut dp = datapath(vec![(
        frontend(NODE6, 30080, Protocol::Tcp),
        frontend_plan(&[(POD6, 8080)], true, &[]),
    )]);
    let out = run(&mut dp, &tcp6((CLIENT6, 40000), (NODE6, 30080), SYN));
    let ((_, snat_port), _) = tuple6(&out.packet);
    // A router towards the client cannot forward the (translated) reply.
    let reply = tcp6((NODE6, 30080), (CLIENT6, 40000), SYN | ACK);
    let error = icmp6_error(ROUTER6, NODE6, PACKET_TOO_BIG, MTU_1280_6, &reply, reply.len() - 14);
    assert_icmp6_checksum(&error);

    let out = run(&mut dp, &error);
    assert_eq!(out.verdict, STACK, "sent on as translated packets are (no route here)");
    let p = &out.packet;
    assert_eq!(
        icmp6_tuples(p),
        ((NODE6, POD6), ((POD6, 8080), (NODE6, snat_port))),
        "to the backend, from the node (as netfilter's masquerade), quoting its own packet"
    );
    assert_icmp6_checksum(p);
    // Every byte: the backend's own reply quoted (its TCP checksum as the
    // node's reply had it), the MTU, the hop limit (handed to the stack).
    let quoted = with_tuple6(&reply, ((POD6, 8080), (NODE6, snat_port)));
    let expect = icmp6_error(NODE6, POD6, PACKET_TOO_BIG, MTU_1280_6, &quoted, quoted.len() - 14);
    assert_eq!(*p, expect);
    assert_eq!(p[54 + 8 + 40 + 16..], reply[54 + 16..], "quoted TCP checksum and options");

    // An error is not the flow's traffic, and it may come again.
    let again = run(&mut dp, &error);
    assert_eq!(again.packet, out.packet);
}

#[test]
fn ipv6_time_exceeded_about_a_cluster_ip_flow_reaches_the_client_pod_from_the_service() {
    let vip = (CLUSTER_IP6, 80);
    let mut dp = datapath(vec![(
        frontend(vip.0, vip.1, Protocol::Tcp),
        frontend_plan(&[(POD6, 8080)], false, &[]),
    )]);
    let mut client = (POD_CLIENT6, 40000);
    client.0[15] = 5;
    let syn = tcp6(client, vip, SYN);
    let out = run(&mut dp, &syn);
    assert_eq!(tuple6(&out.packet), (client, (POD6, 8080)), "a pod's flow: not SNATed");
    // A router towards the backend: the client's packet, as translated.
    let error = icmp6_error(ROUTER6, client.0, (3, 0), [0; 4], &out.packet, 48);

    let back = run(&mut dp, &error);
    assert_eq!(back.verdict, STACK);
    assert_eq!(
        icmp6_tuples(&back.packet),
        ((vip.0, client.0), (client, vip)),
        "the client learns of its packet to the service, from the service"
    );
    assert_icmp6_checksum(&back.packet);
    // Every byte: the client's own packet quoted, as it sent it.
    assert_eq!(back.packet, icmp6_error(vip.0, client.0, (3, 0), [0; 4], &syn, 48));

    // Errors about no flow, or cut short before the ports, and other
    // ICMPv6 messages (an echo request quoting nothing) pass untouched.
    let other = tcp6((POD6, 8080), (client.0, 40001), SYN | ACK);
    let not_a_flow = icmp6_error(ROUTER6, client.0, (3, 0), [0; 4], &other, 48);
    let short = icmp6_error(ROUTER6, client.0, (3, 0), [0; 4], &out.packet, 42);
    let echo = icmp6_error(ROUTER6, client.0, (128, 0), [0; 4], &out.packet, 48);
    for p in [not_a_flow, short, echo] {
        let out = run(&mut dp, &p);
        assert_eq!(out.verdict, NEXT, "{p:02x?}");
        assert_eq!(out.packet, p);
    }
}

#[test]
fn ipv6_port_unreachable_the_stack_sends_for_a_host_network_backend_names_the_node_port() {
    let mut plan = frontend_plan(&[(NODE6, 9090)], true, &[]);
    plan.backends = plan.backends.iter().map(|b| BackendPlan { host: true, ..b }).collect();
    let mut dp = datapath(vec![(frontend(NODE6, 30099, Protocol::Udp), plan)]);
    let datagram = udp6((CLIENT6, 40000), (NODE6, 30099));
    let out = run(&mut dp, &datagram);
    assert_eq!(tuple6(&out.packet), ((CLIENT6, 40000), (NODE6, 9090)));
    // Nothing listens on 9090: the node's stack answers on its way out.
    let error = icmp6_error(NODE6, CLIENT6, (1, 4), [0; 4], &out.packet, 48);
    let sent = dp.run_tc_egress(&error, 1).unwrap();
    assert_eq!(sent.verdict, NEXT, "the stack routed it already");
    assert_eq!(icmp6_tuples(&sent.packet), ((NODE6, CLIENT6), ((CLIENT6, 40000), (NODE6, 30099))));
    assert_icmp6_checksum(&sent.packet);
    // Every byte: the quoted UDP checksum is the translated datagram's.
    let quoted = with_tuple6(&out.packet, ((CLIENT6, 40000), (NODE6, 30099)));
    assert_eq!(sent.packet, icmp6_error(NODE6, CLIENT6, (1, 4), [0; 4], &quoted, 48));
}

/// The monitor's events (`proxy-agent monitor`): one per new flow, drop and
/// refusal while a monitor keeps the deadline ahead, none for a tracked
/// flow's packets, and none at all once the deadline passed.
#[test]
fn the_monitor_sees_translations_drops_and_refusals_only_while_on() {
    use proxy_common::monitor::{hook, reason, verdict};

    let lb = [10, 200, 0, 10];
    let mut dp = datapath(vec![
        (frontend(NODE, 30080, Protocol::Tcp), frontend_plan(&[(POD, 8080)], true, &[])),
        (frontend(NODE, 30081, Protocol::Tcp), frontend_plan::<[u8; 4]>(&[], true, &[])),
        (frontend(lb, 80, Protocol::Tcp), frontend_plan(&[(POD, 8080)], true, &["10.0.0.0/8"])),
        (frontend(NODE6, 30080, Protocol::Tcp), frontend_plan(&[(POD6, 8080)], true, &[])),
    ]);
    let mut watch = dp.watch().expect("the monitor's maps");
    let syn = tcp((CLIENT, 40000), (NODE, 30080), SYN);
    run(&mut dp, &syn);
    assert!(watch.next().is_none(), "off: no event");

    watch.keep_on(proxy_agent::sys::monotonic_ns()).unwrap();
    let syn = tcp((CLIENT, 40001), (NODE, 30080), SYN);
    let out = run(&mut dp, &syn);
    run(&mut dp, &syn);
    run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30081), SYN));
    run(&mut dp, &tcp((CLIENT, 40000), (lb, 80), SYN));
    run(&mut dp, &tcp6((CLIENT6, 40000), (NODE6, 30080), SYN));

    let e = watch.next().expect("the new flow's event");
    assert_eq!((e.hook, e.family, e.verdict), (hook::TC_INGRESS, 4, verdict::TRANSLATED));
    assert_eq!(e.before.saddr[..4], CLIENT);
    assert_eq!((&e.before.daddr[..4], e.before.dport), (&NODE[..], 30080));
    let ((src, sport), dst) = tuple(&out.packet);
    assert_eq!((&e.after.saddr[..4], e.after.sport), (&src[..], sport), "the SNAT it got");
    assert_eq!((&e.after.daddr[..4], e.after.dport), (&dst.0[..], dst.1));
    assert_ne!(e.rev_nat_id, 0);
    let e = watch.next().expect("the refusal's event (the tracked packet has none)");
    assert_eq!(
        (e.verdict, e.reason, e.before.dport),
        (verdict::REFUSED, reason::NO_ENDPOINT, 30081)
    );
    let e = watch.next().expect("the drop's event");
    assert_eq!((e.verdict, e.reason), (verdict::DROPPED, reason::SOURCE_OUTSIDE_RANGES));
    let e = watch.next().expect("the IPv6 flow's event");
    assert_eq!(
        (e.family, e.verdict, e.before.daddr, e.after.daddr),
        (6, verdict::TRANSLATED, NODE6, POD6)
    );
    assert!(watch.next().is_none());
    assert_eq!(watch.lost(), 0);

    watch.set_deadline(0).unwrap();
    run(&mut dp, &tcp((CLIENT, 40002), (NODE, 30080), SYN));
    assert!(watch.next().is_none(), "off again");
}

#[test]
fn ipv4_packets_are_forwarded_by_a_fib_lookup_with_the_ttl_decremented() {
    let mut dp = datapath(vec![
        (frontend(NODE, 30080, Protocol::Tcp), frontend_plan(&[(POD, 8080)], true, &[])),
        (frontend(NODE, 30053, Protocol::Udp), frontend_plan(&[(POD, 5353)], true, &[])),
    ]);
    // A link towards the pod's network, and forwarding on (else the FIB
    // lookup leaves the packet to the stack).
    sh("ip", "link add pods type veth peer name pods-peer");
    sh("ip", "link set pods address 02:00:00:00:00:11");
    sh("ip", "link set pods-peer up");
    sh("ip", "link set pods up");
    sh("ip", "addr add 10.244.2.1/24 dev pods");
    sh("sysctl", "-qw net.ipv4.ip_forward=1");

    // No neighbour entry yet: bpf_redirect_neigh resolves it.
    let syn = run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), SYN));
    assert_eq!(syn.verdict, REDIRECT);
    assert_eq!(syn.packet[22], 63, "TTL decremented");
    assert_eq!(tuple(&syn.packet).1, (POD, 8080));
    assert_checksums(&syn.packet);

    // A known neighbour: its MAC address and the interface's, and a plain
    // redirect; the flow's next packet is a tracked one.
    sh("ip", "neigh add 10.244.2.2 lladdr 02:00:00:00:00:22 dev pods");
    let ack = run(&mut dp, &tcp((CLIENT, 40000), (NODE, 30080), ACK));
    assert_eq!(ack.verdict, REDIRECT);
    assert_eq!(ack.packet[0..12], [2, 0, 0, 0, 0, 0x22, 2, 0, 0, 0, 0, 0x11], "the MACs");
    assert_eq!(ack.packet[22], 63);
    assert_eq!(tuple(&ack.packet), tuple(&syn.packet));
    assert_checksums(&ack.packet);

    // UDP, with and without a checksum (none stays none).
    for (port, with_checksum) in [(40001, true), (40002, false)] {
        let out = run(&mut dp, &udp((CLIENT, port), (NODE, 30053), with_checksum));
        assert_eq!(out.verdict, REDIRECT);
        assert_eq!(out.packet[22], 63);
        assert_eq!(tuple(&out.packet).1, (POD, 5353));
        assert_eq!(out.packet[40..42] == [0, 0], !with_checksum, "{:02x?}", out.packet);
        assert_checksums(&out.packet);
    }

    // A TTL that runs out here: dropped, not sent on with 0.
    let mut last_hop = tcp((CLIENT, 40003), (NODE, 30080), SYN);
    last_hop[22] = 1;
    set_ipv4_checksum(&mut last_hop);
    assert_eq!(run(&mut dp, &last_hop).verdict, SHOT);
}

/// `p` (a frame with a plain IPv4 header) with 4 bytes of IP options (three
/// NOPs and an end of list), its header checksum recomputed.
fn with_ip_options(p: &[u8]) -> Vec<u8> {
    let mut q = p[..34].to_vec();
    q.extend_from_slice(&[1, 1, 1, 0]);
    q.extend_from_slice(&p[34..]);
    q[14] = 0x46;
    let total = u16::from_be_bytes([q[16], q[17]]) + 4;
    q[16..18].copy_from_slice(&total.to_be_bytes());
    set_ipv4_checksum(&mut q);
    q
}

#[test]
fn ipv4_headers_with_options_are_translated_with_valid_checksums() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30080, Protocol::Tcp),
        frontend_plan(&[(POD, 8080)], true, &[]),
    )]);
    let syn = with_ip_options(&tcp((CLIENT, 40000), (NODE, 30080), SYN));
    for (p, flags) in
        [(syn.clone(), SYN), (with_ip_options(&tcp((CLIENT, 40000), (NODE, 30080), ACK)), ACK)]
    {
        let out = run(&mut dp, &p);
        assert_eq!(out.verdict, STACK, "flags {flags:#x}");
        assert_eq!(out.packet[26..30], NODE, "SNAT");
        assert_eq!(out.packet[30..34], POD);
        assert_eq!(out.packet[34..38], [1, 1, 1, 0], "options untouched");
        assert_eq!(u16::from_be_bytes([out.packet[40], out.packet[41]]), 8080);
        assert_eq!(out.packet[22], 64, "the stack decrements the TTL");
        assert!(packet_craft::ipv4_checksum_ok(&out.packet), "IPv4 header checksum");
        // The L4 checksum as over the same segment behind a plain header.
        let mut plain = out.packet[..34].to_vec();
        plain.extend_from_slice(&out.packet[38..]);
        plain[14] = 0x45;
        assert!(l4_checksum_ok(&plain), "TCP checksum of {:02x?}", out.packet);
    }
}

// SCTP: ports where TCP and UDP have them, and a CRC32c over the whole
// packet that a port rewrite must update (`proxy_common::sctp`).

/// INIT (its fixed part: initiate tag 1, a_rwnd, streams, TSN).
const INIT: [u8; 20] = [1, 0, 0, 20, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 0, 10, 0, 10, 0, 0, 0, 1];
/// INIT ACK (its fixed part, initiate tag 2; no cookie: no stack reads it).
const INIT_ACK: [u8; 20] = [2, 0, 0, 20, 0, 0, 0, 2, 0, 0, 0xff, 0xff, 0, 10, 0, 10, 0, 0, 0, 1];
/// DATA: TSN 1, stream 0, "hello" (padded to four bytes).
const DATA: [u8; 24] =
    [0, 3, 0, 21, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, b'h', b'e', b'l', b'l', b'o', 0, 0, 0];
/// COOKIE ACK: four bytes, a frame Ethernet pads to its minimum.
const COOKIE_ACK: [u8; 4] = [11, 0, 0, 4];

/// An SCTP packet (verification tag `tag`, then `chunk`), its CRC set.
fn sctp<const N: usize>(src: ([u8; N], u16), dst: ([u8; N], u16), tag: u32, chunk: &[u8]) -> Vec<u8>
where
    IpAddr: From<[u8; N]>,
{
    let addr = |(ip, port): ([u8; N], u16)| SocketAddr::new(IpAddr::from(ip), port);
    let mut p = packet_craft::sctp(addr(src), addr(dst), tag, chunk);
    p[..12].copy_from_slice(&MACS);
    p
}

#[test]
fn sctp_node_port_associations_are_translated_both_ways_with_valid_crcs() {
    let mut dp = datapath(vec![(
        frontend(NODE, 30868, Protocol::Sctp),
        frontend_plan(&[(POD, 3869)], true, &[]),
    )]);
    let init = sctp((CLIENT, 40000), (NODE, 30868), 0, &INIT);
    let out = run(&mut dp, &init);
    assert_eq!(out.verdict, STACK, "no route in an empty netns: the stack gets it");
    let ((src, sport), dst) = tuple(&out.packet);
    assert_eq!(src, NODE, "external traffic with policy Cluster is SNATed");
    assert!((61000..=65000).contains(&sport), "SNAT port {sport} in range");
    assert_eq!(dst, (POD, 3869), "to the target port");
    assert_checksums(&out.packet);
    assert_eq!(out.packet[34 + 12..], init[34 + 12..], "chunks untouched");

    // The pod's INIT ACK leaves as the NodePort's.
    let back = run(&mut dp, &sctp((POD, 3869), (NODE, sport), 1, &INIT_ACK));
    assert_eq!(tuple(&back.packet), ((NODE, 30868), (CLIENT, 40000)));
    assert_checksums(&back.packet);
    // DATA follows the association; a COOKIE ACK in a padded frame has
    // its CRC over the SCTP packet the IP header counts, not the padding.
    let data = run(&mut dp, &sctp((CLIENT, 40000), (NODE, 30868), 1, &DATA));
    assert_eq!(tuple(&data.packet), ((NODE, sport), (POD, 3869)));
    assert_checksums(&data.packet);
    let mut cookie_ack = sctp((POD, 3869), (NODE, sport), 1, &COOKIE_ACK);
    cookie_ack.resize(60, 0);
    let back = run(&mut dp, &cookie_ack);
    assert_eq!(tuple(&back.packet), ((NODE, 30868), (CLIENT, 40000)));
    assert_eq!(back.packet.len(), 60);
    assert_checksums(&back.packet);
    assert_eq!(
        dp.collect_conntrack().unwrap().counts(),
        (0, 2),
        "one live association, both directions"
    );
}

/// No socket hook sees SCTP: the programs of pod interfaces the socket LB
/// covers, which leave a pod's TCP to a ClusterIP alone, translate its
/// SCTP, keeping the pod's address, and its replies back.
#[test]
fn sctp_to_a_cluster_ip_is_translated_on_pod_interfaces() {
    let vip = [10, 96, 0, 10];
    let mut dp = datapath(vec![
        (frontend(vip, 3868, Protocol::Sctp), frontend_plan(&[(POD, 3869)], false, &[])),
        (frontend(vip, 80, Protocol::Tcp), frontend_plan(&[(POD, 8080)], false, &[])),
    ]);
    let pod_replies = |dp: &mut BpfObject, p: &[u8]| dp.run_tc_pod_replies(p, 1).unwrap();
    let client = ([10, 244, 1, 5], 50000);
    let syn = tcp(client, (vip, 80), SYN);
    assert_eq!(pod_replies(&mut dp, &syn).verdict, NEXT, "TCP is the socket LB's");
    let out = pod_replies(&mut dp, &sctp(client, (vip, 3868), 0, &INIT));
    assert_eq!(out.verdict, STACK);
    assert_eq!(tuple(&out.packet), (client, (POD, 3869)), "a pod keeps its address");
    assert_checksums(&out.packet);
    let back = pod_replies(&mut dp, &sctp((POD, 3869), client, 1, &INIT_ACK));
    assert_eq!(tuple(&back.packet), ((vip, 3868), client));
    assert_checksums(&back.packet);
}

#[test]
fn ipv6_sctp_node_port_associations_are_translated_both_ways_with_valid_crcs() {
    let mut dp = datapath(vec![(
        frontend(NODE6, 30868, Protocol::Sctp),
        frontend_plan(&[(POD6, 3869)], true, &[]),
    )]);
    let out = run(&mut dp, &sctp((CLIENT6, 40000), (NODE6, 30868), 0, &INIT));
    assert_eq!(out.verdict, STACK);
    let ((src, sport), dst) = tuple6(&out.packet);
    assert_eq!((src, dst), (NODE6, (POD6, 3869)));
    assert!(l4_checksum_ok(&out.packet), "CRC of {:02x?}", out.packet);
    let back = run(&mut dp, &sctp((POD6, 3869), (NODE6, sport), 1, &INIT_ACK));
    assert_eq!(tuple6(&back.packet), ((NODE6, 30868), (CLIENT6, 40000)));
    assert!(l4_checksum_ok(&back.packet), "CRC of {:02x?}", back.packet);
}
