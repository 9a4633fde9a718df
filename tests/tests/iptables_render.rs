//! `proxy-agent render iptables` produces input that iptables-restore (nft
//! and legacy backends) accepts and applies, inside a lab node namespace.

use std::{
    io::Write,
    process::{Command, Stdio},
};

use proxy_lab::{Lab, sh, target_bin};

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
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.1.2], nodeName: lab-node}
- {addresses: [10.244.2.2], nodeName: lab-node2}
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

#[test]
fn rendered_rules_are_accepted_and_applied_by_iptables_restore() {
    let lab = Lab::new().unwrap();
    let manifest = lab.write_manifest(MANIFEST).unwrap();
    let agent = target_bin("proxy-agent");
    let manifest = manifest.to_string_lossy().into_owned();
    let render = |extra: &[&str]| {
        let mut args =
            vec!["render", "iptables", "--manifests", &manifest, "--hostname-override", "lab-node"];
        args.extend(["--node-ip", "192.168.100.11", "--cluster-cidr", "10.244.0.0/16"]);
        args.extend(extra);
        sh(&agent.to_string_lossy(), &args).unwrap()
    };
    let rules = render(&[]);
    // nfacct matches need their counters, which kube-proxy creates first:
    // apply the variant without them.
    let applicable = render(&["--no-nfacct"]);
    for line in [
        "-A KUBE-NODEPORTS -m comment --comment \"lab/web:http health check node port\" -m tcp -p tcp --dport 32000 -j ACCEPT",
        "-A KUBE-SERVICES -m comment --comment \"lab/empty has no endpoints\" -m tcp -p tcp -d 10.96.0.20 --dport 80 -j REJECT",
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
        let applied = restore(&lab.node, program, &["--noflush"], &applicable);
        assert!(
            applied.status.success(),
            "{program}: {}",
            String::from_utf8_lossy(&applied.stderr)
        );
        let saved = sh("ip", &["netns", "exec", &lab.node, save]).unwrap();
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
    }
}
