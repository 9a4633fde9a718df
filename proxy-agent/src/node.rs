//! This node: its name, its addresses, and what its Node object says (zone
//! for topology hints, whether load balancers should still send it traffic).

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Node;

use crate::sys;

/// The node label naming its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The taint the cluster autoscaler puts on a node it is about to remove.
const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// `--hostname-override`, else the hostname, lowercased (kube-proxy's rule).
pub fn name(hostname_override: &Option<String>) -> anyhow::Result<String> {
    if let Some(name) = hostname_override {
        return Ok(name.clone());
    }
    let name =
        std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading the hostname")?;
    Ok(name.trim().to_lowercase())
}

/// Where this node's addresses come from, and so when the agent must
/// restart to use new ones (as kube-proxy does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddressSource {
    /// `--node-ip`, or the interfaces' addresses found at start: fixed.
    Fixed,
    /// The Node object's InternalIPs: a change restarts the agent.
    NodeObject,
    /// None found at start (ClusterIPs only): the first interface address
    /// (beside these pod-facing prefixes) restarts the agent to serve
    /// NodePorts on it.
    AwaitingInterfaces { pod_interfaces: Vec<String> },
}

/// The IPv4 and IPv6 addresses of the interfaces that are neither loopback
/// nor pod-facing, those of the default route's interface first (the first
/// IPv4 one is the SNAT address: replies must find their way back to it).
/// Link-local addresses are not node addresses. Possibly none.
pub fn interface_ips(pod_interfaces: &[String]) -> anyhow::Result<Vec<IpAddr>> {
    let mut interfaces: Vec<(String, Vec<IpAddr>)> =
        sys::interfaces().context("listing interfaces")?.into_iter().collect();
    let uplink = sys::default_route_interface();
    interfaces.sort_by_key(|(name, _)| Some(name) != uplink.as_ref());
    let ips: Vec<IpAddr> = interfaces
        .iter()
        .filter(|(name, _)| !is_pod_facing(name, pod_interfaces))
        .flat_map(|(_, addrs)| addrs.iter().copied())
        .filter(|ip| is_node_address(*ip))
        .collect();
    Ok(ips)
}

fn is_node_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => !ip.is_loopback() && !ip.is_link_local(),
        IpAddr::V6(ip) => !ip.is_loopback() && !ip.is_unicast_link_local(),
    }
}

fn is_pod_facing(name: &str, prefixes: &[String]) -> bool {
    prefixes.iter().any(|p| !p.is_empty() && name.starts_with(p.as_str()))
}

/// Which side of the node an interface faces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Facing {
    /// It holds a node address: clients outside the node come in here.
    Node,
    /// Its name says a pod is behind it.
    Pod,
}

/// The interfaces the per-packet programs go on, and the side each faces:
/// those holding a node address, and pod-facing ones (by name prefix).
pub fn tc_interfaces(
    interfaces: &BTreeMap<String, Vec<IpAddr>>,
    node_ips: &[IpAddr],
    pod_prefixes: &[String],
) -> BTreeMap<String, Facing> {
    interfaces
        .iter()
        .filter(|(name, _)| name.as_str() != "lo")
        .filter_map(|(name, addrs)| {
            let facing = if addrs.iter().any(|a| node_ips.contains(a)) {
                Facing::Node
            } else if is_pod_facing(name, pod_prefixes) {
                Facing::Pod
            } else {
                return None;
            };
            Some((name.clone(), facing))
        })
        .collect()
}

/// Whether this node should receive load-balancer traffic, from its Node
/// object (kube-proxy: it exists, is not being deleted, and has no
/// `ToBeDeletedByClusterAutoscaler` taint). Without an API server there is
/// no Node object, and the node is taken as eligible.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeEligibility {
    NoApiServer,
    Eligible,
    Ineligible,
}

/// What the Node object says about this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub zone: Option<String>,
    pub eligibility: NodeEligibility,
    /// `status.addresses` of type InternalIP (both families), in order.
    pub internal_ips: Vec<IpAddr>,
}

impl NodeInfo {
    /// From the Node object; `None` (not found) means ineligible, as for
    /// kube-proxy.
    pub fn of(node: Option<&Node>) -> Self {
        let Some(node) = node else {
            return NodeInfo {
                zone: None,
                eligibility: NodeEligibility::Ineligible,
                internal_ips: Vec::new(),
            };
        };
        let zone = node.metadata.labels.as_ref().and_then(|l| l.get(ZONE_LABEL)).cloned();
        let deleting = node.metadata.deletion_timestamp.is_some();
        let tainted = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|taints| taints.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
        let eligibility = if deleting || tainted {
            NodeEligibility::Ineligible
        } else {
            NodeEligibility::Eligible
        };
        let internal_ips = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
        NodeInfo { zone, eligibility, internal_ips }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn per_packet_interfaces_are_node_and_pod_facing_ones() {
        let interfaces: BTreeMap<String, Vec<IpAddr>> = [
            ("lo", vec!["127.0.0.1"]),
            ("eth0", vec!["192.168.100.11"]),
            ("eth1", vec!["172.16.0.1"]),
            ("eth2", vec!["fd00:100::11", "fe80::1"]),
            ("veth1", vec!["169.254.1.1"]),
            ("lxc12", vec![]),
            ("docker0", vec!["172.17.0.1"]),
        ]
        .into_iter()
        .map(|(n, a)| (n.to_string(), a.iter().map(|a| a.parse().unwrap()).collect()))
        .collect();
        let node_ips = ["192.168.100.11".parse().unwrap(), "fd00:100::11".parse().unwrap()];
        let wanted = tc_interfaces(&interfaces, &node_ips, &["veth".into(), "lxc".into()]);
        let facing: Vec<(&str, Facing)> = wanted.iter().map(|(n, f)| (n.as_str(), *f)).collect();
        let (node, pod) = (Facing::Node, Facing::Pod);
        assert_eq!(facing, [("eth0", node), ("eth2", node), ("lxc12", pod), ("veth1", pod)]);
        let node_addresses: Vec<bool> =
            ["10.0.0.1", "127.0.0.1", "169.254.0.1", "fd00::1", "::1", "fe80::1"]
                .map(|ip| is_node_address(ip.parse().unwrap()))
                .into();
        assert_eq!(node_addresses, [true, false, false, true, false, false]);
    }

    #[test]
    fn node_objects_give_zone_addresses_and_eligibility() {
        let node: Node = crate::yaml::from_str(
            "metadata: {name: n1, labels: {topology.kubernetes.io/zone: zone-a}}\nstatus: {addresses: [{type: Hostname, address: n1}, {type: InternalIP, address: 192.168.100.11}, {type: InternalIP, address: 'fd00::1'}]}",
        )
        .unwrap();
        let info = NodeInfo::of(Some(&node));
        assert_eq!(info.zone.as_deref(), Some("zone-a"));
        let both: [IpAddr; 2] =
            [Ipv4Addr::new(192, 168, 100, 11).into(), "fd00::1".parse().unwrap()];
        assert_eq!(info.internal_ips, both);
        assert_eq!(info.eligibility, NodeEligibility::Eligible);
        let tainted: Node = crate::yaml::from_str(
            "metadata: {name: n1}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}",
        )
        .unwrap();
        assert_eq!(NodeInfo::of(Some(&tainted)).eligibility, NodeEligibility::Ineligible);
        assert_eq!(NodeInfo::of(None).eligibility, NodeEligibility::Ineligible);
    }
}
