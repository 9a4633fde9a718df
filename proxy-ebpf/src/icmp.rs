//! ICMP errors about flows translated per packet. A router that cannot
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

use aya_ebpf::programs::TcContext;
use network_types::{icmp::Icmpv4Hdr, ip::Ipv4Hdr};
use proxy_common::{
    CtKey, IPPROTO_TCP, IPPROTO_UDP,
    icmp::{DEST_UNREACH, ErrorTuple, TIME_EXCEEDED, flow_key, translate},
};

use crate::{
    conntrack,
    packet::{self, DPORT, IcmpMessage, IpHeader, SPORT},
};

/// An ICMP error quoting a TCP or UDP packet.
pub struct IcmpError {
    pub tuple: ErrorTuple,
    icmp_off: usize,
    /// Offsets of the quoted IP header and of its ports.
    ip_off: usize,
    l4_off: usize,
}

/// Reads a destination-unreachable or time-exceeded error and the IP
/// header and ports it quotes; other messages, or errors quoting anything
/// but the first bytes of a TCP or UDP packet, are `None`.
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
    if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) || ip.frag_offset() != 0 {
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

/// What `err` becomes, if it quotes a packet of a live translated flow. The
/// flow is not refreshed: an error is not the flow's traffic.
#[inline(always)]
pub fn translation(err: &IcmpError, now: u64) -> Option<ErrorTuple> {
    let rewritten = conntrack::peek(&flow_key(&err.tuple.quoted), now)?;
    Some(translate(&err.tuple, &rewritten))
}

/// Rewrites the error's addresses, the quoted addresses and ports, and the
/// IP and ICMP checksums that cover them. The quoted header's checksum
/// takes the change of its addresses, so the bytes of that header keep
/// their ones'-complement sum: the ICMP checksum, which covers them, stays
/// right without an update (whether or not the quoted checksum was right
/// to begin with).
#[inline(always)]
pub fn rewrite(ctx: &TcContext, err: &IcmpError, to: &ErrorTuple) -> Result<(), i64> {
    let from = &err.tuple;
    packet::rewrite_addrs(ctx, [from.saddr, from.daddr], [to.saddr, to.daddr])?;
    let (old, new) = (&from.quoted, &to.quoted);
    let quoted_addr =
        |field, old, new| packet::set_addr::<Ipv4Hdr>(ctx, None, err.ip_off, field, old, new);
    quoted_addr(Ipv4Hdr::SADDR, old.saddr, new.saddr)?;
    quoted_addr(Ipv4Hdr::DADDR, old.daddr, new.daddr)?;
    set_quoted_port(ctx, err, err.l4_off + SPORT, old.sport, new.sport)?;
    set_quoted_port(ctx, err, err.l4_off + DPORT, old.dport, new.dport)
}

/// A quoted port: only the ICMP checksum covers it here (ICMP has no
/// pseudo-header).
fn set_quoted_port(
    ctx: &TcContext,
    err: &IcmpError,
    off: usize,
    old: u16,
    new: u16,
) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (old.to_be(), new.to_be());
    let csum = err.icmp_off + offset_of!(Icmpv4Hdr, check);
    ctx.l4_csum_replace(csum, old as u64, new as u64, 2)?;
    ctx.store(off, &new, 0)
}
