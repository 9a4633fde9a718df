//! What the lab does on the host: commands, namespaces' links and sysctls,
//! cgroups, its bpffs, stopping processes, and sweeping labs a killed run
//! left behind.

use std::{
    io::Write,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::{BPFFS_DIR, PREFIX};

const CGROUP2: &str = "/sys/fs/cgroup/unified";

/// Runs a command, failing with its output when it fails.
pub fn sh(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out =
        Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn ip(args: &[&str]) -> anyhow::Result<String> {
    sh("ip", args)
}

/// `ip` commands in one namespace, run in order by one `ip -batch` process
/// that stops at the first failure: a process costs about 0.1 s under the
/// VM matrix's emulated CPU, and a pod's plumbing is a dozen commands.
pub(crate) struct IpBatch {
    netns: String,
    lines: String,
}

impl IpBatch {
    pub(crate) fn new(netns: &str) -> Self {
        Self { netns: netns.to_string(), lines: String::new() }
    }

    /// One command: `ip`'s object and arguments, no options (a batch line
    /// takes none; an address says its family) and no spaces in one.
    pub(crate) fn add(&mut self, args: &[&str]) -> &mut Self {
        self.lines.push_str(&args.join(" "));
        self.lines.push('\n');
        self
    }

    pub(crate) fn run(&self) -> anyhow::Result<()> {
        let mut child = Command::new("ip")
            .args(["-n", &self.netns, "-batch", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("running ip -batch")?;
        let mut stdin = child.stdin.take().context("ip's stdin")?;
        stdin.write_all(self.lines.as_bytes())?;
        drop(stdin);
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "ip -n {} -batch:\n{}{}",
                self.netns,
                self.lines,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

/// Deletes a named network namespace as `ip netns del` does (its mount
/// goes, and the namespace with its last user), without a process.
pub(crate) fn delete_netns(name: &str) {
    let path = Path::new("/run/netns").join(name);
    if let Ok(target) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) {
        // SAFETY: a valid path; failure (not mounted) is fine.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_file(path);
}

pub(crate) fn cgroup2_root() -> PathBuf {
    // The development machines have a hybrid hierarchy; a pure v2 host has
    // it at /sys/fs/cgroup.
    if Path::new(CGROUP2).join("cgroup.procs").exists() {
        PathBuf::from(CGROUP2)
    } else {
        PathBuf::from("/sys/fs/cgroup")
    }
}

/// Signals an agent's process group (it and the tools it runs), and kills
/// it after 5 s if it has not stopped.
pub(crate) fn stop(agent: &mut Child, signal: i32) {
    let group = -(agent.id() as i32);
    // SAFETY: signals to a process group this lab created.
    unsafe { libc::kill(group, signal) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while matches!(agent.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: as above; the group may be gone already.
    unsafe { libc::kill(group, libc::SIGKILL) };
    let _ = agent.wait();
}

/// The command (for an [`IpBatch`] in the namespace that makes it) adding
/// a veth pair: `name` there (with `options`, e.g. its MTU), its peer
/// `eth0` in `peer_netns`.
pub(crate) fn veth_to_eth0<'a>(
    name: &'a str,
    options: &[&'a str],
    peer_netns: &'a str,
) -> Vec<&'a str> {
    let peer = ["type", "veth", "peer", "name", "eth0", "netns", peer_netns];
    [&["link", "add", name][..], options, &peer[..]].concat()
}

/// Sets a sysctl of `netns` from a thread of ours that enters it: a
/// thread's `/proc/sys/net` is its namespace's, and no process is started
/// (`ip netns exec … sysctl` is two, each about 0.1 s under the VM
/// matrix's emulated CPU).
pub(crate) fn sysctl(netns: &str, key: &str, value: &str) -> anyhow::Result<()> {
    let ns = std::fs::File::open(Path::new("/run/netns").join(netns))
        .with_context(|| format!("opening namespace {netns}"))?;
    let path = Path::new("/proc/sys").join(key.replace('.', "/"));
    let write = || -> anyhow::Result<()> {
        // SAFETY: a valid namespace descriptor; only this thread moves,
        // and it ends with the write.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("entering {netns}: {}", std::io::Error::last_os_error());
        }
        std::fs::write(&path, value).with_context(|| format!("{key}={value} in {netns}"))
    };
    std::thread::scope(|s| s.spawn(write).join())
        .unwrap_or_else(|_| bail!("setting {key} in {netns}: the thread panicked"))
}

pub(crate) fn wait_link_up(netns: &str, dev: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = ip(&["-n", netns, "-o", "link", "show", dev])?;
        if out.contains("LOWER_UP") && !out.contains("NO-CARRIER") {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{dev} in {netns} did not come up: {out}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kills what is left in a cgroup and removes it.
pub(crate) fn remove_cgroup(cgroup: &Path) {
    for _ in 0..50 {
        if !cgroup.exists() || std::fs::remove_dir(cgroup).is_ok() {
            return;
        }
        if let Ok(procs) = std::fs::read_to_string(cgroup.join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pid in a `pxl-<pid>-…` name.
pub(crate) fn owner_pid(name: &str) -> Option<i32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Removes namespaces, cgroups and pins of labs whose process is gone.
pub(crate) fn sweep_stale() {
    let dead = |name: &str| {
        owner_pid(name).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    };
    if let Ok(list) = ip(&["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if dead(name) {
                delete_netns(name);
            }
        }
    }
    let scratch = std::env::temp_dir();
    for dir in [cgroup2_root(), scratch.clone()] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if dead(&name) {
                if dir == scratch {
                    remove_scratch(&entry.path());
                } else {
                    remove_cgroup(&entry.path());
                }
            }
        }
    }
}

/// A bpffs of the lab's own.
/// Verdicts of the lab's own XDP programs.
pub(crate) const XDP_DROP: u8 = 1;
pub(crate) const XDP_PASS: u8 = 2;

/// Loads an XDP program that returns `verdict` for every frame
/// (`r0 = verdict; exit`) and pins it at `pin`.
pub(crate) fn pin_xdp_verdict(verdict: u8, pin: &Path) -> anyhow::Result<()> {
    const BPF_OBJ_PIN: libc::c_long = 6;
    let fd = load_xdp(&[[0xb7, 0, 0, 0, verdict, 0, 0, 0], [0x95, 0, 0, 0, 0, 0, 0, 0]])
        .with_context(|| format!("loading an XDP program returning {verdict}"))?;
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())?;
    // BPF_OBJ_PIN: path, descriptor.
    let mut attr = [0u8; 128];
    attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(fd.as_raw_fd() as u32).to_ne_bytes());
    // SAFETY: an attr the size given, pointing at live buffers.
    if unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, attr.as_ptr(), attr.len()) } < 0 {
        bail!("pinning it at {}: {}", pin.display(), std::io::Error::last_os_error());
    }
    Ok(())
}

/// Loads an XDP program of raw instructions through `bpf(2)` itself: the
/// lab's own few-instruction programs need no object file or loader.
pub fn load_xdp(insns: &[[u8; 8]]) -> anyhow::Result<OwnedFd> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    let license = c"GPL";
    // `union bpf_attr` for BPF_PROG_LOAD: type, count, instructions, license.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
    attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // SAFETY: an attr the size given, pointing at live buffers.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_ptr(), attr.len()) };
    if fd < 0 {
        bail!("BPF_PROG_LOAD: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor just returned, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub(crate) fn mount_bpffs(at: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(at)?;
    let target = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())?;
    // SAFETY: static NUL-terminated strings and a valid target path.
    let rc = unsafe {
        libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null())
    };
    if rc != 0 {
        bail!("mounting bpffs at {}: {}", at.display(), std::io::Error::last_os_error());
    }
    Ok(())
}

/// Unmounts the lab's bpffs (dropping whatever is still pinned there) and
/// removes its scratch dir.
pub(crate) fn remove_scratch(dir: &Path) {
    if let Ok(target) = std::ffi::CString::new(dir.join(BPFFS_DIR).as_os_str().as_encoded_bytes()) {
        // SAFETY: a valid path; failure (not mounted) is fine.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_names_carry_their_owner() {
        assert_eq!(owner_pid("pxl-4242-3-node"), Some(4242));
        assert_eq!(owner_pid("proxy"), None);
    }
}
