//! kube-proxy's categorization of a service port's endpoints for one node
//! (its `CategorizeEndpoints`): which endpoints Cluster-policy and
//! Local-policy traffic go to, and so which per-service chains a rule-based
//! proxier needs. Shared by the iptables and nftables renderers, which write
//! the same decisions in two rule languages. Pure code.

use crate::model::{Endpoint, ServicePort};

/// kube-proxy orders endpoints by their `ip:port` text.
fn sorted(mut endpoints: Vec<&Endpoint>) -> Vec<&Endpoint> {
    endpoints.sort_by_key(|e| e.addr.to_string());
    endpoints
}

/// One service port's endpoints as this node's proxier sees them.
pub struct Categorized<'a> {
    pub port: &'a ServicePort,
    /// Cluster-policy endpoints (topology hints applied), by `ip:port` text.
    pub cluster: Vec<&'a Endpoint>,
    /// This node's endpoints, by `ip:port` text.
    pub local: Vec<&'a Endpoint>,
}

impl<'a> Categorized<'a> {
    pub fn new(port: &'a ServicePort, node_name: &str, zone: Option<&str>) -> Self {
        Categorized {
            port,
            cluster: sorted(port.cluster_endpoints(node_name, zone)),
            local: sorted(port.usable_endpoints(Some(node_name))),
        }
    }

    /// The service has an endpoint somewhere.
    pub fn has_endpoints(&self) -> bool {
        !self.cluster.is_empty()
    }

    /// ClusterIP traffic has endpoints to go to (its policy's).
    pub fn has_internal(&self) -> bool {
        if self.port.internal_local { !self.local.is_empty() } else { self.has_endpoints() }
    }

    /// External traffic from outside the cluster has endpoints to go to.
    pub fn has_external(&self) -> bool {
        if self.port.external_local { !self.local.is_empty() } else { self.has_endpoints() }
    }

    /// A NodePort, an external IP or a load-balancer IP.
    pub fn externally_accessible(&self) -> bool {
        self.port.node_port.is_some()
            || !self.port.external_ips().is_empty()
            || !self.port.load_balancer_ips().is_empty()
    }

    /// The Cluster-policy chain is written (even with an external Local
    /// policy: in-cluster clients of external addresses are short-circuited
    /// to it).
    pub fn uses_cluster_chain(&self) -> bool {
        self.has_endpoints() && (!self.port.internal_local || self.externally_accessible())
    }

    /// The Local-policy chain is written.
    pub fn uses_local_chain(&self) -> bool {
        !self.local.is_empty()
            && (self.port.internal_local
                || (self.port.external_local && self.externally_accessible()))
    }

    /// The external chain is written (even without external endpoints: it
    /// holds the short-circuit rules).
    pub fn uses_external_chain(&self) -> bool {
        self.has_endpoints() && self.externally_accessible()
    }

    /// The endpoints that get a chain of their own: those the Cluster- or
    /// Local-policy chain uses, by `ip:port` text.
    pub fn reachable(&self) -> Vec<&'a Endpoint> {
        let mut endpoints: Vec<&Endpoint> =
            if self.uses_cluster_chain() { self.cluster.clone() } else { Vec::new() };
        if self.uses_local_chain() {
            for e in &self.local {
                if !endpoints.iter().any(|x| x.addr == e.addr) {
                    endpoints.push(e);
                }
            }
        }
        sorted(endpoints)
    }
}
