//! proxy-agent: an eBPF replacement for kube-proxy.
//!
//! `source` reads objects, `model` applies kube-proxy's semantics, `plan`
//! turns that into the desired datapath, `backend` writes it to the kernel.

mod agent;
mod backend;
mod metrics;
mod model;
mod plan;
mod source;
mod sys;

use std::{net::SocketAddr, path::PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "proxy-agent", version, about = "eBPF Kubernetes service proxy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the services of the manifests until SIGTERM; the datapath stays
    /// pinned after exit (as Cilium's does) until `cleanup`.
    Run(RunArgs),
    /// Remove every program, link and pin the agent installed.
    Cleanup(PinArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProxyMode {
    /// Socket load balancing in BPF programs on cgroup hooks.
    Ebpf,
}

/// Where the datapath is pinned; shared by `run` and `cleanup`.
#[derive(Args, Clone, Debug)]
pub struct PinArgs {
    /// bpffs directory for the pinned maps and links (bpffs is mounted at
    /// /sys/fs/bpf when missing)
    #[arg(long, value_name = "PATH", default_value = "/sys/fs/bpf/proxy")]
    pub bpffs_root: PathBuf,
}

#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// A YAML file or directory of Services and EndpointSlices, re-read on change
    #[arg(long, value_name = "PATH")]
    pub manifests: PathBuf,
    /// Which datapath to program
    #[arg(long, value_enum, default_value = "ebpf")]
    pub proxy_mode: ProxyMode,
    /// This node's name, matched against EndpointSlice nodeName to flag local
    /// backends [default: the hostname]
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// cgroup v2 the socket programs attach to [default: the cgroup2 mount root]
    #[arg(long, value_name = "PATH")]
    pub cgroup_path: Option<PathBuf>,
    /// Where /metrics and /healthz are served
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    #[command(flatten)]
    pub pins: PinArgs,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => agent::run(args),
        Command::Cleanup(args) => agent::cleanup(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
