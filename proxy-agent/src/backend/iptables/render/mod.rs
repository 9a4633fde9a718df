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

use super::chains::{ServiceChains, endpoint_chain, is_service_chain};
use crate::model::{Cidr, Endpoint, IpFamily, Model, ServicePort};

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

/// The rules of one service port: which chains it needs, and their rules.
struct ServiceRules<'a> {
    port: &'a ServicePort,
    opts: &'a Options,
    large: bool,
    name: String,
    proto: &'static str,
    chains: ServiceChains,
    cluster: Vec<&'a Endpoint>,
    local: Vec<&'a Endpoint>,
}

impl<'a> ServiceRules<'a> {
    fn new(port: &'a ServicePort, opts: &'a Options, large: bool) -> Self {
        ServiceRules {
            port,
            opts,
            large,
            name: port.name.to_string(),
            proto: port.protocol.lower(),
            chains: ServiceChains::new(&port.name, port.protocol),
            cluster: sorted(port.cluster_endpoints(&opts.node_name, opts.zone.as_deref())),
            local: sorted(port.usable_endpoints(Some(&opts.node_name))),
        }
    }

    fn has_endpoints(&self) -> bool {
        !self.cluster.is_empty()
    }

    fn has_internal(&self) -> bool {
        if self.port.internal_local { !self.local.is_empty() } else { self.has_endpoints() }
    }

    fn has_external(&self) -> bool {
        if self.port.external_local { !self.local.is_empty() } else { self.has_endpoints() }
    }

    fn externally_accessible(&self) -> bool {
        self.port.node_port.is_some()
            || !self.port.external_ips().is_empty()
            || !self.port.load_balancer_ips().is_empty()
    }

    fn uses_svc(&self) -> bool {
        self.has_endpoints() && (!self.port.internal_local || self.externally_accessible())
    }

    fn uses_svl(&self) -> bool {
        !self.local.is_empty()
            && (self.port.internal_local
                || (self.port.external_local && self.externally_accessible()))
    }

    fn uses_ext(&self) -> bool {
        self.has_endpoints() && self.externally_accessible()
    }

    fn uses_fw(&self) -> bool {
        self.has_endpoints()
            && !self.port.load_balancer_ips().is_empty()
            && !self.port.source_ranges().is_empty()
    }

    fn internal_chain(&self) -> &str {
        if self.port.internal_local { &self.chains.svl } else { &self.chains.svc }
    }

    /// The endpoints that get a KUBE-SEP chain: those SVC or SVL use.
    fn sep_endpoints(&self) -> Vec<&'a Endpoint> {
        let mut endpoints: Vec<&Endpoint> =
            if self.uses_svc() { self.cluster.clone() } else { Vec::new() };
        if self.uses_svl() {
            for e in &self.local {
                if !endpoints.iter().any(|x| x.addr == e.addr) {
                    endpoints.push(e);
                }
            }
        }
        sorted(endpoints)
    }

    /// `-m tcp -p tcp -d IP --dport PORT`.
    fn dest<'b>(&'b self, ip: &'b str, port: &'b str) -> [&'b str; 8] {
        ["-m", self.proto, "-p", self.proto, "-d", ip, "--dport", port]
    }

    fn write(&self, filter: &mut Table, nat: &mut Table) {
        self.write_filter(filter);
        if !self.has_endpoints() {
            return;
        }
        let seps = self.sep_endpoints();
        if self.uses_ext() {
            nat.chain(&self.chains.ext);
        }
        if self.uses_fw() {
            nat.chain(&self.chains.fw);
        }
        if self.uses_svc() {
            nat.chain(&self.chains.svc);
        }
        if self.uses_svl() {
            nat.chain(&self.chains.svl);
        }
        for e in &seps {
            nat.chain(&endpoint_chain(&self.port.name, self.port.protocol, &e.addr.to_string()));
        }
        self.write_nat(nat, &seps);
    }

    fn write_filter(&self, filter: &mut Table) {
        let s = &self.name;
        let port = self.port.port.to_string();
        let (target, why) = if self.has_endpoints() {
            ("DROP", format!("\"{s} has no local endpoints\""))
        } else {
            ("REJECT", format!("\"{s} has no endpoints\""))
        };
        if !self.has_internal() {
            let cip = self.port.cluster_ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &why];
            words.extend(self.dest(&cip, &port));
            words.extend(["-j", target]);
            filter.rule("KUBE-SERVICES", &words);
        }
        let external = !self.has_external();
        for ip in self.port.external_ips() {
            if external {
                let ip = ip.to_string();
                let mut words = vec!["-m", "comment", "--comment", &why];
                words.extend(self.dest(&ip, &port));
                words.extend(["-j", target]);
                filter.rule("KUBE-EXTERNAL-SERVICES", &words);
            }
        }
        // All the firewall drops, then the no-endpoint rules, as kube-proxy.
        if self.uses_fw() {
            let not_accepted = format!("\"{s} traffic not accepted by {}\"", self.chains.fw);
            for ip in self.port.load_balancer_ips() {
                let ip = ip.to_string();
                let mut words = vec!["-m", "comment", "--comment", &not_accepted];
                words.extend(self.dest(&ip, &port));
                words.extend(["-j", "DROP"]);
                filter.rule("KUBE-PROXY-FIREWALL", &words);
            }
        }
        for ip in self.port.load_balancer_ips().iter().filter(|_| external) {
            let ip = ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &why];
            words.extend(self.dest(&ip, &port));
            words.extend(["-j", target]);
            filter.rule("KUBE-EXTERNAL-SERVICES", &words);
        }
        if let (Some(node_port), true) = (self.port.node_port, external) {
            let node_port = node_port.to_string();
            filter.rule(
                "KUBE-EXTERNAL-SERVICES",
                &[
                    "-m",
                    "comment",
                    "--comment",
                    &why,
                    "-m",
                    "addrtype",
                    "--dst-type",
                    "LOCAL",
                    "-m",
                    self.proto,
                    "-p",
                    self.proto,
                    "--dport",
                    &node_port,
                    "-j",
                    target,
                ],
            );
        }
        if let Some(hc) = self.port.health_check_node_port {
            let hc = hc.to_string();
            let what = format!("\"{s} health check node port\"");
            filter.rule(
                "KUBE-NODEPORTS",
                &[
                    "-m",
                    "comment",
                    "--comment",
                    &what,
                    "-m",
                    "tcp",
                    "-p",
                    "tcp",
                    "--dport",
                    &hc,
                    "-j",
                    "ACCEPT",
                ],
            );
        }
    }

    fn write_nat(&self, nat: &mut Table, seps: &[&Endpoint]) {
        let s = &self.name;
        let c = &self.chains;
        let port = self.port.port.to_string();
        let cip = self.port.cluster_ip.to_string();
        let cluster_ip = format!("\"{s} cluster IP\"");
        if self.has_internal() {
            let mut words = vec!["-m", "comment", "--comment", &cluster_ip];
            words.extend(self.dest(&cip, &port));
            words.extend(["-j", self.internal_chain()]);
            nat.rule("KUBE-SERVICES", &words);
        }
        let external_ip = format!("\"{s} external IP\"");
        for ip in self.port.external_ips() {
            let ip = ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &external_ip];
            words.extend(self.dest(&ip, &port));
            words.extend(["-j", &c.ext]);
            nat.rule("KUBE-SERVICES", &words);
        }
        let lb_ip = format!("\"{s} loadbalancer IP\"");
        let lb_target = if self.uses_fw() { &c.fw } else { &c.ext };
        for ip in self.port.load_balancer_ips() {
            let ip = ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &lb_ip];
            words.extend(self.dest(&ip, &port));
            words.extend(["-j", lb_target]);
            nat.rule("KUBE-SERVICES", &words);
        }
        if let Some(node_port) = self.port.node_port {
            let node_port = node_port.to_string();
            let bare = comment(s);
            if self.opts.localhost_nodeports() && self.opts.nfacct {
                nat.rule(
                    "KUBE-NODEPORTS",
                    &[
                        "-m",
                        "comment",
                        "--comment",
                        &bare,
                        "-m",
                        self.proto,
                        "-p",
                        self.proto,
                        "-d",
                        "127.0.0.0/8",
                        "--dport",
                        &node_port,
                        "-m",
                        "nfacct",
                        "--nfacct-name",
                        "localhost_nps_accepted_pkts",
                        "-j",
                        &c.ext,
                    ],
                );
            }
            nat.rule(
                "KUBE-NODEPORTS",
                &[
                    "-m",
                    "comment",
                    "--comment",
                    &bare,
                    "-m",
                    self.proto,
                    "-p",
                    self.proto,
                    "--dport",
                    &node_port,
                    "-j",
                    &c.ext,
                ],
            );
        }
        if self.has_internal() {
            let cidr = self.opts.cluster_cidr.map(|c| c.to_string());
            let mut words = vec!["-m", "comment", "--comment", &cluster_ip];
            words.extend(self.dest(&cip, &port));
            let masquerade = match (&cidr, self.opts.masquerade_all) {
                (_, true) => true,
                (Some(cidr), false) => {
                    words.extend(["!", "-s", cidr]);
                    true
                }
                (None, false) => false,
            };
            if masquerade {
                words.extend(["-j", "KUBE-MARK-MASQ"]);
                nat.rule(self.internal_chain(), &words);
            }
        }
        if self.uses_ext() {
            self.write_ext(nat);
        }
        if self.uses_fw() {
            for range in self.port.source_ranges() {
                let range = range.to_string();
                nat.rule(
                    &c.fw,
                    &["-m", "comment", "--comment", &lb_ip, "-s", &range, "-j", &c.ext],
                );
            }
            // kube-proxy checks its primary node IP only.
            let admits_node =
                self.opts.node_ips.first().is_some_and(|node| {
                    self.port.source_ranges().iter().any(|r| r.contains(*node))
                });
            if admits_node {
                for ip in self.port.load_balancer_ips() {
                    let ip = ip.to_string();
                    nat.rule(
                        &c.fw,
                        &["-m", "comment", "--comment", &lb_ip, "-s", &ip, "-j", &c.ext],
                    );
                }
            }
            let dropped =
                format!("\"other traffic to {s} will be dropped by KUBE-PROXY-FIREWALL\"");
            nat.rule(&c.fw, &["-m", "comment", "--comment", &dropped]);
        }
        if self.uses_svc() {
            self.write_balancer(nat, &c.svc, &self.cluster);
        }
        if self.uses_svl() {
            self.write_balancer(nat, &c.svl, &self.local);
        }
        for e in seps {
            self.write_endpoint(nat, e);
        }
    }

    fn write_ext(&self, nat: &mut Table) {
        let s = &self.name;
        let c = &self.chains;
        if !self.port.external_local {
            let why = format!("\"masquerade traffic for {s} external destinations\"");
            nat.rule(&c.ext, &["-m", "comment", "--comment", &why, "-j", "KUBE-MARK-MASQ"]);
            nat.rule(&c.ext, &["-j", &c.svc]);
            return;
        }
        if let Some(cidr) = self.opts.cluster_cidr {
            let cidr = cidr.to_string();
            let why = format!("\"pod traffic for {s} external destinations\"");
            nat.rule(&c.ext, &["-m", "comment", "--comment", &why, "-s", &cidr, "-j", &c.svc]);
        }
        // kube-proxy's pair for traffic from the node itself: masquerade,
        // then the cluster-wide chain.
        for (what, target) in [("masquerade", "KUBE-MARK-MASQ"), ("route", c.svc.as_str())] {
            let why = format!("\"{what} LOCAL traffic for {s} external destinations\"");
            let words = ["-m", "comment", "--comment", &why, "-m", "addrtype", "--src-type"];
            nat.rule(&c.ext, &[&words[..], &["LOCAL", "-j", target]].concat());
        }
        if self.has_external() {
            nat.rule(&c.ext, &["-j", &c.svl]);
        }
    }

    /// Affinity checks, then one statistic rule per endpoint (the last
    /// without a match), in `chain`.
    fn write_balancer(&self, nat: &mut Table, chain: &str, endpoints: &[&Endpoint]) {
        let seps: Vec<(String, String)> = endpoints
            .iter()
            .map(|e| {
                let ep = e.addr.to_string();
                (endpoint_chain(&self.port.name, self.port.protocol, &ep), ep)
            })
            .collect();
        let commented = |ep: &str| -> Vec<String> {
            if self.large {
                Vec::new()
            } else {
                ["-m", "comment", "--comment"]
                    .map(String::from)
                    .into_iter()
                    .chain([format!("\"{} -> {ep}\"", self.name)])
                    .collect()
            }
        };
        if let Some(timeout) = self.port.affinity_timeout_secs {
            for (sep, ep) in &seps {
                let mut words = commented(ep);
                words.extend(
                    ["-m", "recent", "--name", sep, "--rcheck", "--seconds"].map(String::from),
                );
                words.extend([timeout.to_string(), "--reap".into(), "-j".into(), sep.clone()]);
                nat.rule(chain, &words.iter().map(String::as_str).collect::<Vec<_>>());
            }
        }
        for (i, (sep, ep)) in seps.iter().enumerate() {
            let mut words = commented(ep);
            let left = seps.len() - i;
            if left > 1 {
                words.extend(
                    ["-m", "statistic", "--mode", "random", "--probability"].map(String::from),
                );
                words.push(probability(left));
            }
            words.extend(["-j".to_string(), sep.clone()]);
            nat.rule(chain, &words.iter().map(String::as_str).collect::<Vec<_>>());
        }
    }

    fn write_endpoint(&self, nat: &mut Table, e: &Endpoint) {
        let ep = e.addr.to_string();
        let ip = e.addr.ip().to_string();
        let sep = endpoint_chain(&self.port.name, self.port.protocol, &ep);
        let bare = comment(&self.name);
        let comment_words: Vec<&str> =
            if self.large { vec![] } else { vec!["-m", "comment", "--comment", &bare] };
        let mut hairpin = comment_words.clone();
        hairpin.extend(["-s", &ip, "-j", "KUBE-MARK-MASQ"]);
        nat.rule(&sep, &hairpin);
        let mut dnat = comment_words;
        if self.port.affinity_timeout_secs.is_some() {
            dnat.extend(["-m", "recent", "--name", &sep, "--set"]);
        }
        dnat.extend(["-m", self.proto, "-p", self.proto, "-j", "DNAT", "--to-destination", &ep]);
        nat.rule(&sep, &dnat);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::Protocol;

    use test_objects::{EndpointBuilder, Protocol::Tcp, ServiceBuilder, ep, port, service};

    /// The model of these services, each with its slice.
    fn model(services: &[(ServiceBuilder, Vec<EndpointBuilder>)]) -> Model {
        let slices = services.iter().map(|(s, endpoints)| slice(s, endpoints.clone()).build());
        let services = services.iter().map(|(s, _)| s.clone().build());
        crate::source::model_of(&services.collect::<Vec<_>>(), &slices.collect::<Vec<_>>())
    }

    /// Service `default/name` at `cluster_ip`.
    fn svc(name: &str, cluster_ip: &str) -> ServiceBuilder {
        service("default", name).cluster_ip(cluster_ip)
    }

    /// Service `web` at 10.96.0.50, port http 80.
    fn web() -> ServiceBuilder {
        svc("web", "10.96.0.50").port(port("http", 80))
    }

    /// Options for a node `node-a` at 192.168.100.11, cluster CIDR
    /// 10.244.0.0/16; the iptables backend's tests use them too.
    pub(crate) fn options() -> Options {
        Options {
            family: IpFamily::V4,
            node_name: "node-a".into(),
            zone: None,
            node_ips: vec![Ipv4Addr::new(192, 168, 100, 11).into()],
            nodeport_addresses: vec![],
            cluster_cidr: Some(Cidr::parse("10.244.0.0/16").unwrap()),
            masquerade_all: false,
            localhost_nodeports: true,
            nfacct: true,
            random_fully: true,
            conntrack_tcp_liberal: false,
        }
    }

    const FILTER_HEAD: &str = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
"#;
    const FORWARD: &str = r#"-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x00004000/0x00004000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
"#;
    const NAT_TOP: &str = r#"-A KUBE-POSTROUTING -m mark ! --mark 0x00004000/0x00004000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x00004000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000
"#;
    const NODEPORTS_LAST: &str = r#"-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#;

    /// The service's slice, its `http` and unnamed ports on 8080.
    fn slice(
        service: &ServiceBuilder,
        endpoints: Vec<EndpointBuilder>,
    ) -> test_objects::SliceBuilder {
        service.slice().port("http", 8080, Tcp).port(None, 8080, Tcp).endpoints(endpoints)
    }

    /// Options for the IPv6 family of node `node-a` at fd00:100::11, cluster
    /// CIDR fd00:10:244::/56.
    fn options_v6() -> Options {
        Options {
            family: IpFamily::V6,
            node_ips: vec!["fd00:100::11".parse().unwrap()],
            cluster_cidr: Some(Cidr::parse("fd00:10:244::/56").unwrap()),
            ..options()
        }
    }

    #[test]
    fn each_family_renders_only_its_own_ports() {
        let endpoints = || vec![ep("10.244.1.2").node("node-a")];
        let dual = web().cluster_ips(&["10.96.0.50", "fd00:96::50"]);
        let v6 = service("default", "v6").cluster_ip("fd00:96::51").port(port("http", 80));
        let both = model(&[(dual, endpoints()), (v6, vec![])]);
        let v4_alone = render(&model(&[(web(), endpoints())]), &options());
        assert_eq!(render(&both, &options()).to_string(), v4_alone.to_string());
        let v6_rules = render(&both, &options_v6()).to_string();
        assert!(!v6_rules.contains("10.96.0.50") && v6_rules.contains("fd00:96::51"));
    }

    #[test]
    fn the_ipv6_family_as_kube_proxy_writes_it() {
        let np = svc("web", "fd00:96::50").cluster_ips(&["fd00:96::50"]).node_port_type();
        let np = np.port(port("http", 80).node_port(30080));
        let v6_slice = np.slice().address_type("IPv6").port("http", 8080, Tcp);
        let v6_slice = v6_slice.endpoint(ep("fd00:244::2").node("node-a"));
        let m = crate::source::model_of(&[np.build()], &[v6_slice.build()]);
        let rules = render(&m, &options_v6()).to_string();
        for line in [
            "-A KUBE-SERVICES -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d fd00:96::50 --dport 80 -j KUBE-SVC-",
            "-A KUBE-SVC-",
            " ! -s fd00:10:244::/56 -j KUBE-MARK-MASQ",
            " -s fd00:244::2 -j KUBE-MARK-MASQ",
            " -m tcp -p tcp -j DNAT --to-destination [fd00:244::2]:8080",
            "-A KUBE-NODEPORTS -m comment --comment default/web:http -m tcp -p tcp --dport 30080 -j KUBE-EXT-",
            "-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS",
        ] {
            assert!(rules.contains(line), "missing {line}\n{rules}");
        }
        // No localhost NodePorts on IPv6, hence no martian guard either.
        for absent in ["127.0.0.0/8", "KUBE-FIREWALL", "localhost_nps_accepted_pkts"] {
            assert!(!rules.contains(absent), "{absent} in\n{rules}");
        }
        // --nodeport-addresses of the other family only: no NodePort address.
        let v4_only = Options {
            nodeport_addresses: vec![Cidr::parse("192.168.100.0/24").unwrap()],
            ..options_v6()
        };
        assert!(!render(&m, &v4_only).to_string().contains("-j KUBE-NODEPORTS"));
    }

    /// `explain`'s rule walk over the rules of the IPv6 family, as
    /// `ip6tables-save` prints them.
    #[test]
    fn explain_walks_the_ipv6_rules() {
        use crate::inspect::explain::{NO_ENDPOINT, Query, explain_rules};
        let np = svc("web", "fd00:96::50").cluster_ips(&["fd00:96::50"]).node_port_type();
        let np = np.port(port("http", 80).node_port(30080));
        let v6_slice = np.slice().address_type("IPv6").port("http", 8080, Tcp);
        let v6_slice = v6_slice.endpoint(ep("fd00:244::2").node("node-a"));
        let empty =
            svc("empty", "fd00:96::51").cluster_ips(&["fd00:96::51"]).port(port("http", 80));
        let m = crate::source::model_of(&[np.build(), empty.build()], &[v6_slice.build()]);
        let save = render(&m, &options_v6()).to_string();
        let local = ["fd00:100::11".parse().unwrap()];
        let query = |to: &str| Query {
            proto: Protocol::Tcp,
            from: "[fd00:100::101]:40000".parse().unwrap(),
            to: to.parse().unwrap(),
            program: "ip6tables rules".into(),
            replies_only: false,
        };
        let x = explain_rules(&query("[fd00:100::11]:30080"), &save, &local);
        assert_eq!(x.outcome, "translated", "{x:?}\n{save}");
        assert_eq!(x.frontend.as_ref().map(|f| f.kind.as_str()), Some("NodePort"));
        assert!(x.notes[0].ends_with("[fd00:244::2]:8080 100%"), "{:?}", x.notes);
        assert!(x.snat.is_some_and(|s| s.starts_with("MASQUERADE")));
        let x = explain_rules(&query("[fd00:96::51]:80"), &save, &local);
        assert_eq!((x.outcome, x.reason.as_deref()), ("refused", Some(NO_ENDPOINT)), "{save}");
        assert_eq!(x.action, "answered with ICMPv6 port unreachable (filter REJECT)");
        // Not a node address: no NodePort.
        let x = explain_rules(&query("[fd00:100::99]:30080"), &save, &local);
        assert_eq!(x.outcome, "passed");
    }

    #[test]
    fn cluster_ip_service_golden() {
        let endpoints = vec![ep("10.244.1.2").node("node-a"), ep("10.244.2.2").node("node-b")];
        let m = model(&[(web(), endpoints)]);
        let expected = String::from(FILTER_HEAD)
            + FORWARD
            + "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
            + ":KUBE-SVC-CDGGSHYLG3RE2FKL - [0:0]\n:KUBE-SEP-UIQK3OSOSTRHRPBX - [0:0]\n:KUBE-SEP-4EX2N4PG4ASNZOBF - [0:0]\n"
            + NAT_TOP
            + r#"-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.50 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-UIQK3OSOSTRHRPBX
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.2.2:8080" -j KUBE-SEP-4EX2N4PG4ASNZOBF
-A KUBE-SEP-UIQK3OSOSTRHRPBX -m comment --comment default/web:http -s 10.244.1.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-UIQK3OSOSTRHRPBX -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-4EX2N4PG4ASNZOBF -m comment --comment default/web:http -s 10.244.2.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-4EX2N4PG4ASNZOBF -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.2.2:8080
"# + NODEPORTS_LAST;
        assert_eq!(render(&m, &options()).to_string(), expected);
    }

    #[test]
    fn node_port_local_policy_and_a_service_without_endpoints_golden() {
        let np = svc("np", "10.96.0.60").node_port_type().external_policy("Local");
        let np = (np.port(port(None, 80).node_port(30080)), vec![ep("10.244.1.5").node("node-a")]);
        let services = [np, (svc("empty", "10.96.0.70").port(port(None, 80)), vec![])];
        let expected = String::from(FILTER_HEAD)
            + "-A KUBE-SERVICES -m comment --comment \"default/empty has no endpoints\" -m tcp -p tcp -d 10.96.0.70 --dport 80 -j REJECT\n"
            + FORWARD
            + "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
            + ":KUBE-EXT-LDATH6LIB7VCFHLW - [0:0]\n:KUBE-SVC-LDATH6LIB7VCFHLW - [0:0]\n:KUBE-SVL-LDATH6LIB7VCFHLW - [0:0]\n:KUBE-SEP-KKAYSMSONWI56KZA - [0:0]\n"
            + NAT_TOP
            + r#"-A KUBE-SERVICES -m comment --comment "default/np cluster IP" -m tcp -p tcp -d 10.96.0.60 --dport 80 -j KUBE-SVC-LDATH6LIB7VCFHLW
-A KUBE-NODEPORTS -m comment --comment default/np -m tcp -p tcp -d 127.0.0.0/8 --dport 30080 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-LDATH6LIB7VCFHLW
-A KUBE-NODEPORTS -m comment --comment default/np -m tcp -p tcp --dport 30080 -j KUBE-EXT-LDATH6LIB7VCFHLW
-A KUBE-SVC-LDATH6LIB7VCFHLW -m comment --comment "default/np cluster IP" -m tcp -p tcp -d 10.96.0.60 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-EXT-LDATH6LIB7VCFHLW -m comment --comment "pod traffic for default/np external destinations" -s 10.244.0.0/16 -j KUBE-SVC-LDATH6LIB7VCFHLW
-A KUBE-EXT-LDATH6LIB7VCFHLW -m comment --comment "masquerade LOCAL traffic for default/np external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-LDATH6LIB7VCFHLW -m comment --comment "route LOCAL traffic for default/np external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-LDATH6LIB7VCFHLW
-A KUBE-EXT-LDATH6LIB7VCFHLW -j KUBE-SVL-LDATH6LIB7VCFHLW
-A KUBE-SVC-LDATH6LIB7VCFHLW -m comment --comment "default/np -> 10.244.1.5:8080" -j KUBE-SEP-KKAYSMSONWI56KZA
-A KUBE-SVL-LDATH6LIB7VCFHLW -m comment --comment "default/np -> 10.244.1.5:8080" -j KUBE-SEP-KKAYSMSONWI56KZA
-A KUBE-SEP-KKAYSMSONWI56KZA -m comment --comment default/np -s 10.244.1.5 -j KUBE-MARK-MASQ
-A KUBE-SEP-KKAYSMSONWI56KZA -m comment --comment default/np -m tcp -p tcp -j DNAT --to-destination 10.244.1.5:8080
"# + NODEPORTS_LAST;
        // kube-proxy walks services in Go map order; we walk them by name.
        assert_eq!(render(&model(&services), &options()).to_string(), expected);
    }

    /// The rules of a service with its slice.
    fn lines(
        service: ServiceBuilder,
        endpoints: Vec<EndpointBuilder>,
        opts: &Options,
    ) -> Vec<String> {
        let model = model(&[(service, endpoints)]);
        render(&model, opts).to_string().lines().map(str::to_string).collect()
    }

    fn has(lines: &[String], line: &str) {
        assert!(lines.iter().any(|l| l == line), "missing:\n{line}\nin:\n{}", lines.join("\n"));
    }

    #[test]
    fn session_affinity_uses_recent() {
        let sticky = web().client_ip_affinity(Some(300));
        let l = lines(sticky, vec![ep("10.244.1.2")], &options());
        has(
            &l,
            "-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -m recent --name KUBE-SEP-UIQK3OSOSTRHRPBX --rcheck --seconds 300 --reap -j KUBE-SEP-UIQK3OSOSTRHRPBX",
        );
        has(
            &l,
            "-A KUBE-SEP-UIQK3OSOSTRHRPBX -m comment --comment default/web:http -m recent --name KUBE-SEP-UIQK3OSOSTRHRPBX --set -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080",
        );
    }

    #[test]
    fn probabilities_have_ten_decimals() {
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(2), "0.5000000000");
    }

    #[test]
    fn load_balancer_source_ranges_go_through_the_firewall_chain() {
        let lb = svc("web", "10.96.0.50").load_balancer_type().source_ranges(&["203.0.113.0/25"]);
        let lb = lb.port(port("http", 80).node_port(30080)).ingress_ip("198.51.100.7");
        let l = lines(lb, vec![ep("10.244.1.2")], &options());
        has(
            &l,
            "-A KUBE-SERVICES -m comment --comment \"default/web:http loadbalancer IP\" -m tcp -p tcp -d 198.51.100.7 --dport 80 -j KUBE-FW-CDGGSHYLG3RE2FKL",
        );
        has(
            &l,
            "-A KUBE-FW-CDGGSHYLG3RE2FKL -m comment --comment \"default/web:http loadbalancer IP\" -s 203.0.113.0/25 -j KUBE-EXT-CDGGSHYLG3RE2FKL",
        );
        has(
            &l,
            "-A KUBE-FW-CDGGSHYLG3RE2FKL -m comment --comment \"other traffic to default/web:http will be dropped by KUBE-PROXY-FIREWALL\"",
        );
        has(
            &l,
            "-A KUBE-PROXY-FIREWALL -m comment --comment \"default/web:http traffic not accepted by KUBE-FW-CDGGSHYLG3RE2FKL\" -m tcp -p tcp -d 198.51.100.7 --dport 80 -j DROP",
        );
        has(
            &l,
            "-A KUBE-EXT-CDGGSHYLG3RE2FKL -m comment --comment \"masquerade traffic for default/web:http external destinations\" -j KUBE-MARK-MASQ",
        );
        has(&l, "-A KUBE-EXT-CDGGSHYLG3RE2FKL -j KUBE-SVC-CDGGSHYLG3RE2FKL");
        assert!(
            !l.iter().any(|x| x.contains("-s 198.51.100.7")),
            "the range does not admit the node"
        );
    }

    #[test]
    fn local_policies_without_local_endpoints_drop() {
        let local = svc("web", "10.96.0.50").node_port_type().external_policy("Local");
        let local = local.internal_policy("Local").external_ips(&["10.200.0.5"]);
        let local = local.port(port("http", 80).node_port(30080));
        let l = lines(local, vec![ep("10.244.2.2").node("node-b")], &options());
        has(
            &l,
            "-A KUBE-SERVICES -m comment --comment \"default/web:http has no local endpoints\" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j DROP",
        );
        has(
            &l,
            "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"default/web:http has no local endpoints\" -m tcp -p tcp -d 10.200.0.5 --dport 80 -j DROP",
        );
        has(
            &l,
            "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"default/web:http has no local endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j DROP",
        );
        // External traffic from pods and the node still reaches the cluster.
        has(
            &l,
            "-A KUBE-EXT-CDGGSHYLG3RE2FKL -m comment --comment \"route LOCAL traffic for default/web:http external destinations\" -m addrtype --src-type LOCAL -j KUBE-SVC-CDGGSHYLG3RE2FKL",
        );
        assert!(!l.iter().any(|x| x.contains("KUBE-SVL-")), "no local endpoint, no SVL chain");
    }

    #[test]
    fn masquerade_all_and_nodeport_addresses() {
        let mut opts = options();
        opts.masquerade_all = true;
        opts.nodeport_addresses = vec![Cidr::parse("192.168.100.0/24").unwrap()];
        let l = lines(web(), vec![ep("10.244.1.2")], &opts);
        has(
            &l,
            "-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j KUBE-MARK-MASQ",
        );
        has(
            &l,
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d 192.168.100.11 -j KUBE-NODEPORTS",
        );
    }

    #[test]
    fn large_clusters_drop_per_endpoint_comments() {
        let endpoints: Vec<EndpointBuilder> =
            (0..1001).map(|i| ep(&format!("10.245.{}.{}", i / 250, i % 250 + 1))).collect();
        let l = lines(web(), endpoints.clone(), &options());
        let sep = endpoint_chain(
            &model(&[(web(), endpoints)]).ports().next().unwrap().name,
            Protocol::Tcp,
            "10.245.0.1:8080",
        );
        has(&l, &format!("-A {sep} -s 10.245.0.1 -j KUBE-MARK-MASQ"));
        has(&l, &format!("-A {sep} -m tcp -p tcp -j DNAT --to-destination 10.245.0.1:8080"));
        assert!(l.iter().any(|x| x.starts_with("-A KUBE-SVC-CDGGSHYLG3RE2FKL -m statistic")));
        has(
            &l,
            "-A KUBE-SERVICES -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL",
        );
    }

    #[test]
    fn jump_rules_are_kube_proxys() {
        let jumps = jump_rules();
        assert_eq!(jumps.len(), 14);
        assert_eq!(
            jumps[0],
            (
                "filter",
                "INPUT",
                vec![
                    "-m",
                    "conntrack",
                    "--ctstate",
                    "NEW",
                    "-m",
                    "comment",
                    "--comment",
                    "kubernetes externally-visible service portals",
                    "-j",
                    "KUBE-EXTERNAL-SERVICES"
                ]
            )
        );
        assert_eq!(jumps[13], ("filter", "OUTPUT", vec!["-j", "KUBE-FIREWALL"]));
    }
}
