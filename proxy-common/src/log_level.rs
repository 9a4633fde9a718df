//! `Config::log_level`: the programs write their decision records
//! ([`crate::record`]) at this level and the ones above it; the numbers are
//! the `log` crate's levels (as aya-log's were).

/// No records: each log point costs a compare.
pub const OFF: u8 = 0;
/// Refusals and drops: no endpoint, a source outside the ranges, no SNAT port.
pub const INFO: u8 = 3;
/// Every new flow's service and backend, and packets a flow has lost.
pub const DEBUG: u8 = 4;
/// Also the packets that are no service's.
pub const TRACE: u8 = 5;
