//! The nftables mode as the agent's loop drives it.

use super::render;
use crate::{backend::TrafficRules, model::IpFamily, plan::Node};

/// What the nftables ruleset of `family` depends on besides the services.
pub fn render_options(node: &Node, traffic: &TrafficRules, family: IpFamily) -> render::Options {
    render::Options {
        family,
        node_name: node.name.clone(),
        zone: node.zone.clone(),
        node_ips: node.ips.iter().copied().filter(|ip| IpFamily::of(*ip) == family).collect(),
        nodeport_addresses: traffic.nodeport_addresses.clone(),
        cluster_cidr: traffic.cluster_cidr(family),
        masquerade_all: traffic.masquerade_all,
    }
}
