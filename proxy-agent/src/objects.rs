//! The API objects as the proxy reads them: lean types that decode only the
//! fields the proxy uses (serde skips the others without building them), so
//! a list of a hundred thousand EndpointSlices never becomes a hundred
//! thousand k8s-openapi objects with their many `String`s. Both sources
//! decode into these (kube-rs's watchers, through [`kube::Resource`], and
//! the manifests), and [`crate::model`] reads only these; tests and tools
//! that build k8s-openapi objects convert them with `from_api` (through
//! serde, so by the same decoding).
//!
//! What is read, and how:
//!
//! - metadata: `name`, `namespace`, `resourceVersion` (the only fields of
//!   the [`ObjectMeta`] that [`kube::Resource::meta`] returns), the labels
//!   and annotations the proxy reads (`kubernetes.io/service-name`,
//!   `service.kubernetes.io/service-proxy-name`,
//!   `endpoints.kubernetes.io/last-change-trigger-time`, a Service's
//!   load-balancer source ranges, load-balancing algorithm and forwarding
//!   mode); `managedFields`,
//!   other labels and annotations, owner references are skipped;
//! - an endpoint: its first address, parsed as it is read (an address that
//!   does not parse is kept as text, for the error), its conditions, its
//!   node name (shared by the endpoints on one node: [`node_name`]) and its
//!   hints; `targetRef`, `zone`, `hostname`, further addresses are skipped;
//! - as in k8s-openapi, an absent or `null` field is its default.

use std::{borrow::Cow, fmt, net::IpAddr, sync::Arc};

use k8s_openapi::{
    api::core::v1::{ServiceSpec, ServiceStatus},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{
    Deserialize, Deserializer,
    de::{DeserializeOwned, IgnoredAny, MapAccess, SeqAccess, Visitor},
};

use crate::intern;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label of objects another proxy serves.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// The annotation the EndpointSlice controller sets to the time of the
/// change (a pod, a service) that led to the slice's current state.
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// The LoadBalancer source-ranges annotation kube-proxy still honours when
/// the field is empty.
pub const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";
/// The annotations that choose a service's load-balancing algorithm and
/// forwarding mode ([`crate::model::balancing`]), the project's own first,
/// then Cilium's.
pub const LB_ALGORITHM_ANNOTATIONS: [&str; 2] =
    ["proxy-agent.io/lb-algorithm", "service.cilium.io/lb-algorithm"];
pub const FORWARDING_MODE_ANNOTATIONS: [&str; 2] =
    ["proxy-agent.io/forwarding-mode", "service.cilium.io/forwarding-mode"];

/// The labels and annotations the proxy reads; others are skipped.
const KEPT: [&str; 8] = [
    SERVICE_NAME_LABEL,
    SERVICE_PROXY_NAME_LABEL,
    TRIGGER_TIME,
    SOURCE_RANGES_ANNOTATION,
    LB_ALGORITHM_ANNOTATIONS[0],
    LB_ALGORITHM_ANNOTATIONS[1],
    FORWARDING_MODE_ANNOTATIONS[0],
    FORWARDING_MODE_ANNOTATIONS[1],
];

/// `null` as the default, as k8s-openapi reads every field.
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Option::<T>::deserialize(d).map(Option::unwrap_or_default)
}

/// The entries of a label or annotation map that are in [`KEPT`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept(Vec<(&'static str, String)>);

impl Kept {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }
}

/// A map key: one of [`KEPT`], or `None` for any other (never allocated).
struct KeptKey(Option<&'static str>);

impl<'de> Deserialize<'de> for KeptKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl Visitor<'_> for Key {
            type Value = KeptKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a label or annotation key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<KeptKey, E> {
                Ok(KeptKey(KEPT.into_iter().find(|k| *k == key)))
            }
        }
        d.deserialize_str(Key)
    }
}

impl<'de> Deserialize<'de> for Kept {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Kept;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_unit<E>(self) -> Result<Kept, E> {
                Ok(Kept::default())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Kept, A::Error> {
                let mut kept = Vec::new();
                while let Some(KeptKey(key)) = map.next_key()? {
                    match key {
                        Some(key) => kept.push((key, map.next_value::<String>()?)),
                        None => drop(map.next_value::<IgnoredAny>()?),
                    }
                }
                Ok(Kept(kept))
            }
        }
        d.deserialize_any(Entries)
    }
}

/// What the proxy reads of `metadata`.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Kept,
    #[serde(default)]
    annotations: Kept,
}

impl Meta {
    fn split(self) -> (ObjectMeta, Kept, Kept) {
        let meta = ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            resource_version: self.resource_version,
            ..ObjectMeta::default()
        };
        (meta, self.labels, self.annotations)
    }
}

fn shared_node_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<str>>, D::Error> {
    let name = Option::<Cow<'de, str>>::deserialize(d)?;
    // Shared by every endpoint on that node.
    Ok(name.map(|n| intern::name(&n)))
}

/// An endpoint's first address, parsed as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Address {
    /// No address.
    #[default]
    None,
    Ip(IpAddr),
    /// Not an IP address: the text, for the error.
    Invalid(String),
}

impl<'de> Deserialize<'de> for Address {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// One address, parsed from the text without copying it.
        struct One(Address);
        impl<'de> Deserialize<'de> for One {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Text;
                impl Visitor<'_> for Text {
                    type Value = One;
                    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                        f.write_str("an address")
                    }
                    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<One, E> {
                        Ok(One(match text.parse() {
                            Ok(ip) => Address::Ip(ip),
                            Err(_) => Address::Invalid(text.to_string()),
                        }))
                    }
                }
                d.deserialize_str(Text)
            }
        }
        struct Addresses;
        impl<'de> Visitor<'de> for Addresses {
            type Value = Address;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of addresses")
            }
            fn visit_unit<E>(self) -> Result<Address, E> {
                Ok(Address::None)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Address, A::Error> {
                // kube-proxy uses the first address of an endpoint.
                let first = seq.next_element::<One>()?.map_or(Address::None, |one| one.0);
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(first)
            }
        }
        d.deserialize_any(Addresses)
    }
}

/// An endpoint's conditions; unset means ready, serving, not terminating
/// (as kube-proxy reads them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Conditions {
    #[serde(default)]
    pub ready: Option<bool>,
    #[serde(default)]
    pub serving: Option<bool>,
    #[serde(default)]
    pub terminating: Option<bool>,
}

#[derive(Default, Deserialize)]
struct Named {
    #[serde(default, deserialize_with = "nullable")]
    name: String,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawHints {
    #[serde(default, deserialize_with = "nullable")]
    for_zones: Vec<Named>,
    #[serde(default, deserialize_with = "nullable")]
    for_nodes: Vec<Named>,
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

fn hints<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Box<Hints>>, D::Error> {
    let raw: RawHints = nullable(d)?;
    let names = |named: Vec<Named>| named.into_iter().map(|n| n.name).collect();
    Ok(Hints::new(names(raw.for_zones), names(raw.for_nodes)))
}

/// An endpoint of an EndpointSlice, as the proxy reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceEndpoint {
    #[serde(default, rename = "addresses")]
    pub address: Address,
    #[serde(default, deserialize_with = "nullable")]
    pub conditions: Conditions,
    #[serde(default, deserialize_with = "shared_node_name")]
    pub node_name: Option<Arc<str>>,
    #[serde(default, deserialize_with = "hints")]
    pub hints: Option<Box<Hints>>,
}

/// A port of an EndpointSlice.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct SlicePort {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub protocol: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
}

/// An EndpointSlice (`discovery.k8s.io/v1`), as the proxy reads it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "RawSlice")]
pub struct EndpointSlice {
    /// Its name, namespace and resource version only.
    pub metadata: ObjectMeta,
    /// `kubernetes.io/service-name`.
    pub service_name: Option<String>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, as written.
    pub trigger_time: Option<String>,
    pub address_type: String,
    pub endpoints: Vec<SliceEndpoint>,
    pub ports: Vec<SlicePort>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSlice {
    #[serde(default, deserialize_with = "nullable")]
    metadata: Meta,
    #[serde(default, deserialize_with = "nullable")]
    address_type: String,
    #[serde(default, deserialize_with = "nullable")]
    endpoints: Vec<SliceEndpoint>,
    #[serde(default, deserialize_with = "nullable")]
    ports: Vec<SlicePort>,
}

impl From<RawSlice> for EndpointSlice {
    fn from(raw: RawSlice) -> Self {
        let (metadata, labels, annotations) = raw.metadata.split();
        EndpointSlice {
            metadata,
            service_name: labels.get(SERVICE_NAME_LABEL).map(str::to_string),
            trigger_time: annotations.get(TRIGGER_TIME).map(str::to_string),
            address_type: raw.address_type,
            endpoints: raw.endpoints,
            ports: raw.ports,
        }
    }
}

/// `kube::Resource` for a lean namespaced object of API version `v1` (of
/// `group`), as its k8s-openapi twin is: what the watchers need to list it.
macro_rules! namespaced_v1 {
    ($ty:ty, $kind:literal, $group:literal, $plural:literal) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = kube::core::NamespaceResourceScope;

            fn kind(_: &()) -> Cow<'_, str> {
                $kind.into()
            }

            fn group(_: &()) -> Cow<'_, str> {
                $group.into()
            }

            fn version(_: &()) -> Cow<'_, str> {
                "v1".into()
            }

            fn plural(_: &()) -> Cow<'_, str> {
                $plural.into()
            }

            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }

            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

namespaced_v1!(EndpointSlice, "EndpointSlice", "discovery.k8s.io", "endpointslices");

/// A Service (`v1`), as the proxy reads it: its spec and status as
/// k8s-openapi has them (a few fields each), its metadata lean.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "RawService")]
pub struct Service {
    /// Its name, namespace and resource version only.
    pub metadata: ObjectMeta,
    /// `service.kubernetes.io/service-proxy-name`: another proxy's.
    pub service_proxy_name: Option<String>,
    /// The annotations the model reads (source ranges, algorithm, mode).
    pub annotations: Kept,
    pub spec: Option<ServiceSpec>,
    pub status: Option<ServiceStatus>,
}

#[derive(Deserialize)]
struct RawService {
    #[serde(default, deserialize_with = "nullable")]
    metadata: Meta,
    #[serde(default)]
    spec: Option<ServiceSpec>,
    #[serde(default)]
    status: Option<ServiceStatus>,
}

impl From<RawService> for Service {
    fn from(raw: RawService) -> Self {
        let (metadata, labels, annotations) = raw.metadata.split();
        Service {
            metadata,
            service_proxy_name: labels.get(SERVICE_PROXY_NAME_LABEL).map(str::to_string),
            annotations,
            spec: raw.spec,
            status: raw.status,
        }
    }
}

namespaced_v1!(Service, "Service", "", "services");

impl Service {
    /// A k8s-openapi Service (tests, tools).
    pub fn from_api(service: &k8s_openapi::api::core::v1::Service) -> Self {
        from_api(service)
    }
}

/// A k8s-openapi object read as the proxy reads it (through its JSON, so
/// by the same decoding as the sources'), for tests and tools.
pub fn from_api<T: serde::Serialize, U: DeserializeOwned>(object: &T) -> U {
    let value = serde_json::to_value(object).expect("a k8s-openapi object is JSON");
    serde_json::from_value(value).expect("a k8s-openapi object decodes as the proxy reads it")
}

impl EndpointSlice {
    /// A k8s-openapi EndpointSlice (tests, tools).
    pub fn from_api(slice: &k8s_openapi::api::discovery::v1::EndpointSlice) -> Self {
        from_api(slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_proxy_reads_is_kept() {
        let json = r#"{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": "shop", "resourceVersion": "7",
                "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"kubernetes.io/service-name": "web", "app": "x"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:01Z",
                    "big": {"nested": [1, 2]}},
                "managedFields": [{"manager": "m", "fieldsV1": {"f:a": {}}}]},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1", "10.0.0.9"], "nodeName": "n1",
                 "targetRef": {"kind": "Pod", "name": "p"}, "zone": "z",
                 "conditions": {"ready": false, "serving": true},
                 "hints": {"forZones": [{"name": "z"}], "forNodes": null}},
                {"addresses": ["nope"], "nodeName": "n1", "conditions": null},
                {"addresses": [], "nodeName": null},
                {}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "h2c"}]}"#;
        let slice: EndpointSlice = serde_json::from_str(json).unwrap();
        assert_eq!(slice.metadata.name.as_deref(), Some("web-1"));
        assert_eq!(slice.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(slice.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(slice.metadata.uid, None);
        assert_eq!(slice.metadata.labels, None);
        assert_eq!(slice.service_name.as_deref(), Some("web"));
        assert_eq!(slice.trigger_time.as_deref(), Some("2026-01-01T00:00:01Z"));
        assert_eq!(slice.address_type, "IPv4");
        let [first, invalid, none, empty] = &slice.endpoints[..] else { panic!() };
        assert_eq!(first.address, Address::Ip("10.0.0.1".parse().unwrap()));
        assert_eq!(first.conditions.ready, Some(false));
        assert_eq!(first.conditions.terminating, None);
        assert_eq!(first.hints.as_ref().unwrap().zones, ["z"]);
        assert!(Arc::ptr_eq(
            first.node_name.as_ref().unwrap(),
            invalid.node_name.as_ref().unwrap()
        ));
        assert_eq!(invalid.address, Address::Invalid("nope".into()));
        assert_eq!((&none.address, &none.node_name), (&Address::None, &None));
        assert_eq!(empty, &SliceEndpoint::default());
        assert_eq!(slice.ports.len(), 1);
        assert_eq!(slice.ports[0].port, Some(8080));

        // Nulls and absent fields are defaults; wrong types of read fields
        // are errors.
        let bare: EndpointSlice = serde_json::from_str(
            r#"{"metadata": null, "endpoints": null, "ports": null, "addressType": null}"#,
        )
        .unwrap();
        assert_eq!(bare, EndpointSlice::default());
        assert!(
            serde_json::from_str::<EndpointSlice>(r#"{"endpoints": [{"addresses": [1]}]}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<EndpointSlice>(r#"{"ports": [{"port": "x"}]}"#).is_err());
    }

    #[test]
    fn a_service_keeps_its_spec_and_status_and_lean_metadata() {
        let built = test_objects::service("shop", "web")
            .cluster_ip("10.96.0.10")
            .port(test_objects::port("http", 80))
            .proxy_name("other")
            .label("app", "web")
            .ingress_ip("192.0.2.1")
            .build();
        let service = Service::from_api(&built);
        assert_eq!(service.metadata.name.as_deref(), Some("web"));
        assert_eq!(service.metadata.labels, None);
        assert_eq!(service.service_proxy_name.as_deref(), Some("other"));
        assert_eq!(service.spec, built.spec);
        assert_eq!(service.status, built.status);
    }

    #[test]
    fn a_k8s_openapi_slice_reads_the_same() {
        let built = test_objects::slice("shop", "web-1")
            .service("web")
            .port(Some("http"), 8080, test_objects::Protocol::Tcp)
            .endpoint(test_objects::ep("10.0.0.1").node("n1").for_zone("z"))
            .build();
        let slice = EndpointSlice::from_api(&built);
        assert_eq!(slice.service_name.as_deref(), Some("web"));
        assert_eq!(slice.endpoints[0].address, Address::Ip("10.0.0.1".parse().unwrap()));
        assert_eq!(slice.endpoints[0].node_name.as_deref(), Some("n1"));
        assert_eq!(slice.ports[0].name.as_deref(), Some("http"));
    }
}
