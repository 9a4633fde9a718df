//! The fragments map: later fragments follow their first's translation.

/// Key of the fragments map: an IP datagram whose first fragment was
/// translated, as its later fragments carry it (they have no ports).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Value of the fragments map: the addresses the first fragment got.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragRewrite {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
}
