//! `proxy-agent cleanup`: every mode's datapath removed.

use anyhow::Context as _;

use crate::{
    backend::{ebpf, iptables, iptables::exec::System, nftables},
    cli::PinArgs,
};

/// Removes every mode's datapath: pins (links detach, maps go), clsact
/// filters, iptables rules and nftables tables of the caller's network
/// namespace.
pub fn run(args: &PinArgs) -> anyhow::Result<()> {
    let root = &args.bpffs_root;
    let (pins, filters) = ebpf::cleanup(root)?;
    let chains = iptables::cleanup_every_backend().context("removing the iptables rules")?;
    let tables =
        nftables::cleanup(&mut System::default()).context("removing the nftables tables")?;
    tracing::info!(pins, filters, chains, tables, root = %root.display(), "removed pinned links and maps, clsact filters, iptables chains and nftables tables");
    Ok(())
}
