//! Per-packet flow tracking: two entries per flow (one per direction), each
//! telling what its packets are rewritten to. The state machine and
//! lifetimes live in `proxy_common::ct`; the agent deletes expired pairs, the
//! LRU evicts under pressure. Written once for both families (`Family`:
//! `CONNTRACK`, `CONNTRACK6`).

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::bpf_get_prandom_u32,
};
use proxy_common::{
    CT_FLAG_DSR, CT_FLAG_REPLY, CT_FLAG_SNAT, CT_STATE_FLAGS, Config, CtTuple, CtValue,
    ct::{Closed, lifetime_secs, next_flags, on_closed, port_reusable},
};

use crate::{family::Family, packet::Packet, prefilter, run::Run};

const NS_PER_SEC: u64 = 1_000_000_000;
/// Expiry is rewritten at most this often per flow while its state holds.
const REFRESH_NS: u64 = NS_PER_SEC;
/// Source ports tried before a new SNAT flow is given up.
const SNAT_TRIES: u32 = 16;

fn lifetime_ns(cfg: &Config, proto: u8, flags: u8) -> u64 {
    lifetime_secs(cfg, proto, flags) as u64 * NS_PER_SEC
}

/// The live entry for `pkt`'s tuple, its state and lifetime refreshed on
/// both directions (so a one-way flow keeps its silent side alive too),
/// the packet (`len` bytes) counted in it. `run` is asked only where the
/// entry would be written: an explain run's packet leaves it as it is.
#[inline(always)]
pub fn lookup<F: Family>(
    pkt: &Packet<F::Tuple>,
    len: u32,
    cfg: &Config,
    now: u64,
    run: impl Fn() -> Run,
) -> Option<F::Entry> {
    let entry = F::ct_get_ptr_mut(&pkt.tuple)?;
    // SAFETY: LRU values may be recycled under us; we copy and re-check.
    let current = unsafe { *entry };
    if current.expires_ns() < now {
        return None;
    }
    let proto = pkt.tuple.proto();
    match on_closed(current.flags(), pkt.tcp_flags) {
        Closed::Applies => {}
        // The caller makes a new flow (overwriting both entries).
        Closed::Restarts => return None,
        // A connection that bypassed the service reuses the closed flow's
        // tuple: its packets must not be rewritten for the closed flow.
        Closed::Stale => {
            if run() == Run::Explain {
                return None;
            }
            F::ct_remove(&current.rewritten(proto).reversed());
            F::ct_remove(&pkt.tuple);
            return None;
        }
    }
    if F::Entry::COUNTS && run() == Run::Real {
        account(entry, len);
    }
    let flags = next_flags(current.flags(), pkt.tcp_flags);
    let expires_ns = now + lifetime_ns(cfg, proto, flags);
    if (flags != current.flags() || expires_ns > current.expires_ns() + REFRESH_NS)
        && run() == Run::Real
    {
        // SAFETY: as above; a lost race costs a refresh, not correctness.
        unsafe { (*entry).set_state(flags, expires_ns) };
        let other = current.rewritten(proto).reversed();
        if let Some(pair) = F::ct_get_ptr_mut(&other) {
            unsafe {
                let pair_flags = ((*pair).flags() & !CT_STATE_FLAGS) | (flags & CT_STATE_FLAGS);
                (*pair).set_state(pair_flags, expires_ns);
            }
        }
    }
    Some(current)
}

/// Counts a packet of the entry's direction: the flow's packets and bytes,
/// which the agent sums per frontend (the default layout; `ct-lean` builds
/// count them per frontend instead, see `tc_lb`).
#[inline(always)]
fn account<E: CtValue>(entry: *mut E, len: u32) {
    // SAFETY: a live map value. The BPF target has no atomic add in `core`:
    // two CPUs counting one flow at the same instant may lose a count.
    unsafe { (*entry).account(len) }
}

/// Whether the reply entry at `key` no longer holds its SNAT port.
#[inline(always)]
fn port_free<F: Family>(key: &F::Tuple, cfg: &Config, now: u64) -> bool {
    let Some(entry) = F::ct_get_ptr_mut(key) else { return true };
    // SAFETY: read once; a racing writer at worst makes us try another port.
    let (expires_ns, flags) = unsafe { ((*entry).expires_ns(), (*entry).flags()) };
    port_reusable(cfg, expires_ns, flags, now)
}

/// Records a new flow `orig` translated to `xlated` (masqueraded with
/// `snat`, sent by direct server return with `dsr`), its first packet
/// (`len` bytes) counted in the forward entry. With SNAT, picks a
/// source port in the configured range whose reply tuple is free (or held by
/// a flow that closed long enough ago, as netfilter reuses closed tuples),
/// and writes it into `xlated`; false when no port (or no room) was found.
/// (No reason why: returning one measured 10-20 ns slower per new flow.)
#[inline(always)]
pub fn create<F: Family>(
    orig: &F::Tuple,
    xlated: &mut F::Tuple,
    rev_nat_id: u32,
    (snat, dsr): (bool, bool),
    len: u32,
    cfg: &Config,
    now: u64,
) -> bool {
    // The DSR bit is only stored, never tested here: the verifier keeps
    // the flows with and without it on one path.
    let flags = (if snat { CT_FLAG_SNAT } else { 0 }) | ((dsr as u8) << 7);
    const _: () = assert!(CT_FLAG_DSR == 1 << 7);
    let expires_ns = now + lifetime_ns(cfg, orig.proto(), 0);
    let back = orig.reversed();
    let mut entry = F::Entry::new(expires_ns, &back, rev_nat_id, flags | CT_FLAG_REPLY);
    if snat {
        let span = (cfg.snat_port_max.saturating_sub(cfg.snat_port_min)) as u32 + 1;
        let mut found = false;
        for _ in 0..SNAT_TRIES {
            let port = cfg.snat_port_min + (unsafe { bpf_get_prandom_u32() } % span) as u16;
            *xlated = xlated.with_sport(port);
            let key = xlated.reversed();
            if F::ct_insert(&key, &entry, BPF_NOEXIST as u64).is_ok()
                || (port_free::<F>(&key, cfg, now)
                    && F::ct_insert(&key, &entry, BPF_ANY as u64).is_ok())
            {
                found = true;
                break;
            }
        }
        if !found {
            return false;
        }
    } else if F::ct_insert(&xlated.reversed(), &entry, BPF_ANY as u64).is_err() {
        return false;
    }
    // The forward entry in the reply's stack slot: the accounting layout's
    // entries are large, and the verifier adds a log call's frame to this.
    entry = F::Entry::new(expires_ns, xlated, rev_nat_id, flags);
    entry.account(len);
    if F::ct_insert(orig, &entry, BPF_ANY as u64).is_err() {
        F::ct_remove(&xlated.reversed());
        return false;
    }
    // Replies to a SNAT port pass the pre-filter on the port; the others
    // on their backend's reply slot, set once the entries exist.
    if !snat {
        prefilter::mark_reply(xlated);
    }
    true
}

/// On a backend's node, a packet sent here by direct server return
/// (`service`: its tuple with the service its option names as the
/// destination): the reply entry that makes the backend's
/// replies leave as the service, straight to the client. Made at the
/// flow's first packet here, or again once it no longer holds this
/// service or a SYN reopens its closed 4-tuple; else its state follows the
/// client's packets (every one carries the option), as a forward entry's
/// would.
#[inline(always)]
pub fn learn_dsr<F: Family>(
    pkt: &Packet<F::Tuple>,
    service: &F::Tuple,
    rev_nat_id: u32,
    cfg: &Config,
    now: u64,
) -> Learnt {
    let t = &pkt.tuple;
    let proto = t.proto();
    let key = t.reversed();
    let to = F::Tuple::new(service.daddr(), t.saddr(), service.dport(), t.sport(), proto);
    if let Some(entry) = F::ct_get_ptr_mut(&key) {
        // SAFETY: as in `lookup`.
        let current = unsafe { *entry };
        // A SYN on a closed flow's 4-tuple is a new flow (the client reused
        // its port): the closed state would call the pod's SYN-ACK stale.
        let restarts = on_closed(current.flags() & !CT_FLAG_REPLY, pkt.tcp_flags);
        if current.expires_ns() >= now
            && current.rewritten(proto) == to
            && restarts == Closed::Applies
        {
            let state = next_flags(CT_FLAG_DSR | (current.flags() & CT_STATE_FLAGS), pkt.tcp_flags);
            let flags = (current.flags() & !CT_STATE_FLAGS) | (state & CT_STATE_FLAGS);
            let expires_ns = now + lifetime_ns(cfg, proto, flags);
            if flags != current.flags() || expires_ns > current.expires_ns() + REFRESH_NS {
                // SAFETY: as in `lookup`.
                unsafe { (*entry).set_state(flags, expires_ns) };
            }
            return Learnt::Known;
        }
    }
    let expires_ns = now + lifetime_ns(cfg, proto, 0);
    let entry = F::Entry::new(expires_ns, &to, rev_nat_id, CT_FLAG_REPLY | CT_FLAG_DSR);
    if F::ct_insert(&key, &entry, BPF_ANY as u64).is_err() {
        return Learnt::NoRoom;
    }
    prefilter::mark_reply(t);
    Learnt::New
}

/// What a DSR packet taught a backend's node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Learnt {
    /// A flow it did not know: its reply entry made.
    New,
    /// A flow it knew: its entry renewed.
    Known,
    /// No room for the entry.
    NoRoom,
}

/// What packets with `key` are rewritten to, if a live flow has that entry.
/// Nothing is refreshed: for packets that are about a flow but not of it
/// (ICMP errors quoting one of its packets).
#[inline(always)]
pub fn peek<F: Family>(key: &F::Tuple, now: u64) -> Option<F::Tuple> {
    let entry = F::ct_get_ptr_mut(key)?;
    // SAFETY: a live map value, read at once.
    let (expires_ns, rewritten) =
        unsafe { ((*entry).expires_ns(), (*entry).rewritten(key.proto())) };
    (expires_ns >= now).then_some(rewritten)
}
