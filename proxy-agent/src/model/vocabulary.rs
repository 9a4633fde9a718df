//! The words the model is written in, shared by Services, EndpointSlices
//! and every layer above them: names, protocols, IP families, endpoint
//! addresses and CIDRs.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

/// `namespace/name`, how kube-proxy names a service in logs and comments.
///
/// Shared strings: a name is held by the source, the store, the model and
/// the plan, a hundred thousand times over, and a copy is a reference.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ServiceName {
    /// The name of an object; `None` when it has none. No namespace means
    /// `default`, as kubectl applies it.
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<Self> {
        let name = meta.name.as_deref().filter(|n| !n.is_empty())?.into();
        let namespace = meta.namespace.as_deref().unwrap_or("default").into();
        Some(ServiceName { namespace, name })
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `namespace/name:port`, or `namespace/name` for an unnamed port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub service: ServiceName,
    pub port: Arc<str>,
}

#[cfg(test)]
impl ServicePortName {
    /// `ns/name:port`, for tests.
    pub fn of(ns: &str, name: &str, port: &str) -> Self {
        ServicePortName {
            service: ServiceName { namespace: ns.into(), name: name.into() },
            port: port.into(),
        }
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// Parses a Kubernetes protocol name; absent means TCP; anything but
    /// the three Kubernetes knows is an error.
    pub(super) fn parse(value: Option<&str>) -> Result<Self, String> {
        let value = value.unwrap_or("TCP");
        Protocol::ALL.into_iter().find(|p| p.as_str() == value).ok_or_else(|| value.to_string())
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// The name iptables, conntrack and kube-proxy's chain hashes use.
    pub fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// An IP family, as Kubernetes names it in `ipFamilies`, an EndpointSlice's
/// `addressType` and kube-proxy's `ip_family` metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    /// `IPv4` or `IPv6`; anything else (`FQDN`) is no IP family.
    pub fn parse(name: &str) -> Option<Self> {
        IpFamily::ALL.into_iter().find(|f| f.as_str() == name)
    }
}

/// The IPv4 address, if `ip` is one: how the IPv4-only parts of the
/// datapaths take the addresses of IPv4 ports.
pub fn v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(_) => None,
    }
}

/// The IPv6 address, if `ip` is one.
pub fn v6(ip: IpAddr) -> Option<Ipv6Addr> {
    match ip {
        IpAddr::V4(_) => None,
        IpAddr::V6(ip) => Some(ip),
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An endpoint's address and port: 20 bytes where a `SocketAddr` takes 32
/// (room for an IPv6 flow label and scope that endpoints never have), and a
/// cluster's million endpoints are held in their slices and in the model.
/// Ordered, printed and parsed as the `SocketAddr` it stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointAddr {
    ip: IpAddr,
    port: u16,
}

impl EndpointAddr {
    pub fn new(ip: IpAddr, port: u16) -> Self {
        EndpointAddr { ip, port }
    }

    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl From<SocketAddr> for EndpointAddr {
    fn from(addr: SocketAddr) -> Self {
        EndpointAddr::new(addr.ip(), addr.port())
    }
}

impl From<EndpointAddr> for SocketAddr {
    fn from(addr: EndpointAddr) -> Self {
        SocketAddr::new(addr.ip, addr.port)
    }
}

impl fmt::Display for EndpointAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        SocketAddr::from(*self).fmt(f)
    }
}

impl std::str::FromStr for EndpointAddr {
    type Err = std::net::AddrParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse::<SocketAddr>().map(EndpointAddr::from)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid CIDR {0:?}")]
pub struct InvalidCidr(pub String);

/// An IPv4 or IPv6 prefix, its host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n` or `x::y/n` (a bare address is a /32 or /128).
    pub fn parse(text: &str) -> Result<Self, InvalidCidr> {
        let invalid = || InvalidCidr(text.to_string());
        let (addr, len) = match text.trim().split_once('/') {
            Some((addr, len)) => (addr, Some(len)),
            None => (text.trim(), None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| invalid())?;
        let max = Self::max_len(addr);
        let len = match len {
            Some(len) => len.parse::<u8>().ok().filter(|l| *l <= max).ok_or_else(invalid)?,
            None => max,
        };
        Ok(Cidr { addr: Self::masked(addr, len), len })
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.addr)
    }

    /// An address of another family is never inside.
    pub fn contains(&self, ip: IpAddr) -> bool {
        IpFamily::of(ip) == self.family() && Self::masked(ip, self.len) == self.addr
    }

    fn max_len(addr: IpAddr) -> u8 {
        match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        }
    }

    fn masked(addr: IpAddr, len: u8) -> IpAddr {
        let keep = |bits: u32| u128::MAX.checked_shl(bits - u32::from(len)).unwrap_or(0);
        match addr {
            IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(u32::from(v4) & keep(32) as u32)),
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & keep(128))),
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}
