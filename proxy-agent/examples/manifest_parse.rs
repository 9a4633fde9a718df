//! Time and peak memory of parsing one large manifest file, as the
//! manifests source does: `manifest_parse generate FILE N` writes N
//! ClusterIP Services and an EndpointSlice of 2 endpoints for each (YAML
//! documents, or for `*.json` one `kind: List` as `kubectl get -o json`
//! writes it);
//! `manifest_parse parse FILE` reads it (twice: new bytes are taken once two
//! reads agree), parses it, and prints the parse's wall time and the
//! process's peak RSS. Run it in release (docs/benchmarks.md).

use std::{fmt::Write as _, time::Instant};

use proxy_agent::source::manifests::Manifests;

fn generate(path: &str, services: u32) -> std::io::Result<()> {
    let json = path.ends_with(".json");
    let mut out = String::from(if json { "{\"apiVersion\": \"v1\", \"items\": [\n" } else { "" });
    for i in 0..services {
        let (hi, lo) = (i / 250 % 250, i % 250 + 1);
        if json {
            let comma = if i + 1 < services { "," } else { "" };
            let _ = write!(
                out,
                "{{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": {{\"name\": \"svc-{i}\", \"namespace\": \"bench\"}}, \
                 \"spec\": {{\"type\": \"ClusterIP\", \"clusterIP\": \"10.96.{hi}.{lo}\", \"ports\": [{{\"name\": \"http\", \"port\": 80, \"protocol\": \"TCP\", \"targetPort\": 8080}}]}}}},\n\
                 {{\"apiVersion\": \"discovery.k8s.io/v1\", \"kind\": \"EndpointSlice\", \"metadata\": {{\"name\": \"svc-{i}-1\", \"namespace\": \"bench\", \"labels\": {{\"kubernetes.io/service-name\": \"svc-{i}\"}}}}, \
                 \"addressType\": \"IPv4\", \"ports\": [{{\"name\": \"http\", \"port\": 8080, \"protocol\": \"TCP\"}}], \
                 \"endpoints\": [{{\"addresses\": [\"10.244.{hi}.{lo}\"], \"conditions\": {{\"ready\": true}}}}, {{\"addresses\": [\"10.245.{hi}.{lo}\"], \"conditions\": {{\"ready\": true}}}}]}}{comma}\n"
            );
            continue;
        }
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{i}\n  namespace: bench\n\
             spec:\n  type: ClusterIP\n  clusterIP: 10.96.{hi}.{lo}\n  ports:\n  - name: http\n    \
             port: 80\n    protocol: TCP\n    targetPort: 8080\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
             name: svc-{i}-1\n  namespace: bench\n  labels:\n    kubernetes.io/service-name: svc-{i}\n\
             addressType: IPv4\nports:\n- name: http\n  port: 8080\n  protocol: TCP\nendpoints:\n\
             - addresses: [10.244.{hi}.{lo}]\n  conditions: {{ready: true}}\n\
             - addresses: [10.245.{hi}.{lo}]\n  conditions: {{ready: true}}\n"
        );
    }
    if json {
        out.push_str("], \"kind\": \"List\", \"metadata\": {}}\n");
    }
    std::fs::write(path, out)
}

/// The process's peak resident set, from the kernel.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["generate", path, n] => generate(path, n.parse()?)?,
        ["parse", path] => {
            let mut manifests = Manifests::new(path);
            manifests.reload();
            let start = Instant::now();
            let reload = manifests.reload();
            let elapsed = start.elapsed();
            let snapshot = manifests.snapshot();
            println!(
                "services {} slices {} errors {} parse {:.2} s peak_rss {} MiB",
                snapshot.services.len(),
                snapshot.slices.len(),
                reload.errors.len(),
                elapsed.as_secs_f64(),
                peak_rss_kib().unwrap_or(0) / 1024,
            );
        }
        _ => return Err("usage: manifest_parse generate FILE N | parse FILE".into()),
    }
    Ok(())
}
