//! From the model to the desired datapath state: which frontends exist, which
//! backends each balances over, and how it treats its clients. Pure code.
//!
//! Per service port: the ClusterIP (internal traffic), and the external
//! frontends: the NodePort on every node address (within
//! `--nodeport-addresses`), each externalIP and each load-balancer IP. As in
//! kube-proxy, a traffic policy of Local narrows a frontend to this node's
//! endpoints; with none here but some elsewhere its traffic is dropped,
//! while a service without any endpoint refuses (TCP RST, ICMP unreachable).

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
};

use crate::model::{Cidr, Model, Protocol, ServicePort, ServicePortName};

/// An address clients connect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub ip: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
}

/// One backend of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendPlan {
    pub addr: SocketAddrV4,
    /// The endpoint runs on this node.
    pub local: bool,
    /// The endpoint's address is one of this node's (host network).
    pub host: bool,
}

/// What a frontend balances over, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendPlan {
    pub service: ServicePortName,
    /// Sorted by address, unique.
    pub backends: Vec<BackendPlan>,
    pub affinity_timeout_secs: Option<u32>,
    /// NodePort, externalIP or load-balancer IP (not the ClusterIP).
    pub external: bool,
    /// Its traffic policy is Local: this node's endpoints, client IP kept.
    pub local: bool,
    /// No backend here but endpoints elsewhere: drop rather than refuse.
    pub drop_when_empty: bool,
    /// Only these sources may connect (load-balancer IPs with
    /// loadBalancerSourceRanges); empty means anyone.
    pub source_ranges: Vec<Cidr>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub frontends: BTreeMap<Frontend, FrontendPlan>,
}

/// The node the plan is for.
#[derive(Clone, Debug, Default)]
pub struct Node {
    pub name: String,
    /// Its addresses: NodePorts are served on those in `nodeport_addresses`.
    pub ips: Vec<Ipv4Addr>,
    /// `--nodeport-addresses`; empty means every node address.
    pub nodeport_addresses: Vec<Cidr>,
    /// Its `topology.kubernetes.io/zone`, for EndpointSlice hints.
    pub zone: Option<String>,
}

impl Node {
    fn nodeport_ips(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.ips.iter().copied().filter(|ip| {
            self.nodeport_addresses.is_empty()
                || self.nodeport_addresses.iter().any(|c| c.contains(*ip))
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Service {loser}: {} {}:{} is already used by {winner}; ignored", frontend.protocol.as_str(), frontend.ip, frontend.port)]
pub struct ConflictError {
    pub frontend: Frontend,
    pub winner: ServicePortName,
    pub loser: ServicePortName,
}

/// Builds the plan for `node`. Two service ports claiming one frontend is a
/// conflict: the first by name keeps it, the other is reported.
pub fn plan(model: &Model, node: &Node) -> (Plan, Vec<ConflictError>) {
    let mut plan = Plan::default();
    let mut conflicts = Vec::new();
    for port in model.ports() {
        for (frontend, fp) in frontends(port, node) {
            if let Some(existing) = plan.frontends.get(&frontend) {
                // The same address listed twice by one service port: the
                // first (a load-balancer IP, with its source ranges) stands.
                if existing.service == port.name {
                    continue;
                }
                conflicts.push(ConflictError {
                    frontend,
                    winner: existing.service.clone(),
                    loser: port.name.clone(),
                });
                continue;
            }
            plan.frontends.insert(frontend, fp);
        }
    }
    (plan, conflicts)
}

fn frontends(port: &ServicePort, node: &Node) -> Vec<(Frontend, FrontendPlan)> {
    let at = |ip, number| Frontend { ip, port: number, protocol: port.protocol };
    let for_policy = |external: bool, local: bool, source_ranges: Vec<Cidr>| {
        let endpoints = if local {
            port.usable_endpoints(Some(&node.name))
        } else {
            port.cluster_endpoints(&node.name, node.zone.as_deref())
        };
        let mut backends: Vec<_> = endpoints
            .iter()
            .map(|e| BackendPlan {
                addr: e.addr,
                local: e.node_name.as_deref() == Some(&node.name),
                host: node.ips.contains(e.addr.ip()),
            })
            .collect();
        backends.sort();
        backends.dedup_by_key(|b| b.addr);
        FrontendPlan {
            service: port.name.clone(),
            drop_when_empty: backends.is_empty() && port.has_endpoints(),
            backends,
            affinity_timeout_secs: port.affinity_timeout_secs,
            external,
            local,
            source_ranges,
        }
    };
    let mut out =
        vec![(at(port.cluster_ip, port.port), for_policy(false, port.internal_local, vec![]))];
    let external = for_policy(true, port.external_local, vec![]);
    if let Some(node_port) = port.node_port {
        out.extend(node.nodeport_ips().map(|ip| (at(ip, node_port), external.clone())));
    }
    let balanced = for_policy(true, port.external_local, port.source_ranges.clone());
    out.extend(port.load_balancer_ips.iter().map(|ip| (at(*ip, port.port), balanced.clone())));
    out.extend(port.external_ips.iter().map(|ip| (at(*ip, port.port), external.clone())));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{self, Endpoint, ServiceName};

    fn port(name: &str, ip: [u8; 4], endpoints: &[(&str, bool, &str)]) -> ServicePort {
        ServicePort {
            name: ServicePortName {
                service: ServiceName { namespace: "default".into(), name: name.into() },
                port: String::new(),
            },
            protocol: Protocol::Tcp,
            port: 80,
            cluster_ip: ip.into(),
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            source_ranges: vec![],
            external_local: false,
            health_check_node_port: None,
            internal_local: false,
            affinity_timeout_secs: None,
            endpoints: endpoints
                .iter()
                .map(|(addr, ready, node)| Endpoint {
                    addr: addr.parse().unwrap(),
                    ready: *ready,
                    serving: *ready,
                    terminating: false,
                    node_name: Some(node.to_string()),
                    zone_hints: vec![],
                    node_hints: vec![],
                })
                .collect(),
        }
    }

    fn node() -> Node {
        Node {
            name: "node-a".into(),
            ips: vec![Ipv4Addr::new(192, 168, 100, 11), Ipv4Addr::new(172, 16, 0, 11)],
            nodeport_addresses: vec![],
            zone: None,
        }
    }

    fn one(ports: Vec<ServicePort>) -> Plan {
        let (plan, conflicts) = plan(&model::Model::from_ports(ports), &node());
        assert!(conflicts.is_empty());
        plan
    }

    fn at(plan: &Plan, ip: [u8; 4], port: u16) -> &FrontendPlan {
        let frontend = Frontend { ip: ip.into(), port, protocol: Protocol::Tcp };
        plan.frontends.get(&frontend).unwrap_or_else(|| panic!("no frontend {frontend:?}"))
    }

    #[test]
    fn frontends_carry_usable_endpoints_only() {
        let plan = one(vec![port(
            "a",
            [10, 96, 0, 1],
            &[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", false, "node-a")],
        )]);
        let fp = at(&plan, [10, 96, 0, 1], 80);
        let addr = "10.0.0.2:80".parse::<SocketAddrV4>().unwrap();
        assert_eq!(fp.backends, vec![BackendPlan { addr, local: true, host: false }]);
        assert!(!fp.external && !fp.local && !fp.drop_when_empty);
    }

    #[test]
    fn node_ports_external_and_load_balancer_ips_become_external_frontends() {
        let mut p = port("a", [10, 96, 0, 1], &[("10.0.0.2:8080", true, "node-b")]);
        p.node_port = Some(30080);
        p.external_ips = vec![Ipv4Addr::new(10, 200, 0, 5)];
        p.load_balancer_ips = vec![Ipv4Addr::new(10, 200, 0, 6)];
        p.source_ranges = vec![Cidr::parse("192.168.100.101/32").unwrap().unwrap()];
        let plan = one(vec![p.clone()]);
        assert_eq!(plan.frontends.len(), 5, "cluster IP, two node ports, external IP, LB IP");
        for (ip, port) in
            [([192, 168, 100, 11], 30080), ([172, 16, 0, 11], 30080), ([10, 200, 0, 5], 80)]
        {
            let fp = at(&plan, ip, port);
            assert!(fp.external && !fp.local && fp.source_ranges.is_empty());
            assert_eq!(fp.backends.len(), 1);
        }
        assert_eq!(
            at(&plan, [10, 200, 0, 6], 80).source_ranges.len(),
            1,
            "ranges only on the LB IP"
        );

        // --nodeport-addresses narrows the node ports.
        let mut n = node();
        n.nodeport_addresses = vec![Cidr::parse("192.168.100.0/24").unwrap().unwrap()];
        let (narrowed, _) = super::plan(&model::Model::from_ports([p]), &n);
        assert_eq!(narrowed.frontends.len(), 4);
    }

    #[test]
    fn local_policies_narrow_to_this_node_and_drop_when_only_elsewhere() {
        let mut p = port(
            "a",
            [10, 96, 0, 1],
            &[("10.0.0.2:80", true, "node-a"), ("10.0.0.3:80", true, "node-b")],
        );
        p.node_port = Some(30080);
        p.external_local = true;
        let plan = one(vec![p.clone()]);
        let external = at(&plan, [192, 168, 100, 11], 30080);
        assert!(external.local && external.external);
        assert_eq!(external.backends.len(), 1);
        assert_eq!(at(&plan, [10, 96, 0, 1], 80).backends.len(), 2, "internal: every endpoint");

        p.endpoints.retain(|e| e.node_name.as_deref() == Some("node-b"));
        p.internal_local = true;
        let plan = one(vec![p.clone()]);
        for fp in plan.frontends.values() {
            assert!(fp.backends.is_empty() && fp.drop_when_empty, "{fp:?}");
        }

        p.endpoints.clear();
        let plan = one(vec![p]);
        assert!(plan.frontends.values().all(|fp| !fp.drop_when_empty), "no endpoints: refuse");
    }

    #[test]
    fn conflicting_frontends_keep_the_first_and_report_the_second() {
        let model = model::Model::from_ports([
            port("a", [10, 96, 0, 1], &[]),
            port("b", [10, 96, 0, 1], &[]),
        ]);
        let (plan, conflicts) = plan(&model, &node());
        assert_eq!(plan.frontends.len(), 1);
        assert_eq!(conflicts.len(), 1);
        assert_eq!(conflicts[0].loser.to_string(), "default/b");
        assert!(conflicts[0].to_string().contains("default/a"));
    }
}
