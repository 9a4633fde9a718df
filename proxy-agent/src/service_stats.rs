//! Per-service traffic counters (issue 13), from the datapath's
//! per-frontend counters (`FRONTEND_STATS`, by reverse-NAT id): pure
//! aggregation into monotonic totals per service port, whatever becomes of
//! the ids (deleted, reused, a new map after the maps grew), and the bound
//! on how many series are exported.

use std::collections::{BTreeMap, HashMap};

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

    /// The metric families: (name, help, samples).
    pub fn families(&self) -> Vec<Family> {
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
            connections.push((with("path", "socket"), s.sock_connections));
            connections.push((with("path", "packet"), s.flows));
            refused.push((with("path", "socket"), s.sock_refused));
            refused.push((with("path", "packet"), s.refused));
            packets.push((labels.clone(), s.packets));
            bytes.push((labels.clone(), s.bytes));
            for reason in DropReason::ALL {
                dropped.push((with("reason", reason.name()), s.dropped[reason as usize]));
            }
        }
        vec![
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
                "proxy_service_packets",
                "Packets of a service port's flows translated per packet, both directions.",
                packets,
            ),
            (
                "proxy_service_bytes",
                "Bytes of those packets as tc sees them (L2 header included).",
                bytes,
            ),
            (
                "proxy_service_dropped",
                "Packets to a service port the datapath dropped, by reason.",
                dropped,
            ),
        ]
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
        let families = t.families();
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
    }
}
