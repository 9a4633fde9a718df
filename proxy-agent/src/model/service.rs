//! Services as kube-proxy reads them: the proxied ports of a Service, one
//! per port and IP family, as the API server would have validated it.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use k8s_openapi::api::core::v1::ServiceSpec;

use super::{
    balancing::{Choice, ForwardingMode, LbAlgorithm},
    endpoint::Endpoint,
    error::ModelError,
    vocabulary::{Cidr, IpFamily, Protocol, ServiceName, ServicePortName},
};
use crate::{
    intern,
    objects::{self, SOURCE_RANGES_ANNOTATION},
};

/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT_SECS: u32 = 10_800;
const MAX_AFFINITY_TIMEOUT_SECS: i32 = 86_400;

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

/// A Service as read: its ports without endpoints, or why it is invalid.
/// Shared: the manifests source's copy of a file's objects and the store's
/// are one.
pub type ParsedService = Result<Arc<[ServicePort]>, ModelError>;

/// Reads a Service as the API server would have validated it: its proxied
/// ports, without endpoints (none when it is not proxied), or why it
/// cannot be used.
/// `name` is its name, shared by its ports' names.
pub fn parse_service(name: &ServiceName, service: objects::Service) -> ParsedService {
    let Some(spec) = service.spec.as_ref() else { return Ok(Arc::default()) };
    if !is_proxied(&service, spec) {
        return Ok(Arc::default());
    }
    let cluster_ips = cluster_ips(name, spec)?;
    let affinity_timeout_secs = affinity_timeout(name, spec)?;
    let externals = Externals::of(name, &service, spec)?;
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
    // Held per service for as long as it exists: exactly its ports, not a
    // growing vector's four for one.
    Ok(ports.into())
}
