//! ICMP and ICMPv6 errors about flows translated per packet. A router that cannot
//! deliver a translated packet (too big for its next link with DF set, TTL
//! run out, no route) answers the packet as it was on the wire: the error
//! quotes the translated tuple and goes to the translated source (the node
//! after SNAT, a backend's reply source). Translated back
//! (`proxy_common::icmp`), it reaches the socket that sent the packet, so
//! path-MTU discovery works through NodePorts and ClusterIPs as it does
//! with netfilter's NAT of RELATED errors.
//!
//! The quoted TCP/UDP checksum is left as it was: receivers do not verify
//! it (Linux matches the error to a socket by addresses and ports), and the
//! 8 quoted bytes do not even hold a TCP checksum.

use core::mem::offset_of;

use aya_ebpf::{bindings::BPF_F_PSEUDO_HDR, programs::TcContext};
use network_types::{
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use proxy_common::{
    CtKey, CtKey6, CtTuple, has_ports,
    icmp::{
        DEST_UNREACH, DEST_UNREACH6, ErrorTuple, PACKET_TOO_BIG, TIME_EXCEEDED, TIME_EXCEEDED6,
        flow_key, translate,
    },
};

use crate::{
    conntrack,
    family::Family,
    packet::{self, DPORT, IP_OFF, IPPROTO_ICMPV6, IcmpMessage, IpHeader, SPORT},
};

/// Where the checksum is, the same in ICMP and ICMPv6 headers.
const CSUM: usize = offset_of!(Icmpv4Hdr, check);
const _: () = assert!(offset_of!(Icmpv6Hdr, check) == CSUM);

/// An ICMP error quoting a TCP or UDP packet (`T`: its family's tuple).
pub struct IcmpError<T: CtTuple = CtKey> {
    pub tuple: ErrorTuple<T>,
    icmp_off: usize,
    /// Offsets of the quoted IP header and of its ports.
    ip_off: usize,
    l4_off: usize,
}

impl<T: CtTuple> Default for IcmpError<T> {
    #[inline(always)]
    fn default() -> Self {
        let quoted = T::new(T::Addr::default(), T::Addr::default(), 0, 0, 0);
        let tuple = ErrorTuple { saddr: T::Addr::default(), daddr: T::Addr::default(), quoted };
        IcmpError { tuple, icmp_off: 0, ip_off: 0, l4_off: 0 }
    }
}

/// Reads a destination-unreachable or time-exceeded error and the IP
/// header and ports it quotes; other messages, or errors quoting anything
/// but the first bytes of a TCP, UDP or SCTP packet, are `None`.
#[inline(always)]
pub fn parse(ctx: &TcContext, msg: &IcmpMessage) -> Option<IcmpError> {
    let kind: u8 = ctx.load(msg.icmp_off + offset_of!(Icmpv4Hdr, type_)).ok()?;
    if kind != DEST_UNREACH && kind != TIME_EXCEEDED {
        return None;
    }
    let ip_off = msg.icmp_off + Icmpv4Hdr::LEN;
    let ip: Ipv4Hdr = ctx.load(ip_off).ok()?;
    let ihl = packet::ipv4_len(&ip)?;
    let proto = ip.proto;
    // A later fragment quotes no ports.
    if !has_ports(proto) || ip.frag_offset() != 0 {
        return None;
    }
    let l4_off = ip_off + ihl;
    // Only the first 8 bytes of the quoted L4 header are there: the ports.
    let ports: [[u8; 2]; 2] = ctx.load(l4_off + SPORT).ok()?;
    let quoted = CtKey {
        saddr: ip.src_addr,
        daddr: ip.dst_addr,
        sport: u16::from_be_bytes(ports[0]),
        dport: u16::from_be_bytes(ports[1]),
        proto,
        _pad: [0; 3],
    };
    let tuple = ErrorTuple { saddr: msg.saddr, daddr: msg.daddr, quoted };
    Some(IcmpError { tuple, icmp_off: msg.icmp_off, ip_off, l4_off })
}

/// The ICMPv6 twin of [`parse`], from the IPv6 header on: destination
/// unreachable, packet too big or time exceeded, right after the fixed
/// header, quoting a TCP, UDP or SCTP header right after the quoted fixed header
/// (a quoted extension header, a fragment's among them, is not read). Read
/// into `err` in place (the IPv6 path's structs are not moved about).
#[inline(always)]
pub fn parse6(ctx: &TcContext, err: &mut IcmpError<CtKey6>) -> Option<()> {
    let next: u8 = ctx.load(IP_OFF + offset_of!(Ipv6Hdr, next_hdr)).ok()?;
    if next != IPPROTO_ICMPV6 {
        return None;
    }
    let icmp_off = IP_OFF + Ipv6Hdr::LEN;
    let kind: u8 = ctx.load(icmp_off + offset_of!(Icmpv6Hdr, type_)).ok()?;
    if kind != DEST_UNREACH6 && kind != PACKET_TOO_BIG && kind != TIME_EXCEEDED6 {
        return None;
    }
    let ip_off = icmp_off + Icmpv6Hdr::LEN;
    let first: [u8; 8] = ctx.load(ip_off).ok()?;
    let proto = first[offset_of!(Ipv6Hdr, next_hdr)];
    if first[0] >> 4 != 6 || !has_ports(proto) {
        return None;
    }
    let l4_off = ip_off + Ipv6Hdr::LEN;
    let ports: [[u8; 2]; 2] = ctx.load(l4_off + SPORT).ok()?;
    let quoted = &mut err.tuple.quoted;
    quoted.saddr = ctx.load(ip_off + Ipv6Hdr::SADDR).ok()?;
    quoted.daddr = ctx.load(ip_off + Ipv6Hdr::DADDR).ok()?;
    (quoted.sport, quoted.dport) = (u16::from_be_bytes(ports[0]), u16::from_be_bytes(ports[1]));
    (quoted.proto, quoted._pad) = (proto, [0; 3]);
    err.tuple.saddr = ctx.load(IP_OFF + Ipv6Hdr::SADDR).ok()?;
    err.tuple.daddr = ctx.load(IP_OFF + Ipv6Hdr::DADDR).ok()?;
    (err.icmp_off, err.ip_off, err.l4_off) = (icmp_off, ip_off, l4_off);
    Some(())
}

/// What `err` becomes, if it quotes a packet of a live translated flow. The
/// flow is not refreshed: an error is not the flow's traffic.
#[inline(always)]
pub fn translation<F: Family>(err: &IcmpError<F::Tuple>, now: u64) -> Option<ErrorTuple<F::Tuple>> {
    let rewritten = conntrack::peek::<F>(&flow_key(&err.tuple.quoted), now)?;
    Some(translate(&err.tuple, &rewritten))
}

/// Rewrites the error's addresses, the quoted addresses and ports, and the
/// checksums that cover them. In IPv4, the IP header's checksum takes the
/// change of the outer addresses (ICMP has no pseudo-header), and the
/// quoted header's checksum the change of its addresses, so the bytes of
/// that header keep their ones'-complement sum: the ICMP checksum, which
/// covers them, stays right without an update (whether or not the quoted
/// checksum was right to begin with). IPv6 has no header checksum: the
/// ICMPv6 checksum takes both, the outer addresses through its
/// pseudo-header.
#[inline(always)]
pub fn rewrite<H: IpHeader>(
    ctx: &TcContext,
    err: &IcmpError<H::Tuple>,
    to: &ErrorTuple<H::Tuple>,
) -> Result<(), i64> {
    let (from, csum) = (&err.tuple, err.icmp_off + CSUM);
    let (outer, quoted) = match H::CSUM {
        Some(_) => (None, None),
        None => (Some((csum, BPF_F_PSEUDO_HDR as u64)), Some((csum, 0))),
    };
    packet::set_addrs::<H>(ctx, IP_OFF, &[from.saddr, from.daddr], &[to.saddr, to.daddr], outer)?;
    let (old, new) = (&from.quoted, &to.quoted);
    let addrs = |t: &H::Tuple| [t.saddr(), t.daddr()];
    packet::set_addrs::<H>(ctx, err.ip_off, &addrs(old), &addrs(new), quoted)?;
    set_quoted_port(ctx, csum, err.l4_off + SPORT, old.sport(), new.sport())?;
    set_quoted_port(ctx, csum, err.l4_off + DPORT, old.dport(), new.dport())
}

/// A quoted port: only the ICMP checksum (at `csum`) covers it here (the
/// quoted L4 checksum is left as it was).
#[inline(always)]
fn set_quoted_port(
    ctx: &TcContext,
    csum: usize,
    off: usize,
    old: u16,
    new: u16,
) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (old.to_be(), new.to_be());
    ctx.l4_csum_replace(csum, old as u64, new as u64, 2)?;
    ctx.store(off, &new, 0)
}
