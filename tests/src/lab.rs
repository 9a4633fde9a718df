//! The lab: namespaces joined by a fabric bridge, its nodes, external
//! clients and the test API server, all removed when it drops.

use std::{
    path::PathBuf,
    process::Child,
    sync::atomic::{AtomicUsize, Ordering},
};

use anyhow::{Context, bail};

use crate::{
    API_ADDR, BPFFS_DIR, EXTERNAL_SERVICE_RANGE, EXTERNAL_SERVICE_RANGE6, FABRIC_PREFIX,
    FAR_PREFIX, FAR_ROUTER, Mode, Node, PREFIX, Pod, SERVICE_RANGE, SERVICE_RANGE6, Setup, Source,
    apiserver,
    host::{
        IpBatch, XDP_DROP, XDP_PASS, cgroup2_root, delete_netns, ip, mount_bpffs, pin_xdp_verdict,
        remove_cgroup, remove_scratch, sh, stop, sweep_stale, sysctl, veth_to_eth0, wait_link_up,
    },
    node_ip, v6,
};

static NEXT: AtomicUsize = AtomicUsize::new(0);

pub struct Lab {
    pub(crate) id: String,
    /// The mode agents are started in.
    pub mode: Mode,
    /// The test API server, when it is the agents' source.
    pub(crate) api: Option<apiserver::ApiServer>,
    /// Node 0, which the single-node tests use.
    pub node: String,
    pub cgroup: PathBuf,
    pub pins: PathBuf,
    pub dir: PathBuf,
    /// What agents are given as `--manifests`: `manifests.yaml` in `dir`,
    /// or a directory of files ([`Lab::use_manifest_dir`]).
    pub(crate) manifests: PathBuf,
    /// A namespace holding the bridge that joins nodes and external clients.
    pub(crate) fabric: String,
    pub(crate) nodes: Vec<Node>,
    pub(crate) externals: usize,
    pub(crate) netns: Vec<String>,
    pub(crate) children: Vec<Child>,
    /// Dual stack: new pods, nodes and external clients get IPv6 too.
    pub(crate) ipv6: bool,
    /// Agents run XDP on the nodes' uplinks (`Setup::xdp`).
    pub(crate) xdp: bool,
}

impl Lab {
    /// A lab whose agents run in eBPF mode on the manifest.
    pub fn new() -> anyhow::Result<Self> {
        Self::with(Setup::EBPF)
    }

    /// A lab whose agents run in `mode` on the manifest.
    pub fn with_mode(mode: Mode) -> anyhow::Result<Self> {
        Self::with(Setup::of(mode, Source::Manifests))
    }

    /// A node (namespace, uplink to the fabric, test cgroup, pin directory),
    /// a scratch dir, and with `Source::ApiServer` the test API server.
    pub fn with(setup: Setup) -> anyhow::Result<Self> {
        let mut lab = Self::bare(setup)?;
        if setup.source == Source::ApiServer {
            lab.start_apiserver()?;
        }
        Ok(lab)
    }

    fn bare(Setup { mode, xdp, .. }: Setup) -> anyhow::Result<Self> {
        if unsafe { libc::geteuid() } != 0 {
            bail!("the lab needs root (network namespaces, cgroups, BPF)");
        }
        sweep_stale();
        let id = format!("{PREFIX}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut lab = Lab {
            mode,
            api: None,
            node: String::new(),
            cgroup: PathBuf::new(),
            pins: PathBuf::new(),
            dir: std::env::temp_dir().join(&id),
            manifests: std::env::temp_dir().join(&id).join("manifests.yaml"),
            fabric: format!("{id}-fabric"),
            id,
            nodes: Vec::new(),
            externals: 0,
            netns: Vec::new(),
            children: Vec::new(),
            ipv6: false,
            xdp,
        };
        std::fs::create_dir_all(&lab.dir)?;
        mount_bpffs(&lab.dir.join(BPFFS_DIR))?;
        let fabric = lab.fabric.clone();
        lab.add_netns(&fabric)?;
        IpBatch::new(&fabric)
            .add(&["link", "add", "br0", "type", "bridge"])
            .add(&["link", "set", "br0", "up"])
            .run()?;
        lab.add_node()?;
        lab.node = lab.nodes[0].netns.clone();
        lab.cgroup = lab.nodes[0].cgroup.clone();
        lab.pins = lab.nodes[0].pins.clone();
        Ok(lab)
    }

    pub(crate) fn add_netns(&mut self, name: &str) -> anyhow::Result<()> {
        ip(&["netns", "add", name])?;
        self.netns.push(name.to_string());
        // Interfaces made from now on (both ends of a veth are made in the
        // namespace that creates the pair) skip duplicate address detection.
        for conf in ["all", "default"] {
            sysctl(name, &format!("net.ipv6.conf.{conf}.accept_dad"), "0")?;
        }
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    }

    /// Makes the lab dual-stack: the nodes so far get their IPv6 addresses
    /// and routes, and every pod, node and external client added from now
    /// on its IPv6 twin too (see [`v6`]); agents are given both node
    /// addresses. Call it before adding pods.
    pub fn dual_stack(&mut self) -> anyhow::Result<()> {
        self.ipv6 = true;
        for index in 0..self.nodes.len() {
            self.node_ipv6(index)?;
        }
        if let Some(api) = &self.api {
            for node in &self.nodes {
                api.apply(&node_object(node))?;
            }
        }
        Ok(())
    }

    /// Node `index`'s IPv6: forwarding, its fabric address, the service
    /// ranges to `svc0`, and routes between its pod range and the others'.
    fn node_ipv6(&mut self, index: usize) -> anyhow::Result<()> {
        let node_ip6 = v6(&self.nodes[index].ip);
        let netns = self.nodes[index].netns.clone();
        sysctl(&netns, "net.ipv6.conf.all.forwarding", "1")?;
        let mut batch = IpBatch::new(&netns);
        batch.add(&["addr", "add", &format!("{node_ip6}/64"), "dev", "eth0", "nodad"]);
        for range in [SERVICE_RANGE6, EXTERNAL_SERVICE_RANGE6] {
            batch.add(&["route", "add", range, "dev", "svc0"]);
        }
        let pod_range = |index: usize| format!("fd00:244:{}::/64", 1 + index);
        for (other, node) in self.nodes.iter().enumerate().filter(|(i, _)| *i != index) {
            let Some(other_ip6) = &node.ip6 else { continue };
            batch.add(&["route", "add", &pod_range(other), "via", other_ip6]);
            let mine = pod_range(index);
            ip(&["-n", &node.netns, "-6", "route", "add", &mine, "via", &node_ip6])?;
        }
        batch.run()?;
        self.nodes[index].ip6 = Some(node_ip6);
        Ok(())
    }

    /// Joins `netns` to the fabric bridge through its `eth0` with `addr`/24.
    fn uplink(&mut self, netns: &str, port: &str, addr: &str) -> anyhow::Result<()> {
        IpBatch::new(&self.fabric)
            .add(&veth_to_eth0(port, &[], netns))
            .add(&["link", "set", port, "master", "br0", "up"])
            .run()?;
        IpBatch::new(netns)
            .add(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"])
            .add(&["link", "set", "eth0", "up"])
            .run()?;
        wait_link_up(netns, "eth0")
    }

    /// The fabric's namespace and node `index`'s port on its bridge: the
    /// wire's far end, where a benchmark feeds the node's uplink.
    pub fn fabric_port(&self, index: usize) -> (&str, String) {
        (&self.fabric, uplink_port(index))
    }

    /// Makes a node's uplink behave towards XDP as a NIC on a wire does:
    /// frames reach the node with their checksums complete (a veth passes
    /// a sender's offloaded checksum on unfinished, which XDP cannot
    /// update: the fabric's port computes it, `tx off`), and frames the
    /// node's XDP sends back out are taken (a veth flushes XDP frames to
    /// its peer only where the peer runs an XDP program: the port runs one
    /// that passes everything).
    fn wire_for_xdp(&self, port: &str) -> anyhow::Result<()> {
        let ethtool = ["netns", "exec", &self.fabric, "ethtool", "-K", port, "tx", "off"];
        sh("ip", &ethtool)?;
        self.attach_verdict(port, XDP_PASS)
    }

    /// Ends the wire at node `index`'s fabric port: what the node sends out
    /// of its uplink is dropped there as it arrives, counted in the port's
    /// `rx_packets` (for benchmarks of the node's forwarding alone).
    pub fn end_wire_at(&self, index: usize) -> anyhow::Result<()> {
        self.attach_verdict(&uplink_port(index), XDP_DROP)
    }

    /// Attaches to a fabric port the XDP program returning `verdict` for
    /// every frame (pinned in the lab's bpffs when first needed).
    fn attach_verdict(&self, port: &str, verdict: u8) -> anyhow::Result<()> {
        let pin = self.dir.join(BPFFS_DIR).join(format!("xdp_verdict_{verdict}"));
        if !pin.exists() {
            pin_xdp_verdict(verdict, &pin)?;
        }
        let pin = pin.to_string_lossy();
        // `-force`: in place of the one there (an XDP_PASS one).
        ip(&["-force", "-n", &self.fabric, "link", "set", "dev", port, "xdpdrv", "pinned", &pin])?;
        Ok(())
    }

    /// Adds a node on the fabric, with routes between its pod CIDR and every
    /// other node's; returns its index.
    pub fn add_node(&mut self) -> anyhow::Result<usize> {
        let index = self.nodes.len();
        let node_id = format!("{}-n{index}", self.id);
        let netns = format!("{node_id}-node");
        self.add_netns(&netns)?;
        sysctl(&netns, "net.ipv4.ip_forward", "1")?;
        let node_ip = node_ip(index);
        let port = uplink_port(index);
        self.uplink(&netns, &port, &node_ip)?;
        if self.xdp {
            self.wire_for_xdp(&port)?;
        }
        // Service addresses route to a device of their own, as kube-proxy's
        // IPVS mode and Cilium give them one: packets to a service without
        // endpoints must reach the filter rules that refuse them, not die
        // for want of a route. A bridge without ports drops what it gets
        // (this kernel has no dummy driver).
        let mut batch = IpBatch::new(&netns);
        batch.add(&["link", "add", "svc0", "type", "bridge"]);
        // No ARP: nothing answers there, and a failed resolution would
        // send clients ICMP errors no real node sends.
        batch.add(&["link", "set", "svc0", "arp", "off", "up"]);
        for range in [SERVICE_RANGE, EXTERNAL_SERVICE_RANGE] {
            batch.add(&["route", "add", range, "dev", "svc0"]);
        }
        let pod_cidr = format!("10.244.{}.0/24", 1 + index);
        for other in &self.nodes {
            batch.add(&["route", "add", &other.pod_cidr, "via", &other.ip]);
            ip(&["-n", &other.netns, "route", "add", &pod_cidr, "via", &node_ip])?;
        }
        batch.run()?;
        let cgroup = cgroup2_root().join(&node_id);
        std::fs::create_dir_all(&cgroup).context("creating the test cgroup")?;
        self.nodes.push(Node {
            netns,
            ip: node_ip,
            ip6: None,
            pod_cidr,
            name: if index == 0 { "lab-node".into() } else { format!("lab-node{}", index + 1) },
            cgroup,
            pins: self.dir.join(BPFFS_DIR).join(&node_id),
            log: self.dir.join(format!("agent-{index}.log")),
            agent: None,
            agent_bin: None,
            agent_umask: None,
            agent_path: None,
            pass_node_ip: true,
            veths: 0,
        });
        if self.ipv6 {
            self.node_ipv6(index)?;
        }
        if let Some(api) = &self.api {
            api.apply(&node_object(&self.nodes[index]))?;
        }
        Ok(index)
    }

    /// The test API server on the fabric (192.168.100.1:6443), holding a
    /// Node object per lab node; agents started from now on watch it.
    pub fn start_apiserver(&mut self) -> anyhow::Result<&apiserver::ApiServer> {
        ip(&["-n", &self.fabric, "addr", "add", &format!("{API_ADDR}/24"), "dev", "br0"])?;
        let api =
            apiserver::ApiServer::start_in(&self.fabric, format!("{API_ADDR}:6443").parse()?)?;
        for node in &self.nodes {
            api.apply(&node_object(node))?;
        }
        std::fs::write(self.dir.join("kubeconfig"), api.kubeconfig())?;
        Ok(self.api.insert(api))
    }

    /// The test API server, if the agents watch it.
    pub fn api(&self) -> Option<&apiserver::ApiServer> {
        self.api.as_ref()
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// An external client on the fabric (no default route; the external
    /// service range goes via node 0).
    pub fn add_external(&mut self, name: &str, addr: &str) -> anyhow::Result<Pod> {
        let netns = format!("{}-{name}", self.id);
        self.add_netns(&netns)?;
        self.externals += 1;
        self.uplink(&netns, &format!("x{}", self.externals), addr)?;
        let mut batch = IpBatch::new(&netns);
        batch.add(&["route", "add", EXTERNAL_SERVICE_RANGE, "via", &self.nodes[0].ip]);
        if let Some(node_ip6) = self.nodes[0].ip6.clone().filter(|_| self.ipv6) {
            let addr6 = format!("{}/64", v6(addr));
            batch.add(&["addr", "add", &addr6, "dev", "eth0", "nodad"]);
            batch.add(&["route", "add", EXTERNAL_SERVICE_RANGE6, "via", &node_ip6]);
        }
        batch.run()?;
        Ok(Pod { name: name.to_string(), netns, ip: addr.to_string() })
    }

    /// An external client behind a router, at `FAR_PREFIX`.2 on a subnet of
    /// its own: the router (`FAR_ROUTER` on the fabric, `FAR_PREFIX`.1 on
    /// that subnet) sends towards the client over a link of `link_mtu`,
    /// while the client's side keeps 1500 (so it advertises an MSS packets
    /// towards it cannot carry: the router answers those with "fragmentation
    /// needed"). The client routes the fabric and the service ranges via the
    /// router, the router routes the service ranges via node 0, and the
    /// lab's nodes (those added so far) route the client's subnet via the
    /// router. One per lab.
    pub fn add_far_external(&mut self, name: &str, link_mtu: u32) -> anyhow::Result<Pod> {
        let router = format!("{}-router", self.id);
        self.add_netns(&router)?;
        sysctl(&router, "net.ipv4.ip_forward", "1")?;
        // Every "fragmentation needed" at once, not one a second.
        sysctl(&router, "net.ipv4.icmp_ratelimit", "0")?;
        self.uplink(&router, "r0", FAR_ROUTER)?;
        let netns = format!("{}-{name}", self.id);
        self.add_netns(&netns)?;
        let (gateway, addr) = (format!("{FAR_PREFIX}.1"), format!("{FAR_PREFIX}.2"));
        let mtu = link_mtu.to_string();
        let mut router_side = IpBatch::new(&router);
        router_side
            .add(&veth_to_eth0("far0", &["mtu", &mtu], &netns))
            .add(&["addr", "add", &format!("{gateway}/24"), "dev", "far0"])
            .add(&["link", "set", "far0", "up"]);
        for range in [SERVICE_RANGE, EXTERNAL_SERVICE_RANGE] {
            router_side.add(&["route", "add", range, "via", &self.nodes[0].ip]);
        }
        router_side.run()?;
        let mut client_side = IpBatch::new(&netns);
        client_side
            .add(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"])
            .add(&["link", "set", "eth0", "up"]);
        for range in [&format!("{FABRIC_PREFIX}.0/24"), SERVICE_RANGE, EXTERNAL_SERVICE_RANGE] {
            client_side.add(&["route", "add", range, "via", &gateway]);
        }
        client_side.run()?;
        wait_link_up(&netns, "eth0")?;
        wait_link_up(&router, "far0")?;
        let far = format!("{FAR_PREFIX}.0/24");
        for node in &self.nodes {
            ip(&["-n", &node.netns, "route", "add", &far, "via", FAR_ROUTER])?;
        }
        Ok(Pod { name: name.to_string(), netns, ip: addr })
    }

    /// Sends external client `ext`'s traffic for the external service
    /// range through node `node`, as an ECMP rehash or a drained node moves
    /// a router's flows.
    pub fn route_external_via(&self, ext: &Pod, node: usize) -> anyhow::Result<()> {
        let via = &self.nodes[node].ip;
        ip(&["-n", &ext.netns, "route", "replace", EXTERNAL_SERVICE_RANGE, "via", via])?;
        if let Some(via) = &self.nodes[node].ip6 {
            let range = EXTERNAL_SERVICE_RANGE6;
            ip(&["-n", &ext.netns, "-6", "route", "replace", range, "via", via])?;
        }
        Ok(())
    }

    /// How many destination-unreachable errors ("fragmentation needed") the
    /// router of [`Lab::add_far_external`] has sent.
    pub fn far_router_unreachables(&self) -> anyhow::Result<u64> {
        let router = format!("{}-router", self.id);
        let snmp = self.run_in(&router, None, "cat", &["/proc/net/snmp"])?;
        // Two "Icmp:" lines: field names, then values.
        let mut icmp = snmp.lines().filter(|l| l.starts_with("Icmp:"));
        let (names, values) = (icmp.next().context("Icmp names")?, icmp.next().context("values")?);
        let (_, value) = names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(name, _)| *name == "OutDestUnreachs")
            .context("no OutDestUnreachs")?;
        Ok(value.parse()?)
    }

    /// Installs kube-proxy's `KUBE-FORWARD` drop of conntrack-INVALID packets
    /// in a node, which reverse-translated packets must never meet.
    pub fn drop_invalid_forwards(&self, node: usize) -> anyhow::Result<()> {
        let netns = &self.nodes[node].netns;
        let families: &[&str] = if self.ipv6 { &["iptables", "ip6tables"] } else { &["iptables"] };
        for program in families {
            let rule = ["-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"];
            sh("ip", &[&["netns", "exec", netns, program][..], &rule[..]].concat())?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        for child in self.children.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for node in &mut self.nodes {
            if let Some(mut agent) = node.agent.take() {
                // SIGTERM: the agent's clean stop path (SIGKILL if a long
                // sync keeps it from answering).
                stop(&mut agent, libc::SIGTERM);
            }
            // Rules die with the namespace; pins live in the lab's bpffs.
            let _ = node.cleanup();
            let _ = std::fs::remove_dir_all(&node.pins);
        }
        for netns in self.netns.drain(..) {
            delete_netns(&netns);
        }
        for node in &self.nodes {
            remove_cgroup(&node.cgroup);
        }
        remove_scratch(&self.dir);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// A lab node's Node object: its name, address and zone `zone-<index>`.
fn node_object(node: &Node) -> String {
    let index = node.ip.rsplit('.').next().and_then(|i| i.parse::<u32>().ok()).unwrap_or(11) - 11;
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {}, labels: {{topology.kubernetes.io/zone: zone-{index}}}}}\nstatus: {{addresses: [{{type: InternalIP, address: {}}}, {}{{type: Hostname, address: {}}}]}}\n",
        node.name,
        node.ip,
        node.ip6
            .as_ref()
            .map_or(String::new(), |ip6| format!("{{type: InternalIP, address: '{ip6}'}}, ")),
        node.name
    )
}

/// Node `index`'s port on the fabric bridge.
fn uplink_port(index: usize) -> String {
    format!("n{index}")
}
