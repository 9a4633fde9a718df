//! Pods: namespaces behind a node, the servers they run, and programs run
//! in a namespace.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::{
    GATEWAY, GATEWAY6, Lab, Mode,
    host::{IpBatch, ip, sh, veth_to_eth0, wait_link_up},
    target_bin, v6,
};

/// A pod: its namespace and address.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub netns: String,
    pub ip: String,
}

impl Lab {
    /// A pod on node 0.
    pub fn add_pod(&mut self, name: &str, pod_ip: &str) -> anyhow::Result<Pod> {
        self.add_pod_on(0, name, pod_ip)
    }

    /// A pod namespace with a veth to the node and a /32 route each way.
    pub fn add_pod_on(&mut self, node: usize, name: &str, pod_ip: &str) -> anyhow::Result<Pod> {
        let netns = format!("{}-{name}", self.id);
        self.add_netns(&netns)?;
        let host = &mut self.nodes[node];
        host.veths += 1;
        let host_if = format!("veth{}", host.veths);
        let node_ns = host.netns.clone();
        // What the agent logged before the pod: it says when it took the
        // new interface in (see `wait_tc_attached`).
        let logged = self.agent_log_on(node).len();
        let (mut node_side, mut pod_side) = (IpBatch::new(&node_ns), IpBatch::new(&netns));
        node_side.add(&veth_to_eth0(&host_if, &[], &netns));
        // Link scope, as CNIs leave the gateway off the host's global
        // addresses: the node masquerades with its own address, not this.
        let gateway = format!("{GATEWAY}/32");
        node_side.add(&["addr", "add", &gateway, "dev", &host_if, "scope", "link"]);
        node_side.add(&["link", "set", &host_if, "up"]);
        node_side.add(&["route", "add", &format!("{pod_ip}/32"), "dev", &host_if]);
        pod_side.add(&["addr", "add", &format!("{pod_ip}/32"), "dev", "eth0"]);
        pod_side.add(&["link", "set", "eth0", "up"]);
        pod_side.add(&["route", "add", GATEWAY, "dev", "eth0", "scope", "link"]);
        pod_side.add(&["route", "add", "default", "via", GATEWAY, "dev", "eth0"]);
        if self.ipv6 {
            let pod_ip6 = v6(pod_ip);
            let gateway = format!("{GATEWAY6}/64");
            node_side.add(&["addr", "add", &gateway, "dev", &host_if, "nodad"]);
            let host = format!("{pod_ip6}/128");
            node_side.add(&["route", "add", &host, "dev", &host_if]);
            pod_side.add(&["addr", "add", &host, "dev", "eth0", "nodad"]);
            pod_side.add(&["route", "add", "default", "via", GATEWAY6, "dev", "eth0"]);
        }
        node_side.run()?;
        pod_side.run()?;
        wait_link_up(&netns, "eth0")?;
        wait_link_up(&node_ns, &host_if)?;
        self.wait_tc_attached(node, &host_if, logged)?;
        Ok(Pod { name: name.to_string(), netns, ip: pod_ip.to_string() })
    }

    /// Takes a pod off the network, as its deletion does: the node side of
    /// its veth goes (with its route), so nothing reaches it any more.
    pub fn unplug_pod(&self, pod: &Pod) -> anyhow::Result<()> {
        for node in &self.nodes {
            let route = ip(&["-n", &node.netns, "-o", "route", "show", &format!("{}/32", pod.ip)])?;
            let dev = route.split_whitespace().skip_while(|w| *w != "dev").nth(1);
            if let Some(dev) = dev {
                return ip(&["-n", &node.netns, "link", "del", dev]).map(drop);
            }
        }
        bail!("no node routes to {}", pod.ip)
    }

    /// With an agent running on `node`, waits until it has attached its
    /// per-packet program to the new interface (it follows netlink
    /// notifications), as a CNI would wait before starting the pod.
    /// Waits until the running eBPF agent took a new pod interface in: its
    /// program attached, or (where pod interfaces carry the replies program
    /// only while their pod backs a service) attached and already taken off
    /// again, which its log says after byte `logged`.
    fn wait_tc_attached(
        &mut self,
        node: usize,
        interface: &str,
        logged: usize,
    ) -> anyhow::Result<()> {
        let host = &mut self.nodes[node];
        let running = host.agent.as_mut().is_some_and(|a| matches!(a.try_wait(), Ok(None)));
        if !running || self.mode != Mode::Ebpf {
            return Ok(());
        }
        // A TCX link is pinned; a clsact filter (before 6.6) is not a link:
        // the kernel shows it.
        let pin = host.pins.join("links").join(format!("tc-{interface}"));
        let netns = host.netns.clone();
        let filter = || {
            sh("tc", &["-n", &netns, "filter", "show", "dev", interface, "ingress"])
                .is_ok_and(|shown| shown.contains(" bpf "))
        };
        let detached = format!("per-packet programs detached interface={interface}");
        let taken_off = |log: String| log.get(logged..).is_some_and(|new| new.contains(&detached));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !pin.exists() && !filter() && !taken_off(self.agent_log_on(node)) {
            if Instant::now() > deadline {
                bail!("the agent on {netns} did not attach to {interface}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// `n` pods `web-<i>` at 10.244.1.2, .3, … on node 0, each serving the
    /// given ports.
    pub fn add_web_pods(&mut self, n: usize, tcp: &[u16], udp: &[u16]) -> anyhow::Result<Vec<Pod>> {
        (0..n)
            .map(|i| {
                let pod = self.add_pod(&format!("web-{i}"), &format!("10.244.1.{}", 2 + i))?;
                self.serve(&pod, tcp, udp)?;
                Ok(pod)
            })
            .collect()
    }

    /// Starts a server in `pod` answering on the given ports; returns once it
    /// listens.
    pub fn serve(&mut self, pod: &Pod, tcp: &[u16], udp: &[u16]) -> anyhow::Result<()> {
        let mut args = Vec::new();
        for (flag, ports) in [("--tcp", tcp), ("--udp", udp)] {
            for port in ports {
                args.extend([flag.to_string(), port.to_string()]);
            }
        }
        self.start_server(pod, &args)
    }

    /// Starts a server in `pod` answering each line received on `port` with
    /// its answer line (long-lived connections).
    pub fn serve_echo(&mut self, pod: &Pod, port: u16) -> anyhow::Result<()> {
        self.start_server(pod, &["--echo".into(), port.to_string()])
    }

    /// Starts a server in `pod` answering SCTP associations on `port` as
    /// the TCP server answers connections (the kernel needs SCTP).
    pub fn serve_sctp(&mut self, pod: &Pod, port: u16) -> anyhow::Result<()> {
        self.start_server(pod, &["--sctp".into(), port.to_string()])
    }

    fn start_server(&mut self, pod: &Pod, args: &[String]) -> anyhow::Result<()> {
        let mut cmd = Command::new(target_bin("labpod"));
        cmd.args(["--netns", &pod.netns, "serve", "--name", &pod.name]).args(args);
        if self.ipv6 {
            cmd.arg("--dual-stack");
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

    /// Starts a long-running program in a namespace; it is killed when the
    /// lab goes. Returns its pid.
    pub fn spawn_in(&mut self, netns: &str, program: &str, args: &[&str]) -> anyhow::Result<u32> {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .arg(program)
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {program} in {netns}"))?;
        let pid = child.id();
        self.children.push(child);
        Ok(pid)
    }

    /// Runs a program to its end in a namespace, optionally in `cgroup`;
    /// its standard output.
    pub fn run_in(
        &self,
        netns: &str,
        cgroup: Option<&Path>,
        program: &str,
        args: &[&str],
    ) -> anyhow::Result<String> {
        let net = format!("--net=/run/netns/{netns}");
        let out = match cgroup {
            None => Command::new("nsenter").arg(&net).arg(program).args(args).output()?,
            Some(cgroup) => Command::new("sh")
                .args([
                    "-c",
                    r#"cg=$1; shift; echo $$ > "$cg/cgroup.procs" && exec nsenter "$@""#,
                    "sh",
                ])
                .arg(cgroup)
                .arg(&net)
                .arg(program)
                .args(args)
                .output()?,
        };
        if !out.status.success() {
            bail!("{program} {args:?} in {netns}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
