//! Per-service traffic counters (issue 13), from the datapath's
//! per-frontend counters (eBPF mode: `FRONTEND_STATS`, by reverse-NAT id;
//! iptables mode: the packet counters of kube-proxy's rules, see
//! [`rule_counters`]): pure aggregation into monotonic totals per service
//! port, whatever becomes of the ids (deleted, reused, a new map after the
//! maps grew; rules rewritten), and the bound on how many series are
//! exported.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use proxy_common::{DropReason, FrontendStats};

/// The `service` label of the series summing the service ports beyond the
/// limit.
pub const OTHER: &str = "(other)";

/// A service port, as the metrics label it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePort {
    pub namespace: String,
    pub service: String,
    pub port: String,
}

impl ServicePort {
    /// From a frontend's recorded name: `ns/name:port`, `ns/name` for an
    /// unnamed port (kube-proxy's servicePortName).
    pub fn parse(name: &str) -> Self {
        let (namespace, rest) = name.split_once('/').unwrap_or(("", name));
        let (service, port) = rest.split_once(':').unwrap_or((rest, ""));
        ServicePort { namespace: namespace.into(), service: service.into(), port: port.into() }
    }

    fn other() -> Self {
        ServicePort { namespace: String::new(), service: OTHER.into(), port: String::new() }
    }
}

/// Where the counters are read from (the datapath's I/O).
pub trait Source: Send {
    fn read(&mut self) -> anyhow::Result<Snapshot>;
    /// What the datapath can tell.
    fn coverage(&self) -> Coverage;
    /// Reads on scrapes are at least this far apart (the last totals are
    /// shown meanwhile).
    fn min_interval(&self) -> Duration;
}

/// What a datapath's counters tell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Coverage {
    /// eBPF mode: everything.
    #[default]
    Everything,
    /// iptables mode: new connections (the nat table sees a flow's first
    /// packet), refusals and drops by the rules' reasons; no socket path,
    /// no packets or bytes per service.
    Rules,
}

/// One read of the datapath's counters.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The kernel's id of the map read: another one after the maps grew.
    pub map_id: u32,
    /// Per reverse-NAT id: the frontend's name (`None`: no longer known)
    /// and its counters summed over CPUs.
    pub frontends: Vec<(u32, Option<String>, FrontendStats)>,
}

/// Monotonic totals per service port.
#[derive(Debug, Default)]
pub struct Totals {
    /// Service ports with a series of their own, at most this many (0: no
    /// series at all).
    limit: usize,
    map_id: Option<u32>,
    /// Per id: the name and counters at the last read.
    last: HashMap<u32, (String, FrontendStats)>,
    series: BTreeMap<ServicePort, FrontendStats>,
    /// The service ports that came after the limit was reached.
    other: FrontendStats,
}

impl Totals {
    pub fn new(limit: usize) -> Self {
        Totals { limit, ..Totals::default() }
    }

    pub fn enabled(&self) -> bool {
        self.limit > 0
    }

    /// Adds what each frontend counted since the last read to its service
    /// port. An id whose counters shrank or whose name changed was deleted
    /// and made anew: all it holds is new. A new map holds only new counts.
    pub fn observe(&mut self, snapshot: Snapshot) {
        if self.map_id != Some(snapshot.map_id) {
            self.last.clear();
            self.map_id = Some(snapshot.map_id);
        }
        let mut last = HashMap::with_capacity(snapshot.frontends.len());
        for (id, name, now) in snapshot.frontends {
            let previous = self.last.remove(&id);
            // A frontend deleted since the read: its counters until then.
            let Some(name) = name.or_else(|| previous.as_ref().map(|(n, _)| n.clone())) else {
                continue;
            };
            let delta = match &previous {
                Some((before_name, before)) if *before_name == name => {
                    now.since(before).unwrap_or(now)
                }
                _ => now,
            };
            self.add(&name, &delta);
            last.insert(id, (name, now));
        }
        self.last = last;
    }

    /// Adds what the per-packet flows counted in their conntrack entries
    /// (eBPF mode, at each collection; [`Totals::observe`] reads the rest):
    /// growth per id, with its frontend's name (`None`: the id's name at
    /// the last read of the counters, if any).
    pub fn add_flows(&mut self, growth: Vec<(u32, Option<String>, FrontendStats)>) {
        if !self.enabled() {
            return;
        }
        for (id, name, delta) in growth {
            let name = name.or_else(|| self.last.get(&id).map(|(n, _)| n.clone()));
            if let Some(name) = name {
                self.add(&name, &delta);
            }
        }
    }

    /// Adds `delta` to its service port's series; service ports first
    /// seen after `limit` others go to the `(other)` series for good, so
    /// every series only grows.
    fn add(&mut self, name: &str, delta: &FrontendStats) {
        if *delta == FrontendStats::default() {
            return;
        }
        let port = ServicePort::parse(name);
        if let Some(total) = self.series.get_mut(&port) {
            total.add(delta);
        } else if self.series.len() < self.limit {
            self.series.insert(port, *delta);
        } else {
            self.other.add(delta);
        }
    }

    /// The series: each service port that saw traffic, then `(other)` if
    /// any went there.
    pub fn series(&self) -> impl Iterator<Item = (ServicePort, &FrontendStats)> {
        let other =
            (self.other != FrontendStats::default()).then(|| (ServicePort::other(), &self.other));
        self.series.iter().map(|(p, s)| (p.clone(), s)).chain(other)
    }

    /// The metric families: (name, help, samples), those `coverage` tells.
    pub fn families(&self, coverage: Coverage) -> Vec<Family> {
        let mut connections = Vec::new();
        let mut refused = Vec::new();
        let mut packets = Vec::new();
        let mut bytes = Vec::new();
        let mut dropped = Vec::new();
        for (port, s) in self.series() {
            let labels = labels(&port);
            let with = |name: &'static str, value: &str| {
                let mut l = labels.clone();
                l.push((name, value.to_string()));
                l
            };
            if coverage == Coverage::Everything {
                connections.push((with("path", "socket"), s.sock_connections));
                refused.push((with("path", "socket"), s.sock_refused));
                packets.push((labels.clone(), s.packets));
                bytes.push((labels.clone(), s.bytes));
            }
            connections.push((with("path", "packet"), s.flows));
            refused.push((with("path", "packet"), s.refused));
            for reason in DropReason::ALL {
                if coverage == Coverage::Everything || RULE_DROPS.contains(&reason) {
                    dropped.push((with("reason", reason.name()), s.dropped[reason as usize]));
                }
            }
        }
        let mut families = vec![
            (
                "proxy_service_connections",
                "New connections to a service port: path=socket, connect() calls (and datagrams starting a socket's flow) the socket LB translated; path=packet, new flows translated per packet.",
                connections,
            ),
            (
                "proxy_service_refused",
                "New connections to a service port without endpoints, refused (ECONNREFUSED on the socket path; TCP RST or ICMP unreachable per packet).",
                refused,
            ),
            (
                "proxy_service_dropped",
                "Packets to a service port the datapath dropped, by reason.",
                dropped,
            ),
        ];
        if coverage == Coverage::Everything {
            families.extend([
                (
                    "proxy_service_packets",
                    "Packets of a service port's flows translated per packet, both directions.",
                    packets,
                ),
                (
                    "proxy_service_bytes",
                    "Bytes of those packets as tc sees them (L2 header included).",
                    bytes,
                ),
            ]);
        }
        families
    }
}

/// The drop reasons kube-proxy's rules tell apart.
const RULE_DROPS: [DropReason; 2] = [DropReason::SourceOutsideRanges, DropReason::NoLocalEndpoint];

/// The counters of kube-proxy's rules in `iptables-save -c` output, by
/// rule (its table and text): the service port its comment names and what
/// its packets count as. New connections: the jumps from `KUBE-SERVICES`
/// and `KUBE-NODEPORTS` to a service's chains (the nat table sees a flow's
/// first packet only), and from a `KUBE-FW-` chain to `KUBE-EXT-` (an
/// admitted source); refusals: REJECT rules for services without
/// endpoints; drops: DROP rules for a Local policy without local
/// endpoints and `KUBE-PROXY-FIREWALL`'s (sources outside the ranges).
pub fn rule_counters(saved: &str) -> Vec<(String, String, FrontendStats)> {
    let mut table = "";
    let mut rules = Vec::new();
    for line in saved.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name;
            continue;
        }
        let Some((packets, rule)) = counted_rule(line) else { continue };
        let Some((service, stats)) = classify(table, rule, packets) else { continue };
        rules.push((format!("{table} {rule}"), service.to_string(), stats));
    }
    rules
}

/// `[packets:bytes] -A …`: the packets and the rule.
fn counted_rule(line: &str) -> Option<(u64, &str)> {
    let (counters, rule) = line.strip_prefix('[')?.split_once("] ")?;
    let packets = counters.split_once(':')?.0.parse().ok()?;
    Some((packets, rule.strip_prefix("-A ")?))
}

/// The service port a rule counts for and what it counts (None: a rule
/// counting nothing per service).
fn classify<'a>(table: &str, rule: &'a str, packets: u64) -> Option<(&'a str, FrontendStats)> {
    let chain = rule.split(' ').next()?;
    let comment = rule.split_once("--comment \"")?.1.split_once('"')?.0;
    let target = rule.rsplit_once(" -j ")?.1.split(' ').next()?;
    let service = comment.split(' ').next()?;
    let mut stats = FrontendStats::default();
    let to_service = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-"].iter().any(|p| target.starts_with(p));
    match (table, target) {
        ("nat", _) if to_service && matches!(chain, "KUBE-SERVICES" | "KUBE-NODEPORTS") => {
            stats.flows = packets
        }
        ("nat", _) if chain.starts_with("KUBE-FW-") && target.starts_with("KUBE-EXT-") => {
            stats.flows = packets
        }
        ("filter", "REJECT") if comment.ends_with(" has no endpoints") => stats.refused = packets,
        ("filter", "DROP") if comment.ends_with(" has no local endpoints") => {
            stats.dropped[DropReason::NoLocalEndpoint as usize] = packets
        }
        ("filter", "DROP") if chain == "KUBE-PROXY-FIREWALL" => {
            stats.dropped[DropReason::SourceOutsideRanges as usize] = packets
        }
        _ => return None,
    }
    Some((service, stats))
}

/// Stable ids for keys that come and go (the rules of each read): a key
/// keeps its id while it is read, one no longer read is forgotten.
#[derive(Debug, Default)]
pub struct Ids {
    ids: HashMap<String, u32>,
    next: u32,
}

impl Ids {
    /// The ids of `keys`, in order; keys not among them are forgotten.
    pub fn assign<'a>(&mut self, keys: impl IntoIterator<Item = &'a str>) -> Vec<u32> {
        let mut ids = HashMap::new();
        let assigned = keys
            .into_iter()
            .map(|key| {
                let id = self.ids.get(key).copied().unwrap_or_else(|| {
                    self.next = self.next.wrapping_add(1);
                    self.next
                });
                ids.insert(key.to_string(), id);
                id
            })
            .collect();
        self.ids = ids;
        assigned
    }
}

/// A sample's labels, as the metrics module encodes them.
pub type Labels = Vec<(&'static str, String)>;

/// A metric family: its name, help and samples.
pub type Family = (&'static str, &'static str, Vec<(Labels, u64)>);

fn labels(port: &ServicePort) -> Labels {
    vec![
        ("namespace", port.namespace.clone()),
        ("service", port.service.clone()),
        ("port", port.port.clone()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(flows: u64, packets: u64, bytes: u64) -> FrontendStats {
        FrontendStats { flows, packets, bytes, ..FrontendStats::default() }
    }

    fn snapshot(map_id: u32, frontends: &[(u32, Option<&str>, FrontendStats)]) -> Snapshot {
        let frontends =
            frontends.iter().map(|(id, name, s)| (*id, name.map(String::from), *s)).collect();
        Snapshot { map_id, frontends }
    }

    fn total(t: &Totals, name: &str) -> FrontendStats {
        let port = ServicePort::parse(name);
        t.series().find(|(p, _)| *p == port).map(|(_, s)| *s).unwrap_or_default()
    }

    #[test]
    fn names_split_into_namespace_service_and_port() {
        let p = ServicePort::parse("lab/web:http");
        assert_eq!(
            (p.namespace.as_str(), p.service.as_str(), p.port.as_str()),
            ("lab", "web", "http")
        );
        let p = ServicePort::parse("lab/web");
        assert_eq!((p.service.as_str(), p.port.as_str()), ("web", ""));
    }

    #[test]
    fn ids_of_one_service_port_add_up_and_reads_add_only_what_is_new() {
        let mut t = Totals::new(10);
        // A ClusterIP and a NodePort frontend of one service port.
        t.observe(snapshot(
            1,
            &[
                (1, Some("lab/web:http"), stats(2, 4, 400)),
                (2, Some("lab/web:http"), stats(1, 2, 200)),
            ],
        ));
        t.observe(snapshot(
            1,
            &[
                (1, Some("lab/web:http"), stats(3, 6, 600)),
                (2, Some("lab/web:http"), stats(1, 2, 200)),
            ],
        ));
        assert_eq!(total(&t, "lab/web:http"), stats(4, 8, 800));
    }

    #[test]
    fn totals_stay_monotonic_across_deletion_reuse_and_a_new_map() {
        let mut t = Totals::new(10);
        t.observe(snapshot(1, &[(1, Some("lab/a:http"), stats(5, 5, 500))]));
        // Id 1 deleted (its counters with it) and reused by another service.
        t.observe(snapshot(1, &[(1, Some("lab/b:http"), stats(1, 1, 100))]));
        assert_eq!(total(&t, "lab/a:http"), stats(5, 5, 500));
        assert_eq!(total(&t, "lab/b:http"), stats(1, 1, 100));
        // Deleted and made anew for the same service: fewer than before.
        t.observe(snapshot(1, &[(1, Some("lab/b:http"), stats(0, 1, 50))]));
        assert_eq!(total(&t, "lab/b:http"), stats(1, 2, 150));
        // The maps grew: a new map, counting from zero.
        t.observe(snapshot(2, &[(1, Some("lab/b:http"), stats(2, 3, 300))]));
        assert_eq!(total(&t, "lab/b:http"), stats(3, 5, 450));
        // The frontend's name is gone before its counters: still its own.
        t.observe(snapshot(2, &[(1, None, stats(3, 4, 400))]));
        assert_eq!(total(&t, "lab/b:http"), stats(4, 6, 550));
        // An unknown id with no name is skipped.
        t.observe(snapshot(2, &[(7, None, stats(9, 9, 9))]));
        assert_eq!(t.series().count(), 2);
    }

    #[test]
    fn flows_growth_adds_to_the_counters_read_under_the_ids_name() {
        let mut t = Totals::new(10);
        t.observe(snapshot(1, &[(1, Some("lab/web:http"), stats(2, 0, 0))]));
        t.add_flows(vec![(1, Some("lab/web:http".into()), stats(0, 5, 500))]);
        // The id's name is gone (the frontend deleted): the name it had.
        t.add_flows(vec![(1, None, stats(0, 1, 100))]);
        // An id never read and nameless counts for no service.
        t.add_flows(vec![(9, None, stats(0, 7, 700))]);
        t.observe(snapshot(1, &[(1, Some("lab/web:http"), stats(3, 0, 0))]));
        assert_eq!(total(&t, "lab/web:http"), stats(3, 6, 600));
        assert_eq!(t.series().count(), 1);
        // No series wanted: none made, not even `(other)`.
        let mut off = Totals::new(0);
        off.add_flows(vec![(1, Some("lab/web:http".into()), stats(0, 5, 500))]);
        assert_eq!(off.series().count(), 0);
    }

    #[test]
    fn service_ports_beyond_the_limit_sum_into_other_for_good() {
        let mut t = Totals::new(2);
        t.observe(snapshot(1, &[(1, Some("lab/a:x"), stats(1, 1, 1))]));
        t.observe(snapshot(
            1,
            &[(1, Some("lab/a:x"), stats(1, 1, 1)), (2, Some("lab/b:x"), stats(1, 1, 1))],
        ));
        let frontends = [
            (1, Some("lab/a:x"), stats(1, 1, 1)),
            (2, Some("lab/b:x"), stats(1, 1, 1)),
            (3, Some("lab/c:x"), stats(4, 4, 4)),
            (4, Some("lab/d:x"), stats(1, 1, 1)),
        ];
        t.observe(snapshot(1, &frontends));
        let names: Vec<_> = t.series().map(|(p, _)| p.service).collect();
        assert_eq!(names, ["a", "b", OTHER]);
        assert_eq!(t.series().last().map(|(_, s)| *s), Some(stats(5, 5, 5)));
        // Frontends without traffic make no series.
        let mut quiet = Totals::new(2);
        quiet.observe(snapshot(1, &[(1, Some("lab/a:x"), FrontendStats::default())]));
        assert_eq!(quiet.series().count(), 0);
    }

    #[test]
    fn families_label_paths_and_reasons() {
        let mut t = Totals::new(5);
        let mut s = stats(2, 10, 1000);
        s.sock_connections = 3;
        s.dropped[DropReason::NoLocalEndpoint as usize] = 4;
        t.observe(snapshot(1, &[(1, Some("lab/a:http"), s)]));
        let families = t.families(Coverage::Everything);
        let find = |name: &str, label: (&str, &str)| {
            let (_, _, samples) = families.iter().find(|(n, _, _)| *n == name).unwrap();
            samples
                .iter()
                .find(|(l, _)| l.iter().any(|(k, v)| *k == label.0 && v == label.1))
                .map(|(_, v)| *v)
        };
        assert_eq!(find("proxy_service_connections", ("path", "socket")), Some(3));
        assert_eq!(find("proxy_service_connections", ("path", "packet")), Some(2));
        assert_eq!(find("proxy_service_dropped", ("reason", "no_local_endpoint")), Some(4));
        assert_eq!(find("proxy_service_bytes", ("port", "http")), Some(1000));
        // What the rules cannot tell is not shown as zero.
        let families = t.families(Coverage::Rules);
        assert!(families.iter().all(|(n, _, _)| *n != "proxy_service_bytes"));
        let (_, _, conns) = &families[0];
        assert!(conns.iter().all(|(l, _)| !l.contains(&("path", "socket".to_string()))));
    }

    #[test]
    fn kube_proxys_rules_count_connections_refusals_and_drops() {
        let saved = r#"*filter
:KUBE-SERVICES - [0:0]
[4:240] -A KUBE-SERVICES -m comment --comment "lab/empty:http has no endpoints" -m tcp -p tcp -d 10.96.0.30 --dport 80 -j REJECT
[3:180] -A KUBE-EXTERNAL-SERVICES -m comment --comment "lab/empty:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30081 -j REJECT
[2:120] -A KUBE-EXTERNAL-SERVICES -m comment --comment "lab/local:http has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30083 -j DROP
[1:60] -A KUBE-PROXY-FIREWALL -m comment --comment "lab/guarded:http traffic not accepted by KUBE-FW-X" -m tcp -p tcp -d 10.200.0.10 --dport 80 -j DROP
[9:540] -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
*nat
[12:720] -A KUBE-SERVICES -m comment --comment "lab/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-A
[6:360] -A KUBE-NODEPORTS -m comment --comment "lab/web:http" -m tcp -p tcp --dport 30080 -j KUBE-EXT-A
[6:360] -A KUBE-EXT-A -j KUBE-SVC-A
[18:1080] -A KUBE-SVC-A -m comment --comment "lab/web:http -> 10.244.1.2:8080" -j KUBE-SEP-B
[3:180] -A KUBE-SERVICES -m comment --comment "lab/guarded:http loadbalancer IP" -m tcp -p tcp -d 10.200.0.10 --dport 80 -j KUBE-FW-X
[2:120] -A KUBE-FW-X -m comment --comment "lab/guarded:http loadbalancer IP" -s 192.168.100.250/32 -j KUBE-EXT-X
[0:0] -A KUBE-FW-X -m comment --comment "other traffic to lab/guarded:http will be dropped by KUBE-PROXY-FIREWALL"
COMMIT
"#;
        let rules = rule_counters(saved);
        let mut t = Totals::new(10);
        let ids = Ids::default().assign(rules.iter().map(|(k, _, _)| k.as_str()));
        let frontends =
            ids.into_iter().zip(rules).map(|(id, (_, name, s))| (id, Some(name), s)).collect();
        t.observe(Snapshot { map_id: 0, frontends });
        assert_eq!(total(&t, "lab/web:http").flows, 18);
        assert_eq!(total(&t, "lab/empty:http").refused, 7);
        assert_eq!(total(&t, "lab/local:http").dropped[DropReason::NoLocalEndpoint as usize], 2);
        let guarded = total(&t, "lab/guarded:http");
        assert_eq!(guarded.flows, 2);
        assert_eq!(guarded.dropped[DropReason::SourceOutsideRanges as usize], 1);
        assert_eq!(t.series().count(), 4, "KUBE-FORWARD counts for no service");
    }

    #[test]
    fn ids_stay_while_their_keys_are_read() {
        let mut ids = Ids::default();
        let first = ids.assign(["a", "b"]);
        let second = ids.assign(["b", "c"]);
        assert_eq!(first[1], second[0]);
        assert!(!first.contains(&second[1]));
        assert_ne!(ids.assign(["a"])[0], first[0], "a was forgotten, then made anew");
    }
}
