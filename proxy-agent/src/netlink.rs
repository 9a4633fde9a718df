//! Netlink requests and dumps, as bytes: the message framing
//! (`linux/netlink.h`) shared by `sock_diag` and the dumps here
//! (`linux/rtnetlink.h`): the host routes (which addresses the node routes
//! to which interface) and the clsact filters' BPF programs (which
//! interface runs what, on kernels without TCX links). The layouts are
//! built and read here; that part is pure and unit-tested.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLMSG_HDRLEN: usize = 16;

const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
/// `struct rtmsg`.
const RTMSG_LEN: usize = 12;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTN_UNICAST: u8 = 1;

/// A request: the header, then `payload`.
pub fn message(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + payload.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(payload);
    msg
}

/// The messages of a buffer of replies, as (type, body); a truncated or
/// malformed one ends the walk.
pub fn messages(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    records(buf, NLMSG_HDRLEN, |header| {
        let len = u32::from_ne_bytes(header[0..4].try_into().ok()?);
        Some((len as usize, u16::from_ne_bytes(header[4..6].try_into().ok()?)))
    })
}

/// Type-length-value records, each 4-byte aligned: `header` bytes, of
/// which `read` gives the record's length (header included) and type;
/// a truncated or malformed one ends the walk.
fn records(
    mut buf: &[u8],
    header: usize,
    read: fn(&[u8]) -> Option<(usize, u16)>,
) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let (len, kind) = read(buf.get(..header)?)?;
        if len < header || len > buf.len() {
            return None;
        }
        let value = &buf[header..len];
        buf = &buf[((len + 3) & !3).min(buf.len())..];
        Some((kind, value))
    })
}

/// How an exchange ended: `NLMSG_DONE`, or the errno of an `NLMSG_ERROR`
/// (0: an ack).
pub fn ending(kind: u16, body: &[u8]) -> Option<Option<i32>> {
    match kind {
        NLMSG_DONE => Some(None),
        NLMSG_ERROR => {
            Some(body.get(0..4).map(|e| -i32::from_ne_bytes(e.try_into().unwrap_or_default())))
        }
        _ => None,
    }
}

/// A netlink socket of `protocol` in the calling thread's network namespace.
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    pub fn open(protocol: libc::c_int) -> io::Result<Self> {
        // SAFETY: plain socket creation; the fd is owned at once.
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd nobody else owns.
        Ok(Socket { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Sends `msg` and hands every reply message but the last to `each`
    /// until the exchange ends; returns its ending's errno, if any.
    pub fn exchange(
        &mut self,
        msg: &[u8],
        mut each: impl FnMut(u16, &[u8]),
    ) -> io::Result<Option<i32>> {
        // SAFETY: a valid buffer of the given length.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: a valid buffer of the given length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                return Ok(None);
            }
            for (kind, body) in messages(&buf[..n as usize]) {
                if let Some(error) = ending(kind, body) {
                    return Ok(error);
                }
                each(kind, body);
            }
        }
    }
}

/// A route to one address (a /32 or /128: how CNIs route a pod to its
/// interface) and the index of the interface it goes out of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRoute {
    pub address: IpAddr,
    pub ifindex: u32,
}

/// The host routes of both families, every table, of this network namespace.
pub fn host_routes() -> io::Result<Vec<HostRoute>> {
    let mut socket = Socket::open(libc::NETLINK_ROUTE)?;
    let mut routes = Vec::new();
    for (seq, family) in [(1, libc::AF_INET), (2, libc::AF_INET6)] {
        let mut rtmsg = [0u8; RTMSG_LEN];
        rtmsg[0] = family as u8;
        let request = message(RTM_GETROUTE, NLM_F_DUMP, seq, &rtmsg);
        let each = |kind, body: &[u8]| routes.extend(host_route(kind, body));
        if let Some(errno) = socket.exchange(&request, each)?.filter(|e| *e != 0) {
            return Err(io::Error::from_raw_os_error(errno));
        }
    }
    Ok(routes)
}

/// A unicast route to a single address, with its output interface.
fn host_route(kind: u16, body: &[u8]) -> Option<HostRoute> {
    if kind != RTM_NEWROUTE || body.len() < RTMSG_LEN {
        return None;
    }
    let (family, dst_len, route_type) = (body[0], body[1], body[7]);
    let full = match i32::from(family) {
        libc::AF_INET => 32,
        libc::AF_INET6 => 128,
        _ => return None,
    };
    if dst_len != full || route_type != RTN_UNICAST {
        return None;
    }
    let (mut address, mut ifindex) = (None, None);
    for (kind, value) in attributes(&body[RTMSG_LEN..]) {
        match (kind, value.len()) {
            (RTA_DST, 4) => address = <[u8; 4]>::try_from(value).ok().map(IpAddr::from),
            (RTA_DST, 16) => address = <[u8; 16]>::try_from(value).ok().map(IpAddr::from),
            (RTA_OIF, 4) => ifindex = value.try_into().ok().map(u32::from_ne_bytes),
            _ => {}
        }
    }
    Some(HostRoute { address: address?, ifindex: ifindex? })
}

const RTM_NEWTFILTER: u16 = 44;
const RTM_GETTFILTER: u16 = 46;
/// `struct tcmsg`.
const TCMSG_LEN: usize = 20;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
/// The clsact qdisc's hooks, as filters name their parent.
pub const TC_INGRESS_PARENT: u32 = 0xffff_fff2;
pub const TC_EGRESS_PARENT: u32 = 0xffff_fff3;

/// The names of the BPF programs the clsact filters of interface `ifindex`
/// at `parent` (a hook) run, as they were attached.
pub fn tc_filter_names(ifindex: u32, parent: u32) -> io::Result<Vec<String>> {
    let mut tcmsg = [0u8; TCMSG_LEN];
    tcmsg[0] = libc::AF_UNSPEC as u8;
    tcmsg[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    tcmsg[12..16].copy_from_slice(&parent.to_ne_bytes());
    let request = message(RTM_GETTFILTER, NLM_F_DUMP, 1, &tcmsg);
    let mut names = Vec::new();
    let each = |kind, body: &[u8]| names.extend(bpf_filter_name(kind, body));
    match Socket::open(libc::NETLINK_ROUTE)?.exchange(&request, each)? {
        Some(errno) if errno != 0 => Err(io::Error::from_raw_os_error(errno)),
        _ => Ok(names),
    }
}

/// A BPF filter's program name (`TCA_OPTIONS` → `TCA_BPF_NAME`).
fn bpf_filter_name(kind: u16, body: &[u8]) -> Option<String> {
    if kind != RTM_NEWTFILTER {
        return None;
    }
    let attrs = attributes(body.get(TCMSG_LEN..)?);
    let mut bpf = false;
    let mut name = None;
    for (kind, value) in attrs {
        match kind & NLA_TYPE_MASK {
            TCA_KIND => bpf = value.split(|b| *b == 0).next() == Some(b"bpf"),
            TCA_OPTIONS => {
                let named = attributes(value).find(|(k, _)| k & NLA_TYPE_MASK == TCA_BPF_NAME);
                let text = named.map(|(_, v)| v.split(|b| *b == 0).next().unwrap_or_default());
                name = text.map(|t| String::from_utf8_lossy(t).into_owned());
            }
            _ => {}
        }
    }
    name.filter(|_| bpf)
}

/// An attribute's type without its nested and byte-order flags.
const NLA_TYPE_MASK: u16 = 0x3fff;

/// The route attributes (`struct rtattr`, 4-byte aligned) as (type, value).
fn attributes(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    records(buf, 4, |header| {
        let len = u16::from_ne_bytes(header[0..2].try_into().ok()?);
        Some((len as usize, u16::from_ne_bytes(header[2..4].try_into().ok()?)))
    })
}

/// A reply message as the kernel frames it (tests).
#[cfg(test)]
pub fn reply(kind: u16, body: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + body.len();
    let mut msg = (len as u32).to_ne_bytes().to_vec();
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&[0; 10]);
    msg.extend_from_slice(body);
    msg.resize((len + 3) & !3, 0);
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attribute(kind: u16, value: &[u8]) -> Vec<u8> {
        let len = 4 + value.len();
        let mut out = (len as u16).to_ne_bytes().to_vec();
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize((len + 3) & !3, 0);
        out
    }

    fn route(family: i32, dst_len: u8, route_type: u8, dst: &[u8], oif: u32) -> Vec<u8> {
        let mut body = vec![family as u8, dst_len, 0, 0, 254, 3, 253, route_type, 0, 0, 0, 0];
        body.extend(attribute(15, &254u32.to_ne_bytes()));
        body.extend(attribute(RTA_DST, dst));
        body.extend(attribute(RTA_OIF, &oif.to_ne_bytes()));
        body
    }

    #[test]
    fn host_routes_are_read_by_the_kernels_layout() {
        let pod = route(libc::AF_INET, 32, RTN_UNICAST, &[10, 244, 0, 5], 7);
        let pod = host_route(RTM_NEWROUTE, &pod);
        assert_eq!(pod, Some(HostRoute { address: IpAddr::from([10, 244, 0, 5]), ifindex: 7 }));
        let v6 = [0xfd, 0, 2, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        let pod6 = host_route(RTM_NEWROUTE, &route(libc::AF_INET6, 128, RTN_UNICAST, &v6, 8));
        assert_eq!(pod6.map(|r| (r.address, r.ifindex)), Some((IpAddr::from(v6), 8)));
        // A subnet, a local address's route, another message: not pods.
        let subnet = route(libc::AF_INET, 24, RTN_UNICAST, &[10, 244, 1, 0], 3);
        assert_eq!(host_route(RTM_NEWROUTE, &subnet), None);
        let local = route(libc::AF_INET, 32, 2, &[192, 168, 1, 1], 3);
        assert_eq!(host_route(RTM_NEWROUTE, &local), None);
        assert_eq!(host_route(RTM_NEWROUTE + 1, &route(libc::AF_INET, 32, 1, &[1; 4], 3)), None);

        let request = message(RTM_GETROUTE, NLM_F_DUMP, 5, &[libc::AF_INET6 as u8; 1]);
        assert_eq!(u16::from_ne_bytes([request[6], request[7]]), NLM_F_DUMP | NLM_F_REQUEST);
        assert_eq!(u32::from_ne_bytes(request[8..12].try_into().unwrap()), 5);
    }

    #[test]
    fn bpf_filters_are_named_by_the_kernels_layout() {
        let mut body = vec![0u8; TCMSG_LEN];
        body.extend(attribute(TCA_KIND, b"bpf\0"));
        let mut options = attribute(3, &7u32.to_ne_bytes());
        options.extend(attribute(TCA_BPF_NAME, b"tc_pod_replies\0"));
        // Nested: the kernel may flag it so.
        body.extend(attribute(TCA_OPTIONS | 0x8000, &options));
        assert_eq!(bpf_filter_name(RTM_NEWTFILTER, &body).as_deref(), Some("tc_pod_replies"));
        let mut u32_filter = vec![0u8; TCMSG_LEN];
        u32_filter.extend(attribute(TCA_KIND, b"u32\0"));
        u32_filter.extend(attribute(TCA_OPTIONS, &attribute(TCA_BPF_NAME, b"x\0")));
        assert_eq!(bpf_filter_name(RTM_NEWTFILTER, &u32_filter), None, "not a BPF filter");
        assert_eq!(bpf_filter_name(RTM_NEWTFILTER, &body[..8]), None, "cut short");
    }

    #[test]
    fn replies_are_split_and_end_at_done_or_error() {
        let mut buf = reply(RTM_NEWROUTE, &[1, 2, 3]);
        buf.extend(reply(NLMSG_DONE, &[0; 4]));
        let kinds: Vec<(u16, usize)> = messages(&buf).map(|(k, b)| (k, b.len())).collect();
        assert_eq!(kinds, [(RTM_NEWROUTE, 3), (NLMSG_DONE, 4)]);
        assert_eq!(ending(NLMSG_DONE, &[0; 4]), Some(None));
        assert_eq!(ending(NLMSG_ERROR, &(-libc::ENOENT).to_ne_bytes()), Some(Some(libc::ENOENT)));
        assert_eq!(ending(NLMSG_ERROR, &0i32.to_ne_bytes()), Some(Some(0)));
        assert_eq!(ending(RTM_NEWROUTE, &[]), None);
        // A length past the buffer ends the walk.
        let mut cut = reply(RTM_NEWROUTE, &[1; 8]);
        cut.truncate(12);
        assert_eq!(messages(&cut).count(), 0);
    }
}
