//! `--config FILE`: kube-proxy's `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`). The fields that mean something
//! here are honoured, those that do not are named in a warning, unknown
//! ones too; a flag given on the command line wins over the file.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::yaml::{Value, YamlError};

use crate::{
    backend::{
        ProxyMode,
        ebpf::settings::{Acceleration, BpfLogLevel},
    },
    cli::{RunArgs, parse_go_duration},
    model::{Cidr, LbAlgorithm, LbMode},
};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a KubeProxyConfiguration: {source}")]
    Yaml { path: PathBuf, source: YamlError },
    #[error("{path}: expected apiVersion {API_VERSION} and kind {KIND}, found {found:?}")]
    Kind { path: PathBuf, found: String },
    #[error("{path}: {field}: {why}")]
    Field { path: PathBuf, field: &'static str, why: String },
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct File {
    api_version: Option<String>,
    kind: Option<String>,
    client_connection: Option<ClientConnection>,
    hostname_override: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    mode: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    iptables: Option<RuleMode>,
    nftables: Option<RuleMode>,
    conntrack: Option<Conntrack>,
    detect_local_mode: Option<String>,
    /// Ours, not kube-proxy's: `--unreadable-source-grace`.
    unreadable_source_grace: Option<String>,
    /// This proxy's own field: `--bpf-log-level`.
    bpf_log_level: Option<String>,
    /// Ours, as Cilium's `bpf-lb-algorithm`: `--bpf-lb-algorithm`.
    bpf_lb_algorithm: Option<String>,
    /// Ours: `--bpf-lb-maglev-table-size`.
    bpf_lb_maglev_table_size: Option<u32>,
    /// Ours, as Cilium's `bpf-lb-mode`: `--bpf-lb-mode`.
    bpf_lb_mode: Option<String>,
    /// Ours: `--bpf-lb-dsr-dispatch`.
    bpf_lb_dsr_dispatch: Option<String>,
    /// Ours, as Cilium's `bpf-lb-acceleration`: `--bpf-lb-acceleration`.
    bpf_lb_acceleration: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClientConnection {
    kubeconfig: Option<String>,
}

/// kube-proxy's `iptables` and `nftables` sections (`localhostNodePorts`
/// is the first's only).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RuleMode {
    masquerade_all: Option<bool>,
    masquerade_bit: Option<i32>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    localhost_node_ports: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Conntrack {
    max_per_core: Option<u32>,
    min: Option<u32>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    udp_timeout: Option<String>,
}

/// The fields honoured, as `section.field` (and their sections).
const HONOURED: &[&str] = &[
    "apiVersion",
    "kind",
    "clientConnection",
    "clientConnection.kubeconfig",
    "hostnameOverride",
    "healthzBindAddress",
    "metricsBindAddress",
    "mode",
    "clusterCIDR",
    "nodePortAddresses",
    "iptables",
    "iptables.masqueradeAll",
    "iptables.masqueradeBit",
    "iptables.syncPeriod",
    "iptables.minSyncPeriod",
    "iptables.localhostNodePorts",
    "nftables",
    "nftables.masqueradeAll",
    "nftables.masqueradeBit",
    "nftables.syncPeriod",
    "nftables.minSyncPeriod",
    "conntrack",
    "conntrack.maxPerCore",
    "conntrack.min",
    "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout",
    "conntrack.udpTimeout",
    "detectLocalMode",
    "unreadableSourceGrace",
    "bpfLogLevel",
    "bpfLbAlgorithm",
    "bpfLbMaglevTableSize",
    "bpfLbMode",
    "bpfLbDsrDispatch",
    "bpfLbAcceleration",
];

/// The names of a rule mode's section and of its fields that can be wrong.
struct SectionNames {
    name: &'static str,
    sync_period: &'static str,
    min_sync_period: &'static str,
}

const IPTABLES: SectionNames = SectionNames {
    name: "iptables",
    sync_period: "iptables.syncPeriod",
    min_sync_period: "iptables.minSyncPeriod",
};

const NFTABLES: SectionNames = SectionNames {
    name: "nftables",
    sync_period: "nftables.syncPeriod",
    min_sync_period: "nftables.minSyncPeriod",
};

/// kube-proxy's fields that do not apply to this proxy.
const NOT_APPLICABLE: &[&str] = &[
    "featureGates",
    "clientConnection.acceptContentTypes",
    "clientConnection.contentType",
    "clientConnection.qps",
    "clientConnection.burst",
    "logging",
    "bindAddress",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "ipvs",
    "winkernel",
    "detectLocal",
    "oomScoreAdj",
    "conntrack.tcpBeLiberal",
    "conntrack.udpStreamTimeout",
    "configSyncPeriod",
    "portRange",
    "windowsRunAsService",
];

/// The settings a file gives, each with the flag (clap id) it stands for.
#[derive(Debug, Default, PartialEq)]
pub struct Settings {
    pub kubeconfig: Option<PathBuf>,
    pub hostname_override: Option<String>,
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    pub proxy_mode: Option<ProxyMode>,
    pub cluster_cidr: Option<Vec<Cidr>>,
    pub nodeport_addresses: Option<Vec<Cidr>>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub localhost_nodeports: Option<bool>,
    pub conntrack_tcp_timeout_established: Option<Duration>,
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    pub conntrack_udp_timeout: Option<Duration>,
    pub conntrack_max_per_core: Option<u32>,
    pub conntrack_min: Option<u32>,
    pub unreadable_source_grace: Option<Duration>,
    pub bpf_log_level: Option<BpfLogLevel>,
    pub bpf_lb_algorithm: Option<LbAlgorithm>,
    pub bpf_lb_maglev_table_size: Option<u32>,
    pub bpf_lb_mode: Option<LbMode>,
    pub bpf_lb_acceleration: Option<Acceleration>,
}

/// Appends kube-proxy's default port to an address given without one.
fn bind_address(text: &str, default_port: u16) -> Result<SocketAddr, String> {
    text.parse()
        .or_else(|_| format!("{text}:{default_port}").parse())
        .map_err(|_| format!("{text:?} is not an IPv4 address with an optional port"))
}

/// A Go duration; `None` for zero (kube-proxy: leave as is).
fn duration(text: &str) -> Result<Option<Duration>, String> {
    parse_go_duration(text).map(|d| Some(d).filter(|d| !d.is_zero()))
}

fn cidr(text: &str) -> Result<Cidr, String> {
    Cidr::parse(text).map_err(|e| e.to_string())
}

/// Parses a configuration; returns its settings and warnings (fields that
/// do not apply here, unknown fields, values this proxy cannot follow).
pub fn parse(path: &std::path::Path, text: &str) -> Result<(Settings, Vec<String>), ConfigError> {
    let yaml_err = |source| ConfigError::Yaml { path: path.to_path_buf(), source };
    let value: Value = crate::yaml::from_str(text).map_err(yaml_err)?;
    let file: File = serde_json::from_value(value.clone()).map_err(|e| yaml_err(e.into()))?;
    let found = format!(
        "{}/{}",
        file.api_version.as_deref().unwrap_or(""),
        file.kind.as_deref().unwrap_or("")
    );
    if file.api_version.as_deref() != Some(API_VERSION) || file.kind.as_deref() != Some(KIND) {
        return Err(ConfigError::Kind { path: path.to_path_buf(), found });
    }
    let mut warnings = Vec::new();
    for field in fields(&value) {
        let known =
            |list: &[&str]| list.iter().any(|k| *k == field || field.starts_with(&format!("{k}.")));
        if known(NOT_APPLICABLE) {
            warnings.push(format!("{field} does not apply to this proxy; ignored"));
        } else if !HONOURED.contains(&field.as_str()) {
            warnings.push(format!("unknown field {field}; ignored"));
        }
    }
    let bad = |field: &'static str| {
        move |why: String| ConfigError::Field { path: path.to_path_buf(), field, why }
    };
    let mut s = Settings {
        kubeconfig: file
            .client_connection
            .and_then(|c| c.kubeconfig)
            .filter(|k| !k.is_empty())
            .map(PathBuf::from),
        hostname_override: file.hostname_override.filter(|h| !h.is_empty()),
        ..Settings::default()
    };
    if let Some(a) = file.healthz_bind_address.filter(|a| !a.is_empty()) {
        s.healthz_bind_address = Some(bind_address(&a, 10256).map_err(bad("healthzBindAddress"))?);
    }
    if let Some(a) = file.metrics_bind_address.filter(|a| !a.is_empty()) {
        s.metrics_bind_address = Some(bind_address(&a, 10249).map_err(bad("metricsBindAddress"))?);
    }
    s.proxy_mode = match file.mode.as_deref().unwrap_or("") {
        "" | "auto" => None,
        "ebpf" => Some(ProxyMode::Ebpf),
        "iptables" => Some(ProxyMode::Iptables),
        "nftables" => Some(ProxyMode::Nftables),
        other => {
            warnings.push(format!("mode {other:?} is not supported: auto instead"));
            None
        }
    };
    if let Some(cidrs) = file.cluster_cidr.filter(|c| !c.is_empty()) {
        // Dual stack: "v4,v6".
        let cidrs: Result<Vec<Cidr>, String> = cidrs.split(',').map(cidr).collect();
        s.cluster_cidr = Some(cidrs.map_err(bad("clusterCIDR"))?);
    }
    if let Some(list) = file.node_port_addresses {
        let mut cidrs = Vec::new();
        for text in &list {
            if text == "primary" {
                warnings.push("nodePortAddresses \"primary\": use --node-ip instead".into());
                continue;
            }
            cidrs.push(cidr(text).map_err(bad("nodePortAddresses"))?);
        }
        s.nodeport_addresses = Some(cidrs);
    }
    // As kube-proxy: the section of the mode run; `nftables` with `mode:
    // nftables`, else `iptables` (which the eBPF mode takes too).
    let (section, names, other) = match s.proxy_mode {
        Some(ProxyMode::Nftables) => (file.nftables, NFTABLES, file.iptables.map(|_| IPTABLES)),
        _ => (file.iptables, IPTABLES, file.nftables.map(|_| NFTABLES)),
    };
    if let Some(other) = other {
        let mode = file.mode.as_deref().filter(|m| !m.is_empty()).unwrap_or("auto");
        let (other, used) = (other.name, names.name);
        warnings.push(format!("{other}: ignored (mode {mode} takes {used})"));
    }
    if let Some(section) = section {
        s.masquerade_all = section.masquerade_all;
        if names.name == IPTABLES.name {
            s.localhost_nodeports = section.localhost_node_ports;
        }
        if section.masquerade_bit.is_some_and(|b| b != 14) {
            let name = names.name;
            warnings.push(format!("{name}.masqueradeBit: only 14 (kube-proxy's default) is used"));
        }
        if let Some(d) = section.sync_period {
            s.sync_period = duration(&d).map_err(bad(names.sync_period))?;
        }
        if let Some(d) = section.min_sync_period {
            s.min_sync_period =
                Some(duration(&d).map_err(bad(names.min_sync_period))?.unwrap_or_default());
        }
    }
    if let Some(ct) = file.conntrack {
        s.conntrack_max_per_core = ct.max_per_core;
        s.conntrack_min = ct.min;
        if let Some(d) = ct.tcp_established_timeout {
            s.conntrack_tcp_timeout_established =
                duration(&d).map_err(bad("conntrack.tcpEstablishedTimeout"))?;
        }
        if let Some(d) = ct.tcp_close_wait_timeout {
            s.conntrack_tcp_timeout_close_wait =
                duration(&d).map_err(bad("conntrack.tcpCloseWaitTimeout"))?;
        }
        if let Some(d) = ct.udp_timeout {
            s.conntrack_udp_timeout = duration(&d).map_err(bad("conntrack.udpTimeout"))?;
        }
    }
    if let Some(d) = file.unreadable_source_grace {
        let grace = parse_go_duration(&d).map_err(bad("unreadableSourceGrace"))?;
        s.unreadable_source_grace = Some(grace);
    }
    if let Some(level) = file.bpf_log_level {
        s.bpf_log_level = Some(
            clap::ValueEnum::from_str(&level, true)
                .map_err(|_| format!("{level:?}: expected off, info, debug or trace"))
                .map_err(bad("bpfLogLevel"))?,
        );
    }
    if let Some(algorithm) = file.bpf_lb_algorithm {
        s.bpf_lb_algorithm =
            Some(crate::cli::parse_annotated(&algorithm).map_err(bad("bpfLbAlgorithm"))?);
    }
    if let Some(mode) = file.bpf_lb_mode {
        s.bpf_lb_mode = Some(crate::cli::parse_annotated(&mode).map_err(bad("bpfLbMode"))?);
    }
    if let Some(acceleration) = file.bpf_lb_acceleration {
        s.bpf_lb_acceleration = Some(
            clap::ValueEnum::from_str(&acceleration, true)
                .map_err(|_| format!("{acceleration:?}: expected disabled, native or best-effort"))
                .map_err(bad("bpfLbAcceleration"))?,
        );
    }
    if let Some(dispatch) = file.bpf_lb_dsr_dispatch.filter(|d| d != "opt") {
        return Err(bad("bpfLbDsrDispatch")(format!("{dispatch:?}: only opt is supported")));
    }
    if let Some(size) = file.bpf_lb_maglev_table_size {
        s.bpf_lb_maglev_table_size = Some(
            crate::cli::parse_maglev_table_size(&size.to_string())
                .map_err(bad("bpfLbMaglevTableSize"))?,
        );
    }
    if let Some(mode) = file.detect_local_mode.filter(|m| !m.is_empty() && m != "ClusterCIDR") {
        warnings.push(format!("detectLocalMode {mode}: only ClusterCIDR is supported"));
    }
    Ok((s, warnings))
}

/// Every field path of a mapping, two levels deep (`iptables.syncPeriod`).
fn fields(value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let Value::Object(top) = value else { return out };
    for (key, inner) in top {
        out.push(key.clone());
        if let Value::Object(section) = inner {
            out.extend(section.keys().map(|k| format!("{key}.{k}")));
        }
    }
    out
}

/// Applies `settings` to `args`, except where `explicit(id)` says the flag
/// was given on the command line.
pub fn apply(settings: Settings, args: &mut RunArgs, explicit: impl Fn(&str) -> bool) {
    macro_rules! set {
        ($id:literal, $field:expr, $value:expr) => {
            if let Some(value) = $value {
                if !explicit($id) {
                    $field = value;
                }
            }
        };
    }
    set!("kubeconfig", args.kubeconfig, settings.kubeconfig.map(Some));
    set!("hostname_override", args.node.hostname_override, settings.hostname_override.map(Some));
    set!("healthz_bind_address", args.healthz_bind_address, settings.healthz_bind_address);
    set!("metrics_bind_address", args.metrics_bind_address, settings.metrics_bind_address);
    set!("proxy_mode", args.proxy_mode, settings.proxy_mode);
    set!("cluster_cidr", args.node.cluster_cidr, settings.cluster_cidr);
    set!("nodeport_addresses", args.node.nodeport_addresses, settings.nodeport_addresses);
    set!("masquerade_all", args.node.masquerade_all, settings.masquerade_all);
    set!("sync_period", args.sync_period, settings.sync_period);
    set!("min_sync_period", args.min_sync_period, settings.min_sync_period.map(Some));
    set!("localhost_nodeports", args.node.localhost_nodeports, settings.localhost_nodeports);
    set!(
        "conntrack_tcp_timeout_established",
        args.conntrack_tcp_timeout_established,
        settings.conntrack_tcp_timeout_established
    );
    set!(
        "conntrack_tcp_timeout_close_wait",
        args.conntrack_tcp_timeout_close_wait,
        settings.conntrack_tcp_timeout_close_wait
    );
    set!("conntrack_udp_timeout", args.conntrack_udp_timeout, settings.conntrack_udp_timeout);
    set!("conntrack_max_per_core", args.conntrack_max_per_core, settings.conntrack_max_per_core);
    set!("conntrack_min", args.conntrack_min, settings.conntrack_min);
    set!("unreadable_source_grace", args.unreadable_source_grace, settings.unreadable_source_grace);
    set!("bpf_log_level", args.bpf_log_level, settings.bpf_log_level);
    set!("bpf_lb_algorithm", args.bpf_lb_algorithm, settings.bpf_lb_algorithm);
    set!("bpf_lb_mode", args.bpf_lb_mode, settings.bpf_lb_mode);
    set!("bpf_lb_acceleration", args.bpf_lb_acceleration, settings.bpf_lb_acceleration);
    set!(
        "bpf_lb_maglev_table_size",
        args.bpf_lb_maglev_table_size,
        settings.bpf_lb_maglev_table_size
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBEADM: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: 12h0m0s
  udpTimeout: 0s
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: 0.0.0.0
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: true
  masqueradeBit: null
  minSyncPeriod: 2s
  syncPeriod: 1m0s
metricsBindAddress: 127.0.0.1:10249
mode: iptables
nodePortAddresses: [192.168.100.0/24, 'fd00:100::/64']
oomScoreAdj: null
someFutureField: true
unreadableSourceGrace: 2s
bpfLogLevel: debug
bpfLbAlgorithm: maglev
bpfLbMaglevTableSize: 65521
bpfLbMode: hybrid
bpfLbDsrDispatch: opt
bpfLbAcceleration: best-effort
"#;

    fn run_args(flags: &[&str]) -> (RunArgs, clap::ArgMatches) {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let mut argv = vec!["proxy-agent", "run"];
        argv.extend(flags);
        let matches = crate::cli::Cli::command().get_matches_from(&argv);
        let run = matches.subcommand_matches("run").unwrap().clone();
        let cli = crate::cli::Cli::from_arg_matches(&matches).unwrap();
        let crate::cli::Command::Run(args) = cli.command else { unreachable!() };
        (*args, run)
    }

    #[test]
    fn a_kubeadm_configuration_is_read_and_flags_win() {
        let (settings, warnings) = parse(std::path::Path::new("config.conf"), KUBEADM).unwrap();
        assert_eq!(settings.kubeconfig, Some("/var/lib/kube-proxy/kubeconfig.conf".into()));
        assert_eq!(settings.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(settings.proxy_mode, Some(ProxyMode::Iptables));
        let cidrs: Vec<String> =
            settings.cluster_cidr.iter().flatten().map(|c| c.to_string()).collect();
        assert_eq!(cidrs, ["10.244.0.0/16", "fd00:10:244::/56"]);
        assert_eq!(settings.sync_period, Some(Duration::from_secs(60)));
        assert_eq!(settings.min_sync_period, Some(Duration::from_secs(2)));
        assert_eq!(settings.conntrack_tcp_timeout_established, Some(Duration::from_secs(43_200)));
        assert_eq!(settings.conntrack_udp_timeout, None, "0s: leave as is");
        assert_eq!(settings.unreadable_source_grace, Some(Duration::from_secs(2)));
        assert_eq!(settings.bpf_log_level, Some(BpfLogLevel::Debug));
        assert!(
            warnings.iter().any(|w| w == "unknown field someFutureField; ignored"),
            "{warnings:?}"
        );
        assert!(
            warnings.iter().any(|w| w.starts_with("oomScoreAdj does not apply")),
            "{warnings:?}"
        );
        assert!(!warnings.iter().any(|w| w.contains("syncPeriod")), "{warnings:?}");

        let (mut args, matches) = run_args(&["--sync-period", "5s", "--manifests", "/m"]);
        let explicit =
            |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        apply(settings, &mut args, explicit);
        assert_eq!(args.sync_period, Duration::from_secs(5), "the flag wins");
        assert_eq!(args.proxy_mode, ProxyMode::Iptables, "the file beats the default");
        assert!(args.node.masquerade_all);
        assert_eq!(args.node.nodeport_addresses.len(), 2, "both families");
        assert_eq!(args.node.cluster_cidr.len(), 2, "one per family");
        assert_eq!(args.min_sync_period, Some(Duration::from_secs(2)));
        assert_eq!(args.bpf_log_level, BpfLogLevel::Debug);
        assert_eq!(args.bpf_lb_algorithm, LbAlgorithm::Maglev);
        assert_eq!(args.bpf_lb_maglev_table_size, 65521);
        assert_eq!(args.bpf_lb_mode, LbMode::Hybrid);
        assert_eq!(args.bpf_lb_acceleration, Acceleration::BestEffort);
    }

    #[test]
    fn the_nftables_mode_takes_the_nftables_section() {
        let text = format!(
            "apiVersion: {API_VERSION}\nkind: {KIND}\nmode: nftables\n\
             nftables: {{masqueradeAll: true, syncPeriod: 30s, minSyncPeriod: 1s}}\n\
             iptables: {{syncPeriod: 10s}}\n"
        );
        let (settings, warnings) = parse(std::path::Path::new("c"), &text).unwrap();
        assert_eq!(settings.proxy_mode, Some(ProxyMode::Nftables));
        assert_eq!(settings.masquerade_all, Some(true));
        assert_eq!(settings.sync_period, Some(Duration::from_secs(30)));
        assert_eq!(settings.min_sync_period, Some(Duration::from_secs(1)));
        assert_eq!(warnings, ["iptables: ignored (mode nftables takes nftables)"]);
        // Another mode takes `iptables`, and says `nftables` is not its.
        let text = text.replace("mode: nftables", "mode: iptables");
        let (settings, warnings) = parse(std::path::Path::new("c"), &text).unwrap();
        assert_eq!(settings.sync_period, Some(Duration::from_secs(10)));
        assert_eq!(settings.masquerade_all, None);
        assert_eq!(warnings, ["nftables: ignored (mode iptables takes iptables)"]);
    }

    #[test]
    fn conntrack_sizes_are_read_and_null_keeps_the_defaults() {
        let (settings, _) = parse(std::path::Path::new("c"), KUBEADM).unwrap();
        assert_eq!((settings.conntrack_max_per_core, settings.conntrack_min), (None, None));
        let text = format!(
            "apiVersion: {API_VERSION}\nkind: {KIND}\nconntrack: {{maxPerCore: 0, min: 250000}}\n"
        );
        let (settings, warnings) = parse(std::path::Path::new("c"), &text).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let (mut args, matches) = run_args(&["--conntrack-min", "1000", "--manifests", "/m"]);
        assert_eq!(args.conntrack_max_per_core, 32_768, "kube-proxy's default");
        let explicit =
            |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        apply(settings, &mut args, explicit);
        assert_eq!(args.conntrack_max_per_core, 0, "0: leave the kernel's alone");
        assert_eq!(args.conntrack_min, 1000, "the flag wins");
    }

    #[test]
    fn other_documents_are_refused() {
        let err =
            parse(std::path::Path::new("c"), "apiVersion: v1\nkind: ConfigMap\n").unwrap_err();
        assert!(err.to_string().contains("expected apiVersion kubeproxy.config.k8s.io/v1alpha1"));
        let err = parse(
            std::path::Path::new("c"),
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables: {syncPeriod: soon}\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("iptables.syncPeriod"), "{err}");
        let err = parse(
            std::path::Path::new("c"),
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nbpfLogLevel: loud\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("bpfLogLevel"), "{err}");
        let bad_values = [
            ("bpfLbAlgorithm", "fastest"),
            ("bpfLbMaglevTableSize", "16384"),
            ("bpfLbMode", "tunnel"),
            ("bpfLbDsrDispatch", "geneve"),
        ];
        for (field, value) in bad_values {
            let text = format!("apiVersion: {API_VERSION}\nkind: {KIND}\n{field}: {value}\n");
            let err = parse(std::path::Path::new("c"), &text).unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
    }
}
