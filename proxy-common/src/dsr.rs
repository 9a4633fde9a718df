//! Direct server return, dispatched in an IPv4 option (Cilium's
//! `dsr-dispatch=opt`): the node a new flow enters DNATs it to a backend on
//! another node without touching the client's address, and carries the
//! service's address and port in an option of the packet's IP header, so
//! that the backend's node can rewrite the pod's replies to come from the
//! service, straight to the client.
//!
//! The option is Cilium's: type 0x9a (copied on fragmentation, class 0,
//! number 26, one the kernel skips where it does not know it), 8 bytes:
//! the type, the length, the port and the address, in network order.

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
}
