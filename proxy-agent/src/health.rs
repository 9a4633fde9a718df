//! kube-proxy's health surfaces: `/healthz` and `/livez` (is the datapath
//! keeping up with the changes?), and the per-service health-check node
//! ports load balancers probe for `externalTrafficPolicy: Local` services.
//! Same JSON, headers and status rules as kube-proxy, except that
//! `/healthz` (and the health-check node ports) fail until the datapath
//! first serves the source: a node is not sent traffic before its rules are
//! in. `/livez` stays kube-proxy's (healthy while starting up), so a slow
//! first list never gets the agent restarted.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

pub use crate::node::NodeEligibility;
use crate::{
    http::{self, Reply},
    model::{IpFamily, ServiceName, ServicePort},
    time,
};

#[derive(Debug)]
struct State {
    /// The last successful sync.
    last_updated: Option<SystemTime>,
    /// The oldest change not yet synced (or failed sync not yet retried
    /// with success).
    oldest_queued: Option<SystemTime>,
    node: NodeEligibility,
    /// The datapath serves the source (the agent took over).
    serving: bool,
}

/// The proxier health kube-proxy serves on `--healthz-bind-address`.
#[derive(Debug)]
pub struct ProxyHealth {
    state: Mutex<State>,
    /// A change pending longer than this makes the proxy unhealthy
    /// (kube-proxy: twice the sync period).
    timeout: Duration,
    pub healthz_200: std::sync::atomic::AtomicU64,
    pub healthz_503: std::sync::atomic::AtomicU64,
    pub livez_200: std::sync::atomic::AtomicU64,
    pub livez_503: std::sync::atomic::AtomicU64,
}

impl ProxyHealth {
    pub fn new(timeout: Duration, node: NodeEligibility) -> Self {
        ProxyHealth {
            state: Mutex::new(State {
                last_updated: None,
                oldest_queued: None,
                node,
                serving: false,
            }),
            timeout,
            healthz_200: Default::default(),
            healthz_503: Default::default(),
            livez_200: Default::default(),
            livez_503: Default::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change is waiting to be synced (only the oldest counts).
    pub fn queued(&self, now: SystemTime) {
        self.state().oldest_queued.get_or_insert(now);
    }

    /// Everything queued is in the datapath.
    pub fn updated(&self, now: SystemTime) {
        let mut state = self.state();
        state.oldest_queued = None;
        state.last_updated = Some(now);
    }

    pub fn set_node(&self, node: NodeEligibility) {
        self.state().node = node;
    }

    /// The datapath serves the source from now on.
    pub fn serving(&self) {
        self.state().serving = true;
    }

    /// kube-proxy's proxier health: healthy unless a change (or a failed
    /// sync) has waited for the timeout.
    pub fn healthy(&self, now: SystemTime) -> bool {
        let state = self.state();
        state
            .oldest_queued
            .is_none_or(|queued| now.duration_since(queued).unwrap_or_default() < self.timeout)
    }

    /// The datapath serves, and keeps up: what `/healthz` and the
    /// health-check node ports answer 200 for.
    pub fn ready(&self, now: SystemTime) -> bool {
        self.healthy(now) && self.state().serving
    }

    /// `/healthz` (with the node's eligibility, once serving) or `/livez`
    /// (neither).
    pub fn reply(&self, healthz: bool, now: SystemTime) -> Reply {
        use std::sync::atomic::Ordering::Relaxed;
        let healthy = if healthz { self.ready(now) } else { self.healthy(now) };
        let state = self.state();
        let eligible = state.node != NodeEligibility::Ineligible;
        let ok = healthy && (!healthz || eligible);
        let zero = || "0001-01-01T00:00:00Z".to_string();
        let last = state.last_updated.map_or_else(zero, time::rfc3339_nano);
        // kube-proxy reports "now" as the last update when healthy.
        let top_last = if ok { time::rfc3339_nano(now) } else { last.clone() };
        let mut body = format!(
            "{{\"lastUpdated\":\"{top_last}\",\"currentTime\":\"{}\"",
            time::rfc3339_nano(now)
        );
        if healthz {
            body.push_str(&format!(",\"nodeEligible\":{eligible}"));
        }
        body.push_str(&format!(",\"healthy\":{healthy}"));
        if state.last_updated.is_some() {
            body.push_str(&format!(
                ",\"status\":{{\"IPv4\":{{\"lastUpdated\":\"{last}\",\"healthy\":{healthy}}}}}"
            ));
        }
        body.push('}');
        let counter = match (healthz, ok) {
            (true, true) => &self.healthz_200,
            (true, false) => &self.healthz_503,
            (false, true) => &self.livez_200,
            (false, false) => &self.livez_503,
        };
        counter.fetch_add(1, Relaxed);
        let mut reply = Reply::new(if ok { 200 } else { 503 }, "application/json", body);
        reply.headers.push(("X-Content-Type-Options", "nosniff".into()));
        reply
    }

    /// Serves `/healthz` and `/livez` on `addr`, from `runtime`.
    pub fn serve(self: Arc<Self>, runtime: &tokio::runtime::Handle, addr: SocketAddr) {
        let handler = Arc::new(move |_method: String, path: String| {
            let health = self.clone();
            async move {
                match path.as_str() {
                    "/healthz" => health.reply(true, SystemTime::now()),
                    "/livez" => health.reply(false, SystemTime::now()),
                    _ => Reply::not_found(),
                }
            }
        });
        http::serve_on(runtime, addr, "healthz", handler);
    }
}

/// One service's health-check node port: its name and this node's ready
/// endpoints (distinct addresses, over all its ports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCheck {
    pub service: ServiceName,
    pub local_endpoints: usize,
}

/// The health-check node ports service `ports` ask for on node `node_name`.
/// A dual-stack service's local endpoints are counted in its first family
/// (a pod is in both).
pub fn service_checks(ports: &[ServicePort], node_name: &str) -> BTreeMap<u16, ServiceCheck> {
    type Check = (ServiceName, IpFamily, std::collections::BTreeSet<IpAddr>);
    let mut checks: BTreeMap<u16, Check> = BTreeMap::new();
    for port in ports {
        let Some(hc) = port.health_check_node_port else { continue };
        let (_, family, ips) = checks
            .entry(hc)
            .or_insert_with(|| (port.name.service.clone(), port.family(), Default::default()));
        if *family != port.family() {
            continue;
        }
        // Ready only: a node with only terminating endpoints should lose
        // its load-balancer traffic.
        let local = port
            .endpoints
            .iter()
            .filter(|e| e.ready && !e.terminating && e.node_name() == Some(node_name));
        ips.extend(local.map(|e| e.addr.ip()));
    }
    checks
        .into_iter()
        .map(|(hc, (service, _, ips))| (hc, ServiceCheck { service, local_endpoints: ips.len() }))
        .collect()
}

/// kube-proxy's answer on a health-check node port.
pub fn service_check_reply(check: &ServiceCheck, proxy_healthy: bool) -> Reply {
    let count = check.local_endpoints;
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": \"{}\",\n\t\t\"name\": \"{}\"\n\t}},\n\t\"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        check.service.namespace, check.service.name
    );
    let status = if count != 0 && proxy_healthy { 200 } else { 503 };
    let mut reply = Reply::new(status, "application/json", body);
    reply.headers.push(("X-Content-Type-Options", "nosniff".into()));
    reply.headers.push(("X-Load-Balancing-Endpoint-Weight", count.to_string()));
    reply
}

/// The listeners of the health-check node ports, kept in step with the
/// services after each sync.
pub struct ServiceChecks {
    health: Arc<ProxyHealth>,
    /// The endpoints' runtime, where the listeners run.
    runtime: tokio::runtime::Handle,
    /// `--nodeport-addresses` matched against the node's addresses: the
    /// addresses to listen on (either family); empty means all (0.0.0.0).
    addresses: Vec<IpAddr>,
    checks: Arc<Mutex<BTreeMap<u16, ServiceCheck>>>,
    listeners: BTreeMap<u16, Vec<tokio::task::JoinHandle<()>>>,
}

impl ServiceChecks {
    pub fn new(
        health: Arc<ProxyHealth>,
        runtime: tokio::runtime::Handle,
        addresses: Vec<IpAddr>,
    ) -> Self {
        ServiceChecks {
            health,
            runtime,
            addresses,
            checks: Default::default(),
            listeners: BTreeMap::new(),
        }
    }

    /// Serves `wanted` from now on: opens new ports, closes gone ones.
    /// Returns the ports that could not be opened, with why.
    pub fn set(&mut self, wanted: BTreeMap<u16, ServiceCheck>) -> Vec<(u16, ServiceCheck, String)> {
        let mut failed = Vec::new();
        self.listeners.retain(|port, tasks| {
            let keep = wanted.contains_key(port);
            if !keep {
                tasks.iter().for_each(|t| t.abort());
            }
            keep
        });
        for (port, check) in &wanted {
            if self.listeners.contains_key(port) {
                continue;
            }
            let addresses = if self.addresses.is_empty() {
                vec![Ipv4Addr::UNSPECIFIED.into()]
            } else {
                self.addresses.clone()
            };
            // All of a port's addresses, or none: a port is retried whole.
            let bound: Result<Vec<_>, String> = addresses
                .iter()
                .map(|ip| {
                    bind(SocketAddr::from((*ip, *port))).map_err(|e| format!("{ip}:{port}: {e}"))
                })
                .collect();
            match bound {
                Ok(listeners) => {
                    let tasks = listeners.into_iter().map(|l| self.serve(l, *port)).collect();
                    self.listeners.insert(*port, tasks);
                }
                Err(why) => failed.push((*port, check.clone(), why)),
            }
        }
        if let Ok(mut checks) = self.checks.lock() {
            *checks = wanted;
        }
        failed
    }

    fn serve(&self, listener: std::net::TcpListener, port: u16) -> tokio::task::JoinHandle<()> {
        let (checks, health) = (self.checks.clone(), self.health.clone());
        let handler = Arc::new(move |_method: String, _path: String| {
            let check = checks.lock().ok().and_then(|c| c.get(&port).cloned());
            let healthy = health.ready(SystemTime::now());
            async move {
                match check {
                    Some(check) => service_check_reply(&check, healthy),
                    None => Reply::not_found(),
                }
            }
        });
        self.runtime.spawn(async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => http::serve(listener, handler).await,
                Err(e) => tracing::error!(port, "health-check node port: {e}"),
            }
        })
    }
}

/// A listening socket, bound here (so failures are known at once) and
/// served from the endpoints' runtime.
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn healthz_follows_pending_changes_and_the_node() {
        let health = ProxyHealth::new(Duration::from_secs(60), NodeEligibility::Eligible);
        let t0 = at(1_748_772_000, 0);
        // Before the datapath serves: /healthz fails, /livez does not.
        let starting = health.reply(true, t0);
        assert_eq!(starting.status, 503);
        assert_eq!(
            starting.body,
            "{\"lastUpdated\":\"0001-01-01T00:00:00Z\",\"currentTime\":\"2025-06-01T10:00:00Z\",\"nodeEligible\":true,\"healthy\":false}"
        );
        assert_eq!(health.reply(false, t0).status, 200);
        health.serving();
        let reply = health.reply(true, t0);
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.body,
            "{\"lastUpdated\":\"2025-06-01T10:00:00Z\",\"currentTime\":\"2025-06-01T10:00:00Z\",\"nodeEligible\":true,\"healthy\":true}"
        );
        health.updated(t0);
        health.queued(t0 + Duration::from_secs(1));
        // Pending for 59 s: fine; for 60 s: unhealthy.
        assert_eq!(health.reply(false, t0 + Duration::from_secs(60)).status, 200);
        let late = health.reply(true, t0 + Duration::from_secs(61));
        assert_eq!(late.status, 503);
        assert_eq!(
            late.body,
            "{\"lastUpdated\":\"2025-06-01T10:00:00Z\",\"currentTime\":\"2025-06-01T10:01:01Z\",\"nodeEligible\":true,\"healthy\":false,\"status\":{\"IPv4\":{\"lastUpdated\":\"2025-06-01T10:00:00Z\",\"healthy\":false}}}"
        );
        health.updated(t0 + Duration::from_secs(62));
        health.set_node(NodeEligibility::Ineligible);
        assert_eq!(health.reply(true, t0 + Duration::from_secs(63)).status, 503);
        let livez = health.reply(false, t0 + Duration::from_secs(63));
        assert_eq!(livez.status, 200, "livez ignores the node");
        assert!(!livez.body.contains("nodeEligible"));
        assert_eq!(health.healthz_503.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    #[test]
    fn service_checks_count_ready_local_endpoint_addresses() {
        use test_objects::{Protocol::Tcp, ep, port, service};
        let web = service("lab", "web").load_balancer_type().cluster_ip("10.96.0.10");
        let web = web.external_policy("Local").health_check_node_port(32000);
        let web = web.port(port("a", 80).node_port(30080)).port(port("b", 81).node_port(30081));
        let slice = web.slice().port("a", 8080, Tcp).port("b", 8081, Tcp).endpoints([
            ep("10.244.1.2").node("n1"),
            ep("10.244.1.3").node("n1").ready(false).serving(true).terminating(true),
            ep("10.244.2.2").node("n2"),
        ]);
        let model = crate::source::model_of(&[web.build()], &[slice.build()]);
        let ports: Vec<ServicePort> = model.ports().cloned().collect();
        let checks = service_checks(&ports, "n1");
        let check = &checks[&32000];
        assert_eq!(check.local_endpoints, 1, "one address over two ports; terminating ones out");
        let reply = service_check_reply(check, true);
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"lab\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"
        );
        assert!(reply.headers.contains(&("X-Load-Balancing-Endpoint-Weight", "1".into())));
        let none = service_checks(&ports, "n3");
        assert_eq!(service_check_reply(&none[&32000], true).status, 503);
        assert_eq!(service_check_reply(check, false).status, 503);
    }
}
