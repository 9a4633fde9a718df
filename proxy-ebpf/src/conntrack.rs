//! Per-packet flow tracking: two entries per flow (one per direction), each
//! telling what its packets are rewritten to. Entries carry an expiry; the
//! agent deletes expired pairs, the LRU evicts under pressure.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::bpf_get_prandom_u32,
};
use proxy_common::{
    CT_FLAG_CLOSING, CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY, CT_FLAG_SNAT, Config, CtEntry, CtKey,
    IPPROTO_UDP,
};

use crate::{
    maps::CONNTRACK,
    packet::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

const NS_PER_SEC: u64 = 1_000_000_000;
/// Expiry is rewritten at most this often per entry while nothing else changes.
const REFRESH_NS: u64 = NS_PER_SEC;
/// Source ports tried before a new SNAT flow is given up.
const SNAT_TRIES: u32 = 16;

fn lifetime_ns(cfg: &Config, proto: u8, flags: u8) -> u64 {
    let secs = if proto == IPPROTO_UDP {
        cfg.udp_timeout_secs
    } else if flags & CT_FLAG_CLOSING != 0 {
        cfg.tcp_closing_timeout_secs
    } else if flags & CT_FLAG_SEEN_REPLY != 0 {
        cfg.tcp_established_timeout_secs
    } else {
        cfg.tcp_syn_timeout_secs
    };
    secs as u64 * NS_PER_SEC
}

/// The live entry for `pkt`'s tuple, its lifetime and state refreshed. A
/// state change (first reply, FIN or RST) is written to both directions.
#[inline(always)]
pub fn lookup(pkt: &Packet, cfg: &Config, now: u64) -> Option<CtEntry> {
    let entry = CONNTRACK.get_ptr_mut(pkt.tuple)?;
    // SAFETY: LRU values may be recycled under us; we copy and re-check.
    let current = unsafe { *entry };
    if current.expires_ns < now {
        return None;
    }
    // A client reusing the source port of a flow that has closed opens a new
    // flow, as netfilter restarts a TIME_WAIT entry on SYN: it gets a fresh
    // backend pick and SNAT port instead of the dead flow's (whose 4-tuple
    // the backend may still hold in TIME_WAIT).
    let new_syn = pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    if new_syn && current.flags & (CT_FLAG_CLOSING | CT_FLAG_REPLY) == CT_FLAG_CLOSING {
        return None;
    }
    let mut flags = current.flags;
    if current.flags & CT_FLAG_REPLY != 0 {
        flags |= CT_FLAG_SEEN_REPLY;
    }
    if pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= CT_FLAG_CLOSING;
    }
    let expires_ns = now + lifetime_ns(cfg, pkt.tuple.proto, flags);
    if flags != current.flags || expires_ns > current.expires_ns + REFRESH_NS {
        unsafe {
            (*entry).flags = flags;
            (*entry).expires_ns = expires_ns;
        }
        if flags != current.flags {
            let other = current.rewritten(pkt.tuple.proto).reversed();
            if let Some(pair) = CONNTRACK.get_ptr_mut(other) {
                let shared = flags & (CT_FLAG_SEEN_REPLY | CT_FLAG_CLOSING);
                unsafe {
                    (*pair).flags |= shared;
                    (*pair).expires_ns = expires_ns;
                }
            }
        }
    }
    Some(current)
}

/// How long a closed flow's SNAT port rests before a new flow may take it:
/// Linux backends hold a closed connection in TIME_WAIT for 60 s, and clients
/// use per-connection timestamp offsets, so a new SYN on that 4-tuple
/// would often fail PAWS and be answered with an ACK instead of a SYN-ACK.
const PORT_REST_NS: u64 = 60 * NS_PER_SEC;

/// Whether the port behind an existing reply entry may go to a new flow: its
/// flow expired, or closed at least `PORT_REST_NS` ago (its entries may live
/// longer, `--conntrack-tcp-timeout-time-wait`, for late packets).
#[inline(always)]
fn reusable(reply_key: &CtKey, cfg: &Config, now: u64) -> bool {
    let Some(entry) = CONNTRACK.get_ptr(reply_key) else { return true };
    // SAFETY: read once; a racing writer at worst makes us try another port.
    let (expires_ns, flags) = unsafe { ((*entry).expires_ns, (*entry).flags) };
    let closed_lifetime = cfg.tcp_closing_timeout_secs as u64 * NS_PER_SEC;
    expires_ns < now
        || (flags & CT_FLAG_CLOSING != 0 && expires_ns + PORT_REST_NS <= now + closed_lifetime)
}

/// Records a new flow `orig` translated to `xlated`. With SNAT, picks a
/// source port in the configured range whose reply tuple is free; `None`
/// when no port (or no room) was found.
#[inline(always)]
pub fn create(
    orig: &CtKey,
    mut xlated: CtKey,
    rev_nat_id: u16,
    snat: bool,
    cfg: &Config,
    now: u64,
) -> Option<CtKey> {
    let flags = if snat { CT_FLAG_SNAT } else { 0 };
    let expires_ns = now + lifetime_ns(cfg, orig.proto, 0);
    let back = orig.reversed();
    let reply = CtEntry {
        expires_ns,
        saddr: back.saddr,
        daddr: back.daddr,
        sport: back.sport,
        dport: back.dport,
        rev_nat_id,
        flags: flags | CT_FLAG_REPLY,
        _pad: 0,
    };
    if snat {
        let span = (cfg.snat_port_max.saturating_sub(cfg.snat_port_min)) as u32 + 1;
        let mut found = false;
        for _ in 0..SNAT_TRIES {
            xlated.sport = cfg.snat_port_min + (unsafe { bpf_get_prandom_u32() } % span) as u16;
            let key = xlated.reversed();
            if CONNTRACK.insert(key, reply, BPF_NOEXIST as u64).is_ok()
                || (reusable(&key, cfg, now)
                    && CONNTRACK.insert(key, reply, BPF_ANY as u64).is_ok())
            {
                found = true;
                break;
            }
        }
        if !found {
            return None;
        }
    } else if CONNTRACK.insert(xlated.reversed(), reply, BPF_ANY as u64).is_err() {
        return None;
    }
    let forward = CtEntry {
        expires_ns,
        saddr: xlated.saddr,
        daddr: xlated.daddr,
        sport: xlated.sport,
        dport: xlated.dport,
        rev_nat_id,
        flags,
        _pad: 0,
    };
    if CONNTRACK.insert(orig, forward, BPF_ANY as u64).is_err() {
        let _ = CONNTRACK.remove(xlated.reversed());
        return None;
    }
    Some(xlated)
}
