//! The API-server source's list without a datapath: the test API server
//! (in a network namespace of this process's own, on its loopback) holds N
//! ClusterIP services × E endpoints shaped as `cargo xtask bench` stores
//! them, and a child process runs what the agent runs until its lists are
//! whole: `KubeSource` (kube-rs watchers, each object parsed as it comes)
//! on a current-thread runtime, as the agent does. The child prints the
//! seconds from its start to every list complete, its heap (live and peak,
//! a counting allocator) and `VmHWM`; with `--split`, a second child lists
//! the two kinds one after the other, page by page, and times the HTTP
//! transfer (request to whole body: the server's share included), the JSON
//! decode and the parse apart.
//!
//! `--client BIN` (repeatable) runs BIN's child instead of this build's, so
//! two builds alternate against one server; medians at the end.
//! `--page-size N` lists N objects a page (the source's `PAGE_SIZE`, 500,
//! otherwise; builds before the option cannot take it).
//!
//! ```sh
//! cargo build --release -p proxy-agent --example list_source
//! target/release/examples/list_source 100000 10 --rounds 5 --split [--page-size N] \
//!     [--client /tmp/list_source-before --client target/release/examples/list_source]
//! ```

use std::{
    collections::BTreeMap,
    path::Path,
    process::Command,
    sync::atomic::Ordering::Relaxed,
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};
use proxy_agent::source::kube::{LABELS, SERVICE_FIELDS};
use proxy_lab::bench_objects::{self, NODE};
use serde_json::{Value, json};

#[path = "support/counting.rs"]
mod counting;

use counting::{LIVE, PEAK};

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

/// The bench's objects ([`bench_objects`]) and the Node.
fn objects(n: usize, e: usize) -> impl Iterator<Item = Value> {
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.100.11"}]}});
    std::iter::once(node).chain(bench_objects::objects(n, e))
}

/// Brings this namespace's loopback up.
fn lo_up() -> anyhow::Result<()> {
    // SAFETY: a socket of our own and an ifreq we own, for two ioctls.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let mut req: libc::ifreq = std::mem::zeroed();
        for (to, from) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *to = *from as libc::c_char;
        }
        let mut ok = libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) == 0;
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        ok = ok && libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) == 0;
        let error = std::io::Error::last_os_error();
        libc::close(fd);
        ensure!(ok, "bringing lo up: {error}");
    }
    Ok(())
}

/// A field of /proc/self/status, in MiB.
fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.trim().strip_suffix("kB")?.trim().parse::<f64>().ok());
    kib.unwrap_or(f64::NAN) / 1024.0
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn arg<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
    let at = args.iter().position(|a| a == flag)?;
    args.get(at + 1)?.parse().ok()
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        return child(&args[2..]);
    }
    let positional: Vec<usize> = args[1..]
        .iter()
        .take_while(|a| !a.starts_with("--"))
        .map(|a| a.parse())
        .collect::<Result<_, _>>()
        .context(
            "usage: list_source [SERVICES [ENDPOINTS]] [--rounds R] [--split] [--client BIN]...",
        )?;
    let n = positional.first().copied().unwrap_or(100_000);
    let e = positional.get(1).copied().unwrap_or(10);
    let rounds: usize = arg(&args, "--rounds").unwrap_or(3);
    let split = args.iter().any(|a| a == "--split");
    let page_size: Option<u32> = arg(&args, "--page-size");
    let mut clients: Vec<String> =
        args.windows(2).filter(|w| w[0] == "--client").map(|w| w[1].clone()).collect();
    if clients.is_empty() {
        clients.push(std::env::current_exe()?.display().to_string());
    }

    // SAFETY: no thread yet; the namespace is this process's (and its
    // children's) alone, and goes with them.
    ensure!(unsafe { libc::geteuid() } == 0, "needs root (a network namespace of its own)");
    ensure!(unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0, "unshare(CLONE_NEWNET)");
    lo_up()?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let api = proxy_lab::apiserver::ApiServer::start_on(listener)?;
    let started = Instant::now();
    api.apply_objects(objects(n, e))?;
    eprintln!(
        "{n} services x {e} endpoints stored (and encoded) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let kubeconfig =
        std::env::temp_dir().join(format!("list_source-{}.kubeconfig", std::process::id()));
    std::fs::write(&kubeconfig, api.kubeconfig())?;

    let mut modes = vec!["source"];
    if split {
        modes.push("split");
    }
    let mut runs: BTreeMap<(usize, &str), Vec<Value>> = BTreeMap::new();
    let outcome = (|| -> anyhow::Result<()> {
        for round in 0..rounds {
            for (c, bin) in clients.iter().enumerate() {
                for mode in &modes {
                    let mut command = Command::new(bin);
                    command.args(["--child", mode]).arg(&kubeconfig);
                    if let Some(page) = page_size {
                        command.arg(page.to_string());
                    }
                    let out = command.output().with_context(|| format!("running {bin}"))?;
                    let stdout = String::from_utf8_lossy(&out.stdout);
                    let line = stdout.lines().last().unwrap_or("");
                    let Ok(result) = serde_json::from_str::<Value>(line) else {
                        anyhow::bail!(
                            "{bin} --child {mode}: {}\n{}",
                            out.status,
                            String::from_utf8_lossy(&out.stderr)
                        );
                    };
                    println!("round {round} client {c} {mode}: {result}");
                    runs.entry((c, mode)).or_default().push(result);
                }
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&kubeconfig);
    outcome?;

    println!("\nmedians of {rounds} rounds ({n} services x {e} endpoints):");
    for ((c, mode), results) in &runs {
        let keys: Vec<&String> = results[0]
            .as_object()
            .map(|o| o.iter().filter(|(_, v)| v.is_f64()).map(|(k, _)| k).collect())
            .unwrap_or_default();
        let medians: Vec<String> = keys
            .iter()
            .map(|k| {
                let mut values: Vec<f64> =
                    results.iter().filter_map(|r| r[k.as_str()].as_f64()).collect();
                values.sort_by(f64::total_cmp);
                format!("{k} {:.3}", values[values.len() / 2])
            })
            .collect();
        println!("  client {c} ({}) {mode}: {}", clients[*c], medians.join(", "));
    }
    Ok(())
}

/// `--child MODE KUBECONFIG`: one client run, one JSON line on stdout.
fn child(args: &[String]) -> anyhow::Result<()> {
    let (mode, kubeconfig, page_size) = match args {
        [mode, kubeconfig] => (mode, kubeconfig, None),
        [mode, kubeconfig, page] => (mode, kubeconfig, Some(page.parse()?)),
        _ => anyhow::bail!("--child MODE KUBECONFIG [PAGE_SIZE]"),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let result = runtime.block_on(async {
        match mode.as_str() {
            "source" => source(Path::new(kubeconfig), page_size).await,
            "split" => split(Path::new(kubeconfig), page_size).await,
            other => anyhow::bail!("unknown mode {other}"),
        }
    })?;
    println!("{result}");
    Ok(())
}

/// What the agent does until its source is whole.
async fn source(kubeconfig: &Path, page_size: Option<u32>) -> anyhow::Result<Value> {
    use proxy_agent::source::kube::{KubeSource, PAGE_SIZE, config};
    let start = Instant::now();
    let config = config(Some(kubeconfig)).await?;
    let mut source = KubeSource::start_paged(config, NODE, page_size.unwrap_or(PAGE_SIZE))?;
    let notify = source.notify();
    while !source.poll().1 {
        ensure!(start.elapsed() < Duration::from_secs(300), "not whole after 300 s");
        tokio::select! {
            _ = notify.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    let listed = start.elapsed().as_secs_f64();
    let (live, peak) = (LIVE.load(Relaxed), PEAK.load(Relaxed));
    let changes = source.take_changes();
    let services = changes.services.values().filter(|s| matches!(s, Some(Ok(_)))).count();
    let slices =
        changes.slices.values().filter(|s| s.as_ref().is_some_and(|s| s.service.is_some())).count();
    let errors: u64 = source.errors().values().sum();
    Ok(json!({
        "listed_s": listed,
        "heap_live_mib": mib(live),
        "heap_peak_mib": mib(peak),
        "vm_hwm_mib": status_mib("VmHWM:"),
        "services": services,
        "slices": slices,
        "node": source.node().is_some(),
        "watch_errors": errors,
    }))
}

/// `%XX` for what a query value cannot hold as is.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

#[derive(Default)]
struct Split {
    http: Duration,
    decode: Duration,
    parse: Duration,
    pages: usize,
    bytes: usize,
}

/// One kind's list, page by page, with its parts timed.
async fn list_kind<K, P>(
    client: &kube::Client,
    path: &str,
    query: &str,
    page: u32,
    parse: impl Fn(K) -> P,
    kept: &mut Vec<P>,
) -> anyhow::Result<Split>
where
    K: serde::de::DeserializeOwned + Clone,
{
    let mut split = Split::default();
    let mut next: Option<String> = None;
    loop {
        let mut uri = format!("{path}?limit={page}&{query}");
        if let Some(token) = &next {
            uri.push_str(&format!("&continue={}", encode(token)));
        }
        let t0 = Instant::now();
        let text = client.request_text(hyper::Request::get(uri).body(Vec::new())?).await?;
        let t1 = Instant::now();
        let list: kube::core::ObjectList<K> = serde_json::from_str(&text)?;
        let t2 = Instant::now();
        kept.extend(list.items.into_iter().map(&parse));
        let t3 = Instant::now();
        split.http += t1 - t0;
        split.decode += t2 - t1;
        split.parse += t3 - t2;
        split.pages += 1;
        split.bytes += text.len();
        next = list.metadata.continue_.filter(|c| !c.is_empty());
        if next.is_none() {
            return Ok(split);
        }
    }
}

/// The two lists one after the other, each part timed.
async fn split(kubeconfig: &Path, page_size: Option<u32>) -> anyhow::Result<Value> {
    let page = page_size.unwrap_or(proxy_agent::source::kube::PAGE_SIZE);
    use proxy_agent::{
        model::{self, ServiceName},
        objects::{EndpointSlice, Service},
    };
    let client = proxy_agent::source::kube::client(Some(kubeconfig)).await?;
    let start = Instant::now();
    let mut services = Vec::new();
    let query =
        format!("labelSelector={}&fieldSelector={}", encode(LABELS), encode(SERVICE_FIELDS));
    let parse = |s: Service| ServiceName::of(&s.metadata).map(|n| model::parse_service(&n, s));
    let s = list_kind(&client, "/api/v1/services", &query, page, parse, &mut services).await?;
    let mut slices = Vec::new();
    let query = format!("labelSelector={}", encode(LABELS));
    let path = "/apis/discovery.k8s.io/v1/endpointslices";
    let parse = |s: EndpointSlice| ServiceName::of(&s.metadata).map(|n| model::parse_slice(&n, s));
    let es = list_kind(&client, path, &query, page, parse, &mut slices).await?;
    let total = start.elapsed().as_secs_f64();
    let s_ = |d: Duration| d.as_secs_f64();
    Ok(json!({
        "total_s": total,
        "svc_http_s": s_(s.http), "svc_decode_s": s_(s.decode), "svc_parse_s": s_(s.parse),
        "es_http_s": s_(es.http), "es_decode_s": s_(es.decode), "es_parse_s": s_(es.parse),
        "svc_mib": mib(s.bytes), "es_mib": mib(es.bytes),
        "pages": s.pages + es.pages,
        "heap_peak_mib": mib(PEAK.load(Relaxed)),
        "vm_hwm_mib": status_mib("VmHWM:"),
        "kept": services.len() + slices.len(),
    }))
}
