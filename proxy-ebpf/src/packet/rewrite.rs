//! Rewriting a packet's addresses and ports (and a later fragment's, an
//! ICMP message's quoted header, the TTL and the MACs), with incremental
//! checksum updates.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    helpers::generated::bpf_csum_diff,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{CtTuple, FragKey, FragRewrite, sctp};

use crate::{
    checksum::{csum_diff, csum_diff_add, csum_replaced, fold_diff},
    frame::Frame,
};

use super::{DPORT, IP_OFF, IpHeader, Packet, SPORT, header};

/// Rewrites one address of the IP header at `ip_off` (`field`: `SADDR` or
/// `DADDR`) and the header's checksum; `l4` is the packet whose L4 checksum
/// covers the address (none for a later fragment, which carries no L4
/// header, or an ICMP message or the header it quotes).
#[inline(always)]
fn set_addr<H: IpHeader<Addr = [u8; 4]>>(
    ctx: &impl Frame,
    l4: Option<&Packet>,
    ip_off: usize,
    field: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (u32::from_ne_bytes(old) as u64, u32::from_ne_bytes(new) as u64);
    if let Some(pkt) = l4 {
        let flags = BPF_F_PSEUDO_HDR as u64 | pkt.l4_flags() | 4;
        ctx.l4_csum_replace(pkt.l4_csum_off(), old, new, flags)?;
    }
    if let Some(csum) = H::CSUM {
        ctx.l3_csum_replace(ip_off + csum, old, new, 4)?;
    }
    ctx.store(ip_off + field, &(new as u32), 0)
}

/// Both ports, in network order, as they lie in the L4 header.
#[inline(always)]
fn ports(sport: u16, dport: u16) -> [u8; 4] {
    let (s, d) = (sport.to_be_bytes(), dport.to_be_bytes());
    [s[0], s[1], d[0], d[1]]
}

/// The folded ones'-complement difference from the addresses `old` to
/// `new` (both side by side, as in the header): what each checksum covering
/// them changes by.
#[inline(always)]
fn addrs_diff<H: IpHeader>(old: &[H::Addr; 2], new: &[H::Addr; 2]) -> Result<u32, i64> {
    if H::CSUM.is_some() {
        let sum = csum_diff_add(0, old[0].as_ref(), new[0].as_ref());
        return Ok(fold_diff(csum_diff_add(sum, old[1].as_ref(), new[1].as_ref())));
    }
    // IPv6: the kernel sums the 32 bytes where they lie (in a tuple, not
    // copied); done here, byte by byte, they would fill the stack with
    // spilled bytes.
    let size = size_of::<[H::Addr; 2]>() as u32;
    let (old, new) = (old.as_ptr().cast_mut().cast(), new.as_ptr().cast_mut().cast());
    // SAFETY: the helper only reads the `size` bytes of each.
    let diff = unsafe { bpf_csum_diff(old, size, new, size, 0) };
    if diff < 0 { Err(diff) } else { Ok(diff as u32) }
}

/// Rewrites both addresses of the IP header at `ip_off` (side by side, one
/// store) and the checksums covering them, each by one difference computed
/// here: the header's own (IPv4), and `l4`, the checksum at that offset
/// with its `l4_csum_replace` flags (`BPF_F_PSEUDO_HDR` where it covers them
/// through a pseudo-header), if one covers them (else [`unbalanced`]).
#[inline(always)]
pub fn set_addrs<H: IpHeader>(
    ctx: &impl Frame,
    ip_off: usize,
    old: &[H::Addr; 2],
    new: &[H::Addr; 2],
    l4: Option<(usize, u64)>,
) -> Result<(), i64> {
    const { assert!(H::DADDR == H::SADDR + size_of::<H::Addr>()) };
    if old == new {
        return Ok(());
    }
    let diff = addrs_diff::<H>(old, new)?;
    if let Some(csum) = H::CSUM {
        ctx.l3_csum_replace(ip_off + csum, 0, diff as u64, 0)?;
    }
    match l4 {
        Some((csum, flags)) => ctx.l4_csum_replace(csum, 0, diff as u64, flags)?,
        None => unbalanced::<H>(ctx, diff),
    }
    // Both addresses, side by side as in the header.
    ctx.store(ip_off + H::SADDR, new, 0)
}

/// Rewrites the packet's tuple to `to`, keeping the IP and L4 checksums
/// right, and with `hop` decrements its TTL (hop limit): `false`, nothing
/// rewritten, when that ran out. Headers in the linear data (nearly always)
/// are written in place: the addresses, the ports, the TTL and the IPv4
/// header checksum (its one update covering all of them: never offloaded,
/// and a header whose sum stays the same keeps a `CHECKSUM_COMPLETE`
/// skb's sum right); the L4 checksum by `l4_csum_replace` alone, which
/// knows how the skb's is kept (partial, complete, none): one call for the
/// addresses (through the pseudo-header), one for the ports (an offloaded
/// checksum covers only the pseudo-header). SCTP's ports go with their
/// CRC ([`set_sctp_ports`]). Other packets (IPv4 options, headers beyond
/// the linear data) take [`rewrite_by_helpers`].
#[inline(always)]
pub fn rewrite<H: IpHeader, const SCTP: bool>(
    ctx: &impl Frame,
    pkt: &Packet<H::Tuple>,
    to: &H::Tuple,
    hop: bool,
) -> Result<bool, i64> {
    const { assert!(DPORT == SPORT + 2) };
    let l4_off = IP_OFF + H::PLAIN_LEN;
    let data = ctx.data();
    if !pkt.plain_ip_header || data + l4_off + DPORT + 2 > ctx.data_end() {
        if hop && !decrement_ttl::<H>(ctx)? {
            return Ok(false);
        }
        rewrite_by_helpers::<H, SCTP>(ctx, pkt, to)?;
        return Ok(true);
    }
    let from = &pkt.tuple;
    let ip = data + IP_OFF;
    // SAFETY: within the linear data, as checked above.
    let ttl = unsafe { *((ip + H::HOPS) as *const u8) };
    if hop && ttl <= 1 {
        return Ok(false);
    }
    let (old, new) = (H::addrs(from), H::addrs(to));
    let addrs_changed = old != new;
    let addrs = if addrs_changed { addrs_diff::<H>(old, new)? } else { 0 };
    let (old_ports, new_ports) = (ports(from.sport(), from.dport()), ports(to.sport(), to.dport()));
    // SAFETY (the stores and the checksum's read): within the linear data,
    // as checked above; a tc program may write it (the kernel unclones the
    // skb first in the prologue of programs that do).
    unsafe {
        if addrs_changed {
            H::store_addrs(ip + H::SADDR, to);
        }
        // SCTP's go with their checksum, below.
        if old_ports != new_ports && !SCTP {
            *((data + l4_off + SPORT) as *mut [u8; 4]) = new_ports;
        }
        if hop {
            *((ip + H::HOPS) as *mut u8) = ttl - 1;
        }
        if let Some(csum) = H::CSUM {
            // The TTL is the high byte of the 16-bit word it shares with
            // the protocol.
            const _: () = assert!(offset_of!(Ipv4Hdr, proto) == offset_of!(Ipv4Hdr, ttl) + 1);
            let proto = *((ip + H::HOPS + 1) as *const u8);
            let hops = if hop { csum_diff([ttl, proto], [ttl - 1, proto]) } else { 0 };
            let at = (ip + csum) as *mut u16;
            *at = csum_replaced(*at, addrs + hops);
        }
    }
    if SCTP {
        unbalanced::<H>(ctx, addrs);
        set_sctp_ports::<H>(ctx, l4_off, new_ports)?;
        return Ok(true);
    }
    let (csum, flags) = (pkt.l4_csum_off(), pkt.l4_flags());
    if addrs_changed {
        ctx.l4_csum_replace(csum, 0, addrs as u64, BPF_F_PSEUDO_HDR as u64 | flags)?;
    }
    if old_ports != new_ports {
        ctx.l4_csum_replace(csum, 0, csum_diff(old_ports, new_ports) as u64, flags)?;
    }
    Ok(true)
}

/// Keeps the receive checksum of a packet whose header changed by `diff`
/// with no checksum to balance it (an IPv6 header under SCTP, whose CRC
/// counts no address) right where it covers the header
/// (`CHECKSUM_COMPLETE`); IPv4's header checksum balances its own change.
#[inline(always)]
fn unbalanced<H: IpHeader>(ctx: &impl Frame, diff: u32) {
    if H::CSUM.is_none() && diff != 0 {
        ctx.csum_update(diff);
    }
}

/// Writes `ports` into the SCTP header at `l4_off` with the checksum they
/// make (`sctp::checksum_after_ports`), over the packet's length as its IP
/// header counts it (a frame may carry padding past it). One store of the
/// common header, which keeps a receive checksum covering it right. A
/// packet of a GSO batch, or one whose CRC the sender left to the device
/// (`CHECKSUM_PARTIAL`), has its CRC computed on its way out whatever the
/// field holds.
#[inline(always)]
fn set_sctp_ports<H: IpHeader>(ctx: &impl Frame, l4_off: usize, ports: [u8; 4]) -> Result<(), i64> {
    // By the helper: `l4_off` is a packet's (IPv6: a map value the verifier
    // knows no bounds of), no constant.
    let mut common: [u8; sctp::HEADER_LEN] = ctx.load(l4_off)?;
    let old = [common[0], common[1], common[2], common[3]];
    if old == ports {
        return Ok(());
    }
    let len: [u8; 2] = header(ctx, IP_OFF + H::LEN_FIELD).ok_or(-1i64)?;
    // The length field counts from the IP header (IPv4) or past its fixed
    // part (IPv6): the SCTP packet is what lies past `l4_off`.
    let counted_from = IP_OFF + H::PLAIN_LEN - H::LEN_BEYOND_L4;
    let len = u16::from_be_bytes(len).wrapping_sub((l4_off - counted_from) as u16);
    let at = sctp::CHECKSUM;
    let checksum = [common[at], common[at + 1], common[at + 2], common[at + 3]];
    let checksum = sctp::checksum_after_ports(checksum, old, ports, len);
    common[..4].copy_from_slice(&ports);
    common[at..at + 4].copy_from_slice(&checksum);
    ctx.store(l4_off, &common, BPF_F_RECOMPUTE_CSUM as u64)
}

/// [`rewrite`] through helper calls, for headers it cannot write in place:
/// the addresses in one store, the ports in another, each checksum updated
/// by one difference computed here.
#[inline(always)]
fn rewrite_by_helpers<H: IpHeader, const SCTP: bool>(
    ctx: &impl Frame,
    pkt: &Packet<H::Tuple>,
    to: &H::Tuple,
) -> Result<(), i64> {
    let from = &pkt.tuple;
    // SCTP's checksum counts no address.
    let l4 = (!SCTP).then(|| (pkt.l4_csum_off(), BPF_F_PSEUDO_HDR as u64 | pkt.l4_flags()));
    set_addrs::<H>(ctx, IP_OFF, H::addrs(from), H::addrs(to), l4)?;
    let (old, new) = (ports(from.sport(), from.dport()), ports(to.sport(), to.dport()));
    if SCTP {
        return set_sctp_ports::<H>(ctx, pkt.l4_off, new);
    }
    if old != new {
        let diff = csum_diff(old, new) as u64;
        ctx.l4_csum_replace(pkt.l4_csum_off(), 0, diff, pkt.l4_flags())?;
        ctx.store(pkt.l4_off + SPORT, &new, 0)?;
    }
    Ok(())
}

/// Rewrites the addresses of a later fragment (IP header only).
#[inline(always)]
pub fn rewrite_fragment(ctx: &impl Frame, from: &FragKey, to: &FragRewrite) -> Result<(), i64> {
    rewrite_addrs(ctx, [from.saddr, from.daddr], [to.saddr, to.daddr])
}

/// Rewrites source and destination of a packet whose L4 checksum does not
/// cover them (a later fragment): the IP header only.
#[inline(always)]
fn rewrite_addrs(ctx: &impl Frame, from: [[u8; 4]; 2], to: [[u8; 4]; 2]) -> Result<(), i64> {
    set_addr::<Ipv4Hdr>(ctx, None, IP_OFF, Ipv4Hdr::SADDR, from[0], to[0])?;
    set_addr::<Ipv4Hdr>(ctx, None, IP_OFF, Ipv4Hdr::DADDR, from[1], to[1])
}

/// Decrements the TTL (hop limit) of a packet we forward ourselves; false
/// when it ran out.
#[inline(always)]
pub fn decrement_ttl<H: IpHeader>(ctx: &impl Frame) -> Result<bool, i64> {
    let hops_at = IP_OFF + H::HOPS;
    let ttl: u8 = ctx.load(hops_at)?;
    if ttl <= 1 {
        return Ok(false);
    }
    if let Some(csum) = H::CSUM {
        // TTL is the high byte of the 16-bit word it shares with the protocol.
        const _: () = assert!(offset_of!(Ipv4Hdr, proto) == offset_of!(Ipv4Hdr, ttl) + 1);
        let (old, new) = ((ttl as u16) << 8, ((ttl - 1) as u16) << 8);
        ctx.l3_csum_replace(IP_OFF + csum, old.to_be() as u64, new.to_be() as u64, 2)?;
    }
    ctx.store(hops_at, &(ttl - 1), 0)?;
    Ok(true)
}

/// Writes the Ethernet header's destination and source MAC addresses.
#[inline(always)]
pub fn set_macs(ctx: &impl Frame, macs: &[[u8; 6]; 2]) -> Result<(), i64> {
    let data = ctx.data();
    if data + size_of::<[[u8; 6]; 2]>() > ctx.data_end() {
        return ctx.store(0, macs, 0);
    }
    // SAFETY: within the linear data, as just checked (see `rewrite`).
    unsafe { *(data as *mut [[u8; 6]; 2]) = *macs };
    Ok(())
}
