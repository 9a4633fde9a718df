//! A packet as a per-packet program sees it: tc's skb or XDP's buffer. The
//! parsing and rewriting in `packet` are written once over [`Frame`]; tc
//! keeps the kernel's helpers (which know how the skb's checksum is kept),
//! XDP, which has no skb and sees frames as the wire delivered them (full
//! checksums), reads and writes in place with the same arithmetic.

use aya_ebpf::{
    EbpfContext,
    bindings::BPF_F_MARK_MANGLED_0,
    helpers::generated::bpf_csum_update,
    programs::{TcContext, XdpContext},
};

use proxy_common::monitor::hook;

use crate::checksum::{csum_diff, csum_replaced};

/// Where XDP reads and writes at most: past Ethernet, IPv6 and a TCP
/// header with options, with room.
const MAX_OFF: usize = 256;

/// The flags of `l3_csum_replace`/`l4_csum_replace` that say how large the
/// replaced field is (0: `to` is a precomputed difference).
const SIZE_MASK: u64 = 0xf;

/// What the parsing and rewriting of `packet` need of a program's packet.
pub trait Frame: EbpfContext {
    /// The hook, as monitor events name it (`proxy_common::monitor::hook`).
    const HOOK: u8;

    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// The frame's length in bytes.
    fn len(&self) -> u32;
    /// The interface it arrived on.
    fn ifindex(&self) -> u32;
    /// The `T` at `off`, wherever it lies.
    fn load<T>(&self, off: usize) -> Result<T, i64>;
    /// Writes `v` at `off` (`flags`: `bpf_skb_store_bytes`').
    fn store<T>(&self, off: usize, v: &T, flags: u64) -> Result<(), i64>;
    /// `bpf_l3_csum_replace`, as the helper takes it.
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> Result<(), i64>;
    /// `bpf_l4_csum_replace`, as the helper takes it.
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64>;
    /// Keeps a receive checksum covering a header that changed by `diff`
    /// right (`bpf_csum_update`; XDP's frames carry none).
    fn csum_update(&self, diff: u32);
    /// The skb's control buffer, where explain runs are marked and noted
    /// (`run`, `explain`); XDP's stand-in is its frame's metadata.
    fn cb(&self) -> Option<*mut [u32; 5]>;
}

impl Frame for TcContext {
    const HOOK: u8 = hook::TC_INGRESS;

    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the context's own field.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, i64> {
        TcContext::load(self, off)
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T, flags: u64) -> Result<(), i64> {
        TcContext::store(self, off, v, flags)
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> Result<(), i64> {
        TcContext::l3_csum_replace(self, off, from, to, size)
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64> {
        TcContext::l4_csum_replace(self, off, from, to, flags)
    }

    #[inline(always)]
    fn csum_update(&self, diff: u32) {
        // SAFETY: the program's own skb.
        unsafe { bpf_csum_update(self.skb.skb, diff) };
    }

    #[inline(always)]
    fn cb(&self) -> Option<*mut [u32; 5]> {
        // SAFETY: the context's own field, which tc programs may write.
        Some(unsafe { &raw mut (*self.skb.skb).cb })
    }
}

impl Frame for XdpContext {
    const HOOK: u8 = hook::XDP;

    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        (XdpContext::data_end(self) - XdpContext::data(self)) as u32
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        self.ingress_ifindex() as u32
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Result<T, i64> {
        let at = in_frame::<T>(self, off)?;
        // SAFETY: within the frame, as just checked; headers lie at any
        // offset.
        Ok(unsafe { core::ptr::read_unaligned(at as *const T) })
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T, _flags: u64) -> Result<(), i64> {
        let at = in_frame::<T>(self, off)?;
        // SAFETY: as in `load`; an XDP program may write its frame.
        unsafe { core::ptr::write_unaligned(at as *mut T, core::ptr::read(v)) };
        Ok(())
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> Result<(), i64> {
        let check: u16 = self.load(off)?;
        self.store(off, &csum_replaced(check, difference(from, to, size)), 0)
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64> {
        let check: u16 = self.load(off)?;
        let mangled_0 = flags & BPF_F_MARK_MANGLED_0 as u64 != 0;
        // A UDP checksum of zero means "none": it stays so.
        if mangled_0 && check == 0 {
            return Ok(());
        }
        let new = csum_replaced(check, difference(from, to, flags & SIZE_MASK));
        // One that comes out zero is sent as all ones.
        let new = if mangled_0 && new == 0 { 0xffff } else { new };
        self.store(off, &new, 0)
    }

    #[inline(always)]
    fn csum_update(&self, _diff: u32) {}

    /// An explain run's marker and notes lie in front of the frame, where
    /// the agent's test run puts them (a real frame's metadata is the
    /// handoff, which never holds the marker).
    #[inline(always)]
    fn cb(&self) -> Option<*mut [u32; 5]> {
        let meta = self.metadata();
        (meta + size_of::<[u32; 5]>() <= XdpContext::data(self)).then_some(meta as *mut [u32; 5])
    }
}

/// Where `size_of::<T>()` bytes at `off` start, if the frame holds them.
/// The offset is bounded first: one read back from a map (IPv6's, kept in
/// `FLOW6`) is unbounded to the verifier, which refuses it beside a
/// packet pointer.
#[inline(always)]
fn in_frame<T>(ctx: &XdpContext, off: usize) -> Result<usize, i64> {
    if off >= MAX_OFF {
        return Err(-1);
    }
    let at = ctx.data() + off;
    if at + size_of::<T>() > ctx.data_end() { Err(-1) } else { Ok(at) }
}

/// The folded difference a csum helper's `from`/`to` of `size` bytes (as
/// in memory) stand for; size 0: `to` is one.
#[inline(always)]
fn difference(from: u64, to: u64, size: u64) -> u32 {
    match size {
        2 => csum_diff((from as u16).to_ne_bytes(), (to as u16).to_ne_bytes()),
        4 => csum_diff((from as u32).to_ne_bytes(), (to as u32).to_ne_bytes()),
        _ => to as u32,
    }
}
