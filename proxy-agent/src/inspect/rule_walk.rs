//! `explain` in the iptables mode: kube-proxy's rules, read back with
//! `iptables-save`, walked for the first packet of a connection as
//! netfilter does: `nat KUBE-SERVICES` and the chains it jumps to
//! (`KUBE-NODEPORTS`, `KUBE-FW`, `KUBE-EXT`, `KUBE-SVC`/`KUBE-SVL`,
//! `KUBE-SEP`), then, without a DNAT, the filter chains that refuse or drop
//! service traffic. Matches are read by option: addresses (`-s`, `-d`,
//! negated or not), protocol, `--dport`, `addrtype` LOCAL; a rule's other
//! matches (marks, comments, conntrack state) are taken as matching. Pure.

use std::net::{IpAddr, SocketAddr};

use super::iptables::Rule;

/// The first packet of a connection.
pub struct Packet<'a> {
    /// `tcp` or `udp`, as the rules name it.
    pub proto: &'a str,
    /// Of one family, the rules' (`iptables-save` or `ip6tables-save`).
    pub from: SocketAddr,
    pub to: SocketAddr,
    /// The node's addresses (`addrtype LOCAL`).
    pub local: &'a [IpAddr],
}

/// Where the walk ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Walked {
    /// DNAT to one of the candidates (`address:port`, with the chance the
    /// statistic rules give each).
    Translated { candidates: Vec<(String, f64)>, masquerade: bool },
    /// `REJECT`: the comment of the rule.
    Refused(String),
    /// `DROP` (filter) or `KUBE-MARK-DROP` (nat): the rule's comment.
    Dropped(String),
    /// No rule of a service took it.
    Passed,
}

/// The walk's end, the frontend rule that matched (`address:port/proto`,
/// `*:port/proto` for a NodePort), and whether the service has session
/// affinity (`-m recent --rcheck`: the remembered backend, if the client
/// has a live entry, wins over the statistic rules).
#[derive(Clone, Debug, PartialEq)]
pub struct Walk {
    pub walked: Walked,
    pub frontend: Option<String>,
    pub affinity: bool,
}

/// Walks `nat` and `filter` (the rules of `iptables-save`) for `p`.
pub(super) fn walk(nat: &[Rule], filter: &[Rule], p: &Packet) -> Walk {
    let mut w = Walker { nat, p, masquerade: false, affinity: false, frontend: None };
    if let Some(walked) = w.chain("KUBE-SERVICES", 0) {
        return Walk { walked, frontend: w.frontend, affinity: w.affinity };
    }
    // No DNAT: the destination is still the frontend the filter rules name.
    let chains = ["KUBE-PROXY-FIREWALL", "KUBE-EXTERNAL-SERVICES", "KUBE-SERVICES"];
    let refusal = chains.iter().find_map(|chain| {
        filter.iter().filter(|r| r.chain == *chain && matches(r, p)).find_map(|r| {
            let comment = r.opt("--comment").unwrap_or_default().to_string();
            match r.jump()? {
                "REJECT" => Some((Walked::Refused(comment), r.frontend())),
                "DROP" => Some((Walked::Dropped(comment), r.frontend())),
                _ => None,
            }
        })
    });
    match refusal {
        Some((walked, frontend)) => {
            Walk { walked, frontend: w.frontend.or(frontend), affinity: w.affinity }
        }
        None => Walk { walked: Walked::Passed, frontend: w.frontend, affinity: w.affinity },
    }
}

struct Walker<'a> {
    nat: &'a [Rule],
    p: &'a Packet<'a>,
    masquerade: bool,
    affinity: bool,
    frontend: Option<String>,
}

/// Deeper than kube-proxy's chains ever nest: a loop in foreign rules.
const MAX_DEPTH: u8 = 8;

impl Walker<'_> {
    /// The end of the walk through `chain`, or `None` when the packet falls
    /// off its end (back to the caller's next rule) or `RETURN`s.
    fn chain(&mut self, chain: &str, depth: u8) -> Option<Walked> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut candidates = Vec::new();
        let mut left = 1.0;
        let nat = self.nat;
        for rule in nat.iter().filter(|r| r.chain == chain && matches(r, self.p)) {
            if rule.has("--rcheck") {
                self.affinity = true;
                continue;
            }
            let Some(target) = rule.jump() else { continue };
            if self.frontend.is_none() && matches!(chain, "KUBE-SERVICES" | "KUBE-NODEPORTS") {
                self.frontend = rule.frontend();
            }
            if target.starts_with("KUBE-SEP-") {
                let chance: f64 =
                    rule.opt("--probability").and_then(|p| p.parse().ok()).unwrap_or(1.0);
                if let Some(address) = self.endpoint(target) {
                    candidates.push((address, left * chance));
                }
                left *= 1.0 - chance;
                if left <= 0.0 {
                    let masquerade = self.masquerade;
                    return Some(Walked::Translated { candidates, masquerade });
                }
                continue;
            }
            let comment = || rule.opt("--comment").unwrap_or_default().to_string();
            match target {
                "KUBE-MARK-MASQ" => self.masquerade = true,
                "KUBE-MARK-DROP" | "DROP" => return Some(Walked::Dropped(comment())),
                "REJECT" => return Some(Walked::Refused(comment())),
                "RETURN" => return None,
                next if next.starts_with("KUBE-") => {
                    if let Some(end) = self.chain(next, depth + 1) {
                        return Some(end);
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// A `KUBE-SEP` chain's DNAT address; its hairpin rule (`-s` the
    /// endpoint `-j KUBE-MARK-MASQ`) masquerades a client that is the
    /// endpoint itself.
    fn endpoint(&mut self, sep: &str) -> Option<String> {
        let rules = self.nat.iter().filter(|r| r.chain == sep);
        let mut address = None;
        for rule in rules {
            match rule.jump() {
                Some("KUBE-MARK-MASQ") if matches(rule, self.p) => self.masquerade = true,
                Some("DNAT") => address = rule.opt("--to-destination").map(str::to_string),
                _ => {}
            }
        }
        address
    }
}

/// Whether `addr` is in `cidr` (an address, or `address/len`, IPv4 or
/// IPv6; never across families).
fn in_cidr(addr: IpAddr, cidr: &str) -> bool {
    let (net, len) = cidr.split_once('/').unwrap_or((cidr, "128"));
    let (Ok(net), Ok(len)) = (net.parse::<IpAddr>(), len.parse::<u32>()) else { return false };
    match (addr, net) {
        (IpAddr::V4(addr), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - len.min(32)).unwrap_or(0);
            u32::from(addr) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(addr), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - len.min(128)).unwrap_or(0);
            u128::from(addr) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// Whether the packet meets the rule's address, protocol, port and
/// addrtype matches (each may be negated by a `!` before it).
fn matches(rule: &Rule, p: &Packet) -> bool {
    let w = &rule.words;
    let mut negate = false;
    let mut i = 0;
    while i < w.len() {
        let arg = w.get(i + 1).map(String::as_str).unwrap_or_default();
        // Loopback is local whatever addresses `lo` lists: 127.0.0.1/8
        // makes the whole /8 so.
        let local = |a: IpAddr| arg != "LOCAL" || a.is_loopback() || p.local.contains(&a);
        let test = match w[i].as_str() {
            "!" => {
                negate = true;
                i += 1;
                continue;
            }
            "-s" => Some(in_cidr(p.from.ip(), arg)),
            "-d" => Some(in_cidr(p.to.ip(), arg)),
            "-p" => Some(arg == p.proto),
            "--dport" => Some(arg.parse::<u16>().ok() == Some(p.to.port())),
            "--dst-type" => Some(local(p.to.ip())),
            "--src-type" => Some(local(p.from.ip())),
            _ => None,
        };
        match test {
            Some(ok) if ok == negate => return false,
            Some(_) => i += 2,
            None => i += 1,
        }
        negate = false;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspect::iptables::tables;

    /// The rules of a NodePort service over three endpoints with
    /// masquerade of sources outside the cluster CIDR, a LoadBalancer IP with
    /// source ranges, a Local NodePort without a local endpoint and a
    /// service without endpoints, as the renderer writes them.
    const SAVED: &str = r#"*filter
-A KUBE-PROXY-FIREWALL -m comment --comment "lab/lb:http traffic not accepted by KUBE-FW-L" -m tcp -p tcp -d 10.200.0.10 --dport 80 -j DROP
-A KUBE-EXTERNAL-SERVICES -m comment --comment "lab/far:http has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30081 -j DROP
-A KUBE-SERVICES -m comment --comment "lab/empty:http has no endpoints" -m tcp -p tcp -d 10.96.0.12 --dport 80 -j REJECT
COMMIT
*nat
-A KUBE-SERVICES -m comment --comment "lab/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-W
-A KUBE-SERVICES -m comment --comment "lab/lb:http loadbalancer IP" -m tcp -p tcp -d 10.200.0.10 --dport 80 -j KUBE-FW-L
-A KUBE-NODEPORTS -m comment --comment lab/web:http -m tcp -p tcp --dport 30080 -j KUBE-EXT-W
-A KUBE-SVC-W -m comment --comment "lab/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-EXT-W -m comment --comment "masquerade traffic for lab/web:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-W -j KUBE-SVC-W
-A KUBE-SVC-W -m comment --comment "lab/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-A
-A KUBE-SVC-W -m comment --comment "lab/web:http -> 10.244.1.3:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-B
-A KUBE-SVC-W -m comment --comment "lab/web:http -> 10.244.1.4:8080" -j KUBE-SEP-C
-A KUBE-SEP-A -m comment --comment lab/web:http -s 10.244.1.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-A -m comment --comment lab/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-B -m comment --comment lab/web:http -s 10.244.1.3 -j KUBE-MARK-MASQ
-A KUBE-SEP-B -m comment --comment lab/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.3:8080
-A KUBE-SEP-C -m comment --comment lab/web:http -s 10.244.1.4 -j KUBE-MARK-MASQ
-A KUBE-SEP-C -m comment --comment lab/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.4:8080
-A KUBE-FW-L -m comment --comment "lab/lb:http loadbalancer IP" -s 192.168.100.101/32 -j KUBE-EXT-W
-A KUBE-FW-L -m comment --comment "other traffic to lab/lb:http will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#;

    fn walk_to(from: &str, to: &str) -> Walk {
        let tables = tables(SAVED);
        let local = ["192.168.100.11".parse().unwrap()];
        let p = Packet {
            proto: "tcp",
            from: format!("{from}:40000").parse().unwrap(),
            to: to.parse().unwrap(),
            local: &local,
        };
        walk(&tables["nat"], &tables["filter"], &p)
    }

    fn candidates(w: &Walk) -> (Vec<(&str, u32)>, bool) {
        match &w.walked {
            Walked::Translated { candidates, masquerade } => (
                candidates.iter().map(|(a, p)| (a.as_str(), (p * 100.0).round() as u32)).collect(),
                *masquerade,
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_node_port_is_masqueraded_to_every_endpoint_with_even_chances() {
        let w = walk_to("192.168.100.101", "192.168.100.11:30080");
        assert_eq!(w.frontend.as_deref(), Some("*:30080/tcp"));
        let three = vec![("10.244.1.2:8080", 33), ("10.244.1.3:8080", 33), ("10.244.1.4:8080", 33)];
        assert_eq!(candidates(&w), (three, true));
        // Not a node address: no NodePort.
        assert_eq!(walk_to("192.168.100.101", "192.168.100.99:30080").walked, Walked::Passed);
    }

    #[test]
    fn cluster_ip_masquerade_follows_the_cluster_cidr_and_hairpin() {
        let from_pod = walk_to("10.244.1.100", "10.96.0.10:80");
        assert_eq!(from_pod.frontend.as_deref(), Some("10.96.0.10:80/tcp"));
        assert!(!candidates(&from_pod).1);
        assert!(candidates(&walk_to("192.168.100.101", "10.96.0.10:80")).1);
        assert!(candidates(&walk_to("10.244.1.3", "10.96.0.10:80")).1, "hairpin");
    }

    #[test]
    fn source_ranges_local_policy_and_no_endpoints() {
        let inside = walk_to("192.168.100.101", "10.200.0.10:80");
        assert_eq!(inside.frontend.as_deref(), Some("10.200.0.10:80/tcp"));
        assert_eq!(candidates(&inside).0.len(), 3);
        let outside = walk_to("192.168.100.102", "10.200.0.10:80");
        assert!(matches!(&outside.walked, Walked::Dropped(c) if c.contains("not accepted")));
        let far = walk_to("192.168.100.101", "192.168.100.11:30081");
        assert!(matches!(&far.walked, Walked::Dropped(c) if c.contains("no local endpoints")));
        assert_eq!(far.frontend.as_deref(), Some("*:30081/tcp"));
        let empty = walk_to("192.168.100.101", "10.96.0.12:80");
        assert!(matches!(&empty.walked, Walked::Refused(c) if c.contains("no endpoints")));
    }

    #[test]
    fn cidrs() {
        let a: IpAddr = "10.244.1.2".parse().unwrap();
        assert!(in_cidr(a, "10.244.0.0/16") && in_cidr(a, "10.244.1.2") && in_cidr(a, "0.0.0.0/0"));
        assert!(!in_cidr(a, "10.244.2.0/24") && !in_cidr(a, "nonsense"));
        assert!(!in_cidr(a, "::/0"), "never across families");
        let b: IpAddr = "fd00:244:1::2".parse().unwrap();
        assert!(
            in_cidr(b, "fd00:244::/32") && in_cidr(b, "fd00:244:1::2/128") && in_cidr(b, "::/0")
        );
        assert!(!in_cidr(b, "fd00:245::/32") && !in_cidr(b, "::1/128") && !in_cidr(b, "0.0.0.0/0"));
    }
}
