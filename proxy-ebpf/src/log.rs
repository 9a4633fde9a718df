//! Decision records (aya-log), read by the agent into its own log. A
//! record is written only when the level the agent keeps in `CONFIG` lets
//! it: while logging is off, a log point costs one compare and no ring
//! buffer write. The agent rewrites the level at run time, without a reload.
//! The per-packet records are written by functions of their own (BPF
//! calls), so the packet path keeps its registers and stack as without them.

/// `record!(cfg, ctx, "program", LEVEL, "format", args...)`, LEVEL one of
/// `proxy_common::log_level`'s INFO, DEBUG, TRACE.
macro_rules! record {
    ($cfg:expr, $ctx:expr, $program:expr, INFO, $($fmt:tt)+) => {
        if $cfg.log_level >= proxy_common::log_level::INFO {
            aya_log_ebpf::info!($ctx, target: $program, $($fmt)+)
        }
    };
    ($cfg:expr, $ctx:expr, $program:expr, DEBUG, $($fmt:tt)+) => {
        if $cfg.log_level >= proxy_common::log_level::DEBUG {
            aya_log_ebpf::debug!($ctx, target: $program, $($fmt)+)
        }
    };
    ($cfg:expr, $ctx:expr, $program:expr, TRACE, $($fmt:tt)+) => {
        if $cfg.log_level >= proxy_common::log_level::TRACE {
            aya_log_ebpf::trace!($ctx, target: $program, $($fmt)+)
        }
    };
}
pub(crate) use record;

use aya_log_ebpf::macro_support::{Argument, IpFormatter};
use proxy_common::{CtTuple, FragKey, ServiceFlags, log_level};

use crate::lb::Via;

/// What became of a packet, for [`packet`].
#[derive(Clone, Copy)]
#[repr(u8)]
pub enum Outcome {
    SourceOutsideRanges,
    NoLocalEndpoint,
    NoEndpoint,
    NoSnatPort,
    ConntrackFull,
    ReplyWithoutFlow,
    NoService,
    NoFlow,
}

impl Outcome {
    #[inline(always)]
    fn text(self) -> &'static str {
        match self {
            Outcome::SourceOutsideRanges => "source outside loadBalancerSourceRanges, dropped",
            Outcome::NoLocalEndpoint => "no local endpoint (policy Local), dropped",
            Outcome::NoEndpoint => "no endpoint, refused",
            Outcome::NoSnatPort => "no SNAT port free (or conntrack map full), dropped",
            Outcome::ConntrackFull => "conntrack map full, dropped",
            Outcome::ReplyWithoutFlow => "reply to a SNAT port without a conntrack entry, passed",
            Outcome::NoService => "no flow, no service",
            Outcome::NoFlow => "no flow",
        }
    }
}

/// The program a per-packet record names.
#[inline(always)]
fn tc_program(ingress: bool) -> &'static str {
    if ingress { "tc_ingress" } else { "tc_egress" }
}

// aya-log 0.2 does not read the context its macros take: the records need
// no `TcContext` passed along.

/// A tuple of either family whose addresses the records print.
pub trait Printable: CtTuple<Addr: Argument + IpFormatter> {}
impl<T: CtTuple<Addr: Argument + IpFormatter>> Printable for T {}

/// A packet's tuple and what became of it, at `level` (the caller checked
/// it against the configured one).
#[inline(never)]
pub fn packet<T: Printable>(level: u8, ingress: bool, t: &T, outcome: Outcome) {
    let (program, what) = (tc_program(ingress), outcome.text());
    let (saddr, sport, daddr, dport, proto) =
        (t.saddr(), t.sport(), t.daddr(), t.dport(), t.proto());
    match level {
        log_level::INFO => {
            aya_log_ebpf::info!((), target: program, "{:i}:{} -> {:i}:{} proto {}: {}", saddr, sport, daddr, dport, proto, what)
        }
        log_level::DEBUG => {
            aya_log_ebpf::debug!((), target: program, "{:i}:{} -> {:i}:{} proto {}: {}", saddr, sport, daddr, dport, proto, what)
        }
        _ => {
            aya_log_ebpf::trace!((), target: program, "{:i}:{} -> {:i}:{} proto {}: {}", saddr, sport, daddr, dport, proto, what)
        }
    }
}

/// A new flow's backend and why (debug). One record a function: each
/// record's frame is added to the packet path's by the verifier, which
/// allows 512 bytes in all (older kernels count it more strictly).
#[inline(never)]
pub fn new_flow<T: Printable>(t: &T, to: &T, via: Via, flags: ServiceFlags) {
    let (how, among) = why(via, flags);
    let (saddr, sport, daddr, dport, proto) =
        (t.saddr(), t.sport(), t.daddr(), t.dport(), t.proto());
    let (backend, port) = (to.daddr(), to.dport());
    aya_log_ebpf::debug!((), target: "tc_ingress", "{:i}:{} -> {:i}:{} proto {}: backend {:i}:{} by {} among {}", saddr, sport, daddr, dport, proto, backend, port, how, among);
}

/// A new flow's SNAT (debug).
#[inline(never)]
pub fn snat<T: Printable>(t: &T, to: &T) {
    let (saddr, sport, daddr, dport, proto) =
        (t.saddr(), t.sport(), t.daddr(), t.dport(), t.proto());
    let (node, port) = (to.saddr(), to.sport());
    aya_log_ebpf::debug!((), target: "tc_ingress", "{:i}:{} -> {:i}:{} proto {}: SNAT to {:i}:{}", saddr, sport, daddr, dport, proto, node, port);
}

/// A later fragment whose first did not come through here (debug).
#[inline(never)]
pub fn orphan_fragment(key: &FragKey) {
    aya_log_ebpf::debug!((), target: "tc_ingress", "{:i} -> {:i} proto {} id {}: a fragment whose first did not come through here, passed", key.saddr, key.daddr, key.proto, key.id);
}

/// Why a backend was chosen, in words: how, and among which endpoints.
#[inline(always)]
pub fn why(via: Via, flags: ServiceFlags) -> (&'static str, &'static str) {
    let how = match via {
        Via::Affinity => "session affinity",
        // One string whatever the algorithm (`lb list` says which): each
        // more the record can hold multiplies what older verifiers (6.1)
        // walk through its formatting.
        Via::Algorithm => "its algorithm (random or Maglev)",
        Via::Flow => "the socket's UDP flow",
    };
    let among = match (flags.is_local_only(), flags.serves_terminating()) {
        (false, false) => "all endpoints",
        (true, false) => "local endpoints only",
        (false, true) => "terminating endpoints (none ready)",
        (true, true) => "local terminating endpoints (none ready)",
    };
    (how, among)
}
