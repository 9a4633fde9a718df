//! The `SOURCE_RANGES` maps: a frontend's loadBalancerSourceRanges.

use crate::Ipv6Octets;

/// Data part of the `SOURCE_RANGES` LPM key: a frontend (by reverse-NAT id)
/// and a source address. The prefix length covers the 32 bits of the id,
/// then the address bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeKey {
    pub rev_nat_id: u32,
    pub address: [u8; 4],
}

/// Data part of the `SOURCE_RANGES6` LPM key: as [`SourceRangeKey`], with
/// an IPv6 source address.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeKey6 {
    pub rev_nat_id: u32,
    pub address: Ipv6Octets,
}

/// Bits of `SourceRangeKey` (and `SourceRangeKey6`) before the address.
pub const SOURCE_RANGE_PREFIX_BITS: u32 = 32;
