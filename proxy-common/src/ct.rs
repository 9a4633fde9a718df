//! The flow state machine, shared by the programs and the agent's tests.

use crate::{
    CT_FLAG_CLOSED, CT_FLAG_DSR, CT_FLAG_ESTABLISHED, CT_FLAG_FIN_ORIG, CT_FLAG_FIN_REPLY,
    CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY, Config, IPPROTO_UDP,
};

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;
/// A closed flow's SNAT port rests this long before a new flow may take
/// it: Linux backends keep a closed connection in TIME_WAIT for 60 s, and
/// clients use per-connection timestamp offsets, so a new SYN on that
/// 4-tuple would often fail PAWS (answered by an ACK, not a SYN-ACK).
pub const PORT_REST_SECS: u64 = 60;
const NS_PER_SEC: u64 = 1_000_000_000;

/// The flags of an entry after a packet of its direction with
/// `tcp_flags` (0 for UDP).
pub const fn next_flags(flags: u8, tcp_flags: u8) -> u8 {
    let reply = flags & CT_FLAG_REPLY != 0;
    let mut next = flags;
    // A DSR flow's replies never pass the node it enters: there, a
    // client's ACK without SYN says the backend answered.
    let answered =
        flags & CT_FLAG_SEEN_REPLY != 0 || (flags & CT_FLAG_DSR != 0 && tcp_flags & TCP_SYN == 0);
    if reply {
        next |= CT_FLAG_SEEN_REPLY;
    } else if answered && tcp_flags & TCP_ACK != 0 {
        next |= CT_FLAG_ESTABLISHED;
    }
    if tcp_flags & TCP_FIN != 0 {
        next |= if reply { CT_FLAG_FIN_REPLY } else { CT_FLAG_FIN_ORIG };
        // Nor does the backend's FIN: on the node the flow entered (its
        // entry never sees a reply), the client's ends the flow (its
        // last ACKs still pass while the entry lives). The backend's
        // node sees both FINs and waits for them, as for any flow.
        if flags & (CT_FLAG_DSR | CT_FLAG_SEEN_REPLY) == CT_FLAG_DSR && !reply {
            next |= CT_FLAG_FIN_REPLY;
        }
    }
    let both_fins = CT_FLAG_FIN_ORIG | CT_FLAG_FIN_REPLY;
    if tcp_flags & TCP_RST != 0 || next & both_fins == both_fins {
        next |= CT_FLAG_CLOSED;
    }
    next
}

/// How long a flow in state `flags` lives without packets.
pub const fn lifetime_secs(cfg: &Config, proto: u8, flags: u8) -> u32 {
    if proto == IPPROTO_UDP {
        cfg.udp_timeout_secs
    } else if flags & CT_FLAG_CLOSED != 0 {
        cfg.tcp_time_wait_timeout_secs
    } else if flags & (CT_FLAG_FIN_ORIG | CT_FLAG_FIN_REPLY) != 0 {
        cfg.tcp_close_wait_timeout_secs
    } else if flags & CT_FLAG_ESTABLISHED != 0 {
        cfg.tcp_established_timeout_secs
    } else {
        cfg.tcp_syn_timeout_secs
    }
}

/// What a SYN on a closed flow's entry means: on the client's entry, a
/// new flow through the service from the same port (it restarts, as
/// netfilter restarts a TIME_WAIT entry); on the backend's entry, a
/// connection that never went through the service (the client reaching
/// the backend directly from the same port), for which the closed
/// flow's entries are stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// The entry applies.
    Applies,
    Restarts,
    Stale,
}

pub const fn on_closed(flags: u8, tcp_flags: u8) -> Closed {
    if tcp_flags & TCP_SYN == 0 || flags & CT_FLAG_CLOSED == 0 {
        Closed::Applies
    } else if flags & CT_FLAG_REPLY == 0 {
        Closed::Restarts
    } else {
        Closed::Stale
    }
}

/// Whether the SNAT port held by a reply entry may go to a new flow: the
/// entry expired, or its flow closed at least `PORT_REST_SECS` ago.
pub const fn port_reusable(cfg: &Config, expires_ns: u64, flags: u8, now: u64) -> bool {
    let closed_lifetime = cfg.tcp_time_wait_timeout_secs as u64 * NS_PER_SEC;
    expires_ns < now
        || (flags & CT_FLAG_CLOSED != 0
            && expires_ns + PORT_REST_SECS * NS_PER_SEC <= now + closed_lifetime)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::with_timeouts as cfg;
    use crate::*;

    #[test]
    fn tcp_flows_walk_through_the_states() {
        let life = |flags| lifetime_secs(&cfg(), IPPROTO_TCP, flags);
        let (fwd, rev) = (0, CT_FLAG_REPLY);
        // SYN, SYN-ACK: not established until the client's ACK.
        let f = next_flags(fwd, TCP_SYN);
        assert_eq!(life(f), 60);
        let r = next_flags(rev | (f & CT_STATE_FLAGS), TCP_SYN | TCP_ACK);
        assert_eq!(life(r), 60, "a SYN-ACK alone does not establish (SYN floods)");
        let f = next_flags(fwd | (r & CT_STATE_FLAGS), TCP_ACK);
        assert_eq!(life(f), 86_400);
        // One FIN: half-closed; both: closed.
        let f = next_flags(f, TCP_FIN | TCP_ACK);
        assert_eq!(life(f), 3_600);
        assert_eq!(on_closed(f, TCP_SYN), Closed::Applies);
        let r = next_flags(rev | (f & CT_STATE_FLAGS), TCP_FIN | TCP_ACK);
        assert_eq!(life(r), 120);
        assert_eq!(on_closed(fwd | (r & CT_STATE_FLAGS), TCP_SYN), Closed::Restarts);
        assert_eq!(on_closed(fwd | (r & CT_STATE_FLAGS), TCP_ACK), Closed::Applies);
        // The backend answering a SYN the service never saw: a direct
        // connection from the same client port; the closed flow is stale.
        assert_eq!(on_closed(r, TCP_SYN | TCP_ACK), Closed::Stale);
        // An RST closes at once.
        assert_eq!(life(next_flags(fwd | CT_FLAG_ESTABLISHED, TCP_RST)), 120);
        assert_eq!(lifetime_secs(&cfg(), IPPROTO_UDP, CT_FLAG_ESTABLISHED), 30);
    }

    #[test]
    fn a_dsr_flow_is_established_by_the_clients_ack_alone() {
        let life = |flags| lifetime_secs(&cfg(), IPPROTO_TCP, flags);
        // Its replies never pass the node it entered.
        let f = next_flags(CT_FLAG_DSR, TCP_SYN);
        assert_eq!(life(f), 60);
        assert_eq!(life(next_flags(f, TCP_SYN | TCP_ACK)), 60, "no ACK of a SYN");
        assert_eq!(life(next_flags(f, TCP_ACK)), 86_400);
        assert_eq!(life(next_flags(0, TCP_ACK)), 60, "not without DSR");
    }

    #[test]
    fn a_dsr_flow_closes_at_the_clients_fin_and_a_new_syn_restarts_it() {
        let life = |flags| lifetime_secs(&cfg(), IPPROTO_TCP, flags);
        // The backend's FIN never passes the node the flow entered.
        let est = next_flags(next_flags(CT_FLAG_DSR, TCP_SYN), TCP_ACK);
        let closed = next_flags(est, TCP_FIN | TCP_ACK);
        assert_eq!(life(closed), 120, "time-wait, not an hour of close-wait");
        assert_eq!(life(next_flags(closed, TCP_ACK)), 120, "its last ACKs keep it closed");
        assert_eq!(on_closed(closed, TCP_SYN), Closed::Restarts);
        // Without DSR, one FIN is not the end.
        assert_eq!(life(next_flags(CT_FLAG_ESTABLISHED, TCP_FIN | TCP_ACK)), 3_600);
        // Nor on the backend's node, whose entry saw the pod's replies: a
        // client that half-closes may wait long for the rest.
        let learnt = CT_FLAG_DSR | CT_FLAG_SEEN_REPLY | CT_FLAG_ESTABLISHED;
        assert_eq!(life(next_flags(learnt, TCP_FIN | TCP_ACK)), 3_600);
    }

    #[test]
    fn snat_ports_rest_through_time_wait() {
        let s = 1_000_000_000u64;
        let now = 1_000 * s;
        let closed_at = |t: u64| t + 120 * s; // expiry of a flow closed at t
        assert!(port_reusable(&cfg(), now - 1, 0, now), "expired");
        assert!(!port_reusable(&cfg(), now + 10 * s, CT_FLAG_ESTABLISHED, now), "live");
        assert!(!port_reusable(&cfg(), closed_at(now - 59 * s), CT_FLAG_CLOSED, now));
        assert!(port_reusable(&cfg(), closed_at(now - 60 * s), CT_FLAG_CLOSED, now));
    }
}
