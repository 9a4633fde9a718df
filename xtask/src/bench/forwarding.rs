//! Forwarding rate through a NodePort (`cargo xtask forwarding`): an
//! external client sends UDP frames as fast as one core can (an
//! `AF_PACKET` socket that bypasses its qdisc) to a NodePort of the first
//! node whose only endpoint is a pod on the second (policy Cluster:
//! masqueraded, forwarded back out of the uplink); counted as the pod
//! receives them. The first node in the eBPF mode with tc alone, with XDP
//! (`--bpf-lb-acceleration native`), and in the iptables mode (kube-proxy's
//! rules), in turns. The CPU is the machine's (all of the lab shares it:
//! the sender, the fabric's bridge, both nodes), per million packets
//! forwarded.

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use proxy_lab::{EXT_IP, Lab, Mode, NODE_IP, Pod, Setup, Source, sh};

/// The NodePort, and the pod's port (a silent sink: its firewall drops
/// what arrives, so nothing answers).
const NODE_PORT: u16 = 30009;
const SINK_PORT: u16 = 9;
/// Flows (client ports) the frames take turns over.
const FLOWS: u16 = 64;

/// What one run measured.
struct Rate {
    sent: u64,
    forwarded: u64,
    seconds: f64,
    cpu_seconds: f64,
}

/// `cargo xtask forwarding`: `rounds` runs of `seconds` per setup, in turns;
/// prints each run and the medians.
pub fn run(seconds: u64, rounds: usize) -> anyhow::Result<()> {
    let setups = [("tc", Setup::EBPF), ("xdp", Setup::XDP), ("iptables", iptables())];
    let mut results: Vec<Vec<Rate>> = setups.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, (name, setup)) in setups.iter().enumerate() {
            let rate = measure(*setup, Duration::from_secs(seconds))
                .with_context(|| format!("{name}, round {}", round + 1))?;
            eprintln!(
                "forwarding {name} round {}: sent {} forwarded {} in {:.2} s, CPU {:.2} s",
                round + 1,
                rate.sent,
                rate.forwarded,
                rate.seconds,
                rate.cpu_seconds
            );
            results[i].push(rate);
        }
    }
    println!("| setup | packets/s forwarded | sent/s | CPU ms per million forwarded |");
    println!("|---|---:|---:|---:|");
    let mut medians = Vec::new();
    for ((name, _), rates) in setups.iter().zip(&results) {
        let pps = super::median(rates.iter().map(|r| r.forwarded as f64 / r.seconds).collect());
        let sent = super::median(rates.iter().map(|r| r.sent as f64 / r.seconds).collect());
        let cpu = super::median(
            rates.iter().map(|r| 1e3 * r.cpu_seconds / (r.forwarded.max(1) as f64 / 1e6)).collect(),
        );
        println!("| {name} | {pps:.0} | {sent:.0} | {cpu:.0} |");
        medians.push((pps, cpu));
    }
    let (tc, xdp) = (medians[0], medians[1]);
    println!(
        "\nXDP ÷ tc: {:.2}× the packets per second, {:.2}× the CPU per packet",
        xdp.0 / tc.0,
        xdp.1 / tc.1
    );
    Ok(())
}

fn iptables() -> Setup {
    Setup::of(Mode::Iptables, Source::Manifests)
}

/// One run: the two-node lab in `setup`, the sink pod on the second node,
/// the client sending for `span`.
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
    let frames = frames(&lab, &ext)?;
    let socket = Sender::open(&ext.netns)?;
    // Each flow's first frame: its flow made (and, in the iptables mode,
    // conntrack's entry), then only tracked packets.
    for frame in &frames {
        socket.send(frame)?;
    }
    std::thread::sleep(Duration::from_millis(300));
    let received = || rx_packets(&sink);
    let (before, cpu_before) = (received()?, cpu_seconds()?);
    let started = Instant::now();
    let mut sent = 0u64;
    while started.elapsed() < span {
        for frame in &frames {
            // A full queue refuses a frame: the rate is what gets through.
            if socket.send(frame).is_ok() {
                sent += 1;
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    // What is in flight arrives.
    std::thread::sleep(Duration::from_millis(200));
    let (after, cpu_after) = (received()?, cpu_seconds()?);
    Ok(Rate { sent, forwarded: after - before, seconds, cpu_seconds: cpu_after - cpu_before })
}

/// The client's frames to the NodePort, one per flow: Ethernet to the first
/// node's uplink, IPv4, UDP (no checksum) with 18 bytes (a 60-byte frame).
fn frames(lab: &Lab, ext: &Pod) -> anyhow::Result<Vec<Vec<u8>>> {
    let mac = |text: String| -> anyhow::Result<[u8; 6]> {
        let bytes: Vec<u8> =
            text.trim().split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>()?;
        bytes.try_into().map_err(|_| anyhow::anyhow!("not a MAC: {text}"))
    };
    let node = mac(lab.exec_on(0, "cat", &["/sys/class/net/eth0/address"])?)?;
    let client =
        mac(sh("ip", &["netns", "exec", &ext.netns, "cat", "/sys/class/net/eth0/address"])?)?;
    let (src, dst): (std::net::Ipv4Addr, std::net::Ipv4Addr) = (EXT_IP.parse()?, NODE_IP.parse()?);
    Ok((0..FLOWS)
        .map(|i| {
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
            f.extend_from_slice(&(20_000 + i).to_be_bytes());
            f.extend_from_slice(&NODE_PORT.to_be_bytes());
            f.extend_from_slice(&26u16.to_be_bytes());
            f.extend_from_slice(&[0, 0]);
            f.extend_from_slice(&[0x5a; 18]);
            f
        })
        .collect())
}

/// Packets the pod's interface received.
fn rx_packets(pod: &Pod) -> anyhow::Result<u64> {
    let text = sh(
        "ip",
        &["netns", "exec", &pod.netns, "cat", "/sys/class/net/eth0/statistics/rx_packets"],
    )?;
    Ok(text.trim().parse()?)
}

/// The machine's CPU time so far (every state but idle and iowait).
fn cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat")?;
    let fields: Vec<u64> =
        line.split_whitespace().skip(1).map(str::parse).collect::<Result<_, _>>()?;
    let busy: u64 =
        fields.iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(busy as f64 / hz)
}

/// An `AF_PACKET` socket on the client's `eth0`, its frames past the qdisc.
struct Sender {
    fd: OwnedFd,
    ifindex: i32,
}

impl Sender {
    /// Opened from a thread in `netns` (the socket stays in it).
    fn open(netns: &str) -> anyhow::Result<Self> {
        let ns = std::fs::File::open(format!("/run/netns/{netns}"))?;
        std::thread::scope(|s| {
            s.spawn(|| -> anyhow::Result<Self> {
                // SAFETY: a namespace descriptor; only this thread moves.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    bail!("entering {netns}: {}", std::io::Error::last_os_error());
                }
                let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
                // SAFETY: plain socket calls.
                let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
                if fd < 0 {
                    bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
                }
                // SAFETY: the descriptor just made.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                let one: libc::c_int = 1;
                // SAFETY: an int option.
                unsafe {
                    libc::setsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_PACKET,
                        libc::PACKET_QDISC_BYPASS,
                        (&one as *const libc::c_int).cast(),
                        size_of::<libc::c_int>() as u32,
                    )
                };
                // SAFETY: a NUL-terminated name.
                let ifindex = unsafe { libc::if_nametoindex(c"eth0".as_ptr()) } as i32;
                if ifindex == 0 {
                    bail!("no eth0 in {netns}");
                }
                Ok(Sender { fd, ifindex })
            })
            .join()
            .unwrap_or_else(|_| bail!("the thread entering {netns} panicked"))
        })
    }

    fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        // SAFETY: plain data.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_ifindex = self.ifindex;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: the frame and address outlive the call.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&to as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if sent < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
    }
}
