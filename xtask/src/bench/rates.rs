//! Connection rates through a ClusterIP and a NodePort against a direct
//! connection, at N installed services.

use std::fmt::Write as _;

use proxy_lab::{
    Lab, Mode, Pod, Setup, Source,
    bench_objects::{self, POD, SERVICE_PORT},
    sh,
};
use serde_json::{Value, json};

use super::wrk::{Run, open_client_ports, rate, start_nginx, wait_answering};
use super::{
    DIRECT_PORT, LIMIT, Options, POD6, VIP6, map_memory_mib, median, peak_rss_mib, stop_and_clean,
};

/// `n` IPv6-only ClusterIP services `v0..` from `fd00:96::a`, one endpoint
/// each: `v0`'s the backend pod's IPv6 address, the others' addresses
/// nothing answers.
pub(super) fn manifest6(n: usize) -> String {
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
pub(super) fn manifest(n: usize, endpoints: usize) -> String {
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

/// Connection rates at size `n` in `mode`, `rounds` alternating rounds.
/// Each round starts with the baseline (no agent, its datapath cleaned up)
/// and then starts the agent for the other runs, so a change in the
/// machine's load meets every kind of run alike.
pub(super) fn connection_rates(mode: Mode, n: usize, opts: &Options) -> anyhow::Result<Value> {
    let (mut lab, client, per_packet, ext) = lab(Setup::of(mode, Source::Manifests))?;
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
    let baseline_errors: u64 = baseline.iter().map(|r| r.errors).sum();
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
    result["errors"] =
        json!(baseline_errors + runs.iter().flat_map(|(_, v)| v).map(|r| r.errors).sum::<u64>());
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
