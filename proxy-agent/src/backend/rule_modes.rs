//! What the rule-based modes (iptables, nftables) do alike: the node facts
//! their rules depend on, the bookkeeping around one family's sync (as
//! kube-proxy's proxier per family times and counts its own), and the
//! kernel's conntrack table they both rely on.

use std::{collections::BTreeSet, net::IpAddr, sync::atomic::Ordering::Relaxed, time::Instant};

use super::{Synced, TrafficRules, conntrack_limit};
use crate::{
    metrics::Metrics,
    model::{Cidr, IpFamily},
    plan::{Node, Plan},
    sys,
};

/// What a family's rules depend on besides the services, in either mode.
#[derive(Clone, Debug)]
pub struct RuleOptions {
    /// The family rendered: its service ports, addresses and CIDRs only.
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

impl RuleOptions {
    /// `node`'s and `traffic`'s, for `family`.
    pub fn new(node: &Node, traffic: &TrafficRules, family: IpFamily) -> Self {
        RuleOptions {
            family,
            node_name: node.name.clone(),
            zone: node.zone.clone(),
            node_ips: node.ips.iter().copied().filter(|ip| IpFamily::of(*ip) == family).collect(),
            nodeport_addresses: traffic.nodeport_addresses.clone(),
            cluster_cidr: traffic.cluster_cidr(family),
            masquerade_all: traffic.masquerade_all,
        }
    }

    /// `--nodeport-addresses` of this family: none given means every
    /// address, and so does a /0 of the family.
    pub fn nodeports_everywhere(&self) -> bool {
        self.nodeport_addresses.is_empty()
            || self.nodeport_addresses.iter().any(|c| c.len == 0 && c.family() == self.family)
    }
}

/// Runs one family's `sync`, times it (`full` of what it returns) and
/// counts its failure when `refused` says the write was refused (and
/// whether it was a full one).
pub fn timed_sync<T, E>(
    family: IpFamily,
    metrics: &Metrics,
    sync: impl FnOnce() -> Result<T, E>,
    full: impl Fn(&T) -> bool,
    refused: impl Fn(&E) -> Option<bool>,
) -> Result<T, E> {
    let start = Instant::now();
    let report = sync().inspect_err(|err| {
        if let Some(full) = refused(err) {
            let rules = metrics.rules(family);
            rules.restore_failures.fetch_add(1, Relaxed);
            if !full {
                rules.partial_restore_failures.fetch_add(1, Relaxed);
            }
        }
    })?;
    metrics.rules(family).synced(start.elapsed(), full(&report));
    Ok(report)
}

/// What a rule-based mode's sync tells the loop: the plan's distinct
/// backends. Says once (`told`) that Maglev and DSR, which the plan may
/// ask for, are the eBPF mode's: `rules` pick at random and masquerade.
pub fn synced(plan: &Plan, told: &mut bool, rules: &str) -> Synced {
    if !*told && plan.frontends.values().any(|f| f.maglev || f.dsr) {
        *told = true;
        tracing::warn!(
            "Maglev and DSR (--bpf-lb-algorithm, --bpf-lb-mode, their annotations) are eBPF-mode features: {rules} pick backends at random and masquerade, as kube-proxy's"
        );
    }
    let backends: BTreeSet<_> =
        plan.frontends.values().flat_map(|f| &f.backends).map(|b| b.addr).collect();
    Synced { backends: backends.len() }
}

/// Raises the kernel's conntrack table to `max` flows as kube-proxy does
/// (see [`conntrack_limit::kernel_writes`]). A failure is logged: the rules
/// serve regardless (outside the node's initial network namespace the
/// kernel refuses both writes).
pub fn raise_conntrack_max(max: u32) {
    let current = match sys::read_number(sys::NF_CONNTRACK_MAX) {
        Ok(current) => current,
        Err(e) => {
            tracing::warn!(error = %e, path = sys::NF_CONNTRACK_MAX, "could not read the kernel's conntrack maximum: left as it is");
            return;
        }
    };
    let hashsize = sys::read_number(sys::NF_CONNTRACK_HASHSIZE).ok();
    let writes = conntrack_limit::kernel_writes(max, current, hashsize);
    if let Some(max) = writes.max {
        match sys::write_number(sys::NF_CONNTRACK_MAX, max) {
            Ok(()) => tracing::info!(
                nf_conntrack_max = max,
                was = current,
                "raised the kernel's conntrack maximum"
            ),
            Err(e) => {
                tracing::warn!(error = %e, nf_conntrack_max = current, wanted = max, "could not raise the kernel's conntrack maximum (--conntrack-max-per-core 0 leaves it alone)")
            }
        }
    }
    if let Some(buckets) = writes.hashsize {
        match sys::write_number(sys::NF_CONNTRACK_HASHSIZE, buckets) {
            Ok(()) => {
                tracing::info!(hashsize = buckets, was = ?hashsize, "raised the kernel's conntrack hash size")
            }
            Err(e) => {
                tracing::warn!(error = %e, hashsize = ?hashsize, wanted = buckets, "could not raise the kernel's conntrack hash size")
            }
        }
    }
}
