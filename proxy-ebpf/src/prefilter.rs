//! The first question a tc program asks of a packet: could it be ours at
//! all? Answered from the headers in place (direct packet access, no helper
//! call) and one bit of `PREFILTER` or one reply slot of `PREFILTER_REPLIES`
//! per question (array reads the kernel inlines), before any hash map is
//! touched. A packet that cannot be of a frontend, of a per-packet flow's
//! reply, or of a SNAT port goes on untouched, IPv4 or IPv6; anything the
//! filter cannot tell (IP options, a later fragment, ICMP and ICMPv6,
//! headers beyond the linear data, IPv6 destination options, which may
//! carry a DSR service) takes the full path. An IPv6 packet with other
//! extension headers passes, as the full path passes it.

use core::mem::offset_of;

use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    udp::UdpHdr,
};
use proxy_common::{
    Config, CtTuple, IPPROTO_SCTP,
    dsr::IPPROTO_DSTOPTS,
    has_ports,
    prefilter::{self, Address, Kind},
};

use crate::{
    frame::Frame,
    maps::{PREFILTER, PREFILTER_REPLIES},
    packet::{DPORT, IP_OFF, IPPROTO_ICMP, IPPROTO_ICMPV6, SPORT},
};

/// Ethernet, a 20-byte IPv4 header and the ports.
const L4_OFF: usize = IP_OFF + Ipv4Hdr::LEN;
const HEADERS: usize = L4_OFF + UdpHdr::LEN;
/// Ethernet, the fixed IPv6 header and the ports.
const L4_OFF6: usize = IP_OFF + Ipv6Hdr::LEN;
const HEADERS6: usize = L4_OFF6 + UdpHdr::LEN;
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
/// connections only what comes from a backend (a reply), and SCTP to a
/// frontend (the socket LB never sees SCTP).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Ingress,
    Egress,
    PodReplies,
}

/// Bytes at `off`, in the HEADERS the caller checked are in the linear data
/// (byte arrays: no alignment to assume).
#[inline(always)]
fn read<const N: usize>(ctx: &impl Frame, off: usize) -> [u8; N] {
    // SAFETY: within the checked bounds; `[u8; N]` has alignment 1.
    unsafe { *((ctx.data() + off) as *const [u8; N]) }
}

/// Whether `kind`'s bit of this endpoint is set.
#[inline(always)]
fn known<A: Address>(kind: Kind, addr: A, port: u16, proto: u8) -> bool {
    let (index, mask) = prefilter::word(prefilter::bit(kind, addr, port, proto));
    // A missing word (never: the array has them all) inspects, as a set bit.
    PREFILTER.get(index).is_none_or(|word| *word & mask != 0)
}

/// Whether a packet from this endpoint could be the reply of a per-packet
/// flow not masqueraded: either generation of its slot is set.
#[inline(always)]
fn replied<A: Address>(addr: A, port: u16, proto: u8) -> bool {
    let (index, offset) = prefilter::reply_slot(addr, port, proto);
    let Some(word) = PREFILTER_REPLIES.get_ptr(index) else { return true };
    // SAFETY: a map value of 8 bytes; `offset` is even and at most 6.
    unsafe { *(word.cast::<u8>().add(offset).cast::<u16>()) != 0 }
}

/// Marks the backend a new flow not masqueraded goes to (`xlated`'s
/// destination), in both generations, after its conntrack entries exist:
/// an agent clearing the slot meanwhile reads the entries afterwards and
/// marks the slot again (see the agent's `replies` module).
#[inline(always)]
pub fn mark_reply<T: CtTuple>(xlated: &T)
where
    T::Addr: Address,
{
    let (index, offset) = prefilter::reply_slot(xlated.daddr(), xlated.dport(), xlated.proto());
    if let Some(word) = PREFILTER_REPLIES.get_ptr_mut(index) {
        // SAFETY: as in `replied`; an idempotent store, racing only stores
        // of single bytes (the agent's), which it cannot tear.
        unsafe { *(word.cast::<u8>().add(offset).cast::<u16>()) = prefilter::REPLY_BOTH };
    }
}

/// The endpoints of the packet in `ctx` and where its ports are.
struct Endpoints<A> {
    saddr: A,
    daddr: A,
    l4_off: usize,
    proto: u8,
}

/// The filter's verdict on the packet in `ctx`.
#[inline(always)]
pub fn check(ctx: &impl Frame, cfg: &Config, hook: Hook) -> Filter {
    if ctx.data() + HEADERS > ctx.data_end() {
        return Filter::Inspect;
    }
    let ethertype: [u8; 2] = read(ctx, offset_of!(EthHdr, ether_type));
    match u16::from_be_bytes(ethertype) {
        IPV4 => match endpoints4(ctx) {
            Ok(e) => ports(ctx, &e, hook, cfg.snat_addr, cfg),
            Err(filter) => filter,
        },
        IPV6 => match endpoints6(ctx) {
            Ok(e) => ports(ctx, &e, hook, cfg.snat_addr6, cfg),
            Err(filter) => filter,
        },
        _ => Filter::Pass,
    }
}

/// A plain IPv4 TCP, UDP or SCTP packet's endpoints, or the verdict on another.
#[inline(always)]
fn endpoints4(ctx: &impl Frame) -> Result<Endpoints<[u8; 4]>, Filter> {
    let [vihl] = read(ctx, IP_OFF);
    let [proto] = read(ctx, IP_OFF + offset_of!(Ipv4Hdr, proto));
    // The fragment offset's 13 bits (network order, after three flag bits).
    let frags = u16::from_be_bytes(read(ctx, IP_OFF + offset_of!(Ipv4Hdr, frags)));
    let later_fragment = frags & 0x1fff != 0;
    if vihl != PLAIN_IPV4 || later_fragment {
        return Err(Filter::Inspect);
    }
    if !has_ports(proto) {
        // ICMP errors may quote a flow; anything else is never ours.
        return Err(if proto == IPPROTO_ICMP { Filter::Inspect } else { Filter::Pass });
    }
    Ok(Endpoints {
        saddr: read(ctx, IP_OFF + offset_of!(Ipv4Hdr, src_addr)),
        daddr: read(ctx, IP_OFF + offset_of!(Ipv4Hdr, dst_addr)),
        l4_off: L4_OFF,
        proto,
    })
}

/// An IPv6 packet with TCP, UDP or SCTP right after its fixed header: its
/// endpoints; ICMPv6 (errors may quote a flow) and destination options (a
/// DSR header) are inspected; anything else (other extension headers,
/// fragments) passes, as the full path passes it.
#[inline(always)]
fn endpoints6(ctx: &impl Frame) -> Result<Endpoints<[u8; 16]>, Filter> {
    if ctx.data() + HEADERS6 > ctx.data_end() {
        return Err(Filter::Inspect);
    }
    let [next] = read(ctx, IP_OFF + offset_of!(Ipv6Hdr, next_hdr));
    if !has_ports(next) {
        let maybe_ours = next == IPPROTO_ICMPV6 || next == IPPROTO_DSTOPTS;
        return Err(if maybe_ours { Filter::Inspect } else { Filter::Pass });
    }
    Ok(Endpoints {
        saddr: read(ctx, IP_OFF + offset_of!(Ipv6Hdr, src_addr)),
        daddr: read(ctx, IP_OFF + offset_of!(Ipv6Hdr, dst_addr)),
        l4_off: L4_OFF6,
        proto: next,
    })
}

/// The verdict on a TCP, UDP or SCTP packet between `e`'s endpoints.
#[inline(always)]
fn ports<A: Address + PartialEq>(
    ctx: &impl Frame,
    e: &Endpoints<A>,
    hook: Hook,
    snat_addr: A,
    cfg: &Config,
) -> Filter {
    // Both read before any map lookup: a helper call ends the verifier's
    // knowledge of the packet's bounds.
    let sport = u16::from_be_bytes(read(ctx, e.l4_off + SPORT));
    let dport = u16::from_be_bytes(read(ctx, e.l4_off + DPORT));
    // Replies of masqueraded flows come back to a SNAT port; of the others,
    // from a backend with a flow. Requests to a frontend are asked of their
    // bit before the reply slot, so they pay no more than before it.
    let snat_reply =
        e.daddr == snat_addr && (cfg.snat_port_min..=cfg.snat_port_max).contains(&dport);
    let ours = match hook {
        Hook::Egress => known(Kind::HostBackend, e.saddr, sport, e.proto),
        // No socket hook sees SCTP: a pod's associations to a frontend
        // are translated here.
        Hook::PodReplies => {
            snat_reply
                || replied(e.saddr, sport, e.proto)
                || (e.proto == IPPROTO_SCTP && known(Kind::Frontend, e.daddr, dport, e.proto))
        }
        Hook::Ingress => {
            snat_reply
                || known(Kind::Frontend, e.daddr, dport, e.proto)
                || replied(e.saddr, sport, e.proto)
        }
    };
    if ours { Filter::Inspect } else { Filter::Pass }
}
