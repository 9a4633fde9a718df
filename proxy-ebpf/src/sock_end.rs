//! Ending the connected sockets of a backend that left its service: socket
//! iterators (`iter/tcp`, `iter/udp`) that destroy, with the
//! `bpf_sock_destroy` kfunc (Linux 6.5+), every socket the socket LB
//! connected to a backend named in `SOCK_ENDS`. The agent runs them in each
//! network namespace after a sync that removed backends; where the kernel
//! lacks the kfunc it uses `sock_diag` instead.
//!
//! The socket's peer is the backend (`connect4` or `connect6` rewrote it);
//! `SOCK_REV_NAT` (`SOCK_REV_NAT6` for IPv6 backends) holds only sockets
//! the socket LB translated, and says for which frontend, so a socket the
//! application connected to a pod directly is never touched.

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_get_socket_cookie, bpf_probe_read_kernel, generated::bpf_seq_write};
use proxy_common::{SOCK_DESTROY_CALL, SockEndKey, SockRevNatKey, SockRevNatKey6, v4_mapped};

use crate::maps::{SOCK_ENDS, SOCK_REV_NAT, SOCK_REV_NAT6};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// The leading fields of the kernel's `struct sock_common`, whose offsets
/// have not moved since these iterators exist.
#[repr(C)]
struct SockCommon {
    daddr: [u8; 4],
    rcv_saddr: [u8; 4],
    hash: u32,
    dport: u16,
    num: u16,
    family: u16,
}

/// Where `skc_v6_daddr` lies in `struct sock_common` (64-bit kernels built
/// with IPv6 and network namespaces: Debian's 5.10 to 6.18 alike).
const V6_DADDR_OFFSET: usize = 56;

/// `struct bpf_iter_meta`: the seq_file the iterator writes to.
#[repr(C)]
struct IterMeta {
    seq: *mut c_void,
}

/// `struct bpf_iter__tcp` and `struct bpf_iter__udp` begin alike: the meta,
/// then the socket (`sock_common` for TCP, `udp_sock` for UDP, whose first
/// member is a `sock_common`). NULL at the end of the walk.
#[repr(C)]
struct IterCtx {
    meta: *const IterMeta,
    sk: *mut SockCommon,
}

/// Looks at one socket; writes the cookie of each socket it ends to the
/// iterator's output, so the agent can count them.
///
/// # Safety
/// `ctx` is the iterator's context, given by the kernel.
pub unsafe fn try_end(ctx: *const c_void, proto: u8) -> i32 {
    let ctx = ctx as *const IterCtx;
    // SAFETY: the kernel's context; `sk` may be NULL, checked.
    let (meta, sk) = unsafe { ((*ctx).meta, (*ctx).sk) };
    if sk.is_null() {
        return 0;
    }
    // SAFETY: a trusted kernel pointer the verifier lets us read.
    let (family, daddr, dport) = unsafe { ((*sk).family, (*sk).daddr, (*sk).dport) };
    // An IPv6 socket connected to a v4-mapped address holds the IPv4 one in
    // `daddr` too; one connected elsewhere has no entry under its cookie.
    if family != AF_INET && family != AF_INET6 {
        return 0;
    }
    // SAFETY: the helper takes any socket pointer of the iterator.
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut c_void) };
    let port = u16::from_be(dport);
    let translated = if family == AF_INET6 { translated6(sk, cookie, port) } else { None };
    let Some((address, rev)) = translated.or_else(|| {
        let translated = SockRevNatKey { cookie, address: daddr, port, _pad: 0 };
        // SAFETY: a plain lookup; the value is copied out at once.
        let rev = unsafe { SOCK_REV_NAT.get(translated) }.map(|v| v.rev_nat_id)?;
        Some((v4_mapped(daddr), rev))
    }) else {
        return 0;
    };
    let key = SockEndKey { address, port, proto, _pad: 0, rev_nat_id: rev };
    // Rev-NAT id 0: the backend left every frontend.
    let every = SockEndKey { rev_nat_id: 0, ..key };
    // SAFETY: plain lookups.
    let listed = unsafe { SOCK_ENDS.get(key).is_some() || SOCK_ENDS.get(every).is_some() };
    // SAFETY: the iterator's own socket, as the kfunc requires.
    if listed && unsafe { sock_destroy(sk) } == 0 {
        // SAFETY: the iterator's seq_file and a local of the stated size.
        unsafe {
            bpf_seq_write((*meta).seq as *mut _, &cookie as *const u64 as *const c_void, 8);
        }
    }
    0
}

/// An IPv6 socket the socket LB sent to an IPv6 backend: the backend's
/// address and the frontend's reverse-NAT id.
#[inline(always)]
fn translated6(sk: *mut SockCommon, cookie: u64, port: u16) -> Option<([u8; 16], u32)> {
    // SAFETY: a kernel read within the socket's sock_common.
    let address: [u8; 16] = unsafe {
        bpf_probe_read_kernel((sk as *const u8).add(V6_DADDR_OFFSET) as *const [u8; 16]).ok()?
    };
    let key = SockRevNatKey6 { cookie, address, port, _pad: [0; 6] };
    // SAFETY: a plain lookup; the value is copied out at once.
    let rev = unsafe { SOCK_REV_NAT6.get(key) }.map(|v| v.rev_nat_id)?;
    Some((address, rev))
}

/// `int bpf_sock_destroy(struct sock_common *sk)`.
///
/// # Safety
/// `sk` is a socket of a socket iterator.
#[inline(always)]
unsafe fn sock_destroy(sk: *mut SockCommon) -> i64 {
    let ret: i64;
    // The instruction as `SOCK_DESTROY_CALL` gives it; the agent puts the
    // kfunc's BTF id in its immediate before loading.
    unsafe {
        core::arch::asm!(
            ".quad {call}",
            call = const SOCK_DESTROY_CALL,
            inlateout("r1") sk => _,
            lateout("r0") ret,
            lateout("r2") _,
            lateout("r3") _,
            lateout("r4") _,
            lateout("r5") _,
        );
    }
    ret
}
