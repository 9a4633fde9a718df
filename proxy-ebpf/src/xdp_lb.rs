//! Per-packet load balancing at the driver hook (XDP, `--bpf-lb-acceleration`)
//! of node interfaces, from tc's maps and with tc's decisions: a packet of
//! a tracked flow is rewritten from its conntrack entry, a new flow to a
//! frontend gets its backend, SNAT and conntrack entries here. One that
//! leaves by a node interface carrying this program (`XDP_EGRESS`, the one
//! it came in by included) and whose next hop the FIB knows is sent on at
//! once (`XDP_TX`, a redirect), before the kernel builds an skb for it;
//! the others go up translated, with a [`handoff`] telling tc ingress what
//! is left (the route, the TTL, a redirect to a pod, the stack for a
//! host-network backend), so nothing is decided or counted twice.
//!
//! IPv4 here, IPv6 in `xdp_ingress6` (a tail call: its packet in `FLOW6`,
//! off the stack, and each step a BPF call of its own, as on tc).
//!
//! Left to tc untouched (passed before anything is written): fragments,
//! IPv4 options and IPv6 extension headers, ICMP, SCTP, new IPv6 flows to
//! a DSR frontend (the decision would not fit the handoff); handed to tc
//! once decided: a new IPv4 flow that leaves by direct server return (tc
//! inserts the option), a tracked DSR flow's packet that carries or
//! clamps the option, a refusal (tc sends the RST or ICMP error). Where
//! the driver keeps no metadata, only what XDP sends on itself is XDP's.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibLookup, xdp_action},
    helpers::bpf_ktime_get_ns,
    programs::XdpContext,
};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use proxy_common::{Config, Counter, CtTuple, CtValue, IPPROTO_SCTP, dsr};

use crate::{
    conntrack,
    family::Family,
    frame::Frame,
    handoff::{self, Handed, Reserved},
    lb,
    log::Printable,
    maps::{CONFIG, XDP_EGRESS, XDP6, count},
    monitor::EventAddr,
    packet::{self, Flow, Packet, Parsed, TCP_AND_UDP},
    prefilter::{self, Filter, Hook},
    report::{self, Denied},
    run::Run,
    stats::Event,
    tc_lb::{Decision, Ingress, decide, flow6, make, route, stat},
};

const PASS: u32 = xdp_action::XDP_PASS;
const DROP: u32 = xdp_action::XDP_DROP;
const TX: u32 = xdp_action::XDP_TX;

#[inline(always)]
pub fn try_ingress(ctx: &XdpContext) -> u32 {
    let Some(cfg) = CONFIG.get(0) else { return PASS };
    if prefilter::check(ctx, cfg, Hook::Ingress) == Filter::Pass {
        return PASS;
    }
    let pkt = match packet::parse(ctx) {
        Some(Parsed::Packet(pkt)) if ours(&pkt) => pkt,
        None if packet::is_ipv6(ctx) => {
            // SAFETY: returns only if the slot is empty (no IPv6 program).
            unsafe { XDP6.tail_call(ctx, 0) };
            return PASS;
        }
        _ => return PASS,
    };
    let mut f = Flow { pkt, to: pkt.tuple, now: unsafe { bpf_ktime_get_ns() } };
    translate::<Ipv4Hdr>(ctx, cfg, &mut f)
}

/// `xdp_ingress6`: an IPv6 packet the IPv4 program handed on (its
/// pre-filter passed it), TCP or UDP right after the fixed header.
#[inline(always)]
pub fn try_ingress6(ctx: &XdpContext) -> u32 {
    let Some(cfg) = CONFIG.get(0) else { return PASS };
    let Some(f) = flow6() else { return PASS };
    if !packet::parse6(ctx, &mut f.pkt) || !ours(&f.pkt) {
        return PASS;
    }
    f.to = f.pkt.tuple;
    f.now = unsafe { bpf_ktime_get_ns() };
    translate::<Ipv6Hdr>(ctx, cfg, f)
}

/// Whether the packet is one XDP may translate: TCP or UDP, an IP header
/// without options (IPv6: without extension headers), not a fragment.
#[inline(always)]
fn ours<T: CtTuple>(pkt: &Packet<T>) -> bool {
    pkt.plain_ip_header && pkt.first_fragment.is_none() && pkt.tuple.proto() != IPPROTO_SCTP
}

/// A packet XDP may translate: of a tracked flow, or of none.
#[inline(always)]
fn translate<F: Family>(ctx: &XdpContext, cfg: &Config, f: &mut Flow<F::Tuple>) -> u32
where
    F::Tuple: Printable + Handed,
    F::Addr: EventAddr,
{
    // Before any decision: the verifier forgets the frame's bounds with it.
    let handoff = handoff::reserve(ctx);
    match (tracked::<F>(ctx, cfg, f, handoff), handoff) {
        (Some(verdict), _) => verdict,
        (None, Some(handoff)) => new_flow::<F>(ctx, cfg, f, handoff),
        (None, None) if Run::of(ctx) == Run::Explain => explained_new_flow::<F>(ctx, cfg, f),
        (None, None) => PASS,
    }
}

/// A packet of a tracked flow: its verdict; `None` for a packet of no flow.
/// Counted and its flow refreshed here, as on tc; one that carries or
/// clamps a DSR option is handed to tc for that (`Kind::Tracked`).
#[inline(always)]
fn tracked<F: Family>(
    ctx: &XdpContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    handoff: Option<Reserved>,
) -> Option<u32> {
    let Some(handoff) = handoff else { return tracked_unhanded::<F>(ctx, cfg, f) };
    // The entry stays in the step (IPv6's fill a frame): what it says is
    // written into `f.to`, its flags returned.
    let flags = F::step(
        #[inline(always)]
        || {
            let entry = conntrack::lookup::<F>(&f.pkt, Frame::len(ctx), cfg, f.now, || Run::Real)?;
            counted::<F>(ctx, &entry);
            f.to = entry.rewritten(f.pkt.tuple.proto());
            Some(entry.flags())
        },
    )?;
    if dsr::action(flags, f.pkt.tcp_flags) != 0 {
        handoff::tracked(ctx, handoff);
        return Some(PASS);
    }
    Some(sent::<F>(ctx, f, handoff))
}

/// [`send_on`] by XDP where it can, else handed to tc: the FIB lookup and
/// the rewrite each a step (their frames one after the other, not added).
#[inline(always)]
fn sent<F: Family>(ctx: &XdpContext, f: &Flow<F::Tuple>, handoff: Reserved) -> u32 {
    let to = &f.to;
    let way = F::step(|| Way::xdp::<F>(ctx, to)).unwrap_or(Way::Tc(handoff));
    F::step(|| send_on::<F>(ctx, f, way))
}

/// [`tracked`] where the driver keeps no metadata (or an explain run's
/// frame holds it): only a packet XDP sends on itself is XDP's, the others
/// reach tc untouched (asked first as an explain run asks, nothing
/// written, so that tc counts them once).
#[inline(always)]
fn tracked_unhanded<F: Family>(
    ctx: &XdpContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
) -> Option<u32> {
    let flags = F::step(
        #[inline(always)]
        || {
            let entry =
                conntrack::lookup::<F>(&f.pkt, Frame::len(ctx), cfg, f.now, || Run::Explain)?;
            f.to = entry.rewritten(f.pkt.tuple.proto());
            Some(entry.flags())
        },
    )?;
    let to = &f.to;
    let way = match F::step(|| Way::xdp::<F>(ctx, to)) {
        Some(way) if dsr::action(flags, f.pkt.tcp_flags) == 0 => way,
        _ => return Some(PASS),
    };
    let unchanged = F::step(
        #[inline(always)]
        || match conntrack::lookup::<F>(&f.pkt, Frame::len(ctx), cfg, f.now, || Run::of(ctx)) {
            Some(entry) if entry.rewritten(f.pkt.tuple.proto()) == f.to => {
                counted::<F>(ctx, &entry);
                true
            }
            _ => false,
        },
    );
    // Changed since: tc decides.
    if !unchanged {
        return Some(PASS);
    }
    Some(F::step(|| send_on::<F>(ctx, f, way)))
}

/// Counts a tracked packet as tc does: `ct_hit`, and its frontend's
/// packets where the conntrack layout does not count them in the entry.
#[inline(always)]
fn counted<F: Family>(ctx: &XdpContext, entry: &F::Entry) {
    count(Counter::CtHit);
    if !F::Entry::COUNTS {
        stat::<F>(entry.rev_nat_id(), Event::packet(Frame::len(ctx)));
    }
}

/// A packet of no flow: its frontend's decision, the flow made and sent on
/// here where XDP can, else handed to tc.
#[inline(always)]
fn new_flow<F: Family>(
    ctx: &XdpContext,
    cfg: &Config,
    f: &mut Flow<F::Tuple>,
    handoff: Reserved,
) -> u32
where
    F::Tuple: Printable + Handed,
    F::Addr: EventAddr,
{
    if !F::Tuple::HANDS_DECIDED && dsr_frontend::<F>(&f.pkt) {
        return PASS;
    }
    let decision = F::step(
        #[inline(always)]
        || decide::<F, TCP_AND_UDP>(ctx, cfg, f),
    );
    match decision {
        Decision::Pass => PASS,
        Decision::Drop(outcome, rev_nat_id) => {
            let site = Ingress::<F, _> { ctx, tuple: &f.pkt.tuple };
            report::denied(&site, cfg, rev_nat_id, Denied::Dropped(outcome));
            DROP
        }
        Decision::Refuse(rev_nat_id) => {
            handoff::refused(ctx, handoff, rev_nat_id);
            PASS
        }
        // The option goes in at tc.
        Decision::Translate(decided) if decided.dsr => {
            f.to.hand_decided(ctx, handoff, decided);
            PASS
        }
        Decision::Translate(decided) => {
            // Its entries' step is its own (as on tc).
            if !make::<F>(ctx, cfg, f, decided) {
                return DROP;
            }
            sent::<F>(ctx, f, handoff)
        }
    }
}

/// Whether the packet addresses a DSR frontend (IPv6's decision of one
/// does not fit the handoff: tc decides it).
#[inline(always)]
fn dsr_frontend<F: Family>(pkt: &Packet<F::Tuple>) -> bool {
    let t = &pkt.tuple;
    let key = F::service_key(t.daddr(), t.dport(), t.proto());
    lb::lookup_frontend(&key).is_some_and(|svc| svc.flags.is_dsr())
}

/// An explain run's packet of no flow (`explain`; its notes in the frame's
/// metadata, no handoff room beside them): decided, nothing made, and
/// sent on from here as a real one would be, or passed up to tc, whose
/// explain run says the rest.
#[inline(always)]
fn explained_new_flow<F: Family>(ctx: &XdpContext, cfg: &Config, f: &mut Flow<F::Tuple>) -> u32 {
    let decision = F::step(
        #[inline(always)]
        || decide::<F, TCP_AND_UDP>(ctx, cfg, f),
    );
    match decision {
        Decision::Drop(..) => DROP,
        Decision::Translate(decided) if !decided.dsr => {
            let to = &f.to;
            let way = F::step(|| Way::xdp::<F>(ctx, to));
            way.map_or(PASS, |way| F::step(|| send_on::<F>(ctx, f, way)))
        }
        _ => PASS,
    }
}

/// How a translated packet leaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// From here, by this XDP interface (`XDP_TX`) or another (a redirect
    /// through `XDP_EGRESS`), to the FIB's next hop.
    Xdp { egress: u32, macs: [[u8; 6]; 2] },
    /// Up, translated, tc sending it on (`handoff`).
    Tc(Reserved),
}

impl Way {
    /// From here, if the FIB's next hop for `to` is known and behind an
    /// XDP interface, and the TTL allows.
    #[inline(always)]
    fn xdp<F: Family>(ctx: &XdpContext, to: &F::Tuple) -> Option<Way> {
        // SAFETY: bpf_fib_lookup is plain data; zero is a valid start.
        let mut fib: FibLookup = unsafe { core::mem::zeroed() };
        let rc = route::<F>(ctx, to, &mut fib);
        let (ingress, egress) = (Frame::ifindex(ctx), fib.ifindex);
        let xdp_out = egress == ingress || XDP_EGRESS.get(egress).is_some();
        let ours = rc == Some(BPF_FIB_LKUP_RET_SUCCESS) && xdp_out && hops_left::<F>(ctx);
        ours.then_some(Way::Xdp { egress, macs: [fib.dmac, fib.smac] })
    }
}

/// Rewrites the packet to `f.to` and sends it `way` (in a step of the
/// caller's: IPv6's rewrite fills a frame).
#[inline(always)]
fn send_on<F: Family>(ctx: &XdpContext, f: &Flow<F::Tuple>, way: Way) -> u32 {
    let hop = matches!(way, Way::Xdp { .. });
    if packet::rewrite::<F, TCP_AND_UDP>(ctx, &f.pkt, &f.to, hop).is_err() {
        count(Counter::Dropped);
        return DROP;
    }
    match way {
        Way::Xdp { egress, macs } => {
            if packet::set_macs(ctx, &macs).is_err() {
                count(Counter::Dropped);
                return DROP;
            }
            if Run::of(ctx) == Run::Real {
                count(Counter::XdpForwarded);
            }
            if egress == Frame::ifindex(ctx) {
                return TX;
            }
            XDP_EGRESS.redirect(egress, 0).unwrap_or_else(|action| action)
        }
        Way::Tc(handoff) => {
            handoff::translated(ctx, handoff);
            PASS
        }
    }
}

/// Whether the TTL (hop limit) lets the packet be forwarded from here
/// (tc's send, or the stack, answers the others).
#[inline(always)]
fn hops_left<F: Family>(ctx: &XdpContext) -> bool {
    ctx.load::<u8>(packet::IP_OFF + F::HOPS).is_ok_and(|ttl| ttl > 1)
}
