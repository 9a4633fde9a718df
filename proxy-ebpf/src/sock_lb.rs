//! Socket-level load balancing: translate the destination once per socket
//! (TCP, connected UDP) or per datagram (unconnected UDP, whose datagrams to
//! a service keep to one backend while the flow is fresh), so packets travel
//! straight to the pod with no per-packet NAT.

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

/// Rewrites the address the syscall uses (destination, or the source a
/// reply is reported from).
#[inline(always)]
fn set_user_addr(ctx: &SockAddrContext, address: [u8; 4], port: u16) {
    // SAFETY: valid context; user_ip4/user_port are writable in these hooks.
    unsafe {
        (*ctx.sock_addr).user_ip4 = u32::from_ne_bytes(address);
        (*ctx.sock_addr).user_port = u16::to_be(port) as u32;
    }
}

#[inline(always)]
fn service_key(sa: &bpf_sock_addr) -> Option<ServiceKey> {
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    Some(ServiceKey::new(sa.user_ip4.to_ne_bytes(), u16::from_be(sa.user_port as u16), proto, 0))
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
    fn program(self, translate: bool) -> &'static str {
        match (self, translate) {
            (Hook::Socket, true) => "connect4",
            (Hook::Datagram, true) => "sendmsg4",
            (Hook::Socket, false) => "getpeername4",
            (Hook::Datagram, false) => "recvmsg4",
        }
    }
}

/// `connect4` and `sendmsg4`: pick a backend and rewrite the destination.
/// The clients are pods and node processes, in-cluster clients all (the
/// node's own as kube-proxy's "LOCAL traffic" rules treat it).
#[inline(always)]
pub fn try_translate(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let sa = sock_addr(ctx);
    let Some(key) = service_key(sa) else {
        return ALLOW;
    };
    let Some(cfg) = CONFIG.get(0) else { return ALLOW };
    let program = hook.program(true);
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
            set_user_addr(ctx, backend.address, backend.port);
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

/// `recvmsg4` and `getpeername4`: show the service address instead of the
/// backend's to the socket that was translated. A datagram's reply marks
/// its socket's flow answered (it then lives longer).
#[inline(always)]
pub fn try_reverse(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let sa = sock_addr(ctx);
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey {
        cookie,
        address: sa.user_ip4.to_ne_bytes(),
        port: u16::from_be(sa.user_port as u16),
        _pad: 0,
    };
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
                hook.program(false),
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
        set_user_addr(ctx, rev.address, rev.port);
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
