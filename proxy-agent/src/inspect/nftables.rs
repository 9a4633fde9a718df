//! The service table from the nftables mode's tables as `nft list table
//! ip|ip6 kube-proxy` prints them: kube-proxy's chain names carry the
//! service names, so the table is read back from what the kernel holds.
//!
//! Frontends are the elements of the verdict maps `service-ips` and
//! `service-nodeports` (each sends a frontend to its chain) and of
//! `no-endpoint-services` and `no-endpoint-nodeports` (no endpoints, no
//! local endpoints; their comment names the service). A frontend's chain is
//! followed `external-` → `service-`/`local-`, whose `dnat` rules name the
//! backends. The maps do not say whether an address is an
//! externalIP or a load-balancer IP: one with source ranges (in
//! `firewall-ips`) is a load-balancer IP, the others are `External`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use super::{
    LbBackend, LbEntry, flag,
    rule_walk::{Packet, Walk, Walked},
};
use crate::model::Cidr;

/// The maps' elements (key → verdict, with the element's comment) and the
/// chains' rules of one or more listed tables.
#[derive(Debug, Default)]
struct Listing {
    /// `ip` or `ip6`.
    family: String,
    maps: BTreeMap<String, Vec<Element>>,
    /// The addresses of `cluster-ips`.
    cluster_ips: BTreeSet<String>,
    /// The addresses of `nodeport-ips` (none: NodePorts on every local
    /// address).
    nodeport_ips: BTreeSet<String>,
    chains: BTreeMap<String, Vec<String>>,
}

#[derive(Debug)]
struct Element {
    key: String,
    comment: Option<String>,
    verdict: String,
}

/// One element as nft lists it: `KEY [comment "C"] : VERDICT`.
fn element(text: &str) -> Option<Element> {
    let (key, verdict) = text.rsplit_once(" : ")?;
    let (key, comment) = match key.split_once(" comment \"") {
        Some((key, comment)) => (key, Some(comment.trim_end_matches('"').to_string())),
        None => (key, None),
    };
    Some(Element { key: key.trim().into(), comment, verdict: verdict.trim().into() })
}

/// Reads `nft list table` output, a listing per table (the families'
/// tables name their chains alike).
fn listings(text: &str) -> Vec<Listing> {
    let mut tables: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with("table ") || tables.is_empty() {
            tables.push(String::new());
        }
        if let Some(table) = tables.last_mut() {
            table.push_str(line);
            table.push('\n');
        }
    }
    tables.iter().map(|t| listing(t)).collect()
}

/// Reads one table of `nft list table` output.
fn listing(text: &str) -> Listing {
    let mut out = Listing::default();
    // The block a line is in: ("map" | "set" | "chain", name).
    let mut block: Option<(String, String)> = None;
    // The text of an `elements = { … }` being read, across lines.
    let mut elements: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if let Some(open) = elements.as_mut() {
            open.push(' ');
            open.push_str(line);
        } else if let Some(rest) = line.strip_prefix("elements = {") {
            elements = Some(rest.to_string());
        } else if line == "}" {
            block = None;
            continue;
        } else if let Some(name) = line.strip_suffix(" {") {
            let mut words = name.split_whitespace();
            if let (Some(kind), Some(name)) = (words.next(), words.next()) {
                if kind == "table" {
                    out.family = name.to_string();
                }
                block = Some((kind.to_string(), name.to_string()));
            }
            continue;
        } else if let Some(("chain", chain)) = block.as_ref().map(|(k, n)| (k.as_str(), n)) {
            if !line.starts_with("type ") && !line.starts_with("comment ") {
                out.chains.entry(chain.clone()).or_default().push(line.to_string());
            }
            continue;
        }
        let Some(open) = elements.as_ref().filter(|e| e.ends_with('}')) else { continue };
        let items = open.trim_end_matches('}').split(',').map(str::trim);
        match block.as_ref().map(|(k, n)| (k.as_str(), n.as_str())) {
            Some(("map", name)) => {
                let map = out.maps.entry(name.to_string()).or_default();
                map.extend(items.filter_map(element));
            }
            Some(("set", "cluster-ips")) => {
                out.cluster_ips.extend(items.filter(|i| !i.is_empty()).map(String::from));
            }
            Some(("set", "nodeport-ips")) => {
                out.nodeport_ips.extend(items.filter(|i| !i.is_empty()).map(String::from));
            }
            _ => {}
        }
        elements = None;
    }
    out
}

/// `ns/name:port` from a per-service chain's name
/// (`service-HASH-ns/name/proto/port`; `ns/name` for an unnamed port).
fn service_of(chain: &str) -> String {
    let base = chain.split_once('-').map_or(chain, |(_, rest)| rest);
    let identity = base.split_once('-').map_or(base, |(_, rest)| rest);
    let parts: Vec<&str> = identity.split('/').collect();
    match parts.as_slice() {
        [ns, name, _proto, ""] => format!("{ns}/{name}"),
        [ns, name, _proto, port, ..] => format!("{ns}/{name}:{port}"),
        _ => "?".into(),
    }
}

/// `address:port/proto` from a map key `address . proto . port`, an IPv6
/// address in brackets; `*:port/proto` from `proto . port`.
fn frontend(key: &str) -> Option<String> {
    let parts: Vec<&str> = key.split(" . ").collect();
    match parts.as_slice() {
        [ip, proto, port] if ip.contains(':') => Some(format!("[{ip}]:{port}/{proto}")),
        [ip, proto, port] => Some(format!("{ip}:{port}/{proto}")),
        [proto, port] => Some(format!("*:{port}/{proto}")),
        _ => None,
    }
}

/// Whether `ip` is `text`, an address or a CIDR.
fn within(ip: IpAddr, text: &str) -> bool {
    match text.contains('/') {
        true => Cidr::parse(text).is_ok_and(|c| c.contains(ip)),
        false => text.parse::<IpAddr>().is_ok_and(|a| a == ip),
    }
}

/// The first packet of a connection walked through one family's table as
/// netfilter does: `firewall-check` (before DNAT), `services` (the verdict
/// maps, then the service's chains down to the `dnat` rules), and
/// without a DNAT the checks of the filter chains (`no-endpoint-services`,
/// `no-endpoint-nodeports`, `cluster-ips`). Matches are read as the
/// renderer writes them; other rules (marks) are taken as matching.
pub(super) fn walk(text: &str, p: &Packet) -> Walk {
    let family = if p.to.is_ipv4() { "ip" } else { "ip6" };
    let passed = Walk { walked: Walked::Passed, frontend: None, affinity: false };
    let Some(listing) = listings(text).into_iter().find(|l| l.family == family) else {
        return passed;
    };
    let (to, from) = (p.to.ip(), p.from.ip());
    let find = |map: &str, key: &str| {
        listing
            .maps
            .get(map)
            .and_then(|m| m.iter().find(|e| e.key == key))
            .map(|e| e.verdict.clone())
    };
    let key = format!("{to} . {} . {}", p.proto, p.to.port());
    let port_key = format!("{} . {}", p.proto, p.to.port());
    let node_port = !to.is_loopback()
        && match listing.nodeport_ips.is_empty() {
            true => p.local.contains(&to),
            false => listing.nodeport_ips.contains(&to.to_string()),
        };
    let mut w = Walker { chains: &listing.chains, p, masquerade: false, affinity: false };
    // Before DNAT: loadBalancerSourceRanges.
    if let Some(chain) =
        find("firewall-ips", &key).and_then(|v| v.strip_prefix("goto ").map(String::from))
    {
        // `ip saddr != { a, b } drop` (one element: `ip saddr != a drop`).
        let admitted = w.rules(&chain).iter().all(|rule| {
            let Some(rest) = rule.strip_prefix(&format!("{family} saddr != ")) else { return true };
            let set = match rest.strip_prefix("{ ") {
                Some(set) => set.split(" }").next().unwrap_or_default(),
                None => rest.split_whitespace().next().unwrap_or_default(),
            };
            set.split(',').map(str::trim).any(|s| within(from, s))
        });
        if !admitted {
            let frontend = frontend(&key);
            return Walk {
                walked: Walked::Dropped(format!("not accepted by {chain}")),
                frontend,
                affinity: false,
            };
        }
    }
    let dispatched = match find("service-ips", &key) {
        Some(verdict) => Some((frontend(&key), verdict)),
        None if node_port => find("service-nodeports", &port_key).map(|v| (frontend(&port_key), v)),
        None => None,
    };
    if let Some((frontend, verdict)) = dispatched
        && let Some(chain) = verdict.strip_prefix("goto ")
        && let Some(walked) = w.follow(chain)
    {
        return Walk { walked, frontend, affinity: w.affinity };
    }
    // No DNAT: the filter chains' checks, after it.
    let refusal = find("no-endpoint-services", &key).map(|v| (key.as_str(), v)).or_else(|| {
        node_port
            .then(|| find("no-endpoint-nodeports", &port_key))
            .flatten()
            .map(|v| (port_key.as_str(), v))
    });
    let walked = match &refusal {
        Some((_, verdict)) if verdict == "drop" => Walked::Dropped("has no local endpoints".into()),
        Some(_) => Walked::Refused("has no endpoints".into()),
        None if listing.cluster_ips.contains(&to.to_string()) => {
            return Walk {
                walked: Walked::Refused("another port of a ClusterIP".into()),
                frontend: None,
                affinity: false,
            };
        }
        None => return passed,
    };
    Walk { walked, frontend: refusal.and_then(|(k, _)| frontend(k)), affinity: false }
}

/// The statement of a rule marking for masquerade, as nft lists it.
const MARK: &str = "meta mark set ";
/// The statement of a rule translating to an endpoint.
const DNAT: &str = " dnat to ";

/// Whether `rule` is an affinity check (`ip saddr @affinity-… …`), not a
/// pick that remembers its client (`… update @affinity-… { ip saddr } …`).
fn is_affinity_check(rule: &str) -> bool {
    rule.contains("saddr @affinity-")
}

/// A packet's way through the service chains.
struct Walker<'a> {
    chains: &'a BTreeMap<String, Vec<String>>,
    p: &'a Packet<'a>,
    masquerade: bool,
    affinity: bool,
}

impl Walker<'_> {
    fn rules(&self, chain: &str) -> &[String] {
        self.chains.get(chain).map_or(&[], Vec::as_slice)
    }

    /// Follows `chain`: `None` when the packet falls off its end (no DNAT).
    fn follow(&mut self, chain: &str) -> Option<Walked> {
        let mut candidates: Vec<String> = Vec::new();
        for rule in self.rules(chain).to_vec() {
            let rule = rule.split(" comment \"").next().unwrap_or_default();
            if is_affinity_check(rule) {
                self.affinity = true;
                continue;
            }
            if let Some((matches, _)) = rule.split_once(MARK) {
                if self.holds(matches) {
                    self.masquerade = true;
                }
            } else if let Some((matches, address)) = rule.split_once(DNAT) {
                candidates.push(address.trim().to_string());
                if !matches.starts_with("numgen ") {
                    break;
                }
            } else if let Some((matches, target)) = rule.rsplit_once("goto ")
                && self.holds(matches)
            {
                return self.follow(target);
            }
        }
        // `masquerading`: a connection DNATed to its own source.
        let from = self.p.from.ip();
        let hairpin = |c: &String| c.parse::<SocketAddr>().is_ok_and(|c| c.ip() == from);
        self.masquerade |= candidates.iter().any(hairpin);
        let n = candidates.len();
        (n > 0).then(|| Walked::Translated {
            candidates: candidates.into_iter().map(|c| (c, 1.0 / n as f64)).collect(),
            masquerade: self.masquerade,
        })
    }

    /// Whether every match of `matches` takes the packet.
    fn holds(&self, matches: &str) -> bool {
        let (from, to) = (self.p.from.ip(), self.p.to.ip());
        let words: Vec<&str> = matches.split_whitespace().collect();
        let mut i = 0;
        while i < words.len() {
            let (ok, used) = match &words[i..] {
                ["fib", "saddr", "type", "local", ..] => (self.p.local.contains(&from), 4),
                [_, "saddr", "!=", value, ..] => (!within(from, value), 4),
                [_, "saddr", value, ..] => (within(from, value), 3),
                [_, "daddr", "!=", value, ..] => (!within(to, value), 4),
                [_, "daddr", value, ..] => (within(to, value), 3),
                _ => (true, 1),
            };
            if !ok {
                return false;
            }
            i += used;
        }
        true
    }
}

/// A frontend's chain walked down to its backends.
struct BackendWalk<'a> {
    chains: &'a BTreeMap<String, Vec<String>>,
    flags: Vec<&'static str>,
    backends: Vec<LbBackend>,
}

impl BackendWalk<'_> {
    fn add(&mut self, f: &'static str) {
        if !self.flags.contains(&f) {
            self.flags.push(f);
        }
    }

    fn rules(&self, chain: &str) -> &[String] {
        self.chains.get(chain).map_or(&[], Vec::as_slice)
    }

    fn follow(&mut self, chain: &str) {
        if chain.starts_with("external-") {
            // Its last rule, taken by every source, when it has one: the
            // policy's chain (node-local and pod sources go to `service-`
            // before it).
            let last = self.rules(chain).iter().rev().find_map(|r| r.strip_prefix("goto "));
            if let Some(next) = last.map(str::to_string) {
                self.follow(&next);
            }
        } else if chain.starts_with("service-") || chain.starts_with("local-") {
            let local = chain.starts_with("local-");
            if local {
                self.add(flag::LOCAL_POLICY);
            }
            let rules = self.rules(chain).to_vec();
            if rules.iter().any(|r| is_affinity_check(r)) {
                self.add(flag::AFFINITY);
            }
            // The endpoints the pick goes to.
            let picks = rules.iter().filter(|r| !is_affinity_check(r));
            for (_, address) in picks.filter_map(|r| r.split_once(DNAT)) {
                let address = address.split(" comment ").next().unwrap_or_default().trim();
                let local = local.then_some(true);
                let backend = LbBackend { address: address.into(), local, maglev_share: None };
                self.backends.push(backend);
            }
        }
    }
}

/// The table these tables (`nft list table` output) program.
pub fn entries(text: &str) -> Vec<LbEntry> {
    listings(text).iter().flat_map(table_entries).collect()
}

/// The entries of one family's table (`ip`, `ip6`): a NodePort is
/// `*:port/proto` in both.
pub fn entries_of(text: &str, family: &str) -> Vec<LbEntry> {
    listings(text).iter().filter(|l| l.family == family).flat_map(table_entries).collect()
}

/// The entries of one table.
fn table_entries(listing: &Listing) -> Vec<LbEntry> {
    let map = |name: &str| listing.maps.get(name).map_or(&[][..], Vec::as_slice);
    let firewalled: BTreeSet<&str> = map("firewall-ips").iter().map(|e| e.key.as_str()).collect();
    let kind = |key: &str, ip: &str, nodeport: bool| match () {
        _ if nodeport => "NodePort",
        _ if listing.cluster_ips.contains(ip) => "ClusterIP",
        _ if firewalled.contains(key) => "LoadBalancer",
        _ => "External",
    };
    let mut out = Vec::new();
    for (name, nodeport) in [("service-ips", false), ("service-nodeports", true)] {
        for e in map(name) {
            let (Some(frontend), Some(chain)) = (frontend(&e.key), e.verdict.strip_prefix("goto "))
            else {
                continue;
            };
            let ip = e.key.split(" . ").next().unwrap_or_default();
            let mut walk =
                BackendWalk { chains: &listing.chains, flags: Vec::new(), backends: Vec::new() };
            if firewalled.contains(e.key.as_str()) {
                walk.add(flag::SOURCE_RANGES);
            }
            walk.follow(chain);
            out.push(LbEntry {
                frontend,
                kind: kind(&e.key, ip, nodeport).into(),
                service: service_of(chain),
                flags: walk.flags,
                backends: walk.backends,
            });
        }
    }
    // Frontends without (local) endpoints.
    for (name, nodeport) in [("no-endpoint-services", false), ("no-endpoint-nodeports", true)] {
        for e in map(name) {
            let Some(frontend) = frontend(&e.key) else { continue };
            let ip = e.key.split(" . ").next().unwrap_or_default();
            let flags = match e.verdict.as_str() {
                "drop" => vec![flag::LOCAL_POLICY, flag::DROP_WHEN_EMPTY],
                _ => vec![],
            };
            out.push(LbEntry {
                frontend,
                kind: kind(&e.key, ip, nodeport).into(),
                service: e.comment.clone().unwrap_or_else(|| "?".into()),
                flags,
                backends: vec![],
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        backend::nftables::render::{Options, render},
        model::{Cidr, IpFamily},
    };

    use test_objects::{Protocol::Tcp, ep, port, service};

    /// What `nft list table ip kube-proxy` prints of a rendered ruleset
    /// (its layout; the kernel's own listing is read in the lab).
    const LISTED: &str = r#"table ip kube-proxy {
	comment "rules for kube-proxy"
	set cluster-ips {
		type ipv4_addr
		comment "Active ClusterIPs"
		elements = { 10.96.0.10, 10.96.0.11 }
	}

	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 10.96.0.10 . tcp . 80 : goto service-AAAAAAAA-demo/web/tcp/http,
			     172.18.0.50 . tcp . 80 : goto external-AAAAAAAA-demo/web/tcp/http,
			     10.200.0.5 . tcp . 80 : goto external-AAAAAAAA-demo/web/tcp/http }
	}

	map service-nodeports {
		type inet_proto . inet_service : verdict
		elements = { tcp . 30080 : goto external-AAAAAAAA-demo/web/tcp/http }
	}

	map firewall-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 172.18.0.50 . tcp . 80 : goto firewall-AAAAAAAA-demo/web/tcp/http }
	}

	map no-endpoint-services {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 10.96.0.11 . udp . 53 comment "demo/empty:dns" : goto reject-chain }
	}

	chain service-AAAAAAAA-demo/web/tcp/http {
		ip daddr 10.96.0.10 ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x00004000
		ip saddr @affinity-BBBBBBBB-demo/web/tcp/http__10.244.1.2/8080 update @affinity-BBBBBBBB-demo/web/tcp/http__10.244.1.2/8080 { ip saddr } meta l4proto tcp dnat to 10.244.1.2:8080
		ip saddr @affinity-CCCCCCCC-demo/web/tcp/http__10.244.2.3/8080 update @affinity-CCCCCCCC-demo/web/tcp/http__10.244.2.3/8080 { ip saddr } meta l4proto tcp dnat to 10.244.2.3:8080
		numgen random mod 2 0 update @affinity-BBBBBBBB-demo/web/tcp/http__10.244.1.2/8080 { ip saddr } meta l4proto tcp dnat to 10.244.1.2:8080
		update @affinity-CCCCCCCC-demo/web/tcp/http__10.244.2.3/8080 { ip saddr } meta l4proto tcp dnat to 10.244.2.3:8080
	}

	chain local-AAAAAAAA-demo/web/tcp/http {
		ip saddr @affinity-BBBBBBBB-demo/web/tcp/http__10.244.1.2/8080 update @affinity-BBBBBBBB-demo/web/tcp/http__10.244.1.2/8080 { ip saddr } meta l4proto tcp dnat to 10.244.1.2:8080
		update @affinity-BBBBBBBB-demo/web/tcp/http__10.244.1.2/8080 { ip saddr } meta l4proto tcp dnat to 10.244.1.2:8080
	}

	chain external-AAAAAAAA-demo/web/tcp/http {
		ip saddr 10.244.0.0/16 goto service-AAAAAAAA-demo/web/tcp/http comment "short-circuit pod traffic"
		fib saddr type local meta mark set meta mark | 0x00004000 comment "masquerade local traffic"
		fib saddr type local goto service-AAAAAAAA-demo/web/tcp/http comment "short-circuit local traffic"
		goto local-AAAAAAAA-demo/web/tcp/http
	}

	chain firewall-AAAAAAAA-demo/web/tcp/http {
		ip saddr != { 192.168.0.0/16, 172.18.0.50 } drop
	}
}
"#;

    #[test]
    fn the_table_is_read_back_from_the_listing() {
        let mut entries = entries(LISTED);
        entries.sort();
        let row = |e: &LbEntry| {
            let backends: Vec<&str> = e.backends.iter().map(|b| b.address.as_str()).collect();
            format!(
                "{} {} {} {} {}",
                e.frontend,
                e.kind,
                e.service,
                e.flags.join(","),
                backends.join(",")
            )
        };
        let rows: Vec<String> = entries.iter().map(row).collect();
        assert_eq!(
            rows,
            [
                "*:30080/tcp NodePort demo/web:http local-policy,affinity 10.244.1.2:8080",
                "10.200.0.5:80/tcp External demo/web:http local-policy,affinity 10.244.1.2:8080",
                "10.96.0.10:80/tcp ClusterIP demo/web:http affinity 10.244.1.2:8080,10.244.2.3:8080",
                "10.96.0.11:53/udp ClusterIP demo/empty:dns  ",
                "172.18.0.50:80/tcp LoadBalancer demo/web:http source-ranges,local-policy,affinity 10.244.1.2:8080",
            ]
        );
    }

    /// `explain`'s walk of [`LISTED`] for a TCP packet `from` → `to` on a
    /// node at 192.168.100.11: the outcome, the candidates, masquerade.
    fn walked(from: &str, to: &str) -> (String, Vec<String>, bool) {
        let local = ["192.168.100.11".parse().unwrap()];
        let p = Packet {
            proto: "tcp",
            from: from.parse().unwrap(),
            to: to.parse().unwrap(),
            local: &local,
        };
        match walk(LISTED, &p).walked {
            Walked::Translated { candidates, masquerade } => {
                ("translated".into(), candidates.into_iter().map(|c| c.0).collect(), masquerade)
            }
            Walked::Refused(why) => (format!("refused: {why}"), vec![], false),
            Walked::Dropped(why) => (format!("dropped: {why}"), vec![], false),
            Walked::Passed => ("passed".into(), vec![], false),
        }
    }

    #[test]
    fn explain_walks_the_table_as_netfilter_does() {
        let both = vec!["10.244.1.2:8080".to_string(), "10.244.2.3:8080".into()];
        let here = vec!["10.244.1.2:8080".to_string()];
        // ClusterIP from a pod: both endpoints, the pod's address kept.
        assert_eq!(
            walked("10.244.5.5:4000", "10.96.0.10:80"),
            ("translated".into(), both.clone(), false)
        );
        // ... from outside the cluster CIDR: masqueraded.
        assert!(walked("192.168.1.9:4000", "10.96.0.10:80").2);
        // NodePort, policy Local: from outside this node's endpoint, the
        // client kept; from a pod, short-circuited to every endpoint.
        assert_eq!(
            walked("192.168.1.9:4000", "192.168.100.11:30080"),
            ("translated".into(), here.clone(), false)
        );
        assert_eq!(walked("10.244.5.5:4000", "192.168.100.11:30080").1, both);
        // Source ranges: outside dropped, inside translated.
        assert_eq!(
            walked("10.9.9.9:4000", "172.18.0.50:80").0,
            "dropped: not accepted by firewall-AAAAAAAA-demo/web/tcp/http"
        );
        assert_eq!(walked("192.168.1.9:4000", "172.18.0.50:80").1, here);
        // No endpoints, another port of a ClusterIP, nothing.
        // TCP to the UDP port's ClusterIP: another port of it, rejected.
        assert_eq!(
            walked("10.244.5.5:4000", "10.96.0.11:53").0,
            "refused: another port of a ClusterIP"
        );
        assert_eq!(
            walked("10.244.5.5:4000", "10.96.0.10:81").0,
            "refused: another port of a ClusterIP"
        );
        assert_eq!(walked("10.244.5.5:4000", "10.99.0.1:80").0, "passed");
        let local = ["192.168.100.11".parse().unwrap()];
        let udp = Packet {
            proto: "udp",
            from: "10.244.5.5:4000".parse().unwrap(),
            to: "10.96.0.11:53".parse().unwrap(),
            local: &local,
        };
        assert!(matches!(walk(LISTED, &udp).walked, Walked::Refused(_)));
    }

    #[test]
    fn each_familys_table_is_read_apart() {
        let v6 = LISTED
            .replace("table ip ", "table ip6 ")
            .replace("10.96.0.10 . tcp", "fd00:96::10 . tcp")
            .replace("10.96.0.10, ", "fd00:96::10, ")
            .replace("dnat to 10.244.1.2:8080", "dnat to [fd00:244::2]:8080");
        let both = entries(&format!("{LISTED}{v6}"));
        let of = |frontend: &str| -> Vec<String> {
            let entry = both.iter().find(|e| e.frontend == frontend).unwrap();
            entry.backends.iter().map(|b| b.address.clone()).collect()
        };
        assert_eq!(of("10.96.0.10:80/tcp"), ["10.244.1.2:8080", "10.244.2.3:8080"]);
        assert_eq!(of("[fd00:96::10]:80/tcp"), ["[fd00:244::2]:8080", "10.244.2.3:8080"]);
    }

    #[test]
    fn an_unnamed_port_and_an_ipv6_frontend() {
        assert_eq!(service_of("service-ULMVA6XW-ns1/svc1/tcp/"), "ns1/svc1");
        assert_eq!(service_of("external-ULMVA6XW-ns1/svc1/tcp/p80"), "ns1/svc1:p80");
        assert_eq!(frontend("fd00:96::10 . tcp . 80").unwrap(), "[fd00:96::10]:80/tcp");
        // The rendered ruleset's words are the ones read back.
        let svc = service("ns", "web").cluster_ip("10.96.0.10").port(port("http", 80));
        let slice = svc.slice().port("http", 8080, Tcp).endpoint(ep("10.244.1.2")).build();
        let model = crate::source::model_of(&[svc.build()], &[slice]);
        let opts = Options {
            family: IpFamily::V4,
            node_name: "node-a".into(),
            zone: None,
            node_ips: vec![],
            nodeport_addresses: vec![],
            cluster_cidr: Some(Cidr::parse("10.244.0.0/16").unwrap()),
            masquerade_all: false,
        };
        let rendered = render(&model, &opts).to_string();
        assert!(rendered.contains("/tcp/http meta l4proto tcp dnat to 10.244.1.2:8080"));
    }
}
