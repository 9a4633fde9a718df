//! Nanoseconds per packet of the per-packet program, measured by the kernel
//! with `BPF_PROG_TEST_RUN` (nothing is sent), for the paths a packet can
//! take: not a service (a miss, IPv4 and IPv6), a backend's reply of a
//! connection the socket LB translated (no per-packet flow), a new NodePort
//! flow (backend pick, SNAT port, two conntrack inserts), a new ClusterIP
//! flow, and a packet of a tracked flow, the last two also of SCTP (the
//! SCTP program's tail call and CRC update); with `--services N` installed
//! (one is the NodePort's). The flows' figures are of one run per packet, which
//! pays `run_overhead` (the timer and dispatch of one run) beside the
//! program.
//! Runs in a network namespace of its own. Needs root. `cargo xtask bench`
//! runs it at several N and reads its `name ns` lines. `--bpf-log-level
//! LEVEL` (off by default) has the programs write their decision records,
//! which a thread drains as the agent's task would. `--monitor` keeps the
//! monitor's events on (`proxy-agent monitor`), drained between runs.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use proxy_agent::{
    backend::{
        conntrack_limit::ConntrackLimit,
        ebpf::{BpfObject, MapSizes, TcAttach, settings::BpfLogLevel, state_sizes::StateSizes},
    },
    model::{EndpointAddr, Protocol, ServiceName, ServicePortName},
    packet_craft,
    plan::{BackendPlan, Frontend, FrontendKind, FrontendPlan, Plan},
};
use proxy_common::Config;

const NODE: [u8; 4] = [192, 168, 100, 11];

const CLIENT: [u8; 4] = [192, 168, 100, 101];
/// The TCP header after the ports: a SYN (SYN-ACK for a reply).
const TCP_REST: [u8; 16] = [0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0];

fn syn(src_port: u16, dst: [u8; 4], dst_port: u16) -> Vec<u8> {
    tcp4((CLIENT, src_port), (dst, dst_port))
}

fn tcp4((src, sport): ([u8; 4], u16), (dst, dport): ([u8; 4], u16)) -> Vec<u8> {
    let mut p = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00];
    p.extend_from_slice(&[0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0]);
    p.extend_from_slice(&src);
    p.extend_from_slice(&dst);
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&TCP_REST);
    p
}

/// An IPv6 SYN from an external client to port 22 of the node: no service.
fn syn6_miss() -> Vec<u8> {
    let mut p = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x86, 0xdd, 0x60, 0, 0, 0, 0, 20, 6, 64];
    p.extend_from_slice(&[0x20, 0x01, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
    p.extend_from_slice(&[0xfd, 0, 0, 0x64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x11]);
    p.extend_from_slice(&40000u16.to_be_bytes());
    p.extend_from_slice(&22u16.to_be_bytes());
    p.extend_from_slice(&TCP_REST);
    p
}

/// An SCTP packet from the client to the node's `dst_port`: an INIT (a new
/// association) or a DATA chunk of one, its CRC32c set.
fn sctp(src_port: u16, dst_port: u16, chunk: &[u8]) -> Vec<u8> {
    let at = |ip: [u8; 4], port| SocketAddr::new(Ipv4Addr::from(ip).into(), port);
    packet_craft::sctp(at(CLIENT, src_port), at(NODE, dst_port), 1, chunk)
}
const INIT: [u8; 20] = [1, 0, 0, 20, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 0, 10, 0, 10, 0, 0, 0, 1];
const DATA: [u8; 20] = [0, 3, 0, 20, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, b'p', b'i', b'n', b'g'];

/// The bench's uplink: a veth whose other end has the backends' and the
/// client's next hops (static neighbours), so that a translated packet is
/// routed and sent on (tc: redirect, XDP: `XDP_TX`), as on a node.
const UPLINK: &str = "bench0";

fn uplink() -> anyhow::Result<u32> {
    let ip = |args: &str| -> anyhow::Result<()> {
        let status = std::process::Command::new("ip").args(args.split(' ')).status()?;
        anyhow::ensure!(status.success(), "ip {args}");
        Ok(())
    };
    ip("link add bench0 type veth peer name bench1")?;
    ip("link set bench0 up")?;
    ip("link set bench1 up")?;
    ip("addr add 10.0.0.1/24 dev bench0")?;
    // The FIB lookup forwards only where the node does.
    std::fs::write("/proc/sys/net/ipv4/conf/all/forwarding", "1")?;
    ip("neigh add 10.0.0.2 lladdr 02:00:00:00:00:02 dev bench0 nud permanent")?;
    ip("route add 10.244.2.0/24 via 10.0.0.2 dev bench0")?;
    ip("route add 192.168.100.0/24 via 10.0.0.2 dev bench0")?;
    Ok(proxy_agent::sys::ifindex(UPLINK)?)
}

/// A packet arriving on the uplink, taking turns packet by packet: tc's
/// ingress (the routed path: redirect) against XDP's (`XDP_TX`): a miss
/// (1M repeats), a new NodePort flow and a packet of a tracked one (one
/// run each, as the figures above); `(name, ns, what)`.
fn routed_and_xdp(
    dp: &mut BpfObject,
    rounds: u16,
) -> anyhow::Result<Vec<(&'static str, f64, &'static str)>> {
    let ifindex = uplink()?;
    let miss = syn(40000, NODE, 22);
    let tc_miss = dp.run_tc_on(&miss, 1_000_000, ifindex)?.duration.as_nanos() as f64;
    let xdp_miss = dp.run_xdp(&miss, 1_000_000, ifindex)?.duration.as_nanos() as f64;
    let (mut tc_new, mut xdp_new) = (Vec::new(), Vec::new());
    for port in 0..rounds {
        tc_new.push(dp.run_tc_on(&syn(40_000 + port, NODE, 30080), 1, ifindex)?.duration);
        xdp_new.push(dp.run_xdp(&syn(20_000 + port, NODE, 30080), 1, ifindex)?.duration);
    }
    let (mut tc_tracked, mut xdp_tracked) = (Vec::new(), Vec::new());
    for port in 0..rounds {
        tc_tracked.push(dp.run_tc_on(&syn(40_000 + port, NODE, 30080), 1, ifindex)?.duration);
        xdp_tracked.push(dp.run_xdp(&syn(20_000 + port, NODE, 30080), 1, ifindex)?.duration);
    }
    Ok(vec![
        ("routed_miss", tc_miss, "tc, arriving on an uplink: not a service, 1M repeats"),
        ("xdp_miss", xdp_miss, "XDP, the same"),
        ("routed_node_port_new", mean(&tc_new), "tc, a new NodePort flow sent on by redirect"),
        ("xdp_node_port_new", mean(&xdp_new), "XDP, the same by XDP_TX"),
        ("routed_tracked", mean(&tc_tracked), "tc, a tracked flow's packet sent on by redirect"),
        ("xdp_tracked", mean(&xdp_tracked), "XDP, the same by XDP_TX"),
    ])
}

fn mean(runs: &[Duration]) -> f64 {
    runs.iter().map(|d| d.as_nanos() as f64).sum::<f64>() / runs.len() as f64
}

/// ClusterIP number `i`: 10.96.0.0/12 from 10.96.0.10 on.
fn cluster_ip(i: u32) -> [u8; 4] {
    (0x0a60_000a + i).to_be_bytes()
}

fn main() -> anyhow::Result<()> {
    anyhow::ensure!(unsafe { libc::geteuid() } == 0, "needs root");
    let args: Vec<String> = std::env::args().collect();
    let services: u32 = match args.iter().position(|a| a == "--services") {
        Some(i) => args.get(i + 1).map_or(Ok(1), |n| n.parse())?,
        None => 1,
    };
    anyhow::ensure!(services >= 1, "--services N: at least 1");
    let level = match args.iter().position(|a| a == "--bpf-log-level") {
        Some(i) => <BpfLogLevel as clap::ValueEnum>::from_str(
            args.get(i + 1).map_or("", String::as_str),
            true,
        )
        .map_err(|e| anyhow::anyhow!("--bpf-log-level: {e}"))?,
        None => BpfLogLevel::Off,
    };
    let monitor = args.iter().any(|a| a == "--monitor");
    // SAFETY: single-threaded here; the namespace is this process's alone.
    anyhow::ensure!(unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0, "unshare");
    let entries = (services * 2 + 1024).max(proxy_common::MAX_SERVICE_ENTRIES);
    let mut dp = BpfObject::load_with(
        TcAttach::Tcx,
        MapSizes { services: entries, backends: entries, rev_nat: entries },
        // Room for the runs' 100,000 flows (two entries each) and more: an
        // LRU evicting them would time new flows, not tracked packets.
        StateSizes::new(
            ConntrackLimit { min: 262_144, ..ConntrackLimit::default() },
            proxy_agent::sys::cpu_count(),
            true,
        ),
        None,
    )?;
    dp.configure(&Config {
        snat_addr: NODE,
        snat_port_min: 1024,
        snat_port_max: 65000,
        tcp_syn_timeout_secs: 60,
        tcp_established_timeout_secs: 3600,
        tcp_close_wait_timeout_secs: 3600,
        tcp_time_wait_timeout_secs: 120,
        udp_timeout_secs: 30,
        log_level: level.word(),
        maglev_table_size: proxy_common::maglev::DEFAULT_TABLE_SIZE,
        ..Config::default()
    })?;
    let drained = Arc::new(AtomicU64::new(0));
    // Off, the reader would only wake up for nothing and disturb the runs
    // (an idle agent's reader sleeps in epoll).
    if level != BpfLogLevel::Off {
        let mut records = dp.take_records()?;
        let drained = drained.clone();
        // Counted, not put into words.
        std::thread::spawn(move || {
            loop {
                while records.next().is_some() {
                    drained.fetch_add(1, Relaxed);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
    }
    let backends: Vec<BackendPlan> = (0..100u8)
        .map(|i| BackendPlan {
            addr: EndpointAddr::new(Ipv4Addr::from([10, 244, 2, i + 2]).into(), 8080),
            local: false,
            host: false,
        })
        .collect();
    let frontend =
        |name: String, backends: Vec<BackendPlan>, external: bool, (maglev, dsr)| FrontendPlan {
            service: Arc::new(ServicePortName {
                service: ServiceName { namespace: "bench".into(), name: name.into() },
                port: "".into(),
            }),
            kind: if external { FrontendKind::NodePort } else { FrontendKind::ClusterIp },
            backends: backends.into(),
            affinity_timeout_secs: None,
            external,
            local: false,
            drop_when_empty: false,
            source_ranges: vec![],
            two_scopes: false,
            serves_terminating: false,
            maglev,
            dsr,
        };
    let mut plan = Plan::default();
    // The same backends behind a NodePort that picks from a Maglev table.
    plan.frontends.insert(
        Frontend::new(NODE.into(), 30081, Protocol::Tcp),
        frontend("maglev".into(), backends.clone(), true, (true, false)),
    );
    // And one whose flows go to them by direct server return.
    plan.frontends.insert(
        Frontend::new(NODE.into(), 30082, Protocol::Tcp),
        frontend("dsr".into(), backends.clone(), true, (false, true)),
    );
    // An SCTP NodePort to them (SNAT, the port translated: the CRC updated).
    plan.frontends.insert(
        Frontend::new(NODE.into(), 30868, Protocol::Sctp),
        frontend("diameter".into(), backends.clone(), true, (false, false)),
    );
    plan.frontends.insert(
        Frontend::new(NODE.into(), 30080, Protocol::Tcp),
        frontend("web".into(), backends, true, (false, false)),
    );
    for i in 1..services {
        let backend = BackendPlan {
            addr: EndpointAddr::new(Ipv4Addr::from(0x0af5_0000 + i).into(), 8080),
            local: false,
            host: false,
        };
        plan.frontends.insert(
            Frontend::new(cluster_ip(i).into(), 80, Protocol::Tcp),
            frontend(format!("s{i}"), vec![backend], false, (false, false)),
        );
    }
    dp.sync(&plan, None)?;
    // A new datapath inspects every backend's replies until two conntrack
    // collections have cleared the reply slots of no flow, as an agent's do.
    for _ in 0..2 {
        dp.collect_conntrack()?;
    }
    let mut watch = dp.watch()?;
    if monitor {
        watch.set_deadline(u64::MAX)?;
    }
    let mut events = 0;

    let rounds = 20_000u16;
    let pass = dp.run_tc(&syn(40000, NODE, 22), 1_000_000)?.duration.as_nanos();
    // What one run costs beyond the program, as every figure of one run per
    // packet pays it (BPF_PROG_TEST_RUN's timer and dispatch): the miss run
    // once, less its figure over a million repeats.
    let mut once = Vec::new();
    for _ in 0..rounds {
        once.push(dp.run_tc(&syn(40000, NODE, 22), 1)?.duration);
    }
    let run_overhead = mean(&once) - pass as f64;
    // A NodePort backend answering a pod that the socket LB connected to
    // it: no per-packet flow of its own (the NodePort's are masqueraded).
    let reply = tcp4(([10, 244, 2, 2], 8080), ([10, 244, 1, 5], 50000));
    let socket_lb_reply = dp.run_tc(&reply, 1_000_000)?.duration.as_nanos();
    let ipv6_miss = dp.run_tc(&syn6_miss(), 1_000_000)?.duration.as_nanos();
    // The kinds compared with each other take turns, packet by packet:
    // each meets the conntrack map as full as the others do.
    let (mut new, mut maglev, mut dsr_new) = (Vec::new(), Vec::new(), Vec::new());
    for port in 0..rounds {
        new.push(dp.run_tc(&syn(10_000 + port, NODE, 30080), 1)?.duration);
        maglev.push(dp.run_tc(&syn(10_000 + port, NODE, 30081), 1)?.duration);
        dsr_new.push(dp.run_tc(&syn(10_000 + port, NODE, 30082), 1)?.duration);
        // Outside the kernel's measure: the ring never fills.
        events += watch.by_ref().count();
    }
    let (mut tracked, mut dsr_tracked) = (Vec::new(), Vec::new());
    for port in 0..rounds {
        tracked.push(dp.run_tc(&syn(10_000 + port, NODE, 30080), 1)?.duration);
        dsr_tracked.push(dp.run_tc(&syn(10_000 + port, NODE, 30082), 1)?.duration);
    }
    // SCTP in loops of its own: taking turns with the TCP packets above,
    // the other program's turn made the TCP figure after it 1.3-1.5x.
    let mut sctp_new = Vec::new();
    for port in 0..rounds {
        sctp_new.push(dp.run_tc(&sctp(10_000 + port, 30868, &INIT), 1)?.duration);
        events += watch.by_ref().count();
    }
    let mut sctp_tracked = Vec::new();
    for port in 0..rounds {
        sctp_tracked.push(dp.run_tc(&sctp(10_000 + port, 30868, &DATA), 1)?.duration);
    }
    // A new flow to the last ClusterIP installed (the first with one).
    let vip = cluster_ip(services.saturating_sub(1).max(1));
    let mut cluster = Vec::new();
    if services > 1 {
        for port in 0..rounds {
            cluster.push(dp.run_tc(&syn(30_000 + port, vip, 80), 1)?.duration);
            events += watch.by_ref().count();
        }
    }
    let routed = routed_and_xdp(&mut dp, rounds)?;
    println!(
        "per-packet program (tc ingress), {services} services, ns per packet, kernel-measured:"
    );
    println!("miss {pass}  (not a service, 1M repeats)");
    println!("socket_lb_reply {socket_lb_reply}  (a backend's reply of no per-packet flow, 1M)");
    println!("ipv6_miss {ipv6_miss}  (IPv6, not a service, 1M repeats)");
    println!(
        "node_port_new {:.0}  (new NodePort flow, 100 backends, SNAT; mean of {rounds})",
        mean(&new)
    );
    println!(
        "node_port_new_maglev {:.0}  (the same from a Maglev table of 16381; mean of {rounds})",
        mean(&maglev)
    );
    println!(
        "node_port_new_dsr {:.0}  (the same by direct server return, option inserted; mean of {rounds})",
        mean(&dsr_new)
    );
    println!(
        "tracked_dsr {:.0}  (packet of a tracked DSR flow, option inserted; mean of {rounds})",
        mean(&dsr_tracked)
    );
    if !cluster.is_empty() {
        println!("cluster_ip_new {:.0}  (new ClusterIP flow; mean of {rounds})", mean(&cluster));
    }
    println!("tracked {:.0}  (packet of a tracked flow; mean of {rounds})", mean(&tracked));
    println!(
        "sctp_node_port_new {:.0}  (new SCTP NodePort association, an INIT: tail call, SNAT, port and CRC rewritten; mean of {rounds})",
        mean(&sctp_new)
    );
    println!(
        "sctp_tracked {:.0}  (DATA of a tracked association; mean of {rounds})",
        mean(&sctp_tracked)
    );
    println!(
        "run_overhead {run_overhead:.0}  (the miss run once, mean of {rounds}, less its 1M figure)"
    );
    for (name, ns, what) in routed {
        println!("{name} {ns:.0}  ({what})");
    }
    std::thread::sleep(Duration::from_millis(50));
    println!("bpf log level {level:?}: {} records", drained.load(Relaxed));
    events += watch.by_ref().count();
    let lost = watch.lost();
    println!("monitor {}: {events} events, {lost} lost", if monitor { "on" } else { "off" });
    Ok(())
}
