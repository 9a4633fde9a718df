//! The `iptables-restore` input kube-proxy's iptables mode writes on a full
//! sync, from our model. Pure code.
//!
//! Same chains, rule order, match order and comments as kube-proxy, so an
//! operator can diff it against a kube-proxy node (sorted: kube-proxy walks
//! its services in Go map order, we walk them by name). The jumps from the
//! built-in chains are not part of the restore input; kube-proxy ensures
//! them with separate `iptables -C/-I` commands, listed by [`jump_rules`].
//!
//! One ruleset per IP family, as kube-proxy runs one proxier per family:
//! the IPv6 one (`ip6tables-restore` input) differs only where kube-proxy's
//! does: no localhost NodePorts (never served on `::1`, and kubelet's
//! `KUBE-FIREWALL` martian rule is IPv4's), so the NodePort jump excludes
//! `::1/128`.

use std::{
    collections::{BTreeMap, HashSet},
    fmt::{self, Write as _},
    hash::{DefaultHasher, Hasher as _},
    net::{IpAddr, Ipv4Addr},
};

mod service_rules;

use super::chains::is_service_chain;
use crate::model::{Cidr, Endpoint, IpFamily, Model};
use service_rules::ServiceRules;

/// kube-proxy's masquerade mark (bit 14), as it formats it.
const MARK: &str = "0x00004000";
/// Above this many endpoints kube-proxy drops per-endpoint comments.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// What the rules depend on besides the services.
#[derive(Clone, Debug)]
pub struct Options {
    /// The family rendered: its service ports, addresses and CIDRs only.
    pub family: IpFamily,
    /// This node's name: endpoints with this `nodeName` are local.
    pub node_name: String,
    /// Its zone, for EndpointSlice hints.
    pub zone: Option<String>,
    /// This node's addresses of `family` (for loadBalancerSourceRanges that
    /// admit the node, and `--nodeport-addresses`).
    pub node_ips: Vec<IpAddr>,
    /// `--nodeport-addresses`; empty means every local address.
    pub nodeport_addresses: Vec<Cidr>,
    /// `--cluster-cidr` of `family`: the local-traffic detector.
    pub cluster_cidr: Option<Cidr>,
    pub masquerade_all: bool,
    /// NodePorts answer on 127.0.0.0/8 (kube-proxy's default for IPv4).
    pub localhost_nodeports: bool,
    /// The kernel has nfnetlink_acct counters (kube-proxy counts with them).
    pub nfacct: bool,
    /// iptables supports `MASQUERADE --random-fully` (1.6.2+).
    pub random_fully: bool,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` is set: kube-proxy then
    /// does not drop conntrack-INVALID forwards.
    pub conntrack_tcp_liberal: bool,
}

impl Options {
    /// `--nodeport-addresses` of this family: none given means every
    /// address, and so does a /0 of the family.
    fn nodeports_everywhere(&self) -> bool {
        self.nodeport_addresses.is_empty()
            || self.nodeport_addresses.iter().any(|c| c.len == 0 && c.family() == self.family)
    }

    /// Localhost NodePorts are on: IPv4 only, and kube-proxy turns them off
    /// when `--nodeport-addresses` leaves out loopback.
    pub fn localhost_nodeports(&self) -> bool {
        self.family == IpFamily::V4
            && self.localhost_nodeports
            && (self.nodeports_everywhere()
                || self.nodeport_addresses.iter().any(|c| c.contains(Ipv4Addr::LOCALHOST.into())))
    }
}

/// kubelet's chain dropping martian packets to 127.0.0.0/8 (which
/// route_localnet would let in): kube-proxy ensures it and its jumps, and
/// never removes them.
pub const KUBELET_FIREWALL: &str = "KUBE-FIREWALL";

/// The jumps from the built-in chains kube-proxy ensures outside the
/// restore input: (table, chain, arguments), each checked with `-C` and
/// inserted with `-I` when missing; kubelet's last.
pub fn jump_rules() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    let new = ["-m", "conntrack", "--ctstate", "NEW"];
    let jump = |table: &'static str,
                chain: &'static str,
                extra: &[&'static str],
                comment: &'static str,
                target: &'static str| {
        let mut args = extra.to_vec();
        if !comment.is_empty() {
            args.extend(["-m", "comment", "--comment", comment]);
        }
        args.extend(["-j", target]);
        (table, chain, args)
    };
    let external = "kubernetes externally-visible service portals";
    let portals = "kubernetes service portals";
    let firewall = "kubernetes load balancer firewall";
    vec![
        jump("filter", "INPUT", &new, external, "KUBE-EXTERNAL-SERVICES"),
        jump("filter", "FORWARD", &new, external, "KUBE-EXTERNAL-SERVICES"),
        jump("filter", "INPUT", &[], "kubernetes health check service ports", "KUBE-NODEPORTS"),
        jump("filter", "FORWARD", &new, portals, "KUBE-SERVICES"),
        jump("filter", "OUTPUT", &new, portals, "KUBE-SERVICES"),
        jump("filter", "FORWARD", &[], "kubernetes forwarding rules", "KUBE-FORWARD"),
        jump("filter", "INPUT", &new, firewall, "KUBE-PROXY-FIREWALL"),
        jump("filter", "OUTPUT", &new, firewall, "KUBE-PROXY-FIREWALL"),
        jump("filter", "FORWARD", &new, firewall, "KUBE-PROXY-FIREWALL"),
        jump("nat", "OUTPUT", &[], portals, "KUBE-SERVICES"),
        jump("nat", "PREROUTING", &[], portals, "KUBE-SERVICES"),
        jump("nat", "POSTROUTING", &[], "kubernetes postrouting rules", "KUBE-POSTROUTING"),
        jump("filter", "INPUT", &[], "", KUBELET_FIREWALL),
        jump("filter", "OUTPUT", &[], "", KUBELET_FIREWALL),
    ]
}

/// One table's part of the restore input: its chains in declaration order,
/// and its `-A` lines in kube-proxy's order.
#[derive(Clone, Debug, Default)]
struct Table {
    chains: Vec<String>,
    rules: Vec<String>,
}

impl Table {
    fn chain(&mut self, name: &str) {
        self.chains.push(name.to_string());
    }

    fn rule(&mut self, chain: &str, words: &[&str]) {
        self.rules.push(format!("-A {chain} {}", words.join(" ")));
    }

    /// Writes the chains and rules `include` selects, then declares and
    /// deletes the `stale` chains (after the rules that referenced them are
    /// flushed or rewritten).
    fn write(&self, out: &mut String, table: &str, include: impl Fn(&str) -> bool, stale: &[&str]) {
        let _ = writeln!(out, "*{table}");
        for chain in self
            .chains
            .iter()
            .map(String::as_str)
            .filter(|c| include(c))
            .chain(stale.iter().copied())
        {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        for line in self.rules.iter().filter(|line| include(rule_chain(line))) {
            let _ = writeln!(out, "{line}");
        }
        for chain in stale {
            let _ = writeln!(out, "-X {chain}");
        }
        let _ = writeln!(out, "COMMIT");
    }

    /// A digest of each chain's rules (chains without rules included).
    fn digests(&self) -> BTreeMap<&str, u64> {
        let mut hashers: BTreeMap<&str, DefaultHasher> =
            self.chains.iter().map(|c| (c.as_str(), DefaultHasher::new())).collect();
        for line in &self.rules {
            hashers.entry(rule_chain(line)).or_default().write(line.as_bytes());
        }
        hashers.into_iter().map(|(chain, h)| (chain, h.finish())).collect()
    }
}

/// The chain of an `-A CHAIN …` line.
fn rule_chain(line: &str) -> &str {
    line.split(' ').nth(1).unwrap_or_default()
}

/// The tables kube-proxy's iptables mode writes, as `iptables-restore`
/// input. `Display` gives a full sync's input.
#[derive(Clone, Debug, Default)]
pub struct Ruleset {
    filter: Table,
    nat: Table,
}

/// A table and one of its chains.
pub type ChainRef = (&'static str, String);

/// A digest of each chain's rules, to tell which chains changed.
pub type Digests = BTreeMap<ChainRef, u64>;

/// Which chains a restore rewrites.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// Every chain: a full sync.
    Full,
    /// The top-level chains, and the per-service chains whose rules differ
    /// from these digests of what was applied: a partial sync.
    ChangedSince(&'a Digests),
}

impl Ruleset {
    fn tables(&self) -> [(&'static str, &Table); 2] {
        [("filter", &self.filter), ("nat", &self.nat)]
    }

    pub fn digests(&self) -> Digests {
        self.tables()
            .into_iter()
            .flat_map(|(name, table)| {
                table.digests().into_iter().map(move |(c, d)| ((name, c.to_string()), d))
            })
            .collect()
    }

    /// The per-service chains among `existing` that this ruleset no longer
    /// has: a restore deletes them.
    pub fn stale_chains<'a>(
        &self,
        existing: impl IntoIterator<Item = &'a ChainRef>,
    ) -> Vec<ChainRef> {
        let current: HashSet<(&str, &str)> = self
            .tables()
            .into_iter()
            .flat_map(|(name, table)| table.chains.iter().map(move |c| (name, c.as_str())))
            .collect();
        existing
            .into_iter()
            .filter(|(table, chain)| is_service_chain(chain) && !current.contains(&(*table, chain)))
            .cloned()
            .collect()
    }

    /// The `iptables-restore --noflush` input for `scope`, deleting `stale`.
    pub fn restore_input(&self, scope: Scope, stale: &[ChainRef]) -> String {
        let digests = match scope {
            Scope::Full => Digests::new(),
            Scope::ChangedSince(_) => self.digests(),
        };
        let mut out = String::new();
        for (name, table) in self.tables() {
            let include = |chain: &str| match scope {
                Scope::Full => true,
                Scope::ChangedSince(applied) => {
                    let key = (name, chain.to_string());
                    !is_service_chain(chain) || applied.get(&key) != digests.get(&key)
                }
            };
            let stale: Vec<&str> =
                stale.iter().filter(|(t, _)| *t == name).map(|(_, c)| c.as_str()).collect();
            table.write(&mut out, name, include, &stale);
        }
        out
    }
}

impl fmt::Display for Ruleset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.restore_input(Scope::Full, &[]))
    }
}

/// A comment as kube-proxy writes it: quoted when it has spaces.
fn comment(text: &str) -> String {
    if text.contains(' ') { format!("\"{text}\"") } else { text.to_string() }
}

/// kube-proxy orders endpoints by their `ip:port` text.
fn sorted(mut endpoints: Vec<&Endpoint>) -> Vec<&Endpoint> {
    endpoints.sort_by_key(|e| e.addr.to_string());
    endpoints
}

/// kube-proxy's statistic probability for the i-th of the last `left` rules.
fn probability(left: usize) -> String {
    format!("{:.10}", 1.0 / left as f64)
}

/// The rules for `model`'s ports of `opts.family`.
pub fn render(model: &Model, opts: &Options) -> Ruleset {
    let ports = || model.ports_of(opts.family);
    let large = ports().map(|p| p.endpoints.len()).sum::<usize>() > LARGE_CLUSTER_ENDPOINTS;
    let mut filter = Table::default();
    let mut nat = Table::default();
    for chain in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
    ] {
        filter.chain(chain);
    }
    if opts.localhost_nodeports() {
        filter.chain("KUBE-FIREWALL");
        filter.rule(
            "KUBE-FIREWALL",
            &[
                "-m",
                "comment",
                "--comment",
                "\"block incoming localnet connections\"",
                "-d",
                "127.0.0.0/8",
                "!",
                "-s",
                "127.0.0.0/8",
                "-m",
                "conntrack",
                "!",
                "--ctstate",
                "RELATED,ESTABLISHED,DNAT",
                "-j",
                "DROP",
            ],
        );
    }
    for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        nat.chain(chain);
    }
    let not_marked = format!("{MARK}/{MARK}");
    nat.rule("KUBE-POSTROUTING", &["-m", "mark", "!", "--mark", &not_marked, "-j", "RETURN"]);
    nat.rule("KUBE-POSTROUTING", &["-j", "MARK", "--xor-mark", MARK]);
    let mut masquerade = vec![
        "-m",
        "comment",
        "--comment",
        "\"kubernetes service traffic requiring SNAT\"",
        "-j",
        "MASQUERADE",
    ];
    if opts.random_fully {
        masquerade.push("--random-fully");
    }
    nat.rule("KUBE-POSTROUTING", &masquerade);
    nat.rule("KUBE-MARK-MASQ", &["-j", "MARK", "--or-mark", MARK]);

    for port in ports() {
        ServiceRules::new(port, opts, large).write(&mut filter, &mut nat);
    }

    let nodeports =
        "\"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    if opts.nodeports_everywhere() {
        let mut words =
            vec!["-m", "comment", "--comment", nodeports, "-m", "addrtype", "--dst-type", "LOCAL"];
        match opts.family {
            IpFamily::V6 => words.extend(["!", "-d", "::1/128"]),
            IpFamily::V4 if !opts.localhost_nodeports() => {
                words.extend(["!", "-d", "127.0.0.0/8"]);
            }
            IpFamily::V4 => {}
        }
        words.extend(["-j", "KUBE-NODEPORTS"]);
        nat.rule("KUBE-SERVICES", &words);
    } else {
        for ip in opts
            .node_ips
            .iter()
            .filter(|ip| opts.nodeport_addresses.iter().any(|c| c.contains(**ip)))
        {
            let ip = ip.to_string();
            nat.rule(
                "KUBE-SERVICES",
                &["-m", "comment", "--comment", nodeports, "-d", &ip, "-j", "KUBE-NODEPORTS"],
            );
        }
    }

    if !opts.conntrack_tcp_liberal {
        let mut invalid = vec!["-m", "conntrack", "--ctstate", "INVALID"];
        if opts.nfacct {
            invalid.extend(["-m", "nfacct", "--nfacct-name", "ct_state_invalid_dropped_pkts"]);
        }
        invalid.extend(["-j", "DROP"]);
        filter.rule("KUBE-FORWARD", &invalid);
    }
    filter.rule(
        "KUBE-FORWARD",
        &[
            "-m",
            "comment",
            "--comment",
            "\"kubernetes forwarding rules\"",
            "-m",
            "mark",
            "--mark",
            &not_marked,
            "-j",
            "ACCEPT",
        ],
    );
    filter.rule(
        "KUBE-FORWARD",
        &[
            "-m",
            "comment",
            "--comment",
            "\"kubernetes forwarding conntrack rule\"",
            "-m",
            "conntrack",
            "--ctstate",
            "RELATED,ESTABLISHED",
            "-j",
            "ACCEPT",
        ],
    );

    Ruleset { filter, nat }
}

#[cfg(test)]
pub(crate) mod tests;
