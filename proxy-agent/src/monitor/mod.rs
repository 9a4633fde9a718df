//! `proxy-agent monitor`: the datapath's decisions as they happen, one line
//! each. The eBPF mode's events come from the `EVENTS` ring buffer
//! (`backend::ebpf::ring`), named from the pinned maps ([`names`]); turning
//! them into lines (service, interface, words) is pure and lives here. The
//! iptables mode's lines come from the kernel's conntrack events and the
//! refusing rules' counters ([`iptables`]).

pub mod iptables;
pub mod names;

use std::{
    fmt::Write as _,
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use proxy_common::monitor::{EventTuple, MonitorEvent, address, hook, reason, verdict};
use serde::Serialize;

use crate::inspect::protocol;

/// One event, in words.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Line {
    /// RFC 3339, UTC.
    pub time: String,
    /// `tc_ingress`, `connect4`, `sendmsg6`, …
    pub hook: &'static str,
    /// The interface of a tc hook.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    pub protocol: &'static str,
    /// `source -> destination`; a socket hook's has no source.
    pub before: String,
    /// The translated tuple (translations only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// `namespace/name:port`, `?` when no frontend names it any more.
    pub service: String,
    /// `translated`, `dropped` or `refused`.
    pub verdict: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// The packets one line stands for, where the mode counts them rather
    /// than seeing each (the iptables mode's refusals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packets: Option<u64>,
}

impl Line {
    /// A drop or a refusal.
    pub fn is_drop(&self) -> bool {
        self.verdict != "translated"
    }

    /// The line `monitor` prints.
    pub fn text(&self) -> String {
        let mut out = format!("{} {}", self.time, self.hook);
        if let Some(interface) = &self.interface {
            let _ = write!(out, " {interface}");
        }
        let _ = write!(out, " {} {}", self.protocol, self.before);
        if let Some(after) = &self.after {
            let _ = write!(out, " => {after}");
        }
        let _ = write!(out, " {} {}", self.service, self.verdict);
        if let Some(reason) = self.reason {
            let _ = write!(out, " ({reason})");
        }
        if let Some(packets) = self.packets {
            let _ = write!(out, " x{packets}");
        }
        out
    }
}

/// What the lines need from outside the event: names of services and
/// interfaces, and the clocks.
pub trait Context {
    /// The service port of the frontend `rev_nat_id`, else of the frontend
    /// address `frontend` (`address:port/protocol`).
    fn service(&mut self, rev_nat_id: u32, frontend: &str) -> Option<String>;
    fn interface(&mut self, ifindex: u32) -> Option<String>;
    /// The wall clock at the monotonic time `ns` (the events' clock).
    fn wall_time(&self, ns: u64) -> SystemTime;
}

/// Converts the events' monotonic times, given both clocks read together.
pub fn wall_time(ns: u64, mono_now: u64, wall_now: SystemTime) -> SystemTime {
    match ns.checked_sub(mono_now) {
        Some(after) => wall_now + Duration::from_nanos(after),
        None => wall_now - Duration::from_nanos(mono_now - ns),
    }
}

pub fn hook_name(h: u8) -> &'static str {
    match h {
        hook::TC_INGRESS => "tc_ingress",
        hook::CONNECT4 => "connect4",
        hook::SENDMSG4 => "sendmsg4",
        hook::CONNECT6 => "connect6",
        hook::SENDMSG6 => "sendmsg6",
        hook::XDP => "xdp_ingress",
        _ => "?",
    }
}

pub fn verdict_name(v: u8) -> &'static str {
    match v {
        verdict::TRANSLATED => "translated",
        verdict::DROPPED => "dropped",
        verdict::REFUSED => "refused",
        _ => "?",
    }
}

pub fn reason_text(r: u8) -> Option<&'static str> {
    match r {
        reason::SOURCE_OUTSIDE_RANGES => Some("source outside loadBalancerSourceRanges"),
        reason::NO_LOCAL_ENDPOINT => Some("no local endpoint, policy Local"),
        reason::NO_ENDPOINT => Some("no endpoint"),
        reason::NO_SNAT_PORT => Some("no SNAT port free"),
        reason::CONNTRACK_FULL => Some("conntrack map full"),
        _ => None,
    }
}

fn destination(family: u8, t: &EventTuple) -> SocketAddr {
    SocketAddr::new(address(family, &t.daddr), t.dport)
}

/// `source -> destination`, or the destination alone for a socket hook.
fn tuple(family: u8, t: &EventTuple, socket: bool) -> String {
    let to = destination(family, t);
    match socket {
        true => format!("-> {to}"),
        false => format!("{} -> {to}", SocketAddr::new(address(family, &t.saddr), t.sport)),
    }
}

/// The line of `e`.
pub fn line(e: &MonitorEvent, cx: &mut impl Context) -> Line {
    let socket = !hook::sees_packets(e.hook);
    let proto = protocol(e.before.proto);
    let frontend = format!("{}/{proto}", destination(e.family, &e.before));
    let translated = e.verdict == verdict::TRANSLATED;
    Line {
        time: crate::time::rfc3339_nano(cx.wall_time(e.ts_ns)),
        hook: hook_name(e.hook),
        interface: (!socket)
            .then(|| cx.interface(e.ifindex).unwrap_or_else(|| format!("if{}", e.ifindex))),
        protocol: proto,
        before: tuple(e.family, &e.before, socket),
        after: translated.then(|| tuple(e.family, &e.after, socket)),
        service: cx.service(e.rev_nat_id, &frontend).unwrap_or_else(|| "?".into()),
        verdict: verdict_name(e.verdict),
        reason: reason_text(e.reason),
        packets: None,
    }
}

/// Which lines `monitor` prints.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// `namespace/name` or `namespace/name:port`.
    pub service: Option<String>,
    /// Drops and refusals only.
    pub drops: bool,
}

impl Filter {
    pub fn keeps(&self, line: &Line) -> bool {
        (!self.drops || line.is_drop())
            && self.service.as_ref().is_none_or(|s| crate::inspect::is_of(&line.service, s))
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, time::UNIX_EPOCH};

    use proxy_common::IPPROTO_TCP;

    use super::*;

    struct Fixed;

    impl Context for Fixed {
        fn service(&mut self, rev_nat_id: u32, frontend: &str) -> Option<String> {
            let by_id = BTreeMap::from([(7, "demo/web:http")]);
            let by_frontend = BTreeMap::from([("10.96.0.11:80/tcp", "demo/empty:http")]);
            by_id.get(&rev_nat_id).or(by_frontend.get(frontend)).map(|s| s.to_string())
        }

        fn interface(&mut self, ifindex: u32) -> Option<String> {
            (ifindex == 3).then(|| "eth0".into())
        }

        fn wall_time(&self, ns: u64) -> SystemTime {
            wall_time(ns, 10_000_000_000, UNIX_EPOCH + Duration::from_secs(1_700_000_010))
        }
    }

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut out = [0; 16];
        out[..4].copy_from_slice(&a);
        out
    }

    fn tuple4(s: [u8; 4], sport: u16, d: [u8; 4], dport: u16) -> EventTuple {
        EventTuple {
            saddr: v4(s),
            daddr: v4(d),
            sport,
            dport,
            proto: IPPROTO_TCP,
            ..Default::default()
        }
    }

    #[test]
    fn a_translation_names_both_tuples_its_interface_and_service() {
        let before = tuple4([192, 168, 1, 5], 40000, [192, 168, 1, 1], 30080);
        let e = MonitorEvent {
            ts_ns: 9_500_000_000,
            ifindex: 3,
            rev_nat_id: 7,
            before,
            after: tuple4([192, 168, 1, 1], 40000, [10, 244, 1, 2], 8080),
            hook: hook::TC_INGRESS,
            family: 4,
            verdict: verdict::TRANSLATED,
            ..Default::default()
        };
        let l = line(&e, &mut Fixed);
        assert_eq!(
            l.text(),
            "2023-11-14T22:13:29.5Z tc_ingress eth0 tcp 192.168.1.5:40000 -> 192.168.1.1:30080 \
             => 192.168.1.1:40000 -> 10.244.1.2:8080 demo/web:http translated"
        );
        assert!(!l.is_drop());
    }

    #[test]
    fn a_refusal_at_a_socket_finds_its_service_by_address_and_gives_its_reason() {
        let e = MonitorEvent {
            ts_ns: 10_000_000_000,
            before: tuple4([0; 4], 0, [10, 96, 0, 11], 80),
            hook: hook::CONNECT4,
            family: 4,
            verdict: verdict::REFUSED,
            reason: reason::NO_ENDPOINT,
            ..Default::default()
        };
        let l = line(&e, &mut Fixed);
        assert_eq!(
            l.text(),
            "2023-11-14T22:13:30Z connect4 tcp -> 10.96.0.11:80 demo/empty:http refused (no endpoint)"
        );
        let json = serde_json::to_value(&l).unwrap();
        assert_eq!(json["reason"], "no endpoint");
        assert!(json.get("after").is_none() && json.get("interface").is_none());
    }

    #[test]
    fn event_times_before_and_after_the_clocks_were_read_convert() {
        let wall = UNIX_EPOCH + Duration::from_secs(100);
        assert_eq!(wall_time(1_000, 3_000, wall), wall - Duration::from_nanos(2_000));
        assert_eq!(wall_time(5_000, 3_000, wall), wall + Duration::from_nanos(2_000));
    }

    #[test]
    fn ipv6_addresses_are_bracketed_and_unknown_services_are_marked() {
        let mut daddr = [0u8; 16];
        daddr[..2].copy_from_slice(&[0xfd, 0]);
        daddr[15] = 0x10;
        let e = MonitorEvent {
            before: EventTuple { daddr, dport: 80, proto: IPPROTO_TCP, ..Default::default() },
            hook: hook::CONNECT6,
            family: 6,
            verdict: verdict::DROPPED,
            reason: reason::NO_LOCAL_ENDPOINT,
            ..Default::default()
        };
        let l = line(&e, &mut Fixed);
        assert_eq!(l.before, "-> [fd00::10]:80");
        assert_eq!(l.service, "?");
    }

    #[test]
    fn the_filter_keeps_a_service_and_drops() {
        let e = MonitorEvent {
            before: tuple4([0; 4], 0, [10, 96, 0, 11], 80),
            hook: hook::CONNECT4,
            family: 4,
            verdict: verdict::REFUSED,
            ..Default::default()
        };
        let refused = line(&e, &mut Fixed);
        let translated =
            line(&MonitorEvent { verdict: verdict::TRANSLATED, rev_nat_id: 7, ..e }, &mut Fixed);
        let drops = Filter { drops: true, ..Filter::default() };
        assert!(drops.keeps(&refused) && !drops.keeps(&translated));
        let web = Filter { service: Some("demo/web".into()), ..Filter::default() };
        assert!(web.keeps(&translated) && !web.keeps(&refused));
        assert!(Filter::default().keeps(&refused));
    }
}
