//! The agent on the test API server: watches that break, expire (410) and
//! resume while traffic flows; an API server outage; Service updates;
//! kube-proxy's health endpoints and health-check node ports; topology
//! hints; bursts; metrics.

use std::{
    io::{BufRead, BufReader},
    time::{Duration, Instant},
};

use proxy_lab::{Attempt, Lab, Mode, Pod, Setup, Source, apiserver::ApiServer, tally};

const API_IPTABLES: Setup = Setup { mode: Mode::Iptables, source: Source::ApiServer };

/// Service `web` (80 → 8080) with endpoints on the given pods (`node`
/// names the node of each), and an optional annotation on the slice.
fn web(port: u16, pods: &[(&Pod, &str)], annotations: &str) -> String {
    let endpoints: String = pods
        .iter()
        .map(|(p, node)| format!("\n- {{addresses: [{}], nodeName: {node}}}", p.ip))
        .collect();
    let endpoints = if endpoints.is_empty() { " []".to_string() } else { endpoints };
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: lab}}
spec:
  clusterIP: 10.96.0.10
  ports: [{{name: http, port: {port}, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: lab
  labels: {{kubernetes.io/service-name: web}}
  annotations: {{{annotations}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:{endpoints}
"#
    )
}

/// A lab on the API server with `n` web pods on node 0 and a client pod.
fn lab(setup: Setup, n: usize) -> (Lab, Vec<Pod>, Pod) {
    let mut lab = Lab::with(setup).unwrap();
    let pods = lab.add_web_pods(n, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    (lab, pods, client)
}

fn on_node0(pods: &[Pod]) -> Vec<(&Pod, &str)> {
    pods.iter().map(|p| (p, "lab-node")).collect()
}

fn api(lab: &Lab) -> &ApiServer {
    lab.api().expect("the lab runs the test API server")
}

/// A metric's value summed over its series (`name` may include labels).
fn metric(lab: &Lab, name: &str) -> f64 {
    let metrics = lab.metrics().unwrap();
    let complete = name.ends_with('}');
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || (!complete && rest.starts_with('{')))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tcp(lab: &Lab, client: &Pod, addr: &str, count: usize) -> Vec<Attempt> {
    lab.client(client, &["--timeout-ms", "500", "tcp", addr, &count.to_string()]).unwrap()
}

/// An HTTP GET from a namespace: (status code, headers and body).
fn get(lab: &Lab, netns: &str, addr: &str, path: &str) -> (u16, String) {
    let response = lab.labpod(netns, None, &["http", addr, path, "--full"]).unwrap();
    let status = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, response)
}

#[test]
fn watches_that_break_or_expire_resume_without_disturbing_traffic() {
    let (mut lab, mut pods, client) = lab(Setup::API, 2);
    lab.write_manifest(&web(80, &on_node0(&pods), "")).unwrap();
    lab.start_agent(&[]).unwrap();
    let lists_before = api(&lab).requests().iter().filter(|r| !r.contains("watch=")).count();

    // Traffic all along, from outside the socket-LB cgroup (per packet).
    let mut flow = lab
        .spawn_outside(
            &client,
            &["--timeout-ms", "1000", "tcp", "10.96.0.10:80", "100", "--interval-ms", "50"],
        )
        .unwrap();

    // Connections reset: the watchers resume where they were.
    api(&lab).drop_watches();
    std::thread::sleep(Duration::from_millis(500));
    // The API server restarts, and changes made meanwhile are compacted
    // away: resuming is refused (410 Gone) and the watchers relist.
    api(&lab).set_up(false);
    let extra = lab.add_pod("web-2", "10.244.1.4").unwrap();
    lab.serve(&extra, &[8080], &[]).unwrap();
    pods.push(extra);
    lab.write_manifest(&web(80, &on_node0(&pods), "")).unwrap();
    api(&lab).compact();
    api(&lab).set_up(true);

    let attempts: Vec<Attempt> = BufReader::new(flow.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| Attempt::parse(&l))
        .collect();
    flow.wait().unwrap();
    assert_eq!(attempts.len(), 100, "every attempt reported");
    let failed: Vec<_> = attempts.iter().filter(|a| a.pod().is_none()).collect();
    assert!(failed.is_empty(), "{failed:?}\n{}", lab.agent_log());
    wait_for("the new endpoint", Duration::from_secs(10), || {
        tally(&tcp(&lab, &client, "10.96.0.10:80", 30)).contains_key("web-2")
    });
    let lists = api(&lab).requests().iter().filter(|r| !r.contains("watch=")).count();
    assert!(lists > lists_before, "a relist after 410 Gone");
    assert!(lab.agent_log().contains("too old resource version"), "{}", lab.agent_log());
}

#[test]
fn an_api_server_outage_changes_nothing_until_it_is_back() {
    let (mut lab, pods, client) = lab(Setup::API, 2);
    lab.write_manifest(&web(80, &on_node0(&pods), "")).unwrap();
    lab.start_agent(&[]).unwrap();

    api(&lab).set_up(false);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        let counts = tally(&tcp(&lab, &client, "10.96.0.10:80", 20));
        assert_eq!(counts.values().sum::<usize>(), 20, "served while the API server is down");
    }
    assert!(metric(&lab, "proxy_apiserver_watch_errors_total") > 0.0);
    // Back: a change made meanwhile arrives.
    lab.write_manifest(&web(80, &on_node0(&pods[..1]), "")).unwrap();
    api(&lab).set_up(true);
    wait_for("the change after the outage", Duration::from_secs(60), || {
        tally(&tcp(&lab, &client, "10.96.0.10:80", 20)).keys().eq(["web-0"])
    });
}

#[test]
fn a_service_update_that_changes_its_port() {
    let (mut lab, pods, client) = lab(Setup::API, 1);
    lab.write_manifest(&web(80, &on_node0(&pods), "")).unwrap();
    lab.start_agent(&[]).unwrap();
    assert_eq!(tally(&tcp(&lab, &client, "10.96.0.10:80", 5)).len(), 1);
    lab.write_manifest(&web(8000, &on_node0(&pods), "")).unwrap();
    wait_for("the new port", Duration::from_secs(5), || {
        tcp(&lab, &client, "10.96.0.10:8000", 1)[0].pod().is_some()
    });
    assert!(tcp(&lab, &client, "10.96.0.10:80", 1)[0].pod().is_none(), "the old port is gone");
}

#[test]
fn one_change_is_programmed_quickly_and_a_burst_in_few_syncs() {
    let (mut lab, pods, client) = lab(Setup::API, 2);
    lab.write_manifest(&web(80, &on_node0(&pods), "")).unwrap();
    lab.start_agent(&[]).unwrap();

    // One endpoint change, stamped as the EndpointSlice controller does.
    let now = proxy_lab::sh("date", &["-u", "+%Y-%m-%dT%H:%M:%S.%NZ"]).unwrap();
    let stamp = format!("endpoints.kubernetes.io/last-change-trigger-time: \"{}\"", now.trim());
    lab.write_manifest(&web(80, &on_node0(&pods[..1]), &stamp)).unwrap();
    let programmed = "kubeproxy_network_programming_duration_seconds_count";
    wait_for("the change", Duration::from_secs(5), || metric(&lab, programmed) >= 1.0);
    let latency = metric(&lab, "kubeproxy_network_programming_duration_seconds_sum");
    eprintln!("one endpoint change reached the kernel in {:.1} ms", latency * 1000.0);
    assert_eq!(
        tally(&tcp(&lab, &client, "10.96.0.10:80", 20)).keys().collect::<Vec<_>>(),
        ["web-0"]
    );

    // A burst: 500 services with a slice each, created at once.
    let syncs = metric(&lab, "proxy_sync_total");
    let mut burst = String::new();
    for i in 0..500 {
        burst.push_str(&format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: burst}}\nspec: {{clusterIP: 10.97.{}.{}, ports: [{{port: 80}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i}-1, namespace: burst, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [10.244.1.2]}}]\n",
            i / 250,
            i % 250 + 1
        ));
    }
    api(&lab).apply(&burst).unwrap();
    wait_for("the burst", Duration::from_secs(30), || metric(&lab, "proxy_frontends") >= 501.0);
    let burst_syncs = metric(&lab, "proxy_sync_total") - syncs;
    eprintln!("1000 objects created at once: {burst_syncs} syncs");
    // Coalesced (1 or 2 syncs on a quiet machine, a few more under load),
    // not one sync per change.
    assert!(burst_syncs < 100.0, "a burst of 1000 changes took {burst_syncs} syncs");
    assert!(tcp(&lab, &client, "10.97.1.250:80", 1)[0].pod().is_some(), "the last one serves");
}

#[test]
fn healthz_and_livez_follow_the_node_as_kube_proxy() {
    let (mut lab, pods, _client) = lab(Setup::API, 1);
    lab.write_manifest(&web(80, &on_node0(&pods), "")).unwrap();
    lab.start_agent(&[]).unwrap();
    let node = lab.node.clone();

    let (status, healthz) = get(&lab, &node, "127.0.0.1:10256", "/healthz");
    assert_eq!(status, 200, "{healthz}");
    assert!(healthz.contains("Content-Type: application/json"), "{healthz}");
    assert!(healthz.contains("X-Content-Type-Options: nosniff"), "{healthz}");
    assert!(
        healthz.contains("\"nodeEligible\":true,\"healthy\":true,\"status\":{\"IPv4\""),
        "{healthz}"
    );

    // The cluster autoscaler is about to remove the node: load balancers
    // should stop sending it traffic; the proxy itself is alive.
    api(&lab)
        .apply("apiVersion: v1\nkind: Node\nmetadata: {name: lab-node}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}\nstatus: {addresses: [{type: InternalIP, address: 192.168.100.11}]}\n")
        .unwrap();
    wait_for("the taint", Duration::from_secs(5), || {
        get(&lab, &node, "127.0.0.1:10256", "/healthz").0 == 503
    });
    let (_, healthz) = get(&lab, &node, "127.0.0.1:10256", "/healthz");
    assert!(healthz.contains("\"nodeEligible\":false"), "{healthz}");
    let (status, livez) = get(&lab, &node, "127.0.0.1:10256", "/livez");
    assert_eq!(status, 200, "{livez}");
    assert!(!livez.contains("nodeEligible"), "{livez}");
    assert_eq!(get(&lab, &node, "127.0.0.1:10256", "/other").0, 404);

    // The metrics count what happened: two 503s at least, one service and
    // its slice (and the sync of them).
    assert!(metric(&lab, "kubeproxy_proxy_healthz_total{code=\"503\"}") >= 2.0);
    assert!(metric(&lab, "kubeproxy_proxy_livez_total{code=\"200\"}") >= 1.0);
    assert_eq!(metric(&lab, "kubeproxy_sync_proxy_rules_service_changes_total"), 1.0);
    assert_eq!(metric(&lab, "kubeproxy_sync_proxy_rules_endpoint_changes_total"), 1.0);
    assert!(metric(&lab, "kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1.0);
    assert!(metric(&lab, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 1.7e9);
    assert_eq!(metric(&lab, "proxy_map_entries{map=\"SERVICES\"}"), 2.0, "a frontend and a slot");
    assert_eq!(
        get(&lab, &node, "127.0.0.1:10249", "/proxyMode").1.rsplit("\r\n").next(),
        Some("ebpf")
    );
}

fn health_check_node_ports(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    lab.add_node().unwrap();
    let a = lab.add_pod_on(0, "web-a", "10.244.1.2").unwrap();
    lab.serve(&a, &[8080], &[]).unwrap();
    let ext = lab.add_external("ext", "192.168.100.101").unwrap();
    lab.write_manifest(
        r#"apiVersion: v1
kind: Service
metadata: {name: lb, namespace: lab}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.12
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30090}]
status: {loadBalancer: {ingress: [{ip: 10.200.0.10}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: lab, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.2], nodeName: lab-node}]
"#,
    )
    .unwrap();
    for node in 0..2 {
        lab.start_agent_on(node, &["--cluster-cidr", "10.244.0.0/16"]).unwrap();
    }
    // What a cloud load balancer's health checker sees, from outside.
    let (status, here) = get(&lab, &ext.netns, "192.168.100.11:32000", "/");
    assert_eq!(status, 200, "{here}");
    assert!(here.contains("X-Load-Balancing-Endpoint-Weight: 1"), "{here}");
    assert!(here.ends_with("{\n\t\"service\": {\n\t\t\"namespace\": \"lab\",\n\t\t\"name\": \"lb\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"), "{here}");
    let (status, there) = get(&lab, &ext.netns, "192.168.100.12:32000", "/");
    assert_eq!(status, 503, "no local endpoint on node 1: {there}");
    assert!(there.contains("\"localEndpoints\": 0"), "{there}");

    // The service goes: so does its health check.
    lab.write_manifest("").unwrap();
    wait_for("the health check to close", Duration::from_secs(5), || {
        lab.labpod(&ext.netns, None, &["--timeout-ms", "300", "http", "192.168.100.11:32000", "/"])
            .is_err()
    });
}

#[test]
fn health_check_node_ports_ebpf() {
    health_check_node_ports(Setup::API);
}

#[test]
fn health_check_node_ports_iptables() {
    health_check_node_ports(API_IPTABLES);
}

fn topology_hints_keep_traffic_in_the_zone(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    lab.add_node().unwrap();
    let mut pods = Vec::new();
    for (node, name, ip) in
        [(0, "web-a", "10.244.1.2"), (1, "web-b", "10.244.2.2"), (1, "web-c", "10.244.2.3")]
    {
        let pod = lab.add_pod_on(node, name, ip).unwrap();
        lab.serve(&pod, &[8080], &[]).unwrap();
        pods.push(pod);
    }
    // The lab's nodes are in zone-0 and zone-1; the slice controller hinted
    // each endpoint for its own zone (trafficDistribution: PreferClose).
    lab.write_manifest(
        r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: lab}
spec: {clusterIP: 10.96.0.10, trafficDistribution: PreferClose, ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: lab, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.1.2], nodeName: lab-node, zone: zone-0, hints: {forZones: [{name: zone-0}]}}
- {addresses: [10.244.2.2], nodeName: lab-node2, zone: zone-1, hints: {forZones: [{name: zone-1}]}}
- {addresses: [10.244.2.3], nodeName: lab-node2, zone: zone-1, hints: {forZones: [{name: zone-1}]}}
"#,
    )
    .unwrap();
    for node in 0..2 {
        lab.start_agent_on(node, &["--cluster-cidr", "10.244.0.0/16"]).unwrap();
    }
    let client0 = lab.add_pod_on(0, "client0", "10.244.1.100").unwrap();
    let client1 = lab.add_pod_on(1, "client1", "10.244.2.100").unwrap();
    let from0 = lab.client_outside(&client0, &["tcp", "10.96.0.10:80", "30"]).unwrap();
    assert_eq!(tally(&from0).keys().collect::<Vec<_>>(), ["web-a"], "zone-0 stays in zone-0");
    let from1 = lab.client_outside(&client1, &["tcp", "10.96.0.10:80", "40"]).unwrap();
    assert_eq!(tally(&from1).keys().collect::<Vec<_>>(), ["web-b", "web-c"]);
}

#[test]
fn topology_hints_keep_traffic_in_the_zone_ebpf() {
    topology_hints_keep_traffic_in_the_zone(Setup::API);
}

#[test]
fn topology_hints_keep_traffic_in_the_zone_iptables() {
    topology_hints_keep_traffic_in_the_zone(API_IPTABLES);
}
