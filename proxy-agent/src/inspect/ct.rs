//! The flows of service traffic, as `proxy-agent ct list` prints them: in
//! the eBPF mode the per-packet conntrack entries (`CONNTRACK`, the forward
//! entry of each flow) and the sockets the socket LB connected
//! (`SOCK_REV_NAT`, `SOCK_REV_NAT6`); in the iptables mode the kernel's conntrack entries
//! whose original destination is a service frontend. Building the rows is
//! pure; the readers hand in entries or `conntrack -L` text.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use proxy_common::{
    CT_FLAG_CLOSED, CT_FLAG_ESTABLISHED, CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY, CtTuple, CtValue,
    FrontendInfo, SockRevNat, SockRevNat6, SockRevNatKey, SockRevNatKey6,
};
use serde::Serialize;

use super::{LbEntry, protocol};

/// One flow of service traffic.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct CtRow {
    /// `per-packet` (tc), `socket` (translated at connect/sendmsg) or
    /// `conntrack` (the kernel's, iptables mode).
    pub path: &'static str,
    pub proto: String,
    /// The client's `address:port`; a socket's cookie.
    pub client: String,
    /// The service address it was sent to.
    pub frontend: String,
    /// The backend it went to.
    pub backend: String,
    /// The source the backend sees, when it was rewritten (SNAT).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat: Option<String>,
    pub state: String,
    /// Seconds until the flow expires if idle.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_secs: Option<u64>,
    pub service: String,
}

fn addr(address: impl Into<IpAddr>, port: u16) -> String {
    SocketAddr::new(address.into(), port).to_string()
}

fn state(flags: u8) -> &'static str {
    if flags & CT_FLAG_CLOSED != 0 {
        "closed"
    } else if flags & CT_FLAG_ESTABLISHED != 0 {
        "established"
    } else if flags & CT_FLAG_SEEN_REPLY != 0 {
        "replied"
    } else {
        "new"
    }
}

fn service(infos: &BTreeMap<u32, FrontendInfo>, rev_nat_id: u32) -> String {
    infos.get(&rev_nat_id).map_or("?", FrontendInfo::name).to_string()
}

/// The per-packet flows of `CONNTRACK` or `CONNTRACK6` entries (their
/// forward entries) at `now_ns` (CLOCK_MONOTONIC).
pub fn flows<K, V>(
    entries: &[(K, V)],
    infos: &BTreeMap<u32, FrontendInfo>,
    now_ns: u64,
) -> Vec<CtRow>
where
    K: CtTuple<Addr: Into<IpAddr>>,
    V: CtValue<Key = K>,
{
    entries
        .iter()
        .filter(|(_, e)| e.flags() & CT_FLAG_REPLY == 0)
        .map(|(k, e)| {
            let to = e.rewritten(k.proto());
            CtRow {
                path: "per-packet",
                proto: protocol(k.proto()).into(),
                client: addr(k.saddr(), k.sport()),
                frontend: addr(k.daddr(), k.dport()),
                backend: addr(to.daddr(), to.dport()),
                snat: (to.saddr() != k.saddr() || to.sport() != k.sport())
                    .then(|| addr(to.saddr(), to.sport())),
                state: state(e.flags()).into(),
                expires_secs: Some(e.expires_ns().saturating_sub(now_ns) / 1_000_000_000),
                service: service(infos, e.rev_nat_id()),
            }
        })
        .collect()
}

/// The sockets the socket LB translated (`SOCK_REV_NAT`); `proto` is not
/// recorded there, the frontend's is.
/// A socket the socket LB translated (`SOCK_REV_NAT`, `SOCK_REV_NAT6`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TranslatedSocket {
    pub cookie: u64,
    pub backend: SocketAddr,
    pub service: SocketAddr,
    pub rev_nat_id: u32,
}

impl From<(SockRevNatKey, SockRevNat)> for TranslatedSocket {
    fn from((k, v): (SockRevNatKey, SockRevNat)) -> Self {
        TranslatedSocket {
            cookie: k.cookie,
            backend: SocketAddr::from((k.address, k.port)),
            service: SocketAddr::from((v.address, v.port)),
            rev_nat_id: v.rev_nat_id,
        }
    }
}

impl From<(SockRevNatKey6, SockRevNat6)> for TranslatedSocket {
    fn from((k, v): (SockRevNatKey6, SockRevNat6)) -> Self {
        TranslatedSocket {
            cookie: k.cookie,
            backend: SocketAddr::from((k.address, k.port)),
            service: SocketAddr::from((v.address, v.port)),
            rev_nat_id: v.rev_nat_id,
        }
    }
}

pub fn sockets(
    entries: &[TranslatedSocket],
    infos: &BTreeMap<u32, FrontendInfo>,
    lb: &[LbEntry],
) -> Vec<CtRow> {
    // Each frontend's protocol by its address, once: a node holds many
    // more sockets than frontends.
    let protocols: BTreeMap<&str, &str> =
        lb.iter().filter_map(|e| e.frontend.rsplit_once('/')).collect();
    entries
        .iter()
        .map(|s| {
            let frontend = s.service.to_string();
            let proto = protocols.get(frontend.as_str()).copied().unwrap_or("?");
            CtRow {
                path: "socket",
                proto: proto.into(),
                client: format!("cookie {}", s.cookie),
                frontend,
                backend: s.backend.to_string(),
                snat: None,
                state: "connected".into(),
                expires_secs: None,
                service: service(infos, s.rev_nat_id),
            }
        })
        .collect()
}

/// A `conntrack -L` line: its protocol, its state word (TCP), and its
/// `key=value` words (the first of each key is the original direction, the
/// second the reply).
type ConntrackLine = (String, Option<String>, Vec<(String, String)>);

fn conntrack_line(line: &str) -> Option<ConntrackLine> {
    let mut words = line.split_whitespace();
    let proto = words.next()?.to_string();
    let fields: Vec<(String, String)> = line
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let state = line
        .split_whitespace()
        .take_while(|w| !w.contains('='))
        .find(|w| w.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .map(str::to_lowercase);
    Some((proto, state, fields))
}

/// The service flows of a `conntrack -L` output: those whose original
/// destination is a frontend of `lb` (a NodePort's `*:port` at any
/// address), with the backend the reply comes from.
pub fn conntrack(text: &str, lb: &[LbEntry]) -> Vec<CtRow> {
    let mut rows = Vec::new();
    for line in text.lines() {
        let Some((proto, state, fields)) = conntrack_line(line) else { continue };
        let get = |key: &str, nth: usize| {
            fields.iter().filter(|(k, _)| k == key).nth(nth).map(|(_, v)| v.as_str())
        };
        let (Some(src), Some(dst), Some(sport), Some(dport)) =
            (get("src", 0), get("dst", 0), get("sport", 0), get("dport", 0))
        else {
            continue;
        };
        let (Some(rsrc), Some(rdst), Some(rsport), Some(rdport)) =
            (get("src", 1), get("dst", 1), get("sport", 1), get("dport", 1))
        else {
            continue;
        };
        let frontend = host_port(dst, dport);
        let exact = format!("{frontend}/{proto}");
        let any = format!("*:{dport}/{proto}");
        let Some(entry) = lb.iter().find(|e| e.frontend == exact || e.frontend == any) else {
            continue;
        };
        let seen_as = host_port(rdst, rdport);
        let client = host_port(src, sport);
        rows.push(CtRow {
            path: "conntrack",
            proto: proto.clone(),
            snat: (seen_as != client).then_some(seen_as),
            client,
            frontend,
            backend: host_port(rsrc, rsport),
            state: state.unwrap_or_else(|| "-".into()),
            expires_secs: line.split_whitespace().nth(2).and_then(|t| t.parse().ok()),
            service: entry.service.clone(),
        });
    }
    rows
}

/// `address:port` as `conntrack -L` gives them, an IPv6 address in brackets.
fn host_port(address: &str, port: &str) -> String {
    match address.contains(':') {
        true => format!("[{address}]:{port}"),
        false => format!("{address}:{port}"),
    }
}

/// Whether the row's backend is at `ip`.
pub fn is_to(row: &CtRow, ip: IpAddr) -> bool {
    row.backend.parse::<SocketAddr>().is_ok_and(|backend| backend.ip() == ip)
}

/// The table, one flow a line.
pub fn table(rows: &[CtRow]) -> String {
    let header =
        ["PATH", "PROTO", "CLIENT", "FRONTEND", "BACKEND", "SNAT", "STATE", "EXPIRES", "SERVICE"];
    let cells: Vec<[String; 9]> = rows
        .iter()
        .map(|r| {
            [
                r.path.to_string(),
                r.proto.clone(),
                r.client.clone(),
                r.frontend.clone(),
                r.backend.clone(),
                r.snat.clone().unwrap_or_else(|| "-".into()),
                r.state.clone(),
                r.expires_secs.map_or("-".into(), |s| format!("{s}s")),
                r.service.clone(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        let padded: Vec<String> =
            cells.iter().zip(widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", padded.join("  ").trim_end());
    };
    line(&mut out, &header);
    for row in &cells {
        line(&mut out, &row.each_ref().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use proxy_common::{CT_FLAG_SNAT, CtEntryV1, CtKey, IPPROTO_TCP, KIND_NODE_PORT};

    use super::*;
    use crate::inspect::LbBackend;

    #[test]
    fn a_per_packet_flow_is_its_forward_entry_with_its_service() {
        let orig = CtKey {
            saddr: [192, 168, 100, 101],
            daddr: [192, 168, 100, 11],
            sport: 40000,
            dport: 30080,
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        };
        let to = CtKey {
            saddr: [192, 168, 100, 11],
            daddr: [10, 244, 1, 2],
            sport: 61000,
            dport: 8080,
            ..orig
        };
        let flags = CT_FLAG_SNAT | CT_FLAG_SEEN_REPLY | CT_FLAG_ESTABLISHED;
        let forward = CtEntryV1::new(70_000_000_000, &to, 3, flags);
        let reply = CtEntryV1::new(70_000_000_000, &orig.reversed(), 3, flags | CT_FLAG_REPLY);
        let infos = BTreeMap::from([(3, FrontendInfo::new(KIND_NODE_PORT, "demo/web:http"))]);
        let rows = flows(&[(orig, forward), (to.reversed(), reply)], &infos, 10_000_000_000);
        assert_eq!(rows.len(), 1, "one flow, two entries");
        let r = &rows[0];
        assert_eq!(
            (r.client.as_str(), r.frontend.as_str()),
            ("192.168.100.101:40000", "192.168.100.11:30080")
        );
        assert_eq!(
            (r.backend.as_str(), r.snat.as_deref()),
            ("10.244.1.2:8080", Some("192.168.100.11:61000"))
        );
        assert_eq!((r.state.as_str(), r.expires_secs), ("established", Some(60)));
        assert_eq!(r.service, "demo/web:http");
    }

    #[test]
    fn an_ipv6_flow_shows_bracketed_addresses() {
        use proxy_common::{CtEntry6V1, CtKey6};
        let ip = |last: u8| [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last];
        let orig = CtKey6::new(ip(1), ip(2), 40000, 80, IPPROTO_TCP);
        let to = CtKey6::new(ip(1), ip(3), 40000, 8080, IPPROTO_TCP);
        let forward = CtEntry6V1::new(70_000_000_000, &to, 3, 0);
        let rows = flows(&[(orig, forward)], &BTreeMap::new(), 10_000_000_000);
        let r = &rows[0];
        assert_eq!((r.client.as_str(), r.frontend.as_str()), ("[fd00::1]:40000", "[fd00::2]:80"));
        assert_eq!((r.backend.as_str(), r.snat.as_deref()), ("[fd00::3]:8080", None));
    }

    #[test]
    fn conntrack_lines_of_service_frontends_are_rows() {
        let lb = [LbEntry {
            frontend: "*:30053/udp".into(),
            kind: "NodePort".into(),
            service: "demo/web:echo".into(),
            flags: vec![],
            backends: vec![LbBackend {
                address: "10.244.1.2:5353".into(),
                local: None,
                maglev_share: None,
            }],
        }];
        let text = "udp      17 28 src=192.168.100.101 dst=192.168.100.11 sport=41000 dport=30053 src=10.244.1.2 dst=192.168.100.11 sport=5353 dport=41000 mark=0 use=1\n\
                    tcp      6 431999 ESTABLISHED src=10.0.0.1 dst=10.0.0.2 sport=1 dport=22 src=10.0.0.2 dst=10.0.0.1 sport=22 dport=1 [ASSURED] mark=0 use=1\n";
        let rows = conntrack(text, &lb);
        assert_eq!(rows.len(), 1, "only the service's flow: {rows:?}");
        let r = &rows[0];
        assert_eq!(
            (r.backend.as_str(), r.snat.as_deref()),
            ("10.244.1.2:5353", Some("192.168.100.11:41000"))
        );
        assert_eq!(
            (r.expires_secs, r.state.as_str(), r.service.as_str()),
            (Some(28), "-", "demo/web:echo")
        );
        assert!(is_to(r, [10, 244, 1, 2].into()) && !is_to(r, [10, 244, 1, 20].into()));
        let table = table(&rows);
        let cells: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            cells[..4],
            ["conntrack", "udp", "192.168.100.101:41000", "192.168.100.11:30053"]
        );
    }

    #[test]
    fn sctp_associations_are_rows_with_their_state() {
        let lb = [LbEntry {
            frontend: "10.96.0.10:3868/sctp".into(),
            kind: "ClusterIP".into(),
            service: "demo/web:diameter".into(),
            flags: vec![],
            backends: vec![],
        }];
        let text = "sctp     132 431999 ESTABLISHED src=10.244.1.100 dst=10.96.0.10 sport=40006 dport=3868 src=10.244.1.2 dst=10.244.1.100 sport=3869 dport=40006 [ASSURED] mark=0 use=1\n";
        let rows = conntrack(text, &lb);
        assert_eq!(rows.len(), 1, "{rows:?}");
        let r = &rows[0];
        assert_eq!((r.proto.as_str(), r.state.as_str()), ("sctp", "established"));
        assert_eq!((r.backend.as_str(), r.expires_secs), ("10.244.1.2:3869", Some(431999)));
        assert_eq!(protocol(proxy_common::IPPROTO_SCTP), "sctp");
    }
}
