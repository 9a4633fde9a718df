//! `proxy-agent explain`: a crafted packet run through the per-packet
//! program under `BPF_PROG_TEST_RUN`, marked in its `__sk_buff` control
//! block (`cb`) so that the program writes no state and leaves what it
//! decided in `cb` for the agent to read back (`ctx_out`).
//!
//! - `cb[0]`, `cb[1]`: [`MAGIC`], set by the agent. A 64-bit value no
//!   other tc program has a reason to leave there.
//! - `cb[2]`: the decision word ([`word`]): a [`Decided`] code, [`SNAT`],
//!   [`AFFINITY`]. Zero when the program decided nothing about a new flow
//!   (no frontend, or a tracked flow).
//! - `cb[3]`: the reverse-NAT id of the frontend the packet addressed.
//! - `cb[4]`: the backend id picked (with [`Decided::Translated`]).

/// `"expl"`, `"ain!"`.
pub const MAGIC: [u32; 2] = [0x6578_706c, 0x6169_6e21];
pub const CB_WORD: usize = 2;
pub const CB_REV_NAT: usize = 3;
pub const CB_BACKEND: usize = 4;

/// What the program decided about a new flow to a frontend.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decided {
    /// Translated to a backend (the conntrack entries are not written).
    Translated = 1,
    /// Dropped: the source is outside loadBalancerSourceRanges.
    SourceOutsideRanges = 2,
    /// Dropped: policy Local and no endpoint on this node.
    NoLocalEndpoint = 3,
    /// Refused (TCP reset, ICMP unreachable): no endpoint.
    Refused = 4,
}

/// The flow is masqueraded (SNAT to the node's address).
pub const SNAT: u32 = 1 << 8;
/// The backend is the client's remembered one (sessionAffinity).
pub const AFFINITY: u32 = 1 << 9;
/// The backend came from the frontend's Maglev table (the entry is
/// `maglev::entry` of the packet's `maglev::flow_hash`).
pub const MAGLEV: u32 = 1 << 10;
/// The flow goes to a backend on another node by direct server return (an
/// IPv4 option carries the service there; the client's address is kept).
pub const DSR: u32 = 1 << 11;
const CODE: u32 = 0xff;

/// The decision word the program writes into `cb[2]`.
#[inline(always)]
pub const fn word(decided: Decided, flags: u32) -> u32 {
    decided as u32 | flags
}

/// The decision of a word, and its flags; `None` for zero (nothing
/// decided) or an unknown code.
pub fn decode(word: u32) -> Option<(Decided, u32)> {
    let decided = match word & CODE {
        1 => Decided::Translated,
        2 => Decided::SourceOutsideRanges,
        3 => Decided::NoLocalEndpoint,
        4 => Decided::Refused,
        _ => return None,
    };
    Some((decided, word & !CODE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_decode_to_what_was_written() {
        for decided in [
            Decided::Translated,
            Decided::SourceOutsideRanges,
            Decided::NoLocalEndpoint,
            Decided::Refused,
        ] {
            for flags in [0, SNAT, AFFINITY, SNAT | AFFINITY, MAGLEV, SNAT | MAGLEV, DSR | MAGLEV] {
                assert_eq!(decode(word(decided, flags)), Some((decided, flags)));
            }
        }
        assert_eq!(decode(0), None);
        assert_eq!(decode(SNAT), None);
    }
}
