//! Sending a translated packet on: the rewrite, the FIB lookup and the
//! redirect past the stack; later fragments follow their first.

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibLookup,
        bpf_redir_neigh,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{Counter, CtKey, CtTuple, FragKey, dsr, log_level};

use crate::{
    family::Family,
    frame::Frame,
    log,
    maps::{CONFIG, FRAGMENTS, count},
    packet::{self, Packet},
    tc_act::{NEXT, SHOT, STACK},
};

/// A fragment after the first: it follows the first fragment's translation,
/// if that one came through here.
#[inline(always)]
pub(super) fn later_fragment(ctx: &TcContext, key: &FragKey) -> i32 {
    // SAFETY: copied out at once.
    let Some(to) = (unsafe { FRAGMENTS.get(key).copied() }) else {
        if CONFIG.get(0).is_some_and(|cfg| cfg.log_level >= log_level::DEBUG) {
            log::orphan_fragment(key);
        }
        return NEXT;
    };
    if packet::rewrite_fragment(ctx, key, &to).is_err() {
        count(Counter::Dropped);
        return SHOT;
    }
    let tuple = CtKey { saddr: to.saddr, daddr: to.daddr, proto: key.proto, ..CtKey::default() };
    send::<Ipv4Hdr>(ctx, &tuple)
}

/// Rewrites `pkt` to `to` and sends it towards its new destination; the
/// first fragment of a datagram leaves its translation for the others; a
/// DSR flow's packet (`Family::pend_dsr`) carries its service in an
/// option. The route comes first (it depends on `to` alone): a packet sent
/// on from here has its TTL decremented in the same rewrite as its tuple.
#[inline(always)]
pub(super) fn forward<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    pkt: &Packet<F::Tuple>,
    to: &F::Tuple,
) -> i32 {
    // SAFETY: bpf_fib_lookup is plain data; zero is a valid start.
    let mut fib: FibLookup = unsafe { core::mem::zeroed() };
    let routed = route::<F>(ctx, to, &mut fib);
    match packet::rewrite::<F, SCTP>(ctx, pkt, to, routed.is_some()) {
        Ok(true) => {}
        // The TTL ran out.
        Ok(false) => return SHOT,
        Err(_) => {
            count(Counter::Dropped);
            return SHOT;
        }
    }
    if !SCTP && apply_pending_dsr::<F>(ctx, pkt).is_err() {
        count(Counter::Dropped);
        return SHOT;
    }
    F::remember_fragment(pkt, to);
    match routed {
        Some(rc) => redirect::<F>(ctx, &fib, rc),
        None => STACK,
    }
}

/// Does what `dsr::action` or a new flow's dispatch left for the
/// rewritten `pkt`, if anything.
#[inline(always)]
fn apply_pending_dsr<F: Family>(ctx: &TcContext, pkt: &Packet<F::Tuple>) -> Result<(), i64> {
    let Some(pending) = F::take_pending_dsr() else { return Ok(()) };
    match pending.on {
        dsr::INSERT => F::insert_dsr(ctx, pkt.tuple.proto(), &pending),
        dsr::CLAMP => packet::clamp_mss::<F>(ctx, pkt, F::DSR_OVERHEAD),
        _ => Ok(()),
    }
}

/// Sends an already translated packet on: [`route`], the TTL decremented,
/// [`redirect`] (the stack for local or unroutable addresses).
#[inline(always)]
pub(crate) fn send<F: Family>(ctx: &TcContext, to: &F::Tuple) -> i32 {
    // SAFETY: as in `forward`.
    let mut fib: FibLookup = unsafe { core::mem::zeroed() };
    let Some(rc) = route::<F>(ctx, to, &mut fib) else { return STACK };
    match packet::decrement_ttl::<F>(ctx) {
        Ok(true) => redirect::<F>(ctx, &fib, rc),
        _ => SHOT,
    }
}

/// The FIB lookup of a packet translated to `to`, into `fib`: its result if
/// this program sends the packet on (`BPF_FIB_LKUP_RET_SUCCESS`, or
/// `NO_NEIGH` where the next hop's address is yet to be resolved), `None`
/// for local delivery (a host-network backend) or no route, where the
/// stack takes it.
#[inline(always)]
pub(crate) fn route<F: Family>(
    ctx: &impl Frame,
    to: &F::Tuple,
    fib: &mut FibLookup,
) -> Option<u32> {
    fib.family = F::AF;
    fib.l4_protocol = to.proto();
    fib.sport = to.sport().to_be();
    fib.dport = to.dport().to_be();
    fib.ifindex = ctx.ifindex();
    F::fib_addrs(fib, to);
    let size = core::mem::size_of::<FibLookup>() as i32;
    // SAFETY: the program's own context, and `fib` of the size given.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), fib, size, 0) } as u32;
    (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH).then_some(rc)
}

/// Redirects a packet [`route`] found the next hop of (`rc`) to its
/// interface: with the neighbour's MAC address where the FIB knew it, else
/// by `bpf_redirect_neigh`.
#[inline(always)]
fn redirect<F: Family>(ctx: &TcContext, fib: &FibLookup, rc: u32) -> i32 {
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        if packet::set_macs(ctx, &[fib.dmac, fib.smac]).is_err() {
            return SHOT;
        }
        return unsafe { bpf_redirect(fib.ifindex, 0) } as i32;
    }
    // SAFETY: plain data.
    let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
    nh.nh_family = F::AF as u32;
    F::next_hop(fib, &mut nh);
    unsafe {
        bpf_redirect_neigh(fib.ifindex, &mut nh, core::mem::size_of::<bpf_redir_neigh>() as i32, 0)
            as i32
    }
}
