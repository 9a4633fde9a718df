//! The command line: subcommands and flags (kube-proxy's names where the
//! concept exists).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    backend::{
        ProxyMode, TrafficRules, conntrack_limit,
        ebpf::{
            settings::{Acceleration, BpfLogLevel, PodInterfacePrograms, TcAttachChoice},
            sock_end::SocketDestroy,
        },
        iptables::exec::Xtables,
    },
    model,
};

#[derive(Parser)]
#[command(name = "proxy-agent", version, about = "eBPF Kubernetes service proxy")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log lines as text or as JSON objects (one a line; the event's fields
    /// are keys of "fields")
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub logging_format: LoggingFormat,
}

/// kube-proxy's `--logging-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoggingFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub enum Command {
    /// Serve the services of the manifests or the API server until SIGTERM;
    /// the datapath stays in place after exit (as Cilium's does) until
    /// `cleanup`.
    Run(Box<RunArgs>),
    /// Remove both modes' datapaths: pins, links, clsact filters, iptables
    /// chains and jumps (in the current network namespace).
    Cleanup(PinArgs),
    /// What `run` needs from the node and cannot do unprivileged: bpffs
    /// mounted, the SNAT port range reserved, route_localnet for localhost
    /// NodePorts (a privileged init container runs it; `run` then finds
    /// them done)
    PrepareNode(PrepareArgs),
    /// Print what a mode would program, without applying anything.
    #[command(subcommand)]
    Render(RenderCommand),
    /// Check the kernel features the eBPF mode needs and print the mode
    /// `--proxy-mode auto` would pick (loads, never attaches, the programs).
    Probe(ProbeArgs),
    /// What the datapath does for each service, read back from the kernel
    /// (the eBPF mode's pinned maps, or the iptables rules)
    #[command(subcommand)]
    Lb(LbCommand),
    /// The flows of service traffic the datapath tracks
    #[command(subcommand)]
    Ct(CtCommand),
    /// Change the running programs' decision records (`run
    /// --bpf-log-level`) without reloading them
    BpfLogLevel(BpfLogLevelArgs),
    /// What the datapath would do with one packet: the real per-packet
    /// program run on a crafted packet against the live maps, leaving no
    /// state (eBPF mode, IPv4)
    Explain(ExplainArgs),
    /// A live stream of the datapath's decisions, one line each: new flows
    /// and their translation, drops and refusals with their reason
    Monitor(MonitorArgs),
}

#[derive(Args, Clone, Debug)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub inspect: InspectArgs,
    /// tcp, udp or sctp
    #[arg(long, value_name = "PROTO", value_parser = protocol)]
    pub proto: model::Protocol,
    /// The client: IP, or IP:PORT ([IPv6]:PORT) (without a port, an ephemeral
    /// one); of the same family as --to
    #[arg(long, value_name = "IP[:PORT]", value_parser = client)]
    pub from: (IpAddr, Option<u16>),
    /// Where the packet is sent
    #[arg(long, value_name = "IP:PORT")]
    pub to: SocketAddr,
    /// The interface the packet comes in on (default: the one this node
    /// routes the client's address through)
    #[arg(long, value_name = "IFACE")]
    pub interface: Option<String>,
}

fn protocol(s: &str) -> Result<model::Protocol, String> {
    match s.to_ascii_lowercase().as_str() {
        "tcp" => Ok(model::Protocol::Tcp),
        "udp" => Ok(model::Protocol::Udp),
        "sctp" => Ok(model::Protocol::Sctp),
        _ => Err(format!("{s}: tcp, udp or sctp")),
    }
}

fn client(s: &str) -> Result<(IpAddr, Option<u16>), String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok((addr.ip(), Some(addr.port())));
    }
    s.parse::<IpAddr>().map(|ip| (ip, None)).map_err(|e| format!("{s}: IP or IP:PORT ({e})"))
}

#[derive(Args, Clone, Debug)]
pub struct MonitorArgs {
    #[command(flatten)]
    pub inspect: InspectArgs,
    /// Only this service: `namespace/name` or `namespace/name:port`
    #[arg(long, value_name = "NS/NAME")]
    pub service: Option<String>,
    /// Only drops and refusals
    #[arg(long)]
    pub drops: bool,
    /// Stop after this many lines
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
    /// Stop after this long (`30s`, `5m`)
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub duration: Option<Duration>,
}

#[derive(Args, Clone, Debug)]
pub struct BpfLogLevelArgs {
    #[arg(value_enum)]
    pub level: BpfLogLevel,
    #[command(flatten)]
    pub pins: PinArgs,
}

#[derive(Subcommand)]
pub enum CtCommand {
    /// The flows of service traffic: per packet (original and translated
    /// tuple, SNAT, state, expiry) and the sockets the socket LB connected;
    /// in iptables mode the kernel's conntrack entries of service flows
    List(CtListArgs),
}

#[derive(Args, Clone, Debug)]
pub struct CtListArgs {
    #[command(flatten)]
    pub inspect: InspectArgs,
    /// Only this service: `namespace/name` or `namespace/name:port`
    #[arg(long, value_name = "NS/NAME")]
    pub service: Option<String>,
    /// Only flows to this backend address
    #[arg(long, value_name = "IP")]
    pub backend: Option<IpAddr>,
}

#[derive(Subcommand)]
pub enum LbCommand {
    /// Every frontend (address, kind, service, flags) with its backends
    List(LbListArgs),
}

#[derive(Args, Clone, Debug)]
pub struct LbListArgs {
    #[command(flatten)]
    pub inspect: InspectArgs,
    /// Only this service: `namespace/name` or `namespace/name:port`
    #[arg(long, value_name = "NS/NAME")]
    pub service: Option<String>,
}

/// What the inspection commands read and how they print it.
#[derive(Args, Clone, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// The datapath to read: `auto` reads the eBPF mode's pins when they
    /// exist under --bpffs-root, else the nftables mode's table when there
    /// is one, else the iptables rules
    #[arg(long, value_enum, default_value_t = InspectMode::Auto)]
    pub mode: InspectMode,
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InspectMode {
    Auto,
    Ebpf,
    Iptables,
    Nftables,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Plain columns
    Table,
    /// One JSON document
    Json,
}

#[derive(Args, Clone, Debug)]
pub struct ProbeArgs {
    /// Also print each check's whole detail (a verifier log) after the table
    #[arg(long, short)]
    pub verbose: bool,
    /// Write each check's whole detail (a verifier log) to FILE
    #[arg(long, value_name = "FILE")]
    pub verifier_log: Option<PathBuf>,
}

#[derive(Args, Clone, Debug)]
pub struct PrepareArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// As `run --snat-port-range`
    #[arg(long, value_name = "MIN-MAX", default_value = "10000-29999", value_parser = parse_port_range)]
    pub snat_port_range: (u16, u16),
    /// Set route_localnet, as `run --localhost-nodeports` needs in iptables mode
    /// (it lets martian packets to 127.0.0.0/8 in: only for that)
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub iptables_localhost_nodeports: bool,
}

#[derive(Subcommand)]
pub enum RenderCommand {
    /// The iptables-restore input kube-proxy's iptables mode would write on
    /// a full sync (filter and nat tables; services in name order)
    Iptables(RenderIptablesArgs),
    /// The nft input kube-proxy's nftables mode would write into empty
    /// tables (`ip kube-proxy`, `ip6 kube-proxy`; services in name order)
    Nftables(RenderArgs),
}

/// What every `render` takes: the objects and the node they are rendered
/// for.
#[derive(Args, Clone, Debug)]
pub struct RenderArgs {
    /// A YAML file or directory of Services and EndpointSlices
    #[arg(long, value_name = "PATH")]
    pub manifests: PathBuf,
    #[command(flatten)]
    pub node: NodeArgs,
    /// This node's zone (`topology.kubernetes.io/zone`), for EndpointSlice
    /// hints
    #[arg(long, value_name = "ZONE")]
    pub zone: Option<String>,
    /// Only this family's rules (`IPv4`, `IPv6`) [default: both, each after
    /// a comment line]
    #[arg(long, value_name = "FAMILY", value_parser = parse_ip_family)]
    pub ip_family: Option<model::IpFamily>,
}

#[derive(Args, Clone, Debug)]
pub struct RenderIptablesArgs {
    #[command(flatten)]
    pub render: RenderArgs,
    /// Leave out the nfacct counter matches kube-proxy adds where the kernel
    /// has nfnetlink_acct (the counters must exist before such rules apply)
    #[arg(long)]
    pub no_nfacct: bool,
}

fn parse_ip_family(text: &str) -> Result<model::IpFamily, String> {
    model::IpFamily::parse(text).ok_or_else(|| "expected IPv4 or IPv6".into())
}

/// `--pod-interfaces` when not given.
pub const DEFAULT_POD_INTERFACES: &str = "veth,lxc,cali";
/// The default bound of the service maps: 4 Mi entries, room for 100,000
/// services of 10 endpoints with the growth's headroom.
pub const BPF_LB_MAP_MAX: u32 = 1 << 22;

/// The node and its traffic rules; shared by `run` and `render`.
#[derive(Args, Clone, Debug)]
pub struct NodeArgs {
    /// This node's name, matched against EndpointSlice nodeName (local
    /// endpoints) [default: the hostname]
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// This node's addresses, of either family: NodePorts are served on
    /// them and clients are SNATed to the first IPv4 one [default: the
    /// addresses of its non-pod interfaces, the default route's first]
    #[arg(long, value_name = "IP[,IP]", value_delimiter = ',')]
    pub node_ip: Vec<IpAddr>,
    /// Serve NodePorts only on node addresses within these CIDRs [default: all]
    #[arg(long, value_name = "CIDR[,CIDR]", value_delimiter = ',', value_parser = parse_cidr)]
    pub nodeport_addresses: Vec<model::Cidr>,
    /// The pods' CIDRs, at most one per IP family (dual stack: `v4,v6`):
    /// ClusterIP traffic from other sources is masqueraded
    #[arg(long, value_name = "CIDR[,CIDR]", value_delimiter = ',', value_parser = parse_cidr)]
    pub cluster_cidr: Vec<model::Cidr>,
    /// Masquerade all ClusterIP traffic (translated per packet, or by iptables)
    #[arg(long)]
    pub masquerade_all: bool,
    /// NodePorts also answer on 127.0.0.0/8 to the node's own clients, IPv4
    /// only (kube-proxy's `localhostNodePorts`, on by default): the eBPF
    /// mode translates such connections at the socket, the iptables mode
    /// DNATs them (and sets net.ipv4.conf.all.route_localnet)
    #[arg(
        long,
        alias = "iptables-localhost-nodeports",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub localhost_nodeports: bool,
}

/// Where the datapath is pinned; shared by `run` and `cleanup`.
#[derive(Args, Clone, Debug)]
pub struct PinArgs {
    /// bpffs directory for the pinned maps and links (bpffs is mounted at
    /// /sys/fs/bpf when missing)
    #[arg(long, value_name = "PATH", default_value = "/sys/fs/bpf/proxy")]
    pub bpffs_root: PathBuf,
}

#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// A KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) file; the
    /// fields that apply are honoured, flags given here win over it
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A YAML file or directory of Services and EndpointSlices, re-read on
    /// change [default: watch the API server]
    #[arg(long, value_name = "PATH", conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// The API server's kubeconfig [default: $KUBECONFIG, ~/.kube/config,
    /// or the in-cluster service account]
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Which datapath to program
    #[arg(long, value_enum, default_value = "auto")]
    pub proxy_mode: ProxyMode,
    /// iptables mode: the iptables implementation to program (`auto`: the
    /// one the node's kubelet uses, else the one holding more rules)
    #[arg(long, value_enum, default_value = "auto")]
    pub iptables_backend: Xtables,
    #[command(flatten)]
    pub node: NodeArgs,
    /// cgroup v2 the socket programs attach to [default: the cgroup2 mount root]
    #[arg(long, value_name = "PATH")]
    pub cgroup_path: Option<PathBuf>,
    /// Where /metrics (and /healthz, /proxyMode) are served
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// eBPF mode: service ports with per-service traffic series of their
    /// own on /metrics; those seeing traffic later are summed in one
    /// `service="(other)"` series (0: no per-service series)
    #[arg(long, value_name = "N", default_value_t = crate::metrics::DEFAULT_SERVICE_METRICS_LIMIT)]
    pub service_metrics_limit: usize,
    /// Where kube-proxy's /healthz and /livez are served
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: SocketAddr,
    /// A change not synced after twice this makes /healthz fail; the
    /// iptables rules are rewritten at least this often
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub sync_period: Duration,
    /// Syncs are at least this far apart (changes meanwhile are taken
    /// together) [default: 1s in iptables mode, 0s in eBPF mode]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_or_zero)]
    pub min_sync_period: Option<Duration>,
    /// Name prefixes of pod-facing interfaces; their ingress (and that of the
    /// interfaces holding a node IP) runs the per-packet program, also on
    /// interfaces that appear later
    #[arg(
        long,
        value_name = "PREFIX[,PREFIX]",
        value_delimiter = ',',
        default_value = DEFAULT_POD_INTERFACES
    )]
    pub pod_interfaces: Vec<String>,
    /// What the per-packet programs do on pod-facing interfaces
    #[arg(long, value_enum, default_value = "auto")]
    pub pod_interface_programs: PodInterfacePrograms,
    /// How the per-packet program is attached to interfaces
    #[arg(long, value_enum, default_value = "auto")]
    pub tc_attach: TcAttachChoice,
    /// eBPF mode: forward packets of tracked NodePort, externalIP and
    /// LoadBalancer flows at the driver hook (XDP) of the interfaces
    /// holding node addresses, before the kernel builds an skb (Cilium's
    /// `bpf-lb-acceleration`); what XDP leaves is tc's, as without
    #[arg(long, value_enum, default_value = "disabled")]
    pub bpf_lb_acceleration: Acceleration,
    /// The socket programs translate only for the node's own network
    /// namespace (the agent's); pods see the ClusterIP and the per-packet
    /// path serves them (service meshes, VMs in pods), as Cilium's
    /// socketLB.hostNamespaceOnly
    #[arg(long)]
    pub socket_lb_host_netns_only: bool,
    /// Also end TCP connections the socket LB made to an endpoint that is
    /// removed (UDP sockets always are); off by default, as kube-proxy
    /// leaves established TCP connections alone
    #[arg(long)]
    pub terminate_tcp_on_endpoint_removal: bool,
    /// How sockets connected to a removed endpoint are ended: `auto` uses
    /// socket iterators with bpf_sock_destroy where the kernel has it
    /// (6.5+), else sock_diag SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY)
    #[arg(long, value_name = "WAY", value_enum, default_value_t = SocketDestroy::Auto)]
    pub socket_destroy: SocketDestroy,
    /// Replacing a previous agent's datapath, how long to wait for manifest
    /// files that do not parse before taking over without their services
    /// (the previous datapath serves them meanwhile); with no previous
    /// datapath, what can be read is served at once. Files that never stop
    /// changing are given up after this too
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration_or_zero)]
    pub unreadable_source_grace: Duration,
    /// Interfaces are followed through the kernel's netlink notifications;
    /// they are also scanned at least this often, in case one was missed
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub interface_rescan_period: Duration,
    /// The most entries the SERVICES map (a frontend plus one per backend
    /// of it), the BACKENDS map and the REV_NAT map (one per frontend) grow
    /// to: they start at 65536 (or this), grow with the services, and
    /// services that do not fit at this bound are refused, the others served
    #[arg(long, value_name = "N", default_value_t = BPF_LB_MAP_MAX)]
    pub bpf_lb_map_max: u32,
    /// Source ports SNAT allocates from (below the NodePort and ephemeral
    /// ranges); reserved in the node's net.ipv4.ip_local_reserved_ports
    #[arg(long, value_name = "MIN-MAX", default_value = "10000-29999", value_parser = parse_port_range)]
    pub snat_port_range: (u16, u16),
    /// Idle timeout of an established TCP flow translated per packet
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_established: Duration,
    /// Idle timeout of a half-closed TCP flow (one side sent FIN)
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Duration,
    /// How long a closed TCP flow (both FINs, or an RST) is kept for late
    /// packets, as netfilter's TIME_WAIT; its SNAT port rests at least 60 s
    /// either way (backends keep closed connections in TIME_WAIT that long)
    #[arg(long, value_name = "DURATION", default_value = "120s", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_time_wait: Duration,
    /// Idle timeout of a UDP flow translated per packet
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub conntrack_udp_timeout: Duration,
    /// Flows tracked per CPU (kube-proxy's): the iptables mode raises the
    /// kernel's `nf_conntrack_max` to this × CPUs, at least
    /// `--conntrack-min` (0 leaves it alone); the eBPF mode sizes its flow
    /// maps so (0: at `--conntrack-min`)
    #[arg(long, value_name = "N", default_value_t = conntrack_limit::DEFAULT_MAX_PER_CORE)]
    pub conntrack_max_per_core: u32,
    /// The fewest flows tracked, whatever the CPUs
    #[arg(long, value_name = "N", default_value_t = conntrack_limit::DEFAULT_MIN)]
    pub conntrack_min: u32,
    /// eBPF mode: the programs' decision records (service hit, backend and
    /// why, refusals, drops) in this log, under the target `bpf`
    #[arg(long, value_enum, default_value = "off", value_name = "LEVEL")]
    pub bpf_log_level: BpfLogLevel,
    /// eBPF mode: how NodePort, externalIP and LoadBalancer frontends pick
    /// the backend of a new flow: `random` on each node, or `maglev`
    /// (consistent hashing of the flow: every node picks the same backend,
    /// and a backend change moves few flows); a service chooses its own
    /// with the annotation `proxy-agent.io/lb-algorithm` or
    /// `service.cilium.io/lb-algorithm`
    #[arg(
        long,
        value_name = "ALGORITHM",
        default_value = "random",
        value_parser = parse_annotated::<model::LbAlgorithm>
    )]
    pub bpf_lb_algorithm: model::LbAlgorithm,
    /// eBPF mode: how flows to NodePort, externalIP and LoadBalancer
    /// frontends (policy Cluster) from outside the cluster reach backends
    /// on other nodes: `snat` (masqueraded, replies back through the node
    /// they entered: kube-proxy's way), `dsr` (direct server return: the
    /// client's address kept, the service carried in an IPv4 option or an
    /// IPv6 destination-options header, the replies sent from the
    /// backend's node straight to the client), `hybrid` (DSR for TCP, SNAT
    /// for UDP); a service
    /// chooses its own with `proxy-agent.io/forwarding-mode` or
    /// `service.cilium.io/forwarding-mode` (snat or dsr)
    #[arg(long, value_name = "MODE", default_value = "snat", value_parser = parse_annotated::<model::LbMode>)]
    pub bpf_lb_mode: model::LbMode,
    /// eBPF mode: how DSR carries the service to the backend's node: `opt`,
    /// an IPv4 option or IPv6 destination-options header (Cilium's default;
    /// no tunnel device needed)
    #[arg(long, value_name = "DISPATCH", default_value = "opt", value_parser = ["opt"])]
    pub bpf_lb_dsr_dispatch: String,
    /// eBPF mode: the entries of each Maglev table (a prime of Cilium's
    /// list: 251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521,
    /// 131071); about 100 times a service's backends keeps a backend
    /// change's disruption near 1/N. Two bytes an entry, per external
    /// frontend using Maglev
    #[arg(
        long,
        value_name = "PRIME",
        default_value_t = proxy_common::maglev::DEFAULT_TABLE_SIZE,
        value_parser = parse_maglev_table_size
    )]
    pub bpf_lb_maglev_table_size: u32,
    #[command(flatten)]
    pub pins: PinArgs,
}

/// A flag taking one of `T`'s words.
pub fn parse_annotated<T: model::Annotated>(text: &str) -> Result<T, String> {
    T::parse(text).ok_or_else(|| format!("{text:?}: expected {}", T::choices()))
}

pub fn parse_maglev_table_size(text: &str) -> Result<u32, String> {
    let sizes = proxy_common::maglev::TABLE_SIZES;
    text.parse().ok().filter(|size| sizes.contains(size)).ok_or_else(|| {
        let list: Vec<String> = sizes.iter().map(u32::to_string).collect();
        format!("{text:?}: the Maglev table size must be one of {}", list.join(", "))
    })
}

fn parse_cidr(text: &str) -> Result<model::Cidr, String> {
    model::Cidr::parse(text)
        .map_err(|_| "expected a CIDR such as 10.244.0.0/16 or fd00:10:244::/64".into())
}

impl NodeArgs {
    /// kube-proxy's rule: at most one `--cluster-cidr` per family.
    pub fn check(&self) -> Result<(), String> {
        for family in model::IpFamily::ALL {
            if self.cluster_cidr.iter().filter(|c| c.family() == family).count() > 1 {
                return Err(format!("--cluster-cidr: more than one {family} CIDR"));
            }
        }
        Ok(())
    }

    /// The traffic rules the flags give.
    pub fn traffic(&self) -> TrafficRules {
        TrafficRules {
            nodeport_addresses: self.nodeport_addresses.clone(),
            cluster_cidrs: self.cluster_cidr.clone(),
            masquerade_all: self.masquerade_all,
        }
    }
}

fn parse_port_range(text: &str) -> Result<(u16, u16), String> {
    let parsed = text.split_once('-').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
    match parsed {
        Some((min, max)) if 0 < min && min <= max => Ok((min, max)),
        _ => Err("expected MIN-MAX, such as 10000-29999".into()),
    }
}

/// A duration, zero allowed.
fn parse_duration_or_zero(text: &str) -> Result<Duration, String> {
    parse_go_duration(text)
}

/// A duration greater than zero.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    match parse_go_duration(text)? {
        Duration::ZERO => Err(format!("{text:?}: must be more than zero")),
        d => Ok(d),
    }
}

/// Go's `time.ParseDuration` (what kube-proxy's flags and configuration
/// take): `300ms`, `1.5h`, `2h45m`, `1h0m0s`, units ns, us, µs, ms, s, m, h;
/// and, as a convenience, a bare number of seconds. Negative durations and
/// overflows are refused.
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("expected a duration such as 500ms, 30s, 1h30m, not {text:?}");
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total_ns: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let unit_ns: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(bad()),
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return Err(bad());
        }
        let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| bad())? };
        let mut part = whole.checked_mul(unit_ns).ok_or_else(bad)?;
        // Fractions to the nanosecond, as Go.
        let mut scale = unit_ns;
        for digit in fraction.chars() {
            scale /= 10;
            part += u128::from(digit.to_digit(10).ok_or_else(bad)?) * scale;
        }
        total_ns = total_ns.checked_add(part).ok_or_else(bad)?;
        rest = after;
    }
    let secs = u64::try_from(total_ns / 1_000_000_000).map_err(|_| bad())?;
    Ok(Duration::new(secs, (total_ns % 1_000_000_000) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_values_parse_like_kube_proxy() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("1h30m0s"), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert!(parse_duration("10x").is_err() && parse_duration("0s").is_err());
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1h0m0.25s"), Ok(Duration::from_millis(3_600_250)));
        assert_eq!(parse_go_duration("0h0m0s"), Ok(Duration::ZERO));
        assert!(parse_go_duration("-1s").is_err() && parse_go_duration("1s2").is_err());
        assert!(parse_go_duration("99999999999999999999h").is_err(), "overflow is refused");
        assert_eq!(parse_port_range("61000-65000"), Ok((61000, 65000)));
        assert!(parse_port_range("65000-61000").is_err());
        assert_eq!(parse_cidr("10.244.0.0/16").unwrap().to_string(), "10.244.0.0/16");
        assert_eq!(parse_cidr("fd00::1/64").unwrap().to_string(), "fd00::/64");
        assert!(parse_cidr("10.0.0.0/33").is_err());
    }

    #[test]
    fn cluster_cidrs_are_one_per_family() {
        let node = |cidrs: &[&str]| {
            let cli = Cli::try_parse_from(
                ["proxy-agent", "render", "iptables", "--manifests", "m", "--cluster-cidr"]
                    .into_iter()
                    .chain([cidrs.join(",").as_str()]),
            )
            .unwrap();
            let Command::Render(RenderCommand::Iptables(args)) = cli.command else { panic!() };
            args.render.node
        };
        let dual = node(&["10.244.0.0/16", "fd00:10:244::/56"]);
        assert!(dual.check().is_ok());
        let v6 = dual.traffic().cluster_cidr(model::IpFamily::V6).unwrap();
        assert_eq!(v6.to_string(), "fd00:10:244::/56");
        assert!(node(&["10.244.0.0/16", "10.245.0.0/16"]).check().is_err());
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
