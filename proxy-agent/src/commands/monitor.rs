//! `proxy-agent monitor`: prints the datapath's decisions as they happen
//! until SIGINT/SIGTERM, `--count` lines or `--duration`.

use std::time::Duration;

use tokio::{
    signal::unix::{SignalKind, signal},
    time::{Instant, MissedTickBehavior},
};

use crate::{
    cli::{InspectMode, MonitorArgs, Output},
    monitor::{
        self, Filter, Line,
        ring::{PinnedNames, Watch},
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
            InspectMode::Iptables => anyhow::bail!(
                "monitor reads the eBPF mode's events (no pinned maps under {}): the iptables mode has none yet",
                args.inspect.pins.bpffs_root.display()
            ),
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

/// Says on stderr how many events were lost (the ring buffer was full)
/// since the last report; returns the new total.
fn report_lost(total: u64, reported: u64) -> u64 {
    if total > reported {
        tracing::warn!(lost = total - reported, total, "events lost: the ring buffer was full");
    }
    total
}
