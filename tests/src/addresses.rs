//! The lab's addresses, named once: the fabric joining nodes and external
//! clients, the nodes, pods and service ranges, and their IPv6 twins in a
//! dual-stack lab.

/// The pods' gateway, on the node side of each pod's veth (link-local, as
/// CNIs use).
pub(crate) const GATEWAY: &str = "169.254.1.1";
pub(crate) const GATEWAY6: &str = "fe80::1";

/// Addresses of external clients and node uplinks share 192.168.100.0/24;
/// externalIPs and load-balancer IPs live in 10.200.0.0/24, which external
/// clients route to node 0.
pub const FABRIC_PREFIX: &str = "192.168.100";
pub const EXTERNAL_SERVICE_RANGE: &str = "10.200.0.0/24";

/// Node 0's address on the fabric ([`node_ip`]`(0)`), and its IPv6 twin.
pub const NODE_IP: &str = "192.168.100.11";
pub const NODE_IP6: &str = "fd00:100::11";

/// Node `index`'s address on the fabric.
pub fn node_ip(index: usize) -> String {
    format!("{FABRIC_PREFIX}.{}", 11 + index)
}

/// Node 0's node port `port`, `192.168.100.11:<port>`.
pub fn node_port(port: u16) -> String {
    format!("{NODE_IP}:{port}")
}

/// The first external client's address (`ext` in the scenarios:
/// [`external_ip`]`(1)`), and its IPv6 twin.
pub const EXT_IP: &str = "192.168.100.101";
pub const EXT_IP6: &str = "fd00:100::101";

/// External client `n`'s address (from 1): 192.168.100.(100 + n).
pub fn external_ip(n: u8) -> String {
    format!("{FABRIC_PREFIX}.{}", 100 + u32::from(n))
}

/// The test API server's address on the fabric.
pub(crate) const API_ADDR: &str = "192.168.100.1";

/// Cluster IPs.
pub const SERVICE_RANGE: &str = "10.96.0.0/12";
/// IPv6 cluster IPs and external service IPs (dual-stack labs).
pub const SERVICE_RANGE6: &str = "fd00:96::/112";
pub const EXTERNAL_SERVICE_RANGE6: &str = "fd00:200::/112";
/// Every pod's IPv6 address (dual-stack labs): `--cluster-cidr`'s second.
pub const CLUSTER_CIDR6: &str = "fd00:244::/32";

/// The IPv6 twin of a lab address in a dual-stack lab: pods 10.244.N.M are
/// also fd00:244:N::M, nodes and external clients 192.168.100.X also
/// fd00:100::X (the decimal digits read as hex: short, and easy to match).
pub fn v6(v4: &str) -> String {
    match v4.split('.').collect::<Vec<_>>()[..] {
        ["10", "244", n, m] => format!("fd00:244:{n}::{m}"),
        ["192", "168", "100", x] => format!("fd00:100::{x}"),
        _ => panic!("{v4} has no IPv6 twin in the lab"),
    }
}

/// The router of [`crate::Lab::add_far_external`] on the fabric, and the
/// subnet behind it.
pub const FAR_ROUTER: &str = "192.168.100.254";
pub const FAR_PREFIX: &str = "192.168.200";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_addresses_agree_with_the_rules_that_make_them() {
        assert_eq!(node_ip(0), NODE_IP);
        assert_eq!(node_ip(1), "192.168.100.12");
        assert_eq!(external_ip(1), EXT_IP);
        assert_eq!(v6(NODE_IP), NODE_IP6);
        assert_eq!(v6(EXT_IP), EXT_IP6);
        assert_eq!(node_port(30080), "192.168.100.11:30080");
        assert_eq!(v6("10.244.2.3"), "fd00:244:2::3");
    }
}
