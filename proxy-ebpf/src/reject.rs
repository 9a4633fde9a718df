//! Refusing a new flow to a service without endpoints, as kube-proxy's
//! REJECT does: a TCP RST, or an ICMP (ICMPv6) port unreachable for UDP,
//! sent back out of the interface the packet came in on.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    helpers::generated::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};
use proxy_common::{
    Counter, CtTuple, IPPROTO_TCP,
    ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    icmp::{DEST_UNREACH, DEST_UNREACH6},
};

use crate::{
    family::Family,
    maps::count,
    packet::{self, IP_OFF, IPPROTO_ICMP, IPPROTO_ICMPV6, IpHeader, Packet, TCP_AND_UDP},
    tc_act::SHOT,
};

/// Destination unreachable's code for a closed port.
const PORT_UNREACH: u8 = 3;
/// ICMPv6 destination unreachable's code for a closed port (RFC 4443).
const PORT_UNREACH6: u8 = 4;
const AF_INET6: u8 = 10;

/// What an ICMP error quotes of the offending datagram: its IP header and
/// the first 8 bytes of what follows.
#[repr(C)]
#[derive(Clone, Copy)]
struct Quote {
    ip: Ipv4Hdr,
    l4: [u8; 8],
}

/// The ICMP message of a port unreachable error.
#[repr(C)]
struct PortUnreachable {
    icmp: Icmpv4Hdr,
    quote: Quote,
}

/// The IP and ICMP headers put in front of the quoted datagram.
const NEW_HEADERS: i32 = (Ipv4Hdr::LEN + Icmpv4Hdr::LEN) as i32;

/// What an ICMPv6 error quotes here: the fixed header and the first 8
/// bytes after it (the ports: all a receiver needs to find the socket;
/// RFC 4443 allows quoting less than the 1280-byte maximum). In words: the
/// BPF target copies byte arrays byte by byte, each byte a stack slot.
type Quote6 = [u64; 6];

/// What the ICMPv6 checksum covers besides the quote: the pseudo-header
/// (RFC 8200 8.1) and the ICMPv6 header.
#[repr(C, align(8))]
struct Summed6 {
    src: [u64; 2],
    dst: [u64; 2],
    len: [u8; 4],
    zero: [u8; 3],
    next: u8,
    icmp: Icmpv6Hdr,
}

const NEW_HEADERS6: i32 = (Ipv6Hdr::LEN + Icmpv6Hdr::LEN) as i32;

#[inline(always)]
pub fn refuse<F: Family>(ctx: &TcContext, pkt: &Packet<F::Tuple>) -> i32 {
    // Only plain IP headers: building replies to packets with options is not
    // worth the code; those are dropped.
    if !pkt.plain_ip_header {
        count(Counter::Dropped);
        return SHOT;
    }
    // A step each (`Family::step`): in the IPv6 path, neither's frame adds
    // to the other's.
    let built = if pkt.tuple.proto() == IPPROTO_TCP {
        F::step(
            #[inline(always)]
            || tcp_reset::<F>(ctx, pkt),
        )
    } else if F::AF == AF_INET6 {
        // A BPF call of its own already.
        icmp6_unreachable(ctx)
    } else {
        icmp_unreachable(ctx)
    };
    if built.is_err() {
        count(Counter::Dropped);
        return SHOT;
    }
    count(Counter::Rejected);
    // SAFETY: plain helper call; out of the device the packet came from.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, 0) as i32 }
}

fn swap_macs(ctx: &TcContext) -> Result<(), i64> {
    let eth: EthHdr = ctx.load(0)?;
    const _: () = assert!(offset_of!(EthHdr, dst_addr) == 0 && offset_of!(EthHdr, src_addr) == 6);
    ctx.store(0, &[eth.src_addr, eth.dst_addr], 0)
}

/// Turns the segment into its RST in place. Swapping addresses and ports
/// leaves every checksum valid; the other fields change through the csum
/// helpers, which keep offloaded (partial) checksums right too. Inlined
/// as [`icmp_unreachable`] is.
#[inline(always)]
fn tcp_reset<F: Family>(ctx: &TcContext, pkt: &Packet<F::Tuple>) -> Result<(), i64> {
    if pkt.tcp_flags & TCP_RST != 0 {
        return Err(0);
    }
    let l4 = pkt.l4_off;
    let ip_len: [u8; 2] = ctx.load(IP_OFF + F::LEN_FIELD)?;
    let tcp: TcpHdr = ctx.load(l4)?;
    let header_len = tcp.doff() as usize * 4;
    let payload =
        (u16::from_be_bytes(ip_len) as usize).saturating_sub(F::LEN_BEYOND_L4 + header_len);
    let (seq, ack) = (u32::from_be_bytes(tcp.seq), u32::from_be_bytes(tcp.ack_seq));
    // RFC 9293 3.10.7.1: answer an ACK with seq = its ack; otherwise ack
    // everything the segment occupied.
    let (new_seq, new_ack, new_flags) = if pkt.tcp_flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        let syn_fin = (pkt.tcp_flags & TCP_SYN != 0) as u32 + (pkt.tcp_flags & TCP_FIN != 0) as u32;
        (0, seq.wrapping_add(payload as u32).wrapping_add(syn_fin), TCP_RST | TCP_ACK)
    };
    let csum = l4 + offset_of!(TcpHdr, check);
    let words: [(usize, u32, u32); 2] = [
        (offset_of!(TcpHdr, seq), seq.to_be(), new_seq.to_be()),
        (offset_of!(TcpHdr, ack_seq), ack.to_be(), new_ack.to_be()),
    ];
    for (field, old, new) in words {
        ctx.l4_csum_replace(csum, old as u64, new as u64, 4)?;
        ctx.store(l4 + field, &new, 0)?;
    }
    // The data offset and flags share a 16-bit word: the offset stays, the
    // flags become the RST's (all in its low byte).
    let offset_flags: u16 = ctx.load(l4 + offset_of!(TcpHdr, _bitfield_1))?;
    let new_offset_flags = (u16::from_be(offset_flags) & 0xf000 | new_flags as u16).to_be();
    let window = u16::from_ne_bytes(tcp.window);
    let halves: [(usize, u16, u16); 2] = [
        (offset_of!(TcpHdr, _bitfield_1), offset_flags, new_offset_flags),
        (offset_of!(TcpHdr, window), window, 0),
    ];
    for (field, old, new) in halves {
        ctx.l4_csum_replace(csum, old as u64, new as u64, 2)?;
        ctx.store(l4 + field, &new, 0)?;
    }
    let reversed = pkt.tuple.reversed();
    packet::rewrite::<F, TCP_AND_UDP>(ctx, pkt, &reversed, false)?;
    swap_macs(ctx)
}

/// Prepends an IP and ICMP header to the datagram and trims it to what the
/// ICMP error quotes. Every checksum is computed here from the bytes.
/// Inlined: a call of its own (LLVM's choice once the SCTP program used
/// it too) added its frame to `tc_ingress`'s, past 512 bytes.
#[inline(always)]
fn icmp_unreachable(ctx: &TcContext) -> Result<(), i64> {
    let quote: Quote = ctx.load(IP_OFF)?;
    ctx.adjust_room(NEW_HEADERS, BPF_ADJ_ROOM_MAC, 0)?;
    let icmp_len = size_of::<PortUnreachable>();
    let total = IP_OFF + Ipv4Hdr::LEN + icmp_len;
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, total as u32, 0) } != 0 {
        return Err(0);
    }
    let mut msg = PortUnreachable {
        icmp: Icmpv4Hdr { type_: DEST_UNREACH, code: PORT_UNREACH, check: [0; 2], data: [0; 4] },
        quote,
    };
    msg.icmp.check = packet::csum_fold(packet::csum_add(0, packet::bytes(&msg))).to_be_bytes();

    let mut ip = Ipv4Hdr {
        vihl: 0,
        tos: 0,
        tot_len: ((Ipv4Hdr::LEN + icmp_len) as u16).to_be_bytes(),
        id: [0; 2],
        frags: [0; 2],
        ttl: 64,
        proto: IPPROTO_ICMP,
        check: [0; 2],
        src_addr: quote.ip.dst_addr,
        dst_addr: quote.ip.src_addr,
    };
    ip.set_vihl(4, Ipv4Hdr::LEN as u8);
    ip.check = packet::csum_fold(packet::csum_add(0, packet::bytes(&ip))).to_be_bytes();

    ctx.store(IP_OFF, &ip, 0)?;
    ctx.store(IP_OFF + Ipv4Hdr::LEN, &msg, 0)?;
    swap_macs(ctx)
}

/// The ICMPv6 twin of [`icmp_unreachable`]: its checksum also covers a
/// pseudo-header (addresses, length, next header), and IPv6 has no header
/// checksum. The kernel sums (`bpf_csum_diff`), and the quoted bytes stay
/// where they are, behind the new headers. A BPF call of its own: its
/// buffers and the RST's would not share one frame.
#[inline(never)]
fn icmp6_unreachable(ctx: &TcContext) -> Result<(), i64> {
    let mut quote: Quote6 = ctx.load(IP_OFF)?;
    let quote_sum = csum(quote.as_mut_ptr().cast(), size_of::<Quote6>(), 0)?;
    ctx.adjust_room(NEW_HEADERS6, BPF_ADJ_ROOM_MAC, 0)?;
    let icmp_len = Icmpv6Hdr::LEN + size_of::<Quote6>();
    let total = IP_OFF + Ipv6Hdr::LEN + icmp_len;
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, total as u32, 0) } != 0 {
        return Err(0);
    }
    // The quoted header's words: 1-2 its source, 3-4 its destination.
    const _: () = assert!(Ipv6Hdr::SADDR == 8 && Ipv6Hdr::DADDR == 24);
    let mut summed = Summed6 {
        src: [quote[3], quote[4]],
        dst: [quote[1], quote[2]],
        len: (icmp_len as u32).to_be_bytes(),
        zero: [0; 3],
        next: IPPROTO_ICMPV6,
        icmp: Icmpv6Hdr { type_: DEST_UNREACH6, code: PORT_UNREACH6, check: [0; 2], data: [0; 4] },
    };
    let sum = csum((&mut summed as *mut Summed6).cast(), size_of::<Summed6>(), quote_sum)?;
    // Summed in memory order: the folded sum is stored as it is.
    summed.icmp.check = packet::csum_fold(sum).to_ne_bytes();
    // Version 6, traffic class and flow label 0; the payload length, the
    // next header and the hop limit: the header's first word.
    let len = (icmp_len as u16).to_be_bytes();
    let first = u64::from_ne_bytes([0x60, 0, 0, 0, len[0], len[1], IPPROTO_ICMPV6, 64]);
    let ip: [u64; 5] = [first, summed.src[0], summed.src[1], summed.dst[0], summed.dst[1]];
    ctx.store(IP_OFF, &ip, 0)?;
    ctx.store(IP_OFF + Ipv6Hdr::LEN, &summed.icmp, 0)?;
    swap_macs(ctx)
}

/// The ones'-complement sum of `len` bytes at `data` added to `seed`, by
/// the kernel (unfolded, as the bytes lie in memory).
#[inline(always)]
fn csum(data: *mut u32, len: usize, seed: u32) -> Result<u32, i64> {
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, data, len as u32, seed) };
    if sum < 0 { Err(sum) } else { Ok(sum as u32) }
}
