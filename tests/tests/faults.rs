//! Faults: the agent never leaves the datapath empty, never stops
//! following its source for good, and says what it refused.
//!
//! - Twenty `kill -9` and restarts at random moments of the agent's life
//!   (during its first sync, between syncs, during a resync) while a
//!   service that does not change carries steady TCP and UDP load, through
//!   the socket path and a NodePort: not one exchange fails.
//! - An API server that drops its watches, forgets its history (410 Gone),
//!   answers 500 and goes away for 30 s: traffic keeps flowing throughout,
//!   and a change made after it recovers is served.
//! - Full maps (eBPF): a service that does not fit is refused alone, named
//!   once in the log and counted in `proxy_services_refused`; an endpoint
//!   change of a service served goes through meanwhile; a replacement that
//!   fits on its own is applied even where old and new do not fit side by
//!   side. (iptables mode has no capacity to overflow: nothing to refuse.)
//! - Maps that size themselves (eBPF): services that outgrow the maps
//!   while the agent serves move into larger ones under steady load, not
//!   one exchange failing; a new agent sizes its maps from the source
//!   before it serves.

use std::{
    process::{Child, Output},
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime},
};

use proxy_lab::{Attempt, EXT_IP, Lab, Pod, Request, Setup, Source, node_port, tally};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// Each client's exchanges are this far apart...
const INTERVAL_MS: u64 = 10;
/// ...for at most this long, whatever happens to the test.
const LOAD_LIMIT: Duration = Duration::from_secs(150);

mod kill_and_restart {
    #[test]
    fn ebpf() {
        super::twenty_kills_under_load(proxy_lab::Setup::EBPF)
    }
    #[test]
    fn iptables() {
        super::twenty_kills_under_load(proxy_lab::Setup::IPTABLES)
    }
}

mod apiserver_faults {
    use proxy_lab::{Mode, Setup, Source};

    #[test]
    fn ebpf() {
        super::apiserver_faults(Setup::of(Mode::Ebpf, Source::ApiServer))
    }
    #[test]
    fn iptables() {
        super::apiserver_faults(Setup::of(Mode::Iptables, Source::ApiServer))
    }
}

/// A single-node lab with web-0 and web-1 serving TCP 8080 and UDP 5353, a
/// client pod and an external client.
struct Bench {
    lab: Lab,
    client: Pod,
    ext: Pod,
}

impl Bench {
    fn new(setup: Setup) -> Self {
        let mut lab = Lab::with(setup).unwrap();
        lab.add_web_pods(3, &[8080], &[5353]).unwrap();
        let client = lab.add_pod("client", "10.244.1.100").unwrap();
        let ext = lab.add_external("ext", EXT_IP).unwrap();
        Bench { lab, client, ext }
    }

    /// Steady load on the stable service: TCP connections and UDP
    /// datagrams through the socket path and through its NodePort.
    fn load(&mut self) -> Load {
        let count = (LOAD_LIMIT.as_millis() as u64 / INTERVAL_MS) as usize;
        let steady =
            |proto: &str, addr: &str| Request::of(proto, addr, count).interval_ms(INTERVAL_MS);
        let mut load = Load::default();
        let (socket_lb, per_packet) =
            (self.lab.client(&self.client), self.lab.client_outside(&self.ext));
        load.add("TCP socket LB", socket_lb.spawn(steady("tcp", "10.96.0.10:80")).unwrap());
        load.add("UDP socket LB", socket_lb.spawn(steady("udp", "10.96.0.10:53")).unwrap());
        let nodeport = steady("tcp", &node_port(30080));
        load.add("TCP NodePort", per_packet.spawn(nodeport).unwrap());
        let nodeport = steady("udp", &node_port(30053));
        load.add("UDP NodePort", per_packet.spawn(nodeport).unwrap());
        // Under way before the faults start.
        std::thread::sleep(Duration::from_millis(500));
        load
    }

    /// Which pod the churned service's ClusterIP answers from (socket path).
    fn churned_pod(&self) -> Option<String> {
        let attempts = self.lab.client(&self.client).tcp("10.96.0.20:80", 1).ok()?;
        attempts.first().and_then(|a| a.pod().map(str::to_string))
    }

    /// Until the churned service answers from `pod` (10 s at most).
    fn wait_for_churned(&self, pod: &str) {
        self.wait_for_churned_within(pod, Duration::from_secs(10));
    }

    fn wait_for_churned_within(&self, pod: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.churned_pod().as_deref() != Some(pod) {
            assert!(
                Instant::now() < deadline,
                "churn never served {pod}:\n{}",
                self.lab.agent_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The stable service (TCP 80 and UDP 53, NodePorts 30080 and 30053, over
/// web-0 and web-1) and a churned one whose only endpoint is web-`pod`.
fn services(pod: usize) -> String {
    let stable = service("lab", "stable")
        .cluster_ip("10.96.0.10")
        .node_port_type()
        .port(port("http", 80).target(8080).node_port(30080))
        .port(port("dns", 53).udp().target(5353).node_port(30053));
    let slice = stable.slice().port("http", 8080, Tcp).port("dns", 5353, Udp);
    let slice = slice.endpoints(["10.244.1.2", "10.244.1.3"].map(|ip| ep(ip).node("lab-node")));
    let churn =
        service("lab", "churn").cluster_ip("10.96.0.20").port(port("http", 80).target(8080));
    let address = format!("10.244.1.{}", 2 + pod);
    let churn_slice =
        churn.slice().port("http", 8080, Tcp).endpoints([ep(&address).node("lab-node")]);
    manifest(&[&stable, &slice, &churn, &churn_slice])
}

/// Long-running clients, their output read as it comes (a full pipe would
/// stall them).
#[derive(Default)]
struct Load {
    clients: Vec<(&'static str, u32, JoinHandle<std::io::Result<Output>>)>,
}

impl Load {
    fn add(&mut self, what: &'static str, child: Child) {
        let pid = child.id();
        self.clients.push((what, pid, std::thread::spawn(move || child.wait_with_output())));
    }

    /// Stops the clients; every exchange each made.
    fn stop(mut self) -> Vec<(&'static str, Vec<Attempt>)> {
        self.kill();
        std::mem::take(&mut self.clients)
            .into_iter()
            .map(|(what, _, reader)| {
                let out = reader.join().unwrap().unwrap();
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                (what, text.lines().filter_map(Attempt::parse).collect())
            })
            .collect()
    }

    fn kill(&self) {
        for (_, pid, reader) in &self.clients {
            // A client that ended was reaped: its pid may be another's.
            if !reader.is_finished() {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
        }
    }

    /// Stops the clients: none failed an exchange, each made many, the TCP
    /// ones over both pods.
    fn check(self, setup: Setup, log: &str) {
        for (what, attempts) in self.stop() {
            let failed: Vec<&Attempt> = attempts.iter().filter(|a| a.pod().is_none()).collect();
            println!("{setup:?} {what}: {} exchanges, {} failed", attempts.len(), failed.len());
            assert!(failed.is_empty(), "{what}: {failed:?} of {}\n{log}", attempts.len());
            assert!(attempts.len() > 100, "{what}: {} exchanges", attempts.len());
            // A UDP socket's flow keeps its pod; TCP connections spread.
            if what.starts_with("TCP") {
                assert_eq!(
                    tally(&attempts).len(),
                    2,
                    "{what} over both pods: {:?}",
                    tally(&attempts)
                );
            }
        }
    }
}

impl Drop for Load {
    /// A failed test stops its clients too.
    fn drop(&mut self) {
        self.kill();
    }
}

/// A small xorshift: the kill moments vary from run to run, and the seed
/// printed replays them.
struct Moments(u64);

impl Moments {
    fn new() -> Self {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos();
        let seed = std::env::var("FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(nanos as u64 | 1);
        println!("kill moments: FAULTS_SEED={seed}");
        Moments(seed)
    }

    /// Up to `max`, uniformly.
    fn next(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        max.mul_f64((self.0 % 10_000) as f64 / 10_000.0)
    }
}

/// Twenty agents killed at random moments, every other one while it
/// starts (reading the source, the first sync, taking over), the others
/// while it serves (between syncs, in the sync of a change made just
/// before, in the resyncs a short `--sync-period` brings); the churned
/// service changes at every cycle.
fn twenty_kills_under_load(setup: Setup) {
    let mut b = Bench::new(setup);
    b.lab.write_manifest(&services(0)).unwrap();
    let args = ["--sync-period", "1s"];
    b.lab.start_agent(&args).unwrap();
    let load = b.load();
    let mut moments = Moments::new();
    for cycle in 1..=20 {
        b.lab.kill_agent();
        b.lab.write_manifest(&services(cycle % 3)).unwrap();
        if cycle % 2 == 0 {
            b.lab.start_agent(&args).unwrap();
            b.lab.write_manifest(&services((cycle + 1) % 3)).unwrap();
            std::thread::sleep(moments.next(Duration::from_millis(1500)));
        } else {
            b.lab.spawn_agent_on(0, &args).unwrap();
            std::thread::sleep(moments.next(Duration::from_millis(500)));
        }
    }
    b.lab.kill_agent();
    b.lab.write_manifest(&services(1)).unwrap();
    b.lab.start_agent(&args).unwrap();
    b.wait_for_churned("web-1");
    std::thread::sleep(Duration::from_secs(1));
    load.check(setup, &b.lab.agent_log());
}

/// The API server misbehaves in every way a client sees; the datapath
/// keeps serving and the agent keeps following.
fn apiserver_faults(setup: Setup) {
    assert_eq!(setup.source, Source::ApiServer);
    let mut b = Bench::new(setup);
    b.lab.write_manifest(&services(0)).unwrap();
    b.lab.start_agent(&[]).unwrap();
    let load = b.load();
    let api = || b.lab.api().unwrap();
    let change = |pod: usize, name: &str| {
        b.lab.write_manifest(&services(pod)).unwrap();
        b.wait_for_churned(name);
    };
    // Watches reset, then reset again with the history gone (410 Gone on
    // resume): each time, a change made afterwards arrives.
    api().drop_watches();
    change(1, "web-1");
    api().compact();
    api().drop_watches();
    change(2, "web-2");
    // Every request fails with 500 for a while.
    api().set_failing(true);
    std::thread::sleep(Duration::from_secs(3));
    api().set_failing(false);
    change(0, "web-0");
    // Gone for 30 s, a change made meanwhile.
    api().set_up(false);
    std::thread::sleep(Duration::from_secs(5));
    b.lab.write_manifest(&services(1)).unwrap();
    std::thread::sleep(Duration::from_secs(25));
    assert_eq!(b.churned_pod().as_deref(), Some("web-0"), "the last state known serves");
    api().set_up(true);
    // kube-rs's watcher backs off as client-go's reflector: 0.8 s doubling
    // to at most 30 s, plus a jitter of up to as much again. After a 30 s
    // outage a kind's last failed attempt may have come just before the API
    // server was back, and its next one up to 60 s later.
    b.wait_for_churned_within("web-1", Duration::from_secs(70));
    assert!(b.lab.agent_alive(), "{}", b.lab.agent_log());
    let log = b.lab.agent_log();
    load.check(setup, &log);
    let metrics = b.lab.metrics().unwrap();
    assert!(metrics.contains("proxy_apiserver_watch_errors_total{"), "{metrics}");
}

/// `lab/<name>` at 10.96.1.`ip`:80 over the given endpoint addresses.
fn padded(name: &str, ip: u8, endpoints: &[String]) -> String {
    let svc = service("lab", name)
        .cluster_ip(&format!("10.96.1.{ip}"))
        .port(port("http", 80).target(8080));
    let slice = svc.slice().port("http", 8080, Tcp);
    let slice = slice.endpoints(endpoints.iter().map(|e| ep(e).node("lab-node")));
    manifest(&[&svc, &slice])
}

/// `n` endpoints no pod answers on (they count, no traffic goes there).
fn fillers(from: u8, n: u8) -> Vec<String> {
    (0..n).map(|i| format!("10.244.9.{}", from + i)).collect()
}

/// The log lines naming `service` as refused.
fn refusals(log: &str, service: &str) -> usize {
    log.lines().filter(|l| l.contains(&format!("Service {service} does not fit"))).count()
}

/// The services refused for want of room in the maps.
fn refused_gauge(lab: &Lab) -> String {
    let metrics = lab.metrics().unwrap();
    metrics
        .lines()
        .filter(|l| l.starts_with("proxy_services_refused{reason=\"services_map_full\"}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Until the ClusterIP 10.96.1.`ip` answers from `pod` (10 s at most).
fn wait_for_pod(b: &Bench, ip: u8, pod: &str) {
    let addr = format!("10.96.1.{ip}:80");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let attempts = b.lab.client(&b.client).tcp(&addr, 1).unwrap();
        if attempts[0].pod() == Some(pod) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{addr} never served {pod}: {attempts:?}\n{}",
            b.lab.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// With 64 entries per map: SERVICES takes a frontend plus one per
/// endpoint.
#[test]
fn full_maps_refuse_only_the_services_that_do_not_fit() {
    let mut b = Bench::new(Setup::EBPF);
    let web = |i: usize| vec![format!("10.244.1.{}", 2 + i)];
    // 2 + 31 entries.
    let base =
        |web_pod: usize| padded("a", 1, &web(web_pod)) + &padded("filler", 2, &fillers(1, 30));
    b.lab.write_manifest(&base(0)).unwrap();
    b.lab.start_agent(&["--bpf-lb-map-max", "64"]).unwrap();
    wait_for_pod(&b, 1, "web-0");

    // 41 more entries do not fit: that service alone is refused.
    let big = padded("big", 3, &fillers(100, 40));
    b.lab.write_manifest(&(base(0) + &big)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while refusals(&b.lab.agent_log(), "lab/big") == 0 {
        assert!(Instant::now() < deadline, "never refused:\n{}", b.lab.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(refused_gauge(&b.lab), r#"proxy_services_refused{reason="services_map_full"} 1"#);

    // An endpoint change of a service served goes through meanwhile, and
    // the refusal is not logged again.
    b.lab.write_manifest(&(base(1) + &big)).unwrap();
    wait_for_pod(&b, 1, "web-1");
    assert_eq!(refusals(&b.lab.agent_log(), "lab/big"), 1, "{}", b.lab.agent_log());

    // A replacement that fits on its own (2 + 34 of 64), though not beside
    // what it replaces (33 entries served).
    let replacement = padded("r1", 11, &web(2)) + &padded("r2", 12, &fillers(50, 33));
    b.lab.write_manifest(&replacement).unwrap();
    wait_for_pod(&b, 11, "web-2");
    assert!(b.lab.agent_log().contains("applying the change service by service"));
    let gone = b.lab.client(&b.client).timeout_ms(500).tcp("10.96.1.1:80", 1).unwrap();
    assert!(gone[0].pod().is_none(), "the replaced service is gone: {gone:?}");
    assert_eq!(refused_gauge(&b.lab), r#"proxy_services_refused{reason="services_map_full"} 0"#);
    let metrics = b.lab.metrics().unwrap();
    assert!(metrics.contains("proxy_map_entries{map=\"SERVICES\"} 36\n"), "{metrics}");
}

/// `n` services of lab/crowd-`i` at 10.96.2.`i`:80, each over the same
/// The `RECORDS` ring buffers (decision records) process `pid` holds open:
/// its fds' map ids (`/proc/PID/fdinfo`), named as bpftool lists them.
fn ring_buffers_held(pid: u32) -> usize {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).unwrap();
    let held: std::collections::BTreeSet<u64> = fds
        .flatten()
        .filter_map(|fd| std::fs::read_to_string(fd.path()).ok())
        .filter_map(|info| {
            info.lines().find_map(|l| l.strip_prefix("map_id:")?.trim().parse().ok())
        })
        .collect();
    let shown = proxy_lab::sh("bpftool", &["-j", "map", "show"]).unwrap();
    let maps: Vec<serde_json::Value> = serde_json::from_str(&shown).unwrap();
    let ours = |m: &&serde_json::Value| {
        m["name"] == "RECORDS" && m["id"].as_u64().is_some_and(|id| held.contains(&id))
    };
    maps.iter().filter(ours).count()
}

/// `endpoints` addresses no pod answers on: a frontend and `endpoints`
/// slots each in SERVICES, `endpoints` entries in BACKENDS.
fn crowd(n: u8, endpoints: usize) -> String {
    let addresses: Vec<String> =
        (0..endpoints).map(|i| format!("10.245.{}.{}", i / 250, 1 + i % 250)).collect();
    let mut yaml = String::new();
    for i in 0..n {
        let svc = service("lab", &format!("crowd-{i}"))
            .cluster_ip(&format!("10.96.2.{i}"))
            .port(port("http", 80).target(8080));
        let slice = svc.slice().port("http", 8080, Tcp);
        let slice = slice.endpoints(addresses.iter().map(|e| ep(e).node("lab-node")));
        yaml += &manifest(&[&svc, &slice]);
    }
    yaml
}

/// The default maps hold 65,536 entries; 70 services of 1,000 endpoints
/// take 70,070 in SERVICES.
#[test]
fn service_maps_grow_under_load_and_are_sized_at_start() {
    let mut b = Bench::new(Setup::EBPF);
    b.lab.write_manifest(&services(0)).unwrap();
    b.lab.start_agent(&[]).unwrap();
    assert_eq!(b.lab.map_capacity("SERVICES").unwrap(), 65_536);
    assert_eq!(b.lab.agent_log().matches("BPF programs verified").count(), 1);
    let load = b.load();

    let big = services(0) + &crowd(70, 1000) + &padded("late", 1, &["10.244.1.4".into()]);
    b.lab.write_manifest(&big).unwrap();
    // Growing loads every program again, verifier and all: bounded as an
    // agent's start is, not as a map write. Said once the new programs are
    // attached, a moment after they serve.
    let deadline = Instant::now() + proxy_lab::scaled(Duration::from_secs(60));
    while !b.lab.agent_log().contains("the service maps grew") {
        assert!(Instant::now() < deadline, "{}", b.lab.agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_for_pod(&b, 1, "web-2");
    let log = b.lab.agent_log();
    // The replaced load's decision-record reader stopped with it: the agent
    // holds one records ring buffer, not one per load.
    let agent = b.lab.agent_pid_on(0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while ring_buffers_held(agent) != 1 {
        assert!(Instant::now() < deadline, "{} held", ring_buffers_held(agent));
        std::thread::sleep(Duration::from_millis(50));
    }
    // 70,070 and a quarter, to a power of two; BACKENDS (1,004) kept its size.
    assert_eq!(b.lab.map_capacity("SERVICES").unwrap(), 131_072);
    assert_eq!(b.lab.map_capacity("BACKENDS").unwrap(), 65_536);
    assert_eq!(refusals(&log, "lab/late"), 0);
    std::thread::sleep(Duration::from_secs(1));
    load.check(Setup::EBPF, &log);

    // A new agent adopts these maps: their size, their entries, one
    // verifier run into them, no sync before the source is whole.
    b.lab.kill_agent();
    let before = b.lab.agent_log().len();
    b.lab.start_agent(&[]).unwrap();
    let log = b.lab.agent_log()[before..].to_string();
    assert!(log.contains("the previous agent's service maps adopted"), "{log}");
    assert!(!log.contains("sizing the service maps"), "{log}");
    assert_eq!(log.matches("BPF programs verified").count(), 1, "{log}");
    assert_eq!(b.lab.map_capacity("SERVICES").unwrap(), 131_072);
    wait_for_pod(&b, 1, "web-2");

    // One it cannot adopt (Maglev tables of another size) sizes new maps
    // for what the source holds before its first sync writes anything,
    // and before it serves: never too small.
    b.lab.kill_agent();
    let before = b.lab.agent_log().len();
    b.lab.start_agent(&["--bpf-lb-maglev-table-size", "251"]).unwrap();
    let log = b.lab.agent_log()[before..].to_string();
    assert!(
        log.contains("service maps are not adopted (their Maglev tables have 16381 entries"),
        "{log}"
    );
    let sized = log.find("sizing the service maps for what the source holds").expect(&log);
    let grown = log.find("the service maps grew").expect(&log);
    assert!(sized < grown && grown < log.find("datapath ready; serving").unwrap(), "{log}");
    assert!(!log.contains("outgrew"), "no failed attempt at the default size: {log}");
    // One verifier run, into the maps sized for the source.
    assert_eq!(log.matches("BPF programs verified").count(), 1, "{log}");
    assert_eq!(b.lab.map_capacity("SERVICES").unwrap(), 131_072);
    wait_for_pod(&b, 1, "web-2");
}
