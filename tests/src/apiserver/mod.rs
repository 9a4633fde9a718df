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

/// A label or field selector requirement.
#[derive(Clone, Debug, PartialEq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// The field selectors the server answers (others get 400, as the real
/// server for an unsupported field label).
const FIELDS: [&str; 3] = ["metadata.name", "metadata.namespace", "spec.clusterIP"];

impl Requirement {
    fn key(&self) -> &str {
        match self {
            Requirement::Exists(k)
            | Requirement::NotExists(k)
            | Requirement::Equals(k, _)
            | Requirement::NotEquals(k, _)
            | Requirement::In(k, _)
            | Requirement::NotIn(k, _) => k,
        }
    }

    fn matches(&self, get: &dyn Fn(&str) -> Option<String>) -> bool {
        match self {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Equals(k, v) => get(k).as_deref() == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k).as_deref() != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
        }
    }
}

/// Parses `a,!b,c=d,e!=f,g in (h,i),j notin (k)`.
fn parse_selector(text: &str) -> anyhow::Result<Vec<Requirement>> {
    let mut requirements = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        // A comma inside parentheses does not end a requirement.
        let end = {
            let mut depth = 0;
            rest.char_indices()
                .find(|(_, c)| {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    *c == ',' && depth == 0
                })
                .map_or(rest.len(), |(i, _)| i)
        };
        let term = rest[..end].trim();
        rest = rest.get(end + 1..).unwrap_or("").trim();
        let set = |op: &str| -> Option<(String, Vec<String>)> {
            let (key, values) = term.split_once(op)?;
            let values = values.trim().strip_prefix('(')?.strip_suffix(')')?;
            Some((
                key.trim().to_string(),
                values.split(',').map(|v| v.trim().to_string()).collect(),
            ))
        };
        let requirement = if let Some((k, vs)) = set(" notin ") {
            Requirement::NotIn(k, vs)
        } else if let Some((k, vs)) = set(" in ") {
            Requirement::In(k, vs)
        } else if let Some((k, v)) = term.split_once("!=") {
            Requirement::NotEquals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            Requirement::Equals(k.trim().into(), v.trim().into())
        } else if let Some(k) = term.strip_prefix('!') {
            Requirement::NotExists(k.trim().into())
        } else if !term.is_empty() {
            Requirement::Exists(term.into())
        } else {
            bail!("empty requirement in selector {text:?}");
        };
        requirements.push(requirement);
    }
    Ok(requirements)
}

/// What a list or watch request selects.
#[derive(Clone, Debug, Default)]
struct Selector {
    namespace: Option<String>,
    labels: Vec<Requirement>,
    fields: Vec<Requirement>,
}

impl Selector {
    fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        if self.namespace.as_ref().is_some_and(|ns| meta["namespace"].as_str() != Some(ns)) {
            return false;
        }
        let label = |k: &str| meta["labels"][k].as_str().map(str::to_string);
        let field = |k: &str| match k {
            "metadata.name" => meta["name"].as_str().map(str::to_string),
            "metadata.namespace" => Some(meta["namespace"].as_str().unwrap_or("").to_string()),
            // kube-proxy watches Services with spec.clusterIP!=None.
            "spec.clusterIP" => {
                Some(object["spec"]["clusterIP"].as_str().unwrap_or("").to_string())
            }
            _ => None,
        };
        self.labels.iter().all(|r| r.matches(&label))
            && self.fields.iter().all(|r| r.matches(&field))
    }
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

/// Binds a listener inside `netns` (this thread enters it, binds, and
/// returns to its own; the socket stays in the namespace).
fn bind_in(netns: &str, addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    let own = std::fs::File::open("/proc/thread-self/ns/net")?;
    let target = std::fs::File::open(format!("/run/netns/{netns}"))
        .with_context(|| format!("opening netns {netns}"))?;
    // SAFETY: valid namespace fds; this thread only.
    if unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("entering {netns}: {}", std::io::Error::last_os_error());
    }
    let listener = std::net::TcpListener::bind(addr);
    // SAFETY: as above.
    let back = unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWNET) };
    if back != 0 {
        // This thread is in the wrong namespace: nothing it does is safe.
        panic!("returning from {netns}: {}", std::io::Error::last_os_error());
    }
    let listener = listener.with_context(|| format!("binding {addr} in {netns}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

async fn serve(
    listener: std::net::TcpListener,
    state: Arc<Mutex<State>>,
    up: watch::Receiver<bool>,
    mut shutdown: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut shutdown => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        if !*up.borrow() {
            drop(stream);
            continue;
        }
        let (state, mut up) = (state.clone(), up.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(state, req)) }
            });
            let connection = http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = up.wait_for(|up| !*up) => {}
            }
        });
    }
}

/// A response body: all at once, or a watch's stream.
enum Body {
    Full(Option<Bytes>),
    Stream(mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>),
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            Body::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(rx) => rx.poll_recv(cx).map(|item| item.map(|r| r.map(Frame::data))),
        }
    }
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    encoded_response(code, serde_json::to_vec(body).unwrap_or_default())
}

fn encoded_response(code: StatusCode, json: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::Full(Some(Bytes::from(json))));
    *response.status_mut() = code;
    response.headers_mut().insert("content-type", "application/json".parse().expect("header"));
    response
}

/// `%XX` and `+` decoding of a query value.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match text.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(b) => {
                    out.push(b);
                    i += 2;
                }
                None => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn handle(shared: Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect();
    let mut state = shared.lock().unwrap_or_else(|e| e.into_inner());
    state.requests.push(format!("{} {}", req.method(), req.uri()));
    if state.failing {
        let body = status(500, "InternalError", "the lab API server fails on request");
        return json_response(StatusCode::INTERNAL_SERVER_ERROR, &body);
    }
    if req.method() != hyper::Method::GET {
        let body = status(405, "MethodNotAllowed", "the lab API server only reads");
        return json_response(StatusCode::METHOD_NOT_ALLOWED, &body);
    }
    if path == "/version" {
        let version = json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-lab"});
        return json_response(StatusCode::OK, &version);
    }
    let Some((kind, namespace, name)) = Kind::route(&path) else {
        return json_response(StatusCode::NOT_FOUND, &status(404, "NotFound", "not found"));
    };
    let selector = match (
        parse_selector(query.get("labelSelector").map_or("", String::as_str)),
        parse_selector(query.get("fieldSelector").map_or("", String::as_str)),
    ) {
        (Ok(labels), Ok(fields)) if fields.iter().all(|f| FIELDS.contains(&f.key())) => {
            Selector { namespace, labels, fields }
        }
        (Ok(_), Ok(_)) => {
            let message = "field label not supported";
            return json_response(StatusCode::BAD_REQUEST, &status(400, "BadRequest", message));
        }
        (Err(e), _) | (_, Err(e)) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &status(400, "BadRequest", &e.to_string()),
            );
        }
    };
    if let Some(name) = name {
        let ns = selector.namespace.clone().unwrap_or_default();
        return match state.objects.get(&(kind, ns, name.clone())) {
            Some(object) => json_response(StatusCode::OK, object),
            None => {
                let message = format!("{} \"{name}\" not found", kind.name());
                json_response(StatusCode::NOT_FOUND, &status(404, "NotFound", &message))
            }
        };
    }
    if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) {
        watch_response(&shared, &mut state, kind, selector, &query)
    } else {
        list_response(&state, kind, &selector, &query)
    }
}

fn list_response(
    state: &State,
    kind: Kind,
    selector: &Selector,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    // The continue token names the last object listed, so a page costs
    // its own size, not a scan of what came before.
    let after = query.get("continue").and_then(|c| c.split_once('/'));
    let start = match after {
        Some((ns, name)) => Bound::Excluded((kind, ns.to_string(), name.to_string())),
        None => Bound::Included((kind, String::new(), String::new())),
    };
    let limit: usize =
        query.get("limit").and_then(|l| l.parse().ok()).filter(|l| *l > 0).unwrap_or(usize::MAX);
    let mut matching = state
        .objects
        .range((start, Bound::Unbounded))
        .take_while(|(key, _)| key.0 == kind)
        .filter(|(_, object)| selector.matches(object));
    let mut items = Vec::new();
    let mut last = None;
    for (key, _) in matching.by_ref().take(limit) {
        items.extend_from_slice(state.items.get(key).map_or(&b"{}"[..], |item| &item[..]));
        items.push(b',');
        last = Some(key);
    }
    items.pop_if(|last| *last == b',');
    let mut metadata = json!({ "resourceVersion": state.rv.to_string() });
    if let Some((_, ns, name)) = last.filter(|_| matching.next().is_some()) {
        metadata["continue"] = json!(format!("{ns}/{name}"));
    }
    let head = json!({
        "kind": format!("{}List", kind.name()),
        "apiVersion": kind.api_version(),
        "metadata": metadata,
    });
    // `{...head, "items":[...]}`: the head's closing brace reopened.
    let mut list = serde_json::to_vec(&head).unwrap_or_default();
    list.pop();
    list.extend_from_slice(b",\"items\":[");
    list.extend_from_slice(&items);
    list.extend_from_slice(b"]}");
    encoded_response(StatusCode::OK, list)
}

/// An object as an item of a list, which carries no kind or apiVersion.
fn list_item(object: &Value) -> Bytes {
    let mut item = object.clone();
    if let Some(map) = item.as_object_mut() {
        map.remove("kind");
        map.remove("apiVersion");
    }
    Bytes::from(serde_json::to_vec(&item).unwrap_or_default())
}

fn watch_response(
    shared: &Arc<Mutex<State>>,
    state: &mut State,
    kind: Kind,
    selector: Selector,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    let (sink, rx) = mpsc::unbounded_channel();
    let from: Option<u64> =
        query.get("resourceVersion").and_then(|rv| rv.parse().ok()).filter(|rv| *rv > 0);
    let initial_events = query.get("sendInitialEvents").is_some_and(|v| v == "true");
    let bookmarks = query.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    match from {
        Some(rv) if !initial_events && rv < state.oldest_rv => {
            let message = format!("too old resource version: {rv} ({})", state.oldest_rv);
            let _ = sink.send(Ok(event("ERROR", &status(410, "Expired", &message))));
            // The real server ends the stream after the error.
            drop(sink);
            return streaming(rx);
        }
        Some(rv) if !initial_events => {
            for change in state.history.iter().filter(|c| c.rv > rv) {
                if let Some(line) = watch_event(kind, &selector, change) {
                    let _ = sink.send(Ok(line));
                }
            }
        }
        _ => {
            // No version, or a streaming list: the current state as ADDED.
            for (_, object) in
                state.objects.iter().filter(|(k, o)| k.0 == kind && selector.matches(o))
            {
                let _ = sink.send(Ok(event("ADDED", object)));
            }
            if initial_events {
                let end = json!({
                    "kind": kind.name(),
                    "apiVersion": kind.api_version(),
                    "metadata": {
                        "resourceVersion": state.rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                });
                let _ = sink.send(Ok(event("BOOKMARK", &end)));
            }
        }
    }
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    state.next_watch += 1;
    let id = state.next_watch;
    spawn_watch_timers(shared.clone(), id, sink.clone(), kind, bookmarks, timeout);
    state.watchers.push(Watcher { id, kind, selector, sink });
    streaming(rx)
}

/// Bookmarks while the watch lasts, and its end at `timeoutSeconds` (the
/// stream closes cleanly, as the real server's).
fn spawn_watch_timers(
    shared: Arc<Mutex<State>>,
    id: u64,
    sink: Sink,
    kind: Kind,
    bookmarks: bool,
    timeout: Duration,
) {
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(BOOKMARK_EVERY);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break,
                _ = tick.tick() => {}
                _ = sink.closed() => return,
            }
            if bookmarks {
                // Every change so far went to this watch as it happened:
                // the current version is where it may resume.
                let rv = shared.lock().map(|s| s.rv).unwrap_or_default();
                let mark = json!({
                    "kind": kind.name(),
                    "apiVersion": kind.api_version(),
                    "metadata": {"resourceVersion": rv.to_string()},
                });
                if sink.send(Ok(event("BOOKMARK", &mark))).is_err() {
                    return;
                }
            }
        }
        // Dropping every sender ends the body.
        if let Ok(mut state) = shared.lock() {
            state.watchers.retain(|w| w.id != id);
        }
    });
}

fn streaming(rx: mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>) -> Response<Body> {
    let mut response = Response::new(Body::Stream(rx));
    response.headers_mut().insert("content-type", "application/json".parse().expect("header"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_parse_like_kubernetes() {
        let s = parse_selector("!service.kubernetes.io/service-proxy-name,app=web,tier in (a, b)")
            .unwrap();
        assert_eq!(
            s,
            [
                Requirement::NotExists("service.kubernetes.io/service-proxy-name".into()),
                Requirement::Equals("app".into(), "web".into()),
                Requirement::In("tier".into(), vec!["a".into(), "b".into()]),
            ]
        );
        assert_eq!(
            parse_selector("metadata.name=node-a").unwrap(),
            [Requirement::Equals("metadata.name".into(), "node-a".into())]
        );
    }

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
