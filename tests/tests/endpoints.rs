//! The agent's HTTP endpoints under abuse, and its logs as JSON. Neither
//! depends on the datapath: they run in the lab's default mode.
//!
//! The metrics and health ports listen in the node's namespace: every
//! client here runs inside it (labpod), never in the host's.

use proxy_lab::Lab;
use test_objects::{Protocol::*, ep, manifest, port, service};

fn lab_serving(extra: &[&str]) -> Lab {
    let mut lab = Lab::new().unwrap();
    let pod = lab.add_web_pods(1, &[8080], &[]).unwrap().remove(0);
    let svc = service("lab", "web").cluster_ip("10.96.0.10").port(port("http", 80).target(8080));
    let slice = svc.slice().port("http", 8080, Tcp).endpoints([ep(&pod.ip).node("lab-node")]);
    lab.write_manifest(&manifest(&[&svc, &slice])).unwrap();
    lab.start_agent(extra).unwrap();
    lab
}

/// Garbage, an endless header, a slowloris client and 1,000 idle
/// connections on each port: the probes keep answering meanwhile, the
/// malformed requests get an error status, the slow client is dropped.
#[test]
fn malformed_and_slow_requests_leave_the_probes_answering() {
    let lab = lab_serving(&[]);
    for (addr, probes) in [
        ("127.0.0.1:10256", &["/healthz", "/livez"][..]),
        ("127.0.0.1:10249", &["/metrics", "/healthz", "/proxyMode"][..]),
    ] {
        let out = lab.client_in(&lab.node, None).timeout_ms(3000).http_abuse(addr, probes).unwrap();
        assert!(out.contains("garbage HTTP/1.1 400 "), "{addr}:\n{out}");
        assert!(out.contains("endless HTTP/1.1 431 "), "{addr}:\n{out}");
        for probe in probes {
            assert!(out.contains(&format!("probe {probe} HTTP/1.1 200 OK")), "{addr}:\n{out}");
        }
        assert!(out.contains("idle 1000"), "{addr}:\n{out}");
        let slowloris = out.lines().find(|l| l.starts_with("slowloris")).unwrap_or_default();
        let ms: u64 = slowloris
            .strip_prefix("slowloris closed ms=")
            .map_or(u64::MAX, |ms| ms.parse().unwrap());
        // Dropped after the 10 s allowed for a request head, not before.
        assert!((10_000..15_000).contains(&ms), "{addr}: {slowloris}\n{out}");
    }
    assert!(lab.metrics().unwrap().contains("kubeproxy_proxy_healthz_total"));
}

/// `--logging-format json`: one JSON object a line, the event's values as
/// fields of their own, not formatted into the message.
#[test]
fn json_logs_keep_fields_structured() {
    let lab = lab_serving(&["--logging-format", "json"]);
    let log = lab.agent_log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let serving = lines
        .iter()
        .find(|l| l["fields"]["message"] == "datapath ready; serving")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(serving["level"], "INFO", "{serving}");
    assert_eq!(serving["fields"]["mode"], lab.mode.as_arg(), "{serving}");
    assert_eq!(serving["fields"]["source"], "manifests", "{serving}");
    let whole = lines.iter().find(|l| l["fields"]["message"] == "source read whole").unwrap();
    assert_eq!(whole["fields"]["services"], 1, "a count, as a number: {whole}");
}
