//! On a backend's node: packets another node sent here by direct server
//! return, recognised by their option and sent on to the pod.

use aya_ebpf::programs::TcContext;
use proxy_common::{Config, Counter, CtTuple, DropReason};

use super::{forward::send, stat};
use crate::{
    conntrack::{self, Learnt},
    family::Family,
    lb,
    maps::count,
    monitor::{self, EventAddr, What},
    packet::Flow,
    run::Run,
    stats::Event,
    tc_act::{NEXT, SHOT},
};

/// Whether a packet of no flow was sent here by direct server return: if
/// so, `flow.to` is its tuple with the service its option names as the
/// destination. (Written in place: the IPv6 path's frame has no room for
/// the service.)
#[inline(always)]
pub(super) fn dsr_service<F: Family>(ctx: &TcContext, flow: &mut Flow<F::Tuple>) -> bool {
    let Some((address, port)) = F::dsr_service(ctx) else { return false };
    let t = &flow.pkt.tuple;
    flow.to = F::Tuple::new(t.saddr(), address, t.sport(), port, t.proto());
    true
}

/// On a backend's node, a packet sent here by direct server return
/// ([`dsr_service`]): the flow's reply entry made or renewed
/// (`conntrack::learn_dsr`), then the packet sent on to its pod past the
/// stack, as translated packets are (the node's netfilter never sees the
/// replies, which leave by redirect, and would call the flow's later
/// packets invalid). Explain runs write nothing and pass.
#[inline(always)]
pub(super) fn dsr_arrival<F: Family>(ctx: &TcContext, cfg: &Config, f: &Flow<F::Tuple>) -> i32
where
    F::Addr: EventAddr,
{
    if Run::of(ctx) == Run::Explain {
        return NEXT;
    }
    let (learnt, rev_nat_id) = F::step(
        #[inline(always)]
        || {
            let service = &f.to;
            let key = F::service_key(service.daddr(), service.dport(), service.proto());
            // The frontend's id here, for its counters (none: 0).
            let rev_nat_id = lb::lookup_frontend(&key).map_or(0, |v| v.rev_nat_id);
            (conntrack::learn_dsr::<F>(&f.pkt, service, rev_nat_id, cfg, f.now), rev_nat_id)
        },
    );
    match learnt {
        Learnt::NoRoom => {
            count(Counter::Dropped);
            stat::<F>(rev_nat_id, Event::dropped(DropReason::ConntrackFull));
            return SHOT;
        }
        Learnt::New => {
            count(Counter::CtNew);
            stat::<F>(rev_nat_id, Event::flow::<F::Entry>(ctx.len()));
            monitor::packet(ctx, &f.pkt.tuple, &f.pkt.tuple, What::Translated(rev_nat_id));
        }
        Learnt::Known => {}
    }
    F::step(
        #[inline(always)]
        || send::<F>(ctx, &f.pkt.tuple),
    )
}
