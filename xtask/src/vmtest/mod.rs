//! `cargo xtask vmtest`: the agent's probe and a smoke subset of the lab
//! tests on Debian's LTS kernels, each booted under qemu (DESIGN §8). The
//! guest runs the host's filesystem read-only over 9p, so the agent and the
//! test binaries run unchanged; its console carries `VMTEST-` lines back.

mod image;
mod qemu;
mod results;

use std::{
    fmt::Write as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::artifacts::{self, TestBinary};

/// A Debian kernel the matrix boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// What `--kernel` names it.
    pub name: &'static str,
    suite: &'static str,
    /// The mode `auto` picks there: a kernel that ran the eBPF mode and
    /// falls back (a program its verifier now refuses) fails the matrix.
    auto: &'static str,
}

pub const KERNELS: [Kernel; 2] = [
    Kernel { name: "5.10", suite: "bullseye", auto: "ebpf" },
    Kernel { name: "6.1", suite: "bookworm", auto: "ebpf" },
];

/// One behaviour of the smoke subset: a test of a lab test binary, run as
/// `<function>::<mode>` in each of its modes (a `both_modes!` test's: both).
struct Scenario {
    id: &'static str,
    binary: &'static str,
    function: &'static str,
    modes: &'static [&'static str],
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        id: "clusterip-tcp",
        binary: "socket_lb",
        function: "tcp_connections_spread_uniformly_over_three_endpoints",
        modes: &MODES,
    },
    Scenario {
        id: "clusterip-udp",
        binary: "socket_lb",
        function: "udp_replies_and_tcp_peer_show_the_cluster_ip",
        modes: &MODES,
    },
    Scenario {
        id: "no-endpoints-socket",
        binary: "socket_lb",
        function: "a_service_without_endpoints_refuses_at_once",
        modes: &MODES,
    },
    Scenario {
        id: "nodeport-snat",
        binary: "packet_lb",
        function: "node_port_cluster_policy_reaches_every_endpoint_snated_to_the_node",
        modes: &EXTERNAL_MODES,
    },
    Scenario {
        id: "nodeport-ipv6",
        binary: "ipv6",
        function: "ipv6_node_port_cluster_policy_reaches_the_backend_from_the_nodes_ipv6_address",
        // With XDP, `xdp_ingress6` too (older verifiers count its frames larger).
        modes: &EXTERNAL_MODES,
    },
    Scenario {
        id: "nodeport-local",
        binary: "packet_lb",
        function: "node_port_local_policy_keeps_the_client_ip_and_drops_without_local_endpoints",
        modes: &MODES,
    },
    Scenario {
        id: "hairpin",
        binary: "packet_lb",
        function: "hairpin_a_pod_reaches_itself_through_its_cluster_ip",
        modes: &MODES,
    },
    Scenario {
        id: "no-endpoints-packet",
        binary: "packet_lb",
        function: "no_endpoints_are_refused_not_timed_out",
        modes: &MODES,
    },
    Scenario {
        id: "sctp-echo",
        binary: "sctp",
        function: "sctp_echo_follows_the_endpoints",
        modes: &MODES,
    },
    Scenario {
        id: "restart",
        binary: "restarts",
        function: "flows_survive_an_agent_crash_and_restart",
        modes: &EXTERNAL_MODES,
    },
];

/// The kernels `--kernel` names (`all`: every one).
pub fn kernels(name: &str) -> Vec<Kernel> {
    KERNELS.iter().copied().filter(|k| name == "all" || k.name == name).collect()
}

/// The modes every scenario runs in.
const MODES: [&str; 3] = ["ebpf", "iptables", "nftables"];
/// The external-traffic scenarios' modes: XDP's too (`--bpf-lb-acceleration
/// native`, the eBPF mode's).
const EXTERNAL_MODES: [&str; 4] = ["ebpf", "iptables", "nftables", "xdp"];
/// Every mode, in the matrix's column order.
const ALL_MODES: [&str; 4] = ["ebpf", "iptables", "nftables", "xdp"];

/// Modules the lab uses, loaded before the tests (the kernel would also
/// request most of them on first use).
const MODULES: &[&str] = &[
    "veth",
    "bridge",
    "sch_ingress",
    "cls_bpf",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "nft_reject_ipv4",
    "nf_conntrack",
    "nf_nat",
    "xt_conntrack",
    "xt_comment",
    "xt_mark",
    "xt_statistic",
    "xt_recent",
    "xt_addrtype",
    "xt_nat",
    "xt_MASQUERADE",
    "xt_set",
    "ipt_REJECT",
    "xt_sctp",
    // SCTP sockets (with libcrc32c and the rest it needs, modprobe's).
    "sctp",
    "inet_diag",
    "tcp_diag",
    "udp_diag",
];

/// How long one kernel's run may take under TCG.
const RUN_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// Builds the agent, the lab's binaries and tests, then runs the matrix
/// (of the scenarios `only` names; none: all of them).
pub fn run(kernels: &[Kernel], only: &[String]) -> anyhow::Result<()> {
    if let Some(id) = only.iter().find(|id| !SCENARIOS.iter().any(|s| s.id == id.as_str())) {
        let ids: Vec<&str> = SCENARIOS.iter().map(|s| s.id).collect();
        bail!("no scenario {id}: {}", ids.join(", "));
    }
    artifacts::bins()?;
    let tests = artifacts::tests(&["proxy-lab"])?;
    run_built(kernels, &tests, only)
}

/// Runs the matrix with what is built: the agent and `labpod` in
/// `target/debug` (the guest gets its own links to them, so a build on the
/// host meanwhile changes nothing in the guest) and the lab's `tests`.
pub fn run_built(kernels: &[Kernel], tests: &[TestBinary], only: &[String]) -> anyhow::Result<()> {
    let root = std::env::current_dir()?;
    let work = root.join("target/vmtest");
    let cache = image::cache_dir();
    let mut runs = Vec::new();
    for kernel in kernels {
        let image = image::fetch(*kernel, &cache)?;
        let dir = work.join(kernel.name);
        std::fs::create_dir_all(&dir)?;
        let initrd = image::initramfs(&image, &dir)?;
        prepare_guest(&dir, &root, tests, only)?;
        let accel = qemu::accelerator(&image, &initrd, &cache)?;
        eprintln!("vmtest: booting {} ({}) under {accel}", kernel.name, image.release);
        let started = Instant::now();
        let console = qemu::boot(&image, &initrd, &dir, accel)?;
        let mut run = results::parse(kernel.name, &console);
        run.expected_auto = kernel.auto.to_string();
        run.only = only.to_vec();
        run.seconds = started.elapsed().as_secs();
        eprintln!("vmtest: {} done in {} s", kernel.name, run.seconds);
        runs.push(run);
    }
    let table = results::table(&runs);
    print!("{table}");
    std::fs::write(work.join("results.md"), &table)?;
    let failed: Vec<String> = runs.iter().flat_map(results::Run::failures).collect();
    if !failed.is_empty() {
        bail!("vmtest failed: {}", failed.join(", "));
    }
    Ok(())
}

/// Writes what the guest reads from `dir`: its script, the plan, the
/// modules to load, and `bin/` with the agent and the lab's pod binary.
fn prepare_guest(
    dir: &Path,
    root: &Path,
    tests: &[TestBinary],
    only: &[String],
) -> anyhow::Result<()> {
    std::fs::write(dir.join("guest.sh"), include_str!("guest.sh"))?;
    std::fs::write(dir.join("modules"), MODULES.join("\n") + "\n")?;
    let mut plan = String::new();
    for scenario in SCENARIOS.iter().filter(|s| only.is_empty() || only.iter().any(|id| id == s.id))
    {
        let binary = tests
            .iter()
            .find(|t| t.package == "proxy-lab" && t.name == scenario.binary)
            .with_context(|| format!("no test binary {}", scenario.binary))?;
        for mode in scenario.modes {
            let _ = writeln!(
                plan,
                "{} {mode} {} {}",
                scenario.id,
                binary.path.display(),
                scenario.function
            );
        }
    }
    std::fs::write(dir.join("plan"), plan)?;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    for name in ["proxy-agent", "labpod"] {
        let to = bin.join(name);
        let _ = std::fs::remove_file(&to);
        let from = root.join("target/debug").join(name);
        // Cargo replaces its files rather than rewriting them: a link keeps
        // this build (a copy where links cannot be made).
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
        }
    }
    Ok(())
}

fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}
