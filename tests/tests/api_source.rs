//! The agent on the test API server: watches that break, expire (410) and
//! resume while traffic flows; an API server outage; Service updates;
//! kube-proxy's health endpoints and health-check node ports; topology
//! hints; bursts; metrics.

use std::{
    io::{BufRead, BufReader},
    time::{Duration, Instant},
};

use proxy_lab::{
    Attempt, EXT_IP, Lab, Mode, NODE_IP, Pod, Request, Setup, Source, apiserver::ApiServer,
    node_ip, node_port, tally, two_node_endpoints,
};
use test_objects::{Protocol::*, ep, manifest, port, service};

const API_IPTABLES: Setup = Setup::of(Mode::Iptables, Source::ApiServer);
const API_NFTABLES: Setup = Setup::of(Mode::Nftables, Source::ApiServer);

/// Service `web` (`port` → 8080) with endpoints on the given pods (`node`
/// names the node of each), its slice stamped with `trigger_time` if given.
fn web(port_: i32, pods: &[(&Pod, &str)], trigger_time: Option<&str>) -> String {
    let web = service("lab", "web").cluster_ip("10.96.0.10").port(port("http", port_).target(8080));
    let slice = web.slice().port("http", 8080, Tcp);
    let slice = slice.endpoints(pods.iter().map(|(p, node)| ep(&p.ip).node(node)));
    let slice = match trigger_time {
        Some(at) => slice.trigger_time(at),
        None => slice,
    };
    manifest(&[&web, &slice])
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

/// What a spawned client reported, once it ended.
fn attempts_of(flow: &mut std::process::Child) -> Vec<Attempt> {
    let out = flow.stdout.take().expect("the client's output");
    let attempts = BufReader::new(out).lines().map_while(Result::ok);
    let attempts = attempts.filter_map(|l| Attempt::parse(&l)).collect();
    flow.wait().unwrap();
    attempts
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tcp(lab: &Lab, client: &Pod, addr: &str, count: usize) -> Vec<Attempt> {
    lab.client(client).timeout_ms(500).tcp(addr, count).unwrap()
}

/// An HTTP GET from a namespace: (status code, headers and body).
fn get(lab: &Lab, netns: &str, addr: &str, path: &str) -> (u16, String) {
    let response = lab.client_in(netns, None).http_get(addr, path).unwrap();
    let status = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, response)
}

#[test]
fn watches_that_break_or_expire_resume_without_disturbing_traffic() {
    let (mut lab, mut pods, client) = lab(Setup::API, 2);
    lab.write_manifest(&web(80, &on_node0(&pods), None)).unwrap();
    lab.start_agent(&[]).unwrap();
    let lists_before = api(&lab).requests().iter().filter(|r| !r.contains("watch=")).count();

    // Traffic all along, from outside the socket-LB cgroup (per packet).
    let mut flow = lab
        .client_outside(&client)
        .timeout_ms(1000)
        .spawn(Request::tcp("10.96.0.10:80", 100).interval_ms(50))
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
    lab.write_manifest(&web(80, &on_node0(&pods), None)).unwrap();
    api(&lab).compact();
    api(&lab).set_up(true);

    let attempts = attempts_of(&mut flow);
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
    lab.write_manifest(&web(80, &on_node0(&pods), None)).unwrap();
    lab.start_agent(&[]).unwrap();

    api(&lab).set_up(false);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        let counts = tally(&tcp(&lab, &client, "10.96.0.10:80", 20));
        assert_eq!(counts.values().sum::<usize>(), 20, "served while the API server is down");
    }
    assert!(metric(&lab, "proxy_apiserver_watch_errors_total") > 0.0);
    // Back: a change made meanwhile arrives.
    lab.write_manifest(&web(80, &on_node0(&pods[..1]), None)).unwrap();
    api(&lab).set_up(true);
    wait_for("the change after the outage", Duration::from_secs(60), || {
        tally(&tcp(&lab, &client, "10.96.0.10:80", 20)).keys().eq(["web-0"])
    });
}

#[test]
fn a_service_update_that_changes_its_port() {
    let (mut lab, pods, client) = lab(Setup::API, 1);
    lab.write_manifest(&web(80, &on_node0(&pods), None)).unwrap();
    lab.start_agent(&[]).unwrap();
    assert_eq!(tally(&tcp(&lab, &client, "10.96.0.10:80", 5)).len(), 1);
    lab.write_manifest(&web(8000, &on_node0(&pods), None)).unwrap();
    wait_for("the new port", Duration::from_secs(5), || {
        tcp(&lab, &client, "10.96.0.10:8000", 1)[0].pod().is_some()
    });
    assert!(tcp(&lab, &client, "10.96.0.10:80", 1)[0].pod().is_none(), "the old port is gone");
}

#[test]
fn one_change_is_programmed_quickly_and_a_burst_in_few_syncs() {
    let (mut lab, pods, client) = lab(Setup::API, 2);
    lab.write_manifest(&web(80, &on_node0(&pods), None)).unwrap();
    lab.start_agent(&[]).unwrap();

    // One endpoint change, stamped as the EndpointSlice controller does.
    let now = proxy_lab::sh("date", &["-u", "+%Y-%m-%dT%H:%M:%S.%NZ"]).unwrap();
    lab.write_manifest(&web(80, &on_node0(&pods[..1]), Some(now.trim()))).unwrap();
    let programmed = "kubeproxy_network_programming_duration_seconds_count";
    wait_for("the change", Duration::from_secs(5), || metric(&lab, programmed) >= 1.0);
    assert_eq!(
        tally(&tcp(&lab, &client, "10.96.0.10:80", 20)).keys().collect::<Vec<_>>(),
        ["web-0"]
    );

    // A burst: 500 services with a slice each, created at once.
    let changes = |lab: &Lab| {
        metric(lab, "kubeproxy_sync_proxy_rules_service_changes_total")
            + metric(lab, "kubeproxy_sync_proxy_rules_endpoint_changes_total")
    };
    let (syncs, changes_before) = (metric(&lab, "proxy_sync_total"), changes(&lab));
    let burst: String = (0..500)
        .map(|i| {
            let ip = format!("10.97.{}.{}", i / 250, i % 250 + 1);
            let service = service("burst", &format!("s{i}")).cluster_ip(&ip).port(port(None, 80));
            let slice = service.slice().port(None, 8080, Tcp).endpoint(ep("10.244.1.2"));
            manifest(&[&service, &slice])
        })
        .collect();
    api(&lab).apply(&burst).unwrap();
    wait_for("the burst", Duration::from_secs(30), || {
        metric(&lab, "proxy_frontends") >= 501.0 && changes(&lab) - changes_before >= 1000.0
    });
    let burst_syncs = metric(&lab, "proxy_sync_total") - syncs;
    // Taken together, not a sync per change. How many a sync takes depends
    // on how fast the watch delivers them against how long a sync takes:
    // 30 to 80 syncs on the 2-core development machine under load.
    assert!(burst_syncs <= 100.0, "1000 changes at once took {burst_syncs} syncs");
    assert!(tcp(&lab, &client, "10.97.1.250:80", 1)[0].pod().is_some(), "the last one serves");
}

#[test]
fn healthz_and_livez_follow_the_node_as_kube_proxy() {
    let (mut lab, pods, _client) = lab(Setup::API, 1);
    lab.write_manifest(&web(80, &on_node0(&pods), None)).unwrap();
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
        .apply(&format!("apiVersion: v1\nkind: Node\nmetadata: {{name: lab-node}}\nspec: {{taints: [{{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}}]}}\nstatus: {{addresses: [{{type: InternalIP, address: {NODE_IP}}}]}}\n"))
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
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let lb = service("lab", "lb")
        .load_balancer_type()
        .cluster_ip("10.96.0.12")
        .external_policy("Local")
        .health_check_node_port(32000)
        .port(port("http", 80).target(8080).node_port(30090))
        .ingress_ip("10.200.0.10");
    let slice = lb.slice().port("http", 8080, Tcp).endpoints(two_node_endpoints(&["a"]));
    lab.write_manifest(&manifest(&[&lb, &slice])).unwrap();
    for node in 0..2 {
        lab.start_agent_on(node, &["--cluster-cidr", "10.244.0.0/16"]).unwrap();
    }
    // What a cloud load balancer's health checker sees, from outside.
    let (status, here) = get(&lab, &ext.netns, &node_port(32000), "/");
    assert_eq!(status, 200, "{here}");
    assert!(here.contains("X-Load-Balancing-Endpoint-Weight: 1"), "{here}");
    assert!(here.ends_with("{\n\t\"service\": {\n\t\t\"namespace\": \"lab\",\n\t\t\"name\": \"lb\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"), "{here}");
    let (status, there) = get(&lab, &ext.netns, &format!("{}:32000", node_ip(1)), "/");
    assert_eq!(status, 503, "no local endpoint on node 1: {there}");
    assert!(there.contains("\"localEndpoints\": 0"), "{there}");

    // The service goes: so does its health check.
    lab.write_manifest("").unwrap();
    wait_for("the health check to close", Duration::from_secs(5), || {
        lab.client_outside(&ext).timeout_ms(300).http_body(&node_port(32000), "/").is_err()
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

#[test]
fn health_check_node_ports_nftables() {
    health_check_node_ports(API_NFTABLES);
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
    let web = service("lab", "web")
        .cluster_ip("10.96.0.10")
        .traffic_distribution("PreferClose")
        .port(port("http", 80).target(8080));
    let zones = ["zone-0", "zone-1", "zone-1"];
    let endpoints = two_node_endpoints(&["a", "b", "c"]).into_iter().zip(zones);
    let endpoints = endpoints.map(|(endpoint, zone)| endpoint.zone(zone).for_zone(zone));
    let slice = web.slice().port("http", 8080, Tcp).endpoints(endpoints);
    lab.write_manifest(&manifest(&[&web, &slice])).unwrap();
    for node in 0..2 {
        lab.start_agent_on(node, &["--cluster-cidr", "10.244.0.0/16"]).unwrap();
    }
    let client0 = lab.add_pod_on(0, "client0", "10.244.1.100").unwrap();
    let client1 = lab.add_pod_on(1, "client1", "10.244.2.100").unwrap();
    let from0 = lab.client_outside(&client0).tcp("10.96.0.10:80", 30).unwrap();
    assert_eq!(tally(&from0).keys().collect::<Vec<_>>(), ["web-a"], "zone-0 stays in zone-0");
    let from1 = lab.client_outside(&client1).tcp("10.96.0.10:80", 40).unwrap();
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

#[test]
fn topology_hints_keep_traffic_in_the_zone_nftables() {
    topology_hints_keep_traffic_in_the_zone(API_NFTABLES);
}

/// `n` services in namespace `fill` (listed before namespace `lab`), each
/// with an endpoint nobody answers on: pages of a large list.
fn fillers(n: usize) -> String {
    let mut yaml = String::new();
    for i in 0..n {
        let ip = format!("10.96.{}.{}", 16 + i / 250, 1 + i % 250);
        let svc = service("fill", &format!("f{i:04}")).cluster_ip(&ip).port(port("http", 80));
        let slice = svc.slice().port("http", 8080, Tcp);
        let slice = slice.endpoints([ep(&format!("10.245.{}.{}", i / 250, 1 + i % 250))]);
        yaml += &manifest(&[&svc, &slice]);
    }
    yaml
}

/// The `writes=` of the agent's "datapath synced" lines in `log` whose
/// `source` is `source`.
fn sync_writes(log: &str, source: &str) -> Vec<u64> {
    let lines = log.lines().filter(|l| l.contains("datapath synced"));
    let lines = lines.filter(|l| l.contains(&format!("source=\"{source}\"")));
    let writes = |l: &str| l.split("writes=").nth(1)?.split(' ').next()?.parse().ok();
    lines.filter_map(writes).collect()
}

/// eBPF only (a rule-based mode's writes are live: it waits for the whole
/// list). A restart on a slow list, onto new maps (Maglev tables of another
/// size: the previous agent's maps are not adopted): what is listed is
/// written into the new agent's maps as it comes, nothing of it serves, the
/// previous agent's datapath serves meanwhile; once the list is whole, the
/// sync writes only the rest, and then the new agent takes over.
#[test]
fn a_slow_list_is_written_as_it_comes_and_served_only_whole() {
    let log = restart_on_a_slow_list(&["--bpf-lb-maglev-table-size", "251"]);
    let (partial, whole) = (sync_writes(&log, "partial"), sync_writes(&log, "whole"));
    assert!(partial.len() >= 2, "{log}");
    let first_whole = *whole.first().expect(&log);
    assert!(first_whole * 2 < partial.iter().sum::<u64>(), "{partial:?} then {first_whole}\n{log}");
}

/// The same restart onto the previous agent's maps, adopted: nothing is
/// written while the list comes (the previous agent's programs serve from
/// them), and the sync of the whole writes only what changed meanwhile.
#[test]
fn a_slow_list_on_adopted_maps_writes_only_what_changed_once_whole() {
    let log = restart_on_a_slow_list(&[]);
    assert!(log.contains("the previous agent's service maps adopted"), "{log}");
    let (partial, whole) = (sync_writes(&log, "partial"), sync_writes(&log, "whole"));
    assert!(partial.iter().all(|w| *w == 0), "{partial:?}\n{log}");
    // `late`: its backend, reverse-NAT entry, frontend and slot.
    assert_eq!(whole.first(), Some(&4), "{log}");
}

/// Restarts an agent (with `extra`) while the API server lists 4 pages of
/// each kind a second apart, a new service `late` on the last; checks that
/// it serves `late` only once whole, that the previous datapath served all
/// along, and that the programs were verified once; returns its log.
fn restart_on_a_slow_list(extra: &[&str]) -> String {
    let (mut lab, pods, client) = lab(Setup::API, 2);
    let late = service("lab", "late").cluster_ip("10.96.0.11").port(port("http", 80).target(8080));
    let late_slice = late.slice().port("http", 8080, Tcp).endpoints([ep(&pods[0].ip)]);
    let before = fillers(1600) + &web(80, &on_node0(&pods), None);
    lab.write_manifest(&before).unwrap();
    lab.start_agent(&[]).unwrap();
    assert_eq!(tally(&tcp(&lab, &client, "10.96.0.10:80", 4)).values().sum::<usize>(), 4);

    // The previous agent's datapath stays.
    lab.kill_agent();
    lab.write_manifest(&(before + &manifest(&[&late, &late_slice]))).unwrap();
    api(&lab).set_page_delay(Duration::from_secs(1));
    let mut flow = lab
        .client(&client)
        .timeout_ms(1000)
        .spawn(Request::tcp("10.96.0.10:80", 80).interval_ms(50))
        .unwrap();
    let restarted = lab.agent_log().len();
    lab.spawn_agent_on(0, extra).unwrap();
    let log = || lab.agent_log()[restarted..].to_string();
    wait_for("a sync of the listed part", Duration::from_secs(20), || {
        !sync_writes(&log(), "partial").is_empty()
    });
    let listing = log();
    assert!(!listing.contains("source read whole"), "{listing}");
    assert!(!listing.contains("datapath ready; serving"), "{listing}");
    // Not served before the whole list is in: the previous agent had none.
    let refused = tcp(&lab, &client, "10.96.0.11:80", 1);
    assert!(refused[0].pod().is_none(), "{refused:?}\n{listing}");
    wait_for("serving", Duration::from_secs(30), || log().contains("datapath ready; serving"));
    assert_eq!(tally(&tcp(&lab, &client, "10.96.0.11:80", 4)).get("web-0"), Some(&4), "{}", log());

    // The previous datapath served all along, then this one.
    let attempts = attempts_of(&mut flow);
    let failed: Vec<_> = attempts.iter().filter(|a| a.pod().is_none()).collect();
    assert!(failed.is_empty(), "{failed:?}\n{}", log());
    let log = log();
    assert_eq!(log.matches("BPF programs verified").count(), 1, "{log}");
    let (read, synced) = (log.find("source read whole"), log.find("datapath holds the whole"));
    assert!(read < synced && synced < log.find("datapath ready; serving"), "{log}");
    log
}
