//! The two-node web cluster the external-traffic scenarios share: its
//! pods, their endpoints, and the lab with agents on both nodes.

use crate::{EXT_IP, Lab, Pod, Setup, v6};

/// The two-node web pods' endpoints, by letter: `a` (web-a, 10.244.1.2, on
/// node 0), `b` and `c` (web-b 10.244.2.2, web-c 10.244.2.3, on node 1).
pub fn two_node_endpoints(pods: &[&str]) -> Vec<test_objects::EndpointBuilder> {
    pods.iter()
        .map(|p| {
            let (address, node) = two_node_pod(p);
            test_objects::ep(address).node(node)
        })
        .collect()
}

/// The same pods' IPv6 endpoints, in a dual-stack lab ([`v6`]).
pub fn two_node_endpoints6(pods: &[&str]) -> Vec<test_objects::EndpointBuilder> {
    pods.iter()
        .map(|p| {
            let (address, node) = two_node_pod(p);
            test_objects::ep(&v6(address)).node(node)
        })
        .collect()
}

/// The two-node web pods on a lab of two nodes: web-a on node 0, web-b
/// and web-c on node 1 ([`two_node_endpoints`]), each serving http 8080,
/// dns 5353/UDP and echo 9000.
fn add_two_node_web_pods(lab: &mut Lab) {
    for (node, letter) in [(0, "a"), (1, "b"), (1, "c")] {
        let (address, _) = two_node_pod(letter);
        let pod = lab.add_pod_on(node, &format!("web-{letter}"), address).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        lab.serve_echo(&pod, 9000).unwrap();
    }
}

/// A two-node web pod's IPv4 address and node, by letter.
fn two_node_pod(letter: &str) -> (&'static str, &'static str) {
    match letter {
        "a" => ("10.244.1.2", "lab-node"),
        "b" => ("10.244.2.2", "lab-node2"),
        "c" => ("10.244.2.3", "lab-node2"),
        other => panic!("no pod {other}"),
    }
}

/// The two-node cluster of the external-traffic scenarios: pods web-a
/// (node 0), web-b and web-c (node 1) serving HTTP on 8080, DNS on
/// 5353/UDP and an echo on 9000; an external client `ext` at
/// 192.168.100.101, its external service range routed to node 0;
/// `manifest`; on both nodes kube-proxy's drop of conntrack-INVALID
/// forwards and an agent with `--cluster-cidr 10.244.0.0/16` and `flags`.
pub fn two_node_web_cluster(setup: Setup, manifest: &str, flags: &[&str]) -> (Lab, Pod) {
    two_node_web_cluster_on(Stack::Ipv4, setup, manifest, flags)
}

/// The address families of a lab.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Stack {
    Ipv4,
    /// [`Lab::dual_stack`].
    Dual,
}

impl Stack {
    /// The agents' `--cluster-cidr` for the two-node cluster's pods.
    pub fn cluster_cidrs(self) -> &'static str {
        match self {
            Stack::Ipv4 => "10.244.0.0/16",
            Stack::Dual => "10.244.0.0/16,fd00:244::/32",
        }
    }
}

/// [`two_node_web_cluster`] of `stack`.
pub fn two_node_web_cluster_on(
    stack: Stack,
    setup: Setup,
    manifest: &str,
    flags: &[&str],
) -> (Lab, Pod) {
    let mut lab = Lab::with(setup).unwrap();
    if stack == Stack::Dual {
        lab.dual_stack().unwrap();
    }
    lab.add_node().unwrap();
    add_two_node_web_pods(&mut lab);
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    lab.write_manifest(manifest).unwrap();
    for node in 0..2 {
        lab.drop_invalid_forwards(node).unwrap();
        let mut args = vec!["--cluster-cidr", stack.cluster_cidrs()];
        args.extend(flags);
        lab.start_agent_on(node, &args).unwrap();
    }
    (lab, ext)
}
