//! What the rules depend on besides the services.

use std::net::IpAddr;

use crate::model::{Cidr, IpFamily};

/// What the rules depend on besides the services.
#[derive(Clone, Debug)]
pub struct Options {
    /// The family rendered: its service ports, addresses and CIDRs only.
    pub family: IpFamily,
    /// This node's name: endpoints with this `nodeName` are local.
    pub node_name: String,
    /// Its zone, for EndpointSlice hints.
    pub zone: Option<String>,
    /// This node's addresses of `family` (for loadBalancerSourceRanges that
    /// admit the node, and `--nodeport-addresses`).
    pub node_ips: Vec<IpAddr>,
    /// `--nodeport-addresses`; empty means every local address.
    pub nodeport_addresses: Vec<Cidr>,
    /// `--cluster-cidr` of `family`: the local-traffic detector.
    pub cluster_cidr: Option<Cidr>,
    pub masquerade_all: bool,
    /// NodePorts answer on 127.0.0.0/8 (kube-proxy's default for IPv4), as
    /// `plan::Node::serves_localhost_nodeports` decides.
    pub localhost_nodeports: bool,
    /// The kernel has nfnetlink_acct counters (kube-proxy counts with them).
    pub nfacct: bool,
    /// iptables supports `MASQUERADE --random-fully` (1.6.2+).
    pub random_fully: bool,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` is set: kube-proxy then
    /// does not drop conntrack-INVALID forwards.
    pub conntrack_tcp_liberal: bool,
    /// SCTP ports get rules: false where the kernel refused them (no
    /// `sctp` match), leaving those ports out.
    pub sctp: bool,
}

impl Options {
    /// `--nodeport-addresses` of this family: none given means every
    /// address, and so does a /0 of the family.
    pub(super) fn nodeports_everywhere(&self) -> bool {
        self.nodeport_addresses.is_empty()
            || self.nodeport_addresses.iter().any(|c| c.len == 0 && c.family() == self.family)
    }

    /// Localhost NodePorts are on: IPv4 only.
    pub fn localhost_nodeports(&self) -> bool {
        self.family == IpFamily::V4 && self.localhost_nodeports
    }
}
