//! The service table from the rules `iptables-save` prints: kube-proxy's
//! chains and comments carry the service names, so the table is read back
//! from what the kernel holds, not from what the agent meant to write.
//!
//! Frontends are the jumps of `nat KUBE-SERVICES` (ClusterIP, externalIP,
//! load-balancer IP, by their comment) and `nat KUBE-NODEPORTS`, and the
//! `REJECT`/`DROP` rules of `filter KUBE-SERVICES` and
//! `KUBE-EXTERNAL-SERVICES` (no endpoints, no local endpoints). A frontend's
//! chain is followed `KUBE-FW` → `KUBE-EXT` → `KUBE-SVC`/`KUBE-SVL` →
//! `KUBE-SEP`, whose `DNAT` names the backend. Options are read by name, so
//! the order `iptables-save` prints them in does not matter.

use std::collections::BTreeMap;

use super::{LbBackend, LbEntry, flag};

/// One `-A CHAIN …` rule: its chain and its words.
#[derive(Debug)]
pub(super) struct Rule {
    pub(super) chain: String,
    pub(super) words: Vec<String>,
}

impl Rule {
    /// The word after `option`.
    pub(super) fn opt(&self, option: &str) -> Option<&str> {
        let at = self.words.iter().position(|w| w == option)?;
        self.words.get(at + 1).map(String::as_str)
    }

    pub(super) fn has(&self, word: &str) -> bool {
        self.words.iter().any(|w| w == word)
    }

    pub(super) fn jump(&self) -> Option<&str> {
        self.opt("-j")
    }

    fn comment(&self) -> &str {
        self.opt("--comment").unwrap_or("")
    }

    /// `-d`, without the `/32` (`/128`) `iptables-save` (`ip6tables-save`)
    /// adds.
    fn destination(&self) -> Option<&str> {
        self.opt("-d")
            .map(|d| d.strip_suffix("/32").or_else(|| d.strip_suffix("/128")).unwrap_or(d))
    }

    /// `address:port/protocol` of a frontend rule (`*` without `-d`), an
    /// IPv6 address in brackets.
    pub(super) fn frontend(&self) -> Option<String> {
        let port = self.opt("--dport")?;
        let proto = self.opt("-p")?;
        Some(match self.destination() {
            Some(ipv6) if ipv6.contains(':') => format!("[{ipv6}]:{port}/{proto}"),
            address => format!("{}:{port}/{proto}", address.unwrap_or("*")),
        })
    }
}

/// Splits a rule into words, `"…"` quoting as iptables-save writes it.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_whitespace() {
            continue;
        }
        let mut word = String::new();
        if c == '"' {
            while let Some(c) = chars.next() {
                match c {
                    '\\' => word.extend(chars.next()),
                    '"' => break,
                    c => word.push(c),
                }
            }
        } else {
            word.push(c);
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                word.push(c);
            }
        }
        words.push(word);
    }
    words
}

/// The rules of each table (`nat`, `filter`) of an `iptables-save` output.
pub(super) fn tables(save: &str) -> BTreeMap<String, Vec<Rule>> {
    let mut tables: BTreeMap<String, Vec<Rule>> = BTreeMap::new();
    let mut table = String::new();
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.trim().to_string();
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let mut words = words(rule);
            if words.is_empty() {
                continue;
            }
            let chain = words.remove(0);
            tables.entry(table.clone()).or_default().push(Rule { chain, words });
        }
    }
    tables
}

/// The service a comment names: its first word (`ns/name:port` or
/// `ns/name`).
fn service_of(comment: &str) -> &str {
    comment.split_whitespace().next().unwrap_or("?")
}

/// A frontend's chain walked down to its backends.
struct Walk<'a> {
    nat: &'a [Rule],
    flags: Vec<&'static str>,
    backends: Vec<LbBackend>,
}

impl<'a> Walk<'a> {
    fn rules<'c>(&self, chain: &'c str) -> impl Iterator<Item = &'a Rule> + use<'a, 'c> {
        self.nat.iter().filter(move |r| r.chain == chain)
    }

    fn add(&mut self, f: &'static str) {
        if !self.flags.contains(&f) {
            self.flags.push(f);
        }
    }

    fn follow(&mut self, chain: &str) {
        if chain.starts_with("KUBE-FW-") {
            self.add(flag::SOURCE_RANGES);
            let next =
                self.rules(chain).find_map(|r| r.jump().filter(|j| j.starts_with("KUBE-EXT-")));
            if let Some(next) = next.map(str::to_string) {
                self.follow(&next);
            }
        } else if chain.starts_with("KUBE-EXT-") {
            // Its last jump, taken by every source: KUBE-SVL with the Local
            // policy (node-local sources go to KUBE-SVC before it).
            let last = self.rules(chain).filter(|r| !r.has("--src-type")).filter_map(Rule::jump);
            if let Some(next) = last.filter(|j| j.starts_with("KUBE-S")).last().map(str::to_string)
            {
                self.follow(&next);
            }
        } else if chain.starts_with("KUBE-SVC-") || chain.starts_with("KUBE-SVL-") {
            let local = chain.starts_with("KUBE-SVL-");
            if local {
                self.add(flag::LOCAL_POLICY);
            }
            let mut endpoints: Vec<String> = Vec::new();
            for rule in self.rules(chain) {
                if rule.has("--rcheck") {
                    self.add(flag::AFFINITY);
                }
                if let Some(sep) = rule.jump().filter(|j| j.starts_with("KUBE-SEP-"))
                    && !endpoints.iter().any(|e| e == sep)
                {
                    endpoints.push(sep.to_string());
                }
            }
            for sep in endpoints {
                let dnat = self.rules(&sep).find_map(|r| r.opt("--to-destination"));
                if let Some(address) = dnat.map(str::to_string) {
                    self.backends.push(LbBackend {
                        address,
                        local: local.then_some(true),
                        maglev_share: None,
                    });
                }
            }
        }
    }
}

/// The table these rules (an `iptables-save` output) program.
pub fn entries(save: &str) -> Vec<LbEntry> {
    let tables = tables(save);
    let nat = tables.get("nat").map_or(&[][..], Vec::as_slice);
    let filter = tables.get("filter").map_or(&[][..], Vec::as_slice);
    let mut out = Vec::new();
    let jumps = nat.iter().filter(|r| r.chain == "KUBE-SERVICES" || r.chain == "KUBE-NODEPORTS");
    for rule in jumps {
        let (Some(frontend), Some(target)) = (rule.frontend(), rule.jump()) else { continue };
        let comment = rule.comment();
        let kind = if rule.chain == "KUBE-NODEPORTS" {
            "NodePort"
        } else if comment.ends_with(" cluster IP") {
            "ClusterIP"
        } else if comment.ends_with(" external IP") {
            "ExternalIP"
        } else if comment.ends_with(" loadbalancer IP") {
            "LoadBalancer"
        } else {
            continue;
        };
        let mut walk = Walk { nat, flags: Vec::new(), backends: Vec::new() };
        walk.follow(target);
        out.push(LbEntry {
            frontend,
            kind: kind.into(),
            service: service_of(comment).into(),
            flags: walk.flags,
            backends: walk.backends,
        });
    }
    // Frontends without (local) endpoints: filter rules only.
    let refusals = filter.iter().filter(|r| {
        matches!(r.chain.as_str(), "KUBE-SERVICES" | "KUBE-EXTERNAL-SERVICES")
            && matches!(r.jump(), Some("REJECT" | "DROP"))
    });
    for rule in refusals {
        let Some(frontend) = rule.frontend() else { continue };
        let comment = rule.comment();
        let kind = match (rule.chain.as_str(), rule.has("--dst-type")) {
            ("KUBE-SERVICES", _) => "ClusterIP",
            (_, true) => "NodePort",
            _ => "External",
        };
        let flags = match comment.ends_with("has no local endpoints") {
            true => vec![flag::LOCAL_POLICY, flag::DROP_WHEN_EMPTY],
            false => vec![],
        };
        out.push(LbEntry {
            frontend,
            kind: kind.into(),
            service: service_of(comment).into(),
            flags,
            backends: vec![],
        });
    }
    out
}

/// A service's REJECT (no endpoints) or DROP (no local endpoints) rule of
/// `filter`, and the packets it matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub service: String,
    /// `address:port/protocol` (`*:port/protocol` for a NodePort).
    pub frontend: String,
    /// DROP (no local endpoints), else REJECT.
    pub dropped: bool,
    pub packets: u64,
}

/// The refusing rules of an `iptables-save -c` output (counters first:
/// `[packets:bytes] -A …`).
pub fn refusals(save: &str) -> Vec<Refusal> {
    let mut table = "";
    let mut out = Vec::new();
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.trim();
            continue;
        }
        let Some((counters, rule)) = line.strip_prefix('[').and_then(|l| l.split_once("] -A "))
        else {
            continue;
        };
        let mut words = words(rule);
        if table != "filter" || words.is_empty() {
            continue;
        }
        let rule = Rule { chain: words.remove(0), words };
        let dropped = match (rule.jump(), rule.comment()) {
            (Some("REJECT"), c) if c.ends_with(" has no endpoints") => false,
            (Some("DROP"), c) if c.ends_with(" has no local endpoints") => true,
            _ => continue,
        };
        let packets = counters.split_once(':').and_then(|(p, _)| p.parse().ok());
        let (Some(frontend), Some(packets)) = (rule.frontend(), packets) else { continue };
        let service = service_of(rule.comment()).to_string();
        out.push(Refusal { service, frontend, dropped, packets });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `iptables-save` prints back for a LoadBalancer service with an
    /// externalIP, source ranges, affinity and the Local policy (options
    /// reordered as iptables-save does), and a service without endpoints.
    const SAVED: &str = r#"# Generated by iptables-save v1.8.9
*filter
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -d 10.96.0.11/32 -p udp -m comment --comment "demo/empty:dns has no endpoints" -m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable
-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "demo/local:http has no local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30081 -j DROP
COMMIT
*nat
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "demo/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-X
-A KUBE-SERVICES -d 10.200.0.5/32 -p tcp -m comment --comment "demo/web:http external IP" -m tcp --dport 80 -j KUBE-EXT-X
-A KUBE-SERVICES -d 172.18.0.50/32 -p tcp -m comment --comment "demo/web:http loadbalancer IP" -m tcp --dport 80 -j KUBE-FW-X
-A KUBE-NODEPORTS -p tcp -m comment --comment demo/web:http -m tcp --dport 30080 -j KUBE-EXT-X
-A KUBE-EXT-X -m comment --comment "masquerade LOCAL traffic for demo/web:http external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-X -m comment --comment "route LOCAL traffic for demo/web:http external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-X
-A KUBE-EXT-X -j KUBE-SVL-X
-A KUBE-FW-X -s 192.168.0.0/16 -m comment --comment "demo/web:http loadbalancer IP" -j KUBE-EXT-X
-A KUBE-FW-X -m comment --comment "other traffic to demo/web:http will be dropped by KUBE-PROXY-FIREWALL"
-A KUBE-SVC-X -m comment --comment "demo/web:http -> 10.244.1.2:8080" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-A --mask 255.255.255.255 --rsource -j KUBE-SEP-A
-A KUBE-SVC-X -m comment --comment "demo/web:http -> 10.244.2.3:8080" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-B --mask 255.255.255.255 --rsource -j KUBE-SEP-B
-A KUBE-SVC-X -m comment --comment "demo/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-A
-A KUBE-SVC-X -m comment --comment "demo/web:http -> 10.244.2.3:8080" -j KUBE-SEP-B
-A KUBE-SVL-X -m comment --comment "demo/web:http -> 10.244.1.2:8080" -j KUBE-SEP-A
-A KUBE-SEP-A -s 10.244.1.2/32 -m comment --comment demo/web:http -j KUBE-MARK-MASQ
-A KUBE-SEP-A -p tcp -m comment --comment demo/web:http -m recent --set --name KUBE-SEP-A --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-B -s 10.244.2.3/32 -m comment --comment demo/web:http -j KUBE-MARK-MASQ
-A KUBE-SEP-B -p tcp -m comment --comment demo/web:http -m tcp -j DNAT --to-destination 10.244.2.3:8080
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#;

    fn find<'a>(entries: &'a [LbEntry], frontend: &str) -> &'a LbEntry {
        entries
            .iter()
            .find(|e| e.frontend == frontend)
            .unwrap_or_else(|| panic!("{frontend}: {entries:?}"))
    }

    fn addresses(e: &LbEntry) -> Vec<(&str, Option<bool>)> {
        e.backends.iter().map(|b| (b.address.as_str(), b.local)).collect()
    }

    #[test]
    fn each_frontend_is_followed_to_its_endpoints() {
        let entries = entries(SAVED);
        assert_eq!(entries.len(), 6, "{entries:?}");
        let cluster = find(&entries, "10.96.0.10:80/tcp");
        assert_eq!(
            (cluster.kind.as_str(), cluster.service.as_str()),
            ("ClusterIP", "demo/web:http")
        );
        assert_eq!(cluster.flags, [flag::AFFINITY]);
        assert_eq!(addresses(cluster), [("10.244.1.2:8080", None), ("10.244.2.3:8080", None)]);
        for (frontend, kind) in [("10.200.0.5:80/tcp", "ExternalIP"), ("*:30080/tcp", "NodePort")] {
            let e = find(&entries, frontend);
            assert_eq!((e.kind.as_str(), e.flags.as_slice()), (kind, &[flag::LOCAL_POLICY][..]));
            assert_eq!(addresses(e), [("10.244.1.2:8080", Some(true))]);
        }
        let lb = find(&entries, "172.18.0.50:80/tcp");
        assert_eq!(lb.kind, "LoadBalancer");
        assert_eq!(lb.flags, [flag::SOURCE_RANGES, flag::LOCAL_POLICY]);
        assert_eq!(addresses(lb), [("10.244.1.2:8080", Some(true))]);
    }

    #[test]
    fn frontends_without_endpoints_come_from_the_filter_table() {
        let entries = entries(SAVED);
        let empty = find(&entries, "10.96.0.11:53/udp");
        assert_eq!((empty.kind.as_str(), empty.service.as_str()), ("ClusterIP", "demo/empty:dns"));
        assert!(empty.backends.is_empty() && empty.flags.is_empty());
        let local = find(&entries, "*:30081/tcp");
        assert_eq!(local.kind, "NodePort");
        assert_eq!(local.flags, [flag::LOCAL_POLICY, flag::DROP_WHEN_EMPTY]);
    }

    #[test]
    fn quoted_words_keep_their_spaces() {
        assert_eq!(
            words(r#"-m comment --comment "a b" -j X"#),
            ["-m", "comment", "--comment", "a b", "-j", "X"]
        );
    }
    #[test]
    fn refusing_rules_are_read_with_their_counters() {
        let save = "*nat\n\
            [9:540] -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"demo/web:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-X\n\
            *filter\n\
            :KUBE-SERVICES - [0:0]\n\
            [3:180] -A KUBE-SERVICES -d 10.96.0.11/32 -p tcp -m comment --comment \"demo/empty:http has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable\n\
            [0:0] -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment \"demo/loc:http has no local endpoints\" -m addrtype --dst-type LOCAL -m tcp --dport 30081 -j DROP\n\
            COMMIT\n";
        let found = refusals(save);
        assert_eq!(
            found,
            [
                Refusal {
                    service: "demo/empty:http".into(),
                    frontend: "10.96.0.11:80/tcp".into(),
                    dropped: false,
                    packets: 3
                },
                Refusal {
                    service: "demo/loc:http".into(),
                    frontend: "*:30081/tcp".into(),
                    dropped: true,
                    packets: 0
                },
            ]
        );
    }
}
