//! The nftables mode's own behaviour in the lab: switching to and from the
//! other modes (the new datapath serves, then the old one's state goes), a
//! table deleted by someone written again, and `cleanup`.

use std::time::{Duration, Instant};

use proxy_lab::{Lab, Mode, Pod, Tally, target_bin};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// `web` at 10.96.0.10:80 over two pods; a lab of `mode` and a client.
fn lab(mode: Mode) -> (Lab, Pod) {
    let mut lab = Lab::with_mode(mode).unwrap();
    let pods = lab.add_web_pods(2, &[8080], &[]).unwrap();
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    let web = service("lab", "web").cluster_ip("10.96.0.10").port(port("http", 80).target(8080));
    let slice = web.slice().port("http", 8080, Tcp).endpoints(pods.iter().map(|p| ep(&p.ip)));
    lab.write_manifest(&manifest(&[&web, &slice])).unwrap();
    (lab, client)
}

/// The pods `count` connections from outside the test cgroup reached.
fn reach(lab: &Lab, client: &Pod, count: usize) -> Tally {
    Tally::of(&lab.client_outside(client).timeout_ms(1000).tcp("10.96.0.10:80", count).unwrap())
}

/// Our IPv4 table, as nft lists it (an error when there is none).
fn table(lab: &Lab) -> anyhow::Result<String> {
    lab.exec_on(0, "nft", &["list", "table", "ip", "kube-proxy"])
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn switching_between_iptables_ebpf_and_nftables_removes_the_others_state() {
    let (mut lab, client) = lab(Mode::Iptables);
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);

    // iptables → nftables: once the table is in, the iptables rules go.
    lab.kill_agent();
    lab.start_agent(&["--proxy-mode", "nftables"]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    assert!(table(&lab).unwrap().contains("10.96.0.10 . tcp . 80 : goto service-"));
    wait_for("the iptables rules removed", Duration::from_secs(10), || {
        !lab.iptables_save_on(0).unwrap().contains("KUBE-SERVICES")
    });
    assert!(lab.agent_log().contains("removed the iptables mode's rules"), "{}", lab.agent_log());

    // nftables → eBPF (whose programs translate in front of the table):
    // once they serve, the tables go; then eBPF → nftables: the pins go.
    lab.kill_agent();
    lab.start_agent(&["--proxy-mode", "ebpf"]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    wait_for("the nftables table removed", Duration::from_secs(10), || table(&lab).is_err());
    let log = lab.agent_log();
    assert_eq!(log.matches("removed the nftables mode's tables").count(), 1, "{log}");
    lab.kill_agent();
    lab.start_agent(&["--proxy-mode", "nftables"]).unwrap();
    wait_for("the eBPF pins removed", Duration::from_secs(10), || !lab.pins.join("links").exists());
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);

    // nftables → iptables: once the rules are in, the tables go.
    lab.kill_agent();
    lab.start_agent(&["--proxy-mode", "iptables"]).unwrap();
    wait_for("the nftables table removed", Duration::from_secs(10), || table(&lab).is_err());
    // The log is appended to across restarts: the eBPF agent's line, then this one's.
    let log = lab.agent_log();
    assert_eq!(log.matches("removed the nftables mode's tables").count(), 2, "{log}");
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
}

#[test]
fn a_table_deleted_by_someone_is_written_again_and_cleanup_removes_it() {
    let (mut lab, client) = lab(Mode::Nftables);
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    lab.exec_on(0, "nft", &["delete", "table", "ip", "kube-proxy"]).unwrap();
    wait_for("the table written again", Duration::from_secs(10), || {
        table(&lab).is_ok_and(|t| t.contains("10.96.0.10 . tcp . 80 : goto service-"))
    });
    assert!(lab.agent_log().contains("was deleted by another program"));
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    // Flushed (rules gone, chains and maps left): written again too.
    lab.exec_on(0, "nft", &["flush", "table", "ip", "kube-proxy"]).unwrap();
    wait_for("the rules written again", Duration::from_secs(10), || {
        table(&lab).is_ok_and(|t| t.contains("vmap @service-ips"))
    });
    assert!(lab.agent_log().contains("was flushed by another program"));
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);

    lab.stop_agent_on(0);
    let agent = target_bin("proxy-agent").to_string_lossy().into_owned();
    let pins = lab.pins.to_string_lossy().into_owned();
    lab.exec_on(0, &agent, &["cleanup", "--bpffs-root", &pins]).unwrap();
    assert!(table(&lab).is_err(), "the table left: {:?}", table(&lab));
    let v6 = lab.exec_on(0, "nft", &["list", "table", "ip6", "kube-proxy"]);
    assert!(v6.is_err(), "{v6:?}");
}

/// An older agent's table in kube-proxy's layout: a per-endpoint chain and
/// the `mark-for-masquerade` chain it jumps to.
const OLDER_TABLE: &str = "add table ip kube-proxy
add chain ip kube-proxy mark-for-masquerade
add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000
add chain ip kube-proxy endpoint-AAAAAAAA-lab/old/tcp/http__10.244.9.9/8080
add rule ip kube-proxy endpoint-AAAAAAAA-lab/old/tcp/http__10.244.9.9/8080 ip saddr 10.244.9.9 jump mark-for-masquerade
add rule ip kube-proxy endpoint-AAAAAAAA-lab/old/tcp/http__10.244.9.9/8080 meta l4proto tcp dnat to 10.244.9.9:8080
";

#[test]
fn an_older_agents_endpoint_chains_and_mark_chain_go_once_the_ruleset_serves() {
    let (mut lab, client) = lab(Mode::Nftables);
    let older = lab.dir.join("older.nft");
    std::fs::write(&older, OLDER_TABLE).unwrap();
    lab.exec_on(0, "nft", &["-f", &older.to_string_lossy()]).unwrap();
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
    // The endpoint chain is flushed by the first sync and deleted a second
    // later by a sync of its own (nothing else changes); the mark chain in
    // the first sync, once nothing jumps to it.
    wait_for("the older chains deleted", Duration::from_secs(10), || {
        table(&lab).is_ok_and(|t| !t.contains("chain endpoint-") && !t.contains("mark-for-masq"))
    });
    assert_eq!(reach(&lab, &client, 20).served().len(), 2);
}
