//! Ending sockets the socket LB connected to an endpoint that left its
//! service, as kube-proxy's users expect from its conntrack flush: a
//! connected UDP socket would otherwise keep sending to the removed pod for
//! as long as it lives. The application gets an error and its next
//! `connect()` goes through the service to a live pod.
//!
//! It happens in every network namespace the agent can see
//! (`/proc/<pid>/ns/net`), a thread each, in one of two ways:
//! - socket iterators calling `bpf_sock_destroy` (Linux 6.5+): the kernel
//!   walks the namespace's sockets and the BPF program picks them (see
//!   `proxy-ebpf/src/sock_end.rs` and `backend::ebpf::sock_end`);
//! - `sock_diag` (`SOCK_DESTROY`, `CONFIG_INET_DIAG_DESTROY`): the sockets are
//!   dumped here and the chosen ones destroyed one by one.
//!
//! The `sock_diag` message layouts are the kernel's (`linux/inet_diag.h`),
//! built and read here as bytes; that part is pure and unit-tested.

use std::{collections::BTreeSet, io, net::IpAddr, os::fd::AsRawFd};

use crate::netlink::{self, NLM_F_ACK, NLM_F_DUMP};

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
/// `struct inet_diag_sockid`.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg`, up to and including the socket id.
const MSG_ID_END: usize = 4 + SOCKID_LEN;

/// A socket as `sock_diag` names it: the bytes of its `inet_diag_sockid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SockId([u8; SOCKID_LEN]);

/// A connected socket as the socket LB recorded it: its cookie and its
/// peer, the backend `connect()` was sent to (an IPv6 socket's v4-mapped
/// peer as the IPv4 address it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub cookie: u64,
    pub address: IpAddr,
    pub port: u16,
}

/// The families whose sockets the socket LB connects.
const FAMILIES: [u8; 2] = [libc::AF_INET as u8, libc::AF_INET6 as u8];

/// The prefix of a v4-mapped IPv6 address (`::ffff:0:0/96`).
const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

impl SockId {
    /// The socket cookie (its last 8 bytes, host order as two u32), its
    /// destination port (2 bytes at 2, network order) and address (the 16
    /// bytes at 20 hold an IPv4 socket's in the first 4, an IPv6 socket's
    /// whole, a v4-mapped one's IPv4 address in the last 4).
    fn peer(&self, family: u8) -> Peer {
        let lo = u32::from_ne_bytes(self.0[40..44].try_into().unwrap_or_default());
        let hi = u32::from_ne_bytes(self.0[44..48].try_into().unwrap_or_default());
        let word = |at: usize| -> [u8; 4] { self.0[at..at + 4].try_into().unwrap_or_default() };
        let address = match family {
            f if f == libc::AF_INET6 as u8 && self.0[20..32] == V4_MAPPED => IpAddr::from(word(32)),
            f if f == libc::AF_INET6 as u8 => {
                IpAddr::from(<[u8; 16]>::try_from(&self.0[20..36]).unwrap_or_default())
            }
            _ => IpAddr::from(word(20)),
        };
        Peer {
            cookie: (u64::from(hi) << 32) | u64::from(lo),
            address,
            port: u16::from_be_bytes([self.0[2], self.0[3]]),
        }
    }
}

/// A netlink message: header, then an `inet_diag_req_v2` for `family`
/// sockets of `protocol` in any state, naming `id` (zeros for a dump).
fn request(
    kind: u16,
    flags: u16,
    seq: u32,
    (family, protocol): (u8, u8),
    id: Option<&SockId>,
) -> Vec<u8> {
    let mut req = Vec::with_capacity(REQ_LEN);
    req.extend_from_slice(&[family, protocol, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    req.extend_from_slice(id.map_or(&[0; SOCKID_LEN], |id| &id.0));
    netlink::message(kind, flags, seq, &req)
}

/// The socket a dump's message names.
fn sock_id(kind: u16, body: &[u8]) -> Option<SockId> {
    let id = body.get(4..MSG_ID_END).filter(|_| kind == SOCK_DIAG_BY_FAMILY)?;
    Some(SockId(id.try_into().ok()?))
}

/// What an exchange's replies said.
#[derive(Debug, Default, PartialEq, Eq)]
struct Replies {
    sockets: Vec<SockId>,
    /// The errno of an `NLMSG_ERROR` (0: an ack).
    error: Option<i32>,
}

/// A `sock_diag` socket in the calling thread's network namespace.
struct Diag {
    socket: netlink::Socket,
    seq: u32,
}

impl Diag {
    fn open() -> io::Result<Self> {
        Ok(Diag { socket: netlink::Socket::open(NETLINK_SOCK_DIAG)?, seq: 0 })
    }

    /// Sends `msg` and reads replies until the exchange ends.
    fn exchange(&mut self, msg: &[u8]) -> io::Result<Replies> {
        let mut sockets = Vec::new();
        let error = self.socket.exchange(msg, |kind, body| sockets.extend(sock_id(kind, body)))?;
        Ok(Replies { sockets, error })
    }

    /// Destroys the `protocol` sockets of this namespace `must_end` picks,
    /// of both families; returns how many.
    fn destroy(&mut self, protocol: u8, must_end: &MustEnd) -> io::Result<usize> {
        let mut destroyed = 0;
        for family in FAMILIES {
            let of = (family, protocol);
            self.seq += 1;
            let dump =
                self.exchange(&request(SOCK_DIAG_BY_FAMILY, NLM_F_DUMP, self.seq, of, None))?;
            let chosen = |id: &&SockId| must_end(&id.peer(family));
            for id in dump.sockets.iter().filter(chosen) {
                self.seq += 1;
                let msg = request(SOCK_DESTROY, NLM_F_ACK, self.seq, of, Some(id));
                match self.exchange(&msg)?.error {
                    Some(0) | None => destroyed += 1,
                    // Gone meanwhile.
                    Some(libc::ENOENT) => {}
                    Some(errno) => return Err(io::Error::from_raw_os_error(errno)),
                }
            }
        }
        Ok(destroyed)
    }
}

/// The network namespaces of the processes the agent can see, one fd each
/// (its own first).
fn namespaces() -> Vec<std::fs::File> {
    let mut seen = BTreeSet::new();
    let own = std::path::PathBuf::from("/proc/self/ns/net");
    let pids = std::fs::read_dir("/proc").into_iter().flatten().flatten().map(|e| e.path());
    std::iter::once(own)
        .chain(
            pids.filter(|p| {
                p.file_name().is_some_and(|n| n.as_encoded_bytes().iter().all(u8::is_ascii_digit))
            })
            .map(|p| p.join("ns/net")),
        )
        .filter_map(|path| {
            let meta = std::fs::metadata(&path).ok()?;
            let key = (
                std::os::unix::fs::MetadataExt::dev(&meta),
                std::os::unix::fs::MetadataExt::ino(&meta),
            );
            if !seen.insert(key) {
                return None;
            }
            std::fs::File::open(&path).ok()
        })
        .collect()
}

/// Picks the sockets to end by their recorded peer.
pub type MustEnd<'a> = dyn Fn(&Peer) -> bool + Sync + 'a;

/// Runs `count` in every network namespace the agent can see, with what
/// `prepare` made for it in the calling thread, and adds up what it
/// returns. A namespace that cannot be entered (its last process left) or
/// fails is skipped; the first error is returned only when none succeeded.
pub fn in_each_netns<P: Send>(
    mut prepare: impl FnMut() -> io::Result<P>,
    count: impl Fn(P) -> io::Result<usize> + Sync,
) -> io::Result<usize> {
    let mut work = Vec::new();
    for netns in namespaces() {
        work.push((netns, prepare()?));
    }
    let count = &count;
    let results: Vec<io::Result<usize>> = std::thread::scope(|scope| {
        let threads: Vec<_> = work
            .into_iter()
            .map(|(netns, prepared)| {
                // setns changes the calling thread's namespace only.
                scope.spawn(move || {
                    // SAFETY: a namespace fd of ours, for this thread alone.
                    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return None;
                    }
                    Some(count(prepared))
                })
            })
            .collect();
        threads.into_iter().filter_map(|t| t.join().ok().flatten()).collect()
    });
    let ended = results.iter().filter_map(|r| r.as_ref().ok()).sum();
    match results.into_iter().find_map(Result::err) {
        Some(e) if ended == 0 => Err(e),
        _ => Ok(ended),
    }
}

/// Destroys with `sock_diag`, in every network namespace the agent can see,
/// the `protocol` sockets `must_end` picks; returns how many.
pub fn destroy(protocol: u8, must_end: &MustEnd) -> io::Result<usize> {
    in_each_netns(|| Ok(()), |()| Diag::open()?.destroy(protocol, must_end))
}

/// Whether this kernel destroys sockets through `sock_diag`: a connected
/// UDP socket of our own, destroyed.
pub fn probe() -> io::Result<()> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    socket.connect(socket.local_addr()?)?;
    let mut diag = Diag::open()?;
    let udp4 = (libc::AF_INET as u8, libc::IPPROTO_UDP as u8);
    let dump = diag.exchange(&request(SOCK_DIAG_BY_FAMILY, NLM_F_DUMP, 1, udp4, None))?;
    let local = socket.local_addr()?.port().to_be_bytes();
    let ours = dump.sockets.iter().find(|id| id.0[0..2] == local).copied();
    let id = ours.ok_or_else(|| io::Error::other("own socket not listed"))?;
    match diag.exchange(&request(SOCK_DESTROY, NLM_F_ACK, 2, udp4, Some(&id)))?.error {
        Some(0) | None => Ok(()),
        Some(errno) => Err(io::Error::from_raw_os_error(errno)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::netlink::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, reply};

    #[test]
    fn dumps_and_destroys_name_sockets_by_the_kernels_layout() {
        let mut id = [0u8; SOCKID_LEN];
        id[0..2].copy_from_slice(&4242u16.to_be_bytes());
        id[40..44].copy_from_slice(&7u32.to_ne_bytes());
        id[44..48].copy_from_slice(&1u32.to_ne_bytes());
        id[2..4].copy_from_slice(&53u16.to_be_bytes());
        id[20..24].copy_from_slice(&[10, 244, 0, 5]);
        let id = SockId(id);
        let address = IpAddr::from([10, 244, 0, 5]);
        let peer = Peer { cookie: (1 << 32) | 7, address, port: 53 };
        let (inet, inet6) = (libc::AF_INET as u8, libc::AF_INET6 as u8);
        assert_eq!(id.peer(inet), peer);
        // The same socket as IPv6 to ::ffff:10.244.0.5, and to an IPv6 peer.
        let mut mapped = id;
        mapped.0[20..36].copy_from_slice(&[&V4_MAPPED[..], &[10, 244, 0, 5]].concat());
        assert_eq!(mapped.peer(inet6), peer);
        let mut ipv6 = mapped;
        ipv6.0[20..22].copy_from_slice(&[0xfd, 0]);
        let address: IpAddr = "fd00::ffff:af4:5".parse().unwrap();
        assert_eq!(ipv6.peer(inet6), Peer { address, ..peer });

        let msg = request(SOCK_DESTROY, NLM_F_ACK, 9, (inet, 17), Some(&id));
        assert_eq!(msg.len(), 72, "nlmsghdr + inet_diag_req_v2");
        assert_eq!(&msg[16..20], &[libc::AF_INET as u8, 17, 0, 0]);
        assert_eq!(&msg[20..24], &u32::MAX.to_ne_bytes(), "every state");
        assert_eq!(&msg[24..], &id.0);
        let dump = request(SOCK_DIAG_BY_FAMILY, NLM_F_DUMP, 1, (inet6, 17), None);
        assert_eq!(dump[16], inet6);
        assert_eq!(u16::from_ne_bytes([dump[6], dump[7]]), NLM_F_DUMP | NLM_F_REQUEST);

        // A dump reply: an inet_diag_msg (72 bytes) per socket, then DONE.
        let mut body = vec![libc::AF_INET as u8, 1, 0, 0];
        body.extend_from_slice(&id.0);
        body.resize(72, 0);
        let mut buf = reply(SOCK_DIAG_BY_FAMILY, &body);
        buf.extend(reply(SOCK_DIAG_BY_FAMILY, &body));
        buf.extend(reply(NLMSG_DONE, &[0; 4]));
        let mut ended = None;
        let mut sockets = Vec::new();
        for (kind, body) in netlink::messages(&buf) {
            match netlink::ending(kind, body) {
                Some(error) => ended = Some(error),
                None => sockets.extend(sock_id(kind, body)),
            }
        }
        assert_eq!(sockets, vec![id, id]);
        assert_eq!(ended, Some(None), "ended by DONE, no error");
    }
}
