//! SCTP, as the per-packet path sees it: the common header's checksum and
//! the chunk that tells an association's state.
//!
//! The checksum is CRC32c over the whole packet (RFC 9260 appendix A), its
//! own field counted as zero, with no pseudo-header: rewriting an address
//! leaves it right, rewriting a port does not. Summing the packet again
//! would cost a loop over every byte; the CRC is linear instead, so two
//! packets of one length that differ only in the ports differ in their
//! CRCs by the CRC (zero start, no final inversion) of the difference:
//! four bytes at the start followed by zeros, that is those four bytes
//! times x^(8·len) modulo the polynomial. Two multiplications in GF(2),
//! with x^(8·len) from two tables of 256 (`len` < 2^16): about 64 shifts,
//! whatever the packet's length.

use crate::ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

/// CRC32c's polynomial, bit-reflected (bit 31 is x^0).
const POLY: u32 = 0x82f6_3b78;
/// The polynomial 1 (x^0), reflected.
const ONE: u32 = 1 << 31;

/// The common header's fields: the ports where TCP and UDP have them, the
/// verification tag, the checksum; then the first chunk's type.
pub const CHECKSUM: usize = 8;
pub const HEADER_LEN: usize = 12;
pub const FIRST_CHUNK_TYPE: usize = HEADER_LEN;

/// a·b modulo the polynomial, both reflected: a's bits from x^0 on add b
/// times x^k, b multiplied by x at each step. Branch-free and of a fixed
/// count (the BPF verifier walks it once).
#[inline(always)]
pub const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut k = 0;
    while k < 32 {
        product ^= b & 0u32.wrapping_sub((a >> (31 - k)) & 1);
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        k += 1;
    }
    product
}

/// `x^(8·step·i)` for i in 0..256: `table(1)` and `table(256)` make any
/// `x^(8·len)` for `len` < 2^16 in one multiplication.
const fn powers(step: u32) -> [u32; 256] {
    // x^(8·step), by squaring x^8 (x^8 is bit 31 - 8).
    let mut base = 1 << (31 - 8);
    let mut s = step;
    while s > 1 {
        base = multiply(base, base);
        s /= 2;
    }
    let mut table = [0; 256];
    let mut power = ONE;
    let mut i = 0;
    while i < 256 {
        table[i] = power;
        power = multiply(power, base);
        i += 1;
    }
    table
}

static LOW: [u32; 256] = powers(1);
static HIGH: [u32; 256] = powers(256);

/// x^(8·len) modulo the polynomial: `len` zero bytes' effect on a CRC.
#[inline(always)]
fn zero_bytes(len: u16) -> u32 {
    multiply(HIGH[(len >> 8) as usize], LOW[(len & 0xff) as usize])
}

/// The checksum field (as it lies in the packet) of an SCTP packet of
/// `len` bytes (common header included) whose first four bytes, the
/// ports, went from `old` to `new`, given the field `checksum` it had.
#[inline(always)]
pub fn checksum_after_ports(checksum: [u8; 4], old: [u8; 4], new: [u8; 4], len: u16) -> [u8; 4] {
    // The difference's four bytes enter a zeroed register as they would
    // any CRC's (least significant first), then the rest of the packet's
    // length in zeros follows: the register times x^(8·len) in all.
    let diff = u32::from_le_bytes(old) ^ u32::from_le_bytes(new);
    let change = multiply(diff, zero_bytes(len));
    (u32::from_le_bytes(checksum) ^ change).to_le_bytes()
}

/// CRC32c of `bytes`, bit by bit: the reference the tests and the crafted
/// packets use (the datapath never sums a packet).
pub const fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    let mut i = 0;
    while i < bytes.len() {
        crc ^= bytes[i] as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = (crc >> 1) ^ (POLY & 0u32.wrapping_sub(crc & 1));
            bit += 1;
        }
        i += 1;
    }
    !crc
}

/// Chunk types conntrack follows (RFC 9260 §3.2).
pub const INIT: u8 = 1;
pub const INIT_ACK: u8 = 2;
pub const ABORT: u8 = 6;
pub const SHUTDOWN: u8 = 7;
pub const SHUTDOWN_ACK: u8 = 8;
pub const SHUTDOWN_COMPLETE: u8 = 14;

/// The TCP flags (`ct`) a packet whose first chunk is `chunk` stands for,
/// so that an association walks TCP's states: INIT opens as a SYN, INIT
/// ACK answers as a SYN-ACK, anything else of an association is an ACK
/// (COOKIE ECHO, DATA, SACK, HEARTBEAT: it is established once answered),
/// SHUTDOWN and SHUTDOWN ACK are each side's FIN, ABORT and SHUTDOWN
/// COMPLETE close it as an RST does. Only the first chunk is read: INIT,
/// INIT ACK and SHUTDOWN COMPLETE travel alone (RFC 9260 §6.10), and an
/// ABORT bundled after data is seen by its lifetime's end. A table read,
/// not a branch per type: the verifier would walk the rest of the program
/// once per value it knew.
#[inline(always)]
pub fn ct_flags(chunk: u8) -> u8 {
    CT_FLAGS[chunk as usize]
}

static CT_FLAGS: [u8; 256] = {
    let mut table = [TCP_ACK; 256];
    table[INIT as usize] = TCP_SYN;
    table[INIT_ACK as usize] = TCP_SYN | TCP_ACK;
    table[ABORT as usize] = TCP_RST;
    table[SHUTDOWN_COMPLETE as usize] = TCP_RST;
    table[SHUTDOWN as usize] = TCP_FIN | TCP_ACK;
    table[SHUTDOWN_ACK as usize] = TCP_FIN | TCP_ACK;
    table
};

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// An SCTP packet: ports, a verification tag, the checksum set, `rest`.
    fn packet(sport: u16, dport: u16, rest: &[u8]) -> Vec<u8> {
        let mut p = [sport.to_be_bytes(), dport.to_be_bytes()].concat();
        p.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0]);
        p.extend_from_slice(rest);
        let sum = crc32c(&p);
        p[CHECKSUM..CHECKSUM + 4].copy_from_slice(&sum.to_le_bytes());
        p
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn multiplying_by_x_to_the_8_is_a_zero_byte() {
        // A CRC register followed by a zero byte: eight shifts.
        let mut shifted = 0x1234_5678u32;
        for _ in 0..8 {
            shifted = (shifted >> 1) ^ (POLY & 0u32.wrapping_sub(shifted & 1));
        }
        assert_eq!(multiply(0x1234_5678, 1 << 23), shifted);
        assert_eq!(multiply(ONE, 0xdead_beef), 0xdead_beef);
        assert_eq!(zero_bytes(0), ONE);
        assert_eq!(zero_bytes(1), 1 << 23);
        assert_eq!(zero_bytes(513), multiply(zero_bytes(512), zero_bytes(1)));
    }

    #[test]
    fn a_port_rewrite_updates_the_checksum_as_a_full_sum_would() {
        // Lengths around the tables' steps, and a jumbo one.
        for len in [16usize, 17, 255, 256, 257, 1452, 8952, 65_535] {
            let rest: Vec<u8> = (0..len - HEADER_LEN).map(|i| (i * 7 + 3) as u8).collect();
            let before = packet(40_000, 30_868, &rest);
            for (sport, dport) in [(40_000, 3869), (61_234, 30_868), (1, 65_535), (40_000, 30_868)]
            {
                let after = packet(sport, dport, &rest);
                let field = |p: &[u8]| p[CHECKSUM..CHECKSUM + 4].try_into().unwrap();
                let ports = |p: &[u8]| p[..4].try_into().unwrap();
                let updated =
                    checksum_after_ports(field(&before), ports(&before), ports(&after), len as u16);
                assert_eq!(updated, field(&after), "{len} bytes, to {sport} → {dport}");
            }
        }
    }

    #[test]
    fn associations_walk_tcps_states() {
        use crate::{ct::*, *};
        let cfg = crate::config::with_timeouts();
        let life = |flags| lifetime_secs(&cfg, IPPROTO_SCTP, flags);
        let (fwd, rev) = (0, CT_FLAG_REPLY);
        let f = next_flags(fwd, ct_flags(INIT));
        let r = next_flags(rev | (f & CT_STATE_FLAGS), ct_flags(INIT_ACK));
        // COOKIE ECHO once answered: established.
        let f = next_flags(fwd | (r & CT_STATE_FLAGS), ct_flags(10));
        assert_eq!(life(f), 86_400);
        // SHUTDOWN, SHUTDOWN ACK: closed; a new INIT restarts the flow.
        let f = next_flags(f, ct_flags(SHUTDOWN));
        let r = next_flags(rev | (f & CT_STATE_FLAGS), ct_flags(SHUTDOWN_ACK));
        assert_eq!(life(r), 120);
        assert_eq!(on_closed(fwd | (r & CT_STATE_FLAGS), ct_flags(INIT)), Closed::Restarts);
        // ABORT closes at once.
        assert_eq!(life(next_flags(CT_FLAG_ESTABLISHED, ct_flags(ABORT))), 120);
    }
}
