//! IPv4 TCP/UDP packet access for tc programs: parsing, rewriting addresses
//! and ports with incremental checksum updates, and plain checksums for the
//! packets we build (RST, ICMP). ICMP messages are only located here; the
//! errors among them are read by `icmp`.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};
use proxy_common::{
    CtKey, FragKey, FragRewrite, IPPROTO_TCP, IPPROTO_UDP,
    ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

pub const IPPROTO_ICMP: u8 = 1;
/// Where the IP header starts: after the Ethernet header.
pub const IP_OFF: usize = EthHdr::LEN;
/// `Ipv4Hdr::frag_flags`: more fragments follow.
const MORE_FRAGMENTS: u8 = 0b001;

/// An IP header whose addresses the datapath rewrites: where they and the
/// header checksum are, from the header's start. An `Ipv6Hdr` impl (no
/// header checksum, 16-byte addresses) slots in beside this one.
pub trait IpHeader {
    type Addr: Copy + PartialEq;
    const SADDR: usize;
    const DADDR: usize;
    const CSUM: usize;
}

impl IpHeader for Ipv4Hdr {
    type Addr = [u8; 4];
    const SADDR: usize = offset_of!(Ipv4Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv4Hdr, dst_addr);
    const CSUM: usize = offset_of!(Ipv4Hdr, check);
}

/// Where the ports are, the same in TCP and UDP headers: one read and one
/// rewrite serve both.
pub const SPORT: usize = offset_of!(UdpHdr, src);
pub const DPORT: usize = offset_of!(UdpHdr, dst);
const _: () = assert!(offset_of!(TcpHdr, source) == SPORT && offset_of!(TcpHdr, dest) == DPORT);

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
        self.l4_off
            + if self.tuple.proto == IPPROTO_TCP {
                offset_of!(TcpHdr, check)
            } else {
                offset_of!(UdpHdr, check)
            }
    }

    fn l4_flags(&self) -> u64 {
        // A UDP checksum of zero means "none" and must stay zero.
        if self.tuple.proto == IPPROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 }
    }
}

/// The flags conntrack follows, numbered as on the wire (`proxy_common::ct`).
#[inline(always)]
pub fn tcp_flags(tcp: &TcpHdr) -> u8 {
    let bit = |set: u16, flag: u8| if set != 0 { flag } else { 0 };
    bit(tcp.fin(), TCP_FIN)
        | bit(tcp.syn(), TCP_SYN)
        | bit(tcp.rst(), TCP_RST)
        | bit(tcp.ack(), TCP_ACK)
}

/// The header length of `ip`, if it is an IPv4 header. (Taking the header
/// by reference: one returned by value is copied byte by byte.)
#[inline(always)]
pub fn ipv4_len(ip: &Ipv4Hdr) -> Option<usize> {
    let ihl = ip.ihl() as usize;
    (ip.version() == 4 && ihl >= Ipv4Hdr::LEN).then_some(ihl)
}

/// The `T` at `off`: read in place where it lies in the packet's linear
/// data (direct packet access, no helper call: the common case), else
/// copied out with `bpf_skb_load_bytes` (headers beyond the linear part).
#[inline(always)]
pub fn header<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let start = ctx.data() + off;
    if start + core::mem::size_of::<T>() <= ctx.data_end() {
        // SAFETY: within the linear data, as just checked; read unaligned,
        // as headers lie at any offset.
        Some(unsafe { core::ptr::read_unaligned(start as *const T) })
    } else {
        ctx.load(off).ok()
    }
}

/// Reads the ports (and TCP flags) of the TCP or UDP header at `off`.
#[inline(always)]
pub fn load_ports(ctx: &TcContext, off: usize, proto: u8) -> Option<(u16, u16, u8)> {
    // One read per header.
    if proto == IPPROTO_TCP {
        let tcp: TcpHdr = header(ctx, off)?;
        Some((u16::from_be_bytes(tcp.source), u16::from_be_bytes(tcp.dest), tcp_flags(&tcp)))
    } else {
        let udp: UdpHdr = header(ctx, off)?;
        Some((udp.src_port(), udp.dst_port(), 0))
    }
}

/// Parses an Ethernet + IPv4 + TCP/UDP packet or fragment. Anything else
/// (other protocols, IPv6, ARP) is `None` and passes untouched.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Option<Parsed> {
    // One read per header, in place: this runs for every packet the
    // pre-filter could not pass.
    let ethertype: u16 = header(ctx, offset_of!(EthHdr, ether_type))?;
    if ethertype != EtherType::Ipv4 as u16 {
        return None;
    }
    let ip: Ipv4Hdr = header(ctx, IP_OFF)?;
    let ihl = ipv4_len(&ip)?;
    let (saddr, daddr, proto) = (ip.src_addr, ip.dst_addr, ip.proto);
    let more_fragments = ip.frag_flags() & MORE_FRAGMENTS != 0;
    let fragment_offset = ip.frag_offset();
    // ICMP errors are small (RFC 1812: at most 576 bytes), never fragmented.
    if proto == IPPROTO_ICMP && !more_fragments && fragment_offset == 0 {
        return Some(Parsed::Icmp(IcmpMessage { saddr, daddr, icmp_off: IP_OFF + ihl }));
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    let frag_key = FragKey { saddr, daddr, id: ip.id(), proto, _pad: 0 };
    if fragment_offset != 0 {
        return Some(Parsed::Fragment(frag_key));
    }
    let l4_off = IP_OFF + ihl;
    let (sport, dport, tcp_flags) = load_ports(ctx, l4_off, proto)?;
    Some(Parsed::Packet(Packet {
        tuple: CtKey { saddr, daddr, sport, dport, proto, _pad: [0; 3] },
        l4_off,
        tcp_flags,
        plain_ip_header: ihl == Ipv4Hdr::LEN,
        first_fragment: more_fragments.then_some(frag_key),
    }))
}

/// Rewrites one address of the IP header at `ip_off` (`field`: `SADDR` or
/// `DADDR`) and the header's checksum; `l4` is the packet whose L4 checksum
/// covers the address (none for a later fragment, which carries no L4
/// header, or an ICMP message or the header it quotes).
#[inline(always)]
pub fn set_addr<H: IpHeader<Addr = [u8; 4]>>(
    ctx: &TcContext,
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
    ctx.l3_csum_replace(ip_off + H::CSUM, old, new, 4)?;
    ctx.store(ip_off + field, &(new as u32), 0)
}

/// The ones'-complement difference that turns a sum over `old` into one over
/// `new` (both as in memory), folded: what the csum helpers take as a
/// precomputed difference (header field size 0).
#[inline(always)]
fn csum_diff<const N: usize>(old: [u8; N], new: [u8; N]) -> u32 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < N {
        sum += !u16::from_ne_bytes([old[i], old[i + 1]]) as u32;
        sum += u16::from_ne_bytes([new[i], new[i + 1]]) as u32;
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    (sum & 0xffff) + (sum >> 16)
}

/// Both 4-byte values side by side, as they lie in a header.
#[inline(always)]
fn pair(a: [u8; 4], b: [u8; 4]) -> [u8; 8] {
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// Both ports, in network order, as they lie in the L4 header.
#[inline(always)]
fn ports(sport: u16, dport: u16) -> [u8; 4] {
    let (s, d) = (sport.to_be_bytes(), dport.to_be_bytes());
    [s[0], s[1], d[0], d[1]]
}

/// Rewrites the packet's tuple to `to`, keeping the IP and L4 checksums
/// right: the addresses in one store, the ports in another, each checksum
/// updated by one difference computed here (five helper calls, not ten; the
/// ports' difference apart, as an offloaded checksum covers only the
/// pseudo-header's addresses).
#[inline(always)]
pub fn rewrite(ctx: &TcContext, pkt: &Packet, to: &CtKey) -> Result<(), i64> {
    const _: () = assert!(Ipv4Hdr::DADDR == Ipv4Hdr::SADDR + 4 && DPORT == SPORT + 2);
    let from = &pkt.tuple;
    let (old, new) = (pair(from.saddr, from.daddr), pair(to.saddr, to.daddr));
    if old != new {
        let diff = csum_diff(old, new) as u64;
        ctx.l3_csum_replace(IP_OFF + Ipv4Hdr::CSUM, 0, diff, 0)?;
        let flags = BPF_F_PSEUDO_HDR as u64 | pkt.l4_flags();
        ctx.l4_csum_replace(pkt.l4_csum_off(), 0, diff, flags)?;
        ctx.store(IP_OFF + Ipv4Hdr::SADDR, &new, 0)?;
    }
    let (old, new) = (ports(from.sport, from.dport), ports(to.sport, to.dport));
    if old != new {
        let diff = csum_diff(old, new) as u64;
        ctx.l4_csum_replace(pkt.l4_csum_off(), 0, diff, pkt.l4_flags())?;
        ctx.store(pkt.l4_off + SPORT, &new, 0)?;
    }
    Ok(())
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
    set_addr::<Ipv4Hdr>(ctx, None, IP_OFF, Ipv4Hdr::SADDR, from[0], to[0])?;
    set_addr::<Ipv4Hdr>(ctx, None, IP_OFF, Ipv4Hdr::DADDR, from[1], to[1])
}

/// Decrements the TTL of a packet we forward ourselves; false when it ran out.
#[inline(always)]
pub fn decrement_ttl(ctx: &TcContext) -> Result<bool, i64> {
    const TTL: usize = IP_OFF + offset_of!(Ipv4Hdr, ttl);
    let ttl: u8 = ctx.load(TTL)?;
    if ttl <= 1 {
        return Ok(false);
    }
    // TTL is the high byte of the 16-bit word it shares with the protocol.
    const _: () = assert!(offset_of!(Ipv4Hdr, proto) == offset_of!(Ipv4Hdr, ttl) + 1);
    let (old, new) = ((ttl as u16) << 8, ((ttl - 1) as u16) << 8);
    ctx.l3_csum_replace(IP_OFF + Ipv4Hdr::CSUM, old.to_be() as u64, new.to_be() as u64, 2)?;
    ctx.store(TTL, &(ttl - 1), 0)?;
    Ok(true)
}

/// The bytes of a header struct (`repr(C)`, no padding), to checksum it.
#[inline(always)]
pub fn bytes<T>(header: &T) -> &[u8] {
    // SAFETY: the headers are plain byte arrays and bytes, without padding.
    unsafe { core::slice::from_raw_parts((header as *const T).cast(), size_of::<T>()) }
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
