//! Direct server return, dispatched in an IP option (Cilium's
//! `dsr-dispatch=opt`): the node a new flow enters DNATs it to a backend on
//! another node without touching the client's address, and carries the
//! service's address and port in an option of the packet's IP header (an
//! IPv6 destination-options header), so that the backend's node can
//! rewrite the pod's replies to come from the service, straight to the
//! client.
//!
//! The IPv4 option is Cilium's: type 0x9a (copied on fragmentation, class
//! 0, number 26, one the kernel skips where it does not know it), 8 bytes:
//! the type, the length, the port and the address, in network order. The
//! IPv6 one is Cilium's too: a destination-options header of 24 bytes
//! holding one option of type 0x1b (its two high bits 00: "skip it if
//! unknown", the pod's kernel ignores it), the address, the port and two
//! reserved bytes.
//!
//! Both add bytes to every packet of the client's side of the flow; the
//! backend's node lowers the MSS its pod announces by as much (see
//! [`overhead`]), so that full-size segments still fit the path's MTU.

/// The option's type byte.
pub const OPT_TYPE: u8 = 0x9a;
/// The option's length, type and length bytes included.
pub const OPT_LEN: u8 = 8;

/// The option as it lies in the header, after the 20 plain bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsrOption {
    pub kind: u8,
    pub len: u8,
    /// Network order.
    pub port: [u8; 2],
    pub address: [u8; 4],
}

impl DsrOption {
    /// The option naming the service at `address`:`port`.
    pub const fn new(address: [u8; 4], port: u16) -> Self {
        DsrOption { kind: OPT_TYPE, len: OPT_LEN, port: port.to_be_bytes(), address }
    }

    /// The service an option names, if it is ours.
    pub const fn service(&self) -> Option<([u8; 4], u16)> {
        if self.kind == OPT_TYPE && self.len == OPT_LEN {
            Some((self.address, u16::from_be_bytes(self.port)))
        } else {
            None
        }
    }

    /// Its bytes as 16-bit words, for the header checksum.
    pub const fn words(&self) -> [u8; 8] {
        let [p0, p1] = self.port;
        let [a0, a1, a2, a3] = self.address;
        [self.kind, self.len, p0, p1, a0, a1, a2, a3]
    }
}

/// What the datapath does to a tracked packet for direct server return
/// ([`action`]): nothing (0), insert the option, or clamp the MSS.
pub const INSERT: u8 = 1;
pub const CLAMP: u8 = 2;

/// What direct server return does to a tracked packet with conntrack
/// `flags` and `tcp_flags`: a DSR flow's forward packets (a forward entry,
/// not `REPLY`, with `DSR`: the client's, on the node it entered) carry the
/// service, each ([`INSERT`]); its pod's SYN-ACK (the backend's node's
/// `REPLY` entry) has its MSS lowered ([`CLAMP`]); anything else, nothing.
/// Arithmetic, not tests: the BPF verifier then walks one path, not three.
pub const fn action(flags: u8, tcp_flags: u8) -> u8 {
    use crate::{CT_FLAG_DSR, CT_FLAG_REPLY, ct::TCP_SYN};
    const _: () = assert!(CT_FLAG_DSR == 1 << 7 && CT_FLAG_REPLY == 1 && TCP_SYN == 2);
    const _: () = assert!(INSERT == 1 && CLAMP == 2);
    let (dsr, reply, syn) = (flags >> 7, flags & 1, (tcp_flags >> 1) & 1);
    dsr * ((!reply & 1) | ((reply & syn) << 1))
}

/// IPv6's next-header number of a destination-options header.
pub const IPPROTO_DSTOPTS: u8 = 60;
/// The IPv6 option's type byte.
pub const OPT6_TYPE: u8 = 0x1b;
/// The destination-options header's length: 8 bytes and this many more
/// 8-byte units.
const HDR6_UNITS: u8 = 2;
/// The length of the whole header, in bytes.
pub const HDR6_LEN: u8 = (HDR6_UNITS + 1) * 8;

/// The destination-options header carrying the service, as it lies after
/// the fixed IPv6 header.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsrHeader6 {
    /// The protocol after it (TCP or UDP).
    pub next_hdr: u8,
    pub hdr_len: u8,
    pub kind: u8,
    /// The option's data: everything after this byte.
    pub len: u8,
    pub address: [u8; 16],
    /// Network order.
    pub port: [u8; 2],
    pub _reserved: [u8; 2],
}

impl DsrHeader6 {
    /// The header naming the service at `address`:`port`, followed by
    /// protocol `next_hdr`.
    pub const fn new(next_hdr: u8, address: [u8; 16], port: u16) -> Self {
        DsrHeader6 {
            next_hdr,
            hdr_len: HDR6_UNITS,
            kind: OPT6_TYPE,
            len: HDR6_LEN - 4,
            address,
            port: port.to_be_bytes(),
            _reserved: [0; 2],
        }
    }

    /// The service a header names, if it is ours.
    pub const fn service(&self) -> Option<([u8; 16], u16)> {
        if self.hdr_len == HDR6_UNITS && self.kind == OPT6_TYPE && self.len == HDR6_LEN - 4 {
            Some((self.address, u16::from_be_bytes(self.port)))
        } else {
            None
        }
    }
}

/// The bytes the dispatch adds to a packet of family `ipv6`, by which the
/// MSS a backend announces is lowered.
pub const fn overhead(ipv6: bool) -> u16 {
    if ipv6 { HDR6_LEN as u16 } else { OPT_LEN as u16 }
}

/// What an MSS option announcing `mss` becomes under DSR (`overhead`
/// bytes less), or `None` where it stays: never below IPv4 TCP's default
/// of 536 (RFC 9293), a floor for both families (an IPv6 path carries more,
/// and the pod's own MSS is far above it on any real link).
pub const fn clamped_mss(mss: u16, overhead: u16) -> Option<u16> {
    const FLOOR: u16 = 536;
    if mss >= FLOOR + overhead { Some(mss - overhead) } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_option_names_its_service_and_others_are_not_ours() {
        let opt = DsrOption::new([10, 200, 0, 10], 80);
        assert_eq!(opt.words(), [0x9a, 8, 0, 80, 10, 200, 0, 10]);
        assert_eq!(opt.service(), Some(([10, 200, 0, 10], 80)));
        // A record-route option (type 7) is no service.
        assert_eq!(DsrOption { kind: 7, ..opt }.service(), None);
        assert_eq!(size_of::<DsrOption>(), 8);
    }

    #[test]
    fn an_ipv6_header_is_three_units_and_names_its_service_and_next_protocol() {
        let address = [0xfd, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];
        let hdr = DsrHeader6::new(6, address, 80);
        assert_eq!(size_of::<DsrHeader6>(), HDR6_LEN as usize);
        // Byte for byte as Cilium's nodes write and read it.
        // SAFETY: a repr(C) struct of bytes, no padding.
        let bytes: [u8; 24] = unsafe { core::mem::transmute(hdr) };
        assert_eq!(bytes[..4], [6, 2, 0x1b, 20]);
        assert_eq!(bytes[4..20], address);
        assert_eq!(bytes[20..], [0, 80, 0, 0]);
        assert_eq!(hdr.service(), Some((address, 80)));
        // A header of another length, or a padding option first, is not ours.
        assert_eq!(DsrHeader6 { hdr_len: 0, ..hdr }.service(), None);
        assert_eq!(DsrHeader6 { kind: 1, ..hdr }.service(), None);
    }

    #[test]
    fn the_client_s_packets_carry_the_option_and_only_the_pod_s_syn_ack_is_clamped() {
        use crate::{
            CT_FLAG_DSR as DSR, CT_FLAG_ESTABLISHED as EST, CT_FLAG_REPLY as REPLY, CT_FLAG_SNAT,
            ct::{TCP_ACK, TCP_FIN, TCP_SYN},
        };
        for tcp in [TCP_SYN, TCP_ACK, TCP_FIN | TCP_ACK, 0] {
            assert_eq!(action(DSR, tcp), INSERT, "client {tcp:#x}");
            assert_eq!(action(DSR | EST, tcp), INSERT, "client {tcp:#x}");
            // Flows without DSR: nothing, whatever the packet.
            assert_eq!(action(CT_FLAG_SNAT, tcp), 0);
            assert_eq!(action(REPLY | EST, tcp | TCP_SYN), 0);
        }
        assert_eq!(action(DSR | REPLY, TCP_SYN | TCP_ACK), CLAMP);
        for tcp in [TCP_ACK, TCP_FIN | TCP_ACK, 0] {
            assert_eq!(action(DSR | REPLY | EST, tcp), 0, "pod {tcp:#x}");
        }
    }

    #[test]
    fn the_mss_is_lowered_by_the_overhead_and_small_ones_are_left_alone() {
        assert_eq!(clamped_mss(1460, overhead(false)), Some(1452));
        assert_eq!(clamped_mss(1440, overhead(true)), Some(1416));
        assert_eq!(clamped_mss(543, overhead(false)), None);
        assert_eq!(clamped_mss(544, overhead(false)), Some(536));
        assert_eq!(clamped_mss(536, overhead(true)), None);
    }
}
