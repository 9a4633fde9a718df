use super::*;
use crate::health::NodeEligibility;

fn metrics(mode: &'static str) -> Arc<Metrics> {
    Arc::new(Metrics::new(
        Arc::new(ProxyHealth::new(Duration::from_secs(60), NodeEligibility::Eligible)),
        mode,
    ))
}

fn text(metrics: &Arc<Metrics>) -> String {
    render(&metrics.registry())
}

/// The sample names of a scrape, in order of first appearance.
fn sample_names(text: &str) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.sort_unstable();
    names
}

#[test]
fn renders_openmetrics_text_with_kube_proxys_names() {
    let m = metrics("ebpf");
    m.invalid("Service");
    m.invalid("Service");
    m.source_error(std::path::Path::new("/m/a \"b\".yaml"), "yaml");
    m.syncs_ok.store(3, Relaxed);
    m.sync_duration.observe(Duration::from_millis(3));
    m.synced_at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    let text = text(&m);
    assert!(text.contains("proxy_invalid_objects_total{kind=\"Service\"} 2\n"), "{text}");
    assert!(text.contains("proxy_sync_total{result=\"ok\"} 3\n"));
    assert!(
        text.contains(r#"proxy_source_errors_total{file="/m/a \"b\".yaml",kind="yaml"} 1"#),
        "{text}"
    );
    assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n"));
    assert!(text.contains("# HELP kubeproxy_sync_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency in seconds\n"), "{text}");
    assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.002\"} 0\n"), "{text}");
    assert!(text.contains(
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.004\"} 1\n"
    ));
    assert!(
        text.contains("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n")
    );
    assert!(
        text.contains(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1700000000.0\n"
        ),
        "{text}"
    );
    assert!(text.contains(
        "kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"300.0\"} 0\n"
    ));
    assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 0\n"));
    // OpenMetrics: a counter's family is named without `_total`, its
    // samples with it.
    assert!(text.contains("# TYPE proxy_datapath_events counter\n"), "{text}");
    assert!(
        text.contains(
            "# HELP proxy_sync Syncs of the datapath with the desired state, by result.\n"
        )
    );
    assert!(text.ends_with("# EOF\n"));
    assert!(!text.contains("iptables"), "no iptables metrics in eBPF mode");
    let text = self::text(&metrics("iptables"));
    assert!(text.contains(
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 0\n"
    ));
    assert!(!text.contains("proxy_datapath_events_total"));
}

/// The IPv6 family's series, once the datapath serves it: its rules'
/// figures are its own, the sync's are both families'.
#[test]
fn ipv6_series_appear_beside_ipv4_once_served() {
    let m = metrics("iptables");
    m.rules(IpFamily::V6).restore_failures.fetch_add(2, Relaxed);
    m.rules(IpFamily::V6).set_written(&[("nat", 7)]);
    m.rules(IpFamily::V4).set_written(&[("nat", 10)]);
    // Each family's rules timed apart: a full IPv4 sync, a partial IPv6 one.
    m.rules(IpFamily::V4).synced(Duration::from_millis(3), true);
    m.rules(IpFamily::V6).synced(Duration::from_millis(500), false);
    let before = text(&m);
    assert!(!before.contains("_seconds_count{ip_family=\"IPv6\"}"), "not served:\n{before}");
    m.ipv6_served.store(true, Relaxed);
    let text = text(&m);
    for line in [
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 0\n",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 2\n",
        "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"} 10\n",
        "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv6\",table=\"nat\"} 7\n",
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 1\n",
        "kubeproxy_sync_proxy_rules_duration_seconds_sum{ip_family=\"IPv6\"} 0.5\n",
        "kubeproxy_sync_proxy_rules_duration_seconds_sum{ip_family=\"IPv4\"} 0.003\n",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 0\n",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 1\n",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
}

/// Every sample name the hand-written text format had, in each mode.
#[test]
fn sample_names_are_unchanged() {
    let histograms = |names: &[&str]| -> Vec<String> {
        let suffixes = ["_bucket", "_count", "_sum"];
        names.iter().flat_map(|n| suffixes.map(|s| format!("{n}{s}"))).collect()
    };
    let common = [
        "kubeproxy_proxy_healthz_total",
        "kubeproxy_proxy_livez_total",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "proxy_activation_failures_total",
        "proxy_apiserver_watch_errors_total",
        "proxy_backends",
        "proxy_frontends",
        "proxy_health_check_node_port_failures_total",
        "proxy_invalid_objects_total",
        "proxy_kept_objects_total",
        "proxy_mode_cleanup_failures_total",
        "proxy_source_errors_total",
        "proxy_sync_total",
        "proxy_unserved_service_ports",
    ];
    let ebpf = [
        "proxy_conntrack_entries",
        "proxy_map_entries",
        "proxy_map_update_failures_total",
        "proxy_state_map_carried",
    ];
    let iptables = [
        "kubeproxy_sync_proxy_rules_iptables_last",
        "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "proxy_conntrack_cleanup_failures_total",
        "proxy_iptables_canary_resyncs_total",
    ];
    let kube_histograms = [
        "kubeproxy_network_programming_duration_seconds",
        "kubeproxy_sync_proxy_rules_duration_seconds",
    ];
    let iptables_histograms = [
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    ];
    for (mode, own) in [("ebpf", &ebpf[..]), ("iptables", &iptables[..])] {
        let m = metrics(mode);
        // Every labelled family with a sample.
        m.invalid("Service");
        m.source_error(std::path::Path::new("a.yaml"), "yaml");
        m.set_apiserver_errors([("Service", 1)].into());
        m.set_map_entries(&[("SERVICES", 2)]);
        m.set_carried(vec![("CONNTRACK", "reused")]);
        m.rules(IpFamily::V4).set_written(&[("nat", 10)]);
        let mut expected: Vec<String> = common.iter().chain(own).map(ToString::to_string).collect();
        expected.extend(histograms(&kube_histograms));
        if mode == "iptables" {
            expected.extend(histograms(&iptables_histograms));
        }
        expected.sort_unstable();
        let text = text(&m);
        assert_eq!(sample_names(&text), expected, "{mode}:\n{text}");
    }
}

#[test]
fn programming_buckets_are_kube_proxys() {
    let bounds = programming_buckets();
    assert_eq!(bounds.len(), 2 + 59 + 12 + 7);
    assert_eq!(&bounds[..4], &[0.25, 0.5, 1.0, 2.0]);
    assert_eq!(bounds[61], 60.0);
    assert_eq!(*bounds.last().unwrap(), 300.0);
    let sync: Vec<f64> = exponential_buckets(0.001, 2.0, 15).collect();
    assert_eq!(sync, (0..15).map(|i| 0.001 * f64::from(1u32 << i)).collect::<Vec<_>>());
}

#[test]
fn refused_services_are_counted_by_reason_and_their_recovery_shows() {
    let m = metrics("ebpf");
    m.set_services_refused(["services_map_full", "services_map_full", "address_held"]);
    let scrape = text(&m);
    assert!(
        scrape.contains("proxy_services_refused{reason=\"services_map_full\"} 2\n"),
        "{scrape}"
    );
    assert!(scrape.contains("proxy_services_refused{reason=\"address_held\"} 1\n"));
    m.set_services_refused([]);
    let scrape = text(&m);
    assert!(
        scrape.contains("proxy_services_refused{reason=\"services_map_full\"} 0\n"),
        "{scrape}"
    );
}
