//! A new flow's second half: its conntrack entries, counters, records,
//! rewrite and send. IPv4's TCP and UDP reach it by a tail call into
//! `tc_new_flow` (the verifier walks the sending once, not once per way a
//! decision comes out of `tc_ingress`); the IPv6 and SCTP paths call
//! [`complete`] inline.

use aya_ebpf::{macros::map, maps::PerCpuArray, programs::TcContext};
use network_types::ip::Ipv4Hdr;
use proxy_common::{Config, Counter, CtKey, TC_NEW_FLOW, dsr, log_level, record::Outcome};

use super::{Ingress, Translation, forward::forward, forward_counted, stat};
use crate::{
    conntrack,
    family::Family,
    frame::Frame,
    log::{self, Printable},
    maps::{CONFIG, TC_NEW, count},
    monitor::{self, EventAddr, What},
    packet::{Flow, TCP_AND_UDP},
    report::{self, Denied},
    run::Run,
    stats::Event,
    tc_act::SHOT,
};

/// A new flow's packet and its decision, handed from `tc_ingress` to
/// `tc_new_flow` (`NEW_FLOW`).
#[derive(Clone, Copy)]
struct NewFlow {
    flow: Flow<CtKey>,
    decided: Translation,
}

/// A new IPv4 flow's packet and decision, handed from `tc_ingress` to
/// `tc_new_flow`, one per CPU. No BTF: scratch space, never read from
/// outside.
#[map]
static NEW_FLOW: PerCpuArray<NewFlow> = PerCpuArray::with_max_entries(1, 0);

/// A new IPv4 TCP or UDP flow goes on in `tc_new_flow` (see
/// `proxy_common::TC_NEW_PROGRAMS`), its packet and decision in this CPU's
/// `NEW_FLOW`.
#[inline(always)]
pub(super) fn to_new_flow(ctx: &TcContext, flow: &Flow<CtKey>, decided: Translation) -> i32 {
    let Some(slot) = NEW_FLOW.get_ptr_mut(0) else { return SHOT };
    // SAFETY: this CPU's slot; nothing else runs on it before the program
    // the tail call enters reads it.
    let slot = unsafe { &mut *slot };
    flow.copy_to(&mut slot.flow);
    slot.decided = decided;
    // SAFETY: returns only if the slot is empty.
    unsafe { TC_NEW.tail_call(ctx, TC_NEW_FLOW) };
    // The agent fills the slot before attaching `tc_ingress`: never here.
    count(Counter::Dropped);
    SHOT
}

/// `tc_new_flow`: the flow [`to_new_flow`] handed on is made and its
/// packet sent.
#[inline(always)]
pub fn try_new_flow(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return SHOT };
    let Some(slot) = NEW_FLOW.get_ptr_mut(0) else { return SHOT };
    // SAFETY: this CPU's slot, written by `tc_ingress` just before.
    let new = unsafe { &mut *slot };
    complete::<Ipv4Hdr, TCP_AND_UDP>(ctx, cfg, &mut new.flow, new.decided)
}

/// A new flow [`translate`] decided: made ([`make`]) and its packet sent
/// on. An explain run's packet only goes on as translated.
#[inline(always)]
pub(super) fn complete<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    decided: Translation,
) -> i32
where
    F::Tuple: Printable,
    F::Addr: EventAddr,
{
    const _: () = assert!(dsr::INSERT == 1);
    if !SCTP {
        F::pend_dsr(decided.dsr as u8, &f.pkt.tuple);
    }
    if Run::of(ctx) == Run::Explain {
        // Decided (see `decide`): the packet goes on as translated, but no
        // flow is created (so no SNAT port is chosen).
        return F::step(
            #[inline(always)]
            || forward::<F, SCTP>(ctx, &f.pkt, &f.to),
        );
    }
    if !make::<F>(ctx, cfg, f, decided) {
        return SHOT;
    }
    forward_counted::<F, SCTP>(ctx, f, decided.rev_nat_id)
}

/// A new flow's conntrack entries made (SNAT's port found and written into
/// `f.to`), counted and recorded, on tc's ingress or XDP's; false, its
/// denial reported, where there was no room or no port.
#[inline(always)]
pub(crate) fn make<F: Family>(
    ctx: &impl Frame,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    decided: Translation,
) -> bool
where
    F::Tuple: Printable,
    F::Addr: EventAddr,
{
    let Translation { rev_nat_id, snat, dsr, via, flags } = decided;
    let created = F::step(
        #[inline(always)]
        || {
            let (orig, len) = (&f.pkt.tuple, ctx.len());
            conntrack::create::<F>(orig, &mut f.to, rev_nat_id, (snat, dsr), len, cfg, f.now)
        },
    );
    if !created {
        let outcome = if snat { Outcome::NoSnatPort } else { Outcome::ConntrackFull };
        let site = Ingress::<F, _> { ctx, tuple: &f.pkt.tuple };
        report::denied(&site, cfg, rev_nat_id, Denied::Dropped(outcome));
        return false;
    }
    count(Counter::CtNew);
    stat::<F>(rev_nat_id, Event::flow::<F::Entry>(ctx.len()));
    monitor::packet(ctx, &f.pkt.tuple, &f.to, What::Translated(rev_nat_id));
    if cfg.log_level >= log_level::DEBUG {
        log::new_flow(&f.pkt.tuple, &f.to, via, flags);
        if snat {
            log::snat(&f.pkt.tuple, &f.to);
        }
    }
    true
}
