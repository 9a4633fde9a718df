//! When a change is taken at once and when the loop waits for those that
//! follow (a burst of API server events goes in few syncs).

use std::time::{Duration, Instant};

/// API server changes are taken as they come (with whatever else arrived
/// meanwhile), up to this many in `BURST_WINDOW`...
const BURST_TAKES: usize = 20;
const BURST_WINDOW: Duration = Duration::from_millis(100);
/// ...beyond that, in a burst, the events that follow within this much of
/// each other are taken together...
const QUIET: Duration = Duration::from_millis(3);
/// ...up to this long after the first.
const MAX_COALESCE: Duration = Duration::from_millis(250);

/// When to take a change at once and when to wait for more: at most
/// `BURST_TAKES` changes go at once in any `BURST_WINDOW`.
#[derive(Debug, Default)]
pub(super) struct Pace {
    taken: std::collections::VecDeque<Instant>,
}

impl Pace {
    /// Whether a change arriving at `now` should wait for those following.
    pub(super) fn coalesce(&mut self, now: Instant) -> bool {
        while self.taken.front().is_some_and(|t| now.duration_since(*t) >= BURST_WINDOW) {
            self.taken.pop_front();
        }
        if self.taken.len() >= BURST_TAKES {
            return true;
        }
        self.taken.push_back(now);
        false
    }
}

/// Waits for the source's next change (forever without a notifier).
pub(super) async fn changed(notify: Option<&tokio::sync::Notify>) {
    match notify {
        Some(notify) => notify.notified().await,
        None => std::future::pending().await,
    }
}

/// Waits until the events stop coming for `QUIET`, or `MAX_COALESCE`.
pub(super) async fn coalesce(notify: Option<&tokio::sync::Notify>) {
    let deadline = tokio::time::Instant::now() + MAX_COALESCE;
    loop {
        tokio::select! {
            _ = changed(notify) => {}
            _ = tokio::time::sleep(QUIET) => return,
            _ = tokio::time::sleep_until(deadline) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_go_at_once_until_a_burst_then_wait() {
        let mut pace = Pace::default();
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        assert!((0..BURST_TAKES as u64).all(|i| !pace.coalesce(at(i))));
        assert!(pace.coalesce(at(50)), "the 21st within 100 ms waits");
        assert!(!pace.coalesce(at(100)), "the first has left the window");
        assert!(pace.coalesce(at(100)), "and only the first");
        assert!(!pace.coalesce(at(300)));
    }
}
