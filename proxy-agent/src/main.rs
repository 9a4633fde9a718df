//! The `proxy-agent` binary: parse the command line, log, run.

use clap::Parser as _;
use proxy_agent::{
    agent,
    cli::{Cli, Command, RenderCommand},
    probe,
};

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
        Command::Run(args) => agent::run(*args),
        Command::Cleanup(args) => agent::cleanup(&args),
        Command::Render(RenderCommand::Iptables(args)) => agent::render_iptables(&args),
        Command::Probe => {
            print!("{}", probe::report(&probe::run()));
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
