//! `proxy-agent cleanup`: both modes' datapaths removed.

use anyhow::Context as _;

use crate::{
    backend::{ebpf, iptables},
    cli::PinArgs,
};

/// Removes both modes' datapaths: pins (links detach, maps go), clsact
/// filters and iptables rules of the caller's network namespace.
pub fn run(args: &PinArgs) -> anyhow::Result<()> {
    let root = &args.bpffs_root;
    let (pins, filters) = ebpf::cleanup(root)?;
    let chains = iptables::cleanup_every_backend().context("removing the iptables rules")?;
    tracing::info!(pins, filters, chains, root = %root.display(), "removed pinned links and maps, clsact filters and iptables chains");
    Ok(())
}
