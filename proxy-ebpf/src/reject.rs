//! Refusing a new flow to a service without endpoints, as kube-proxy's
//! REJECT does: a TCP RST, or an ICMP port unreachable for UDP, sent back
//! out of the interface the packet came in on.

use aya_ebpf::{
    bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    helpers::generated::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{
    Counter, IPPROTO_TCP,
    ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

use crate::{
    maps::count,
    packet::{self, ETH_HLEN, IPPROTO_ICMP, Packet},
    tc_act::SHOT,
};

const IP_OFF: usize = ETH_HLEN;
/// What an ICMP error quotes of the offending datagram: its IP header and 8 bytes.
const QUOTE_LEN: usize = 28;
const ICMP_LEN: usize = 8 + QUOTE_LEN;
/// The IP and ICMP headers put in front of the quoted datagram.
const NEW_HEADERS: i32 = 20 + 8;

#[inline(always)]
pub fn refuse(ctx: &TcContext, pkt: &Packet) -> i32 {
    // Only plain IP headers: building replies to packets with options is not
    // worth the code; those are dropped.
    if !pkt.plain_ip_header {
        count(Counter::Dropped);
        return SHOT;
    }
    let built =
        if pkt.tuple.proto == IPPROTO_TCP { tcp_reset(ctx, pkt) } else { icmp_unreachable(ctx) };
    if built.is_err() {
        count(Counter::Dropped);
        return SHOT;
    }
    count(Counter::Rejected);
    // SAFETY: plain helper call; out of the device the packet came from.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, 0) as i32 }
}

fn swap_macs(ctx: &TcContext) -> Result<(), i64> {
    let macs: [[u8; 6]; 2] = ctx.load(0)?;
    ctx.store(0, &[macs[1], macs[0]], 0)
}

/// Turns the segment into its RST in place. Swapping addresses and ports
/// leaves every checksum valid; the other fields change through the csum
/// helpers, which keep offloaded (partial) checksums right too.
fn tcp_reset(ctx: &TcContext, pkt: &Packet) -> Result<(), i64> {
    if pkt.tcp_flags & TCP_RST != 0 {
        return Err(0);
    }
    let l4 = pkt.l4_off;
    let tot_len: u16 = u16::from_be(ctx.load(IP_OFF + 2)?);
    let offset_flags: u16 = u16::from_be(ctx.load(l4 + 12)?);
    let header_len = ((offset_flags >> 12) as usize) * 4;
    let payload = (tot_len as usize).saturating_sub(20 + header_len) as u32;
    let seq = u32::from_be(ctx.load(l4 + 4)?);
    let ack = u32::from_be(ctx.load(l4 + 8)?);
    // RFC 9293 3.10.7.1: answer an ACK with seq = its ack; otherwise ack
    // everything the segment occupied.
    let (new_seq, new_ack, new_flags) = if pkt.tcp_flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        let syn_fin = (pkt.tcp_flags & TCP_SYN != 0) as u32 + (pkt.tcp_flags & TCP_FIN != 0) as u32;
        (0, seq.wrapping_add(payload).wrapping_add(syn_fin), TCP_RST | TCP_ACK)
    };
    let csum = l4 + 16;
    let words: [(usize, u32, u32, u64); 2] =
        [(l4 + 4, seq.to_be(), new_seq.to_be(), 4), (l4 + 8, ack.to_be(), new_ack.to_be(), 4)];
    for (off, old, new, size) in words {
        ctx.l4_csum_replace(csum, old as u64, new as u64, size)?;
        ctx.store(off, &new, 0)?;
    }
    let new_offset_flags = (offset_flags & 0xf000) | new_flags as u16;
    let window: u16 = ctx.load(l4 + 14)?;
    let halves: [(usize, u16, u16); 2] =
        [(l4 + 12, offset_flags.to_be(), new_offset_flags.to_be()), (l4 + 14, window, 0)];
    for (off, old, new) in halves {
        ctx.l4_csum_replace(csum, old as u64, new as u64, 2)?;
        ctx.store(off, &new, 0)?;
    }
    let reversed = pkt.tuple.reversed();
    packet::rewrite(ctx, pkt, &reversed)?;
    swap_macs(ctx)
}

/// Prepends an IP and ICMP header to the datagram and trims it to what the
/// ICMP error quotes. Every checksum is computed here from the bytes.
fn icmp_unreachable(ctx: &TcContext) -> Result<(), i64> {
    let quote: [u8; QUOTE_LEN] = ctx.load(IP_OFF)?;
    ctx.adjust_room(NEW_HEADERS, BPF_ADJ_ROOM_MAC, 0)?;
    let total = ETH_HLEN + 20 + ICMP_LEN;
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, total as u32, 0) } != 0 {
        return Err(0);
    }
    let mut icmp = [0u8; ICMP_LEN];
    icmp[0] = 3; // destination unreachable
    icmp[1] = 3; // port unreachable
    icmp[8..].copy_from_slice(&quote);
    let sum = packet::csum_fold(packet::csum_add(0, &icmp)).to_be_bytes();
    icmp[2] = sum[0];
    icmp[3] = sum[1];

    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + ICMP_LEN) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = IPPROTO_ICMP;
    ip[12..16].copy_from_slice(&quote[16..20]);
    ip[16..20].copy_from_slice(&quote[12..16]);
    let sum = packet::csum_fold(packet::csum_add(0, &ip)).to_be_bytes();
    ip[10] = sum[0];
    ip[11] = sum[1];

    ctx.store(IP_OFF, &ip, 0)?;
    ctx.store(IP_OFF + 20, &icmp, 0)?;
    swap_macs(ctx)
}
