//! What the rules depend on besides the services.

use std::ops::{Deref, DerefMut};

use crate::{backend::rule_modes::RuleOptions, model::IpFamily};

/// What the rules depend on besides the services: the node's facts both
/// rule-based modes take (`rules`, which it derefs to), and iptables' own.
#[derive(Clone, Debug)]
pub struct Options {
    pub rules: RuleOptions,
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

impl Deref for Options {
    type Target = RuleOptions;

    fn deref(&self) -> &RuleOptions {
        &self.rules
    }
}

impl DerefMut for Options {
    fn deref_mut(&mut self) -> &mut RuleOptions {
        &mut self.rules
    }
}

impl Options {
    /// Localhost NodePorts are on: IPv4 only.
    pub fn localhost_nodeports(&self) -> bool {
        self.family == IpFamily::V4 && self.localhost_nodeports
    }
}
