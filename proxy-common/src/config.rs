//! The datapath's settings (`CONFIG`).

use crate::Ipv6Octets;

/// The datapath's settings, in a one-element array written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Config {
    /// The node address clients are SNATed to.
    pub snat_addr: [u8; 4],
    /// `--cluster-cidr`: sources outside it are masqueraded on ClusterIP
    /// traffic. A zero prefix length means no cluster CIDR is set.
    pub cluster_cidr: [u8; 4],
    pub cluster_cidr_prefix: u8,
    /// `--masquerade-all`.
    pub masquerade_all: u8,
    /// SNAT source ports are allocated in `snat_port_min..=snat_port_max`.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Which decision records the programs write (`log_level`); the agent
    /// rewrites it at run time.
    pub log_level: u8,
    /// `--socket-lb-host-netns-only`: the socket programs translate only for
    /// sockets of the node's network namespace (`node_netns_cookie`).
    pub socket_lb_node_only: u8,
    pub tcp_syn_timeout_secs: u32,
    pub tcp_established_timeout_secs: u32,
    /// After one side's FIN (half-closed).
    pub tcp_close_wait_timeout_secs: u32,
    /// After both FINs or an RST.
    pub tcp_time_wait_timeout_secs: u32,
    pub udp_timeout_secs: u32,
    /// A UDP flow that saw a reply (netfilter's "stream" timeout).
    pub udp_stream_timeout_secs: u32,
    /// The node's network namespace (its `bpf_get_netns_cookie`): only its
    /// sockets reach localhost NodePorts, and with `socket_lb_node_only`
    /// any service. 0 where the kernel cannot tell it (before 5.14): no
    /// socket is the node's then.
    pub node_netns_cookie: u64,
    /// The node's IPv6 address clients are SNATed to (all zero: none).
    pub snat_addr6: Ipv6Octets,
    /// The IPv6 `--cluster-cidr`; a zero prefix length means none is set.
    pub cluster_cidr6: Ipv6Octets,
    pub cluster_cidr6_prefix: u8,
    pub _pad6: [u8; 3],
    /// `--bpf-lb-maglev-table-size`: the entries of every Maglev table.
    pub maglev_table_size: u32,
}

/// The timeouts the tests of flows use.
#[cfg(test)]
pub(crate) fn with_timeouts() -> Config {
    Config {
        tcp_syn_timeout_secs: 60,
        tcp_established_timeout_secs: 86_400,
        tcp_close_wait_timeout_secs: 3_600,
        tcp_time_wait_timeout_secs: 120,
        udp_timeout_secs: 30,
        udp_stream_timeout_secs: 120,
        ..Config::default()
    }
}
