//! The lab: a node network namespace running `proxy-agent`, pod namespaces
//! joined to it by veth pairs, and a test cgroup for clients under socket LB.
//!
//! Pods get /32 addresses routed through the node, as real CNIs do: the pod's
//! default route goes via the link-local gateway 169.254.1.1 on the node side
//! of its veth, so every pod-to-pod packet crosses the node's IP layer. The
//! node namespace has no default route: an address nobody serves is
//! unreachable, never sent off the machine.
//!
//! A dual-stack lab ([`Lab::dual_stack`]) adds the IPv6 twin of each address
//! (see [`v6`]): pods fd00:244:N::M/128 behind the link-local gateway fe80::1
//! (as CNIs do), nodes and external clients fd00:100::X/64 on the fabric,
//! ClusterIPs in fd00:96::/112 and external service IPs in fd00:200::/112
//! routed as their IPv4 ranges are. Addresses skip duplicate address
//! detection (`nodad`, `accept_dad=0`): nothing else claims them, and a lab
//! must not wait a second per address.
//!
//! Everything a lab creates is named `pxl-<pid>-<n>-…` and removed when the
//! `Lab` drops, also when a test panics; labs left by a killed run are swept
//! by name when the next lab starts.

use std::path::PathBuf;

mod addresses;
mod agent;
pub mod apiserver;
pub mod bench_objects;
mod client;
mod cluster;
mod host;
mod lab;
mod node;
mod pods;
mod setup;

pub use addresses::*;
pub use client::{Attempt, Client, Request, Tally, answered, answered_after, tally};
pub use cluster::{
    Stack, two_node_endpoints, two_node_endpoints6, two_node_web_cluster, two_node_web_cluster_on,
};
pub use host::{load_xdp, sh};
pub use lab::Lab;
pub use node::{Node, sample};
pub use pods::Pod;
pub use setup::{Mode, Setup, Source};

const PREFIX: &str = "pxl-";
/// Each lab's own bpffs, mounted in its scratch dir (so nothing appears in
/// the host's /sys/fs/bpf, where mounting bpffs would also show the kernel's
/// preloaded iterators) and unmounted at teardown.
pub(crate) const BPFFS_DIR: &str = "bpf";

/// Overrides where [`target_bin`] looks (the benchmark uses release builds).
pub const BIN_DIR_ENV: &str = "PROXY_LAB_BIN_DIR";

/// A binary of this workspace: in `$PROXY_LAB_BIN_DIR`, else next to the
/// running executable (`target/<profile>/`, or its parent for integration
/// tests, which cargo puts in `target/<profile>/deps/`).
pub fn target_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let exe_dir = exe.parent().expect("exe dir").to_path_buf();
    let candidates = match std::env::var_os(BIN_DIR_ENV) {
        Some(dir) => vec![PathBuf::from(dir)],
        None => vec![exe_dir.clone(), exe_dir.parent().unwrap_or(&exe_dir).to_path_buf()],
    };
    let found = candidates.iter().map(|d| d.join(name)).find(|p| p.exists());
    found.unwrap_or_else(|| {
        panic!("{name} is missing in {candidates:?}: build it first (cargo xtask test does)")
    })
}

/// Multiplies the lab's waits for an agent to serve (`PROXY_LAB_WAIT_SCALE`,
/// 1 when unset): the VM matrix's emulated CPU, sharing the host with the
/// test run, verifies the programs many times slower than the host.
pub const WAIT_SCALE_ENV: &str = "PROXY_LAB_WAIT_SCALE";

/// `wait` scaled by [`WAIT_SCALE_ENV`].
pub fn scaled(wait: std::time::Duration) -> std::time::Duration {
    let scale = std::env::var(WAIT_SCALE_ENV).ok().and_then(|s| s.parse::<u32>().ok());
    wait * scale.unwrap_or(1).max(1)
}

/// Whether the running kernel is at least `major.minor` (some behaviours
/// differ on older kernels, as docs/operations.md says).
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (major, minor)
}

/// Generates `mod <scenario> { fn <mode>(); … }` for the `[mode = SETUP,
/// …]` given, each test calling `<scenario>(Setup::SETUP)`: one definition,
/// every mode.
#[macro_export]
macro_rules! modes {
    (@one $scenario:ident [$($mode:ident = $setup:ident),*]) => {
        mod $scenario {
            $(
                #[test]
                fn $mode() {
                    super::$scenario($crate::Setup::$setup)
                }
            )*
        }
    };
    ($modes:tt $($scenario:ident),* $(,)?) => {$(
        $crate::modes!(@one $scenario $modes);
    )*};
}

/// Every mode (`ebpf`, `iptables`, `nftables`), and the API server as the
/// source (`api`).
#[macro_export]
macro_rules! both_modes {
    ($($scenario:ident),* $(,)?) => {
        $crate::modes!(
            [ebpf = EBPF, iptables = IPTABLES, nftables = NFTABLES, api = API]
            $($scenario),*
        );
    };
}

/// [`both_modes!`] and the eBPF mode with XDP on the nodes' uplinks
/// (`xdp`): the external-traffic scenarios.
#[macro_export]
macro_rules! external_modes {
    ($($scenario:ident),* $(,)?) => {
        $crate::modes!(
            [ebpf = EBPF, iptables = IPTABLES, nftables = NFTABLES, api = API, xdp = XDP]
            $($scenario),*
        );
    };
}
