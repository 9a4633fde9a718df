use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::model::{Cidr, IpFamily};

use test_objects::{EndpointBuilder, Protocol::Tcp, ServiceBuilder, ep, port, service};

/// The model of these services, each with its slice of port `p80` on 80.
fn model(services: &[(ServiceBuilder, Vec<EndpointBuilder>)]) -> Model {
    let slices = services
        .iter()
        .filter(|(_, endpoints)| !endpoints.is_empty())
        .map(|(s, endpoints)| s.slice().port("p80", 80, Tcp).endpoints(endpoints.clone()).build());
    let services = services.iter().map(|(s, _)| s.clone().build());
    crate::source::model_of(&services.collect::<Vec<_>>(), &slices.collect::<Vec<_>>())
}

/// kube-proxy's test node: `test-node` at 192.168.0.2, pods in
/// 10.0.0.0/8, NodePorts on 192.168.0.2 only.
fn options() -> Options {
    Options {
        family: IpFamily::V4,
        node_name: "test-node".into(),
        zone: None,
        node_ips: ["192.168.0.2", "192.168.1.2", "192.168.99.11"]
            .map(|ip| ip.parse().unwrap())
            .to_vec(),
        nodeport_addresses: vec![Cidr::parse("192.168.0.2/32").unwrap()],
        cluster_cidr: Some(Cidr::parse("10.0.0.0/8").unwrap()),
        masquerade_all: false,
    }
}

/// A ruleset's statements: those that are not rules as a sorted list, and
/// each chain's rules in order (their order is what matters).
#[derive(Debug, PartialEq, Eq)]
struct Statements {
    declarations: BTreeSet<String>,
    rules: BTreeMap<String, Vec<String>>,
}

/// Reads `nft -f` input for an empty table, as kube-proxy's tests write it
/// (blank lines and `#` comments skipped; a statement adding several
/// elements read as one per element).
fn statements(text: &str) -> Statements {
    let mut declarations = BTreeSet::new();
    let mut rules: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if line.starts_with("add element ")
            && let Some((set, elements)) = line.split_once(" { ")
        {
            for element in elements.trim_end_matches(" }").split(", ") {
                declarations.insert(format!("{set} {{ {element} }}"));
            }
        } else if let Some(rest) = line.strip_prefix("add rule ") {
            let mut words = rest.splitn(4, ' ');
            let (_family, _table) = (words.next(), words.next());
            let chain = words.next().unwrap_or_default().to_string();
            rules.entry(chain).or_default().push(words.next().unwrap_or_default().to_string());
        } else {
            declarations.insert(line.to_string());
        }
    }
    Statements { declarations, rules }
}

/// kube-proxy's `TestOverallNFTablesRules` (pkg/proxy/nftables/
/// proxier_test.go, kubernetes/kubernetes master, 2026): its expected
/// ruleset, `baseRules` and the services' part, test data quoted as is.
const KUBE_PROXY_OVERALL: &str = r#"
add table ip kube-proxy { comment "rules for kube-proxy" ; }

add set ip kube-proxy cluster-ips { type ipv4_addr ; comment "Active ClusterIPs" ; }
add set ip kube-proxy nodeport-ips { type ipv4_addr ; comment "IPs that accept NodePort traffic" ; }

add map ip kube-proxy firewall-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }
add map ip kube-proxy no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }
add map ip kube-proxy no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }
add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }
add map ip kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }

add chain ip kube-proxy cluster-ips-check
add chain ip kube-proxy filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }
add chain ip kube-proxy filter-output-pre-dnat { type filter hook output priority -110 ; }
add chain ip kube-proxy filter-forward { type filter hook forward priority 0 ; }
add chain ip kube-proxy filter-input { type filter hook input priority 0 ; }
add chain ip kube-proxy filter-output { type filter hook output priority 0 ; }
add chain ip kube-proxy firewall-check
add chain ip kube-proxy mark-for-masquerade
add chain ip kube-proxy masquerading
add chain ip kube-proxy nat-output { type nat hook output priority -100 ; }
add chain ip kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }
add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add chain ip kube-proxy nodeport-endpoints-check
add chain ip kube-proxy reject-chain { comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }
add chain ip kube-proxy services
add chain ip kube-proxy service-endpoints-check

add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"
add rule ip kube-proxy cluster-ips-check ip daddr { 172.30.0.0/16 } drop comment "Drop traffic to unallocated ClusterIPs"
add rule ip kube-proxy filter-prerouting-pre-dnat ct state new jump firewall-check
add rule ip kube-proxy filter-forward ct state new jump service-endpoints-check
add rule ip kube-proxy filter-forward ct state new jump cluster-ips-check
add rule ip kube-proxy filter-input ct state new jump nodeport-endpoints-check
add rule ip kube-proxy filter-input ct state new jump service-endpoints-check
add rule ip kube-proxy filter-output ct state new jump service-endpoints-check
add rule ip kube-proxy filter-output-pre-dnat ct state new jump firewall-check
add rule ip kube-proxy filter-output ct state new jump cluster-ips-check
add rule ip kube-proxy firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips
add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000
add rule ip kube-proxy masquerading mark and 0x4000 == 0 return
add rule ip kube-proxy masquerading mark set mark xor 0x4000
add rule ip kube-proxy masquerading masquerade fully-random
add rule ip kube-proxy nat-output jump services
add rule ip kube-proxy nat-postrouting jump masquerading
add rule ip kube-proxy nat-prerouting jump services
add rule ip kube-proxy nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports
add rule ip kube-proxy reject-chain reject
add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips
add rule ip kube-proxy services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports

add element ip kube-proxy nodeport-ips { 192.168.0.2 }
add rule ip kube-proxy service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services

# svc1
add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80
add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }

add chain ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80
add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 ip saddr 10.180.0.1 jump mark-for-masquerade
add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 meta l4proto tcp dnat to 10.180.0.1:80

add element ip kube-proxy cluster-ips { 172.30.0.41 }
add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }

# svc2
add chain ip kube-proxy service-42NFTM6N-ns2/svc2/tcp/p80
add rule ip kube-proxy service-42NFTM6N-ns2/svc2/tcp/p80 ip daddr 172.30.0.42 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
add rule ip kube-proxy service-42NFTM6N-ns2/svc2/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80 }
add chain ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80
add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 ip saddr 10.0.0.0/8 goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit pod traffic"
add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit local traffic"
add chain ip kube-proxy endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80
add rule ip kube-proxy endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80 ip saddr 10.180.0.2 jump mark-for-masquerade
add rule ip kube-proxy endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80 meta l4proto tcp dnat to 10.180.0.2:80

add element ip kube-proxy cluster-ips { 172.30.0.42 }
add element ip kube-proxy service-ips { 172.30.0.42 . tcp . 80 : goto service-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip kube-proxy service-ips { 192.168.99.22 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip kube-proxy service-ips { 1.2.3.4 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
add element ip kube-proxy service-nodeports { tcp . 3001 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }

add element ip kube-proxy no-endpoint-nodeports { tcp . 3001 comment "ns2/svc2:p80" : drop }
add element ip kube-proxy no-endpoint-services { 1.2.3.4 . tcp . 80 comment "ns2/svc2:p80" : drop }
add element ip kube-proxy no-endpoint-services { 192.168.99.22 . tcp . 80 comment "ns2/svc2:p80" : drop }

# svc3
add chain ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80
add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 ip daddr 172.30.0.43 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-UEIP74TE-ns3/svc3/tcp/p80__10.180.0.3/80 }
add chain ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80
add rule ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80 jump mark-for-masquerade
add rule ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80 goto service-4AT6LBPK-ns3/svc3/tcp/p80
add chain ip kube-proxy endpoint-UEIP74TE-ns3/svc3/tcp/p80__10.180.0.3/80
add rule ip kube-proxy endpoint-UEIP74TE-ns3/svc3/tcp/p80__10.180.0.3/80 ip saddr 10.180.0.3 jump mark-for-masquerade
add rule ip kube-proxy endpoint-UEIP74TE-ns3/svc3/tcp/p80__10.180.0.3/80 meta l4proto tcp dnat to 10.180.0.3:80

add element ip kube-proxy cluster-ips { 172.30.0.43 }
add element ip kube-proxy service-ips { 172.30.0.43 . tcp . 80 : goto service-4AT6LBPK-ns3/svc3/tcp/p80 }
add element ip kube-proxy service-nodeports { tcp . 3003 : goto external-4AT6LBPK-ns3/svc3/tcp/p80 }

# svc4
add chain ip kube-proxy service-LAUZTJTB-ns4/svc4/tcp/p80
add rule ip kube-proxy service-LAUZTJTB-ns4/svc4/tcp/p80 ip daddr 172.30.0.44 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
add rule ip kube-proxy service-LAUZTJTB-ns4/svc4/tcp/p80 numgen random mod 2 vmap { 0 : goto endpoint-UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80 , 1 : goto endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80 }
add chain ip kube-proxy external-LAUZTJTB-ns4/svc4/tcp/p80
add rule ip kube-proxy external-LAUZTJTB-ns4/svc4/tcp/p80 jump mark-for-masquerade
add rule ip kube-proxy external-LAUZTJTB-ns4/svc4/tcp/p80 goto service-LAUZTJTB-ns4/svc4/tcp/p80
add chain ip kube-proxy endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80
add rule ip kube-proxy endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80 ip saddr 10.180.0.5 jump mark-for-masquerade
add rule ip kube-proxy endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80 meta l4proto tcp dnat to 10.180.0.5:80
add chain ip kube-proxy endpoint-UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80
add rule ip kube-proxy endpoint-UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80 ip saddr 10.180.0.4 jump mark-for-masquerade
add rule ip kube-proxy endpoint-UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80 meta l4proto tcp dnat to 10.180.0.4:80

add element ip kube-proxy cluster-ips { 172.30.0.44 }
add element ip kube-proxy service-ips { 172.30.0.44 . tcp . 80 : goto service-LAUZTJTB-ns4/svc4/tcp/p80 }
add element ip kube-proxy service-ips { 192.168.99.33 . tcp . 80 : goto external-LAUZTJTB-ns4/svc4/tcp/p80 }

# svc5
add set ip kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }
add chain ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80
add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip daddr 172.30.0.45 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80
add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 }
add chain ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80
add rule ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80 jump mark-for-masquerade
add rule ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80 goto service-HVFWP5L3-ns5/svc5/tcp/p80

add chain ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80
add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 ip saddr 10.180.0.3 jump mark-for-masquerade
add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 update @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { ip saddr }
add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 meta l4proto tcp dnat to 10.180.0.3:80

add chain ip kube-proxy firewall-HVFWP5L3-ns5/svc5/tcp/p80
add rule ip kube-proxy firewall-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr != { 203.0.113.0/25 } drop

add element ip kube-proxy cluster-ips { 172.30.0.45 }
add element ip kube-proxy service-ips { 172.30.0.45 . tcp . 80 : goto service-HVFWP5L3-ns5/svc5/tcp/p80 }
add element ip kube-proxy service-ips { 5.6.7.8 . tcp . 80 : goto external-HVFWP5L3-ns5/svc5/tcp/p80 }
add element ip kube-proxy service-nodeports { tcp . 3002 : goto external-HVFWP5L3-ns5/svc5/tcp/p80 }
add element ip kube-proxy firewall-ips { 5.6.7.8 . tcp . 80 : goto firewall-HVFWP5L3-ns5/svc5/tcp/p80 }

# svc6
add element ip kube-proxy cluster-ips { 172.30.0.46 }
add element ip kube-proxy no-endpoint-services { 172.30.0.46 . tcp . 80 comment "ns6/svc6:p80" : goto reject-chain }
"#;

/// What kube-proxy writes that we do not, by design (docs/nftables.md):
/// the drop of unallocated ClusterIPs needs the ServiceCIDR objects, which
/// the agent does not watch.
const NOT_OURS: [&str; 1] = [
    "add rule ip kube-proxy cluster-ips-check ip daddr { 172.30.0.0/16 } drop comment \"Drop traffic to unallocated ClusterIPs\"",
];

/// The services and slices of kube-proxy's `TestOverallNFTablesRules`.
fn kube_proxys_overall_services() -> Model {
    let svc = |ns: &str, name: &str, ip: &str| service(ns, name).cluster_ip(ip);
    let p80 = || port("p80", 80);
    model(&[
        (svc("ns1", "svc1", "172.30.0.41").port(p80()), vec![ep("10.180.0.1")]),
        (
            svc("ns2", "svc2", "172.30.0.42")
                .load_balancer_type()
                .external_policy("Local")
                .port(p80().node_port(3001))
                .ingress_ip("1.2.3.4")
                .external_ips(&["192.168.99.22"])
                .health_check_node_port(30000),
            // No nodeName: not local, so not used by the Local policy.
            vec![ep("10.180.0.2")],
        ),
        (
            svc("ns3", "svc3", "172.30.0.43").node_port_type().port(p80().node_port(3003)),
            vec![ep("10.180.0.3")],
        ),
        (
            svc("ns4", "svc4", "172.30.0.44")
                .node_port_type()
                .external_ips(&["192.168.99.33"])
                .port(p80().target(80)),
            vec![ep("10.180.0.4"), ep("10.180.0.5").node("test-node")],
        ),
        (
            svc("ns5", "svc5", "172.30.0.45")
                .load_balancer_type()
                .external_policy("Cluster")
                .port(p80().node_port(3002))
                .ingress_ip("5.6.7.8")
                .health_check_node_port(30000)
                .source_ranges(&[" 203.0.113.0/25"])
                .client_ip_affinity(Some(10800)),
            vec![ep("10.180.0.3")],
        ),
        (svc("ns6", "svc6", "172.30.0.46").port(p80().target(80)), vec![]),
    ])
}

/// What we write that kube-proxy does not, by design (docs/nftables.md):
/// the hairpin check of its endpoint chains, as one lookup after DNAT.
const OURS_ONLY: [&str; 2] = [
    "add set ip kube-proxy hairpin-endpoints { type ipv4_addr . ipv4_addr ; comment \"endpoints twice: a connection DNATed to its own source is masqueraded\" ; }",
    "add rule ip kube-proxy masquerading ct status dnat ip saddr . ip daddr @hairpin-endpoints mark set mark or 0x4000",
];

/// kube-proxy's ruleset as ours writes it by design (docs/nftables.md): no
/// per-endpoint chains and no `mark-for-masquerade` chain. An endpoint
/// chain's hairpin check (`ip saddr A jump mark-for-masquerade`) becomes an
/// element `A . A` of `hairpin-endpoints`, and what else it does is written
/// where kube-proxy jumps to it; its pick `numgen random mod N vmap { 0 :
/// goto A , 1 : goto B }` becomes `numgen random mod 2 0 <A's>`, `<B's>`
/// (no anonymous set); `jump mark-for-masquerade` becomes that chain's one
/// rule.
fn as_ours(mut theirs: Statements) -> Statements {
    let (endpoints, chains): (BTreeMap<_, _>, BTreeMap<_, _>) =
        theirs.rules.into_iter().partition(|(chain, _)| chain.starts_with("endpoint-"));
    let mut translations = BTreeMap::new();
    for (chain, rules) in endpoints {
        let (hairpin, rest) = rules.split_first().unwrap();
        let ip = hairpin.strip_prefix("ip saddr ").unwrap();
        let ip = ip.strip_suffix(" jump mark-for-masquerade").unwrap();
        let element = format!("add element ip kube-proxy hairpin-endpoints {{ {ip} . {ip} }}");
        theirs.declarations.insert(element);
        theirs.declarations.remove(&format!("add chain ip kube-proxy {chain}"));
        translations.insert(chain, rest.join(" "));
    }
    theirs.declarations.remove("add chain ip kube-proxy mark-for-masquerade");
    let inline = |rule: &str| -> String {
        let rule = rule.replace("jump mark-for-masquerade", "mark set mark or 0x4000");
        match rule.rsplit_once("goto endpoint-") {
            Some((matches, chain)) => {
                format!("{matches}{}", translations[&format!("endpoint-{chain}")])
            }
            None => rule,
        }
    };
    theirs.rules = chains
        .into_iter()
        .filter(|(chain, _)| chain != "mark-for-masquerade")
        .map(|(chain, rules)| {
            let rules = rules.iter().flat_map(|r| cascade(r)).map(|r| inline(&r)).collect();
            (chain, rules)
        })
        .collect();
    theirs
}

/// kube-proxy's pick, `numgen random mod N vmap { 0 : goto A , 1 : goto B
/// }`, as a cascade (`service::pick`): `numgen random mod 2 0 goto A`,
/// `goto B`.
fn cascade(rule: &str) -> Vec<String> {
    let Some(picks) =
        rule.strip_prefix("numgen random mod ").and_then(|r| r.split_once(" vmap { "))
    else {
        return vec![rule.to_string()];
    };
    let targets: Vec<&str> = picks
        .1
        .trim_end_matches(" }")
        .split(" , ")
        .filter_map(|p| p.split_once(" : "))
        .map(|p| p.1)
        .collect();
    let n = targets.len();
    let pick = |(i, t): (usize, &&str)| match n - i {
        1 => t.to_string(),
        left => format!("numgen random mod {left} 0 {t}"),
    };
    targets.iter().enumerate().map(pick).collect()
}

/// `lines` added to `theirs` (`add`: a rule first in its chain) or taken
/// from it, each asserted to be new, or there.
fn amend(theirs: &mut Statements, lines: &[&str], add: bool) {
    for line in lines {
        let amendment = statements(line);
        for declaration in amendment.declarations {
            let changed = match add {
                true => theirs.declarations.insert(declaration),
                false => theirs.declarations.remove(&declaration),
            };
            assert!(changed, "{line}");
        }
        for (chain, rules) in amendment.rules {
            let kept = theirs.rules.get_mut(&chain).unwrap();
            for rule in rules {
                match add {
                    true => kept.insert(0, rule),
                    false => {
                        let before = kept.len();
                        kept.retain(|r| *r != rule);
                        assert_eq!(kept.len() + 1, before, "{line} is not in kube-proxy's ruleset");
                    }
                }
            }
        }
    }
}

#[test]
fn kube_proxys_overall_test_element_for_element() {
    let ours = statements(&render(&kube_proxys_overall_services(), &options()).to_string());
    let mut theirs = as_ours(statements(KUBE_PROXY_OVERALL));
    amend(&mut theirs, &NOT_OURS, false);
    amend(&mut theirs, &OURS_ONLY, true);
    let only = |a: &Statements, b: &Statements| -> Vec<String> {
        a.declarations.difference(&b.declarations).cloned().collect()
    };
    assert_eq!(only(&ours, &theirs), Vec::<String>::new(), "ours only");
    assert_eq!(only(&theirs, &ours), Vec::<String>::new(), "kube-proxy's only");
    for (chain, rules) in &theirs.rules {
        assert_eq!(ours.rules.get(chain), Some(rules), "chain {chain}");
    }
    assert_eq!(ours.rules.keys().collect::<Vec<_>>(), theirs.rules.keys().collect::<Vec<_>>());
}

#[test]
fn internal_local_policy_uses_the_local_chain_and_drops_without_local_endpoints() {
    let svc = || service("ns", "web").cluster_ip("172.30.0.10").internal_policy("Local");
    let here = render(
        &model(&[(
            svc().port(port("p80", 80)),
            vec![ep("10.0.1.1").node("test-node"), ep("10.0.2.1")],
        )]),
        &options(),
    )
    .to_string();
    let local = ServiceChainsFor::web();
    assert!(
        here.contains(&format!("service-ips {{ 172.30.0.10 . tcp . 80 : goto {} }}", local.local)),
        "{here}"
    );
    assert!(!here.contains("10.0.2.1:80"), "the other node's endpoint is not used\n{here}");
    let elsewhere = render(
        &model(&[(svc().port(port("p80", 80)), vec![ep("10.0.2.1").node("other")])]),
        &options(),
    );
    assert!(elsewhere.chains.is_empty(), "no chain without a local endpoint");
    let elsewhere = elsewhere.to_string();
    assert!(
        elsewhere.contains(
            "no-endpoint-services { 172.30.0.10 . tcp . 80 comment \"ns/web:p80\" : drop }"
        ),
        "{elsewhere}"
    );
}

/// The chain names of `ns/web:p80` (TCP).
struct ServiceChainsFor;

impl ServiceChainsFor {
    fn web() -> super::names::ServiceChains {
        let name = crate::model::ServicePortName::of("ns", "web", "p80");
        super::names::ServiceChains::new(&name, crate::model::Protocol::Tcp)
    }
}

#[test]
fn terminating_endpoints_serve_when_none_is_ready() {
    let svc = service("ns", "web").cluster_ip("172.30.0.10").port(port("p80", 80));
    let endpoints = vec![
        ep("10.0.1.1").ready(false).serving(true).terminating(true),
        ep("10.0.1.2").ready(false).serving(false).terminating(true),
    ];
    let text = render(&model(&[(svc, endpoints)]), &options()).to_string();
    assert!(text.contains("dnat to 10.0.1.1:80"), "{text}");
    assert!(!text.contains("10.0.1.2:80"), "{text}");
    assert!(!text.contains("numgen"), "one endpoint: no pick\n{text}");
}

#[test]
fn masquerade_all_and_every_local_address_for_nodeports() {
    let svc = service("ns", "web").cluster_ip("172.30.0.10").node_port_type();
    let svc = svc.port(port("p80", 80).node_port(30080));
    let opts = Options { masquerade_all: true, nodeport_addresses: vec![], ..options() };
    let text = render(&model(&[(svc, vec![ep("10.0.1.1")])]), &opts).to_string();
    let chains = ServiceChainsFor::web();
    let masquerade = format!(
        "add rule ip kube-proxy {} ip daddr 172.30.0.10 mark set mark or 0x4000",
        chains.cluster
    );
    assert!(text.contains(&masquerade), "{text}");
    assert!(text.contains("services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"));
    assert!(!text.contains("nodeport-ips"), "no set of NodePort addresses\n{text}");
}

#[test]
fn the_ipv6_family_as_kube_proxy_writes_it() {
    let svc = service("ns", "web").cluster_ip("fd00:96::10").cluster_ips(&["fd00:96::10"]);
    let svc =
        svc.node_port_type().port(port("p80", 80).node_port(30080)).client_ip_affinity(Some(60));
    let slice = svc.slice().address_type("IPv6").port("p80", 8080, Tcp).endpoint(ep("fd00:10::2"));
    let m = crate::source::model_of(&[svc.build()], &[slice.build()]);
    let opts = Options {
        family: IpFamily::V6,
        node_ips: vec!["fd00:100::11".parse().unwrap()],
        nodeport_addresses: vec![],
        cluster_cidr: Some(Cidr::parse("fd00:10::/64").unwrap()),
        ..options()
    };
    let text = render(&m, &opts).to_string();
    for line in [
        "add table ip6 kube-proxy",
        "add set ip6 kube-proxy cluster-ips { type ipv6_addr ;",
        "add set ip6 kube-proxy hairpin-endpoints { type ipv6_addr . ipv6_addr ;",
        "masquerading ct status dnat ip6 saddr . ip6 daddr @hairpin-endpoints mark set",
        "hairpin-endpoints { fd00:10::2 . fd00:10::2 }",
        "ip6 daddr fd00:96::10 ip6 saddr != fd00:10::/64 mark set mark or 0x4000",
        "__fd00.10..2/8080 { type ipv6_addr ; flags dynamic,timeout ; timeout 60s ; }",
        "__fd00.10..2/8080 { ip6 saddr } meta l4proto tcp dnat to [fd00:10::2]:8080\n",
        "ip6 saddr @affinity-",
        "ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports",
        "add element ip6 kube-proxy service-ips { fd00:96::10 . tcp . 80 : goto service-",
    ] {
        assert!(text.contains(line), "missing {line}\n{text}");
    }
    assert!(render(&m, &options()).chains.is_empty(), "the IPv4 table has no IPv6 service");
}

#[test]
fn a_partial_sync_writes_only_what_changed() {
    let svc = |name: &str, ip: &str| service("ns", name).cluster_ip(ip).port(port("p80", 80));
    let before = render(
        &model(&[
            (svc("a", "172.30.0.1"), vec![ep("10.0.1.1")]),
            (svc("b", "172.30.0.2"), vec![ep("10.0.2.1")]),
        ]),
        &options(),
    );
    let after = render(
        &model(&[
            (svc("a", "172.30.0.1"), vec![ep("10.0.1.1")]),
            (svc("b", "172.30.0.2"), vec![ep("10.0.2.2")]),
        ]),
        &options(),
    );
    assert_eq!(before.partial(&before.applied()).text, "", "nothing changed, nothing written");
    let tx = after.partial(&before.applied());
    // b's service chain (its pick) and its new endpoint's hairpin element;
    // the old one's stays (see `an_endpoint_of_two_ports_is_one_hairpin_element`).
    assert_eq!(tx.chains_written, 1, "{}", tx.text);
    assert!(!tx.text.contains("ns/a/"), "a is untouched\n{}", tx.text);
    assert!(tx.text.contains("dnat to 10.0.2.2:80"), "{}", tx.text);
    assert!(tx.stale_chains.is_empty());
    assert_eq!(tx.elements_written, 1, "the maps still send b to its chain");
    assert!(
        tx.text.contains("add element ip kube-proxy hairpin-endpoints { 10.0.2.2 . 10.0.2.2 }")
    );

    // b loses its endpoints: its service-ips element becomes a reject.
    let empty = render(
        &model(&[(svc("a", "172.30.0.1"), vec![ep("10.0.1.1")]), (svc("b", "172.30.0.2"), vec![])]),
        &options(),
    );
    let tx = empty.partial(&after.applied());
    assert!(
        tx.text.contains("delete element ip kube-proxy service-ips { 172.30.0.2 . tcp . 80 }"),
        "{}",
        tx.text
    );
    assert!(
        tx.text.contains("add element ip kube-proxy no-endpoint-services { 172.30.0.2 . tcp . 80 comment \"ns/b:p80\" : goto reject-chain }"),
        "{}",
        tx.text
    );
    assert_eq!(tx.stale_chains.len(), 1, "b's service chain");
}

#[test]
fn a_full_sync_rewrites_everything_and_removes_what_it_does_not_write() {
    let svc = service("ns", "web").cluster_ip("172.30.0.10").port(port("p80", 80));
    let rs =
        render(&model(&[(svc.client_ip_affinity(Some(30)), vec![ep("10.0.1.1")])]), &options());
    let existing = Existing {
        chains: ["services", "service-OLD00000-ns/old/tcp/p80"].map(String::from).into(),
        sets: ["cluster-ips", "affinity-OLD00000-ns/old/tcp/p80__10.0.0.9/80"]
            .map(String::from)
            .into(),
    };
    let tx = full(&rs, &existing, true);
    for line in [
        "add chain ip kube-proxy nat-prerouting\ndelete chain ip kube-proxy nat-prerouting\n",
        "flush map ip kube-proxy service-ips\n",
        "flush chain ip kube-proxy services\n",
        "flush chain ip kube-proxy service-OLD00000-ns/old/tcp/p80\n",
        "delete set ip kube-proxy affinity-OLD00000-ns/old/tcp/p80__10.0.0.9/80\n",
    ] {
        assert!(tx.text.contains(line), "missing {line}\n{}", tx.text);
    }
    assert_eq!(tx.stale_chains, ["service-OLD00000-ns/old/tcp/p80"]);
    // The affinity set of a served endpoint is added, never flushed: its
    // clients keep their endpoint.
    assert!(!tx.text.contains("flush set ip kube-proxy affinity-"), "{}", tx.text);
    assert!(!full(&rs, &existing, false).text.contains("delete chain"));
}

/// A full sync of `rs` as one part.
fn full(rs: &Ruleset, existing: &Existing, recreate: bool) -> Transaction {
    let mut writer = SyncWriter::full(&fixed(&options()), recreate);
    writer.add(rs);
    writer.finish(Some(existing)).0
}

#[test]
fn a_full_sync_written_a_port_at_a_time_is_the_whole_ruleset() {
    let m = kube_proxys_overall_services();
    let opts = options();
    let whole = render(&m, &opts);
    let mut writer = SyncWriter::full(&fixed(&opts), false);
    for port in m.ports_of(IpFamily::V4) {
        assert!(!writer.add(&render_port(port, &opts)), "no two ports claim one element");
    }
    let (tx, applied) = writer.finish(Some(&Existing::default()));
    // Every statement of the whole ruleset, and besides them only the
    // flushes that empty what a full sync rewrites.
    let (flushes, written): (Vec<&str>, Vec<&str>) =
        tx.text.lines().partition(|l| l.starts_with("flush "));
    assert_eq!(statements(&written.join("\n")), statements(&whole.to_string()));
    assert!(flushes.contains(&"flush map ip kube-proxy service-ips"), "{}", tx.text);
    assert_eq!(applied, whole.applied());
    assert_eq!(tx.chains_written, whole.chains.len());
    assert_eq!(tx.elements_written, whole.elements.len());
    assert!(tx.stale_chains.is_empty());

    // What it applied is what a partial sync of the same compares with.
    let mut writer = SyncWriter::partial(IpFamily::V4, &applied);
    for port in m.ports_of(IpFamily::V4) {
        writer.add(&render_port(port, &opts));
    }
    let (tx, again) = writer.finish(None);
    assert_eq!(tx.text, "", "nothing changed, nothing written");
    assert_eq!(again, applied);
}

#[test]
fn of_two_parts_claiming_one_element_the_first_keeps_it() {
    let svc = |name: &str| service("ns", name).cluster_ip("172.30.0.1").port(port("p80", 80));
    let m = model(&[(svc("a"), vec![ep("10.0.1.1")]), (svc("b"), vec![ep("10.0.2.1")])]);
    let opts = options();
    let mut writer = SyncWriter::full(&fixed(&opts), false);
    let claims: Vec<bool> =
        m.ports_of(IpFamily::V4).map(|port| writer.add(&render_port(port, &opts))).collect();
    assert_eq!(claims, [false, true]);
    let (tx, applied) = writer.finish(None);
    let elements: Vec<&str> = tx
        .text
        .lines()
        .filter(|l| l.starts_with("add element ip kube-proxy service-ips"))
        .collect();
    assert_eq!(elements.len(), 1, "{}", tx.text);
    assert!(elements[0].contains("goto service-") && elements[0].contains("-ns/a/tcp/p80"));
    assert_eq!(applied, render(&m, &opts).applied(), "as the whole ruleset says");
}

#[test]
fn an_endpoint_of_two_ports_is_one_hairpin_element() {
    let svc = |name: &str, ip: &str| service("ns", name).cluster_ip(ip).port(port("p80", 80));
    let both = model(&[
        (svc("a", "172.30.0.1"), vec![ep("10.0.1.1")]),
        (svc("b", "172.30.0.2"), vec![ep("10.0.1.1")]),
    ]);
    let opts = options();
    let mut writer = SyncWriter::full(&fixed(&opts), false);
    for port in both.ports_of(IpFamily::V4) {
        assert!(!writer.add(&render_port(port, &opts)), "not a claim two ports dispute");
    }
    let (tx, applied) = writer.finish(None);
    let hairpin = "add element ip kube-proxy hairpin-endpoints { 10.0.1.1 . 10.0.1.1 }";
    assert_eq!(tx.text.matches(hairpin).count(), 1, "{}", tx.text);

    // b goes: a partial sync (of b's part alone) leaves the element, which
    // a still needs.
    let b = both.ports_of(IpFamily::V4).find(|p| &*p.name.service.name == "b").unwrap();
    let tx = Ruleset::new(IpFamily::V4, None).partial(&render_port(b, &opts).applied());
    assert!(tx.text.contains("delete element ip kube-proxy service-ips"), "{}", tx.text);
    assert!(!tx.text.contains("hairpin-endpoints"), "{}", tx.text);

    // One left when no port has it any more: a full sync does not write it.
    let none = model(&[(svc("a", "172.30.0.1"), vec![ep("10.0.2.1")])]);
    let mut writer = SyncWriter::full(&fixed(&opts), false);
    for port in none.ports_of(IpFamily::V4) {
        writer.add(&render_port(port, &opts));
    }
    let (tx, _) = writer.finish(None);
    assert!(tx.text.contains("flush set ip kube-proxy hairpin-endpoints\n"), "{}", tx.text);
    assert!(!tx.text.contains(hairpin), "{}", tx.text);
    assert!(
        applied.has_element(&(ruleset::Container::HairpinEndpoints, "10.0.1.1 . 10.0.1.1".into()))
    );
}
