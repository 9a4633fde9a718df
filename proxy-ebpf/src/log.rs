//! Decision records ([`proxy_common::record`]) into `RECORDS`, written
//! only when the level the agent keeps in `CONFIG` asks for them: while
//! records are off, a record site costs one compare. A record is a
//! fixed-size struct the agent puts into words, so a site costs the
//! verifier a few dozen instructions (text formatted here, with aya-log,
//! cost about 17,000 at each). The agent rewrites the level at run time,
//! without a reload. The per-packet records are written by functions of
//! their own (BPF calls), so the packet path keeps its registers and stack
//! as without them.

use aya_ebpf::{btf_maps::RingBuf, macros::btf_map};
use proxy_common::{
    Counter, CtTuple, FragKey, ServiceFlags, log_level,
    record::{Among, Kind, Outcome, Program, RECORDS_BYTES, Record, Via},
};

use crate::{
    maps::count,
    monitor::{EventAddr, put_tuple},
};

#[btf_map]
pub static RECORDS: RingBuf<Record, { RECORDS_BYTES as usize }> = RingBuf::new();

/// A tuple of either family, whose records the agent can print.
pub trait Printable: CtTuple<Addr: EventAddr> {}
impl<T: CtTuple<Addr: EventAddr>> Printable for T {}

/// The fields of a record besides its tuple.
struct Fields<A> {
    program: Program,
    level: u8,
    kind: Kind,
    detail: u8,
    among: u8,
    to: (A, u16),
    id: u32,
}

impl<A: EventAddr> Fields<A> {
    #[inline(always)]
    fn new(program: Program, level: u8, kind: Kind) -> Self {
        Fields { program, level, kind, detail: 0, among: 0, to: (A::default(), 0), id: 0 }
    }
}

/// Writes a record of `t` into the ring buffer; one that finds it full is
/// counted instead.
#[inline(always)]
fn write<T: Printable>(t: &T, f: Fields<T::Addr>) {
    let Some(mut entry) = RECORDS.reserve(0) else {
        count(Counter::RecordLost);
        return;
    };
    let r = entry.as_mut_ptr();
    // SAFETY: `r` points at the reserved record; every field is written.
    unsafe {
        put_tuple(&mut (*r).tuple, t);
        f.to.0.put(&mut (*r).to);
        (*r).to_port = f.to.1;
        (*r).program = f.program as u8;
        (*r).level = f.level;
        (*r).kind = f.kind as u8;
        (*r).detail = f.detail;
        (*r).among = f.among;
        (*r).family = T::Addr::FAMILY;
        (*r).id = f.id;
    }
    // With a wake-up: the agent's reader waits on the ring's fd.
    entry.submit(0);
}

/// The program a per-packet record names.
#[inline(always)]
fn tc_program(ingress: bool) -> Program {
    if ingress { Program::TcIngress } else { Program::TcEgress }
}

/// A packet's tuple and what became of it, at `level` (the caller checked
/// it against the configured one).
#[inline(never)]
pub fn packet<T: Printable>(level: u8, ingress: bool, t: &T, outcome: Outcome) {
    let mut f = Fields::new(tc_program(ingress), level, Kind::Outcome);
    f.detail = outcome as u8;
    write(t, f);
}

/// A new flow's backend (`to`'s destination) and why (debug).
#[inline(never)]
pub fn new_flow<T: Printable>(t: &T, to: &T, via: Via, flags: ServiceFlags) {
    let mut f = Fields::new(Program::TcIngress, log_level::DEBUG, Kind::Backend);
    f.to = (to.daddr(), to.dport());
    (f.detail, f.among) = (via as u8, among(flags) as u8);
    write(t, f);
}

/// A new flow's SNAT (`to`'s source; debug).
#[inline(never)]
pub fn snat<T: Printable>(t: &T, to: &T) {
    let mut f = Fields::new(Program::TcIngress, log_level::DEBUG, Kind::Snat);
    f.to = (to.saddr(), to.sport());
    write(t, f);
}

/// A later fragment whose first did not come through here (debug).
#[inline(never)]
pub fn orphan_fragment(key: &FragKey) {
    let t = proxy_common::CtKey::new(key.saddr, key.daddr, 0, 0, key.proto);
    let mut f = Fields::new(Program::TcIngress, log_level::DEBUG, Kind::OrphanFragment);
    f.id = u32::from(key.id);
    write(&t, f);
}

/// A socket program's record about a call to `service`: `kind` one of
/// the kinds without a backend.
#[inline(always)]
pub fn socket<A: EventAddr>(program: Program, level: u8, kind: Kind, service: (A, u16), proto: u8) {
    let t = A::Tuple::new(A::default(), service.0, 0, service.1, proto);
    write(&t, Fields::new(program, level, kind));
}

/// A socket program's backend for a call to `service`, and why (debug).
#[inline(always)]
pub fn socket_backend<A: EventAddr>(
    program: Program,
    (service, proto): ((A, u16), u8),
    to: (A, u16),
    via: Via,
    flags: ServiceFlags,
) {
    let t = A::Tuple::new(A::default(), service.0, 0, service.1, proto);
    let mut f = Fields::new(program, log_level::DEBUG, Kind::Backend);
    (f.to, f.detail, f.among) = (to, via as u8, among(flags) as u8);
    write(&t, f);
}

/// A reply from `peer` whose service is gone: the peer's own address is
/// shown (debug).
#[inline(always)]
pub fn service_gone<A: EventAddr>(program: Program, peer: (A, u16), service: (A, u16)) {
    let t = A::Tuple::new(peer.0, service.0, peer.1, service.1, 0);
    write(&t, Fields::new(program, log_level::DEBUG, Kind::ServiceGone));
}

/// Among which endpoints a frontend with `flags` chooses.
#[inline(always)]
fn among(flags: ServiceFlags) -> Among {
    Among::of(flags.is_local_only(), flags.serves_terminating())
}
