//! `proxy-agent explain`: what the datapath does with one packet, in words.
//! The eBPF mode runs the real program on a packet crafted here
//! ([`craft`]) and reads back what it decided (`backend::ebpf::explain`);
//! [`explain`] turns that run and the service table into an
//! [`Explanation`]. Pure: no I/O.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use proxy_common::{
    explain::{AFFINITY, DSR, Decided, MAGLEV, SNAT, decode},
    maglev,
};
use serde::Serialize;

use super::{
    LbBackend, LbEntry, flag,
    rule_walk::{Packet, Walk, Walked, walk},
};
use crate::{backend::ebpf::explain::ExplainRun, model::Protocol, packet_craft};

const SYN: u8 = 0x02;

/// tc verdicts.
const NEXT: i32 = -1;
const STACK: i32 = 0;
const SHOT: i32 = 2;
const REDIRECT: i32 = 7;

/// The packet a client would send to start a flow: a TCP SYN (with an MSS
/// option, as real ones have) or a UDP datagram, in an Ethernet frame over
/// IPv4 or IPv6 (an IPv4 address of a mixed pair taken as IPv4-mapped: the
/// caller refuses mixed families), with valid checksums.
pub fn craft(proto: Protocol, from: SocketAddr, to: SocketAddr) -> Vec<u8> {
    match proto {
        // seq 1, data offset 6 words, SYN, window, checksum and urgent 0,
        // MSS 1460.
        Protocol::Tcp => packet_craft::packet(
            packet_craft::TCP,
            from,
            to,
            &[0, 0, 0, 1, 0, 0, 0, 0, 0x60, SYN, 0xfa, 0xf0, 0, 0, 0, 0, 2, 4, 0x05, 0xb4],
        ),
        // Length (8 + 4 bytes of payload), checksum 0, payload.
        Protocol::Udp => packet_craft::packet(
            packet_craft::UDP,
            from,
            to,
            &[0, 12, 0, 0, b'p', b'i', b'n', b'g'],
        ),
        Protocol::Sctp => packet_craft::sctp_init(from, to),
    }
}

/// The tuple of a frame (IPv4, or IPv6 without extension headers):
/// protocol, source, destination.
pub use packet_craft::tuple;

/// What the datapath does with the packet, as `explain` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// `tcp 192.168.1.5:40000 -> 10.96.0.10:80`.
    pub packet: String,
    /// Where it was run: `tc_ingress on eth0`.
    pub program: String,
    /// translated, tracked, refused, dropped or passed.
    pub outcome: &'static str,
    /// The frontend the packet addressed, if it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frontend: Option<Matched>,
    /// The frontend's backends (the ones the program chooses among).
    pub backends: Vec<LbBackend>,
    /// The backend picked, `address:port`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picked: Option<String>,
    /// How: `random`, `affinity` or `maglev`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<&'static str>,
    /// With `maglev`: the table entry the flow's hash picked, and the
    /// table's size (every node picks the same entry for the flow).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_entry: Option<(u32, u32)>,
    /// The packet as the program sends it on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub translated: Option<String>,
    /// The address the source is masqueraded to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat: Option<String>,
    /// What becomes of the packet.
    pub action: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub notes: Vec<String>,
}

/// A frontend of the service table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Matched {
    pub frontend: String,
    pub kind: String,
    pub service: String,
    pub flags: Vec<&'static str>,
}

/// What was asked: the packet and where it runs.
pub struct Query {
    pub proto: Protocol,
    /// Of the same family.
    pub from: SocketAddr,
    pub to: SocketAddr,
    /// `tc_ingress on eth0`.
    pub program: String,
    /// The program translates tracked flows only (`tc_pod_replies`).
    pub replies_only: bool,
}

impl Query {
    /// A packet from `from` to `to` where `program` meets it (one that
    /// translates new flows too).
    pub fn new(proto: Protocol, from: SocketAddr, to: SocketAddr, program: String) -> Self {
        Query { proto, from, to, program, replies_only: false }
    }
}

fn proto_name(proto: Protocol) -> &'static str {
    match proto {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// Why a packet is refused or dropped, in the same words in both modes.
pub const NO_ENDPOINT: &str = "the service has no endpoint";
pub const NO_LOCAL_ENDPOINT: &str = "traffic policy Local and no endpoint on this node";
pub const OUTSIDE_RANGES: &str = "the source is outside loadBalancerSourceRanges";
const PASSED: &str = "no frontend at this address and port, and no tracked flow";

/// The entry of the frontend `addressed` (`address:port/proto`): of two
/// sharing it (two scopes), the one whose backends hold `picked`, else the
/// external one.
fn entry_of<'a>(
    entries: &'a [LbEntry],
    addressed: &str,
    picked: Option<&str>,
) -> Option<&'a LbEntry> {
    let candidates: Vec<&LbEntry> = entries.iter().filter(|e| e.frontend == addressed).collect();
    let has_pick = |e: &&&LbEntry| e.backends.iter().any(|b| Some(b.address.as_str()) == picked);
    candidates
        .iter()
        .find(has_pick)
        .or_else(|| candidates.iter().find(|e| !e.flags.contains(&flag::IN_CLUSTER)))
        .copied()
}

/// An explanation of `query`'s packet to the frontend `entry`, its verdict
/// yet to be filled in (passed).
fn start(query: &Query, entry: Option<&LbEntry>) -> Explanation {
    Explanation {
        packet: format!("{} {} -> {}", proto_name(query.proto), query.from, query.to),
        program: query.program.clone(),
        outcome: "passed",
        frontend: entry.map(|e| Matched {
            frontend: e.frontend.clone(),
            kind: e.kind.clone(),
            service: e.service.clone(),
            flags: e.flags.clone(),
        }),
        backends: entry.map(|e| e.backends.clone()).unwrap_or_default(),
        picked: None,
        via: None,
        maglev_entry: None,
        translated: None,
        snat: None,
        action: "passed on untouched".into(),
        reason: None,
        notes: Vec::new(),
    }
}

/// The Maglev table entry `query`'s flow hashes to (`proxy_common::maglev`),
/// and the table's size: the backends' shares of it, summed.
fn maglev_entry(query: &Query, backends: &[LbBackend]) -> Option<(u32, u32)> {
    let size: u32 = backends.iter().map(|b| b.maglev_share).sum::<Option<u32>>()?;
    let proto = crate::backend::ebpf::entries::proto(query.proto);
    let (sport, dport) = (query.from.port(), query.to.port());
    let hash = match query.from.ip() {
        std::net::IpAddr::V4(ip) => maglev::flow_hash(&[ip.to_bits()], sport, dport, proto),
        std::net::IpAddr::V6(ip) => {
            let bits = ip.to_bits();
            let words = [96, 64, 32, 0].map(|shift| (bits >> shift) as u32);
            maglev::flow_hash(&words, sport, dport, proto)
        }
    };
    (size > 0).then(|| (maglev::entry(hash, size), size))
}

/// The note of a ClusterIP's explanation.
fn socket_lb_note(x: &mut Explanation) {
    if x.frontend.as_ref().is_some_and(|f| f.kind == "ClusterIP") {
        x.notes.push(
            "a pod or node process inside the socket-LB cgroup is translated at connect()/sendmsg() by the same lookup, before any packet: no SNAT".into(),
        );
    }
}

/// The explanation of an explain run of `query`'s packet, with the
/// service table `entries` of the same maps.
pub fn explain(query: &Query, run: &ExplainRun, entries: &[LbEntry]) -> Explanation {
    let name = proto_name(query.proto);
    let out = tuple(&run.packet);
    let dst = out.map(|(_, _, dst)| dst.to_string());
    let entry = entry_of(entries, &format!("{}/{name}", query.to), dst.as_deref());
    let mut x = start(query, entry);
    let translated = out.map(|(_, src, dst)| format!("{name} {src} -> {dst}"));
    match decode(run.cb[proxy_common::explain::CB_WORD]) {
        Some((Decided::Translated, flags)) => {
            x.outcome = "translated";
            x.picked = dst;
            x.via = Some(match flags {
                _ if flags & AFFINITY != 0 => "affinity",
                _ if flags & MAGLEV != 0 => "maglev",
                _ => "random",
            });
            if flags & MAGLEV != 0 {
                x.maglev_entry = maglev_entry(query, &x.backends);
            }
            x.translated = translated;
            if flags & DSR != 0 {
                x.notes.push(
                    "direct server return: the client's address is kept, the service travels to the backend's node in an IPv4 option (IPv6: a destination-options header), and the backend's replies leave that node as the service, straight to the client".into(),
                );
            }
            if flags & SNAT != 0 {
                x.snat = out.map(|(_, src, _)| src.ip().to_string());
                x.notes.push(
                    "the SNAT source port is chosen when a real flow is created: the one shown is the client's".into(),
                );
            }
            x.action = forwarded(run.verdict);
        }
        Some((Decided::Refused, _)) => {
            x.outcome = "refused";
            x.reason = Some(NO_ENDPOINT.into());
            let answer = match query.proto {
                Protocol::Tcp => "a TCP reset".into(),
                Protocol::Udp | Protocol::Sctp => port_unreachable(query),
            };
            x.action = format!("answered with {answer}, out of the interface it came in on");
        }
        Some((decided, _)) => {
            x.outcome = "dropped";
            x.reason = Some(
                match decided {
                    Decided::SourceOutsideRanges => {
                        "the source is outside loadBalancerSourceRanges"
                    }
                    _ => "traffic policy Local and no endpoint on this node",
                }
                .into(),
            );
            x.action = "discarded, nothing answers (TC_ACT_SHOT)".into();
        }
        None if run.verdict == NEXT => {
            x.reason = Some(match x.frontend.is_some() && query.replies_only {
                true => "this interface's program translates only replies of tracked flows (the socket LB translates its pods' connections)".into(),
                false => PASSED.into(),
            });
        }
        None => {
            x.outcome = "tracked";
            x.reason = Some("a tracked flow: rewritten as its conntrack entry says".into());
            x.translated = translated;
            x.action = forwarded(run.verdict);
        }
    }
    socket_lb_note(&mut x);
    x
}

/// Whether `to` is a localhost NodePort's address (127.0.0.0/8, IPv4 only
/// as kube-proxy), which the eBPF mode serves at the node's own sockets.
pub fn is_localhost(to: SocketAddr) -> bool {
    matches!(to, SocketAddr::V4(to) if to.ip().is_loopback())
}

/// The explanation of a connection from the node itself to a localhost
/// NodePort in the eBPF mode, from the service table `entries`: the socket
/// programs translate it at connect()/sendmsg(), which no test run can run,
/// by the lookup they make (any 127.0.0.0/8 address is 127.0.0.1; the node
/// is an in-cluster client, so a frontend's in-cluster twin serves it).
pub fn explain_localhost(query: &Query, entries: &[LbEntry]) -> Explanation {
    let addressed = format!("127.0.0.1:{}/{}", query.to.port(), proto_name(query.proto));
    let at: Vec<&LbEntry> = entries.iter().filter(|e| e.frontend == addressed).collect();
    let entry =
        at.iter().find(|e| e.flags.contains(&flag::IN_CLUSTER)).or_else(|| at.first()).copied();
    let mut x = start(query, entry);
    x.notes.push(
        "only the node's own sockets (its network namespace): a pod's 127.0.0.1 is its own loopback, and a packet to 127.0.0.0/8 arriving on an interface is martian, left to the stack that drops it".into(),
    );
    let Some(entry) = entry else {
        x.reason = Some(
            "no NodePort at this port (localhost NodePorts: --localhost-nodeports, on by default)"
                .into(),
        );
        x.action = "left to the node's loopback: whatever listens there answers".into();
        return x;
    };
    if entry.backends.is_empty() {
        x.outcome = "refused";
        x.reason = Some(NO_ENDPOINT.into());
        x.action = "connect() fails at once with ECONNREFUSED (sendmsg() likewise)".into();
        return x;
    }
    x.outcome = "translated";
    x.action = "connect()/sendmsg() goes to a backend picked at random per socket (per fresh flow for unconnected UDP), from the node's address the route to it gives: the backend never sees 127.0.0.1, and the socket sees the address it called".into();
    if entry.flags.contains(&flag::AFFINITY) {
        x.notes.push("sessionAffinity: the node (its network namespace) keeps to the backend it reached last while the entry lives".into());
    }
    x
}

/// The explanation of `query`'s packet in the iptables mode: kube-proxy's
/// rules (`save`, an `iptables-save` output) walked for it
/// ([`rule_walk`](super::rule_walk)) on a node with the addresses `local`.
pub fn explain_rules(query: &Query, save: &str, local: &[IpAddr]) -> Explanation {
    let tables = super::iptables::tables(save);
    let rules = |name: &str| tables.get(name).map_or(&[][..], Vec::as_slice);
    let p = Packet { proto: proto_name(query.proto), from: query.from, to: query.to, local };
    let walk = walk(rules("nat"), rules("filter"), &p);
    explain_walk(query, walk, &super::iptables::entries(save), &IPTABLES_WORDS)
}

/// `explain` in the nftables mode: `listed` (`nft list table` of our
/// tables) walked (`nftables::walk`) for `query`'s packet.
pub fn explain_nftables(query: &Query, listed: &str, local: &[IpAddr]) -> Explanation {
    let p = Packet { proto: proto_name(query.proto), from: query.from, to: query.to, local };
    let walk = super::nftables::walk(listed, &p);
    let family = if query.to.is_ipv4() { "ip" } else { "ip6" };
    explain_walk(query, walk, &super::nftables::entries_of(listed, family), &NFTABLES_WORDS)
}

/// How a rule-based mode's explanation names what its rules do.
struct RuleWords {
    dnat: &'static str,
    /// The rules that pick a backend at random.
    pick: &'static str,
    reject: &'static str,
    drop: &'static str,
    masquerade: &'static str,
    affinity: &'static str,
}

const IPTABLES_WORDS: RuleWords = RuleWords {
    dnat: "DNAT (nat PREROUTING), then routed by the node's stack",
    pick: "statistic",
    reject: "filter REJECT",
    drop: "filter DROP",
    masquerade: "MASQUERADE to the address of the interface it leaves by",
    affinity: "sessionAffinity: a client with a live entry in /proc/net/xt_recent/KUBE-SEP-* goes to its remembered backend",
};

const NFTABLES_WORDS: RuleWords = RuleWords {
    dnat: "dnat (chain nat-prerouting), then routed by the node's stack",
    pick: "numgen",
    reject: "reject-chain",
    drop: "drop",
    masquerade: "MASQUERADE to the address of the interface it leaves by (chain masquerading)",
    affinity: "sessionAffinity: a client in an endpoint's set affinity-* (nft list set) goes to that backend",
};

/// The explanation of a rule walk's result.
fn explain_walk(query: &Query, walk: Walk, entries: &[LbEntry], words: &RuleWords) -> Explanation {
    let entry = walk.frontend.as_deref().and_then(|f| entry_of(entries, f, None));
    let mut x = start(query, entry);
    let reason = |comment: &str| {
        if comment.contains("no local endpoints") {
            NO_LOCAL_ENDPOINT
        } else if comment.contains("not accepted by") {
            OUTSIDE_RANGES
        } else {
            NO_ENDPOINT
        }
    };
    match walk.walked {
        Walked::Translated { candidates, masquerade } => {
            x.outcome = "translated";
            x.action = words.dnat.into();
            let chances: Vec<String> = candidates
                .iter()
                .map(|(address, chance)| format!("{address} {:.0}%", chance * 100.0))
                .collect();
            x.notes.push(format!(
                "the backend is chosen per new connection by the {} rules: {}",
                words.pick,
                chances.join(", ")
            ));
            if walk.affinity {
                x.notes.push(words.affinity.into());
            }
            if masquerade {
                x.snat = Some(words.masquerade.into());
            }
            if x.backends.is_empty() {
                x.backends = candidates
                    .into_iter()
                    .map(|(address, _)| LbBackend { address, local: None, maglev_share: None })
                    .collect();
            }
        }
        Walked::Refused(comment) => {
            x.outcome = "refused";
            x.reason = Some(reason(&comment).into());
            // kube-proxy's REJECT has no --reject-with (nor its nftables
            // reject): TCP too gets the ICMP error.
            x.action = format!("answered with {} ({})", port_unreachable(query), words.reject);
        }
        Walked::Dropped(comment) => {
            x.outcome = "dropped";
            x.reason = Some(reason(&comment).into());
            x.action = format!("discarded, nothing answers ({})", words.drop);
        }
        Walked::Passed => x.reason = Some(PASSED.into()),
    }
    x.notes.push("a packet of a connection netfilter already tracks follows its conntrack entry, not these rules (see ct list)".into());
    x
}

/// The ICMP error of a closed port, of the query's family.
fn port_unreachable(query: &Query) -> String {
    let icmp = if query.to.is_ipv4() { "ICMP" } else { "ICMPv6" };
    format!("{icmp} port unreachable")
}

/// What the program does with a packet it translated.
fn forwarded(verdict: i32) -> String {
    match verdict {
        REDIRECT => "redirected to the next hop (FIB lookup)",
        STACK => "handed to the node's stack (a local address, or no route)",
        SHOT => "dropped (its TTL ran out, or it could not be rewritten)",
        _ => "passed on",
    }
    .into()
}

/// The explanation as lines of text.
pub fn text(x: &Explanation) -> String {
    let mut out = String::new();
    let mut line = |label: &str, value: &str| {
        let _ = writeln!(out, "{label:<12}{value}");
    };
    line("packet:", &x.packet);
    line("program:", &x.program);
    match &x.frontend {
        Some(f) => {
            let flags = if f.flags.is_empty() { String::new() } else { f.flags.join(",") };
            line(
                "frontend:",
                format!("{} {} {} {flags}", f.frontend, f.kind, f.service).trim_end(),
            );
        }
        None => line("frontend:", "none"),
    }
    if x.frontend.is_some() {
        let backends: Vec<String> = x.backends.iter().map(super::backend).collect();
        line("backends:", &if backends.is_empty() { "none".into() } else { backends.join(", ") });
    }
    if let Some(picked) = &x.picked {
        line("picked:", &format!("{picked} ({})", x.via.unwrap_or("?")));
        if let Some((entry, size)) = x.maglev_entry {
            line(
                "maglev:",
                &format!(
                    "entry {entry} of {size} (a hash of the client's address and port, the port and protocol)"
                ),
            );
        }
    }
    if let Some(translated) = &x.translated {
        line("translated:", translated);
    }
    if let Some(snat) = &x.snat {
        line("snat:", snat);
    }
    line("verdict:", &format!("{}: {}", x.outcome, x.action));
    if let Some(reason) = &x.reason {
        line("why:", reason);
    }
    for note in &x.notes {
        line("note:", note);
    }
    out
}

/// The interface `/proc/net/route` (`table`) routes `addr` through: the
/// longest prefix, then the lowest metric.
pub fn route_interface(table: &str, addr: Ipv4Addr) -> Option<String> {
    let hex = |s: &str| u32::from_str_radix(s, 16).ok().map(|v| Ipv4Addr::from(v.to_le_bytes()));
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (dest, metric, mask) =
                (hex(fields.get(1)?)?, fields.get(6)?.parse::<u32>().ok()?, hex(fields.get(7)?)?);
            let (m, d, a) = (u32::from(mask), u32::from(dest), u32::from(addr));
            (a & m == d).then(|| (std::cmp::Reverse(m.count_ones()), metric, fields[0]))
        })
        .min()
        .map(|(_, _, iface)| iface.to_string())
}

/// The interface `/proc/net/ipv6_route` (`table`) routes `addr` through:
/// the longest prefix, then the lowest metric; a reject route
/// (unreachable, prohibit) leads nowhere.
pub fn route_interface6(table: &str, addr: Ipv6Addr) -> Option<String> {
    const RTF_REJECT: u32 = 0x0200;
    let hex = |s: Option<&&str>| u32::from_str_radix(s?, 16).ok();
    table
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let dest = u128::from_str_radix(fields.first()?, 16).ok()?;
            let (len, metric) = (hex(fields.get(1))?.min(128), hex(fields.get(5))?);
            let (flags, iface) = (hex(fields.get(8))?, *fields.get(9)?);
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            let routed = flags & RTF_REJECT == 0 && u128::from(addr) & mask == dest & mask;
            routed.then_some((std::cmp::Reverse(len), metric, iface))
        })
        .min()
        .map(|(_, _, iface)| iface.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_crafted_packets_start_the_flow_asked_for() {
        let (from, to) = (addr("192.168.1.5:40000"), addr("10.96.0.10:80"));
        let syn = craft(Protocol::Tcp, from, to);
        assert_eq!(tuple(&syn), Some((packet_craft::TCP, from, to)));
        assert!(packet_craft::ipv4_checksum_ok(&syn) && packet_craft::l4_checksum_ok(&syn));
        let (from, to) = (addr("[fd00::5]:40000"), addr("[fd00:96::10]:53"));
        let datagram = craft(Protocol::Udp, from, to);
        assert_eq!(tuple(&datagram), Some((packet_craft::UDP, from, to)));
        assert!(packet_craft::l4_checksum_ok(&datagram), "{datagram:02x?}");
    }

    #[test]
    fn the_ipv6_route_to_the_client_names_the_interface() {
        let table = "\
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000001 00000000 00000003     eth0
fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth1
fd000000000000010000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth2
fd000000000000020000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";
        let route = |a: &str| route_interface6(table, a.parse().unwrap());
        assert_eq!(route("fd00::5").as_deref(), Some("eth1"));
        assert_eq!(route("fd00:0:0:1::5").as_deref(), Some("eth2"));
        assert_eq!(route("fd00:0:0:2::5").as_deref(), Some("eth0"), "a reject route is skipped");
        assert_eq!(route("2001:db8::1").as_deref(), Some("eth0"));
    }

    fn entry(frontend: &str, kind: &str, flags: Vec<&'static str>, backends: &[&str]) -> LbEntry {
        LbEntry {
            frontend: frontend.into(),
            kind: kind.into(),
            service: "demo/web:http".into(),
            flags,
            backends: backends
                .iter()
                .map(|a| LbBackend {
                    address: a.to_string(),
                    local: Some(false),
                    maglev_share: None,
                })
                .collect(),
        }
    }

    fn query(to: &str) -> Query {
        Query::new(Protocol::Tcp, addr("192.168.1.5:40000"), addr(to), "tc_ingress on eth0".into())
    }

    fn run(verdict: i32, word: u32, packet: Vec<u8>) -> ExplainRun {
        ExplainRun { verdict, packet, cb: [0, 0, word, 7, 3] }
    }

    #[test]
    fn a_localhost_node_port_is_the_socket_lb_s_lookup_at_127_0_0_1() {
        let entries = [
            entry("127.0.0.1:30080/tcp", "NodePort", vec![flag::LOCAL_POLICY], &[]),
            entry("127.0.0.1:30080/tcp", "NodePort", vec![flag::IN_CLUSTER], &["10.244.2.2:80"]),
            entry("127.0.0.1:30082/tcp", "NodePort", vec![], &[]),
        ];
        assert!(is_localhost(addr("127.0.0.5:30080")) && !is_localhost(addr("[::1]:30080")));
        // Any 127/8 address; the node is an in-cluster client: the twin.
        let x = explain_localhost(&query("127.0.0.5:30080"), &entries);
        assert_eq!((x.outcome, x.backends.len()), ("translated", 1), "{x:?}");
        assert_eq!(x.frontend.unwrap().flags, [flag::IN_CLUSTER]);
        let x = explain_localhost(&query("127.0.0.1:30082"), &entries);
        assert_eq!((x.outcome, x.reason.as_deref()), ("refused", Some(NO_ENDPOINT)));
        let x = explain_localhost(&query("127.0.0.1:30999"), &entries);
        assert!(x.outcome == "passed" && x.frontend.is_none(), "{x:?}");
    }

    #[test]
    fn a_translated_node_port_flow_names_its_backend_and_snat() {
        let entries = [
            entry(
                "192.168.1.10:30080/tcp",
                "NodePort",
                vec![],
                &["10.244.1.2:80", "10.244.2.2:80"],
            ),
            entry("10.96.0.10:80/tcp", "ClusterIP", vec![], &["10.244.1.2:80"]),
        ];
        let out = craft(Protocol::Tcp, addr("192.168.1.10:40000"), addr("10.244.2.2:80"));
        let word = proxy_common::explain::word(Decided::Translated, SNAT);
        let x = explain(&query("192.168.1.10:30080"), &run(REDIRECT, word, out), &entries);
        assert_eq!(x.outcome, "translated");
        assert_eq!(x.frontend.as_ref().unwrap().kind, "NodePort");
        assert_eq!(x.backends.len(), 2);
        assert_eq!(x.picked.as_deref(), Some("10.244.2.2:80"));
        assert_eq!(x.snat.as_deref(), Some("192.168.1.10"));
        assert_eq!((x.via, x.reason.as_deref()), (Some("random"), None));
        assert_eq!(x.translated.as_deref(), Some("tcp 192.168.1.10:40000 -> 10.244.2.2:80"));
        assert!(x.action.starts_with("redirected"));
        let text = text(&x);
        assert!(text.contains("picked:     10.244.2.2:80 (random)"), "{text}");
        assert!(text.contains("snat:       192.168.1.10"), "{text}");
    }

    #[test]
    fn the_in_cluster_scope_is_the_entry_holding_the_pick() {
        let entries = [
            entry(
                "192.168.1.10:30080/tcp",
                "NodePort",
                vec![flag::LOCAL_POLICY],
                &["10.244.1.2:80"],
            ),
            entry("192.168.1.10:30080/tcp", "NodePort", vec![flag::IN_CLUSTER], &["10.244.2.2:80"]),
        ];
        let out = craft(Protocol::Tcp, addr("10.244.1.9:40000"), addr("10.244.2.2:80"));
        let word = proxy_common::explain::word(Decided::Translated, 0);
        let x = explain(&query("192.168.1.10:30080"), &run(STACK, word, out), &entries);
        assert_eq!(x.frontend.unwrap().flags, [flag::IN_CLUSTER]);
        assert_eq!(x.snat, None);
        assert!(x.action.starts_with("handed to the node's stack"));
    }

    #[test]
    fn refusals_drops_passes_and_tracked_flows_say_why() {
        let entries = [entry("10.96.0.10:80/tcp", "ClusterIP", vec![], &[])];
        let q = query("10.96.0.10:80");
        let packet = craft(Protocol::Tcp, q.to, q.from);
        let refused = proxy_common::explain::word(Decided::Refused, 0);
        let x = explain(&q, &run(REDIRECT, refused, packet.clone()), &entries);
        assert_eq!((x.outcome, x.picked), ("refused", None));
        assert!(x.action.contains("TCP reset"));
        assert_eq!(x.notes.len(), 1, "the socket LB's note for a ClusterIP");
        let local = proxy_common::explain::word(Decided::NoLocalEndpoint, 0);
        let x = explain(&q, &run(SHOT, local, packet.clone()), &entries);
        assert_eq!(x.outcome, "dropped");
        assert!(x.reason.unwrap().contains("Local"));
        let x = explain(&query("10.96.0.99:80"), &run(NEXT, 0, packet.clone()), &entries);
        assert_eq!((x.outcome, x.frontend), ("passed", None));
        assert_eq!(x.reason.as_deref(), Some(PASSED));
        let q6 = Query { proto: Protocol::Udp, ..query("[fd00:96::10]:53") };
        let q6 = Query { from: addr("[fd00::5]:40000"), ..q6 };
        let x = explain(&q6, &run(REDIRECT, refused, packet.clone()), &entries);
        assert!(x.action.starts_with("answered with ICMPv6 port unreachable"), "{}", x.action);
        let x = explain(&q, &run(STACK, 0, packet), &entries);
        assert_eq!(x.outcome, "tracked");
        assert_eq!(x.translated.as_deref(), Some("tcp 10.96.0.10:80 -> 192.168.1.5:40000"));
    }

    #[test]
    fn the_iptables_rules_explain_in_the_same_words() {
        let save = r#"*filter
-A KUBE-SERVICES -m comment --comment "lab/empty:http has no endpoints" -m tcp -p tcp -d 10.96.0.12 --dport 80 -j REJECT
COMMIT
*nat
-A KUBE-SERVICES -m comment --comment "lab/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-W
-A KUBE-SVC-W -m comment --comment "lab/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-W -m comment --comment "lab/web:http -> 10.244.1.2:80" -m statistic --mode random --probability 0.5 -j KUBE-SEP-A
-A KUBE-SVC-W -m comment --comment "lab/web:http -> 10.244.2.2:80" -j KUBE-SEP-B
-A KUBE-SEP-A -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:80
-A KUBE-SEP-B -m tcp -p tcp -j DNAT --to-destination 10.244.2.2:80
COMMIT
"#;
        let local = ["192.168.1.10".parse().unwrap()];
        let x = explain_rules(&query("10.96.0.10:80"), save, &local);
        assert_eq!((x.outcome, x.picked.as_deref()), ("translated", None));
        assert_eq!(x.frontend.unwrap().service, "lab/web:http");
        assert_eq!(x.backends.len(), 2);
        assert!(x.snat.unwrap().starts_with("MASQUERADE"), "192.168.1.5 is outside the CIDR");
        assert!(x.notes[0].ends_with("10.244.1.2:80 50%, 10.244.2.2:80 50%"), "{:?}", x.notes);
        let x = explain_rules(&query("10.96.0.12:80"), save, &local);
        assert_eq!((x.outcome, x.reason.as_deref()), ("refused", Some(NO_ENDPOINT)));
        assert_eq!(x.action, "answered with ICMP port unreachable (filter REJECT)", "TCP too");
        let x = explain_rules(&query("10.96.0.99:80"), save, &local);
        assert_eq!((x.outcome, x.reason.as_deref()), ("passed", Some(PASSED)));
    }

    #[test]
    fn the_route_to_the_client_names_the_interface() {
        let table = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
            eth0\t00000000\t0101A8C0\t0003\t0\t0\t100\t00000000\n\
            eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t0000FFFF\n\
            eth2\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n";
        let route = |a: &str| route_interface(table, a.parse().unwrap());
        assert_eq!(route("192.168.1.5").as_deref(), Some("eth2"));
        assert_eq!(route("192.168.7.5").as_deref(), Some("eth1"));
        assert_eq!(route("8.8.8.8").as_deref(), Some("eth0"));
    }
}
