//! A node and what can be read from it: its rules, its pinned maps and
//! counters, its metrics, and the agent's inspection commands.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::{Lab, Mode, host::sh, target_bin};

/// One node: its namespace, address, test cgroup, pins and agent.
pub struct Node {
    pub netns: String,
    /// Its address on the fabric, 192.168.100.(11 + index).
    pub ip: String,
    /// Its IPv6 address on the fabric in a dual-stack lab, fd00:100::(11 + index).
    pub ip6: Option<String>,
    /// Its pod CIDR, 10.244.(1 + index).0/24, routed to it from the others.
    pub pod_cidr: String,
    /// The name EndpointSlices use for it (`nodeName`).
    pub name: String,
    pub cgroup: PathBuf,
    pub pins: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) agent: Option<Child>,
    /// The agent binary, when not this workspace's `proxy-agent`.
    pub(crate) agent_bin: Option<PathBuf>,
    /// The umask agents start with, when not the test's.
    pub(crate) agent_umask: Option<libc::mode_t>,
    /// A directory the agent looks for the programs it runs in before
    /// `PATH` (another `nft`).
    pub(crate) agent_path: Option<PathBuf>,
    /// Whether the agent is told its address (`--node-ip`), or finds it.
    pub(crate) pass_node_ip: bool,
    pub(crate) veths: usize,
}

impl Node {
    /// Its addresses as `--node-ip` takes them: IPv4, and IPv6 in a
    /// dual-stack lab.
    pub(crate) fn node_ips(&self) -> String {
        match &self.ip6 {
            Some(ip6) => format!("{},{ip6}", self.ip),
            None => self.ip.clone(),
        }
    }

    /// `proxy-agent cleanup` in this node's namespace: its pins, filters
    /// and iptables rules (never the host's).
    pub(crate) fn cleanup(&self) -> anyhow::Result<String> {
        let agent = target_bin("proxy-agent");
        let netns = format!("--net=/run/netns/{}", self.netns);
        let pins = self.pins.to_string_lossy();
        let out = Command::new("nsenter")
            .args([netns.as_str()])
            .arg(&agent)
            .args(["cleanup", "--bpffs-root", &pins])
            .output()?;
        if !out.status.success() {
            bail!("cleanup failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

impl Lab {
    /// `proxy-agent cleanup` in a node's namespace, on its pins.
    pub fn cleanup_on(&self, node: usize) -> anyhow::Result<String> {
        self.nodes[node].cleanup()
    }

    /// Runs a command in a node's namespace.
    pub fn exec_on(&self, node: usize, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["netns", "exec", &self.nodes[node].netns, program];
        full.extend(args);
        sh("ip", &full)
    }

    /// `iptables-save` in a node's namespace.
    pub fn iptables_save_on(&self, node: usize) -> anyhow::Result<String> {
        sh("ip", &["netns", "exec", &self.nodes[node].netns, "iptables-save"])
    }

    /// Packets that matched the rules of a table whose line contains
    /// `needle` (in `iptables-save -c` form), in a node's namespace: of
    /// both families' rules in a dual-stack lab.
    pub fn rule_packets_on(&self, node: usize, table: &str, needle: &str) -> anyhow::Result<u64> {
        let families: &[&str] =
            if self.ipv6 { &["iptables-save", "ip6tables-save"] } else { &["iptables-save"] };
        let mut packets = 0;
        for program in families {
            let saved = self.exec_on(node, program, &["-c", "-t", table])?;
            packets += saved
                .lines()
                .filter(|line| line.contains(needle))
                .filter_map(|line| line.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
                .sum::<u64>();
        }
        Ok(packets)
    }

    /// Conntrack entries in a node's namespace that `conntrack -L <args>`
    /// lists (of both families in a dual-stack lab): the nftables mode's
    /// rules count nothing, the flows they translated are in conntrack.
    pub fn flows_on(&self, node: usize, args: &[&str]) -> anyhow::Result<u64> {
        let families: &[&str] = if self.ipv6 { &["ipv4", "ipv6"] } else { &["ipv4"] };
        let mut flows = 0;
        for family in families {
            let mut words = vec!["-L", "-f", family];
            words.extend(args);
            flows += self.exec_on(node, "conntrack", &words)?.lines().count() as u64;
        }
        Ok(flows)
    }

    /// How many of the nftables mode's affinity sets hold `client` (an
    /// IPv4 address) in a node's namespace.
    pub fn affinity_sets_holding(&self, node: usize, client: &str) -> anyhow::Result<u64> {
        let sets = self.exec_on(node, "nft", &["list", "sets", "ip"])?;
        let mut holding = 0;
        let mut affinity = false;
        for line in sets.lines().map(str::trim) {
            if line.starts_with("set ") {
                affinity = line.starts_with("set affinity-");
            }
            let mut listed = line.split([' ', ',', '{', '}']);
            if affinity && line.starts_with("elements") && listed.any(|w| w == client) {
                holding += 1;
            }
        }
        Ok(holding)
    }

    /// What a node's datapath counted: the eBPF counter, or in iptables mode
    /// the packets of the rules that do the same thing (refusals, drops for
    /// want of a local endpoint, affinity hits).
    pub fn count_on(&self, node: usize, counter: proxy_common::Counter) -> anyhow::Result<u64> {
        use proxy_common::Counter::*;
        match self.mode {
            Mode::Ebpf => return self.counter_on(node, counter),
            Mode::Nftables => bail!("the nftables mode counts nothing ({counter:?})"),
            Mode::Iptables => {}
        }
        let (table, rules) = match counter {
            NoBackend | Rejected => ("filter", "has no endpoints\""),
            Dropped => ("filter", "has no local endpoints\""),
            AffinityHit => ("nat", "--rcheck"),
            other => bail!("{other:?} has no iptables counterpart"),
        };
        self.rule_packets_on(node, table, rules)
    }

    pub fn counter(&self, counter: proxy_common::Counter) -> anyhow::Result<u64> {
        self.counter_on(0, counter)
    }

    /// Sum over CPUs of one datapath counter of a node, from its pinned map.
    pub fn counter_on(&self, node: usize, counter: proxy_common::Counter) -> anyhow::Result<u64> {
        let map = self.nodes[node].pins.join("maps").join("COUNTERS");
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

    /// `proxy-agent <args> --bpffs-root <its pins>` in a node's namespace:
    /// the inspection commands (`lb list`, …) as an operator runs them.
    pub fn inspect_on(&self, node: usize, args: &[&str]) -> anyhow::Result<String> {
        let agent = target_bin("proxy-agent");
        let pins = self.nodes[node].pins.to_string_lossy().into_owned();
        let args: Vec<&str> = args.iter().copied().chain(["--bpffs-root", &pins]).collect();
        self.exec_on(node, &agent.to_string_lossy(), &args)
    }

    /// As `inspect_on`, for a command that streams (`monitor`): started in
    /// the node's namespace and left running (stopped at teardown); its
    /// output, a line at a time.
    pub fn spawn_inspect_on(
        &mut self,
        node: usize,
        args: &[&str],
    ) -> anyhow::Result<std::io::Lines<BufReader<std::process::ChildStdout>>> {
        let pins = self.nodes[node].pins.to_string_lossy().into_owned();
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.nodes[node].netns))
            .arg(target_bin("proxy-agent"))
            .args(args)
            .args(["--bpffs-root", &pins])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting proxy-agent")?;
        let stdout = child.stdout.take().context("its stdout")?;
        self.children.push(child);
        Ok(BufReader::new(stdout).lines())
    }

    /// The entries a pinned map of node 0 holds at most (`bpftool map show`).
    pub fn map_capacity(&self, name: &str) -> anyhow::Result<u64> {
        let path = self.nodes[0].pins.join("maps").join(name);
        let out = sh("bpftool", &["-j", "map", "show", "pinned", &path.to_string_lossy()])?;
        let json: serde_json::Value = serde_json::from_str(&out)?;
        json["max_entries"].as_u64().context("max_entries")
    }

    pub fn dump_map(&self, name: &str) -> anyhow::Result<String> {
        self.dump_map_on(0, name)
    }

    /// `bpftool map dump` of one pinned map of a node.
    pub fn dump_map_on(&self, node: usize, name: &str) -> anyhow::Result<String> {
        let path = self.nodes[node].pins.join("maps").join(name);
        sh("bpftool", &["map", "dump", "pinned", &path.to_string_lossy()])
    }

    /// Node 0's agent's /metrics, fetched inside the node namespace.
    pub fn metrics(&self) -> anyhow::Result<String> {
        self.client_in(&self.node, None).http_body("127.0.0.1:10249", "/metrics")
    }

    /// Node 0's /metrics once the series `name{labels}` reaches `at_least`
    /// (the iptables mode reads its rules' counters at most every few
    /// seconds), or as they are after 15 s.
    pub fn metrics_reaching(
        &self,
        name: &str,
        labels: &str,
        at_least: u64,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let metrics = self.metrics()?;
            if sample(&metrics, name, labels) >= at_least || Instant::now() > deadline {
                return Ok(metrics);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// The value of the series `name{labels}` in /metrics text (the labels
/// as the agent writes them, in order), 0 when absent.
pub fn sample(metrics: &str, name: &str, labels: &str) -> u64 {
    let prefix = format!("{name}{{{labels}}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap_or_else(|_| panic!("{prefix}{v}")))
}
