//! The agent's first sync without a kernel: N ClusterIP services × E
//! endpoints (as `cargo xtask bench` lists them from the test API server)
//! read into changes the way the API-server source hands them over, then
//! the store, the plan, the size check and the eBPF sync into a map writer
//! that only counts; with `nftables` as a third argument, the nftables
//! mode's full sync into an `nft` that takes every transaction, then one
//! endpoint's change (a partial sync). Per phase: seconds, the heap it left
//! live and its peak (a counting allocator), and the process's VmRSS /
//! VmHWM.
//!
//! ```sh
//! cargo build --release -p proxy-agent --example first_sync
//! target/release/examples/first_sync 100000 10 [nftables]
//! ```

use std::{
    net::Ipv4Addr,
    sync::{Arc, atomic::Ordering::Relaxed},
    time::Instant,
};

use proxy_agent::{
    backend::{
        TrafficRules,
        ebpf::{
            MapSizes, fit,
            reconciler::{MapOp, MapWriter, Reconciler},
        },
        iptables::exec::{ExecError, Input, Runner},
        nftables::{NftablesBackend, datapath::render_options},
    },
    intern,
    model::{self, ServiceName},
    plan::{Node, Planner},
    source::{Changes, Store},
};
use test_objects::{Protocol::Tcp, ep, port, service, slice};

#[path = "support/counting.rs"]
mod counting;

use counting::{LIVE, PEAK};

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

/// A map writer that takes every write, counting them and the runs the
/// real one writes in one go (a batch of service slots or backends, else
/// a single write).
#[derive(Default)]
struct Counter {
    writes: usize,
    runs: usize,
}

impl MapWriter for Counter {
    fn apply(&mut self, _op: &MapOp) -> Result<(), std::io::Error> {
        self.writes += 1;
        self.runs += 1;
        Ok(())
    }

    fn apply_run(&mut self, ops: &[MapOp]) -> (usize, Result<(), std::io::Error>) {
        self.writes += ops.len();
        self.runs += 1;
        (ops.len(), Ok(()))
    }
}

/// An `nft` (and `conntrack`) that takes everything and lists nothing; a
/// transaction written to it is read as from a pipe, not kept, and its
/// size printed.
struct Nft;

impl Runner for Nft {
    fn run(&mut self, _: &str, _: &[&str], _: Option<&str>) -> Result<String, ExecError> {
        Ok(String::new())
    }

    fn run_writing(&mut self, _: &str, _: &[&str], input: Input) -> Result<String, ExecError> {
        let mut sink = Sink(0);
        input(&mut sink).map_err(|source| ExecError::Io { program: "nft".into(), source })?;
        println!("  nft read {:.1} MiB", sink.0 as f64 / MIB);
        Ok(String::new())
    }
}

/// Counts what is written to it.
struct Sink(usize);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(field));
    let value = line.and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
    value.unwrap_or(0)
}

const MIB: f64 = 1024.0 * 1024.0;

/// Times a phase and prints what it left.
fn phase<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let start = Instant::now();
    let out = f();
    let secs = start.elapsed().as_secs_f64();
    let live = LIVE.load(Relaxed);
    println!(
        "{name:<16} {secs:>7.3} s  heap {:>+8.1} MiB -> {:>7.1} MiB (peak {:>7.1})  VmRSS {:>6} MiB  VmHWM {:>6} MiB",
        (live as f64 - before as f64) / MIB,
        live as f64 / MIB,
        PEAK.load(Relaxed) as f64 / MIB,
        status_kib("VmRSS:") / 1024,
        status_kib("VmHWM:") / 1024,
    );
    out
}

/// Service `i` and its slice, read as the API-server source reads them
/// (the objects themselves are dropped at once, the namespace's name
/// shared).
fn read(changes: &mut Changes, i: usize, endpoints: usize) {
    let (name, slice_name) = (format!("s{i}"), format!("s{i}-1"));
    let ip = Ipv4Addr::from(0x0a60_0000u32 + 10 + i as u32).to_string();
    let svc = service("bench", &name).cluster_ip(&ip).port(port("http", 80).target(8080)).build();
    let addrs = (0..endpoints).map(|e| {
        let k = i * endpoints + e;
        ep(&format!("10.{}.{}.{}", 128 + k / 65_536, k / 256 % 256, k % 256)).node("lab-node")
    });
    let es = slice("bench", &slice_name).service(&name).port("http", 8080, Tcp).endpoints(addrs);
    let key = |name: String| ServiceName { namespace: intern::name("bench"), name: name.into() };
    let name = key(name);
    let parsed = model::parse_service(&name, proxy_agent::objects::Service::from_api(&svc));
    changes.services.insert(name, Some(parsed));
    let slice_name = key(slice_name);
    let parsed =
        model::parse_slice(&slice_name, proxy_agent::objects::EndpointSlice::from_api(&es.build()));
    changes.slices.insert(slice_name, Some(Arc::new(parsed)));
}

fn main() {
    proxy_agent::sys::fix_allocator_thresholds();
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let services = args.next().and_then(Result::ok).unwrap_or(100_000);
    let endpoints = args.next().and_then(Result::ok).unwrap_or(10);
    let nftables = std::env::args().nth(3).is_some_and(|a| a == "nftables");
    println!("{services} services x {endpoints} endpoints");
    let total = Instant::now();

    let changes = phase("read", || {
        let mut changes = Changes::default();
        (0..services).for_each(|i| read(&mut changes, i, endpoints));
        changes
    });
    let mut store = Store::default();
    phase("store", || drop(store.apply(changes)));
    let node = Node {
        name: "lab-node".into(),
        ips: vec![Ipv4Addr::new(192, 168, 100, 11).into()],
        ..Node::default()
    };
    let mut planner = Planner::new(node.clone());
    phase("plan", || drop(planner.rebuild(store.model())));
    if nftables {
        let options = render_options(&node, &TrafficRules::default(), model::IpFamily::V4);
        let mut backend = NftablesBackend::new(Nft, options);
        let sync = |backend: &mut NftablesBackend<Nft>, store: &Store| {
            let report = backend.sync(store.model()).expect("the fake nft takes everything");
            println!("  chains {} elements {}", report.chains_written, report.elements_written);
        };
        phase("nftables sync", || sync(&mut backend, &store));
        // Service 0 with one endpoint fewer.
        let mut changes = Changes::default();
        read(&mut changes, 0, endpoints - 1);
        store.apply(changes);
        phase("nftables change", || sync(&mut backend, &store));
        println!("total {:.3} s", total.elapsed().as_secs_f64());
        return;
    }
    let needed = phase("size check", || fit::needed(planner.plan()));
    let sizes = MapSizes {
        services: (needed.services as u32 + 1).next_power_of_two(),
        backends: (needed.backends as u32 + 1).next_power_of_two(),
        rev_nat: (needed.rev_nat as u32 + 1).next_power_of_two(),
    };
    let mut state = Reconciler::with_capacity(sizes);
    let mut writer = Counter::default();
    let report = phase("sync", || state.sync(planner.plan(), None, &mut writer));
    match report {
        Ok(report) => {
            println!("writes {} ({} written in {} runs)", report.writes, writer.writes, writer.runs)
        }
        Err(e) => println!("sync failed: {e}"),
    }
    println!("total {:.3} s", total.elapsed().as_secs_f64());
}
