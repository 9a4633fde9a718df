//! The agent's endpoints (metrics, health, per-service health checks),
//! served by hyper: HTTP/1.1, one request per connection, answered from a
//! handler of (method, path). They run on a runtime thread of their own, so
//! a long sync (an `iptables-restore` waiting for the xtables lock) never
//! keeps a probe waiting; request heads are bounded in size and time, and
//! every connection in time, so slow or malformed clients cannot pile up.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
    sync::Semaphore,
};

/// Larger request heads are refused (431): only the request line matters.
/// hyper's smallest buffer.
const MAX_REQUEST: usize = 8192;
/// How long a connection may take.
#[derive(Clone, Copy, Debug)]
struct Timeouts {
    /// A client that has not sent its request head by then is dropped
    /// (slowloris).
    read: Duration,
    /// Any connection is closed after this (a client that never reads its
    /// response, a body that never ends).
    connection: Duration,
}

const TIMEOUTS: Timeouts =
    Timeouts { read: Duration::from_secs(10), connection: Duration::from_secs(30) };
/// Connections served at once over all the endpoints; past it, new ones
/// wait in the kernel's accept queue until a slot frees (at the latest when
/// a slow client's time is up), so file descriptors stay bounded.
const MAX_CONNECTIONS: usize = 4096;

static CONNECTIONS: Semaphore = Semaphore::const_new(MAX_CONNECTIONS);

/// A response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Reply {
    pub fn new(status: u16, content_type: &str, body: String) -> Self {
        Reply { status, headers: vec![("Content-Type", content_type.to_string())], body }
    }

    pub fn not_found() -> Self {
        Reply::new(404, "text/plain; charset=utf-8", "404 page not found\n".into())
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let mut response = Response::builder().status(self.status);
        for (name, value) in &self.headers {
            response = response.header(*name, value);
        }
        response.body(Full::new(Bytes::from(self.body))).unwrap_or_else(|_| {
            let mut error = Response::new(Full::default());
            *error.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
            error
        })
    }
}

/// Serves one connection with `handler`, within the limits above.
async fn serve_connection<IO, H, F>(io: IO, handler: Arc<H>, timeouts: Timeouts)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(String, String) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send,
{
    let service = service_fn(move |request: Request<Incoming>| {
        let handler = handler.clone();
        async move {
            let (method, path) = (request.method().to_string(), request.uri().path().to_string());
            Ok::<_, Infallible>(handler(method, path).await.into_response())
        }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.read)
        .max_buf_size(MAX_REQUEST)
        .keep_alive(false)
        .title_case_headers(true)
        .serve_connection(TokioIo::new(io), service);
    // A client that sends garbage gets a 400 and is closed: nothing to log.
    let _ = tokio::time::timeout(timeouts.connection, connection).await;
}

/// Answers every connection on `listener` with `handler` until the task is
/// dropped.
pub async fn serve<H, F>(listener: TcpListener, handler: Arc<H>)
where
    H: Fn(String, String) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    loop {
        let Ok(slot) = CONNECTIONS.acquire().await else { return };
        let Ok((stream, _)) = listener.accept().await else {
            // Out of file descriptors, say: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            serve_connection(stream, handler, TIMEOUTS).await;
            drop(slot);
        });
    }
}

/// The endpoints' thread: a runtime of its own, serving until the process
/// ends. Spawn onto the handle.
pub fn server_thread() -> std::io::Result<tokio::runtime::Handle> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("http".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    Ok(handle)
}

/// Serves `handler` on `addr` from `runtime`, binding again every 5 s while
/// the address is taken (as kube-proxy does).
pub fn serve_on<H, F>(
    runtime: &tokio::runtime::Handle,
    addr: std::net::SocketAddr,
    what: &'static str,
    handler: Arc<H>,
) where
    H: Fn(String, String) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    runtime.spawn(async move {
        loop {
            match TcpListener::bind(addr).await {
                Ok(listener) => return serve(listener, handler).await,
                Err(e) => {
                    tracing::error!(%addr, "could not serve {what} (retrying in 5 s): {e}");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};

    use super::*;

    /// A connection served by a handler that echoes the method and path
    /// into a 503; the client's end.
    fn connect() -> DuplexStream {
        connect_within(TIMEOUTS)
    }

    fn connect_within(timeouts: Timeouts) -> DuplexStream {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let handler = Arc::new(|method: String, path: String| async move {
            Reply::new(503, "application/json", format!("{method} {path}"))
        });
        tokio::spawn(serve_connection(server, handler, timeouts));
        client
    }

    async fn response(client: &mut DuplexStream) -> String {
        let mut response = Vec::new();
        let _ = client.read_to_end(&mut response).await;
        String::from_utf8_lossy(&response).into_owned()
    }

    #[tokio::test]
    async fn requests_get_the_handlers_reply() {
        let mut client = connect();
        client.write_all(b"GET /healthz?verbose HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let text = response(&mut client).await;
        assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{text}");
        assert!(text.contains("Content-Type: application/json\r\n"), "{text}");
        assert!(text.contains("Content-Length: 12\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nGET /healthz"), "{text}");
    }

    #[tokio::test]
    async fn garbage_and_endless_heads_are_refused() {
        let mut client = connect();
        client.write_all(b"\x01\x02 not http at all\r\n\r\n").await.unwrap();
        assert!(response(&mut client).await.starts_with("HTTP/1.1 400 "));
        let mut client = connect();
        client.write_all(b"GET / HTTP/1.1\r\nX: ").await.unwrap();
        let header = vec![b'a'; 2 * MAX_REQUEST];
        // The server stops reading once its buffer is full: not all of it
        // may be taken.
        let _ = client.write_all(&header).await;
        assert!(response(&mut client).await.starts_with("HTTP/1.1 431 "));
    }

    #[tokio::test]
    async fn slow_clients_are_dropped() {
        let timeouts =
            Timeouts { read: Duration::from_millis(200), connection: Duration::from_secs(30) };
        let mut client = connect_within(timeouts);
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let start = tokio::time::Instant::now();
        let text = response(&mut client).await;
        assert!(!text.contains("GET /"), "{text}");
        let took = start.elapsed();
        assert!(took >= timeouts.read, "dropped once its time is up ({took:?})");
        assert!(took < timeouts.connection, "by the read timeout ({took:?})");
    }
}
