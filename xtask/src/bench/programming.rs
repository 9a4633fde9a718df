//! Programming N services (from the test API server or one manifest
//! file), one endpoint change's latency, the iptables mode's programming
//! time with each iptables implementation, and `nft -f` of the nftables
//! mode's whole ruleset with each nft.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, bail};
use proxy_lab::{
    Lab, Mode, Setup, Source,
    bench_objects::{self, POD, SERVICE_PORT},
};
use serde_json::{Value, json};

use super::rates::manifest;
use super::{
    CHANGES, LIMIT, OUT, QUICK_IPTABLES_CHANGES, failures, limit, map_memory_mib, metric,
    peak_rss_mib,
};

/// [`bench_objects::objects`] as one JSON `List` (what `kubectl get -o
/// json` writes).
pub(super) fn manifest_json(n: usize, endpoints: usize) -> String {
    let items: Vec<Value> = bench_objects::objects(n, endpoints).collect();
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

/// An `nft` the nftables mode's agent runs (`bench --nft`).
pub(super) struct Nft {
    /// The directory put first in the agent's PATH; `None`: PATH's.
    dir: Option<PathBuf>,
    /// What it says it is (`1.1.3`).
    pub(super) version: String,
}

impl Nft {
    /// `--nft`'s directories (`system`: PATH's nft), PATH's when none.
    pub(super) fn all(dirs: &[String]) -> anyhow::Result<Vec<Nft>> {
        let system = [String::from("system")];
        let dirs = if dirs.is_empty() { &system[..] } else { dirs };
        dirs.iter()
            .map(|d| {
                let dir = (d != "system").then(|| std::fs::canonicalize(d)).transpose()?;
                let version = crate::nft::version(dir.as_deref())?;
                Ok(Nft { dir, version })
            })
            .collect()
    }

    fn program(&self) -> PathBuf {
        self.dir.as_ref().map_or_else(|| "nft".into(), |d| d.join("nft"))
    }
}

/// From starting the agent on N services × 10 endpoints (listed from the
/// test API server, as from a cluster's) to its datapath serving; and its
/// first sync.
pub(super) fn programming(
    mode: Mode,
    n: usize,
    full: bool,
    nft: Option<&Nft>,
) -> anyhow::Result<Value> {
    programming_with(mode, Feed::ApiServer, n, full, &[], nft)
}

/// Where a programming run's services come from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Feed {
    ApiServer,
    /// One manifest file (`--manifests`), 2 endpoints per service.
    Json,
    Yaml,
}

impl Feed {
    pub(super) fn name(self) -> &'static str {
        match self {
            Feed::ApiServer => "API server",
            Feed::Json => "one JSON file",
            Feed::Yaml => "one YAML file",
        }
    }

    pub(super) fn endpoints(self) -> usize {
        if self == Feed::ApiServer { 10 } else { 2 }
    }
}

/// `programming` with more agent flags.
pub(super) fn programming_with(
    mode: Mode,
    feed: Feed,
    n: usize,
    full: bool,
    extra: &[&str],
    nft: Option<&Nft>,
) -> anyhow::Result<Value> {
    let source = if feed == Feed::ApiServer { Source::ApiServer } else { Source::Manifests };
    let mut lab = Lab::with(Setup::of(mode, source))?;
    lab.set_agent_path(0, nft.and_then(|n| n.dir.clone()));
    match feed {
        // The file, and the test API server fed the same.
        Feed::ApiServer | Feed::Yaml => drop(lab.write_manifest(&manifest(n, feed.endpoints()))?),
        Feed::Json => {
            lab.use_manifest_dir()?;
            lab.write_manifest_file(
                "services.json",
                manifest_json(n, feed.endpoints()).as_bytes(),
            )?;
        }
    }
    let limit = limit(mode, full);
    let start = Instant::now();
    lab.spawn_agent_on(0, extra)?;
    let (outcome, listed) = wait_serving(&lab, 0, start, limit);
    let serving = start.elapsed().as_secs_f64();
    let mut result = json!({"mode": mode.as_arg(), "source": feed.name(), "services": n, "endpoints": n * feed.endpoints()});
    match outcome {
        Programmed::Serving => {
            result["to_serving_s"] = json!(serving);
            result["listed_s"] = json!(listed.unwrap_or(f64::NAN));
            // Every sync until then: those of the lists' parts as they
            // came (eBPF), and the sync of the whole.
            let syncs = metric(&lab, "kubeproxy_sync_proxy_rules_duration_seconds_sum");
            if let Err(e) = &syncs {
                eprintln!("  no sync duration: {e:#}");
            }
            let syncs = syncs.unwrap_or(f64::NAN);
            result["syncs_s"] = json!(syncs);
            // The one between the whole source and serving.
            result["first_sync_s"] = json!(whole_sync_s(&lab.agent_log()).unwrap_or(syncs));
            result["agent_peak_rss_mib"] =
                json!(lab.agent_pid_on(0).map_or(f64::NAN, peak_rss_mib));
            result["map_memory_mib"] = json!(map_memory_mib(&lab));
            if mode == Mode::Ebpf && feed == Feed::ApiServer {
                let (serving, peak) = restart(&mut lab, extra, limit)?;
                result["restart_to_serving_s"] = serving;
                result["restart_peak_rss_mib"] = json!(peak);
            }
        }
        // A measured limit (the size is too large for the mode), not a
        // failure.
        Programmed::OverLimit(limit) => result["over_limit_s"] = json!(limit.as_secs()),
        Programmed::Failed(why) => result["failed"] = json!(why),
    }
    eprintln!("  {}", result);
    Ok(result)
}

/// From a restart after a crash (`kill -9`: the state maps and the
/// serving programs carried over) to serving again; and the new agent's
/// peak RSS by then.
fn restart(lab: &mut Lab, extra: &[&str], limit: Duration) -> anyhow::Result<(Value, f64)> {
    lab.kill_agent_on(0);
    let from = lab.agent_log().len();
    let start = Instant::now();
    lab.spawn_agent_on(0, extra)?;
    let serving = match wait_serving(lab, from, start, limit).0 {
        Programmed::Serving => json!(start.elapsed().as_secs_f64()),
        Programmed::OverLimit(_) => json!("over the limit"),
        Programmed::Failed(why) => json!(why),
    };
    Ok((serving, lab.agent_pid_on(0).map_or(f64::NAN, peak_rss_mib)))
}

/// Waits for the agent spawned at `start` to serve, reading its log from
/// byte `from` on (the log is appended to across restarts); returns how it
/// ended and when the source was read whole.
fn wait_serving(
    lab: &Lab,
    from: usize,
    start: Instant,
    limit: Duration,
) -> (Programmed, Option<f64>) {
    let mut listed = None;
    loop {
        let log = lab.agent_log();
        let log = log.get(from..).unwrap_or_default();
        if listed.is_none() && log.contains("source read whole") {
            listed = Some(start.elapsed().as_secs_f64());
        }
        if log.contains("datapath ready; serving") {
            return (Programmed::Serving, listed);
        }
        if let Some(line) = log.lines().find(|l| l.contains("sync failed") || l.contains("ERROR")) {
            return (Programmed::Failed(line.to_string()), listed);
        }
        if start.elapsed() > limit {
            return (Programmed::OverLimit(limit), listed);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The sync of the whole source, as the agent logs it (`None` before it
/// said so).
fn whole_sync_s(log: &str) -> Option<f64> {
    let (_, rest) = log.split_once("the datapath holds the whole source ms=")?;
    let ms: f64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(ms / 1000.0)
}

/// How a programming run ended.
enum Programmed {
    Serving,
    /// Not serving within the run's limit.
    OverLimit(Duration),
    /// The agent logged an error.
    Failed(String),
}

/// One endpoint change at a time through the test API server, `CHANGES`
/// times (or `--changes`): from the change to the end of the sync that
/// programmed it.
pub(super) fn change_latency(
    mode: Mode,
    n: usize,
    opts: &super::Options,
    nft: Option<&Nft>,
) -> anyhow::Result<Value> {
    let quick_iptables = mode == Mode::Iptables && !opts.full;
    let changes =
        opts.changes.unwrap_or(if quick_iptables { QUICK_IPTABLES_CHANGES } else { CHANGES });
    let mut lab = Lab::with(Setup::of(mode, Source::ApiServer))?;
    lab.set_agent_path(0, nft.and_then(|n| n.dir.clone()));
    lab.write_manifest(&manifest(n, 10))?;
    lab.start_agent_within(0, &["--min-sync-period", "0s"], LIMIT)?;
    let api = lab.api().context("API server")?;
    let mut latencies = Vec::with_capacity(changes);
    for i in 0..changes {
        let endpoint = format!("10.127.{}.{}", i / 250, i % 250 + 1);
        let slice = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s0-1, namespace: bench, labels: {{kubernetes.io/service-name: s0}}}}\naddressType: IPv4\nports: [{{name: http, port: {SERVICE_PORT}}}]\nendpoints: [{{addresses: [{POD}]}}, {{addresses: [{endpoint}]}}]\n"
        );
        let before = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?.as_secs_f64();
        api.apply(&slice)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = metric(&lab, "kubeproxy_sync_proxy_rules_last_timestamp_seconds")?;
            if synced > before {
                latencies.push(synced - before);
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "change {i} was not synced");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)] * 1000.0
    };
    let result = json!({
        "mode": mode.as_arg(), "services": n, "changes": changes, "p50_ms": at(0.5), "p99_ms": at(0.99),
    });
    eprintln!("  {}", result);
    Ok(result)
}

/// The iptables mode's programming time with each iptables implementation
/// (`--iptables-backend nft` and `legacy`) at `sizes` (1,000 and 10,000 by
/// default) × 10 endpoints; prints a table and writes
/// target/bench/iptables-backends.json.
pub fn iptables_backends(sizes: &[usize], full: bool) -> anyhow::Result<()> {
    let sizes = if sizes.is_empty() { &[1_000, 10_000][..] } else { sizes };
    let mut results = Vec::new();
    let mut table = String::from(
        "| services × 10 endpoints | backend | to serving (s) | first sync (s) |\n|---|---|---|---|\n",
    );
    for &n in sizes {
        for backend in ["nft", "legacy"] {
            eprintln!("programming: iptables-{backend}, {n} services x 10 endpoints");
            let flags = ["--iptables-backend", backend];
            let mut result =
                programming_with(Mode::Iptables, Feed::ApiServer, n, full, &flags, None)?;
            result["backend"] = json!(backend);
            let secs = |key: &str| {
                result[key]
                    .as_f64()
                    .map_or_else(|| "not serving".to_string(), |s| format!("{s:.2}"))
            };
            let _ = writeln!(
                table,
                "| {n} | {backend} | {} | {} |",
                secs("to_serving_s"),
                secs("first_sync_s")
            );
            results.push(result);
        }
    }
    std::fs::create_dir_all(OUT)?;
    let json = serde_json::to_string_pretty(&results)?;
    std::fs::write(Path::new(OUT).join("iptables-backends.json"), json)?;
    println!("{table}");
    let failed = failures(&json!({ "programming": results }));
    if !failed.is_empty() {
        bail!("the bench had failures:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// `nft -f` of the nftables mode's whole IPv4 ruleset for N services × 10
/// endpoints (`proxy-agent render nftables`) into a node's empty
/// namespace, with `nft`: how much of the start is nft's.
pub(super) fn nft_load(n: usize, nft: Option<&Nft>) -> anyhow::Result<Value> {
    let nft = nft.context("an nft")?;
    let lab = Lab::with(Setup::NFTABLES)?;
    let manifest = lab.write_manifest(&manifest(n, 10))?;
    let node = &lab.nodes()[0];
    let ruleset = proxy_lab::sh(
        &proxy_lab::target_bin("proxy-agent").to_string_lossy(),
        &[
            "render",
            "nftables",
            "--manifests",
            &manifest.to_string_lossy(),
            "--hostname-override",
            &node.name,
            "--node-ip",
            &node.ip,
            "--ip-family",
            "IPv4",
        ],
    )?;
    let file = lab.dir.join("ruleset.nft");
    std::fs::write(&file, &ruleset)?;
    let start = Instant::now();
    lab.exec_on(0, &nft.program().to_string_lossy(), &["-f", &file.to_string_lossy()])?;
    let result = json!({
        "services": n, "lines": ruleset.lines().count(), "seconds": start.elapsed().as_secs_f64(),
    });
    eprintln!("  nft -f: {result}");
    Ok(result)
}
