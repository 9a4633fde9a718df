//! What the tasks build: the agent and the lab's binaries, the agent with
//! the other conntrack layout, and the test executables (listed from
//! cargo's JSON messages so one build serves the test run and the VMs).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::cargo;

/// A test executable cargo built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestBinary {
    /// Its package (`proxy-lab` for the lab's tests).
    pub package: String,
    /// Its target's name (`socket_lb`, or the crate's name for unit tests).
    pub name: String,
    pub path: PathBuf,
}

/// The agent and the lab's pod binary, which the demo and lab tests run.
pub fn bins() -> anyhow::Result<()> {
    cargo(&["build", "-p", "proxy-agent", "-p", "proxy-lab", "--bins"])
}

/// The agent and the lab's pod binary, optimized.
pub fn release_bins() -> anyhow::Result<()> {
    cargo(&["build", "--release", "-p", "proxy-agent", "-p", "proxy-lab", "--bins"])
}

/// The BPF objects of both conntrack layouts, built on a thread of their
/// own as the agent's build script builds them (`proxy-ebpf-build`): cargo
/// runs that build script behind most libraries, with the BPF build then
/// alone on the critical path; started first, it overlaps with them, and
/// the build script finds it done.
pub fn bpf_objects_in_background() -> std::thread::JoinHandle<std::io::Result<()>> {
    std::thread::spawn(|| {
        let (crate_dir, target) = (Path::new("proxy-ebpf"), Path::new("target"));
        std::fs::create_dir_all(target)?;
        for features in [&[][..], &["ct-lean"]] {
            proxy_ebpf_build::build(crate_dir, target, std::env::consts::ARCH, features)?;
        }
        Ok(())
    })
}

/// The agent with the other conntrack layout (`ct-lean`), as
/// `target/debug/proxy-agent-ct-lean`: the upgrade tests move flows
/// between it and the default build. Leaves the default agent in place:
/// kept aside while cargo links the other one where it was (building it
/// again would compile the agent once more, as the test build unified
/// other features).
pub fn other_layout() -> anyhow::Result<()> {
    let dir = Path::new("target/debug");
    let (agent, kept) = (dir.join("proxy-agent"), dir.join("proxy-agent-default"));
    let _ = std::fs::remove_file(&kept);
    std::fs::hard_link(&agent, &kept).context("keeping the default agent")?;
    cargo(&["build", "-p", "proxy-agent", "--features", "ct-lean"])?;
    // A new file, not the hard link cargo made: a later build replaces
    // `proxy-agent` and must not change this one.
    let lean = dir.join("proxy-agent-ct-lean");
    let _ = std::fs::remove_file(&lean);
    std::fs::copy(&agent, &lean).context("keeping the ct-lean build")?;
    std::fs::rename(&kept, &agent).context("putting the default agent back")
}

/// Builds the test executables of `packages` (all of the workspace's but
/// the BPF crate when empty) and lists them.
pub fn tests(packages: &[&str]) -> anyhow::Result<Vec<TestBinary>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["test", "--no-run", "--message-format=json-render-diagnostics"]);
    if packages.is_empty() {
        cmd.args(["--workspace", "--exclude", "proxy-ebpf"]);
    }
    for package in packages {
        cmd.args(["-p", package]);
    }
    let out = cmd.stderr(Stdio::inherit()).output().context("building the tests")?;
    if !out.status.success() {
        bail!("building the tests failed ({})", out.status);
    }
    Ok(test_binaries(&String::from_utf8_lossy(&out.stdout)))
}

/// The test executables in cargo's JSON messages.
fn test_binaries(messages: &str) -> Vec<TestBinary> {
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| {
            let package_id = m["package_id"].as_str()?;
            Some(TestBinary {
                package: package_name(package_id)?.to_string(),
                name: m["target"]["name"].as_str()?.to_string(),
                path: PathBuf::from(m["executable"].as_str()?),
            })
        })
        .collect()
}

/// The name in a package id: `path+file:///w/tests#proxy-lab@0.1.0`, or
/// `path+file:///w/xtask#0.1.0` when the directory is the name.
fn package_name(id: &str) -> Option<&str> {
    let (path, rest) = id.rsplit_once('#')?;
    match rest.split_once('@') {
        Some((name, _)) => Some(name),
        None => path.rsplit('/').next(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_binaries_come_from_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/tests#proxy-lab@0.1.0","target":{"kind":["lib"],"name":"proxy_lab"},"profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","package_id":"path+file:///w/tests#proxy-lab@0.1.0","target":{"kind":["test"],"name":"socket_lb"},"profile":{"test":true},"executable":"/w/target/debug/deps/socket_lb-1234"}
{"reason":"compiler-artifact","package_id":"path+file:///w/xtask#0.1.0","target":{"kind":["bin"],"name":"xtask"},"profile":{"test":true},"executable":"/w/target/debug/deps/xtask-99"}
{"reason":"build-finished","success":true}"#;
        let binaries = test_binaries(messages);
        assert_eq!(
            binaries,
            [
                TestBinary {
                    package: "proxy-lab".into(),
                    name: "socket_lb".into(),
                    path: "/w/target/debug/deps/socket_lb-1234".into()
                },
                TestBinary {
                    package: "xtask".into(),
                    name: "xtask".into(),
                    path: "/w/target/debug/deps/xtask-99".into()
                },
            ]
        );
    }
}
