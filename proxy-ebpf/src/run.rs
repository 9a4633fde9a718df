//! Whether a packet is real or an explain run's (`explain`): a crafted
//! packet the agent runs through the program under `BPF_PROG_TEST_RUN`,
//! marked in `cb`, takes the real path but writes no state. Its own module,
//! below `lb` and `conntrack`, which only ask it; `explain` notes the
//! decisions.

use proxy_common::explain::MAGIC;

use crate::frame::Frame;

/// Whether a packet is real or an explain run's.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Run {
    Real,
    Explain,
}

impl Run {
    #[inline(always)]
    pub fn of(ctx: &impl Frame) -> Run {
        let Some(cb) = ctx.cb() else { return Run::Real };
        // SAFETY: the context's own fields.
        let cb = unsafe { &*cb };
        if cb[0] == MAGIC[0] && cb[1] == MAGIC[1] { Run::Explain } else { Run::Real }
    }
}
