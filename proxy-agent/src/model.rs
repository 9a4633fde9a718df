//! What the services are: kube-proxy's semantics applied to Service and
//! EndpointSlice objects. Pure code, no I/O.
//!
//! - Headless (`clusterIP: None`) and `ExternalName` services, and services
//!   labelled `service.kubernetes.io/service-proxy-name`, are not proxied.
//! - Endpoints come from the EndpointSlices labelled
//!   `kubernetes.io/service-name`; slices of one service are merged and
//!   de-duplicated. A service port is matched to a slice port by name and
//!   protocol, and takes that slice's port number: that is how a named
//!   `targetPort` resolves to different numbers on different pods.
//! - Ready endpoints are used; when none is ready, the serving and
//!   terminating ones are (graceful termination).
//! - A Service the API server would have refused (bad IP, port out of range,
//!   unknown protocol, duplicate port, cluster IPs that disagree with
//!   `ipFamilies` or `ipFamilyPolicy`) is skipped whole and reported by name.
//! - Dual stack as kube-proxy's proxier per family sees it: a service has a
//!   set of ports per family of its `clusterIPs` (`ipFamilies` tells which
//!   is which), each with only that family's externalIPs, load-balancer IPs
//!   and source ranges, and the endpoints of that family's EndpointSlices
//!   (`addressType`; FQDN slices are ignored).

pub mod balancing;

pub use balancing::{
    ANNOTATIONS as BALANCING_ANNOTATIONS, Annotated, Choice, ForwardingMode, LbAlgorithm, LbMode,
};

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::SystemTime,
};

use k8s_openapi::api::{
    core::v1::{Service, ServiceSpec},
    discovery::v1::EndpointSlice,
};

use crate::{
    intern::{self, Interner},
    objects,
};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT_SECS: u32 = 10_800;
const MAX_AFFINITY_TIMEOUT_SECS: i32 = 86_400;

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
}

impl Protocol {
    /// Parses a Kubernetes protocol name; absent means TCP. SCTP is valid
    /// but not proxied (`Ok(None)`); anything else is an error.
    fn parse(value: Option<&str>) -> Result<Option<Self>, String> {
        match value.unwrap_or("TCP") {
            "TCP" => Ok(Some(Protocol::Tcp)),
            "UDP" => Ok(Some(Protocol::Udp)),
            "SCTP" => Ok(None),
            other => Err(other.to_string()),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }

    /// The name iptables, conntrack and kube-proxy's chain hashes use.
    pub fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
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

/// One endpoint of a service port, with the EndpointSlice conditions.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    /// Of the family of its service port's cluster IP.
    pub addr: EndpointAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Its node and hints, behind a thin pointer (an endpoint is 32
    /// bytes): one allocation shared by the endpoints in the same place,
    /// as a cluster has millions of endpoints and few nodes.
    place: Option<Arc<Place>>,
}

/// Where an endpoint runs and which clients it should serve.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Place {
    node_name: Option<Arc<str>>,
    /// EndpointSlice hints, boxed: most endpoints have none.
    hints: Option<Box<Hints>>,
}

impl Place {
    /// `None` for an endpoint of no node without hints.
    fn of(node_name: Option<Arc<str>>, hints: Option<Box<Hints>>) -> Option<Place> {
        (node_name.is_some() || hints.is_some()).then_some(Place { node_name, hints })
    }

    /// The shared place equal to this one: every endpoint on a node (with
    /// the same hints) names one, across slices.
    fn shared(self) -> Arc<Place> {
        thread_local! {
            static PLACES: RefCell<Interner<Place>> = RefCell::default();
        }
        PLACES.with_borrow_mut(|places| places.get(&self, |place| Arc::new(place.clone())))
    }
}

/// The zones (`forZones`) and nodes (`forNodes`) an endpoint should serve.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hints {
    pub zones: Vec<String>,
    pub nodes: Vec<String>,
}

impl Hints {
    /// `None` when there are no hints.
    pub fn new(zones: Vec<String>, nodes: Vec<String>) -> Option<Box<Hints>> {
        (!zones.is_empty() || !nodes.is_empty()).then(|| Box::new(Hints { zones, nodes }))
    }
}

impl Endpoint {
    /// An endpoint in these conditions, of no node and without hints.
    pub fn new(addr: EndpointAddr, ready: bool, serving: bool, terminating: bool) -> Self {
        Endpoint { addr, ready, serving, terminating, place: None }
    }

    /// The same on `node_name`, with `hints`.
    pub fn placed(self, node_name: Option<Arc<str>>, hints: Option<Box<Hints>>) -> Self {
        Endpoint { place: Place::of(node_name, hints).map(Arc::new), ..self }
    }

    pub fn node_name(&self) -> Option<&str> {
        self.place.as_ref()?.node_name.as_deref()
    }

    fn hints(&self) -> Option<&Hints> {
        self.place.as_ref()?.hints.as_deref()
    }

    pub fn zone_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.zones)
    }

    pub fn node_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.nodes)
    }
}

/// One proxied port of a service in one IP family: what kube-proxy's
/// proxier of that family calls a ServicePort. Every address in it is of
/// the family of `cluster_ip`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub name: Arc<ServicePortName>,
    pub protocol: Protocol,
    pub port: u16,
    pub cluster_ip: IpAddr,
    /// `nodePort` of a NodePort or LoadBalancer service.
    pub node_port: Option<u16>,
    /// Its external and load-balancer IPs with their source ranges, when
    /// it has any (see [`Exposure::boxed`]).
    pub exposure: Option<Box<Exposure>>,
    /// `externalTrafficPolicy: Local` on a service with external addresses.
    pub external_local: bool,
    /// `healthCheckNodePort` (LoadBalancer with externalTrafficPolicy Local).
    pub health_check_node_port: Option<u16>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `Some(timeout)` for `sessionAffinity: ClientIP`.
    pub affinity_timeout_secs: Option<u32>,
    /// How its external frontends pick a backend, and how they send flows
    /// to backends on other nodes, as its annotations say (one byte each).
    pub lb_algorithm: Choice<LbAlgorithm>,
    pub forwarding_mode: Choice<ForwardingMode>,
    /// All endpoints found, sorted by address, one per address. A port
    /// with one slice shares that slice's list (a million endpoints are
    /// held once, not once per slice and again per port).
    pub endpoints: Arc<[Endpoint]>,
}

/// The addresses a port is reached at beyond its cluster IP and node port.
/// Most ports have none, and a large cluster's store and model hold
/// hundreds of thousands of ports: boxed, and left out when empty, they
/// take 8 bytes of a port rather than 72.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exposure {
    /// `spec.externalIPs` of this family.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` of this family (LoadBalancer).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `loadBalancerSourceRanges` of this family: who may reach the
    /// load-balancer IPs.
    pub source_ranges: Vec<Cidr>,
}

impl Exposure {
    /// As a port holds it: `None` when empty, so that equal ports compare
    /// equal.
    pub fn boxed(self) -> Option<Box<Exposure>> {
        (self != Exposure::default()).then(|| Box::new(self))
    }
}

impl ServicePort {
    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.cluster_ip)
    }

    /// `spec.externalIPs` of this family.
    pub fn external_ips(&self) -> &[IpAddr] {
        self.exposure.as_ref().map_or(&[], |e| &e.external_ips)
    }

    /// `status.loadBalancer.ingress[].ip` of this family (LoadBalancer).
    pub fn load_balancer_ips(&self) -> &[IpAddr] {
        self.exposure.as_ref().map_or(&[], |e| &e.load_balancer_ips)
    }

    /// `loadBalancerSourceRanges` of this family: who may reach the
    /// load-balancer IPs.
    pub fn source_ranges(&self) -> &[Cidr] {
        self.exposure.as_ref().map_or(&[], |e| &e.source_ranges)
    }

    /// The endpoints traffic goes to: the ready ones, or when none is ready
    /// the serving and terminating ones. With `local_node`, only those on
    /// that node (the fallback applies among them, as in kube-proxy).
    pub fn usable_endpoints(&self, local_node: Option<&str>) -> Vec<&Endpoint> {
        let candidates = || {
            self.endpoints
                .iter()
                .filter(move |e| local_node.is_none() || e.node_name() == local_node)
        };
        let ready: Vec<_> = candidates().filter(|e| e.ready).collect();
        if !ready.is_empty() {
            return ready;
        }
        candidates().filter(|e| e.serving && e.terminating).collect()
    }

    /// The endpoints Cluster-policy traffic from `node_name` (in `zone`)
    /// goes to, as kube-proxy picks them: the ready ones, narrowed by the
    /// EndpointSlice hints when every ready endpoint has one and some name
    /// this node (`forNodes`, trafficDistribution PreferSameNode) or else
    /// its zone (`forZones`: PreferClose/PreferSameZone, topology-mode
    /// Auto); when none is ready, the serving and terminating ones, hints
    /// ignored.
    pub fn cluster_endpoints(&self, node_name: &str, zone: Option<&str>) -> Vec<&Endpoint> {
        let ready: Vec<&Endpoint> = self.endpoints.iter().filter(|e| e.ready).collect();
        if ready.is_empty() {
            return self.usable_endpoints(None);
        }
        let narrowed = |hints: fn(&Endpoint) -> &[String], to: &str| -> Option<Vec<&Endpoint>> {
            if !ready.iter().all(|e| !hints(e).is_empty()) {
                return None;
            }
            let hinted: Vec<&Endpoint> =
                ready.iter().copied().filter(|e| hints(e).iter().any(|h| h == to)).collect();
            (!hinted.is_empty()).then_some(hinted)
        };
        narrowed(Endpoint::node_hints, node_name)
            .or_else(|| zone.and_then(|zone| narrowed(Endpoint::zone_hints, zone)))
            .unwrap_or(ready)
    }

    /// Whether the service has an endpoint traffic could use, anywhere.
    pub fn has_endpoints(&self) -> bool {
        !self.usable_endpoints(None).is_empty()
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

/// Why an object, or part of one, was not used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("Service {service}: invalid clusterIP {value:?}")]
    InvalidClusterIp { service: ServiceName, value: String },
    #[error("Service {service}: {why}")]
    InvalidIpFamilies { service: ServiceName, why: String },
    #[error("Service {service}: port {port_name:?} has invalid port number {port}")]
    InvalidPort { service: ServiceName, port_name: String, port: i32 },
    #[error("Service {service}: port {port_name:?} has unsupported protocol {protocol:?}")]
    UnsupportedProtocol { service: ServiceName, port_name: String, protocol: String },
    #[error("Service {service}: port {port}/{} is declared twice", protocol.as_str())]
    DuplicatePort { service: ServiceName, port: u16, protocol: Protocol },
    #[error("Service {service}: sessionAffinity timeoutSeconds {value} is outside 1..=86400")]
    InvalidAffinityTimeout { service: ServiceName, value: i32 },
    #[error("Service {service}: invalid {field} entry {value:?}")]
    InvalidAddress { service: ServiceName, field: &'static str, value: String },
    #[error("Service {service}: port {port_name:?} has invalid nodePort {port}")]
    InvalidNodePort { service: ServiceName, port_name: String, port: i32 },
    #[error("Service {service}: unknown sessionAffinity {value:?}")]
    InvalidAffinity { service: ServiceName, value: String },
    #[error("{kind} without metadata.name")]
    Unnamed { kind: &'static str },
    #[error("EndpointSlice {slice}: invalid endpoint address {value:?}")]
    InvalidEndpointAddress { slice: ServiceName, value: String },
    #[error("EndpointSlice {slice}: port {port_name:?} has unknown protocol {protocol:?}")]
    UnsupportedSlicePortProtocol { slice: ServiceName, port_name: String, protocol: String },
    #[error("EndpointSlice {slice}: port {port_name:?} has invalid port number {port:?}")]
    InvalidEndpointPort { slice: ServiceName, port_name: String, port: Option<i32> },
}

impl ModelError {
    /// The kind of object the error is about, for the metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::Unnamed { kind } => kind,
            ModelError::InvalidEndpointAddress { .. }
            | ModelError::InvalidEndpointPort { .. }
            | ModelError::UnsupportedSlicePortProtocol { .. } => "EndpointSlice",
            _ => "Service",
        }
    }
}

/// The proxied service ports, by service, plus what was wrong with the
/// input. Kept up to date one service at a time.
#[derive(Debug, Default)]
pub struct Model {
    services: BTreeMap<ServiceName, Vec<ServicePort>>,
    pub errors: Vec<ModelError>,
}

impl Model {
    /// A model of these ports (tests, tools).
    pub fn from_ports(ports: impl IntoIterator<Item = ServicePort>) -> Model {
        let mut by_service: BTreeMap<ServiceName, Vec<ServicePort>> = BTreeMap::new();
        for port in ports {
            by_service.entry(port.name.service.clone()).or_default().push(port);
        }
        let mut model = Model::default();
        for (name, ports) in by_service {
            model.set_service(name, ports);
        }
        model
    }

    /// Every port, by service name, port name, family and protocol.
    pub fn ports(&self) -> impl Iterator<Item = &ServicePort> {
        self.services.values().flatten()
    }

    /// The ports of one family: what kube-proxy's proxier of that family
    /// serves.
    pub fn ports_of(&self, family: IpFamily) -> impl Iterator<Item = &ServicePort> {
        self.ports().filter(move |p| p.family() == family)
    }

    /// The ports of one service (none if it is not proxied).
    pub fn service(&self, name: &ServiceName) -> &[ServicePort] {
        self.services.get(name).map_or(&[], Vec::as_slice)
    }

    pub fn service_names(&self) -> impl Iterator<Item = &ServiceName> {
        self.services.keys()
    }

    /// Rebuilds the map of services dense after `grown` were set (see
    /// [`compact::refill`]).
    pub fn refill(&mut self, grown: usize) {
        crate::compact::refill(&mut self.services, grown);
    }

    /// Replaces a service's ports; none removes it.
    pub fn set_service(&mut self, name: ServiceName, mut ports: Vec<ServicePort>) {
        if ports.is_empty() {
            self.services.remove(&name);
        } else {
            ports.sort_by(|a, b| {
                let key = |p: &ServicePort| (p.family(), p.protocol);
                a.name.cmp(&b.name).then(key(a).cmp(&key(b)))
            });
            self.services.insert(name, ports);
        }
    }
}

/// Applies kube-proxy's semantics to a snapshot of Services and EndpointSlices.
pub fn build(services: &[Service], slices: &[EndpointSlice]) -> Model {
    let mut errors = Vec::new();
    let mut by_service: BTreeMap<ServiceName, Vec<ParsedSlice>> = BTreeMap::new();
    for slice in slices {
        match object_name(&slice.metadata, "EndpointSlice") {
            Ok(name) => {
                let parsed = parse_slice(&name, objects::EndpointSlice::from_api(slice));
                errors.extend(parsed.errors.iter().cloned());
                if let Some(service) = parsed.service.clone() {
                    by_service.entry(service).or_default().push(parsed);
                }
            }
            Err(err) => errors.push(err),
        }
    }
    let mut ports = Vec::new();
    for service in services {
        let parsed = object_name(&service.metadata, "Service")
            .and_then(|name| parse_service(&name, &objects::Service::from_api(service)));
        match parsed {
            Ok(templates) => {
                let Some(first) = templates.first() else { continue };
                let slices = by_service.get(&first.name.service).into_iter().flatten();
                ports.extend(with_endpoints(&templates, slices));
            }
            Err(err) => errors.push(err),
        }
    }
    Model { errors, ..Model::from_ports(ports) }
}

/// Key of one slice port: (port name, protocol).
type SlicePortKey = (Arc<str>, Protocol);

fn object_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    kind: &'static str,
) -> Result<ServiceName, ModelError> {
    ServiceName::of(meta).ok_or(ModelError::Unnamed { kind })
}

/// An EndpointSlice as the proxy reads it: all it keeps of one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedSlice {
    /// The service it belongs to (`kubernetes.io/service-name`, in its
    /// namespace); `None` when the proxy has no use for it (FQDN,
    /// unlabelled).
    pub service: Option<ServiceName>,
    /// Its `addressType` (meaningless without `service`).
    family: Option<IpFamily>,
    /// Per slice port, its endpoints with its number: sorted by address,
    /// one per address, as a service port holds them.
    ports: Vec<(SlicePortKey, Arc<[Endpoint]>)>,
    /// Addresses and ports that were skipped.
    pub errors: Vec<ModelError>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`.
    pub trigger_time: Option<SystemTime>,
}

/// Reads EndpointSlice `slice_name` (taking its endpoints): what the proxy
/// keeps of it. Its service's name shares the slice's namespace.
pub fn parse_slice(slice_name: &ServiceName, slice: objects::EndpointSlice) -> ParsedSlice {
    let trigger_time = slice.trigger_time.as_deref().and_then(crate::time::parse_rfc3339);
    let mut parsed = ParsedSlice { trigger_time, ..ParsedSlice::default() };
    // FQDN slices are not proxied, as in kube-proxy.
    let (Some(service), Some(family)) = (slice.service_name, IpFamily::parse(&slice.address_type))
    else {
        return parsed;
    };
    parsed.service =
        Some(ServiceName { namespace: slice_name.namespace.clone(), name: service.into() });
    parsed.family = Some(family);
    let ports = slice_ports(slice_name, slice.ports, &mut parsed.errors);
    // Exactly as many as listed: a million endpoints are held here.
    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
    for endpoint in slice.endpoints {
        let ip = match endpoint.address {
            objects::Address::None => continue,
            objects::Address::Ip(ip) if IpFamily::of(ip) == family => Ok(ip),
            // An address of the other family is not one of this slice's.
            objects::Address::Ip(ip) => Err(ip.to_string()),
            objects::Address::Invalid(text) => Err(text),
        };
        let ip = match ip {
            Ok(ip) => ip,
            Err(value) => {
                let slice = slice_name.clone();
                parsed.errors.push(ModelError::InvalidEndpointAddress { slice, value });
                continue;
            }
        };
        let conditions = endpoint.conditions;
        endpoints.push(Endpoint {
            addr: EndpointAddr::new(ip, 0),
            // Unset conditions mean ready, serving, not terminating (as
            // kube-proxy reads them).
            ready: conditions.ready.unwrap_or(true),
            serving: conditions.serving.unwrap_or(true),
            terminating: conditions.terminating.unwrap_or(false),
            place: Place::of(endpoint.node_name, endpoint.hints).map(Place::shared),
        });
    }
    one_per_address(&mut endpoints);
    parsed.ports = ports
        .into_iter()
        .map(|(key, number)| {
            let numbered = endpoints
                .iter()
                .map(|e| Endpoint { addr: EndpointAddr::new(e.addr.ip(), number), ..e.clone() });
            (key, numbered.collect())
        })
        .collect();
    parsed
}

/// A slice's ports the proxy can use, by (name, protocol); the others are
/// reported.
fn slice_ports(
    slice_name: &ServiceName,
    ports: Vec<objects::SlicePort>,
    errors: &mut Vec<ModelError>,
) -> Vec<(SlicePortKey, u16)> {
    let mut usable = Vec::with_capacity(ports.len());
    for port in ports {
        let port_name = port.name.unwrap_or_default();
        let protocol = match Protocol::parse(port.protocol.as_deref()) {
            Ok(Some(protocol)) => protocol,
            Ok(None) => continue,
            Err(protocol) => {
                errors.push(ModelError::UnsupportedSlicePortProtocol {
                    slice: slice_name.clone(),
                    port_name,
                    protocol,
                });
                continue;
            }
        };
        let number = port.port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0);
        let Some(number) = number else {
            errors.push(ModelError::InvalidEndpointPort {
                slice: slice_name.clone(),
                port_name,
                port: port.port,
            });
            continue;
        };
        usable.push(((intern::name(&port_name), protocol), number));
    }
    usable
}

/// A service's ports (from [`parse_service`]) with the endpoints of its
/// slices: merged, one per address; a service port takes the number of the
/// slice port of its family with its name and protocol.
pub fn with_endpoints<'a>(
    ports: &[ServicePort],
    slices: impl IntoIterator<Item = &'a ParsedSlice>,
) -> Vec<ServicePort> {
    let slices: Vec<&ParsedSlice> = slices.into_iter().collect();
    ports
        .iter()
        .map(|port| {
            let lists = slices
                .iter()
                .filter(|slice| slice.family == Some(port.family()))
                .flat_map(|slice| {
                    slice.ports.iter().filter(|((name, protocol), _)| {
                        **name == *port.name.port && *protocol == port.protocol
                    })
                })
                .map(|(_, endpoints)| endpoints);
            ServicePort { endpoints: merged(lists), ..port.clone() }
        })
        .collect()
}

/// Endpoint lists of one service port merged: one list is shared as it is.
fn merged<'a>(mut lists: impl Iterator<Item = &'a Arc<[Endpoint]>>) -> Arc<[Endpoint]> {
    let Some(first) = lists.next() else { return Arc::default() };
    let Some(second) = lists.next() else { return first.clone() };
    let mut all: Vec<Endpoint> =
        [first, second].into_iter().chain(lists).flat_map(|list| list.iter().cloned()).collect();
    one_per_address(&mut all);
    all.into()
}

/// Sorts by address, keeping one endpoint per address: the first in the
/// best state (the same endpoint in two slices during a rebalance, or
/// listed twice in one).
fn one_per_address(endpoints: &mut Vec<Endpoint>) {
    // Stable: among equals, the first listed stays first.
    endpoints.sort_by_key(|e| (e.addr, std::cmp::Reverse((e.ready, e.serving))));
    endpoints.dedup_by_key(|e| e.addr);
}

fn is_proxied(service: &objects::Service, spec: &ServiceSpec) -> bool {
    let labelled = service.service_proxy_name.is_some();
    let external_name = spec.type_.as_deref() == Some("ExternalName");
    let headless = matches!(spec.cluster_ip.as_deref(), None | Some("") | Some("None"));
    !(labelled || external_name || headless)
}

fn affinity_timeout(name: &ServiceName, spec: &ServiceSpec) -> Result<Option<u32>, ModelError> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => Ok(None),
        Some("ClientIP") => {
            let configured = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match configured {
                None => Ok(Some(DEFAULT_AFFINITY_TIMEOUT_SECS)),
                Some(secs @ 1..=MAX_AFFINITY_TIMEOUT_SECS) => Ok(Some(secs as u32)),
                Some(value) => {
                    Err(ModelError::InvalidAffinityTimeout { service: name.clone(), value })
                }
            }
        }
        Some(other) => {
            Err(ModelError::InvalidAffinity { service: name.clone(), value: other.to_string() })
        }
    }
}

/// The LoadBalancer source-ranges annotation kube-proxy still honours when
/// the field is empty.
pub const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

/// The service-wide part of its external exposure (both families).
struct Externals {
    has_node_ports: bool,
    external_ips: Vec<IpAddr>,
    load_balancer_ips: Vec<IpAddr>,
    source_ranges: Vec<Cidr>,
    external_local: bool,
}

impl Externals {
    /// `port` at `cluster_ip`, with the external addresses of its family.
    fn in_family(&self, port: &ServicePort, cluster_ip: IpAddr) -> ServicePort {
        let family = IpFamily::of(cluster_ip);
        let of_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
            ips.iter().copied().filter(|ip| IpFamily::of(*ip) == family).collect()
        };
        let exposure = Exposure {
            external_ips: of_family(&self.external_ips),
            load_balancer_ips: of_family(&self.load_balancer_ips),
            source_ranges: self
                .source_ranges
                .iter()
                .copied()
                .filter(|c| c.family() == family)
                .collect(),
        };
        ServicePort { cluster_ip, exposure: exposure.boxed(), ..port.clone() }
    }

    fn of(
        name: &ServiceName,
        service: &objects::Service,
        spec: &ServiceSpec,
    ) -> Result<Self, ModelError> {
        let kind = spec.type_.as_deref().unwrap_or("ClusterIP");
        let load_balancer = kind == "LoadBalancer";
        let invalid = |field: &'static str, value: &str| ModelError::InvalidAddress {
            service: name.clone(),
            field,
            value: value.to_string(),
        };
        let mut external_ips = Vec::new();
        for raw in spec.external_ips.iter().flatten() {
            external_ips.push(raw.parse().map_err(|_| invalid("externalIPs", raw))?);
        }
        let mut load_balancer_ips = Vec::new();
        if load_balancer {
            let ingress = service.status.as_ref().and_then(|s| s.load_balancer.as_ref());
            for entry in ingress.and_then(|lb| lb.ingress.as_ref()).into_iter().flatten() {
                // Hostname-only entries (some clouds) have nothing to proxy,
                // and `ipMode: Proxy` ones are handled by the load balancer.
                let Some(raw) = &entry.ip else { continue };
                if entry.ip_mode.as_deref() == Some("Proxy") {
                    continue;
                }
                let ip = raw.parse().map_err(|_| invalid("status.loadBalancer.ingress", raw))?;
                load_balancer_ips.push(ip);
            }
        }
        let annotation = service
            .annotations
            .get(SOURCE_RANGES_ANNOTATION)
            .map(|v| v.split(',').map(str::to_string).collect::<Vec<_>>());
        let ranges = match &spec.load_balancer_source_ranges {
            Some(ranges) if !ranges.is_empty() => ranges.clone(),
            _ => annotation.unwrap_or_default(),
        };
        let mut source_ranges = Vec::new();
        for raw in ranges.iter().filter(|r| !r.trim().is_empty()) {
            source_ranges
                .push(Cidr::parse(raw).map_err(|_| invalid("loadBalancerSourceRanges", raw))?);
        }
        let has_node_ports = kind == "NodePort" || load_balancer;
        let external = has_node_ports || !external_ips.is_empty();
        Ok(Externals {
            has_node_ports,
            external_ips,
            load_balancer_ips,
            source_ranges,
            external_local: external && spec.external_traffic_policy.as_deref() == Some("Local"),
        })
    }
}

/// The service's cluster IPs, one per family, as the API server validates
/// them: `clusterIPs` (else `clusterIP`), its first entry `clusterIP`, at
/// most one per family, the family of each the one `ipFamilies` names at
/// its index, as many as `ipFamilyPolicy` allows.
fn cluster_ips(name: &ServiceName, spec: &ServiceSpec) -> Result<Vec<IpAddr>, ModelError> {
    let invalid = |why: String| ModelError::InvalidIpFamilies { service: name.clone(), why };
    let raw: Vec<&String> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().collect(),
        _ => spec.cluster_ip.iter().collect(),
    };
    let mut ips = Vec::new();
    for value in raw {
        let ip = value.parse::<IpAddr>().map_err(|_| ModelError::InvalidClusterIp {
            service: name.clone(),
            value: value.clone(),
        })?;
        ips.push(ip);
    }
    if let (Some(primary), Some(first)) = (&spec.cluster_ip, ips.first())
        && primary.parse::<IpAddr>().ok() != Some(*first)
    {
        return Err(invalid(format!("clusterIP {primary} is not clusterIPs[0] {first}")));
    }
    let families: Vec<IpFamily> = ips.iter().map(|ip| IpFamily::of(*ip)).collect();
    if families.len() > 2 || (families.len() == 2 && families[0] == families[1]) {
        return Err(invalid(format!("clusterIPs {ips:?} are not one per IP family")));
    }
    for (index, declared) in spec.ip_families.iter().flatten().enumerate() {
        let family = IpFamily::parse(declared)
            .ok_or_else(|| invalid(format!("unknown ipFamilies entry {declared:?}")))?;
        if families.get(index).is_some_and(|f| *f != family) {
            return Err(invalid(format!(
                "ipFamilies[{index}] {declared} is not clusterIPs[{index}]'s family"
            )));
        }
    }
    match (spec.ip_family_policy.as_deref(), ips.len()) {
        (None | Some("PreferDualStack"), _)
        | (Some("SingleStack"), 1)
        | (Some("RequireDualStack"), 2) => Ok(ips),
        (Some(policy), n) => {
            Err(invalid(format!("ipFamilyPolicy {policy} with {n} cluster IP(s)")))
        }
    }
}

/// Reads a Service as the API server would have validated it: its proxied
/// ports, without endpoints (none when it is not proxied), or why it
/// cannot be used.
/// `name` is its name, shared by its ports' names.
pub fn parse_service(
    name: &ServiceName,
    service: &objects::Service,
) -> Result<Vec<ServicePort>, ModelError> {
    let Some(spec) = service.spec.as_ref() else { return Ok(Vec::new()) };
    if !is_proxied(service, spec) {
        return Ok(Vec::new());
    }
    let cluster_ips = cluster_ips(name, spec)?;
    let affinity_timeout_secs = affinity_timeout(name, spec)?;
    let externals = Externals::of(name, service, spec)?;
    let lb_algorithm = Choice::of(&service.annotations);
    let forwarding_mode = Choice::of(&service.annotations);

    let mut seen = BTreeSet::new();
    let mut ports = Vec::new();
    for port in spec.ports.iter().flatten() {
        let port_name = port.name.clone().unwrap_or_default();
        let protocol = Protocol::parse(port.protocol.as_deref()).map_err(|protocol| {
            ModelError::UnsupportedProtocol {
                service: name.clone(),
                port_name: port_name.clone(),
                protocol,
            }
        })?;
        let Some(protocol) = protocol else {
            tracing::debug!(service = %name, port = %port_name, "SCTP port: not proxied");
            continue;
        };
        let number = u16::try_from(port.port).ok().filter(|p| *p != 0).ok_or_else(|| {
            ModelError::InvalidPort {
                service: name.clone(),
                port_name: port_name.clone(),
                port: port.port,
            }
        })?;
        if !seen.insert((number, protocol)) {
            return Err(ModelError::DuplicatePort {
                service: name.clone(),
                port: number,
                protocol,
            });
        }
        let node_port = match (externals.has_node_ports, port.node_port) {
            (true, Some(n)) if n != 0 => {
                Some(u16::try_from(n).ok().filter(|n| *n != 0).ok_or_else(|| {
                    ModelError::InvalidNodePort {
                        service: name.clone(),
                        port_name: port_name.clone(),
                        port: n,
                    }
                })?)
            }
            _ => None,
        };
        let template = ServicePort {
            name: Arc::new(ServicePortName {
                service: name.clone(),
                port: intern::name(&port_name),
            }),
            protocol,
            port: number,
            cluster_ip: Ipv4Addr::UNSPECIFIED.into(),
            node_port,
            exposure: None,
            external_local: externals.external_local,
            // Only LoadBalancer services with policy Local have one (the API
            // server clears it otherwise; manifests are not validated).
            health_check_node_port: spec
                .health_check_node_port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| {
                    *p != 0
                        && externals.external_local
                        && spec.type_.as_deref() == Some("LoadBalancer")
                }),
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            affinity_timeout_secs,
            lb_algorithm,
            forwarding_mode,
            endpoints: Arc::default(),
        };
        ports.extend(cluster_ips.iter().map(|ip| externals.in_family(&template, *ip)));
    }
    // Held per service for as long as it exists: not a growing vector's
    // four ports for one.
    ports.shrink_to_fit();
    Ok(ports)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_objects::{EndpointBuilder, Protocol::*, ServiceBuilder, ep, port, slice};

    fn hinted(endpoints: impl IntoIterator<Item = EndpointBuilder>) -> ServicePort {
        let web = svc("web", "10.96.0.10").port(port(None, 80));
        let endpoints = web.slice().port(None, 8080, Tcp).endpoints(endpoints);
        let model = crate::source::model_of(&[web.build()], &[endpoints.build()]);
        model.ports().next().unwrap().clone()
    }

    fn ips(endpoints: Vec<&Endpoint>) -> Vec<String> {
        endpoints.iter().map(|e| e.addr.ip().to_string()).collect()
    }

    fn parsed_slice(slice: EndpointSlice) -> ParsedSlice {
        parse_slice(
            &ServiceName::of(&slice.metadata).unwrap(),
            objects::EndpointSlice::from_api(&slice),
        )
    }

    #[test]
    fn an_endpoint_is_32_bytes_and_endpoints_on_one_node_share_their_place_across_slices() {
        // A million endpoints are held: each byte is a MiB.
        assert_eq!(std::mem::size_of::<Endpoint>(), 32);
        let endpoints = [ep("10.244.0.1").node("a"), ep("10.244.0.2").node("a"), ep("10.244.0.3")];
        let slice = parsed_slice(web_slice("s", 8080, endpoints));
        let list = &slice.ports[0].1;
        let place = |i: usize| list[i].place.as_ref();
        assert!(Arc::ptr_eq(place(0).unwrap(), place(1).unwrap()), "one place for node a");
        assert_eq!((list[0].node_name(), list[2].node_name()), (Some("a"), None));
        let other = parsed_slice(web_slice("t", 8080, [ep("10.244.0.4").node("a")]));
        let theirs = other.ports[0].1[0].place.as_ref().unwrap();
        assert!(Arc::ptr_eq(place(0).unwrap(), theirs), "and another slice's");
        assert!(Arc::ptr_eq(&slice.ports[0].0.0, &other.ports[0].0.0), "one port name");
    }

    #[test]
    fn topology_hints_narrow_cluster_endpoints_as_kube_proxy() {
        let port = hinted([
            ep("10.0.0.1").for_zone("a").for_node("n1"),
            ep("10.0.0.2").for_zone("a").for_node("n2"),
            ep("10.0.0.3").for_zone("b").for_node("n3"),
        ]);
        // Node hints first (PreferSameNode), then zone hints.
        assert_eq!(ips(port.cluster_endpoints("n1", Some("a"))), ["10.0.0.1"]);
        assert_eq!(ips(port.cluster_endpoints("n9", Some("a"))), ["10.0.0.1", "10.0.0.2"]);
        // A zone no endpoint is hinted for, or no zone: all of them.
        assert_eq!(port.cluster_endpoints("n9", Some("c")).len(), 3);
        assert_eq!(port.cluster_endpoints("n9", None).len(), 3);

        // One endpoint without hints: hints are ignored.
        let partial = hinted([ep("10.0.0.1").for_zone("a"), ep("10.0.0.2")]);
        assert_eq!(partial.cluster_endpoints("n1", Some("a")).len(), 2);

        // Only terminating endpoints left: those, hints ignored.
        let terminating = hinted([terminating("10.0.0.1", true).for_zone("b")]);
        assert_eq!(ips(terminating.cluster_endpoints("n1", Some("a"))), ["10.0.0.1"]);
    }

    /// A malformed Service, as YAML.
    fn service(yaml: &str) -> Service {
        crate::yaml::from_str(yaml).unwrap()
    }

    /// Service `default/name` at `cluster_ip`.
    fn svc(name: &str, cluster_ip: &str) -> ServiceBuilder {
        test_objects::service("default", name).cluster_ip(cluster_ip)
    }

    /// Service `shop/web`: http 80 → the endpoints' `http`, dns 53/UDP.
    fn web() -> Service {
        let http = port("http", 80).target_name("http");
        let web = test_objects::service("shop", "web").cluster_ip("10.96.0.10").port(http);
        web.port(port("dns", 53).udp()).build()
    }

    /// An endpoint not ready, terminating, `serving` or not.
    fn terminating(ip: &str, serving: bool) -> EndpointBuilder {
        ep(ip).ready(false).serving(serving).terminating(true)
    }

    fn web_slice(
        name: &str,
        port: i32,
        endpoints: impl IntoIterator<Item = EndpointBuilder>,
    ) -> EndpointSlice {
        let slice = slice("shop", name).service("web").port("http", port, Tcp);
        slice.port("dns", 5353, Udp).endpoints(endpoints).build()
    }

    fn eps(ips: &[&str]) -> Vec<EndpointBuilder> {
        ips.iter().map(|ip| ep(ip)).collect()
    }

    fn http(model: &Model) -> &ServicePort {
        model.ports().find(|p| &*p.name.port == "http").expect("the http port")
    }

    fn addrs(port: &ServicePort) -> Vec<String> {
        port.usable_endpoints(None).iter().map(|e| e.addr.to_string()).collect()
    }

    #[test]
    fn named_target_port_resolves_per_slice_and_slices_merge() {
        let slices = [
            web_slice("web-a", 8080, eps(&["10.244.0.2", "10.244.0.3"])),
            web_slice("web-b", 9090, eps(&["10.244.0.4", "10.244.0.2"])),
        ];
        let model = build(&[web()], &slices);
        assert!(model.errors.is_empty(), "{:?}", model.errors);
        let http = model.ports().find(|p| &*p.name.port == "http").unwrap();
        assert_eq!(
            addrs(http),
            ["10.244.0.2:8080", "10.244.0.2:9090", "10.244.0.3:8080", "10.244.0.4:9090"]
        );
        let dns = model.ports().find(|p| &*p.name.port == "dns").unwrap();
        assert_eq!(dns.protocol, Protocol::Udp);
        assert_eq!(addrs(dns), ["10.244.0.2:5353", "10.244.0.3:5353", "10.244.0.4:5353"]);
        assert_eq!(http.name.to_string(), "shop/web:http");
    }

    #[test]
    fn duplicate_endpoints_across_slices_keep_the_ready_one() {
        let slices = [
            web_slice("a", 8080, [ep("10.244.0.2").ready(false)]),
            web_slice("b", 8080, [ep("10.244.0.2").ready(true)]),
        ];
        let model = build(&[web()], &slices);
        let http = model.ports().find(|p| &*p.name.port == "http").unwrap();
        assert_eq!(http.endpoints.len(), 1);
        assert!(http.endpoints[0].ready);
    }

    #[test]
    fn a_port_with_one_slice_shares_its_sorted_list_and_duplicates_in_it_keep_the_ready_one() {
        let endpoints = [
            ep("10.244.0.3"),
            ep("10.244.0.2").ready(false),
            ep("10.244.0.2").ready(true).node("b"),
            ep("10.244.0.2").ready(true).node("c"),
        ];
        let slice = parsed_slice(web_slice("a", 8080, endpoints));
        let web = web();
        let name = ServiceName::of(&web.metadata).unwrap();
        let templates = parse_service(&name, &objects::Service::from_api(&web)).unwrap();
        let ports = with_endpoints(&templates, [&slice]);
        let http = ports.iter().find(|p| &*p.name.port == "http").unwrap();
        assert!(Arc::ptr_eq(&http.endpoints, &slice.ports[0].1), "held once");
        assert_eq!(addrs(http), ["10.244.0.2:8080", "10.244.0.3:8080"]);
        // The first of the ready ones, as across slices.
        assert_eq!(http.endpoints[0].node_name(), Some("b"));

        // Two slices: a list of their own, merged.
        let other = parsed_slice(web_slice("b", 8080, [ep("10.244.0.4")]));
        let ports = with_endpoints(&templates, [&slice, &other]);
        let http = ports.iter().find(|p| &*p.name.port == "http").unwrap();
        assert_eq!(addrs(http), ["10.244.0.2:8080", "10.244.0.3:8080", "10.244.0.4:8080"]);
    }

    #[test]
    fn ready_endpoints_win_then_serving_terminating_fallback() {
        let mixed = web_slice(
            "a",
            8080,
            [
                ep("10.244.0.2").ready(true),
                terminating("10.244.0.3", true),
                ep("10.244.0.4").ready(false).serving(false),
            ],
        );
        let model = build(&[web()], &[mixed]);
        assert_eq!(addrs(http(&model)), ["10.244.0.2:8080"]);

        let terminating = web_slice(
            "a",
            8080,
            [
                terminating("10.244.0.3", true),
                terminating("10.244.0.4", false),
                ep("10.244.0.5").ready(false).serving(true).terminating(false),
            ],
        );
        let model = build(&[web()], &[terminating]);
        assert_eq!(addrs(http(&model)), ["10.244.0.3:8080"]);
    }

    #[test]
    fn unset_serving_means_serving_for_the_terminating_fallback() {
        let s = web_slice("a", 8080, [ep("10.244.0.3").ready(false).terminating(true)]);
        assert_eq!(addrs(http(&build(&[web()], &[s]))), ["10.244.0.3:8080"]);
    }

    #[test]
    fn sctp_ports_are_skipped_not_rejected() {
        let sctp =
            svc("a", "10.96.0.3").port(port("x", 80)).port(port("y", 90).protocol(Sctp)).build();
        let model = build(std::slice::from_ref(&sctp), &[]);
        assert!(model.errors.is_empty());
        assert_eq!(model.ports().count(), 1, "the TCP port is still served");
        let sctp_slice = slice("default", "s").service("a").port("y", 90, Sctp);
        let sctp_slice = sctp_slice.endpoint(ep("10.244.0.2")).build();
        assert!(build(&[sctp], &[sctp_slice]).errors.is_empty());
    }

    /// `default/dual`: IPv6 first, then IPv4 (as `ipFamilies` says), with
    /// external addresses and source ranges of both families.
    fn dual_stack() -> ServiceBuilder {
        let dual = svc("dual", "fd00:96::10").cluster_ips(&["fd00:96::10", "10.96.0.4"]);
        let dual = dual.ip_families(&["IPv6", "IPv4"]).ip_family_policy("RequireDualStack");
        let dual = dual.load_balancer_type().port(port("http", 80).node_port(30080));
        let dual = dual.external_ips(&["10.200.0.5", "fd00:200::5"]);
        let dual = dual.ingress_ip("fd00:201::1").ingress_ip("10.201.0.1");
        dual.source_ranges(&["192.168.0.0/16", "fd00:c0::/48"])
    }

    #[test]
    fn a_dual_stack_service_has_a_port_per_family_with_its_family_s_addresses() {
        let model = build(&[dual_stack().build()], &[]);
        assert!(model.errors.is_empty(), "{:?}", model.errors);
        // Cluster IP, external IPs, load-balancer IPs, source ranges.
        let text = |port: &ServicePort| {
            let ranges: Vec<String> = port.source_ranges().iter().map(|c| c.to_string()).collect();
            let (ext, lb) = (port.external_ips(), port.load_balancer_ips());
            format!("{} {ext:?} {lb:?} {ranges:?}", port.cluster_ip)
        };
        let v4: Vec<_> = model.ports_of(IpFamily::V4).map(text).collect();
        let v6: Vec<_> = model.ports_of(IpFamily::V6).map(text).collect();
        assert_eq!(v4, [r#"10.96.0.4 [10.200.0.5] [10.201.0.1] ["192.168.0.0/16"]"#]);
        assert_eq!(v6, [r#"fd00:96::10 [fd00:200::5] [fd00:201::1] ["fd00:c0::/48"]"#]);
        assert!(model.ports().all(|p| p.node_port == Some(30080) && &*p.name.port == "http"));
        // IPv4 first in the model's order, then IPv6.
        let families: Vec<_> = model.ports().map(ServicePort::family).collect();
        assert_eq!(families, [IpFamily::V4, IpFamily::V6]);
    }

    #[test]
    fn each_family_takes_only_its_own_slices_and_fqdn_slices_are_ignored() {
        let dual = dual_stack();
        let v4 = dual.slice().port("http", 8080, Tcp).endpoint(ep("10.244.0.2"));
        let v6 = slice("default", "dual-2").service("dual").address_type("IPv6");
        let v6 = v6.port("http", 8080, Tcp).endpoint(ep("fd00:244::2"));
        let fqdn = slice("default", "dual-3").service("dual").address_type("FQDN");
        let fqdn = fqdn.port("http", 8080, Tcp).endpoint(ep("web.example"));
        let slices = [v4.build(), v6.build(), fqdn.build()];
        let model = build(&[dual.build()], &slices);
        assert!(model.errors.is_empty(), "{:?}", model.errors);
        let endpoints = |family| addrs(model.ports_of(family).next().unwrap());
        assert_eq!(endpoints(IpFamily::V4), ["10.244.0.2:8080"]);
        assert_eq!(endpoints(IpFamily::V6), ["[fd00:244::2]:8080"]);

        // An address of the other family in a slice is skipped and reported.
        let wrong = slice("default", "dual-4").service("dual").address_type("IPv6");
        let wrong = wrong.port("http", 8080, Tcp).endpoint(ep("10.244.0.3")).build();
        let model = build(&[dual_stack().build()], &[wrong]);
        assert_eq!(model.errors.len(), 1, "{:?}", model.errors);
        assert!(model.ports().all(|p| p.endpoints.is_empty()));
    }

    #[test]
    fn single_family_services_of_either_family() {
        let v6 = svc("b", "fd00::10").cluster_ips(&["fd00::10"]).ip_families(&["IPv6"]);
        let model = build(&[v6.ip_family_policy("SingleStack").port(port(None, 80)).build()], &[]);
        assert!(model.errors.is_empty(), "{:?}", model.errors);
        let families: Vec<_> = model.ports().map(ServicePort::family).collect();
        assert_eq!(families, [IpFamily::V6]);
        // No clusterIPs (an older API server): clusterIP alone.
        let v4 = build(&[svc("a", "10.96.0.3").port(port(None, 80)).build()], &[]);
        assert_eq!(v4.ports().next().unwrap().cluster_ip.to_string(), "10.96.0.3");
    }

    #[test]
    fn cluster_ips_the_api_server_would_refuse_are_reported() {
        let bad = [
            svc("a", "10.96.0.3").cluster_ips(&["10.96.0.3", "10.96.0.4"]),
            svc("b", "10.96.0.3").cluster_ips(&["10.96.0.9"]),
            svc("c", "10.96.0.3").cluster_ips(&["10.96.0.3"]).ip_families(&["IPv6"]),
            svc("d", "10.96.0.3").ip_family_policy("RequireDualStack"),
            svc("e", "10.96.0.3")
                .cluster_ips(&["10.96.0.3", "fd00::3"])
                .ip_family_policy("SingleStack"),
            svc("f", "10.96.0.3").ip_families(&["IPv5"]),
            svc("g", "10.96.0.3").ip_family_policy("Sometimes"),
        ];
        for service in bad {
            let model = build(&[service.clone().port(port(None, 80)).build()], &[]);
            assert_eq!(model.errors.len(), 1, "{service:?}");
            assert!(model.ports().next().is_none(), "{service:?}");
        }
    }

    #[test]
    fn cidrs_of_both_families() {
        let cidr = |text| Cidr::parse(text).unwrap();
        assert_eq!(cidr("10.244.1.7/16").to_string(), "10.244.0.0/16");
        assert_eq!(cidr("10.0.0.1").to_string(), "10.0.0.1/32");
        assert_eq!(cidr("fd00:10:244::7/56").to_string(), "fd00:10:244::/56");
        assert_eq!(cidr("fd00::1").to_string(), "fd00::1/128");
        assert_eq!(cidr("::/0").to_string(), "::/0");
        assert!(cidr("0.0.0.0/0").contains("10.1.2.3".parse().unwrap()));
        assert!(!cidr("0.0.0.0/0").contains("fd00::1".parse().unwrap()), "another family");
        assert!(cidr("fd00:10::/32").contains("fd00:10:ffff::1".parse().unwrap()));
        assert!(!cidr("fd00:10::/32").contains("fd00:11::1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "fd00::/129", "10.0.0.0/x", "nope/8"] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn load_balancer_ips_in_proxy_mode_and_stray_health_check_ports_are_ignored() {
        use k8s_openapi::api::core::v1::LoadBalancerIngress;
        let lb = |policy| {
            let proxied = LoadBalancerIngress {
                ip: Some("10.200.0.2".into()),
                ip_mode: Some("Proxy".into()),
                ..Default::default()
            };
            let named =
                LoadBalancerIngress { hostname: Some("lb.example".into()), ..Default::default() };
            let lb = svc("a", "10.96.0.3").load_balancer_type().external_policy(policy);
            let lb = lb.health_check_node_port(32000).port(port(None, 80).node_port(30080));
            lb.ingress_ip("10.200.0.1").ingress(proxied).ingress(named).build()
        };
        let model = build(&[lb("Local")], &[]);
        let port = model.ports().next().unwrap();
        assert_eq!(port.load_balancer_ips(), [IpAddr::from([10, 200, 0, 1])]);
        assert_eq!(port.health_check_node_port, Some(32000));
        assert_eq!(
            build(&[lb("Cluster")], &[]).ports().next().unwrap().health_check_node_port,
            None
        );
    }

    #[test]
    fn headless_external_name_and_foreign_proxy_are_skipped() {
        let skipped = [
            test_objects::service("default", "a").headless().port(port(None, 80)),
            test_objects::service("default", "b").external_name("example.org"),
            svc("c", "10.96.0.3").proxy_name("other").port(port(None, 80)),
        ];
        for service in skipped {
            let model = build(&[service.clone().build()], &[]);
            assert!(model.ports().next().is_none() && model.errors.is_empty(), "{service:?}");
        }
    }

    #[test]
    fn slices_of_another_namespace_or_service_do_not_match() {
        let mut other = web_slice("x", 8080, eps(&["10.244.0.9"]));
        other.metadata.namespace = Some("default".into());
        let model = build(&[web()], &[other]);
        assert!(model.ports().all(|p| p.endpoints.is_empty()));
    }

    #[test]
    fn malformed_services_are_reported_by_name_and_skipped() {
        let bad = [
            (
                "{metadata: {name: badip}, spec: {clusterIP: 10.96.0.999, ports: [{port: 80}]}}",
                "badip",
            ),
            ("{metadata: {name: zero}, spec: {clusterIP: 10.96.0.5, ports: [{port: 0}]}}", "zero"),
            (
                "{metadata: {name: big}, spec: {clusterIP: 10.96.0.5, ports: [{port: 70000}]}}",
                "big",
            ),
            (
                "{metadata: {name: proto}, spec: {clusterIP: 10.96.0.6, ports: [{port: 80, protocol: QUIC}]}}",
                "proto",
            ),
            (
                "{metadata: {name: dup}, spec: {clusterIP: 10.96.0.7, ports: [{name: a, port: 80}, {name: b, port: 80}]}}",
                "dup",
            ),
            (
                "{metadata: {name: aff}, spec: {clusterIP: 10.96.0.8, sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}, ports: [{port: 80}]}}",
                "aff",
            ),
        ];
        for (yaml, name) in bad {
            let model = build(&[service(yaml), web()], &[]);
            assert_eq!(model.ports().count(), 2, "{yaml}: the good service is still served");
            assert_eq!(model.errors.len(), 1, "{yaml}");
            let message = model.errors[0].to_string();
            assert!(message.contains(&format!("default/{name}")), "{message}");
            assert_eq!(model.errors[0].kind(), "Service");
        }
    }

    #[test]
    fn an_endpoint_address_sorts_prints_and_parses_as_a_socket_address() {
        let texts = ["10.0.0.2:80", "10.0.0.2:8080", "10.0.0.10:80", "[fd00::1]:80", "[::1]:443"];
        let sockets: Vec<SocketAddr> = texts.iter().map(|t| t.parse().unwrap()).collect();
        let mut compact: Vec<EndpointAddr> = texts.iter().map(|t| t.parse().unwrap()).collect();
        let mut sorted = sockets.clone();
        sorted.sort();
        compact.sort();
        let printed: Vec<String> = compact.iter().map(EndpointAddr::to_string).collect();
        let expected: Vec<String> = sorted.iter().map(SocketAddr::to_string).collect();
        assert_eq!(printed, expected);
        assert!(compact.iter().zip(&sorted).all(|(c, s)| SocketAddr::from(*c) == *s));
    }

    #[test]
    fn bad_endpoint_addresses_are_skipped_alone() {
        let s = web_slice("a", 8080, eps(&["not-an-ip", "10.244.0.2"]));
        let model = build(&[web()], &[s]);
        assert_eq!(model.errors.len(), 1);
        assert!(model.errors[0].to_string().contains("shop/a"));
        assert_eq!(addrs(http(&model)), ["10.244.0.2:8080"]);
    }

    #[test]
    fn session_affinity_timeout_defaults_and_overrides() {
        let sticky = |timeout| {
            let sticky = svc("a", "10.96.0.3").client_ip_affinity(timeout).port(port(None, 80));
            build(&[sticky.build()], &[]).ports().next().unwrap().affinity_timeout_secs
        };
        assert_eq!(sticky(None), Some(10_800));
        assert_eq!(sticky(Some(5)), Some(5));
        assert_eq!(build(&[web()], &[]).ports().next().unwrap().affinity_timeout_secs, None);
    }

    #[test]
    fn unnamed_port_name_is_namespace_and_name() {
        let s = test_objects::service("n", "a").cluster_ip("10.96.0.3").port(port(None, 80));
        assert_eq!(build(&[s.build()], &[]).ports().next().unwrap().name.to_string(), "n/a");
    }
}
