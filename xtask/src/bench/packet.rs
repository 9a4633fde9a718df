//! The per-packet program (`packet_bench`): at 2 and 100,000 services in
//! the bench, and one build against another (`cargo xtask packet-bench`).

use std::path::Path;

use anyhow::Context as _;
use proxy_lab::sh;
use serde_json::{Value, json};

use super::median;

pub(super) const PACKET_BENCH: &str = "target/release/examples/packet_bench";

/// The figures `packet_bench` prints, and `tracked_net`: a tracked packet
/// less `run_overhead` (what one run costs beside the program, which the
/// figures of one run per packet pay and the misses, over 1M repeats, not).
const PER_PACKET: [&str; 19] = [
    "miss_ns",
    "socket_lb_reply_ns",
    "ipv6_miss_ns",
    "node_port_new_ns",
    "node_port_new_maglev_ns",
    "node_port_new_dsr_ns",
    "cluster_ip_new_ns",
    "tracked_ns",
    "tracked_dsr_ns",
    "sctp_node_port_new_ns",
    "sctp_tracked_ns",
    "run_overhead_ns",
    "tracked_net_ns",
    "routed_miss_ns",
    "xdp_miss_ns",
    "routed_node_port_new_ns",
    "xdp_node_port_new_ns",
    "routed_tracked_ns",
    "xdp_tracked_ns",
];

/// Ratios within one `packet_bench` run (its figures measured a moment
/// apart, so the machine's load changes them less than it does figures of
/// different runs): a new NodePort flow picked from a Maglev table over a
/// random pick, a new DSR flow over a new SNAT flow, and a tracked DSR
/// packet over a tracked SNAT packet, and SCTP's new association and
/// tracked packet (a tail call and the CRC's update more) over TCP's, and
/// XDP's program over tc's on the same packets arriving on an uplink; each
/// as `(name, numerator, denominator)`.
const PER_PACKET_RATIOS: [(&str, &str, &str); 8] = [
    ("maglev_vs_random", "node_port_new_maglev_ns", "node_port_new_ns"),
    ("dsr_vs_snat_new", "node_port_new_dsr_ns", "node_port_new_ns"),
    ("dsr_vs_snat_tracked", "tracked_dsr_ns", "tracked_ns"),
    ("sctp_vs_tcp_new", "sctp_node_port_new_ns", "node_port_new_ns"),
    ("sctp_vs_tcp_tracked", "sctp_tracked_ns", "tracked_ns"),
    ("xdp_vs_tc_miss", "xdp_miss_ns", "routed_miss_ns"),
    ("xdp_vs_tc_new", "xdp_node_port_new_ns", "routed_node_port_new_ns"),
    ("xdp_vs_tc_tracked", "xdp_tracked_ns", "routed_tracked_ns"),
];

pub(super) fn build_packet_bench() -> anyhow::Result<()> {
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
pub(super) fn medians(n: usize, values: &[Value]) -> Value {
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
pub(super) fn per_packet(bin: &str, extra: &[&str], n: usize) -> anyhow::Result<Value> {
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
