//! The services and backends maps: frontends, their backend slots, the
//! backends and the reverse-NAT entries, of both families.

use crate::{BackendFlags, Ipv6Octets, SCOPE_EXTERNAL, ServiceFlags};

/// Key of the services map. Slot 0 is the frontend entry; slots `1..=count`
/// hold the ids of the service's backends.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub address: [u8; 4],
    pub port: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}

impl ServiceKey {
    pub const fn new(address: [u8; 4], port: u16, proto: u8, slot: u16) -> Self {
        Self { address, port, slot, proto, scope: SCOPE_EXTERNAL, _pad: [0; 2] }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }

    pub const fn with_scope(self, scope: u8) -> Self {
        Self { scope, ..self }
    }
}

/// Value of the services map. In the frontend slot `count` is the number of
/// backend slots and `backend_id` is 0; in a backend slot only `backend_id`
/// is meaningful.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub affinity_timeout_secs: u32,
    pub count: u16,
    pub flags: ServiceFlags,
}

/// Value of the backends map, keyed by a `u32` backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub address: [u8; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: BackendFlags,
}

/// Value of the reverse-NAT map, keyed by a `u32` reverse-NAT id: the
/// service address replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat {
    pub address: [u8; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Key of `SERVICES6`: as [`ServiceKey`]. The IPv6 types on the per-packet
/// path are aligned as their size allows (the layout stays): the BPF target
/// copies byte arrays it cannot assume aligned one byte at a time, and
/// 16-byte addresses copied that way fill the programs' stack.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}

impl ServiceKey6 {
    pub const fn new(address: Ipv6Octets, port: u16, proto: u8, slot: u16) -> Self {
        Self { address, port, slot, proto, scope: SCOPE_EXTERNAL, _pad: [0; 2] }
    }

    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }

    pub const fn with_scope(self, scope: u8) -> Self {
        Self { scope, ..self }
    }
}

/// Value of `BACKENDS6`, keyed by a `u32` backend id: as [`Backend`].
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub proto: u8,
    pub flags: BackendFlags,
}

/// Value of `REV_NAT6`, keyed by a `u32` reverse-NAT id: as [`RevNat`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNat6 {
    pub address: Ipv6Octets,
    pub port: u16,
    pub _pad: u16,
}
