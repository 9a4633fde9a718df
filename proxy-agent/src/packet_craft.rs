//! Packets crafted to run the programs on (`explain`'s test runs, the
//! packet tests): Ethernet frames over IPv4 or IPv6 carrying TCP, UDP,
//! ICMP or ICMPv6, with their checksums, and the readings back the callers
//! check. Pure: no I/O.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const ETH_LEN: usize = 14;
pub const IP_LEN: usize = 20;
pub const IP6_LEN: usize = 40;
pub const ETH_IPV4: u16 = 0x0800;
pub const ETH_IPV6: u16 = 0x86dd;
pub const ICMP: u8 = 1;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;
pub const ICMPV6: u8 = 58;

/// A frame with zero MACs: the IP header of `src` and `dst` (IPv4 with its
/// header checksum, or IPv6; an IPv4 address of a mixed pair taken as
/// IPv4-mapped), protocol `number`, then `l4` as given (its checksum is
/// [`set_l4_checksum`]'s business).
pub fn frame(number: u8, src: IpAddr, dst: IpAddr, l4: &[u8]) -> Vec<u8> {
    let (ethertype, ip) = match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => (ETH_IPV4, ipv4_header(number, src, dst, l4.len())),
        (src, dst) => (ETH_IPV6, ipv6_header(number, v6(src), v6(dst), l4.len())),
    };
    let mut p = vec![0; ETH_LEN];
    p[12..14].copy_from_slice(&ethertype.to_be_bytes());
    p.extend_from_slice(&ip);
    p.extend_from_slice(l4);
    p
}

/// A TCP or UDP message: the two ports, then `rest`.
pub fn with_ports(src: u16, dst: u16, rest: &[u8]) -> Vec<u8> {
    let mut l4 = Vec::with_capacity(4 + rest.len());
    l4.extend_from_slice(&src.to_be_bytes());
    l4.extend_from_slice(&dst.to_be_bytes());
    l4.extend_from_slice(rest);
    l4
}

/// A TCP segment or UDP datagram from `from` to `to` (`rest` after the
/// ports), its checksums set.
pub fn packet(number: u8, from: SocketAddr, to: SocketAddr, rest: &[u8]) -> Vec<u8> {
    let mut p = frame(number, from.ip(), to.ip(), &with_ports(from.port(), to.port(), rest));
    set_l4_checksum(&mut p);
    p
}

/// An SCTP INIT from `from` to `to` (verification tag 0, as an INIT has),
/// its CRC32c checksum set.
pub fn sctp_init(from: SocketAddr, to: SocketAddr) -> Vec<u8> {
    // INIT chunk of 20 bytes: initiate tag 1, a_rwnd 65535, 10 outbound
    // and inbound streams, TSN 1.
    let init = [1, 0, 0, 20, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 0, 10, 0, 10, 0, 0, 0, 1];
    sctp(from, to, 0, &init)
}

/// An SCTP packet from `from` to `to`: verification tag `tag`, then
/// `chunks`, its CRC32c checksum set.
pub fn sctp(from: SocketAddr, to: SocketAddr, tag: u32, chunks: &[u8]) -> Vec<u8> {
    let mut rest = tag.to_be_bytes().to_vec();
    // The checksum, set below.
    rest.extend_from_slice(&[0; 4]);
    rest.extend_from_slice(chunks);
    let mut p = frame(SCTP, from.ip(), to.ip(), &with_ports(from.port(), to.port(), &rest));
    set_l4_checksum(&mut p);
    p
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(ip) => ip.to_ipv6_mapped(),
        IpAddr::V6(ip) => ip,
    }
}

fn ipv4_header(number: u8, src: Ipv4Addr, dst: Ipv4Addr, l4_len: usize) -> Vec<u8> {
    // Id 1, don't fragment, TTL 64.
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, number, 0, 0];
    ip[2..4].copy_from_slice(&((IP_LEN + l4_len) as u16).to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let sum = fold(sum16(&ip));
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    ip
}

fn ipv6_header(number: u8, src: Ipv6Addr, dst: Ipv6Addr, l4_len: usize) -> Vec<u8> {
    // Version 6, no traffic class or flow label, payload length, next
    // header, hop limit 64.
    let mut ip = vec![0x60, 0, 0, 0, 0, 0, number, 64];
    ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    ip
}

/// A frame's IP header (an IPv4 one with its options) and ethertype.
pub fn ip_header(p: &[u8]) -> Option<(&[u8], u16)> {
    let ethertype = u16::from_be_bytes([*p.get(12)?, *p.get(13)?]);
    let len = match ethertype {
        ETH_IPV6 => IP6_LEN,
        // At least the fixed header, whatever a broken length field says.
        _ => (usize::from(*p.get(ETH_LEN)? & 0x0f) * 4).max(IP_LEN),
    };
    Some((p.get(ETH_LEN..ETH_LEN + len)?, ethertype))
}

/// The source (`which` 0) or destination (1) address of an IP header.
fn ip_of(ip: &[u8], ethertype: u16, which: usize) -> IpAddr {
    if ethertype == ETH_IPV6 {
        let o = 8 + 16 * which;
        IpAddr::from(<[u8; 16]>::try_from(&ip[o..o + 16]).unwrap_or_default())
    } else {
        let o = 12 + 4 * which;
        IpAddr::from(<[u8; 4]>::try_from(&ip[o..o + 4]).unwrap_or_default())
    }
}

/// A frame's protocol number and what follows its IP header, as far as
/// the header's length field counts (a frame may be padded past it).
fn l4(p: &[u8]) -> Option<(u8, &[u8])> {
    let (ip, ethertype) = ip_header(p)?;
    let (number, counted) = if ethertype == ETH_IPV6 {
        (ip[6], IP6_LEN + usize::from(u16::from_be_bytes([ip[4], ip[5]])))
    } else {
        (ip[9], usize::from(u16::from_be_bytes([ip[2], ip[3]])))
    };
    let start = ETH_LEN + ip.len();
    let end = (ETH_LEN + counted).clamp(start, p.len());
    Some((number, p.get(start..end)?))
}

/// The tuple of a frame (IPv4, or IPv6 without extension headers):
/// protocol, source, destination.
pub fn tuple(p: &[u8]) -> Option<(u8, SocketAddr, SocketAddr)> {
    let (ip, ethertype) = ip_header(p)?;
    let (number, l4) = l4(p)?;
    let ports = l4.get(..4)?;
    let port = |o: usize| u16::from_be_bytes([ports[o], ports[o + 1]]);
    Some((
        number,
        SocketAddr::new(ip_of(ip, ethertype, 0), port(0)),
        SocketAddr::new(ip_of(ip, ethertype, 1), port(2)),
    ))
}

/// The pseudo-header the L4 checksum covers (RFC 793, RFC 8200 8.1).
pub fn pseudo_header(number: u8, src: IpAddr, dst: IpAddr, l4_len: usize) -> Vec<u8> {
    let mut pseudo = Vec::with_capacity(40);
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&[0, number]);
            pseudo.extend_from_slice(&(l4_len as u16).to_be_bytes());
        }
        (src, dst) => {
            pseudo.extend_from_slice(&v6(src).octets());
            pseudo.extend_from_slice(&v6(dst).octets());
            pseudo.extend_from_slice(&(l4_len as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, number]);
        }
    }
    pseudo
}

/// The ones' complement sum of 16-bit words (an odd byte padded).
pub fn sum16(bytes: &[u8]) -> u32 {
    bytes.chunks(2).map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32).sum()
}

/// A sum folded to 16 bits and complemented: the checksum to write, or 0
/// over bytes whose checksum is right.
pub fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Where a message's checksum sits in it.
fn checksum_at(number: u8) -> usize {
    match number {
        TCP => 16,
        UDP => 6,
        SCTP => proxy_common::sctp::CHECKSUM,
        _ => 2,
    }
}

/// SCTP's CRC32c over a message, its own field counted as zero.
fn sctp_checksum(l4: &[u8]) -> Option<[u8; 4]> {
    let at = proxy_common::sctp::CHECKSUM;
    let mut zeroed = l4.get(..proxy_common::sctp::HEADER_LEN)?.to_vec();
    zeroed[at..at + 4].fill(0);
    zeroed.extend_from_slice(&l4[proxy_common::sctp::HEADER_LEN..]);
    // RFC 9260 appendix A: its bytes go out least significant first.
    Some(proxy_common::sctp::crc32c(&zeroed).to_le_bytes())
}

/// The folded sum over a frame's L4 message, with the pseudo-header but
/// for ICMP over IPv4 (which has none): 0 when its checksum is right.
fn l4_folded(p: &[u8]) -> Option<u16> {
    let (ip, ethertype) = ip_header(p)?;
    let (number, l4) = l4(p)?;
    let pseudo = match number {
        ICMP => 0,
        _ => sum16(&pseudo_header(
            number,
            ip_of(ip, ethertype, 0),
            ip_of(ip, ethertype, 1),
            l4.len(),
        )),
    };
    Some(fold(pseudo + sum16(l4)))
}

/// Computes and writes a frame's TCP, UDP, SCTP, ICMP or ICMPv6 checksum
/// (a UDP sum of 0 written as 0xffff: 0 means none, forbidden over IPv6).
pub fn set_l4_checksum(p: &mut [u8]) {
    let Some((ip, _)) = ip_header(p) else { return };
    let Some((number, l4)) = l4(p) else { return };
    let at = ETH_LEN + ip.len() + checksum_at(number);
    if number == SCTP {
        if let Some(sum) = sctp_checksum(l4) {
            p[at..at + 4].copy_from_slice(&sum);
        }
        return;
    }
    if p.len() < at + 2 {
        return;
    }
    p[at..at + 2].copy_from_slice(&[0, 0]);
    let sum = l4_folded(p).unwrap_or_default();
    let sum = if sum == 0 && number == UDP { 0xffff } else { sum };
    p[at..at + 2].copy_from_slice(&sum.to_be_bytes());
}

/// Whether a frame's L4 checksum is right.
pub fn l4_checksum_ok(p: &[u8]) -> bool {
    match l4(p) {
        Some((SCTP, l4)) => {
            let at = checksum_at(SCTP);
            sctp_checksum(l4).is_some_and(|sum| l4[at..at + 4] == sum)
        }
        _ => l4_folded(p) == Some(0),
    }
}

/// Recomputes an IPv4 frame's header checksum (after a field changed).
pub fn set_ipv4_checksum(p: &mut [u8]) {
    let Some((ip, _)) = ip_header(p) else { return };
    let end = ETH_LEN + ip.len();
    p[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&[0, 0]);
    let sum = fold(sum16(&p[ETH_LEN..end]));
    p[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&sum.to_be_bytes());
}

/// Whether an IPv4 frame's header checksum is right.
pub fn ipv4_checksum_ok(p: &[u8]) -> bool {
    ip_header(p).is_some_and(|(ip, ethertype)| ethertype == ETH_IPV4 && fold(sum16(ip)) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_sctp_init_carries_its_ports_and_a_checksum_over_the_message() {
        let p = sctp_init(addr("10.0.0.1:4000"), addr("10.96.0.1:80"));
        assert_eq!(p[ETH_LEN + 9], SCTP);
        let l4 = &p[ETH_LEN + IP_LEN..];
        assert_eq!(&l4[..4], &[0x0f, 0xa0, 0, 80]);
        assert_eq!(l4[12], 1, "an INIT chunk");
        let mut zeroed = l4.to_vec();
        zeroed[8..12].fill(0);
        let sum = proxy_common::sctp::crc32c(&zeroed);
        assert_eq!(u32::from_le_bytes(l4[8..12].try_into().unwrap()), sum);
        assert!(l4_checksum_ok(&p));
        let mut broken = p.clone();
        broken[ETH_LEN + IP_LEN + 20] ^= 1;
        assert!(!l4_checksum_ok(&broken), "a changed byte is seen");
        // Ethernet padding past the IP length is no part of it.
        broken = p.clone();
        broken.extend_from_slice(&[0xaa; 6]);
        assert!(l4_checksum_ok(&broken));
    }

    #[test]
    fn crafted_packets_have_valid_checksums_and_read_back() {
        let pairs =
            [("192.168.1.5:40000", "10.96.0.10:80"), ("[fd00::5]:40000", "[fd00:96::10]:80")];
        for (from, to) in pairs {
            for number in [TCP, UDP] {
                let p = packet(number, addr(from), addr(to), &[0; 16]);
                let (ip, ethertype) = ip_header(&p).unwrap();
                let v4 = ethertype == ETH_IPV4;
                assert_eq!(v4, addr(from).is_ipv4(), "{from}: ethertype {ethertype:#x}");
                assert_eq!(ipv4_checksum_ok(&p), v4, "IPv4 header checksum");
                if !v4 {
                    assert_eq!(ip[4..6], ((p.len() - ETH_LEN - IP6_LEN) as u16).to_be_bytes());
                }
                assert_eq!(tuple(&p), Some((number, addr(from), addr(to))));
                // Recomputed independently of `l4_folded`.
                let l4 = &p[ETH_LEN + ip.len()..];
                let pseudo = pseudo_header(number, addr(from).ip(), addr(to).ip(), l4.len());
                assert_eq!(fold(sum16(&pseudo) + sum16(l4)), 0, "{number} checksum from {from}");
                assert!(l4_checksum_ok(&p));
                let mut broken = p.clone();
                *broken.last_mut().unwrap() ^= 1;
                assert!(!l4_checksum_ok(&broken), "a flipped bit is caught");
            }
        }
        assert_eq!(tuple(&[0; 20]), None);
        assert_eq!(tuple(&[&[0u8; 12][..], &[0x86, 0xdd]].concat()), None);
    }

    #[test]
    fn icmp_checksums_cover_the_pseudo_header_over_ipv6_only() {
        let (a4, b4) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let mut p = frame(ICMP, a4, b4, &[3, 3, 0, 0, 0, 0, 0, 0, 1, 2, 3]);
        set_l4_checksum(&mut p);
        assert_eq!(fold(sum16(&p[ETH_LEN + IP_LEN..])), 0, "no pseudo-header");
        let (a6, b6) = (IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, 1]), "fd00::2".parse().unwrap());
        let mut p = frame(ICMPV6, a6, b6, &[1, 4, 0, 0, 0, 0, 0, 0]);
        set_l4_checksum(&mut p);
        let pseudo = pseudo_header(ICMPV6, a6, b6, 8);
        assert_eq!(fold(sum16(&pseudo) + sum16(&p[ETH_LEN + IP6_LEN..])), 0);
        assert!(l4_checksum_ok(&p));
    }

    #[test]
    fn a_udp_sum_of_zero_is_sent_as_all_ones_and_headers_recompute() {
        // A source port that completes the sum: the checksum comes out 0.
        let (src, dst) = (IpAddr::from([0, 0, 0, 0]), IpAddr::from([0, 0, 0, 0]));
        let l4 = with_ports(0, 0, &[0, 8, 0, 0]);
        let rest = fold(sum16(&pseudo_header(UDP, src, dst, 8)) + sum16(&l4));
        let mut p = frame(UDP, src, dst, &with_ports(rest, 0, &[0, 8, 0, 0]));
        set_l4_checksum(&mut p);
        assert_eq!(p[ETH_LEN + IP_LEN + 6..ETH_LEN + IP_LEN + 8], [0xff, 0xff]);
        assert!(l4_checksum_ok(&p));

        p[ETH_LEN + 8] = 1;
        assert!(!ipv4_checksum_ok(&p));
        set_ipv4_checksum(&mut p);
        assert!(ipv4_checksum_ok(&p));
    }
}
