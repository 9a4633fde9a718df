//! Per-packet load balancing in tc ingress: for traffic no socket hook sees
//! (NodePort, externalIPs, LoadBalancer IPs, ClusterIP traffic the node
//! forwards). A tracked flow is rewritten from its conntrack entry; a new
//! flow to a frontend gets a backend, SNAT where kube-proxy would
//! masquerade, and two conntrack entries. Translated packets are sent on with
//! a FIB lookup and a redirect, so they bypass the stack (and its netfilter
//! conntrack, which never saw the translated tuples).

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibLookup,
        bpf_redir_neigh,
    },
    helpers::{
        bpf_ktime_get_ns,
        generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    },
    programs::TcContext,
};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use proxy_common::{
    Config, Counter, CtKey, CtKey6, CtTuple, CtValue, DropReason, FragKey, IPPROTO_SCTP,
    ServiceFlags, ServiceValue, TC_NEW_FLOW, TC_SCTP_EGRESS, TC_SCTP_EGRESS6, TC_SCTP_INGRESS,
    TC_SCTP_INGRESS6, TC6_EGRESS, TC6_INGRESS, TC6_POD_REPLIES, dsr, explain::Decided, log_level,
};

use crate::{
    conntrack::{self, Learnt},
    family::Family,
    icmp::{self, IcmpError},
    lb::{self, Pick, Verdict, Via},
    log::{self, Outcome, Printable},
    maps::{CONFIG, FLOW6, FRAGMENTS, NEW_FLOW, TC_NEW, TC_SCTP, TC6, count},
    monitor::{self, EventAddr, What},
    packet::{self, Flow, Packet, Parsed, SCTP_ALONE, TCP_AND_UDP},
    prefilter::{self, Filter, Hook},
    reject,
    report::{self, Denied, Site},
    run::Run,
    stats::{self, Event},
    tc_act::{NEXT, SHOT, STACK},
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

/// A new flow's packet and its decision, handed from `tc_ingress` to
/// `tc_new_flow` (`NEW_FLOW`).
#[derive(Clone, Copy)]
pub struct NewFlow {
    flow: Flow<CtKey>,
    decided: Translation,
}

/// A new IPv4 TCP or UDP flow goes on in `tc_new_flow` (see
/// `proxy_common::TC_NEW_PROGRAMS`), its packet and decision in this CPU's
/// `NEW_FLOW`.
#[inline(always)]
fn to_new_flow(ctx: &TcContext, flow: &Flow<CtKey>, decided: Translation) -> i32 {
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
fn flow6() -> Option<&'static mut Flow<CtKey6>> {
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

/// A new flow's decision (see [`decide`]); its translated tuple is in
/// `Flow::to`.
#[derive(Clone, Copy)]
struct Translation {
    rev_nat_id: u32,
    snat: bool,
    dsr: bool,
    via: Via,
    flags: ServiceFlags,
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
                let site = Ingress::<F> { ctx, tuple: &f.pkt.tuple };
                report::denied(&site, cfg, rev_nat_id, Denied::Dropped(outcome));
            }
            SHOT
        }
        Decision::Refuse(rev_nat_id) => {
            if Run::of(ctx) == Run::Real {
                let site = Ingress::<F> { ctx, tuple: &f.pkt.tuple };
                report::denied(&site, cfg, rev_nat_id, Denied::Refused);
            }
            reject::refuse::<F>(ctx, &f.pkt)
        }
        Decision::Translate(decided) => return Step::NewFlow(decided),
    })
}

/// A new flow [`translate`] decided: its conntrack entries made (SNAT's
/// port found), counted and recorded, and its packet sent on. An explain
/// run's packet only goes on as translated.
#[inline(always)]
fn complete<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    decided: Translation,
) -> i32
where
    F::Tuple: Printable,
    F::Addr: EventAddr,
{
    let Translation { rev_nat_id, snat, dsr, via, flags } = decided;
    const _: () = assert!(dsr::INSERT == 1);
    if !SCTP {
        F::pend_dsr(dsr as u8, &f.pkt.tuple);
    }
    if Run::of(ctx) == Run::Explain {
        // Decided (see `decide`): the packet goes on as translated, but no
        // flow is created (so no SNAT port is chosen).
        return F::step(
            #[inline(always)]
            || forward::<F, SCTP>(ctx, &f.pkt, &f.to),
        );
    }
    let created = F::step(
        #[inline(always)]
        || {
            let (orig, len) = (&f.pkt.tuple, ctx.len());
            conntrack::create::<F>(orig, &mut f.to, rev_nat_id, (snat, dsr), len, cfg, f.now)
        },
    );
    if !created {
        let outcome = if snat { Outcome::NoSnatPort } else { Outcome::ConntrackFull };
        let site = Ingress::<F> { ctx, tuple: &f.pkt.tuple };
        report::denied(&site, cfg, rev_nat_id, Denied::Dropped(outcome));
        return SHOT;
    }
    count(Counter::CtNew);
    stat::<F>(rev_nat_id, Event::flow::<F::Entry>(ctx.len()));
    monitor::tc(ctx, &f.pkt.tuple, &f.to, What::Translated(rev_nat_id));
    if cfg.log_level >= log_level::DEBUG {
        log::new_flow(&f.pkt.tuple, &f.to, via, flags);
        if snat {
            log::snat(&f.pkt.tuple, &f.to);
        }
    }
    forward_counted::<F, SCTP>(ctx, f, rev_nat_id)
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
fn stat<F: Family>(rev_nat_id: u32, event: Event) {
    F::step(
        #[inline(always)]
        || stats::count(rev_nat_id, event),
    )
}

/// A packet of no flow on tc ingress, as `report` tells of its denial.
struct Ingress<'a, F: Family> {
    ctx: &'a TcContext,
    tuple: &'a F::Tuple,
}

impl<F: Family> Site for Ingress<'_, F>
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
        monitor::tc(self.ctx, self.tuple, self.tuple, what);
    }
}

/// Whether the pre-filter passes the packet on untouched. At `trace`, where
/// every packet of no flow is recorded, every packet takes the full path.
#[inline(always)]
fn filtered(ctx: &TcContext, cfg: &Config, hook: Hook) -> bool {
    cfg.log_level < log_level::TRACE && prefilter::check(ctx, cfg, hook) == Filter::Pass
}

/// What a packet of no flow gets. (Its tag first, where BTF can describe
/// it: a niche inside a field is not.)
#[repr(u8)]
enum Decision {
    /// It is to no frontend: passed on.
    Pass,
    /// Dropped, for this reason, at this frontend (reverse-NAT id).
    Drop(Outcome, u32),
    /// To this frontend without endpoints: refused.
    Refuse(u32),
    /// A new flow, translated to the tuple [`decide`] wrote (its SNAT port
    /// yet to be found).
    Translate(Translation),
}

/// Whether a packet of no flow starts one: its frontend, a backend, SNAT
/// where kube-proxy would masquerade (the translated tuple in `flow.to`);
/// or its drop or refusal. The caller counts and records: a record's frame
/// would add to this step's. An explain run's packet notes the decision
/// (`explain`).
#[inline(always)]
fn decide<F: Family, const SCTP: bool>(
    ctx: &TcContext,
    cfg: &Config,
    flow: &mut Flow<F::Tuple>,
) -> Decision {
    let pkt = &flow.pkt;
    let t = &pkt.tuple;
    // Localhost NodePorts are the node's own sockets' (the socket LB's): a
    // packet to 127.0.0.0/8 from an interface is martian, left to the stack
    // that drops it (kube-proxy guards them likewise, CVE-2020-8558).
    if F::is_localhost(t.daddr()) {
        return Decision::Pass;
    }
    let mut key = F::service_key(t.daddr(), t.dport(), t.proto());
    let Some(svc) = lb::lookup_frontend(&key) else { return Decision::Pass };
    let run = Run::of(ctx);
    run.frontend(ctx, svc.rev_nat_id);
    if svc.flags.has_source_ranges() && !F::source_allowed(svc.rev_nat_id, t.saddr()) {
        run.refused(ctx, Decided::SourceOutsideRanges);
        return Decision::Drop(Outcome::SourceOutsideRanges, svc.rev_nat_id);
    }
    let mut scoped = svc;
    if from_pods::<F>(cfg, t.saddr()) {
        (key, scoped) = lb::in_cluster_scope(&key, &svc);
    }
    let pick = Pick::Hashed { hash: || F::flow_hash(t), table_size: cfg.maglev_table_size };
    match lb::choose_in(&key, &scoped, F::client(t.saddr()), run, pick) {
        Verdict::NoBackend if scoped.flags.drops_when_empty() => {
            run.refused(ctx, Decided::NoLocalEndpoint);
            Decision::Drop(Outcome::NoLocalEndpoint, scoped.rev_nat_id)
        }
        Verdict::NoBackend => {
            run.refused(ctx, Decided::Refused);
            Decision::Refuse(scoped.rev_nat_id)
        }
        Verdict::Backend { backend, backend_id, rev_nat_id, via } => {
            let (snat, dsr) = dispatch::<F, SCTP>(&svc, cfg, pkt, &backend);
            run.translated(ctx, backend_id, (snat, dsr), via, scoped.flags);
            let (address, port, _) = F::backend(&backend);
            let saddr = if snat { F::snat_addr(cfg) } else { t.saddr() };
            let to = F::Tuple::new(saddr, *address, t.sport(), port, t.proto());
            flow.to = to;
            Decision::Translate(Translation { rev_nat_id, snat, dsr, via, flags: scoped.flags })
        }
    }
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

/// Whether a source is in-cluster as kube-proxy's local detector sees it:
/// in `--cluster-cidr` (none set, none is). The node's own traffic to its
/// addresses never passes tc ingress (only the socket hooks see it), and
/// another node's address is external to kube-proxy too.
#[inline(always)]
fn from_pods<F: Family>(cfg: &Config, saddr: F::Addr) -> bool {
    F::in_cluster_cidr(cfg, saddr) == Some(true)
}

/// How a new flow leaves, `(snat, dsr)`: kube-proxy's masquerade
/// decisions (external traffic with policy Cluster, a pod reaching itself
/// (hairpin), ClusterIP traffic from outside the cluster CIDR or all of it
/// with `--masquerade-all`), except that external traffic from outside the
/// cluster to a DSR frontend goes by direct server return to a backend on
/// another node (an unfragmented packet with a plain header, where the
/// option can go; a backend here needs no option, its replies pass this
/// node). `svc` is the frontend the client
/// addressed, whichever scope serves it: pods reaching a Local external
/// address are not masqueraded (kube-proxy's short-circuit skips the
/// ClusterIP's masquerade rule, which matches the ClusterIP). Two values
/// rather than one of three: `dsr` is only ever stored, never tested, up
/// to where the option goes in, so that the verifier walks the paths with
/// and without it as one (a value it must tell apart doubles every path
/// after it, past what 6.1 accepts). SCTP never goes direct (the model
/// gives its frontends SNAT): the SCTP programs carry no DSR path at all.
#[inline(always)]
fn dispatch<F: Family, const SCTP: bool>(
    svc: &ServiceValue,
    cfg: &Config,
    pkt: &Packet<F::Tuple>,
    backend: &F::Backend,
) -> (bool, bool) {
    let (address, _, flags) = F::backend(backend);
    let saddr = pkt.tuple.saddr();
    // A host-network backend answers from this node anyway, and a packet
    // from a node address to a node address would be a martian.
    if flags.is_host() {
        return (false, false);
    }
    if *address == saddr {
        return (true, false);
    }
    if svc.flags.is_external() {
        if svc.flags.is_local_only() {
            return (false, false);
        }
        let dsr = !SCTP
            && svc.flags.is_dsr()
            && pkt.plain_ip_header
            && pkt.first_fragment.is_none()
            && !from_pods::<F>(cfg, saddr);
        // A backend here: its replies pass this node, no option needed.
        return (!dsr, dsr && !flags.is_local());
    }
    let snat = cfg.masquerade_all != 0 || F::in_cluster_cidr(cfg, saddr) == Some(false);
    (snat, false)
}

/// Whether a packet of no flow was sent here by direct server return: if
/// so, `flow.to` is its tuple with the service its option names as the
/// destination. (Written in place: the IPv6 path's frame has no room for
/// the service.)
#[inline(always)]
fn dsr_service<F: Family>(ctx: &TcContext, flow: &mut Flow<F::Tuple>) -> bool {
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
fn dsr_arrival<F: Family>(ctx: &TcContext, cfg: &Config, f: &Flow<F::Tuple>) -> i32
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
            monitor::tc(ctx, &f.pkt.tuple, &f.pkt.tuple, What::Translated(rev_nat_id));
        }
        Learnt::Known => {}
    }
    F::step(
        #[inline(always)]
        || send::<F>(ctx, &f.pkt.tuple),
    )
}

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

/// An ICMP error quoting a packet of a translated flow is translated back
/// for the packet's sender (`icmp`). On ingress it is then sent on like a
/// translated packet. On egress (errors the node's stack sends, e.g. about
/// a packet for a host-network backend) the stack routed it already: it is
/// translated only where its destination stays.
#[inline(always)]
fn icmp_error<F: Family>(ctx: &TcContext, err: Option<&IcmpError<F::Tuple>>, ingress: bool) -> i32 {
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
fn icmp_error6(ctx: &TcContext, ingress: bool) -> i32 {
    let mut err = IcmpError::default();
    let parsed = Ipv6Hdr::step(
        #[inline(always)]
        || icmp::parse6(ctx, &mut err).is_some(),
    );
    icmp_error::<Ipv6Hdr>(ctx, parsed.then_some(&err), ingress)
}

/// A fragment after the first: it follows the first fragment's translation,
/// if that one came through here.
#[inline(always)]
fn later_fragment(ctx: &TcContext, key: &FragKey) -> i32 {
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
fn forward<F: Family, const SCTP: bool>(
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
fn send<F: Family>(ctx: &TcContext, to: &F::Tuple) -> i32 {
    // SAFETY: as in `forward`.
    let mut fib: FibLookup = unsafe { core::mem::zeroed() };
    let Some(rc) = route::<F>(ctx, to, &mut fib) else { return STACK };
    match packet::decrement_ttl::<F>(ctx) {
        Ok(true) => redirect::<F>(ctx, &fib, rc),
        _ => SHOT,
    }
}

/// The FIB lookup of a packet translated to `to`, into `fib`: its result if
/// this program sends the packet on, `None` for local delivery (a
/// host-network backend) or no route, where the stack takes it.
#[inline(always)]
fn route<F: Family>(ctx: &TcContext, to: &F::Tuple, fib: &mut FibLookup) -> Option<u32> {
    fib.family = F::AF;
    fib.l4_protocol = to.proto();
    fib.sport = to.sport().to_be();
    fib.dport = to.dport().to_be();
    fib.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    F::fib_addrs(fib, to);
    let rc = unsafe {
        bpf_fib_lookup(ctx.skb.skb.cast(), fib, core::mem::size_of::<FibLookup>() as i32, 0)
    } as u32;
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
