//! kube-proxy's nftables names of the per-service-port chains and the
//! per-endpoint affinity sets: a prefix, the first 8 characters of
//! base32(sha256(identity)), a hyphen and the identity itself
//! (`namespace/service/protocol/port`, with `__ip/port` for an endpoint),
//! so `nft list table` reads as the services it serves.

use crate::{
    backend::iptables::chains::hash,
    model::{EndpointAddr, Protocol, ServicePortName},
};

/// The longest name nftables takes.
const NAME_MAX: usize = 256;
/// The longest prefix kube-proxy puts before a base (with its hyphen).
const PREFIX_MAX: usize = 16;

/// `HASH-identity`, cut to fit behind any prefix (kube-proxy ends a cut
/// name with `...`; the hash keeps it unique).
fn hashed(identity: &str) -> String {
    let max = NAME_MAX - PREFIX_MAX;
    let mut name = format!("{}-{identity}", &hash(identity)[..8]);
    if name.len() > max {
        // The identity is ASCII (names, protocols, addresses, numbers).
        name.truncate(max - 3);
        name.push_str("...");
    }
    name
}

/// The base of a service port's names.
fn service_base(name: &ServicePortName, protocol: Protocol) -> String {
    let s = &name.service;
    hashed(&format!("{}/{}/{}/{}", s.namespace, s.name, protocol.lower(), name.port))
}

/// The chains of one service port, which share one base.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChains {
    /// `service-`: the Cluster-policy endpoints.
    pub cluster: String,
    /// `local-`: this node's endpoints.
    pub local: String,
    /// `external-`: NodePort, external and load-balancer IP traffic.
    pub external: String,
    /// `firewall-`: loadBalancerSourceRanges.
    pub firewall: String,
}

impl ServiceChains {
    pub fn new(name: &ServicePortName, protocol: Protocol) -> Self {
        let base = service_base(name, protocol);
        ServiceChains {
            cluster: format!("service-{base}"),
            local: format!("local-{base}"),
            external: format!("external-{base}"),
            firewall: format!("firewall-{base}"),
        }
    }
}

/// The base of an endpoint's names: `:` is not allowed in a name, so an
/// IPv6 address is written with dots.
fn endpoint_base(name: &ServicePortName, protocol: Protocol, endpoint: EndpointAddr) -> String {
    let s = &name.service;
    let ip = endpoint.ip().to_string().replace(':', ".");
    let (proto, port) = (protocol.lower(), endpoint.port());
    hashed(&format!("{}/{}/{proto}/{}__{ip}/{port}", s.namespace, s.name, name.port))
}

/// An endpoint's affinity set (`affinity-`), kube-proxy's name. (kube-proxy
/// also gives each endpoint a chain, `endpoint-` and the same base; the
/// agent writes what it holds into the service's chain.)
pub fn affinity_set(name: &ServicePortName, protocol: Protocol, endpoint: EndpointAddr) -> String {
    format!("affinity-{}", endpoint_base(name, protocol, endpoint))
}

/// Whether `chain` is a per-service-port chain (or a per-endpoint one an
/// older agent or kube-proxy left): only those have a `/` in their names.
pub fn is_service_chain(chain: &str) -> bool {
    chain.contains('/')
}

/// Whether `set` is an endpoint's affinity set.
pub fn is_affinity_set(set: &str) -> bool {
    set.starts_with("affinity-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spn(ns: &str, name: &str, port: &str) -> ServicePortName {
        ServicePortName::of(ns, name, port)
    }

    #[test]
    fn names_match_kube_proxys() {
        // Names from kube-proxy's TestOverallNFTablesRules.
        let chains = ServiceChains::new(&spn("ns1", "svc1", "p80"), Protocol::Tcp);
        assert_eq!(chains.cluster, "service-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(
            ServiceChains::new(&spn("ns2", "svc2", "p80"), Protocol::Tcp).external,
            "external-42NFTM6N-ns2/svc2/tcp/p80"
        );
        let ep = |text: &str| text.parse::<EndpointAddr>().unwrap();
        let set = affinity_set(&spn("ns5", "svc5", "p80"), Protocol::Tcp, ep("10.180.0.3:80"));
        assert_eq!(set, "affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80");
        let v6 = affinity_set(&spn("ns1", "svc1", "p80"), Protocol::Tcp, ep("[fd00::1]:80"));
        assert!(v6.ends_with("-ns1/svc1/tcp/p80__fd00..1/80"), "{v6}");
    }

    #[test]
    fn a_long_name_is_cut_to_fit() {
        let long = "x".repeat(63);
        let name = spn(&long, &long, &long);
        let ep = "[fd00:1111:2222:3333:4444:5555:6666:7777]:65535".parse().unwrap();
        let set = affinity_set(&name, Protocol::Sctp, ep);
        assert_eq!(set.len(), "affinity-".len() + NAME_MAX - PREFIX_MAX);
        assert!(set.ends_with("..."));
        let chains = ServiceChains::new(&name, Protocol::Sctp);
        assert!(is_service_chain(&chains.cluster) && !is_service_chain("services"));
    }
}
