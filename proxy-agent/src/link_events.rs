//! Following interfaces as they come and go: the kernel's netlink
//! notifications of links and IPv4 addresses (a node address moving to
//! another interface changes which interfaces are wanted), and when to scan
//! the interfaces again. The messages are not parsed: a scan follows anyway.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use tokio::io::{Interest, unix::AsyncFd};

/// After a notification, the scan waits this long for those that follow
/// (creating a pod's veth sends several: links, addresses, up).
pub const SETTLE: Duration = Duration::from_millis(5);

/// A NETLINK_ROUTE socket subscribed to link and IPv4 address changes, in
/// the agent's network namespace.
pub struct LinkEvents {
    socket: AsyncFd<OwnedFd>,
}

impl LinkEvents {
    /// Opens the socket (non-blocking, close-on-exec) and joins the
    /// RTMGRP_LINK, RTMGRP_IPV4_IFADDR and RTMGRP_IPV6_IFADDR multicast groups.
    pub fn open() -> io::Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor socket(2) just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; all-zero is its unbound state.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups =
            (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32;
        // SAFETY: a valid sockaddr_nl and its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the descriptor is open, owned by the OwnedFd the AsyncFd
        // keeps, and stays the same until both drop.
        let socket = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        Ok(LinkEvents { socket })
    }

    /// Waits until an interface or address changed, taking every
    /// notification pending (cancel-safe: nothing is lost if dropped).
    pub async fn changed(&self) -> io::Result<()> {
        loop {
            let mut ready = self.socket.readable().await?;
            let (changed, empty) = drain(self.socket.get_ref())?;
            if empty {
                // Read until EAGAIN: nothing is left until the next edge.
                ready.clear_ready();
            }
            if changed {
                return Ok(());
            }
        }
    }
}

/// Reads at most this many messages per wake-up, so that endless churn
/// cannot keep the loop from its other work.
const MAX_READS: usize = 4096;

/// Reads the pending messages: whether there was any (an overrun counts:
/// the messages lost were changes too), and whether all were read.
fn drain(socket: &OwnedFd) -> io::Result<(bool, bool)> {
    let mut buf = [0u8; 8192];
    let mut changed = false;
    for _ in 0..MAX_READS {
        // SAFETY: a valid buffer of that length; longer messages are
        // truncated, which is fine: only their arrival matters.
        let n = unsafe {
            libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
        };
        if n >= 0 {
            changed = true;
            continue;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) => return Ok((changed, true)),
            Some(libc::EINTR) => {}
            Some(libc::ENOBUFS) => changed = true,
            _ => return Err(err),
        }
    }
    Ok((changed, false))
}

/// When the interfaces are scanned again: soon after a notification, at
/// polls once the safety-net period has passed since the last scan, and at
/// every poll when there are no notifications.
#[derive(Debug)]
pub struct Rescan {
    /// The safety net; `None`: no notifications, scan at every poll.
    period: Option<Duration>,
    last: Instant,
    /// When the first notification not followed yet arrived.
    pending: Option<Instant>,
}

impl Rescan {
    /// Following notifications, with a scan at least every `period`.
    pub fn new(period: Duration, now: Instant) -> Self {
        Rescan { period: Some(period), last: now, pending: None }
    }

    /// The notifications are lost: scan at every poll from now on.
    pub fn every_poll(&mut self) {
        self.period = None;
    }

    /// A notification arrived at `now`; later ones before the scan join it.
    pub fn changed(&mut self, now: Instant) {
        self.pending.get_or_insert(now);
    }

    /// When the loop must wake for a scan not due at a poll.
    pub fn wake_at(&self) -> Option<Instant> {
        self.pending.map(|since| since + SETTLE)
    }

    /// Whether to scan now; `polled`: this round is a poll.
    pub fn due(&self, now: Instant, polled: bool) -> bool {
        if self.wake_at().is_some_and(|at| now >= at) {
            return true;
        }
        polled && self.period.is_none_or(|period| now.duration_since(self.last) >= period)
    }

    /// The interfaces were scanned at `now` (what was pending is followed).
    pub fn scanned(&mut self, now: Instant) {
        self.last = now;
        self.pending = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_are_followed_after_a_short_settle_and_polls_rarely_scan() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut rescan = Rescan::new(Duration::from_secs(10), start);
        assert!(!rescan.due(at(200), true), "a poll before the period does not scan");
        assert_eq!(rescan.wake_at(), None);

        rescan.changed(at(300));
        rescan.changed(at(302));
        assert_eq!(rescan.wake_at(), Some(at(300) + SETTLE), "the first notification counts");
        assert!(!rescan.due(at(302), false), "settling");
        assert!(rescan.due(at(300) + SETTLE, false));
        rescan.scanned(at(306));
        assert_eq!(rescan.wake_at(), None);
        assert!(!rescan.due(at(400), true));

        assert!(!rescan.due(at(10_305), true), "the safety net counts from the last scan");
        assert!(!rescan.due(at(10_306), false), "the safety net waits for a poll");
        assert!(rescan.due(at(10_306), true));
    }

    #[test]
    fn without_notifications_every_poll_scans() {
        let start = Instant::now();
        let mut rescan = Rescan::new(Duration::from_secs(3600), start);
        rescan.every_poll();
        rescan.scanned(start);
        assert!(rescan.due(start, true));
        assert!(!rescan.due(start + Duration::from_millis(50), false), "only at polls");
    }
}
