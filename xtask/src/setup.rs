//! Idempotent installation of the build and test prerequisites (DESIGN §7).

use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Debian packages: LLVM 22 for bpf-linker, and the lab's runtime tools.
const PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "iproute2",
    "iptables",
    // The nftables mode applies its ruleset with `nft -f`.
    "nftables",
    "conntrack",
    "bpftool",
    "util-linux",
    // The lab turns a client's offloads off to send full-size packets.
    "ethtool",
];
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn run() -> anyhow::Result<()> {
    apt_packages()?;
    nightly_with_rust_src()?;
    bpf_linker()
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

pub(crate) fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

/// What `cargo xtask bench` adds: nginx as the backend, wrk as the client.
const BENCH_PACKAGES: &[&str] = &["nginx-light", "wrk"];

/// The benchmark's tools, installed without starting nginx on the host
/// (the bench runs its own, inside the lab).
pub fn bench_packages() -> anyhow::Result<()> {
    const POLICY: &str = "/usr/sbin/policy-rc.d";
    let missing: Vec<&str> = BENCH_PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    // Debian starts services it installs unless policy-rc.d says no.
    let ours = !std::path::Path::new(POLICY).exists();
    if ours {
        std::fs::write(POLICY, "#!/bin/sh\nexit 101\n")?;
        std::fs::set_permissions(POLICY, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    }
    let result = install(&missing);
    if ours {
        let _ = std::fs::remove_file(POLICY);
    }
    result
}

/// What `cargo xtask vmtest` adds: qemu, and busybox and cpio for the
/// guest's initramfs, kmod's depmod for the guest kernel's modules.
const VM_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static", "cpio", "kmod"];

pub fn vm_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = VM_PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    install(&missing)
}

fn apt_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    install(&missing)
}

fn install(missing: &[&str]) -> anyhow::Result<()> {
    eprintln!("setup: installing {}", missing.join(" "));
    // A fresh machine's package lists may be empty or old.
    run_cmd(Command::new("apt-get").args(["update", "-q"]))?;
    run_cmd(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn nightly_with_rust_src() -> anyhow::Result<()> {
    if !succeeds(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        eprintln!("setup: installing the nightly toolchain");
        run_cmd(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            // clippy: `cargo xtask test` lints the BPF crate with nightly.
            "rust-src,clippy",
        ]))?;
    }
    let components = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .context("listing nightly's components")?;
    if !String::from_utf8_lossy(&components.stdout).lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("setup: adding rust-src to nightly");
        run_cmd(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

fn bpf_linker() -> anyhow::Result<()> {
    if succeeds(Command::new("bpf-linker").arg("--version")) {
        return Ok(());
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (a few minutes)");
    // Without the prefix llvm-sys finds /usr/bin/llvm-config (LLVM 14).
    let path = format!("{LLVM_PREFIX}/bin:{}", std::env::var("PATH").unwrap_or_default());
    run_cmd(
        Command::new("cargo")
            .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_SYS_221_PREFIX", LLVM_PREFIX)
            .env("PATH", path),
    )
}
