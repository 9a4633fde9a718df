//! What the XDP program tells tc of a packet it passes on, in the frame's
//! metadata (`bpf_xdp_adjust_meta`, which the skb keeps as `data_meta`), as
//! Cilium's XDP programs hand packets to their tc ones: what XDP did
//! already, so that tc does none of it twice (no second backend choice, no
//! second count).

use aya_ebpf::{
    helpers::generated::bpf_xdp_adjust_meta,
    programs::{TcContext, XdpContext},
};
use proxy_common::{CtKey, CtKey6};

use crate::lb::Translation;

/// Marks metadata as ours: another program's is not read as a handoff.
const MAGIC: u16 = 0x7870;

/// What tc is to do with the packet.
#[repr(u8)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Nothing was done: tc's path from the start.
    None,
    /// Translated, its flow tracked and counted: tc sends it on (the FIB
    /// lookup, the TTL, the redirect or the stack).
    Translated,
    /// A new flow decided (`decided`, translated to `to`) that tc makes and
    /// sends: one that leaves by direct server return, whose option XDP
    /// does not insert.
    Decided,
    /// A new flow to a frontend without endpoints (`decided.rev_nat_id`):
    /// tc refuses it (TCP RST, ICMP port unreachable), as without XDP.
    Refused,
    /// A tracked DSR flow's packet, counted and its flow refreshed, that
    /// carries or clamps the option: tc sends it on (XDP does not grow
    /// packets).
    Tracked,
}

const _: () = assert!(Kind::Translated as u8 == 1 && Kind::Decided as u8 == 2);
const _: () = assert!(Kind::Refused as u8 == 3 && Kind::Tracked as u8 == 4);

/// The metadata in front of a frame XDP passes on.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Handoff {
    magic: u16,
    /// A [`Kind`], kept as its byte: metadata is read as found.
    kind: u8,
    _pad: u8,
    pub decided: Translation,
    pub to: CtKey,
}

const SIZE: usize = size_of::<Handoff>();
// The kernel's bound on metadata, in its unit.
const _: () = assert!(SIZE <= 32 && SIZE.is_multiple_of(4));

/// Proof that a handoff was reserved in front of the frame. The writes
/// find it again from the context: a pointer to it would not survive the
/// XDP program's BPF calls (the verifier loses its type).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Reserved(());

/// Room for a handoff in front of the frame, said to be "nothing done"
/// until written; `None` where the driver keeps no metadata (the XDP
/// program then sends on only what needs no handoff). Made before any
/// decision: the packet pointers the verifier knows are lost with it.
#[inline(always)]
pub fn reserve(ctx: &XdpContext) -> Option<Reserved> {
    // A frame that comes with metadata is an explain run's (marked there,
    // its notes written there): nothing is handed on.
    if ctx.metadata() != ctx.data() {
        return None;
    }
    // SAFETY: the program's own context.
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(SIZE as i32)) } != 0 {
        return None;
    }
    let handoff = slot(ctx)?;
    // SAFETY: the metadata just made, within the frame's bounds.
    unsafe { handoff.write(Handoff::EMPTY) };
    Some(Reserved(()))
}

/// The reserved handoff, found from the context.
#[inline(always)]
fn slot(ctx: &XdpContext) -> Option<*mut Handoff> {
    let meta = ctx.metadata();
    (meta + SIZE <= ctx.data()).then_some(meta as *mut Handoff)
}

/// Hands tc a new flow decided, translated to `to`, to make and send.
#[inline(always)]
pub fn decided(ctx: &XdpContext, _: Reserved, decided: Translation, to: &CtKey) {
    let Some(handoff) = slot(ctx) else { return };
    // SAFETY: `reserve`'s metadata, within the frame's bounds.
    unsafe {
        (*handoff).kind = Kind::Decided as u8;
        (*handoff).decided = decided;
        (*handoff).to = *to;
    }
}

/// A family's tuple, as a decided new flow is handed on with it: IPv4's
/// fits the handoff, IPv6's does not (its DSR frontends' new flows are
/// left to tc before XDP decides them).
pub trait Handed {
    const HANDS_DECIDED: bool;
    fn hand_decided(&self, ctx: &XdpContext, reserved: Reserved, decided: Translation);
}

impl Handed for CtKey {
    const HANDS_DECIDED: bool = true;

    #[inline(always)]
    fn hand_decided(&self, ctx: &XdpContext, reserved: Reserved, decided: Translation) {
        self::decided(ctx, reserved, decided, self);
    }
}

impl Handed for CtKey6 {
    const HANDS_DECIDED: bool = false;

    #[inline(always)]
    fn hand_decided(&self, _: &XdpContext, _: Reserved, _: Translation) {}
}

/// Hands tc a new flow to refuse for the frontend `rev_nat_id`.
#[inline(always)]
pub fn refused(ctx: &XdpContext, _: Reserved, rev_nat_id: u32) {
    let Some(handoff) = slot(ctx) else { return };
    // SAFETY: as in `decided`.
    unsafe {
        (*handoff).kind = Kind::Refused as u8;
        (*handoff).decided.rev_nat_id = rev_nat_id;
    }
}

/// Hands tc a tracked packet, counted, to send on with its DSR option.
#[inline(always)]
pub fn tracked(ctx: &XdpContext, _: Reserved) {
    let Some(handoff) = slot(ctx) else { return };
    // SAFETY: as in `decided`.
    unsafe { (*handoff).kind = Kind::Tracked as u8 };
}

/// Hands tc a translated packet to send on.
#[inline(always)]
pub fn translated(ctx: &XdpContext, _: Reserved) {
    let Some(handoff) = slot(ctx) else { return };
    // SAFETY: as in `decided`.
    unsafe { (*handoff).kind = Kind::Translated as u8 };
}

/// The handoff in front of the packet, if the XDP program left one.
#[inline(always)]
pub fn take(ctx: &TcContext) -> Option<Handoff> {
    // SAFETY: the context's own fields.
    let (meta, data) = unsafe { ((*ctx.skb.skb).data_meta as usize, (*ctx.skb.skb).data as usize) };
    if meta + SIZE > data {
        return None;
    }
    // The header first, as plain bytes: metadata not ours (another
    // program's) is never read as a handoff's typed fields.
    // SAFETY: within the metadata, as just checked; bytes have any value.
    let [m0, m1, kind, _] = unsafe { *(meta as *const [u8; 4]) };
    if u16::from_ne_bytes([m0, m1]) != MAGIC || kind == Kind::None as u8 {
        return None;
    }
    if kind == Kind::Translated as u8 || kind == Kind::Tracked as u8 {
        // Nothing more to read (an earlier build's XDP left the rest
        // unwritten: its packets may meet this tc during a take-over).
        return Some(Handoff { kind, ..Handoff::EMPTY });
    }
    // SAFETY: within the metadata; ours, written in full by `reserve`.
    Some(unsafe { *(meta as *const Handoff) })
}

impl Handoff {
    /// "Nothing done", every field written: the fields of a handoff are
    /// read as typed (an enum, bools), so none may hold what the buffer
    /// held before (an invalid value there would be undefined behaviour,
    /// and `Option<Handoff>` keeps its `None` in such a field's unused
    /// values: tc would find no handoff on a packet XDP translated).
    const EMPTY: Handoff = Handoff {
        magic: MAGIC,
        kind: Kind::None as u8,
        _pad: 0,
        // SAFETY: all zeros is a valid Translation (frontend 0, no SNAT,
        // no DSR, `Via::Affinity`, no flags) and a valid tuple.
        decided: unsafe { core::mem::zeroed() },
        to: unsafe { core::mem::zeroed() },
    };

    #[inline(always)]
    pub fn kind(&self) -> Kind {
        match self.kind {
            1 => Kind::Translated,
            2 => Kind::Decided,
            3 => Kind::Refused,
            4 => Kind::Tracked,
            _ => Kind::None,
        }
    }
}
