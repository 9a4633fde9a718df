//! Builds the BPF programs (`proxy-ebpf`) for `bpfel-unknown-none` with the
//! nightly toolchain and `-Z build-std=core`. The agent's build script
//! embeds what this builds; `cargo xtask test` starts the same build first,
//! beside the rest of the workspace's, so that the build script (which
//! cargo schedules late, behind the libraries) finds it done.
//!
//! One cargo target serves every feature set (`<target>/bpf/cargo`: `core`
//! is compiled once) and each set's object is copied to a directory of its
//! own (`<target>/bpf/<set>`). The command runs with a fixed environment:
//! a build script's (which cargo fills with its own variables, some of
//! which the BPF crates' build scripts watch) and `cargo xtask`'s must give
//! the same fingerprints, or each would compile everything again.

use std::{
    io,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// The variables the build keeps from its caller: where the tools are and
/// rustup's settings (but not a toolchain: it names its own).
fn kept(name: &str) -> bool {
    ["PATH", "HOME", "CARGO_HOME"].contains(&name)
        || (name.starts_with("RUSTUP_") && name != "RUSTUP_TOOLCHAIN")
}

/// Builds `proxy-ebpf` (the crate at `crate_dir`) with `features`, in the
/// workspace's cargo `target` directory, for a host of `arch` (the
/// programs' `bpf_target_arch`: which `pt_regs` layout they read); returns
/// the object's path, `<target>/bpf/<features or "default">/proxy-ebpf`.
pub fn build(
    crate_dir: &Path,
    target: &Path,
    arch: &str,
    features: &[&str],
) -> io::Result<PathBuf> {
    let set = if features.is_empty() { "default".to_string() } else { features.join("+") };
    // The same paths however the caller named them.
    let (crate_dir, target) = (crate_dir.canonicalize()?, target.canonicalize()?);
    let artifacts = target.join("bpf").join(set);
    let mut cargo = Command::new("rustup");
    cargo
        .args(["run", "nightly", "cargo", "build", "--package", "proxy-ebpf", "--bins"])
        .args(["--release", "--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .args(["--features", &features.join(",")])
        .arg("--target-dir")
        .arg(target.join("bpf").join("cargo"))
        .args(["-Z", "unstable-options", "--artifact-dir"])
        .arg(&artifacts)
        .current_dir(&crate_dir)
        .env_clear()
        .envs(std::env::vars_os().filter(|(k, _)| k.to_str().is_some_and(kept)))
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            format!("--cfg=bpf_target_arch=\"{arch}\"\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf"),
        )
        // A build script's stdout is read by cargo: cargo's own messages
        // go to stderr.
        .stdout(Stdio::null());
    let status =
        cargo.status().map_err(|e| io::Error::new(e.kind(), format!("running {cargo:?}: {e}")))?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "building the BPF programs failed ({status}): {cargo:?}"
        )));
    }
    Ok(artifacts.join("proxy-ebpf"))
}

#[cfg(test)]
mod tests {
    use super::kept;

    #[test]
    fn only_where_the_tools_are_is_kept() {
        for name in ["PATH", "HOME", "CARGO_HOME", "RUSTUP_HOME", "RUSTUP_AUTO_INSTALL"] {
            assert!(kept(name), "{name}");
        }
        // What cargo sets for a build script, and a toolchain of the caller's.
        for name in
            ["HOST", "TARGET", "OUT_DIR", "RUSTC", "CARGO_CFG_TARGET_ARCH", "RUSTUP_TOOLCHAIN"]
        {
            assert!(!kept(name), "{name}");
        }
    }
}
