//! Direct server return's marks on a packet: the IPv4 option or IPv6
//! destination option naming the service, and the MSS clamp that leaves
//! room for it.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_NET, helpers::generated::bpf_csum_update,
    programs::TcContext,
};
use network_types::{
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
};
use proxy_common::{
    ct::{TCP_ACK, TCP_SYN},
    dsr::{self, DsrHeader6, DsrOption, HDR6_LEN, IPPROTO_DSTOPTS, OPT_LEN},
};

use crate::checksum::{csum_diff, csum_diff_add, csum_replaced, fold_diff};

use super::{IP_OFF, IpHeader, Packet, header};

/// What direct server return does to a packet being forwarded, left by
/// `Family::pend_dsr` for `Family::take_pending_dsr` (`on`: a
/// `dsr::action`; for `dsr::INSERT`, the service is at `address`:`port`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DsrPending<A> {
    pub on: u8,
    pub _pad: u8,
    pub port: u16,
    pub address: A,
}

/// Version 4 and a header of 7 words: the plain 20 bytes and a DSR option.
const IPV4_WITH_DSR: u8 = 0x47;

/// The service the DSR option of an IPv4 packet names (`proxy_common::dsr`):
/// one sent to a backend here by direct server return. Only a header of
/// the plain 20 bytes and that option is read.
#[inline(always)]
pub fn dsr_service(ctx: &TcContext) -> Option<([u8; 4], u16)> {
    if header::<u8>(ctx, IP_OFF)? != IPV4_WITH_DSR {
        return None;
    }
    header::<DsrOption>(ctx, IP_OFF + Ipv4Hdr::LEN)?.service()
}

/// Inserts the DSR option naming `service`:`port` after the plain IPv4
/// header of a packet (already rewritten to its backend): room made by
/// `bpf_skb_adjust_room` at the network layer (which inserts it right
/// after the 20 plain bytes and shrinks a GSO packet's segment size to
/// fit), the header length and total length grown, the header checksum
/// updated by the difference. The L4 checksum is unchanged: its
/// pseudo-header counts the segment, not the IP header. Written in place
/// (the helper leaves the headers in the linear data): a store helper per
/// field would cost about as much as the room itself.
#[inline(always)]
pub fn insert_dsr_option(ctx: &TcContext, service: [u8; 4], port: u16) -> Result<(), i64> {
    const LEN_AT: usize = offset_of!(Ipv4Hdr, tot_len);
    const CHECK_AT: usize = offset_of!(Ipv4Hdr, check);
    let first: [u8; 2] = header(ctx, IP_OFF).ok_or(-1i64)?;
    let len: [u8; 2] = header(ctx, IP_OFF + LEN_AT).ok_or(-1i64)?;
    let new_len = grown(len, OPT_LEN)?;
    ctx.adjust_room(OPT_LEN as i32, BPF_ADJ_ROOM_NET, 0)?;
    let option = DsrOption::new(service, port);
    let new_first = [IPV4_WITH_DSR, first[1]];
    // The option's words join the sum as new words over zero ones.
    let mut sum = csum_diff_add(0, &first, &new_first);
    sum = csum_diff_add(sum, &len, &new_len);
    sum = csum_diff_add(sum, &[0; OPT_LEN as usize], &option.words());
    let ip = ctx.data() + IP_OFF;
    if ip + Ipv4Hdr::LEN + OPT_LEN as usize > ctx.data_end() {
        return Err(-1);
    }
    // SAFETY: within the linear data, as just checked; unaligned stores,
    // as in `rewrite`.
    unsafe {
        core::ptr::write_unaligned(ip as *mut [u8; 2], new_first);
        core::ptr::write_unaligned((ip + LEN_AT) as *mut [u8; 2], new_len);
        core::ptr::write_unaligned((ip + Ipv4Hdr::LEN) as *mut DsrOption, option);
        let at = (ip + CHECK_AT) as *mut u16;
        at.write_unaligned(csum_replaced(at.read_unaligned(), fold_diff(sum)));
    }
    Ok(())
}

/// The service the DSR header of an IPv6 packet names (see [`parse6`]).
#[inline(always)]
pub fn dsr_service6(ctx: &TcContext) -> Option<([u8; 16], u16)> {
    header::<DsrHeader6>(ctx, IP_OFF + Ipv6Hdr::LEN)?.service()
}

/// Inserts the DSR destination-options header naming `service`:`port`
/// after the fixed IPv6 header of a packet of protocol `proto` (already
/// rewritten to its backend), as [`insert_dsr_option`] does for IPv4: the
/// next header and the payload length follow. IPv6 has no header
/// checksum, and the L4 pseudo-header counts neither.
#[inline(always)]
pub fn insert_dsr_header6(
    ctx: &TcContext,
    proto: u8,
    service: [u8; 16],
    port: u16,
) -> Result<(), i64> {
    const LEN_AT: usize = offset_of!(Ipv6Hdr, payload_len);
    let len: [u8; 2] = header(ctx, IP_OFF + LEN_AT).ok_or(-1i64)?;
    let new_len = grown(len, HDR6_LEN)?;
    // The next header shares its word with the hop limit.
    const NEXT_AT: usize = offset_of!(Ipv6Hdr, next_hdr);
    const _: () =
        assert!(offset_of!(Ipv6Hdr, hop_limit) == NEXT_AT + 1 && NEXT_AT.is_multiple_of(2));
    let next: [u8; 2] = header(ctx, IP_OFF + NEXT_AT).ok_or(-1i64)?;
    ctx.adjust_room(HDR6_LEN as i32, BPF_ADJ_ROOM_NET, 0)?;
    let ip = ctx.data() + IP_OFF;
    if ip + Ipv6Hdr::LEN + HDR6_LEN as usize > ctx.data_end() {
        return Err(-1);
    }
    let hdr = DsrHeader6::new(proto, service, port);
    // SAFETY: as in `insert_dsr_option`.
    unsafe {
        *((ip + NEXT_AT) as *mut u8) = IPPROTO_DSTOPTS;
        core::ptr::write_unaligned((ip + LEN_AT) as *mut [u8; 2], new_len);
        core::ptr::write_unaligned((ip + Ipv6Hdr::LEN) as *mut DsrHeader6, hdr);
    }
    // IPv6 has no header checksum to balance the change: a packet whose
    // receive checksum covers it (CHECKSUM_COMPLETE) has it updated.
    let mut sum = csum_diff_add(0, &len, &new_len);
    sum = csum_diff_add(sum, &next, &[IPPROTO_DSTOPTS, next[1]]);
    // SAFETY: a plain 24-byte value, read as bytes.
    let words: [u8; HDR6_LEN as usize] = unsafe { core::mem::transmute(hdr) };
    sum = csum_diff_add(sum, &[0; HDR6_LEN as usize], &words);
    // SAFETY: the program's own skb.
    unsafe { bpf_csum_update(ctx.skb.skb, fold_diff(sum)) };
    Ok(())
}

/// A length field of a packet `by` bytes longer; an error where it would
/// wrap or where it does not count the packet (0: BIG TCP's over 64 KiB).
#[inline(always)]
fn grown(len: [u8; 2], by: u8) -> Result<[u8; 2], i64> {
    match u16::from_be_bytes(len) {
        0 => Err(-1),
        len => len.checked_add(by as u16).map(u16::to_be_bytes).ok_or(-1),
    }
}

/// Lowers the MSS a SYN-ACK announces by `overhead` bytes
/// (`dsr::clamped_mss`), so that the client's full-size segments still fit
/// once the dispatch has added its option. Only an MSS option first among
/// the TCP options is read: where every mainstream stack writes it (Linux
/// always), and one read, not a walk the verifier must bound.
#[inline(always)]
pub fn clamp_mss<H: IpHeader>(
    ctx: &TcContext,
    pkt: &Packet<H::Tuple>,
    overhead: u16,
) -> Result<(), i64> {
    const MSS_KIND: [u8; 2] = [2, 4];
    // A pod's SYN-ACK has a plain header: its options at a constant
    // offset, as direct packet access wants.
    let syn_ack = pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK;
    if !syn_ack || !pkt.plain_ip_header {
        return Ok(());
    }
    let l4_off = IP_OFF + H::PLAIN_LEN;
    let at = l4_off + TcpHdr::LEN;
    let Some([kind, len, hi, lo]) = header::<[u8; 4]>(ctx, at) else { return Ok(()) };
    let Some(mss) = ([kind, len] == MSS_KIND)
        .then(|| dsr::clamped_mss(u16::from_be_bytes([hi, lo]), overhead))
        .flatten()
    else {
        return Ok(());
    };
    // The option lies within the header only if the data offset says so.
    let doff = header::<u8>(ctx, l4_off + 12).ok_or(-1i64)? >> 4;
    if (doff as usize) * 4 < TcpHdr::LEN + 4 {
        return Ok(());
    }
    let (old, new) = ([hi, lo], mss.to_be_bytes());
    ctx.l4_csum_replace(pkt.l4_csum_off(), 0, csum_diff(old, new) as u64, 0)?;
    ctx.store(at + 2, &new, 0)
}
