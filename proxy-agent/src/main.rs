//! The `proxy-agent` binary: parse the command line, log, run.

use anyhow::Context as _;
use clap::{CommandFactory as _, FromArgMatches as _, parser::ValueSource};
use proxy_agent::{
    agent,
    cli::{Cli, Command, RenderCommand, RunArgs},
    config, probe,
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
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Run(args) => {
            let run = matches.subcommand_matches("run").cloned().unwrap_or_default();
            with_config(*args, &run).and_then(agent::run)
        }
        Command::Cleanup(args) => agent::cleanup(&args),
        Command::PrepareNode(args) => agent::prepare_node(&args),
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

/// `run`'s flags, with `--config`'s settings where no flag was given.
fn with_config(mut args: RunArgs, matches: &clap::ArgMatches) -> anyhow::Result<RunArgs> {
    let Some(path) = args.config.clone() else { return Ok(args) };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (settings, warnings) = config::parse(&path, &text)?;
    for warning in warnings {
        tracing::warn!(config = %path.display(), "{warning}");
    }
    config::apply(settings, &mut args, |id| {
        matches.value_source(id) == Some(ValueSource::CommandLine)
    });
    Ok(args)
}
