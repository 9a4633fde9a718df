//! IPv4 and IPv6 TCP/UDP/SCTP packet access for tc programs: parsing,
//! rewriting addresses and ports with incremental checksum updates (SCTP's
//! CRC32c by `proxy_common::sctp`), and plain checksums for the packets we
//! build (RST, ICMP). ICMP messages are only located here; the errors among
//! them are read by `icmp`.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{
        BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM,
        bpf_adj_room_mode::BPF_ADJ_ROOM_NET,
    },
    helpers::generated::{bpf_csum_diff, bpf_csum_update},
    programs::TcContext,
};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use proxy_common::{
    CtKey, CtKey6, CtTuple, FragKey, FragRewrite, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
    ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    dsr::{self, DsrHeader6, DsrOption, HDR6_LEN, IPPROTO_DSTOPTS, OPT_LEN},
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

/// Reads the ports (and TCP flags, or what SCTP's first chunk stands for)
/// of the TCP, UDP or SCTP header at `off`.
#[inline(always)]
pub fn load_ports(ctx: &TcContext, off: usize, proto: u8) -> Option<(u16, u16, u8)> {
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

/// Whether the frame carries IPv6.
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    header::<u16>(ctx, offset_of!(EthHdr, ether_type)) == Some(EtherType::Ipv6 as u16)
}

/// Parses an Ethernet + IPv6 packet ([`is_ipv6`]): TCP, UDP or SCTP right after
/// the fixed header, or after a DSR destination-options header
/// ([`dsr_service6`]; `plain_ip_header` false). Other extension headers
/// (fragments included), ICMPv6 (neighbour discovery) and anything else
/// are `false` and pass untouched.
#[inline(always)]
pub fn parse6(ctx: &TcContext, pkt: &mut Packet<CtKey6>) -> bool {
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
    if let Some(csum) = H::CSUM {
        ctx.l3_csum_replace(ip_off + csum, old, new, 4)?;
    }
    ctx.store(ip_off + field, &(new as u32), 0)
}

/// Adds to `sum` the ones'-complement difference that turns a sum over
/// `old` into one over `new` (both as in memory, of one even length),
/// unfolded.
#[inline(always)]
fn csum_diff_add(mut sum: u32, old: &[u8], new: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < old.len() && i + 1 < new.len() {
        sum += !u16::from_ne_bytes([old[i], old[i + 1]]) as u32;
        sum += u16::from_ne_bytes([new[i], new[i + 1]]) as u32;
        i += 2;
    }
    sum
}

/// `sum` folded to 16 bits: what the csum helpers take as a precomputed
/// difference (header field size 0).
#[inline(always)]
fn fold_diff(mut sum: u32) -> u32 {
    sum = (sum & 0xffff) + (sum >> 16);
    (sum & 0xffff) + (sum >> 16)
}

/// The folded difference from `old` to `new`.
#[inline(always)]
fn csum_diff<const N: usize>(old: [u8; N], new: [u8; N]) -> u32 {
    fold_diff(csum_diff_add(0, &old, &new))
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
    ctx: &TcContext,
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
    ctx: &TcContext,
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
fn unbalanced<H: IpHeader>(ctx: &TcContext, diff: u32) {
    if H::CSUM.is_none() && diff != 0 {
        // SAFETY: the program's own skb.
        unsafe { bpf_csum_update(ctx.skb.skb, diff) };
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
fn set_sctp_ports<H: IpHeader>(ctx: &TcContext, l4_off: usize, ports: [u8; 4]) -> Result<(), i64> {
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
    ctx: &TcContext,
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

/// The checksum `check` (as in memory) of a header whose covered words
/// changed by the folded difference `diff` (RFC 1624, eqn. 3).
#[inline(always)]
fn csum_replaced(check: u16, diff: u32) -> u16 {
    !(fold_diff(diff + !check as u32) as u16)
}

/// Rewrites the addresses of a later fragment (IP header only).
#[inline(always)]
pub fn rewrite_fragment(ctx: &TcContext, from: &FragKey, to: &FragRewrite) -> Result<(), i64> {
    rewrite_addrs(ctx, [from.saddr, from.daddr], [to.saddr, to.daddr])
}

/// Rewrites source and destination of a packet whose L4 checksum does not
/// cover them (a later fragment): the IP header only.
#[inline(always)]
pub fn rewrite_addrs(ctx: &TcContext, from: [[u8; 4]; 2], to: [[u8; 4]; 2]) -> Result<(), i64> {
    set_addr::<Ipv4Hdr>(ctx, None, IP_OFF, Ipv4Hdr::SADDR, from[0], to[0])?;
    set_addr::<Ipv4Hdr>(ctx, None, IP_OFF, Ipv4Hdr::DADDR, from[1], to[1])
}

/// Decrements the TTL (hop limit) of a packet we forward ourselves; false
/// when it ran out.
#[inline(always)]
pub fn decrement_ttl<H: IpHeader>(ctx: &TcContext) -> Result<bool, i64> {
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
pub fn set_macs(ctx: &TcContext, macs: &[[u8; 6]; 2]) -> Result<(), i64> {
    let data = ctx.data();
    if data + size_of::<[[u8; 6]; 2]>() > ctx.data_end() {
        return ctx.store(0, macs, 0);
    }
    // SAFETY: within the linear data, as just checked (see `rewrite`).
    unsafe { *(data as *mut [[u8; 6]; 2]) = *macs };
    Ok(())
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
