//! Prometheus metrics on `--metrics-bind-address`: kube-proxy's names
//! where the concept is the same (`kubeproxy_…`, with its help strings,
//! labels and buckets), ours (`proxy_…`) for the rest. prometheus-client
//! encodes them (OpenMetrics text); the values are read at each scrape.

use std::{
    collections::BTreeMap,
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, SystemTime},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeGaugeValue, EncodeMetric},
    metrics::{
        MetricType,
        counter::ConstCounter,
        gauge::ConstGauge,
        histogram::{self, exponential_buckets},
    },
    registry::Registry,
};
use proxy_common::{Counter, FrontendStats};

use crate::{
    health::ProxyHealth,
    http::{self, Reply},
    model::IpFamily,
    service_stats::{Source, Totals},
};

/// The datapath's event counters, read at each scrape (the eBPF mode's
/// pinned counters map).
pub trait DatapathCounters: Send {
    /// Per-counter totals over all CPUs.
    fn read(&self) -> Vec<(Counter, u64)>;
}

/// `--service-metrics-limit`'s default.
pub const DEFAULT_SERVICE_METRICS_LIMIT: usize = 2000;

/// What Prometheus is told it scrapes.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A histogram of durations, in seconds.
#[derive(Debug)]
pub struct Histogram(histogram::Histogram);

impl Histogram {
    /// kube-proxy's sync latency buckets: 1 ms doubling 15 times.
    fn sync_latency() -> Self {
        Histogram(histogram::Histogram::new(exponential_buckets(0.001, 2.0, 15)))
    }

    /// kube-proxy's network programming buckets: 0.25 s to 300 s.
    fn programming_latency() -> Self {
        Histogram(histogram::Histogram::new(programming_buckets()))
    }

    pub fn observe(&self, value: Duration) {
        self.0.observe(value.as_secs_f64());
    }
}

fn programming_buckets() -> Vec<f64> {
    let mut bounds = vec![0.25, 0.5];
    bounds.extend((1..60).map(f64::from));
    bounds.extend((0..12).map(|i| f64::from(60 + 5 * i)));
    bounds.extend((0..7).map(|i| f64::from(120 + 30 * i)));
    bounds
}

/// Seconds since the epoch, for timestamp gauges.
fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A sample's labels.
type Labels = Vec<(&'static str, String)>;

fn label(name: &'static str, value: impl ToString) -> Labels {
    vec![(name, value.to_string())]
}

/// Writes metric families with prometheus-client's encoder, help texts as
/// given (its registry would add a full stop to them).
struct Families<'a>(DescriptorEncoder<'a>);

impl Families<'_> {
    fn counter(&mut self, name: &str, help: &str, value: u64) -> fmt::Result {
        ConstCounter::new(value).encode(self.0.encode_descriptor(
            name,
            help,
            None,
            MetricType::Counter,
        )?)
    }

    fn gauge(&mut self, name: &str, help: &str, value: impl EncodeGaugeValue) -> fmt::Result {
        ConstGauge::new(value).encode(self.0.encode_descriptor(
            name,
            help,
            None,
            MetricType::Gauge,
        )?)
    }

    fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) -> fmt::Result {
        histogram.0.encode(self.0.encode_descriptor(name, help, None, MetricType::Histogram)?)
    }

    fn counters(
        &mut self,
        name: &str,
        help: &str,
        samples: impl IntoIterator<Item = (Labels, u64)>,
    ) -> fmt::Result {
        let samples = samples.into_iter().map(|(l, v)| (l, ConstCounter::new(v)));
        self.labelled(name, help, MetricType::Counter, samples)
    }

    fn gauges<N: EncodeGaugeValue>(
        &mut self,
        name: &str,
        help: &str,
        samples: impl IntoIterator<Item = (Labels, N)>,
    ) -> fmt::Result {
        let samples = samples.into_iter().map(|(l, v)| (l, ConstGauge::new(v)));
        self.labelled(name, help, MetricType::Gauge, samples)
    }

    fn labelled(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        samples: impl IntoIterator<Item = (Labels, impl EncodeMetric)>,
    ) -> fmt::Result {
        let mut family = self.0.encode_descriptor(name, help, None, kind)?;
        for (labels, metric) in samples {
            metric.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The per-service counters' source and totals.
struct ServiceStats {
    source: Option<Box<dyn Source>>,
    totals: Totals,
    read_at: Option<std::time::Instant>,
}

impl ServiceStats {
    fn new(limit: usize) -> Self {
        ServiceStats { source: None, totals: Totals::new(limit), read_at: None }
    }

    /// Adds what the source counted since the last read (with no series
    /// wanted, nothing is read).
    fn read(&mut self) {
        let Some(source) = self.source.as_mut().filter(|_| self.totals.enabled()) else { return };
        match source.read() {
            Ok(snapshot) => self.totals.observe(snapshot),
            // The last totals are still right; the next read tries again.
            Err(e) => tracing::warn!(error = %e, "reading the per-service counters"),
        }
        self.read_at = Some(std::time::Instant::now());
    }
}

pub struct Metrics {
    pub syncs_ok: AtomicU64,
    pub syncs_failed: AtomicU64,
    /// Unix time (as f64 bits) of the last successful and last queued sync.
    last_sync: AtomicU64,
    last_queued: AtomicU64,
    pub sync_duration: Histogram,
    pub network_programming: Histogram,
    pub service_changes: AtomicU64,
    pub service_changes_pending: AtomicU64,
    pub endpoint_changes: AtomicU64,
    pub endpoint_changes_pending: AtomicU64,
    /// Service ports with a Local policy and endpoints, none of them here.
    pub no_local_endpoints_internal: AtomicU64,
    pub no_local_endpoints_external: AtomicU64,
    pub frontends: AtomicU64,
    pub backends: AtomicU64,
    /// IPv6 service ports in the model: no datapath serves them yet.
    pub unserved_ipv6_ports: AtomicU64,
    pub conntrack_entries: AtomicU64,
    /// Entries of each BPF map the agent writes.
    map_entries: Mutex<BTreeMap<&'static str, u64>>,
    /// What became of each state map of the previous agent.
    carried: Mutex<Vec<(&'static str, &'static str)>>,
    /// BPF map writes the kernel refused.
    pub map_update_failures: AtomicU64,
    /// Services the maps cannot hold as planned, by reason (kept at 0 once
    /// seen, so a recovery shows).
    services_refused: Mutex<BTreeMap<&'static str, u64>>,
    /// Served from their last good version after a bad update.
    pub kept_objects: AtomicU64,
    /// iptables mode: each family's rules (IPv4, IPv6).
    rules: [FamilyRules; 2],
    /// Whether the datapath serves the IPv6 family: its `ip_family="IPv6"`
    /// series are shown then.
    pub ipv6_served: AtomicBool,
    /// iptables mode: stale conntrack entries that could not be deleted.
    pub conntrack_cleanup_failures: AtomicU64,
    /// Failed attempts to attach the programs (or take over the datapath).
    pub activation_failures: AtomicU64,
    /// Failed removals of the other mode's datapath.
    pub mode_cleanup_failures: AtomicU64,
    /// iptables mode: full resyncs because the canary chain vanished.
    pub canary_resyncs: AtomicU64,
    /// Health-check node ports that could not be opened.
    pub health_check_failures: AtomicU64,
    /// API server watch failures, by kind.
    apiserver_errors: Mutex<BTreeMap<&'static str, u64>>,
    invalid: Mutex<BTreeMap<String, u64>>,
    /// Errors of the source's files, by (file, kind), once per change.
    source_errors: Mutex<BTreeMap<(String, String), u64>>,
    /// Read at each scrape, once the datapath is pinned.
    datapath: Mutex<Option<Box<dyn DatapathCounters>>>,
    /// Per-service counters: where they are read from, their totals.
    service_stats: Mutex<ServiceStats>,
    health: Arc<ProxyHealth>,
    mode: &'static str,
}

impl Metrics {
    pub fn new(health: Arc<ProxyHealth>, mode: &'static str) -> Self {
        Metrics {
            syncs_ok: AtomicU64::new(0),
            syncs_failed: AtomicU64::new(0),
            last_sync: AtomicU64::new(0),
            last_queued: AtomicU64::new(0),
            sync_duration: Histogram::sync_latency(),
            network_programming: Histogram::programming_latency(),
            service_changes: AtomicU64::new(0),
            service_changes_pending: AtomicU64::new(0),
            endpoint_changes: AtomicU64::new(0),
            endpoint_changes_pending: AtomicU64::new(0),
            no_local_endpoints_internal: AtomicU64::new(0),
            no_local_endpoints_external: AtomicU64::new(0),
            frontends: AtomicU64::new(0),
            backends: AtomicU64::new(0),
            unserved_ipv6_ports: AtomicU64::new(0),
            conntrack_entries: AtomicU64::new(0),
            map_entries: Mutex::default(),
            carried: Mutex::default(),
            map_update_failures: AtomicU64::new(0),
            services_refused: Mutex::default(),
            kept_objects: AtomicU64::new(0),
            rules: Default::default(),
            ipv6_served: AtomicBool::new(false),
            conntrack_cleanup_failures: AtomicU64::new(0),
            activation_failures: AtomicU64::new(0),
            mode_cleanup_failures: AtomicU64::new(0),
            canary_resyncs: AtomicU64::new(0),
            health_check_failures: AtomicU64::new(0),
            apiserver_errors: Mutex::default(),
            invalid: Mutex::default(),
            source_errors: Mutex::default(),
            datapath: Mutex::default(),
            service_stats: Mutex::new(ServiceStats::new(DEFAULT_SERVICE_METRICS_LIMIT)),
            health,
            mode,
        }
    }

    /// Counts one invalid object (or unreadable file) of `kind`.
    pub fn invalid(&self, kind: &str) {
        if let Ok(mut invalid) = self.invalid.lock() {
            *invalid.entry(kind.to_string()).or_default() += 1;
        }
    }

    /// Counts one error of a source file: `kind` is `yaml` for a file that
    /// does not parse, else the kind of the object that does not decode.
    pub fn source_error(&self, file: &std::path::Path, kind: &str) {
        if let Ok(mut errors) = self.source_errors.lock() {
            let key = (file.display().to_string(), kind.to_string());
            *errors.entry(key).or_default() += 1;
        }
    }

    pub fn set_datapath(&self, reader: Box<dyn DatapathCounters>) {
        if let Ok(mut datapath) = self.datapath.lock() {
            *datapath = Some(reader);
        }
    }

    /// Where the per-service counters are read from from now on (eBPF
    /// mode: the maps of each reload).
    pub fn set_service_stats_source(&self, source: Box<dyn Source>) {
        if let Ok(mut stats) = self.service_stats.lock() {
            stats.source = Some(source);
        }
    }

    /// Reads the per-service counters now (iptables mode: before a sync
    /// rewrites the rules, which zeroes their counters), from the source
    /// set, else from `source`'s.
    pub fn fold_service_stats(&self, source: impl FnOnce() -> Box<dyn Source>) {
        if let Ok(mut stats) = self.service_stats.lock() {
            stats.source.get_or_insert_with(source);
            stats.read();
        }
    }

    /// Adds the packets and bytes the per-packet flows' conntrack entries
    /// counted, per reverse-NAT id (see `backend::ebpf::flow_counts`).
    pub fn add_flow_growth(&self, growth: Vec<(u32, Option<String>, FrontendStats)>) {
        if growth.is_empty() {
            return;
        }
        if let Ok(mut stats) = self.service_stats.lock() {
            stats.totals.add_flows(growth);
        }
    }

    /// At most `limit` service ports get series of their own (0: none).
    pub fn set_service_metrics_limit(&self, limit: usize) {
        if let Ok(mut stats) = self.service_stats.lock() {
            stats.totals = Totals::new(limit);
        }
    }

    /// The per-service counters' families, read anew unless read lately.
    fn encode_service_stats(&self, out: &mut Families) -> fmt::Result {
        let Ok(mut stats) = self.service_stats.lock() else { return Ok(()) };
        let Some(source) = &stats.source else { return Ok(()) };
        let coverage = source.coverage();
        let due = stats.read_at.is_none_or(|at| at.elapsed() >= source.min_interval());
        if due {
            stats.read();
        }
        for (name, help, samples) in stats.totals.families(coverage) {
            out.counters(name, help, samples)?;
        }
        Ok(())
    }

    pub fn set_map_entries(&self, entries: &[(&'static str, usize)]) {
        if let Ok(mut map) = self.map_entries.lock() {
            map.extend(entries.iter().map(|(name, n)| (*name, *n as u64)));
        }
    }

    /// (map, outcome) per state map at this agent's start.
    pub fn set_carried(&self, carried: Vec<(&'static str, &'static str)>) {
        if let Ok(mut last) = self.carried.lock() {
            *last = carried;
        }
    }

    /// The services refused now, per reason.
    pub fn set_services_refused(&self, refused: impl IntoIterator<Item = &'static str>) {
        if let Ok(mut map) = self.services_refused.lock() {
            map.values_mut().for_each(|n| *n = 0);
            for reason in refused {
                *map.entry(reason).or_default() += 1;
            }
        }
    }

    /// iptables mode: what `family`'s rules did.
    pub fn rules(&self, family: IpFamily) -> &FamilyRules {
        &self.rules[family as usize]
    }

    pub fn set_apiserver_errors(&self, errors: BTreeMap<&'static str, u64>) {
        if let Ok(mut map) = self.apiserver_errors.lock() {
            *map = errors;
        }
    }

    pub fn synced_at(&self, t: SystemTime) {
        self.last_sync.store(unix_seconds(t).to_bits(), Relaxed);
    }

    pub fn queued_at(&self, t: SystemTime) {
        self.last_queued.store(unix_seconds(t).to_bits(), Relaxed);
    }

    /// kube-proxy's metrics that carry `ip_family` (a constant label of
    /// their sub-registry, written first as kube-proxy does). One sync
    /// programs every family: its timestamps and programming latency are
    /// each family's; in iptables mode each family's rules are timed and
    /// counted apart (as kube-proxy's proxier per family), in eBPF mode the
    /// one map sync is the IPv4 family's.
    fn encode_per_family(&self, family: IpFamily, mut out: Families) -> fmt::Result {
        if family == IpFamily::V6 && !self.ipv6_served.load(Relaxed) {
            return Ok(());
        }
        let rules = self.rules(family);
        let iptables = matches!(self.mode, "iptables" | "nftables");
        out.histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds",
            if iptables { &rules.sync_duration } else { &self.sync_duration },
        )?;
        out.histogram(
            "kubeproxy_network_programming_duration_seconds",
            "[ALPHA] In Cluster Network Programming Latency in seconds",
            &self.network_programming,
        )?;
        let f = |bits: &AtomicU64| f64::from_bits(bits.load(Relaxed));
        out.gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "[ALPHA] The last time proxy rules were successfully synced",
            f(&self.last_sync),
        )?;
        out.gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "[ALPHA] The last time a sync of proxy rules was queued",
            f(&self.last_queued),
        )?;
        out.gauges(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "[ALPHA] Number of services with a Local traffic policy and no endpoints",
            [
                (
                    label("traffic_policy", "external"),
                    self.no_local_endpoints_external.load(Relaxed),
                ),
                (
                    label("traffic_policy", "internal"),
                    self.no_local_endpoints_internal.load(Relaxed),
                ),
            ],
        )?;
        if !iptables {
            return Ok(());
        }
        out.histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds for full resyncs",
            &rules.full_sync_duration,
        )?;
        out.histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds for partial resyncs",
            &rules.partial_sync_duration,
        )?;
        if self.mode == "nftables" {
            out.counter(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures",
                "[ALPHA] Cumulative proxy nftables sync failures",
                rules.restore_failures.load(Relaxed),
            )?;
            return out.counter(
                "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
                "[ALPHA] Cumulative proxy nftables cleanup failures",
                rules.cleanup_failures.load(Relaxed),
            );
        }
        out.counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "[ALPHA] Cumulative proxy iptables restore failures",
            rules.restore_failures.load(Relaxed),
        )?;
        out.counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "[ALPHA] Cumulative proxy iptables partial restore failures",
            rules.partial_restore_failures.load(Relaxed),
        )?;
        let last = rules.last.lock().map(|l| l.clone()).unwrap_or_default();
        out.gauges(
            "kubeproxy_sync_proxy_rules_iptables_last",
            "[ALPHA] Number of iptables rules written by kube-proxy in last sync",
            last.into_iter().map(|(table, n)| (label("table", table), n as u64)),
        )
    }

    /// kube-proxy's metrics without `ip_family`.
    fn encode_kube_proxys(&self, out: &mut Families) -> fmt::Result {
        out.counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "[ALPHA] Cumulative proxy rules Endpoint changes",
            self.endpoint_changes.load(Relaxed),
        )?;
        out.gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "[ALPHA] Pending proxy rules Endpoint changes",
            self.endpoint_changes_pending.load(Relaxed),
        )?;
        out.counter(
            "kubeproxy_sync_proxy_rules_service_changes",
            "[ALPHA] Cumulative proxy rules Service changes",
            self.service_changes.load(Relaxed),
        )?;
        out.gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "[ALPHA] Pending proxy rules Service changes",
            self.service_changes_pending.load(Relaxed),
        )?;
        for (name, help, codes) in [
            (
                "kubeproxy_proxy_healthz",
                "[ALPHA] Cumulative proxy healthz HTTP status",
                [&self.health.healthz_200, &self.health.healthz_503],
            ),
            (
                "kubeproxy_proxy_livez",
                "[ALPHA] Cumulative proxy livez HTTP status",
                [&self.health.livez_200, &self.health.livez_503],
            ),
        ] {
            let samples = ["200", "503"].iter().zip(codes);
            out.counters(
                name,
                help,
                samples.map(|(code, n)| (label("code", code), n.load(Relaxed))),
            )?;
        }
        Ok(())
    }

    /// Ours, in both modes.
    fn encode_ours(&self, out: &mut Families) -> fmt::Result {
        out.counters(
            "proxy_sync",
            "Syncs of the datapath with the desired state, by result.",
            [
                (label("result", "ok"), self.syncs_ok.load(Relaxed)),
                (label("result", "error"), self.syncs_failed.load(Relaxed)),
            ],
        )?;
        out.gauge(
            "proxy_frontends",
            "Service frontends (address, port, protocol, scope) the datapath serves.",
            self.frontends.load(Relaxed),
        )?;
        out.gauge(
            "proxy_backends",
            "Distinct backends the datapath serves.",
            self.backends.load(Relaxed),
        )?;
        out.gauges(
            "proxy_unserved_service_ports",
            "Service ports of an IP family this proxy's datapath does not serve yet.",
            [(label("ip_family", "IPv6"), self.unserved_ipv6_ports.load(Relaxed))],
        )?;
        let invalid = self.invalid.lock().map(|m| m.clone()).unwrap_or_default();
        out.counters(
            "proxy_invalid_objects",
            "Objects (or manifest files) rejected as invalid, by kind.",
            invalid.into_iter().map(|(kind, n)| (label("kind", kind), n)),
        )?;
        let source_errors = self.source_errors.lock().map(|m| m.clone()).unwrap_or_default();
        out.counters(
            "proxy_source_errors",
            "Errors of the source's files, once per change of the file: kind yaml (the file does not parse) or the kind of an object that does not decode.",
            source_errors.into_iter().map(|((file, kind), n)| (vec![("file", file), ("kind", kind)], n)),
        )?;
        out.counter(
            "proxy_kept_objects",
            "Times an invalid update was ignored and the last good object kept.",
            self.kept_objects.load(Relaxed),
        )?;
        let apiserver = self.apiserver_errors.lock().map(|m| m.clone()).unwrap_or_default();
        out.counters(
            "proxy_apiserver_watch_errors",
            "API server watches that failed (and were retried), by kind.",
            apiserver.into_iter().map(|(kind, n)| (label("kind", kind), n)),
        )?;
        out.counter(
            "proxy_activation_failures",
            "Failed attempts to take over the datapath (attach the programs); retried.",
            self.activation_failures.load(Relaxed),
        )?;
        out.counter(
            "proxy_mode_cleanup_failures",
            "Failed removals of the other mode's datapath after a mode switch; retried.",
            self.mode_cleanup_failures.load(Relaxed),
        )?;
        out.counter(
            "proxy_health_check_node_port_failures",
            "Health-check node ports that could not be opened; retried at the next sync.",
            self.health_check_failures.load(Relaxed),
        )
    }

    /// Ours, of the rule-based modes (iptables, nftables).
    fn encode_rules(&self, out: &mut Families) -> fmt::Result {
        out.counter(
            "proxy_conntrack_cleanup_failures",
            "Stale conntrack entry sets that could not be deleted (retried).",
            self.conntrack_cleanup_failures.load(Relaxed),
        )?;
        match self.mode {
            "nftables" => out.counter(
                "proxy_nftables_table_resyncs",
                "Full resyncs after table kube-proxy was deleted or flushed by another program.",
                self.canary_resyncs.load(Relaxed),
            ),
            _ => out.counter(
                "proxy_iptables_canary_resyncs",
                "Full resyncs after KUBE-PROXY-CANARY vanished (rules flushed by another program).",
                self.canary_resyncs.load(Relaxed),
            ),
        }
    }

    /// Ours, of eBPF mode.
    fn encode_ebpf(&self, out: &mut Families) -> fmt::Result {
        let maps = self.map_entries.lock().map(|m| m.clone()).unwrap_or_default();
        out.gauges(
            "proxy_map_entries",
            "Entries of each BPF map (CONNTRACK at the last collection).",
            maps.into_iter().map(|(map, n)| (label("map", map), n)),
        )?;
        let carried = self.carried.lock().map(|c| c.clone()).unwrap_or_default();
        out.gauges(
            "proxy_state_map_carried",
            "What became of the previous agent's maps at this agent's start: state maps reused, converted (another layout), reset (a layout this build cannot read) or none; service maps reused (adopted) or rebuilt (made again from the source, ids kept).",
            carried.into_iter().map(|(map, how)| (vec![("map", map.into()), ("outcome", how.into())], 1u64)),
        )?;
        out.counter(
            "proxy_map_update_failures",
            "BPF map writes the kernel refused (the sync is retried).",
            self.map_update_failures.load(Relaxed),
        )?;
        let refused = self.services_refused.lock().map(|m| m.clone()).unwrap_or_default();
        out.gauges(
            "proxy_services_refused",
            "Services the BPF maps cannot hold as planned (--bpf-lb-map-max), by reason: not served, or served as before their last change.",
            refused.into_iter().map(|(reason, n)| (label("reason", reason), n)),
        )?;
        out.gauge(
            "proxy_conntrack_entries",
            "Entries of the per-packet conntrack map (two per flow), at the last collection.",
            self.conntrack_entries.load(Relaxed),
        )?;
        let counters = self.datapath.lock().ok().and_then(|d| d.as_ref().map(|r| r.read()));
        out.counters(
            "proxy_datapath_events",
            "Events counted by the BPF programs, summed over CPUs.",
            counters.unwrap_or_default().into_iter().map(|(c, n)| (label("event", c.name()), n)),
        )
    }

    /// This process's registry: everything above, read at each scrape.
    pub fn registry(self: &Arc<Self>) -> Registry {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Collected(self.clone())));
        for family in IpFamily::ALL {
            registry
                .sub_registry_with_label(("ip_family".into(), family.as_str().into()))
                .register_collector(Box::new(PerFamily(self.clone(), family)));
        }
        registry
    }

    /// Serves `/metrics`, `/healthz` (as on `--healthz-bind-address`: 503
    /// until the datapath serves; kube-proxy's metrics port answers `ok`
    /// from the start, which tells nothing) and `/proxyMode` on `addr`,
    /// from `runtime`.
    pub fn serve(self: Arc<Self>, runtime: &tokio::runtime::Handle, addr: std::net::SocketAddr) {
        let registry = Arc::new(self.registry());
        let handler = Arc::new(move |_method: String, path: String| {
            let (metrics, registry) = (self.clone(), registry.clone());
            async move {
                let text = |body: String| Reply::new(200, "text/plain; charset=utf-8", body);
                match path.as_str() {
                    "/metrics" => Reply::new(200, CONTENT_TYPE, render(&registry)),
                    "/healthz" => metrics.health.reply(true, SystemTime::now()),
                    "/proxyMode" => text(metrics.mode.into()),
                    _ => Reply::not_found(),
                }
            }
        });
        http::serve_on(runtime, addr, "metrics", handler);
    }
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").field("mode", &self.mode).finish_non_exhaustive()
    }
}

/// The metrics without a constant label.
#[derive(Debug)]
struct Collected(Arc<Metrics>);

impl Collector for Collected {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        let mut out = Families(encoder);
        self.0.encode_kube_proxys(&mut out)?;
        self.0.encode_ours(&mut out)?;
        self.0.encode_service_stats(&mut out)?;
        match self.0.mode {
            "iptables" | "nftables" => self.0.encode_rules(&mut out),
            _ => self.0.encode_ebpf(&mut out),
        }
    }
}

/// The metrics of an `ip_family` sub-registry.
#[derive(Debug)]
struct PerFamily(Arc<Metrics>, IpFamily);

impl Collector for PerFamily {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        self.0.encode_per_family(self.1, Families(encoder))
    }
}

/// What one family's iptables rules did: kube-proxy's proxier per family
/// times and counts its own syncs.
#[derive(Debug)]
pub struct FamilyRules {
    /// Failed `ip(6)tables-restore` runs, and those of them that were
    /// partial syncs.
    pub restore_failures: AtomicU64,
    pub partial_restore_failures: AtomicU64,
    /// nftables: stale chains that could not be deleted.
    pub cleanup_failures: AtomicU64,
    /// Rules written per table by the last sync.
    last: Mutex<Vec<(&'static str, usize)>>,
    /// This family's share of each sync (rendering and restoring its rules),
    /// of all syncs and of full and partial ones.
    sync_duration: Histogram,
    full_sync_duration: Histogram,
    partial_sync_duration: Histogram,
}

impl Default for FamilyRules {
    fn default() -> Self {
        FamilyRules {
            restore_failures: AtomicU64::new(0),
            partial_restore_failures: AtomicU64::new(0),
            cleanup_failures: AtomicU64::new(0),
            last: Mutex::default(),
            sync_duration: Histogram::sync_latency(),
            full_sync_duration: Histogram::sync_latency(),
            partial_sync_duration: Histogram::sync_latency(),
        }
    }
}

impl FamilyRules {
    /// One sync of this family's rules took `took`.
    pub fn synced(&self, took: Duration, full: bool) {
        self.sync_duration.observe(took);
        match full {
            true => self.full_sync_duration.observe(took),
            false => self.partial_sync_duration.observe(took),
        }
    }

    pub fn set_written(&self, rules: &[(&'static str, usize)]) {
        if let Ok(mut last) = self.last.lock() {
            *last = rules.to_vec();
        }
    }
}

/// The OpenMetrics text of `registry`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String does not fail; a collector's error would be a bug.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::error!("encoding the metrics: {e}");
    }
    out
}

#[cfg(test)]
mod tests;
