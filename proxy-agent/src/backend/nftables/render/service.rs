//! One service port's chains, affinity sets and elements, as kube-proxy's
//! nftables proxier writes them, but for its per-endpoint chains: what
//! each holds is written where kube-proxy jumps to it (docs/nftables.md).

use super::{
    Options,
    names::{ServiceChains, affinity_set},
    ruleset::{Container, Element, MARK_MASQ, Ruleset},
};
use crate::{
    backend::categorize::Categorized,
    model::{Endpoint, ServicePort},
};

const REJECT: &str = "goto reject-chain";

/// Writes `port`'s part of the ruleset into `rs`.
pub(super) fn write(rs: &mut Ruleset, port: &ServicePort, opts: &Options) {
    ServiceWriter::new(port, opts).write(rs);
}

struct ServiceWriter<'a> {
    port: &'a ServicePort,
    opts: &'a Options,
    endpoints: Categorized<'a>,
    chains: ServiceChains,
    /// `ip` or `ip6`.
    ip: &'static str,
    proto: &'static str,
    name: String,
}

impl<'a> ServiceWriter<'a> {
    fn new(port: &'a ServicePort, opts: &'a Options) -> Self {
        ServiceWriter {
            port,
            opts,
            endpoints: Categorized::new(port, &opts.node_name, opts.zone.as_deref()),
            chains: ServiceChains::new(&port.name, port.protocol),
            ip: match opts.family {
                crate::model::IpFamily::V4 => "ip",
                crate::model::IpFamily::V6 => "ip6",
            },
            proto: port.protocol.lower(),
            name: port.name.to_string(),
        }
    }

    fn affinity_set(&self, e: &Endpoint) -> String {
        affinity_set(&self.port.name, self.port.protocol, e.addr)
    }

    /// What kube-proxy's chain of endpoint `e` does after its hairpin
    /// check (here a lookup in `hairpin-endpoints`, after DNAT): remember
    /// the client for affinity, then DNAT.
    fn translation(&self, e: &Endpoint) -> String {
        let dnat = format!("meta l4proto {} dnat to {}", self.proto, e.addr);
        match self.port.affinity_timeout_secs {
            Some(_) => format!("update @{} {{ {} saddr }} {dnat}", self.affinity_set(e), self.ip),
            None => dnat,
        }
    }

    /// `IP . proto . port`.
    fn key(&self, ip: impl std::fmt::Display, port: u16) -> String {
        format!("{ip} . {} . {port}", self.proto)
    }

    fn element(&self, rs: &mut Ruleset, container: Container, key: String, value: String) {
        let comment =
            matches!(container, Container::NoEndpointServices | Container::NoEndpointNodePorts)
                .then(|| self.name.clone());
        rs.elements.insert((container, key), Element { value: Some(value), comment });
    }

    fn rule(rs: &mut Ruleset, chain: &str, rule: String) {
        rs.chains.entry(chain.to_string()).or_default().push(rule);
    }

    fn write(&self, rs: &mut Ruleset) {
        let e = &self.endpoints;
        let c = &self.chains;
        let port = self.port;
        let has_endpoints = e.has_endpoints();
        let reachable = e.reachable();
        // Chains are declared even when they get no rule.
        let declare = |rs: &mut Ruleset, chain: &str| {
            rs.chains.entry(chain.to_string()).or_default();
        };
        if e.uses_cluster_chain() {
            declare(rs, &c.cluster);
        }
        if e.uses_local_chain() {
            declare(rs, &c.local);
        }
        let internal_chain = if port.internal_local { &c.local } else { &c.cluster };
        let external_policy_chain = if port.external_local { &c.local } else { &c.cluster };
        if e.uses_external_chain() {
            declare(rs, &c.external);
        }
        let (internal_verdict, external_verdict) = match has_endpoints {
            false => (REJECT, REJECT),
            true => ("drop", "drop"),
        };
        let goto = |chain: &str| format!("goto {chain}");

        let cluster_ip = port.cluster_ip;
        rs.elements.insert(
            (Container::ClusterIps, cluster_ip.to_string()),
            Element { value: None, comment: None },
        );
        let cluster_key = self.key(cluster_ip, port.port);
        if e.has_internal() {
            self.element(rs, Container::ServiceIps, cluster_key, goto(internal_chain));
        } else {
            self.element(rs, Container::NoEndpointServices, cluster_key, internal_verdict.into());
        }
        for ip in port.external_ips() {
            if has_endpoints {
                let key = self.key(ip, port.port);
                self.element(rs, Container::ServiceIps, key, goto(&c.external));
            }
            if !e.has_external() {
                let key = self.key(ip, port.port);
                self.element(rs, Container::NoEndpointServices, key, external_verdict.into());
            }
        }
        let uses_firewall =
            !port.load_balancer_ips().is_empty() && !port.source_ranges().is_empty();
        if uses_firewall {
            declare(rs, &c.firewall);
        }
        for ip in port.load_balancer_ips() {
            let key = || self.key(ip, port.port);
            if has_endpoints {
                self.element(rs, Container::ServiceIps, key(), goto(&c.external));
            }
            if uses_firewall {
                self.element(rs, Container::FirewallIps, key(), goto(&c.firewall));
            }
            if !e.has_external() {
                self.element(rs, Container::NoEndpointServices, key(), external_verdict.into());
            }
        }
        if let Some(node_port) = port.node_port {
            let key = || format!("{} . {node_port}", self.proto);
            if has_endpoints {
                self.element(rs, Container::ServiceNodePorts, key(), goto(&c.external));
            }
            if !e.has_external() {
                self.element(rs, Container::NoEndpointNodePorts, key(), external_verdict.into());
            }
        }

        let ip = self.ip;
        if e.has_internal() {
            let masquerade = match (self.opts.masquerade_all, self.opts.cluster_cidr) {
                (true, _) => Some(format!("{ip} daddr {cluster_ip} {MARK_MASQ}")),
                (false, Some(cidr)) => {
                    Some(format!("{ip} daddr {cluster_ip} {ip} saddr != {cidr} {MARK_MASQ}"))
                }
                (false, None) => None,
            };
            if let Some(rule) = masquerade {
                Self::rule(rs, internal_chain, rule);
            }
        }
        if e.uses_external_chain() {
            let ext = &c.external;
            if !port.external_local {
                // Endpoints elsewhere: masquerade, as the reply must come back here.
                Self::rule(rs, ext, MARK_MASQ.to_string());
            } else {
                if let Some(cidr) = self.opts.cluster_cidr {
                    let rule = format!(
                        "{ip} saddr {cidr} goto {} comment \"short-circuit pod traffic\"",
                        c.cluster
                    );
                    Self::rule(rs, ext, rule);
                }
                let local = "fib saddr type local";
                let rule = format!("{local} {MARK_MASQ} comment \"masquerade local traffic\"");
                Self::rule(rs, ext, rule);
                let rule =
                    format!("{local} goto {} comment \"short-circuit local traffic\"", c.cluster);
                Self::rule(rs, ext, rule);
            }
            if e.has_external() {
                Self::rule(rs, ext, goto(external_policy_chain));
            }
        }
        if uses_firewall {
            let ranges = port.source_ranges();
            let mut sources: Vec<String> = ranges.iter().map(ToString::to_string).collect();
            // kube-proxy checks its primary node IP only: a node whose
            // load-balancer IPs are local addresses reaches them from them.
            let primary = self.opts.node_ips.first();
            if primary.is_some_and(|node| ranges.iter().any(|r| r.contains(*node))) {
                sources.extend(port.load_balancer_ips().iter().map(ToString::to_string));
            }
            let rule = format!("{ip} saddr != {{ {} }} drop", sources.join(" , "));
            Self::rule(rs, &c.firewall, rule);
        }
        for ep in &reachable {
            let ip = ep.addr.ip();
            let hairpin = (Container::HairpinEndpoints, format!("{ip} . {ip}"));
            rs.elements.insert(hairpin, Element { value: None, comment: None });
            if let Some(timeout) = port.affinity_timeout_secs {
                rs.affinity.insert(self.affinity_set(ep), timeout);
            }
        }
        if e.uses_cluster_chain() {
            self.write_balancer(rs, &c.cluster, &e.cluster);
        }
        if e.uses_local_chain() {
            self.write_balancer(rs, &c.local, &e.local);
        }
    }

    /// Affinity checks, then a random pick among `endpoints`, in `chain`.
    fn write_balancer(&self, rs: &mut Ruleset, chain: &str, endpoints: &[&Endpoint]) {
        let translations: Vec<String> = endpoints.iter().map(|e| self.translation(e)).collect();
        if self.port.affinity_timeout_secs.is_some() {
            for (e, translation) in endpoints.iter().zip(&translations) {
                let rule = format!("{} saddr @{} {translation}", self.ip, self.affinity_set(e));
                Self::rule(rs, chain, rule);
            }
        }
        for rule in pick(&translations) {
            Self::rule(rs, chain, rule);
        }
    }
}

/// The rules picking one of the endpoints (their `translations`) at
/// random, uniformly: the i-th of N taken with probability 1/(N-i)
/// (`numgen random mod (N-i) 0`), the last always, as iptables' statistic
/// rules do. Not kube-proxy's one rule with an anonymous verdict map
/// (`numgen random mod N vmap { 0 : goto endpoint-…, … }`): the kernel
/// names each anonymous set by scanning every set of the table, so a full
/// sync's transaction made 10,000 of them in minutes (4 min 20 s at 10,000
/// services × 10 endpoints; docs/nftables.md). A DNAT ends the walk: only
/// a connection's first packet walks these, at most N rules of its own
/// service.
fn pick(translations: &[String]) -> Vec<String> {
    let n = translations.len();
    translations
        .iter()
        .enumerate()
        .map(|(i, t)| match n - i {
            1 => t.clone(),
            left => format!("numgen random mod {left} 0 {t}"),
        })
        .collect()
}
