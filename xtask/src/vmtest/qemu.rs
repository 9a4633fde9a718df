//! Booting a guest under qemu and reading its console.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::Context;

use super::{RUN_TIMEOUT, image::Image};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "KVM",
            Accel::Tcg => "TCG",
        })
    }
}

/// KVM where a guest actually boots with it (nested virtualization may
/// hang), else TCG. Decided once per host kernel and remembered.
pub(super) fn accelerator(image: &Image, initrd: &Path, cache: &Path) -> anyhow::Result<Accel> {
    if !Path::new("/dev/kvm").exists() {
        return Ok(Accel::Tcg);
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let remembered = cache.join(format!("kvm-{}", host.trim()));
    if let Ok(answer) = std::fs::read_to_string(&remembered) {
        return Ok(if answer.trim() == "yes" { Accel::Kvm } else { Accel::Tcg });
    }
    eprintln!("vmtest: checking whether a guest boots with KVM");
    let mut qemu = qemu(image, initrd, Accel::Kvm, "");
    let booted = watch(&mut qemu, Duration::from_secs(30), &mut std::io::sink())?
        .iter()
        .any(|l| l.contains("VMTEST-BOOTED"));
    std::fs::write(&remembered, if booted { "yes" } else { "no" })?;
    Ok(if booted { Accel::Kvm } else { Accel::Tcg })
}

fn qemu(image: &Image, initrd: &Path, accel: Accel, cmdline: &str) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    match accel {
        Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => cmd.args(["-accel", "tcg,tb-size=256", "-cpu", "max"]),
    };
    // No network device: the lab makes its own namespaces inside.
    cmd.args(["-m", "3072", "-smp", "2", "-nic", "none", "-no-reboot"])
        .args(["-display", "none", "-serial", "stdio", "-monitor", "none"])
        .arg("-kernel")
        .arg(&image.vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        // `no_timer_check`: on a loaded host the emulated CPU can miss the
        // IO-APIC timer check at boot, and the guest then hangs before
        // userspace (seen as its last console line, "8254 timer not
        // connected to IO-APIC"). `mitigations=off`: a throwaway guest
        // has nothing to guard, and its speculation barriers made every
        // scenario about a quarter slower under TCG.
        .arg(format!("console=ttyS0 panic=-1 quiet no_timer_check mitigations=off {cmdline}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// Boots the kernel into `guest.sh`; the console's lines (also in
/// `console.log`).
pub(super) fn boot(
    image: &Image,
    initrd: &Path,
    dir: &Path,
    accel: Accel,
) -> anyhow::Result<Vec<String>> {
    // The workspace: the guest keeps it visible where a tmpfs covers its
    // host path (a checkout under /tmp).
    let workspace = std::env::current_dir()?.canonicalize()?;
    let cmdline = format!(
        "vmtest.run={} vmtest.dir={} vmtest.modules={} vmtest.ws={}",
        dir.join("guest.sh").display(),
        dir.display(),
        image.root.display(),
        workspace.display()
    );
    let mut qemu = qemu(image, initrd, accel, &cmdline);
    qemu.args([
        "-virtfs",
        "local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap",
    ]);
    let mut log = std::fs::File::create(dir.join("console.log"))?;
    watch(&mut qemu, RUN_TIMEOUT, &mut log)
}

/// Runs qemu until it exits (or `timeout`, then kills it); its console
/// lines, written to `log` as they come, progress lines also to stderr.
fn watch(
    qemu: &mut Command,
    timeout: Duration,
    log: &mut dyn std::io::Write,
) -> anyhow::Result<Vec<String>> {
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    let stdout = child.stdout.take().context("qemu's console")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut lines = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_string();
                writeln!(log, "{line}")?;
                if line.starts_with("VMTEST-RESULT")
                    || line.starts_with("VMTEST-AUTO")
                    || line.starts_with("VMTEST-ERROR")
                {
                    eprintln!("  {line}");
                }
                lines.push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                eprintln!(
                    "vmtest: the guest did not finish in {} s; stopping it",
                    timeout.as_secs()
                );
                let _ = child.kill();
                break;
            }
        }
    }
    let _ = child.wait();
    Ok(lines)
}
