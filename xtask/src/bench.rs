//! Connection rates through a ClusterIP (socket LB) and a NodePort (per
//! packet) against direct connections to the pod, measured in one lab run so
//! the ratios hold on a noisy machine; then the per-packet program's
//! nanoseconds per packet (`proxy-agent/examples/packet_bench.rs`).

use proxy_lab::{Attempt, BIN_DIR_ENV, Lab, Pod, sh};

const MANIFEST: &str = r#"apiVersion: v1
kind: Service
metadata: {name: bench, namespace: bench}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: bench-1, namespace: bench, labels: {kubernetes.io/service-name: bench}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.2]}]
"#;

struct Round {
    /// Connections per second over the summed per-connection times.
    rate: f64,
    median_us: f64,
}

fn measure(lab: &Lab, client: &Pod, addr: &str, n: usize) -> anyhow::Result<Round> {
    // Pods run in the socket-LB cgroup, external clients outside it.
    let args = ["tcp", addr, &n.to_string()];
    let attempts = if client.name == "ext" {
        lab.client_outside(client, &args)?
    } else {
        lab.client(client, &args)?
    };
    let mut times: Vec<f64> = attempts
        .iter()
        .filter_map(|a| match a {
            Attempt::Ok { ms, .. } => Some(*ms),
            Attempt::Err { .. } => None,
        })
        .collect();
    let failures: Vec<&Attempt> =
        attempts.iter().filter(|a| matches!(a, Attempt::Err { .. })).collect();
    anyhow::ensure!(
        failures.is_empty(),
        "{} of {n} connections to {addr} failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    times.sort_by(f64::total_cmp);
    let total_s: f64 = times.iter().sum::<f64>() / 1000.0;
    Ok(Round { rate: n as f64 / total_s, median_us: times[n / 2] * 1000.0 })
}

/// Alternates `direct` and `via` rounds and prints their rates and ratio.
fn compare(
    lab: &Lab,
    client: &Pod,
    title: &str,
    direct: &str,
    via: &str,
    connections: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    // Warm up both paths (ARP, page cache, first map lookups).
    measure(lab, client, direct, 100)?;
    measure(lab, client, via, 100)?;
    println!(
        "\n{title}: sequential TCP connect+request+close, {connections} connections per round"
    );
    println!(
        "{:>5} {:>14} {:>14} {:>8} {:>12} {:>12}",
        "round", "direct conn/s", "via conn/s", "ratio", "direct p50", "via p50"
    );
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        let d = measure(lab, client, direct, connections)?;
        let v = measure(lab, client, via, connections)?;
        let ratio = v.rate / d.rate;
        ratios.push(ratio);
        println!(
            "{round:>5} {:>14.0} {:>14.0} {:>8.3} {:>10.1}us {:>10.1}us",
            d.rate, v.rate, ratio, d.median_us, v.median_us
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!("median via/direct connection-rate ratio: {:.3}", ratios[ratios.len() / 2]);
    Ok(())
}

pub fn run(connections: usize, rounds: usize) -> anyhow::Result<()> {
    // SAFETY: single-threaded here; the lab reads it when starting binaries.
    unsafe { std::env::set_var(BIN_DIR_ENV, "target/release") };
    let mut lab = Lab::new()?;
    let pod = lab.add_pod("web-0", "10.244.1.2")?;
    lab.serve(&pod, &[8080], &[])?;
    let client = lab.add_pod("client", "10.244.1.100")?;
    let ext = lab.add_external("ext", "192.168.100.101")?;
    // The external client may also reach the pod directly, routed by the node.
    sh("ip", &["-n", &ext.netns, "route", "add", "10.244.1.0/24", "via", "192.168.100.11"])?;
    lab.write_manifest(MANIFEST)?;
    // A closed flow's SNAT port rests 60 s (the backend's TIME_WAIT), so one
    // backend takes at most range/60 s new SNATed flows per second: the
    // benchmark's rate needs the lab node's whole port space.
    lab.start_agent(&["--snat-port-range", "1024-65000"])?;
    compare(
        &lab,
        &client,
        "ClusterIP, socket LB (pod in the cgroup)",
        "10.244.1.2:8080",
        "10.96.0.10:80",
        connections,
        rounds,
    )?;
    compare(
        &lab,
        &ext,
        "NodePort, per packet (external client, SNAT)",
        "10.244.1.2:8080",
        "192.168.100.11:30080",
        connections,
        rounds,
    )?;
    drop(lab);
    println!();
    crate::cargo(&["run", "--quiet", "--release", "-p", "proxy-agent", "--example", "packet_bench"])
}
