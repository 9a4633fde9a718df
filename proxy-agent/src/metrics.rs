//! Prometheus text metrics on `--metrics-bind-address` (`/metrics`, and
//! `/healthz` for probes).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
};

use crate::backend::ebpf::CounterReader;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

#[derive(Default)]
pub struct Metrics {
    pub syncs_ok: AtomicU64,
    pub syncs_failed: AtomicU64,
    pub last_sync_seconds: AtomicU64,
    pub frontends: AtomicU64,
    pub backends: AtomicU64,
    pub conntrack_entries: AtomicU64,
    /// Served from their last good version after a bad update.
    pub kept_objects: AtomicU64,
    /// iptables mode: failed `iptables-restore` runs, and those of them
    /// that were partial syncs.
    pub restore_failures: AtomicU64,
    pub partial_restore_failures: AtomicU64,
    /// iptables mode: stale conntrack entries that could not be deleted.
    pub conntrack_cleanup_failures: AtomicU64,
    /// Failed attempts to attach the programs (or take over the datapath).
    pub activation_failures: AtomicU64,
    /// Failed removals of the other mode's datapath.
    pub mode_cleanup_failures: AtomicU64,
    /// iptables mode: full resyncs because the canary chain vanished.
    pub canary_resyncs: AtomicU64,
    invalid: Mutex<BTreeMap<String, u64>>,
    /// Read at each scrape, once the datapath is pinned.
    datapath: Mutex<Option<CounterReader>>,
}

impl Metrics {
    /// Counts one invalid object (or unreadable file) of `kind`.
    pub fn invalid(&self, kind: &str) {
        if let Ok(mut invalid) = self.invalid.lock() {
            *invalid.entry(kind.to_string()).or_default() += 1;
        }
    }

    pub fn set_datapath(&self, reader: CounterReader) {
        if let Ok(mut datapath) = self.datapath.lock() {
            *datapath = Some(reader);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        metric(
            "proxy_sync_total",
            "counter",
            "Syncs of the datapath with the desired state, by result.",
            &[
                (r#"{result="ok"}"#.into(), self.syncs_ok.load(Relaxed)),
                (r#"{result="error"}"#.into(), self.syncs_failed.load(Relaxed)),
            ],
        );
        metric(
            "proxy_last_sync_timestamp_seconds",
            "gauge",
            "Unix time of the last successful sync.",
            &[(String::new(), self.last_sync_seconds.load(Relaxed))],
        );
        metric(
            "proxy_frontends",
            "gauge",
            "Service frontends (address, port, protocol) in the datapath.",
            &[(String::new(), self.frontends.load(Relaxed))],
        );
        metric(
            "proxy_backends",
            "gauge",
            "Distinct backends in the datapath.",
            &[(String::new(), self.backends.load(Relaxed))],
        );
        metric(
            "proxy_conntrack_entries",
            "gauge",
            "Entries of the per-packet conntrack map (two per flow), at the last collection.",
            &[(String::new(), self.conntrack_entries.load(Relaxed))],
        );
        let invalid: Vec<_> = self
            .invalid
            .lock()
            .map(|m| m.iter().map(|(k, v)| (format!(r#"{{kind="{k}"}}"#), *v)).collect())
            .unwrap_or_default();
        metric(
            "proxy_invalid_objects_total",
            "counter",
            "Objects (or manifest files) rejected as invalid, by kind.",
            &invalid,
        );
        metric(
            "proxy_kept_objects_total",
            "counter",
            "Times an invalid update was ignored and the last good object kept.",
            &[(String::new(), self.kept_objects.load(Relaxed))],
        );
        metric(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "counter",
            "iptables mode: failed iptables-restore runs (each is retried as a full sync).",
            &[(String::new(), self.restore_failures.load(Relaxed))],
        );
        metric(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
            "counter",
            "Cumulative proxy iptables partial restore failures",
            &[(String::new(), self.partial_restore_failures.load(Relaxed))],
        );
        metric(
            "proxy_conntrack_cleanup_failures_total",
            "counter",
            "iptables mode: stale conntrack entry sets that could not be deleted (retried).",
            &[(String::new(), self.conntrack_cleanup_failures.load(Relaxed))],
        );
        metric(
            "proxy_activation_failures_total",
            "counter",
            "Failed attempts to take over the datapath (attach the programs); retried.",
            &[(String::new(), self.activation_failures.load(Relaxed))],
        );
        metric(
            "proxy_mode_cleanup_failures_total",
            "counter",
            "Failed removals of the other mode's datapath after a mode switch; retried.",
            &[(String::new(), self.mode_cleanup_failures.load(Relaxed))],
        );
        metric(
            "proxy_iptables_canary_resyncs_total",
            "counter",
            "iptables mode: full resyncs after KUBE-PROXY-CANARY vanished (rules flushed by another program).",
            &[(String::new(), self.canary_resyncs.load(Relaxed))],
        );
        let counters = self.datapath.lock().ok().and_then(|d| d.as_ref().map(CounterReader::read));
        let datapath: Vec<_> = counters
            .unwrap_or_default()
            .into_iter()
            .map(|(c, v)| (format!(r#"{{event="{}"}}"#, c.name()), v))
            .collect();
        metric(
            "proxy_datapath_events_total",
            "counter",
            "Events counted by the BPF programs, summed over CPUs.",
            &datapath,
        );
        out
    }
}

/// Serves the metrics until the listener fails.
pub async fn serve(listener: TcpListener, metrics: std::sync::Arc<Metrics>) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            // Out of file descriptors, say: back off instead of spinning.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut request = [0u8; 1024];
            let n = stream.read(&mut request).await.unwrap_or(0);
            let line = String::from_utf8_lossy(&request[..n]);
            let path = line.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = match path {
                "/metrics" => ("200 OK", metrics.render()),
                "/healthz" => ("200 OK", "ok\n".to_string()),
                _ => ("404 Not Found", "not found\n".to_string()),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let metrics = Metrics::default();
        metrics.invalid("Service");
        metrics.invalid("Service");
        metrics.syncs_ok.store(3, Relaxed);
        let text = metrics.render();
        assert!(text.contains("proxy_invalid_objects_total{kind=\"Service\"} 2\n"), "{text}");
        assert!(text.contains("proxy_sync_total{result=\"ok\"} 3\n"));
        assert!(text.contains("# TYPE proxy_datapath_events_total counter\n"));
        assert!(text.contains("# TYPE proxy_frontends gauge\n"));
    }
}
