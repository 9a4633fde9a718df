//! Per-packet load balancing at the driver hook (XDP, `--bpf-lb-acceleration`)
//! on node interfaces: a packet of a tracked flow whose translation leaves
//! by a node interface that carries this program (`XDP_EGRESS`; the one it
//! came in by included) is rewritten and sent on before the kernel builds
//! an skb for it: a NodePort, externalIP or LoadBalancer flow to a backend
//! on another node, and the replies coming back to its SNAT port. Every
//! other packet passes untouched to the stack, where tc does what it does
//! without XDP, from the same maps: a flow's first packet, packets to and
//! from this node's pods and host, fragments, IPv4 options, ICMP, IPv6,
//! SCTP, DSR's option insertions, and next hops the FIB has no neighbour
//! for. Nothing is written before the packet is known to be XDP's: a
//! packet passed on is counted once, by tc.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup as FibLookup, xdp_action},
    helpers::{bpf_ktime_get_ns, generated::bpf_fib_lookup},
    programs::XdpContext,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{Config, Counter, CtKey, CtValue, IPPROTO_SCTP, dsr};

use crate::{
    conntrack,
    family::Family,
    frame::Frame,
    maps::{CONFIG, XDP_EGRESS, count},
    packet::{self, Packet, Parsed, TCP_AND_UDP},
    prefilter::{self, Filter, Hook},
    run::Run,
    stats::{self, Event},
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
    match packet::parse(ctx) {
        Some(Parsed::Packet(pkt)) if ours(&pkt) => tracked(ctx, cfg, &pkt),
        _ => PASS,
    }
}

/// Whether the packet is one XDP may send on: TCP or UDP, an IPv4 header
/// without options, not a fragment.
#[inline(always)]
fn ours(pkt: &Packet) -> bool {
    pkt.plain_ip_header && pkt.first_fragment.is_none() && pkt.tuple.proto != IPPROTO_SCTP
}

/// A packet of a tracked flow that leaves by an XDP interface: rewritten
/// and sent; anything else passes.
#[inline(always)]
fn tracked(ctx: &XdpContext, cfg: &Config, pkt: &Packet) -> u32 {
    let (now, len) = (unsafe { bpf_ktime_get_ns() }, Frame::len(ctx));
    // Asked first as an explain run asks (nothing written): what tc would
    // do with the packet is known before it is counted anywhere.
    let Some(entry) = conntrack::lookup::<Ipv4Hdr>(pkt, len, cfg, now, || Run::Explain) else {
        return PASS;
    };
    if dsr::action(entry.flags(), pkt.tcp_flags) != 0 {
        return PASS;
    }
    let to = entry.rewritten(pkt.tuple.proto);
    let Some(fib) = route(ctx, &to) else { return PASS };
    let (ingress, egress) = (Frame::ifindex(ctx), fib.ifindex);
    if egress != ingress && XDP_EGRESS.get(egress).is_none() {
        return PASS;
    }
    if !hops_left(ctx) {
        return PASS;
    }
    // The packet is XDP's: now counted and its flow refreshed, as tc would.
    match conntrack::lookup::<Ipv4Hdr>(pkt, len, cfg, now, || Run::Real) {
        Some(entry) if entry.rewritten(pkt.tuple.proto) == to => {
            count(Counter::CtHit);
            count(Counter::XdpForwarded);
            if !<Ipv4Hdr as Family>::Entry::COUNTS {
                stats::count(entry.rev_nat_id(), Event::packet(len));
            }
        }
        // Changed under us: tc decides.
        _ => return PASS,
    }
    let sent = packet::rewrite::<Ipv4Hdr, TCP_AND_UDP>(ctx, pkt, &to, true)
        .and_then(|_| packet::set_macs(ctx, &[fib.dmac, fib.smac]));
    if sent.is_err() {
        count(Counter::Dropped);
        return DROP;
    }
    if egress == ingress {
        return TX;
    }
    XDP_EGRESS.redirect(egress, 0).unwrap_or_else(|action| action)
}

/// The FIB's next hop for a packet translated to `to`, if it is known to
/// the neighbour (the stack resolves the others).
#[inline(always)]
fn route(ctx: &XdpContext, to: &CtKey) -> Option<FibLookup> {
    // SAFETY: bpf_fib_lookup is plain data; zero is a valid start.
    let mut fib: FibLookup = unsafe { core::mem::zeroed() };
    fib.family = <Ipv4Hdr as Family>::AF;
    fib.l4_protocol = to.proto;
    fib.sport = to.sport.to_be();
    fib.dport = to.dport.to_be();
    fib.ifindex = Frame::ifindex(ctx);
    <Ipv4Hdr as Family>::fib_addrs(&mut fib, to);
    let size = core::mem::size_of::<FibLookup>() as i32;
    // SAFETY: the program's own context, and `fib` of the size given.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), &mut fib, size, 0) } as u32;
    (rc == BPF_FIB_LKUP_RET_SUCCESS).then_some(fib)
}

/// Whether the TTL lets the packet be forwarded (the stack answers the
/// others with its ICMP error).
#[inline(always)]
fn hops_left(ctx: &XdpContext) -> bool {
    let ttl = ctx.load::<u8>(packet::IP_OFF + <Ipv4Hdr as packet::IpHeader>::HOPS);
    ttl.is_ok_and(|ttl| ttl > 1)
}
