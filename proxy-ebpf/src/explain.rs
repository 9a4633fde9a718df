//! Explain runs (`proxy_common::explain`): a crafted packet the agent runs
//! through the program under `BPF_PROG_TEST_RUN`, marked in `cb` (`run`).
//! Such a run takes the real path but writes no state (conntrack entries,
//! affinity, refreshes) and leaves its decision in `cb`, noted here. The
//! marker is read only where a new flow is decided or state would be
//! written.

use proxy_common::{
    ServiceFlags,
    explain::{AFFINITY, CB_BACKEND, CB_REV_NAT, CB_WORD, DSR, Decided, MAGLEV, SNAT, word},
};

use crate::{frame::Frame, lb::Via, run::Run};

/// The notes an explain run's packet leaves; a real packet's are none.
impl Run {
    /// Notes the frontend the packet addressed.
    #[inline(always)]
    pub fn frontend(self, ctx: &impl Frame, rev_nat_id: u32) {
        if self == Run::Explain {
            set(ctx, CB_REV_NAT, rev_nat_id);
        }
    }

    /// Notes a drop or refusal.
    #[inline(always)]
    pub fn refused(self, ctx: &impl Frame, decided: Decided) {
        if self == Run::Explain {
            set(ctx, CB_WORD, word(decided, 0));
        }
    }

    /// Notes a translation to `backend_id`, picked `via` by a frontend with
    /// `flags`.
    #[inline(always)]
    pub fn translated(
        self,
        ctx: &impl Frame,
        backend_id: u32,
        (snat, dsr): (bool, bool),
        via: Via,
        flags: ServiceFlags,
    ) {
        if self == Run::Explain {
            // By arithmetic: a test of `dsr` would split the verifier's
            // paths (see `tc_lb::dispatch`).
            let snat = (snat as u32 * SNAT) | (dsr as u32 * DSR);
            let how = match via {
                Via::Affinity => AFFINITY,
                Via::Algorithm if flags.uses_maglev() => MAGLEV,
                Via::Algorithm | Via::Flow => 0,
            };
            set(ctx, CB_WORD, word(Decided::Translated, snat | how));
            set(ctx, CB_BACKEND, backend_id);
        }
    }
}

#[inline(always)]
fn set(ctx: &impl Frame, index: usize, value: u32) {
    if let Some(cb) = ctx.cb() {
        // SAFETY: tc programs may write their context's `cb`.
        unsafe { (*cb)[index] = value };
    }
}
