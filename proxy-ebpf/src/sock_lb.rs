//! Socket-level load balancing: translate the destination once per socket
//! (TCP, connected UDP) or per datagram (unconnected UDP, whose datagrams to
//! a service keep to one backend while the flow is fresh), so packets travel
//! straight to the pod with no per-packet NAT. The `*6` hooks serve IPv6
//! sockets that reach an IPv4 service through its v4-mapped address
//! (`::ffff:10.96.0.10`), as dual-stack applications do, from the same maps.

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{
        bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, generated::bpf_set_retval,
    },
    programs::SockAddrContext,
};
use proxy_common::{
    AFFINITY_CLIENT_NETNS, Backend, Config, Counter, IPPROTO_TCP, IPPROTO_UDP, ServiceKey,
    ServiceValue, SockFlow, SockFlowKey, SockRevNat, SockRevNatKey, log_level,
};

use crate::{
    lb::{self, Verdict, Via},
    log::{self, record},
    maps::{CONFIG, SOCK_FLOWS, SOCK_REV_NAT, count},
};

/// What the hook sees: a socket's one destination (connect, getpeername)
/// or one datagram of an unconnected socket (sendmsg, recvmsg).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Socket,
    Datagram,
}

/// Which address of the context a hook reads and writes: the IPv4 one (the
/// `*4` hooks), or the IPv4 address inside an IPv6 socket's v4-mapped one
/// (the `*6` hooks; other IPv6 addresses pass untouched).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V4Mapped,
}

/// The third word of a v4-mapped IPv6 address (`::ffff:0:0/96`), as it lies
/// in memory.
const V4_MAPPED: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Return codes of cgroup sock_addr programs.
pub const ALLOW: i32 = 1;
pub const REJECT: i32 = 0;

const ECONNREFUSED: i32 = 111;

/// Whether the kernel has `bpf_set_retval` (5.18+): the agent probes and
/// sets it at load time. A frozen read-only global, so on older kernels the
/// verifier prunes the call it would reject, and a refusal fails
/// `connect()` with EPERM instead of ECONNREFUSED.
#[unsafe(no_mangle)]
static SET_RETVAL: u8 = 1;

#[inline(always)]
fn sock_addr(ctx: &SockAddrContext) -> &bpf_sock_addr {
    // SAFETY: the kernel hands every sock_addr program a valid context.
    unsafe { &*ctx.sock_addr }
}

/// The IPv4 address the syscall uses, if the hook's family has one: a
/// `*6` hook's address must be v4-mapped. (Each hook reads only the words
/// the verifier lets it: the family is a constant of the program.)
#[inline(always)]
fn user_ip4(sa: &bpf_sock_addr, family: Family) -> Option<[u8; 4]> {
    match family {
        Family::V4 => Some(sa.user_ip4.to_ne_bytes()),
        Family::V4Mapped => {
            let mapped = sa.user_ip6[0] == 0 && sa.user_ip6[1] == 0 && sa.user_ip6[2] == V4_MAPPED;
            mapped.then(|| sa.user_ip6[3].to_ne_bytes())
        }
    }
}

/// Rewrites the address the syscall uses (destination, or the source a
/// reply is reported from); a v4-mapped one keeps its `::ffff:` prefix.
#[inline(always)]
fn set_user_addr(ctx: &SockAddrContext, family: Family, address: [u8; 4], port: u16) {
    // SAFETY: valid context; the hook's address words and user_port are
    // writable in these hooks.
    unsafe {
        match family {
            Family::V4 => (*ctx.sock_addr).user_ip4 = u32::from_ne_bytes(address),
            Family::V4Mapped => (*ctx.sock_addr).user_ip6[3] = u32::from_ne_bytes(address),
        }
        (*ctx.sock_addr).user_port = u16::to_be(port) as u32;
    }
}

#[inline(always)]
fn service_key(sa: &bpf_sock_addr, family: Family) -> Option<ServiceKey> {
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    let address = user_ip4(sa, family)?;
    Some(ServiceKey::new(address, u16::from_be(sa.user_port as u16), proto, 0))
}

/// Whether sockets of the network namespace `netns` (a cookie) are
/// translated here: all of them, or with `--socket-lb-host-netns-only` only
/// the node's own, so pods (service meshes, VMs) see the ClusterIP and the
/// per-packet path serves them.
#[inline(always)]
fn in_scope(ctx: &SockAddrContext, cfg: &Config) -> bool {
    if cfg.host_netns_cookie == 0 {
        return true;
    }
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    netns == cfg.host_netns_cookie
}

impl Hook {
    /// The program's name, for the decision records.
    #[inline(always)]
    fn program(self, family: Family, translate: bool) -> &'static str {
        match (self, family, translate) {
            (Hook::Socket, Family::V4, true) => "connect4",
            (Hook::Datagram, Family::V4, true) => "sendmsg4",
            (Hook::Socket, Family::V4, false) => "getpeername4",
            (Hook::Datagram, Family::V4, false) => "recvmsg4",
            (Hook::Socket, Family::V4Mapped, true) => "connect6",
            (Hook::Datagram, Family::V4Mapped, true) => "sendmsg6",
            (Hook::Socket, Family::V4Mapped, false) => "getpeername6",
            (Hook::Datagram, Family::V4Mapped, false) => "recvmsg6",
        }
    }
}

/// `connect4` and `sendmsg4` (and their `*6` twins for v4-mapped
/// addresses): pick a backend and rewrite the destination. The clients are
/// pods and node processes, in-cluster clients all (the node's own as
/// kube-proxy's "LOCAL traffic" rules treat it).
#[inline(always)]
pub fn try_translate(ctx: &SockAddrContext, hook: Hook, family: Family) -> i32 {
    let sa = sock_addr(ctx);
    let Some(key) = service_key(sa, family) else {
        return ALLOW;
    };
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    let program = hook.program(family, true);
    let Some(svc) = lb::lookup_frontend(&key) else {
        record!(
            cfg,
            ctx,
            program,
            TRACE,
            "{:i}:{} proto {}: no service",
            key.address,
            key.port,
            key.proto
        );
        return ALLOW;
    };
    if !in_scope(ctx, cfg) {
        record!(
            cfg,
            ctx,
            program,
            TRACE,
            "{:i}:{} proto {}: a pod's socket, left to the per-packet path",
            key.address,
            key.port,
            key.proto
        );
        return ALLOW;
    }
    let (key, svc) = lb::in_cluster_scope(&key, &svc);
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // An unconnected UDP socket's datagrams to a service stay on one backend
    // while the flow is fresh, as conntrack keeps a 5-tuple on one pod.
    // Affinity decides alone where the service has it.
    let flow = (hook == Hook::Datagram
        && key.proto == IPPROTO_UDP
        && svc.count != 0
        && !svc.flags.is_affinity())
    .then_some(SockFlowKey { cookie, rev_nat_id: svc.rev_nat_id, _pad: 0 });
    // A flow to start: none remembered (or it went stale).
    let (verdict, new_flow) = match flow.as_ref().and_then(|flow| flow_backend(cfg, flow, &svc)) {
        Some(verdict) => (verdict, None),
        None => {
            let client = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
            (lb::choose(&key, &svc, client, AFFINITY_CLIENT_NETNS), flow)
        }
    };
    match verdict {
        Verdict::NoBackend => {
            record!(
                cfg,
                ctx,
                program,
                INFO,
                "{:i}:{} proto {}: no endpoint, refused (ECONNREFUSED)",
                key.address,
                key.port,
                key.proto
            );
            // Fail the call at once with ECONNREFUSED instead of EPERM.
            // SAFETY: reading a global the loader initialised.
            if unsafe { core::ptr::read_volatile(&SET_RETVAL) } != 0 {
                unsafe { bpf_set_retval(-ECONNREFUSED) };
            }
            REJECT
        }
        Verdict::Backend { backend, backend_id, rev_nat_id, via } => {
            if let Some(flow) = new_flow {
                remember(&flow, backend_id);
            }
            if cfg.log_level >= log_level::DEBUG {
                let (how, among) = log::why(via, svc.flags);
                record!(
                    cfg,
                    ctx,
                    program,
                    DEBUG,
                    "{:i}:{} proto {}: backend {:i}:{} by {} among {}",
                    key.address,
                    key.port,
                    key.proto,
                    backend.address,
                    backend.port,
                    how,
                    among
                );
            }
            let rev_key =
                SockRevNatKey { cookie, address: backend.address, port: backend.port, _pad: 0 };
            let rev = SockRevNat { address: key.address, port: key.port, _pad: 0, rev_nat_id };
            let _ = SOCK_REV_NAT.insert(rev_key, rev, 0);
            set_user_addr(ctx, family, backend.address, backend.port);
            ALLOW
        }
    }
}

/// The backend of the socket's flow `key` to `svc`, if the flow is fresh
/// and the backend still exists; the datagram refreshes it.
#[inline(always)]
fn flow_backend(cfg: &Config, key: &SockFlowKey, svc: &ServiceValue) -> Option<Verdict> {
    let entry = SOCK_FLOWS.get_ptr_mut(key)?;
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: the LRU entry may be recycled concurrently; at worst we read a
    // stale backend id, which is then checked against the backends map.
    let flow = unsafe { *entry };
    if !flow.is_fresh(cfg, now) {
        return None;
    }
    let backend: Backend = lb::backend(flow.backend_id)?;
    unsafe { (*entry).last_used_ns = now };
    count(Counter::ServiceHit);
    let (backend_id, rev_nat_id) = (flow.backend_id, svc.rev_nat_id);
    Some(Verdict::Backend { backend, backend_id, rev_nat_id, via: Via::Flow })
}

/// Starts the socket's flow `key` on `backend_id`.
#[inline(always)]
fn remember(key: &SockFlowKey, backend_id: u32) {
    let now = unsafe { bpf_ktime_get_ns() };
    let flow = SockFlow { last_used_ns: now, backend_id, answered: 0, _pad: [0; 3] };
    let _ = SOCK_FLOWS.insert(key, flow, 0);
}

/// `recvmsg4` and `getpeername4` (and their `*6` twins): show the service
/// address instead of the backend's to the socket that was translated. A
/// datagram's reply marks its socket's flow answered (it then lives longer).
#[inline(always)]
pub fn try_reverse(ctx: &SockAddrContext, hook: Hook, family: Family) -> i32 {
    let sa = sock_addr(ctx);
    let Some(address) = user_ip4(sa, family) else { return ALLOW };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey { cookie, address, port: u16::from_be(sa.user_port as u16), _pad: 0 };
    // SAFETY: copied out at once.
    let Some(rev) = (unsafe { SOCK_REV_NAT.get(key).copied() }) else {
        return ALLOW;
    };
    // Only while the service still exists: a reply from a pod that is no
    // longer behind it should show its own address. The socket got either
    // scope of the address (the internal one has its own id).
    let frontend = ServiceKey::new(rev.address, rev.port, sa.protocol as u8, 0);
    let Some(svc) = lb::lookup_frontend(&frontend) else {
        if let Some(cfg) = CONFIG.get(0) {
            record!(
                cfg,
                ctx,
                hook.program(family, false),
                DEBUG,
                "{:i}:{}: its service {:i}:{} is gone, the peer's own address shown",
                key.address,
                key.port,
                rev.address,
                rev.port
            );
        }
        return ALLOW;
    };
    if svc.rev_nat_id == rev.rev_nat_id
        || lb::in_cluster_scope(&frontend, &svc).1.rev_nat_id == rev.rev_nat_id
    {
        count(Counter::RevNat);
        set_user_addr(ctx, family, rev.address, rev.port);
        if hook == Hook::Datagram {
            let flow = SockFlowKey { cookie, rev_nat_id: rev.rev_nat_id, _pad: 0 };
            if let Some(entry) = SOCK_FLOWS.get_ptr_mut(flow) {
                // SAFETY: a one-byte store into a live entry.
                unsafe { (*entry).answered = 1 };
            }
        }
    }
    ALLOW
}
