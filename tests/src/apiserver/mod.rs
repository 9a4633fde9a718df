//! The test API server: the stand-in for kube-apiserver (which cannot be
//! installed here). It speaks the protocol kube-rs uses, as the real server
//! does: lists with `resourceVersion` and `limit`/`continue` pages, watches as
//! chunked streams of JSON events from a resource version, bookmarks, `410
//! Gone` (an `ERROR` event with an `Expired` status) for a version older than
//! its history, label and field selectors (an object leaving a watch's
//! selector is `DELETED` for it). Tests change objects, compact the history,
//! drop every connection, answer 500 to everything, or stop answering.
//!
//! It runs in a thread of the test process, on a socket bound inside a lab
//! namespace, so agents reach it at a lab address and nothing else can.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    convert::Infallible,
    net::SocketAddr,
    ops::Bound,
    os::fd::AsRawFd,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context as TaskContext, Poll},
    time::Duration,
};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body::Frame;
use hyper::{
    Request, Response, StatusCode, body::Incoming, server::conn::http1, service::service_fn,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

mod http;
mod selector;

use http::{bind_in, list_item, serve};
use selector::{FIELDS, Selector, parse_selector};

/// Events kept for watches that resume from an older resource version.
const HISTORY: usize = 10_000;
/// How often a watch that asked for them gets a bookmark.
const BOOKMARK_EVERY: Duration = Duration::from_secs(1);

/// The kinds the agent watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    fn parse(kind: &str) -> Option<Self> {
        match kind {
            "Service" => Some(Kind::Service),
            "EndpointSlice" => Some(Kind::EndpointSlice),
            "Node" => Some(Kind::Node),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            _ => "v1",
        }
    }

    fn namespaced(self) -> bool {
        self != Kind::Node
    }

    /// `(kind, namespace)` of a request path, and a name for a single GET.
    fn route(path: &str) -> Option<(Kind, Option<String>, Option<String>)> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (rest, group_ok) = match parts.as_slice() {
            ["api", "v1", rest @ ..] => (rest, true),
            ["apis", "discovery.k8s.io", "v1", rest @ ..] => (rest, false),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] => (Some(ns.to_string()), rest),
            rest => (None, rest),
        };
        let (resource, name) = match rest {
            [resource] => (*resource, None),
            [resource, name] => (*resource, Some(name.to_string())),
            _ => return None,
        };
        let kind = match (resource, group_ok) {
            ("services", true) => Kind::Service,
            ("nodes", true) => Kind::Node,
            ("endpointslices", false) => Kind::EndpointSlice,
            _ => return None,
        };
        Some((kind, namespace, name))
    }
}

type Key = (Kind, String, String);

/// One change, as watches see it.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    kind: Kind,
    /// The object before (none when created) and after (none when deleted).
    old: Option<Value>,
    new: Option<Value>,
}

/// A watch's channel: JSON lines, or an error that resets the connection.
type Sink = mpsc::UnboundedSender<Result<Bytes, std::io::Error>>;

struct Watcher {
    id: u64,
    kind: Kind,
    selector: Selector,
    sink: Sink,
}

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// Each object as a list item (no kind, no apiVersion), encoded when
    /// stored: a real API server serves lists from its watch cache, and
    /// the bench times the proxy's list, not this server's encoding.
    items: HashMap<Key, Bytes>,
    history: VecDeque<Change>,
    /// Watches from before this version get 410 Gone.
    oldest_rv: u64,
    watchers: Vec<Watcher>,
    /// Every request, `METHOD path?query`, for assertions.
    requests: Vec<String>,
    next_uid: u64,
    next_watch: u64,
    /// Every request gets 500 Internal Server Error.
    failing: bool,
    /// Each list page after the first is answered this late.
    page_delay: Duration,
}

fn event(kind: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({ "type": kind, "object": object })).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

impl State {
    /// Records a change and tells the watches it concerns.
    fn record(&mut self, kind: Kind, old: Option<Value>, new: Option<Value>) {
        let change = Change { rv: self.rv, kind, old, new };
        self.watchers.retain(|w| match watch_event(w.kind, &w.selector, &change) {
            Some(line) => w.sink.send(Ok(line)).is_ok(),
            None => !w.sink.is_closed(),
        });
        self.history.push_back(change);
        while self.history.len() > HISTORY {
            if let Some(dropped) = self.history.pop_front() {
                self.oldest_rv = dropped.rv;
            }
        }
    }

    fn apply(&mut self, mut object: Value) -> anyhow::Result<()> {
        let kind = object["kind"].as_str().and_then(Kind::parse).context("unknown kind")?;
        let name = object["metadata"]["name"].as_str().context("no metadata.name")?.to_string();
        let namespace = if kind.namespaced() {
            object["metadata"]["namespace"].as_str().unwrap_or("default").to_string()
        } else {
            String::new()
        };
        let key = (kind, namespace.clone(), name);
        let old = self.objects.get(&key).cloned();
        self.rv += 1;
        let meta = &mut object["metadata"];
        if kind.namespaced() {
            meta["namespace"] = json!(namespace);
        }
        meta["resourceVersion"] = json!(self.rv.to_string());
        let uid = match old.as_ref().and_then(|o| o["metadata"]["uid"].as_str()) {
            Some(uid) => uid.to_string(),
            None => {
                self.next_uid += 1;
                format!("00000000-0000-4000-8000-{:012x}", self.next_uid)
            }
        };
        meta["uid"] = json!(uid);
        meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        object["apiVersion"] = json!(kind.api_version());
        self.items.insert(key.clone(), list_item(&object));
        self.objects.insert(key, object.clone());
        self.record(kind, old, Some(object));
        Ok(())
    }

    fn delete(&mut self, key: &Key) -> bool {
        let Some(mut old) = self.objects.remove(key) else { return false };
        self.items.remove(key);
        self.rv += 1;
        // A DELETED event carries the object at its deletion's version.
        old["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.record(key.0, Some(old), None);
        true
    }
}

/// Whether a stored object and a manifest's say the same (ignoring what the
/// server sets).
fn same(stored: &Value, object: &Value) -> bool {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(meta) = v["metadata"].as_object_mut() {
            for field in ["resourceVersion", "uid", "creationTimestamp", "namespace"] {
                meta.remove(field);
            }
        }
        if let Some(map) = v.as_object_mut() {
            map.remove("apiVersion");
        }
        v
    };
    strip(stored) == strip(object)
}

/// The event a watch of `kind` with `selector` sees for `change`, if any.
fn watch_event(kind: Kind, selector: &Selector, change: &Change) -> Option<Bytes> {
    if change.kind != kind {
        return None;
    }
    let was = change.old.as_ref().filter(|o| selector.matches(o));
    let is = change.new.as_ref().filter(|o| selector.matches(o));
    match (was, is) {
        (None, Some(new)) => Some(event("ADDED", new)),
        (Some(_), Some(new)) => Some(event("MODIFIED", new)),
        (Some(old), None) => {
            // Left the selector (or deleted): the last state it was seen in,
            // at this change's version.
            let mut last = change.new.clone().unwrap_or_else(|| old.clone());
            last["metadata"]["resourceVersion"] = json!(change.rv.to_string());
            Some(event("DELETED", &last))
        }
        (None, None) => None,
    }
}

/// The test API server; stops when dropped.
pub struct ApiServer {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// `true`: answer; `false`: close every connection and refuse new ones.
    up: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl ApiServer {
    /// Serves on `addr` inside the network namespace `netns`.
    pub fn start_in(netns: &str, addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = bind_in(netns, addr)?;
        Self::start_on(listener)
    }

    /// Serves on a listener the caller bound, in a network namespace of its
    /// own (a harness that unshared one, as `list_source` does): never one
    /// bound in the host's namespace.
    pub fn start_on(listener: std::net::TcpListener) -> anyhow::Result<Self> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State { rv: 1, oldest_rv: 1, ..State::default() }));
        let (up, up_rx) = watch::channel(true);
        let (shutdown, shutdown_rx) = tokio::sync::oneshot::channel();
        let served = state.clone();
        let thread = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build()
            else {
                return;
            };
            runtime.block_on(serve(listener, served, up_rx, shutdown_rx));
        });
        Ok(ApiServer { addr, state, up, thread: Some(thread), shutdown: Some(shutdown) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates or updates these objects (Services, EndpointSlices, Nodes),
    /// one resource version each: a harness's hundred thousand without a
    /// YAML parse.
    pub fn apply_objects(&self, objects: impl IntoIterator<Item = Value>) -> anyhow::Result<()> {
        let mut state = self.state();
        for object in objects {
            state.apply(object)?;
        }
        Ok(())
    }

    /// Creates or updates every object of a YAML stream (Services,
    /// EndpointSlices, Nodes), one resource version each.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<()> {
        let mut state = self.state();
        // Empty documents are skipped.
        for value in serde_saphyr::read(&mut yaml.as_bytes()) {
            state.apply(value?)?;
        }
        Ok(())
    }

    /// Makes the Services and EndpointSlices those of a YAML stream: applies
    /// the new and changed ones, deletes the others (Nodes are left alone).
    pub fn replace_services(&self, yaml: &str) -> anyhow::Result<()> {
        let mut wanted = BTreeMap::new();
        for value in serde_saphyr::read(&mut yaml.as_bytes()) {
            let value: serde_json::Value = value?;
            let Some(kind) = value["kind"].as_str().and_then(Kind::parse) else { continue };
            if kind == Kind::Node {
                continue;
            }
            let name = value["metadata"]["name"].as_str().unwrap_or_default().to_string();
            let ns = value["metadata"]["namespace"].as_str().unwrap_or("default").to_string();
            wanted.insert((kind, ns, name), value);
        }
        let mut state = self.state();
        let gone: Vec<Key> = state
            .objects
            .keys()
            .filter(|k| k.0 != Kind::Node && !wanted.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            state.delete(&key);
        }
        for (key, object) in wanted {
            let unchanged = state.objects.get(&key).is_some_and(|old| same(old, &object));
            if !unchanged {
                state.apply(object)?;
            }
        }
        Ok(())
    }

    /// Deletes an object (`namespace` is ignored for Nodes); whether it was there.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> bool {
        let namespace = if kind.namespaced() { namespace } else { "" };
        self.state().delete(&(kind, namespace.to_string(), name.to_string()))
    }

    /// Deletes every object of `kind`.
    pub fn delete_all(&self, kind: Kind) {
        let mut state = self.state();
        let keys: Vec<Key> = state.objects.keys().filter(|k| k.0 == kind).cloned().collect();
        for key in keys {
            state.delete(&key);
        }
    }

    /// Forgets the history: watches resuming from before now get 410 Gone.
    pub fn compact(&self) {
        let mut state = self.state();
        state.oldest_rv = state.rv;
        state.history.clear();
    }

    /// Resets every open watch connection (as a load balancer in front of
    /// the API server would).
    pub fn drop_watches(&self) {
        for watcher in self.state().watchers.drain(..) {
            let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "dropped");
            let _ = watcher.sink.send(Err(reset));
        }
    }

    /// Answers every request with 500 Internal Server Error (a broken
    /// server behind a healthy load balancer), open watches reset; or
    /// answers normally again.
    pub fn set_failing(&self, failing: bool) {
        self.state().failing = failing;
        if failing {
            self.drop_watches();
        }
    }

    /// Answers each list page after a list's first `delay` late: a slow
    /// list, as from a large cluster or a busy server.
    pub fn set_page_delay(&self, delay: Duration) {
        self.state().page_delay = delay;
    }

    /// Stops answering (connections reset, new ones closed at once) or
    /// answers again.
    pub fn set_up(&self, up: bool) {
        if !up {
            self.drop_watches();
        }
        let _ = self.up.send(up);
    }

    /// The requests served so far, `GET path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.state().requests.clone()
    }

    /// The current resource version.
    pub fn resource_version(&self) -> u64 {
        self.state().rv
    }

    /// A kubeconfig for this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster: {{server: \"http://{}\"}}\nusers:\n- name: lab\n  user: {{}}\ncontexts:\n- name: lab\n  context: {{cluster: lab, user: lab}}\ncurrent-context: lab\n",
            self.addr
        )
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.drop_watches();
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{http::decode, *};

    #[test]
    fn routes_and_decoding() {
        assert_eq!(Kind::route("/api/v1/services"), Some((Kind::Service, None, None)));
        assert_eq!(
            Kind::route("/apis/discovery.k8s.io/v1/namespaces/lab/endpointslices"),
            Some((Kind::EndpointSlice, Some("lab".into()), None))
        );
        assert_eq!(Kind::route("/api/v1/nodes/n1"), Some((Kind::Node, None, Some("n1".into()))));
        assert_eq!(Kind::route("/api/v1/endpointslices"), None);
        assert_eq!(
            decode("%21service.kubernetes.io%2Fheadless"),
            "!service.kubernetes.io/headless"
        );
    }

    #[test]
    fn leaving_a_selector_is_a_deletion() {
        let selector = Selector { labels: parse_selector("!skip").unwrap(), ..Selector::default() };
        let plain = json!({"metadata": {"name": "a", "labels": {}}});
        let labelled = json!({"metadata": {"name": "a", "labels": {"skip": "yes"}}});
        let change =
            Change { rv: 7, kind: Kind::Service, old: Some(plain.clone()), new: Some(labelled) };
        let line = watch_event(Kind::Service, &selector, &change).unwrap();
        let event: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(event["type"], "DELETED");
        assert_eq!(event["object"]["metadata"]["resourceVersion"], "7");
        let back = Change { rv: 8, kind: Kind::Service, old: change.new.clone(), new: Some(plain) };
        let event: Value =
            serde_json::from_slice(&watch_event(Kind::Service, &selector, &back).unwrap()).unwrap();
        assert_eq!(event["type"], "ADDED");
    }
}
