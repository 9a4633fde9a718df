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

mod external;
pub mod forwarding;
mod packet;
mod programming;
mod rates;
mod wrk;

use std::{
    fmt::Write as _,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use proxy_lab::{BIN_DIR_ENV, Lab, Mode, sh};
use serde_json::{Value, json};

pub use packet::{Builds, packet_ab};
pub use programming::iptables_backends;

use external::external_path;
use packet::{PACKET_BENCH, build_packet_bench, medians, per_packet};
use programming::{Feed, Nft, change_latency, nft_load, programming, programming_with};
use rates::connection_rates;

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
    /// The nftables mode's nft: directories holding an `nft` the agent
    /// finds first (`system`: the one in PATH), e.g. `--nft
    /// system,target/nft-1.1.3/bin` (`cargo xtask newer-nft`); with more
    /// than one, its programming and change runs take them in turn,
    /// `--rounds` times, and each times `nft -f` of the whole ruleset
    #[arg(long, value_delimiter = ',')]
    pub nft: Vec<String>,
    /// Endpoint changes timed per run (100; 20 in the quick profile's
    /// iptables mode)
    #[arg(long)]
    pub changes: Option<usize>,
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

/// Stops the agent and removes its datapath (which outlives it by design),
/// leaving the lab as it was before the agent started.
fn stop_and_clean(lab: &mut Lab) -> anyhow::Result<()> {
    lab.stop_agent_on(0);
    lab.cleanup_on(0).context("cleanup between rounds")?;
    Ok(())
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
        "external_path": [], "nft_load": [],
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
    let nfts = Nft::all(&opts.nft)?;
    for &mode in &modes {
        let limit = limit(mode, opts.full);
        let mut sizes = sizes(&opts).into_iter();
        'sizes: for n in sizes.by_ref() {
            let mut slowest: f64 = 0.0;
            for (round, nft) in runs(mode, &nfts, opts.rounds) {
                let with = nft.map_or_else(String::new, |nft| format!(", nft {}", nft.version));
                eprintln!("programming: {} mode{with}, {n} services x 10 endpoints", mode.as_arg());
                let mut result = programming(mode, n, opts.full, nft)?;
                label(&mut result, round, nft);
                let took = result["to_serving_s"].as_f64();
                push(&mut results, "programming", result);
                let Some(took) = took else {
                    too_big.push((mode, n));
                    break 'sizes;
                };
                slowest = slowest.max(took);
                eprintln!("change latency: {} mode{with}, {n} services", mode.as_arg());
                let mut result = change_latency(mode, n, &opts, nft)?;
                label(&mut result, round, nft);
                push(&mut results, "change_latency", result);
                if round.is_some() {
                    let mut result = nft_load(n, nft)?;
                    label(&mut result, round, nft);
                    push(&mut results, "nft_load", result);
                }
            }
            let took = slowest;
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
                programming_with(Mode::Ebpf, feed, n, opts.full, &[], None)?,
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

/// The runs of `mode` at one size: once; in the nftables mode with
/// several nfts, `rounds` rounds taking them in turn (numbered from 1).
fn runs(mode: Mode, nfts: &[Nft], rounds: usize) -> Vec<(Option<usize>, Option<&Nft>)> {
    match nfts {
        _ if mode != Mode::Nftables => vec![(None, None)],
        [nft] => vec![(None, Some(nft))],
        _ => (1..=rounds).flat_map(|r| nfts.iter().map(move |nft| (Some(r), Some(nft)))).collect(),
    }
}

/// Names the nft and the round of a run's result.
fn label(result: &mut Value, round: Option<usize>, nft: Option<&Nft>) {
    if let Some(nft) = nft {
        result["nft"] = json!(nft.version);
    }
    if let Some(round) = round {
        result["round"] = json!(round);
    }
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
    let failed = failures(&results);
    if !failed.is_empty() {
        bail!("the bench had failures (see the report):\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// What went wrong in `results`: failed runs and runs wrk saw errors in.
fn failures(results: &Value) -> Vec<String> {
    let mut failed = Vec::new();
    for section in ["programming", "connection_rates", "external_path"] {
        for row in results[section].as_array().into_iter().flatten() {
            let mut what = section.to_string();
            if let (Some(mode), Some(n)) = (row["mode"].as_str(), row["services"].as_u64()) {
                what = format!("{what}, {mode} mode, {n} services");
            }
            if let Some(why) = row["failed"].as_str() {
                failed.push(format!("{what}: {why}"));
            }
            if let Some(errors) = row["errors"].as_u64().filter(|&e| e > 0) {
                failed.push(format!("{what}: wrk saw {errors} errors"));
            }
        }
    }
    failed
}

/// The command line that made the results, as far as it changes them.
fn command(opts: &Options) -> String {
    let mut command = String::from("cargo xtask bench");
    for (set, flag) in [(opts.full, " --full"), (opts.external_only, " --external-only")] {
        if set {
            command.push_str(flag);
        }
    }
    if let Some(changes) = opts.changes {
        let _ = write!(command, " --changes {changes}");
    }
    if !opts.nft.is_empty() {
        let _ = write!(command, " --nft {}", opts.nft.join(","));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_runs_and_wrk_errors_fail_the_bench_and_a_limit_does_not() {
        let results = json!({
            "programming": [
                {"mode": "ebpf", "services": 1000, "to_serving_s": 1.0},
                {"mode": "iptables", "services": 10000, "over_limit_s": 60},
                {"mode": "ebpf", "services": 10000, "failed": "sync failed: map full"},
            ],
            "connection_rates": [{"mode": "ebpf", "services": 1, "errors": 0}],
            "external_path": [{"rounds": 3, "errors": 7}],
        });
        assert_eq!(
            failures(&results),
            [
                "programming, ebpf mode, 10000 services: sync failed: map full",
                "external_path: wrk saw 7 errors"
            ]
        );
    }
}
