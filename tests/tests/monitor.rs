//! `proxy-agent monitor` in the lab: a connection through a service per
//! packet (from outside, to a NodePort) and one from a pod (eBPF: at
//! `connect`), one to a service without endpoints and one from outside to a
//! NodePort of policy Local without a local endpoint, each show up as a
//! line naming the service, with the tuple translated to the backend the
//! connection reached, or the refusal or drop and its reason; `--drops` and
//! `--service` keep only what they name.

use std::{
    sync::mpsc,
    time::{Duration, Instant},
};

use proxy_lab::{Attempt, EXT_IP, Lab, Mode, NODE_IP, Pod, Setup, external_modes, node_port};
use serde_json::Value;
use test_objects::{Protocol::*, ep, manifest, port, service};

external_modes!(monitor_shows_translations_refusals_and_drops_with_their_service);

/// A running monitor's lines (`-o json`), read by a thread of their own.
struct Stream(mpsc::Receiver<Value>);

impl Stream {
    fn start(lab: &mut Lab, filters: &[&str]) -> Stream {
        let mut args = vec!["monitor", "-o", "json", "--duration", "120s"];
        args.extend(filters);
        let lines = lab.spawn_inspect_on(0, &args).unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let value = serde_json::from_str(&line).unwrap_or(Value::String(line));
                if tx.send(value).is_err() {
                    break;
                }
            }
        });
        Stream(rx)
    }

    /// The first line `wanted` matches within `wait` (those before it
    /// skipped); `None` if none came.
    fn find(&self, wait: Duration, wanted: impl Fn(&Value) -> bool) -> Option<Value> {
        let end = Instant::now() + wait;
        loop {
            match self.0.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(line) if wanted(&line) => return Some(line),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }

    /// Whether the monitor ended (its output closed) within `wait`, what it
    /// printed meanwhile.
    fn rest(&self, wait: Duration) -> Result<Vec<Value>, Vec<Value>> {
        let end = Instant::now() + wait;
        let mut lines = Vec::new();
        loop {
            match self.0.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(line) => lines.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(lines),
                Err(mpsc::RecvTimeoutError::Timeout) => return Err(lines),
            }
        }
    }
}

/// The one attempt a client made, succeeded.
fn reached(attempts: &[Attempt]) -> (String, String) {
    match attempts {
        [Attempt::Ok { local, peer, .. }] => (local.clone(), peer.clone()),
        other => panic!("one connection expected: {other:?}"),
    }
}

fn is(line: &Value, service: &str, verdict: &str) -> bool {
    line["service"] == service && line["verdict"] == verdict
}

/// Connects from outside to the NodePort until a monitor's line shows the
/// connection (it may have started before the monitor did); that line and
/// the connection's (backend, peer) as the backend saw them.
fn node_port_line(lab: &Lab, ext: &Pod, stream: &Stream) -> (Value, (String, String)) {
    for _ in 0..20 {
        let attempts = lab.client_outside(ext).tcp(&node_port(30080), 1).unwrap();
        let (local, peer) = reached(&attempts);
        let shows = |l: &Value| {
            is(l, "demo/web:http", "translated")
                && l["after"].as_str().is_some_and(|a| a.ends_with(&format!("-> {local}")))
                && l["before"].as_str().is_some_and(|b| b.ends_with(&format!("-> {NODE_IP}:30080")))
        };
        if let Some(line) = stream.find(Duration::from_secs(2), shows) {
            return (line, (local, peer));
        }
    }
    panic!("no line of the NodePort connection");
}

fn monitor_shows_translations_refusals_and_drops_with_their_service(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    let pods = lab.add_web_pods(2, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let web = service("demo", "web")
        .node_port_type()
        .cluster_ip("10.96.0.10")
        .port(port("http", 80).target(8080).node_port(30080));
    let endpoints = pods.iter().map(|p| ep(&p.ip).ready(true).node("lab-node"));
    let slice = web.slice().port("http", 8080, Tcp).endpoints(endpoints);
    let empty = service("demo", "empty").cluster_ip("10.96.0.11").port(port("http", 80));
    // Policy Local with its only endpoint on another node: dropped here.
    let far = service("demo", "far")
        .node_port_type()
        .cluster_ip("10.96.0.12")
        .port(port("http", 80).target(8080).node_port(30081))
        .external_policy("Local");
    let elsewhere = [ep("10.244.2.3").ready(true).node("other-node")];
    let far_slice = far.slice().port("http", 8080, Tcp).endpoints(elsewhere);
    lab.write_manifest(&manifest(&[&web, &slice, &empty, &far, &far_slice])).unwrap();
    lab.start_agent(&[]).unwrap();
    let refuse = |lab: &Lab| lab.client(&client).timeout_ms(1000).tcp("10.96.0.11:80", 1).unwrap();

    // Refusals and drops come from the rules' counters: kube-proxy's
    // nftables rules count nothing, its monitor shows translations only.
    let counted = setup.mode.counts();
    if counted {
        // Filtered: only the refusal of the empty service, then it stops
        // (--count). Alone: in the eBPF mode monitors share one ring buffer.
        let drops =
            Stream::start(&mut lab, &["--drops", "--service", "demo/empty", "--count", "1"]);
        let mut refusal = None;
        for _ in 0..20 {
            lab.client(&client).tcp("10.96.0.10:80", 1).unwrap();
            let attempts = refuse(&lab);
            assert!(matches!(attempts.as_slice(), [Attempt::Err { .. }]), "{attempts:?}");
            refusal = drops.find(Duration::from_secs(2), |_| true);
            if refusal.is_some() {
                break;
            }
        }
        let refusal = refusal.expect("a line of the refusal");
        assert!(is(&refusal, "demo/empty:http", "refused"), "{refusal}");
        assert_eq!(refusal["reason"], "no endpoint", "{refusal}");
        let rest = drops.rest(Duration::from_secs(10));
        assert_eq!(rest, Ok(vec![]), "--count 1: one line, then the end");
    }

    // Unfiltered: per packet from outside, the tuple as the backend saw it.
    let all = Stream::start(&mut lab, &[]);
    let (line, (local, peer)) = node_port_line(&lab, &ext, &all);
    assert_eq!(line["after"], format!("{peer} -> {local}"), "{line}");
    assert!(line["before"].as_str().unwrap().starts_with(&format!("{EXT_IP}:")), "{line}");
    // With XDP, the flow is made at the driver hook.
    let per_packet_hook = if setup.xdp { "xdp_ingress" } else { "tc_ingress" };
    if setup.mode == Mode::Ebpf {
        assert_eq!(line["hook"], per_packet_hook, "{line}");
    }
    // From a pod: the eBPF mode translates at connect (no source yet).
    let (local, _) = reached(&lab.client(&client).tcp("10.96.0.10:80", 1).unwrap());
    let pod_line = all.find(Duration::from_secs(10), |l| {
        is(l, "demo/web:http", "translated")
            && l["before"].as_str().is_some_and(|b| b.ends_with("-> 10.96.0.10:80"))
    });
    let pod_line = pod_line.expect("a line of the pod's connection");
    let after = pod_line["after"].as_str().unwrap();
    assert!(after.ends_with(&format!("-> {local}")), "{pod_line}");
    if !counted {
        return;
    }
    let attempts = refuse(&lab);
    assert!(matches!(attempts.as_slice(), [Attempt::Err { .. }]), "{attempts:?}");
    let refusal = all.find(Duration::from_secs(10), |l| is(l, "demo/empty:http", "refused"));
    assert_eq!(refusal.expect("a line of the refusal")["reason"], "no endpoint");

    // A drop: from outside to the Local NodePort, no endpoint on this node.
    let attempts = lab.client_outside(&ext).timeout_ms(500).tcp(&node_port(30081), 1).unwrap();
    assert!(matches!(attempts.as_slice(), [Attempt::Err { .. }]), "{attempts:?}");
    let drop = all.find(Duration::from_secs(10), |l| is(l, "demo/far:http", "dropped"));
    let drop = drop.expect("a line of the drop");
    assert_eq!(drop["reason"], "no local endpoint, policy Local", "{drop}");
    if setup.mode == Mode::Ebpf {
        assert_eq!(drop["hook"], per_packet_hook, "{drop}");
    }
    // The rules name a NodePort on every local address: `-> *:30081`.
    assert!(drop["before"].as_str().unwrap().ends_with(":30081"), "{drop}");
}
