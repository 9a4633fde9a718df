//! `proxy-agent lb list`: the service table read back from the datapath.

use anyhow::Context as _;

use crate::{
    backend::iptables::exec::{Runner as _, System},
    cli::{InspectArgs, InspectMode, LbListArgs, Output},
    inspect::{self, LbEntry},
};

/// Which datapath the inspection commands read.
pub fn mode(args: &InspectArgs) -> InspectMode {
    match args.mode {
        InspectMode::Auto if args.pins.bpffs_root.join("maps").exists() => InspectMode::Ebpf,
        InspectMode::Auto => InspectMode::Iptables,
        mode => mode,
    }
}

pub fn list(args: &LbListArgs) -> anyhow::Result<()> {
    let inspect = &args.inspect;
    let mut entries: Vec<LbEntry> = match mode(inspect) {
        InspectMode::Iptables => {
            let save = System.run("iptables-save", &[], None).context("reading the rules")?;
            inspect::iptables::entries(&save)
        }
        _ => inspect::maps::read_pinned(&inspect.pins.bpffs_root)?,
    };
    if let Some(service) = &args.service {
        entries.retain(|e| inspect::is_of(e, service));
    }
    entries.sort();
    print(&entries, inspect.output, inspect::table)
}

/// Prints `items` as the table `table` makes, or as JSON.
pub fn print<T: serde::Serialize>(
    items: &[T],
    output: Output,
    table: impl Fn(&[T]) -> String,
) -> anyhow::Result<()> {
    match output {
        Output::Table => print!("{}", table(items)),
        Output::Json => println!("{}", serde_json::to_string_pretty(items)?),
    }
    Ok(())
}
