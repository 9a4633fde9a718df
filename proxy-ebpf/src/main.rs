//! BPF programs of the service proxy. Entry points are thin; the logic lives
//! in `sock_lb` (socket hooks) and `lb` (service lookup, backend choice).
#![no_std]
#![no_main]
// The `bpf_sock_destroy` kfunc call (see `sock_end`).
#![feature(asm_experimental_arch)]

mod checksum;
mod conntrack;
mod explain;
mod family;
mod frame;
mod handoff;
mod icmp;
mod lb;
mod log;
mod maps;
mod monitor;
mod packet;
mod prefilter;
mod reject;
mod report;
mod run;
mod sock_end;
mod sock_lb;
mod stats;
mod tc_act;
mod tc_lb;
mod xdp_lb;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use sock_lb::{Hook, V4};
use tc_lb::Scope;

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    sock_lb::try_translate::<V4>(&ctx, Hook::Socket)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    sock_lb::try_translate::<V4>(&ctx, Hook::Datagram)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    sock_lb::try_reverse::<V4>(&ctx, Hook::Datagram)
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    sock_lb::try_reverse::<V4>(&ctx, Hook::Socket)
}

/// IPv6 sockets: to IPv6 services, and to IPv4 ones through their
/// v4-mapped address (`::ffff:10.96.0.10`).
#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    sock_lb::try_translate6(&ctx, Hook::Socket)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    sock_lb::try_translate6(&ctx, Hook::Datagram)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    sock_lb::try_reverse6(&ctx, Hook::Datagram)
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    sock_lb::try_reverse6(&ctx, Hook::Socket)
}

/// Ingress of node and pod interfaces: per-packet service translation.
/// Inlined into the entry the macro wraps it in: left a call of its own
/// (LLVM's choice once the path grew), every packet paid the call before
/// the pre-filter, a miss 38 -> 45 ns.
#[classifier]
#[inline(always)]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    tc_lb::try_ingress(&ctx, Scope::Everything)
}

/// Ingress of pod interfaces when the socket LB translates every pod's
/// connections: only replies of per-packet flows (NodePort and others to a
/// pod here) are left to do.
#[classifier]
pub fn tc_pod_replies(ctx: TcContext) -> i32 {
    tc_lb::try_ingress(&ctx, Scope::TrackedOnly)
}

/// Egress of the same interfaces: replies the stack sends for translated
/// flows (host-network backends).
#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    tc_lb::try_egress(&ctx)
}

/// The three above for IPv6 packets, entered by tail call (`TC6`).
#[classifier]
pub fn tc_ingress6(ctx: TcContext) -> i32 {
    tc_lb::try_ingress6(&ctx, Scope::Everything)
}

#[classifier]
pub fn tc_pod_replies6(ctx: TcContext) -> i32 {
    tc_lb::try_ingress6(&ctx, Scope::TrackedOnly)
}

#[classifier]
pub fn tc_egress6(ctx: TcContext) -> i32 {
    tc_lb::try_egress6(&ctx)
}

/// A new IPv4 TCP or UDP flow's first packet, decided in `tc_ingress`
/// (`NEW_FLOW`), entered by tail call (`TC_NEW`).
#[classifier]
pub fn tc_new_flow(ctx: TcContext) -> i32 {
    tc_lb::try_new_flow(&ctx)
}

/// The four above for SCTP packets (no socket hook sees SCTP: ingress
/// translates new associations on every interface), entered by tail call
/// (`TC_SCTP`).
#[classifier]
#[inline(always)]
pub fn tc_ingress_sctp(ctx: TcContext) -> i32 {
    tc_lb::try_ingress_sctp(&ctx)
}

#[classifier]
pub fn tc_egress_sctp(ctx: TcContext) -> i32 {
    tc_lb::try_egress_sctp(&ctx)
}

#[classifier]
pub fn tc_ingress6_sctp(ctx: TcContext) -> i32 {
    tc_lb::try_ingress6_sctp(&ctx)
}

#[classifier]
pub fn tc_egress6_sctp(ctx: TcContext) -> i32 {
    tc_lb::try_egress6_sctp(&ctx)
}

/// The driver hook of node interfaces (`--bpf-lb-acceleration`): tracked
/// external flows forwarded before the stack; everything else to tc.
#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    xdp_lb::try_ingress(&ctx)
}

/// Its IPv6 packets, entered by tail call (`XDP6`).
#[xdp]
pub fn xdp_ingress6(ctx: XdpContext) -> u32 {
    xdp_lb::try_ingress6(&ctx)
}

/// Socket iterators ending the TCP and UDP sockets connected to backends
/// that left (`SOCK_ENDS`); run by the agent, never attached to a hook.
///
/// # Safety
/// Called by the kernel with the iterator's context.
#[unsafe(no_mangle)]
#[unsafe(link_section = "iter/tcp")]
pub unsafe extern "C" fn end_tcp_sockets(ctx: *mut core::ffi::c_void) -> i32 {
    // SAFETY: the iterator's context.
    unsafe { sock_end::try_end(ctx, proxy_common::IPPROTO_TCP) }
}

/// # Safety
/// As above.
#[unsafe(no_mangle)]
#[unsafe(link_section = "iter/udp")]
pub unsafe extern "C" fn end_udp_sockets(ctx: *mut core::ffi::c_void) -> i32 {
    // SAFETY: as above.
    unsafe { sock_end::try_end(ctx, proxy_common::IPPROTO_UDP) }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
