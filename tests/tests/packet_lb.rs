//! The per-packet datapath in the lab: two nodes on a fabric with routed pod
//! CIDRs, external clients, NodePorts, load-balancer and external IPs, and
//! ClusterIP traffic from pods outside the socket-LB cgroup. Each node drops
//! conntrack-INVALID forwards, as kube-proxy's KUBE-FORWARD chain does.

use std::{
    io::{BufRead, BufReader},
    time::{Duration, Instant},
};

use proxy_common::Counter;
use proxy_lab::{Attempt, Lab, Pod, tally};

const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// Two nodes, each running an agent on the same manifest; pods a (node 0),
/// b and c (node 1) serve TCP 8080 and UDP 5353; two external clients.
struct Cluster {
    lab: Lab,
    pods: Vec<Pod>,
    ext: Pod,
    ext2: Pod,
}

fn cluster(manifest: &str) -> Cluster {
    let mut lab = Lab::new().unwrap();
    lab.add_node().unwrap();
    let mut pods = Vec::new();
    for (node, name, ip) in [(0, "web-a", "10.244.1.2"), (1, "web-b", "10.244.2.2"), (1, "web-c", "10.244.2.3")] {
        let pod = lab.add_pod_on(node, name, ip).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        pods.push(pod);
    }
    let ext = lab.add_external("ext", "192.168.100.101").unwrap();
    let ext2 = lab.add_external("ext2", "192.168.100.102").unwrap();
    lab.write_manifest(manifest).unwrap();
    for node in 0..2 {
        lab.drop_invalid_forwards(node).unwrap();
        lab.start_agent_on(node, &["--cluster-cidr", CLUSTER_CIDR]).unwrap();
    }
    Cluster { lab, pods, ext, ext2 }
}

/// A service over the three pods (`a`, `b`, `c` as given) with extra spec
/// lines and extra endpoints YAML.
fn service(name: &str, cluster_ip: &str, spec: &str, endpoints: &[&str]) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|e| {
            let (ip, node) = match *e {
                "a" => ("10.244.1.2", "lab-node"),
                "b" => ("10.244.2.2", "lab-node2"),
                "c" => ("10.244.2.3", "lab-node2"),
                other => panic!("no pod {other}"),
            };
            format!("\n- {{addresses: [{ip}], nodeName: {node}}}")
        })
        .collect();
    let endpoints = if endpoints.is_empty() { " []".to_string() } else { endpoints };
    format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: lab}}
spec:
  clusterIP: {cluster_ip}
{spec}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: lab, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}, {{name: dns, port: 5353, protocol: UDP}}]
endpoints:{endpoints}
"#
    )
}

const PORTS_30080: &str = "  type: NodePort
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}";

fn ok_attempts(attempts: &[Attempt]) -> Vec<(String, String, String)> {
    attempts
        .iter()
        .map(|a| match a {
            Attempt::Ok { name, peer, from, .. } => (name.clone(), peer.clone(), from.clone()),
            err => panic!("failed attempt: {err:?} in {attempts:?}"),
        })
        .collect()
}

fn peer_ip(peer: &str) -> &str {
    peer.split(':').next().unwrap()
}

#[test]
fn node_port_cluster_policy_reaches_every_endpoint_snated_to_the_node() {
    let c = cluster(&service("web", "10.96.0.10", PORTS_30080, &["a", "b", "c"]));
    let attempts = c.lab.client_outside(&c.ext, &["tcp", "192.168.100.11:30080", "90"]).unwrap();
    let seen = ok_attempts(&attempts);
    assert_eq!(tally(&attempts).len(), 3, "every endpoint: {:?}", tally(&attempts));
    for (name, peer, _) in &seen {
        assert_eq!(peer_ip(peer), "192.168.100.11", "{name} saw {peer}, not the node");
    }
    assert!(c.lab.counter_on(0, Counter::CtNew).unwrap() >= 90);
}
