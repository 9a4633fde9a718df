//! `cargo xtask bench`: what a Service costs, side by side, in one lab run
//! per size so machine noise cancels in the ratios.
//!
//! For N installed services (quick: 1, 1,000, 10,000; `--full` adds
//! 100,000), in eBPF and iptables mode:
//! - connection rate (wrk, HTTP with `Connection: close`, to nginx) from a
//!   client pod: straight to the pod with no agent at all (the baseline),
//!   straight to the pod with the agent and N services installed, through a
//!   ClusterIP (eBPF: from inside the socket-LB cgroup, and from outside it,
//!   per packet), and through a NodePort (policy Local: no SNAT) from an
//!   external client; the
//!   direct runs use another backend port than the service runs, so
//!   conntrack TIME_WAIT entries of one never meet the other; and what the
//!   same runs cost: CPU time of client and server per 10,000 connections
//!   (a cost, steadier than a rate on a loaded machine), as ratios to the
//!   baseline and, for the socket LB, to the direct run with the agent. Each
//!   round runs them all in turn, the baseline with the agent stopped and
//!   its datapath removed, so a change in the machine's load meets every
//!   kind alike; in eBPF mode two last direct runs per round have the pod
//!   interfaces' replies-only programs (as a node whose socket LB covers
//!   every pod has them), and no program on pod interfaces; in the
//!   dual-stack lab, beside the N IPv4 services N IPv6 ones: a direct IPv6
//!   connection and one through an IPv6 ClusterIP, as a ratio to it;
//! - programming time: N services × 10 endpoints listed from the test API
//!   server to the datapath serving, and the agent's first sync (iptables
//!   only while a size finishes within the limit, and not at the next size
//!   when one took more than a tenth of it: the next is ten times larger);
//! - the latency of one endpoint change (from the test API server) to the
//!   end of the sync that programs it, p50 and p99;
//! - the agent's peak RSS and the BPF maps' memory;
//! - the external path (eBPF mode, two nodes, once: `--external-only` runs
//!   it alone): an external client's connections to nginx in a pod on the
//!   second node, straight to the pod (routed via its node) and through
//!   the first node's NodePorts by SNAT, by DSR, and by DSR with Maglev
//!   (one service each, annotated, the same agents): rates and CPU per
//!   10,000 connections, as ratios to the direct run and DSR's to SNAT's;
//! - the per-packet program's nanoseconds per packet (`BPF_PROG_TEST_RUN`)
//!   at 2 and 100,000 services: a miss, new NodePort flows (random, Maglev,
//!   DSR) and ClusterIP flows, a tracked flow and a tracked DSR flow, and
//!   the ratios of each run (Maglev ÷ random, DSR ÷ SNAT).
//!
//! Results go to `target/bench/results.json`, a report and SVG plots next
//! to it; `--docs` copies them into docs/.

use std::{
    fmt::Write as _,
    path::Path,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use proxy_lab::{
    BIN_DIR_ENV, Lab, Mode, Pod, Setup, Source,
    bench_objects::{self, POD, SERVICE_PORT},
    sh,
};
use serde_json::{Value, json};

const OUT: &str = "target/bench";
/// nginx in the backend pod (`POD`): `SERVICE_PORT` behind the services,
/// this one for direct runs.
const DIRECT_PORT: u16 = 8081;
/// The dual-stack lab's IPv6 twin of `POD`, and the first of the IPv6
/// services (`manifest6`).
const POD6: &str = "fd00:244:1::2";
const VIP6: &str = "[fd00:96::a]:80";
/// Endpoint changes timed per size (fewer in iptables mode in the quick
/// profile: each rewrites the large top-level chains).
const CHANGES: usize = 100;
const QUICK_IPTABLES_CHANGES: usize = 20;
/// Programming runs give up after this long (the quick profile's budget is
/// ten minutes in all).
const LIMIT: Duration = Duration::from_secs(600);
const QUICK_IPTABLES_LIMIT: Duration = Duration::from_secs(60);

/// How long a programming run may take.
fn limit(mode: Mode, full: bool) -> Duration {
    if mode == Mode::Iptables && !full { QUICK_IPTABLES_LIMIT } else { LIMIT }
}

#[derive(clap::Args)]
pub struct Options {
    /// Add 100,000 services
    #[arg(long)]
    pub full: bool,
    /// Seconds per wrk run
    #[arg(long, default_value_t = 2)]
    pub seconds: u64,
    /// Rounds per measurement (the median is reported)
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Only these sizes (e.g. `--sizes 100000`), instead of the profile's
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// Only these modes
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["ebpf", "iptables"])]
    pub modes: Vec<crate::DemoMode>,
    /// Also copy the report and plots into docs/
    #[arg(long)]
    pub docs: bool,
    /// Only the programming runs (from the API server, and at the largest
    /// size from one JSON and one YAML file) and the change latency
    #[arg(long, conflicts_with = "external_only")]
    pub programming_only: bool,
    /// Only the external path: two nodes, an external client's connections
    /// straight to a pod and through NodePorts by SNAT, DSR and DSR with
    /// Maglev (eBPF mode)
    #[arg(long)]
    pub external_only: bool,
}

fn sizes(opts: &Options) -> Vec<usize> {
    match (opts.full, opts.sizes.is_empty()) {
        (_, false) => opts.sizes.clone(),
        (true, true) => vec![1, 1_000, 10_000, 100_000],
        (false, true) => vec![1, 1_000, 10_000],
    }
}

/// `n` IPv6-only ClusterIP services `v0..` from `fd00:96::a`, one endpoint
/// each: `v0`'s the backend pod's IPv6 address, the others' addresses
/// nothing answers.
fn manifest6(n: usize) -> String {
    let first = u128::from(std::net::Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0xa));
    let mut out = String::with_capacity(n * 600);
    for i in 0..n {
        let ip = std::net::Ipv6Addr::from(first + i as u128);
        let endpoint = match i {
            0 => POD6.to_string(),
            _ => std::net::Ipv6Addr::new(0xfd00, 0x128, 0, 0, 0, 0, (i >> 16) as u16, i as u16)
                .to_string(),
        };
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: v{i}, namespace: bench}}\nspec: {{clusterIP: '{ip}', clusterIPs: ['{ip}'], ipFamilies: [IPv6], ports: [{{name: http, port: 80, targetPort: {SERVICE_PORT}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: v{i}-1, namespace: bench, labels: {{kubernetes.io/service-name: v{i}}}}}\naddressType: IPv6\nports: [{{name: http, port: {SERVICE_PORT}}}]\nendpoints: [{{addresses: ['{endpoint}'], nodeName: lab-node}}]\n"
        );
    }
    out
}

/// [`bench_objects::objects`] as YAML documents, written directly (a
/// hundred thousand of them).
fn manifest(n: usize, endpoints: usize) -> String {
    let mut out = String::with_capacity(n * 600);
    for i in 0..n {
        let (ip, node_port) = bench_objects::service(i);
        let node_port_type =
            if node_port { ", type: NodePort, externalTrafficPolicy: Local" } else { "" };
        let np = if node_port { ", nodePort: 30080" } else { "" };
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: bench}}\nspec: {{clusterIP: {ip}{node_port_type}, ports: [{{name: http, port: 80, targetPort: {SERVICE_PORT}{np}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i}-1, namespace: bench, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\nports: [{{name: http, port: {SERVICE_PORT}}}]\nendpoints: ["
        );
        for e in 0..endpoints {
            let addr = bench_objects::endpoint(i, e, endpoints);
            let _ = write!(
                out,
                "{}{{addresses: [{addr}], nodeName: lab-node}}",
                if e > 0 { ", " } else { "" }
            );
        }
        out.push_str("]\n");
    }
    out
}

/// [`bench_objects::objects`] as one JSON `List` (what `kubectl get -o
/// json` writes).
fn manifest_json(n: usize, endpoints: usize) -> String {
    let items: Vec<Value> = bench_objects::objects(n, endpoints).collect();
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

/// A lab: nginx in a pod (one process, no master: stopping it leaves no
/// worker behind), two client pods (one for the runs through the
/// socket-LB cgroup and direct, one for the per-packet runs: a 4-tuple the
/// backend holds in TIME_WAIT after one kind of run would refuse the other
/// kind's SYN, as with any NAT), an external client that can also reach the
/// pod directly; client ports opened up.
fn lab(setup: Setup) -> anyhow::Result<(Lab, Pod, Pod, Pod)> {
    let mut lab = Lab::with(setup)?;
    lab.dual_stack()?;
    let web = lab.add_pod("web-0", POD)?;
    start_nginx(&mut lab, &web, &[SERVICE_PORT, DIRECT_PORT], true)?;
    let client = lab.add_pod("client", "10.244.1.100")?;
    let per_packet = lab.add_pod("client-pp", "10.244.1.101")?;
    let ext = lab.add_external("ext", "192.168.100.101")?;
    sh("ip", &["-n", &ext.netns, "route", "add", "10.244.1.0/24", "via", "192.168.100.11"])?;
    for netns in [&client.netns, &per_packet.netns, &ext.netns] {
        open_client_ports(netns)?;
    }
    wait_answering(&lab, &client, &format!("{POD}:{DIRECT_PORT}"))?;
    Ok((lab, client, per_packet, ext))
}

/// nginx in `pod` on `ports` (and on IPv6 too with `ipv6`): one process, no
/// master (stopping it leaves no worker behind), no access log, no
/// keep-alive; its pid in the lab's `nginx.pid`, where [`rate`] reads it.
/// One per lab.
fn start_nginx(lab: &mut Lab, pod: &Pod, ports: &[u16], ipv6: bool) -> anyhow::Result<()> {
    let mut listen = String::new();
    for port in ports {
        let _ = write!(listen, "listen {port} reuseport; ");
    }
    if ipv6 {
        for port in ports {
            let _ = write!(listen, "listen [::]:{port} reuseport; ");
        }
    }
    let conf = lab.dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off; master_process off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/nginx.log;\nevents {{ worker_connections 4096; }}\nhttp {{ access_log off; keepalive_timeout 0;\n  server {{ {listen}location / {{ return 200 \"ok\\n\"; }} }} }}\n",
            dir = lab.dir.display()
        ),
    )?;
    lab.spawn_in(&pod.netns, "nginx", &["-c", &conf.to_string_lossy()])?;
    Ok(())
}

/// A client namespace's ephemeral ports widened and TIME_WAIT reuse on, so
/// runs of thousands of short connections do not run out of ports.
fn open_client_ports(netns: &str) -> anyhow::Result<()> {
    sh(
        "ip",
        &["netns", "exec", netns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"],
    )?;
    sh("ip", &["netns", "exec", netns, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    Ok(())
}

/// Waits (5 s at most) until nginx answers `client` at `addr`.
fn wait_answering(lab: &Lab, client: &Pod, addr: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while lab.client_outside(client).http_body(addr, "/").is_err() {
        anyhow::ensure!(Instant::now() < deadline, "nginx did not answer at {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// One wrk run: connections per second, and the CPU they cost.
#[derive(Clone, Copy)]
struct Run {
    per_s: f64,
    /// CPU time of client (wrk) and server (nginx) per 10,000 connections,
    /// in ms: user, system, and the softirq work done in their context
    /// (most of the network stack's, veth included). A cost, where a rate
    /// swings with the machine's load.
    cpu_ms_per_10k: f64,
}

/// The CPU seconds of this process's reaped children (each wrk run).
fn children_cpu_s() -> f64 {
    // SAFETY: plain out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// The CPU seconds process `pid` used so far (utime + stime of
/// /proc/PID/stat); 0 when it cannot be read.
fn process_cpu_s(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and
    // stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: f64 =
        rest.split_whitespace().skip(11).take(2).filter_map(|t| t.parse::<f64>().ok()).sum();
    // SAFETY: no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// A wrk run to `addr` from `client`: its rate and CPU cost.
fn rate(lab: &Lab, client: &Pod, in_cgroup: bool, addr: &str, seconds: u64) -> anyhow::Result<Run> {
    let url = format!("http://{addr}/");
    let duration = format!("{seconds}s");
    let args = ["-t1", "-c8", "-d", &duration, "-H", "Connection: close", &url];
    let cgroup = in_cgroup.then_some(lab.cgroup.as_path());
    let nginx = std::fs::read_to_string(lab.dir.join("nginx.pid")).unwrap_or_default();
    let cpu_before = children_cpu_s() + process_cpu_s(&nginx);
    let out = lab.run_in(&client.netns, cgroup, "wrk", &args)?;
    let cpu = children_cpu_s() + process_cpu_s(&nginx) - cpu_before;
    let per_s = out
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:")?.trim().parse().ok())
        .with_context(|| format!("no rate from wrk:\n{out}"))?;
    let requests: f64 = out
        .lines()
        .find_map(|l| l.trim().split_once(" requests in ")?.0.parse().ok())
        .with_context(|| format!("no request count from wrk:\n{out}"))?;
    if let Some(errors) = out.lines().find(|l| l.contains("Socket errors") || l.contains("Non-2xx"))
    {
        eprintln!("  wrk to {addr}: {}", errors.trim());
    }
    Ok(Run { per_s, cpu_ms_per_10k: cpu * 1000.0 * 10_000.0 / requests.max(1.0) })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Peak RSS (VmHWM) of a process, in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse::<f64>().ok()
            })
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// The memory the node's pinned maps lock, in MiB (bpftool's memlock).
fn map_memory_mib(lab: &Lab) -> f64 {
    let Ok(entries) = std::fs::read_dir(lab.pins.join("maps")) else { return 0.0 };
    entries
        .flatten()
        .filter_map(|e| {
            sh("bpftool", &["-j", "map", "show", "pinned", &e.path().to_string_lossy()]).ok()
        })
        .filter_map(|out| serde_json::from_str::<Value>(&out).ok()?["bytes_memlock"].as_f64())
        .sum::<f64>()
        / (1024.0 * 1024.0)
}

/// The first sample of `name` (which may include labels).
pub(crate) fn metric(lab: &Lab, name: &str) -> anyhow::Result<f64> {
    let metrics = lab.metrics()?;
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .with_context(|| format!("{name} missing"))
}

/// Connection rates at size `n` in `mode`, `rounds` alternating rounds.
/// Each round starts with the baseline (no agent, its datapath cleaned up)
/// and then starts the agent for the other runs, so a change in the
/// machine's load meets every kind of run alike.
fn connection_rates(mode: Mode, n: usize, opts: &Options) -> anyhow::Result<Value> {
    let (mut lab, client, per_packet, ext) = lab(Setup { mode, source: Source::Manifests })?;
    let s = opts.seconds;
    let direct = format!("{POD}:{DIRECT_PORT}");
    rate(&lab, &client, false, &direct, 1)?;
    lab.write_manifest(&(manifest(n, 1) + &manifest6(n)))?;
    let vip = "10.96.0.10:80";
    let direct6 = format!("[{POD6}]:{DIRECT_PORT}");
    let node_port = "192.168.100.11:30080";
    let (mut baseline, mut direct_replies, mut direct_no_pod_programs) =
        (Vec::<Run>::new(), Vec::new(), Vec::new());
    let mut runs: Vec<(&str, Vec<Run>)> = vec![
        ("direct", vec![]),
        ("vip", vec![]),
        ("node_port", vec![]),
        ("direct6", vec![]),
        ("vip6", vec![]),
    ];
    if mode == Mode::Ebpf {
        runs.push(("vip_per_packet", vec![]));
    }
    for round in 0..opts.rounds {
        baseline.push(rate(&lab, &client, false, &direct, s)?);
        // The defaults: the maps size themselves.
        if let Err(e) = lab.start_agent_within(0, &[], LIMIT) {
            anyhow::ensure!(round == 0, "the agent did not start again: {e:#}");
            let result = json!({"mode": mode.as_arg(), "services": n, "failed": format!("{e:#}")});
            eprintln!("  {result}");
            return Ok(result);
        }
        for (name, values) in runs.iter_mut() {
            let r = match *name {
                "direct" => rate(&lab, &client, false, &direct, s)?,
                // In eBPF mode from the socket-LB cgroup; in iptables mode
                // the cgroup changes nothing.
                "vip" => rate(&lab, &client, true, vip, s)?,
                "vip_per_packet" => rate(&lab, &per_packet, false, vip, s)?,
                "direct6" => rate(&lab, &client, false, &direct6, s)?,
                "vip6" => rate(&lab, &client, true, VIP6, s)?,
                _ => rate(&lab, &ext, false, node_port, s)?,
            };
            values.push(r);
        }
        if mode == Mode::Ebpf {
            // Pod interfaces as on a node whose socket LB covers every pod
            // (its default): the replies program at their ingress only; and,
            // to tell the programs' share from the rest of the agent's, none.
            for (flags, runs) in [
                (["--pod-interface-programs", "replies"], &mut direct_replies),
                (["--pod-interfaces", ""], &mut direct_no_pod_programs),
            ] {
                lab.stop_agent_on(0);
                lab.start_agent_within(0, &flags, LIMIT)?;
                runs.push(rate(&lab, &client, false, &direct, s)?);
            }
        }
        if round + 1 < opts.rounds {
            stop_and_clean(&mut lab)?;
        }
    }
    if mode == Mode::Ebpf {
        runs.push(("direct_replies_only", direct_replies));
        runs.push(("direct_no_pod_programs", direct_no_pod_programs));
    }
    let baseline_cpu = median(baseline.iter().map(|r| r.cpu_ms_per_10k).collect());
    let baseline = median(baseline.iter().map(|r| r.per_s).collect());
    let mut result = json!({
        "mode": mode.as_arg(),
        "services": n,
        "baseline_per_s": baseline,
        "baseline_cpu_ms_per_10k": baseline_cpu,
        "agent_peak_rss_mib": lab.agent_pid_on(0).map_or(f64::NAN, peak_rss_mib),
        "map_memory_mib": map_memory_mib(&lab),
    });
    for (name, values) in runs {
        let m = median(values.iter().map(|r| r.per_s).collect());
        result[format!("{name}_per_s")] = json!(m);
        result[format!("{name}_ratio")] = json!(m / baseline);
        let cpu = median(values.iter().map(|r| r.cpu_ms_per_10k).collect());
        result[format!("{name}_cpu_ms_per_10k")] = json!(cpu);
        result[format!("{name}_cpu_ratio")] = json!(cpu / baseline_cpu);
    }
    // The socket LB's cost over a direct connection, both with the agent;
    // and an IPv6 ClusterIP's over a direct IPv6 connection.
    for (vip, direct, key) in
        [("vip", "direct", "vip_cpu_vs_direct"), ("vip6", "direct6", "vip6_cpu_vs_direct6")]
    {
        let cpu = |name: &str| result[format!("{name}_cpu_ms_per_10k")].as_f64();
        if let (Some(through), Some(straight)) = (cpu(vip), cpu(direct)) {
            result[key] = json!(through / straight);
        }
        let rate = |name: &str| result[format!("{name}_per_s")].as_f64();
        if let (Some(through), Some(straight)) = (rate(vip), rate(direct)) {
            result[format!("{vip}_rate_vs_{direct}")] = json!(through / straight);
        }
    }
    eprintln!("  {}", result);
    Ok(result)
}

/// The external path's backend pod, on the second node, and the external
/// client.
const EXTERNAL_POD: &str = "10.244.2.2";
const EXTERNAL_CLIENT: &str = "192.168.100.101";
const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The external path's rounds at most (each has ports of its own).
const EXTERNAL_MAX_ROUNDS: usize = 9;

/// One kind of external run: its name in the results, whether it goes
/// through a NodePort of the first node (or straight to the pod's
/// address), and the annotations of its services.
struct ExternalKind {
    name: &'static str,
    node_port: bool,
    annotations: &'static [(&'static str, &'static str)],
}

const FORWARDING: &str = "proxy-agent.io/forwarding-mode";
const EXTERNAL_KINDS: [ExternalKind; 4] = [
    ExternalKind { name: "direct", node_port: false, annotations: &[] },
    ExternalKind { name: "snat", node_port: true, annotations: &[(FORWARDING, "snat")] },
    ExternalKind { name: "dsr", node_port: true, annotations: &[(FORWARDING, "dsr")] },
    ExternalKind {
        name: "maglev_dsr",
        node_port: true,
        annotations: &[(FORWARDING, "dsr"), ("proxy-agent.io/lb-algorithm", "maglev")],
    },
];

/// The pod's port and the NodePort of kind `kind` (an index into
/// [`EXTERNAL_KINDS`]) in round `round` (0: the warm-up). Every run has
/// ports of its own, so no run meets the 4-tuples another left behind:
/// in the pod (TIME_WAIT, the same client address and ports for the
/// direct and DSR runs), in the first node's SNAT ports (a closed flow's
/// port rests 60 s: one backend address and port takes about 1,000 new
/// SNAT flows a second for long) and in the DSR flows the second node
/// learnt (see docs/benchmarks.md).
fn external_ports(round: usize, kind: usize) -> (u16, u16) {
    let offset = (10 * round + kind) as u16;
    (8080 + offset, 30080 + offset)
}

/// The external path's NodePort services (policy Cluster): one per kind
/// but the direct one and round, each with the pod on the second node as
/// its only endpoint.
fn external_manifest(rounds: usize) -> String {
    let mut out = String::new();
    for round in 0..=rounds {
        for (k, kind) in EXTERNAL_KINDS.iter().enumerate().filter(|(_, kind)| kind.node_port) {
            let (port, node_port) = external_ports(round, k);
            let annotations: Vec<String> =
                kind.annotations.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let _ = write!(
                out,
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: bench, annotations: {{{annotations}}}}}\nspec: {{clusterIP: 10.96.1.{ip}, type: NodePort, ports: [{{name: http, port: 80, targetPort: {port}, nodePort: {node_port}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: bench, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: {port}}}]\nendpoints: [{{addresses: [{EXTERNAL_POD}], nodeName: lab-node2}}]\n",
                name = format!("{}-{round}", kind.name.replace('_', "-")),
                annotations = annotations.join(", "),
                ip = 10 * round + k + 1,
            );
        }
    }
    out
}

/// The addresses the pod's TIME_WAIT sockets on `port` name as their
/// peer: who the pod saw connecting (the server closes first).
fn pod_peers(lab: &Lab, pod: &Pod, port: u16) -> anyhow::Result<Vec<String>> {
    let sport = format!(":{port}");
    let out =
        lab.run_in(&pod.netns, None, "ss", &["-Htn", "state", "time-wait", "sport", "=", &sport])?;
    let mut peers: Vec<String> = out
        .lines()
        .filter_map(|l| Some(l.split_whitespace().last()?.rsplit_once(':')?.0.to_string()))
        .collect();
    peers.sort();
    peers.dedup();
    Ok(peers)
}

/// The external path on two nodes (eBPF mode): an external client's
/// connections (wrk, `Connection: close`) to nginx in a pod on the second
/// node, straight to the pod's address (routed via that node), and through
/// the first node's NodePorts: SNAT, DSR, and DSR with Maglev, all served
/// by the same agents (a service annotation each), in `rounds` rounds that
/// take the kinds in turn (each round starting one further along), the
/// median of each. A warm-up run of each kind checks first that each path
/// is what it claims: the pod sees the client's address directly and with
/// DSR, the first node's with SNAT.
fn external_path(opts: &Options) -> anyhow::Result<Value> {
    anyhow::ensure!(
        opts.rounds <= EXTERNAL_MAX_ROUNDS,
        "the external path takes {EXTERNAL_MAX_ROUNDS} rounds at most"
    );
    let mut lab = Lab::with(Setup { mode: Mode::Ebpf, source: Source::Manifests })?;
    let node2 = lab.add_node()?;
    let web = lab.add_pod_on(node2, "web-0", EXTERNAL_POD)?;
    let ports: Vec<u16> = (0..=opts.rounds)
        .flat_map(|round| (0..EXTERNAL_KINDS.len()).map(move |k| external_ports(round, k).0))
        .collect();
    start_nginx(&mut lab, &web, &ports, false)?;
    let ext = lab.add_external("ext", EXTERNAL_CLIENT)?;
    open_client_ports(&ext.netns)?;
    // The direct runs cross the second node only, as its forwarding.
    let (node1_ip, node2_ip) = (lab.nodes()[0].ip.clone(), lab.nodes()[node2].ip.clone());
    let pod_cidr = lab.nodes()[node2].pod_cidr.clone();
    sh("ip", &["-n", &ext.netns, "route", "add", &pod_cidr, "via", &node2_ip])?;
    lab.write_manifest(&external_manifest(opts.rounds))?;
    for node in 0..lab.nodes().len() {
        lab.drop_invalid_forwards(node)?;
        lab.start_agent_on(node, &["--cluster-cidr", CLUSTER_CIDR])?;
    }
    let addr = |round: usize, k: usize| {
        let (port, node_port) = external_ports(round, k);
        match EXTERNAL_KINDS[k].node_port {
            true => format!("{node1_ip}:{node_port}"),
            false => format!("{EXTERNAL_POD}:{port}"),
        }
    };
    for (k, kind) in EXTERNAL_KINDS.iter().enumerate() {
        wait_answering(&lab, &ext, &addr(0, k))?;
        rate(&lab, &ext, false, &addr(0, k), 1)?;
        let expected = if kind.name == "snat" { &node1_ip } else { &ext.ip };
        let peers = pod_peers(&lab, &web, external_ports(0, k).0)?;
        anyhow::ensure!(
            peers == [expected.clone()],
            "{}: the pod saw {peers:?}, not {expected}",
            kind.name
        );
    }
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); EXTERNAL_KINDS.len()];
    for round in 1..=opts.rounds {
        for i in 0..EXTERNAL_KINDS.len() {
            let k = (round + i) % EXTERNAL_KINDS.len();
            runs[k].push(rate(&lab, &ext, false, &addr(round, k), opts.seconds)?);
        }
    }
    let mut result = json!({"rounds": opts.rounds, "seconds": opts.seconds});
    for (kind, values) in EXTERNAL_KINDS.iter().zip(&runs) {
        let name = kind.name;
        result[format!("{name}_per_s")] = json!(median(values.iter().map(|r| r.per_s).collect()));
        result[format!("{name}_cpu_ms_per_10k")] =
            json!(median(values.iter().map(|r| r.cpu_ms_per_10k).collect()));
        result[format!("{name}_runs")] =
            json!(values.iter().map(|r| [r.per_s, r.cpu_ms_per_10k]).collect::<Vec<_>>());
    }
    let figure = |name: &str, what: &str| result[format!("{name}_{what}")].as_f64();
    let mut ratios = Vec::new();
    for (of, to) in [
        ("snat", "direct"),
        ("dsr", "direct"),
        ("maglev_dsr", "direct"),
        ("dsr", "snat"),
        ("maglev_dsr", "dsr"),
    ] {
        for (what, key) in [("per_s", "rate"), ("cpu_ms_per_10k", "cpu")] {
            if let (Some(a), Some(b)) = (figure(of, what), figure(to, what)) {
                ratios.push((format!("{of}_{key}_vs_{to}"), a / b));
            }
        }
    }
    for (key, value) in ratios {
        result[key] = json!(value);
    }
    eprintln!("  {result}");
    Ok(result)
}

/// Stops the agent and removes its datapath (which outlives it by design),
/// leaving the lab as it was before the agent started.
fn stop_and_clean(lab: &mut Lab) -> anyhow::Result<()> {
    lab.stop_agent_on(0);
    lab.cleanup_on(0).context("cleanup between rounds")?;
    Ok(())
}

/// From starting the agent on N services × 10 endpoints (listed from the
/// test API server, as from a cluster's) to its datapath serving; and its
/// first sync.
fn programming(mode: Mode, n: usize, full: bool) -> anyhow::Result<Value> {
    programming_with(mode, Feed::ApiServer, n, full, &[])
}

/// Where a programming run's services come from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Feed {
    ApiServer,
    /// One manifest file (`--manifests`), 2 endpoints per service.
    Json,
    Yaml,
}

impl Feed {
    fn name(self) -> &'static str {
        match self {
            Feed::ApiServer => "API server",
            Feed::Json => "one JSON file",
            Feed::Yaml => "one YAML file",
        }
    }

    fn endpoints(self) -> usize {
        if self == Feed::ApiServer { 10 } else { 2 }
    }
}

/// `programming` with more agent flags.
fn programming_with(
    mode: Mode,
    feed: Feed,
    n: usize,
    full: bool,
    extra: &[&str],
) -> anyhow::Result<Value> {
    let source = if feed == Feed::ApiServer { Source::ApiServer } else { Source::Manifests };
    let mut lab = Lab::with(Setup { mode, source })?;
    match feed {
        // The file, and the test API server fed the same.
        Feed::ApiServer | Feed::Yaml => drop(lab.write_manifest(&manifest(n, feed.endpoints()))?),
        Feed::Json => {
            lab.use_manifest_dir()?;
            lab.write_manifest_file(
                "services.json",
                manifest_json(n, feed.endpoints()).as_bytes(),
            )?;
        }
    }
    let start = Instant::now();
    lab.spawn_agent_on(0, extra)?;
    let limit = limit(mode, full);
    let mut listed = None;
    let outcome = loop {
        let log = lab.agent_log();
        if listed.is_none() && log.contains("source read whole") {
            listed = Some(start.elapsed().as_secs_f64());
        }
        if log.contains("datapath ready; serving") {
            break None;
        }
        if let Some(line) = log.lines().find(|l| l.contains("sync failed") || l.contains("ERROR")) {
            break Some(line.to_string());
        }
        if start.elapsed() > limit {
            break Some(format!("not serving after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let serving = start.elapsed().as_secs_f64();
    let mut result = json!({"mode": mode.as_arg(), "source": feed.name(), "services": n, "endpoints": n * feed.endpoints()});
    match outcome {
        None => {
            result["to_serving_s"] = json!(serving);
            result["listed_s"] = json!(listed.unwrap_or(f64::NAN));
            let first_sync = metric(&lab, "kubeproxy_sync_proxy_rules_duration_seconds_sum");
            if let Err(e) = &first_sync {
                eprintln!("  no sync duration: {e:#}");
            }
            result["first_sync_s"] = json!(first_sync.unwrap_or(f64::NAN));
            result["agent_peak_rss_mib"] =
                json!(lab.agent_pid_on(0).map_or(f64::NAN, peak_rss_mib));
            result["map_memory_mib"] = json!(map_memory_mib(&lab));
        }
        Some(why) => result["failed"] = json!(why),
    }
    eprintln!("  {}", result);
    Ok(result)
}

/// One endpoint change at a time through the test API server, `CHANGES`
/// times: from the change to the end of the sync that programmed it.
fn change_latency(mode: Mode, n: usize, full: bool) -> anyhow::Result<Value> {
    let changes = if mode == Mode::Iptables && !full { QUICK_IPTABLES_CHANGES } else { CHANGES };
    let mut lab = Lab::with(Setup { mode, source: Source::ApiServer })?;
    lab.write_manifest(&manifest(n, 10))?;
    lab.start_agent_within(0, &["--min-sync-period", "0s"], LIMIT)?;
    let api = lab.api().context("API server")?;
    let mut latencies = Vec::with_capacity(changes);
    for i in 0..changes {
        let endpoint = format!("10.127.{}.{}", i / 250, i % 250 + 1);
        let slice = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s0-1, namespace: bench, labels: {{kubernetes.io/service-name: s0}}}}\naddressType: IPv4\nports: [{{name: http, port: {SERVICE_PORT}}}]\nendpoints: [{{addresses: [{POD}]}}, {{addresses: [{endpoint}]}}]\n"
        );
        let before = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?.as_secs_f64();
        api.apply(&slice)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = metric(&lab, "kubeproxy_sync_proxy_rules_last_timestamp_seconds")?;
            if synced > before {
                latencies.push(synced - before);
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "change {i} was not synced");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)] * 1000.0
    };
    let result = json!({
        "mode": mode.as_arg(), "services": n, "changes": changes, "p50_ms": at(0.5), "p99_ms": at(0.99),
    });
    eprintln!("  {}", result);
    Ok(result)
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    // SAFETY: single-threaded here; the lab reads it when starting binaries.
    unsafe { std::env::set_var(BIN_DIR_ENV, "target/release") };
    std::fs::create_dir_all(OUT)?;
    let started = Instant::now();
    let modes: Vec<Mode> = opts.modes.iter().map(|m| m.lab()).collect();
    let mut results = json!({
        "command": command(&opts),
        "machine": machine(),
        "connection_rates": [], "programming": [], "change_latency": [], "per_packet": [],
        "external_path": [],
    });
    if opts.external_only {
        eprintln!("external path: ebpf mode, two nodes");
        push(&mut results, "external_path", external_path(&opts)?);
        return report(results, started, &opts);
    }
    // Programming first: a mode's connection rates at N services of one
    // endpoint are not measured where it could not program N/10 services
    // of ten (as many rules) within the limit.
    let mut too_big: Vec<(Mode, usize)> = Vec::new();
    for &mode in &modes {
        let limit = limit(mode, opts.full);
        let mut sizes = sizes(&opts).into_iter();
        for n in sizes.by_ref() {
            eprintln!("programming: {} mode, {n} services x 10 endpoints", mode.as_arg());
            let result = programming(mode, n, opts.full)?;
            let took = result["to_serving_s"].as_f64();
            push(&mut results, "programming", result);
            let Some(took) = took else {
                too_big.push((mode, n));
                break;
            };
            eprintln!("change latency: {} mode, {n} services", mode.as_arg());
            push(&mut results, "change_latency", change_latency(mode, n, opts.full)?);
            if took > limit.as_secs_f64() / 10.0 {
                eprintln!("  {took:.0} s: a larger size would not finish within {limit:?}");
                too_big.extend(sizes.next().map(|next| (mode, next)));
                break;
            }
        }
    }
    // The largest size from one manifest file, each format (eBPF: the
    // iptables mode's programming is measured above).
    if modes.contains(&Mode::Ebpf)
        && let Some(&n) = sizes(&opts).iter().max()
    {
        for feed in [Feed::Json, Feed::Yaml] {
            eprintln!("programming: ebpf mode, {n} services x 2 endpoints from {}", feed.name());
            push(
                &mut results,
                "programming",
                programming_with(Mode::Ebpf, feed, n, opts.full, &[])?,
            );
        }
    }
    if opts.programming_only {
        return report(results, started, &opts);
    }
    for &mode in &modes {
        for n in sizes(&opts) {
            if too_big.iter().any(|(m, big)| *m == mode && n / 10 >= *big) {
                eprintln!("connection rates: {} mode, {n} services: skipped", mode.as_arg());
                continue;
            }
            eprintln!("connection rates: {} mode, {n} services", mode.as_arg());
            push(&mut results, "connection_rates", connection_rates(mode, n, &opts)?);
        }
    }
    if modes.contains(&Mode::Ebpf) {
        eprintln!("external path: ebpf mode, two nodes");
        push(&mut results, "external_path", external_path(&opts)?);
    }
    // The per-packet program at 2 services (NodePorts: random, Maglev and
    // DSR; and a ClusterIP) and at 100,000.
    build_packet_bench()?;
    // Alternating rounds, the median of each figure: one run is noisy.
    let mut runs: Vec<(usize, Vec<Value>)> = vec![(2, vec![]), (100_000, vec![])];
    for _ in 0..opts.rounds {
        for (n, values) in runs.iter_mut() {
            eprintln!("per-packet program: {n} services");
            values.push(per_packet(PACKET_BENCH, &[], *n)?);
        }
    }
    for (n, values) in runs {
        push(&mut results, "per_packet", medians(n, &values));
    }
    report(results, started, &opts)
}

/// Writes the results, the report and the plots (and into docs/ with
/// `--docs`), and prints the report.
fn report(mut results: Value, started: Instant, opts: &Options) -> anyhow::Result<()> {
    results["duration_s"] = json!(started.elapsed().as_secs_f64());
    std::fs::write(Path::new(OUT).join("results.json"), serde_json::to_string_pretty(&results)?)?;
    let report = crate::report::markdown(&results);
    std::fs::write(Path::new(OUT).join("report.md"), &report)?;
    crate::report::plots(&results, Path::new(OUT))?;
    println!("{report}");
    if opts.docs {
        crate::report::to_docs(Path::new(OUT))?;
    }
    Ok(())
}

/// The iptables mode's programming time with each iptables implementation
/// (`--iptables-backend nft` and `legacy`) at `sizes` (1,000 and 10,000 by
/// default) × 10 endpoints; prints a table and writes
/// target/bench/iptables-backends.json.
pub fn iptables_backends(sizes: &[usize], full: bool) -> anyhow::Result<()> {
    let sizes = if sizes.is_empty() { &[1_000, 10_000][..] } else { sizes };
    let mut results = Vec::new();
    let mut table = String::from(
        "| services × 10 endpoints | backend | to serving (s) | first sync (s) |\n|---|---|---|---|\n",
    );
    for &n in sizes {
        for backend in ["nft", "legacy"] {
            eprintln!("programming: iptables-{backend}, {n} services x 10 endpoints");
            let flags = ["--iptables-backend", backend];
            let mut result = programming_with(Mode::Iptables, Feed::ApiServer, n, full, &flags)?;
            result["backend"] = json!(backend);
            let secs = |key: &str| {
                result[key]
                    .as_f64()
                    .map_or_else(|| "not serving".to_string(), |s| format!("{s:.2}"))
            };
            let _ = writeln!(
                table,
                "| {n} | {backend} | {} | {} |",
                secs("to_serving_s"),
                secs("first_sync_s")
            );
            results.push(result);
        }
    }
    std::fs::create_dir_all(OUT)?;
    let json = serde_json::to_string_pretty(&results)?;
    std::fs::write(Path::new(OUT).join("iptables-backends.json"), json)?;
    println!("{table}");
    Ok(())
}

const PACKET_BENCH: &str = "target/release/examples/packet_bench";
/// The figures `packet_bench` prints, and `tracked_net`: a tracked packet
/// less `run_overhead` (what one run costs beside the program, which the
/// figures of one run per packet pay and the misses, over 1M repeats, not).
const PER_PACKET: [&str; 11] = [
    "miss_ns",
    "socket_lb_reply_ns",
    "ipv6_miss_ns",
    "node_port_new_ns",
    "node_port_new_maglev_ns",
    "node_port_new_dsr_ns",
    "cluster_ip_new_ns",
    "tracked_ns",
    "tracked_dsr_ns",
    "run_overhead_ns",
    "tracked_net_ns",
];
/// Ratios within one `packet_bench` run (its figures measured a moment
/// apart, so the machine's load changes them less than it does figures of
/// different runs): a new NodePort flow picked from a Maglev table over a
/// random pick, a new DSR flow over a new SNAT flow, and a tracked DSR
/// packet over a tracked SNAT packet; each as `(name, numerator,
/// denominator)`.
const PER_PACKET_RATIOS: [(&str, &str, &str); 3] = [
    ("maglev_vs_random", "node_port_new_maglev_ns", "node_port_new_ns"),
    ("dsr_vs_snat_new", "node_port_new_dsr_ns", "node_port_new_ns"),
    ("dsr_vs_snat_tracked", "tracked_dsr_ns", "tracked_ns"),
];

fn build_packet_bench() -> anyhow::Result<()> {
    crate::cargo(&[
        "build",
        "--quiet",
        "--release",
        "-p",
        "proxy-agent",
        "--example",
        "packet_bench",
    ])
}

/// The median of each figure over `values` (runs at `n` services).
fn medians(n: usize, values: &[Value]) -> Value {
    let mut result = json!({"services": n, "rounds": values.len()});
    let keys = PER_PACKET.into_iter().chain(PER_PACKET_RATIOS.map(|(name, _, _)| name));
    for key in keys {
        result[key] = json!(median(values.iter().filter_map(|v| v[key].as_f64()).collect()));
    }
    result
}

/// A `packet_bench` binary and its extra arguments.
type BenchRun<'a> = (&'a str, &'a [&'a str]);

/// What `packet-bench` compares with this tree's `packet_bench`.
pub enum Builds<'a> {
    /// Another build's (`--base BIN`).
    Base(&'a Path),
    /// This tree's with the monitor's events on (`--monitor`); the base
    /// has them off.
    Monitor,
}

/// `cargo xtask packet-bench --base BIN | --monitor`: two `packet_bench`
/// runs (this tree's and another build's, e.g. one built from main and
/// kept aside; or this tree's, monitor off and on), alternately on the
/// same machine, `rounds` times at each size (who goes first alternates
/// too); prints the medians and their ratios.
pub fn packet_ab(builds: Builds, sizes: &[usize], rounds: usize) -> anyhow::Result<()> {
    build_packet_bench()?;
    let (base, this): (BenchRun, BenchRun) = match builds {
        Builds::Base(base) => {
            ((base.to_str().context("--base: not UTF-8")?, &[]), (PACKET_BENCH, &[]))
        }
        Builds::Monitor => ((PACKET_BENCH, &[]), (PACKET_BENCH, &["--monitor"])),
    };
    let sizes = if sizes.is_empty() { &[2, 100_000][..] } else { sizes };
    let this_name = if this.1.is_empty() { "this tree" } else { "monitor on" };
    println!("| services | figure | base ns | {this_name} ns | ratio |");
    println!("|---|---|---|---|---|");
    for &n in sizes {
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            eprintln!("per-packet program: {n} services, round {}", round + 1);
            let mut pair = [(base, &mut before), (this, &mut after)];
            if round % 2 == 1 {
                pair.reverse();
            }
            for ((bin, extra), values) in pair {
                values.push(per_packet(bin, extra, n)?);
            }
        }
        let (before, after) = (medians(n, &before), medians(n, &after));
        for key in PER_PACKET {
            if let (Some(b), Some(a)) = (before[key].as_f64(), after[key].as_f64()) {
                let name = key.trim_end_matches("_ns");
                println!("| {n} | {name} | {b:.0} | {a:.0} | {:.2}x |", a / b);
            }
        }
    }
    Ok(())
}

/// `packet_bench --services n` (and `extra`) of the build `bin`:
/// nanoseconds per packet by path, from its `name ns` lines.
fn per_packet(bin: &str, extra: &[&str], n: usize) -> anyhow::Result<Value> {
    let n_text = n.to_string();
    let args: Vec<&str> =
        ["--services", &n_text].into_iter().chain(extra.iter().copied()).collect();
    let out = sh(bin, &args)?;
    let mut result = json!({"services": n});
    for line in out.lines() {
        let mut words = line.split_whitespace();
        if let (Some(name), Some(Ok(ns))) = (words.next(), words.next().map(str::parse::<f64>)) {
            result[format!("{name}_ns")] = json!(ns);
        }
    }
    if let (Some(tracked), Some(overhead)) =
        (result["tracked_ns"].as_f64(), result["run_overhead_ns"].as_f64())
    {
        result["tracked_net_ns"] = json!(tracked - overhead);
    }
    for (name, of, to) in PER_PACKET_RATIOS {
        if let (Some(a), Some(b)) = (result[of].as_f64(), result[to].as_f64()) {
            result[name] = json!(a / b);
        }
    }
    eprintln!("  {result}");
    Ok(result)
}

/// The command line that made the results, as far as it changes them.
fn command(opts: &Options) -> String {
    let mut command = String::from("cargo xtask bench");
    for (set, flag) in [(opts.full, " --full"), (opts.external_only, " --external-only")] {
        if set {
            command.push_str(flag);
        }
    }
    if opts.external_only || opts.rounds != 3 || opts.seconds != 2 {
        let _ = write!(command, " --rounds {} --seconds {}", opts.rounds, opts.seconds);
    }
    command
}

fn push(results: &mut Value, key: &str, value: Value) {
    if let Some(list) = results[key].as_array_mut() {
        list.push(value);
    }
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = sh("uname", &["-r"]).unwrap_or_default();
    format!("Linux {}, {cpus} CPUs", kernel.trim())
}
