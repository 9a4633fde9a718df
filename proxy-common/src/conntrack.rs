//! The conntrack maps' keys and values, of both families and both
//! layouts (the flow state machine is `ct`).

use crate::Ipv6Octets;

/// A conntrack key of either family ([`CtKey`], [`CtKey6`]), for code
/// written once for both (the programs' flow tracking, the agent's upkeep).
pub trait CtTuple: Copy + PartialEq {
    type Addr: Copy + PartialEq + Default;
    fn new(saddr: Self::Addr, daddr: Self::Addr, sport: u16, dport: u16, proto: u8) -> Self;
    fn saddr(&self) -> Self::Addr;
    fn daddr(&self) -> Self::Addr;
    fn sport(&self) -> u16;
    fn dport(&self) -> u16;
    fn proto(&self) -> u8;
    /// The key of the packets flowing the other way.
    fn reversed(&self) -> Self;
    fn with_sport(self, sport: u16) -> Self;
}

/// Declares a conntrack key: a packet's tuple as it is on the wire.
macro_rules! ct_key {
    ($(#[$doc:meta])* $name:ident($addr:ty)) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            pub saddr: $addr,
            pub daddr: $addr,
            pub sport: u16,
            pub dport: u16,
            pub proto: u8,
            pub _pad: [u8; 3],
        }

        impl $name {
            /// The key of the packets flowing the other way.
            pub const fn reversed(&self) -> Self {
                Self {
                    saddr: self.daddr,
                    daddr: self.saddr,
                    sport: self.dport,
                    dport: self.sport,
                    proto: self.proto,
                    _pad: [0; 3],
                }
            }
        }

        impl CtTuple for $name {
            type Addr = $addr;
            #[inline(always)]
            fn new(saddr: $addr, daddr: $addr, sport: u16, dport: u16, proto: u8) -> Self {
                Self { saddr, daddr, sport, dport, proto, _pad: [0; 3] }
            }
            #[inline(always)]
            fn saddr(&self) -> $addr {
                self.saddr
            }
            #[inline(always)]
            fn daddr(&self) -> $addr {
                self.daddr
            }
            #[inline(always)]
            fn sport(&self) -> u16 {
                self.sport
            }
            #[inline(always)]
            fn dport(&self) -> u16 {
                self.dport
            }
            #[inline(always)]
            fn proto(&self) -> u8 {
                self.proto
            }
            #[inline(always)]
            fn reversed(&self) -> Self {
                $name::reversed(self)
            }
            #[inline(always)]
            fn with_sport(self, sport: u16) -> Self {
                Self { sport, ..self }
            }
        }
    };
}

ct_key!(
    /// Key of the conntrack map.
    CtKey([u8; 4])
);

ct_key!(
    /// Key of `CONNTRACK6`, the IPv6 flows: as [`CtKey`]. Aligned to 8
    /// (its size already is a multiple, so the layout stays): the BPF target
    /// copies byte arrays it cannot assume aligned one byte at a time, and
    /// 16-byte addresses copied that way fill the programs' stack.
    #[repr(align(8))]
    CtKey6(Ipv6Octets)
);

/// `CtEntry::flags`: the entry translates replies (backend to client).
pub const CT_FLAG_REPLY: u8 = 1 << 0;
/// The flow's source was rewritten (SNAT to the node).
pub const CT_FLAG_SNAT: u8 = 1 << 1;
/// TCP: both sides sent FIN, or one sent RST: the flow is over.
pub const CT_FLAG_CLOSED: u8 = 1 << 2;
/// A packet was seen in the reply direction.
pub const CT_FLAG_SEEN_REPLY: u8 = 1 << 3;
/// TCP: the client acknowledged after the backend answered (handshake done).
pub const CT_FLAG_ESTABLISHED: u8 = 1 << 4;
/// TCP: the client sent FIN.
pub const CT_FLAG_FIN_ORIG: u8 = 1 << 5;
/// TCP: the backend sent FIN.
pub const CT_FLAG_FIN_REPLY: u8 = 1 << 6;
/// A forward entry of a flow sent by direct server return: its packets
/// carry the service in an IP option; or, on the backend's node, the
/// reply entry a packet with that option made.
pub const CT_FLAG_DSR: u8 = 1 << 7;
/// The bits both entries of a flow share (the flow's state).
pub const CT_STATE_FLAGS: u8 = CT_FLAG_CLOSED
    | CT_FLAG_SEEN_REPLY
    | CT_FLAG_ESTABLISHED
    | CT_FLAG_FIN_ORIG
    | CT_FLAG_FIN_REPLY;

/// A conntrack value of either family, for code written once for both.
pub trait CtValue: Copy {
    type Key: CtTuple;
    /// An entry rewriting packets to `to`.
    fn new(expires_ns: u64, to: &Self::Key, rev_nat_id: u32, flags: u8) -> Self;
    /// The tuple this entry rewrites packets to.
    fn rewritten(&self, proto: u8) -> Self::Key;
    fn expires_ns(&self) -> u64;
    fn flags(&self) -> u8;
    fn rev_nat_id(&self) -> u32;
    fn set_state(&mut self, flags: u8, expires_ns: u64);
    /// Whether the layout counts its packets and bytes (`account`).
    const COUNTS: bool;
    /// Counts a packet of `len` bytes (layouts with counters; else nothing).
    fn account(&mut self, len: u32);
    /// The packets and bytes counted (zero in a layout without counters).
    fn counted(&self) -> (u64, u64);
}

/// Declares a conntrack value layout: the fields every version has, then
/// the version's own (zero in a new entry; `packets` and `bytes` count).
macro_rules! ct_entry {
    ($(#[$doc:meta])* $name:ident($key:ident, $addr:ty) { $($(#[$fdoc:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub struct $name {
            /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) after which the entry is stale.
            pub expires_ns: u64,
            pub saddr: $addr,
            pub daddr: $addr,
            pub sport: u16,
            pub dport: u16,
            pub rev_nat_id: u32,
            pub flags: u8,
            pub _pad: [u8; 7],
            $($(#[$fdoc])* pub $field: $ty,)*
        }

        impl $name {
            /// An entry rewriting packets to `to`.
            pub const fn new(expires_ns: u64, to: &$key, rev_nat_id: u32, flags: u8) -> Self {
                Self {
                    expires_ns,
                    saddr: to.saddr,
                    daddr: to.daddr,
                    sport: to.sport,
                    dport: to.dport,
                    rev_nat_id,
                    flags,
                    _pad: [0; 7],
                    $($field: 0,)*
                }
            }

            /// The tuple this entry rewrites packets to.
            pub const fn rewritten(&self, proto: u8) -> $key {
                $key {
                    saddr: self.saddr,
                    daddr: self.daddr,
                    sport: self.sport,
                    dport: self.dport,
                    proto,
                    _pad: [0; 3],
                }
            }
        }

        impl CtValue for $name {
            type Key = $key;
            const COUNTS: bool = ct_entry!(@counts $($field)*);
            #[inline(always)]
            fn new(expires_ns: u64, to: &$key, rev_nat_id: u32, flags: u8) -> Self {
                $name::new(expires_ns, to, rev_nat_id, flags)
            }
            #[inline(always)]
            fn rewritten(&self, proto: u8) -> $key {
                $name::rewritten(self, proto)
            }
            #[inline(always)]
            fn expires_ns(&self) -> u64 {
                self.expires_ns
            }
            #[inline(always)]
            fn flags(&self) -> u8 {
                self.flags
            }
            #[inline(always)]
            fn rev_nat_id(&self) -> u32 {
                self.rev_nat_id
            }
            #[inline(always)]
            fn set_state(&mut self, flags: u8, expires_ns: u64) {
                self.flags = flags;
                self.expires_ns = expires_ns;
            }
            #[inline(always)]
            fn account(&mut self, _len: u32) {
                $(ct_entry!(@count self, _len, $field);)*
            }
            #[inline(always)]
            fn counted(&self) -> (u64, u64) {
                #[allow(unused_mut)]
                let mut counted = (0, 0);
                $(ct_entry!(@read self, counted, $field);)*
                counted
            }
        }
    };
    (@counts) => { false };
    (@counts $($field:ident)+) => { true };
    (@read $self:ident, $counted:ident, packets) => { $counted.0 = $self.packets };
    (@read $self:ident, $counted:ident, bytes) => { $counted.1 = $self.bytes };
    (@count $self:ident, $len:ident, packets) => { $self.packets += 1 };
    (@count $self:ident, $len:ident, bytes) => { $self.bytes += $len as u64 };
}

/// Conversions between a family's two conntrack layouts.
macro_rules! ct_layouts_convert {
    ($v1:ident, $v2:ident) => {
        impl From<$v1> for $v2 {
            /// Counting starts at the upgrade.
            fn from(v1: $v1) -> Self {
                let $v1 { expires_ns, saddr, daddr, sport, dport, rev_nat_id, flags, _pad } = v1;
                $v2 {
                    expires_ns,
                    saddr,
                    daddr,
                    sport,
                    dport,
                    rev_nat_id,
                    flags,
                    _pad,
                    packets: 0,
                    bytes: 0,
                }
            }
        }

        impl From<$v2> for $v1 {
            /// A rollback drops the counts, not the flow.
            fn from(v2: $v2) -> Self {
                let $v2 { expires_ns, saddr, daddr, sport, dport, rev_nat_id, flags, _pad, .. } =
                    v2;
                $v1 { expires_ns, saddr, daddr, sport, dport, rev_nat_id, flags, _pad }
            }
        }
    };
}

ct_entry!(
    /// Value of the conntrack map, layout 1: what a packet with the key's
    /// tuple becomes, and until when the entry lives. Each flow has two
    /// entries, one per direction; each names the other by its rewritten
    /// tuple reversed.
    CtEntryV1(CtKey, [u8; 4]) {}
);

ct_entry!(
    /// Conntrack layout 2 (the default; `ct-lean` builds use layout 1):
    /// layout 1 and what the entry's direction carried, its first packet
    /// included, as netfilter's `nf_conntrack_acct` counts. The agent sums
    /// them per frontend at each conntrack collection.
    CtEntryV2(CtKey, [u8; 4]) {
        packets: u64,
        bytes: u64,
    }
);

ct_layouts_convert!(CtEntryV1, CtEntryV2);

ct_entry!(
    /// Value of `CONNTRACK6`, layout 1: as [`CtEntryV1`].
    CtEntry6V1(CtKey6, Ipv6Octets) {}
);

ct_entry!(
    /// `CONNTRACK6` layout 2 (the default): as [`CtEntryV2`].
    CtEntry6V2(CtKey6, Ipv6Octets) {
        packets: u64,
        bytes: u64,
    }
);

ct_layouts_convert!(CtEntry6V1, CtEntry6V2);

/// The conntrack values of this build.
#[cfg(not(feature = "ct-lean"))]
pub type CtEntry = CtEntryV2;
#[cfg(feature = "ct-lean")]
pub type CtEntry = CtEntryV1;
#[cfg(not(feature = "ct-lean"))]
pub type CtEntry6 = CtEntry6V2;
#[cfg(feature = "ct-lean")]
pub type CtEntry6 = CtEntry6V1;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IPPROTO_TCP;

    #[test]
    fn conntrack_layouts_convert_both_ways_keeping_the_flow() {
        let to = CtKey {
            saddr: [1, 2, 3, 4],
            daddr: [5, 6, 7, 8],
            sport: 9,
            dport: 10,
            ..Default::default()
        };
        let v1 = CtEntryV1::new(42, &to, 7, CT_FLAG_REPLY | CT_FLAG_ESTABLISHED);
        let v2 = CtEntryV2::from(v1);
        assert_eq!(
            (v2.expires_ns, v2.rewritten(IPPROTO_TCP), v2.rev_nat_id),
            (42, CtKey { proto: IPPROTO_TCP, ..to }, 7)
        );
        assert_eq!((v2.packets, v2.bytes), (0, 0));
        let mut counted = v2;
        counted.account(100);
        counted.account(200);
        assert_eq!(counted.counted(), (2, 300));
        assert_eq!(CtEntryV1::from(counted), v1);
        // Layout 1 counts nothing.
        let mut lean = v1;
        lean.account(100);
        assert_eq!((lean, lean.counted()), (v1, (0, 0)));
        const { assert!(CtEntryV2::COUNTS && !CtEntryV1::COUNTS) };
    }
}
