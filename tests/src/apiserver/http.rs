//! The server's HTTP side: binding in a lab namespace, routing requests,
//! and list and watch responses.

use super::*;

/// Binds a listener inside `netns` (this thread enters it, binds, and
/// returns to its own; the socket stays in the namespace).
pub(super) fn bind_in(netns: &str, addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
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

pub(super) async fn serve(
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
                async move {
                    let delay = page_delay(&state, &req);
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    Ok::<_, Infallible>(handle(state, req))
                }
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

/// How late to answer `req`: a list's pages after its first, as the test
/// asks (`ApiServer::set_page_delay`).
fn page_delay(state: &Mutex<State>, req: &Request<Incoming>) -> Duration {
    let query = req.uri().query().unwrap_or("");
    let page = query.split('&').any(|p| p.starts_with("continue="));
    match page && !query.split('&').any(|p| p.starts_with("watch=")) {
        true => state.lock().unwrap_or_else(|e| e.into_inner()).page_delay,
        false => Duration::ZERO,
    }
}

/// A response body: all at once, or a watch's stream.
pub(super) enum Body {
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

pub(super) fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    encoded_response(code, serde_json::to_vec(body).unwrap_or_default())
}

pub(super) fn encoded_response(code: StatusCode, json: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::Full(Some(Bytes::from(json))));
    *response.status_mut() = code;
    response.headers_mut().insert("content-type", "application/json".parse().expect("header"));
    response
}

/// `%XX` and `+` decoding of a query value.
pub(super) fn decode(text: &str) -> String {
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

pub(super) fn handle(shared: Arc<Mutex<State>>, req: Request<Incoming>) -> Response<Body> {
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

pub(super) fn list_response(
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
        // As the real server: only for a list without selectors.
        if selector.counts_remaining() {
            metadata["remainingItemCount"] = json!(1 + matching.count());
        }
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
pub(super) fn list_item(object: &Value) -> Bytes {
    let mut item = object.clone();
    if let Some(map) = item.as_object_mut() {
        map.remove("kind");
        map.remove("apiVersion");
    }
    Bytes::from(serde_json::to_vec(&item).unwrap_or_default())
}

pub(super) fn watch_response(
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
pub(super) fn spawn_watch_timers(
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

pub(super) fn streaming(
    rx: mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>,
) -> Response<Body> {
    let mut response = Response::new(Body::Stream(rx));
    response.headers_mut().insert("content-type", "application/json".parse().expect("header"));
    response
}
