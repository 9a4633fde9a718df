use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use super::*;
use test_objects::{EndpointBuilder, Protocol::*, ServiceBuilder, ep, port, slice};

fn hinted(endpoints: impl IntoIterator<Item = EndpointBuilder>) -> ServicePort {
    let web = svc("web", "10.96.0.10").port(port(None, 80));
    let endpoints = web.slice().port(None, 8080, Tcp).endpoints(endpoints);
    let model = build(&[web.build()], &[endpoints.build()]);
    assert!(model.errors.is_empty(), "{:?}", model.errors);
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
    let templates = parse_service(&name, objects::Service::from_api(&web)).unwrap();
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
fn sctp_ports_are_proxied_with_their_endpoints() {
    let sctp = svc("a", "10.96.0.3").port(port("x", 80)).port(port("y", 90).protocol(Sctp));
    let sctp = sctp.build();
    let sctp_slice = slice("default", "s").service("a").port("y", 9090, Sctp);
    let sctp_slice = sctp_slice.endpoint(ep("10.244.0.2")).build();
    let model = build(&[sctp], &[sctp_slice]);
    assert!(model.errors.is_empty(), "{:?}", model.errors);
    let protocols: Vec<_> = model.ports().map(|p| p.protocol).collect();
    assert_eq!(protocols, [Protocol::Tcp, Protocol::Sctp]);
    let y = model.ports().find(|p| p.protocol == Protocol::Sctp).unwrap();
    assert_eq!(addrs(y), ["10.244.0.2:9090"]);
}

#[test]
fn an_sctp_port_and_a_tcp_port_may_share_a_number() {
    let both = svc("a", "10.96.0.3").port(port("t", 90)).port(port("s", 90).protocol(Sctp));
    let model = build(&[both.build()], &[]);
    assert!(model.errors.is_empty(), "{:?}", model.errors);
    assert_eq!(model.ports().count(), 2);
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
    assert_eq!(build(&[lb("Cluster")], &[]).ports().next().unwrap().health_check_node_port, None);
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
        ("{metadata: {name: badip}, spec: {clusterIP: 10.96.0.999, ports: [{port: 80}]}}", "badip"),
        ("{metadata: {name: zero}, spec: {clusterIP: 10.96.0.5, ports: [{port: 0}]}}", "zero"),
        ("{metadata: {name: big}, spec: {clusterIP: 10.96.0.5, ports: [{port: 70000}]}}", "big"),
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
