//! The operator's commands in the lab, in both modes: `proxy-agent lb list`
//! reads the table back from the kernel (pinned maps, or iptables-save) and
//! must say the same thing in both modes, what the manifest asks for, and
//! what real connections do.

use std::collections::BTreeSet;

use proxy_lab::{
    Attempt, EXT_IP, Lab, Mode, NODE_IP, Setup, both_modes, external_modes, node_port, tally,
};
use test_objects::{Protocol::*, ep, manifest, port, service};

both_modes!(lb_list_shows_every_frontend_with_its_flags_and_backends);
// With XDP too: the flows it makes are the ones `ct list` reads.
external_modes!(ct_list_shows_the_flows_real_traffic_made);

/// (frontend, kind, service, flags, backend addresses), NodePorts as
/// `*:port` (the eBPF mode has one per node address, iptables one rule).
type Row = (String, String, String, BTreeSet<String>, BTreeSet<String>);

fn rows(json: &str) -> BTreeSet<Row> {
    let entries: Vec<serde_json::Value> = serde_json::from_str(json).expect(json);
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    entries
        .iter()
        // The eBPF mode's in-cluster twins: iptables has no frontend of them.
        .filter(|e| !e["flags"].as_array().unwrap().iter().any(|f| f == "in-cluster"))
        .map(|e| {
            let mut frontend = text(&e["frontend"]);
            if e["kind"] == "NodePort" {
                frontend = format!("*:{}", frontend.split_once(':').unwrap().1);
            }
            let list = |key: &str, field: Option<&str>| -> BTreeSet<String> {
                let items = e[key].as_array().unwrap().iter();
                items.map(|v| text(field.map_or(v, |f| &v[f]))).collect()
            };
            let backends = list("backends", Some("address"));
            (frontend, text(&e["kind"]), text(&e["service"]), list("flags", None), backends)
        })
        .collect()
}

fn row(frontend: &str, kind: &str, service: &str, flags: &[&str], backends: &[&str]) -> Row {
    let set = |items: &[&str]| items.iter().map(|s| s.to_string()).collect();
    (frontend.into(), kind.into(), service.into(), set(flags), set(backends))
}

/// A LoadBalancer service with an externalIP, source ranges, affinity and
/// the Local policy, one endpoint here and one on another node; a service
/// without endpoints; one with the internal Local policy.
fn lb_list_shows_every_frontend_with_its_flags_and_backends(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    let pod = lab.add_pod("web-0", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let web = service("demo", "web")
        .load_balancer_type()
        .cluster_ip("10.96.0.10")
        .external_ips(&["10.200.0.5"])
        .source_ranges(&["192.168.0.0/16"])
        .client_ip_affinity(Some(600))
        .external_policy("Local")
        .ingress_ip("172.18.0.50")
        .port(port("http", 80).target(8080).node_port(30080));
    let here_and_there = [
        ep("10.244.1.2").ready(true).node("lab-node"),
        ep("10.244.2.3").ready(true).node("other-node"),
    ];
    let web_slice = web.slice().port("http", 8080, Tcp).endpoints(here_and_there.clone());
    let empty = service("demo", "empty").cluster_ip("10.96.0.11").port(port("dns", 53).udp());
    let loc = service("demo", "loc")
        .cluster_ip("10.96.0.12")
        .internal_policy("Local")
        .port(port("http", 80).target(8080));
    let loc_slice = loc.slice().port("http", 8080, Tcp).endpoints(here_and_there);
    lab.write_manifest(&manifest(&[&web, &web_slice, &empty, &loc, &loc_slice])).unwrap();
    lab.start_agent(&[]).unwrap();

    let json = lab.inspect_on(0, &["lb", "list", "-o", "json"]).unwrap();
    let (here, there) = ("10.244.1.2:8080", "10.244.2.3:8080");
    let local_web = ["affinity", "local-policy"];
    // The nftables maps do not tell an externalIP from a load-balancer IP
    // without source ranges.
    let external_ip = if setup.mode == Mode::Nftables { "External" } else { "ExternalIP" };
    let expected = BTreeSet::from([
        row("10.96.0.10:80/tcp", "ClusterIP", "demo/web:http", &["affinity"], &[here, there]),
        row("*:30080/tcp", "NodePort", "demo/web:http", &local_web, &[here]),
        row("10.200.0.5:80/tcp", external_ip, "demo/web:http", &local_web, &[here]),
        row(
            "172.18.0.50:80/tcp",
            "LoadBalancer",
            "demo/web:http",
            &["affinity", "local-policy", "source-ranges"],
            &[here],
        ),
        row("10.96.0.11:53/udp", "ClusterIP", "demo/empty:dns", &[], &[]),
        row("10.96.0.12:80/tcp", "ClusterIP", "demo/loc:http", &["local-policy"], &[here]),
    ]);
    assert_eq!(rows(&json), expected, "{json}");

    // The table, filtered to one service, names what the JSON names.
    let table = lab.inspect_on(0, &["lb", "list", "--service", "demo/loc"]).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2, "a header and one frontend: {table}");
    assert!(lines[1].contains("demo/loc:http") && lines[1].contains(here), "{table}");

    // What real connections do: the Local-policy ClusterIP reaches only
    // the one backend `lb list` names, the other refuses.
    let attempts = lab.client(&client).tcp("10.96.0.12:80", 10).unwrap();
    assert_eq!(tally(&attempts).into_iter().collect::<Vec<_>>(), [("web-0".to_string(), 10)]);
    let refused = lab.client(&client).timeout_ms(1000).udp("10.96.0.11:53", 1);
    let refused = refused.unwrap();
    assert!(matches!(refused.as_slice(), [Attempt::Err { .. }]), "{refused:?}");
}

/// UDP to a NodePort from outside (translated per packet, SNATed to the
/// node) and to the ClusterIP from a pod (eBPF: at `sendmsg`; iptables: by
/// the node's rules): `ct list` shows both flows with their service and
/// the backend each went to.
fn ct_list_shows_the_flows_real_traffic_made(setup: Setup) {
    let mut lab = Lab::with(setup).unwrap();
    let pods = lab.add_web_pods(2, &[], &[5353]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let web = service("demo", "web")
        .node_port_type()
        .cluster_ip("10.96.0.10")
        .port(port("dns", 53).udp().target(5353).node_port(30053));
    let endpoints = pods.iter().map(|p| ep(&p.ip).ready(true).node("lab-node"));
    let slice = web.slice().port("dns", 5353, Udp).endpoints(endpoints);
    lab.write_manifest(&manifest(&[&web, &slice])).unwrap();
    lab.start_agent(&[]).unwrap();

    let outside = lab.client_outside(&ext).udp(&node_port(30053), 3).unwrap();
    let inside = lab.client(&client).udp("10.96.0.10:53", 3).unwrap();
    assert!(outside.iter().chain(&inside).all(|a| a.pod().is_some()), "{outside:?} {inside:?}");

    let json = lab.inspect_on(0, &["ct", "list", "-o", "json"]).unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).expect(&json);
    let pod_ips: Vec<&str> = pods.iter().map(|p| p.ip.as_str()).collect();
    let to_a_pod = |r: &&serde_json::Value| {
        let backend = r["backend"].as_str().unwrap();
        backend.ends_with(":5353") && pod_ips.contains(&backend.split(':').next().unwrap())
    };
    let of = |frontend: &str| {
        rows.iter()
            .filter(|r| r["frontend"] == frontend && r["service"] == "demo/web:dns")
            .filter(to_a_pod)
            .count()
    };
    assert!(of(&node_port(30053)) >= 1, "the NodePort flow: {json}");
    assert!(of("10.96.0.10:53") >= 1, "the ClusterIP flow: {json}");
    let node_port = rows.iter().find(|r| r["frontend"] == node_port(30053)).unwrap();
    assert!(node_port["client"].as_str().unwrap().starts_with(&format!("{EXT_IP}:")), "{json}");
    let snat = node_port["snat"].as_str().unwrap_or_default();
    assert!(snat.starts_with(&format!("{NODE_IP}:")), "SNATed to the node: {json}");

    // --backend keeps the flows to that pod only.
    let one = pod_ips[0];
    let json = lab.inspect_on(0, &["ct", "list", "-o", "json", "--backend", one]).unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).expect(&json);
    assert!(rows.iter().all(|r| r["backend"].as_str().unwrap().starts_with(&format!("{one}:"))));
}

/// The `bpftool` commands of the docs' shell blocks, continuation lines
/// joined and comments cut, as (file, command).
fn documented_bpftool_commands() -> Vec<(String, String)> {
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let mut commands = Vec::new();
    let files = std::fs::read_dir(&docs).unwrap().flatten();
    for entry in files.filter(|e| e.path().extension().is_some_and(|x| x == "md")) {
        let text = std::fs::read_to_string(entry.path()).unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut in_sh = false;
        let mut pending = String::new();
        for line in text.lines() {
            if line.starts_with("```") {
                in_sh = line == "```sh";
                continue;
            }
            let code = line.split(" #").next().unwrap_or_default().trim_end();
            if !in_sh || (pending.is_empty() && !code.starts_with("bpftool ")) {
                continue;
            }
            match code.strip_suffix('\\') {
                Some(head) => pending.push_str(head),
                None => {
                    pending.push_str(code);
                    commands.push((name.clone(), std::mem::take(&mut pending)));
                }
            }
        }
    }
    commands
}

/// Every `bpftool` recipe of the docs runs against a live eBPF lab (its
/// pins and cgroup in place of the defaults), so none can rot. eBPF only.
#[test]
fn ebpf_every_documented_bpftool_recipe_runs() {
    let mut lab = Lab::with(Setup::EBPF).unwrap();
    let pod = lab.add_pod("web-0", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    // 10.96.0.10:80/TCP, as the docs' lookup names it.
    let web = service("demo", "web").cluster_ip("10.96.0.10").port(port("http", 80).target(8080));
    let slice = web.slice().port("http", 8080, Tcp).endpoints([ep("10.244.1.2").ready(true)]);
    lab.write_manifest(&manifest(&[&web, &slice])).unwrap();
    lab.start_agent(&[]).unwrap();
    assert!(lab.client(&client).tcp("10.96.0.10:80", 1).unwrap()[0].pod().is_some());

    let commands = documented_bpftool_commands();
    assert!(commands.len() >= 10, "{commands:?}");
    let pins = lab.pins.to_string_lossy().into_owned();
    let cgroup = lab.cgroup.to_string_lossy().into_owned();
    for (file, command) in &commands {
        let command =
            command.replace("/sys/fs/bpf/proxy", &pins).replace("/sys/fs/cgroup/unified", &cgroup);
        let args: Vec<&str> = command.split_whitespace().skip(1).collect();
        // Interfaces are the node namespace's; maps, links and cgroups global
        // (and `ip netns exec` hides the host's /sys).
        let out = match command.contains(" net ") {
            true => lab.exec_on(0, "bpftool", &args),
            false => proxy_lab::sh("bpftool", &args),
        };
        let out = out.unwrap_or_else(|e| panic!("{file}: `{command}` failed: {e:#}"));
        assert!(
            !out.trim().is_empty() || command.contains("link show"),
            "{file}: `{command}` printed nothing"
        );
    }
}
