//! Services and EndpointSlices for tests, built in one line each rather
//! than written out as YAML in every test (as kube-proxy's
//! `makeTestService` / `makeTestEndpointSlice`):
//!
//! ```
//! use test_objects::{Protocol::*, ep, manifest, port, service, slice};
//!
//! let web = service("lab", "web")
//!     .cluster_ip("10.96.0.10")
//!     .node_port_type()
//!     .port(port("http", 80).target(8080).node_port(30080));
//! let endpoints = slice("lab", "web-1")
//!     .service("web")
//!     .port("http", 8080, Tcp)
//!     .endpoint(ep("10.244.1.2").node("lab-node").ready(true));
//! let yaml = manifest(&[&web, &endpoints]);
//! assert!(yaml.starts_with("---\napiVersion: v1\nkind: Service\n"));
//! ```
//!
//! Only what a test sets is set: an unset field stays absent, as in a
//! manifest that leaves it out. Tests that feed malformed objects keep
//! writing YAML: these builders make well-formed ones.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::{
            ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort,
            ServiceSpec, ServiceStatus, SessionAffinityConfig,
        },
        discovery::v1::{
            Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode,
            ForZone,
        },
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

/// The label that ties a slice to its service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that hands a service to another proxy.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// The EndpointSlice controller's stamp of the change a slice reflects.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// A port's protocol, as the API spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

fn meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(namespace.to_string()),
        ..Default::default()
    }
}

/// Sets `key` in a label or annotation map.
fn set(map: &mut Option<BTreeMap<String, String>>, key: &str, value: &str) {
    map.get_or_insert_with(BTreeMap::new).insert(key.to_string(), value.to_string());
}

fn strings(items: &[&str]) -> Option<Vec<String>> {
    Some(items.iter().map(|s| s.to_string()).collect())
}

/// A Service `namespace/name` with nothing else set yet.
pub fn service(namespace: &str, name: &str) -> ServiceBuilder {
    ServiceBuilder(Service {
        metadata: meta(namespace, name),
        spec: Some(ServiceSpec::default()),
        status: None,
    })
}

/// A Service under construction; [`ServiceBuilder::build`] gives it.
#[derive(Clone, Debug)]
pub struct ServiceBuilder(Service);

impl ServiceBuilder {
    pub fn build(self) -> Service {
        self.0
    }

    /// The service's slice `<name>-1`: same namespace, labelled as its.
    pub fn slice(&self) -> SliceBuilder {
        let meta = &self.0.metadata;
        let (namespace, name) = (meta.namespace.as_deref(), meta.name.as_deref());
        let (namespace, name) = (namespace.unwrap_or("default"), name.unwrap_or_default());
        slice(namespace, &format!("{name}-1")).service(name)
    }

    fn spec(&mut self) -> &mut ServiceSpec {
        self.0.spec.get_or_insert_with(Default::default)
    }

    fn with(mut self, f: impl FnOnce(&mut ServiceSpec)) -> Self {
        f(self.spec());
        self
    }

    /// Any string: a test may give an invalid one on purpose.
    pub fn cluster_ip(self, ip: &str) -> Self {
        self.with(|s| s.cluster_ip = Some(ip.to_string()))
    }

    /// `clusterIPs`, for dual-stack services.
    pub fn cluster_ips(self, ips: &[&str]) -> Self {
        self.with(|s| s.cluster_ips = strings(ips))
    }

    /// `ipFamilies` (`IPv4`, `IPv6`), in the order of `clusterIPs`.
    pub fn ip_families(self, families: &[&str]) -> Self {
        self.with(|s| s.ip_families = strings(families))
    }

    /// `ipFamilyPolicy`: SingleStack, PreferDualStack or RequireDualStack.
    pub fn ip_family_policy(self, policy: &str) -> Self {
        self.with(|s| s.ip_family_policy = Some(policy.to_string()))
    }

    /// `clusterIP: None`.
    pub fn headless(self) -> Self {
        self.cluster_ip("None")
    }

    /// `type`: `ClusterIP`, `NodePort`, `LoadBalancer` or `ExternalName`.
    pub fn type_(self, type_: &str) -> Self {
        self.with(|s| s.type_ = Some(type_.to_string()))
    }

    pub fn node_port_type(self) -> Self {
        self.type_("NodePort")
    }

    pub fn load_balancer_type(self) -> Self {
        self.type_("LoadBalancer")
    }

    /// `type: ExternalName` for `external_name`.
    pub fn external_name(self, external_name: &str) -> Self {
        self.type_("ExternalName").with(|s| s.external_name = Some(external_name.to_string()))
    }

    /// `externalTrafficPolicy`: `Cluster` or `Local`.
    pub fn external_policy(self, policy: &str) -> Self {
        self.with(|s| s.external_traffic_policy = Some(policy.to_string()))
    }

    /// `internalTrafficPolicy`: `Cluster` or `Local`.
    pub fn internal_policy(self, policy: &str) -> Self {
        self.with(|s| s.internal_traffic_policy = Some(policy.to_string()))
    }

    /// `sessionAffinity: ClientIP`, with its timeout when given.
    pub fn client_ip_affinity(self, timeout_seconds: Option<i32>) -> Self {
        self.with(|s| {
            s.session_affinity = Some("ClientIP".to_string());
            s.session_affinity_config = timeout_seconds.map(|t| SessionAffinityConfig {
                client_ip: Some(ClientIPConfig { timeout_seconds: Some(t) }),
            });
        })
    }

    pub fn external_ips(self, ips: &[&str]) -> Self {
        self.with(|s| s.external_ips = strings(ips))
    }

    pub fn source_ranges(self, cidrs: &[&str]) -> Self {
        self.with(|s| s.load_balancer_source_ranges = strings(cidrs))
    }

    pub fn health_check_node_port(self, port: i32) -> Self {
        self.with(|s| s.health_check_node_port = Some(port))
    }

    /// `trafficDistribution`, e.g. `PreferClose`.
    pub fn traffic_distribution(self, distribution: &str) -> Self {
        self.with(|s| s.traffic_distribution = Some(distribution.to_string()))
    }

    pub fn port(self, port: PortBuilder) -> Self {
        self.with(|s| s.ports.get_or_insert_with(Vec::new).push(port.0))
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        set(&mut self.0.metadata.labels, key, value);
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        set(&mut self.0.metadata.annotations, key, value);
        self
    }

    /// The label that hands the service to the proxy named `proxy`.
    pub fn proxy_name(self, proxy: &str) -> Self {
        self.label(SERVICE_PROXY_NAME_LABEL, proxy)
    }

    /// A load-balancer ingress IP in the status.
    pub fn ingress_ip(self, ip: &str) -> Self {
        self.ingress(LoadBalancerIngress { ip: Some(ip.to_string()), ..Default::default() })
    }

    /// A load-balancer ingress entry (`ipMode`, a hostname) in the status.
    pub fn ingress(mut self, ingress: LoadBalancerIngress) -> Self {
        let status = self.0.status.get_or_insert_with(ServiceStatus::default);
        let balancer = status.load_balancer.get_or_insert_with(LoadBalancerStatus::default);
        balancer.ingress.get_or_insert_with(Vec::new).push(ingress);
        self
    }
}

impl From<ServiceBuilder> for Service {
    fn from(builder: ServiceBuilder) -> Service {
        builder.0
    }
}

/// A service port; `name` may be `None` (a service's only port).
pub fn port<'a>(name: impl Into<Option<&'a str>>, port: i32) -> PortBuilder {
    PortBuilder(ServicePort { name: name.into().map(str::to_string), port, ..Default::default() })
}

/// A service port under construction, for [`ServiceBuilder::port`].
#[derive(Clone, Debug)]
pub struct PortBuilder(ServicePort);

impl PortBuilder {
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.0.protocol = Some(protocol.as_str().to_string());
        self
    }

    pub fn udp(self) -> Self {
        self.protocol(Protocol::Udp)
    }

    /// A numeric `targetPort`.
    pub fn target(mut self, port: i32) -> Self {
        self.0.target_port = Some(IntOrString::Int(port));
        self
    }

    /// A named `targetPort`, resolved per endpoint slice.
    pub fn target_name(mut self, name: &str) -> Self {
        self.0.target_port = Some(IntOrString::String(name.to_string()));
        self
    }

    pub fn node_port(mut self, port: i32) -> Self {
        self.0.node_port = Some(port);
        self
    }
}

/// An IPv4 EndpointSlice `namespace/name`, of no service yet.
pub fn slice(namespace: &str, name: &str) -> SliceBuilder {
    SliceBuilder(EndpointSlice {
        address_type: "IPv4".to_string(),
        endpoints: Vec::new(),
        metadata: meta(namespace, name),
        ports: None,
    })
}

/// An EndpointSlice under construction; [`SliceBuilder::build`] gives it.
#[derive(Clone, Debug)]
pub struct SliceBuilder(EndpointSlice);

impl SliceBuilder {
    pub fn build(self) -> EndpointSlice {
        self.0
    }

    /// `addressType`: IPv4 (the default), IPv6 or FQDN.
    pub fn address_type(mut self, address_type: &str) -> Self {
        self.0.address_type = address_type.to_string();
        self
    }

    /// The service the slice belongs to (its `kubernetes.io/service-name`).
    pub fn service(self, service: &str) -> Self {
        self.label(SERVICE_NAME_LABEL, service)
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        set(&mut self.0.metadata.labels, key, value);
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        set(&mut self.0.metadata.annotations, key, value);
        self
    }

    /// The controller's last-change-trigger-time (RFC 3339).
    pub fn trigger_time(self, at: &str) -> Self {
        self.annotation(TRIGGER_TIME_ANNOTATION, at)
    }

    /// A port; `name` may be `None` (for a service's unnamed port).
    pub fn port<'a>(
        mut self,
        name: impl Into<Option<&'a str>>,
        port: i32,
        protocol: Protocol,
    ) -> Self {
        self.0.ports.get_or_insert_with(Vec::new).push(EndpointPort {
            name: name.into().map(str::to_string),
            port: Some(port),
            protocol: Some(protocol.as_str().to_string()),
            ..Default::default()
        });
        self
    }

    pub fn endpoint(mut self, endpoint: EndpointBuilder) -> Self {
        self.0.endpoints.push(endpoint.0);
        self
    }

    pub fn endpoints(self, endpoints: impl IntoIterator<Item = EndpointBuilder>) -> Self {
        endpoints.into_iter().fold(self, Self::endpoint)
    }
}

impl From<SliceBuilder> for EndpointSlice {
    fn from(builder: SliceBuilder) -> EndpointSlice {
        builder.0
    }
}

/// An endpoint at `address`, its conditions unset (which means ready).
pub fn ep(address: &str) -> EndpointBuilder {
    EndpointBuilder(Endpoint { addresses: vec![address.to_string()], ..Default::default() })
}

/// An endpoint under construction, for [`SliceBuilder::endpoint`].
#[derive(Clone, Debug)]
pub struct EndpointBuilder(Endpoint);

impl EndpointBuilder {
    pub fn node(mut self, node: &str) -> Self {
        self.0.node_name = Some(node.to_string());
        self
    }

    pub fn zone(mut self, zone: &str) -> Self {
        self.0.zone = Some(zone.to_string());
        self
    }

    fn conditions(mut self, f: impl FnOnce(&mut EndpointConditions)) -> Self {
        f(self.0.conditions.get_or_insert_with(Default::default));
        self
    }

    pub fn ready(self, ready: bool) -> Self {
        self.conditions(|c| c.ready = Some(ready))
    }

    pub fn serving(self, serving: bool) -> Self {
        self.conditions(|c| c.serving = Some(serving))
    }

    pub fn terminating(self, terminating: bool) -> Self {
        self.conditions(|c| c.terminating = Some(terminating))
    }

    fn hints(&mut self) -> &mut EndpointHints {
        self.0.hints.get_or_insert_with(Default::default)
    }

    /// A topology hint for `zone`.
    pub fn for_zone(mut self, zone: &str) -> Self {
        let zones = self.hints().for_zones.get_or_insert_with(Vec::new);
        zones.push(ForZone { name: zone.to_string() });
        self
    }

    /// A topology hint for `node`.
    pub fn for_node(mut self, node: &str) -> Self {
        let nodes = self.hints().for_nodes.get_or_insert_with(Vec::new);
        nodes.push(ForNode { name: node.to_string() });
        self
    }
}

/// What a manifest holds: a Service or an EndpointSlice, built or not.
pub trait Document {
    /// The object as one YAML document, without a `---` line.
    fn yaml(&self) -> String;
}

fn to_yaml<T: serde::Serialize>(object: &T) -> String {
    serde_saphyr::to_string(object).expect("a k8s-openapi object serializes")
}

impl Document for Service {
    fn yaml(&self) -> String {
        to_yaml(self)
    }
}

impl Document for EndpointSlice {
    fn yaml(&self) -> String {
        to_yaml(self)
    }
}

impl Document for ServiceBuilder {
    fn yaml(&self) -> String {
        self.0.yaml()
    }
}

impl Document for SliceBuilder {
    fn yaml(&self) -> String {
        self.0.yaml()
    }
}

/// A multi-document YAML stream, each document after its `---` line, so
/// that two manifests concatenated are one.
pub fn manifest(objects: &[&dyn Document]) -> String {
    objects.iter().map(|o| format!("---\n{}", o.yaml())).collect()
}

#[cfg(test)]
mod tests {
    use super::{Protocol::*, *};

    /// What the manifest source and the test API server do with a stream.
    fn parse(yaml: &str) -> (Vec<Service>, Vec<EndpointSlice>) {
        let (mut services, mut slices) = (Vec::new(), Vec::new());
        for value in serde_saphyr::read::<_, serde_json::Value>(&mut yaml.as_bytes()) {
            let value = value.unwrap();
            match value["kind"].as_str() {
                Some("Service") => services.push(serde_json::from_value(value).unwrap()),
                Some("EndpointSlice") => slices.push(serde_json::from_value(value).unwrap()),
                other => panic!("{other:?}"),
            }
        }
        (services, slices)
    }

    fn every_service_field() -> ServiceBuilder {
        service("lab", "lb")
            .cluster_ip("10.96.0.12")
            .cluster_ips(&["10.96.0.12"])
            .load_balancer_type()
            .external_policy("Local")
            .internal_policy("Local")
            .client_ip_affinity(Some(60))
            .external_ips(&["10.200.0.11"])
            .source_ranges(&["192.168.100.101/32"])
            .health_check_node_port(32000)
            .traffic_distribution("PreferClose")
            .proxy_name("other")
            .port(port("http", 80).target(8080).node_port(30080))
            .port(port("dns", 53).udp().target_name("dns").node_port(30053))
            .port(port(None, 90).protocol(Sctp))
            .ingress_ip("10.200.0.10")
            .ingress(LoadBalancerIngress {
                ip: Some("10.200.0.20".into()),
                ip_mode: Some("Proxy".into()),
                ..Default::default()
            })
    }

    fn every_slice_field() -> SliceBuilder {
        slice("lab", "lb-1")
            .service("lb")
            .trigger_time("2025-06-01T10:00:00Z")
            .port("http", 8080, Tcp)
            .port("dns", 5353, Udp)
            .port(None, 90, Sctp)
            .endpoint(ep("10.244.1.2").node("lab-node").zone("zone-0").for_zone("zone-0"))
            .endpoints([
                ep("10.244.2.2").ready(false).serving(true).terminating(true),
                ep("10.244.2.3").for_node("lab-node2"),
            ])
    }

    #[test]
    fn the_yaml_parses_back_to_the_same_objects() {
        let objects = (
            [every_service_field().build(), service("lab", "headless").headless().build()],
            [every_slice_field().build(), slice("lab", "empty").build()],
        );
        let yaml = manifest(&[&objects.0[0], &objects.1[0], &objects.0[1], &objects.1[1]]);
        assert_eq!(
            every_service_field().slice().build().metadata,
            slice("lab", "lb-1").service("lb").build().metadata
        );
        let (services, slices) = parse(&yaml);
        assert_eq!(services, objects.0);
        assert_eq!(slices, objects.1);
        // Concatenated manifests are one stream.
        let twice = parse(&(yaml.clone() + &yaml));
        assert_eq!(twice.0.len(), 4);
    }

    #[test]
    fn fields_land_where_the_api_has_them() {
        let yaml = manifest(&[&every_service_field(), &every_slice_field()]);
        for expected in [
            "kind: Service",
            "namespace: lab",
            "service.kubernetes.io/service-proxy-name: other",
            "type: LoadBalancer",
            "externalTrafficPolicy: Local",
            "internalTrafficPolicy: Local",
            "sessionAffinity: ClientIP",
            "timeoutSeconds: 60",
            "loadBalancerSourceRanges:",
            "targetPort: 8080",
            "targetPort: dns",
            "nodePort: 30053",
            "protocol: UDP",
            "ipMode: Proxy",
            "kind: EndpointSlice",
            "addressType: IPv4",
            "kubernetes.io/service-name: lb",
            "endpoints.kubernetes.io/last-change-trigger-time:",
            "nodeName: lab-node",
            "terminating: true",
            "forZones:",
            "forNodes:",
        ] {
            assert!(yaml.contains(expected), "{expected} not in\n{yaml}");
        }
        let external = service("lab", "x").external_name("example.org").build();
        let spec = external.spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("ExternalName"));
        assert_eq!(spec.external_name.as_deref(), Some("example.org"));
    }

    #[test]
    fn unset_fields_stay_absent() {
        let slice = slice("lab", "web-1").endpoint(ep("10.244.1.2"));
        let yaml = manifest(&[&service("lab", "web").port(port(None, 80)), &slice]);
        for absent in ["null", "type", "protocol", "targetPort", "conditions", "hints", "ports:\n-"]
        {
            assert!(!yaml.contains(absent), "{absent} in\n{yaml}");
        }
        // serde-saphyr quotes scalars that look numeric-ish.
        assert!(yaml.contains("endpoints:\n- addresses:\n  - \"10.244.1.2\"\n"), "{yaml}");
    }
}
