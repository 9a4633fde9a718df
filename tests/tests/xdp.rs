//! `--bpf-lb-acceleration` where a node interface's driver has no XDP: a
//! bridge holding a second node address. `native` refuses to take over,
//! names it and attaches nothing (retrying, as for any failed take-over);
//! `best-effort` serves, XDP on the uplink, tc alone on the bridge, and
//! says so in its log.

use std::time::{Duration, Instant};

use proxy_lab::{EXT_IP, Lab, Setup, answered, node_port};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// A node address on a bridge, which has no driver-mode XDP.
const BRIDGE_IP: &str = "192.168.200.1";

#[test]
fn native_refuses_a_driver_without_xdp_and_best_effort_leaves_it_to_tc() {
    let mut lab = Lab::with(Setup::XDP).unwrap();
    let pod = lab.add_pod("web-0", "10.244.1.2").unwrap();
    lab.serve(&pod, &[8080], &[]).unwrap();
    let ext = lab.add_external("ext", EXT_IP).unwrap();
    let web = service("demo", "web")
        .node_port_type()
        .cluster_ip("10.96.0.10")
        .port(port("http", 80).target(8080).node_port(30080));
    let slice = web.slice().port("http", 8080, Tcp).endpoints([ep("10.244.1.2").ready(true)]);
    lab.write_manifest(&manifest(&[&web, &slice])).unwrap();
    for args in [
        &["link", "add", "xb0", "type", "bridge"][..],
        &["addr", "add", &format!("{BRIDGE_IP}/24"), "dev", "xb0"],
        &["link", "set", "xb0", "up"],
    ] {
        lab.exec_on(0, "ip", args).unwrap();
    }

    lab.spawn_agent_on(0, &["--node-ip", BRIDGE_IP]).unwrap();
    let refusal = "XDP on xb0 in driver mode (--bpf-lb-acceleration native; best-effort leaves such interfaces to tc): program xdp_ingress";
    let deadline = Instant::now() + Duration::from_secs(30);
    let refused =
        |log: &str| log.lines().any(|l| l.contains("could not take over") && l.contains(refusal));
    while !refused(&lab.agent_log()) {
        assert!(Instant::now() < deadline, "{}", lab.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let uplink = lab.exec_on(0, "ip", &["-o", "link", "show", "eth0"]).unwrap();
    assert!(!uplink.contains("prog/xdp"), "nothing left attached: {uplink}");
    let hooks = lab.exec_on(0, "bpftool", &["net", "show"]).unwrap();
    assert!(!hooks.contains("tc_ingress"), "nor tc's: {hooks}");
    lab.kill_agent_on(0);

    let best_effort = ["--node-ip", BRIDGE_IP, "--bpf-lb-acceleration", "best-effort"];
    lab.start_agent(&best_effort).unwrap();
    answered(&lab.client_outside(&ext).tcp(&node_port(30080), 5).unwrap());
    let log = lab.agent_log();
    let fallback = log.lines().find(|l| l.contains("XDP cannot run on this interface"));
    assert!(fallback.is_some_and(|l| l.contains("interface=xb0")), "{log}");
    let uplink = lab.exec_on(0, "ip", &["-o", "link", "show", "eth0"]).unwrap();
    assert!(uplink.contains("prog/xdp"), "{uplink}");
    let listed = lab.inspect_on(0, &["lb", "list"]).unwrap();
    assert!(listed.lines().any(|l| l == "XDP (--bpf-lb-acceleration) on: eth0"), "{listed}");
}
