//! ICMP and ICMPv6 errors quoting a packet of a translated flow, translated
//! back for the packet's sender.

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use network_types::ip::Ipv6Hdr;
use proxy_common::{Counter, CtTuple};

use super::forward::send;
use crate::{
    family::Family,
    icmp::{self, IcmpError},
    maps::count,
    tc_act::{NEXT, SHOT},
};

/// An ICMP error quoting a packet of a translated flow is translated back
/// for the packet's sender (`icmp`). On ingress it is then sent on like a
/// translated packet. On egress (errors the node's stack sends, e.g. about
/// a packet for a host-network backend) the stack routed it already: it is
/// translated only where its destination stays.
#[inline(always)]
pub(super) fn icmp_error<F: Family>(
    ctx: &TcContext,
    err: Option<&IcmpError<F::Tuple>>,
    ingress: bool,
) -> i32 {
    let Some(err) = err else { return NEXT };
    // Filled in place by the step (IPv6: a BPF call returns no struct).
    let mut to = err.tuple;
    let found = F::step(
        #[inline(always)]
        || match icmp::translation::<F>(err, unsafe { bpf_ktime_get_ns() }) {
            Some(tuple) => {
                to = tuple;
                true
            }
            None => false,
        },
    );
    if !found || (!ingress && to.daddr != err.tuple.daddr) {
        return NEXT;
    }
    let rewritten = F::step(
        #[inline(always)]
        || icmp::rewrite::<F>(ctx, err, &to).is_ok(),
    );
    if !rewritten {
        count(Counter::Dropped);
        return SHOT;
    }
    count(Counter::IcmpRevNat);
    if !ingress {
        return NEXT;
    }
    // The outer tuple in the step's frame (IPv6: the caller's is full).
    F::step(
        #[inline(always)]
        || send::<F>(ctx, &F::Tuple::new(to.saddr, to.daddr, 0, 0, F::ICMP)),
    )
}

/// An IPv6 packet that is no TCP or UDP one: an ICMPv6 error about a
/// translated flow is translated as ICMP ones are; anything else (neighbour
/// discovery among it) passes untouched. A BPF call of its own, whose frame
/// holds the error's tuples, with each step a call of its own from here:
/// the IPv6 programs' frames stay as they were.
#[inline(never)]
pub(super) fn icmp_error6(ctx: &TcContext, ingress: bool) -> i32 {
    let mut err = IcmpError::default();
    let parsed = Ipv6Hdr::step(
        #[inline(always)]
        || icmp::parse6(ctx, &mut err).is_some(),
    );
    icmp_error::<Ipv6Hdr>(ctx, parsed.then_some(&err), ingress)
}
