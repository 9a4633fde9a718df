//! The socket LB's maps: the reverse translation of translated sockets,
//! unconnected UDP sockets' flows, and the sockets to end.

use crate::{Config, Ipv6Octets};

/// Key of the socket reverse-NAT map: a socket (by cookie) and the backend it
/// was sent to. Filled by `connect4`/`sendmsg4`, read by `recvmsg4` and
/// `getpeername4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    pub cookie: u64,
    pub address: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Value of the socket reverse-NAT map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNat {
    pub address: [u8; 4],
    pub port: u16,
    pub _pad: u16,
    pub rev_nat_id: u32,
}

/// Key of `SOCK_REV_NAT6`: as [`SockRevNatKey`], for IPv6 sockets sent to
/// an IPv6 backend (`connect6`, `sendmsg6`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey6 {
    pub cookie: u64,
    pub address: Ipv6Octets,
    pub port: u16,
    pub _pad: [u8; 6],
}

/// Value of `SOCK_REV_NAT6`: as [`SockRevNat`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNat6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub _pad: u16,
    pub rev_nat_id: u32,
}

/// Key of the socket flow map: an unconnected UDP socket (by cookie) and the
/// frontend (by reverse-NAT id) it sends datagrams to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFlowKey {
    pub cookie: u64,
    pub rev_nat_id: u32,
    pub _pad: u32,
}

/// Value of the socket flow map: the backend the socket's datagrams to that
/// frontend go to, as a conntrack entry keeps a UDP 5-tuple on one pod.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFlow {
    /// `bpf_ktime_get_ns()` of the last datagram sent.
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// 1 once a reply came back (recvmsg4 reverse-translated one).
    pub answered: u8,
    pub _pad: [u8; 3],
}

impl SockFlow {
    /// Whether the flow still holds at `now`: for `udp_timeout_secs` after
    /// the last datagram, `udp_stream_timeout_secs` once answered, as
    /// netfilter's UDP timeouts.
    pub const fn is_fresh(&self, cfg: &Config, now: u64) -> bool {
        let secs =
            if self.answered != 0 { cfg.udp_stream_timeout_secs } else { cfg.udp_timeout_secs };
        now.wrapping_sub(self.last_used_ns) <= secs as u64 * 1_000_000_000
    }
}

/// The `bpf_sock_destroy` kfunc call as the BPF object holds it: BPF_JMP |
/// BPF_CALL (0x85), src_reg BPF_PSEUDO_KFUNC_CALL (2), off 0 (vmlinux BTF),
/// and a placeholder immediate the agent replaces with the kfunc's BTF id in
/// the running kernel before loading (aya does not resolve kfunc calls).
pub const SOCK_DESTROY_CALL: u64 = (0x5ec0_de57 << 32) | 0x2085;

/// Key of the socket-ending map: connected sockets the socket LB sent to
/// `address:port` (`proto`) for the frontend `rev_nat_id` must end, the
/// backend having left it; `rev_nat_id` 0 stands for every frontend (the
/// backend left them all). Written by the agent, read by the socket
/// iterators. Of both families: an IPv4 backend's address is v4-mapped
/// (`::ffff:a.b.c.d`), as the map lives only for one run of the iterators.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockEndKey {
    pub address: Ipv6Octets,
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
    pub rev_nat_id: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::with_timeouts as cfg;

    #[test]
    fn socket_flows_live_longer_once_answered() {
        let s = 1_000_000_000u64;
        let flow = SockFlow { last_used_ns: 1_000 * s, ..SockFlow::default() };
        assert!(flow.is_fresh(&cfg(), 1_030 * s));
        assert!(!flow.is_fresh(&cfg(), 1_031 * s), "30 s without a reply");
        let answered = SockFlow { answered: 1, ..flow };
        assert!(answered.is_fresh(&cfg(), 1_120 * s));
        assert!(!answered.is_fresh(&cfg(), 1_121 * s), "120 s once answered");
    }
}
