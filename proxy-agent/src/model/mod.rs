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
//!
//! By concern, as kube-proxy splits them, each using only those before it:
//! the shared [`vocabulary`], the [`error`]s, an [`endpoint`], the
//! [`balancing`] annotations, the semantics of [`service`]s, those of
//! [`endpoint_slice`]s (which fill a service's ports), and here the
//! [`Model`] of them all.

pub mod balancing;
pub mod endpoint;
pub mod endpoint_slice;
pub mod error;
pub mod service;
pub mod vocabulary;

use std::collections::BTreeMap;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

pub use self::{
    balancing::{Annotated, Choice, ForwardingMode, LbAlgorithm, LbMode},
    endpoint::{Endpoint, Hints},
    endpoint_slice::{ParsedSlice, parse_slice, with_endpoints},
    error::ModelError,
    service::{DEFAULT_AFFINITY_TIMEOUT_SECS, Exposure, ParsedService, ServicePort, parse_service},
    vocabulary::{
        Cidr, EndpointAddr, InvalidCidr, IpFamily, Protocol, ServiceName, ServicePortName, v4, v6,
    },
};
use crate::objects;

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
    /// [`crate::compact::refill`]).
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
            .and_then(|name| parse_service(&name, objects::Service::from_api(service)));
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

fn object_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    kind: &'static str,
) -> Result<ServiceName, ModelError> {
    ServiceName::of(meta).ok_or(ModelError::Unnamed { kind })
}

#[cfg(test)]
mod tests;
