//! The lab: a node network namespace running `proxy-agent`, pod namespaces
//! joined to it by veth pairs, and a test cgroup for clients under socket LB.
//!
//! Pods get /32 addresses routed through the node, as real CNIs do: the pod's
//! default route goes via the link-local gateway 169.254.1.1 on the node side
//! of its veth, so every pod-to-pod packet crosses the node's IP layer. The
//! node namespace has no default route: an address nobody serves is
//! unreachable, never sent off the machine.
//!
//! Everything a lab creates is named `pxl-<pid>-<n>-…` and removed when the
//! `Lab` drops, also when a test panics; labs left by a killed run are swept
//! by name when the next lab starts.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

const GATEWAY: &str = "169.254.1.1";
const PREFIX: &str = "pxl-";
const CGROUP2: &str = "/sys/fs/cgroup/unified";
const BPFFS: &str = "/sys/fs/bpf";

static NEXT: AtomicUsize = AtomicUsize::new(0);

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

fn ip(args: &[&str]) -> anyhow::Result<String> {
    sh("ip", args)
}

fn cgroup2_root() -> PathBuf {
    // The development machines have a hybrid hierarchy; a pure v2 host has
    // it at /sys/fs/cgroup.
    if Path::new(CGROUP2).join("cgroup.procs").exists() {
        PathBuf::from(CGROUP2)
    } else {
        PathBuf::from("/sys/fs/cgroup")
    }
}

/// A pod: its namespace and address.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub netns: String,
    pub ip: String,
}

/// One parsed client line.
#[derive(Clone, Debug, PartialEq)]
pub enum Attempt {
    /// `from` is the peer (TCP, getpeername) or reply source (UDP, recvmsg);
    /// `name`, `local`, `peer` are what the server saw.
    Ok {
        ms: f64,
        from: String,
        name: String,
        local: String,
        peer: String,
    },
    Err {
        ms: f64,
        kind: String,
    },
}

impl Attempt {
    fn parse(line: &str) -> Option<Self> {
        let field = |key: &str| {
            line.split_whitespace().find_map(|w| w.strip_prefix(key)).map(str::to_string)
        };
        let ms = field("ms=")?.parse().ok()?;
        if line.starts_with("ok ") {
            Some(Attempt::Ok {
                ms,
                from: field("from=")?,
                name: field("name=")?,
                local: field("local=")?,
                peer: field("peer=")?,
            })
        } else {
            Some(Attempt::Err { ms, kind: field("kind=")? })
        }
    }

    /// The answering pod's name, for successful attempts.
    pub fn pod(&self) -> Option<&str> {
        match self {
            Attempt::Ok { name, .. } => Some(name),
            Attempt::Err { .. } => None,
        }
    }
}

pub struct Lab {
    id: String,
    pub node: String,
    pub cgroup: PathBuf,
    pub pins: PathBuf,
    pub dir: PathBuf,
    netns: Vec<String>,
    children: Vec<Child>,
    agent: Option<Child>,
    pods: usize,
}

impl Lab {
    /// A node namespace, a test cgroup, a pin directory and a scratch dir.
    pub fn new() -> anyhow::Result<Self> {
        if unsafe { libc::geteuid() } != 0 {
            bail!("the lab needs root (network namespaces, cgroups, BPF)");
        }
        sweep_stale();
        let id = format!("{PREFIX}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut lab = Lab {
            node: format!("{id}-node"),
            cgroup: cgroup2_root().join(&id),
            pins: Path::new(BPFFS).join(&id),
            dir: std::env::temp_dir().join(&id),
            id,
            netns: Vec::new(),
            children: Vec::new(),
            agent: None,
            pods: 0,
        };
        let node = lab.node.clone();
        lab.add_netns(&node)?;
        ip(&["-n", &node, "link", "set", "lo", "up"])?;
        sysctl(&node, "net.ipv4.ip_forward", "1")?;
        std::fs::create_dir_all(&lab.cgroup).context("creating the test cgroup")?;
        std::fs::create_dir_all(&lab.dir)?;
        Ok(lab)
    }

    fn add_netns(&mut self, name: &str) -> anyhow::Result<()> {
        ip(&["netns", "add", name])?;
        self.netns.push(name.to_string());
        Ok(())
    }

    /// A pod namespace with a veth to the node and a /32 route each way.
    pub fn add_pod(&mut self, name: &str, pod_ip: &str) -> anyhow::Result<Pod> {
        let netns = format!("{}-{name}", self.id);
        self.add_netns(&netns)?;
        self.pods += 1;
        let host_if = format!("veth{}", self.pods);
        ip(&[
            "-n", &self.node, "link", "add", &host_if, "type", "veth", "peer", "name", "eth0",
            "netns", &netns,
        ])?;
        ip(&["-n", &self.node, "addr", "add", &format!("{GATEWAY}/32"), "dev", &host_if])?;
        ip(&["-n", &self.node, "link", "set", &host_if, "up"])?;
        ip(&["-n", &self.node, "route", "add", &format!("{pod_ip}/32"), "dev", &host_if])?;
        ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        ip(&["-n", &netns, "addr", "add", &format!("{pod_ip}/32"), "dev", "eth0"])?;
        ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &netns, "route", "add", GATEWAY, "dev", "eth0", "scope", "link"])?;
        ip(&["-n", &netns, "route", "add", "default", "via", GATEWAY, "dev", "eth0"])?;
        wait_link_up(&netns, "eth0")?;
        wait_link_up(&self.node, &host_if)?;
        Ok(Pod { name: name.to_string(), netns, ip: pod_ip.to_string() })
    }

    /// Starts a server in `pod` answering on the given ports; returns once it
    /// listens.
    pub fn serve(&mut self, pod: &Pod, tcp: &[u16], udp: &[u16]) -> anyhow::Result<()> {
        let mut cmd = Command::new(target_bin("labpod"));
        cmd.args(["--netns", &pod.netns, "serve", "--name", &pod.name]);
        for port in tcp {
            cmd.args(["--tcp", &port.to_string()]);
        }
        for port in udp {
            cmd.args(["--udp", &port.to_string()]);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn()?;
        let stdout = child.stdout.take().context("server stdout")?;
        self.children.push(child);
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            bail!("server in {} did not start", pod.name);
        }
        Ok(())
    }

    /// Writes the manifest file the agent watches, atomically.
    pub fn write_manifest(&self, yaml: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.join("manifests.yaml");
        let tmp = self.dir.join(".manifests.yaml.tmp");
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// Starts `proxy-agent run` in the node namespace on the lab's manifest,
    /// cgroup and pins; returns once its programs are attached.
    pub fn start_agent(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.dir.join("agent.log"))?;
        let manifest = self.dir.join("manifests.yaml");
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.node))
            .arg(target_bin("proxy-agent"))
            .arg("run")
            .arg("--manifests")
            .arg(&manifest)
            .arg("--cgroup-path")
            .arg(&self.cgroup)
            .arg("--bpffs-root")
            .arg(&self.pins)
            .args(["--hostname-override", "lab-node"])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let attached = self.pins.join("links").join("getpeername4");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !attached.exists() {
            if let Some(status) = child.try_wait()? {
                bail!("proxy-agent exited ({status}):\n{}", self.agent_log());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("proxy-agent did not attach in time:\n{}", self.agent_log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.agent = Some(child);
        Ok(())
    }

    /// Kills the agent without letting it clean up, as a crash would.
    pub fn kill_agent(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.kill();
            let _ = agent.wait();
        }
    }

    /// Whether the agent is still running.
    pub fn agent_alive(&mut self) -> bool {
        self.agent.as_mut().is_some_and(|a| matches!(a.try_wait(), Ok(None)))
    }

    /// Runs a labpod client in `pod`, inside the test cgroup (socket LB).
    pub fn client(&self, pod: &Pod, args: &[&str]) -> anyhow::Result<Vec<Attempt>> {
        let out = self.labpod(&pod.netns, true, args)?;
        Ok(out.lines().filter_map(Attempt::parse).collect())
    }

    /// Runs labpod in a namespace, optionally in the test cgroup; its stdout.
    pub fn labpod(&self, netns: &str, in_cgroup: bool, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new(target_bin("labpod"));
        cmd.args(["--netns", netns]);
        if in_cgroup {
            cmd.arg("--cgroup").arg(&self.cgroup);
        }
        let Output { status, stdout, stderr } = cmd.args(args).output()?;
        if !status.success() {
            bail!("labpod {args:?}: {}", String::from_utf8_lossy(&stderr));
        }
        Ok(String::from_utf8_lossy(&stdout).into_owned())
    }

    /// The agent's /metrics, fetched inside the node namespace.
    pub fn metrics(&self) -> anyhow::Result<String> {
        self.labpod(&self.node, false, &["http", "127.0.0.1:10249", "/metrics"])
    }

    /// Sum over CPUs of one datapath counter, read from the pinned map.
    pub fn counter(&self, counter: proxy_common::Counter) -> anyhow::Result<u64> {
        let map = self.pins.join("maps").join("COUNTERS");
        let index = (counter as u32).to_string();
        let out = sh(
            "bpftool",
            &[
                "-j",
                "map",
                "lookup",
                "pinned",
                &map.to_string_lossy(),
                "key",
                &index,
                "0",
                "0",
                "0",
            ],
        )?;
        let json: serde_json::Value = serde_json::from_str(&out)?;
        let values = json["formatted"]["values"].as_array().context("per-CPU values")?;
        Ok(values.iter().filter_map(|v| v["value"].as_u64()).sum())
    }

    /// `bpftool map dump` of one pinned map.
    pub fn dump_map(&self, name: &str) -> anyhow::Result<String> {
        sh(
            "bpftool",
            &["map", "dump", "pinned", &self.pins.join("maps").join(name).to_string_lossy()],
        )
    }

    fn teardown(&mut self) {
        for child in self.children.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(mut agent) = self.agent.take() {
            // SIGTERM: the agent's clean stop path.
            unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
            let _ = agent.wait();
        }
        if self.pins.exists() {
            let _ = Command::new(target_bin("proxy-agent"))
                .args(["cleanup", "--bpffs-root"])
                .arg(&self.pins)
                .stderr(Stdio::null())
                .status();
            let _ = std::fs::remove_dir_all(&self.pins);
        }
        for netns in self.netns.drain(..) {
            let _ = ip(&["netns", "del", &netns]);
        }
        remove_cgroup(&self.cgroup);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn sysctl(netns: &str, key: &str, value: &str) -> anyhow::Result<()> {
    sh("ip", &["netns", "exec", netns, "sysctl", "-qw", &format!("{key}={value}")]).map(drop)
}

fn wait_link_up(netns: &str, dev: &str) -> anyhow::Result<()> {
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
fn remove_cgroup(cgroup: &Path) {
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
fn owner_pid(name: &str) -> Option<i32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Removes namespaces, cgroups and pins of labs whose process is gone.
fn sweep_stale() {
    let dead = |name: &str| {
        owner_pid(name).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    };
    if let Ok(list) = ip(&["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if dead(name) {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }
    for dir in [cgroup2_root(), PathBuf::from(BPFFS)] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if dead(&name) {
                if dir == Path::new(BPFFS) {
                    let _ = std::fs::remove_dir_all(entry.path());
                } else {
                    remove_cgroup(&entry.path());
                }
            }
        }
    }
}

/// How many attempts each pod answered.
pub fn tally(attempts: &[Attempt]) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for pod in attempts.iter().filter_map(Attempt::pod) {
        *counts.entry(pod.to_string()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_lines_parse() {
        let ok = Attempt::parse(
            "ok ms=0.412 from=10.96.0.10:80 name=web-0 local=10.244.1.2:8080 peer=10.244.1.10:4242",
        );
        assert_eq!(ok.as_ref().and_then(|a| a.pod()), Some("web-0"));
        let err = Attempt::parse("err ms=0.101 kind=ConnectionRefused");
        assert_eq!(err, Some(Attempt::Err { ms: 0.101, kind: "ConnectionRefused".into() }));
    }

    #[test]
    fn stale_names_carry_their_owner() {
        assert_eq!(owner_pid("pxl-4242-3-node"), Some(4242));
        assert_eq!(owner_pid("proxy"), None);
    }
}
