//! Layout versions of the maps, so a new agent can tell whether a previous
//! agent's pinned maps hold entries it can read: the same version is reused
//! as it is, a known older (or newer) one is converted, an unknown one is
//! started afresh. Bump a map's version whenever its key or value changes.

pub const SERVICES: u32 = 1;
pub const BACKENDS: u32 = 1;
/// 2: `CtEntryV2`, with packets and bytes per direction; 1:
/// `CtEntryV1`, without them (the `ct-lean` build).
pub const CONNTRACK: u32 = if cfg!(feature = "ct-lean") { 1 } else { 2 };
pub const AFFINITY: u32 = 1;
pub const SOCK_REV_NAT: u32 = 1;
pub const FRAGMENTS: u32 = 1;
pub const SOCK_FLOWS: u32 = 1;
pub const SOCK_REV_NAT6: u32 = 1;
/// As `CONNTRACK`: 1 in the `ct-lean` build.
pub const CONNTRACK6: u32 = CONNTRACK;
pub const AFFINITY6: u32 = 1;

/// Value of the one-element `LAYOUT` map: the layout version of each map as
/// the agent that pinned them wrote them. Its own layout never changes:
/// maps added later take the reserved words, in order. Pins without a
/// `LAYOUT` map are those of the first release, whose layouts are version 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Layouts {
    pub services: u32,
    pub backends: u32,
    pub conntrack: u32,
    pub affinity: u32,
    pub sock_rev_nat: u32,
    pub fragments: u32,
    pub sock_flows: u32,
    pub sock_rev_nat6: u32,
    pub conntrack6: u32,
    pub affinity6: u32,
    pub _reserved: [u32; 6],
}

impl Layouts {
    /// This build's layouts.
    pub const CURRENT: Layouts = Layouts {
        services: SERVICES,
        backends: BACKENDS,
        conntrack: CONNTRACK,
        affinity: AFFINITY,
        sock_rev_nat: SOCK_REV_NAT,
        fragments: FRAGMENTS,
        sock_flows: SOCK_FLOWS,
        sock_rev_nat6: SOCK_REV_NAT6,
        conntrack6: CONNTRACK6,
        affinity6: AFFINITY6,
        _reserved: [0; 6],
    };

    /// What unversioned pins (the first release) hold.
    pub const FIRST: Layouts = Layouts {
        services: 1,
        backends: 1,
        conntrack: 1,
        affinity: 1,
        sock_rev_nat: 1,
        fragments: 1,
        // The first release had no such maps.
        sock_flows: 0,
        sock_rev_nat6: 0,
        conntrack6: 0,
        affinity6: 0,
        _reserved: [0; 6],
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<ServiceKey>(), 12);
        assert_eq!(size_of::<ServiceValue>(), 16);
        assert_eq!(size_of::<Backend>(), 8);
        assert_eq!(size_of::<RevNat>(), 8);
        assert_eq!(size_of::<SockRevNatKey>(), 16);
        assert_eq!(size_of::<SockRevNat>(), 12);
        assert_eq!(size_of::<SockEndKey>(), 24);
        assert_eq!(size_of::<FrontendInfo>(), 152);
        assert_eq!(size_of::<AffinityKey>(), 16);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<CtKey>(), 16);
        assert_eq!(size_of::<CtEntryV1>(), 32);
        assert_eq!(size_of::<CtEntryV2>(), 48);
        assert_eq!(size_of::<Layouts>(), 64);
        assert_eq!(size_of::<SourceRangeKey>(), 8);
        assert_eq!(size_of::<FragKey>(), 12);
        assert_eq!(size_of::<FragRewrite>(), 8);
        assert_eq!(size_of::<Config>(), 88);
        assert_eq!(size_of::<SockFlowKey>(), 16);
        assert_eq!(size_of::<SockFlow>(), 16);
        assert_eq!(size_of::<ServiceKey6>(), 24);
        assert_eq!(size_of::<Backend6>(), 20);
        assert_eq!(size_of::<RevNat6>(), 20);
        assert_eq!(size_of::<SockRevNatKey6>(), 32);
        assert_eq!(size_of::<SockRevNat6>(), 24);
        assert_eq!(size_of::<CtKey6>(), 40);
        assert_eq!(size_of::<CtEntry6V1>(), 56);
        assert_eq!(size_of::<CtEntry6V2>(), 72);
        assert_eq!(size_of::<AffinityKey6>(), 24);
        assert_eq!(size_of::<SourceRangeKey6>(), 20);
        assert_eq!(size_of::<maglev::MaglevKey>(), 8);
        assert_eq!(size_of::<maglev::MaglevChunk>(), 8192);
    }
}
