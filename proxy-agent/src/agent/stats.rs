//! Per-service figures the metrics and health checks need, kept up to date
//! with the services a change touches.

use std::collections::BTreeMap;

use crate::{
    health::{self, ServiceCheck},
    model::{IpFamily, Model, ServiceName, ServicePort},
};

/// What the metrics and health checks need from each service, kept up to
/// date with the services a change touches (only services with something
/// to count are held).
#[derive(Debug, Default)]
pub struct ServiceStats {
    /// Services with a Local policy and endpoints, but none usable here:
    /// (internal, external).
    no_local: BTreeMap<ServiceName, (u64, u64)>,
    /// Health-check node ports, by service.
    checks: BTreeMap<ServiceName, BTreeMap<u16, ServiceCheck>>,
    /// IPv6 service ports, by service (not served yet).
    ipv6_ports: BTreeMap<ServiceName, u64>,
}

impl ServiceStats {
    pub fn update<'a>(
        &mut self,
        model: &Model,
        names: impl Iterator<Item = &'a ServiceName>,
        node_name: &str,
    ) {
        for name in names {
            let ports = model.service(name);
            match no_local_endpoints(ports, node_name) {
                (0, 0) => self.no_local.remove(name),
                counts => self.no_local.insert(name.clone(), counts),
            };
            match ports.iter().filter(|p| p.family() == IpFamily::V6).count() {
                0 => self.ipv6_ports.remove(name),
                n => self.ipv6_ports.insert(name.clone(), n as u64),
            };
            let checks = health::service_checks(ports, node_name);
            match checks.is_empty() {
                true => self.checks.remove(name),
                false => self.checks.insert(name.clone(), checks),
            };
        }
    }

    /// kube-proxy's `no_local_endpoints` gauges (internal, external).
    pub fn no_local_endpoints(&self) -> (u64, u64) {
        self.no_local.values().fold((0, 0), |(i, e), (di, de)| (i + di, e + de))
    }

    /// The model's IPv6 service ports.
    pub fn ipv6_ports(&self) -> u64 {
        self.ipv6_ports.values().sum()
    }

    pub fn service_checks(&self) -> BTreeMap<u16, ServiceCheck> {
        self.checks.values().flat_map(|c| c.iter().map(|(p, c)| (*p, c.clone()))).collect()
    }
}

/// Service ports with a Local policy and endpoints somewhere, but none
/// usable on this node (internal, external).
fn no_local_endpoints(ports: &[ServicePort], node_name: &str) -> (u64, u64) {
    let mut counts = (0, 0);
    // The IPv4 family's gauge: the one served.
    for port in ports.iter().filter(|p| p.family() == IpFamily::V4 && p.has_endpoints()) {
        let none_here = port.usable_endpoints(Some(node_name)).is_empty();
        let external = port.node_port.is_some()
            || !port.external_ips().is_empty()
            || !port.load_balancer_ips().is_empty();
        counts.0 += u64::from(port.internal_local && none_here);
        counts.1 += u64::from(port.external_local && external && none_here);
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_with_local_policies_and_no_endpoint_here_are_counted() {
        let model = crate::source::model_from_yaml(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {type: NodePort, clusterIP: 10.96.0.1, externalTrafficPolicy: Local, internalTrafficPolicy: Local, ports: [{port: 80, nodePort: 30080}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: 10.96.0.2, internalTrafficPolicy: Local, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a-1, labels: {kubernetes.io/service-name: a}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.244.2.2], nodeName: other}]\n",
        );
        // b has no endpoints at all: not counted, as kube-proxy.
        let mut stats = ServiceStats::default();
        stats.update(&model, model.service_names(), "here");
        assert_eq!(stats.no_local_endpoints(), (1, 1));
        stats.update(&model, model.service_names(), "other");
        assert_eq!(stats.no_local_endpoints(), (0, 0));
        assert_eq!(stats.ipv6_ports(), 0);
    }

    #[test]
    fn ipv6_ports_are_counted_apart() {
        let model = crate::source::model_from_yaml(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, clusterIPs: [10.96.0.1, 'fd00::1'], internalTrafficPolicy: Local, ports: [{port: 80}, {name: b, port: 81}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a-1, labels: {kubernetes.io/service-name: a}}\naddressType: IPv6\nports: [{port: 8080}]\nendpoints: [{addresses: ['fd00::2'], nodeName: other}]\n",
        );
        let mut stats = ServiceStats::default();
        stats.update(&model, model.service_names(), "here");
        assert_eq!(stats.ipv6_ports(), 2);
        assert_eq!(stats.no_local_endpoints(), (0, 0), "the IPv4 family's gauge");
    }
}
