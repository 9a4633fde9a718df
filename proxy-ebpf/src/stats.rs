//! Per-frontend traffic counters (`FRONTEND_STATS`, see
//! `proxy_common::stats`): one per-CPU hash lookup per event; a frontend's
//! entry is made at its first event, from a zero value in a map (no stack).
//! Events are rare ones (new flows, refusals, drops, socket-LB calls): a
//! tracked flow's packets are counted in its conntrack entry, off this map.

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::{CtValue, DropReason, FrontendStats};

use crate::maps::{FRONTEND_STATS, STATS_ZERO};

/// What happened to a frontend's traffic: a kind and its number (a
/// length, a drop reason). A struct of two plain words rather than an enum
/// with payloads: through a BPF call (the IPv6 path's steps) an enum's
/// unused payload would be an uninitialised register, which the verifier
/// refuses.
#[derive(Clone, Copy)]
pub struct Event {
    kind: Kind,
    n: u32,
}

#[derive(Clone, Copy)]
enum Kind {
    SocketConnection,
    SocketRefused,
    Flow,
    FlowPacket,
    Packet,
    Refused,
    Dropped,
}

impl Event {
    /// Socket LB: a connection (or a datagram starting a socket's flow)
    /// translated.
    pub const SOCKET_CONNECTION: Event = Event { kind: Kind::SocketConnection, n: 0 };
    /// Socket LB: a call refused.
    pub const SOCKET_REFUSED: Event = Event { kind: Kind::SocketRefused, n: 0 };
    /// Per packet: a new flow refused.
    pub const REFUSED: Event = Event { kind: Kind::Refused, n: 0 };

    /// Per packet: a new flow's first packet, of `len` bytes, in a flow
    /// whose conntrack entries are `E`: where they count packets (the
    /// default layout), its packet and bytes are the entry's, not this.
    pub const fn flow<E: CtValue>(len: u32) -> Event {
        let kind = if E::COUNTS { Kind::Flow } else { Kind::FlowPacket };
        Event { kind, n: len }
    }

    /// Per packet, `ct-lean` builds only: a tracked flow's packet, of
    /// `len` bytes (the default layout counts it in its conntrack entry).
    pub const fn packet(len: u32) -> Event {
        Event { kind: Kind::Packet, n: len }
    }

    pub const fn dropped(reason: DropReason) -> Event {
        Event { kind: Kind::Dropped, n: reason as u32 }
    }
}

/// Counts `event` for the frontend `rev_nat_id` on this CPU.
#[inline(always)]
pub fn count(rev_nat_id: u32, event: Event) {
    let Some(stats) = entry(rev_nat_id) else { return };
    // SAFETY: this CPU's value; programs of these types are not preempted
    // by another one on the same CPU.
    let stats = unsafe { &mut *stats };
    match event.kind {
        Kind::SocketConnection => stats.sock_connections += 1,
        Kind::SocketRefused => stats.sock_refused += 1,
        Kind::Flow => stats.flows += 1,
        Kind::FlowPacket => {
            stats.flows += 1;
            stats.packets += 1;
            stats.bytes += event.n as u64;
        }
        Kind::Packet => {
            stats.packets += 1;
            stats.bytes += event.n as u64;
        }
        Kind::Refused => stats.refused += 1,
        Kind::Dropped => {
            if let Some(n) = stats.dropped.get_mut(event.n as usize) {
                *n += 1;
            }
        }
    }
}

/// This CPU's counters of `rev_nat_id`, made at the first event. A full
/// map (more frontends with traffic than ids) counts nothing more.
#[inline(always)]
fn entry(rev_nat_id: u32) -> Option<*mut FrontendStats> {
    if let Some(stats) = FRONTEND_STATS.get_ptr_mut(rev_nat_id) {
        return Some(stats);
    }
    let zero = STATS_ZERO.get(0)?;
    // Another CPU may have made it meanwhile: fine, it is the same entry.
    let _ = FRONTEND_STATS.insert(rev_nat_id, zero, BPF_NOEXIST as u64);
    FRONTEND_STATS.get_ptr_mut(rev_nat_id)
}
