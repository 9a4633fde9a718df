//! EndpointSlices as kube-proxy reads them: each slice's endpoints per
//! slice port, then a service port's endpoints merged from its slices.

use std::{sync::Arc, time::SystemTime};

use super::{
    endpoint::{Endpoint, Place},
    error::ModelError,
    service::ServicePort,
    vocabulary::{EndpointAddr, IpFamily, Protocol, ServiceName},
};
use crate::{intern, objects};

/// Key of one slice port: (port name, protocol).
type SlicePortKey = (Arc<str>, Protocol);

/// An EndpointSlice as the proxy reads it: all it keeps of one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedSlice {
    /// The service it belongs to (`kubernetes.io/service-name`, in its
    /// namespace); `None` when the proxy has no use for it (FQDN,
    /// unlabelled).
    pub service: Option<ServiceName>,
    /// Its `addressType` (meaningless without `service`).
    pub(super) family: Option<IpFamily>,
    /// Per slice port, its endpoints with its number: sorted by address,
    /// one per address, as a service port holds them.
    pub(super) ports: Vec<(SlicePortKey, Arc<[Endpoint]>)>,
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
            Ok(protocol) => protocol,
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

/// A service's ports (from [`super::parse_service`]) with the endpoints of its
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
