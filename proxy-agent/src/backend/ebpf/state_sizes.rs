//! How many entries the state maps hold: the maps of flows, sockets and
//! affinity that the programs fill as traffic comes. They are LRU maps,
//! which the kernel allocates whole when it creates them (an LRU map
//! cannot be allocated per entry), so their size is memory the node pays
//! from the start: sized as kube-proxy sizes the kernel's conntrack table
//! ([`ConntrackLimit`]), and the IPv6 family's at a token size on a node
//! without IPv6 (the programs still name those maps). Pure.

use proxy_common::{MAX_FRAGMENTS, map_names};

use crate::backend::conntrack_limit::ConntrackLimit;

/// The fewest entries a state map gets: the IPv6 family's on a node
/// without IPv6, and the floor of any map (a handful of flows still work
/// there; a map too small for the kernel's per-CPU free lists would not).
pub const TOKEN: u32 = 1024;

/// The entries of each family's state maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSizes {
    /// Flows of a family: `CONNTRACK` and `SOCK_REV_NAT` hold this many.
    pub flows: u32,
    pub flows6: u32,
}

impl StateSizes {
    /// Sized for `limit` on a node of `cpus` CPUs; the IPv6 maps at the
    /// token size without `ipv6`. In the eBPF mode no kernel value is left
    /// alone: 0 per core sizes the maps at the minimum.
    pub fn new(limit: ConntrackLimit, cpus: u32, ipv6: bool) -> Self {
        let flows = limit.max(cpus).unwrap_or(limit.min).max(TOKEN);
        StateSizes { flows, flows6: if ipv6 { flows } else { TOKEN } }
    }

    /// Every map at the token size: for loads that only verify or test the
    /// programs (`probe`, test runs).
    pub const SMALLEST: StateSizes = StateSizes { flows: TOKEN, flows6: TOKEN };

    /// Whether the IPv6 maps are smaller than the IPv4 ones (the token
    /// size of a node without IPv6).
    pub fn ipv6_token(self) -> bool {
        self.flows6 < self.flows
    }

    /// Whether `held` IPv6 flow entries fill the token-size maps: this node
    /// has IPv6 traffic the agent did not expect (a node without an IPv6
    /// address or `--cluster-cidr` whose pods have IPv6 all the same).
    pub fn ipv6_outgrown(self, held: usize) -> bool {
        self.ipv6_token() && held >= self.flows6 as usize * 3 / 4
    }

    /// The entries of the state map `name`: a flow translated per packet
    /// takes two `CONNTRACK` entries (one per direction), a socket the
    /// socket LB connected one `SOCK_REV_NAT` entry; unconnected UDP
    /// sockets' flows (`SOCK_FLOWS`, of both families) and clients with
    /// session affinity (`AFFINITY`) are fewer: a quarter. Fragments are
    /// few and short-lived: a fixed size.
    pub fn entries(self, name: &str) -> u32 {
        let quarter = |flows: u32| (flows / 4).max(TOKEN);
        match name {
            map_names::CONNTRACK | map_names::SOCK_REV_NAT => self.flows,
            map_names::CONNTRACK6 | map_names::SOCK_REV_NAT6 => self.flows6,
            map_names::AFFINITY | map_names::SOCK_FLOWS => quarter(self.flows),
            map_names::AFFINITY6 => quarter(self.flows6),
            _ => MAX_FRAGMENTS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ebpf::carry::STATE_MAPS;

    #[test]
    fn a_small_node_gets_kube_proxys_minimum() {
        let sizes = StateSizes::new(ConntrackLimit::default(), 2, true);
        assert_eq!(sizes.entries(map_names::CONNTRACK), 131_072);
        assert_eq!(sizes.entries(map_names::SOCK_REV_NAT6), 131_072);
        assert_eq!(sizes.entries(map_names::AFFINITY), 32_768);
        assert_eq!(sizes.entries(map_names::SOCK_FLOWS), 32_768);
        assert_eq!(sizes.entries(map_names::FRAGMENTS), MAX_FRAGMENTS);
        let large = StateSizes::new(ConntrackLimit::default(), 16, true);
        assert_eq!(large.entries(map_names::CONNTRACK6), 524_288);
    }

    #[test]
    fn without_ipv6_its_maps_take_the_token_size() {
        let sizes = StateSizes::new(ConntrackLimit::default(), 2, false);
        for name in [map_names::CONNTRACK6, map_names::SOCK_REV_NAT6, map_names::AFFINITY6] {
            assert_eq!(sizes.entries(name), TOKEN, "{name}");
        }
        assert_eq!(sizes.entries(map_names::CONNTRACK), 131_072, "IPv4's unchanged");
        assert_eq!(sizes.entries(map_names::SOCK_FLOWS), 32_768, "both families'");
        assert!(sizes.ipv6_token());
        assert!(!StateSizes::new(ConntrackLimit::default(), 2, true).ipv6_token());
    }

    #[test]
    fn ipv6_flows_that_fill_the_token_size_are_told() {
        let sizes = StateSizes::new(ConntrackLimit::default(), 2, false);
        assert!(!sizes.ipv6_outgrown(2), "a few flows fit");
        assert!(sizes.ipv6_outgrown(768));
        let full = StateSizes::new(ConntrackLimit::default(), 2, true);
        assert!(!full.ipv6_outgrown(100_000), "sized in full: never");
    }

    #[test]
    fn zero_per_core_sizes_at_the_minimum_and_nothing_goes_below_the_token() {
        let off = ConntrackLimit { max_per_core: 0, min: 50_000 };
        assert_eq!(StateSizes::new(off, 8, true).flows, 50_000);
        let tiny = ConntrackLimit { max_per_core: 10, min: 0 };
        let sizes = StateSizes::new(tiny, 2, true);
        assert_eq!(sizes.entries(map_names::CONNTRACK), TOKEN);
        assert_eq!(sizes.entries(map_names::AFFINITY6), TOKEN);
    }

    #[test]
    fn every_state_map_has_a_size_of_its_own() {
        // A map added to STATE_MAPS without a rule here would get the
        // fragments' size.
        let sizes = StateSizes::new(ConntrackLimit { max_per_core: 0, min: 400_000 }, 1, true);
        let fixed: Vec<_> = STATE_MAPS
            .iter()
            .filter(|m| sizes.entries(m.name) == MAX_FRAGMENTS)
            .map(|m| m.name)
            .collect();
        assert_eq!(fixed, [map_names::FRAGMENTS]);
    }
}
