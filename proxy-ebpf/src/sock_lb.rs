//! Socket-level load balancing: translate the destination once per socket
//! (TCP, connected UDP) or per datagram (unconnected UDP), so packets travel
//! straight to the pod with no per-packet NAT.

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, generated::bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{
    AFFINITY_CLIENT_NETNS, Counter, IPPROTO_TCP, IPPROTO_UDP, ServiceKey, SockRevNat, SockRevNatKey,
};

use crate::{
    lb::{self, Verdict},
    maps::{CONFIG, SOCK_REV_NAT, count},
};

/// Return codes of cgroup sock_addr programs.
pub const ALLOW: i32 = 1;
pub const REJECT: i32 = 0;

const ECONNREFUSED: i32 = 111;

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
fn in_scope(netns: u64) -> bool {
    CONFIG.get(0).is_none_or(|cfg| cfg.host_netns_cookie == 0 || cfg.host_netns_cookie == netns)
}

/// `connect4` and `sendmsg4`: pick a backend and rewrite the destination.
/// The clients are pods and node processes, in-cluster clients all (the
/// node's own as kube-proxy's "LOCAL traffic" rules treat it).
#[inline(always)]
pub fn try_translate(ctx: &SockAddrContext) -> i32 {
    let sa = sock_addr(ctx);
    let Some(key) = service_key(sa) else {
        return ALLOW;
    };
    let client = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    if !in_scope(client) {
        return ALLOW;
    }
    match lb::select_in_cluster(&key, client, AFFINITY_CLIENT_NETNS) {
        Verdict::NotAService => ALLOW,
        Verdict::NoBackend => {
            // Fail the call at once with ECONNREFUSED instead of EPERM.
            unsafe { bpf_set_retval(-ECONNREFUSED) };
            REJECT
        }
        Verdict::Backend { backend, rev_nat_id } => {
            let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
            let rev_key =
                SockRevNatKey { cookie, address: backend.address, port: backend.port, _pad: 0 };
            let rev = SockRevNat { address: key.address, port: key.port, _pad: 0, rev_nat_id };
            let _ = SOCK_REV_NAT.insert(rev_key, rev, 0);
            set_user_addr(ctx, backend.address, backend.port);
            ALLOW
        }
    }
}

/// `recvmsg4` and `getpeername4`: show the service address instead of the
/// backend's to the socket that was translated.
#[inline(always)]
pub fn try_reverse(ctx: &SockAddrContext) -> i32 {
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
    let Some(svc) = lb::lookup_frontend(&frontend) else { return ALLOW };
    if svc.rev_nat_id == rev.rev_nat_id
        || lb::in_cluster_scope(&frontend, &svc).1.rev_nat_id == rev.rev_nat_id
    {
        count(Counter::RevNat);
        set_user_addr(ctx, rev.address, rev.port);
    }
    ALLOW
}
