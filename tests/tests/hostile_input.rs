//! Hostile input: manifest files that do not parse (garbage, truncated,
//! huge, binary) next to good ones, a takeover from a previous agent while
//! a file does not parse, `/healthz` before and after the datapath serves,
//! and pins under `umask 000`. The agent never gets stuck, never goes
//! silent, and leaves nothing more open than needed.
//!
//! These scenarios read a directory of manifest files, which the API
//! server source has no counterpart of: they run in both modes on the
//! manifests only.

use std::{
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use proxy_lab::{Lab, Mode, Pod, Tally};
use test_objects::{Protocol::*, ep, manifest, port, service};

/// Each scenario in eBPF and iptables mode, on the manifests.
macro_rules! both_datapaths {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[test]
            fn ebpf() {
                super::$scenario(proxy_lab::Mode::Ebpf)
            }
            #[test]
            fn iptables() {
                super::$scenario(proxy_lab::Mode::Iptables)
            }
        }
    )*};
}

both_datapaths!(
    a_file_that_does_not_parse_leaves_the_others_served,
    a_takeover_waits_for_unreadable_files_a_bounded_time,
);

/// Service `lab/<name>` at `cluster_ip`:80 → 8080 on `pods`.
fn web(name: &str, cluster_ip: &str, pods: &[&Pod]) -> String {
    let svc = service("lab", name).cluster_ip(cluster_ip).port(port("http", 80).target(8080));
    let endpoints = pods.iter().map(|p| ep(&p.ip).node("lab-node"));
    let slice = svc.slice().port("http", 8080, Tcp).endpoints(endpoints);
    manifest(&[&svc, &slice])
}

/// A lab in `mode` reading a manifest directory, with one web pod (serving
/// 8080) and a client pod.
fn lab(mode: Mode) -> (Lab, Pod, Pod) {
    let mut lab = Lab::with_mode(mode).unwrap();
    lab.use_manifest_dir().unwrap();
    let pod = lab.add_web_pods(1, &[8080], &[]).unwrap().remove(0);
    let client = lab.add_pod("client", "10.244.1.100").unwrap();
    (lab, pod, client)
}

/// Which pods answered `count` connections to `addr`, and which failed.
fn reach(lab: &Lab, client: &Pod, addr: &str, count: usize) -> Tally {
    let attempts = lab.client(client).timeout_ms(500).tcp(addr, count).unwrap();
    Tally::of(&attempts)
}

fn served_by(pod: &Pod, count: usize) -> Tally {
    Tally { pods: [(pod.name.clone(), count)].into(), errors: Default::default() }
}

/// How many times the agent's log says `needle`.
fn logged(lab: &Lab, needle: &str) -> usize {
    lab.agent_log().matches(needle).count()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn a_file_that_does_not_parse_leaves_the_others_served(mode: Mode) {
    let (mut lab, pod, client) = lab(mode);
    lab.write_manifest_file("good.yaml", web("web", "10.96.0.10", &[&pod]).as_bytes()).unwrap();
    let garbage =
        lab.write_manifest_file("garbage.yaml", b"kind: [Service\n:: }{ not yaml").unwrap();
    // No previous datapath: what can be read is served at once.
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, "10.96.0.10:80", 3), served_by(&pod, 3));
    // Reported once (not at every poll), with the file in the metric.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(logged(&lab, "garbage.yaml: not valid YAML"), 1, "{}", lab.agent_log());
    assert_eq!(logged(&lab, "taking over without the services of these files"), 1);
    let metrics = lab.metrics().unwrap();
    let counted =
        format!("proxy_source_errors_total{{file=\"{}\",kind=\"yaml\"}} 1\n", garbage.display());
    assert!(metrics.contains(&counted), "{metrics}");

    // Mended: its service is served too.
    lab.write_manifest_file("garbage.yaml", web("other", "10.96.0.11", &[&pod]).as_bytes())
        .unwrap();
    wait_for("the mended file's service", Duration::from_secs(10), || {
        reach(&lab, &client, "10.96.0.11:80", 1) == served_by(&pod, 1)
    });
}

#[test]
fn truncated_huge_and_binary_files_are_reported_once_and_not_read_again() {
    let (mut lab, pod, client) = lab(Mode::Ebpf);
    let good = web("web", "10.96.0.10", &[&pod]);
    lab.write_manifest_file("good.yaml", good.as_bytes()).unwrap();
    // Cut inside a flow mapping: never valid YAML.
    let truncated = format!("{}\n{}", web("cut", "10.96.0.12", &[&pod]), "spec: {ports: [{port: 8");
    lab.write_manifest_file("truncated.yaml", truncated.as_bytes()).unwrap();
    // 10 MB that parses to the very end before failing.
    let mut huge = b"items: [\n".to_vec();
    while huge.len() < 10 << 20 {
        huge.extend_from_slice(b"  {name: x, port: 80},\n");
    }
    lab.write_manifest_file("huge.yaml", &huge).unwrap();
    let binary: Vec<u8> =
        (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    lab.write_manifest_file("binary.yaml", &binary).unwrap();

    // A debug build of the agent takes about 10 s to find huge.yaml broken.
    lab.start_agent_within(0, &[], Duration::from_secs(60)).unwrap();
    assert_eq!(reach(&lab, &client, "10.96.0.10:80", 3), served_by(&pod, 3));
    // Many polls later, each file was parsed (and reported) once.
    std::thread::sleep(Duration::from_secs(3));
    let log = lab.agent_log();
    for file in ["truncated.yaml", "huge.yaml", "binary.yaml"] {
        assert_eq!(logged(&lab, &format!("{file}: not valid YAML")), 1, "{file}:\n{log}");
    }
    let takeover = log.lines().find(|l| l.contains("taking over without")).unwrap_or_default();
    for file in ["truncated.yaml", "huge.yaml", "binary.yaml"] {
        assert!(takeover.contains(file), "{takeover}");
    }
    assert!(!takeover.contains("good.yaml"), "{takeover}");
}

#[test]
fn a_file_that_never_stops_changing_is_given_up_after_the_grace() {
    let (mut lab, pod, client) = lab(Mode::Ebpf);
    let dir = lab.use_manifest_dir().unwrap();
    lab.write_manifest_file("good.yaml", web("web", "10.96.0.10", &[&pod]).as_bytes()).unwrap();
    // Never the same twice: the kernel's uptime, in hundredths of a second.
    // (A writer thread rewriting it fell silent when the test got no core
    // for a poll's time, and two reads agreed.)
    std::os::unix::fs::symlink("/proc/uptime", dir.join("moving.yaml")).unwrap();
    lab.start_agent(&["--unreadable-source-grace", "1s"]).unwrap();
    assert_eq!(reach(&lab, &client, "10.96.0.10:80", 3), served_by(&pod, 3));
    let log = lab.agent_log();
    let warning = log.lines().find(|l| l.contains("taking over without")).unwrap_or_default();
    assert!(warning.contains("still_changing=[") && warning.contains("moving.yaml"), "{log}");
}

fn a_takeover_waits_for_unreadable_files_a_bounded_time(mode: Mode) {
    let (mut lab, pod, client) = lab(mode);
    lab.write_manifest_file("good.yaml", web("web", "10.96.0.10", &[&pod]).as_bytes()).unwrap();
    lab.write_manifest_file("other.yaml", web("other", "10.96.0.11", &[&pod]).as_bytes()).unwrap();
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, "10.96.0.11:80", 1), served_by(&pod, 1));
    lab.stop_agent_on(0);

    // While no agent runs, other.yaml is broken; a new agent replaces the
    // previous datapath, which keeps serving other's service meanwhile.
    lab.write_manifest_file("other.yaml", b"\x00\x01 this is not yaml {{{").unwrap();
    lab.spawn_agent_on(0, &["--unreadable-source-grace", "4s"]).unwrap();
    wait_for("other.yaml's error", Duration::from_secs(10), || {
        logged(&lab, "other.yaml: not valid YAML") == 1
    });
    let healthz = lab.http_get("127.0.0.1:10256", "/healthz").unwrap();
    assert!(healthz.starts_with("HTTP/1.1 503 "), "not serving yet:\n{healthz}");
    assert!(healthz.contains("\"lastUpdated\":\"") && healthz.contains("\"nodeEligible\":true"));
    let metrics_port = lab.http_get("127.0.0.1:10249", "/healthz").unwrap();
    assert!(metrics_port.starts_with("HTTP/1.1 503 "), "{metrics_port}");
    assert_eq!(logged(&lab, "datapath ready; serving"), 1, "only the first agent's");
    assert_eq!(reach(&lab, &client, "10.96.0.11:80", 1), served_by(&pod, 1), "previous serves");

    // Then it takes over, loudly, without other's service.
    wait_for("the takeover", Duration::from_secs(15), || {
        logged(&lab, "datapath ready; serving") == 2
    });
    let warning = lab.agent_log();
    let warning = warning.lines().find(|l| l.contains("taking over without")).unwrap();
    assert!(warning.contains("WARN") && warning.contains("other.yaml"), "{warning}");
    assert!(!warning.contains("good.yaml"), "{warning}");
    assert_eq!(reach(&lab, &client, "10.96.0.10:80", 3), served_by(&pod, 3));
    let healthz = lab.http_get("127.0.0.1:10256", "/healthz").unwrap();
    assert!(healthz.starts_with("HTTP/1.1 200 "), "{healthz}");
    assert!(healthz.contains("Content-Type: application/json"), "{healthz}");
    let body = healthz.split("\r\n\r\n").nth(1).unwrap();
    let json: serde_json::Value = serde_json::from_str(body).unwrap();
    for field in ["lastUpdated", "currentTime"] {
        assert!(json[field].as_str().is_some_and(|t| t.ends_with('Z')), "{body}");
    }
    assert_eq!(json["nodeEligible"], true, "{body}");
    let metrics_port = lab.http_get("127.0.0.1:10249", "/healthz").unwrap();
    assert!(metrics_port.starts_with("HTTP/1.1 200 "), "{metrics_port}");
}

#[test]
fn nothing_pinned_is_open_to_other_users_even_under_umask_000() {
    let mut lab = Lab::new().unwrap();
    let pod = lab.add_web_pods(1, &[8080], &[]).unwrap().remove(0);
    lab.write_manifest(&web("web", "10.96.0.10", &[&pod])).unwrap();
    lab.set_agent_umask(0, Some(0));
    lab.start_agent(&[]).unwrap();

    let mut dirs = vec![lab.pins.clone()];
    let mut files = Vec::new();
    let mut i = 0;
    while i < dirs.len() {
        for entry in std::fs::read_dir(&dirs[i]).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() { dirs.push(path) } else { files.push(path) }
        }
        i += 1;
    }
    assert!(files.iter().any(|f| f.ends_with("maps/SERVICES")), "{files:?}");
    assert!(files.iter().any(|f| f.ends_with("links/connect4")), "{files:?}");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    for dir in &dirs {
        assert_eq!(mode(dir), 0o700, "{}", dir.display());
    }
    for file in &files {
        assert_eq!(mode(file), 0o600, "{}", file.display());
    }
    // And as another user: nothing can be listed, read, written, created
    // or unlinked.
    let as_nobody = |program: &str, args: &[&str]| {
        let mut command = Command::new(program);
        let command = command.args(args).uid(65534).gid(65534).stderr(Stdio::null());
        command.status().unwrap().success()
    };
    for dir in &dirs {
        let dir = dir.to_string_lossy();
        assert!(!as_nobody("ls", &[&dir]), "{dir} listed");
        assert!(!as_nobody("touch", &[&format!("{dir}/intruder")]), "created in {dir}");
    }
    for file in &files {
        let file = file.to_string_lossy();
        assert!(!as_nobody("head", &["-c1", &file]), "{file} read");
        assert!(!as_nobody("sh", &["-c", &format!("echo > {file}")]), "{file} written");
        assert!(!as_nobody("rm", &["-f", &file]), "{file} unlinked");
        assert!(Path::new(&*file).exists(), "{file} unlinked");
    }
}

/// 200 invalid Services (an unknown protocol each) and 50 that do not
/// decode (a port that is not a number) beside a good one: the good one is
/// served, the log warns about ten of each and sums up the rest in one line
/// (each at debug level), and the metrics count them all. eBPF only: the
/// reporting is the agent's, not the datapath's.
#[test]
fn many_invalid_services_are_summed_up_not_logged_one_by_one() {
    let (mut lab, pod, client) = lab(Mode::Ebpf);
    let bad: Vec<_> = (0..200)
        .map(|i| {
            let ip = format!("10.96.1.{}", i + 1);
            service("lab", &format!("bad-{i}")).cluster_ip(&ip).port(port("x", 0))
        })
        .collect();
    let bad: Vec<&dyn test_objects::Document> = bad.iter().map(|s| s as _).collect();
    lab.write_manifest_file("bad.yaml", manifest(&bad).as_bytes()).unwrap();
    let undecodable: String = (0..50)
        .map(|i| format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: undecodable-{i}, namespace: lab}}\nspec: {{clusterIP: 10.96.2.{}, ports: [{{port: abc}}]}}\n", i + 1))
        .collect();
    lab.write_manifest_file("undecodable.yaml", undecodable.as_bytes()).unwrap();
    lab.write_manifest_file("good.yaml", web("web", "10.96.0.10", &[&pod]).as_bytes()).unwrap();
    lab.start_agent(&[]).unwrap();
    assert_eq!(reach(&lab, &client, "10.96.0.10:80", 3), served_by(&pod, 3));
    wait_for("the summary", Duration::from_secs(5), || {
        logged(&lab, "more problems with objects") > 0
    });
    assert_eq!(logged(&lab, "invalid object skipped"), 10, "{}", lab.agent_log());
    assert!(lab.agent_log().contains("more=190"), "{}", lab.agent_log());
    assert_eq!(logged(&lab, "undecodable.yaml: document"), 10, "{}", lab.agent_log());
    assert_eq!(logged(&lab, "more errors in the source"), 1, "{}", lab.agent_log());
    assert!(lab.agent_log().contains("more=40"), "{}", lab.agent_log());
    let metrics = lab.metrics().unwrap();
    let counted =
        metrics.lines().find(|l| l.starts_with("proxy_invalid_objects_total{kind=\"Service\"}"));
    // The invalid ones and the undecodable ones.
    assert_eq!(counted.and_then(|l| l.split_whitespace().last()), Some("250"), "{metrics}");
    let undecoded = metrics
        .lines()
        .find(|l| l.starts_with("proxy_source_errors_total{") && l.contains("undecodable.yaml"));
    assert_eq!(undecoded.and_then(|l| l.split_whitespace().last()), Some("50"), "{metrics}");
}
