//! What the datapath holds, in words: the service table `proxy-agent lb
//! list` prints, read back from the kernel in any mode, from the pinned
//! maps ([`maps`]), from `iptables-save` ([`iptables`]) or from `nft list
//! table` ([`nftables`]), so one command answers "what does this node do
//! for my service" whatever the mode, and
//! while the agent is stopped. Building and printing the table is pure.

pub mod ct;
pub mod explain;
pub mod iptables;
pub mod maps;
pub mod nftables;
pub mod rule_walk;

use std::fmt::Write as _;

use proxy_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
use serde::Serialize;

/// Flags of a frontend, in words (the same in both modes).
pub mod flag {
    /// `sessionAffinity: ClientIP`.
    pub const AFFINITY: &str = "affinity";
    /// The traffic policy of this frontend is Local.
    pub const LOCAL_POLICY: &str = "local-policy";
    /// `loadBalancerSourceRanges` restrict its clients.
    pub const SOURCE_RANGES: &str = "source-ranges";
    /// Without a backend here, packets are dropped (endpoints elsewhere).
    pub const DROP_WHEN_EMPTY: &str = "drop-when-empty";
    /// The in-cluster twin of an external address with the Local policy
    /// (eBPF; iptables routes in-cluster sources in the same chain).
    pub const IN_CLUSTER: &str = "in-cluster";
    /// New flows pick from a Maglev table (eBPF; the iptables rules pick
    /// at random).
    pub const MAGLEV: &str = "maglev";
    /// Flows from outside to backends on other nodes go by direct server
    /// return (eBPF; the iptables rules masquerade).
    pub const DSR: &str = "dsr";
}

/// A protocol number's name, as the tables print it.
pub fn protocol(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "tcp",
        IPPROTO_UDP => "udp",
        IPPROTO_SCTP => "sctp",
        _ => "?",
    }
}

/// One frontend of a service and where it sends traffic.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct LbEntry {
    /// `address:port/protocol`; `*:port/protocol` for a NodePort the
    /// iptables mode serves on every local address.
    pub frontend: String,
    /// ClusterIP, NodePort, ExternalIP, LoadBalancer; External when the
    /// iptables rules do not tell an externalIP from a load-balancer IP.
    pub kind: String,
    /// `namespace/name:port`.
    pub service: String,
    pub flags: Vec<&'static str>,
    pub backends: Vec<LbBackend>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct LbBackend {
    /// `address:port`.
    pub address: String,
    /// Runs on this node; absent where the mode does not say (iptables
    /// rules name local endpoints only for the Local policy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local: Option<bool>,
    /// The entries of the frontend's Maglev table that name it (eBPF, a
    /// frontend with one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_share: Option<u32>,
}

/// Whether the service port `service` (`namespace/name:port`) is what
/// `wanted` names: `namespace/name` or `namespace/name:port`.
pub fn is_of(service: &str, wanted: &str) -> bool {
    service == wanted || service.split_once(':').is_some_and(|(name, _)| name == wanted)
}

/// The table, one backend a line, sorted by service then frontend.
pub fn table(entries: &[LbEntry]) -> String {
    let mut sorted: Vec<&LbEntry> = entries.iter().collect();
    sorted.sort_by(|a, b| (&a.service, &a.frontend).cmp(&(&b.service, &b.frontend)));
    let width =
        |f: fn(&LbEntry) -> usize, min| sorted.iter().map(|e| f(e)).max().unwrap_or(0).max(min);
    let (wf, wk, ws) =
        (width(|e| e.frontend.len(), 8), width(|e| e.kind.len(), 4), width(|e| e.service.len(), 7));
    let wl = width(|e| flags(e).len(), 5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<wf$}  {:<wk$}  {:<ws$}  {:<wl$}  BACKENDS",
        "FRONTEND", "KIND", "SERVICE", "FLAGS"
    );
    for e in sorted {
        let mut backends = e.backends.iter().map(backend);
        let first = backends.next().unwrap_or_else(|| empty(e).to_string());
        let flags = flags(e);
        let _ = writeln!(
            out,
            "{:<wf$}  {:<wk$}  {:<ws$}  {flags:<wl$}  {first}",
            e.frontend, e.kind, e.service
        );
        for b in backends {
            let _ = writeln!(out, "{:<w$}  {b}", "", w = wf + wk + ws + wl + 6);
        }
    }
    out
}

fn flags(e: &LbEntry) -> String {
    if e.flags.is_empty() { "-".into() } else { e.flags.join(",") }
}

fn backend(b: &LbBackend) -> String {
    match b.local {
        Some(true) => format!("{} (local)", b.address),
        _ => b.address.clone(),
    }
}

/// What a frontend without backends does.
fn empty(e: &LbEntry) -> &'static str {
    if e.flags.contains(&flag::DROP_WHEN_EMPTY) { "(none: dropped)" } else { "(none: refused)" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(frontend: &str, service: &str, backends: &[(&str, Option<bool>)]) -> LbEntry {
        LbEntry {
            frontend: frontend.into(),
            kind: "ClusterIP".into(),
            service: service.into(),
            flags: vec![],
            backends: backends
                .iter()
                .map(|(a, local)| LbBackend {
                    address: a.to_string(),
                    local: *local,
                    maglev_share: None,
                })
                .collect(),
        }
    }

    #[test]
    fn the_table_lists_a_backend_a_line_and_says_what_an_empty_frontend_does() {
        let mut dropped = entry("192.168.1.1:30080/tcp", "ns/b:http", &[]);
        dropped.flags = vec![flag::LOCAL_POLICY, flag::DROP_WHEN_EMPTY];
        let entries = [
            dropped,
            entry(
                "10.96.0.10:80/tcp",
                "ns/a:http",
                &[("10.0.0.1:80", Some(true)), ("10.0.0.2:80", None)],
            ),
            entry("10.96.0.11:53/udp", "ns/c", &[]),
        ];
        let out = table(&entries);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("FRONTEND") && lines[0].ends_with("BACKENDS"));
        assert!(
            lines[1].starts_with("10.96.0.10:80/tcp") && lines[1].ends_with("10.0.0.1:80 (local)")
        );
        assert!(lines[2].trim_start().starts_with("10.0.0.2:80"), "{out}");
        assert!(
            lines[3].contains("local-policy,drop-when-empty")
                && lines[3].ends_with("(none: dropped)")
        );
        assert!(lines[4].ends_with("(none: refused)"), "{out}");
    }

    #[test]
    fn a_service_is_named_with_or_without_its_port() {
        assert!(is_of("ns/a:http", "ns/a") && is_of("ns/a:http", "ns/a:http"));
        assert!(!is_of("ns/a:http", "ns/ab") && !is_of("ns/a:http", "ns/a:dns"));
    }
}
