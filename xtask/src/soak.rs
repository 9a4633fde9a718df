//! `cargo xtask soak --minutes N`: the agent under steady churn for a
//! while, to show what grows.
//!
//! One lab node, the test API server as the source. A stable service (two
//! pods) carries TCP connections from a client pod through the socket path
//! and from an external client through its NodePort (per packet: conntrack
//! entries), while `--rate` changes a second create, change the endpoints
//! of and delete fifty other services in turn. After a warm-up, and every
//! ten seconds until the end, the agent's RSS, open fds and CPU, the maps'
//! entries and the conntrack entries are sampled; at the end every
//! connection to the stable service must have succeeded.
//!
//! Results go to `target/soak/results.json`, a table to stdout.

use std::{
    fmt::Write as _,
    path::Path,
    process::{Child, Output},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use proxy_lab::{Attempt, BIN_DIR_ENV, Lab, Mode, Request, Setup, Source};
use serde_json::{Value, json};

const OUT: &str = "target/soak";
/// Services the churn creates, changes and deletes in turn.
const CHURNED: usize = 50;
/// The stable service's clients make a connection this often.
const CLIENT_INTERVAL_MS: u64 = 20;
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

pub struct Options {
    pub minutes: u64,
    pub mode: Mode,
    /// Changes a second.
    pub rate: u32,
    pub warm_up: Duration,
}

/// One sample of the agent and its datapath.
struct Sample {
    at_s: f64,
    rss_mib: f64,
    fds: usize,
    /// utime + stime, in seconds.
    cpu_s: f64,
    map_entries: Value,
    /// The per-packet conntrack map (eBPF) and the node's netfilter table.
    bpf_conntrack: f64,
    nf_conntrack: f64,
}

impl Sample {
    fn take(lab: &Lab, pid: u32, started: Instant) -> anyhow::Result<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
            .context("no VmRSS")?;
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
        let metrics = lab.metrics()?;
        let mut map_entries = json!({});
        for line in metrics.lines().filter_map(|l| l.strip_prefix("proxy_map_entries{map=\"")) {
            if let Some((map, value)) = line.split_once("\"} ") {
                map_entries[map] = json!(value.parse::<u64>().ok());
            }
        }
        let count = lab.exec_on(0, "cat", &["/proc/sys/net/netfilter/nf_conntrack_count"]);
        Ok(Sample {
            at_s: started.elapsed().as_secs_f64(),
            rss_mib: rss_kib / 1024.0,
            fds,
            cpu_s: cpu_seconds(pid)?,
            map_entries,
            bpf_conntrack: crate::bench::metric(lab, "proxy_conntrack_entries").unwrap_or(0.0),
            nf_conntrack: count.ok().and_then(|c| c.trim().parse().ok()).unwrap_or(f64::NAN),
        })
    }

    fn json(&self, cpu_percent: f64) -> Value {
        json!({
            "at_s": self.at_s, "rss_mib": self.rss_mib, "fds": self.fds,
            "cpu_percent": cpu_percent, "map_entries": self.map_entries,
            "bpf_conntrack": self.bpf_conntrack, "nf_conntrack": self.nf_conntrack,
        })
    }
}

/// The CPU time a process used, from /proc/PID/stat.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces): utime is the 14th
    // field of the line, the 12th after ") ".
    let rest = stat.rsplit_once(") ").context("odd stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// The stable service (ClusterIP 10.96.0.10, NodePort 30080) over web-0
/// and web-1.
fn stable() -> String {
    "---\napiVersion: v1\nkind: Service\nmetadata: {name: stable, namespace: soak}\nspec: {clusterIP: 10.96.0.10, type: NodePort, ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: stable-1, namespace: soak, labels: {kubernetes.io/service-name: stable}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.244.1.2], nodeName: lab-node}, {addresses: [10.244.1.3], nodeName: lab-node}]\n".into()
}

/// Change `i` of the churn: service `c<k>` is created, has its endpoints
/// changed, then is deleted, in turn.
fn churn(lab: &Lab, i: usize) -> anyhow::Result<()> {
    let api = lab.api().context("API server")?;
    let k = i % CHURNED;
    let round = i / CHURNED;
    let name = format!("c{k}");
    if round % 3 == 2 {
        api.delete(proxy_lab::apiserver::Kind::Service, "soak", &name);
        api.delete(proxy_lab::apiserver::Kind::EndpointSlice, "soak", &format!("{name}-1"));
        return Ok(());
    }
    let mut yaml = String::new();
    if round.is_multiple_of(3) {
        let _ = write!(
            yaml,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: soak}}\nspec: {{clusterIP: 10.96.1.{ip}, ports: [{{name: http, port: 80, targetPort: 8080}}]}}\n",
            ip = k + 1
        );
    }
    // Three endpoints nothing answers on, a different one each round.
    let endpoints: Vec<String> = (0..3)
        .map(|e| {
            format!("{{addresses: [10.128.{k}.{}], nodeName: lab-node}}", (round * 3 + e) % 250 + 1)
        })
        .collect();
    let _ = write!(
        yaml,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: soak, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{}]\n",
        endpoints.join(", ")
    );
    api.apply(&yaml)
}

/// A client's exchanges, read as they come (a full pipe would stall it);
/// stopped when dropped.
struct Client {
    what: &'static str,
    pid: u32,
    reader: Option<JoinHandle<std::io::Result<Output>>>,
}

impl Client {
    fn start(what: &'static str, child: Child) -> Self {
        let pid = child.id();
        let reader = Some(std::thread::spawn(move || child.wait_with_output()));
        Client { what, pid, reader }
    }

    fn kill(&self) {
        if self.reader.as_ref().is_some_and(|r| !r.is_finished()) {
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        }
    }

    /// Stops it: its connections, and the failed ones (which, what error,
    /// after how long).
    fn stop(&mut self) -> anyhow::Result<(usize, Vec<Value>)> {
        self.kill();
        let reader = self.reader.take().context("stopped already")?;
        let out = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
        let text = String::from_utf8_lossy(&out.stdout);
        let attempts: Vec<Attempt> = text.lines().filter_map(Attempt::parse).collect();
        let failed = attempts.iter().enumerate().filter_map(|(i, a)| match a {
            Attempt::Err { ms, kind } => Some(json!({"connection": i, "kind": kind, "ms": ms})),
            Attempt::Ok { .. } => None,
        });
        Ok((attempts.len(), failed.collect()))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    // SAFETY: single-threaded here; the lab reads it when starting binaries.
    unsafe { std::env::set_var(BIN_DIR_ENV, "target/release") };
    std::fs::create_dir_all(OUT)?;
    let mut lab = Lab::with(Setup::of(opts.mode, Source::ApiServer))?;
    lab.add_web_pods(2, &[8080], &[])?;
    let client = lab.add_pod("client", "10.244.1.100")?;
    let ext = lab.add_external("ext", "192.168.100.101")?;
    lab.write_manifest(&stable())?;
    lab.start_agent(&[])?;
    let pid = lab.agent_pid_on(0).context("agent pid")?;
    let total = opts.warm_up + Duration::from_secs(opts.minutes * 60);
    // Bounded: they end on their own a minute after the soak would.
    let count = ((total.as_millis() as u64 + 60_000) / CLIENT_INTERVAL_MS) as usize;
    let steady = |addr: &str| Request::tcp(addr, count).interval_ms(CLIENT_INTERVAL_MS);
    let clients = [
        Client::start("socket LB", lab.client(&client).spawn(steady("10.96.0.10:80"))?),
        Client::start("NodePort", lab.client_outside(&ext).spawn(steady("192.168.100.11:30080"))?),
    ];
    let started = Instant::now();
    let every = Duration::from_secs_f64(1.0 / f64::from(opts.rate.max(1)));
    let mut changes = 0;
    let mut samples: Vec<Sample> = Vec::new();
    let mut next_sample = started + opts.warm_up;
    eprintln!(
        "soak: {} mode, {} change/s, warm-up {:?}, {} min",
        opts.mode.as_arg(),
        opts.rate,
        opts.warm_up,
        opts.minutes
    );
    while started.elapsed() < total {
        churn(&lab, changes)?;
        changes += 1;
        if Instant::now() >= next_sample {
            if !lab.agent_alive() {
                break;
            }
            let sample = Sample::take(&lab, pid, started)?;
            eprintln!(
                "  {:>5.0} s: RSS {:.1} MiB, {} fds, CPU {:.1} s, maps {}, conntrack {} BPF / {} netfilter",
                sample.at_s,
                sample.rss_mib,
                sample.fds,
                sample.cpu_s,
                sample.map_entries,
                sample.bpf_conntrack,
                sample.nf_conntrack
            );
            samples.push(sample);
            next_sample += SAMPLE_EVERY;
        }
        let next = started + every * changes as u32;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let alive = lab.agent_alive();
    let syncs_failed =
        crate::bench::metric(&lab, "proxy_sync_total{result=\"error\"}").unwrap_or(f64::NAN);
    let mut connections = json!({});
    let mut failed_total = 0;
    for mut client in clients {
        let (n, failed) = client.stop()?;
        failed_total += failed.len();
        connections[client.what] = json!({"connections": n, "failed": failed.len()});
        if !failed.is_empty() {
            connections[client.what]["failures"] = json!(failed);
        }
    }
    if !alive {
        let log = lab.agent_log();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        anyhow::bail!(
            "the agent exited after {:.0} s (stable service: {connections}); its log ends with:\n{}",
            started.elapsed().as_secs_f64(),
            tail.join("\n")
        );
    }
    samples.push(Sample::take(&lab, pid, started)?);
    let results = report(&opts, &samples, changes, syncs_failed, connections)?;
    std::fs::write(Path::new(OUT).join("results.json"), serde_json::to_string_pretty(&results)?)?;
    anyhow::ensure!(failed_total == 0, "{failed_total} connections to the stable service failed");
    Ok(())
}

/// CPU use between two samples, in percent of one CPU.
fn cpu_percent(from: &Sample, to: &Sample) -> f64 {
    100.0 * (to.cpu_s - from.cpu_s) / (to.at_s - from.at_s)
}

/// The results as JSON, and a table on stdout: start (after the warm-up)
/// and end, CPU over the first and the last sampling interval.
fn report(
    opts: &Options,
    samples: &[Sample],
    changes: usize,
    syncs_failed: f64,
    connections: Value,
) -> anyhow::Result<Value> {
    anyhow::ensure!(
        samples.len() >= 3,
        "the soak was too short to sample (use --minutes 1 or more)"
    );
    let (first, second) = (&samples[0], &samples[1]);
    let (before_last, last) = (&samples[samples.len() - 2], &samples[samples.len() - 1]);
    let start = first.json(cpu_percent(first, second));
    let end = last.json(cpu_percent(before_last, last));
    let average_cpu = cpu_percent(first, last);
    let command = format!(
        "cargo xtask soak --minutes {} --mode {} --rate {}",
        opts.minutes,
        opts.mode.as_arg(),
        opts.rate
    );
    println!("{command}: {changes} changes, failed syncs: {syncs_failed}");
    println!("| | start (after {:?} warm-up) | end |\n|---|---|---|", opts.warm_up);
    println!("| agent RSS (MiB) | {:.1} | {:.1} |", first.rss_mib, last.rss_mib);
    println!("| agent open fds | {} | {} |", first.fds, last.fds);
    println!(
        "| agent CPU (% of one CPU, over {SAMPLE_EVERY:?}) | {:.1} | {:.1} |",
        start["cpu_percent"].as_f64().unwrap_or(f64::NAN),
        end["cpu_percent"].as_f64().unwrap_or(f64::NAN)
    );
    println!("| map entries | {} | {} |", first.map_entries, last.map_entries);
    println!(
        "| conntrack entries (BPF / netfilter) | {} / {} | {} / {} |",
        first.bpf_conntrack, first.nf_conntrack, last.bpf_conntrack, last.nf_conntrack
    );
    println!("average agent CPU {average_cpu:.1} %; stable service: {connections}");
    Ok(json!({
        "command": command,
        "changes": changes,
        "syncs_failed": syncs_failed,
        "start": start,
        "end": end,
        "average_cpu_percent": average_cpu,
        "stable_service": connections,
        "samples": samples.iter().map(|s| s.json(f64::NAN)).collect::<Vec<_>>(),
    }))
}
