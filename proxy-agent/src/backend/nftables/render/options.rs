//! What the nftables ruleset depends on besides the services.

use std::net::IpAddr;

use crate::model::{Cidr, IpFamily};

/// What the ruleset depends on besides the services.
#[derive(Clone, Debug)]
pub struct Options {
    /// The family rendered (table `ip kube-proxy` or `ip6 kube-proxy`):
    /// its service ports, addresses and CIDRs only.
    pub family: IpFamily,
    /// This node's name: endpoints with this `nodeName` are local.
    pub node_name: String,
    /// Its zone, for EndpointSlice hints.
    pub zone: Option<String>,
    /// This node's addresses of `family`, its primary one first (the one
    /// kube-proxy checks against loadBalancerSourceRanges).
    pub node_ips: Vec<IpAddr>,
    /// `--nodeport-addresses`; empty means every local address.
    pub nodeport_addresses: Vec<Cidr>,
    /// `--cluster-cidr` of `family`: the local-traffic detector.
    pub cluster_cidr: Option<Cidr>,
    pub masquerade_all: bool,
}

impl Options {
    /// The addresses NodePorts are served on (`nodeport-ips`), or `None`
    /// for every local address but loopback (no `--nodeport-addresses` of
    /// this family narrower than /0). Loopback addresses are left out, as
    /// kube-proxy's nftables mode does: no localhost NodePorts.
    pub fn nodeport_ips(&self) -> Option<Vec<IpAddr>> {
        let everywhere = self.nodeport_addresses.is_empty()
            || self.nodeport_addresses.iter().any(|c| c.len == 0 && c.family() == self.family);
        if everywhere {
            return None;
        }
        Some(
            self.node_ips
                .iter()
                .copied()
                .filter(|ip| !ip.is_loopback())
                .filter(|ip| self.nodeport_addresses.iter().any(|c| c.contains(*ip)))
                .collect(),
        )
    }
}
