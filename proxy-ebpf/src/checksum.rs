//! Ones'-complement checksums: the differences that update a checksum in
//! place (`packet`'s rewrites, XDP's stand-ins for tc's csum helpers in
//! `frame`), and plain sums for the packets we build (RST, ICMP).

/// Adds to `sum` the ones'-complement difference that turns a sum over
/// `old` into one over `new` (both as in memory, of one even length),
/// unfolded.
#[inline(always)]
pub fn csum_diff_add(mut sum: u32, old: &[u8], new: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < old.len() && i + 1 < new.len() {
        sum += !u16::from_ne_bytes([old[i], old[i + 1]]) as u32;
        sum += u16::from_ne_bytes([new[i], new[i + 1]]) as u32;
        i += 2;
    }
    sum
}

/// `sum` folded to 16 bits: what the csum helpers take as a precomputed
/// difference (header field size 0).
#[inline(always)]
pub fn fold_diff(mut sum: u32) -> u32 {
    sum = (sum & 0xffff) + (sum >> 16);
    (sum & 0xffff) + (sum >> 16)
}

/// The folded difference from `old` to `new`.
#[inline(always)]
pub fn csum_diff<const N: usize>(old: [u8; N], new: [u8; N]) -> u32 {
    fold_diff(csum_diff_add(0, &old, &new))
}

/// The checksum `check` (as in memory) of a header whose covered words
/// changed by the folded difference `diff` (RFC 1624, eqn. 3).
#[inline(always)]
pub fn csum_replaced(check: u16, diff: u32) -> u16 {
    !(fold_diff(diff + !check as u32) as u16)
}

/// The bytes of a header struct (`repr(C)`, no padding), to checksum it.
#[inline(always)]
pub fn bytes<T>(header: &T) -> &[u8] {
    // SAFETY: the headers are plain byte arrays and bytes, without padding.
    unsafe { core::slice::from_raw_parts((header as *const T).cast(), size_of::<T>()) }
}

/// Ones'-complement sum of `bytes` (big-endian 16-bit words) added to `sum`.
#[inline(always)]
pub fn csum_add(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    if i < bytes.len() {
        sum += (bytes[i] as u32) << 8;
    }
    sum
}

/// Folds a ones'-complement sum into the checksum field value.
#[inline(always)]
pub fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}
