//! Prometheus text metrics on `--metrics-bind-address`: kube-proxy's names
//! where the concept is the same (`kubeproxy_…`, with its help strings,
//! labels and buckets), ours (`proxy_…`) for the rest.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, SystemTime},
};

use crate::{
    backend::ebpf::CounterReader,
    health::ProxyHealth,
    http::{self, Reply},
};

/// kube-proxy's `ip_family` label: this proxy is IPv4 only.
const FAMILY: &str = r#"ip_family="IPv4""#;

/// A Prometheus histogram.
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    fn new(bounds: Vec<f64>) -> Self {
        let buckets = vec![0; bounds.len()];
        Histogram { bounds, state: Mutex::new((buckets, 0.0, 0)) }
    }

    /// kube-proxy's sync latency buckets: 1 ms doubling 15 times.
    fn sync_latency() -> Self {
        Histogram::new((0..15).map(|i| 0.001 * f64::from(1u32 << i)).collect())
    }

    /// kube-proxy's network programming buckets: 0.25 s to 300 s.
    fn programming_latency() -> Self {
        let mut bounds = vec![0.25, 0.5];
        bounds.extend((1..60).map(f64::from));
        bounds.extend((0..12).map(|i| f64::from(60 + 5 * i)));
        bounds.extend((0..7).map(|i| f64::from(120 + 30 * i)));
        Histogram::new(bounds)
    }

    pub fn observe(&self, value: Duration) {
        let secs = value.as_secs_f64();
        if let Ok(mut state) = self.state.lock() {
            let (buckets, sum, count) = &mut *state;
            for (bucket, bound) in buckets.iter_mut().zip(&self.bounds) {
                if secs <= *bound {
                    *bucket += 1;
                }
            }
            *sum += secs;
            *count += 1;
        }
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let Ok(state) = self.state.lock() else { return };
        let (buckets, sum, count) = &*state;
        for (bound, n) in self.bounds.iter().zip(buckets) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// A label value with `\`, `"` and newlines escaped, as the text format
/// wants (file names may hold any of them).
fn label_value(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Seconds since the epoch, for timestamp gauges.
fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

pub struct Metrics {
    pub syncs_ok: AtomicU64,
    pub syncs_failed: AtomicU64,
    /// Unix time (as f64 bits) of the last successful and last queued sync.
    last_sync: AtomicU64,
    last_queued: AtomicU64,
    pub sync_duration: Histogram,
    pub full_sync_duration: Histogram,
    pub partial_sync_duration: Histogram,
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
    /// iptables mode: failed `iptables-restore` runs, and those of them
    /// that were partial syncs.
    pub restore_failures: AtomicU64,
    pub partial_restore_failures: AtomicU64,
    /// iptables mode: rules written per table by the last sync.
    iptables_rules_last: Mutex<Vec<(&'static str, usize)>>,
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
    datapath: Mutex<Option<CounterReader>>,
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
            full_sync_duration: Histogram::sync_latency(),
            partial_sync_duration: Histogram::sync_latency(),
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
            restore_failures: AtomicU64::new(0),
            partial_restore_failures: AtomicU64::new(0),
            iptables_rules_last: Mutex::default(),
            conntrack_cleanup_failures: AtomicU64::new(0),
            activation_failures: AtomicU64::new(0),
            mode_cleanup_failures: AtomicU64::new(0),
            canary_resyncs: AtomicU64::new(0),
            health_check_failures: AtomicU64::new(0),
            apiserver_errors: Mutex::default(),
            invalid: Mutex::default(),
            source_errors: Mutex::default(),
            datapath: Mutex::default(),
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

    pub fn set_datapath(&self, reader: CounterReader) {
        if let Ok(mut datapath) = self.datapath.lock() {
            *datapath = Some(reader);
        }
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

    pub fn set_iptables_rules(&self, rules: &[(&'static str, usize)]) {
        if let Ok(mut last) = self.iptables_rules_last.lock() {
            *last = rules.to_vec();
        }
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

    pub fn render(&self) -> String {
        let mut out = String::new();
        let header = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        let samples =
            |out: &mut String, name: &str, kind: &str, help: &str, values: &[(String, String)]| {
                header(out, name, kind, help);
                for (labels, value) in values {
                    let _ = writeln!(out, "{name}{labels} {value}");
                }
            };
        let one = |v: u64| vec![(String::new(), v.to_string())];
        let family = |v: String| vec![(format!("{{{FAMILY}}}"), v)];

        // kube-proxy's.
        for (name, help, histogram) in [
            (
                "kubeproxy_sync_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds",
                &self.sync_duration,
            ),
            (
                "kubeproxy_network_programming_duration_seconds",
                "In Cluster Network Programming Latency in seconds",
                &self.network_programming,
            ),
        ] {
            header(&mut out, name, "histogram", &format!("[ALPHA] {help}"));
            histogram.write(&mut out, name, FAMILY);
        }
        if self.mode == "iptables" {
            for (name, help, histogram) in [
                (
                    "kubeproxy_sync_full_proxy_rules_duration_seconds",
                    "SyncProxyRules latency in seconds for full resyncs",
                    &self.full_sync_duration,
                ),
                (
                    "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                    "SyncProxyRules latency in seconds for partial resyncs",
                    &self.partial_sync_duration,
                ),
            ] {
                header(&mut out, name, "histogram", &format!("[ALPHA] {help}"));
                histogram.write(&mut out, name, FAMILY);
            }
        }
        let f = |bits: &AtomicU64| f64::from_bits(bits.load(Relaxed)).to_string();
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "gauge",
            "[ALPHA] The last time proxy rules were successfully synced",
            &family(f(&self.last_sync)),
        );
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "gauge",
            "[ALPHA] The last time a sync of proxy rules was queued",
            &family(f(&self.last_queued)),
        );
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "counter",
            "[ALPHA] Cumulative proxy rules Endpoint changes",
            &one(self.endpoint_changes.load(Relaxed)),
        );
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "gauge",
            "[ALPHA] Pending proxy rules Endpoint changes",
            &one(self.endpoint_changes_pending.load(Relaxed)),
        );
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "counter",
            "[ALPHA] Cumulative proxy rules Service changes",
            &one(self.service_changes.load(Relaxed)),
        );
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "gauge",
            "[ALPHA] Pending proxy rules Service changes",
            &one(self.service_changes_pending.load(Relaxed)),
        );
        samples(
            &mut out,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
            "[ALPHA] Number of services with a Local traffic policy and no endpoints",
            &[
                (
                    format!("{{{FAMILY},traffic_policy=\"external\"}}"),
                    self.no_local_endpoints_external.load(Relaxed).to_string(),
                ),
                (
                    format!("{{{FAMILY},traffic_policy=\"internal\"}}"),
                    self.no_local_endpoints_internal.load(Relaxed).to_string(),
                ),
            ],
        );
        for (name, help, codes) in [
            (
                "kubeproxy_proxy_healthz_total",
                "Cumulative proxy healthz HTTP status",
                [&self.health.healthz_200, &self.health.healthz_503],
            ),
            (
                "kubeproxy_proxy_livez_total",
                "Cumulative proxy livez HTTP status",
                [&self.health.livez_200, &self.health.livez_503],
            ),
        ] {
            let values: Vec<(String, String)> = ["200", "503"]
                .iter()
                .zip(codes)
                .map(|(code, n)| (format!("{{code=\"{code}\"}}"), n.load(Relaxed).to_string()))
                .collect();
            samples(&mut out, name, "counter", &format!("[ALPHA] {help}"), &values);
        }
        if self.mode == "iptables" {
            samples(
                &mut out,
                "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                "counter",
                "[ALPHA] Cumulative proxy iptables restore failures",
                &family(self.restore_failures.load(Relaxed).to_string()),
            );
            samples(
                &mut out,
                "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                "counter",
                "[ALPHA] Cumulative proxy iptables partial restore failures",
                &family(self.partial_restore_failures.load(Relaxed).to_string()),
            );
            let last: Vec<(String, String)> = self
                .iptables_rules_last
                .lock()
                .map(|l| {
                    l.iter()
                        .map(|(t, n)| (format!("{{{FAMILY},table=\"{t}\"}}"), n.to_string()))
                        .collect()
                })
                .unwrap_or_default();
            samples(
                &mut out,
                "kubeproxy_sync_proxy_rules_iptables_last",
                "gauge",
                "[ALPHA] Number of iptables rules written by kube-proxy in last sync",
                &last,
            );
        }

        // Ours.
        samples(
            &mut out,
            "proxy_sync_total",
            "counter",
            "Syncs of the datapath with the desired state, by result.",
            &[
                (r#"{result="ok"}"#.into(), self.syncs_ok.load(Relaxed).to_string()),
                (r#"{result="error"}"#.into(), self.syncs_failed.load(Relaxed).to_string()),
            ],
        );
        samples(
            &mut out,
            "proxy_frontends",
            "gauge",
            "Service frontends (address, port, protocol, scope) the datapath serves.",
            &one(self.frontends.load(Relaxed)),
        );
        samples(
            &mut out,
            "proxy_backends",
            "gauge",
            "Distinct backends the datapath serves.",
            &one(self.backends.load(Relaxed)),
        );
        samples(
            &mut out,
            "proxy_unserved_service_ports",
            "gauge",
            "Service ports of an IP family this proxy's datapath does not serve yet.",
            &[(r#"{ip_family="IPv6"}"#.into(), self.unserved_ipv6_ports.load(Relaxed).to_string())],
        );
        let invalid: Vec<_> = self
            .invalid
            .lock()
            .map(|m| m.iter().map(|(k, v)| (format!(r#"{{kind="{k}"}}"#), v.to_string())).collect())
            .unwrap_or_default();
        samples(
            &mut out,
            "proxy_invalid_objects_total",
            "counter",
            "Objects (or manifest files) rejected as invalid, by kind.",
            &invalid,
        );
        let source_errors: Vec<_> = self
            .source_errors
            .lock()
            .map(|m| {
                m.iter()
                    .map(|((file, kind), v)| {
                        let (file, kind) = (label_value(file), label_value(kind));
                        (format!(r#"{{file="{file}",kind="{kind}"}}"#), v.to_string())
                    })
                    .collect()
            })
            .unwrap_or_default();
        samples(
            &mut out,
            "proxy_source_errors_total",
            "counter",
            "Errors of the source's files, once per change of the file: kind yaml (the file does not parse) or the kind of an object that does not decode.",
            &source_errors,
        );
        samples(
            &mut out,
            "proxy_kept_objects_total",
            "counter",
            "Times an invalid update was ignored and the last good object kept.",
            &one(self.kept_objects.load(Relaxed)),
        );
        let apiserver: Vec<_> = self
            .apiserver_errors
            .lock()
            .map(|m| m.iter().map(|(k, v)| (format!(r#"{{kind="{k}"}}"#), v.to_string())).collect())
            .unwrap_or_default();
        samples(
            &mut out,
            "proxy_apiserver_watch_errors_total",
            "counter",
            "API server watches that failed (and were retried), by kind.",
            &apiserver,
        );
        samples(
            &mut out,
            "proxy_activation_failures_total",
            "counter",
            "Failed attempts to take over the datapath (attach the programs); retried.",
            &one(self.activation_failures.load(Relaxed)),
        );
        samples(
            &mut out,
            "proxy_mode_cleanup_failures_total",
            "counter",
            "Failed removals of the other mode's datapath after a mode switch; retried.",
            &one(self.mode_cleanup_failures.load(Relaxed)),
        );
        samples(
            &mut out,
            "proxy_health_check_node_port_failures_total",
            "counter",
            "Health-check node ports that could not be opened; retried at the next sync.",
            &one(self.health_check_failures.load(Relaxed)),
        );
        if self.mode == "iptables" {
            samples(
                &mut out,
                "proxy_conntrack_cleanup_failures_total",
                "counter",
                "Stale conntrack entry sets that could not be deleted (retried).",
                &one(self.conntrack_cleanup_failures.load(Relaxed)),
            );
            samples(
                &mut out,
                "proxy_iptables_canary_resyncs_total",
                "counter",
                "Full resyncs after KUBE-PROXY-CANARY vanished (rules flushed by another program).",
                &one(self.canary_resyncs.load(Relaxed)),
            );
            return out;
        }
        let maps: Vec<_> = self
            .map_entries
            .lock()
            .map(|m| m.iter().map(|(k, v)| (format!(r#"{{map="{k}"}}"#), v.to_string())).collect())
            .unwrap_or_default();
        samples(
            &mut out,
            "proxy_map_entries",
            "gauge",
            "Entries of each BPF map (CONNTRACK at the last collection).",
            &maps,
        );
        let carried: Vec<_> = self
            .carried
            .lock()
            .map(|c| {
                c.iter()
                    .map(|(map, how)| (format!(r#"{{map="{map}",outcome="{how}"}}"#), "1".into()))
                    .collect()
            })
            .unwrap_or_default();
        samples(
            &mut out,
            "proxy_state_map_carried",
            "gauge",
            "What became of the previous agent's state maps at this agent's start: reused, converted (another layout), reset (a layout this build cannot read) or none.",
            &carried,
        );
        samples(
            &mut out,
            "proxy_map_update_failures_total",
            "counter",
            "BPF map writes the kernel refused (the sync is retried).",
            &one(self.map_update_failures.load(Relaxed)),
        );
        let refused: Vec<_> = self
            .services_refused
            .lock()
            .map(|m| {
                m.iter().map(|(k, v)| (format!(r#"{{reason="{k}"}}"#), v.to_string())).collect()
            })
            .unwrap_or_default();
        samples(
            &mut out,
            "proxy_services_refused",
            "gauge",
            "Services the BPF maps cannot hold as planned (--bpf-lb-map-max), by reason: not served, or served as before their last change.",
            &refused,
        );
        samples(
            &mut out,
            "proxy_conntrack_entries",
            "gauge",
            "Entries of the per-packet conntrack map (two per flow), at the last collection.",
            &one(self.conntrack_entries.load(Relaxed)),
        );
        let counters = self.datapath.lock().ok().and_then(|d| d.as_ref().map(CounterReader::read));
        let datapath: Vec<_> = counters
            .unwrap_or_default()
            .into_iter()
            .map(|(c, v)| (format!(r#"{{event="{}"}}"#, c.name()), v.to_string()))
            .collect();
        samples(
            &mut out,
            "proxy_datapath_events_total",
            "counter",
            "Events counted by the BPF programs, summed over CPUs.",
            &datapath,
        );
        out
    }

    /// Serves `/metrics`, `/healthz` (as on `--healthz-bind-address`: 503
    /// until the datapath serves; kube-proxy's metrics port answers `ok`
    /// from the start, which tells nothing) and `/proxyMode` on `addr`,
    /// from `runtime`.
    pub fn serve(self: Arc<Self>, runtime: &tokio::runtime::Handle, addr: std::net::SocketAddr) {
        let handler = Arc::new(move |_method: String, path: String| {
            let metrics = self.clone();
            async move {
                let text = |body: String| Reply::new(200, "text/plain; charset=utf-8", body);
                match path.as_str() {
                    "/metrics" => Reply::new(200, "text/plain; version=0.0.4", metrics.render()),
                    "/healthz" => metrics.health.reply(true, SystemTime::now()),
                    "/proxyMode" => text(metrics.mode.into()),
                    _ => Reply::not_found(),
                }
            }
        });
        http::serve_on(runtime, addr, "metrics", handler);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::NodeEligibility;

    fn metrics(mode: &'static str) -> Metrics {
        Metrics::new(
            Arc::new(ProxyHealth::new(Duration::from_secs(60), NodeEligibility::Eligible)),
            mode,
        )
    }

    #[test]
    fn renders_prometheus_text_with_kube_proxys_names() {
        let m = metrics("ebpf");
        m.invalid("Service");
        m.invalid("Service");
        m.source_error(std::path::Path::new("/m/a \"b\".yaml"), "yaml");
        m.syncs_ok.store(3, Relaxed);
        m.sync_duration.observe(Duration::from_millis(3));
        m.synced_at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let text = m.render();
        assert!(text.contains("proxy_invalid_objects_total{kind=\"Service\"} 2\n"), "{text}");
        assert!(text.contains("proxy_sync_total{result=\"ok\"} 3\n"));
        assert!(
            text.contains(r#"proxy_source_errors_total{file="/m/a \"b\".yaml",kind="yaml"} 1"#),
            "{text}"
        );
        assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.002\"} 0\n"), "{text}");
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.004\"} 1\n"));
        assert!(
            text.contains(
                "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n"
            )
        );
        assert!(
            text.contains(
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1700000000\n"
            ),
            "{text}"
        );
        assert!(text.contains("kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"300\"} 0\n"));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 0\n"));
        assert!(text.contains("# TYPE proxy_datapath_events_total counter\n"));
        assert!(!text.contains("iptables"), "no iptables metrics in eBPF mode");
        let text = metrics("iptables").render();
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 0\n"
        ));
        assert!(!text.contains("proxy_datapath_events_total"));
    }

    #[test]
    fn programming_buckets_are_kube_proxys() {
        let h = Histogram::programming_latency();
        assert_eq!(h.bounds.len(), 2 + 59 + 12 + 7);
        assert_eq!(&h.bounds[..4], &[0.25, 0.5, 1.0, 2.0]);
        assert_eq!(h.bounds[61], 60.0);
        assert_eq!(*h.bounds.last().unwrap(), 300.0);
    }

    #[test]
    fn refused_services_are_counted_by_reason_and_their_recovery_shows() {
        let m = metrics("ebpf");
        m.set_services_refused(["services_map_full", "services_map_full", "address_held"]);
        let text = m.render();
        assert!(
            text.contains("proxy_services_refused{reason=\"services_map_full\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("proxy_services_refused{reason=\"address_held\"} 1\n"));
        m.set_services_refused([]);
        let text = m.render();
        assert!(
            text.contains("proxy_services_refused{reason=\"services_map_full\"} 0\n"),
            "{text}"
        );
    }
}
