//! Per-packet flow tracking: two entries per flow (one per direction), each
//! telling what its packets are rewritten to. The state machine and
//! lifetimes live in `proxy_common::ct`; the agent deletes expired pairs, the
//! LRU evicts under pressure.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::bpf_get_prandom_u32,
};
use proxy_common::{
    CT_FLAG_REPLY, CT_FLAG_SNAT, CT_STATE_FLAGS, Config, CtEntry, CtKey,
    ct::{Closed, lifetime_secs, next_flags, on_closed, port_reusable},
};

use crate::{maps::CONNTRACK, packet::Packet};

const NS_PER_SEC: u64 = 1_000_000_000;
/// Expiry is rewritten at most this often per flow while its state holds.
const REFRESH_NS: u64 = NS_PER_SEC;
/// Source ports tried before a new SNAT flow is given up.
const SNAT_TRIES: u32 = 16;

fn lifetime_ns(cfg: &Config, proto: u8, flags: u8) -> u64 {
    lifetime_secs(cfg, proto, flags) as u64 * NS_PER_SEC
}

/// The live entry for `pkt`'s tuple, its state and lifetime refreshed on
/// both directions (so a one-way flow keeps its silent side alive too).
/// `len`: the packet's length, for the flow-accounting build.
#[inline(always)]
pub fn lookup(pkt: &Packet, len: u32, cfg: &Config, now: u64) -> Option<CtEntry> {
    let entry = CONNTRACK.get_ptr_mut(pkt.tuple)?;
    // SAFETY: LRU values may be recycled under us; we copy and re-check.
    let current = unsafe { *entry };
    if current.expires_ns < now {
        return None;
    }
    account(entry, len);
    match on_closed(current.flags, pkt.tcp_flags) {
        Closed::Applies => {}
        // The caller makes a new flow (overwriting both entries).
        Closed::Restarts => return None,
        // A connection that bypassed the service reuses the closed flow's
        // tuple: its packets must not be rewritten for the closed flow.
        Closed::Stale => {
            let _ = CONNTRACK.remove(current.rewritten(pkt.tuple.proto).reversed());
            let _ = CONNTRACK.remove(pkt.tuple);
            return None;
        }
    }
    let flags = next_flags(current.flags, pkt.tcp_flags);
    let expires_ns = now + lifetime_ns(cfg, pkt.tuple.proto, flags);
    if flags != current.flags || expires_ns > current.expires_ns + REFRESH_NS {
        // SAFETY: as above; a lost race costs a refresh, not correctness.
        unsafe {
            (*entry).flags = flags;
            (*entry).expires_ns = expires_ns;
        }
        let other = current.rewritten(pkt.tuple.proto).reversed();
        if let Some(pair) = CONNTRACK.get_ptr_mut(other) {
            unsafe {
                (*pair).flags = ((*pair).flags & !CT_STATE_FLAGS) | (flags & CT_STATE_FLAGS);
                (*pair).expires_ns = expires_ns;
            }
        }
    }
    Some(current)
}

/// Counts a packet of the entry's direction (`ct-accounting` builds).
#[cfg(feature = "ct-accounting")]
#[inline(always)]
fn account(entry: *mut CtEntry, len: u32) {
    // SAFETY: a live map value. The BPF target has no atomic add in `core`:
    // two CPUs counting one flow at the same instant may lose a count.
    unsafe {
        (*entry).packets += 1;
        (*entry).bytes += len as u64;
    }
}

#[cfg(not(feature = "ct-accounting"))]
#[inline(always)]
fn account(_entry: *mut CtEntry, _len: u32) {}

/// Whether the reply entry at `key` no longer holds its SNAT port.
#[inline(always)]
fn port_free(key: &CtKey, cfg: &Config, now: u64) -> bool {
    let Some(entry) = CONNTRACK.get_ptr(key) else { return true };
    // SAFETY: read once; a racing writer at worst makes us try another port.
    let (expires_ns, flags) = unsafe { ((*entry).expires_ns, (*entry).flags) };
    port_reusable(cfg, expires_ns, flags, now)
}

/// Records a new flow `orig` translated to `xlated`. With SNAT, picks a
/// source port in the configured range whose reply tuple is free (or held by
/// a flow that closed long enough ago, as netfilter reuses closed tuples);
/// `None` when no port (or no room) was found. (No reason why: returning
/// one measured 10-20 ns slower per new flow.)
#[inline(always)]
pub fn create(
    orig: &CtKey,
    mut xlated: CtKey,
    rev_nat_id: u32,
    snat: bool,
    cfg: &Config,
    now: u64,
) -> Option<CtKey> {
    let flags = if snat { CT_FLAG_SNAT } else { 0 };
    let expires_ns = now + lifetime_ns(cfg, orig.proto, 0);
    let back = orig.reversed();
    let mut entry = CtEntry::new(expires_ns, &back, rev_nat_id, flags | CT_FLAG_REPLY);
    if snat {
        let span = (cfg.snat_port_max.saturating_sub(cfg.snat_port_min)) as u32 + 1;
        let mut found = false;
        for _ in 0..SNAT_TRIES {
            xlated.sport = cfg.snat_port_min + (unsafe { bpf_get_prandom_u32() } % span) as u16;
            let key = xlated.reversed();
            if CONNTRACK.insert(key, entry, BPF_NOEXIST as u64).is_ok()
                || (port_free(&key, cfg, now)
                    && CONNTRACK.insert(key, entry, BPF_ANY as u64).is_ok())
            {
                found = true;
                break;
            }
        }
        if !found {
            return None;
        }
    } else if CONNTRACK.insert(xlated.reversed(), entry, BPF_ANY as u64).is_err() {
        return None;
    }
    // The forward entry in the reply's stack slot: the accounting layout's
    // entries are large, and the verifier adds a log call's frame to this.
    entry = CtEntry::new(expires_ns, &xlated, rev_nat_id, flags);
    if CONNTRACK.insert(orig, entry, BPF_ANY as u64).is_err() {
        let _ = CONNTRACK.remove(xlated.reversed());
        return None;
    }
    Some(xlated)
}

/// What packets with `key` are rewritten to, if a live flow has that entry.
/// Nothing is refreshed: for packets that are about a flow but not of it
/// (ICMP errors quoting one of its packets).
#[inline(always)]
pub fn peek(key: &CtKey, now: u64) -> Option<CtKey> {
    // SAFETY: copied out at once.
    let entry = unsafe { CONNTRACK.get(key).copied() }?;
    (entry.expires_ns >= now).then(|| entry.rewritten(key.proto))
}
