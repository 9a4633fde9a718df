//! The service-map entries a sync writes, of either address family. Each
//! family has its own services, backends and reverse-NAT maps (`SERVICES`
//! and `SERVICES6`, ...: IPv4 keys stay 12 bytes, and `bpftool` prints each
//! family's addresses as they are), while backend and reverse-NAT ids come
//! from one space, so the maps keyed by id alone serve both. Pure code.

use std::net::{IpAddr, SocketAddr};

use proxy_common::{
    Backend, Backend6, BackendFlags, FrontendInfo, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, RevNat,
    RevNat6, SCOPE_EXTERNAL, SCOPE_INTERNAL, ServiceKey, ServiceKey6,
};

use crate::{
    model::{IpFamily, Protocol},
    plan::{BackendPlan, Frontend, Scope},
};

/// A key of `SERVICES` or `SERVICES6`: a frontend's slot 0, or one of its
/// backend slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SlotKey {
    V4(ServiceKey),
    V6(ServiceKey6),
}

/// A value of `BACKENDS` or `BACKENDS6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BackendEntry {
    V4(Backend),
    V6(Backend6),
}

/// A value of `REV_NAT` or `REV_NAT6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RevNatEntry {
    V4(RevNat),
    V6(RevNat6),
}

pub fn proto(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => IPPROTO_TCP,
        Protocol::Udp => IPPROTO_UDP,
        Protocol::Sctp => IPPROTO_SCTP,
    }
}

fn protocol(proto: u8) -> Protocol {
    match proto {
        IPPROTO_UDP => Protocol::Udp,
        IPPROTO_SCTP => Protocol::Sctp,
        _ => Protocol::Tcp,
    }
}

/// A frontend's protocol and scope as the maps' keys hold them.
pub fn proto_and_scope(frontend: &Frontend) -> (u8, u8) {
    let scope = match frontend.scope {
        Scope::External => SCOPE_EXTERNAL,
        Scope::Internal => SCOPE_INTERNAL,
    };
    (proto(frontend.protocol), scope)
}

/// The frontend at `ip` and `port` with a protocol and a scope as the maps'
/// keys hold them.
fn frontend(ip: IpAddr, port: u16, proto: u8, scope: u8) -> Frontend {
    let frontend = Frontend::new(ip, port, protocol(proto));
    if scope == SCOPE_INTERNAL { frontend.internal() } else { frontend }
}

impl SlotKey {
    pub fn new(frontend: &Frontend, slot: u16) -> Self {
        let (proto, scope) = proto_and_scope(frontend);
        let port = frontend.port;
        match frontend.ip {
            IpAddr::V4(ip) => {
                SlotKey::V4(ServiceKey::new(ip.octets(), port, proto, slot).with_scope(scope))
            }
            IpAddr::V6(ip) => {
                SlotKey::V6(ServiceKey6::new(ip.octets(), port, proto, slot).with_scope(scope))
            }
        }
    }

    pub fn slot(&self) -> u16 {
        match self {
            SlotKey::V4(key) => key.slot,
            SlotKey::V6(key) => key.slot,
        }
    }

    pub fn family(&self) -> IpFamily {
        match self {
            SlotKey::V4(_) => IpFamily::V4,
            SlotKey::V6(_) => IpFamily::V6,
        }
    }

    /// The frontend whose entry this is.
    pub fn frontend(&self) -> Frontend {
        match self {
            SlotKey::V4(k) => frontend(k.address.into(), k.port, k.proto, k.scope),
            SlotKey::V6(k) => frontend(k.address.into(), k.port, k.proto, k.scope),
        }
    }
}

impl BackendEntry {
    /// A planned backend of `frontend`, as its family's map holds it.
    pub fn new(frontend: &Frontend, planned: &BackendPlan) -> Self {
        let (port, proto) = (planned.addr.port(), proto(frontend.protocol));
        let flags = BackendFlags::EMPTY.with_local(planned.local).with_host(planned.host);
        match planned.addr.ip() {
            IpAddr::V4(ip) => {
                BackendEntry::V4(Backend { address: ip.octets(), port, proto, flags })
            }
            IpAddr::V6(ip) => {
                BackendEntry::V6(Backend6 { address: ip.octets(), port, proto, flags })
            }
        }
    }

    pub fn addr(&self) -> SocketAddr {
        match self {
            BackendEntry::V4(b) => SocketAddr::from((b.address, b.port)),
            BackendEntry::V6(b) => SocketAddr::from((b.address, b.port)),
        }
    }

    pub fn proto(&self) -> u8 {
        match self {
            BackendEntry::V4(b) => b.proto,
            BackendEntry::V6(b) => b.proto,
        }
    }

    pub fn flags(&self) -> BackendFlags {
        match self {
            BackendEntry::V4(b) => b.flags,
            BackendEntry::V6(b) => b.flags,
        }
    }

    pub fn family(&self) -> IpFamily {
        match self {
            BackendEntry::V4(_) => IpFamily::V4,
            BackendEntry::V6(_) => IpFamily::V6,
        }
    }

    /// As a plan names it.
    pub fn plan(&self) -> BackendPlan {
        let flags = self.flags();
        BackendPlan { addr: self.addr().into(), local: flags.is_local(), host: flags.is_host() }
    }
}

impl RevNatEntry {
    /// The address replies of `frontend`'s flows come from.
    pub fn new(frontend: &Frontend) -> Self {
        let port = frontend.port;
        match frontend.ip {
            IpAddr::V4(ip) => RevNatEntry::V4(RevNat { address: ip.octets(), port, _pad: 0 }),
            IpAddr::V6(ip) => RevNatEntry::V6(RevNat6 { address: ip.octets(), port, _pad: 0 }),
        }
    }

    /// The frontend whose reverse-NAT entry this is and whose info is
    /// `info`; `None` if the info does not say its protocol (an older
    /// agent's).
    pub fn frontend(&self, info: &FrontendInfo) -> Option<Frontend> {
        let (ip, port) = match self {
            RevNatEntry::V4(r) => (IpAddr::from(r.address), r.port),
            RevNatEntry::V6(r) => (IpAddr::from(r.address), r.port),
        };
        (info.proto != 0).then(|| frontend(ip, port, info.proto, info.scope))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::EndpointAddr;

    #[test]
    fn each_family_keys_its_own_map_and_reads_back() {
        let v4 = Frontend::new("10.96.0.10".parse().unwrap(), 53, Protocol::Udp).internal();
        let v6 = Frontend::new("fd00:96::a".parse().unwrap(), 80, Protocol::Tcp);
        for (frontend, family) in [(v4, IpFamily::V4), (v6, IpFamily::V6)] {
            let key = SlotKey::new(&frontend, 3);
            assert_eq!((key.family(), key.slot(), key.frontend()), (family, 3, frontend));
            let planned = BackendPlan {
                addr: EndpointAddr::new(frontend.ip, 8080),
                local: true,
                host: false,
            };
            let backend = BackendEntry::new(&frontend, &planned);
            assert_eq!((backend.family(), backend.plan()), (family, planned));
            assert_eq!(backend.proto(), proto(frontend.protocol));
        }
        match SlotKey::new(&v6, 0) {
            SlotKey::V6(key) => assert_eq!(key.address[..2], [0xfd, 0x00]),
            SlotKey::V4(_) => panic!("an IPv6 frontend in the IPv4 map"),
        }
    }
}
