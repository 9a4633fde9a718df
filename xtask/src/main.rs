//! Developer tasks: `cargo xtask setup | demo | test | bench | packet-bench | soak |
//! vmtest | newer-nft`.

mod artifacts;
mod bench;
mod demo;
mod nft;
mod report;
mod runner;
mod setup;
mod soak;
mod suite;
mod vmtest;

use std::process::Command;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing needs (apt packages, nightly with
    /// rust-src, bpf-linker); quick when everything is there.
    Setup,
    /// Build, start a lab with pods and the example manifest, send traffic
    /// through the ClusterIP and the NodePort, show the maps (or rules),
    /// tear everything down.
    Demo {
        /// The agent's --proxy-mode
        #[arg(long, value_enum, default_value = "ebpf")]
        mode: DemoMode,
    },
    /// Setup, lint, build once, and run every test (unit and lab; needs
    /// root), each in its own process, several at a time, then the kernel
    /// matrix on 6.1 (`vmtest --kernel 6.1`) with the same build; the time
    /// of each phase at the end.
    Test {
        /// Tests run at a time (the lab's tests mostly wait)
        #[arg(long, default_value_t = 4)]
        jobs: usize,
        /// The VM matrix's kernel: 5.10, 6.1, all, or none
        #[arg(long, default_value = "6.1", value_parser = ["5.10", "6.1", "all", "none"])]
        kernel: String,
    },
    /// What a Service costs: connection rates against a direct connection,
    /// programming time, change latency and memory, for 1, 1,000 and 10,000
    /// services (and 100,000 with --full), in eBPF and iptables mode; an
    /// external client's path on two nodes (direct, SNAT, DSR, DSR with
    /// Maglev); the per-packet program; writes target/bench/ (results.json,
    /// report.md, plots).
    Bench {
        #[command(flatten)]
        options: bench::Options,
        /// Only compare the iptables mode's programming time with
        /// iptables-nft and iptables-legacy (at --sizes, default 1,000 and
        /// 10,000)
        #[arg(long)]
        iptables_backends: bool,
    },
    /// The per-packet program's nanoseconds per packet (`packet_bench`) of
    /// this tree against another build's, run alternately on the same
    /// machine; prints the medians and the ratios.
    PacketBench {
        /// The other build's packet_bench binary (e.g. built from main:
        /// `cargo build --release -p proxy-agent --example packet_bench`,
        /// then copied aside)
        #[arg(long, required_unless_present = "monitor", conflicts_with = "monitor")]
        base: Option<std::path::PathBuf>,
        /// Compare this tree with the monitor's events off (base) and on
        #[arg(long)]
        monitor: bool,
        /// Rounds per size (the median is reported)
        #[arg(long, default_value_t = 7)]
        rounds: usize,
        /// Services installed (default 2 and 100,000)
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<usize>,
    },
    /// Packets per second a node forwards through a NodePort to a pod on
    /// another node, and its CPU per packet, from frames that reach it as a
    /// NIC's do: the eBPF mode with tc alone, with XDP, and the iptables
    /// mode, in turns.
    Forwarding {
        /// Seconds of sending per run
        #[arg(long, default_value_t = 3)]
        seconds: u64,
        /// Runs per setup (the median is reported)
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// The agent under steady churn of services and endpoints (from the
    /// test API server) with traffic through a stable service: RSS, fds,
    /// CPU, map and conntrack entries after a warm-up and at the end, and
    /// the stable service's failed connections (must be 0); writes
    /// target/soak/results.json.
    Soak {
        /// Minutes after the warm-up
        #[arg(long, default_value_t = 10)]
        minutes: u64,
        /// The agent's --proxy-mode
        #[arg(long, value_enum, default_value = "ebpf")]
        mode: DemoMode,
        /// Changes a second
        #[arg(long, default_value_t = 20)]
        rate: u32,
        /// Seconds of churn before the first sample
        #[arg(long, default_value_t = 30)]
        warm_up: u64,
    },
    /// The probe and a smoke subset of the lab tests, in each mode, on
    /// Debian's LTS kernels booted under qemu (downloaded once, cached in
    /// ~/.cache/proxy-vmtest); prints kernel × scenario × mode.
    Vmtest {
        /// 5.10, 6.1 or all
        #[arg(long, default_value = "all", value_parser = ["5.10", "6.1", "all"])]
        kernel: String,
        /// Only this scenario (repeatable; e.g. sctp-echo): a quick check of
        /// one behaviour, not the matrix
        #[arg(long = "scenario", value_name = "ID")]
        scenarios: Vec<String>,
    },
    /// nft 1.1.3 for benchmarks (Debian 12's is 1.0.6): Debian trixie's
    /// packages, pinned by sha256, unpacked into target/nft-1.1.3/ (no
    /// install; quick when there); prints the directory holding its `nft`,
    /// for `bench --nft`.
    NewerNft,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DemoMode {
    Ebpf,
    Iptables,
    Nftables,
}

impl DemoMode {
    fn lab(self) -> proxy_lab::Mode {
        match self {
            DemoMode::Ebpf => proxy_lab::Mode::Ebpf,
            DemoMode::Iptables => proxy_lab::Mode::Iptables,
            DemoMode::Nftables => proxy_lab::Mode::Nftables,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Run from the workspace root whatever the caller's directory.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::env::set_current_dir(&root).context("entering the workspace")?;
    match cli.task {
        Task::Setup => setup::run(),
        Task::Demo { mode } => {
            setup::run()?;
            artifacts::bins()?;
            demo::run(mode.lab())
        }
        Task::Test { jobs, kernel } => {
            suite::run(suite::Options { jobs, kernels: vmtest::kernels(&kernel) })
        }
        Task::Bench { options, iptables_backends } => {
            setup::run()?;
            setup::bench_packages()?;
            require_root()?;
            // The bench hosts the test API server and loads large manifests
            // into it: it runs optimized, as the agent does.
            if rerun_optimized()? {
                return Ok(());
            }
            artifacts::release_bins()?;
            if iptables_backends {
                return bench::iptables_backends(&options.sizes, options.full);
            }
            bench::run(options)
        }
        Task::PacketBench { base, monitor, rounds, sizes } => {
            require_root()?;
            let builds = match &base {
                Some(base) => bench::Builds::Base(base),
                None if monitor => bench::Builds::Monitor,
                None => bail!("--base BIN or --monitor"),
            };
            bench::packet_ab(builds, &sizes, rounds)
        }
        Task::Forwarding { seconds, rounds } => {
            setup::run()?;
            require_root()?;
            if rerun_optimized()? {
                return Ok(());
            }
            artifacts::release_bins()?;
            bench::forwarding::run(seconds, rounds)
        }
        Task::Soak { minutes, mode, rate, warm_up } => {
            setup::run()?;
            require_root()?;
            if rerun_optimized()? {
                return Ok(());
            }
            artifacts::release_bins()?;
            let warm_up = std::time::Duration::from_secs(warm_up);
            soak::run(soak::Options { minutes, mode: mode.lab(), rate, warm_up })
        }
        Task::Vmtest { kernel, scenarios } => {
            setup::run()?;
            setup::vm_packages()?;
            require_root()?;
            vmtest::run(&vmtest::kernels(&kernel), &scenarios)
        }
        Task::NewerNft => nft::run().map(drop),
    }
}

/// Runs this task again as an optimized build, when it is not one: the
/// bench and the soak host the test API server, and time things.
fn rerun_optimized() -> anyhow::Result<bool> {
    if !cfg!(debug_assertions) {
        return Ok(false);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = ["run", "--quiet", "--release", "--package", "xtask", "--"];
    cargo(&[&run[..], &args].concat())?;
    Ok(true)
}

pub(crate) fn cargo(args: &[&str]) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .with_context(|| format!("running cargo {args:?}"))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

pub(crate) fn require_root() -> anyhow::Result<()> {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab needs root: network namespaces, cgroups and BPF programs");
    }
    Ok(())
}
