//! A small HTTP/1.1 responder for the agent's endpoints (metrics, health,
//! per-service health checks): one request per connection, answered from a
//! handler of (method, path). They run on a thread of their own, so a long
//! sync (an `iptables-restore` waiting for the xtables lock) never keeps a
//! probe waiting.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

/// Requests larger than this are cut: only the request line matters.
const MAX_REQUEST: usize = 8192;
/// A client that sends nothing for this long is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

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

    fn reason(&self) -> &'static str {
        match self.status {
            200 => "OK",
            404 => "Not Found",
            503 => "Service Unavailable",
            _ => "",
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut head = format!("HTTP/1.1 {} {}\r\n", self.status, self.reason());
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\nConnection: close\r\n\r\n", self.body.len()));
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(self.body.as_bytes());
        bytes
    }
}

/// The method and path (without query) of a request's first line.
fn request_line(request: &[u8]) -> (String, String) {
    let text = String::from_utf8_lossy(request);
    let mut words = text.lines().next().unwrap_or("").split_whitespace();
    let method = words.next().unwrap_or("").to_string();
    let target = words.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("").to_string();
    (method, path)
}

/// Answers every connection on `listener` with `handler` until the task is
/// dropped.
pub async fn serve<H, F>(listener: TcpListener, handler: Arc<H>)
where
    H: Fn(String, String) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send,
{
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            // Out of file descriptors, say: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < MAX_REQUEST {
                match tokio::time::timeout(READ_TIMEOUT, stream.read(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => request.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
            let (method, path) = request_line(&request);
            let reply = handler(method, path).await;
            let _ = stream.write_all(&reply.to_bytes()).await;
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
    F: Future<Output = Reply> + Send,
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
    use super::*;

    #[test]
    fn request_lines_and_replies() {
        assert_eq!(
            request_line(b"GET /healthz?verbose HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("GET".into(), "/healthz".into())
        );
        let reply = Reply::new(503, "application/json", "{}".into());
        let text = String::from_utf8(reply.to_bytes()).unwrap();
        assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{text}");
        assert!(text.ends_with("Content-Length: 2\r\nConnection: close\r\n\r\n{}"), "{text}");
    }
}
