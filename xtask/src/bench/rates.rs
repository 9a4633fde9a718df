//! Connection rates through a ClusterIP and a NodePort against a direct
//! connection, at N installed services.

use std::fmt::Write as _;

use anyhow::Context as _;

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

/// The lab's pods: nginx's, two clients (one for the runs through the
/// socket-LB cgroup and direct, one for the per-packet runs: a 4-tuple the
/// backend holds in TIME_WAIT after one kind of run would refuse the other
/// kind's SYN, as with any NAT), and an external client that can also
/// reach the server directly.
struct Pods {
    server: Pod,
    client: Pod,
    per_packet: Pod,
    ext: Pod,
}

/// A lab: nginx in a pod (one process, no master: stopping it leaves no
/// worker behind), the [`Pods`], client ports opened up.
fn lab(setup: Setup) -> anyhow::Result<(Lab, Pods)> {
    let mut lab = Lab::with(setup)?;
    lab.dual_stack()?;
    let server = lab.add_pod("web-0", POD)?;
    start_nginx(&mut lab, &server, &[SERVICE_PORT, DIRECT_PORT], true)?;
    let client = lab.add_pod("client", "10.244.1.100")?;
    let per_packet = lab.add_pod("client-pp", "10.244.1.101")?;
    let ext = lab.add_external("ext", "192.168.100.101")?;
    sh("ip", &["-n", &ext.netns, "route", "add", "10.244.1.0/24", "via", "192.168.100.11"])?;
    for netns in [&client.netns, &per_packet.netns, &ext.netns] {
        open_client_ports(netns)?;
    }
    wait_answering(&lab, &client, &format!("{POD}:{DIRECT_PORT}"))?;
    Ok((lab, Pods { server, client, per_packet, ext }))
}

/// Waits (10 s at most) until the interface of `pod` on node 0 runs no
/// per-packet program: the agent takes `tc_pod_replies` off a pod that
/// backs nothing after its first conntrack collection.
fn wait_bare(lab: &Lab, pod: &Pod) -> anyhow::Result<()> {
    let route = lab.exec_on(0, "ip", &["-o", "route", "show", &format!("{}/32", pod.ip)])?;
    let dev = route.split_whitespace().skip_while(|w| *w != "dev").nth(1);
    let dev = dev.with_context(|| format!("no route to {}", pod.ip))?;
    let pin = lab.pins.join("links").join(format!("tc-{dev}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pin.exists() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "{dev} kept its program");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}

/// Connection rates at size `n` in `mode`, `rounds` alternating rounds.
/// Each round starts with the baseline (no agent, its datapath cleaned up)
/// and then starts the agent for the other runs, so a change in the
/// machine's load meets every kind of run alike.
pub(super) fn connection_rates(mode: Mode, n: usize, opts: &Options) -> anyhow::Result<Value> {
    let (mut lab, Pods { server, client, per_packet, ext }) =
        lab(Setup::of(mode, Source::Manifests))?;
    let s = opts.seconds;
    let direct = format!("{POD}:{DIRECT_PORT}");
    rate(&lab, &client, false, &direct, 1)?;
    let all = manifest(n, 1) + &manifest6(n);
    lab.write_manifest(&all)?;
    let vip = "10.96.0.10:80";
    let direct6 = format!("[{POD6}]:{DIRECT_PORT}");
    let node_port = "192.168.100.11:30080";
    let (mut baseline, mut direct_replies, mut direct_bare, mut direct_no_pod_programs) =
        (Vec::<Run>::new(), Vec::new(), Vec::new(), Vec::new());
    // The same services, none of them over the server pod.
    let all_but_the_server = all
        .replace(&format!("[{POD}]"), "[10.244.9.9]")
        .replace(&format!("['{POD6}']"), "['fd00:244:9::9']");
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
            // (its default): the replies program only on the interfaces of
            // pods that back a service (the server's: the client's goes
            // bare); the server backing nothing (no program either side);
            // and, to tell the programs' share from the rest of the
            // agent's, none on any pod interface.
            let (replies, none) =
                (["--pod-interface-programs", "replies"], ["--pod-interfaces", ""]);
            let runs_of: [(_, _, &[&Pod], &mut Vec<Run>); 3] = [
                (replies, &all, &[&client], &mut direct_replies),
                (replies, &all_but_the_server, &[&client, &server], &mut direct_bare),
                (none, &all, &[], &mut direct_no_pod_programs),
            ];
            for (flags, manifest, bare, runs) in runs_of {
                // Without the NodePort run's flows (to the server): the
                // server's interface keeps the program while they live.
                stop_and_clean(&mut lab)?;
                lab.write_manifest(manifest)?;
                lab.start_agent_within(0, &flags, LIMIT)?;
                for pod in bare {
                    wait_bare(&lab, pod)?;
                }
                runs.push(rate(&lab, &client, false, &direct, s)?);
            }
        }
        if round + 1 < opts.rounds {
            stop_and_clean(&mut lab)?;
        }
    }
    if mode == Mode::Ebpf {
        runs.push(("direct_replies_only", direct_replies));
        runs.push(("direct_bare", direct_bare));
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
