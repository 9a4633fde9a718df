//! The agents: their manifests, starting, stopping and killing them, and
//! their logs.

use std::{
    os::unix::process::CommandExt as _,
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::{Lab, Mode, host::stop, scaled, target_bin};
use std::process::Child;

/// What the agent logs once its datapath serves the manifests.
const SERVING: &str = "datapath ready; serving";

impl Lab {
    /// Writes the manifest file the agents watch, atomically; with the API
    /// server as the source, makes its Services and EndpointSlices those of
    /// the manifest too.
    pub fn write_manifest(&self, yaml: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.join("manifests.yaml");
        let tmp = self.dir.join(".manifests.yaml.tmp");
        std::fs::write(&tmp, yaml)?;
        std::fs::rename(&tmp, &path)?;
        if let Some(api) = &self.api {
            api.replace_services(yaml)?;
        }
        Ok(path)
    }

    /// Agents started from now on read a directory of manifest files
    /// (`manifests.d` in the scratch dir), which is returned; write them
    /// with [`Lab::write_manifest_file`].
    pub fn use_manifest_dir(&mut self) -> anyhow::Result<PathBuf> {
        self.manifests = self.dir.join("manifests.d");
        std::fs::create_dir_all(&self.manifests)?;
        Ok(self.manifests.clone())
    }

    /// Writes one file of the manifest directory atomically (any bytes:
    /// tests feed the agent garbage too).
    pub fn write_manifest_file(&self, name: &str, contents: &[u8]) -> anyhow::Result<PathBuf> {
        let path = self.manifests.join(name);
        // Hidden: the agent does not read it while it is being written.
        let tmp = self.manifests.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, contents)?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    pub fn agent_log(&self) -> String {
        self.agent_log_on(0)
    }

    pub fn agent_log_on(&self, node: usize) -> String {
        std::fs::read_to_string(&self.nodes[node].log).unwrap_or_default()
    }

    pub fn start_agent(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        self.start_agent_on(0, extra)
    }

    /// Starts `proxy-agent run` in a node's namespace on the lab's manifest,
    /// the node's cgroup, pins and address, in the lab's mode; returns once
    /// its datapath serves.
    pub fn start_agent_on(&mut self, node: usize, extra: &[&str]) -> anyhow::Result<()> {
        // Generous: under an emulated CPU (`cargo xtask vmtest`) each of the
        // iptables commands of a first sync takes a second or more.
        self.start_agent_within(node, extra, Duration::from_secs(60))
    }

    /// As `start_agent_on`, allowing `timeout` for the first sync (a large
    /// ruleset takes a while).
    pub fn start_agent_within(
        &mut self,
        node: usize,
        extra: &[&str],
        timeout: Duration,
    ) -> anyhow::Result<()> {
        // The log is appended to across restarts: wait for one more line.
        let attached_before = self.agent_log_on(node).matches(SERVING).count();
        self.spawn_agent_on(node, extra)?;
        let deadline = Instant::now() + scaled(timeout);
        while self.agent_log_on(node).matches(SERVING).count() == attached_before {
            let agent = self.nodes[node].agent.as_mut().context("agent")?;
            if let Some(status) = agent.try_wait()? {
                self.nodes[node].agent = None;
                bail!("proxy-agent exited ({status}):\n{}", self.agent_log_on(node));
            }
            if Instant::now() > deadline {
                self.kill_agent_on(node);
                bail!("proxy-agent did not serve in time:\n{}", self.agent_log_on(node));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Starts `proxy-agent run` on a node without waiting for it to serve;
    /// a `--proxy-mode` in `extra` overrides the lab's.
    pub fn spawn_agent_on(&mut self, node: usize, extra: &[&str]) -> anyhow::Result<()> {
        let source = match &self.api {
            Some(_) => ["--kubeconfig".into(), self.dir.join("kubeconfig")],
            None => ["--manifests".into(), self.manifests.clone()],
        };
        let mode = ["--proxy-mode", self.mode.as_arg()];
        let mode: &[&str] = if extra.contains(&"--proxy-mode") { &[] } else { &mode };
        let asked = extra.contains(&"--bpf-lb-acceleration");
        let xdp: &[&str] = if self.xdp && self.mode == Mode::Ebpf && !mode.is_empty() && !asked {
            &["--bpf-lb-acceleration", "native"]
        } else {
            &[]
        };
        let host = &mut self.nodes[node];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&host.log)?;
        let agent = host.agent_bin.clone().unwrap_or_else(|| target_bin("proxy-agent"));
        let mut command = Command::new("nsenter");
        if let Some(mask) = host.agent_umask {
            // SAFETY: umask is async-signal-safe and touches no memory.
            unsafe {
                command.pre_exec(move || {
                    libc::umask(mask);
                    Ok(())
                });
            }
        }
        if let Some(dir) = &host.agent_path {
            let path = std::env::var_os("PATH").unwrap_or_default();
            let paths = std::iter::once(dir.clone()).chain(std::env::split_paths(&path));
            command.env("PATH", std::env::join_paths(paths)?);
        }
        let child = command
            .arg(format!("--net=/run/netns/{}", host.netns))
            .arg(agent)
            .arg("run")
            .args(&source)
            .arg("--cgroup-path")
            .arg(&host.cgroup)
            .arg("--bpffs-root")
            .arg(&host.pins)
            .args(["--hostname-override", &host.name])
            .args(if host.pass_node_ip {
                vec!["--node-ip".into(), host.node_ips()]
            } else {
                vec![]
            })
            .args(mode)
            .args(xdp)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own process group: stopping it stops what it runs too.
            .process_group(0)
            .spawn()?;
        host.agent = Some(child);
        Ok(())
    }

    /// Agents started on `node` from now on run `binary` (another build of
    /// the agent, for upgrades), or this workspace's with `None`.
    pub fn set_agent_binary(&mut self, node: usize, binary: Option<PathBuf>) {
        self.nodes[node].agent_bin = binary;
    }

    /// Agents started on `node` from now on look for the programs they run
    /// (`nft`, …) in `dir` first, or only in `PATH` with `None`.
    pub fn set_agent_path(&mut self, node: usize, dir: Option<PathBuf>) {
        self.nodes[node].agent_path = dir;
    }

    /// Agents started on `node` from now on start with this umask (the
    /// test's with `None`).
    pub fn set_agent_umask(&mut self, node: usize, umask: Option<libc::mode_t>) {
        self.nodes[node].agent_umask = umask;
    }

    /// Lets a node's agent find its addresses itself instead of being given
    /// them with `--node-ip`.
    pub fn omit_node_ip(&mut self, node: usize) {
        self.nodes[node].pass_node_ip = false;
    }

    /// The pid of a node's agent, while it runs.
    pub fn agent_pid_on(&self, node: usize) -> Option<u32> {
        self.nodes[node].agent.as_ref().map(Child::id)
    }

    /// Whether node 0's agent is still running.
    pub fn agent_alive(&mut self) -> bool {
        self.nodes[0].agent.as_mut().is_some_and(|a| matches!(a.try_wait(), Ok(None)))
    }

    /// Stops a node's agent as an orchestrator does (SIGTERM).
    pub fn stop_agent_on(&mut self, node: usize) {
        if let Some(mut agent) = self.nodes[node].agent.take() {
            stop(&mut agent, libc::SIGTERM);
        }
    }

    /// Kills node 0's agent without letting it clean up, as a crash would.
    pub fn kill_agent(&mut self) {
        self.kill_agent_on(0)
    }

    pub fn kill_agent_on(&mut self, node: usize) {
        if let Some(mut agent) = self.nodes[node].agent.take() {
            stop(&mut agent, libc::SIGKILL);
        }
    }
}
