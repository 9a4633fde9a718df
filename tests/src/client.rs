//! Clients: labpod runs in a pod's namespace, and what their attempts
//! gave.

use std::{
    path::Path,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::bail;

use crate::{Lab, Pod, target_bin};

/// One parsed client line.
#[derive(Clone, Debug, PartialEq)]
pub enum Attempt {
    /// `from` is the peer (TCP, getpeername) or reply source (UDP, recvmsg);
    /// `name`, `local`, `peer` are what the server saw; `bytes` is the
    /// padding a bulk transfer received.
    Ok {
        ms: f64,
        from: String,
        name: String,
        local: String,
        peer: String,
        bytes: Option<usize>,
    },
    Err {
        ms: f64,
        kind: String,
    },
}

impl Attempt {
    pub fn parse(line: &str) -> Option<Self> {
        let field = |key: &str| {
            line.split_whitespace().find_map(|w| w.strip_prefix(key)).map(str::to_string)
        };
        let ms = field("ms=")?.parse().ok()?;
        if !line.starts_with("ok ") {
            return Some(Attempt::Err { ms, kind: field("kind=")? });
        }
        let answer = (|| {
            Some(Attempt::Ok {
                ms,
                from: field("from=")?,
                name: field("name=")?,
                local: field("local=")?,
                peer: field("peer=")?,
                bytes: field("bytes=").and_then(|b| b.parse().ok()),
            })
        })();
        // Connected, but the server's answer is missing or cut short.
        Some(answer.unwrap_or(Attempt::Err { ms, kind: "NoAnswer".into() }))
    }

    /// How long the attempt took.
    pub fn ms(&self) -> f64 {
        match self {
            Attempt::Ok { ms, .. } | Attempt::Err { ms, .. } => *ms,
        }
    }

    /// The answering pod's name, for successful attempts.
    pub fn pod(&self) -> Option<&str> {
        match self {
            Attempt::Ok { name, .. } => Some(name),
            Attempt::Err { .. } => None,
        }
    }
}

/// What a run of attempts gave: how many each pod answered and how many
/// failed, by error kind, kept apart so that no count of answers or of
/// pods can include a failure.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tally {
    pub pods: std::collections::BTreeMap<String, usize>,
    pub errors: std::collections::BTreeMap<String, usize>,
}

impl Tally {
    pub fn of(attempts: &[Attempt]) -> Self {
        let mut errors = std::collections::BTreeMap::new();
        for attempt in attempts {
            if let Attempt::Err { kind, .. } = attempt {
                *errors.entry(kind.clone()).or_insert(0) += 1;
            }
        }
        Tally { pods: tally(attempts), errors }
    }

    /// The pods that answered, panicking if any attempt failed.
    pub fn served(&self) -> &std::collections::BTreeMap<String, usize> {
        assert!(self.errors.is_empty(), "failed attempts: {self:?}");
        &self.pods
    }
}

/// How many attempts each pod answered (failed attempts are not counted:
/// see [`Tally`] for both).
pub fn tally(attempts: &[Attempt]) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for pod in attempts.iter().filter_map(Attempt::pod) {
        *counts.entry(pod.to_string()).or_insert(0) += 1;
    }
    counts
}

/// What each successful attempt's server saw: (pod, peer, reply source);
/// panics on a failed one.
pub fn answered(attempts: &[Attempt]) -> Vec<(String, String, String)> {
    attempts
        .iter()
        .map(|a| match a {
            Attempt::Ok { name, peer, from, .. } => (name.clone(), peer.clone(), from.clone()),
            err => panic!("failed attempt: {err:?} in {attempts:?}"),
        })
        .collect()
}

/// The pods that answered the attempts a streaming client sent more than
/// `settle` after `changed`, from its output lines as they come (`<lost>`
/// for a failed one). A line comes when its attempt ends, which was sent
/// its duration earlier: a reply in flight at the change may be lost (as
/// with kube-proxy's conntrack deletion), and its line comes late.
pub fn answered_after(
    lines: impl IntoIterator<Item = std::io::Result<String>>,
    changed: Instant,
    settle: Duration,
) -> Vec<String> {
    let mut after = Vec::new();
    for line in lines.into_iter().map_while(Result::ok) {
        let Some(attempt) = Attempt::parse(&line) else { continue };
        let sent = Instant::now() - Duration::from_secs_f64(attempt.ms() / 1000.0);
        if sent > changed + settle {
            after.push(attempt.pod().unwrap_or("<lost>").to_string());
        }
    }
    after
}

/// What a client does, as labpod takes it: each attempt one line.
#[derive(Clone, Debug)]
pub struct Request {
    args: Vec<String>,
}

impl Request {
    fn new(verb: &str, addr: &str, count: usize) -> Self {
        Request { args: vec![verb.into(), addr.into(), count.to_string()] }
    }

    /// `count` TCP connections, one after the other, each an exchange.
    pub fn tcp(addr: &str, count: usize) -> Self {
        Self::new("tcp", addr, count)
    }

    /// `count` SCTP associations, one after the other, each an exchange
    /// as [`Request::tcp`]'s.
    pub fn sctp(addr: &str, count: usize) -> Self {
        Self::new("sctp", addr, count)
    }

    /// `count` TCP connections open at once.
    pub fn tcp_concurrent(addr: &str, count: usize) -> Self {
        Self::new("tcp-concurrent", addr, count)
    }

    /// One TCP connection carrying `count` exchanges (to an echo port).
    pub fn stream(addr: &str, count: usize) -> Self {
        Self::new("stream", addr, count)
    }

    /// `count` datagrams from one socket, each waiting for its answer.
    pub fn udp(addr: &str, count: usize) -> Self {
        Self::new("udp", addr, count)
    }

    /// [`Request::tcp`] or [`Request::udp`] by protocol name.
    pub fn of(proto: &str, addr: &str, count: usize) -> Self {
        match proto {
            "tcp" => Self::tcp(addr, count),
            "udp" => Self::udp(addr, count),
            other => panic!("no client for {other}"),
        }
    }

    /// A download of `bytes` bytes over one connection.
    pub fn bulk(addr: &str, bytes: usize) -> Self {
        Self::new("bulk", addr, bytes)
    }

    /// An upload of `bytes` bytes over one connection.
    pub fn upload(addr: &str, bytes: usize) -> Self {
        Self::new("upload", addr, bytes)
    }

    fn option(mut self, name: &str, value: impl ToString) -> Self {
        self.args.extend([name.to_string(), value.to_string()]);
        self
    }

    fn flag(mut self, name: &str) -> Self {
        self.args.push(name.into());
        self
    }

    /// A pause between attempts.
    pub fn interval_ms(self, ms: u64) -> Self {
        self.option("--interval-ms", ms)
    }

    /// Attempt `i` from source port `port + i`.
    pub fn source_port_base(self, port: u16) -> Self {
        self.option("--source-port-base", port)
    }

    /// UDP: a connected socket.
    pub fn connected(self) -> Self {
        self.flag("--connect")
    }

    /// UDP, connected: connect again when the socket is ended.
    pub fn reconnecting(self) -> Self {
        self.flag("--reconnect")
    }

    /// UDP: a socket of its own per datagram.
    pub fn socket_per_datagram(self) -> Self {
        self.flag("--socket-per-datagram")
    }

    /// UDP: datagrams of `bytes` bytes.
    pub fn size(self, bytes: usize) -> Self {
        self.option("--size", bytes)
    }
}

/// Where a labpod client runs: a namespace, and a cgroup or none.
pub struct Client<'a> {
    netns: &'a str,
    cgroup: Option<&'a Path>,
    timeout_ms: Option<u64>,
}

impl Lab {
    /// A client in `pod`, inside node 0's test cgroup: its sockets meet the
    /// socket LB.
    pub fn client<'a>(&'a self, pod: &'a Pod) -> Client<'a> {
        self.client_in(&pod.netns, Some(&self.nodes[0].cgroup))
    }

    /// A client in `pod` outside any test cgroup: its packets meet only the
    /// per-packet datapath.
    pub fn client_outside<'a>(&'a self, pod: &'a Pod) -> Client<'a> {
        self.client_in(&pod.netns, None)
    }

    /// A client in any namespace (a node's too), optionally in a cgroup.
    pub fn client_in<'a>(&'a self, netns: &'a str, cgroup: Option<&'a Path>) -> Client<'a> {
        Client { netns, cgroup, timeout_ms: None }
    }

    /// GET `path` from `addr` in node 0's namespace: the whole response,
    /// status line and headers too.
    pub fn http_get(&self, addr: &str, path: &str) -> anyhow::Result<String> {
        self.client_in(&self.node, None).http_get(addr, path)
    }
}

impl Client<'_> {
    /// How long each attempt waits (2 s unless told).
    pub fn timeout_ms(mut self, ms: u64) -> Self {
        self.timeout_ms = Some(ms);
        self
    }

    /// Runs `request` to its end: its attempts.
    pub fn run(&self, request: Request) -> anyhow::Result<Vec<Attempt>> {
        let out = self.labpod(&request.args)?;
        Ok(out.lines().filter_map(Attempt::parse).collect())
    }

    /// [`Request::tcp`], run to its end.
    pub fn tcp(&self, addr: &str, count: usize) -> anyhow::Result<Vec<Attempt>> {
        self.run(Request::tcp(addr, count))
    }

    /// [`Request::udp`], run to its end.
    pub fn udp(&self, addr: &str, count: usize) -> anyhow::Result<Vec<Attempt>> {
        self.run(Request::udp(addr, count))
    }

    /// Starts `request` and returns it running, its stdout piped (one line
    /// per attempt, as they happen).
    pub fn spawn(&self, request: Request) -> anyhow::Result<Child> {
        Ok(self.command(&request.args).stdout(Stdio::piped()).spawn()?)
    }

    /// GET `path` from `addr`: the whole response, status line and headers
    /// too.
    pub fn http_get(&self, addr: &str, path: &str) -> anyhow::Result<String> {
        self.labpod(&["http", addr, path, "--full"])
    }

    /// GET `path` from `addr`: the body.
    pub fn http_body(&self, addr: &str, path: &str) -> anyhow::Result<String> {
        self.labpod(&["http", addr, path])
    }

    /// Malformed and oversized requests to `addr`, then a GET of each of
    /// `paths`: a line per request with the status line it got.
    pub fn http_abuse(&self, addr: &str, paths: &[&str]) -> anyhow::Result<String> {
        self.labpod(&[&["http-abuse", addr][..], paths].concat())
    }

    fn command(&self, args: &[impl AsRef<std::ffi::OsStr>]) -> Command {
        let mut cmd = Command::new(target_bin("labpod"));
        cmd.args(["--netns", self.netns]);
        if let Some(cgroup) = self.cgroup {
            cmd.arg("--cgroup").arg(cgroup);
        }
        if let Some(ms) = self.timeout_ms {
            cmd.args(["--timeout-ms".to_string(), ms.to_string()]);
        }
        cmd.args(args);
        cmd
    }

    /// Runs labpod; its stdout.
    fn labpod(
        &self,
        args: &[impl AsRef<std::ffi::OsStr> + std::fmt::Debug],
    ) -> anyhow::Result<String> {
        let Output { status, stdout, stderr } = self.command(args).output()?;
        if !status.success() {
            bail!("labpod {args:?}: {}", String::from_utf8_lossy(&stderr));
        }
        Ok(String::from_utf8_lossy(&stdout).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_lines_parse() {
        let ok = Attempt::parse(
            "ok ms=0.412 from=10.96.0.10:80 name=web-0 local=10.244.1.2:8080 peer=10.244.1.10:4242",
        );
        assert_eq!(ok.as_ref().and_then(|a| a.pod()), Some("web-0"));
        let err = Attempt::parse("err ms=0.101 kind=ConnectionRefused");
        assert_eq!(err, Some(Attempt::Err { ms: 0.101, kind: "ConnectionRefused".into() }));
        let bulk = Attempt::parse(
            "ok ms=3.5 from=10.96.0.10:80 bytes=200000 name=web-0 local=10.244.1.2:8080 peer=10.244.1.10:4242",
        );
        assert!(matches!(bulk, Some(Attempt::Ok { bytes: Some(200_000), .. })), "{bulk:?}");
        let cut = Attempt::parse("ok ms=0.2 from=10.96.0.10:80 ");
        assert_eq!(cut, Some(Attempt::Err { ms: 0.2, kind: "NoAnswer".into() }));
    }
}
