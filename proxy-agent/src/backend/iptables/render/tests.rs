use std::net::Ipv4Addr;

use super::{service_rules::probability, *};
use crate::{
    backend::{iptables::chains::endpoint_chain, rule_modes::RuleOptions},
    model::{Cidr, Protocol},
};

use test_objects::{EndpointBuilder, Protocol::Tcp, ServiceBuilder, ep, port, service};

/// The model of these services, each with its slice.
fn model(services: &[(ServiceBuilder, Vec<EndpointBuilder>)]) -> Model {
    let slices = services.iter().map(|(s, endpoints)| slice(s, endpoints.clone()).build());
    let services = services.iter().map(|(s, _)| s.clone().build());
    crate::source::model_of(&services.collect::<Vec<_>>(), &slices.collect::<Vec<_>>())
}

/// Service `default/name` at `cluster_ip`.
fn svc(name: &str, cluster_ip: &str) -> ServiceBuilder {
    service("default", name).cluster_ip(cluster_ip)
}

/// Service `web` at 10.96.0.50, port http 80.
fn web() -> ServiceBuilder {
    svc("web", "10.96.0.50").port(port("http", 80))
}

/// Options for a node `node-a` at 192.168.100.11, cluster CIDR
/// 10.244.0.0/16; the iptables backend's tests use them too.
pub(crate) fn options() -> Options {
    Options {
        rules: RuleOptions {
            family: IpFamily::V4,
            node_name: "node-a".into(),
            zone: None,
            node_ips: vec![Ipv4Addr::new(192, 168, 100, 11).into()],
            nodeport_addresses: vec![],
            cluster_cidr: Some(Cidr::parse("10.244.0.0/16").unwrap()),
            masquerade_all: false,
        },
        localhost_nodeports: true,
        nfacct: true,
        random_fully: true,
        conntrack_tcp_liberal: false,
        sctp: true,
    }
}

const FILTER_HEAD: &str = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
"#;
const FORWARD: &str = r#"-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x00004000/0x00004000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
"#;
const NAT_TOP: &str = r#"-A KUBE-POSTROUTING -m mark ! --mark 0x00004000/0x00004000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x00004000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000
"#;
const NODEPORTS_LAST: &str = r#"-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#;

/// The service's slice, its `http` and unnamed ports on 8080.
fn slice(service: &ServiceBuilder, endpoints: Vec<EndpointBuilder>) -> test_objects::SliceBuilder {
    service.slice().port("http", 8080, Tcp).port(None, 8080, Tcp).endpoints(endpoints)
}

/// Options for the IPv6 family of node `node-a` at fd00:100::11, cluster
/// CIDR fd00:10:244::/56.
fn options_v6() -> Options {
    let opts = options();
    let rules = RuleOptions {
        family: IpFamily::V6,
        node_ips: vec!["fd00:100::11".parse().unwrap()],
        cluster_cidr: Some(Cidr::parse("fd00:10:244::/56").unwrap()),
        ..opts.rules.clone()
    };
    Options { rules, ..opts }
}

#[test]
fn each_family_renders_only_its_own_ports() {
    let endpoints = || vec![ep("10.244.1.2").node("node-a")];
    let dual = web().cluster_ips(&["10.96.0.50", "fd00:96::50"]);
    let v6 = service("default", "v6").cluster_ip("fd00:96::51").port(port("http", 80));
    let both = model(&[(dual, endpoints()), (v6, vec![])]);
    let v4_alone = render(&model(&[(web(), endpoints())]), &options());
    assert_eq!(render(&both, &options()).to_string(), v4_alone.to_string());
    let v6_rules = render(&both, &options_v6()).to_string();
    assert!(!v6_rules.contains("10.96.0.50") && v6_rules.contains("fd00:96::51"));
}

#[test]
fn the_ipv6_family_as_kube_proxy_writes_it() {
    let np = svc("web", "fd00:96::50").cluster_ips(&["fd00:96::50"]).node_port_type();
    let np = np.port(port("http", 80).node_port(30080));
    let v6_slice = np.slice().address_type("IPv6").port("http", 8080, Tcp);
    let v6_slice = v6_slice.endpoint(ep("fd00:244::2").node("node-a"));
    let m = crate::source::model_of(&[np.build()], &[v6_slice.build()]);
    let rules = render(&m, &options_v6()).to_string();
    for line in [
        "-A KUBE-SERVICES -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d fd00:96::50 --dport 80 -j KUBE-SVC-",
        "-A KUBE-SVC-",
        " ! -s fd00:10:244::/56 -j KUBE-MARK-MASQ",
        " -s fd00:244::2 -j KUBE-MARK-MASQ",
        " -m tcp -p tcp -j DNAT --to-destination [fd00:244::2]:8080",
        "-A KUBE-NODEPORTS -m comment --comment default/web:http -m tcp -p tcp --dport 30080 -j KUBE-EXT-",
        "-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS",
    ] {
        assert!(rules.contains(line), "missing {line}\n{rules}");
    }
    // No localhost NodePorts on IPv6, hence no martian guard either.
    for absent in ["127.0.0.0/8", "KUBE-FIREWALL", "localhost_nps_accepted_pkts"] {
        assert!(!rules.contains(absent), "{absent} in\n{rules}");
    }
    // --nodeport-addresses of the other family only: no NodePort address.
    let mut v4_only = options_v6();
    v4_only.nodeport_addresses = vec![Cidr::parse("192.168.100.0/24").unwrap()];
    assert!(!render(&m, &v4_only).to_string().contains("-j KUBE-NODEPORTS"));
}

/// `explain`'s rule walk over the rules of the IPv6 family, as
/// `ip6tables-save` prints them.
#[test]
fn explain_walks_the_ipv6_rules() {
    use crate::inspect::explain::{NO_ENDPOINT, Query, explain_rules};
    let np = svc("web", "fd00:96::50").cluster_ips(&["fd00:96::50"]).node_port_type();
    let np = np.port(port("http", 80).node_port(30080));
    let v6_slice = np.slice().address_type("IPv6").port("http", 8080, Tcp);
    let v6_slice = v6_slice.endpoint(ep("fd00:244::2").node("node-a"));
    let empty = svc("empty", "fd00:96::51").cluster_ips(&["fd00:96::51"]).port(port("http", 80));
    let m = crate::source::model_of(&[np.build(), empty.build()], &[v6_slice.build()]);
    let save = render(&m, &options_v6()).to_string();
    let local = ["fd00:100::11".parse().unwrap()];
    let from = "[fd00:100::101]:40000".parse().unwrap();
    let query =
        |to: &str| Query::new(Protocol::Tcp, from, to.parse().unwrap(), "ip6tables rules".into());
    let x = explain_rules(&query("[fd00:100::11]:30080"), &save, &local);
    assert_eq!(x.outcome, "translated", "{x:?}\n{save}");
    assert_eq!(x.frontend.as_ref().map(|f| f.kind.as_str()), Some("NodePort"));
    assert!(x.notes[0].ends_with("[fd00:244::2]:8080 100%"), "{:?}", x.notes);
    assert!(x.snat.is_some_and(|s| s.starts_with("MASQUERADE")));
    let x = explain_rules(&query("[fd00:96::51]:80"), &save, &local);
    assert_eq!((x.outcome, x.reason.as_deref()), ("refused", Some(NO_ENDPOINT)), "{save}");
    assert_eq!(x.action, "answered with ICMPv6 port unreachable (filter REJECT)");
    // Not a node address: no NodePort.
    let x = explain_rules(&query("[fd00:100::99]:30080"), &save, &local);
    assert_eq!(x.outcome, "passed");
}

#[test]
fn cluster_ip_service_golden() {
    let endpoints = vec![ep("10.244.1.2").node("node-a"), ep("10.244.2.2").node("node-b")];
    let m = model(&[(web(), endpoints)]);
    let expected = String::from(FILTER_HEAD)
        + FORWARD
        + "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
        + ":KUBE-SVC-CDGGSHYLG3RE2FKL - [0:0]\n:KUBE-SEP-UIQK3OSOSTRHRPBX - [0:0]\n:KUBE-SEP-4EX2N4PG4ASNZOBF - [0:0]\n"
        + NAT_TOP
        + r#"-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.50 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-UIQK3OSOSTRHRPBX
-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment "default/web:http -> 10.244.2.2:8080" -j KUBE-SEP-4EX2N4PG4ASNZOBF
-A KUBE-SEP-UIQK3OSOSTRHRPBX -m comment --comment default/web:http -s 10.244.1.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-UIQK3OSOSTRHRPBX -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-4EX2N4PG4ASNZOBF -m comment --comment default/web:http -s 10.244.2.2 -j KUBE-MARK-MASQ
-A KUBE-SEP-4EX2N4PG4ASNZOBF -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.2.2:8080
"# + NODEPORTS_LAST;
    assert_eq!(render(&m, &options()).to_string(), expected);
}

#[test]
fn node_port_local_policy_and_a_service_without_endpoints_golden() {
    let np = svc("np", "10.96.0.60").node_port_type().external_policy("Local");
    let np = (np.port(port(None, 80).node_port(30080)), vec![ep("10.244.1.5").node("node-a")]);
    let services = [np, (svc("empty", "10.96.0.70").port(port(None, 80)), vec![])];
    let expected = String::from(FILTER_HEAD)
        + "-A KUBE-SERVICES -m comment --comment \"default/empty has no endpoints\" -m tcp -p tcp -d 10.96.0.70 --dport 80 -j REJECT\n"
        + FORWARD
        + "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
        + ":KUBE-EXT-LDATH6LIB7VCFHLW - [0:0]\n:KUBE-SVC-LDATH6LIB7VCFHLW - [0:0]\n:KUBE-SVL-LDATH6LIB7VCFHLW - [0:0]\n:KUBE-SEP-KKAYSMSONWI56KZA - [0:0]\n"
        + NAT_TOP
        + r#"-A KUBE-SERVICES -m comment --comment "default/np cluster IP" -m tcp -p tcp -d 10.96.0.60 --dport 80 -j KUBE-SVC-LDATH6LIB7VCFHLW
-A KUBE-NODEPORTS -m comment --comment default/np -m tcp -p tcp -d 127.0.0.0/8 --dport 30080 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-LDATH6LIB7VCFHLW
-A KUBE-NODEPORTS -m comment --comment default/np -m tcp -p tcp --dport 30080 -j KUBE-EXT-LDATH6LIB7VCFHLW
-A KUBE-SVC-LDATH6LIB7VCFHLW -m comment --comment "default/np cluster IP" -m tcp -p tcp -d 10.96.0.60 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ
-A KUBE-EXT-LDATH6LIB7VCFHLW -m comment --comment "pod traffic for default/np external destinations" -s 10.244.0.0/16 -j KUBE-SVC-LDATH6LIB7VCFHLW
-A KUBE-EXT-LDATH6LIB7VCFHLW -m comment --comment "masquerade LOCAL traffic for default/np external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-LDATH6LIB7VCFHLW -m comment --comment "route LOCAL traffic for default/np external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-LDATH6LIB7VCFHLW
-A KUBE-EXT-LDATH6LIB7VCFHLW -j KUBE-SVL-LDATH6LIB7VCFHLW
-A KUBE-SVC-LDATH6LIB7VCFHLW -m comment --comment "default/np -> 10.244.1.5:8080" -j KUBE-SEP-KKAYSMSONWI56KZA
-A KUBE-SVL-LDATH6LIB7VCFHLW -m comment --comment "default/np -> 10.244.1.5:8080" -j KUBE-SEP-KKAYSMSONWI56KZA
-A KUBE-SEP-KKAYSMSONWI56KZA -m comment --comment default/np -s 10.244.1.5 -j KUBE-MARK-MASQ
-A KUBE-SEP-KKAYSMSONWI56KZA -m comment --comment default/np -m tcp -p tcp -j DNAT --to-destination 10.244.1.5:8080
"# + NODEPORTS_LAST;
    // kube-proxy walks services in Go map order; we walk them by name.
    assert_eq!(render(&model(&services), &options()).to_string(), expected);
}

/// An SCTP port gets kube-proxy's rules, as TCP and UDP do (its proxier
/// writes `-m <protocol> -p <protocol>` whatever the protocol), the chain
/// names hashed with `sctp`, DNAT to the target port: a Diameter service
/// at a cluster IP, a NodePort, an external IP and a load-balancer IP.
#[test]
fn an_sctp_port_gets_kube_proxys_rules_with_port_translation() {
    use test_objects::Protocol::Sctp;
    let diameter = svc("diameter", "10.96.0.80").load_balancer_type().external_ips(&["10.200.0.8"]);
    let diameter = diameter.port(port("diameter", 3868).protocol(Sctp).node_port(30868));
    let diameter = diameter.ingress_ip("198.51.100.8");
    let endpoints = diameter.slice().port("diameter", 3869, Sctp);
    let endpoints = endpoints.endpoint(ep("10.244.1.7").node("node-a"));
    let empty = svc("empty", "10.96.0.81").port(port("sigtran", 2905).protocol(Sctp));
    let m = crate::source::model_of(&[diameter.build(), empty.build()], &[endpoints.build()]);
    let l: Vec<String> = render(&m, &options()).to_string().lines().map(str::to_string).collect();
    for line in [
        "-A KUBE-SERVICES -m comment --comment \"default/empty:sigtran has no endpoints\" -m sctp -p sctp -d 10.96.0.81 --dport 2905 -j REJECT",
        "-A KUBE-SERVICES -m comment --comment \"default/diameter:diameter cluster IP\" -m sctp -p sctp -d 10.96.0.80 --dport 3868 -j KUBE-SVC-M2TMZFIBI5SX3EW2",
        "-A KUBE-SERVICES -m comment --comment \"default/diameter:diameter external IP\" -m sctp -p sctp -d 10.200.0.8 --dport 3868 -j KUBE-EXT-M2TMZFIBI5SX3EW2",
        "-A KUBE-SERVICES -m comment --comment \"default/diameter:diameter loadbalancer IP\" -m sctp -p sctp -d 198.51.100.8 --dport 3868 -j KUBE-EXT-M2TMZFIBI5SX3EW2",
        "-A KUBE-NODEPORTS -m comment --comment default/diameter:diameter -m sctp -p sctp -d 127.0.0.0/8 --dport 30868 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-M2TMZFIBI5SX3EW2",
        "-A KUBE-NODEPORTS -m comment --comment default/diameter:diameter -m sctp -p sctp --dport 30868 -j KUBE-EXT-M2TMZFIBI5SX3EW2",
        "-A KUBE-SVC-M2TMZFIBI5SX3EW2 -m comment --comment \"default/diameter:diameter cluster IP\" -m sctp -p sctp -d 10.96.0.80 --dport 3868 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ",
        "-A KUBE-EXT-M2TMZFIBI5SX3EW2 -m comment --comment \"masquerade traffic for default/diameter:diameter external destinations\" -j KUBE-MARK-MASQ",
        "-A KUBE-SVC-M2TMZFIBI5SX3EW2 -m comment --comment \"default/diameter:diameter -> 10.244.1.7:3869\" -j KUBE-SEP-P6PVRGDOH2EFATBI",
        "-A KUBE-SEP-P6PVRGDOH2EFATBI -m comment --comment default/diameter:diameter -s 10.244.1.7 -j KUBE-MARK-MASQ",
        "-A KUBE-SEP-P6PVRGDOH2EFATBI -m comment --comment default/diameter:diameter -m sctp -p sctp -j DNAT --to-destination 10.244.1.7:3869",
    ] {
        has(&l, line);
    }
    assert!(!l.iter().any(|x| x.contains(" tcp") || x.contains(" udp")), "SCTP rules only");
}

/// The rules of a service with its slice.
fn lines(service: ServiceBuilder, endpoints: Vec<EndpointBuilder>, opts: &Options) -> Vec<String> {
    let model = model(&[(service, endpoints)]);
    render(&model, opts).to_string().lines().map(str::to_string).collect()
}

fn has(lines: &[String], line: &str) {
    assert!(lines.iter().any(|l| l == line), "missing:\n{line}\nin:\n{}", lines.join("\n"));
}

#[test]
fn session_affinity_uses_recent() {
    let sticky = web().client_ip_affinity(Some(300));
    let l = lines(sticky, vec![ep("10.244.1.2")], &options());
    has(
        &l,
        "-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -m recent --name KUBE-SEP-UIQK3OSOSTRHRPBX --rcheck --seconds 300 --reap -j KUBE-SEP-UIQK3OSOSTRHRPBX",
    );
    has(
        &l,
        "-A KUBE-SEP-UIQK3OSOSTRHRPBX -m comment --comment default/web:http -m recent --name KUBE-SEP-UIQK3OSOSTRHRPBX --set -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080",
    );
}

#[test]
fn probabilities_have_ten_decimals() {
    assert_eq!(probability(3), "0.3333333333");
    assert_eq!(probability(2), "0.5000000000");
}

#[test]
fn load_balancer_source_ranges_go_through_the_firewall_chain() {
    let lb = svc("web", "10.96.0.50").load_balancer_type().source_ranges(&["203.0.113.0/25"]);
    let lb = lb.port(port("http", 80).node_port(30080)).ingress_ip("198.51.100.7");
    let l = lines(lb, vec![ep("10.244.1.2")], &options());
    has(
        &l,
        "-A KUBE-SERVICES -m comment --comment \"default/web:http loadbalancer IP\" -m tcp -p tcp -d 198.51.100.7 --dport 80 -j KUBE-FW-CDGGSHYLG3RE2FKL",
    );
    has(
        &l,
        "-A KUBE-FW-CDGGSHYLG3RE2FKL -m comment --comment \"default/web:http loadbalancer IP\" -s 203.0.113.0/25 -j KUBE-EXT-CDGGSHYLG3RE2FKL",
    );
    has(
        &l,
        "-A KUBE-FW-CDGGSHYLG3RE2FKL -m comment --comment \"other traffic to default/web:http will be dropped by KUBE-PROXY-FIREWALL\"",
    );
    has(
        &l,
        "-A KUBE-PROXY-FIREWALL -m comment --comment \"default/web:http traffic not accepted by KUBE-FW-CDGGSHYLG3RE2FKL\" -m tcp -p tcp -d 198.51.100.7 --dport 80 -j DROP",
    );
    has(
        &l,
        "-A KUBE-EXT-CDGGSHYLG3RE2FKL -m comment --comment \"masquerade traffic for default/web:http external destinations\" -j KUBE-MARK-MASQ",
    );
    has(&l, "-A KUBE-EXT-CDGGSHYLG3RE2FKL -j KUBE-SVC-CDGGSHYLG3RE2FKL");
    assert!(!l.iter().any(|x| x.contains("-s 198.51.100.7")), "the range does not admit the node");
}

#[test]
fn local_policies_without_local_endpoints_drop() {
    let local = svc("web", "10.96.0.50").node_port_type().external_policy("Local");
    let local = local.internal_policy("Local").external_ips(&["10.200.0.5"]);
    let local = local.port(port("http", 80).node_port(30080));
    let l = lines(local, vec![ep("10.244.2.2").node("node-b")], &options());
    has(
        &l,
        "-A KUBE-SERVICES -m comment --comment \"default/web:http has no local endpoints\" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j DROP",
    );
    has(
        &l,
        "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"default/web:http has no local endpoints\" -m tcp -p tcp -d 10.200.0.5 --dport 80 -j DROP",
    );
    has(
        &l,
        "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"default/web:http has no local endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j DROP",
    );
    // External traffic from pods and the node still reaches the cluster.
    has(
        &l,
        "-A KUBE-EXT-CDGGSHYLG3RE2FKL -m comment --comment \"route LOCAL traffic for default/web:http external destinations\" -m addrtype --src-type LOCAL -j KUBE-SVC-CDGGSHYLG3RE2FKL",
    );
    assert!(!l.iter().any(|x| x.contains("KUBE-SVL-")), "no local endpoint, no SVL chain");
}

#[test]
fn masquerade_all_and_nodeport_addresses() {
    let mut opts = options();
    opts.masquerade_all = true;
    opts.nodeport_addresses = vec![Cidr::parse("192.168.100.0/24").unwrap()];
    let l = lines(web(), vec![ep("10.244.1.2")], &opts);
    has(
        &l,
        "-A KUBE-SVC-CDGGSHYLG3RE2FKL -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j KUBE-MARK-MASQ",
    );
    has(
        &l,
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d 192.168.100.11 -j KUBE-NODEPORTS",
    );
}

#[test]
fn large_clusters_drop_per_endpoint_comments() {
    let endpoints: Vec<EndpointBuilder> =
        (0..1001).map(|i| ep(&format!("10.245.{}.{}", i / 250, i % 250 + 1))).collect();
    let l = lines(web(), endpoints.clone(), &options());
    let sep = endpoint_chain(
        &model(&[(web(), endpoints)]).ports().next().unwrap().name,
        Protocol::Tcp,
        "10.245.0.1:8080",
    );
    has(&l, &format!("-A {sep} -s 10.245.0.1 -j KUBE-MARK-MASQ"));
    has(&l, &format!("-A {sep} -m tcp -p tcp -j DNAT --to-destination 10.245.0.1:8080"));
    assert!(l.iter().any(|x| x.starts_with("-A KUBE-SVC-CDGGSHYLG3RE2FKL -m statistic")));
    has(
        &l,
        "-A KUBE-SERVICES -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d 10.96.0.50 --dport 80 -j KUBE-SVC-CDGGSHYLG3RE2FKL",
    );
}

#[test]
fn jump_rules_are_kube_proxys() {
    let jumps = jump_rules();
    assert_eq!(jumps.len(), 14);
    assert_eq!(
        jumps[0],
        (
            "filter",
            "INPUT",
            vec![
                "-m",
                "conntrack",
                "--ctstate",
                "NEW",
                "-m",
                "comment",
                "--comment",
                "kubernetes externally-visible service portals",
                "-j",
                "KUBE-EXTERNAL-SERVICES"
            ]
        )
    );
    assert_eq!(jumps[13], ("filter", "OUTPUT", vec!["-j", "KUBE-FIREWALL"]));
}
