//! tc egress: replies the stack sends (host-network backends) reverse
//! translated on their way out.

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use proxy_common::{
    Config, Counter, CtTuple, CtValue, DropReason, IPPROTO_SCTP, TC_SCTP_EGRESS, TC_SCTP_EGRESS6,
    TC6_EGRESS, log_level, record::Outcome,
};

use super::{
    filtered, flow6,
    icmp_errors::{icmp_error, icmp_error6},
    record, to_ipv6, to_sctp,
};
use crate::{
    conntrack,
    family::Family,
    icmp,
    log::Printable,
    maps::{CONFIG, count},
    packet::{self, Packet, Parsed, SCTP_ALONE, TCP_AND_UDP},
    prefilter::Hook,
    run::Run,
    stats::{self, Event},
    tc_act::{NEXT, SHOT},
};

/// Egress of the same interfaces: replies of host-network backends, which
/// the stack sends (translated packets it delivered locally), are reverse
/// translated on their way out. The pre-filter lets only those (and ICMP
/// errors) reach the conntrack lookup: packets this datapath redirected, and
/// every other packet leaving towards a pod, pass at the cost of one bit.
#[inline(always)]
pub fn try_egress(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    if filtered(ctx, cfg, Hook::Egress) {
        return NEXT;
    }
    let pkt = match packet::parse(ctx) {
        Some(Parsed::Packet(pkt)) if pkt.tuple.proto == IPPROTO_SCTP => {
            return to_sctp(ctx, TC_SCTP_EGRESS);
        }
        Some(Parsed::Packet(pkt)) => pkt,
        Some(Parsed::Icmp(msg)) => {
            return icmp_error::<Ipv4Hdr>(ctx, icmp::parse(ctx, &msg).as_ref(), false);
        }
        Some(Parsed::Fragment(_)) => return NEXT,
        None => return to_ipv6(ctx, TC6_EGRESS),
    };
    reverse::<Ipv4Hdr, TCP_AND_UDP>(ctx, cfg, &pkt)
}

/// The SCTP program's egress (`tc_egress_sctp`): replies of host-network
/// backends, as [`try_egress`]'s.
#[inline(always)]
pub fn try_egress_sctp(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    match packet::parse(ctx) {
        Some(Parsed::Packet(pkt)) if pkt.tuple.proto == IPPROTO_SCTP => {
            reverse::<Ipv4Hdr, SCTP_ALONE>(ctx, cfg, &pkt)
        }
        _ => NEXT,
    }
}

/// The IPv6 program's egress (`tc_egress6`). The reverse translation is a
/// step of its own, beside the ICMPv6 one rather than under it: older
/// verifiers (6.1) count the two frames together otherwise (544 bytes).
#[inline(always)]
pub fn try_egress6(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    let Some(flow) = flow6() else { return NEXT };
    let pkt = &mut flow.pkt;
    if !packet::parse6(ctx, pkt) {
        return icmp_error6(ctx, false);
    }
    if pkt.tuple.proto == IPPROTO_SCTP {
        return to_sctp(ctx, TC_SCTP_EGRESS6);
    }
    Ipv6Hdr::step(
        #[inline(always)]
        || reverse::<Ipv6Hdr, TCP_AND_UDP>(ctx, cfg, pkt),
    )
}

/// The IPv6 SCTP program's egress (`tc_egress6_sctp`).
#[inline(always)]
pub fn try_egress6_sctp(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    let Some(flow) = flow6() else { return NEXT };
    let pkt = &mut flow.pkt;
    if !packet::parse6(ctx, pkt) || pkt.tuple.proto != IPPROTO_SCTP {
        return NEXT;
    }
    Ipv6Hdr::step(
        #[inline(always)]
        || reverse::<Ipv6Hdr, SCTP_ALONE>(ctx, cfg, pkt),
    )
}

/// A packet the stack sends: rewritten if it is of a tracked flow, and left
/// to the stack, which routed it already.
#[inline(always)]
fn reverse<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    cfg: &Config,
    pkt: &Packet<F::Tuple>,
) -> i32
where
    F::Tuple: Printable,
{
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(entry) = conntrack::lookup::<F>(pkt, ctx.len(), cfg, now, || Run::Real) else {
        record(cfg, log_level::TRACE, false, &pkt.tuple, Outcome::NoFlow);
        return NEXT;
    };
    count(Counter::CtHit);
    let rev_nat_id = entry.rev_nat_id();
    match packet::rewrite::<F, SCTP>(ctx, pkt, &entry.rewritten(pkt.tuple.proto()), false) {
        Ok(_) => {
            // As on ingress: the entry counted it, unless lean.
            if !F::Entry::COUNTS {
                stats::count(rev_nat_id, Event::packet(ctx.len()));
            }
            NEXT
        }
        Err(_) => {
            count(Counter::Dropped);
            stats::count(rev_nat_id, Event::dropped(DropReason::RewriteFailed));
            SHOT
        }
    }
}
