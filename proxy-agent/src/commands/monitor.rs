//! `proxy-agent monitor`: prints the datapath's decisions as they happen
//! until SIGINT/SIGTERM, `--count` lines or `--duration`: the eBPF mode's
//! events, or what the rule-based modes can tell (`monitor::iptables`):
//! new flows and their translation from conntrack in both, refusals and
//! drops from the iptables rules' counters (kube-proxy's nftables rules
//! count nothing).

use std::{
    process::Stdio,
    time::{Duration, SystemTime},
};

use anyhow::Context as _;

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc::UnboundedReceiver,
    time::{Instant, MissedTickBehavior},
};

use crate::{
    backend::ebpf::ring::Watch,
    cli::{InspectMode, MonitorArgs, Output},
    monitor::{
        self, Filter, Line,
        iptables::{self, Counters},
        names::PinnedNames,
    },
    sys,
};

/// How often the ring buffer is read: the programs write without waking
/// a reader (a wakeup per event costs the packet microseconds), and the
/// ring holds some 2,300 events, 230,000 a second at this pace.
const POLL: Duration = Duration::from_millis(10);

/// How often the deadline is pushed ahead (well within
/// `proxy_common::monitor::DEADLINE_AHEAD_NS`) and lost events reported.
const REFRESH: Duration = Duration::from_secs(1);

pub fn run(args: &MonitorArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match super::lb::mode(&args.inspect) {
            InspectMode::Iptables => iptables(args, true).await,
            InspectMode::Nftables => iptables(args, false).await,
            _ => ebpf(args).await,
        }
    })
}

/// Prints lines while they pass `filter`, counting them against `--count`.
struct Printer {
    filter: Filter,
    output: Output,
    left: Option<u64>,
}

impl Printer {
    fn new(args: &MonitorArgs) -> Self {
        let filter = Filter { service: args.service.clone(), drops: args.drops };
        Printer { filter, output: args.inspect.output, left: args.count }
    }

    fn print(&mut self, line: &Line) -> anyhow::Result<()> {
        if !self.filter.keeps(line) || self.done() {
            return Ok(());
        }
        match self.output {
            Output::Table => println!("{}", line.text()),
            Output::Json => println!("{}", serde_json::to_string(line)?),
        }
        if let Some(left) = &mut self.left {
            *left -= 1;
        }
        Ok(())
    }

    fn done(&self) -> bool {
        self.left == Some(0)
    }
}

async fn ebpf(args: &MonitorArgs) -> anyhow::Result<()> {
    let root = &args.inspect.pins.bpffs_root;
    let mut watch = Watch::open(root)?;
    watch.keep_on(sys::monotonic_ns())?;
    let mut names = PinnedNames::new(root);
    let mut printer = Printer::new(args);
    let mut poll = tokio::time::interval(POLL);
    poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut refresh = tokio::time::interval(REFRESH);
    refresh.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut interrupt, mut terminate) =
        (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
    let end = args.duration.map(|d| Instant::now() + d);
    let mut reported_lost = 0;
    while !printer.done() {
        tokio::select! {
            _ = poll.tick() => {
                for event in watch.by_ref() {
                    printer.print(&monitor::line(&event, &mut names))?;
                }
            }
            _ = refresh.tick() => {
                watch.keep_on(sys::monotonic_ns())?;
                reported_lost = report_lost(watch.lost(), reported_lost);
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
            _ = tokio::time::sleep_until(end.unwrap_or_else(Instant::now)), if end.is_some() => break,
        }
    }
    report_lost(watch.lost(), reported_lost);
    Ok(())
}

/// The rule-based modes: new service flows from `conntrack -E` (filtered
/// by the service table, read again every second); with
/// `refusals_counted` (iptables) refusals and drops from the REJECT/DROP
/// rules' counters, polled every second.
async fn iptables(args: &MonitorArgs, refusals_counted: bool) -> anyhow::Result<()> {
    let (_conntrack, mut events) = conntrack_events()?;
    let mut printer = Printer::new(args);
    let mut lb = super::lb::lb_entries(&args.inspect)?;
    let mut counters = Counters::default();
    let refusals = || if refusals_counted { refusals() } else { Ok(Vec::new()) };
    counters.update(&refusals()?, SystemTime::now());
    let mut refresh = tokio::time::interval(REFRESH);
    refresh.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut interrupt, mut terminate) =
        (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
    let end = args.duration.map(|d| Instant::now() + d);
    while !printer.done() {
        tokio::select! {
            event = events.recv() => {
                let Some(event) = event else { anyhow::bail!("conntrack -E ended") };
                if let Some(line) = iptables::new_flow(&event, &lb, SystemTime::now()) {
                    printer.print(&line)?;
                }
            }
            _ = refresh.tick() => {
                lb = super::lb::lb_entries(&args.inspect)?;
                for line in counters.update(&refusals()?, SystemTime::now()) {
                    printer.print(&line)?;
                }
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
            _ = tokio::time::sleep_until(end.unwrap_or_else(Instant::now)), if end.is_some() => break,
        }
    }
    Ok(())
}

/// `conntrack -E -e NEW`, running until the returned guard drops, and its
/// lines (a thread reads them: tokio here has no process support).
fn conntrack_events() -> anyhow::Result<(KillOnDrop, UnboundedReceiver<String>)> {
    let mut child = std::process::Command::new("conntrack")
        .args(["-E", "-e", "NEW"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting conntrack -E (conntrack-tools)")?;
    let stdout = child.stdout.take().context("conntrack's output")?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok((KillOnDrop(child), rx))
}

/// A child process stopped when this drops.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The refusing rules of both families, with their counters.
fn refusals() -> anyhow::Result<Vec<crate::inspect::iptables::Refusal>> {
    let saved = super::lb::saved_rules(&["-c"])?;
    Ok(saved.iter().flat_map(|save| crate::inspect::iptables::refusals(save)).collect())
}

/// Says on stderr how many events were lost (the ring buffer was full)
/// since the last report; returns the new total.
fn report_lost(total: u64, reported: u64) -> u64 {
    if total > reported {
        tracing::warn!(lost = total - reported, total, "events lost: the ring buffer was full");
    }
    total
}
