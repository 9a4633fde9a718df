//! IPv4 and IPv6 TCP/UDP/SCTP packet access for tc programs: parsing,
//! rewriting addresses and ports with incremental checksum updates (SCTP's
//! CRC32c by `proxy_common::sctp`), and plain checksums for the packets we
//! build (RST, ICMP). ICMP messages are only located here; the errors among
//! them are read by `icmp`. Parsing is here; [`rewrite`], [`dsr_option`]
//! and [`checksum`] do the rest.

mod dsr_option;
mod rewrite;

pub use crate::checksum::{bytes, csum_add, csum_fold};
pub use dsr_option::{
    DsrPending, clamp_mss, dsr_service, dsr_service6, insert_dsr_header6, insert_dsr_option,
};
pub use rewrite::{decrement_ttl, rewrite, rewrite_fragment, set_addrs, set_macs};

use core::mem::offset_of;

use crate::frame::Frame;
use aya_ebpf::bindings::BPF_F_MARK_MANGLED_0;
use network_types::{
    eth::{EthHdr, EtherType},
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use proxy_common::{
    CtKey, CtKey6, CtTuple, FragKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
    ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    dsr::{DsrHeader6, HDR6_LEN, IPPROTO_DSTOPTS},
    has_ports, sctp,
};

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;
/// Where the IP header starts: after the Ethernet header.
pub const IP_OFF: usize = EthHdr::LEN;
/// `Ipv4Hdr::frag_flags`: more fragments follow.
const MORE_FRAGMENTS: u8 = 0b001;

/// An IP header whose packets the datapath translates, and so an address
/// family: where its fields are, from the header's start, and the tuple
/// its flows are tracked by. Code generic over it is written once and
/// compiled for each family; the constants fold the other family's
/// branches away.
pub trait IpHeader {
    type Addr: Copy + PartialEq + Default + AsRef<[u8]> + proxy_common::prefilter::Address;
    type Tuple: CtTuple<Addr = Self::Addr>;
    const SADDR: usize;
    const DADDR: usize;
    /// The header's length without IPv4 options (IPv6: the fixed header).
    const PLAIN_LEN: usize;
    /// The header checksum (IPv6 has none).
    const CSUM: Option<usize>;
    /// The TTL or hop limit.
    const HOPS: usize;
    /// ICMP's protocol number in this family (ICMPv6's next header).
    const ICMP: u8;
    /// The length field, and what it counts beyond the L4 segment (IPv4's
    /// total length counts its plain header, IPv6's payload length nothing).
    const LEN_FIELD: usize;
    const LEN_BEYOND_L4: usize;

    /// Both addresses of `t`, side by side as in the header (a tuple
    /// starts with them).
    fn addrs(t: &Self::Tuple) -> &[Self::Addr; 2];

    /// Stores both addresses of `t` side by side at `at`, as in the header.
    ///
    /// # Safety
    /// `at` points to writable packet data the verifier knows holds them.
    unsafe fn store_addrs(at: usize, t: &Self::Tuple);
}

impl IpHeader for Ipv4Hdr {
    type Addr = [u8; 4];
    type Tuple = CtKey;
    const SADDR: usize = offset_of!(Ipv4Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv4Hdr, dst_addr);
    const PLAIN_LEN: usize = Ipv4Hdr::LEN;
    const CSUM: Option<usize> = Some(offset_of!(Ipv4Hdr, check));
    const HOPS: usize = offset_of!(Ipv4Hdr, ttl);
    const ICMP: u8 = IPPROTO_ICMP;
    const LEN_FIELD: usize = offset_of!(Ipv4Hdr, tot_len);
    const LEN_BEYOND_L4: usize = Ipv4Hdr::LEN;

    #[inline(always)]
    fn addrs(t: &CtKey) -> &[[u8; 4]; 2] {
        const _: () = assert!(offset_of!(CtKey, daddr) == 4);
        // SAFETY: the key's first 8 bytes, as just asserted.
        unsafe { &*(t as *const CtKey).cast() }
    }

    #[inline(always)]
    unsafe fn store_addrs(at: usize, t: &CtKey) {
        // Two words (the packet's alignment does not matter to the verifier
        // where unaligned access is efficient, as on x86 and arm64).
        let at = at as *mut u32;
        unsafe { (*at, *at.add(1)) = (u32::from_ne_bytes(t.saddr), u32::from_ne_bytes(t.daddr)) };
    }
}

impl IpHeader for Ipv6Hdr {
    type Addr = [u8; 16];
    type Tuple = CtKey6;
    const SADDR: usize = offset_of!(Ipv6Hdr, src_addr);
    const DADDR: usize = offset_of!(Ipv6Hdr, dst_addr);
    const PLAIN_LEN: usize = Ipv6Hdr::LEN;
    const CSUM: Option<usize> = None;
    const HOPS: usize = offset_of!(Ipv6Hdr, hop_limit);
    const ICMP: u8 = IPPROTO_ICMPV6;
    const LEN_FIELD: usize = offset_of!(Ipv6Hdr, payload_len);
    const LEN_BEYOND_L4: usize = 0;

    #[inline(always)]
    fn addrs(t: &CtKey6) -> &[[u8; 16]; 2] {
        const _: () = assert!(offset_of!(CtKey6, daddr) == 16);
        // SAFETY: the key's first 32 bytes, as just asserted.
        unsafe { &*(t as *const CtKey6).cast() }
    }

    #[inline(always)]
    unsafe fn store_addrs(at: usize, t: &CtKey6) {
        // As four words from the aligned key (see `parse6`).
        unsafe { *(at as *mut [u64; 4]) = *(Self::addrs(t) as *const _ as *const [u64; 4]) };
    }
}

/// What a per-packet program translates, as a constant parameter of its
/// path (`SCTP`): its family's TCP and UDP (handing SCTP on), or SCTP
/// alone. The verifier then walks each program for its own protocols only.
pub const TCP_AND_UDP: bool = false;
pub const SCTP_ALONE: bool = true;

/// Where the ports are, the same in TCP, UDP and SCTP headers: one read
/// and one rewrite serve all three.
pub const SPORT: usize = offset_of!(UdpHdr, src);
pub const DPORT: usize = offset_of!(UdpHdr, dst);
const _: () = assert!(offset_of!(TcpHdr, source) == SPORT && offset_of!(TcpHdr, dest) == DPORT);

/// The fields of one TCP, UDP or SCTP packet the datapath works with (`T`:
/// its family's tuple).
#[derive(Clone, Copy)]
pub struct Packet<T = CtKey> {
    pub tuple: T,
    /// Offset of the L4 header.
    pub l4_off: usize,
    /// TCP flags (0 for UDP; SCTP's first chunk as TCP flags, see
    /// `sctp::ct_flags`).
    pub tcp_flags: u8,
    /// The IPv4 header length is 20 (no options); in IPv6, no extension
    /// header (the DSR one is the only one parsed).
    pub plain_ip_header: bool,
    /// The first fragment of a fragmented IPv4 datagram: its later fragments
    /// are known by this key. (IPv6 fragments have an extension header: they
    /// pass untouched.)
    pub first_fragment: Option<FragKey>,
}

/// A packet on its way through the steps of the ingress path (`tc_lb`), and
/// `to`, the tuple they fill or read in place. The IPv6 path keeps it in a
/// per-CPU map (`FLOW6`): on the stack, its 16-byte addresses and the copies
/// the compiler makes of them would leave the steps too little of it.
#[derive(Clone, Copy)]
pub struct Flow<T> {
    pub pkt: Packet<T>,
    pub to: T,
    /// `bpf_ktime_get_ns()` when the packet came.
    pub now: u64,
}

impl<T: Copy> Flow<T> {
    /// Copies the flow to `slot` eight bytes at a time: a plain struct
    /// copy compiles to a call of the BPF build's `memmove`, which copies a
    /// byte at a time (60 ns for a new flow's handover).
    #[inline(always)]
    pub fn copy_to(&self, slot: &mut Self) {
        // A `u64` field makes the size a multiple of 8 too.
        const { assert!(align_of::<Self>() >= 8) };
        let (from, to) = (self as *const Self as *const u64, slot as *mut Self as *mut u64);
        for i in 0..size_of::<Self>() / 8 {
            // SAFETY: both are a `Self`, 8-aligned; volatile, so that the
            // compiler does not make the loop a `memmove` again.
            unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) };
        }
    }
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
    /// An IPv4 TCP, UDP or SCTP packet, or the first fragment of a datagram.
    Packet(Packet),
    /// A later fragment: IP header only.
    Fragment(FragKey),
    /// An ICMP message (an error may quote a translated flow's packet).
    Icmp(IcmpMessage),
}

impl<T: CtTuple> Packet<T> {
    fn l4_csum_off(&self) -> usize {
        self.l4_off
            + if self.tuple.proto() == IPPROTO_TCP {
                offset_of!(TcpHdr, check)
            } else {
                offset_of!(UdpHdr, check)
            }
    }

    fn l4_flags(&self) -> u64 {
        // A UDP checksum of zero means "none" and must stay zero; one that
        // comes out zero is written as 0xffff (IPv6 UDP must never carry 0).
        if self.tuple.proto() == IPPROTO_UDP { BPF_F_MARK_MANGLED_0 as u64 } else { 0 }
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
pub fn header<T: Copy>(ctx: &impl Frame, off: usize) -> Option<T> {
    let start = ctx.data() + off;
    if start + core::mem::size_of::<T>() <= ctx.data_end() {
        // SAFETY: within the linear data, as just checked; read unaligned,
        // as headers lie at any offset.
        Some(unsafe { core::ptr::read_unaligned(start as *const T) })
    } else {
        ctx.load(off).ok()
    }
}

/// Reads the ports (and TCP flags, or what SCTP's first chunk stands for)
/// of the TCP, UDP or SCTP header at `off`.
#[inline(always)]
pub fn load_ports(ctx: &impl Frame, off: usize, proto: u8) -> Option<(u16, u16, u8)> {
    // One read per header.
    if proto == IPPROTO_TCP {
        let tcp: TcpHdr = header(ctx, off)?;
        Some((u16::from_be_bytes(tcp.source), u16::from_be_bytes(tcp.dest), tcp_flags(&tcp)))
    } else if proto == IPPROTO_SCTP {
        let h: [u8; sctp::FIRST_CHUNK_TYPE + 1] = header(ctx, off)?;
        let (sport, dport) = (u16::from_be_bytes([h[0], h[1]]), u16::from_be_bytes([h[2], h[3]]));
        Some((sport, dport, sctp::ct_flags(h[sctp::FIRST_CHUNK_TYPE])))
    } else {
        let udp: UdpHdr = header(ctx, off)?;
        Some((udp.src_port(), udp.dst_port(), 0))
    }
}

/// Parses an Ethernet + IPv4 + TCP/UDP/SCTP packet or fragment. Anything else
/// (other protocols, IPv6: [`parse6`], ARP) is `None` and passes untouched.
#[inline(always)]
pub fn parse(ctx: &impl Frame) -> Option<Parsed> {
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
    if !has_ports(proto) {
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

/// Whether the frame carries IPv6.
#[inline(always)]
pub fn is_ipv6(ctx: &impl Frame) -> bool {
    header::<u16>(ctx, offset_of!(EthHdr, ether_type)) == Some(EtherType::Ipv6 as u16)
}

/// Parses an Ethernet + IPv6 packet ([`is_ipv6`]): TCP, UDP or SCTP right after
/// the fixed header, or after a DSR destination-options header
/// ([`dsr_service6`]; `plain_ip_header` false). Other extension headers
/// (fragments included), ICMPv6 (neighbour discovery) and anything else
/// are `false` and pass untouched.
#[inline(always)]
pub fn parse6(ctx: &impl Frame, pkt: &mut Packet<CtKey6>) -> bool {
    // The version's word and the next header, before the addresses.
    let Some(first) = header::<[u8; 8]>(ctx, IP_OFF) else { return false };
    let (version, mut proto) = (first[0] >> 4, first[offset_of!(Ipv6Hdr, next_hdr)]);
    let mut l4_off = IP_OFF + Ipv6Hdr::LEN;
    if proto == IPPROTO_DSTOPTS {
        let Some(dsr) = header::<DsrHeader6>(ctx, l4_off) else { return false };
        if dsr.service().is_none() {
            return false;
        }
        (proto, l4_off) = (dsr.next_hdr, l4_off + HDR6_LEN as usize);
    }
    if version != 6 || !has_ports(proto) {
        return false;
    }
    let Some((sport, dport, tcp_flags)) = load_ports(ctx, l4_off, proto) else { return false };
    // Both addresses in one copy of words into the aligned key (see `CtKey6`).
    const _: () = assert!(offset_of!(CtKey6, daddr) == 16 && Ipv6Hdr::DADDR == Ipv6Hdr::SADDR + 16);
    let addrs = (&mut pkt.tuple as *mut CtKey6).cast::<[u64; 4]>();
    let at = IP_OFF + Ipv6Hdr::SADDR;
    let start = ctx.data() + at;
    if start + 32 <= ctx.data_end() {
        // SAFETY: within the linear data, as just checked; read as words
        // (the packet's own alignment does not matter to the verifier where
        // unaligned access is efficient, as on x86 and arm64).
        unsafe { *addrs = *(start as *const [u64; 4]) };
    } else {
        let Ok(words) = ctx.load::<[u64; 4]>(at) else { return false };
        // SAFETY: the key's first 32 bytes.
        unsafe { *addrs = words };
    }
    (pkt.tuple.sport, pkt.tuple.dport, pkt.tuple.proto) = (sport, dport, proto);
    pkt.tuple._pad = [0; 3];
    (pkt.l4_off, pkt.tcp_flags, pkt.plain_ip_header, pkt.first_fragment) =
        (l4_off, tcp_flags, l4_off == IP_OFF + Ipv6Hdr::LEN, None);
    true
}
