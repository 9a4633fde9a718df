//! `proxy-agent prepare-node`: what needs root on the node, once (the
//! DaemonSet's init container).

use anyhow::Context as _;

use crate::{cli::PrepareArgs, sys};

/// `prepare-node`: the node settings `run` needs and checks, made as root.
pub fn run(args: &PrepareArgs) -> anyhow::Result<()> {
    let root = &args.pins.bpffs_root;
    sys::ensure_bpffs_dir(root).with_context(|| format!("preparing {}", root.display()))?;
    let (min, max) = args.snat_port_range;
    sys::reserve_ports(min, max).context("reserving the SNAT port range")?;
    if args.iptables_localhost_nodeports {
        sys::set_sysctl("net/ipv4/conf/all/route_localnet", "1")
            .context("enabling route_localnet")?;
    }
    tracing::info!(bpffs = %root.display(), min, max, "node prepared");
    Ok(())
}
