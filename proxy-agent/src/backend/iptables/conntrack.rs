//! Which kernel conntrack entries go stale when UDP endpoints change. Pure
//! code; the agent deletes them with the `conntrack` tool.
//!
//! A UDP "connection" lives in conntrack for as long as datagrams keep
//! coming, DNATed to the endpoint picked for its first one. As kube-proxy
//! does, entries are deleted when:
//! - their endpoint leaves the service: the next datagram picks again
//!   (otherwise a DNS client keeps talking to a dead pod);
//! - a service without endpoints gets some: datagrams sent meanwhile made
//!   entries without DNAT, which would keep them from reaching the new pods.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::Ipv4Addr,
};

use crate::model::{Model, Protocol, ServicePortName};

/// The frontends (`ip:port`) of one UDP service port and the endpoints its
/// rules send to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UdpService {
    /// Cluster IP, external IPs and load-balancer IPs with the port, and
    /// the node addresses with the NodePort.
    pub frontends: Vec<(Ipv4Addr, u16)>,
    pub endpoints: BTreeSet<Ipv4Addr>,
}

pub type UdpServices = BTreeMap<ServicePortName, UdpService>;

/// The UDP service ports of `model` on a node with `node_ips`.
pub fn udp_services(model: &Model, node_ips: &[Ipv4Addr]) -> UdpServices {
    model
        .ports
        .iter()
        .filter(|p| p.protocol == Protocol::Udp)
        .map(|p| {
            let service_ips = std::iter::once(&p.cluster_ip)
                .chain(&p.external_ips)
                .chain(&p.load_balancer_ips)
                .map(|ip| (*ip, p.port));
            let node_ports =
                p.node_port.into_iter().flat_map(|np| node_ips.iter().map(move |ip| (*ip, np)));
            let frontends = service_ips.chain(node_ports).collect();
            let endpoints = p.usable_endpoints(None).iter().map(|e| *e.addr.ip()).collect();
            (p.name.clone(), UdpService { frontends, endpoints })
        })
        .collect()
}

/// A set of UDP conntrack entries to delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StaleFlows {
    /// Sent to `ip:port`, DNATed to `endpoint`.
    ToEndpoint { ip: Ipv4Addr, port: u16, endpoint: Ipv4Addr },
    /// Sent to `ip:port` and not translated (there was no endpoint): the
    /// reply would come from `ip` itself. Translated flows are kept.
    Untranslated { ip: Ipv4Addr, port: u16 },
}

impl StaleFlows {
    /// `conntrack` arguments deleting these entries.
    pub fn args(&self) -> Vec<String> {
        let (ip, port, reply_from, filter) = match *self {
            StaleFlows::ToEndpoint { ip, port, endpoint } => (ip, port, endpoint, "--dst-nat"),
            StaleFlows::Untranslated { ip, port } => (ip, port, ip, "--reply-src"),
        };
        ["-D", "-p", "udp", "--orig-dst", &ip.to_string(), "--orig-port-dst", &port.to_string()]
            .into_iter()
            .map(String::from)
            .chain([filter.to_string(), reply_from.to_string()])
            .collect()
    }
}

impl fmt::Display for StaleFlows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StaleFlows::ToEndpoint { ip, port, endpoint } => {
                write!(f, "UDP {ip}:{port} -> {endpoint}")
            }
            StaleFlows::Untranslated { ip, port } => write!(f, "UDP {ip}:{port} untranslated"),
        }
    }
}

/// The entries made stale by going from `old` to `new`.
pub fn stale_flows(old: &UdpServices, new: &UdpServices) -> BTreeSet<StaleFlows> {
    let mut stale = BTreeSet::new();
    for (name, was) in old {
        let now = new.get(name);
        let kept = |endpoint: &Ipv4Addr| now.is_some_and(|n| n.endpoints.contains(endpoint));
        for endpoint in was.endpoints.iter().filter(|e| !kept(e)) {
            for &(ip, port) in &was.frontends {
                stale.insert(StaleFlows::ToEndpoint { ip, port, endpoint: *endpoint });
            }
        }
    }
    for (name, now) in new {
        let had_none = old.get(name).is_none_or(|was| was.endpoints.is_empty());
        if had_none && !now.endpoints.is_empty() {
            for &(ip, port) in &now.frontends {
                stale.insert(StaleFlows::Untranslated { ip, port });
            }
        }
    }
    stale
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServiceName;

    fn name(n: &str) -> ServicePortName {
        ServicePortName {
            service: ServiceName { namespace: "default".into(), name: n.into() },
            port: "dns".into(),
        }
    }

    const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
    const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 11);

    fn dns(endpoints: &[[u8; 4]]) -> UdpService {
        UdpService {
            frontends: vec![(VIP, 53), (NODE, 30053)],
            endpoints: endpoints.iter().map(|e| Ipv4Addr::from(*e)).collect(),
        }
    }

    #[test]
    fn a_removed_endpoint_loses_its_flows_on_every_frontend() {
        let old = UdpServices::from([(name("dns"), dns(&[[10, 244, 1, 2], [10, 244, 1, 3]]))]);
        let new = UdpServices::from([(name("dns"), dns(&[[10, 244, 1, 3]]))]);
        let gone = Ipv4Addr::new(10, 244, 1, 2);
        let stale: Vec<_> = stale_flows(&old, &new).into_iter().collect();
        assert_eq!(
            stale,
            [
                StaleFlows::ToEndpoint { ip: VIP, port: 53, endpoint: gone },
                StaleFlows::ToEndpoint { ip: NODE, port: 30053, endpoint: gone },
            ]
        );
        assert_eq!(
            stale[0].args().join(" "),
            "-D -p udp --orig-dst 10.96.0.10 --orig-port-dst 53 --dst-nat 10.244.1.2"
        );
    }

    #[test]
    fn a_deleted_service_loses_its_flows() {
        let old = UdpServices::from([(name("dns"), dns(&[[10, 244, 1, 2]]))]);
        assert_eq!(stale_flows(&old, &UdpServices::new()).len(), 2);
    }

    #[test]
    fn first_endpoints_clear_untranslated_flows_only() {
        let old = UdpServices::from([(name("dns"), dns(&[]))]);
        let new = UdpServices::from([(name("dns"), dns(&[[10, 244, 1, 2]]))]);
        let stale: Vec<_> = stale_flows(&old, &new).into_iter().collect();
        assert_eq!(
            stale,
            [
                StaleFlows::Untranslated { ip: VIP, port: 53 },
                StaleFlows::Untranslated { ip: NODE, port: 30053 },
            ]
        );
        assert_eq!(
            stale[1].args().join(" "),
            "-D -p udp --orig-dst 192.168.100.11 --orig-port-dst 30053 --reply-src 192.168.100.11"
        );
        // At startup every service is new: only untranslated flows go.
        assert_eq!(stale_flows(&UdpServices::new(), &new), stale.into_iter().collect());
        assert!(stale_flows(&new, &new).is_empty());
    }

    #[test]
    fn node_ports_are_frontends_on_every_node_address() {
        let m = crate::source::model_from_yaml(
            "apiVersion: v1\nkind: Service\nmetadata: {name: dns}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{name: dns, port: 53, protocol: UDP, nodePort: 30053}, {name: tcp, port: 53}]}\n",
        );
        let udp = udp_services(&m, &[NODE, Ipv4Addr::new(172, 16, 0, 1)]);
        assert_eq!(udp.len(), 1);
        assert_eq!(
            udp.values().next().unwrap().frontends,
            [(VIP, 53), (NODE, 30053), (Ipv4Addr::new(172, 16, 0, 1), 30053)]
        );
    }
}
