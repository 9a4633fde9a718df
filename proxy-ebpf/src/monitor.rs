//! Events for `proxy-agent monitor` (`proxy_common::monitor`): written at
//! the decision points only (new flows, drops, refusals, socket-LB
//! translations), and only while a monitor keeps `MONITOR`'s deadline
//! ahead of the clock. Off, a decision point costs an array lookup and a
//! compare. The event is written in place in the ring buffer by a function
//! of its own (a BPF call), so the packet path's frame stays as it was.

use aya_ebpf::{
    bindings::BPF_RB_NO_WAKEUP,
    btf_maps::{Array, PerCpuArray, RingBuf},
    helpers::bpf_ktime_get_ns,
    macros::btf_map,
};
use proxy_common::{
    CtKey, CtKey6, CtTuple,
    monitor::{EVENTS_BYTES, EventTuple, MonitorEvent, reason, verdict},
    record::Outcome,
};

use crate::frame::Frame;

#[btf_map]
pub static EVENTS: RingBuf<MonitorEvent, { EVENTS_BYTES as usize }> = RingBuf::new();

/// The deadline (ktime ns) until which events are written: 0, or past,
/// while no monitor runs. Its own map: the agent rewrites `CONFIG`.
#[btf_map]
pub static MONITOR: Array<u64, 1> = Array::new();

/// Events lost to a full ring buffer, per CPU.
#[btf_map]
pub static MONITOR_LOST: PerCpuArray<u64, 1> = PerCpuArray::new();

/// What the event says of the packet or call.
#[derive(Clone, Copy)]
pub enum What {
    /// A new flow to the frontend `rev_nat_id`, translated.
    Translated(u32),
    Dropped(Outcome),
    Refused,
}

/// An address as an event holds it (16 bytes, IPv4 in the first 4), and
/// the tuple type of its family.
pub trait EventAddr: Copy + Default {
    type Tuple: CtTuple<Addr = Self>;
    const FAMILY: u8;
    fn put(self, out: &mut [u8; 16]);
}

impl EventAddr for [u8; 4] {
    type Tuple = CtKey;
    const FAMILY: u8 = 4;

    #[inline(always)]
    fn put(self, out: &mut [u8; 16]) {
        *out = [0; 16];
        out[..4].copy_from_slice(&self);
    }
}

impl EventAddr for [u8; 16] {
    type Tuple = CtKey6;
    const FAMILY: u8 = 6;

    #[inline(always)]
    fn put(self, out: &mut [u8; 16]) {
        *out = self;
    }
}

/// Whether a monitor runs: its deadline is ahead. No clock read while
/// none ever ran.
#[inline(always)]
fn on() -> bool {
    match MONITOR.get(0) {
        Some(&deadline) if deadline != 0 => deadline > unsafe { bpf_ktime_get_ns() },
        _ => false,
    }
}

/// A per-packet decision (tc ingress, XDP) about the packet `before`
/// (`after`: its translation; else `before` again).
#[inline(always)]
pub fn packet<C: Frame, T: CtTuple<Addr: EventAddr>>(ctx: &C, before: &T, after: &T, what: What) {
    if on() {
        write(before, after, &Meta::new(C::HOOK, ctx.ifindex(), what));
    }
}

/// A socket hook's decision about a call to `service` (`to`: the backend
/// it was translated to; else the service again). `hook` names the hook
/// (`proxy_common::monitor::hook`), asked only while a monitor runs.
#[inline(always)]
pub fn socket<A: EventAddr>(
    hook: impl FnOnce() -> u8,
    service: (A, u16),
    to: (A, u16),
    proto: u8,
    what: What,
) {
    if !on() {
        return;
    }
    let hook = hook();
    let before = A::Tuple::new(A::default(), service.0, 0, service.1, proto);
    let after = A::Tuple::new(A::default(), to.0, 0, to.1, proto);
    write(&before, &after, &Meta::new(hook, 0, what));
}

/// An event's fields besides its tuples.
struct Meta {
    hook: u8,
    verdict: u8,
    reason: u8,
    rev_nat_id: u32,
    ifindex: u32,
}

impl Meta {
    #[inline(always)]
    fn new(hook: u8, ifindex: u32, what: What) -> Self {
        let (verdict, reason, rev_nat_id) = match what {
            What::Translated(id) => (verdict::TRANSLATED, reason::NONE, id),
            What::Dropped(outcome) => (verdict::DROPPED, reason_of(outcome), 0),
            What::Refused => (verdict::REFUSED, reason::NO_ENDPOINT, 0),
        };
        Meta { hook, verdict, reason, rev_nat_id, ifindex }
    }
}

#[inline(always)]
fn reason_of(outcome: Outcome) -> u8 {
    match outcome {
        Outcome::SourceOutsideRanges => reason::SOURCE_OUTSIDE_RANGES,
        Outcome::NoLocalEndpoint => reason::NO_LOCAL_ENDPOINT,
        Outcome::NoEndpoint => reason::NO_ENDPOINT,
        Outcome::NoSnatPort => reason::NO_SNAT_PORT,
        Outcome::ConntrackFull => reason::CONNTRACK_FULL,
        _ => reason::NONE,
    }
}

/// Writes one event in place in the ring buffer, or counts it lost. No
/// reader is woken (`monitor` polls): a wakeup costs the packet some
/// microseconds (an IPI), ten times the event itself.
#[inline(never)]
fn write<T: CtTuple<Addr: EventAddr>>(before: &T, after: &T, meta: &Meta) {
    let Some(mut entry) = EVENTS.reserve(0) else {
        if let Some(lost) = MONITOR_LOST.get_ptr_mut(0) {
            // SAFETY: this CPU's slot; programs are not preempted here.
            unsafe { *lost += 1 };
        }
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: `e` points at the reserved event; every field is written.
    unsafe {
        (*e).ts_ns = bpf_ktime_get_ns();
        (*e).ifindex = meta.ifindex;
        (*e).rev_nat_id = meta.rev_nat_id;
        put_tuple(&mut (*e).before, before);
        put_tuple(&mut (*e).after, after);
        (*e).hook = meta.hook;
        (*e).family = T::Addr::FAMILY;
        (*e).verdict = meta.verdict;
        (*e).reason = meta.reason;
        (*e)._pad = [0; 4];
    }
    entry.submit(BPF_RB_NO_WAKEUP as u64);
}

/// Writes `t` into `out`, in a reserved event or record.
#[inline(always)]
pub fn put_tuple<T: CtTuple<Addr: EventAddr>>(out: &mut EventTuple, t: &T) {
    t.saddr().put(&mut out.saddr);
    t.daddr().put(&mut out.daddr);
    out.sport = t.sport();
    out.dport = t.dport();
    out.proto = t.proto();
    // Byte by byte: three zero bytes at an odd offset become a call to
    // `memset`, a BPF subprogram of its own, whose frame made `connect6`'s
    // call chain 544 bytes on 6.1's verifier.
    for byte in &mut out._pad {
        // SAFETY: a byte of the reserved event or record.
        unsafe { core::ptr::write_volatile(byte, 0) };
    }
}
