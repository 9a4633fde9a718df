//! Endpoints that left, as a sync reports them: whose flows (per-packet
//! conntrack, unconnected-UDP socket flows) and connected sockets must go,
//! as kube-proxy deletes the conntrack entries of a (service, endpoint)
//! pair when the endpoint leaves that service. Pure: the backend reads the
//! maps and asks.
//!
//! A backend leaves one frontend (by its reverse-NAT id) while it may stay
//! in others (two services sharing a pod port, a NodePort removed while the
//! ClusterIP stays): only that frontend's flows go. A backend no frontend
//! names any more is gone: all its flows go.

use std::collections::BTreeSet;

use std::net::IpAddr;

use proxy_common::{SockEndKey, v4_mapped};

use super::entries::BackendEntry;

/// Stands for every frontend in [`SockEndKey::rev_nat_id`]; real reverse-NAT
/// ids start at 1.
pub const EVERY_FRONTEND: u32 = 0;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Departures {
    /// (reverse-NAT id or [`EVERY_FRONTEND`], backend id).
    by_id: BTreeSet<(u32, u32)>,
    /// The same departures by the backend's address (IPv4 ones
    /// v4-mapped), as flows and the socket iterators name it.
    by_address: BTreeSet<SockEndKey>,
}

fn key(rev_nat_id: u32, backend: &BackendEntry) -> SockEndKey {
    let (address, port, proto) = match backend {
        BackendEntry::V4(b) => (v4_mapped(b.address), b.port, b.proto),
        BackendEntry::V6(b) => (b.address, b.port, b.proto),
    };
    SockEndKey { address, port, proto, _pad: 0, rev_nat_id }
}

impl Departures {
    /// Backends (with their ids) no frontend names any more.
    pub fn gone(backends: impl IntoIterator<Item = (u32, BackendEntry)>) -> Self {
        let mut departures = Self::default();
        for (id, backend) in backends {
            departures.add(EVERY_FRONTEND, id, &backend);
        }
        departures
    }

    /// Backend `id` left the frontend `rev_nat_id` (or, with
    /// [`EVERY_FRONTEND`], every frontend).
    pub fn add(&mut self, rev_nat_id: u32, id: u32, backend: &BackendEntry) {
        self.by_id.insert((rev_nat_id, id));
        self.by_address.insert(key(rev_nat_id, backend));
    }

    /// These and `more`'s.
    pub fn merge(&mut self, more: Departures) {
        self.by_id.extend(more.by_id);
        self.by_address.extend(more.by_address);
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// How many (frontend, backend) departures, a gone backend counting once.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether the flow of frontend `rev_nat_id` to backend `backend_id`
    /// must go.
    pub fn ends(&self, rev_nat_id: u32, backend_id: u32) -> bool {
        self.by_id.contains(&(EVERY_FRONTEND, backend_id))
            || self.by_id.contains(&(rev_nat_id, backend_id))
    }

    /// The same, for a flow or socket that names its backend by address.
    pub fn ends_flow_to(&self, rev_nat_id: u32, proto: u8, address: IpAddr, port: u16) -> bool {
        let address = match address {
            IpAddr::V4(ip) => v4_mapped(ip.octets()),
            IpAddr::V6(ip) => ip.octets(),
        };
        let mut key = SockEndKey { address, port, proto, _pad: 0, rev_nat_id: EVERY_FRONTEND };
        self.by_address.contains(&key) || {
            key.rev_nat_id = rev_nat_id;
            self.by_address.contains(&key)
        }
    }

    /// Whether any departure is of a backend whose protocol is `which`.
    pub fn has_proto(&self, which: impl Fn(u8) -> bool) -> bool {
        self.by_address.iter().any(|k| which(k.proto))
    }

    /// The departures of `protocols`, as the socket iterators read them.
    pub fn socket_keys(&self, protocols: &[u8]) -> Vec<SockEndKey> {
        self.by_address.iter().filter(|k| protocols.contains(&k.proto)).copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::{Backend, BackendFlags, IPPROTO_TCP, IPPROTO_UDP};

    fn backend(last: u8, proto: u8) -> BackendEntry {
        let flags = BackendFlags::default();
        BackendEntry::V4(Backend { address: [10, 244, 0, last], port: 53, proto, flags })
    }

    #[test]
    fn a_backend_leaving_one_frontend_ends_that_frontends_flows_only() {
        let mut departures = Departures::default();
        departures.add(7, 1, &backend(1, IPPROTO_UDP));
        assert!(departures.ends(7, 1));
        assert!(!departures.ends(8, 1), "the backend still serves frontend 8");
        assert!(departures.ends_flow_to(7, IPPROTO_UDP, [10, 244, 0, 1].into(), 53));
        assert!(!departures.ends_flow_to(8, IPPROTO_UDP, [10, 244, 0, 1].into(), 53));
        assert!(!departures.ends_flow_to(7, IPPROTO_TCP, [10, 244, 0, 1].into(), 53));
        assert!(!departures.ends_flow_to(7, IPPROTO_UDP, [10, 244, 0, 1].into(), 54));
    }

    #[test]
    fn a_gone_backend_ends_the_flows_of_every_frontend() {
        let departures = Departures::gone([(2, backend(2, IPPROTO_UDP))]);
        assert!(departures.ends(7, 2) && departures.ends(8, 2));
        assert!(!departures.ends(7, 3));
        assert!(departures.ends_flow_to(9, IPPROTO_UDP, [10, 244, 0, 2].into(), 53));
        assert_eq!(departures.len(), 1);
    }

    #[test]
    fn ipv6_backends_are_named_by_their_own_address_ipv4_ones_v4_mapped() {
        let v6 = BackendEntry::V6(proxy_common::Backend6 {
            address: [0xfd, 0, 0, 0, 2, 0x44, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2],
            port: 53,
            proto: IPPROTO_UDP,
            flags: BackendFlags::default(),
        });
        let mut departures = Departures::gone([(3, v6)]);
        departures.add(7, 1, &backend(1, IPPROTO_UDP));
        let addresses: Vec<[u8; 16]> =
            departures.socket_keys(&[IPPROTO_UDP]).iter().map(|k| k.address).collect();
        let mapped = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 244, 0, 1];
        assert_eq!(addresses, [mapped, [0xfd, 0, 0, 0, 2, 0x44, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2]]);
        assert!(departures.ends(9, 3), "gone from every frontend");
    }

    #[test]
    fn socket_keys_are_filtered_by_protocol() {
        let mut departures = Departures::gone([(2, backend(2, IPPROTO_TCP))]);
        departures.add(7, 1, &backend(1, IPPROTO_UDP));
        let udp = departures.socket_keys(&[IPPROTO_UDP]);
        assert_eq!(udp, vec![key(7, &backend(1, IPPROTO_UDP))]);
        assert_eq!(departures.socket_keys(&[IPPROTO_UDP, IPPROTO_TCP]).len(), 2);
        assert!(departures.has_proto(|p| p == IPPROTO_TCP));
        assert!(!Departures::default().has_proto(|p| p == IPPROTO_UDP));
    }
}
