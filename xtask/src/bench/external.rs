//! The external path on two nodes: direct, SNAT, DSR, DSR with Maglev.

use std::fmt::Write as _;

use proxy_lab::{Lab, Mode, Pod, Setup, Source, sh};
use serde_json::{Value, json};

use super::wrk::{Run, open_client_ports, rate, start_nginx, wait_answering};
use super::{Options, median};

/// The external path's backend pod, on the second node, and the external
/// client.
const EXTERNAL_POD: &str = "10.244.2.2";

const EXTERNAL_CLIENT: &str = "192.168.100.101";

const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// The external path's rounds at most (each has ports of its own).
const EXTERNAL_MAX_ROUNDS: usize = 9;

/// One kind of external run: its name in the results, whether it goes
/// through a NodePort of the first node (or straight to the pod's
/// address), and the annotations of its services.
struct ExternalKind {
    name: &'static str,
    node_port: bool,
    annotations: &'static [(&'static str, &'static str)],
}

const FORWARDING: &str = "proxy-agent.io/forwarding-mode";

const EXTERNAL_KINDS: [ExternalKind; 4] = [
    ExternalKind { name: "direct", node_port: false, annotations: &[] },
    ExternalKind { name: "snat", node_port: true, annotations: &[(FORWARDING, "snat")] },
    ExternalKind { name: "dsr", node_port: true, annotations: &[(FORWARDING, "dsr")] },
    ExternalKind {
        name: "maglev_dsr",
        node_port: true,
        annotations: &[(FORWARDING, "dsr"), ("proxy-agent.io/lb-algorithm", "maglev")],
    },
];

/// The pod's port and the NodePort of kind `kind` (an index into
/// [`EXTERNAL_KINDS`]) in round `round` (0: the warm-up). Every run has
/// ports of its own, so no run meets the 4-tuples another left behind:
/// in the pod (TIME_WAIT, the same client address and ports for the
/// direct and DSR runs), in the first node's SNAT ports (a closed flow's
/// port rests 60 s: one backend address and port takes about 1,000 new
/// SNAT flows a second for long) and in the DSR flows the second node
/// learnt (see docs/benchmarks.md).
fn external_ports(round: usize, kind: usize) -> (u16, u16) {
    let offset = (10 * round + kind) as u16;
    (8080 + offset, 30080 + offset)
}

/// The external path's NodePort services (policy Cluster): one per kind
/// but the direct one and round, each with the pod on the second node as
/// its only endpoint.
fn external_manifest(rounds: usize) -> String {
    let mut out = String::new();
    for round in 0..=rounds {
        for (k, kind) in EXTERNAL_KINDS.iter().enumerate().filter(|(_, kind)| kind.node_port) {
            let (port, node_port) = external_ports(round, k);
            let annotations: Vec<String> =
                kind.annotations.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let _ = write!(
                out,
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: bench, annotations: {{{annotations}}}}}\nspec: {{clusterIP: 10.96.1.{ip}, type: NodePort, ports: [{{name: http, port: 80, targetPort: {port}, nodePort: {node_port}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: bench, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: {port}}}]\nendpoints: [{{addresses: [{EXTERNAL_POD}], nodeName: lab-node2}}]\n",
                name = format!("{}-{round}", kind.name.replace('_', "-")),
                annotations = annotations.join(", "),
                ip = 10 * round + k + 1,
            );
        }
    }
    out
}

/// The addresses the pod's TIME_WAIT sockets on `port` name as their
/// peer: who the pod saw connecting (the server closes first).
fn pod_peers(lab: &Lab, pod: &Pod, port: u16) -> anyhow::Result<Vec<String>> {
    let sport = format!(":{port}");
    let out =
        lab.run_in(&pod.netns, None, "ss", &["-Htn", "state", "time-wait", "sport", "=", &sport])?;
    let mut peers: Vec<String> = out
        .lines()
        .filter_map(|l| Some(l.split_whitespace().last()?.rsplit_once(':')?.0.to_string()))
        .collect();
    peers.sort();
    peers.dedup();
    Ok(peers)
}

/// The external path on two nodes (eBPF mode): an external client's
/// connections (wrk, `Connection: close`) to nginx in a pod on the second
/// node, straight to the pod's address (routed via that node), and through
/// the first node's NodePorts: SNAT, DSR, and DSR with Maglev, all served
/// by the same agents (a service annotation each), in `rounds` rounds that
/// take the kinds in turn (each round starting one further along), the
/// median of each. A warm-up run of each kind checks first that each path
/// is what it claims: the pod sees the client's address directly and with
/// DSR, the first node's with SNAT.
pub(super) fn external_path(opts: &Options) -> anyhow::Result<Value> {
    anyhow::ensure!(
        opts.rounds <= EXTERNAL_MAX_ROUNDS,
        "the external path takes {EXTERNAL_MAX_ROUNDS} rounds at most"
    );
    let mut lab = Lab::with(Setup::of(Mode::Ebpf, Source::Manifests))?;
    let node2 = lab.add_node()?;
    let web = lab.add_pod_on(node2, "web-0", EXTERNAL_POD)?;
    let ports: Vec<u16> = (0..=opts.rounds)
        .flat_map(|round| (0..EXTERNAL_KINDS.len()).map(move |k| external_ports(round, k).0))
        .collect();
    start_nginx(&mut lab, &web, &ports, false)?;
    let ext = lab.add_external("ext", EXTERNAL_CLIENT)?;
    open_client_ports(&ext.netns)?;
    // The direct runs cross the second node only, as its forwarding.
    let (node1_ip, node2_ip) = (lab.nodes()[0].ip.clone(), lab.nodes()[node2].ip.clone());
    let pod_cidr = lab.nodes()[node2].pod_cidr.clone();
    sh("ip", &["-n", &ext.netns, "route", "add", &pod_cidr, "via", &node2_ip])?;
    lab.write_manifest(&external_manifest(opts.rounds))?;
    for node in 0..lab.nodes().len() {
        lab.drop_invalid_forwards(node)?;
        lab.start_agent_on(node, &["--cluster-cidr", CLUSTER_CIDR])?;
    }
    let addr = |round: usize, k: usize| {
        let (port, node_port) = external_ports(round, k);
        match EXTERNAL_KINDS[k].node_port {
            true => format!("{node1_ip}:{node_port}"),
            false => format!("{EXTERNAL_POD}:{port}"),
        }
    };
    for (k, kind) in EXTERNAL_KINDS.iter().enumerate() {
        wait_answering(&lab, &ext, &addr(0, k))?;
        rate(&lab, &ext, false, &addr(0, k), 1)?;
        let expected = if kind.name == "snat" { &node1_ip } else { &ext.ip };
        let peers = pod_peers(&lab, &web, external_ports(0, k).0)?;
        anyhow::ensure!(
            peers == [expected.clone()],
            "{}: the pod saw {peers:?}, not {expected}",
            kind.name
        );
    }
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); EXTERNAL_KINDS.len()];
    for round in 1..=opts.rounds {
        for i in 0..EXTERNAL_KINDS.len() {
            let k = (round + i) % EXTERNAL_KINDS.len();
            runs[k].push(rate(&lab, &ext, false, &addr(round, k), opts.seconds)?);
        }
    }
    let errors: u64 = runs.iter().flatten().map(|r| r.errors).sum();
    let mut result = json!({"rounds": opts.rounds, "seconds": opts.seconds, "errors": errors});
    for (kind, values) in EXTERNAL_KINDS.iter().zip(&runs) {
        let name = kind.name;
        result[format!("{name}_per_s")] = json!(median(values.iter().map(|r| r.per_s).collect()));
        result[format!("{name}_cpu_ms_per_10k")] =
            json!(median(values.iter().map(|r| r.cpu_ms_per_10k).collect()));
        result[format!("{name}_runs")] =
            json!(values.iter().map(|r| [r.per_s, r.cpu_ms_per_10k]).collect::<Vec<_>>());
    }
    let figure = |name: &str, what: &str| result[format!("{name}_{what}")].as_f64();
    let mut ratios = Vec::new();
    for (of, to) in [
        ("snat", "direct"),
        ("dsr", "direct"),
        ("maglev_dsr", "direct"),
        ("dsr", "snat"),
        ("maglev_dsr", "dsr"),
    ] {
        for (what, key) in [("per_s", "rate"), ("cpu_ms_per_10k", "cpu")] {
            if let (Some(a), Some(b)) = (figure(of, what), figure(to, what)) {
                ratios.push((format!("{of}_{key}_vs_{to}"), a / b));
            }
        }
    }
    for (key, value) in ratios {
        result[key] = json!(value);
    }
    eprintln!("  {result}");
    Ok(result)
}
