//! Nanoseconds per packet of the per-packet program, measured by the kernel
//! with `BPF_PROG_TEST_RUN` (nothing is sent), for the paths a packet can
//! take: not a service, a new NodePort flow (backend pick, SNAT port, two
//! conntrack inserts), and a packet of a tracked flow. Runs in a network
//! namespace of its own. Needs root. `cargo xtask bench` runs it.

use std::{net::SocketAddrV4, time::Duration};

use proxy_agent::{
    backend::ebpf::{EbpfBackend, TcAttach},
    model::{Protocol, ServiceName, ServicePortName},
    plan::{BackendPlan, Frontend, FrontendPlan, Plan},
};
use proxy_common::Config;

const NODE: [u8; 4] = [192, 168, 100, 11];

fn syn(src_port: u16, dst: [u8; 4], dst_port: u16) -> Vec<u8> {
    let mut p = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00];
    p.extend_from_slice(&[0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0]);
    p.extend_from_slice(&[192, 168, 100, 101]);
    p.extend_from_slice(&dst);
    p.extend_from_slice(&src_port.to_be_bytes());
    p.extend_from_slice(&dst_port.to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    p
}

fn mean(runs: &[Duration]) -> f64 {
    runs.iter().map(|d| d.as_nanos() as f64).sum::<f64>() / runs.len() as f64
}

fn main() -> anyhow::Result<()> {
    anyhow::ensure!(unsafe { libc::geteuid() } == 0, "needs root");
    // SAFETY: single-threaded here; the namespace is this process's alone.
    anyhow::ensure!(unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0, "unshare");
    let mut dp = EbpfBackend::load(TcAttach::Tcx)?;
    dp.configure(&Config {
        snat_addr: NODE,
        snat_port_min: 1024,
        snat_port_max: 65000,
        tcp_syn_timeout_secs: 60,
        tcp_established_timeout_secs: 3600,
        tcp_close_wait_timeout_secs: 3600,
        tcp_time_wait_timeout_secs: 120,
        udp_timeout_secs: 30,
        ..Config::default()
    })?;
    let backends = (0..100u8)
        .map(|i| BackendPlan {
            addr: SocketAddrV4::new([10, 244, 2, i + 2].into(), 8080),
            local: false,
            host: false,
        })
        .collect();
    let plan = Plan {
        frontends: [(
            Frontend { ip: NODE.into(), port: 30080, protocol: Protocol::Tcp },
            FrontendPlan {
                service: ServicePortName {
                    service: ServiceName { namespace: "bench".into(), name: "web".into() },
                    port: String::new(),
                },
                backends,
                affinity_timeout_secs: None,
                external: true,
                local: false,
                drop_when_empty: false,
                source_ranges: vec![],
            },
        )]
        .into(),
    };
    dp.sync(&plan)?;

    let rounds = 20_000u16;
    let pass = dp.run_tc(&syn(40000, NODE, 22), 1_000_000)?.duration.as_nanos();
    let mut new = Vec::new();
    for port in 0..rounds {
        new.push(dp.run_tc(&syn(10_000 + port, NODE, 30080), 1)?.duration);
    }
    let mut tracked = Vec::new();
    for port in 0..rounds {
        tracked.push(dp.run_tc(&syn(10_000 + port, NODE, 30080), 1)?.duration);
    }
    println!("per-packet program (tc ingress), ns per packet, kernel-measured:");
    println!("  not a service (1M repeats)             {pass:>6}");
    println!(
        "  new NodePort flow, 100 backends, SNAT  {:>6.0}  (mean of {rounds} single runs)",
        mean(&new)
    );
    println!(
        "  packet of a tracked flow               {:>6.0}  (mean of {rounds} single runs)",
        mean(&tracked)
    );
    Ok(())
}
