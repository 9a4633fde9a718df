//! From the model to the desired datapath state: which frontends exist and
//! which backends each one balances over. Pure code, no I/O.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
};

use crate::model::{Model, Protocol, ServicePortName};

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
}

/// What a frontend balances over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendPlan {
    pub service: ServicePortName,
    /// Sorted by address, unique.
    pub backends: Vec<BackendPlan>,
    pub affinity_timeout_secs: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub frontends: BTreeMap<Frontend, FrontendPlan>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Service {loser}: {} {}:{} is already used by {winner}; ignored", frontend.protocol.as_str(), frontend.ip, frontend.port)]
pub struct ConflictError {
    pub frontend: Frontend,
    pub winner: ServicePortName,
    pub loser: ServicePortName,
}

/// Builds the plan for the node `node_name`. Two service ports claiming one
/// frontend is a conflict: the first by name keeps it, the other is reported.
pub fn plan(model: &Model, node_name: &str) -> (Plan, Vec<ConflictError>) {
    let mut plan = Plan::default();
    let mut conflicts = Vec::new();
    for port in &model.ports {
        let frontend = Frontend { ip: port.cluster_ip, port: port.port, protocol: port.protocol };
        if let Some(existing) = plan.frontends.get(&frontend) {
            conflicts.push(ConflictError {
                frontend,
                winner: existing.service.clone(),
                loser: port.name.clone(),
            });
            continue;
        }
        let mut backends: Vec<_> = port
            .usable_endpoints()
            .iter()
            .map(|e| BackendPlan { addr: e.addr, local: e.node_name.as_deref() == Some(node_name) })
            .collect();
        backends.sort();
        backends.dedup_by_key(|b| b.addr);
        plan.frontends.insert(
            frontend,
            FrontendPlan {
                service: port.name.clone(),
                backends,
                affinity_timeout_secs: port.affinity_timeout_secs,
            },
        );
    }
    (plan, conflicts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{self, Endpoint, ServiceName, ServicePort};

    fn port(name: &str, ip: [u8; 4], endpoints: &[(&str, bool)]) -> ServicePort {
        ServicePort {
            name: ServicePortName {
                service: ServiceName { namespace: "default".into(), name: name.into() },
                port: String::new(),
            },
            protocol: Protocol::Tcp,
            port: 80,
            cluster_ip: ip.into(),
            affinity_timeout_secs: None,
            endpoints: endpoints
                .iter()
                .map(|(addr, ready)| Endpoint {
                    addr: addr.parse().unwrap(),
                    ready: *ready,
                    serving: *ready,
                    terminating: false,
                    node_name: Some("node-a".into()),
                })
                .collect(),
        }
    }

    #[test]
    fn frontends_carry_usable_endpoints_only() {
        let model = model::Model {
            ports: vec![port(
                "a",
                [10, 96, 0, 1],
                &[("10.0.0.2:80", true), ("10.0.0.3:80", false)],
            )],
            errors: vec![],
        };
        let (plan, conflicts) = plan(&model, "node-a");
        assert!(conflicts.is_empty());
        let (frontend, fp) = plan.frontends.iter().next().unwrap();
        assert_eq!(frontend.ip, Ipv4Addr::new(10, 96, 0, 1));
        let addr = "10.0.0.2:80".parse::<SocketAddrV4>().unwrap();
        assert_eq!(fp.backends, vec![BackendPlan { addr, local: true }]);
    }

    #[test]
    fn conflicting_frontends_keep_the_first_and_report_the_second() {
        let model = model::Model {
            ports: vec![port("a", [10, 96, 0, 1], &[]), port("b", [10, 96, 0, 1], &[])],
            errors: vec![],
        };
        let (plan, conflicts) = plan(&model, "node-a");
        assert_eq!(plan.frontends.len(), 1);
        assert_eq!(conflicts.len(), 1);
        assert_eq!(conflicts[0].loser.to_string(), "default/b");
        assert!(conflicts[0].to_string().contains("default/a"));
    }
}
