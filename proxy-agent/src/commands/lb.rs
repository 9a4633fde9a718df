//! `proxy-agent lb list` and `ct list`: the service table and the service
//! flows, read back from the datapath; `bpf-log-level`: the running
//! programs' records.

use anyhow::Context as _;

use crate::{
    backend::{
        ebpf,
        iptables::exec::{ExecError, Runner as _, System, Xtables},
        nftables::render::TABLE,
    },
    cli::{BpfLogLevelArgs, CtListArgs, InspectArgs, InspectMode, LbListArgs, Output},
    inspect::{self, LbEntry, ct::CtRow},
    model::IpFamily,
    sys,
};

/// Which datapath the inspection commands read.
pub fn mode(args: &InspectArgs) -> InspectMode {
    match args.mode {
        InspectMode::Auto if args.pins.bpffs_root.join("maps").exists() => InspectMode::Ebpf,
        InspectMode::Auto if nft_tables().is_ok_and(|t| !t.is_empty()) => InspectMode::Nftables,
        InspectMode::Auto => InspectMode::Iptables,
        mode => mode,
    }
}

/// The service table of the datapath `args` names: in the iptables mode,
/// of both families' rules (a node without IPv6 rules has none of them).
pub fn lb_entries(args: &InspectArgs) -> anyhow::Result<Vec<LbEntry>> {
    Ok(match mode(args) {
        InspectMode::Iptables => {
            saved_rules(&[])?.iter().flat_map(|save| inspect::iptables::entries(save)).collect()
        }
        InspectMode::Nftables => inspect::nftables::entries(&nft_tables()?),
        _ => inspect::maps::read_pinned(&args.pins.bpffs_root)?,
    })
}

/// `nft list table` of the nftables mode's tables, both families' (none
/// where there is none).
pub fn nft_tables() -> anyhow::Result<String> {
    let mut text = String::new();
    for family in ["ip", "ip6"] {
        match System::default().run("nft", &["list", "table", family, TABLE], None) {
            Ok(listed) => text += &listed,
            Err(ExecError::Failed { stderr, .. }) if stderr.contains("No such file") => {}
            Err(e) => return Err(e).context("reading the nftables tables"),
        }
    }
    Ok(text)
}

/// `iptables-save <args>` of each family: IPv4's, and IPv6's where the
/// node has them.
pub fn saved_rules(args: &[&str]) -> anyhow::Result<Vec<String>> {
    let tools = System::new(Xtables::Auto.resolve(&mut System::default()));
    let save = tools.for_family(IpFamily::V4).run("iptables-save", args, None);
    let mut saved = vec![save.context("reading the rules")?];
    saved.extend(tools.for_family(IpFamily::V6).run("iptables-save", args, None).ok());
    Ok(saved)
}

pub fn list(args: &LbListArgs) -> anyhow::Result<()> {
    let inspect = &args.inspect;
    let mut entries = lb_entries(inspect)?;
    if let Some(service) = &args.service {
        entries.retain(|e| inspect::is_of(&e.service, service));
    }
    entries.sort();
    print(&entries, inspect.output, inspect::table)?;
    if inspect.output == Output::Table && mode(inspect) == InspectMode::Ebpf {
        let root = &inspect.pins.bpffs_root;
        let xdp = ebpf::xdp_pinned(root);
        if !xdp.is_empty() {
            println!("XDP (--bpf-lb-acceleration) on: {}", xdp.join(", "));
        }
        if args.service.is_none() {
            print_tc_interfaces(root);
        }
    }
    Ok(())
}

/// Which interfaces run which per-packet programs, and those that run none.
fn print_tc_interfaces(root: &std::path::Path) {
    let (running, bare): (Vec<_>, Vec<_>) =
        ebpf::tc_attached(root).into_iter().partition(|(_, programs)| !programs.is_empty());
    println!("per-packet programs:");
    for (interface, programs) in &running {
        println!("  {interface:<16} {}", programs.join(" + "));
    }
    if !bare.is_empty() {
        let names: Vec<String> = bare.into_iter().map(|(interface, _)| interface).collect();
        println!("  none on: {}", names.join(", "));
    }
}

pub fn ct_list(args: &CtListArgs) -> anyhow::Result<()> {
    let inspect = &args.inspect;
    let mut rows: Vec<CtRow> = match mode(inspect) {
        InspectMode::Iptables | InspectMode::Nftables => {
            let lb = lb_entries(inspect)?;
            // Both families' entries (`-L` alone lists IPv4's).
            let mut text = String::new();
            for family in ["ipv4", "ipv6"] {
                let listed = System::default().run("conntrack", &["-L", "-f", family], None);
                text += &listed.context("reading conntrack")?;
            }
            inspect::ct::conntrack(&text, &lb)
        }
        _ => inspect::maps::read_flows(&inspect.pins.bpffs_root, sys::monotonic_ns())?,
    };
    if let Some(service) = &args.service {
        rows.retain(|r| inspect::is_of(&r.service, service));
    }
    if let Some(ip) = args.backend {
        rows.retain(|r| inspect::ct::is_to(r, ip));
    }
    rows.sort();
    print(&rows, inspect.output, inspect::ct::table)
}

pub fn set_log_level(args: &BpfLogLevelArgs) -> anyhow::Result<()> {
    let root = &args.pins.bpffs_root;
    let previous = crate::backend::ebpf::set_pinned_log_level(root, args.level.word())?;
    println!(
        "decision records: {previous} -> {} (proxy_common::log_level words)",
        args.level.word()
    );
    Ok(())
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
