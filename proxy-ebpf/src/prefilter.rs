//! The first question a tc program asks of a packet: could it be ours at
//! all? Answered from the headers in place (direct packet access, no helper
//! call) and one bit of `PREFILTER` per question (an array read the kernel
//! inlines), before any hash map is touched. A packet that cannot be of a
//! frontend, of a per-packet flow's reply, or of a SNAT port goes on
//! untouched; anything the filter cannot tell (IP options, a later fragment,
//! ICMP, headers beyond the linear data) takes the full path. So does every
//! IPv6 packet: the bits stand for IPv4 endpoints only, and an IPv6 packet
//! passed on a bit it has none of would miss its flow.

use core::mem::offset_of;

use aya_ebpf::programs::TcContext;
use network_types::{eth::EthHdr, ip::Ipv4Hdr, udp::UdpHdr};
use proxy_common::{
    Config, IPPROTO_TCP, IPPROTO_UDP,
    prefilter::{self, Kind},
};

use crate::{
    maps::PREFILTER,
    packet::{DPORT, IP_OFF, SPORT},
};

/// Ethernet, a 20-byte IPv4 header and the ports.
const L4_OFF: usize = IP_OFF + Ipv4Hdr::LEN;
const HEADERS: usize = L4_OFF + UdpHdr::LEN;
const IPV4: u16 = 0x0800;
const IPV6: u16 = 0x86dd;
/// Version 4, header length 5 words: no options.
const PLAIN_IPV4: u8 = 0x45;

/// What the filter says of a packet.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Not the datapath's: it goes on untouched.
    Pass,
    /// Maybe the datapath's: the full path decides.
    Inspect,
}

/// Where the program runs: ingress inspects what a frontend, a SNAT port or
/// a flow's reply could be; egress only replies of host-network backends;
/// a pod-facing ingress where the socket LB translates every pod's
/// connections only what comes from a backend (a reply).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Ingress,
    Egress,
    PodReplies,
}

/// Bytes at `off`, in the HEADERS the caller checked are in the linear data
/// (byte arrays: no alignment to assume).
#[inline(always)]
fn read<const N: usize>(ctx: &TcContext, off: usize) -> [u8; N] {
    // SAFETY: within the checked bounds; `[u8; N]` has alignment 1.
    unsafe { *((ctx.data() + off) as *const [u8; N]) }
}

/// Whether `kind`'s bit of this endpoint is set.
#[inline(always)]
fn known(kind: Kind, addr: [u8; 4], port: u16, proto: u8) -> bool {
    let (index, mask) = prefilter::word(prefilter::bit(kind, addr, port, proto));
    // A missing word (never: the array has them all) inspects, as a set bit.
    PREFILTER.get(index).is_none_or(|word| *word & mask != 0)
}

/// The filter's verdict on the packet in `ctx`.
#[inline(always)]
pub fn check(ctx: &TcContext, cfg: &Config, hook: Hook) -> Filter {
    if ctx.data() + HEADERS > ctx.data_end() {
        return Filter::Inspect;
    }
    let ethertype: [u8; 2] = read(ctx, offset_of!(EthHdr, ether_type));
    match u16::from_be_bytes(ethertype) {
        IPV4 => {}
        IPV6 => return Filter::Inspect,
        _ => return Filter::Pass,
    }
    let [vihl] = read(ctx, IP_OFF);
    let [proto] = read(ctx, IP_OFF + offset_of!(Ipv4Hdr, proto));
    // The fragment offset's 13 bits (network order, after three flag bits).
    let frags = u16::from_be_bytes(read(ctx, IP_OFF + offset_of!(Ipv4Hdr, frags)));
    let later_fragment = frags & 0x1fff != 0;
    if vihl != PLAIN_IPV4 || later_fragment {
        return Filter::Inspect;
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        // ICMP errors may quote a flow; anything else is never ours.
        return if proto == crate::packet::IPPROTO_ICMP { Filter::Inspect } else { Filter::Pass };
    }
    let saddr = read(ctx, IP_OFF + offset_of!(Ipv4Hdr, src_addr));
    let sport = u16::from_be_bytes(read(ctx, L4_OFF + SPORT));
    let ours = match hook {
        Hook::Egress => known(Kind::HostBackend, saddr, sport, proto),
        Hook::PodReplies => known(Kind::Backend, saddr, sport, proto),
        Hook::Ingress => {
            let daddr = read(ctx, IP_OFF + offset_of!(Ipv4Hdr, dst_addr));
            let dport = u16::from_be_bytes(read(ctx, L4_OFF + DPORT));
            // Replies of masqueraded flows come back to a SNAT port.
            (daddr == cfg.snat_addr && (cfg.snat_port_min..=cfg.snat_port_max).contains(&dport))
                || known(Kind::Frontend, daddr, dport, proto)
                || known(Kind::Backend, saddr, sport, proto)
        }
    };
    if ours { Filter::Inspect } else { Filter::Pass }
}
