//! The lab: a node network namespace running `proxy-agent`, pod namespaces
//! joined to it by veth pairs, and a test cgroup for clients under socket LB.
//!
//! Pods get /32 addresses routed through the node, as real CNIs do: the pod's
//! default route goes via the link-local gateway 169.254.1.1 on the node side
//! of its veth, so every pod-to-pod packet crosses the node's IP layer. The
//! node namespace has no default route: an address nobody serves is
//! unreachable, never sent off the machine.
//!
//! A dual-stack lab ([`Lab::dual_stack`]) adds the IPv6 twin of each address
//! (see [`v6`]): pods fd00:244:N::M/128 behind the link-local gateway fe80::1
//! (as CNIs do), nodes and external clients fd00:100::X/64 on the fabric,
//! ClusterIPs in fd00:96::/112 and external service IPs in fd00:200::/112
//! routed as their IPv4 ranges are. Addresses skip duplicate address
//! detection (`nodad`, `accept_dad=0`): nothing else claims them, and a lab
//! must not wait a second per address.
//!
//! Everything a lab creates is named `pxl-<pid>-<n>-…` and removed when the
//! `Lab` drops, also when a test panics; labs left by a killed run are swept
//! by name when the next lab starts.

use std::{
    io::{BufRead, BufReader},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

pub mod apiserver;
pub mod bench_objects;

const GATEWAY: &str = "169.254.1.1";
const GATEWAY6: &str = "fe80::1";
const PREFIX: &str = "pxl-";
const CGROUP2: &str = "/sys/fs/cgroup/unified";
/// Each lab's own bpffs, mounted in its scratch dir (so nothing appears in
/// the host's /sys/fs/bpf, where mounting bpffs would also show the kernel's
/// preloaded iterators) and unmounted at teardown.
const BPFFS_DIR: &str = "bpf";

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

/// Whether the running kernel is at least `major.minor` (some behaviours
/// differ on older kernels, as docs/operations.md says).
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(|n| n.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (major, minor)
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

/// The two-node web pods' endpoints, by letter: `a` (web-a, 10.244.1.2, on
/// node 0), `b` and `c` (web-b 10.244.2.2, web-c 10.244.2.3, on node 1).
pub fn two_node_endpoints(pods: &[&str]) -> Vec<test_objects::EndpointBuilder> {
    pods.iter()
        .map(|p| {
            let (address, node) = two_node_pod(p);
            test_objects::ep(address).node(node)
        })
        .collect()
}

/// The same pods' IPv6 endpoints, in a dual-stack lab ([`v6`]).
pub fn two_node_endpoints6(pods: &[&str]) -> Vec<test_objects::EndpointBuilder> {
    pods.iter()
        .map(|p| {
            let (address, node) = two_node_pod(p);
            test_objects::ep(&v6(address)).node(node)
        })
        .collect()
}

/// The two-node web pods on a lab of two nodes: web-a on node 0, web-b
/// and web-c on node 1 ([`two_node_endpoints`]), each serving http 8080,
/// dns 5353/UDP and echo 9000.
pub fn add_two_node_web_pods(lab: &mut Lab) {
    for (node, letter) in [(0, "a"), (1, "b"), (1, "c")] {
        let (address, _) = two_node_pod(letter);
        let pod = lab.add_pod_on(node, &format!("web-{letter}"), address).unwrap();
        lab.serve(&pod, &[8080], &[5353]).unwrap();
        lab.serve_echo(&pod, 9000).unwrap();
    }
}

/// A two-node web pod's IPv4 address and node, by letter.
fn two_node_pod(letter: &str) -> (&'static str, &'static str) {
    match letter {
        "a" => ("10.244.1.2", "lab-node"),
        "b" => ("10.244.2.2", "lab-node2"),
        "c" => ("10.244.2.3", "lab-node2"),
        other => panic!("no pod {other}"),
    }
}

/// One parsed client line.
#[derive(Clone, Debug, PartialEq)]
pub enum Attempt {
    /// `from` is the peer (TCP, getpeername) or reply source (UDP, recvmsg);
    /// `name`, `local`, `peer` are what the server saw; `bytes` is the
    /// padding a bulk transfer received.
    Ok {
        ms: f64,
        from: String,
        name: String,
        local: String,
        peer: String,
        bytes: Option<usize>,
    },
    Err {
        ms: f64,
        kind: String,
    },
}

impl Attempt {
    pub fn parse(line: &str) -> Option<Self> {
        let field = |key: &str| {
            line.split_whitespace().find_map(|w| w.strip_prefix(key)).map(str::to_string)
        };
        let ms = field("ms=")?.parse().ok()?;
        if !line.starts_with("ok ") {
            return Some(Attempt::Err { ms, kind: field("kind=")? });
        }
        let answer = (|| {
            Some(Attempt::Ok {
                ms,
                from: field("from=")?,
                name: field("name=")?,
                local: field("local=")?,
                peer: field("peer=")?,
                bytes: field("bytes=").and_then(|b| b.parse().ok()),
            })
        })();
        // Connected, but the server's answer is missing or cut short.
        Some(answer.unwrap_or(Attempt::Err { ms, kind: "NoAnswer".into() }))
    }

    /// How long the attempt took.
    pub fn ms(&self) -> f64 {
        match self {
            Attempt::Ok { ms, .. } | Attempt::Err { ms, .. } => *ms,
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

/// What the agent logs once its datapath serves the manifests.
const SERVING: &str = "datapath ready; serving";

/// The agent's `--proxy-mode`: the same scenarios run in each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Ebpf,
    Iptables,
}

impl Mode {
    pub fn as_arg(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
        }
    }
}

/// Where the agents read Services and EndpointSlices from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The lab's manifest file (`--manifests`).
    Manifests,
    /// The test API server, fed the same manifest (`--kubeconfig`).
    ApiServer,
}

/// How a lab runs its agents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setup {
    pub mode: Mode,
    pub source: Source,
}

impl Setup {
    pub const EBPF: Setup = Setup { mode: Mode::Ebpf, source: Source::Manifests };
    pub const IPTABLES: Setup = Setup { mode: Mode::Iptables, source: Source::Manifests };
    pub const API: Setup = Setup { mode: Mode::Ebpf, source: Source::ApiServer };
}

/// Generates `mod <scenario> { fn ebpf(); fn iptables(); fn api(); }`, each
/// test calling `<scenario>(Setup)`: one definition, both modes, and the
/// API server as the source.
#[macro_export]
macro_rules! both_modes {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[test]
            fn ebpf() {
                super::$scenario($crate::Setup::EBPF)
            }
            #[test]
            fn iptables() {
                super::$scenario($crate::Setup::IPTABLES)
            }
            #[test]
            fn api() {
                super::$scenario($crate::Setup::API)
            }
        }
    )*};
}

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
    log: PathBuf,
    agent: Option<Child>,
    /// The agent binary, when not this workspace's `proxy-agent`.
    agent_bin: Option<PathBuf>,
    /// The umask agents start with, when not the test's.
    agent_umask: Option<libc::mode_t>,
    /// Whether the agent is told its address (`--node-ip`), or finds it.
    pass_node_ip: bool,
    veths: usize,
}

impl Node {
    /// Its addresses as `--node-ip` takes them: IPv4, and IPv6 in a
    /// dual-stack lab.
    fn node_ips(&self) -> String {
        match &self.ip6 {
            Some(ip6) => format!("{},{ip6}", self.ip),
            None => self.ip.clone(),
        }
    }

    /// `proxy-agent cleanup` in this node's namespace: its pins, filters
    /// and iptables rules (never the host's).
    fn cleanup(&self) -> anyhow::Result<String> {
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

pub struct Lab {
    id: String,
    /// The mode agents are started in.
    pub mode: Mode,
    /// The test API server, when it is the agents' source.
    api: Option<apiserver::ApiServer>,
    /// Node 0, which the single-node tests use.
    pub node: String,
    pub cgroup: PathBuf,
    pub pins: PathBuf,
    pub dir: PathBuf,
    /// What agents are given as `--manifests`: `manifests.yaml` in `dir`,
    /// or a directory of files ([`Lab::use_manifest_dir`]).
    manifests: PathBuf,
    /// A namespace holding the bridge that joins nodes and external clients.
    fabric: String,
    nodes: Vec<Node>,
    externals: usize,
    netns: Vec<String>,
    children: Vec<Child>,
    /// Dual stack: new pods, nodes and external clients get IPv6 too.
    ipv6: bool,
}

/// Addresses of external clients and node uplinks share 192.168.100.0/24;
/// externalIPs and load-balancer IPs live in 10.200.0.0/24, which external
/// clients route to node 0.
pub const FABRIC_PREFIX: &str = "192.168.100";
pub const EXTERNAL_SERVICE_RANGE: &str = "10.200.0.0/24";
/// The test API server's address on the fabric.
const API_ADDR: &str = "192.168.100.1";
/// Cluster IPs.
pub const SERVICE_RANGE: &str = "10.96.0.0/12";
/// IPv6 cluster IPs and external service IPs (dual-stack labs).
pub const SERVICE_RANGE6: &str = "fd00:96::/112";
pub const EXTERNAL_SERVICE_RANGE6: &str = "fd00:200::/112";
/// Every pod's IPv6 address (dual-stack labs): `--cluster-cidr`'s second.
pub const CLUSTER_CIDR6: &str = "fd00:244::/32";

/// The IPv6 twin of a lab address in a dual-stack lab: pods 10.244.N.M are
/// also fd00:244:N::M, nodes and external clients 192.168.100.X also
/// fd00:100::X (the decimal digits read as hex: short, and easy to match).
pub fn v6(v4: &str) -> String {
    match v4.split('.').collect::<Vec<_>>()[..] {
        ["10", "244", n, m] => format!("fd00:244:{n}::{m}"),
        ["192", "168", "100", x] => format!("fd00:100::{x}"),
        _ => panic!("{v4} has no IPv6 twin in the lab"),
    }
}
/// The router of [`Lab::add_far_external`] on the fabric, and the subnet
/// behind it.
pub const FAR_ROUTER: &str = "192.168.100.254";
pub const FAR_PREFIX: &str = "192.168.200";

impl Lab {
    /// A lab whose agents run in eBPF mode on the manifest.
    pub fn new() -> anyhow::Result<Self> {
        Self::with(Setup::EBPF)
    }

    /// A lab whose agents run in `mode` on the manifest.
    pub fn with_mode(mode: Mode) -> anyhow::Result<Self> {
        Self::with(Setup { mode, source: Source::Manifests })
    }

    /// A node (namespace, uplink to the fabric, test cgroup, pin directory),
    /// a scratch dir, and with `Source::ApiServer` the test API server.
    pub fn with(setup: Setup) -> anyhow::Result<Self> {
        let mut lab = Self::bare(setup.mode)?;
        if setup.source == Source::ApiServer {
            lab.start_apiserver()?;
        }
        Ok(lab)
    }

    fn bare(mode: Mode) -> anyhow::Result<Self> {
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
        };
        std::fs::create_dir_all(&lab.dir)?;
        mount_bpffs(&lab.dir.join(BPFFS_DIR))?;
        let fabric = lab.fabric.clone();
        lab.add_netns(&fabric)?;
        ip(&["-n", &fabric, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &fabric, "link", "set", "br0", "up"])?;
        lab.add_node()?;
        lab.node = lab.nodes[0].netns.clone();
        lab.cgroup = lab.nodes[0].cgroup.clone();
        lab.pins = lab.nodes[0].pins.clone();
        Ok(lab)
    }

    fn add_netns(&mut self, name: &str) -> anyhow::Result<()> {
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
        let addr = format!("{node_ip6}/64");
        ip(&["-n", &netns, "-6", "addr", "add", &addr, "dev", "eth0", "nodad"])?;
        for range in [SERVICE_RANGE6, EXTERNAL_SERVICE_RANGE6] {
            ip(&["-n", &netns, "-6", "route", "add", range, "dev", "svc0"])?;
        }
        let pod_range = |index: usize| format!("fd00:244:{}::/64", 1 + index);
        for (other, node) in self.nodes.iter().enumerate().filter(|(i, _)| *i != index) {
            let Some(other_ip6) = &node.ip6 else { continue };
            ip(&["-n", &netns, "-6", "route", "add", &pod_range(other), "via", other_ip6])?;
            let mine = pod_range(index);
            ip(&["-n", &node.netns, "-6", "route", "add", &mine, "via", &node_ip6])?;
        }
        self.nodes[index].ip6 = Some(node_ip6);
        Ok(())
    }

    /// Joins `netns` to the fabric bridge through its `eth0` with `addr`/24.
    fn uplink(&mut self, netns: &str, port: &str, addr: &str) -> anyhow::Result<()> {
        veth_to_eth0(&self.fabric, port, &[], netns)?;
        ip(&["-n", &self.fabric, "link", "set", port, "master", "br0", "up"])?;
        ip(&["-n", netns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
        ip(&["-n", netns, "link", "set", "eth0", "up"])?;
        wait_link_up(netns, "eth0")
    }

    /// Adds a node on the fabric, with routes between its pod CIDR and every
    /// other node's; returns its index.
    pub fn add_node(&mut self) -> anyhow::Result<usize> {
        let index = self.nodes.len();
        let node_id = format!("{}-n{index}", self.id);
        let netns = format!("{node_id}-node");
        self.add_netns(&netns)?;
        sysctl(&netns, "net.ipv4.ip_forward", "1")?;
        let node_ip = format!("{FABRIC_PREFIX}.{}", 11 + index);
        self.uplink(&netns, &format!("n{index}"), &node_ip)?;
        // Service addresses route to a device of their own, as kube-proxy's
        // IPVS mode and Cilium give them one: packets to a service without
        // endpoints must reach the filter rules that refuse them, not die
        // for want of a route. A bridge without ports drops what it gets
        // (this kernel has no dummy driver).
        ip(&["-n", &netns, "link", "add", "svc0", "type", "bridge"])?;
        // No ARP: nothing answers there, and a failed resolution would
        // send clients ICMP errors no real node sends.
        ip(&["-n", &netns, "link", "set", "svc0", "arp", "off", "up"])?;
        for range in [SERVICE_RANGE, EXTERNAL_SERVICE_RANGE] {
            ip(&["-n", &netns, "route", "add", range, "dev", "svc0"])?;
        }
        let pod_cidr = format!("10.244.{}.0/24", 1 + index);
        for other in &self.nodes {
            ip(&["-n", &netns, "route", "add", &other.pod_cidr, "via", &other.ip])?;
            ip(&["-n", &other.netns, "route", "add", &pod_cidr, "via", &node_ip])?;
        }
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
        ip(&["-n", &netns, "route", "add", EXTERNAL_SERVICE_RANGE, "via", &self.nodes[0].ip])?;
        if let Some(node_ip6) = self.nodes[0].ip6.clone().filter(|_| self.ipv6) {
            let addr6 = format!("{}/64", v6(addr));
            ip(&["-n", &netns, "-6", "addr", "add", &addr6, "dev", "eth0", "nodad"])?;
            ip(&["-n", &netns, "-6", "route", "add", EXTERNAL_SERVICE_RANGE6, "via", &node_ip6])?;
        }
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
        veth_to_eth0(&router, "far0", &["mtu", &link_mtu.to_string()], &netns)?;
        let (gateway, addr) = (format!("{FAR_PREFIX}.1"), format!("{FAR_PREFIX}.2"));
        ip(&["-n", &router, "addr", "add", &format!("{gateway}/24"), "dev", "far0"])?;
        ip(&["-n", &router, "link", "set", "far0", "up"])?;
        ip(&["-n", &netns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
        ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
        wait_link_up(&netns, "eth0")?;
        wait_link_up(&router, "far0")?;
        for range in [&format!("{FABRIC_PREFIX}.0/24"), SERVICE_RANGE, EXTERNAL_SERVICE_RANGE] {
            ip(&["-n", &netns, "route", "add", range, "via", &gateway])?;
        }
        for range in [SERVICE_RANGE, EXTERNAL_SERVICE_RANGE] {
            ip(&["-n", &router, "route", "add", range, "via", &self.nodes[0].ip])?;
        }
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
        veth_to_eth0(&node_ns, &host_if, &[], &netns)?;
        // Link scope, as CNIs leave the gateway off the host's global
        // addresses: the node masquerades with its own address, not this.
        ip(&[
            "-n",
            &node_ns,
            "addr",
            "add",
            &format!("{GATEWAY}/32"),
            "dev",
            &host_if,
            "scope",
            "link",
        ])?;
        ip(&["-n", &node_ns, "link", "set", &host_if, "up"])?;
        ip(&["-n", &node_ns, "route", "add", &format!("{pod_ip}/32"), "dev", &host_if])?;
        ip(&["-n", &netns, "addr", "add", &format!("{pod_ip}/32"), "dev", "eth0"])?;
        ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &netns, "route", "add", GATEWAY, "dev", "eth0", "scope", "link"])?;
        ip(&["-n", &netns, "route", "add", "default", "via", GATEWAY, "dev", "eth0"])?;
        if self.ipv6 {
            let pod_ip6 = v6(pod_ip);
            let gateway = format!("{GATEWAY6}/64");
            ip(&["-n", &node_ns, "-6", "addr", "add", &gateway, "dev", &host_if, "nodad"])?;
            let host = format!("{pod_ip6}/128");
            ip(&["-n", &node_ns, "-6", "route", "add", &host, "dev", &host_if])?;
            ip(&["-n", &netns, "-6", "addr", "add", &host, "dev", "eth0", "nodad"])?;
            ip(&["-n", &netns, "-6", "route", "add", "default", "via", GATEWAY6, "dev", "eth0"])?;
        }
        wait_link_up(&netns, "eth0")?;
        wait_link_up(&node_ns, &host_if)?;
        self.wait_tc_attached(node, &host_if)?;
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
    fn wait_tc_attached(&mut self, node: usize, interface: &str) -> anyhow::Result<()> {
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
        let deadline = Instant::now() + Duration::from_secs(20);
        while !pin.exists() && !filter() {
            if Instant::now() > deadline {
                bail!("the agent on {} did not attach to {interface}", host.netns);
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

    /// The pid of a node's agent, while it runs.
    pub fn agent_pid_on(&self, node: usize) -> Option<u32> {
        self.nodes[node].agent.as_ref().map(Child::id)
    }

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
        let deadline = Instant::now() + timeout;
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

    /// Agents started on `node` from now on start with this umask (the
    /// test's with `None`).
    /// Lets a node's agent find its addresses itself instead of being given
    /// them with `--node-ip`.
    pub fn omit_node_ip(&mut self, node: usize) {
        self.nodes[node].pass_node_ip = false;
    }

    pub fn set_agent_umask(&mut self, node: usize, umask: Option<libc::mode_t>) {
        self.nodes[node].agent_umask = umask;
    }

    /// GET `path` from `addr` in node 0's namespace: the whole response,
    /// status line and headers too.
    pub fn http_get(&self, addr: &str, path: &str) -> anyhow::Result<String> {
        self.labpod(&self.node, None, &["http", addr, path, "--full"])
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

    /// Whether node 0's agent is still running.
    pub fn agent_alive(&mut self) -> bool {
        self.nodes[0].agent.as_mut().is_some_and(|a| matches!(a.try_wait(), Ok(None)))
    }

    /// Runs a labpod client in `pod`, inside node 0's test cgroup (socket LB).
    pub fn client(&self, pod: &Pod, args: &[&str]) -> anyhow::Result<Vec<Attempt>> {
        let out = self.labpod(&pod.netns, Some(&self.nodes[0].cgroup), args)?;
        Ok(out.lines().filter_map(Attempt::parse).collect())
    }

    /// Runs a labpod client in `netns` outside any test cgroup: its packets
    /// meet only the per-packet datapath.
    pub fn client_outside(&self, pod: &Pod, args: &[&str]) -> anyhow::Result<Vec<Attempt>> {
        let out = self.labpod(&pod.netns, None, args)?;
        Ok(out.lines().filter_map(Attempt::parse).collect())
    }

    /// Starts a labpod client in `pod` outside any cgroup and returns it
    /// running, its stdout piped (one line per attempt, as they happen).
    pub fn spawn_outside(&mut self, pod: &Pod, args: &[&str]) -> anyhow::Result<Child> {
        Ok(Command::new(target_bin("labpod"))
            .args(["--netns", &pod.netns])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()?)
    }

    /// As `spawn_outside`, inside node 0's test cgroup (socket LB).
    pub fn spawn_client(&mut self, pod: &Pod, args: &[&str]) -> anyhow::Result<Child> {
        let cgroup = self.nodes[0].cgroup.to_string_lossy().into_owned();
        let args: Vec<&str> =
            ["--cgroup", cgroup.as_str()].into_iter().chain(args.iter().copied()).collect();
        self.spawn_outside(pod, &args)
    }

    /// Runs labpod in a namespace, optionally in a cgroup; its stdout.
    pub fn labpod(
        &self,
        netns: &str,
        cgroup: Option<&Path>,
        args: &[&str],
    ) -> anyhow::Result<String> {
        let mut cmd = Command::new(target_bin("labpod"));
        cmd.args(["--netns", netns]);
        if let Some(cgroup) = cgroup {
            cmd.arg("--cgroup").arg(cgroup);
        }
        let Output { status, stdout, stderr } = cmd.args(args).output()?;
        if !status.success() {
            bail!("labpod {args:?}: {}", String::from_utf8_lossy(&stderr));
        }
        Ok(String::from_utf8_lossy(&stdout).into_owned())
    }

    /// Node 0's agent's /metrics, fetched inside the node namespace.
    pub fn metrics(&self) -> anyhow::Result<String> {
        self.labpod(&self.node, None, &["http", "127.0.0.1:10249", "/metrics"])
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

    /// `proxy-agent cleanup` in a node's namespace, on its pins.
    pub fn cleanup_on(&self, node: usize) -> anyhow::Result<String> {
        self.nodes[node].cleanup()
    }

    /// `iptables-save` in a node's namespace.
    pub fn iptables_save_on(&self, node: usize) -> anyhow::Result<String> {
        sh("ip", &["netns", "exec", &self.nodes[node].netns, "iptables-save"])
    }

    /// Packets that matched the rules of a table whose line contains
    /// `needle` (in `iptables-save -c` form), in a node's namespace.
    pub fn rule_packets_on(&self, node: usize, table: &str, needle: &str) -> anyhow::Result<u64> {
        let saved = self.exec_on(node, "iptables-save", &["-c", "-t", table])?;
        Ok(saved
            .lines()
            .filter(|line| line.contains(needle))
            .filter_map(|line| line.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
            .sum())
    }

    /// Runs a command in a node's namespace.
    pub fn exec_on(&self, node: usize, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["netns", "exec", &self.nodes[node].netns, program];
        full.extend(args);
        sh("ip", &full)
    }

    /// What a node's datapath counted: the eBPF counter, or in iptables mode
    /// the packets of the rules that do the same thing (refusals, drops for
    /// want of a local endpoint, affinity hits).
    pub fn count_on(&self, node: usize, counter: proxy_common::Counter) -> anyhow::Result<u64> {
        use proxy_common::Counter::*;
        if self.mode == Mode::Ebpf {
            return self.counter_on(node, counter);
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
            let _ = ip(&["netns", "del", &netns]);
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

/// Signals an agent's process group (it and the tools it runs), and kills
/// it after 5 s if it has not stopped.
fn stop(agent: &mut Child, signal: i32) {
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

/// A veth pair: `name` in `netns` (with `options`, e.g. its MTU), its peer
/// `eth0` in `peer_netns`.
fn veth_to_eth0(netns: &str, name: &str, options: &[&str], peer_netns: &str) -> anyhow::Result<()> {
    let add = ["-n", netns, "link", "add", name];
    let peer = ["type", "veth", "peer", "name", "eth0", "netns", peer_netns];
    ip(&[&add[..], options, &peer[..]].concat()).map(drop)
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
fn mount_bpffs(at: &Path) -> anyhow::Result<()> {
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
fn remove_scratch(dir: &Path) {
    if let Ok(target) = std::ffi::CString::new(dir.join(BPFFS_DIR).as_os_str().as_encoded_bytes()) {
        // SAFETY: a valid path; failure (not mounted) is fine.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// How many attempts each pod answered.
/// The pods that answered the attempts a streaming client sent more than
/// `settle` after `changed`, from its output lines as they come (`<lost>`
/// for a failed one). A line comes when its attempt ends, which was sent
/// its duration earlier: a reply in flight at the change may be lost (as
/// with kube-proxy's conntrack deletion), and its line comes late.
/// The two-node cluster of the external-traffic scenarios: pods web-a
/// (node 0), web-b and web-c (node 1) serving HTTP on 8080, DNS on
/// 5353/UDP and an echo on 9000; an external client `ext` at
/// 192.168.100.101, its external service range routed to node 0;
/// `manifest`; on both nodes kube-proxy's drop of conntrack-INVALID
/// forwards and an agent with `--cluster-cidr 10.244.0.0/16` and `flags`.
pub fn two_node_web_cluster(setup: Setup, manifest: &str, flags: &[&str]) -> (Lab, Pod) {
    two_node_web_cluster_on(Stack::Ipv4, setup, manifest, flags)
}

/// The address families of a lab.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Stack {
    Ipv4,
    /// [`Lab::dual_stack`].
    Dual,
}

impl Stack {
    /// The agents' `--cluster-cidr` for the two-node cluster's pods.
    pub fn cluster_cidrs(self) -> &'static str {
        match self {
            Stack::Ipv4 => "10.244.0.0/16",
            Stack::Dual => "10.244.0.0/16,fd00:244::/32",
        }
    }
}

/// [`two_node_web_cluster`] of `stack`.
pub fn two_node_web_cluster_on(
    stack: Stack,
    setup: Setup,
    manifest: &str,
    flags: &[&str],
) -> (Lab, Pod) {
    let mut lab = Lab::with(setup).unwrap();
    if stack == Stack::Dual {
        lab.dual_stack().unwrap();
    }
    lab.add_node().unwrap();
    add_two_node_web_pods(&mut lab);
    let ext = lab.add_external("ext", "192.168.100.101").unwrap();
    lab.write_manifest(manifest).unwrap();
    for node in 0..2 {
        lab.drop_invalid_forwards(node).unwrap();
        let mut args = vec!["--cluster-cidr", stack.cluster_cidrs()];
        args.extend(flags);
        lab.start_agent_on(node, &args).unwrap();
    }
    (lab, ext)
}

/// What each successful attempt's server saw: (pod, peer, reply source);
/// panics on a failed one.
pub fn answered(attempts: &[Attempt]) -> Vec<(String, String, String)> {
    attempts
        .iter()
        .map(|a| match a {
            Attempt::Ok { name, peer, from, .. } => (name.clone(), peer.clone(), from.clone()),
            err => panic!("failed attempt: {err:?} in {attempts:?}"),
        })
        .collect()
}

pub fn answered_after(
    lines: impl IntoIterator<Item = std::io::Result<String>>,
    changed: Instant,
    settle: Duration,
) -> Vec<String> {
    let mut after = Vec::new();
    for line in lines.into_iter().map_while(Result::ok) {
        let Some(attempt) = Attempt::parse(&line) else { continue };
        let sent = Instant::now() - Duration::from_secs_f64(attempt.ms() / 1000.0);
        if sent > changed + settle {
            after.push(attempt.pod().unwrap_or("<lost>").to_string());
        }
    }
    after
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
        let bulk = Attempt::parse(
            "ok ms=3.5 from=10.96.0.10:80 bytes=200000 name=web-0 local=10.244.1.2:8080 peer=10.244.1.10:4242",
        );
        assert!(matches!(bulk, Some(Attempt::Ok { bytes: Some(200_000), .. })), "{bulk:?}");
        let cut = Attempt::parse("ok ms=0.2 from=10.96.0.10:80 ");
        assert_eq!(cut, Some(Attempt::Err { ms: 0.2, kind: "NoAnswer".into() }));
    }

    #[test]
    fn stale_names_carry_their_owner() {
        assert_eq!(owner_pid("pxl-4242-3-node"), Some(4242));
        assert_eq!(owner_pid("proxy"), None);
    }
}
