//! IPv4 TCP/UDP packet access for tc programs: parsing, rewriting addresses
//! and ports with incremental checksum updates, and plain checksums for the
//! packets we build (RST, ICMP). ICMP messages are only located here; the
//! errors among them are read by `icmp`.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{CtKey, FragKey, FragRewrite, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const IPPROTO_ICMP: u8 = 1;
const IP_OFF: usize = ETH_HLEN;

/// IPv4 header fields, from the start of an IPv4 header (the packet's own,
/// or one an ICMP error quotes).
pub mod ipv4 {
    pub const TTL: usize = 8;
    pub const CSUM: usize = 10;
    pub const SADDR: usize = 12;
    pub const DADDR: usize = 16;
    /// Bits of the flags and fragment offset word.
    pub const MORE_FRAGMENTS: u16 = 0x2000;
    pub const FRAGMENT_OFFSET: u16 = 0x1fff;
}

const IP_CSUM_OFF: usize = IP_OFF + ipv4::CSUM;
const IP_SADDR_OFF: usize = IP_OFF + ipv4::SADDR;
const IP_DADDR_OFF: usize = IP_OFF + ipv4::DADDR;
const IP_TTL_OFF: usize = IP_OFF + ipv4::TTL;

/// The fields of one IPv4 TCP or UDP packet the datapath works with.
#[derive(Clone, Copy)]
pub struct Packet {
    pub tuple: CtKey,
    /// Offset of the L4 header.
    pub l4_off: usize,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
    /// The IPv4 header length is 20 (no options).
    pub plain_ip_header: bool,
    /// The first fragment of a fragmented datagram: its later fragments are
    /// known by this key.
    pub first_fragment: Option<FragKey>,
}

/// An unfragmented ICMP message: its IP addresses and where it starts.
#[derive(Clone, Copy)]
pub struct IcmpMessage {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub icmp_off: usize,
}

/// What a tc program sees.
pub enum Parsed {
    /// A TCP or UDP packet, or the first fragment of a datagram.
    Packet(Packet),
    /// A later fragment: IP header only.
    Fragment(FragKey),
    /// An ICMP message (an error may quote a translated flow's packet).
    Icmp(IcmpMessage),
}

impl Packet {
    fn l4_csum_off(&self) -> usize {
        self.l4_off + if self.tuple.proto == IPPROTO_TCP { 16 } else { 6 }
    }

    fn l4_flags(&self) -> u64 {
        // A UDP checksum of zero means "none" and must stay zero.
        if self.tuple.proto == IPPROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 }
    }
}

/// Parses an Ethernet + IPv4 + TCP/UDP packet or fragment. Anything else
/// (other protocols, IPv6, ARP) is `None` and passes untouched.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Option<Parsed> {
    // One load per header: each bpf_skb_load_bytes is a helper call, and
    // this runs for every packet of every watched interface.
    let ethertype: u16 = ctx.load(12).ok()?;
    if u16::from_be(ethertype) != ETH_P_IP {
        return None;
    }
    let ip: [u8; 20] = ctx.load(IP_OFF).ok()?;
    if ip[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    if ihl < 20 {
        return None;
    }
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    let proto = ip[9];
    let saddr = [ip[12], ip[13], ip[14], ip[15]];
    let daddr = [ip[16], ip[17], ip[18], ip[19]];
    // ICMP errors are small (RFC 1812: at most 576 bytes), never fragmented.
    if proto == IPPROTO_ICMP && frag & (ipv4::MORE_FRAGMENTS | ipv4::FRAGMENT_OFFSET) == 0 {
        return Some(Parsed::Icmp(IcmpMessage { saddr, daddr, icmp_off: IP_OFF + ihl }));
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    let id = u16::from_be_bytes([ip[4], ip[5]]);
    let frag_key = FragKey { saddr, daddr, id, proto, _pad: 0 };
    if frag & ipv4::FRAGMENT_OFFSET != 0 {
        return Some(Parsed::Fragment(frag_key));
    }
    let l4_off = IP_OFF + ihl;
    let ports: [u8; 4] = ctx.load(l4_off).ok()?;
    let tcp_flags = if proto == IPPROTO_TCP { ctx.load::<u8>(l4_off + 13).ok()? } else { 0 };
    Some(Parsed::Packet(Packet {
        tuple: CtKey {
            saddr,
            daddr,
            sport: u16::from_be_bytes([ports[0], ports[1]]),
            dport: u16::from_be_bytes([ports[2], ports[3]]),
            proto,
            _pad: [0; 3],
        },
        l4_off,
        tcp_flags,
        plain_ip_header: ihl == 20,
        first_fragment: (frag & ipv4::MORE_FRAGMENTS != 0).then_some(frag_key),
    }))
}

/// Rewrites one IP address; `l4` is the packet whose L4 checksum covers it
/// (none for a later fragment, which carries no L4 header).
fn set_addr(
    ctx: &TcContext,
    l4: Option<&Packet>,
    off: usize,
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
    ctx.l3_csum_replace(IP_CSUM_OFF, old, new, 4)?;
    ctx.store(off, &(new as u32), 0)
}

fn set_port(ctx: &TcContext, pkt: &Packet, off: usize, old: u16, new: u16) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let (old, new) = (old.to_be(), new.to_be());
    ctx.l4_csum_replace(pkt.l4_csum_off(), old as u64, new as u64, pkt.l4_flags() | 2)?;
    ctx.store(off, &new, 0)
}

/// Rewrites the packet's tuple to `to`, keeping the IP and L4 checksums right.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, pkt: &Packet, to: &CtKey) -> Result<(), i64> {
    let from = &pkt.tuple;
    set_addr(ctx, Some(pkt), IP_SADDR_OFF, from.saddr, to.saddr)?;
    set_addr(ctx, Some(pkt), IP_DADDR_OFF, from.daddr, to.daddr)?;
    set_port(ctx, pkt, pkt.l4_off, from.sport, to.sport)?;
    set_port(ctx, pkt, pkt.l4_off + 2, from.dport, to.dport)
}

/// Rewrites the addresses of a later fragment (IP header only).
#[inline(always)]
pub fn rewrite_fragment(ctx: &TcContext, from: &FragKey, to: &FragRewrite) -> Result<(), i64> {
    rewrite_addrs(ctx, [from.saddr, from.daddr], [to.saddr, to.daddr])
}

/// Rewrites source and destination of a packet whose L4 checksum does not
/// cover them (a later fragment, an ICMP message): the IP header only.
#[inline(always)]
pub fn rewrite_addrs(ctx: &TcContext, from: [[u8; 4]; 2], to: [[u8; 4]; 2]) -> Result<(), i64> {
    set_addr(ctx, None, IP_SADDR_OFF, from[0], to[0])?;
    set_addr(ctx, None, IP_DADDR_OFF, from[1], to[1])
}

/// Decrements the TTL of a packet we forward ourselves; false when it ran out.
#[inline(always)]
pub fn decrement_ttl(ctx: &TcContext) -> Result<bool, i64> {
    let ttl: u8 = ctx.load(IP_TTL_OFF)?;
    if ttl <= 1 {
        return Ok(false);
    }
    // TTL is the high byte of the 16-bit word it shares with the protocol.
    let (old, new) = ((ttl as u16) << 8, ((ttl - 1) as u16) << 8);
    ctx.l3_csum_replace(IP_CSUM_OFF, old.to_be() as u64, new.to_be() as u64, 2)?;
    ctx.store(IP_TTL_OFF, &(ttl - 1), 0)?;
    Ok(true)
}

/// Ones'-complement sum of `bytes` (big-endian 16-bit words) added to `sum`.
#[inline(always)]
pub fn csum_add(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    if i < bytes.len() {
        sum += (bytes[i] as u32) << 8;
    }
    sum
}

/// Folds a ones'-complement sum into the checksum field value.
#[inline(always)]
pub fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}
