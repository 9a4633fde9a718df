//! A new flow's drop or refusal, told the same way wherever it is decided
//! (in the manner of Cilium's `send_drop_notify`): the global counter of
//! drops, the frontend's counters (`stats`), a decision record at info
//! (`log`) and a monitor event (`monitor`). One function, so no place
//! forgets one of them. Inlined: each place's code stays the calls it
//! made, and its verdict, known there, folds the choice away (no branch
//! more for the verifier to walk).

use proxy_common::{Config, Counter, DropReason, record::Outcome};

use crate::{maps::count, monitor::What, stats::Event};

/// What a new flow got instead of a backend.
#[derive(Clone, Copy)]
pub enum Denied {
    Dropped(Outcome),
    /// Its frontend has no endpoint.
    Refused,
}

/// Where a flow is denied: how that hook counts, records and tells of it.
pub trait Site {
    /// The frontend counters' event of a refusal there.
    const REFUSED: Event;
    /// Counts `event` for the frontend `rev_nat_id`.
    fn stat(&self, rev_nat_id: u32, event: Event);
    /// The decision record of `outcome`, if the configured level takes it.
    fn record(&self, cfg: &Config, outcome: Outcome);
    /// The monitor event, if a monitor runs.
    fn event(&self, what: What);
}

/// Reports a flow to the frontend `rev_nat_id` denied at `site`.
#[inline(always)]
pub fn denied<S: Site>(site: &S, cfg: &Config, rev_nat_id: u32, denied: Denied) {
    let (event, outcome, what) = match denied {
        Denied::Dropped(outcome) => {
            count(Counter::Dropped);
            (Event::dropped(drop_reason(outcome)), outcome, What::Dropped(outcome))
        }
        Denied::Refused => (S::REFUSED, Outcome::NoEndpoint, What::Refused),
    };
    site.stat(rev_nat_id, event);
    site.record(cfg, outcome);
    site.event(what);
}

/// The drop reason a dropping outcome is counted under.
#[inline(always)]
fn drop_reason(outcome: Outcome) -> DropReason {
    match outcome {
        Outcome::SourceOutsideRanges => DropReason::SourceOutsideRanges,
        Outcome::NoLocalEndpoint => DropReason::NoLocalEndpoint,
        Outcome::NoSnatPort => DropReason::NoSnatPort,
        Outcome::ConntrackFull => DropReason::ConntrackFull,
        _ => DropReason::RewriteFailed,
    }
}
