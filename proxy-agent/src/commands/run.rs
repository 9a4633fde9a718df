//! `proxy-agent run`: the flags (and `--config`), the source, this node,
//! the datapath of the mode, health and metrics; then the agent's loop.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::parser::ValueSource;

use crate::{
    agent::{self, LoopSettings, Source, Start},
    backend::{self, conntrack_limit::ConntrackLimit, ebpf::settings::FlowTimeouts},
    cli::RunArgs,
    config,
    health::{NodeEligibility, ProxyHealth, ServiceChecks},
    metrics::Metrics,
    node::{self, AddressSource, NodeInfo},
    plan::Node,
    source::{kube::KubeSource, manifests::Manifests},
};

/// How long to wait for this node's Node object for its addresses.
const NODE_WAIT: Duration = Duration::from_secs(30);
/// How often the Node object is looked for meanwhile.
const NODE_POLL: Duration = Duration::from_millis(200);

/// `run`, with `matches` telling which flags the command line gave.
pub fn run(args: RunArgs, matches: &clap::ArgMatches) -> anyhow::Result<()> {
    let args = with_config(args, matches)?;
    args.node.check().map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let start = start(&args).await?;
        agent::run(start).await
    })
}

/// `run`'s flags, with `--config`'s settings where no flag was given.
fn with_config(mut args: RunArgs, matches: &clap::ArgMatches) -> anyhow::Result<RunArgs> {
    let Some(path) = args.config.clone() else { return Ok(args) };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (settings, warnings) = config::parse(&path, &text)?;
    for warning in warnings {
        tracing::warn!(config = %path.display(), "{warning}");
    }
    config::apply(settings, &mut args, |id| {
        matches.value_source(id) == Some(ValueSource::CommandLine)
    });
    Ok(args)
}

/// Everything the loop starts from.
async fn start(args: &RunArgs) -> anyhow::Result<Start> {
    let name = node::name(&args.node.hostname_override)?;
    let source = source(args, &name).await?;
    let ips = node_ips(args, &source).await?;
    let from_node_object =
        matches!(&source, Source::Kube(k) if NodeInfo::of(k.node().as_ref()).internal_ips == ips);
    let addresses = if !args.node.node_ip.is_empty() {
        AddressSource::Fixed
    } else if from_node_object {
        AddressSource::NodeObject
    } else if ips.is_empty() {
        tracing::warn!(
            "no node address found: serving ClusterIPs only; the agent restarts to serve NodePorts once an interface has an address (or pass --node-ip)"
        );
        AddressSource::AwaitingInterfaces { pod_interfaces: args.pod_interfaces.clone() }
    } else {
        AddressSource::Fixed
    };
    let mut node = Node {
        name,
        ips,
        nodeport_addresses: args.node.nodeport_addresses.clone(),
        localhost_nodeports: args.node.localhost_nodeports,
        zone: None,
        lb_algorithm: args.bpf_lb_algorithm,
        lb_mode: args.bpf_lb_mode,
    };
    let eligibility = match &source {
        Source::Manifests(_) => NodeEligibility::NoApiServer,
        Source::Kube(kube) => {
            let info = NodeInfo::of(kube.node().as_ref());
            node.zone = info.zone;
            info.eligibility
        }
    };
    // Loading (the verifier: a second or two of CPU) runs beside the
    // source's first lists, which the runtime serves meanwhile, or beside
    // the first reads of the manifests.
    let loading = {
        let (settings, node) = (backend_settings(args), node.clone());
        tokio::task::spawn_blocking(move || backend::start(&settings, &node))
    };
    let source = match source {
        Source::Manifests(mut manifests) => {
            let primed = move || {
                manifests.prime(agent::POLL);
                manifests
            };
            Source::Manifests(tokio::task::spawn_blocking(primed).await?)
        }
        kube => kube,
    };
    let datapath = loading.await??;
    node.localhost_nodeports &= datapath.serves_localhost_nodeports();
    tracing::info!(mode = datapath.mode(), source = source.name(), node = %node.name, node_ips = ?node.ips, zone = ?node.zone, "starting");

    // kube-proxy: unhealthy once a change waits twice the sync period.
    let health = Arc::new(ProxyHealth::new(2 * args.sync_period, eligibility));
    let metrics = Arc::new(Metrics::new(health.clone(), datapath.mode()));
    metrics.set_service_metrics_limit(args.service_metrics_limit);
    let http = crate::http::server_thread().context("starting the endpoints' thread")?;
    metrics.clone().serve(&http, args.metrics_bind_address);
    health.clone().serve(&http, args.healthz_bind_address);
    let check_addresses = if args.node.nodeport_addresses.is_empty() {
        Vec::new()
    } else {
        let within =
            |ip: &std::net::IpAddr| args.node.nodeport_addresses.iter().any(|c| c.contains(*ip));
        node.ips.iter().copied().filter(within).collect()
    };
    Ok(Start {
        source,
        datapath,
        addresses,
        service_checks: ServiceChecks::new(health.clone(), http, check_addresses),
        metrics,
        health,
        node,
        settings: LoopSettings {
            min_sync_period: args.min_sync_period,
            sync_period: args.sync_period,
            interface_rescan_period: args.interface_rescan_period,
            unreadable_source_grace: args.unreadable_source_grace,
        },
    })
}

/// The backend's settings from the flags.
fn backend_settings(args: &RunArgs) -> backend::Settings {
    let traffic = args.node.traffic();
    let bpffs_root = args.pins.bpffs_root.clone();
    let conntrack =
        ConntrackLimit { max_per_core: args.conntrack_max_per_core, min: args.conntrack_min };
    backend::Settings {
        mode: args.proxy_mode,
        ebpf: backend::ebpf::Settings {
            bpffs_root: bpffs_root.clone(),
            cgroup: args.cgroup_path.clone(),
            tc_attach: args.tc_attach,
            pod_interfaces: args.pod_interfaces.clone(),
            pod_interface_programs: args.pod_interface_programs,
            socket_lb_host_netns_only: args.socket_lb_host_netns_only,
            socket_destroy: args.socket_destroy,
            terminate_tcp_on_endpoint_removal: args.terminate_tcp_on_endpoint_removal,
            map_max: args.bpf_lb_map_max,
            snat_port_range: args.snat_port_range,
            traffic: traffic.clone(),
            timeouts: FlowTimeouts {
                tcp_established: args.conntrack_tcp_timeout_established,
                tcp_close_wait: args.conntrack_tcp_timeout_close_wait,
                tcp_time_wait: args.conntrack_tcp_timeout_time_wait,
                udp: args.conntrack_udp_timeout,
            },
            conntrack,
            log_level: args.bpf_log_level,
            maglev_table_size: args.bpf_lb_maglev_table_size,
            acceleration: args.bpf_lb_acceleration,
        },
        iptables: backend::iptables::datapath::Settings {
            xtables: args.iptables_backend,
            traffic: traffic.clone(),
            bpffs_root: bpffs_root.clone(),
            conntrack,
        },
        nftables: backend::nftables::datapath::Settings { traffic, bpffs_root, conntrack },
    }
}

/// The source the flags ask for: `--manifests`, else the API server.
async fn source(args: &RunArgs, node_name: &str) -> anyhow::Result<Source> {
    if let Some(path) = &args.manifests {
        return Ok(Source::Manifests(Manifests::new(path)));
    }
    let config = crate::source::kube::config(args.kubeconfig.as_deref()).await?;
    Ok(Source::Kube(KubeSource::start(config, node_name)?))
}

/// `--node-ip`; else the Node object's InternalIPs (waiting a while for
/// it); else the interfaces' addresses.
async fn node_ips(args: &RunArgs, source: &Source) -> anyhow::Result<Vec<std::net::IpAddr>> {
    if !args.node.node_ip.is_empty() {
        return Ok(args.node.node_ip.clone());
    }
    if let Source::Kube(kube) = source {
        let deadline = Instant::now() + NODE_WAIT;
        while !kube.node_listed() && Instant::now() < deadline {
            tokio::time::sleep(NODE_POLL).await;
        }
        let ips = NodeInfo::of(kube.node().as_ref()).internal_ips;
        if !ips.is_empty() {
            return Ok(ips);
        }
        tracing::warn!("no InternalIP in this node's Node object: using the interfaces' addresses");
    }
    node::interface_ips(&args.pod_interfaces)
}
