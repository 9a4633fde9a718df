//! Decision records (aya-log), read by the agent into its own log. A
//! record is written only when the level the agent keeps in `CONFIG` lets
//! it: while logging is off, a log point costs one compare and no ring
//! buffer write. The agent rewrites the level at run time, without a reload.

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

use proxy_common::ServiceValue;

use crate::lb::Via;

/// Why a backend was chosen, in words: how, and among which endpoints.
#[inline(always)]
pub fn why(via: Via, svc: &ServiceValue) -> (&'static str, &'static str) {
    let how = match via {
        Via::Affinity => "session affinity",
        Via::Random => "random pick",
        Via::Flow => "the socket's UDP flow",
    };
    let among = match (svc.flags.is_local_only(), svc.flags.serves_terminating()) {
        (false, false) => "all endpoints",
        (true, false) => "local endpoints only",
        (false, true) => "terminating endpoints (none ready)",
        (true, true) => "local terminating endpoints (none ready)",
    };
    (how, among)
}
