//! `proxy-agent render iptables` produces input that iptables-restore and
//! ip6tables-restore (nft and legacy backends) accept and apply, and
//! `render nftables` input that nft applies, inside a lab node namespace.

use std::{
    io::Write,
    process::{Command, Stdio},
};

use proxy_lab::{Lab, NODE_IP, NODE_IP6, sh, target_bin};

const MANIFEST: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: lab}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalIPs: [10.200.0.11]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  loadBalancerSourceRanges: [192.168.100.0/24]
  sessionAffinity: ClientIP
  ports:
  - {name: http, port: 80, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, nodePort: 30053}
  - {name: diameter, port: 3868, protocol: SCTP, targetPort: 3869, nodePort: 30868}
status: {loadBalancer: {ingress: [{ip: 10.200.0.10}]}}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: lab}
spec: {type: NodePort, clusterIP: 10.96.0.20, internalTrafficPolicy: Local, ports: [{port: 80, nodePort: 30081}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: lab, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}, {name: diameter, port: 3869, protocol: SCTP}]
endpoints:
- {addresses: [10.244.1.2], nodeName: lab-node}
- {addresses: [10.244.2.2], nodeName: lab-node2}
---
apiVersion: v1
kind: Service
metadata: {name: web6, namespace: lab}
spec:
  type: NodePort
  clusterIP: fd00:96::10
  clusterIPs: [fd00:96::10]
  ipFamilies: [IPv6]
  ipFamilyPolicy: SingleStack
  externalIPs: [fd00:200::11]
  ports: [{name: http, port: 80, nodePort: 30082}, {name: diameter, port: 3868, protocol: SCTP, nodePort: 30869}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: lab, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: http, port: 8080}, {name: diameter, port: 3868, protocol: SCTP}]
endpoints:
- {addresses: ['fd00:244:1::2'], nodeName: lab-node}
- {addresses: ['fd00:244:2::2'], nodeName: lab-node2}
"#;

fn restore(netns: &str, program: &str, args: &[&str], input: &str) -> std::process::Output {
    let mut child = Command::new("ip")
        .args(["netns", "exec", netns, program])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// `render iptables` of [`MANIFEST`] for a dual-stack `lab-node`.
fn render(lab: &Lab, extra: &[&str]) -> String {
    render_for(lab, "iptables", extra)
}

/// `render <what>` of [`MANIFEST`] for a dual-stack `lab-node`.
fn render_for(lab: &Lab, what: &str, extra: &[&str]) -> String {
    let manifest = lab.write_manifest(MANIFEST).unwrap().to_string_lossy().into_owned();
    let node_ips = format!("{NODE_IP},{NODE_IP6}");
    let mut args =
        vec!["render", what, "--manifests", &manifest, "--hostname-override", "lab-node"];
    args.extend(["--node-ip", &node_ips]);
    args.extend(["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"]);
    args.extend(extra);
    sh(&target_bin("proxy-agent").to_string_lossy(), &args).unwrap()
}

/// Applies `input` with `program` in the lab node; `save`'s output after.
fn apply(lab: &Lab, program: &str, save: &str, input: &str) -> String {
    let applied = restore(&lab.node, program, &["--noflush"], input);
    assert!(applied.status.success(), "{program}: {}", String::from_utf8_lossy(&applied.stderr));
    sh("ip", &["netns", "exec", &lab.node, save]).unwrap()
}

#[test]
fn rendered_rules_are_accepted_and_applied_by_iptables_restore() {
    let lab = Lab::new().unwrap();
    let render = |extra: &[&str]| render(&lab, extra);
    let both = render(&[]);
    assert!(both.contains("# IPv4: iptables-restore input\n*filter"), "{both}");
    assert!(both.contains("# IPv6: ip6tables-restore input\n*filter"), "{both}");
    let rules = render(&["--ip-family", "IPv4"]);
    // nfacct matches need their counters, which kube-proxy creates first:
    // apply the variant without them.
    let applicable = render(&["--ip-family", "IPv4", "--no-nfacct"]);
    assert!(!rules.contains("fd00:"), "the IPv6 service is not in the IPv4 rules");
    for line in [
        "-A KUBE-NODEPORTS -m comment --comment \"lab/web:http health check node port\" -m tcp -p tcp --dport 32000 -j ACCEPT",
        "-A KUBE-SERVICES -m comment --comment \"lab/empty has no endpoints\" -m tcp -p tcp -d 10.96.0.20 --dport 80 -j REJECT",
        "-A KUBE-SERVICES -m comment --comment \"lab/web:diameter loadbalancer IP\" -m sctp -p sctp -d 10.200.0.10 --dport 3868 -j KUBE-FW-",
        "-A KUBE-NODEPORTS -m comment --comment lab/web:diameter -m sctp -p sctp --dport 30868 -j KUBE-EXT-",
        "-m sctp -p sctp -j DNAT --to-destination 10.244.1.2:3869",
    ] {
        assert!(rules.contains(line), "missing {line}\n{rules}");
    }
    assert!(rules.contains("nfacct") && !applicable.contains("nfacct"));
    for (program, save) in
        [("iptables-restore", "iptables-save"), ("iptables-legacy-restore", "iptables-legacy-save")]
    {
        let test = restore(&lab.node, program, &["--test", "--noflush"], &rules);
        assert!(
            test.status.success(),
            "{program} --test: {}",
            String::from_utf8_lossy(&test.stderr)
        );
        let saved = apply(&lab, program, save, &applicable);
        for chain in [
            "KUBE-SERVICES",
            "KUBE-FW-",
            "KUBE-EXT-",
            "KUBE-SVL-",
            "KUBE-SEP-",
            "KUBE-PROXY-FIREWALL",
        ] {
            assert!(saved.contains(chain), "{save} has no {chain}:\n{saved}");
        }
        // The SCTP port's rules, as iptables-save prints them back.
        for sctp in [
            "-A KUBE-SERVICES -d 10.96.0.10/32 -p sctp -m comment --comment \"lab/web:diameter cluster IP\" -m sctp --dport 3868 -j KUBE-SVC-",
            "-A KUBE-NODEPORTS -p sctp -m comment --comment \"lab/web:diameter\" -m sctp --dport 30868 -j KUBE-EXT-",
            " -m sctp -j DNAT --to-destination 10.244.1.2:3869",
        ] {
            assert!(saved.contains(sctp), "{save} has no {sctp}:\n{saved}");
        }
    }
}

#[test]
fn an_ipv6_only_service_s_rules_are_applied_by_ip6tables_restore() {
    let lab = Lab::new().unwrap();
    let rules = render(&lab, &["--ip-family", "IPv6", "--no-nfacct"]);
    assert!(!rules.contains("10.96.0.10"), "the IPv4 services are not in the IPv6 rules");
    for line in [
        "-A KUBE-SERVICES -m comment --comment \"lab/web6:http cluster IP\" -m tcp -p tcp -d fd00:96::10 --dport 80 -j KUBE-SVC-",
        "-j DNAT --to-destination [fd00:244:1::2]:8080",
        "-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS",
    ] {
        assert!(rules.contains(line), "missing {line}\n{rules}");
    }
    for (program, save) in [
        ("ip6tables-restore", "ip6tables-save"),
        ("ip6tables-legacy-restore", "ip6tables-legacy-save"),
    ] {
        let saved = apply(&lab, program, save, &rules);
        for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-EXT-", "KUBE-SVC-", "KUBE-SEP-"] {
            assert!(saved.contains(chain), "{save} has no {chain}:\n{saved}");
        }
        assert!(saved.contains("fd00:96::10/128"), "{save}:\n{saved}");
        assert!(
            saved.contains("-j DNAT --to-destination [fd00:244:1::2]:3868"),
            "{save}:\n{saved}"
        );
    }
}

#[test]
fn the_rendered_nftables_ruleset_is_applied_by_nft_and_read_back() {
    let lab = Lab::new().unwrap();
    let both = render_for(&lab, "nftables", &[]);
    assert!(both.contains("# IPv4: table ip kube-proxy input\nadd table ip kube-proxy"), "{both}");
    assert!(
        both.contains("# IPv6: table ip6 kube-proxy input\nadd table ip6 kube-proxy"),
        "{both}"
    );
    for family in ["IPv4", "IPv6"] {
        let ruleset = render_for(&lab, "nftables", &["--ip-family", family]);
        let applied = restore(&lab.node, "nft", &["-f", "-"], &ruleset);
        assert!(applied.status.success(), "nft: {}", String::from_utf8_lossy(&applied.stderr));
    }
    let listed = |family: &str| {
        sh("ip", &["netns", "exec", &lab.node, "nft", "list", "table", family, "kube-proxy"])
            .unwrap()
    };
    let v4 = listed("ip");
    for text in [
        // Local policy, source ranges, affinity and SCTP, as nft lists them.
        "10.200.0.10 . tcp . 80 : goto firewall-",
        // The node is in the ranges: its load-balancer IP is admitted too.
        "ip saddr != { 10.200.0.10, 192.168.100.0/24 } drop",
        "10.96.0.20 . tcp . 80 comment \"lab/empty\" : goto reject-chain",
        "meta l4proto sctp dnat to 10.244.1.2:3869",
        "update @affinity-",
    ] {
        assert!(v4.contains(text), "missing {text}:\n{v4}");
    }
    let v6 = listed("ip6");
    assert!(v6.contains("meta l4proto tcp dnat to [fd00:244:1::2]:8080"), "{v6}");
    assert!(!v6.contains("10.96.0.10"), "the IPv4 services are not in the IPv6 table");
    // `lb list` reads both tables back.
    let lb = sh(
        "ip",
        &["netns", "exec", &lab.node, &target_bin("proxy-agent").to_string_lossy(), "lb", "list"],
    )
    .unwrap();
    for frontend in ["10.96.0.10:3868/sctp", "[fd00:96::10]:80/tcp", "*:30082/tcp"] {
        assert!(lb.contains(frontend), "{frontend} missing:\n{lb}");
    }
}
