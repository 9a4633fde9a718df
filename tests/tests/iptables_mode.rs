//! What only the iptables mode has: the rules are those `render iptables`
//! prints, they come back after someone flushes them, a refused partial
//! restore is followed by a full one, `/healthz` fails while syncs keep
//! failing, `cleanup` removes them, and switching modes removes the other
//! mode's datapath.

use std::time::{Duration, Instant};

use proxy_lab::{Attempt, Lab, Mode, NODE_IP6, Pod, Request, Tally, target_bin};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// Service `web` (80/TCP → 8080) over `pods`, and an unrelated `other`.
fn web_manifest(pods: &[&Pod]) -> String {
    let web = service("lab", "web")
        .node_port_type()
        .cluster_ip("10.96.0.10")
        .port(port("http", 80).target(8080).node_port(30080));
    let other = service("lab", "other").cluster_ip("10.96.0.11").port(port(None, 80));
    let endpoints = pods.iter().map(|p| ep(&p.ip).node("lab-node"));
    let slice = web.slice().port("http", 8080, Tcp).endpoints(endpoints);
    manifest(&[&web, &other, &slice])
}

/// A lab with two web pods and a client pod, in `mode`.
fn lab(mode: Mode) -> (Lab, Vec<Pod>, Pod) {
    let mut lab = Lab::with_mode(mode).unwrap();
    let pods = lab.add_web_pods(2, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>())).unwrap();
    (lab, pods, client)
}

/// `count` connections to the service from `client` (outside the socket-LB
/// cgroup), by the pods that answered.
fn reach(lab: &Lab, client: &Pod, count: usize) -> Tally {
    let attempts = lab.client_outside(client).timeout_ms(500).tcp("10.96.0.10:80", count).unwrap();
    Tally::of(&attempts)
}

/// The chains of `table` named `KUBE-…` in `iptables-save` output.
fn kube_chains(saved: &str, table: &str) -> Vec<String> {
    let mut in_table = false;
    let mut chains = Vec::new();
    for line in saved.lines() {
        if let Some(t) = line.strip_prefix('*') {
            in_table = t == table;
        } else if let Some(chain) = line.strip_prefix(":KUBE-").filter(|_| in_table) {
            chains.push(format!("KUBE-{}", chain.split(' ').next().unwrap()));
        }
    }
    chains.sort();
    chains
}

/// The lines of `iptables-save` output that belong to the iptables mode
/// (kubelet's `KUBE-FIREWALL` is not ours).
fn ours(saved: &str) -> Vec<&str> {
    saved.lines().filter(|l| l.contains("KUBE-") && !l.contains("KUBE-FIREWALL")).collect()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn metric(lab: &Lab, name: &str) -> u64 {
    let metrics = lab.metrics().unwrap();
    metrics
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with([' ', '{'])))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
}

#[test]
fn the_applied_rules_are_the_rendered_ones_and_cleanup_removes_them() {
    let (mut lab, _pods, _client) = lab(Mode::Iptables);
    lab.start_agent(&[]).unwrap();
    let manifest = lab.dir.join("manifests.yaml");
    let rendered = lab
        .exec_on(
            0,
            &target_bin("proxy-agent").to_string_lossy(),
            &[
                "render",
                "iptables",
                "--manifests",
                &manifest.to_string_lossy(),
                "--hostname-override",
                "lab-node",
                "--node-ip",
                &lab.nodes()[0].ip,
                "--no-nfacct",
                "--ip-family",
                "IPv4",
            ],
        )
        .unwrap();
    let saved = lab.iptables_save_on(0).unwrap();
    for table in ["filter", "nat"] {
        let mut applied = kube_chains(&saved, table);
        applied.retain(|c| c != "KUBE-PROXY-CANARY");
        assert_eq!(applied, kube_chains(&rendered, table), "{table}:\n{saved}");
    }
    // The same rules, as iptables-save prints them back.
    let rules = |text: &str| text.lines().filter(|l| l.starts_with("-A KUBE-")).count();
    assert_eq!(rules(&saved), rules(&rendered));
    for jump in ["-A PREROUTING", "-A OUTPUT", "-A POSTROUTING", "-A INPUT", "-A FORWARD"] {
        assert!(saved.contains(jump), "{jump} missing:\n{saved}");
    }
    assert_eq!(kube_chains(&saved, "mangle"), ["KUBE-PROXY-CANARY"]);

    lab.kill_agent();
    lab.cleanup_on(0).unwrap();
    let saved = lab.iptables_save_on(0).unwrap();
    assert_eq!(ours(&saved), Vec::<&str>::new(), "left after cleanup:\n{saved}");
    // kubelet's martian drop stays, as kube-proxy leaves it.
    assert_eq!(saved.matches("-j KUBE-FIREWALL").count(), 2, "{saved}");
}

/// `iptables-save` or `ip6tables-save` lines of the iptables mode.
fn saved_on(lab: &Lab, program: &str) -> String {
    lab.exec_on(0, program, &[]).unwrap()
}

#[test]
fn an_ipv6_node_address_brings_the_ipv6_family_s_rules_and_cleanup_removes_them() {
    let (mut lab, pods, _client) = lab(Mode::Iptables);
    // An IPv6-only service beside the lab's IPv4 ones (no IPv6 traffic in
    // the lab yet: the rules are checked, not used).
    let web6 = service("lab", "web6")
        .node_port_type()
        .cluster_ip("fd00:96::10")
        .cluster_ips(&["fd00:96::10"])
        .ip_families(&["IPv6"])
        .port(port("http", 80).target(8080).node_port(30082));
    let slice6 = test_objects::slice("lab", "web6-1").service("web6").address_type("IPv6");
    let slice6 = slice6.port("http", 8080, Tcp).endpoint(ep("fd00:244:1::2").node("lab-node"));
    let ipv4 = web_manifest(&pods.iter().collect::<Vec<_>>());
    lab.write_manifest(&format!("{ipv4}---\n{}", manifest(&[&web6, &slice6]))).unwrap();
    lab.start_agent(&["--node-ip", NODE_IP6]).unwrap();
    let saved6 = saved_on(&lab, "ip6tables-save");
    for needle in [
        "-A KUBE-SERVICES -d fd00:96::10/128 -p tcp -m comment --comment \"lab/web6:http cluster IP\"",
        "--to-destination [fd00:244:1::2]:8080",
        ":KUBE-PROXY-CANARY",
    ] {
        assert!(saved6.contains(needle), "{needle} missing:\n{saved6}");
    }
    assert!(!saved6.contains("10.96.0.10"), "IPv4 services in ip6tables:\n{saved6}");
    assert!(!saved_on(&lab, "iptables-save").contains("fd00:"), "IPv6 in iptables");
    assert_eq!(metric(&lab, "proxy_unserved_service_ports"), 0, "served here");

    lab.kill_agent();
    lab.cleanup_on(0).unwrap();
    let saved6 = saved_on(&lab, "ip6tables-save");
    let left: Vec<&str> = saved6.lines().filter(|l| l.contains("KUBE-")).collect();
    // kubelet's chain (ensured, never removed, as in IPv4) may stay.
    assert!(left.iter().all(|l| l.contains("KUBE-FIREWALL")), "left after cleanup:\n{saved6}");
}

#[test]
fn rules_flushed_by_another_program_come_back() {
    let (mut lab, _pods, client) = lab(Mode::Iptables);
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);

    // What a firewall reload does: flush every chain, delete ours, put
    // back its own rules (which keep conntrack on).
    for table in ["filter", "nat", "mangle"] {
        lab.exec_on(0, "iptables", &["-t", table, "-F"]).unwrap();
        lab.exec_on(0, "iptables", &["-t", table, "-X"]).unwrap();
    }
    lab.drop_invalid_forwards(0).unwrap();
    // A connection attempted meanwhile: its SYN makes an untranslated
    // conntrack entry, which its retransmissions would keep matching.
    let mut patient = lab
        .client_outside(&client)
        .timeout_ms(8000)
        .spawn(Request::tcp("10.96.0.10:80", 1))
        .unwrap();
    wait_for("the resync", Duration::from_secs(10), || reach(&lab, &client, 1).errors.is_empty());
    let counts = reach(&lab, &client, 20);
    assert_eq!(counts.errors, Default::default(), "{counts:?}\n{}", lab.agent_log());
    assert_eq!(counts.pods.len(), 2, "{counts:?}\n{}", lab.agent_log());
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(patient.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    patient.wait().unwrap();
    let attempt = Attempt::parse(&line).unwrap();
    assert!(
        attempt.pod().is_some(),
        "the retried SYN was translated: {attempt:?}\n{}",
        lab.agent_log()
    );
    assert!(attempt.ms() > 900.0, "it was sent before the rules came back: {attempt:?}");
    assert!(lab.agent_log().contains("made while the rules were missing deleted"));
    assert!(lab.agent_log().contains("KUBE-PROXY-CANARY is gone"), "{}", lab.agent_log());
    assert_eq!(metric(&lab, "proxy_iptables_canary_resyncs_total"), 1);
}

#[test]
fn a_refused_partial_restore_is_followed_by_a_full_one() {
    let (mut lab, mut pods, client) = lab(Mode::Iptables);
    lab.start_agent(&[]).unwrap();
    let saved = lab.iptables_save_on(0).unwrap();
    // Someone deletes web-0's endpoint chain (after emptying the service
    // chain that jumps to it).
    let svc = kube_chains(&saved, "nat").into_iter().find(|c| c.starts_with("KUBE-SVC-")).unwrap();
    let sep = saved
        .lines()
        .find(|l| l.contains("DNAT") && l.contains("10.244.1.2:8080"))
        .and_then(|l| l.split(' ').nth(1))
        .unwrap()
        .to_string();
    lab.exec_on(0, "iptables", &["-t", "nat", "-F", &svc]).unwrap();
    lab.exec_on(0, "iptables", &["-t", "nat", "-F", &sep]).unwrap();
    lab.exec_on(0, "iptables", &["-t", "nat", "-X", &sep]).unwrap();

    // A new endpoint: the partial restore rewrites the service chain, which
    // jumps to the chain it believes is there, and iptables-restore refuses.
    let extra = lab.add_pod("web-2", "10.244.1.4").unwrap();
    lab.serve(&extra, &[8080], &[]).unwrap();
    pods.push(extra);
    lab.write_manifest(&web_manifest(&pods.iter().collect::<Vec<_>>())).unwrap();
    wait_for("a full resync", Duration::from_secs(10), || {
        lab.agent_log().matches("full=true").count() >= 2
    });
    assert!(lab.agent_log().contains("sync failed"), "{}", lab.agent_log());
    assert!(metric(&lab, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total") >= 1);
    let counts = reach(&lab, &client, 60);
    assert_eq!(counts.served().len(), 3, "every endpoint again: {counts:?}");
}

#[test]
fn switching_modes_removes_the_other_modes_datapath() {
    let (mut lab, _pods, client) = lab(Mode::Ebpf);
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    let cgroup = lab.cgroup.to_string_lossy().into_owned();
    let programs = || proxy_lab::sh("bpftool", &["cgroup", "show", &cgroup]).unwrap();
    assert!(programs().contains("connect4"));

    // eBPF → iptables: once the rules are in, the programs and pins go.
    lab.kill_agent();
    lab.start_agent(&["--proxy-mode", "iptables"]).unwrap();
    assert!(!programs().contains("connect4"), "{}", programs());
    assert!(!lab.pins.join("links").exists(), "pins left");
    let tc = lab.exec_on(0, "tc", &["filter", "show", "dev", "eth0", "ingress"]).unwrap();
    assert!(!tc.contains("tc_ingress"), "{tc}");
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    assert!(lab.iptables_save_on(0).unwrap().contains("KUBE-SERVICES"));

    // iptables → eBPF: once the programs serve, the rules go.
    lab.kill_agent();
    lab.start_agent(&["--proxy-mode", "ebpf"]).unwrap();
    let saved = lab.iptables_save_on(0).unwrap();
    assert_eq!(ours(&saved), Vec::<&str>::new(), "{saved}");
    assert!(lab.agent_log().contains("removed the iptables mode's rules"));
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
}

#[test]
fn auto_mode_runs_ebpf_on_this_kernel() {
    let (mut lab, _pods, client) = lab(Mode::Ebpf);
    lab.start_agent(&["--proxy-mode", "auto"]).unwrap();
    assert!(lab.agent_log().contains("mode=\"ebpf\""), "{}", lab.agent_log());
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
}

/// `--iptables-backend auto` programs the implementation the node's kubelet
/// uses (its `KUBE-IPTABLES-HINT` chain), as kube-proxy's image picks it:
/// legacy here, nf_tables there; `cleanup` removes the rules from either.
#[test]
fn the_rules_go_where_kubelets_chains_are() {
    for (kubelet, other) in [("legacy", "nft"), ("nft", "legacy")] {
        let (mut lab, _pods, client) = lab(Mode::Iptables);
        let hint = format!("iptables-{kubelet}");
        lab.exec_on(0, &hint, &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"]).unwrap();
        lab.start_agent(&[]).unwrap();
        assert!(lab.agent_log().contains(&format!("backend={}", capitalized(kubelet))));
        let saved = |lab: &Lab, backend: &str| {
            lab.exec_on(0, &format!("iptables-{backend}-save"), &["-t", "nat"]).unwrap()
        };
        let (ours, theirs) = (saved(&lab, kubelet), saved(&lab, other));
        assert!(ours.contains("-A KUBE-SERVICES"), "{kubelet}: {ours}");
        assert!(!theirs.contains("KUBE-SERVICES"), "{other}: {theirs}");
        assert_eq!(reach(&lab, &client, 10).served().values().sum::<usize>(), 10);

        lab.stop_agent_on(0);
        let agent = target_bin("proxy-agent").to_string_lossy().into_owned();
        let pins = lab.pins.to_string_lossy().into_owned();
        lab.exec_on(0, &agent, &["cleanup", "--bpffs-root", &pins]).unwrap();
        let cleaned = saved(&lab, kubelet);
        assert!(!cleaned.contains("KUBE-SERVICES"), "cleaned: {cleaned}");
    }
}

fn capitalized(word: &str) -> String {
    word[..1].to_uppercase() + &word[1..]
}

/// kube-proxy's `/healthz` turns 503 when changes wait unsynced for twice
/// the sync period, and 200 again once a sync goes through. The fault is a
/// real one: an administrator's rule jumps to an endpoint chain, so
/// iptables-restore cannot delete that chain when its endpoint goes.
#[test]
fn healthz_fails_while_syncs_fail_and_recovers_after() {
    let (mut lab, pods, client) = lab(Mode::Iptables);
    lab.start_agent(&["--sync-period", "2s"]).unwrap();
    let status = |lab: &Lab| {
        let reply = lab.http_get("127.0.0.1:10256", "/healthz").unwrap();
        reply.split(' ').nth(1).unwrap_or_default().to_string()
    };
    wait_for("healthz 200", Duration::from_secs(10), || status(&lab) == "200");
    let saved = lab.iptables_save_on(0).unwrap();
    let sep = saved
        .lines()
        .find(|l| l.contains("DNAT") && l.contains(&format!("{}:8080", pods[1].ip)))
        .and_then(|l| l.split(' ').nth(1))
        .unwrap()
        .to_string();
    let admin = ["-t", "nat", "-N", "ADMIN-AUDIT"];
    lab.exec_on(0, "iptables", &admin).unwrap();
    lab.exec_on(0, "iptables", &["-t", "nat", "-A", "ADMIN-AUDIT", "-j", &sep]).unwrap();

    // web-1 leaves: every sync now fails to delete its chain.
    lab.write_manifest(&web_manifest(&[&pods[0]])).unwrap();
    wait_for("a failed sync", Duration::from_secs(10), || lab.agent_log().contains("sync failed"));
    assert_eq!(status(&lab), "200", "not yet twice the sync period");
    wait_for("healthz 503", Duration::from_secs(15), || status(&lab) == "503");
    let livez = lab.http_get("127.0.0.1:10256", "/livez").unwrap();
    assert!(livez.starts_with("HTTP/1.1 503 "), "{livez}");
    assert!(metric(&lab, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total") >= 2);
    assert!(metric(&lab, "kubeproxy_proxy_healthz_total{code=\"503\"}") >= 1);
    // The last good rules keep serving meanwhile.
    reach(&lab, &client, 10).served();

    // The administrator's rule goes: the next retry applies the change.
    lab.exec_on(0, "iptables", &["-t", "nat", "-F", "ADMIN-AUDIT"]).unwrap();
    lab.exec_on(0, "iptables", &["-t", "nat", "-X", "ADMIN-AUDIT"]).unwrap();
    wait_for("healthz 200 again", Duration::from_secs(30), || status(&lab) == "200");
    let counts = reach(&lab, &client, 20);
    assert_eq!(counts.served().keys().collect::<Vec<_>>(), [&pods[0].name], "{counts:?}");
}

/// `--conntrack-max-per-core` and `--conntrack-min` raise the kernel's
/// conntrack maximum as kube-proxy's do; the lab's agents run in network
/// namespaces of their own, where the kernel refuses (its maximum and hash
/// size are the node's): the agent says so and serves, the host's value
/// is untouched (the lab never changes it).
#[test]
fn a_conntrack_maximum_the_kernel_refuses_is_reported_and_the_rules_serve() {
    const MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
    let host = std::fs::read_to_string(MAX).unwrap();
    let (mut lab, _pods, client) = lab(Mode::Iptables);
    let wanted = host.trim().parse::<u64>().unwrap() + 1024;
    let min = wanted.to_string();
    lab.start_agent(&["--conntrack-max-per-core", "1", "--conntrack-min", &min]).unwrap();
    assert_eq!(reach(&lab, &client, 10).served().values().sum::<usize>(), 10);
    let log = lab.agent_log();
    let line = log.lines().find(|l| l.contains("could not raise the kernel's conntrack maximum"));
    let line = line.unwrap_or_else(|| panic!("no warning:\n{log}"));
    assert!(line.contains(&format!("wanted={wanted}")), "{line}");
    assert_eq!(std::fs::read_to_string(MAX).unwrap(), host, "the host's maximum");
}
