//! The benchmark's report: markdown tables and SVG plots from
//! `results.json`, and their copy into docs/.

use std::{fmt::Write as _, path::Path};

use plotters::prelude::*;
use serde_json::Value;

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// A ratio to three decimals, "–" when absent.
fn ratio(v: &Value, key: &str) -> String {
    v[key].as_f64().map_or("–".into(), |v| format!("{v:.3}"))
}

fn rows<'a>(results: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    results[key].as_array().into_iter().flatten()
}

/// CPU time (client and server) per 10,000 connections, as a ratio to the
/// direct connection without an agent; and the socket LB's over a direct
/// connection with the agent.
fn cpu_table(out: &mut String, results: &Value) {
    let _ = writeln!(
        out,
        "\n### CPU time per 10,000 connections (wrk + nginx, user + system), as a ratio to a direct connection without any proxy\n\n| mode | services | baseline ms | direct, N installed | direct, pod interfaces replies-only | direct, no pod-interface programs | ClusterIP | ClusterIP per packet | NodePort | ClusterIP ÷ direct with the agent |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows(results, "connection_rates").filter(|r| r["failed"].is_null()) {
        let ratio = |k: &str| ratio(r, k);
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} |",
            r["mode"].as_str().unwrap_or(""),
            r["services"],
            num(r, "baseline_cpu_ms_per_10k"),
            ratio("direct_cpu_ratio"),
            ratio("direct_replies_only_cpu_ratio"),
            ratio("direct_no_pod_programs_cpu_ratio"),
            ratio("vip_cpu_ratio"),
            ratio("vip_per_packet_cpu_ratio"),
            ratio("node_port_cpu_ratio"),
            ratio("vip_cpu_vs_direct"),
        );
    }
}

/// IPv6 in the dual-stack lab: a direct IPv6 connection with the agent,
/// and through an IPv6 ClusterIP (iptables mode; the eBPF mode serves the
/// IPv4 family only so far).
fn ipv6_table(out: &mut String, results: &Value) {
    let _ = writeln!(
        out,
        "\n### IPv6 (dual-stack lab): an IPv6 ClusterIP against a direct IPv6 connection, both with the agent\n\n| mode | services | direct IPv6 conn/s | IPv6 ClusterIP conn/s | rate ratio | CPU ratio |\n|---|---:|---:|---:|---:|---:|"
    );
    for r in rows(results, "connection_rates").filter(|r| r["failed"].is_null()) {
        let rate = |k: &str| r[k].as_f64().map_or("–".into(), |v| format!("{v:.0}"));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r["mode"].as_str().unwrap_or(""),
            r["services"],
            rate("direct6_per_s"),
            rate("vip6_per_s"),
            ratio(r, "vip6_rate_vs_direct6"),
            ratio(r, "vip6_cpu_vs_direct6"),
        );
    }
}

pub fn markdown(results: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Machine: {}. Command: `{}` ({:.0} s).\n",
        results["machine"].as_str().unwrap_or(""),
        results["command"].as_str().unwrap_or(""),
        num(results, "duration_s")
    );
    let _ = writeln!(
        out,
        "### Connection rate (wrk, `Connection: close`), as a ratio to a direct connection without any proxy\n"
    );
    let _ = writeln!(
        out,
        "| mode | services | baseline conn/s | direct, N installed | ClusterIP | ClusterIP per packet | NodePort | agent peak RSS MiB | BPF maps MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows(results, "connection_rates") {
        if let Some(why) = r["failed"].as_str() {
            let (mode, n) = (r["mode"].as_str().unwrap_or(""), &r["services"]);
            let _ = writeln!(out, "| {mode} | {n} | failed: {why} | | | | | | |");
            continue;
        }
        let ratio = |k: &str| ratio(r, k);
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {:.1} | {:.1} |",
            r["mode"].as_str().unwrap_or(""),
            r["services"],
            num(r, "baseline_per_s"),
            ratio("direct_ratio"),
            ratio("vip_ratio"),
            ratio("vip_per_packet_ratio"),
            ratio("node_port_ratio"),
            num(r, "agent_peak_rss_mib"),
            num(r, "map_memory_mib"),
        );
    }
    cpu_table(&mut out, results);
    ipv6_table(&mut out, results);
    let _ = writeln!(out, "\n### Programming N services, and one endpoint change\n");
    let _ = writeln!(
        out,
        "| mode | source | services × endpoints | listed (s) | to serving (s) | first sync (s) | restart after kill -9, to serving (s) | change p50 (ms) | change p99 (ms) | agent peak RSS MiB | BPF maps MiB |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows(results, "programming") {
        // Runs from before the manifest files were measured name no source.
        let source = r["source"].as_str().unwrap_or("API server");
        let change = rows(results, "change_latency").find(|c| {
            source == "API server"
                && ["mode", "services", "nft", "round"].iter().all(|k| c[k] == r[k])
        });
        let latency = |k: &str| change.map_or("–".into(), |c| format!("{:.1}", num(c, k)));
        let services = r["services"].as_f64().unwrap_or(f64::NAN);
        let per_service = r["endpoints"].as_f64().map_or(10.0, |e| e / services);
        let head = format!("| {} | {source} | {services} × {per_service} |", mode_label(r));
        let unfinished = match (r["failed"].as_str(), r["over_limit_s"].as_u64()) {
            (Some(why), _) => Some(format!("failed: {why}")),
            (None, Some(limit)) => Some(format!("not serving within {limit} s")),
            (None, None) => None,
        };
        let _ = match unfinished {
            Some(why) => writeln!(out, "{head} {why} | | | | | | | |"),
            None => writeln!(
                out,
                "{head} {:.2} | {:.2} | {:.3} | {} | {} | {} | {:.1} | {:.1} |",
                num(r, "listed_s"),
                num(r, "to_serving_s"),
                num(r, "first_sync_s"),
                r["restart_to_serving_s"].as_f64().map_or("–".into(), |s| format!("{s:.2}")),
                latency("p50_ms"),
                latency("p99_ms"),
                num(r, "agent_peak_rss_mib"),
                num(r, "map_memory_mib"),
            ),
        };
    }
    nft_load_table(&mut out, results);
    external_table(&mut out, results);
    let _ = writeln!(out, "\n### Per-packet program, ns per packet (`BPF_PROG_TEST_RUN`)\n");
    let _ = writeln!(
        out,
        "| services | miss (not a service) | new NodePort flow (SNAT, 100 backends) | new NodePort flow, Maglev | new NodePort flow, DSR | new ClusterIP flow | tracked flow | tracked DSR flow | Maglev ÷ random | new DSR ÷ new SNAT | tracked DSR ÷ SNAT |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows(results, "per_packet") {
        let ns = |k: &str| r[k].as_f64().map_or("–".into(), |v| format!("{v:.0}"));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r["services"],
            ns("miss_ns"),
            ns("node_port_new_ns"),
            ns("node_port_new_maglev_ns"),
            ns("node_port_new_dsr_ns"),
            ns("cluster_ip_new_ns"),
            ns("tracked_ns"),
            ns("tracked_dsr_ns"),
            ratio(r, "maglev_vs_random"),
            ratio(r, "dsr_vs_snat_new"),
            ratio(r, "dsr_vs_snat_tracked"),
        );
    }
    out
}

/// The external path on two nodes: an external client to a pod on the
/// second node, straight and through the first node's NodePorts.
/// A run's mode, with its nft (and round) where the bench compared nfts.
fn mode_label(r: &Value) -> String {
    let mode = r["mode"].as_str().unwrap_or("");
    match (r["nft"].as_str(), r["round"].as_u64()) {
        (Some(nft), Some(round)) => format!("{mode} (nft {nft}, round {round})"),
        (Some(nft), None) => format!("{mode} (nft {nft})"),
        _ => mode.to_string(),
    }
}

/// `nft -f` of the nftables mode's whole ruleset with each nft (`--nft`).
fn nft_load_table(out: &mut String, results: &Value) {
    if rows(results, "nft_load").next().is_none() {
        return;
    }
    let _ = writeln!(
        out,
        "\n### `nft -f` of the whole IPv4 ruleset into an empty namespace\n\n| nft | round | services × endpoints | lines | seconds |\n|---|---:|---:|---:|---:|"
    );
    for r in rows(results, "nft_load") {
        let _ = writeln!(
            out,
            "| {} | {} | {} × 10 | {} | {:.2} |",
            r["nft"].as_str().unwrap_or(""),
            r["round"],
            r["services"],
            r["lines"],
            num(r, "seconds"),
        );
    }
}

fn external_table(out: &mut String, results: &Value) {
    let Some(r) = rows(results, "external_path").next() else { return };
    let _ = writeln!(
        out,
        "\n### External path, two nodes (eBPF mode): an external client to a pod on the other node, {} rounds of {} s, medians\n\nCPU: wrk's and nginx's user + system time (with the softirq work that ran in their context: most of both nodes' forwarding) per 10,000 connections.\n\n| path | conn/s | CPU ms per 10,000 | rate ÷ direct | CPU ÷ direct |\n|---|---:|---:|---:|---:|",
        r["rounds"], r["seconds"]
    );
    for (name, label) in [
        ("direct", "direct to the pod (via its node)"),
        ("snat", "NodePort, SNAT"),
        ("dsr", "NodePort, DSR"),
        ("maglev_dsr", "NodePort, DSR with Maglev"),
    ] {
        let (rate, cpu) =
            (num(r, &format!("{name}_per_s")), num(r, &format!("{name}_cpu_ms_per_10k")));
        let (rate_ratio, cpu_ratio) = match name {
            "direct" => ("1".to_string(), "1".to_string()),
            _ => (
                ratio(r, &format!("{name}_rate_vs_direct")),
                ratio(r, &format!("{name}_cpu_vs_direct")),
            ),
        };
        let _ = writeln!(out, "| {label} | {rate:.0} | {cpu:.0} | {rate_ratio} | {cpu_ratio} |");
    }
    let _ = writeln!(
        out,
        "\nDSR ÷ SNAT: rate {}, CPU {}; DSR with Maglev ÷ DSR: rate {}, CPU {}.",
        ratio(r, "dsr_rate_vs_snat"),
        ratio(r, "dsr_cpu_vs_snat"),
        ratio(r, "maglev_dsr_rate_vs_dsr"),
        ratio(r, "maglev_dsr_cpu_vs_dsr"),
    );
}

type Series = (String, Vec<(f64, f64)>);

fn series(results: &Value, key: &str, fields: &[(&str, &str, &str)]) -> Vec<Series> {
    fields
        .iter()
        .map(|(mode, field, label)| {
            let points = rows(results, key)
                .filter(|r| r["mode"] == *mode)
                .filter_map(|r| Some((r["services"].as_f64()?, r[*field].as_f64()?)))
                .collect();
            (label.to_string(), points)
        })
        .filter(|(_, points): &Series| !points.is_empty())
        .collect()
}

/// Each series as a line with its points, and a legend entry.
fn draw<'a, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<LogCoord<f64>, Y>>,
    data: &[Series],
) -> anyhow::Result<()>
where
    Y: Ranged<ValueType = f64>,
{
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (label, points)) in data.iter().enumerate() {
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE).border_style(BLACK).draw()?;
    Ok(())
}

fn plot(
    path: &Path,
    title: &str,
    y_label: &str,
    data: &[Series],
    y_log: bool,
) -> anyhow::Result<()> {
    // Nothing to draw (a run of the external path alone): no plot, where
    // an empty range would have the axes ask for endless ticks.
    if data.iter().all(|(_, points)| points.is_empty()) {
        let _ = std::fs::remove_file(path);
        return Ok(());
    }
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let points = data.iter().flat_map(|(_, p)| p.iter());
    let (x_max, y_max) =
        points.clone().fold((1.0f64, 0.0f64), |(x, y), (px, py)| (x.max(*px), y.max(*py)));
    let y_min = points.map(|(_, y)| *y).filter(|y| *y > 0.0).fold(f64::INFINITY, f64::min);
    let x_range = (1.0f64..x_max * 2.0).log_scale();
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56);
    if y_log {
        let mut chart =
            builder.build_cartesian_2d(x_range, (y_min / 2.0..y_max * 2.0).log_scale())?;
        chart.configure_mesh().x_desc("services installed").y_desc(y_label).draw()?;
        draw(&mut chart, data)?;
    } else {
        let mut chart = builder.build_cartesian_2d(x_range, 0.0..(y_max * 1.15).max(1.1))?;
        chart.configure_mesh().x_desc("services installed").y_desc(y_label).draw()?;
        draw(&mut chart, data)?;
    }
    root.present()?;
    Ok(())
}

pub fn plots(results: &Value, dir: &Path) -> anyhow::Result<()> {
    let rates = series(
        results,
        "connection_rates",
        &[
            ("ebpf", "vip_ratio", "eBPF socket LB (ClusterIP)"),
            ("ebpf", "vip_per_packet_ratio", "eBPF per packet (ClusterIP)"),
            ("iptables", "vip_ratio", "iptables (ClusterIP)"),
            ("ebpf", "node_port_ratio", "eBPF NodePort"),
            ("iptables", "node_port_ratio", "iptables NodePort"),
            ("iptables", "direct_ratio", "iptables, direct to the pod"),
        ],
    );
    plot(
        &dir.join("connection-rate.svg"),
        "Connection rate vs. a direct connection without a proxy",
        "ratio to the baseline",
        &rates,
        false,
    )?;
    let programming = series(
        results,
        "programming",
        &[("ebpf", "to_serving_s", "eBPF"), ("iptables", "to_serving_s", "iptables")],
    );
    plot(
        &dir.join("programming-time.svg"),
        "From a manifest of N services × 10 endpoints to serving",
        "seconds",
        &programming,
        true,
    )?;
    Ok(())
}

/// Copies the plots to docs/bench/ and the report into docs/benchmarks.md
/// (between its `bench:begin`/`bench:end` markers).
pub fn to_docs(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all("docs/bench")?;
    for plot in ["connection-rate.svg", "programming-time.svg"] {
        if dir.join(plot).exists() {
            std::fs::copy(dir.join(plot), Path::new("docs/bench").join(plot))?;
        }
    }
    let report = std::fs::read_to_string(dir.join("report.md"))?;
    let doc = std::fs::read_to_string("docs/benchmarks.md")?;
    let (begin, end) = ("<!-- bench:begin -->", "<!-- bench:end -->");
    let (Some(a), Some(b)) = (doc.find(begin), doc.find(end)) else {
        anyhow::bail!("docs/benchmarks.md lacks the {begin} … {end} markers");
    };
    let updated = format!("{}{begin}\n{report}\n{}", &doc[..a], &doc[b..]);
    std::fs::write("docs/benchmarks.md", updated)?;
    Ok(())
}
