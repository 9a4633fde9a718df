//! Connection rate through a ClusterIP against a direct pod connection,
//! measured in one lab run so the ratio holds on a noisy machine.

use proxy_lab::{Attempt, BIN_DIR_ENV, Lab};

const MANIFEST: &str = r#"apiVersion: v1
kind: Service
metadata: {name: bench, namespace: bench}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
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

fn measure(lab: &Lab, client: &proxy_lab::Pod, addr: &str, n: usize) -> anyhow::Result<Round> {
    let attempts = lab.client(client, &["tcp", addr, &n.to_string()])?;
    let mut times: Vec<f64> = attempts
        .iter()
        .filter_map(|a| match a {
            Attempt::Ok { ms, .. } => Some(*ms),
            Attempt::Err { .. } => None,
        })
        .collect();
    anyhow::ensure!(times.len() == n, "{} of {n} connections to {addr} failed", n - times.len());
    times.sort_by(f64::total_cmp);
    let total_s: f64 = times.iter().sum::<f64>() / 1000.0;
    Ok(Round { rate: n as f64 / total_s, median_us: times[n / 2] * 1000.0 })
}

pub fn run(connections: usize, rounds: usize) -> anyhow::Result<()> {
    // SAFETY: single-threaded here; the lab reads it when starting binaries.
    unsafe { std::env::set_var(BIN_DIR_ENV, "target/release") };
    let mut lab = Lab::new()?;
    let pod = lab.add_pod("web-0", "10.244.1.2")?;
    lab.serve(&pod, &[8080], &[])?;
    let client = lab.add_pod("client", "10.244.1.100")?;
    lab.write_manifest(MANIFEST)?;
    lab.start_agent(&[])?;
    // Warm up both paths (ARP, page cache, first map lookups).
    measure(&lab, &client, "10.244.1.2:8080", 100)?;
    measure(&lab, &client, "10.96.0.10:80", 100)?;

    println!(
        "socket LB, sequential TCP connect+request+close, {connections} connections per round"
    );
    println!(
        "{:>5} {:>14} {:>14} {:>8} {:>12} {:>12}",
        "round", "direct conn/s", "VIP conn/s", "ratio", "direct p50", "VIP p50"
    );
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        let direct = measure(&lab, &client, "10.244.1.2:8080", connections)?;
        let vip = measure(&lab, &client, "10.96.0.10:80", connections)?;
        let ratio = vip.rate / direct.rate;
        ratios.push(ratio);
        println!(
            "{round:>5} {:>14.0} {:>14.0} {:>8.3} {:>10.1}us {:>10.1}us",
            direct.rate, vip.rate, ratio, direct.median_us, vip.median_us
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!("median VIP/direct connection-rate ratio: {:.3}", ratios[ratios.len() / 2]);
    Ok(())
}
