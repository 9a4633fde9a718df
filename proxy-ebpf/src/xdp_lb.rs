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
//! Left to tc untouched (passed before anything is written): fragments,
//! IPv4 options, ICMP, IPv6, SCTP, a tracked DSR flow's packets that carry
//! or clamp its option; handed to tc once decided: a new flow that leaves
//! by direct server return (tc inserts the option), a refusal (tc sends
//! the RST or ICMP error). Where the driver keeps no metadata, only what
//! XDP sends on itself is XDP's.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibLookup, xdp_action},
    helpers::bpf_ktime_get_ns,
    programs::XdpContext,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{Config, Counter, CtKey, CtValue, IPPROTO_SCTP, dsr};

use crate::{
    conntrack,
    family::Family,
    frame::Frame,
    handoff::{self, Handoff},
    maps::{CONFIG, XDP_EGRESS, count},
    packet::{self, Flow, Packet, Parsed, TCP_AND_UDP},
    prefilter::{self, Filter, Hook},
    report::{self, Denied},
    run::Run,
    stats::Event,
    tc_lb::{Decision, Ingress, decide, make, route, stat},
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
        _ => return PASS,
    };
    // Before any decision: the verifier forgets the frame's bounds with it.
    let handoff = handoff::reserve(ctx);
    let mut f = Flow { pkt, to: pkt.tuple, now: unsafe { bpf_ktime_get_ns() } };
    match (tracked(ctx, cfg, &mut f, handoff), handoff) {
        (Some(verdict), _) => verdict,
        (None, Some(handoff)) => new_flow(ctx, cfg, &mut f, handoff),
        (None, None) if Run::of(ctx) == Run::Explain => explained_new_flow(ctx, cfg, &mut f),
        (None, None) => PASS,
    }
}

/// Whether the packet is one XDP may translate: TCP or UDP, an IPv4 header
/// without options, not a fragment.
#[inline(always)]
fn ours(pkt: &Packet) -> bool {
    pkt.plain_ip_header && pkt.first_fragment.is_none() && pkt.tuple.proto != IPPROTO_SCTP
}

/// A packet of a tracked flow: its verdict; `None` for a packet of no flow.
/// Counted and its flow refreshed here, as on tc; one that carries or
/// clamps a DSR option is handed to tc for that (`Kind::Tracked`).
#[inline(always)]
fn tracked(
    ctx: &XdpContext,
    cfg: &Config,
    f: &mut Flow<CtKey>,
    handoff: Option<*mut Handoff>,
) -> Option<u32> {
    let Some(handoff) = handoff else { return tracked_unhanded(ctx, cfg, f) };
    let entry = conntrack::lookup::<Ipv4Hdr>(&f.pkt, Frame::len(ctx), cfg, f.now, || Run::Real)?;
    counted(ctx, &entry);
    if dsr::action(entry.flags(), f.pkt.tcp_flags) != 0 {
        handoff::tracked(handoff);
        return Some(PASS);
    }
    f.to = entry.rewritten(f.pkt.tuple.proto);
    let way = Way::xdp(ctx, &f.to).unwrap_or(Way::Tc(handoff));
    Some(send_on(ctx, f, way))
}

/// [`tracked`] where the driver keeps no metadata: only a packet XDP
/// sends on itself is XDP's, the others reach tc untouched (asked first
/// as an explain run asks, nothing written, so that tc counts them once).
#[inline(always)]
fn tracked_unhanded(ctx: &XdpContext, cfg: &Config, f: &mut Flow<CtKey>) -> Option<u32> {
    let len = Frame::len(ctx);
    let entry = conntrack::lookup::<Ipv4Hdr>(&f.pkt, len, cfg, f.now, || Run::Explain)?;
    f.to = entry.rewritten(f.pkt.tuple.proto);
    let way = match Way::xdp(ctx, &f.to) {
        Some(way) if dsr::action(entry.flags(), f.pkt.tcp_flags) == 0 => way,
        _ => return Some(PASS),
    };
    match conntrack::lookup::<Ipv4Hdr>(&f.pkt, len, cfg, f.now, || Run::of(ctx)) {
        Some(entry) if entry.rewritten(f.pkt.tuple.proto) == f.to => counted(ctx, &entry),
        // Changed since: tc decides.
        _ => return Some(PASS),
    }
    Some(send_on(ctx, f, way))
}

/// Counts a tracked packet as tc does: `ct_hit`, and its frontend's
/// packets where the conntrack layout does not count them in the entry.
#[inline(always)]
fn counted(ctx: &XdpContext, entry: &<Ipv4Hdr as Family>::Entry) {
    count(Counter::CtHit);
    if !<Ipv4Hdr as Family>::Entry::COUNTS {
        stat::<Ipv4Hdr>(entry.rev_nat_id(), Event::packet(Frame::len(ctx)));
    }
}

/// A packet of no flow: its frontend's decision, the flow made and sent on
/// here where XDP can, else handed to tc.
#[inline(always)]
fn new_flow(ctx: &XdpContext, cfg: &Config, f: &mut Flow<CtKey>, handoff: *mut Handoff) -> u32 {
    match decide::<Ipv4Hdr, TCP_AND_UDP>(ctx, cfg, f) {
        Decision::Pass => PASS,
        Decision::Drop(outcome, rev_nat_id) => {
            let site = Ingress::<Ipv4Hdr, _> { ctx, tuple: &f.pkt.tuple };
            report::denied(&site, cfg, rev_nat_id, Denied::Dropped(outcome));
            DROP
        }
        Decision::Refuse(rev_nat_id) => {
            handoff::refused(handoff, rev_nat_id);
            PASS
        }
        // The option goes in at tc.
        Decision::Translate(decided) if decided.dsr => {
            handoff::decided(handoff, decided, &f.to);
            PASS
        }
        Decision::Translate(decided) => {
            if !make::<Ipv4Hdr>(ctx, cfg, f, decided) {
                return DROP;
            }
            let way = Way::xdp(ctx, &f.to).unwrap_or(Way::Tc(handoff));
            send_on(ctx, f, way)
        }
    }
}

/// An explain run's packet of no flow (`explain`; its notes in the frame's
/// metadata, no handoff room beside them): decided, nothing made, and
/// sent on from here as a real one would be, or passed up to tc, whose
/// explain run says the rest.
#[inline(always)]
fn explained_new_flow(ctx: &XdpContext, cfg: &Config, f: &mut Flow<CtKey>) -> u32 {
    match decide::<Ipv4Hdr, TCP_AND_UDP>(ctx, cfg, f) {
        Decision::Drop(..) => DROP,
        Decision::Translate(decided) if !decided.dsr => {
            Way::xdp(ctx, &f.to).map_or(PASS, |way| send_on(ctx, f, way))
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
    Tc(*mut Handoff),
}

impl Way {
    /// From here, if the FIB's next hop for `to` is known and behind an
    /// XDP interface, and the TTL allows.
    #[inline(always)]
    fn xdp(ctx: &XdpContext, to: &CtKey) -> Option<Way> {
        // SAFETY: bpf_fib_lookup is plain data; zero is a valid start.
        let mut fib: FibLookup = unsafe { core::mem::zeroed() };
        let rc = route::<Ipv4Hdr>(ctx, to, &mut fib);
        let (ingress, egress) = (Frame::ifindex(ctx), fib.ifindex);
        let xdp_out = egress == ingress || XDP_EGRESS.get(egress).is_some();
        let ours = rc == Some(BPF_FIB_LKUP_RET_SUCCESS) && xdp_out && hops_left(ctx);
        ours.then_some(Way::Xdp { egress, macs: [fib.dmac, fib.smac] })
    }
}

/// Rewrites the packet to `f.to` and sends it `way`.
#[inline(always)]
fn send_on(ctx: &XdpContext, f: &Flow<CtKey>, way: Way) -> u32 {
    let hop = matches!(way, Way::Xdp { .. });
    if packet::rewrite::<Ipv4Hdr, TCP_AND_UDP>(ctx, &f.pkt, &f.to, hop).is_err() {
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
            handoff::translated(handoff);
            PASS
        }
    }
}

/// Whether the TTL lets the packet be forwarded from here (tc's send, or
/// the stack, answers the others).
#[inline(always)]
fn hops_left(ctx: &XdpContext) -> bool {
    let ttl = ctx.load::<u8>(packet::IP_OFF + <Ipv4Hdr as packet::IpHeader>::HOPS);
    ttl.is_ok_and(|ttl| ttl > 1)
}
