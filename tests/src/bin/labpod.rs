//! The lab's pod process: a server that answers with its name, or a client
//! that reports who answered. It enters its network namespace (and, for
//! clients under socket LB, the test cgroup) itself before opening a socket.
//!
//! Every answer line is `name=<pod> local=<ip:port> peer=<ip:port>`, as the
//! server saw the connection; clients print one line per attempt:
//! `ok ms=<elapsed> from=<reply source or peer> <answer>` or
//! `err ms=<elapsed> kind=<io::ErrorKind>`. A request for `/bytes/N` is
//! answered with the answer line and N bytes of padding after it (bulk
//! transfers); the `bulk` client reports how many arrived as `bytes=N`
//! before the answer. A request with a `Content-Length` of N (the `upload`
//! client's) has its N bytes read and counted, answered `bytes=<received>`
//! before the answer line.
//!
//! SCTP associations (one-to-one sockets, which read and write as TCP
//! connections do) are served and made as TCP connections are: `--sctp
//! PORT` serves, the `sctp` client connects.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

const USAGE: &str = "usage: labpod --netns NAME [--cgroup DIR] [--timeout-ms MS] \
    (serve --name NAME [--dual-stack] [--tcp PORT]... [--udp PORT]... [--echo PORT]... \
    [--sctp PORT]... \
    | (tcp|sctp) ADDR COUNT [--interval-ms MS] [--source-port-base PORT] \
    | tcp-concurrent ADDR COUNT \
    | stream ADDR COUNT [--interval-ms MS] \
    | udp ADDR COUNT [--interval-ms MS] [--connect [--reconnect]] [--socket-per-datagram] \
    [--source-port-base PORT] \
    [--size BYTES] | http ADDR PATH [--full] | http-abuse ADDR PATH... \
    | bulk ADDR BYTES | upload ADDR BYTES)";

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let netns = take_opt(&mut args, "--netns").context(USAGE)?;
    let cgroup = take_opt(&mut args, "--cgroup");
    enter_netns(&netns)?;
    raise_nofile_limit();
    if let Some(cgroup) = cgroup {
        std::fs::write(format!("{cgroup}/cgroup.procs"), std::process::id().to_string())
            .with_context(|| format!("joining cgroup {cgroup}"))?;
    }
    let timeout =
        Duration::from_millis(take_opt(&mut args, "--timeout-ms").map_or(Ok(2000), |t| t.parse())?);
    match args.first().map(String::as_str) {
        Some("serve") => serve(&mut args),
        Some("tcp") => tcp_client(&mut args, timeout, Stream::Tcp),
        Some("sctp") => tcp_client(&mut args, timeout, Stream::Sctp),
        Some("tcp-concurrent") => tcp_concurrent(&args, timeout),
        Some("stream") => stream_client(&mut args, timeout),
        Some("udp") => udp_client(&mut args, timeout),
        Some("http") => http_get(&args, timeout),
        Some("http-abuse") => http_abuse(&args, timeout),
        Some("bulk") => bulk_client(&args, timeout),
        Some("upload") => upload_client(&args, timeout),
        _ => bail!(USAGE),
    }
}

/// The protocol of a stream socket.
#[derive(Clone, Copy)]
enum Stream {
    Tcp,
    Sctp,
}

impl Stream {
    fn protocol(self) -> socket2::Protocol {
        match self {
            Stream::Tcp => socket2::Protocol::TCP,
            Stream::Sctp => socket2::Protocol::from(libc::IPPROTO_SCTP),
        }
    }
}

/// A listening SCTP one-to-one socket on `any:port`, as a `TcpListener`:
/// accept, read and write are the same calls.
fn sctp_listener(any: &str, port: &str) -> anyhow::Result<TcpListener> {
    let addr: SocketAddr = format!("{any}:{port}").parse()?;
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(Stream::Sctp.protocol()),
    )
    .context("an SCTP socket (is SCTP in this kernel?)")?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    Ok(socket.into())
}

fn take_opt(args: &mut Vec<String>, name: &str) -> Option<String> {
    let i = args.iter().position(|a| a == name)?;
    args.remove(i);
    (i < args.len()).then(|| args.remove(i))
}

fn take_all(args: &mut Vec<String>, name: &str) -> Vec<String> {
    std::iter::from_fn(|| take_opt(args, name)).collect()
}

/// Servers and the concurrent client hold a thousand sockets and more.
fn raise_nofile_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-parameter, then a valid limit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn enter_netns(name: &str) -> anyhow::Result<()> {
    let file = std::fs::File::open(format!("/run/netns/{name}"))
        .with_context(|| format!("opening netns {name}"))?;
    // SAFETY: a valid namespace fd; the process is still single-threaded.
    if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) } != 0 {
        bail!("setns {name}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn answer(name: &str, local: SocketAddr, peer: SocketAddr) -> String {
    format!("name={name} local={} peer={}", canonical(local), canonical(peer))
}

/// An IPv4 address as IPv4, also where a dual-stack socket saw it as
/// v4-mapped IPv6 (`::ffff:a.b.c.d`).
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn serve(args: &mut Vec<String>) -> anyhow::Result<()> {
    let name = take_opt(args, "--name").context(USAGE)?;
    // Dual-stack sockets take both families (IPv4 as v4-mapped addresses).
    let any = match args.iter().position(|a| a == "--dual-stack") {
        Some(i) => {
            args.remove(i);
            "[::]"
        }
        None => "0.0.0.0",
    };
    let mut threads = Vec::new();
    let mut listeners: Vec<(TcpListener, Handler)> = Vec::new();
    for port in take_all(args, "--tcp") {
        listeners.push((TcpListener::bind(format!("{any}:{port}"))?, serve_tcp));
    }
    for port in take_all(args, "--echo") {
        listeners.push((TcpListener::bind(format!("{any}:{port}"))?, serve_echo));
    }
    for port in take_all(args, "--sctp") {
        listeners.push((sctp_listener(any, &port)?, serve_tcp));
    }
    for (listener, serve) in listeners {
        let name = name.clone();
        threads.push(std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let name = name.clone();
                std::thread::spawn(move || serve(&name, stream));
            }
        }));
    }
    for port in take_all(args, "--udp") {
        let socket = UdpSocket::bind(format!("{any}:{port}"))?;
        let name = name.clone();
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            let local = socket.local_addr().expect("bound socket");
            while let Ok((_, peer)) = socket.recv_from(&mut buf) {
                let _ = socket.send_to(answer(&name, local, peer).as_bytes(), peer);
            }
        }));
    }
    // The harness waits for this line before sending traffic.
    println!("ready");
    std::io::stdout().flush()?;
    for thread in threads {
        let _ = thread.join();
    }
    Ok(())
}

/// What a server does with each connection it accepts.
type Handler = fn(&str, TcpStream);

/// Answers one HTTP/1.0-style request and closes. The whole request is read
/// first: closing with unread bytes would make the kernel send a reset.
fn serve_tcp(name: &str, mut stream: TcpStream) {
    // Long enough for a client that opens a thousand connections first.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else { return };
    let mut body = answer(name, local, peer);
    if let Some(length) = content_length(&request) {
        let head = request.windows(4).position(|w| w == b"\r\n\r\n").map_or(0, |i| i + 4);
        let mut received = request.len() - head;
        while received < length {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => received += n,
            }
        }
        body = format!("bytes={received} {body}");
    }
    if let Some(size) = padding_requested(&request) {
        body.push('\n');
        body.extend(std::iter::repeat_n('x', size));
    }
    let response = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    let _ = stream.write_all(response.as_bytes());
}

/// A long-lived connection: one answer line per line received, until the
/// client closes.
fn serve_echo(name: &str, stream: TcpStream) {
    let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else { return };
    let Ok(mut writer) = stream.try_clone() else { return };
    let answer = format!("{}\n", answer(name, local, peer));
    for line in BufReader::new(stream).lines() {
        if line.is_err() || writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// The `Content-Length` of a request's head.
fn content_length(request: &[u8]) -> Option<usize> {
    String::from_utf8_lossy(request)
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: ")?.trim().parse().ok())
}

/// N for a request of `/bytes/N`.
fn padding_requested(request: &[u8]) -> Option<usize> {
    let line = String::from_utf8_lossy(request.split(|b| *b == b'\n').next()?);
    line.split_whitespace().nth(1)?.strip_prefix("/bytes/")?.parse().ok()
}

fn target(args: &[String]) -> anyhow::Result<(SocketAddr, usize)> {
    let addr = args.get(1).context(USAGE)?.parse()?;
    let count = args.get(2).map_or(Ok(1), |c| c.parse())?;
    Ok((addr, count))
}

fn report(start: Instant, result: std::io::Result<(SocketAddr, String)>) {
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    match result {
        Ok((from, body)) => println!("ok ms={ms:.3} from={from} {}", body.trim()),
        Err(e) => println!("err ms={ms:.3} kind={:?}", e.kind()),
    }
}

/// COUNT sequential connections (or SCTP associations), `--interval-ms`
/// apart; `from` is what getpeername returned. Each line is flushed as it
/// is printed. With `--source-port-base P`, connection `i` is made from
/// port `P + i` (the same tuples again in a later run).
fn tcp_client(args: &mut Vec<String>, timeout: Duration, stream: Stream) -> anyhow::Result<()> {
    let interval = take_opt(args, "--interval-ms").map_or(Ok(0), |t| t.parse())?;
    let base: Option<u16> = take_opt(args, "--source-port-base").map(|p| p.parse()).transpose()?;
    let (addr, count) = target(args)?;
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(interval));
        }
        let start = Instant::now();
        let source_port = base.map(|b| b + i as u16);
        let request = "GET / HTTP/1.0\r\n\r\n";
        let answer = connect(addr, timeout, source_port, stream)
            .and_then(|stream| exchange_on(stream, request, timeout))
            .map(|(from, r)| (from, body(&r).into()));
        report(start, answer);
    }
    Ok(())
}

/// A TCP connection (or SCTP association) to `addr`, from `source_port`
/// if given (reusable at once: the same tuple is made again through
/// another node).
fn connect(
    addr: SocketAddr,
    timeout: Duration,
    source_port: Option<u16>,
    stream: Stream,
) -> std::io::Result<TcpStream> {
    if let (None, Stream::Tcp) = (source_port, stream) {
        return TcpStream::connect_timeout(&addr, timeout);
    }
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(stream.protocol()),
    )?;
    if let Some(port) = source_port {
        socket.set_reuse_address(true)?;
        let any: SocketAddr = if addr.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().unwrap();
        socket.bind(&SocketAddr::new(any.ip(), port).into())?;
    }
    socket.connect_timeout(&addr.into(), timeout)?;
    Ok(socket.into())
}

/// The body of an HTTP response.
fn body(response: &str) -> &str {
    response.split_once("\r\n\r\n").map_or(response, |(_, b)| b)
}

fn tcp_request(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(SocketAddr, String)> {
    exchange(addr, &format!("GET {path} HTTP/1.0\r\n\r\n"), timeout)
}

/// A GET as probes and scrapers send it (HTTP/1.1), for the agent's
/// endpoints: the whole response.
fn http_request(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<String> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    Ok(exchange(addr, &request, timeout)?.1)
}

/// Sends `request`, reads the response until the server closes.
fn exchange(
    addr: SocketAddr,
    request: &str,
    timeout: Duration,
) -> std::io::Result<(SocketAddr, String)> {
    exchange_on(TcpStream::connect_timeout(&addr, timeout)?, request, timeout)
}

/// Sends `request` on `stream`, reads the response until the server closes.
fn exchange_on(
    mut stream: TcpStream,
    request: &str,
    timeout: Duration,
) -> std::io::Result<(SocketAddr, String)> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let peer = stream.peer_addr()?;
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok((peer, response))
}

/// One connection, COUNT exchanges `--interval-ms` apart (a line out, an
/// answer line back), a line printed per exchange as it completes; the
/// first failure ends it.
fn stream_client(args: &mut Vec<String>, timeout: Duration) -> anyhow::Result<()> {
    let interval = take_opt(args, "--interval-ms").map_or(Ok(50), |t| t.parse())?;
    let (addr, count) = target(args)?;
    let start = Instant::now();
    let connected = TcpStream::connect_timeout(&addr, timeout).and_then(|s| {
        s.set_read_timeout(Some(timeout))?;
        Ok((s.peer_addr()?, s.try_clone()?, s))
    });
    let (peer, mut writer, reader) = match connected {
        Ok(parts) => parts,
        Err(e) => {
            report(start, Err(e));
            return Ok(());
        }
    };
    let mut lines = BufReader::new(reader).lines();
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(interval));
        }
        let start = Instant::now();
        let answer = writer.write_all(format!("{i}\n").as_bytes()).and_then(|()| {
            let line = lines.next().unwrap_or_else(|| {
                Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"))
            })?;
            Ok((peer, line))
        });
        let failed = answer.is_err();
        report(start, answer);
        std::io::stdout().flush()?;
        if failed {
            break;
        }
    }
    Ok(())
}

/// COUNT connections held open at once: all are connected first, then each
/// sends its request and reads its answer.
fn tcp_concurrent(args: &[String], timeout: Duration) -> anyhow::Result<()> {
    let (addr, count) = target(args)?;
    let mut streams = Vec::with_capacity(count);
    for _ in 0..count {
        let start = Instant::now();
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => streams.push((start, stream)),
            Err(e) => report(start, Err(e)),
        }
    }
    for (start, mut stream) in streams {
        let result = (|| {
            stream.set_read_timeout(Some(timeout))?;
            stream.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            let body = response.split_once("\r\n\r\n").map_or(response.as_str(), |(_, b)| b);
            Ok((stream.peer_addr()?, body.to_string()))
        })();
        report(start, result);
    }
    Ok(())
}

/// COUNT datagrams from one socket (one flow), INTERVAL apart; `from` is
/// the reply's source as recvmsg reported it. With `--connect` the socket is
/// connected, so an ICMP port unreachable surfaces as ConnectionRefused.
/// With `--socket-per-datagram` each datagram has a socket of its own, as
/// a resolver opening one per query.
fn udp_client(args: &mut Vec<String>, timeout: Duration) -> anyhow::Result<()> {
    let interval = take_opt(args, "--interval-ms").map_or(Ok(0), |t| t.parse())?;
    // Larger than the MTU, a datagram leaves in fragments.
    let payload = vec![b'x'; take_opt(args, "--size").map_or(Ok(5), |t| t.parse())?];
    let mut flag = |name: &str| args.iter().position(|a| a == name).map(|i| args.remove(i));
    let connect = flag("--connect").is_some();
    let per_datagram = flag("--socket-per-datagram").is_some();
    // After a failed attempt, connect again (a socket the proxy ended).
    let reconnect = flag("--reconnect").is_some();
    // Datagram `i` from port `base + i`, a socket each.
    let base: Option<u16> = take_opt(args, "--source-port-base").map(|p| p.parse()).transpose()?;
    let per_datagram = per_datagram || base.is_some();
    let (addr, count) = target(args)?;
    let mut sent_so_far = 0u16;
    let mut open = || -> std::io::Result<UdpSocket> {
        let port = base.map_or(0, |b| b + sent_so_far);
        sent_so_far += 1;
        let any = if addr.is_ipv6() { "::" } else { "0.0.0.0" };
        let socket = UdpSocket::bind((any, port))?;
        socket.set_read_timeout(Some(timeout))?;
        if connect {
            socket.connect(addr)?;
        }
        Ok(socket)
    };
    // A refused connect() (the socket LB refusing a service without
    // endpoints) is the attempt's result; the next attempt opens again.
    let mut socket: Option<UdpSocket> = None;
    let mut buf = [0u8; 1500];
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(interval));
            if per_datagram {
                socket = None;
            }
        }
        let start = Instant::now();
        if socket.is_none() {
            match open() {
                Ok(opened) => socket = Some(opened),
                Err(e) => {
                    report(start, Err(e));
                    continue;
                }
            }
        }
        let Some(socket) = &socket else { continue };
        let sent = if connect { socket.send(&payload) } else { socket.send_to(&payload, addr) };
        let result = sent.and_then(|_| {
            let (n, from) = socket.recv_from(&mut buf)?;
            Ok((from, String::from_utf8_lossy(&buf[..n]).into_owned()))
        });
        let failed = result.is_err();
        report(start, result);
        if failed && reconnect {
            socket.connect(addr)?;
        }
    }
    Ok(())
}

/// One download of BYTES bytes of padding (after the answer line): reports
/// `bytes=<padding received>` before the answer. Each read may take up to
/// the timeout.
fn bulk_client(args: &[String], timeout: Duration) -> anyhow::Result<()> {
    let addr = args.get(1).context(USAGE)?.parse()?;
    let size: usize = args.get(2).context(USAGE)?.parse()?;
    let start = Instant::now();
    let result = tcp_request(addr, &format!("/bytes/{size}"), timeout).map(|(from, response)| {
        let body = body(&response);
        let (answer, padding) = body.split_once('\n').unwrap_or((body, ""));
        (from, format!("bytes={} {answer}", padding.len()))
    });
    report(start, result);
    Ok(())
}

/// One upload of BYTES bytes: the server reports `bytes=<received>` before
/// its answer.
fn upload_client(args: &[String], timeout: Duration) -> anyhow::Result<()> {
    let addr = args.get(1).context(USAGE)?.parse()?;
    let size: usize = args.get(2).context(USAGE)?.parse()?;
    let start = Instant::now();
    let head = format!("POST /upload HTTP/1.0\r\nContent-Length: {size}\r\n\r\n");
    let request = head + &"x".repeat(size);
    let result = exchange(addr, &request, timeout).map(|(from, response)| {
        let body = body(&response).to_string();
        (from, body)
    });
    report(start, result);
    Ok(())
}

/// GET PATH from ADDR and print the body (used for the agent's /metrics).
/// Prints the body, or with `--full` the whole response (status line and
/// headers too).
/// Abuses an HTTP server, then GETs each PATH while the abuse goes on:
/// 1,000 idle connections held open, a slowloris client (a byte of its
/// request head every 500 ms, for 15 s at most), garbage, and an endless
/// header. Prints `garbage|endless <status line>`, `probe PATH <status
/// line>`, `idle N`, then `slowloris closed ms=<elapsed>` (or `slowloris
/// open`) once the server drops it.
fn http_abuse(args: &[String], timeout: Duration) -> anyhow::Result<()> {
    let addr: SocketAddr = args.get(1).context(USAGE)?.parse()?;
    let connect = || -> std::io::Result<TcpStream> {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(stream)
    };
    let status_line = |stream: &mut TcpStream| {
        let mut response = Vec::new();
        let _ = stream.read_to_end(&mut response);
        let text = String::from_utf8_lossy(&response).into_owned();
        text.lines().next().map_or("closed".to_string(), str::to_string)
    };
    let idle: Vec<TcpStream> = (0..1000).filter_map(|_| connect().ok()).collect();
    let mut slow = connect()?;
    let slowloris = std::thread::spawn(move || {
        let start = Instant::now();
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n".iter().cycle().take(30) {
            if slow.write_all(&[*byte]).is_err() {
                return format!("slowloris closed ms={}", start.elapsed().as_millis());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let mut rest = Vec::new();
        match slow.read_to_end(&mut rest) {
            Ok(_) => format!("slowloris closed ms={}", start.elapsed().as_millis()),
            Err(_) => "slowloris open".to_string(),
        }
    });
    let mut garbage = connect()?;
    garbage.write_all(b"\x01\x02\xff not http at all\r\n\r\n")?;
    println!("garbage {}", status_line(&mut garbage));
    let mut endless = connect()?;
    endless.write_all(b"GET / HTTP/1.1\r\nX-Endless: ")?;
    // The server stops reading once it has had enough.
    let _ = endless.write_all(&[b'a'; 64 * 1024]);
    println!("endless {}", status_line(&mut endless));
    for path in &args[2..] {
        let response = http_request(addr, path, timeout)?;
        println!("probe {path} {}", response.lines().next().unwrap_or("closed"));
    }
    println!("idle {}", idle.len());
    println!("{}", slowloris.join().map_err(|_| anyhow::anyhow!("slowloris thread"))?);
    Ok(())
}

fn http_get(args: &[String], timeout: Duration) -> anyhow::Result<()> {
    let addr = args.get(1).context(USAGE)?.parse()?;
    let path = args.get(2).context(USAGE)?;
    let response = http_request(addr, path, timeout)?;
    if args.iter().any(|a| a == "--full") {
        print!("{response}");
    } else {
        print!("{}", body(&response));
    }
    Ok(())
}
