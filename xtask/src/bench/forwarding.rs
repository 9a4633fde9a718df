//! Forwarding rate through a NodePort (`cargo xtask forwarding`): frames
//! reach the first node's uplink as a NIC hands them over, with no skb yet.
//! On the wire's far end (the uplink's peer, a port of the fabric's bridge)
//! an XDP program run by `BPF_PROG_TEST_RUN` with live frames (5.18+) makes
//! UDP frames of 64 flows to a NodePort, as fast as one core can, and
//! redirects them into the uplink. The NodePort's only endpoint is a pod on
//! the second node (policy Cluster: masqueraded, sent back out of the
//! uplink). The uplink's receive processing (its NAPI) runs in a real-time
//! kernel thread of its own on a core of its own, so the node's CPU per
//! packet is that thread's time, apart from the sender's and the rest of
//! the lab's. Once the flows are made and shown to reach the pod, the wire
//! ends at the fabric's port (what the node sends there is dropped as it
//! arrives), so that the sender outruns the node and the node's own rate
//! is measured. The first node in the eBPF mode with tc alone, with XDP
//! (`--bpf-lb-acceleration native`), and in the iptables mode (kube-proxy's
//! rules), in turns.

use std::{
    os::fd::{AsRawFd, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use proxy_lab::{EXT_IP, Lab, Mode, NODE_IP, Pod, Setup, Source, load_xdp, sh};

/// The NodePort, and the pod's port (a silent sink: its firewall drops
/// what arrives, so nothing answers).
const NODE_PORT: u16 = 30009;
const SINK_PORT: u16 = 9;
/// Flows: client ports the sender draws from (a power of two).
const FLOWS: u16 = 64;
const FIRST_CLIENT_PORT: u16 = 20_000;
/// Frames per `BPF_PROG_TEST_RUN`: a second's worth or so (each run ends
/// with an RCU grace period, tens of milliseconds without frames).
const COPIES: u32 = 1 << 20;
/// Frames that make every flow (a draw of 4,096 misses one of 64 ports with
/// a chance of about 10⁻²⁶).
const WARM_UP: u32 = 4096;
/// The sender's and the fabric's core, and the node's.
const SENDER_CPU: usize = 0;
const NODE_CPU: usize = 1;

/// What one run measured.
struct Rate {
    /// Frames the sender made.
    sent: u64,
    /// Frames the node sent back to the wire (the fabric port received).
    forwarded: u64,
    seconds: f64,
    /// The node's receive thread's CPU time.
    node_cpu_seconds: f64,
}

/// `cargo xtask forwarding`: `rounds` runs of `seconds` per setup, in turns;
/// prints each run and the medians.
pub fn run(seconds: u64, rounds: usize) -> anyhow::Result<()> {
    let setups = [("tc", Setup::EBPF), ("xdp", Setup::XDP), ("iptables", iptables())];
    let mut results: Vec<Vec<Rate>> = setups.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, (name, setup)) in setups.iter().enumerate() {
            if std::env::var("FWD_ONLY").is_ok_and(|o| o != *name) {
                continue;
            }
            let rate = measure(*setup, Duration::from_secs(seconds))
                .with_context(|| format!("{name}, round {}", round + 1))?;
            eprintln!(
                "forwarding {name} round {}: sent {} forwarded {} in {:.2} s, node CPU {:.2} s",
                round + 1,
                rate.sent,
                rate.forwarded,
                rate.seconds,
                rate.node_cpu_seconds
            );
            results[i].push(rate);
        }
    }
    println!(
        "| setup | packets/s forwarded | CPU ns per packet | node's core busy | sender: frames/s |"
    );
    println!("|---|---:|---:|---:|---:|");
    let mut medians = Vec::new();
    for ((name, _), rates) in setups.iter().zip(&results) {
        let per_second = |count: fn(&Rate) -> u64| {
            super::median(rates.iter().map(|r| count(r) as f64 / r.seconds).collect())
        };
        let pps = per_second(|r| r.forwarded);
        let cpu_ns = super::median(
            rates.iter().map(|r| 1e9 * r.node_cpu_seconds / r.forwarded.max(1) as f64).collect(),
        );
        let busy = super::median(rates.iter().map(|r| r.node_cpu_seconds / r.seconds).collect());
        println!(
            "| {name} | {pps:.0} | {cpu_ns:.0} | {:.0}% | {:.0} |",
            100.0 * busy,
            per_second(|r| r.sent)
        );
        medians.push((pps, cpu_ns));
    }
    let ratio = |a: (f64, f64), b: (f64, f64)| (a.0 / b.0, a.1 / b.1);
    for (name, (pps, cpu)) in [
        ("XDP ÷ tc", ratio(medians[1], medians[0])),
        ("XDP ÷ iptables", ratio(medians[1], medians[2])),
        ("tc ÷ iptables", ratio(medians[0], medians[2])),
    ] {
        println!("\n{name}: {pps:.2}× the packets per second, {cpu:.2}× the CPU per packet");
    }
    Ok(())
}

fn iptables() -> Setup {
    Setup::of(Mode::Iptables, Source::Manifests)
}

/// One run: the two-node lab in `setup`, the sink pod on the second node,
/// frames fed into the first node's uplink for `span`.
fn measure(setup: Setup, span: Duration) -> anyhow::Result<Rate> {
    let mut lab = Lab::with(setup)?;
    lab.add_node()?;
    let sink = lab.add_pod_on(1, "web-b", "10.244.2.2")?;
    let drop = format!("-A INPUT -p udp --dport {SINK_PORT} -j DROP");
    let drop: Vec<&str> = drop.split(' ').collect();
    sh("ip", &[&["netns", "exec", &sink.netns, "iptables"][..], &drop].concat())?;
    let ext = lab.add_external("ext", EXT_IP)?;
    lab.write_manifest(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: sink, namespace: bench}}\nspec: {{clusterIP: 10.96.0.10, type: NodePort, ports: [{{name: sink, protocol: UDP, port: 9, targetPort: {SINK_PORT}, nodePort: {NODE_PORT}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: sink-1, namespace: bench, labels: {{kubernetes.io/service-name: sink}}}}\naddressType: IPv4\nports: [{{name: sink, protocol: UDP, port: {SINK_PORT}}}]\nendpoints: [{{addresses: [{}], nodeName: lab-node2}}]\n",
        sink.ip
    ))?;
    for node in 0..2 {
        lab.start_agent_on(node, &["--cluster-cidr", "10.244.0.0/16"])?;
    }
    let frame = frame(&lab, &ext)?;
    let (fabric, port) = lab.fabric_port(0);
    let node_thread = napi_threads(&lab, fabric, &port)?;
    let sender = Sender { netns: fabric.into(), port: port.clone() };
    let forwarded = || counter(fabric, &format!("/sys/class/net/{port}/statistics/rx_packets"));
    let delivered = || counter(&sink.netns, "/sys/class/net/eth0/statistics/rx_packets");
    // Every flow's first frames: its flow made (and, in the iptables mode,
    // conntrack's entry) and the next hop's address resolved; then only
    // tracked packets. What the node forwards then must reach the pod.
    for round in 0..2 {
        let before = (forwarded()?, delivered()?);
        sender.send(&frame, WARM_UP, Duration::ZERO)?;
        std::thread::sleep(Duration::from_millis(300));
        let (out, arrived) = (forwarded()? - before.0, delivered()? - before.1);
        if round == 1 && (out == 0 || arrived < out * 9 / 10) {
            bail!("the node forwarded {out} frames, the pod received {arrived}");
        }
    }
    lab.end_wire_at(0)?;
    let before = (forwarded()?, cpu_seconds(node_thread)?);
    let started = Instant::now();
    let sent = sender.send(&frame, COPIES, span)?;
    let seconds = started.elapsed().as_secs_f64();
    // What is in flight arrives.
    std::thread::sleep(Duration::from_millis(100));
    let after = (forwarded()?, cpu_seconds(node_thread)?);
    Ok(Rate { sent, forwarded: after.0 - before.0, seconds, node_cpu_seconds: after.1 - before.1 })
}

/// Gives the node's uplink and its fabric port each a NAPI (GRO on; XDP
/// gives one too) in a real-time kernel thread of its own (`threaded`), the
/// node's on its own core, the fabric's with the sender; returns the node's
/// thread.
/// A veth takes another's redirected frames only into a NAPI, and in a
/// thread the node's receive work is measured apart from the wire's.
fn napi_threads(lab: &Lab, fabric: &str, port: &str) -> anyhow::Result<u32> {
    let mut threads = Vec::new();
    for (netns, dev, cpu) in
        [(lab.nodes()[0].netns.as_str(), "eth0", NODE_CPU), (fabric, port, SENDER_CPU)]
    {
        let before = napi_thread_ids(dev)?;
        sh("ip", &["netns", "exec", netns, "ethtool", "-K", dev, "gro", "on"])?;
        let threaded = format!("echo 1 > /sys/class/net/{dev}/threaded");
        sh("ip", &["netns", "exec", netns, "sh", "-c", &threaded])?;
        let new: Vec<u32> =
            napi_thread_ids(dev)?.into_iter().filter(|t| !before.contains(t)).collect();
        let [thread] = new[..] else {
            bail!("{dev} in {netns}: expected one new NAPI thread, found {new:?}");
        };
        sh("taskset", &["-pc", &cpu.to_string(), &thread.to_string()])?;
        // Real-time, as interrupt work is: what else runs on the machine
        // waits, not the packets.
        sh("chrt", &["-f", "-p", "50", &thread.to_string()])?;
        threads.push(thread);
    }
    Ok(threads[0])
}

/// The NAPI threads of interfaces named `dev` (`napi/<dev>-<id>`).
fn napi_thread_ids(dev: &str) -> anyhow::Result<Vec<u32>> {
    let prefix = format!("napi/{dev}-");
    let mut ids = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim_end().starts_with(&prefix) {
            ids.push(pid);
        }
    }
    Ok(ids)
}

/// The client's frame to the NodePort: Ethernet to the first node's
/// uplink, IPv4, UDP (no checksum) from the first client port, with 18
/// bytes (a 60-byte frame).
fn frame(lab: &Lab, ext: &Pod) -> anyhow::Result<Vec<u8>> {
    let mac = |text: String| -> anyhow::Result<[u8; 6]> {
        let bytes: Vec<u8> =
            text.trim().split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>()?;
        bytes.try_into().map_err(|_| anyhow::anyhow!("not a MAC: {text}"))
    };
    let node = mac(lab.exec_on(0, "cat", &["/sys/class/net/eth0/address"])?)?;
    let client =
        mac(sh("ip", &["netns", "exec", &ext.netns, "cat", "/sys/class/net/eth0/address"])?)?;
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (EXT_IP.parse()?, NODE_IP.parse()?);
    let mut f = Vec::with_capacity(60);
    f.extend_from_slice(&node);
    f.extend_from_slice(&client);
    f.extend_from_slice(&[0x08, 0x00]);
    let mut ip = [0x45, 0, 0, 46, 0, 0, 0x40, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let sum = ip.chunks(2).map(|w| u16::from_be_bytes([w[0], w[1]]) as u32).sum::<u32>();
    let sum = (sum & 0xffff) + (sum >> 16);
    ip[10..12].copy_from_slice(&(!((sum & 0xffff) + (sum >> 16)) as u16).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&FIRST_CLIENT_PORT.to_be_bytes());
    f.extend_from_slice(&NODE_PORT.to_be_bytes());
    f.extend_from_slice(&26u16.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&[0x5a; 18]);
    Ok(f)
}

/// A counter file read in `netns`.
fn counter(netns: &str, path: &str) -> anyhow::Result<u64> {
    Ok(sh("ip", &["netns", "exec", netns, "cat", path])?.trim().parse()?)
}

/// A thread's CPU time so far (`/proc/<pid>/schedstat`: nanoseconds on a CPU).
fn cpu_seconds(thread: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{thread}/schedstat"))?;
    let ns: u64 = stat.split_whitespace().next().context("schedstat")?.parse()?;
    Ok(ns as f64 / 1e9)
}

/// The wire's far end: the sender's XDP program (`sender_program`) run by
/// `BPF_PROG_TEST_RUN` with live frames, each copy a page-pool frame sent
/// through the fabric port's `ndo_xdp_xmit`, which queues it in the node's
/// uplink's receive ring.
struct Sender {
    netns: String,
    port: String,
}

impl Sender {
    /// Sends `copies` frames, again until `span` has passed (once when it
    /// is zero), from a thread in the fabric's namespace (the redirect finds
    /// the port there) on the sender's core; returns the frames made.
    fn send(&self, frame: &[u8], copies: u32, span: Duration) -> anyhow::Result<u64> {
        let ns = std::fs::File::open(format!("/run/netns/{}", self.netns))?;
        std::thread::scope(|s| {
            s.spawn(|| -> anyhow::Result<u64> {
                // SAFETY: a namespace descriptor; only this thread moves.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    bail!("entering {}: {}", self.netns, std::io::Error::last_os_error());
                }
                pin_to(SENDER_CPU)?;
                let program = sender_program(&self.port, frame)?;
                let started = Instant::now();
                let mut sent = 0;
                loop {
                    test_run_live(&program, frame, copies)?;
                    sent += u64::from(copies);
                    if started.elapsed() >= span {
                        return Ok(sent);
                    }
                }
            })
            .join()
            .unwrap_or_else(|_| bail!("the sender's thread panicked"))
        })
    }
}

/// The sender's program: writes `frame`'s headers into the frame (a live
/// frame's page comes back to the sender's pool as the receiver left it,
/// and the node rewrites what it forwards), a client port drawn from
/// `FLOWS`, and redirects it into `dev`.
fn sender_program(dev: &str, frame: &[u8]) -> anyhow::Result<OwnedFd> {
    const BPF_FUNC_GET_PRANDOM_U32: i32 = 7;
    const BPF_FUNC_REDIRECT: i32 = 23;
    const XDP_DROP: i32 = 1;
    /// Ethernet, IPv4 and UDP; the client port at 34.
    const HEADERS: usize = 42;
    const CLIENT_PORT_AT: i16 = 34;
    let name = std::ffi::CString::new(dev)?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
    if ifindex == 0 {
        bail!("no {dev} here");
    }
    // One instruction: opcode, registers (source << 4 | destination),
    // offset, immediate.
    let insn = |code: u8, regs: u8, off: i16, imm: i32| {
        let mut insn = [code, regs, 0, 0, 0, 0, 0, 0];
        insn[2..4].copy_from_slice(&off.to_le_bytes());
        insn[4..].copy_from_slice(&imm.to_le_bytes());
        insn
    };
    let (len, ports) = (frame.len() as i32, i32::from(FLOWS) - 1);
    let mut program = vec![
        insn(0x61, 0x12, 0, 0),   // r2 = ctx->data
        insn(0x61, 0x13, 4, 0),   // r3 = ctx->data_end
        insn(0xbf, 0x27, 0, 0),   // r7 = r2
        insn(0x07, 0x02, 0, len), // r2 += len
    ];
    let headers: Vec<[u8; 8]> = frame[..HEADERS]
        .chunks(4)
        .enumerate()
        .map(|(i, bytes)| {
            let off = 4 * i as i16;
            match *bytes {
                // *(u32 *)(r7 + off) = the 4 bytes as memory holds them
                [a, b, c, d] => insn(0x62, 0x07, off, i32::from_le_bytes([a, b, c, d])),
                // *(u16 *)(r7 + off) = the last 2
                [a, b] => insn(0x6a, 0x07, off, i32::from(u16::from_le_bytes([a, b]))),
                _ => unreachable!("42 bytes are 10 words and a half"),
            }
        })
        .collect();
    // if r2 > r3 (the frame is shorter than ours): drop it
    program.push(insn(0x2d, 0x32, headers.len() as i16 + 9, 0));
    program.extend(headers);
    program.extend([
        insn(0x85, 0, 0, BPF_FUNC_GET_PRANDOM_U32), // r0 = random
        insn(0x57, 0x00, 0, ports),                 // r0 &= FLOWS - 1
        insn(0x07, 0x00, 0, i32::from(FIRST_CLIENT_PORT)), // r0 += the first port
        insn(0xdc, 0x00, 0, 16),                    // r0 = htons(r0)
        insn(0x6b, 0x07, CLIENT_PORT_AT, 0),        // *(u16 *)(r7 + 34) = r0
        insn(0xb7, 0x01, 0, ifindex),               // r1 = ifindex
        insn(0xb7, 0x02, 0, 0),                     // r2 = 0
        insn(0x85, 0, 0, BPF_FUNC_REDIRECT),        // r0 = bpf_redirect(r1, r2)
        insn(0x95, 0, 0, 0),                        // return r0
        insn(0xb7, 0x00, 0, XDP_DROP),              // r0 = XDP_DROP
        insn(0x95, 0, 0, 0),                        // return r0
    ]);
    load_xdp(&program).context("loading the sender's program")
}

/// `BPF_PROG_TEST_RUN` with `BPF_F_TEST_XDP_LIVE_FRAMES`: `copies` runs of
/// `program` on frames made from `frame`, each sent where the program says.
fn test_run_live(program: &OwnedFd, frame: &[u8], copies: u32) -> anyhow::Result<()> {
    const BPF_PROG_TEST_RUN: libc::c_long = 10;
    const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
    // `union bpf_attr`'s `test`: prog_fd, data_size_in, data_in, repeat, flags.
    let mut attr = [0u8; 80];
    attr[0..4].copy_from_slice(&(program.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&copies.to_ne_bytes());
    attr[64..68].copy_from_slice(&BPF_F_TEST_XDP_LIVE_FRAMES.to_ne_bytes());
    // SAFETY: an attr the size given, pointing at a live frame.
    if unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_TEST_RUN, attr.as_ptr(), attr.len()) } < 0 {
        bail!("BPF_PROG_TEST_RUN with live frames: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Keeps the calling thread on `cpu`.
fn pin_to(cpu: usize) -> anyhow::Result<()> {
    // SAFETY: a zeroed set, then one CPU in it, for this thread.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        bail!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
