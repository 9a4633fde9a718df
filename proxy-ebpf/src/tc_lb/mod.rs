//! Per-packet load balancing in tc ingress: for traffic no socket hook sees
//! (NodePort, externalIPs, LoadBalancer IPs, ClusterIP traffic the node
//! forwards). A tracked flow is rewritten from its conntrack entry; a new
//! flow to a frontend gets a backend, SNAT where kube-proxy would
//! masquerade, and two conntrack entries. Translated packets are sent on with
//! a FIB lookup and a redirect, so they bypass the stack (and its netfilter
//! conntrack, which never saw the translated tuples).
//!
//! Here: the entry points, a tracked flow's path and the reporting of
//! denials; [`decide`] chooses for a packet of no flow, [`new_flow`] makes
//! and sends the flow, [`forward`] sends packets on, [`egress`] reverses
//! replies the stack sends, [`icmp_errors`] translates errors back, and
//! [`dsr_arrival`] takes direct-server-return packets on a backend's node.

mod decide;
mod dsr_arrival;
mod egress;
mod forward;
mod icmp_errors;
mod new_flow;

pub(crate) use self::{
    decide::{Decision, decide},
    forward::route,
    new_flow::make,
};
pub use egress::{try_egress, try_egress_sctp, try_egress6, try_egress6_sctp};
pub use new_flow::try_new_flow;

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use proxy_common::{
    Config, Counter, CtKey6, CtTuple, CtValue, DropReason, IPPROTO_SCTP, TC_SCTP_INGRESS,
    TC_SCTP_INGRESS6, TC6_INGRESS, TC6_POD_REPLIES, dsr, log_level, record::Outcome,
};

use crate::{
    conntrack,
    family::Family,
    frame::Frame,
    handoff::{self, Handoff, Kind},
    icmp,
    lb::Translation,
    log::{self, Printable},
    maps::{CONFIG, FLOW6, TC_SCTP, TC6, count},
    monitor::{self, EventAddr, What},
    packet::{self, Flow, Packet, Parsed, SCTP_ALONE, TCP_AND_UDP},
    prefilter::{self, Filter, Hook},
    reject,
    report::{self, Denied, Site},
    run::Run,
    stats::{self, Event},
    tc_act::{NEXT, SHOT},
};

use self::{
    dsr_arrival::{dsr_arrival, dsr_service},
    forward::{forward, later_fragment, send},
    icmp_errors::{icmp_error, icmp_error6},
    new_flow::{complete, to_new_flow},
};

/// What an ingress program translates.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// New flows to frontends and the packets of tracked flows: node
    /// interfaces, and pod-facing ones where some pod's connections escape
    /// the socket LB.
    Everything,
    /// Only the packets of tracked flows (replies of per-packet flows to a
    /// pod backend): pod-facing interfaces where the socket LB translates
    /// every pod's connections, so a pod never sends to a frontend.
    /// (SCTP, which no socket hook sees, is the SCTP program's, which
    /// translates everything.)
    TrackedOnly,
}

#[inline(always)]
pub fn try_ingress(ctx: &TcContext, scope: Scope) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    if let Some(handed) = handoff::take(ctx) {
        return handed_on(ctx, cfg, &handed);
    }
    let hook = match scope {
        Scope::Everything => Hook::Ingress,
        Scope::TrackedOnly => Hook::PodReplies,
    };
    if filtered(ctx, cfg, hook) {
        return NEXT;
    }
    let pkt = match packet::parse(ctx) {
        Some(Parsed::Packet(pkt)) if pkt.tuple.proto == IPPROTO_SCTP => {
            return to_sctp(ctx, TC_SCTP_INGRESS);
        }
        Some(Parsed::Packet(pkt)) => pkt,
        Some(Parsed::Fragment(key)) => return later_fragment(ctx, &key),
        Some(Parsed::Icmp(msg)) => {
            return icmp_error::<Ipv4Hdr>(ctx, icmp::parse(ctx, &msg).as_ref(), true);
        }
        None => {
            let slot = match scope {
                Scope::Everything => TC6_INGRESS,
                Scope::TrackedOnly => TC6_POD_REPLIES,
            };
            return to_ipv6(ctx, slot);
        }
    };
    let mut flow = Flow { to: pkt.tuple, pkt, now: unsafe { bpf_ktime_get_ns() } };
    match translate::<Ipv4Hdr, TCP_AND_UDP>(ctx, cfg, &mut flow, scope) {
        Step::Done(verdict) => verdict,
        Step::NewFlow(decided) => to_new_flow(ctx, &flow, decided),
    }
}

/// A packet the XDP program passed up with a handoff: what it left.
#[inline(always)]
fn handed_on(ctx: &TcContext, cfg: &Config, handed: &Handoff) -> i32 {
    // An IPv6 packet's handoff is the IPv6 program's to read.
    let Some(Parsed::Packet(pkt)) = packet::parse(ctx) else { return to_ipv6(ctx, TC6_INGRESS) };
    match handed.kind() {
        // Translated, and its flow counted.
        Kind::Translated => send::<Ipv4Hdr>(ctx, &pkt.tuple),
        Kind::Decided => {
            let flow = Flow { to: handed.to, pkt, now: unsafe { bpf_ktime_get_ns() } };
            to_new_flow(ctx, &flow, handed.decided)
        }
        Kind::Refused => {
            let site = Ingress::<Ipv4Hdr, _> { ctx, tuple: &pkt.tuple };
            report::denied(&site, cfg, handed.decided.rev_nat_id, Denied::Refused);
            reject::refuse::<Ipv4Hdr>(ctx, &pkt)
        }
        Kind::Tracked => {
            let mut f = Flow { to: pkt.tuple, pkt, now: unsafe { bpf_ktime_get_ns() } };
            tracked_handed::<Ipv4Hdr>(ctx, cfg, &mut f)
        }
        Kind::None => NEXT,
    }
}

/// An IPv6 packet the XDP program passed up with a handoff (its new flows
/// are never handed on decided: XDP leaves DSR frontends' to tc).
#[inline(always)]
fn handed_on6(ctx: &TcContext, cfg: &Config, f: &mut Flow<CtKey6>, handed: &Handoff) -> i32 {
    match handed.kind() {
        Kind::Translated => <Ipv6Hdr as Family>::step(|| send::<Ipv6Hdr>(ctx, &f.pkt.tuple)),
        Kind::Refused => {
            let site = Ingress::<Ipv6Hdr, _> { ctx, tuple: &f.pkt.tuple };
            report::denied(&site, cfg, handed.decided.rev_nat_id, Denied::Refused);
            <Ipv6Hdr as Family>::step(|| reject::refuse::<Ipv6Hdr>(ctx, &f.pkt))
        }
        Kind::Tracked => tracked_handed::<Ipv6Hdr>(ctx, cfg, f),
        Kind::Decided | Kind::None => NEXT,
    }
}

/// A tracked DSR flow's packet XDP counted and handed up: its entry read
/// without a write, the option put in, sent on.
#[inline(always)]
fn tracked_handed<F: Family>(ctx: &TcContext, cfg: &Config, f: &mut Flow<F::Tuple>) -> i32 {
    let (len, now) = (ctx.len(), f.now);
    let entry = F::step(|| conntrack::lookup::<F>(&f.pkt, len, cfg, now, || Run::Explain));
    let Some(entry) = entry else { return NEXT };
    f.to = entry.rewritten(f.pkt.tuple.proto());
    F::pend_dsr(dsr::action(entry.flags(), f.pkt.tcp_flags), &f.pkt.tuple);
    forward_counted::<F, TCP_AND_UDP>(ctx, f, entry.rev_nat_id())
}

/// The SCTP program's ingress (`tc_ingress_sctp`): a packet the TCP/UDP
/// program handed on (its pre-filter passed it), of a tracked association
/// or a new one to a frontend, on any interface (pods' included: no socket
/// hook sees SCTP).
#[inline(always)]
pub fn try_ingress_sctp(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    let Some(Parsed::Packet(pkt)) = packet::parse(ctx) else { return NEXT };
    if pkt.tuple.proto != IPPROTO_SCTP {
        return NEXT;
    }
    let mut flow = Flow { to: pkt.tuple, pkt, now: unsafe { bpf_ktime_get_ns() } };
    translated::<Ipv4Hdr, SCTP_ALONE>(ctx, cfg, &mut flow, Scope::Everything)
}

/// An SCTP packet goes on in the SCTP program at `slot` of `TC_SCTP`;
/// where the agent loaded none (no SCTP frontend yet), it passes untouched.
#[inline(always)]
fn to_sctp(ctx: &TcContext, slot: u32) -> i32 {
    // SAFETY: returns only if the slot is empty.
    unsafe { TC_SCTP.tail_call(ctx, slot) };
    NEXT
}

/// An IPv6 packet goes on in the IPv6 program at `slot` of `TC6` (a tail
/// call: a stack of its own); anything else, or with no such program,
/// passes untouched.
#[inline(always)]
fn to_ipv6(ctx: &TcContext, slot: u32) -> i32 {
    if packet::is_ipv6(ctx) {
        // SAFETY: returns only if the slot is empty.
        unsafe { TC6.tail_call(ctx, slot) };
    }
    NEXT
}

/// The IPv6 programs' ingress (`tc_ingress6`, `tc_pod_replies6`).
#[inline(always)]
pub fn try_ingress6(ctx: &TcContext, scope: Scope) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    let Some(flow) = flow6() else { return NEXT };
    if !packet::parse6(ctx, &mut flow.pkt) {
        return icmp_error6(ctx, true);
    }
    if let Some(handed) = handoff::take(ctx) {
        flow.now = unsafe { bpf_ktime_get_ns() };
        return handed_on6(ctx, cfg, flow, &handed);
    }
    if flow.pkt.tuple.proto == IPPROTO_SCTP {
        return to_sctp(ctx, TC_SCTP_INGRESS6);
    }
    flow.to = flow.pkt.tuple;
    flow.now = unsafe { bpf_ktime_get_ns() };
    translated::<Ipv6Hdr, TCP_AND_UDP>(ctx, cfg, flow, scope)
}

/// The IPv6 SCTP program's ingress (`tc_ingress6_sctp`), as
/// [`try_ingress_sctp`].
#[inline(always)]
pub fn try_ingress6_sctp(ctx: &TcContext) -> i32 {
    let Some(cfg) = CONFIG.get(0) else { return NEXT };
    let Some(flow) = flow6() else { return NEXT };
    if !packet::parse6(ctx, &mut flow.pkt) || flow.pkt.tuple.proto != IPPROTO_SCTP {
        return NEXT;
    }
    flow.to = flow.pkt.tuple;
    flow.now = unsafe { bpf_ktime_get_ns() };
    translated::<Ipv6Hdr, SCTP_ALONE>(ctx, cfg, flow, Scope::Everything)
}

/// This CPU's IPv6 packet and tuples, off the stack (see `FLOW6`).
#[inline(always)]
pub(crate) fn flow6() -> Option<&'static mut Flow<CtKey6>> {
    let flow = FLOW6.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot; a tc program is not preempted by another
    // program using it.
    Some(unsafe { &mut *flow })
}

/// What [`translate`] leaves to its caller.
enum Step {
    /// The packet's verdict.
    Done(i32),
    /// A new flow, decided: made and sent by [`complete`] (in `tc_new_flow`
    /// for IPv4's TCP and UDP).
    NewFlow(Translation),
}

/// [`translate`] with the new flow made and sent here: the IPv6 and SCTP
/// paths.
#[inline(always)]
fn translated<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    scope: Scope,
) -> i32
where
    F::Tuple: Printable,
    F::Addr: EventAddr,
{
    match translate::<F, SCTP>(ctx, cfg, f, scope) {
        Step::Done(verdict) => verdict,
        Step::NewFlow(decided) => complete::<F, SCTP>(ctx, cfg, f, decided),
    }
}

/// A TCP, UDP or SCTP packet: of a tracked flow (sent on), or a new flow to
/// a frontend (decided; dropped or refused here). Each step is a BPF call
/// of its own in the IPv6 path (`Family::step`), one after the other from
/// here, so their frames never add up (the compiler's copies of 16-byte
/// addresses would not fit one frame); they fill or read `flow.to` in
/// place.
#[inline(always)]
fn translate<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    scope: Scope,
) -> Step
where
    F::Tuple: Printable,
    F::Addr: EventAddr,
{
    let mut tracked = None;
    F::step(
        #[inline(always)]
        || {
            if let Some(entry) =
                conntrack::lookup::<F>(&f.pkt, ctx.len(), cfg, f.now, || Run::of(ctx))
            {
                f.to = entry.rewritten(f.pkt.tuple.proto());
                if !SCTP {
                    F::pend_dsr(dsr::action(entry.flags(), f.pkt.tcp_flags), &f.pkt.tuple);
                }
                tracked = Some(entry.rev_nat_id());
            }
        },
    );
    if let Some(rev_nat_id) = tracked {
        count(Counter::CtHit);
        // The entry counted the packet; the lean layout cannot.
        if !F::Entry::COUNTS && Run::of(ctx) == Run::Real {
            stat::<F>(rev_nat_id, Event::packet(ctx.len()));
        }
        return Step::Done(forward_counted::<F, SCTP>(ctx, f, rev_nat_id));
    }
    if scope == Scope::TrackedOnly {
        return Step::Done(NEXT);
    }
    let decision = F::step(
        #[inline(always)]
        || decide::<F, SCTP>(ctx, cfg, f),
    );
    Step::Done(match decision {
        Decision::Pass => {
            // Sent here by direct server return: its backend is a pod here.
            if !SCTP && !f.pkt.plain_ip_header && F::step(|| dsr_service::<F>(ctx, f)) {
                dsr_arrival::<F>(ctx, cfg, f)
            } else {
                record_unknown::<F>(cfg, &f.pkt);
                NEXT
            }
        }
        // An explain run's drop or refusal is noted in its `cb` only: no
        // counter, record or event tells of a packet that never was.
        Decision::Drop(outcome, rev_nat_id) => {
            if Run::of(ctx) == Run::Real {
                let site = Ingress::<F, _> { ctx, tuple: &f.pkt.tuple };
                report::denied(&site, cfg, rev_nat_id, Denied::Dropped(outcome));
            }
            SHOT
        }
        Decision::Refuse(rev_nat_id) => {
            if Run::of(ctx) == Run::Real {
                let site = Ingress::<F, _> { ctx, tuple: &f.pkt.tuple };
                report::denied(&site, cfg, rev_nat_id, Denied::Refused);
            }
            reject::refuse::<F>(ctx, &f.pkt)
        }
        Decision::Translate(decided) => return Step::NewFlow(decided),
    })
}

/// [`forward`] in a step of its own, a packet it cannot send on counted
/// as the frontend's drop.
#[inline(always)]
fn forward_counted<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    f: &Flow<F::Tuple>,
    rev_nat_id: u32,
) -> i32 {
    let verdict = F::step(
        #[inline(always)]
        || forward::<F, SCTP>(ctx, &f.pkt, &f.to),
    );
    if verdict == SHOT {
        stat::<F>(rev_nat_id, Event::dropped(DropReason::RewriteFailed));
    }
    verdict
}

/// Counts a frontend's `event` (`stats`), in a step of its own.
#[inline(always)]
pub(crate) fn stat<F: Family>(rev_nat_id: u32, event: Event) {
    F::step(
        #[inline(always)]
        || stats::count(rev_nat_id, event),
    )
}

/// A packet of no flow on ingress (tc's or XDP's), as `report` tells of
/// its denial.
pub(crate) struct Ingress<'a, F: Family, C: Frame> {
    pub ctx: &'a C,
    pub tuple: &'a F::Tuple,
}

impl<F: Family, C: Frame> Site for Ingress<'_, F, C>
where
    F::Tuple: Printable,
    F::Addr: EventAddr,
{
    const REFUSED: Event = Event::REFUSED;

    #[inline(always)]
    fn stat(&self, rev_nat_id: u32, event: Event) {
        stat::<F>(rev_nat_id, event);
    }

    #[inline(always)]
    fn record(&self, cfg: &Config, outcome: Outcome) {
        record(cfg, log_level::INFO, true, self.tuple, outcome);
    }

    #[inline(always)]
    fn event(&self, what: What) {
        monitor::packet(self.ctx, self.tuple, self.tuple, what);
    }
}

/// Whether the pre-filter passes the packet on untouched. At `trace`, where
/// every packet of no flow is recorded, every packet takes the full path.
#[inline(always)]
fn filtered(ctx: &TcContext, cfg: &Config, hook: Hook) -> bool {
    cfg.log_level < log_level::TRACE && prefilter::check(ctx, cfg, hook) == Filter::Pass
}

/// Records a packet of no flow to no service: a reply to a SNAT port
/// whose flow is gone (expired, evicted) at debug, anything else at trace.
#[inline(always)]
fn record_unknown<F: Family>(cfg: &Config, pkt: &Packet<F::Tuple>)
where
    F::Tuple: Printable,
{
    if cfg.log_level < log_level::DEBUG {
        return;
    }
    let t = &pkt.tuple;
    if t.daddr() == F::snat_addr(cfg)
        && (cfg.snat_port_min..=cfg.snat_port_max).contains(&t.dport())
    {
        record(cfg, log_level::DEBUG, true, t, Outcome::ReplyWithoutFlow);
    } else {
        record(cfg, log_level::TRACE, true, t, Outcome::NoService);
    }
}

/// A decision record about the packet `t`, if the configured level takes it.
#[inline(always)]
fn record<T: Printable>(cfg: &Config, level: u8, ingress: bool, t: &T, outcome: Outcome) {
    if cfg.log_level >= level {
        log::packet(level, ingress, t, outcome);
    }
}
