//! Traffic: nginx in a pod, wrk runs against it, and what they cost.

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use proxy_lab::{Lab, Pod, sh};

/// nginx in `pod` on `ports` (and on IPv6 too with `ipv6`): one process, no
/// master (stopping it leaves no worker behind), no access log, no
/// keep-alive; its pid in the lab's `nginx.pid`, where [`rate`] reads it.
/// One per lab.
pub(super) fn start_nginx(
    lab: &mut Lab,
    pod: &Pod,
    ports: &[u16],
    ipv6: bool,
) -> anyhow::Result<()> {
    let mut listen = String::new();
    for port in ports {
        let _ = write!(listen, "listen {port} reuseport; ");
    }
    if ipv6 {
        for port in ports {
            let _ = write!(listen, "listen [::]:{port} reuseport; ");
        }
    }
    let conf = lab.dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off; master_process off; worker_processes 1; pid {dir}/nginx.pid; error_log {dir}/nginx.log;\nevents {{ worker_connections 4096; }}\nhttp {{ access_log off; keepalive_timeout 0;\n  server {{ {listen}location / {{ return 200 \"ok\\n\"; }} }} }}\n",
            dir = lab.dir.display()
        ),
    )?;
    lab.spawn_in(&pod.netns, "nginx", &["-c", &conf.to_string_lossy()])?;
    Ok(())
}

/// A client namespace's ephemeral ports widened and TIME_WAIT reuse on, so
/// runs of thousands of short connections do not run out of ports.
pub(super) fn open_client_ports(netns: &str) -> anyhow::Result<()> {
    sh(
        "ip",
        &["netns", "exec", netns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"],
    )?;
    sh("ip", &["netns", "exec", netns, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    Ok(())
}

/// Waits (5 s at most) until nginx answers `client` at `addr`.
pub(super) fn wait_answering(lab: &Lab, client: &Pod, addr: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while lab.client_outside(client).http_body(addr, "/").is_err() {
        anyhow::ensure!(Instant::now() < deadline, "nginx did not answer at {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// One wrk run: connections per second, and the CPU they cost.
#[derive(Clone, Copy)]
pub(super) struct Run {
    pub(super) per_s: f64,
    /// CPU time of client (wrk) and server (nginx) per 10,000 connections,
    /// in ms: user, system, and the softirq work done in their context
    /// (most of the network stack's, veth included). A cost, where a rate
    /// swings with the machine's load.
    pub(super) cpu_ms_per_10k: f64,
    /// wrk's socket errors (connect, read, write, timeout) and non-2xx/3xx
    /// answers: a run that had any is reported as failed.
    pub(super) errors: u64,
}

/// The CPU seconds of this process's reaped children (each wrk run).
fn children_cpu_s() -> f64 {
    // SAFETY: plain out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// The CPU seconds process `pid` used so far (utime + stime of
/// /proc/PID/stat); 0 when it cannot be read.
fn process_cpu_s(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and
    // stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: f64 =
        rest.split_whitespace().skip(11).take(2).filter_map(|t| t.parse::<f64>().ok()).sum();
    // SAFETY: no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// A wrk run to `addr` from `client`: its rate and CPU cost.
pub(super) fn rate(
    lab: &Lab,
    client: &Pod,
    in_cgroup: bool,
    addr: &str,
    seconds: u64,
) -> anyhow::Result<Run> {
    let url = format!("http://{addr}/");
    let duration = format!("{seconds}s");
    let args = ["-t1", "-c8", "-d", &duration, "-H", "Connection: close", &url];
    let cgroup = in_cgroup.then_some(lab.cgroup.as_path());
    let nginx = std::fs::read_to_string(lab.dir.join("nginx.pid")).unwrap_or_default();
    let cpu_before = children_cpu_s() + process_cpu_s(&nginx);
    let out = lab.run_in(&client.netns, cgroup, "wrk", &args)?;
    let cpu = children_cpu_s() + process_cpu_s(&nginx) - cpu_before;
    let per_s = out
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:")?.trim().parse().ok())
        .with_context(|| format!("no rate from wrk:\n{out}"))?;
    let requests: f64 = out
        .lines()
        .find_map(|l| l.trim().split_once(" requests in ")?.0.parse().ok())
        .with_context(|| format!("no request count from wrk:\n{out}"))?;
    let errors = wrk_errors(&out);
    if errors > 0 {
        eprintln!("  wrk to {addr}: {errors} errors");
    }
    Ok(Run { per_s, cpu_ms_per_10k: cpu * 1000.0 * 10_000.0 / requests.max(1.0), errors })
}

/// The socket errors and non-2xx/3xx answers wrk reports (`Socket errors:
/// connect 0, read 2, write 0, timeout 1`, `Non-2xx or 3xx responses: 4`).
fn wrk_errors(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("Socket errors:").or_else(|| l.strip_prefix("Non-2xx or 3xx responses:"))
        })
        .flat_map(|counts| counts.split(|c: char| !c.is_ascii_digit()))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrks_socket_errors_and_bad_answers_are_counted() {
        let clean = "  8 threads\n  20000 requests in 2.00s, 3.1MB read\nRequests/sec:  10000.00\n";
        assert_eq!(wrk_errors(clean), 0);
        let errors = "  20000 requests in 2.00s\n  Socket errors: connect 0, read 12, write 1, timeout 3\n  Non-2xx or 3xx responses: 4\nRequests/sec: 9000.0\n";
        assert_eq!(wrk_errors(errors), 20);
    }
}
