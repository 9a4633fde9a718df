//! The `proxy-agent` binary: parse the command line, log, dispatch.

use clap::{CommandFactory as _, FromArgMatches as _};
use proxy_agent::{
    cli::{Cli, Command, CtCommand, LbCommand, LoggingFormat, RenderCommand},
    commands,
};

/// Logs to stderr at `RUST_LOG`'s level (info by default), as text or JSON.
fn init_logging(format: LoggingFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LoggingFormat::Text => {
            logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init()
        }
        LoggingFormat::Json => logs.json().with_current_span(false).init(),
    }
}

fn main() -> std::process::ExitCode {
    proxy_agent::sys::fix_allocator_thresholds();
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_logging(cli.logging_format);
    let result = match cli.command {
        Command::Run(args) => {
            let run = matches.subcommand_matches("run").cloned().unwrap_or_default();
            commands::run::run(*args, &run)
        }
        Command::Cleanup(args) => commands::cleanup::run(&args),
        Command::PrepareNode(args) => commands::prepare_node::run(&args),
        Command::Render(RenderCommand::Iptables(args)) => commands::render::iptables(&args),
        Command::Render(RenderCommand::Nftables(args)) => commands::render::nftables(&args),
        Command::Probe(args) => commands::probe::run(&args),
        Command::Lb(LbCommand::List(args)) => commands::lb::list(&args),
        Command::Ct(CtCommand::List(args)) => commands::lb::ct_list(&args),
        Command::BpfLogLevel(args) => commands::lb::set_log_level(&args),
        Command::Explain(args) => commands::explain::run(&args),
        Command::Monitor(args) => commands::monitor::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
