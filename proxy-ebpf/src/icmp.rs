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

use aya_ebpf::programs::TcContext;
use proxy_common::{
    CtKey, IPPROTO_TCP, IPPROTO_UDP,
    icmp::{DEST_UNREACH, ErrorTuple, TIME_EXCEEDED, flow_key, translate},
};

use crate::{
    conntrack,
    packet::{
        self, IcmpMessage,
        ipv4::{
            CSUM as IP_CSUM_OFF, DADDR as IP_DADDR_OFF, FRAGMENT_OFFSET as IP_FRAGMENT_OFFSET,
            SADDR as IP_SADDR_OFF,
        },
    },
};

const ICMP_CSUM_OFF: usize = 2;
const ICMP_HLEN: usize = 8;

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
    let kind: u8 = ctx.load(msg.icmp_off).ok()?;
    if kind != DEST_UNREACH && kind != TIME_EXCEEDED {
        return None;
    }
    let ip_off = msg.icmp_off + ICMP_HLEN;
    let ip: [u8; 20] = ctx.load(ip_off).ok()?;
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    let proto = ip[9];
    let offset = u16::from_be_bytes([ip[6], ip[7]]) & IP_FRAGMENT_OFFSET;
    // A later fragment quotes no ports.
    if ip[0] >> 4 != 4 || ihl < 20 || (proto != IPPROTO_TCP && proto != IPPROTO_UDP) || offset != 0
    {
        return None;
    }
    let l4_off = ip_off + ihl;
    let ports: [u8; 4] = ctx.load(l4_off).ok()?;
    let quoted = CtKey {
        saddr: [ip[12], ip[13], ip[14], ip[15]],
        daddr: [ip[16], ip[17], ip[18], ip[19]],
        sport: u16::from_be_bytes([ports[0], ports[1]]),
        dport: u16::from_be_bytes([ports[2], ports[3]]),
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
/// IP and ICMP checksums that cover them.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, err: &IcmpError, to: &ErrorTuple) -> Result<(), i64> {
    let from = &err.tuple;
    packet::rewrite_addrs(ctx, [from.saddr, from.daddr], [to.saddr, to.daddr])?;
    let (old, new) = (&from.quoted, &to.quoted);
    set_quoted_addr(ctx, err, IP_SADDR_OFF, old.saddr, new.saddr)?;
    set_quoted_addr(ctx, err, IP_DADDR_OFF, old.daddr, new.daddr)?;
    set_quoted_port(ctx, err, err.l4_off, old.sport, new.sport)?;
    set_quoted_port(ctx, err, err.l4_off + 2, old.dport, new.dport)
}

/// The quoted header's checksum takes the change, so the bytes of that
/// header keep their ones'-complement sum: the ICMP checksum, which covers
/// them, stays right without an update (whether or not the quoted checksum
/// was right to begin with).
fn set_quoted_addr(
    ctx: &TcContext,
    err: &IcmpError,
    field: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (u32::from_ne_bytes(old), u32::from_ne_bytes(new));
    ctx.l3_csum_replace(err.ip_off + IP_CSUM_OFF, old as u64, new as u64, 4)?;
    ctx.store(err.ip_off + field, &new, 0)
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
    ctx.l4_csum_replace(err.icmp_off + ICMP_CSUM_OFF, old as u64, new as u64, 2)?;
    ctx.store(off, &new, 0)
}
