//! The agent's life, one phase after another:
//!
//! ```text
//! Reading ──source read whole──► SourceWhole ──a sync succeeds──► SyncedWhole
//!                                                                     │ takes over
//!                        Serving { leftovers: false } ◄── the other ── Serving { leftovers: true }
//!                                                     mode removed
//! ```
//!
//! A phase never goes back: a source read whole once is whole (a relist
//! keeps the last complete list), and a serving datapath keeps serving.

/// Where the agent is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not every object of the source has been read yet.
    Reading,
    /// The source was read whole; the datapath does not hold it yet.
    SourceWhole,
    /// A sync of the whole source succeeded: the datapath may take over.
    SyncedWhole,
    /// The datapath serves (programs attached, rules applied); the other
    /// mode's datapath may still be there (`leftovers`).
    Serving { leftovers: bool },
}

impl Phase {
    /// The source has been read whole once.
    pub fn source_whole(self) -> bool {
        self != Phase::Reading
    }

    /// The datapath has held the whole source.
    pub fn synced_whole(self) -> bool {
        matches!(self, Phase::SyncedWhole | Phase::Serving { .. })
    }

    pub fn serving(self) -> bool {
        matches!(self, Phase::Serving { .. })
    }

    /// The phase after `event`, if it moves the agent on.
    pub fn after(self, event: Event) -> Option<Phase> {
        match (self, event) {
            (Phase::Reading, Event::SourceWhole) => Some(Phase::SourceWhole),
            (Phase::SourceWhole, Event::Synced) => Some(Phase::SyncedWhole),
            (Phase::SyncedWhole, Event::TookOver { leftovers }) => {
                Some(Phase::Serving { leftovers })
            }
            (Phase::Serving { leftovers: true }, Event::OtherModeRemoved) => {
                Some(Phase::Serving { leftovers: false })
            }
            _ => None,
        }
    }
}

/// Whether a source with files that do not parse is taken as it stands
/// (the services of those files left out): once every file was read
/// (`settled`), at once when no previous datapath serves here (waiting
/// would serve nothing better); else once `waited` reaches `grace` (the
/// previous datapath serves those services meanwhile, and an operator may
/// mend the files), also when a file never stops changing. Never later.
pub fn take_partial(
    previous_datapath: bool,
    settled: bool,
    waited: std::time::Duration,
    grace: std::time::Duration,
) -> bool {
    (settled && !previous_datapath) || waited >= grace
}

/// What moves the agent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A reload found every object of the source.
    SourceWhole,
    /// A sync succeeded.
    Synced,
    /// The datapath took over; what the other mode left may still be there.
    TookOver { leftovers: bool },
    /// What the other mode left is gone.
    OtherModeRemoved,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_follow_one_another_and_never_go_back() {
        let mut phase = Phase::Reading;
        // A sync of a partial source (eBPF maps are private) moves nothing.
        assert_eq!(phase.after(Event::Synced), None);
        assert_eq!(phase.after(Event::TookOver { leftovers: false }), None);
        for (event, next) in [
            (Event::SourceWhole, Phase::SourceWhole),
            (Event::Synced, Phase::SyncedWhole),
            (Event::TookOver { leftovers: true }, Phase::Serving { leftovers: true }),
            (Event::OtherModeRemoved, Phase::Serving { leftovers: false }),
        ] {
            phase = phase.after(event).unwrap_or_else(|| panic!("{phase:?} after {event:?}"));
            assert_eq!(phase, next);
        }
        let took_over = Event::TookOver { leftovers: true };
        for event in [Event::SourceWhole, Event::Synced, took_over, Event::OtherModeRemoved] {
            assert_eq!(phase.after(event), None, "{event:?} once serving");
        }
        assert!(phase.source_whole() && phase.synced_whole() && phase.serving());
        assert!(!Phase::SourceWhole.synced_whole() && Phase::SyncedWhole.synced_whole());
    }

    #[test]
    fn unreadable_files_hold_a_takeover_for_the_grace_only() {
        use std::time::Duration;
        let grace = Duration::from_secs(5);
        let (early, late) = (Duration::from_secs(4), grace);
        assert!(
            take_partial(false, true, Duration::ZERO, grace),
            "nothing serves: serve what reads"
        );
        assert!(!take_partial(true, true, early, grace), "the previous one serves");
        assert!(take_partial(true, true, late, grace), "bounded");
        assert!(!take_partial(false, false, early, grace), "a file being written is waited for");
        assert!(take_partial(false, false, late, grace), "a file never settling too, bounded");
    }
}
