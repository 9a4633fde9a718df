//! The iptables mode's `monitor` lines, from what the mode can tell: new
//! service flows and their DNAT (and masquerade) from the kernel's
//! conntrack events (`conntrack -E -e NEW`), and refusals and drops from
//! the packet counters of kube-proxy's REJECT/DROP rules, one line per
//! increase (the rules count packets; their tuples are not seen). Pure:
//! the command hands in the text.

use std::{collections::BTreeMap, time::SystemTime};

use super::Line;
use crate::inspect::{LbEntry, ct, iptables::Refusal};

/// The hook of the iptables mode's lines.
pub const CONNTRACK: &str = "conntrack";
pub const RULES: &str = "iptables";

fn protocol(name: &str) -> &'static str {
    match name {
        "tcp" => "tcp",
        "udp" => "udp",
        "sctp" => "sctp",
        _ => "?",
    }
}

/// The line of a `conntrack -E` event (`[NEW] tcp 6 120 SYN_SENT src=…`)
/// whose original destination is a frontend of `lb`.
pub fn new_flow(event: &str, lb: &[LbEntry], time: SystemTime) -> Option<Line> {
    let entry = event.trim_start().strip_prefix("[NEW]")?;
    let row = ct::conntrack(entry, lb).pop()?;
    let seen_as = row.snat.as_deref().unwrap_or(&row.client);
    Some(Line {
        time: crate::time::rfc3339_nano(time),
        hook: CONNTRACK,
        interface: None,
        protocol: protocol(&row.proto),
        before: format!("{} -> {}", row.client, row.frontend),
        after: Some(format!("{seen_as} -> {}", row.backend)),
        service: row.service,
        verdict: "translated",
        reason: None,
        packets: None,
    })
}

/// What a refusing rule is known by between two readings.
type RuleKey = (String, String, bool);

/// The refusing rules' counters, to tell increases.
#[derive(Default)]
pub struct Counters {
    read: bool,
    packets: BTreeMap<RuleKey, u64>,
}

impl Counters {
    /// A line per rule whose counter grew since the last reading (none at
    /// the first: what came before the monitor is not shown).
    pub fn update(&mut self, now: &[Refusal], time: SystemTime) -> Vec<Line> {
        let first = !std::mem::replace(&mut self.read, true);
        let mut lines = Vec::new();
        let mut next = BTreeMap::new();
        for r in now {
            let key = (r.frontend.clone(), r.service.clone(), r.dropped);
            *next.entry(key).or_insert(0) += r.packets;
        }
        for ((frontend, service, dropped), &packets) in &next {
            let key = (frontend.clone(), service.clone(), *dropped);
            let before = self.packets.get(&key).copied();
            let grew = match before {
                Some(before) => packets.saturating_sub(before),
                None if first => 0,
                None => packets,
            };
            if grew > 0 {
                lines.push(refusal(frontend, service, *dropped, grew, time));
            }
        }
        self.packets = next;
        lines
    }
}

fn refusal(frontend: &str, service: &str, dropped: bool, packets: u64, time: SystemTime) -> Line {
    let (address, proto) = frontend.rsplit_once('/').unwrap_or((frontend, "?"));
    Line {
        time: crate::time::rfc3339_nano(time),
        hook: RULES,
        interface: None,
        protocol: protocol(proto),
        before: format!("-> {address}"),
        after: None,
        service: service.to_string(),
        verdict: if dropped { "dropped" } else { "refused" },
        reason: Some(match dropped {
            true => "no local endpoint, policy Local",
            false => "no endpoint",
        }),
        packets: Some(packets),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn lb(frontend: &str, service: &str) -> LbEntry {
        LbEntry {
            frontend: frontend.into(),
            kind: "ClusterIP".into(),
            service: service.into(),
            flags: vec![],
            backends: vec![],
        }
    }

    #[test]
    fn a_new_service_flow_names_its_translation() {
        let time = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let lb = [lb("*:30080/tcp", "demo/web:http"), lb("10.96.0.10:80/tcp", "demo/web:http")];
        let event = "    [NEW] tcp      6 120 SYN_SENT src=192.168.100.101 dst=192.168.100.11 sport=54306 dport=30080 [UNREPLIED] src=10.244.1.2 dst=192.168.100.11 sport=8080 dport=17973";
        let line = new_flow(event, &lb, time).expect("a service's flow");
        assert_eq!(
            line.text(),
            "2023-11-14T22:13:20Z conntrack tcp 192.168.100.101:54306 -> 192.168.100.11:30080 \
             => 192.168.100.11:17973 -> 10.244.1.2:8080 demo/web:http translated"
        );
        let unmasqueraded = "[NEW] tcp 6 120 SYN_SENT src=10.244.1.100 dst=10.96.0.10 sport=4000 dport=80 [UNREPLIED] src=10.244.1.3 dst=10.244.1.100 sport=8080 dport=4000";
        let line = new_flow(unmasqueraded, &lb, time).unwrap();
        assert_eq!(line.after.as_deref(), Some("10.244.1.100:4000 -> 10.244.1.3:8080"));
        let other = "[NEW] tcp 6 120 SYN_SENT src=10.0.0.1 dst=10.0.0.2 sport=1 dport=22 [UNREPLIED] src=10.0.0.2 dst=10.0.0.1 sport=22 dport=1";
        assert!(new_flow(other, &lb, time).is_none(), "no service's");
    }

    #[test]
    fn counters_give_a_line_per_increase_after_the_first_reading() {
        let time = UNIX_EPOCH;
        let rule = |packets| Refusal {
            service: "demo/empty:http".into(),
            frontend: "10.96.0.11:80/tcp".into(),
            dropped: false,
            packets,
        };
        let mut counters = Counters::default();
        assert!(counters.update(&[rule(5)], time).is_empty(), "the first reading");
        assert!(counters.update(&[rule(5)], time).is_empty());
        let lines = counters.update(&[rule(7)], time);
        assert_eq!(lines.len(), 1);
        assert_eq!(
            lines[0].text(),
            "1970-01-01T00:00:00Z iptables tcp -> 10.96.0.11:80 demo/empty:http refused (no endpoint) x2"
        );
        assert!(lines[0].is_drop());
    }
}
