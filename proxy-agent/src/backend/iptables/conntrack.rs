//! Which kernel conntrack entries go stale when the rules change. Pure
//! code; the agent deletes them with the `conntrack` tool.
//!
//! A UDP "connection" lives in conntrack for as long as datagrams keep
//! coming, DNATed to the endpoint picked for its first one; an SCTP
//! association's entry outlives the association, and the next INIT from
//! the peer's port (Diameter and SIGTRAN peers keep theirs) takes over its
//! NAT. So UDP entries (as kube-proxy does) and SCTP entries (as kube-proxy
//! did until 1.28, its `IsClearConntrackNeeded`) are deleted when:
//! - their endpoint no longer serves the service (ready or serving, as
//!   kube-proxy counts them: a terminating endpoint still serving keeps its
//!   flows): the next datagram picks again, so a DNS client does not keep
//!   talking to a dead pod. NodePort entries are matched by port alone,
//!   whatever local address (127.0.0.1 included) they were sent to;
//! - a service without endpoints gets some: datagrams sent meanwhile made
//!   entries without DNAT, which would keep them from reaching the new pods.
//!
//! And, beyond kube-proxy, when the rules were missing (someone flushed
//! them): unanswered TCP, UDP and SCTP entries to a service address made
//! meanwhile were not translated, and a client retrying (a SYN or an INIT
//! resent from the same port) would keep matching them until they expire.
//! Answered ones are left alone: something real answered them. TCP entries
//! are otherwise left alone, as kube-proxy leaves them: a connection's entry
//! ends with it.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use crate::model::{IpFamily, Model, Protocol, ServicePort, ServicePortName};

/// Whether the entries of `protocol`'s service ports are deleted when
/// their endpoint leaves (see the module's documentation).
fn cleaned(protocol: Protocol) -> bool {
    matches!(protocol, Protocol::Udp | Protocol::Sctp)
}

/// The frontends of one UDP or SCTP service port and the endpoints it
/// sends to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CleanedPort {
    pub protocol: Protocol,
    /// Cluster IP, external IPs and load-balancer IPs, with the port.
    pub frontends: Vec<(IpAddr, u16)>,
    pub node_port: Option<u16>,
    /// This node's addresses (where untranslated NodePort flows went).
    pub node_ips: Vec<IpAddr>,
    pub endpoints: BTreeSet<IpAddr>,
}

pub type CleanedPorts = BTreeMap<ServicePortName, CleanedPort>;

/// The UDP and SCTP service ports of `model`'s `family` on a node with
/// `node_ips` (of that family).
pub fn cleaned_ports(model: &Model, family: IpFamily, node_ips: &[IpAddr]) -> CleanedPorts {
    model
        .ports_of(family)
        .filter(|p| cleaned(p.protocol))
        .map(|p| {
            let service = CleanedPort {
                protocol: p.protocol,
                frontends: service_frontends(p).collect(),
                node_port: p.node_port,
                node_ips: node_ips.to_vec(),
                endpoints: p
                    .endpoints
                    .iter()
                    .filter(|e| e.ready || e.serving)
                    .map(|e| e.addr.ip())
                    .collect(),
            };
            (ServicePortName::clone(&p.name), service)
        })
        .collect()
}

fn service_frontends(p: &ServicePort) -> impl Iterator<Item = (IpAddr, u16)> + '_ {
    std::iter::once(&p.cluster_ip)
        .chain(p.external_ips())
        .chain(p.load_balancer_ips())
        .map(|ip| (*ip, p.port))
}

/// Every address clients reach services on: cluster, external and
/// load-balancer IPs with the port, node addresses with the NodePort.
pub fn frontends(
    model: &Model,
    family: IpFamily,
    node_ips: &[IpAddr],
) -> BTreeSet<(Protocol, IpAddr, u16)> {
    model
        .ports_of(family)
        .flat_map(|p| {
            let node_ports =
                p.node_port.into_iter().flat_map(|np| node_ips.iter().map(move |ip| (*ip, np)));
            service_frontends(p).chain(node_ports).map(move |(ip, port)| (p.protocol, ip, port))
        })
        .collect()
}

/// One entry of a `conntrack -L` listing: its original direction, where
/// its replies come from, and whether any came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub protocol: Protocol,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub reply_src: IpAddr,
    pub reply_sport: u16,
    pub unreplied: bool,
}

impl Entry {
    /// Parses `tcp 6 117 SYN_SENT src=… dst=… sport=… dport=… [UNREPLIED]
    /// src=… dst=… sport=… dport=… …`; `None` for other protocols.
    pub fn parse(line: &str) -> Option<Self> {
        let name = line.split_whitespace().next()?;
        let protocol = Protocol::ALL.into_iter().find(|p| p.lower() == name)?;
        let values = |key: &'static str| {
            line.split_whitespace().filter_map(move |w| w.strip_prefix(key)?.strip_prefix('='))
        };
        let (mut src, mut dst, mut sport, mut dport) =
            (values("src"), values("dst"), values("sport"), values("dport"));
        Some(Entry {
            protocol,
            src: src.next()?.parse().ok()?,
            dst: dst.next()?.parse().ok()?,
            sport: sport.next()?.parse().ok()?,
            dport: dport.next()?.parse().ok()?,
            reply_src: src.next()?.parse().ok()?,
            reply_sport: sport.next()?.parse().ok()?,
            unreplied: line.contains("[UNREPLIED]"),
        })
    }

    fn translated(&self) -> bool {
        self.reply_src != self.dst || self.reply_sport != self.dport
    }

    /// `conntrack` arguments deleting exactly this entry.
    pub fn delete_args(&self) -> Vec<String> {
        [
            "-D",
            "-p",
            self.protocol.lower(),
            "--orig-src",
            &self.src.to_string(),
            "--orig-dst",
            &self.dst.to_string(),
            "--orig-port-src",
            &self.sport.to_string(),
            "--orig-port-dst",
            &self.dport.to_string(),
        ]
        .map(String::from)
        .to_vec()
    }
}

/// The entries of a `conntrack -L` listing sent to one of `frontends`,
/// never translated and never answered.
pub fn untranslated(listing: &str, frontends: &BTreeSet<(Protocol, IpAddr, u16)>) -> Vec<Entry> {
    listing
        .lines()
        .filter_map(Entry::parse)
        .filter(|e| {
            e.unreplied && !e.translated() && frontends.contains(&(e.protocol, e.dst, e.dport))
        })
        .collect()
}

/// A set of UDP or SCTP conntrack entries to delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StaleFlows {
    pub protocol: Protocol,
    pub to: StaleTo,
}

/// Where the entries of [`StaleFlows`] were sent and translated to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StaleTo {
    /// Sent to `ip:port`, DNATed to `endpoint`.
    ToEndpoint { ip: IpAddr, port: u16, endpoint: IpAddr },
    /// Sent to NodePort `port` on any local address, DNATed to `endpoint`.
    NodePortToEndpoint { port: u16, endpoint: IpAddr },
    /// Sent to `ip:port` and not translated (there was no endpoint): the
    /// reply would come from `ip` itself. Translated flows are kept.
    Untranslated { ip: IpAddr, port: u16 },
}

impl StaleFlows {
    /// `conntrack` arguments deleting these entries.
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["-D", "-p", self.protocol.lower()].map(String::from).to_vec();
        let dst = |ip: &IpAddr| ["--orig-dst".to_string(), ip.to_string()];
        let port = |port: &u16| ["--orig-port-dst".to_string(), port.to_string()];
        match &self.to {
            StaleTo::ToEndpoint { ip, port: p, endpoint } => {
                args.extend(dst(ip).into_iter().chain(port(p)));
                args.extend(["--dst-nat".to_string(), endpoint.to_string()]);
            }
            StaleTo::NodePortToEndpoint { port: p, endpoint } => {
                args.extend(port(p));
                args.extend(["--dst-nat".to_string(), endpoint.to_string()]);
            }
            StaleTo::Untranslated { ip, port: p } => {
                args.extend(dst(ip).into_iter().chain(port(p)));
                args.extend(["--reply-src".to_string(), ip.to_string()]);
            }
        }
        args
    }
}

impl fmt::Display for StaleFlows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let protocol = self.protocol.lower();
        match self.to {
            StaleTo::ToEndpoint { ip, port, endpoint } => {
                write!(f, "{protocol} {ip}:{port} -> {endpoint}")
            }
            StaleTo::NodePortToEndpoint { port, endpoint } => {
                write!(f, "{protocol} NodePort {port} -> {endpoint}")
            }
            StaleTo::Untranslated { ip, port } => write!(f, "{protocol} {ip}:{port} untranslated"),
        }
    }
}

/// The entries made stale by going from `old` to `new`.
pub fn stale_flows(old: &CleanedPorts, new: &CleanedPorts) -> BTreeSet<StaleFlows> {
    let mut stale = BTreeSet::new();
    for (name, was) in old {
        let now = new.get(name);
        let kept = |endpoint: &IpAddr| now.is_some_and(|n| n.endpoints.contains(endpoint));
        let mut insert = |to| stale.insert(StaleFlows { protocol: was.protocol, to });
        for &endpoint in was.endpoints.iter().filter(|e| !kept(e)) {
            for &(ip, port) in &was.frontends {
                insert(StaleTo::ToEndpoint { ip, port, endpoint });
            }
            if let Some(port) = was.node_port {
                insert(StaleTo::NodePortToEndpoint { port, endpoint });
            }
        }
    }
    for (name, now) in new {
        let had_none = old.get(name).is_none_or(|was| was.endpoints.is_empty());
        if had_none && !now.endpoints.is_empty() {
            let node_ports = now
                .node_port
                .into_iter()
                .flat_map(|np| now.node_ips.iter().map(move |ip| (*ip, np)));
            for (ip, port) in now.frontends.iter().copied().chain(node_ports) {
                let to = StaleTo::Untranslated { ip, port };
                stale.insert(StaleFlows { protocol: now.protocol, to });
            }
        }
    }
    stale
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServiceName;
    use std::net::Ipv4Addr;

    fn name(n: &str) -> ServicePortName {
        ServicePortName {
            service: ServiceName { namespace: "default".into(), name: n.into() },
            port: "dns".into(),
        }
    }

    const VIP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10));
    const NODE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 168, 100, 11));

    fn dns(endpoints: &[[u8; 4]]) -> CleanedPort {
        CleanedPort {
            protocol: Protocol::Udp,
            frontends: vec![(VIP, 53)],
            node_port: Some(30053),
            node_ips: vec![NODE],
            endpoints: endpoints.iter().map(|e| IpAddr::from(*e)).collect(),
        }
    }

    #[test]
    fn a_removed_endpoint_loses_its_flows_on_every_frontend() {
        let old = CleanedPorts::from([(name("dns"), dns(&[[10, 244, 1, 2], [10, 244, 1, 3]]))]);
        let new = CleanedPorts::from([(name("dns"), dns(&[[10, 244, 1, 3]]))]);
        let gone = IpAddr::from([10, 244, 1, 2]);
        let stale: Vec<_> = stale_flows(&old, &new).into_iter().collect();
        assert_eq!(
            stale,
            [
                udp(StaleTo::ToEndpoint { ip: VIP, port: 53, endpoint: gone }),
                udp(StaleTo::NodePortToEndpoint { port: 30053, endpoint: gone }),
            ]
        );
        assert_eq!(
            stale[0].args().join(" "),
            "-D -p udp --orig-dst 10.96.0.10 --orig-port-dst 53 --dst-nat 10.244.1.2"
        );
        // Whatever local address the NodePort was reached on.
        assert_eq!(
            stale[1].args().join(" "),
            "-D -p udp --orig-port-dst 30053 --dst-nat 10.244.1.2"
        );
    }

    fn udp(to: StaleTo) -> StaleFlows {
        StaleFlows { protocol: Protocol::Udp, to }
    }

    /// An SCTP peer keeps its port: the entry of its closed association to
    /// a gone endpoint would take its next INIT there.
    #[test]
    fn a_removed_sctp_endpoint_loses_its_associations_entries() {
        use test_objects::{Protocol::Sctp, ep, port, service};
        let diameter = service("default", "diameter").node_port_type().cluster_ip("10.96.0.10");
        let diameter = diameter.port(port("diameter", 3868).protocol(Sctp).node_port(30868));
        let ports = |eps: &[&str]| {
            let slice = diameter.slice().port("diameter", 3869, Sctp);
            let slice = slice.endpoints(eps.iter().map(|e| ep(e))).build();
            let model = crate::source::model_of(&[diameter.clone().build()], &[slice]);
            cleaned_ports(&model, IpFamily::V4, &[NODE])
        };
        let stale = stale_flows(&ports(&["10.244.1.2", "10.244.1.3"]), &ports(&["10.244.1.3"]));
        let args: Vec<_> = stale.iter().map(|s| s.args().join(" ")).collect();
        assert_eq!(
            args,
            [
                "-D -p sctp --orig-dst 10.96.0.10 --orig-port-dst 3868 --dst-nat 10.244.1.2",
                "-D -p sctp --orig-port-dst 30868 --dst-nat 10.244.1.2",
            ]
        );
        assert_eq!(stale.first().unwrap().to_string(), "sctp 10.96.0.10:3868 -> 10.244.1.2");
    }

    #[test]
    fn a_deleted_service_loses_its_flows() {
        let old = CleanedPorts::from([(name("dns"), dns(&[[10, 244, 1, 2]]))]);
        assert_eq!(stale_flows(&old, &CleanedPorts::new()).len(), 2);
    }

    #[test]
    fn first_endpoints_clear_untranslated_flows_only() {
        let old = CleanedPorts::from([(name("dns"), dns(&[]))]);
        let new = CleanedPorts::from([(name("dns"), dns(&[[10, 244, 1, 2]]))]);
        let stale: Vec<_> = stale_flows(&old, &new).into_iter().collect();
        assert_eq!(
            stale,
            [
                udp(StaleTo::Untranslated { ip: VIP, port: 53 }),
                udp(StaleTo::Untranslated { ip: NODE, port: 30053 }),
            ]
        );
        assert_eq!(
            stale[1].args().join(" "),
            "-D -p udp --orig-dst 192.168.100.11 --orig-port-dst 30053 --reply-src 192.168.100.11"
        );
        // At startup every service is new: only untranslated flows go.
        assert_eq!(stale_flows(&CleanedPorts::new(), &new), stale.into_iter().collect());
        assert!(stale_flows(&new, &new).is_empty());
    }

    #[test]
    fn untranslated_entries_to_frontends_are_found_in_a_listing() {
        let listing = "tcp      6 117 SYN_SENT src=10.244.1.100 dst=10.96.0.10 sport=40000 dport=80 [UNREPLIED] src=10.96.0.10 dst=10.244.1.100 sport=80 dport=40000 mark=0 use=1
tcp      6 431999 ESTABLISHED src=10.244.1.100 dst=10.96.0.10 sport=40002 dport=80 src=10.244.1.2 dst=10.244.1.100 sport=8080 dport=40002 [ASSURED] mark=0 use=1
tcp      6 431999 ESTABLISHED src=10.244.1.100 dst=10.96.0.10 sport=40004 dport=80 src=10.96.0.10 dst=10.244.1.100 sport=80 dport=40004 [ASSURED] mark=0 use=1
udp      17 29 src=10.244.1.100 dst=10.96.0.99 sport=5000 dport=53 [UNREPLIED] src=10.96.0.99 dst=10.244.1.100 sport=53 dport=5000 mark=0 use=1
sctp     132 2 COOKIE_WAIT src=10.244.1.100 dst=10.96.0.10 sport=40006 dport=3868 [UNREPLIED] src=10.96.0.10 dst=10.244.1.100 sport=3868 dport=40006 mark=0 use=1
sctp     132 431999 ESTABLISHED src=10.244.1.100 dst=10.96.0.10 sport=40008 dport=3868 src=10.244.1.2 dst=10.244.1.100 sport=3868 dport=40008 [ASSURED] mark=0 use=1
icmp     1 29 src=10.244.1.100 dst=10.96.0.10 type=8 code=0 id=7 src=10.96.0.10 dst=10.244.1.100 type=0 code=0 id=7 mark=0 use=1
";
        let frontends = BTreeSet::from([(Protocol::Tcp, VIP, 80), (Protocol::Sctp, VIP, 3868)]);
        let found = untranslated(listing, &frontends);
        assert_eq!(found.len(), 2, "answered, DNATed and other flows are kept: {found:?}");
        assert_eq!(
            found[0].delete_args().join(" "),
            "-D -p tcp --orig-src 10.244.1.100 --orig-dst 10.96.0.10 --orig-port-src 40000 --orig-port-dst 80"
        );
        assert_eq!(
            found[1].delete_args().join(" "),
            "-D -p sctp --orig-src 10.244.1.100 --orig-dst 10.96.0.10 --orig-port-src 40006 --orig-port-dst 3868"
        );
    }

    #[test]
    fn node_ports_are_frontends_on_every_node_address_and_serving_endpoints_keep_flows() {
        use test_objects::{Protocol::Udp, ep, port, service};
        let dns = service("default", "dns").node_port_type().cluster_ip("10.96.0.10");
        let dns = dns.port(port("dns", 53).udp().node_port(30053)).port(port("tcp", 53));
        let slice = dns.slice().port("dns", 5353, Udp).endpoints([
            ep("10.244.1.2"),
            ep("10.244.1.3").ready(false).serving(true).terminating(true),
            ep("10.244.1.4").ready(false).serving(false),
        ]);
        let m = crate::source::model_of(&[dns.build()], &[slice.build()]);
        let other = IpAddr::from([172, 16, 0, 1]);
        let cleaned = cleaned_ports(&m, IpFamily::V4, &[NODE, other]);
        assert_eq!(cleaned.len(), 1, "the TCP port's entries are left alone");
        // A terminating endpoint still serving keeps its flows, as kube-proxy.
        let endpoints: Vec<_> =
            cleaned.values().next().unwrap().endpoints.iter().copied().collect();
        assert_eq!(endpoints, [IpAddr::from([10, 244, 1, 2]), IpAddr::from([10, 244, 1, 3])]);
        let all = frontends(&m, IpFamily::V4, &[NODE, other]);
        assert!(all.contains(&(Protocol::Udp, other, 30053)));
        assert!(all.contains(&(Protocol::Tcp, VIP, 53)));
        let new = stale_flows(&CleanedPorts::new(), &cleaned);
        assert!(new.contains(&udp(StaleTo::Untranslated { ip: other, port: 30053 })), "{new:?}");
    }
}
