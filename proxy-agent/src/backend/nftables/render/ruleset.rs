//! The ruleset as the table's fixed part, the per-service chains, the
//! affinity sets and the elements of the sets and maps; and the `nft -f`
//! transactions that write it: whole (a full sync), or only what differs
//! from what was applied (a partial sync).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, btree_map::Entry, hash_map},
    fmt::{self, Write as _},
    hash::{DefaultHasher, Hash, Hasher as _},
    io,
    net::IpAddr,
};

use super::names::{is_affinity_set, is_service_chain};
use crate::model::IpFamily;

/// The table, in both families.
pub const TABLE: &str = "kube-proxy";
/// kube-proxy's masquerade mark (bit 14).
const MARK: &str = "0x4000";
/// Marks a packet for masquerade: the one rule of kube-proxy's
/// `mark-for-masquerade` chain, written where kube-proxy jumps to it. A
/// transaction with a statement naming a chain makes nft read every chain
/// of the table first (0.25 s at 10,000 services); an endpoint change then
/// names none.
pub(super) const MARK_MASQ: &str = "mark set mark or 0x4000";
/// Chains an older agent made that this one does not: deleted by the
/// first full sync, once it flushed every chain that could jump to them.
const RETIRED_CHAINS: [&str; 1] = ["mark-for-masquerade"];

/// A set or map of the table's fixed part that per-service elements go in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Container {
    ClusterIps,
    HairpinEndpoints,
    ServiceIps,
    ServiceNodePorts,
    FirewallIps,
    NoEndpointServices,
    NoEndpointNodePorts,
}

impl Container {
    pub const ALL: [Container; 7] = [
        Container::ClusterIps,
        Container::HairpinEndpoints,
        Container::ServiceIps,
        Container::ServiceNodePorts,
        Container::FirewallIps,
        Container::NoEndpointServices,
        Container::NoEndpointNodePorts,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Container::ClusterIps => "cluster-ips",
            Container::HairpinEndpoints => "hairpin-endpoints",
            Container::ServiceIps => "service-ips",
            Container::ServiceNodePorts => "service-nodeports",
            Container::FirewallIps => "firewall-ips",
            Container::NoEndpointServices => "no-endpoint-services",
            Container::NoEndpointNodePorts => "no-endpoint-nodeports",
        }
    }

    /// `set` or `map`.
    fn kind(self) -> &'static str {
        match self {
            Container::ClusterIps | Container::HairpinEndpoints => "set",
            _ => "map",
        }
    }

    /// Whether several ports may add one element: an endpoint's address
    /// backs any number of them. Never a claim two ports dispute, and a
    /// partial sync only adds such elements: one no port has any more
    /// stays until the next full sync, where it is harmless (only a
    /// connection DNATed to its own source matches it).
    pub fn shared(self) -> bool {
        self == Container::HairpinEndpoints
    }

    /// Its type and comment, as kube-proxy declares it.
    fn declaration(self, addr: &str) -> String {
        let (key, comment) = match self {
            Container::ClusterIps => (addr.to_string(), "Active ClusterIPs"),
            Container::HairpinEndpoints => (
                format!("{addr} . {addr}"),
                "endpoints twice: a connection DNATed to its own source is masqueraded",
            ),
            Container::ServiceIps => {
                (addr.to_string(), "ClusterIP, ExternalIP and LoadBalancer IP traffic")
            }
            Container::ServiceNodePorts => (String::new(), "NodePort traffic"),
            Container::FirewallIps => {
                (addr.to_string(), "destinations that are subject to LoadBalancerSourceRanges")
            }
            Container::NoEndpointServices => {
                (addr.to_string(), "vmap to drop or reject packets to services with no endpoints")
            }
            Container::NoEndpointNodePorts => (
                String::new(),
                "vmap to drop or reject packets to service nodeports with no endpoints",
            ),
        };
        let ty = match (self.kind(), key.is_empty()) {
            ("set", _) => key,
            (_, true) => "inet_proto . inet_service : verdict".to_string(),
            (_, false) => format!("{key} . inet_proto . inet_service : verdict"),
        };
        format!("{{ type {ty} ; comment \"{comment}\" ; }}")
    }
}

/// One element: its value in a map, and the comment kube-proxy gives it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Element {
    pub value: Option<String>,
    pub comment: Option<String>,
}

/// An element's container and key (`172.30.0.41 . tcp . 80`).
pub type ElementKey = (Container, String);

/// kube-proxy's nftables ruleset for one family. `Display` gives it as
/// `nft -f` input that creates it in an empty table (the form of
/// kube-proxy's tests); [`Ruleset::full`] and [`Ruleset::partial`] give
/// the transactions a sync applies.
#[derive(Clone, Debug)]
pub struct Ruleset {
    family: IpFamily,
    /// Where NodePorts are served (`nodeport-ips`); `None`: every local
    /// address but loopback.
    nodeport_ips: Option<Vec<IpAddr>>,
    /// The per-service-port and per-endpoint chains and their rules.
    pub(super) chains: BTreeMap<String, Vec<String>>,
    /// The endpoints' affinity sets and their timeouts (seconds).
    pub(super) affinity: BTreeMap<String, u32>,
    pub(super) elements: BTreeMap<ElementKey, Element>,
}

/// What a sync applied, to tell what the next one changes: a digest of each
/// chain's rules and of each element, and the affinity sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    chains: HashMap<String, u64>,
    affinity: BTreeMap<String, u32>,
    elements: HashMap<ElementKey, u64>,
}

impl Applied {
    /// Whether an element at `key` was applied.
    pub fn has_element(&self, key: &ElementKey) -> bool {
        self.elements.contains_key(key)
    }

    /// Whether this per-service chain was applied.
    pub fn has_chain(&self, name: &str) -> bool {
        self.chains.contains_key(name)
    }

    /// `old`'s chains, affinity sets and elements replaced by `new`'s: what
    /// a partial sync of some ports (`new.partial(&old.applied())`) leaves.
    pub fn replace(&mut self, old: &Ruleset, new: &Ruleset) {
        for chain in old.chains.keys() {
            self.chains.remove(chain);
        }
        for set in old.affinity.keys() {
            self.affinity.remove(set);
        }
        for key in old.elements.keys() {
            self.elements.remove(key);
        }
        let applied = new.applied();
        self.chains.extend(applied.chains);
        self.affinity.extend(applied.affinity);
        self.elements.extend(applied.elements);
    }
}

/// What the kernel's table holds, listed before a full sync: the chains
/// and sets a full sync does not write are removed.
#[derive(Clone, Debug, Default)]
pub struct Existing {
    pub chains: BTreeSet<String>,
    pub sets: BTreeSet<String>,
}

/// A transaction for `nft -f`, and what it leaves to do.
#[derive(Debug, Default)]
pub struct Transaction {
    pub text: String,
    /// Per-service chains written (declared and filled).
    pub chains_written: usize,
    /// Per-service chains flushed because no longer used: they are deleted
    /// a while later (before Linux 6.2 the kernel notices only after a
    /// moment that no map element jumps to them any more).
    pub stale_chains: Vec<String>,
    /// Elements added and deleted.
    pub elements_written: usize,
}

fn digest(value: &impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// The type of a family's addresses in a set.
fn addr_type(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4_addr",
        IpFamily::V6 => "ipv6_addr",
    }
}

/// `ip` or `ip6`: a family's table, and the words of its matches.
fn ip(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// The statements of a transaction, written for one family's table.
struct Writer<'a> {
    out: &'a mut String,
    family: &'static str,
}

impl Writer<'_> {
    fn line(&mut self, verb: &str, what: &str, name: &str, rest: &str) {
        let (family, sep) = (self.family, if rest.is_empty() { "" } else { " " });
        let _ = writeln!(self.out, "{verb} {what} {family} {TABLE} {name}{sep}{rest}");
    }

    fn rule(&mut self, chain: &str, rule: &str) {
        self.line("add", "rule", chain, rule);
    }

    fn affinity_set(&mut self, family: IpFamily, name: &str, timeout: u32) {
        let ty = addr_type(family);
        self.line(
            "add",
            "set",
            name,
            &format!("{{ type {ty} ; flags dynamic,timeout ; timeout {timeout}s ; }}"),
        );
    }

    fn element(&mut self, verb: &str, set: &str, key: &str, element: Option<&Element>) {
        self.elements(verb, set, &[element_text(key, element)]);
    }

    /// Several elements (from [`element_text`]) in one statement.
    fn elements(&mut self, verb: &str, set: &str, elements: &[String]) {
        self.line(verb, "element", set, &format!("{{ {} }}", elements.join(", ")));
    }
}

/// An element as a statement lists it: `KEY [comment "C"] [: VALUE]`.
fn element_text(key: &str, element: Option<&Element>) -> String {
    let mut text = key.to_string();
    if let Some(element) = element {
        if let Some(comment) = &element.comment {
            let _ = write!(text, " comment \"{comment}\"");
        }
        if let Some(value) = &element.value {
            let _ = write!(text, " : {value}");
        }
    }
    text
}

/// A full sync adds elements this many to a statement: nft parses a
/// statement of a thousand faster than a thousand statements (3.7 s →
/// 3.3 s for the whole ruleset at 10,000 services × 10 endpoints).
const ELEMENTS_PER_STATEMENT: usize = 1000;

impl Writer<'_> {}

/// The base chains: (name, type, hook, priority). The filter chains that
/// see destinations before DNAT run just before it; the others at the
/// filter priority, after it.
const BASE_CHAINS: [(&str, &str, &str, i32); 8] = [
    ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
    ("filter-output-pre-dnat", "filter", "output", -110),
    ("filter-forward", "filter", "forward", 0),
    ("filter-input", "filter", "input", 0),
    ("filter-output", "filter", "output", 0),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
    ("nat-prerouting", "nat", "prerouting", -100),
];

/// The regular chains of the fixed part.
const TOP_CHAINS: [&str; 7] = [
    "cluster-ips-check",
    "firewall-check",
    "masquerading",
    "nodeport-endpoints-check",
    "reject-chain",
    "services",
    "service-endpoints-check",
];

impl Ruleset {
    pub fn new(family: IpFamily, nodeport_ips: Option<Vec<IpAddr>>) -> Self {
        Ruleset {
            family,
            nodeport_ips,
            chains: BTreeMap::new(),
            affinity: BTreeMap::new(),
            elements: BTreeMap::new(),
        }
    }

    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// A ruleset with one made-up service that uses every expression the
    /// mode writes (verdict maps, numgen, fib, ct status, an affinity set
    /// updated from the packet, dnat, marks, masquerade), for `probe` to
    /// have nft check.
    pub fn probe() -> Ruleset {
        let mut rs = Ruleset::new(IpFamily::V4, Some(vec![]));
        let (svc, ext) = ("service-probe/x", "external-probe/x");
        rs.affinity.insert("affinity-probe/x".into(), 10800);
        let translation =
            "update @affinity-probe/x { ip saddr } meta l4proto tcp dnat to 10.0.0.1:80";
        let sticky = format!("ip saddr @affinity-probe/x {translation}");
        let pick = format!("numgen random mod 2 0 {translation}");
        rs.chains.insert(svc.into(), vec![sticky, pick, translation.into()]);
        let local = format!("fib saddr type local {MARK_MASQ}");
        let short_circuit = format!("fib saddr type local goto {svc}");
        rs.chains.insert(ext.into(), vec![local, short_circuit]);
        let element = Element { value: Some(format!("goto {ext}")), comment: None };
        rs.elements.insert((Container::ServiceIps, "10.0.0.2 . tcp . 80".into()), element);
        let hairpin = Element { value: None, comment: None };
        rs.elements.insert((Container::HairpinEndpoints, "10.0.0.1 . 10.0.0.1".into()), hairpin);
        rs
    }

    /// Adds `part`'s chains, affinity sets and elements (a port's, from
    /// [`super::render_port`]). Returns whether an element's key was taken
    /// already (two ports claim one address and port; not a
    /// [`Container::shared`] one): the first keeps it.
    pub fn absorb(&mut self, part: &Ruleset) -> bool {
        self.chains.extend(part.chains.iter().map(|(c, r)| (c.clone(), r.clone())));
        self.affinity.extend(part.affinity.iter().map(|(s, t)| (s.clone(), *t)));
        let mut conflict = false;
        for (key, element) in &part.elements {
            match self.elements.entry(key.clone()) {
                Entry::Occupied(_) => conflict |= !key.0.shared(),
                Entry::Vacant(v) => {
                    v.insert(element.clone());
                }
            }
        }
        conflict
    }

    /// The keys of its elements that are a port's own (not
    /// [`Container::shared`]).
    pub fn own_element_keys(&self) -> impl Iterator<Item = &ElementKey> {
        self.elements.keys().filter(|key| !key.0.shared())
    }

    /// Whether it has this per-service chain.
    pub fn has_chain(&self, name: &str) -> bool {
        self.chains.contains_key(name)
    }

    fn ip(&self) -> &'static str {
        ip(self.family)
    }

    /// The rules of the fixed part's chains, in order.
    fn top_rules(&self) -> Vec<(&'static str, String)> {
        let ip = self.ip();
        let not_localhost = match self.family {
            IpFamily::V4 => "ip daddr != 127.0.0.0/8",
            IpFamily::V6 => "ip6 daddr != ::1",
        };
        let new = |target: &str| format!("ct state new jump {target}");
        let tuple = format!("{ip} daddr . meta l4proto . th dport vmap");
        let (nodeport_check, nodeports) = match self.nodeport_ips {
            Some(_) => (
                format!(
                    "{ip} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports"
                ),
                format!("{ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"),
            ),
            None => (
                format!("{not_localhost} meta l4proto . th dport vmap @no-endpoint-nodeports"),
                format!(
                    "fib daddr type local {not_localhost} meta l4proto . th dport vmap @service-nodeports"
                ),
            ),
        };
        vec![
            (
                "cluster-ips-check",
                format!(
                    "{ip} daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
                ),
            ),
            ("filter-prerouting-pre-dnat", new("firewall-check")),
            ("filter-output-pre-dnat", new("firewall-check")),
            ("filter-forward", new("service-endpoints-check")),
            ("filter-forward", new("cluster-ips-check")),
            ("filter-input", new("nodeport-endpoints-check")),
            ("filter-input", new("service-endpoints-check")),
            ("filter-output", new("service-endpoints-check")),
            ("filter-output", new("cluster-ips-check")),
            ("firewall-check", format!("{tuple} @firewall-ips")),
            // kube-proxy's endpoint chains each begin with this check.
            (
                "masquerading",
                format!("ct status dnat {ip} saddr . {ip} daddr @hairpin-endpoints {MARK_MASQ}"),
            ),
            ("masquerading", format!("mark and {MARK} == 0 return")),
            ("masquerading", format!("mark set mark xor {MARK}")),
            ("masquerading", "masquerade fully-random".to_string()),
            ("nat-output", "jump services".to_string()),
            ("nat-postrouting", "jump masquerading".to_string()),
            ("nat-prerouting", "jump services".to_string()),
            ("nodeport-endpoints-check", nodeport_check),
            ("reject-chain", "reject".to_string()),
            ("services", format!("{tuple} @service-ips")),
            ("services", nodeports),
            ("service-endpoints-check", format!("{tuple} @no-endpoint-services")),
        ]
    }

    /// The fixed part: the table, its sets and maps (emptied when `flush`),
    /// its chains (emptied when `flush`; base chains deleted first when
    /// `recreate`, so one left with other settings is made anew) and their
    /// rules, and the `nodeport-ips` elements.
    fn write_fixed(&self, w: &mut Writer, flush: bool, recreate: bool) {
        let _ = writeln!(
            w.out,
            "add table {} {TABLE} {{ comment \"rules for kube-proxy\" ; }}",
            w.family
        );
        let addr = addr_type(self.family);
        for container in Container::ALL {
            w.line("add", container.kind(), container.name(), &container.declaration(addr));
        }
        let nodeport_ips =
            format!("{{ type {addr} ; comment \"IPs that accept NodePort traffic\" ; }}");
        match (&self.nodeport_ips, flush) {
            (Some(_), _) => w.line("add", "set", "nodeport-ips", &nodeport_ips),
            // Into an empty table: not made at all.
            (None, false) => {}
            // Added first: deleting a set that is not there fails.
            (None, true) => {
                w.line("add", "set", "nodeport-ips", &nodeport_ips);
                w.line("delete", "set", "nodeport-ips", "");
            }
        }
        if flush && self.nodeport_ips.is_some() {
            w.line("flush", "set", "nodeport-ips", "");
        }
        if flush {
            for container in Container::ALL {
                w.line("flush", container.kind(), container.name(), "");
            }
        }
        for (name, ty, hook, priority) in BASE_CHAINS {
            if recreate {
                w.line("add", "chain", name, "");
                w.line("delete", "chain", name, "");
            }
            w.line(
                "add",
                "chain",
                name,
                &format!("{{ type {ty} hook {hook} priority {priority} ; }}"),
            );
            if flush {
                w.line("flush", "chain", name, "");
            }
        }
        for name in TOP_CHAINS {
            let spec = match name {
                "reject-chain" => {
                    "{ comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }"
                }
                _ => "",
            };
            w.line("add", "chain", name, spec);
            if flush {
                w.line("flush", "chain", name, "");
            }
        }
        for (chain, rule) in self.top_rules() {
            w.rule(chain, &rule);
        }
        for ip in self.nodeport_ips.iter().flatten() {
            w.element("add", "nodeport-ips", &ip.to_string(), None);
        }
    }

    fn writer<'a>(&self, out: &'a mut String) -> Writer<'a> {
        Writer { out, family: self.ip() }
    }

    /// What applying this ruleset leaves in the kernel, for the next
    /// partial sync.
    pub fn applied(&self) -> Applied {
        Applied {
            chains: self.chains.iter().map(|(name, rules)| (name.clone(), digest(rules))).collect(),
            affinity: self.affinity.clone(),
            elements: self.elements.iter().map(|(k, e)| (k.clone(), digest(e))).collect(),
        }
    }

    /// A partial sync: only the chains, affinity sets and elements that
    /// differ from `applied`; none when nothing does (empty text).
    pub fn partial(&self, applied: &Applied) -> Transaction {
        let mut sync = SyncWriter::partial(self.family, applied);
        sync.add(self);
        sync.finish(None).0
    }
}

/// A sync's transaction, written a port's part at a time (each rendered,
/// written and dropped), with the digests of what it applies: the agent
/// never holds the whole ruleset, and a full sync's text only a port's at
/// a time (`drain_into`).
pub struct SyncWriter<'a> {
    family: IpFamily,
    text: String,
    /// What the kernel holds before; `None`: a full sync, everything
    /// written.
    before: Option<&'a Applied>,
    /// What it holds after.
    after: Applied,
    /// A full sync that also deletes the [`RETIRED_CHAINS`] (the agent's
    /// first).
    retire: bool,
    /// A full sync's elements not written yet, per container (written
    /// [`ELEMENTS_PER_STATEMENT`] at a time).
    unwritten: BTreeMap<Container, Vec<String>>,
    chains_written: usize,
    elements_written: usize,
}

impl<'a> SyncWriter<'a> {
    /// A full sync: the fixed part of `fixed` (a ruleset of no service,
    /// with the NodePort addresses), its sets and chains emptied; then
    /// every port's part as it is added. `recreate`: the base chains are
    /// made anew and the retired chains deleted (the first sync: another
    /// version may have left them).
    pub fn full(fixed: &Ruleset, recreate: bool) -> Self {
        let mut text = String::new();
        fixed.write_fixed(&mut fixed.writer(&mut text), true, recreate);
        SyncWriter { retire: recreate, ..SyncWriter::new(fixed.family, text, None) }
    }

    /// A partial sync: of each port's part added, what differs from
    /// `before`.
    pub fn partial(family: IpFamily, before: &'a Applied) -> Self {
        SyncWriter::new(family, String::new(), Some(before))
    }

    fn new(family: IpFamily, text: String, before: Option<&'a Applied>) -> Self {
        SyncWriter {
            family,
            text,
            before,
            after: Applied::default(),
            retire: false,
            unwritten: BTreeMap::new(),
            chains_written: 0,
            elements_written: 0,
        }
    }

    /// Writes what `part` (a port's, from [`super::render_port`]) changes:
    /// [`SyncWriter::declare`], then [`SyncWriter::fill`].
    pub fn add(&mut self, part: &Ruleset) -> bool {
        self.declare(part);
        self.fill(part)
    }

    /// Declares `part`'s affinity sets and the chains it writes (emptied).
    /// A full sync declares every port's before any rule: nft 1.0.6 took
    /// three times longer over every later transaction in a table whose
    /// chains were made between rules (3.2 s against 1.1 s at 10,000
    /// services).
    pub fn declare(&mut self, part: &Ruleset) {
        let mut w = Writer { out: &mut self.text, family: ip(self.family) };
        for (name, timeout) in &part.affinity {
            if self.before.is_none_or(|b| b.affinity.get(name) != Some(timeout)) {
                w.affinity_set(self.family, name, *timeout);
            }
        }
        for (name, rules) in &part.chains {
            if self.before.is_none_or(|b| b.chains.get(name) != Some(&digest(rules))) {
                w.line("add", "chain", name, "");
                w.line("flush", "chain", name, "");
            }
        }
    }

    /// Writes the rules of `part`'s chains that changed (declared first)
    /// and its elements that did. Returns whether one of its elements'
    /// keys was taken already (two ports claim one address and port; not a
    /// [`Container::shared`] one): the first keeps it.
    pub fn fill(&mut self, part: &Ruleset) -> bool {
        let before = self.before;
        let mut w = Writer { out: &mut self.text, family: ip(self.family) };
        let after = &mut self.after;
        after.affinity.extend(part.affinity.iter().map(|(name, timeout)| (name.clone(), *timeout)));
        for (name, rules) in &part.chains {
            let d = digest(rules);
            if before.is_none_or(|b| b.chains.get(name) != Some(&d)) {
                rules.iter().for_each(|rule| w.rule(name, rule));
                self.chains_written += 1;
            }
            after.chains.insert(name.clone(), d);
        }
        let mut conflict = false;
        for (key, element) in &part.elements {
            let d = digest(element);
            match after.elements.entry(key.clone()) {
                hash_map::Entry::Occupied(_) => {
                    conflict |= !key.0.shared();
                    continue;
                }
                hash_map::Entry::Vacant(v) => v.insert(d),
            };
            match before.map(|b| b.elements.get(key)) {
                // A full sync: batched.
                None => {
                    let unwritten = self.unwritten.entry(key.0).or_default();
                    unwritten.push(element_text(&key.1, Some(element)));
                    if unwritten.len() == ELEMENTS_PER_STATEMENT {
                        w.elements("add", key.0.name(), &std::mem::take(unwritten));
                    }
                }
                Some(Some(was)) if *was == d => continue,
                Some(was) => {
                    if was.is_some() {
                        w.element("delete", key.0.name(), &key.1, None);
                    }
                    w.element("add", key.0.name(), &key.1, Some(element));
                }
            }
            self.elements_written += 1;
        }
        conflict
    }

    /// Writes the text so far into `out`, and forgets it: a full sync's
    /// transaction goes to nft a port at a time, never held whole.
    pub fn drain_into(&mut self, out: &mut dyn io::Write) -> io::Result<()> {
        out.write_all(self.text.as_bytes())?;
        self.text.clear();
        Ok(())
    }

    /// The transaction, ended by removing what the kernel holds that no
    /// part added (what `before` had, or in a full sync the per-service
    /// chains and affinity sets of `existing`): elements deleted (not
    /// [`Container::shared`] ones), chains flushed (to be deleted later),
    /// affinity sets deleted. Affinity sets kept keep their clients; the
    /// first full sync deletes the retired chains last. Returns it and what
    /// it leaves applied.
    pub fn finish(mut self, existing: Option<&Existing>) -> (Transaction, Applied) {
        let mut w = Writer { out: &mut self.text, family: ip(self.family) };
        for (container, elements) in &self.unwritten {
            if !elements.is_empty() {
                w.elements("add", container.name(), elements);
            }
        }
        let after = &self.after;
        let mut stale_chains = Vec::new();
        let mut stale_sets: Vec<&String> = Vec::new();
        if let Some(before) = self.before {
            let gone = |k: &&ElementKey| !k.0.shared() && !after.elements.contains_key(*k);
            for key in before.elements.keys().filter(gone) {
                w.element("delete", key.0.name(), &key.1, None);
                self.elements_written += 1;
            }
            stale_chains.extend(before.chains.keys().filter(|c| !after.has_chain(c)).cloned());
            stale_sets.extend(before.affinity.keys().filter(|s| !after.affinity.contains_key(*s)));
        }
        if let Some(existing) = existing {
            let gone = |c: &&String| is_service_chain(c) && !after.has_chain(c);
            stale_chains.extend(existing.chains.iter().filter(gone).cloned());
            let gone = |s: &&String| is_affinity_set(s) && !after.affinity.contains_key(*s);
            stale_sets.extend(existing.sets.iter().filter(gone));
        }
        for chain in &stale_chains {
            w.line("flush", "chain", chain, "");
        }
        for set in stale_sets {
            w.line("delete", "set", set, "");
        }
        // Added first: deleting a chain that is not there fails.
        for chain in RETIRED_CHAINS.iter().filter(|_| self.retire) {
            w.line("add", "chain", chain, "");
            w.line("delete", "chain", chain, "");
        }
        let tx = Transaction {
            text: self.text,
            chains_written: self.chains_written,
            stale_chains,
            elements_written: self.elements_written,
        };
        (tx, self.after)
    }
}

impl fmt::Display for Ruleset {
    /// The ruleset as `nft -f` input for an empty table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = String::new();
        let mut w = self.writer(&mut text);
        self.write_fixed(&mut w, false, false);
        for (name, timeout) in &self.affinity {
            w.affinity_set(self.family, name, *timeout);
        }
        for name in self.chains.keys() {
            w.line("add", "chain", name, "");
        }
        for (name, rules) in &self.chains {
            rules.iter().for_each(|rule| w.rule(name, rule));
        }
        for (key, element) in &self.elements {
            w.element("add", key.0.name(), &key.1, Some(element));
        }
        f.write_str(&text)
    }
}
