//! `cargo xtask test`: format, build once (the agent, the lab's binaries
//! and every test executable, which the VM matrix runs too), the other
//! layout's agent, every test in parallel with the lints beside them, then
//! the kernel matrix; the time of each phase at the end.

use std::{
    process::Command,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::{artifacts, cargo, require_root, runner, setup, vmtest};

pub struct Options {
    /// Tests run at a time.
    pub jobs: usize,
    /// The VM matrix's kernels (none: no VM).
    pub kernels: Vec<vmtest::Kernel>,
}

pub fn run(options: Options) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut phases = Phases::default();
    phases.time("setup", || {
        setup::run()?;
        if !options.kernels.is_empty() {
            setup::vm_packages()?;
        }
        Ok(())
    })?;
    require_root()?;
    phases.time("format", || cargo(&["fmt", "--all", "--check"]))?;
    let tests = phases.time("build", || {
        let bpf = artifacts::bpf_objects_in_background();
        // One cargo run: the test build makes the agent's and the lab's
        // binaries too (the integration tests run them), and cargo then
        // overlaps the agent's library with its test build.
        let tests = artifacts::tests(&[])?;
        bpf.join().map_err(|_| anyhow::anyhow!("the BPF build panicked"))??;
        Ok(tests)
    })?;
    phases.time("other conntrack layout", artifacts::other_layout)?;
    // The examples in the libraries' docs (not test executables), with the
    // packages the build chose (other features would compile them again).
    phases.time("doc tests", || {
        cargo(&["test", "--doc", "--workspace", "--exclude", "proxy-ebpf"])
    })?;
    let lint = lint_beside();
    let summary =
        phases.time("tests (the lints beside them)", || runner::run(&tests, options.jobs))?;
    let (lint, linted) = phases.time("lints (what was left)", || {
        lint.join().map_err(|_| anyhow::anyhow!("the lints' thread panicked"))
    })?;
    phases.add("(lints, from their start)", linted);
    // After the tests, not beside them: on two cores an emulated CPU
    // sharing the host with the lab verifies the programs minutes late, and
    // both sides' waits and latency checks fail.
    let vm_result = match options.kernels.is_empty() {
        true => Ok(()),
        false => {
            let names: Vec<&str> = options.kernels.iter().map(|k| k.name).collect();
            let phase = format!("VM matrix {}", names.join(", "));
            phases.time(&phase, || Ok(vmtest::run_built(&options.kernels, &tests, &[])))?
        }
    };
    if let Err(e) = &lint {
        eprintln!("\n---- lints ----\n{e:#}");
    }
    for (name, output) in &summary.failed {
        eprintln!("\n---- {name} ----\n{output}");
    }
    eprintln!("\nslowest tests:");
    for (name, took) in &summary.slowest {
        eprintln!("  {:>6.1} s  {name}", took.as_secs_f64());
    }
    eprintln!(
        "\ntests: {} passed, {} failed, {} ignored ({} at a time)",
        summary.passed,
        summary.failed.len(),
        summary.ignored,
        options.jobs
    );
    phases.add("total", started.elapsed());
    eprint!("{}", phases.table());
    if !summary.failed.is_empty() {
        let names: Vec<&str> = summary.failed.iter().map(|(n, _)| n.as_str()).collect();
        bail!("{} tests failed: {}", names.len(), names.join(", "));
    }
    lint.context("the lints")?;
    vm_result.context("the VM matrix")
}

/// The lints (clippy on the workspace, and on the BPF crate for its own
/// target) on a thread of their own, beside the tests, with only the CPU
/// and disk time nothing else wants (`SCHED_IDLE`, the idle I/O class):
/// the tests mostly wait, and the lints take what they leave (about half
/// a core) instead of two cores of their own before them, without
/// taking a share from the tests' agents (a nice value would). Their output
/// is kept, and shown if they fail. Returns how long they took.
fn lint_beside() -> JoinHandle<(anyhow::Result<()>, Duration)> {
    std::thread::spawn(|| {
        let started = Instant::now();
        idle_priority();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut workspace = Command::new(cargo);
        workspace.args(["clippy", "--workspace", "--exclude", "proxy-ebpf", "--all-targets"]);
        workspace.args(["--", "-D", "warnings"]);
        let result = quietly(workspace).and_then(|()| quietly(clippy_bpf()));
        (result, started.elapsed())
    })
}

/// Gives this thread, and what it starts (Linux: both are per thread and
/// inherited), the idle CPU policy and the idle I/O class. Failing leaves
/// them as they were.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // The idle I/O class, priority 0 (`IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0)`).
    const IOPRIO_IDLE: libc::c_long = 3 << 13;
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    // SAFETY: no preconditions; 0 names the calling thread.
    unsafe {
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
        libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, IOPRIO_IDLE);
    }
}

/// Clippy on the BPF crate for its own target, as the build compiles it.
fn clippy_bpf() -> Command {
    let mut clippy = Command::new("rustup");
    clippy
        .args(["run", "nightly", "cargo", "clippy", "-p", "proxy-ebpf"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .args(["--target-dir", "target/bpf-clippy", "--", "-D", "warnings"])
        // The outer cargo's toolchain must not leak into nightly's.
        .env_remove("RUSTC")
        .env_remove("CARGO")
        .env_remove("RUSTUP_TOOLCHAIN");
    clippy
}

/// Runs `command` with its output kept: an error with that output if it
/// fails.
fn quietly(mut command: Command) -> anyhow::Result<()> {
    let out = command.output().with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!(
            "{command:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Wall time per phase, in order.
#[derive(Default)]
struct Phases(Vec<(String, Duration)>);

impl Phases {
    fn time<T>(
        &mut self,
        name: &str,
        phase: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let started = Instant::now();
        eprintln!("== {name}");
        let result = phase();
        self.add(name, started.elapsed());
        if result.is_err() {
            eprint!("{}", self.table());
        }
        result
    }

    fn add(&mut self, name: &str, took: Duration) {
        self.0.push((name.to_string(), took));
    }

    fn table(&self) -> String {
        let mut out = String::from("\nphase                                      time\n");
        for (name, took) in &self.0 {
            let secs = took.as_secs();
            out += &format!("{name:<40} {:>3}:{:02}\n", secs / 60, secs % 60);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_read_as_minutes_and_seconds() {
        let mut phases = Phases::default();
        phases.add("build", Duration::from_secs(254));
        phases.add("tests", Duration::from_millis(59_900));
        let table = phases.table();
        assert!(table.contains("build                                      4:14\n"), "{table}");
        assert!(table.contains("tests                                      0:59\n"), "{table}");
    }
}
