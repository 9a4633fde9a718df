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
    maps::lpm_trie::Key,
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_CLIENT_IPV4, Backend, Config, Counter, CtKey, FragKey, FragRewrite,
    SOURCE_RANGE_PREFIX_BITS, ServiceKey, ServiceValue, SourceRangeKey, log_level,
};

use crate::{
    conntrack, icmp,
    lb::{self, Verdict},
    log::{self, Outcome},
    maps::{CONFIG, FRAGMENTS, SOURCE_RANGES, count},
    packet::{self, IPPROTO_ICMP, IcmpMessage, Packet, Parsed},
    prefilter::{self, Filter, Hook},
    reject,
    tc_act::{NEXT, SHOT, STACK},
};

const AF_INET: u8 = 2;

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
        Some(Parsed::Packet(pkt)) => pkt,
        Some(Parsed::Fragment(key)) => return later_fragment(ctx, &key),
        Some(Parsed::Icmp(msg)) => return icmp_error(ctx, &msg, true),
        None => return NEXT,
    };
    let now = unsafe { bpf_ktime_get_ns() };

    if let Some(entry) = conntrack::lookup(&pkt, ctx.len(), cfg, now) {
        count(Counter::CtHit);
        return forward(ctx, &pkt, &entry.rewritten(pkt.tuple.proto));
    }
    if scope == Scope::TrackedOnly {
        return NEXT;
    }

    let key = ServiceKey::new(pkt.tuple.daddr, pkt.tuple.dport, pkt.tuple.proto, 0);
    let Some(svc) = lb::lookup_frontend(&key) else {
        record_unknown(cfg, &pkt);
        return NEXT;
    };
    let t = &pkt.tuple;
    if svc.flags.has_source_ranges() && !source_allowed(&svc, t.saddr) {
        count(Counter::Dropped);
        record(cfg, log_level::INFO, true, t, Outcome::SourceOutsideRanges);
        return SHOT;
    }
    new_flow(ctx, cfg, &pkt, &key, &svc, now)
}

/// Whether the pre-filter passes the packet on untouched. At `trace`, where
/// every packet of no flow is recorded, every packet takes the full path.
#[inline(always)]
fn filtered(ctx: &TcContext, cfg: &Config, hook: Hook) -> bool {
    cfg.log_level < log_level::TRACE && prefilter::check(ctx, cfg, hook) == Filter::Pass
}

/// A new flow to the frontend `svc` (found at `key`): a backend, SNAT where
/// kube-proxy would masquerade, two conntrack entries; or its refusal.
#[inline(always)]
fn new_flow(
    ctx: &TcContext,
    cfg: &Config,
    pkt: &Packet,
    key: &ServiceKey,
    svc: &ServiceValue,
    now: u64,
) -> i32 {
    let t = &pkt.tuple;
    let client = u32::from_ne_bytes(t.saddr) as u64;
    let (scoped_key, scoped) =
        if from_pods(cfg, t.saddr) { lb::in_cluster_scope(key, svc) } else { (*key, *svc) };
    match lb::choose(&scoped_key, &scoped, client, AFFINITY_CLIENT_IPV4) {
        Verdict::NoBackend if scoped.flags.drops_when_empty() => {
            count(Counter::Dropped);
            record(cfg, log_level::INFO, true, t, Outcome::NoLocalEndpoint);
            SHOT
        }
        Verdict::NoBackend => {
            record(cfg, log_level::INFO, true, t, Outcome::NoEndpoint);
            reject::refuse(ctx, pkt)
        }
        Verdict::Backend { backend, rev_nat_id, via, .. } => {
            let snat = needs_snat(svc, cfg, pkt, &backend);
            let xlated = CtKey {
                saddr: if snat { cfg.snat_addr } else { t.saddr },
                daddr: backend.address,
                sport: t.sport,
                dport: backend.port,
                proto: t.proto,
                _pad: [0; 3],
            };
            let xlated = match conntrack::create(t, xlated, rev_nat_id, snat, cfg, now) {
                Some(xlated) => xlated,
                None => {
                    count(Counter::Dropped);
                    let outcome = if snat { Outcome::NoSnatPort } else { Outcome::ConntrackFull };
                    record(cfg, log_level::INFO, true, t, outcome);
                    return SHOT;
                }
            };
            count(Counter::CtNew);
            if cfg.log_level >= log_level::DEBUG {
                log::new_flow(t, &xlated, via, scoped.flags);
                if snat {
                    log::snat(t, &xlated);
                }
            }
            forward(ctx, pkt, &xlated)
        }
    }
}

/// Records a packet of no flow to no service: a reply to a SNAT port
/// whose flow is gone (expired, evicted) at debug, anything else at trace.
#[inline(always)]
fn record_unknown(cfg: &Config, pkt: &Packet) {
    if cfg.log_level < log_level::DEBUG {
        return;
    }
    let t = &pkt.tuple;
    if t.daddr == cfg.snat_addr && (cfg.snat_port_min..=cfg.snat_port_max).contains(&t.dport) {
        record(cfg, log_level::DEBUG, true, t, Outcome::ReplyWithoutFlow);
    } else {
        record(cfg, log_level::TRACE, true, t, Outcome::NoService);
    }
}

/// A decision record about the packet `t`, if the configured level takes it.
#[inline(always)]
fn record(cfg: &Config, level: u8, ingress: bool, t: &CtKey, outcome: Outcome) {
    if cfg.log_level >= level {
        log::packet(level, ingress, t, outcome);
    }
}

/// Whether a source is in-cluster as kube-proxy's local detector sees it:
/// in `--cluster-cidr` (none set, none is). The node's own traffic to its
/// addresses never passes tc ingress (only the socket hooks see it), and
/// another node's address is external to kube-proxy too.
#[inline(always)]
fn from_pods(cfg: &Config, saddr: [u8; 4]) -> bool {
    cfg.cluster_cidr_prefix != 0 && in_prefix(saddr, cfg.cluster_cidr, cfg.cluster_cidr_prefix)
}

/// kube-proxy's masquerade decisions: external traffic with policy Cluster,
/// a pod reaching itself (hairpin), and ClusterIP traffic from outside the
/// cluster CIDR (or all of it with `--masquerade-all`). `svc` is the
/// frontend the client addressed, whichever scope serves it: pods reaching
/// a Local external address are not masqueraded (kube-proxy's short-circuit
/// skips the ClusterIP's masquerade rule, which matches the ClusterIP).
#[inline(always)]
fn needs_snat(svc: &ServiceValue, cfg: &Config, pkt: &Packet, backend: &Backend) -> bool {
    // A host-network backend answers from this node anyway, and a packet
    // from a node address to a node address would be a martian.
    if backend.flags.is_host() {
        return false;
    }
    if backend.address == pkt.tuple.saddr {
        return true;
    }
    if svc.flags.is_external() {
        return !svc.flags.is_local_only();
    }
    cfg.masquerade_all != 0
        || (cfg.cluster_cidr_prefix != 0
            && !in_prefix(pkt.tuple.saddr, cfg.cluster_cidr, cfg.cluster_cidr_prefix))
}

#[inline(always)]
fn in_prefix(addr: [u8; 4], prefix: [u8; 4], len: u8) -> bool {
    let mask = if len >= 32 { u32::MAX } else { !(u32::MAX >> len) };
    u32::from_be_bytes(addr) & mask == u32::from_be_bytes(prefix) & mask
}

#[inline(always)]
fn source_allowed(svc: &ServiceValue, saddr: [u8; 4]) -> bool {
    let key = Key::new(
        SOURCE_RANGE_PREFIX_BITS + 32,
        SourceRangeKey { rev_nat_id: svc.rev_nat_id, address: saddr },
    );
    SOURCE_RANGES.get(&key).is_some()
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
        Some(Parsed::Packet(pkt)) => pkt,
        Some(Parsed::Icmp(msg)) => return icmp_error(ctx, &msg, false),
        _ => return NEXT,
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(entry) = conntrack::lookup(&pkt, ctx.len(), cfg, now) else {
        record(cfg, log_level::TRACE, false, &pkt.tuple, Outcome::NoFlow);
        return NEXT;
    };
    count(Counter::CtHit);
    match packet::rewrite(ctx, &pkt, &entry.rewritten(pkt.tuple.proto)) {
        Ok(()) => NEXT,
        Err(_) => {
            count(Counter::Dropped);
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
fn icmp_error(ctx: &TcContext, msg: &IcmpMessage, ingress: bool) -> i32 {
    let Some(err) = icmp::parse(ctx, msg) else { return NEXT };
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(to) = icmp::translation(&err, now) else { return NEXT };
    if !ingress && to.daddr != msg.daddr {
        return NEXT;
    }
    if icmp::rewrite(ctx, &err, &to).is_err() {
        count(Counter::Dropped);
        return SHOT;
    }
    count(Counter::IcmpRevNat);
    if !ingress {
        return NEXT;
    }
    let outer = CtKey { saddr: to.saddr, daddr: to.daddr, proto: IPPROTO_ICMP, ..CtKey::default() };
    send(ctx, &outer)
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
    send(ctx, &tuple)
}

/// Rewrites `pkt` to `to` and sends it towards its new destination; the
/// first fragment of a datagram leaves its translation for the others.
#[inline(always)]
fn forward(ctx: &TcContext, pkt: &Packet, to: &CtKey) -> i32 {
    if packet::rewrite(ctx, pkt, to).is_err() {
        count(Counter::Dropped);
        return SHOT;
    }
    if let Some(key) = &pkt.first_fragment {
        let _ = FRAGMENTS.insert(key, FragRewrite { saddr: to.saddr, daddr: to.daddr }, 0);
    }
    send(ctx, to)
}

/// Sends an already translated packet on: a FIB lookup, then a redirect to
/// the next hop's interface (the stack for local or unroutable addresses).
#[inline(always)]
fn send(ctx: &TcContext, to: &CtKey) -> i32 {
    // SAFETY: bpf_fib_lookup is plain data; zero is a valid start.
    let mut fib: FibLookup = unsafe { core::mem::zeroed() };
    fib.family = AF_INET;
    fib.l4_protocol = to.proto;
    fib.sport = to.sport.to_be();
    fib.dport = to.dport.to_be();
    fib.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    fib.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(to.saddr);
    fib.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(to.daddr);
    let rc = unsafe {
        bpf_fib_lookup(ctx.skb.skb.cast(), &mut fib, core::mem::size_of::<FibLookup>() as i32, 0)
    } as u32;
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        // Local delivery (a host-network backend) or no route: the stack
        // takes the translated packet from here.
        return STACK;
    }
    match packet::decrement_ttl(ctx) {
        Ok(true) => {}
        _ => return SHOT,
    }
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        let macs = [fib.dmac, fib.smac];
        if ctx.store(0, &macs, 0).is_err() {
            return SHOT;
        }
        return unsafe { bpf_redirect(fib.ifindex, 0) } as i32;
    }
    // SAFETY: plain data.
    let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
    nh.nh_family = AF_INET as u32;
    nh.__bindgen_anon_1.ipv4_nh = unsafe { fib.__bindgen_anon_4.ipv4_dst };
    unsafe {
        bpf_redirect_neigh(fib.ifindex, &mut nh, core::mem::size_of::<bpf_redir_neigh>() as i32, 0)
            as i32
    }
}
